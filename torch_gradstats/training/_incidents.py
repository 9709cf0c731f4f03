"""Skipped steps and other incidents, told at the next host read: :class:`StepIncidents`.

Shared by the Trainer and the Lightning and Hugging Face callbacks (split from ``_trainer`` so that the callbacks
can use it without the loop). Every optimizer step writes one small row on the device (the step, whether it was
skipped, whether a gradient was non-finite, and with ``per_example`` the step's top 3 examples and the median of its
per-example gradient norms); nothing is read on the host then. The rows travel with the next transfer the caller
makes anyway (the Trainer's sync, a logging step's report): each skipped or non-finite step is then named in a
WARNING on the ``torch_gradstats`` logger, and a flight recorder, when kept, is dumped beside it. A callback, whose
run may log no step, has its rows read once :data:`UNREAD_MAX` of them wait (``read_after``): one small transfer per
that many steps, so that they neither pile up for the whole run nor go untold. The Trainer's rows wait for its sync
(once per epoch, or every ``sync_every`` steps), as everything else it keeps does.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.monitors.per_example import PerExampleNorms
from torch_gradstats.ops._transfer import to_host
from torch_gradstats.stats.gradients import ExtraFigures, GradStats
from torch_gradstats.stats.groups import GroupStats

__all__ = ["UNREAD_MAX", "StepIncidents", "check_flight_recorder"]

logger = logging.getLogger("torch_gradstats")

TOP = 3  # batch positions named in a skipped step's warning
_STEP, _SKIPPED, _NONFINITE, _COUNT, _MEDIAN, _IDX = 0, 1, 2, 3, 4, 5  # row layout; then TOP indices, TOP norms
_WIDTH = _IDX + 2 * TOP
UNREAD_MAX = 256  # a callback's rows left unread by its transfers: read then (a run that logs no step)
EXAMPLE_KEYS = ("examples/max_norm", "examples/median_norm", "examples/max_over_median")


def check_flight_recorder(who: str, value: Any) -> FlightRecorder | None:
    """``flight_recorder=``: None, a capacity (int >= 1: ``FlightRecorder(value)``) or a FlightRecorder."""
    if value is None or isinstance(value, FlightRecorder):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, numbers.Integral)) or value < 1:  # numpy ints too
        raise TypeError(f"{who}: flight_recorder must be None, a capacity (an int >= 1) or a FlightRecorder, "
                        f"got {value!r}")
    return FlightRecorder(int(value))


class StepIncidents:
    """Per-step rows on the device, read with the caller's next transfer (see the module docstring).

    Args:
        model: the model whose per-example norms are taken when ``per_example``.
        per_example: keep a :class:`~torch_gradstats.PerExampleNorms` of ``model`` (``loss_reduction``).
        recorder: a :class:`~torch_gradstats.FlightRecorder` recording every step, dumped at an incident.
        who: the caller's name, for messages.
        name: the optimizer's name where a callback keeps one record per optimizer (several optimizers): its
            warnings say ``(optimizer '<name>')`` after the step, and its dumps are ``flight-<name>-<step>.jsonl``.
        read_after: read the rows once this many wait unread (a callback's :data:`UNREAD_MAX`); None: only with
            the caller's transfers.
    """

    def __init__(self, model: nn.Module | None, *, per_example: bool, recorder: FlightRecorder | None,
                 loss_reduction: str = "mean", who: str = "Trainer", nonfinite_told: bool = False,
                 name: str | None = None, read_after: int | None = None) -> None:
        self.who = who
        self.read_after = read_after
        self.name = name
        self.label = f" (optimizer {name!r})" if name is not None else ""  # after the step number in warnings
        # The caller names non-finite steps itself: ours add nothing unless they carry examples or a dump.
        self.nonfinite_told = nonfinite_told and not per_example and recorder is None
        self.recorder = recorder
        self.per_example: PerExampleNorms | None = None
        if per_example:
            if model is None:
                raise ValueError(f"{who}: per_example=True needs the model")
            self.per_example = PerExampleNorms(model, loss_reduction=loss_reduction)
        self._rows: Tensor | None = None  # [capacity, _WIDTH] float64, the first self._count rows pending
        self._count = 0
        self._examples: Tensor | None = None  # float64 [3]: the last step's max, median, max / median
        self.last_dump: Path | None = None  #: the last flight recorder file written
        self.last_step: int | None = None  #: the step of the last :meth:`note` (the caller's optimizer step)

    def begin_step(self) -> None:
        """A new optimizer step starts: forget the examples recorded so far."""
        if self.per_example is not None:
            self.per_example.reset()

    def remove(self) -> None:
        if self.per_example is not None:
            self.per_example.remove()

    # ------------------------------------------------------------------------------------------- on the device
    def note(self, step: int, stats: GradStats | None, skipped: Tensor | None, *, scale: Tensor | float = 1.0,
             loss: Tensor | None = None, guard: Any = None, clip: Any = None,
             groups: GroupStats | None = None) -> None:
        """One optimizer step, on the device (no host read): ``skipped`` is a 0-d tensor, non-zero when the step was
        skipped (None: not skipped); ``scale`` multiplies the raw per-example norms into each example's own
        ``||grad loss_i||`` (the caller's loss weighting). Records the step in the flight recorder (with ``groups``, the
        groups' figures too)."""
        if stats is None or not len(stats.names):
            return
        device = stats.total_norm.device
        self.last_step = step
        if self.recorder is not None:
            self.recorder.record(stats, loss=loss, guard=guard, clip=clip, groups=groups, step=step)
        row = torch.full((_WIDTH,), math.nan, dtype=torch.float64, device=device)
        row[_STEP] = step
        row[_SKIPPED] = 0.0 if skipped is None else (skipped.reshape(()).to(device) != 0).to(torch.float64)
        row[_NONFINITE] = (stats.nonfinite_count > 0).to(torch.float64)
        row[_COUNT] = 0.0
        pe = self.per_example
        if pe is not None and pe.num_examples:
            norms = pe.norms().to(device=device, dtype=torch.float64) * scale
            k = min(TOP, norms.shape[0])
            values, indices = torch.topk(norms, k)
            median = norms.nanmedian()  # of the examples with a norm: one NaN example leaves the others
            row[_COUNT] = norms.shape[0]
            row[_MEDIAN] = median
            row[_IDX:_IDX + k] = indices.to(torch.float64)
            row[_IDX + TOP:_IDX + TOP + k] = values
            self._examples = torch.stack([values[0], median, values[0] / median])
        else:
            self._examples = None
        if self._rows is None or self._rows.device != device or self._count == self._rows.shape[0]:
            grown = torch.full((max(16, 2 * self._count), _WIDTH), math.nan, dtype=torch.float64, device=device)
            if self._rows is not None and self._count:
                grown[: self._count] = self._rows[: self._count].to(device)
            self._rows = grown
        self._rows[self._count] = row
        self._count += 1
        if self.read_after is not None and self._count >= self.read_after:  # no transfer read them: told now
            self.read_now()

    def example_figures(self) -> ExtraFigures | None:
        """The last step's ``examples/max_norm``, ``examples/median_norm``, ``examples/max_over_median``, for a
        report's one transfer; None without per-example norms."""
        if self._examples is None:
            return None
        return ExtraFigures([self._examples], [], lambda f, i: dict(zip(EXAMPLE_KEYS, f)))

    def pending(self) -> ExtraFigures | None:
        """The rows since the last read, for the caller's next transfer (put it before a guard's figures, so that
        the warnings come before a :class:`~torch_gradstats.SpikeStreakError`); None when there are none."""
        if not self._count or self._rows is None:
            return None
        return ExtraFigures([self._rows[: self._count]], [], self._read)

    def drop_pending(self) -> None:
        """Let the rows since the last read go unread: on a rank whose reports are not made (the logging rank's tell
        the same steps), so that they do not pile up there."""
        self._count = 0

    # ------------------------------------------------------------------------------------------- on the host
    def read_now(self) -> None:
        """Read the pending rows now (one small transfer): where a skip was just decided on the host."""
        pending = self.pending()
        if pending is not None:
            floats, ints = to_host(list(pending.floats), list(pending.ints))
            pending.read(floats, ints)

    def _read(self, floats: list[float], ints: list[int]) -> dict[str, float]:
        self._count = 0
        rows = [floats[i:i + _WIDTH] for i in range(0, len(floats), _WIDTH)]
        incidents = [r for r in rows if (r[_SKIPPED] or r[_NONFINITE]) and not (r[_NONFINITE] and self.nonfinite_told)]
        if incidents:
            path = self.dump(int(incidents[0][_STEP]))
            for r in incidents:
                self._warn(r, path)
        return {}

    def dump(self, step: int) -> Path | None:
        """Write the flight recorder as ``<dump_dir>/flight-<step>.jsonl`` (``flight-<name>-<step>.jsonl`` for a
        named optimizer's; and ``.png``); None without one."""
        if self.recorder is None or not len(self.recorder):
            return None
        stem = f"flight-{step}" if self.name is None else f"flight-{self.name}-{step}"
        self.last_dump = self.recorder.dump(self.recorder.dump_dir / f"{stem}.jsonl")
        return self.last_dump

    def _warn(self, r: list[float], path: Path | None) -> None:
        step = int(r[_STEP])
        if r[_SKIPPED]:
            what = "non-finite gradient" if r[_NONFINITE] else "gradient spike"
            head = f"optimizer step {step}{self.label} skipped ({what})"
        else:
            head = f"non-finite gradient at optimizer step {step}{self.label} (step taken)"
        words = [head]
        n = int(r[_COUNT]) if not math.isnan(r[_COUNT]) else 0
        if n:
            top = ", ".join(f"#{int(r[_IDX + j])} norm {r[_IDX + TOP + j]:.4g}" for j in range(min(TOP, n)))
            words.append(f"largest per-example gradient norms of its {n} examples (0-based batch positions): {top}; "
                         f"batch median {r[_MEDIAN]:.4g}")
        if path is not None:
            words.append(f"flight recorder dumped to {os.fspath(path)}")
        logger.warning("torch_gradstats: %s", "; ".join(words))

    def dump_on_error(self, step: int, error: BaseException) -> None:
        """At a :class:`~torch_gradstats.SpikeStreakError`: dump the flight recorder and name the file."""
        path = self.dump(step)
        if path is not None:
            logger.warning("torch_gradstats: %s at optimizer step %d%s; flight recorder dumped to %s",
                           type(error).__name__, step, self.label, os.fspath(path))
