"""The pure-PyTorch kernel of the op's histogram overload: the fallback's statistics and the exponent histogram.

``multi_tensor_stats.histogram`` adds ``exponent_histogram``, int64 ``[N, 277]``: bucket ``b`` of row ``i`` counts
the finite non-zero elements of tensor ``i`` with ``floor(log2 |x|) == b - 149`` (float64 values below ``2**-149``
in bucket 0, at or above ``2**128`` in bucket 276). The compiled kernels count the exponents in the same read as
the other statistics; this fallback, like the rest of :mod:`torch_gradstats.ops.fallback` a few whole-batch torch ops
per batch, reads the tensors once more for it, in batches of at most ``chunk_elems`` elements (its extra memory:
about 24 bytes per batch element), with no host read of device data.

Each element's bucket comes from the bits of its |x|: a normal value with exponent field ``E`` has
``floor(log2 |x|) = E - bias``; a subnormal one with mantissa ``m``, ``1 - bias - mantissa_bits + floor(log2 m)``,
where ``floor(log2 m)`` is read off the exponent of ``m`` converted to float32 (exact: ``m < 2**23``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torch_gradstats.ops._checks import DTYPE_BITS, checked_numels
from torch_gradstats.ops._pieces import distinct_elements, iter_pieces
from torch_gradstats.ops.fallback import FALLBACK_CHUNK_ELEMS, fallback_multi_tensor_stats, require_float64

__all__ = ["HISTOGRAM_BUCKETS", "HISTOGRAM_MIN_EXPONENT", "fallback_multi_tensor_stats_histogram"]

#: floor(log2 |x|) of the first bucket, and the number of buckets (float32's range, subnormals included).
HISTOGRAM_MIN_EXPONENT = -149
HISTOGRAM_BUCKETS = 277

# Per dtype: the exponent field's shift, its all-ones value (NaN and Inf), the bias and the mantissa's bits.
_FIELDS = {
    torch.float16: (10, 0x1F, 15, 10),
    torch.bfloat16: (7, 0xFF, 127, 7),
    torch.float32: (23, 0xFF, 127, 23),
    torch.float64: (52, 0x7FF, 1023, 52),
}
_DUMP = HISTOGRAM_BUCKETS  # the column that zeros, NaNs and Infs go to, dropped at the end


def _buckets(x: Tensor) -> Tensor:
    """The histogram column (int64) of every element of ``x`` (any float dtype, flat): its bucket, or ``_DUMP`` for
    zeros, NaNs and Infs."""
    int_dtype, abs_mask, _ = DTYPE_BITS[x.dtype]
    shift, all_ones, bias, mantissa_bits = _FIELDS[x.dtype]
    bits = x.view(int_dtype).bitwise_and(abs_mask).to(torch.int64)
    field = bits >> shift
    bucket = field - (bias + HISTOGRAM_MIN_EXPONENT)  # normal values
    subnormal = field == 0
    # floor(log2 m) of a subnormal's mantissa m (< 2**52; only float16/bfloat16/float32's land in a bucket above 0,
    # and those are exact in float32), from float32's exponent field
    m_log2 = (bits.to(torch.float32).view(torch.int32).to(torch.int64) >> 23) - 127
    sub_bucket = (1 - bias - mantissa_bits - HISTOGRAM_MIN_EXPONENT) + m_log2
    bucket = torch.where(subnormal, sub_bucket, bucket).clamp_(0, HISTOGRAM_BUCKETS - 1)
    return bucket.masked_fill_((bits == 0) | (field == all_ones), _DUMP)


def exponent_histogram(
    tensors: Sequence[Tensor], numels: Sequence[int], chunk_elems: int = FALLBACK_CHUNK_ELEMS
) -> Tensor:
    """``exponent_histogram`` of checked inputs: pieces of at most ``chunk_elems`` elements (each tensor's distinct
    elements, a broadcast dimension read once) are read in batches of about ``chunk_elems`` elements."""
    n, device = len(tensors), tensors[0].device
    hist = torch.zeros(n * (HISTOGRAM_BUCKETS + 1), dtype=torch.int64, device=device)
    batch: list[Tensor] = []
    owners: list[int] = []
    batch_elems = 0

    def flush() -> None:
        nonlocal batch_elems
        flat = torch.cat([p.reshape(-1) for p in batch]) if len(batch) > 1 else batch[0].reshape(-1)  # one dtype
        lengths = torch.tensor([p.numel() for p in batch], dtype=torch.int64, device=device)
        rows = torch.tensor(owners, dtype=torch.int64, device=device)
        base = torch.repeat_interleave(rows * (HISTOGRAM_BUCKETS + 1), lengths, output_size=flat.numel())
        index = _buckets(flat).add_(base)
        hist.index_add_(0, index, torch.ones(1, dtype=torch.int64, device=device).expand(index.numel()))
        batch.clear()
        owners.clear()
        batch_elems = 0

    repeats: dict[int, int] = {}
    for i, (t, numel) in enumerate(zip(tensors, numels)):
        if numel == 0:
            continue
        t, copies = distinct_elements(t.detach())
        if copies > 1:
            repeats[i] = copies
        for piece in iter_pieces(t, chunk_elems):
            if batch and (piece.dtype != batch[0].dtype or batch_elems + piece.numel() > chunk_elems):
                flush()
            batch.append(piece)
            owners.append(i)
            batch_elems += piece.numel()
    if batch:
        flush()
    out = hist.view(n, HISTOGRAM_BUCKETS + 1)[:, :HISTOGRAM_BUCKETS].contiguous()
    for i, copies in repeats.items():
        out[i] *= copies
    return out


@torch.no_grad()
def fallback_multi_tensor_stats_histogram(
    tensors: Sequence[Tensor], chunk_elems: int = FALLBACK_CHUNK_ELEMS
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pure-PyTorch kernel of ``multi_tensor_stats.histogram``: :func:`~torch_gradstats.ops.fallback.
    fallback_multi_tensor_stats`'s three outputs and the exponent histogram (see the module's docstring)."""
    numels = checked_numels(tensors)
    require_float64(tensors[0].device)
    if any(t.is_neg() for t in tensors):
        # A negative view (torch._neg_view, conj of a real tensor) has no bits to read: flip its sign bit back, no
        # copy. Every statistic is symmetric in the sign. (Through the dispatcher such views arrive resolved.)
        tensors = [torch._neg_view(t) if t.is_neg() else t for t in tensors]
    sumsq, amax, counts = fallback_multi_tensor_stats(tensors, chunk_elems)
    return sumsq, amax, counts, exponent_histogram(tensors, numels, chunk_elems)


def register(lib: torch.library.Library, name: str) -> None:
    """Register the fallback as the histogram overload's CompositeExplicitAutograd kernel in ``lib``."""
    lib.impl(name, fallback_multi_tensor_stats_histogram, "CompositeExplicitAutograd")
