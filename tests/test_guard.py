"""SpikeGuard against independent reimplementations of its rule (exact rational statistics on Python lists, and
OLMo-core's list-based rule), resumed from checkpoints, without host syncs, compiled, and on CUDA where there is one."""

from __future__ import annotations

import copy
import io
import math
import os
import statistics
import sys

import pytest
import torch

from torch_gradstats import SpikeGuard, SpikeStreakError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _guard_helpers import KINDS, forbid_host_reads, sequence
from _host_reads import HostReads

NAN, INF = math.nan, math.inf


def compiled_policy_ops() -> bool:
    """Whether the policies' ops run a compiled CPU kernel here (not under TORCH_GRADSTATS_FORCE_FALLBACK=1)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::spike_guard_step", "CPU")


# ---------------------------------------------------------------------------------------------- references
class ReferenceRule:
    """The rule as specified, on Python lists, with exact (rational) mean and Bessel std from ``statistics``."""

    def __init__(
        self, window: int, sigma: float, min_history: int, count_skipped: bool, adopt_after: int = 4
    ) -> None:
        self.window, self.sigma, self.min_history, self.count_skipped = window, sigma, min_history, count_skipped
        self.adopt_after = adopt_after
        self.hist: dict[str, list[float]] = {"g": [], "l": []}
        self.skipped = self.consecutive = self.streak = 0

    def _skips(self, series: str, value: float) -> bool:
        h = self.hist[series]
        if len(h) < self.min_history:
            return False
        if not math.isfinite(value):
            return True
        if len(h) < 2:  # the std of fewer than two values is NaN, and NaN compares False
            return False
        return value - statistics.mean(h) > self.sigma * statistics.stdev(h)

    def step(self, values: dict[str, float]) -> bool:
        take = not any(self._skips(s, v) for s, v in values.items())
        all_finite = all(math.isfinite(v) for v in values.values())
        if take:
            self.streak = 0
        elif all_finite:  # a step with a non-finite value neither ends nor extends the streak
            self.streak += 1
        adopt = not take and all_finite and self.streak >= self.adopt_after
        for s, v in values.items():
            if math.isfinite(v) and (take or adopt or self.count_skipped):
                self.hist[s] = (self.hist[s] + [v])[-self.window :]
        self.skipped += not take
        self.consecutive = 0 if take else self.consecutive + 1
        return take


class OlmoRule:
    """OLMo-core's SkipStepOptimizer rule (warm-up max(2, window // 2)), reimplemented from its description: Python
    lists of 0-d tensors, the last ``window + 1`` values (the current one last), restacked every step."""

    def __init__(self, rolling_interval_length: int, sigma_factor: float) -> None:
        self.n, self.sigma = rolling_interval_length, sigma_factor
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        for lst, v in ((self.losses, loss), (self.grad_norms, grad_norm)):
            lst.append(v)
            while len(lst) > self.n + 1:
                lst.pop(0)
        if len(self.losses) < max(2, self.n // 2):
            return True
        loss_std, loss_mean = torch.std_mean(torch.stack(self.losses[:-1]))
        gn_std, gn_mean = torch.std_mean(torch.stack(self.grad_norms[:-1]))
        ok = torch.logical_and(
            (self.losses[-1] - loss_mean) <= self.sigma * loss_std,
            (self.grad_norms[-1] - gn_mean) <= self.sigma * gn_std,
        )
        return bool(ok)


def _t(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "window,sigma,count_skipped", [(128, 6.0, False), (16, 3.0, False), (7, 2.0, True)], ids=["w128", "w16", "w7cs"]
)
def test_decisions_equal_the_reference(kind, window, sigma, count_skipped):
    n = 1200 if window == 128 else 500
    norms, losses = sequence(kind, n, seed=1), sequence(kind, n, seed=2)
    guard = SpikeGuard(window, sigma, count_skipped=count_skipped)
    ref = ReferenceRule(window, sigma, guard.min_history, count_skipped)
    got, want = [], []
    for i, (g, ell) in enumerate(zip(norms, losses)):
        watch_loss = i % 5 != 3  # some steps give no loss: the loss history skips them
        got.append(guard.observe(_t(g), _t(ell) if watch_loss else None).item())
        want.append(ref.step({"g": g, "l": ell} if watch_loss else {"g": g}))
    assert got == [float(w) for w in want]
    if kind in ("spikes", "plateaus", "nonfinite", "mixed"):
        assert 0 < sum(want) < n  # the sequence exercises both outcomes
    host = guard.check()
    assert host["guard/skipped"] == ref.skipped and host["guard/consecutive"] == ref.consecutive


def test_equal_history_has_std_exactly_zero():
    guard = SpikeGuard(window=10, sigma=6.0, min_history=3)
    for _ in range(12):
        assert guard.observe(_t(0.1)).item() == 1.0  # 0.1 is not representable: running sums would drift
    assert guard.grad_norm_z.item() == 0.0
    st = guard.state_dict()
    assert st["last"][0, 1].item() == 0.1 and st["last"][0, 2].item() == 0.0  # mean, std
    assert guard.observe(_t(0.1 + 1e-12)).item() == 0.0  # anything above a flat history is a spike
    assert guard.grad_norm_z.item() == math.inf


def test_min_history_default_and_explicit():
    assert SpikeGuard(128).min_history == 63
    assert SpikeGuard(3).min_history == 1
    guard = SpikeGuard(window=8, sigma=1.0, min_history=0)
    assert guard.observe(_t(NAN)).item() == 0.0  # judged from the first step: a NaN is skipped at once
    guard = SpikeGuard(window=8, sigma=1.0, min_history=2)
    assert guard.observe(_t(NAN)).item() == 1.0  # too little history: taken, and the NaN never enters it
    assert guard.observe(_t(1.0)).item() == 1.0
    assert guard.observe(_t(INF)).item() == 1.0
    assert guard.state_dict()["count"][0].item() == 1


def test_loss_spike_alone_skips_and_watch_loss_false_ignores_it():
    for watch in (True, False):
        guard = SpikeGuard(window=8, sigma=3.0, watch_loss=watch)
        for i in range(8):
            guard.observe(_t(1.0 + 0.01 * i), _t(2.0 + 0.01 * (i % 3)))
        assert guard.observe(_t(1.0), _t(40.0)).item() == (1.0 if not watch else 0.0)


@pytest.mark.parametrize("window", [6, 8, 16, 128])
@pytest.mark.parametrize("kind", ["noise", "spikes", "plateaus", "mixed_finite"])
def test_count_skipped_equals_olmo_core(kind, window):
    """count_skipped=True on finite values makes OLMo-core's decisions (its warm-up counts the current value)."""
    n = 700
    if kind == "mixed_finite":
        norms = [v if math.isfinite(v) else 1e3 for v in sequence("mixed", n, seed=3)]
        losses = [v if math.isfinite(v) else 7.0 for v in sequence("spikes", n, seed=4)]
    else:
        norms, losses = sequence(kind, n, seed=3), sequence(kind, n, seed=4)
    guard = SpikeGuard(window, 3.0, count_skipped=True)
    olmo = OlmoRule(window, 3.0)
    got = [guard.observe(_t(g), _t(ell)).item() for g, ell in zip(norms, losses)]
    want = [float(olmo.step(_t(ell), _t(g))) for g, ell in zip(norms, losses)]
    assert got == want
    if kind != "noise":
        assert 0 < sum(want) < n


