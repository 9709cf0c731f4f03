"""The distributed path on a GPU: a 1-rank NCCL group with DTensor gradients (FSDP2's layout). After the first call
on a layout, grad_stats makes no host sync (torch.cuda.set_sync_debug_mode("error")) and can be captured in a CUDA
graph whose replays follow the gradients. Skipped without a CUDA device, NCCL and the compiled CUDA kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torch_gradstats import grad_stats

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
         and torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CUDA")),
    reason="needs a CUDA device, NCCL and the compiled CUDA kernels",
)


@pytest.fixture
def nccl_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _fsdp2_like(mesh) -> tuple[list[tuple[str, nn.Parameter]], dict[str, torch.Tensor]]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen),
            "e": torch.randn(8, 4, generator=gen).to(torch.bfloat16)}
    placements = {"w": [Shard(0)], "b": [Replicate()], "e": [Shard(1)]}
    params = []
    for name, t in full.items():
        t = t.cuda()
        p = nn.Parameter(distribute_tensor(torch.zeros_like(t), mesh, placements[name]))
        p.grad = distribute_tensor(t.clone(), mesh, placements[name])
        params.append((name, p))
    return params, full


def _reference(full: dict[str, torch.Tensor], scale: float) -> float:
    return math.sqrt(sum(float((t.double() * scale).square().sum()) for t in full.values()))


def test_no_host_sync_after_the_first_call(nccl_mesh) -> None:
    params, full = _fsdp2_like(nccl_mesh)
    grad_stats(params)  # the first call on the layout agrees on it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norms = [grad_stats(params).total_norm for _ in range(4)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = _reference(full, 1.0)
    for norm in norms:
        assert math.isclose(float(norm), want, rel_tol=1e-6), (float(norm), want)


def test_captured_in_a_cuda_graph(nccl_mesh) -> None:
    params, full = _fsdp2_like(nccl_mesh)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            grad_stats(params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grad_stats(params)
        norm = captured.total_norm
    for scale in (1.0, 3.0, 0.5):
        for name, p in params:  # the gradients change in place; the replay reads them again
            p.grad.to_local().copy_(full[name].cuda().to(p.grad.dtype) * scale)
        graph.replay()
        torch.cuda.synchronize()
        want = _reference({n: t.to(p.grad.dtype) for (n, t), (_, p) in zip(full.items(), params)}, scale)
        assert math.isclose(float(norm), want, rel_tol=1e-3), (scale, float(norm), want)
        # every figure the replay wrote: the rows' element counts and max |g| too (index lists included)
        assert captured.numel.tolist() == [t.numel() for t in full.values()]
        amax = [float((t.to(p.grad.dtype).double() * scale).abs().max())
                for (_, t), (_, p) in zip(full.items(), params)]
        assert captured.amax.tolist() == pytest.approx(amax, rel=1e-2)
