"""``torch_gradstats.collector``, the documented path of :mod:`torch_gradstats.compat.collector` (the drop-in for
esper-lite's gradient collector).
"""

from torch_gradstats.compat.collector import (
    DEFAULT_EXPLODING_THRESHOLD,
    DEFAULT_VANISHING_THRESHOLD,
    DualGradientStats,
    GradientHealthMetrics,
    GradientHealthStats,
    SeedGradientCollector,
    collect_dual_gradients_async,
    collect_host_gradients_async,
    collect_seed_gradients,
    collect_seed_gradients_async,
    collect_seed_gradients_only_async,
    materialize_dual_grad_stats,
    materialize_grad_stats,
)

__all__ = [
    "DEFAULT_EXPLODING_THRESHOLD",
    "DEFAULT_VANISHING_THRESHOLD",
    "DualGradientStats",
    "GradientHealthMetrics",
    "GradientHealthStats",
    "SeedGradientCollector",
    "collect_dual_gradients_async",
    "collect_host_gradients_async",
    "collect_seed_gradients",
    "collect_seed_gradients_async",
    "collect_seed_gradients_only_async",
    "materialize_dual_grad_stats",
    "materialize_grad_stats",
]