@pytest.mark.parametrize("kind", ["mixed", "nonfinite", "plateaus"])
def test_resume_from_state_dict_equals_uninterrupted(kind):
    n, cut = 600, 257
    norms, losses = sequence(kind, n, seed=5), sequence(kind, n, seed=6)
    settings = {"window": 32, "sigma": 3.0, "max_consecutive": 50}
    whole = SpikeGuard(**settings)
    want = [whole.observe(_t(g), _t(ell)).item() for g, ell in zip(norms, losses)]

    first = SpikeGuard(**settings)
    got = [first.observe(_t(g), _t(ell)).item() for g, ell in zip(norms[:cut], losses[:cut])]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    resumed = SpikeGuard()  # fresh, other settings: the state dict's settings win
    resumed.load_state_dict(state)
    assert resumed.window == 32 and resumed.sigma == 3.0 and resumed.max_consecutive == 50
    got += [resumed.observe(_t(g), _t(ell)).item() for g, ell in zip(norms[cut:], losses[cut:])]
    assert got == want
    for key, value in whole.state_dict().items():
        other = resumed.state_dict()[key]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(other, value, rtol=0, atol=0, equal_nan=True, msg=key)
        else:
            assert value == other, key
    assert _check(resumed) == _check(whole)


def _check(guard: SpikeGuard) -> object:
    try:
        return guard.check()
    except SpikeStreakError as err:  # a streak of skips (plateaus: a level shift is skipped until adopted)
        return err.step, err.consecutive, err.values, err.bands


