"""Monitors left attached while the model generates text (``model.generate()``: many forwards, a KV cache, eval mode,
``no_grad`` / ``inference_mode``) or runs evaluation forwards between training steps: the training steps' figures
are those of the same run without the generation.

- ActivationWatch on GPT-2 and a ``TransformerEncoder``: greedy and sampled generation, with and without
  ``inference_mode``, a padded batch of different lengths with its attention mask; memory stays bounded.
- PerExampleNorms after generation and eval forwards (with grad on, never backpropagated): each example's norm
  against float64 per-example gradients, one backward per example.
- The Hugging Face callback with every monitor on and a callback generating samples at ``on_step_end``.
"""

from __future__ import annotations

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

from torch_gradstats import ActivationWatch, FlightRecorder, PerExampleNorms, SpikeGuard

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.usefixtures("one_thread")

T = 8


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _quiet_gpt2(seed: int = 0) -> Any:
    model = model_zoo.gpt2(seed)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _generate(model: Any, *, sample: bool, inference: bool, cache: bool = True) -> Any:
    """A padded batch of two prompts of different lengths (left padding, as decoder-only generation wants)."""
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    was = model.training
    model.eval()
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=sample,
                             use_cache=cache, pad_token_id=0, top_k=0 if sample else None)
    model.train(was)
    return out


def _train_step(model: Any, batch: torch.Tensor) -> None:
    out = model(input_ids=batch, labels=batch, position_ids=torch.arange(batch.shape[1]).expand_as(batch))
    out.loss.backward()


def _figures(watch: ActivationWatch) -> dict[str, Any]:
    report = watch.report()
    return {"modules": report.modules, "origin": report.origin, "forward_order": report.forward_order,
            "backward_order": report.backward_order, "nonfinite": report.nonfinite}


# ================================================================================================ ActivationWatch
@pytest.mark.skipif(not _installed("transformers"), reason="needs transformers")
@pytest.mark.parametrize("every", [1, 3])
def test_watch_training_figures_after_generation_are_those_without_it(every: int) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(1, 64, (2, T), generator=g) for _ in range(7)]

    def run(generate: bool) -> list[dict[str, Any] | None]:
        model = _quiet_gpt2()
        watch = ActivationWatch(model, every_n_steps=every)
        seen: list[dict[str, Any] | None] = []
        for k, batch in enumerate(batches):
            if generate:  # before the step: its forwards are steps of the watch's count too
                _generate(model, sample=k % 2 == 1, inference=k % 3 != 0)
            model.zero_grad()
            _train_step(model, batch)
            seen.append(_figures(watch) if watch.report().step == watch.step else None)  # recorded
        # Bounded: the latest recorded step's calls alone, nothing per forward kept
        assert not any(watch._open.values()) and len(watch._fwd_names) <= len(watch.module_names)
        assert len(watch._fwd) <= 2 * len(watch.module_names)
        watch.remove()
        return seen

    with_generation, plain = run(True), run(False)
    recorded = [f is not None for f in plain]
    assert recorded == [k % every == 0 for k in range(len(batches))]
    assert [f is not None for f in with_generation] == recorded  # the training steps recorded are the same ones
    for got, want in zip(with_generation, plain):
        assert got == want


