"""Weight norms and update-to-weight ratios, from the same single read as the gradient statistics.

:func:`grad_and_weight_stats` calls :func:`torch_gradstats.multi_tensor_stats` **once** over the gradients *and* the
weights of the parameters (one call per device), so the weight norms cost no extra launch and no extra pass over
the gradients. With an optimizer it also gives the usual estimate of the update-to-weight ratio,
``lr * ||g|| / ||w||`` per parameter, using each parameter's learning rate from the optimizer's param groups. That
estimate is the real ratio only for plain SGD (no momentum); for Adam and friends the update is normalised per
element, so measure the true ratio with :class:`UpdateRatio`.

:class:`UpdateRatio` measures ``||Δw|| / ||w||`` around an optimizer step: before the step it copies the weights
once (one ``torch._foreach_copy_`` into buffers it keeps between steps), after the step it turns the copy into
``w_before - w_after`` in place (one ``torch._foreach_sub_``) and reads the differences and the new weights in one
op call. Memory cost: one copy of the measured parameters (``UpdateRatio.nbytes``: the sum of their sizes, in their
own dtypes, on their own devices), kept between steps to avoid reallocating it; :meth:`UpdateRatio.release` frees it.
Since the buffers have the weights' dtype, a float16/bfloat16 ``Δw`` is rounded to it: each ``||Δw||`` is within the
dtype's unit roundoff (2^-11, 2^-8) of the exact one, and much closer in practice (docs/integrations.md); float32
buffers would double the snapshot of 16-bit weights.

Everything stays on the device until :meth:`GradWeightStats.report`, which makes exactly one device-to-host
transfer for the gradient statistics, the weight norms, the learning rates and the measured updates together.

Under FSDP2 (DTensor parameters) or with ``group=`` (plain shards), weights and updates are reduced across ranks in
the same way as the gradients (:func:`torch_gradstats.distributed.reduce.reduce_across_ranks`).

(One module of ~450 lines on purpose: the device-side statistics, the update measurement and their host report
share one packing of the values for the single transfer, and are read together.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.ops.op import SUPPORTED_DTYPES
from torch_gradstats.stats._params import ParamsLike, dtensor_types, named_params, stats_on_home, unique_names
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


# ---------------------------------------------------------------------------------------------- small helpers


def _local(t: Tensor, dtensor_types: tuple[type, ...]) -> Tensor:
    t = t.detach()
    return t.to_local() if dtensor_types and isinstance(t, dtensor_types) else t  # type: ignore[attr-defined]


def _check_named(what: str, named: Sequence[tuple[str, Tensor]]) -> None:
    """After the op refused its input: the same failure, named by parameter (metadata only)."""
    for name, t in named:
        if t.layout != torch.strided:
            raise ValueError(f"{what}: parameter {name!r} has a {t.layout} tensor; only dense (strided) gradients "
                             "and weights are supported (for nn.Embedding(sparse=True) use sparse=False)")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{what}: parameter {name!r} has a {t.dtype} tensor; expected float16, bfloat16, "
                            "float32 or float64")




def _reduce(originals: Sequence[Tensor], sumsq: Tensor, amax: Tensor, counts: Tensor, group: Any,
            any_dtensor: bool, meshes: Sequence[Any] = ()) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """Global figures across ranks (only when a DTensor is involved or a group is given), numel included;
    ``meshes``: those of DTensor parameters without a gradient here (their reductions still need this rank)."""
    if group is None and not any_dtensor:
        numel = torch.tensor([t.numel() for t in originals], dtype=torch.int64)
        return sumsq, amax, counts, None, to_device(numel, sumsq.device)
    from torch_gradstats.distributed.reduce import reduce_across_ranks  # only on this path

    r = reduce_across_ranks(originals, sumsq, amax, counts, group, meshes=meshes)
    return r.sumsq, r.amax, r.counts, r.rank_nonfinite, r.numel


def _device_ratio(num_sumsq: Tensor, den_sumsq: Tensor) -> Tensor:
    """:func:`_ratio` elementwise on the device: 0 (not NaN) where both sums are 0, as the report gives."""
    both_zero = (num_sumsq == 0) & (den_sumsq == 0)
    return torch.where(both_zero, torch.zeros_like(num_sumsq), num_sumsq.sqrt() / den_sumsq.sqrt())


def _names_like_grad_stats(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Unique names that agree with ``grad_stats`` (which names only the parameters with a gradient) for the
    parameters that have one; the others get names unique around them. Differs from ``unique_names`` of all the
    names only when a name repeats and a gradient is missing."""
    given = [n for n, _ in named]
    with_grad = [i for i, (_, p) in enumerate(named) if p.grad is not None]
    out = dict(zip(with_grad, unique_names([given[i] for i in with_grad])))
    taken, given_set = set(out.values()), set(given)
    for i, name in enumerate(given):
        if i in out:
            continue
        unique, k = name, 0
        while unique in taken or (unique != name and unique in given_set):
            k += 1
            unique = f"{name}#{k}"
        taken.add(unique)
        out[i] = unique
    return [out[i] for i in range(len(given))]


