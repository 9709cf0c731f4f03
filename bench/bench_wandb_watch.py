"""A gradient-histogram logging step: ``wandb.watch(model, log="gradients")``'s recipe against ``grad_stats`` with
the exponent histogram, on GPT-2 small on the CPU.

The model is transformers' ``GPT2LMHeadModel`` with GPT-2 small's configuration (124M parameters in 148 tensors,
random weights, float32); one forward and backward pass on a batch of random tokens gives the gradients, and every
contender then runs a whole logging step over the same gradients:

``wandb_watch``
    What the hook ``wandb.watch(model, log="gradients")`` installs does on a logging step, by calling wandb's own
    code (``wandb/integration/torch/wandb_torch.py``, read in wandb 0.31.0; the run prints the version installed):
    for every parameter, ``TorchHistory.log_tensor_stats(p.grad.data, "gradients/" + name)`` (clone, flatten,
    upcast to float32, skip an all-non-finite tensor, drop NaN/Inf, ``min().item()``, ``max().item()``,
    ``histc(bins=64)``, ``linspace`` for the edges, ``wandb.Histogram(np_histogram=...)``, ``run._log``).
``grad_stats``
    The same per-parameter histograms from this project, in one read of the gradients:
    ``grad_stats(model.named_parameters(), histogram=True, per_tensor=True)``, its ``report()`` logged by
    ``WandbSink`` (norms, max, zero/NaN/Inf counts per parameter, the fp16/bf16/fp8 underflow and overflow
    fractions, the global exponent histogram) and each parameter's exponent histogram turned into a
    ``wandb.Histogram`` over log2|g| (``integrations.wandb.exponent_histogram``) and logged with ``run._log``.
``grad_stats_sink``
    What ``WandbSink`` logs by default: ``grad_stats(model.named_parameters(), histogram=True).report()`` with its
    one global exponent histogram (no per-parameter histograms).

W&B runs in ``mode="disabled"``: ``run.log`` and ``run._log`` are wandb's code paths but nothing is serialised or
sent, for any contender; no server, no network. The contenders run interleaved, one logging step each per
repetition, the order rotating every repetition, Python's garbage collector off; times are wall and the calling
thread's CPU time (``time.thread_time``, reported for one thread only), medians over the repetitions, with their
spread ((max - min) / median over the middle 80%); a ratio is the median of the per-repetition ratios.

A difference in what is logged: wandb's recipe drops NaN and Inf elements from its histogram (and logs nothing for
a gradient with no finite element); ``grad_stats`` counts them (``nan_count``, ``inf_count`` per parameter) and
its exponent histogram holds the finite non-zero elements, zeros counted apart.

    python bench/bench_wandb_watch.py [--quick] [--threads 2,1] [--repeats 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import torch_gradstats
from torch_gradstats.bench import machine_description, spread
from torch_gradstats.integrations.wandb import WandbSink, exponent_histogram
from torch_gradstats.stats.exponents import ExponentHistogram

WANDB_WATCH, GRAD_STATS, SINK = "wandb_watch", "grad_stats", "grad_stats_sink"


def build_model(quick: bool) -> torch.nn.Module:
    """GPT-2 small (transformers' GPT2LMHeadModel, random weights); --quick: 2 layers of width 64."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128, bos_token_id=0, eos_token_id=0
        )
    else:
        config = GPT2Config()  # GPT-2 small: 12 layers, d=768, vocabulary 50,257, 1,024 positions
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def backward_once(model: torch.nn.Module, batch: int, seq: int) -> None:
    """One forward and backward pass on random tokens: every parameter gets its ``.grad``."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    model(input_ids=tokens, labels=tokens).loss.backward()


def contenders(model: torch.nn.Module) -> dict[str, Callable[[], object]]:
    """The three logging steps on ``model``'s current gradients (a W&B run must be active)."""
    import wandb
    from wandb.integration.torch.wandb_torch import TorchHistory

    history = TorchHistory()  # the object whose hooks wandb.watch installs (run._torch)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    numel = {n: p.numel() for n, p in named}
    sink = WandbSink()

    def wandb_watch() -> None:
        for name, p in named:  # the body of the gradient hook's callback, per parameter
            history.log_tensor_stats(p.grad.data, "gradients/" + name)

    def grad_stats() -> None:
        stats = torch_gradstats.grad_stats(model.named_parameters(), histogram=True, per_tensor=True)
        sink.log(stats.report(), step=0)
        assert stats.exponent_histogram is not None
        rows = stats.exponent_histogram.tolist()
        hists = {f"gradients/{n}": exponent_histogram(ExponentHistogram(tuple(r), numel[n]))
                 for n, r in zip(stats.names, rows)}  # fmt: skip
        wandb.run._log(hists, commit=False)

    def grad_stats_sink() -> None:
        sink.log(torch_gradstats.grad_stats(model.named_parameters(), histogram=True).report(), step=0)

    return {WANDB_WATCH: wandb_watch, GRAD_STATS: grad_stats, SINK: grad_stats_sink}


