"""The callbacks in the settings people train with: real ``transformers.Trainer`` and ``lightning.pytorch.Trainer`` runs
on the models of ``model_zoo`` with gradient accumulation, clipping, bf16, gradient checkpointing, evaluation between
steps, manual optimization and resumed runs, the logged values read back from the files the loggers wrote
(TensorBoard event files, Lightning's CSV).

References are independent of the callback: the gradients the framework itself reads at each optimizer step
(captured where the Hugging Face Trainer measures its ``grad_norm``, by a Lightning callback placed before ours, by
an optimizer step hook), their norms taken in float64, and for the first accumulated step a float64 copy of the model
recomputing the step's gradient from the captured micro-batches. Also: the spike guard's judged loss on an epoch's
short last accumulation step (both callbacks) and under Lightning's fp16 GradScaler, the per-example norms on a short
last step, a Hugging Face run resumed with the callback's policies' state restored, reentrant checkpointing with every
trainable parameter inside a segment, MLflow and W&B run files (slow tier), and torch_gradstats.Trainer's file sinks.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import math
import os
import warnings
from pathlib import Path
from typing import Any

import model_zoo
import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("one_thread")

REL = 1e-5  # float32 gradients, float64 references: the logged norms agree to a few float32 ulps


def _total(norms: dict[str, float]) -> float:
    return math.sqrt(sum(v * v for v in norms.values()))


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


# ================================================================================================ Hugging Face Trainer
def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


# Marked at collection: the callbacks' modules import their framework, so a test body would fail before its skip.
needs_hf = pytest.mark.skipif(not _installed("transformers", "accelerate"), reason="needs transformers and accelerate")
needs_lightning = pytest.mark.skipif(not _installed("lightning"), reason="needs lightning")


def _hf() -> Any:
    pytest.importorskip("accelerate")
    return pytest.importorskip("transformers")


def _lm_data(n: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


def _hf_trainer(tmp_path: Path, model: nn.Module | None = None, eval_dataset: Any = None, callbacks: Any = None,
                optimizers: Any = (None, None), train_dataset: Any = None, **kw: Any) -> Any:
    """A Trainer that records, at every optimizer step, the float64 norms of the gradients it hands to its
    accelerator's ``clip_grad_norm_`` (to clip, or with ``max_grad_norm=0`` to measure its ``grad_norm``), before
    clipping, keyed by the global step the optimizer step ends on (``trainer.ref``)."""
    transformers = _hf()
    args: dict[str, Any] = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        "max_grad_norm": 1.0, "max_steps": 4, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "save_strategy": "no", "learning_rate": 1e-3, "disable_tqdm": True, "seed": 0,
    }
    args.update(kw)
    with warnings.catch_warnings():  # gradient_checkpointing's new name (activation_checkpointing) is not in older
        warnings.simplefilter("ignore", FutureWarning)  # versions
        targs = transformers.TrainingArguments(**args)
    model = model if model is not None else _no_dropout(model_zoo.gpt2())
    trainer = transformers.Trainer(model=model, args=targs,
                                   train_dataset=_lm_data() if train_dataset is None else train_dataset,
                                   eval_dataset=eval_dataset, callbacks=callbacks, optimizers=optimizers)
    names = {id(p): n for n, p in model.named_parameters()}
    trainer.ref = {}
    clip = trainer.accelerator.clip_grad_norm_

    def recording(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(parameters)
        step = trainer.state.global_step + 1
        if step not in trainer.ref:
            trainer.ref[step] = {names[id(p)]: float(p.grad.double().norm()) for p in params if p.grad is not None}
        return clip(params, *args, **kwargs)

    trainer.accelerator.clip_grad_norm_ = recording
    return trainer


def _hf_train(trainer: Any, **kw: Any) -> dict[int, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(**kw)
    return {e["step"]: e for e in trainer.state.log_history if "loss" in e}


def _assert_hf_matches(logged: dict[str, Any], ref: dict[str, float], rel: float = REL) -> None:
    per_param = {k[len("grad/norm/"):]: v for k, v in logged.items() if k.startswith("grad/norm/")}
    assert set(per_param) == set(ref)
    for name, norm in ref.items():
        assert per_param[name] == pytest.approx(norm, rel=rel), name
    assert logged["grad/total_norm"] == pytest.approx(_total(ref), rel=rel)
    assert logged["grad/nan_count"] == 0 and logged["grad/health"] == 1.0


@needs_hf
def test_hf_accumulation_logs_the_accumulated_gradient_at_its_global_step(tmp_path: Path) -> None:
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = _no_dropout(model_zoo.gpt2())
    initial = copy.deepcopy(model).double()
    micro: list[dict[str, Any]] = []  # the first optimizer step's micro-batches, as the model received them

    def keep(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled() and len(micro) < 3:
            micro.append({k: kwargs[k] for k in ("input_ids", "labels", "num_items_in_batch") if k in kwargs})

    model.register_forward_pre_hook(keep, with_kwargs=True)
    trainer = _hf_trainer(tmp_path, model, gradient_accumulation_steps=3, max_steps=4, logging_steps=2,
                          logging_first_step=True)
    add_to_trainer(trainer)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 4]  # logging_first_step, then every 2nd optimizer step (not micro-batch)
    for step in (1, 2, 4):
        _assert_hf_matches(logs[step], trainer.ref[step])
        assert logs[step]["grad/total_norm"] == pytest.approx(logs[step]["grad_norm"], rel=REL)
    # Step 1 from scratch in float64, from the three micro-batches and the loss normalisation the model was given
    # (the Trainer passes the step's token count as num_items_in_batch, or else divides each mean loss by 3).
    assert len(micro) == 3
    for kwargs in micro:
        loss = initial(**kwargs).loss
        (loss if "num_items_in_batch" in kwargs else loss / 3).backward()
    for name, p in initial.named_parameters():
        assert logs[1][f"grad/norm/{name}"] == pytest.approx(float(p.grad.norm()), rel=1e-5), name


@needs_hf
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05], ids=["no_clip", "clip"])
def test_hf_figures_are_before_clipping(tmp_path: Path, max_grad_norm: float) -> None:
    transformers = _hf()
    from torch_gradstats.integrations.transformers import add_to_trainer

    class AfterClip(transformers.TrainerCallback):
        """The global norm the optimizer steps with (after the Trainer's clip)."""

        def __init__(self) -> None:
            self.norms: dict[int, float] = {}

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self.norms[state.global_step + 1] = _total(
                {n: float(p.grad.double().norm()) for n, p in model.named_parameters() if p.grad is not None})

    after = AfterClip()
    trainer = _hf_trainer(tmp_path, max_grad_norm=max_grad_norm, max_steps=3, callbacks=[after])
    add_to_trainer(trainer)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 3]
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])
        if max_grad_norm:  # the optimizer saw clipped gradients; the logged figures are of the ones before
            assert after.norms[step] == pytest.approx(max_grad_norm, rel=1e-4)
            assert logged["grad/total_norm"] > 10 * max_grad_norm
        else:
            assert after.norms[step] == pytest.approx(logged["grad/total_norm"], rel=REL)


