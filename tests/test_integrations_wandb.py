"""W&B sink in offline mode (no network): the run file is read back record by record."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
import torch
from torch import nn

wandb = pytest.importorskip("wandb")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

import torch_gradstats as tg
from torch_gradstats.integrations import GradSink
from torch_gradstats.integrations.wandb import WandbSink


def _read_records(path: Path) -> list:
    """Records of a ``.wandb`` file: a 7-byte header, then LevelDB-log framing (32 KiB blocks; each chunk has a
    crc32, a 2-byte length and a type: 1 full, 2 first, 3 middle, 4 last) around protobuf ``Record`` messages."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, raws = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            raws.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            raws.append(pending + chunk)
    records = []
    for raw in raws:
        rec = pb.Record()
        rec.ParseFromString(raw)
        records.append(rec)
    return records


def completed_records(path: Path, timeout_s: float = 60.0) -> list:
    """The records of an offline run file once W&B's own service has written it to the end (its ``exit`` record):
    ``run.finish()`` returns before that, so the file is read again, a record cut short by the writer included,
    until it is complete."""
    from google.protobuf.message import DecodeError

    deadline, last = time.monotonic() + timeout_s, "no exit record"
    while True:
        try:
            records = _read_records(path)
        except DecodeError as exc:  # the last record is still being written
            last = f"{type(exc).__name__}: {exc}"
        else:
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
        assert time.monotonic() < deadline, f"the offline run file {path} was never completed ({last})"
        time.sleep(0.2)


def _key(item) -> str:  # type: ignore[no-untyped-def]
    return item.key or "/".join(item.nested_key)


def test_wandb_sink_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    run = wandb.init(project="torch-gradstats-test", dir=str(tmp_path), mode="offline")  # whatever ran before
    sink = WandbSink(run)
    assert isinstance(sink, GradSink)
    reports = {}
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        if step == 1:
            model[0].bias.grad[3] = float("inf")
        reports[step] = tg.grad_stats(model.named_parameters()).report()
        sink.log(reports[step], step)
        opt.step()
    assert run.summary["grad/first_nonfinite"] == "0.bias"
    assert run.summary["grad/first_nonfinite_step"] == 1
    run_dir = Path(run.dir).parent
    run.finish()

    files = list(run_dir.glob("run-*.wandb"))
    assert len(files) == 1
    records = completed_records(files[0])
    history = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
            history[rec.history.step.num] = row
    assert sorted(history) == [0, 1, 2]
    for step, report in reports.items():
        row = history[step]
        for name, norm in report.norms.items():
            got = row[f"grad/norm/{name}"]
            assert (math.isinf(got) and math.isinf(norm)) or got == pytest.approx(norm, rel=1e-12)
        assert row["grad/inf_count"] == report.inf_count
        assert row["grad/nan_count"] == 0
        assert row["grad/health"] == report.health
        assert row["grad/first_nonfinite_index"] == (1 if step == 1 else -1)  # "0.bias" is second
    assert math.isinf(history[1]["grad/total_norm"]) and history[1]["grad/health"] == 0.0
    assert history[0]["grad/total_norm"] == pytest.approx(reports[0].total_norm, rel=1e-12)
    summary = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
    assert summary["grad/first_nonfinite"] == "0.bias"


def test_wandb_sink_needs_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wandb, "run", None)
    report = tg.grad_stats([]).report()
    with pytest.raises(RuntimeError, match="wandb.init"):
        WandbSink().log(report, 0)


def test_a_step_lower_than_one_logged_is_refused_not_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    model = nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    report = tg.grad_stats(model.named_parameters()).report()
    run = wandb.init(project="torch-gradstats-test", dir=str(tmp_path), mode="offline")
    sink = WandbSink(run)
    sink.log(report, 5)
    with pytest.raises(ValueError, match="WandbSink.log: step 3 is lower than step 5, already logged"):
        sink.log(report, 3)  # W&B itself drops it with a warning
    with pytest.raises(TypeError, match=r"WandbSink.log: step must be an int, got 6.0 \(float\)"):
        sink.log(report, 6.0)  # type: ignore[arg-type]
    sink.log(report, 5)  # the same step again: its row
    sink.log(report, 6)
    run_dir = Path(run.dir).parent
    run.finish()

    records = completed_records(next(run_dir.glob("run-*.wandb")))
    steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
    assert steps == [5, 6]
