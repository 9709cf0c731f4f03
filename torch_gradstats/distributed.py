"""Global gradient statistics across ranks: :func:`reduce_across_ranks`.

:func:`torch_gradstats.grad_stats` computes per-parameter statistics of what each rank holds locally (a DTensor's
local shard, or a plain tensor) and, when a ``group`` is given or a gradient is a DTensor, calls
:func:`reduce_across_ranks` to turn them into statistics of the whole logical parameter.

What is reduced, per parameter:

* **DTensor** gradient: over each mesh dimension whose placement is ``Shard`` (FSDP2 leaves ``Shard(0)`` gradients,
  tensor parallelism ``Shard(d)``), never over a ``Replicate`` dimension (DDP/HSDP replicas hold the same numbers;
  summing them would over-report the norm by sqrt(replicas)). A ``Partial`` placement means the local tensors are
  *addends* of the gradient: the sum of squares of the addends is not the square of their sum, so each Partial
  gradient is first materialized (``redistribute`` of its Partial dimensions to ``Shard(0)``, a reduce-scatter, one
  collective per such gradient; ``Replicate`` for a 0-d one; neither FSDP2 nor DDP leaves Partial gradients), its
  local statistics recomputed from the result, and the dimension then reduced like any sharded one.
* **plain tensor** with an explicit ``group``: the tensors of every rank in ``group`` are shards of one logical set
  (FSDP1 flat parameters, ZeRO partitions), so sums of squares and counts are summed, max |x| is maxed.
* **plain tensor** without a ``group``: nothing is reduced (DDP: every rank holds the same, already averaged
  gradient). :func:`~torch_gradstats.grad_stats` does not call this module at all when no gradient is a DTensor and
  no group is given.

Communication: for each distinct process group (the explicit ``group``, and each mesh dimension group a gradient is
sharded over), exactly one SUM and one MAX ``all_reduce``, each on one packed buffer holding every parameter that
needs that group, never one per parameter. Parameters sharded over several mesh dimensions are reduced over each
dimension's group in turn (sum and max compose). Groups of one rank are skipped.

The SUM buffer is float64 ``[K, 5 + world]``: sum of squares, the three counts, the per-rank non-finite counts and
the local element count (summed, it is the logical numel, which for plain shards no rank knows from metadata).
Counts travel as float64 because it holds every integer below 2**53 exactly and one buffer means one collective; a
logical parameter would need 2**53 (9e15) elements to break that, which is checked on metadata. NaN and Inf are
carried as counts: a MAX all-reduce need not propagate NaN (gloo does not guarantee it), so after the reduction
every parameter whose reduced NaN count is positive gets NaN for its max |x| and its sum of squares, on every rank.

``rank_nonfinite[p, r]`` is the number of NaN/Inf elements parameter ``p`` had on global rank ``r`` in what that rank
held (its shard; for a Partial gradient, its addend before materialization, so the rank that produced the bad value
is named). A rank sees the columns of the ranks it reduces with; replicas (Replicate dimensions, DDP) are not
communicated with, so each replica reports its own copy (and a 0-d Partial gradient, materialized as Replicate,
names only the rank itself if its own addend was bad).

No host sync: buffers are built and unpacked on the statistics' device; row indices for partial buffers are copied
host-to-device from pinned memory without blocking.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats._transfer import host_int64, to_device
from torch_gradstats.ops import INF, NAN, multi_tensor_stats

__all__ = ["ReducedStats", "reduce_across_ranks"]

logger = logging.getLogger("torch_gradstats")

#: float64 holds every integer below this exactly; counts travel in float64 buffers.
_EXACT_F64_INT = 2**53

# Columns of the packed SUM buffer.
_SUMSQ_COL = 0
_COUNTS_COLS = slice(1, 4)
_RANKS_START = 4  # then one column per global rank, then the local numel


class ReducedStats(NamedTuple):
    """What :func:`reduce_across_ranks` returns: statistics of the whole logical parameters, one row each."""

    sumsq: Tensor  #: float64 ``[P]``
    amax: Tensor  #: float64 ``[P]``
    counts: Tensor  #: int64 ``[P, 3]``: zeros, NaNs, Infs
    rank_nonfinite: Tensor | None  #: int64 ``[P, world]``, or None when there was nothing to reduce
    numel: Tensor  #: int64 ``[P]``: logical element count of each parameter


def _dtensor_class() -> type[Any] | None:
    """torch's DTensor class, or None if this torch has none."""
    for mod_name in ("torch.distributed.tensor", "torch.distributed._tensor"):  # new name, then torch < 2.5
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        cls = getattr(mod, "DTensor", None)
        if isinstance(cls, type):
            return cls
    return None


