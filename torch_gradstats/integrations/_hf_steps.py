"""The Hugging Face Trainer's step as the callback reads it: whether a micro-batch ends its optimizer step (set by
the Trainer through accelerate), and the statistics of gradients a GradScaler scaled, unscaled on the device. Split
from ``transformers.py`` (past 500 lines): the Trainer's rules change with transformers and accelerate, apart from
the callback's own logic. Nothing here imports transformers."""

from __future__ import annotations

import dataclasses

import torch

from torch_gradstats.monitors.updates import GradWeightStats
from torch_gradstats.stats.gradients import GradStats

__all__ = ["sync_gradients", "unscaled"]


def sync_gradients() -> bool:
    """True while the current micro-batch is the last of its optimizer step (set by the Trainer via accelerate)."""
    try:
        from accelerate.state import GradientState
    except ImportError:  # the Trainer itself needs accelerate; without it every backward counts
        return True
    return bool(GradientState().sync_gradients)


def unscaled(stats: GradStats | GradWeightStats, scale: torch.Tensor) -> GradStats | GradWeightStats:
    """The statistics of ``grads / scale`` from those of ``grads`` (on the device; counts are unchanged). The
    exponent histogram moves down by ``log2(scale)`` buckets: exact for a power-of-two scale, as GradScaler's are
    (its initial scale and growth and backoff factors by default)."""
    g = stats.grads if isinstance(stats, GradWeightStats) else stats
    s = scale.to(device=g.device, dtype=torch.float64)
    unscaled = dataclasses.replace(g, sumsq=g.sumsq / (s * s), amax=g.amax / s)
    if g.exponent_histogram is not None:
        h = g.exponent_histogram
        shift = torch.round(torch.log2(s)).to(torch.int64)
        index = (torch.arange(h.shape[-1], device=h.device) - shift).clamp_(0, h.shape[-1] - 1).expand_as(h)
        unscaled.exponent_histogram = torch.zeros_like(h).scatter_add_(-1, index, h)
    if isinstance(stats, GradWeightStats):
        return dataclasses.replace(stats, grads=unscaled)
    return unscaled
