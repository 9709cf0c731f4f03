"""Gradient health: the score of the original gradient collector, with named, documented defaults.

The score looks at per-tensor (per-parameter) L2 norms:

    health = clamp(1 - vanishing_penalty * share_vanishing - exploding_penalty * share_exploding, 0, 1)

where ``share_vanishing`` is the fraction of tensors whose norm is below ``vanishing_threshold`` and
``share_exploding`` the fraction whose norm is above ``exploding_threshold`` *or is not finite*. Any non-finite norm
(a NaN or Inf anywhere in that gradient, or a float64 sum of squares that overflowed) sets the health to 0.
No tensors at all is perfect health, 1.0.

Two implementations that give bit-identical answers: :meth:`HealthPolicy.score` works on a device tensor of norms
and never syncs; :meth:`HealthPolicy.score_host` works on Python floats. Both evaluate the same float64 expression in
the same order, so ``float(policy.score(t)) == policy.score_host(t.tolist())`` exactly.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_EXPLODING_PENALTY",
    "DEFAULT_EXPLODING_THRESHOLD",
    "DEFAULT_VANISHING_PENALTY",
    "DEFAULT_VANISHING_THRESHOLD",
    "HealthPolicy",
]

#: A tensor whose gradient norm is below this carries (almost) no learning signal.
DEFAULT_VANISHING_THRESHOLD = 1e-7
#: A tensor whose gradient norm is above this is "exploding" (it would be clipped hard).
DEFAULT_EXPLODING_THRESHOLD = 10.0
#: Health lost when every tensor vanishes.
DEFAULT_VANISHING_PENALTY = 0.5
#: Health lost when every tensor explodes (exploding is penalised more than vanishing).
DEFAULT_EXPLODING_PENALTY = 0.8


_ACCEPTED = "an int, a float, a numpy scalar or a one-element real tensor"
_THRESHOLDS = ("vanishing_threshold", "exploding_threshold")


def _short_repr(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _checked_field(name: str, value: object) -> float:
    """``value`` as a Python float, or a TypeError/ValueError naming the field and what it accepts."""
    number = value
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"HealthPolicy.{name} must be a real number ({_ACCEPTED}); got a {value.dtype} tensor of shape "
                f"{tuple(value.shape)}"
            )
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise TypeError(
            f"HealthPolicy.{name} must be a real number ({_ACCEPTED}), got {_short_repr(value)} "
            f"({type(value).__name__})"
        )
    too_large = ValueError(
        f"HealthPolicy.{name} must be a number a float can hold (at most {sys.float_info.max:.4g}), got "
        f"{_short_repr(value)}"
    )
    try:
        result = float(number)
    except OverflowError:  # an int (or Fraction) beyond float64's range
        raise too_large from None
    if math.isinf(result) and number != result:  # e.g. a finite numpy longdouble beyond float64's range
        raise too_large
    if math.isnan(result):
        raise ValueError(f"HealthPolicy.{name} must be a number, not NaN (a NaN threshold or penalty would never "
                         f"apply), got {_short_repr(value)}")
    if result < 0:
        raise ValueError(f"HealthPolicy.{name} must be >= 0, got {_short_repr(value)}")
    if math.isinf(result) and name not in _THRESHOLDS:
        raise ValueError(f"HealthPolicy.{name} must be finite (inf is accepted for the thresholds only), got "
                         f"{_short_repr(value)}")
    return result


@dataclass(frozen=True)
class HealthPolicy:
    """Thresholds and penalties of the gradient health score (see the module docstring for the formula).

    Every field must be a real number >= 0: an int, a float, a numpy scalar (``np.int64``, ``np.float32``, ...) or a
    one-element real tensor, stored as a Python float. Anything else raises, naming the field: a TypeError for
    another type (strings, bools, complex numbers, lists), a ValueError for a negative number, NaN, an int too large
    for a float, or an infinite penalty.

    The thresholds may be ``float('inf')``, as the original collector allowed; the comparisons stay the plain
    ``norm < vanishing_threshold`` and ``norm > exploding_threshold``. So ``exploding_threshold=inf`` never fires
    (only non-finite norms count as exploding, as always), and ``vanishing_threshold=inf`` counts every finite norm
    as vanishing (use ``vanishing_threshold=0`` for a vanishing test that never fires). NaN is rejected rather than
    given the original's meaning (every comparison with NaN is false, so the threshold silently never fires): a NaN
    here is almost always a bug upstream; say inf or 0 to switch a test off.

    Attributes:
        vanishing_threshold: per-tensor norm below which a tensor counts as vanishing (strictly below).
        exploding_threshold: per-tensor norm above which a tensor counts as exploding (strictly above).
        vanishing_penalty: weight of the share of vanishing tensors.
        exploding_penalty: weight of the share of exploding tensors.
    """

    vanishing_threshold: float = DEFAULT_VANISHING_THRESHOLD
    exploding_threshold: float = DEFAULT_EXPLODING_THRESHOLD
    vanishing_penalty: float = DEFAULT_VANISHING_PENALTY
    exploding_penalty: float = DEFAULT_EXPLODING_PENALTY

    def __post_init__(self) -> None:
        # Strings and bools are rejected rather than converted. An infinite penalty is rejected because it would
        # make the device and host scores differ (inf * 0 is NaN); an infinite threshold only enters comparisons.
        # Thresholds are not required to be ordered: like the original collector, a norm can then be both vanishing
        # and exploding, and counts in both shares.
        for name in ("vanishing_threshold", "exploding_threshold", "vanishing_penalty", "exploding_penalty"):
            object.__setattr__(self, name, _checked_field(name, getattr(self, name)))

    # ------------------------------------------------------------------ device side (no host sync)
    def classify(self, norms: Tensor) -> tuple[Tensor, Tensor]:
        """Boolean masks ``(vanishing, exploding)`` over a 1-d tensor of per-tensor norms. No host sync.

        A NaN or +-Inf norm is exploding (never vanishing).
        """
        finite = torch.isfinite(norms)
        vanishing = (norms < self.vanishing_threshold) & finite
        exploding = (norms > self.exploding_threshold) | ~finite
        return vanishing, exploding

    def score_from_counts(self, n_vanishing: Tensor, n_exploding: Tensor, n_nonfinite: Tensor, n: int) -> Tensor:
        """The score from device-side counts over ``n`` tensors, as a float64 0-d tensor. No host sync."""
        device = n_vanishing.device
        if n == 0:
            return torch.ones((), dtype=torch.float64, device=device)
        share_v = n_vanishing.to(torch.float64) / n
        share_e = n_exploding.to(torch.float64) / n
        # Same operation order as score_host, so both give the same bits.
        raw = (1.0 - share_v * self.vanishing_penalty) - share_e * self.exploding_penalty
        score = raw.clamp(0.0, 1.0)
        return torch.where(n_nonfinite > 0, torch.zeros_like(score), score)

    def score(self, norms: Tensor) -> Tensor:
        """Health of a 1-d tensor of per-tensor norms, as a float64 0-d tensor on the same device. No host sync."""
        if norms.dim() != 1:
            raise ValueError(f"HealthPolicy.score: expected a 1-d tensor of norms, got shape {tuple(norms.shape)}")
        vanishing, exploding = self.classify(norms)
        n_nonfinite = (~torch.isfinite(norms)).sum()
        return self.score_from_counts(vanishing.sum(), exploding.sum(), n_nonfinite, norms.numel())

    # ------------------------------------------------------------------ host side
    def classify_host(self, norms: Sequence[float]) -> tuple[list[bool], list[bool]]:
        """Host-side :meth:`classify` over Python floats."""
        vanishing = [math.isfinite(x) and x < self.vanishing_threshold for x in norms]
        exploding = [(not math.isfinite(x)) or x > self.exploding_threshold for x in norms]
        return vanishing, exploding

    def score_from_counts_host(self, n_vanishing: int, n_exploding: int, n_nonfinite: int, n: int) -> float:
        """Host-side :meth:`score_from_counts` over Python ints; same bits as the device version."""
        if n == 0:
            return 1.0
        if n_nonfinite > 0:
            return 0.0
        share_v = n_vanishing / n
        share_e = n_exploding / n
        raw = (1.0 - share_v * self.vanishing_penalty) - share_e * self.exploding_penalty
        return min(1.0, max(0.0, raw))

    def score_host(self, norms: Sequence[float]) -> float:
        """Health of a sequence of per-tensor norms (Python floats). Same answer as :meth:`score`, bit for bit."""
        vanishing, exploding = self.classify_host(norms)
        n_nonfinite = sum(not math.isfinite(x) for x in norms)
        return self.score_from_counts_host(sum(vanishing), sum(exploding), n_nonfinite, len(norms))
