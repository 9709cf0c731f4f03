"""What the demo (:mod:`torch_gradstats.cli.demo`) writes besides its figures: the JSON-lines log and the progress bar.

``log.jsonl`` holds one JSON object for the run, one per step and one per epoch (:func:`write_log`; strict JSON, so
non-finite numbers are written as ``null``, by the JSON Lines sink's
:func:`~torch_gradstats.integrations.files.strict_json`). The tqdm bar over the optimizer steps goes to
stderr when it is a terminal (:func:`progress_bar`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_gradstats.integrations.files import strict_json
from torch_gradstats.training import EpochSummary

__all__ = ["progress_bar", "write_log"]


def _line(record: dict[str, Any]) -> str:
    # strict JSON has no NaN/Infinity: null, and the record's counts say what it was
    return json.dumps(strict_json(record), allow_nan=False) + "\n"


def write_log(
    path: Path, summaries: Sequence[EpochSummary], meta: dict[str, Any], extra: dict[int, dict[str, Any]]
) -> None:
    with path.open("w") as f:
        f.write(_line({"type": "run", **meta}))
        for s in summaries:
            for r in s.history:
                f.write(_line({"type": "step", **r.to_dict(), **extra.get(r.step, {})}))
            f.write(_line({"type": "epoch", **s.to_dict()}))


def _terminal_size(stream: Any) -> tuple[int, int]:
    """Columns and rows of the terminal ``stream`` writes to, 80x24 where it reports none: a pseudo-terminal
    nobody sized (``script``, some CI runners and containers) says 0x0, and tqdm then draws nothing at all."""
    try:
        cols, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        cols, rows = 0, 0
    return cols if cols > 0 else 80, rows if rows > 0 else 24


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(progress: bool | None, total: int) -> Any:
    """The demo's tqdm bar over its optimizer steps, on stderr; None when ``progress`` is False, when it is None and
    stderr is not a terminal, or without tqdm."""
    if progress is False or (progress is None and not _stderr_isatty()):
        return None
    try:
        from tqdm import tqdm  # lazy: only the demo needs it
    except ImportError:
        if progress:
            print("tqdm is not installed: no progress bar (pip install tqdm)", file=sys.stderr)
        return None
    cols, rows = _terminal_size(sys.stderr)
    return tqdm(total=total, desc="demo", unit="step", file=sys.stderr, ncols=cols, nrows=rows, leave=True)
