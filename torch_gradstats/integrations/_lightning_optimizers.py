"""The Lightning callback with several optimizers (a GAN's generator and discriminator, manual optimization): which
parameters each optimizer's step reads, the key names its figures are logged under, its own step policies, and their
checkpoint state.

Split from ``lightning.py``: a job of its own (the per-optimizer bookkeeping), and that module was near 500 lines.
Nothing here imports a Lightning package; the callback hands in its trainer and module.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.integrations._common import ActivationReporting, PolicyState, StatsTaker
from torch_gradstats.integrations._lightning_incidents import (
    grad_versions,
    optimizer_incidents,
    optimizer_recorder,
    start_examples_afresh,
)
from torch_gradstats.monitors.activations import ActivationReport
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.guard import SpikeGuard

logger = logging.getLogger("torch_gradstats")

POLICIES = ("spike_guard", "adaptive_clip")


def check_optimizer_names(names: Any) -> tuple[str, ...] | None:
    """Validate ``optimizer_names``: None, or distinct non-empty strings without ``/`` (each becomes one segment of
    the logged keys)."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"optimizer_names must be a sequence of str (one per optimizer, in configure_optimizers "
                        f"order) or None, got {type(names).__name__}")
    out: list[str] = []
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(f"optimizer_names[{i}] must be a str, got {type(name).__name__}")
        if not name or "/" in name:
            raise ValueError(f"optimizer_names[{i}] must be a non-empty str without '/', got {name!r}")
        if name in out:
            raise ValueError(f"optimizer_names[{i}]: {name!r} is given twice")
        out.append(name)
    if not out:
        raise ValueError("optimizer_names must name at least one optimizer (or be None)")
    return tuple(out)


def optimizer_key(key: str, name: str, prefix: str) -> str:
    """Where optimizer ``name``'s figure ``key`` is logged: our keys as ``<prefix><name>/<rest>``, any other key with
    ``name`` as its second path segment (``grad_2.0_norm/<name>/<parameter>``, ``guard/<name>/skipped``), or as its
    last one where it has a single segment (``grad_2.0_norm_total/<name>``)."""
    if prefix and key.startswith(prefix):
        return f"{prefix}{name}/{key[len(prefix):]}"
    head, slash, rest = key.partition("/")
    return f"{head}/{name}/{rest}" if slash else f"{key}/{name}"


def raw_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (the object itself otherwise)."""
    return getattr(optimizer, "_optimizer", optimizer) if type(optimizer).__name__ == "LightningOptimizer" \
        else optimizer


class OptimizerTaker(StatsTaker):
    """A :class:`StatsTaker` of one optimizer among several: it reads only the parameters its optimizer holds at
    this step (named as in the LightningModule, in its order) and keeps its own copies of the step policies."""

    def __init__(self, template: StatsTaker, name: str, optimizer: Any) -> None:
        super().__init__(template.log_weight_norms, template.log_update_ratio, template._group, template.policy,
                         template.k, group_by=template.group_by,
                         spike_guard=copy.deepcopy(template.spike_guard),
                         adaptive_clip=copy.deepcopy(template.adaptive_clip),
                         stage_group=template.stage_group, tied=template.tied)
        self.name = name
        self.label = f" (optimizer {name!r})"
        self._optimizer = optimizer
        #: the activation watch's report read at this optimizer's step, for a report made after the batch
        self.activation: ActivationReport | None = None

    def trainable(self, module: nn.Module, optimizer: Any = None) -> list[tuple[str, Tensor]]:  # type: ignore[override]
        """The parameters this optimizer's param groups hold now that require a gradient (``toggle_optimizer``
        leaves them so) or hold one (frozen since it was accumulated): found again at every step, so a param group
        added during training (``add_param_group``) or a parameter replaced in a group is read from that step on.
        ``optimizer`` is ignored: this taker's optimizer is its own."""
        return [(n, p) for n, p in held_params(module, raw_optimizer(self._optimizer), self.name)
                if p.requires_grad or p.grad is not None]

    def trained(self, module: nn.Module, optimizer: Any) -> list[tuple[str, Tensor]]:  # type: ignore[override]
        """The parameters whose update this optimizer's step measures: those it reads (with every one of them
        frozen, none, never another optimizer's)."""
        return self.trainable(module)


