"""Tests of ``python -m torch_gradstats info | demo | bench`` (in-process, plus one real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import torch_gradstats
from torch_gradstats.cli.demo import make_model
from torch_gradstats.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def _strict_json(line: str) -> dict:
    def no_constants(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=no_constants)


def _read_log(path: Path) -> list[dict]:
    return [_strict_json(line) for line in path.read_text().splitlines()]


def test_info_reports_honestly(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch            {torch.__version__}" in out
    assert "matches the float64 reference: yes" in out
    cpu_line = next(line for line in out.splitlines() if line.strip().startswith("CPU "))
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CPU")
    assert ("no compiled kernel" not in cpu_line) == has_cpu_kernel
    isa_line = next(line for line in out.splitlines() if line.startswith("instruction set"))
    if torch_gradstats.HAS_EXTENSION:  # the compiled CPU kernel names the instruction set it chose at run time
        assert isa_line.split()[2] in {"DEFAULT", "AVX2", "AVX512"}
    else:
        assert "n/a" in isa_line
    # The pure-PyTorch kernel is registered as CompositeExplicitAutograd: it must not be reported as a CPU kernel.
    if not torch_gradstats.HAS_EXTENSION:
        assert "no compiled kernel" in cpu_line
        assert "NOT loaded" in out
    else:
        assert "extension        loaded" in out
    assert "pure-PyTorch fallback registered" in out
    forced = "TORCH_GRADSTATS_FORCE_FALLBACK" in os.environ
    assert ("TORCH_GRADSTATS_FORCE_FALLBACK not set" in out) == (not forced)


def test_demo_names_the_nan_step_and_parameter(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    rc = main(["demo", "--steps", "40", "--inject-nan", "27", "--out", str(out_dir), "--no-progress", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "first seen at optimizer step 27 (epoch 1) in parameter 'hidden.weight'" in out
    assert "Skipped 1 optimizer step(s); parameters all finite: True" in out
    assert "step 27: hidden.weight" in out  # the per-epoch table names it too

    records = _read_log(out_dir / "log.jsonl")
    run = records[0]
    steps = [r for r in records if r["type"] == "step"]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert run["type"] == "run" and run["inject_nan"] == 27 and run["inject_param"] == "hidden.weight"
    assert [r["step"] for r in steps] == list(range(40))
    assert [e["steps"] for e in epochs] == [25, 15]
    bad = [r for r in steps if r["nan_count"] or r["inf_count"] or r["skipped"]]
    numel = dict(make_model(0).named_parameters())["hidden.weight"].numel()
    assert len(bad) == 1 and bad[0]["step"] == 27 and bad[0]["skipped"] is True
    assert bad[0]["nan_count"] == numel and bad[0]["total_norm"] is None and bad[0]["health"] == 0.0
    assert epochs[1]["first_nonfinite_step"] == 27 and epochs[1]["skipped_steps"] == 1
    assert epochs[0]["first_nonfinite_step"] is None
    assert all(r["total_norm"] > 0 for r in steps if r["step"] != 27)

    png = (out_dir / "gradstats.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_demo_without_injection_and_without_plot(tmp_path, capsys):
    rc = main(["demo", "--steps", "10", "--inject-param", "head.bias", "--out", str(tmp_path), "--no-progress",
               "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Non-finite" not in out and "Skipped 0 optimizer step(s)" in out
    assert not (tmp_path / "gradstats.png").exists()
    steps = [r for r in _read_log(tmp_path / "log.jsonl") if r["type"] == "step"]
    assert len(steps) == 10 and not any(r["skipped"] for r in steps)


def test_demo_without_matplotlib_still_writes_the_log(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--steps", "3", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert (tmp_path / "log.jsonl").exists() and not (tmp_path / "gradstats.png").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "5", "--inject-nan", "5"], "outside the run's optimizer steps 0..4"),
        (["--inject-param", "nope"], "'nope' is not a parameter of the demo model"),
        (["--device", "cuda:7"], "cuda:7"),
    ],
)
def test_demo_bad_arguments(tmp_path, capsys, args, message):
    if args[0] == "--device" and torch.cuda.device_count() > 7:  # pragma: no cover
        pytest.skip("this machine has a cuda:7")
    assert main(["demo", "--out", str(tmp_path), "--no-progress", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "demo: error:" in captured.err
    assert "error" not in captured.out


@pytest.mark.parametrize("out", ["/proc/forbidden", "{file}/sub"], ids=["proc", "under-a-file"])
def test_demo_unwritable_out_is_one_line_on_stderr(tmp_path, capsys, out):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    out = out.format(file=a_file)
    assert main(["demo", "--steps", "2", "--out", out, "--no-progress", "--no-plot"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("demo: error: cannot write the outputs to") and out in err[0]
    assert "Traceback" not in captured.err + captured.out


def test_bench_bad_threads_is_one_line_on_stderr(capsys):
    assert main(["bench", "--threads", "-3", "--quick", "--no-progress", "--workloads", "large_f32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bench: error:" in err[0] and "positive" in err[0]


def test_info_checks_the_cpp_error_path():
    from torch_gradstats.cli.main import check_cpp_errors, info_report

    text, ok = info_report()
    assert ok
    line = next(x for x in text.splitlines() if x.startswith("C++ error path"))
    if torch_gradstats.HAS_EXTENSION:
        assert "ok (a bad input raises TypeError)" in line
        ok, msg = check_cpp_errors()  # the real child: an integer tensor through the compiled kernel
        assert ok, msg
    else:
        assert "not checked" in line


def test_info_reports_a_child_killed_by_a_signal():
    """The crash branch, with a child that really dies by SIGSEGV (a stand-in for an extension whose C++
    exceptions crash), passed through the check's command parameter."""
    from torch_gradstats.cli.main import check_cpp_errors, info_report

    dies = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    ok, msg = check_cpp_errors(dies)
    assert not ok
    assert "CRASHED" in msg and "SIGSEGV" in msg and "CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install" in msg
    no_error = [sys.executable, "-c", "print('no exception')"]
    ok, msg = check_cpp_errors(no_error)
    assert not ok and "did not raise TypeError" in msg
    if torch_gradstats.HAS_EXTENSION:
        text, ok = info_report(cpp_check_command=dies)
        assert not ok and "CRASHED" in text


