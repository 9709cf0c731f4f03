"""``python -m torch_gradstats demo``: train a small model on synthetic data and watch its gradients.

Everything is generated locally (no downloads): a 3-class problem of noisy concentric rings in 2-d, lifted to 16
features, learned by a small MLP with :class:`torch_gradstats.training.Trainer`. With ``--inject-nan STEP`` one
named parameter's gradient is set to NaN at that optimizer step; the demo then names that step and parameter, the
step is skipped on the device (fused Adam's ``found_inf``), and training goes on. With ``--nan-module NAME`` the NaN
goes into that module's forward output instead, and an ActivationWatch names the module as the forward origin.
``--inject-spike STEP`` multiplies that step's gradients by 1000 and a SpikeGuard skips it; ``--adaptive-clip`` clips
with AdaptiveClip.
``--inject-bad-example STEP`` corrupts one example's target at that step (batch position :data:`BAD_POSITION`, its
one-hot target scaled by :data:`BAD_TARGET`): its loss and gradient spike, a SpikeGuard skips the step, and the
Trainer's per-example gradient norms (``per_example=True``) name that batch position.

Outputs in ``--out`` (default ``runs/demo``): ``gradstats.png`` (loss, global gradient norm, health and non-finite
counts over steps), ``layers.png`` (each layer's gradient norm over steps, log scale) and ``log.jsonl`` (one JSON
object per step with stats and one per epoch; non-finite numbers are written as ``null``). Without ``--inject-nan``
nothing goes non-finite, and the figure's non-finite panel says so.

While training, a tqdm progress bar over the optimizer steps goes to stderr when stderr is a terminal (not in a
pipe or a file; ``--no-progress`` turns it off); the per-epoch table goes to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.cli._demo_figure import exponent_figure, figure, layer_figure, save
from torch_gradstats.cli._demo_output import TrainerWarnings, progress_bar, write_log
from torch_gradstats.cli._demo_problem import (
    BAD_POSITION,
    BAD_TARGET,
    BATCH,
    SPIKE_FACTOR,
    STEPS_PER_EPOCH,
    Plan,
    StepRecorder,
    corrupt_target,
    epoch_batches,
    make_data,
    make_model,
    plan_run,
)
from torch_gradstats.monitors.activations import ActivationReport
from torch_gradstats.training import EpochSummary, Trainer, format_epoch_table, validate_device

__all__ = ["DemoResult", "build_parser", "main", "make_data", "make_model", "run"]

@dataclass
class DemoResult:
    """What :func:`run` produced."""

    summaries: list[EpochSummary]
    accuracy: float  #: accuracy on a held-out synthetic set after training
    seconds: float
    plot: Path | None
    log: Path
    thresholds: list[float] = field(default_factory=list)  #: AdaptiveClip's threshold per step (with adaptive_clip)
    layer_norms: dict[str, list[float]] = field(default_factory=dict)  #: layer -> its gradient norm at each step
    layer_plot: Path | None = None
    exponents: list[list[int]] = field(default_factory=list)  #: each step's exponent histogram (277 buckets)
    exponent_plot: Path | None = None


#: What the table's columns are (printed once above it): every norm is a global L2 norm over all gradients.
TABLE_KEY = (
    "max_norm, mean_norm: largest and mean global L2 gradient norm of the epoch's steps; "
    "min_health: its worst step's health"
)


def _figure(
    summaries: Sequence[EpochSummary],
    inject_step: int | None,
    thresholds: Sequence[float] | None = None,
    spike_step: int | None = None,
    origin: str | None = None,
    bad_step: int | None = None,
) -> Any:
    """The demo's matplotlib figure (see :mod:`torch_gradstats.cli._demo_figure`); ``origin``: where the
    ActivationWatch found the first non-finite values."""
    events = []
    if spike_step is not None:
        events.append(f"gradients x{SPIKE_FACTOR:g} at step {spike_step}")
    if bad_step is not None:
        events.append(f"target of example #{BAD_POSITION} x{BAD_TARGET:g} at step {bad_step}")
    return figure(summaries, inject_step, thresholds, "; ".join(events) or None, origin)


def _train(
    trainer: Trainer,
    data: tuple[Tensor, Tensor],
    steps: int,
    seed: int,
    inject_bad_example: int | None,
    bar: Any,
    tensorboard: str | Path | None,
) -> list[EpochSummary]:
    """Train ``steps`` optimizer steps, epoch by epoch, printing each epoch's table row as it ends."""
    x, y = data
    writer = None
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        writer = SummaryWriter(str(tensorboard))
    g = torch.Generator().manual_seed(seed)
    summaries: list[EpochSummary] = []
    try:
        with warnings.catch_warnings():
            # The watch's backward hook on the first layer, whose input needs no gradient: expected, not news.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            remaining = steps
            while remaining > 0:
                n = min(STEPS_PER_EPOCH, remaining)
                batches = epoch_batches(x, y, n, g)
                first = steps - remaining  # the global step of this epoch's first batch
                if inject_bad_example is not None and first <= inject_bad_example < first + n:
                    inputs, targets = batches[inject_bad_example - first]
                    batches[inject_bad_example - first] = (inputs, corrupt_target(targets))
                summary = trainer.train_epoch(batches)
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
        if writer is not None:
            writer.close()
    return summaries


