"""The Trainer loop: epochs of accumulation windows, each ending in one optimizer step; one host sync per epoch."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.monitors._grad_scaler import loss_scale
from torch_gradstats.monitors.activations import ActivationReport, ActivationWatch
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.ops._checks import check_bool
from torch_gradstats.ops._transfer import PinnedBuffer, to_host
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.clip import clip_grad_norm_
from torch_gradstats.policies.guard import SpikeGuard, SpikeStreakError
from torch_gradstats.stats.gradients import ExtraFigures, GradStats, grad_stats
from torch_gradstats.stats.health import HealthPolicy
from torch_gradstats.training._args import (
    GradSink,
    WatchSteps,
    activation_watch,
    check_int,
    check_optimizer_and_loss,
    check_positive_number,
    check_sinks,
    send_to_sinks,
)
from torch_gradstats.training._compile import LossFn, run_forward
from torch_gradstats.training._device import as_pair, batch_size, safe_len, same_device, validate_device
from torch_gradstats.training._incidents import StepIncidents, check_flight_recorder
from torch_gradstats.training._progress import progress_bar, progress_postfix, progress_update, windows
from torch_gradstats.training._step import OptimizerStepper
from torch_gradstats.training._summary import EpochState, EpochSummary

__all__ = ["Trainer"]

logger = logging.getLogger("torch_gradstats")


class Trainer:
    """Train a model epoch by epoch while watching its gradients, with one host sync per epoch.

    Args:
        model: the model, already on ``device``.
        optimizer: its optimizer. ``fused=True`` Adam/AdamW/SGD/Adagrad let ``skip_nonfinite`` skip on the device.
        loss_fn: ``loss_fn(outputs, targets)`` returning the **mean** loss over the batch (a 0-d tensor), e.g.
            ``nn.CrossEntropyLoss()``; the helper weights it by batch size to average per sample.
        device: where to train; validated up front (default: the device of the model's first parameter).
        stats_every: take gradient stats every this many optimizer steps (default 1: every step). Forced to 1 (an
            INFO log names why) when ``skip_nonfinite``, ``scaler``, ``spike_guard``, ``adaptive_clip``,
            ``per_example`` or ``flight_recorder`` is given: each acts on, or records, every step's statistics.
        accumulation_steps: micro-batches per optimizer step (gradient accumulation). An empty batch (0 samples)
            is counted as a batch and adds nothing; a window whose every batch is empty makes no optimizer step.
        scaler: a :class:`torch.amp.GradScaler` for mixed precision; the stats are taken after ``unscale_``. The
            scaler skips non-finite steps itself; a disabled one (``enabled=False``) skips nothing, as without a
            scaler (``skip_nonfinite`` then applies).
        amp_dtype: run the forward under ``torch.autocast(device.type, dtype=amp_dtype)`` (e.g. ``torch.bfloat16``).
        max_grad_norm: clip the global L2 norm to this with :func:`torch_gradstats.clip_grad_norm_` (the stats
            come from the same read). Stats report the norm before clipping.
        skip_nonfinite: skip the optimizer step when any gradient is NaN/Inf. With a fused optimizer this is done
            on the device through the optimizer's ``found_inf`` input (no sync); otherwise it costs one host sync
            per optimizer step (a warning says so once).
        compile: run forward+loss through ``torch.compile``, cached per model architecture. A compile failure logs
            a warning and runs eagerly.
        compile_mode, compile_backend: passed to ``torch.compile``. With ``mode="reduce-overhead"`` (CUDA graphs)
            the loss output is consumed before the next call, and ``cudagraph_mark_step_begin`` is called per call.
        health_policy: thresholds of the health score (default :class:`HealthPolicy`).
        sync_every: also sync every this many optimizer steps (logging interval) and log the epoch so far;
            ``None`` (default) syncs only at the epoch end.
        progress: show a tqdm bar; ``None`` (default) shows it when stderr is a terminal and tqdm is installed.
        keep_history: keep one :class:`StepRecord` per stats step in the summary (for plots and logs).
        after_backward: optional ``callback(trainer)`` run once per optimizer step after the gradients are
            accumulated, before the stats; e.g. to inspect or perturb gradients. Under a GradScaler it runs before
            ``unscale_`` (the gradients are still multiplied by the loss scale), so the scaler sees its changes.
        log_to: sinks for per-step gradient reports: objects with a ``log(report, step)`` method, such as
            :class:`~torch_gradstats.integrations.tensorboard.TensorBoardSink` or
            :class:`~torch_gradstats.integrations.wandb.WandbSink` (see docs/integrations.md). Every ``log_every``
            optimizer steps the gradients' :class:`~torch_gradstats.GradReport` (before clipping) is sent to each
            sink: one host transfer per logging step, on top of the per-epoch sync.
        log_every: optimizer steps between two reports to ``log_to`` (default 1; ignored without ``log_to``).
        histogram: on each logging step, read the gradients' exponent histogram too, in the same read
            (``grad_stats(..., histogram=True)``): every sink gets the fp16/bf16/fp8 underflow and overflow
            fractions, and ``TensorBoardSink(histograms=True)`` and ``WandbSink`` draw the histogram.
        spike_guard: a :class:`~torch_gradstats.SpikeGuard` that judges every step's gradient norm (before
            clipping) and mean loss and skips the step it flags, on the device with a fused optimizer, else with
            one host sync per optimizer step (a warning says so once); with a scaler, a step skipped by either is
            skipped once. Non-finite gradients are then skipped too.
        adaptive_clip: an :class:`~torch_gradstats.AdaptiveClip` that clips every step to its threshold (from the
            same read as the stats; instead of ``max_grad_norm``: give it ``max_norm=`` for a cap).
        watch_activations: an :class:`~torch_gradstats.ActivationWatch` of ``model``, or True for
            ``ActivationWatch(model)``. At each sync its report (one more transfer) is kept as
            ``last_activation_report``, and a WARNING names the forward/backward origin module and the first
            non-finite parameter when the watched step or the epoch's gradients were non-finite. The report describes
            the watch's latest recorded step (a forward call; where its number is not the optimizer step's, the
            warning says which optimizer step it was a forward of, or that it was none): once a NaN reaches the
            weights, later steps name the first poisoned layer, so hunt with ``skip_nonfinite=True`` or
            ``sync_every=1``. Not with ``compile=True`` (the hooks cannot run in a compiled region).
        per_example: keep a :class:`~torch_gradstats.PerExampleNorms` of ``model`` (reset before each optimizer
            step's first micro-batch; each example's own norm, the micro-batches' weighting and the step's loss
            scale undone): each logging step's report gets ``examples/max_norm``,
            ``examples/median_norm`` and ``examples/max_over_median`` in its one transfer, and the warning of a
            skipped step names its top 3 batch positions (0-based, over the step's micro-batches in order) with
            their norms and the batch median. Not with ``compile=True``.
        flight_recorder: a :class:`~torch_gradstats.FlightRecorder`, or its capacity (an int), recording every
            step; at an incident (a skipped step, a non-finite gradient, a ``SpikeStreakError``) it is dumped into
            its ``dump_dir`` as ``flight-<step>.jsonl`` and ``.png``, and the warning names the file.

    With ``spike_guard`` or ``adaptive_clip``, each sync and each ``log_to`` logging step also reads their figures
    (``guard/skipped``, ``guard/consecutive``, ``guard/grad_norm_z``, ``guard/loss_z``, ``clip/threshold``,
    ``clip/coef``) in the same transfer, into :attr:`policy_figures` (and, on a logging step, into the report's
    ``extra``, which every sink writes), and raises :class:`~torch_gradstats.SpikeStreakError` there when the
    guard's ``max_consecutive`` was reached since the last read.

    Every skipped step (a spike or a non-finite gradient) is named in a WARNING on the ``torch_gradstats`` logger
    at the next host read (the sync, or a logging step's transfer; at once where the skip was decided on the host).

    ``global_step`` counts optimizer steps taken or skipped; it advances exactly when the optimizer steps (or a step
    is skipped), so after an interrupt it still agrees with the optimizer's own step counts.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        device: torch.device | str | int | None = None,
        stats_every: int = 1,
        accumulation_steps: int = 1,
        scaler: torch.amp.GradScaler | None = None,
        amp_dtype: torch.dtype | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        compile: bool = False,
        compile_mode: str | None = None,
        compile_backend: Any = "inductor",
        health_policy: HealthPolicy | None = None,
        sync_every: int | None = None,
        progress: bool | None = None,
        keep_history: bool = True,
        after_backward: Callable[[Trainer], None] | None = None,
        log_to: Sequence[GradSink] = (),
        log_every: int = 1,
        spike_guard: SpikeGuard | None = None,
        adaptive_clip: AdaptiveClip | None = None,
        watch_activations: ActivationWatch | bool | None = None,
        histogram: bool = False,
        per_example: bool = False,
        flight_recorder: FlightRecorder | int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        params = list(model.named_parameters())
        if not params:
            raise ValueError("model has no parameters to train")
        check_optimizer_and_loss(optimizer, loss_fn, model)
        if device is None:
            device = params[0][1].device
        self.device = validate_device(device)
        for name, p in params:
            if not same_device(p.device, self.device):
                raise ValueError(
                    f"parameter {name!r} is on {p.device} but the trainer's device is {self.device}; "
                    f"move the model first (model.to({str(self.device)!r})) and then create the optimizer"
                )
        stats_every = check_int("stats_every", stats_every)
        accumulation_steps = check_int("accumulation_steps", accumulation_steps)
        log_every = check_int("log_every", log_every)
        sync_every = None if sync_every is None else check_int("sync_every", sync_every, or_none=True)
        max_grad_norm = check_positive_number("max_grad_norm", max_grad_norm)
        if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
            raise TypeError(f"spike_guard must be a SpikeGuard or None, got {type(spike_guard).__name__}")
        if adaptive_clip is not None and not isinstance(adaptive_clip, AdaptiveClip):
            raise TypeError(f"adaptive_clip must be an AdaptiveClip or None, got {type(adaptive_clip).__name__}")
        if adaptive_clip is not None and max_grad_norm is not None:
            raise ValueError("give max_grad_norm or adaptive_clip, not both (AdaptiveClip(max_norm=...) caps it)")
        self.spike_guard = spike_guard
        self.adaptive_clip = adaptive_clip
        self.policy_figures: dict[str, float] = {}  #: the guard's and the clip's figures at the last read
        self._nonfinite_named: int | None = None  # the last skipped non-finite step named in a warning

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.amp_dtype = amp_dtype
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.compile = compile
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        if health_policy is not None and not isinstance(health_policy, HealthPolicy):
            raise TypeError(
                f"Trainer: health_policy must be a HealthPolicy or None, got {type(health_policy).__name__}"
            )
        self.health_policy = health_policy if health_policy is not None else HealthPolicy()
        self.sync_every = sync_every
        self.progress = progress
        self.keep_history = keep_history
        self.after_backward = after_backward
        self.log_to = check_sinks(log_to)
        self.log_every = log_every
        self.histogram = check_bool("histogram", histogram)
        self.flight_recorder = check_flight_recorder("Trainer", flight_recorder)
        if check_bool("per_example", per_example) and compile:
            raise ValueError("Trainer: per_example needs compile=False: its hooks cannot run in a compiled region")
        # Skipped steps can only be counted if every step is looked at: what acts on, or records, every step.
        every_step_for = [name for name, on in (
            ("skip_nonfinite", skip_nonfinite), ("scaler", scaler is not None),
            ("spike_guard", spike_guard is not None), ("adaptive_clip", adaptive_clip is not None),
            ("per_example", per_example), ("flight_recorder", self.flight_recorder is not None)) if on]
        self.must_check_every_step = bool(every_step_for)
        self._incidents: StepIncidents | None = None
        if per_example or self.flight_recorder is not None or self._nonfinite_flag_needed() or scaler is not None:
            # "sum": each micro-batch's loss is weighted by its share of the window (see _example_scale).
            self._incidents = StepIncidents(model, per_example=per_example, recorder=self.flight_recorder,
                                            loss_reduction="sum", nonfinite_told=True)
        self.stats_every = 1 if self.must_check_every_step else stats_every
        if self.must_check_every_step and stats_every != 1:
            logger.info("torch_gradstats: stats_every=%d ignored: stats are taken every step for %s", stats_every,
                        ", ".join(every_step_for))
        self.accumulation_steps = accumulation_steps
        self._stepper = OptimizerStepper(optimizer, scaler, skip_nonfinite or spike_guard is not None)
        skipping = [name for name, on in (("skip_nonfinite", skip_nonfinite), ("spike_guard", spike_guard)) if on]
        if skipping and (scaler is None or not scaler.is_enabled()) and not self._stepper.skips_on_device:
            logger.warning(
                "torch_gradstats: %s with %s (not fused) costs one host sync per optimizer step; "
                "create the optimizer with fused=True for a device-side skip",
                " and ".join(skipping), type(optimizer).__name__,
            )  # fmt: skip
        self.activation_watch = activation_watch(watch_activations, model, compile)
        self._watch_steps = WatchSteps()
        self.last_activation_report: ActivationReport | None = None
        self.epoch = 0  #: index of the next epoch
        self._staging = PinnedBuffer()  # reused by every host transfer of this trainer

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (skipped ones included); set it when resuming from a checkpoint."""
        return self._stepper.count

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._stepper.count = check_int("global_step", value, minimum=0)

    @property
    def device_side_skip(self) -> bool:
        """``skip_nonfinite`` is done on the device by the optimizer (no host sync per step)."""
        return self._stepper.skips_on_device

    # ----------------------------------------------------------------------------------------------- public
    def fit(self, loader: Iterable[Any], epochs: int) -> list[EpochSummary]:
        """Run ``epochs`` epochs (an int >= 1) over ``loader``; return their summaries."""
        return [self.train_epoch(loader) for _ in range(check_int("epochs", epochs))]

    def train_epoch(self, loader: Iterable[Any]) -> EpochSummary:
        """Train one epoch over ``loader`` (batches of ``(inputs, targets)``) and return its summary.

        A batch is a pair (tuple, list or namedtuple); its inputs and targets may be tensors, dicts, namedtuples,
        dataclasses or nested mixes of them, moved to the device as Lightning's ``move_data_to_device`` moves
        them; the model gets the inputs and ``loss_fn`` the targets in the same structure. The batch size is read
        from the shape of the first tensor with a batch dimension inside. Empty batches are counted and skipped
        (see ``accumulation_steps``).

        Raises:
            TypeError: a batch is not a tuple, list or namedtuple.
            ValueError: the loader yields no batches or only empty ones, or a batch does not have two items.
        """
        length = safe_len(loader)
        if length == 0:
            raise ValueError(
                "the data loader is empty (len 0): nothing to train on. Check the dataset size, batch_size and "
                "drop_last"
            )
        state = EpochState(self.epoch, self.device)
        self.model.train()
        with progress_bar(self.progress, length, f"epoch {state.epoch}") as bar:
            for window in windows(loader, self.accumulation_steps):
                if self._train_window(window, state, bar) and self._sync_due(state):
                    summary = self._sync(state)
                    logger.info("torch_gradstats: epoch %d, step %d: %s", state.epoch, self.global_step,
                                summary.to_dict())
                    progress_postfix(bar, summary)
        if state.samples == 0:
            raise ValueError(
                f"the data loader yielded {'no' if state.batches == 0 else 'only empty'} batches: nothing to train "
                "on. Check the dataset size, batch_size and drop_last"
            )
        summary = self._sync(state)
        self.epoch += 1
        logger.info("torch_gradstats: epoch %d done: %s", state.epoch, summary.to_dict())
        return summary

    # ----------------------------------------------------------------------------------------------- one step
    def _train_window(self, window: list[Any], state: EpochState, bar: Any) -> bool:
        """Accumulate the gradients of one window and take its optimizer step; False if it had no samples."""
        batches = [as_pair(b, state.batches + i, self.device) for i, b in enumerate(window)]
        sizes = [batch_size(x, y) for x, y in batches]
        samples = sum(sizes)
        if samples == 0:  # nothing to learn from: counted, no optimizer step
            state.add_empty_window(len(batches))
            progress_update(bar, len(batches))
            return False
        step = self.global_step
        self.optimizer.zero_grad(set_to_none=True)
        if self._incidents is not None:
            self._incidents.begin_step()
        watched = self.activation_watch.step + 1 if self.activation_watch is not None else 0
        loss_sum = self._accumulate_gradients(batches, sizes, samples, bar)
        if self.activation_watch is not None:
            self._watch_steps.note(watched, self.activation_watch.step, step)
        state.add_window(len(batches), samples, loss_sum)
        if self.after_backward is not None:
            # Before unscale_, so a GradScaler sees whatever the callback did to the gradients.
            self.after_backward(self)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # stats must see the true gradients, not loss-scaled ones
        log_due = bool(self.log_to) and step % self.log_every == 0
        take_stats = self.must_check_every_step or log_due or step % self.stats_every == 0
        stats = self._read_gradients(take_stats, self.histogram and log_due)
        nonfinite = self._nonfinite_flag(stats)
        flagged = None
        if self.spike_guard is not None and stats is not None:
            flagged = (self.spike_guard.observe(stats.total_norm, loss_sum / samples) == 0).to(torch.float64)
        # Before the step: a GradScaler's update changes the scale the per-example norms were taken under.
        example_scale = self._example_scale(samples) if self._incidents is not None else 1.0
        host_skipped = self._stepper.step(nonfinite, flagged)
        if host_skipped and nonfinite is not None and stats is not None:  # decided on the host: said at once
            self._warn_nonfinite_now(stats, step)
        skipped = nonfinite if nonfinite is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        if flagged is not None:
            skipped = torch.maximum(skipped, flagged)
        state.add_step(skipped)
        if self._incidents is not None:
            self._incidents.note(step, stats, skipped, scale=example_scale, loss=loss_sum / samples,
                                 guard=self.spike_guard, clip=self.adaptive_clip)
            if host_skipped:  # decided on the host: said at once (one small transfer, on a skipped step only)
                self._incidents.read_now()
        if stats is not None and take_stats:
            health = stats.health(self.health_policy)
            state.add_stats(step, stats, health, skipped, loss_sum / samples, self.keep_history)
        if stats is not None and log_due:
            # The one transfer of this logging step, with the policies' figures (so every sink writes them).
            with self._dump_on_streak(step):
                report = stats.report(policy=self.health_policy, extra=self._extra(examples=True))
            self.policy_figures.update(report.extra)
            send_to_sinks(self.log_to, report, step)  # each sink gets it, even after one raised
        return True

    def _accumulate_gradients(self, batches: list[tuple[Any, Any]], sizes: list[int], samples: int, bar: Any) -> Tensor:
        """Forward and backward over the window's batches; returns the sample-weighted loss sum (float64 0-d)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for (inputs, targets), n in zip(batches, sizes):
            if n > 0:  # an empty micro-batch adds nothing (and its mean loss would be NaN)
                with self._autocast():
                    loss = run_forward(self.model, inputs, targets, self.loss_fn, compile=self.compile,
                                       mode=self.compile_mode, backend=self.compile_backend)
                if loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a 0-d (mean) loss, got shape {tuple(loss.shape)}; use reduction='mean'"
                    )
                if not loss.requires_grad:  # torch's own error says only "element 0 of tensors does not require grad"
                    frozen = not any(p.requires_grad for p in self.model.parameters())
                    raise ValueError(
                        "Trainer: the loss does not require grad, so there is no gradient to train on: "
                        + ("every parameter of the model is frozen (requires_grad=False); unfreeze the ones to train"
                           if frozen else "it does not depend on a parameter that requires grad (a loss_fn that "
                           "detaches, or a forward under torch.no_grad?)")
                    )
                # Weight each micro-batch by its share of the window's samples: per-sample averaging.
                scaled = loss if n == samples else loss * (n / samples)
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                loss_sum += loss.detach().to(torch.float64) * n
            progress_update(bar, 1)
        return loss_sum

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _read_gradients(self, take_stats: bool, histogram: bool) -> GradStats | None:
        """The gradients' stats (clipping them on the way when ``max_grad_norm``), with the exponent histogram
        when ``histogram``, or None when none are read or no parameter has a gradient."""
        read = grad_stats(self.model.named_parameters(), histogram=True) if histogram else None
        if self.adaptive_clip is not None:
            stats = self.adaptive_clip.clip_(self.model.named_parameters(), stats=read)
        elif self.max_grad_norm is not None:
            stats = clip_grad_norm_(self.model.named_parameters(), self.max_grad_norm, stats=read)
        elif take_stats:
            stats = read if read is not None else grad_stats(self.model.named_parameters())
        else:
            return None
        return stats if len(stats) > 0 else None

    def _nonfinite_flag(self, stats: GradStats | None) -> Tensor | None:
        """float64 0-d, 1.0 when a gradient is non-finite, where the step policy needs it; else None."""
        if stats is None or not self._nonfinite_flag_needed():
            return None
        return (stats.nonfinite_count > 0).to(torch.float64)

    # ----------------------------------------------------------------------------------------------- host sync
    def _policies(self) -> list[SpikeGuard | AdaptiveClip]:
        return [p for p in (self.spike_guard, self.adaptive_clip) if p is not None]

    def _extra(self, examples: bool) -> list[ExtraFigures]:
        """What a transfer brings along: the steps' incident rows first (their warnings come before a streak
        error), the policies' figures, and on a logging step the examples' figures."""
        inc = self._incidents
        extra = [inc.pending()] if inc is not None else []
        extra += [ExtraFigures(*p.check_tensors(), p.check_values) for p in self._policies()]
        if examples and inc is not None:
            extra.append(inc.example_figures())
        return [e for e in extra if e is not None]

    @contextlib.contextmanager
    def _dump_on_streak(self, step: int) -> Iterator[None]:
        try:
            yield
        except SpikeStreakError as error:
            if self._incidents is not None:
                self._incidents.dump_on_error(step, error)
            raise

    def _example_scale(self, samples: int) -> Tensor | float:
        """Per-example norms are taken with ``loss_reduction="sum"`` from backwards of ``loss * n / samples``
        (times the loss scale): times ``samples`` (over the scale) they are each example's own gradient norm."""
        scale = loss_scale(self.scaler)
        return float(samples) if scale is None else float(samples) / scale.reshape(()).to(torch.float64)

    def _sync_due(self, state: EpochState) -> bool:
        return self.sync_every is not None and state.steps % self.sync_every == 0

    def _sync(self, state: EpochState) -> EpochSummary:
        """The epoch so far, and the policies' figures, in one device-to-host transfer."""
        buffer = state.buffer()
        floats: list[Tensor] = [buffer]
        ints: list[Tensor] = []
        extra = self._extra(examples=False)
        for e in extra:
            floats += e.floats
            ints += e.ints
        values, host_ints = to_host(floats, ints, self._staging)
        n = buffer.numel()
        summary = state.summary(values[:n])
        at_f, at_i = n, 0
        with self._dump_on_streak(self.global_step - 1):
            for e in extra:
                nf, ni = sum(t.numel() for t in e.floats), sum(t.numel() for t in e.ints)
                self.policy_figures.update(e.read(values[at_f : at_f + nf], host_ints[at_i : at_i + ni]))
                at_f, at_i = at_f + nf, at_i + ni
        self._warn_nonfinite(summary)
        if self.activation_watch is not None:
            self._report_activations(summary)
        return summary

    def _warn_nonfinite(self, summary: EpochSummary) -> None:
        """At a sync: name the epoch's first non-finite step, skipped on the device, unless already named."""
        step = summary.first_nonfinite_step
        if step is None or step == self._nonfinite_named or not self._nonfinite_flag_needed():
            return
        self._nonfinite_named = step
        logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: first non-finite parameter %r; "
                       "step skipped (%d steps skipped in epoch %d so far)", step, summary.first_nonfinite_param,
                       summary.skipped_steps, summary.epoch)  # fmt: skip

    def _warn_nonfinite_now(self, stats: GradStats, step: int) -> None:
        """A step skipped on the host: if its gradients are non-finite, name the first such parameter now (one more
        small transfer, on a skipped step only)."""
        mask = stats.nonfinite_mask
        _, (n_bad, first) = to_host([], [mask.sum(), mask.to(torch.int32).argmax()])
        if n_bad:
            self._nonfinite_named = step
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: first non-finite parameter %r "
                           "(%d non-finite in all); step skipped", step, stats.names[first], n_bad)

    def _nonfinite_flag_needed(self) -> bool:
        # A disabled scaler (GradScaler(enabled=False), or disabled mid-run) skips nothing: its step is the
        # optimizer's, so a non-finite step is skipped only as it would be without a scaler.
        scaling = self.scaler is not None and self.scaler.is_enabled()
        return self.skip_nonfinite or scaling or self.spike_guard is not None

    def _report_activations(self, summary: EpochSummary) -> None:
        """Keep the watch's report (its own one transfer) and warn, naming the origin, when something was non-finite."""
        assert self.activation_watch is not None
        report = self.last_activation_report = self.activation_watch.report()
        if not report.nonfinite and summary.first_nonfinite_step is None:
            return
        param = (
            "none"
            if summary.first_nonfinite_step is None
            else f"{summary.first_nonfinite_param} at step {summary.first_nonfinite_step}"
        )
        logger.warning("torch_gradstats: epoch %d: %s%s; first non-finite parameter gradient: %s", summary.epoch,
                       report.summary(), self._watch_steps.words(report.step), param)  # fmt: skip
