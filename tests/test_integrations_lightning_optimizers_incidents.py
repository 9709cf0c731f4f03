"""The Lightning callback with several optimizers, ``per_example=True`` and ``flight_recorder=``: a small GAN in manual
optimization trained for real on the CPU (no mocks). One real example of one batch is scaled up, which spikes the
discriminator's gradient alone: its step must name that example (checked against per-example gradients computed
here, one backward per example), the generator's must not. A NaN in the generator's gradient skips its step and
dumps its own flight recorder, whose rows are checked against float64 norms recorded at the same hook by a callback
placed before ours."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torch_gradstats import FlightRecorder, SpikeGuard

L = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger
from test_integrations_lightning_optimizers import OneOptimizer, _rows

from torch_gradstats.integrations.lightning import GradStatsCallback

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("generator", "discriminator")
BAD, BAD_POS = 9, 5  # the batch and position of the real example scaled up
NAN = 13  # the batch whose generator gradient gets a NaN
BATCH = 8


class GAN(L.LightningModule):
    """The canonical Lightning GAN step (no ``toggle_optimizer`` unless asked: the generator's backward then goes
    through the discriminator's modules and leaves gradients there, which its ``zero_grad`` clears)."""

    def __init__(self, toggle: bool = False, bad: int | None = BAD, nan: int | None = NAN) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.toggle, self.bad, self.nan = toggle, bad, nan
        self.d_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # batch -> (real, fake) of D's loss
        self.losses: dict[tuple[int, str], float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        if batch_idx == self.bad:
            real = real.clone()
            real[BAD_POS] *= 100.0  # one corrupted example: only the discriminator sees real data
        g_opt, d_opt = self.optimizers()
        z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        if self.toggle:
            self.toggle_optimizer(g_opt)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        if batch_idx == self.nan:
            self.generator[2].weight.grad[1, 2] = float("nan")
        self.losses[(batch_idx, "generator")] = float(g_loss)
        g_opt.step()
        if self.toggle:
            self.untoggle_optimizer(g_opt)
            self.toggle_optimizer(d_opt)
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)) / 2
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        self.losses[(batch_idx, "discriminator")] = float(d_loss)
        self.d_inputs[batch_idx] = (real.detach().clone(), fake.detach().clone())
        d_opt.step()
        if self.toggle:
            self.untoggle_optimizer(d_opt)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.generator.parameters(), lr=0.01),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.005)]


class Recorder(L.Callback):
    """Before our callback: float64 norms of the stepping optimizer's gradients, and the discriminator's weights."""

    def __init__(self) -> None:
        self.norms: dict[tuple[int, str], float] = {}
        self.d_before: dict[int, dict[str, torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        which = NAMES[0] if optimizer is trainer.optimizers[0] else NAMES[1]
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1
        mine = [p for group in optimizer.param_groups for p in group["params"]]
        self.norms[(batch, which)] = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in mine))
        if which == "discriminator":
            self.d_before[batch] = {k: v.detach().clone() for k, v in pl_module.discriminator.state_dict().items()}


def _data(n: int = 16 * BATCH) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g) + 2.0),
                                       batch_size=BATCH)


def _fit(tmp_path: Path, callbacks: list, module: Any, **kw: Any) -> Any:
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=callbacks, logger=CSVLogger(str(tmp_path)),
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        log_every_n_steps=1, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data())
    return trainer


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
            for line in path.read_text().splitlines()]


def _d_example_norms(module: GAN, weights: dict[str, torch.Tensor], real: torch.Tensor,
                     fake: torch.Tensor) -> list[float]:
    """Each example's own discriminator gradient norm, one float64 backward per example: example i's loss is
    ``(bce(D(real_i), 1) + bce(D(fake_i), 0)) / 2`` (the batch loss is their mean)."""
    d = copy.deepcopy(module.discriminator).double()
    d.load_state_dict({k: v.double() for k, v in weights.items()})
    bce = nn.functional.binary_cross_entropy_with_logits
    norms = []
    for i in range(real.shape[0]):
        d.zero_grad()
        one = torch.ones(1, 1, dtype=torch.float64)
        loss = (bce(d(real[i:i + 1].double()), one) + bce(d(fake[i:i + 1].double()), 0 * one)) / 2
        loss.backward()
        norms.append(math.sqrt(sum(float(p.grad.norm()) ** 2 for p in d.parameters())))
    return norms


