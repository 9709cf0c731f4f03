"""The pure-PyTorch fallback against the compiled CPU kernel, side by side in one process.

Three contenders on the same inputs, timed in interleaved rounds (median of the rounds):

* ``compiled``: the fused CPU kernel (``torch.ops.torch_gradstats.multi_tensor_stats``; needs the extension);
* ``fallback``: :func:`torch_gradstats.fallback.fallback_multi_tensor_stats`, what every device without a compiled
  kernel runs;
* ``old fallback``: :func:`torch_gradstats.ops.reference_multi_tensor_stats`, the float64 reference, which is
  what the fallback was before (a whole float64 copy of each tensor, a dozen ops per tensor).

Workloads: 1,000 float32 tensors of 65,536 elements (256 MiB), 200,000 tiny float32 tensors of 1 to 16 elements,
and the peak extra memory of each kernel on one large tensor (float32 and bfloat16; the fallback's first call on a
thread, which makes the workspace it keeps), from torch's profiler memory
events (the CPU allocator's own allocations and frees, not RSS).

    python bench/bench_fallback.py              # ~2 min on a 2-core machine (the old fallback is the slow part)
    python bench/bench_fallback.py --quick      # smaller sizes, fewer rounds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_gradstats
from torch_gradstats.bench.timing import peak_allocated_bytes
from torch_gradstats.fallback import fallback_multi_tensor_stats, release_workspace
from torch_gradstats.ops import reference_multi_tensor_stats

Kernel = Callable[[list[torch.Tensor]], object]


def _compiled(tensors: list[torch.Tensor]) -> object:
    return torch.ops.torch_gradstats.multi_tensor_stats.default(tensors)


def time_interleaved(kernels: dict[str, Kernel], tensors: list[torch.Tensor], rounds: int) -> dict[str, float]:
    """Median seconds per call of each kernel, one call of each per round (so drift hits all alike)."""
    for fn in kernels.values():  # warm-up
        fn(tensors)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            fn(tensors)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per workload (default 5, quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
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
    g = torch.Generator().manual_seed(0)
    n_large, n_tiny = (200, 20_000) if args.quick else (1000, 200_000)
    workloads = {
        f"{n_large:,} x 65,536 float32": [torch.randn(65_536, generator=g) for _ in range(n_large)],
        f"{n_tiny:,} tiny float32 (1-16 elements)": [torch.randn(1 + i % 16, generator=g) for i in range(n_tiny)],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {rounds} interleaved rounds")
    print(f"{'workload':<40} {'compiled':>10} {'fallback':>10} {'old fallback':>13} {'fallback/compiled':>18} "
          f"{'old/compiled':>13}")  # fmt: skip
    for name, tensors in workloads.items():
        kernels: dict[str, Kernel] = {"compiled": _compiled, "fallback": fallback_multi_tensor_stats}
        old_rounds = rounds if "tiny" not in name else max(1, rounds // 2)  # the old fallback takes seconds here
        t = time_interleaved(kernels, tensors, rounds)
        t_old = time_interleaved({"old": reference_multi_tensor_stats}, tensors, old_rounds)["old"]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
