"""What the Lightning and Hugging Face callbacks share: take the statistics, measure the update, apply the step
policies (SpikeGuard, AdaptiveClip), report once."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations._options import check_policies
from torch_gradstats.integrations.sinks import AnyReport, grad_report
from torch_gradstats.monitors.activations import ActivationReport, ActivationWatch
from torch_gradstats.monitors.update_ratio import UpdateRatio
from torch_gradstats.monitors.updates import GradWeightStats, grad_and_weight_stats
from torch_gradstats.ops._transfer import to_host
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.clip import clip_with_threshold_
from torch_gradstats.policies.guard import SpikeGuard, SpikeStreakError
from torch_gradstats.stats._params import flat_param_shards, flat_param_types
from torch_gradstats.stats.gradients import ExtraFigures, GradStats, grad_stats
from torch_gradstats.stats.groups import GroupBy, group_names
from torch_gradstats.stats.health import HealthPolicy
from torch_gradstats.training._incidents import StepIncidents

logger = logging.getLogger("torch_gradstats")


def styled_keys(report: AnyReport, key_style: str | None, per_param: bool) -> dict[str, float]:
    """The numbers of ``key_style``'s keys (none for None or ``"default"``: those are the callbacks' own keys)."""
    if key_style is None or key_style == "default":
        return {}
    return {k: float(v) for k, v in grad_report(report).to_dict(per_param=per_param, style=key_style).items()
            if isinstance(v, (int, float))}


def activation_metrics(report: ActivationReport, watch: ActivationWatch) -> dict[str, float]:
    """The numbers every logger takes from an activation report: ``act/nonfinite`` (0 or 1) and
    ``act/origin_index`` (position of :attr:`ActivationReport.origin` in ``watch.module_names``; -1 when all
    finite, -2 when the model's inputs were non-finite). The origin's name goes to the warning."""
    origin = report.origin
    if origin is None:
        index = -1
    elif origin == "<inputs>":
        index = -2
    else:
        names = watch.module_names
        index = names.index(origin) if origin in names else -1
    return {"act/nonfinite": float(report.nonfinite), "act/origin_index": float(index)}


def mean_over_ranks(loss: Tensor | None) -> Tensor | None:
    """The loss averaged over the default process group (an all-reduce on the device, no host sync), so every rank's
    guard judges the same value and all ranks take or skip a step together; the loss itself when not distributed."""
    if loss is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return loss
    total = loss.detach().to(torch.float64).clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def policy_extra(policies: list[SpikeGuard | AdaptiveClip]) -> list[ExtraFigures]:
    """The step policies' device figures, to bring along in a report's one transfer (``report(extra=...)``)."""
    return [ExtraFigures(*p.check_tensors(), p.check_values) for p in policies]


class ActivationReporting:
    """What both callbacks do with an :class:`~torch_gradstats.ActivationWatch`: one report per watched step, and the
    words naming the origin in their warnings."""

    activation_watch: ActivationWatch | None
    last_activation_report: ActivationReport | None
    _activation_at: int
    _held_activation: tuple[int, Any] | None = None  # the watch's step and figures kept by _hold_activation

    def _hold_activation(self) -> None:
        """At a training step's end: keep the watch's figures of it (on the device), which forwards run before the
        report (a sample another callback generates) would replace."""
        watch = self.activation_watch
        self._held_activation = None if watch is None else (watch.step, watch._hold(training=True))

    def _activation_report(self) -> ActivationReport | None:
        """The watch's report of the held step, else of its latest recorded training step (its own one transfer);
        None without a watch."""
        watch = self.activation_watch
        if watch is None:
            return None
        held, self._held_activation = self._held_activation, None
        at = held[0] if held is not None else watch.step
        if self.last_activation_report is None or self._activation_at != at:  # no forward since: the same
            self.last_activation_report = watch._report_of(held[1] if held is not None else watch._hold(training=True))
            self._activation_at = at
        return self.last_activation_report

    def _activation_words(self, act: ActivationReport | None = None) -> str:
        """``"; <the watch's summary>"`` naming the forward/backward origin, or "" without a watch."""
        act = act if act is not None else self._activation_report()
        return "" if act is None else f"; {act.summary()}"


class PolicyState:
    """What both callbacks share about their step policies: the :class:`~torch_gradstats.SpikeGuard` and
    :class:`~torch_gradstats.AdaptiveClip` given to them (``spike_guard``, ``adaptive_clip``; None where not given),
    and their statistics as the callback's ``state_dict`` (Lightning saves it in its checkpoints; with the Hugging
    Face Trainer, whose checkpoints hold no callback tensors, save it yourself)."""

    taker: StatsTaker

    @property
    def spike_guard(self) -> SpikeGuard | None:
        """The :class:`~torch_gradstats.SpikeGuard` given as ``spike_guard=``, or None."""
        return self.taker.spike_guard

    @property
    def adaptive_clip(self) -> AdaptiveClip | None:
        """The :class:`~torch_gradstats.AdaptiveClip` given as ``adaptive_clip=``, or None."""
        return self.taker.adaptive_clip

    def state_dict(self) -> dict[str, Any]:
        """The spike guard's and the adaptive clip's statistics (``{"spike_guard": ..., "adaptive_clip": ...}``, each
        present where given; Python scalars and tensors, loadable with ``torch.load(weights_only=True)``): restored
        by :meth:`load_state_dict`, a resumed run judges and clips as one that never stopped."""
        return self.taker.policy_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved into this callback's policies; a policy saved that this callback
        lacks is named in a warning and left out."""
        if self.taker.load_policy_state(state_dict):
            self._policies_restored = True

    @property
    def policies_restored(self) -> bool:
        """Whether :meth:`load_state_dict` restored a policy's statistics into this callback."""
        return bool(getattr(self, "_policies_restored", False))


