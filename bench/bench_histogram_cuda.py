"""The op with and without its exponent histogram, side by side: time per call of ``multi_tensor_stats`` (the plain
overload) and of ``multi_tensor_stats.histogram`` on the same list, and their ratio.

Lists: GPT-2-medium shapes (292 tensors, 355M elements) in float32, bfloat16 and float16, and 10,000 x 1,024
float32, filled like gradients (normal values times 1e-3, so that the exponents bunch in a few buckets as real
gradients' do: the histogram's shared-memory atomics then collide, its costly case). On CUDA each figure is device
time per call: one CUDA graph holding calls on ``COPIES`` copies of the list (so that a small list is not served
from L2), replayed back to back and timed with events; the two overloads alternate, and each figure is the median
of ``ROUNDS`` rounds. On the CPU (``--device cpu``): wall time per call, median of the rounds.

    python bench/bench_histogram_cuda.py [--device cuda|cpu] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_gradstats  # noqa: F401  (registers the op)
from torch_gradstats.bench import machine_description
from torch_gradstats.bench.workloads import gpt2_shapes

PLAIN = torch.ops.torch_gradstats.multi_tensor_stats.default
HISTOGRAM = torch.ops.torch_gradstats.multi_tensor_stats.histogram
ROUNDS = 5


def graph_us(calls: list[Callable[[], object]], reps: int) -> float:
    """Device time per call: the calls captured into one CUDA graph, replayed `reps` times back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()  # warm-up (the op writes its metadata here)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def wall_us(calls: list[Callable[[], object]], reps: int) -> float:
    for c in calls:
        c()
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in calls:
            c()
    return (time.perf_counter() - t0) * 1e6 / (reps * len(calls))


def measure(label: str, lists: list[list[torch.Tensor]], device: str) -> tuple[float, float]:
    timer = graph_us if device == "cuda" else wall_us
    plain = [lambda ts=ts: PLAIN(ts) for ts in lists]
    hist = [lambda ts=ts: HISTOGRAM(ts) for ts in lists]
    t = time.perf_counter()
    hist[0]()
    if device == "cuda":
        torch.cuda.synchronize()
    one = time.perf_counter() - t
    reps = max(3, min(200, int(0.2 / max(one, 1e-6) / len(lists))))  # ~0.2 s per figure
    rounds: dict[str, list[float]] = {"plain": [], "histogram": []}
    for _ in range(ROUNDS):
        rounds["plain"].append(timer(plain, reps))
        rounds["histogram"].append(timer(hist, reps))
    p, h = statistics.median(rounds["plain"]), statistics.median(rounds["histogram"])
    nbytes = sum(t.numel() * t.element_size() for t in lists[0])
    print(f"{label:<28} plain {p:10.2f} us ({nbytes / p / 1e3:7.1f} GB/s)   histogram {h:10.2f} us "
          f"({nbytes / h / 1e3:7.1f} GB/s)   histogram / plain {h / p:5.2f}", flush=True)
    return p, h


def gradient_like(shapes: list[tuple], dtype: torch.dtype, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(s, device=device, generator=gen) * 1e-3).to(dtype) for s in shapes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small lists (a smoke test of the script)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device cpu)")
        return 2
    fused = torch._C._dispatch_has_kernel_for_dispatch_key(
        "torch_gradstats::multi_tensor_stats.histogram", "CUDA" if args.device == "cuda" else "CPU")
    print(", ".join(f"{k}: {v}" for k, v in machine_description(torch.device(args.device)).items()))
    print(f"histogram overload kernel: {'compiled' if fused else 'pure-PyTorch fallback'}")
    gen = torch.Generator(device=args.device).manual_seed(0)
    shapes = gpt2_shapes(64, n_layer=2, vocab=1000, n_ctx=128) if args.quick else gpt2_shapes()
    small = (100, 256) if args.quick else (10_000, 1024)
    copies = 4 if args.device == "cuda" else 1
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lists = [gradient_like(shapes, dtype, args.device, gen)]
        label = f"gpt2 {str(dtype)[6:]} ({len(shapes)} tensors)"
        results.append((label, *measure(label, lists, args.device)))
        del lists
    lists = [gradient_like([(small[1],)] * small[0], torch.float32, args.device, gen) for _ in range(copies)]
    label = f"{small[0]} x {small[1]} float32"
    results.append((label, *measure(label, lists, args.device)))
    print("summary: histogram / plain: " + ", ".join(f"{r[0]} {r[2] / r[1]:.2f}" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
