"""Floor 2, statistics with names: ``grad_stats`` and ``GradStats`` (``gradients``), host-side reports (``report``),
per-group figures (``groups``), exponent histograms (``exponents``), the health score (``health``) and the walk over
parameters that every user shares (``_params``).
"""

from torch_gradstats.stats.exponents import (
    ExponentHistogram,
    FloatFormat,
)
from torch_gradstats.stats.gradients import (
    ExtraFigures,
    GradReport,
    GradStats,
    grad_stats,
)
from torch_gradstats.stats.groups import (
    GroupBy,
    GroupReport,
    GroupStats,
)
from torch_gradstats.stats.health import (
    HealthPolicy,
)

__all__ = [
    "ExponentHistogram",
    "ExtraFigures",
    "FloatFormat",
    "GradReport",
    "GradStats",
    "GroupBy",
    "GroupReport",
    "GroupStats",
    "HealthPolicy",
    "grad_stats",
]
