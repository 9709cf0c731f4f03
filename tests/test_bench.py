"""Tests of the benchmark (torch_gradstats.bench and bench/*.py): what is timed is right, the goals are evaluated
right, the files round-trip, and a quick CPU run works end to end. CPU only, small sizes."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_gradstats import HAS_EXTENSION, bench
from torch_gradstats.bench.contenders import COMPILED, check_contender
from torch_gradstats.bench.main import COUNT_CONTENDERS
from torch_gradstats.cli.main import main as cli_main
from torch_gradstats.ops.op import reference_multi_tensor_stats

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _special_sample() -> bench.Sample:
    """Mixed dtypes, odd lengths, a non-contiguous view, and zeros, NaN and Inf in known places."""
    pt = bench.Point("t", "p", [(33, 7), (129,), (5, 3), (17,)], [torch.float32, torch.bfloat16, torch.float16,
                                                                  torch.float64])  # fmt: skip
    (sample,) = bench.make_samples(pt, torch.device("cpu"), llc=0, seed=3)
    t = sample.tensors
    t[0][:4] = 0.0
    t[0] = t[0].t()  # non-contiguous
    t[1][7] = float("inf")
    t[2][1, 1] = float("nan")
    t[3][-3:] = 0.0
    sample.params = bench.workloads.as_params(t)
    return sample


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == COMPILED else n for n in bench.CONTENDERS]
)
def test_every_contender_agrees_with_the_reference(name):
    contender = bench.CONTENDERS[name]
    sample = _special_sample()
    if name == "orig_collector":  # it flattens with view(-1): contiguous gradients only, as autograd makes them
        sample.tensors[0] = sample.tensors[0].contiguous()
    check_contender(contender, sample, contender(sample))
    plain = bench.make_samples(bench.Point("t", "p", [(300,), (4, 25)], [torch.float32] * 2),
                               torch.device("cpu"), llc=0, seed=1)[0]  # fmt: skip
    check_contender(contender, plain, contender(plain))


def test_lightning_grad_norm_reimplementation_matches_the_reference_and_lightning():
    from torch_gradstats.bench.contenders import grad_norm_reimplementation

    sample = _special_sample()
    ours = grad_norm_reimplementation(sample.module, 2)
    label = dataclasses.replace(bench.CONTENDERS["lightning_grad_norm"], fn=lambda s: None)
    check_contender(label, sample, ours)
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        pytest.skip("lightning is not installed")
    theirs = grad_norm(sample.module, 2)
    assert list(theirs) == list(ours)
    for a, b in zip(theirs.values(), ours.values()):
        assert torch.equal(a, b) or (a.isnan() and b.isnan())


def test_the_check_fails_on_a_wrong_answer():
    sample = _special_sample()
    fused = bench.CONTENDERS["fused"]
    sumsq, amax, counts = fused(sample)
    check_contender(fused, sample, (sumsq, amax, counts))
    wrong_counts = counts.clone()
    wrong_counts[0, 0] += 1
    with pytest.raises(AssertionError, match="counts"):
        check_contender(fused, sample, (sumsq, amax, wrong_counts))
    with pytest.raises(AssertionError, match="sumsq"):
        check_contender(fused, sample, (sumsq * 1.0001, amax, counts))  # float32 and float64 tensors are exact
    norms = torch._foreach_norm(sample.tensors)
    with pytest.raises(AssertionError, match="sumsq"):
        check_contender(bench.CONTENDERS["foreach_norm"], sample, [n * 1.05 for n in norms])
    with pytest.raises(AssertionError, match="amax"):
        check_contender(fused, sample, (sumsq, amax.nextafter(torch.tensor(math.inf, dtype=amax.dtype)), counts))


def test_contenders_do_not_modify_inputs():
    pt = bench.Point("t", "p", [(8, 4), (16,)], [torch.float32, torch.bfloat16])
    (sample,) = bench.make_samples(pt, torch.device("cpu"), llc=0, seed=1)
    before = [t.clone() for t in sample.tensors]
    for name, fn in bench.CONTENDERS.items():
        if name != COMPILED:  # compiling takes tens of seconds; it runs the same ops as the composite
            fn(sample)
    for a, b in zip(before, sample.tensors):
        assert torch.equal(a, b)
    assert all(bool((t != 0).all()) for t in sample.tensors)  # random normal, never zeros


def test_original_collector_baseline_computes_what_the_collector_computed():
    g = torch.randn(50)
    g[:7] = 0.0
    h = torch.randn(4, 5, dtype=torch.bfloat16)
    h[0, 0] = float("inf")
    total_sq, mn, mx, _, _, zeros, nans, infs = bench.original_collector([g, torch.randn(3, 3), h])
    assert zeros == 7 and nans == 0 and infs == 1
    assert math.isinf(total_sq) and math.isinf(mx)
    total_sq, mn, mx, *_ = bench.original_collector([g])
    sumsq = reference_multi_tensor_stats([g])[0]
    assert total_sq == pytest.approx(float(sumsq[0]), rel=1e-12)
    assert mn == mx == pytest.approx(math.sqrt(float(sumsq[0])), rel=1e-12)


def test_workloads_shapes_and_rotation():
    assert sum(math.prod(s) for s in bench.gpt2_shapes(1024)) == 354_823_168  # GPT-2 medium
    assert len(bench.gpt2_shapes(1024)) == 292
    pt = bench.Point("t", "p", [(256,)] * 4, [torch.float32] * 4)  # 4 KiB: rotated to cover 2 x the cache
    samples = bench.make_samples(pt, torch.device("cpu"), llc=64 * 1024, seed=0)
    assert len(samples) == 32
    assert samples[0].flat.numel() * 4 == pt.total_bytes
    cuda_sizes = bench.sizes_for(torch.device("cuda"), quick=False)
    points = bench.build_points(bench.WORKLOADS, list(bench.DTYPES), cuda_sizes)
    first = points[0]
    assert (first.workload, first.dtype_label, len(first.shapes)) == ("gpt2", "float32", 292)
    big4 = [p for p in points if p.workload == "big4"]
    assert {p.dtype_label for p in big4} == {"float32", "bfloat16", "float16", "float64", "bfloat16+float32"}
    assert all(p.shapes == [(256 << 20,)] * 4 and p.label == "4x256M" for p in big4)
    assert points[-1].workload == "sweep" and points[-1].total_bytes == 4 << 30


def test_no_timed_call_reads_the_copy_the_call_before_it_read():
    """Each block goes on with the input copies after the previous block's, whichever contender ran it: a contender
    never starts on data the one before it has just left in the cache (on the CPU, two copies at least)."""
    reads: list[int] = []
    record = bench.Contender("a", lambda s: reads.append(id(s)), lambda s, o: {})
    contenders = {name: dataclasses.replace(record, name=name) for name in ("a", "b", "c")}
    big = bench.Point("t", "p", [(1 << 16,)], [torch.float32])  # 256 KiB > a 64 KiB "cache": two copies
    assert len(bench.make_samples(big, torch.device("cpu"), llc=64 * 1024, seed=0)) == 2
    bench.run_point(big, contenders, torch.device("cpu"), repeats=4, min_seconds=0.0, block_s=1e-9)
    timed = reads[3:]  # after one warm-up call each
    assert len(timed) >= 12
    assert all(x != y for x, y in itertools.pairwise(timed)), timed


def _row(workload, contender, dtype="float32", n=292, device="cuda", device_ms=NAN, eager_ms=1.0, host_ms=NAN,
         point="p"):  # fmt: skip
    return bench.Row(device, workload, point, dtype, n, 10**9, contender, 5, device_ms, eager_ms, host_ms)


def _gpu_rows(fused_dev: float = 0.50, fused_eager: float = 0.53, many_dev: float = 0.015, raw_slope_ns: float = 50):
    rows = []
    for dt in ("float32", "bfloat16"):
        rows += [_row("gpt2", "fused", dt, device_ms=fused_dev, eager_ms=fused_eager, host_ms=0.054),
                 _row("gpt2", "fused_raw_op", dt, device_ms=fused_dev, eager_ms=fused_eager, host_ms=0.050),
                 _row("gpt2", "grad_stats", dt, eager_ms=fused_eager, host_ms=0.060),
                 _row("gpt2", "ceiling_sum", dt, device_ms=0.49, eager_ms=0.5)]  # fmt: skip
    rows += [_row("small_many", "fused", n=10_000, device_ms=many_dev, eager_ms=0.9, point="10000x1024"),
             _row("small_many", "ceiling_sum", n=10_000, device_ms=0.014, eager_ms=0.02, point="10000x1024")]
    for n in (1, 64, 2048, 10_000):  # host = 10 us + slope * n
        rows.append(_row("count", "fused_raw_op", n=n, host_ms=0.010 + raw_slope_ns * 1e-6 * n, point=f"{n}x1024"))
    bench.fill_ratios(rows)
    return rows


def _by_name(targets):
    return {t.name: t for t in targets}


def test_gpu_goals_pass_fail_and_not_measured():
    good = _by_name(bench.evaluate_targets(_gpu_rows(), "cuda"))
    assert good["GPU gpt2 float32: fused device-time bandwidth >= 0.95x torch.sum"].passed is True
    assert good["GPU gpt2 bfloat16: fused eager >= 0.9x torch.sum"].passed is True
    assert good["GPU gpt2 float16: fused eager >= 0.9x torch.sum"].passed is None  # not run
    assert good["GPU big4 float64: fused device-time bandwidth >= 0.95x torch.sum"].passed is None
    assert good["GPU 10,000 x 1,024 float32: fused device time <= 20 us"].passed is True
    assert good["GPU 10,000 x 1,024 float32: fused eager <= 1 ms"].passed is True
    per = good["GPU host: raw op <= 60 ns per tensor"]
    assert per.passed is True and "50 ns" in per.detail
    fixed = good["GPU host: raw op fixed cost < 15 us"]
    assert fixed.passed is True and "10 us" in fixed.detail
    wrap = [t for t in good.values() if "adds <= 10% over the raw op" in t.name]
    assert [t.passed for t in wrap] == [True, False]  # fused 1.08x, grad_stats 1.2x of the raw op's host time
    assert all(t.line().startswith(("[PASS]", "[FAIL]", "[N/A ]")) for t in good.values())

    bad = _by_name(bench.evaluate_targets(_gpu_rows(fused_dev=0.60, fused_eager=0.7, many_dev=0.05,
                                                    raw_slope_ns=90), "cuda"))  # fmt: skip
    assert bad["GPU gpt2 float32: fused device-time bandwidth >= 0.95x torch.sum"].passed is False
    assert bad["GPU gpt2 float32: fused eager >= 0.9x torch.sum"].passed is False
    assert bad["GPU 10,000 x 1,024 float32: fused device time <= 20 us"].passed is False
    assert bad["GPU host: raw op <= 60 ns per tensor"].passed is False


def test_cpu_goals_pass_and_fail():
    def rows(fused_ms, foreach_ms, dtype="float32"):
        r = [_row("gpt2", "fused", dtype, device="cpu", eager_ms=fused_ms),
             _row("gpt2", "fused_raw_op", dtype, device="cpu", eager_ms=fused_ms / 1.05),
             _row("gpt2", "grad_stats", dtype, device="cpu", eager_ms=fused_ms * 1.04),
             _row("gpt2", "foreach_norm", dtype, device="cpu", eager_ms=foreach_ms),
             _row("gpt2", "ceiling_sum", dtype, device="cpu", eager_ms=1.0)]  # fmt: skip
        bench.fill_ratios(r)
        return r

    ok = _by_name(bench.evaluate_targets(rows(1.05, 1.5) + rows(1.2, 1.6, "bfloat16"), "cpu", threads=2))
    assert ok["CPU (2 threads; goals set for 2 cores) gpt2 float32: fused >= 0.9x torch.sum of the same bytes"].passed
    assert ok["CPU (2 threads; goals set for 2 cores) gpt2 bfloat16: fused >= 0.8x torch.sum of the same bytes"].passed
    every = ok["CPU (2 threads; goals set for 2 cores): fused >= 1.3x _foreach_norm at every point"]
    assert every.passed is True and "2 points" in every.detail
    assert all(t.passed for t in ok.values() if "adds <=" in t.name)

    bad = _by_name(bench.evaluate_targets(rows(1.2, 1.5) + rows(1.3, 1.6, "bfloat16"), "cpu"))
    assert bad["CPU gpt2 float32: fused >= 0.9x torch.sum of the same bytes"].passed is False  # 0.83x
    assert bad["CPU gpt2 bfloat16: fused >= 0.8x torch.sum of the same bytes"].passed is False  # 0.77x
    every = bad["CPU: fused >= 1.3x _foreach_norm at every point"]
    assert every.passed is False and "gpt2/p/bfloat16" in every.detail  # 1.23x there


def test_spread_of_repetitions():
    assert bench.spread([1.0, 1.0, 1.0]) == 0.0
    assert bench.spread([0.9, 1.2, 1.0]) == pytest.approx(0.3)
    assert bench.spread([1.0]) is None and bench.spread([]) is None
    # ten or more: the highest and lowest tenth are left out (one stalled block does not decide)
    assert bench.spread([1.0] * 9 + [10.0]) == 0.0
    assert bench.spread([0.1] + [1.0, 1.1] * 9 + [10.0]) == pytest.approx(0.1 / 1.05)


def _reps_rows(fused_reps, ceiling_reps, foreach_reps, dtype="float32", point="p"):
    """CPU rows of one point with the given per-repetition times (ms): the medians are the reps' medians."""
    def row(contender, reps):
        r = _row("gpt2", contender, dtype, device="cpu", eager_ms=sorted(reps)[len(reps) // 2], point=point)
        r.eager_reps = list(reps)
        return r

    rows = [row("fused", fused_reps), row("fused_raw_op", [x / 1.02 for x in fused_reps]),
            row("grad_stats", [x * 1.03 for x in fused_reps]), row("foreach_norm", foreach_reps),
            row("ceiling_sum", ceiling_reps)]  # fmt: skip
    bench.fill_ratios(rows)
    return rows


def test_goals_too_noisy_to_judge_say_so():
    name = "CPU gpt2 float32: fused >= 0.9x torch.sum of the same bytes"
    every = "CPU: fused >= 1.3x _foreach_norm at every point"
    flat = [1.0] * 5
    # 0.95x of torch.sum, 5.3% above the goal; the repetitions agree within 2%: judged
    quiet = _by_name(bench.evaluate_targets(_reps_rows([1.04, 1.05, 1.06, 1.05, 1.05], flat, [2.0] * 5), "cpu"))
    assert quiet[name].passed is True and not quiet[name].noisy and quiet[name].line().startswith("[PASS]")
    assert quiet[every].passed is True
    # the same medians from repetitions that spread by ~60%: a PASS here would be drawn from noise
    noisy = _by_name(bench.evaluate_targets(_reps_rows([0.8, 1.05, 1.4, 1.0, 1.1], flat, [2.0] * 5), "cpu"))
    t = noisy[name]
    assert t.passed is None and t.noisy
    assert t.line().startswith(f"[NOISY] {name}: 0.952x (need >= 0.9x); noisy, not judged (repeat spread ")
    assert "vs margin 5.8%" in t.line()
    # a clear miss (0.67x, 26% below) with 7% spread is still a FAIL
    bad = _by_name(bench.evaluate_targets(_reps_rows([1.45, 1.5, 1.55], [1.0] * 3, [2.0] * 3), "cpu"))
    assert bad[name].passed is False and not bad[name].noisy
    # rows without repetitions (a CSV of an older run) are judged as before
    old = _reps_rows([1.04, 1.05, 1.06, 1.05, 1.05], flat, [2.0] * 5)
    for r in old:
        r.eager_reps = []
    assert _by_name(bench.evaluate_targets(old, "cpu"))[name].passed is True


def test_every_point_goal_fails_on_a_clear_miss_and_is_not_judged_on_noise():
    every = "CPU: fused >= 1.3x _foreach_norm at every point"
    clear = _reps_rows([1.0] * 5, [1.0] * 5, [2.0] * 5, point="a")
    noisy = _reps_rows([1.0] * 5, [1.0] * 5, [0.9, 1.4, 2.2, 1.2, 1.3], point="b")  # 1.3x median, wild spread
    missed = _reps_rows([1.0] * 5, [1.0] * 5, [1.1, 1.1, 1.12, 1.1, 1.1], point="c")  # 1.1x, steady
    t = _by_name(bench.evaluate_targets(clear + noisy, "cpu"))[every]
    assert t.passed is None and t.noisy and "noisy, not judged" in t.detail and "gpt2/b/float32" in t.detail
    t = _by_name(bench.evaluate_targets(clear + noisy + missed, "cpu"))[every]
    assert t.passed is False and not t.noisy and "below 1.3x at 1: gpt2/c/float32" in t.detail


def test_gpu_noisy_device_time_and_wrappers():
    rows = _gpu_rows()
    fused = next(r for r in rows if r.contender == "fused" and r.workload == "small_many")
    fused.device_reps = [0.012, 0.015, 0.019, 0.015, 0.014]  # 15 us median, 20 us goal: spread 47% > margin 25%
    raw, wrap = (next(r for r in rows if r.contender == c and r.dtype == "float32") for c in ("fused_raw_op", "fused"))
    raw.host_reps, wrap.host_reps = [0.050] * 3, [0.050, 0.054, 0.060]  # 1.08x of the raw op, 2% margin, 20% spread
    got = _by_name(bench.evaluate_targets(rows, "cuda"))
    t = got["GPU 10,000 x 1,024 float32: fused device time <= 20 us"]
    assert t.noisy and t.passed is None and "15 us (need <= 20 us); noisy, not judged" in t.detail
    t = got["GPU: fused adds <= 10% over the raw op (292 tensors, host time)"]
    assert t.noisy and t.line().startswith("[NOISY]")
    assert got["GPU gpt2 float32: fused device-time bandwidth >= 0.95x torch.sum"].passed is True  # no reps: judged


def test_fit_line():
    slope, icpt = bench.fit_line([1, 10, 100], [3 + 2 * x for x in (1, 10, 100)])
    assert slope == pytest.approx(2.0) and icpt == pytest.approx(3.0)


def test_csv_and_markdown_round_trip(tmp_path):
    rows = _gpu_rows()
    rows[0].launches, rows[0].compile_s, rows[1].note = 2, 12.5, "skipped: out of memory, sorry"
    rows[0].eager_reps, rows[0].device_reps = [0.5, 0.1 + 0.2, 1e-7], [0.25]
    bench.write_csv(rows, tmp_path / "b.csv")
    back = bench.read_csv(tmp_path / "b.csv")
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        for f in dataclasses.fields(bench.Row):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), f.name

    targets = [t.line() for t in bench.evaluate_targets(rows, "cuda")]
    bench.write_markdown(rows, targets, {"commit measured": "abc123"}, tmp_path / "b.md", ["bandwidth_cuda.png"])
    md = (tmp_path / "b.md").read_text()
    assert "- **commit measured**: abc123" in md and "## Goals" in md and "![bandwidth_cuda.png]" in md
    assert all(f"- {t}" in md for t in targets)
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[1:]]
    assert len(cells) == len(rows) and all(len(c) == len(head) for c in cells)
    for r, c in zip(rows, cells):
        rec = dict(zip(head, c))
        assert (rec["workload"], rec["contender"], rec["dtype"]) == (r.workload, r.contender, r.dtype)
        for col, attr in (("device ms", "device_ms"), ("eager ms", "eager_ms"), ("host ms", "host_ms")):
            v = getattr(r, attr)
            assert rec[col] == ("-" if math.isnan(v) else f"{v:.3f}")
        assert rec["note"] == r.note


