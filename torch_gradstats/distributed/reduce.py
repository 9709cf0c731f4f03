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

Communication: for each distinct process group (the explicit ``expert_group`` and ``group``, then every dimension of
every mesh a DTensor gradient lives on, meshes ordered by their ranks, then ``stage_group``: an order every rank
agrees on whatever it holds), exactly one SUM and one MAX ``torch.distributed.all_reduce`` in steady state,
each on one packed buffer holding every parameter that needs that group, never one per parameter. Parameters
sharded over several mesh dimensions are reduced over each dimension's group in turn (sum and max compose). Groups
of one rank are skipped; an explicit group is reduced over even when this rank holds none of its parameters.

Ranks need not hold the same parameters: the rows of each group's buffers follow a layout the group's ranks agree
on (``_layout``), exchanged (``all_gather_object``) on the first call on a group. A rank without a parameter's
gradient adds an empty shard to it. A rank learns of a parameter it does not hold only from the groups it shares with
a holder: a DTensor sharded over several mesh dimensions must have a gradient on all ranks of its mesh or on none.
Every rank also packs *reserved rows*, one per set of groups a row can be reduced over: a gradient the agreed layout
has no row for (a parameter a rank holds for the first time since the group agreed) is summed into the reserved row
of its groups, so the totals of that very call stay exact; :class:`Unattributed` returns them apart from the rows.

No host read in steady state: each buffer's last row is a check row (the layout's fingerprint, whether this rank's
rows differ from those it had when the group agreed, whether it asks to agree again), reduced with the rest and read
by nobody during the call. :meth:`GradStats.report`, which reads the host anyway, reads the flags
(:class:`LayoutCheck`) and marks each changed group. A rank asks in its next reduction over the group, and so does a
rank whose own rows changed since its previous call; the ranks that ask read how many did (the only host read, never
in steady state), and the group agrees again in that same call if all of them asked. So every rank takes the same
branch whatever it read, a rank alone cannot start a collective the others do not, and a layout change is attributed
to its rows from the call after a report on every rank (or at once, when every rank changed together).

The SUM buffer is float64 ``[K, 5]``: sum of squares, the three counts and the local element count (summed, it is
the logical numel, which for plain shards no rank knows from metadata); with an exponent histogram, its 277 counts
per row follow, in the same collective. The MAX buffer is float64 ``[K, 2]``: max |x| and the encoded rank
(``world - rank`` where this rank held a NaN/Inf, else 0), whose maximum names the lowest such rank. Neither grows
with the world size.
Counts travel as float64 because it holds every integer below 2**53 exactly and one buffer means one collective; a
logical parameter would need 2**53 (9e15) elements to break that, which is checked on metadata. NaN and Inf are
carried as counts: a MAX all-reduce need not propagate NaN (gloo does not guarantee it), so after the reduction
every parameter whose reduced NaN count is positive gets NaN for its max |x| and its sum of squares, on every rank.

``rank_nonfinite[p]`` is the lowest global rank whose held part of parameter ``p`` had a NaN/Inf (its shard; for a
Partial gradient, its addend before materialization, so the rank that produced the bad value is named), -1 if none.
A rank sees the ranks it reduces with; replicas (Replicate dimensions, DDP) are not communicated with, so each
replica names itself for its own copy (and a 0-d Partial gradient, materialized as Replicate, names only the rank
itself if its own addend was bad).

Buffers are built and unpacked on the statistics' device; row indices are copied host-to-device from pinned memory
without blocking. The buffers keep a last row for the check, so a rank that holds every row in the agreed order (the
common case) reduces the buffer it packed as it is; the rows are packed again from the inputs only when the group
agrees anew.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from torch_gradstats.distributed import _layout
from torch_gradstats.distributed._layout import Desc
from torch_gradstats.distributed._reduce_plan import (
    dtensor_class,
    materialize_partials,
    plan_steps,
    row_descs,
    spanning_step,
)
from torch_gradstats.distributed._step import (
    AMAX_COL,
    COUNTS_COLS,
    HIST_START,
    NUMEL_COL,
    RANK_COL,
    SUMSQ_COL,
    LayoutCheck,
    Table,
    Unattributed,
    reduce_step,
    reorder,
    unattributed_figures,
)
from torch_gradstats.ops._transfer import host_int64, repeated_int64
from torch_gradstats.ops.op import HISTOGRAM_BUCKETS, INF, NAN

__all__ = ["LayoutCheck", "ReducedStats", "Unattributed", "is_logging_rank", "reduce_across_ranks"]

logger = logging.getLogger("torch_gradstats")

