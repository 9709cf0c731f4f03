"""Worker side of tests/test_distributed_real.py: real wrappers whose ranks hold different parameters (FSDP1 flat
shards, FSDP2 shards that are empty on some ranks, a different set of experts on each rank), run by every rank of a
gloo process group on the CPU.

Each scenario compares what every rank reports with float64 figures of the whole (unsharded) gradients, and checks
that every rank names the same rows in model order and the same first non-finite parameter (see _dist_workers for
the scenario protocol).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import model_zoo
import torch
import torch.distributed as dist
from _dist_workers import _check_report_equal, _params_with_grads, _seq
from torch import nn

from torch_gradstats import clip_grad_norm_, grad_stats


def _reference(named: list[tuple[str, torch.Tensor]]) -> Any:
    """Single-process report on the whole gradients, in float64."""
    return grad_stats(_params_with_grads([(n, g.detach().double()) for n, g in named])).report()


def _same_on_every_rank(what: str, value: object) -> None:
    seen: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    assert all(v == seen[0] for v in seen), f"{what} differs between ranks: {seen}"


def _chain(seed: int, layers: int) -> nn.Module:
    """Layers of 16 weights each: FSDP1's flat parameter then splits between parameters, so that the ranks hold
    disjoint sets of whole gradients (2 layers a rank with 2 * world of them)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(4, 4, bias=False), nn.Tanh())])


