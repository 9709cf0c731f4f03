"""ActivationWatch on the architectures people train (tests/model_zoo.py), in training and under inference_mode:
each names the module that made the non-finite value."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import pytest
import torch
from model_zoo import CheckpointedEncoder, classification_data, gpt2, lightning_module, resnet
from torch import nn

from torch_gradstats.monitors.activations import ActivationReport, ActivationWatch

MODES = ["train", "inference"]


def _run(model: nn.Module, mode: str, call: Any, watch: ActivationWatch) -> ActivationReport:
    """One step: forward and backward in training, a forward under torch.inference_mode in evaluation."""
    if mode == "train":
        model.train()
        loss = call()
        loss.backward()
    else:
        model.eval()
        with torch.inference_mode():
            call()
    return watch.report()


# ------------------------------------------------------------------------------------------------- ResNet
@pytest.mark.parametrize("mode", MODES)
def test_resnet_nan_in_one_conv_of_one_block(mode):
    model = resnet()
    with torch.no_grad():
        model.layer2[1].conv1.weight[3, 2, 1, 1] = math.nan
    x = torch.randn(4, 3, 8, 8)
    with ActivationWatch(model) as watch:
        report = _run(model, mode, lambda: model(x).sum(), watch)
    assert report.forward_origin == "layer2.1.conv1", report.summary()
    assert math.isnan(report.weight_max_abs) and math.isfinite(report.input_max_abs)
    assert report.forward_propagators[:2] == ["layer2.1.bn1", "layer2.1.relu"]
    assert report.forward_propagators[-2:] == ["fc", "<root>"]
    assert "layer2.0.conv1" not in report.forward_propagators  # the block before is clean
    assert report.backward_recorded == (mode == "train")
    assert report.modules["layer2.1.relu"].calls == 2  # one ReLU(inplace=True), called twice per block


def test_resnet_gradients_are_the_same_watched_or_not():
    """The in-place residual and ReLU(inplace=True) run through the watch's backward nodes unchanged."""
    x = torch.randn(4, 3, 8, 8)
    plain, watched = resnet(), resnet()
    plain(x).square().sum().backward()
    with ActivationWatch(watched) as watch:
        watched(x).square().sum().backward()
        report = watch.report()
    for (name, p), q in zip(plain.named_parameters(), watched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert not report.nonfinite and report.backward_recorded
    assert report.modules["layer1.0.bn2"].grad_max_abs > 0  # the output that `out += identity` changes in place
    assert report.backward_order[0] == "fc"


def test_resnet_evaluation_then_training_with_one_watch():
    model = resnet()
    x = torch.randn(2, 3, 8, 8)
    with ActivationWatch(model) as watch:
        evaluation = _run(model, "inference", lambda: model(x), watch)
        training = _run(model, "train", lambda: model(x).sum(), watch)
        with torch.no_grad():
            model.eval()
            model(x)
        no_grad = watch.report()
    assert (evaluation.step, training.step, no_grad.step) == (0, 1, 2)
    assert not evaluation.backward_recorded and training.backward_recorded and not no_grad.backward_recorded
    assert evaluation.modules["fc"].max_abs > 0 and training.modules["fc"].grad_max_abs == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------- GPT-2
@pytest.mark.parametrize("mode", MODES)
def test_gpt2_attention_overflow_under_bfloat16_autocast(mode):
    pytest.importorskip("transformers")
    model = gpt2()
    attn = model.transformer.h[1].attn
    with torch.no_grad():  # q and k of block 1 stay finite in bfloat16; their dot products overflow it
        attn.c_attn.weight[:, :64].mul_(1e20)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    # containers too: the attention scores are a matmul in GPT2Attention's own forward
    with ActivationWatch(model, modules=lambda path, m: True) as watch:

        def call() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(ids, labels=ids).loss  # the loss is computed inside forward

        report = _run(model, mode, call, watch)
    assert report.forward_origin == "transformer.h.1.attn", report.summary()
    assert report.forward_propagators[-1] == "<root>"  # the loss, inside the root's forward, is NaN too
    assert "transformer.h.0.attn" not in report.forward_propagators
    assert math.isfinite(report.input_max_abs)
    assert report.modules["transformer.h.1.attn.c_attn"].max_abs > 1e18  # large, finite
    assert report.backward_recorded == (mode == "train")


# ------------------------------------------------------------------------------------------------- checkpointing
def _encoder_report(use_reentrant: bool, checkpointed: bool, mode: str = "train",
                    poison: bool = False) -> ActivationReport:  # fmt: skip
    model = CheckpointedEncoder(use_reentrant, checkpointed)
    if poison:
        with torch.no_grad():
            model.encoder.layers[1].linear1.weight[0, 0] = math.inf
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    with ActivationWatch(model) as watch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's notes on checkpointing without inputs that require grad
        return _run(model, mode, lambda: model(x).square().sum(), watch)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_encoder_figures_equal_those_without_checkpointing(use_reentrant):
    plain = _encoder_report(use_reentrant, checkpointed=False)
    ckpt = _encoder_report(use_reentrant, checkpointed=True)
    assert list(ckpt.modules) == list(plain.modules) and ckpt.forward_order == plain.forward_order
    assert plain.modules["encoder.layers.0.linear1"].grad_norm is not None
    assert sorted(ckpt.backward_order) == sorted(plain.backward_order)
    for name, fig in plain.modules.items():
        got = ckpt.modules[name]
        assert got.calls == fig.calls == 1, name  # the recomputation is no second call
        assert got.norm == pytest.approx(fig.norm, rel=1e-5), name
        assert got.max_abs == pytest.approx(fig.max_abs, rel=1e-5), name
        for field in ("grad_norm", "grad_max_abs", "grad_input_max_abs"):
            want = getattr(fig, field)
            assert getattr(got, field) == (want if want is None else pytest.approx(want, rel=1e-4)), (name, field)
        assert (got.grad_nonfinite, got.grad_input_nonfinite) == (fig.grad_nonfinite, fig.grad_input_nonfinite)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_encoder_names_the_layer_that_overflowed(use_reentrant, mode):
    plain = _encoder_report(use_reentrant, checkpointed=False, mode=mode, poison=True)
    ckpt = _encoder_report(use_reentrant, checkpointed=True, mode=mode, poison=True)
    assert ckpt.forward_origin == plain.forward_origin == "encoder.layers.1.linear1", ckpt.summary()
    assert ckpt.forward_propagators == plain.forward_propagators
    name = "encoder.layers.1.linear1"
    assert ckpt.modules[name].inf_count + ckpt.modules[name].nan_count == plain.modules[name].inf_count + \
        plain.modules[name].nan_count  # fmt: skip
    assert ckpt.backward_recorded == (mode == "train")


class _ProbedResNet(nn.Module):
    """The ResNet and a linear probe whose steps call the submodules, never this module's own forward (as a
    LightningModule's training and validation steps do)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = resnet()
        self.probe = nn.Linear(5, 2)


def test_an_evaluation_calling_another_module_first_leaves_the_training_steps_whole(caplog):
    """The model's own forward is not called, so a step starts at the first watched module called: one in training
    and one in evaluation (``model.eval()``). An evaluation calling the probe alone on held-out features, run before
    the first training step (as Lightning's sanity check runs) and between them, is a step of its own each time,
    and each training step (the ResNet, then the probe) one whole step, backward included. (Before: the probe, the
    first module ever called, started every step, so each training step's ResNet forward fell into the step before,
    its backward out of every report, with a WARNING.)"""
    model = _ProbedResNet()
    x, features = torch.randn(2, 3, 8, 8), torch.randn(4, 5)
    reports = []
    with ActivationWatch(model) as watch, caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        for _ in range(2):
            model.eval()
            with torch.inference_mode():
                model.probe(features)
            model.train()
            model.probe(model.net(x)).square().sum().backward()
            reports.append(watch.report())
    assert watch.step == 3 and [r.step for r in reports] == [1, 3]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    for report in reports:
        assert report.backward_recorded and not report.nonfinite
        for name in ("net.conv1", "net.layer2.1.conv2", "probe"):
            assert report.modules[name].calls == 1, name
            assert report.modules[name].grad_max_abs > 0, name
        assert report.modules["net.conv1"].input_max_abs == pytest.approx(float(x.abs().max()))
        assert not report.inputs_nonfinite


# ------------------------------------------------------------------------------------------------- Lightning
def _trainer(max_steps: int, callbacks: list, val_batches: float = 0) -> Any:
    pl = pytest.importorskip("lightning.pytorch")
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=val_batches)  # fmt: skip


def test_lightning_training_step_calling_self_net_counts_steps_and_names_the_origin(caplog):
    pytest.importorskip("lightning.pytorch")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    module = lightning_module()
    with torch.no_grad():
        module.net[2].weight[0, 0] = math.inf  # net.2's output is inf from finite inputs
    cb = GradStatsCallback(on_nonfinite="skip", watch_activations=True)
    trainer = _trainer(3, [cb])
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, classification_data(3))
    said = [r.getMessage() for r in caplog.records if "non-finite gradient" in r.getMessage()]
    assert len(said) == 3, said
    assert all("forward origin net.2" in s for s in said), said
    assert not any("step None" in s or "activations finite" in s for s in said)
    assert cb.last_activation_report is not None and cb.last_activation_report.step == 2


@pytest.mark.parametrize("mode", MODES)
def test_lightning_module_self_net_in_fit_and_validate(mode):
    module = lightning_module()
    with torch.no_grad():
        module.net[2].weight[0, 0] = math.inf
    watch = ActivationWatch(module)
    trainer = _trainer(1, [], val_batches=1.0)  # one step: after it, the NaN gradients are in every weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "train":
            trainer.fit(module, classification_data(1))
        else:
            trainer.validate(module, classification_data(3))  # under torch.inference_mode
    report = watch.report()
    watch.remove()
    assert report.step == (0 if mode == "train" else 2)  # validation: one step per batch
    assert report.forward_origin == "net.2", report.summary()
    assert report.backward_recorded == (mode == "train")