def test_main_in_process_leaves_threads_and_gc_as_found(capsys):
    """bench.main sets torch's thread count and freezes the garbage collector while it runs; called from Python (a
    test, a notebook) it must give both back."""
    threads = torch.get_num_threads()
    other = 1 if threads != 1 else 2
    assert bench.main(["--quick", "--device", "cpu", "--threads", str(other), "--workloads", "count",
                       "--contenders", "fused,ceiling_sum", "--no-progress"]) == 0  # fmt: skip
    assert "Goals" in capsys.readouterr().out
    assert torch.get_num_threads() == threads
    assert gc.get_freeze_count() == 0


def test_quick_cpu_run_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch_gradstats", "bench", "--quick", "--device", "cpu", "--threads", "1",
           "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    took = float(re.search(r"bench: \d+ rows in ([0-9.]+) s", out).group(1))
    assert took < 10.0, f"the quick run itself took {took} s"  # ~1 s on a quiet 2-core machine
    for word in ("time ms", "GB/s", "% sum", "fused faster by", "Goals (ratios measured in this run)"):
        assert word in out
    assert re.search(r"\[(PASS|FAIL|NOISY)\] CPU", out)  # NOISY: the machine was too busy to judge that goal
    expected = {"bench_cpu.csv", "bench_cpu.md"}
    if importlib.util.find_spec("matplotlib") is not None:
        expected |= {"bandwidth_cpu.png", "host_time_cpu.png"}
    assert {p.name for p in tmp_path.iterdir()} == expected
    rows = bench.read_csv(tmp_path / "bench_cpu.csv")
    points = {r.key for r in rows}
    assert {w for w, _, _ in points} == set(bench.WORKLOADS)
    for key in points:  # every point has every contender once (compiled_composite as a skipped row: no budget)
        got = [r.contender for r in rows if r.key == key]
        want = [n for n in bench.CONTENDERS if key[0] != "count" or n in COUNT_CONTENDERS]
        assert got == want
    for r in rows:
        if r.contender == COMPILED:
            assert r.note.startswith("skipped") and math.isnan(r.eager_ms)
            continue
        assert r.eager_ms > 0 and r.gbps > 0 and r.reps >= 3 and math.isnan(r.device_ms)
        assert len(r.eager_reps) == r.reps and r.device_reps == r.host_reps == []  # each repetition, kept
        if r.contender == bench.SUM_CEILING:
            assert r.pct_ceiling == pytest.approx(100.0)
        if r.contender == bench.FUSED:
            assert r.vs_fused == pytest.approx(1.0)
    md = (tmp_path / "bench_cpu.md").read_text()
    assert "commit measured" in md and "## Goals" in md and "| contender |" in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["--threads", "-3"], "argument --threads: expected a positive integer, got -3"),
        (["--threads", "two"], "argument --threads: expected a positive integer, got 'two'"),
        (["--repeats", "0"], "argument --repeats: expected a positive integer, got 0"),
        (["--budget-s", "-1"], "argument --budget-s: expected a number of seconds >= 0"),
        (["--compile-budget-s", "nan"], "argument --compile-budget-s: expected a number of seconds >= 0"),
        (["--workloads", "nope"], "argument --workloads: unknown ['nope']"),
        (["--contenders", "fused,bogus"], "argument --contenders: unknown ['bogus']"),
        (["--dtypes", "int8"], "argument --dtypes: unknown ['int8']"),
    ],
)
def test_bad_options_are_one_line_errors_with_status_2(capsys, args, message):
    assert cli_main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_device_is_status_2(capsys):
    assert bench.main(["--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        assert bench.main(["--device", "cuda"]) == 2
    assert "--device" in capsys.readouterr().err


def test_bench_cpu_script_shapes():
    mod = _load_script("bench_cpu")
    shapes = mod.shapes()
    assert len(shapes) == 64
    assert 120 * 2**20 <= sum(math.prod(s) for s in shapes) * 4 <= 136 * 2**20


def test_bench_training_script_tiny(capsys):
    mod = _load_script("bench_training")
    assert mod.main(["--model", "tiny", "--rounds", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for variant in mod.VARIANTS:
        assert variant in out
    assert "ms/step" in out and "goal" in out


def test_gpt2_small_model_has_the_advertised_size():
    mod = _load_script("bench_training")
    with torch.device("meta"):
        model = mod.build_model("gpt2-small")
    params = list(model.parameters())
    assert len(params) == 149
    assert 162_000_000 <= sum(p.numel() for p in params) <= 163_500_000


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_bench_host_costs_runs_and_names_every_contender() -> None:
    """bench/bench_host_costs.py (the host costs docs/design.md and the docstrings quote), one round: every
    contender of its three groups gets a positive time, and the header names the machine and the commit."""
    if not HAS_EXTENSION:
        pytest.skip("the script measures the compiled entry point")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_host_costs.py"), "--rounds", "1"],
                         capture_output=True, text=True, timeout=300, check=True)
    header, *rest = run.stdout.splitlines()
    assert "commit measured:" in header and "logical cores" in header, header
    names = ["_C.direct_stats", "multi_tensor_stats", "torch.ops (raw op)", "torch._foreach_norm", "torch.sum",
             "torch.tensor(list)", "host_int64 (array, frombuffer)", "detach() of each tensor",
             "multi_tensor_stats(list)"]
    times = {}
    for line in rest:
        m = re.match(r"\s+(.+?)\s+([0-9.]+)\s+\(([0-9.]+)\)$", line)
        if m:
            times[m.group(1)] = float(m.group(2))
    assert sorted(times) == sorted(names), times
    assert all(t > 0 for t in times.values()), times

