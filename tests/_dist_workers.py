"""Worker side of tests/test_distributed.py: scenarios run by every rank of a gloo process group on the CPU.

Kept out of the test module because multiprocessing (spawn/forkserver) re-imports the worker's module in each child.
Each scenario is a function ``(rank, world) -> None | str``: it raises AssertionError on a wrong result, returns
None when every check passed, or a string starting with "skip:" when it cannot run here. :func:`run_worker` runs the
scenarios in order and writes one JSON file per rank with each scenario's outcome.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.distributed.reduce import reduce_across_ranks
from torch_gradstats.ops.op import INF, NAN, multi_tensor_stats

try:
    from torch_gradstats.stats.gradients import grad_stats
except ImportError:  # the Python layer is not there yet
    grad_stats = None  # type: ignore[assignment]

# The op accumulates 16/32-bit inputs to within 1e-5 of float64 (docs/design.md); splitting a tensor changes the order.
RTOL = 1e-5


# ---------------------------------------------------------------------------------------------- helpers
def _seq(pg) -> int:
    """Collectives issued so far on ``pg`` (gloo counts every collective in C++, whoever calls it)."""
    return pg._get_sequence_number_for_group()


def _uneven_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """Split n elements over world ranks unevenly: rank r < world-1 gets a share growing with r, the last none."""
    weights = [r + 1 for r in range(world - 1)] + [0]
    sizes = [n * w // sum(weights) for w in weights]
    sizes[0] += n - sum(sizes)
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    assert sizes[-1] == 0 and sum(sizes) == n
    return bounds


def _shard_flat(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    lo, hi = _uneven_bounds(t.numel(), world)[rank]
    return t.reshape(-1)[lo:hi]


def _check_stats(what: str, got: tuple, full: list[torch.Tensor]) -> None:
    """got = reduce_across_ranks(...) (or any (sumsq, amax, counts, ...)); full = the whole logical tensors."""
    ref_s, ref_a, ref_c = multi_tensor_stats(full)
    sumsq, amax, counts = got[0], got[1], got[2]
    torch.testing.assert_close(sumsq, ref_s, rtol=RTOL, atol=0, equal_nan=True, msg=lambda m: f"{what} sumsq: {m}")
    # max is independent of the order: exact
    torch.testing.assert_close(amax, ref_a, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what} amax: {m}")
    assert torch.equal(counts, ref_c), f"{what} counts: {counts.tolist()} != {ref_c.tolist()}"


def _check_report_equal(what: str, got, ref, *, check_numel: bool = True) -> None:
    """Two GradReports describe the same gradients (norms to RTOL, everything else exactly)."""
    for key in ("total_norm", "inf_norm", "max_norm", "min_norm"):
        a, b = getattr(got, key), getattr(ref, key)
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RTOL), f"{what} {key}: {a} != {b}"
    assert list(got.norms) == list(ref.norms), f"{what} names: {list(got.norms)} != {list(ref.norms)}"
    for name in ref.norms:
        a, b = got.norms[name], ref.norms[name]
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=RTOL), f"{what} norm {name}: {a} != {b}"
    for key in ("zero_count", "nan_count", "inf_count", "nonfinite", "first_nonfinite"):
        assert getattr(got, key) == getattr(ref, key), f"{what} {key}: {getattr(got, key)} != {getattr(ref, key)}"
    if check_numel:
        assert got.numel == ref.numel, f"{what} numel: {got.numel} != {ref.numel}"
        assert math.isclose(got.zero_fraction, ref.zero_fraction, rel_tol=1e-12), f"{what} zero_fraction"


def _params_with_grads(named_grads: list[tuple[str, torch.Tensor]]) -> list[tuple[str, nn.Parameter]]:
    out = []
    for name, g in named_grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g
        out.append((name, p))
    return out


def _test_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    """A few gradients of mixed dtypes and shapes, with some exact zeros."""
    a = torch.randn(7, 5, generator=gen)
    a[0, :3] = 0
    b = torch.randn(11, generator=gen, dtype=torch.float64)
    c = (torch.randn(3, 4, generator=gen) * 3).to(torch.bfloat16)
    c[2, 1] = 0
    return [a, b, c]


# ---------------------------------------------------------------------------------------------- scenarios
def plain_uneven_shards(rank: int, world: int) -> None:
    """Plain tensors split unevenly over the group (last rank empty) give the whole tensors' statistics."""
    full = _test_tensors(torch.Generator().manual_seed(1))
    local = [_shard_flat(t, rank, world) for t in full]
    assert local[0].numel() > 0 or rank == world - 1
    if rank == world - 1:
        assert all(t.numel() == 0 for t in local)
    s, a, c = multi_tensor_stats(local)
    pg = dist.group.WORLD
    reduce_across_ranks(local, s, a, c, pg)  # warm-up: the first call on a layout exchanges it
    before = _seq(pg)
    got = reduce_across_ranks(local, s, a, c, pg)
    assert _seq(pg) - before == 2, f"expected one SUM and one MAX collective, saw {_seq(pg) - before}"
    _check_stats("uneven", got, full)
    assert got.rank_nonfinite.shape == (len(full),) and got.rank_nonfinite.dtype == torch.int64
    assert (got.rank_nonfinite == -1).all(), f"no non-finite values, rank_nonfinite={got.rank_nonfinite.tolist()}"
    assert got.numel.tolist() == [t.numel() for t in full], f"numel {got.numel.tolist()}"
    # inputs untouched
    torch.testing.assert_close((s, a, c), tuple(multi_tensor_stats(local)), rtol=0, atol=0)

    if world >= 4:
        # Two independent logical sets, each sharded over a 2-rank subgroup: global ranks name the columns.
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = rank // 2
        pg2 = groups[pair]
        full2 = _test_tensors(torch.Generator().manual_seed(10 + pair))
        local2 = [_shard_flat(t, rank % 2, 2) for t in full2]
        s2, a2, c2 = multi_tensor_stats(local2)
        reduce_across_ranks(local2, s2, a2, c2, pg2)  # warm-up: the first call on a layout exchanges it
        before = _seq(pg2)
        got2 = reduce_across_ranks(local2, s2, a2, c2, pg2)
        assert _seq(pg2) - before == 2
        _check_stats(f"subgroup {pair}", got2, full2)
        assert got2.rank_nonfinite.shape == (len(full2),)
        # a group this rank is not in is a clear error, not a silent local result
        try:
            reduce_across_ranks(local2, s2, a2, c2, groups[1 - pair])
        except ValueError as exc:
            assert "not a member" in str(exc), exc
        else:
            raise AssertionError("a group without this rank was accepted")

    # a 1-D DeviceMesh is accepted as the group
    mesh = init_device_mesh("cpu", (world,))
    got3 = reduce_across_ranks(local, s, a, c, mesh)
    _check_stats("uneven, mesh as group", got3, full)


