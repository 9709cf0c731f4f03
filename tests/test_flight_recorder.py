"""FlightRecorder: order and wrap-around, the same values as each step's report, no host read while recording, and
strict JSON lines (plus a PNG) when dumped."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torch_gradstats import AdaptiveClip, SpikeGuard, clip_grad_norm_, grad_stats
from torch_gradstats.monitors.flight_recorder import FlightRecorder
from torch_gradstats.stats import ExtraFigures

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.randn(16, 6), torch.randn(16, 2)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """One backward; some steps with a zeroed, a NaN or an Inf gradient."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x * (1 + 0.3 * k)), y)
    loss.backward()
    with torch.no_grad():
        if k % 5 == 2:
            model[0].weight.grad[0, 0] = math.nan
        if k % 7 == 3:
            model[2].bias.grad[1] = -math.inf
        if k % 4 == 1:
            model[4].weight.grad[0].zero_()
    return loss


def same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_order_and_wrap_around() -> None:
    rec = FlightRecorder(capacity=4)
    assert rec.to_dicts() == [] and len(rec) == 0
    model, x, y = model_and_batch()
    losses = []
    for k in range(10):
        losses.append(step(model, x, y, k))
        rec.record(grad_stats(model.named_parameters()), loss=losses[-1])
        rows = rec.to_dicts()
        assert [r["step"] for r in rows] == list(range(max(0, k - 3), k + 1))  # the last min(steps, capacity)
    assert len(rec) == 4 and rec.steps == 10
    assert [r["loss"] for r in rows] == [float(loss.detach()) for loss in losses[6:]]


@pytest.mark.parametrize("grouped", [False, True], ids=["totals", "with_groups"])
def test_values_equal_each_steps_report(grouped: bool) -> None:
    model, x, y = model_and_batch()
    guard, clip = SpikeGuard(window=8, sigma=2.0, min_history=2), AdaptiveClip(warmup=3)
    rec = FlightRecorder(capacity=6)
    expected = []
    for k in range(9):
        loss = step(model, x, y, k)
        named = list(model.named_parameters())
        stats = clip_grad_norm_(named, clip.threshold(grad_stats(named).total_norm))
        guard.observe(stats.total_norm, loss)
        groups = stats.grouped("layer") if grouped else None
        rec.record(stats, loss=loss, guard=guard, clip=clip, groups=groups)
        extra = [ExtraFigures(*guard.check_tensors(), guard.check_values),
                 ExtraFigures(*clip.check_tensors(), clip.check_values)]
        expected.append(stats.report(groups=groups, extra=extra).to_dict(per_param=False))
    rows = rec.to_dicts()
    assert [r["step"] for r in rows] == list(range(3, 9))
    for row in rows:
        want = expected[int(row["step"])]  # type: ignore[arg-type]
        keys = set(row) - {"step", "loss"}
        assert {"total_norm", "inf_norm", "zero_count", "nan_count", "inf_count", "clip_coef", "clipped_norm",
                "guard/skipped", "guard/loss_z", "clip/threshold", "clip/coef"} <= keys
        assert keys <= set(want)
        assert grouped == any(k.startswith("group/") for k in keys)
        for key in keys:
            assert same(row[key], want[key]), (row["step"], key, row[key], want[key])
    assert any(r["nan_count"] for r in rows) and any(r["inf_count"] for r in rows)


def test_group_stats_alone() -> None:
    model, x, y = model_and_batch()
    step(model, x, y, 2)  # with a NaN
    stats = grad_stats(model.named_parameters())
    groups = stats.grouped("layer")
    rec = FlightRecorder()
    rec.record(groups)
    (row,) = rec.to_dicts()
    want = stats.report(groups=groups).to_dict(per_param=False)
    assert row["loss"] is None
    for key in set(row) - {"step", "loss"}:
        assert same(row[key], want[key]) or math.isclose(row[key], want[key], rel_tol=1e-12), key  # type: ignore[arg-type]


