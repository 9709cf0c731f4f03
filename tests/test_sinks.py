"""CSVSink and JSONLSink: files read back with the standard library, numbers as numbers, NaN/Inf in CSV and JSON,
columns that appear later, flushing, and the Trainer's log_to."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torch_gradstats as tg
from torch_gradstats.integrations import CSVSink, GradSink, JSONLSink
from torch_gradstats.training import Trainer


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    m(torch.randn(5, 3)).sum().backward()
    return m


def _reports():
    m = _model()
    plain = tg.grad_stats(m.named_parameters()).report()
    clipped = tg.clip_grad_norm_(m.named_parameters(), max_norm=0.1).report()
    m[2].weight.grad[0, 0] = math.nan
    m[2].bias.grad[0] = math.inf
    bad = tg.grad_stats(m.named_parameters()).report()
    return plain, clipped, bad


def test_sinks_are_exported_and_follow_the_protocol(tmp_path: Path) -> None:
    for cls in (CSVSink, JSONLSink):
        with cls(tmp_path / f"x.{cls.__name__}") as sink:
            assert isinstance(sink, GradSink)


def test_csv_rows_numbers_nan_inf_and_a_column_added_later(tmp_path: Path) -> None:
    plain, clipped, bad = _reports()
    path = tmp_path / "grads.csv"
    sink = CSVSink(path)
    sink.log(plain, 0)
    sink.log(bad, 1)
    sink.log(clipped, 2)  # clip_coef and clipped_norm appear only now
    sink.close()
    text = path.read_text()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    header = text.splitlines()[0].split(",")
    assert header[0] == "step" and header[1:len(plain.to_dict()) + 1] == list(plain.to_dict())
    assert header[-2:] == ["clip_coef", "clipped_norm"]
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["numel"] == str(plain.numel) and rows[0]["clip_coef"] == ""  # an int as an int; empty cell
    assert float(rows[0]["total_norm"]) == plain.total_norm  # every digit kept
    assert rows[1]["total_norm"] == "nan" and rows[1]["inf_norm"] == "nan" and rows[1]["norm/2.bias"] == "inf"
    assert rows[1]["first_nonfinite"] == "2.weight" and rows[0]["first_nonfinite"] == ""
    assert float(rows[2]["clip_coef"]) == clipped.clip_coef and float(rows[2]["clipped_norm"]) == clipped.clipped_norm


def test_jsonl_lines_null_for_non_finite_and_key_order(tmp_path: Path) -> None:
    plain, clipped, bad = _reports()
    path = tmp_path / "grads.jsonl"
    with JSONLSink(path, prefix="grad/") as sink:
        sink.log(plain, 0)
        sink.log(clipped, 1)
        sink.log(bad, 2)  # no clip keys here: null, in their place
    lines = path.read_text().splitlines()
    assert "NaN" not in lines[2] and "Infinity" not in lines[2]  # strict JSON: null, the counts say which
    rows = [json.loads(line) for line in lines]
    assert list(rows[0]) == ["step", *(f"grad/{k}" for k in plain.to_dict())]
    assert list(rows[1]) == list(rows[2]) == [*rows[0], "grad/clip_coef", "grad/clipped_norm"]
    assert rows[2]["grad/clip_coef"] is None and rows[1]["grad/clip_coef"] == clipped.clip_coef
    assert rows[2]["grad/total_norm"] is None and rows[2]["grad/norm/2.bias"] is None
    assert rows[2]["grad/nan_count"] == 1 and rows[2]["grad/inf_count"] == 1
    assert isinstance(rows[0]["grad/numel"], int) and rows[0]["grad/total_norm"] == plain.total_norm
    assert rows[0]["grad/first_nonfinite"] is None and rows[2]["grad/first_nonfinite"] == "2.weight"


def test_groups_and_styles_reach_the_files(tmp_path: Path) -> None:
    stats = tg.grad_stats(_model().named_parameters())
    report = stats.report(groups=stats.grouped(lambda n: n.split(".")[0]))
    with JSONLSink(tmp_path / "g.jsonl") as sink:
        sink.log(report, 0)
    row = json.loads((tmp_path / "g.jsonl").read_text())
    assert row["group/0/norm"] == report.groups.norms["0"]  # type: ignore[union-attr]
    with CSVSink(tmp_path / "m.csv", style="megatron") as sink:
        sink.log(report, 7)
    assert (tmp_path / "m.csv").read_text().splitlines() == [
        "step,grad-norm,num-zeros", f"7,{report.total_norm!r},{report.zero_count}"]


def test_close_flushes(tmp_path: Path) -> None:
    plain, _, _ = _reports()
    for cls in (CSVSink, JSONLSink):
        path = tmp_path / f"f.{cls.__name__}"
        sink = cls(path, flush_every=100)
        sink.log(plain, 0)
        assert path.read_text() == ""  # still in the file's buffer
        sink.close()
        assert str(plain.numel) in path.read_text()
        sink.close()  # a second close does nothing
        with pytest.raises(ValueError, match="is closed"):
            sink.log(plain, 1)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="path must be a str or path"):
        CSVSink(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flush_every must be a positive int"):
        JSONLSink(tmp_path / "x", flush_every=0)


def _make_sink(kind: str, tmp_path: Path, style: object) -> object:
    if kind == "tensorboard":
        pytest.importorskip("tensorboard")
        from torch_gradstats.integrations.tensorboard import TensorBoardSink

        return TensorBoardSink(tmp_path / "tb", key_style=style)  # type: ignore[arg-type]
    if kind == "wandb":
        from torch_gradstats.integrations.wandb import WandbSink

        return WandbSink(key_style=style)  # type: ignore[arg-type]
    if kind == "mlflow":
        from torch_gradstats.integrations import MLflowSink

        return MLflowSink(key_style=style)  # type: ignore[arg-type]
    return {"csv": CSVSink, "jsonl": JSONLSink}[kind](tmp_path / "f", style=style)


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "mlflow", "csv", "jsonl"])
def test_a_bad_key_style_is_refused_when_the_sink_is_made(kind: str, tmp_path: Path) -> None:
    name = {"tensorboard": "TensorBoardSink", "wandb": "WandbSink", "mlflow": "MLflowSink", "csv": "CSVSink",
            "jsonl": "JSONLSink"}[kind]
    with pytest.raises(ValueError, match=f"{name}: (key_)?style must be one of default, .*got 'hugginface'"):
        _make_sink(kind, tmp_path, "hugginface")
    with pytest.raises(TypeError, match=f"{name}: (key_)?style must be a str"):
        _make_sink(kind, tmp_path, 3)
    assert list(tmp_path.iterdir()) == []  # nothing made on the way


def test_trainer_log_to_writes_one_row_per_logging_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)),
                        batch_size=8)
    sinks = [CSVSink(tmp_path / "t.csv"), JSONLSink(tmp_path / "t.jsonl")]
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), log_to=sinks, log_every=2,
            progress=False).train_epoch(loader)
    for s in sinks:
        s.close()
    with open(tmp_path / "t.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    json_rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["step"] for r in csv_rows] == ["0", "2", "4"] and [r["step"] for r in json_rows] == [0, 2, 4]
    for c, j in zip(csv_rows, json_rows):
        assert float(c["total_norm"]) == j["total_norm"] > 0


class _Failing:
    """A sink whose backend fails (a full disk, a lost connection)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def log(self, report: tg.GradReport, step: int) -> None:
        raise self.error


