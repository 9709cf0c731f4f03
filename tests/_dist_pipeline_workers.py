"""Worker side of tests/test_distributed_pipeline.py: pipeline stages with a tied parameter, run by every rank of a
gloo process group on the CPU (see _dist_workers for the scenario protocol).

Each scenario compares what every rank computes with a single-process float64 reference on the same tensors.
"""

from __future__ import annotations

import csv
import glob
import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from _dist_layout_workers import _full, _params, _reference, _shard_flat
from _dist_workers import RTOL, _seq
from _host_reads import HostReads
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.distributed.reduce import reduce_across_ranks
from torch_gradstats.integrations import CSVSink, JSONLSink
from torch_gradstats.integrations._common import logs_here
from torch_gradstats.integrations.mlflow import MLflowSink
from torch_gradstats.integrations.tensorboard import TensorBoardSink
from torch_gradstats.integrations.wandb import WandbSink
from torch_gradstats.ops.op import multi_tensor_stats
from torch_gradstats.policies.clip import clip_grad_norm_
from torch_gradstats.stats.gradients import grad_stats

_HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # the integrations extra
_HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None
_HAS_WANDB = importlib.util.find_spec("wandb") is not None


def _close(what: str, got: float, ref: float) -> None:
    assert math.isclose(got, ref, rel_tol=RTOL), f"{what}: {got} != {ref}"


