"""Tests of torch_gradstats.training.Trainer (CPU only; fast)."""

from __future__ import annotations

import copy
import logging
import math
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats.ops.fallback
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.stats.health import HealthPolicy
from torch_gradstats.training import (
    Trainer,
    _compile,
    _device,
    _trainer,
    clear_compile_cache,
    format_epoch_table,
    validate_device,
)


def _mlp(seed: int = 0, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, out))


def _data(n: int = 40, seed: int = 1, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, out, (n,), generator=g) if out > 1 else torch.randn(n, 1, generator=g)
    return x, y


def _loader(x: torch.Tensor, y: torch.Tensor, bs: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=False)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _global_norm(model: nn.Module) -> float:
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _nan_at(step: int, param: str):
    def hook(trainer: Trainer) -> None:
        if trainer.global_step == step:
            dict(trainer.model.named_parameters())[param].grad.view(-1)[0] = float("nan")

    return hook


# ------------------------------------------------------------------------------------------ one sync per epoch
class _SyncCounter:
    """Counts every way a tensor's value can reach Python (each one is a host sync on an accelerator).

    Calls made by torch.utils.data are not counted: the DataLoader draws its worker seed with ``.item()`` on a CPU
    tensor when an epoch starts, which never touches the training device. The pure-PyTorch kernel is told it is
    on another device: on the CPU it reads a batch's min/max |x| (no sync there), elsewhere it reads nothing.
    """

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, orig))
        for owner, label in ((torch.cuda, "cuda.synchronize"), (torch.cuda.Event, "Event.synchronize")):
            monkeypatch.setattr(owner, "synchronize", self._wrap(label, owner.synchronize))
        monkeypatch.setattr(torch_gradstats.ops.fallback, "_branches_on_host", lambda device: False)

    def _wrap(self, name, orig):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "torch/utils/data" not in caller:
                self.calls.append(name)
            return orig(*args, **kwargs)

        return wrapper


#: What one transfer of torch_gradstats.ops._transfer costs on the CPU: a .cpu() (a no-op there), one numpy() read.
ONE_TRANSFER = ["cpu", "numpy"]


@pytest.mark.parametrize("fused_skip", [False, True])
def test_one_host_sync_per_epoch(monkeypatch, fused_skip):
    model = _mlp()
    x, y = _data(40)
    if fused_skip:  # skip_nonfinite on the device through fused Adam's found_inf: still no per-step sync
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        kwargs = {"skip_nonfinite": True, "after_backward": _nan_at(2, "2.bias")}
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kwargs = {}
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), progress=False, **kwargs)
    loader = _loader(x, y, 8)  # 5 steps per epoch
    counter = _SyncCounter(monkeypatch)
    summaries = trainer.fit(loader, epochs=3)
    monkeypatch.undo()
    assert counter.calls == ONE_TRANSFER * 3, counter.calls
    assert [s.steps for s in summaries] == [5, 5, 5]
    assert all(len(s.history) == 5 for s in summaries)
    if fused_skip:
        assert summaries[0].skipped_steps == 1 and summaries[0].first_nonfinite_param == "2.bias"


def test_one_host_sync_per_epoch_of_many_steps_with_a_flight_recorder(monkeypatch, tmp_path):
    """An epoch of 300 steps with a flight recorder keeps its rows to the epoch's one transfer: the read the callbacks
    make once 256 rows wait (a run that logs no step) is theirs, not the Trainer's."""
    model = _mlp()
    x, y = _data(300)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), progress=False,
                      flight_recorder=FlightRecorder(8, dump_dir=tmp_path))
    counter = _SyncCounter(monkeypatch)
    summary = trainer.train_epoch(_loader(x, y, 1))
    monkeypatch.undo()
    assert summary.steps == 300
    assert counter.calls == ONE_TRANSFER, counter.calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_sync_per_epoch_through_pinned_memory(monkeypatch):
    model = _mlp().cuda()
    x, y = _data(40)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, after_backward=_nan_at(2, "2.bias"),
                      progress=False)
    counter = _SyncCounter(monkeypatch)
    summaries = trainer.fit(_loader(x, y, 8), epochs=2)
    monkeypatch.undo()
    # Per epoch: one event wait after the non-blocking copy, then numpy() reads the pinned host buffer.
    assert counter.calls == ["Event.synchronize", "numpy"] * 2, counter.calls
    assert trainer._staging.tensor is not None and trainer._staging.tensor.is_pinned()
    assert summaries[0].skipped_steps == 1 and summaries[0].first_nonfinite_param == "2.bias"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sync_every_is_one_sync_per_interval(monkeypatch):
    model = _mlp()
    x, y = _data(56)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), sync_every=3, progress=False)
    counter = _SyncCounter(monkeypatch)
    summary = trainer.train_epoch(_loader(x, y, 8))  # 7 steps: syncs after 3, 6, and at the end
    monkeypatch.undo()
    assert counter.calls == ONE_TRANSFER * 3
    assert [r.step for r in summary.history] == list(range(7))  # no row lost or duplicated across syncs


