"""Per-parameter gradient statistics: :func:`grad_stats` -> :class:`GradStats` (device side) -> :class:`GradReport`.

:func:`grad_stats` reads every gradient once, through one :func:`torch_gradstats.multi_tensor_stats` call per
device, and returns device tensors only: nothing here waits for the device until :meth:`GradStats.report`, which
makes exactly one device-to-host transfer.

Where the numbers live: all of a :class:`GradStats`'s tensors are on one device, ``GradStats.device``: the device
of the first parameter (in the order given) whose gradient is on an accelerator, or the CPU if every gradient is
on the CPU. Choosing the accelerator means results from other devices are only ever copied *to* it (CPU -> GPU
through pinned memory, GPU -> GPU on the stream), never from a GPU to the host, so no host sync happens before
:meth:`GradStats.report`. Those copies and the one transfer are :mod:`torch_gradstats.ops._transfer`'s; the host-side
summary is :class:`~torch_gradstats.stats.report.GradReport` (re-exported here).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from torch_gradstats.ops._checks import check_bool
from torch_gradstats.ops._extension import native_function
from torch_gradstats.ops._transfer import repeated_int64, to_device, to_host
from torch_gradstats.ops.op import HISTOGRAM_BUCKETS, INF, NAN, ZERO
from torch_gradstats.stats._params import (
    ParamsLike,
    check_grads,
    dtensor_types,
    empty_rows_dtype,
    flat_param_types,
    fsdp1_grad,
    fsdp1_managed,
    named_params,
    stats_on_home,
    unique_names,
)
from torch_gradstats.stats.exponents import ExponentHistogram
from torch_gradstats.stats.groups import GroupBy, GroupStats, group_stats
from torch_gradstats.stats.health import HealthPolicy
from torch_gradstats.stats.report import GradReport

if TYPE_CHECKING:  # imported at run time only where ranks are reduced over: the plain path imports no distributed code
    from torch_gradstats.distributed.reduce import LayoutCheck, Unattributed

#: The report's row for the figures of gradients the layout agreed across ranks had no row for yet (see
#: :attr:`GradStats.unattributed`); listed only in a call that has some.
UNATTRIBUTED_ROW = "(unattributed)"

__all__ = ["ExtraFigures", "GradReport", "GradStats", "ParamsLike", "grad_stats"]

logger = logging.getLogger("torch_gradstats")

_DEFAULT_POLICY = HealthPolicy()


@dataclass(frozen=True)
class ExtraFigures:
    """More device tensors to bring to the host in a report's one transfer, and how to name their host values.

    Made for the step policies: ``ExtraFigures(*guard.check_tensors(), guard.check_values)``. The tensors must be on
    the statistics' device (or the CPU when that is an accelerator: they are copied there without a sync).

    Attributes:
        floats: tensors whose values travel as float64.
        ints: tensors whose values travel as int64.
        read: the host values of ``floats`` and of ``ints`` (flattened, each in order) -> named figures, which go to
            the report's ``extra``.
    """

    floats: Sequence[Tensor]
    ints: Sequence[Tensor]
    read: Callable[[list[float], list[int]], Mapping[str, float]]


def extra_tensors(extra: Sequence[ExtraFigures], device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors of ``extra`` on ``device``, floats then ints, to append to a report's own."""
    for i, e in enumerate(extra):
        if not isinstance(e, ExtraFigures):
            raise TypeError(f"report: extra must be a sequence of ExtraFigures, got a {type(e).__name__} at [{i}]")
    return ([to_device(t, device) for e in extra for t in e.floats],
            [to_device(t, device) for e in extra for t in e.ints])


def read_extra(extra: Sequence[ExtraFigures], floats: list[float], ints: list[int]) -> dict[str, float]:
    """Each of ``extra``'s figures from its share of the host values (the tail of a report's transfer)."""
    out: dict[str, float] = {}
    for e in extra:
        nf, ni = sum(t.numel() for t in e.floats), sum(t.numel() for t in e.ints)
        out.update(e.read(floats[:nf], ints[:ni]))
        floats, ints = floats[nf:], ints[ni:]
    return out


