"""Worker side of the distributed test in tests/test_guard.py: every rank of a gloo group runs the same steps on its
shard of the gradients and records the guard's decisions and the adaptive clip's figures. Kept out of the test module
because spawned children re-import the worker's module."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from torch_gradstats import AdaptiveClip, SpikeGuard

STEPS = 60
SPIKES = {25: 40.0, 41: 60.0}
NAN_STEP = 33  # a NaN in one rank's shard only


def full_grads(step: int) -> list[torch.Tensor]:
    """The whole gradients of one step (the same on every rank): float64, spikes and a NaN at fixed steps."""
    gen = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(37, generator=gen, dtype=torch.float64), torch.randn(64, generator=gen, dtype=torch.float64)]
    grads = [g * SPIKES.get(step, 1.0) for g in grads]
    if step == NAN_STEP:
        grads[1][-1] = float("nan")  # in the last rank's shard
    return grads


def full_loss(step: int) -> float:
    return 2.0 - step / STEPS + (25.0 if step == 47 else 0.0)


def run(grads_of, loss_of, group=None) -> dict[str, list[float]]:
    """The steps on the gradients given by ``grads_of(step)`` and the loss ``loss_of(step)``."""
    guard = SpikeGuard(window=16, sigma=4.0)
    clip = AdaptiveClip(warmup=8, max_norm=50.0)
    out: dict[str, list[float]] = {"factor": [], "clip_norm": [], "clip_coef": [], "threshold": []}
    params = None
    for step in range(STEPS):
        grads = grads_of(step)
        if params is None:
            params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        stats = clip.clip_(params, group=group)
        factor = guard.observe(stats.clip_norm, loss_of(step))
        out["factor"].append(factor.item())
        out["clip_norm"].append(stats.clip_norm.item())
        out["clip_coef"].append(stats.clip_coef.item())
        out["threshold"].append(clip.last_threshold.item())
    return out


def run_worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        def shards(step: int) -> list[torch.Tensor]:
            return [g.tensor_split(world)[rank] for g in full_grads(step)]

        def loss(step: int) -> torch.Tensor:
            local = torch.tensor(full_loss(step) * (rank + 1), dtype=torch.float64)  # differs per rank
            dist.all_reduce(local)
            return local / sum(range(1, world + 1))  # the global loss, the same on every rank

        result = run(shards, loss, group=dist.group.WORLD)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can abort a finished process