def check(model: torch.nn.Module) -> None:
    """Both recipes histogram what they should on this model's gradients: wandb's bins hold every finite element,
    the exponent histograms every finite non-zero one."""
    import wandb
    from wandb.integration.torch.wandb_torch import TorchHistory

    run = wandb.run
    logged: dict[str, Any] = {}
    original = run._log
    run._log = lambda data, **kw: logged.update(data)  # catch what wandb's recipe hands to the run, once
    try:
        history = TorchHistory()
        for name, p in model.named_parameters():
            history.log_tensor_stats(p.grad.data, "gradients/" + name)
    finally:
        run._log = original
    for name, p in model.named_parameters():
        g = p.grad
        finite = int(torch.isfinite(g).sum())
        # histc's counts are float32: a bin over 2**24 elements (a mostly-zero embedding gradient) is rounded.
        assert abs(sum(logged["gradients/" + name].histogram) - finite) <= 1e-6 * finite, name
        hist = torch_gradstats.grad_stats([p], histogram=True).exponent_histogram
        assert hist is not None and int(hist.sum()) == int((torch.isfinite(g) & (g != 0)).sum()), name


@dataclasses.dataclass
class Measurement:
    threads: int
    times: dict[str, dict[str, list[float]]]  # clock -> contender -> ms per logging step, per repetition

    def clocks(self) -> list[str]:
        return [c for c in self.times if c == "wall" or self.threads == 1]

    def ratios(self, clock: str, num: str, den: str) -> list[float]:
        return [a / b for a, b in zip(self.times[clock][num], self.times[clock][den]) if b > 0]


def measure(steps: dict[str, Callable[[], object]], threads: int, repeats: int) -> Measurement:
    torch.set_num_threads(threads)
    names = list(steps)
    for name in names:
        steps[name]()  # warm-up
    times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in names} for c in ("wall", "thread")}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for k in range(len(names)):
                name = names[(r + k) % len(names)]
                w0, c0 = time.perf_counter(), time.thread_time()
                steps[name]()
                w1, c1 = time.perf_counter(), time.thread_time()
                times["wall"][name].append((w1 - w0) * 1e3)
                times["thread"][name].append((c1 - c0) * 1e3)
    finally:
        gc.enable()
    return Measurement(threads, times)


def run(threads: Sequence[int], repeats: int, quick: bool) -> tuple[torch.nn.Module, list[Measurement]]:
    """Build the model, one backward pass, check both recipes, then time the logging steps at each thread count."""
    import wandb

    before = torch.get_num_threads()
    model = build_model(quick)
    backward_once(model, batch=2 if quick else 4, seq=32 if quick else 256)
    own_run = wandb.run is None
    if own_run:
        wandb.init(mode="disabled")
    try:
        check(model)
        steps = contenders(model)
        results = [measure(steps, n, repeats) for n in threads]
    finally:
        torch.set_num_threads(before)
        if own_run:
            wandb.finish()
            wandb.teardown()  # the disabled mode stays in wandb's process-wide settings otherwise
    return model, results


def _pm(xs: Sequence[float]) -> str:
    s = spread(xs)
    return "-" if s is None else f"{s:.0%}"


def table(results: Sequence[Measurement]) -> str:
    head = ("| threads | clock | wandb_watch ms | grad_stats ms | grad_stats_sink ms | wandb_watch / grad_stats | "
            "wandb_watch / grad_stats_sink |")  # fmt: skip
    lines = [head, "|---:|---|---:|---:|---:|---:|---:|"]
    for m in results:
        for clock in m.clocks():
            t = m.times[clock]
            cells = [f"{statistics.median(t[n]):.1f} ± {_pm(t[n])}" for n in (WANDB_WATCH, GRAD_STATS, SINK)]
            ratios = [m.ratios(clock, WANDB_WATCH, n) for n in (GRAD_STATS, SINK)]
            cells += [f"**{statistics.median(r):.1f}x** ± {_pm(r)}" for r in ratios]
            lines.append(f"| {m.threads} | {clock} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer, width-64 model, 3 repetitions (smoke test)")
    p.add_argument(
        "--threads",
        type=_int_list,
        default=None,
        help="comma list of torch thread counts, each measured (default: torch's, then 1)",
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 9, 3 quick)")
    args = p.parse_args(argv)
    import wandb

    threads = args.threads or list(dict.fromkeys([torch.get_num_threads(), 1]))
    repeats = args.repeats or (3 if args.quick else 9)
    info = machine_description(torch.device("cpu"))
    info["wandb"] = wandb.__version__
    print("bench_wandb_watch  " + "  ".join(f"{k}: {v}" for k, v in info.items()))
    model, results = run(threads, repeats, args.quick)
    params = list(model.parameters())
    print(f"model: GPT2LMHeadModel, {len(params)} parameter tensors, {sum(p.numel() for p in params):,} elements "
          f"(float32); {repeats} interleaved repetitions; ms per logging step, median ± spread\n")  # fmt: skip
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
