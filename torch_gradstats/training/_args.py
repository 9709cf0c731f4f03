"""Checks of the Trainer's scalar arguments: TypeError for a wrong type, ValueError for a bad value, each naming the
argument. Integers may be any ``numbers.Integral`` (numpy's included) except bool, and come back as Python ints."""

from __future__ import annotations

import numbers

__all__ = ["check_int", "check_positive_number"]


def check_int(name: str, value: object, *, minimum: int = 1, or_none: bool = False) -> int:
    """``value`` as a Python int >= ``minimum``, or an error naming ``name`` (``or_none``: the message says None is
    accepted too; the caller lets None through)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise TypeError(f"{name} must be {kind}{' or None' if or_none else ''}, got {value!r} "
                        f"({type(value).__name__})")  # fmt: skip
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {int(value)}")
    return int(value)


def check_positive_number(name: str, value: object) -> float | None:
    """``value`` as a float > 0 (inf allowed), None as None, or an error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number or None, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not number > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number
