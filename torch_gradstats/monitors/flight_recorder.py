"""The last steps at full resolution, kept on the device: :class:`FlightRecorder`.

Logging every step costs a host transfer per step, so runs log every N steps and have no record of the steps just
before a blow-up. :meth:`FlightRecorder.record` copies a step's figures (total norm, max |g|, zero/NaN/Inf counts,
the loss, the guard's and the clip's figures, per-group figures) into one row of two ring buffers on the device: the
same few launches every step and no host read. :meth:`FlightRecorder.to_dicts` brings the whole ring to the host in
one transfer, and :meth:`FlightRecorder.dump` writes it as strict JSON lines and a PNG, for the moment something
went wrong.

A figure that :meth:`GradReport.to_dict <torch_gradstats.GradReport.to_dict>` also has carries its key, without a
prefix, and the same value as that step's report: ``total_norm`` (from the same float64 sum of squares),
``inf_norm``, ``zero_count``, ``nan_count``, ``inf_count``, ``clip_coef`` and ``clipped_norm`` after
:func:`~torch_gradstats.clip_grad_norm_`, ``guard/...`` and ``clip/...`` (from the policies' ``check_tensors`` and
``check_values``), and ``group/<g>/norm``, ``group/<g>/max_abs``, ``group/<g>/nonfinite``.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from torch_gradstats.ops._transfer import to_device, to_host
from torch_gradstats.ops.op import INF, NAN
from torch_gradstats.policies.guard import SpikeGuard
from torch_gradstats.stats.gradients import GradStats
from torch_gradstats.stats.groups import GroupStats

__all__ = ["FlightRecorder"]

logger = logging.getLogger("torch_gradstats.flight_recorder")

Figure = float | int | None
_COUNTS = ("zero_count", "nan_count", "inf_count")
_TRIPPED = 3  # SpikeGuard's counters: steps, skipped, consecutive, tripped, trip step


class StepPolicy(Protocol):
    """What :meth:`FlightRecorder.record` reads from a guard or a clip: :class:`~torch_gradstats.SpikeGuard` and
    :class:`~torch_gradstats.AdaptiveClip` have both."""

    def check_tensors(self) -> tuple[list[Tensor], list[Tensor]]: ...

    def check_values(self, floats: list[float], ints: list[int]) -> dict[str, float]: ...


def _policy(what: str, policy: Any) -> StepPolicy | None:
    if policy is not None and not (callable(getattr(policy, "check_tensors", None))
                                   and callable(getattr(policy, "check_values", None))):
        raise TypeError(f"FlightRecorder.record: {what} must be a SpikeGuard, an AdaptiveClip or None (an object "
                        f"with check_tensors() and check_values()), got a {type(policy).__name__}")
    return policy


class _Layout:
    """What one row holds, fixed by the first record but for the groups (a new one adds its columns at the end):
    the float and int slots, and how to name their values."""

    def __init__(self, stats: GradStats | GroupStats, groups: GroupStats | None, guard: StepPolicy | None,
                 clip: StepPolicy | None, floats: list[Tensor], ints: list[Tensor]) -> None:
        self.clipped = isinstance(stats, GradStats) and stats.clip_coef is not None and stats.clipped_norm is not None
        self.groups = list(groups.names) if groups is not None else None
        self.group_totals = isinstance(stats, GroupStats)  # the totals are the groups' sums, not every parameter's
        self.guard = guard
        self.clip = clip
        self.policy_sizes = [
            (sum(t.numel() for t in f), sum(t.numel() for t in i))
            for f, i in ((p.check_tensors() if p is not None else ([], [])) for p in (guard, clip))
        ]
        self.n_floats = sum(t.numel() for t in floats)
        self.n_ints = sum(t.numel() for t in ints)

    def read(self, f: list[float], i: list[int], present: frozenset[str] | None = None) -> dict[str, Figure]:
        """A row's host values as named figures (total norm from the sum of squares, as a report makes it);
        ``present``: the groups the step had, when some had no gradient (the others' figures are None)."""
        out: dict[str, Figure] = {"total_norm": math.sqrt(f[0]) if not math.isnan(f[0]) else math.nan,
                                  "inf_norm": f[1]}
        out.update(zip(_COUNTS, i[:3]))
        f, i = f[2:], i[3:]
        if self.clipped:
            out["clip_coef"], out["clipped_norm"] = f[0], f[1]
            f = f[2:]
        for policy, (nf, ni) in zip((self.guard, self.clip), self.policy_sizes):
            if policy is None:
                continue
            pf, pi = f[:nf], list(i[:ni])
            if isinstance(policy, SpikeGuard):
                pi[_TRIPPED] = 0  # a snapshot: raising SpikeStreakError (and clearing the flag) is the guard's read
            out.update(policy.check_values(pf, pi))
            f, i = f[nf:], i[ni:]
        if self.groups is not None:
            g = len(self.groups)
            for k, name in enumerate(self.groups):
                if present is not None and name not in present:
                    out[f"group/{name}/norm"] = out[f"group/{name}/max_abs"] = out[f"group/{name}/nonfinite"] = None
                    continue
                out[f"group/{name}/norm"] = math.sqrt(f[k]) if not math.isnan(f[k]) else math.nan
                out[f"group/{name}/max_abs"] = f[g + k]
                out[f"group/{name}/nonfinite"] = i[3 * k + NAN] + i[3 * k + INF]
        return out


class FlightRecorder:
    """A ring buffer on the device of the last ``capacity`` steps' figures (see the module docstring).

    Args:
        capacity: how many steps to keep (int >= 1).
        dump_dir: where :meth:`dump` writes ``flight-<step>.jsonl`` and ``.png`` when given no path; a relative one
            is resolved when the recorder is made.
    """

    def __init__(self, capacity: int = 256, *, dump_dir: str | os.PathLike[str] = ".") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, numbers.Integral)) or capacity < 1:
            raise ValueError(f"FlightRecorder: capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(dump_dir, (str, os.PathLike)):
            raise TypeError(f"FlightRecorder: dump_dir must be a str or path, got a {type(dump_dir).__name__}")
        self.capacity: int = int(capacity)
        self.dump_dir = Path(dump_dir).absolute()  # fixed now, as the sinks' paths: a later chdir moves no dump
        self.steps = 0  #: record() calls so far (the next step's number)
        self._layout: _Layout | None = None
        self._floats: Tensor | None = None  # [capacity, n_floats] float64
        self._ints: Tensor | None = None  # [capacity, n_ints] int64
        self._has_loss: list[bool] = [False] * self.capacity  # known on the host: no device value needed
        self._step_of: list[int] = [0] * self.capacity  # each slot's step number, known on the host
        # per slot, the groups the step had when some of the ring's groups had no gradient (None: all of them)
        self._present: list[frozenset[str] | None] = [None] * self.capacity
        self._group_index: tuple[tuple[str, ...], Tensor] | None = None  # the last such step's slots, kept

    def __len__(self) -> int:
        return min(self.steps, self.capacity)

    @property
    def device(self) -> torch.device | None:
        """Where the ring lives (the first recorded statistics' device), None before the first record."""
        return None if self._floats is None else self._floats.device

    def record(self, stats: GradStats | GroupStats, *, loss: Tensor | float | None = None,
               guard: Any = None, clip: Any = None, groups: GroupStats | None = None, step: int | None = None) -> None:
        """Append a step: ``stats``'s totals (and its per-group figures if it is a :class:`GroupStats`, or those of
        ``groups``; a GroupStats from ``GradStats.grouped`` gives the totals of every parameter, grouped or not,
        any other its groups' sums), the loss, and the figures of ``guard`` (a :class:`SpikeGuard`) and ``clip`` (an
        :class:`AdaptiveClip`) after their step. No host read; every step must give the same kinds of figures, but
        the groups may change: a group without a gradient at a step (its parameters frozen or unused) has None
        figures for that step, and a group seen for the first time (a layer unfrozen later) is added to the ring,
        with None figures for the steps before it (a one-time reallocation of the ring, on the device).

        ``step`` is the row's ``step`` (an int >= 0, the caller's own count, e.g. the optimizer step, which goes on
        across a resumed run); None: the number of ``record`` calls before this one.
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0):
            raise ValueError(f"FlightRecorder.record: step must be an int >= 0 or None, got {step!r}")
        label = self.steps if step is None else int(step)  # the row's step, in messages too
        if isinstance(stats, GroupStats):
            if groups is not None:
                raise ValueError("FlightRecorder.record: stats is already a GroupStats; pass groups= only with a "
                                 "GradStats")
            groups = stats
            if isinstance(stats.source, GradStats):  # from GradStats.grouped: the totals of every parameter
                stats = stats.source
        elif not isinstance(stats, GradStats):
            raise TypeError(f"FlightRecorder.record: stats must be a GradStats or a GroupStats, got a "
                            f"{type(stats).__name__}")
        if groups is not None and not isinstance(groups, GroupStats):
            raise TypeError(f"FlightRecorder.record: groups must be a GroupStats or None, got a "
                            f"{type(groups).__name__}")
        guard_p, clip_p = _policy("guard", guard), _policy("clip", clip)
        device = self.device or (stats.device if isinstance(stats, GradStats) else stats.sumsq.device)
        if device.type == "meta" or (groups is not None and groups.sumsq.device.type == "meta"):
            raise ValueError("FlightRecorder.record: these statistics are of meta tensors, which have no values (a "
                             "model on the meta device); the ring would be made there and never read back: record "
                             "the statistics of gradients with data")
        present = None
        if (groups is not None and self._layout is not None and self._layout.groups is not None
                and list(groups.names) != self._layout.groups):
            new = [name for name in groups.names if name not in self._layout.groups]
            if new:  # a layer unfrozen (or first given a gradient) after the first record: the ring gains columns
                self._widen(new, label)
            groups, present = self._in_first_groups(groups, self._layout.groups), frozenset(groups.names)
        floats, ints = self._row(stats, groups, loss, guard_p, clip_p, device)
        if self._layout is None:
            self._layout = _Layout(stats, groups, guard_p, clip_p, floats, ints)
            with torch.inference_mode(False):  # ordinary tensors: every later record writes them, in any mode
                self._floats = torch.full((self.capacity, self._layout.n_floats), math.nan, dtype=torch.float64,
                                          device=device)
                self._ints = torch.zeros((self.capacity, self._layout.n_ints), dtype=torch.int64, device=device)
        else:
            self._same_layout(stats, groups, guard_p, clip_p, floats, ints, label)
        assert self._floats is not None and self._ints is not None
        slot = self.steps % self.capacity
        self._floats[slot].copy_(torch.cat([to_device(t.reshape(-1).to(torch.float64), device) for t in floats]))
        self._ints[slot].copy_(torch.cat([to_device(t.reshape(-1).to(torch.int64), device) for t in ints]))
        self._has_loss[slot] = loss is not None
        self._step_of[slot] = label
        self._present[slot] = present
        self.steps += 1

    def _widen(self, new: list[str], step: int) -> None:
        """Add columns for groups seen for the first time (appended after the known ones, whose columns keep their
        places): a new ring, the old one's values copied in on the device (no host read), once per new group. The
        steps already recorded did not have them: they read back as None there."""
        lay, old_floats, old_ints = self._layout, self._floats, self._ints
        assert lay is not None and lay.groups is not None and old_floats is not None and old_ints is not None
        g, g2 = len(lay.groups), len(lay.groups) + len(new)
        pf, pi = lay.n_floats - 2 * g, lay.n_ints - 3 * g  # the figures before the groups' (which come last)
        with torch.inference_mode(False):
            floats = old_floats.new_full((self.capacity, pf + 2 * g2), math.nan)
            ints = old_ints.new_zeros((self.capacity, pi + 3 * g2))
        floats[:, :pf + g].copy_(old_floats[:, :pf + g])  # the figures before the groups', the sums of squares
        floats[:, pf + g2:pf + g2 + g].copy_(old_floats[:, pf + g:])  # max |g|
        ints[:, :pi + 3 * g].copy_(old_ints)  # the counts: 3 per group, the new groups' after
        for slot in range(len(self)):
            if self._present[slot] is None:
                self._present[slot] = frozenset(lay.groups)
        logger.info("FlightRecorder: group(s) %s first recorded at step %d (the steps before it record None for "
                    "them)", new, step)
        self._floats, self._ints = floats, ints
        lay.groups = [*lay.groups, *new]
        lay.n_floats, lay.n_ints = pf + 2 * g2, pi + 3 * g2
        self._group_index = None

    def _in_first_groups(self, groups: GroupStats, first: list[str]) -> GroupStats:
        """``groups`` laid out as the ring's groups (``first``), when some of those have no gradient now (their
        parameters frozen or unused: their slots hold zeros, read back as None)."""
        names = tuple(groups.names)
        if self._group_index is None or self._group_index[0] != names:  # moved once per change of the groups
            where = torch.tensor([first.index(name) for name in names], dtype=torch.int64)
            self._group_index = (names, to_device(where, groups.sumsq.device))
        index = self._group_index[1]
        g = len(first)

        def placed(t: Tensor) -> Tensor:
            return t.new_zeros((g, *t.shape[1:])).index_copy_(0, index, t)

        return GroupStats(list(first), placed(groups.sumsq), placed(groups.amax), placed(groups.counts),
                          placed(groups.numel), dict(groups.members))

    @staticmethod
    def _row(stats: GradStats | GroupStats, groups: GroupStats | None, loss: Tensor | float | None,
             guard: StepPolicy | None, clip: StepPolicy | None,
             device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
        """The step's device tensors: floats (sum of squares, max |g|, loss, clip, policies, groups) and ints."""
        if isinstance(stats, GradStats):
            totals = [stats.total_sumsq, stats.inf_norm]
            counts = [stats.zero_count, stats.nan_count, stats.inf_count]
        else:
            empty = stats.amax.numel() == 0
            totals = [stats.sumsq.sum(), stats.amax.new_zeros(()) if empty else stats.amax.max()]
            counts = [stats.counts.sum(0)]
        if isinstance(loss, Tensor):
            if loss.numel() != 1:
                raise ValueError(f"FlightRecorder.record: loss must be one value, got a tensor of shape "
                                 f"{tuple(loss.shape)}")
            if loss.dtype == torch.bool or loss.is_complex():
                raise TypeError(f"FlightRecorder.record: loss must be a real tensor, got {loss.dtype}")
            if loss.device.type == "meta":
                raise ValueError("FlightRecorder.record: loss is a meta tensor, which has no value; pass the step's "
                                 "loss")
            loss_t = loss.detach()
        elif loss is None or (isinstance(loss, numbers.Real) and not isinstance(loss, bool)):  # numpy's too
            loss_t = torch.full((), math.nan if loss is None else float(loss), dtype=torch.float64)
        else:
            raise TypeError(f"FlightRecorder.record: loss must be a tensor, a number or None, got a "
                            f"{type(loss).__name__}")
        floats, ints = [*totals, loss_t], list(counts)
        if isinstance(stats, GradStats) and stats.clip_coef is not None and stats.clipped_norm is not None:
            floats += [stats.clip_coef, stats.clipped_norm]
        for policy in (guard, clip):
            if policy is not None:
                pf, pi = policy.check_tensors()
                floats += pf
                ints += pi
        if groups is not None:
            floats += [groups.sumsq, groups.amax]
            ints.append(groups.counts)
        return floats, ints

    def _same_layout(self, stats: GradStats | GroupStats, groups: GroupStats | None, guard: StepPolicy | None,
                     clip: StepPolicy | None, floats: Sequence[Tensor], ints: Sequence[Tensor], step: int) -> None:
        lay = self._layout
        assert lay is not None
        clipped = isinstance(stats, GradStats) and stats.clip_coef is not None and stats.clipped_norm is not None
        changed = [what for what, now, then in (
            ("the clip figures of clip_grad_norm_", clipped, lay.clipped),
            ("what the totals cover (every parameter, or the groups' own)", isinstance(stats, GroupStats),
             lay.group_totals),
            ("guard", guard is not None, lay.guard is not None),
            ("clip", clip is not None, lay.clip is not None),
            ("the groups", None if groups is None else list(groups.names), lay.groups),
            ("the number of figures", (sum(t.numel() for t in floats), sum(t.numel() for t in ints)),
             (lay.n_floats, lay.n_ints)),
        ) if now != then]
        if changed:
            raise ValueError(f"FlightRecorder.record: every step must record the same figures as the first; "
                             f"{changed[0]} changed at step {step}")

    # ------------------------------------------------------------------------------------------- host side
    def to_dicts(self) -> list[dict[str, Figure]]:
        """The last ``min(steps, capacity)`` steps, oldest first, in ONE device-to-host transfer: dicts with
        ``step`` (the ``step`` given to :meth:`record`, else 0-based, counting ``record`` calls), ``loss`` (None when
        not given) and the step's figures (see the module docstring)."""
        if self._layout is None or self._floats is None or self._ints is None:
            return []
        floats, ints = to_host([self._floats], [self._ints])
        nf, ni = self._layout.n_floats, self._layout.n_ints
        out = []
        for n in range(self.steps - len(self), self.steps):
            slot = n % self.capacity
            f, i = floats[slot * nf:(slot + 1) * nf], ints[slot * ni:(slot + 1) * ni]
            row: dict[str, Figure] = {"step": self._step_of[slot], "loss": f[2] if self._has_loss[slot] else None}
            row.update(self._layout.read(f[:2] + f[3:], i, self._present[slot]))  # f[2]: the loss
            out.append(row)
        return out

    def dump(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write :meth:`to_dicts` as strict JSON lines (a non-finite number as ``null``) to ``path`` (default
        ``dump_dir/flight-<last step>.jsonl``) and a PNG of the main figures beside it (``.png``; with matplotlib
        only: without it a warning is logged). Returns the JSON lines file's path."""
        rows = self.to_dicts()
        last = rows[-1]["step"] if rows else -1
        target = Path(path) if path is not None else self.dump_dir / f"flight-{last}.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({k: _strict(v) for k, v in row.items()}, allow_nan=False) + "\n" for row in rows)
        _plot(rows, target.with_suffix(".png"))
        return target


def _strict(v: Figure) -> Figure:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _plot(rows: list[dict[str, Figure]], path: Path) -> None:
    """Norms, loss and non-finite counts against the step, as a PNG (matplotlib's Agg canvas: no global state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure as MplFigure
    except ImportError:
        logger.warning("FlightRecorder.dump: matplotlib is not installed, so no plot was written beside the "
                       "figures (%s); pip install matplotlib", path.with_suffix(".jsonl").name)
        return
    steps = [r["step"] for r in rows]
    fig = MplFigure(figsize=(9, 6.5))
    FigureCanvasAgg(fig)
    ax_norm, ax_loss, ax_bad = fig.subplots(3, 1, sharex=True)
    series: list[tuple[Any, str, Callable[[dict[str, Figure]], Figure]]] = [
        (ax_norm, "total_norm", lambda r: r["total_norm"]),
        (ax_norm, "inf_norm (max |g|)", lambda r: r["inf_norm"]),
        (ax_loss, "loss", lambda r: r["loss"]),
        (ax_bad, "NaN + Inf elements", lambda r: (r["nan_count"] or 0) + (r["inf_count"] or 0)),
    ]
    for ax, label, get in series:
        values = [_finite_or_nan(get(r)) for r in rows]
        ax.plot(steps, values, marker=".", label=label)
        ax.legend(loc="upper left", fontsize="small")
    if any(v > 0 for v in (_finite_or_nan(r["total_norm"]) for r in rows)):
        ax_norm.set_yscale("log")
    for r in rows:  # a step the guard skipped, or one with a non-finite gradient
        bad = (r["nan_count"] or 0) + (r["inf_count"] or 0)
        if bad or (r.get("guard/consecutive") or 0) > 0:
            for ax in (ax_norm, ax_loss, ax_bad):
                ax.axvline(r["step"], color="red", alpha=0.3)
    ax_bad.set_xlabel("step")
    fig.suptitle(f"flight recorder: steps {steps[0]}-{steps[-1]}" if steps else "flight recorder: no steps")
    fig.savefig(path, dpi=100)


def _finite_or_nan(v: Figure) -> float:
    return float(v) if v is not None else math.nan
