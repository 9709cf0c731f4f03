"""Global per-parameter statistics from DeepSpeed ZeRO stage 1/2 gradient partitions: of a live engine, or by
partition arithmetic.

ZeRO stages 1 and 2 flatten the parameters of an optimizer parameter group, in order, into one buffer, pad its end
with zeros to a multiple of ``alignment * world_size`` (DeepSpeed aligns partition starts for NCCL), and give rank
``r`` the ``r``-th of ``world_size`` equal contiguous partitions, with the gradient partition laid out the same way.
A parameter can straddle two or more partitions; padding belongs to no parameter.

:func:`partition_pieces` computes which slice of which parameter each rank holds; :func:`partition_stats` reads a
rank's gradient partition in one fused op call (one view per piece, padding left out) and combines the ranks with
one SUM and one MAX all-reduce into the statistics of the whole parameters, the same on every rank.

DeepSpeed itself is not needed (nor imported) for those two: pass a rank's flat gradient partition of one parameter
group and the element counts of that group's parameters in flattening order (with ``round_robin_gradients``, that
order).

:func:`engine_grad_stats` reads a live ZeRO 1/2 engine instead: each parameter's piece of this rank's averaged
gradient partition, where DeepSpeed itself links it (``param._hp_mapping``, the link its ``safe_get_full_grad``
uses), read in one fused op call and combined the same way. It needs no DeepSpeed import either: it only reads
attributes of the engine it is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.ops._transfer import host_int64, to_device
from torch_gradstats.ops.op import NAN, TensorStats, multi_tensor_stats
from torch_gradstats.stats.gradients import GradStats

__all__ = ["Piece", "engine_grad_stats", "partition_pieces", "partition_stats"]


class Piece(NamedTuple):
    """A contiguous run of one parameter's elements inside one rank's partition."""

    param: int  #: index of the parameter in flattening order
    param_start: int  #: first element, within the flattened parameter
    partition_start: int  #: where it starts within the partition
    length: int  #: number of elements


def partition_pieces(numels: Sequence[int], world_size: int, alignment: int = 1) -> list[list[Piece]]:
    """For each rank, the pieces of parameters its partition holds, in order; the partition size is
    ``ceil(sum(numels) / (alignment * world_size)) * alignment``."""
    for name, v in (("world_size", world_size), ("alignment", alignment)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"partition_pieces: {name} must be an int, got a {type(v).__name__}")
        if v < 1:
            raise ValueError(f"partition_pieces: {name} must be at least 1, got {v}")
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"partition_pieces: numels[{i}] must be a non-negative int, got {n!r}")
    total = sum(numels)
    unit = alignment * world_size
    size = -(-total // unit) * unit // world_size
    out: list[list[Piece]] = [[] for _ in range(world_size)]
    offset = 0
    for i, n in enumerate(numels):
        first, last = offset, offset + n
        for rank in range(first // size if size else 0, world_size):
            lo, hi = rank * size, (rank + 1) * size
            if lo >= last:
                break
            start, end = max(first, lo), min(last, hi)
            if start < end:
                out[rank].append(Piece(i, start - first, start - lo, end - start))
        offset = last
    return out


def partition_stats(
    partition: Tensor, numels: Sequence[int], group: Any = None, alignment: int = 1
) -> TensorStats:
    """The statistics of each whole parameter's gradient, from this rank's ZeRO gradient partition.

    Args:
        partition: this rank's flat gradient partition (1-D, the size :func:`partition_pieces` gives).
        numels: element counts of the group's parameters, in flattening order.
        group: the data-parallel process group the partitions are split over (None: the default group when
            torch.distributed is initialized, else a single rank).
        alignment: DeepSpeed's partition alignment factor (its NCCL start alignment).

    Returns:
        ``TensorStats`` with one row per parameter (sum of squares, max |x|, zero/NaN/Inf counts), equal on every
        rank: one fused read, one SUM and one MAX all-reduce, no host sync.
    """
    if not isinstance(partition, Tensor):
        raise TypeError(f"partition_stats: partition must be a torch.Tensor, got a {type(partition).__name__}")
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    pieces = partition_pieces(numels, world, alignment)
    size = -(-sum(numels) // (alignment * world)) * alignment
    if partition.dim() != 1 or partition.numel() != size:
        raise ValueError(
            f"partition_stats: partition must be 1-D with {size} elements (rank {rank} of {world}, alignment "
            f"{alignment}), got shape {tuple(partition.shape)}"
        )
    n, device = len(numels), partition.device
    sumsq = torch.zeros(n, dtype=torch.float64, device=device)
    amax = torch.zeros(n, dtype=torch.float64, device=device)
    counts = torch.zeros(n, 3, dtype=torch.int64, device=device)
    mine = pieces[rank]
    if mine:  # each parameter is contiguous, so it has at most one piece per rank
        s, a, c = multi_tensor_stats([partition.narrow(0, p.partition_start, p.length) for p in mine])
        idx = host_int64([p.param for p in mine], device)
        sumsq.index_copy_(0, idx, s)
        amax.index_copy_(0, idx, a)
        counts.index_copy_(0, idx, c)
    if distributed and world > 1:
        return _combine(sumsq, amax, counts, group)
    return TensorStats(sumsq, amax, counts)


def _combine(sumsq: Tensor, amax: Tensor, counts: Tensor, group: Any) -> TensorStats:
    """Per-rank rows of the pieces each rank holds (zeros elsewhere) -> rows of the whole parameters, on every rank:
    one SUM and one MAX all-reduce. A MAX all-reduce need not keep a NaN (gloo's does not promise to): a row whose
    reduced NaN count is positive gets NaN for its sum of squares and max |g|, as the op's contract says."""
    n = sumsq.numel()
    packed = torch.cat([sumsq, counts.to(torch.float64).reshape(-1)])  # counts exact below 2**53
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    counts = packed[n:].reshape(n, 3).to(torch.int64)
    has_nan = counts[:, NAN] > 0
    return TensorStats(packed[:n].masked_fill(has_nan, math.nan), amax.masked_fill(has_nan, math.nan), counts)


def _zero_optimizer(engine: Any) -> Any:
    optimizer = getattr(engine, "optimizer", None)
    if not all(hasattr(optimizer, a) for a in ("bit16_groups", "averaged_gradients", "real_dp_process_group")):
        raise TypeError(
            "engine_grad_stats: engine must be a DeepSpeed engine with ZeRO stage 1 or 2 (its optimizer a "
            f"DeepSpeedZeroOptimizer), got a {type(engine).__name__} whose optimizer is a "
            f"{type(optimizer).__name__}"
        )
    if getattr(optimizer, "round_robin_gradients", False):
        # not checked against a round-robin flattening order: refused rather than risk wrong rows
        raise ValueError("engine_grad_stats: round_robin_gradients=True is not supported; leave it False")
    return optimizer


def engine_grad_stats(engine: Any) -> GradStats:
    """The statistics of every trainable parameter's whole gradient, from a DeepSpeed ZeRO stage 1 or 2 engine.

    Call it on every rank of the data-parallel group after ``engine.backward(loss)`` on the last micro-batch of a
    step (the gradient accumulation boundary) and before ``engine.step()``: that is while the engine holds its
    averaged gradient partitions; at any other time DeepSpeed raises its ``ValueError`` ("Gradients are only
    available immediately after backward and before engine step"). The gradients are the ones the optimizer steps
    with: averaged over the ranks and over the accumulated micro-batches, before clipping; under fp16 loss scaling
    the norms and max |g| are divided by the current loss scale (counts need no unscaling).

    Args:
        engine: the engine ``deepspeed.initialize`` returned, with ``zero_optimization.stage`` 1 or 2 (CPU offload
            included; ``round_robin_gradients`` left False).

    Returns:
        :class:`~torch_gradstats.GradStats`, one row per trainable parameter named as in
        ``engine.module.named_parameters()``, in that order, the same on every rank: one fused read of this rank's
        pieces, one SUM and one MAX all-reduce over the data-parallel group, no host sync.
    """
    optimizer = _zero_optimizer(engine)
    dp_groups = list(optimizer.real_dp_process_group)
    if any(g is not dp_groups[0] for g in dp_groups):
        raise ValueError(
            "engine_grad_stats: every parameter group must be partitioned over the same data-parallel group "
            "(expert-parallel MoE groups are not supported)"
        )
    trainable = {id(p) for group in optimizer.bit16_groups for p in group}
    named = [(name, p) for name, p in engine.module.named_parameters() if id(p) in trainable]
    if len(named) != len(trainable):
        raise ValueError("engine_grad_stats: the optimizer holds parameters that engine.module does not")
    unlinked = [name for name, p in named if not hasattr(p, "_hp_mapping")]
    if unlinked:
        raise ValueError(f"engine_grad_stats: DeepSpeed has not linked {unlinked} to the gradient partitions")
    home = named[0][1].device if named else torch.device("cpu")
    pieces: list[Tensor] = []
    rows: list[int] = []
    for row, (name, p) in enumerate(named):
        mapping = p._hp_mapping
        if mapping is None:  # no piece of it on this rank
            continue
        piece = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        address = mapping.lp_fragment_address
        if piece.numel() != address.numel:
            if piece.numel() != p.numel():
                raise RuntimeError(
                    f"engine_grad_stats: the gradient piece of {name} has {piece.numel()} elements, expected "
                    f"{address.numel}"
                )
            piece = piece.narrow(0, address.start, address.numel)  # a whole gradient: keep this rank's part
        pieces.append(piece)
        rows.append(row)
    n = len(named)
    sumsq = torch.zeros(n, dtype=torch.float64, device=home)
    amax = torch.zeros(n, dtype=torch.float64, device=home)
    counts = torch.zeros(n, 3, dtype=torch.int64, device=home)
    if pieces:  # a parameter has at most one piece per rank
        s, a, c = multi_tensor_stats(pieces)
        if s.device != home:  # CPU offload: the pieces are on the CPU. One copy, through pinned memory: no wait
            k = s.numel()
            packed = to_device(torch.cat([s, a, c.to(torch.float64).reshape(-1)]), home)  # counts exact < 2**53
            s, a, c = packed[:k], packed[k:2 * k], packed[2 * k:].reshape(k, 3).to(torch.int64)
        idx = host_int64(rows, home)
        sumsq.index_copy_(0, idx, s)
        amax.index_copy_(0, idx, a)
        counts.index_copy_(0, idx, c)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(dp_groups[0]) > 1:
        sumsq, amax, counts = _combine(sumsq, amax, counts, dp_groups[0])
    if getattr(optimizer, "dtype", None) == torch.float16:  # still multiplied by the loss scale until step()
        scale = optimizer.loss_scale
        sumsq, amax = sumsq / (scale * scale), amax / scale
    numel = host_int64([p.numel() for _, p in named], home)
    return GradStats([name for name, _ in named], sumsq, amax, counts, numel, device=home)
