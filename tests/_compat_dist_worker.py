"""Worker side of the multi-process tests in tests/test_compat.py: every rank of a 2-rank gloo group runs each
scenario and compares with a single-process float64 reference on the full tensors (every rank builds the same full
tensors from one seed, then keeps its part)."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from torch_gradstats.compat import deepspeed, megatron, torchtitan
from torch_gradstats.ops.op import reference_multi_tensor_stats

NORMS = (2.0, 1.0, math.inf, 3.0)


def _full(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (7,), (4, 2), (3,)]  # odd first dims: uneven shards
    out = [torch.randn(s, generator=gen) * (i + 1) for i, s in enumerate(shapes)]
    out[1][2] = 0.0  # zeros to count
    out[3][:2] = 0.0
    return out


def _ref_norm(grads: list[torch.Tensor], p: float) -> float:
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
    return float(flat.abs().max()) if math.isinf(p) else float(flat.abs().pow(p).sum() ** (1.0 / p))


def _ref_clipped(grads: list[torch.Tensor], p: float, max_norm: float) -> list[torch.Tensor]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for q, g in zip(params, grads):
        q.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, max_norm, p)
    return [q.grad for q in params]


def _close(got: float, want: float, what: str) -> None:
    assert math.isclose(got, want, rel_tol=1e-5), f"{what}: got {got}, want {want}"


def _no_host_reads(fn):  # type: ignore[no-untyped-def]
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    with Reads():
        out = fn()
    assert Reads.count == 0, f"{Reads.count} host reads"
    return out


def pipeline_split(rank: int, world: int) -> None:
    """Each rank a pipeline stage holding whole tensors of its own: the norm is over all stages."""
    pp = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    full = _full(0)
    for p in NORMS:
        mine = [i for i in range(len(full)) if i % world == rank]
        params = [nn.Parameter(torch.zeros_like(full[i])) for i in mine]
        for q, i in zip(params, mine):
            q.grad = full[i].clone()
        total = _no_host_reads(lambda: torchtitan.clip_grad_norm_(params, 1.0, p, pp_mesh=pp))  # noqa: B023
        assert type(total) is torch.Tensor and total.dtype == torch.float32 and total.dim() == 0
        _close(float(total), _ref_norm(full, p), f"norm {p}")
        ref = _ref_clipped(full, p, 1.0)
        for q, i in zip(params, mine):
            torch.testing.assert_close(q.grad, ref[i], rtol=1e-5, atol=1e-7)


def dtensor_shards(rank: int, world: int) -> None:
    """DTensor gradients, sharded unevenly or replicated: the norm is the full tensors'."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    full = _full(1)
    placements = [[Shard(0)], [Shard(0)], [Replicate()], [Shard(0)]]
    for p in NORMS:
        params = []
        for g, pl in zip(full, placements):
            q = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, pl))
            q.grad = distribute_tensor(g.clone(), mesh, pl)
            params.append(q)
        total = _no_host_reads(lambda: torchtitan.clip_grad_norm_(params, 1.0, p))  # noqa: B023
        assert not isinstance(total, DTensor)
        _close(float(total), _ref_norm(full, p), f"norm {p}")
        for q, r in zip(params, _ref_clipped(full, p, 1.0)):
            torch.testing.assert_close(q.grad.full_tensor(), r, rtol=1e-5, atol=1e-7)


def expert_and_dense_meshes(rank: int, world: int) -> None:
    """ep_enabled: expert gradients on an "ep" mesh, dense ones on another mesh, combined with a pipeline split."""
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    ep = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    full = _full(2)
    for p in NORMS:
        params = []
        for i, g in enumerate(full):
            mesh = ep if i % 2 else dense
            q = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
            q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            params.append(q)
        total = torchtitan.clip_grad_norm_(params, 2.0, p, ep_enabled=True)
        _close(float(total), _ref_norm(full, p), f"norm {p}")
        for q, r in zip(params, _ref_clipped(full, p, 2.0)):
            torch.testing.assert_close(q.grad.full_tensor(), r, rtol=1e-5, atol=1e-7)


