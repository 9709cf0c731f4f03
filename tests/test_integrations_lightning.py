"""Lightning callback, with real Lightning training runs on the CPU (no mocks).

Reference figures are computed independently at the same steps by a callback placed before ours, with plain
float64 PyTorch and with Lightning's own ``grad_norm`` utility.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning.pytorch")
from _host_reads import instrument
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import grad_norm

from torch_gradstats.integrations.lightning import GradStatsCallback

NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


class Tiny(L.LightningModule):
    def __init__(self, nan_at: int | None = None, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.nan_at = nan_at
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.nan_at:  # a NaN in one gradient at one optimizer step
            self.net[2].weight.grad[0, 0] = float("nan")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Recorder(L.Callback):
    """Independent figures at every optimizer step, before our callback (callbacks run in list order)."""

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}
        self.nans: dict[int, int] = {}
        self.lightning: dict[int, dict[str, float]] = {}
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.lr: float = 0.0

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        step = trainer.global_step
        self.norms[step] = {n: float(p.grad.double().norm()) for n, p in pl_module.named_parameters()}
        self.nans[step] = sum(int(p.grad.isnan().sum()) for p in pl_module.parameters())
        self.lightning[step] = {k: float(v) for k, v in grad_norm(pl_module, 2).items()}
        self.before[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[trainer.global_step - 1] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _data(n: int = 96) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(module: L.LightningModule, callbacks: list, logger: Any, max_steps: int, **kw: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=logger,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        log_every_n_steps=kw.pop("log_every_n_steps", 1), **kw,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data())
    return trainer


def _csv_rows(logger: CSVLogger) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            rows.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return rows


def test_logged_values_match_independent_figures_and_nan_step_is_skipped(tmp_path: Path) -> None:
    rec = Recorder()
    cb = GradStatsCallback(every_n_steps=2, on_nonfinite="skip")
    logger = CSVLogger(tmp_path)
    # accumulation 2 and clipping far below the gradients' norm: the figures must be the accumulated,
    # unclipped gradients that the recorder sees in the same hook.
    trainer = _fit(Tiny(nan_at=5), [rec, cb], logger, max_steps=6, accumulate_grad_batches=2,
                   gradient_clip_val=1e-3)
    assert trainer.global_step == 6
    rows = _csv_rows(logger)
    assert sorted(rows) == [1, 3, 5]  # every second step counting from one, as Lightning logs
    for step in (1, 3, 5):
        row = rows[step]
        # Lightning's own key names, with the values of Lightning's own grad_norm utility
        lightning_keys = {k for k in row if k.startswith("grad_2.0_norm")}
        assert lightning_keys == set(rec.lightning[step])
        for name in NAMES:
            ref = rec.norms[step][name]
            got = row[f"grad_2.0_norm/{name}"]
            assert (math.isnan(ref) and math.isnan(got)) or got == pytest.approx(ref, rel=1e-6), (step, name)
        assert row["grad_stats/nan_count"] == rec.nans[step]
    for step in (1, 3):
        total = math.sqrt(sum(v * v for v in rec.norms[step].values()))
        assert rows[step]["grad_2.0_norm_total"] == pytest.approx(total, rel=1e-6)
        assert rows[step]["grad_2.0_norm_total"] == pytest.approx(rec.lightning[step]["grad_2.0_norm_total"],
                                                                   rel=1e-5)
        assert total > 100 * 1e-3  # so clipping was active and the figures are from before it
        assert rows[step]["grad_stats/health"] == 1.0
        assert rows[step]["grad_stats/first_nonfinite_index"] == -1
    bad = rows[5]
    assert bad["grad_stats/nan_count"] == 1 and bad["grad_stats/health"] == 0.0
    assert bad["grad_stats/first_nonfinite_index"] == NAMES.index("net.2.weight")
    assert math.isnan(bad["grad_2.0_norm_total"])
    # the NaN step was skipped: weights unchanged by it, and finite at the end
    assert cb.skipped_steps == [5]
    for name in NAMES:
        torch.testing.assert_close(rec.after[5][name], rec.before[5][name], rtol=0, atol=0)
        assert not torch.equal(rec.after[4][name], rec.before[4][name])  # a normal step did update
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_histogram_fractions_are_logged(tmp_path: Path) -> None:
    """histogram=True: each logged row carries the fp16/bf16/fp8 fractions of the gradients the recorder saw in the
    same hook (grad_stats with histogram=True on the same tensors)."""
    import torch_gradstats as tg

    class Fractions(L.Callback):
        def __init__(self) -> None:
            self.seen: dict[int, dict[str, Any]] = {}

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            stats = tg.grad_stats(pl_module.named_parameters(), histogram=True)
            self.seen[trainer.global_step] = stats.report().to_dict()

    rec = Fractions()
    logger = CSVLogger(tmp_path)
    _fit(Tiny(), [rec, GradStatsCallback(every_n_steps=2, histogram=True)], logger, max_steps=4)
    rows = _csv_rows(logger)
    assert sorted(rows) == [1, 3]
    for step in (1, 3):
        for fmt in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
            for kind in ("underflow", "overflow"):
                assert rows[step][f"grad_stats/{kind}/{fmt}"] == pytest.approx(rec.seen[step][f"{kind}/{fmt}"],
                                                                               rel=1e-6, abs=0), (step, kind, fmt)
    assert any(rows[s]["grad_stats/underflow/fp8_e4m3"] > 0 for s in (1, 3))  # small gradients: not all zero
    with pytest.raises(ValueError, match="log_update_ratio"):
        GradStatsCallback(histogram=True, log_update_ratio=True)


def test_stop_on_nonfinite(tmp_path: Path) -> None:
    rec = Recorder()
    cb = GradStatsCallback(every_n_steps=100, on_nonfinite="stop")
    trainer = _fit(Tiny(nan_at=2), [rec, cb], CSVLogger(tmp_path), max_steps=10)
    assert trainer.should_stop
    assert trainer.global_step == 3  # steps 0, 1, and the skipped step 2; nothing after
    assert cb.skipped_steps == [2]
    for name in NAMES:
        torch.testing.assert_close(rec.after[2][name], rec.before[2][name], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


@pytest.mark.parametrize("on_nonfinite", [None, "skip"])
def test_host_syncs_only_when_logging_or_checking(tmp_path: Path, on_nonfinite: str | None) -> None:
    cb = GradStatsCallback(every_n_steps=3, on_nonfinite=on_nonfinite)  # type: ignore[arg-type]
    counts = instrument(cb, ("on_before_optimizer_step", "on_train_batch_end"))
    _fit(Tiny(), [cb], CSVLogger(tmp_path), max_steps=6)
    assert counts["report"] == 2  # steps 2 and 5: one packed transfer each
    if on_nonfinite is None:
        assert counts["check"] == 0 and counts["reads"] == 0  # nothing else reads the device
    else:
        # One check on each non-logging step, a one-value transfer through torch_gradstats.ops._transfer (no .item()).
        assert counts["check"] == 4 and counts["reads"] == 0


def test_weight_norms_and_update_ratio_with_tensorboard_logger(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Recorder()
    cb = GradStatsCallback(every_n_steps=1, log_weight_norms=True, log_update_ratio=True)
    logger = TensorBoardLogger(tmp_path, name="tb")
    _fit(Tiny(lr=0.2), [rec, cb], logger, max_steps=3)
    logger.experiment.flush()
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()

    def scalar(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in acc.Scalars(tag)}

    for name in NAMES:
        wn, ur = scalar(f"grad_stats/weight_norm/{name}"), scalar(f"grad_stats/update_ratio/{name}")
        lr_ur, gn = scalar(f"grad_stats/lr_update_ratio/{name}"), scalar(f"grad_2.0_norm/{name}")
        assert sorted(wn) == [0, 1, 2]
        for step in range(3):
            w0, w1 = rec.before[step][name].double(), rec.after[step][name].double()
            assert wn[step] == pytest.approx(float(w0.norm()), rel=1e-5)
            assert ur[step] == pytest.approx(float((w1 - w0).norm() / w1.norm()), rel=1e-4)
            assert lr_ur[step] == pytest.approx(rec.lr * rec.norms[step][name] / float(w0.norm()), rel=1e-5)
            assert gn[step] == pytest.approx(rec.norms[step][name], rel=1e-5)


def test_pytorch_lightning_namespace(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from torch_gradstats.integrations.lightning import PLGradStatsCallback

    class PLTiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(6, 3)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = PLGradStatsCallback(every_n_steps=1)
    assert isinstance(cb, pl.Callback)
    logger = pl.loggers.CSVLogger(tmp_path)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, callbacks=[cb], logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(PLTiny(), _data())
    rows = _csv_rows(logger)
    assert sorted(rows) == [0, 1]
    assert rows[1]["grad_2.0_norm_total"] == pytest.approx(cb.last_report.total_norm, rel=1e-12)
    assert "grad_2.0_norm/net.weight" in rows[0]


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="on_nonfinite"):
        GradStatsCallback(on_nonfinite="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_nonfinite must be None, 'skip' or 'stop', got 1 \\(int\\)"):
        GradStatsCallback(on_nonfinite=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_n_steps"):
        GradStatsCallback(every_n_steps=0)
    with pytest.raises(TypeError, match="every_n_steps must be a positive int .* got '10' \\(str\\)"):
        GradStatsCallback(every_n_steps="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every_n_steps"):
        GradStatsCallback(every_n_steps=2.0)  # type: ignore[arg-type]


def test_numpy_integer_every_n_steps() -> None:
    import numpy as np

    cb = GradStatsCallback(every_n_steps=np.int64(4))  # type: ignore[arg-type]
    assert cb.every_n_steps == 4 and type(cb.every_n_steps) is int


class Logged(Tiny):
    """Logs its loss with ``self.log``, the way the charts that grad_stats must line up with are made."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def _steps_with(rows: dict[int, dict[str, float]], key: str) -> list[int]:
    return sorted(step for step, row in rows.items() if key in row)