# ------------------------------------------------------------------------------------------ aggregates
def test_epoch_aggregates_match_per_step_reference():
    model = _mlp()
    x, y = _data(48)
    ref_norms: list[float] = []

    def record(tr: Trainer) -> None:
        if tr.global_step == 3:
            tr.model[0].weight.grad[1, 2] = float("inf")
            tr.model[2].weight.grad[0, 0] = float("nan")
        ref_norms.append(_global_norm(tr.model))

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, after_backward=record,
                      progress=False)
    s = trainer.train_epoch(_loader(x, y, 8))
    finite = [n for n in ref_norms if math.isfinite(n)]
    assert s.steps == 6 and s.stats_steps == 6 and s.batches == 6 and s.samples == 48
    assert s.max_norm == pytest.approx(max(finite), rel=1e-6)
    assert s.mean_norm == pytest.approx(sum(finite) / len(finite), rel=1e-6)
    assert s.min_health == 0.0
    assert (s.nan_count, s.inf_count, s.nonfinite_steps, s.skipped_steps) == (1, 1, 1, 1)
    assert s.first_nonfinite_step == 3 and s.first_nonfinite_param == "0.weight"  # model order, not NaN-first
    for rec, ref in zip(s.history, ref_norms):
        if math.isfinite(ref):
            assert rec.total_norm == pytest.approx(ref, rel=1e-6)
        else:
            assert math.isnan(rec.total_norm) and rec.health == 0.0 and rec.skipped
    assert "step 3: 0.weight" in format_epoch_table([s])
    d = s.to_dict()
    assert d["first_nonfinite_param"] == "0.weight" and "history" not in d


def test_first_nonfinite_is_per_epoch_and_uses_that_steps_names():
    model = _mlp()
    x, y = _data(32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True,
                      after_backward=_nan_at(6, "2.weight"), progress=False)
    first, second = trainer.fit(_loader(x, y, 8), epochs=2)  # 4 steps per epoch: step 6 is in epoch 1
    assert first.first_nonfinite_step is None and first.first_nonfinite_param is None and first.nan_count == 0
    assert second.first_nonfinite_step == 6 and second.first_nonfinite_param == "2.weight"
    assert second.skipped_steps == 1 and first.min_health == 1.0


def test_stats_every_n_steps():
    model = _mlp()
    x, y = _data(56)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), stats_every=3, progress=False)
    s = trainer.train_epoch(_loader(x, y, 8))  # 7 optimizer steps
    assert s.steps == 7 and s.stats_steps == 3
    assert [r.step for r in s.history] == [0, 3, 6]


