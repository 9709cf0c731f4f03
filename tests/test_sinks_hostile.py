"""The sinks under hostile figures and hostile endings: numpy scalars, tensors (on a device too) and bools reach
every sink as numbers (none dropped, none written as ``tensor(...)``), anything else is an error naming its key, and
so is a figure named ``step`` in the file sinks; a process killed with SIGKILL mid-run leaves every flushed row
readable, and the run resumes into the same files. (Names that need quoting in a CSV file resumed after a crash:
tests/test_file_sinks.py.)"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torch_gradstats as tg
from torch_gradstats.integrations import CSVSink, JSONLSink, metrics


def _report(**extra: object) -> tg.GradReport:
    model = nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    report = tg.grad_stats(model.named_parameters()).report()
    report.extra = dict(extra)  # type: ignore[arg-type]
    return report


ODD = {"np32": np.float32(1.5), "np_int": np.int64(3), "tensor": torch.tensor(4.0), "int_tensor": torch.tensor([5]),
       "flag": True, "np_flag": np.bool_(False), "np_nan": np.float64("nan"), "array": np.array(-math.inf)}


def test_numpy_scalars_tensors_and_bools_reach_every_sink_as_numbers(tmp_path: Path) -> None:
    report = _report(**ODD)
    got = {k: v for k, v in metrics(report).items() if k in ODD}
    assert list(got) == list(ODD)
    assert all(type(v) is float for v in got.values())
    assert got["np32"] == 1.5 and got["np_int"] == 3.0 and got["tensor"] == 4.0 and got["int_tensor"] == 5.0
    assert got["flag"] == 1.0 and got["np_flag"] == 0.0 and math.isnan(got["np_nan"]) and got["array"] == -math.inf

    with CSVSink(tmp_path / "v.csv") as c, JSONLSink(tmp_path / "v.jsonl") as j:
        c.log(report, 0)
        j.log(report, 0)
    with open(tmp_path / "v.csv", newline="") as f:
        row = next(csv.DictReader(f))
    assert {k: row[k] for k in ODD} == {"np32": "1.5", "np_int": "3", "tensor": "4.0", "int_tensor": "5",
                                        "flag": "True", "np_flag": "False", "np_nan": "nan", "array": "-inf"}
    line = json.loads((tmp_path / "v.jsonl").read_text())
    assert {k: line[k] for k in ODD} == {"np32": 1.5, "np_int": 3, "tensor": 4.0, "int_tensor": 5, "flag": True,
                                         "np_flag": False, "np_nan": None, "array": None}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_tensor_figure_is_read_not_dropped(tmp_path: Path) -> None:
    report = _report(on_device=torch.tensor(2.5, device="cuda"), int_on_device=torch.tensor([7], device="cuda"))
    got = metrics(report)
    assert got["on_device"] == 2.5 and got["int_on_device"] == 7.0
    with JSONLSink(tmp_path / "d.jsonl") as j:
        j.log(report, 0)
    line = json.loads((tmp_path / "d.jsonl").read_text())
    assert line["on_device"] == 2.5 and line["int_on_device"] == 7


@pytest.mark.parametrize("bad", [torch.ones(2), [1.0], {"a": 1.0}, object(), 1j],
                         ids=["tensor", "list", "dict", "object", "complex"])
def test_a_figure_that_is_no_number_is_an_error_naming_it_and_nothing_is_written(tmp_path: Path, bad: object) -> None:
    report = _report(**{"my/figure": bad})
    with pytest.raises(TypeError, match="report figure 'my/figure' is of type"):
        metrics(report)
    with CSVSink(tmp_path / "b.csv") as c, JSONLSink(tmp_path / "b.jsonl") as j:
        for sink in (c, j):
            with pytest.raises(TypeError, match="report figure 'my/figure' is of type"):
                sink.log(report, 0)
        c.log(_report(), 1)
        j.log(_report(), 1)
    with open(tmp_path / "b.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1"] and "my/figure" not in rows[0]
    lines = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] and "my/figure" not in lines[0]


def test_an_int_too_large_for_a_float_is_an_error_naming_it(tmp_path: Path) -> None:
    report = _report(huge=10**400)
    with pytest.raises(OverflowError, match="metrics: 'huge' is 1000.*, too large for a float"):
        metrics(report)
    with JSONLSink(tmp_path / "h.jsonl") as j:  # JSON and CSV keep every digit
        j.log(report, 0)
    assert json.loads((tmp_path / "h.jsonl").read_text())["huge"] == 10**400


_KILLED_CHILD = """
import os, signal, sys
import torch, torch_gradstats as tg
from torch_gradstats.integrations import CSVSink, JSONLSink
from torch_gradstats.integrations.tensorboard import TensorBoardSink
root = sys.argv[1]
m = torch.nn.Linear(3, 2)
m(torch.ones(4, 3)).sum().backward()
report = tg.grad_stats(m.named_parameters()).report()
sinks = [CSVSink(os.path.join(root, "g.csv")), JSONLSink(os.path.join(root, "g.jsonl")),
         CSVSink(os.path.join(root, "every3.csv"), flush_every=3)]
tb = TensorBoardSink(os.path.join(root, "tb"))
tb_every = TensorBoardSink(os.path.join(root, "tb_every"), flush_every=1)
for step in range(4):
    for sink in sinks:
        sink.log(report, step)
    tb.log(report, step)
    tb_every.log(report, step)
    if step == 2:
        tb.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL: POSIX systems")
def test_a_process_killed_mid_run_keeps_every_flushed_row_and_the_files_resume(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    with open(tmp_path / "g.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2", "3"]  # flushed at every row
    assert [json.loads(x)["step"] for x in (tmp_path / "g.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    with open(tmp_path / "every3.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0", "1", "2"]  # the last flush: after step 2
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        for tag in metrics(_report()):  # every figure up to the flush
            assert [e.step for e in acc.Scalars(tag)][:3] == [0, 1, 2], tag
        acc = EventAccumulator(str(tmp_path / "tb_every"))
        acc.Reload()
        for tag in metrics(_report()):  # flush_every=1: every figure of every step
            assert [e.step for e in acc.Scalars(tag)] == [0, 1, 2, 3], tag

    # The run resumed into the same files, with a key it did not have (clipping starts).
    model = nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    clipped = tg.clip_grad_norm_(model.named_parameters(), max_norm=0.1).report()
    with CSVSink(tmp_path / "g.csv") as c, JSONLSink(tmp_path / "g.jsonl") as j:
        c.log(clipped, 4)
        j.log(clipped, 4)
    with open(tmp_path / "g.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames is not None and reader.fieldnames.count("step") == 1  # one header
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r["clip_coef"] for r in rows] == ["", "", "", "", repr(clipped.clip_coef)]
    assert [r["total_norm"] for r in rows][-1] == repr(clipped.total_norm)
    lines = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4] and lines[-1]["clip_coef"] == clipped.clip_coef



@pytest.mark.parametrize("cls", [CSVSink, JSONLSink])
def test_a_figure_named_step_is_refused_not_written_over_the_step(tmp_path: Path, cls: type) -> None:
    with cls(tmp_path / "s") as sink:
        with pytest.raises(ValueError, match=f"{cls.__name__}.log: the report has a figure named 'step'"):
            sink.log(_report(step=99.0), 5)
        sink.log(_report(steps=99.0), 6)
    text = (tmp_path / "s").read_text()
    assert "99.0" in text and text.count("\n") == (2 if cls is CSVSink else 1)  # the header (CSV) and step 6
