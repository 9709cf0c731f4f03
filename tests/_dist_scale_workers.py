"""Worker side of tests/test_distributed_scale.py: what the reductions cost and in which order they run, on gloo.

Each scenario is ``(rank, world) -> None | str`` as in tests/_dist_workers.py (whose run_worker runs them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _host_reads import AllHostReads
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.policies.clip import clip_grad_norm_
from torch_gradstats.stats.gradients import UNATTRIBUTED_ROW, grad_stats


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
    rows = len(shapes) + 2  # and the reserved row (figures without a row yet) and the check row
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


def _plain(name: str, grad: torch.Tensor) -> tuple[str, nn.Parameter]:
    p = nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    return name, p


def _dtensor_params(mesh, placements: dict[str, list], full: dict[str, torch.Tensor], scale: float = 1.0,
                    without: frozenset[str] = frozenset()) -> list[tuple[str, nn.Parameter]]:
    """FSDP2-like parameters: DTensor parameters and gradients (none for the names in ``without``)."""
    params = []
    for name, placement in placements.items():  # made in one order on every rank: distribute_tensor is a collective
        p = nn.Parameter(distribute_tensor(torch.zeros_like(full[name]), mesh, placement))
        grad = distribute_tensor(full[name] * scale, mesh, placement)
        p.grad = None if name in without else grad
        params.append((name, p))
    return params


def _layouts(rank: int, world: int) -> dict[str, Callable[[int], tuple[list, dict]]]:
    """Each layout: step -> (the grad_stats call's arguments, the float64 reference of the whole model)."""
    gen = torch.Generator().manual_seed(5)
    full = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in
            (("w", (world * 2 + 1, 3)), ("v", (7,)), ("u", (world, 2)))}
    out = {}

    def plain_group(step: int):
        params = []
        for name, t in full.items():
            params.append(_plain(name, torch.tensor_split(t.reshape(-1) * (step + 1), world)[rank]))
        return (params, {"group": dist.group.WORLD}), {n: t * (step + 1) for n, t in full.items()}

    out["group"] = plain_group
    mesh = init_device_mesh("cpu", (world,))

    def dtensor(step: int):
        placements = {"w": [Shard(0)], "v": [Replicate()], "u": [Shard(1)]}
        return (_dtensor_params(mesh, placements, full, step + 1), {}), {n: t * (step + 1) for n, t in full.items()}

    out["dtensor"] = dtensor
    # pipeline stages x data parallel: stage s holds its own parameters, each sharded over the stage's dp ranks
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, dp_rank, dp_size = grid.get_local_rank("pp"), grid.get_local_rank("dp"), world // 2
    stage_names = [["w", "v"], ["u"]]

    def stages(step: int):
        params = []
        for name in stage_names[stage]:
            params.append(_plain(name, torch.tensor_split(full[name].reshape(-1) * (step + 1), dp_size)[dp_rank]))
        args = {"group": grid.get_group("dp"), "stage_group": grid.get_group("pp")}
        return (params, args), {n: t * (step + 1) for n, t in full.items()}

    out["stage_group x dp"] = stages
    if world == 4:  # DTensors on a 2-D (dp, tp) mesh: sharded over both dimensions, over one, or replicated
        grid2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def dtensor_2d(step: int):
            placements = {"w": [Shard(0), Shard(1)], "v": [Replicate(), Replicate()], "u": [Replicate(), Shard(0)]}
            return ((_dtensor_params(grid2, placements, full, step + 1), {}),
                    {n: t * (step + 1) for n, t in full.items()})

        out["2-D mesh DTensor"] = dtensor_2d
    return out


def no_host_reads_in_steady_state(rank: int, world: int) -> None:
    """After the first call on a layout, grad_stats makes no host read at all, with group=, with DTensor gradients
    and with pipeline stages x data parallel (a 2x2 mesh on 4 ranks): counted with a dispatch mode on
    aten::_local_scalar_dense and with Tensor.item/tolist/numpy patched. The figures are right at every call."""
    for layout, make in _layouts(rank, world).items():
        for step in range(5):
            (params, kwargs), ref = make(step)
            with AllHostReads() as reads:
                stats = grad_stats(params, **kwargs)
            if step >= 1:
                assert reads.count == 0, f"{layout}, call {step + 1}: {reads.count} host reads"
            rep = stats.report()
            want = math.sqrt(sum(float(t.square().sum()) for t in ref.values()))
            assert abs(rep.total_norm - want) <= 1e-12 * want, (layout, step, rep.total_norm, want)
            assert set(rep.norms) == set(ref), (layout, sorted(rep.norms))


