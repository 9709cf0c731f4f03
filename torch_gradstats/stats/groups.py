"""Per-group figures (per layer, per block, per module...) from per-parameter statistics already on the device.

:meth:`GradStats.grouped(by) <torch_gradstats.GradStats.grouped>` sums the per-parameter results of the one read
into groups: no second read of the gradients, and one scatter-style op per figure (``index_add_`` for the sum of
squares, the three counts and the element counts; ``scatter_reduce`` for max |x|), whatever the number of groups.
The index tensor that maps parameters to groups is made once per (names, ``by``, device) and kept, so a training
loop that groups every step pays only those ops. Nothing here waits for the device until :meth:`GroupStats.report`,
which makes one device-to-host transfer.

``by`` is one of:

* ``"layer"``: numbered blocks found in the name: the outermost ``<container>.<number>`` (``layers.3``, ``h.3``,
  ``blocks.3``, ``encoder.layer.3``; ``layers.0.mlp.0.weight`` is in ``layers.0``); a parameter outside every
  numbered container is grouped by the path of the module that owns it (``model.embed_tokens.weight`` in
  ``model.embed_tokens``, ``lm_head.weight`` in ``lm_head``); a parameter held by the root module itself (a name
  without a dot) is a group of its own, named as the parameter;
* an ``int`` ``d >= 1``: the first ``d`` parts of the owning module's path (``1``: ``model``, ``lm_head``); a
  parameter whose module path is shorter keeps its whole module path, and a root parameter its own name;
* a regular expression (a ``str`` other than ``"layer"``, or a compiled pattern), applied with ``re.search``: its
  first capture group names the group (the whole match if it has no group); a name it does not match is left out;
* a callable ``name -> str | None``: the group's name, or None to leave the parameter out.

Groups are named and ordered as first seen in the parameters' order. Grouping works on any per-parameter figures,
including those already reduced across ranks (``grad_stats(..., group=)`` or a DTensor model, or a
:class:`~torch_gradstats.distributed.ReducedStats` with ``names=``): a group's figures are then those of its whole
logical parameters, and grouping adds no collective.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import host_int64, to_host
from torch_gradstats.ops.op import INF, NAN, ZERO
from torch_gradstats.stats.report import GroupReport

__all__ = ["GroupBy", "GroupReport", "GroupStats", "group_names", "group_stats", "group_sums"]

#: What ``grouped(by)`` accepts (see the module docstring).
GroupBy = str | int | re.Pattern[str] | Callable[[str], "str | None"]

# ``name.<digits>`` as a dotted component: ``layers.3``, ``h.3``; ``layer3`` or ``3d`` are not numbered blocks.
_NUMBERED = re.compile(r"(?:^|\.)\d+(?=\.|$)")


class PerParam(Protocol):
    """Per-parameter figures as :class:`~torch_gradstats.GradStats` holds them (a ReducedStats has them too)."""

    @property
    def sumsq(self) -> Tensor: ...

    @property
    def amax(self) -> Tensor: ...

    @property
    def counts(self) -> Tensor: ...

    @property
    def numel(self) -> Tensor: ...


class _Rows(NamedTuple):
    """Some rows of per-parameter figures."""

    sumsq: Tensor
    amax: Tensor
    counts: Tensor
    numel: Tensor


# ---------------------------------------------------------------------------------------------- naming
def _module_path(name: str) -> str | None:
    head, dot, _ = name.rpartition(".")
    return head if dot else None


def _layer_group(name: str) -> str:
    m = _NUMBERED.search(name)  # the first number is the outermost container's (a leading one: nn.Sequential's)
    if m is not None:
        return name[: m.end()]
    return _module_path(name) or name


def _resolver(by: GroupBy) -> Callable[[str], str | None]:
    if isinstance(by, bool):
        raise TypeError(f"grouped: by must be 'layer', an int, a regex or a callable, got {by!r}")
    if isinstance(by, (int, numbers.Integral)):  # numpy's too
        if by < 1:
            raise ValueError(f"grouped: by as an int is a module-path depth and must be >= 1, got {by}")
        depth = int(by)

        def at_depth(name: str) -> str:
            path = _module_path(name)
            return name if path is None else ".".join(path.split(".")[:depth])

        return at_depth
    if isinstance(by, str) and by == "layer":
        return _layer_group
    if isinstance(by, (str, re.Pattern)):
        try:
            pattern = re.compile(by)
        except re.error as exc:
            raise ValueError(f"grouped: by {by!r} is not a valid regular expression ({exc})") from None

        def by_regex(name: str) -> str | None:
            m = pattern.search(name)
            if m is None:
                return None
            return m.group(1) if pattern.groups else m.group(0)

        return by_regex
    if callable(by):
        return by
    raise TypeError(
        f"grouped: by must be 'layer', an int (module-path depth), a regex (str or re.Pattern) or a callable "
        f"name -> group | None, got a {type(by).__name__}"
    )


def group_names(names: Sequence[str], by: GroupBy) -> tuple[list[str], list[int]]:
    """The groups of ``names`` under ``by``, in first-seen order, and each name's group index (-1: left out)."""
    resolve = _resolver(by)
    groups: dict[str, int] = {}
    index: list[int] = []
    for name in names:
        g = resolve(name)
        if g is None:
            index.append(-1)
            continue
        if not isinstance(g, str):
            raise TypeError(f"grouped: by({name!r}) returned a {type(g).__name__}; expected a str or None")
        index.append(groups.setdefault(g, len(groups)))
    return list(groups), index


