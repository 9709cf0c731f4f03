"""The project's speed goals, evaluated on the rows of one run as PASS / FAIL / N/A lines.

GPU (device time = replayed CUDA graph; eager = loop, synchronised at the end; host = enqueue time):

* large lists (GPT-2-medium shapes, 4 x 256M), each of float32, bfloat16, float16, float64 and a bfloat16+float32
  mix: fused >= 0.95x ``torch.sum``'s read bandwidth in device time, and >= 0.9x in eager time;
* 10,000 x 1,024 float32: fused <= 20 us device time and <= 1 ms eager;
* host: the raw op costs <= 60 ns per tensor plus a fixed cost under 15 us (slope and intercept fitted over the
  list sizes measured: the count series and 10,000 x 1,024);
* the Python wrapper and ``grad_stats`` add at most 10% host time over the raw op on the 292 tensors of GPT-2.

CPU (wall time; the goals are set for 2 cores): float32/float64 >= 0.9x ``torch.sum`` of the same bytes on the
large lists, bfloat16/float16/mixed >= 0.8x; >= 1.3x ``_foreach_norm`` at every point; wrapper and ``grad_stats``
within 10% of the raw op on the 292 tensors of GPT-2.

Noise: every figure judged is a ratio (or a time) of medians; the same ratio is also taken in each interleaved
repetition. When those repetitions spread wider than the measured figure's distance from its goal, the run cannot
tell a pass from a fail: the goal is printed as ``[NOISY]``, "noisy, not judged", instead of a PASS/FAIL drawn
from noise (a busy machine). Spread = (max - min) / median of the repetitions, the highest and lowest tenth left
out once there are ten or more; margin = |figure - goal| / goal. The host-cost fit is judged without this check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TypeGuard

from .contenders import FOREACH, FUSED, GRAD_STATS, RAW_OP, SUM_CEILING
from .report import Row
from .workloads import LARGE_WORKLOADS

LARGE_DTYPES = ("float32", "bfloat16", "float16", "float64", "bfloat16+float32")
GPT2_TENSORS = 292


@dataclasses.dataclass
class Target:
    name: str
    passed: bool | None  # None: not measured in this run, or too noisy to judge (``noisy``)
    detail: str
    noisy: bool = False

    def line(self) -> str:
        status = "NOISY" if self.noisy else {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        return f"[{status}] {self.name}: {self.detail}"


def spread(reps: Sequence[float]) -> float | None:
    """How far the repetitions of one figure spread, relative to their median: (max - min) / median, over the
    middle 80% once there are ten or more (one stalled block then does not decide); None under two repetitions."""
    xs = sorted(x for x in reps if not math.isnan(x))
    if len(xs) < 2:
        return None
    cut = len(xs) // 10
    xs = xs[cut : len(xs) - cut]
    mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return (xs[-1] - xs[0]) / abs(mid) if mid else None


def too_noisy(value: float, bound: float, reps: Sequence[float] | None) -> tuple[bool, str]:
    """Whether the repetitions spread wider than ``value``'s margin from ``bound``, and a note saying by how much."""
    s = spread(reps or ())
    if s is None:
        return False, ""
    margin = abs(value - bound) / abs(bound)
    return s > margin, f"repeat spread {s:.1%} vs margin {margin:.1%}"


def _judged(name: str, value: float, bound: float, passed: bool, detail: str, reps: Sequence[float] | None
            ) -> Target:  # fmt: skip
    noisy, note = too_noisy(value, bound, reps)
    if noisy:
        return Target(name, None, f"{detail}; noisy, not judged ({note})", noisy=True)
    return Target(name, passed, detail)


def rep_ratios(num: Row | None, den: Row | None, attr: str) -> list[float]:
    """``num``'s time over ``den``'s in each repetition (``attr``: device_reps, eager_reps or host_reps)."""
    if num is None or den is None:
        return []
    return [a / b for a, b in zip(getattr(num, attr), getattr(den, attr)) if b > 0]


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and not math.isnan(x)


def _get(rows: Iterable[Row], contender: str, workload: str, dtype: str | None = None, n: int | None = None
         ) -> Row | None:  # fmt: skip
    for r in rows:
        if (r.contender, r.workload) == (contender, workload) and dtype in (None, r.dtype) and n in (None, r.n_tensors):
            return r
    return None


def _at_least(name: str, value: float | None, bound: float, detail: str, unit: str = "",
              reps: Sequence[float] | None = None) -> Target:  # fmt: skip
    if not _finite(value):
        return Target(name, None, f"not measured ({detail})" if detail else "not measured")
    return _judged(name, value, bound, value >= bound, f"{detail}{value:.3g}{unit} (need >= {bound:g}{unit})", reps)


