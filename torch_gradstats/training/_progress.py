"""The Trainer's walk over a loader: its batches in accumulation windows, and the optional tqdm progress bar (split
from ``_trainer``, which was past 500 lines)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from torch_gradstats.training._summary import EpochSummary, fmt

__all__ = ["progress_bar", "progress_postfix", "progress_update", "windows"]

logger = logging.getLogger("torch_gradstats")


def windows(loader: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """The loader's batches in windows of ``size`` (the last one may be shorter)."""
    it = iter(loader)
    while window := list(itertools.islice(it, size)):
        yield window


@contextlib.contextmanager
def progress_bar(progress: bool | None, total: int | None, desc: str) -> Iterator[Any]:
    """A tqdm bar, or None: off when asked, when stderr is not a terminal (auto mode), or without tqdm."""
    bar = None
    if progress or (progress is None and _stderr_isatty()):
        try:
            from tqdm.auto import tqdm  # lazy: tqdm is optional
        except ImportError:
            if progress:
                logger.warning("torch_gradstats: progress=True but tqdm is not installed (pip install tqdm)")
        else:
            bar = tqdm(total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True)
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress_update(bar: Any, n: int) -> None:
    if bar is not None:
        bar.update(n)


def progress_postfix(bar: Any, summary: EpochSummary) -> None:
    if bar is not None:
        bar.set_postfix(loss=f"{summary.loss:.4g}", max_norm=fmt(summary.max_norm), skipped=summary.skipped_steps)
