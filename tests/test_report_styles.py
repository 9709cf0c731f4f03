"""Report keys: the fused clip's coefficient and post-clip norm, and GradReport.to_dict(style=...) checked against the
keys the frameworks themselves log."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torch_gradstats as tg


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    m(torch.randn(5, 4)).square().sum().mul(100).backward()
    return m


# ---------------------------------------------------------------------------------------------- clip
def test_clip_exposes_coefficient_and_post_clip_norm_on_the_device() -> None:
    m = _model()
    reference = [p.grad.clone() for p in m.parameters()]
    stats = tg.clip_grad_norm_(m.named_parameters(), max_norm=1.0)
    assert stats.clip_coef is not None and stats.clipped_norm is not None and stats.clip_norm is not None
    assert stats.clipped_norm.dtype == torch.float64 and stats.clipped_norm.device == stats.device
    pre = torch.cat([g.reshape(-1) for g in reference]).double().norm().item()
    post = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).double().norm().item()
    report = stats.report()
    assert pre > 1.0
    assert report.total_norm == pytest.approx(pre, rel=1e-6)
    assert report.clip_coef == pytest.approx(1.0 / (pre + 1e-6), rel=1e-6)
    assert report.clipped_norm == pytest.approx(post, rel=1e-6)  # what the gradients hold after the clip
    assert report.clipped_norm == pytest.approx(1.0, rel=1e-5)
    d = report.to_dict()
    assert d["clip_coef"] == report.clip_coef and d["clipped_norm"] == report.clipped_norm


def test_clip_below_max_norm_keeps_the_norm() -> None:
    m = _model()
    report = tg.clip_grad_norm_(m.parameters(), max_norm=1e9).report()
    assert report.clip_coef == 1.0 and report.clipped_norm == report.total_norm


def test_unclipped_reports_have_no_clip_keys() -> None:
    d = tg.grad_stats(_model().named_parameters()).report().to_dict()
    assert "clip_coef" not in d and "clipped_norm" not in d


def test_clip_with_a_nan_reports_nan_coefficient_and_norm() -> None:
    m = _model()
    m[0].weight.grad[0, 0] = math.nan
    report = tg.clip_grad_norm_(m.parameters(), max_norm=1.0).report()
    assert math.isnan(report.clip_coef) and math.isnan(report.clipped_norm)  # type: ignore[arg-type]


def test_clip_of_no_gradients() -> None:
    report = tg.clip_grad_norm_([torch.zeros(2, requires_grad=True)], max_norm=1.0).report()
    assert report.clip_coef == 1.0 and report.clipped_norm == 0.0


# ---------------------------------------------------------------------------------------------- styles
def test_default_style_is_todays_keys() -> None:
    report = tg.grad_stats(_model().named_parameters()).report()
    assert report.to_dict(style="default") == report.to_dict()
    assert "total_norm" in report.to_dict() and "norm/0.weight" in report.to_dict()


def test_lightning_style_equals_lightnings_grad_norm() -> None:
    grad_norm = pytest.importorskip("lightning.pytorch.utilities").grad_norm
    m = _model()
    want = {k: float(v) for k, v in grad_norm(m, 2).items()}
    got = tg.grad_stats(m.named_parameters()).report().to_dict(style="lightning")
    assert list(got) == list(want)  # the same keys, in the same order
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5)
    assert tg.grad_stats(m.named_parameters()).report().to_dict(style="lightning", per_param=False) == {
        "grad_2.0_norm_total": got["grad_2.0_norm_total"]}
    m.zero_grad(set_to_none=True)
    assert grad_norm(m, 2) == {} and tg.grad_stats(m.named_parameters()).report().to_dict(style="lightning") == {}


def test_megatron_and_composer_styles() -> None:
    m = _model()
    m[0].bias.grad.zero_()
    report = tg.grad_stats(m.named_parameters()).report()
    zeros = sum(int((p.grad == 0).sum()) for p in m.parameters())
    assert zeros >= 8
    assert report.to_dict(style="megatron") == {"grad-norm": report.total_norm, "num-zeros": zeros}
    per_param = {f"train/l2_norm/grad/{n}": v for n, v in report.norms.items()}
    assert report.to_dict(prefix="train/", style="composer") == {"train/l2_norm/grad/global": report.total_norm,
                                                                 **per_param}
    assert report.to_dict(style="hf") == {"grad_norm": report.total_norm}


def test_update_report_styles_are_the_gradient_keys() -> None:
    from torch_gradstats.monitors.updates import grad_and_weight_stats

    report = grad_and_weight_stats(_model().named_parameters()).report()
    assert report.to_dict(style="megatron") == report.grads.to_dict(style="megatron")


def test_bad_style() -> None:
    report = tg.grad_stats(_model().named_parameters()).report()
    with pytest.raises(ValueError, match="style must be one of default, lightning, hf, megatron, composer"):
        report.to_dict(style="keras")
    with pytest.raises(TypeError, match="style must be a str"):
        report.to_dict(style=2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- integrations
def test_lightning_callback_key_style_and_group_by(tmp_path) -> None:
    L = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from torch_gradstats.integrations.lightning import GradStatsCallback

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)),
        batch_size=8)
    rows = {}
    for style in ("lightning", "megatron", None):
        cb = GradStatsCallback(every_n_steps=1, key_style=style, group_by="layer")
        logger = CSVLogger(tmp_path, name=str(style))
        trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[cb], logger=logger, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
        trainer.fit(Tiny(), data)
        logger.finalize("success")
        import csv
        with open(f"{logger.log_dir}/metrics.csv") as f:
            rows[style] = next(csv.DictReader(f))
        report = cb.last_report
        assert report is not None and report.groups is not None
        assert float(rows[style]["grad_stats/group/net.0/norm"]) == pytest.approx(report.groups.norms["net.0"])
    assert "grad_2.0_norm_total" in rows["lightning"] and "grad_stats/norm/net.0.weight" not in rows["lightning"]
    assert "grad-norm" in rows["megatron"] and "grad_2.0_norm_total" not in rows["megatron"]
    assert float(rows["megatron"]["num-zeros"]) >= 0 and "grad_stats/norm/net.0.weight" in rows["megatron"]
    assert not any(k.startswith(("grad_2.0", "grad-norm")) for k in rows[None])
    with pytest.raises(ValueError, match="key_style must be None or one of"):
        GradStatsCallback(key_style="keras")
    with pytest.raises(TypeError, match="by must be 'layer'"):
        GradStatsCallback(group_by=2.5)  # type: ignore[arg-type]


def test_hf_callback_grad_norm_is_the_trainers_and_groups_are_logged(tmp_path) -> None:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from torch_gradstats.integrations.transformers import add_to_trainer

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids])
    cb = add_to_trainer(trainer, group_by="layer")
    assert cb.key_style == "hf"
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2
    for entry in logged:
        # the Trainer's own pre-clip grad_norm, which ours equals (and never replaces)
        assert entry["grad_norm"] == pytest.approx(entry["grad/total_norm"], rel=1e-5)
        assert {"grad/group/transformer.h.0/norm", "grad/group/transformer.h.1/max_abs",
                "grad/group/transformer.ln_f/nonfinite", "grad/group/transformer.wte/norm"} <= entry.keys()
    assert cb.last_report is not None
    assert cb.last_report.to_dict(style="hf")["grad_norm"] == pytest.approx(logged[-1]["grad_norm"], rel=1e-5)


def test_tensorboard_sink_key_style(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from torch_gradstats.integrations import metrics
    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    report = tg.grad_stats(_model().named_parameters()).report()
    assert metrics(report, "train/", style="megatron") == {"train/grad-norm": report.total_norm,
                                                           "train/num-zeros": float(report.zero_count)}
    writer = SummaryWriter(str(tmp_path))
    TensorBoardSink(writer, prefix="", key_style="lightning").log(report, 3)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(report.to_dict(style="lightning"))
    assert acc.Scalars("grad_2.0_norm_total")[0].value == pytest.approx(report.total_norm, rel=1e-6)