def test_load_state_dict_rejects_bad_states():
    guard = SpikeGuard(window=4)
    state = guard.state_dict()
    with pytest.raises(TypeError, match="expected a dict"):
        guard.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no history"):
        guard.load_state_dict({k: v for k, v in state.items() if k != "history"})
    with pytest.raises(ValueError, match="'history' must be a torch.float64 tensor of shape \\(2, 4\\)"):
        guard.load_state_dict({**state, "history": torch.zeros(2, 5, dtype=torch.float64)})
    with pytest.raises(ValueError, match="window must be >= 2"):
        guard.load_state_dict({**state, "window": 0})


# ---------------------------------------------------------------------------------------------- streaks
def test_max_consecutive_raises_at_the_next_check_with_step_values_and_band():
    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=3)
    for i in range(8):
        guard.observe(_t(1.0 + 0.01 * (i % 2)), _t(3.0))
    for value in (50.0, 60.0):
        assert guard.observe(_t(value), _t(3.0)).item() == 0.0
    assert guard.check()["guard/consecutive"] == 2.0  # two in a row: no error yet
    guard.observe(_t(70.0), _t(3.0))  # the third: the streak is recorded on the device ...
    guard.observe(_t(1.0), _t(3.0))  # ... and survives a taken step before the host looks
    with pytest.raises(SpikeStreakError, match="3 steps in a row were skipped") as info:
        guard.check()
    err = info.value
    assert err.step == 11 and err.values == {"grad_norm": 70.0, "loss": 3.0}
    mean, top = err.bands["grad_norm"]
    assert mean == pytest.approx(1.005) and mean < top < 2.0
    assert guard.check()["guard/skipped"] == 3.0  # raised once; the flag is cleared


def test_no_streak_error_without_max_consecutive():
    guard = SpikeGuard(window=4, sigma=1.0, min_history=2)
    for v in [1.0, 1.0] + [NAN] * 20:
        guard.observe(_t(v))
    assert guard.check()["guard/consecutive"] == 20.0


# ---------------------------------------------------------------------------------------------- arguments
def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="window must be an int"):
        SpikeGuard(window=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be >= 2"):
        SpikeGuard(window=0)
    with pytest.raises(ValueError, match="window must be <= 1,048,576 .each history is a buffer"):
        SpikeGuard(window=10**12)  # before: torch's allocator failing on 16 TB
    assert SpikeGuard(window=1 << 20).window == 1 << 20
    with pytest.raises(ValueError, match="sigma must be finite, >= 0"):
        SpikeGuard(sigma=-1.0)
    with pytest.raises(TypeError, match="sigma must be a real number"):
        SpikeGuard(sigma="6")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_history must be <= window"):
        SpikeGuard(window=4, min_history=5)
    with pytest.raises(TypeError, match="watch_loss must be a bool"):
        SpikeGuard(watch_loss=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_consecutive must be >= 1"):
        SpikeGuard(max_consecutive=0)
    guard = SpikeGuard()
    with pytest.raises(ValueError, match="grad_norm must be a one-element tensor"):
        guard.observe(torch.ones(3))
    with pytest.raises(TypeError, match="loss must be a real tensor"):
        guard.observe(torch.ones(()), torch.ones((), dtype=torch.bool))
    with pytest.raises(TypeError, match="grad_norm must be a tensor or a real number"):
        guard.observe("1.0")  # type: ignore[arg-type]


def test_numbers_and_float32_inputs_are_accepted():
    a, b = SpikeGuard(window=8, sigma=2.0), SpikeGuard(window=8, sigma=2.0)
    for v in sequence("spikes", 60, seed=7):
        x = a.observe(v, loss=1.0)
        y = b.observe(torch.tensor(v, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float32))
        assert x.dtype == torch.float32 and x.shape == () and torch.equal(x, y)


# ---------------------------------------------------------------------------------------------- no host sync
def test_forbid_host_reads_catches_host_reads():
    with forbid_host_reads(), pytest.raises(AssertionError, match="host read: Tensor.__bool__"):
        bool(torch.ones(()) > 0)


def test_observe_never_reads_the_host():
    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=2)
    values = sequence("mixed", 40, seed=8)
    with forbid_host_reads(), HostReads() as mode:
        out = [guard.observe(_t(v), torch.tensor(v, dtype=torch.float32)) for v in values]
        _ = (guard.skipped, guard.consecutive, guard.grad_norm_z, guard.loss_z, guard.check_tensors())
    assert mode.count == 0
    assert any(o.item() == 0.0 for o in out)


def test_observe_launches_the_same_ops_every_step():
    from torch.profiler import ProfilerActivity, profile

    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=3)
    counts = []
    for v in [1.0, 1.1, 1.0, 50.0, NAN, 1.05, INF, 1.0, 0.9, 1.0, 60.0, 70.0, 80.0]:
        g, ell = _t(v), _t(2.0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            guard.observe(g, ell)
        counts.append(sum(1 for e in prof.events() if e.name.startswith("aten::")))
    assert len(set(counts)) == 1, counts


# ---------------------------------------------------------------------------------------------- step_or_skip
OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "sgd_momentum_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.1, foreach=True),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
}


