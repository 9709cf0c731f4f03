"""``python -m torch_gradstats demo``: train a small model on synthetic data and watch its gradients.

Everything is generated locally (no downloads): a 3-class problem of noisy concentric rings in 2-d, lifted to 16
features, learned by a small MLP with :class:`torch_gradstats.training.Trainer`. With ``--inject-nan STEP`` one
named parameter's gradient is set to NaN at that optimizer step; the demo then names that step and parameter, the
step is skipped on the device (fused Adam's ``found_inf``), and training goes on.

Outputs in ``--out`` (default ``runs/demo``): ``gradstats.png`` (loss, global gradient norm, health and non-finite
counts over steps) and ``log.jsonl`` (one JSON object per step with stats and one per epoch; non-finite numbers are
written as ``null``). Without ``--inject-nan`` nothing goes non-finite, and the figure's non-finite panel says so.

While training, a tqdm progress bar over the optimizer steps goes to stderr when stderr is a terminal (not in a
pipe or a file; ``--no-progress`` turns it off); the per-epoch table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.training import EpochSummary, Trainer, format_epoch_table, validate_device

__all__ = ["DemoResult", "build_parser", "main", "make_data", "make_model", "run"]

FEATURES, CLASSES, BATCH, STEPS_PER_EPOCH = 16, 3, 64, 25


def make_data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """Noisy concentric rings (one per class) in 2-d, mixed into ``FEATURES`` dims by a fixed random matrix."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    radius = 1.0 + y.float() + 0.25 * torch.randn(n, generator=g)
    angle = 2 * math.pi * torch.rand(n, generator=g)
    xy = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    mix = torch.randn(2, FEATURES, generator=torch.Generator().manual_seed(1234)) / math.sqrt(2)
    x = xy @ mix + 0.05 * torch.randn(n, FEATURES, generator=g)
    return x, y


