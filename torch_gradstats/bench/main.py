"""``python -m torch_gradstats bench``: options, the run over all points, and what it prints and writes."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

from .contenders import COMPILED, CONTENDERS, Contender, lightning_grad_norm
from .env import machine_description
from .report import Row, format_table, make_plots, write_csv, write_markdown
from .targets import evaluate_targets
from .timing import run_point
from .workloads import DTYPES, LARGE_WORKLOADS, WORKLOADS, Point, build_points, sizes_for

#: A compile's time is guessed as at least the first number (seconds; the smaller of it and the last compile's
#: time once one ran), else per tensor as the second (before a first compile) or as the last compile took.
_COMPILE_GUESS = {"cpu": (20.0, 0.25), "cuda": (10.0, 0.2)}


#: Contenders of the count series (host or wall time per call vs number of tensors).
COUNT_CONTENDERS = ("fused", "fused_raw_op", "grad_stats", "foreach_norm", "get_total_norm", "ceiling_sum")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block: the message says what to fix
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text}")
    return value


def _seed(text: str) -> int:
    lo, hi = -(2**63), 2**64 - 1  # what torch's generators take
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {value}")
    return value


def _names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m torch_gradstats bench",
        description="Time the fused multi_tensor_stats op against what users run today (_foreach_norm, composites, "
        "Lightning's grad_norm, get_total_norm, the original collector, the pure-PyTorch fallback) and the memory "
        "ceilings, side by side in one run; print the table and the speed goals as PASS/FAIL lines.",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--workloads", type=_names(WORKLOADS), default=list(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--dtypes", type=_names(DTYPES), default=list(DTYPES),
                   help=f"dtypes of the large lists (gpt2, big4): comma list of {', '.join(DTYPES)} (default: all)")
    p.add_argument("--contenders", type=_names(CONTENDERS), default=None,
                   help=f"comma list of {', '.join(CONTENDERS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (smoke test)")
    p.add_argument("--repeats", type=_positive_int, default=None,
                   help="minimum interleaved repetitions per point (default 9, 3 with --quick); "
                   "cheap points get more, up to 200")
    p.add_argument("--warmup", type=_positive_int, default=1, help="untimed calls per contender first (default 1)")
    p.add_argument("--out", default=None, help="directory for bench_<device>.csv/.md and the PNG plots")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--budget-s", type=_seconds, default=0.0,
                   help="start no new point after this many seconds (0: no limit); the rows so far are written")
    p.add_argument("--compile-budget-s", type=_seconds, default=None,
                   help="seconds torch.compile may take in all (compiled_composite; default 0 with --quick, else "
                   "120); a compile expected to take longer than what is left is skipped with a note")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random inputs (default 0)")
    return p


def _progress(items: list, enabled: bool) -> Iterable:
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(items, desc="bench", unit="point", file=sys.stderr, leave=False)
        except ImportError:
            pass
    return items


class _CompilePlan:
    """Decides, point by point, whether compiled_composite is compiled (its time counts against the budget)."""

    def __init__(self, device: str, budget_s: float) -> None:
        self.left = budget_s
        self.fixed, self.per_tensor = _COMPILE_GUESS[device]

    def skip_reason(self, pt: Point, run_left_s: float | None) -> str | None:
        if pt.workload not in LARGE_WORKLOADS:
            return "skipped: compiled only on the large lists (compile time grows with the tensor count)"
        guess = max(self.fixed, self.per_tensor * len(pt.shapes))
        left = self.left if run_left_s is None else min(self.left, run_left_s / 2)
        if guess > left:
            return f"skipped: compile would take ~{guess:.0f} s, {max(left, 0):.0f} s of compile budget left"
        return None

    def spent(self, pt: Point, rows: list[Row]) -> None:
        took = next((r.compile_s for r in rows if r.contender == COMPILED and r.compile_s == r.compile_s), None)
        if took is not None:
            self.left -= took
            self.fixed, self.per_tensor = min(self.fixed, took), took / len(pt.shapes)


def run(
    device: torch.device,
    workloads: Sequence[str],
    contenders: dict[str, Contender],
    *,
    quick: bool,
    repeats: int,
    dtypes: Sequence[str] = tuple(DTYPES),
    warmup: int = 1,
    seed: int = 0,
    progress: bool = False,
    budget_s: float = 0.0,
    compile_budget_s: float = 120.0,
    on_point: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Run the selected points; all rows (one per contender per point).

    ``budget_s`` > 0: start no new point once that many seconds have passed (the rest is reported as not run).
    ``on_point`` is called with the new point's rows after each point (e.g. to print them and keep a CSV current).
    """
    points = build_points(workloads, dtypes, sizes_for(device, quick))
    plan = _CompilePlan(device.type, compile_budget_s)
    rows: list[Row] = []
    t0 = time.perf_counter()
    for i, pt in enumerate(_progress(points, progress)):
        elapsed = time.perf_counter() - t0
        if budget_s > 0 and elapsed > budget_s:
            skipped = ", ".join(f"{p.workload}/{p.label}/{p.dtype_label}" for p in points[i:])
            print(f"bench: time budget of {budget_s:g} s spent; not run: {skipped}", file=sys.stderr)
            break
        chosen, skipped_c = dict(contenders), {}
        if pt.workload == "count":  # the per-call cost series: the per-tensor composites would dominate the run
            chosen = {n: c for n, c in chosen.items() if n in COUNT_CONTENDERS}
        if COMPILED in chosen:
            why = plan.skip_reason(pt, budget_s - elapsed if budget_s > 0 else None)
            if why:
                del chosen[COMPILED]
                skipped_c[COMPILED] = why
        new = run_point(pt, chosen, device, repeats=repeats, warmup=warmup, seed=seed,
                        min_seconds=0.01 if quick else 0.25, block_s=5e-4 if quick else 2e-3,
                        count_launches=pt.workload not in ("sweep", "count"), rotate=not quick,
                        skipped=skipped_c)  # fmt: skip
        plan.spent(pt, new)
        order = list(contenders)
        new.sort(key=lambda r: order.index(r.contender))  # a skipped contender keeps its place in the table
        rows += new
        if on_point is not None:
            on_point(new)
    return rows


