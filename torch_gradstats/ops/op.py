"""The one op: ``torch.ops.torch_gradstats.multi_tensor_stats``.

This module owns everything every layer relies on:

* the schema, defined once, here (so the op exists and traces even without the compiled library);
* the fake kernel (fixed output shapes, so torch.compile and CUDA graphs see one node and never a host sync);
* the registration of the pure-PyTorch kernel :func:`~torch_gradstats.ops.fallback.fallback_multi_tensor_stats`
  (:mod:`torch_gradstats.ops.fallback`), which the dispatcher runs on any device that has no compiled kernel (XPU, a
  CPU without the extension; everywhere under ``TORCH_GRADSTATS_FORCE_FALLBACK=1``; MPS, which has no float64,
  gets a clear error);
* the float64 reference :func:`reference_multi_tensor_stats`, which the tests compare every kernel with;
* the typed Python wrapper :func:`multi_tensor_stats`;
* the overload ``multi_tensor_stats.histogram``, which returns the exponent histogram as well (same read, same
  checks; its fallback is :mod:`torch_gradstats.ops.fallback_histogram`).

Why two pure-PyTorch implementations: the fallback must be fast and bounded in memory (it batches thousands of
small tensors into a few ops, cuts large ones into chunks, reads zero/NaN/Inf from the bits and fixes the order of
every float sum), which makes it no longer obviously correct. The reference stays the simple, unbounded,
obviously correct one (a float64 copy of each tensor, plain torch reductions); the tests check the fallback
against it like any other kernel, and the reference itself against numpy.

Contract, for N input tensors (see docs/design.md):

=========  ================  ==============================================================================
output     dtype, shape      meaning
=========  ================  ==============================================================================
sumsq      float64 [N]       sum of x**2; NaN if any NaN; +inf if any inf and no NaN; finite for finite 16/32-bit
amax       float64 [N]       max |x|; NaN if any NaN; 0 for an empty tensor
counts     int64 [N, 3]      number of elements == 0 (-0.0 too), NaN, +-inf
=========  ================  ==============================================================================

``multi_tensor_stats.histogram`` returns a fourth output, ``exponent_histogram``, int64 ``[N, 277]``: bucket ``b``
of row ``i`` counts the finite non-zero elements of tensor ``i`` with ``floor(log2 |x|) == b - 149`` (float64
values below ``2**-149`` count in bucket 0, at or above ``2**128`` in bucket 276). Zeros, NaNs and Infs are in
``counts`` only, so each row sums to ``numel - zeros - nans - infs``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling

from torch_gradstats.ops import fallback, fallback_histogram
from torch_gradstats.ops._checks import OP_NAME, SUPPORTED_DTYPES, check_bool, check_inputs, check_tensor_list
from torch_gradstats.ops.fallback import fallback_multi_tensor_stats
from torch_gradstats.ops.fallback_histogram import HISTOGRAM_BUCKETS, HISTOGRAM_MIN_EXPONENT

__all__ = [
    "HISTOGRAM_BUCKETS",
    "HISTOGRAM_MIN_EXPONENT",
    "SUPPORTED_DTYPES",
    "HistogramStats",
    "TensorStats",
    "check_inputs",
    "fallback_multi_tensor_stats",
    "multi_tensor_stats",
    "reference_multi_tensor_stats",
]

OP_NAMESPACE = "torch_gradstats"
OP_QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"
HISTOGRAM_OVERLOAD = f"{OP_NAME}.histogram"

#: Index of each column of ``counts``.
ZERO, NAN, INF = 0, 1, 2


class TensorStats(NamedTuple):
    """Per-tensor statistics of one :func:`multi_tensor_stats` call. All three live on the inputs' device."""

    sumsq: Tensor  #: float64 [N]: sum of squares (norm of tensor i is ``sumsq[i].sqrt()``)
    amax: Tensor  #: float64 [N]: max |x|
    counts: Tensor  #: int64 [N, 3]: zeros, NaNs, Infs


