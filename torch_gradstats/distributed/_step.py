"""One reduction step of :func:`~torch_gradstats.distributed.reduce_across_ranks`: the rows reduced over one process
group, packed in the group's agreed layout (``_layout``), with the layout's check row and the reserved rows.

Split from ``reduce`` because it is a job of its own: ``reduce`` decides what is reduced over which group and
unpacks the result; this module packs, reduces and keeps the layout right (see the ``reduce`` module docstring for
the protocol: no host read in steady state, reserved rows for what the layout has no row for).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.distributed import _layout
from torch_gradstats.distributed._layout import Desc
from torch_gradstats.ops._transfer import host_int64, repeated_int64, to_host
from torch_gradstats.ops.op import NAN

__all__ = ["LayoutCheck", "Table", "Unattributed", "reduce_step", "reorder", "unattributed_figures"]

logger = logging.getLogger("torch_gradstats")

# Columns of the packed SUM buffer: the sum of squares, the three counts, the local numel, then any histogram.
SUMSQ_COL = 0
COUNTS_COLS = slice(1, 4)
NUMEL_COL = 4
HIST_START = 5
# Columns of the packed MAX buffer: max |x|, then the encoded rank (world - rank where this rank held a NaN/Inf,
# else 0): its MAX names the lowest such rank, in a column whose size does not depend on the world.
AMAX_COL = 0
RANK_COL = 1


class Unattributed(NamedTuple):
    """Figures of gradients the agreed layout had no row for in this call (a parameter a rank holds for the first
    time since the group last agreed, see the module docstring): in the totals of the whole model, in no row."""

    sumsq: Tensor  #: float64 0-d (NaN when a NaN is among them)
    amax: Tensor  #: float64 0-d (NaN when a NaN is among them)
    counts: Tensor  #: int64 ``[3]``: zeros, NaNs, Infs
    numel: Tensor  #: int64 0-d
    histogram: Tensor | None  #: int64 ``[277]`` when a histogram was given
    #: the names of this rank's gradients among them, known on the host (empty in steady state)
    local_names: tuple[str, ...] = ()


class LayoutCheck(NamedTuple):
    """What a call's check rows say, for :meth:`GradStats.report` to read in its one transfer (nothing waits for
    them before): per group reduced over, whether some rank packed rows the group's layout has no place for."""

    changed: Tensor  #: int64 ``[S]``, one per group: 1 where the layout must be agreed again
    groups: list[tuple[Any, str, int]]  #: (group, layout mode, layout id), one per flag

    def note(self, changed: Sequence[int]) -> None:
        """Given the flags as read on the host: ask each changed group to agree again at its next reduction."""
        for flag, (group, mode, layout_id) in zip(changed, self.groups):
            if flag:
                _layout.mark(group, mode, layout_id)


class Table(NamedTuple):
    """The rows a rank holds while reducing: packed SUM and MAX buffers, with a name and description per row.

    The buffers have one more row than ``descs``, the last: the slot of the layout check row, so that a table
    that needs no repacking is reduced as it is, without a copy to append the check row."""

    sum_buf: Tensor  # float64 [R + 1, 5 (+ 277 with a histogram)]
    max_buf: Tensor  # float64 [R + 1, 2]
    descs: list[Desc]
    counted: list[bool]  # False: a tied parameter's copy, reported but not counted in the whole model's figures


# The check row's columns: the layout fingerprint (SUM and MAX), whether this rank's rows differ from those it had
# when the group agreed (SUM), whether this rank asks the group to agree again (SUM).
_CHECK_FP, _CHECK_DIRTY, _CHECK_ASKED = 0, 1, 2


