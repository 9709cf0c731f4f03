"""Host time per eager call on CUDA: the raw op, the Python entry point, grad_stats and _foreach_norm, side by side.

Two lists: 10,000 x 1,024 float32 and GPT-2-medium shapes (292 float32 tensors). Each figure is the median of 5
blocks of calls (20 or 100) timed with ``perf_counter`` before the block's synchronize: the host's enqueue time.
With the garbage collector off. Also: the raw op on one-element CPU copies of the same list (the dispatcher's and
the CPU kernel's per-tensor cost without CUDA), and ``list(ts)`` (a Python floor for this host).

    python bench/bench_host_cuda.py
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_gradstats
from torch_gradstats.bench import machine_description
from torch_gradstats.bench.workloads import GradsAsModule, as_params, gpt2_shapes

OP = torch.ops.torch_gradstats.multi_tensor_stats.default


def host_us(fn: Callable[[], object], calls: int, blocks: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def measure(name: str, ts: list[torch.Tensor]) -> None:
    module = GradsAsModule(as_params(ts))
    cpu = [t[:1].cpu() for t in ts]
    calls = 20 if len(ts) > 1000 else 100
    figures = {
        "raw op (torch.ops)": host_us(lambda: OP(ts), calls),
        "multi_tensor_stats": host_us(lambda: torch_gradstats.multi_tensor_stats(ts), calls),
        "grad_stats": host_us(lambda: torch_gradstats.grad_stats(module.named_parameters()), calls),
        "_foreach_norm": host_us(lambda: torch._foreach_norm(ts), calls),
        "raw op, 1-element CPU copies": host_us(lambda: OP(cpu), calls),
        "list(ts)": host_us(lambda: list(ts), calls),
    }
    per = " | ".join(f"{k} {v:.1f} us ({1e3 * v / len(ts):.0f} ns/tensor)" for k, v in figures.items())
    print(f"{name}: {per}", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    print("  ".join(f"{k}: {v}" for k, v in machine_description(torch.device("cuda")).items()))
    gc.disable()
    measure("10,000 x 1,024 float32", [torch.randn(1024, device="cuda") for _ in range(10_000)])
    measure("GPT-2-medium shapes, 292 float32", [torch.randn(s, device="cuda") for s in gpt2_shapes(1024)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
