"""The policies' ops (torch_gradstats/ops/policy_ops.py): the compiled CPU kernels against the pure-PyTorch kernels
on random sequences (spikes, NaN, Inf, level changes), opcheck of each op, one launch per policy step, and the
errors of bad states and figures."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from torch_gradstats import AdaptiveClip, NoiseScale, SpikeGuard
from torch_gradstats.ops import policy_ops as ops

COMPILED = torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::spike_guard_step", "CPU")
needs_kernel = pytest.mark.skipif(not COMPILED, reason="no compiled CPU kernel (extension absent or forced off)")


def figures(n: int, seed: int) -> list[float]:
    """A lognormal series with 1-4-step spikes, NaN and Inf steps, and lasting level changes up and down."""
    gen = torch.Generator().manual_seed(seed)
    level, out = 1.0, []
    noise = torch.randn(n, generator=gen, dtype=torch.float64).mul(0.1).exp().tolist()
    u = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    spike_left = 0
    for i in range(n):
        if u[i] < 0.02:
            level *= (2.0, 10.0, 0.3)[i % 3]
        v = level * noise[i]
        if spike_left or u[i] > 0.97:
            spike_left = spike_left - 1 if spike_left else i % 4
            v *= 50.0
        if 0.5 < u[i] < 0.51:
            v = (math.nan, math.inf, -math.inf)[i % 3]
        out.append(v)
    return out


def flat(n: int) -> list[float]:
    """Equal values (std exactly 0), then a 1% lasting rise."""
    return [3.0] * (n // 2) + [3.03] * (n - n // 2)


def _assert_same_state(a: torch.Tensor, b: torch.Tensor, step: int) -> None:
    # The sums over a history are taken in another order: the mean and std agree to about 1e-15 (relative), and a
    # z-score near 0 (a value near the mean) to about 1e-16 absolute.
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True, msg=lambda m: f"step {step}: {m}")


# (window, then the op's settings: sigma, min_history, adopt_after, max_consecutive, count_skipped)
GUARD_SETTINGS = [
    (2, (0.0, 0, 1, 0, False)),
    (8, (3.0, 3, 4, 3, False)),
    (16, (1.0, 7, 2, 0, True)),
    (128, (6.0, 63, 4, 5, False)),
    (300, (2.0, 1, 3, 2, True)),
]


@needs_kernel
@pytest.mark.parametrize(("window", "args"), GUARD_SETTINGS, ids=[f"w{w}" for w, _ in GUARD_SETTINGS])
@pytest.mark.parametrize("series", ["random", "flat"])
def test_guard_kernel_equals_the_fallback(window, args, series):
    n = 4 * window + 200
    norms = figures(n, seed=window) if series == "random" else flat(n)
    losses = figures(n, seed=window + 1) if series == "random" else [2.0] * n
    compiled = torch.zeros(ops.guard_state_size(window), dtype=torch.float64)
    compiled[ops.GUARD_LAST:ops.GUARD_HIST] = math.nan
    fallback = compiled.clone()
    for i, (g, ell) in enumerate(zip(norms, losses, strict=True)):
        grad_norm = torch.tensor(g, dtype=torch.float64)
        loss = None if i % 7 == 3 else torch.tensor(ell, dtype=(torch.float32, torch.float64)[i % 2])
        take = ops.spike_guard_step(compiled, grad_norm, loss, *args)
        want = ops._spike_guard_step(fallback, grad_norm, loss, *args)
        assert take.dtype == torch.float32 and take.shape == () and float(take) == float(want), f"step {i}"
        _assert_same_state(compiled, fallback, i)
    if series == "random":
        assert 0 < compiled[ops.GUARD_COUNTERS + 1] < n  # some steps skipped, some taken


# (warmup, then the op's settings: alpha, z_thresh, clip_factor, max_norm, clip_to_mean, skip_update_on_spike,
# adopt_after (0: never))
CLIP_SETTINGS = [
    (25, (0.97, 2.5, 1.0, math.inf, False, False, 16)),
    (25, (0.97, 2.5, 1.0, math.inf, False, False, 0)),
    (1, (0.0, 0.5, 0.7, 3.0, False, True, 1)),
    (3, (0.9, 1.0, 1.0, math.inf, True, False, 4)),
    (700, (0.5, 2.0, 2.0, 1.5, True, True, 2)),
]


@needs_kernel
@pytest.mark.parametrize(("warmup", "args"), CLIP_SETTINGS, ids=[f"warmup{w}-adopt{a[-1]}" for w, a in CLIP_SETTINGS])
def test_clip_kernel_equals_the_fallback(warmup, args):
    compiled = torch.zeros(ops.clip_state_size(warmup), dtype=torch.float64)
    compiled[ops.CLIP_LAST:ops.CLIP_STREAK] = math.nan
    fallback = compiled.clone()
    longest = 0.0
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    for i, g in enumerate(figures(warmup + 600, seed=warmup)):
        grad_norm = torch.tensor([g], dtype=dtypes[i % 4])  # any one-element shape, any float dtype
        got = ops.adaptive_clip_step(compiled, grad_norm, *args)
        want = ops._adaptive_clip_step(fallback, grad_norm, *args)
        assert got.dtype == torch.float64 and got.shape == ()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, equal_nan=True, msg=f"step {i}")
        _assert_same_state(compiled, fallback, i)
        longest = max(longest, float(compiled[ops.CLIP_STREAK]))
    assert compiled[ops.CLIP_COUNT] == warmup
    assert longest >= max(args[-1], 2)  # streaks of clipped steps, long enough to adopt where adoption is on


@needs_kernel
def test_noise_kernel_equals_the_fallback():
    gen = torch.Generator().manual_seed(5)
    for ema in (0.0, 0.9, 0.99):
        compiled = torch.zeros(ops.NOISE_STATE, dtype=torch.float64)
        fallback = compiled.clone()
        for i in range(300):
            big = float(torch.rand((), generator=gen, dtype=torch.float64)) * 2
            small = big + float(torch.rand((), generator=gen, dtype=torch.float64))
            if i % 37 == 5:
                small = (math.nan, math.inf)[i % 2]
            s = torch.tensor(small, dtype=(torch.float32, torch.float64)[i % 2])
            b = torch.tensor([big], dtype=torch.float64)
            ops.noise_scale_step(compiled, s, b, 8.0, 8.0 * (2 + i % 3), ema)
            ops._noise_scale_step(fallback, s, b, 8.0, 8.0 * (2 + i % 3), ema)
            _assert_same_state(compiled, fallback, i)
        assert 0 < float(compiled[2]) <= 1


def _guard_state(window: int) -> torch.Tensor:
    state = torch.zeros(ops.guard_state_size(window), dtype=torch.float64)
    state[ops.GUARD_LAST:ops.GUARD_HIST] = math.nan
    return state


@pytest.mark.parametrize("loss", [None, torch.tensor(2.0, dtype=torch.float32)])
def test_opcheck_spike_guard_step(loss):
    state = _guard_state(8)
    for v in (1.0, 1.1, 0.9, 1.0):  # a history, so the check also runs the judging path
        ops.spike_guard_step(state, torch.tensor(v, dtype=torch.float64), loss, 3.0, 2, 4, 3, False)
    torch.library.opcheck(ops.spike_guard_step, (state, torch.tensor(50.0, dtype=torch.float64), loss, 3.0, 2, 4, 3,
                                                 False))


def test_opcheck_adaptive_clip_step():
    state = torch.zeros(ops.clip_state_size(3), dtype=torch.float64)
    for v in (1.0, 1.2, 0.8, 1.1):
        ops.adaptive_clip_step(state, torch.tensor(v, dtype=torch.float64), 0.9, 2.0, 1.0, math.inf, False, False, 2)
    torch.library.opcheck(ops.adaptive_clip_step, (state, torch.tensor([9.0]), 0.9, 2.0, 1.0, 5.0, False, False, 2))


def test_opcheck_noise_scale_step():
    state = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    torch.library.opcheck(ops.noise_scale_step, (state, torch.tensor(3.0), torch.tensor(1.5, dtype=torch.float64),
                                                 4.0, 16.0, 0.9))


def test_bad_states_and_figures_are_named():
    state = _guard_state(4)
    g = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="spike_guard_step: state must be the policy's packed float64"):
        ops.spike_guard_step(state.float(), g, None, 3.0, 1, 4, 0, False)
    with pytest.raises(ValueError, match="spike_guard_step: loss must be a one-element"):
        ops.spike_guard_step(state, g, torch.ones(2), 3.0, 1, 4, 0, False)
    with pytest.raises(ValueError, match="adaptive_clip_step: grad_norm must be a one-element"):
        ops.adaptive_clip_step(torch.zeros(9, dtype=torch.float64), torch.tensor(1), 0.9, 2.0, 1.0, 1.0, False, False,
                               0)
    for kernel in (ops.adaptive_clip_step, ops._adaptive_clip_step):  # the compiled kernel where there is one
        with pytest.raises(ValueError, match="adaptive_clip_step: adopt_after must be >= 0"):
            kernel(torch.zeros(9, dtype=torch.float64), g, 0.9, 2.0, 1.0, 1.0, False, False, -1)
    with pytest.raises(ValueError, match="noise_scale_step: state must be"):
        ops.noise_scale_step(torch.zeros(4, dtype=torch.float64), g, g, 4.0, 8.0, 0.9)


def test_each_policy_step_is_one_op():
    """Eager, on the CPU: each per-step update reaches the dispatcher as one op (the pure-PyTorch kernel runs below
    it where no compiled kernel is registered), whatever the step's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    guard, clip, noise = SpikeGuard(window=8, sigma=3.0), AdaptiveClip(warmup=3), NoiseScale(4)
    noise.update(torch.tensor(2.0), torch.tensor(1.0), big_batch_size=8)  # the first step allocates the state
    for v, ell in itertools.product((1.0, 1.1, 50.0, math.nan, 0.9), (2.0, math.inf)):
        norm, loss = torch.tensor(v, dtype=torch.float64), torch.tensor(ell)
        with Ops() as mode:
            guard.observe(norm, loss)
            clip.threshold(norm)
            noise.update(norm * 2, norm, big_batch_size=8)
        assert mode.names == ["torch_gradstats::spike_guard_step", "torch_gradstats::adaptive_clip_step",
                              "aten::mul.Tensor", "torch_gradstats::noise_scale_step"], mode.names
