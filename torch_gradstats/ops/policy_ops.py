"""The policies' per-step updates as ops: one launch per step for each of SpikeGuard, AdaptiveClip and NoiseScale.

Each op reads a step's figure(s) and updates its policy's whole state, kept in ONE float64 tensor, in place:

======================  ==================================================================  ==========================
op                      state (float64, packed; offsets below)                              returns
======================  ==================================================================  ==========================
``spike_guard_step``    counters [7], count [2], position [2], last [2, 4], trip [2, 4],    float32 0-d: 1 take,
                        history [2, window]                                                 0 skip
``adaptive_clip_step``  count, mean, var, last [3] (threshold, coef, z), clipped in a row,   float64 0-d: threshold
                        warm-up [warmup]
``noise_scale_step``    EMA of |G|^2, EMA of tr(Sigma), weight (the EMAs' bias correction)  nothing
======================  ==================================================================  ==========================

Counts and counters are whole numbers held exactly in float64. A figure is a one-element float16/bfloat16/float32/
float64 tensor on the state's device, any shape; it is read on the device, never on the host.

This module defines the schemas (so the ops exist and trace without the compiled library), their fake kernels, and
their pure-PyTorch kernels, registered as CompositeExplicitAutograd like the statistics op's fallback: the
dispatcher runs them wherever no compiled kernel is registered (csrc/cpu/policies_cpu.cpp for the CPU,
csrc/cuda/policies.cu for CUDA; csrc/policies.h holds the step logic both share). Each is the rule of its policy's
module docstring, written with whole-tensor ops; the compiled kernels compute the same values (the sums over a
history in another order: equal to about 1e-15).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "CLIP_EMA",
    "CLIP_LAST",
    "CLIP_STREAK",
    "CLIP_WARM",
    "GUARD_COUNT",
    "GUARD_COUNTERS",
    "GUARD_HIST",
    "GUARD_LAST",
    "GUARD_POS",
    "GUARD_TRIP",
    "adaptive_clip_step",
    "clip_state_size",
    "guard_state_size",
    "noise_scale_step",
    "spike_guard_step",
]

# Offsets into the packed states (csrc/policies.h repeats them; a test checks the kernels against these kernels).
GUARD_COUNTERS, GUARD_COUNT, GUARD_POS, GUARD_LAST, GUARD_TRIP, GUARD_HIST = 0, 7, 9, 11, 19, 27
GUARD_N_COUNTERS, GUARD_SERIES = 7, 2
# Columns of the guard's counters: steps, skipped, skips in a row, tripped, trip step, streak of all-finite skips,
# the series judged at the trip.
STEPS, SKIPPED, CONSECUTIVE, TRIPPED, TRIP_STEP, STREAK, TRIP_SERIES = range(7)
CLIP_COUNT, CLIP_EMA, CLIP_LAST, CLIP_STREAK, CLIP_WARM = 0, 1, 3, 6, 7
NOISE_STATE = 3

_EPS = 1e-6  # ZClip's eps in the z-score, and the eps of the clipping coefficient


def guard_state_size(window: int) -> int:
    return GUARD_HIST + GUARD_SERIES * window


def clip_state_size(warmup: int) -> int:
    return CLIP_WARM + warmup


def _value(figure: Tensor) -> Tensor:
    """A figure as a float64 tensor of one element (detached: the state never joins an autograd graph)."""
    return figure.detach().reshape(1).to(torch.float64)


# ----------------------------------------------------------------------------------------------- SpikeGuard
def _spike_guard_step(state: Tensor, grad_norm: Tensor, loss: Tensor | None, sigma: float, min_history: int,
                      adopt_after: int, max_consecutive: int, count_skipped: bool) -> Tensor:  # fmt: skip
    """The pure-PyTorch kernel of ``spike_guard_step`` (the rule of :mod:`torch_gradstats.policies.guard`)."""
    _fake_guard(state, grad_norm, loss, sigma, min_history, adopt_after, max_consecutive, count_skipped)
    window = (state.numel() - GUARD_HIST) // GUARD_SERIES
    values = _value(grad_norm) if loss is None else torch.cat([_value(grad_norm), _value(loss)])
    k = values.shape[0]  # series judged this step: the first k rows of every per-series block
    c = state[GUARD_COUNTERS:GUARD_COUNTERS + GUARD_N_COUNTERS]
    count = state[GUARD_COUNT:GUARD_COUNT + k]
    pos = state[GUARD_POS:GUARD_POS + k]
    hist = state[GUARD_HIST:].view(GUARD_SERIES, window)[:k]
    last_all = state[GUARD_LAST:GUARD_TRIP].view(GUARD_SERIES, 4)
    trip_all = state[GUARD_TRIP:GUARD_HIST].view(GUARD_SERIES, 4)
    slots = torch.arange(window, dtype=torch.float64, device=state.device)

    valid = slots < count[:, None]
    # Mean and std of each history, shifted by its slot 0 (a recorded value whenever the history is not empty):
    # equal values give differences of exactly 0, so the mean is that value and the std exactly 0.
    pivot = hist[:, 0]
    diff = torch.where(valid, hist - pivot[:, None], 0.0)
    mean_diff = diff.sum(dim=1) / count
    dev = torch.where(valid, diff - mean_diff[:, None], 0.0)
    std = (dev.square().sum(dim=1) / (count - 1)).sqrt()  # NaN for fewer than 2 values, as torch.std_mean
    mean = pivot + mean_diff

    finite = torch.isfinite(values)
    spike = (values - mean) > sigma * std
    judged = count >= min_history
    skip = (judged & (spike | ~finite)).any()
    take = ~skip

    # A streak of skipped all-finite steps long enough is a new level: its further values enter the history.
    all_finite = finite.all()
    streak = torch.where(take, 0.0, torch.where(all_finite, c[STREAK] + 1, c[STREAK]))
    adopt = skip & all_finite & (streak >= adopt_after)
    enter = finite if count_skipped else finite & (take | adopt)
    write = (slots == pos[:, None]) & enter[:, None]
    hist.copy_(torch.where(write, values[:, None], hist))
    pos.copy_(torch.where(enter, torch.remainder(pos + 1, window), pos))
    count.copy_(torch.where(enter, (count + 1).clamp(max=window), count))

    # The z-score of each value against its history (0 for a value equal to the mean, std 0 included).
    z = torch.where(values == mean, 0.0, (values - mean) / std)
    last = torch.stack([values, mean, std, z], dim=1)
    last_all[:k].copy_(last)

    skip_f = skip.to(torch.float64)
    steps = c[STEPS] + 1
    consecutive = (c[CONSECUTIVE] + 1) * skip_f
    tripped, trip_step, trip_series = c[TRIPPED], c[TRIP_STEP], c[TRIP_SERIES]
    if max_consecutive > 0:
        trip = skip & (consecutive >= max_consecutive)
        tripped = torch.where(trip, 1.0, tripped)
        trip_step = torch.where(trip, steps, trip_step)
        trip_series = torch.where(trip, float(k), trip_series)
        trip_all[:k].copy_(torch.where(trip, last, trip_all[:k]))
        trip_all[k:].copy_(torch.where(trip, math.nan, trip_all[k:]))
    c.copy_(torch.stack([steps, c[SKIPPED] + skip_f, consecutive, tripped, trip_step, streak, trip_series]))
    return take.to(torch.float32)


# ----------------------------------------------------------------------------------------------- AdaptiveClip
def _adaptive_clip_step(state: Tensor, grad_norm: Tensor, alpha: float, z_thresh: float, clip_factor: float,
                        max_norm: float, clip_to_mean: bool, skip_update_on_spike: bool,
                        adopt_after: int) -> Tensor:  # fmt: skip
    """The pure-PyTorch kernel of ``adaptive_clip_step`` (the rule of :mod:`torch_gradstats.policies.adaptive_clip`);
    ``max_norm`` is ``inf`` for none, ``adopt_after`` 0 for never (ZClip's rule)."""
    _fake_clip(state, grad_norm, alpha, z_thresh, clip_factor, max_norm, clip_to_mean, skip_update_on_spike,
               adopt_after)
    warmup = state.numel() - CLIP_WARM
    g = _value(grad_norm)[0]
    count = state[CLIP_COUNT:CLIP_COUNT + 1]
    ema = state[CLIP_EMA:CLIP_EMA + 2]
    warm = state[CLIP_WARM:]
    slots = torch.arange(warmup, dtype=torch.float64, device=state.device)
    finite = torch.isfinite(g)
    n = count[0]
    ready = n >= warmup  # the statistics were initialised before this step

    # Warm-up: collect finite norms; the step that brings the last one initialises mean and var.
    collect = finite & ~ready
    warm.copy_(torch.where((slots == n) & collect, g, warm))
    n_new = torch.where(collect, n + 1, n)
    init_now = collect & (n_new == warmup)
    warm_mean = warm.mean()
    warm_var = (warm - warm_mean).square().mean()

    mean, var = ema[0], ema[1]
    std = var.sqrt()
    z = (g - mean) / (std + _EPS)
    spike = ready & (z > z_thresh)
    clip_value = mean if clip_to_mean else (mean + z_thresh * std / (z / z_thresh)) * clip_factor
    threshold = torch.where(spike, clip_value.clamp(max=max_norm), max_norm)

    # Clipped steps in a row (finite norms after the warm-up): a non-finite norm neither extends nor ends the streak.
    # From the adopt_after-th on, the statistics take the norm itself, so a lasting change of level is adopted.
    streak = state[CLIP_STREAK]
    judged = ready & finite
    streak_out = torch.where(judged, torch.where(spike, streak + 1, 0.0), streak)
    adopt = spike & judged & (streak_out >= (adopt_after if adopt_after > 0 else math.inf))

    v = torch.where(spike & ~adopt, clip_value, g)
    new_mean = alpha * mean + (1 - alpha) * v
    new_var = alpha * var + (1 - alpha) * (v - new_mean).square()
    # A variance that would overflow float64 (a norm above ~1e154 adopted) leaves the statistics as they were.
    update = ready & finite & torch.isfinite(new_var)
    if skip_update_on_spike:
        update = update & (~spike | adopt)
    mean_out = torch.where(init_now, warm_mean, torch.where(update, new_mean, mean))
    var_out = torch.where(init_now, warm_var, torch.where(update, new_var, var))
    coef = (threshold / (g + _EPS)).clamp(max=1.0)
    head = torch.stack([n_new, mean_out, var_out, threshold, coef, torch.where(ready, z, math.nan), streak_out])
    state[:CLIP_WARM].copy_(head)
    return threshold


# ----------------------------------------------------------------------------------------------- NoiseScale
def _noise_scale_step(state: Tensor, small_sq: Tensor, big_sq: Tensor, b_small: float, b_big: float,
                      ema: float) -> None:  # fmt: skip
    """The pure-PyTorch kernel of ``noise_scale_step`` (:mod:`torch_gradstats.monitors.noise_scale`): one step's
    unbiased estimates folded into the EMAs; a step whose estimates are not finite is left out."""
    _fake_noise(state, small_sq, big_sq, b_small, b_big, ema)
    small, big = _value(small_sq)[0], _value(big_sq)[0]
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    ok = torch.isfinite(grad_sq) & torch.isfinite(trace)
    estimates = torch.where(ok, torch.stack([grad_sq, trace, torch.ones_like(grad_sq)]), 0.0)
    decay = torch.where(ok, grad_sq.new_full((), ema), 1.0)  # ema for a step folded in, 1 for one left out (float64)
    state.copy_(state * decay + estimates * (1.0 - ema))


# ----------------------------------------------------------------------------------------------- registration
_lib = torch.library.Library("torch_gradstats", "FRAGMENT")
_lib.define(
    "spike_guard_step(Tensor(a!) state, Tensor grad_norm, Tensor? loss, float sigma, int min_history, "
    "int adopt_after, int max_consecutive, bool count_skipped) -> Tensor"
)
_lib.define(
    "adaptive_clip_step(Tensor(a!) state, Tensor grad_norm, float alpha, float z_thresh, float clip_factor, "
    "float max_norm, bool clip_to_mean, bool skip_update_on_spike, int adopt_after) -> Tensor"
)
_lib.define(
    "noise_scale_step(Tensor(a!) state, Tensor small_sq, Tensor big_sq, float b_small, float b_big, float ema) -> ()"
)
_KERNELS = {
    "spike_guard_step": _spike_guard_step,
    "adaptive_clip_step": _adaptive_clip_step,
    "noise_scale_step": _noise_scale_step,
}
for _name, _kernel in _KERNELS.items():
    _lib.impl(_name, _kernel, "CompositeExplicitAutograd")
    # Decisions are not differentiable: autograd falls through (a loss that requires grad is read, never traced).
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")


def _check(op: str, state: Tensor, size_ok: bool, figures: dict[str, Tensor | None]) -> None:
    """The contract every kernel enforces, for the fake kernel (so torch.compile reports it at trace time)."""
    if state.dtype != torch.float64 or state.dim() != 1 or not size_ok:
        raise ValueError(f"{op}: state must be the policy's packed float64 1-d state, got {state.dtype} "
                         f"{tuple(state.shape)}")
    for name, t in figures.items():
        if t is None:
            continue
        if t.numel() != 1 or not t.dtype.is_floating_point or t.dtype not in _FIGURE_DTYPES:
            raise ValueError(f"{op}: {name} must be a one-element float16/bfloat16/float32/float64 tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if t.device != state.device:
            raise ValueError(f"{op}: {name} is on {t.device} but the state is on {state.device}")


_FIGURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.library.register_fake("torch_gradstats::spike_guard_step", lib=_lib)
def _fake_guard(state: Tensor, grad_norm: Tensor, loss: Tensor | None, sigma: float, min_history: int,
                adopt_after: int, max_consecutive: int, count_skipped: bool) -> Tensor:  # fmt: skip
    size_ok = state.numel() >= GUARD_HIST + 2 * GUARD_SERIES and (state.numel() - GUARD_HIST) % GUARD_SERIES == 0
    _check("spike_guard_step", state, size_ok, {"grad_norm": grad_norm, "loss": loss})
    return state.new_empty((), dtype=torch.float32)


@torch.library.register_fake("torch_gradstats::adaptive_clip_step", lib=_lib)
def _fake_clip(state: Tensor, grad_norm: Tensor, alpha: float, z_thresh: float, clip_factor: float, max_norm: float,
               clip_to_mean: bool, skip_update_on_spike: bool, adopt_after: int) -> Tensor:  # fmt: skip
    _check("adaptive_clip_step", state, state.numel() > CLIP_WARM, {"grad_norm": grad_norm})
    if adopt_after < 0:
        raise ValueError(f"adaptive_clip_step: adopt_after must be >= 0 (0: never adopt), got {adopt_after}")
    return state.new_empty(())


@torch.library.register_fake("torch_gradstats::noise_scale_step", lib=_lib)
def _fake_noise(state: Tensor, small_sq: Tensor, big_sq: Tensor, b_small: float, b_big: float, ema: float) -> None:
    _check("noise_scale_step", state, state.numel() == NOISE_STATE, {"small_sq": small_sq, "big_sq": big_sq})


#: The ops, for the policies' per-step calls.
spike_guard_step = torch.ops.torch_gradstats.spike_guard_step.default
adaptive_clip_step = torch.ops.torch_gradstats.adaptive_clip_step.default
noise_scale_step = torch.ops.torch_gradstats.noise_scale_step.default
