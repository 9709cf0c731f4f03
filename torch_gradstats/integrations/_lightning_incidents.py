"""Per-example norms and flight recorders of the Lightning callback with several optimizers: each optimizer's own
:class:`~torch_gradstats.training._incidents.StepIncidents`, its per-example norms taken over the modules that hold
its parameters, its flight recorder dumped under its name.

Split from ``_lightning_optimizers.py``: a job of its own (which examples and which steps belong to which optimizer),
and that module was near 300 lines of per-optimizer bookkeeping already. Nothing here imports a Lightning package.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import Tensor, nn

from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.training._incidents import UNREAD_MAX, StepIncidents

__all__ = ["HeldModules", "grad_versions", "optimizer_incidents", "optimizer_recorder", "start_examples_afresh"]


class HeldModules(nn.Module):
    """A view of ``module`` for one optimizer's :class:`~torch_gradstats.PerExampleNorms`: only the modules that
    directly own one of ``params``, and of their parameters only ``params``, named as in ``module``; and every
    BatchNorm, checked at each call but not hooked (one in training mode mixes the examples of any backward through
    it, the other optimizer's network's too). The other optimizers' modules are not hooked, so a backward through
    them (the generator's loss goes through the discriminator) neither computes nor counts their per-example
    gradients in this optimizer's norms.

    A view, not a container: the modules are not registered as its children (they stay the LightningModule's); only
    ``named_modules`` and ``named_parameters`` (and so ``modules`` and ``parameters``) see them. The set is fixed when
    made: a module first given to the optimizer later (``add_param_group``) is not in it.
    """

    def __init__(self, module: nn.Module, params: Sequence[Tensor]) -> None:
        super().__init__()
        held = {id(p) for p in params}
        # a tuple, so that nn.Module does not register them as submodules of the view
        self._owners: tuple[tuple[str, nn.Module], ...] = tuple(
            (name, m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            or any(id(p) in held for p in m.parameters(recurse=False)))
        # only the optimizer's own: a module whose weight one optimizer holds and its bias another (or none) is
        # hooked by both, each counting its own parameters' per-example gradients
        self._params: tuple[tuple[str, nn.Parameter], ...] = tuple(
            (name, p) for name, p in module.named_parameters() if id(p) in held)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        yield from self._owners

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._params


def optimizer_recorder(template: FlightRecorder | None, recorders: dict[str, FlightRecorder],
                       name: str) -> FlightRecorder | None:
    """Optimizer ``name``'s flight recorder: the one it had in an earlier fit of this callback, else a new one with
    the capacity and ``dump_dir`` of ``flight_recorder=`` (the object given is a template, as the policies are: one
    ring holds one optimizer's steps, whose figures would not line up with the other's)."""
    if template is None:
        return None
    if name not in recorders:
        recorders[name] = FlightRecorder(template.capacity, dump_dir=template.dump_dir)
    return recorders[name]


def optimizer_incidents(module: nn.Module, name: str, params: Sequence[Tensor], per_example: bool,
                        recorder: FlightRecorder | None) -> StepIncidents | None:
    """Optimizer ``name``'s record of incidents: per-example norms over the modules holding ``params`` (its
    parameters) and its own flight recorder, each where asked for; None where neither is."""
    if not per_example and recorder is None:
        return None
    view = HeldModules(module, params) if per_example else None
    return StepIncidents(view, per_example=per_example, recorder=recorder, who="GradStatsCallback",
                         nonfinite_told=True, name=name, read_after=UNREAD_MAX)


def grad_versions(params: Sequence[Tensor]) -> dict[int, tuple[int, int]]:
    """After a backward: each parameter's gradient tensor and its version counter (bumped by every in-place change),
    for :func:`start_examples_afresh`. Host reads of tensor attributes: no sync."""
    return {id(p): (id(p.grad), p.grad._version) for p in params if p.grad is not None}


def start_examples_afresh(incidents: StepIncidents | None, params: Sequence[Tensor],
                          seen: dict[int, tuple[int, int]]) -> None:
    """Before a backward: where the optimizer's ``zero_grad`` ran since its last backward, its gradient starts afresh
    with this backward, so its examples do too. Without ``toggle_optimizer`` the generator's backward reaches the
    discriminator's modules, whose examples would otherwise be counted before the discriminator's own (after its
    ``zero_grad`` they are no part of its gradient). Cleared means: every parameter's gradient is None
    (``set_to_none=True``), or was changed in place since the last backward (``seen``, :func:`grad_versions`):
    ``zero_grad(set_to_none=False)`` zeroes it so. A host check of ``.grad`` and its version: no sync."""
    if incidents is None or incidents.per_example is None:
        return
    if all(p.grad is None or seen.get(id(p), (id(p.grad), p.grad._version)) != (id(p.grad), p.grad._version)
           for p in params):
        incidents.begin_step()
