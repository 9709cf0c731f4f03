"""AdaptiveClip: ZClip's adaptive gradient clipping (z-score mode), computed on the device with no host sync.

The rule, per step, given the step's total gradient norm ``g`` (ZClip's ``zclip.py``, z-score mode):

* warm-up: the first ``warmup`` finite norms are collected and the threshold is ``max_norm`` (``inf`` without one);
  when the last of them arrives, ``mean`` becomes their average and ``var`` their population variance;
* afterwards ``std = sqrt(var)`` and ``z = (g - mean) / (std + 1e-6)``. When ``z > z_thresh`` a clip value is
  computed: ``(mean + z_thresh * std / (z / z_thresh)) * clip_factor`` (``"adaptive_scaling"``) or ``mean``
  (``"mean"``), and the threshold is the clip value capped by ``max_norm``; otherwise the threshold is ``max_norm``
  (or ``inf``);
* then, unless ``skip_update_on_spike`` and a clip value was computed, with ``v`` the clip value if one was computed,
  else ``g`` (never the ``max_norm``-capped value): ``mean <- alpha * mean + (1 - alpha) * v``, then
  ``var <- alpha * var + (1 - alpha) * (v - mean)**2`` with the new mean.

Two differences, on purpose:

* a non-finite norm never enters the statistics (nor the warm-up). ZClip folds it into its EMA, and a single NaN then
  disables its clipping for the rest of the run. Nor does an update whose variance would overflow float64 (a norm
  above ~1e154 adopted, float64 gradients only): it would disable the clipping the same way;
* **a lasting change of level is adopted** (``adopt_after``, 16 by default; ``None`` is ZClip's rule exactly). In
  ZClip a clipped step feeds the statistics its clip value, which for a large ``z`` sits just above the mean: after a
  lasting rise of the norm (a new loss scale, data mix or phase of training) the threshold never follows, and every
  later step is clipped to the old level for the rest of the run. Here, from the ``adopt_after``-th clipped step in a
  row on, each further clipped step of the streak updates the statistics with ``g`` itself (and, with
  ``skip_update_on_spike``, updates them at all); the step is still clipped to this step's threshold. Mean and var
  then move to the new level at the EMA's rate, widening the band as they go, and the clipping stops a few steps
  later, whatever the size of the jump: with the defaults, 20 to 22 steps after a x10 rise (the last 5 to 7 of
  them adopted). The streak counts the clipped finite norms after the warm-up; an unclipped finite norm ends it, and
  a non-finite norm neither extends nor ends it (it says nothing about the level, and never enters the statistics).
  So a spike of fewer than ``adopt_after`` steps is clipped exactly as ZClip clips it.

  Why 16: it is about half the EMA's time constant ``1 / (1 - alpha)`` (33 steps at the default ``alpha``).
  Gradient-norm spikes last one to a few steps, far below it, and are clipped as ZClip clips them; a norm that has
  stayed above the band for half the EMA's memory is a level in the EMA's own terms, and a lasting change then holds
  the run at its old scale for about 20 steps, under one time constant, instead of for good. The price: a burst of
  16 or more clipped steps is adopted too, and the band it widened stays wide for about a time constant. With
  another ``alpha``, about half of ``1 / (1 - alpha)`` keeps that balance (the adoption itself takes longer with a
  slower EMA: about 12 adopted steps at ``alpha=0.99``).

ZClip reads the norm with ``.item()`` (a host sync) every step. Here the whole state (count, mean, var, the last
figures, the clipped steps in a row, the warm-up norms) is one float64 tensor on the device and each step is one op,
``torch_gradstats::adaptive_clip_step`` (:mod:`torch_gradstats.ops.policy_ops`), which updates it in place: so
:meth:`AdaptiveClip.threshold` launches one kernel every step, never syncs, and runs inside
``torch.compile(fullgraph=True)`` and CUDA graphs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torch_gradstats.ops import policy_ops as ops
from torch_gradstats.ops._transfer import fetch, to_host
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
from torch_gradstats.policies.clip import check_writable, clip_grad_norm_, clip_with_threshold_
from torch_gradstats.stats._params import ParamsLike, named_params
from torch_gradstats.stats.gradients import GradStats, grad_stats

__all__ = ["AdaptiveClip"]

_EPS = 1e-6  # ZClip's eps in the z-score, and the eps of the clipping coefficient
_FIGURE_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))  # read as they are
_CLIP_OPTIONS = ("adaptive_scaling", "mean")
# Clipped steps in a row after which the statistics take the norm itself: about half the EMA's time constant
# 1 / (1 - alpha) at the default alpha (the module docstring says why).
_ADOPT_AFTER = 16
# The largest adopt_after: the streak is counted in the float64 state, exactly up to 2**53.
_MAX_ADOPT_AFTER = 1 << 53
# Columns of _last: the threshold, the coefficient clipping to it applies, the z-score.
_THRESHOLD, _COEF, _Z = range(3)


class AdaptiveClip:
    """The clipping threshold of each step from the history of gradient norms (see the module docstring).

    Args:
        alpha: EMA smoothing factor of the norms' mean and variance (in [0, 1)).
        z_thresh: z-score above which a norm is a spike (> 0).
        warmup: finite norms collected before the first z-score (int >= 1).
        clip_option: ``"adaptive_scaling"`` (clip harder the larger the spike) or ``"mean"`` (clip to the mean).
        clip_factor: multiplier of the adaptive clip value (> 0).
        max_norm: fixed cap of every threshold (> 0), or None.
        skip_update_on_spike: keep a spike's (clipped) norm out of the statistics (until ``adopt_after`` applies).
        adopt_after: from this many clipped steps in a row on, each further clipped step of the streak updates the
            statistics with its norm instead of its clip value, so a lasting change of level is adopted and the
            clipping stops (int >= 1; a spike shorter than this is clipped exactly as ZClip). ``None``: ZClip's rule
            exactly, under which a lasting rise of the norm is clipped to the old level for the rest of the run.
        device: where the state lives at first; it moves to the device of the first norm seen on an accelerator.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup: int = 25,
        *,
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        max_norm: float | None = None,
        skip_update_on_spike: bool = False,
        adopt_after: int | None = _ADOPT_AFTER,
        device: torch.device | str | None = None,
    ) -> None:
        self.alpha = check_real("AdaptiveClip: alpha", alpha, low=0.0)
        if self.alpha >= 1.0:
            raise ValueError(f"AdaptiveClip: alpha must be in [0, 1), got {alpha!r}")
        self.z_thresh = check_real("AdaptiveClip: z_thresh", z_thresh, low=0.0, low_open=True)
        self.warmup = check_int("AdaptiveClip: warmup", warmup, low=1, high=MAX_HISTORY,
                                why=" (the warm-up norms are a buffer of that many float64 values on the device)")
        if clip_option not in _CLIP_OPTIONS:
            raise ValueError(f"AdaptiveClip: clip_option must be one of {_CLIP_OPTIONS}, got {clip_option!r}")
        self.clip_option = clip_option
        self.clip_factor = check_real("AdaptiveClip: clip_factor", clip_factor, low=0.0, low_open=True)
        self.max_norm = (
            None if max_norm is None else check_real("AdaptiveClip: max_norm", max_norm, low=0.0, low_open=True)
        )
        if not isinstance(skip_update_on_spike, bool):
            raise TypeError(f"AdaptiveClip: skip_update_on_spike must be a bool, got {skip_update_on_spike!r}")
        self.skip_update_on_spike = skip_update_on_spike
        self.adopt_after = (
            None if adopt_after is None
            else check_int("AdaptiveClip: adopt_after", adopt_after, low=1, high=_MAX_ADOPT_AFTER,
                           why=" (the streak is counted exactly in float64), or None for ZClip's rule")
        )
        dev = torch.device("cpu") if device is None else check_device("AdaptiveClip: device", device)
        with torch.inference_mode(False):  # a normal tensor even when made in evaluation code
            self._state = torch.zeros(ops.clip_state_size(self.warmup), dtype=torch.float64, device=dev)
            self._state[ops.CLIP_LAST:ops.CLIP_STREAK].fill_(math.nan)

    def _last(self) -> Tensor:  # the last threshold, coefficient and z-score: a view of the packed state
        return self._state[ops.CLIP_LAST:ops.CLIP_STREAK]

    @property
    def device(self) -> torch.device:
        """Where the state lives."""
        return self._state.device

    def to(self, device: torch.device | str) -> AdaptiveClip:
        """Move the state to ``device`` (not needed per step: :meth:`threshold` moves it once); returns self."""
        self._state = moved(self._state, check_device("AdaptiveClip.to: device", device))
        return self

    # ------------------------------------------------------------------------------------------- the step
    def threshold(self, grad_norm: Tensor | float) -> Tensor:
        """The norm to clip this step's gradients to, as a float64 0-d tensor on ``grad_norm``'s device (``max_norm``,
        or ``inf`` without one, when no z-score clip applies), and the state updated in place. No host sync, one
        launch every step (the op ``adaptive_clip_step``).

        Args:
            grad_norm: the step's total gradient norm, a one-element tensor (or a number).
        """
        state = self._state
        # A float tensor of one element on the state's device (metadata checks only) goes to the op as it is.
        if not (isinstance(grad_norm, Tensor) and grad_norm.numel() == 1 and grad_norm.dtype in _FIGURE_DTYPES
                and grad_norm.device == state.device):
            grad_norm = as_figure("AdaptiveClip.threshold: grad_norm", grad_norm, self.device)
            if grad_norm.device != self.device:
                if grad_norm.device.type == "cpu":
                    raise ValueError(
                        f"AdaptiveClip.threshold: grad_norm is on the CPU but the state is on {self.device}; moving "
                        "it back every step would sync. Pass the norm on the state's device."
                    )
                self.to(grad_norm.device)
            state = self._state
        return ops.adaptive_clip_step(state, grad_norm, self.alpha, self.z_thresh, self.clip_factor,
                                      math.inf if self.max_norm is None else self.max_norm,
                                      self.clip_option == "mean", self.skip_update_on_spike,
                                      0 if self.adopt_after is None else self.adopt_after)

    @torch.no_grad()
    def clip_(self, params: ParamsLike, group: Any = None, *, stats: GradStats | None = None) -> GradStats:
        """Clip gradients in place to this step's :meth:`threshold`: one read of the gradients gives the statistics
        and the norm, then the fused :func:`~torch_gradstats.clip_grad_norm_` scales them (no host sync).

        Args:
            params: what :func:`~torch_gradstats.grad_stats` accepts.
            group: process group over which plain-tensor gradients are shards of one set (see ``clip_grad_norm_``).
            stats: the :func:`~torch_gradstats.grad_stats` of these gradients, already read (e.g. with
                ``histogram=True``): used instead of reading them again, as ``clip_grad_norm_(stats=)``.

        Returns:
            The statistics before clipping, with ``clip_norm`` and ``clip_coef`` set (as ``clip_grad_norm_``).
        """
        named, seen = [], set()
        for name, p in named_params(params, "AdaptiveClip.clip_"):  # a tensor given twice (tied) is clipped once
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        check_writable(named, "AdaptiveClip.clip_")  # before the threshold's step changes the state
        if stats is None:
            stats = grad_stats(named, group=group)
        if not len(stats):
            return clip_grad_norm_(named, math.inf, group=group, stats=stats)
        # group=: the statistics hold every rank's rows, which the clip checks against this rank's parameters
        return clip_with_threshold_(named, self.threshold(stats.total_norm), group=group, stats=stats)

    # ------------------------------------------------------------------------------------------- figures
    @property
    def last_threshold(self) -> Tensor:
        """The last threshold (NaN before any): float64 0-d, on the device (a copy)."""
        return self._last()[_THRESHOLD].clone()

    @property
    def last_coef(self) -> Tensor:
        """The coefficient clipping the last norm to the last threshold applies, ``min(threshold / (norm + 1e-6),
        1)``: float64 0-d, on the device (a copy)."""
        return self._last()[_COEF].clone()

    @property
    def consecutive(self) -> Tensor:
        """Clipped steps in a row (the streak that ``adopt_after`` counts; 0 after an unclipped step): int64 0-d, on
        the device (a copy)."""
        return self._state[ops.CLIP_STREAK].to(torch.int64)

    def check_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """The device tensors of :meth:`figures`, as ``(floats, ints)`` for a caller's own single transfer."""
        return [self._last()], []

    def check_values(self, floats: list[float], ints: list[int]) -> dict[str, float]:
        """``clip/threshold`` and ``clip/coef`` from the host values of :meth:`check_tensors`."""
        return {"clip/threshold": floats[_THRESHOLD], "clip/coef": floats[_COEF]}

    def figures(self) -> dict[str, float]:
        """``clip/threshold`` and ``clip/coef`` of the last step on the host (ONE transfer, which waits)."""
        floats, ints = self.check_tensors()
        return self.check_values(*to_host(floats, ints))

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Settings (Python scalars) and state (tensor copies): loads with ``torch.load(weights_only=True)``."""
        return {
            "alpha": self.alpha,
            "z_thresh": self.z_thresh,
            "warmup": self.warmup,
            "clip_option": self.clip_option,
            "clip_factor": self.clip_factor,
            "max_norm": self.max_norm,
            "skip_update_on_spike": self.skip_update_on_spike,
            "adopt_after": self.adopt_after,
            "warmup_norms": self._state[ops.CLIP_WARM:].clone(),
            "count": self._state[ops.CLIP_COUNT:ops.CLIP_EMA].to(torch.int64),
            "ema": self._state[ops.CLIP_EMA:ops.CLIP_LAST].clone(),
            "last": self._last().clone(),
            "streak": self._state[ops.CLIP_STREAK:ops.CLIP_WARM].to(torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (its settings replace this clipper's; state copied to this device). A state
        saved before ``adopt_after`` existed loads with the default and no streak under way."""
        if not isinstance(state, dict):
            raise TypeError(f"AdaptiveClip.load_state_dict: expected a dict, got {type(state).__name__}")
        missing = [k for k in self.state_dict() if k not in state and k not in _ADDED]
        if missing:
            raise ValueError(f"AdaptiveClip.load_state_dict: the state has no {', '.join(missing)}")
        state = {**_ADDED, **state}
        fresh = AdaptiveClip(
            state["alpha"],
            state["z_thresh"],
            state["warmup"],
            clip_option=state["clip_option"],
            clip_factor=state["clip_factor"],
            max_norm=state["max_norm"],
            skip_update_on_spike=state["skip_update_on_spike"],
            adopt_after=state["adopt_after"],
            device=self.device,
        )
        shapes = {
            "warmup_norms": ((fresh.warmup,), torch.float64),
            "count": ((1,), torch.int64),
            "ema": ((2,), torch.float64),
            "last": ((3,), torch.float64),
            "streak": ((1,), torch.int64),
        }
        check_state_tensors("AdaptiveClip.load_state_dict", state, shapes)
        # Values no save produces would silently stop the clipping (a negative count never ends the warm-up).
        # A NaN mean, or an inf warm-up norm, would give a NaN or inf threshold for the rest of the run.
        count, ema, streak = int(fetch(state["count"])[0]), fetch(state["ema"]), int(fetch(state["streak"])[0])
        if not 0 <= count <= fresh.warmup:
            raise ValueError(
                f"AdaptiveClip.load_state_dict: 'count' (the warm-up norms collected) must be in "
                f"[0, {fresh.warmup}], got {count}"
            )
        if not 0 <= streak <= _MAX_ADOPT_AFTER:
            raise ValueError(f"AdaptiveClip.load_state_dict: 'streak' (the clipped steps in a row) must be in "
                             f"[0, {_MAX_ADOPT_AFTER}], got {streak}")
        mean, var = float(ema[0]), float(ema[1])
        if not math.isfinite(mean):
            raise ValueError(f"AdaptiveClip.load_state_dict: the EMA mean of the norms ('ema'[0]) must be finite, "
                             f"got {mean}")
        if not math.isfinite(var) or var < 0:
            raise ValueError(f"AdaptiveClip.load_state_dict: the EMA variance of the norms ('ema'[1]) must be "
                             f"finite and >= 0, got {var}")
        warm = fetch(state["warmup_norms"])[:count]
        if not bool(warm.isfinite().all()) or bool((warm < 0).any()):
            raise ValueError(
                f"AdaptiveClip.load_state_dict: the {count} warm-up norms collected ('warmup_norms') must be finite "
                f"and >= 0, got {[float(v) for v in warm]}"
            )
        packed = torch.cat([fetch(state[key]).to(torch.float64).reshape(-1)
                            for key in ("count", "ema", "last", "streak", "warmup_norms")])
        current = self._state
        self.__dict__.update(fresh.__dict__)
        self._state = load_state(current, packed)  # in place where the warm-up agrees: a compiled step stays valid

    def __repr__(self) -> str:
        return (
            f"AdaptiveClip(alpha={self.alpha}, z_thresh={self.z_thresh}, warmup={self.warmup}, "
            f"clip_option={self.clip_option!r}, clip_factor={self.clip_factor}, max_norm={self.max_norm}, "
            f"skip_update_on_spike={self.skip_update_on_spike}, adopt_after={self.adopt_after}, device={self.device})"
        )


# Keys added to the state_dict after its first release, with the values a state saved before them loads with: the
# default adoption, and no streak under way.
_ADDED: dict[str, Any] = {"adopt_after": _ADOPT_AFTER, "streak": torch.zeros(1, dtype=torch.int64)}
