"""Where the Trainer runs and how batches get there: device validation, batch moves, batch sizes (no host sync)."""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

import torch
from torch import Tensor

__all__ = ["as_pair", "batch_size", "move", "safe_len", "same_device", "validate_device"]


def validate_device(device: torch.device | str | int | None) -> torch.device:
    """Turn ``device`` into a :class:`torch.device` that exists on this machine, or raise a clear error.

    Accepts a ``torch.device``, a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``, or a CUDA index.
    ``"cuda"`` without an index means the current CUDA device.

    Raises:
        ValueError: the string is not a device, or the device type is not available, or the index is out of range.
    """
    if device is None:
        raise ValueError("device is None; pass e.g. 'cpu' or 'cuda:0'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"invalid device {device!r}: {exc}. Use e.g. 'cpu', 'cuda' or 'cuda:0'.") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(dev)!r} requested but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= count:
            raise ValueError(
                f"device {str(dev)!r} requested but only {count} CUDA device(s) are visible "
                f"(valid: {', '.join(f'cuda:{i}' for i in range(count))})"
            )
        return dev
    backend = getattr(torch, dev.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise ValueError(f"device {str(dev)!r} requested but the {dev.type!r} backend is not available")
    return dev


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are the same device, an index of None matching any index of the same type."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def move(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or tuples/lists/dicts of them) on ``device``; anything else as it is."""
    if isinstance(x, Tensor):
        # non_blocking only overlaps when the source is pinned (DataLoader(pin_memory=True)); harmless otherwise.
        return x.to(device, non_blocking=True)
    if isinstance(x, (tuple, list)):
        return type(x)(move(t, device) for t in x)
    if isinstance(x, dict):
        return {k: move(v, device) for k, v in x.items()}
    return x


def as_pair(batch: Any, index: int, device: torch.device) -> tuple[Any, Any]:
    """Batch ``index`` of the loader as ``(inputs, targets)`` on ``device``, or a clear error."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"batch {index} is a {type(batch).__name__}; expected an (inputs, targets) pair")
    return move(batch[0], device), move(batch[1], device)


def _first_batched_tensor(x: Any) -> Tensor | None:
    """The first tensor with a batch dimension in ``x`` (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(x, Tensor):
        return x if x.dim() > 0 else None
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for item in items:
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
