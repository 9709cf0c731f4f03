"""File sinks, standard library only: :class:`CSVSink` (one row per logged step) and :class:`JSONLSink` (one JSON
object per line).

Both write ``step`` first, then the figures of ``report.to_dict(prefix, per_param, style)`` in the order the report
gives them (``first_nonfinite`` is a parameter name, or empty / ``null``). Numbers stay numbers: counts are written
as integers, norms as floats with every digit Python keeps (``repr``); the CSV file writes NaN and infinities as
``nan``, ``inf`` and ``-inf`` (``float()`` reads them back), the JSON Lines file as the ``NaN``, ``Infinity`` and
``-Infinity`` tokens Python's ``json`` module reads back.

A key that first appears at a later step (a new parameter, ``clip_coef`` once clipping starts, a new group):

* :class:`CSVSink` keeps one header for the whole file: the file is rewritten once with the wider header, earlier
  rows getting empty cells in the new columns (a rare event: each column is added once, at the cost of one rewrite);
* :class:`JSONLSink` never rewrites a line: the new key is added after the known ones, so every line has the keys of
  the lines before it, in the same order, then its new ones.

A key missing at a later step is an empty cell (CSV) or ``null`` (JSON Lines), so columns and key order never
change. Each sink opens its file (truncating it) when made, flushes after every step unless ``flush_every`` says
otherwise, and :meth:`close` flushes and closes it (also as a context manager).

Distributed: with ``stage_group=`` (pipeline parallelism), ``group=`` or ``log_rank=``, only the logging rank
(:func:`torch_gradstats.distributed.is_logging_rank`: the last stage's first rank of ``group``, or global rank
``log_rank``) opens the file and writes; on every other rank the sink opens nothing and ``log`` does nothing
(``writes`` is False), so every rank can make and call it alike.
"""

from __future__ import annotations

import csv
import json
import numbers
import os
from typing import IO, Any

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations.sinks import AnyReport
from torch_gradstats.report import STYLES

__all__ = ["CSVSink", "JSONLSink"]


class _FileSink:
    def __init__(self, path: str | os.PathLike[str], prefix: str, per_param: bool, style: str,
                 flush_every: int, stage_group: Any, group: Any, log_rank: int | None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{type(self).__name__}: path must be a str or path, got a {type(path).__name__}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"{type(self).__name__}: flush_every must be a positive int, got {flush_every!r}")
        # Checked here, before the file is truncated, rather than at the first log().
        if not isinstance(prefix, str):
            raise TypeError(f"{type(self).__name__}: prefix must be a str, got a {type(prefix).__name__}")
        if not isinstance(per_param, bool):
            raise TypeError(f"{type(self).__name__}: per_param must be a bool, got a {type(per_param).__name__}")
        if not isinstance(style, str):
            raise TypeError(f"{type(self).__name__}: style must be a str, one of {', '.join(STYLES)}")
        if style not in STYLES:
            raise ValueError(f"{type(self).__name__}: style must be one of {', '.join(STYLES)}; got {style!r}")
        self.path = os.fspath(path)
        self.prefix = prefix
        self.per_param = per_param
        self.style = style
        self.flush_every = flush_every
        self.columns: list[str] = ["step"]  #: every key written so far, in file order
        self._known: set[str] = {"step"}
        #: whether this process writes (False on the ranks other than the logging rank; see the module docstring)
        self.writes = writes_here(type(self).__name__, stage_group, group, log_rank)
        self._file: IO[str] | None = (
            open(self.path, "w", newline="", encoding="utf-8") if self.writes else None  # noqa: SIM115 (closed by close())
        )
        self._since_flush = 0

    def _row(self, report: AnyReport, step: int) -> dict[str, Any]:
        if self._file is None:
            raise ValueError(f"{type(self).__name__}: {self.path} is closed")
        # A float step would be truncated (1.7 written as 1), a str written as given: both are refused.
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"{type(self).__name__}.log: step must be an int, got {step!r} ({type(step).__name__})")
        if not hasattr(report, "to_dict"):
            raise TypeError(
                f"{type(self).__name__}.log: report must be a GradReport or an UpdateReport, got a "
                f"{type(report).__name__}"
            )
        row: dict[str, Any] = {"step": int(step)}
        row.update(report.to_dict(self.prefix, self.per_param, self.style))
        return row

    def _new_columns(self, row: dict[str, Any]) -> list[str]:
        new = [k for k in row if k not in self._known]
        self.columns += new
        self._known.update(new)
        return new

    def _wrote(self) -> None:
        self._since_flush += 1
        if self._since_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._since_flush = 0

    def close(self) -> None:
        """Flush and close the file (a second call does nothing)."""
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CSVSink(_FileSink):
    """Write each report as one CSV row: ``step``, then the report's figures (see the module docstring).

    Args:
        path: the file to write (created or truncated).
        prefix: prepended to every figure's column name (default none: ``total_norm``, ``norm/<name>``...).
        per_param: one column per parameter (and per figure).
        style: the key names of ``GradReport.to_dict(style=...)``.
        flush_every: flush the file every this many rows (default 1: a crash loses nothing written).
        stage_group, group, log_rank: which process writes (see the module docstring); none given: this one.
    """

    def __init__(self, path: str | os.PathLike[str], prefix: str = "", per_param: bool = True,
                 style: str = "default", flush_every: int = 1, *, stage_group: Any = None, group: Any = None,
                 log_rank: int | None = None) -> None:
        super().__init__(path, prefix, per_param, style, flush_every, stage_group, group, log_rank)
        self._rows = 0

    def log(self, report: AnyReport, step: int) -> None:
        if not self.writes:
            return
        row = self._row(report, step)
        assert self._file is not None
        if self._new_columns(row) and self._rows:
            self._widen()
        writer = csv.DictWriter(self._file, self.columns, restval="")
        if not self._rows:
            writer.writeheader()
        writer.writerow(row)
        self._rows += 1
        self._wrote()

    def _widen(self) -> None:
        """Rewrite the file under the wider header: earlier rows get empty cells in the new columns."""
        assert self._file is not None
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            old = list(csv.DictReader(f))  # cells as written: rewriting them changes no digit
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, self.columns, restval="")
            writer.writeheader()
            writer.writerows(old)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._since_flush = 0


class JSONLSink(_FileSink):
    """Write each report as one JSON object per line: ``step``, then the report's figures (see the module
    docstring); the keys of every line come in the same order.

    Args:
        path: the file to write (created or truncated).
        prefix: prepended to every figure's key (default none).
        per_param: one key per parameter (and per figure).
        style: the key names of ``GradReport.to_dict(style=...)``.
        flush_every: flush the file every this many lines (default 1).
        stage_group, group, log_rank: which process writes (see the module docstring); none given: this one.
    """

    def __init__(self, path: str | os.PathLike[str], prefix: str = "", per_param: bool = True,
                 style: str = "default", flush_every: int = 1, *, stage_group: Any = None, group: Any = None,
                 log_rank: int | None = None) -> None:
        super().__init__(path, prefix, per_param, style, flush_every, stage_group, group, log_rank)

    def log(self, report: AnyReport, step: int) -> None:
        if not self.writes:
            return
        row = self._row(report, step)
        assert self._file is not None
        self._new_columns(row)
        line = {k: row.get(k) for k in self.columns}
        self._file.write(json.dumps(line, allow_nan=True) + "\n")
        self._wrote()