class HistogramStats(NamedTuple):
    """:class:`TensorStats` and the exponent histogram, from one ``multi_tensor_stats(..., histogram=True)`` call."""

    sumsq: Tensor  #: float64 [N]
    amax: Tensor  #: float64 [N]
    counts: Tensor  #: int64 [N, 3]: zeros, NaNs, Infs
    exponent_histogram: Tensor  #: int64 [N, 277]: finite non-zero elements by floor(log2 |x|) + 149


def reference_multi_tensor_stats(tensors: Sequence[Tensor], histogram: bool = False) -> tuple[Tensor, ...]:
    """The float64 reference the tests compare every kernel with (the fallback included). Not registered.

    Obviously correct rather than fast: each tensor is copied whole to float64 (so float32's FLT_MAX and
    float16's 6e4 square without overflow) and reduced with plain torch ops, one tensor at a time. Its extra
    memory is 8 bytes per element of the largest tensor, and torch.sum's order of addition follows the thread
    count: it is an oracle for tests, not a kernel. With ``histogram=True`` the fourth output is the exponent
    histogram, from ``torch.frexp`` of the float64 values (``|x| = m * 2**e`` with ``0.5 <= m < 1``, so
    ``floor(log2 |x|) = e - 1``).
    """
    check_inputs(tensors)
    device = tensors[0].device
    sumsq, amax, counts, hist = [], [], [], []
    for t in tensors:
        x = t.detach().reshape(-1).to(torch.float64)
        row = torch.zeros(HISTOGRAM_BUCKETS, dtype=torch.int64, device=device)
        hist.append(row)
        if x.numel() == 0:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            sumsq.append(zero)
            amax.append(zero)
            counts.append(torch.zeros(3, dtype=torch.int64, device=device))
            continue
        sumsq.append(torch.sum(x * x))
        amax.append(torch.amax(x.abs()))  # amax propagates NaN
        counts.append(torch.stack([(x == 0).sum(), x.isnan().sum(), x.isinf().sum()]))
        if histogram:
            finite = x[torch.isfinite(x) & (x != 0)]
            e = torch.frexp(finite).exponent.to(torch.int64) - 1
            bucket = (e - HISTOGRAM_MIN_EXPONENT).clamp(0, HISTOGRAM_BUCKETS - 1)
            row += torch.bincount(bucket, minlength=HISTOGRAM_BUCKETS)
    out = torch.stack(sumsq), torch.stack(amax), torch.stack(counts)
    return (*out, torch.stack(hist)) if histogram else out


