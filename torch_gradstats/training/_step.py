"""How the Trainer takes one optimizer step, and how it counts steps.

One step is taken in exactly one of four ways:

* **plain**: ``optimizer.step()``;
* **by the GradScaler**: ``scaler.step(optimizer)`` (which skips non-finite steps itself) then ``scaler.update()``;
* **skipped on the device**: an optimizer that accepts a device-side ``found_inf`` (fused Adam, AdamW, SGD, Adagrad)
  is always stepped and skips the update in its kernel where a gradient was non-finite: no host sync;
* **skipped from the host**: any other optimizer; whether to call ``optimizer.step()`` is decided in Python, which
  costs one host sync per step.

The step counter advances exactly when a step is taken or skipped: a step post-hook on the optimizer counts the step
the moment ``optimizer.step()`` has updated the parameters (even if a later hook or the loop is then interrupted),
and a step that is skipped without calling ``optimizer.step()`` is counted where it is skipped. So after any
interrupt (``KeyboardInterrupt`` included) the counter agrees with the optimizer's own step counts. (Post-hooks run
in registration order: one registered on the optimizer *before* the Trainer was created that raises would run first.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device, to_host

__all__ = ["OptimizerStepper", "device_skip_step", "host_skips", "momentum_pending", "scaler_step"]


def device_skip_step(optimizer: torch.optim.Optimizer) -> Callable[[Tensor], None] | None:
    """``step(found_inf)`` that steps ``optimizer`` and lets it skip the update on the device, or None if it cannot.

    This is the one place that relies on torch's private optimizer protocol, the one ``torch.amp.GradScaler`` uses:
    optimizers whose ``_step_supports_amp_scaling`` is True (the ``fused=True`` implementations) read the attribute
    ``found_inf`` (a float32 0-d device tensor) inside ``step()`` and leave the parameters and their step counts
    unchanged where it is non-zero.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return None

    def step(found_inf: Tensor) -> None:
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # the private protocol above
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]

    return step


class OptimizerStepper:
    """Takes the Trainer's optimizer steps (see the module docstring) and counts them in :attr:`count`."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, skip_nonfinite: bool
    ) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        self.count = 0  #: optimizer steps taken or skipped
        self._device_skip = device_skip_step(optimizer)
        self._state_ready: tuple[int, int, int] | None = None  # see _state_pending: the optimizer's layout then
        self._armed = False  # a counted call is in progress
        self._stepped = False  # ... and optimizer.step() has completed inside it
        register = getattr(optimizer, "register_step_post_hook", None)
        if callable(register):
            register(self._on_optimizer_step)

    @property
    def skips_on_device(self) -> bool:
        """The optimizer can skip a non-finite step on the device (no host sync)."""
        return self._device_skip is not None

    def step(self, nonfinite: Tensor | None, skip: Tensor | None = None) -> bool | None:
        """Take (or skip) one optimizer step.

        Args:
            nonfinite: float64 0-d device tensor, 1.0 when a gradient is non-finite; None when no gradient was read
                (the step is then taken as it is).
            skip: a policy's decision (a spike guard's), float 0-d device tensor, 1.0 to skip the step whatever
                ``skip_nonfinite`` says; with a scaler, merged with the scaler's own skip.

        Returns:
            Whether the step was skipped, where that was decided on the host; None where it was decided on the
            device (or nothing could skip it).
        """
        if self.scaler is not None and self.scaler.is_enabled():  # a disabled scaler steps as no scaler would
            self._scaler_step(self.scaler, skip)
            return None
        flag = nonfinite if self.skip_nonfinite else None
        if skip is not None:
            flag = skip.to(torch.float64) if flag is None else torch.maximum(flag, skip.to(torch.float64))
        if flag is not None:
            if self._device_skip is not None and not self._state_pending():
                self._device_skipping_step(self._device_skip, flag)
                return None
            return self._host_skipping_step(flag)
        self._plain_step()
        return None

    # ------------------------------------------------------------------------------------------- the four ways
    def _plain_step(self) -> None:
        with self._counted():
            self.optimizer.step()

    def _scaler_step(self, scaler: torch.amp.GradScaler, skip: Tensor | None = None) -> None:
        with self._counted():
            if skip is None and not self._state_pending():
                scaler.step(self.optimizer)  # calls optimizer.step() unless a gradient is non-finite
            else:  # a policy's skip, or the scaler's own to be kept from a fused SGD's first step (scaler_step)
                scaler_step(self.optimizer, scaler, torch.zeros(()) if skip is None else skip.to(torch.float32))
        scaler.update()

    def _device_skipping_step(self, step: Callable[[Tensor], None], nonfinite: Tensor) -> None:
        with self._counted():
            step(nonfinite.to(torch.float32))

    def _host_skipping_step(self, nonfinite: Tensor) -> bool:
        if bool(nonfinite):  # the documented host sync: a non-fused optimizer can only be skipped from Python
            self.count += 1  # skipped: counted here, where it is decided
            return True
        self._plain_step()
        return False

    # ------------------------------------------------------------------------------------------- counting
    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Count the one step of the call inside: when ``optimizer.step()`` completes (the post-hook), or, if the
        call returns without stepping (the scaler skipped it), when it returns; not at all if it is interrupted
        before stepping."""
        self._armed, self._stepped = True, False
        try:
            yield
            if not self._stepped:
                self.count += 1
        finally:
            self._armed = False

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._armed and not self._stepped:
            self._stepped = True
            self.count += 1

    def _state_pending(self) -> bool:
        """:func:`momentum_pending`, until it is False once for the optimizer's param groups and state: a group added
        later (``add_param_group``, e.g. layers unfrozen mid-run), or a state loaded or cleared (a rollback to a
        checkpoint saved before the first step), has no momentum buffers yet, and a fused SGD's step that creates
        them, skipped on the device, would leave them uninitialised as on the very first step. Asked again only
        when the number of groups, or the state dict or its size, changed (no walk over the parameters per step)."""
        opt = self.optimizer
        layout = (len(opt.param_groups), id(opt.state), len(opt.state))
        if self._state_ready == layout:
            return False
        if momentum_pending(opt):
            return True
        self._state_ready = layout
        return False


