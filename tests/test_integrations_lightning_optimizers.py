"""The Lightning callback with several optimizers: a small GAN in manual optimization (generator and discriminator,
each with its own optimizer), trained for real on the CPU (no mocks). Each optimizer's logged figures are compared,
from the CSVLogger's files, with float64 figures of exactly that optimizer's parameters' gradients, recorded at the
same hook by a callback placed before ours."""

from __future__ import annotations

import csv
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch_gradstats import ActivationWatch, AdaptiveClip, SpikeGuard

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger

from torch_gradstats.integrations.lightning import GradStatsCallback

pytestmark = pytest.mark.usefixtures("one_thread")

G_LR, D_LR = 0.01, 0.005
G_NAMES = ["generator.0.weight", "generator.0.bias", "generator.2.weight", "generator.2.bias"]
D_NAMES = ["discriminator.0.weight", "discriminator.0.bias", "discriminator.2.weight", "discriminator.2.bias"]
NAMES = {"generator": G_NAMES, "discriminator": D_NAMES}
SPIKE = 10  # the batch whose generator loss is multiplied by 1e4


class GAN(L.LightningModule):
    """The canonical Lightning GAN step: ``self.optimizers()``, ``manual_backward``, one step of each optimizer per
    batch. Without ``toggle_optimizer`` the generator's backward also leaves gradients on the discriminator, which its
    optimizer zeroes before its own backward: a read of the whole module at the generator's step would count them."""

    def __init__(self, spike_at: int | None = None, toggle: bool = False, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.spike_at = spike_at  # the batch whose generator loss is multiplied by 1e4
        self.toggle = toggle
        self.nan_at = nan_at  # the batch whose discriminator gradient gets a NaN

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(int(self.global_step)))
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        if self.toggle:
            self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), ones)
        if self.spike_at is not None and batch_idx == self.spike_at:
            g_loss = g_loss * 1e4
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        if self.toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        if batch_idx == self.nan_at:
            self.discriminator[2].weight.grad[0, 0] = float("nan")
        d_opt.step()
        if self.toggle:
            self.untoggle_optimizer(d_opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.generator.parameters(), lr=G_LR),
                torch.optim.SGD(self.discriminator.parameters(), lr=D_LR)]


class Recorder(L.Callback):
    """Float64 figures of the stepping optimizer's own parameters at every optimizer step (before our callback),
    and each optimizer's weights before its step and at the batch's end."""

    def __init__(self) -> None:
        self.norms: dict[tuple[int, str], dict[str, float]] = {}  # (batch, optimizer) -> name -> ||g||
        self.weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.before: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.others: dict[tuple[int, str], float] = {}  # sum of squares of the other parameters' gradients
        self.fp16_underflow: dict[tuple[int, str], float] = {}  # non-zero elements below fp16's smallest normal

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        which = "generator" if optimizer is trainer.optimizers[0] else "discriminator"
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        params = [(n, p) for n, p in pl_module.named_parameters() if id(p) in mine]
        self.norms[(batch, which)] = {n: float(p.grad.double().norm()) for n, p in params}
        self.before[(batch, which)] = {n: p.detach().clone() for n, p in params}
        grads = [p.grad.double() for _, p in params]
        numel = sum(g.numel() for g in grads)
        self.fp16_underflow[(batch, which)] = sum(
            int(((g != 0) & (g.abs() < 2.0**-14)).sum()) for g in grads) / numel
        self.others[(batch, which)] = sum(float(p.grad.double().norm()) ** 2 for p in pl_module.parameters()
                                          if id(p) not in mine and p.grad is not None)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[batch_idx] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _data(n: int = 128) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g) + 2.0),
                                       batch_size=8)


def _trainer(tmp_path: Path, callbacks: list, **kw: Any) -> Any:
    return L.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=CSVLogger(str(tmp_path)),
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=kw.pop("enable_checkpointing", False),
                     log_every_n_steps=kw.pop("log_every_n_steps", 1), **kw)


def _fit(trainer: Any, module: Any, **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), **kw)