def test_a_sink_that_raises_keeps_the_report_from_no_other_sink(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from torch_gradstats.integrations import log_to

    plain = _reports()[0]
    first, second = OSError("disk full"), RuntimeError("connection lost")
    with CSVSink(tmp_path / "s.csv") as c, JSONLSink(tmp_path / "s.jsonl") as j, \
            caplog.at_level("ERROR", logger="torch_gradstats"), pytest.raises(OSError, match="disk full") as info:
        log_to([_Failing(first), c, _Failing(second), j], plain, 7)
    assert info.value is first
    assert "sink [0] (a _Failing) raised at step 7: OSError: disk full" in caplog.text
    assert "sink [2] (a _Failing) raised at step 7: RuntimeError: connection lost" in caplog.text
    with open(tmp_path / "s.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["7"]
    assert [json.loads(line)["step"] for line in (tmp_path / "s.jsonl").read_text().splitlines()] == [7]

    class Interrupted:
        def log(self, report: tg.GradReport, step: int) -> None:
            raise KeyboardInterrupt

    with JSONLSink(tmp_path / "k.jsonl") as j, pytest.raises(KeyboardInterrupt):
        log_to([Interrupted(), j], plain, 0)  # stops at once
    assert (tmp_path / "k.jsonl").read_text() == ""


def test_trainer_log_to_gives_the_report_to_every_sink_before_raising(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)),
                        batch_size=8)
    with CSVSink(tmp_path / "t.csv") as sink:
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                          log_to=[_Failing(OSError("disk full")), sink], progress=False)
        with pytest.raises(OSError, match="disk full"):
            trainer.train_epoch(loader)
    with open(tmp_path / "t.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0"]


def test_log_to_refuses_what_is_no_list_of_sinks_before_any_sink_writes(tmp_path: Path) -> None:
    from torch_gradstats.integrations import log_to

    plain = _reports()[0]
    with CSVSink(tmp_path / "one.csv") as sink:
        with pytest.raises(TypeError, match="log_to must be a list of sinks"):
            log_to(sink, plain, 0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"log_to\[1\] is a NoneType without a log\(report, step\) method"):
            log_to([sink, None], plain, 0)  # type: ignore[list-item]
    assert (tmp_path / "one.csv").read_text() == ""
