"""SpikeGuard: skip the optimizer step whose gradient norm (or loss) spikes, decided on the device with no host sync.

The rule, for the gradient norm and (when given and ``watch_loss``) the loss alike: the *history* is the last
``window`` finite values recorded before this step. While the history holds fewer than ``min_history`` values the
step is taken. Otherwise the step is skipped when the value is non-finite or ``value - mean > sigma * std`` over the
history (``std`` with Bessel's correction, as ``torch.std_mean``); a step is skipped when either watched value says
so. After the decision the step's finite values enter the history when the step is taken, or always with
``count_skipped=True``; non-finite values never enter it.

A lasting change of level is adopted, so the guard never skips forever: once ``adopt_after`` steps in a row were
skipped with every watched value finite, the finite values of each further skipped step of that streak enter the
history as well, until a step is taken. A few such values widen the band enough to take the new level (about
``window / (1 + sigma**2)`` of them), and the history then fills with it. Steps with a non-finite value neither
enter nor count toward ``adopt_after``; a taken step ends the streak. So a spike of fewer than ``adopt_after``
steps never enters the history, and one of ``adopt_after`` or more steps is skipped until it looks like a level.

How it runs: the whole state (both histories as fixed ring buffers, their counts and positions, the counters and the
last figures) is one float64 tensor on the device, and each step is one op, ``torch_gradstats::spike_guard_step``
(:mod:`torch_gradstats.ops.policy_ops`; a compiled kernel on the CPU and CUDA, its pure-PyTorch kernel elsewhere),
which updates it in place. Mean and std are recomputed over the buffer every step (running sums drift), shifted by one
of the buffer's own values so that a history of equal values has a mean equal to that value and a std of exactly 0.
:meth:`SpikeGuard.observe` launches that one op every step and never reads a value on the host, so it runs inside
``torch.compile(fullgraph=True)`` and CUDA graphs.

With ``count_skipped=True``, finite values and ``window >= 6`` its decisions are those of OLMo-core's
``SkipStepOptimizer`` (warm-up ``max(2, window // 2)`` values counting the current one, hence the default
``min_history``), without restacking a list every step, with compilation, and with a NaN kept out of the window.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops import policy_ops as ops
from torch_gradstats.ops._transfer import fetch, to_device, to_host
from torch_gradstats.policies._scalars import (
    MAX_HISTORY,
    as_figure,
    check_device,
    check_int,
    check_real,
    check_state_tensors,
    load_state,
    moved,
)

__all__ = ["SpikeGuard", "SpikeStreakError"]

# Series: row 0 of every per-series buffer is the gradient norm, row 1 the loss.
_SERIES = ("grad_norm", "loss")
# Columns of the counters: steps, skipped, skips in a row, tripped, trip step, the streak of skipped all-finite
# steps, and the series judged at the trip step.
_STEPS, _SKIPPED, _CONSECUTIVE, _TRIPPED, _TRIP_STEP, _STREAK, _TRIP_SERIES = range(7)
_N_COUNTERS = ops.GUARD_N_COUNTERS
_OLD_COUNTERS = 5  # state_dicts saved before the level adoption and the trip's series
# Columns of the last and trip figures (one row per series): the value, the history's mean and std, the z-score.
_VALUE, _MEAN, _STD, _Z = range(4)
# The figure dtypes the op reads as they are (others are converted first).
_FIGURE_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


class SpikeStreakError(RuntimeError):
    """``max_consecutive`` steps in a row were skipped. Raised where the host reads the guard (:meth:`SpikeGuard.check`,
    a Trainer log step), so it arrives at that read, possibly some steps after the streak reached the limit.

    Attributes:
        step: the (1-based) observed step of the last skip that was part of the streak, as of the read.
        consecutive: the streak's length at that step.
        values: the watched values at that step (``grad_norm``, and ``loss`` when watched).
        bands: per watched value, ``(mean, mean + sigma * std)`` of its history at that step: a value above the
            upper bound, or a non-finite one, was skipped.
    """

    def __init__(
        self, message: str, step: int, consecutive: int, values: dict[str, float], bands: dict[str, tuple[float, float]]
    ) -> None:
        super().__init__(message)
        self.step = step
        self.consecutive = consecutive
        self.values = values
        self.bands = bands


class SpikeGuard:
    """Decides, on the device, whether each optimizer step is taken (1.0) or skipped (0.0); see the module docstring.

    Args:
        window: number of finite values each history keeps (int >= 2: the band needs a std).
        sigma: a value more than ``sigma`` standard deviations above the history's mean is a spike (real >= 0).
        min_history: steps are taken until the history holds this many values; ``None`` means
            ``max(2, window // 2) - 1`` (int >= 0 and <= ``window``).
        watch_loss: judge the loss too when :meth:`observe` is given one.
        count_skipped: a skipped step's finite values enter the history too (OLMo-core's behaviour; the default
            keeps a spike out of the band that judges the next steps).
        adopt_after: after this many skipped all-finite steps in a row, the values of the streak's further skipped
            steps enter the history, so a lasting change of level is adopted (int >= 1; spikes shorter than
            this are kept out of the history).
        max_consecutive: this many skips in a row raise :class:`SpikeStreakError` at the next host read of the guard
            (:meth:`check`, a Trainer log step); None never raises.
        device: where the state lives at first; it moves to the device of the first gradient norm observed on an
            accelerator (one copy, no sync).
    """

    def __init__(
        self,
        window: int = 128,
        sigma: float = 6.0,
        *,
        min_history: int | None = None,
        watch_loss: bool = True,
        count_skipped: bool = False,
        adopt_after: int = 4,
        max_consecutive: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.window = check_int("SpikeGuard: window", window, low=2, high=MAX_HISTORY,
                                why=" (each history is a buffer of that many float64 values on the device)")
        self.sigma = check_real("SpikeGuard: sigma", sigma, low=0.0)
        default_min = max(2, self.window // 2) - 1
        self.min_history = (
            default_min if min_history is None else check_int("SpikeGuard: min_history", min_history, low=0)
        )
        if self.min_history > self.window:
            raise ValueError(
                f"SpikeGuard: min_history must be <= window ({self.window}), got {self.min_history}: the history "
                "never holds more than window values"
            )
        for name, flag in (("watch_loss", watch_loss), ("count_skipped", count_skipped)):
            if not isinstance(flag, bool):
                raise TypeError(f"SpikeGuard: {name} must be a bool, got {flag!r} ({type(flag).__name__})")
        self.watch_loss = watch_loss
        self.count_skipped = count_skipped
        self.adopt_after = check_int("SpikeGuard: adopt_after", adopt_after, low=1)
        self.max_consecutive = (
            None if max_consecutive is None else check_int("SpikeGuard: max_consecutive", max_consecutive, low=1)
        )
        self._allocate(torch.device("cpu") if device is None else check_device("SpikeGuard: device", device))

    def _allocate(self, device: torch.device) -> None:
        with torch.inference_mode(False):  # a normal tensor even when made in evaluation code
            self._state = torch.zeros(ops.guard_state_size(self.window), dtype=torch.float64, device=device)
            self._state[ops.GUARD_LAST:ops.GUARD_HIST].fill_(math.nan)  # the last and trip figures

    # Views of the packed state (see torch_gradstats.ops.policy_ops).
    def _counters(self) -> Tensor:
        return self._state[ops.GUARD_COUNTERS:ops.GUARD_COUNTERS + _N_COUNTERS]

    def _last(self) -> Tensor:
        return self._state[ops.GUARD_LAST:ops.GUARD_TRIP].view(len(_SERIES), 4)

    def _trip(self) -> Tensor:
        return self._state[ops.GUARD_TRIP:ops.GUARD_HIST].view(len(_SERIES), 4)

    @property
    def device(self) -> torch.device:
        """Where the guard's state lives."""
        return self._state.device

    def to(self, device: torch.device | str) -> SpikeGuard:
        """Move the state to ``device`` (not needed per step: :meth:`observe` moves it once); returns self."""
        self._state = moved(self._state, check_device("SpikeGuard.to: device", device))
        return self

    # ------------------------------------------------------------------------------------------- the step
    def observe(self, grad_norm: Tensor | float, loss: Tensor | float | None = None) -> Tensor:
        """Judge this step and record it: a float32 0-d tensor on ``grad_norm``'s device, 1.0 to take the step, 0.0 to
        skip it. No host sync, one launch every step (the op ``spike_guard_step``).

        Args:
            grad_norm: the step's total gradient norm (e.g. ``grad_stats(...).total_norm``), a one-element tensor
                (or a number).
            loss: the step's loss (judged when ``watch_loss``), a one-element tensor (or a number) on the same device
                or on the CPU; never traced by autograd.
        """
        state = self._state
        if loss is not None and not self.watch_loss:
            loss = None
        # The common case, a float tensor of one element on the state's device (metadata checks only), goes to the op
        # as it is; anything else is checked and converted first.
        if not (isinstance(grad_norm, Tensor) and grad_norm.numel() == 1 and grad_norm.dtype in _FIGURE_DTYPES
                and grad_norm.device == state.device and (loss is None or (
                    isinstance(loss, Tensor) and loss.numel() == 1 and loss.dtype in _FIGURE_DTYPES
                    and loss.device == state.device))):
            grad_norm, loss = self._figures(grad_norm, loss)
            state = self._state
        return ops.spike_guard_step(state, grad_norm, loss, self.sigma, self.min_history, self.adopt_after,
                                    self.max_consecutive or 0, self.count_skipped)

    def _figures(self, grad_norm: Tensor | float, loss: Tensor | float | None) -> tuple[Tensor, Tensor | None]:
        """The step's figures as float64 0-d tensors on one device, the state moved there (once) if it is elsewhere."""
        gn = as_figure("SpikeGuard.observe: grad_norm", grad_norm, self.device)
        device = gn.device
        if device != self.device:
            if device.type == "cpu":
                raise ValueError(
                    f"SpikeGuard.observe: grad_norm is on the CPU but the guard's state is on {self.device}; moving "
                    "it back every step would sync. Pass the norm on the guard's device."
                )
            self.to(device)
        if loss is None:
            return gn, None
        lv = as_figure("SpikeGuard.observe: loss", loss, device)
        if lv.device != device:
            if device.type == "cpu":
                raise ValueError(
                    f"SpikeGuard.observe: loss is on {lv.device} but grad_norm is on the CPU; pass both on one "
                    "device (reading the loss back would sync)"
                )
            lv = to_device(lv, device)
        return gn, lv

    # ------------------------------------------------------------------------------------------- device figures
    @property
    def skipped(self) -> Tensor:
        """Steps skipped so far: an int64 0-d tensor on the guard's device (a copy: it does not change later)."""
        return self._counters()[_SKIPPED].to(torch.int64)

    @property
    def consecutive(self) -> Tensor:
        """Skips in a row up to the last observed step (0 after a taken step): int64 0-d, on the device (a copy)."""
        return self._counters()[_CONSECUTIVE].to(torch.int64)

    @property
    def steps(self) -> Tensor:
        """Steps observed so far: int64 0-d, on the device (a copy)."""
        return self._counters()[_STEPS].to(torch.int64)

    @property
    def grad_norm_z(self) -> Tensor:
        """The last gradient norm's z-score against its history (NaN before two values; 0 for a value equal to the
        mean): float64 0-d, on the device (a copy)."""
        return self._last()[0, _Z].clone()

    @property
    def loss_z(self) -> Tensor:
        """As :attr:`grad_norm_z`, for the last loss judged (NaN before any)."""
        return self._last()[1, _Z].clone()

    # ------------------------------------------------------------------------------------------- host reads
    def check_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """The device tensors :meth:`check` reads, as ``(floats, ints)`` to add to a caller's own single transfer
        (``_transfer.pack``); give their host values to :meth:`check_values`."""
        return [self._last()[:, _Z], self._trip().reshape(-1)], [self._counters().to(torch.int64)]

    def check_values(self, floats: list[float], ints: list[int]) -> dict[str, float]:
        """The host values of :meth:`check_tensors` as figures ``guard/skipped``, ``guard/consecutive``,
        ``guard/grad_norm_z``, ``guard/loss_z``; raises :class:`SpikeStreakError` if a streak reached
        ``max_consecutive`` since the last raise (the flag is then cleared on the device, without a sync)."""
        z, trip = floats[:2], floats[2:]
        figures = {
            "guard/skipped": float(ints[_SKIPPED]),
            "guard/consecutive": float(ints[_CONSECUTIVE]),
            "guard/grad_norm_z": z[0],
            "guard/loss_z": z[1],
        }
        if ints[_TRIPPED]:
            self._counters()[_TRIPPED].zero_()
            values = {}
            bands = {}
            for s, name in enumerate(_SERIES[: max(1, ints[_TRIP_SERIES])]):  # every value judged, NaN included
                row = trip[4 * s : 4 * s + 4]
                values[name] = row[_VALUE]
                bands[name] = (row[_MEAN], row[_MEAN] + self.sigma * row[_STD])
            where = ", ".join(
                f"{n} {values[n]:.6g} (band mean {bands[n][0]:.6g}, max {bands[n][1]:.6g})" for n in values
            )
            raise SpikeStreakError(
                f"SpikeGuard: {self.max_consecutive} steps in a row were skipped (max_consecutive); at step "
                f"{ints[_TRIP_STEP]}: {where}. The training is likely diverging: lower the learning rate, roll back "
                "to a checkpoint, or raise sigma / max_consecutive.",
                step=ints[_TRIP_STEP],
                consecutive=ints[_CONSECUTIVE],
                values=values,
                bands=bands,
            )
        return figures

    def check(self) -> dict[str, float]:
        """Read the guard on the host (ONE device-to-host transfer, which waits for the device): the figures of
        :meth:`check_values`; raises :class:`SpikeStreakError` if a streak reached ``max_consecutive``."""
        floats, ints = self.check_tensors()
        host_floats, host_ints = to_host(floats, ints)
        return self.check_values(host_floats, host_ints)

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Settings (Python scalars) and state (tensors, copies on the guard's device): loads with
        ``torch.load(weights_only=True)``."""
        return {
            "window": self.window,
            "sigma": self.sigma,
            "min_history": self.min_history,
            "watch_loss": self.watch_loss,
            "count_skipped": self.count_skipped,
            "adopt_after": self.adopt_after,
            "max_consecutive": self.max_consecutive,
            "history": self._state[ops.GUARD_HIST:].view(len(_SERIES), self.window).clone(),
            "count": self._state[ops.GUARD_COUNT:ops.GUARD_POS].to(torch.int64),
            "position": self._state[ops.GUARD_POS:ops.GUARD_LAST].to(torch.int64),
            "counters": self._counters().to(torch.int64),
            "last": self._last().clone(),
            "trip": self._trip().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: its settings replace this guard's (so a resumed run decides as the one that
        saved it), its state is copied to this guard's device. Any guard can load it, one that never observed a
        step included."""
        if not isinstance(state, dict):
            raise TypeError(f"SpikeGuard.load_state_dict: expected a dict, got {type(state).__name__}")
        missing = [k for k in self.state_dict() if k not in state and k != "adopt_after"]
        if missing:
            raise ValueError(f"SpikeGuard.load_state_dict: the state has no {', '.join(missing)}")
        state = _upgraded(state)
        fresh = SpikeGuard(
            state["window"],
            state["sigma"],
            min_history=state["min_history"],
            watch_loss=state["watch_loss"],
            count_skipped=state["count_skipped"],
            adopt_after=state["adopt_after"],
            max_consecutive=state["max_consecutive"],
            device=self.device,
        )
        w, s = fresh.window, len(_SERIES)
        shapes = {
            "history": ((s, w), torch.float64),
            "count": ((s,), torch.int64),
            "position": ((s,), torch.int64),
            "counters": ((_N_COUNTERS,), torch.int64),
            "last": ((s, 4), torch.float64),
            "trip": ((s, 4), torch.float64),
        }
        check_state_tensors("SpikeGuard.load_state_dict", state, shapes)
        # Values no save produces would silently decide every later step (a count above the window skips them all).
        count, pos, counters = fetch(state["count"]), fetch(state["position"]), fetch(state["counters"])
        if bool(((count < 0) | (count > w)).any()):
            raise ValueError(f"SpikeGuard.load_state_dict: 'count' must be in [0, {w}], got {[int(v) for v in count]}")
        if bool(((pos < 0) | (pos >= w) | ((count < w) & (pos != count))).any()):
            raise ValueError(
                f"SpikeGuard.load_state_dict: 'position' must be in [0, {w}) and equal 'count' while the history is "
                f"not full, got {[int(v) for v in pos]} (count {[int(v) for v in count]})"
            )
        if bool((counters < 0).any()) or int(counters[_TRIP_SERIES]) > s:
            raise ValueError(
                f"SpikeGuard.load_state_dict: 'counters' must be >= 0 (the series judged at a trip <= {s}), got "
                f"{[int(v) for v in counters]}"
            )
        recorded = torch.arange(w)[None, :] < count[:, None]
        if not bool(fetch(state["history"])[recorded].isfinite().all()):
            raise ValueError("SpikeGuard.load_state_dict: 'history' holds a non-finite recorded value")
        packed = torch.cat([fetch(state[key]).to(torch.float64).reshape(-1)
                            for key in ("counters", "count", "position", "last", "trip", "history")])
        current = self._state
        self.__dict__.update(fresh.__dict__)
        self._state = load_state(current, packed)  # in place where the window agrees: a compiled step stays valid

    def __repr__(self) -> str:
        return (
            f"SpikeGuard(window={self.window}, sigma={self.sigma}, min_history={self.min_history}, "
            f"watch_loss={self.watch_loss}, count_skipped={self.count_skipped}, adopt_after={self.adopt_after}, "
            f"max_consecutive={self.max_consecutive}, device={self.device})"
        )


def _upgraded(state: dict[str, Any]) -> dict[str, Any]:
    """A state saved before the level adoption as a current one: the default ``adopt_after``, no streak under way,
    and the series judged at a recorded trip read from its values (a series not judged was recorded as NaN)."""
    state = {"adopt_after": 4, **state}
    counters, trip = state["counters"], state["trip"]
    old = isinstance(counters, Tensor) and tuple(counters.shape) == (_OLD_COUNTERS,) and counters.dtype == torch.int64
    if old and isinstance(trip, Tensor) and trip.dim() == 2 and trip.shape[0] == len(_SERIES):
        judged = 1 if bool(fetch(trip[1]).isnan().all()) else 2
        state["counters"] = torch.cat([counters, torch.tensor([0, judged], dtype=torch.int64, device=counters.device)])
    return state