# ------------------------------------------------------------------------------------------ loss, accumulation
def test_loss_is_averaged_per_sample():
    model = _mlp(out=1)
    x, y = _data(10, out=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # frozen model: the epoch loss is a fixed number
    trainer = Trainer(model, opt, nn.MSELoss(), progress=False)
    s = trainer.train_epoch(_loader(x, y, 4))  # batches of 4, 4, 2
    with torch.no_grad():
        per_sample = ((model(x) - y) ** 2).squeeze(1)
        batch_means = [per_sample[i:i + 4].mean() for i in (0, 4, 8)]
    assert s.loss == pytest.approx(float(per_sample.mean()), rel=1e-6)
    assert s.loss != pytest.approx(float(torch.stack(batch_means).mean()), rel=1e-6)  # what per-batch would give
    assert s.samples == 10 and s.batches == 3


@pytest.mark.parametrize("bs,accum,steps", [(4, 3, 1), (2, 5, 1)])
def test_accumulation_equals_one_big_batch(bs, accum, steps):
    x, y = _data(10)
    runs = []
    for b, a in ((bs, accum), (10, 1)):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), accumulation_steps=a, progress=False)
        runs.append((trainer.train_epoch(_loader(x, y, b)), _params(model)))
    (acc, acc_params), (big, big_params) = runs
    assert acc.steps == steps and len(acc.history) == steps  # stats once per optimizer step
    assert acc.batches == math.ceil(10 / bs)
    assert acc.history[0].total_norm == pytest.approx(big.history[0].total_norm, rel=1e-5)
    assert acc.loss == pytest.approx(big.loss, rel=1e-6)
    for p, q in zip(acc_params, big_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_accumulation_short_last_window_weighted_per_sample():
    x, y = _data(10)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[float] = []
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), accumulation_steps=2, progress=False,
                      after_backward=lambda tr: seen.append(_global_norm(tr.model)))
    s = trainer.train_epoch(_loader(x, y, 4))  # windows [4, 4] and [2]
    assert s.steps == 2 and s.batches == 3
    # The last window's gradient is the mean over its own 2 samples, as if it were one batch of 2.
    ref = _mlp()
    ref.load_state_dict({k: v for k, v in zip(ref.state_dict(), _params_after_first_step(x, y))})
    nn.CrossEntropyLoss()(ref(x[8:]), y[8:]).backward()
    assert seen[1] == pytest.approx(_global_norm(ref), rel=1e-5)


def _params_after_first_step(x, y):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(model(x[:8]), y[:8]).backward()
    opt.step()
    return _params(model)


# ------------------------------------------------------------------------------------------ AMP
def _scaler(init_scale: float):
    try:
        return torch.amp.GradScaler("cpu", init_scale=init_scale)
    except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - torch without a CPU GradScaler
        pytest.skip("this torch has no CPU GradScaler")


def test_amp_stats_are_taken_after_unscale(monkeypatch):
    x, y = _data(32)
    order: list[str] = []
    results = []
    for scaler in (None, _scaler(2.0**12)):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if scaler is not None:
            orig_unscale = scaler.unscale_
            monkeypatch.setattr(scaler, "unscale_",
                                lambda o, f=orig_unscale: (order.append("unscale_"), f(o))[1])
            orig_stats = _trainer.grad_stats
            monkeypatch.setattr(_trainer, "grad_stats",
                                lambda p, f=orig_stats: (order.append("grad_stats"), f(p))[1])
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), scaler=scaler, progress=False)
        results.append(trainer.train_epoch(_loader(x, y, 8)))
    plain, amp = results
    assert order == ["unscale_", "grad_stats"] * 4
    # Same gradients, so the same norms: the loss scale (4096) does not leak into the stats.
    for a, b in zip(plain.history, amp.history):
        assert a.total_norm == pytest.approx(b.total_norm, rel=1e-5)
    assert amp.skipped_steps == 0


def test_amp_nonfinite_step_is_skipped_by_scaler_and_counted():
    x, y = _data(32)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = _scaler(2.0**8)
    snapshots: dict[int, list[torch.Tensor]] = {}

    def hook(tr: Trainer) -> None:
        snapshots[tr.global_step] = _params(tr.model)
        if tr.global_step == 1:
            tr.model[0].bias.grad[0] = float("inf")

    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), scaler=scaler, after_backward=hook, progress=False)
    s = trainer.train_epoch(_loader(x, y, 8))
    assert s.skipped_steps == 1 and s.inf_count == 1 and s.first_nonfinite_param == "0.bias"
    for p, q in zip(snapshots[1], snapshots[2]):  # step 1 did not move the parameters
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert scaler.get_scale() == 2.0**7  # the scaler backed off once


def test_autocast_bf16_runs_on_cpu():
    x, y = _data(16)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    s = Trainer(model, opt, nn.CrossEntropyLoss(), amp_dtype=torch.bfloat16, progress=False).train_epoch(
        _loader(x, y, 8))
    assert s.steps == 2 and s.max_norm is not None and math.isfinite(s.max_norm)