class StatsTaker:
    """Takes the statistics of one optimizer step, applies the step policies, and turns them into one report (one
    host transfer)."""

    def __init__(self, log_weight_norms: bool, log_update_ratio: bool, group: Any, policy: HealthPolicy | None,
                 k: int, group_by: GroupBy | None = None, spike_guard: SpikeGuard | None = None,
                 adaptive_clip: AdaptiveClip | None = None, stage_group: Any = None,
                 tied: Collection[str] = ()) -> None:
        if stage_group is not None and (log_weight_norms or log_update_ratio):
            raise ValueError("stage_group: weight norms and update ratios are not gathered over pipeline stages; "
                             "pass log_weight_norms=False and log_update_ratio=False with stage_group")
        if group_by is not None:  # a wrong group_by is named now, not at the first logging step
            try:
                group_names([], group_by)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"GradStatsCallback: group_by={group_by!r} is no grouping: {exc}") from None
        check_policies(spike_guard, adaptive_clip)
        self.group_by = group_by
        self.log_weight_norms = log_weight_norms
        self.log_update_ratio = log_update_ratio
        self._group = group
        self._fsdp1_checked = False
        self.stage_group = stage_group
        self.tied = tied
        self.policy = policy
        self.k = k
        self.ratio: UpdateRatio | None = None
        self._ratio_key: tuple[int, ...] | None = None  # ids of the parameters ``ratio`` measures
        self._optimizer: Any = None  # the optimizer last given to take()
        self.spike_guard = spike_guard
        self.adaptive_clip = adaptive_clip
        #: the guard's and the clip's figures read with the last report (``guard/...``, ``clip/...``)
        self.policy_figures: dict[str, float] = {}
        # Steps skipped on the device with non-finite gradients since the last report: (count, first step, index of
        # its first non-finite parameter), named at the next report; the names of those parameters.
        self._skipped_nonfinite: Tensor | None = None
        self._skipped_names: list[str] = []
        #: per_example / flight_recorder: every step's row, read with the next report (set by the callback)
        self.incidents: StepIncidents | None = None
        #: words after the step number in warnings (" (optimizer 'generator')" for one optimizer of several)
        self.label = ""

    @property
    def group(self) -> Any:
        """The process group of plain shards: as given, or what a callable given returns now (a callback is made
        before the process group exists, where ``torch.distributed.group.WORLD`` is still None)."""
        return self._group() if callable(self._group) else self._group

    def _check_fsdp1_group(self, params: list[tuple[str, Tensor]]) -> None:
        """Once: warn where FSDP1 shards over several ranks are read without a group (this rank's figures alone)."""
        self._fsdp1_checked = True
        flat = flat_param_types()
        if not flat or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        for name, p in params:
            if getattr(p, "_fsdp_flattened", False) is True and (
                    (flat_param_shards(p) or 1) > 1 if isinstance(p, flat) else p.numel() == 0):
                logger.warning(
                    "torch_gradstats: %r is a shard of FSDP1 over several ranks, but no group= was given: the "
                    "figures are this rank's shard's alone, not the model's. Pass group= the group FSDP shards over; "
                    "a callback made before the process group exists takes a callable, e.g. group=lambda: "
                    "torch.distributed.group.WORLD (torch.distributed.group.WORLD itself is None until then)", name)
                return

    @property
    def every_step(self) -> bool:
        """A policy judges or clips every optimizer step, so the statistics are taken every step."""
        return self.spike_guard is not None or self.adaptive_clip is not None or self.incidents is not None

    def apply_policies(self, module: nn.Module, stats: GradStats | GradWeightStats,
                       loss: Tensor | None) -> Tensor | None:
        """Clip to the adaptive threshold and judge the step, on the device (no host sync). Both see the norm
        before clipping, as the Trainer's do. Returns the guard's factor (1.0 take, 0.0 skip), or None."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        if not len(g.names):
            return None
        factor = None
        with torch.no_grad():
            if self.spike_guard is not None:
                factor = self.spike_guard.observe(g.total_norm, mean_over_ranks(loss))
            if self.adaptive_clip is not None:
                threshold = self.adaptive_clip.threshold(g.total_norm)
                clip_with_threshold_(self.trainable(module, self._optimizer), threshold, stats=g, group=self.group,
                                     stage_group=self.stage_group, tied=self.tied)
        return factor

    def policy_state(self) -> dict[str, Any]:
        """The guard's and the clip's statistics, each where given (a callback's ``state_dict``)."""
        state: dict[str, Any] = {}
        if self.spike_guard is not None:
            state["spike_guard"] = self.spike_guard.state_dict()
        if self.adaptive_clip is not None:
            state["adaptive_clip"] = self.adaptive_clip.state_dict()
        return state

    def check_policy_state(self, state: dict[str, Any]) -> None:
        """Raise the error :meth:`load_policy_state` would raise for ``state``, loading nothing: a state that is not
        a callback's (a TypeError or a ValueError naming its keys), or a policy's state that its own
        ``load_state_dict`` refuses (checked by loading it into a new policy)."""
        if not isinstance(state, dict):
            raise TypeError(f"GradStatsCallback.load_state_dict: expected the dict of the callback's state_dict(), got "
                            f"{type(state).__name__}")
        unknown = [k for k in state if k not in ("spike_guard", "adaptive_clip")]
        if unknown:
            raise ValueError(f"GradStatsCallback.load_state_dict: the state has key(s) {unknown}; a callback's "
                             "state_dict() holds only 'spike_guard' and 'adaptive_clip' (a policy's own state_dict "
                             "loads into callback.spike_guard or callback.adaptive_clip)")
        for key, policy in (("spike_guard", self.spike_guard), ("adaptive_clip", self.adaptive_clip)):
            if key in state and policy is not None:
                type(policy)().load_state_dict(state[key])

    def load_policy_state(self, state: dict[str, Any]) -> bool:
        """Restore what :meth:`policy_state` saved; a policy saved that this taker lacks is named in a warning and
        left out. Returns whether anything was restored. Anything else (a policy's own ``state_dict``, another
        object's) is refused with a ValueError naming its keys: restoring nothing from it would go unnoticed. Both
        policies' states are checked before either is loaded, so a corrupt one leaves the other as it was too."""
        self.check_policy_state(state)
        restored = False
        for key, policy in (("spike_guard", self.spike_guard), ("adaptive_clip", self.adaptive_clip)):
            if key not in state:
                continue
            if policy is None:
                logger.warning("torch_gradstats: the checkpoint holds GradStatsCallback's %s statistics%s, but this "
                               "callback has no %s: they are not restored", key, self.label, key)
            else:
                policy.load_state_dict(state[key])
                restored = True
        return restored

    @staticmethod
    def trainable(module: nn.Module, optimizer: Any = None) -> list[tuple[str, Tensor]]:
        """The parameters an optimizer step reads: those that require grad, and one frozen since its gradient was
        accumulated (``requires_grad_(False)`` between the micro-batches of a step), whose gradient the optimizer
        still applies; where ``optimizer``'s param groups are known, only if it holds it (a gradient left on a
        parameter it does not hold is never applied, nor cleared by its ``zero_grad``)."""
        params: list[tuple[str, Tensor]] = [(n, p) for n, p in module.named_parameters()
                                            if p.requires_grad or p.grad is not None]
        groups = getattr(optimizer, "param_groups", None)
        if groups and any(not p.requires_grad for _, p in params):
            held = {id(q) for group in groups for q in group["params"]}
            params = [(n, p) for n, p in params if p.requires_grad or id(p) in held]
        return params

    def take(self, module: nn.Module, optimizer: Any, histogram: bool = False) -> GradStats | GradWeightStats:
        """Device statistics of the gradients (and weights, with learning rates) of ``module``, with the exponent
        histogram when ``histogram`` (see :func:`check_histogram`); no host sync."""
        self._optimizer = optimizer
        params = self.trainable(module, optimizer)
        group = self.group
        if group is None and not self._fsdp1_checked:
            self._check_fsdp1_group(params)
        if self.log_weight_norms or self.log_update_ratio:
            return grad_and_weight_stats(params, optimizer=optimizer, group=group)
        return grad_stats(params, group=group, stage_group=self.stage_group, tied=self.tied, histogram=histogram)

    @staticmethod
    def trained(module: nn.Module, optimizer: Any) -> list[tuple[str, Tensor]]:
        """The parameters an optimizer step trains now: those of ``module`` read (:meth:`trainable`) that, where the
        optimizer has param groups, are held by one of them (a parameter it does not hold is never updated). An
        optimizer holding none of them holds copies (master weights of another dtype): then every one counts."""
        params = StatsTaker.trainable(module, optimizer)
        groups = getattr(optimizer, "param_groups", None)
        if groups:
            held = {id(p) for group in groups for p in group["params"]}
            params = [(n, p) for n, p in params if id(p) in held] or params
        return params

    def snapshot(self, module: nn.Module) -> None:
        """Copy the weights of the parameters this step trains (:meth:`trained`, with the optimizer last given to
        :meth:`take`), right before the optimizer step. The set is found again at every snapshot: when layers are
        unfrozen (``requires_grad_(True)``, a param group added) or frozen, the measurement follows them from this
        step on, a parameter first trained now measured against its weights of now. Unchanged, it costs a tuple of
        ids, no allocation and no host sync."""
        params = self.trained(module, self._optimizer)
        key = tuple(id(p) for _, p in params)
        if key != self._ratio_key:
            before = set(self.ratio.names) if self.ratio is not None else set()
            if self.ratio is not None:
                self.ratio.release()
            self.ratio = UpdateRatio(params, group=self.group) if params else None
            now = set(self.ratio.names) if self.ratio is not None else set()
            mib = self.ratio.nbytes / 2**20 if self.ratio is not None else 0.0
            if self._ratio_key is None:
                logger.info("torch_gradstats: measuring update ratios keeps one copy of the weights (%.1f MiB)", mib)
            else:
                logger.info("torch_gradstats: the trained parameters changed (%d added, %d removed, %d now): update "
                            "ratios are measured on those from this step on (a copy of %.1f MiB)", len(now - before),
                            len(before - now), len(now), mib)
            self._ratio_key = key
        if self.ratio is not None:
            self.ratio.snapshot()

    def measure(self, stats: GradStats | GradWeightStats) -> None:
        if self.ratio is not None and isinstance(stats, GradWeightStats):
            stats.update = self.ratio.measure()

    def report(self, stats: GradStats | GradWeightStats) -> AnyReport:
        """The one device-to-host transfer of a logging step: the statistics, the groups' figures when grouping,
        and the step policies' figures (into :attr:`policy_figures`; raises
        :class:`~torch_gradstats.SpikeStreakError` when the guard's ``max_consecutive`` was reached)."""
        groups = stats.grouped(self.group_by) if self.group_by is not None else None
        policies: list[SpikeGuard | AdaptiveClip] = [
            p for p in (self.spike_guard, self.adaptive_clip) if p is not None]
        extra = policy_extra(policies)
        record = self._skipped_nonfinite
        if record is not None:
            extra.insert(0, ExtraFigures([], [record], self._name_skipped_nonfinite))  # said before a streak error
        inc = self.incidents
        if inc is not None:  # the rows first: their warnings come before a streak error
            extra = [e for e in (inc.pending(), *extra, inc.example_figures()) if e is not None]
        try:
            report = stats.report(self.k, policy=self.policy, groups=groups, extra=extra)
        except SpikeStreakError as error:
            if inc is not None and inc.recorder is not None and inc.last_step is not None:
                inc.dump_on_error(inc.last_step, error)  # the optimizer step, which goes on in a resumed run
            raise
        self.policy_figures = dict(grad_report(report).extra)
        return report

    def check_layout(self, stats: GradStats | GradWeightStats) -> None:
        """On a rank that does not log, at a logging step: read the layout flags the logging rank reads with its
        report, so that the ranks agree on the rows again together (:meth:`GradStats.check_layout`)."""
        (stats.grads if isinstance(stats, GradWeightStats) else stats).check_layout()

    def note_step(self, stats: GradStats | GradWeightStats, factor: Tensor | None, step: int, loss: Tensor | None,
                  scale: Tensor | float, host_skipped: bool | None, *, skips_nonfinite: bool = False) -> None:
        """Where per_example or a flight recorder is kept: the step's row (no host read; read at once where the
        skip was decided on the host), then a new step for the per-example norms. ``skips_nonfinite``: a non-finite
        step is skipped whatever ``factor`` says (``on_nonfinite``, or a GradScaler), so its row says skipped."""
        inc = self.incidents
        if inc is None:
            return
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        groups = None  # with a recorder, the dump holds the groups the logs hold
        if self.group_by is not None and inc.recorder is not None and len(g.names):
            groups = g.grouped(self.group_by)
        skipped = None if factor is None else (factor.reshape(()) == 0)
        if skips_nonfinite and len(g.names):  # on the device: no host read
            bad = g.nonfinite_count > 0
            skipped = bad if skipped is None else skipped | bad.to(skipped.device)
        inc.note(step, g, skipped, scale=scale, loss=loss, guard=self.spike_guard, clip=self.adaptive_clip,
                 groups=groups)
        inc.begin_step()
        if host_skipped:
            inc.read_now()

    def record_skipped_nonfinite(self, stats: GradStats | GradWeightStats, factor: Tensor, step: int) -> None:
        """Where the step is skipped on the device: note it on the device when its gradients are non-finite (no
        host sync); the next :meth:`report` names its first non-finite parameter in a warning."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        if not len(g.names):
            return
        mask = g.nonfinite_mask
        if self._skipped_nonfinite is None or self._skipped_nonfinite.device != mask.device:
            self._skipped_nonfinite = torch.zeros(3, dtype=torch.int64, device=mask.device)
        record = self._skipped_nonfinite
        bad = (mask.any() & (factor.reshape(()) == 0).to(mask.device)).to(torch.int64)
        first = bad.bool() & (record[0] == 0)
        record.copy_(torch.stack([record[0] + bad, torch.where(first, step, record[1]),
                                  torch.where(first, mask.to(torch.int32).argmax().to(torch.int64), record[2])]))
        self._skipped_names = g.names

    def _name_skipped_nonfinite(self, floats: list[float], ints: list[int]) -> dict[str, float]:
        count, step, index = ints
        if count:
            assert self._skipped_nonfinite is not None
            self._skipped_nonfinite.zero_()  # on the device, no sync
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d%s: first non-finite parameter "
                           "%r; step skipped by the spike guard (%d such steps since the last report)",
                           step, self.label, self._skipped_names[index], count)
        return {}

    def warn_skipped_nonfinite(self, stats: GradStats | GradWeightStats, step: int) -> None:
        """Where a step was just skipped from the host: name its first non-finite parameter now, if any (one small
        transfer, on a skipped step only)."""
        if self.nonfinite(stats):
            logger.warning("torch_gradstats: non-finite gradient at optimizer step %d%s: %s; step skipped by the "
                           "spike guard", step, self.label, self.describe_nonfinite(stats))

    @staticmethod
    def nonfinite(stats: GradStats | GradWeightStats) -> bool:
        """Whether any gradient is NaN/Inf: one small device-to-host transfer."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        if not len(g.names):
            return False
        _, (count,) = to_host([], [g.nonfinite_count])
        return count > 0

    @staticmethod
    def describe_nonfinite(stats: GradStats | GradWeightStats) -> str:
        """The first non-finite parameter by name, with the counts, as :func:`describe_nonfinite` words them.

        One more small transfer: made only on a step already found non-finite, so a healthy step pays nothing."""
        g = stats.grads if isinstance(stats, GradWeightStats) else stats
        mask = g.nonfinite_mask
        first_index = mask.to(torch.int32).argmax()  # argmax returns the first maximum: model order
        _, (first, n_bad, nan, inf) = to_host([], [first_index, mask.sum(), g.nan_count, g.inf_count])
        return _describe(g.names[first], n_bad, nan, inf)


def describe_nonfinite(report: AnyReport) -> str:
    """``'<first non-finite parameter>' and N more (a NaN, b Inf)`` from a report already on the host."""
    g = grad_report(report)
    return _describe(g.first_nonfinite, len(g.nonfinite), g.nan_count, g.inf_count)


def _describe(first: str | None, n_tensors: int, nan: int, inf: int) -> str:
    more = f" and {n_tensors - 1} more" if n_tensors > 1 else ""
    return f"{first!r}{more} ({nan} NaN, {inf} Inf)"


def logs_here(who: str, framework_rank_zero: bool, log_rank: int | None) -> bool:
    """Whether a callback transfers and logs on this process: the framework's own logging process (global rank 0,
    the only one where Lightning's loggers and the Hugging Face Trainer's ``report_to`` integrations write), or
    global rank ``log_rank``."""
    return framework_rank_zero if log_rank is None else writes_here(who, None, None, log_rank)
