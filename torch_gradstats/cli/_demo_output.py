"""What the demo (:mod:`torch_gradstats.cli.demo`) writes besides its figures: the JSON-lines log, the progress bar,
and the Trainer's warnings it tells in its own words (:class:`TrainerWarnings`).

``log.jsonl`` holds one JSON object for the run, one per step and one per epoch (:func:`write_log`; strict JSON, so
non-finite numbers are written as ``null``, by the JSON Lines sink's
:func:`~torch_gradstats.integrations.files.strict_json`). The tqdm bar over the optimizer steps goes to
stderr when it is a terminal (:func:`progress_bar`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch_gradstats.integrations.files import strict_json
from torch_gradstats.training import EpochSummary

__all__ = ["TrainerWarnings", "progress_bar", "write_log"]


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


#: The Trainer's warning of a skipped step with per-example norms: the step, then its largest examples and median.
_EXAMPLES = re.compile(r"optimizer step (\d+) skipped \(gradient spike\); largest per-example gradient norms of its "
                       r"\d+ examples \(0-based batch positions\): (.*); batch median (\S+)$")


class TrainerWarnings(logging.Filter):
    """Keeps the Trainer's activation warnings (one per sync while the epoch has a non-finite step) for the demo to
    print the first, instead of repeating them on stderr; drops its warning of a skipped non-finite step, which the
    demo says in its own words ("Non-finite gradient first seen at optimizer step ..."), and of a step the SpikeGuard
    skipped ("SpikeGuard skipped step ..."), keeping the examples that one names (``examples``: step, top, median)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.examples: list[tuple[int, str, str]] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        if "first non-finite parameter gradient" in message:
            self.messages.append(message)
            return False
        if "skipped (gradient spike)" in message:
            found = _EXAMPLES.search(message)
            if found is not None:
                self.examples.append((int(found[1]), found[2], found[3]))
            return False
        return "non-finite gradient at optimizer step" not in message
