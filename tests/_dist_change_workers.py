"""Worker side of tests/test_distributed_changes.py: layouts that change between calls, with no host read in steady
state (docs/distributed.md): rows without names, tied copies gained late, tied names given on some ranks only, the
order of the rows, clip_grad_norm_ with statistics given, the report's per-parameter summaries, pipelines.

Each scenario is ``(rank, world) -> None | str`` as in tests/_dist_workers.py (whose run_worker runs them).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from _dist_layout_workers import _expect_error
from _host_reads import AllHostReads
from torch import nn

from torch_gradstats import AdaptiveClip, clip_grad_norm_, grad_stats
from torch_gradstats.distributed.reduce import reduce_across_ranks
from torch_gradstats.monitors.updates import grad_and_weight_stats
from torch_gradstats.ops.op import multi_tensor_stats
from torch_gradstats.stats.gradients import UNATTRIBUTED_ROW


def _p(name: str, grad: torch.Tensor | None, weight: torch.Tensor | None = None) -> tuple[str, nn.Parameter]:
    p = nn.Parameter(weight.clone() if weight is not None else torch.zeros_like(grad))
    p.grad = None if grad is None else grad.clone()
    return name, p


def _sumsq(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().square().sum()) for t in tensors)


def unnamed_rows_raise_at_once(rank: int, world: int) -> None:
    """Rows without names are matched by position, so a rank whose list changes makes every rank raise in that
    same call (they all read the check row), also through grad_and_weight_stats; nothing is mixed up."""
    pg = dist.group.WORLD
    base = [torch.full((4,), 1.0), torch.full((3,), 2.0)]
    s, a, c = multi_tensor_stats(base)
    reduce_across_ranks(base, s, a, c, pg)  # agreed
    longer = base + [torch.full((2,), 3.0)] if rank == 1 else base
    s, a, c = multi_tensor_stats(longer)
    _expect_error(lambda: reduce_across_ranks(longer, s, a, c, pg), "different gradient lists", "names=")
    got = reduce_across_ranks(base, *multi_tensor_stats(base), pg)  # and the group works afterwards
    assert got.sumsq.tolist() == [4.0 * world, 12.0 * world], got.sumsq.tolist()

    params = [_p(n, torch.full((2,), 1.0 + i), torch.full((2,), 10.0)) for i, n in enumerate("abc")]
    grad_and_weight_stats(params, group=pg)
    if rank == 1:
        params[1][1].grad = None  # a weight's row would take the place of a gradient's
    _expect_error(lambda: grad_and_weight_stats(params, group=pg), "different gradient lists")


def tied_copy_gained_late(rank: int, world: int) -> str | None:
    """Pipeline stages with a tied embedding: the later stage gains its copy's gradient after the first call. The
    totals count the embedding once (from the lowest stage) in that call too; the call after a report on every
    rank lists each stage's copy."""
    if world != 2:
        return "skip: two stages of one rank"
    pp = dist.group.WORLD
    emb0, emb1, a, b = torch.full((4,), 1.0), torch.full((4,), 10.0), torch.full((3,), 2.0), torch.full((2,), 3.0)
    want = math.sqrt(_sumsq([emb0, a, b]))
    for call in range(3):
        if rank == 0:
            params = [_p("emb", emb0), _p("a", a)]
        else:
            params = ([_p("emb", emb1)] if call >= 1 else []) + [_p("b", b)]
        stats = clip_grad_norm_(params, max_norm=1.0, stage_group=pp, tied={"emb"})
        rep = stats.report()
        assert math.isclose(rep.total_norm, want, rel_tol=1e-12), (call, rep.total_norm, want)
        assert math.isclose(rep.clip_coef, 1.0 / (want + 1e-6), rel_tol=1e-12), (call, rep.clip_coef)
        rows = ["emb@stage0", "a", "emb@stage1", "b"] if call == 2 else ["emb", "a", "b"]
        assert list(rep.norms) == rows, (call, list(rep.norms))
    return None