def fsdp1_flat_shards_in_model_order(rank: int, world: int) -> str | None:
    """FSDP1 (use_orig_params=True) cuts one flat parameter into consecutive pieces: here each rank holds two
    whole gradients and no other. The report lists every parameter in model order on every rank (rows of disjoint
    holdings once came out last rank first), so a NaN in the first parameter and one in the last name the first."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return "skip: torch.distributed.fsdp.FullyShardedDataParallel not available"
    ref = _chain(seed=3, layers=2 * world)
    model = FSDP(_chain(seed=3, layers=2 * world), use_orig_params=True, device_id=torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2 * world, 4, generator=gen)
    model(x[2 * rank: 2 * rank + 2]).pow(2).mean().backward()  # FSDP1 averages over the ranks' batches
    ref(x).pow(2).mean().backward()
    names = [n for n, _ in ref.named_parameters()]
    held = [n.replace("_fsdp_wrapped_module.", "") for n, p in model.named_parameters() if p.grad is not None]
    assert held == names[2 * rank: 2 * rank + 2], f"rank {rank} holds {held}: not its own two layers"
    for call in range(2):  # the first call agrees on the layout, the second is the steady state
        rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
        got = [n.replace("_fsdp_wrapped_module.", "") for n in rep.norms]
        assert got == names, f"call {call}: rows {got}, model order {names}"
        for name in names:
            want = float(ref.get_parameter(name).grad.double().norm())
            assert math.isclose(rep.norms["_fsdp_wrapped_module." + name], want, rel_tol=1e-4), (name, want)
    # A NaN in the first parameter (rank 0's piece) and one in the last (the last rank's piece).
    params = list(model.named_parameters())
    for index in (0, len(params) - 1):
        g = params[index][1].grad
        if g is not None and g.numel():
            g.view(-1)[-1 if index else 0] = float("nan")
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    first = "_fsdp_wrapped_module." + names[0]
    assert rep.first_nonfinite == first, f"first non-finite {rep.first_nonfinite!r}, expected {first!r}"
    assert rep.nonfinite_ranks[first] == [0], rep.nonfinite_ranks
    _same_on_every_rank("rows and first non-finite", (list(rep.norms), rep.first_nonfinite, rep.nonfinite_ranks))
    return None


def experts_differ_per_rank(rank: int, world: int) -> None:
    """Expert parallelism where each rank holds two experts of its own, whole (`expert_group`), and the dense
    parameters are replicas already averaged (no `group`); one expert got no token on rank 0. Every rank reports the
    same rows in model order, the whole model's figures, and, with a NaN in a dense parameter (on every rank) and
    in the last rank's expert, the dense parameter as the first non-finite one."""
    gen = torch.Generator().manual_seed(5)
    dense = {"embed.weight": torch.randn(6, 4, generator=gen), "head.weight": torch.randn(3, 6, generator=gen)}
    experts = {f"moe.experts.{e}.w": torch.randn(4, 4, generator=gen) * (e + 1) for e in range(2 * world)}
    order = ["embed.weight"] + list(experts) + ["head.weight"]  # the model's order
    mine = {n: t for n, t in experts.items() if int(n.split(".")[2]) // 2 == rank}
    if rank == 0:
        mine.pop("moe.experts.1.w")  # no token reached it: no gradient this step
    held = [(n, mine[n] if n in mine else dense[n]) for n in order if n in mine or n in dense]

    def stats(named: list[tuple[str, torch.Tensor]]) -> Any:
        return grad_stats(_params_with_grads(named), expert_group=dist.group.WORLD,
                          is_expert=lambda name: ".experts." in name).report()  # fmt: skip

    whole = [(n, {**dense, **experts}[n]) for n in order if n != "moe.experts.1.w"]
    for call in range(2):
        rep = stats([(n, t.clone()) for n, t in held])
        _check_report_equal(f"experts, call {call}", rep, _reference(whole))
        _same_on_every_rank("rows", list(rep.norms))
    bad = [(n, t.clone()) for n, t in held]
    for n, t in bad:
        if n == "head.weight" or n == f"moe.experts.{2 * world - 1}.w":
            t.view(-1)[0] = float("nan")
    rep = stats(bad)
    want = f"moe.experts.{2 * world - 1}.w"
    assert rep.nonfinite == [want, "head.weight"], rep.nonfinite
    assert rep.first_nonfinite == want and rep.nonfinite_ranks[want] == [world - 1], rep.nonfinite_ranks
    _same_on_every_rank("first non-finite", (rep.first_nonfinite, rep.nonfinite, list(rep.norms)))


def fsdp2_empty_shards_nan_on_one_rank(rank: int, world: int) -> str | None:
    """FSDP2 with parameters whose first dimension is smaller than the world (the last ranks' shards are empty):
    figures equal the whole gradients' (all-gathered, float64); a NaN on the last rank only is named, with that
    rank, the same on every rank; clipping uses the global norm."""
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import init_device_mesh
    except ImportError:
        return "skip: torch.distributed.fsdp.fully_shard not available"
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 2 * world - 1), nn.Tanh(), nn.Linear(2 * world - 1, 1))  # 2.*: on rank 0 only
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(3 * world, 5, generator=torch.Generator().manual_seed(7))
    model(x[3 * rank: 3 * rank + 3]).pow(2).mean().backward()
    assert model[2].bias.grad.to_local().numel() == (1 if rank == 0 else 0)
    whole = [(n, p.grad.full_tensor()) for n, p in model.named_parameters()]
    for call in range(2):
        _check_report_equal(f"fsdp2, call {call}", grad_stats(model.named_parameters()).report(), _reference(whole))
    local = model[0].weight.grad.to_local()
    if rank == world - 1:
        local.view(-1)[0] = float("nan")
    rep = grad_stats(model.named_parameters()).report()
    assert rep.first_nonfinite == "0.weight" and rep.nonfinite_ranks == {"0.weight": [world - 1]}, rep.nonfinite_ranks
    _same_on_every_rank("first non-finite", (rep.first_nonfinite, rep.nonfinite_ranks))
    if rank == world - 1:
        local.view(-1)[0] = 0.0
    whole = [(n, p.grad.full_tensor()) for n, p in model.named_parameters()]
    norm = _reference(whole).total_norm
    stats = clip_grad_norm_(model.named_parameters(), max_norm=norm / 4)
    assert math.isclose(float(stats.clip_norm), norm, rel_tol=1e-5), (float(stats.clip_norm), norm)
    after = math.sqrt(sum(float(p.grad.full_tensor().double().pow(2).sum()) for p in model.parameters()))
    assert math.isclose(after, norm / 4, rel_tol=1e-4), (after, norm / 4)
    return None


