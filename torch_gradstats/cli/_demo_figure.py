"""The demo's figures: loss, global gradient norm (with the AdaptiveClip threshold and the steps the SpikeGuard
skipped), health, and non-finite counts over the optimizer steps; and the gradient norm of each layer over the steps.
Their own module: drawing is a job apart from running the demo.

Every legend sits outside its axes (no legend covers data), and the marks of an event (a skipped step, the first
non-finite step) stay inside their panel, their labels turned towards its middle."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch_gradstats.training import EpochSummary

__all__ = ["figure", "layer_figure", "save"]

#: Where a legend goes: right of its axes, top-aligned (constrained layout makes room for it).
OUTSIDE: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}


def _label_offset(ax: Any, step: float, dy: float) -> dict[str, Any]:
    """``annotate`` arguments that put a label beside ``step``, on the side towards the panel's middle, so that a
    label for a late step does not run past the right edge."""
    lo, hi = ax.get_xlim()
    right = step <= (lo + hi) / 2
    return {"xytext": (6 if right else -6, dy), "textcoords": "offset points", "ha": "left" if right else "right"}


def figure(
    summaries: Sequence[EpochSummary],
    inject_step: int | None,
    thresholds: Sequence[float] | None = None,
    spike: str | None = None,
    origin: str | None = None,
) -> Any:
    """The demo's matplotlib figure (four panels over the optimizer steps), from the per-step history; with
    ``thresholds`` (one per step) the AdaptiveClip threshold is drawn over the gradient norm where it is finite.
    ``origin``: the module an ActivationWatch found the first non-finite values in, named at the first non-finite
    step instead of the first non-finite parameter gradient (which, after a forward NaN, is just the first in model
    order)."""
    import matplotlib  # lazy: only the demo needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for s in summaries for r in s.history]
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True, constrained_layout=True)
    bad_rows = [r for r in rows if r.nan_count + r.inf_count > 0]
    bad = [r.step for r in bad_rows]

    axes[0].plot(steps, [r.loss for r in rows], color="tab:blue", lw=1.2)
    axes[0].set_ylabel("loss (per sample)")
    # Non-finite norms become NaN: a gap in the line where the gradient went bad.
    axes[1].plot(steps, [r.total_norm if math.isfinite(r.total_norm) else math.nan for r in rows],
                 color="tab:purple", lw=1.2)
    if thresholds is not None:
        axes[1].plot(steps, [t if math.isfinite(t) else math.nan for t in thresholds], color="tab:gray", lw=1.0,
                     ls="-.", marker=".", markersize=4, label="AdaptiveClip threshold")  # fmt: skip
    # A step the SpikeGuard skipped: finite gradients, step not taken.
    guard_rows = [r for r in rows if r.skipped and r.nan_count + r.inf_count == 0]
    axes[1].set_yscale("log")
    if guard_rows:
        axes[1].plot([r.step for r in guard_rows], [r.total_norm for r in guard_rows], "X", color="tab:orange",
                     markersize=9, label="skipped by SpikeGuard")  # fmt: skip
        _headroom(axes[1], max(r.total_norm for r in guard_rows))
        for r in guard_rows:
            axes[1].annotate(f"step {r.step} skipped", xy=(r.step, r.total_norm), color="tab:orange", fontsize=9,
                             va="center", **_label_offset(axes[1], r.step, 0))  # fmt: skip
    if thresholds is not None or guard_rows:
        axes[1].legend(**OUTSIDE)
    axes[1].set_ylabel("global grad norm")
    axes[2].plot(steps, [r.health for r in rows], color="tab:green", lw=1.2)
    axes[2].set_ylim(-0.05, 1.05)
    axes[2].set_ylabel("health")
    axes[3].bar(steps, [r.nan_count for r in rows], color="tab:red", width=1.0, label="NaN")
    axes[3].bar(steps, [r.inf_count for r in rows], bottom=[r.nan_count for r in rows], color="tab:orange",
                width=1.0, label="Inf")
    # A bar one step wide can be thinner than a pixel on a long run: a marker on top keeps each bad step visible.
    axes[3].plot(bad, [r.nan_count + r.inf_count for r in bad_rows], "v", color="tab:red", markersize=7,
                 label="_nolegend_")
    top = max((r.nan_count + r.inf_count for r in bad_rows), default=0)
    axes[3].set_ylim(0, max(1.0, top * 1.15))  # counts: never a negative axis, room above the highest bar
    axes[3].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[3].set_ylabel("non-finite grad elements")
    axes[3].set_xlabel("optimizer step")
    if bad:
        axes[3].legend(**OUTSIDE)
    else:
        axes[3].text(0.5, 0.5, "no NaN or Inf gradient in this run (--inject-nan STEP makes one)",
                     transform=axes[3].transAxes, ha="center", va="center", color="tab:green", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        for b in bad:
            ax.axvline(b, color="tab:red", alpha=0.35, lw=1, ls="--")
        for r in guard_rows:
            ax.axvline(r.step, color="tab:orange", alpha=0.5, lw=1, ls=":")
    for s in summaries[1:]:
        if s.history:
            for ax in axes:
                ax.axvline(s.history[0].step - 0.5, color="gray", alpha=0.25, lw=0.8)
    first = next((s for s in summaries if s.first_nonfinite_step is not None), None)
    row = next((r for r in bad_rows if first is not None and r.step == first.first_nonfinite_step), None)
    if first is not None and row is not None:
        what = " and ".join(f"{n} {kind}" for n, kind in ((row.nan_count, "NaN"), (row.inf_count, "Inf")) if n)
        where = (f", origin {origin} (ActivationWatch)" if origin is not None
                 else f" (first in {first.first_nonfinite_param})")  # fmt: skip
        axes[3].annotate(
            f"step {row.step}: {what}{where}" + ("; step skipped" if row.skipped else ""),
            xy=(row.step, 1.0),
            xycoords=("data", "axes fraction"),
            color="tab:red",
            fontsize=9,
            **_label_offset(axes[3], row.step, -14),
        )
    title = "torch_gradstats demo: gradient telemetry over training"
    if inject_step is not None:
        title += f" (NaN injected at step {inject_step})"
    if spike is not None:
        title += f" ({spike})"
    fig.suptitle(title)
    return fig


def _headroom(ax: Any, top: float) -> None:
    """Raise a log axis' top so that a marker drawn at ``top`` and its label sit inside the panel: a tenth of the
    axis' decades above it."""
    lo, hi = ax.get_ylim()
    if not (math.isfinite(top) and top > 0 and lo > 0):
        return
    decades = math.log10(max(hi, top)) - math.log10(lo)
    ax.set_ylim(lo, max(hi, top * 10 ** (0.1 * decades)))


