"""Worker side of tests/test_distributed_layout.py: ranks that hold different parameters (missing gradients,
pipeline stages, expert parallelism), run by every rank of a gloo process group on the CPU.

Each scenario compares what every rank reports with a single-process float64 reference on the union of the
tensors the ranks hold (see _dist_workers for the scenario protocol).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from _dist_workers import _check_report_equal, _params_with_grads, _seq
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.stats.gradients import grad_stats

try:
    from torch_gradstats.distributed.reduce import is_logging_rank
except ImportError:  # the logging rank is not there yet
    is_logging_rank = None  # type: ignore[assignment]


def _shard_flat(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Near-even flat shards: every rank holds some of every tensor."""
    return torch.tensor_split(t.reshape(-1), world)[rank]


def _full(seed: int, names: list[str]) -> dict[str, torch.Tensor]:
    """One float32 tensor per name, with some exact zeros, and sizes that shard unevenly."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, name in enumerate(names):
        t = torch.randn(5 + 3 * i, generator=gen)
        t[::4] = 0
        out[name] = t
    return out


def _reference(full: dict[str, torch.Tensor]):
    """Single-process report on the whole tensors, in float64."""
    return grad_stats(_params_with_grads([(n, t.double()) for n, t in full.items()])).report()


def _params(named: list[tuple[str, torch.Tensor | None]]):
    """(name, parameter) pairs; a None gradient leaves the parameter without .grad."""
    out = []
    for name, g in named:
        p = torch.nn.Parameter(torch.zeros_like(g) if g is not None else torch.zeros(0))
        p.grad = g
        out.append((name, p))
    return out


def _expect_error(fn: Callable[[], object], *needles: str) -> str:
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
        return str(exc)
    raise AssertionError("no ValueError was raised")


# ---------------------------------------------------------------------------------------------- missing gradients
def missing_grad_one_rank(rank: int, world: int) -> None:
    """A parameter without .grad on some ranks counts as an empty shard there; names and figures equal the
    single-process reference on the union of what the ranks hold, and the steady state costs one SUM and one MAX."""
    pg = dist.group.WORLD
    names = ["a", "b", "c", "d"]
    full = _full(1, names)
    shards = {n: _shard_flat(t, rank, world) for n, t in full.items()}

    # Rank 0 lacks "b" and rank 1 lacks "c": both hold three gradients, so nothing but names tells the rows apart.
    missing = {0: "b", 1: "c"}.get(rank)
    held = {n: t for n, t in shards.items() if n != missing}
    ref_full = {n: torch.cat([_shard_flat(full[n], r, world) for r in range(world) if {0: "b", 1: "c"}.get(r) != n])
                for n in names}
    for call in range(2):
        before = _seq(pg)
        rep = grad_stats(_params([(n, held.get(n)) for n in names]), group=pg).report()
        _check_report_equal(f"missing b/c, call {call}", rep, _reference(ref_full))
        if call == 1:
            assert _seq(pg) - before == 2, f"steady state: {_seq(pg) - before} collectives, expected 2"

    # The last rank holds only "d": the buffers differ in size across ranks.
    held = {"d": shards["d"]} if rank == world - 1 else shards
    ref_full = {n: torch.cat([_shard_flat(full[n], r, world) for r in range(world - 1)]) for n in names}
    ref_full["d"] = full["d"]
    rep = grad_stats(_params([(n, held.get(n)) for n in names]), group=pg).report()
    _check_report_equal("only d on the last rank", rep, _reference(ref_full))

    # Every rank holds everything again: back to the whole tensors.
    rep = grad_stats(_params(list(shards.items())), group=pg).report()
    _check_report_equal("all held", rep, _reference(full))


def rank_without_gradients(rank: int, world: int) -> None:
    """A rank that holds no gradient at all still takes part and reports the others' figures."""
    pg = dist.group.WORLD
    full = _full(2, ["x", "y"])
    owners = range(world - 1)  # the last rank holds nothing
    named = [(n, _shard_flat(t, rank, len(owners))) for n, t in full.items()] if rank in owners else []
    for _ in range(2):
        rep = grad_stats(_params(named), group=pg).report()
        _check_report_equal("rank without gradients", rep, _reference(full))


