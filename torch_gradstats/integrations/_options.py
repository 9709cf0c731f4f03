"""The callbacks' shared arguments, checked when a callback is made (split from ``_common.py``: checking what a
user passed is a job of its own, apart from taking and reporting the statistics)."""

from __future__ import annotations

import numbers
from typing import Any, Literal

from torch_gradstats.monitors.activations import ActivationWatch
from torch_gradstats.ops._checks import check_bool
from torch_gradstats.policies.adaptive_clip import AdaptiveClip
from torch_gradstats.policies.guard import SpikeGuard
from torch_gradstats.stats.report import STYLES

__all__ = ["OnNonfinite", "check_histogram", "check_key_style", "check_options", "check_policies", "check_watch"]

OnNonfinite = Literal["skip", "stop"] | None


def check_key_style(key_style: Any) -> str | None:
    """Validate a callback's ``key_style``: None or one of ``GradReport.to_dict``'s styles."""
    if key_style is not None and not isinstance(key_style, str):
        raise TypeError(f"key_style must be None or one of {', '.join(STYLES)}, got a {type(key_style).__name__}")
    if key_style is not None and key_style not in STYLES:
        raise ValueError(f"key_style must be None or one of {', '.join(STYLES)}, got {key_style!r}")
    return key_style


def check_options(every_n_steps: Any, on_nonfinite: Any) -> int | None:
    """Validate the options the callbacks share; returns ``every_n_steps`` as a Python int (or None)."""
    if on_nonfinite is not None and not isinstance(on_nonfinite, str):
        raise TypeError(f"on_nonfinite must be None, 'skip' or 'stop', got {on_nonfinite!r} "
                        f"({type(on_nonfinite).__name__})")
    if on_nonfinite not in (None, "skip", "stop"):
        raise ValueError(f"on_nonfinite must be None, 'skip' or 'stop', got {on_nonfinite!r}")
    if every_n_steps is None:
        return None
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, numbers.Integral):
        raise TypeError(f"every_n_steps must be a positive int (or numpy integer) or None, got {every_n_steps!r} "
                        f"({type(every_n_steps).__name__})")
    if every_n_steps < 1:
        raise ValueError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
    return int(every_n_steps)


def check_histogram(histogram: Any, log_weight_norms: bool, log_update_ratio: bool) -> bool:
    """Validate a callback's ``histogram``: a bool, and not with the weight statistics (their one op call over the
    gradients and the weights has no histogram)."""
    check_bool("histogram", histogram)
    if histogram and (log_weight_norms or log_update_ratio):
        raise ValueError("histogram=True reads the gradients' exponent histogram with grad_stats; it is not taken "
                         "with log_weight_norms or log_update_ratio")
    return histogram


def check_policies(spike_guard: Any, adaptive_clip: Any) -> None:
    """Validate a callback's ``spike_guard`` and ``adaptive_clip``."""
    if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
        raise TypeError(f"spike_guard must be a SpikeGuard or None, got {type(spike_guard).__name__}")
    if adaptive_clip is not None and not isinstance(adaptive_clip, AdaptiveClip):
        raise TypeError(f"adaptive_clip must be an AdaptiveClip or None, got {type(adaptive_clip).__name__}")


def check_watch(watch: Any) -> ActivationWatch | bool:
    """Validate a callback's ``watch_activations``: an ActivationWatch, True (the default one, made when training
    starts), or False / None (no watch)."""
    if watch is None or watch is False:
        return False
    if watch is not True and not isinstance(watch, ActivationWatch):
        raise TypeError(
            f"watch_activations must be an ActivationWatch, True, False or None, got {type(watch).__name__}"
        )
    return watch