# ------------------------------------------------------------------------------------------ skip on non-finite
@pytest.mark.parametrize("fused", [True, False])
def test_skip_nonfinite_equals_dropping_the_step(caplog, fused):
    x, y = _data(24)
    finals = []
    for data, hook in (((x, y), _nan_at(1, "0.weight")), ((torch.cat([x[:8], x[16:]]), torch.cat([y[:8], y[16:]])),
                                                          None)):
        model = _mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, after_backward=hook,
                              progress=False)
        s = trainer.train_epoch(_loader(*data, 8))
        finals.append((s, _params(model)))
    (skipped, p_skip), (dropped, p_drop) = finals
    assert skipped.skipped_steps == 1 and dropped.skipped_steps == 0
    assert skipped.first_nonfinite_step == 1 and skipped.first_nonfinite_param == "0.weight"
    assert [r.skipped for r in skipped.history] == [False, True, False]
    for p, q in zip(p_skip, p_drop):  # Adam's step count and moments untouched by the skipped step
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    warned = any("host sync per optimizer step" in r.getMessage() for r in caplog.records)
    assert warned == (not fused)


def test_a_step_with_a_nan_loss_leaves_the_epoch_loss_finite():
    """A NaN input in one batch makes that step's loss NaN (skipped by skip_nonfinite): the epoch's loss is the
    per-sample mean over the other steps, and the step is counted in nonfinite_loss_steps (one NaN made the whole
    epoch's loss NaN, which hid the loss of every other step)."""
    x, y = _data(20)
    x[9, 2] = float("nan")  # in the second batch of 8
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, progress=False).train_epoch(_loader(x, y, 8))
    losses = [r.loss for r in s.history]
    assert math.isnan(losses[1]) and all(math.isfinite(v) for v in (losses[0], losses[2]))
    assert s.skipped_steps == 1 and s.nonfinite_loss_steps == 1 and s.samples == 20
    assert s.loss == pytest.approx((8 * losses[0] + 4 * losses[2]) / 12, rel=1e-12)
    assert s.to_dict()["nonfinite_loss_steps"] == 1


def test_without_skip_nan_reaches_the_parameters():
    x, y = _data(24)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Trainer(model, opt, nn.CrossEntropyLoss(), after_backward=_nan_at(1, "0.weight"),
                progress=False).train_epoch(_loader(x, y, 8))
    assert s.skipped_steps == 0 and s.first_nonfinite_step == 1
    assert torch.isnan(model[0].weight).any()


# ------------------------------------------------------------------------------------------ clipping
def test_max_grad_norm_clips_like_torch():
    x, y = _data(24)
    finals = []
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    s = Trainer(model, opt, nn.CrossEntropyLoss(), max_grad_norm=0.1, progress=False).train_epoch(_loader(x, y, 8))
    finals.append(_params(model))
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    pre_clip = []
    for i in range(0, 24, 8):
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(ref(x[i:i + 8]), y[i:i + 8]).backward()
        pre_clip.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)))
        ref_opt.step()
    for p, q in zip(finals[0], _params(ref)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [r.total_norm for r in s.history] == pytest.approx(pre_clip, rel=1e-5)  # stats are pre-clip


# ------------------------------------------------------------------------------------------ errors
def test_empty_loader_is_a_clear_error():
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), progress=False)
    empty = DataLoader(TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match="empty"):
        trainer.train_epoch(empty)
    with pytest.raises(ValueError, match="no batches"):
        trainer.train_epoch(b for b in [])  # no len(): detected after iterating
    assert trainer.global_step == 0


@pytest.mark.parametrize("device,match", [("cuda:5", "CUDA"), ("gpu0", "invalid device"), (None, None)])
def test_bad_device_fails_up_front(device, match):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if device is None:  # default: the model's device
        assert Trainer(model, opt, nn.CrossEntropyLoss()).device == torch.device("cpu")
        return
    if device.startswith("cuda") and torch.cuda.device_count() > 5:  # pragma: no cover
        pytest.skip("this machine has a cuda:5")
    with pytest.raises(ValueError, match=match):
        Trainer(model, opt, nn.CrossEntropyLoss(), device=device)


