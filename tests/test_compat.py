"""The drop-ins of torch_gradstats.compat: torchtitan's clip_grad_norm_, Megatron-LM's get_grad_norm_fp32 /
count_zeros_fp32 and the ZeRO partition statistics, against torch.nn.utils.clip_grad_norm_ and a float64 reference,
in one process and on 2 gloo ranks (pipeline stages, DTensor shards, expert and dense meshes, a model-parallel
group, ZeRO partitions)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import sys
import time

import pytest
import torch
from torch import nn

import torch_gradstats.compat.shards as shards_module
import torch_gradstats.ops.fallback
from torch_gradstats.compat import deepspeed, megatron, torchtitan
from torch_gradstats.ops.op import reference_multi_tensor_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _compat_dist_worker
from _host_reads import HostReads

NORMS = [2.0, 1.0, math.inf, 3.0]


def _params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate([(5, 3), (7,), (4, 2, 2), (1,)]):
        q = nn.Parameter(torch.zeros(shape, dtype=dtype))
        q.grad = (torch.randn(shape, generator=gen) * (i + 1)).to(dtype)
        out.append(q)
    out[1].grad[3] = 0.0
    out.append(nn.Parameter(torch.zeros(2)))  # no gradient: skipped
    return out


def _twin(params: list[nn.Parameter]) -> list[nn.Parameter]:
    out = []
    for q in params:
        t = nn.Parameter(q.detach().clone())
        t.grad = None if q.grad is None else q.grad.clone()
        out.append(t)
    return out


def _ref_norm(params: list[nn.Parameter], p: float) -> float:
    flat = torch.cat([q.grad.reshape(-1).to(torch.float64) for q in params if q.grad is not None])
    return float(flat.abs().max()) if math.isinf(p) else float(flat.abs().pow(p).sum() ** (1.0 / p))


@pytest.fixture
def no_host_sync(monkeypatch):
    """Every way of reading a tensor into Python raises inside the test body. The pure-PyTorch kernel reads a CPU
    batch's min/max |x| (no sync on the CPU); it is told it is elsewhere, so it runs its sync-free path."""
    monkeypatch.setattr(torch_gradstats.ops.fallback, "_branches_on_host", lambda device: False)

    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"host read through Tensor.{name}")

        return raiser

    for name in ("item", "__bool__", "__float__", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    with HostReads() as mode:
        yield
    assert mode.count == 0, f"{mode.count} host reads"


# ------------------------------------------------------------------------------------------------ torchtitan
@pytest.mark.parametrize("p", NORMS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_torchtitan_matches_torch(p, dtype):
    ours, ref = _params(dtype=dtype), None
    ref = _twin(ours)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, p)
    got = torchtitan.clip_grad_norm_(ours, 1.0, p)
    assert type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == () and got.device == want.device
    torch.testing.assert_close(got, want)
    assert math.isclose(float(got), _ref_norm(_twin(_params(dtype=dtype)), p), rel_tol=1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_torchtitan_single_tensor_and_foreach(foreach):
    q = _params()[0]
    r = _twin([q])[0]
    torch.testing.assert_close(
        torchtitan.clip_grad_norm_(q, 0.5, foreach=foreach), torch.nn.utils.clip_grad_norm_(r, 0.5, foreach=foreach)
    )
    torch.testing.assert_close(q.grad, r.grad)


def test_torchtitan_no_gradients_is_zero_like_torch():
    got = torchtitan.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)
    want = torch.nn.utils.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)
    assert got.dtype == want.dtype and float(got) == float(want) == 0.0


@pytest.mark.parametrize("p", [2.0, math.inf], ids=str)
def test_torchtitan_no_host_sync(p, no_host_sync):
    params = _params()
    total = torchtitan.clip_grad_norm_(params, 1.0, p)
    assert total.shape == ()


def test_torchtitan_error_if_nonfinite():
    params = _params()
    params[2].grad[0, 0, 0] = float("nan")
    before = [q.grad.clone() for q in params if q.grad is not None]
    with pytest.raises(RuntimeError, match="not finite"):
        torchtitan.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for q, b in zip([q for q in params if q.grad is not None], before):
        torch.testing.assert_close(q.grad, b, equal_nan=True)
    # the same gradients without the option: NaN norm, NaN gradients, as torch does
    assert torchtitan.clip_grad_norm_(params, 1.0).isnan()


def test_torchtitan_bad_arguments():
    with pytest.raises(ValueError, match="norm_type"):
        torchtitan.clip_grad_norm_(_params(), 1.0, norm_type=0.0)
    with pytest.raises(TypeError, match="ep_enabled"):
        torchtitan.clip_grad_norm_(_params(), 1.0, ep_enabled=True)
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        torchtitan.total_norm([torch.ones(2), "x"], 2.0)


# ------------------------------------------------------------------------------------------------ megatron
@pytest.fixture
def op_calls(monkeypatch):
    """How many times the fused op reads the gradients (the real op runs)."""
    calls = [0]
    real = shards_module.multi_tensor_stats

    def counting(tensors):
        calls[0] += 1
        return real(tensors)

    monkeypatch.setattr(shards_module, "multi_tensor_stats", counting)
    yield calls