def _resolve_group(group: Any) -> Any:
    """A process group (or None) from what the caller passed: a ProcessGroup, None, or a 1-D DeviceMesh."""
    if group is None:
        return None
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = None  # type: ignore[assignment,misc]
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"reduce_across_ranks: group is a {group.ndim}-D DeviceMesh; pass the process group of the dimension "
                "the plain gradients are sharded over, e.g. mesh.get_group('dp_shard')"
            )
        group = group.get_group()
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"reduce_across_ranks: global rank {dist.get_rank()} is not a member of the group it was given; call it "
            "with a group this rank belongs to (each rank passes its own shard group)"
        )
    return group


def _check_inputs(grads: Sequence[Any], sumsq: Tensor, amax: Tensor, counts: Tensor) -> None:
    p = len(grads)
    for name, t, shape, dtype in (
        ("sumsq", sumsq, (p,), torch.float64),
        ("amax", amax, (p,), torch.float64),
        ("counts", counts, (p, 3), torch.int64),
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"reduce_across_ranks: {name} is a {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"reduce_across_ranks: {name} must be {dtype} of shape {list(shape)} for {p} gradients, "
                f"got {t.dtype} of shape {list(t.shape)}"
            )
    if not (sumsq.device == amax.device == counts.device):
        raise ValueError(
            f"reduce_across_ranks: sumsq ({sumsq.device}), amax ({amax.device}) and counts ({counts.device}) "
            "must be on one device"
        )
    for i, g in enumerate(grads):
        if not isinstance(g, Tensor):
            raise TypeError(f"reduce_across_ranks: grads[{i}] is a {type(g).__name__}, expected a tensor")


def _materialize_partials(
    grads: Sequence[Any], dtensor_cls: type[Any] | None, sumsq: Tensor, amax: Tensor, counts: Tensor
) -> tuple[list[Any], Tensor, Tensor, Tensor]:
    """Replace Partial DTensor gradients by their reduced redistribution and recompute their rows.

    Returns the gradients to plan with (materialized where Partial) and the updated statistics. The caller's
    tensors are not modified.
    """
    if dtensor_cls is None:
        return list(grads), sumsq, amax, counts
    rows = [
        i
        for i, g in enumerate(grads)
        if isinstance(g, dtensor_cls) and any(pl.is_partial() for pl in g.placements)
    ]
    if not rows:
        return list(grads), sumsq, amax, counts
    from torch.distributed.tensor import Replicate, Shard

    planned = list(grads)
    for i in rows:
        g = grads[i]
        # Partial -> Shard(0) (a reduce-scatter): the dimension is then reduced like any sharded one, so the
        # per-rank non-finite counts of the addends reach every rank. A 0-d tensor cannot be sharded: Replicate.
        target = Shard(0) if g.ndim > 0 else Replicate()
        # A new DTensor: the gradient itself is left as it is.
        planned[i] = g.redistribute(g.device_mesh, [target if pl.is_partial() else pl for pl in g.placements])
    s, a, c = multi_tensor_stats([planned[i].to_local() for i in rows])
    device = sumsq.device
    idx = host_int64(rows, device)
    sumsq = sumsq.index_copy(0, idx, to_device(s, device))
    amax = amax.index_copy(0, idx, to_device(a, device))
    counts = counts.index_copy(0, idx, to_device(c, device))
    return planned, sumsq, amax, counts


def _plan(
    grads: Sequence[Any], dtensor_cls: type[Any] | None, group: Any
) -> tuple[list[tuple[Any, list[int]]], list[int]]:
    """For each distinct process group (first-use order, identical on every rank), the rows reduced over it.

    Also returns each row's local element count (for the numel column and the 2**53 exactness check).
    """
    groups: dict[int, tuple[Any, list[int]]] = {}
    local_numel: list[int] = []
    for i, g in enumerate(grads):
        row_groups: list[Any] = []
        if dtensor_cls is not None and isinstance(g, dtensor_cls):
            mesh = g.device_mesh
            local_numel.append(g.to_local().numel())
            if mesh.get_coordinate() is not None:  # ranks outside the mesh hold nothing and reduce nothing
                row_groups = [mesh.get_group(d) for d, pl in enumerate(g.placements) if pl.is_shard()]
            logical = g.numel()
        else:
            local_numel.append(g.numel())
            if group is not None:
                row_groups = [group]
                logical = g.numel() * dist.get_world_size(group)  # an upper bound: every shard as large
            else:
                logical = g.numel()
        if logical >= _EXACT_F64_INT:
            raise ValueError(
                f"reduce_across_ranks: grads[{i}] has about {logical} elements across ranks; counts travel as "
                "float64 and are exact only below 2**53"
            )
        seen: set[int] = set()
        for pg in row_groups:
            if id(pg) in seen or dist.get_world_size(pg) == 1:
                continue
            seen.add(id(pg))
            groups.setdefault(id(pg), (pg, []))[1].append(i)
    return list(groups.values()), local_numel