def test_bench_forwards_its_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("torch_gradstats.bench")
    fake.main = lambda argv=None: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "torch_gradstats.bench", fake)
    assert main(["bench", "--quick", "--device", "cpu", "--help"]) == 7
    assert seen == [["--quick", "--device", "cpu", "--help"]]


def test_bench_missing_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_gradstats.bench", None)  # import raises ImportError
    assert main(["bench"]) == 2
    assert "torch_gradstats.bench is not available" in capsys.readouterr().err


def test_help_and_bad_command(capsys):
    assert main(["--help"]) == 0
    assert "{info,demo,bench}" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert main([]) == 2


def test_module_entry_point_runs_in_a_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_gradstats", "demo", "--steps", "25", "--inject-nan", "20",
         "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "optimizer step 20 (epoch 0) in parameter 'hidden.weight'" in proc.stdout
    assert (tmp_path / "gradstats.png").exists() and (tmp_path / "log.jsonl").exists()


def test_demo_into_a_closed_pipe_stops_quietly(tmp_path):
    # `python -m torch_gradstats demo | head -1`: the reader leaves after one line; the demo stops without a
    # traceback or an error about --out (a broken pipe once read as an unwritable output directory).
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_gradstats", "demo", "--steps", "200", "--no-plot", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert first.startswith(b"torch_gradstats demo:")
    assert err == "", err