def test_validate_device():
    assert validate_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="invalid device"):
        validate_device("not-a-device")
    with pytest.raises(ValueError, match="None"):
        validate_device(None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            validate_device("cuda")


def test_model_on_other_device_is_named():
    model = _mlp().to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'0.weight' is on meta"):
        Trainer(model, opt, nn.CrossEntropyLoss(), device="cpu")


def test_an_optimizer_or_loss_fn_that_cannot_train_the_model_is_refused_up_front():
    """Mistakes that used to surface only at the first step (``'NoneType' object is not callable``), or never: an
    optimizer built over another model's parameters trained nothing, silently."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        Trainer(model, opt, None)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got StepLR"):
        Trainer(model, torch.optim.lr_scheduler.StepLR(opt, 1), nn.CrossEntropyLoss())
    other = _mlp()
    with pytest.raises(ValueError, match="optimizer holds none of the model's parameters"):
        Trainer(model, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss())
    head_only = torch.optim.SGD(model[-1].parameters(), lr=0.1)  # a part of the model is fine
    assert Trainer(model, head_only, nn.CrossEntropyLoss(), progress=False).optimizer is head_only


def test_bad_arguments_and_batches():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="stats_every"):
        Trainer(model, opt, nn.CrossEntropyLoss(), stats_every=0)
    with pytest.raises(ValueError, match="accumulation_steps"):
        Trainer(model, opt, nn.CrossEntropyLoss(), accumulation_steps=0)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(TypeError, match=r"batch 0 is a Tensor; expected an \(inputs, targets\) pair"):
        trainer.train_epoch([torch.zeros(2, 6)])
    bad_loss = Trainer(model, opt, nn.CrossEntropyLoss(reduction="none"), progress=False)
    x, y = _data(8)
    with pytest.raises(ValueError, match="0-d"):
        bad_loss.train_epoch(_loader(x, y, 4))


# ------------------------------------------------------------------------------------------ compile
def test_compiled_step_matches_eager_and_is_cached_per_architecture():
    clear_compile_cache()
    x, y = _data(16)
    results = []
    for compiled in (False, True, True):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), compile=compiled, compile_backend="eager",
                          progress=False)
        results.append((trainer.train_epoch(_loader(x, y, 8)), _params(model)))
    assert len(_compile.COMPILE_CACHE) == 1  # two instances of one architecture share an entry
    for s, params in results[1:]:
        assert s.loss == pytest.approx(results[0][0].loss, rel=1e-6)
        for p, q in zip(params, results[0][1]):
            torch.testing.assert_close(p, q)
    other = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))  # another architecture: another entry
    Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss(), compile=True,
            compile_backend="eager", progress=False).train_epoch(_loader(x, y, 8))
    assert len(_compile.COMPILE_CACHE) == 2
    assert not any(e.failed for e in _compile.COMPILE_CACHE.values())
    clear_compile_cache()


def test_compile_failure_warns_and_falls_back(caplog):
    clear_compile_cache()

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded on purpose")

    x, y = _data(16)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), compile=True, compile_backend=broken_backend,
                      progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        s = trainer.train_epoch(_loader(x, y, 8))
    warnings = [r.getMessage() for r in caplog.records if "compiled train step failed" in r.getMessage()]
    assert len(warnings) == 1 and "eager" in warnings[0]  # logged once, not silent, not per step
    ref = _mlp()
    s_ref = Trainer(ref, torch.optim.SGD(ref.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    progress=False).train_epoch(_loader(x, y, 8))
    assert s.loss == pytest.approx(s_ref.loss, rel=1e-6) and s.steps == 2
    clear_compile_cache()


# ------------------------------------------------------------------------------------------ progress bar
def test_works_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm...` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = _data(16)
    model = _mlp()
    s = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                progress=True).train_epoch(_loader(x, y, 8))
    assert s.steps == 2


def test_progress_auto_is_off_when_not_a_tty_and_on_when_asked(capsys):
    pytest.importorskip("tqdm")
    x, y = _data(16)
    for progress in (None, True):
        model = _mlp()
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                progress=progress).train_epoch(_loader(x, y, 8))
        err = capsys.readouterr().err
        if progress is None:  # pytest captures stderr: not a terminal
            assert "epoch 0" not in err
        else:
            assert "epoch 0" in err


# ------------------------------------------------------------------------------------------ review follow-ups
def test_skip_at_first_step_with_fused_sgd_momentum_keeps_the_model_finite():
    """Fused SGD allocates its momentum buffers uninitialised on its first step; a device-side skip of that step
    would leave garbage in them. The first step is decided on the host until the buffers exist."""
    x, y = _data(24)
    finals = []
    for data, hook in (((x, y), _nan_at(0, "0.weight")), ((x[8:], y[8:]), None)):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, after_backward=hook,
                          progress=False)
        s = trainer.train_epoch(_loader(*data, 8))
        finals.append((s, _params(model), opt))
    (skipped, p_skip, opt_skip), (_, p_drop, opt_drop) = finals
    assert skipped.skipped_steps == 1 and skipped.first_nonfinite_step == 0
    # The skipped step left no trace: later steps are the dropped run's, bit for bit.
    for p, q in zip(p_skip, p_drop):
        assert torch.equal(p, q)
    buffers_skip = [st["momentum_buffer"] for st in opt_skip.state.values()]
    buffers_drop = [st["momentum_buffer"] for st in opt_drop.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(buffers_skip, buffers_drop))


def test_skip_at_first_step_of_a_param_group_added_later_keeps_fused_sgd_momentum_finite():
    """A param group added mid-run (layers unfrozen) has no momentum buffers until its first step, which fused SGD
    allocates uninitialised: a device-side skip of that step left garbage in them and the next step moved the
    weights by ~1e14. The check that the buffers exist is made again when the param groups change."""
    x, y = _data(32)
    model = _mlp()
    head = model[2]
    for p in head.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9, fused=True)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, progress=False,
                      after_backward=_nan_at(2, "0.weight"))
    trainer.train_epoch(_loader(x[:16], y[:16], 8))  # two steps: the first group's buffers exist
    for p in head.parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(head.parameters())})
    s = trainer.train_epoch(_loader(x[16:24], y[16:24], 8))  # the group's first step (global step 2): skipped
    assert s.skipped_steps == 1
    # Skipped without a step: no buffer was made (a device-side skip made them with empty_like, left unwritten).
    assert all("momentum_buffer" not in opt.state.get(p, {}) for p in head.parameters())
    before = [p.detach().clone() for p in head.parameters()]
    trainer.train_epoch(_loader(x[24:], y[24:], 8))  # the group's first step taken: buffer = grad
    for p, b in zip(head.parameters(), before):
        assert torch.equal(opt.state[p]["momentum_buffer"], p.grad)
        assert torch.allclose(p.detach(), b - 0.05 * p.grad)


def test_skip_after_a_rollback_to_an_optimizer_state_without_momentum_buffers_keeps_fused_sgd_finite():
    """A rollback to a checkpoint saved before the first step (optimizer.load_state_dict of an empty state) removes
    the momentum buffers; the first skipped step after it was skipped on the device, leaving the buffers fused SGD
    made with empty_like unwritten (the weights reached ~2e9 two steps later)."""
    x, y = _data(32)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), skip_nonfinite=True, progress=False,
                      after_backward=_nan_at(2, "0.weight"))
    trainer.train_epoch(_loader(x[:16], y[:16], 8))  # two steps: the buffers exist
    model.load_state_dict(start[0])
    opt.load_state_dict(start[1])  # the rollback: no buffers
    s = trainer.train_epoch(_loader(x[16:24], y[16:24], 8))  # global step 2: skipped
    assert s.skipped_steps == 1 and all("momentum_buffer" not in opt.state.get(p, {}) for p in model.parameters())
    before = _params(model)
    trainer.train_epoch(_loader(x[24:], y[24:], 8))  # the first step after the rollback: buffer = grad
    for p, b in zip(model.parameters(), before):
        assert torch.equal(opt.state[p]["momentum_buffer"], p.grad)
        assert torch.allclose(p.detach(), b - 0.05 * p.grad)


def test_a_disabled_grad_scaler_warns_of_the_host_sync_as_no_scaler_would(caplog):
    """skip_nonfinite with a non-fused optimizer reads each step's flag on the host; the warning saying so was left
    out whenever a scaler was given, a disabled one (which skips nothing itself) included."""
    model = _mlp()
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), scaler=scaler,
                    skip_nonfinite=True, progress=False)
        warned = any("costs one host sync per optimizer step" in r.getMessage() for r in caplog.records)
        assert warned == (scaler is None or not scaler.is_enabled())


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_a_disabled_grad_scaler_skips_as_no_scaler_would(skip_nonfinite):
    """GradScaler(enabled=False) (the usual `enabled=use_amp`) steps the optimizer whatever the gradients: an Inf step
    was counted and warned as skipped while it was taken, and skip_nonfinite was ignored (the weights went Inf)."""
    x, y = _data(32)
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", enabled=False)):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = Trainer(model, opt, nn.CrossEntropyLoss(), scaler=scaler, skip_nonfinite=skip_nonfinite,
                          after_backward=_nan_at(1, "0.weight"), progress=False)
        s = trainer.train_epoch(_loader(x, y, 8))
        runs.append((s.skipped_steps, s.first_nonfinite_step, _params(model)))
    (skipped, first, params), (skipped_d, first_d, params_d) = runs
    assert (skipped_d, first_d) == (skipped, first) == (int(skip_nonfinite), 1)
    assert all(torch.isfinite(p).all() for p in params_d) == skip_nonfinite
    for p, q in zip(params, params_d):
        assert torch.equal(p.nan_to_num(), q.nan_to_num())


def test_a_loss_that_does_not_require_grad_is_named():
    """A model whose parameters are all frozen failed in backward() with torch's 'element 0 of tensors does not
    require grad and does not have a grad_fn', which names neither the frozen model nor the loss."""
    x, y = _data(16)
    model = _mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    before = _params(model)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(ValueError, match="every parameter of the model is frozen"):
        trainer.train_epoch(_loader(x, y, 8))
    assert trainer.global_step == 0 and all(torch.equal(p, q) for p, q in zip(_params(model), before))
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      lambda out, target: nn.functional.cross_entropy(out.detach(), target), progress=False)
    with pytest.raises(ValueError, match="does not depend on a parameter that requires grad"):
        trainer.train_epoch(_loader(x, y, 8))
    assert trainer.global_step == 0


