"""What the drop-ins share: the local shards of a list of gradients, one fused read of them, and the sum of a
per-tensor figure over every rank that holds a part of each tensor.

A DTensor gradient contributes its local shard. Summing over a mesh counts each element once only if replicas are
left out: a shard is *counted* on a rank whose coordinate is 0 along every mesh dimension where the gradient is
replicated; the other replicas hold the same values and add nothing. A maximum needs no such care.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.ops._transfer import host_int64, to_device
from torch_gradstats.ops.op import TensorStats, multi_tensor_stats

__all__ = ["Shards", "local_shards", "max_over_meshes", "read", "reduce_over_mesh", "sum_counted"]


def _dtensor_type() -> type[Any] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


class Shards(NamedTuple):
    """The local part of each gradient, in order."""

    local: list[Tensor]  #: the tensor itself, or a DTensor's local shard (a view: writing to it writes the DTensor)
    mesh: list[Any]  #: the DTensor's device mesh, or None for a plain tensor
    counted: list[bool]  #: False where this rank's shard is a replica another rank counts


def local_shards(grads: Sequence[Any], what: str) -> Shards:
    """Split ``grads`` into local shards; ``what`` names the argument in errors."""
    dtensor = _dtensor_type()
    local, meshes, counted = [], [], []
    for i, g in enumerate(grads):
        if dtensor is not None and isinstance(g, dtensor):
            placements = g.placements
            if any(p.is_partial() for p in placements):
                raise ValueError(
                    f"{what}[{i}] is a DTensor with a Partial placement {tuple(placements)}: its local values are "
                    "not its elements; redistribute it to Shard or Replicate first"
                )
            mesh = g.device_mesh
            local.append(g.to_local())
            meshes.append(mesh)
            counted.append(all(mesh.get_local_rank(d) == 0 for d, p in enumerate(placements) if p.is_replicate()))
        elif isinstance(g, Tensor):
            local.append(g)
            meshes.append(None)
            counted.append(True)
        else:
            raise TypeError(f"{what}[{i}] must be a torch.Tensor, got a {type(g).__name__}")
    return Shards(local, meshes, counted)


def read(tensors: Sequence[Tensor], home: torch.device) -> TensorStats:
    """One fused read per device, gathered on ``home`` in input order, without a host sync."""
    n = len(tensors)
    if n == 0:
        return TensorStats(
            torch.zeros(0, dtype=torch.float64, device=home),
            torch.zeros(0, dtype=torch.float64, device=home),
            torch.zeros(0, 3, dtype=torch.int64, device=home),
        )
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) == 1 and home in by_device:
        return multi_tensor_stats(list(tensors))
    parts = []
    order: list[int] = []
    for idx in by_device.values():
        s, a, c = multi_tensor_stats([tensors[i] for i in idx])
        parts.append((to_device(s, home), to_device(a, home), to_device(c, home)))
        order.extend(idx)
    inverse = host_int64(sorted(range(n), key=order.__getitem__), home)
    return TensorStats(
        torch.cat([p[0] for p in parts]).index_select(0, inverse),
        torch.cat([p[1] for p in parts]).index_select(0, inverse),
        torch.cat([p[2] for p in parts]).index_select(0, inverse),
    )


def sum_counted(values: Tensor, shards: Shards) -> Tensor:
    """``values`` ([N, ...], one row per gradient) summed over this rank's counted shards and over every DTensor
    mesh they live on: one SUM all-reduce per mesh dimension of each distinct mesh (torch's own DTensor norm
    reduces the same way). Plain tensors stay local."""
    groups: dict[Any, list[int]] = {}
    for i, (mesh, counted) in enumerate(zip(shards.mesh, shards.counted)):
        if counted or mesh is None:
            groups.setdefault(mesh, []).append(i)
    # In order of first appearance, the same on every rank (a set's order follows string hashes, which differ).
    meshes = list(dict.fromkeys(m for m in shards.mesh if m is not None))
    total = torch.zeros(values.shape[1:], dtype=values.dtype, device=values.device)
    for mesh in [None, *meshes]:
        idx = groups.get(mesh, [])
        part = values.index_select(0, host_int64(idx, values.device)).sum(0) if idx else torch.zeros_like(total)
        if mesh is not None:
            reduce_over_mesh(part, mesh, dist.ReduceOp.SUM)
        total = total + part
    return total


def reduce_over_mesh(t: Tensor, mesh: Any, op: Any) -> None:
    """All-reduce ``t`` in place over every rank of ``mesh``: one collective per dimension of more than one rank."""
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            dist.all_reduce(t, op=op, group=mesh.get_group(d))


def max_over_meshes(values: Tensor, shards: Shards) -> Tensor:
    """The largest of ``values`` ([N]) over this rank and every rank of the DTensor meshes: one MAX all-reduce per
    mesh dimension of each distinct mesh. Replicas hold equal values, so every shard takes part."""
    total = values.max() if values.numel() else torch.zeros((), dtype=values.dtype, device=values.device)
    for mesh in dict.fromkeys(m for m in shards.mesh if m is not None):
        reduce_over_mesh(total, mesh, dist.ReduceOp.MAX)
    return total
