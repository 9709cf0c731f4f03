"""How a point is measured: every contender warmed up, then timed in interleaved blocks; medians become Rows.

Three times per contender and point, each per call:

* **device** (CUDA only): one CUDA graph holding one call per input copy, replayed back to back between two
  events, so no host cost is in it. Contenders that sync with the host cannot be captured: "-".
* **eager**: calls in a loop (each on the next input copy), synchronised once at the end, wall clock: what a user's
  loop sees. On CPU this is the only time (wall time).
* **host** (CUDA only): the host's time to enqueue those same calls (``perf_counter`` around the loop, before the
  sync). A contender that syncs, or whose calls fill the launch queue, waits for the device inside it.

A block is as many calls as make about ``block_s`` (at least one); the contenders' blocks run interleaved, the order
rotating every repetition, with Python's garbage collector off; each figure is the median over the repetitions. Each
block reads the input copies that follow the ones the block before it read (see ``make_samples``), so no contender
reads data another has just brought into the cache.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from .contenders import COMPILED, COPY_CEILING, FUSED, Contender, reset_compiled
from .report import Row, fill_ratios
from .workloads import Point, Sample, last_level_cache_bytes, make_samples

NAN = float("nan")
T = TypeVar("T")
#: A contender whose calls (one per input copy) take longer than this is not captured in a CUDA graph: capturing
#: costs about what the calls cost, and tens of thousands of per-tensor launches make a graph slow to build.
MAX_CAPTURE_S = 0.25


class _Skip(Exception):
    """A contender that cannot run this point (e.g. out of memory); it is reported, not fatal."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Measured:
    """One contender's state on one point."""

    def __init__(self, contender: Contender) -> None:
        self.c = contender
        self.n_inner = 1
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_calls = 0
        self.replays = 1
        self.compile_s = NAN
        self.device: list[float] = []
        self.eager: list[float] = []
        self.host: list[float] = []
        self.note = ""


def _eager_block(m: _Measured, samples: list[Sample], offset: int, device: torch.device) -> tuple[float, float]:
    _sync(device)
    t0 = time.perf_counter()
    for i in range(m.n_inner):
        m.c(samples[(offset + i) % len(samples)])
    host = time.perf_counter() - t0
    _sync(device)
    return (time.perf_counter() - t0) / m.n_inner, host / m.n_inner


def _graph_block(m: _Measured) -> float:
    assert m.graph is not None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(m.replays):
        m.graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (m.replays * m.graph_calls)


def _capture(m: _Measured, samples: list[Sample], one_call_s: float, block_s: float) -> None:
    """A CUDA graph of one call per copy; warmed up on a side stream first, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in samples:
            m.c(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in samples:
            m.c(s)
    graph.replay()
    torch.cuda.synchronize()
    m.graph, m.graph_calls = graph, len(samples)
    m.replays = max(1, min(64, round(block_s / max(one_call_s * len(samples), 1e-7))))


def _count_launches(fn: Callable[[Sample], object], sample: Sample) -> int | None:
    """Kernels one call launches on the GPU (torch.profiler; memcpys and memsets not counted); None if uncountable."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(sample)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))  # fmt: skip
    except Exception:  # noqa: BLE001 (profiler unavailable, e.g. CUPTI missing: the column stays empty)
        return None


