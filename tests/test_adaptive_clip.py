"""AdaptiveClip against ZClip's z-score rule reimplemented in Python floats (with and without the adoption of a lasting
change of level), the clip through the fused clip_grad_norm_ with a 0-d tensor max_norm, checkpoints, and no host
reads."""

from __future__ import annotations

import io
import math
import os
import sys

import pytest
import torch
from torch import nn

import torch_gradstats.policies.adaptive_clip as adaptive_clip_mod
import torch_gradstats.policies.clip as clip_mod
from torch_gradstats import HAS_EXTENSION, AdaptiveClip, clip_grad_norm_, grad_stats
from torch_gradstats.policies.clip import clip_with_threshold_

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _guard_helpers import forbid_host_reads, sequence
from _host_reads import HostReads


class ZClipRule:
    """ZClip's z-score mode (its zclip.py) on Python floats: a list during warm-up, then EMA mean and variance.
    ``finite_only`` keeps non-finite norms out of the statistics, as AdaptiveClip does (ZClip folds them in).
    ``adopt_after`` (not ZClip's) feeds the statistics the norm itself from that many clipped finite norms in a row
    on; a non-finite norm neither extends nor ends the streak."""

    def __init__(self, alpha, z_thresh, warmup, clip_option, clip_factor, max_norm, skip_update, finite_only=False,
                 adopt_after=None):
        self.alpha, self.z_thresh, self.warmup = alpha, z_thresh, warmup
        self.clip_option, self.clip_factor, self.max_norm = clip_option, clip_factor, max_norm
        self.skip_update, self.finite_only = skip_update, finite_only
        self.adopt_after = adopt_after
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0
        self.streak = 0

    def step(self, norm: float) -> float:
        cap = math.inf if self.max_norm is None else self.max_norm
        if self.mean is None:
            if math.isfinite(norm) or not self.finite_only:
                self.buffer.append(norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            return cap
        std = self.var**0.5
        z = (norm - self.mean) / (std + 1e-6)
        clip_value = None
        if z > self.z_thresh:
            if self.clip_option == "adaptive_scaling":
                clip_value = (self.mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
            else:
                clip_value = self.mean
        threshold = cap if clip_value is None else min(clip_value, cap)
        adopt = False
        if math.isfinite(norm):
            self.streak = 0 if clip_value is None else self.streak + 1
            adopt = clip_value is not None and self.adopt_after is not None and self.streak >= self.adopt_after
        if adopt:
            clip_value = None  # the statistics take the norm itself (the threshold is this step's clip value)
        if not (clip_value is not None and self.skip_update) and (math.isfinite(norm) or not self.finite_only):
            v = norm if clip_value is None else clip_value
            self.mean = self.alpha * self.mean + (1 - self.alpha) * v
            self.var = self.alpha * self.var + (1 - self.alpha) * (v - self.mean) ** 2
        return threshold


# ZClip's rule exactly: adopt_after=None (the tests with adoption below add it).
SETTINGS = {
    "defaults": {"adopt_after": None},
    "mean_capped": {"clip_option": "mean", "max_norm": 1.5, "warmup": 10, "adopt_after": None},
    "factor_skip": {"alpha": 0.9, "z_thresh": 2.0, "clip_factor": 0.7, "skip_update_on_spike": True, "warmup": 5,
                    "adopt_after": None},
}


def _rule(clip: AdaptiveClip, finite_only: bool) -> ZClipRule:
    return ZClipRule(
        clip.alpha, clip.z_thresh, clip.warmup, clip.clip_option, clip.clip_factor, clip.max_norm,
        clip.skip_update_on_spike, finite_only, clip.adopt_after,
    )


def _assert_thresholds(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a == b) or math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0), f"step {i}: {a} != {b}"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["noise", "trend", "rising", "spikes", "plateaus"])
def test_thresholds_equal_zclip_on_finite_norms(kind, setting):
    clip = AdaptiveClip(**SETTINGS[setting])
    zclip = _rule(clip, finite_only=False)
    norms = sequence(kind, 800, seed=11)
    got = [clip.threshold(torch.tensor(g, dtype=torch.float64)).item() for g in norms]
    want = [zclip.step(g) for g in norms]
    _assert_thresholds(got, want)
    if kind == "spikes":
        assert sum(1 for t in want if t < (clip.max_norm or math.inf)) > 10  # clipping happened


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["nonfinite", "mixed"])
def test_non_finite_norms_stay_out_of_the_statistics(kind, setting):
    clip = AdaptiveClip(**SETTINGS[setting])
    ref = _rule(clip, finite_only=True)
    norms = sequence(kind, 800, seed=12)
    got = [clip.threshold(torch.tensor(g, dtype=torch.float64)).item() for g in norms]
    _assert_thresholds(got, [ref.step(g) for g in norms])
    mean, var = clip.state_dict()["ema"].tolist()
    assert math.isfinite(mean) and math.isfinite(var)  # ZClip's would be NaN after the first NaN


def test_resume_from_state_dict_equals_uninterrupted():
    norms = sequence("mixed", 500, seed=13)
    whole = AdaptiveClip(warmup=20, max_norm=4.0)
    want = [whole.threshold(torch.tensor(g)).item() for g in norms]
    for cut in (7, 20, 21, 300):  # inside the warm-up, at its end, just after, well after
        first = AdaptiveClip(warmup=20, max_norm=4.0)
        got = [first.threshold(torch.tensor(g)).item() for g in norms[:cut]]
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        buf.seek(0)
        resumed = AdaptiveClip()  # fresh, other settings
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        got += [resumed.threshold(torch.tensor(g)).item() for g in norms[cut:]]
        assert got == want, cut


