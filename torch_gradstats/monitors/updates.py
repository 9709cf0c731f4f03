"""Weight norms and update-to-weight ratios, from the same single read as the gradient statistics.

:func:`grad_and_weight_stats` calls :func:`torch_gradstats.multi_tensor_stats` **once** over the gradients *and* the
weights of the parameters (one call per device), so the weight norms cost no extra launch and no extra pass over
the gradients. With an optimizer it also gives the usual estimate of the update-to-weight ratio,
``lr * ||g|| / ||w||`` per parameter, using each parameter's learning rate from the optimizer's param groups. That
estimate is the real ratio only for plain SGD (no momentum); for Adam and friends the update is normalised per
element, so measure the true ratio with :class:`~torch_gradstats.monitors.update_ratio.UpdateRatio` (re-exported
here) and pass its :class:`UpdateStats` as ``update=``.

Everything stays on the device until :meth:`GradWeightStats.report`, which makes exactly one device-to-host
transfer for the gradient statistics, the weight norms, the learning rates and the measured updates together, and
reads them back into an :class:`UpdateReport`.

Under FSDP2 (DTensor parameters) or with ``group=`` (plain shards), weights are reduced across ranks in the same way
as the gradients (:func:`torch_gradstats.distributed.reduce.reduce_across_ranks`).

The measurement around the optimizer step lives in ``update_ratio`` (split from here past 500 lines: a second job);
the device-side statistics and their host report stay together, as they share one packing of the values for the
single transfer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from torch_gradstats.monitors._weight_reads import check_named, device_ratio, local_view, reduce_figures
from torch_gradstats.monitors.update_ratio import UpdateRatio, UpdateStats
from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.stats._params import (
    ParamsLike,
    check_flat_param_group,
    check_orig_param_group,
    dtensor_types,
    empty_orig_shard,
    empty_rows_dtype,
    flat_param_types,
    named_params,
    stats_on_home,
    unique_names,
    without_shard_padding,
)
from torch_gradstats.stats.gradients import ExtraFigures, GradReport, GradStats, extra_tensors, read_extra
from torch_gradstats.stats.groups import GroupBy, GroupStats, group_sums, norm_ratio
from torch_gradstats.stats.health import HealthPolicy

__all__ = [
    "GradWeightStats",
    "UpdateRatio",
    "UpdateReport",
    "UpdateStats",
    "grad_and_weight_stats",
]


# ---------------------------------------------------------------------------------------------- combined stats
@dataclass
class UpdateReport:
    """Host-side figures of :meth:`GradWeightStats.report` (plain Python numbers), from one transfer.

    Attributes:
        grads: the :class:`~torch_gradstats.GradReport` of the gradients (same as ``GradStats.report()``).
        weight_norms: parameter name -> L2 norm of its weights, for the parameters that have a gradient.
        weight_norm_total: L2 norm of all those weights together.
        weight_nonfinite: names of parameters whose *weights* hold a NaN/Inf.
        lrs: parameter name -> learning rate (from the optimizer's param groups), or empty without an optimizer.
        lr_update_ratios: parameter name -> ``lr * ||g|| / ||w||`` (SGD's update over the weights), empty without
            an optimizer. A parameter the optimizer does not hold is left out.
        update_ratios: parameter name -> measured ``||Δw|| / ||w_after||``, empty unless an update was given.
        delta_norms: parameter name -> ``||Δw||``, empty unless an update was given.
    """

    grads: GradReport
    weight_norms: dict[str, float]
    weight_norm_total: float
    weight_nonfinite: list[str]
    lrs: dict[str, float] = field(default_factory=dict)
    lr_update_ratios: dict[str, float] = field(default_factory=dict)
    update_ratios: dict[str, float] = field(default_factory=dict)
    delta_norms: dict[str, float] = field(default_factory=dict)

    def to_dict(self, prefix: str = "", per_param: bool = True,
                style: str = "default") -> dict[str, float | int | str | None]:
        """Flat dict: the gradient figures of ``GradReport.to_dict`` plus ``weight_norm_total``,
        ``num_nonfinite_weights``, ``lr_update_ratio_max`` / ``update_ratio_max`` (largest finite... or NaN) and,
        with ``per_param``, ``weight_norm/<name>``, ``lr_update_ratio/<name>``, ``update_ratio/<name>``. A framework
        ``style`` gives the gradient keys of ``GradReport.to_dict(style=...)`` only."""
        if style != "default":
            return self.grads.to_dict(prefix, per_param, style)
        extra = self.grads.extra  # last and unprefixed, as GradReport.to_dict writes them
        out: dict[str, float | int | str | None] = {
            k: v for k, v in self.grads.to_dict(per_param=per_param).items() if k not in extra}
        out["weight_norm_total"] = self.weight_norm_total
        out["num_nonfinite_weights"] = len(self.weight_nonfinite)
        if self.lr_update_ratios:
            out["lr_update_ratio_max"] = _nan_max(self.lr_update_ratios.values())
        if self.update_ratios:
            out["update_ratio_max"] = _nan_max(self.update_ratios.values())
        if per_param:
            for key, values in (("weight_norm", self.weight_norms), ("lr_update_ratio", self.lr_update_ratios),
                                ("update_ratio", self.update_ratios)):
                for name, v in values.items():
                    out[f"{key}/{name}"] = v
        return {**{prefix + k: v for k, v in out.items()}, **extra}


def _nan_max(values: Iterable[float]) -> float:
    vals = list(values)
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals) if vals else 0.0


@dataclass
class GradWeightStats:
    """Gradient statistics plus weight statistics of the same parameters, all on ``grads.device`` (no sync).

    Attributes:
        grads: the :class:`~torch_gradstats.GradStats` (identical to what ``grad_stats`` returns).
        weight_sumsq, weight_amax: float64 ``[P]``, of the weights of the parameters in ``grads.names``.
        weight_counts: int64 ``[P, 3]``: zeros, NaNs, Infs in the weights.
        lrs: learning rate per parameter in ``grads.names`` order (a float, a 0-d tensor, or None where the
            optimizer does not hold that parameter); None without an optimizer.
        update: measured update of the last optimizer step (:class:`UpdateStats`), if one was attached.
    """

    grads: GradStats
    weight_sumsq: Tensor
    weight_amax: Tensor
    weight_counts: Tensor
    lrs: list[Any] | None = None
    update: UpdateStats | None = None

    @property
    def names(self) -> list[str]:
        return self.grads.names

    @property
    def weight_norms(self) -> Tensor:
        """float64 ``[P]``: L2 norm of each parameter's weights (device)."""
        return self.weight_sumsq.sqrt()

    def lr_update_ratios(self) -> Tensor | None:
        """float64 ``[P]``: ``lr * ||g|| / ||w||`` on the device (NaN where the optimizer lacks the parameter); None
        without learning rates. Moving the learning rates to an accelerator goes through pinned memory (no sync)."""
        lr = self._lr_tensor()
        return None if lr is None else lr * device_ratio(self.grads.sumsq, self.weight_sumsq)

    def _lr_tensor(self) -> Tensor | None:
        if self.lrs is None:
            return None
        device = self.grads.device
        # Python numbers go up together through pinned memory; learning rates held as tensors (capturable
        # optimizers keep them on the device) are copied device to device: no sync either way.
        numbers = [math.nan if v is None or isinstance(v, Tensor) else float(v) for v in self.lrs]
        lr = to_device(torch.tensor(numbers, dtype=torch.float64), device)
        held = [i for i, v in enumerate(self.lrs) if isinstance(v, Tensor)]
        if held:
            values = [to_device(self.lrs[i].reshape(()).to(torch.float64), device) for i in held]
            lr = lr.index_put((to_device(torch.tensor(held), device),), torch.stack(values))
        return lr

    def grouped(self, by: GroupBy = "layer") -> GroupStats:
        """:meth:`GradStats.grouped` plus, per group, the weights' sum of squares, with an optimizer the squared
        norm of plain SGD's update (``sum(lr_p**2 * ||g_p||**2)``, 0 for a parameter it does not hold) and with a
        measured update its ``||Δw||²`` and ``||w_after||²``: device tensors, no sync; ratios in the report.

        Every figure of a group covers the same parameters: those of the group that have a gradient (``self.names``).
        A parameter without one (frozen, or unused by the step) is skipped by PyTorch's optimizers, so it did not
        update: it is left out of the group's weights, SGD update and measured update alike (its own measured ratio,
        0, stays in the per-parameter ``update_ratios``)."""
        out = self.grads.grouped(by)
        out.weight_sumsq = group_sums(self.names, self.weight_sumsq, by, out.names)
        lr = self._lr_tensor()
        if lr is not None:
            sgd = torch.nan_to_num(lr, nan=0.0).square() * self.grads.sumsq
            out.lr_update_sumsq = group_sums(self.names, sgd, by, out.names)
        if self.update is not None:
            # The parameters with a gradient, as for the weights and the SGD update: one without (frozen, or unused
            # by this step) is skipped by the optimizer, so its weights would only dilute the group's ratio.
            kept = set(self.names)
            out.delta_sumsq = group_sums(self.update.names, self.update.delta_sumsq, by, out.names, only=kept)
            out.update_weight_sumsq = group_sums(self.update.names, self.update.weight_sumsq, by, out.names,
                                                 only=kept)
            # Names only (no read): a group with gradients none of which was measured has no update ratio.
            measured = frozenset(out.members[n] for n in self.update.names if n in kept and n in out.members)
            if measured != frozenset(out.names):
                out.measured = measured
        return out

    def report(self, k: int = 5, *, policy: HealthPolicy | None = None,
               groups: GroupStats | None = None, extra: Sequence[ExtraFigures] = ()) -> UpdateReport:
        """Everything in ONE device-to-host transfer: gradient report, weight norms, learning rates, update, the
        per-group figures of ``groups`` (:meth:`grouped`) as ``report.grads.groups``, and the figures of ``extra``
        (see :meth:`GradStats.report`) as ``report.grads.extra``."""
        g = self.grads
        if g.device.type == "meta":
            raise ValueError(
                "GradWeightStats.report: these statistics are of meta tensors, which have shapes but no values, so "
                "there are no numbers to report; compute them on a model with data (e.g. after "
                "model.to_empty(device=...) and a backward pass)"
            )
        p = len(g.names)
        floats: list[Tensor] = [g.sumsq, g.amax, self.weight_sumsq]
        tensor_lrs = [i for i, v in enumerate(self.lrs or []) if isinstance(v, Tensor)]
        if tensor_lrs:
            lrs = cast(list[Tensor], [self.lrs[i] for i in tensor_lrs])  # type: ignore[index]
            floats.append(torch.stack([to_device(v.reshape(()).to(torch.float64), g.device) for v in lrs]))
        upd = self.update
        if upd is not None:
            floats += [upd.delta_sumsq, upd.weight_sumsq]
        ints: list[Tensor] = [g.counts, g.numel, self.weight_counts]
        world = 0 if g.rank_nonfinite is None else 1  # one rank named per row
        if g.rank_nonfinite is not None:
            ints.append(g.rank_nonfinite)
        group_floats, group_ints = groups._host_parts() if groups is not None else ([], [])
        extra_floats, extra_ints = extra_tensors(extra, g.device)
        n_floats, n_ints = sum(t.numel() for t in floats), sum(t.numel() for t in ints)
        n_group_floats, n_group_ints = sum(t.numel() for t in group_floats), sum(t.numel() for t in group_ints)
        fl, it = to_host(floats + group_floats + extra_floats, ints + group_ints + extra_ints)

        sumsq, amax, wsumsq = fl[:p], fl[p:2 * p], fl[2 * p:3 * p]
        pos = 3 * p
        lr_values = list(self.lrs) if self.lrs is not None else None
        if tensor_lrs and lr_values is not None:
            for i, v in zip(tensor_lrs, fl[pos:pos + len(tensor_lrs)]):
                lr_values[i] = v
            pos += len(tensor_lrs)
        counts = it[:3 * p]
        numel = it[3 * p:4 * p]
        wcounts = it[4 * p:7 * p]
        rank_nf = it[7 * p:7 * p + world * p]

        # The gradient report, built by GradStats.report() itself from host tensors (a host-side copy, no sync).
        host = GradStats(
            names=list(g.names),
            sumsq=torch.tensor(sumsq, dtype=torch.float64),
            amax=torch.tensor(amax, dtype=torch.float64),
            counts=torch.tensor(counts, dtype=torch.int64).reshape(p, 3),
            numel=torch.tensor(numel, dtype=torch.int64),
            rank_nonfinite=torch.tensor(rank_nf, dtype=torch.int64) if world else None,
            device=torch.device("cpu"),
        )
        grads_report = host.report(k, policy=policy)
        if groups is not None:
            grads_report.groups = groups._from_host(fl[n_floats:n_floats + n_group_floats],
                                                    it[n_ints:n_ints + n_group_ints])
        grads_report.extra = read_extra(extra, fl[n_floats + n_group_floats:], it[n_ints + n_group_ints:])

        names = g.names
        weight_norms = {n: (math.sqrt(s) if not math.isnan(s) else math.nan) for n, s in zip(names, wsumsq)}
        total = math.fsum(wsumsq) if not any(math.isnan(s) for s in wsumsq) else math.nan
        weight_nonfinite = [n for i, n in enumerate(names) if wcounts[3 * i + 1] + wcounts[3 * i + 2] > 0]
        report = UpdateReport(
            grads=grads_report,
            weight_norms=weight_norms,
            weight_norm_total=math.sqrt(total) if not math.isnan(total) else math.nan,
            weight_nonfinite=weight_nonfinite,
        )
        if lr_values is not None:
            for n, lr, gs, ws in zip(names, lr_values, sumsq, wsumsq):
                if lr is None:
                    continue
                report.lrs[n] = float(lr)
                report.lr_update_ratios[n] = float(lr) * norm_ratio(gs, ws)
        if upd is not None:
            q = len(upd.names)
            dsumsq, asumsq = fl[pos:pos + q], fl[pos + q:pos + 2 * q]
            for n, d, w in zip(upd.names, dsumsq, asumsq):
                report.delta_norms[n] = math.sqrt(d) if not math.isnan(d) else math.nan
                report.update_ratios[n] = norm_ratio(d, w)
        return report


def _lr_by_param(optimizer: Any) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            out[id(p)] = group.get("lr")
    return out


@torch.no_grad()
def grad_and_weight_stats(
    params: ParamsLike,
    *,
    optimizer: Any = None,
    update: UpdateStats | None = None,
    group: Any = None,
) -> GradWeightStats:
    """Gradient and weight statistics of ``params`` from ONE :func:`~torch_gradstats.multi_tensor_stats` call
    (per device) over the gradients and the weights together; device tensors only, no host sync.

    Args:
        params: what :func:`~torch_gradstats.grad_stats` accepts. Parameters without a gradient are skipped (as in
            ``grad_stats``), for the weights too.
        optimizer: if given, each parameter's learning rate is read from its param group (for
            :meth:`GradWeightStats.lr_update_ratios` and the report's ``lr_update_ratios``).
        update: a measured :class:`UpdateStats` (from :class:`UpdateRatio`) to report in the same transfer.
        group: as in ``grad_stats``: process group over which plain tensors are shards of one set.

    Returns:
        :class:`GradWeightStats`; ``.grads`` equals ``grad_stats(params, group=group)`` value for value.
    """
    every = named_params(params, "grad_and_weight_stats")
    # With group=, rows are matched by position: FSDP1's original parameters (use_orig_params=True) whose shard is
    # empty here count as empty rows, so that every rank lists the parameters of every flat parameter alike.
    orig = group is not None and bool(flat_param_types())
    named = [(n, p) for n, p in every if p.grad is not None or (orig and empty_orig_shard(p))]
    dt = dtensor_types()
    if not named:
        empty_f = torch.zeros(0, dtype=torch.float64)
        # Without gradients here, this rank still takes part in the reductions its peers make (or they would wait):
        # the rows are matched by position, so peers that hold gradients make every rank raise alike.
        idle = [cast(Any, p).device_mesh for _, p in every if dt and isinstance(p, dt)]
        if group is not None or idle:
            reduce_figures([], empty_f, empty_f.clone(), torch.zeros(0, 3, dtype=torch.int64), group, True, idle)
        stats = GradStats(names=[], sumsq=empty_f, amax=empty_f.clone(), counts=torch.zeros(0, 3, dtype=torch.int64),
                          numel=torch.zeros(0, dtype=torch.int64))
        return GradWeightStats(stats, empty_f.clone(), empty_f.clone(), torch.zeros(0, 3, dtype=torch.int64),
                               [] if optimizer is not None else None, update)
    names = unique_names([n for n, _ in named])
    empty_dtype = empty_rows_dtype(named) if orig else None
    grads: list[Tensor] = [p.detach().to(empty_dtype or p.dtype) if p.grad is None else p.grad for _, p in named]
    weights = [p.detach() for _, p in named]
    flat = flat_param_types()
    if flat and group is not None:  # FSDP1's shards, as grad_stats reads them with a group (without one: as stored)
        for i, (name, p) in enumerate(named):
            if isinstance(p, flat):  # use_orig_params=False: the shard padding is no gradient nor weight
                check_flat_param_group(name, p, group, "grad_and_weight_stats")
                grads[i], weights[i] = without_shard_padding(p, grads[i]), without_shard_padding(p, weights[i])
            elif getattr(p, "_fsdp_flattened", False) is True and not (dt and isinstance(grads[i], dt)):
                check_orig_param_group(name, grads[i], group, "grad_and_weight_stats")  # use_orig_params=True
    local = [local_view(t, dt) for t in grads] + [local_view(t, dt) for t in weights]
    any_dt = bool(dt) and any(isinstance(t, dt) for t in grads + weights)
    try:
        (sumsq, amax, counts), home = stats_on_home(local, False)
    except (TypeError, ValueError, RuntimeError):
        check_named("grad_and_weight_stats", list(zip(names, local[: len(names)])) +
                     list(zip(names, local[len(names):])))
        raise
    sumsq, amax, counts, rank_nf, numel = reduce_figures(grads + weights, sumsq, amax, counts, group, any_dt)
    n = len(named)
    stats = GradStats(
        names=names,
        sumsq=sumsq[:n],
        amax=amax[:n],
        counts=counts[:n],
        numel=numel[:n],
        rank_nonfinite=rank_nf[:n] if rank_nf is not None else None,
        device=home,
    )
    lrs = None
    if optimizer is not None:
        by_id = _lr_by_param(optimizer)
        lrs = [by_id.get(id(p)) for _, p in named]
    return GradWeightStats(stats, sumsq[n:], amax[n:], counts[n:], lrs, update)
