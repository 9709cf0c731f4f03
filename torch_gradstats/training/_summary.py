"""What an epoch did: device-side running aggregates (:class:`EpochState`) and their host-side summaries.

:class:`EpochState` keeps everything the Trainer learns about the gradients on the device, as float64 0-d tensors
(counts are exact below 2**53), plus host-side counters known from the loop's structure. :meth:`EpochState.buffer`
is the one buffer sent to the host; :meth:`EpochState.summary` turns the values that came back into an
:class:`EpochSummary` (and :class:`StepRecord` rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.stats.gradients import GradStats

__all__ = ["EpochState", "EpochSummary", "StepRecord", "format_epoch_table"]


@dataclasses.dataclass
class StepRecord:
    """Gradient stats of one optimizer step on which stats were taken (host-side numbers)."""

    epoch: int
    step: int  #: global optimizer step index (0-based, counts skipped steps too)
    loss: float  #: per-sample mean loss of the samples of this step
    total_norm: float  #: global L2 norm of the gradients (after unscaling, before clipping); NaN/inf if non-finite
    health: float  #: HealthPolicy score, 0.0 when any gradient is non-finite
    nan_count: int
    inf_count: int
    skipped: bool  #: the optimizer step was skipped (non-finite gradients)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, in declaration order."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class EpochSummary:
    """What one epoch (or, mid-epoch, the epoch so far) did, from one host transfer.

    Norm aggregates cover the steps whose global norm was finite; non-finite steps are counted separately.
    Fields are None when there is nothing to aggregate (e.g. no step had stats).
    """

    epoch: int
    steps: int  #: optimizer steps (skipped ones included)
    batches: int  #: batches drawn from the loader (empty ones included)
    samples: int
    loss: float  #: per-sample mean loss over the epoch's steps whose loss was finite (NaN when none was)
    stats_steps: int  #: optimizer steps on which gradient stats were taken
    max_norm: float | None
    mean_norm: float | None
    min_health: float | None
    nan_count: int  #: total NaN gradient elements over the stats steps
    inf_count: int  #: total Inf gradient elements over the stats steps
    nonfinite_steps: int  #: stats steps with any NaN/Inf gradient
    skipped_steps: int  #: optimizer steps skipped because a gradient was non-finite
    first_nonfinite_step: int | None  #: global step of the first non-finite gradient this epoch
    first_nonfinite_param: str | None  #: name of the first parameter (model order) non-finite at that step
    nonfinite_loss_steps: int = 0  #: optimizer steps whose loss was NaN/Inf, left out of ``loss``
    history: list[StepRecord] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of the epoch figures (without the per-step history), for loggers."""
        d = dataclasses.asdict(self)
        d.pop("history")
        return d

    def __str__(self) -> str:
        return format_epoch_table([self])


def fmt(x: float | None, spec: str = ".4g") -> str:
    """A number for a table cell, ``-`` for None."""
    return "-" if x is None else format(x, spec)


