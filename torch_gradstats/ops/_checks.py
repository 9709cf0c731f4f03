"""The op's input contract, checked on metadata only: shared by the Python wrapper, the fake kernel and the
pure-PyTorch kernels (the compiled kernels enforce the same rules in csrc/ops.cpp).

Every error names the offending tensor by its index in the list and says what to do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

import torch
from torch import Tensor

__all__ = [
    "DTYPE_BITS",
    "OP_NAME",
    "SUPPORTED_DTYPES",
    "check_bool",
    "check_inputs",
    "check_tensor_list",
    "checked_numels",
    "type_name",
]

OP_NAME = "multi_tensor_stats"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Per dtype: the integer dtype of the same width, the mask that clears the sign bit, and the bits of +inf. Zero,
# NaN and Inf are told apart from these bits: comparisons on floats would see subnormals as zero on a thread that
# flushes denormals (torch.set_flush_denormal applies to the calling thread only).
DTYPE_BITS = {
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def type_name(value: object) -> str:
    """The type of ``value`` as errors name it: ``int``, ``str``, but ``numpy.bool`` (numpy's bool type is named
    "bool" too, and "must be a bool, got bool" would tell the caller nothing)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_bool(where: str, value: object) -> bool:
    """``value`` if it is True or False, else a TypeError naming ``where`` and what was given."""
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be a bool (True or False), got {type_name(value)}")
    return value


def check_inputs(tensors: Sequence[Tensor], *, check_storage: bool = True) -> None:
    """Raise a clear error naming the offending tensor if ``tensors`` breaks the op's input contract.

    The same rules are enforced by the compiled kernels (csrc/ops.cpp); this copy runs before dispatch and
    inside the fake kernel, on metadata only, so it never syncs. ``check_storage=False`` skips the storage-size
    check (fake and meta tensors have no data to check).
    """
    checked_numels(tensors, check_storage)


_BARE_TENSOR_MSG = (
    f"{OP_NAME}: expected a list of tensors, got a single tensor of shape {{shape}}; "
    "wrap it in a list ([t]) for its statistics as one tensor"
)


def _a(obj: object) -> str:
    if obj is None:
        return "None"
    name = type(obj).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_tensor_list(tensors: object, *, iterables: bool = False) -> None:
    """Raise TypeError unless ``tensors`` is a list or tuple (any sequence; with ``iterables``, any ordered
    iterable such as a generator). Strings, mappings and sets are refused: iterating them gives keys or characters,
    or tensors in no set order, so result ``i`` would match no tensor the caller can name."""
    if isinstance(tensors, (list, tuple)):
        return
    ordered = isinstance(tensors, Sequence) or (iterables and hasattr(tensors, "__iter__"))
    if not ordered or isinstance(tensors, (str, bytes, bytearray, Mapping, AbstractSet)):
        hint = "; pass list(d.values())" if isinstance(tensors, Mapping) else ""
        raise TypeError(
            f"{OP_NAME}: tensors must be a tensor or a list or tuple of tensors, got {_a(tensors)}{hint}"
        )


def checked_numels(tensors: Sequence[Tensor], check_storage: bool = True) -> list[int]:
    """:func:`check_inputs`, returning each tensor's number of elements (one tight pass: the fallback runs it on
    every call, and for 100,000s of small tensors each attribute read counts)."""
    if type(tensors) is not list:
        if isinstance(tensors, Tensor):
            raise TypeError(_BARE_TENSOR_MSG.format(shape=tuple(tensors.shape)))
        check_tensor_list(tensors)
    if len(tensors) == 0:
        raise ValueError(f"{OP_NAME}: expected at least one tensor, got an empty list")
    first = tensors[0]
    device = first.device if isinstance(first, Tensor) else None
    check_storage = check_storage and device is not None and device.type != "meta"
    numels = []
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or t.dtype not in DTYPE_BITS or t.layout != torch.strided or t.is_nested:
            _raise_for(i, t)
        if t.device != device:
            raise ValueError(
                f"{OP_NAME}: tensors[{i}] is on {t.device} but tensors[0] is on {device}; "
                "all tensors of one call must be on one device (group them by device)"
            )
        numel = t.numel()
        if check_storage and numel:
            _check_storage(i, t, numel)
        numels.append(numel)
    return numels


def _raise_for(i: int, t: object) -> None:
    """The error for ``tensors[i]``, which is not a dense tensor of a supported dtype."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{OP_NAME}: tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
    if t.is_nested:
        raise ValueError(f"{OP_NAME}: tensors[{i}] is a nested tensor; pass its components instead (t.unbind())")
    if t.layout != torch.strided:
        raise ValueError(
            f"{OP_NAME}: tensors[{i}] has layout {t.layout}; only strided (dense) tensors are supported, "
            "convert it with .to_dense()"
        )
    raise TypeError(f"{OP_NAME}: tensors[{i}] has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")


def _check_storage(i: int, t: Tensor, numel: int) -> None:
    """The storage must hold every element the view can address: a freed or shrunk storage would be read out of
    bounds. Metadata only."""
    try:
        have = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return  # a wrapper subclass with no storage of its own: the kernels it dispatches to check their inputs
    if t.is_contiguous():
        extent = numel
    else:
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    needed = (t.storage_offset() + extent) * t.element_size()
    if have < needed:
        raise ValueError(
            f"{OP_NAME}: tensors[{i}] needs {needed} bytes of storage but its storage holds {have} "
            "(it was freed or resized, e.g. by untyped_storage().resize_(0)); pass a tensor with allocated data"
        )