# ---------------------------------------------------------------------------------------------- input handling
#: grad_stats's walk over plain parameters or (name, parameter) pairs in C++ (csrc/python_module.cpp), when the
#: library has it.
_collect_grads: Callable[[list[Any]], tuple[list[str], list[Tensor], tuple[int, ...]] | None] | None = (
    native_function("collect_grads")
)


# ---------------------------------------------------------------------------------------------- GradStats
@dataclass
class GradStats:
    """Per-parameter gradient statistics, as device tensors on ``device`` (no host sync to make or read them).

    Only parameters with a gradient appear, in the order given. Properties are computed on the device each time
    they are read and never sync; :meth:`report` brings everything to the host in one transfer.

    Attributes:
        names: one name per parameter with a gradient; an unnamed parameter is named by its position in the
            input (``"0"``, ``"1"``, ...), counting parameters without a gradient too.
        sumsq: float64 ``[P]``, sum of squares of each gradient (NaN if it has a NaN, +inf if it has an inf).
        amax: float64 ``[P]``, max |g| of each gradient (NaN if it has a NaN).
        counts: int64 ``[P, 3]``, number of zeros, NaNs and Infs of each gradient.
        numel: int64 ``[P]``, logical number of elements (for a DTensor, the full parameter's).
        rank_nonfinite: int64 ``[P]``: the lowest global rank whose gradient of parameter p held a NaN/Inf (-1:
            none), or None outside the distributed path.
        device: where all the tensors above live.
        clip_norm: set by :func:`torch_gradstats.clip_grad_norm_`: the total norm (of its ``norm_type``) it
            clipped with, float64 0-d; None otherwise.
        clip_coef: set by :func:`torch_gradstats.clip_grad_norm_`: the clamped coefficient the gradients were
            multiplied by, float64 0-d; None otherwise.
        clipped_norm: set by :func:`torch_gradstats.clip_grad_norm_`: the total norm after clipping,
            ``clip_coef * clip_norm``, float64 0-d; None otherwise. The report carries both.
        exponent_histogram: with ``grad_stats(..., histogram=True)``, int64 ``[277]``: the finite non-zero
            gradient elements by ``floor(log2 |g|) + 149`` (``[P, 277]``, a row per parameter, with
            ``per_tensor=True``); None otherwise. See :mod:`torch_gradstats.stats.exponents`.
        counted: one bool per row: whether it counts in the figures of the whole model (the totals, the report's
            totals, :meth:`grouped`), or None when every row does. False only for the copies of a parameter tied
            across pipeline stages (``grad_stats(..., stage_group=, tied=)``) on stages other than the lowest that
            holds it: each copy is still reported as a row of its own.
        unattributed: on the distributed path, the figures of gradients that the layout the ranks agreed on has
            no row for yet (a parameter some rank holds for the first time since; docs/distributed.md): counted in
            every total (norms, counts, the clip), in no row; the report lists them as one row,
            ``"(unattributed)"``, when there are any. None off the distributed path.
        layout_check: on the distributed path, the device flags :meth:`report` reads to learn that a layout must
            be agreed again (nothing else reads them); None otherwise.
    """

    names: list[str]
    sumsq: Tensor
    amax: Tensor
    counts: Tensor
    numel: Tensor
    rank_nonfinite: Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    clip_norm: Tensor | None = None
    clip_coef: Tensor | None = None
    clipped_norm: Tensor | None = None
    exponent_histogram: Tensor | None = None
    counted: list[bool] | None = None
    unattributed: Unattributed | None = None
    layout_check: LayoutCheck | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.names)

    def _whole(self, rows: Tensor) -> Tensor:
        """The rows of ``rows`` that count in the figures of the whole model (all of them unless tied copies)."""
        if self.counted is None:
            return rows
        return rows.index_select(0, repeated_int64([i for i, c in enumerate(self.counted) if c], rows.device))

    # ---- device-side properties (no sync)
    @property
    def norms(self) -> Tensor:
        """float64 ``[P]``: L2 norm of each gradient."""
        return self.sumsq.sqrt()

    @property
    def total_sumsq(self) -> Tensor:
        """float64 0-d: sum of squares of all gradients (a tied parameter once, see ``counted``)."""
        total = self._whole(self.sumsq).sum()
        return total if self.unattributed is None else total + self.unattributed.sumsq

    def _total_count(self, column: int) -> Tensor:
        total = self._whole(self.counts[:, column]).sum()
        return total if self.unattributed is None else total + self.unattributed.counts[column]

    @property
    def total_norm(self) -> Tensor:
        """float64 0-d: global L2 norm, ``sqrt(sum(sumsq))`` (what ``clip_grad_norm_`` computes). 0 if empty."""
        return self.total_sumsq.sqrt()

    @property
    def inf_norm(self) -> Tensor:
        """float64 0-d: max |g| over all gradients (NaN if any NaN). 0 if empty."""
        if self.amax.numel() == 0:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
        else:
            total = self._whole(self.amax).max()
        return total if self.unattributed is None else torch.maximum(total, self.unattributed.amax)

    @property
    def zero_count(self) -> Tensor:
        """int64 0-d: number of gradient elements equal to zero."""
        return self._total_count(ZERO)

    @property
    def nan_count(self) -> Tensor:
        """int64 0-d: number of NaN gradient elements."""
        return self._total_count(NAN)

    @property
    def inf_count(self) -> Tensor:
        """int64 0-d: number of +-Inf gradient elements."""
        return self._total_count(INF)

    @property
    def nonfinite_count(self) -> Tensor:
        """int64 0-d: number of NaN or Inf gradient elements."""
        return self.nan_count + self.inf_count

    @property
    def nonfinite_mask(self) -> Tensor:
        """bool ``[P]``: parameters whose gradient has a NaN or Inf."""
        return (self.counts[:, NAN] + self.counts[:, INF]) > 0

    def health(self, policy: HealthPolicy | None = None) -> Tensor:
        """Health score (see :class:`~torch_gradstats.stats.health.HealthPolicy`) as a float64 0-d device tensor.

        Args:
            policy: thresholds and penalties of the score (default: ``HealthPolicy()``).
        """
        return (policy or _DEFAULT_POLICY).score(self.norms)

    def grouped(self, by: GroupBy = "layer") -> GroupStats:
        """Per-group figures (per layer, module, regex group...) from these per-parameter ones, on the device, no
        sync.

        Args:
            by: which group a parameter belongs to: ``"layer"`` (the default), an int (the first parts of the owning
                module's path), any other str or a compiled pattern (a regular expression: its first capture group,
                or the whole match), or a callable ``name -> str | None``; a parameter given no group is left out
                (see :mod:`torch_gradstats.stats.groups`).
        """
        out = group_stats(self, by)
        out.source = self  # its totals cover the parameters in no group too (a flight recorder takes them)
        return out

    # ---- host side
    def check_layout(self) -> None:
        """Read only the layout flags of a distributed call (one small transfer), for a rank that does not call
        :meth:`report`: when they show that some rank's gradients changed, the group agrees on the rows again at
        its next call, as after a report. That happens only when every rank of the group read them (reported or
        checked), so ranks that do not report call this on the same steps as the one that does; see
        docs/distributed.md. Nothing is transferred off the distributed path."""
        if self.layout_check is not None:
            _, flags = to_host([], [self.layout_check.changed])
            self.layout_check.note(flags)

    def report(self, k: int = 5, *, policy: HealthPolicy | None = None,
               groups: GroupStats | None = None, extra: Sequence[ExtraFigures] = ()) -> GradReport:
        """Bring the statistics to the host in exactly one device-to-host transfer and summarise them.

        Args:
            k: how many of the largest per-parameter norms to list in ``top_norms`` (an int >= 0).
            policy: health policy (default :class:`HealthPolicy()`); the score is computed on the host from the
                transferred norms and equals :meth:`health` bit for bit.
            groups: per-group figures (:meth:`grouped`) to bring along in the same transfer, as ``report.groups``.
            extra: more device figures (e.g. the step policies') to bring along in the same transfer, as
                ``report.extra``.
        """
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"GradStats.report: k must be a non-negative int, got {k!r} ({type(k).__name__})")
        if k < 0:
            raise ValueError(f"GradStats.report: k must be a non-negative int, got {k}")
        if self.device.type == "meta":
            raise ValueError(
                "GradStats.report: these statistics are of meta tensors, which have shapes but no values, so there "
                "are no numbers to report; compute them on gradients with data (e.g. after model.to_empty(device=...) "
                "and a backward pass)"
            )
        # Duck-typed: the integrations pass their own figures riding along in the same transfer.
        if groups is not None and not (hasattr(groups, "_host_parts") and hasattr(groups, "_from_host")):
            raise TypeError(f"GradStats.report: groups must be a GroupStats (stats.grouped(...)) or None, got a "
                            f"{type(groups).__name__}")
        k = int(k)
        p = len(self.names)
        world = 0 if self.rank_nonfinite is None else 1  # one rank named per row
        ints_in = [self.counts, self.numel] + ([self.rank_nonfinite] if self.rank_nonfinite is not None else [])
        clip = [] if self.clip_coef is None or self.clipped_norm is None else [self.clip_coef, self.clipped_norm]
        group_floats, group_ints = groups._host_parts() if groups is not None else ([], [])
        extra_floats, extra_ints = extra_tensors(extra, self.device)
        hist = self.exponent_histogram
        if hist is not None and hist.dim() == 2:  # per parameter: the whole model's, as the 1-D one is
            hist = self._whole(hist).sum(0)
            if self.unattributed is not None and self.unattributed.histogram is not None:
                hist = hist + self.unattributed.histogram
        hist_ints = [] if hist is None else [hist]
        # After everything else (the histogram last): the unattributed figures and the layout flags.
        u, check = self.unattributed, self.layout_check
        tail_floats = [] if u is None else [u.sumsq.reshape(1), u.amax.reshape(1)]
        tail_ints = ([] if u is None else [u.counts, u.numel.reshape(1)]) + ([] if check is None else [check.changed])
        floats, ints = to_host([self.sumsq, self.amax, self.total_sumsq, *clip, *group_floats, *extra_floats,
                                *tail_floats], ints_in + group_ints + extra_ints + tail_ints + hist_ints)
        n_hist = 0 if hist is None else HISTOGRAM_BUCKETS
        if check is not None:  # a group whose layout no longer fits agrees again at its next reduction
            check.note(ints[len(ints) - n_hist - check.changed.numel():len(ints) - n_hist])
        n_floats = 2 * p + 1 + len(clip) + sum(t.numel() for t in group_floats)
        n_ints = (4 + world) * p + sum(t.numel() for t in group_ints)
        sumsq, amax, total_sumsq = floats[:p], floats[p : 2 * p], floats[2 * p]
        counts = [ints[3 * i : 3 * i + 3] for i in range(p)]
        numel = ints[3 * p : 4 * p]
        rank_nf = ints[4 * p : 5 * p] if world else None
        out = GradReport._build(self.names, sumsq, amax, total_sumsq, counts, numel, rank_nf, k, policy,
                                self.counted)
        if u is not None:
            u_counts = ints[len(ints) - n_hist - (0 if check is None else check.changed.numel()) - 4:][:4]
            if u_counts[3] > 0:  # some elements had no row: in the totals, and listed as a row of their own
                out._add_unattributed(UNATTRIBUTED_ROW, floats[-2], floats[-1], u_counts[:3], u_counts[3])
        if clip:
            out.clip_coef, out.clipped_norm = floats[2 * p + 1], floats[2 * p + 2]
        if groups is not None:
            out.groups = groups._from_host(floats[2 * p + 1 + len(clip):n_floats], ints[(4 + world) * p:n_ints])
        out.extra = read_extra(extra, floats[n_floats:], ints[n_ints:])
        if hist is not None:
            out.exponent_histogram = ExponentHistogram(tuple(ints[len(ints) - HISTOGRAM_BUCKETS:]), out.numel)
        return out