def _rows(trainer: Any) -> dict[int, dict[str, float]]:
    """The CSVLogger's rows merged by logger step (each optimizer's figures are written by a call of their own)."""
    rows: dict[int, dict[str, float]] = {}
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update(
                {k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return rows


def test_each_optimizer_logs_the_figures_of_its_own_parameters(tmp_path: Path) -> None:
    rec = Recorder()
    clip = AdaptiveClip(warmup=4, z_thresh=1.0)
    cb = GradStatsCallback(optimizer_names=("generator", "discriminator"), log_weight_norms=True, adaptive_clip=clip)
    trainer = _trainer(tmp_path, [rec, cb], max_epochs=1)
    _fit(trainer, GAN())
    rows = _rows(trainer)
    assert sorted(rows) == list(range(16))  # one logger step per batch, both optimizers' figures at it
    # each optimizer's clip: its thresholds are those of a clip fed that optimizer's own norms, step after step
    replay = {which: AdaptiveClip(warmup=4, z_thresh=1.0) for which in NAMES}
    clipped = 0
    for batch, row in rows.items():
        for which, ref_clip in replay.items():
            norm = math.sqrt(sum(v * v for v in rec.norms[(batch, which)].values()))
            threshold = float(ref_clip.threshold(torch.tensor(norm, dtype=torch.float64)))
            assert row[f"clip/{which}/threshold"] == pytest.approx(threshold, rel=1e-6), (batch, which)
            clipped += row[f"clip/{which}/coef"] < 1.0
    assert clipped > 0 and int(clip.state_dict()["count"]) == 0  # clipping happened; the clip given stays unused
    assert set(cb.adaptive_clips) == {"generator", "discriminator"}
    for batch, row in rows.items():
        for which, names in NAMES.items():
            ref = rec.norms[(batch, which)]
            assert sorted(ref) == sorted(names)
            total = math.sqrt(sum(v * v for v in ref.values()))
            assert row[f"grad_stats/{which}/total_norm"] == pytest.approx(total, rel=1e-6), (batch, which)
            assert row[f"grad_2.0_norm_total/{which}"] == pytest.approx(total, rel=1e-6), (batch, which)
            assert row[f"grad_stats/{which}/num_tensors"] == len(names)
            for name in names:
                assert row[f"grad_2.0_norm/{which}/{name}"] == pytest.approx(ref[name], rel=1e-6), (batch, name)
                w = float(rec.before[(batch, which)][name].double().norm())
                lr = G_LR if which == "generator" else D_LR
                assert row[f"grad_stats/{which}/lr_update_ratio/{name}"] == pytest.approx(
                    lr * ref[name] / w, rel=1e-5), (batch, name)
            other = "discriminator" if which == "generator" else "generator"
            assert not [k for k in row if k.startswith(f"grad_2.0_norm/{which}/{other}.")]
        # the generator's backward left gradients on the discriminator too: a whole-module read would differ
        assert rec.others[(batch, "generator")] > 1e-6
    assert not [k for k in rows[0] if k.startswith("grad_stats/total_norm") or k == "grad_2.0_norm_total"]


def test_default_names_and_the_measured_update_ratio_per_optimizer(tmp_path: Path) -> None:
    rec = Recorder()
    cb = GradStatsCallback(log_update_ratio=True, key_style=None, every_n_steps=2)
    trainer = _trainer(tmp_path, [rec, cb], max_epochs=1)
    _fit(trainer, GAN(toggle=True))  # toggle_optimizer: the other optimizer's parameters are frozen meanwhile
    rows = _rows(trainer)
    assert sorted(rows) == list(range(1, 16, 2))
    for batch in rows:
        for i, (which, names) in enumerate(NAMES.items()):
            ref = rec.norms[(batch, which)]
            total = math.sqrt(sum(v * v for v in ref.values()))
            assert rows[batch][f"grad_stats/optimizer_{i}/total_norm"] == pytest.approx(total, rel=1e-6)
            for name in names:
                before, after = rec.before[(batch, which)][name], rec.after[batch][name]
                ratio = float((after - before).double().norm() / after.double().norm())  # weights after the step
                assert ratio > 0
                assert rows[batch][f"grad_stats/optimizer_{i}/update_ratio/{name}"] == pytest.approx(
                    ratio, rel=1e-4), (batch, name)
                assert f"grad_stats/optimizer_{i}/norm/{name}" in rows[batch]


def test_a_nonfinite_gradient_skips_only_its_optimizer_and_histograms_are_per_optimizer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    cb = GradStatsCallback(optimizer_names=("generator", "discriminator"), on_nonfinite="skip", histogram=True,
                           every_n_steps=2)
    trainer = _trainer(tmp_path, [rec, cb], max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(trainer, GAN(nan_at=3))
    assert cb.skipped_steps == [7]  # Lightning's global_step counts both optimizers' steps: batch 3's second step
    messages = [r.getMessage() for r in caplog.records]
    assert ("torch_gradstats: non-finite gradient at optimizer step 7 (optimizer 'discriminator'): "
            "'discriminator.2.weight' (1 NaN, 0 Inf); step skipped") in messages
    for name in D_NAMES:
        assert torch.equal(rec.after[3][name], rec.before[(3, "discriminator")][name]), name
    for name in G_NAMES:
        assert not torch.equal(rec.after[3][name], rec.before[(3, "generator")][name]), name
    rows = _rows(trainer)
    assert rows[3]["grad_stats/discriminator/nan_count"] == 1.0 and rows[3]["grad_stats/generator/nan_count"] == 0.0
    assert rows[3]["grad_stats/discriminator/first_nonfinite_index"] == 2.0  # discriminator.2.weight, among its own
    underflows = []
    for batch in (1, 3, 5, 7, 9, 11, 13, 15):
        for which in NAMES:
            ref = rec.fp16_underflow[(batch, which)]
            assert rows[batch][f"grad_stats/{which}/underflow/fp16"] == pytest.approx(ref, abs=1e-12), (batch, which)
            underflows.append(ref)
    assert max(underflows) > 0


def _guard() -> SpikeGuard:
    return SpikeGuard(window=16, sigma=6.0, min_history=6)


def test_a_generator_spike_trips_only_the_generators_guard(tmp_path: Path) -> None:
    rec = Recorder()
    guard = _guard()
    cb = GradStatsCallback(optimizer_names=("generator", "discriminator"), spike_guard=guard)
    trainer = _trainer(tmp_path, [rec, cb], max_epochs=1)
    _fit(trainer, GAN(spike_at=SPIKE))
    guards = cb.spike_guards
    assert set(guards) == {"generator", "discriminator"} and guards["generator"] is not guard
    assert guards["generator"] is not guards["discriminator"]
    assert int(guard.steps) == 0  # the one given is the template, copied per optimizer when training starts
    assert int(guards["generator"].skipped) == 1 and int(guards["discriminator"].skipped) == 0
    assert int(guards["generator"].steps) == int(guards["discriminator"].steps) == 16
    rows = _rows(trainer)
    assert sorted(rows) == list(range(16))
    for batch, row in rows.items():  # skipped steps so far, each optimizer's own count
        assert row["guard/generator/skipped"] == (1.0 if batch >= SPIKE else 0.0), batch
        assert row["guard/discriminator/skipped"] == 0.0, batch
        if batch != SPIKE and batch >= 6:  # judged (min_history) and within sigma, for both optimizers
            assert abs(row["guard/generator/grad_norm_z"]) < 6.0 and abs(row["guard/discriminator/grad_norm_z"]) < 6.0
    assert rows[SPIKE]["guard/generator/grad_norm_z"] > 1000.0 and rows[SPIKE]["guard/generator/consecutive"] == 1.0
    # the two histories are of different scales (one shared history would mix them)
    assert rows[3]["grad_stats/discriminator/total_norm"] > 1.5 * rows[3]["grad_stats/generator/total_norm"]
    # the spike step left the generator as it was; the discriminator still stepped, on its own figures
    for name in G_NAMES:
        assert torch.equal(rec.after[SPIKE][name], rec.before[(SPIKE, "generator")][name]), name
        assert not torch.equal(rec.after[SPIKE - 1][name], rec.before[(SPIKE - 1, "generator")][name]), name
    for name in D_NAMES:
        assert not torch.equal(rec.after[SPIKE][name], rec.before[(SPIKE, "discriminator")][name]), name


@pytest.mark.slow
def test_resume_restores_each_optimizers_guard(tmp_path: Path) -> None:
    names = ("generator", "discriminator")
    whole = GradStatsCallback(optimizer_names=names, spike_guard=_guard())
    _fit(_trainer(tmp_path / "whole", [whole], max_epochs=2), GAN(spike_at=SPIKE))

    first = GradStatsCallback(optimizer_names=names, spike_guard=_guard())
    trainer = _trainer(tmp_path / "first", [first], max_epochs=1)
    _fit(trainer, GAN(spike_at=SPIKE))
    ckpt = tmp_path / "one_epoch.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if "GradStatsCallback" in k]
    assert sorted(state) == ["optimizers"] and sorted(state["optimizers"]) == sorted(names)
    assert int(state["optimizers"]["generator"]["spike_guard"]["counters"].sum()) > 0

    resumed = GradStatsCallback(optimizer_names=names, spike_guard=_guard())
    _fit(_trainer(tmp_path / "second", [resumed], max_epochs=2), GAN(spike_at=SPIKE), ckpt_path=str(ckpt))
    assert resumed.policies_restored
    for which in names:
        got, want = resumed.spike_guards[which].state_dict(), whole.spike_guards[which].state_dict()
        for key, value in want.items():
            same = torch.equal(got[key].nan_to_num(-1), value.nan_to_num(-1)) if isinstance(value, torch.Tensor) \
                else got[key] == value
            assert same, (which, key)
    assert int(resumed.spike_guards["generator"].skipped) == 2  # the first epoch's spike (carried over), the second's

    # a run whose optimizers have other names refuses the checkpoint, naming both sets
    other = GradStatsCallback(optimizer_names=("g", "d"), spike_guard=_guard())
    with pytest.raises(ValueError, match=r"optimizer\(s\) \['generator', 'discriminator'\].*\['g', 'd'\]"):
        _fit(_trainer(tmp_path / "third", [other], max_epochs=2), GAN(), ckpt_path=str(ckpt))


def test_what_is_refused_with_several_optimizers_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="optimizer_names names 3 optimizer"):
        _fit(_trainer(tmp_path, [GradStatsCallback(optimizer_names=("a", "b", "c"))], max_steps=2), GAN())
    with pytest.raises(TypeError, match="optimizer_names must be a sequence"):
        GradStatsCallback(optimizer_names="generator")
    with pytest.raises(ValueError, match=r"optimizer_names\[1\] must be a non-empty str without '/'"):
        GradStatsCallback(optimizer_names=("g", "d/x"))
    with pytest.raises(ValueError, match=r"optimizer_names\[1\]: 'g' is given twice"):
        GradStatsCallback(optimizer_names=("g", "g"))
    # a one-optimizer checkpoint's guard statistics are not spread over several optimizers
    single = GradStatsCallback(spike_guard=_guard())
    single.spike_guard.observe(torch.tensor(1.0, dtype=torch.float64), None)  # type: ignore[union-attr]
    cb = GradStatsCallback(spike_guard=_guard())
    cb.load_state_dict(single.state_dict())
    with pytest.raises(ValueError, match="one optimizer's spike_guard statistics, but this run has 2 optimizers"):
        _fit(_trainer(tmp_path, [cb], max_steps=2), GAN())


class OneOptimizer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("names", [None, ("net",)])
def test_one_optimizer_keeps_its_keys_unless_named(tmp_path: Path, names: tuple[str, ...] | None) -> None:
    cb = GradStatsCallback(optimizer_names=names, spike_guard=_guard(), per_example=True)
    trainer = _trainer(tmp_path, [cb], max_steps=4)
    _fit(trainer, OneOptimizer())
    keys = set(_rows(trainer)[3])
    plain = {"grad_2.0_norm_total", "grad_stats/total_norm", "grad_2.0_norm/net.0.weight", "guard/skipped",
             "examples/max_norm"}
    named = {"grad_2.0_norm_total/net", "grad_stats/net/total_norm", "grad_2.0_norm/net/net.0.weight",
             "guard/net/skipped", "examples/net/max_norm"}
    if names is None:
        assert plain <= keys and not keys & named
        assert sorted(cb.state_dict()) == ["spike_guard"] and cb.spike_guards == {}
        assert int(cb.spike_guard.steps) == 4  # type: ignore[union-attr]
    else:
        assert named <= keys and not keys & plain
        assert sorted(cb.state_dict()) == ["optimizers"] and int(cb.spike_guards["net"].steps) == 4


class NaNTanh(nn.Tanh):
    """Tanh whose ``poison_call``-th call (counting from 0) puts a NaN in its output."""

    def __init__(self, poison_call: int) -> None:
        super().__init__()
        self.poison_call, self.calls = poison_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.calls == self.poison_call:
            out = out.clone()
            out[0, 0] = float("nan")
        self.calls += 1
        return out


D_POISON, G_POISON = 5, 9  # the batches whose discriminator (its real pass) / generator forward makes a NaN


@pytest.mark.parametrize("log_update_ratio", [False, True])  # True: reported after the batch, read at each step
def test_activation_keys_per_optimizer_name_the_origin_of_each_steps_nan(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, log_update_ratio: bool) -> None:
    gan = GAN()
    # the discriminator runs three times a batch: on the fake (generator's step), the real and the fake again
    gan.discriminator[1] = NaNTanh(3 * D_POISON + 1)  # its real pass in the discriminator's step of batch 5
    gan.generator[1] = NaNTanh(G_POISON)  # batch 9: the fake is NaN in both steps
    cb = GradStatsCallback(optimizer_names=("generator", "discriminator"), watch_activations=True,
                           on_nonfinite="skip", log_update_ratio=log_update_ratio)
    trainer = _trainer(tmp_path, [cb], max_epochs=1)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(trainer, gan)
    names = ActivationWatch(GAN()).module_names  # the same module paths, in model order
    d_origin, g_origin = names.index("discriminator.1"), names.index("generator.1")
    assert d_origin != g_origin and min(d_origin, g_origin) > 0
    rows = _rows(trainer)
    assert sorted(rows) == list(range(16))
    expected = {(D_POISON, "generator"): (0.0, -1.0), (D_POISON, "discriminator"): (1.0, d_origin),
                (G_POISON, "generator"): (1.0, g_origin), (G_POISON, "discriminator"): (1.0, g_origin)}
    for batch, row in rows.items():
        for which in NAMES:
            got = (row[f"act/{which}/nonfinite"], row[f"act/{which}/origin_index"])
            assert got == expected.get((batch, which), (0.0, -1.0)), (batch, which)
        assert not [k for k in row if k.startswith("act/") and k.count("/") < 2]  # no key without a name
    # the skipped steps (Lightning counts both optimizers' steps) and their warnings name the origin
    assert cb.skipped_steps == [2 * D_POISON + 1, 2 * G_POISON, 2 * G_POISON + 1]
    messages = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(messages) == 3
    assert "(optimizer 'discriminator')" in messages[0] and "forward origin discriminator.1 " in messages[0]
    assert "(optimizer 'generator')" in messages[1] and "forward origin generator.1 " in messages[1]
    assert "(optimizer 'discriminator')" in messages[2] and "forward origin generator.1 " in messages[2]


class ValidatedGAN(GAN):
    """The GAN with a validation step that calls the discriminator alone: its score on held-out real data."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        self.log("val_real_score", self.discriminator(real).mean())


def test_validation_calling_the_discriminator_alone_leaves_the_training_steps_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Lightning's sanity check (2 validation batches before training) and a validation every 4 batches, each under
    inference_mode and calling the discriminator alone; the LightningModule's own forward is never called, so the
    watch starts a step at the first watched module called. A validation batch is a step of its own and every
    training batch one step, from the generator's first layer: the generator's NaN at batch 9 is named as the origin
    in both optimizers' figures, no backward is left out, and neither the guards nor the logged steps see the
    evaluation. (Before: the first module called at all, the discriminator's in the sanity check, started every step
    after it, so each training batch was cut into three steps, the generator's forward and backward fell out of the
    discriminator's report, and a WARNING said a backward ran after the next step began.)"""
    gan = ValidatedGAN()
    gan.generator[1] = NaNTanh(G_POISON)
    watch = ActivationWatch(gan)
    cb = GradStatsCallback(optimizer_names=("generator", "discriminator"), watch_activations=watch,
                           on_nonfinite="skip", spike_guard=_guard(), adaptive_clip=AdaptiveClip(warmup=3),
                           log_update_ratio=True)
    trainer = _trainer(tmp_path, [cb], max_epochs=1, val_check_interval=4, limit_val_batches=2)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(trainer, gan, val_dataloaders=_data(32))
    watch.remove()
    assert not [r for r in caplog.records if "ran after step" in r.getMessage()]
    assert watch.step == 2 + 16 + 4 * 2 - 1  # sanity check, 16 training batches, 4 validations of 2 batches
    g_origin = watch.module_names.index("generator.1")
    rows = _rows(trainer)
    trained = {s: r for s, r in rows.items() if any(k.startswith("grad_stats/") for k in r)}
    assert sorted(trained) == list(range(16))
    assert any("val_real_score" in r for r in rows.values())
    for batch, row in trained.items():
        for which in NAMES:
            got = (row[f"act/{which}/nonfinite"], row[f"act/{which}/origin_index"])
            assert got == ((1.0, g_origin) if batch == G_POISON else (0.0, -1.0)), (batch, which)
    assert cb.skipped_steps == [2 * G_POISON, 2 * G_POISON + 1]
    assert {n: int(g.steps) for n, g in cb.spike_guards.items()} == {"generator": 16, "discriminator": 16}
