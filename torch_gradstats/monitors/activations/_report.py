"""The host side of :class:`~torch_gradstats.ActivationWatch`: its report and how the origin is found.

Plain Python numbers that already crossed to the host in the watch's one transfer; nothing here touches a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ROOT", "ActivationReport", "HookFigures", "ModuleFigures", "build_report"]

#: The name of the watched model itself, in reports, keys and warnings.
ROOT = "<root>"

#: Per tensor of one hook call: (sum of squares, max |x|, NaN count, Inf count).
TensorFigures = tuple[float, float, int, int]
#: One hook call of the reported step: module path, how many tensors of each kind (forward: inputs, outputs,
#: parameters; backward: grad_output, grad_input), and the figures of every tensor in that order.
HookFigures = tuple[str, tuple[int, ...], list[TensorFigures]]


def _nan_max(values: Sequence[float]) -> float:
    """max() that propagates NaN; 0.0 for no values."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def _group(values: Sequence[TensorFigures]) -> TensorFigures:
    """(sum of squares, max |x|, NaN count, Inf count) over tensors."""
    return (
        sum(v[0] for v in values),
        _nan_max([v[1] for v in values]),
        sum(v[2] for v in values),
        sum(v[3] for v in values),
    )


def _sqrt(x: float) -> float:
    return math.sqrt(x) if not math.isnan(x) else math.nan


@dataclass
class ModuleFigures:
    """One module's figures at the reported step (several calls of one module in a step are merged).

    Forward: ``max_abs``, ``norm`` (L2 over all its floating outputs), ``nan_count``, ``inf_count`` of its outputs;
    ``input_max_abs`` and ``input_nonfinite`` (NaN + Inf count) of its floating inputs; ``weight_max_abs`` of its own
    parameters (None if it owns none). Backward (None when the backward of that step was not recorded):
    ``grad_max_abs``, ``grad_norm``, ``grad_nonfinite`` of ``grad_output``; ``grad_input_max_abs`` and
    ``grad_input_nonfinite`` of ``grad_input``. ``calls``: how many times its forward ran in the step.
    """

    max_abs: float = 0.0
    norm: float = 0.0
    nan_count: int = 0
    inf_count: int = 0
    input_max_abs: float = 0.0
    input_nonfinite: int = 0
    weight_max_abs: float | None = None
    grad_max_abs: float | None = None
    grad_norm: float | None = None
    grad_nonfinite: int | None = None
    grad_input_max_abs: float | None = None
    grad_input_nonfinite: int | None = None
    calls: int = 0


@dataclass
class ActivationReport:
    """What :meth:`ActivationWatch.report` found at the latest recorded step (plain Python values).

    Attributes:
        step: the step described (steps are calls of the model's forward, from 0), or None if none was recorded.
        forward_origin: the first module, in forward order, whose output is non-finite while its floating inputs
            were finite: the producer. ``"<root>"`` (the model itself, always read; it finishes last) when no watched
            module inside it produced it: the root's own code (a loss computed in ``forward``) or an unwatched module.
            None if the forward was finite, or the model's inputs were already non-finite.
        forward_propagators: the other modules whose output is non-finite, in forward order.
        inputs_nonfinite: the model's own floating inputs held a NaN/Inf (then no module is the origin).
        forward_first_nonfinite: the first module in forward order with a non-finite output (the origin when there
            is one; otherwise the value came in with the inputs or from code outside every watched module).
        input_max_abs, weight_max_abs: max |x| of the forward origin's inputs and own parameters (None without one).
        backward_origin: the first module, in backward order, whose ``grad_input`` is non-finite while its
            ``grad_output`` was finite. When the forward was already non-finite this is a consequence, not a cause.
        backward_propagators: the other modules with a non-finite ``grad_output`` or ``grad_input``, in order.
        backward_first_nonfinite: the first module in backward order with a non-finite ``grad_output`` or
            ``grad_input``; when it is not the backward origin, the value came from the backward of code outside the
            watched modules (the loss, or the root's own code).
        backward_recorded: the backward of this step ran while the watch had backward hooks on.
        modules: module path -> :class:`ModuleFigures`, in forward order.
        forward_order, backward_order: module paths in the order their forward finished / their backward hook ran.
    """

    step: int | None
    forward_origin: str | None
    forward_propagators: list[str]
    inputs_nonfinite: bool
    forward_first_nonfinite: str | None
    input_max_abs: float | None
    weight_max_abs: float | None
    backward_origin: str | None
    backward_propagators: list[str]
    backward_first_nonfinite: str | None
    backward_recorded: bool
    modules: dict[str, ModuleFigures]
    forward_order: list[str]
    backward_order: list[str]

    @property
    def nonfinite(self) -> bool:
        """A NaN/Inf was seen in the forward (inputs included) or the backward of the step."""
        return (
            self.inputs_nonfinite
            or self.forward_first_nonfinite is not None
            or self.backward_origin is not None
            or self.backward_first_nonfinite is not None
        )

    @property
    def origin(self) -> str | None:
        """One label for where it started: the forward origin, ``"<inputs>"`` if the model's inputs were
        non-finite, else the backward origin. None when all was finite, and when no watched module produced the
        value (a module that only received it is never named: :meth:`summary` says where it was first seen)."""
        if self.forward_origin is not None:
            return self.forward_origin
        if self.inputs_nonfinite:
            return "<inputs>"
        if self.forward_first_nonfinite is not None:
            return None
        return self.backward_origin

    def summary(self) -> str:
        """One line naming the origin (for a log message)."""
        if self.step is None:
            return "no forward recorded yet"
        if not self.nonfinite:
            return f"activations finite at step {self.step}"
        parts = []
        if self.forward_origin is not None:
            parts.append(
                f"forward origin {self.forward_origin} (inputs max |x| {self.input_max_abs:.4g}, "
                + (f"weights max |x| {self.weight_max_abs:.4g})" if self.weight_max_abs is not None else "no weights)")
            )
            first = self.forward_first_nonfinite
            if self.forward_origin == ROOT:
                parts[-1] += (
                    ": made by code outside the watched modules (the root's own forward or an unwatched module)"
                    + (f", first seen by {first}" if first not in (None, ROOT) else "")
                )
        elif self.inputs_nonfinite:
            parts.append("the model's inputs were non-finite")
        elif self.forward_first_nonfinite is not None:
            parts.append(
                f"first non-finite output in {self.forward_first_nonfinite}, whose inputs were already non-finite: "
                "made by code outside the watched modules"
            )
        if self.backward_origin is not None:
            parts.append(f"backward origin {self.backward_origin}")
        elif self.backward_first_nonfinite is not None:
            parts.append(
                f"first non-finite gradient in the backward of {self.backward_first_nonfinite}, which received it: "
                "made in the backward of code outside the watched modules (the loss, or the root's own code)"
            )
        return f"non-finite activations at step {self.step}: " + "; ".join(parts)

    def to_dict(self, per_module: bool = False) -> dict[str, Any]:
        """Flat metrics: ``act/origin`` (see :attr:`origin`; None when all finite) and, with ``per_module``,
        ``act/<module>/max_abs`` for every module."""
        out: dict[str, Any] = {"act/origin": self.origin}
        if per_module:
            for name, fig in self.modules.items():
                out[f"act/{name}/max_abs"] = fig.max_abs
        return out


