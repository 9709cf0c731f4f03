"""torch_gradstats: gradient telemetry in one read of the gradients."""

from torch_gradstats.ops import SUPPORTED_DTYPES, TensorStats, multi_tensor_stats
from torch_gradstats._extension import HAS_EXTENSION

__version__ = "0.1.0"

__all__ = [
    "HAS_EXTENSION",
    "SUPPORTED_DTYPES",
    "TensorStats",
    "multi_tensor_stats",
]
