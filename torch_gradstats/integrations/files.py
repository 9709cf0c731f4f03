"""File sinks, standard library only: :class:`CSVSink` (one row per logged step) and :class:`JSONLSink` (one JSON
object per line).

Both write ``step`` first, then the figures of ``report.to_dict(prefix, per_param, style)`` in the order the report
gives them (``first_nonfinite`` is a parameter name, or empty / ``null``). Numbers stay numbers: counts are written
as integers, norms as floats with every digit Python keeps (``repr``); a numpy scalar or a one-element tensor (in
``report.extra``, say) as the Python number it holds, anything else no number nor str a ``TypeError`` naming its key
(:func:`~torch_gradstats.integrations.sinks.plain_values`). The CSV file writes NaN and infinities as
``nan``, ``inf`` and ``-inf`` (``float()`` reads them back). The JSON Lines file is strict JSON, which has no NaN or
infinity: a non-finite number is written as ``null`` (:func:`strict_json`), and the ``nan_count`` / ``inf_count`` of
the same line say which it was.

A key that first appears at a later step (a new parameter, ``clip_coef`` once clipping starts, a new group):

* :class:`CSVSink` keeps one header for the whole file: the file is rewritten once with the new columns at the end
  of its header, every earlier row kept, with empty cells in the new columns (a rare event: each column is added
  once);
* :class:`JSONLSink` never rewrites a line: the new key is added after the known ones, so every line has the keys of
  the lines before it, in the same order, then its new ones.

A key missing at a later step is an empty cell (CSV) or ``null`` (JSON Lines), so columns and key order never
change. A figure named ``step`` (in ``report.extra``) is a ``ValueError``: it would overwrite the step.

The file, and what is already in it:

* ``mode="a"`` (the default) appends: a run resumed with the same path keeps every earlier row. A CSV file that
  already has a header (a non-empty regular file) keeps it and widens it when the new rows bring more columns (a
  file whose first line is no header of this sink's, whose first cell is not ``step``, is refused untouched); a
  JSON Lines file continues the key order of its last line.
* ``mode="w"`` overwrites the file when the sink is made.
* The path is made absolute when the sink is made, so a later ``os.chdir`` changes nothing.
* One file, one writer: making a sink for a file that an open sink of this process writes (by any path to it:
  symbolic or hard links included) raises ``ValueError`` naming the path (close the first sink to free it); so does
  a regular file that a sink of another process holds open (on POSIX systems, by ``flock``: another rank given the
  same path), before the file is read or overwritten. A child made by ``fork`` (a DataLoader worker) holds neither
  the lock nor the file: its copies of the sinks refuse to log.
* A pipe or a device (``/dev/stdout``) is only written to, never read nor rewritten: there a key that first appears
  at a later step makes :class:`CSVSink` write its whole, wider header again, as a line of its own, before the row.
  Widening a regular file replaces it with the rewritten copy (through a symbolic link, the file the link names);
  another hard link to it keeps the rows written before. A file that cannot be rewritten then (a read-only
  directory, a file moved or replaced since the sink opened it) gets the wider header as a line of its own too,
  with a warning on the ``torch_gradstats`` logger: no row is lost.
* Each sink flushes after every step unless ``flush_every`` says otherwise. :meth:`close` flushes and closes the
  file (also as a context manager); when that last flush fails (a full disk), the file is closed all the same and
  the error raised once; a second ``close`` does nothing.

Distributed: with ``stage_group=`` (pipeline parallelism), ``group=`` or ``log_rank=``, only the logging rank
(:func:`torch_gradstats.distributed.reduce.is_logging_rank`: the last stage's first rank of ``group``, or global rank
``log_rank``) opens the file and writes; on every other rank the sink opens nothing and ``log`` does nothing
(``writes`` is False), so every rank can make and call it alike.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import numbers
import os
import shutil
import stat
import tempfile
import threading
import weakref
from typing import IO, Any

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations.sinks import AnyReport, check_style, plain_values

__all__ = ["CSVSink", "JSONLSink", "strict_json"]

MODES = ("a", "w")
logger = logging.getLogger("torch_gradstats")

#: The files open sinks of this process write (by real path), and their sinks: a second writer is refused. Weak, so
#: a sink dropped without close() frees its path along with its file.
_WRITERS: weakref.WeakValueDictionary[str, _FileSink] = weakref.WeakValueDictionary()
_WRITERS_LOCK = threading.Lock()


def _detach_in_child() -> None:
    """In a child made by ``fork`` (a DataLoader worker, say): the child holds copies of every open sink's file
    descriptor, and with them the sink's lock, which would outlive the parent's ``close``. Each copy is pointed at
    the null device (what the child's copy of a sink would flush, rows the parent also holds, goes nowhere) and the
    child's sinks refuse to log."""
    global _WRITERS_LOCK
    _WRITERS_LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    sinks = {id(sink): sink for sink in list(_WRITERS.values())}
    _WRITERS.clear()
    if not sinks:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for sink in sinks.values():
            sink._detach(null)
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_in_child)


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (in it, or in its dicts and lists) replaced by ``None``: what
    ``json.dumps(..., allow_nan=False)`` accepts, written as ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _has_content(path: str) -> bool:
    """Whether ``path`` is a non-empty regular file: only such a file has rows (a device or a pipe is not read)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size > 0


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) in (b"\n", b"\r")


class _FileSink:
    def __init__(self, path: str | os.PathLike[str], prefix: str, per_param: bool, style: str,
                 flush_every: int, mode: str, stage_group: Any, group: Any, log_rank: int | None) -> None:
        who = type(self).__name__
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{who}: path must be a str or path, got a {type(path).__name__}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"{who}: flush_every must be a positive int, got {flush_every!r}")
        # Checked here, before the file is opened, rather than at the first log().
        if not isinstance(prefix, str):
            raise TypeError(f"{who}: prefix must be a str, got a {type(prefix).__name__}")
        if not isinstance(per_param, bool):
            raise TypeError(f"{who}: per_param must be a bool, got a {type(per_param).__name__}")
        check_style(who, "style", style)
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"{who}: mode must be 'a' (append, the default) or 'w' (overwrite); got {mode!r}")
        #: the file, as an absolute path (fixed when the sink is made: a later os.chdir changes nothing)
        self.path = os.path.abspath(os.fspath(path))
        self.mode = mode
        self.prefix = prefix
        self.per_param = per_param
        self.style = style
        self.flush_every = flush_every
        self.columns: list[str] = ["step"]  #: every key written so far, in file order
        self._known: set[str] = {"step"}
        self._file: IO[str] | None = None
        self._since_flush = 0
        self._keys: list[str] = []  # what this sink holds in _WRITERS
        self._regular = True  # the file is a regular file (a pipe or a device cannot be rewritten)
        self._closed = False
        self._forked = False  # this process is a fork of the one that opened the file
        #: whether this process writes (False on the ranks other than the logging rank; see the module docstring)
        self.writes = writes_here(who, stage_group, group, log_rank)
        if not self.writes:
            return
        self._claim()
        try:
            # Opened without truncating it, and locked, before anything is read or overwritten: a file another process
            # writes (another rank given the same path) is refused untouched.
            self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 (closed by close())
            st = os.fstat(self._file.fileno())
            self._regular = stat.S_ISREG(st.st_mode)
            self._hold([f"inode:{st.st_dev}:{st.st_ino}"])  # a file made just now: its hard links are it too
            if self._regular:
                self._lock()
                if mode == "w":
                    self._file.truncate(0)
            if mode == "a" and _has_content(self.path):
                self._resume()
                self._end_cut_line()
        except BaseException:
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
                self._file = None
            self._release()
            raise

    def _claim(self) -> None:
        """Claims the file for this sink, by real path and, where it exists, by inode (a hard link is another path to
        the same file); refuses it when an open sink of this process holds either."""
        keys = [os.path.realpath(self.path)]
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            keys.append(f"inode:{st.st_dev}:{st.st_ino}")
        self._hold(keys)

    def _hold(self, keys: list[str], drop: str | None = None) -> None:
        """Holds ``keys`` for this sink (and lets go of ``drop``), or raises when another open sink holds one."""
        with _WRITERS_LOCK:
            if drop is not None and drop not in keys:
                if _WRITERS.get(drop) is self:
                    del _WRITERS[drop]
                if drop in self._keys:
                    self._keys.remove(drop)
            for key in keys:
                other = _WRITERS.get(key)
                if other is not None and other is not self:
                    raise ValueError(
                        f"{type(self).__name__}: {self.path} is already written by an open {type(other).__name__} of "
                        "this process; close that sink first, or give this one another path"
                    )
            for key in keys:
                _WRITERS[key] = self
        self._keys += [k for k in keys if k not in self._keys]

    def _lock(self) -> None:
        """Lock the file (``flock``) for as long as this sink holds it open, or raise when another process holds it:
        two processes appending to one file interleave their rows, and one's widening drops the other's. Where the
        system has no such lock (Windows) or the file system refuses it, the file is written unlocked."""
        assert self._file is not None
        try:
            import fcntl
        except ImportError:
            return
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{type(self).__name__}: {self.path} is already written by a sink of another process (another rank "
                "given the same path?); give each process its own path, or let one rank write (log_rank=0, "
                "stage_group=, group=)"
            ) from None
        except OSError as exc:
            logger.debug("torch_gradstats: %s cannot lock %s (%s); written unlocked", type(self).__name__, self.path,
                         exc)

    def _detach(self, null: int) -> None:
        """In a forked child: point this sink's descriptor at ``null`` (see :func:`_detach_in_child`)."""
        if self._file is not None:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(null, self._file.fileno())
        self._keys = []
        self._forked = True

    def _check_open(self) -> None:
        """Raise when ``log`` may not write: after ``close`` (on every rank, writing or not), or in a forked child."""
        if self._forked:
            raise ValueError(f"{type(self).__name__}: {self.path} was opened by the process this one was forked from; "
                             "make a sink of its own in this process (another path)")
        if self._closed:
            raise ValueError(f"{type(self).__name__}: {self.path} is closed")

    def _release(self) -> None:
        with _WRITERS_LOCK:
            for key in self._keys:
                if _WRITERS.get(key) is self:
                    del _WRITERS[key]
        self._keys = []

    def _resume(self) -> None:
        """Read what the existing file says about its columns (appending to it)."""

    def _end_cut_line(self) -> None:
        """End the resumed file's last line when a crash cut it short: it stays a line of its own."""
        assert self._file is not None
        if not _ends_with_newline(self.path):
            self._file.write("\n")

    def _row(self, report: AnyReport, step: int) -> dict[str, Any]:
        if self._file is None:  # closed (a rank that does not write returned before)
            raise ValueError(f"{type(self).__name__}: {self.path} is closed")
        # A float step would be truncated (1.7 written as 1), a str written as given: both are refused.
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"{type(self).__name__}.log: step must be an int, got {step!r} ({type(step).__name__})")
        if not hasattr(report, "to_dict"):
            raise TypeError(
                f"{type(self).__name__}.log: report must be a GradReport or an UpdateReport, got a "
                f"{type(report).__name__}"
            )
        values = plain_values(report.to_dict(self.prefix, self.per_param, self.style))
        if "step" in values:  # it would overwrite the step column
            raise ValueError(f"{type(self).__name__}.log: the report has a figure named 'step' (in its extra?), the "
                             "name of the step column; give the figure another name")
        return {"step": int(step), **values}

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
        """Flush and close the file. The file is closed (and its path freed) even when this last flush fails; that
        error is raised, once: a second call does nothing."""
        self._closed = True
        file, self._file = self._file, None
        try:
            if file is not None:
                file.close()  # flushes; closes the descriptor even when the flush raises
        finally:
            self._release()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CSVSink(_FileSink):
    """Write each report as one CSV row: ``step``, then the report's figures (see the module docstring).

    Args:
        path: the file to write (made absolute now).
        prefix: prepended to every figure's column name (default none: ``total_norm``, ``norm/<name>``...).
        per_param: one column per parameter (and per figure).
        style: the key names of ``GradReport.to_dict(style=...)``.
        flush_every: flush the file every this many rows (default 1: a crash loses nothing written).
        mode: ``"a"`` (default) appends to an existing file, keeping its header and rows; ``"w"`` overwrites it.
        stage_group, group, log_rank: which process writes (see the module docstring); none given: this one.
    """

    def __init__(self, path: str | os.PathLike[str], prefix: str = "", per_param: bool = True,
                 style: str = "default", flush_every: int = 1, mode: str = "a", *, stage_group: Any = None,
                 group: Any = None, log_rank: int | None = None) -> None:
        self._has_header = False
        super().__init__(path, prefix, per_param, style, flush_every, mode, stage_group, group, log_rank)

    def _resume(self) -> None:
        try:
            with open(self.path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ValueError(
                f"CSVSink: cannot append to {self.path}: its first line is no CSV header ({exc}); give mode='w' to "
                "overwrite it, or another path"
            ) from None
        if header[:1] != ["step"]:  # not a file of this sink's: widening it would rewrite its every line as cells
            first = ",".join(header)
            first = first[:60] + "..." if len(first) > 60 else first
            raise ValueError(
                f"CSVSink: cannot append to {self.path}: its first line ({first!r}) is no header this sink wrote "
                "(they start with 'step'); give mode='w' to overwrite it, or another path"
            )
        self.columns = list(header)
        self._known = set(header)
        self._has_header = True

    def _end_cut_line(self) -> None:
        # A row cut inside a quoted cell (a name with a comma, a quote or a newline) would swallow the rows written
        # after it, up to the next quote: the cell is closed first. Every quote of a CSV file is in a quoted cell
        # (opening, closing, or doubled inside it), so an odd count means the file ends inside one.
        assert self._file is not None
        quotes = 0
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                quotes += block.count(b'"')
        if quotes % 2:
            self._file.write('"\n')
        else:
            super()._end_cut_line()

    def log(self, report: AnyReport, step: int) -> None:
        self._check_open()
        if not self.writes:
            return
        row = self._row(report, step)
        assert self._file is not None
        known = len(self.columns)
        if self._new_columns(row) and self._has_header and not (self._regular and self._widen(known)):
            # A pipe or a device, or a file that cannot be rewritten now: the wider header is written again, as a line
            # of its own, so the row is not lost.
            self._has_header = False
        writer = csv.DictWriter(self._file, self.columns, restval="")
        if not self._has_header:
            writer.writeheader()
            self._has_header = True
        writer.writerow(row)
        self._wrote()

    def _widen(self, known: int) -> bool:
        """Rewrite the file with the new columns (those from ``known`` on) at the end of its header; every earlier
        row keeps its cells and gets empty ones in the new columns. False, with a warning, when the file cannot be
        rewritten (a read-only directory, a file moved or replaced since the sink opened it)."""
        assert self._file is not None
        self._file.flush()
        target = os.path.realpath(self.path)  # through a symbolic link: the file it names is rewritten, not the link
        held = os.fstat(self._file.fileno())
        tmp: str | None = None
        try:
            now = os.stat(target)
            if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                raise OSError(f"{target} is no longer the file this sink writes (moved or replaced)")
            # A fresh name beside it: no file of the user's (nor another sink's) is written through.
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".tmp",
                                       dir=os.path.dirname(target))
            with open(target, newline="", encoding="utf-8") as old, \
                    open(fd, "w", newline="", encoding="utf-8") as new:
                rows, writer = csv.reader(old), csv.writer(new)
                next(rows, None)  # the old header
                writer.writerow(self.columns)
                width = len(self.columns)
                for row in rows:  # one at a time: the file may be large
                    writer.writerow(row + [""] * (width - len(row)))
            shutil.copymode(target, tmp)
            os.replace(tmp, target)
            tmp = None
        except (OSError, ValueError, csv.Error) as exc:
            logger.warning("torch_gradstats: CSVSink could not rewrite %s with its new columns (%s); the wider "
                           "header is written again, as a line of its own", self.path, exc)
            return False
        except BaseException:
            del self.columns[known:]  # the file keeps its old header: the next row tries again
            self._known = set(self.columns)
            raise
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        self._file.close()  # the replaced file's, already flushed
        self._file = open(target, "a", newline="", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._lock()
        st = os.fstat(self._file.fileno())
        # The new file's inode is this sink's; the replaced one's is free (the system may give its number to a file
        # made next).
        self._hold([f"inode:{st.st_dev}:{st.st_ino}"], drop=f"inode:{held.st_dev}:{held.st_ino}")
        self._since_flush = 0
        return True


def _last_object(path: str) -> dict[str, Any] | None:
    """The last line of a JSON Lines file that holds a JSON object, read from the end (a line cut short by a crash
    is passed over)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        block = 1 << 16
        while True:
            start = max(0, size - block)
            f.seek(start)
            lines = f.read(size - start).splitlines()
            for line in reversed(lines[1:] if start else lines):  # the block's first line may be cut
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    return obj
            if not start:
                return None
            block *= 4


class JSONLSink(_FileSink):
    """Write each report as one strict JSON object per line: ``step``, then the report's figures (see the module
    docstring); the keys of every line come in the same order.

    Args:
        path: the file to write (made absolute now).
        prefix: prepended to every figure's key (default none).
        per_param: one key per parameter (and per figure).
        style: the key names of ``GradReport.to_dict(style=...)``.
        flush_every: flush the file every this many lines (default 1).
        mode: ``"a"`` (default) appends to an existing file, continuing its key order; ``"w"`` overwrites it.
        stage_group, group, log_rank: which process writes (see the module docstring); none given: this one.
    """

    def __init__(self, path: str | os.PathLike[str], prefix: str = "", per_param: bool = True,
                 style: str = "default", flush_every: int = 1, mode: str = "a", *, stage_group: Any = None,
                 group: Any = None, log_rank: int | None = None) -> None:
        super().__init__(path, prefix, per_param, style, flush_every, mode, stage_group, group, log_rank)

    def _resume(self) -> None:
        last = _last_object(self.path)
        if last is not None:
            self.columns = list(last)
            self._known = set(self.columns)

    def log(self, report: AnyReport, step: int) -> None:
        self._check_open()
        if not self.writes:
            return
        row = self._row(report, step)
        assert self._file is not None
        self._new_columns(row)
        line = strict_json({k: row.get(k) for k in self.columns})
        self._file.write(json.dumps(line, allow_nan=False) + "\n")
        self._wrote()