def nonfinite_raises_on_every_rank(rank: int, world: int) -> None:
    pp = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    q = nn.Parameter(torch.zeros(3))
    q.grad = torch.tensor([1.0, float("nan") if rank == 1 else 2.0, 3.0])
    before = q.grad.clone()
    try:
        torchtitan.clip_grad_norm_([q], 1.0, error_if_nonfinite=True, pp_mesh=pp)
    except RuntimeError as e:
        assert "not finite" in str(e), e
    else:
        raise AssertionError("no error on a NaN held by rank 1")
    torch.testing.assert_close(q.grad, before, equal_nan=True)


def megatron_group(rank: int, world: int) -> None:
    """Model-parallel split over grad_stats_parallel_group: norm and zero count over the union of the ranks' parts."""
    full = _full(3)
    explicit = dist.new_group(list(range(world)))
    for p in NORMS:
        for group in (explicit, None):  # an explicit group, and None: the default group, as in Megatron
            mine = [i for i in range(len(full)) if i % world == rank]
            params = [nn.Parameter(torch.zeros_like(full[i])) for i in mine]
            for q, i in zip(params, mine):
                q.grad = full[i].clone()
            norm = megatron.get_grad_norm_fp32([q.grad for q in params], p, group)
            assert type(norm) is float
            _close(norm, _ref_norm(full, p), f"norm {p}")
            zeros = megatron.count_zeros_fp32(params, group)
            assert type(zeros) is float and zeros == sum(int((g == 0).sum()) for g in full), zeros


def megatron_dtensor(rank: int, world: int) -> None:
    """DTensor gradients (sharded over a data-parallel mesh) and a model-parallel group of one rank each."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    singles = [dist.new_group([r]) for r in range(world)]
    full = _full(4)
    for p in NORMS:
        params = []
        for g in full:
            q = nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
            q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            params.append(q)
        norm = megatron.get_grad_norm_fp32([q.grad for q in params], p, singles[rank])
        _close(norm, _ref_norm(full, p), f"norm {p}")
        zeros = megatron.count_zeros_fp32(params, singles[rank])
        assert zeros == sum(int((g == 0).sum()) for g in full), zeros


def zero_partitions(rank: int, world: int) -> None:
    """ZeRO stage 1/2 layout: flat buffer padded to alignment * world, equal partitions; parameters straddle them."""
    full = _full(5)
    full[0][1, 1] = float("nan")  # in the first rank's partition
    full[-1].view(-1)[-1] = float("nan")  # in the last rank's: a MAX all-reduce need not keep either
    numels = [g.numel() for g in full]
    for alignment in (1, 2, 4):
        flat = torch.cat([g.reshape(-1) for g in full])
        unit = alignment * world
        padded = -(-flat.numel() // unit) * unit
        flat = torch.cat([flat, torch.full((padded - flat.numel(),), 7.0)])  # padding must not count
        size = padded // world
        part = flat[rank * size : (rank + 1) * size].clone()
        got = deepspeed.partition_stats(part, numels, alignment=alignment)
        want = reference_multi_tensor_stats(full)
        torch.testing.assert_close(got.sumsq, want[0], rtol=1e-6, atol=0, equal_nan=True)
        torch.testing.assert_close(got.amax, want[1], equal_nan=True)
        assert torch.equal(got.counts, want[2]), (got.counts, want[2])


SCENARIOS = {
    f.__name__: f
    for f in (pipeline_split, dtensor_shards, expert_and_dense_meshes, nonfinite_raises_on_every_rank, megatron_group,
              megatron_dtensor, zero_partitions)
}


def run_worker(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results: dict[str, str] = {}
    try:
        for name, fn in SCENARIOS.items():
            try:
                fn(rank, world)
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - reported by the test of this scenario
                results[name] = traceback.format_exc()
            with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown, where gloo threads can abort a finished process
