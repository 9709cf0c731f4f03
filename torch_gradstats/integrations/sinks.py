"""The sink protocol and the helpers every sink shares.

A sink is anything with a ``log(report, step)`` method, where ``report`` is a :class:`~torch_gradstats.GradReport`
or an :class:`~torch_gradstats.monitors.UpdateReport` (host-side numbers, already transferred) and ``step`` the global
optimizer step. :func:`metrics` turns either report into the flat ``{key: float}`` dict every sink writes.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from torch_gradstats.monitors.updates import UpdateReport
from torch_gradstats.stats.gradients import GradReport
from torch_gradstats.stats.report import STYLES
from torch_gradstats.training._args import send_to_sinks

__all__ = ["AnyReport", "GradSink", "check_style", "finite_values", "grad_report", "log_to", "metrics",
           "nonfinite_index"]

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


def metrics(report: AnyReport, prefix: str = "grad/", per_param: bool = True,
            style: str = "default") -> dict[str, float]:
    """The report as ``{prefix + key: float}``: every number of ``to_dict`` (counts as floats, NaN/inf kept),
    with ``first_nonfinite`` (a name) replaced by ``first_nonfinite_index`` (see :func:`nonfinite_index`); with a
    framework ``style`` (``GradReport.to_dict``'s), that style's keys alone. The report's ``extra`` figures come
    last under their own names, unprefixed, as ``to_dict`` writes them."""
    values = report.to_dict(prefix, per_param=per_param, style=style)
    out = {k: float(v) for k, v in values.items()
           if k != prefix + "first_nonfinite" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    if style == "default":
        out[prefix + "first_nonfinite_index"] = float(nonfinite_index(report))
    return out


def log_to(sinks: list[GradSink], report: AnyReport, step: int) -> None:
    """Send one report to every sink (what ``Trainer(log_to=[...])`` does at each logging step). A sink that raises
    does not keep the report from the others: every sink is called, then the first error is raised (each failing
    sink is named on the ``torch_gradstats`` logger)."""
    send_to_sinks(sinks, report, step)


def finite_values(values: list[float]) -> list[float]:
    """The finite values alone (what a histogram can bin)."""
    return [v for v in values if math.isfinite(v)]
