"""``torch_gradstats.updates``, the documented path of :mod:`torch_gradstats.monitors.updates` (weight norms and
update ratios).
"""

from torch_gradstats.monitors.updates import (
    GradWeightStats,
    UpdateRatio,
    UpdateReport,
    UpdateStats,
    grad_and_weight_stats,
)

__all__ = [
    "GradWeightStats",
    "UpdateRatio",
    "UpdateReport",
    "UpdateStats",
    "grad_and_weight_stats",
]