def tied_names_on_some_ranks(rank: int, world: int) -> None:
    """One rank declares tied names, the others do not, and calls without them alternate with calls with them:
    nothing hangs (a rank alone never starts an exchange) and the totals are right."""
    pp = dist.group.WORLD
    v = torch.full((4,), float(rank + 1))
    params = [_p("emb", v), _p(f"own{rank}", torch.full((2,), 1.0))]
    want = math.sqrt(sum(16.0 * (r + 1) ** 2 + 2.0 for r in range(world)))
    for _ in range(3):
        t1 = grad_stats(params, stage_group=pp, tied={"emb"} if rank == world - 1 else ()).total_norm
        t2 = clip_grad_norm_(params, max_norm=1e9, stage_group=pp).clip_norm
        for total in (t1, t2):  # before the groups agree on the tied names, every copy counts
            assert total is not None and float(total) <= want * (1 + 1e-12), (float(total), want)


def row_order_after_a_change(rank: int, world: int) -> None:
    """A rank's holdings change while the group's layout does not yet follow: every rank still reports the rows
    in one order, and each row's figures are right."""
    pg = dist.group.WORLD
    v = {"p1": 1.0, "p2": 2.0, "p3": 3.0, "p4": 4.0}
    for call in range(3):
        held = ["p2", "p4"] if rank == 0 else (["p1", "p3"] if call == 0 else ["p1", "p2", "p3"])
        stats = grad_stats([_p(n, torch.full((2,), v[n])) for n in held], group=pg)
        orders: list[object] = [None] * world
        dist.all_gather_object(orders, stats.names, group=pg)
        assert all(o == orders[0] for o in orders), orders
        holders = {"p1": world - 1, "p2": 1 + (world - 1) * (call > 0), "p3": world - 1, "p4": 1}
        for name, s in zip(stats.names, stats.sumsq.tolist()):
            assert s == 2 * v[name] ** 2 * holders[name], (call, name, s)
        if call == 0:  # without a report the layout stays; the rows are right as they are
            continue
        stats.report()


def clip_with_given_statistics(rank: int, world: int) -> None:
    """clip_grad_norm_(params, group=, stats=grad_stats(...)) where the ranks hold different parameters (and one
    rank none): no error, and every rank clips by the global norm (the empty rank reports it too)."""
    pg = dist.group.WORLD
    for call in range(3):
        drop = rank == 0 and call >= 1
        empty = rank == world - 1 and call == 2
        params = [] if empty else [_p("a", torch.full((3,), 1.0))] + ([] if drop else [_p("b", torch.full((2,), 2.0))])
        stats = grad_stats(params, group=pg)
        clip_grad_norm_(params, max_norm=1.0, group=pg, stats=stats)
        a_holders = world - (call == 2)  # the last rank holds nothing at call 2
        b_holders = world - (call >= 1) - (call == 2)
        want = math.sqrt(3.0 * a_holders + 8.0 * b_holders)
        assert math.isclose(float(stats.clip_norm), want, rel_tol=1e-12), (call, float(stats.clip_norm), want)
        assert math.isclose(float(stats.clip_coef), 1.0 / (want + 1e-6), rel_tol=1e-12), call
    wrong = [_p("zzz", torch.ones(2))]
    _expect_error(lambda: clip_grad_norm_(wrong, max_norm=1.0, group=pg, stats=stats), "'zzz'")


def adaptive_clip_with_different_parameters(rank: int, world: int) -> None:
    """AdaptiveClip.clip_(params, group=) where the ranks hold different parameters (and one rank none at a call):
    every rank takes the same threshold from the global norm and clips by it, as clip_grad_norm_(group=)."""
    pg = dist.group.WORLD
    clipper = AdaptiveClip(warmup=2)
    for call in range(4):
        empty = rank == world - 1 and call == 3
        params = [] if empty else [_p("a", torch.full((3,), 1.0 + call))] + (
            [_p("b", torch.full((2,), 2.0))] if rank == 0 else [])
        stats = clipper.clip_(params, group=pg)
        a_holders = world - (call == 3)
        want = math.sqrt(3.0 * (1.0 + call) ** 2 * a_holders + 8.0)
        assert math.isclose(float(stats.clip_norm), want, rel_tol=1e-12), (call, float(stats.clip_norm), want)
        coef = float(stats.clip_coef)
        for name, p in params:  # scaled by the coefficient of the global norm
            before = 1.0 + call if name == "a" else 2.0
            assert p.grad is not None and torch.allclose(p.grad, torch.full_like(p.grad, before * coef)), call
        coefs = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(coefs, torch.tensor(coef, dtype=torch.float64))
        assert all(float(c) == coef for c in coefs), (call, [float(c) for c in coefs])  # one threshold everywhere
        assert coef == 1.0 if call < 2 else coef < 1.0, (call, coef)  # the warm-up, then a rising norm clipped


