"""Ranks of tests/test_monitors_models.py's DDP tests: noise_scale_hook on the model zoo's models under real DDP (gloo),
with bfloat16 autocast and a GradScaler given to the NoiseScale; and NoiseScale's accumulation path (micro_batch and
step given the DDP module, no_sync() for every micro-batch but the last).

Kept out of the test module because multiprocessing re-imports the worker's module in each child. Each rank checks
its own NoiseScale against a float64 reference it computes from a plain copy of the model: every rank's gradient
of the unscaled loss (the small batches), their mean (the big batch), the formulas of docs/noise_scale.md.
"""

import contextlib
import copy
import datetime
import json
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
from model_zoo import CheckpointedEncoder, gpt2, resnet
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_gradstats.monitors.noise_scale import NoiseScale, noise_scale_hook

BATCH = 2  # samples per rank per step
STEPS = 3
ACCUMULATE = 2  # micro-batches per optimizer step (check_accumulation)
INF_STEP = 1  # rank 0's loss is multiplied by inf: every rank's scaler skips the step


def zoo(name: str) -> tuple[nn.Module, object]:
    if name == "resnet":
        def resnet_loss(m: nn.Module, j: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(j)
            x, y = torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)
            return nn.functional.cross_entropy(m(x), y)

        return resnet(), resnet_loss
    if name == "gpt2":
        def gpt2_loss(m: nn.Module, j: int) -> torch.Tensor:
            ids = torch.randint(0, 64, (BATCH, 8), generator=torch.Generator().manual_seed(j))
            torch.manual_seed(10_000 + j)  # GPT-2's dropout
            return m(input_ids=ids, labels=ids).loss

        return gpt2(), gpt2_loss

    def encoder_loss(m: nn.Module, j: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(j)
        return nn.functional.mse_loss(m(torch.randn(BATCH, 5, 8, generator=g)), torch.randn(BATCH, 5, 4, generator=g))

    return CheckpointedEncoder(use_reentrant=False), encoder_loss


def grad64(model: nn.Module, loss_fn: object, j: int) -> list[torch.Tensor]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, j)  # type: ignore[operator]
    loss.backward()
    out = [p.grad.to(torch.float64).clone() for p in model.parameters()]
    model.zero_grad()
    return out


def check_model(name: str, rank: int, world: int) -> str:
    model, loss_fn = zoo(name)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ns = NoiseScale(BATCH, ema=0.5, scaler=scaler)
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    ddp.register_comm_hook(ns, noise_scale_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: the reference stays valid
    b_small, b_big = BATCH, BATCH * world
    eg = et = weight = size = 0.0
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(ddp, 100 * step + rank)  # type: ignore[operator]
        if step == INF_STEP and rank == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if step != INF_STEP:
            grads = [grad64(reference, loss_fn, 100 * step + r) for r in range(world)]
            mean = [sum(g[i] for g in grads) / world for i in range(len(grads[0]))]
            for i, p in enumerate(model.parameters()):  # DDP's gradient is the mean, as with the default hook
                torch.testing.assert_close(p.grad.to(torch.float64), mean[i], rtol=1e-4, atol=1e-7)
            s = math.fsum(float(t.square().sum()) for t in grads[rank])
            b = math.fsum(float(t.square().sum()) for t in mean)
            size = max(size, s, b)
            g2 = (b_big * b - b_small * s) / (b_big - b_small)
            tr = (s - b) / (1 / b_small - 1 / b_big)
            eg, et, weight = 0.5 * eg + 0.5 * g2, 0.5 * et + 0.5 * tr, 0.5 * weight + 0.5
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert scaler.get_scale() == 2.0**11, scaler.get_scale()  # backed off once, at the Inf
    assert ns.steps == STEPS, ns.steps
    got = ns.to_dict()
    # |G|^2 and tr(Sigma) are differences of near numbers: their errors are relative to those numbers
    for key, want, tol in (("noise/grad_sq", eg / weight, 1e-5 * size),
                           ("noise/trace_sigma", et / weight, 4e-5 * size)):
        assert abs(got[key] - want) <= tol, (key, got[key], want)
    return f"{name}: {got}"


def check_accumulation(name: str, rank: int, world: int) -> str:
    """NoiseScale.micro_batch and step given the DDP module, gradient accumulation with no_sync() for every
    micro-batch but the last: each small batch is one micro-batch of this rank, the big batch is DDP's .grad, the mean
    over every rank's micro-batches (ACCUMULATE x BATCH x world samples)."""
    model, loss_fn = zoo(name.removeprefix("accumulation_"))
    reference = copy.deepcopy(model)
    ns = NoiseScale(BATCH, ema=0.5)
    ddp = DDP(model, bucket_cap_mb=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: the reference stays valid
    b_small, b_big = BATCH, BATCH * ACCUMULATE * world
    eg = et = weight = size = 0.0
    for step in range(STEPS):
        j0 = 100 * step + ACCUMULATE * rank
        for j in range(ACCUMULATE):
            sync = contextlib.nullcontext() if j == ACCUMULATE - 1 else ddp.no_sync()
            with sync, ns.micro_batch(ddp):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_fn(ddp, j0 + j) / ACCUMULATE  # type: ignore[operator]
                loss.backward()
        ns.step(ddp)
        mine = [grad64(reference, loss_fn, j0 + j) for j in range(ACCUMULATE)]
        every = [grad64(reference, loss_fn, 100 * step + j) for j in range(ACCUMULATE * world)]
        mean = [sum(g[i] for g in every) / len(every) for i in range(len(every[0]))]
        s = math.fsum(math.fsum(float(t.square().sum()) for t in g) for g in mine) / ACCUMULATE
        b = math.fsum(float(t.square().sum()) for t in mean)
        size = max(size, s, b)
        g2 = (b_big * b - b_small * s) / (b_big - b_small)
        tr = (s - b) / (1 / b_small - 1 / b_big)
        eg, et, weight = 0.5 * eg + 0.5 * g2, 0.5 * et + 0.5 * tr, 0.5 * weight + 0.5
        optimizer.step()
        optimizer.zero_grad()
    got = ns.to_dict()
    for key, want, tol in (("noise/grad_sq", eg / weight, 1e-5 * size),
                           ("noise/trace_sigma", et / weight, 4e-5 * size)):
        assert abs(got[key] - want) <= tol, (key, got[key], want)
    # The same NoiseScale as the module's comm hook too would fold each step twice: refused.
    hooked = DDP(model, bucket_cap_mb=0.01)
    hooked.register_comm_hook(ns, noise_scale_hook)
    try:
        ns.step(hooked)
    except ValueError as exc:
        assert "noise_scale_hook" in str(exc), exc
    else:
        raise AssertionError("step() on a DDP module whose noise_scale_hook is this NoiseScale did not raise")
    return f"{name}: {got}"


def run_worker(rank: int, world: int, port: int, outdir: str, models: list[str], timeout_s: float) -> None:
    torch.set_num_threads(1)
    results: dict[str, dict[str, str]] = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for name in models:
            try:
                check = check_accumulation if name.startswith("accumulation_") else check_model
                results[name] = {"status": "ok", "detail": check(name, rank, world)}
            except Exception:  # noqa: BLE001 - recorded, reported by the test
                results[name] = {"status": "fail", "detail": traceback.format_exc()}
            with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
