"""Floor 0, the op: ``torch.ops.torch_gradstats.multi_tensor_stats``, its schema and fake kernel (``op``), the loader
of the compiled kernels (``_extension``), the pure-PyTorch fallback (``fallback``, ``fallback_histogram`` and their
pieces), the argument checks (``_checks``) and the one place that reads the device from the host (``_transfer``).
"""

# op first: it defines the op's schema, then loads the compiled kernels that register against it.
from torch_gradstats.ops.op import (
    HISTOGRAM_BUCKETS,
    HISTOGRAM_MIN_EXPONENT,
    SUPPORTED_DTYPES,
    HistogramStats,
    TensorStats,
    multi_tensor_stats,
    reference_multi_tensor_stats,
)

# isort: split
from torch_gradstats.ops._extension import HAS_EXTENSION

__all__ = [
    "HAS_EXTENSION",
    "HISTOGRAM_BUCKETS",
    "HISTOGRAM_MIN_EXPONENT",
    "SUPPORTED_DTYPES",
    "HistogramStats",
    "TensorStats",
    "multi_tensor_stats",
    "reference_multi_tensor_stats",
]
