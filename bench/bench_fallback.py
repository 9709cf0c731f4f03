"""The pure-PyTorch fallback against the compiled CPU kernel, side by side in one process.

Three contenders on the same inputs, timed in interleaved rounds (median of the rounds):

* ``compiled``: the fused CPU kernel (``torch.ops.torch_gradstats.multi_tensor_stats``; needs the extension);
* ``fallback``: :func:`torch_gradstats.ops.fallback.fallback_multi_tensor_stats`, what every device without a compiled
  kernel runs;
* ``old fallback``: :func:`torch_gradstats.ops.op.reference_multi_tensor_stats`, the float64 reference, which is
  what the fallback was before (a whole float64 copy of each tensor, a dozen ops per tensor).

Workloads: 1,000 float32 tensors of 65,536 elements (256 MiB), 200,000 tiny float32 tensors of 1 to 16 elements,
one float16 tensor of 128 MiB (read alone, in runs of pieces); the peak extra memory of each kernel on one large
tensor (float32 and bfloat16; the fallback's first call on a thread, which makes the workspace it keeps), from
torch's profiler memory events (the CPU allocator's own allocations and frees); and the process's own memory
(RSS, from /proc/self/status on Linux) that one call raises at its peak and keeps after ``gc.collect()``, for a
128 MiB float16 and a 1 GiB float32 tensor, contiguous and transposed, each in a fresh process after a warm-up call
on a small tensor (the measured call makes the thread's workspace again, and counts it).

    python bench/bench_fallback.py              # ~3 min on a 2-core machine (the old fallback is the slow part)
    python bench/bench_fallback.py --quick      # smaller sizes, fewer rounds
    python bench/bench_fallback.py --threads 1 --clock thread   # CPU time of the calling thread: steadier under load
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

import torch_gradstats
from torch_gradstats.bench.timing import peak_allocated_bytes
from torch_gradstats.ops.fallback import fallback_multi_tensor_stats, release_workspace
from torch_gradstats.ops.op import reference_multi_tensor_stats

Kernel = Callable[[list[torch.Tensor]], object]


def _compiled(tensors: list[torch.Tensor]) -> object:
    return torch.ops.torch_gradstats.multi_tensor_stats.default(tensors)


def time_interleaved(
    kernels: dict[str, Kernel], tensors: list[torch.Tensor], rounds: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median seconds per call of each kernel, one call of each per round (so drift hits all alike)."""
    for fn in kernels.values():  # warm-up
        fn(tensors)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            t0 = clock()
            fn(tensors)
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


#: RSS workloads: name -> (shape, dtype, transposed).
RSS_WORKLOADS = {
    "128 MiB float16": ((1 << 26,), torch.float16, False),
    "128 MiB float16, transposed": ((8192, 8192), torch.float16, True),
    "1 GiB float32": ((1 << 28,), torch.float32, False),
    "1 GiB float32, transposed": ((16384, 16384), torch.float32, True),
}
QUICK_RSS_WORKLOADS = {
    "128 MiB float16": ((1 << 26,), torch.float16, False),
    "128 MiB float16, transposed": ((8192, 8192), torch.float16, True),
    "256 MiB float32, transposed": ((8192, 8192), torch.float32, True),
}