# ================================================================================================ Hugging Face
@pytest.mark.slow  # two Hugging Face runs of GPT-2
@pytest.mark.skipif(not _installed("transformers", "accelerate"), reason="needs transformers and accelerate")
@pytest.mark.parametrize("every", [1, 2])
def test_hf_callback_figures_with_samples_generated_at_step_end_are_those_without(tmp_path: Path, every: int) -> None:
    transformers = pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import GradStatsCallback, add_to_trainer

    g = torch.Generator().manual_seed(0)
    train = [{"input_ids": x, "labels": x, "position_ids": torch.arange(T)} for x in torch.randint(1, 64, (16, T),
                                                                                                    generator=g)]

    def run(generate: bool) -> tuple[dict[int, dict[str, Any]], dict[int, Any], GradStatsCallback]:
        model = _quiet_gpt2()
        with torch.no_grad():  # the last position, which only a long sample reaches: its forward is non-finite
            model.transformer.wpe.weight[15] = math.inf
        cb = GradStatsCallback(watch_activations=True if every == 1 else ActivationWatch(model, every_n_steps=every),
                               per_example=True,
                               flight_recorder=FlightRecorder(8, dump_dir=tmp_path / f"gen_{generate}_{every}"),
                               spike_guard=SpikeGuard(min_history=2))
        reports: dict[int, Any] = {}

        class Samples(transformers.TrainerCallback):  # sample logging, a common pattern
            def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                if generate and state.global_step % 2 == 1:
                    _generate(model, sample=False, inference=True)
                    model.eval()
                    with torch.inference_mode():  # positions 13 to 15: its last forward is non-finite
                        model.generate(input_ids=train[0]["input_ids"][None, :5].repeat(1, 3)[:, :13],
                                       max_new_tokens=4, do_sample=False, pad_token_id=0)
                    model.train()
                    if every == 1:  # (a watch counts a forward in training mode with grad on as a training step)
                        # a sample's loss with grad on, in training mode, never backpropagated: no forward of a step
                        model(input_ids=train[1]["input_ids"][None], labels=train[1]["input_ids"][None]).loss.item()

        class Keep(transformers.TrainerCallback):  # after ours: the activation report it logged with
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    report = cb.last_activation_report
                    reports[state.global_step] = (report.modules, report.forward_order, report.backward_recorded)

        optimizer = cb.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"out_{generate}_{every}"), per_device_train_batch_size=4, max_steps=4,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
            lr_scheduler_type="constant")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=train, callbacks=[Samples(), Keep()],
                                       optimizers=(optimizer, None))
        add_to_trainer(trainer, cb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        logs = {e["step"]: {k: v if isinstance(v, str) else float(v) for k, v in e.items()
                            if k.startswith(("grad/", "guard/", "act/", "examples/")) or k == "loss"}
                for e in trainer.state.log_history if "loss" in e}
        return logs, reports, cb

    (logs, reports, cb), (plain_logs, plain_reports, _) = run(True), run(False)
    assert sorted(plain_logs) == [1, 2, 3, 4] and all("examples/max_norm" in r for r in plain_logs.values())
    assert all(row["act/nonfinite"] == 0.0 for row in logs.values())  # the training steps were finite
    assert cb.skipped_steps == []
    for step, row in plain_logs.items():
        assert sorted(logs[step]) == sorted(row), step
        for key, value in row.items():
            assert logs[step][key] == value or (math.isnan(value) and math.isnan(logs[step][key])), (step, key)
    for step, want in plain_reports.items():  # the training step's activations, not the generation's last forward
        assert reports[step] == want, step


# ================================================================================================ Lightning
@pytest.mark.slow  # two Lightning fits of GPT-2
@pytest.mark.skipif(not _installed("lightning", "transformers"), reason="needs lightning and transformers")
def test_lightning_callback_figures_with_generation_in_validation_and_batch_end_are_those_without() -> None:
    L = pytest.importorskip("lightning.pytorch")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    g = torch.Generator().manual_seed(0)
    data = torch.randint(1, 64, (12, T), generator=g)

    class LM(L.LightningModule):
        def __init__(self, generate: bool) -> None:
            super().__init__()
            self.model, self.generate = _quiet_gpt2(), generate

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.model(input_ids=x, labels=x, position_ids=torch.arange(T).expand_as(x)).loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.generate:  # under Lightning's inference_mode, in eval mode
                self.model.generate(input_ids=batch[0][:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Samples(L.Callback):  # before ours: its batch-end generation runs before the callback's report
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if pl_module.generate:
                _generate(pl_module.model, sample=True, inference=False)

    def run(generate: bool) -> tuple[list[Any], list[dict[str, str]]]:
        cb = GradStatsCallback(every_n_steps=1, watch_activations=True, log_update_ratio=True, per_example=True,
                               spike_guard=SpikeGuard(min_history=2))
        reports: list[Any] = []
        logged: list[dict[str, str]] = []

        class Keep(L.Callback):  # after ours
            def on_train_batch_end(self, *args: Any) -> None:
                report = cb.last_activation_report
                reports.append((report.modules, report.forward_order, report.backward_recorded))
                logged.append({k: repr(float(v)) for k, v in cb.taker.policy_figures.items()})  # nan == nan

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[Samples(), cb, Keep()],
                            logger=False, log_every_n_steps=1, val_check_interval=1, limit_val_batches=1,
                            num_sanity_val_steps=1, enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(LM(generate), loader, loader)
        assert cb.skipped_steps == []
        return reports, logged

    (reports, logged), (plain_reports, plain_logged) = run(True), run(False)
    assert len(plain_reports) == 3 and all(r[2] for r in plain_reports)
    assert logged == plain_logged
    assert reports == plain_reports  # the training step's activations, not a generated sample's


# ================================================================================================ PerExampleNorms
@pytest.mark.skipif(not _installed("transformers"), reason="needs transformers")
def test_per_example_norms_after_generation_and_eval_forwards_with_grad_are_right() -> None:
    import copy

    model = _quiet_gpt2()
    reference = copy.deepcopy(model).double()
    x = torch.randint(1, 64, (3, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T).expand_as(x)
    pe = PerExampleNorms(model)
    loss = model(input_ids=x, labels=x, position_ids=pos).loss
    uses = dict(pe._uses)  # uses of each parameter still to come in the backward: those of one forward
    loss.backward()
    model.zero_grad()
    pe.reset()
    _generate(model, sample=False, inference=False)
    _generate(model, sample=True, inference=True)
    model.eval()
    model(input_ids=x[:2], labels=x[:2], position_ids=pos[:2])  # an eval loss with grad on, never backpropagated
    model.train()
    loss = model(input_ids=x, labels=x, position_ids=pos).loss
    # The evaluation's graph is gone: its uses are not awaited, so each layer's per-example figures are reduced as
    # its gradient arrives, not kept to the backward's end.
    assert dict(pe._uses) == uses
    loss.backward()
    got = pe.norms()
    want = []
    for i in range(x.shape[0]):  # float64, one backward per example
        reference.zero_grad()
        reference(input_ids=x[i : i + 1], labels=x[i : i + 1], position_ids=pos[i : i + 1]).loss.backward()
        want.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in reference.parameters()
                                  if p.grad is not None)))
    assert got.shape == (3,)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=0)
    pe.remove()


