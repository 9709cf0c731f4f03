"""The policies refuse what they cannot act on (window 1, impossible states, a negative max_norm), report every value
of a streak, measure a micro-batch whatever its backward calls, and every integration names the first non-finite
parameter of a step it skipped."""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats as tg
from torch_gradstats import AdaptiveClip, NoiseScale, SpikeGuard, SpikeStreakError, clip_grad_norm_

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NAN = math.nan


def _t(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- SpikeGuard
def test_a_streak_of_nan_losses_reports_the_loss():
    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=3)
    for i in range(8):
        guard.observe(_t(1.0 + 0.01 * (i % 2)), _t(2.0))
    for _ in range(3):  # the norm stays inside its band: only the loss says why
        assert guard.observe(_t(1.0), _t(NAN)).item() == 0.0
    with pytest.raises(SpikeStreakError, match=r"loss nan") as info:
        guard.check()
    assert set(info.value.values) == {"grad_norm", "loss"} and math.isnan(info.value.values["loss"])
    assert info.value.values["grad_norm"] == 1.0 and set(info.value.bands) == {"grad_norm", "loss"}


def test_a_streak_without_a_loss_reports_the_norm_alone():
    guard = SpikeGuard(window=8, sigma=3.0, max_consecutive=2, watch_loss=False)
    for i in range(8):
        guard.observe(_t(1.0 + 0.01 * (i % 2)), _t(2.0))
    for _ in range(2):
        guard.observe(_t(NAN), _t(2.0))
    with pytest.raises(SpikeStreakError) as info:
        guard.check()
    assert set(info.value.values) == {"grad_norm"}


def test_window_one_is_refused():
    with pytest.raises(ValueError, match="window must be >= 2"):
        SpikeGuard(window=1)


# ---------------------------------------------------------------------------------------------- impossible states
def _clip_state() -> dict[str, Any]:
    clip = AdaptiveClip(warmup=4)
    for v in (1.0, 1.1, 0.9, 1.05, 1.0, 1.2):
        clip.threshold(_t(v))
    return clip.state_dict()


@pytest.mark.parametrize("change,words", [
    (lambda s: s["ema"].__setitem__(0, NAN), "EMA mean"),
    (lambda s: s["ema"].__setitem__(1, math.inf), "EMA variance"),
    (lambda s: s["ema"].__setitem__(1, -1.0), "EMA variance"),
    (lambda s: s["warmup_norms"].__setitem__(2, math.inf), "warm-up norms"),
    (lambda s: s["warmup_norms"].__setitem__(0, NAN), "warm-up norms"),
    (lambda s: s["count"].__setitem__(0, 5), "'count' .the warm-up norms collected"),
    (lambda s: s["count"].__setitem__(0, -1), "'count' .the warm-up norms collected"),
], ids=["nan_mean", "inf_var", "negative_var", "inf_warmup", "nan_warmup", "count_high", "count_negative"])
def test_adaptive_clip_refuses_impossible_states(change, words):
    state = _clip_state()
    change(state)
    with pytest.raises(ValueError, match=words):
        AdaptiveClip().load_state_dict(state)
    AdaptiveClip().load_state_dict(_clip_state())  # a real one loads


def _noise_state() -> dict[str, Any]:
    ns = NoiseScale(4)
    for small, big in ((2.0, 1.0), (2.2, 1.1), (1.9, 0.9)):
        ns.update(small, big, big_batch_size=16)
    return ns.state_dict()


@pytest.mark.parametrize("key,value,words", [
    ("grad_sq_ema", NAN, "grad_sq_ema .the EMA of \\|G\\|\\^2. must be finite"),
    ("trace_sigma_ema", math.inf, "trace_sigma_ema .the EMA of tr.Sigma.. must be finite"),
    ("weight", NAN, "weight .the EMAs' bias correction. must be finite"),
    ("weight", -0.1, "weight .the EMAs' bias correction, 1 - ema..steps folded in. must be in"),
    ("weight", 0.5, "must be in \\[0, 0.0297"),  # 3 steps of ema 0.99 weigh at most 1 - 0.99**3
])
def test_noise_scale_refuses_impossible_states(key, value, words):
    state = _noise_state()
    state[key] = torch.tensor(value, dtype=torch.float64)
    with pytest.raises(ValueError, match=words):
        NoiseScale(4).load_state_dict(state)
    NoiseScale(4).load_state_dict(_noise_state())


# ---------------------------------------------------------------------------------------------- negative max_norm
def _grads() -> list[torch.Tensor]:
    p = torch.ones(5, requires_grad=True)
    p.grad = torch.full((5,), 2.0)
    return [p]


@pytest.mark.parametrize("max_norm", [-1.0, NAN, torch.tensor(-1.0), torch.tensor(NAN, dtype=torch.float64)],
                         ids=["float", "nan", "cpu_tensor", "cpu_tensor_nan"])
def test_clip_grad_norm_refuses_a_negative_max_norm(max_norm):
    params = _grads()
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        clip_grad_norm_(params, max_norm)
    assert torch.equal(params[0].grad, torch.full((5,), 2.0))  # untouched
    assert clip_grad_norm_(params, 0.0).clip_coef.item() == 0.0  # zero stays allowed, as in PyTorch


def test_adaptive_clip_refuses_a_negative_max_norm():
    with pytest.raises(ValueError, match="max_norm must be finite, > 0"):
        AdaptiveClip(max_norm=-1.0)


