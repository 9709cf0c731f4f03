"""The fused CPU kernel per input dtype: its read rate against ``torch.sum`` and ``torch._foreach_norm``.

For float32, float16, bfloat16 and float64 lists with GPT-2's layer structure (~128 MiB of float32, the same shapes
for every dtype) and for 10,000 tensors of 1,024 float32 elements, times the raw op (``fused_raw_op``), the public
wrapper (``fused``), ``_foreach_norm`` and ``torch.sum`` over a flat float32 buffer of the same bytes, interleaved
in one process (see ``torch_gradstats.bench``), and prints each one's share of the ``torch.sum`` read rate.

    python bench/bench_cpu_dtypes.py [--repeats 9] [--threads N] [--dtypes float32,bfloat16] [--no-small]
"""

from __future__ import annotations

import argparse

import torch

import torch_gradstats
from torch_gradstats.bench import CONTENDERS, SUM_CEILING, Point, gpt2_shapes, run_point

SHAPES = gpt2_shapes(256)  # GPT-2 medium's 24 layers at width 256
NAMES = ("fused_raw_op", "fused", "foreach_norm", SUM_CEILING)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9, help="interleaved timed runs per contender (>= 5)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--dtypes", default="float32,float16,bfloat16,float64")
    p.add_argument("--no-small", action="store_true", help="skip the 10,000 x 1,024 point")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, extension: {torch_gradstats.HAS_EXTENSION}")
    points = [Point(name, "gpt2-384", SHAPES, [getattr(torch, name)] * len(SHAPES)) for name in args.dtypes.split(",")]
    if not args.no_small:
        points.append(Point("float32", "10000x1024", [(1024,)] * 10_000, [torch.float32] * 10_000))
    print(f"{'point':<22} {'MiB':>6} " + " ".join(f"{n + ' ms':>15}" for n in NAMES) + "  raw/sum  raw/foreach")
    for point in points:
        rows = {r.contender: r for r in run_point(point, {n: CONTENDERS[n] for n in NAMES}, torch.device("cpu"),
                                                  repeats=args.repeats, min_seconds=0.5)}  # fmt: skip
        ms = {n: rows[n].time_ms for n in NAMES}
        print(f"{point.workload + ' ' + point.label:<22} {point.total_bytes / 2**20:>6.0f} "
              + " ".join(f"{ms[n]:>15.3f}" for n in NAMES)
              + f"  {ms[SUM_CEILING] / ms['fused_raw_op']:>7.2f}  {ms['foreach_norm'] / ms['fused_raw_op']:>11.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