def _guarded(m: _Measured, device: torch.device, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``; a contender other than the fused op that fails (e.g. out of memory, compile unavailable) is
    skipped, with its reason (contenders' correctness is tested apart)."""
    try:
        return fn(*args)
    except Exception as exc:
        if m.c.name == FUSED:
            raise  # the op under test must not fail quietly
        m.note = f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        raise _Skip from exc


def run_point(
    point: Point,
    contenders: dict[str, Contender],
    device: torch.device,
    *,
    repeats: int,
    warmup: int = 1,
    min_seconds: float = 0.25,
    max_repeats: int = 200,
    block_s: float = 2e-3,
    seed: int = 0,
    count_launches: bool = False,
    rotate: bool = True,
    skipped: dict[str, str] | None = None,
) -> list[Row]:
    """Measure every contender on one point; one Row per contender (and per name in ``skipped``, with its reason).

    ``repeats`` is the minimum number of interleaved repetitions; cheap points get more (until the slowest
    contender's blocks add up to about ``min_seconds``, at most ``max_repeats``). ``rotate=False``: one copy of
    the inputs, read from cache when it fits (for smoke tests: making the copies costs more than timing them).
    """
    cuda = device.type == "cuda"
    llc = last_level_cache_bytes(device) if rotate else 0
    samples = make_samples(point, device, llc, seed, copy_target=COPY_CEILING in contenders)
    states = [_Measured(c) for c in contenders.values()]
    live: list[_Measured] = []
    slowest = 0.0
    for m in states:
        try:
            if m.c.compiled:  # compile time is reported apart, never timed
                reset_compiled()
                t0 = time.perf_counter()
                _guarded(m, device, _eager_block, m, samples[:1], 0, device)
                m.compile_s = time.perf_counter() - t0
            for _ in range(warmup):
                one_call, _ = _guarded(m, device, _eager_block, m, samples, 0, device)
            m.n_inner = max(1, min(256 if not cuda else 64, round(block_s / max(one_call, 1e-7))))
            if cuda and m.c.graph_safe and one_call * len(samples) > MAX_CAPTURE_S:
                m.note = f"no device time: host-bound ({one_call * 1e3:.0f} ms a call), not captured"
            elif cuda and m.c.graph_safe:
                try:
                    _capture(m, samples, one_call, block_s)
                except Exception as exc:  # noqa: BLE001 (any capture failure only costs the device-time column)
                    m.graph, m.note = None, f"no device time: capture failed ({type(exc).__name__})"
                    torch.cuda.synchronize()
            live.append(m)
            slowest = max(slowest, one_call * m.n_inner * (2 if m.graph is not None else 1))
        except _Skip:
            continue
    reps = max(repeats, min(max_repeats, int(min_seconds / slowest) if slowest > 0 else repeats))

    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # no collector pauses inside timed calls
    cursor = 0  # the next input copy: each block goes on where the one before stopped, so none starts on warm data
    try:
        for r in range(reps):
            for k in range(len(live)):
                m = live[(r + k) % len(live)]  # rotate the order so no contender always runs first
                if m.note.startswith("skipped"):
                    continue
                try:
                    eager, host = _guarded(m, device, _eager_block, m, samples, cursor, device)
                    cursor += m.n_inner
                    m.eager.append(eager)
                    m.host.append(host)
                    if m.graph is not None:
                        m.device.append(_graph_block(m))
                except _Skip:
                    continue
    finally:
        if gc_was_enabled:
            gc.enable()

    launches: dict[str, int | None] = {}
    if count_launches and cuda:
        for m in live:
            if not m.note.startswith("skipped"):
                launches[m.c.name] = _count_launches(m.c, samples[0])

    rows = [_row(point, device, m, launches.get(m.c.name)) for m in states]
    rows += [_row(point, device, None, None, name=n, note=why) for n, why in (skipped or {}).items()]
    fill_ratios(rows)
    for m in states:
        if m.note.startswith("skipped"):
            print(f"  [{m.c.name} on {point.workload}/{point.label}/{point.dtype_label}: {m.note}]", file=sys.stderr)
    for m in states:
        m.graph = None
    samples.clear()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # hand the point's buffers back before the next (up to 8 GiB) point
    return rows


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else NAN


def _row(point: Point, device: torch.device, m: _Measured | None, launches: int | None, name: str = "",
         note: str = "") -> Row:  # fmt: skip
    cuda = device.type == "cuda"
    return Row(
        device=device.type,
        workload=point.workload,
        point=point.label,
        dtype=point.dtype_label,
        n_tensors=len(point.shapes),
        total_bytes=point.total_bytes,
        contender=m.c.name if m else name,
        reps=len(m.eager) if m else 0,
        device_ms=_median_ms(m.device) if m else NAN,
        eager_ms=_median_ms(m.eager) if m else NAN,
        host_ms=_median_ms(m.host) if (m and cuda) else NAN,
        launches=launches,
        compile_s=m.compile_s if m and m.c.name == COMPILED else NAN,
        note=m.note if m else note,
        device_reps=[x * 1e3 for x in m.device] if m else [],
        eager_reps=[x * 1e3 for x in m.eager] if m else [],
        host_reps=[x * 1e3 for x in m.host] if (m and cuda) else [],
    )


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak of the CPU allocator's live bytes while ``fn()`` runs (allocations minus frees, in order), from torch's
    profiler memory events: what an op allocates, not the process's RSS."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
