"""The statistics of one batch of rows for the pure-PyTorch kernel (:mod:`torch_gradstats.ops.fallback`): sums of
squares, max |x| and zero/NaN/Inf counts of equal-length rows given as the bits of their |x|, with float32 squares
where they are exact enough, and sums in an order fixed by the shapes alone.

Split from fallback.py, which decides which rows go together, in what batches and how their figures combine: this
is the arithmetic of one batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_gradstats.ops._checks import DTYPE_BITS
from torch_gradstats.ops._fallback_workspace import Workspace

__all__ = ["SUM_BLOCK", "batch_stats", "fixed_order_sum", "row_sums"]

#: Row sums longer than this are cut into blocks first (see :func:`row_sums`).
SUM_BLOCK = 1 << 12

def row_sums(x: Tensor) -> Tensor:
    """Sums of the rows of a contiguous float64 ``[r, L]`` tensor, in an order fixed by its shape alone.

    torch's CPU reductions split work between threads only across outputs when there are several, and run
    serially below 32,768 elements: so each sum here either has several outputs or fewer elements than that, and
    each output's order of addition does not depend on the thread count.
    """
    r, length = x.shape
    if length > SUM_BLOCK:
        x = x.reshape(r * (length // SUM_BLOCK), SUM_BLOCK).sum(dim=1).reshape(r, length // SUM_BLOCK)
    return x.sum(dim=1)


def fixed_order_sum(v: Tensor) -> Tensor:
    """Sum of a 1-d float64 tensor in an order fixed by its length (zero padding adds nothing)."""
    if v.numel() > SUM_BLOCK:
        v = torch.cat([v, v.new_zeros(-v.numel() % SUM_BLOCK)])
    return row_sums(v.view(1, -1))[0]


def _count_at_least(bits: Tensor, threshold: int, tmp: Tensor) -> Tensor:
    """Per row, how many of the non-negative ``bits`` are >= ``threshold`` (clamped to 0/1 and summed in int32,
    which torch vectorizes, unlike comparisons to bool and int64 sums)."""
    return torch.sub(bits, threshold - 1, out=tmp).clamp_(0, 1).sum(dim=1, dtype=torch.int32)


#: Per 16/32-bit dtype, bits of |x| between which float32 squares are normal numbers and a float32 sum of
#: SUM_BLOCK of them cannot overflow: [2**-63, 2**56) (squares in [2**-126, 2**112)); for float16 every normal value.
_FLOAT32_SAFE_BITS = {
    torch.float32: (0x2000_0000, 0x5B80_0000),
    torch.bfloat16: (0x2000, 0x5B80),
    torch.float16: (0x0400, 0x7C00),
}


def _exact_sumsq(absx: Tensor, ws: Workspace) -> Tensor:
    """Row sums of squares computed in float64: squares of 16/32-bit values are exact there."""
    squares = ws.get("squares", torch.float64, (absx.shape[0], absx.shape[1]))
    if absx.dtype == torch.float64:
        torch.mul(absx, absx, out=squares)
    else:
        squares.copy_(absx)  # exact
        squares.mul_(squares)
    return row_sums(squares)


def _float32_sumsq(absx: Tensor, ws: Workspace, overwrite: bool = False) -> Tensor:
    """Row sums of squares of a 16/32-bit batch whose nonzero |x| all lie in the range of _FLOAT32_SAFE_BITS:
    squares in float32 (each rounded once, never subnormal), summed in float32 by blocks of at most SUM_BLOCK
    (torch's cascade sum), the block sums added in float64. ``overwrite``: ``absx`` (a workspace buffer, never
    an input) is not needed afterwards, so float32 squares may replace it (one buffer less to pass through)."""
    r, length = absx.shape
    if absx.dtype == torch.float32 and overwrite:
        squares = absx.mul_(absx)
    elif absx.dtype == torch.float32:
        squares = torch.mul(absx, absx, out=ws.get("squares", torch.float32, (r, length)))
    else:
        squares = ws.get("squares", torch.float32, (r, length)).copy_(absx)  # exact
        squares.mul_(squares)
    block = min(length, SUM_BLOCK)
    block_sums = squares.view(r * (length // block), block).sum(dim=1)
    return row_sums(block_sums.to(torch.float64).view(r, length // block))


def _counts(
    bits: Tensor, pad: Tensor | None, inf_bits: int, tmp: Tensor, nonfinite: bool = True
) -> tuple[Tensor, Tensor]:
    """Per row: the [zeros, NaN, Inf] counts (int64) and the number of nonzero elements (int32, padding
    included). ``nonfinite=False`` when no |x| reaches +inf's bits: both of those counts are then 0."""
    nonzero = torch.clamp(bits, max=1, out=tmp).sum(dim=1, dtype=torch.int32)
    zeros = bits.shape[1] - nonzero if pad is None else bits.shape[1] - nonzero - pad
    if nonfinite:
        nonfinite_count = _count_at_least(bits, inf_bits, tmp)
        nans = _count_at_least(bits, inf_bits + 1, tmp)
        infs = nonfinite_count - nans
    else:
        nans = infs = torch.zeros_like(nonzero)
    return torch.stack([zeros.to(torch.int64), nans.to(torch.int64), infs.to(torch.int64)], dim=1), nonzero


