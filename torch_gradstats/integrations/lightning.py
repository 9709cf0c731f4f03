"""Lightning callback: gradient statistics from one read, logged with Lightning's own key names.

Example::

    import lightning.pytorch as L          # or: import pytorch_lightning as L
    from torch_gradstats.integrations.lightning import GradStatsCallback

    trainer = L.Trainer(callbacks=[GradStatsCallback(every_n_steps=50, on_nonfinite="skip")])

When: in ``on_before_optimizer_step``, which Lightning calls once per optimizer step, after the last micro-batch of
gradient accumulation, after AMP's ``GradScaler.unscale_`` and **before** gradient clipping, so the figures are the
true (unscaled, unclipped) gradients. (Exception: an optimizer that unscales inside its own ``step()``, such as
fused Adam under ``precision="16-mixed"``, still holds loss-scaled gradients there; Lightning does not unscale them.)

What is logged every ``every_n_steps`` optimizer steps (default: the trainer's ``log_every_n_steps``), with every
logger of the trainer, on the steps and at the step numbers where Lightning writes ``self.log`` values, so the charts
line up with the loss. Lightning counts from one: with ``n`` = 10 it writes at logger steps 9, 19, 29, ... (and at
the step on which ``trainer.should_stop`` is set, as when ``on_nonfinite="stop"`` stops); ``log_every_n_steps=0``
writes no step values, and then neither does the callback unless ``every_n_steps`` is given. (A ``should_stop`` set
by another callback after this hook has run is seen by Lightning but too late for the gradients to be read.)

* Lightning's own key names, so dashboards built on ``lightning.pytorch.utilities.grad_norm`` keep working:
  ``grad_2.0_norm/<parameter>`` and ``grad_2.0_norm_total``;
* ours, under ``grad_stats/``: ``total_norm``, ``inf_norm``, ``zero_count``, ``nan_count``, ``inf_count``,
  ``zero_fraction``, ``health``, ``min_norm``, ``max_norm``, ``num_nonfinite_tensors`` ..., and
  ``first_nonfinite_index`` (model-order index of the first parameter with a NaN/Inf gradient, -1 if none; the
  name itself goes to the Python log as a warning, since not every logger takes text);
* with ``log_weight_norms=True``: ``grad_stats/weight_norm/<parameter>``, ``grad_stats/weight_norm_total`` and
  ``grad_stats/lr_update_ratio/<parameter>`` (``lr * ||g|| / ||w||`` from the optimizer's param groups), read in the
  same op call as the gradients;
* with ``log_update_ratio=True``: also ``grad_stats/update_ratio/<parameter>``, the measured ``||Δw|| / ||w||`` of
  the step (see :class:`torch_gradstats.monitors.UpdateRatio`: one copy of the weights is kept in memory); the report
  is then made after the optimizer step, in ``on_train_batch_end``.

Host syncs: none on steps that neither log nor check; on a logging step exactly one device-to-host transfer (one
``report()``; values go to the loggers as Python floats through ``logger.log_metrics``, not through
``self.log``, which would turn each one into a device tensor and ``.item()`` it back). With ``on_nonfinite`` set
every optimizer step must be checked: one small transfer per step (on logging steps the report's transfer serves
both, except with ``log_update_ratio=True``, where the report comes after the step: two transfers on those steps).
A step found non-finite that has no report makes one more small transfer, to name the parameter in the warning.

Non-finite gradients (``on_nonfinite``):

* ``"skip"``: the step is skipped by setting every gradient of the optimizer to None (``optimizer.zero_grad(
  set_to_none=True)``) in ``on_before_optimizer_step``. PyTorch optimizers leave parameters without a gradient
  untouched: no update, no weight decay, no momentum or Adam state change. Lightning then still calls
  ``optimizer.step()`` (a no-op) and the LR scheduler, as it does when AMP's scaler skips a step. Skipped steps are
  listed in ``callback.skipped_steps``, and each is named in a warning on the ``torch_gradstats`` logger, logged
  step or not: the first non-finite parameter (model order), how many more, and the NaN and Inf counts.
* ``"stop"``: the step is skipped as above and ``trainer.should_stop`` is set, so training ends after this batch.

Step policies (``spike_guard=``, ``adaptive_clip=``; both look at every optimizer step, in
``on_before_optimizer_step``, on the norm before clipping, as :class:`torch_gradstats.Trainer` does):

* ``adaptive_clip``: an :class:`~torch_gradstats.AdaptiveClip` computes the step's threshold on the device and the
  gradients are clipped to it in place (:func:`~torch_gradstats.clip_grad_norm_` reusing the statistics' read). Not
  with the trainer's ``gradient_clip_val`` (a ValueError at setup): give the clip ``max_norm=`` for a fixed cap.
* ``spike_guard``: a :class:`~torch_gradstats.SpikeGuard` judges the step's gradient norm and its loss (the mean
  of the micro-batches' losses over the accumulation window, from those Lightning passes to ``on_before_backward``,
  each divided by ``accumulate_grad_batches``: their sum, scaled up on an epoch's short last window, whose fewer
  micro-batches Lightning still divides by the setting; under ``precision="16-mixed"`` divided by the GradScaler's
  scale, which Lightning has multiplied them by; under DDP averaged over the ranks by one all-reduce per step, so
  every rank decides alike). A flagged
  step (a spike, or non-finite gradients) is skipped as ``step_or_skip`` skips it: with a fused
  optimizer (``fused=True`` Adam, AdamW, SGD, Adagrad) and no GradScaler, on the device, with no host sync, through
  the ``found_inf`` the optimizer's ``step()`` reads right after this hook: parameters, optimizer state and step
  counts stay as they were. Any other optimizer (or ``precision="16-mixed"``, whose GradScaler steps the optimizer)
  is skipped from the host: one 0-d read per optimizer step (a warning says so once), then the gradients are set to
  None as ``on_nonfinite="skip"`` does. The LR scheduler still steps on a skipped step.
* Their figures, ``guard/skipped``, ``guard/consecutive``, ``guard/grad_norm_z``, ``guard/loss_z``,
  ``clip/threshold``, ``clip/coef``, are logged on logging steps, read in the report's one transfer. A guard's
  ``max_consecutive`` streak raises :class:`~torch_gradstats.SpikeStreakError` at that read: on the first logging
  step after the streak was reached (up to ``every_n_steps - 1`` optimizer steps later, all of them skipped too
  while the spikes go on), before that step's optimizer step.

Checkpoints: the guard's and the clip's statistics (each optimizer's, with several) are the callback's
``state_dict``, which Lightning saves in its checkpoints and restores on ``trainer.fit(..., ckpt_path=...)``: a
resumed fit judges and clips as one that never stopped.

Activations (``watch_activations=``, an :class:`~torch_gradstats.ActivationWatch` or True for one of the whole
LightningModule): on logging steps the watch's report (one more transfer) gives ``act/nonfinite`` (0 or 1) and
``act/origin_index`` (the origin's position in ``watch.module_names``; -1 all finite, -2 non-finite inputs), and
every warning about a non-finite step adds the watch's summary: the forward (or backward) origin module beside the
first non-finite parameter. The report describes the watch's latest forward, so name the origin on the step it
happens with ``on_nonfinite`` set (a non-finite weight poisons every later step).

Distributed: call it the same on every rank. Under DDP every rank holds the same averaged gradients, so no
communication is needed; under FSDP2 (``ModelParallelStrategy``: DTensor parameters) the figures are reduced over
the mesh by :func:`torch_gradstats.grad_stats` (collectives on every rank, so every rank must reach the hook,
which Lightning guarantees). With FSDP1 (``FSDPStrategy``) pass the group FSDP shards over as ``group=``, as a
callable, since the callback is made before Lightning makes the process group (``torch.distributed.group.WORLD`` is
None until then): ``group=lambda: torch.distributed.group.WORLD`` for its default full sharding (a group FSDP does
not shard over is refused; without a group, a warning says the figures are each rank's shard's): with
``use_orig_params=True`` the figures are per original parameter; with ``use_orig_params=False`` the rows are the
flat parameters (their shards read without FSDP's padding). The figures are the same on every rank; only
global rank 0 transfers them to the host and logs (Lightning's loggers write on rank 0 only); with ``on_nonfinite``
every rank makes its own check, so all ranks agree on skipping or stopping.

Manual optimization works: figures at each ``opt.step()``, logged at that batch's logger step.

Several optimizers (``configure_optimizers`` returning two or more, as a GAN's generator and discriminator in manual
optimization): each optimizer step reads only its own param groups' parameters and logs them under that optimizer's key
segment, ``optimizer_names[i]`` (default ``optimizer_<i>``): ``grad_stats/generator/total_norm``,
``grad_2.0_norm/generator/<parameter>``, ``grad_2.0_norm_total/generator``. Each optimizer has its own copy of
``spike_guard`` and ``adaptive_clip`` (``callback.spike_guards`` / ``callback.adaptive_clips``), judging the losses
given to ``manual_backward`` since its previous step, saved and restored by name; ``on_nonfinite`` skips only the
optimizer whose gradients are non-finite. ``per_example`` and ``flight_recorder`` are kept per optimizer too: each one's
per-example norms are taken over the modules that hold its parameters (the discriminator's step names the
discriminator's examples, only its own parameters of a module both hold; an optimizer whose ``zero_grad`` ran since its
last backward, ``set_to_none`` or not, starts its examples afresh there), logged as ``examples/<name>/max_norm`` ...,
and each has its own flight recorder (``callback.flight_recorders``: a ``FlightRecorder`` given is copied per optimizer,
its capacity and ``dump_dir``, as the policies are; an int is each one's capacity), dumped as
``flight-<name>-<step>.jsonl``. Every key and rule: docs/integrations.md, "Optimizers".

Both namespaces work: the callback subclasses ``lightning.pytorch.Callback`` when the ``lightning`` package is
installed, else ``pytorch_lightning.Callback``; ``PLGradStatsCallback`` is the ``pytorch_lightning`` one when both
are installed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from torch import Tensor

from torch_gradstats.integrations._common import (
    StatsTaker,
    activation_metrics,
    describe_nonfinite,
    logs_here,
    styled_keys,
)
from torch_gradstats.integrations._lightning_optimizers import (
    OptimizerTaker,
    SeveralOptimizers,
    check_optimizer_names,
    optimizer_key,
)
from torch_gradstats.integrations._lightning_steps import (
    GuardSkip,
    StepLoss,
    batch_logger_step,
    example_scale,
    lightning_scaler,
    log_due,
)
from torch_gradstats.integrations._options import (
    OnNonfinite,
    check_histogram,
    check_key_style,
    check_options,
    check_watch,
)
from torch_gradstats.integrations.sinks import AnyReport, grad_report, metrics
from torch_gradstats.monitors.activations import ActivationReport, ActivationWatch
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.monitors.updates import GradWeightStats
from torch_gradstats.ops._checks import check_bool
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.guard import SpikeGuard
from torch_gradstats.stats.gradients import GradStats
from torch_gradstats.stats.groups import GroupBy
from torch_gradstats.stats.health import HealthPolicy
from torch_gradstats.training._incidents import UNREAD_MAX, StepIncidents, check_flight_recorder

try:
    from lightning.pytorch import Callback as _Callback
except ImportError:  # only the older package name is installed
    from pytorch_lightning import Callback as _Callback

__all__ = ["GradStatsCallback", "PLGradStatsCallback", "lightning_keys"]  # noqa: F822 (module __getattr__)

logger = logging.getLogger("torch_gradstats")


def lightning_keys(report: AnyReport, per_param: bool = True) -> dict[str, float]:
    """Lightning's ``grad_norm(module, 2)`` key names and values, from a report: ``grad_2.0_norm/<name>``,
    ``grad_2.0_norm_total``."""
    g = grad_report(report)
    out = {f"grad_2.0_norm/{name}": norm for name, norm in g.norms.items()} if per_param else {}
    out["grad_2.0_norm_total"] = g.total_norm
    return out


class _GradStatsMixin(SeveralOptimizers):
    """The callback's logic, independent of which Lightning package provides the base class."""

    def __init__(
        self,
        every_n_steps: int | None = None,
        *,
        per_param: bool = True,
        prefix: str = "grad_stats/",
        lightning_names: bool = True,
        on_nonfinite: OnNonfinite = None,
        log_weight_norms: bool = False,
        log_update_ratio: bool = False,
        group: Any = None,
        policy: HealthPolicy | None = None,
        key_style: str | None = "lightning",
        group_by: GroupBy | None = None,
        spike_guard: SpikeGuard | None = None,
        adaptive_clip: AdaptiveClip | None = None,
        watch_activations: ActivationWatch | bool | None = None,
        stage_group: Any = None,
        tied: Collection[str] = (),
        log_rank: int | None = None,
        histogram: bool = False,
        per_example: bool = False,
        flight_recorder: FlightRecorder | int | None = None,
        optimizer_names: Sequence[str] | None = None,
    ) -> None:
        """
        Args:
            every_n_steps: log every this many optimizer steps (default: the trainer's ``log_every_n_steps``).
            per_param: log one value per parameter (norms, and weight norms / ratios when asked for).
            prefix: prefix of our own keys.
            lightning_names: also log ``grad_2.0_norm/<name>`` and ``grad_2.0_norm_total``.
            on_nonfinite: None, ``"skip"`` or ``"stop"`` (see the module docstring); checks every step.
            log_weight_norms: log weight norms and ``lr * ||g|| / ||w||``, from the same op call.
            log_update_ratio: log the measured ``||Δw|| / ||w||`` (keeps one copy of the weights).
            group: process group for plain-tensor shards (FSDP1), or a callable returning it when read (the
                process group does not exist yet when the callback is made); None otherwise.
            policy: health policy (default ``HealthPolicy()``).
            key_style: whose key names to log beside ours (``GradReport.to_dict``'s styles): ``"lightning"``
                (``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``), ``"megatron"``, ``"composer"``, ``"hf"``, or
                None / ``"default"`` for ours alone. ``lightning_names=False`` is the same as None.
            group_by: also log per-group figures, ``<prefix>group/<g>/norm`` ... (see
                :meth:`torch_gradstats.GradStats.grouped`), from the same transfer.
            spike_guard: a :class:`~torch_gradstats.SpikeGuard` judging every step's gradient norm (before
                clipping) and loss; the step it flags is skipped (see "Step policies" in the module docstring).
            adaptive_clip: an :class:`~torch_gradstats.AdaptiveClip` clipping every step to its threshold (not
                with the trainer's ``gradient_clip_val``).
            watch_activations: an :class:`~torch_gradstats.ActivationWatch`, or True for one of the whole
                LightningModule (made when a fit is set up, removed at its teardown; ``trainer.validate`` / ``test``
                / ``predict`` runs of their own make none): ``act/`` figures on logging steps, and the origin module
                named in the warning of a non-finite step.
            stage_group: the pipeline-stage group (see :func:`torch_gradstats.grad_stats`): every rank then reports
                the whole model, every stage's parameters; ``tied`` names parameters shared by stages (counted once).
                Not with ``log_weight_norms`` / ``log_update_ratio``.
            log_rank: the global rank that transfers and logs the figures. Default: the framework's logging process,
                global rank 0 (Lightning's loggers write only there); with ``stage_group`` its figures are the whole
                model's, the same as on the last stage. Give another rank for a logger that writes there.
            histogram: on logging steps, read the gradients' exponent histogram in the same read and log the
                fp16/bf16/fp8 underflow and overflow fractions (``<prefix>underflow/fp16`` ...; see
                docs/histograms.md). Not with ``log_weight_norms`` / ``log_update_ratio``.
            per_example: keep a :class:`~torch_gradstats.PerExampleNorms` of the LightningModule (made when a fit
                is set up, as the watch is, reset every optimizer step; the loss of each micro-batch is the mean
                over its examples, and Lightning's division by ``accumulate_grad_batches`` is undone): logging steps
                get ``examples/max_norm``, ``examples/median_norm``, ``examples/max_over_median`` (beside the
                guard's ``guard/...`` figures), and the warning of a skipped step names its top 3 batch positions
                with their norms and the batch median.
            flight_recorder: a :class:`~torch_gradstats.FlightRecorder` (or its capacity) recording every step,
                dumped into its ``dump_dir`` as ``flight-<step>.jsonl`` and ``.png`` at an incident (a skipped step,
                a non-finite gradient, a ``SpikeStreakError``); the warning names the file. With several optimizers
                each has its own, made with this one's capacity and ``dump_dir`` (``callback.flight_recorders``),
                dumped as ``flight-<name>-<step>.jsonl``; ``per_example`` is then per optimizer as well.
            optimizer_names: with several optimizers, the key segment of each, in ``configure_optimizers`` order
                (default ``optimizer_0``, ``optimizer_1``, ...; see "Several optimizers" in the module docstring).
                Given with one optimizer, its keys get the segment too.
        """
        super().__init__()
        self.key_style = check_key_style(key_style) if lightning_names else None
        self.every_n_steps = check_options(every_n_steps, on_nonfinite)
        self.per_param = per_param
        self.prefix = prefix
        self.lightning_names = lightning_names
        self.on_nonfinite = on_nonfinite
        self.taker = StatsTaker(log_weight_norms, log_update_ratio, group, policy, k=5, group_by=group_by,
                                spike_guard=spike_guard, adaptive_clip=adaptive_clip, stage_group=stage_group,
                                tied=tied)
        self.log_rank = log_rank
        logs_here("GradStatsCallback", True, log_rank)  # a wrong log_rank is named now
        self.histogram = check_histogram(histogram, log_weight_norms, log_update_ratio)
        self._watch_option = check_watch(watch_activations)
        #: the activation watch (the one given, or the one made when a fit is set up for ``watch_activations=True``)
        self.activation_watch: ActivationWatch | None = (
            self._watch_option if isinstance(self._watch_option, ActivationWatch) else None)
        self.last_activation_report: ActivationReport | None = None  #: the watch's last report
        self._activation_at = -2  # the watch's step when that report was made
        self.skipped_steps: list[int] = []  #: optimizer steps skipped because a gradient was non-finite
        self.last_report: AnyReport | None = None  #: the last report logged (rank 0)
        # reports made after the batch (log_update_ratio), the last step's of each taker: the stats, the logger step
        self._pending: dict[int, tuple[StatsTaker, GradStats | GradWeightStats, int]] = {}
        self.optimizer_names = check_optimizer_names(optimizer_names)
        # several optimizers: each one's taker (its parameters, its key segment, its policies), by the optimizer's id
        self._takers: dict[int, OptimizerTaker] | None = None
        self._saved_optimizer_states: dict[str, Any] | None = None  # loaded before the optimizers exist
        self._one_optimizer_state = False  # a one-optimizer checkpoint's policy statistics were loaded
        self._step_loss = StepLoss()  # the losses of this optimizer step's micro-batches
        self._guard_skip = GuardSkip()
        self._per_example = check_bool("per_example", per_example)
        self.flight_recorder = check_flight_recorder("GradStatsCallback", flight_recorder)

    # ----------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return  # validate / test / predict take no optimizer step: the watch and the hooks would serve nothing
        if self.adaptive_clip is not None and getattr(trainer, "gradient_clip_val", None):
            raise ValueError("GradStatsCallback: give the trainer's gradient_clip_val or adaptive_clip, not both "
                             "(AdaptiveClip(max_norm=...) caps the threshold)")
        if self._watch_option is True and self.activation_watch is None:
            self.activation_watch = ActivationWatch(pl_module)
        if (self._per_example or self.flight_recorder is not None) and self.taker.incidents is None:
            self.taker.incidents = StepIncidents(pl_module, per_example=self._per_example,
                                                 recorder=self.flight_recorder, who="GradStatsCallback",
                                                 nonfinite_told=True, read_after=UNREAD_MAX)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Several optimizers (manual optimization): each one's step reads its own parameters, logs under its own key
        # segment and is judged by its own copies of the policies. Statistics carried over from an earlier fit of
        # this callback, or loaded from a checkpoint (before the optimizers existed), go to the optimizer of the name.
        self._start_optimizers(trainer, pl_module)
        policies = [name for name in ("spike_guard", "adaptive_clip") if getattr(self, name) is not None]
        if policies and getattr(trainer, "ckpt_path", None) and not self.policies_restored:
            # a checkpoint saved before the policies were given, or without the callbacks' state
            logger.warning("torch_gradstats: GradStatsCallback resumed at step %d from a checkpoint that holds no "
                           "statistics of its %s: they are not restored (new ones start afresh, warm-up included)",
                           trainer.global_step, " and ".join(policies))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for optimizer in getattr(trainer, "optimizers", []):
            self._guard_skip.clear(optimizer)  # left by a step that never ran (an exception in between)
        if self._watch_option is True and self.activation_watch is not None:
            self.activation_watch.remove()  # the one we made; a watch given to us stays the caller's
            self.activation_watch = None
        self._remove_incidents()  # several optimizers' per-example hooks
        if self.taker.incidents is not None:
            self.taker.incidents.remove()
            self.taker.incidents = None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Tensor) -> None:
        # the loss a guard judges and a flight recorder records (summed on the device: no sync)
        if (self.spike_guard is not None and self.spike_guard.watch_loss) or self.flight_recorder is not None:
            self._step_loss.add(trainer, loss)
        self._examples_afresh()  # several optimizers: one whose gradient starts afresh starts its examples too

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._examples_seen()  # several optimizers: each one's gradients as this backward left them

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        step = trainer.global_step
        at = batch_logger_step(trainer)
        log_now = log_due(trainer, self.every_n_steps, at)
        taker = self._step_taker(optimizer)
        if not log_now and self.on_nonfinite is None and not taker.every_step:
            return  # nothing read, nothing synced
        stats = taker.take(pl_module, optimizer, histogram=self.histogram and log_now)
        if taker.every_step:
            loss = self._step_loss.take(trainer, pl_module)
            factor = taker.apply_policies(pl_module, stats, loss)
            host_skipped = None
            if factor is not None:
                host_skipped = self._guard_skip.apply(trainer, optimizer, factor)
                if self.on_nonfinite is None:  # else on_nonfinite's own check names it below
                    if host_skipped is None:
                        taker.record_skipped_nonfinite(stats, factor, step)
                    elif host_skipped:
                        taker.warn_skipped_nonfinite(stats, step)
            scaler = lightning_scaler(trainer)  # a GradScaler skips a non-finite step itself
            taker.note_step(stats, factor, step, loss, example_scale(trainer), host_skipped,
                            skips_nonfinite=self.on_nonfinite is not None or bool(scaler and scaler.is_enabled()))
            if taker.incidents is not None and not self._logs_here(trainer):
                taker.incidents.drop_pending()  # the logging rank tells them: none read (nor dumped) here
        report: AnyReport | None = None
        if log_now and self._logs_here(trainer) and not taker.log_update_ratio:
            report = taker.report(stats)  # the one transfer of this step
        if self.on_nonfinite is not None:
            g = grad_report(report) if report is not None else None
            bad = (g.nan_count + g.inf_count > 0) if g is not None else taker.nonfinite(stats)
            if bad:
                self._handle_nonfinite(trainer, optimizer, step, report, stats, taker)
                if not log_now and log_due(trainer, self.every_n_steps, at):  # "stop": Lightning logs this step too
                    log_now = True
                    if self._logs_here(trainer) and not taker.log_update_ratio:
                        report = taker.report(stats)
        if report is not None:
            self._log(trainer, report, at, taker)
        elif log_now and taker.log_update_ratio:
            taker.snapshot(pl_module)
            self._pending[id(taker)] = (taker, stats, at)
            self._hold_pending(taker, optimizer, self._logs_here(trainer))
        elif log_now:  # a rank that does not log reads what the logging rank's report reads
            self._not_logged(taker, stats)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        pending, self._pending = self._pending, {}
        for taker, stats, logger_step in pending.values():
            self._measure_pending(taker, stats)
            if self._logs_here(trainer):
                self._use_held_activation(taker)
                self._log(trainer, taker.report(stats), logger_step, taker)
            else:
                self._not_logged(taker, stats)

    # ----------------------------------------------------------------------------------------------- internals
    def _logs_here(self, trainer: Any) -> bool:
        return logs_here("GradStatsCallback", trainer.is_global_zero, self.log_rank)

    @staticmethod
    def _not_logged(taker: StatsTaker, stats: GradStats | GradWeightStats) -> None:
        """A logging step on a rank that does not log: read the layout flags the logging rank's report reads, and let
        the incident rows go (the logging rank's report tells them), which would otherwise pile up, one per step."""
        taker.check_layout(stats)
        if taker.incidents is not None:
            taker.incidents.drop_pending()

    def _handle_nonfinite(self, trainer: Any, optimizer: Any, step: int, report: AnyReport | None,
                          stats: GradStats | GradWeightStats, taker: StatsTaker) -> None:
        # Named from the report when this step has one, else from one more small read (a non-finite step only).
        what = describe_nonfinite(report) if report is not None else taker.describe_nonfinite(stats)
        what += self._activation_words()
        optimizer.zero_grad(set_to_none=True)  # the optimizer then leaves every parameter untouched
        self.skipped_steps.append(step)
        if self.on_nonfinite == "stop":
            trainer.should_stop = True
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d%s: %s; step skipped, stopping",
                           step, taker.label, what)
        else:
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d%s: %s; step skipped", step,
                           taker.label, what)

    def _log(self, trainer: Any, report: AnyReport, logger_step: int, taker: StatsTaker) -> None:
        values = styled_keys(report, self.key_style, self.per_param)
        ours = metrics(report, self.prefix, self.per_param)
        if self.key_style in ("lightning", "composer"):  # the per-parameter norms are already there, so named
            ours = {k: v for k, v in ours.items() if not k.startswith(self.prefix + "norm/")}
        values.update(ours)
        values.update(taker.policy_figures)
        act = self._activation_report()
        if act is not None and self.activation_watch is not None:
            values.update(activation_metrics(act, self.activation_watch))
        grads_bad = grad_report(report).first_nonfinite is not None
        if (grads_bad or (act is not None and act.nonfinite)) and self.on_nonfinite is None:  # else already said
            logger.warning("torch_gradstats: non-finite values at logger step %d%s: first non-finite parameter "
                           "gradient: %s%s", logger_step, taker.label,
                           describe_nonfinite(report) if grads_bad else "none", self._activation_words(act))
        if isinstance(taker, OptimizerTaker):  # one optimizer of several: its own key segment
            values = {optimizer_key(k, taker.name, self.prefix): v for k, v in values.items()}
        for lg in trainer.loggers:
            lg.log_metrics(values, step=logger_step)
        self.last_report = report


class GradStatsCallback(_GradStatsMixin, _Callback):
    """Gradient statistics every N optimizer steps, logged to the trainer's loggers (see the module docstring)."""


_PL_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # PLGradStatsCallback is built on first use: importing pytorch_lightning is slow and usually not needed.
    global _PL_CLASS
    if name != "PLGradStatsCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _PL_CLASS is None:
        import pytorch_lightning

        if issubclass(GradStatsCallback, pytorch_lightning.Callback):
            _PL_CLASS = GradStatsCallback
        else:

            class PLGradStatsCallback(_GradStatsMixin, pytorch_lightning.Callback):
                """:class:`GradStatsCallback` for ``pytorch_lightning.Trainer``."""

            _PL_CLASS = PLGradStatsCallback
    return _PL_CLASS
