"""The one op: ``torch.ops.torch_gradstats.multi_tensor_stats``.

This module owns everything every layer relies on:

* the schema, defined once, here (so the op exists and traces even without the compiled library);
* the fake kernel (fixed output shapes, so torch.compile and CUDA graphs see one node and never a host sync);
* the pure-PyTorch kernel: the float64 reference the tests compare against, and the fallback the dispatcher runs on
  any device that has no compiled kernel (or everywhere, under ``TORCH_GRADSTATS_FORCE_FALLBACK=1``);
* the typed Python wrapper :func:`multi_tensor_stats`.

Contract, for N input tensors (see DESIGN.md):

=========  ================  ==============================================================================
output     dtype, shape      meaning
=========  ================  ==============================================================================
sumsq      float64 [N]       sum of x**2; NaN if any NaN; +inf if any inf and no NaN; finite for finite 16/32-bit
amax       float64 [N]       max |x|; NaN if any NaN; 0 for an empty tensor
counts     int64 [N, 3]      number of elements == 0 (-0.0 too), NaN, +-inf
=========  ================  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "SUPPORTED_DTYPES",
    "TensorStats",
    "check_inputs",
    "multi_tensor_stats",
    "reference_multi_tensor_stats",
]

OP_NAMESPACE = "torch_gradstats"
OP_NAME = "multi_tensor_stats"
OP_QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

#: Index of each column of ``counts``.
ZERO, NAN, INF = 0, 1, 2

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TensorStats(NamedTuple):
    """Per-tensor statistics of one :func:`multi_tensor_stats` call. All three live on the inputs' device."""

    sumsq: Tensor  #: float64 [N]: sum of squares (norm of tensor i is ``sumsq[i].sqrt()``)
    amax: Tensor  #: float64 [N]: max |x|
    counts: Tensor  #: int64 [N, 3]: zeros, NaNs, Infs


def check_inputs(tensors: Sequence[Tensor]) -> None:
    """Raise a clear error naming the offending tensor if ``tensors`` breaks the op's input contract.

    The same rules are enforced by the compiled kernels (csrc/ops.cpp); this copy runs before dispatch and
    inside the fake kernel, on metadata only, so it never syncs.
    """
    if len(tensors) == 0:
        raise ValueError(f"{OP_NAME}: expected at least one tensor, got an empty list")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{OP_NAME}: tensors[{i}] is a {type(t).__name__}, expected a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(
                f"{OP_NAME}: tensors[{i}] has layout {t.layout}; only strided (dense) tensors are supported, "
                "convert it with .to_dense()"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{OP_NAME}: tensors[{i}] has dtype {t.dtype}; expected float16, bfloat16, float32 or float64"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"{OP_NAME}: tensors[{i}] is on {t.device} but tensors[0] is on {device}; "
                "all tensors of one call must be on one device (group them by device)"
            )


def reference_multi_tensor_stats(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-PyTorch kernel, accumulating in float64: the reference for the tests and the portable fallback.

    Reads each tensor through a float64 copy (so float32's FLT_MAX and float16's 6e4 square without overflow),
    one tensor at a time so at most one copy is alive. Uses no host sync and no data-dependent shapes.
    """
    check_inputs(tensors)
    device = tensors[0].device
    sumsq, amax, counts = [], [], []
    for t in tensors:
        x = t.detach().reshape(-1).to(torch.float64)
        if x.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            sumsq.append(zero)
            amax.append(zero)
            counts.append(torch.zeros(3, dtype=torch.int64, device=device))
            continue
        sumsq.append(torch.sum(x * x))
        amax.append(torch.amax(x.abs()))  # amax propagates NaN
        counts.append(torch.stack([(x == 0).sum(), x.isnan().sum(), x.isinf().sum()]))
    return torch.stack(sumsq), torch.stack(amax), torch.stack(counts)


def _fake_multi_tensor_stats(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(tensors)
    n, device = len(tensors), tensors[0].device
    return (
        torch.empty(n, dtype=torch.float64, device=device),
        torch.empty(n, dtype=torch.float64, device=device),
        torch.empty(n, 3, dtype=torch.int64, device=device),
    )


# The schema is defined once, here. Compiled kernels (csrc/) register against it with TORCH_LIBRARY_IMPL for their
# backend keys; the pure-PyTorch kernel is registered as CompositeExplicitAutograd, which the dispatcher uses only
# for backends that have no kernel of their own.
_lib = torch.library.Library(OP_NAMESPACE, "DEF")
_lib.define(f"{OP_NAME}(Tensor[] tensors) -> (Tensor sumsq, Tensor amax, Tensor counts)")
_lib.impl(OP_NAME, reference_multi_tensor_stats, "CompositeExplicitAutograd")
# Statistics are not differentiable: autograd falls through, so outputs never require grad (and inputs need no
# per-tensor detach, which would cost more host time than the whole op for thousands of tensors).
_lib.impl(OP_NAME, torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake(OP_QUALNAME, _fake_multi_tensor_stats, lib=_lib)

# Load the compiled kernels only now, after the schema they register against exists.
from torch_gradstats._extension import HAS_EXTENSION  # noqa: E402,F401


def multi_tensor_stats(tensors: Iterable[Tensor]) -> TensorStats:
    """Sum of squares, max |x| and zero/NaN/Inf counts of every tensor, in one pass over their memory.

    Args:
        tensors: one or more float16/bfloat16/float32/float64 tensors on one device; any shapes and strides,
            mixed dtypes allowed. They are never modified.

    Returns:
        :class:`TensorStats` of device tensors (no host sync): ``sumsq`` and ``amax`` float64 ``[N]``,
        ``counts`` int64 ``[N, 3]`` (zeros, NaNs, Infs).

    Raises:
        ValueError / TypeError naming the offending tensor's index for an empty list, a non-float dtype,
        a non-strided layout or tensors on different devices.
    """
    tensors = list(tensors)
    op = torch.ops.torch_gradstats.multi_tensor_stats.default
    if torch.compiler.is_compiling():
        check_inputs(tensors)  # at trace time only: the compiled graph carries no Python checks
        return TensorStats(*op(tensors))
    # Eager: the kernels check their inputs themselves; the Python checks (a loop over every tensor) run only to
    # turn a failure into the same clear, named error on every backend.
    try:
        return TensorStats(*op(tensors))
    except (TypeError, ValueError, RuntimeError):
        check_inputs(tensors)
        raise
