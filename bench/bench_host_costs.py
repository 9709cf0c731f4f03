"""Host costs of single calls on the CPU, the figures docs/design.md and the docstrings quote.

Three groups, each timed side by side in one process, the contenders interleaved round by round; a figure is the
median over ``--rounds`` rounds of one round's time per call (``--calls`` calls in a loop), and the fastest round
beside it. The clock is the calling thread's CPU time (``time.thread_time``), which leaves out the time the process
waits for a core on a shared machine.

    one 4 KiB tensor     one float32 tensor of 1,024 elements: ``_C.direct_stats`` (the compiled entry point,
                         no dispatcher), ``multi_tensor_stats`` (the Python wrapper around it), the raw op through
                         ``torch.ops``, ``torch._foreach_norm`` and ``torch.sum``
    10,000 ints          an int64 tensor of 10,000 Python ints: ``torch.tensor`` of the list against
                         ``host_int64`` (an ``array`` and ``torch.frombuffer``)
    10,000 tensors       per tensor of 10,000 x 1,024 float32: a ``detach()`` of each, against one call of
                         ``multi_tensor_stats`` over the list

    python bench/bench_host_costs.py [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import torch_gradstats as tg
from torch_gradstats.ops import op as _op
from torch_gradstats.ops._transfer import host_int64


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=10"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _group(title: str, contenders: dict[str, Callable[[], object]], calls: int, rounds: int, per: int = 1) -> None:
    """Time each contender ``calls`` times per round, interleaved; print us per call (or per item, over ``per``)."""
    for fn in contenders.values():  # warm up
        for _ in range(min(calls, 100)):
            fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # fmt: skip
        for name in order:
            fn = contenders[name]
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            times[name].append((time.thread_time() - t0) / calls / per * 1e6)
    unit = "us per call" if per == 1 else f"us per item (of {per:,})"
    print(f"\n{title}: {unit}, median of {rounds} rounds of {calls} calls (fastest round)")
    for name in names:
        print(f"  {name:34s} {statistics.median(times[name]):9.3f}  ({min(times[name]):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  torch: {torch.__version__}  "
          f"commit measured: {_commit()}  cpu: {_cpu_name()}, {os.cpu_count()} logical cores, torch threads "
          f"{torch.get_num_threads()}  load average at start: {load:.2f}  "
          f"compiled extension loaded: {_op._direct_stats is not None}")  # fmt: skip
    direct = _op._direct_stats
    if direct is None:
        raise SystemExit("the compiled extension is not loaded: nothing to measure")

    one = [torch.randn(1024)]
    _group("one 4 KiB float32 tensor", {
        "_C.direct_stats": lambda: direct(one),
        "multi_tensor_stats": lambda: tg.multi_tensor_stats(one),
        "torch.ops (raw op)": lambda: torch.ops.torch_gradstats.multi_tensor_stats(one),
        "torch._foreach_norm": lambda: torch._foreach_norm(one),
        "torch.sum": lambda: torch.sum(one[0]),
    }, calls=20_000, rounds=args.rounds)  # fmt: skip

    ints = list(range(1_000, 11_000))
    cpu = torch.device("cpu")
    _group("10,000 Python ints to an int64 tensor", {
        "torch.tensor(list)": lambda: torch.tensor(ints, dtype=torch.int64),
        "host_int64 (array, frombuffer)": lambda: host_int64(ints, cpu),
    }, calls=20, rounds=args.rounds, per=len(ints))  # fmt: skip

    many = [torch.randn(1024) for _ in range(10_000)]
    _group("10,000 x 1,024 float32", {
        "detach() of each tensor": lambda: [t.detach() for t in many],
        "multi_tensor_stats(list)": lambda: tg.multi_tensor_stats(many),
    }, calls=3, rounds=args.rounds, per=len(many))  # fmt: skip


if __name__ == "__main__":
    main()
