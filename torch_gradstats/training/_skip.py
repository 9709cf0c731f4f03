"""step_or_skip: apply a step factor (1.0 take, 0.0 skip; e.g. :meth:`SpikeGuard.observe`'s) to an optimizer step.

Three ways, chosen from metadata:

* **on the device**: optimizers that take a device-side ``found_inf`` (fused Adam, AdamW, SGD, Adagrad; see
  :func:`~torch_gradstats.training._step.device_skip_step`) are always stepped, with ``found_inf`` set where the
  factor is 0: parameters, optimizer state and step counts stay as they were. No host sync;
* **from the host**: any other optimizer (and a fused SGD whose momentum buffers do not exist yet) is stepped or not
  in Python, which reads the factor: ONE 0-d device-to-host read per call (a sync on an accelerator);
* **with a GradScaler**: ``scaler.step(optimizer)`` then ``scaler.update()``. A step skipped by the scaler (inf/NaN
  gradients) or by the factor is skipped once: for a fused optimizer the two ``found_inf`` are merged on the device,
  otherwise the factor is read only when the scaler decided to step. The scaler's update sees only its own
  inf checks, so a spike never shrinks the loss scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_gradstats.training._step import device_skip_step, host_skips, momentum_pending, scaler_step

__all__ = ["step_or_skip"]


def step_or_skip(
    optimizer: torch.optim.Optimizer, factor: Tensor, scaler: torch.amp.GradScaler | None = None
) -> None:
    """Step ``optimizer``, leaving parameters and optimizer state untouched where ``factor == 0``.

    Args:
        optimizer: any ``torch.optim.Optimizer``; those with a device-side ``found_inf`` (``fused=True``) skip
            without a host sync, except a fused SGD with momentum whose momentum buffers do not exist yet (its
            first step): it is stepped or not from the host (with a scaler, the scaler's overflow check is read
            with the factor), so a skipped first step leaves no uninitialised buffer. Any other optimizer is
            stepped or not from the host: one 0-d read of the factor per call.
        factor: one-element tensor, 1.0 to take the step and 0.0 to skip it (:meth:`SpikeGuard.observe`). Only
            zero skips: any other value (0.5, NaN) takes the whole step, unscaled. Its value is not checked, which
            would take a host read on every call.
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss).backward()`` made the gradients: it steps the
            optimizer (skipping steps with inf/NaN gradients itself) and is updated here.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_or_skip: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(factor, Tensor):
        raise TypeError(f"step_or_skip: factor must be a tensor (1.0 take, 0.0 skip), got {type(factor).__name__}")
    if factor.numel() != 1:
        raise ValueError(f"step_or_skip: factor must have one element, got shape {tuple(factor.shape)}")
    if factor.device.type == "meta":
        raise ValueError("step_or_skip: factor is a meta tensor, which has no value; pass the guard's factor")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"step_or_skip: scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    skip = (factor.detach().reshape(()) == 0).to(torch.float32)  # found_inf's convention: 1.0 skips
    device_step = device_skip_step(optimizer)
    on_device = device_step is not None and not momentum_pending(optimizer)

    if scaler is None or not scaler.is_enabled():
        if on_device:
            assert device_step is not None
            device_step(skip)
        elif not host_skips(skip):
            optimizer.step()
        if scaler is not None:
            scaler.update()
        return

    scaler_step(optimizer, scaler, skip)
    scaler.update()
