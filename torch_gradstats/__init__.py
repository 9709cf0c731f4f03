"""torch_gradstats: gradient telemetry in one read of the gradients.

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
from torch_gradstats._extension import HAS_EXTENSION
from torch_gradstats.activations import ActivationReport, ActivationWatch
from torch_gradstats.adaptive_clip import AdaptiveClip
from torch_gradstats.clip import clip_grad_norm_
from torch_gradstats.groups import GroupStats
from torch_gradstats.guard import SpikeGuard, SpikeStreakError
from torch_gradstats.health import HealthPolicy
from torch_gradstats.noise_scale import NoiseScale, noise_scale_hook
from torch_gradstats.report import GroupReport
from torch_gradstats.stats import GradReport, GradStats, grad_stats
from torch_gradstats.training import EpochSummary, StepRecord, Trainer
from torch_gradstats.training._skip import step_or_skip

__version__ = "0.1.0"

__all__ = [
    "HAS_EXTENSION",
    "SUPPORTED_DTYPES",
    "ActivationReport",
    "ActivationWatch",
    "AdaptiveClip",
    "EpochSummary",
    "GradReport",
    "GradStats",
    "GroupReport",
    "GroupStats",
    "HealthPolicy",
    "NoiseScale",
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
