"""The sink protocol and the helpers every sink shares.

A sink is anything with a ``log(report, step)`` method, where ``report`` is a :class:`~torch_gradstats.GradReport`
or an :class:`~torch_gradstats.monitors.UpdateReport` (host-side numbers, already transferred) and ``step`` the global
optimizer step. :func:`metrics` turns either report into the flat ``{key: float}`` dict every sink writes.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

from torch_gradstats.monitors.updates import UpdateReport
from torch_gradstats.stats.gradients import GradReport
from torch_gradstats.stats.report import STYLES
from torch_gradstats.training._args import check_sinks, send_to_sinks

__all__ = ["AnyReport", "GradSink", "check_style", "finite_values", "grad_report", "log_to", "metrics",
           "nonfinite_index", "plain_values"]

#: What a sink accepts: the gradient report alone, or the gradient + weight + update report.
AnyReport = GradReport | UpdateReport


@runtime_checkable
class GradSink(Protocol):
    """Something that records a report at a step: ``TensorBoardSink``, ``WandbSink``, or your own."""

    def log(self, report: AnyReport, step: int) -> None:  # pragma: no cover - protocol
        ...


def check_style(who: str, arg: str, style: object) -> str:
    """``style`` when it is one of ``GradReport.to_dict``'s key styles; else the error a sink raises when it is made
    (naming the sink and its argument), rather than at its first ``log``."""
    if not isinstance(style, str):
        raise TypeError(f"{who}: {arg} must be a str, one of {', '.join(STYLES)}; got a {type(style).__name__}")
    if style not in STYLES:
        raise ValueError(f"{who}: {arg} must be one of {', '.join(STYLES)}; got {style!r}")
    return style


def grad_report(report: AnyReport) -> GradReport:
    """The gradient part of either kind of report."""
    return report.grads if isinstance(report, UpdateReport) else report


def nonfinite_index(report: AnyReport) -> int:
    """Position (model order, among the parameters with a gradient) of the first parameter with a NaN/Inf gradient,
    or -1: a number every scalar logger can plot, where the name itself is a string."""
    g = grad_report(report)
    if g.first_nonfinite is None:
        return -1
    return list(g.norms).index(g.first_nonfinite)


def plain_values(values: dict[Any, Any]) -> dict[str, float | int | bool | str | None]:
    """``values`` (a report's ``to_dict``) with every value a plain Python ``float``, ``int``, ``bool``, ``str`` or
    None: a numpy scalar, or a tensor or array of one element (read with ``.item()``; on a device, a sync), becomes
    the Python number it holds, so no sink drops or garbles one (a figure someone put in ``report.extra``, say).
    Anything else, or a key that is no str, is a ``TypeError`` naming the key."""
    out: dict[str, float | int | bool | str | None] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"report figure keys must be str, got {key!r} ({type(key).__name__})")
        if value is not None and type(value) not in (float, int, bool, str):
            if hasattr(value, "item") and _one_element(value):  # a numpy scalar, a tensor or an array
                value = value.item()
            if isinstance(value, (bool, str)):
                value = bool(value) if isinstance(value, bool) else str(value)
            elif isinstance(value, numbers.Integral):
                value = int(value)
            elif isinstance(value, numbers.Real):
                value = float(value)
            else:
                raise TypeError(f"report figure {key!r} is of type {type(value).__name__}: not a number (a float, an "
                                "int, a numpy scalar or a one-element tensor), a str or None")
        out[key] = value
    return out


def _one_element(value: Any) -> bool:
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor
        return bool(numel() == 1)
    return bool(getattr(value, "size", None) == 1)  # a numpy scalar or array


def metrics(report: AnyReport, prefix: str = "grad/", per_param: bool = True,
            style: str = "default") -> dict[str, float]:
    """The report as ``{prefix + key: float}``: every number of ``to_dict`` (counts and bools as floats, NaN/inf
    kept; numpy scalars and one-element tensors too, see :func:`plain_values`), with ``first_nonfinite`` (a name)
    replaced by ``first_nonfinite_index`` (see :func:`nonfinite_index`); with a framework ``style``
    (``GradReport.to_dict``'s), that style's keys alone. The report's ``extra`` figures come last under their own
    names, unprefixed, as ``to_dict`` writes them. An int too large for a float is an ``OverflowError`` naming its
    key."""
    values = plain_values(report.to_dict(prefix, per_param=per_param, style=style))
    out: dict[str, float] = {}
    for k, v in values.items():
        if k == prefix + "first_nonfinite" or v is None or isinstance(v, str):
            continue
        try:
            out[k] = float(v)
        except OverflowError:
            raise OverflowError(f"metrics: {k!r} is {v}, too large for a float") from None
    if style == "default":
        out[prefix + "first_nonfinite_index"] = float(nonfinite_index(report))
    return out


def log_to(sinks: list[GradSink], report: AnyReport, step: int) -> None:
    """Send one report to every sink (what ``Trainer(log_to=[...])`` does at each logging step). A sink that raises
    does not keep the report from the others: every sink is called, then the first error is raised (each failing
    sink is named on the ``torch_gradstats`` logger)."""
    send_to_sinks(check_sinks(sinks), report, step)  # a list of objects with a log method, or a TypeError


def finite_values(values: list[float]) -> list[float]:
    """The finite values alone (what a histogram can bin)."""
    return [v for v in values if math.isfinite(v)]
