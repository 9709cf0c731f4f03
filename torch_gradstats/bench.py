"""Benchmark suite: ``python -m torch_gradstats bench [--device cpu|cuda] [--quick] [--out DIR] ...``.

Times the fused op against what users run today, side by side in one process, so that the ratios hold on a noisy
machine. Every contender computes what it computes in real code:

==================  =====================================================================================
contender           what it runs
==================  =====================================================================================
fused               ``torch_gradstats.multi_tensor_stats`` (sumsq, amax, zero/NaN/Inf counts per tensor)
fused_raw_op        ``torch.ops.torch_gradstats.multi_tensor_stats`` called directly (no Python-side validation)
foreach_norm        ``torch._foreach_norm`` alone (per-tensor L2 norms only)
composite           ``_foreach_norm`` + per tensor ``(g == 0).sum()``, ``isnan(g).sum()``, ``isinf(g).sum()``
get_total_norm      ``torch.nn.utils.get_total_norm`` (torch >= 2.6; one global norm)
orig_collector      the original gradient collector as last published: float64 copy of every gradient,
                    ``_foreach_norm``, ``torch.cat`` of all gradients, three masks, one ``.tolist()``
ceiling_sum         ``torch.sum`` over one flat float32 buffer of the same bytes (read-bandwidth ceiling)
ceiling_copy        a device-to-device copy of that buffer (reads and writes the bytes)
==================  =====================================================================================

Method: inputs are random normal (never zeros); a working set smaller than twice the last-level cache is rotated
between several copies, every call reading the next copy; each contender is warmed up, then all contenders run interleaved (the order rotates every
repetition) and the median is reported. On CUDA, CUDA events give device time and ``perf_counter`` around the call
gives host (enqueue) time; on CPU both columns are wall time. GB/s is the input's bytes over the median time, so
``pct_ceiling`` compares each contender's read rate to ``ceiling_sum`` measured in the same run, and
``vs_fused`` is the contender's time over the fused op's time (how many times faster the fused op is).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

import torch_gradstats
from torch_gradstats.ops import OP_QUALNAME, multi_tensor_stats

__all__ = [
    "CONTENDERS",
    "CSV_COLUMNS",
    "WORKLOADS",
    "Row",
    "Sample",
    "evaluate_targets",
    "gpt2_shapes",
    "main",
    "original_collector",
    "run_point",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FUSED, SUM_CEILING, COPY_CEILING = "fused", "ceiling_sum", "ceiling_copy"


# ----------------------------------------------------------------------------------------------------------------
# Contenders
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    """One rotation copy of a workload point: the tensor list, and a flat float32 buffer of the same bytes."""

    tensors: list[Tensor]
    flat: Tensor  # ceiling input
    dst: Tensor  # ceiling_copy destination


def _fused(s: Sample) -> object:
    return multi_tensor_stats(s.tensors)


def _fused_raw_op(s: Sample) -> object:
    # The registered op without the Python wrapper's per-tensor validation: shows what that wrapper costs.
    return torch.ops.torch_gradstats.multi_tensor_stats.default(s.tensors)


def _foreach_norm(s: Sample) -> object:
    return torch._foreach_norm(s.tensors)


def _composite(s: Sample) -> object:
    # What users write today to get the same information: one norm launch plus three reductions per tensor.
    norms = torch._foreach_norm(s.tensors)
    zeros = [(g == 0).sum() for g in s.tensors]
    nans = [torch.isnan(g).sum() for g in s.tensors]
    infs = [torch.isinf(g).sum() for g in s.tensors]
    return norms, zeros, nans, infs


def _get_total_norm(s: Sample) -> object:
    return torch.nn.utils.get_total_norm(s.tensors)


def original_collector(
    grads: Sequence[Tensor], vanishing_threshold: float = 1e-7, exploding_threshold: float = 5.0
) -> list[float]:
    """Baseline: the work done by the original gradient collector (``collect_seed_gradients``) as last published.

    Re-expressed here step by step so its cost can be measured: every gradient is upcast to a float64 copy before
    ``_foreach_norm`` (its overflow fix), the per-parameter norms are stacked and summarised, all gradients are
    concatenated into one flat buffer that three elementwise masks (== 0, isnan, isinf) are counted over, and the
    eight summary scalars come back to the host in one ``.tolist()``.
    """
    float64_copies = [g.double() for g in grads]
    norms = torch.stack(torch._foreach_norm(float64_copies, ord=2))
    summary = [
        (norms**2).sum(),
        norms.min(),
        norms.max(),
        (norms < vanishing_threshold).sum().float(),
        (norms > exploding_threshold).sum().float(),
    ]
    flat = torch.cat([g.view(-1) for g in grads])
    summary += [(flat == 0).sum().float(), torch.isnan(flat).sum().float(), torch.isinf(flat).sum().float()]
    return torch.stack(summary).tolist()


def _orig_collector(s: Sample) -> object:
    return original_collector(s.tensors)


def _ceiling_sum(s: Sample) -> object:
    return torch.sum(s.flat)


def _ceiling_copy(s: Sample) -> object:
    return s.dst.copy_(s.flat)


def _has_get_total_norm() -> bool:
    return hasattr(torch.nn.utils, "get_total_norm")  # added in torch 2.6


#: name -> function of one Sample. Order is the table's order.
CONTENDERS: dict[str, Callable[[Sample], object]] = {
    FUSED: _fused,
    "fused_raw_op": _fused_raw_op,
    "foreach_norm": _foreach_norm,
    "composite": _composite,
    **({"get_total_norm": _get_total_norm} if _has_get_total_norm() else {}),
    "orig_collector": _orig_collector,
    SUM_CEILING: _ceiling_sum,
    COPY_CEILING: _ceiling_copy,
}


# ----------------------------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------------------------
def gpt2_shapes(d_model: int = 1024, n_layer: int = 24, vocab: int = 50257, n_ctx: int = 1024) -> list[tuple]:
    """Parameter shapes of a GPT-2-style model (d_model=1024, 24 layers: GPT-2 medium, 355M parameters)."""
    d = d_model
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (n_ctx, d)] + block * n_layer + [(d,), (d,)]


def _numel(shape: tuple) -> int:
    return math.prod(shape)


def _gpt2_scaled(target_bytes: int, elem_size: int = 4) -> list[tuple]:
    """GPT-2-medium's layer structure (24 layers, full vocabulary) with the width whose float32 size is closest."""
    best = min(range(64, 1025, 64), key=lambda d: abs(sum(map(_numel, gpt2_shapes(d))) * elem_size - target_bytes))
    return gpt2_shapes(best)