def _twins(make_opt):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    return a, b, make_opt(a.parameters()), make_opt(b.parameters())


def _backward(models, i, bad=False, scalers=None):
    for k, m in enumerate(models):
        m.zero_grad()
        loss = m(torch.ones(4, 3) * (i + 1)).sum() * (math.inf if bad else 1.0)
        (loss if scalers is None else scalers[k].scale(loss)).backward()


def _assert_same(a, b, opt_a, opt_b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert set(sb) <= set(sa)
    for k in set(sa) - set(sb):  # a fused optimizer skipped on the device made its state, still untouched
        assert all(not torch.as_tensor(v).any() for v in sa[k].values()), sa[k]
    for k in sb:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name])), (k, name)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_step_or_skip_equals_stepping_only_the_taken_steps(opt):
    from torch_gradstats import step_or_skip

    model, ref, optimizer, ref_opt = _twins(OPTIMIZERS[opt])
    # a skipped first step too; only zero skips: 0.5 and NaN take the whole step
    for i, f in enumerate([0.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.0, math.nan, 1.0]):
        _backward([model, ref], i)
        step_or_skip(optimizer, torch.tensor(f))
        if f != 0:
            ref_opt.step()
        _assert_same(model, ref, optimizer, ref_opt)
    assert not hasattr(optimizer, "found_inf")


def test_step_or_skip_with_a_fused_optimizer_never_reads_the_host():
    from torch_gradstats import step_or_skip

    model, ref, optimizer, ref_opt = _twins(OPTIMIZERS["adamw_fused"])
    guard = SpikeGuard(window=4, sigma=2.0, min_history=2)
    norms = [1.0, 1.1, 1.05, 9.0, 1.0, NAN, 1.02]
    taken = []
    with forbid_host_reads(), HostReads() as mode:
        for i, g in enumerate(norms):
            _backward([model], i)
            factor = guard.observe(_t(g))
            step_or_skip(optimizer, factor)
            taken.append(factor)
    assert mode.count == 0
    assert [t.item() for t in taken] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    for i, t in enumerate(taken):
        _backward([ref], i)
        if t.item():
            ref_opt.step()
    _assert_same(model, ref, optimizer, ref_opt)


@pytest.mark.parametrize("opt", ["adamw_fused", "adam_foreach", "sgd_momentum_fused"])
def test_step_or_skip_composes_with_a_grad_scaler(opt):
    """A step skipped by the scaler (inf gradients), by the factor, or by both is skipped once; the scaler's update
    sees only its own inf checks (a skip by the factor alone keeps the scale)."""
    from torch_gradstats import step_or_skip

    model, ref, optimizer, ref_opt = _twins(OPTIMIZERS[opt])
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in range(2))
    plan = [(1.0, False), (0.0, False), (1.0, True), (0.0, True), (1.0, False), (1.0, False), (0.0, False), (1.0, 0)]
    scales = []
    for i, (f, bad) in enumerate(plan):
        _backward([model, ref], i, bad=bool(bad), scalers=[scaler, ref_scaler])
        step_or_skip(optimizer, torch.tensor(f), scaler)
        if f:
            ref_scaler.step(ref_opt)
        else:
            ref_scaler.unscale_(ref_opt)  # the scaler's inf check, without a step
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        scales.append(scaler.get_scale())
        _assert_same(model, ref, optimizer, ref_opt)
    assert scales[1] == 2.0**9 and scales[2] == 2.0**8 and scales[3] == 2.0**7  # skip alone: grown on schedule
    assert "step" not in optimizer.__dict__ and not hasattr(optimizer, "found_inf")