def plain_uneven_grad_stats(rank: int, world: int) -> str | None:
    """The same, end to end through grad_stats(group=...): the report equals the single-process one."""
    if grad_stats is None:
        return "skip: torch_gradstats.stats.gradients.grad_stats not available"
    full = _test_tensors(torch.Generator().manual_seed(2))
    names = ["a", "b", "c"]
    local = [_shard_flat(t, rank, world) for t in full]
    pg = dist.group.WORLD
    grad_stats(_params_with_grads(list(zip(names, local))), group=pg)  # warm-up: the first call exchanges layouts
    before = _seq(pg)
    stats = grad_stats(_params_with_grads(list(zip(names, local))), group=pg)
    rep = stats.report()
    assert _seq(pg) - before == 2, f"grad_stats issued {_seq(pg) - before} collectives, expected 2"
    ref = grad_stats(_params_with_grads(list(zip(names, full)))).report()
    _check_report_equal("grad_stats(group)", rep, ref, check_numel=False)
    assert rep.nonfinite_ranks == {}


def plain_group_numel(rank: int, world: int) -> str | None:
    """grad_stats(group=...) reports the logical numel of plain sharded tensors (it travels in the SUM collective)."""
    if grad_stats is None:
        return "skip: torch_gradstats.stats.gradients.grad_stats not available"
    full = _test_tensors(torch.Generator().manual_seed(3))
    local = [_shard_flat(t, rank, world) for t in full]
    stats = grad_stats(_params_with_grads(list(zip("abc", local))), group=dist.group.WORLD)
    rep = stats.report()
    ref = grad_stats(_params_with_grads(list(zip("abc", full)))).report()
    _check_report_equal("grad_stats(group) numel", rep, ref, check_numel=True)


