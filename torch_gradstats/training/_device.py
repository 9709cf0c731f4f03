"""Where the Trainer runs and how batches get there: device validation, batch moves, batch sizes (no host sync)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import numbers
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import Tensor

__all__ = ["as_pair", "batch_size", "move", "safe_len", "same_device", "validate_device"]


def validate_device(device: torch.device | str | int | None, *, name: str = "device") -> torch.device:
    """Turn ``device`` into a :class:`torch.device` that exists on this machine and holds data, or raise a clear
    error.

    Accepts a ``torch.device``, a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a CUDA index.
    ``"cuda"`` without an index means the current CUDA device. ``name`` is how the errors call the argument (e.g.
    ``"--device"`` for a command-line flag).

    Raises:
        TypeError: ``device`` is none of those types.
        ValueError: the string is not a device, the device type is not available, the index is out of range, or
            the device is ``meta`` (shapes without data: nothing can be trained there).
    """

    def use(value: str) -> str:  # how to pass another value, in the caller's words
        return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"

    if device is None:
        raise ValueError(f"{name} is None; pass e.g. {use('cpu')} or {use('cuda:0')}")
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, numbers.Integral)):
        raise TypeError(
            f"{name} must be a torch.device, a string such as 'cpu' or 'cuda:0', or a CUDA index; got "
            f"{type(device).__name__}"
        )
    if isinstance(device, numbers.Integral):  # numpy integers too; a negative index is refused below
        if device < 0:
            raise ValueError(f"{name} index must be >= 0, got {int(device)}")
        device = f"cuda:{int(device)}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid {name} {device!r}: {exc}. Use e.g. 'cpu', 'cuda' or 'cuda:0'.") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError(
            f"{name} {str(dev)!r} holds no data (meta tensors have shapes only): nothing can be trained there; "
            f"use {use('cpu')} or a GPU"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{name} {str(dev)!r} requested but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use {use('cpu')}"
            )
        count = torch.cuda.device_count()
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= count:
            raise ValueError(
                f"{name} {str(dev)!r} requested but only {count} CUDA device(s) are visible "
                f"(valid: {', '.join(f'cuda:{i}' for i in range(count))})"
            )
        return dev
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise ValueError(f"{name} {str(dev)!r} requested but the {dev.type!r} backend is not available")
    return dev


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are the same device, an index of None matching any index of the same type."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


#: Target devices a tensor is copied to synchronously: a non-blocking copy to the CPU could be read before it lands
#: (and MPS has had races with it).
_BLOCKING_DEVICE_TYPES = ("cpu", "mps")


def move(x: Any, device: torch.device) -> Any:
    """``x`` on ``device``, walked the way Lightning's ``move_data_to_device`` walks a batch.

    Anything with a ``to`` method (a tensor, a module, a user's class) is moved by ``x.to(device)`` (a ``to`` that
    returns None leaves ``x`` as it is); dataclass instances (frozen ones too), mappings, namedtuples and other
    sequences are rebuilt as the same type around their moved items; strings and everything else stay as they
    are. ``x`` itself is never changed.
    """
    if isinstance(x, Tensor):
        # non_blocking only overlaps when the source is pinned (DataLoader(pin_memory=True)).
        return x.to(device, non_blocking=device.type not in _BLOCKING_DEVICE_TYPES)
    if not isinstance(x, type) and callable(getattr(x, "to", None)):
        moved = x.to(device)
        return x if moved is None else moved
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _move_dataclass(x, device)
    if isinstance(x, Mapping):
        items = [(k, move(v, device)) for k, v in x.items()]
        if isinstance(x, defaultdict):
            return type(x)(x.default_factory, items)
        return type(x)(items)  # type: ignore[call-arg]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple: its fields are positional arguments
        return type(x)(*(move(v, device) for v in x))
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray)):
        return type(x)([move(v, device) for v in x])  # type: ignore[call-arg]
    return x


def _move_dataclass(x: Any, device: torch.device) -> Any:
    """A copy of the dataclass instance ``x`` with its ``__init__`` fields moved (others shared, as in ``x``)."""
    out = copy.copy(x)
    for f in dataclasses.fields(x):
        if f.init:
            object.__setattr__(out, f.name, move(getattr(x, f.name), device))  # frozen dataclasses too
    cached = getattr(out, "__dict__", None)
    if cached is not None:  # a cached_property computed from the old fields would be stale
        for name, attr in vars(type(x)).items():
            if isinstance(attr, functools.cached_property):
                cached.pop(name, None)
    return out


def as_pair(batch: Any, index: int, device: torch.device) -> tuple[Any, Any]:
    """Batch ``index`` of the loader as ``(inputs, targets)`` on ``device``, or a clear error."""
    if not isinstance(batch, (tuple, list)):
        raise TypeError(
            f"batch {index} is a {type(batch).__name__}; expected an (inputs, targets) pair (a tuple, list or "
            "namedtuple of two)"
        )
    if len(batch) != 2:
        raise ValueError(f"batch {index} has {len(batch)} items; expected an (inputs, targets) pair")
    inputs, targets = batch
    return move(inputs, device), move(targets, device)


def _children(x: Any) -> Iterable[Any]:
    """The items ``move`` walks into (none for a leaf)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (getattr(x, f.name) for f in dataclasses.fields(x))
    if isinstance(x, Mapping):
        return x.values()
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray)):
        return x
    return ()


def _first_batched_tensor(x: Any) -> Tensor | None:
    """The first tensor with a batch dimension in ``x``, depth first in the order ``move`` walks it."""
    if isinstance(x, Tensor):
        return x if x.dim() > 0 else None
    for item in _children(x):
        found = _first_batched_tensor(item)
        if found is not None:
            return found
    return None


def batch_size(inputs: Any, targets: Any) -> int:
    """Number of samples in a batch, from the first batched tensor's shape (no sync), else ``len()``."""
    for x in (inputs, targets):
        t = _first_batched_tensor(x)
        if t is not None:
            return int(t.shape[0])  # from the shape: no sync
    for x in (inputs, targets):
        try:
            return len(x)
        except TypeError:
            pass
    raise ValueError("cannot tell the batch size: neither inputs nor targets is a tensor with a batch dimension")


def safe_len(loader: Iterable[Any]) -> int | None:
    """``len(loader)``, or None for a loader without a length."""
    if not isinstance(loader, Sized):
        return None
    try:
        return len(loader)
    except TypeError:  # e.g. a DataLoader over an IterableDataset without __len__
        return None
