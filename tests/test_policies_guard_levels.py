"""SpikeGuard adopts a lasting change of level: it never skips forever, yet short spikes and non-finite steps stay
out of its history."""

from __future__ import annotations

import math

import pytest
import torch

from torch_gradstats import SpikeGuard

NAN, INF = math.nan, math.inf


def _t(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def _levels(before: int, after: int, factor: float, noise: float, seed: int = 0) -> list[float]:
    """``before`` values around 1, then ``after`` values around ``factor``: log-normal noise of width ``noise``."""
    gen = torch.Generator().manual_seed(seed)
    eps = (noise * torch.randn(before + after, generator=gen, dtype=torch.float64)).exp()
    base = torch.cat([torch.ones(before, dtype=torch.float64), torch.full((after,), factor, dtype=torch.float64)])
    return (base * eps).tolist()


CONFIGS = {
    "defaults": {},
    "window32": {"window": 32},
    "sigma3": {"sigma": 3.0},
    "window32_sigma3": {"window": 32, "sigma": 3.0},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=list(CONFIGS))
@pytest.mark.parametrize("factor", [2.0, 10.0])
@pytest.mark.parametrize("watch_loss", [False, True], ids=["norm", "norm_and_loss"])
def test_a_lasting_level_change_is_taken_again_within_window_steps(config, factor, watch_loss):
    guard = SpikeGuard(**config)
    w, before, after = guard.window, 200, 800  # the 2% is measured over enough steps to hold noise skips too
    norms = _levels(before, after, factor, noise=0.05, seed=1)
    losses = _levels(before, after, 1.0, noise=0.05, seed=2)
    taken = [
        guard.observe(_t(g), _t(ell) if watch_loss else None).item() == 1.0 for g, ell in zip(norms, losses)
    ]
    after = taken[before:]
    assert not after[0]  # the change itself looks like a spike
    assert any(after[:w]), f"no step taken in the {w} steps after the change"
    late = after[w:]
    assert late.count(False) <= 0.02 * len(late), f"{late.count(False)} of {len(late)} skipped"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=list(CONFIGS))
def test_a_small_rise_after_a_flat_history_is_adopted(config):
    guard = SpikeGuard(**config)
    w = guard.window
    values = [1.0] * 150 + [1.01] * (5 * w)  # std 0, then 1% higher for good
    taken = [guard.observe(_t(v)).item() == 1.0 for v in values]
    after = taken[150:]
    assert not after[0] and any(after[:w])
    assert after[w:].count(False) <= 0.02 * len(after[w:])


@pytest.mark.parametrize("length", [1, 2, 3])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=list(CONFIGS))
def test_spikes_of_one_to_three_steps_are_skipped_in_full(config, length):
    guard = SpikeGuard(**config)
    values = _levels(300, 0, 1.0, noise=0.05, seed=3)
    spikes = set()
    for start in range(150, 290, 20):  # several bursts, each kept out of the history
        for i in range(length):
            values[start + i] = 20.0 + i
            spikes.add(start + i)
    decisions = [guard.observe(_t(v)).item() for v in values]
    assert [decisions[i] for i in sorted(spikes)] == [0.0] * len(spikes)
    assert decisions.count(0.0) - len(spikes) <= 0.02 * len(values)  # besides them, a few noise skips at most
    assert guard.state_dict()["history"][0].max().item() < 2.0  # no spike entered the history


def test_non_finite_steps_neither_enter_nor_count_toward_adopting():
    guard = SpikeGuard(window=32, sigma=3.0)
    for v in _levels(60, 0, 1.0, noise=0.05, seed=4):
        guard.observe(_t(v))
    assert guard.observe(_t(1.0)).item() == 1.0  # no streak under way
    history = guard.state_dict()["history"].clone()
    # Three spikes with long runs of NaN and inf around them: the streak of finite skips never reaches 4.
    values = [NAN] * 10 + [30.0] + [INF] * 10 + [31.0] + [NAN] * 5 + [32.0] + [NAN] * 10
    decisions = [guard.observe(_t(v)).item() for v in values]
    assert decisions == [0.0] * len(values)
    torch.testing.assert_close(guard.state_dict()["history"], history, rtol=0, atol=0)
    # The fourth finite spike of the streak is the first to enter; a taken step ends the streak.
    assert guard.observe(_t(33.0)).item() == 0.0
    assert guard.state_dict()["history"][0].max().item() == 33.0
    assert guard.observe(_t(1.0)).item() == 1.0
    assert guard.observe(_t(30.0)).item() == 0.0


def test_a_non_finite_loss_keeps_the_step_out_of_the_streak():
    guard = SpikeGuard(window=16, sigma=3.0)
    for g, ell in zip(_levels(30, 0, 1.0, 0.05, seed=5), _levels(30, 0, 2.0, 0.05, seed=6)):
        guard.observe(_t(g), _t(ell))
    count = guard.state_dict()["count"].clone()
    for _ in range(20):  # a lasting higher norm, but every step's loss is NaN: nothing is adopted
        assert guard.observe(_t(5.0), _t(NAN)).item() == 0.0
    assert torch.equal(guard.state_dict()["count"], count) and guard.state_dict()["counters"][5].item() == 0


def test_adopt_after_is_a_setting_saved_and_checked():
    guard = SpikeGuard(window=16, sigma=3.0, adopt_after=2)
    assert guard.state_dict()["adopt_after"] == 2 and "adopt_after=2" in repr(guard)
    with pytest.raises(ValueError, match="adopt_after must be >= 1"):
        SpikeGuard(adopt_after=0)
    with pytest.raises(TypeError, match="adopt_after must be an int"):
        SpikeGuard(adopt_after=2.0)  # type: ignore[arg-type]
    for v in _levels(20, 0, 1.0, 0.05, seed=7):
        guard.observe(_t(v))
    assert [guard.observe(_t(10.0)).item() for _ in range(2)] == [0.0, 0.0]
    assert guard.state_dict()["count"][0].item() == 16  # full; the second skip entered in place of the oldest
    assert guard.state_dict()["history"][0].max().item() == 10.0


def test_a_state_saved_before_the_adoption_loads_and_resumes():
    """An older state has five counters and no adopt_after: it loads with the default and no streak under way."""
    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=2)
    values = _levels(20, 0, 1.0, 0.05, seed=8) + [50.0, 60.0]
    for v in values:
        guard.observe(_t(v), _t(1.0))
    state = guard.state_dict()
    old = {k: v for k, v in state.items() if k != "adopt_after"}
    old["counters"] = state["counters"][:5].clone()
    old["counters"][3] = 1  # a trip recorded, with the loss judged
    resumed = SpikeGuard()
    resumed.load_state_dict(old)
    assert resumed.adopt_after == 4 and resumed.state_dict()["counters"].tolist()[5:] == [0, 2]
    with pytest.raises(Exception, match="loss"):
        resumed.check()
    torch.testing.assert_close(resumed.state_dict()["history"], state["history"], rtol=0, atol=0)