def batch_stats(
    bits: Tensor, dtype: torch.dtype, pad: Tensor | None, ws: Workspace, *, on_host: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Statistics of each row of a batch given as the bits of its |x| ([r, L], of ``dtype``); ``pad[j]`` zero
    elements of row j are padding. ``on_host``: reading a value computed on the batch's device costs no sync (the
    CPU), so the batch may skip passes whose result is known and square in float32 where that is safe; else every
    batch takes the same ops and nothing is read back."""
    _, _, inf_bits = DTYPE_BITS[dtype]
    r = bits.shape[0]
    absx = bits.view(dtype)  # squares of |x| are those of x, bit for bit
    tmp_shape = (r, bits.shape[1])  # an integer temporary, taken only where a count needs it
    max_bits = bits.amax(dim=1)  # bits of non-negative floats are ordered like the floats, NaN above +inf
    amax = max_bits.view(dtype).to(torch.float64)  # the max of exact values: no order to fix
    if not on_host:  # the same ops for every batch: nothing is read back
        return _exact_sumsq(absx, ws), amax, _counts(bits, pad, inf_bits, ws.get("tmp", bits.dtype, tmp_shape))[0]

    min_bits = bits.amin(dim=1)
    lowest, highest = torch.stack([min_bits.min(), max_bits.max()]).tolist()  # on the CPU: no sync
    nonzero = None
    if lowest > 0 and highest < inf_bits:  # no zero (so no padding either), no NaN, no Inf
        counts = torch.zeros(r, 3, dtype=torch.int64, device=bits.device)
    else:
        tmp = ws.get("tmp", bits.dtype, tmp_shape)
        counts, nonzero = _counts(bits, pad, inf_bits, tmp, nonfinite=highest >= inf_bits)
    if dtype == torch.float64:
        return _exact_sumsq(absx, ws), amax, counts
    low, high = _FLOAT32_SAFE_BITS[dtype]
    if lowest >= low and highest < high:  # every row in range; the bits have given all they hold
        return _float32_sumsq(absx, ws, overwrite=True), amax, counts
    # Rows decided one by one: a row is in range if its max is below ``high`` and its nonzero |x| reach ``low``.
    in_range = max_bits < high
    if nonzero is None:
        in_range &= min_bits >= low
    else:  # a zero hides the smallest nonzero |x|: count those >= low instead (Inf/NaN rows are out already)
        in_range &= _count_at_least(bits, low, ws.get("tmp", bits.dtype, tmp_shape)) == nonzero
    n_in_range = in_range.sum().tolist()  # on the CPU: no sync
    if n_in_range == 0:
        return _exact_sumsq(absx, ws), amax, counts
    fast = _float32_sumsq(absx, ws)
    if n_in_range == r:
        return fast, amax, counts
    return torch.where(in_range, fast, _exact_sumsq(absx, ws)), amax, counts  # each row's result its own
