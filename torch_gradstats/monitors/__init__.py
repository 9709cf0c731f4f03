"""Floor 4, monitors beside the training step: where a NaN starts in the activations (``activations``), weight norms
and update ratios (``updates``), and the gradient noise scale (``noise_scale``).
"""

from torch_gradstats.monitors.activations import (
    ActivationReport,
    ActivationWatch,
)
from torch_gradstats.monitors.noise_scale import (
    NoiseScale,
    noise_scale_hook,
)
from torch_gradstats.monitors.updates import (
    GradWeightStats,
    UpdateRatio,
    UpdateReport,
    UpdateStats,
    grad_and_weight_stats,
)

__all__ = [
    "ActivationReport",
    "ActivationWatch",
    "GradWeightStats",
    "NoiseScale",
    "UpdateRatio",
    "UpdateReport",
    "UpdateStats",
    "grad_and_weight_stats",
    "noise_scale_hook",
]