@pytest.mark.parametrize("setting", [
    {"bf16": True},
    {"gradient_checkpointing": True},
    {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
], ids=["bf16", "checkpointing", "checkpointing_reentrant"])
@needs_hf
def test_hf_bf16_and_gradient_checkpointing(tmp_path: Path, setting: dict[str, Any]) -> None:
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = _no_dropout(model_zoo.gpt2())
    trainer = _hf_trainer(tmp_path, model, max_steps=3, **setting)
    add_to_trainer(trainer)
    logs = _hf_train(trainer)
    if setting.get("gradient_checkpointing"):
        active = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        assert active and all(active)
    assert sorted(logs) == [1, 2, 3]
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])


@needs_hf
def test_hf_reentrant_checkpointing_with_every_trainable_parameter_inside(tmp_path: Path) -> None:
    """Adapter-style fine-tuning: only the blocks' attention weights train (embeddings, norms and head frozen) and
    every block runs under a reentrant checkpoint, so each block's gradients arrive in a backward of its own, nested
    in the Trainer's. The figures must be taken once per optimizer step, at the end of the outer backward, when every
    gradient is there: the guard judges each step once, on the whole step's norm."""
    from torch_gradstats import SpikeGuard
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    model = _no_dropout(model_zoo.gpt2())
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("attn.c_attn.weight"))
    model.enable_input_require_grads()  # what adapter fine-tuning with reentrant checkpoints needs
    guard = SpikeGuard(min_history=2)
    norms: list[float] = []
    observe = guard.observe

    def recording(grad_norm: torch.Tensor, loss: torch.Tensor | None = None) -> torch.Tensor:
        norms.append(float(grad_norm))
        return observe(grad_norm, loss)

    guard.observe = recording  # type: ignore[method-assign]
    cb = GradStatsCallback(spike_guard=guard, on_nonfinite="skip")
    opt = cb.wrap_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    trainer = _hf_trainer(tmp_path, model, max_steps=3, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": True}, optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 3]
    for step, logged in logs.items():
        assert len(trainer.ref[step]) == 2  # the two blocks' c_attn weights
        _assert_hf_matches(logged, trainer.ref[step])
    assert norms == pytest.approx([_total(trainer.ref[s]) for s in (1, 2, 3)], rel=REL)  # once a step, all of it
    assert int(guard.steps) == 3


@needs_hf
def test_hf_per_example_with_reentrant_checkpointing_and_every_trainable_parameter_inside(tmp_path: Path) -> None:
    """per_example=True in the adapter setting above, every example the same sequence: each per-example norm is the
    step's whole gradient norm, every block's contribution counted (a reentrant segment's nested backward ends
    before the others' gradients exist)."""
    from torch_gradstats.integrations.transformers import add_to_trainer

    model = _no_dropout(model_zoo.gpt2())
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("attn.c_attn.weight"))
    model.enable_input_require_grads()
    ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(0))
    same = [{"input_ids": ids, "labels": ids, "position_ids": torch.arange(16)} for _ in range(16)]
    trainer = _hf_trainer(tmp_path, model, max_steps=2, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": True}, train_dataset=same)
    add_to_trainer(trainer, per_example=True)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2]
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])
        for key in ("examples/median_norm", "examples/max_norm"):
            assert logged[key] == pytest.approx(logged["grad/total_norm"], rel=1e-4), (step, key)


@needs_hf
def test_hf_evaluation_between_steps_logs_nothing_and_changes_nothing(tmp_path: Path) -> None:
    from torch_gradstats.integrations.transformers import add_to_trainer

    trainer = _hf_trainer(tmp_path, max_steps=5, logging_steps=2, eval_strategy="steps", eval_steps=1,
                          eval_dataset=_lm_data(8, seed=1), per_device_eval_batch_size=4)
    cb = add_to_trainer(trainer, on_nonfinite="skip")
    logs = _hf_train(trainer)
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [1, 2, 3, 4, 5]  # an evaluation after every optimizer step
    assert not any(k.startswith("grad/") for e in evals for k in e)  # no gradient figures on evaluation entries
    assert sorted(logs) == [2, 4]
    for step in (2, 4):
        _assert_hf_matches(logs[step], trainer.ref[step])
    assert cb.skipped_steps == []


