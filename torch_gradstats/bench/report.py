"""Results: the Row of one contender on one point, its derived ratios, and the CSV, table, markdown and plots."""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .contenders import FUSED, SUM_CEILING
from .workloads import fmt_bytes

NAN = float("nan")


@dataclasses.dataclass
class Row:
    """One contender on one point. Times are medians per call over ``reps`` interleaved repetitions (ms); NaN: not
    measured. ``gbps`` and ``pct_ceiling`` use device time on CUDA and wall (eager) time on CPU; ``vs_fused`` is
    eager time over the fused op's eager time (how many times faster the fused op is end to end)."""

    device: str
    workload: str
    point: str
    dtype: str
    n_tensors: int
    total_bytes: int
    contender: str
    reps: int
    device_ms: float
    eager_ms: float
    host_ms: float
    gbps: float = NAN
    pct_ceiling: float = NAN
    eager_pct_ceiling: float = NAN
    vs_fused: float = NAN
    launches: int | None = None
    compile_s: float = NAN
    note: str = ""
    #: The per-call times of each repetition (ms), in repetition order: the same index is the same repetition in
    #: every row of the point, so the goals can see how much a ratio moved from one repetition to the next.
    device_reps: list[float] = dataclasses.field(default_factory=list)
    eager_reps: list[float] = dataclasses.field(default_factory=list)
    host_reps: list[float] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, str]:
        """The point this row belongs to."""
        return self.workload, self.point, self.dtype

    @property
    def rate_ms(self) -> float:
        """The time GB/s is computed from: device time on CUDA, wall time on CPU."""
        return self.device_ms if self.device == "cuda" else self.eager_ms


#: Columns of the CSV, in order (the Row's fields).
CSV_COLUMNS = tuple(f.name for f in dataclasses.fields(Row))


def _ok(x: float | None) -> bool:
    return x is not None and not math.isnan(x) and x > 0


def fill_ratios(rows: list[Row]) -> None:
    """GB/s, % of ceiling_sum (device or wall; and eager) and time relative to the fused op, within one point."""
    by_point: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_point.setdefault(r.key, {})[r.contender] = r
    for r in rows:
        r.gbps = r.total_bytes / (r.rate_ms * 1e-3) / 1e9 if _ok(r.rate_ms) else NAN
    for r in rows:
        others = by_point[r.key]
        ceiling, fused = others.get(SUM_CEILING), others.get(FUSED)
        if ceiling is not None and _ok(ceiling.gbps) and _ok(r.gbps):
            r.pct_ceiling = 100.0 * r.gbps / ceiling.gbps
        if ceiling is not None and _ok(ceiling.eager_ms) and _ok(r.eager_ms):
            r.eager_pct_ceiling = 100.0 * ceiling.eager_ms / r.eager_ms
        if fused is not None and _ok(fused.eager_ms) and _ok(r.eager_ms):
            r.vs_fused = r.eager_ms / fused.eager_ms


# ------------------------------------------------------------------------------------------------- CSV
def write_csv(rows: Sequence[Row], path: Path) -> None:
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            d = dataclasses.asdict(r)
            w.writerow(["" if d[c] is None else " ".join(map(repr, d[c])) if isinstance(d[c], list) else d[c]
                        for c in CSV_COLUMNS])  # fmt: skip


def read_csv(path: Path) -> list[Row]:
    """Rows back from :func:`write_csv` (e.g. to re-evaluate the goals of an earlier run)."""
    types = {f.name: f.type for f in dataclasses.fields(Row)}
    rows = []
    with Path(path).open(newline="") as fh:
        for rec in csv.DictReader(fh):
            kw: dict[str, object] = {}
            for name, text in rec.items():
                t = str(types[name])
                if t.startswith("list"):  # repetitions, space-separated
                    kw[name] = [float(x) for x in text.split()]
                elif t == "str":
                    kw[name] = text
                elif t == "int":
                    kw[name] = int(text)
                elif "int" in t:  # int | None
                    kw[name] = int(text) if text else None
                else:
                    kw[name] = float(text) if text else NAN
            rows.append(Row(**kw))  # type: ignore[arg-type]
    return rows


# ------------------------------------------------------------------------------------------------ tables
_CUDA_COLS = [("device ms", "device_ms", ".3f"), ("eager ms", "eager_ms", ".3f"), ("host ms", "host_ms", ".3f"),
              ("GB/s", "gbps", ".1f"), ("% sum", "pct_ceiling", ".1f"), ("% sum eager", "eager_pct_ceiling", ".1f"),
              ("fused faster by", "vs_fused", ".2f"), ("launches", "launches", "d"), ("compile s", "compile_s", ".1f")]
