"""Hugging Face Trainer callback, with real ``transformers.Trainer`` runs of a tiny GPT-2 built from a local config
(no download). Reference figures come from the Trainer itself (its logged pre-clip ``grad_norm``) and from the
gradients ``torch.nn.utils.clip_grad_norm_`` receives when the Trainer clips (recorded, then passed on unchanged).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("accelerate")  # transformers.Trainer needs it
transformers = pytest.importorskip("transformers")

from _host_reads import instrument
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from torch_gradstats.integrations._hf_steps import unscaled
from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

POISONED = "transformer.h.1.mlp.c_fc.weight"



def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _data(n: int = 64) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


class Poison(TrainerCallback):
    """Makes one parameter's gradient NaN during optimizer step ``at`` (0-based), through a tensor hook, and keeps
    the weights before and after each step."""

    def __init__(self, model: GPT2LMHeadModel, at: int | None) -> None:
        self.at = at
        self.active = False
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        dict(model.named_parameters())[POISONED].register_hook(
            lambda g: torch.full_like(g, float("nan")) if self.active else g)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.active = state.global_step == self.at
        self.before[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.after[state.global_step - 1] = {n: p.detach().clone() for n, p in model.named_parameters()}


def _args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "max_grad_norm": 0.01, "max_steps": 4, "logging_steps": 2, "report_to": [], "use_cpu": True,
        "save_strategy": "no", "learning_rate": 1e-3, "disable_tqdm": True, "seed": 0,
    }
    base.update(kw)
    return TrainingArguments(**base)


def _train(trainer: Trainer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


def test_logged_figures_are_before_clipping_and_match_the_trainer(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[dict[str, float]] = []
    real = torch.nn.utils.clip_grad_norm_

    def recording(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(parameters)
        seen.append({names[id(p)]: float(p.grad.double().norm()) for p in params if p.grad is not None})
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    poison = Poison(model, at=3)  # the 4th optimizer step, logged at global step 4
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_data(), callbacks=[poison])
    cb = add_to_trainer(trainer, on_nonfinite="skip")
    _train(trainer)

    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logs) == [2, 4]
    assert len(seen) == 4  # the Trainer clipped once per optimizer step
    good = logs[2]
    # the Trainer's own grad_norm is its norm before clipping (max_grad_norm=0.01 is far below it)
    assert good["grad_norm"] > 10 * 0.01
    assert good["grad/total_norm"] == pytest.approx(good["grad_norm"], rel=1e-5)
    ref = seen[1]  # optimizer step 1 -> global step 2
    assert set(ref) == {k[len("grad/norm/"):] for k in good if k.startswith("grad/norm/")}
    for name, norm in ref.items():
        assert good[f"grad/norm/{name}"] == pytest.approx(norm, rel=1e-5), name
    assert good["grad/nan_count"] == 0 and good["grad/health"] == 1.0 and good["grad/first_nonfinite_index"] == -1

    bad = logs[4]
    n_poisoned = dict(model.named_parameters())[POISONED].numel()
    assert bad["grad/nan_count"] == n_poisoned and bad["grad/health"] == 0.0
    assert bad["grad/first_nonfinite_index"] == list(ref).index(POISONED)
    assert math.isnan(bad["grad/total_norm"])
    # skipped: every gradient was gone before clipping, and no weight moved in that step
    assert seen[3] == {} and bad["grad_norm"] == 0.0
    assert cb.skipped_steps == [3]
    for name, w in poison.before[3].items():
        torch.testing.assert_close(poison.after[3][name], w, rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_report_to_tensorboard_receives_the_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = _args(tmp_path, report_to=["tensorboard"], max_steps=2, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    add_to_trainer(trainer, log_weight_norms=True, log_update_ratio=True)
    _train(trainer)
    history = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    runs = [p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    for key in ("grad/total_norm", "grad/health", "grad/weight_norm/transformer.wte.weight",
                "grad/update_ratio/transformer.wte.weight", "grad/lr_update_ratio/transformer.wte.weight"):
        events = {e.step: e.value for e in acc.Scalars("train/" + key)}
        assert sorted(events) == [1, 2], key
        for step in (1, 2):
            assert events[step] == pytest.approx(history[step][key], rel=1e-6), (key, step)
    # the measured update ratio is the real relative change of the weights in that step
    assert 0 < history[1]["grad/update_ratio/transformer.wte.weight"] < 1


def test_stop_on_nonfinite(tmp_path: Path) -> None:
    model = _model()
    poison = Poison(model, at=1)
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=6, logging_steps=10), train_dataset=_data(),
                      callbacks=[poison])
    cb = add_to_trainer(trainer, on_nonfinite="stop")
    _train(trainer)
    assert trainer.state.global_step == 2  # steps 0 and the skipped 1
    assert cb.skipped_steps == [1]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("on_nonfinite", [None, "skip"])
def test_host_syncs_only_on_logging_steps(tmp_path: Path, on_nonfinite: str | None) -> None:
    model = _model()
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=6, logging_steps=3), train_dataset=_data())
    cb = add_to_trainer(trainer, on_nonfinite=on_nonfinite)
    counts = instrument(cb, ("_after_backward", "on_log", "on_optimizer_step", "on_pre_optimizer_step"))
    _train(trainer)
    assert counts["report"] == 2  # global steps 3 and 6
    if on_nonfinite is None:
        assert counts["check"] == 0 and counts["reads"] == 0
    else:
        # One check per optimizer step, each a one-value transfer through torch_gradstats.ops._transfer (no .item()).
        assert counts["check"] == 6 and counts["reads"] == 0


def test_add_to_trainer_refuses_options_beside_a_callback(tmp_path: Path) -> None:
    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
    with pytest.raises(ValueError, match=r"add_to_trainer: options \(on_nonfinite\) are for the callback it makes"):
        add_to_trainer(trainer, GradStatsCallback(), on_nonfinite="skip")
    assert not any(isinstance(c, GradStatsCallback) for c in trainer.callback_handler.callbacks)  # nothing added


def test_fp16_scaled_gradients_are_unscaled_on_the_device() -> None:
    """The fp16 path's arithmetic with a real GradScaler: figures of scaled gradients, divided by the scale, equal
    the figures after GradScaler.unscale_."""
    import torch_gradstats as tg

    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(model(torch.randn(4, 5)).sum()).backward()
    scaled = tg.grad_stats(model.named_parameters())
    divided = unscaled(scaled, scaler._scale)
    scaler.unscale_(opt)
    ref = tg.grad_stats(model.named_parameters())
    torch.testing.assert_close(divided.norms, ref.norms, rtol=1e-12, atol=0)
    torch.testing.assert_close(divided.amax, ref.amax, rtol=1e-12, atol=0)
    torch.testing.assert_close(divided.counts, ref.counts, rtol=0, atol=0)
    # the exponent histogram moves down by log2(scale) buckets, per parameter and in all
    for per_tensor in (False, True):
        scaled_h = tg.grad_stats(model.named_parameters(), histogram=True, per_tensor=per_tensor)
        scaled_h.exponent_histogram = torch.roll(scaled_h.exponent_histogram, 12, dims=-1)  # the grads * 2**12
        moved = unscaled(scaled_h, scaler._scale).exponent_histogram
        want = tg.grad_stats(model.named_parameters(), histogram=True, per_tensor=per_tensor).exponent_histogram
        assert torch.equal(moved, want)


def test_histogram_fractions_are_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """histogram=True: the logged steps carry the fp16/bf16/fp8 fractions of the gradients the Trainer clipped
    (before clipping), equal to those of the same gradients read by grad_stats."""
    import torch_gradstats as tg

    model = _model()
    seen: list[dict[str, Any]] = []
    real = torch.nn.utils.clip_grad_norm_

    def recording(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(parameters)
        named = [(n, p) for n, p in model.named_parameters() if any(p is q for q in params)]
        seen.append(tg.grad_stats(named, histogram=True).report().to_dict())
        return real(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_data())
    add_to_trainer(trainer, histogram=True)
    _train(trainer)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logs) == [2, 4]
    for step in (2, 4):
        for key in ("underflow/fp16", "overflow/fp16", "underflow/fp8_e4m3", "overflow/fp8_e5m2"):
            assert logs[step][f"grad/{key}"] == seen[step - 1][key], (step, key)
    with pytest.raises(ValueError, match="log_weight_norms"):
        add_to_trainer(trainer, histogram=True, log_weight_norms=True)
    with pytest.raises(TypeError, match="histogram must be a bool"):
        add_to_trainer(trainer, histogram="yes")


def test_figures_are_taken_after_end_of_backward_callbacks(tmp_path: Path) -> None:
    """DDP averages the gradients in a callback it queues on the autograd engine near the end of the backward
    pass; the figures must be taken after such callbacks. Here a hook registered after the callback's own queues,
    late in the backward, a callback that halves every gradient (as an average over two replicas would)."""
    model = _model()
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=_data())
    add_to_trainer(trainer)
    engine = torch.autograd.Variable._execution_engine

    def halve_all() -> None:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)

    class LateReduction(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            wpe = model.transformer.wpe.weight  # among the last gradients of the backward pass
            wpe.register_post_accumulate_grad_hook(lambda p: engine.queue_callback(halve_all))

    trainer.add_callback(LateReduction())  # on_train_begin after ours: its hook is registered later
    _train(trainer)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for e in logs:
        # the Trainer clips (and measures grad_norm) after the backward, so it sees the halved gradients too
        assert e["grad/total_norm"] == pytest.approx(e["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("logging_steps", [10, 2], ids=["step_not_logged", "step_logged"])
@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_skip_warning_names_the_parameter(tmp_path: Path, caplog: pytest.LogCaptureFixture, logging_steps: int,
                                          on_nonfinite: str) -> None:
    model = _model()
    poison = Poison(model, at=1)  # optimizer step 1: global step 2 when it is done
    trainer = Trainer(model=model, args=_args(tmp_path, max_steps=3, logging_steps=logging_steps),
                      train_dataset=_data(), callbacks=[poison])
    cb = add_to_trainer(trainer, on_nonfinite=on_nonfinite)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _train(trainer)
    assert cb.skipped_steps == [1]
    n = dict(model.named_parameters())[POISONED].numel()
    stopping = ", stopping" if on_nonfinite == "stop" else ""
    expected = f"torch_gradstats: non-finite gradient at optimizer step 1: '{POISONED}' ({n} NaN, 0 Inf); step skipped"
    # one warning per non-finite step, whether or not the Trainer logs that step
    assert [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"] == [expected + stopping]


def _guarded_run(out: Path, max_steps: int, resume: bool = False, adaptive_clip: bool = True,
                 min_history: int = 2) -> GradStatsCallback:
    from torch_gradstats import AdaptiveClip, SpikeGuard

    cb = GradStatsCallback(spike_guard=SpikeGuard(min_history=min_history),
                           adaptive_clip=AdaptiveClip(warmup=2) if adaptive_clip else None)
    model = _model()
    opt = cb.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    trainer = Trainer(model=model, args=_args(out, max_steps=max_steps, gradient_accumulation_steps=1,
                                              max_grad_norm=0.0, save_strategy="steps", save_steps=1),
                      train_dataset=_data(), optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume or None)
    return cb


@pytest.mark.parametrize("saved", ["cut", "foreign_pickle", "foreign_dict"])
def test_resumed_run_names_an_unreadable_gradstats_file(tmp_path: Path, saved: str) -> None:
    """A checkpoint's gradstats.pt that cannot be restored (cut short, another program's pickle, a dict that is no
    callback's state) stops the resumed run with an error naming the file; torch.load's own error named none."""
    _guarded_run(tmp_path, max_steps=1)
    path = tmp_path / "checkpoint-1" / "gradstats.pt"
    if saved == "cut":
        path.write_bytes(path.read_bytes()[:40])
    elif saved == "foreign_pickle":
        torch.save({"spike_guard": object()}, path)
    else:
        torch.save({"model": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=str(path)):
        _guarded_run(tmp_path, max_steps=2, resume=True)


def test_resumed_run_says_which_policy_its_gradstats_file_lacks(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A run saved by a callback with a spike guard only, resumed by one that also has an adaptive clip: the guard's
    statistics are restored and a warning says, naming the file, that the clip's start afresh (nothing was said)."""
    _guarded_run(tmp_path, max_steps=1, adaptive_clip=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        cb = _guarded_run(tmp_path, max_steps=2, resume=True)
    assert cb.policies_restored
    path = tmp_path / "checkpoint-1" / "gradstats.pt"
    said = (f"torch_gradstats: GradStatsCallback resumed at step 1: {path} holds no statistics of the adaptive_clip, "
            "which start afresh (warm-up included)")
    assert [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"] == [said]


def test_resumed_run_says_which_saved_settings_replace_its_own(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A resumed run whose callback's policy has other settings than the run that saved gradstats.pt decides with the
    saved ones (as SpikeGuard.load_state_dict does); a warning names each setting and the file (nothing was said)."""
    _guarded_run(tmp_path, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        cb = _guarded_run(tmp_path, max_steps=2, resume=True, min_history=5)
    assert cb.policies_restored and cb.spike_guard.state_dict()["min_history"] == 2
    path = tmp_path / "checkpoint-1" / "gradstats.pt"
    said = (f"torch_gradstats: GradStatsCallback resumed at step 1: the spike_guard decides with the settings saved "
            f"in {path} (min_history=2, not 5), as the run that saved them did; remove that file to run with this "
            "callback's (its statistics then start afresh)")
    assert [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"] == [said]