@dataclasses.dataclass
class Point:
    """One measured configuration: a list of shapes with a dtype per tensor."""

    workload: str
    label: str
    shapes: list[tuple]
    dtypes: list[torch.dtype]

    @property
    def total_bytes(self) -> int:
        return sum(_numel(s) * dt.itemsize for s, dt in zip(self.shapes, self.dtypes))

    @property
    def dtype_label(self) -> str:
        names = sorted({str(dt).replace("torch.", "") for dt in self.dtypes})
        return "+".join(names)


@dataclasses.dataclass
class Sizes:
    """Workload sizes for one device/mode."""

    large: list[tuple]
    many_count: int
    sweep_bytes: list[int]
    counts: list[int]


def _sizes(device: torch.device, quick: bool) -> Sizes:
    if quick:
        return Sizes(
            large=gpt2_shapes(64, n_layer=2, vocab=1000, n_ctx=128),
            many_count=300,
            sweep_bytes=[64 * KiB, 256 * KiB, 1 * MiB],
            counts=[1, 16, 128],
        )
    if device.type == "cuda":
        sweep_end = 4 * GiB
        large = gpt2_shapes(1024)  # GPT-2 medium itself: 1.32 GiB of float32
    else:
        sweep_end = 256 * MiB
        large = _gpt2_scaled(128 * MiB)
    sweep, b = [], 64 * KiB
    while b <= sweep_end:
        sweep.append(b)
        b *= 2
    return Sizes(large=large, many_count=10_000, sweep_bytes=sweep, counts=[1, 8, 64, 512, 2048, 10_000])