_CPU_COLS = [("time ms", "eager_ms", ".3f"), ("GB/s", "gbps", ".2f"), ("% sum", "pct_ceiling", ".1f"),
             ("fused faster by", "vs_fused", ".2f"), ("compile s", "compile_s", ".1f")]  # fmt: skip
_LEAD = [("workload", 10), ("point", 10), ("dtype", 16), ("tensors", 7), ("bytes", 10), ("contender", 19)]


def _fmt(v: float | None, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def _cells(r: Row, cols: list[tuple[str, str, str]]) -> list[str]:
    lead = [r.workload, r.point, r.dtype, str(r.n_tensors), fmt_bytes(r.total_bytes), r.contender]
    nums = [_fmt(getattr(r, attr), spec) + ("x" if attr == "vs_fused" and _ok(r.vs_fused) else "")
            for _, attr, spec in cols]  # fmt: skip
    return lead + nums + [r.note]


def format_table(rows: Sequence[Row], markdown: bool = False, header: bool = True) -> str:
    """The results table (columns by device: CUDA has device/eager/host times, CPU one wall time)."""
    cols = _CUDA_COLS if any(r.device == "cuda" for r in rows) else _CPU_COLS
    head = [h for h, _ in _LEAD] + [h for h, _, _ in cols] + ["note"]
    lines = [_cells(r, cols) for r in rows]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] if header else []
        return "\n".join(out + ["| " + " | ".join(x.replace("|", "\\|") for x in c) + " |" for c in lines])
    # Fixed widths, so that tables printed point by point line up.
    widths = [w for _, w in _LEAD] + [max(9, len(h)) for h, _, _ in cols] + [0]
    out = []
    if header:
        out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
        out.append("  ".join("-" * max(w, 4) for w in widths[:-1]))
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines]
    return "\n".join(out)


def write_markdown(rows: Sequence[Row], target_lines: Sequence[str], info: dict[str, str], path: Path,
                   plots: Sequence[str]) -> None:  # fmt: skip
    """The run as markdown: machine and commit, the goals' PASS/FAIL lines, the table, the plots."""
    device = rows[0].device if rows else "?"
    lines = [f"# torch_gradstats benchmark: {device}", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items()]
    basis = "device time (a replayed CUDA graph: no host cost)" if device == "cuda" else "wall time"
    lines += ["", f"Per call, medians of interleaved repetitions. GB/s = input bytes / {basis}; `% sum` compares that "
              "rate with `torch.sum` over a flat float32 buffer of the same bytes measured in the same run "
              "(`% sum eager` the same with eager times); `fused faster by` = contender eager time / fused eager "
              "time." + (" Eager = calls in a loop, synchronised at the end; host = enqueue time per call."
                         if device == "cuda" else ""), ""]  # fmt: skip
    lines += ["## Goals", ""] + [f"- {t}" for t in target_lines] + [""]
    lines += ["## Results", "", format_table(rows, markdown=True), ""]
    lines += [f"![{p}]({p})" for p in plots]
    Path(path).write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------- plots
def make_plots(rows: Sequence[Row], out: Path, device: str) -> list[str]:
    """GB/s vs list size (sweep) and time vs tensor count (count); the PNG names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return []
    cuda = device == "cuda"
    specs = [
        ("sweep", "total_bytes", "gbps", f"bandwidth_{device}.png", "total bytes of the list (64 float32 tensors)",
         "GB/s (device time)" if cuda else "GB/s (wall time)", f"Read rate vs list size ({device})"),
        ("count", "n_tensors", "host_ms" if cuda else "eager_ms", f"host_time_{device}.png",
         "number of tensors (1,024 float32 each)", "host (enqueue) time per call, ms" if cuda else "time per call, ms",
         f"Time vs tensor count ({device})"),
    ]  # fmt: skip
    written = []
    for workload, xk, yk, fname, xlabel, ylabel, title in specs:
        sel = [r for r in rows if r.workload == workload and _ok(getattr(r, yk))]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for name in dict.fromkeys(r.contender for r in sel):
            pts = sorted((getattr(r, xk), getattr(r, yk)) for r in sel if r.contender == name)
            style = "--" if name.startswith("ceiling") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=name,
                    lw=2.5 if name == FUSED else 1.3)  # fmt: skip
        ax.set_xscale("log", base=2 if xk == "total_bytes" else 10)
        if yk != "gbps":
            ax.set_yscale("log")
        if xk == "total_bytes":
            ticks = sorted({r.total_bytes for r in sel})
            ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(out) / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    return written