# ---------------------------------------------------------------------------------------------- micro_batch
def test_micro_batch_measures_the_block_gradient_whatever_its_backward_calls():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    x, y = torch.randn(32, 6), torch.randn(32, 3)

    def run(split: bool) -> tuple[float, float]:
        ns = NoiseScale(8)
        for p in model.parameters():
            p.grad = None
        for k in range(4):  # four micro-batches of 8 samples, each of mean loss / 4
            xb, yb = x[8 * k : 8 * k + 8], y[8 * k : 8 * k + 8]
            with ns.micro_batch(model):
                if split:  # the same micro-batch in two backward calls of 4 samples each
                    for h in (0, 4):
                        (nn.functional.mse_loss(model(xb[h : h + 4]), yb[h : h + 4]) / 8).backward()
                else:
                    (nn.functional.mse_loss(model(xb), yb) / 4).backward()
        ns.step(model)
        return ns.grad_sq.item(), ns.trace_sigma.item()

    whole, split = run(False), run(True)
    assert split == pytest.approx(whole, rel=1e-5)  # float32 gradients summed in another order
    assert whole[0] > 0 and whole[1] > 0


# ---------------------------------------------------------------------------------------------- the warnings
def _nan_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "torch_gradstats" and r.levelno == logging.WARNING and "non-finite gradient" in r.getMessage()]


@pytest.mark.parametrize("fused", [True, False], ids=["device", "host"])
def test_trainer_names_the_first_nonfinite_parameter_of_a_skipped_step(fused: bool,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    y[40:48] = NAN  # batch 5: a NaN loss, NaN gradients
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused) if fused else torch.optim.SGD(
        model.parameters(), lr=1e-2)
    trainer = tg.Trainer(model, opt, nn.functional.mse_loss, spike_guard=SpikeGuard(window=8, sigma=1e6, min_history=2),
                         progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        summary = trainer.train_epoch(DataLoader(TensorDataset(x, y), batch_size=8))
    assert summary.skipped_steps == 1
    said = _nan_messages(caplog)
    assert len(said) == 1 and "optimizer step 5" in said[0] and "'0.weight'" in said[0], said


def _lightning() -> Any:
    return pytest.importorskip("lightning.pytorch")


@pytest.mark.parametrize("fused", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("on_nonfinite", [None, "skip"])
def test_lightning_names_the_first_nonfinite_parameter_of_a_skipped_step(
        tmp_path: Path, fused: bool, on_nonfinite: str | None, caplog: pytest.LogCaptureFixture) -> None:
    _lightning()
    from test_integrations_policies import Tiny, _fit, _guard

    from torch_gradstats.integrations.lightning import GradStatsCallback

    class NanAt(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * NAN if self.trainer.global_step == 6 else loss

    cb = GradStatsCallback(spike_guard=_guard(), on_nonfinite=on_nonfinite)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(NanAt(fused=fused, spike_at=None), [cb], tmp_path, log_every_n_steps=5)
    said = _nan_messages(caplog)
    assert len(said) == 1 and "optimizer step 6" in said[0] and "'net.0.weight'" in said[0], said


@pytest.mark.parametrize("fused", [True, False], ids=["device", "host"])
def test_hf_names_the_first_nonfinite_parameter_of_a_skipped_step(tmp_path: Path, fused: bool,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from test_integrations_policies import _gpt2, _guard, _hf_args, _hf_train, _tokens

    from torch_gradstats.integrations.transformers import GradStatsCallback as HFCallback
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = _gpt2()

    class NanAt(transformers.TrainerCallback):
        active = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.active = state.global_step == 6

    nan_at = NanAt()

    def hook(module: Any, args: Any, output: Any) -> Any:
        if nan_at.active and module.training:
            output.loss = output.loss * NAN
        return output

    model.register_forward_hook(hook)
    cb = HFCallback(spike_guard=_guard())
    opt = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused))
    trainer = transformers.Trainer(model=model, args=_hf_args(tmp_path, logging_steps=4), train_dataset=_tokens(),
                                   callbacks=[nan_at], optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_train(trainer)
    said = _nan_messages(caplog)
    assert len(said) == 1 and "optimizer step 6" in said[0] and "'transformer.wte.weight'" in said[0], said


# ---------------------------------------------------------------------------------------------- with a GradScaler
def test_the_plain_loop_with_a_grad_scaler_judges_unscaled_norms():
    """docs/guard.md's recipe: unscale_ before the policies, so a scale that doubles every few steps is no spike."""

    def run(scaled: bool) -> tuple[list[float], float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3, enabled=scaled)
        guard, clipper = SpikeGuard(window=8, sigma=3.0), AdaptiveClip(warmup=4)
        x, y = torch.randn(256, 8), torch.randn(256, 1)
        norms = []
        for step in range(30):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x[8 * step : 8 * step + 8]), y[8 * step : 8 * step + 8])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            stats = clipper.clip_(model.parameters())
            tg.step_or_skip(optimizer, guard.observe(stats.total_norm, loss), scaler)
            norms.append(stats.total_norm.item())
        return norms, guard.check()["guard/skipped"]

    plain, scaled = run(False), run(True)
    assert scaled[0] == pytest.approx(plain[0], rel=1e-5) and scaled[1] == plain[1]  # the same norms and decisions
