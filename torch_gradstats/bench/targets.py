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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TypeGuard

from .contenders import FOREACH, FUSED, GRAD_STATS, RAW_OP
from .report import Row
from .workloads import LARGE_WORKLOADS

LARGE_DTYPES = ("float32", "bfloat16", "float16", "float64", "bfloat16+float32")
GPT2_TENSORS = 292


@dataclasses.dataclass
class Target:
    name: str
    passed: bool | None  # None: not measured in this run
    detail: str

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        return f"[{status}] {self.name}: {self.detail}"


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and not math.isnan(x)


def _get(rows: Iterable[Row], contender: str, workload: str, dtype: str | None = None, n: int | None = None
         ) -> Row | None:  # fmt: skip
    for r in rows:
        if (r.contender, r.workload) == (contender, workload) and dtype in (None, r.dtype) and n in (None, r.n_tensors):
            return r
    return None


def _at_least(name: str, value: float | None, bound: float, detail: str, unit: str = "") -> Target:
    if not _finite(value):
        return Target(name, None, f"not measured ({detail})" if detail else "not measured")
    return Target(name, value >= bound, f"{detail}{value:.3g}{unit} (need >= {bound:g}{unit})")


def _at_most(name: str, value: float | None, bound: float, detail: str, unit: str = "") -> Target:
    if not _finite(value):
        return Target(name, None, "not measured")
    return Target(name, value <= bound, f"{detail}{value:.3g}{unit} (need <= {bound:g}{unit})")


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
        out.append(_at_most(label, ratio, 1.10, detail, "x"))
    return out


def _large_points(rows: Sequence[Row], large_workloads: Sequence[str]) -> list[tuple[str, str]]:
    seen = {(r.workload, r.dtype) for r in rows if r.workload in large_workloads}
    wanted = [(w, d) for w in large_workloads for d in LARGE_DTYPES if w in LARGE_WORKLOADS]
    return wanted + sorted(seen - set(wanted))


def evaluate_targets(rows: Sequence[Row], device: str, large_workloads: Sequence[str] = LARGE_WORKLOADS,
                     threads: int | None = None) -> list[Target]:  # fmt: skip
    """The goals for ``device`` ("cuda" or "cpu") as Targets; ``large_workloads`` carry the bandwidth goals."""
    out: list[Target] = []
    if device == "cuda":
        for wl, dt in _large_points(rows, large_workloads):
            f = _get(rows, FUSED, wl, dt)
            out.append(_at_least(f"GPU {wl} {dt}: fused device-time bandwidth >= 0.95x torch.sum",
                                 f.pct_ceiling / 100 if f else None, 0.95, "", "x"))  # fmt: skip
            out.append(_at_least(f"GPU {wl} {dt}: fused eager >= 0.9x torch.sum",
                                 f.eager_pct_ceiling / 100 if f else None, 0.9, "", "x"))  # fmt: skip
        f = _get(rows, FUSED, "small_many", "float32", 10_000)
        out.append(_at_most("GPU 10,000 x 1,024 float32: fused device time <= 20 us",
                            f.device_ms * 1e3 if f else None, 20.0, "", " us"))  # fmt: skip
        out.append(_at_most("GPU 10,000 x 1,024 float32: fused eager <= 1 ms", f.eager_ms if f else None, 1.0, "",
                            " ms"))  # fmt: skip
        out += _host_fit(rows)
        out += _wrappers(rows, "GPU", "host_ms")
        return out

    cores = f"CPU ({threads} thread{'s' if threads != 1 else ''}; goals set for 2 cores)" if threads else "CPU"
    for wl, dt in _large_points(rows, large_workloads):
        need = 0.9 if dt in ("float32", "float64") else 0.8
        f = _get(rows, FUSED, wl, dt)
        out.append(_at_least(f"{cores} {wl} {dt}: fused >= {need:g}x torch.sum of the same bytes",
                             f.pct_ceiling / 100 if f else None, need, "", "x"))  # fmt: skip
    ratios = []
    for f in (r for r in rows if r.contender == FUSED):
        o = next((r for r in rows if r.contender == FOREACH and r.key == f.key), None)
        if o is not None and _finite(o.eager_ms) and _finite(f.eager_ms) and f.eager_ms > 0:
            ratios.append((o.eager_ms / f.eager_ms, f"{f.workload}/{f.point}/{f.dtype}"))
    label = f"{cores}: fused >= 1.3x _foreach_norm at every point"
    if not ratios:
        out.append(Target(label, None, "not measured"))
    else:
        worst = min(ratios)
        failing = [p for x, p in ratios if x < 1.3]
        detail = f"{len(ratios)} points, slowest ratio {worst[0]:.2f}x at {worst[1]}"
        detail += f"; below 1.3x at {len(failing)}: {', '.join(failing[:6])}" + (" ..." if len(failing) > 6 else "")
        out.append(Target(label, not failing, detail))
    out += _wrappers(rows, cores, "eager_ms")
    return out