@needs_hf
def test_hf_resumed_run_logs_the_same_steps_and_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume from checkpoint-2 of a 4-step run: the resumed run logs steps 3 and 4, with the figures of the
    uninterrupted run, into its own TensorBoard event file."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torch_gradstats.integrations.transformers import add_to_trainer

    common = {"max_steps": 4, "logging_steps": 1, "save_strategy": "steps", "save_steps": 2,
              "report_to": ["tensorboard"], "save_only_model": False}
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb_full"))
    full = _hf_trainer(tmp_path / "full", **common)
    add_to_trainer(full)
    full_logs = _hf_train(full)
    assert sorted(full_logs) == [1, 2, 3, 4]

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb_resumed"))
    resumed = _hf_trainer(tmp_path / "resumed", **common)
    cb = add_to_trainer(resumed)
    resumed_logs = _hf_train(resumed, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert sorted(resumed.ref) == [3, 4]  # the resumed run's own optimizer steps
    for step in (3, 4):
        _assert_hf_matches(resumed_logs[step], resumed.ref[step])
        assert resumed_logs[step]["grad/total_norm"] == pytest.approx(full_logs[step]["grad/total_norm"], rel=1e-6)
    assert cb.last_report is not None and cb._pending is None
    files = list((tmp_path / "tb_resumed").rglob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    written = {e.step: e.value for e in acc.Scalars("train/grad/total_norm")}
    assert sorted(written) == [3, 4]
    for step in (3, 4):
        assert written[step] == pytest.approx(_total(resumed.ref[step]), rel=REL)



def _recording_guard() -> tuple[Any, list[float]]:
    """A SpikeGuard (judging from its 3rd step) and the list of the losses it is given to judge, in order."""
    from torch_gradstats import SpikeGuard

    guard = SpikeGuard(min_history=2)
    judged: list[float] = []
    observe = guard.observe

    def recording(grad_norm: torch.Tensor, loss: torch.Tensor | None = None) -> torch.Tensor:
        judged.append(float(loss))
        return observe(grad_norm, loss)

    guard.observe = recording  # type: ignore[method-assign]
    return guard, judged

@needs_hf
def test_hf_guard_judges_the_step_loss_with_a_short_last_accumulation(tmp_path: Path) -> None:
    """GPT-2 takes the Trainer's ``num_items_in_batch``, so each micro-batch's loss is its share of the step's loss
    (its token sum over the step's token count): the step's loss is their sum, not their mean. 10 batches with
    ``gradient_accumulation_steps=4`` make steps of 4, 4 and 2 micro-batches; the guard must judge the step's own
    loss, the one the Trainer logs (the mean of the micro-batches' shares was a quarter of it on full steps and half
    of it on the short ones: a loss spike at the end of every epoch)."""
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    guard, judged = _recording_guard()
    cb = GradStatsCallback(spike_guard=guard)
    model = _no_dropout(model_zoo.gpt2())
    opt = cb.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    trainer = _hf_trainer(tmp_path, model, max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=4,
                          train_dataset=_lm_data(40), optimizers=(opt, None))
    add_to_trainer(trainer, cb)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 3, 4, 5, 6]
    assert judged == pytest.approx([logs[s]["loss"] for s in range(1, 7)], rel=1e-3)  # the Trainer rounds to 4 digits
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])


@needs_hf
def test_hf_per_example_norms_on_a_short_last_accumulation(tmp_path: Path) -> None:
    """per_example=True with every example the same sequence: each example's gradient is then the step's whole
    gradient, so every per-example norm equals the logged total norm, on the epoch's short last step (2 micro-batches
    of ``gradient_accumulation_steps=4``) too, where the Trainer normalises the loss by 2 micro-batches, not 4."""
    from torch_gradstats.integrations.transformers import add_to_trainer

    ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(0))
    same = [{"input_ids": ids, "labels": ids, "position_ids": torch.arange(16)} for _ in range(40)]
    trainer = _hf_trainer(tmp_path, max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=4,
                          train_dataset=same)
    add_to_trainer(trainer, per_example=True)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 3]
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])
        for key in ("examples/median_norm", "examples/max_norm"):
            assert logged[key] == pytest.approx(logged["grad/total_norm"], rel=1e-4), (step, key)