# (names, by, device) -> (group names, device index with left-out parameters in a last, discarded slot, members)
_Index = tuple[list[str], Tensor, dict[str, str]]
_INDEX: OrderedDict[tuple[Any, ...], _Index] = OrderedDict()
_INDEX_MAX = 16
_INDEX_LOCK = threading.Lock()


def _index(names: Sequence[str], by: GroupBy, device: torch.device) -> _Index:
    """The groups of ``names``, the index tensor on ``device`` and the members, kept for the next call alike."""
    if isinstance(by, bool):  # True == 1: refused before it could hit the cache as a depth
        _resolver(by)
    key: tuple[Any, ...] | None = (tuple(names), type(by), by, device)
    try:
        hash(key)
    except TypeError:  # an unhashable callable: made every time
        key = None
    if key is not None:
        with _INDEX_LOCK:
            hit = _INDEX.get(key)
            if hit is not None and hit[1]._version == 0:
                _INDEX.move_to_end(key)
                return hit
    groups, index = group_names(names, by)
    spare = len(groups)
    members = {n: groups[i] for n, i in zip(names, index) if i >= 0}
    with torch.inference_mode(False):  # kept: an inference tensor has no _version, and later calls read it
        made = (groups, host_int64([i if i >= 0 else spare for i in index], device), members)
    if key is not None:
        with _INDEX_LOCK:
            _INDEX[key] = made
            while len(_INDEX) > _INDEX_MAX:
                _INDEX.popitem(last=False)
    return made