# ------------------------------------------------------------------------- errors: status 2, one line, no traceback
def _run_cli(args: list[str], cwd: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """``python -m torch_gradstats ARGS`` in a child process (``prelude``: Python run first in the child)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"{prelude}\nimport runpy, sys\nsys.argv = ['torch_gradstats', *{args!r}]\n" \
           "runpy.run_module('torch_gradstats', run_name='__main__')"  # fmt: skip
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300, check=False)  # fmt: skip


def _assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(err) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    for text in expected:
        assert text in err[0], err[0]
    return err[0]


_SEED_RANGE = "--seed must be an integer from -9223372036854775808 to 18446744073709551614"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["demo", "--device", "meta"], ["demo: error: --device 'meta'", "holds no data", "use --device cpu"]),
        (["demo", "--device", "tpu:0"], ["demo: error: invalid --device 'tpu:0'"]),
        (["demo", "--seed", str(2**64 - 1)], [_SEED_RANGE, "got 18446744073709551615"]),
        (["demo", "--seed", str(2**64)], [_SEED_RANGE, "got 18446744073709551616"]),
        (["demo", "--seed", str(-(2**63) - 1)], [_SEED_RANGE]),
        (["demo", "--steps", "many"], ["demo: error: argument --steps: invalid int value: 'many'"]),
        (["demo", "--no-such-flag"], ["error: unrecognized arguments: --no-such-flag"]),
        (["frobnicate"], ["error: argument {info,demo,bench}: invalid choice: 'frobnicate'"]),
        (["bench", "--seed", str(2**64)], ["argument --seed: expected an integer from -9223372036854775808 to",
                                           "18446744073709551615, got 18446744073709551616"]),
        (["bench", "--device", "meta"], ["--device must be cpu or cuda, got 'meta'"]),
    ],
    ids=["meta", "bad-device", "seed-2**64-1", "seed-2**64", "seed-below", "steps", "flag", "command", "bench-seed",
         "bench-meta"],
)
def test_cli_errors_are_status_2_and_one_line(tmp_path, args, expected):
    if args[0] == "demo":
        args = [*args, "--out", str(tmp_path / "out"), "--no-plot", "--no-progress"]
    _assert_one_line_error(_run_cli(args, tmp_path), *expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_without_cuda_names_the_flag(tmp_path):
    line = _assert_one_line_error(_run_cli(["demo", "--device", "cuda", "--out", str(tmp_path)], tmp_path),
                                  "--device 'cuda' requested but CUDA is not available", "use --device cpu")
    assert "device='cpu'" not in line


@pytest.mark.parametrize("where", ["{file}", "{file}/sub", "/proc/forbidden"], ids=["a-file", "under-a-file", "proc"])
def test_cli_unwritable_tensorboard_dir_names_its_flag(tmp_path, where):
    pytest.importorskip("torch.utils.tensorboard")  # without it the error names the missing package instead
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    where = where.format(file=a_file)
    proc = _run_cli(["demo", "--steps", "1", "--no-plot", "--out", str(tmp_path / "out"), "--tensorboard", where],
                    tmp_path)  # fmt: skip
    line = _assert_one_line_error(proc, f"demo: error: --tensorboard {where!r}", "pass a writable directory")
    assert "--out" not in line


def test_cli_tensorboard_missing_names_the_package(tmp_path):
    prelude = "import sys; sys.modules['torch.utils.tensorboard'] = None  # as if tensorboard were not installed"
    proc = _run_cli(["demo", "--steps", "1", "--out", str(tmp_path), "--tensorboard", str(tmp_path / "tb")],
                    tmp_path, prelude)  # fmt: skip
    _assert_one_line_error(proc, "demo: error: --tensorboard needs the tensorboard package (pip install tensorboard)")
    assert not (tmp_path / "log.jsonl").exists()  # refused before training


def test_cli_demo_in_range_extreme_seed_runs(tmp_path):
    assert main(["demo", "--steps", "1", "--seed", str(2**64 - 2), "--out", str(tmp_path), "--no-plot",
                 "--no-progress"]) == 0  # fmt: skip


_MODULES = "one of ['embed', 'act1', 'hidden', 'act2', 'head']"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--inject-spike", "-1"], ["demo: error: --inject-spike -1 is outside the run's optimizer steps 0..199"]),
        (["--steps", "30", "--inject-spike", "30"], ["--inject-spike 30 is outside the run's optimizer steps 0..29"]),
        (["--inject-spike", "3"], ["--inject-spike 3 falls in the spike guard's warm-up: it judges steps 11..199"]),
        (["--steps", "10", "--inject-spike", "3"],
         ["--inject-spike 3 falls in the spike guard's warm-up: with --steps 10 it judges none"]),
        (["--inject-spike", "2.5"], ["demo: error: argument --inject-spike: invalid int value: '2.5'"]),
        (["--inject-bad-example", "-1"], ["demo: error: --inject-bad-example -1 is outside the run's optimizer steps"]),
        (["--steps", "30", "--inject-bad-example", "30"],
         ["--inject-bad-example 30 is outside the run's optimizer steps 0..29"]),
        (["--inject-bad-example", "3"],
         ["--inject-bad-example 3 falls in the spike guard's warm-up: it judges steps 11..199"]),
        (["--inject-bad-example", "x"], ["demo: error: argument --inject-bad-example: invalid int value: 'x'"]),
        (["--inject-nan", "5", "--nan-module", "nope"], ["demo: error: --nan-module 'nope' is not a module", _MODULES]),
        (["--nan-module", "hidden"], ["--nan-module hidden needs --inject-nan STEP"]),
        (["--inject-nan", "-2", "--nan-module", "hidden"], ["--inject-nan -2 is outside the run's optimizer steps"]),
        (["--inject-nan", "5", "--nan-module", "hidden", "--inject-param", "head.bias"],
         ["give --inject-param (a gradient) or --nan-module (a forward output) to poison, not both"]),
    ],
    ids=["spike-negative", "spike-past-end", "spike-in-warm-up", "spike-run-too-short", "spike-not-int",
         "bad-example-negative", "bad-example-past-end", "bad-example-in-warm-up", "bad-example-not-int",
         "bad-module", "module-no-step", "nan-negative", "param-and-module"],
)
def test_cli_injection_errors_are_status_2_and_one_line(tmp_path, args, expected):
    out = tmp_path / "out"
    proc = _run_cli(["demo", *args, "--out", str(out), "--no-plot", "--no-progress"], tmp_path)
    _assert_one_line_error(proc, *expected)
    assert not out.exists()  # refused before training


def test_cli_nan_module_names_the_forward_origin(tmp_path):
    proc = _run_cli(["demo", "--steps", "30", "--inject-nan", "20", "--nan-module", "hidden", "--no-plot",
                     "--out", str(tmp_path)], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forward origin hidden" in proc.stdout
    assert "ActivationWatch: forward origin of the non-finite values: hidden (step 20)." in proc.stdout
    assert proc.stderr == ""  # the Trainer's repeated warnings are printed once, on stdout, not on stderr


def test_cli_inject_spike_names_the_skipped_step(tmp_path, capsys):
    assert main(["demo", "--steps", "30", "--inject-spike", "20", "--adaptive-clip", "--no-plot", "--no-progress",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "with SpikeGuard, AdaptiveClip" in out and "SpikeGuard skipped step 20 (global grad norm" in out


@pytest.mark.parametrize("flag", ["--inject-spike", "--inject-bad-example"])
def test_cli_guard_skip_is_told_on_stdout_only(tmp_path, flag):
    proc = _run_cli(["demo", "--steps", "30", flag, "20", "--no-plot", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SpikeGuard skipped step 20 (global grad norm" in proc.stdout
    assert proc.stderr == ""  # the Trainer's warning of the skipped step is the demo's to tell, on stdout