@needs_hf
def test_hf_resumed_run_without_the_callbacks_statistics_warns_that_they_start_afresh(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run resumed from a checkpoint that holds no gradstats.pt (saved by a run without the policies, or copied
    without it) says once, naming the file and the policies, that their statistics start afresh; a run from
    scratch says nothing."""
    import logging
    import shutil

    from torch_gradstats import AdaptiveClip, SpikeGuard
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    def run(**kw: Any) -> None:
        cb = GradStatsCallback(spike_guard=SpikeGuard(), adaptive_clip=AdaptiveClip())
        model = _no_dropout(model_zoo.gpt2())
        opt = cb.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        trainer = _hf_trainer(tmp_path / "out", model, max_steps=3, save_strategy="steps", save_steps=2,
                              optimizers=(opt, None), logging_steps=10)
        add_to_trainer(trainer, cb)
        _hf_train(trainer, **kw)

    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        run()
    assert not [r for r in caplog.records if r.name == "torch_gradstats"]
    saved = tmp_path / "out" / "checkpoint-2" / "gradstats.pt"
    shutil.move(saved, tmp_path / "elsewhere.pt")
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        run(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    said = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"]
    assert said == [(f"torch_gradstats: GradStatsCallback resumed at step 2: there is no {saved}, so the "
                     "spike_guard's and the adaptive_clip's statistics start afresh (restore them with "
                     "load_state_dict from the checkpoint's gradstats.pt)")]


@needs_hf
def test_hf_resumed_run_reads_the_callbacks_statistics_from_its_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The callback writes its ``state_dict()`` (its ``spike_guard``'s and ``adaptive_clip``'s statistics) into each
    of the Trainer's checkpoint folders as gradstats.pt. A run resumed from the middle, by
    ``resume_from_checkpoint=True`` in an output_dir holding that checkpoint, reads them back by itself; one resumed
    from a checkpoint elsewhere takes them by ``load_state_dict``. Either way steps 3 and 4 are judged and clipped as
    in the uninterrupted run (the same z-scores, thresholds and decisions), the policies end with its state, and
    nothing is said. Without the file they start afresh (the guard with no history has no z-scores), with the
    warning: the comparison tells the two apart."""
    import logging
    import shutil

    from torch_gradstats import AdaptiveClip, SpikeGuard
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    full_checkpoint = tmp_path / "full" / "checkpoint-2"

    def run(out: str, resume: str | None = None) -> tuple[dict[int, dict[str, Any]], Any, Any]:
        cb = GradStatsCallback(spike_guard=SpikeGuard(min_history=2), adaptive_clip=AdaptiveClip(warmup=2))
        model = _no_dropout(model_zoo.gpt2())
        opt = cb.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        trainer = _hf_trainer(tmp_path / out, model, max_steps=4, save_strategy="steps", save_steps=2,
                              save_only_model=False, max_grad_norm=0.0, optimizers=(opt, None))
        add_to_trainer(trainer, cb)
        kw: dict[str, Any] = {}
        if resume == "found":  # the checkpoint in this run's own output_dir
            shutil.copytree(full_checkpoint, tmp_path / out / "checkpoint-2")
            kw["resume_from_checkpoint"] = True
        elif resume == "loaded":  # a checkpoint elsewhere: its file loaded by hand
            cb.load_state_dict(torch.load(full_checkpoint / "gradstats.pt", weights_only=True))
            kw["resume_from_checkpoint"] = str(full_checkpoint)
        elif resume == "afresh":  # the checkpoint without the callback's file
            shutil.copytree(full_checkpoint, tmp_path / out / "checkpoint-2")
            (tmp_path / out / "checkpoint-2" / "gradstats.pt").unlink()
            kw["resume_from_checkpoint"] = True
        return _hf_train(trainer, **kw), cb, trainer

    full, full_cb, _ = run("full")
    assert sorted(full) == [1, 2, 3, 4]
    assert sorted(p.parent.name for p in (tmp_path / "full").glob("*/gradstats.pt")) == ["checkpoint-2",
                                                                                          "checkpoint-4"]
    assert math.isfinite(full[3]["guard/grad_norm_z"]) and math.isfinite(full[3]["guard/loss_z"])  # past min_history
    keys = ("grad/total_norm", "guard/skipped", "guard/consecutive", "guard/grad_norm_z", "guard/loss_z",
            "clip/threshold", "clip/coef")
    for how in ("found", "loaded"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
            resumed, resumed_cb, trainer = run(how, resume=how)
        assert resumed_cb.policies_restored, how
        assert not [r for r in caplog.records if r.name == "torch_gradstats"], how
        assert sorted(trainer.ref) == [3, 4]  # the resumed run's own optimizer steps (log_history keeps 1 and 2 too)
        for step in (3, 4):
            for key in keys:
                assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5), (how, step, key)
        assert resumed_cb.spike_guard is not None and resumed_cb.adaptive_clip is not None
        for policy in ("spike_guard", "adaptive_clip"):
            want = full_cb.state_dict()[policy]
            for name, got in resumed_cb.state_dict()[policy].items():
                if isinstance(got, torch.Tensor):
                    torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-7, equal_nan=True,
                                               msg=f"{how}: {policy}.{name}")
                else:
                    assert got == want[name], (how, policy, name)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        afresh, _, _ = run("afresh", resume="afresh")
    assert len([r for r in caplog.records if "start afresh" in r.getMessage()]) == 1
    assert not all(afresh[3][key] == pytest.approx(full[3][key], rel=1e-5) for key in keys)


@needs_hf
@pytest.mark.slow
def test_hf_torch_compile(tmp_path: Path) -> None:
    """``torch_compile=True`` compiles the model's forward (about a minute on two CPU cores): the hooks on the
    parameters still fire and the figures match."""
    from torch_gradstats.integrations.transformers import add_to_trainer

    trainer = _hf_trainer(tmp_path, torch_compile=True, max_steps=2, gradient_accumulation_steps=2)
    add_to_trainer(trainer)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2]
    for step, logged in logs.items():
        _assert_hf_matches(logged, trainer.ref[step])


# ================================================================================================ Lightning
def _pl() -> Any:
    return pytest.importorskip("lightning.pytorch")


def _reference_callback() -> Any:
    L = _pl()

    class Ref(L.Callback):
        """Float64 norms of every gradient at each optimizer step, read before our callback (list order), keyed by
        the logger step (Lightning's ``_batches_that_stepped``); each entry is a list, one per optimizer step."""

        def __init__(self) -> None:
            self.by_logger_step: dict[int, list[dict[str, float]]] = {}
            self.after_clip: dict[int, float] = {}
            self._step = -1
            self._module: Any = None
            self._hooked: set[int] = set()

        def _norms(self) -> dict[str, float]:
            return {n: float(p.grad.double().norm()) for n, p in self._module.named_parameters() if p.grad is not None}

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._step, self._module = trainer.fit_loop.epoch_loop._batches_that_stepped, pl_module
            self.by_logger_step.setdefault(self._step, []).append(self._norms())
            if id(optimizer) not in self._hooked:  # what the optimizer stepped with: after the clip
                self._hooked.add(id(optimizer))
                optimizer.register_step_post_hook(self._after_step)

        def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self.after_clip[self._step] = _total(self._norms())

    return Ref()