def layer_figure(norms: Mapping[str, Sequence[float]], bad_steps: Sequence[int] = (), note: str | None = None) -> Any:
    """One line per layer: its gradient norm (``GradStats.grouped("layer")``) at each optimizer step, on a log axis;
    a non-finite norm is a gap in its line, and each step in ``bad_steps`` a dashed red line."""
    import matplotlib  # lazy: only the demo needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.4), constrained_layout=True)
    for name, values in norms.items():
        ax.plot(range(len(values)), [v if math.isfinite(v) and v > 0 else math.nan for v in values], lw=1.0,
                label=name)
    for b in bad_steps:
        ax.axvline(b, color="tab:red", alpha=0.35, lw=1, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient norm (L2) of the layer")
    ax.grid(alpha=0.3)
    ax.legend(title="layer", **OUTSIDE)  # outside: the lines fill the axes
    ax.set_title("Gradient norm per layer" + (f" ({note})" if note else ""))
    return fig


def exponent_figure(histograms: Sequence[Sequence[int]], bad_steps: Sequence[int] = ()) -> Any:
    """The exponent histogram of every step (``grad_stats(..., histogram=True)``) as an image: x the optimizer step,
    y ``floor(log2 |g|)``, the colour the share of the step's finite non-zero gradient elements in that binade; the
    smallest normal numbers of fp16 and fp8 e4m3 are dashed lines (what lies below would underflow there), and each
    step in ``bad_steps`` is marked red."""
    import matplotlib  # lazy: only the demo needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from torch_gradstats.ops.op import HISTOGRAM_MIN_EXPONENT
    from torch_gradstats.stats.exponents import FORMATS

    counts = np.asarray(histograms, dtype=np.float64).reshape(len(histograms), -1)
    used = np.flatnonzero(counts.sum(0))
    lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 1)
    shares = counts[:, lo:hi] / np.maximum(counts.sum(1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(7.5, 3.8), constrained_layout=True)
    extent = (-0.5, len(histograms) - 0.5, HISTOGRAM_MIN_EXPONENT + lo, HISTOGRAM_MIN_EXPONENT + hi)
    image = ax.imshow(np.where(shares > 0, shares, np.nan).T, origin="lower", aspect="auto", extent=extent,
                      cmap="viridis", norm=matplotlib.colors.LogNorm(vmin=1e-5, vmax=1.0))
    fig.colorbar(image, ax=ax, label="share of the step's finite\nnon-zero elements")
    for name, color in (("fp16", "white"), ("fp8_e4m3", "tab:orange")):
        e = FORMATS[name].min_exponent
        if extent[2] <= e <= extent[3]:
            ax.axhline(e, color=color, ls="--", lw=1, label=f"{name} smallest normal (2^{e})")
    for b in bad_steps:
        ax.axvline(b, color="tab:red", alpha=0.6, lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("floor(log2 |gradient|)")
    if ax.get_legend_handles_labels()[0]:  # below the figure: the image fills the axes, the colour bar is right
        fig.legend(loc="outside lower center", ncol=2, fontsize=8, facecolor="0.75")  # grey: the fp16 line is white
    ax.set_title("Gradient values by binary exponent (exponent histogram, same read as the norms)")
    return fig


def save(fig: Any, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` and free it."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
