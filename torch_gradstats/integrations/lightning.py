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
  the step (see :class:`torch_gradstats.updates.UpdateRatio`: one copy of the weights is kept in memory); the report
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

Distributed: call it the same on every rank. Under DDP every rank holds the same averaged gradients, so no
communication is needed; under FSDP2 (``ModelParallelStrategy``: DTensor parameters) the figures are reduced over
the mesh by :func:`torch_gradstats.grad_stats` (collectives on every rank, so every rank must reach the hook,
which Lightning guarantees). With FSDP1 (``FSDPStrategy``) pass ``group=torch.distributed.group.WORLD`` and
``use_orig_params=False``, so every rank holds a shard of the same flat parameters. The figures are the same on
every rank; only global rank 0 transfers them to the host and logs (Lightning's loggers write on rank 0 only); with
``on_nonfinite`` every rank makes its own check, so all ranks agree on skipping or stopping.

Both namespaces work: the callback subclasses ``lightning.pytorch.Callback`` when the ``lightning`` package is
installed, else ``pytorch_lightning.Callback``; ``PLGradStatsCallback`` is the ``pytorch_lightning`` one when both
are installed.
"""

from __future__ import annotations

import logging
from typing import Any

from torch_gradstats.groups import GroupBy
from torch_gradstats.health import HealthPolicy
from torch_gradstats.integrations import AnyReport, grad_report, metrics
from torch_gradstats.integrations._common import (
    OnNonfinite,
    StatsTaker,
    check_key_style,
    check_options,
    describe_nonfinite,
    styled_keys,
)
from torch_gradstats.stats import GradStats
from torch_gradstats.updates import GradWeightStats

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


class _GradStatsMixin:
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
            group: process group for plain-tensor shards (FSDP1); None otherwise.
            policy: health policy (default ``HealthPolicy()``).
            key_style: whose key names to log beside ours (``GradReport.to_dict``'s styles): ``"lightning"``
                (``grad_2.0_norm/<name>``, ``grad_2.0_norm_total``), ``"megatron"``, ``"composer"``, ``"hf"``, or
                None / ``"default"`` for ours alone. ``lightning_names=False`` is the same as None.
            group_by: also log per-group figures, ``<prefix>group/<g>/norm`` ... (see
                :meth:`torch_gradstats.GradStats.grouped`), from the same transfer.
        """
        super().__init__()
        self.key_style = check_key_style(key_style) if lightning_names else None
        self.every_n_steps = check_options(every_n_steps, on_nonfinite)
        self.per_param = per_param
        self.prefix = prefix
        self.lightning_names = lightning_names
        self.on_nonfinite = on_nonfinite
        self.taker = StatsTaker(log_weight_norms, log_update_ratio, group, policy, k=5, group_by=group_by)
        self.skipped_steps: list[int] = []  #: optimizer steps skipped because a gradient was non-finite
        self.last_report: AnyReport | None = None  #: the last report logged (rank 0)
        self._pending: tuple[GradStats | GradWeightStats, int, int] | None = None  # stats, logger step, opt step

    # ----------------------------------------------------------------------------------------------- hooks
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        step = trainer.global_step
        logger_step = self._logger_step(trainer)
        log_now = self._log_due(trainer, logger_step)
        if not log_now and self.on_nonfinite is None:
            return  # nothing read, nothing synced
        stats = self.taker.take(pl_module, optimizer)
        report: AnyReport | None = None
        if log_now and trainer.is_global_zero and not self.taker.log_update_ratio:
            report = self.taker.report(stats)  # the one transfer of this step
        if self.on_nonfinite is not None:
            g = grad_report(report) if report is not None else None
            bad = (g.nan_count + g.inf_count > 0) if g is not None else self.taker.nonfinite(stats)
            if bad:
                self._handle_nonfinite(trainer, optimizer, step, report, stats)
                if not log_now and self._log_due(trainer, logger_step):  # "stop": Lightning logs this step too
                    log_now = True
                    if trainer.is_global_zero and not self.taker.log_update_ratio:
                        report = self.taker.report(stats)
        if report is not None:
            self._log(trainer, report, logger_step)
        elif log_now and self.taker.log_update_ratio:
            self.taker.snapshot(pl_module)
            self._pending = (stats, logger_step, step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is None:
            return
        stats, logger_step, _ = self._pending
        self._pending = None
        self.taker.measure(stats)
        if trainer.is_global_zero:
            self._log(trainer, self.taker.report(stats), logger_step)

    # ----------------------------------------------------------------------------------------------- internals
    @staticmethod
    def _logger_step(trainer: Any) -> int:
        # The step Lightning's logger connector gives self.log'd values of this batch.
        return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))

    def _log_due(self, trainer: Any, logger_step: int) -> bool:
        """Lightning's own rule for writing ``self.log`` values of a training step
        (``_LoggerConnector.should_update_logs``): the ``n``-th, ``2n``-th, ... step counting from one, and a step on
        which training stops."""
        if getattr(trainer, "fast_dev_run", False):
            return True  # Lightning logs every step of a fast_dev_run
        every = self.every_n_steps
        if every is None:
            every = int(getattr(trainer, "log_every_n_steps", 50) or 0)
            if every <= 0:
                return False  # log_every_n_steps=0: Lightning writes no step values
        return (logger_step + 1) % every == 0 or bool(trainer.should_stop)

    def _handle_nonfinite(self, trainer: Any, optimizer: Any, step: int, report: AnyReport | None,
                          stats: GradStats | GradWeightStats) -> None:
        # Named from the report when this step has one, else from one more small read (a non-finite step only).
        what = describe_nonfinite(report) if report is not None else self.taker.describe_nonfinite(stats)
        optimizer.zero_grad(set_to_none=True)  # the optimizer then leaves every parameter untouched
        self.skipped_steps.append(step)
        if self.on_nonfinite == "stop":
            trainer.should_stop = True
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: %s; step skipped, stopping",
                           step, what)
        else:
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d: %s; step skipped", step, what)

    def _log(self, trainer: Any, report: AnyReport, logger_step: int) -> None:
        values = styled_keys(report, self.key_style, self.per_param)
        ours = metrics(report, self.prefix, self.per_param)
        if self.key_style in ("lightning", "composer"):  # the per-parameter norms are already there, so named
            ours = {k: v for k, v in ours.items() if not k.startswith(self.prefix + "norm/")}
        values.update(ours)
        if grad_report(report).first_nonfinite is not None and self.on_nonfinite is None:  # else already said
            logger.warning("torch_gradstats: non-finite gradient at logger step %d: %s", logger_step,
                           describe_nonfinite(report))
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
