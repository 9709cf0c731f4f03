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
every rank raises the same error before any buffer is reduced. A call may send this rank's own list of names (in
model order) in the same exchange: the group then keeps every rank's list, from which the rows of several groups
are ordered the same on every rank (:func:`rank_order`).

Two ways to merge: ``"shard"`` (a name on several ranks is one parameter sharded over them: its rows are summed) and
``"stage"`` (the ranks hold disjoint parts of a model: a name held by several ranks is one row per rank, suffixed
``@stage<rank in the group>``; a tied one too, but only the lowest such rank's row is *counted* in the figures of the
whole model, see :attr:`Agreed.counted`).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
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
    """One layout a group agreed on, and this rank's state with it."""

    agreed: Agreed
    layout_id: int  # the same on every rank of the group: layouts are agreed together, and found again by fingerprint
    #: a report showed that some rank's rows no longer fit this layout: ask the group to agree again
    marked: bool = False
    #: this rank's rows and tied names when the group agreed, and at its last reduction in this layout
    agreed_local: list[Desc] = field(default_factory=list)
    agreed_tied: frozenset[str] = frozenset()
    last_local: list[Desc] = field(default_factory=list)
    tied: frozenset[str] = frozenset()
    #: every rank's own names in model order (by group rank) when the group agreed, where the call sent them (see
    #: :func:`rank_order`), a digest of them, and this rank's list then and at its last reduction in this layout
    lists: tuple[tuple[str, ...], ...] | None = None
    lists_key: int = 0
    agreed_raw: list[str] | None = None
    last_raw: list[str] | None = None


_MAX_LAYOUTS = 8  # per group: call sites that reduce different rows over one group, e.g. a subset, then everything
_HISTORY = 16


@dataclass
class _GroupLayouts:
    """Every layout one group agreed on (the last few), and which one each call used: the same on every rank of the
    group, since every call on the group is made by all of them and each choice below is made from this alone."""

    group: Any  # kept so that the id of a destroyed group is never mistaken for this one
    layouts: dict[int, _Entry] = field(default_factory=dict)  # by layout id, least recently used first
    history: list[int] = field(default_factory=list)  # the layout id each call used, the latest last
    next_id: int = 1

    def predict(self) -> _Entry:
        """The layout the next call is likely to use: where the last calls repeat a cycle of up to 4 (call sites
        taking turns on the group), the one the cycle has next; else the last one used."""
        h = self.history
        for period in range(1, 5):
            if len(h) >= 2 * period and h[-period:] == h[-2 * period:-period] and h[-period] in self.layouts:
                return self.layouts[h[-period]]
        return self.layouts[h[-1]]

    def used(self, entry: _Entry) -> None:
        self.layouts[entry.layout_id] = self.layouts.pop(entry.layout_id, entry)
        self.history = [*self.history[-(_HISTORY - 1):], entry.layout_id]


#: The layouts per (group, mode).
_CACHE: dict[tuple[int, str], _GroupLayouts] = {}


def _fingerprint(names: Sequence[str], descs: Sequence[Sequence[Desc]], counted: Sequence[bool]) -> int:
    digest = hashlib.blake2b(repr((list(names), [list(d) for d in descs], list(counted))).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - _FP_BITS)


def merge_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """Ordered union (model order), the same for the same lists: an order in which every list's names keep their
    order, when one exists (the lists do not contradict each other), closest to :func:`_greedy_order`'s; else that
    greedy order itself."""
    greedy = _greedy_order(lists)
    rank = {n: i for i, n in enumerate(greedy)}
    after: dict[str, set[str]] = {n: set() for n in greedy}
    before = dict.fromkeys(greedy, 0)
    for names in lists:
        for a, b in itertools.pairwise(names):
            if b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready = [rank[n] for n in greedy if not before[n]]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        name = greedy[heapq.heappop(ready)]
        out.append(name)
        for b in after[name]:
            before[b] -= 1
            if not before[b]:
                heapq.heappush(ready, rank[b])
    return out if len(out) == len(greedy) else greedy  # a cycle: two lists disagree on an order


def rank_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """Ordered union of every rank's own list (``lists[r]``: rank r's names in model order), the same wherever it is
    computed from the same lists: an order in which every list keeps its order, names no list orders placed by the
    first rank that lists them, then their position in its list (ranks holding consecutive pieces of a model, as
    experts spread over ranks between dense parameters, list them in rank order). Where two lists disagree (a
    cycle), the names in that same key's order."""
    key: dict[str, tuple[int, int]] = {}
    after: dict[str, set[str]] = {}
    before: dict[str, int] = {}
    for r, names in enumerate(lists):
        for i, name in enumerate(names):
            if name not in key:
                key[name], after[name], before[name] = (r, i), set(), 0
        for a, b in itertools.pairwise(names):
            if b not in after[a]:
                after[a].add(b)
                before[b] += 1
    ready = [(k, n) for n, k in key.items() if not before[n]]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        out.append(name)
        for b in after[name]:
            before[b] -= 1
            if not before[b]:
                heapq.heappush(ready, (key[b], b))
    return out if len(out) == len(key) else sorted(key, key=key.__getitem__)


