"""What the Lightning callback needs to know of Lightning's optimizer steps: when Lightning writes a step's values,
the loss it passes for each micro-batch, and how a guard's skip reaches an optimizer inside Lightning's closure.

Kept apart from the callback (lightning.py), which reads, judges and logs: these are Lightning's rules, each one a
reading of Lightning's own code, and they change when Lightning does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.monitors._grad_scaler import loss_scale
from torch_gradstats.training._step import device_skip_step, host_skips, momentum_pending

__all__ = ["GuardSkip", "StepLoss", "batch_logger_step", "example_scale", "lightning_scaler", "log_due"]

logger = logging.getLogger("torch_gradstats")


def lightning_scaler(trainer: Any) -> Any:
    """The GradScaler of Lightning's mixed-precision plugin ("16-mixed"), or None."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def batch_logger_step(trainer: Any) -> int:
    """The step Lightning's logger connector gives the ``self.log``'d values of this batch."""
    return int(getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step))


def log_due(trainer: Any, every_n_steps: int | None, step: int) -> bool:
    """Lightning's own rule for writing ``self.log`` values of a training step at logger step ``step``
    (``_LoggerConnector.should_update_logs``): the ``n``-th, ``2n``-th, ... step counting from one, and a step on
    which training stops. ``every_n_steps`` None: the trainer's ``log_every_n_steps``."""
    if getattr(trainer, "fast_dev_run", False):
        return True  # Lightning logs every step of a fast_dev_run
    every = every_n_steps
    if every is None:
        every = int(getattr(trainer, "log_every_n_steps", 50) or 0)
        if every <= 0:
            return False  # log_every_n_steps=0: Lightning writes no step values
    return (step + 1) % every == 0 or bool(trainer.should_stop)


def example_scale(trainer: Any) -> Tensor | float:
    """Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` (and a GradScaler multiplies it
    by its scale): the factor that undoes both on per-example norms."""
    scale = float(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    by = loss_scale(lightning_scaler(trainer))
    return scale if by is None else scale / by.reshape(()).to(torch.float64)


class StepLoss:
    """The losses Lightning passes to ``on_before_backward`` since the last optimizer step, summed on the device
    (no sync), and how many there were."""

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self._count = 0

    def add(self, trainer: Any, loss: Tensor) -> None:
        """One micro-batch's loss. Under ``precision="16-mixed"`` Lightning passes it already multiplied by the
        GradScaler's scale: divided by it here, on the device, so a guard judges the loss and not the scale's
        changes."""
        value = loss.detach()
        scale = loss_scale(lightning_scaler(trainer))
        if scale is not None:
            value = value / scale.reshape(()).to(value.device)
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def take(self, trainer: Any, pl_module: Any) -> Tensor | None:
        """The step's loss, the mean of its micro-batches' losses, from their sum, and a fresh start. Automatic
        optimization divides each by ``accumulate_grad_batches``, the epoch's short last window too (fewer
        micro-batches): the sum is scaled by ``accumulate_grad_batches / count`` (1 on a full window). Manual
        optimization divides nothing: the sum of the step's ``manual_backward`` losses, as given."""
        loss, n = self._sum, self._count
        self._sum, self._count = None, 0
        if loss is None or not getattr(pl_module, "automatic_optimization", True):
            return loss
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        return loss if n == accumulate else loss * (accumulate / n)


class GuardSkip:
    """Skips an optimizer step a guard flagged, from ``on_before_optimizer_step``: on the device where it can,
    else from the host."""

    def __init__(self) -> None:
        self._found_inf_set: set[int] = set()  # optimizers given a guard's found_inf for this step (ids)
        self._hooked: set[int] = set()  # optimizers with our step post-hook
        self._warned_host_skip = False

    def apply(self, trainer: Any, optimizer: Any, factor: Tensor) -> bool | None:
        """Skip this step where the guard's ``factor`` is 0: on the device through a fused optimizer's
        ``found_inf`` (read by its ``step()`` after this hook; returns None), else from the host by dropping the
        gradients (returns whether it skipped)."""
        skip = (factor == 0).to(torch.float32)
        scaler = lightning_scaler(trainer)
        if (scaler is None and isinstance(optimizer, torch.optim.Optimizer)
                and device_skip_step(optimizer) is not None and not momentum_pending(optimizer)):
            # The protocol torch.amp.GradScaler uses (see training._step.device_skip_step): a fused optimizer's
            # step() reads found_inf and, where it is 1, leaves parameters, state and step counts as they were.
            # We are inside Lightning's closure, so step() reads it next; a post-hook takes it away again.
            if id(optimizer) not in self._hooked:
                optimizer.register_step_post_hook(self.clear)
                self._hooked.add(id(optimizer))
            optimizer.found_inf = skip  # type: ignore[attr-defined]
            self._found_inf_set.add(id(optimizer))
            return None
        if not self._warned_host_skip:
            self._warned_host_skip = True
            logger.warning("torch_gradstats: spike_guard with %s%s decides each step on the host (one sync per "
                           "optimizer step); a fused optimizer (fused=True) without a GradScaler skips on the device",
                           type(optimizer).__name__, " and a GradScaler" if scaler is not None else "")
        if host_skips(skip):
            optimizer.zero_grad(set_to_none=True)  # the optimizer then leaves every parameter untouched
            return True
        return False

    def clear(self, optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
        """Take away the ``found_inf`` given to ``optimizer`` (its step post-hook, and at teardown for a step that
        never ran)."""
        if id(optimizer) in self._found_inf_set:
            self._found_inf_set.discard(id(optimizer))
            del optimizer.found_inf