@pytest.mark.parametrize(
    "every_n_steps, fit_kw, expected",
    [
        (None, {"log_every_n_steps": 5}, [4, 9]),  # the trainer's log_every_n_steps
        (3, {"log_every_n_steps": 3, "accumulate_grad_batches": 2}, [2, 5, 8, 11]),  # counted in optimizer steps
    ],
    ids=["trainer_default", "explicit_with_accumulation"],
)
def test_logs_on_the_steps_self_log_does(tmp_path: Path, every_n_steps: int | None, fit_kw: dict[str, Any],
                                         expected: list[int]) -> None:
    cb = GradStatsCallback(every_n_steps=every_n_steps)
    logger = CSVLogger(tmp_path)
    _fit(Logged(), [cb], logger, max_steps=12, **fit_kw)
    rows = _csv_rows(logger)
    assert _steps_with(rows, "loss") == expected  # where Lightning itself wrote self.log("loss")
    assert _steps_with(rows, "grad_stats/total_norm") == expected
    assert _steps_with(rows, "grad_2.0_norm_total") == expected


def test_logs_the_step_it_stops_on_as_self_log_does(tmp_path: Path) -> None:
    cb = GradStatsCallback(on_nonfinite="stop")
    logger = CSVLogger(tmp_path)
    _fit(Logged(nan_at=2), [cb], logger, max_steps=12, log_every_n_steps=5)
    rows = _csv_rows(logger)
    assert _steps_with(rows, "loss") == _steps_with(rows, "grad_stats/total_norm") == [2]
    assert rows[2]["grad_stats/nan_count"] == 1