def dtensor_1d(rank: int, world: int) -> None:
    """Shard(0) (last rank empty), Shard(1) (uneven) and Replicate() gradients on a 1-D mesh."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(4)
    full = [
        torch.randn(world - 1, 3, generator=gen),  # Shard(0): the last rank holds 0 rows
        torch.randn(4, 2 * world + 1, generator=gen, dtype=torch.float64),  # Shard(1): uneven
        torch.randn(5, generator=gen),  # Replicate: must not be counted world times
        torch.randn((), generator=gen, dtype=torch.float64),  # 0-d, replicated
    ]
    full[0][0, 0] = 0
    placements = [Shard(0), Shard(1), Replicate(), Replicate()]
    grads = [distribute_tensor(t, mesh, [pl]) for t, pl in zip(full, placements)]
    if rank == world - 1:
        assert grads[0].to_local().numel() == 0
    local = [g.to_local() for g in grads]
    s, a, c = multi_tensor_stats(local)
    pg = mesh.get_group(0)
    reduce_across_ranks(grads, s, a, c, None)  # warm-up: the first call on a layout exchanges it
    before = _seq(pg)
    got = reduce_across_ranks(grads, s, a, c, None)
    assert _seq(pg) - before == 2, f"expected 2 collectives on the mesh group, saw {_seq(pg) - before}"
    _check_stats("dtensor 1-D", got, full)
    assert got.numel.tolist() == [t.numel() for t in full]
    # grads untouched
    assert all(g.placements == (pl,) for g, pl in zip(grads, placements))

    if grad_stats is not None:
        names = ["w0", "w1", "b", "s"]
        params = []
        for name, t, g in zip(names, full, grads):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, list(g.placements)))
            p.grad = g
            params.append((name, p))
        grad_stats(params)  # warm-up: the first call on a layout exchanges it
        before = _seq(pg)
        rep = grad_stats(params).report()
        assert _seq(pg) - before == 2, f"grad_stats issued {_seq(pg) - before} collectives, expected 2"
        ref = grad_stats(_params_with_grads(list(zip(names, full)))).report()
        _check_report_equal("grad_stats dtensor 1-D", rep, ref)


def dtensor_2d(rank: int, world: int) -> None:
    """2-D mesh (replicate, shard), HSDP-like, plus gradients sharded over both dimensions."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    n_shard = world // 2
    gen = torch.Generator().manual_seed(5)
    full = [
        torch.randn(2 * n_shard + 1, 3, generator=gen),  # HSDP: Replicate over dim 0, Shard(0) over dim 1
        torch.randn(6, generator=gen),  # replicated over both
        torch.randn(3, 5, generator=gen, dtype=torch.float64),  # sharded over both
        torch.randn(2, 3, generator=gen),  # sharded over the "replicate" dimension only
    ]
    placements = [
        (Replicate(), Shard(0)),
        (Replicate(), Replicate()),
        (Shard(0), Shard(1)),
        (Shard(1), Replicate()),
    ]
    grads = [distribute_tensor(t, mesh, list(pl)) for t, pl in zip(full, placements)]
    local = [g.to_local() for g in grads]
    s, a, c = multi_tensor_stats(local)
    pg0, pg1 = mesh.get_group(0), mesh.get_group(1)
    reduce_across_ranks(grads, s, a, c, None)  # warm-up: the first call on a layout exchanges it
    b0, b1 = _seq(pg0), _seq(pg1)
    got = reduce_across_ranks(grads, s, a, c, None)
    assert _seq(pg0) - b0 == 2, f"mesh dim 0: {_seq(pg0) - b0} collectives, expected 2"
    expected1 = 2 if n_shard > 1 else 0  # a group of one rank is skipped
    assert _seq(pg1) - b1 == expected1, f"mesh dim 1: {_seq(pg1) - b1} collectives, expected {expected1}"
    _check_stats("dtensor 2-D", got, full)
    assert got.numel.tolist() == [t.numel() for t in full]

    if grad_stats is not None:
        names = ["hsdp", "rep", "both", "dim0"]
        params = []
        for name, t, g in zip(names, full, grads):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, list(g.placements)))
            p.grad = g
            params.append((name, p))
        rep = grad_stats(params).report()
        ref = grad_stats(_params_with_grads(list(zip(names, full)))).report()
        _check_report_equal("grad_stats dtensor 2-D", rep, ref)