def irreconcilable_layouts(rank: int, world: int) -> None:
    """The same name with different dtypes raises the same ValueError on every rank, naming it; no hang, and the
    group works afterwards. Unnamed gradients (reduce_across_ranks without names) must match exactly."""
    from torch_gradstats.distributed.reduce import reduce_across_ranks
    from torch_gradstats.ops.op import multi_tensor_stats

    pg = dist.group.WORLD
    full = _full(3, ["ok", "w"])
    named = [(n, _shard_flat(t, rank, world)) for n, t in full.items()]
    grad_stats(_params(named), group=pg)  # agree on a layout first: the conflict then shows up as a change
    if rank == 1:
        named[1] = ("w", named[1][1].double())
    # Only rank 1 changed: the agreed layout has no row for its float64 "w", whose figures count in the totals
    # (as the unattributed row) until a report on every rank has seen the change.
    rep = grad_stats(_params(named), group=pg).report()
    assert "(unattributed)" in rep.norms, list(rep.norms)
    assert math.isclose(rep.total_norm, math.sqrt(sum(float(t.double().square().sum()) for t in full.values())),
                        rel_tol=1e-6), rep.total_norm
    # The next call agrees again, and the conflict is the same ValueError on every rank.
    msg = _expect_error(lambda: grad_stats(_params(named), group=pg), "'w'", "torch.float32", "torch.float64")
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, msg, group=pg)
    assert all(m == msg for m in gathered), f"ranks raised different errors: {gathered}"

    named[1] = ("w", named[1][1].float())
    rep = grad_stats(_params(named), group=pg).report()
    _check_report_equal("after the error", rep, _reference(full))

    # DTensors of one name whose shapes contradict each other (rank 1 claims a larger logical tensor).
    mesh = init_device_mesh("cpu", (world,))
    shape = (world + (1 if rank == 1 else 0), 3)
    local_rows = torch.ones(1 if rank < world - 1 or rank == 1 else 0, 3)
    dt = DTensor.from_local(local_rows, mesh, [Shard(0)], run_check=False, shape=shape, stride=(3, 1))
    p = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local_rows), mesh, [Shard(0)], run_check=False,
                                              shape=shape, stride=(3, 1)))
    p.grad = dt
    msg = _expect_error(lambda: grad_stats([("v", p)]), "'v'", f"shape [{world}, 3]", f"shape [{world + 1}, 3]")
    dist.all_gather_object(gathered, msg, group=pg)
    assert all(m == msg for m in gathered), f"ranks raised different errors: {gathered}"

    # Without names, rows are matched by position only: a different number of gradients is an error everywhere.
    local = [t for _, t in named][: 1 if rank == 0 else 2]
    s, a, c = multi_tensor_stats(local)
    _expect_error(lambda: reduce_across_ranks(local, s, a, c, pg), "different gradient lists", "names=")


def dtensor_missing_grad(rank: int, world: int) -> None:
    """DTensor gradients (Shard(0), FSDP2-like) where one rank lacks one of them."""
    mesh = init_device_mesh("cpu", (world,))
    full = {"p": torch.randn(world + 1, 3), "q": torch.randn(2 * world, 2)}
    dts = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    named = [(n, dts[n] if not (rank == 1 and n == "q") else None) for n in full]
    params = []
    for n, g in named:
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full[n]), mesh, [Shard(0)]))
        p.grad = g
        params.append((n, p))
    ref = dict(full)
    ref["q"] = torch.cat([torch.chunk(full["q"], world)[r] for r in range(world) if r != 1])
    for _ in range(2):
        rep = grad_stats(params).report()
        _check_report_equal("dtensor, q missing on rank 1", rep, _reference(ref), check_numel=False)