def test_each_architecture_compiles_under_its_own_recompile_limit():
    """Architectures used to share one code object, hence dynamo's recompile limit, then ran eagerly unannounced."""
    from torch._dynamo.testing import CompileCounter

    clear_compile_cache()
    torch._dynamo.reset()
    counter = CompileCounter()
    x, y = _data(8)
    n_arch = torch._dynamo.config.recompile_limit + 2
    for width in range(1, n_arch + 1):
        model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), compile=True,
                compile_backend=counter, progress=False).train_epoch(_loader(x, y, 8))
    assert counter.frame_count == n_arch
    clear_compile_cache()


def test_a_users_error_does_not_turn_compilation_off():
    clear_compile_cache()
    x, y = _data(16)
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), compile=True,
                      compile_backend="eager", progress=False)
    with pytest.raises(RuntimeError):
        trainer.train_epoch(_loader(torch.randn(16, 5), y, 8))  # wrong input width: the user's error
    trainer.train_epoch(_loader(x, y, 8))
    assert not any(e.failed for e in _compile.COMPILE_CACHE.values())
    clear_compile_cache()


def test_empty_micro_batch_in_an_accumulation_window_is_ignored():
    x, y = _data(8)
    batches = [(x[:4], y[:4]), (x[:0], y[:0]), (x[4:], y[4:]), (x[4:], y[4:])]
    model = _mlp()
    s = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), accumulation_steps=2,
                progress=False).train_epoch(batches)
    assert math.isfinite(s.loss) and s.steps == 2


