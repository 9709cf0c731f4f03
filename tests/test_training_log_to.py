"""Trainer(log_to=...): per-step gradient reports sent to sinks, read back from real TensorBoard event files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats.ops._transfer as transfer
from torch_gradstats import GradReport
from torch_gradstats.training import Trainer


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
    return model, opt, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class Recorder:
    """A sink that keeps what it was given."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, GradReport]] = []

    def log(self, report: GradReport, step: int) -> None:
        self.seen.append((step, report))


def _norms_before_each_step(every: int) -> dict[int, float]:
    """The global gradient norm at each logging step of the same run, computed independently in float64."""
    model, opt, loader = _setup()
    loss_fn = nn.CrossEntropyLoss()
    norms = {}
    for step, (x, y) in enumerate(loader):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        if step % every == 0:
            sq = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
            norms[step] = math.sqrt(sq)
        opt.step()
    return norms


def test_reports_every_n_steps_with_one_transfer_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = transfer.fetch
    monkeypatch.setattr(transfer, "fetch", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, opt, loader = _setup()
    sink = Recorder()
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), log_to=[sink], log_every=2, progress=False)
    trainer.train_epoch(loader)
    assert [s for s, _ in sink.seen] == [0, 2, 4]
    expected = _norms_before_each_step(2)
    for step, report in sink.seen:
        assert report.total_norm == pytest.approx(expected[step], rel=1e-6)  # float32 gradients
        assert set(report.norms) == {n for n, _ in model.named_parameters()}
    assert len(calls) == 3 + 1  # one per logging step, one at the epoch end


def test_tensorboard_sink_through_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    writer = SummaryWriter(str(tmp_path))
    model, opt, loader = _setup()
    Trainer(model, opt, nn.CrossEntropyLoss(), log_to=[TensorBoardSink(writer)], log_every=3,
            progress=False).train_epoch(loader)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("grad/total_norm")}
    expected = _norms_before_each_step(3)
    assert sorted(logged) == [0, 3]
    for step, value in logged.items():
        assert value == pytest.approx(expected[step], rel=1e-6)  # TensorBoard stores float32
    assert "grad/norm/0.weight" in acc.Tags()["scalars"]


@pytest.mark.parametrize("bad", ["runs/x", [object()], 3])
def test_log_to_rejects_what_is_not_a_sink(bad: object) -> None:
    model, opt, _ = _setup()
    with pytest.raises(TypeError, match="log_to"):
        Trainer(model, opt, nn.CrossEntropyLoss(), log_to=bad)  # type: ignore[arg-type]


def test_log_every_must_be_positive() -> None:
    model, opt, _ = _setup()
    with pytest.raises(ValueError, match="log_every"):
        Trainer(model, opt, nn.CrossEntropyLoss(), log_to=[Recorder()], log_every=0)