def test_each_optimizer_names_its_own_examples_and_dumps_its_own_flight_recorder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    given = FlightRecorder(64, dump_dir=tmp_path / "flight")
    cb = GradStatsCallback(optimizer_names=NAMES, spike_guard=SpikeGuard(window=16, sigma=6.0, min_history=6),
                           per_example=True, flight_recorder=given)
    module = GAN()
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer = _fit(tmp_path, [rec, cb], module, max_epochs=1)
    messages = [r.getMessage() for r in caplog.records]
    skipped = [m for m in messages if " skipped (" in m]
    d_step, g_step = 2 * BAD + 1, 2 * NAN  # Lightning's global_step counts both optimizers' steps
    flight = tmp_path / "flight"
    assert len(skipped) == 2, messages

    # The discriminator's spike: its warning names the corrupted example, with its norm and the batch median as
    # computed here from that batch's inputs and the weights before the step.
    d_path = flight / f"flight-discriminator-{d_step}.jsonl"
    assert skipped[0].startswith(f"torch_gradstats: optimizer step {d_step} (optimizer 'discriminator') skipped "
                                 "(gradient spike); largest per-example gradient norms of its 8 examples")
    assert skipped[0].endswith(f"flight recorder dumped to {d_path}")
    ref = _d_example_norms(module, rec.d_before[BAD], *module.d_inputs[BAD])
    top = [(int(i), float(v)) for i, v in re.findall(r"#(\d+) norm ([0-9.e+-]+)", skipped[0])]
    assert [i for i, _ in top] == sorted(range(BATCH), key=lambda i: -ref[i])[:3] and top[0][0] == BAD_POS
    for i, v in top:
        assert v == pytest.approx(ref[i], rel=1e-3), i
    median = float(re.search(r"batch median ([0-9.e+-]+)", skipped[0]).group(1))
    assert median == pytest.approx(float(torch.tensor(ref).median()), rel=1e-3)
    rows = _rows(trainer)
    assert rows[BAD]["examples/discriminator/max_norm"] == pytest.approx(ref[BAD_POS], rel=1e-4)
    assert rows[BAD]["examples/discriminator/max_over_median"] > 20.0
    assert rows[BAD]["guard/discriminator/skipped"] == 1.0 and rows[BAD]["guard/generator/skipped"] == 0.0
    # the generator's examples never saw real data: no outlier among them, at that batch or any other
    for batch, row in rows.items():
        assert row["examples/generator/max_over_median"] < 5.0, batch
        assert not [k for k in row if k.startswith("examples/") and k.split("/")[1] not in NAMES]
    # each optimizer's examples are its own backward's 8, not 16: the generator's backward went through the
    # discriminator's modules, but the discriminator's zero_grad started its examples afresh
    for batch in range(16):
        if batch != BAD:
            assert rows[batch]["examples/discriminator/max_over_median"] < 5.0, batch

    # The generator's NaN: its step skipped, its own flight recorder dumped, one row per generator step
    g_path = flight / f"flight-generator-{g_step}.jsonl"
    assert skipped[1].startswith(f"torch_gradstats: optimizer step {g_step} (optimizer 'generator') skipped "
                                 "(non-finite gradient); largest per-example gradient norms of its 8 examples")
    assert skipped[1].endswith(f"flight recorder dumped to {g_path}")
    assert sorted(p.name for p in flight.glob("*.jsonl")) == [d_path.name, g_path.name]
    assert sorted(p.name for p in flight.glob("*.png")) in ([], [d_path.with_suffix(".png").name,
                                                             g_path.with_suffix(".png").name])
    for path, which, last, index in ((d_path, "discriminator", BAD, 1), (g_path, "generator", NAN, 0)):
        dumped = _read(path)
        assert [r["step"] for r in dumped] == [2 * b + index for b in range(last + 1)], which
        for batch, r in enumerate(dumped):
            want = rec.norms[(batch, which)]
            if batch == NAN and which == "generator":
                assert math.isnan(want) and r["total_norm"] is None and r["nan_count"] == 1
            else:
                assert r["total_norm"] == pytest.approx(want, rel=1e-6), (which, batch)
                assert r["nan_count"] == 0 and r["inf_count"] == 0
            assert r["loss"] == pytest.approx(module.losses[(batch, which)], rel=1e-6), (which, batch)
            assert r["guard/consecutive"] == (1 if batch == last else 0), (which, batch)
    # the recorder given is the template: one copy per optimizer, with its capacity and dump_dir
    recorders = cb.flight_recorders
    assert sorted(recorders) == sorted(NAMES) and len(given) == 0
    assert all(r is not given and r.capacity == 64 and r.dump_dir == flight for r in recorders.values())
    assert len(recorders["generator"]) == len(recorders["discriminator"]) == 16