def _fake_multi_tensor_stats(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    check_inputs(tensors, check_storage=False)
    n, device = len(tensors), tensors[0].device
    return (
        torch.empty(n, dtype=torch.float64, device=device),
        torch.empty(n, dtype=torch.float64, device=device),
        torch.empty(n, 3, dtype=torch.int64, device=device),
    )


def _fake_histogram(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = _fake_multi_tensor_stats(tensors)
    return (*out, torch.empty(len(tensors), HISTOGRAM_BUCKETS, dtype=torch.int64, device=out[0].device))


# The schema is defined once, here. Compiled kernels (csrc/) register against it with TORCH_LIBRARY_IMPL for their
# backend keys; the pure-PyTorch kernel is registered as CompositeExplicitAutograd, which the dispatcher uses only
# for backends that have no kernel of their own.
_lib = torch.library.Library(OP_NAMESPACE, "DEF")
_lib.define(f"{OP_NAME}(Tensor[] tensors) -> (Tensor sumsq, Tensor amax, Tensor counts)")
_lib.define(
    f"{HISTOGRAM_OVERLOAD}(Tensor[] tensors) -> (Tensor sumsq, Tensor amax, Tensor counts, Tensor exponent_histogram)"
)
fallback.register(_lib)
fallback_histogram.register(_lib, HISTOGRAM_OVERLOAD)
# Statistics are not differentiable: autograd falls through, so outputs never require grad (and inputs need no
# per-tensor detach, which would cost more host time than the whole op for thousands of tensors).
for _name in (OP_NAME, HISTOGRAM_OVERLOAD):
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake(OP_QUALNAME, _fake_multi_tensor_stats, lib=_lib)
torch.library.register_fake(f"{OP_NAMESPACE}::{HISTOGRAM_OVERLOAD}", _fake_histogram, lib=_lib)


def _reject_nested(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel for the nested-tensor keys: the dispatcher's own error would say only "Could not run"."""
    check_inputs(tensors, check_storage=False)  # raises, naming the nested tensor
    raise ValueError(f"{OP_NAME}: nested tensors are not supported; pass their components instead (t.unbind())")


for _key in ("NestedTensorCPU", "NestedTensorCUDA"):
    for _name in (OP_NAME, HISTOGRAM_OVERLOAD):
        _lib.impl(_name, _reject_nested, _key)


def _vmap_rule(info: Any, in_dims: tuple[list[int | None]], tensors: list[Tensor]
               ) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[int, int, int]]:  # fmt: skip
    """``torch.vmap``: the stats of each batch element's tensors, from one op call over all their slices. A tensor
    that is not mapped over is read once per batch element (its stats repeat)."""
    (dims,) = in_dims
    b, n = info.batch_size, len(tensors)
    if b == 0:
        check_inputs(tensors, check_storage=False)
        device = tensors[0].device
        return (torch.empty(0, n, dtype=torch.float64, device=device),
                torch.empty(0, n, dtype=torch.float64, device=device),
                torch.empty(0, n, 3, dtype=torch.int64, device=device)), (0, 0, 0)  # fmt: skip
    flat = [t if d is None else t.select(d, i) for i in range(b) for t, d in zip(tensors, dims)]
    sumsq, amax, counts = _op(flat)
    return (sumsq.view(b, n), amax.view(b, n), counts.view(b, n, 3)), (0, 0, 0)


def _vmap_histogram_rule(info: Any, in_dims: tuple[list[int | None]], tensors: list[Tensor]
                         ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], tuple[int, int, int, int]]:  # fmt: skip
    """``torch.vmap`` of the histogram overload, as :func:`_vmap_rule`."""
    (dims,) = in_dims
    b, n = info.batch_size, len(tensors)
    if b == 0:
        check_inputs(tensors, check_storage=False)
        out = _fake_histogram(tensors)
        return tuple(o.new_empty(0, *o.shape) for o in out), (0, 0, 0, 0)  # type: ignore[return-value]
    flat = [t if d is None else t.select(d, i) for i in range(b) for t, d in zip(tensors, dims)]
    sumsq, amax, counts, hist = _histogram_op(flat)
    return (sumsq.view(b, n), amax.view(b, n), counts.view(b, n, 3), hist.view(b, n, HISTOGRAM_BUCKETS)), (0, 0, 0, 0)

# Load the compiled kernels only now, after the schema they register against exists.
from torch_gradstats.ops._extension import HAS_EXTENSION, native_function  # noqa: E402,F401

#: The compiled kernel for a list of plain CPU or CUDA tensors, called without the dispatcher, returning a
#: TensorStats (None: use torch.ops), when the compiled library has it: see csrc/python_module.cpp.
_direct_stats: Callable[[list[Tensor]], TensorStats | None] | None = None
if (_set_stats_type := native_function("set_stats_type")) is not None:
    _set_stats_type(TensorStats)
    _direct_stats = native_function("direct_stats")
#: The same for the histogram overload (a plain 4-tuple).
_direct_histogram_stats: Callable[[list[Tensor]], tuple[Tensor, Tensor, Tensor, Tensor] | None] | None = (
    native_function("direct_histogram_stats")
)
_op = torch.ops.torch_gradstats.multi_tensor_stats.default
_histogram_op = torch.ops.torch_gradstats.multi_tensor_stats.histogram
torch.library.register_vmap(OP_QUALNAME, _vmap_rule, lib=_lib)
torch.library.register_vmap(f"{OP_NAMESPACE}::{HISTOGRAM_OVERLOAD}", _vmap_histogram_rule, lib=_lib)


@overload
def multi_tensor_stats(tensors: Tensor | Iterable[Tensor], *, histogram: Literal[False] = False) -> TensorStats: ...
@overload
def multi_tensor_stats(tensors: Tensor | Iterable[Tensor], *, histogram: Literal[True]) -> HistogramStats: ...
@overload
def multi_tensor_stats(tensors: Tensor | Iterable[Tensor], *, histogram: bool) -> TensorStats | HistogramStats: ...


def multi_tensor_stats(tensors: Tensor | Iterable[Tensor], *, histogram: bool = False) -> TensorStats | HistogramStats:
    """Sum of squares, max |x| and zero/NaN/Inf counts of every tensor, in one pass over their memory.

    Args:
        tensors: one or more float16/bfloat16/float32/float64 tensors on one device; any shapes and strides,
            mixed dtypes allowed. They are never modified. A single tensor counts as a list of one (as in
            :func:`~torch_gradstats.grad_stats` and ``torch.nn.utils.clip_grad_norm_``): its rows are never
            iterated. (The raw op ``torch.ops.torch_gradstats.multi_tensor_stats`` takes a list only.)
        histogram: also count each tensor's finite non-zero elements by binary exponent, in the same read
            (the overload ``multi_tensor_stats.histogram``).

    Returns:
        :class:`TensorStats` of device tensors (no host sync): ``sumsq`` and ``amax`` float64 ``[N]``,
        ``counts`` int64 ``[N, 3]`` (zeros, NaNs, Infs). With ``histogram=True`` a :class:`HistogramStats`, whose
        ``exponent_histogram`` is int64 ``[N, 277]``: bucket ``b`` counts the elements with
        ``floor(log2 |x|) == b - 149`` (float64 values beyond float32's range in the first or last bucket).

    Other Python threads run while the compiled kernel does (CUDA calls, and CPU lists of at least 65,536 elements
    and 16,384 per tensor on average release the GIL), as they do during any torch op.

    Under ``torch.vmap`` each batch element gets its statistics, the batch dimension first (``sumsq`` ``[B, N]``).

    Raises:
        TypeError when ``tensors`` is neither a tensor nor a list, tuple or other ordered iterable of them (an int,
        None, a str, a dict, a set). ValueError / TypeError naming the offending tensor's index for an empty list,
        an item that is not a tensor, a non-float dtype, a sparse or nested tensor, tensors on different devices,
        or a tensor whose storage was freed. Under ``torch.compile`` the same message comes from the op's fake
        kernel, inside Dynamo's ``TorchRuntimeError``.
    """
    if type(tensors) is not list:  # a list is used as it is: neither path keeps or changes it
        if isinstance(tensors, Tensor):
            tensors = [tensors]
        else:
            check_tensor_list(tensors, iterables=True)
            tensors = list(tensors)
    if histogram is not False:
        check_bool("multi_tensor_stats: histogram", histogram)
        return _with_histogram(tensors)
    if is_dynamo_compiling():  # a constant to Dynamo; in eager a quarter of is_compiling()'s host time
        # No Python checks here: an exception raised while Dynamo traces this frame would surface as "Observed
        # exception" with the message hidden. The fake kernel runs the same checks and Dynamo quotes its error.
        # (Other tracers, non-strict export's included, run the eager path: their tensors take torch.ops there.)
        return TensorStats(*_op(tensors))
    # Eager: the kernels check their inputs themselves; the Python checks (a loop over every tensor) run only to
    # turn a failure into the same clear, named error on every backend. Plain CPU and CUDA tensors go to their
    # compiled kernel without the dispatcher (same kernel, same results); anything else through torch.ops.
    try:
        if _direct_stats is not None:
            stats = _direct_stats(tensors)
            if stats is not None:
                return stats
        return TensorStats(*_op(tensors))
    except (TypeError, ValueError, RuntimeError):
        check_inputs(tensors)
        raise


def _with_histogram(tensors: list[Tensor]) -> HistogramStats:
    """:func:`multi_tensor_stats` with ``histogram=True``: the same paths, for the overload."""
    if is_dynamo_compiling():
        return HistogramStats(*_histogram_op(tensors))
    try:
        if _direct_histogram_stats is not None:
            out = _direct_histogram_stats(tensors)
            if out is not None:
                return HistogramStats(*out)
        return HistogramStats(*_histogram_op(tensors))
    except (TypeError, ValueError, RuntimeError):
        check_inputs(tensors)
        raise
