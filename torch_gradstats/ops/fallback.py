"""The pure-PyTorch kernel of the op, registered for every backend without a compiled kernel.

The dispatcher runs :func:`fallback_multi_tensor_stats` (registered below as the op's CompositeExplicitAutograd
kernel) on any device that has no compiled kernel of its own: XPU, a CPU without the extension, and every device
under ``TORCH_GRADSTATS_FORCE_FALLBACK=1``. Not MPS: the op's statistics are float64 and MPS has no float64, so there
it raises a clear error (see :func:`require_float64`). It is bounded in memory, batches small tensors, and gives the
same bits whatever the thread count; the tests check it against the float64 reference in :mod:`torch_gradstats.ops.op`
like any other kernel.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from torch_gradstats.ops._checks import DTYPE_BITS, OP_NAME, checked_numels
from torch_gradstats.ops._fallback_batch import SUM_BLOCK, batch_stats, fixed_order_sum, row_sums
from torch_gradstats.ops._fallback_workspace import (  # the first and fourth stay public here too
    FALLBACK_CHUNK_ELEMS,
    Workspace,
    give_back,
    release_workspace,
    take_workspace,
)
from torch_gradstats.ops._pieces import distinct_elements, iter_pieces
from torch_gradstats.ops._transfer import host_int64

__all__ = ["FALLBACK_CHUNK_ELEMS", "fallback_multi_tensor_stats", "register", "release_workspace", "require_float64"]

#: Batches of at most this many rows are read row by row instead of being stacked first.
_FEW_ROWS = 8
#: The pieces of a tensor of at most this many chunks are rows among the others; a larger one is read alone, in runs
#: of pieces of at most this many chunks' elements, each run's rows reduced together and added to its figures.
_RUN_CHUNKS = 32


def _branches_on_host(device: torch.device) -> bool:
    """True where reading a value computed on ``device`` costs no sync (the CPU): batches may then skip passes
    whose result is known and square in float32 where that is safe. Elsewhere every batch takes the same ops."""
    return device.type == "cpu"


@torch.no_grad()
def fallback_multi_tensor_stats(
    tensors: Sequence[Tensor], chunk_elems: int = FALLBACK_CHUNK_ELEMS
) -> tuple[Tensor, Tensor, Tensor]:
    """Pure-PyTorch kernel of the op: what the dispatcher runs on any device without a compiled kernel.

    Tensors are cut into pieces of at most ``chunk_elems`` elements, pieces of one dtype and similar length are
    stacked as the rows of a ``[rows, L]`` batch (``L`` the next power of two of the length, zero-padded; at most
    ``chunk_elems`` elements per batch; up to 8 rows are read in place instead), and each batch is reduced
    by a few whole-batch torch ops on the bits of its |x|: so thousands of small tensors cost a few ops, not a few
    per tensor, and only one batch is ever upcast. A tensor of more than 32 chunks is read alone, its pieces made
    one at a time, in runs of 32 chunks.

    Repeated elements: a broadcast dimension (stride 0, size > 1, as ``expand`` makes) is read once and multiplies
    ``sumsq`` and the counts by its size (max |x| is unchanged), so ``torch.ones(1).expand(2**34)`` costs one
    element. A view whose other strides overlap (``as_strided``, ``unfold``) is read element by element, a piece
    at a time, like the reference reads it; its time grows with its number of elements, its memory does not.

    Memory: besides its outputs and bookkeeping of a few dozen bytes per tensor and per piece, the extra memory is
    at most ``56 * chunk_elems`` bytes (14 MiB at the default 2**18), whatever the tensors' sizes and strides:
    four reused buffers of ``8 * chunk_elems`` bytes each (the stacked rows, their bits, an integer temporary, the
    squares), and while a batch of small tensors is stacked, one more copy of it and its int64 padding index. No
    tensor is ever copied whole (a non-dense one is copied one piece at a time). The process's memory (RSS) is
    bounded as well: the outputs and bookkeeping are made before the first batch and every batch frees all it
    makes before the next, since a block kept from the middle of the call would split the C allocator's free
    space and the process would keep all of it. On the CPU a call with
    the default chunk uses the calling thread's kept workspace (8 MiB; torch's CPU allocator does not cache, and
    faulting fresh pages in costs more than the arithmetic); :func:`release_workspace` frees it.

    Threads and reentrancy: no module state is shared between calls. Threads each use their own workspace; a call
    made while another runs on the same thread (a gc callback, a signal handler, a ``__del__``) uses a workspace
    of its own (see :func:`~torch_gradstats.ops._fallback_workspace.take_workspace`), so both get their own results.

    Paths: max |x| and the zero/NaN/Inf counts are exact everywhere (read from the bits). Off the CPU every batch
    runs the same ops and nothing is read back (no sync): all counts are taken, and squares are computed in
    float64 (exact for 16/32-bit values) and summed in float64. On the CPU, where reading a value costs no sync,
    16/32-bit rows that fill their padded length (the pieces of a large tensor but its last, and any tensor of
    2**k elements) are read squares first (:func:`_squares_first`: one write of their float32 squares, then their
    largest, smallest and block sums); a row whose squares are all normal and below 2**112 (no zero, no NaN,
    no Inf) is settled from those, with max |x| the square root of its largest square (exact, see
    :func:`_squares_first`), and every other row is read again by the bits path. The bits path reads each
    batch's smallest and largest |x| and skips what they settle: the zero count when no |x| is 0, the NaN/Inf
    counts when no |x| reaches +inf. There a 16/32-bit row whose nonzero |x| all lie in
    [2**-63, 2**56) (float16: every row of normal numbers) is squared in float32 (each square rounded once, a
    normal number: no overflow, no underflow) and summed in float32 by blocks of 4,096 (torch's cascade sum), the
    block sums in float64: each rounding is at most 6e-8 relative and torch's cascade sum keeps their number
    along any path to a few dozen (measured: up to 4e-7, on 4,096 equal values), inside the op's 1e-5; sums of
    small integers, such as counts of ones, stay exact. Every other row (a value outside that range, a subnormal,
    NaN or Inf, and all float64) takes the float64 squares; the choice is made per row from its own bits, so a
    tensor's result does not depend on the tensors batched with it.

    Determinism: every float sum has an order fixed by the shapes and strides alone (see :func:`row_sums`;
    a tensor's pieces are added in their order), and float32
    squares are taken only where they are normal numbers, so the bits of the results do not depend on the
    thread count or on torch.set_flush_denormal, with one exception: on a thread that flushes denormals, float32
    and bfloat16 subnormals (|x| < 1.2e-38) are read as zero by the float64 conversion, so their squares (below
    1.4e-76) may be missing from ``sumsq`` and ``amax`` of a tensor holding only such values may be 0.
    """
    numels = checked_numels(tensors)
    require_float64(tensors[0].device)
    if any(t.is_neg() for t in tensors):  # a negative view has no bits to read: its sign flipped back, no copy
        tensors = [torch._neg_view(t) if t.is_neg() else t for t in tensors]
    if chunk_elems < 1 or chunk_elems & (chunk_elems - 1):
        raise ValueError(f"{OP_NAME}: chunk_elems must be a power of two, got {chunk_elems}")
    ws = take_workspace(tensors[0].device, chunk_elems)
    try:
        return _stats(tensors, numels, chunk_elems, ws)
    finally:
        give_back(ws)


def _stats(
    tensors: Sequence[Tensor], numels: list[int], chunk_elems: int, ws: Workspace
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fallback_multi_tensor_stats` of checked inputs, in the workspace ``ws``."""
    n, device = len(tensors), ws.device
    # What outlives the call first (the workspace, then the outputs), then only memory that each batch frees again:
    # a block kept from the middle of the call would split the C allocator's free space below it, and the process
    # would keep all of it (RSS; torch's own figures do not show it).
    sumsq = torch.zeros(n, dtype=torch.float64, device=device)
    amax = torch.zeros(n, dtype=torch.float64, device=device)
    counts = torch.zeros(n, 3, dtype=torch.int64, device=device)
    # Rows grouped by (dtype, padded length, whether they fill it): tensors of at most a chunk, and the pieces of
    # tensors of at most _RUN_CHUNKS chunks. Larger ones are read alone, run by run (see _large_tensor_stats).
    groups: dict[tuple[torch.dtype, int, bool], tuple[array[int], list[Tensor]]] = {}  # (owners, rows)
    split: dict[int, list[tuple[tuple[torch.dtype, int, bool], int]]] = {}  # tensor -> (group, row) of its pieces
    large: list[tuple[int, Tensor]] = []
    repeats: dict[int, int] = {}  # tensor index -> how many times each element of its distinct view appears
    for i, (t, numel) in enumerate(zip(tensors, numels)):
        if numel == 0:
            continue
        if not t.is_contiguous():
            t, copies = distinct_elements(t)
            if copies > 1:
                repeats[i] = copies
                numel //= copies
        if numel <= chunk_elems:
            owners, rows = groups.setdefault(_row_key(t.dtype, numel), (array("q"), []))
            owners.append(i)
            rows.append(t)
        elif numel <= _RUN_CHUNKS * chunk_elems:
            places = split[i] = []
            for piece in iter_pieces(t, chunk_elems):
                key = _row_key(t.dtype, piece.numel())
                owners, rows = groups.setdefault(key, (array("q"), []))
                places.append((key, len(rows)))
                owners.append(i)
                rows.append(piece)
        else:
            large.append((i, t))

    if groups:
        # Every row's figures, group after group, then each tensor's from its rows.
        n_rows = sum(len(rows) for _, rows in groups.values())
        row_sumsq = torch.empty(n_rows, dtype=torch.float64, device=device)
        row_amax = torch.empty(n_rows, dtype=torch.float64, device=device)
        row_counts = torch.empty(n_rows, 3, dtype=torch.int64, device=device)
        offsets: dict[tuple[torch.dtype, int, bool], int] = {}
        owners_all: array[int] = array("q")  # raw integers: no Python object per row
        for key, (owners, rows) in groups.items():
            offset = offsets[key] = len(owners_all)
            end = offset + len(rows)
            _reduce_rows(
                rows, key, chunk_elems, ws, (row_sumsq[offset:end], row_amax[offset:end], row_counts[offset:end])
            )
            owners_all += owners
        split_rows = {i: [offsets[key] + j for key, j in places] for i, places in split.items()}
        _combine_rows(owners_all, split_rows, (row_sumsq, row_amax, row_counts), (sumsq, amax, counts))
    for i, t in large:
        sumsq[i], amax[i], counts[i] = _large_tensor_stats(t, chunk_elems, ws)

    if repeats:  # a broadcast dimension repeats every element: sums and counts scale, the max does not
        idx = host_int64(list(repeats), device)
        times = host_int64(list(repeats.values()), device)
        sumsq.index_copy_(0, idx, sumsq.index_select(0, idx) * times.to(torch.float64))
        counts.index_copy_(0, idx, counts.index_select(0, idx) * times.unsqueeze(1))
    nan = counts[:, 1] > 0
    sumsq.masked_fill_(nan, math.nan)  # in place: nothing made after the rest is freed
    amax.masked_fill_(nan, math.nan)
    return sumsq, amax, counts


def _row_key(dtype: torch.dtype, numel: int) -> tuple[torch.dtype, int, bool]:
    """The batch a row of ``numel`` elements goes to: its dtype, its padded length (the next power of two) and
    whether it fills it."""
    padded = 1 << (numel - 1).bit_length()
    return dtype, padded, numel == padded


def _reduce_rows(
    rows: list[Tensor],
    key: tuple[torch.dtype, int, bool],
    chunk: int,
    ws: Workspace,
    out: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Statistics of rows of one key, batch by batch, written into ``out`` (sumsq, amax, counts; one entry per row):
    a batch leaves no memory behind it (see :func:`_stats`)."""
    (dtype, length, full), (sumsq, amax, counts) = key, out
    n_rows, device = len(rows), ws.device
    per_batch = max(1, chunk // length)
    on_host = _branches_on_host(device)
    if not (full and dtype != torch.float64 and on_host):
        for start in range(0, n_rows, per_batch):
            stop = min(start + per_batch, n_rows)
            bits, pad = _abs_bits(rows[start:stop], length, ws)
            for o, part in zip(out, batch_stats(bits, dtype, pad, ws, on_host=on_host)):
                o[start:stop] = part
        return

    # Squares first. A row whose squares are all in [_SQUARE_LOW, _SQUARE_HIGH) has no zero, NaN or Inf and its
    # float32 sums are safe (the float32 path of batch_stats, bit for bit); every other row (one host read says
    # which) is read again by the bits path, which counts exactly.
    highest = torch.empty(n_rows, dtype=torch.float32, device=device)
    lowest = torch.empty(n_rows, dtype=torch.float32, device=device)
    per_read = max(1, 2 * chunk // length)  # float32 squares: twice the rows in the bytes of float64 squares
    for start in range(0, n_rows, per_read):
        stop = min(start + per_read, n_rows)
        _squares_first(rows[start:stop], length, ws, (highest[start:stop], lowest[start:stop], sumsq[start:stop]))
    amax.copy_(highest).sqrt_()
    amax.copy_(amax.to(torch.float32))  # the square root, rounded once to float32
    counts.zero_()
    settled = (lowest >= _SQUARE_LOW) & (highest < _SQUARE_HIGH)
    redo = (~settled).nonzero().flatten().tolist()  # on the CPU: no sync
    for start in range(0, len(redo), per_batch):
        picked = redo[start : start + per_batch]
        bits, pad = _abs_bits([rows[j] for j in picked], length, ws)
        idx = host_int64(picked, device)
        for o, part in zip(out, batch_stats(bits, dtype, pad, ws, on_host=on_host)):
            o.index_copy_(0, idx, part)


def _large_tensor_stats(t: Tensor, chunk: int, ws: Workspace) -> tuple[Tensor, Tensor, Tensor]:
    """Statistics of one tensor larger than a chunk, from its pieces (:func:`iter_pieces`) in order: consecutive
    pieces of one key make a batch, and each batch's figures are added to the running ones, so the order of
    every sum is fixed by the tensor's shape and strides alone."""
    device = t.device
    total_sumsq = torch.zeros((), dtype=torch.float64, device=device)
    total_amax = torch.zeros((), dtype=torch.float64, device=device)
    total_counts = torch.zeros(3, dtype=torch.int64, device=device)

    def add(rows: list[Tensor], key: tuple[torch.dtype, int, bool]) -> None:
        s = torch.empty(len(rows), dtype=torch.float64, device=device)
        a = torch.empty(len(rows), dtype=torch.float64, device=device)
        c = torch.empty(len(rows), 3, dtype=torch.int64, device=device)
        _reduce_rows(rows, key, chunk, ws, (s, a, c))
        total_sumsq.add_(fixed_order_sum(s))
        torch.maximum(total_amax, a.amax(), out=total_amax)  # NaN wins; the counts say so anyway
        total_counts.add_(c.sum(dim=0))

    pending: list[Tensor] = []
    key = None
    for piece in iter_pieces(t, chunk):
        piece_key = _row_key(t.dtype, piece.numel())
        if pending and (piece_key != key or len(pending) * piece_key[1] >= _RUN_CHUNKS * chunk):
            add(pending, key)  # type: ignore[arg-type]  # key is set once pending is not empty
            pending = []
        key = piece_key
        pending.append(piece)
    if pending:
        add(pending, key)  # type: ignore[arg-type]
    return total_sumsq, total_amax, total_counts


def require_float64(device: torch.device) -> None:
    """Raise if ``device`` cannot hold the op's float64 outputs (MPS has no float64 at all), saying what to do."""
    if device.type == "mps":
        raise NotImplementedError(
            f"{OP_NAME}: the statistics are float64 (sumsq, amax) and MPS has no float64; compute them from CPU "
            "copies, e.g. torch_gradstats.multi_tensor_stats([g.cpu() for g in grads])"
        )


#: Float32 squares from which the CPU's squares-first path settles a row: every square a normal number (so no
#: zero, no subnormal, no flushed value) and below 2**112 (so a float32 sum of SUM_BLOCK of them stays finite).
#: NaN fails both comparisons.
_SQUARE_LOW, _SQUARE_HIGH = 2.0**-126, 2.0**112


def _squares_first(rows: list[Tensor], length: int, ws: Workspace, out: tuple[Tensor, Tensor, Tensor]) -> None:
    """Float32 squares of a batch of full 16/32-bit rows (written once, into the workspace) and, per row, their
    largest and smallest value and the float64 sum of their float32 sums by blocks of SUM_BLOCK, into ``out``:
    three reads of a buffer still in cache instead of the bits path's mask, max, min and squares (the CPU path for
    rows without zeros, NaN or Inf).

    Squares of 16-bit values are exact in float32; those of float32 values are rounded once, and in binary
    floating point the rounded square is strictly increasing in |x| and its correctly rounded square root is |x|
    (checked for every float32 significand by the tests), so the largest square gives max |x| exactly."""
    r = len(rows)
    squares = ws.get("squares", torch.float32, (r, length))
    if r <= 2 * _FEW_ROWS:  # each row written into its slot: no stacked copy
        float32 = rows[0].dtype == torch.float32
        for row, x in zip(ws.rows("squares", torch.float32, (r, length)), rows):
            row = row if x.dim() == 1 else row.view(x.shape)
            if float32:
                torch.mul(x, x, out=row)
            else:
                row.copy_(x)  # 16-bit values widened exactly
        if not float32:
            squares.mul_(squares)
    else:
        torch.cat([x.reshape(-1) for x in rows], out=squares.view(-1))  # 16-bit rows widened exactly
        squares.mul_(squares)
    highest, lowest, sumsq = out
    torch.amax(squares, dim=1, out=highest)
    torch.amin(squares, dim=1, out=lowest)
    block = min(length, SUM_BLOCK)
    block_sums = ws.get("squares", torch.float32, (r * (length // block), block)).sum(dim=1)
    sumsq.copy_(row_sums(block_sums.view(r, length // block).to(torch.float64)))


def _abs_bits(rows: list[Tensor], length: int, ws: Workspace) -> tuple[Tensor, Tensor | None]:
    """The bits of the rows' |x| as one ``[len(rows), length]`` tensor (zero-padded), and each row's number of
    padding zeros. A few rows are masked straight from their own memory (no stacked copy)."""
    int_dtype, abs_mask, _ = DTYPE_BITS[rows[0].dtype]
    r = len(rows)
    bits = ws.get("bits", int_dtype, (r, length))
    if r <= _FEW_ROWS:  # each row masked into its slot, its padding zeroed: no stacked copy, no scatter index
        numels = [x.numel() for x in rows]
        for row, x, k in zip(ws.rows("bits", int_dtype, (r, length)), rows, numels):
            torch.bitwise_and(x.view(int_dtype), abs_mask, out=row[:k].view(x.shape))
            if k < length:
                row[k:].zero_()
        if all(k == length for k in numels):
            return bits, None
        return bits, host_int64([length - k for k in numels], bits.device)
    m, pad = _stack_rows(rows, length, ws)
    return torch.bitwise_and(m.view(int_dtype), abs_mask, out=bits), pad


def _stack_rows(rows: list[Tensor], length: int, ws: Workspace) -> tuple[Tensor, Tensor | None]:
    """The rows as one ``[len(rows), length]`` tensor (zero-padded) and each row's number of padding zeros."""
    r, device = len(rows), ws.device  # more than _FEW_ROWS rows: fewer are read in place by _abs_bits
    lengths = [x.numel() for x in rows]
    m = ws.get("rows", rows[0].dtype, (r, length))
    if all(k == length for k in lengths) and r <= 64:  # a few full rows: copied straight into place
        torch.cat([x.reshape(-1) for x in rows], out=m.view(-1))
        return m, None
    flat = torch._utils._flatten_dense_tensors(rows)  # one copy, made in C++ (no per-tensor Python op)
    if all(k == length for k in lengths):
        return flat.view(r, length), None
    # Where each element goes: row j's k-th element to j * length + k. Built on the device from the lengths
    # (output_size given, so repeat_interleave needs no sync).
    total = flat.numel()
    lens = host_int64(lengths, device)
    shift = torch.arange(r, dtype=torch.int64, device=device) * length - (torch.cumsum(lens, 0) - lens)
    dest = torch.arange(total, dtype=torch.int64, device=device)
    dest += torch.repeat_interleave(shift, lens, output_size=total)
    m.zero_().view(-1).index_copy_(0, dest, flat)  # distinct indices: no accumulation, deterministic
    return m, length - lens


def _combine_rows(
    owners: array[int],
    split_rows: dict[int, list[int]],
    rows: tuple[Tensor, Tensor, Tensor],
    out: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Write each tensor's statistics into ``out`` from those of its rows (``owners[j]``: the tensor of row j): one
    row per tensor, except for the tensors in ``split_rows``, whose rows (listed in piece order) are combined."""
    device = out[0].device
    if not split_rows:  # every row is a tensor's
        dst = host_int64(owners, device)
        for o, r in zip(out, rows):
            o.index_copy_(0, dst, r)  # distinct indices: deterministic
    else:
        single = array("q", (j for j, i in enumerate(owners) if i not in split_rows))
        if single:
            src = host_int64(single, device)
            dst = host_int64(array("q", (owners[j] for j in single)), device)
            for o, r in zip(out, rows):
                o.index_copy_(0, dst, r.index_select(0, src))
    for i, row_list in split_rows.items():
        idx = host_int64(row_list, device)
        out[0][i] = fixed_order_sum(rows[0].index_select(0, idx))
        out[1][i] = rows[1].index_select(0, idx).max()
        out[2][i] = rows[2].index_select(0, idx).sum(dim=0)


def register(lib: torch.library.Library) -> None:
    """Register the fallback as the op's CompositeExplicitAutograd kernel in ``lib`` (the op's schema library):
    the dispatcher uses it only for backends that have no kernel of their own."""
    lib.impl(OP_NAME, fallback_multi_tensor_stats, "CompositeExplicitAutograd")