def _greedy_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """Ordered union in one pass: each list's new names go right after the name before them in that list; new
    names before the first name already placed go right before it, and a list that shares no name with the earlier
    ones follows them (ranks holding consecutive pieces of a model, as FSDP1 and ZeRO shard it, list them in rank
    order). A name placed from an earlier list is not moved by a later one."""
    out: list[str] = []
    for names in lists:
        index = {n: i for i, n in enumerate(out)}
        pending: list[str] = []  # new names before this list's first name already placed
        at: int | None = None
        for name in names:
            if name in index:
                if at is None and pending:  # they go right before it
                    pos = index[name]
                    out[pos:pos] = pending
                    index = {n: i for i, n in enumerate(out)}
                    pending = []
                at = index[name] + 1
                continue
            if at is None:
                pending.append(name)
                continue
            out.insert(at, name)
            if at == len(out) - 1:
                index[name] = at
            else:  # inserted before the end: later positions moved
                index = {n: i for i, n in enumerate(out)}
            at += 1
        out += pending  # no name of this list was placed before: after everything so far
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
        def count(descs: Sequence[Desc]) -> int:
            return sum(not d.name.startswith(RESERVED) for d in descs)

        for r, descs in enumerate(all_descs):
            if list(descs) != list(all_descs[0]):
                raise ValueError(
                    f"{who}: the ranks hold different gradient lists (group rank 0: {count(all_descs[0])} gradients, "
                    f"group rank {r}: {count(descs)}, or different dtypes or layouts); pass names= so that "
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
    """The layout the next reduction over ``group`` in ``mode`` uses (:meth:`_GroupLayouts.predict`), or None:
    never agreed, exchange now."""
    state = _CACHE.get((id(group), mode))
    if state is None or state.group is not group or not state.history:
        return None
    return state.predict()


def used(group: Any, mode: str, entry: _Entry) -> None:
    """Record that a call reduced over ``group`` in ``entry``'s layout (what :func:`cached` predicts from)."""
    state = _CACHE.get((id(group), mode))
    if state is not None and state.group is group:
        state.used(entry)


def mark(group: Any, mode: str, layout_id: int) -> None:
    """Note that a reduction in layout ``layout_id`` of ``group`` found that some rank's rows no longer fit it (read
    from its check row by a report): this rank then asks the group to agree again at its next call in it."""
    state = _CACHE.get((id(group), mode))
    if state is not None and state.group is group and layout_id in state.layouts:
        state.layouts[layout_id].marked = True


def exchange(
    group: Any, mode: str, local: list[Desc], tied: Collection[str], who: str, strict: bool = False,
    raw: list[str] | None = None,
) -> _Entry:
    """Exchange every rank's descriptions over ``group`` (one ``all_gather_object``), agree, and remember: as a
    layout the group agreed on before if it is the same one (found by fingerprint), else as a new one. ``raw``:
    this rank's own names in model order, sent along in the same collective and kept (:attr:`_Entry.lists`)."""
    key = (id(group), mode)
    state = _CACHE.get(key)
    if state is None or state.group is not group:
        state = _CACHE[key] = _GroupLayouts(group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (local, sorted(tied), raw), group=group)
    all_tied = frozenset(name for _, names, _ in gathered for name in names)  # one rank's declaration is enough
    try:
        agreed = _agree(mode, [descs for descs, _, _ in gathered], dist.get_rank(group), all_tied, who, strict)
    except ValueError:
        del _CACHE[key]  # raised on every rank alike: every rank starts afresh at its next call
        raise
    entry = next((e for e in state.layouts.values() if e.agreed.fingerprint == agreed.fingerprint), None)
    if entry is None:
        entry = _Entry(agreed, state.next_id)
        state.next_id += 1
        if len(state.layouts) >= _MAX_LAYOUTS:
            state.layouts.pop(next(iter(state.layouts)))
    entry.agreed, entry.marked = agreed, False
    entry.agreed_local = entry.last_local = list(local)
    entry.agreed_tied = entry.tied = frozenset(tied)
    entry.agreed_raw = entry.last_raw = raw
    if raw is not None:
        entry.lists = tuple(tuple(names or ()) for _, _, names in gathered)
        entry.lists_key = hash(entry.lists)  # str hashes are salted per process: a key of this rank's cache only
    state.layouts[entry.layout_id] = entry
    return entry