def _scatter_sum(values: Tensor, index: Tensor, slots: int) -> Tensor:
    out = torch.zeros((slots, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, index, values)


# ---------------------------------------------------------------------------------------------- GroupStats
@dataclass
class GroupStats:
    """Per-group figures as device tensors (no host sync to make or read them), one row per group.

    Attributes:
        names: the groups, in first-seen order.
        sumsq: float64 ``[G]``: sum of squares of the group's gradients (NaN if one holds a NaN).
        amax: float64 ``[G]``: max |g| over the group (NaN if the group holds a NaN).
        counts: int64 ``[G, 3]``: zeros, NaNs and Infs.
        numel: int64 ``[G]``: elements in the group.
        members: parameter name -> group, for the parameters grouped (the others are left out).
        weight_sumsq: float64 ``[G]``, sum of squares of the group's weights (from ``grad_and_weight_stats``).
        lr_update_sumsq: float64 ``[G]``: ``sum(lr_p**2 * ||g_p||**2)``, the squared norm of the group's plain SGD
            update (a parameter the optimizer does not hold counts 0: it is not updated); with an optimizer.
        delta_sumsq, update_weight_sumsq: float64 ``[G]``: ``||Δw||²`` and ``||w_after||²`` of a measured update,
            over the same parameters as ``weight_sumsq`` (those with a gradient).
        measured: the groups holding a parameter of the measured update (None: every group); the report gives
            update ratios for these only: a group with gradients but nothing measured (a layer not yet given to the
            optimizer, or to the ``UpdateRatio``) has no ratio rather than 0.
        source: the per-parameter statistics the groups were made from (a ``GradStats``, by its ``grouped``), whose
            totals cover the parameters no group holds too; None when made otherwise.
    """

    names: list[str]
    sumsq: Tensor
    amax: Tensor
    counts: Tensor
    numel: Tensor
    members: dict[str, str]
    weight_sumsq: Tensor | None = None
    lr_update_sumsq: Tensor | None = None
    delta_sumsq: Tensor | None = None
    update_weight_sumsq: Tensor | None = None
    measured: frozenset[str] | None = None
    source: object | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def device(self) -> torch.device:
        return self.sumsq.device

    @property
    def norms(self) -> Tensor:
        """float64 ``[G]``: L2 norm of each group's gradients."""
        return self.sumsq.sqrt()

    @property
    def nonfinite_counts(self) -> Tensor:
        """int64 ``[G]``: NaN and Inf elements of each group."""
        return self.counts[:, NAN] + self.counts[:, INF]

    def report(self) -> GroupReport:
        """Every figure on the host in ONE device-to-host transfer."""
        if self.sumsq.device.type == "meta":
            raise ValueError(
                "GroupStats.report: these figures are of meta tensors, which have shapes but no values; compute them "
                "on gradients with data"
            )
        return self._from_host(*to_host(*self._host_parts()))

    def _host_parts(self) -> tuple[list[Tensor], list[Tensor]]:
        """The float and int tensors one transfer carries (a GradStats report takes them along in its own)."""
        extras = [t for t in (self.weight_sumsq, self.lr_update_sumsq, self.delta_sumsq, self.update_weight_sumsq)
                  if t is not None]
        return [self.sumsq, self.amax, *extras], [self.counts, self.numel]

    def _from_host(self, floats: Sequence[float], ints: Sequence[int]) -> GroupReport:
        g = len(self.names)
        rows = iter([list(floats[i * g:(i + 1) * g]) for i in range(len(floats) // g if g else 0)])
        sumsq, amax = (next(rows), next(rows)) if g else ([], [])
        wsumsq = next(rows) if g and self.weight_sumsq is not None else None
        lrsumsq = next(rows) if g and self.lr_update_sumsq is not None else None
        dsumsq = next(rows) if g and self.delta_sumsq is not None else None
        usumsq = next(rows) if g and self.update_weight_sumsq is not None else None
        out = GroupReport(
            norms=dict(zip(self.names, map(_sqrt, sumsq))),
            max_abs=dict(zip(self.names, amax)),
            zero_counts={n: ints[3 * i + ZERO] for i, n in enumerate(self.names)},
            nan_counts={n: ints[3 * i + NAN] for i, n in enumerate(self.names)},
            inf_counts={n: ints[3 * i + INF] for i, n in enumerate(self.names)},
            numel=dict(zip(self.names, ints[3 * g:4 * g])),
        )
        if self.weight_sumsq is not None:
            out.weight_norms = dict(zip(self.names, map(_sqrt, wsumsq or [])))
            if self.lr_update_sumsq is not None:
                out.lr_update_ratios = {n: norm_ratio(u, w) for n, u, w in zip(self.names, lrsumsq or [], wsumsq or [])}
        if self.delta_sumsq is not None and self.update_weight_sumsq is not None:
            out.update_ratios = {n: norm_ratio(d, w) for n, d, w in zip(self.names, dsumsq or [], usumsq or [])
                                 if self.measured is None or n in self.measured}
        return out


def _sqrt(x: float) -> float:
    return math.sqrt(x) if not math.isnan(x) else math.nan


def norm_ratio(num_sumsq: float, den_sumsq: float) -> float:
    """``sqrt(num) / sqrt(den)`` from two sums of squares; NaN if either is NaN, 0 for 0/0, inf for a nonzero change
    of an all-zero tensor (also used by :mod:`torch_gradstats.monitors.updates` per parameter)."""
    if math.isnan(num_sumsq) or math.isnan(den_sumsq):
        return math.nan
    num, den = math.sqrt(num_sumsq), math.sqrt(den_sumsq)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---------------------------------------------------------------------------------------------- grouping
def group_stats(stats: PerParam, by: GroupBy, *, names: Sequence[str] | None = None) -> GroupStats:
    """Group per-parameter figures (a ``GradStats``, or a ``ReducedStats`` with ``names``) by ``by``; no sync.

    Raises:
        TypeError: ``by`` of another type, a callable returning something other than a str or None, or no names.
        ValueError: a negative or zero depth, an invalid regex, or names that do not match the figures in number.
    """
    if names is None:
        names = getattr(stats, "names", None)
        if names is None:
            raise TypeError(f"grouped: a {type(stats).__name__} has no names; pass names=")
    p = int(stats.sumsq.shape[0])
    if len(names) != p:
        raise ValueError(f"grouped: {len(names)} names for the figures of {p} parameters")
    device = stats.sumsq.device
    counted = getattr(stats, "counted", None)
    if counted is not None and not all(counted):  # a tied parameter's copies on later stages: in no group
        keep = [i for i, c in enumerate(counted) if c]
        rows = host_int64(keep, device)
        names = [names[i] for i in keep]
        stats = _Rows(*(t.index_select(0, rows) for t in (stats.sumsq, stats.amax, stats.counts, stats.numel)))
    groups, index, members = _index(names, by, device)
    slots = len(groups) + 1  # the last slot collects the parameters left out, and is dropped
    g = len(groups)
    counts = _scatter_sum(stats.counts, index, slots)[:g]
    amax = torch.zeros(slots, dtype=stats.amax.dtype, device=device)
    amax = amax.scatter_reduce_(0, index, stats.amax, "amax", include_self=False)[:g]
    # A MAX need not propagate NaN on every backend: the NaN count says it.
    amax = torch.where(counts[:, NAN] > 0, torch.full_like(amax, math.nan), amax)
    return GroupStats(
        names=groups,
        sumsq=_scatter_sum(stats.sumsq, index, slots)[:g],
        amax=amax,
        counts=counts,
        numel=_scatter_sum(stats.numel, index, slots)[:g],
        members=members,
    )


def group_sums(names: Sequence[str], values: Tensor, by: GroupBy, groups: Sequence[str], *,
               only: Collection[str] | None = None) -> Tensor:
    """Sum ``values`` ``[P]`` (one per name in ``names``) into ``groups`` (those of a :func:`group_stats` result);
    a name whose group is not among them is left out, and so is a name not in ``only`` when it is given. No sync."""
    own, index, members = _index(names, by, values.device)
    if only is not None and any(n not in only for n in names):  # a per-name index: the names left out to the spare
        where = {grp: i for i, grp in enumerate(groups)}
        spare = len(groups)
        index = host_int64([where.get(members[n], spare) if n in only and n in members else spare for n in names],
                           values.device)
    elif list(own) != list(groups):  # names of another set (a measured update): its groups mapped onto ``groups``
        where = {grp: i for i, grp in enumerate(groups)}
        table = host_int64([where.get(grp, len(groups)) for grp in own] + [len(groups)], values.device)
        index = table.index_select(0, index)
    return _scatter_sum(values, index, len(groups) + 1)[: len(groups)]
