"""What the policies that act on statistics (guard, adaptive_clip) share: checked settings, a per-step figure given as
a tensor or a number made a float64 0-d tensor without a host sync, the checks of a loaded state's tensors, and the
moves of their state between devices."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import fetch, to_device

__all__ = ["as_figure", "check_device", "check_int", "check_real", "check_state_tensors", "load_state", "moved"]


def check_real(
    where: str, value: object, *, low: float = -math.inf, low_open: bool = False, high: float = math.inf
) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``), or a TypeError/ValueError
    naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a real number, got {value!r} ({type(value).__name__})")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or number > high:
        lo = f"> {low:g}" if low_open else f">= {low:g}"
        hi = "" if high == math.inf else f" and <= {high:g}"
        raise ValueError(f"{where} must be finite, {lo}{hi}; got {value!r}")
    return number


#: The most values a policy keeps on the device per history (its buffers are allocated whole, up front).
MAX_HISTORY = 1 << 20


def check_int(where: str, value: object, *, low: int, high: int | None = None, why: str = "") -> int:
    """``value`` as an int in ``[low, high]``, or a TypeError/ValueError naming ``where`` (and ``why`` the bound)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where} must be an int, got {value!r} ({type(value).__name__})")
    if int(value) < low:
        raise ValueError(f"{where} must be >= {low}, got {value!r}")
    if high is not None and int(value) > high:
        raise ValueError(f"{where} must be <= {high:,}{why}, got {value!r}")
    return int(value)


def check_device(where: str, device: object) -> torch.device:
    """``device`` (a torch.device or a str such as ``"cuda:0"``, not ``"meta"``) as a torch.device, or a
    TypeError/ValueError naming ``where`` (torch's own errors name neither; an int would pick an accelerator)."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"{where} must be a torch.device or a str, got {device!r} ({type(device).__name__})")
    try:
        out = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{where} is not a device: {device!r} ({exc})") from None
    if out.type == "meta":  # the state would have no values: every decision unreadable, no move off it possible
        raise ValueError(f"{where} is the meta device, which holds no values; keep the state where the gradient "
                         "norms are computed (by default it moves to the first one's device)")
    return out


def as_figure(where: str, value: object, device: torch.device) -> Tensor:
    """A per-step figure (a one-element real tensor or a Python number) as a float64 0-d tensor, detached.

    A tensor stays on its device (the caller moves its state there); a number is made on ``device``. Metadata
    checks only: nothing here reads the value.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{where} must be a real tensor, got {value.dtype}")
        if value.device.type == "meta":  # the state would move there and lose every value it holds
            raise ValueError(f"{where} is a meta tensor, which has no value; pass the figure of a real step")
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a tensor or a real number, got {type(value).__name__}")
    if torch.compiler.is_compiling():  # a constant of the graph
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    return to_device(torch.tensor(float(value), dtype=torch.float64), device)


def moved(t: Tensor, device: torch.device) -> Tensor:
    """A copy of the state tensor ``t`` on ``device`` (to the host only when loading or moving state, not per step),
    a normal tensor even inside inference mode (an inference tensor refuses every later in-place update)."""
    with torch.inference_mode(False):
        if t.device == device:
            return t.clone()
        if device.type == "cpu":
            return fetch(t).clone()
        return to_device(t, device).clone()


def load_state(current: Tensor, saved: Tensor) -> Tensor:
    """``saved`` as the new value of the state tensor ``current``: copied into it in place where the shapes agree,
    so a compiled function or a captured CUDA graph that holds ``current`` keeps working; else a copy on its device."""
    if current.shape == saved.shape and current.dtype == saved.dtype:
        return current.copy_(moved(saved, current.device))
    return moved(saved, current.device)


def check_state_tensors(where: str, state: Mapping[str, Any], shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                        ) -> None:
    """Raise a ValueError naming the key unless each ``state[key]`` is a tensor of ``shapes[key]``'s shape and dtype
    with values (a meta tensor, from ``map_location="meta"``, has shapes only). ``where``: the loading method."""
    for key, (shape, dtype) in shapes.items():
        t = state[key]
        if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {key!r} must be a {dtype} tensor of shape {shape}, got {got}")
        if t.device.type == "meta":
            raise ValueError(f"{where}: {key!r} is a meta tensor, which has no values; load the state with "
                             "map_location set to a real device")