def _print_findings(
    plan: Plan,
    summaries: list[EpochSummary],
    first_report: ActivationReport | None,
    trainer_warnings: TrainerWarnings,
    thresholds: list[float],
) -> None:
    """What the run found: the first non-finite gradient, the watch's origin, the guard's skips, the per-example
    norms of skipped steps and the clip's count."""
    rows = [r for s in summaries for r in s.history]
    bad = [s for s in summaries if s.first_nonfinite_step is not None]
    if bad:
        s = bad[0]
        print(
            f"\nNon-finite gradient first seen at optimizer step {s.first_nonfinite_step} (epoch {s.epoch}) in "
            f"parameter '{s.first_nonfinite_param}'."
        )
    if trainer_warnings.messages:
        print(f"Trainer warning: {trainer_warnings.messages[0]}")
    if first_report is not None:
        print(f"ActivationWatch: forward origin of the non-finite values: {first_report.forward_origin or 'none'} "
              f"(step {first_report.step}).")  # fmt: skip
    if plan.guard is not None:
        print("SpikeGuard skipped "
              + (", ".join(f"step {r.step} (global grad norm {r.total_norm:.4g})" for r in _guard_skips(rows))
                 or "no step")
              + ".")  # fmt: skip
    for step, top, median in trainer_warnings.examples:
        print(f"Per-example gradient norms of skipped step {step}, largest first (0-based batch positions): {top}; "
              f"batch median {median}.")
    if plan.clip is not None:
        clipped = sum(r.total_norm > t for r, t in zip(rows, thresholds))
        print(f"AdaptiveClip clipped {clipped} of {len(rows)} steps (its threshold is finite only on a step it clips).")


def _guard_skips(rows: Sequence[Any]) -> list[Any]:
    """The steps skipped with finite gradients: the spike guard's."""
    return [r for r in rows if r.skipped and r.nan_count + r.inf_count == 0]


