"""TensorBoard sink: write gradient reports to a ``SummaryWriter``.

Example::

    from torch.utils.tensorboard import SummaryWriter
    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    sink = TensorBoardSink(SummaryWriter("runs/exp"), histograms=True)
    ...
    sink.log(tg.grad_stats(model.named_parameters()).report(), step)

What it writes at each step (``prefix`` defaults to ``"grad/"``):

* one scalar per figure of :func:`torch_gradstats.integrations.metrics`: ``grad/total_norm``, ``grad/health``,
  ``grad/nan_count``, ... and ``grad/first_nonfinite_index`` (-1 while everything is finite);
* with ``per_param``: ``grad/norm/<parameter>`` (and, from an ``UpdateReport``, ``grad/weight_norm/<parameter>``,
  ``grad/lr_update_ratio/<parameter>``, ``grad/update_ratio/<parameter>``);
* with ``histograms``: ``grad/norms`` (and ``grad/update_ratios``), a histogram over parameters of the per-parameter
  values at that step (non-finite values left out; their count is in the scalars); and, when the report was read
  with ``histogram=True``, ``grad/exponents``: the exponent histogram of every gradient element, written with
  ``add_histogram_raw`` from the counts the report already holds (no gradient is copied to the host). Each bucket
  is ``[2**e, 2**(e + 1))`` of |g|, its limit the upper edge ``2**(e + 1)``; only finite non-zero values are in it
  (zeros, NaN and Inf are scalars of their own). The raw histogram's ``sum`` and ``sum_squares`` are written as 0:
  the op does not compute the sum of |g|, and TensorBoard draws the buckets only;
* when a gradient is non-finite: a text entry ``grad/first_nonfinite`` naming the first such parameter.

Closing: a writer the sink made (``writer`` given as a log directory) is the sink's: :meth:`TensorBoardSink.close`
(also as a context manager) closes it, and so does the end of the process (or the sink being dropped) when
``close`` was never called, so no event still queued in the writer is lost. A ``SummaryWriter`` you pass is yours:
``close`` flushes it and leaves it open, and the sink flushes it too at the end of the process. After ``close``,
``log`` raises ``ValueError``; so do ``log`` and ``flush`` in a child made by ``fork`` (a DataLoader worker), whose
copy of a ``SummaryWriter`` has no thread writing its queue (writing through it would wait forever).
:meth:`TensorBoardSink.flush` writes every queued event now, and ``flush_every=N`` does so every N ``log`` calls: a
``SummaryWriter`` writes on its own every ``flush_secs``, 120 s by default, and a process killed by ``SIGKILL`` (the
kernel's out-of-memory killer) loses what was logged since.

Distributed: with ``stage_group=`` (pipeline parallelism), ``group=`` or ``log_rank=``, only the logging rank
(:func:`torch_gradstats.distributed.reduce.is_logging_rank`: the last stage's first rank of ``group``, or global rank
``log_rank``) writes; elsewhere ``log`` does nothing and a log directory given as ``writer`` is not created.
"""

from __future__ import annotations

import numbers
import os
import weakref
from collections.abc import Callable
from typing import Any

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations.sinks import AnyReport, check_style, finite_values, grad_report, metrics
from torch_gradstats.monitors.updates import UpdateReport
from torch_gradstats.ops._checks import check_bool
from torch_gradstats.stats.exponents import ExponentHistogram

__all__ = ["TensorBoardSink", "log_step_records"]


