"""Evaluation between training steps changes no figure: the callbacks with every monitor and policy on (activation
watch, per-example norms, flight recorder, spike guard, adaptive clipping, measured update ratios) log exactly what
the same run without evaluation logs (both tests in the slow tier: two runs of a framework each).

- Lightning: the sanity check before training and a validation every 3 batches under ``inference_mode``, with
  gradient accumulation over 2 batches (so a validation falls between the micro-batches of an optimizer step) and
  bf16 autocast.
- Hugging Face: GPT-2 from the model zoo evaluated (under ``no_grad``) after every optimizer step while a block is
  unfrozen at step 2 and another frozen at step 4 (the callback's gradient hooks and update-ratio copy are made
  again then), then ``evaluate()`` and ``predict()`` after training.
"""

from __future__ import annotations

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

from torch_gradstats import AdaptiveClip, FlightRecorder, SpikeGuard

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("one_thread")


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _assert_same_figures(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want)
    for step, row in want.items():
        assert sorted(got[step]) == sorted(row), step
        for key, value in row.items():
            assert _same(got[step][key], value), (step, key, got[step][key], value)


# ================================================================================================ Lightning
@pytest.mark.slow  # two Lightning fits
@pytest.mark.skipif(not _installed("lightning"), reason="needs lightning")
def test_lightning_validation_between_micro_batches_changes_no_figure(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    def run(validate: bool) -> dict[int, dict[str, float]]:
        cb = GradStatsCallback(every_n_steps=1, per_example=True, watch_activations=True,
                               flight_recorder=FlightRecorder(8, dump_dir=tmp_path),
                               spike_guard=SpikeGuard(min_history=2), adaptive_clip=AdaptiveClip(warmup=2),
                               log_update_ratio=True)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[cb], precision="bf16-mixed",
                            logger=CSVLogger(str(tmp_path), name=f"validate_{validate}"), log_every_n_steps=1,
                            accumulate_grad_batches=2, val_check_interval=3 if validate else 1.0,
                            limit_val_batches=2 if validate else 0, num_sanity_val_steps=2 if validate else 0,
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model_zoo.lightning_module(), model_zoo.classification_data(8),
                        model_zoo.classification_data(4, seed=1))
        assert int(cb.spike_guard.steps) == 4  # type: ignore[union-attr]  # the optimizer steps alone
        rows: dict[int, dict[str, float]] = {}
        with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
            for row in csv.DictReader(f):
                rows.setdefault(int(row["step"]), {}).update(
                    {k: float(v) for k, v in row.items() if v and k not in ("step", "epoch", "val_loss")})
        return rows

    validated, plain = run(True), run(False)
    assert sorted(plain) == list(range(4))
    for key in ("examples/max_norm", "act/nonfinite", "guard/loss_z", "clip/threshold",
                "grad_stats/update_ratio/net.0.weight"):
        assert all(key in row for row in plain.values()), key
    _assert_same_figures(validated, plain)


# ================================================================================================ Hugging Face
@pytest.mark.slow  # two Hugging Face runs of GPT-2, with evaluations
@pytest.mark.skipif(not _installed("transformers", "accelerate"), reason="needs transformers and accelerate")
def test_hf_evaluation_between_unfreezing_steps_changes_no_figure(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    T = 16
    g = torch.Generator().manual_seed(0)
    train = [{"input_ids": x, "labels": x, "position_ids": torch.arange(T)} for x in torch.randint(0, 64, (24, T),
                                                                                                    generator=g)]
    held_out = [{"input_ids": x, "labels": x, "position_ids": torch.arange(T)} for x in torch.randint(0, 64, (8, T),
                                                                                                       generator=g)]

    def freeze(model: nn.Module, prefix: str, frozen: bool) -> list[nn.Parameter]:
        params = [p for n, p in model.named_parameters() if n.startswith(prefix)]
        for p in params:
            p.requires_grad_(not frozen)
        return params

    def run(evaluate: bool) -> tuple[dict[int, dict[str, float]], Any]:
        model = model_zoo.gpt2()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        for p in model.parameters():
            p.requires_grad_(False)
        freeze(model, "transformer.h.1.", False)
        freeze(model, "transformer.ln_f.", False)

        class Unfreeze(transformers.TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              lr_scheduler: Any = None, **kw: Any) -> None:
                if state.global_step == 2:  # a param group of its own learning rate, the scheduler told of it
                    optimizer.add_param_group({"params": freeze(model, "transformer.h.0.", False), "lr": 3e-3,
                                               "initial_lr": 3e-3})
                    lr_scheduler.base_lrs.append(3e-3)
                    lr_scheduler.lr_lambdas.append(lr_scheduler.lr_lambdas[0])
                if state.global_step == 4:
                    freeze(model, "transformer.h.1.", True)

        cb = GradStatsCallback(log_update_ratio=True, watch_activations=True, per_example=True,
                               flight_recorder=FlightRecorder(8, dump_dir=tmp_path),
                               spike_guard=SpikeGuard(min_history=2), adaptive_clip=AdaptiveClip(warmup=2))
        optimizer = cb.wrap_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                                        fused=True))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"evaluate_{evaluate}"), per_device_train_batch_size=4,
            per_device_eval_batch_size=4, max_steps=6, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", disable_tqdm=True, seed=0, eval_strategy="steps" if evaluate else "no", eval_steps=1,
            lr_scheduler_type="constant")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train,
                                       eval_dataset=held_out if evaluate else None, callbacks=[Unfreeze()],
                                       optimizers=(optimizer, None))
        add_to_trainer(trainer, cb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
            if evaluate:
                trainer.evaluate()
                trainer.predict(held_out)
        logs = {e["step"]: {k: float(v) for k, v in e.items() if k.startswith(("grad/", "guard/", "clip/", "act/",
                                                                               "examples/"))}
                for e in trainer.state.log_history if "loss" in e}
        return logs, trainer

    (evaluated, trainer), (plain, _) = run(True), run(False)
    assert sum("eval_loss" in e for e in trainer.state.log_history) == 7  # after each step, and evaluate()
    assert sorted(plain) == list(range(1, 7))
    assert any(k.startswith("grad/update_ratio/transformer.h.0.") for k in plain[3])  # unfrozen at step 2
    assert not any(k.startswith("grad/update_ratio/transformer.h.1.") for k in plain[5])  # frozen at step 4
    for key in ("examples/max_norm", "act/nonfinite", "guard/loss_z", "clip/threshold"):
        assert all(key in row for row in plain.values()), key
    _assert_same_figures(evaluated, plain)
