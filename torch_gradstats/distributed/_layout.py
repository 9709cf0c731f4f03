"""Agreeing on the per-parameter layout of the packed buffers across the ranks of one process group.

:mod:`~torch_gradstats.distributed` packs one row per parameter into the buffers it all-reduces, so every rank of a
group must put the same parameter in the same row, and all buffers must have the same size (gloo aborts the
process on a size mismatch). Ranks do not always hold the same parameters: a gradient can be missing on one rank
only (an expert no token reached, a frozen branch), and pipeline stages hold different parameters altogether.

Each rank describes the rows it reduces over a group (:class:`Desc`: name, dtype, DTensor shape and placements) and
the group agrees on an ordered union of them, the *agreed layout*; a rank packs zeros in the rows it does not hold
(an empty shard). The full descriptions are exchanged (``all_gather_object``) on the first call on a group, and
again only when every rank of the group asks for it in the same reduction (see
:mod:`torch_gradstats.distributed.reduce`: a rank asks after a report showed a change, or when its own rows just
changed), so that every rank decides alike without reading the host in steady state. In between, a row the layout
has no place for (:meth:`Agreed.positions` says None) goes to a reserved row (names starting with
:data:`RESERVED`). Layout errors are decided from the exchanged descriptions, which every rank holds in full, so
every rank raises the same error before any buffer is reduced.

Two ways to merge: ``"shard"`` (a name on several ranks is one parameter sharded over them: its rows are summed) and
``"stage"`` (the ranks hold disjoint parts of a model: a name held by several ranks is one row per rank, suffixed
``@stage<rank in the group>``; a tied one too, but only the lowest such rank's row is *counted* in the figures of the
whole model, see :attr:`Agreed.counted`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
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


#: Row names that start with this are the reserved rows (see the module docstring); a parameter's name never does.
RESERVED = "\x00unattributed:"
#: The reserved row of the copies of a tied parameter that are not counted (a later stage's): in no total.
RESERVED_UNCOUNTED = RESERVED + "uncounted"


@dataclass
class Agreed:
    """The agreed layout of one group: output names in row order, and where each of this rank's rows goes."""

    names: list[str]
    descs: list[Desc]  # one per output name (renamed where a stage suffix was added)
    #: this rank's rows the layout has a place for: name -> (row, the description agreed for it)
    place: dict[str, tuple[int, Desc]]
    fingerprint: int
    #: one per output name: whether the row counts in the figures of the whole model (False for the copies of a
    #: tied parameter on stages other than the lowest that holds it)
    counted: list[bool]
    #: stage mode: which ranks of the group hold each name (empty in shard mode)
    holders: dict[str, list[int]] = field(default_factory=dict)
    tied: frozenset[str] = frozenset()  #: the tied names every rank declared, together

    def positions(self, local: Sequence[Desc]) -> list[int | None]:
        """Where each of ``local`` goes: its row, or None where the layout has no row of that description."""
        out: list[int | None] = []
        for d in local:
            hit = self.place.get(d.name)
            out.append(hit[0] if hit is not None and hit[1] == d else None)
        return out


@dataclass
class _Entry:
    group: Any  # kept so that the id of a destroyed group is never mistaken for this one
    mode: str
    agreed_tied: frozenset[str]  # this rank's tied names when the group agreed
    agreed: Agreed
    epoch: int  # how many exchanges this group has made: a mark from an older layout's check is stale
    #: a report showed that some rank packed rows this layout has no place for: ask the group to exchange
    marked: bool = False
    #: this rank's rows when the group agreed, and at its last reduction over the group
    agreed_local: list[Desc] = field(default_factory=list)
    last_local: list[Desc] = field(default_factory=list)
    tied: frozenset[str] = frozenset()  # ... and at its last reduction


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
    if mode.startswith("shard"):
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
        place = {n: (i, out_descs[i]) for i, n in enumerate(names)}
        counted = [True] * len(names)
        holders: dict[str, list[int]] = {}
    else:  # stage
        holders = {}
        for r, descs in enumerate(all_descs):
            for d in descs:
                holders.setdefault(d.name, []).append(r)

        names, out_descs, counted = [], [], []
        place = {}
        for r, descs in enumerate(all_descs):
            for d in descs:
                ranks = holders[d.name]
                name = d.name if len(ranks) == 1 else f"{d.name}@stage{r}"
                if r == me:
                    place[d.name] = (len(names), d)
                names.append(name)
                out_descs.append(d._replace(name=name))
                # A tied parameter is one parameter: every stage's row is reported, the lowest stage's is counted.
                counted.append(d.name not in tied or r == ranks[0])
    return Agreed(names, out_descs, place, _fingerprint(names, all_descs, counted), counted, holders,
                  frozenset(tied))


def cached(group: Any, mode: str) -> _Entry | None:
    """The last agreement of ``group`` in ``mode``, or None: never agreed, exchange now."""
    entry = _CACHE.get((id(group), mode))
    if entry is None or entry.group is not group:
        return None
    return entry


def mark(group: Any, mode: str, epoch: int) -> None:
    """Note that a reduction in layout ``epoch`` of ``group`` packed rows its layout had no place for (read from
    its check row by a report): this rank then asks the group to exchange layouts at its next reduction."""
    entry = _CACHE.get((id(group), mode))
    if entry is not None and entry.group is group and entry.epoch == epoch:
        entry.marked = True


def exchange(
    group: Any, mode: str, local: list[Desc], tied: Collection[str], who: str, strict: bool = False
) -> _Entry:
    """Exchange every rank's descriptions over ``group`` (one ``all_gather_object``), agree, and remember."""
    previous = _CACHE.pop((id(group), mode), None)  # an error below leaves no layout: every rank exchanges next time
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (local, sorted(tied)), group=group)
    all_tied = frozenset(name for _, names in gathered for name in names)  # one rank's declaration is enough
    agreed = _agree(mode, [descs for descs, _ in gathered], dist.get_rank(group), all_tied, who, strict)
    epoch = 1 if previous is None or previous.group is not group else previous.epoch + 1
    entry = _Entry(group, mode, frozenset(tied), agreed, epoch, agreed_local=list(local), last_local=list(local),
                   tied=frozenset(tied))
    _CACHE[(id(group), mode)] = entry
    return entry
