"""Hugging Face ``transformers.Trainer`` callback: gradient statistics from one read, logged through the Trainer.

Example::

    from transformers import Trainer
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    add_to_trainer(trainer, GradStatsCallback(on_nonfinite="skip"))   # first in line: report_to loggers see it
    trainer.train()

What it logs, on which steps, its host syncs, ``on_nonfinite``, the step policies (``spike_guard=`` needs
:meth:`GradStatsCallback.wrap_optimizer`), activations, per-example norms and checkpoints: docs/integrations.md,
"Hugging Face Trainer". The design in short:

* The figures are taken at the end of the backward of the **last micro-batch** of each optimizer step (accelerate's
  ``GradientState.sync_gradients``), from a post-accumulate-grad hook per trainable parameter (made again before a
  training forward when layers were unfrozen or frozen since) that queues one engine callback: before the Trainer
  clips (its ``on_pre_optimizer_step`` comes after its ``clip_grad_norm_``, which would have spread a NaN to every
  gradient), after DDP's own end-of-backward reduction, and with reentrant checkpoint segments at the end of the
  outermost backward. Under fp16 the norms are divided by the scaler's scale
  on the device. DeepSpeed keeps its gradients outside ``param.grad``: not supported.
* Exactly one device-to-host transfer per logging step (on the main process), none on other steps; with
  ``on_nonfinite`` one small transfer per optimizer step on every rank, so all ranks agree.
* A callback cannot skip ``optimizer.step()``: ``"skip"`` sets every gradient to None, and the spike guard goes
  through the optimizer wrapped by :meth:`GradStatsCallback.wrap_optimizer`
  (:func:`~torch_gradstats.training.step_or_skip`). Their statistics go into each checkpoint folder as
  ``gradstats.pt``, read back by a run resumed from it (``_hf_checkpoints.py``).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback

from torch_gradstats.integrations._common import (
    ActivationReporting,
    PolicyState,
    StatsTaker,
    activation_metrics,
    describe_nonfinite,
    logs_here,
    styled_keys,
)
from torch_gradstats.integrations._hf_checkpoints import restore_saved_state, save_state
from torch_gradstats.integrations._hf_steps import sync_gradients, unscaled
from torch_gradstats.integrations._options import (
    OnNonfinite,
    check_histogram,
    check_key_style,
    check_options,
    check_watch,
)
from torch_gradstats.integrations.sinks import AnyReport, grad_report, metrics
from torch_gradstats.monitors._backward_end import requeue_if_nested
from torch_gradstats.monitors._grad_scaler import loss_scale
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
from torch_gradstats.training._skip import step_or_skip
from torch_gradstats.training._step import device_skip_step, host_skips, momentum_pending

__all__ = ["GradStatsCallback", "add_to_trainer"]

_WRAPPED_BY = "_torch_gradstats_callback"  # attribute marking an optimizer wrapped by GradStatsCallback.wrap_optimizer

logger = logging.getLogger("torch_gradstats")


class GradStatsCallback(ActivationReporting, PolicyState, TrainerCallback):
    """Gradient statistics of each logged optimizer step, added to the Trainer's logs (see the module docstring).

    Args:
        per_param: log one value per parameter (norms, and weight norms / ratios when asked for).
        prefix: key prefix (default ``"grad/"``).
        on_nonfinite: None, ``"skip"`` or ``"stop"``; checks every step.
        log_weight_norms: log weight norms and ``lr * ||g|| / ||w||``, from the same op call as the gradients.
        log_update_ratio: log the measured ``||Δw|| / ||w||`` of the logged steps (keeps one copy of the weights).
        group: process group for plain-tensor shards (FSDP1), or a callable returning it when read (for a
            callback made before the process group exists); None otherwise.
        policy: health policy (default ``HealthPolicy()``).
        key_style: whose key names to add beside ours, unprefixed (``GradReport.to_dict``'s styles): ``"hf"``
            adds ``grad_norm`` (the pre-clip norm) on the steps where the Trainer logs none (``max_grad_norm=0``);
            a key the Trainer already logged is never replaced. None or ``"default"``: ours alone.
        group_by: also log per-group figures, ``grad/group/<g>/norm`` ... (see
            :meth:`torch_gradstats.GradStats.grouped`), from the same transfer.
        spike_guard: a :class:`~torch_gradstats.SpikeGuard` judging every step's gradient norm (before clipping)
            and loss (the step's loss from the model outputs' ``loss``: their mean over the micro-batches, or
            their sum where the Trainer passes the model ``num_items_in_batch``). A callback cannot skip
            ``optimizer.step()``: give the Trainer an optimizer wrapped by :meth:`wrap_optimizer` (checked when
            training starts). Reached as ``callback.spike_guard``. The Trainer's checkpoints do not hold its
            statistics: save the callback's ``state_dict()`` with the checkpoint and give it to the new callback's
            ``load_state_dict`` (docs/integrations.md); a run resumed past step 0 without that warns that they
            start afresh.
        adaptive_clip: an :class:`~torch_gradstats.AdaptiveClip` clipping every step's gradients to its threshold,
            before the Trainer's own ``max_grad_norm`` clip (set ``max_grad_norm=0`` to clip with it alone); reached
            as ``callback.adaptive_clip``, and not kept in the Trainer's checkpoints either.
        watch_activations: an :class:`~torch_gradstats.ActivationWatch`, or True for one of the whole model (made
            when training starts, removed when it ends): ``act/`` figures on logging steps, and the origin module
            named in the warning of a non-finite step.
        stage_group: the pipeline-stage group (see :func:`torch_gradstats.grad_stats`): every rank then reports
            the whole model, every stage's parameters; ``tied`` names parameters shared by stages (counted once).
            Not with ``log_weight_norms`` / ``log_update_ratio``.
        log_rank: the global rank that transfers and logs the figures. Default: the Trainer's main process,
            global rank 0 (its ``report_to`` integrations write only there); with ``stage_group`` its figures are
            the whole model's, the same as on the last stage. Give another rank for a logger that writes there.
        histogram: on logging steps, read the gradients' exponent histogram in the same read and log the
            fp16/bf16/fp8 underflow and overflow fractions (``grad/underflow/fp16`` ...; see docs/histograms.md),
            of the unscaled gradients under a GradScaler. Not with ``log_weight_norms`` / ``log_update_ratio``.
        per_example: keep a :class:`~torch_gradstats.PerExampleNorms` of the model (made when training starts,
            reset every optimizer step; the Trainer's division of the loss by the step's micro-batch count, fewer
            than ``gradient_accumulation_steps`` on an epoch's short last step, and the loss scale are undone):
            logging steps get ``examples/max_norm``, ``examples/median_norm``, ``examples/max_over_median``, and the
            warning of a skipped step, at the next report, names its top 3 batch positions with their norms and
            the batch median.
        flight_recorder: a :class:`~torch_gradstats.FlightRecorder` (or its capacity) recording every step, dumped
            into its ``dump_dir`` as ``flight-<step>.jsonl`` and ``.png`` at an incident (a skipped step, a
            non-finite gradient, a ``SpikeStreakError``); the warning names the file.
    """

    def __init__(
        self,
        *,
        per_param: bool = True,
        prefix: str = "grad/",
        on_nonfinite: OnNonfinite = None,
        log_weight_norms: bool = False,
        log_update_ratio: bool = False,
        group: Any = None,
        policy: HealthPolicy | None = None,
        key_style: str | None = "hf",
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
    ) -> None:
        check_options(None, on_nonfinite)
        self._per_example = check_bool("per_example", per_example)
        self.flight_recorder = check_flight_recorder("GradStatsCallback", flight_recorder)
        self.key_style = check_key_style(key_style)
        self.per_param = per_param
        self.prefix = prefix
        self.on_nonfinite = on_nonfinite
        self.taker = StatsTaker(log_weight_norms, log_update_ratio, group, policy, k=5, group_by=group_by,
                                spike_guard=spike_guard, adaptive_clip=adaptive_clip, stage_group=stage_group,
                                tied=tied)
        self.log_rank = log_rank
        logs_here("GradStatsCallback", True, log_rank)  # a wrong log_rank is named now
        self.histogram = check_histogram(histogram, log_weight_norms, log_update_ratio)
        self._watch_option = check_watch(watch_activations)
        #: the activation watch (the one given, or the one made when training starts for True)
        self.activation_watch: ActivationWatch | None = (
            self._watch_option if isinstance(self._watch_option, ActivationWatch) else None)
        self.last_activation_report: ActivationReport | None = None  #: the watch's last report
        self._activation_at = -2  # the watch's step when that report was made
        self._factor: Tensor | None = None  # the guard's decision for the coming optimizer.step()
        self._judged: tuple[int, GradStats | GradWeightStats] | None = None  # its step number and statistics
        self._loss_sum: Tensor | None = None  # the micro-batches' losses of this step, on the device
        self._loss_n = 0
        # Whether those losses were each normalised by the step's item count (num_items_in_batch): then the step's
        # loss is their sum, else (each a micro-batch's own mean) their mean.
        self._loss_of_step = False
        self._micro_n = 0  # the training forwards (micro-batches) of this step, for the per-example norms' scale
        self.skipped_steps: list[int] = []  #: optimizer steps skipped because a gradient was non-finite
        self.last_report: AnyReport | None = None  #: the last report logged (main process)
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []  # the gradient hooks, on the parameters that require grad
        self._hooked_key: tuple[int, ...] | None = None  # their ids
        self._model: Any = None
        self._optimizer: Any = None
        self._args: Any = None
        self._state: Any = None
        self._queued = False
        self._pending: tuple[int, GradStats | GradWeightStats] | None = None  # (global step after it, stats)
        self._measure_after_step = False
        self._stop = False

    # ----------------------------------------------------------------------------------------------- hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise ValueError("GradStatsCallback: the Trainer passed no model to on_train_begin")
        if self.spike_guard is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the Trainer's optimizer
            if getattr(inner, _WRAPPED_BY, None) is not self:
                raise ValueError(
                    "GradStatsCallback(spike_guard=...): the Trainer's optimizer must be wrapped by this callback's "
                    "wrap_optimizer(), e.g. Trainer(..., optimizers=(callback.wrap_optimizer(opt), None)): a callback "
                    "cannot skip optimizer.step() itself"
                )
        policies = [n for n, p in (("spike_guard", self.spike_guard), ("adaptive_clip", self.adaptive_clip))
                    if p is not None]
        if policies and state.global_step > 0 and not self.policies_restored:
            restore_saved_state(self, args, state, policies)  # resumed, and nothing loaded into this callback
        # before any hook of ours: a model PerExampleNorms refuses (a BatchNorm) is left without them
        if (self._per_example or self.flight_recorder is not None) and self.taker.incidents is None:
            self.taker.incidents = StepIncidents(model, per_example=self._per_example, recorder=self.flight_recorder,
                                                 who="GradStatsCallback", nonfinite_told=True,
                                                 read_after=UNREAD_MAX)
        self._model, self._optimizer, self._args, self._state = model, optimizer, args, state
        self._remove_hooks()
        self._hook_trainable(model)
        # Layers unfrozen or frozen during training: the gradient hooks follow them, checked before each forward.
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        if ((self.spike_guard is not None and self.spike_guard.watch_loss) or self._per_example
                or self.flight_recorder is not None):
            self._handles.append(model.register_forward_hook(self._on_forward, with_kwargs=True))
        if self._watch_option is True and self.activation_watch is None:
            self.activation_watch = ActivationWatch(model)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer.step()`` apply this callback's spike guard (returns the same optimizer, changed in place).

        Its ``step`` then goes through :func:`~torch_gradstats.training.step_or_skip` with the factor the guard
        decided at the end of the step's backward: a fused optimizer (``fused=True``) skips on the device (no host
        sync), any other is stepped or not from the host (one 0-d read per step). Pass it to the Trainer as
        ``optimizers=(callback.wrap_optimizer(opt), scheduler_or_None)``, or return it from an overridden
        ``create_optimizer``. The LR scheduler still steps on a skipped step, as under AMP. Under ``fp16`` the
        GradScaler steps the optimizer: a step it skips stays skipped, and for a fused optimizer the guard's skip is
        added to the scaler's ``found_inf`` on the device (the scale follows the scaler's own checks alone)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if self.spike_guard is None:
            raise ValueError("wrap_optimizer: this callback has no spike_guard; there is nothing to apply")
        if getattr(optimizer, _WRAPPED_BY, None) is self:
            return optimizer
        real_step = optimizer.step
        inside = False

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            nonlocal inside
            factor, self._factor = self._factor, None
            judged, self._judged = self._judged, None
            if factor is None or inside:  # no decision for this step, or step_or_skip's own call below
                return real_step(*args, **kwargs)
            if self.on_nonfinite is not None:
                judged = None  # on_nonfinite's own check names a non-finite step
            if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
                raise ValueError("wrap_optimizer: a step with a closure cannot be skipped by the spike guard")
            found = getattr(opt, "found_inf", None)
            if isinstance(found, Tensor):
                # A GradScaler is stepping a fused optimizer (fp16): add the guard's skip to the scaler's found_inf,
                # on the device, and let the scaler's own step run (it takes found_inf away afterwards).
                opt.found_inf = torch.clamp(found + (factor == 0).to(found), max=1.0)  # type: ignore[attr-defined]
                if judged is not None:
                    self.taker.record_skipped_nonfinite(judged[1], factor, judged[0])
                return real_step(*args, **kwargs)
            if judged is not None and (device_skip_step(opt) is None or momentum_pending(opt)):
                # Decided on the host (step_or_skip's one read, made here): a non-finite step is named at once.
                if host_skips((factor == 0).to(torch.float32)):
                    self.taker.warn_skipped_nonfinite(judged[1], judged[0])
                    return None
                return real_step(*args, **kwargs)
            if judged is not None:
                self.taker.record_skipped_nonfinite(judged[1], factor, judged[0])
            inside = True
            try:
                step_or_skip(opt, factor)
            finally:
                inside = False
            return None

        # A bound method, as LR schedulers expect when they wrap optimizer.step themselves.
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        setattr(optimizer, _WRAPPED_BY, self)
        return optimizer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.spike_guard is not None or self.adaptive_clip is not None:  # the checkpoint folder is written by now
            save_state(args, state, self.state_dict())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_hooks()
        if self.taker.incidents is not None:
            self.taker.incidents.remove()
            self.taker.incidents = None
        if self._watch_option is True and self.activation_watch is not None:
            self.activation_watch.remove()  # the one we made; a watch given to us stays the caller's
            self.activation_watch = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A training forward run since the last step ended was none of the Trainer's (a callback's sample loss at
        # on_step_end, with grad on): the step's loss and micro-batch count start here.
        self._loss_sum, self._loss_n, self._micro_n = None, 0, 0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._stop:
            control.should_training_stop = True
            self._stop = False
        return control

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._measure_after_step and self._pending is not None:
            self.taker.measure(self._pending[1])
        self._measure_after_step = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self._pending is None or logs is None or "loss" not in logs:
            return
        step, stats = self._pending
        if step != state.global_step:  # figures of another step: never attach them to this one
            return
        self._pending = None
        if not logs_here("GradStatsCallback", state.is_world_process_zero, self.log_rank):
            self.taker.check_layout(stats)  # what the logging rank's report reads, read here too
            if self.taker.incidents is not None:
                self.taker.incidents.drop_pending()  # the logging rank's report tells these steps: none pile up
            return
        report = self.taker.report(stats)  # the one transfer of this logging step (the policies' figures too)
        figures: dict[str, Any] = metrics(report, self.prefix, self.per_param)
        for key, value in styled_keys(report, self.key_style, self.per_param).items():
            if key not in logs:  # the Trainer's own entries (its grad_norm when it clips) are never replaced
                figures[key] = value
        figures.update(self.taker.policy_figures)
        act = self._activation_report()
        if act is not None and self.activation_watch is not None:
            figures.update(activation_metrics(act, self.activation_watch))
            if act.origin is not None:
                figures["act/origin"] = act.origin  # a name: kept in log_history, dropped by scalar-only loggers
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)
        grads_bad = grad_report(report).first_nonfinite is not None
        if (grads_bad or (act is not None and act.nonfinite)) and self.on_nonfinite is None:  # else already said
            logger.warning("torch_gradstats: non-finite values at step %d: first non-finite parameter gradient: %s%s",
                           step, describe_nonfinite(report) if grads_bad else "none", self._activation_words(act))
        self.last_report = report

    # ----------------------------------------------------------------------------------------------- internals
    def _on_forward(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        # The training forwards' losses (eval runs without grad), kept on the device for the guard. Given the
        # Trainer's num_items_in_batch, a model's loss is its token sum over the whole step's count: its share.
        if not (module.training and torch.is_grad_enabled()):
            return
        self._micro_n += 1
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(())
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_n += 1
            self._loss_of_step = kwargs.get("num_items_in_batch") is not None

    def _remove_hooks(self) -> None:
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles, self._grad_handles = [], []
        self._hooked_key = None

    def _hook_trainable(self, model: Any) -> None:
        """A gradient hook on each parameter that requires grad now (the end of a backward is found from them)."""
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = [p.register_post_accumulate_grad_hook(self._on_param_grad) for _, p in trainable]
        self._hooked_key = tuple(id(p) for _, p in trainable)

    def _before_forward(self, module: Any, args: Any) -> None:
        # A training forward after layers were unfrozen or frozen (gradual unfreezing): hook the parameters that
        # require grad now, or a step whose first-hooked parameters were all frozen again would never be read.
        # Unchanged, it costs a tuple of ids per forward (no host sync).
        if (module.training and torch.is_grad_enabled()
                and tuple(id(p) for p in module.parameters() if p.requires_grad) != self._hooked_key):
            self._hook_trainable(module)

    def _on_param_grad(self, param: torch.Tensor) -> None:
        # Called for each parameter as its gradient is accumulated; queue one callback per backward, only on the
        # last micro-batch of an optimizer step.
        if self._queued or not sync_gradients():
            return
        self._queued = True
        engine = torch.autograd.Variable._execution_engine
        # Queued from a queued callback, it runs after every callback queued during the backward, DDP's
        # end-of-backward reduction included.
        engine.queue_callback(lambda: engine.queue_callback(self._after_backward))

    def _will_log(self, next_step: int) -> bool:
        args, state = self._args, self._state
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        if strategy == "no":
            return False
        if strategy != "steps":
            return True  # e.g. "epoch": read every step on the device, report the last one when it logs
        every = max(int(getattr(state, "logging_steps", None) or args.logging_steps or 1), 1)
        return next_step % every == 0 or (next_step == 1 and bool(args.logging_first_step))

    def _scale(self) -> torch.Tensor | None:
        return loss_scale(getattr(self._optimizer, "scaler", None))  # accelerate's optimizer wrapper under fp16

    def _after_backward(self) -> None:
        engine = torch.autograd.Variable._execution_engine
        # The end of a backward nested in a node of the Trainer's (a reentrant torch.utils.checkpoint segment): the
        # step's other gradients are still to come, so the figures are taken at the end of the outer one (queued
        # from a queued callback there, after DDP's end-of-backward reduction, as in _on_param_grad).
        if requeue_if_nested(lambda: engine.queue_callback(self._after_backward)):
            return
        self._queued = False
        self._held_activation = None  # a step's figures kept for a log that never came are no later step's
        next_step = self._state.global_step + 1  # the global step once this optimizer step is done
        log_now = self._will_log(next_step)
        loss = self._loss_sum
        if loss is not None and not self._loss_of_step:
            loss = loss / self._loss_n  # each micro-batch's own mean: the step's is their mean
        self._loss_sum, self._loss_n = None, 0
        micro, self._micro_n = self._micro_n, 0
        if not log_now and self.on_nonfinite is None and not self.taker.every_step:
            return
        with torch.no_grad():
            stats = self.taker.take(self._model, self._optimizer, histogram=self.histogram and log_now)
            scale = self._scale()
            if scale is not None:
                stats = unscaled(stats, scale)
        if self.taker.every_step:
            # Clipping the still loss-scaled gradients by the coefficient of the unscaled norm is the same clip.
            self._factor = self.taker.apply_policies(self._model, stats, loss)
            self._judged = (next_step - 1, stats)
            # The Trainer divides each micro-batch's mean loss by the step's micro-batch count (or the model by the
            # step's item count: the same for equal lengths), fewer on an epoch's short last step; a GradScaler
            # scales it.
            pe_scale: Tensor | float = float(micro or getattr(self._args, "gradient_accumulation_steps", 1) or 1)
            if scale is not None:
                pe_scale = pe_scale / scale.reshape(()).to(torch.float64)
            self.taker.note_step(stats, self._factor, next_step - 1, loss, pe_scale, None,
                                 skips_nonfinite=self.on_nonfinite is not None or scale is not None)
            if self.taker.incidents is not None and not logs_here("GradStatsCallback",
                                                                   self._state.is_world_process_zero, self.log_rank):
                self.taker.incidents.drop_pending()  # the logging rank tells them: none read (nor dumped) here
        if self.on_nonfinite is not None and self.taker.nonfinite(stats):
            self._handle_nonfinite(next_step - 1, scale is not None,
                                   self.taker.describe_nonfinite(stats) + self._activation_words())
        if log_now:
            self._pending = (next_step, stats)
            self._hold_activation()  # on_log comes after every callback's on_step_end, which may run forwards
            if self.taker.log_update_ratio:
                self.taker.snapshot(self._model)
                self._measure_after_step = True

    def _handle_nonfinite(self, step: int, scaler_skips: bool, what: str) -> None:
        # ``what`` names the first non-finite parameter (read on this non-finite step only).
        if scaler_skips:
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: %s; the GradScaler skips it",
                           step, what)
        else:
            for _, p in StatsTaker.trainable(self._model):
                p.grad = None  # the optimizer then leaves every parameter untouched
            self.skipped_steps.append(step)
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: %s; step skipped%s", step,
                           what, ", stopping" if self.on_nonfinite == "stop" else "")
        if self.on_nonfinite == "stop":
            self._stop = True


def add_to_trainer(trainer: Any, callback: GradStatsCallback | None = None, **kwargs: Any) -> GradStatsCallback:
    """Add ``callback`` (or ``GradStatsCallback(**kwargs)``) to ``trainer`` as its *first* callback, so the
    ``report_to`` integrations that log after it receive its figures. Returns the callback. Options go to the
    callback one makes here: given with a callback of your own, they raise a ``ValueError`` (they would be lost)."""
    if callback is not None and kwargs:
        raise ValueError(f"add_to_trainer: options ({', '.join(sorted(kwargs))}) are for the callback it makes; "
                         "a GradStatsCallback given already has its own: give one or the other")
    cb = callback if callback is not None else GradStatsCallback(**kwargs)
    trainer.callback_handler.callbacks.insert(0, cb)
    return cb

