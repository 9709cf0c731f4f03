"""Smoke tests of the benchmark suite (torch_gradstats/bench.py and bench/*.py): tiny sizes, CPU only, fast."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from torch_gradstats import bench
from torch_gradstats.ops import reference_multi_tensor_stats

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_suite_writes_table_csv_markdown_and_plots(tmp_path, capsys):
    rc = bench.main(["--quick", "--device", "cpu", "--workloads", "large_f32,mixed,sweep,count", "--out",
                     str(tmp_path), "--repeats", "1", "--warmup", "1", "--no-progress"])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    for word in ("contender", "GB/s", "% ceiling", "fused faster by", "Targets"):
        assert word in printed

    with (tmp_path / "bench_cpu.csv").open() as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames) == bench.CSV_COLUMNS
        rows = list(reader)
    # Every point has every contender, once.
    points = {(r["workload"], r["point"]) for r in rows}
    assert {w for w, _ in points} == {"large_f32", "mixed", "sweep", "count"}
    for pt in points:
        got = sorted(r["contender"] for r in rows if (r["workload"], r["point"]) == pt)
        assert got == sorted(bench.CONTENDERS)
    for r in rows:
        assert float(r["time_ms"]) > 0 and float(r["gbps"]) > 0 and int(r["reps"]) >= 1
        if r["contender"] == bench.SUM_CEILING:
            assert float(r["pct_ceiling"]) == pytest.approx(100.0)
        if r["contender"] == bench.FUSED:
            assert float(r["vs_fused"]) == pytest.approx(1.0)
    mixed = next(r for r in rows if r["workload"] == "mixed")
    assert mixed["dtype"] == "bfloat16+float32"

    md = (tmp_path / "bench_cpu.md").read_text()
    assert "torch" in md and "date" in md and "## Targets" in md and "| contender |" in md
    if importlib.util.find_spec("matplotlib") is not None:
        for png in ("bandwidth_cpu.png", "host_time_cpu.png"):
            data = (tmp_path / png).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bad_arguments_return_2(capsys):
    assert bench.main(["--workloads", "nope"]) == 2
    assert bench.main(["--contenders", "fused,bogus"]) == 2
    assert bench.main(["--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        assert bench.main(["--device", "cuda"]) == 2
    assert "nope" in capsys.readouterr().err


def test_original_collector_baseline_computes_what_the_collector_computed():
    g = torch.randn(50)
    g[:7] = 0.0
    h = torch.randn(4, 5, dtype=torch.bfloat16)
    h[0, 0] = float("inf")
    total_sq, mn, mx, _n_van, _n_exp, zeros, nans, infs = bench.original_collector([g, torch.randn(3, 3), h])
    assert zeros == 7 and nans == 0 and infs == 1
    assert math.isinf(total_sq) and math.isinf(mx)
    total_sq, mn, mx, *_ = bench.original_collector([g])
    sumsq = reference_multi_tensor_stats([g])[0]
    assert total_sq == pytest.approx(float(sumsq[0]), rel=1e-12)
    assert mn == mx == pytest.approx(math.sqrt(float(sumsq[0])), rel=1e-12)


def test_contenders_do_not_modify_inputs():
    pt = bench.Point("t", "p", [(8, 4), (16,)], [torch.float32, torch.bfloat16])
    (sample,) = bench._make_samples(pt, torch.device("cpu"), llc=0, seed=1)
    before = [t.clone() for t in sample.tensors]
    for fn in bench.CONTENDERS.values():
        fn(sample)
    for a, b in zip(before, sample.tensors):
        assert torch.equal(a, b)
    assert all(bool((t != 0).any()) for t in sample.tensors)  # random normal, never zeros


def test_gpt2_shapes_and_rotation():
    assert sum(math.prod(s) for s in bench.gpt2_shapes(1024)) == 354_823_168  # GPT-2 medium
    pt = bench.Point("t", "p", [(256,)] * 4, [torch.float32] * 4)  # 4 KiB: rotated to cover 2 x the cache
    samples = bench._make_samples(pt, torch.device("cpu"), llc=64 * 1024, seed=0)
    assert len(samples) == 32
    assert samples[0].flat.numel() * 4 == pt.total_bytes


def _row(workload, contender, time_ms, **kw):
    r = bench.Row("cuda", workload, "p", "float32", 1, 10**9, contender, 5, time_ms, time_ms, time_ms,
                  1.0 / time_ms, **kw)  # fmt: skip
    return r


def test_targets_pass_and_fail():
    rows = [_row("large_f32", "fused", 1.0), _row("large_f32", "composite", 2.0),
            _row("large_f32", "foreach_norm", 0.9)]  # fmt: skip
    t = {x.name: x.passed for x in bench.evaluate_targets(rows, "cpu")}
    assert t == {"CPU: fused >= 3x faster than the composite": False, "CPU: fused no slower than _foreach_norm": False}
    rows[1].time_ms, rows[2].time_ms = 3.5, 1.0
    assert all(x.passed for x in bench.evaluate_targets(rows, "cpu"))

    gpu = [_row("large_f32", "fused", 1.0, pct_ceiling=95.0), _row("large_f32", "foreach_norm", 1.4),
           _row("large_f32", "composite", 5.0), _row("large_f32", "orig_collector", 9.0),
           _row("small_many", "fused", 0.01, launches=1), _row("small_many", "foreach_norm", 0.03),
           _row("large_bf16", "fused", 0.5, pct_ceiling=80.0)]  # fmt: skip
    res = {x.name: x.passed for x in bench.evaluate_targets(gpu, "cuda")}
    assert res["GPU large: fused read bandwidth >= 92% of torch.sum"] is True
    assert res["GPU large: >= 10x the orig collector"] is False
    assert res["GPU 10,000 x 1,024: at most two launches"] is True
    assert res["GPU large_bf16: same fraction of the ceiling as float32 (within 5 points)"] is False
    assert res["GPU mixed: same fraction of the ceiling as float32 (within 5 points)"] is None


def test_bench_cpu_script_shapes():
    mod = _load_script("bench_cpu")
    shapes = mod.shapes()
    assert len(shapes) == 64
    assert 120 * 2**20 <= sum(math.prod(s) for s in shapes) * 4 <= 136 * 2**20


def test_bench_training_script_tiny(capsys):
    mod = _load_script("bench_training")
    assert mod.main(["--size", "tiny", "--rounds", "1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    for variant in mod.VARIANTS:
        assert variant in out
    assert "steps/s" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