def _pl_fit(module: Any, tmp_path: Path, cb: Any, data: Any = None, logger: str = "csv", ckpt_path: str | None = None,
            **kw: Any) -> tuple[Any, Any]:
    L = _pl()
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    ref = _reference_callback()
    lg = CSVLogger(str(tmp_path), name="csv") if logger == "csv" else TensorBoardLogger(str(tmp_path), name="tb")
    args: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "max_steps": 4, "callbacks": [ref, cb], "logger": lg,
        "enable_progress_bar": False, "enable_checkpointing": False, "enable_model_summary": False,
        "log_every_n_steps": 1, "default_root_dir": str(tmp_path), "num_sanity_val_steps": 0,
    }
    args.update(kw)
    trainer = L.Trainer(**args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data if data is not None else model_zoo.classification_data(8), ckpt_path=ckpt_path)
    return trainer, ref


def _csv(trainer: Any) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return {s: r for s, r in rows.items() if "grad_2.0_norm_total" in r}


def _assert_pl_matches(row: dict[str, float], ref: dict[str, float], rel: float = REL) -> None:
    per_param = {k[len("grad_2.0_norm/"):]: v for k, v in row.items() if k.startswith("grad_2.0_norm/")}
    assert set(per_param) == set(ref)
    for name, norm in ref.items():
        assert per_param[name] == pytest.approx(norm, rel=rel), name
    assert row["grad_2.0_norm_total"] == pytest.approx(_total(ref), rel=rel)
    assert row["grad_stats/total_norm"] == pytest.approx(_total(ref), rel=rel)
    assert row["grad_stats/nan_count"] == 0 and row["grad_stats/health"] == 1.0