def _at_most(name: str, value: float | None, bound: float, detail: str, unit: str = "",
             reps: Sequence[float] | None = None) -> Target:  # fmt: skip
    if not _finite(value):
        return Target(name, None, "not measured")
    return _judged(name, value, bound, value <= bound, f"{detail}{value:.3g}{unit} (need <= {bound:g}{unit})", reps)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys over xs (at least two distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def _host_fit(rows: Sequence[Row]) -> list[Target]:
    measured = [r for r in rows if r.contender == RAW_OP and r.workload in ("count", "small_many")]
    pts = sorted({(r.n_tensors, r.host_ms) for r in measured if _finite(r.host_ms)})
    per, fixed = "GPU host: raw op <= 60 ns per tensor", "GPU host: raw op fixed cost < 15 us"
    if len({n for n, _ in pts}) < 2:
        return [Target(per, None, "needs two or more list sizes (count, small_many)"), Target(fixed, None, "idem")]
    slope_ms, icpt_ms = fit_line([n for n, _ in pts], [h for _, h in pts])
    sizes = f"fit over {len(pts)} sizes, {pts[0][0]} to {pts[-1][0]} tensors: "
    return [_at_most(per, slope_ms * 1e6, 60.0, sizes, " ns"),
            Target(fixed, icpt_ms * 1e3 < 15.0, f"{sizes}{icpt_ms * 1e3:.3g} us (need < 15 us)")]  # fmt: skip


def _wrappers(rows: Sequence[Row], prefix: str, attr: str) -> list[Target]:
    raw = _get(rows, RAW_OP, "gpt2", "float32", GPT2_TENSORS)
    out = []
    for name in (FUSED, GRAD_STATS):
        label = f"{prefix}: {name} adds <= 10% over the raw op ({GPT2_TENSORS} tensors, {attr.split('_')[0]} time)"
        r = _get(rows, name, "gpt2", "float32", GPT2_TENSORS)
        a, b = (getattr(r, attr) if r else None), (getattr(raw, attr) if raw else None)
        ratio = a / b if _finite(a) and _finite(b) and b > 0 else None
        detail = f"{a:.4f} vs {b:.4f} ms -> " if ratio is not None else ""
        out.append(_at_most(label, ratio, 1.10, detail, "x", rep_ratios(r, raw, attr.replace("_ms", "_reps"))))
    return out


def _large_points(rows: Sequence[Row], large_workloads: Sequence[str]) -> list[tuple[str, str]]:
    seen = {(r.workload, r.dtype) for r in rows if r.workload in large_workloads}
    wanted = [(w, d) for w in large_workloads for d in LARGE_DTYPES if w in LARGE_WORKLOADS]
    return wanted + sorted(seen - set(wanted))


def _some(points: Sequence[str]) -> str:
    return ", ".join(points[:6]) + (" ..." if len(points) > 6 else "")


def _every_point_vs_foreach(rows: Sequence[Row], label: str, need: float = 1.3) -> Target:
    """FAIL if a point is clearly below ``need``; else not judged if any point is too noisy; else PASS."""
    ratios, noisy = [], []
    for f in (r for r in rows if r.contender == FUSED):
        o = next((r for r in rows if r.contender == FOREACH and r.key == f.key), None)
        if o is not None and _finite(o.eager_ms) and _finite(f.eager_ms) and f.eager_ms > 0:
            where = f"{f.workload}/{f.point}/{f.dtype}"
            ratio = o.eager_ms / f.eager_ms
            ratios.append((ratio, where))
            if too_noisy(ratio, need, rep_ratios(o, f, "eager_reps"))[0]:
                noisy.append(where)
    if not ratios:
        return Target(label, None, "not measured")
    worst = min(ratios)
    failing = [p for x, p in ratios if x < need and p not in noisy]
    detail = f"{len(ratios)} points, slowest ratio {worst[0]:.2f}x at {worst[1]}"
    if failing:
        return Target(label, False, f"{detail}; below {need:g}x at {len(failing)}: {_some(failing)}")
    if noisy:
        return Target(label, None, f"{detail}; noisy, not judged (repeat spread above the margin at {len(noisy)}: "
                                   f"{_some(noisy)})", noisy=True)  # fmt: skip
    return Target(label, True, detail)


def evaluate_targets(rows: Sequence[Row], device: str, large_workloads: Sequence[str] = LARGE_WORKLOADS,
                     threads: int | None = None) -> list[Target]:  # fmt: skip
    """The goals for ``device`` ("cuda" or "cpu") as Targets; ``large_workloads`` carry the bandwidth goals."""
    out: list[Target] = []
    if device == "cuda":
        for wl, dt in _large_points(rows, large_workloads):
            f, c = _get(rows, FUSED, wl, dt), _get(rows, SUM_CEILING, wl, dt)
            out.append(_at_least(f"GPU {wl} {dt}: fused device-time bandwidth >= 0.95x torch.sum",
                                 f.pct_ceiling / 100 if f else None, 0.95, "", "x",
                                 rep_ratios(c, f, "device_reps")))  # fmt: skip
            out.append(_at_least(f"GPU {wl} {dt}: fused eager >= 0.9x torch.sum",
                                 f.eager_pct_ceiling / 100 if f else None, 0.9, "", "x",
                                 rep_ratios(c, f, "eager_reps")))  # fmt: skip
        f = _get(rows, FUSED, "small_many", "float32", 10_000)
        out.append(_at_most("GPU 10,000 x 1,024 float32: fused device time <= 20 us",
                            f.device_ms * 1e3 if f else None, 20.0, "", " us",
                            [x * 1e3 for x in f.device_reps] if f else None))  # fmt: skip
        out.append(_at_most("GPU 10,000 x 1,024 float32: fused eager <= 1 ms", f.eager_ms if f else None, 1.0, "",
                            " ms", f.eager_reps if f else None))  # fmt: skip
        out += _host_fit(rows)
        out += _wrappers(rows, "GPU", "host_ms")
        return out

    cores = f"CPU ({threads} thread{'s' if threads != 1 else ''}; goals set for 2 cores)" if threads else "CPU"
    for wl, dt in _large_points(rows, large_workloads):
        need = 0.9 if dt in ("float32", "float64") else 0.8
        f, c = _get(rows, FUSED, wl, dt), _get(rows, SUM_CEILING, wl, dt)
        out.append(_at_least(f"{cores} {wl} {dt}: fused >= {need:g}x torch.sum of the same bytes",
                             f.pct_ceiling / 100 if f else None, need, "", "x",
                             rep_ratios(c, f, "eager_reps")))  # fmt: skip
    out.append(_every_point_vs_foreach(rows, f"{cores}: fused >= 1.3x _foreach_norm at every point"))
    out += _wrappers(rows, cores, "eager_ms")
    return out