def test_a_capacity_per_optimizer_and_the_recorders_kept_from_fit_to_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # a capacity's recorders dump into the working directory
    cb = GradStatsCallback(optimizer_names=NAMES, on_nonfinite="skip", per_example=True, flight_recorder=4)
    first, second = Recorder(), Recorder()
    _fit(tmp_path / "first", [first, cb], GAN(toggle=True, bad=None, nan=None), max_steps=8)  # 4 batches
    recorders = cb.flight_recorders
    assert [len(recorders[n]) for n in NAMES] == [4, 4] and recorders["generator"].capacity == 4
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(tmp_path / "second", [second, cb], GAN(toggle=True, bad=None, nan=2), max_steps=6)
    assert cb.flight_recorders["generator"] is recorders["generator"]  # the same ring, carried over by name
    assert cb.skipped_steps == [4]  # the second fit counts its steps from 0: batch 2's generator step
    (path,) = tmp_path.glob("*.jsonl")
    assert path.name == "flight-generator-4.jsonl"
    dumped = _read(path)
    # the ring's last 4 generator steps: the first fit's last one (step 6, batch 3), then this fit's 0, 2 and 4
    assert [r["step"] for r in dumped] == [6, 0, 2, 4]
    assert dumped[0]["total_norm"] == pytest.approx(first.norms[(3, "generator")], rel=1e-6)
    for batch, r in zip((0, 1), dumped[1:3]):
        assert r["total_norm"] == pytest.approx(second.norms[(batch, "generator")], rel=1e-6)
    assert dumped[3]["total_norm"] is None and dumped[3]["nan_count"] == 1
    # on_nonfinite skipped the step: the dump's warning says so, under the optimizer's name
    told = [r.getMessage() for r in caplog.records if "flight recorder dumped" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith(
        "torch_gradstats: optimizer step 4 (optimizer 'generator') skipped (non-finite gradient); largest "
        "per-example gradient norms of its 8 examples")
    assert told[0].endswith(f"flight recorder dumped to {path}")  # in full: the working directory of then


class InfAtStep2(OneOptimizer):
    def on_after_backward(self) -> None:
        if self.global_step == 2:
            self.net[0].weight.grad[0, 0] = float("inf")


def test_one_optimizer_a_step_on_nonfinite_skipped_is_told_as_skipped_beside_its_dump(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = GradStatsCallback(on_nonfinite="skip", flight_recorder=FlightRecorder(8, dump_dir=tmp_path / "flight"),
                           every_n_steps=2)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(tmp_path, [cb], InfAtStep2(), max_steps=4)
    assert cb.skipped_steps == [2]
    path = tmp_path / "flight" / "flight-2.jsonl"
    told = [r.getMessage() for r in caplog.records if "flight recorder dumped" in r.getMessage()]
    assert told == ["torch_gradstats: optimizer step 2 skipped (non-finite gradient); flight recorder dumped to "
                    + str(path)]
    assert [r["inf_count"] for r in _read(path)] == [0, 0, 1, 0]  # dumped at the next report, step 3's