def _wrapped(net: nn.Module, lr: float = 0.01) -> Any:
    """A LightningModule training ``net`` with cross-entropy on its outputs (flattened over any sequence axis)."""
    L = _pl()

    class Wrapped(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            out = self.net(x)
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

    return Wrapped()


def _loader(x: torch.Tensor, y: torch.Tensor, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


@needs_lightning
def test_lightning_accumulation_logs_the_accumulated_gradient(tmp_path: Path) -> None:
    """accumulate_grad_batches=3 on the checkpointed TransformerEncoder (reentrant checkpoints): the figures are of
    the gradient summed over the three micro-batches, logged at Lightning's logger step of that optimizer step."""
    from torch_gradstats.integrations.lightning import GradStatsCallback

    net = model_zoo.CheckpointedEncoder(use_reentrant=True)
    initial = copy.deepcopy(net).double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 5, 8, generator=g), torch.randint(0, 4, (24, 5), generator=g)
    trainer, ref = _pl_fit(_wrapped(net), tmp_path, GradStatsCallback(every_n_steps=1), data=_loader(x, y, 4),
                           accumulate_grad_batches=3, max_steps=2)
    rows = _csv(trainer)
    assert sorted(rows) == [0, 1] and sorted(ref.by_logger_step) == [0, 1]
    for step in (0, 1):
        _assert_pl_matches(rows[step], ref.by_logger_step[step][0])
    # optimizer step 0 from scratch in float64: Lightning divides each micro-batch's loss by 3
    for i in range(3):
        xb, yb = x[4 * i:4 * i + 4].double(), y[4 * i:4 * i + 4]
        (nn.functional.cross_entropy(initial(xb).reshape(-1, 4), yb.reshape(-1)) / 3).backward()
    for name, p in initial.named_parameters():
        assert rows[0][f"grad_2.0_norm/net.{name}"] == pytest.approx(float(p.grad.norm()), rel=1e-5), name


@needs_lightning
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_lightning_figures_are_before_gradient_clip_val(tmp_path: Path, algorithm: str) -> None:
    from torch_gradstats.integrations.lightning import GradStatsCallback

    clip = 0.02 if algorithm == "norm" else 0.001
    trainer, ref = _pl_fit(model_zoo.lightning_module(), tmp_path, GradStatsCallback(), gradient_clip_val=clip,
                           gradient_clip_algorithm=algorithm)
    rows = _csv(trainer)
    assert sorted(rows) == [0, 1, 2, 3]
    for step, row in rows.items():
        _assert_pl_matches(row, ref.by_logger_step[step][0])
        assert row["grad_stats/total_norm" if algorithm == "norm" else "grad_stats/inf_norm"] > 10 * clip
        if algorithm == "norm":  # the optimizer stepped with clipped gradients
            assert ref.after_clip[step] == pytest.approx(clip, rel=1e-4)
        else:
            assert ref.after_clip[step] < row["grad_2.0_norm_total"] / 10


@needs_lightning
def test_lightning_bf16_mixed_resnet_to_tensorboard(tmp_path: Path) -> None:
    """precision="bf16-mixed" on the ResNet (BatchNorm, in-place residuals), read back from the TensorBoard event
    file the TensorBoardLogger wrote."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torch_gradstats.integrations.lightning import GradStatsCallback

    g = torch.Generator().manual_seed(0)
    data = _loader(torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 5, (12,), generator=g), 4)
    trainer, ref = _pl_fit(_wrapped(model_zoo.resnet()), tmp_path, GradStatsCallback(), data=data,
                           logger="tensorboard", precision="bf16-mixed", max_steps=3)
    files = list(Path(trainer.logger.log_dir).glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0]))
    acc.Reload()
    for key in ("grad_2.0_norm_total", "grad_2.0_norm/net.layer2.0.downsample.0.weight", "grad_2.0_norm/net.fc.bias"):
        written = {e.step: e.value for e in acc.Scalars(key)}
        assert sorted(written) == [0, 1, 2], key
        for step, value in written.items():
            r = ref.by_logger_step[step][0]
            want = _total(r) if key == "grad_2.0_norm_total" else r[key[len("grad_2.0_norm/"):]]
            assert value == pytest.approx(want, rel=REL), (key, step)  # event files keep float32


def _forward_hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def _eval_module() -> Any:
    m = model_zoo.lightning_module()

    def test_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("test_loss", loss)
        return loss

    def predict_step(self: Any, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    m.test_step = test_step.__get__(m)
    m.predict_step = predict_step.__get__(m)
    return m


@needs_lightning
def test_lightning_validation_test_and_predict_leave_the_figures_alone(tmp_path: Path) -> None:
    """Validation every 2 training batches, and trainer.validate / test / predict (under inference_mode) before and
    after fit, with a callback that judges every step: only the training steps are read, judged and logged. The
    activation watch and the per-example hooks serve a fit's optimizer steps: an evaluation run of its own adds no
    hook to any module (before, both were made at the setup of every stage, and each watched module's evaluation
    forward made op calls that nothing read)."""
    L = _pl()
    from torch_gradstats import SpikeGuard
    from torch_gradstats.integrations.lightning import GradStatsCallback

    module = _eval_module()
    bare = _forward_hooks(module)
    hooks: list[int] = []  # at each batch of trainer.validate / test / predict

    class Probe(L.Callback):
        def on_validation_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if not trainer.training and trainer.state.fn != "fit":
                hooks.append(_forward_hooks(pl_module))

        on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    guard = SpikeGuard(min_history=2)
    cb = GradStatsCallback(every_n_steps=2, on_nonfinite="skip", spike_guard=guard, watch_activations=True,
                           per_example=True)
    data = model_zoo.classification_data(8)
    other = L.Trainer(accelerator="cpu", logger=False, callbacks=[cb, Probe()], enable_progress_bar=False,
                      enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.validate(module, data)
        other.test(module, data)
        other.predict(module, data)
    assert hooks == [bare] * 24 and cb.activation_watch is None
    ref = _reference_callback()
    from lightning.pytorch.loggers import CSVLogger

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[ref, cb, Probe()],
                        logger=CSVLogger(str(tmp_path), name="csv"), enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
                        val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, data)
        trainer.validate(module, data)
        trainer.test(module, data)
        trainer.predict(module, data)
    assert hooks == [bare] * (24 + 2 + 8 + 8) and _forward_hooks(module) == bare  # limit_val_batches: validate 2
    rows = _csv(trainer)
    assert sorted(rows) == [1, 3, 5]
    for step, row in rows.items():
        _assert_pl_matches(row, ref.by_logger_step[step][0])
        assert row["act/nonfinite"] == 0 and row["guard/skipped"] == 0
    assert int(guard.steps) == 6  # the six training steps, not the evaluation batches
    assert cb.skipped_steps == []


@needs_lightning
def test_lightning_manual_optimization(tmp_path: Path) -> None:
    """automatic_optimization=False, stepping every 2nd batch (manual accumulation): the figures at each
    ``opt.step()``, logged at the logger step of that batch, as ``self.log`` values are."""
    L = _pl()
    from torch_gradstats.integrations.lightning import GradStatsCallback

    class Manual(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            opt = self.optimizers()
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.manual_backward(loss / 2)
            if batch_idx % 2 == 1:
                opt.step()
                opt.zero_grad()
            self.log("loss", loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer, ref = _pl_fit(Manual(), tmp_path, GradStatsCallback(every_n_steps=1), max_steps=3)
    rows = _csv(trainer)
    assert sorted(rows) == [1, 3, 5] == sorted(ref.by_logger_step)
    for step, row in rows.items():
        assert len(ref.by_logger_step[step]) == 1
        _assert_pl_matches(row, ref.by_logger_step[step][0])


@needs_lightning
def test_lightning_resumed_fit_logs_at_the_resumed_steps(tmp_path: Path) -> None:
    import glob

    from torch_gradstats.integrations.lightning import GradStatsCallback

    first, _ = _pl_fit(model_zoo.lightning_module(), tmp_path / "first", GradStatsCallback(), max_steps=3,
                       log_every_n_steps=2, enable_checkpointing=True)
    assert sorted(_csv(first)) == [1]
    (ckpt,) = glob.glob(str(tmp_path / "first" / "**" / "*.ckpt"), recursive=True)
    trainer, ref = _pl_fit(model_zoo.lightning_module(), tmp_path / "resumed", GradStatsCallback(), max_steps=6,
                           log_every_n_steps=2, ckpt_path=ckpt)
    rows = _csv(trainer)
    assert sorted(ref.by_logger_step) == [3, 4, 5]  # the steps after the checkpoint
    assert sorted(rows) == [3, 5]  # every 2nd counting from one, as before the checkpoint
    for step, row in rows.items():
        _assert_pl_matches(row, ref.by_logger_step[step][0])


@needs_lightning
def test_lightning_two_optimizers_log_each_ones_own_parameters(tmp_path: Path) -> None:
    """Two optimizers over two layers of one module, one backward (manual optimization): each ``opt.step()`` reads
    the parameters of its own param groups alone (at the first step the other layer's gradients are there too) and
    logs them under its own key segment, both at the batch's logger step."""
    L = _pl()
    from torch_gradstats.integrations.lightning import GradStatsCallback

    class TwoOptimizers(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.manual_backward(nn.functional.cross_entropy(self.net(x), y))
            for opt in self.optimizers():
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.net[0].parameters(), lr=0.01),
                    torch.optim.SGD(self.net[2].parameters(), lr=0.01)]

    trainer, ref = _pl_fit(TwoOptimizers(), tmp_path, GradStatsCallback(every_n_steps=1), max_steps=4)
    rows: dict[int, dict[str, float]] = {}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    assert sorted(rows) == [0, 1]  # max_steps counts both optimizers' steps: two batches
    for step, row in rows.items():
        first, second = ref.by_logger_step[step]  # every gradient there, at each optimizer's step
        assert sorted(first) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
        for i, layer in enumerate(("net.0", "net.2")):
            mine = {n: v for n, v in (first if i == 0 else second).items() if n.startswith(layer + ".")}
            assert len(mine) == 2
            assert row[f"grad_2.0_norm_total/optimizer_{i}"] == pytest.approx(_total(mine), rel=REL), (step, i)
            assert row[f"grad_stats/optimizer_{i}/total_norm"] == pytest.approx(_total(mine), rel=REL), (step, i)
            assert {k for k in row if k.startswith(f"grad_2.0_norm/optimizer_{i}/")} == {
                f"grad_2.0_norm/optimizer_{i}/{n}" for n in mine}
            for name, norm in mine.items():
                assert row[f"grad_2.0_norm/optimizer_{i}/{name}"] == pytest.approx(norm, rel=REL), (step, name)
        assert row["grad_2.0_norm_total/optimizer_0"] < _total(first)  # the whole module's would be larger


@needs_lightning
def test_lightning_resumed_fit_keeps_the_guard_and_clip_statistics(tmp_path: Path) -> None:
    """The SpikeGuard's and AdaptiveClip's statistics go into Lightning's checkpoint with the callback's state: a
    fit resumed from a checkpoint judges and clips exactly as the uninterrupted fit, its logged figures included.
    (Every batch is the same one, so the comparison does not depend on where Lightning restarts the epoch.)"""
    import glob

    from torch_gradstats import AdaptiveClip, SpikeGuard
    from torch_gradstats.integrations.lightning import GradStatsCallback

    def callback() -> Any:
        return GradStatsCallback(spike_guard=SpikeGuard(min_history=2), adaptive_clip=AdaptiveClip(warmup=2))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    data = _loader(x.repeat(3, 1), y.repeat(3), 4)  # 3 equal batches: one epoch is 3 optimizer steps
    full_cb = callback()
    full, _ = _pl_fit(model_zoo.lightning_module(), tmp_path / "full", full_cb, data=data, max_steps=6,
                      log_every_n_steps=2)
    _pl_fit(model_zoo.lightning_module(), tmp_path / "first", callback(), data=data, max_steps=3,
            log_every_n_steps=2, enable_checkpointing=True)
    (ckpt,) = glob.glob(str(tmp_path / "first" / "**" / "*.ckpt"), recursive=True)
    resumed_cb = callback()
    resumed, ref = _pl_fit(model_zoo.lightning_module(), tmp_path / "resumed", resumed_cb, data=data, max_steps=6,
                           log_every_n_steps=2, ckpt_path=ckpt)
    assert sorted(ref.by_logger_step) == [3, 4, 5]
    full_rows, resumed_rows = _csv(full), _csv(resumed)
    assert sorted(resumed_rows) == [3, 5]
    for step in (3, 5):
        for key in ("grad_2.0_norm_total", "clip/threshold", "clip/coef", "guard/grad_norm_z", "guard/loss_z"):
            assert resumed_rows[step][key] == pytest.approx(full_rows[step][key], rel=1e-5), (step, key)
    assert int(resumed_cb.spike_guard.steps) == int(full_cb.spike_guard.steps) == 6
    for name, value in full_cb.adaptive_clip.state_dict().items():
        got = resumed_cb.adaptive_clip.state_dict()[name]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-7, msg=name)
        else:
            assert got == value, name