# ---------------------------------------------------------------------------------------------- grad_stats
def _empty_stats(device: torch.device) -> GradStats:
    return GradStats(
        names=[],
        sumsq=torch.zeros(0, dtype=torch.float64, device=device),
        amax=torch.zeros(0, dtype=torch.float64, device=device),
        counts=torch.zeros(0, 3, dtype=torch.int64, device=device),
        numel=torch.zeros(0, dtype=torch.int64, device=device),
        device=device,
    )


def _empty_local(histogram: bool) -> list[Tensor]:
    s = _with_histogram(_empty_stats(torch.device("cpu")), histogram, True)
    return [s.sumsq, s.amax, s.counts] + ([] if s.exponent_histogram is None else [s.exponent_histogram])


def _with_histogram(stats: GradStats, histogram: bool, per_tensor: bool) -> GradStats:
    """``stats`` of no gradients, with an empty histogram when one is asked for."""
    if histogram:
        shape = (len(stats), HISTOGRAM_BUCKETS) if per_tensor else (HISTOGRAM_BUCKETS,)
        stats.exponent_histogram = torch.zeros(shape, dtype=torch.int64, device=stats.device)
    return stats


@torch.no_grad()
def grad_stats(
    params: ParamsLike,
    *,
    group: Any = None,
    stage_group: Any = None,
    tied: Collection[str] = (),
    expert_group: Any = None,
    is_expert: Callable[[str], bool] | None = None,
    histogram: bool = False,
    per_tensor: bool = False,
) -> GradStats:
    """Statistics of the gradients of ``params`` in one read, as device tensors (no host sync).

    Args:
        params: ``model.named_parameters()``, ``model.parameters()``, a tensor, or an iterable (generators are fine,
            they are consumed once) of tensors or of ``(name, tensor)`` pairs. Each item's ``.grad`` is read;
            items whose ``.grad`` is None are skipped.
        group: a ``torch.distributed`` process group. When given, or when any gradient is a DTensor, the local
            statistics are combined across ranks by :func:`torch_gradstats.distributed.reduce.reduce_across_ranks`.
            Otherwise there is no communication at all. Ranks may hold different parameters (a gradient missing
            on one rank counts as an empty shard there); see docs/distributed.md. FSDP1: ``group`` must be the group
            FSDP shards over (a gradient whole on every rank, NO_SHARD's or inside no_sync(), is a ValueError naming
            it); shards are read without FSDP's padding with ``group``, as stored without one.
        stage_group: process group of pipeline stages (ranks holding disjoint parts of the model): the figures
            of all stages are gathered on every rank; a name held by several stages is reported as
            ``name@stage<k>``, one row per stage.
        tied: names of parameters shared by several stages (a tied embedding): each stage's row is reported, and
            the figures of the whole model (totals, groups, the clip norm) count it once, from the lowest stage
            (``GradStats.counted``).
        expert_group, is_expert: process group the plain gradients of expert parameters are sharded over (instead
            of ``group``), and a callable ``is_expert(name) -> bool`` saying which parameters are experts. Pass both
            or neither.
        histogram: also count the gradients' finite non-zero elements by binary exponent, in the same read
            (``GradStats.exponent_histogram``; a report then has the fp16/bf16/fp8 underflow and overflow
            fractions). Reduced across ranks with the rest.
        per_tensor: keep the histogram's row of each parameter (``[P, 277]``) rather than their sum (``[277]``).

    Returns:
        :class:`GradStats` on the first accelerator device among the gradients (else the CPU). With no gradients:
        an empty GradStats on the CPU (total norm 0, health 1.0).

    Raises:
        TypeError: an item that is neither a tensor nor a (name, tensor) pair, or a gradient of an unsupported
            dtype (both errors name the item or parameter).
        ValueError: a sparse or nested gradient, or one whose storage was freed (named).
    """
    check_bool("grad_stats: histogram", histogram)
    if check_bool("grad_stats: per_tensor", per_tensor) and not histogram:
        raise ValueError("grad_stats: per_tensor=True keeps the histogram's per-parameter rows; pass histogram=True")
    names: list[str] = []
    grads: list[Tensor] = []  # as given (possibly DTensors): for numel and the distributed hook
    local: list[Tensor] = []  # what the op reads
    any_dtensor = False
    idle_meshes: dict[int, Any] = {}  # meshes of DTensor parameters without a gradient here
    if _collect_grads is not None and not isinstance(params, (Tensor, str, bytes)) and isinstance(params, Iterable):
        params = params if type(params) is list else list(params)  # consumed once, whichever walk reads it
        # FSDP1 with a group: the Python walk drops shard padding (without one no per-parameter look-up is paid)
        flat = group is not None and bool(flat_param_types()) and fsdp1_managed(params)
        collected = None if torch.compiler.is_compiling() or flat else _collect_grads(params)
    else:
        collected = None
    numels: tuple[int, ...] | None
    if collected is not None:  # plain parameters or (name, parameter) pairs with plain gradients, walked in C++
        names, local, numels = collected
        grads = local
    else:
        dtensor_classes = dtensor_types()
        flat_classes = flat_param_types()
        pairs = named_params(params)
        empty_dtype = empty_rows_dtype(pairs) if group is not None and flat_classes else None
        for name, p in pairs:
            g = p.grad
            if group is not None and flat_classes and getattr(p, "_fsdp_flattened", False) is True:
                g = fsdp1_grad(name, p, group, empty_dtype)  # without padding, checked; an empty row keeps order
            if g is None:
                if dtensor_classes and isinstance(p, dtensor_classes):  # its mesh's reductions still need this rank
                    mesh = cast(Any, p).device_mesh
                    idle_meshes.setdefault(id(mesh), mesh)
                continue
            names.append(name)
            grads.append(g)
            if dtensor_classes and isinstance(g, dtensor_classes):
                any_dtensor = True
                local.append(cast(Any, g).to_local())  # a DTensor (its class is only known at run time)
            else:
                local.append(g)
        numels = None  # read after the op: a .grad that is not a tensor is named there

    distributed = group is not None or stage_group is not None or expert_group is not None
    if not distributed:  # these options need their group: silently ignored otherwise
        if isinstance(tied, str) or not isinstance(tied, Collection) or not all(isinstance(t, str) for t in tied):
            raise TypeError("grad_stats: tied must be a collection of parameter names (str)")
        if tied:
            raise ValueError("grad_stats: tied names parameters shared by pipeline stages; pass stage_group too")
        if is_expert is not None and not callable(is_expert):
            raise TypeError(f"grad_stats: is_expert must be a callable name -> bool, got a {type(is_expert).__name__}")
        if is_expert is not None:
            raise ValueError("grad_stats: expert_group and is_expert go together: pass both or neither")
    if not local and not distributed and not idle_meshes:
        return _with_histogram(_empty_stats(torch.device("cpu")), histogram, per_tensor)
    names = unique_names(names)

    try:
        # A rank without any gradient still takes part in the reduction, with nothing to add.
        outputs, home = stats_on_home(local, histogram) if local else (_empty_local(histogram), torch.device("cpu"))
    except (AttributeError, TypeError, ValueError, RuntimeError):  # AttributeError: a .grad that is not a tensor
        check_grads(names, local)  # the same failure, named by parameter rather than by list index
        raise
    sumsq, amax, counts = outputs[:3]
    hist = outputs[3] if histogram else None

    if numels is None:
        numels = tuple(g.numel() for g in grads)  # DTensor.numel() is the logical (global) numel
    numel = repeated_int64(numels, home)
    rank_nonfinite = None
    counted = None
    unattributed = layout_check = None
    if distributed or any_dtensor or idle_meshes:
        from torch_gradstats.distributed.reduce import reduce_across_ranks  # only on this path: no import otherwise

        # Plain shards: no rank knows a parameter's full size, so numel travels in the same SUM collective.
        reduced = reduce_across_ranks(
            grads, sumsq, amax, counts, group, names=names, stage_group=stage_group, tied=tied,
            expert_group=expert_group, is_expert=is_expert, histogram=hist, meshes=list(idle_meshes.values()),
        )
        unattributed, layout_check = reduced.unattributed, reduced.layout_check
        sumsq, amax, counts, numel, hist = reduced.sumsq, reduced.amax, reduced.counts, reduced.numel, reduced.histogram
        rank_nonfinite = reduced.rank_nonfinite
        names = reduced.names if reduced.names is not None else names
        counted = reduced.counted
    out = GradStats(
        names=names,
        sumsq=sumsq,
        amax=amax,
        counts=counts,
        numel=numel,
        rank_nonfinite=rank_nonfinite,
        device=home,
        counted=counted,
        unattributed=unattributed,
        layout_check=layout_check,
    )
    if hist is not None:  # the whole model's: a tied parameter's copies once
        out.exponent_histogram = hist if per_tensor else out._whole(hist).sum(0)
        if not per_tensor and unattributed is not None and unattributed.histogram is not None:
            out.exponent_histogram = out.exponent_histogram + unattributed.histogram
    return out
