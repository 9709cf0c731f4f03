"""The Trainer's per_example and flight_recorder: skipped steps named with their examples, the examples' figures in
the report's one transfer, a flight recorder dump at an incident, and no host read per step."""

from __future__ import annotations

import copy
import json
import logging
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests import model_zoo
from tests._host_reads import HostReads
from torch_gradstats import FlightRecorder, GradReport, SpikeGuard, SpikeStreakError
from torch_gradstats.training import Trainer

BATCH, BAD_STEP, BAD_POS = 8, 14, 5


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _data(bad: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20 * BATCH, 8, generator=g), torch.randn(20 * BATCH, 1, generator=g)
    if bad:
        y[BAD_STEP * BATCH + BAD_POS] = 1e4  # one corrupted target
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def _guard() -> SpikeGuard:
    return SpikeGuard(window=16, sigma=6.0, min_history=8)


class _Sink:
    def __init__(self) -> None:
        self.reports: dict[int, GradReport] = {}

    def log(self, report: GradReport, step: int) -> None:
        self.reports[step] = report


def _skip_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torch_gradstats" and r.levelno == logging.WARNING
            and "skipped (" in r.getMessage()]


@pytest.mark.parametrize("fused", [True, False], ids=["device-skip", "host-skip"])
def test_warning_names_the_corrupted_example(fused: bool, caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    trainer = Trainer(model, opt, nn.MSELoss(), spike_guard=_guard(), per_example=True, progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        summary = trainer.train_epoch(_data())
    assert summary.skipped_steps == 1
    (message,) = _skip_warnings(caplog)
    assert f"optimizer step {BAD_STEP} skipped (gradient spike)" in message
    assert f"positions): #{BAD_POS} norm" in message and "batch median" in message


def test_an_example_with_a_nan_input_is_named_beside_the_median_of_the_others(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(20 * BATCH, 8, generator=g), torch.randn(20 * BATCH, 1, generator=g)
    x[BAD_STEP * BATCH + BAD_POS, 3] = float("nan")
    model = _mlp()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-2), nn.MSELoss(), skip_nonfinite=True,
                      per_example=True, progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer.train_epoch(DataLoader(TensorDataset(x, y), batch_size=BATCH))
    (message,) = _skip_warnings(caplog)
    assert f"optimizer step {BAD_STEP} skipped (non-finite gradient)" in message
    assert f"positions): #{BAD_POS} norm nan, #" in message  # the one NaN example first, then finite norms
    median = float(message.rsplit("batch median ", 1)[1])
    assert math.isfinite(median) and median > 0


def test_every_skipped_step_is_warned_without_per_example(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    trainer = Trainer(model, opt, nn.MSELoss(), spike_guard=_guard(), progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer.train_epoch(_data())
    assert _skip_warnings(caplog) == [f"torch_gradstats: optimizer step {BAD_STEP} skipped (gradient spike)"]


class _LM(nn.Module):
    """GPT-2 given its position ids per example (a [1, T] row broadcast over the batch has no batch dimension)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return self.gpt(ids, position_ids=positions).logits


def test_examples_figures_are_the_per_example_norms() -> None:
    """On a tiny GPT-2: each logging step's examples/... figures are the max and median of the step's per-example
    gradient norms, each example's own loss gradient taken alone (two micro-batches per step, the last one short)."""
    model = _LM(model_zoo.gpt2())
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (14, 8), generator=g)
    loader = DataLoader(TensorDataset(ids, ids), batch_size=4)  # windows: 4 + 4, then 4 + 2

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten())

    expected: list[torch.Tensor] = []

    def after_backward(trainer: Trainer) -> None:  # the weights of this step, before the optimizer moves them
        alone = copy.deepcopy(model)
        window = ids[8 * len(expected) : 8 * len(expected) + 8]
        norms = []
        for example in window:
            alone.zero_grad()
            loss_fn(alone(example[None]), example[None]).backward()
            norms.append(torch.sqrt(sum(p.grad.double().square().sum() for p in alone.parameters()
                                        if p.grad is not None)))
        expected.append(torch.stack(norms))

    sink = _Sink()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(model, opt, loss_fn, per_example=True, log_to=[sink], accumulation_steps=2,
                      after_backward=after_backward, progress=False)
    trainer.train_epoch(loader)
    assert sorted(sink.reports) == [0, 1]
    for step, norms in enumerate(expected):
        extra = sink.reports[step].extra
        assert extra["examples/max_norm"] == pytest.approx(norms.max().item(), rel=1e-4)
        assert extra["examples/median_norm"] == pytest.approx(norms.median().item(), rel=1e-4)
        assert extra["examples/max_over_median"] == pytest.approx((norms.max() / norms.median()).item(), rel=1e-4)
        assert "examples/max_norm" in sink.reports[step].to_dict()


def test_flight_recorder_dumped_at_a_skipped_step(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    trainer = Trainer(model, opt, nn.MSELoss(), spike_guard=_guard(), per_example=True, progress=False,
                      flight_recorder=FlightRecorder(8, dump_dir=tmp_path))
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer.train_epoch(_data())
    path = tmp_path / f"flight-{BAD_STEP}.jsonl"
    (message,) = _skip_warnings(caplog)
    assert f"flight recorder dumped to {path}" in message
    assert path.with_suffix(".png").exists()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
            for line in path.read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(20 - 8, 20))  # the ring at the epoch's sync: the incident and the steps around it
    assert rows[steps.index(BAD_STEP)]["guard/consecutive"] == 1


def test_flight_recorder_dumped_at_a_streak(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    loader = _data(bad=False)
    for i, (x, y) in enumerate(loader.dataset):  # type: ignore[attr-defined]
        if i >= 10 * BATCH:
            y.mul_(1e4)  # every later step spikes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    trainer = Trainer(model, opt, nn.MSELoss(), spike_guard=SpikeGuard(window=8, sigma=6.0, min_history=4,
                                                                        max_consecutive=3),
                      flight_recorder=FlightRecorder(32, dump_dir=tmp_path), sync_every=4, progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"), pytest.raises(SpikeStreakError):
        trainer.train_epoch(loader)
    dumps = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert dumps and any("SpikeStreakError" in r.getMessage() and "flight recorder dumped" in r.getMessage()
                         for r in caplog.records)


def test_no_host_read_per_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """With a fused optimizer the examples and the flight recorder read nothing per step: an epoch reads as much as
    one with the guard alone (whose pure-PyTorch kernel may call .tolist() on CPU metadata), and the dispatch-level
    reads of an epoch are the same for 10 steps as for 20."""
    calls = {"n": 0}
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _real: Any = real, **kw: Any) -> Any:
            calls["n"] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def reads(steps: int, watched: bool = True) -> tuple[int, int]:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        options: dict[str, Any] = {"per_example": True, "flight_recorder": FlightRecorder(8, dump_dir=tmp_path)}
        trainer = Trainer(model, opt, nn.MSELoss(), spike_guard=_guard(), progress=False,
                          **(options if watched else {}))
        g = torch.Generator().manual_seed(1)
        loader = DataLoader(TensorDataset(torch.randn(steps * BATCH, 8, generator=g),
                                          torch.randn(steps * BATCH, 1, generator=g)), batch_size=BATCH)
        calls["n"] = 0
        with HostReads() as mode:
            trainer.train_epoch(loader)
        return mode.count, calls["n"]

    assert reads(10)[0] == reads(20)[0] == 1  # the epoch's one sync
    assert reads(10) == reads(10, watched=False) and reads(20) == reads(20, watched=False)