def dtensor_partial(rank: int, world: int) -> None:
    """Partial gradients: local tensors are addends; the result describes their sum, a NaN addend names its rank."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(6)
    # Integers times world, so every addend (full / world) and every sum is exact in float64.
    full = [
        torch.randint(-8, 8, (5, 3), generator=gen).to(torch.float64) * world,
        torch.randint(-8, 8, (), generator=gen).to(torch.float64) * world + world,  # 0-d, nonzero
        torch.randint(-8, 8, (world + 1,), generator=gen).to(torch.float64) * world,
    ]
    addends = [t / world for t in full]
    bad = world - 1
    if rank == bad:
        addends[2][1] = float("nan")
    full[2][1] = float("nan")
    grads = [DTensor.from_local(x.clone(), mesh, [Partial()], run_check=False) for x in addends]
    local = [g.to_local() for g in grads]
    s, a, c = multi_tensor_stats(local)
    naive = (s * world)[0].item()
    got = reduce_across_ranks(grads, s, a, c, None)
    _check_stats("partial", got, full)
    assert got[0][0].item() != naive, "sum of squares of addends is not the square of the sum"
    assert got.numel.tolist() == [t.numel() for t in full]
    expected = torch.tensor([-1, -1, bad])
    assert torch.equal(got.rank_nonfinite, expected), (
        f"rank_nonfinite {got.rank_nonfinite.tolist()}, expected {expected.tolist()}"
    )
    # the gradients are still Partial and their addends unchanged
    for g, x in zip(grads, addends):
        assert g.placements == (Partial(),)
        torch.testing.assert_close(g.to_local(), x, rtol=0, atol=0, equal_nan=True)


def nan_on_one_rank(rank: int, world: int) -> None:
    """A NaN on one rank and an Inf on another are reported by every rank, with the rank named."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(6, 4, generator=gen), torch.randn(9, generator=gen), torch.randn(world, 2, generator=gen)]
    nan_rank, inf_rank = 1, 0
    # near-even shards (every rank holds some), planted at the first element each named rank holds
    full[0].view(-1)[full[0].numel() // world] = float("nan")  # ceil-split: rank 1 starts at or before this
    full[1].view(-1)[0] = float("-inf")  # rank 0
    full[2][world - 1, 0] = float("nan")  # Shard(0) row world-1 lives on the last rank
    local = [torch.tensor_split(full[0].view(-1), world)[rank], torch.tensor_split(full[1].view(-1), world)[rank]]
    assert (local[0].isnan().sum().item() == 1) == (rank == nan_rank)
    dt = distribute_tensor(full[2], mesh, [Shard(0)])
    grads = local + [dt]
    s, a, c = multi_tensor_stats(local + [dt.to_local()])
    pg = dist.group.WORLD
    reduce_across_ranks(grads, s, a, c, pg)  # warm-up: the first call on a layout exchanges it
    before = _seq(pg)
    # plain tensors over the group and a DTensor over the mesh: the same process group, so one SUM and one MAX
    got = reduce_across_ranks(grads, s, a, c, pg)
    assert _seq(pg) - before == 2, f"{_seq(pg) - before} collectives, expected 2"
    _check_stats("nan", got, full)
    assert math.isnan(got[0][0].item()) and math.isnan(got[1][0].item())
    assert got[0][1].item() == math.inf and got[1][1].item() == math.inf
    assert got[2][0, NAN].item() == 1 and got[2][1, INF].item() == 1 and got[2][2, NAN].item() == 1
    expected = torch.tensor([nan_rank, inf_rank, world - 1])  # the lowest rank that held one
    assert torch.equal(got.rank_nonfinite, expected), (
        f"rank_nonfinite {got.rank_nonfinite.tolist()}, expected {expected.tolist()}"
    )

    if grad_stats is not None:
        params = _params_with_grads([("p0", local[0]), ("p1", local[1])])
        p2 = nn.Parameter(distribute_tensor(torch.zeros_like(full[2]), mesh, [Shard(0)]))
        p2.grad = dt
        rep = grad_stats(params + [("p2", p2)], group=pg).report()
        assert rep.nonfinite_ranks == {"p0": [nan_rank], "p1": [inf_rank], "p2": [world - 1]}, rep.nonfinite_ranks
        assert rep.nonfinite == ["p0", "p1", "p2"] and rep.first_nonfinite == "p0"
        assert rep.nan_count == 2 and rep.inf_count == 1
        assert math.isnan(rep.total_norm)


def ddp_no_collective(rank: int, world: int) -> str | None:
    """DDP-wrapped model: grad_stats without a group equals the single-process report and issues no collective."""
    if grad_stats is None:
        return "skip: torch_gradstats.stats.gradients.grad_stats not available"
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(8)
    ref_model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.load_state_dict(ref_model.state_dict())
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4 * world, 6, generator=gen)
    y = torch.randn(4 * world, 3, generator=gen)
    part = slice(4 * rank, 4 * (rank + 1))
    nn.functional.mse_loss(ddp(x[part]), y[part]).backward()  # DDP averages the gradients over ranks
    nn.functional.mse_loss(ref_model(x), y).backward()

    pg = dist.group.WORLD
    calls = []
    patched = {}
    for fn in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):
        orig = getattr(dist, fn)
        patched[fn] = orig

        def wrapper(*args, _fn=fn, _orig=orig, **kwargs):
            calls.append(_fn)
            return _orig(*args, **kwargs)

        setattr(dist, fn, wrapper)
    before = _seq(pg)
    try:
        stats = grad_stats(ddp.module.named_parameters())
        rep = stats.report()
    finally:
        for fn, orig in patched.items():
            setattr(dist, fn, orig)
    assert _seq(pg) == before, f"grad_stats issued {_seq(pg) - before} collectives under DDP"
    assert not calls, f"grad_stats called {calls} under DDP"
    assert stats.rank_nonfinite is None
    ref = grad_stats(ref_model.named_parameters()).report()
    _check_report_equal("ddp", rep, ref)
    assert rep.nan_count == 0 and rep.nonfinite_ranks == {}