SWEEP_TENSORS = 64  # tensors per sweep point (the shape of issue 2's CPU benchmark)
SMALL_NUMEL = 1024


def _workload_points(name: str, sizes: Sizes) -> list[Point]:
    f32, bf16 = torch.float32, torch.bfloat16
    if name == "large_f32":
        return [Point(name, "gpt2", sizes.large, [f32] * len(sizes.large))]
    if name == "large_bf16":
        return [Point(name, "gpt2", sizes.large, [bf16] * len(sizes.large))]
    if name == "mixed":
        return [Point(name, "gpt2", sizes.large, [f32 if i % 2 == 0 else bf16 for i in range(len(sizes.large))])]
    if name == "small_many":
        n = sizes.many_count
        return [Point(name, f"{n}x{SMALL_NUMEL}", [(SMALL_NUMEL,)] * n, [f32] * n)]
    if name == "sweep":
        points = []
        for total in sizes.sweep_bytes:
            per = max(1, total // (4 * SWEEP_TENSORS))
            points.append(Point(name, _fmt_bytes(total), [(per,)] * SWEEP_TENSORS, [f32] * SWEEP_TENSORS))
        return points
    if name == "count":
        return [Point(name, f"{n}x{SMALL_NUMEL}", [(SMALL_NUMEL,)] * n, [f32] * n) for n in sizes.counts]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


#: Workload names, in run order.
WORKLOADS = ("large_f32", "large_bf16", "mixed", "small_many", "sweep", "count")


def _last_level_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * MiB))
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 * MiB