@torch.no_grad()
def reduce_across_ranks(
    grads: Sequence[Tensor],
    sumsq: Tensor,
    amax: Tensor,
    counts: Tensor,
    group: Any = None,
) -> ReducedStats:
    """Turn per-rank statistics of local gradients into statistics of the whole logical parameters.

    Args:
        grads: the gradients as the user holds them (plain tensors or DTensors), one per row; only their metadata
            is read, except for Partial DTensors (materialized, see the module docstring). Never modified.
        sumsq: float64 ``[P]``, local sum of squares of each gradient (of a DTensor: of its local tensor).
        amax: float64 ``[P]``, local max |x|.
        counts: int64 ``[P, 3]``, local zero/NaN/Inf counts (columns ``ops.ZERO, ops.NAN, ops.INF``).
        group: process group (or 1-D DeviceMesh) the plain-tensor gradients are sharded over (their statistics are
            summed / maxed over it), or None: plain tensors are then not reduced. DTensors always use their own
            mesh.

    Returns:
        A :class:`ReducedStats` ``(sumsq, amax, counts, rank_nonfinite, numel)`` of tensors on ``sumsq``'s device,
        identical on every rank that reduced together. ``numel`` is each parameter's logical element count: the
        local counts summed over the same groups as everything else (for plain tensors with a ``group``, the size
        of the whole logical tensor, which no rank knows from metadata alone). ``rank_nonfinite`` is int64
        ``[P, world]`` (world and columns: global ranks), or None when torch.distributed is not initialized and no
        gradient is a DTensor (nothing to reduce: the same sumsq/amax/counts tensors come back).

    Raises:
        ValueError / TypeError: inconsistent shapes, dtypes or devices (naming the argument), a gradient too
            large for exact float64 counts, a group this rank is not in, or a multi-dimensional DeviceMesh.
        RuntimeError: a ``group`` is given but torch.distributed is not initialized.
    """
    _check_inputs(grads, sumsq, amax, counts)
    dtensor_cls = _dtensor_class() if dist.is_available() else None
    has_dtensor = dtensor_cls is not None and any(isinstance(g, dtensor_cls) for g in grads)
    initialized = dist.is_available() and dist.is_initialized()
    if group is not None and not initialized:
        raise RuntimeError(
            "reduce_across_ranks: a process group was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first, or pass group=None"
        )
    if not initialized and not has_dtensor:
        return ReducedStats(sumsq, amax, counts, None, host_int64([g.numel() for g in grads], sumsq.device))

    group = _resolve_group(group)
    device = sumsq.device
    p = len(grads)
    world, rank = dist.get_world_size(), dist.get_rank()

    # The rank that produced a NaN/Inf is named from what it held before any materialization.
    local_nonfinite = counts[:, NAN] + counts[:, INF]
    planned, sumsq, amax, counts = _materialize_partials(grads, dtensor_cls, sumsq, amax, counts)
    groups, local_numel = _plan(planned, dtensor_cls, group)

    # One packed float64 SUM buffer (exact integers below 2**53) and one float64 MAX buffer.
    ranks = torch.zeros(p, world, dtype=torch.float64, device=device)
    ranks[:, rank] = local_nonfinite.to(torch.float64)
    numel_col = to_device(torch.tensor(local_numel, dtype=torch.float64), device).unsqueeze(1)
    sum_buf = torch.cat([sumsq.unsqueeze(1), counts.to(torch.float64), ranks, numel_col], dim=1)
    max_buf = amax.clone()

    for pg, rows in groups:
        if len(rows) == p:  # every parameter needs this group: reduce the buffers whole
            dist.all_reduce(sum_buf, op=dist.ReduceOp.SUM, group=pg)
            dist.all_reduce(max_buf, op=dist.ReduceOp.MAX, group=pg)
            continue
        idx = host_int64(rows, device)
        sub_sum = sum_buf.index_select(0, idx)
        sub_max = max_buf.index_select(0, idx)
        dist.all_reduce(sub_sum, op=dist.ReduceOp.SUM, group=pg)
        dist.all_reduce(sub_max, op=dist.ReduceOp.MAX, group=pg)
        sum_buf.index_copy_(0, idx, sub_sum)
        max_buf.index_copy_(0, idx, sub_max)
    if groups:
        logger.debug(
            "reduce_across_ranks: %d parameters, %d process group(s), rows per group %s",
            p,
            len(groups),
            [len(rows) for _, rows in groups],
        )

    counts_out = sum_buf[:, _COUNTS_COLS].to(torch.int64)
    has_nan = counts_out[:, NAN] > 0
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
    sumsq_out = torch.where(has_nan, nan, sum_buf[:, _SUMSQ_COL])
    amax_out = torch.where(has_nan, nan, max_buf)  # NaN need not survive a MAX all-reduce; the count does
    rank_nonfinite = sum_buf[:, _RANKS_START : _RANKS_START + world].to(torch.int64)
    numel_out = sum_buf[:, _RANKS_START + world].to(torch.int64)
    return ReducedStats(sumsq_out, amax_out, counts_out, rank_nonfinite, numel_out)
