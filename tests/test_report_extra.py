"""report(extra=...): more device figures in a report's one transfer, as GradReport.extra; and the Trainer's log_to
sinks writing the step policies' figures that way."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import torch_gradstats.ops._transfer as transfer
from torch_gradstats import AdaptiveClip, SpikeGuard, Trainer, grad_stats
from torch_gradstats.integrations import metrics
from torch_gradstats.integrations.files import JSONLSink
from torch_gradstats.monitors import updates
from torch_gradstats.monitors.updates import grad_and_weight_stats
from torch_gradstats.stats.gradients import ExtraFigures

POLICY_KEYS = {"guard/skipped", "guard/consecutive", "guard/grad_norm_z", "guard/loss_z", "clip/threshold",
               "clip/coef"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model


def _count_transfers(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = transfer.fetch
    monkeypatch.setattr(transfer, "fetch", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _extra() -> ExtraFigures:
    floats = [torch.tensor([1.5, -2.0], dtype=torch.float64), torch.tensor(0.25)]
    ints = [torch.tensor([7, 2**53 + 1])]  # an int64 that float64 would round
    return ExtraFigures(floats, ints, lambda f, i: {"x/a": f[0], "x/b": f[1], "x/c": f[2], "x/n": float(i[1])})


def test_grad_stats_report_brings_extra_in_its_one_transfer(monkeypatch):
    model = _model()
    stats = grad_stats(model.named_parameters())
    plain = stats.report()
    calls = _count_transfers(monkeypatch)
    got = stats.report(groups=stats.grouped("module"),
                       extra=[_extra(), ExtraFigures([], [torch.tensor([3])], lambda f, i: {"y/i": float(i[0])})])
    assert len(calls) == 1
    assert got.extra == {"x/a": 1.5, "x/b": -2.0, "x/c": 0.25, "x/n": float(2**53 + 1), "y/i": 3.0}
    assert got.norms == plain.norms and got.groups == stats.report(groups=stats.grouped("module")).groups
    assert plain.extra == {}
    # Every style ends with the extra figures, under their own names, without the prefix.
    default = got.to_dict("grad/")
    assert list(default)[-5:] == ["x/a", "x/b", "x/c", "x/n", "y/i"] and "grad/total_norm" in default
    assert got.to_dict("grad/", style="hf") == {"grad/grad_norm": got.total_norm, **got.extra}
    assert metrics(got)["x/a"] == 1.5 and "grad/x/a" not in metrics(got)


def test_grad_and_weight_stats_report_brings_extra(monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = grad_and_weight_stats(model.named_parameters(), optimizer=opt)
    calls: list[int] = []  # its device read (the gradient report is then built from a host copy)
    real = updates.to_host
    monkeypatch.setattr(updates, "to_host", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = stats.report(groups=stats.grouped("module"), extra=[_extra()])
    assert len(calls) == 1
    assert got.grads.extra["x/n"] == float(2**53 + 1)
    assert got.grads.groups == stats.report(groups=stats.grouped("module")).grads.groups
    d = got.to_dict("g/")
    assert d["x/b"] == -2.0 and "g/weight_norm_total" in d and "g/x/b" not in d


def test_extra_must_be_extra_figures():
    stats = grad_stats(_model().named_parameters())
    with pytest.raises(TypeError, match=r"extra must be a sequence of ExtraFigures, got a tuple at \[0\]"):
        stats.report(extra=[([torch.ones(1)], [])])  # type: ignore[list-item]


class _Seen:
    """A sink that keeps what the trainer's ``policy_figures`` held when each report arrived."""

    def __init__(self, trainer_ref: list[Trainer]) -> None:
        self.trainer_ref = trainer_ref
        self.at: dict[int, dict[str, float]] = {}

    def log(self, report, step: int) -> None:
        self.at[step] = dict(self.trainer_ref[0].policy_figures)


@pytest.mark.parametrize("log_every", [1, 3])
def test_trainer_sinks_write_the_policies_figures_in_one_transfer(monkeypatch, tmp_path, log_every):
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32 * 30, 6, generator=gen)
    batches = list(DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=32))  # 30 steps
    spikes = {12: 1e3, 20: 1e4, 21: 1e4}

    def spike(t: Trainer) -> None:
        for p in t.model.parameters():
            p.grad.mul_(spikes.get(t.global_step, 1.0))

    path = tmp_path / "log.jsonl"
    ref: list[Trainer] = []
    seen = _Seen(ref)
    sink = JSONLSink(path)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), nn.functional.mse_loss,
                      spike_guard=SpikeGuard(window=16, sigma=4.0), adaptive_clip=AdaptiveClip(warmup=8),
                      after_backward=spike, log_to=[sink, seen], log_every=log_every, progress=False)
    ref.append(trainer)
    calls = _count_transfers(monkeypatch)
    summary = trainer.train_epoch(batches)
    monkeypatch.undo()
    sink.close()
    logged = list(range(0, 30, log_every))
    assert len(calls) == len(logged) + 1  # one per logging step, one for the epoch
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == logged
    for row in rows:
        assert POLICY_KEYS <= set(row)
        figures = {k: row[k] for k in POLICY_KEYS}
        want = seen.at[row["step"]]
        assert figures.keys() == want.keys()
        # strict JSON: a non-finite figure is written as null
        assert all(v == want[k] or (v is None and not math.isfinite(want[k])) for k, v in figures.items()), row
    assert summary.skipped_steps >= 3
    assert max(r["guard/skipped"] for r in rows) >= 2  # the spikes were judged, and written
    if log_every == 1:  # the last logged step is the epoch's last: the sync's own read says the same
        last = rows[-1]
        assert last["guard/skipped"] == summary.skipped_steps
        want = {k: v if math.isfinite(v) else None for k, v in trainer.policy_figures.items()}
        assert {k: last[k] for k in POLICY_KEYS} == want
