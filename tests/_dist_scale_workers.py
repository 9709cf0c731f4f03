"""Worker side of tests/test_distributed_scale.py: what the reductions cost and in which order they run, on gloo.

Each scenario is ``(rank, world) -> None | str`` as in tests/_dist_workers.py (whose run_worker runs them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.stats.gradients import grad_stats


def _record_all_reduce(sizes: list[int]) -> Callable[[], None]:
    """Record the numel of every tensor passed to torch.distributed.all_reduce; returns the undo."""
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording

    def undo() -> None:
        dist.all_reduce = real

    return undo


def all_reduce_sizes(rank: int, world: int) -> None:
    """The same rows carry the same number of elements per all-reduce at any world size, a NaN's rank named."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(6, 4), (9,), (3, 3, 2), (5,)]
    params = []
    for i, shape in enumerate(shapes):
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) + rank
        params.append((f"p{i}", p))
    if rank == world - 1:
        params[1][1].grad[0] = math.nan
    grad_stats(params, group=dist.group.WORLD)  # the first call agrees on the layout
    sizes: list[int] = []
    undo = _record_all_reduce(sizes)
    try:
        for _ in range(3):
            rep = grad_stats(params, group=dist.group.WORLD, histogram=True).report()
            grad_stats(params, group=dist.group.WORLD).report()
    finally:
        undo()
    rows = len(shapes) + 1  # and the check row
    # per call one SUM (sumsq, 3 counts, numel [, 277 histogram counts]) and one MAX (max |x|, encoded rank)
    assert sizes == [rows * (5 + 277), rows * 2, rows * 5, rows * 2] * 3, sizes
    assert rep.nonfinite_ranks == {"p1": [world - 1]}, rep.nonfinite_ranks


def _reference_2x2(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in (
        ("both", (4, 6)), ("tp_only", (6, 2)), ("dp_only", (4, 3)), ("replicated", (3,)),
        ("plain_a", (8,)), ("plain_b", (5, 2)), ("plain_c", (7,)),
    )}


def mesh_2x2_subsets(rank: int, world: int) -> str | None:
    """A 2x2 (dp, tp) mesh: DTensors sharded over both, one or no dimension, and plain dp shards that the ranks
    hold in different subsets; every rank's figures equal the float64 reference, 4 calls within 60 s."""
    if world != 4:
        return "skip: needs 4 ranks"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    full = _reference_2x2(11)
    placements = {"both": [Shard(0), Shard(1)], "tp_only": [Replicate(), Shard(0)],
                  "dp_only": [Shard(0), Replicate()], "replicated": [Replicate(), Replicate()]}
    # plain shards over dp, the same on both tp ranks (replicated over tp): which ranks hold what differs
    held = {0: {"plain_a": 0, "plain_b": 0}, 1: {"plain_b": 1, "plain_c": 0}}[dp_rank]
    start = time.monotonic()
    for step in range(4):
        params = []
        for name, placement in placements.items():
            p = nn.Parameter(distribute_tensor(torch.zeros_like(full[name]), mesh, placement))
            p.grad = distribute_tensor(full[name] * (step + 1), mesh, placement)
            params.append((name, p))
        for name, part in held.items():
            whole = full[name].reshape(-1) * (step + 1)
            chunks = torch.tensor_split(whole, 2) if name == "plain_b" else [whole]
            p = nn.Parameter(torch.zeros_like(chunks[part]))
            p.grad = chunks[part].clone()
            params.append((name, p))
        rep = grad_stats(params, group=mesh.get_group("dp")).report()
        want = math.sqrt(sum(float(t.square().sum()) for t in full.values())) * (step + 1)
        assert rep.total_norm == want or abs(rep.total_norm - want) <= 1e-12 * want, (step, rep.total_norm, want)
        assert set(rep.norms) == set(full), sorted(rep.norms)
        for name, t in full.items():
            assert abs(rep.norms[name] - float(t.norm()) * (step + 1)) <= 1e-12 * rep.norms[name], name
            assert rep.numel == sum(t.numel() for t in full.values())
    assert time.monotonic() - start < 60.0

    # DTensors only, listed in another order on each dp coordinate: the order of the reductions must not follow it
    params = []
    for name, placement in placements.items():  # made in one order on every rank: distribute_tensor is a collective
        p = nn.Parameter(distribute_tensor(torch.zeros_like(full[name]), mesh, placement))
        p.grad = distribute_tensor(full[name].clone(), mesh, placement)
        params.append((name, p))
    if dp_rank == 1:  # a tp-sharded gradient first here, one sharded over dp first on dp coordinate 0
        params = [params[1], params[3], params[0], params[2]]
    for _ in range(2):
        rep = grad_stats(params).report()
        want = math.sqrt(sum(float(full[n].square().sum()) for n in placements))
        assert abs(rep.total_norm - want) <= 1e-12 * want, (rep.total_norm, want)


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f for f in (all_reduce_sizes, mesh_2x2_subsets)  # type: ignore[misc]
}
