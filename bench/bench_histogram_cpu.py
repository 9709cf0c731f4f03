"""What the exponent histogram costs on the CPU: ``multi_tensor_stats(tensors)`` against
``multi_tensor_stats(tensors, histogram=True)`` on the same GPT-2-shaped list, side by side in one run, with
``torch.sum`` over a flat float32 buffer of the same bytes as the yardstick of the plain op (the benchmark's
ceiling: the plain op must stay at its read rate).

The list is the benchmark's ``gpt2`` point (GPT-2-medium's 292 shapes, width scaled to ~128 MiB of float32; the
same shapes in bfloat16), in rotated copies that together exceed twice the last-level cache (each call reads the
copy after the one the previous call read). Two distributions of values (the histogram's cost depends on how many
binary exponents a block of elements holds; the plain op's does not): ``normal``, narrow Gaussian gradients
(a 4,096-element block spans ~15 binades), and ``heavy``, heavy-tailed gradients whose magnitudes are log-uniform
over 20 binades (2^-22 to 2^-2, random signs), so that every block holds ~20 exponents.

The three contenders run interleaved, one call each per repetition,
the order rotating every repetition, Python's garbage collector off. Every call is timed with two clocks at once:
wall time and the calling thread's CPU time (``time.thread_time``), which leaves out the time the process waits
to be scheduled on a machine shared with other work; it is reported for one thread only (with more, the worker
threads' time is not in it). Figures: the median over the repetitions and their spread, (max - min) / median over
the middle 80% (``torch_gradstats.bench.spread``); a ratio is the median of the per-repetition ratios.

Goals (printed as the benchmark prints its own: PASS, FAIL, or NOISY when the ratio's spread is wider than its
distance from the goal): with the histogram at most 1.25x the plain op's time for float32 and bfloat16; the plain
op at >= 0.9x (float32) / 0.8x (bfloat16) ``torch.sum``'s read rate, the benchmark's own CPU goal.

    python bench/bench_histogram_cpu.py [--quick] [--threads 2,1] [--repeats 41] [--dtypes f32,bf16]
                                        [--dists normal,heavy]
    python bench/bench_histogram_cpu.py --device cuda    # wall time, synchronised around every call
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import torch_gradstats
from torch_gradstats.bench import Point, Sample, machine_description, make_samples, sizes_for, spread
from torch_gradstats.bench.targets import too_noisy
from torch_gradstats.bench.workloads import fmt_bytes, last_level_cache_bytes

OP, HIST, SUM = "op", "op+histogram", "torch.sum"
#: What each contender runs on one input copy.
CONTENDERS: dict[str, Callable[[Sample], object]] = {
    OP: lambda s: torch_gradstats.multi_tensor_stats(s.tensors),
    HIST: lambda s: torch_gradstats.multi_tensor_stats(s.tensors, histogram=True),
    SUM: lambda s: torch.sum(s.flat),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
DISTS = ("normal", "heavy")
HEAVY_BINADES = (-22, -2)  # log2 |x| of the heavy-tailed values, uniform in this range
HIST_GOAL = 1.25  # op+histogram time / op time, at most
SUM_GOAL = {torch.float32: 0.9, torch.bfloat16: 0.8}  # torch.sum time / op time, at least


@dataclasses.dataclass
class Measurement:
    """One list (dtype) at one thread count: per-call times (ms) of every contender, per clock, per repetition."""

    dtype: torch.dtype
    dist: str
    threads: int
    n_tensors: int
    total_bytes: int
    times: dict[str, dict[str, list[float]]]  # clock ("wall" or "thread") -> contender -> ms per repetition

    def clocks(self) -> list[str]:
        """The clocks worth reporting: thread CPU time only when the op runs on the calling thread alone."""
        return [c for c in self.times if c == "wall" or self.threads == 1]

    def median(self, clock: str, name: str) -> float:
        return statistics.median(self.times[clock][name])

    def ratios(self, clock: str, num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(self.times[clock][num], self.times[clock][den]) if b > 0]


def _check(sample: Sample) -> None:
    """The two overloads agree on what both compute, and the histogram counts every finite non-zero element."""
    plain = torch_gradstats.multi_tensor_stats(sample.tensors)
    hist = torch_gradstats.multi_tensor_stats(sample.tensors, histogram=True)
    for a, b in zip(plain, hist[:3]):
        same = torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
        assert same, "multi_tensor_stats: the histogram overload changed the other statistics"
    counted = hist.exponent_histogram.sum(1)
    numel = torch.tensor([t.numel() for t in sample.tensors], device=counted.device)
    assert torch.equal(counted, numel - plain.counts.sum(1)), "exponent histogram: counts do not add up"


def make_heavy(samples: Sequence[Sample], seed: int) -> None:
    """Rewrites every tensor of ``samples`` in place with heavy-tailed values: |x| = 2^u, u uniform over
    HEAVY_BINADES, random signs (no zeros)."""
    gen = torch.Generator(device=samples[0].tensors[0].device).manual_seed(seed + 1)
    lo, hi = HEAVY_BINADES
    for sample in samples:
        for t in sample.tensors:
            u = torch.rand(t.shape, generator=gen, device=t.device) * (hi - lo) + lo
            sign = torch.randint(0, 2, t.shape, generator=gen, device=t.device) * 2 - 1
            t.copy_(torch.exp2(u) * sign)


def measure(samples: Sequence[Sample], dtype: torch.dtype, dist: str, threads: int, repeats: int,
            device: torch.device) -> Measurement:  # fmt: skip
    """Interleaved repetitions of the three contenders at ``threads`` torch threads; each call on the next copy."""
    torch.set_num_threads(threads)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    names = list(CONTENDERS)
    for i, name in enumerate(names):  # warm-up
        CONTENDERS[name](samples[i % len(samples)])
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}}
    if not cuda:
        times["thread"] = {n: [] for n in names}
    cursor = 0
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                sample = samples[cursor % len(samples)]
                cursor += 1
                sync()
                w0, c0 = time.perf_counter(), time.thread_time()
                CONTENDERS[name](sample)
                sync()
                w1, c1 = time.perf_counter(), time.thread_time()
                times["wall"][name].append((w1 - w0) * 1e3)
                if not cuda:
                    times["thread"][name].append((c1 - c0) * 1e3)
    finally:
        gc.enable()
    tensors = samples[0].tensors
    return Measurement(dtype, dist, threads, len(tensors), sum(t.numel() * t.element_size() for t in tensors), times)


def run(dtypes: Sequence[torch.dtype], threads: Sequence[int], repeats: int, quick: bool,
        device: torch.device, seed: int = 0, dists: Sequence[str] = DISTS) -> list[Measurement]:  # fmt: skip
    """Every dtype and distribution at every thread count (torch's thread count is restored afterwards)."""
    before = torch.get_num_threads()
    shapes = sizes_for(device, quick).gpt2
    llc = 0 if quick else last_level_cache_bytes(device)  # quick: one copy, read from cache
    out = []
    try:
        for dtype in dtypes:
            point = Point("gpt2", "gpt2", shapes, [dtype] * len(shapes))
            samples = make_samples(point, device, llc, seed, copy_target=False)
            for dist in dists:
                if dist == "heavy":
                    make_heavy(samples, seed)
                _check(samples[0])
                for n in threads:
                    out.append(measure(samples, dtype, dist, n, repeats, device))
            del samples
            gc.collect()
    finally:
        torch.set_num_threads(before)
    return out


def _pm(xs: Sequence[float]) -> str:
    s = spread(xs)
    return "-" if s is None else f"{s:.0%}"


def table(results: Sequence[Measurement]) -> str:
    """Markdown: medians (ms per call) with their spreads, and the two ratios with theirs."""
    head = ("| dtype | values | bytes | threads | clock | op ms | op+histogram ms | torch.sum ms | op+histogram / op | "
            "torch.sum / op (op's rate vs sum's) |")  # fmt: skip
    lines = [head, "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for m in results:
        dt = str(m.dtype).replace("torch.", "")
        for clock in m.clocks():
            t = m.times[clock]
            hist, ceil = m.ratios(clock, HIST, OP), m.ratios(clock, SUM, OP)
            lines.append(
                f"| {dt} | {m.dist} | {fmt_bytes(m.total_bytes)} | {m.threads} | {clock} | "
                f"{m.median(clock, OP):.2f} ± {_pm(t[OP])} | {m.median(clock, HIST):.2f} ± {_pm(t[HIST])} | "
                f"{m.median(clock, SUM):.2f} ± {_pm(t[SUM])} | **{statistics.median(hist):.2f}x** ± {_pm(hist)} | "
                f"{statistics.median(ceil):.2f}x ± {_pm(ceil)} |"
            )
    return "\n".join(lines)


def goals(results: Sequence[Measurement]) -> list[str]:
    """One line per goal, dtype, thread count and clock: [PASS], [FAIL] or [NOISY]."""
    out = []
    for m in results:
        dt = str(m.dtype).replace("torch.", "")
        for clock in m.clocks():
            where = f"gpt2 {dt} {m.dist}, {m.threads} thread{'s' if m.threads != 1 else ''}, {clock} clock"
            for label, reps, bound, at_most in (
                (f"op+histogram <= {HIST_GOAL:g}x op", m.ratios(clock, HIST, OP), HIST_GOAL, True),
                (f"op >= {SUM_GOAL.get(m.dtype, 0.8):g}x torch.sum's read rate", m.ratios(clock, SUM, OP),
                 SUM_GOAL.get(m.dtype, 0.8), False),
            ):  # fmt: skip
                value = statistics.median(reps)
                noisy, note = too_noisy(value, bound, reps)
                passed = value <= bound if at_most else value >= bound
                status = "NOISY" if noisy else ("PASS" if passed else "FAIL")
                within = sum((x <= bound) if at_most else (x >= bound) for x in reps)
                extra = f"; noisy, not judged ({note})" if noisy else f" (repeat spread {_pm(reps)})"
                out.append(f"[{status}] {where}: {label}: {value:.3g}x{extra}; {within}/{len(reps)} repetitions "
                           "within the goal")  # fmt: skip
    return out


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def _dtype_list(text: str) -> list[torch.dtype]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; choose from {', '.join(DTYPES)}")
    return [DTYPES[x] for x in names]


def _dist_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DISTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; choose from {', '.join(DISTS)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny list read from cache, 3 repetitions (smoke test)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--threads",
        type=_int_list,
        default=None,
        help="comma list of torch thread counts, each measured (default: torch's, then 1)",
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 41, 3 quick)")
    p.add_argument("--dtypes", type=_dtype_list, default=list(DTYPES.values()), help="comma list of f32, bf16")
    p.add_argument("--dists", type=_dist_list, default=list(DISTS), help="comma list of normal, heavy")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    threads = args.threads or list(dict.fromkeys([torch.get_num_threads(), 1]))
    repeats = args.repeats or (3 if args.quick else 41)
    info = machine_description(device)
    print("bench_histogram_cpu  " + "  ".join(f"{k}: {v}" for k, v in info.items()))
    shapes = sizes_for(device, args.quick).gpt2
    print(f"list: GPT-2-medium's structure, {len(shapes)} tensors, {fmt_bytes(4 * sum(map(_numel, shapes)))} in "
          f"float32; {repeats} interleaved repetitions; ms per call, median ± spread")  # fmt: skip
    lo, hi = HEAVY_BINADES
    print(f"values: normal = torch.randn; heavy = random signs, |x| = 2^u with u uniform in [{lo}, {hi}]")
    results = run(args.dtypes, threads, repeats, args.quick, device, dists=args.dists)
    print()
    print(table(results))
    print("\nGoals (ratios measured in this run):")
    for line in goals(results):
        print("  " + line)
    return 0


def _numel(shape: tuple) -> int:
    return int(torch.Size(shape).numel())


if __name__ == "__main__":
    raise SystemExit(main())