def test_group_stats_of_some_parameters_keeps_the_totals_of_all() -> None:
    model, x, y = model_and_batch()
    step(model, x, y, 0)
    with torch.no_grad():
        model[4].bias.grad[0] = 0.0  # a zero, in no group
        model[4].bias.grad[1] = 50.0  # the largest |g|, in no group
    stats = grad_stats(model.named_parameters())
    groups = stats.grouped(lambda name: "weights" if name.endswith("weight") else None)  # biases in no group
    rec = FlightRecorder()
    rec.record(groups)
    (row,) = rec.to_dicts()
    want = stats.report(groups=groups).to_dict(per_param=False)
    for key in set(row) - {"step", "loss"}:
        assert same(row[key], want[key]), key
    assert row["total_norm"] > row["group/weights/norm"] and row["inf_norm"] == 50.0 and row["zero_count"] >= 1
    # A GroupStats made otherwise has only its groups' sums for totals: a step of it is refused beside these.
    from torch_gradstats.stats.groups import group_stats

    with pytest.raises(ValueError, match="what the totals cover .* changed at step 1"):
        rec.record(group_stats(stats, lambda name: "weights" if name.endswith("weight") else None))


class Reads(TorchDispatchMode):
    """Counts reads of a tensor value into Python (aten::_local_scalar_dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_record_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not even at the step where a layer unfrozen later adds its group to the ring."""
    model, x, y = model_and_batch()
    guard, clip = SpikeGuard(window=4, min_history=1), AdaptiveClip(warmup=2)
    rec = FlightRecorder(capacity=3)
    calls = {"item": 0, "tolist": 0}
    recording = [False]
    for name in calls:
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
            calls[_name] += recording[0]
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    reads = Reads()
    for k in range(5):
        model[0].requires_grad_(k >= 2)  # a layer unfrozen at step 2: the ring gains its group's columns
        loss = step(model, x, y, k)
        stats = grad_stats(model.named_parameters())
        guard.observe(stats.total_norm, loss)
        clip.threshold(stats.total_norm)
        groups = stats.grouped(1)
        recording[0] = True
        with reads:
            rec.record(stats, loss=loss, guard=guard, clip=clip, groups=groups)
        recording[0] = False
    assert reads.count == 0 and calls == {"item": 0, "tolist": 0}
    rows = rec.to_dicts()
    assert len(rows) == 3 and rows[0]["group/0/norm"] is not None and rec.steps == 5


def strict_lines(path: Path) -> list[dict[str, Any]]:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text(encoding="utf-8").splitlines()]


def test_dump_writes_strict_json_lines_and_a_png(tmp_path: Path) -> None:
    model, x, y = model_and_batch()
    guard = SpikeGuard(window=4, min_history=1)
    rec = FlightRecorder(capacity=5, dump_dir=tmp_path / "incidents")
    for k in range(7):
        loss = step(model, x, y, k)
        stats = grad_stats(model.named_parameters())
        guard.observe(stats.total_norm, loss)
        rec.record(stats, loss=loss if k != 4 else None, guard=guard)
    path = rec.dump()
    assert path == tmp_path / "incidents" / "flight-6.jsonl"
    lines = strict_lines(path)
    assert lines == [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                     for r in rec.to_dicts()]
    assert [r["step"] for r in lines] == [2, 3, 4, 5, 6]
    assert lines[0]["total_norm"] is None  # step 2 has a NaN gradient
    assert lines[2]["loss"] is None  # no loss given at step 4
    assert lines[1]["total_norm"] is None and lines[1]["inf_count"] == 1  # step 3: an Inf gradient
    assert isinstance(lines[3]["total_norm"], float) and lines[3]["nan_count"] == 0
    if HAS_MPL:
        png = path.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = rec.dump(tmp_path / "named.jsonl")
    assert strict_lines(other) == lines


def test_dump_without_matplotlib_logs_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails: not installed
    model, x, y = model_and_batch()
    step(model, x, y, 0)
    rec = FlightRecorder(dump_dir=tmp_path)
    rec.record(grad_stats(model.named_parameters()), loss=1.5)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        path = rec.dump()
    assert strict_lines(path)[0]["loss"] == 1.5
    assert not path.with_suffix(".png").exists()
    assert "matplotlib is not installed" in caplog.text