def _rss_status() -> dict[str, int]:
    """VmHWM (peak) and VmRSS of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def rss_child(workload: str, contender: str) -> int:
    """In a fresh process: make the workload's tensor, warm up on a small one, then print how many bytes one call
    raised RSS by at its peak and kept after gc.collect() (the fallback's workspace is made by that call)."""
    shape, dtype, transposed = {**RSS_WORKLOADS, **QUICK_RSS_WORKLOADS}[workload]
    x = torch.empty(shape, dtype=dtype).normal_()
    tensors = [x.t() if transposed else x]
    fn: Kernel = _compiled if contender == "compiled" else fallback_multi_tensor_stats
    fn([torch.randn(1000).to(dtype)])  # torch's code pages and first-use state, outside the measurement
    release_workspace()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss_status()["VmRSS"]
    result = fn(tensors)
    peak = _rss_status()["VmHWM"] - before
    del result
    gc.collect()
    print(peak, _rss_status()["VmRSS"] - before)
    return 0


def measure_rss(workload: str, contender: str) -> tuple[float, float] | None:
    """(peak, kept) MiB of one call, measured by :func:`rss_child` in a fresh process; None where it cannot run."""
    child = subprocess.run(
        [sys.executable, __file__, "--rss-child", workload, contender],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if child.returncode != 0:
        print(f"  {workload} / {contender}: failed: {child.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    peak, kept = (int(v) / 2**20 for v in child.stdout.split())
    return peak, kept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 5, quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall time, or the calling thread's CPU time (steadier under load)")  # fmt: skip
    p.add_argument("--no-rss", action="store_true", help="skip the RSS measurements (fresh processes, Linux only)")
    p.add_argument("--rss-child", nargs=2, metavar=("WORKLOAD", "CONTENDER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        return rss_child(*args.rss_child)
    if not torch_gradstats.HAS_EXTENSION:
        print("bench_fallback: the compiled extension is not loaded (build it, and unset "
              "TORCH_GRADSTATS_FORCE_FALLBACK): nothing to compare the fallback with", file=sys.stderr)  # fmt: skip
        return 2
    if args.threads is not None:
        if args.threads < 1:
            print("bench_fallback: --threads must be >= 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 5)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    g = torch.Generator().manual_seed(0)
    n_large, n_tiny = (200, 20_000) if args.quick else (1000, 200_000)
    workloads = {
        f"{n_large:,} x 65,536 float32": [torch.randn(65_536, generator=g) for _ in range(n_large)],
        f"{n_tiny:,} tiny float32 (1-16 elements)": [torch.randn(1 + i % 16, generator=g) for i in range(n_tiny)],
        "one 128 MiB float16": [torch.randn(1 << 26, generator=g).to(torch.float16)],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}, "
          f"median of {rounds} interleaved rounds")  # fmt: skip
    print(f"{'workload':<40} {'compiled':>10} {'fallback':>10} {'old fallback':>13} {'fallback/compiled':>18} "
          f"{'old/compiled':>13}")  # fmt: skip
    for name, tensors in workloads.items():
        kernels: dict[str, Kernel] = {"compiled": _compiled, "fallback": fallback_multi_tensor_stats}
        old_rounds = rounds if "tiny" not in name else max(1, rounds // 2)  # the old fallback takes seconds here
        t = time_interleaved(kernels, tensors, rounds, clock)
        t_old = time_interleaved({"old": reference_multi_tensor_stats}, tensors, old_rounds, clock)["old"]
        print(f"{name:<40} {t['compiled'] * 1e3:>8.1f}ms {t['fallback'] * 1e3:>8.1f}ms {t_old * 1e3:>11.1f}ms "
              f"{t['fallback'] / t['compiled']:>17.1f}x {t_old / t['compiled']:>12.1f}x")  # fmt: skip
        del tensors

    numel = (1 << 22) if args.quick else (1 << 24)
    print(f"\npeak extra memory on one tensor of {numel:,} elements (x the tensor's own bytes)")
    print(f"{'dtype':<10} {'tensor':>10} {'compiled':>16} {'fallback':>16} {'old fallback':>18}")
    for dtype in (torch.float32, torch.bfloat16):
        x = [torch.randn(numel, generator=g).to(dtype)]
        size = numel * x[0].element_size()
        cells = []
        for fn in (_compiled, fallback_multi_tensor_stats, reference_multi_tensor_stats):
            release_workspace()  # the fallback keeps its CPU workspace between calls: measure the call that makes it
            peak = peak_allocated_bytes(lambda fn=fn, x=x: fn(x))
            cells.append(f"{peak / 2**20:8.2f} MiB {peak / size:5.2f}x")
        print(f"{str(dtype).replace('torch.', ''):<10} {size / 2**20:>6.0f} MiB " + " ".join(f"{c:>16}" for c in cells))
    del x

    if args.no_rss or not sys.platform.startswith("linux"):
        return 0
    print("\nprocess memory (RSS) of one call, fresh process each: raised at its peak / kept after gc.collect()")
    print("(goal for the fallback: peak at most 64 MiB above the inputs, at most 24 MiB kept, its workspace included)")
    print(f"{'workload':<32} {'compiled peak':>14} {'kept':>9} {'fallback peak':>14} {'kept':>9}")
    for name in QUICK_RSS_WORKLOADS if args.quick else RSS_WORKLOADS:
        cells = []
        for contender in ("compiled", "fallback"):
            got = measure_rss(name, contender)
            cells += ["n/a", "n/a"] if got is None else [f"{got[0]:.1f} MiB", f"{got[1]:.1f} MiB"]
        print(f"{name:<32} {cells[0]:>14} {cells[1]:>9} {cells[2]:>14} {cells[3]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