# ================================================================================================ TransformerEncoder
@pytest.mark.parametrize("inference", [False, True])
def test_watch_reads_a_transformer_encoders_nested_tensors_in_evaluation(inference: bool) -> None:
    """In evaluation over a padded batch, nn.TransformerEncoder hands its layers' modules nested tensors (its fast
    path): read as their components' elements, padding left out; training afterwards is as without it."""
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])

    def encoder() -> nn.TransformerEncoder:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2)

    def train_step(enc: nn.TransformerEncoder, watch: ActivationWatch) -> dict[str, Any]:
        enc.train()
        enc(x, src_key_padding_mask=mask).sum().backward()
        return _figures(watch)

    enc = encoder()
    seen: dict[str, float] = {}

    def keep(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        assert out.is_nested  # what the watch is given here
        flat = torch.cat([c.reshape(-1) for c in out.unbind()])
        seen["max_abs"], seen["norm"] = float(flat.abs().max()), float(flat.double().norm())

    watch = ActivationWatch(enc)
    handle = enc.layers[0].linear1.register_forward_hook(keep)
    enc.eval()
    with torch.inference_mode() if inference else torch.no_grad():
        out = enc(x, src_key_padding_mask=mask)
    handle.remove()
    figures = watch.report().modules["layers.0.linear1"]
    assert not out.is_nested and not watch.report().nonfinite
    assert figures.max_abs == pytest.approx(seen["max_abs"], rel=1e-6)
    assert figures.norm == pytest.approx(seen["norm"], rel=1e-5)
    after = train_step(enc, watch)
    plain = encoder()
    plain_watch = ActivationWatch(plain)
    assert after == train_step(plain, plain_watch)
    watch.remove()
    plain_watch.remove()
