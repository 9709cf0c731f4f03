"""The demo's table labels, its progress bar (on a real pseudo-terminal and in a pipe) and the data behind its
figure (the matplotlib artists and log.jsonl, not pixels)."""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from torch_gradstats.cli import demo
from torch_gradstats.training import format_epoch_table

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _strict(line: str) -> dict:
    """One line of log.jsonl, parsed as strict JSON: a NaN or Infinity token raises."""

    def refuse(token: str) -> None:
        raise ValueError(f"log.jsonl is not strict JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def _steps(log: Path) -> list[dict]:
    return [r for r in map(_strict, log.read_text().splitlines()) if r["type"] == "step"]


# ------------------------------------------------------------------------------------------------- the table
def test_table_columns_are_named_for_what_they_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = demo.run(steps=30, out=tmp_path, progress=False, plot=False, inject_nan=27)
    out = capsys.readouterr().out
    assert demo.TABLE_KEY in out
    header, _, *rows = format_epoch_table(result.summaries).splitlines()
    assert "max|g|" not in out and "mean|g|" not in out
    columns = header.split()[:8]
    assert columns == ["epoch", "steps", "loss", "max_norm", "mean_norm", "min_health", "NaN", "Inf"]
    assert header in out
    for summary, row in zip(result.summaries, rows):
        cells = dict(zip(columns, row.split()))
        # each column holds the EpochSummary field it is named after
        assert float(cells["max_norm"]) == pytest.approx(summary.max_norm, rel=1e-3)
        assert float(cells["mean_norm"]) == pytest.approx(summary.mean_norm, rel=1e-3)
        assert float(cells["min_health"]) == pytest.approx(summary.min_health, abs=1e-3)
    # the norms are global L2 norms of the steps; min_health is the worst step, 0.0 in the epoch of the NaN
    steps = _steps(result.log)
    second = [r for r in steps if r["epoch"] == 1]
    assert result.summaries[1].max_norm == max(r["total_norm"] for r in second if r["total_norm"] is not None)
    assert result.summaries[1].min_health == 0.0 and result.summaries[0].min_health == 1.0


# ------------------------------------------------------------------------------------------------- progress bar
def _demo_in_pty(tmp_path: Path, args: list[str], size: tuple[int, int] | None) -> tuple[int, str]:
    """Run ``python -m torch_gradstats demo`` with stdin, stdout and stderr on a new pseudo-terminal; returns the
    exit status and everything the terminal received."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    if size is not None:
        rows, cols = size
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "torch_gradstats", "demo", *args], stdin=slave, stdout=slave,
                            stderr=slave, cwd=tmp_path, env=ENV, close_fds=True)
    os.close(slave)
    received = bytearray()
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not data:
                break
            received += data
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(timeout=30), received.decode("utf-8", "replace")


@pytest.mark.slow
@pytest.mark.parametrize("size", [(24, 100), None], ids=["sized_terminal", "unsized_terminal"])
def test_progress_bar_shows_on_a_terminal(tmp_path: Path, size: tuple[int, int] | None) -> None:
    """A terminal gets the bar; one that reports a 0x0 size (``script``, CI runners) gets it too, 80 wide."""
    pytest.importorskip("tqdm")
    rc, text = _demo_in_pty(tmp_path, ["--steps", "30", "--no-plot", "--out", "o"], size)
    assert rc == 0, text
    assert "demo: 100%|" in text and "30/30" in text, text
    assert "max_norm" in text and "Skipped 0 optimizer step(s)" in text  # the table and summary still show
    if size is None:
        final = text[text.rindex("demo: 100%|"):].split("\r")[0].split("\n")[0]
        assert len(final) == 80  # tqdm's own width for an unsized terminal would draw nothing


@pytest.mark.slow
def test_no_progress_on_a_terminal(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    rc, text = _demo_in_pty(tmp_path, ["--steps", "5", "--no-plot", "--no-progress", "--out", "o"], (24, 100))
    assert rc == 0, text
    assert "demo:" not in text.replace("torch_gradstats demo:", "") and "%|" not in text


@pytest.mark.slow
def test_progress_bar_stays_quiet_in_a_pipe(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    proc = subprocess.run([sys.executable, "-m", "torch_gradstats", "demo", "--steps", "30", "--no-plot", "--out",
                           "o"], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # nothing for a log file: no bar, no carriage returns
    assert "max_norm" in proc.stdout and "\r" not in proc.stdout


# ------------------------------------------------------------------------------------------------- the figure
def _nonfinite_panel(result: demo.DemoResult, inject_step: int | None) -> tuple[Any, Any]:  # figure, Axes
    pytest.importorskip("matplotlib")
    fig = demo._figure(result.summaries, inject_step)
    return fig, fig.axes[3]


def _bar_heights(ax: Any) -> dict[int, float]:
    """Height of the stacked NaN + Inf bars at each step, read from the bar artists."""
    heights: dict[int, float] = {}
    for container in ax.containers:
        for patch in container.patches:
            step = round(patch.get_x() + patch.get_width() / 2)
            heights[step] = heights.get(step, 0.0) + patch.get_height()
    return heights


def test_figure_shows_the_injected_nan_step(tmp_path: Path) -> None:
    result = demo.run(steps=30, inject_nan=20, out=tmp_path, progress=False, plot=True)
    assert result.plot is not None and result.plot.read_bytes()[:4] == b"\x89PNG"
    steps = _steps(result.log)
    numel = dict(demo.make_model(0).named_parameters())["hidden.weight"].numel()
    logged = {r["step"]: r["nan_count"] + r["inf_count"] for r in steps}
    assert {s: n for s, n in logged.items() if n} == {20: numel}

    fig, ax = _nonfinite_panel(result, 20)
    heights = _bar_heights(ax)
    assert heights == {s: float(n) for s, n in logged.items()}  # the bars are the log, step for step
    markers = [line for line in ax.lines if line.get_marker() == "v"]
    assert [(list(m.get_xdata()), list(m.get_ydata())) for m in markers] == [([20], [numel])]
    low, high = ax.get_ylim()
    assert low == 0 and high > numel  # the bar fits in the panel
    texts = [t.get_text() for t in ax.texts]
    assert texts == [f"step 20: {numel} NaN (first in hidden.weight); step skipped"]
    assert "NaN injected at step 20" in fig._suptitle.get_text()
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert [list(line.get_xdata()) for line in dashed] == [[20, 20]]


def test_default_run_figure_says_nothing_went_non_finite(tmp_path: Path) -> None:
    result = demo.run(steps=30, out=tmp_path, progress=False, plot=True)
    steps = _steps(result.log)
    assert len(steps) == 30 and not any(r["nan_count"] or r["inf_count"] or r["skipped"] for r in steps)

    fig, ax = _nonfinite_panel(result, None)
    assert set(_bar_heights(ax).values()) == {0.0}
    assert ax.get_ylim()[0] == 0  # a count axis, not one centred on zero with negative ticks
    assert [t.get_text() for t in ax.texts] == ["no NaN or Inf gradient in this run (--inject-nan STEP makes one)"]
    assert not any(line.get_marker() == "v" and len(line.get_xdata()) for line in ax.lines)
    assert ax.get_legend() is None
    assert "injected" not in fig._suptitle.get_text()
    assert all(math.isfinite(r["total_norm"]) for r in steps)


# ------------------------------------------------------------------------------------- spike guard, clip, watch
def _run_record(log: Path) -> dict:
    return next(r for r in map(_strict, log.read_text().splitlines()) if r["type"] == "run")


def _labelled(ax: Any, label: str) -> Any:
    return next(line for line in ax.lines if line.get_label() == label)


def test_spike_guard_skips_the_injected_spike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = demo.run(steps=30, inject_spike=20, out=tmp_path, progress=False, plot=True)
    out = capsys.readouterr().out
    assert "gradients multiplied by 1000 at step 20; with SpikeGuard" in out
    assert "SpikeGuard skipped step 20 (global grad norm" in out
    run = _run_record(result.log)
    assert run["inject_spike"] == 20 and run["spike_guard"] is True and run["guard_skipped_steps"] == [20]
    assert run["policy_figures"]["guard/skipped"] == 1
    steps = _steps(result.log)
    assert [r["step"] for r in steps if r["skipped"]] == [20]
    assert not any(r["nan_count"] or r["inf_count"] for r in steps)  # finite: the guard skipped it, not the NaN check
    others = sorted(r["total_norm"] for r in steps if r["step"] != 20)
    assert steps[20]["total_norm"] > 100 * others[-1]  # the spike the log recorded is the injected one
    assert result.plot is not None

    fig = demo._figure(result.summaries, None, None, 20)
    marker = _labelled(fig.axes[1], "skipped by SpikeGuard")
    assert list(marker.get_xdata()) == [20] and list(marker.get_ydata()) == [steps[20]["total_norm"]]
    assert [t.get_text() for t in fig.axes[1].texts] == ["step 20 skipped"]
    for ax in fig.axes:  # a dotted line marks the skipped step on every panel
        assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == ":"] == [[20, 20]]
    assert "gradients x1000 at step 20" in fig._suptitle.get_text()


def test_spike_guard_alone_skips_nothing_in_a_clean_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = demo.run(steps=50, spike_guard=True, out=tmp_path, progress=False, plot=False)
    assert "SpikeGuard skipped no step." in capsys.readouterr().out
    assert _run_record(result.log)["guard_skipped_steps"] == []
    assert not any(r["skipped"] for r in _steps(result.log))


def test_bad_example_is_named_by_its_batch_position(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = demo.run(steps=30, inject_bad_example=20, out=tmp_path, progress=False, plot=False)
    out = capsys.readouterr().out
    assert f"target of batch position {demo.BAD_POSITION} multiplied by 1000 at step 20; with SpikeGuard, " \
        "per-example norms" in out  # fmt: skip
    assert "SpikeGuard skipped step 20 (global grad norm" in out
    (line,) = [line for line in out.splitlines() if line.startswith("Per-example gradient norms")]
    found = re.fullmatch(r"Per-example gradient norms of skipped step 20, largest first \(0-based batch positions\): "
                         r"#(\d+) norm (\S+), #\d+ norm (\S+), #\d+ norm \S+; batch median (\S+)\.", line)
    assert found is not None, line
    assert int(found[1]) == demo.BAD_POSITION  # the corrupted example, named by the Trainer's per-example norms
    top, second, median = float(found[2]), float(found[3]), float(found[4])
    assert top > 50 * second and top > 50 * median
    run = _run_record(result.log)
    assert run["inject_bad_example"] == 20 and run["bad_position"] == demo.BAD_POSITION
    assert run["guard_skipped_steps"] == [20]
    steps = _steps(result.log)
    assert [r["step"] for r in steps if r["skipped"]] == [20]
    assert not any(r["nan_count"] or r["inf_count"] for r in steps)


def test_adaptive_clip_threshold_is_logged_and_drawn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = demo.run(steps=30, inject_spike=20, adaptive_clip=True, out=tmp_path, progress=False, plot=False)
    out = capsys.readouterr().out
    steps = _steps(result.log)
    assert len(result.thresholds) == len(steps) == 30
    # the log holds each step's threshold (null where it is inf: no clip on that step)
    assert [r["clip_threshold"] for r in steps] == [t if math.isfinite(t) else None for t in result.thresholds]
    assert all(math.isinf(t) for t in result.thresholds[:10])  # the 10-step warm-up clips nothing
    spike = steps[20]
    assert math.isfinite(result.thresholds[20]) and result.thresholds[20] < spike["total_norm"] / 100
    assert spike["skipped"]  # the guard judges the norm before clipping: it still skips the spike
    clipped = sum(r["total_norm"] > t for r, t in zip(steps, result.thresholds))
    assert f"AdaptiveClip clipped {clipped} of 30 steps" in out and clipped >= 1
    assert _run_record(result.log)["policy_figures"]["clip/threshold"] == steps[-1]["clip_threshold"]

    pytest.importorskip("matplotlib")
    fig = demo._figure(result.summaries, None, result.thresholds, 20)
    line = _labelled(fig.axes[1], "AdaptiveClip threshold")
    assert list(line.get_xdata()) == [r["step"] for r in steps]
    drawn = list(line.get_ydata())
    assert [None if math.isnan(v) else v for v in drawn] == [r["clip_threshold"] for r in steps]


@pytest.mark.parametrize("module", ["embed", "hidden", "head"])
def test_nan_in_a_module_forward_names_that_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], module: str
) -> None:
    result = demo.run(steps=30, inject_nan=20, nan_module=module, out=tmp_path, progress=False, plot=False)
    out = capsys.readouterr().out
    assert f"NaN injected into {module}'s forward output at step 20; with ActivationWatch" in out
    # the Trainer's warning, and its last_activation_report, name the module as the forward origin
    assert f"Trainer warning: torch_gradstats: epoch 0: non-finite activations at step 20: forward origin {module} (" \
        in out  # fmt: skip
    assert f"ActivationWatch: forward origin of the non-finite values: {module} (step 20)." in out
    run = _run_record(result.log)
    assert (run["nan_module"], run["activation_origin"], run["activation_step"]) == (module, module, 20)
    assert run["inject_param"] is None and run["watch_activations"] is True
    steps = _steps(result.log)
    assert [r["step"] for r in steps if r["skipped"]] == [20]
    assert steps[20]["loss"] is None and steps[20]["nan_count"] > 0 and steps[21]["loss"] is not None


def test_gradient_nan_with_the_watch_names_no_forward_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = demo.run(steps=30, inject_nan=20, watch_activations=True, out=tmp_path, progress=False, plot=False)
    out = capsys.readouterr().out
    # the NaN was put into a gradient after the backward: every activation was finite
    assert "activations finite at step 20; first non-finite parameter gradient: hidden.weight at step 20" in out
    assert "forward origin of the non-finite values" not in out
    run = _run_record(result.log)
    assert run["activation_origin"] is None and run["inject_param"] == "hidden.weight"


def test_layer_figure_is_written_and_draws_each_layers_norm(tmp_path: Path) -> None:
    mpl = pytest.importorskip("matplotlib")
    import numpy as np
    from matplotlib.image import imread

    from torch_gradstats.cli._demo_figure import layer_figure

    result = demo.run(steps=30, inject_nan=20, out=tmp_path, progress=False, plot=True)
    assert result.layer_plot == tmp_path / "layers.png"
    assert list(result.layer_norms) == ["embed", "hidden", "head"]  # GradStats.grouped("layer") of the demo model
    for r in _steps(result.log):  # the layers' norms make up each step's global norm, as the Trainer read it
        norms = [result.layer_norms[name][r["step"]] for name in result.layer_norms]
        if r["step"] == 20:  # the poisoned gradient: hidden's norm is NaN, the others are not
            assert r["total_norm"] is None and math.isnan(norms[1]) and math.isfinite(norms[0] + norms[2])
        else:
            assert math.isclose(math.sqrt(sum(v * v for v in norms)), r["total_norm"], rel_tol=1e-9)

    png = result.layer_plot.read_bytes()
    assert png[:4] == b"\x89PNG" and 20_000 < len(png) < 150_000
    pixels = imread(result.layer_plot)[..., :3]
    for color in ("tab:blue", "tab:orange", "tab:green"):  # each layer's line is drawn in it
        assert (np.abs(pixels - mpl.colors.to_rgb(color)).max(axis=-1) < 0.02).sum() > 100, color

    fig = layer_figure(result.layer_norms, [20])
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_legend().get_title().get_text() == "layer"
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.lines if not line.get_label().startswith("_")}
    assert list(lines) == ["embed", "hidden", "head"]
    for name, drawn in lines.items():  # a gap where the norm is NaN
        assert [None if math.isnan(v) else v for v in drawn] == [
            None if math.isnan(v) else v for v in result.layer_norms[name]]
    assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == "--"] == [[20, 20]]


def test_exponent_figure_is_written_from_each_steps_histogram(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import numpy as np

    from torch_gradstats.cli._demo_figure import exponent_figure
    from torch_gradstats.ops.op import HISTOGRAM_BUCKETS

    result = demo.run(steps=12, inject_nan=5, out=tmp_path, progress=False, plot=True)
    assert result.exponent_plot == tmp_path / "exponents.png"
    png = result.exponent_plot.read_bytes()
    assert png[:4] == b"\x89PNG" and 10_000 < len(png) < 150_000
    assert len(result.exponents) == 12 and all(len(row) == HISTOGRAM_BUCKETS for row in result.exponents)
    params = dict(demo.make_model(0).named_parameters())
    numel = sum(p.numel() for p in params.values())
    for step, row in enumerate(result.exponents):  # the finite non-zero gradient elements of each step
        assert sum(row) <= numel and (step == 5 or sum(row) > 0.5 * numel), step
    # step 5's poisoned gradient (all NaN) is not in its histogram
    assert sum(result.exponents[5]) <= numel - params["hidden.weight"].numel()

    fig = exponent_figure(result.exponents, [5])
    image = fig.axes[0].images[0].get_array()
    used = np.flatnonzero(np.asarray(result.exponents).sum(0))
    assert image.shape == (used[-1] + 1 - used[0], 12)  # one column per step, one row per binade used
    shares = np.asarray(result.exponents, dtype=float)[:, used[0]:used[-1] + 1]
    shares /= shares.sum(1, keepdims=True)
    assert np.allclose(np.nan_to_num(np.asarray(image.filled(np.nan))), shares.T)


# ------------------------------------------------------------------------ the figures as saved: marks and legends
@pytest.fixture
def saved_figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The figures the demo saves, by file name (matplotlib's ``Figure.savefig`` wrapped to keep each one)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures: dict[str, Any] = {}
    savefig = Figure.savefig

    def keep(self: Any, fname: Any, *args: Any, **kwargs: Any) -> Any:
        figures[Path(fname).name] = self
        return savefig(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _drawn(fig: Any) -> Any:
    """``fig`` drawn (on a new Agg canvas: the saved figure was closed); returns the renderer that measures it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _inside(inner: Any, outer: Any) -> bool:
    tol = 0.5  # pixels: rounding
    return (inner.x0 >= outer.x0 - tol and inner.x1 <= outer.x1 + tol
            and inner.y0 >= outer.y0 - tol and inner.y1 <= outer.y1 + tol)  # fmt: skip


def _assert_no_legend_covers_data(fig: Any, name: str) -> None:
    renderer = _drawn(fig)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    for legend in legends:
        for ax in fig.axes:  # every panel, and the colour bar
            box = legend.get_window_extent(renderer)
            assert not box.overlaps(ax.get_window_extent(renderer)), (name, ax.get_ylabel())


@pytest.mark.parametrize(("steps", "step"), [(200, 20), (30, 28)])  # the documented run; a step near the end
def test_skipped_step_marker_is_inside_its_panel_and_clear_of_the_legend(
    tmp_path: Path, saved_figures: dict[str, Any], steps: int, step: int
) -> None:
    demo.run(steps=steps, inject_spike=step, adaptive_clip=True, out=tmp_path, progress=False)
    fig = saved_figures["gradstats.png"]
    renderer = _drawn(fig)
    ax = fig.axes[1]
    marker = _labelled(ax, "skipped by SpikeGuard")
    (label,) = ax.texts
    assert list(marker.get_xdata()) == [step] and label.get_text() == f"step {step} skipped"
    legend = ax.get_legend()
    assert legend is not None
    panel, key = ax.get_window_extent(renderer), legend.get_window_extent(renderer)
    for artist in (marker, label):  # the whole cross (its size included) and its label: not clipped, not covered
        box = artist.get_window_extent(renderer)
        assert _inside(box, panel) and not box.overlaps(key), (artist, box, panel, key)
    for name, saved in saved_figures.items():
        _assert_no_legend_covers_data(saved, name)


def _late_nan_label(tmp_path: Path, saved_figures: dict[str, Any], **kwargs: Any) -> str:
    """The label of the first non-finite step (28 of 30: near the right edge) in the saved figure, checked to lie
    inside its panel."""
    demo.run(steps=30, inject_nan=28, out=tmp_path, progress=False, **kwargs)
    fig = saved_figures["gradstats.png"]
    renderer = _drawn(fig)
    (label,) = fig.axes[3].texts
    assert _inside(label.get_window_extent(renderer), fig.axes[3].get_window_extent(renderer))
    assert sorted(saved_figures) == ["exponents.png", "gradstats.png", "layers.png"]
    for name, saved in saved_figures.items():
        _assert_no_legend_covers_data(saved, name)
    return label.get_text()


def test_figure_names_the_module_the_watch_found(tmp_path: Path, saved_figures: dict[str, Any]) -> None:
    text = _late_nan_label(tmp_path, saved_figures, nan_module="hidden")
    numel = sum(p.numel() for p in demo.make_model(0).parameters())  # every gradient is NaN after a forward NaN
    assert text == f"step 28: {numel} NaN, origin hidden (ActivationWatch); step skipped"
    # the first parameter gradient in model order says nothing about the cause: the figure does not name it
    fig = saved_figures["gradstats.png"]
    assert not any("embed" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_gradient_nan_figure_names_the_parameter(tmp_path: Path, saved_figures: dict[str, Any]) -> None:
    numel = dict(demo.make_model(0).named_parameters())["hidden.weight"].numel()
    assert _late_nan_label(tmp_path, saved_figures) == f"step 28: {numel} NaN (first in hidden.weight); step skipped"


# ------------------------------------------------------------------- what docs/training.md quotes of the demo
TRAINING_MD = REPO / "docs" / "training.md"


def _quoted_blocks(first: str) -> list[list[str]]:
    """The fenced blocks of docs/training.md without a language whose first line starts with ``first``."""
    blocks: list[tuple[str, list[str]]] = []  # (info string, lines)
    fence: list[str] | None = None
    for line in TRAINING_MD.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if fence is None:  # an opening fence
                blocks.append((line[3:].strip(), []))
                fence = blocks[-1][1]
            else:
                fence = None
        elif fence is not None:
            fence.append(line)
    return [lines for info, lines in blocks if not info and lines and lines[0].startswith(first)]


def _line_pattern(quoted: str) -> re.Pattern[str]:
    """``…`` stands for one machine-dependent token, runs of spaces for any (a table's columns)."""
    parts = [p for p in re.split(r"(…|\s+)", quoted.strip()) if p]
    body = "".join(r"\S+" if p == "…" else r"\s+" if p.isspace() else re.escape(p) for p in parts)
    return re.compile(r"\s*" + body + r"\s*")


def _unprinted(quoted: list[str], printed: list[str]) -> str | None:
    """The first quoted line the demo did not print in that order (``  ...`` skips lines), or None."""
    at, skip = 0, True
    for line in quoted:
        if line.strip() == "...":
            skip = True
            continue
        pattern = _line_pattern(line)
        ahead = range(at, len(printed)) if skip else range(at, min(at + 1, len(printed)))
        found = next((j for j in ahead if pattern.fullmatch(printed[j])), None)
        if found is None:
            return line
        at, skip = found + 1, False
    return None


def test_training_md_quotes_what_the_demo_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Every demo output the page quotes is printed, token for token, where it does not write ``…`` for a number
    that depends on the machine (run with TORCH_GRADSTATS_FORCE_FALLBACK=1 too: other kernels, same text)."""
    monkeypatch.chdir(tmp_path)  # the default --out, runs/demo, as quoted
    runs = {
        "torch_gradstats demo:": ["--inject-nan", "20"],
        "Trainer warning:": ["--inject-nan", "20", "--nan-module", "hidden", "--steps", "30", "--no-plot"],
        "SpikeGuard skipped": ["--inject-spike", "20", "--adaptive-clip", "--steps", "30", "--no-plot"],
        "Per-example gradient norms": ["--inject-bad-example", "20", "--steps", "30", "--no-plot"],
    }
    text = TRAINING_MD.read_text(encoding="utf-8")
    quoted = {
        "torch_gradstats demo:": _quoted_blocks("torch_gradstats demo:"),
        "Trainer warning:": _quoted_blocks("Trainer warning:"),
        "SpikeGuard skipped": [[span] for span in re.findall(r"`(SpikeGuard skipped [^`]*)`", text)],
        "Per-example gradient norms": _quoted_blocks("Per-example gradient norms"),
    }
    for first, args in runs.items():
        assert quoted[first], f"docs/training.md quotes no output starting {first!r}"
        assert demo.main([*args, "--device", "cpu", "--no-progress"]) == 0
        printed = capsys.readouterr().out.splitlines()
        for block in quoted[first]:
            assert _unprinted(block, printed) is None, (_unprinted(block, printed), printed)
    assert not re.search(r"\b4[67]\d\.\d\b", text)  # no machine's global grad norm quoted as the spike's