def fsdp2_compiled_clip(rank: int, world: int) -> str | None:
    """A compiled post-backward step on an FSDP2 model (clip_grad_norm_ of its DTensor gradients): the reduction
    across ranks runs eagerly inside it (Dynamo once crashed tracing the gradients' placements), and the norm and
    the clipped gradients equal float64 figures of the whole gradients."""
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import init_device_mesh
    except ImportError:
        return "skip: torch.distributed.fsdp.fully_shard not available"
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(5, 2 * world + 1), nn.Tanh(), nn.Linear(2 * world + 1, 3))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(9))

    def after_backward(model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(model.named_parameters(), max_norm=0.05).total_norm

    compiled = torch.compile(after_backward, backend="aot_eager")
    try:
        for step in range(3):
            model.zero_grad()
            model(x[2 * rank: 2 * rank + 2] * (step + 1)).pow(2).mean().backward()
            norm = _reference([(n, p.grad.full_tensor()) for n, p in model.named_parameters()]).total_norm
            got = float(compiled(model))
            assert math.isclose(got, norm, rel_tol=1e-5), (step, got, norm)
            after = math.sqrt(sum(float(p.grad.full_tensor().double().pow(2).sum()) for p in model.parameters()))
            assert math.isclose(after, min(norm, 0.05), rel_tol=1e-4), (step, after, norm)
    finally:
        torch._dynamo.reset()
    return None


def fsdp1_flat_parameters_without_padding(rank: int, world: int) -> str | None:
    """FSDP1 with use_orig_params=False: one row per flat parameter, whose norm is the whole model's and whose numel
    and zero count leave out the zero FSDP pads the last rank's shard with (19 elements on 2 or 4 ranks: one); a
    NaN in the last rank's shard is named with that rank."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return "skip: torch.distributed.fsdp.FullyShardedDataParallel not available"
    torch.manual_seed(10)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # 19 elements
    model = FSDP(copy.deepcopy(ref), use_orig_params=False, device_id=torch.device("cpu"))
    (flat,) = list(model.parameters())
    padded = torch.tensor([flat._shard_numel_padded], dtype=torch.int64)
    dist.all_reduce(padded)
    assert int(padded) == -19 % world and int(padded) > 0, int(padded)  # there is padding to leave out
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(11))
    x[:, 0] = 0.0  # the first weight column's gradient: 3 exact zeros
    model(x[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    want = _reference([(n, p.grad) for n, p in ref.named_parameters()])
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    assert list(rep.norms) == ["_fsdp_wrapped_module._flat_param"], list(rep.norms)
    assert math.isclose(rep.total_norm, want.total_norm, rel_tol=1e-5), (rep.total_norm, want.total_norm)
    assert (rep.numel, rep.zero_count) == (19, want.zero_count) and want.zero_count >= 3, (rep.numel, rep.zero_count)
    if rank == world - 1:
        flat.grad[0] = float("nan")  # the last rank's first element: real gradient, not padding
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    assert (rep.nan_count, rep.numel) == (1, 19), (rep.nan_count, rep.numel)
    assert rep.nonfinite_ranks == {"_fsdp_wrapped_module._flat_param": [world - 1]}, rep.nonfinite_ranks
    return None


def fsdp1_whole_flat_parameters_refuse_a_larger_group(rank: int, world: int) -> str | None:
    """FSDP1 flat parameters that each rank of group= holds whole (NO_SHARD; HYBRID_SHARD read over every rank
    instead of its sharding group) are a ValueError naming the parameter, on every rank: the sum over the group
    counted each copy (NO_SHARD's norm was sqrt(world) times the model's). Read over FSDP's own group (none for
    NO_SHARD), the figures are the model's."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
    except ImportError:
        return "skip: torch.distributed.fsdp.FullyShardedDataParallel not available"
    torch.manual_seed(10)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # 19 elements
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(11))
    ref(x).pow(2).mean().backward()
    want = _reference([(n, p.grad) for n, p in ref.named_parameters()])
    setups = [(ShardingStrategy.NO_SHARD, {}, None)]
    if world % 2 == 0 and world > 2:  # two replicas, each sharded over world / 2 ranks
        mesh = init_device_mesh("cpu", (2, world // 2))
        setups.append((ShardingStrategy.HYBRID_SHARD, {"device_mesh": mesh}, "process_group"))
    for strategy, kw, own in setups:
        model = FSDP(copy.deepcopy(ref), use_orig_params=False, device_id=torch.device("cpu"),
                     sharding_strategy=strategy, **kw)
        model.zero_grad()
        model(x[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
        try:
            grad_stats(model.named_parameters(), group=dist.group.WORLD)
        except ValueError as exc:
            assert "'_fsdp_wrapped_module._flat_param'" in str(exc) and "group=" in str(exc), str(exc)
        else:
            raise AssertionError(f"{strategy}: group=WORLD over whole copies was not refused")
        group = getattr(model, own) if own else None
        rep = grad_stats(model.named_parameters(), group=group).report()
        assert math.isclose(rep.total_norm, want.total_norm, rel_tol=1e-5), (strategy, rep.total_norm, want.total_norm)
        assert (rep.numel, rep.zero_count) == (19, want.zero_count), (strategy, rep.numel, rep.zero_count)
    return None


def fsdp1_grad_and_weight_stats_without_padding(rank: int, world: int) -> str | None:
    """grad_and_weight_stats over FSDP1 flat parameters (use_orig_params=False) with group=: its .grads equal
    grad_stats's (19 elements, no padding zero; the padding counted before), a NaN put in the last rank's padding
    counts nowhere, and the weight norm is the model's."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return "skip: torch.distributed.fsdp.FullyShardedDataParallel not available"
    from torch_gradstats.updates import grad_and_weight_stats

    torch.manual_seed(10)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # 19 elements: padding on 2 and 4 ranks
    model = FSDP(copy.deepcopy(ref), use_orig_params=False, device_id=torch.device("cpu"))
    (flat,) = list(model.parameters())
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(11))
    model(x[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
    if flat._shard_numel_padded:
        flat.grad[-1] = float("nan")  # padding: no gradient of the model
    both = grad_and_weight_stats(model.named_parameters(), group=dist.group.WORLD).report()
    alone = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    assert (both.grads.numel, both.grads.zero_count, both.grads.nan_count) == (19, alone.zero_count, 0), (
        both.grads.numel, both.grads.zero_count, both.grads.nan_count, alone.zero_count)
    assert both.grads.total_norm == alone.total_norm, (both.grads.total_norm, alone.total_norm)
    want = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in ref.parameters()))
    (weight_norm,) = both.weight_norms.values()
    assert math.isclose(weight_norm, want, rel_tol=1e-6), (weight_norm, want)
    return None


def fsdp1_no_sync_gradient_refused_with_group(rank: int, world: int) -> str | None:
    """FSDP1 (use_orig_params=False) inside no_sync(): each rank's flat parameter holds its own unsharded partial
    sum, and grad_stats with group= is a ValueError naming the parameter (it summed the ranks' partial sums as shards:
    38 elements for 19 on 2 ranks); after the backward that reduces them, the figures are the accumulated model's."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return "skip: torch.distributed.fsdp.FullyShardedDataParallel not available"
    torch.manual_seed(10)
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))  # 19 elements
    model = FSDP(copy.deepcopy(ref), use_orig_params=False, device_id=torch.device("cpu"))
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(11))
    first, second = x[: 2 * world], x[2 * world:]
    with model.no_sync():
        model(first[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
        try:
            grad_stats(model.named_parameters(), group=dist.group.WORLD)
        except ValueError as exc:
            assert "'_fsdp_wrapped_module._flat_param'" in str(exc) and "no_sync" in str(exc), str(exc)
        else:
            raise AssertionError("an unsharded gradient inside no_sync() was read with group= as a shard")
    model(second[2 * rank: 2 * rank + 2]).pow(2).mean().backward()
    (ref(first).pow(2).mean() + ref(second).pow(2).mean()).backward()
    want = _reference([(n, p.grad) for n, p in ref.named_parameters()])
    rep = grad_stats(model.named_parameters(), group=dist.group.WORLD).report()
    assert math.isclose(rep.total_norm, want.total_norm, rel_tol=1e-5), (rep.total_norm, want.total_norm)
    assert rep.numel == 19, rep.numel
    return None


def gpt2_fsdp2_bf16_nan_on_one_rank(rank: int, world: int) -> str | None:
    """The zoo's GPT-2 (tied embedding and head) in bfloat16 under FSDP2 with MixedPrecisionPolicy(reduce_dtype=
    float32), one FSDP unit per block: every row equals float64 figures of the all-gathered bfloat16 gradients, and a
    NaN put in the last rank's shard of one parameter is named, with that rank, the same on every rank."""
    try:
        import transformers  # noqa: F401
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor import init_device_mesh
    except ImportError as exc:
        return f"skip: {exc}"
    model = model_zoo.gpt2(seed=0).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    ids = torch.randint(0, 64, (2 * world, 8), generator=torch.Generator().manual_seed(12))
    mine = ids[2 * rank: 2 * rank + 2]
    model(mine, labels=mine).loss.backward()
    named = list(model.named_parameters())
    assert {p.grad.dtype for _, p in named} == {torch.bfloat16}
    for call in range(2):
        rep = grad_stats(model.named_parameters()).report()
        _check_report_equal(f"gpt2, call {call}", rep, _reference([(n, p.grad.full_tensor()) for n, p in named]))
    name, param = next((n, p) for n, p in named if p.grad.to_local().numel() and n.endswith("c_attn.weight"))
    if rank == world - 1:
        param.grad.to_local().view(-1)[-1] = float("nan")
    rep = grad_stats(model.named_parameters()).report()
    assert rep.first_nonfinite == name and rep.nonfinite_ranks == {name: [world - 1]}, rep.nonfinite_ranks
    _same_on_every_rank("first non-finite", (rep.first_nonfinite, rep.nonfinite_ranks, list(rep.norms)))
    return None


def experts_over_pairs_dense_sharded(rank: int, world: int) -> None:
    """Expert parallelism over pairs of ranks (`expert_group`: ranks 2k and 2k+1, each holding two of the four
    experts; pairs are replicas of each other) and dense parameters sharded flat over every rank (`group`): every
    rank reports the same rows, in model order (the rows of the other rank of a pair once came after the dense
    parameters on one rank of each pair), and the whole model's figures."""
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]  # every rank makes every group
    expert_group, expert_rank = pairs[rank // 2], rank % 2
    gen = torch.Generator().manual_seed(13)
    dense = {"embed.weight": torch.randn(6, 4, generator=gen), "head.weight": torch.randn(3, 6, generator=gen)}
    experts = {f"moe.experts.{e}.w": torch.randn(4, 4, generator=gen) * (e + 1) for e in range(4)}
    order = ["embed.weight", *experts, "head.weight"]
    held = []
    for name in order:
        if name in dense:
            held.append((name, torch.tensor_split(dense[name].reshape(-1), world)[rank]))
        elif int(name.split(".")[2]) // 2 == expert_rank:
            held.append((name, experts[name]))
    whole = [(n, {**dense, **experts}[n]) for n in order]
    for call in range(2):
        rep = grad_stats(_params_with_grads([(n, g.clone()) for n, g in held]), group=dist.group.WORLD,
                         expert_group=expert_group, is_expert=lambda name: ".experts." in name).report()
        _check_report_equal(f"expert pairs, call {call}", rep, _reference(whole))
        _same_on_every_rank("rows", list(rep.norms))


def experts_gained_late_over_pairs(rank: int, world: int) -> str | None:
    """Experts over pairs of ranks and dense parameters over every rank, where the second rank of each pair holds no
    expert at first: every rank reports the same rows in model order and names the same first non-finite parameter
    (that rank once put the experts after its dense parameters, and named "head.weight" first), then again once
    those ranks gain experts; the steady state costs one SUM and one MAX per group, and the rows' order no more."""
    if world < 4:
        return "skip: needs two pairs of ranks"
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]
    expert_group, expert_rank, pg = pairs[rank // 2], rank % 2, dist.group.WORLD
    gen = torch.Generator().manual_seed(17)
    dense = {"embed.weight": torch.randn(6, 4, generator=gen), "head.weight": torch.randn(3, 6, generator=gen)}
    experts = {f"moe.experts.{e}.w": torch.randn(4, 4, generator=gen) * (e + 1) for e in range(4)}
    order = ["embed.weight", *experts, "head.weight"]

    def held(own: set[int]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name in order:
            if name in dense:
                out.append((name, torch.tensor_split(dense[name].reshape(-1), world)[rank].clone()))
            elif int(name.split(".")[2]) in own:
                out.append((name, experts[name].clone()))
        return out

    def report(named: list[tuple[str, torch.Tensor]]) -> Any:
        return grad_stats(_params_with_grads(named), group=pg, expert_group=expert_group,
                          is_expert=lambda name: ".experts." in name).report()  # fmt: skip

    first = {0, 1} if expert_rank == 0 else set()  # the second rank of each pair: no expert yet
    bad = held(first)
    for name, g in bad:
        if name in ("moe.experts.1.w", "head.weight"):
            g.view(-1)[0] = float("nan")
    rep = report(bad)
    _same_on_every_rank("rows and first non-finite", (list(rep.norms), rep.first_nonfinite))
    whole = [(n, {**dense, **experts}[n]) for n in order if ".experts.2." not in n and ".experts.3." not in n]
    assert list(rep.norms) == [n for n, _ in whole], list(rep.norms)
    assert rep.first_nonfinite == "moe.experts.1.w", rep.first_nonfinite
    for call in range(2):
        before = (_seq(pg), _seq(expert_group))
        _check_report_equal(f"no expert on one rank, call {call}", report(held(first)), _reference(whole))
        if call == 1:  # steady state: one SUM and one MAX on each group, nothing for the order
            assert (_seq(pg) - before[0], _seq(expert_group) - before[1]) == (2, 2), (before, _seq(pg))
    later = {0, 1} if expert_rank == 0 else {2, 3}
    report(held(later))  # the new experts count in the totals only; the report has every rank agree again
    full = [(n, {**dense, **experts}[n]) for n in order]
    for call in range(2):
        before = (_seq(pg), _seq(expert_group))
        rep = report(held(later))
        if call == 1:
            assert (_seq(pg) - before[0], _seq(expert_group) - before[1]) == (2, 2), (before, _seq(pg))
        _check_report_equal(f"experts gained, call {call}", rep, _reference(full))
        _same_on_every_rank("rows", list(rep.norms))
    return None


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f  # type: ignore[misc]
    for f in (fsdp1_flat_shards_in_model_order, experts_differ_per_rank, experts_over_pairs_dense_sharded,
              experts_gained_late_over_pairs,
              fsdp2_empty_shards_nan_on_one_rank, fsdp1_flat_parameters_without_padding,
              fsdp1_whole_flat_parameters_refuse_a_larger_group, fsdp1_grad_and_weight_stats_without_padding,
              fsdp1_no_sync_gradient_refused_with_group,
              gpt2_fsdp2_bf16_nan_on_one_rank, fsdp2_compiled_clip)
}