def test_step_or_skip_keeps_an_lr_scheduler_wrapper_and_rejects_bad_arguments():
    from torch_gradstats import step_or_skip

    model, _, optimizer, _ = _twins(OPTIMIZERS["adamw_fused"])
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    wrapped = optimizer.__dict__.get("step")
    scaler = torch.amp.GradScaler("cpu")
    _backward([model], 0, scalers=[scaler])
    step_or_skip(optimizer, torch.tensor(1.0), scaler)
    assert optimizer.__dict__.get("step") is wrapped
    sched.step()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        step_or_skip(model, torch.tensor(1.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factor must be a tensor"):
        step_or_skip(optimizer, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor must have one element"):
        step_or_skip(optimizer, torch.ones(2))
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        step_or_skip(optimizer, torch.tensor(1.0), object())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- compiled
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_observe_and_threshold_compile_in_one_graph_without_recompiles(backend):
    """A compiled post-backward step (statistics, guard, adaptive threshold, clipping) runs as one graph for 50 steps
    and decides as the eager one; the in-place state updates survive compilation (a 0-d float64 attribute's would
    not, on torch 2.13)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_gradstats import AdaptiveClip, grad_stats, step_or_skip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def after_backward(model, loss, guard, clip):
        norm = grad_stats(model.parameters()).total_norm
        factor = guard.observe(norm, loss)
        threshold = clip.threshold(norm)
        torch._foreach_mul_([p.grad for p in model.parameters()], (threshold / (norm + 1e-6)).clamp(max=1.0))
        return factor, threshold

    compiled = torch.compile(after_backward, fullgraph=True, backend=counter)
    runs = {}
    for name, fn in (("eager", after_backward), ("compiled", compiled)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        guard, clip = SpikeGuard(window=16, sigma=3.0, max_consecutive=4), AdaptiveClip(warmup=5, max_norm=5.0)
        gen = torch.Generator().manual_seed(1)
        out = []
        for step in range(50):
            x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
            if step in (20, 33, 34):
                y = y * 100  # loss and gradient spikes
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            factor, threshold = fn(model, loss.detach(), guard, clip)
            step_or_skip(optimizer, factor)
            out.append((factor.item(), threshold.item()))
        runs[name] = (out, guard.state_dict(), clip.state_dict(), [p.detach().clone() for p in model.parameters()])
    (eager, e_guard, e_clip, e_params), (got, c_guard, c_clip, c_params) = runs["eager"], runs["compiled"]
    assert counter.frame_count == 1, "recompiled or broke the graph"
    assert [f for f, _ in got] == [f for f, _ in eager]
    assert [f for f, _ in eager].count(0.0) >= 3  # the spikes were skipped
    torch.testing.assert_close([t for _, t in got], [t for _, t in eager], rtol=1e-9, atol=0)
    for eager_state, state in ((e_guard, c_guard), (e_clip, c_clip)):
        assert state["count"].sum() > 0
        for key, value in eager_state.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(state[key], value, rtol=1e-9, atol=0, equal_nan=True, msg=key)
    torch.testing.assert_close(c_params, e_params, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()


def test_clipping_compiles_in_one_graph_and_matches_eager():
    """clip_grad_norm_ and AdaptiveClip.clip_ (the clipping the policies' compiled steps use) trace into one graph
    with fullgraph=True, in training and under torch.inference_mode(), without recompiles, and clip as eager does."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_gradstats import AdaptiveClip, clip_grad_norm_

    def backward(model, seed):  # one model for every step, as in training: the compiled step guards on it
        model.zero_grad()
        model(torch.randn(7, 6, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()

    def fixed(model):
        s = clip_grad_norm_(model.named_parameters(), max_norm=0.5)
        return s.total_norm, s.clip_coef

    def adaptive(model, clip):
        s = clip.clip_(model.parameters())
        return s.total_norm, s.clip_coef

    cases = (("clip_grad_norm_", fixed, False), ("AdaptiveClip.clip_", adaptive, True))
    for (name, fn, with_clip), inference in [(c, i) for c in cases for i in (False, True)]:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        extra, eager_extra = ((AdaptiveClip(warmup=2),), (AdaptiveClip(warmup=2),)) if with_clip else ((), ())
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        eager_model = copy.deepcopy(model)
        for seed in range(4):
            backward(model, seed)
            backward(eager_model, seed)
            with torch.inference_mode(inference):
                want = fn(eager_model, *eager_extra)
                got = compiled(model, *extra)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=0, msg=name)
            for p, q in zip(model.parameters(), eager_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)
        assert counter.frame_count == 1, (name, inference, counter.frame_count)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_steps(n: int) -> list[tuple[float, float]]:
    norms, losses = sequence("mixed", n, seed=21), sequence("spikes", n, seed=22)
    return list(zip(norms, losses))


def _eager_decisions(steps, device):
    from torch_gradstats import AdaptiveClip

    guard, clip = SpikeGuard(window=16, sigma=3.0), AdaptiveClip(warmup=5)
    out = []
    for g, ell in steps:
        norm = torch.tensor(g, dtype=torch.float64, device=device)
        f = guard.observe(norm, torch.tensor(ell, device=device))
        out.append((f.item(), clip.threshold(norm).item()))
    return out


@cuda
def test_cuda_observe_threshold_clip_and_fused_step_never_sync():
    from torch_gradstats import AdaptiveClip, grad_stats, step_or_skip

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard, clip = SpikeGuard(window=8, sigma=3.0, device=device), AdaptiveClip(warmup=3, device=device)
    x = torch.randn(16, 64, device=device)
    model(x).square().mean().backward()
    optimizer.step()  # the optimizer's state is made outside the checked region
    grad_stats(model.parameters())  # and the op's metadata cache entry of this gradient list
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(12):
            optimizer.zero_grad()
            loss = model(x * (50.0 if step == 9 else 1.0)).square().mean()
            loss.backward()
            stats = clip.clip_(model.parameters())
            step_or_skip(optimizer, guard.observe(stats.total_norm, loss))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert guard.check()["guard/skipped"] >= 1.0  # the spike at step 9


@cuda
def test_cuda_graph_replay_decides_as_eager():
    from torch_gradstats import AdaptiveClip

    device = torch.device("cuda")
    steps = _cuda_steps(120)
    want = _eager_decisions(steps, device)
    guard, clip = SpikeGuard(window=16, sigma=3.0, device=device), AdaptiveClip(warmup=5, device=device)
    norm, loss = torch.zeros((), device=device, dtype=torch.float64), torch.zeros((), device=device)
    # Warm up on a side stream as torch.cuda.graph requires, on copies: the captured guard starts fresh.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        SpikeGuard(window=16, sigma=3.0, device=device).observe(norm, loss)
        AdaptiveClip(warmup=5, device=device).threshold(norm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        factor = guard.observe(norm, loss)
        threshold = clip.threshold(norm)
    got = []
    for g, ell in steps:
        norm.fill_(g)
        loss.fill_(ell)
        graph.replay()
        got.append((factor.item(), threshold.item()))
    assert [f for f, _ in got] == [f for f, _ in want]
    torch.testing.assert_close([t for _, t in got], [t for _, t in want], rtol=1e-12, atol=0)


@cuda
def test_cuda_reduce_overhead_decides_as_eager():
    from torch_gradstats import AdaptiveClip

    device = torch.device("cuda")
    steps = _cuda_steps(60)
    want = _eager_decisions(steps, device)
    torch._dynamo.reset()
    guard, clip = SpikeGuard(window=16, sigma=3.0, device=device), AdaptiveClip(warmup=5, device=device)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def decide(norm, loss):
        return guard.observe(norm, loss), clip.threshold(norm)

    got = []
    for g, ell in steps:
        torch.compiler.cudagraph_mark_step_begin()
        f, t = decide(torch.tensor(g, dtype=torch.float64, device=device), torch.tensor(ell, device=device))
        got.append((f.item(), t.item()))
    assert [f for f, _ in got] == [f for f, _ in want]
    torch.testing.assert_close([t for _, t in got], [t for _, t in want], rtol=1e-9, atol=0)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- distributed
@pytest.mark.distributed
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo"
)
def test_two_gloo_ranks_make_the_same_decisions_as_one_process(tmp_path):
    """The decision is a function of global figures: every rank of a group decides alike, as one process holding
    all the gradients does (spikes, a NaN in one rank's shard only, a loss spike)."""
    import json
    import socket
    import time

    import _guard_dist_worker as worker
    import torch.multiprocessing as mp

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(
        worker.run_worker, args=(2, port, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "the 2-rank run did not finish in 180 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ref = worker.run(worker.full_grads, lambda step: torch.tensor(worker.full_loss(step), dtype=torch.float64))
    for key in ranks[0]:
        got, other, want = (torch.tensor(r[key]) for r in (ranks[0], ranks[1], ref))
        torch.testing.assert_close(other, got, rtol=0, atol=0, equal_nan=True, msg=f"ranks differ in {key}")
        exact = key == "factor"
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-9, atol=0, equal_nan=True, msg=key)
    skipped = [i for i, f in enumerate(ref["factor"]) if f == 0.0]
    assert {25, 33, 41, 47} <= set(skipped), skipped


# ---------------------------------------------------------------------------------------------- the Trainer
def _trainer_setup(seed=0):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32 * 40, 6, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    return model, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


SPIKE_STEPS = {14: 1e3, 27: 1e4, 28: 1e4}


def _spike(step, model):
    for p in model.parameters():
        p.grad.mul_(SPIKE_STEPS.get(step, 1.0))


def test_trainer_with_guard_and_adaptive_clip_equals_the_plain_loop():
    from torch_gradstats import AdaptiveClip, Trainer, step_or_skip

    settings = {"window": 16, "sigma": 4.0}
    model, loader = _trainer_setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard, clip = SpikeGuard(**settings), AdaptiveClip(warmup=8)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, spike_guard=guard, adaptive_clip=clip,
        after_backward=lambda t: _spike(t.global_step, t.model), progress=False,
    )
    summary = trainer.train_epoch(loader)

    ref_model, _ = _trainer_setup()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ref_guard, ref_clip = SpikeGuard(**settings), AdaptiveClip(warmup=8)
    factors = []
    for step, (x, y) in enumerate(loader):
        ref_opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ref_model(x), y)
        loss.backward()
        _spike(step, ref_model)
        stats = ref_clip.clip_(ref_model.named_parameters())
        factor = ref_guard.observe(stats.total_norm, loss.detach().to(torch.float64))
        step_or_skip(ref_opt, factor)
        factors.append(factor.item())
    skipped = [i for i, f in enumerate(factors) if f == 0.0]
    assert set(SPIKE_STEPS) <= set(skipped)
    assert summary.skipped_steps == len(skipped) and trainer.global_step == 40
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    figures = trainer.policy_figures
    assert figures["guard/skipped"] == len(skipped)
    assert figures == {**ref_guard.check(), **ref_clip.figures()}


def test_trainer_raises_a_spike_streak_at_its_sync():
    from torch_gradstats import Trainer

    model, loader = _trainer_setup()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = SpikeGuard(window=16, sigma=4.0, max_consecutive=2)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, spike_guard=guard, sync_every=10,
        after_backward=lambda t: _spike(t.global_step, t.model), progress=False,
    )
    with pytest.raises(SpikeStreakError, match="2 steps in a row") as info:
        trainer.train_epoch(loader)
    assert info.value.step == 29  # steps 27 and 28 (0-based), 1-based in the guard; raised at the sync of step 30
    assert trainer.global_step == 30


def test_trainer_guard_with_a_grad_scaler_and_bad_arguments():
    from torch_gradstats import AdaptiveClip, Trainer

    model, loader = _trainer_setup()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, scaler=scaler, spike_guard=SpikeGuard(window=16, sigma=4.0),
        after_backward=lambda t: _spike(t.global_step, t.model), progress=False,
    )
    summary = trainer.train_epoch(loader)
    assert summary.skipped_steps >= 3 and scaler.get_scale() >= 2.0**4  # a guard's skip never shrinks the scale
    assert optimizer.state_dict()["state"][0]["step"].item() == 40 - summary.skipped_steps
    with pytest.raises(TypeError, match="spike_guard must be a SpikeGuard"):
        Trainer(model, optimizer, torch.nn.functional.mse_loss, spike_guard=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="adaptive_clip must be an AdaptiveClip"):
        Trainer(model, optimizer, torch.nn.functional.mse_loss, adaptive_clip=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_grad_norm or adaptive_clip, not both"):
        Trainer(model, optimizer, torch.nn.functional.mse_loss, max_grad_norm=1.0, adaptive_clip=AdaptiveClip())


def test_trainer_with_policies_reads_the_host_once_per_epoch(monkeypatch):
    """Guard, adaptive clip and the device-side skip add no host read: the epoch's one transfer carries their
    figures."""
    import torch_gradstats.training._trainer as trainer_mod
    from torch_gradstats import AdaptiveClip, Trainer

    model, loader = _trainer_setup()
    batches = list(loader)  # the DataLoader draws a seed with .item() when an epoch starts: not the trainer's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(
        model, optimizer, torch.nn.functional.mse_loss, spike_guard=SpikeGuard(window=16, sigma=4.0),
        adaptive_clip=AdaptiveClip(warmup=8), after_backward=lambda t: _spike(t.global_step, t.model),
        progress=False,
    )
    transfers = []
    real = trainer_mod.to_host
    monkeypatch.setattr(trainer_mod, "to_host", lambda *a, **k: transfers.append(1) or real(*a, **k))
    with HostReads() as mode:
        summary = trainer.train_epoch(batches)
    assert mode.count == 0 and len(transfers) == 1
    assert summary.skipped_steps >= 3 and trainer.policy_figures["guard/skipped"] == summary.skipped_steps


def test_bench_guard_runs():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_guard.py"
    spec = importlib.util.spec_from_file_location("_bench_guard", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--reps", "8", "--rounds", "2"]) == 0
    # name (20 columns), host us (9), launches (9): launches are what every contender but the optimizer makes
    contenders, policies = out.getvalue().split("\n\n")
    rows = {line[:20].strip(): (float(line[21:30]), int(line[31:40])) for line in contenders.splitlines()[2:]}
    assert set(rows) == {"grad_stats", "+ SpikeGuard", "+ AdaptiveClip", "AdaptiveClip.clip_", "clip_grad_norm_",
                         "+ OLMo list rule", "step_or_skip", "optimizer.step"}
    assert all(us > 0 for us, _ in rows.values())
    assert rows["+ SpikeGuard"][1] > rows["grad_stats"][1] > 0
    # each policy's own update: one launch with the compiled kernels, its fallback's ops without them
    alone = {line[:24].strip(): (float(line[25:34]), int(line[35:44])) for line in policies.splitlines()[1:]}
    assert set(alone) == {"SpikeGuard.observe", "AdaptiveClip.threshold", "NoiseScale.update"}
    for name, (us, launches) in alone.items():
        assert us > 0 and (launches == 1 if compiled_policy_ops() else launches > 3), name


def test_load_state_dict_keeps_a_compiled_step_valid():
    """Loading copies into the state tensors in place (same window): a compiled step keeps its graph and reads the
    loaded state."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_gradstats import AdaptiveClip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    guard, clip = SpikeGuard(window=8, sigma=2.0), AdaptiveClip(warmup=4)

    @torch.compile(fullgraph=True, backend=counter)
    def decide(norm):
        return guard.observe(norm), clip.threshold(norm)

    values = [_t(v) for v in sequence("spikes", 40, seed=31)]  # (a NaN 0-d CPU input would specialise the graph)
    for v in values[:20]:
        decide(v)
    compiled = counter.frame_count
    saved = (guard.state_dict(), clip.state_dict())
    first = [tuple(t.item() for t in decide(v)) for v in values[20:]]
    guard.load_state_dict(saved[0])
    clip.load_state_dict(saved[1])
    again = [tuple(t.item() for t in decide(v)) for v in values[20:]]
    assert again == first and counter.frame_count == compiled  # no recompile
    torch._dynamo.reset()