class ReducedStats(NamedTuple):
    """What :func:`reduce_across_ranks` returns: statistics of the whole logical parameters, one row each."""

    sumsq: Tensor  #: float64 ``[P]``
    amax: Tensor  #: float64 ``[P]``
    counts: Tensor  #: int64 ``[P, 3]``: zeros, NaNs, Infs
    #: int64 ``[P]``: the lowest global rank that held a NaN/Inf of each row (-1: none), or None when there was
    #: nothing to reduce
    rank_nonfinite: Tensor | None
    numel: Tensor  #: int64 ``[P]``: logical element count of each parameter
    names: list[str] | None = None  #: the row names (see :func:`reduce_across_ranks`), or None without names
    #: whether each row counts in the figures of the whole model (False: a tied parameter's copy on a later
    #: stage), or None when every row does
    counted: list[bool] | None = None
    #: int64 ``[P, 277]``: each row's exponent histogram, summed like the counts, when one was given
    histogram: Tensor | None = None
    #: figures of gradients the agreed layouts had no row for in this call (in the totals, in no row), or None
    #: when nothing was gathered
    unattributed: Unattributed | None = None
    #: the check rows' flags, for a report to read (None when nothing was gathered, or every group just agreed)
    layout_check: LayoutCheck | None = None


def _resolve_group(group: Any, arg: str) -> Any:
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
                f"reduce_across_ranks: {arg} is a {group.ndim}-D DeviceMesh; pass the process group of the dimension "
                "the plain gradients are sharded over, e.g. mesh.get_group('dp_shard')"
            )
        group = group.get_group()
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"reduce_across_ranks: global rank {dist.get_rank()} is not a member of the {arg} it was given; call it "
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


def _check_names(names: Any, p: int) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"reduce_across_ranks: names must be a sequence of str, got a {type(names).__name__}")
    if len(names) != p or not all(isinstance(n, str) for n in names):
        raise ValueError(f"reduce_across_ranks: names must be {p} strings, one per gradient")
    if len(set(names)) != p:
        raise ValueError("reduce_across_ranks: names must be unique (two parameters would share one row)")
    return list(names)