def reduce_step(
    table: Table, pg: Any, mode: str, rows: list[int], sinks: list[int], tied: Collection[str], strict: bool,
    remake: Callable[[], Table] | None = None, upstream: Tensor | None = None, uncounted_sink: int | None = None,
    unplaced_names: list[str] | None = None, raw: list[str] | None = None,
    lists_out: list[tuple[int, tuple[tuple[str, ...], ...]]] | None = None,
) -> tuple[Table, tuple[Any, str, int, Tensor] | None]:
    """Reduce ``rows`` of ``table`` over ``pg`` in the group's agreed layout: one SUM and one MAX, no host read.

    ``sinks[k]``: the table row (a reserved one, also among ``rows``) that takes ``rows[k]``'s figures if the layout
    has no place for it; ``uncounted_sink``: the one that takes a tied parameter's copy another stage already holds
    (stage mode). ``remake``: makes ``table`` again (from the caller's inputs). With it, a table that needs no
    repacking is reduced in place, and made again if the group agrees anew; without it, such a table is copied.
    ``upstream``: a device flag, positive when an earlier step of this call found a layout change (a change there
    changes the rows here too, so this group's check says so as well). ``unplaced_names`` gets the names of the
    rows the layout had no place for. ``raw``: this rank's own names in model order, sent when the group agrees
    and part of what the check row compares, like the rows; ``lists_out`` then gets every rank's list as the group
    last agreed (a digest and the lists, see :func:`reorder`).

    Rows without names (``strict``) are matched by position, so there every rank reads the check row at every
    call, and a difference is the same ValueError on every rank at once.

    Returns the new table (the agreed rows in the agreed order, including rows other ranks hold and this one does
    not, then the rows not reduced over ``pg``) and, unless the group has just agreed, ``(pg, mode, layout id,
    changed)``: the device flag a report reads (see :class:`LayoutCheck`).
    """
    device = table.sum_buf.device
    local = [table.descs[i] for i in rows]
    tied = frozenset(tied)
    group_size = dist.get_world_size(pg)
    entry = _layout.cached(pg, mode)
    fresh = entry is None
    while True:
        if entry is None:
            entry = _layout.exchange(pg, mode, local, tied, "reduce_across_ranks", strict, raw)
        agreed = entry.agreed
        n = len(agreed.names)
        positions = agreed.positions(local)
        unplaced = [k for k, pos in enumerate(positions) if pos is None]
        identity = not unplaced and n == len(table.descs) and rows == positions == list(range(n))
        if identity:  # the common case: this rank holds every row, in the agreed order; the last row is the slot
            in_place = remake is not None
            sub_sum = table.sum_buf if in_place else table.sum_buf.clone()
            sub_max = table.max_buf if in_place else table.max_buf.clone()
        else:
            sub_sum = torch.zeros(n + 1, table.sum_buf.shape[1], dtype=torch.float64, device=device)
            sub_max = torch.zeros(n + 1, table.max_buf.shape[1], dtype=torch.float64, device=device)
            placed = [(r, pos) for r, pos in zip(rows, positions) if pos is not None]
            if placed:
                src = repeated_int64([r for r, _ in placed], device)  # the same every call in steady state
                dst = repeated_int64([pos for _, pos in placed], device)
                sub_sum.index_copy_(0, dst, table.sum_buf.index_select(0, src))
                sub_max.index_copy_(0, dst, table.max_buf.index_select(0, src))
            if unplaced:
                _pack_unplaced(table, sub_sum, sub_max, rows, positions, unplaced,
                               _sinks(local, rows, sinks, unplaced, agreed, tied, uncounted_sink, pg))
        # The check row. The fingerprint is scaled so that its sum over the group stays below 2**52: exact in
        # float64 at any group size.
        fp = agreed.fingerprint % (2**52 // group_size)
        # Where the call sends its own list, a change of it is a change of the layout too: the order of the rows
        # is made from the lists the group last agreed with.
        raw_changed = raw is not None and raw != entry.last_raw
        rows_changed = local != entry.last_local or tied != entry.tied or raw_changed
        sub_sum[n, _CHECK_FP] = float(fp)
        sub_sum[n, _CHECK_DIRTY] = float(local != entry.agreed_local or tied != entry.agreed_tied
                                         or (raw is not None and raw != entry.agreed_raw))
        if upstream is not None and not fresh:
            sub_sum[n, _CHECK_DIRTY] += upstream
        # A rank asks the group to agree again when its report saw that the layout no longer fits, or when its
        # own rows (or tied names) changed since its last call (then it reads one value: not the steady state).
        asking = entry.marked or rows_changed
        entry.last_local, entry.tied, entry.marked = local, tied, False
        if raw is not None:
            entry.last_raw = raw
        sub_sum[n, _CHECK_ASKED] = float(asking)
        sub_max[n, _CHECK_FP] = float(fp)
        dist.all_reduce(sub_sum, op=dist.ReduceOp.SUM, group=pg)
        dist.all_reduce(sub_max, op=dist.ReduceOp.MAX, group=pg)
        if fresh:
            break  # every rank of the group has just agreed on this layout
        if strict:  # every rank reads: rows matched by position must agree now, or raise now
            (fp_sum, dirty, fp_max), _ = to_host([sub_sum[n, :2], sub_max[n, :1]], [])
            agree_again = dirty > 0 or fp_sum != fp_max * group_size
        elif asking:
            # Only the ranks that asked read how many did, and the group agrees again only if all of them did:
            # every rank takes the same branch. (All ranks ask at once when they all changed, e.g. a new list.)
            (asked,), _ = to_host([sub_sum[n, _CHECK_ASKED:_CHECK_ASKED + 1]], [])
            agree_again = asked == group_size
            if not agree_again:
                logger.debug("reduce_across_ranks: %d of %d ranks asked to agree on the layout again; rows it has "
                             "no place for count in the totals only until every rank asks (a report or "
                             "check_layout() on every rank makes them)", int(asked), group_size)
        else:
            agree_again = False  # no host read: whether the layout still fits is read by a report, from the flag
        if not agree_again:
            break
        logger.debug("reduce_across_ranks: a rank's parameter layout changed; agreeing on the layout again")
        entry, fresh = None, True
        if identity and remake is not None:  # the reduction overwrote this rank's rows: pack them anew
            table = remake()
    if lists_out is not None and entry.lists is not None:
        lists_out.append((entry.lists_key, entry.lists))
    if unplaced_names is not None:
        unplaced_names.extend(local[k].name for k in unplaced if not local[k].name.startswith(_layout.RESERVED))
    check = None
    if not fresh:
        changed = (sub_sum[n, _CHECK_DIRTY] > 0) | (sub_sum[n, _CHECK_FP] != sub_max[n, _CHECK_FP] * group_size)
        check = (pg, mode, entry.layout_id, changed)
    _layout.used(pg, mode, entry)
    held = set(rows)
    rest = [i for i in range(len(table.descs)) if i not in held]
    if rest:
        keep = repeated_int64(rest, device)
        sum_buf = torch.cat([sub_sum[:n], table.sum_buf.index_select(0, keep), sub_sum[n:]])
        max_buf = torch.cat([sub_max[:n], table.max_buf.index_select(0, keep), sub_max[n:]])
    else:
        sum_buf, max_buf = sub_sum, sub_max
    descs = list(agreed.descs) + [table.descs[i] for i in rest]
    return Table(sum_buf, max_buf, descs, list(agreed.counted) + [table.counted[i] for i in rest]), check


def _sinks(local: list[Desc], rows: list[int], sinks: list[int], unplaced: list[int], agreed: _layout.Agreed,
           tied: frozenset[str], uncounted_sink: int | None, pg: Any) -> list[int]:
    """The table row each unplaced row goes to: its reserved row, or the uncounted one for a copy of a tied
    parameter that another stage already holds (that stage's copy is the one counted, as for any tied copy)."""
    out = [sinks[k] for k in unplaced]
    if uncounted_sink is None:
        return out
    me, all_tied = dist.get_rank(pg), tied | agreed.tied
    for i, k in enumerate(unplaced):
        name = local[k].name
        if name in all_tied and any(r != me for r in agreed.holders.get(name, ())):
            out[i] = uncounted_sink
    return out


def _pack_unplaced(table: Table, sub_sum: Tensor, sub_max: Tensor, rows: list[int], positions: list[int | None],
                   unplaced: list[int], to_rows: list[int]) -> None:
    """Sum (max) the rows the layout has no place for into the reserved rows ``to_rows`` (table rows, one each):
    in the totals this call, in no row yet."""
    where = dict(zip(rows, positions))
    # A reserved row is on every rank at every agreement, so it has a place; should it have none (the ranks planned
    # different steps), any placed one keeps the figures in the totals.
    spare = next((pos for r in to_rows if (pos := where.get(r)) is not None), 0)
    device = sub_sum.device
    src = host_int64([rows[k] for k in unplaced], device)
    dst = host_int64([pos if (pos := where.get(r)) is not None else spare for r in to_rows], device)
    sub_sum.index_add_(0, dst, table.sum_buf.index_select(0, src))
    sub_max.scatter_reduce_(0, dst[:, None].expand(-1, sub_max.shape[1]), table.max_buf.index_select(0, src), "amax")


#: (table rows (names, in order), the length of each step's agreed rows) -> the order they are reported in; see
#: :func:`reorder`.
_ORDERS: OrderedDict[tuple[tuple[str, ...], tuple[int, ...], int | None], list[int]] = OrderedDict()
_ORDERS_MAX = 16


def reorder(table: Table, row_names: list[str], segments: Sequence[Sequence[str]] = (),
            lists: tuple[int, Sequence[Sequence[str]]] | None = None) -> Table:
    """The table's rows in model order: this rank's rows (``row_names``) in their order, each other rank's row in
    its place among them, as the order each step's group agreed on (``segments``: one list of row names per step)
    places it; one step's rows are not ordered against another's by their place in the table, where steps follow
    one another. Every rank must report the same order, and the order of a rank's own rows changes only where its
    holdings do, which the group's layout may not have followed yet (no host read in steady state); so the order is
    kept per set of table rows, made the first time they are seen (when the group has just agreed on them, every
    rank's rows fit the agreed order), and reused after.

    ``lists``: (a digest, every rank's own list, as a group that holds the ranks of all the steps' groups last
    agreed): the order is then :func:`_layout.rank_order` of those lists, a function of what every rank holds alone,
    so the same on every rank whatever each one sees (rows no list names, the reserved ones, after)."""
    names = tuple(d.name for d in table.descs)
    key = (names, tuple(len(s) for s in segments), lists[0] if lists is not None else None)
    order = _ORDERS.get(key)
    if order is None:
        where = {n: i for i, n in enumerate(names)}
        if lists is not None:
            merged = [n for n in _layout.rank_order(lists[1]) if n in where]
        else:
            merged = _layout.merge_order([[n for n in row_names if n in where], *(list(s) for s in segments)])
        placed = set(merged)
        order = [where[n] for n in merged] + [i for i, n in enumerate(names) if n not in placed]
        _ORDERS[key] = order
        while len(_ORDERS) > _ORDERS_MAX:
            _ORDERS.popitem(last=False)
    _ORDERS.move_to_end(key)
    if order == list(range(len(order))):
        return table
    idx = repeated_int64(order + [len(order)], table.sum_buf.device)  # and the check row's slot
    descs = [table.descs[i] for i in order]
    counted = [table.counted[i] for i in order]
    return Table(table.sum_buf.index_select(0, idx), table.max_buf.index_select(0, idx), descs, counted)


def unattributed_figures(sums: Tensor, maxes: Tensor, histogram: bool, local_names: Sequence[str]) -> Unattributed:
    """The reserved rows' figures, summed (``sums``: a SUM buffer row) and maxed (``maxes``: a MAX buffer row)."""
    counts = sums[COUNTS_COLS].to(torch.int64)
    has_nan = counts[NAN] > 0
    nan = torch.full((), float("nan"), dtype=torch.float64, device=sums.device)
    return Unattributed(
        torch.where(has_nan, nan, sums[SUMSQ_COL]), torch.where(has_nan, nan, maxes[AMAX_COL]), counts,
        sums[NUMEL_COL].to(torch.int64), sums[HIST_START:].to(torch.int64) if histogram else None,
        tuple(dict.fromkeys(local_names)),
    )