class TensorBoardSink:
    """Write reports to a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its ``add_scalar``,
    ``add_histogram`` and ``add_text`` methods, e.g. ``tensorboardX``).

    Args:
        writer: a SummaryWriter, or a log directory (a SummaryWriter is created there, closed by :meth:`close` or at
            the end of the process).
        prefix: tag prefix (default ``"grad/"``).
        per_param: write one scalar per parameter and figure.
        histograms: also write histograms over parameters of the per-parameter norms, and the exponent histogram
            of reports read with ``histogram=True``.
        key_style: the scalar tags of ``GradReport.to_dict(style=...)`` (default: ours).
        flush_every: flush the writer every this many ``log`` calls (1: every event on disk when ``log`` returns,
            as a ``CSVSink`` writes its rows); None (the default): the writer's own schedule (``flush_secs``).
        stage_group, group, log_rank: which process writes (see the module docstring); none given: this one.
    """

    def __init__(self, writer: Any, prefix: str = "grad/", per_param: bool = True, histograms: bool = False,
                 key_style: str = "default", *, flush_every: int | None = None, stage_group: Any = None,
                 group: Any = None, log_rank: int | None = None) -> None:
        #: whether this process writes (False on the ranks other than the logging rank)
        check_bool("TensorBoardSink: histograms", histograms)  # before a log directory is made
        check_style("TensorBoardSink", "key_style", key_style)
        if flush_every is not None and (isinstance(flush_every, bool) or not isinstance(flush_every, numbers.Integral)
                                        or flush_every < 1):
            raise ValueError(f"TensorBoardSink: flush_every must be a positive int or None, got {flush_every!r}")
        self.flush_every = None if flush_every is None else int(flush_every)
        self._since_flush = 0
        self.writes = writes_here("TensorBoardSink", stage_group, group, log_rank)
        if isinstance(writer, str) or hasattr(writer, "__fspath__"):
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            # A rank that does not write creates no log directory: its writer is None.
            writer = SummaryWriter(str(writer)) if self.writes else None
            end = None if writer is None else writer.close
        else:
            if self.writes and not callable(getattr(writer, "add_scalar", None)):
                raise TypeError("TensorBoardSink: writer must be a SummaryWriter (something with add_scalar, "
                                f"add_histogram and add_text) or a log directory, got a {type(writer).__name__}")
            end = getattr(writer, "flush", None) if self.writes else None
        self.writer: Any = writer
        self._closed = False
        # At close(), at the end of the process or when the sink is dropped: a writer the sink made is closed, yours
        # flushed. A SummaryWriter's events wait in a queue that a daemon thread writes: never closed, the last ones
        # are lost at exit.
        self._pid = os.getpid()  # a forked child's copy of the sink refuses to write
        self._end = weakref.finalize(self, _end_writer, self._pid, end) if callable(end) else None
        self.prefix = prefix
        self.per_param = per_param
        self.histograms = histograms
        self.key_style = key_style

    def log(self, report: AnyReport, step: int) -> None:
        if self._closed:
            raise ValueError("TensorBoardSink: the sink is closed")
        # An event's step is an int64: a float step would be truncated there (1.7 written as 1).
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"TensorBoardSink.log: step must be an int, got {step!r} ({type(step).__name__})")
        if not self.writes:
            return
        self._check_process()
        for tag, value in metrics(report, self.prefix, self.per_param, self.key_style).items():
            self.writer.add_scalar(tag, value, step)
        g = grad_report(report)
        if self.histograms:
            import numpy as np

            norms = finite_values(list(g.norms.values()))
            if norms:
                self.writer.add_histogram(self.prefix + "norms", np.asarray(norms), step)
            if isinstance(report, UpdateReport) and report.update_ratios:
                ratios = finite_values(list(report.update_ratios.values()))
                if ratios:
                    self.writer.add_histogram(self.prefix + "update_ratios", np.asarray(ratios), step)
            if g.exponent_histogram is not None:
                self._log_exponents(g.exponent_histogram, step)
        if g.first_nonfinite is not None:
            more = f" (+{len(g.nonfinite) - 1} more)" if len(g.nonfinite) > 1 else ""
            self.writer.add_text(self.prefix + "first_nonfinite", f"{g.first_nonfinite}{more}", step)
        if self.flush_every is not None:
            self._since_flush += 1
            if self._since_flush >= self.flush_every:
                self.flush()

    def flush(self) -> None:
        """Write every event the writer still holds."""
        self._since_flush = 0
        if self.writes and not self._closed and callable(getattr(self.writer, "flush", None)):
            self._check_process()
            self.writer.flush()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise ValueError("TensorBoardSink: the sink was made by the process this one was forked from, whose "
                             "writer's events only that process writes; make a sink of its own in this process "
                             "(another log directory)")

    def close(self) -> None:
        """Close the writer the sink made, or flush the one you gave (it stays open); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._end is not None:
            self._end()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_exponents(self, hist: ExponentHistogram, step: int) -> None:
        first, end = hist.nonzero_range()
        if first == end:
            return  # no finite non-zero element: nothing to draw
        edges = hist.edges()
        counts = hist.counts[first:end]
        self.writer.add_histogram_raw(
            self.prefix + "exponents", min=edges[first], max=edges[end], num=sum(counts), sum=0.0, sum_squares=0.0,
            bucket_limits=edges[first + 1 : end + 1], bucket_counts=list(counts), global_step=step,
        )


def _end_writer(pid: int, end: Callable[[], Any]) -> None:
    """Close (or flush) a sink's writer, in the process that made the sink only: a child made by ``fork`` has a copy
    of the writer without the thread that writes its queue (closing it there could wait on that queue forever)."""
    if os.getpid() == pid:
        end()


def log_step_records(writer: Any, records: Any, prefix: str = "grad/") -> None:
    """Write :class:`torch_gradstats.training.StepRecord` rows (an epoch summary's ``history``) to a writer, one point
    per optimizer step: ``<prefix>total_norm``, ``<prefix>health``, ``<prefix>nan_count``, ``<prefix>inf_count``,
    ``<prefix>skipped`` and ``train/loss``. Non-finite norms are written as they are (TensorBoard shows a gap)."""
    for r in records:
        writer.add_scalar("train/loss", r.loss, r.step)
        writer.add_scalar(prefix + "total_norm", r.total_norm, r.step)
        writer.add_scalar(prefix + "health", r.health, r.step)
        writer.add_scalar(prefix + "nan_count", float(r.nan_count), r.step)
        writer.add_scalar(prefix + "inf_count", float(r.inf_count), r.step)
        writer.add_scalar(prefix + "skipped", float(r.skipped), r.step)