def test_log_every_n_steps_zero_logs_nothing(tmp_path: Path) -> None:
    cb = GradStatsCallback()
    logger = CSVLogger(tmp_path)
    _fit(Logged(), [cb], logger, max_steps=4, log_every_n_steps=0)
    assert cb.last_report is None
    assert not (Path(logger.log_dir) / "metrics.csv").exists()  # Lightning wrote no loss either


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_skip_warning_names_the_parameter_on_a_step_it_does_not_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, on_nonfinite: str
) -> None:
    cb = GradStatsCallback(every_n_steps=100, on_nonfinite=on_nonfinite)  # type: ignore[arg-type]
    counts = instrument(cb, ("on_before_optimizer_step",))
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(Tiny(nan_at=2), [cb], CSVLogger(tmp_path), max_steps=4)
    assert cb.skipped_steps == [2]
    warned = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"]
    stopping = ", stopping" if on_nonfinite == "stop" else ""
    expected = ("torch_gradstats: non-finite gradient at optimizer step 2: 'net.2.weight' (1 NaN, 0 Inf); "
                f"step skipped{stopping}")
    assert warned == [expected]
    assert counts["reads"] == 0  # the name came through the same packed transfer path, no .item()


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def test_per_example_names_the_corrupted_example_and_dumps_the_flight_recorder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A corrupted target at step 9, position 3: the guard skips the step on the device, and the next report's
    warning names the position and the flight recorder's dump, which holds the steps up to it."""
    from torch_gradstats import FlightRecorder, SpikeGuard

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(96, 6, generator=g), torch.randn(96, 1, generator=g)
    y[9 * 8 + 3] = 1e4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    cb = GradStatsCallback(spike_guard=SpikeGuard(window=16, sigma=6.0, min_history=6), per_example=True,
                           flight_recorder=FlightRecorder(32, dump_dir=tmp_path / "flight"))
    logger = CSVLogger(str(tmp_path), name="pe")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=12, callbacks=[cb], logger=logger,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        log_every_n_steps=5)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        warnings.simplefilter("ignore")
        trainer.fit(_Regression(), loader)
    skipped = [r.getMessage() for r in caplog.records if "skipped (" in r.getMessage()]
    path = tmp_path / "flight" / "flight-9.jsonl"
    assert len(skipped) == 1 and "optimizer step 9 skipped (gradient spike)" in skipped[0]
    assert "positions): #3 norm" in skipped[0] and f"flight recorder dumped to {path}" in skipped[0]
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
            for line in path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(len(steps))) and steps[-1] >= 9  # every step up to the next logging step
    assert rows[9]["guard/consecutive"] == 1 and rows[8]["guard/consecutive"] == 0
    logged = _csv_rows(logger)
    assert {"examples/max_norm", "examples/median_norm", "examples/max_over_median"} <= set(logged[4])


