"""Agreeing on the per-parameter layout of the packed buffers across the ranks of one process group.

:mod:`~torch_gradstats.distributed` packs one row per parameter into the buffers it all-reduces, so every rank of a
group must put the same parameter in the same row, and all buffers must have the same size (gloo aborts the
process on a size mismatch). Ranks do not always hold the same parameters: a gradient can be missing on one rank
only (an expert no token reached, a frozen branch), and pipeline stages hold different parameters altogether.

Each rank describes the rows it reduces over a group (:class:`Desc`: name, dtype, DTensor shape and placements) and
the group agrees on an ordered union of them, the *agreed layout*; a rank packs zeros in the rows it does not hold
(an empty shard). The full descriptions are exchanged (``all_gather_object``) only on the first call on a group and
when a rank's own description changed since the last exchange. In between, the agreed layout is reused, and the
existing SUM/MAX reductions carry one extra row, the check row: each rank's fingerprint of the layout it packed by
and whether its own description changed ("dirty"). Every rank reads the reduced check row (the same values on every
rank, so the same decision everywhere): all fingerprints equal and nobody dirty means the result is valid; otherwise
every rank exchanges and reduces again. Layout errors are decided from the exchanged descriptions, which every rank
holds in full, so every rank raises the same error before any buffer is reduced.

Two ways to merge: ``"shard"`` (a name on several ranks is one parameter sharded over them: its rows are summed) and
``"stage"`` (the ranks hold disjoint parts of a model: a name held by several ranks is one row per rank, suffixed
``@stage<rank in the group>``; a tied one too, but only the lowest such rank's row is *counted* in the figures of the
whole model, see :attr:`Agreed.counted`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

_FP_BITS = 52  # float64 holds every integer below 2**53; the reduction scales it down to the group's size


class Desc(NamedTuple):
    """What a rank says about one row: the parameter's name, its gradient's dtype and, for a DTensor, its logical
    shape and placements (None for a plain tensor)."""

    name: str
    dtype: torch.dtype
    dtensor: tuple[tuple[int, ...], str] | None


@dataclass
class Agreed:
    """The agreed layout of one group: output names in row order, and where each local row goes (None: nowhere)."""

    names: list[str]
    descs: list[Desc]  # one per output name (renamed where a stage suffix was added)
    positions: list[int | None]
    fingerprint: int
    #: one per output name: whether the row counts in the figures of the whole model (False for the copies of a
    #: tied parameter on stages other than the lowest that holds it)
    counted: list[bool]


@dataclass
class _Entry:
    group: Any  # kept so that the id of a destroyed group is never mistaken for this one
    mode: str
    local: list[Desc]
    tied: frozenset[str]
    agreed: Agreed


#: The last agreed layout per (group, mode): identical on every rank of the group, which all exchange together.
_CACHE: dict[tuple[int, str], _Entry] = {}


def _fingerprint(names: Sequence[str], descs: Sequence[Sequence[Desc]], counted: Sequence[bool]) -> int:
    digest = hashlib.blake2b(repr((list(names), [list(d) for d in descs], list(counted))).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _FP_BITS)


def merge_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """Ordered union: each list's new names go right after the name before them in that list (model order)."""
    out: list[str] = []
    index: dict[str, int] = {}
    for names in lists:
        at = 0
        for name in names:
            if name in index:
                at = index[name] + 1
                continue
            out.insert(at, name)
            if at == len(out) - 1:
                index[name] = at
            else:  # inserted before the end: later positions moved
                index = {n: i for i, n in enumerate(out)}
            at += 1
    return out


def _describe(desc: Desc) -> str:
    if desc.dtensor is None:
        return f"a {desc.dtype} plain tensor"
    shape, placements = desc.dtensor
    return f"a {desc.dtype} DTensor of shape {list(shape)} with placements {placements}"


def _agree(
    mode: str, all_descs: Sequence[Sequence[Desc]], me: int, tied: Collection[str], who: str, strict: bool
) -> Agreed:
    """The agreed layout from every rank's descriptions (``all_descs[r]`` is group rank r's); raises ValueError,
    the same on every rank, where the layouts cannot be reconciled. ``strict``: rows have no names (only their
    positions), so every rank must describe exactly the same rows."""
    if strict:
        for r, descs in enumerate(all_descs):
            if list(descs) != list(all_descs[0]):
                raise ValueError(
                    f"{who}: the ranks hold different gradient lists (group rank 0: {len(all_descs[0])} gradients, "
                    f"group rank {r}: {len(descs)}, or different dtypes or layouts); pass names= so that "
                    "gradients are matched by name and a missing one counts as an empty shard"
                )
    if mode == "shard":
        first: dict[str, tuple[int, Desc]] = {}
        for r, descs in enumerate(all_descs):
            for d in descs:
                seen = first.setdefault(d.name, (r, d))
                if seen[1] != d:
                    raise ValueError(
                        f"{who}: parameter {d.name!r} cannot be reduced across ranks: its gradient is "
                        f"{_describe(seen[1])} on group rank {seen[0]} and {_describe(d)} on group rank {r}; every "
                        "rank that holds a gradient of a parameter must hold the same dtype and layout"
                    )
        names = merge_order([[d.name for d in descs] for descs in all_descs])
        out_descs = [first[n][1] for n in names]
        where = {n: i for i, n in enumerate(names)}
        positions: list[int | None] = [where[d.name] for d in all_descs[me]]
        counted = [True] * len(names)
    else:  # stage
        holders: dict[str, list[int]] = {}
        for r, descs in enumerate(all_descs):
            for d in descs:
                holders.setdefault(d.name, []).append(r)

        names, out_descs, counted = [], [], []
        for r, descs in enumerate(all_descs):
            for d in descs:
                ranks = holders[d.name]
                name = d.name if len(ranks) == 1 else f"{d.name}@stage{r}"
                names.append(name)
                out_descs.append(d._replace(name=name))
                # A tied parameter is one parameter: every stage's row is reported, the lowest stage's is counted.
                counted.append(d.name not in tied or r == ranks[0])
        start = sum(map(len, all_descs[:me]))  # this rank's rows, stage by stage
        positions = [start + i for i in range(len(all_descs[me]))]
    return Agreed(names, out_descs, positions, _fingerprint(names, all_descs, counted), counted)


def cached(group: Any, mode: str, local: list[Desc], tied: Collection[str]) -> tuple[Agreed | None, bool]:
    """The last agreed layout of ``group`` (or None: never agreed, exchange now) and whether this rank is dirty
    (its own description or the tied names changed since; it then packs nothing and the group exchanges again)."""
    entry = _CACHE.get((id(group), mode))
    if entry is None or entry.group is not group:
        return None, False
    if entry.local == local and entry.tied == frozenset(tied):
        return entry.agreed, False
    return entry.agreed, True


def exchange(
    group: Any, mode: str, local: list[Desc], tied: Collection[str], who: str, strict: bool = False
) -> Agreed:
    """Exchange every rank's descriptions over ``group`` (one ``all_gather_object``), agree, and remember."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (local, sorted(tied)), group=group)
    _CACHE.pop((id(group), mode), None)  # an error below leaves no layout behind: every rank exchanges next time
    all_tied = frozenset(name for _, names in gathered for name in names)  # one rank's declaration is enough
    agreed = _agree(mode, [descs for descs, _ in gathered], dist.get_rank(group), all_tied, who, strict)
    _CACHE[(id(group), mode)] = _Entry(group, mode, list(local), frozenset(tied), agreed)
    return agreed
