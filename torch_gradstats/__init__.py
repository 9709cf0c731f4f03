"""torch_gradstats: gradient telemetry in one read of the gradients.

This module only re-exports; the code lives in one folder per floor (docs/design.md).

The op: ``multi_tensor_stats(tensors) -> TensorStats(sumsq, amax, counts)``. Above it: ``grad_stats`` (named,
device-side, one host transfer in ``report()``), ``HealthPolicy``, the fused ``clip_grad_norm_``, the drop-in
``collector``, the ``training`` loop helper, ``distributed`` global figures, weight norms and update ratios
(``updates``) and, as optional extras never imported here, ``integrations`` (Lightning, Hugging Face, TensorBoard,
W&B).
"""

# ops first: it defines the op's schema, then loads the compiled kernels that register against it.
from torch_gradstats.ops import SUPPORTED_DTYPES, TensorStats, multi_tensor_stats

# isort: split
from torch_gradstats import collector
from torch_gradstats.monitors import (
    ActivationReport,
    ActivationWatch,
    FlightRecorder,
    NoiseScale,
    PerExampleNorms,
    noise_scale_hook,
)
from torch_gradstats.ops import HAS_EXTENSION
from torch_gradstats.ops._version import __version__ as __version__
from torch_gradstats.policies import AdaptiveClip, SpikeGuard, SpikeStreakError, clip_grad_norm_
from torch_gradstats.stats import GradReport, GradStats, GroupReport, GroupStats, HealthPolicy, grad_stats
from torch_gradstats.training import EpochSummary, StepRecord, Trainer, step_or_skip

__all__ = [
    "HAS_EXTENSION",
    "SUPPORTED_DTYPES",
    "ActivationReport",
    "ActivationWatch",
    "AdaptiveClip",
    "EpochSummary",
    "FlightRecorder",
    "GradReport",
    "GradStats",
    "GroupReport",
    "GroupStats",
    "HealthPolicy",
    "NoiseScale",
    "PerExampleNorms",
    "SpikeGuard",
    "SpikeStreakError",
    "StepRecord",
    "TensorStats",
    "Trainer",
    "clip_grad_norm_",
    "collector",
    "grad_stats",
    "multi_tensor_stats",
    "noise_scale_hook",
    "step_or_skip",
]