def test_batch_size_is_read_inside_dict_inputs():
    assert _device.batch_size({"a": 1, "x": torch.zeros(5, 2), "b": 2}, torch.tensor(0.5)) == 5
    assert _device.batch_size((torch.tensor(1.0), [torch.zeros(7)]), torch.tensor(0.5)) == 7


# ------------------------------------------------------------------------------------------ empty batches
@pytest.mark.parametrize("accum", [1, 2])
def test_an_empty_batch_is_counted_and_skipped(accum):
    """One empty batch used to abort the whole epoch when accumulation_steps=1 (and a window of empty batches
    did with more); it is now counted as a batch and makes no optimizer step."""
    x, y = _data(32)
    empty = (x[:0], y[:0])
    full = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    with_empty = full[:2] + [empty] * accum + full[2:]  # a whole window of empty batches
    runs = []
    for batches in (with_empty, full):
        model = _mlp()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                          accumulation_steps=accum, progress=False)
        runs.append((trainer.train_epoch(batches), _params(model), trainer))
    (s, p, trainer), (s_ref, p_ref, _) = runs
    assert s.batches == len(with_empty) and s.samples == 32
    assert s.steps == s_ref.steps == 4 // accum and trainer.global_step == s.steps
    assert s.loss == s_ref.loss
    for a, b in zip(p, p_ref):
        assert torch.equal(a, b)


def test_only_empty_batches_is_a_clear_error():
    x, y = _data(8)
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), progress=False)
    with pytest.raises(ValueError, match="only empty batches"):
        trainer.train_epoch([(x[:0], y[:0])] * 3)
    assert trainer.global_step == 0


