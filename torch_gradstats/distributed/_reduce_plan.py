"""What :func:`~torch_gradstats.distributed.reduce_across_ranks` reduces over which process group, from the gradients.

Read from the gradients' metadata before any buffer is packed: torch's DTensor class (:func:`dtensor_class`), Partial
DTensor gradients materialized and their rows recomputed (:func:`materialize_partials`), each row's description for
the layout the ranks agree on (:func:`row_descs`, see ``_layout``), and the reduction steps, each
process group with the rows reduced over it (:func:`plan_steps`). The module docstring of
:mod:`torch_gradstats.distributed.reduce` says what is reduced over which group and why.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from torch_gradstats.distributed._layout import Desc
from torch_gradstats.ops._transfer import host_int64, to_device
from torch_gradstats.ops.op import multi_tensor_stats

__all__ = ["dtensor_class", "materialize_partials", "plan_steps", "row_descs", "spanning_step"]

#: float64 holds every integer below this exactly; counts travel in float64 buffers.
_EXACT_F64_INT = 2**53


def dtensor_class() -> type[Any] | None:
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


def materialize_partials(
    grads: Sequence[Any], dtensor_cls: type[Any] | None, sumsq: Tensor, amax: Tensor, counts: Tensor,
    histogram: Tensor | None,
) -> tuple[list[Any], Tensor, Tensor, Tensor, Tensor | None]:
    """Replace Partial DTensor gradients by their reduced redistribution and recompute their rows.

    Returns the gradients to plan with (materialized where Partial) and the updated statistics. The caller's
    tensors are not modified.
    """
    if dtensor_cls is None:
        return list(grads), sumsq, amax, counts, histogram
    rows = [
        i
        for i, g in enumerate(grads)
        if isinstance(g, dtensor_cls) and any(pl.is_partial() for pl in g.placements)
    ]
    if not rows:
        return list(grads), sumsq, amax, counts, histogram
    from torch.distributed.tensor import Replicate, Shard

    planned = list(grads)
    for i in rows:
        g = grads[i]
        # Partial -> Shard(0) (a reduce-scatter): the dimension is then reduced like any sharded one, so the
        # per-rank non-finite counts of the addends reach every rank. A 0-d tensor cannot be sharded: Replicate.
        target = Shard(0) if g.ndim > 0 else Replicate()
        # A new DTensor: the gradient itself is left as it is.
        planned[i] = g.redistribute(g.device_mesh, [target if pl.is_partial() else pl for pl in g.placements])
    local = [planned[i].to_local() for i in rows]
    device = sumsq.device
    idx = host_int64(rows, device)
    if histogram is not None:
        s, a, c, h = multi_tensor_stats(local, histogram=True)
        histogram = histogram.index_copy(0, idx, to_device(h, device))
    else:
        s, a, c = multi_tensor_stats(local)
    sumsq = sumsq.index_copy(0, idx, to_device(s, device))
    amax = amax.index_copy(0, idx, to_device(a, device))
    counts = counts.index_copy(0, idx, to_device(c, device))
    return planned, sumsq, amax, counts, histogram


def row_descs(
    grads: Sequence[Any], names: Sequence[str], dtensor_cls: type[Any] | None, has_dtensor: bool
) -> list[Desc]:
    if dtensor_cls is None or not has_dtensor:  # the per-step cost of the layout check: one tuple per row
        return list(map(Desc._make, zip(names, [g.dtype for g in grads], itertools.repeat(None))))
    return [
        Desc(n, g.dtype, (tuple(g.shape), repr(tuple(g.placements))) if isinstance(g, dtensor_cls) else None)
        for g, n in zip(grads, names)
    ]


#: id(mesh) -> (the mesh, its key): a mesh's rank list is a tensor, read once per mesh (a host read each time else)
_MESH_KEYS: dict[int, tuple[Any, tuple[Any, ...]]] = {}


def mesh_key(mesh: Any) -> tuple[Any, ...]:
    """What every rank of ``mesh`` agrees on about it: its shape and global ranks (read once, then kept)."""
    kept = _MESH_KEYS.get(id(mesh))
    if kept is not None and kept[0] is mesh:
        return kept[1]
    key = (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()))
    _MESH_KEYS[id(mesh)] = (mesh, key)
    return key


def plan_steps(
    grads: Sequence[Any],
    names: Sequence[str],
    dtensor_cls: type[Any] | None,
    explicit: Sequence[tuple[Any, Callable[[str], bool] | None]],
    meshes: Sequence[Any] = (),
) -> tuple[list[tuple[Any, list[int]]], list[int], list[tuple[int, ...]]]:
    """The reduction steps, each process group with the rows reduced over it, in an order every rank agrees on
    whatever it holds: the explicit groups first (always, so that a rank holding none of their rows still takes
    part), then every dimension of every mesh a DTensor gradient lives on (a dimension none of this rank's rows is
    sharded over included), meshes ordered by their ranks and dimensions in mesh order. Rows sharded over several
    groups are reduced over each in that order on every rank, so the sums compose.

    ``explicit`` lists (group, which plain rows it reduces: None for all); ``meshes``: more meshes to take part in
    (those of parameters whose gradient this rank lacks). Also returns each row's local element count, and every
    set of steps a row can be reduced over (its *mask*: an explicit group's step alone, or the steps of some of a
    mesh's dimensions), as sorted step indices, the same on every rank that plans the same steps.
    """
    steps: dict[int, tuple[Any, list[int]]] = {}
    sizes: dict[int, int] = {}  # dist.get_world_size costs microseconds: once per group, not once per row

    def size(pg: Any) -> int:
        n = sizes.get(id(pg))
        if n is None:
            n = sizes[id(pg)] = dist.get_world_size(pg)
        return n

    for pg, _ in explicit:
        if pg is not None and size(pg) > 1:
            steps.setdefault(id(pg), (pg, []))
    all_meshes: dict[int, Any] = {id(m): m for m in meshes if m.get_coordinate() is not None}
    only = explicit[0][0] if len(explicit) == 1 and explicit[0][1] is None else None  # it takes every plain row
    local_numel: list[int] = []
    rows: dict[int, list[int]] = {}
    for i, (g, name) in enumerate(zip(grads, names)):
        row_groups: list[Any] = []
        if dtensor_cls is not None and isinstance(g, dtensor_cls):
            mesh = g.device_mesh
            local_numel.append(g.to_local().numel())
            if mesh.get_coordinate() is not None:  # ranks outside the mesh hold nothing and reduce nothing
                all_meshes.setdefault(id(mesh), mesh)
                row_groups = [mesh.get_group(d) for d, pl in enumerate(g.placements) if pl.is_shard()]
            logical = g.numel()
        else:
            local_numel.append(g.numel())
            pg = only
            if pg is None:
                pg = next((pg for pg, takes in explicit if takes is None or takes(name)), None)
            logical = g.numel()
            if pg is not None:
                row_groups = [pg]
                logical *= size(pg)  # an upper bound: every shard as large
        if logical >= _EXACT_F64_INT:
            raise ValueError(
                f"reduce_across_ranks: grads[{i}] has about {logical} elements across ranks; counts travel as "
                "float64 and are exact only below 2**53"
            )
        for pg in dict.fromkeys(row_groups):  # a group once per row
            if size(pg) > 1:
                rows.setdefault(id(pg), []).append(i)
    ordered_meshes = sorted(all_meshes.values(), key=mesh_key)
    for mesh in ordered_meshes:
        for d in range(mesh.ndim):
            pg = mesh.get_group(d)
            if size(pg) > 1:
                steps.setdefault(id(pg), (pg, []))
    for key, (pg, step_rows) in steps.items():
        step_rows.extend(rows.get(key, []))
    index = {key: k for k, key in enumerate(steps)}
    masks: set[tuple[int, ...]] = {(index[id(pg)],) for pg, _ in explicit if pg is not None and id(pg) in index}
    for mesh in ordered_meshes:
        dims = sorted({index[id(mesh.get_group(d))] for d in range(mesh.ndim) if id(mesh.get_group(d)) in index})
        for n in range(1, len(dims) + 1):
            masks.update(itertools.combinations(dims, n))
    return list(steps.values()), local_numel, sorted(masks)


#: id(group) -> (the group, its global ranks): read once per group
_GROUP_RANKS: dict[int, tuple[Any, frozenset[int]]] = {}


def _ranks(pg: Any) -> frozenset[int]:
    kept = _GROUP_RANKS.get(id(pg))
    if kept is None or kept[0] is not pg:
        kept = _GROUP_RANKS[id(pg)] = (pg, frozenset(dist.get_process_group_ranks(pg)))
    return kept[1]


def spanning_step(steps: Sequence[tuple[Any, list[int]]]) -> int | None:
    """The first step whose group holds every rank of the other steps' groups (``group=`` over every rank beside
    an ``expert_group=`` over some of them), or None. Every rank of that group learns every rank's own list of
    names when it agrees, which orders the rows the same on all of them (``reorder``). No communication."""
    if len(steps) < 2:
        return None
    groups = tuple(pg for pg, _ in steps)
    kept = _SPANS.get(tuple(map(id, groups)))
    if kept is not None and all(a is b for a, b in zip(kept[0], groups)):
        return kept[1]
    union = frozenset().union(*map(_ranks, groups))
    span = next((k for k, pg in enumerate(groups) if _ranks(pg) == union), None)
    _SPANS[tuple(map(id, groups))] = (groups, span)
    return span


#: the steps' groups (by id) -> (the groups, the spanning step): the same few sets of groups at every call
_SPANS: dict[tuple[int, ...], tuple[tuple[Any, ...], int | None]] = {}
