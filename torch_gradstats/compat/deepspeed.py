"""Global per-parameter statistics from DeepSpeed ZeRO stage 1/2 gradient partitions, by partition arithmetic.

ZeRO stages 1 and 2 flatten the parameters of an optimizer parameter group, in order, into one buffer, pad its end
with zeros to a multiple of ``alignment * world_size`` (DeepSpeed aligns partition starts for NCCL), and give rank
``r`` the ``r``-th of ``world_size`` equal contiguous partitions, with the gradient partition laid out the same way.
A parameter can straddle two or more partitions; padding belongs to no parameter.

:func:`partition_pieces` computes which slice of which parameter each rank holds; :func:`partition_stats` reads a
rank's gradient partition in one fused op call (one view per piece, padding left out) and combines the ranks with
one SUM and one MAX all-reduce into the statistics of the whole parameters, the same on every rank.

DeepSpeed itself is not needed (nor imported): pass a rank's flat gradient partition of one parameter group and the
element counts of that group's parameters in flattening order (with ``round_robin_gradients``, that order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats._transfer import host_int64
from torch_gradstats.ops import TensorStats, multi_tensor_stats

__all__ = ["Piece", "partition_pieces", "partition_stats"]


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
        packed = torch.cat([sumsq, counts.to(torch.float64).reshape(-1)])  # counts exact below 2**53
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        sumsq, counts = packed[:n], packed[n:].reshape(n, 3).to(torch.int64)
    return TensorStats(sumsq, amax, counts)