def test_bad_input() -> None:
    model, x, y = model_and_batch()
    step(model, x, y, 0)
    stats = grad_stats(model.named_parameters())
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(0)
    rec = FlightRecorder()
    with pytest.raises(TypeError, match="GradStats or a GroupStats"):
        rec.record({"total_norm": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="guard must be a SpikeGuard"):
        rec.record(stats, guard=object())
    with pytest.raises(ValueError, match="loss must be one value"):
        rec.record(stats, loss=torch.ones(3))
    rec.record(stats)
    with pytest.raises(ValueError, match="guard changed at step 1"):
        rec.record(stats, guard=SpikeGuard())
    with pytest.raises(ValueError, match="the groups changed at step 1"):
        rec.record(stats, groups=stats.grouped("layer"))


def test_loss_of_any_real_kind_and_refused_losses() -> None:
    # A numpy float (a metric's) was a TypeError, a complex loss lost its imaginary part silently, and a meta loss
    # failed with an internal error; a numpy capacity was refused.
    np = pytest.importorskip("numpy")
    model, x, y = model_and_batch()
    step(model, x, y, 0)
    stats = grad_stats(model.named_parameters())
    rec = FlightRecorder(np.int64(3))
    assert rec.capacity == 3 and type(rec.capacity) is int
    for loss in (np.float32(1.5), np.float64(2.25), torch.tensor(3, dtype=torch.int32)):
        rec.record(stats, loss=loss)
    assert [r["loss"] for r in rec.to_dicts()] == [1.5, 2.25, 3.0]
    with pytest.raises(TypeError, match="loss must be a real tensor, got torch.complex64"):
        rec.record(stats, loss=torch.tensor(1 + 2j))
    with pytest.raises(ValueError, match="loss is a meta tensor"):
        rec.record(stats, loss=torch.ones((), device="meta"))
    assert rec.steps == 3


def test_meta_statistics_are_refused_and_the_recorder_stays_usable() -> None:
    # The ring was made on the meta device, and every to_dicts() and dump() failed after it.
    with torch.device("meta"):
        meta = nn.Linear(4, 1)
    meta(torch.randn(2, 4, device="meta")).sum().backward()
    rec = FlightRecorder(2)
    meta_stats = grad_stats(meta.named_parameters())
    for call in (lambda: rec.record(meta_stats), lambda: rec.record(meta_stats.grouped("layer"))):
        with pytest.raises(ValueError, match="statistics are of meta tensors"):
            call()
    assert rec.device is None and rec.steps == 0
    model, x, y = model_and_batch()
    step(model, x, y, 0)
    stats = grad_stats(model.named_parameters())
    rec.record(stats)
    assert rec.to_dicts()[0]["total_norm"] == pytest.approx(float(stats.total_norm), rel=1e-12)


def test_a_relative_dump_dir_is_fixed_when_made_and_the_warning_names_the_file_in_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``Trainer(flight_recorder=N)`` dumps into ``dump_dir="."``: resolved when the recorder is made (as the sinks'
    paths are), so a later ``os.chdir`` moves no dump and the warning names the file where it is, not
    ``flight-3.jsonl`` relative to a directory the reader cannot know."""
    from torch_gradstats import Trainer

    (tmp_path / "made").mkdir()
    (tmp_path / "later").mkdir()
    monkeypatch.chdir(tmp_path / "made")
    model, x, y = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def poison(trainer: Trainer) -> None:
        if trainer.global_step == 3:
            model[2].weight.grad[0, 0] = math.nan

    trainer = Trainer(model, opt, nn.MSELoss(), skip_nonfinite=True, flight_recorder=8, after_backward=poison,
                      progress=False)
    monkeypatch.chdir(tmp_path / "later")
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        trainer.train_epoch([(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)])
    dump = tmp_path / "made" / "flight-3.jsonl"
    assert dump.is_file() and not list((tmp_path / "later").iterdir())
    assert any(f"flight recorder dumped to {dump}" in r.getMessage() for r in caplog.records)
