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
from torch_gradstats.ops import policy_ops as ops
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


# ------------------------------------------------------------------------------------- a lasting change of level
def _level_change(n: int = 300, at: int = 150, factor: float = 10.0, seed: int = 0) -> list[float]:
    """Gradient norms around 1 (lognormal, 10% spread) whose level rises by ``factor`` for good at step ``at``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, generator=gen, dtype=torch.float64).mul(0.1).exp().tolist()
    return [(factor if i >= at else 1.0) * v for i, v in enumerate(noise)]


def _coefs(clip: AdaptiveClip, norms: list[float]) -> list[float]:
    out = []
    for g in norms:
        clip.threshold(torch.tensor(g, dtype=torch.float64))
        out.append(clip.last_coef.item())
    return out


@pytest.mark.parametrize("factor", [2.0, 10.0, 1e4])
def test_a_lasting_rise_is_adopted_by_default_and_clipped_for_good_by_zclip(factor):
    norms = _level_change(factor=factor)
    adopted, zclip = _coefs(AdaptiveClip(), norms), _coefs(AdaptiveClip(adopt_after=None), norms)
    assert adopted[:150] == zclip[:150]  # no streak of 16 clipped steps before the change: ZClip's thresholds
    # ZClip: the threshold stays at the old level, every step after the change is clipped to it (about 1 / factor).
    assert all(c < 1 for c in zclip[150:])
    assert max(zclip[200:]) < 1.5 / factor
    # Adopted: clipped for adopt_after steps as ZClip, then a few more while the statistics move (the first unclipped
    # step: 166 to 172 here), then for a small rise a few milder clips while the band settles (up to step 178 for
    # x2), then only noise, no more than at the old level (2 steps of 150).
    stop = next(i for i in range(150, 300) if adopted[i] == 1.0)
    assert 150 + 16 <= stop <= 150 + 25, stop
    assert all(c < 1 for c in adopted[150:stop])
    assert adopted[150:166] == zclip[150:166]  # the streak's first 15 steps, and the 16th's threshold, as ZClip
    assert sum(c < 1 for c in adopted[150 + 35:]) <= 2
    assert adopted[-1] == 1.0


def test_a_spike_shorter_than_adopt_after_is_clipped_as_zclip_and_a_longer_one_is_adopted():
    norms = _level_change(n=400, at=400)  # around 1, then spikes of 1 to 15 steps, and one of 20
    starts, length = {}, 1
    for start in range(60, 360, 20):
        starts[start] = min(length, 15)
        length += 1
    spiky = list(norms)
    for start, n in starts.items():
        spiky[start:start + n] = [30.0 * v for v in spiky[start:start + n]]
    zclip = [AdaptiveClip(adopt_after=None), ZClipRule(0.97, 2.5, 25, "adaptive_scaling", 1.0, None, False)]
    adopted = AdaptiveClip()
    got = [adopted.threshold(torch.tensor(g, dtype=torch.float64)).item() for g in spiky]
    want = [zclip[0].threshold(torch.tensor(g, dtype=torch.float64)).item() for g in spiky]
    assert got == want  # spikes of up to adopt_after - 1 = 15 steps: exactly ZClip's thresholds
    _assert_thresholds(got, [zclip[1].step(g) for g in spiky])
    assert all(got[s + i] < 30 for s, n in starts.items() for i in range(n))  # every spike step was clipped
    # A burst of 20 steps: its first 15 clipped as ZClip, its 16th on enter the statistics.
    burst = norms[:100] + [30.0 * v for v in norms[100:120]] + norms[120:]
    a, z = AdaptiveClip(), AdaptiveClip(adopt_after=None)
    got = [a.threshold(torch.tensor(g, dtype=torch.float64)).item() for g in burst]
    want = [z.threshold(torch.tensor(g, dtype=torch.float64)).item() for g in burst]
    assert got[:116] == want[:116] and got[116] != want[116]


@pytest.mark.parametrize("setting", [{}, {"clip_option": "mean", "max_norm": 5.0}, {"skip_update_on_spike": True},
                                     {"adopt_after": 1, "alpha": 0.9, "warmup": 5}])
@pytest.mark.parametrize("kind", ["rising", "plateaus", "mixed", "levels"])
def test_adoption_equals_the_reference_rule(kind, setting):
    """The three ways of computing a step (the compiled kernel where there is one, the pure-PyTorch kernel, and the
    rule on Python floats) agree with adoption on, NaN and inf inside streaks included."""
    clip, fallback = AdaptiveClip(**setting), AdaptiveClip(**setting)
    ref = _rule(clip, finite_only=True)
    if kind == "levels":  # a rise x10, a fall x100, a rise x100; NaN and inf in the streaks of clipped steps
        norms = _level_change(n=250, at=100) + [v * 0.1 for v in _level_change(n=250, at=150, factor=100.0)]
        for i in (101, 103, 104, 401):
            norms[i] = (math.nan, math.inf)[i % 2]
    else:
        norms = sequence(kind, 600, seed=14)
    got, slow, streaks = [], [], []
    for g in norms:
        t = torch.tensor(g, dtype=torch.float64)
        got.append(clip.threshold(t).item())
        slow.append(ops._adaptive_clip_step(fallback._state, t, clip.alpha, clip.z_thresh, clip.clip_factor,
                                            math.inf if clip.max_norm is None else clip.max_norm,
                                            clip.clip_option == "mean", clip.skip_update_on_spike,
                                            clip.adopt_after).item())
        streaks.append(clip.consecutive.item())
    want = [ref.step(g) for g in norms]
    _assert_thresholds(got, want)
    _assert_thresholds(slow, want)
    torch.testing.assert_close(clip._state, fallback._state, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert clip.consecutive.item() == ref.streak
    if kind == "levels":  # the NaN and inf neither ended nor extended the streaks they fell in
        assert all(streaks[i] == streaks[i - 1] for i in (101, 103, 104, 401))
        assert streaks[100] == 1 and streaks[400] == 1  # each rise starts a streak
        assert max(streaks) >= clip.adopt_after  # adoption happened


def test_non_finite_norms_neither_extend_nor_end_the_streak():
    clip = AdaptiveClip(warmup=3, adopt_after=3)
    for g in (1.0, 1.1, 0.9, 1.0):
        clip.threshold(torch.tensor(g, dtype=torch.float64))
    streaks = []
    for g in (50.0, math.nan, 50.0, math.inf, -math.inf, 50.0, 1.0):
        clip.threshold(torch.tensor(g, dtype=torch.float64))
        streaks.append(clip.consecutive.item())
    assert streaks == [1, 1, 2, 2, 2, 3, 0]
    assert clip.consecutive.dtype == torch.int64 and clip.consecutive.shape == ()


def test_an_adopted_norm_whose_variance_would_overflow_leaves_the_statistics_finite():
    """float64 norms above ~1e154 square past float64's range: adopting one would make the variance infinite and
    stop every later clip; it leaves the statistics as they were instead, so the threshold stays finite."""
    clip = AdaptiveClip(warmup=3, adopt_after=2)
    for g in (1.0, 1.1, 0.9):
        clip.threshold(torch.tensor(g, dtype=torch.float64))
    for _ in range(6):
        threshold = clip.threshold(torch.tensor(1e160, dtype=torch.float64))
    state = clip.state_dict()
    assert math.isfinite(threshold.item()) and threshold.item() < 2.0
    assert all(math.isfinite(v) for v in state["ema"].tolist())
    AdaptiveClip().load_state_dict(state)  # its own state stays loadable


def test_adopt_after_resumes_from_a_state_dict_mid_streak():
    norms = _level_change(n=220, at=100)
    whole = AdaptiveClip(adopt_after=8)
    want, streaks = [], []
    for g in norms:
        want.append(whole.threshold(torch.tensor(g)).item())
        streaks.append(whole.consecutive.item())
    assert streaks[103] == 4 and streaks[108] == 9  # the streak runs on after its adoption
    for cut in (104, 108, 109):  # inside the streak: before, at and after its adoption
        first = AdaptiveClip(adopt_after=8)
        got = [first.threshold(torch.tensor(g)).item() for g in norms[:cut]]
        state = first.state_dict()
        assert state["adopt_after"] == 8 and state["streak"].tolist() == [cut - 100]
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        resumed = AdaptiveClip(adopt_after=None)  # other settings: the state's replace them
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        assert resumed.adopt_after == 8 and resumed.consecutive.item() == cut - 100
        got += [resumed.threshold(torch.tensor(g)).item() for g in norms[cut:]]
        assert got == want, cut
    none = AdaptiveClip(adopt_after=None)
    none.threshold(1.0)
    fresh = AdaptiveClip()
    fresh.load_state_dict(none.state_dict())
    assert fresh.adopt_after is None  # None (ZClip's rule) round-trips


def test_a_state_saved_before_adopt_after_loads_with_the_default_and_no_streak():
    norms = _level_change(n=200, at=100)
    saved = AdaptiveClip(adopt_after=None)
    for g in norms[:110]:  # 10 clipped steps in a row
        saved.threshold(torch.tensor(g))
    old = {k: v for k, v in saved.state_dict().items() if k not in ("adopt_after", "streak")}
    clip = AdaptiveClip(adopt_after=3)
    clip.load_state_dict(old)
    assert clip.adopt_after == 16 and clip.consecutive.item() == 0
    assert repr(clip).endswith("adopt_after=16, device=cpu)")
    # It continues as a default clipper that saw the same statistics and no streak: it adopts 16 steps later.
    ref = AdaptiveClip()
    ref._state.copy_(saved._state)
    ref._state[ops.CLIP_STREAK] = 0
    assert [clip.threshold(torch.tensor(g)).item() for g in norms[110:]] == [
        ref.threshold(torch.tensor(g)).item() for g in norms[110:]
    ]
    assert clip.last_coef.item() == 1.0


def test_bad_adopt_after_is_named():
    with pytest.raises(ValueError, match="adopt_after must be >= 1"):
        AdaptiveClip(adopt_after=0)
    with pytest.raises(TypeError, match="adopt_after must be an int"):
        AdaptiveClip(adopt_after=4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="adopt_after must be an int"):
        AdaptiveClip(adopt_after=True)
    with pytest.raises(ValueError, match="adopt_after must be <= .*or None for ZClip's rule"):
        AdaptiveClip(adopt_after=2**60)
    state = AdaptiveClip().state_dict()
    with pytest.raises(ValueError, match="adopt_after must be >= 1"):
        AdaptiveClip().load_state_dict({**state, "adopt_after": -2})
    with pytest.raises(ValueError, match="'streak' must be a torch.int64 tensor of shape \\(1,\\)"):
        AdaptiveClip().load_state_dict({**state, "streak": torch.zeros(1)})
    with pytest.raises(ValueError, match="'streak' .the clipped steps in a row. must be in"):
        AdaptiveClip().load_state_dict({**state, "streak": torch.tensor([-1])})


@pytest.mark.usefixtures("one_thread")
def test_a_model_whose_loss_is_scaled_x10_halfway_is_clipped_again_only_briefly():
    """A ResNet trained with Adam on random batches, its loss scaled x10 from step 50 of 100 (the gradient norm's level
    rises x10; Adam's steps stay about the same): AdaptiveClip.clip_ every step. ZClip's rule clips every later step
    to about 0.1; the default adopts the new level and the coefficient is back to 1.0 within a few dozen steps."""
    from model_zoo import resnet

    gen = torch.Generator().manual_seed(0)
    images, labels = torch.randn(128, 3, 4, 4, generator=gen), torch.randint(0, 5, (128,), generator=gen)
    batches = [torch.randint(0, 128, (8,), generator=gen) for _ in range(100)]
    coefs = {}
    for adopt_after in (16, None):
        model = resnet(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        clip = AdaptiveClip(warmup=10, adopt_after=adopt_after)
        out = []
        for step, batch in enumerate(batches):
            loss = nn.functional.cross_entropy(model(images[batch]), labels[batch]) * (10.0 if step >= 50 else 1.0)
            optimizer.zero_grad()
            loss.backward()
            out.append(clip.clip_(model.parameters()).clip_coef.item())
            optimizer.step()
        coefs[adopt_after] = out
    adopted, zclip = coefs[16], coefs[None]
    assert max(zclip[50:]) < 0.5  # held at the old scale to the end
    # Clipped (about 0.1) from step 50 to 66, then 7 milder clips (coefficients 0.5 to 0.97) up to step 81, then
    # none; ZClip's rule clips every step from 50 to about 0.1.
    clipped = [i for i in range(50, 100) if adopted[i] < 1]
    stop = next(i for i in range(50, 100) if adopted[i] == 1.0)
    assert 50 + 16 <= stop <= 50 + 30 and clipped[-1] < 50 + 35, clipped