# ---------------------------------------------------------------------------------------------- UpdateRatio
@dataclass
class UpdateStats:
    """One measured optimizer step, as device tensors (float64 ``[P]``): ``delta_sumsq`` is ``||w_before -
    w_after||²`` and ``weight_sumsq`` is ``||w_after||²`` of each parameter, named by ``names``."""

    names: list[str]
    delta_sumsq: Tensor
    weight_sumsq: Tensor

    @property
    def ratios(self) -> Tensor:
        """float64 ``[P]``: ``||Δw|| / ||w||`` (weights after the step), on the device; 0 for an all-zero weight
        that did not change (as in the report)."""
        return _device_ratio(self.delta_sumsq, self.weight_sumsq)


class UpdateRatio:
    """Measure the true ``||Δw|| / ||w||`` of each parameter around an optimizer step.

    Example::

        ratio = UpdateRatio(model.named_parameters())    # once
        ...
        with ratio:                  # snapshot: one foreach copy of the weights
            optimizer.step()
        ratio.stats.ratios           # device tensor, no sync; or grad_and_weight_stats(..., update=ratio.stats)

    Or without ``with``: :meth:`snapshot` before the step, :meth:`measure` after it. The ratio's denominator is the
    norm of the weights *after* the step (so a zero-initialised bias gets a finite ratio after its first update).

    Memory: :attr:`nbytes`, one copy of the parameters in their own dtypes, kept between steps (:meth:`release`
    frees it). So ``w_before - w_after`` is rounded to the weights' dtype: for float16/bfloat16 weights each ``||Δw||``
    is within that dtype's unit roundoff (2^-11, 2^-8) of the exact one (docs/integrations.md). A step that changes no
    weight (skipped by a GradScaler or a guard), and a parameter the optimizer skips (no ``.grad``), measure 0.
    Parameters are read through ``.detach()`` (DTensors through their local shard) and never modified. ``group``:
    the process group over which plain-tensor parameters are shards of one set (as in ``grad_and_weight_stats``).
    """

    def __init__(self, params: ParamsLike, *, group: Any = None) -> None:
        self._named = named_params(params, "UpdateRatio")
        if not self._named:
            raise ValueError("UpdateRatio: no parameters given")
        self.names = unique_names([n for n, _ in self._named])
        self.group = group
        self._buffers: list[Tensor] | None = None
        self._armed = False
        self.stats: UpdateStats | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the snapshot buffers: those allocated, or before the first snapshot those it will allocate (one
        copy of each parameter's local shard: a DTensor's local tensor, not its global size)."""
        if self._buffers is not None:
            return sum(b.numel() * b.element_size() for b in self._buffers)
        dt = dtensor_types()
        return sum(t.numel() * t.element_size() for t in (_local(p, dt) for _, p in self._named))

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the current weights (one foreach copy into kept buffers). Call right before ``optimizer.step()``."""
        dt = dtensor_types()
        local = [_local(p, dt) for _, p in self._named]
        if self._buffers is None or any(b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
                                        for b, t in zip(self._buffers, local)):
            with torch.inference_mode(False):  # ordinary tensors: every later snapshot writes them, in any mode
                self._buffers = [torch.empty_like(t) for t in local]
        torch._foreach_copy_(self._buffers, local)
        self._armed = True

    @torch.no_grad()
    def measure(self) -> UpdateStats:
        """After the step: ``||Δw||²`` and ``||w||²`` of each parameter from one op call (device tensors)."""
        if not self._armed or self._buffers is None:
            raise RuntimeError("UpdateRatio.measure() called without a snapshot() before the optimizer step")
        dt = dtensor_types()
        local = [_local(p, dt) for _, p in self._named]
        self._armed = False
        try:
            torch._foreach_sub_(self._buffers, local)  # buffers := w_before - w_after
        except RuntimeError:  # NotImplementedError too: a dtype without subtraction (float8)
            self._named_failure(local)
            raise
        n = len(local)
        tensors = self._buffers + local
        try:
            (sumsq, amax, counts), _ = stats_on_home(tensors, False)  # buffers and weights share devices and order
        except (TypeError, ValueError, RuntimeError):
            _check_named("UpdateRatio", list(zip(self.names, local)))  # the same failure, named by parameter
            raise
        originals = [p for _, p in self._named]
        any_dt = bool(dt) and any(isinstance(p, dt) for p in originals)
        sumsq, *_ = _reduce(originals + originals, sumsq, amax, counts, self.group, any_dt)
        # Named as grad_and_weight_stats names the gradients now, so the report pairs each update with its own
        # parameter even when a name repeats and a gradient is missing.
        self.names = _names_like_grad_stats(self._named)
        self.stats = UpdateStats(self.names, sumsq[:n], sumsq[n:])
        return self.stats

    def _named_failure(self, local: list[Tensor]) -> None:
        """After the subtraction failed: the parameter that changed shape or device since the snapshot, or has a
        dtype the op refuses, named (metadata only; only on failure, so a step pays no loop over the parameters)."""
        assert self._buffers is not None
        for name, b, t in zip(self.names, self._buffers, local):
            if b.shape != t.shape or b.device != t.device:
                raise ValueError(
                    f"UpdateRatio.measure: parameter {name!r} changed between snapshot() and measure(), from "
                    f"{tuple(b.shape)} on {b.device} to {tuple(t.shape)} on {t.device}; snapshot() again"
                )
        _check_named("UpdateRatio", list(zip(self.names, local)))

    def release(self) -> None:
        """Free the snapshot buffers (the next snapshot allocates them again)."""
        self._buffers = None
        self._armed = False

    def __enter__(self) -> UpdateRatio:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self.snapshot()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.measure()
        else:
            self._armed = False


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
        return None if lr is None else lr * _device_ratio(self.grads.sumsq, self.weight_sumsq)

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
    named = [(n, p) for n, p in every if p.grad is not None]
    dt = dtensor_types()
    if not named:
        empty_f = torch.zeros(0, dtype=torch.float64)
        # Without gradients here, this rank still takes part in the reductions its peers make (or they would wait):
        # the rows are matched by position, so peers that hold gradients make every rank raise alike.
        idle = [cast(Any, p).device_mesh for _, p in every if dt and isinstance(p, dt)]
        if group is not None or idle:
            _reduce([], empty_f, empty_f.clone(), torch.zeros(0, 3, dtype=torch.int64), group, True, idle)
        stats = GradStats(names=[], sumsq=empty_f, amax=empty_f.clone(), counts=torch.zeros(0, 3, dtype=torch.int64),
                          numel=torch.zeros(0, dtype=torch.int64))
        return GradWeightStats(stats, empty_f.clone(), empty_f.clone(), torch.zeros(0, 3, dtype=torch.int64),
                               [] if optimizer is not None else None, update)
    names = unique_names([n for n, _ in named])
    grads: list[Tensor] = [p.grad for _, p in named]  # type: ignore[misc]
    weights = [p.detach() for _, p in named]
    local = [_local(t, dt) for t in grads] + [_local(t, dt) for t in weights]
    any_dt = bool(dt) and any(isinstance(t, dt) for t in grads + weights)
    try:
        (sumsq, amax, counts), home = stats_on_home(local, False)
    except (TypeError, ValueError, RuntimeError):
        _check_named("grad_and_weight_stats", list(zip(names, local[: len(names)])) +
                     list(zip(names, local[len(names):])))
        raise
    sumsq, amax, counts, rank_nf, numel = _reduce(grads + weights, sumsq, amax, counts, group, any_dt)
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
