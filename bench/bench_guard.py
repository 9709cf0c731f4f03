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

Host time: the median over ``--reps`` calls of the wall time of one call, the contenders interleaved in
``--rounds`` rounds (on CUDA the host's launch time: the device is synchronised only between calls). Launches: on
CUDA the device kernels of one call; on the CPU the outermost ``aten::`` ops of one call that would launch a kernel
on a GPU (views and no-op conversions are not counted).

    python bench/bench_guard.py [--device cpu|cuda] [--reps 400] [--rounds 8] [--threads 1]
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


#: Ops that only make a view or return their input: no kernel launch on a GPU.
_NO_LAUNCH = {
    "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::view", "aten::reshape", "aten::detach",
    "aten::alias", "aten::expand", "aten::as_strided", "aten::t", "aten::permute", "aten::lift_fresh",
    "aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::result_type",
}


def _top_level(event: object) -> bool:
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _launches(fn: Callable[[], object], device: torch.device) -> int:
    """Kernel launches of one call: device kernels on CUDA; on the CPU the outermost aten ops that are not views,
    and no-op conversions (``aten::to`` that returns its input) are not counted either."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    n = 0
    for e in events:
        if not e.name.startswith("aten::") or e.name in _NO_LAUNCH or not _top_level(e):
            continue
        if e.name == "aten::to" and not any(c.name == "aten::_to_copy" for c in e.cpu_children):
            continue
        n += 1
    return n


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
    print(f"torch {torch.__version__}, device {device}, {len(params)} gradient tensors, {args.threads} thread(s), "
          f"median of {args.reps} calls in {args.rounds} interleaved rounds")
    for fn in contenders.values():
        for _ in range(10):
            fn()
    host = _host_us(contenders, device, args.reps, args.rounds)
    print(f"{'contender':<20} {'host us':>9} {'launches':>9} {'host us over grad_stats':>24}")
    for name, fn in contenders.items():
        extra = f"{host[name] - host['grad_stats']:+.1f}" if name.startswith("+") else ""
        print(f"{name:<20} {host[name]:9.1f} {_launches(fn, device):9d} {extra:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