def report_summaries_with_unattributed(rank: int, world: int) -> None:
    """In a call with unattributed figures, report().health equals health() (per-parameter summaries leave them
    out on both sides) while the totals include them and the report lists them as one row."""
    pg = dist.group.WORLD
    for _ in range(2):  # the group agrees on these rows (the second call at the latest, after a report everywhere)
        grad_stats([_p("a", torch.full((4,), 1e-2))], group=pg).report()
    held = [_p("a", torch.full((4,), 1e-2))] + ([_p("big", torch.full((4,), 1e3))] if rank == world - 1 else [])
    stats = grad_stats(held, group=pg)
    rep = stats.report()
    assert rep.health == float(stats.health()), (rep.health, float(stats.health()))
    assert list(rep.norms) == ["a", UNATTRIBUTED_ROW], list(rep.norms)
    assert math.isclose(rep.total_norm, math.sqrt(4e-4 * world + 4e6), rel_tol=1e-12), rep.total_norm
    assert rep.numel == 4 * world + 4 and rep.max_norm == rep.norms["a"], (rep.numel, rep.max_norm)


def pipeline_gain_one_report(rank: int, world: int) -> str | None:
    """Pipeline stages x data parallel (2 x 2): one data-parallel rank of the last stage gains a parameter. Its
    figures are exact in that call, and after one report on every rank the next call has its row: the stage
    group's check also says when the data-parallel group's layout changed."""
    if world != 4:
        return "skip: needs 4 ranks"
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    pps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp = pps[rank % 2]

    def local(r: int, call: int) -> dict[str, torch.Tensor]:
        d = {"a": torch.full((3,), 1.0 + r)} if r < 2 else {"b": torch.full((2,), 2.0 + r)}
        if r == 3 and call >= 1:
            d["x"] = torch.full((5,), 6.0)
        return d

    for call in range(3):
        stats = grad_stats([_p(n, t) for n, t in local(rank, call).items()], group=dp, stage_group=pp)
        rep = stats.report()
        want = sum(_sumsq(list(local(r, call).values())) for r in range(4))
        assert math.isclose(rep.total_norm ** 2, want, rel_tol=1e-12), (call, rep.total_norm ** 2, want)
        assert ("x" in rep.norms) == (call == 2), (call, list(rep.norms))
    return None


def rank_without_gradients_weights(rank: int, world: int) -> None:
    """grad_and_weight_stats(group=) on a rank whose parameters have no gradient: it still takes part, so every
    rank raises the same error (rows without names must match) instead of its peers waiting for it."""
    pg = dist.group.WORLD
    params = [_p(n, torch.full((2,), 1.0), torch.full((2,), 10.0)) for n in "ab"]
    grad_and_weight_stats(params, group=pg)
    if rank == world - 1:
        for _, p in params:
            p.grad = None
    _expect_error(lambda: grad_and_weight_stats(params, group=pg), "different gradient lists")


def two_call_sites_steady(rank: int, world: int) -> None:
    """Statistics of a subset, then a clip of everything, on one group at every step (every rank holding the
    same): the group keeps both layouts and learns the order they come in, so from the third step on neither call
    reads the host or agrees again."""
    pg = dist.group.WORLD
    params = [_p(f"p{i}", torch.full((3,), 1.0 + i)) for i in range(3)]
    want_subset = math.sqrt(world * (3.0 + 12.0))
    counts: list[int] = []
    for step in range(6):
        with AllHostReads() as reads:
            subset = grad_stats(params[:2], group=pg)
            clip_grad_norm_(params, max_norm=1e9, group=pg)
        counts.append(reads.count)
        assert math.isclose(float(subset.total_norm), want_subset, rel_tol=1e-12), step
        assert subset.names == ["p0", "p1"], subset.names
    assert counts[3:] == [0, 0, 0], counts


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f for f in (unnamed_rows_raise_at_once, tied_copy_gained_late,  # type: ignore[misc]
                            tied_names_on_some_ranks, row_order_after_a_change, clip_with_given_statistics,
                            report_summaries_with_unattributed, pipeline_gain_one_report,
                            rank_without_gradients_weights, two_call_sites_steady,
                            adaptive_clip_with_different_parameters)
}
