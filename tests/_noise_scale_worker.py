"""Ranks of the noise-scale tests (tests/test_noise_scale.py): real DDP on gloo with torch_gradstats.noise_scale_hook.

Kept out of the test module because multiprocessing re-imports the worker's module in each child.

The model is a parameter vector w of d elements (split over several tensors, one DDP bucket each) and the loss of
sample i is sum(w * x_i) with x_i = G + sigma * z_i, so the per-sample gradient is exactly x_i: its mean is G, its
covariance sigma^2 I, and the true noise scale is B_simple = sigma^2 d / |G|^2.
"""

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_gradstats.monitors.noise_scale import NoiseScale, noise_scale_hook

PIECES = 4  # parameters, hence buckets with a tiny bucket_cap_mb
PIECE = 256
D = PIECES * PIECE
LOCAL_BATCH = 4
SIGMA = 1.0
B_SIMPLE = 16.0  # sigma^2 d / |G|^2
G_VALUE = (SIGMA**2 * D / B_SIMPLE / D) ** 0.5  # every coordinate of G


class Linear(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.pieces = nn.ParameterList(nn.Parameter(torch.zeros(PIECE, dtype=dtype)) for _ in range(PIECES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.cat(list(self.pieces))
        return (x * w).sum(1).mean()  # gradient: the batch mean of x


def batch(step: int, rank: int, dtype: torch.dtype, *, d: int = D) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: any rank can rebuild any other's."""
    gen = torch.Generator().manual_seed(1000003 * step + rank)
    z = torch.randn(LOCAL_BATCH, d, generator=gen, dtype=torch.float64)
    return (G_VALUE + SIGMA * z).to(dtype)


def make_ddp(dtype: torch.dtype, ns: NoiseScale, hook: Any = noise_scale_hook) -> DDP:
    model = DDP(Linear(dtype), bucket_cap_mb=PIECE * 8 / 2**20 / 2)  # one parameter per bucket
    model.register_comm_hook(ns, hook)
    return model


def counting_hook(seen: list[tuple[int, bool]]) -> Any:
    """noise_scale_hook, recording each bucket's (index, is_last)."""

    def hook(state: NoiseScale, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append((bucket.index(), bucket.is_last()))
        return noise_scale_hook(state, bucket)

    return hook


# ------------------------------------------------------------------------------------------------- scenarios
def exact_float64(rank: int, world: int) -> None:
    """Three steps in float64: the EMAs equal a float64 reimplementation of the formulas on the same gradients, and
    DDP's gradients are exactly the default all-reduce's (the mean over every rank's batch)."""
    ns = NoiseScale(LOCAL_BATCH, ema=0.99)
    seen: list[tuple[int, bool]] = []
    model = make_ddp(torch.float64, ns, counting_hook(seen))
    b_small, b_big = LOCAL_BATCH, LOCAL_BATCH * world
    ema_g = ema_t = 0.0
    for step in range(3):
        model.zero_grad()
        model(batch(step, rank, torch.float64)).backward()
        local = batch(step, rank, torch.float64).mean(0)
        big = torch.stack([batch(step, r, torch.float64) for r in range(world)]).mean((0, 1))
        grad = torch.cat([p.grad for p in model.module.pieces])
        torch.testing.assert_close(grad, big, rtol=1e-12, atol=1e-12)
        s, b = float(local.pow(2).sum()), float(big.pow(2).sum())
        g2 = (b_big * b - b_small * s) / (b_big - b_small)
        tr = (s - b) / (1 / b_small - 1 / b_big)
        ema_g, ema_t = 0.99 * ema_g + 0.01 * g2, 0.99 * ema_t + 0.01 * tr
        corr = 1 - 0.99 ** (step + 1)
        assert ns.steps == step + 1, (ns.steps, step)
        for name, got, want in (
            ("grad_sq", ns.grad_sq, ema_g / corr),
            ("trace_sigma", ns.trace_sigma, ema_t / corr),
            ("b_simple", ns.b_simple, ema_t / ema_g),
        ):
            assert got.dtype == torch.float64 and got.dim() == 0, (name, got)
            assert abs(float(got) - want) <= 1e-10 * abs(want), (name, float(got), want)
    # Several buckets per step, one of them last: the fold happened once per step, not once per bucket.
    per_step = len(seen) // 3
    assert per_step >= 2 and len(seen) == 3 * per_step, seen
    assert sum(last for _, last in seen) == 3, seen


def accumulation_no_sync(rank: int, world: int) -> None:
    """Gradient accumulation under DDP: micro-batches under no_sync(), the last one synced. The hook compares the
    rank's accumulated gradient (local_batch_size = micro-batches x micro-batch) with the all-reduced one."""
    k = 3
    ns = NoiseScale(k * LOCAL_BATCH, ema=0.5)
    model = make_ddp(torch.float64, ns)
    for step in range(2):
        model.zero_grad()
        xs = [batch(10 * step + j, rank, torch.float64) for j in range(k)]
        with model.no_sync():
            for x in xs[:-1]:
                (model(x) / k).backward()
        assert ns.steps == step, "the hook ran under no_sync()"
        (model(xs[-1]) / k).backward()
        assert ns.steps == step + 1, ns.steps
    b_small, b_big = k * LOCAL_BATCH, k * LOCAL_BATCH * world
    ema_g = ema_t = 0.0
    for step in range(2):
        local = torch.cat([batch(10 * step + j, rank, torch.float64) for j in range(k)]).mean(0)
        every = [batch(10 * step + j, r, torch.float64) for r in range(world) for j in range(k)]
        s, b = float(local.pow(2).sum()), float(torch.cat(every).mean(0).pow(2).sum())
        ema_g = 0.5 * ema_g + 0.5 * (b_big * b - b_small * s) / (b_big - b_small)
        ema_t = 0.5 * ema_t + 0.5 * (s - b) / (1 / b_small - 1 / b_big)
    assert abs(float(ns.grad_sq) - ema_g / 0.75) <= 1e-10 * abs(ema_g), (float(ns.grad_sq), ema_g / 0.75)
    assert abs(float(ns.trace_sigma) - ema_t / 0.75) <= 1e-10 * abs(ema_t), (float(ns.trace_sigma), ema_t / 0.75)


def converges(rank: int, world: int) -> str:
    """500 float32 steps with the default ema: B_simple, |G|^2 and tr(Sigma) within 10% of the truth."""
    ns = NoiseScale(LOCAL_BATCH)
    seen: list[tuple[int, bool]] = []
    model = make_ddp(torch.float32, ns, counting_hook(seen))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradient does not depend on w: any lr gives the same
    start = time.perf_counter()
    for step in range(500):
        opt.zero_grad()
        model(batch(step, rank, torch.float32)).backward()
        opt.step()
    seconds = time.perf_counter() - start
    assert ns.steps == 500, ns.steps
    out = ns.to_dict()
    truth = {"noise/b_simple": B_SIMPLE, "noise/grad_sq": G_VALUE**2 * D, "noise/trace_sigma": SIGMA**2 * D}
    errors = {k: out[k] / truth[k] - 1 for k in truth}
    assert all(abs(e) < 0.1 for e in errors.values()), (out, truth)
    buckets = max(i for i, _ in seen) + 1
    assert buckets == PIECES, f"expected {PIECES} buckets, saw {buckets}"
    return f"info: {world} ranks, 500 steps in {seconds:.2f} s, {buckets} buckets, relative errors " + ", ".join(
        f"{k} {e:+.4f}" for k, e in errors.items()
    )


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def refusing_host_reads(calls: list[str]) -> Iterator[None]:
    """Every read of a tensor value into Python raises (and is recorded in ``calls``), in every thread; except the
    pure-PyTorch fallback's documented reads of CPU batches (no device, no sync: tests/test_layering.py)."""
    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def refuse(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__")
            if caller == "torch_gradstats.ops.fallback" and self.device.type == "cpu":
                return saved[name](self, *args, **kwargs)
            calls.append(f"Tensor.{name}() from {caller}")
            raise RuntimeError(f"host read: Tensor.{name}() from {caller}")

        return read

    for n in HOST_READS:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def no_host_sync(rank: int, world: int) -> None:
    """Nothing in the hook or its callbacks reads a tensor value into Python: those reads raise during backward."""
    ns = NoiseScale(LOCAL_BATCH)
    model = make_ddp(torch.float32, ns)
    model(batch(0, rank, torch.float32)).backward()  # the first step, outside the patch (DDP's rebuild)
    calls: list[str] = []
    for step in range(1, 4):
        model.zero_grad()
        loss = model(batch(step, rank, torch.float32))
        with refusing_host_reads(calls):
            loss.backward()
    assert not calls, calls
    assert ns.steps == 4, ns.steps
    assert torch.isfinite(ns.b_simple), ns.b_simple


def one_rank_group(rank: int, world: int) -> None:
    """A DDP group of one rank has B_big == B_small: backward fails with the hook's ValueError message."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    ns = NoiseScale(LOCAL_BATCH, process_group=groups[rank])
    model = DDP(Linear(torch.float32), process_group=groups[rank])
    model.register_comm_hook(ns, noise_scale_hook)
    try:
        model(batch(0, rank, torch.float32)).backward()
    except Exception as e:  # noqa: BLE001 - the reducer may wrap the hook's error
        assert "noise_scale_hook: the process group has 1 rank" in str(e), repr(e)
    else:
        raise AssertionError("backward did not raise")
    assert ns.steps == 0


SCENARIOS = {
    "exact_float64": exact_float64,
    "accumulation_no_sync": accumulation_no_sync,
    "converges": converges,
    "no_host_sync": no_host_sync,
    "one_rank_group": one_rank_group,
}


def run_worker(rank: int, world: int, port: int, outdir: str, timeout_s: float) -> None:
    """Entry point of each spawned rank: run every scenario, record outcomes in ``outdir/rank{rank}.json``."""
    torch.set_num_threads(1)
    results: dict[str, dict[str, str]] = {}
    path = os.path.join(outdir, f"rank{rank}.json")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        for name, fn in SCENARIOS.items():
            start = time.perf_counter()
            try:
                outcome = fn(rank, world)
                if isinstance(outcome, str) and outcome.startswith("info:"):
                    results[name] = {"status": "ok", "detail": outcome[5:].strip()}
                else:
                    results[name] = {"status": "ok", "detail": ""}
            except Exception:  # noqa: BLE001 - recorded, reported by the test of this scenario
                results[name] = {"status": "fail", "detail": traceback.format_exc()}
            results[name]["seconds"] = f"{time.perf_counter() - start:.3f}"
            with open(path, "w") as f:  # after every scenario: a later hang keeps what came before
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads can abort a finished process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