def run(
    steps: int = 200,
    inject_nan: int | None = None,
    inject_param: str | None = None,
    out: str | Path = "runs/demo",
    seed: int = 0,
    progress: bool | None = None,
    device: str | None = None,
    plot: bool = True,
    tensorboard: str | Path | None = None,
    *,
    nan_module: str | None = None,
    inject_spike: int | None = None,
    spike_guard: bool = False,
    adaptive_clip: bool = False,
    watch_activations: bool = False,
    inject_bad_example: int | None = None,
) -> DemoResult:
    """Train the demo model for ``steps`` optimizer steps; print the per-epoch table; write the plot and log.

    ``inject_nan`` poisons ``inject_param``'s gradient (default ``hidden.weight``) or, with ``nan_module``, that
    module's forward output (and turns ``watch_activations`` on). ``inject_spike`` multiplies every gradient of that
    step by :data:`SPIKE_FACTOR` (and turns ``spike_guard`` on). ``inject_bad_example`` corrupts the target of batch
    position :data:`BAD_POSITION` at that step (and turns ``spike_guard`` and the Trainer's ``per_example`` on)."""
    dev = validate_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = make_model(seed).to(dev)
    plan = plan_run(model, steps, inject_nan, inject_param, nan_module, inject_spike, spike_guard, adaptive_clip,
                 watch_activations, inject_bad_example)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    x, y = make_data(STEPS_PER_EPOCH * BATCH, seed)
    x_test, y_test = make_data(2000, seed + 1)
    x, y, x_test, y_test = x.to(dev), y.to(dev), x_test.to(dev), y_test.to(dev)
    # fused=True: skip_nonfinite skips on the device, through the optimizer's found_inf (no host sync).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4, fused=True)
    recorder = StepRecorder(plan, inject_nan, nan_module is None, inject_spike)

    def poison_output(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        if module.training and trainer.global_step == inject_nan:
            return output * float("nan")
        return None

    handles = []
    if nan_module is not None:
        # prepend: the watch's own hook on that module must see the poisoned output
        handles.append(model.get_submodule(nan_module).register_forward_hook(poison_output, prepend=True))
    trainer = Trainer(
        model,
        opt,
        nn.CrossEntropyLoss(),
        device=dev,
        skip_nonfinite=True,
        progress=False,  # the demo's own bar spans the whole run, not one epoch
        after_backward=recorder,
        spike_guard=plan.guard,
        adaptive_clip=plan.clip,
        watch_activations=plan.watch_activations,
        # The watch reports its latest step: sync after every step so the poisoned step's report is read.
        sync_every=1 if plan.watch_activations else None,
        per_example=plan.per_example,
    )
    policies = [name for name, on in (("SpikeGuard", plan.guard is not None), ("AdaptiveClip", plan.clip is not None),
                                      ("ActivationWatch", plan.watch_activations),
                                      ("per-example norms", plan.per_example)) if on]  # fmt: skip
    print(
        f"torch_gradstats demo: {steps} steps, {dev}, torch {torch.__version__}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters in {len(list(model.parameters()))} tensors"
        + "".join(f", {text}" for text in plan.injected)
        + (f"; with {', '.join(policies)}" if policies else ""),
        flush=True,
    )
    print(TABLE_KEY, flush=True)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        # A model this small runs fastest on one thread; several threads spin against each other (and against
        # anything else on a busy machine): 1.7 ms vs 340 ms per step measured on a loaded 2-core box.
        torch.set_num_threads(1)
    recorder.bar = progress_bar(progress, steps)
    trainer_warnings = TrainerWarnings()
    logger = logging.getLogger("torch_gradstats")
    logger.addFilter(trainer_warnings)
    t0 = time.perf_counter()
    try:
        summaries = _train(trainer, (x, y), steps, seed, inject_bad_example, recorder.bar, tensorboard)
    finally:
        logger.removeFilter(trainer_warnings)
        for handle in handles:
            handle.remove()
        if recorder.bar is not None:
            recorder.bar.close()
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0
    threshold_values, per_layer, exponent_rows = recorder.finish(trainer)
    first_report = recorder.first_report
    if trainer.activation_watch is not None:
        trainer.activation_watch.remove()  # the held-out pass below is no training step

    model.eval()
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).double().mean())
    _print_findings(plan, summaries, first_report, trainer_warnings, threshold_values)
    skipped = sum(s.skipped_steps for s in summaries)
    params_finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(
        f"Skipped {skipped} optimizer step(s); parameters all finite: {params_finite}; "
        f"final loss {summaries[-1].loss:.4f}; held-out accuracy {accuracy:.1%}; {seconds:.1f} s of training"
    )

    rows = [r for s in summaries for r in s.history]
    log_path = out_dir / "log.jsonl"
    meta = {
        "steps": steps,
        "inject_nan": inject_nan,
        "inject_param": plan.inject_param if inject_nan is not None and nan_module is None else None,
        "nan_module": nan_module,
        "inject_spike": inject_spike,
        "inject_bad_example": inject_bad_example,
        "bad_position": BAD_POSITION if inject_bad_example is not None else None,
        "spike_factor": SPIKE_FACTOR if inject_spike is not None else None,
        "spike_guard": plan.guard is not None,
        "guard_skipped_steps": [r.step for r in _guard_skips(rows)] if plan.guard is not None else None,
        "adaptive_clip": plan.clip is not None,
        "policy_figures": dict(trainer.policy_figures),
        "watch_activations": plan.watch_activations,
        "activation_origin": first_report.origin if first_report is not None else None,
        "activation_step": first_report.step if first_report is not None else None,
        "seed": seed,
        "device": str(dev),
        "torch": torch.__version__,
        "accuracy": accuracy,
        "seconds": seconds,
    }
    extra = {r.step: {"clip_threshold": t} for r, t in zip(rows, threshold_values)}
    write_log(log_path, summaries, meta, extra)
    plot_path = layer_path = exponent_path = None
    if plot:
        try:
            plot_path, layer_path = out_dir / "gradstats.png", out_dir / "layers.png"
            exponent_path = out_dir / "exponents.png"
            origin = first_report.origin if first_report is not None else None
            save(_figure(summaries, inject_nan, threshold_values or None, inject_spike, origin, inject_bad_example),
                 plot_path)
            bad_steps = [r.step for r in rows if r.nan_count + r.inf_count]
            save(layer_figure(per_layer, bad_steps, "; ".join(plan.injected) or None), layer_path)
            save(exponent_figure(exponent_rows, bad_steps), exponent_path)
        except ImportError:
            plot_path = layer_path = exponent_path = None
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    print(f"Wrote {log_path}" + (f", {plot_path}, {layer_path} and {exponent_path}" if plot_path else ""))
    return DemoResult(summaries, accuracy, seconds, plot_path, log_path, threshold_values, per_layer, layer_path,
                      exponent_rows, exponent_path)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The demo's flags (on ``parser`` if given, e.g. a CLI subcommand)."""
    p = parser or argparse.ArgumentParser(prog="python -m torch_gradstats demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="make one parameter's gradient (or a module's output: --nan-module) NaN at this optimizer step "
                        "(0-based)")  # fmt: skip
    p.add_argument("--inject-param", default=None, metavar="NAME",
                   help="the parameter whose gradient --inject-nan poisons (default hidden.weight)")
    p.add_argument("--nan-module", default=None, metavar="NAME",
                   help="poison this module's forward output instead (embed, hidden, head, ...); turns on "
                        "--watch-activations")  # fmt: skip
    p.add_argument("--watch-activations", action="store_true",
                   help="watch every module's activations (ActivationWatch) to name where a NaN starts")
    p.add_argument("--inject-spike", type=int, default=None, metavar="STEP",
                   help=f"multiply every gradient by {SPIKE_FACTOR:g} at this optimizer step; turns on --spike-guard")
    p.add_argument("--inject-bad-example", type=int, default=None, metavar="STEP",
                   help=f"corrupt the target of batch position {BAD_POSITION} at this optimizer step "
                        f"(x{BAD_TARGET:g}); turns on --spike-guard and per-example gradient norms, which name "
                        "that position")  # fmt: skip
    p.add_argument("--spike-guard", action="store_true",
                   help="skip steps whose gradient norm or loss spikes (SpikeGuard, one-epoch window, 12 sigma)")
    p.add_argument("--adaptive-clip", action="store_true",
                   help="clip each step to an adaptive threshold (AdaptiveClip, ZClip's rule); drawn in the figure")
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
            nan_module=args.nan_module,
            inject_spike=args.inject_spike,
            spike_guard=args.spike_guard,
            adaptive_clip=args.adaptive_clip,
            watch_activations=args.watch_activations,
            inject_bad_example=getattr(args, "inject_bad_example", None),
        )
    except ValueError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # standard output closed (`demo | head`): not an --out problem, the CLI ends quietly
        raise
    except OSError as exc:  # --out not writable, disk full...
        print(f"demo: error: cannot write the outputs to {args.out!r}: {exc.strerror or exc}; pass a writable --out",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0