def _make_samples(point: Point, device: torch.device, llc: int, seed: int) -> list[Sample]:
    """Random-normal inputs, rotated between enough copies that the working set exceeds twice the LLC."""
    total = point.total_bytes
    max_copies = max(1, min(256, 200_000 // max(1, len(point.shapes))))
    copies = max(1, min(max_copies, math.ceil(2 * llc / max(total, 1))))
    gen = torch.Generator(device=device).manual_seed(seed)
    flat_numel = max(1, total // 4)
    samples = []
    for _ in range(copies):
        tensors = [torch.randn(s, dtype=dt, device=device, generator=gen) for s, dt in zip(point.shapes, point.dtypes)]
        flat = torch.randn(flat_numel, dtype=torch.float32, device=device, generator=gen)
        samples.append(Sample(tensors, flat, torch.empty_like(flat)))
    return samples


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
class _Timer:
    """Times one call: (device seconds, host seconds). CUDA: events + perf_counter; CPU: wall time for both."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[Sample], object], sample: Sample) -> tuple[float, float]:
        if not self.cuda:
            t0 = time.perf_counter()
            fn(sample)
            dt = time.perf_counter() - t0
            return dt, dt
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        fn(sample)
        host = time.perf_counter() - h0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host


def _count_device_activities(fn: Callable[[Sample], object], sample: Sample) -> int | None:
    """Kernels one call launches on the GPU (torch.profiler; memcpys and memsets not counted); None if uncountable."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(sample)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))  # fmt: skip
    except Exception:  # profiler unavailable (e.g. CUPTI missing): the column stays empty
        return None


#: Columns of the CSV, in order.
CSV_COLUMNS = (
    "device", "workload", "point", "dtype", "n_tensors", "total_bytes", "contender", "reps",
    "time_ms", "min_ms", "host_ms", "gbps", "pct_ceiling", "vs_fused", "launches",
)  # fmt: skip


@dataclasses.dataclass
class Row:
    """One contender on one workload point. Times are medians over ``reps`` interleaved repetitions."""

    device: str
    workload: str
    point: str
    dtype: str
    n_tensors: int
    total_bytes: int
    contender: str
    reps: int
    time_ms: float
    min_ms: float
    host_ms: float
    gbps: float
    pct_ceiling: float = float("nan")
    vs_fused: float = float("nan")
    launches: int | None = None


def run_point(
    point: Point,
    contenders: dict[str, Callable[[Sample], object]],
    device: torch.device,
    *,
    repeats: int,
    warmup: int = 1,
    min_seconds: float = 0.25,
    max_repeats: int = 200,
    seed: int = 0,
    count_launches: bool = False,
) -> list[Row]:
    """Measure every contender on one point, interleaved; return one Row per contender (ratios filled in).

    ``repeats`` is the minimum; cheap points get more repetitions (until one contender's time adds up to about
    ``min_seconds``, at most ``max_repeats``) so that the medians of microsecond-scale calls are stable.
    """
    timer = _Timer(device)
    samples = _make_samples(point, device, _last_level_cache_bytes(device), seed)
    names = list(contenders)
    failed: dict[str, str] = {}
    dev_t: dict[str, list[float]] = {n: [] for n in names}
    host_t: dict[str, list[float]] = {n: [] for n in names}

    n_calls = 0

    def call(name: str) -> tuple[float, float] | None:
        # Every call reads the next copy, so no contender finds the data another one just pulled into the cache.
        nonlocal n_calls
        if name in failed:
            return None
        sample = samples[n_calls % len(samples)]
        n_calls += 1
        try:
            return timer(contenders[name], sample)
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # e.g. the collector's float64 copies on a huge list
            if name == FUSED:
                raise  # the op under test must not fail quietly
            failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    slowest = 0.0
    for i in range(warmup):
        for name in names:
            warm = call(name)
            if warm is not None and i == warmup - 1:
                slowest = max(slowest, warm[0])
    reps = max(repeats, min(max_repeats, int(min_seconds / slowest) if slowest > 0 else repeats))

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside timed calls
    try:
        for r in range(reps):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]  # rotate the order so no contender always runs first
                t = call(name)
                if t is not None:
                    dev_t[name].append(t[0])
                    host_t[name].append(t[1])
    finally:
        if gc_was_enabled:
            gc.enable()

    launches: dict[str, int | None] = {}
    if count_launches and device.type == "cuda":
        for name in names:
            if name not in failed:
                launches[name] = _count_device_activities(contenders[name], samples[0])

    rows = []
    total = point.total_bytes
    for name in names:
        if not dev_t[name]:
            continue
        med = statistics.median(dev_t[name])
        rows.append(
            Row(
                device=device.type,
                workload=point.workload,
                point=point.label,
                dtype=point.dtype_label,
                n_tensors=len(point.shapes),
                total_bytes=total,
                contender=name,
                reps=len(dev_t[name]),
                time_ms=med * 1e3,
                min_ms=min(dev_t[name]) * 1e3,
                host_ms=statistics.median(host_t[name]) * 1e3,
                gbps=total / med / 1e9 if med > 0 else float("nan"),
                launches=launches.get(name),
            )
        )
    _fill_ratios(rows)
    for name, why in failed.items():
        print(f"  [skipped {name} on {point.workload}/{point.label}: {why}]", file=sys.stderr)
    samples.clear()  # the closure `call` still refers to the list: empty it so its buffers can go
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the point's buffers back before the next (up to 4 GiB) point
    return rows


def _fill_ratios(rows: list[Row]) -> None:
    by = {r.contender: r for r in rows}
    ceiling, fused = by.get(SUM_CEILING), by.get(FUSED)
    for r in rows:
        if ceiling is not None and ceiling.gbps > 0:
            r.pct_ceiling = 100.0 * r.gbps / ceiling.gbps
        if fused is not None and fused.time_ms > 0:
            r.vs_fused = r.time_ms / fused.time_ms


# ----------------------------------------------------------------------------------------------------------------
# Targets (issue 2 on CPU, issue 5 on CUDA), evaluated on ratios measured in the same run
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    name: str
    passed: bool | None  # None: not measured in this run
    detail: str

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "N/A "}[self.passed]
        return f"[{status}] {self.name}: {self.detail}"


def _find(rows: Iterable[Row], workload: str, contender: str) -> Row | None:
    return next((r for r in rows if r.workload == workload and r.contender == contender), None)


def _speedup_target(rows: list[Row], workload: str, other: str, factor: float, label: str) -> Target:
    o, f = _find(rows, workload, other), _find(rows, workload, FUSED)
    if o is None or f is None:
        return Target(label, None, f"{workload}: {other} or fused not measured")
    ratio = o.time_ms / f.time_ms
    return Target(label, ratio >= factor, f"{workload}: fused {f.time_ms:.3f} ms, {other} {o.time_ms:.3f} ms "
                  f"-> {ratio:.2f}x (need >= {factor:g}x)")  # fmt: skip


def evaluate_targets(rows: list[Row], device: str, large_workload: str = "large_f32") -> list[Target]:
    """The issue's acceptance targets as PASS/FAIL lines: issue 2 (CPU) or issue 5 (CUDA)."""
    if device != "cuda":
        return [
            _speedup_target(rows, large_workload, "composite", 3.0, "CPU: fused >= 3x faster than the composite"),
            _speedup_target(rows, large_workload, "foreach_norm", 1.0, "CPU: fused no slower than _foreach_norm"),
        ]
    out = []
    f = _find(rows, large_workload, FUSED)
    out.append(
        Target("GPU large: fused read bandwidth >= 92% of torch.sum", f.pct_ceiling >= 92.0,
               f"{large_workload}: {f.gbps:.0f} GB/s = {f.pct_ceiling:.1f}% of ceiling_sum")
        if f is not None and not math.isnan(f.pct_ceiling)
        else Target("GPU large: fused read bandwidth >= 92% of torch.sum", None, "not measured")
    )  # fmt: skip
    out.append(_speedup_target(rows, large_workload, "foreach_norm", 1.3, "GPU large: >= 1.3x _foreach_norm"))
    out.append(_speedup_target(rows, large_workload, "composite", 4.0, "GPU large: >= 4x the composite"))
    out.append(_speedup_target(rows, large_workload, "orig_collector", 10.0, "GPU large: >= 10x the orig collector"))
    f = _find(rows, "small_many", FUSED)
    if f is None or f.launches is None:
        out.append(Target("GPU 10,000 x 1,024: at most two launches", None, "not measured"))
    else:
        out.append(Target("GPU 10,000 x 1,024: at most two launches", f.launches <= 2,
                          f"{f.launches} kernel launches per call"))  # fmt: skip
    o = _find(rows, "small_many", "foreach_norm")
    if f is None or o is None:
        out.append(Target("GPU 10,000 x 1,024: <= half of _foreach_norm's time", None, "not measured"))
    else:
        out.append(Target("GPU 10,000 x 1,024: <= half of _foreach_norm's time", f.time_ms <= 0.5 * o.time_ms,
                          f"fused {f.time_ms:.3f} ms vs {o.time_ms:.3f} ms ({f.time_ms / o.time_ms:.2f}x)"))  # fmt: skip
    ref = _find(rows, large_workload, FUSED)
    for wl in ("large_bf16", "mixed"):
        r = _find(rows, wl, FUSED)
        label = f"GPU {wl}: same fraction of the ceiling as float32 (within 5 points)"
        if r is None or ref is None:
            out.append(Target(label, None, "not measured"))
        else:
            out.append(Target(label, r.pct_ceiling >= ref.pct_ceiling - 5.0,
                              f"{r.pct_ceiling:.1f}% vs float32 {ref.pct_ceiling:.1f}%"))  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# Output: table, CSV, markdown, plots
# ----------------------------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt(v: float | int | None, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def format_table(rows: list[Row], markdown: bool = False) -> str:
    """The results table; one block per workload point."""
    cuda = any(r.device == "cuda" for r in rows)
    head = ["workload", "point", "dtype", "tensors", "bytes", "contender", "time ms"]
    head += ["host ms"] if cuda else []
    head += ["GB/s", "% ceiling", "fused faster by"]
    head += ["launches"] if any(r.launches is not None for r in rows) else []
    lines = []
    for r in rows:
        cells = [r.workload, r.point, r.dtype, str(r.n_tensors), _fmt_bytes(r.total_bytes), r.contender,
                 _fmt(r.time_ms, ".3f")]  # fmt: skip
        cells += [_fmt(r.host_ms, ".3f")] if cuda else []
        cells += [_fmt(r.gbps, ".2f"), _fmt(r.pct_ceiling, ".1f"), _fmt(r.vs_fused, ".2f") + "x"]
        cells += [_fmt(r.launches, "d")] if len(head) > len(cells) else []
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c) + " |" for c in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    prev = None
    for r, c in zip(rows, lines):
        if prev is not None and (r.workload, r.point) != prev:
            out.append("")
        prev = (r.workload, r.point)
        out.append("  ".join(x.ljust(w) for x, w in zip(c, widths)))
    return "\n".join(out)


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            d = dataclasses.asdict(r)
            w.writerow(["" if d[c] is None else d[c] for c in CSV_COLUMNS])


