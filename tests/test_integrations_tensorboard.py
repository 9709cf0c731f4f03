"""TensorBoard sink and the demo's --tensorboard option: event files written, then read back with TensorBoard."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import torch_gradstats as tg
from torch_gradstats.integrations import GradSink, metrics
from torch_gradstats.integrations.tensorboard import TensorBoardSink
from torch_gradstats.monitors.updates import UpdateRatio, grad_and_weight_stats


def _events(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def _scalar(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_sink_scalars_histograms_and_text(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer, histograms=True)
    assert isinstance(sink, GradSink)
    expected = {}
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        if step == 2:
            model[2].weight.grad[0, 0] = float("nan")
        report = tg.grad_stats(model.named_parameters()).report()
        expected[step] = report
        sink.log(report, step)
        opt.step()
    writer.close()

    acc = _events(tmp_path)
    tags = acc.Tags()
    total = _scalar(acc, "grad/total_norm")
    for step in (0, 1):
        assert total[step] == pytest.approx(expected[step].total_norm, rel=1e-6)
        for name, norm in expected[step].norms.items():
            assert _scalar(acc, f"grad/norm/{name}")[step] == pytest.approx(norm, rel=1e-6)
    assert math.isnan(total[2])
    assert _scalar(acc, "grad/nan_count") == {0: 0.0, 1: 0.0, 2: 1.0}
    assert _scalar(acc, "grad/first_nonfinite_index") == {0: -1.0, 1: -1.0, 2: 2.0}  # "2.weight" is third
    assert _scalar(acc, "grad/health")[2] == 0.0
    # every numeric figure of the report became a scalar
    assert set(metrics(expected[0])) <= set(tags["scalars"])
    # histogram over parameters of the per-parameter norms; the NaN norm left out at step 2
    hist = {e.step: e.histogram_value for e in acc.Histograms("grad/norms")}
    assert hist[0].num == 4 and hist[2].num == 3
    assert hist[0].max == pytest.approx(expected[0].max_norm, rel=1e-6)
    # the name of the bad parameter, as text, only at the bad step
    texts = acc.Tensors("grad/first_nonfinite/text_summary")
    assert [t.step for t in texts] == [2]
    assert b"2.weight" in texts[0].tensor_proto.string_val[0]


def test_sink_with_update_report(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    model(torch.randn(4, 3)).sum().backward()
    s = grad_and_weight_stats(model.named_parameters(), optimizer=opt)
    with UpdateRatio(model.named_parameters()) as ratio:
        opt.step()
    s.update = ratio.stats
    report = s.report()
    with SummaryWriter(str(tmp_path)) as writer:
        TensorBoardSink(writer, prefix="gs/", histograms=True).log(report, 7)
    acc = _events(tmp_path)
    assert _scalar(acc, "gs/weight_norm/weight")[7] == pytest.approx(report.weight_norms["weight"], rel=1e-6)
    assert _scalar(acc, "gs/update_ratio/bias")[7] == pytest.approx(report.update_ratios["bias"], rel=1e-6)
    assert _scalar(acc, "gs/lr_update_ratio/bias")[7] == pytest.approx(report.lr_update_ratios["bias"], rel=1e-6)
    assert {e.step for e in acc.Histograms("gs/update_ratios")} == {7}


def test_demo_writes_tensorboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch_gradstats.cli import demo

    tb = tmp_path / "tb"
    code = demo.main(["--steps", "6", "--inject-nan", "3", "--out", str(tmp_path / "out"), "--no-plot",
                      "--no-progress", "--device", "cpu", "--tensorboard", str(tb)])
    assert code == 0
    capsys.readouterr()
    acc = _events(tb)
    norms = _scalar(acc, "grad/total_norm")
    assert sorted(norms) == list(range(6))
    assert math.isnan(norms[3]) and all(math.isfinite(norms[s]) for s in (0, 1, 2, 4, 5))
    assert _scalar(acc, "grad/skipped") == {s: float(s == 3) for s in range(6)}
    assert _scalar(acc, "grad/nan_count")[3] > 0
    assert set(_scalar(acc, "train/loss")) == set(range(6))


def _report() -> tg.GradReport:
    model = nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    return tg.grad_stats(model.named_parameters()).report()


def test_a_writer_the_sink_made_is_closed_by_close_and_by_dropping_the_sink(tmp_path: Path) -> None:
    report = _report()
    with TensorBoardSink(str(tmp_path / "ctx")) as sink:
        sink.log(report, 0)
    assert _scalar(_events(tmp_path / "ctx"), "grad/total_norm") == {0: pytest.approx(report.total_norm)}
    sink.close()  # a second close does nothing
    with pytest.raises(ValueError, match="TensorBoardSink: the sink is closed"):
        sink.log(report, 1)

    dropped = TensorBoardSink(tmp_path / "dropped")  # never closed: dropping it closes its writer
    for step in range(3):
        dropped.log(report, step)
    del dropped
    acc = _events(tmp_path / "dropped")
    assert set(metrics(report)) <= set(acc.Tags()["scalars"])
    assert list(_scalar(acc, "grad/total_norm")) == [0, 1, 2]


def test_close_and_flush_leave_your_writer_open(tmp_path: Path) -> None:
    report = _report()
    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer)
    sink.log(report, 0)
    sink.flush()
    assert list(_scalar(_events(tmp_path), "grad/total_norm")) == [0]
    sink.close()
    writer.add_scalar("mine", 1.0, 1)  # still yours, still open
    writer.close()
    assert list(_scalar(_events(tmp_path), "mine")) == [1]


@pytest.mark.slow
@pytest.mark.parametrize("end", ["exit", "raise", "KeyboardInterrupt"])
def test_nothing_logged_is_lost_when_the_process_ends_without_close(tmp_path: Path, end: str) -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, torch_gradstats as tg
        from torch.utils.tensorboard import SummaryWriter
        from torch_gradstats.integrations.tensorboard import TensorBoardSink
        m = torch.nn.Linear(3, 2)
        m(torch.ones(4, 3)).sum().backward()
        report = tg.grad_stats(m.named_parameters()).report()
        mine = TensorBoardSink(SummaryWriter({str(tmp_path / "yours")!r}))
        made = TensorBoardSink({str(tmp_path / "made")!r})
        for step in range(3):
            mine.log(report, step)
            made.log(report, step)
        if {end!r} == "raise":
            raise RuntimeError("the user's step failed")
        if {end!r} == "KeyboardInterrupt":
            raise KeyboardInterrupt
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert (done.returncode == 0) == (end == "exit"), done.stderr
    for logdir in ("yours", "made"):
        acc = _events(tmp_path / logdir)
        assert set(metrics(_report())) <= set(acc.Tags()["scalars"]), logdir
        for tag in acc.Tags()["scalars"]:
            assert list(_scalar(acc, tag)) == [0, 1, 2], (logdir, tag)


def test_a_step_that_is_no_int_is_refused_not_truncated(tmp_path: Path) -> None:
    with TensorBoardSink(str(tmp_path)) as sink:
        for step in (1.7, "3", True):
            with pytest.raises(TypeError, match="TensorBoardSink.log: step must be an int"):
                sink.log(_report(), step)  # type: ignore[arg-type]
        sink.log(_report(), np.int64(2))  # type: ignore[arg-type]
    assert list(_scalar(_events(tmp_path), "grad/total_norm")) == [2]


@pytest.mark.parametrize("writer", [None, 42, object()], ids=["None", "int", "object"])
def test_a_writer_that_is_no_summary_writer_is_refused_when_the_sink_is_made(writer: object) -> None:
    with pytest.raises(TypeError, match="TensorBoardSink: writer must be a SummaryWriter .* or a log directory, got a"):
        TensorBoardSink(writer)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX systems")
@pytest.mark.parametrize("flush_every", [1, None])
def test_a_forked_child_refuses_to_log_instead_of_hanging(tmp_path: Path, flush_every: int | None) -> None:
    """A forked child (a DataLoader worker) that logs through its copy of the sink gets a ValueError from log and
    flush, as the file sinks' copies do: its copy of the writer has no thread writing the queue, and the child hung
    (at the first flush, or once the queue was full). The parent's sink goes on writing."""
    sink = TensorBoardSink(tmp_path, flush_every=flush_every)
    sink.log(_report(), 0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:  # whatever happens, the child ends here (what it wrote to the pipe is checked)
            os.close(read)
            said = []
            for call in (lambda: [sink.log(_report(), s) for s in range(1, 30)], sink.flush):
                try:
                    call()
                except ValueError as exc:
                    said.append(str(exc))
            os.write(write, "\n".join(said).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung logging through its copy of the writer")
        time.sleep(0.05)
    with os.fdopen(read) as f:
        said = f.read().splitlines()
    assert len(said) == 2 and all("forked from" in line for line in said), said
    sink.log(_report(), 1)
    sink.close()
    assert list(_scalar(_events(tmp_path), "grad/total_norm")) == [0, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX systems")
def test_a_forked_child_ends_without_touching_the_writer(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    for step in range(3):  # events queued for the writer's thread, which a forked child does not have
        sink.log(_report(), step)
    end = sink._end  # what the end of a process runs
    assert end is not None
    pid = os.fork()
    if pid == 0:
        try:
            end()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung closing its copy of the writer")
        time.sleep(0.05)
    sink.close()
    assert list(_scalar(_events(tmp_path), "grad/total_norm")) == [0, 1, 2]


def test_flush_every_puts_each_logged_step_on_disk_when_log_returns(tmp_path: Path) -> None:
    report = _report()
    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer, flush_every=2)
    for step in range(4):
        sink.log(report, step)
        acc = _events(tmp_path)  # read while the writer is open
        on_disk = [] if "grad/total_norm" not in acc.Tags()["scalars"] else list(_scalar(acc, "grad/total_norm"))
        if step % 2:
            assert set(metrics(report)) <= set(acc.Tags()["scalars"])
            assert on_disk == list(range(step + 1))
    writer.close()
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="TensorBoardSink: flush_every must be a positive int or None"):
            TensorBoardSink(str(tmp_path / "bad"), flush_every=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "bad").exists()
