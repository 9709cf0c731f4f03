"""Worker side of tests/test_groups.py's distributed check: every rank holds an uneven shard of each gradient (plain
tensors with ``group=``, as FSDP1 flat parameters or ZeRO partitions), groups the reduced figures and compares them
with the groups of the whole gradients. Kept out of the test module: spawned processes re-import it."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist

from torch_gradstats.distributed.reduce import reduce_across_ranks
from torch_gradstats.monitors.updates import grad_and_weight_stats
from torch_gradstats.ops.op import multi_tensor_stats
from torch_gradstats.stats.gradients import grad_stats
from torch_gradstats.stats.groups import group_stats

NAMES = ["embed.weight", "layers.0.mlp.0.weight", "layers.0.mlp.2.bias", "layers.1.attn.weight", "lm_head.weight"]
SHAPES = [(7, 3), (5, 4), (6,), (4, 4), (3, 7)]


def full_params() -> list[torch.nn.Parameter]:
    """The same parameters and gradients on every rank: a NaN in layers.1, an Inf in lm_head."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
        p.grad = torch.randn(shape, generator=gen, dtype=torch.float64)
        params.append(p)
    params[3].grad.view(-1)[5] = math.nan
    params[4].grad.view(-1)[0] = math.inf
    return params


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank r holds an uneven slice of the flattened tensor."""
    n, total = t.numel(), world * (world + 1) // 2
    bounds = [n * (r * (r + 1) // 2) // total for r in range(world + 1)]  # rank r holds r + 1 parts
    return t.reshape(-1)[bounds[rank]:bounds[rank + 1]]


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or math.isclose(a[k], b[k], rel_tol=1e-12) for k in a
    )


def check(rank: int, world: int) -> dict[str, str]:
    pg = dist.group.WORLD
    full = full_params()
    shards = []
    for p in full:
        s = torch.nn.Parameter(shard(p.detach(), rank, world).clone())
        s.grad = shard(p.grad, rank, world).clone()
        shards.append(s)
    expected = grad_stats(list(zip(NAMES, full))).grouped("layer").report().to_dict()

    stats = grad_stats(list(zip(NAMES, shards)), group=pg)
    before = pg._get_sequence_number_for_group()
    got = stats.grouped("layer").report().to_dict()
    assert pg._get_sequence_number_for_group() == before, "grouping issued a collective"
    assert close(got, expected), (got, expected)

    # A ReducedStats straight from reduce_across_ranks, grouped with the names given.
    local = [s.grad for s in shards]
    reduced = reduce_across_ranks(local, *multi_tensor_stats(local), pg)
    got = group_stats(reduced, "layer", names=NAMES).report().to_dict()
    assert close(got, expected), (got, expected)

    # Weights too: their group norms are those of the whole weights.
    want_w = grad_and_weight_stats(list(zip(NAMES, full))).grouped("layer").report().weight_norms
    got_w = grad_and_weight_stats(list(zip(NAMES, shards)), group=pg).grouped("layer").report().weight_norms
    assert close(got_w or {}, want_w or {}), (got_w, want_w)
    return {"status": "ok", "groups": ",".join(got_w or {})}


def run_worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        try:
            result = check(rank, world)
        except Exception:  # noqa: BLE001 - reported by the test
            result = {"status": "fail", "detail": traceback.format_exc()}
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort an interpreter's teardown; the result is on disk