# ---------------------------------------------------------------------------------------------- pipeline stages
def _stage_groups(world: int):
    """(stage group, shard group within the stage, stage index, stage count): two stages of world/2 ranks each
    on 4 ranks (the stage's tensors sharded over its ranks), two stages of one rank on 2."""
    if world == 2:
        return dist.group.WORLD, None, dist.get_rank(), 2
    rank = dist.get_rank()
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in the same order
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return pp[rank % 2], dp[rank // 2], rank // 2, 2


def pipeline_stages(rank: int, world: int) -> None:
    """stage_group: every rank reports all stages' parameters; a name on two stages gets a stage suffix, or is
    counted once when declared tied; one SUM and one MAX per group in steady state."""
    pp, dp, stage, n_stages = _stage_groups(world)
    shard_world = 1 if dp is None else dist.get_world_size(dp)
    shard_rank = 0 if dp is None else dist.get_rank(dp)
    full = _full(4, ["emb0", "layers.0.w", "layers.1.w", "emb1"])
    held = {0: {"emb": full["emb0"], "layers.0.w": full["layers.0.w"]},
            1: {"layers.1.w": full["layers.1.w"], "emb": full["emb1"]}}[stage]
    named = [(n, _shard_flat(t, shard_rank, shard_world)) for n, t in held.items()]
    ref = {"emb@stage0": full["emb0"], "layers.0.w": full["layers.0.w"], "layers.1.w": full["layers.1.w"],
           "emb@stage1": full["emb1"]}
    for call in range(2):
        b_pp, b_dp = _seq(pp), (_seq(dp) if dp is not None else 0)
        rep = grad_stats(_params(named), group=dp, stage_group=pp).report()
        _check_report_equal(f"stages, call {call}", rep, _reference(ref))
        if call == 1:
            assert _seq(pp) - b_pp == 2, f"stage group: {_seq(pp) - b_pp} collectives, expected 2"
            if dp is not None:
                assert _seq(dp) - b_dp == 2, f"shard group: {_seq(dp) - b_dp} collectives, expected 2"

    # A gradient missing on one rank of a stage (4 ranks: rank 3, stage 1): that stage's other shard only.
    if dp is not None:
        lacking = rank == 3
        named_missing = [(n, None if (lacking and n == "layers.1.w") else t) for n, t in named]
        ref_missing = dict(ref, **{"layers.1.w": _shard_flat(full["layers.1.w"], 0, 2)})
        for call in range(2):
            rep = grad_stats(_params(named_missing), group=dp, stage_group=pp).report()
            _check_report_equal(f"stages, layers.1.w missing on rank 3, call {call}", rep, _reference(ref_missing))

    # Tied: both stages hold the same gradient (as after Megatron's embedding all-reduce): one row per stage, the
    # whole model's figures count it once (tests/_dist_pipeline_workers.py checks copies that differ).
    tied_held = dict(held, emb=full["emb0"])
    named = [(n, _shard_flat(t, shard_rank, shard_world)) for n, t in tied_held.items()]
    ref = {"emb": full["emb0"], "layers.0.w": full["layers.0.w"], "layers.1.w": full["layers.1.w"]}
    for call in range(2):
        rep = grad_stats(_params(named), group=dp, stage_group=pp, tied={"emb"}).report()
        assert list(rep.norms) == ["emb@stage0", "layers.0.w", "layers.1.w", "emb@stage1"], list(rep.norms)
        assert rep.norms["emb@stage0"] == rep.norms["emb@stage1"]
        ref_rep = _reference(ref)
        assert math.isclose(rep.total_norm, ref_rep.total_norm, rel_tol=1e-5), (rep.total_norm, ref_rep.total_norm)
        assert (rep.numel, rep.zero_count) == (ref_rep.numel, ref_rep.zero_count), f"tied, call {call}"
    assert n_stages == 2


def pipeline_stages_dtensor(rank: int, world: int) -> None:
    """stage_group with FSDP2-like DTensor gradients inside each stage (a 2-D ("pp", "dp") mesh)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage, dp_mesh, pp = mesh.get_coordinate()[0], mesh["dp"], mesh.get_group("pp")
    gen = torch.Generator().manual_seed(7)
    full = {f"layers.{s}.{k}": torch.randn(world + 1 + s, 3, generator=gen) for s in range(2) for k in ("w", "b")}
    params = []
    for name, t in full.items():
        if name.startswith(f"layers.{stage}."):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(t), dp_mesh, [Shard(0)]))
            p.grad = distribute_tensor(t, dp_mesh, [Shard(0)])
            params.append((name, p))
    for call in range(2):
        b_pp = _seq(pp)
        rep = grad_stats(params, stage_group=pp).report()
        _check_report_equal(f"stages with DTensors, call {call}", rep, _reference(full))
        if call == 1:
            assert _seq(pp) - b_pp == 2, f"stage group: {_seq(pp) - b_pp} collectives, expected 2"


# ---------------------------------------------------------------------------------------------- experts
def expert_parallel(rank: int, world: int) -> None:
    """expert_group: expert parameters are reduced over the expert group, dense ones over group; one SUM and one
    MAX per distinct group (on 2 ranks both are the whole world: one pair in total)."""
    if world == 2:
        ep, ep_rank, ep_world = dist.group.WORLD, rank, 2
    else:
        eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # two expert-parallel replicas
        ep, ep_rank, ep_world = eps[rank // 2], rank % 2, 2
    dense = _full(5, ["embed", "out"])
    experts = _full(6, ["moe.experts.w1", "moe.experts.w2"])
    named = [(n, _shard_flat(t, rank, world)) for n, t in dense.items()]
    named += [(n, _shard_flat(t, ep_rank, ep_world)) for n, t in experts.items()]
    pg = dist.group.WORLD
    for call in range(2):
        b_pg, b_ep = _seq(pg), _seq(ep)
        rep = grad_stats(
            _params(named), group=pg, expert_group=ep, is_expert=lambda name: ".experts." in name
        ).report()
        _check_report_equal(f"experts, call {call}", rep, _reference({**dense, **experts}))
        if call == 1:
            if ep is pg:
                assert _seq(pg) - b_pg == 2, f"one group: {_seq(pg) - b_pg} collectives, expected 2"
            else:
                assert (_seq(pg) - b_pg, _seq(ep) - b_ep) == (2, 2), (_seq(pg) - b_pg, _seq(ep) - b_ep)


def rows_agree_for_any_holdings(rank: int, world: int) -> None:
    """Ranks holding random subsets of eight parameters (some none, some disjoint from the others): every rank
    reports the same rows, in an order that keeps each rank's own order (it once put a rank's own order first, so a
    rank whose list showed p0 before p3 reported them in another order than the others), with the figures of all."""
    import random

    names = [f"p{i}" for i in range(8)]
    rng = random.Random(world)
    for trial in range(10):
        holdings = [sorted(rng.sample(range(8), rng.randint(0, 4))) for _ in range(world)]
        mine = [(names[i], torch.full((3,), float(i + 1))) for i in holdings[rank]]
        grad_stats(_params(mine), group=dist.group.WORLD).report()  # a change of holdings: agreed after a report
        rows = list(grad_stats(_params(mine), group=dist.group.WORLD).report().norms)
        seen: list[object] = [None] * world
        dist.all_gather_object(seen, rows)
        assert all(r == rows for r in seen), f"trial {trial} {holdings}: rows {seen}"
        assert set(rows) == {names[i] for held in holdings for i in held}, (holdings, rows)
        for held in holdings:
            assert [n for n in rows if n in {names[i] for i in held}] == [names[i] for i in held], (held, rows)


# ---------------------------------------------------------------------------------------------- logging rank
def logging_rank(rank: int, world: int) -> str | None:
    """One rank logs: the last stage's first shard rank under pipeline parallelism, rank 0 otherwise, or the
    user's choice."""
    if is_logging_rank is None:
        return "skip: is_logging_rank not available"
    pp, dp, stage, n_stages = _stage_groups(world)
    flags: list[object] = [None] * world
    chosen = (
        is_logging_rank(pp, group=dp),
        is_logging_rank(),
        is_logging_rank(pp, group=dp, rank=1),
    )
    dist.all_gather_object(flags, chosen)
    expected_pp = 1 if world == 2 else 2  # world 4: ranks 2 and 3 are the last stage, 2 is first in its group
    assert [r for r in range(world) if flags[r][0]] == [expected_pp], flags
    assert [r for r in range(world) if flags[r][1]] == [0], flags
    assert [r for r in range(world) if flags[r][2]] == [1], flags
    _expect_error(lambda: is_logging_rank(rank=world), "rank must be in")
    assert stage == dist.get_rank(pp) and n_stages == dist.get_world_size(pp)
    return None


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f
    for f in (
        missing_grad_one_rank,
        rank_without_gradients,
        irreconcilable_layouts,
        dtensor_missing_grad,
        pipeline_stages,
        pipeline_stages_dtensor,
        expert_parallel,
        rows_agree_for_any_holdings,
        logging_rank,
    )
}