def format_epoch_table(summaries: Sequence[EpochSummary]) -> str:
    """A short fixed-width table, one row per epoch summary; columns are named after the :class:`EpochSummary`
    fields they show (``max_norm``, ``mean_norm``: global L2 gradient norms; ``min_health``: the worst step)."""
    header = (
        f"{'epoch':>5} {'steps':>5} {'loss':>9} {'max_norm':>9} {'mean_norm':>9} {'min_health':>10} "
        f"{'NaN':>6} {'Inf':>6} {'skip':>4}  first non-finite"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        first = "-" if s.first_nonfinite_step is None else f"step {s.first_nonfinite_step}: {s.first_nonfinite_param}"
        lines.append(
            f"{s.epoch:>5} {s.steps:>5} {fmt(s.loss):>9} {fmt(s.max_norm):>9} {fmt(s.mean_norm):>9} "
            f"{fmt(s.min_health, '.3f'):>10} {s.nan_count:>6} {s.inf_count:>6} {s.skipped_steps:>4}  {first}"
        )
    return "\n".join(lines)


# Order of the aggregate fields in the one buffer sent to the host, then one row of _ROW_FIELDS per kept step.
_AGG_FIELDS = (
    "loss_sum",
    "loss_samples",
    "nonfinite_loss_steps",
    "norm_sum",
    "norm_max",
    "finite_steps",
    "health_min",
    "nan_total",
    "inf_total",
    "nonfinite_steps",
    "skipped",
    "first_step",
    "first_param",
)
_AGG_START = {
    "norm_max": -math.inf,
    "health_min": math.inf,
    "first_step": -1.0,
    "first_param": -1.0,
}  # every other field starts at 0
_ROW_FIELDS = ("loss", "total_norm", "health", "nan_count", "inf_count", "skipped")


class EpochState:
    """Device-side running aggregates of one epoch and the host-side counters of its loop."""

    def __init__(self, epoch: int, device: torch.device) -> None:
        self.epoch = epoch
        self.device = device
        self.agg: dict[str, Tensor] = {
            k: torch.full((), _AGG_START.get(k, 0.0), dtype=torch.float64, device=device) for k in _AGG_FIELDS
        }
        self.rows: list[Tensor] = []  # per stats step, not yet sent to the host
        self.row_steps: list[int] = []  # global step of each pending row (known on the host)
        self.names_log: list[tuple[int, list[str]]] = []  # (first step using it, parameter names) when it changes
        # Host-side counters (from shapes and loop structure; no sync).
        self.steps = 0
        self.batches = 0
        self.samples = 0
        self.stats_steps = 0
        self.history: list[StepRecord] = []

    # ------------------------------------------------------------------------------------------- on the device
    def add_window(self, batches: int, samples: int, loss_sum: Tensor) -> None:
        """One accumulation window's batches, samples and sample-weighted loss sum. A non-finite loss (a step the
        guard or ``skip_nonfinite`` skips, say) is counted, not summed: one NaN would make the epoch's loss NaN."""
        self.batches += batches
        self.samples += samples
        finite = torch.isfinite(loss_sum)
        self.agg["loss_sum"] += torch.where(finite, loss_sum, 0.0)
        self.agg["loss_samples"] += finite.to(torch.float64) * samples
        self.agg["nonfinite_loss_steps"] += (~finite).to(torch.float64)

    def add_empty_window(self, batches: int) -> None:
        """A window whose every batch was empty: counted as batches, nothing else."""
        self.batches += batches

    def add_step(self, skipped: Tensor) -> None:
        """One optimizer step, taken or skipped (``skipped``: float64 0-d, 1.0 when skipped)."""
        self.steps += 1
        self.agg["skipped"] += skipped

    def add_stats(
        self, step: int, stats: GradStats, health: Tensor, skipped: Tensor, step_loss: Tensor, keep_row: bool
    ) -> None:
        """Fold the gradient statistics of optimizer step ``step`` into the aggregates (no sync)."""
        a = self.agg
        norm = stats.total_norm.to(torch.float64)
        nan = stats.nan_count.to(torch.float64)
        inf = stats.inf_count.to(torch.float64)
        finite = torch.isfinite(norm)
        a["norm_sum"] += torch.where(finite, norm, 0.0)
        a["norm_max"] = torch.maximum(a["norm_max"], torch.where(finite, norm, -math.inf))
        a["finite_steps"] += finite.to(torch.float64)
        a["health_min"] = torch.minimum(a["health_min"], health.to(torch.float64))
        a["nan_total"] += nan
        a["inf_total"] += inf
        bad = (nan + inf) > 0
        a["nonfinite_steps"] += bad.to(torch.float64)
        # First non-finite step and, at that step, the first parameter (model order) with a NaN/Inf.
        new = bad & (a["first_step"] < 0)
        first_idx = stats.nonfinite_mask.to(torch.int32).argmax().to(torch.float64)  # argmax: first maximum
        a["first_step"] = torch.where(new, float(step), a["first_step"])
        a["first_param"] = torch.where(new, first_idx, a["first_param"])
        if not self.names_log or self.names_log[-1][1] != stats.names:
            self.names_log.append((step, list(stats.names)))
        self.stats_steps += 1
        if keep_row:
            self.rows.append(torch.stack([step_loss, norm, health.to(torch.float64), nan, inf, skipped]))
            self.row_steps.append(step)

    def buffer(self) -> Tensor:
        """Every aggregate and every pending row in one float64 buffer: what crosses to the host."""
        return torch.cat([torch.stack([self.agg[k] for k in _AGG_FIELDS]), *self.rows])

    # ------------------------------------------------------------------------------------------- on the host
    def summary(self, values: Sequence[float]) -> EpochSummary:
        """The epoch so far, from the host values of :meth:`buffer`; pending rows move to the history."""
        agg = dict(zip(_AGG_FIELDS, values[: len(_AGG_FIELDS)]))
        width = len(_ROW_FIELDS)
        flat = values[len(_AGG_FIELDS) :]
        for i, step in enumerate(self.row_steps):
            row = dict(zip(_ROW_FIELDS, flat[i * width : (i + 1) * width]))
            self.history.append(
                StepRecord(
                    epoch=self.epoch,
                    step=step,
                    loss=row["loss"],
                    total_norm=row["total_norm"],
                    health=row["health"],
                    nan_count=int(row["nan_count"]),
                    inf_count=int(row["inf_count"]),
                    skipped=bool(row["skipped"]),
                )
            )
        self.rows, self.row_steps = [], []
        finite_steps = int(agg["finite_steps"])
        first_step = int(agg["first_step"])
        return EpochSummary(
            epoch=self.epoch,
            steps=self.steps,
            batches=self.batches,
            samples=self.samples,
            loss=agg["loss_sum"] / agg["loss_samples"] if agg["loss_samples"] else math.nan,
            stats_steps=self.stats_steps,
            max_norm=agg["norm_max"] if finite_steps else None,
            mean_norm=agg["norm_sum"] / finite_steps if finite_steps else None,
            min_health=agg["health_min"] if self.stats_steps else None,
            nan_count=int(agg["nan_total"]),
            inf_count=int(agg["inf_total"]),
            nonfinite_steps=int(agg["nonfinite_steps"]),
            skipped_steps=int(agg["skipped"]),
            first_nonfinite_step=first_step if first_step >= 0 else None,
            first_nonfinite_param=self._name_at(first_step, int(agg["first_param"])) if first_step >= 0 else None,
            nonfinite_loss_steps=int(agg["nonfinite_loss_steps"]),
            history=list(self.history),
        )

    def _name_at(self, step: int, index: int) -> str | None:
        names = None
        for start, ns in self.names_log:
            if start <= step:
                names = ns
        if names is None or not 0 <= index < len(names):
            return None
        return names[index]
