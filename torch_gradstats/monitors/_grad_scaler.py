"""What the library reads of a ``torch.amp.GradScaler``: its scale on the device (:func:`loss_scale`, for the
Trainer's and the callbacks' per-example norms, the Lightning guard's loss and NoiseScale), and NoiseScale's use of
it: the readings of gradients of the scaled loss divided by the scale's square, and the check that
``NoiseScale.step`` reads gradients the scaler has unscaled. Split from noise_scale.py (past 500 lines): a job of its
own, tied to GradScaler's internals.

GradScaler keeps its scale and its per-optimizer stage in private attributes, ``_scale`` and
``_per_optimizer_states``, read here with ``getattr``: the public ``get_scale()`` syncs.
"""

from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device

__all__ = ["check_unscaled", "loss_scale", "unscaled"]


def loss_scale(scaler: Any) -> Tensor | None:
    """The scaler's scale as a device tensor (no sync), None without an enabled scaler that has scaled (``scaler``
    may be None)."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)  # get_scale() would sync; None until its first scale()
    return scale if isinstance(scale, Tensor) else None


def unscaled(scaler: Any, sq: Tensor) -> Tensor:
    """``sq``, a squared norm of gradients of the scaled loss, divided by the scale's square (on the device)."""
    scale = loss_scale(scaler)
    if scale is None:
        return sq
    return sq / to_device(scale.detach().reshape(()).to(torch.float64), sq.device).square()


def check_unscaled(scaler: Any) -> None:
    """With a scaler, ``NoiseScale.step`` reads ``.grad`` as the true gradient: the scaler must have unscaled it."""
    if loss_scale(scaler) is None:
        return
    states = getattr(scaler, "_per_optimizer_states", None)  # the stage GradScaler keeps per optimizer
    if isinstance(states, dict) and not any(
            getattr(s.get("stage"), "name", None) in ("UNSCALED", "STEPPED") for s in states.values()):
        raise ValueError(
            "NoiseScale.step: the scaler has not unscaled the gradients of this step, so .grad holds the "
            "gradient of the scaled loss; call step() after scaler.unscale_(optimizer) (or scaler.step) and "
            "before scaler.update()"
        )