def clip_dtensor(rank: int, world: int) -> str | None:
    """clip_grad_norm_ on DTensor gradients clips by the global norm, like torch.nn.utils.clip_grad_norm_."""
    try:
        from torch_gradstats.policies.clip import clip_grad_norm_
    except ImportError:
        return "skip: torch_gradstats.policies.clip not available"
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(world + 1, 3, generator=gen), torch.randn(4, generator=gen)]
    placements = [Shard(0), Replicate()]

    def make():
        params = []
        for i, (t, pl) in enumerate(zip(full, placements)):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, [pl]))
            p.grad = distribute_tensor(t.clone(), mesh, [pl])
            params.append((f"p{i}", p))
        return params

    ours, theirs = make(), make()
    stats = clip_grad_norm_(ours, max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for _, p in theirs], max_norm=0.5)
    ref_norm = ref_norm.full_tensor() if isinstance(ref_norm, DTensor) else ref_norm
    single = math.sqrt(sum(float(t.double().pow(2).sum()) for t in full))
    assert math.isclose(stats.clip_norm.item(), single, rel_tol=RTOL), (stats.clip_norm.item(), single)
    assert math.isclose(stats.clip_norm.item(), ref_norm.item(), rel_tol=RTOL), (stats.clip_norm.item(), ref_norm)
    for (name, p), (_, q) in zip(ours, theirs):
        assert isinstance(p.grad, DTensor) and p.grad.placements == q.grad.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-6, atol=0)