# ------------------------------------------------------------------------------------------ interrupts
def _adam_steps(opt: torch.optim.Optimizer) -> set[int]:
    return {int(st["step"]) for st in opt.state.values()}


class _Interrupt:
    """Raises KeyboardInterrupt the ``at``-th time it is called (0-based), once."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.at + 1:
            raise KeyboardInterrupt


class _InterruptingPolicy(HealthPolicy):
    """A health policy whose score raises KeyboardInterrupt once: an interrupt after the optimizer step."""

    def __init__(self, at: int) -> None:
        super().__init__()
        object.__setattr__(self, "_interrupt", _Interrupt(at))

    def score(self, norms):
        self._interrupt()
        return super().score(norms)


INTERRUPT_POINTS = ["loss_fn", "after_backward", "step_pre_hook", "step_post_hook", "after_the_step"]


@pytest.mark.parametrize("policy", ["plain", "device_skip", "host_skip"])
@pytest.mark.parametrize("point", INTERRUPT_POINTS)
def test_global_step_agrees_with_the_optimizer_after_an_interrupt(point, policy):
    """A KeyboardInterrupt once left global_step one behind the optimizer's step count."""
    x, y = _data(40)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=policy == "device_skip")
    interrupt = _Interrupt(at=2)
    loss = nn.CrossEntropyLoss()
    kwargs: dict = {"skip_nonfinite": policy != "plain"}
    if point == "loss_fn":
        kwargs["loss_fn"] = lambda out, target: (interrupt(), loss(out, target))[1]
    if point == "after_backward":
        kwargs["after_backward"] = interrupt
    if point == "after_the_step":
        kwargs["health_policy"] = _InterruptingPolicy(at=2)
    trainer = Trainer(model, opt, kwargs.pop("loss_fn", loss), progress=False, **kwargs)
    if point == "step_pre_hook":
        opt.register_step_pre_hook(interrupt)
    if point == "step_post_hook":
        opt.register_step_post_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_epoch(_loader(x, y, 8))
    taken = 3 if point in ("step_post_hook", "after_the_step") else 2  # was the third step taken?
    assert _adam_steps(opt) == {taken}
    assert trainer.global_step == taken
    s = trainer.train_epoch(_loader(x, y, 8))  # and training goes on from there
    assert s.steps == 5 and _adam_steps(opt) == {taken + 5} and trainer.global_step == taken + 5
    assert [r.step for r in s.history] == list(range(taken, taken + 5))


def test_global_step_counts_a_step_the_scaler_skips_and_one_interrupted_after_it():
    x, y = _data(40)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = _scaler(2.0**8)
    interrupt = _Interrupt(at=3)
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), scaler=scaler, after_backward=_nan_at(1, "2.bias"),
                      progress=False)
    opt.register_step_post_hook(interrupt)  # the optimizer's 4th real step is the trainer's 5th
    with pytest.raises(KeyboardInterrupt):
        trainer.train_epoch(_loader(x, y, 8))
    assert _adam_steps(opt) == {4}  # step 1 was skipped by the scaler
    assert trainer.global_step == 5  # ... and counted


def test_only_fused_optimizers_skip_on_the_device():
    from torch_gradstats.training._step import device_skip_step

    model = _mlp()
    assert device_skip_step(torch.optim.Adam(model.parameters(), fused=True)) is not None
    assert device_skip_step(torch.optim.Adam(model.parameters())) is None
    assert device_skip_step(torch.optim.SGD(model.parameters(), lr=0.1)) is None


def test_global_step_can_be_set_when_resuming():
    x, y = _data(16)
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), progress=False)
    trainer.global_step = 100
    s = trainer.train_epoch(_loader(x, y, 8))
    assert trainer.global_step == 102 and [r.step for r in s.history] == [100, 101]
    with pytest.raises(ValueError, match="global_step"):
        trainer.global_step = -1


@pytest.mark.parametrize("bad, error", [(True, TypeError), (0, ValueError), (-1, ValueError), (2.0, TypeError),
                                        ("3", TypeError)])  # fmt: skip
def test_sync_every_must_be_a_positive_int(bad: object, error: type[Exception]) -> None:
    model = _mlp()
    with pytest.raises(error, match="sync_every"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), sync_every=bad)  # type: ignore[arg-type]
