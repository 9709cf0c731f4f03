"""The exponent histogram on the host: what a report holds of ``grad_stats(..., histogram=True)``, and what it tells.

The op's histogram overload counts each finite non-zero element in the bucket of ``floor(log2 |x|)``, from ``-149``
(bucket 0) to ``127`` (bucket 276); float64 values beyond that range count in the first or last bucket. From those
counts alone, and the number of elements, :class:`ExponentHistogram` gives the fraction of the gradient that a
narrower format would lose:

* **underflow**: non-zero values below the format's smallest normal number (they would be flushed to zero or kept
  as subnormals with fewer significant bits). Zeros are counted in the denominator, never as underflow.
* **overflow**: values at or above ``2 ** (e_max + 1)``, ``e_max`` the format's largest exponent. The histogram
  resolves powers of two only, so a value between the format's largest finite number and the next power of two
  (e.g. between 57344 and 65536 for fp8 e5m2, 448 and 512 for e4m3) counts as representable, although a cast would
  make it inf or NaN. NaN and Inf elements are in neither fraction: they have their own counts.

Both are fractions of **all** elements (zeros, NaN and Inf included in the denominator).

The last bucket holds ``floor(log2 |x|) >= 127``: float32's top binade and every float64 value at or above
``2**128`` alike. bf16's overflow threshold, ``2**128``, lies inside it, so ``overflow("bf16")`` (like any format
with ``max_exponent >= 127``) counts none of them: float64 gradients at or above ``2**128`` are not in it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

from torch_gradstats.ops.fallback_histogram import HISTOGRAM_BUCKETS, HISTOGRAM_MIN_EXPONENT

__all__ = ["FORMATS", "ExponentHistogram", "FloatFormat"]


class FloatFormat(NamedTuple):
    """The exponent range of a floating-point format: its normal numbers are ``2**min_exponent <= |x| <
    2**(max_exponent + 1)``."""

    min_exponent: int
    max_exponent: int


#: The formats whose fractions a report gives, by the name used in its keys (``underflow/<name>``).
FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat(-14, 15),
    "bf16": FloatFormat(-126, 127),
    "fp8_e4m3": FloatFormat(-6, 8),
    "fp8_e5m2": FloatFormat(-14, 15),
}


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"ExponentHistogram: {name} must be an int, got {type(value).__name__}")
    return int(value)


def _format(fmt: str | FloatFormat) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"ExponentHistogram: fmt must be a format name or a FloatFormat, got {type(fmt).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"ExponentHistogram: unknown format {fmt!r}; expected one of {', '.join(FORMATS)} or a "
                         f"FloatFormat")
    return FORMATS[fmt]


@dataclass(frozen=True)
class ExponentHistogram:
    """A global exponent histogram on the host.

    Attributes:
        counts: 277 ints: ``counts[b]`` finite non-zero elements with ``floor(log2 |x|) == b - 149``.
        numel: the number of elements of all the gradients it counts (zeros, NaN and Inf included).
    """

    counts: tuple[int, ...]
    numel: int

    def __post_init__(self) -> None:
        if len(self.counts) != HISTOGRAM_BUCKETS:
            raise ValueError(f"ExponentHistogram: expected {HISTOGRAM_BUCKETS} counts, got {len(self.counts)}")
        # Counts and numel are numbers of elements (ints, numpy's too, stored as ints): anything else would give
        # fractions outside [0, 1].
        object.__setattr__(self, "numel", _as_int(self.numel, "numel"))
        object.__setattr__(self, "counts", tuple(_as_int(c, f"counts[{b}]") for b, c in enumerate(self.counts)))
        negative = next((b for b, c in enumerate(self.counts) if c < 0), None)
        if negative is not None:
            raise ValueError(f"ExponentHistogram: counts must be >= 0, got {self.counts[negative]} in bucket "
                             f"{negative}")
        if sum(self.counts) > self.numel:
            raise ValueError(f"ExponentHistogram: the counts add up to {sum(self.counts)}, more than numel "
                             f"({self.numel}), the number of elements they are part of")

    def _count_below(self, exponent: int) -> int:
        """Elements with ``floor(log2 |x|) < exponent``."""
        return sum(self.counts[: max(0, min(HISTOGRAM_BUCKETS, exponent - HISTOGRAM_MIN_EXPONENT))])

    def underflow(self, fmt: str | FloatFormat) -> float:
        """Fraction of all elements that are non-zero and below ``fmt``'s smallest normal number."""
        f = _format(fmt)
        return self._count_below(f.min_exponent) / self.numel if self.numel else 0.0

    def overflow(self, fmt: str | FloatFormat) -> float:
        """Fraction of all elements at or above ``2 ** (max_exponent + 1)`` of ``fmt`` (see the module's note on
        values between the largest finite number and that power of two)."""
        f = _format(fmt)
        total = sum(self.counts)
        return (total - self._count_below(f.max_exponent + 1)) / self.numel if self.numel else 0.0

    def fractions(self) -> dict[str, float]:
        """``underflow/<format>`` and ``overflow/<format>`` for every format of :data:`FORMATS`."""
        out = {f"underflow/{name}": self.underflow(name) for name in FORMATS}
        out.update({f"overflow/{name}": self.overflow(name) for name in FORMATS})
        return out

    def nonzero_range(self) -> tuple[int, int]:
        """``(first, last + 1)``: the buckets from the first to the last non-empty one (``(0, 0)`` if all are)."""
        used = [b for b, c in enumerate(self.counts) if c]
        return (used[0], used[-1] + 1) if used else (0, 0)

    def edges(self) -> list[float]:
        """The 278 bucket edges ``2**-149 ... 2**128``: bucket ``b`` is ``[edges[b], edges[b + 1])``."""
        return [2.0 ** (HISTOGRAM_MIN_EXPONENT + b) for b in range(HISTOGRAM_BUCKETS + 1)]
