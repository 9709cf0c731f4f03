"""The policies' CUDA kernels against their CPU kernels: the same decisions and states on random sequences (spikes,
NaN, Inf, level changes), under torch.cuda.set_sync_debug_mode("error") (no host sync), replayed from a captured
CUDA graph, and one kernel per step. Skipped without a CUDA device and the compiled CUDA kernels."""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch

from torch_gradstats import AdaptiveClip, NoiseScale, SpikeGuard
from torch_gradstats.ops import policy_ops as ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_policies_ops import CLIP_SETTINGS, GUARD_SETTINGS, figures

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available()
         and torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::spike_guard_step", "CUDA")),
    reason="needs a CUDA device and the compiled CUDA kernels",
)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Block sums and contracted multiply-adds on the device: equal to about 1e-15.
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-12, atol=1e-12, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.fixture(autouse=True)
def _no_sync():
    torch.cuda.set_sync_debug_mode("error")
    yield
    torch.cuda.set_sync_debug_mode(0)


def _inputs(values: list[float], dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The figures on the CPU and, copied without a sync, on the device."""
    cpu = [torch.tensor(v, dtype=dtype) for v in values]
    with torch.cuda.device(0):
        host = torch.tensor(values, dtype=dtype).pin_memory()
        dev = host.to("cuda", non_blocking=True)
    return cpu, list(dev.unbind())


@pytest.mark.parametrize(("window", "args"), GUARD_SETTINGS, ids=[f"w{w}" for w, _ in GUARD_SETTINGS])
def test_guard_cuda_equals_cpu(window, args):
    n = 4 * window + 200
    norms_cpu, norms = _inputs(figures(n, seed=window))
    losses_cpu, losses = _inputs(figures(n, seed=window + 1), torch.float32)
    cpu = torch.zeros(ops.guard_state_size(window), dtype=torch.float64)
    cpu[ops.GUARD_LAST:ops.GUARD_HIST] = math.nan
    dev = cpu.to("cuda", non_blocking=True)
    takes, want = [], []
    for i in range(n):
        with_loss = i % 7 != 3
        takes.append(ops.spike_guard_step(dev, norms[i], losses[i] if with_loss else None, *args))
        want.append(ops.spike_guard_step(cpu, norms_cpu[i], losses_cpu[i] if with_loss else None, *args))
    torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(torch.stack(takes).cpu(), torch.stack(want))
    _close(dev, cpu, "state")


@pytest.mark.parametrize(("warmup", "args"), CLIP_SETTINGS, ids=[f"warmup{w}-adopt{a[-1]}" for w, a in CLIP_SETTINGS])
def test_clip_cuda_equals_cpu(warmup, args):
    values = figures(warmup + 600, seed=warmup)
    norms_cpu, norms = _inputs(values)
    halves_cpu, halves = _inputs(values, torch.bfloat16)
    cpu = torch.zeros(ops.clip_state_size(warmup), dtype=torch.float64)
    cpu[ops.CLIP_LAST:ops.CLIP_STREAK] = math.nan
    dev = cpu.to("cuda", non_blocking=True)
    got, want = [], []
    for i in range(len(values)):
        g, g_cpu = (halves[i], halves_cpu[i]) if i % 3 == 1 else (norms[i], norms_cpu[i])
        got.append(ops.adaptive_clip_step(dev, g, *args))
        want.append(ops.adaptive_clip_step(cpu, g_cpu, *args))
    torch.cuda.set_sync_debug_mode(0)
    _close(torch.stack(got), torch.stack(want), "thresholds")
    _close(dev, cpu, "state")


def test_noise_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(3)
    big = (torch.rand(300, generator=gen, dtype=torch.float64) * 2).tolist()
    small = [b + float(d) for b, d in zip(big, torch.rand(300, generator=gen, dtype=torch.float64).tolist())]
    small[17], small[40] = math.nan, math.inf
    small_cpu, small_dev = _inputs(small, torch.float32)
    big_cpu, big_dev = _inputs(big)
    cpu = torch.zeros(ops.NOISE_STATE, dtype=torch.float64)
    dev = cpu.to("cuda", non_blocking=True)
    for i in range(300):
        ops.noise_scale_step(dev, small_dev[i], big_dev[i], 8.0, 32.0, 0.99)
        ops.noise_scale_step(cpu, small_cpu[i], big_cpu[i], 8.0, 32.0, 0.99)
    torch.cuda.set_sync_debug_mode(0)
    _close(dev, cpu, "state")


def test_policies_replayed_from_a_cuda_graph_decide_as_eager():
    """The three policies' steps captured once and replayed over a sequence decide as eager calls on the CPU."""
    torch.cuda.set_sync_debug_mode(0)  # capture itself is set up on the host
    values = figures(400, seed=11)
    eager = (SpikeGuard(window=16, sigma=3.0, max_consecutive=3), AdaptiveClip(warmup=5), NoiseScale(4))
    graphed = (SpikeGuard(window=16, sigma=3.0, max_consecutive=3, device="cuda"),
               AdaptiveClip(warmup=5, device="cuda"), NoiseScale(4))
    norm = torch.zeros((), dtype=torch.float64, device="cuda")
    loss = torch.zeros((), dtype=torch.float32, device="cuda")
    graphed[2].update(torch.ones((), device="cuda"), torch.ones((), device="cuda"), big_batch_size=8)
    eager[2].update(torch.ones(()), torch.ones(()), big_batch_size=8)

    def step():
        take = graphed[0].observe(norm, loss)
        threshold = graphed[1].threshold(norm)
        graphed[2].update(norm * 1.5, norm, big_batch_size=8)
        return take, threshold

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up on a side stream before capture, as torch recommends; then restore the states
            state = [p._state.clone() for p in graphed]
            step()
            for p, s in zip(graphed, state):
                p._state.copy_(s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        take, threshold = step()
    got, want = [], []
    torch.cuda.set_sync_debug_mode("error")
    host = torch.tensor(values, dtype=torch.float64).pin_memory()
    host_loss = (torch.tensor(values, dtype=torch.float32) * 2).pin_memory()
    for i, v in enumerate(values):
        norm.copy_(host[i], non_blocking=True)
        loss.copy_(host_loss[i], non_blocking=True)
        graph.replay()
        got.append(torch.stack([take.double(), threshold]))
        n = torch.tensor(v, dtype=torch.float64)
        want.append(torch.stack([eager[0].observe(n, n.float() * 2).double(), eager[1].threshold(n)]))
        eager[2].update(n * 1.5, n, big_batch_size=8)
    torch.cuda.set_sync_debug_mode(0)
    _close(torch.stack(got), torch.stack(want), "decisions and thresholds")
    for p, q in zip(graphed, eager):
        _close(p._state, q._state, type(p).__name__)


def test_one_kernel_per_policy_step():
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_sync_debug_mode(0)
    guard, clip, noise = SpikeGuard(device="cuda"), AdaptiveClip(device="cuda"), NoiseScale(4)
    norm = torch.ones((), dtype=torch.float64, device="cuda")
    loss = torch.ones((), device="cuda")
    noise.update(norm * 2, norm, big_batch_size=8)
    for call in (lambda: guard.observe(norm, loss), lambda: clip.threshold(norm),
                 lambda: noise.update(norm, norm, big_batch_size=8)):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, kernels


def _noise_scale_with_a_scaler_and_without(device: str) -> tuple[dict[str, float], dict[str, float]]:
    """Three windows of two micro-batches: NoiseScale(scaler=) on ``device`` under a GradScaler, and a plain
    NoiseScale on a float64 copy of the model on the CPU without one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(model).double()
    model = model.to(device)
    data = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(6)]
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)  # a power of two: float32 scaling is exact
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaled, plain = NoiseScale(8, ema=0.5, scaler=scaler), NoiseScale(8, ema=0.5)
    for step in range(3):
        for x, y in data[2 * step:2 * step + 2]:
            with scaled.micro_batch(model):
                loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)) / 2
                scaler.scale(loss).backward()
            with plain.micro_batch(reference):
                (torch.nn.functional.mse_loss(reference(x.double()), y.double()) / 2).backward()
        scaler.unscale_(optimizer)
        scaled.step(model)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        plain.step(reference)
        reference.zero_grad()
    return scaled.to_dict(), plain.to_dict()


def test_noise_scale_with_a_grad_scaler_on_cuda_reads_the_unscaled_gradients():
    """The micro-batches' readings of the scaled loss's gradients are divided by the scale's square on the device
    (the DDP hook does the same on its callback's stream), ``step`` reads the unscaled ``.grad``: the estimates are
    those of a float64 run without a scaler."""
    torch.cuda.set_sync_debug_mode(0)  # the scaler's own step reads found_inf on the host
    got, want = _noise_scale_with_a_scaler_and_without("cuda")
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-4), (key, got[key], value)