def test_load_state_dict_rejects_bad_states():
    clip = AdaptiveClip(warmup=4)
    state = clip.state_dict()
    with pytest.raises(ValueError, match="no ema"):
        clip.load_state_dict({k: v for k, v in state.items() if k != "ema"})
    with pytest.raises(ValueError, match="'warmup_norms' must be a torch.float64 tensor of shape \\(4,\\)"):
        clip.load_state_dict({**state, "warmup_norms": torch.zeros(5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="clip_option must be one of"):
        clip.load_state_dict({**state, "clip_option": "median"})


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="alpha must be in \\[0, 1\\)"):
        AdaptiveClip(alpha=1.0)
    with pytest.raises(ValueError, match="z_thresh must be finite, > 0"):
        AdaptiveClip(z_thresh=0)
    with pytest.raises(TypeError, match="warmup must be an int"):
        AdaptiveClip(warmup=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        AdaptiveClip(warmup=0)
    with pytest.raises(ValueError, match="warmup must be <= 1,048,576"):
        AdaptiveClip(warmup=10**12)  # before: torch's allocator failing on 8 TB
    with pytest.raises(ValueError, match="max_norm must be finite, > 0"):
        AdaptiveClip(max_norm=-1.0)
    with pytest.raises(TypeError, match="skip_update_on_spike must be a bool"):
        AdaptiveClip(skip_update_on_spike=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_norm must be a one-element tensor"):
        AdaptiveClip().threshold(torch.ones(2))


# ---------------------------------------------------------------------------------------------- clipping
def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model(torch.randn(4, 6)).square().sum().backward()
    return model


def test_clip_grad_norm_takes_a_tensor_max_norm_like_a_number():
    a, b = _model(0), _model(0)
    want = clip_grad_norm_(a.parameters(), 0.5)
    with HostReads() as mode:  # a CPU tensor is checked (>= 0): its one read is no sync, its memory is the host's
        got = clip_grad_norm_(b.parameters(), torch.tensor(0.5, dtype=torch.float32))
    assert mode.count == 1
    c = _model(0)
    with forbid_host_reads(), HostReads() as mode:  # the policies' own thresholds are never read
        unread = clip_with_threshold_(c.parameters(), torch.tensor(0.5, dtype=torch.float32))
    assert mode.count == 0
    # bit-equal with the compiled kernel; the pure-PyTorch one sums in another order when it may not read the host
    torch.testing.assert_close(unread.clip_coef, got.clip_coef, rtol=0 if HAS_EXTENSION else 1e-6, atol=0)
    torch.testing.assert_close(got.clip_coef, want.clip_coef, rtol=1e-6, atol=0)
    assert got.clip_coef.item() < 1
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="max_norm must have one element"):
        clip_grad_norm_(b.parameters(), torch.ones(2))
    with pytest.raises(TypeError, match="max_norm as a tensor must be floating point"):
        clip_grad_norm_(b.parameters(), torch.tensor(1))
    with pytest.raises(ValueError, match="stats must be the GradStats of the 4 gradients"):
        clip_grad_norm_(b.parameters(), 1.0, stats=grad_stats(list(b.parameters())[:2]))
    with pytest.raises(TypeError, match="stats must be a GradStats or None"):
        clip_grad_norm_(b.parameters(), 1.0, stats={})  # type: ignore[arg-type]


def test_clip_reads_the_gradients_once_and_clips_to_the_threshold(monkeypatch):
    reads = []
    real = adaptive_clip_mod.grad_stats
    monkeypatch.setattr(adaptive_clip_mod, "grad_stats", lambda *a, **k: reads.append(1) or real(*a, **k))

    def second_read(*args, **kwargs):
        raise AssertionError("clip_grad_norm_ read the gradients again")

    monkeypatch.setattr(clip_mod, "grad_stats", second_read)
    clip, ref = AdaptiveClip(warmup=3, z_thresh=1.5), AdaptiveClip(warmup=3, z_thresh=1.5)
    clipped = []
    for step in range(12):
        model, plain = _model(step), _model(step)
        if step in (6, 9):  # spikes
            for m in (model, plain):
                for p in m.parameters():
                    p.grad.mul_(30)
        stats = clip.clip_(model.named_parameters())
        norm = grad_stats(plain.parameters()).total_norm
        threshold = ref.threshold(norm)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), threshold.item())
        assert stats.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
        torch.testing.assert_close(stats.clip_norm, norm, rtol=0, atol=0)
        torch.testing.assert_close(stats.clip_coef, (threshold / (norm + 1e-6)).clamp(max=1), rtol=0, atol=0)
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        if stats.clip_coef.item() < 1:
            clipped.append(step)
    assert len(reads) == 12 and {6, 9} <= set(clipped) and 0 not in clipped  # no clipping in the warm-up
    assert clip.figures() == {"clip/threshold": threshold.item(), "clip/coef": stats.clip_coef.item()}


def test_threshold_and_clip_never_read_the_host():
    clip = AdaptiveClip(warmup=4, max_norm=10.0)
    models = [_model(s) for s in range(10)]
    with forbid_host_reads(), HostReads() as mode:
        for i, model in enumerate(models):
            clip.threshold(torch.tensor(float(i % 3) * 5 + 1.0, dtype=torch.float64))
            clip.clip_(model.parameters())
        _ = (clip.last_threshold, clip.last_coef, clip.check_tensors())
    assert mode.count == 0


def test_threshold_launches_the_same_ops_every_step():
    from torch.profiler import ProfilerActivity, profile

    clip = AdaptiveClip(warmup=3)
    counts = []
    for v in [1.0, math.nan, 1.1, 1.2, 50.0, math.inf, 1.0, 1.05]:
        g = torch.tensor(v, dtype=torch.float64)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            clip.threshold(g)
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
    assert len(set(counts)) == 1, counts