def gradient_gained_at_call_3(rank: int, world: int) -> None:
    """The last rank gains a gradient at call 3 that the agreed layout has no row for: that call's total norm,
    counts and clip coefficient are exact on every rank (the gradient is the "(unattributed)" row); the call after
    a report on every rank has the gradient's own row."""
    gen = torch.Generator().manual_seed(8)
    full = {n: torch.randn(world * 3, generator=gen, dtype=torch.float64) for n in ("a", "b", "late")}
    full["late"][1] = 0.0
    shards = {n: torch.tensor_split(t, world)[rank] for n, t in full.items()}
    for call in range(1, 6):
        holds = ["a", "b"] + (["late"] if call >= 3 and rank == world - 1 else [])
        params = [_plain(n, shards[n]) for n in holds]
        ref = {n: full[n] for n in ("a", "b")}
        if call >= 3:
            ref["late"] = shards["late"] if rank == world - 1 else torch.tensor_split(full["late"], world)[world - 1]
        want = math.sqrt(sum(float(t.square().sum()) for t in ref.values()))
        stats = clip_grad_norm_(params, max_norm=want / 4, group=dist.group.WORLD)
        rep = stats.report()
        assert abs(rep.total_norm - want) <= 1e-12 * want, (call, rep.total_norm, want)
        assert abs(rep.clip_coef - (want / 4) / (want + 1e-6)) <= 1e-12, (call, rep.clip_coef)
        assert rep.zero_count == sum(int((t == 0).sum()) for t in ref.values()), (call, rep.zero_count)
        assert rep.numel == sum(t.numel() for t in ref.values()), (call, rep.numel)
        for name, p in params:  # every gradient was multiplied by the same exact coefficient
            torch.testing.assert_close(p.grad, shards[name] * rep.clip_coef, rtol=1e-12, atol=0)
        rows = {3: ["a", "b", UNATTRIBUTED_ROW]}.get(call, ["a", "b", "late"] if call > 3 else ["a", "b"])
        assert list(rep.norms) == rows, (call, list(rep.norms))
        # the exponent histogram of the whole model counts the unattributed elements too (in both of its forms)
        nonzero = sum(int((t != 0).sum()) for t in ref.values())
        for per_tensor in (False, True):
            hist = grad_stats(params, group=dist.group.WORLD, histogram=True, per_tensor=per_tensor).report()
            assert hist.exponent_histogram is not None and sum(hist.exponent_histogram.counts) == nonzero, call


def one_rank_reports(rank: int, world: int) -> None:
    """Only rank 0 reads its statistics while the last rank gains a gradient: nothing hangs, rank 0's totals are
    exact at every call, and the new gradient stays the "(unattributed)" row (attributing it needs every rank),
    until the other ranks read the layout flags on the step rank 0 reports."""
    gen = torch.Generator().manual_seed(9)
    full = {n: torch.randn(world * 2, generator=gen, dtype=torch.float64) for n in ("x", "y")}
    shards = {n: torch.tensor_split(t, world)[rank] for n, t in full.items()}
    start = time.monotonic()
    for call in range(5):
        holds = ["x"] + (["y"] if call >= 1 and rank == world - 1 else [])
        params = [_plain(n, shards[n]) for n in holds]
        stats = grad_stats(params, group=dist.group.WORLD)
        if rank == 0:
            rep = stats.report()
            want = full["x"].square().sum() + (torch.tensor_split(full["y"], world)[-1].square().sum() if call else 0)
            assert abs(rep.total_norm - math.sqrt(float(want))) <= 1e-12 * rep.total_norm, (call, rep.total_norm)
            assert list(rep.norms) == (["x", UNATTRIBUTED_ROW] if call else ["x"]), (call, list(rep.norms))
    assert time.monotonic() - start < 60.0
    # The other ranks read only the layout flags (GradStats.check_layout) at the step rank 0 reports: the next
    # call has the gradient's own row, on every rank.
    for call in range(2):
        stats = grad_stats(params, group=dist.group.WORLD)
        if call == 0:
            if rank == 0:
                stats.report()
            else:
                stats.check_layout()
        else:
            assert list(stats.report().norms) == ["x", "y"], list(stats.report().norms)


def rank_without_dtensor_gradients(rank: int, world: int) -> None:
    """A rank whose DTensor parameters have no gradient at all still takes part in their mesh's reductions: the
    others' figures are right and nothing hangs."""
    gen = torch.Generator().manual_seed(10)
    full = {"w": torch.randn(world * 2, 3, generator=gen, dtype=torch.float64)}
    mesh = init_device_mesh("cpu", (world,))
    last = rank == world - 1
    for call in range(3):
        params = _dtensor_params(mesh, {"w": [Shard(0)]}, full, without=frozenset({"w"}) if last else frozenset())
        rep = grad_stats(params).report()
        kept = torch.cat(torch.tensor_split(full["w"], world)[: world - 1])
        want = math.sqrt(float(kept.square().sum()))
        assert abs(rep.total_norm - want) <= 1e-12 * want, (call, rep.total_norm, want)


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f for f in (all_reduce_sizes, mesh_2x2_subsets, no_host_reads_in_steady_state,  # type: ignore[misc]
                            gradient_gained_at_call_3, one_rank_reports, rank_without_dtensor_gradients)
}
