"""Floor 4, monitors beside the training step: where a NaN starts in the activations (``activations``), weight norms
and update ratios (``updates``; the measured ones, ``update_ratio``), the gradient noise scale (``noise_scale``),
each example's gradient norm (``per_example``) and a flight recorder of the last steps (``flight_recorder``).
"""

from torch_gradstats.monitors.activations import (
    ActivationReport,
    ActivationWatch,
)
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.monitors.noise_scale import (
    NoiseScale,
    noise_scale_hook,
)
from torch_gradstats.monitors.per_example import PerExampleNorms
from torch_gradstats.monitors.update_ratio import (
    UpdateRatio,
    UpdateStats,
)
from torch_gradstats.monitors.updates import (
    GradWeightStats,
    UpdateReport,
    grad_and_weight_stats,
)

__all__ = [
    "ActivationReport",
    "ActivationWatch",
    "FlightRecorder",
    "GradWeightStats",
    "NoiseScale",
    "PerExampleNorms",
    "UpdateRatio",
    "UpdateReport",
    "UpdateStats",
    "grad_and_weight_stats",
    "noise_scale_hook",
]