def fsdp2_model(rank: int, world: int) -> str | None:
    """FSDP2 (fully_shard) on CPU: grad_stats of the sharded model equals the single-process full-batch report."""
    if grad_stats is None:
        return "skip: torch_gradstats.stats.gradients.grad_stats not available"
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return "skip: torch.distributed.fsdp.fully_shard not available"
    torch.manual_seed(12)
    # world + 1 output rows: uneven Shard(0) gradients
    ref_model = nn.Sequential(nn.Linear(6, 2 * world + 1), nn.Tanh(), nn.Linear(2 * world + 1, 3))
    model = nn.Sequential(nn.Linear(6, 2 * world + 1), nn.Tanh(), nn.Linear(2 * world + 1, 3))
    model.load_state_dict(ref_model.state_dict())
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4 * world, 6, generator=gen)
    y = torch.randn(4 * world, 3, generator=gen)
    part = slice(4 * rank, 4 * (rank + 1))
    nn.functional.mse_loss(model(x[part]), y[part]).backward()  # FSDP2 averages the gradient shards over ranks
    nn.functional.mse_loss(ref_model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(isinstance(g, DTensor) and g.placements == (Shard(0),) for g in grads), [type(g) for g in grads]
    pg = mesh.get_group(0)
    grad_stats(model.named_parameters())  # warm-up: the first call on a layout exchanges it
    before = _seq(pg)
    rep = grad_stats(model.named_parameters()).report()
    assert _seq(pg) - before == 2, f"grad_stats issued {_seq(pg) - before} collectives, expected 2"
    ref = grad_stats(ref_model.named_parameters()).report()
    _check_report_equal("fsdp2", rep, ref)


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f
    for f in (
        plain_uneven_shards,
        plain_uneven_grad_stats,
        plain_group_numel,
        dtensor_1d,
        dtensor_2d,
        dtensor_partial,
        nan_on_one_rank,
        ddp_no_collective,
        clip_dtensor,
        fsdp2_model,
    )
}


def run_worker(
    rank: int, world: int, port: int, outdir: str, timeout_s: float, scenarios_module: str = "_dist_workers"
) -> None:
    """Entry point of each spawned rank: run every scenario of ``scenarios_module`` (its SCENARIOS), recording
    outcomes in ``outdir/rank{rank}.json``."""
    import importlib

    scenarios: dict[str, Callable[[int, int], str | None]] = importlib.import_module(scenarios_module).SCENARIOS
    torch.set_num_threads(1)
    results: dict[str, dict[str, str]] = {}
    path = os.path.join(outdir, f"rank{rank}.json")
    start = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results["init_process_group"] = {"status": "info", "seconds": f"{time.perf_counter() - start:.3f}"}
    try:
        for name, fn in scenarios.items():
            start = time.perf_counter()
            try:
                outcome = fn(rank, world)
                if isinstance(outcome, str) and outcome.startswith("skip:"):
                    results[name] = {"status": "skip", "detail": outcome[5:].strip()}
                else:
                    results[name] = {"status": "ok", "detail": ""}
            except Exception:  # noqa: BLE001 - recorded, reported by the test of this scenario
                results[name] = {"status": "fail", "detail": traceback.format_exc()}
            results[name]["seconds"] = f"{time.perf_counter() - start:.3f}"
            with open(path, "w") as f:  # after every scenario: a later hang keeps what came before
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads can abort a finished process ("terminate called
    # without an active exception"); every result is already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