@needs_lightning
def test_lightning_guard_judges_the_step_loss_with_a_short_last_accumulation(tmp_path: Path) -> None:
    """Lightning divides every micro-batch's loss by ``accumulate_grad_batches``, the epoch's short last window
    included (its ``ClosureResult`` normalises by the setting, not by the window's size). 5 batches of 4 with
    ``accumulate_grad_batches=2`` make windows of 2, 2 and 1 micro-batches, for 2 epochs: the guard must judge each
    step's mean loss over its examples, the float64 loss of each batch taken with the weights of its forward (the
    window of 1 was judged at half its loss, a loss dip at the end of every epoch)."""
    L = _pl()
    from torch_gradstats.integrations.lightning import GradStatsCallback

    class BatchLoss(L.Callback):
        """The float64 mean loss of each training batch, with the weights of its forward, by (epoch, batch)."""

        def __init__(self) -> None:
            self.losses: dict[tuple[int, int], float] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            x, y = batch
            net = copy.deepcopy(pl_module.net).double()
            with torch.no_grad():
                loss = nn.functional.cross_entropy(net(x.double()), y)
            self.losses[(trainer.current_epoch, batch_idx)] = float(loss)

    guard, judged = _recording_guard()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g)
    batch_loss = BatchLoss()
    cb = GradStatsCallback(spike_guard=guard)
    trainer, _ = _pl_fit(_wrapped(net, lr=0.1), tmp_path, cb, data=_loader(x, y, 4), accumulate_grad_batches=2,
                         max_steps=-1, max_epochs=2, callbacks=[batch_loss, cb])
    assert trainer.global_step == 6 and len(batch_loss.losses) == 10
    windows = [(0, 1), (2, 3), (4,)]
    want = [sum(batch_loss.losses[(e, b)] for b in w) / len(w) for e in (0, 1) for w in windows]
    assert judged == pytest.approx(want, rel=1e-5)


