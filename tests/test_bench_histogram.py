"""Smoke tests of the histogram benchmarks (bench/bench_histogram_cpu.py, bench/bench_wandb_watch.py): each runs in
quick mode and prints what it should; timings are not judged. CPU only, tiny sizes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _table_rows(out: str) -> list[list[str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_histogram_cpu_quick_measures_every_dtype_thread_and_clock():
    mod = _load_script("bench_histogram_cpu")
    threads = torch.get_num_threads()
    results = mod.run([torch.float32, torch.bfloat16], [2, 1], repeats=3, quick=True, device=torch.device("cpu"),
                      dists=["normal"])  # fmt: skip
    assert torch.get_num_threads() == threads  # given back
    assert [(m.dtype, m.threads) for m in results] == [(torch.float32, 2), (torch.float32, 1),
                                                       (torch.bfloat16, 2), (torch.bfloat16, 1)]  # fmt: skip
    for m in results:
        assert m.n_tensors == 28 and m.clocks() == (["wall"] if m.threads == 2 else ["wall", "thread"])
        for clock in ("wall", "thread"):
            assert set(m.times[clock]) == {mod.OP, mod.HIST, mod.SUM}
            assert all(len(v) == 3 and all(x >= 0 for x in v) for v in m.times[clock].values())
    rows = _table_rows(mod.table(results))
    assert rows[0][:5] == ["dtype", "values", "bytes", "threads", "clock"] and len(rows) == 1 + 6  # header, 6 rows
    assert all(re.fullmatch(r"\*\*[0-9.]+x\*\* ± (\d+%|-)", r[8]) for r in rows[1:])
    lines = mod.goals(results)
    assert len(lines) == 12  # 2 goals x (2 + 2 + 1 + 1) dtype/thread/clock rows
    where = r"\[(PASS|FAIL|NOISY)\] gpt2 (float32|bfloat16) normal, [12] threads?, (wall|thread) clock: "
    assert all(re.match(where, ln) for ln in lines)
    assert sum("op+histogram <= 1.25x op" in ln for ln in lines) == 6
    assert all(ln.endswith("/3 repetitions within the goal") for ln in lines)


def test_histogram_cpu_check_leaves_zeros_nan_and_inf_out_of_the_count():
    mod = _load_script("bench_histogram_cpu")
    point = mod.Point("gpt2", "t", [(5, 7), (64,)], [torch.float32] * 2)
    (sample,) = mod.make_samples(point, torch.device("cpu"), llc=0, seed=1, copy_target=False)
    sample.tensors[0][0] = 0.0
    sample.tensors[1][3] = float("nan")
    mod._check(sample)  # zeros and NaNs are outside the histogram, and the check knows it
    sample.tensors[1][4] = float("inf")
    mod._check(sample)


def test_histogram_cpu_main_prints_table_and_goals(capsys):
    mod = _load_script("bench_histogram_cpu")
    assert mod.main(["--quick", "--threads", "1", "--dtypes", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "op+histogram / op" in out and "Goals (ratios measured in this run):" in out
    assert "torch: " in out and "commit measured" in out
    rows = _table_rows(out)
    assert len(rows) == 5 and {r[1] for r in rows[1:]} == {"normal", "heavy"}  # header, wall and thread per dist


def test_wandb_watch_quick_times_three_logging_steps(capsys):
    pytest.importorskip("wandb")
    pytest.importorskip("transformers")
    mod = _load_script("bench_wandb_watch")
    assert mod.main(["--quick", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "wandb: " in out and "GPT2LMHeadModel, 28 parameter tensors" in out
    rows = _table_rows(out)
    assert rows[0] == ["threads", "clock", "wandb_watch ms", "grad_stats ms", "grad_stats_sink ms",
                       "wandb_watch / grad_stats", "wandb_watch / grad_stats_sink"]  # fmt: skip
    assert [r[:2] for r in rows[1:]] == [["1", "wall"], ["1", "thread"]]
    for r in rows[1:]:
        assert all(re.fullmatch(r"[0-9.]+ ± (\d+%|-)", c) for c in r[2:5])
        assert all(re.fullmatch(r"\*\*[0-9.]+x\*\* ± (\d+%|-)", c) for c in r[5:7])


def test_histogram_cuda_script_runs_on_the_cpu_in_quick_mode():
    """bench/bench_histogram_cuda.py is what a GPU run times (bench/gpu_check.sh); here its CPU mode checks that it
    runs and prints a ratio for every list."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_histogram_cuda.py"), "--device", "cpu",
                           "--quick"], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "histogram overload kernel:" in proc.stdout
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("summary: histogram / plain:")]
    assert len(summary) == 1
    ratios = re.findall(r"(\d+\.\d+)", summary[0])
    assert len(ratios) == 4 and all(float(r) > 0 for r in ratios)