def make_model(seed: int) -> nn.Module:
    """A small MLP with readable parameter names (``embed.weight``, ``hidden.weight``, ``head.bias``, ...)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(FEATURES, 64),
            act1=nn.GELU(),
            hidden=nn.Linear(64, 64),
            act2=nn.GELU(),
            head=nn.Linear(64, CLASSES),
        )
    )


@dataclass
class DemoResult:
    """What :func:`run` produced."""

    summaries: list[EpochSummary]
    accuracy: float  #: accuracy on a held-out synthetic set after training
    seconds: float
    plot: Path | None
    log: Path


def _epoch_batches(x: Tensor, y: Tensor, n_batches: int, g: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    order = torch.randperm(x.shape[0], generator=g)
    return [(x[idx], y[idx]) for idx in order[: n_batches * BATCH].split(BATCH)]


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN/Infinity; the counts say what it was
    return v


def _write_log(path: Path, summaries: Sequence[EpochSummary], meta: dict[str, Any]) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"type": "run", **meta}, allow_nan=False) + "\n")
        for s in summaries:
            for r in s.history:
                rec = {k: _json_number(v) for k, v in r.to_dict().items()}
                f.write(json.dumps({"type": "step", **rec}, allow_nan=False) + "\n")
            rec = {k: _json_number(v) for k, v in s.to_dict().items()}
            f.write(json.dumps({"type": "epoch", **rec}, allow_nan=False) + "\n")


#: What the table's columns are (printed once above it): every norm is a global L2 norm over all gradients.
TABLE_KEY = (
    "max_norm, mean_norm: largest and mean global L2 gradient norm of the epoch's steps; "
    "min_health: its worst step's health"
)


def _terminal_size(stream: Any) -> tuple[int, int]:
    """Columns and rows of the terminal ``stream`` writes to, 80x24 where it reports none: a pseudo-terminal
    nobody sized (``script``, some CI runners and containers) says 0x0, and tqdm then draws nothing at all."""
    try:
        cols, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        cols, rows = 0, 0
    return cols if cols > 0 else 80, rows if rows > 0 else 24


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _progress_bar(progress: bool | None, total: int) -> Any:
    """The demo's tqdm bar over its optimizer steps, on stderr; None when ``progress`` is False, when it is None and
    stderr is not a terminal, or without tqdm."""
    if progress is False or (progress is None and not _stderr_isatty()):
        return None
    try:
        from tqdm import tqdm  # lazy: only the demo needs it
    except ImportError:
        if progress:
            print("tqdm is not installed: no progress bar (pip install tqdm)", file=sys.stderr)
        return None
    cols, rows = _terminal_size(sys.stderr)
    return tqdm(total=total, desc="demo", unit="step", file=sys.stderr, ncols=cols, nrows=rows, leave=True)


def _figure(summaries: Sequence[EpochSummary], inject_step: int | None) -> Any:
    """The demo's matplotlib figure (four panels over the optimizer steps), from the per-step history."""
    import matplotlib  # lazy: only the demo needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for s in summaries for r in s.history]
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True, constrained_layout=True)
    bad_rows = [r for r in rows if r.nan_count + r.inf_count > 0]
    bad = [r.step for r in bad_rows]

    axes[0].plot(steps, [r.loss for r in rows], color="tab:blue", lw=1.2)
    axes[0].set_ylabel("loss (per sample)")
    # Non-finite norms become NaN: a gap in the line where the gradient went bad.
    axes[1].plot(steps, [r.total_norm if math.isfinite(r.total_norm) else math.nan for r in rows],
                 color="tab:purple", lw=1.2)
    axes[1].set_yscale("log")
    axes[1].set_ylabel("global grad norm")
    axes[2].plot(steps, [r.health for r in rows], color="tab:green", lw=1.2)
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_ylabel("health")
    axes[3].bar(steps, [r.nan_count for r in rows], color="tab:red", width=1.0, label="NaN")
    axes[3].bar(steps, [r.inf_count for r in rows], bottom=[r.nan_count for r in rows], color="tab:orange",
                width=1.0, label="Inf")
    # A bar one step wide can be thinner than a pixel on a long run: a marker on top keeps each bad step visible.
    axes[3].plot(bad, [r.nan_count + r.inf_count for r in bad_rows], "v", color="tab:red", markersize=7,
                 label="_nolegend_")
    top = max((r.nan_count + r.inf_count for r in bad_rows), default=0)
    axes[3].set_ylim(0, max(1.0, top * 1.15))  # counts: never a negative axis, room above the highest bar
    axes[3].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[3].set_ylabel("non-finite grad elements")
    axes[3].set_xlabel("optimizer step")
    if bad:
        axes[3].legend(loc="upper right")
    else:
        axes[3].text(0.5, 0.5, "no NaN or Inf gradient in this run (--inject-nan STEP makes one)",
                     transform=axes[3].transAxes, ha="center", va="center", color="tab:green", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        for b in bad:
            ax.axvline(b, color="tab:red", alpha=0.35, lw=1, ls="--")
    for s in summaries[1:]:
        if s.history:
            for ax in axes:
                ax.axvline(s.history[0].step - 0.5, color="gray", alpha=0.25, lw=0.8)
    first = next((s for s in summaries if s.first_nonfinite_step is not None), None)
    row = next((r for r in bad_rows if first is not None and r.step == first.first_nonfinite_step), None)
    if first is not None and row is not None:
        what = " and ".join(f"{n} {kind}" for n, kind in ((row.nan_count, "NaN"), (row.inf_count, "Inf")) if n)
        axes[3].annotate(
            f"step {row.step}: {what} (first in {first.first_nonfinite_param})"
            + ("; step skipped" if row.skipped else ""),
            xy=(row.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(5, -14),
            textcoords="offset points",
            color="tab:red",
            fontsize=9,
        )
    title = "torch_gradstats demo: gradient telemetry over training"
    if inject_step is not None:
        title += f" (NaN injected at step {inject_step})"
    fig.suptitle(title)
    return fig


def _plot(path: Path, summaries: Sequence[EpochSummary], inject_step: int | None) -> None:
    import matplotlib.pyplot as plt

    fig = _figure(summaries, inject_step)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def run(
    steps: int = 200,
    inject_nan: int | None = None,
    inject_param: str = "hidden.weight",
    out: str | Path = "runs/demo",
    seed: int = 0,
    progress: bool | None = None,
    device: str | None = None,
    plot: bool = True,
    tensorboard: str | Path | None = None,
) -> DemoResult:
    """Train the demo model for ``steps`` optimizer steps; print the per-epoch table; write the plot and log."""
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    dev = validate_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = make_model(seed).to(dev)
    names = [n for n, _ in model.named_parameters()]
    if inject_param not in names:
        raise ValueError(f"--inject-param {inject_param!r} is not a parameter of the demo model; one of {names}")
    if inject_nan is not None and not 0 <= inject_nan < steps:
        raise ValueError(f"--inject-nan {inject_nan} is outside the run's optimizer steps 0..{steps - 1}")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    x, y = make_data(STEPS_PER_EPOCH * BATCH, seed)
    x_test, y_test = make_data(2000, seed + 1)
    x, y, x_test, y_test = x.to(dev), y.to(dev), x_test.to(dev), y_test.to(dev)
    # fused=True: skip_nonfinite skips on the device, through the optimizer's found_inf (no host sync).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4, fused=True)

    bar: Any = None

    def after_backward(trainer: Trainer) -> None:
        if trainer.global_step == inject_nan:
            grad = dict(trainer.model.named_parameters())[inject_param].grad
            if grad is not None:
                grad.fill_(float("nan"))
        if bar is not None:
            bar.update(1)

    trainer = Trainer(
        model,
        opt,
        nn.CrossEntropyLoss(),
        device=dev,
        skip_nonfinite=True,
        progress=False,  # the demo's own bar spans the whole run, not one epoch
        after_backward=after_backward,
    )
    print(
        f"torch_gradstats demo: {steps} steps, {dev}, torch {torch.__version__}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters in {len(names)} tensors"
        + (f", NaN injected into {inject_param}'s gradient at step {inject_nan}" if inject_nan is not None else ""),
        flush=True,
    )
    print(TABLE_KEY, flush=True)
    writer = None
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        writer = SummaryWriter(str(tensorboard))
    g = torch.Generator().manual_seed(seed)
    summaries: list[EpochSummary] = []
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # A model this small runs fastest on one thread; several threads spin against each other (and against
        # anything else on a busy machine): 1.7 ms vs 340 ms per step measured on a loaded 2-core box.
        torch.set_num_threads(1)
    bar = _progress_bar(progress, steps)
    t0 = time.perf_counter()
    try:
        remaining = steps
        while remaining > 0:
            n = min(STEPS_PER_EPOCH, remaining)
            summary = trainer.train_epoch(_epoch_batches(x, y, n, g))
            summaries.append(summary)
            if writer is not None:
                from torch_gradstats.integrations.tensorboard import log_step_records

                log_step_records(writer, summary.history)
            lines = format_epoch_table([summary]).splitlines()
            text = "\n".join(lines if len(summaries) == 1 else lines[2:])
            if bar is not None:
                bar.set_postfix(loss=f"{summary.loss:.4g}", skipped=sum(s.skipped_steps for s in summaries))
                bar.write(text, file=sys.stdout)  # clears the bar, prints, redraws it below
                sys.stdout.flush()
            else:
                print(text, flush=True)
            remaining -= n
    finally:
        if bar is not None:
            bar.close()
        torch.set_num_threads(threads)
        if writer is not None:
            writer.close()
    seconds = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).double().mean())
    bad = [s for s in summaries if s.first_nonfinite_step is not None]
    if bad:
        s = bad[0]
        print(
            f"\nNon-finite gradient first seen at optimizer step {s.first_nonfinite_step} (epoch {s.epoch}) in "
            f"parameter '{s.first_nonfinite_param}'."
        )
    skipped = sum(s.skipped_steps for s in summaries)
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(
        f"Skipped {skipped} optimizer step(s); parameters all finite: {params_finite}; "
        f"final loss {summaries[-1].loss:.4f}; held-out accuracy {accuracy:.1%}; {seconds:.1f} s of training"
    )

    log_path = out_dir / "log.jsonl"
    meta = {
        "steps": steps,
        "inject_nan": inject_nan,
        "inject_param": inject_param if inject_nan is not None else None,
        "seed": seed,
        "device": str(dev),
        "torch": torch.__version__,
        "accuracy": accuracy,
        "seconds": seconds,
    }
    _write_log(log_path, summaries, meta)
    plot_path: Path | None = None
    if plot:
        try:
            plot_path = out_dir / "gradstats.png"
            _plot(plot_path, summaries, inject_nan)
        except ImportError:
            plot_path = None
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(f"Wrote {log_path}" + (f" and {plot_path}" if plot_path else ""))
    return DemoResult(summaries, accuracy, seconds, plot_path, log_path)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's flags (on ``parser`` if given, e.g. a CLI subcommand)."""
    p = parser or argparse.ArgumentParser(prog="python -m torch_gradstats demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="make one parameter's gradient NaN at this optimizer step (0-based)")
    p.add_argument("--inject-param", default="hidden.weight", metavar="NAME",
                   help="the parameter --inject-nan poisons (default hidden.weight)")
    p.add_argument("--out", default="runs/demo", metavar="DIR", help="output folder (default runs/demo)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip the matplotlib plot")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write per-step TensorBoard scalars to DIR (needs the tensorboard package)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo from command-line arguments; returns the exit status."""
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        run(
            steps=args.steps,
            inject_nan=args.inject_nan,
            inject_param=args.inject_param,
            out=args.out,
            seed=args.seed,
            progress=False if args.no_progress else None,
            device=args.device,
            plot=not args.no_plot,
            tensorboard=getattr(args, "tensorboard", None),
        )
    except ValueError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out not writable, disk full...
        print(f"demo: error: cannot write the outputs to {args.out!r}: {exc.strerror or exc}; pass a writable --out",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