@pytest.mark.parametrize("p", [2, 1, math.inf, 3], ids=str)
def test_megatron_norm_and_zeros_match_reference(p, op_calls, monkeypatch):
    params = _params()
    grads = [q.grad for q in params if q.grad is not None]
    norm = megatron.get_grad_norm_fp32(grads, p)
    assert type(norm) is float and math.isclose(norm, _ref_norm(params, p), rel_tol=1e-7)
    transfers = [0]
    real = megatron.to_host

    def counting(*args, **kwargs):
        transfers[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(megatron, "to_host", counting)
    zeros = megatron.count_zeros_fp32(params, None)
    assert type(zeros) is float and zeros == sum(int((g == 0).sum()) for g in grads) == 1
    assert op_calls[0] == 2 and transfers[0] == 1  # each call reads the gradients as they are, and syncs once


def test_megatron_sees_writes_that_bump_no_version(op_calls):
    params = _params()
    grads = [q.grad for q in params if q.grad is not None]
    before = megatron.get_grad_norm_fp32(grads)
    torch._foreach_mul_(grads, 0.5)  # how a clip scales gradients in place (apex's multi_tensor_scale alike)
    assert megatron.get_grad_norm_fp32(grads) == pytest.approx(before / 2, rel=1e-12)
    for g in grads:
        g.data.zero_()  # a write through .data
    assert megatron.get_grad_norm_fp32(grads) == 0.0
    assert megatron.count_zeros_fp32(params, None) == sum(g.numel() for g in grads)
    grads[0].data.fill_(2.0)
    assert megatron.get_grad_norm_fp32(grads, math.inf) == 2.0
    assert megatron.count_zeros_fp32(params, None) == sum(g.numel() for g in grads[1:])
    assert megatron.get_grad_norm_fp32(grads[0]) == pytest.approx(2.0 * grads[0].numel() ** 0.5)


def test_megatron_count_zeros_skips_what_megatron_skips(op_calls):
    params = _params()
    params[1].shared = True  # the zero is in a shared parameter: not counted
    assert megatron.count_zeros_fp32(params, None) == 0
    q = nn.Parameter(torch.zeros(3))
    q.decoupled_grad = torch.tensor([0.0, 1.0, 0.0])
    assert megatron.count_zeros_fp32([q], None, use_decoupled_grad=True) == 2
    assert megatron.count_zeros_fp32([q], None) == 0  # no .grad


def test_megatron_single_tensor_and_bad_arguments():
    g = torch.tensor([3.0, 4.0])
    assert megatron.get_grad_norm_fp32(g) == 5.0
    with pytest.raises(ValueError, match="norm_type"):
        megatron.get_grad_norm_fp32(g, -1)
    with pytest.raises(TypeError, match="norm_type"):
        megatron.get_grad_norm_fp32(g, "2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"grads_for_norm\[1\]"):
        megatron.get_grad_norm_fp32([g, 2.0])  # type: ignore[list-item]
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="not initialized"):
            megatron.get_grad_norm_fp32(g, 2, object())


# ------------------------------------------------------------------------------------------------ ZeRO partitions
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("alignment", [1, 2, 4])
def test_zero_partition_pieces_cover_each_element_once(world, alignment):
    numels = [5, 9, 0, 1, 6, 33]
    pieces = deepspeed.partition_pieces(numels, world, alignment)
    size = -(-sum(numels) // (alignment * world)) * alignment
    assert len(pieces) == world and size % alignment == 0
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank, mine in enumerate(pieces):
        for p in mine:
            assert 0 <= p.partition_start and p.partition_start + p.length <= size
            # the piece's place in the flat buffer is the parameter's offset plus its start
            assert rank * size + p.partition_start == sum(numels[: p.param]) + p.param_start
            seen[p.param][p.param_start : p.param_start + p.length] += 1
    assert all(bool((s == 1).all()) for s in seen)


def test_zero_partition_stats_single_rank_and_bad_inputs():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    grads = [torch.randn(3, 2), torch.zeros(4), torch.tensor([float("inf")])]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.ones(1)])  # padded to alignment 2
    got = deepspeed.partition_stats(flat, [6, 4, 1], alignment=2)
    want = reference_multi_tensor_stats(grads)
    torch.testing.assert_close(got.sumsq, want[0])
    torch.testing.assert_close(got.amax, want[1])
    assert torch.equal(got.counts, want[2])
    with pytest.raises(ValueError, match="12 elements"):
        deepspeed.partition_stats(flat[:-1], [6, 4, 1], alignment=2)
    with pytest.raises(TypeError, match="partition"):
        deepspeed.partition_stats([1.0], [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"numels\[1\]"):
        deepspeed.partition_pieces([1, -2], 2)
    with pytest.raises(TypeError, match="world_size"):
        deepspeed.partition_pieces([1], 2.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ 2 gloo ranks
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp

    world, outdir = 2, str(tmp_path_factory.mktemp("compat"))
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.tensor", "_compat_dist_worker"])
    ctx = mp.start_processes(
        _compat_dist_worker.run_worker, args=(world, _free_port(), outdir), nprocs=world, join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-rank run did not finish in 180 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
    out = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(_compat_dist_worker.SCENARIOS))
def test_two_ranks(dist_results, scenario):
    failed = [f"--- rank {r}:\n{res.get(scenario, 'not reached')}" for r, res in enumerate(dist_results)
              if res.get(scenario) != "ok"]
    assert not failed, "\n".join(failed)