@needs_lightning
def test_lightning_guard_judges_the_unscaled_loss_under_16_mixed(tmp_path: Path) -> None:
    """Under ``precision="16-mixed"`` Lightning hands ``on_before_backward`` the loss already multiplied by the
    GradScaler's scale: the guard must judge the loss itself (the one ``training_step`` returned), not the loss
    times a scale that doubles every ``growth_interval`` steps (here 2, from 1024: the judged loss doubled with it,
    and was 1024 times too large to begin with). fp16 autocast on the CPU, through Lightning's own plugin."""
    L = _pl()
    from lightning.pytorch.plugins import MixedPrecision

    from torch_gradstats.integrations.lightning import GradStatsCallback

    class Returned(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    guard, judged = _recording_guard()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    returned = Returned()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    cb = GradStatsCallback(spike_guard=guard)
    trainer, _ = _pl_fit(_wrapped(net), tmp_path, cb, data=_loader(x, y, 4), callbacks=[returned, cb],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert trainer.global_step == 4 and float(scaler.get_scale()) == 4096.0  # doubled twice
    assert judged == pytest.approx(returned.losses, rel=1e-6)


# ======================================================================================= sinks in a training loop
def test_trainer_sinks_with_accumulation_and_bf16_read_back_from_their_files(tmp_path: Path) -> None:
    """torch_gradstats.Trainer on the ResNet with accumulation over 2 micro-batches (each epoch's last window ends
    with a short batch of 2), bf16 autocast, and the CSV, JSON Lines and TensorBoard sinks every 2nd optimizer step:
    the three files hold the same steps and the figures of the gradients the optimizer stepped with (no clipping
    here)."""
    pytest.importorskip("tensorboard")
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    import torch_gradstats as tg
    from torch_gradstats.integrations import CSVSink, JSONLSink
    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    net = model_zoo.resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    ref: list[dict[str, float]] = []
    opt.register_step_pre_hook(lambda o, a, k: ref.append(
        {n: float(p.grad.double().norm()) for n, p in net.named_parameters() if p.grad is not None}))
    g = torch.Generator().manual_seed(0)
    # 5 batches of 4, then one of 2
    data = _loader(torch.randn(22, 3, 8, 8, generator=g), torch.randint(0, 5, (22,), generator=g), 4)
    writer = SummaryWriter(str(tmp_path / "tb"))
    sinks = [CSVSink(tmp_path / "g.csv"), JSONLSink(tmp_path / "g.jsonl"), TensorBoardSink(writer)]
    trainer = tg.Trainer(net, opt, nn.functional.cross_entropy, accumulation_steps=2, amp_dtype=torch.bfloat16,
                         log_to=sinks, log_every=2, progress=False)
    trainer.fit(data, epochs=2)
    sinks[0].close()
    sinks[1].close()
    writer.close()
    assert len(ref) == 6  # 3 optimizer steps per epoch
    with open(tmp_path / "g.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    with open(tmp_path / "g.jsonl") as f:
        lines = {d["step"]: d for d in map(json.loads, f)}
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = {e.step: e.value for e in acc.Scalars("grad/total_norm")}
    assert sorted(rows) == sorted(lines) == sorted(events) == [0, 2, 4]
    for step in (0, 2, 4):
        want = ref[step]
        assert float(rows[step]["total_norm"]) == pytest.approx(_total(want), rel=REL)
        assert lines[step]["total_norm"] == pytest.approx(_total(want), rel=REL)
        assert events[step] == pytest.approx(_total(want), rel=REL)
        for name, norm in want.items():
            assert float(rows[step][f"norm/{name}"]) == pytest.approx(norm, rel=REL), (step, name)
            assert lines[step][f"norm/{name}"] == pytest.approx(norm, rel=REL), (step, name)


# ================================================================================================ other backends
@needs_hf
@pytest.mark.slow
def test_hf_report_to_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report_to=["mlflow"] with a local file store, gradient accumulation and an activation watch (whose
    ``act/origin`` name MLflow's integration must skip, not choke on): every figure is in the run, at its step."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from torch_gradstats.integrations.transformers import add_to_trainer

    while mlflow.active_run() is not None:  # a run an earlier test left active would receive this one's figures
        mlflow.end_run()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:" + str(tmp_path / "mlruns"))
    # A URI an earlier test set in code (mlflow.set_tracking_uri) would outrank the environment's.
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    trainer = _hf_trainer(tmp_path / "out", report_to=["mlflow"], max_steps=3)
    add_to_trainer(trainer, watch_activations=True)
    logs = _hf_train(trainer)
    assert sorted(logs) == [1, 2, 3]
    client = MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for name in ("grad/total_norm", "grad/norm/transformer.h.1.mlp.c_fc.weight", "act/nonfinite"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert sorted(history) == [1, 2, 3], name
        for step in (1, 2, 3):
            assert history[step] == pytest.approx(logs[step][name], rel=1e-12), (name, step)
    for step in (1, 2, 3):
        ref = trainer.ref[step]
        _assert_hf_matches(logs[step], ref)


@needs_lightning
@pytest.mark.slow
def test_lightning_wandb_logger_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's WandbLogger, offline: the run file's history records hold the figures at Lightning's steps."""
    pytest.importorskip("wandb")
    import json

    from lightning.pytorch.loggers import WandbLogger
    from test_integrations_wandb import _key, completed_records

    from torch_gradstats.integrations.lightning import GradStatsCallback

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    L = _pl()
    ref = _reference_callback()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, callbacks=[ref, GradStatsCallback(every_n_steps=2)],
                        logger=WandbLogger(offline=True, save_dir=str(tmp_path), project="gradstats"),
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model_zoo.lightning_module(), model_zoo.classification_data(8))
    trainer.logger.experiment.finish()  # this run's own: wandb.run may be another (or none) in a shared process
    (path,) = tmp_path.rglob("*.wandb")
    rows = {}
    for rec in completed_records(path):  # written by W&B's own service, after finish() returns
        if rec.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            if "grad_2.0_norm_total" in row:
                rows[row["trainer/global_step"]] = row
    assert sorted(rows) == [1, 3]
    for step, row in rows.items():
        r = ref.by_logger_step[step][0]
        assert row["grad_2.0_norm_total"] == pytest.approx(_total(r), rel=REL)
        assert row["grad_2.0_norm/net.2.weight"] == pytest.approx(r["net.2.weight"], rel=REL)
        assert row["grad_stats/health"] == 1