def _layouts(world: int) -> list[tuple[str, object, object, int, int]]:
    """(label, stage group, shard group in the stage or None, stage index, stage count) of each layout this world
    runs: 2 ranks: 2 stages of one rank; 4 ranks: 2 stages x 2 shard ranks, then 4 stages of one rank. Every rank
    creates every group, in the same order."""
    rank = dist.get_rank()
    if world == 2:
        return [("2 stages", dist.group.WORLD, None, rank, 2)]
    dp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return [
        ("2 stages x 2 shards", pp[rank % 2], dp[rank // 2], rank // 2, 2),
        ("4 stages", dist.group.WORLD, None, rank, 4),
    ]


def _stage_model(stage: int, n_stages: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(what this stage holds, every stage's tensors by row name): each stage holds ``layers.<stage>.w``; the
    first and the last also hold ``tok.weight`` (a tied embedding), each with its own gradient, the last one's
    larger in magnitude so that counting it would change every figure."""
    full = _full(seed, [f"layers.{s}.w" for s in range(n_stages)] + ["tok.first", "tok.last"])
    full["tok.last"] = full["tok.last"] * 10
    full["tok.last"][1] = 0.0  # one more exact zero than the first stage's copy: a count that must not be added
    rows: dict[str, torch.Tensor] = {}
    for s in range(n_stages):
        if s == 0:
            rows["tok.weight@stage0"] = full["tok.first"]
        rows[f"layers.{s}.w"] = full[f"layers.{s}.w"]
        if s == n_stages - 1:
            rows[f"tok.weight@stage{s}"] = full["tok.last"]
    held = {n.split("@")[0]: t for n, t in rows.items() if n in (f"layers.{stage}.w", f"tok.weight@stage{stage}")}
    return held, rows


def tied_across_stages(rank: int, world: int) -> None:
    """A tied embedding on the first and the last stage: one row per stage, each equal to that stage's own
    figures; the whole model's figures (total norm, max, counts, numel, groups) count it once, from the first
    stage; one SUM and one MAX per group in steady state; changing ``tied`` is picked up at the next call."""
    for label, pp, dp, stage, n_stages in _layouts(world):
        shard_world = 1 if dp is None else dist.get_world_size(dp)
        shard_rank = 0 if dp is None else dist.get_rank(dp)
        held, rows = _stage_model(stage, n_stages, seed=11)
        named = [(n, _shard_flat(t, shard_rank, shard_world)) for n, t in held.items()]
        ref_rows = _reference(rows)  # every stage's row, as reported
        once = {n: t for n, t in rows.items() if n != f"tok.weight@stage{n_stages - 1}"}
        ref_once = _reference(once)  # the whole model, the tied embedding counted once
        ref_twice = ref_rows
        for call in range(2):
            b_pp = _seq(pp)
            stats = grad_stats(_params(named), group=dp, stage_group=pp, tied={"tok.weight"})
            rep = stats.report()
            what = f"{label}, call {call}"
            assert list(rep.norms) == list(ref_rows.norms), f"{what} rows: {list(rep.norms)}"
            for name, ref in ref_rows.norms.items():
                _close(f"{what} norm of {name}", rep.norms[name], ref)
            assert rep.zero_counts == ref_rows.zero_counts, f"{what} zero counts {rep.zero_counts}"
            for key in ("total_norm", "inf_norm"):
                _close(f"{what} {key}", getattr(rep, key), getattr(ref_once, key))
            for key in ("numel", "zero_count", "nan_count", "inf_count"):
                assert getattr(rep, key) == getattr(ref_once, key), f"{what} {key}: {getattr(rep, key)}"
            _close(f"{what} device total_norm", float(stats.total_norm), ref_once.total_norm)
            _close(f"{what} device inf_norm", float(stats.inf_norm), ref_once.inf_norm)
            assert int(stats.zero_count) == ref_once.zero_count, f"{what} device zero_count"
            # Groups count it once too: the embedding's group is the first stage's copy, and the groups add up.
            groups = stats.grouped("layer")
            grep = stats.report(groups=groups).groups
            assert grep is not None and list(grep.norms) == ["tok", *[f"layers.{s}" for s in range(n_stages)]]
            _close(f"{what} group tok", grep.norms["tok"], ref_rows.norms["tok.weight@stage0"])
            _close(f"{what} groups add up", math.sqrt(sum(v * v for v in grep.norms.values())), ref_once.total_norm)
            if call == 1:
                assert _seq(pp) - b_pp == 2, f"{what}: {_seq(pp) - b_pp} collectives on the stage group"

        # Not tied any more: both copies count (the layout is exchanged again, on every rank together).
        rep = grad_stats(_params(named), group=dp, stage_group=pp).report()
        _close(f"{label}, untied total_norm", rep.total_norm, ref_twice.total_norm)
        assert rep.numel == ref_twice.numel and rep.zero_count == ref_twice.zero_count, f"{label}, untied counts"

        # reduce_across_ranks says which rows count.
        local = [t for _, t in named]
        s, a, c = multi_tensor_stats(local)
        r = reduce_across_ranks(local, s, a, c, dp, names=[n for n, _ in named], stage_group=pp, tied=["tok.weight"])
        assert r.names == list(ref_rows.norms)
        assert r.counted == [n != f"tok.weight@stage{n_stages - 1}" for n in r.names], r.counted


def clip_with_tied_stages(rank: int, world: int) -> None:
    """clip_grad_norm_ with stage_group and tied clips every stage by the whole model's norm, the tied embedding
    counted once, and returns the per-stage rows; also with ``stats=`` from grad_stats."""
    for label, pp, dp, stage, n_stages in _layouts(world):
        shard_world = 1 if dp is None else dist.get_world_size(dp)
        shard_rank = 0 if dp is None else dist.get_rank(dp)
        held, rows = _stage_model(stage, n_stages, seed=12)
        once = {n: t for n, t in rows.items() if n != f"tok.weight@stage{n_stages - 1}"}
        ref_total = _reference(once).total_norm
        max_norm = ref_total / 4
        for use_stats in (False, True):
            named = [(n, _shard_flat(t, shard_rank, shard_world).clone()) for n, t in held.items()]
            params = _params(named)
            before = {n: p.grad.clone() for n, p in params}
            given = grad_stats(params, group=dp, stage_group=pp, tied={"tok.weight"}) if use_stats else None
            stats = clip_grad_norm_(params, max_norm, group=dp, stage_group=pp, tied={"tok.weight"}, stats=given)
            what = f"{label}, stats given: {use_stats}"
            assert stats.clip_norm is not None and stats.clip_coef is not None
            _close(f"{what} clip_norm", float(stats.clip_norm), ref_total)
            coef = max_norm / (ref_total + 1e-6)
            _close(f"{what} clip_coef", float(stats.clip_coef), coef)
            assert stats.names == list(rows), f"{what} rows {stats.names}"
            for n, p in params:
                torch.testing.assert_close(p.grad, before[n] * coef, rtol=1e-5, atol=0, msg=f"{what} grad {n}")


def _shared_dir() -> str:
    """A directory every rank writes into (rank 0's temporary directory)."""
    made = [tempfile.mkdtemp(prefix="tgs-sinks-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return str(made[0])


def sinks_write_on_one_rank(rank: int, world: int) -> None:
    """Sinks made with stage_group (and group) on every rank write on one rank only, the last stage's first rank
    of group, with the whole model's figures; log_rank= chooses another; the other ranks open no file and need no
    W&B run; the callbacks' rule is the framework's rank 0 unless log_rank is given."""
    root = _shared_dir()
    for li, (label, pp, dp, stage, n_stages) in enumerate(_layouts(world)):
        expected = (world - (dist.get_world_size(dp) if dp is not None else 1))  # last stage, first of its group
        held, rows = _stage_model(stage, n_stages, seed=13)
        shard_world = 1 if dp is None else dist.get_world_size(dp)
        shard_rank = 0 if dp is None else dist.get_rank(dp)
        named = [(n, _shard_flat(t, shard_rank, shard_world)) for n, t in held.items()]
        rep = grad_stats(_params(named), group=dp, stage_group=pp, tied={"tok.weight"}).report()
        base = os.path.join(root, f"layout{li}")
        sinks = [
            CSVSink(f"{base}-rank{rank}.csv", stage_group=pp, group=dp),
            JSONLSink(f"{base}-rank{rank}.jsonl", stage_group=pp, group=dp),
            CSVSink(f"{base}-chosen-rank{rank}.csv", stage_group=pp, group=dp, log_rank=0),
        ]
        if _HAS_TENSORBOARD:
            sinks.append(TensorBoardSink(f"{base}-tb-rank{rank}", stage_group=pp, group=dp))
        if _HAS_MLFLOW:  # read by mlflow when the writing rank imports it; the others never do
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            os.environ["MLFLOW_TRACKING_URI"] = "file:" + os.path.join(root, f"layout{li}-mlruns")
            sinks.append(MLflowSink(stage_group=pp, group=dp))
        for sink in sinks:
            sink.log(rep, 1)
        if _HAS_WANDB:
            wandb_sink = WandbSink(stage_group=pp, group=dp)  # no run anywhere: only the writing rank may look for one
            try:
                wandb_sink.log(rep, 1)
                assert rank != expected, "the logging rank logged to W&B without a run"
            except RuntimeError as exc:
                assert rank == expected and "wandb.init" in str(exc), (rank, exc)
        for sink in sinks:
            if isinstance(sink, TensorBoardSink):
                assert (sink.writer is None) == (not sink.writes)
                if sink.writer is not None:
                    sink.writer.close()
            else:
                sink.close()
                try:  # closed: log raises on every rank, the writing one or not
                    sink.log(rep, 2)
                    raise AssertionError(f"{type(sink).__name__}.log after close was accepted on rank {rank}")
                except ValueError as exc:
                    assert "closed" in str(exc), exc
        dist.barrier()
        if rank == 0:
            made = sorted(os.listdir(root))
            want = sorted([f"layout{li}-rank{expected}.csv", f"layout{li}-rank{expected}.jsonl",
                           f"layout{li}-chosen-rank0.csv"] + [f"layout{li}-tb-rank{expected}"] * _HAS_TENSORBOARD
                          + [f"layout{li}-mlruns"] * _HAS_MLFLOW)  # fmt: skip
            if _HAS_MLFLOW:  # one run, written by the logging rank
                metric = glob.glob(os.path.join(root, f"layout{li}-mlruns", "*", "*", "metrics", "grad", "total_norm"))
                assert len(metric) == 1, metric
            assert [m for m in made if m.startswith(f"layout{li}-")] == want, (label, made)
            with open(f"{base}-rank{expected}.csv") as f:
                (row,) = list(csv.DictReader(f))
            with open(f"{base}-rank{expected}.jsonl") as f:
                (line,) = [json.loads(x) for x in f]
            once = {n: t for n, t in rows.items() if n != f"tok.weight@stage{n_stages - 1}"}
            ref = _reference(once).total_norm
            _close(f"{label} CSV total_norm", float(row["total_norm"]), ref)
            _close(f"{label} JSONL total_norm", line["total_norm"], ref)
            assert set(_reference(rows).norms) <= {k.removeprefix("norm/") for k in line}, f"{label}: rows missing"
        dist.barrier()
    # With none of stage_group, group and log_rank every rank writes: given the same path, one rank gets the file and
    # every other is refused (a lock across processes), rather than interleaving its rows and headers there.
    shared = {cls: os.path.join(root, f"same.{cls.__name__}") for cls in (CSVSink, JSONLSink)}
    got = {}
    for cls, path in shared.items():
        try:
            got[cls] = cls(path)
        except ValueError as exc:
            assert "is already written by a sink of another process" in str(exc), exc
    owners: list[object] = [None] * world
    dist.all_gather_object(owners, sorted(cls.__name__ for cls in got))
    for cls in shared:
        assert sum(cls.__name__ in o for o in owners) == 1, (cls.__name__, owners)  # type: ignore[operator]
    for sink in got.values():
        sink.log(rep, 1)
        sink.close()
    dist.barrier()
    if rank == 0:
        with open(shared[CSVSink]) as f:
            assert [r["step"] for r in csv.DictReader(f)] == ["1"]
        with open(shared[JSONLSink]) as f:
            assert [json.loads(x)["step"] for x in f] == [1]
    # The callbacks keep the framework's logging process (rank 0) unless log_rank says otherwise.
    flags: list[object] = [None] * world
    dist.all_gather_object(flags, (logs_here("cb", rank == 0, None), logs_here("cb", rank == 0, world - 1)))
    assert [r for r in range(world) if flags[r][0]] == [0] and [r for r in range(world) if flags[r][1]] == [world - 1]
    try:
        CSVSink(os.path.join(root, f"bad-rank{rank}.csv"), log_rank=world)
        raise AssertionError("log_rank=world was accepted")
    except ValueError as exc:
        assert "CSVSink: log_rank must be in" in str(exc), exc
    assert not os.path.exists(os.path.join(root, f"bad-rank{rank}.csv"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)


def layout_change_on_one_rank(rank: int, world: int) -> None:
    """The last rank gains and then loses a gradient while the others hold the same rows in the agreed order (their
    buffers are reduced in place). In the call where it changes, the totals are exact: a gradient the agreed layout
    has no row for counts as the "(unattributed)" row, and a lost one leaves its row with nothing in it. Every rank
    reports that call, so the next call agrees again (the last rank alone asking is not enough) and every row is
    exact; the call after is the steady state again: one SUM and one MAX, no host read."""
    pg = dist.group.WORLD
    full = _full(31, ["a", "b", "c"])
    shards = {n: _shard_flat(t, rank, world) for n, t in full.items()}
    last = rank == world - 1
    c_part = _shard_flat(full["c"], world - 1, world)
    plans = [  # (names held by the last rank, the reference the call where it changes, the one after)
        (["a", "b"], None, {"a": full["a"], "b": full["b"]}),
        (["a", "b", "c"], {"a": full["a"], "b": full["b"], "(unattributed)": c_part},
         {"a": full["a"], "b": full["b"], "c": c_part}),
        (["a", "b"], {"a": full["a"], "b": full["b"], "c": c_part[:0]}, {"a": full["a"], "b": full["b"]}),
    ]
    for call, (held_last, changing, ref) in enumerate(plans):
        held = held_last if last else ["a", "b"]
        for repeat, want in enumerate([changing or ref, ref, ref]):
            before = _seq(pg)
            with HostReads() as reads:
                stats = grad_stats(_params([(n, shards[n]) for n in held]), group=pg)
            rep = stats.report()
            what = f"call {call}.{repeat}"
            assert list(rep.norms) == list(want), f"{what} rows {list(rep.norms)}"
            for name, t in want.items():
                _close(f"{what} norm {name}", rep.norms[name], float(t.double().norm()))
            _close(f"{what} total", rep.total_norm, _reference(ref).total_norm)
            if repeat == 2:
                assert _seq(pg) - before == 2, f"{what}: {_seq(pg) - before} collectives, expected 2"
                assert reads.count == 0, f"{what}: {reads.count} host reads"


# ---------------------------------------------------------------------------------------------- compat, 4 ranks
NORMS = (2.0, 1.0, math.inf, 3.0)


def _compat_full(seed: int, n: int) -> list[torch.Tensor]:
    """``n`` float32 tensors with odd first dimensions (uneven shards), some exact zeros, growing magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = torch.randn(5 + 2 * i, 3, generator=gen) * (i + 1)
        t[i % 5, :2] = 0.0
        out.append(t)
    return out


def _ref_norm(grads: list[torch.Tensor], p: float) -> float:
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
    return float(flat.abs().max()) if math.isinf(p) else float(flat.abs().pow(p).sum() ** (1.0 / p))


def _ref_clipped(grads: list[torch.Tensor], p: float, max_norm: float) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float64)) for g in grads]
    for q, g in zip(params, grads):
        q.grad = g.to(torch.float64)
    torch.nn.utils.clip_grad_norm_(params, max_norm, p)
    return [q.grad.float() for q in params]


def _dtensor_param(full: torch.Tensor, mesh, placements):  # type: ignore[no-untyped-def]
    q = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, placements))
    q.grad = distribute_tensor(full.clone(), mesh, placements)
    return q


def torchtitan_two_stages_two_shards(rank: int, world: int) -> str | None:
    """torchtitan's clip_grad_norm_ on a ("pp", "dp") = (2, 2) mesh: each stage's parameters are DTensors sharded
    over its "dp" ranks, the norm is combined over pp_mesh; every norm type against the float64 reference, with no
    host read, and the clipped gradients against torch's clip of the full tensors."""
    if world != 4:
        return "skip: a 4-rank layout"
    from _compat_dist_worker import _no_host_reads

    from torch_gradstats.compat import torchtitan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, pp_mesh, dp_mesh = mesh.get_coordinate()[0], mesh["pp"], mesh["dp"]  # slicing a mesh reads its ranks
    full = _compat_full(21, 6)
    mine = [i for i in range(len(full)) if i % 2 == stage]  # stage 0: tensors 0, 2, 4; stage 1: 1, 3, 5
    for p in NORMS:
        params = [_dtensor_param(full[i], dp_mesh, [Shard(0)]) for i in mine]
        total = _no_host_reads(lambda: torchtitan.clip_grad_norm_(params, 1.0, p, pp_mesh=pp_mesh))  # noqa: B023
        assert type(total) is torch.Tensor and total.dtype == torch.float32 and total.dim() == 0
        _close(f"2x2 norm {p}", float(total), _ref_norm(full, p))
        ref = _ref_clipped(full, p, 1.0)
        for q, i in zip(params, mine):
            torch.testing.assert_close(q.grad.full_tensor(), ref[i], rtol=1e-5, atol=1e-7)
    return None


def torchtitan_expert_group_of_two(rank: int, world: int) -> str | None:
    """ep_enabled on 4 ranks: dense parameters sharded over all 4, experts sharded over an expert group of 2 and
    replicated over the 2 expert-data-parallel replicas (a (2, 2) mesh, [Replicate(), Shard(0)]): a replica is
    counted once; every norm type against the float64 reference."""
    if world != 4:
        return "skip: a 4-rank layout"
    from torch_gradstats.compat import torchtitan

    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    full = _compat_full(22, 5)
    for p in NORMS:
        params = [
            _dtensor_param(g, expert_mesh, [Replicate(), Shard(0)]) if i % 2 else
            _dtensor_param(g, dense_mesh, [Shard(0)])
            for i, g in enumerate(full)
        ]
        total = torchtitan.clip_grad_norm_(params, 2.0, p, ep_enabled=True)
        _close(f"experts norm {p}", float(total), _ref_norm(full, p))
        for q, r in zip(params, _ref_clipped(full, p, 2.0)):
            torch.testing.assert_close(q.grad.full_tensor(), r, rtol=1e-5, atol=1e-7)
    return None


def megatron_two_stages_two_replicas(rank: int, world: int) -> str | None:
    """Megatron on 2 pipeline stages x 2 data-parallel replicas: the model-parallel group is the stage group; the
    embedding is tied between the stages and marked ``shared`` on the last (Megatron's rule): the norm (the caller
    leaves shared gradients out) and the zero count are the whole model's, the embedding once, and equal
    grad_stats(stage_group=, tied=)'s."""
    if world != 4:
        return "skip: a 4-rank layout"
    from torch_gradstats.compat import megatron

    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # stage = rank // 2; rank % 2: the replica
    stage = rank // 2
    full = _compat_full(23, 4)
    emb = full[0]
    layers = {0: [full[1]], 1: [full[2], full[3]]}[stage]
    held = [("emb", emb.clone())] + [(f"layers.{stage}.{i}", t.clone()) for i, t in enumerate(layers)]
    params = _params(held)
    if stage == 1:
        params[0][1].shared = True  # type: ignore[attr-defined]
    once = full  # the embedding once, every layer
    zeros = sum(int((g == 0).sum()) for g in once)
    for p in NORMS:
        grads = [q.grad for _, q in params if not getattr(q, "shared", False)]
        norm = megatron.get_grad_norm_fp32(grads, p, pp)
        _close(f"megatron 2x2 norm {p}", norm, _ref_norm(once, p))
        count = megatron.count_zeros_fp32([q for _, q in params], pp)
        assert count == zeros, (p, count, zeros)
    ours = grad_stats(params, stage_group=pp, tied={"emb"})
    _close("grad_stats agrees with megatron", float(ours.total_norm), _ref_norm(once, 2.0))
    assert int(ours.zero_count) == zeros
    return None


def megatron_tensor_and_expert_groups(rank: int, world: int) -> str | None:
    """Megatron on 4 ranks: tensor parallel 2 x pipeline 2 (a split weight on each tensor-parallel rank, a
    replicated one counted on tensor-parallel rank 0 only), and experts over an expert group of 2 (each expert
    rank holds its own experts; ranks 2, 3 replicate ranks 0, 1)."""
    if world != 4:
        return "skip: a 4-rank layout"
    from torch_gradstats.compat import megatron

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp, tp_rank, stage = tp_groups[rank // 2], rank % 2, rank // 2
    full = _compat_full(24, 4)  # stage 0: split 0, replicated 1; stage 1: split 2, replicated 3
    split, replicated = full[2 * stage], full[2 * stage + 1]
    shard = torch.tensor_split(split, 2)[tp_rank].clone()
    w = torch.nn.Parameter(torch.zeros_like(shard))
    w.grad = shard
    w.tensor_model_parallel = True  # type: ignore[attr-defined]
    b = torch.nn.Parameter(torch.zeros_like(replicated))
    b.grad = replicated.clone()
    for p in NORMS:
        # Megatron's caller leaves tensor-parallel duplicates out of the norm: the replicated one on tp rank 0.
        grads = [w.grad] + ([b.grad] if tp_rank == 0 else [])
        _close(f"tp x pp norm {p}", megatron.get_grad_norm_fp32(grads, p, dist.group.WORLD), _ref_norm(full, p))
        count = megatron.count_zeros_fp32([w, b], dist.group.WORLD, tp_group=tp)
        assert count == sum(int((g == 0).sum()) for g in full), count

    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    experts = _compat_full(25, 4)
    mine = [experts[i] for i in range(4) if i % 2 == rank % 2]
    eparams = _params([(f"experts.{i}", t.clone()) for i, t in enumerate(mine)])
    for p in NORMS:
        norm = megatron.get_grad_norm_fp32([q.grad for _, q in eparams], p, ep)
        _close(f"experts norm {p}", norm, _ref_norm(experts, p))
        count = megatron.count_zeros_fp32([q for _, q in eparams], ep)
        assert count == sum(int((g == 0).sum()) for g in experts), count
    return None


def _hist(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Reference exponent histograms ([len, 277]) of whole tensors, from numpy.frexp."""
    import numpy as np

    rows = []
    for t in tensors:
        x = t.detach().double().reshape(-1).numpy()
        x = x[np.isfinite(x) & (x != 0)]
        _, e = np.frexp(np.abs(x))
        rows.append(torch.from_numpy(np.bincount(np.clip(e.astype(np.int64) + 148, 0, 276), minlength=277)))
    return torch.stack(rows)


def histogram_across_ranks(rank: int, world: int) -> None:
    """grad_stats(histogram=True) across ranks: shards of one parameter (group=), pipeline stages with a tied
    embedding (the whole model's histogram counts it once; each stage's row is its own), a gradient missing on one
    rank, and DTensor gradients (Shard and Partial): every rank's rows and global histogram equal the histograms of
    the whole tensors, computed in one process."""
    for label, pp, dp, stage, n_stages in _layouts(world):
        shard_world = 1 if dp is None else dist.get_world_size(dp)
        shard_rank = 0 if dp is None else dist.get_rank(dp)
        held, rows = _stage_model(stage, n_stages, seed=23)
        rows["tok.weight@stage0"][3] = float("nan")  # not in any histogram
        named = [(n, _shard_flat(t, shard_rank, shard_world)) for n, t in held.items()]
        stats = grad_stats(_params(named), group=dp, stage_group=pp, tied={"tok.weight"}, histogram=True,
                           per_tensor=True)  # fmt: skip
        assert stats.names == list(rows), f"{label}: {stats.names}"
        want = _hist(list(rows.values()))
        assert torch.equal(stats.exponent_histogram, want), f"{label}: per-row histograms differ"
        whole = grad_stats(_params(named), group=dp, stage_group=pp, tied={"tok.weight"}, histogram=True)
        once = want[[i for i, n in enumerate(rows) if n != f"tok.weight@stage{n_stages - 1}"]].sum(0)
        assert torch.equal(whole.exponent_histogram, once), f"{label}: the tied embedding is not counted once"
        rep = whole.report()
        assert rep.exponent_histogram is not None and list(rep.exponent_histogram.counts) == once.tolist()

    # A gradient missing on the last rank: its rows still hold every other rank's elements.
    full = _full(31, ["a", "b", "c"])
    named = [(n, _shard_flat(t, rank, world) if not (n == "b" and rank == world - 1) else None) for n, t in
             full.items()]  # fmt: skip
    stats = grad_stats(_params(named), group=dist.group.WORLD, histogram=True, per_tensor=True)
    assert stats.names == ["a", "b", "c"], stats.names
    kept = [t if n != "b" else torch.cat(torch.tensor_split(t, world)[: world - 1]) for n, t in full.items()]
    assert torch.equal(stats.exponent_histogram, _hist(kept)), "missing gradient: histograms differ"

    # DTensor gradients: sharded, and Partial (each rank an addend; the histogram is of the sum).
    mesh = init_device_mesh("cpu", (world,))
    from torch.distributed.tensor import DTensor, Partial

    full = _full(37, ["s", "p"])
    addends = [full["p"] * (r + 1) / world for r in range(world)]
    sharded = distribute_tensor(full["s"], mesh, [Shard(0)])
    partial = DTensor.from_local(addends[rank], mesh, [Partial()])
    stats = grad_stats(_params([("s", sharded), ("p", partial)]), histogram=True, per_tensor=True)
    assert torch.equal(stats.exponent_histogram, _hist([full["s"], sum(addends)])), "DTensor histograms differ"


SCENARIOS: dict[str, Callable[[int, int], str | None]] = {
    f.__name__: f
    for f in (
        tied_across_stages,
        clip_with_tied_stages,
        sinks_write_on_one_rank,
        layout_change_on_one_rank,
        torchtitan_two_stages_two_shards,
        torchtitan_expert_group_of_two,
        megatron_two_stages_two_replicas,
        megatron_tensor_and_expert_groups,
        histogram_across_ranks,
    )
}