@pytest.mark.parametrize("nan_at", [3, 4])  # between logging steps, and on one (every_n_steps=4)
def test_a_step_on_nonfinite_skips_is_not_called_taken_by_the_flight_recorders_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, nan_at: int) -> None:
    """``on_nonfinite="skip"`` with a flight recorder: the callback skips the NaN step and says so, and the dump's
    warning called the same step ``(step taken)``."""
    from torch_gradstats import FlightRecorder

    module = Tiny(nan_at=nan_at)
    cb = GradStatsCallback(every_n_steps=4, on_nonfinite="skip",
                           flight_recorder=FlightRecorder(16, dump_dir=tmp_path / "flight"))
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(module, [cb], False, max_steps=8)
    said = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"]
    assert cb.skipped_steps == [nan_at] and not [m for m in said if "step taken" in m], said
    path = tmp_path / "flight" / f"flight-{nan_at}.jsonl"
    assert [m for m in said if f"optimizer step {nan_at} skipped (non-finite gradient)" in m
            and f"flight recorder dumped to {path}" in m], said


def test_a_step_the_grad_scaler_skips_is_not_called_taken_by_the_flight_recorders_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under ``16-mixed`` (fp16 autocast on the CPU, Lightning's own plugin) the GradScaler skips a step with NaN
    gradients; the flight recorder's warning called it ``(step taken)``. The weights stay finite."""
    from lightning.pytorch.plugins import MixedPrecision

    from torch_gradstats import FlightRecorder

    module = Tiny(nan_at=5)
    cb = GradStatsCallback(every_n_steps=4, flight_recorder=FlightRecorder(16, dump_dir=tmp_path / "flight"))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        _fit(module, [cb], False, max_steps=8, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    said = [r.getMessage() for r in caplog.records if r.name == "torch_gradstats"]
    assert float(scaler.get_scale()) == 512.0 and all(bool(torch.isfinite(p).all()) for p in module.parameters())
    path = tmp_path / "flight" / "flight-5.jsonl"
    assert not [m for m in said if "step taken" in m], said
    assert [m for m in said if "optimizer step 5 skipped (non-finite gradient)" in m
            and f"flight recorder dumped to {path}" in m], said
