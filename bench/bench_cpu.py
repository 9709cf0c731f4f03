"""The CPU acceptance check: the fused op against ``torch._foreach_norm`` and the composite users write today.

A list of 64 float32 tensors of about 128 MiB (16 transformer-like blocks of four matrices), random normal. Times
the median of >= 5 interleaved runs of each contender (plus ``torch.sum`` over a flat buffer of the same bytes as the
memory ceiling) and prints a table with time, GB/s and ratios, then the two CPU targets as PASS/FAIL.

    .venv/bin/python bench/bench_cpu.py [--repeats 7] [--threads N] [--csv FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import torch_gradstats
from torch_gradstats.bench import (
    CONTENDERS,
    FUSED,
    SUM_CEILING,
    Point,
    evaluate_targets,
    format_table,
    machine_description,
    run_point,
    write_csv,
)

D = 432  # block width: 16 blocks x (d*3d + 3d + d*4d + 4d*d) float32 elements = 125 MiB


def shapes(d: int = D, blocks: int = 16) -> list[tuple[int, ...]]:
    """64 tensors: per block a QKV matrix, its bias, and the two MLP matrices."""
    return [s for _ in range(blocks) for s in ((d, 3 * d), (3 * d,), (d, 4 * d), (4 * d, d))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed runs per contender (>= 5)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5 (median of at least five runs)")
    if args.threads:
        torch.set_num_threads(args.threads)

    sh = shapes()
    point = Point("cpu64", f"{len(sh)} tensors", sh, [torch.float32] * len(sh))
    names = (FUSED, "foreach_norm", "composite", SUM_CEILING)
    info = machine_description(torch.device("cpu"))
    print("  ".join(f"{k}: {v}" for k, v in info.items()))
    if not torch_gradstats.HAS_EXTENSION:
        print("NOTE: compiled extension not loaded: 'fused' is the pure-PyTorch fallback here.")
    # min_seconds=0: exactly --repeats timed runs, no extra ones for cheap calls (these calls are not cheap).
    rows = run_point(point, {n: CONTENDERS[n] for n in names}, torch.device("cpu"), repeats=args.repeats,
                     warmup=1, min_seconds=0.0)  # fmt: skip
    print(format_table(rows))
    fused = next(r for r in rows if r.contender == FUSED)
    for r in rows:
        if r.contender != FUSED:
            print(f"fused vs {r.contender}: {r.vs_fused:.2f}x")
    print(f"fused read rate: {fused.gbps:.2f} GB/s = {fused.pct_ceiling:.0f}% of torch.sum over the same bytes")
    targets = evaluate_targets(rows, "cpu", large_workloads=("cpu64",))
    for t in targets:
        print(t.line())
    if args.csv:
        write_csv(rows, Path(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