def optimizer_takers(trainer: Any, pl_module: nn.Module, template: StatsTaker,
                     names: tuple[str, ...] | None) -> dict[int, OptimizerTaker] | None:
    """One :class:`OptimizerTaker` per optimizer of ``trainer``, by the optimizer's id, where there are several (or
    ``names`` were given); None for the one-optimizer callback, whose keys and reads stay the whole module's."""
    optimizers = list(getattr(trainer, "optimizers", []) or [])
    if names is None and len(optimizers) < 2:
        return None
    if names is not None and len(names) != len(optimizers):
        raise ValueError(f"GradStatsCallback: optimizer_names names {len(names)} optimizer(s) {list(names)}, but "
                         f"configure_optimizers returned {len(optimizers)}")
    names = names or tuple(f"optimizer_{i}" for i in range(len(optimizers)))
    takers: dict[int, OptimizerTaker] = {}
    for name, optimizer in zip(names, optimizers):
        held_params(pl_module, optimizer, name)  # a parameter outside the module is named now
        takers[id(optimizer)] = OptimizerTaker(template, name, optimizer)
    return takers


def held_params(module: nn.Module, optimizer: Any, name: str) -> list[tuple[str, Tensor]]:
    """The parameters ``optimizer``'s param groups hold now, named as in ``module`` and in its order; a ValueError
    names the optimizer when one of them is not a parameter of the module (its figures could not be named)."""
    held = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    params = [(n, p) for n, p in module.named_parameters() if held.get(id(p)) is p]
    if len(params) != len(held):
        named = {id(p) for _, p in params}
        p = next(p for i, p in held.items() if i not in named)
        raise ValueError(f"GradStatsCallback: optimizer {name!r} ({type(optimizer).__name__}) holds a parameter of "
                         f"shape {tuple(p.shape)} that is not one of the LightningModule's parameters, so its figures "
                         f"could not be named")
    return params


def load_optimizer_states(takers: dict[int, OptimizerTaker], states: dict[str, Any]) -> bool:
    """Restore each optimizer's policy statistics from a checkpoint's ``{"optimizers": {name: state}}``; returns
    whether anything was restored. Names must match this run's optimizers."""
    names = [t.name for t in takers.values()]
    unknown = [n for n in states if n not in names]
    if unknown:
        raise ValueError(f"GradStatsCallback: the checkpoint holds step-policy statistics of optimizer(s) {unknown}, "
                         f"but this run's optimizers are {names} (give the same optimizer_names as the saved run)")
    for taker in takers.values():  # every optimizer's state checked before any is loaded: none half restored
        if taker.name in states:
            taker.check_policy_state(states[taker.name])
    restored = False
    for taker in takers.values():
        if taker.name in states:
            restored = taker.load_policy_state(states[taker.name]) or restored
    return restored