# Never traced: the layout agreement and its cache are host work (object collectives, Python state), which Dynamo
# cannot trace (DTensor placements crash it); a compiled caller breaks its graph here and runs this eagerly.
@torch.compiler.disable
@torch.no_grad()
def reduce_across_ranks(
    grads: Sequence[Tensor],
    sumsq: Tensor,
    amax: Tensor,
    counts: Tensor,
    group: Any = None,
    *,
    names: Sequence[str] | None = None,
    expert_group: Any = None,
    is_expert: Callable[[str], bool] | None = None,
    stage_group: Any = None,
    tied: Collection[str] = (),
    histogram: Tensor | None = None,
    meshes: Sequence[Any] = (),
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
        names: one unique name per gradient. With names, ranks may hold different gradients: rows are matched by
            name and a gradient missing on a rank counts as an empty shard. Without, every rank of a group must
            hold the same gradients in the same order (checked; a difference is a ValueError on every rank).
        expert_group: process group the plain gradients named by ``is_expert`` are sharded over instead of
            ``group`` (expert parallelism). Needs ``names`` and ``is_expert``.
        is_expert: ``name -> bool``, which gradients are expert parameters.
        stage_group: process group whose ranks hold disjoint parts of the model (pipeline stages): after the
            other reductions, the rows of all its ranks are gathered on each (one SUM and one MAX). A name held
            by several ranks becomes ``name@stage<k>`` (k: rank in ``stage_group``), one row each. Needs
            ``names``.
        tied: names of parameters tied across stages (e.g. a shared embedding): each stage's row is still
            reported, but only the lowest stage's is counted in the figures of the whole model (``counted``).
        histogram: int64 ``[P, 277]``, each gradient's local exponent histogram (the op's histogram overload):
            summed like the counts, as more columns of the same SUM collective.
        meshes: DeviceMeshes of DTensor parameters that have no gradient on this rank: this rank still takes part
            in their dimensions' reductions (:func:`~torch_gradstats.grad_stats` passes them), as the ranks that
            hold gradients on them do.

    Returns:
        A :class:`ReducedStats` ``(sumsq, amax, counts, rank_nonfinite, numel, names, counted)`` of tensors on
        ``sumsq``'s device, identical on every rank that reduced together. ``names`` gives the rows: the agreed
        union of what the ranks hold (with stage suffixes), or ``names`` as given (None if not given) when nothing
        was gathered. ``counted`` says which rows count in the whole model's figures (None: all).
        ``numel`` is each parameter's logical element count: the local counts summed over the same groups as
        everything else. ``unattributed``: the figures of gradients the agreed layouts had no row for in this call
        (in the totals, in no row; zeros in steady state), and ``layout_check``: the flags a report reads to have
        the groups agree again (see the module docstring). ``rank_nonfinite`` is int64 ``[P]``, the lowest global
        rank whose part of each row held a NaN/Inf (-1: none), or None when torch.distributed is not initialized
        and no gradient is a DTensor (nothing to reduce: the same sumsq/amax/counts tensors come back).

    Raises:
        ValueError / TypeError: inconsistent shapes, dtypes or devices (naming the argument), a gradient too
            large for exact float64 counts, a group this rank is not in, a multi-dimensional DeviceMesh, or
            layouts that cannot be reconciled across ranks (the same error on every rank, naming the parameter).
        RuntimeError: a group is given but torch.distributed is not initialized.
    """
    _check_inputs(grads, sumsq, amax, counts)
    p = len(grads)
    if histogram is not None and (histogram.dtype != torch.int64 or histogram.shape != (p, HISTOGRAM_BUCKETS)
                                  or histogram.device != sumsq.device):  # fmt: skip
        raise ValueError(f"reduce_across_ranks: histogram must be int64 of shape [{p}, {HISTOGRAM_BUCKETS}] on "
                         f"{sumsq.device}, got {histogram.dtype} of shape {list(histogram.shape)} on "
                         f"{histogram.device}")
    given_names = _check_names(names, p)
    tied = _check_options(given_names, expert_group, is_expert, stage_group, tied)
    dtensor_cls = dtensor_class() if dist.is_available() else None
    has_dtensor = dtensor_cls is not None and any(isinstance(g, dtensor_cls) for g in grads)
    initialized = dist.is_available() and dist.is_initialized()
    if any(g is not None for g in (group, expert_group, stage_group)) and not initialized:
        raise RuntimeError(
            "reduce_across_ranks: a process group was given but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first, or pass no group"
        )
    if not initialized and not has_dtensor:
        numel = host_int64([g.numel() for g in grads], sumsq.device)
        return ReducedStats(sumsq, amax, counts, None, numel, given_names, histogram=histogram)

    group = _resolve_group(group, "group")
    expert_group = _resolve_group(expert_group, "expert_group")
    stage_group = _resolve_group(stage_group, "stage_group")
    device = sumsq.device
    world, rank = dist.get_world_size(), dist.get_rank()
    strict = given_names is None
    row_names = given_names if given_names is not None else [f"grads[{i}]" for i in range(p)]

    # The rank that produced a NaN/Inf is named from what it held before any materialization.
    local_nonfinite = counts[:, NAN] + counts[:, INF]
    planned, sumsq, amax, counts, histogram = materialize_partials(grads, dtensor_cls, sumsq, amax, counts, histogram)
    explicit: list[tuple[Any, Callable[[str], bool] | None]] = []
    if expert_group is not None and is_expert is not None:
        explicit.append((expert_group, is_expert))
    if group is not None:
        explicit.append((group, None))
    steps, local_numel, masks = plan_steps(planned, row_names, dtensor_cls, explicit, meshes)
    staged = stage_group is not None and dist.get_world_size(stage_group) > 1

    # The reserved rows: one per set of groups a row can be reduced over (and one for the stage gathering), on every
    # rank, so that a gradient the agreed layout has no row for still counts, reduced over its own groups.
    row_masks: list[list[int]] = [[] for _ in range(p)]
    for k, (_, rows) in enumerate(steps):
        for r in rows:
            row_masks[r].append(k)
    labels = [",".join(map(str, m)) for m in masks]
    named_masks = {tuple(m): ",".join(map(str, m)) for m in map(tuple, row_masks)}  # a handful of distinct ones
    row_labels = [named_masks[tuple(m)] for m in row_masks]
    labels += sorted({label for label in named_masks.values() if label} - set(labels))  # none unless plans differ
    reserved = [Desc(_layout.RESERVED + label, torch.float64, None) for label in labels]
    if staged:
        reserved.append(Desc(_layout.RESERVED + "stage", torch.float64, None))
        reserved.append(Desc(_layout.RESERVED_UNCOUNTED, torch.float64, None))

    # One packed float64 SUM buffer (exact integers below 2**53) and one float64 MAX buffer, each with a last row
    # for the layout check.
    numel_col = repeated_int64(local_numel, device).to(torch.float64)  # no copy in steady state
    descs = row_descs(planned, row_names, dtensor_cls, has_dtensor) + reserved
    rows_in_all = p + len(reserved)
    hist_cols = 0 if histogram is None else HISTOGRAM_BUCKETS

    def first_table() -> Table:
        sum_buf = torch.zeros(rows_in_all + 1, HIST_START + hist_cols, dtype=torch.float64, device=device)
        sum_buf[:p, SUMSQ_COL] = sumsq
        sum_buf[:p, COUNTS_COLS] = counts
        sum_buf[:p, NUMEL_COL] = numel_col
        if histogram is not None:
            sum_buf[:p, HIST_START:] = histogram
        max_buf = torch.zeros(rows_in_all + 1, 2, dtype=torch.float64, device=device)
        max_buf[:p, AMAX_COL] = amax
        max_buf[:p, RANK_COL] = (local_nonfinite > 0).to(torch.float64) * (world - rank)
        return Table(sum_buf, max_buf, descs, [True] * rows_in_all)

    table = first_table()
    remake: Callable[[], Table] | None = first_table  # only the first step reduces the caller's rows
    checks: list[tuple[Any, str, int, Tensor]] = []
    unplaced: list[str] = []  # this rank's gradients the layouts had no row for (their figures: unattributed)
    mode = "shard" if not strict else "shard:unnamed"  # unnamed rows are matched by position: a layout of their own

    def upstream() -> Tensor | None:  # whether an earlier step of this call found a change (a device flag)
        return torch.stack([c[3] for c in checks]).sum(dtype=torch.float64) if checks else None

    segments: list[list[str]] = []  # each step's agreed rows, in its group's order (the model order they imply)
    # With several groups, one that holds the ranks of all the others carries every rank's own list when it agrees:
    # the rows' order is made from those alone, the same on every rank.
    span = spanning_step(steps) if not staged and given_names is not None else None
    lists: list[tuple[int, tuple[tuple[str, ...], ...]]] = []
    for k, (pg, rows) in enumerate(steps):
        # Rows move as earlier steps reorder the table (and add rows other ranks held): follow them by name.
        where = {d.name: i for i, d in enumerate(table.descs)}
        own = [where[_layout.RESERVED + label] for label, m in zip(labels, masks) if k in m]
        reserved_at = {label: where[_layout.RESERVED + label] for label in labels}
        sinks = [reserved_at[row_labels[r]] for r in rows]
        step_rows = [where[row_names[r]] for r in rows] + own
        not_reduced = len(table.descs) - len(step_rows)
        table, check = reduce_step(table, pg, mode, step_rows, sinks + own, (),
                                   strict, remake, upstream(), unplaced_names=unplaced,
                                   raw=row_names if k == span else None,
                                   lists_out=lists if k == span else None)
        segments.append([d.name for d in table.descs[: len(table.descs) - not_reduced]])  # the agreed rows lead
        checks += [check] if check is not None else []
        remake = None
    if staged:  # its agreed order (stage by stage) is the same on every rank
        everything = list(range(len(table.descs)))
        names_now = [d.name for d in table.descs]
        sink, uncounted = names_now.index(_layout.RESERVED + "stage"), names_now.index(_layout.RESERVED_UNCOUNTED)
        table, check = reduce_step(table, stage_group, "stage", everything, [sink] * len(everything), tied, strict,
                                   remake, upstream(), uncounted, unplaced)
        checks += [check] if check is not None else []
    elif steps:  # back to model order: from every rank's list (``span``), or this rank's and its groups' orders
        table = reorder(table, row_names, segments, lists[0] if lists else None)
    gathered = bool(steps) or staged
    if gathered:
        logger.debug("reduce_across_ranks: %d local parameters, %d rows, %d step(s)", p, len(table.descs), len(steps))

    sum_buf, max_buf = table.sum_buf[: len(table.descs)], table.max_buf[: len(table.descs)]
    row_descs_out, counted_out, unattributed = table.descs, table.counted, None
    # The reserved rows' figures count in the totals, except those of tied copies another stage counts.
    spare = [i for i, d in enumerate(table.descs)
             if d.name.startswith(_layout.RESERVED) and not d.name.startswith(_layout.RESERVED_UNCOUNTED)]
    if spare:
        real = [i for i, d in enumerate(table.descs) if not d.name.startswith(_layout.RESERVED)]
        if spare == list(range(spare[0], spare[-1] + 1)):  # the usual case: the reserved rows side by side
            res_sum, res_max = sum_buf[spare[0]:spare[-1] + 1], max_buf[spare[0]:spare[-1] + 1]
        else:
            take = repeated_int64(spare, device)
            res_sum, res_max = sum_buf.index_select(0, take), max_buf.index_select(0, take)
        if real == list(range(len(real))):  # the reserved rows last: the usual case
            sum_buf, max_buf = sum_buf[: len(real)], max_buf[: len(real)]
        else:
            keep = repeated_int64(real, device)
            sum_buf, max_buf = sum_buf.index_select(0, keep), max_buf.index_select(0, keep)
        row_descs_out = [table.descs[i] for i in real]
        counted_out = [table.counted[i] for i in real]
        unattributed = unattributed_figures(res_sum.sum(0), res_max.amax(0), histogram is not None, unplaced)

    counts_out = sum_buf[:, COUNTS_COLS].to(torch.int64)
    has_nan = counts_out[:, NAN] > 0
    nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
    sumsq_out = torch.where(has_nan, nan, sum_buf[:, SUMSQ_COL])
    amax_out = torch.where(has_nan, nan, max_buf[:, AMAX_COL])  # NaN need not survive a MAX; the count does
    encoded = max_buf[:, RANK_COL].to(torch.int64)
    rank_nonfinite = torch.where(encoded > 0, world - encoded, -1)
    numel_out = sum_buf[:, NUMEL_COL].to(torch.int64)
    hist_out = sum_buf[:, HIST_START:].to(torch.int64) if histogram is not None else None
    out_names = [d.name for d in row_descs_out] if (gathered and given_names is not None) else given_names
    counted = None if all(counted_out) else counted_out
    layout_check = None
    if checks:
        flags = torch.stack([c[3] for c in checks]).to(torch.int64)
        layout_check = LayoutCheck(flags, [(c[0], c[1], c[2]) for c in checks])
    return ReducedStats(sumsq_out, amax_out, counts_out, rank_nonfinite, numel_out, out_names, counted, hist_out,
                        unattributed, layout_check)


def _check_options(
    names: list[str] | None, expert_group: Any, is_expert: Any, stage_group: Any, tied: Any
) -> frozenset[str]:
    if is_expert is not None and not callable(is_expert):
        raise TypeError(
            f"reduce_across_ranks: is_expert must be a callable name -> bool, got a {type(is_expert).__name__}"
        )
    if (expert_group is None) != (is_expert is None):
        raise ValueError("reduce_across_ranks: expert_group and is_expert go together: pass both or neither")
    if isinstance(tied, str) or not isinstance(tied, Collection) or not all(isinstance(t, str) for t in tied):
        raise TypeError("reduce_across_ranks: tied must be a collection of parameter names (str)")
    if tied and stage_group is None:
        raise ValueError("reduce_across_ranks: tied names parameters shared by pipeline stages; pass stage_group too")
    if names is None and (expert_group is not None or stage_group is not None):
        raise ValueError("reduce_across_ranks: expert_group and stage_group match parameters by name; pass names=")
    return frozenset(tied)


def is_logging_rank(stage_group: Any = None, *, group: Any = None, rank: int | None = None) -> bool:
    """Whether this process is the one that logs reports (one rank logs; the figures are the same on every rank).

    Args:
        stage_group: the pipeline-stage group passed to ``grad_stats``: the logging rank is then on the last stage
            (where the loss is computed, as torchtitan and Megatron log).
        group: the group the stage's parameters are sharded over (data/shard parallel): among the last stage's
            ranks, its first rank logs.
        rank: a global rank chosen by the user; overrides the rule above.

    Returns:
        True on exactly one rank of each pipeline (with ``stage_group`` and ``group`` covering every other
        dimension, exactly one rank in all): ``rank`` if given; else, with a ``stage_group``, the last rank of
        ``stage_group`` that is also the first of ``group`` (if given); else global rank 0. Always True when
        torch.distributed is not initialized. No communication.
    """
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)):
        raise TypeError(f"is_logging_rank: rank must be an int (a global rank), got a {type(rank).__name__}")
    if rank is not None and rank < 0:  # no world has it: refused with or without torch.distributed
        raise ValueError(f"is_logging_rank: rank must be a global rank >= 0, got {rank}")
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if rank is not None:
        if not 0 <= rank < dist.get_world_size():
            raise ValueError(f"is_logging_rank: rank must be in [0, {dist.get_world_size()}), got {rank}")
        return dist.get_rank() == rank
    if stage_group is None:
        return dist.get_rank() == 0
    stage_group = _resolve_group(stage_group, "stage_group")
    group = _resolve_group(group, "group")
    last_stage = dist.get_rank(stage_group) == dist.get_world_size(stage_group) - 1
    return last_stage and (group is None or dist.get_rank(group) == 0)
