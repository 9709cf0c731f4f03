"""Weights & Biases sink: log gradient reports to a W&B run with an explicit step.

Example::

    import wandb
    from torch_gradstats.integrations.wandb import WandbSink

    run = wandb.init(project="my-project")
    sink = WandbSink(run)
    ...
    sink.log(tg.grad_stats(model.named_parameters()).report(), step)

Each call is one ``run.log(figures, step=step)`` with the figures of :func:`torch_gradstats.integrations.metrics`
(``grad/total_norm``, ``grad/health``, ``grad/nan_count``, ..., ``grad/norm/<parameter>``), all numbers, so every
one becomes a line chart. The name of the first parameter whose gradient went non-finite is a string: it goes to
the run's summary (``run.summary["grad/first_nonfinite"]``, with ``grad/first_nonfinite_step``), not to the
history. W&B requires steps that never decrease across all ``run.log`` calls of a run, and drops a row logged at
a lower step with a mere warning: a step lower than one this sink already logged is refused (``ValueError`` naming
both) rather than lost. A step logged again joins that step's row (the later values win, as W&B does). Pass
``commit=False`` to let the figures join the row your own next ``run.log`` call completes.

Compared with ``wandb.watch(model, log="gradients")``: ``watch`` hooks every parameter and uploads a histogram of
each gradient's *values* every ``log_freq`` batches (a copy of every gradient, two host reads and a ``histc`` per
parameter, NaN and Inf left out); this sink uploads per-parameter *norms* and the counts computed on the device in
one read, at the steps you choose, and, for reports read with ``histogram=True``, ``grad/exponents``: a
``wandb.Histogram`` of the binary exponents ``floor(log2 |g|)`` of every finite non-zero gradient element (its
x axis is log2 |g|), from the same read. The fp16/bf16/fp8 underflow and overflow fractions come with the figures.

Distributed: with ``stage_group=`` (pipeline parallelism), ``group=`` or ``log_rank=``, only the logging rank
(:func:`torch_gradstats.distributed.reduce.is_logging_rank`: the last stage's first rank of ``group``, or global rank
``log_rank``) logs; elsewhere ``log`` does nothing and needs no run, so ``wandb.init`` can be called on that
rank alone.
"""

from __future__ import annotations

import numbers
from typing import Any

from torch_gradstats.integrations._logging_rank import writes_here
from torch_gradstats.integrations.sinks import AnyReport, check_style, grad_report, metrics
from torch_gradstats.ops.op import HISTOGRAM_MIN_EXPONENT
from torch_gradstats.stats.exponents import ExponentHistogram

__all__ = ["WandbSink", "exponent_histogram"]


def exponent_histogram(hist: ExponentHistogram) -> Any:
    """``wandb.Histogram`` of an exponent histogram: buckets ``[e, e + 1)`` of log2 |g| for the non-empty range
    (at most 277 bins, under W&B's limit of 512)."""
    if not isinstance(hist, ExponentHistogram):
        raise TypeError(f"exponent_histogram: expected an ExponentHistogram (GradReport.exponent_histogram), got a "
                        f"{type(hist).__name__}")
    import wandb

    first, end = hist.nonzero_range()
    if first == end:
        first, end = 0, 1  # nothing finite and non-zero: one empty bucket
    edges = [float(HISTOGRAM_MIN_EXPONENT + b) for b in range(first, end + 1)]
    return wandb.Histogram(np_histogram=(list(hist.counts[first:end]), edges))


class WandbSink:
    """Log reports to a W&B run.

    Args:
        run: a ``wandb`` run (``wandb.init(...)``); None uses the current ``wandb.run`` at each call.
        prefix: key prefix (default ``"grad/"``).
        per_param: log one value per parameter and figure.
        commit: passed to ``run.log`` (None: W&B's default).
        key_style: the keys of ``GradReport.to_dict(style=...)`` (default: ours).
        stage_group, group, log_rank: which process logs (see the module docstring); none given: this one.
    """

    def __init__(self, run: Any = None, prefix: str = "grad/", per_param: bool = True,
                 commit: bool | None = None, key_style: str = "default", *, stage_group: Any = None,
                 group: Any = None, log_rank: int | None = None) -> None:
        #: whether this process logs (False on the ranks other than the logging rank)
        self.writes = writes_here("WandbSink", stage_group, group, log_rank)
        self.run = run
        self.prefix = prefix
        self.per_param = per_param
        self.commit = commit
        self.key_style = check_style("WandbSink", "key_style", key_style)
        self._first_recorded = False
        self._last_step: int | None = None  # the highest step logged: W&B drops a row at a lower one

    def _run(self) -> Any:
        if self.run is not None:
            return self.run
        import wandb

        if wandb.run is None:
            raise RuntimeError("WandbSink: no W&B run; call wandb.init() first or pass run=")
        return wandb.run

    def log(self, report: AnyReport, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"WandbSink.log: step must be an int, got {step!r} ({type(step).__name__})")
        step = int(step)
        if not self.writes:
            return
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"WandbSink.log: step {step} is lower than step {self._last_step}, already logged; W&B "
                             "steps never decrease (W&B would drop this row)")
        run = self._run()
        kwargs: dict[str, Any] = {"step": step}
        if self.commit is not None:
            kwargs["commit"] = self.commit
        figures: dict[str, Any] = dict(metrics(report, self.prefix, self.per_param, self.key_style))
        g = grad_report(report)
        if g.exponent_histogram is not None:
            figures[self.prefix + "exponents"] = exponent_histogram(g.exponent_histogram)
        run.log(figures, **kwargs)
        self._last_step = step
        if g.first_nonfinite is not None and not self._first_recorded:
            self._first_recorded = True
            run.summary[self.prefix + "first_nonfinite"] = g.first_nonfinite
            run.summary[self.prefix + "first_nonfinite_step"] = step