def machine_description(device: torch.device) -> dict[str, str]:
    """What the numbers were measured on: device, versions, date."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "torch_gradstats": torch_gradstats.__version__,
        "python": platform.python_version(),
        "compiled extension loaded": str(torch_gradstats.HAS_EXTENSION),
    }
    try:  # which version of the kernels was measured (source checkouts only)
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()  # fmt: skip
        if rev:
            info["git commit"] = rev
    except (OSError, subprocess.SubprocessError):
        pass
    if hasattr(os, "getloadavg"):
        info["load average at start"] = f"{os.getloadavg()[0]:.2f}"
    key = "CUDA" if device.type == "cuda" else "CPU"
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(OP_QUALNAME, key)
    info["fused op kernel"] = f"compiled {key} kernel" if has_kernel else "pure-PyTorch fallback (not the fused kernel)"
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    info["cpu"] = f"{cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"
    info["last-level cache"] = _fmt_bytes(_last_level_cache_bytes(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = f"{props.name}, {props.total_memory / GiB:.0f} GiB"
        info["cuda (torch build)"] = str(torch.version.cuda)
        try:
            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()  # fmt: skip
            info["driver"] = drv.splitlines()[0] if drv else "unknown"
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi not found)"
    return info


def write_markdown(rows: list[Row], targets: list[Target], info: dict[str, str], path: Path, plots: list[str]) -> None:
    lines = [f"# torch_gradstats benchmark: {rows[0].device if rows else '?'}", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items()]
    lines += ["", "Times are medians of interleaved repetitions; GB/s = input bytes / time; `% ceiling` compares with "
              "`torch.sum` over a flat float32 buffer of the same bytes measured in the same run; "
              "`fused faster by` = contender time / fused time.", ""]  # fmt: skip
    lines += ["## Targets", ""] + [f"- {t.line()}" for t in targets] + [""]
    lines += ["## Results", "", format_table(rows, markdown=True), ""]
    lines += [f"![{p}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def make_plots(rows: list[Row], out: Path, device: str) -> list[str]:
    """GB/s vs total bytes (sweep) and host time vs tensor count (count); returns the PNG file names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    specs = [
        ("sweep", "total_bytes", "gbps", f"bandwidth_{device}.png", "total bytes of the list (64 tensors)", "GB/s",
         f"Read rate vs list size ({device})"),
        ("count", "n_tensors", "host_ms", f"host_time_{device}.png", "number of tensors (1,024 float32 each)",
         "host time per call, ms" if device == "cuda" else "time per call, ms", f"Time vs tensor count ({device})"),
    ]  # fmt: skip
    for workload, xk, yk, fname, xlabel, ylabel, title in specs:
        sel = [r for r in rows if r.workload == workload]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for name in dict.fromkeys(r.contender for r in sel):
            pts = sorted((getattr(r, xk), getattr(r, yk)) for r in sel if r.contender == name)
            style = "--" if name.startswith("ceiling") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name,
                    lw=2.5 if name == FUSED else 1.3)  # fmt: skip
        ax.set_xscale("log", base=2 if xk == "total_bytes" else 10)
        if yk == "host_ms":
            ax.set_yscale("log")
        if xk == "total_bytes":
            ticks = sorted({r.total_bytes for r in sel})
            ax.set_xticks(ticks, [_fmt_bytes(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    return written


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m torch_gradstats bench",
        description="Time the fused multi_tensor_stats op against _foreach_norm, the composite users write, "
        "get_total_norm, the original collector and the memory ceilings, side by side.",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (smoke test)")
    p.add_argument("--repeats", type=int, default=None,
                   help="minimum timed repetitions per point (default: 5 on CPU, 9 on CUDA, 3 with --quick); "
                   "cheap points get more, up to 200")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per contender before timing (default 1)")
    p.add_argument("--out", default=None, help="directory for the CSV, markdown and PNG plots (default: none)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs (default: torch's)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no new point after this many seconds (0: no limit); rows so far are still written")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else (9 if args.device.startswith("cuda") else 5)
    if args.repeats < 1 or args.warmup < 1:
        p.error("--repeats and --warmup must be >= 1")
    return args


def _progress(items: list, enabled: bool) -> Iterable:
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(items, desc="bench", unit="point", file=sys.stderr, leave=False)
        except ImportError:
            pass
    return items


def run(
    device: torch.device,
    workloads: Sequence[str],
    contenders: dict[str, Callable[[Sample], object]],
    *,
    quick: bool,
    repeats: int,
    warmup: int = 1,
    seed: int = 0,
    progress: bool = False,
    budget_s: float = 0.0,
    on_point: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Run the selected workloads; return all rows (one per contender per point).

    ``budget_s`` > 0: start no new point once that many seconds have passed (the rest is reported as skipped).
    ``on_point`` is called with all rows so far after each point (e.g. to keep a CSV current under a time limit).
    """
    sizes = _sizes(device, quick)
    points = [pt for wl in workloads for pt in _workload_points(wl, sizes)]
    rows: list[Row] = []
    t0 = time.perf_counter()
    for i, pt in enumerate(_progress(points, progress)):
        if budget_s > 0 and time.perf_counter() - t0 > budget_s:
            skipped = ", ".join(f"{p.workload}/{p.label}" for p in points[i:])
            print(f"bench: time budget of {budget_s:g} s spent; not run: {skipped}", file=sys.stderr)
            break
        rows += run_point(
            pt,
            contenders,
            device,
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            min_seconds=0.05 if quick else 0.25,
            count_launches=pt.workload not in ("sweep", "count"),
        )
        if on_point is not None:
            on_point(rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_gradstats bench``; returns the process exit code."""
    args = _parse(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"bench: bad --device {args.device!r}: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"bench: --device must be cpu or cuda, got {args.device!r}", file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad_c = [c for c in names if c not in CONTENDERS]
    if bad or bad_c or not workloads or not names:
        print(f"bench: unknown workload(s) {bad} or contender(s) {bad_c}; workloads: {', '.join(WORKLOADS)}; "
              f"contenders: {', '.join(CONTENDERS)}", file=sys.stderr)  # fmt: skip
        return 2
    contenders = {n: CONTENDERS[n] for n in CONTENDERS if n in names}
    if args.threads:
        torch.set_num_threads(args.threads)

    info = machine_description(device)
    print("torch_gradstats bench  " + "  ".join(f"{k}: {v}" for k, v in info.items()))
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
        print(f"WARNING: the machine is busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
              "absolute times will be noisy; the interleaved ratios hold better.")  # fmt: skip
    if "fallback" in info["fused op kernel"]:
        print("NOTE: the fused op runs its pure-PyTorch fallback here; its timings are not the fused kernel's.")
    out = Path(args.out) if args.out else None
    csv_path = out / f"bench_{device.type}.csv" if out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run(device, workloads, contenders, quick=args.quick, repeats=args.repeats, warmup=args.warmup,
               seed=args.seed, progress=not args.no_progress, budget_s=args.budget_s,
               on_point=(lambda rs: write_csv(rs, csv_path)) if csv_path else None)  # fmt: skip
    print()
    print(format_table(rows))
    targets = evaluate_targets(rows, device.type)
    print()
    print("Targets (ratios measured in this run):")
    for t in targets:
        print("  " + t.line())
    print(f"\nbench: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")

    if out and csv_path:
        write_csv(rows, csv_path)
        plots = [] if args.no_plots else make_plots(rows, out, device.type)
        md_path = out / f"bench_{device.type}.md"
        write_markdown(rows, targets, info, md_path, plots)
        print(f"bench: wrote {csv_path}, {md_path}" + "".join(f", {out / p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