def _check_device(text: str) -> torch.device | str:
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        return f"bad --device {text!r}: {exc}"
    if device.type not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {text!r}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "--device cuda asked for, but torch sees no CUDA device"
    return device


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_gradstats bench``; returns the process exit code. Called in-process (tests,
    notebooks), it leaves torch's thread count and the garbage collector as it found them."""
    threads = torch.get_num_threads()
    try:
        return _main(argv)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    device = _check_device(args.device)
    if isinstance(device, str):
        print(f"bench: {device}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    repeats = args.repeats or (3 if args.quick else 9)
    names = args.contenders or list(CONTENDERS)
    contenders = {n: CONTENDERS[n] for n in CONTENDERS if n in names}
    compile_budget = args.compile_budget_s if args.compile_budget_s is not None else (0.0 if args.quick else 120.0)
    if args.threads:
        torch.set_num_threads(args.threads)

    info = machine_description(device)
    if "lightning_grad_norm" in contenders:
        info["lightning_grad_norm"] = lightning_grad_norm()[1]
    print("torch_gradstats bench  " + "  ".join(f"{k}: {v}" for k, v in info.items()))
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
        print(f"WARNING: the machine is busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): "
              "absolute times will be noisy; the interleaved ratios hold better.")  # fmt: skip
    if "fallback" in info["fused op kernel"]:
        print("NOTE: the fused op runs its pure-PyTorch fallback here; its timings are not the fused kernel's.")
    if args.quick:
        print("NOTE: --quick: tiny lists read from cache, few repetitions, no torch.compile (unless "
              "--compile-budget-s is given): a smoke test; its goal lines mean little.")

    out = Path(args.out) if args.out else None
    csv_path = out / f"bench_{device.type}.csv" if out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    done: list[Row] = []

    def on_point(new: list[Row]) -> None:  # print as we go, so a run cut short still shows what it measured
        print(("\n" if done else "") + format_table(new, header=not done), flush=True)
        done.extend(new)
        if csv_path:
            write_csv(done, csv_path)

    gc.freeze()  # what is imported by now stays: the collections between points then walk only the new objects
    t0 = time.perf_counter()
    print()
    rows = run(device, args.workloads, contenders, quick=args.quick, repeats=repeats, dtypes=args.dtypes,
               warmup=args.warmup, seed=args.seed, progress=not args.no_progress, budget_s=args.budget_s,
               compile_budget_s=compile_budget, on_point=on_point)  # fmt: skip
    targets = [t.line() for t in evaluate_targets(rows, device.type, threads=None if cuda else torch.get_num_threads())]
    print("\nGoals (ratios measured in this run):")
    for line in targets:
        print("  " + line)
    print(f"\nbench: {len(rows)} rows in {time.perf_counter() - t0:.1f} s")

    if out and csv_path:
        write_csv(rows, csv_path)
        plots = [] if args.no_plots else make_plots(rows, out, device.type)
        md_path = out / f"bench_{device.type}.md"
        write_markdown(rows, targets, info, md_path, plots)
        print(f"bench: wrote {csv_path}, {md_path}" + "".join(f", {out / p}" for p in plots))
    return 0