class SeveralOptimizers(ActivationReporting, PolicyState):
    """The callback's side of several optimizers: one :class:`OptimizerTaker` each, made when training starts (the
    optimizers exist then), with its own per-example norms and flight recorder, and the policies' per-optimizer
    checkpoint state (loaded before they exist)."""

    taker: StatsTaker
    optimizer_names: tuple[str, ...] | None
    flight_recorder: FlightRecorder | None
    _per_example: bool
    _takers: dict[int, OptimizerTaker] | None
    _saved_optimizer_states: dict[str, Any] | None
    _one_optimizer_state: bool
    _policies_restored: bool
    _pending: dict[int, tuple[StatsTaker, Any, int]]

    def __init__(self) -> None:
        super().__init__()
        self._measured: set[int] = set()  # takers whose pending update was measured right after its step (ids)
        self._measure_hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers with that step post-hook
        self._flight_recorders: dict[str, FlightRecorder] = {}  # each optimizer's, by name, kept from fit to fit
        self._grads_seen: dict[int, dict[int, tuple[int, int]]] = {}  # by taker id: its gradients after a backward

    def _start_optimizers(self, trainer: Any, pl_module: nn.Module) -> None:
        """At ``on_train_start``: the takers of several optimizers (None with one), with the statistics carried over
        from an earlier fit of this callback or loaded from a checkpoint, each to the optimizer of its name."""
        carried = {t.name: t.policy_state() for t in (self._takers or {}).values()}
        self._takers = optimizer_takers(trainer, pl_module, self.taker, self.optimizer_names)
        self._start_incidents(pl_module)
        saved, self._saved_optimizer_states = self._saved_optimizer_states, None
        if self._takers is None:
            if saved and len(saved) == 1:  # saved with optimizer_names of one optimizer: its statistics are ours
                super().load_state_dict(next(iter(saved.values())))
            elif saved:
                raise ValueError(f"GradStatsCallback: the checkpoint holds the step-policy statistics of optimizers "
                                 f"{sorted(saved)}, but this run has one optimizer")
            return
        # One optimizer named by optimizer_names, resumed from a checkpoint saved without: its copies of the policies
        # were made from the ones that checkpoint restored.
        one, self._one_optimizer_state = self._one_optimizer_state and len(self._takers) > 1, False
        if one:
            which = " and ".join(k for k in POLICIES if getattr(self, k) is not None)
            raise ValueError(f"GradStatsCallback: the checkpoint holds one optimizer's {which} statistics, but this "
                             f"run has {len(self._takers)} optimizers, each judged by its own {which}")
        restored = load_optimizer_states(self._takers, {n: st for n, st in carried.items()
                                                        if n in {t.name for t in self._takers.values()}})
        if saved:
            restored = load_optimizer_states(self._takers, saved) or restored
        self._policies_restored = self.policies_restored or restored

    def _start_incidents(self, pl_module: nn.Module) -> None:
        """With optimizer takers: each one's per-example norms (over the modules holding its parameters) and flight
        recorder, in place of the whole module's made at setup, whose rows would mix the optimizers' steps."""
        if self._takers is None or self.taker.incidents is None:
            return
        self.taker.incidents.remove()
        self.taker.incidents = None
        for taker in self._takers.values():
            params = [p for _, p in held_params(pl_module, raw_optimizer(taker._optimizer), taker.name)]
            recorder = optimizer_recorder(self.flight_recorder, self._flight_recorders, taker.name)
            taker.incidents = optimizer_incidents(pl_module, taker.name, params, self._per_example, recorder)

    def _examples_afresh(self) -> None:
        """Before a backward (``on_before_backward``): each optimizer whose gradients were cleared since its last
        backward starts its examples afresh (:func:`start_examples_afresh`)."""
        for taker in (self._takers or {}).values():
            if taker.incidents is not None and taker.incidents.per_example is not None:
                start_examples_afresh(taker.incidents, self._held(taker), self._grads_seen.get(id(taker), {}))

    def _examples_seen(self) -> None:
        """After a backward (``on_after_backward``): each optimizer's gradients as it left them, so that the next
        backward tells a ``zero_grad(set_to_none=False)`` since (:func:`grad_versions`)."""
        for taker in (self._takers or {}).values():
            if taker.incidents is not None and taker.incidents.per_example is not None:
                self._grads_seen[id(taker)] = grad_versions(self._held(taker))

    @staticmethod
    def _held(taker: OptimizerTaker) -> list[Tensor]:
        return [p for g in raw_optimizer(taker._optimizer).param_groups for p in g["params"]]

    def _remove_incidents(self) -> None:
        """At teardown: every optimizer's per-example hooks removed (the flight recorders are kept, by name)."""
        for taker in (self._takers or {}).values():
            if taker.incidents is not None:
                taker.incidents.remove()
                taker.incidents = None
        self._grads_seen = {}

    def _step_taker(self, optimizer: Any) -> StatsTaker:
        """The taker of the optimizer step beginning now (:meth:`_taker`). With several optimizers one watch step of
        ``watch_activations`` (a batch, from the first watched module's call) holds every optimizer's forwards and
        backwards, one optimizer's step after the other's: its report is made again at each optimizer's step, so
        that the discriminator's ``act/`` figures and warnings see what ran since the generator's step too, not the
        report made there (one more transfer per optimizer on a logging step, as with one optimizer)."""
        if self._takers is not None:
            self._activation_at = -2
        return self._taker(optimizer)

    def _hold_pending(self, taker: StatsTaker, optimizer: Any, logs_here: bool) -> None:
        """At a logging optimizer step whose report waits for the batch's end (``log_update_ratio``, the weights
        just copied): the update is measured right after this optimizer's step, by a step post-hook on it, so that
        a later optimizer's step in the batch (a parameter held by both, a later step of the same optimizer) is not
        counted in it; at the batch's end where the step never ran (a GradScaler's skip). With several optimizers,
        also read the watch's report now, which describes what ran before this optimizer's step (at the batch's end
        it would hold the later optimizers' forwards and backwards too)."""
        raw = raw_optimizer(optimizer)
        self._measured.discard(id(taker))
        if isinstance(raw, torch.optim.Optimizer) and raw not in self._measure_hooked:
            raw.register_step_post_hook(self._measure_after_step)
            self._measure_hooked.add(raw)
        if isinstance(taker, OptimizerTaker) and logs_here and self.activation_watch is not None:
            taker.activation = self._activation_report()
        elif logs_here:  # one optimizer: the step's figures, not those of forwards run before the batch's end
            self._hold_activation()

    def _measure_after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        taker = self._taker(optimizer) if self._takers is None or id(optimizer) in self._takers else None
        entry = self._pending.get(id(taker)) if taker is not None else None
        if entry is not None and id(entry[0]) not in self._measured:
            entry[0].measure(entry[1])
            self._measured.add(id(entry[0]))

    def _measure_pending(self, taker: StatsTaker, stats: Any) -> None:
        """At the batch's end: measure a pending update that its optimizer's step has not measured."""
        if id(taker) not in self._measured:
            taker.measure(stats)
        self._measured.discard(id(taker))

    def _use_held_activation(self, taker: StatsTaker) -> None:
        """Before that report is logged: the watch's report read at its optimizer's step is the one it logs."""
        if isinstance(taker, OptimizerTaker) and taker.activation is not None and self.activation_watch is not None:
            self.last_activation_report, self._activation_at = taker.activation, self.activation_watch.step
            taker.activation = None

    def _taker(self, optimizer: Any) -> StatsTaker:
        """The taker of ``optimizer``'s steps: the callback's own with one optimizer, else that optimizer's."""
        if self._takers is None:
            return self.taker
        taker = self._takers.get(id(raw_optimizer(optimizer)))
        if taker is None:
            raise ValueError(f"GradStatsCallback: an optimizer ({type(raw_optimizer(optimizer)).__name__}) that is not "
                             "one of trainer.optimizers took a step")
        return taker

    @property
    def spike_guards(self) -> dict[str, SpikeGuard]:
        """With several optimizers (once training started): each optimizer's own copy of ``spike_guard``, by its
        key name; empty with one optimizer, whose guard is :attr:`spike_guard` itself."""
        return {t.name: t.spike_guard for t in (self._takers or {}).values() if t.spike_guard is not None}

    @property
    def flight_recorders(self) -> dict[str, FlightRecorder]:
        """With several optimizers, or ``optimizer_names`` given (once training started with ``flight_recorder=``):
        each optimizer's own :class:`~torch_gradstats.FlightRecorder`, by its key name, made with the capacity and
        ``dump_dir`` of the one given (which records nothing then) and kept from fit to fit; empty with one unnamed
        optimizer, whose recorder is :attr:`flight_recorder` itself."""
        return dict(self._flight_recorders)

    @property
    def adaptive_clips(self) -> dict[str, AdaptiveClip]:
        """With several optimizers (once training started): each optimizer's own copy of ``adaptive_clip``, by its
        key name; empty with one optimizer, whose clip is :attr:`adaptive_clip` itself."""
        return {t.name: t.adaptive_clip for t in (self._takers or {}).values() if t.adaptive_clip is not None}

    def state_dict(self) -> dict[str, Any]:
        """The step policies' statistics: with one optimizer ``{"spike_guard": ..., "adaptive_clip": ...}`` (each
        where given), with several ``{"optimizers": {name: {...}}}``, each optimizer's own (see the base class)."""
        if self._takers is not None:
            states = {t.name: t.policy_state() for t in self._takers.values()}
            return {"optimizers": states} if any(states.values()) else {}
        if self._saved_optimizer_states is not None:
            return {"optimizers": dict(self._saved_optimizer_states)}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; several optimizers' statistics go to the optimizers of the same
        names (when training starts, if the optimizers do not exist yet)."""
        if "optimizers" in state_dict:
            if self._takers is None:
                self._saved_optimizer_states = dict(state_dict["optimizers"])
            elif load_optimizer_states(self._takers, state_dict["optimizers"]):
                self._policies_restored = True
            return
        super().load_state_dict(state_dict)
        self._one_optimizer_state = any(k in state_dict and getattr(self, k) is not None for k in POLICIES)

