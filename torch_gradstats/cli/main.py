"""Command line: ``python -m torch_gradstats info | demo | bench``.

* ``info``: versions, whether the compiled extension loaded (and why not), which dispatch keys have a compiled
  kernel of the op, whether the fallback is forced, one run of the op on CPU (and CUDA when present) checked
  against the float64 reference, and whether a C++ error (a bad input) comes back as a Python exception, checked
  in a child process because some toolchains make it crash the process. Exit status 1 if a check fails.
* ``demo``: train a small model on synthetic data and watch its gradients (see :mod:`torch_gradstats.cli.demo`).
* ``bench``: the benchmark (:mod:`torch_gradstats.bench`); every argument after ``bench`` is passed to it.

A bad argument exits with status 2 and one line on stderr that names the flag (no usage block, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import torch

__all__ = ["check_cpp_errors", "info", "info_report", "main"]

OP = "torch_gradstats::multi_tensor_stats"


def _kernel_line(key: str) -> str:
    """Is there a kernel registered for exactly this dispatch key?

    ``_dispatch_has_kernel_for_dispatch_key`` sees only kernels registered for that key itself: the pure-PyTorch
    fallback, registered as CompositeExplicitAutograd, does not count as a "CPU" or "CUDA" kernel. So "no" below
    means the fallback serves that backend.
    """
    if torch._C._dispatch_has_kernel_for_dispatch_key(OP, key):
        return f"{key:<26} compiled kernel"
    if key == "CUDA" and torch.version.cuda is None:
        return f"{key:<26} no compiled kernel (and this torch has no CUDA)"
    return f"{key:<26} no compiled kernel (the pure-PyTorch fallback serves it)"


def _example_tensors(device: torch.device) -> list[torch.Tensor]:
    return [
        torch.tensor([3.0, 4.0, 0.0], device=device),
        torch.tensor([1.0, float("nan"), float("inf"), -0.0], dtype=torch.float16, device=device),
        torch.full((1000,), 1e20, dtype=torch.float32, device=device),  # squares overflow float32, not float64
        torch.zeros(0, dtype=torch.bfloat16, device=device),
    ]


def _run_op(device: torch.device) -> list[str]:
    from torch_gradstats.ops.op import multi_tensor_stats, reference_multi_tensor_stats

    tensors = _example_tensors(device)
    out = multi_tensor_stats(tensors)
    ref = reference_multi_tensor_stats(tensors)
    sumsq, amax, counts = (t.cpu() for t in out)
    r_sumsq, r_amax, r_counts = (t.cpu() for t in ref)
    ok = (
        torch.allclose(sumsq, r_sumsq, rtol=1e-5, equal_nan=True)
        and torch.allclose(amax, r_amax, rtol=1e-5, equal_nan=True)
        and torch.equal(counts, r_counts)
    )
    lines = [
        f"op on {device}: {len(tensors)} tensors (float32 [3], float16 [4] with NaN/Inf, float32 1e20 x1000, "
        + "empty bfloat16)"
    ]
    for i in range(len(tensors)):
        lines.append(
            f"  [{i}] sumsq={sumsq[i].item():.6g} amax={amax[i].item():.6g} "
            f"zeros={int(counts[i, 0])} nan={int(counts[i, 1])} inf={int(counts[i, 2])}"
        )
    lines.append(f"  matches the float64 reference: {'yes' if ok else 'NO'}")
    return lines


#: What the C++ error-path check runs in a child process: an integer tensor through the raw op must come back as a
#: TypeError. A toolchain that links its own static libstdc++ into the extension makes C++ exceptions crash instead.
_CPP_ERROR_CHILD = (
    "import torch, torch_gradstats\n"
    "try:\n"
    "    torch.ops.torch_gradstats.multi_tensor_stats.default([torch.arange(3)])\n"
    "except TypeError:\n"
    "    print('ok')\n"
)

REBUILD_HINT = (
    "rebuild it with the system compiler: CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e ."
)


def check_cpp_errors(command: Sequence[str] | None = None, timeout: float = 120.0) -> tuple[bool, str]:
    """Feed a bad input to the raw op in a child process; ``(ok, one line)``. A crash there cannot take this
    process down. ``command`` replaces the child (tests point it at one that dies by a signal)."""
    cmd = list(command) if command is not None else [sys.executable, "-c", _CPP_ERROR_CHILD]
    try:
        child = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return False, f"the child process hung for {timeout:g} s on a bad input; {REBUILD_HINT}"
    if child.returncode < 0:
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        return False, (
            f"CRASHED: a C++ error (bad input to the op) killed the process with {name}; the extension was built "
            f"with a toolchain whose C++ exceptions do not work with torch's; {REBUILD_HINT}"
        )
    if child.returncode != 0 or child.stdout.strip() != "ok":
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"a bad input did not raise TypeError (exit status {child.returncode}: {last})"
    return True, "ok (a bad input raises TypeError)"


def info() -> str:
    """The ``info`` report as a string (also what ``python -m torch_gradstats info`` prints)."""
    return info_report()[0]


def _cpu_capability(ext: object) -> str:
    """The instruction set the compiled CPU kernel runs with (chosen at run time, as ATen chooses its own)."""
    query = getattr(ext, "cpu_capability", None)
    if query is None:
        return "n/a (no compiled CPU kernel)"
    return f"{query()} (ATEN_CPU_CAPABILITY=default|avx2|avx512 before importing torch to force one)"


def _cpu_histogram_counting(ext: object) -> str:
    """How the compiled CPU kernel counts the exponent histogram (GFNI where the CPU has it)."""
    query = getattr(ext, "cpu_histogram_counting", None)
    if query is None:
        return "n/a (no compiled CPU kernel)"
    return str(query())


def info_report(cpp_check_command: Sequence[str] | None = None) -> tuple[str, bool]:
    """The ``info`` report and whether every check in it passed (the exit status of ``info``)."""
    from torch_gradstats.ops import HAS_EXTENSION, _extension
    from torch_gradstats.ops._version import __version__

    ext = sys.modules.get("torch_gradstats._C")
    if HAS_EXTENSION:
        ext_line = f"loaded ({getattr(ext, '__file__', '?')})"
    else:
        ext_line = f"NOT loaded: {_extension.EXTENSION_ERROR}"
    forced = os.environ.get(_extension.FORCE_FALLBACK_ENV)
    lines = [
        f"torch_gradstats {__version__}",
        f"python           {platform.python_version()} ({platform.platform()})",
        f"torch            {torch.__version__}",
        f"torch CUDA       {torch.version.cuda or 'none (CPU-only build)'}",
        f"CUDA available   {torch.cuda.is_available()}"
        + (f" ({torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)})"
           if torch.cuda.is_available() else ""),
        f"extension        {ext_line}",
        f"instruction set  {_cpu_capability(ext)}",
        f"histogram on CPU {_cpu_histogram_counting(ext)}",
        f"{_extension.FORCE_FALLBACK_ENV} "
        + (f"set to {forced!r}" + (" (forces the fallback)" if _extension._fallback_forced() else " (ignored)")
           if forced is not None else "not set"),
        f"dispatch keys of {OP}:",
        "  " + _kernel_line("CPU"),
        "  " + _kernel_line("CUDA"),
        "  " + f"{'CompositeExplicitAutograd':<26} "
        + ("pure-PyTorch fallback registered" if torch._C._dispatch_has_kernel_for_dispatch_key(
            OP, "CompositeExplicitAutograd") else "MISSING"),
    ]
    lines += _run_op(torch.device("cpu"))
    if torch.cuda.is_available():
        lines += _run_op(torch.device("cuda"))
    ok = all("matches the float64 reference: yes" in line for line in lines if "matches the float64" in line)
    if HAS_EXTENSION:
        cpp_ok, cpp_line = check_cpp_errors(cpp_check_command)
        ok = ok and cpp_ok
    else:
        cpp_line = "not checked (the compiled extension is not loaded)"
    lines.append(f"C++ error path   {cpp_line}")
    return "\n".join(lines), ok


def _bench(argv: Sequence[str]) -> int:
    try:
        bench = importlib.import_module("torch_gradstats.bench")
    except ImportError as exc:
        print(f"error: the benchmark module torch_gradstats.bench is not available ({exc})", file=sys.stderr)
        return 2
    try:
        return int(bench.main(list(argv)) or 0)
    except SystemExit as exc:  # its argparse exits on --help and on bad arguments
        return _exit_code(exc)
    except BrokenPipeError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:  # e.g. --threads -3, an --out it cannot write
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


class _Parser(argparse.ArgumentParser):
    """Errors as one line (the subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


#: What torch.Generator.manual_seed accepts: any signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)


def _demo_args_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the demo's flags that the demo would only find deep inside (or name by another flag)."""
    from torch_gradstats.training import validate_device

    lo, hi = SEED_RANGE[0], SEED_RANGE[1] - 1  # the demo seeds its held-out data with seed + 1
    if not lo <= args.seed <= hi:
        return f"--seed must be an integer from {lo} to {hi} (torch's 64-bit seeds; the demo also uses seed + 1), " \
               f"got {args.seed}"  # fmt: skip
    if args.device is not None:
        try:
            validate_device(args.device, name="--device")
        except ValueError as exc:
            return str(exc)
    if args.tensorboard is not None:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as exc:
            return f"--tensorboard needs the tensorboard package (pip install tensorboard): {exc}"
        try:
            Path(args.tensorboard).mkdir(parents=True, exist_ok=True)
            writable = os.access(args.tensorboard, os.W_OK | os.X_OK)
        except OSError as exc:
            return f"--tensorboard {args.tensorboard!r}: {exc.strerror or exc}; pass a writable directory"
        if not writable:
            return f"--tensorboard {args.tensorboard!r}: permission denied; pass a writable directory"
    return None


def _demo(args: argparse.Namespace) -> int:
    from torch_gradstats.cli import demo

    problem = _demo_args_error(args)
    if problem is not None:
        print(f"demo: error: {problem}", file=sys.stderr)
        return 2
    return demo.run_from_args(args)


def _parser() -> argparse.ArgumentParser:
    from torch_gradstats.cli import demo

    p = _Parser(prog="python -m torch_gradstats", description="torch_gradstats command line")
    sub = p.add_subparsers(dest="command", metavar="{info,demo,bench}")
    sub.required = True
    sub.add_parser("info", help="versions, extension and kernel status, one run of the op")
    demo.build_parser(sub.add_parser("demo", help="train a small model on synthetic data and watch its gradients",
                                     description=demo.__doc__.split("\n")[0]))
    sub.add_parser("bench", help="benchmark the fused op (arguments are passed on; see `bench --help`)",
                   add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m torch_gradstats``; returns the exit status."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here rather than at exit, where a broken pipe could no longer be handled
        return status
    except BrokenPipeError:
        # Standard output was closed early (`python -m torch_gradstats demo | head`): stop quietly, as Unix tools
        # do. Standard output goes to /dev/null so that Python's flush at exit does not fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a standard output without a file descriptor
            pass
        return 1  # what Python itself returns after a broken pipe


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench`, --help included, belongs to the benchmark
        return _bench(argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on errors; report that as a status instead
        return _exit_code(exc)
    if args.command == "info":
        text, ok = info_report()
        print(text)
        return 0 if ok else 1
    if args.command == "demo":
        return _demo(args)
    return 2  # unreachable: argparse rejects unknown commands
