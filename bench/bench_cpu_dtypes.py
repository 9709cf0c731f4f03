"""The fused CPU kernel per input dtype: its read rate against ``torch.sum`` and ``torch._foreach_norm``.

For float32, float16, bfloat16 and float64 lists with GPT-2's layer structure (24 layers at width 256: 30.6M
elements, the same shapes for every dtype) and for 10,000 tensors of 1,024 float32 elements, times the raw op
(``torch.ops.torch_gradstats.multi_tensor_stats``), ``torch._foreach_norm`` on the same list, and ``torch.sum`` over
one flat float32 buffer of the same bytes (the read-rate ceiling). The three run interleaved, each call reading the
next of several copies (together > 2x the last-level cache), and the ratios come from the same run.

``--clock thread`` times with the calling thread's CPU time (``time.thread_time``) instead of wall time: on a
machine shared with other jobs it does not count the time the process waits to be scheduled, so single-thread
figures stay comparable under load (it does not remove memory-bandwidth contention). Use it with ``--threads 1``.

    python bench/bench_cpu_dtypes.py [--threads 1 --clock thread] [--repeats 21] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import torch_gradstats
from torch_gradstats.bench import gpt2_shapes

SHAPES = gpt2_shapes(256)
LLC_BYTES = 32 << 20


def make_copies(shapes: list[tuple], dtype: torch.dtype) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    nbytes = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize
    copies = max(2, -(-2 * LLC_BYTES // nbytes))
    return [([torch.randn(s, dtype=dtype) for s in shapes], torch.randn(nbytes // 4)) for _ in range(copies)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=21, help="interleaved timed calls per contender")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--dtypes", default="float32,float16,bfloat16,float64")
    p.add_argument("--no-small", action="store_true", help="skip the 10,000 x 1,024 point")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    try:
        from torch_gradstats import _C

        capability = _C.cpu_capability()
    except (ImportError, AttributeError):
        capability = "n/a"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {args.clock}, extension "
          f"{torch_gradstats.HAS_EXTENSION}, CPU kernel {capability}")  # fmt: skip
    points = [(name, SHAPES, getattr(torch, name)) for name in args.dtypes.split(",")]
    if not args.no_small:
        points.append(("10000x1024 float32", [(1024,)] * 10_000, torch.float32))
    op = torch.ops.torch_gradstats.multi_tensor_stats.default
    contenders = {"op": lambda c: op(c[0]), "foreach_norm": lambda c: torch._foreach_norm(c[0]),
                  "sum": lambda c: c[1].sum()}  # fmt: skip
    print(f"{'point':<20} {'MiB':>5}  {'op ms':>8} {'foreach ms':>10} {'sum ms':>8}   sum/op  foreach/op  (medians)")
    for name, shapes, dtype in points:
        copies = make_copies(shapes, dtype)
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for fn in contenders.values():
            fn(copies[0])  # warm-up
        gc.disable()
        k = 0
        for r in range(args.repeats):
            order = list(contenders)[r % 3 :] + list(contenders)[: r % 3]
            for key in order:
                c = copies[k % len(copies)]
                k += 1
                t0 = clock()
                contenders[key](c)
                times[key].append(clock() - t0)
        gc.enable()
        med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        mib = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize / 2**20
        print(f"{name:<20} {mib:>5.0f}  {med['op']:>8.3f} {med['foreach_norm']:>10.3f} {med['sum']:>8.3f}   "
              f"{med['sum'] / med['op']:>6.2f}  {med['foreach_norm'] / med['op']:>10.2f}")  # fmt: skip
        del copies
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
