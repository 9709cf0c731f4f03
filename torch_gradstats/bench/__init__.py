"""The benchmark: ``python -m torch_gradstats bench [--device cpu|cuda] [--quick] [--out DIR] ...``.

Times the fused op against what users run today, side by side in one process so that the ratios hold on a noisy
machine, and prints the project's speed goals as PASS/FAIL lines. One module per responsibility:

=============  ==================================================================================================
module         what it holds
=============  ==================================================================================================
workloads      the points: GPT-2-medium shapes, 4 x 256M, 10,000 x 1,024, a tensor-count series and a size sweep,
               each large list in float32, bfloat16, float16, float64 and a bfloat16+float32 mix; sizes per
               device (the CPU gets the same structure scaled to ~128 MiB); the random inputs, rotated between
               copies so that no call reads what the previous one left in the cache
contenders     what each contender runs (fused op, raw op, grad_stats, the pure-PyTorch fallback, _foreach_norm,
               composites eager and compiled, Lightning's grad_norm, get_total_norm, the original collector,
               the torch.sum and copy ceilings) and the check that its output agrees with the float64 reference
timing         how one point is measured: device time (replayed CUDA graph), eager time (a loop, synchronised at
               the end), host (enqueue) time; wall time on CPU; interleaved blocks, medians
report         the Row, its ratios (GB/s, % of torch.sum, fused faster by), CSV, text and markdown tables, plots
targets        the goals, evaluated on the rows of one run
env            what was measured on (versions, commit, CPU, GPU, driver); every external tool is optional
main           the command line, the run over all points (with time and torch.compile budgets), the output files
=============  ==================================================================================================

Everything ``bench`` needs at run time is in this package (it runs from an installed wheel); tqdm and matplotlib
are optional (no progress bar, no plots without them). Method and how to read the output: docs/bench.md.
"""

from .contenders import (
    CONTENDERS,
    COPY_CEILING,
    FUSED,
    SUM_CEILING,
    Contender,
    check_contender,
    composite_stats,
    original_collector,
)
from .env import machine_description
from .main import build_parser, main, run
from .report import CSV_COLUMNS, Row, fill_ratios, format_table, read_csv, write_csv, write_markdown
from .targets import Target, evaluate_targets, fit_line, spread
from .timing import run_point
from .workloads import DTYPES, WORKLOADS, Point, Sample, build_points, gpt2_shapes, make_samples, sizes_for

__all__ = [
    "CONTENDERS",
    "COPY_CEILING",
    "CSV_COLUMNS",
    "DTYPES",
    "FUSED",
    "SUM_CEILING",
    "WORKLOADS",
    "Contender",
    "Point",
    "Row",
    "Sample",
    "Target",
    "build_parser",
    "build_points",
    "check_contender",
    "composite_stats",
    "evaluate_targets",
    "fill_ratios",
    "fit_line",
    "format_table",
    "gpt2_shapes",
    "machine_description",
    "main",
    "make_samples",
    "original_collector",
    "read_csv",
    "run",
    "run_point",
    "sizes_for",
    "spread",
    "write_csv",
    "write_markdown",
]
