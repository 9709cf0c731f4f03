"""Per-step cost of the policies that act on the statistics: host time and launches, beside a plain grad_stats step.

Each contender is one step's worth of work after ``backward()`` on the gradients of a small MLP (8 tensors):

    grad_stats          ``grad_stats(params).total_norm``: the read every policy builds on
    + SpikeGuard        that, then ``guard.observe(norm, loss)`` (window 128, warmed up)
    + AdaptiveClip      that, then ``clipper.threshold(norm)`` (warmed up)
    AdaptiveClip.clip_  statistics, threshold and in-place clipping of every gradient in one call
    clip_grad_norm_     the fused fixed-threshold clip (``max_norm=1.0``), for comparison
    + OLMo list rule    ``grad_stats`` then OLMo-core's rule reimplemented: lists of the last 129 losses and norms
                        as 0-d tensors, ``torch.stack`` and ``torch.std_mean`` of each, two comparisons
    step_or_skip        fused AdamW stepped through ``step_or_skip`` (the guard's factor as ``found_inf``)
    optimizer.step      the same fused AdamW stepped directly

Then each policy's own per-step update alone, on figures already computed (a float64 norm, a float32 loss):

    SpikeGuard.observe      ``guard.observe(norm, loss)``
    AdaptiveClip.threshold  ``clipper.threshold(norm)``
    NoiseScale.update       ``noise.update(small_sq, big_sq, big_batch_size=...)``: what the DDP hook calls per step

Host time: the median over ``--reps`` calls of the wall time of one call, the contenders interleaved in
``--rounds`` rounds (on CUDA the host's launch time: the device is synchronised only between calls). Launches: on
CUDA the device kernels of one call (the profiler's); on the CPU the outermost ops of one call that would launch a
kernel on a GPU, seen by a dispatch mode: ``aten::`` and custom ops alike (a ``torch_gradstats::`` op with a compiled
kernel counts as one; one served by its pure-PyTorch fallback counts the ops of the fallback), views and
allocations not counted.

``--compare FILE`` adds the figures of an earlier output of this script (e.g. the code before a change) beside the
policies' own: ``policy, host us, launches, before vs after``.

    python bench/bench_guard.py [--device cpu|cuda] [--reps 400] [--rounds 8] [--threads 1] [--compare FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import torch_gradstats as tg


class OlmoRule:
    """OLMo-core's SkipStepOptimizer rule as it runs each step, reimplemented for comparison (no host sync)."""

    def __init__(self, window: int = 128, sigma: float = 6.0) -> None:
        self.window, self.sigma = window, sigma
        self.losses: list[torch.Tensor] = []
        self.norms: list[torch.Tensor] = []

    def step(self, loss: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        for values, v in ((self.losses, loss), (self.norms, norm)):
            values.append(v)
            while len(values) > self.window + 1:
                values.pop(0)
        if len(self.losses) < max(2, self.window // 2):
            return torch.ones((), device=loss.device)
        loss_std, loss_mean = torch.std_mean(torch.stack(self.losses[:-1]))
        norm_std, norm_mean = torch.std_mean(torch.stack(self.norms[:-1]))
        loss_ok = (self.losses[-1] - loss_mean) <= self.sigma * loss_std
        ok = torch.logical_and(loss_ok, (self.norms[-1] - norm_mean) <= self.sigma * norm_std)
        return ok.float()


#: Ops that allocate or relabel a tensor without touching its memory: no kernel launch on a GPU.
_NO_LAUNCH = {
    "aten::empty.memory_format", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::lift_fresh",
    "aten::alias", "aten::_unsafe_view", "aten::set_.source_Storage_storage_offset",
}


class _Launches(TorchDispatchMode):
    """Counts the outermost ops that reach the dispatcher's backends: every op but views and allocations. A
    ``torch_gradstats::`` op with a kernel compiled for the device counts as one launch; one that runs its
    pure-PyTorch fallback there is entered, and the fallback's own ops are counted (each is a launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.name()
        if name.startswith("torch_gradstats::"):
            key = self._device_key(args)
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
                with self:  # the fallback runs below this mode, its ops seen (and counted) one by one
                    return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
        if not func.is_view and name not in _NO_LAUNCH:
            self.ops.append(name)
        return func(*args, **kwargs)

    @staticmethod
    def _device_key(args: tuple) -> str:
        flat = [a for a in args if isinstance(a, torch.Tensor)]
        flat += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        return "CUDA" if flat and flat[0].device.type == "cuda" else "CPU"


def _launches(fn: Callable[[], object], device: torch.device) -> int:
    """Kernel launches of one call: device kernels on CUDA (the profiler's); on the CPU the ops :class:`_Launches`
    counts."""
    if device.type == "cuda":
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    with _Launches() as mode:
        fn()
    return len(mode.ops)


def _host_us(contenders: dict[str, Callable[[], object]], device: torch.device, reps: int, rounds: int
             ) -> dict[str, float]:
    """Median host time of one call per contender, contenders interleaved round by round (they share the noise)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        names = list(contenders)
        names = names[r % len(names):] + names[: r % len(names)]
        for name in names:
            fn = contenders[name]
            for _ in range(reps // rounds):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: host time without contention)")
    parser.add_argument("--compare", default=None, help="an earlier output of this script: its policy figures are "
                        "printed beside these (before vs after)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64),
                          nn.GELU(), nn.Linear(64, 1)).to(device)
    x = torch.randn(128, 64, device=device)
    loss = model(x).square().mean()
    loss.backward()
    loss = loss.detach()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=0.0, fused=True)  # lr 0: the benchmark never changes the weights
    optimizer.step()

    guard = tg.SpikeGuard(window=128, device=device)
    clipper = tg.AdaptiveClip(device=device)
    olmo = OlmoRule()
    # Warm every rule up past its warm-up, so each contender runs its steady-state path.
    for _ in range(140):
        norm = tg.grad_stats(params).total_norm
        guard.observe(norm, loss)
        clipper.threshold(norm)
        olmo.step(loss, norm)
    factor = guard.observe(tg.grad_stats(params).total_norm, loss)
    norm = tg.grad_stats(params).total_norm
    noise = tg.NoiseScale(16)
    small_sq, big_sq = norm.square() * 1.5, norm.square()
    loss32 = loss.float()

    contenders: dict[str, Callable[[], object]] = {
        "grad_stats": lambda: tg.grad_stats(params).total_norm,
        "+ SpikeGuard": lambda: guard.observe(tg.grad_stats(params).total_norm, loss),
        "+ AdaptiveClip": lambda: clipper.threshold(tg.grad_stats(params).total_norm),
        "AdaptiveClip.clip_": lambda: clipper.clip_(params),
        "clip_grad_norm_": lambda: tg.clip_grad_norm_(params, 1.0),
        "+ OLMo list rule": lambda: olmo.step(loss, tg.grad_stats(params).total_norm),
        "step_or_skip": lambda: tg.step_or_skip(optimizer, factor),
        "optimizer.step": lambda: optimizer.step(),
    }
    policies: dict[str, Callable[[], object]] = {
        "SpikeGuard.observe": lambda: guard.observe(norm, loss32),
        "AdaptiveClip.threshold": lambda: clipper.threshold(norm),
        "NoiseScale.update": lambda: noise.update(small_sq, big_sq, big_batch_size=64),
    }
    extension = "compiled kernels" if tg.HAS_EXTENSION else "pure-PyTorch fallback (no compiled extension)"
    print(f"torch {torch.__version__}, device {device}, {len(params)} gradient tensors, {args.threads} thread(s), "
          f"median of {args.reps} calls in {args.rounds} interleaved rounds, {extension}")
    for fn in (*contenders.values(), *policies.values()):
        for _ in range(10):
            fn()
    host = _host_us({**contenders, **policies}, device, args.reps, args.rounds)
    print(f"{'contender':<20} {'host us':>9} {'launches':>9} {'host us over grad_stats':>24}")
    for name, fn in contenders.items():
        extra = f"{host[name] - host['grad_stats']:+.1f}" if name.startswith("+") else ""
        print(f"{name:<20} {host[name]:9.1f} {_launches(fn, device):9d} {extra:>24}")
    before = _policy_rows(args.compare) if args.compare else {}
    print()
    header = f"{'policy (alone)':<24} {'host us':>9} {'launches':>9}"
    print(header + (f" {'before us':>10} {'before':>7}" if before else ""))
    for name, fn in policies.items():
        row = f"{name:<24} {host[name]:9.1f} {_launches(fn, device):9d}"
        if before:
            was = before.get(name)
            row += f" {was[0]:10.1f} {was[1]:7d}" if was else f" {'-':>10} {'-':>7}"
        print(row)
    return 0


def _policy_rows(path: str) -> dict[str, tuple[float, int]]:
    """The policy table of an earlier output of this script: name -> (host us, launches)."""
    rows: dict[str, tuple[float, int]] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    table = False
    for line in lines:
        if line.startswith("policy (alone)"):
            table = True
        elif table and line.strip():
            name, us, launches = line[:24].strip(), line[25:34], line[35:44]
            rows[name] = (float(us), int(launches))
    return rows


if __name__ == "__main__":
    sys.exit(main())
