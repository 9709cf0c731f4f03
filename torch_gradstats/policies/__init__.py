"""Floor 3, policies that act on the statistics: clipping (``clip``), skipping a spiking step (``guard``) and a clip
threshold that follows the norm (``adaptive_clip``), all decided on the device; ``_scalars`` holds their checks and
state helpers.
"""

from torch_gradstats.policies.adaptive_clip import (
    AdaptiveClip,
)
from torch_gradstats.policies.clip import (
    clip_grad_norm_,
)
from torch_gradstats.policies.guard import (
    SpikeGuard,
    SpikeStreakError,
)

__all__ = [
    "AdaptiveClip",
    "SpikeGuard",
    "SpikeStreakError",
    "clip_grad_norm_",
]