def momentum_pending(optimizer: torch.optim.Optimizer) -> bool:
    """True while an SGD with momentum has not yet created its momentum buffers.

    A fused SGD's first step allocates them uninitialised (``empty_like``) and, told to skip by ``found_inf``, leaves
    them so: a skipped first step would poison every later one. Until the buffers exist, a skip is decided on the
    host (one sync per step, normally just the first).
    """
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            if group.get("momentum", 0) == 0:
                continue
            for p in group["params"]:
                if p.grad is not None and "momentum_buffer" not in optimizer.state.get(p, {}):
                    return True
    return False


def host_skips(skip: Tensor) -> bool:
    """Whether a 0-d skip flag (1.0 skips) is set: the documented host read of a step skipped from Python."""
    floats, _ = to_host([skip.reshape(1)], [])
    return floats[0] != 0.0


def scaler_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: Tensor) -> None:
    """``scaler.step(optimizer)``, also skipping the step where the float32 0-d ``skip`` is 1.0 (not ``update``).

    The scaler calls ``optimizer.step()`` only when it takes the step (finite gradients); a wrapper put on the
    instance for this call adds ``skip`` there: merged into the ``found_inf`` the scaler hands a fused optimizer (on
    the device), or read on the host for any other. The scaler's own inf checks, which its ``update`` reads, are
    left as they are.

    A fused SGD with momentum whose buffers do not exist yet (:func:`momentum_pending`) is handed its step only when
    neither the scaler's ``found_inf`` nor ``skip`` is set, read on the host (one sync, normally on the first step
    only): told to skip by ``found_inf`` it would create the buffers uninitialised and train on them from then on
    (what torch's own ``scaler.step`` does after an overflow on the first step).
    """
    on_device = device_skip_step(optimizer) is not None and not momentum_pending(optimizer)
    instance_step = optimizer.__dict__.get("step")  # an LR scheduler may have wrapped step() on the instance
    real_step = optimizer.step

    @functools.wraps(real_step)
    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        found = getattr(optimizer, "found_inf", None)
        if isinstance(found, Tensor) and on_device:
            # Fused kernels skip where found_inf == 1 and subtract it from their step counts: exactly 0 or 1.
            optimizer.found_inf = torch.clamp(found + to_device(skip, found.device), max=1.0)  # type: ignore[attr-defined]
            return real_step(*args, **kwargs)
        # Read on the host: a fused optimizer's found_inf too (a fused SGD whose momentum buffers do not exist yet).
        either = skip if not isinstance(found, Tensor) else torch.maximum(to_device(skip, found.device), found)
        if host_skips(either):
            return None
        return real_step(*args, **kwargs)

    optimizer.step = guarded_step  # type: ignore[method-assign]
    try:
        scaler.step(optimizer)
    finally:
        if instance_step is None:
            del optimizer.step
        else:
            optimizer.step = instance_step  # type: ignore[method-assign]