def build_report(
    step: int | None,
    forward: list[HookFigures],
    backward: list[HookFigures],
    inputs: list[TensorFigures] | None,
    forward_order: list[str],
    backward_order: list[str],
) -> ActivationReport:
    """The report of one step from its hook calls, each list in execution order (``inputs``: the model's own
    floating inputs, None if it had none)."""
    modules: dict[str, ModuleFigures] = {}
    inputs_nonfinite = inputs is not None and sum(_group(inputs)[2:]) > 0
    origin: str | None = None
    first_bad: str | None = None
    in_max = w_max = None
    bad_fwd: list[str] = []
    for name, (n_in, n_out, _n_par), values in forward:
        _, i_max, i_nan, i_inf = _group(values[:n_in])
        o_sq, o_max, o_nan, o_inf = _group(values[n_in : n_in + n_out])
        params = values[n_in + n_out :]
        fig = modules.setdefault(name, ModuleFigures())
        fig.norm = _sqrt(fig.norm**2 + o_sq)
        fig.max_abs = _nan_max([fig.max_abs, o_max])
        fig.nan_count += o_nan
        fig.inf_count += o_inf
        fig.input_max_abs = _nan_max([fig.input_max_abs, i_max])
        fig.input_nonfinite += i_nan + i_inf
        if params:
            fig.weight_max_abs = _nan_max([fig.weight_max_abs or 0.0, _group(params)[1]])
        fig.calls += 1
        if o_nan + o_inf == 0:
            continue
        first_bad = first_bad or name
        if origin is None and not inputs_nonfinite and i_nan + i_inf == 0:
            origin, in_max = name, i_max  # the producer: finite in, non-finite out
            w_max = _group(params)[1] if params else None
        elif name not in bad_fwd:
            bad_fwd.append(name)
    b_origin: str | None = None
    b_first: str | None = None
    bad_bwd: list[str] = []
    for name, (n_out, _n_in), values in backward:
        go_sq, go_max, go_nan, go_inf = _group(values[:n_out])
        _, gi_max, gi_nan, gi_inf = _group(values[n_out:])
        fig = modules.setdefault(name, ModuleFigures())
        fig.grad_norm = _sqrt((fig.grad_norm or 0.0) ** 2 + go_sq)
        fig.grad_max_abs = _nan_max([fig.grad_max_abs or 0.0, go_max])
        fig.grad_nonfinite = (fig.grad_nonfinite or 0) + go_nan + go_inf
        fig.grad_input_max_abs = _nan_max([fig.grad_input_max_abs or 0.0, gi_max])
        fig.grad_input_nonfinite = (fig.grad_input_nonfinite or 0) + gi_nan + gi_inf
        if go_nan + go_inf + gi_nan + gi_inf > 0:
            b_first = b_first or name
        if b_origin is None and go_nan + go_inf == 0 and gi_nan + gi_inf > 0:
            b_origin = name
        elif go_nan + go_inf + gi_nan + gi_inf > 0 and name not in bad_bwd:
            bad_bwd.append(name)
    return ActivationReport(
        step=step,
        forward_origin=origin,
        forward_propagators=[n for n in bad_fwd if n != origin],
        inputs_nonfinite=inputs_nonfinite,
        forward_first_nonfinite=first_bad,
        input_max_abs=in_max,
        weight_max_abs=w_max,
        backward_origin=b_origin,
        backward_propagators=[n for n in bad_bwd if n != b_origin],
        backward_first_nonfinite=b_first,
        backward_recorded=bool(backward),
        modules=modules,
        forward_order=forward_order,
        backward_order=backward_order,
    )
