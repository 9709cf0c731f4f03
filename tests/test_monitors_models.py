"""The monitors (UpdateRatio, NoiseScale, FlightRecorder) on the architectures people train (tests/model_zoo.py): a
training loop with evaluation under ``torch.inference_mode`` and ``torch.no_grad`` between the steps, AMP with a
GradScaler (skipped steps included), a lasting change of level, parameters frozen mid-run and checkpoints. Every
figure is compared with a float64 reference computed here from the gradients and weights, not by the library."""

from __future__ import annotations

import copy
import io
import json
import logging
import math
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import CheckpointedEncoder, gpt2, resnet
from torch import nn

import torch_gradstats as tg
from torch_gradstats import FlightRecorder, NoiseScale
from torch_gradstats.updates import UpdateRatio, grad_and_weight_stats

# A reentrant checkpoint run under no_grad (evaluation) warns that its inputs need no gradient: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

MODELS = ["resnet", "gpt2", "encoder", "encoder_reentrant"]
LossFn = Callable[[nn.Module, int], torch.Tensor]


def zoo(name: str) -> tuple[nn.Module, LossFn]:
    """A zoo model and its loss on batch ``j`` (inputs and dropout seeded by ``j``: the same batch gives the same
    loss on the model and on a copy of it)."""
    if name == "resnet":
        def resnet_loss(m: nn.Module, j: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(j)
            x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 5, (2,), generator=g)
            return nn.functional.cross_entropy(m(x), y)

        return resnet(), resnet_loss
    if name == "gpt2":
        def gpt2_loss(m: nn.Module, j: int) -> torch.Tensor:
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(j))
            torch.manual_seed(10_000 + j)  # GPT-2's dropout
            return m(input_ids=ids, labels=ids).loss  # the loss is computed inside forward

        return gpt2(), gpt2_loss

    def encoder_loss(m: nn.Module, j: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(j)
        return nn.functional.mse_loss(m(torch.randn(2, 5, 8, generator=g)), torch.randn(2, 5, 4, generator=g))

    return CheckpointedEncoder(use_reentrant=name == "encoder_reentrant"), encoder_loss


def evaluate(model: nn.Module, loss_fn: LossFn) -> None:
    """Evaluation between training steps, under both of torch's no-autograd modes."""
    model.eval()
    with torch.inference_mode():
        loss_fn(model, 999)
    with torch.no_grad():
        loss_fn(model, 998)
    model.train()


def weights64(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters()}


def grads64(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().to(torch.float64).clone() for n, p in model.named_parameters() if p.grad is not None}


def sq(tensors: Any) -> float:
    return math.fsum(float(t.to(torch.float64).square().sum()) for t in tensors)


def ratio_of(num: float, den: float) -> float:
    """num / den as the documented ratios give it: 0 for 0 / 0, inf for a non-zero over 0 (a zero-initialised
    BatchNorm bias)."""
    return (0.0 if num == 0 else math.inf) if den == 0 else num / den


# ================================================================================================= UpdateRatio
def check_update(report: Any, before: dict[str, torch.Tensor], model: nn.Module, rel: float = 1e-6) -> None:
    """The measured ||Δw|| and ||Δw|| / ||w_after|| of every parameter against float64."""
    after = weights64(model)
    assert set(report.update_ratios) == set(after)
    for n, w in after.items():
        delta = float((before[n] - w).norm())
        want = ratio_of(delta, float(w.norm()))
        assert report.delta_norms[n] == pytest.approx(delta, rel=rel, abs=1e-30), n
        assert report.update_ratios[n] == pytest.approx(want, rel=rel, abs=1e-30), n


@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder"])
def test_update_ratio_in_training_with_evaluation_between_steps(name: str) -> None:
    model, loss_fn = zoo(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ratio = UpdateRatio(model.named_parameters())
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        grads, before = grads64(model), weights64(model)
        stats = grad_and_weight_stats(model.named_parameters(), optimizer=optimizer)
        with ratio:
            optimizer.step()
        kept = (ratio.stats.delta_sumsq.clone(), ratio.stats.weight_sumsq.clone())
        after = grads64(model)  # the monitors read the gradients and never write them
        assert all(torch.equal(after[n], g) for n, g in grads.items()) and after.keys() == grads.keys()
        evaluate(model, loss_fn)  # must not touch the measurement
        assert torch.equal(ratio.stats.delta_sumsq, kept[0]) and torch.equal(ratio.stats.weight_sumsq, kept[1])
        stats.update = ratio.stats
        report = stats.report()
        check_update(report, before, model)
        assert report.grads.total_norm == pytest.approx(math.sqrt(sq(grads.values())), rel=1e-6)
        for n, g in grads.items():  # lr * ||g|| / ||w||, the weights as they were when the stats were taken
            assert report.weight_norms[n] == pytest.approx(float(before[n].norm()), rel=1e-6)
            want = 1e-2 * ratio_of(float(g.norm()), float(before[n].norm()))
            assert report.lr_update_ratios[n] == pytest.approx(want, rel=1e-6)
        # Adam's update is normalised per element: the measured ratio is not the SGD estimate
        assert report.update_ratios != pytest.approx(report.lr_update_ratios, rel=0.1)


@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder"])
def test_update_ratio_with_amp_and_a_grad_scaler_and_a_skipped_step(name: str) -> None:
    """bfloat16 autocast and a GradScaler: figures taken after unscale_ are the true ones; the step the scaler
    skips (an Inf in the scaled gradients) changes no weight, so its measured ratio is exactly 0 everywhere."""
    model, loss_fn = zoo(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ratio = UpdateRatio(model.named_parameters())
    reference = copy.deepcopy(model)
    for step in range(3):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, step)
        scaler.scale(loss).backward()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(reference, step).backward()  # the same forward, no loss scale
        want = {n: p.grad.to(torch.float64) for n, p in reference.named_parameters()}
        if step == 1:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf
        scale = scaler.get_scale()
        scaler.unscale_(optimizer)
        stats = grad_and_weight_stats(model.named_parameters(), optimizer=optimizer)
        before = weights64(model)
        with ratio:
            scaler.step(optimizer)
        scaler.update()
        stats.update = ratio.stats
        report = stats.report()
        check_update(report, before, model)
        if step == 1:
            assert scaler.get_scale() == scale / 2
            assert set(report.update_ratios.values()) == {0.0} and set(report.delta_norms.values()) == {0.0}
            assert report.grads.inf_count == 1
        else:
            assert min(report.update_ratios.values()) > 0
            for n, g in want.items():  # unscaled: the scaled gradients are the true ones times a power of two
                assert report.grads.norms[n] == pytest.approx(float(g.norm()), rel=1e-5), n
                want = 0.05 * ratio_of(float(g.norm()), float(before[n].norm()))
                assert report.lr_update_ratios[n] == pytest.approx(want, rel=1e-5)
        # keep the reference on the same weights
        reference.load_state_dict(model.state_dict())


@pytest.mark.slow
def test_update_ratio_follows_a_lasting_ten_fold_learning_rate_change() -> None:
    """Plain SGD on the checkpointed encoder for 240 steps, the learning rate x10 from step 120 on: every step's
    measured ratio against float64, and the ratio's level after the change is 10x the level before it."""
    model, loss_fn = zoo("encoder")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ratio = UpdateRatio(model.named_parameters())
    head: list[float] = []
    for step in range(240):
        if step == 120:
            for group in optimizer.param_groups:
                group["lr"] = 1e-2
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        g = model.head.weight.grad.to(torch.float64).clone()
        with ratio:
            optimizer.step()
        r = ratio.stats.ratios[ratio.names.index("head.weight")].item()
        want = optimizer.param_groups[0]["lr"] * float(g.norm()) / float(model.head.weight.to(torch.float64).norm())
        assert r == pytest.approx(want, rel=1e-5), step
        head.append(r / float(g.norm()))  # the ratio per unit of gradient: lr / ||w_after||
    before, after = sum(head[100:120]) / 20, sum(head[121:141]) / 20
    assert after / before == pytest.approx(10, rel=0.05)


def test_update_ratio_with_a_parameter_frozen_mid_run_and_one_without_a_gradient() -> None:
    """GPT-2: the position embedding is frozen after step 1 (its .grad None from then on) and the last block's
    final projection gets no gradient at step 2 (grad None though it requires grad): both keep a ratio of exactly
    0, the report's gradient figures leave them out, and every other parameter matches float64."""
    model, loss_fn = zoo("gpt2")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ratio = UpdateRatio(model.named_parameters())
    frozen, idle = "transformer.wpe.weight", "transformer.h.1.mlp.c_proj.weight"
    params = dict(model.named_parameters())
    for step in range(4):
        if step == 2:
            params[frozen].requires_grad_(False)
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        if step == 2:
            params[idle].grad = None
        before = weights64(model)
        stats = grad_and_weight_stats(model.named_parameters(), optimizer=optimizer)
        with ratio:
            optimizer.step()
        stats.update = ratio.stats
        report = stats.report()
        check_update(report, before, model)
        if step >= 2:
            assert report.update_ratios[frozen] == 0.0 and frozen not in report.grads.norms
        if step == 2:
            assert report.update_ratios[idle] == 0.0 and idle not in report.lr_update_ratios
        if step < 2:
            assert report.update_ratios[frozen] > 0
        assert set(report.grads.norms) == set(grads64(model))


# ================================================================================================= NoiseScale
def reference_pair(reference: nn.Module, loss_fn: LossFn, batches: list[int],
                   autocast: bool = False) -> tuple[float, float]:
    """(k * sum_j |g_j / k|^2, |sum_j g_j / k|^2) in float64, each micro-batch's gradient from its own backward on a
    copy of the model."""
    k = len(batches)
    total: dict[str, torch.Tensor] = {}
    small = 0.0
    for j in batches:
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(reference, j) / k
        loss.backward()
        g = grads64(reference)
        small += sq(g.values())
        for n, t in g.items():
            total[n] = total[n] + t if n in total else t
    reference.zero_grad()
    return k * small, sq(total.values())


def reference_estimates(pairs: list[tuple[float, float]], b_small: int, k: int, ema: float) -> dict[str, float]:
    """The EMAs of docs/noise_scale.md in float64, bias-corrected, over the finite pairs."""
    b_big = k * b_small
    eg = et = weight = 0.0
    for s, b in pairs:
        g2 = (b_big * b - b_small * s) / (b_big - b_small)
        tr = (s - b) / (1 / b_small - 1 / b_big)
        if not (math.isfinite(g2) and math.isfinite(tr)):
            continue
        eg, et, weight = ema * eg + (1 - ema) * g2, ema * et + (1 - ema) * tr, ema * weight + (1 - ema)
    return {"noise/b_simple": et / eg, "noise/grad_sq": eg / weight, "noise/trace_sigma": et / weight}


def assert_estimates(ns: NoiseScale, pairs: list[tuple[float, float]], k: int, rel: float = 1e-5) -> None:
    want = reference_estimates(pairs, ns.local_batch_size, k, ns.ema)
    got = ns.to_dict()
    # |G|^2 is a difference of two near numbers: its error is relative to them, not to itself
    size = max(max(abs(s), abs(b)) for s, b in pairs if math.isfinite(s) and math.isfinite(b))
    assert got["noise/grad_sq"] == pytest.approx(want["noise/grad_sq"], rel=rel, abs=rel * size)
    assert got["noise/trace_sigma"] == pytest.approx(want["noise/trace_sigma"], rel=rel, abs=rel * size * 4)
    assert got["noise/b_simple"] == pytest.approx(want["noise/b_simple"], rel=rel * 100)


def window(ns: NoiseScale, model: nn.Module, loss_fn: LossFn, batches: list[int],
           scaler: Any = None, autocast: bool | None = None, between: Callable[[], None] | None = None) -> None:
    """One accumulation window read by ``ns`` (bfloat16 autocast with a scaler unless told); ``between`` runs
    between its micro-batches."""
    k = len(batches)
    amp = scaler is not None if autocast is None else autocast
    for i, j in enumerate(batches):
        if i and between is not None:
            between()
        with ns.micro_batch(model):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(model, j) / k
            (loss if scaler is None else scaler.scale(loss)).backward()


@pytest.mark.parametrize("name", MODELS)
def test_noise_scale_accumulation_with_evaluation_between_steps(name: str) -> None:
    model, loss_fn = zoo(name)
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    ns = NoiseScale(2, ema=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pairs = []
    for step in range(3):
        batches = [10 * step, 10 * step + 1]
        pairs.append(reference_pair(reference, loss_fn, batches))
        window(ns, model, loss_fn, batches, between=lambda: evaluate(model, loss_fn))  # evaluation mid-window too
        ns.step(model)
        if step == 0:  # the hooks read the contributions and leave .grad as it is without them, bit for bit
            for j in batches:
                (loss_fn(plain, j) / 2).backward()
            want, got = grads64(plain), grads64(model)
            assert got.keys() == want.keys() and all(torch.equal(g, want[n]) for n, g in got.items())
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ns.state_dict().items()}
        evaluate(model, loss_fn)
        with torch.inference_mode():
            ns.to_dict()  # reading in evaluation changes nothing
        assert {k: v for k, v in ns.state_dict().items()}.keys() == state.keys()
        for k, v in ns.state_dict().items():
            assert torch.equal(v, state[k]) if isinstance(v, torch.Tensor) else v == state[k]
        optimizer.step()
        optimizer.zero_grad()
        reference.load_state_dict(model.state_dict())
    assert ns.steps == 3
    assert_estimates(ns, pairs, 2)


@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder_reentrant"])
def test_noise_scale_with_amp_and_a_grad_scaler(name: str) -> None:
    """bfloat16 autocast and a GradScaler given to NoiseScale: the micro-batches are read as gradients of the
    scaled loss and divided by the scale's square, ``step`` reads the unscaled ``.grad``: the figures are those of
    the unscaled gradients (float64 reference without a scaler). A window with an Inf is left out and the scaler
    halves its scale: the estimates go on at the new scale as if nothing had happened."""
    model, loss_fn = zoo(name)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: one reference model suffices
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    ns = NoiseScale(2, ema=0.5, scaler=scaler)
    pairs = []
    for step in range(3):
        batches = [10 * step, 10 * step + 1]
        window(ns, model, loss_fn, batches, scaler)
        if step == 1:  # an Inf in the accumulated gradient: the scaler skips the step and backs off
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf
            pairs.append((math.inf, math.inf))
        else:
            pairs.append(reference_pair(reference, loss_fn, batches, autocast=True))
        if step == 0:
            with pytest.raises(ValueError, match=r"after scaler.unscale_\(optimizer\)"):
                ns.step(model)  # .grad is still scaled here; the window is kept
        scaler.unscale_(optimizer)
        ns.step(model)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert scaler.get_scale() == 2.0**13
    assert ns.steps == 3
    assert_estimates(ns, pairs, 2)


@pytest.mark.slow
def test_noise_scale_and_flight_recorder_through_a_lasting_ten_fold_jump_of_the_loss_scale() -> None:
    """A GradScaler whose scale jumps 10x at step 12 and stays (growth_factor=10; float32, so the scaled gradients
    are the true ones to rounding): NoiseScale's estimates and the flight recorder's norms, taken after
    unscale_, are those of the unscaled gradients all along (float64 reference without a scaler)."""
    model, loss_fn = zoo("encoder")
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_factor=10.0, growth_interval=12)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ns, recorder = NoiseScale(2, ema=0.8, scaler=scaler), FlightRecorder(capacity=8)
    pairs, scales = [], []
    for step in range(20):
        batches = [2 * step, 2 * step + 1]
        pairs.append(reference_pair(reference, loss_fn, batches))
        window(ns, model, loss_fn, batches, scaler, autocast=False)
        scales.append(scaler.get_scale())
        scaler.unscale_(optimizer)
        ns.step(model)
        recorder.record(tg.grad_stats(model.named_parameters()))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if step in (11, 19):
            assert_estimates(ns, pairs, 2)
    assert scales == [4.0] * 12 + [40.0] * 8
    rows = recorder.to_dicts()
    assert [r["step"] for r in rows] == list(range(12, 20))
    for row, (_, big) in zip(rows, pairs[12:]):
        assert row["total_norm"] == pytest.approx(math.sqrt(big), rel=1e-6)


def test_noise_scale_state_dict_saved_and_loaded_mid_run_continues_the_same_run() -> None:
    model, loss_fn = zoo("gpt2")
    ns, resumed = NoiseScale(2, ema=0.9), None
    reference = copy.deepcopy(model)
    pairs = []
    saved = io.BytesIO()
    for step in range(6):
        batches = [10 * step, 10 * step + 1]
        pairs.append(reference_pair(reference, loss_fn, batches))
        window(ns, model, loss_fn, batches)
        ns.step(model)
        model.zero_grad()
        if step == 2:
            torch.save(ns.state_dict(), saved)
            saved.seek(0)
            resumed = NoiseScale(2, ema=0.9)
            resumed.load_state_dict(torch.load(saved))  # weights_only: plain numbers and tensors
        elif step > 2:
            assert resumed is not None
            window(resumed, model, loss_fn, batches)
            resumed.step(model)
            model.zero_grad()
    assert resumed is not None and resumed.steps == ns.steps == 6
    assert resumed.to_dict() == ns.to_dict()
    assert_estimates(resumed, pairs, 2)


def test_noise_scale_rolled_back_to_a_saved_state_mid_window() -> None:
    """GPT-2: a state saved after the first window, a failure after one micro-batch of the second (the window is
    given up, the gradients cleared), a rollback to the saved state and the second window again: the estimates
    are those of the two windows, not of the given-up micro-batch counted with the second window's."""
    model, loss_fn = zoo("gpt2")
    reference = copy.deepcopy(model)
    ns = NoiseScale(2, ema=0.5)
    pairs = [reference_pair(reference, loss_fn, [0, 1]), reference_pair(reference, loss_fn, [2, 3])]
    window(ns, model, loss_fn, [0, 1])
    ns.step(model)
    model.zero_grad()
    saved = ns.state_dict()
    window(ns, model, loss_fn, [2])  # ...and the step fails here
    model.zero_grad()
    ns.load_state_dict(saved)
    window(ns, model, loss_fn, [2, 3])
    ns.step(model)
    assert ns.steps == 2
    assert_estimates(ns, pairs, 2)


def test_noise_scale_with_a_parameter_frozen_mid_run() -> None:
    """The checkpointed encoder (reentrant): the first layer's first linear map is frozen from the second window
    on; the estimates are those of the parameters still training (float64 reference over the same parameters)."""
    model, loss_fn = zoo("encoder_reentrant")
    reference = copy.deepcopy(model)
    ns = NoiseScale(2, ema=0.5)
    pairs = []
    for step in range(3):
        if step == 1:
            model.encoder.layers[0].linear1.weight.requires_grad_(False)
            reference.encoder.layers[0].linear1.weight.requires_grad_(False)
        batches = [10 * step, 10 * step + 1]
        pairs.append(reference_pair(reference, loss_fn, batches))
        window(ns, model, loss_fn, batches)
        ns.step(model)
        model.zero_grad()
    assert model.encoder.layers[0].linear1.weight.grad is None
    assert_estimates(ns, pairs, 2)


def _two_ranks(tmp_path_factory: pytest.TempPathFactory, label: str, names: list[str]
               ) -> list[dict[str, dict[str, str]]]:
    """Two gloo ranks running the scenarios ``names`` of tests/_monitors_ddp_worker.py on the zoo's models: each
    rank's outcomes."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("transformers")
    import _monitors_ddp_worker as worker
    import torch.multiprocessing as mp

    outdir = str(tmp_path_factory.mktemp(label))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    multiprocessing.set_forkserver_preload(["torch", "torch.nn.parallel", "_monitors_ddp_worker"])
    ctx = mp.start_processes(worker.run_worker, args=(2, port, outdir, names, 60.0),
                             nprocs=2, join=False, start_method="forkserver")
    deadline = time.monotonic() + 300
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-rank run did not finish in 300 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    results = []
    for rank in range(2):
        with open(os.path.join(outdir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="module")
def ddp_amp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, str]]]:
    """Two gloo ranks running tests/_monitors_ddp_worker.py on the zoo's models (ResNet, GPT-2, encoder)."""
    return _two_ranks(tmp_path_factory, "ddp_amp", ["resnet", "gpt2", "encoder"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder"])
def test_noise_scale_hook_under_ddp_with_amp_and_a_grad_scaler(ddp_amp_results: Any, name: str) -> None:
    """noise_scale_hook on 2 gloo ranks, bfloat16 autocast and a GradScaler given to the NoiseScale, one step
    skipped at an Inf: each rank's figures are those of the unscaled gradients (float64 reference in the worker)
    and DDP's gradients the mean of the ranks' own."""
    outcomes = [r.get(name, {"status": "fail", "detail": "not reached"}) for r in ddp_amp_results]
    failed = [f"--- rank {rank}:\n{o['detail']}" for rank, o in enumerate(outcomes) if o["status"] != "ok"]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_noise_scale_follows_a_lasting_ten_fold_change_of_the_loss() -> None:
    """200 windows on the checkpointed encoder, the loss x10 from window 100 on (its gradients x10, |G|^2 and
    tr(Sigma) x100, B_simple unchanged): the EMAs against float64 at the change and at the end, and the level
    after it."""
    model, base = zoo("encoder")
    reference = copy.deepcopy(model)

    def loss_fn(m: nn.Module, j: int) -> torch.Tensor:
        return base(m, j % 1000) * (10.0 if j >= 1000 else 1.0)

    ns = NoiseScale(2, ema=0.9)
    pairs = []
    for step in range(200):
        batches = [(2 * step + i) + (1000 if step >= 100 else 0) for i in range(2)]
        pairs.append(reference_pair(reference, loss_fn, batches))
        window(ns, model, loss_fn, batches)
        ns.step(model)
        model.zero_grad()
        if step in (99, 199):
            assert_estimates(ns, pairs, 2, rel=1e-4)
            level = ns.to_dict()
            if step == 99:
                low = level
    assert level["noise/trace_sigma"] / low["noise/trace_sigma"] == pytest.approx(100, rel=0.5)


# ================================================================================================= FlightRecorder
def check_rows(rows: list[dict[str, Any]], want: list[tuple[float, float, float, int, int]]) -> None:
    """Rows against (total norm, max |g|, loss, NaN count, Inf count) from float64."""
    assert len(rows) == len(want)
    for row, (norm, amax, loss, nans, infs) in zip(rows, want):
        if math.isfinite(norm):
            assert row["total_norm"] == pytest.approx(norm, rel=1e-6)
            assert row["inf_norm"] == amax
        assert (row["nan_count"], row["inf_count"]) == (nans, infs)
        assert row["loss"] == pytest.approx(loss, rel=1e-12)


def figures(model: nn.Module, loss: torch.Tensor) -> tuple[float, float, float, int, int]:
    g = list(grads64(model).values())
    return (math.sqrt(sq(g)), max(float(t.abs().max()) for t in g), float(loss),
            sum(int(t.isnan().sum()) for t in g), sum(int(t.isinf().sum()) for t in g))


@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder"])
def test_flight_recorder_in_training_with_evaluation_between_steps(name: str) -> None:
    model, loss_fn = zoo(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recorder = FlightRecorder(capacity=3)
    want = []
    for step in range(5):
        optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        want.append(figures(model, loss))
        stats = tg.clip_grad_norm_(model.named_parameters(), max_norm=0.5)  # figures before the clip
        recorder.record(stats, loss=loss)
        evaluate(model, loss_fn)
        with torch.inference_mode():
            rows = recorder.to_dicts()  # reading in evaluation changes nothing
        check_rows(rows, want[-3:])
        coef = min(0.5 / (want[-1][0] + 1e-6), 1.0)
        assert rows[-1]["clip_coef"] == pytest.approx(coef, rel=1e-6)
        assert math.sqrt(sq(grads64(model).values())) == pytest.approx(want[-1][0] * coef, rel=1e-6)
        optimizer.step()
    assert recorder.steps == 5 and [r["step"] for r in recorder.to_dicts()] == [2, 3, 4]
    check_rows(recorder.to_dicts(), want[-3:])


@pytest.mark.parametrize("name", ["resnet", "gpt2", "encoder"])
def test_flight_recorder_with_amp_a_grad_scaler_and_a_skipped_step(name: str) -> None:
    """Statistics recorded after unscale_ are the unscaled figures (float64 reference without a scaler); the step
    the scaler skips is recorded with its Inf; the scale's changes (growth after every good step, a back-off at
    the Inf) never show."""
    model, loss_fn = zoo(name)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    recorder = FlightRecorder(capacity=8)
    want, scales = [], []
    for step in range(4):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, step)
        scaler.scale(loss).backward()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = loss_fn(reference, step)
        ref_loss.backward()
        if step == 1:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = math.inf
                next(reference.parameters()).grad.view(-1)[0] = math.inf
        want.append(figures(reference, ref_loss))
        scales.append(scaler.get_scale())
        scaler.unscale_(optimizer)
        recorder.record(tg.grad_stats(model.named_parameters()), loss=loss)
        scaler.step(optimizer)
        scaler.update()
        reference.load_state_dict(model.state_dict())
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**11]  # grown, backed off at the Inf, grown
    rows = recorder.to_dicts()
    check_rows(rows, want)
    assert rows[1]["inf_count"] == 1 and rows[1]["total_norm"] == math.inf


# ================================================================================================= all three
def test_monitors_first_used_under_inference_mode_keep_working_in_training() -> None:
    """A monitor whose first call happens under torch.inference_mode (an evaluation hook, a sanity check before
    training) keeps working in training after it: what it keeps is made of ordinary tensors, never inference
    tensors (which nothing may write in place outside inference mode)."""
    model, loss_fn = zoo("encoder")
    loss_fn(model, 0).backward()
    ratio, recorder, ns = UpdateRatio(model.named_parameters()), FlightRecorder(4), NoiseScale(2, ema=0.5)
    with torch.inference_mode():
        ratio.snapshot()
        ratio.measure()
        recorder.record(tg.grad_stats(model.named_parameters()), loss=1.0)
        ns.update(3.0, 1.0, big_batch_size=4)
    assert float(ratio.stats.delta_sumsq.sum()) == 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = weights64(model)
    with ratio:
        optimizer.step()
    recorder.record(tg.grad_stats(model.named_parameters()), loss=2.0)
    ns.update(5.0, 2.0, big_batch_size=4)
    delta = math.sqrt(sq(before[n] - w for n, w in weights64(model).items()))
    assert math.sqrt(float(ratio.stats.delta_sumsq.sum())) == pytest.approx(delta, rel=1e-6)
    assert [r["loss"] for r in recorder.to_dicts()] == [1.0, 2.0]
    assert ns.to_dict() == pytest.approx(reference_estimates([(3.0, 1.0), (5.0, 2.0)], 2, 2, 0.5), rel=1e-12)
    assert not ns._state.is_inference()  # the compiled kernel writes it anyway; the pure-PyTorch one would not
    with torch.inference_mode():
        loaded = NoiseScale(2, ema=0.5)
        loaded.load_state_dict(ns.state_dict())
    loaded.update(4.0, 1.0, big_batch_size=4)
    assert not loaded._state.is_inference()


def gpt2_group(name: str) -> str:
    """GPT-2's parameters by block (``h.0``, ``h.1``) or by embedding / final norm (``wte``, ``wpe``, ``ln_f``)."""
    parts = name.split(".")
    return ".".join(parts[1:3]) if parts[1] == "h" else parts[1]


def test_flight_recorder_groups_when_a_layer_is_frozen_mid_run_and_unfrozen(tmp_path: Path) -> None:
    """GPT-2 grouped by block and embedding: the position embedding frozen at step 2 is recorded as None while
    it has no gradient and again once unfrozen; every other group's figures match float64 at every step. (It made
    the recorder raise at the first step without the frozen group.)"""
    model, loss_fn = zoo("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = FlightRecorder(capacity=8)
    wpe = model.transformer.wpe.weight
    want: list[dict[str, tuple[float, float]]] = []
    for step in range(5):
        wpe.requires_grad_(step not in (2, 3))
        optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        stats = tg.grad_stats(model.named_parameters())
        recorder.record(stats.grouped(gpt2_group), loss=loss)
        by_group: dict[str, list[torch.Tensor]] = {}
        for n, g in grads64(model).items():
            by_group.setdefault(gpt2_group(n), []).append(g)
        want.append({k: (math.sqrt(sq(v)), max(float(t.abs().max()) for t in v)) for k, v in by_group.items()})
        optimizer.step()
    rows = recorder.to_dicts()
    groups = ["wte", "wpe", "h.0", "h.1", "ln_f"]
    assert sorted(k.split("/")[1] for k in rows[0] if k.endswith("/norm")) == sorted(groups)
    for row, figures_of in zip(rows, want):
        for g in groups:
            if g not in figures_of:
                assert (row[f"group/{g}/norm"], row[f"group/{g}/max_abs"], row[f"group/{g}/nonfinite"]) == (None,) * 3
                continue
            assert row[f"group/{g}/norm"] == pytest.approx(figures_of[g][0], rel=1e-6), (row["step"], g)
            assert row[f"group/{g}/max_abs"] == figures_of[g][1] and row[f"group/{g}/nonfinite"] == 0
        assert row["total_norm"] == pytest.approx(math.sqrt(sum(n * n for n, _ in figures_of.values())), rel=1e-6)
    assert [r["group/wpe/norm"] is None for r in rows] == [False, False, True, True, False]
    with open(recorder.dump(tmp_path / "flight.jsonl")) as f:  # strict JSON: the missing group's figures are null
        dumped = [json.loads(line) for line in f]
    assert [d["group/wpe/nonfinite"] for d in dumped] == [0, 0, None, None, 0]
    assert dumped[1]["group/h.0/norm"] == pytest.approx(rows[1]["group/h.0/norm"], rel=1e-15)


def test_noise_scale_errors_name_the_parameter_whose_gradient_the_op_refuses() -> None:
    """A sparse gradient (nn.Embedding(sparse=True)) is refused by name in micro_batch and in step, not as the
    op's 'tensors[0]'."""
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    ns = NoiseScale(2)
    refused = r"NoiseScale.micro_batch: parameter '0.weight' has a torch.sparse_coo"
    with pytest.raises(ValueError, match=refused), ns.micro_batch(model):
        model(torch.tensor([1, 2])).sum().backward()
    for _ in range(2):
        with ns.micro_batch(model[1]):
            model(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"NoiseScale.step: parameter '0.weight' has a torch.sparse_coo"):
        ns.step(model)


def test_update_ratio_error_names_the_parameter_the_op_refuses() -> None:
    """ResNet with an integer parameter registered beside its weights (a step counter): the measurement names it,
    not the op's index into the list of differences and weights."""
    model = resnet()
    model.fc.register_parameter("steps", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    ratio = UpdateRatio(model.named_parameters())
    with pytest.raises(TypeError, match=r"UpdateRatio: parameter 'fc.steps' has a torch.int64 tensor"), ratio:
        pass


def test_flight_recorder_in_the_trainer_with_amp_on_resnet(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Trainer(flight_recorder=, scaler=, amp_dtype=bfloat16) on the ResNet: each recorded norm is the unscaled
    gradient's (float64 reference from the scaled gradients divided by the scale, read in after_backward), the step
    the scaler skips at an Inf is recorded with it, and the ring is dumped at that incident, the WARNING naming the
    file (docs/training.md, "At a spike")."""
    model = resnet()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 5, (12,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    recorder = FlightRecorder(capacity=8, dump_dir=tmp_path)
    want: list[float] = []

    def after_backward(trainer: Any) -> None:
        if len(want) == 3:
            with torch.no_grad():
                model.fc.weight.grad[0, 0] = math.inf
        scale = scaler.get_scale()
        want.append(math.sqrt(sq(p.grad.to(torch.float64) / scale for p in model.parameters())))

    trainer = tg.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(), scaler=scaler,
                         amp_dtype=torch.bfloat16, flight_recorder=recorder, after_backward=after_backward,
                         progress=False)
    with caplog.at_level(logging.WARNING, logger="torch_gradstats"):
        summary = trainer.fit(torch.utils.data.DataLoader(data, batch_size=2), epochs=1)[0]
    assert summary.skipped_steps == 1 and scaler.get_scale() == 2.0**11
    rows = recorder.to_dicts()
    assert [r["step"] for r in rows] == list(range(6))
    for row, norm in zip(rows, want):
        if math.isfinite(norm):
            assert row["total_norm"] == pytest.approx(norm, rel=1e-6)
    assert rows[3]["inf_count"] == 1 and [r["inf_count"] for r in rows].count(0) == 5
    dumps = sorted(tmp_path.glob("flight-*.jsonl"))
    assert dumps and any(d.name in rec.getMessage() for rec in caplog.records for d in dumps)


@pytest.mark.parametrize("by", ["layer", 1])
def test_update_ratio_groups_cover_the_parameters_with_a_gradient(by: Any) -> None:
    """GPT-2 with its first block frozen and the last block's final projection without a gradient (grad None,
    though it requires grad): a group's weight norm, SGD update ratio and measured update ratio all cover the
    group's parameters that have a gradient (the optimizer skips the others), each against float64. By layer the
    frozen block is no group at all and ``h.1`` lacks its projection; by depth 1 the one group ``transformer`` holds
    both. (The measured ratio once divided by the weights of every measured parameter of the group.)"""
    model, loss_fn = zoo("gpt2")
    lr = 1e-2
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for p in model.transformer.h[0].parameters():
        p.requires_grad_(False)
    idle = "transformer.h.1.mlp.c_proj.weight"
    ratio = UpdateRatio(model.named_parameters())
    group_of = tg.stats.groups._resolver(by)
    for step in range(2):
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        dict(model.named_parameters())[idle].grad = None
        before, grads = weights64(model), grads64(model)
        stats = grad_and_weight_stats(model.named_parameters(), optimizer=optimizer)
        with ratio:
            optimizer.step()
        stats.update = ratio.stats
        after = weights64(model)
        report = stats.report(groups=stats.grouped(by)).grads.groups
        members: dict[str, list[str]] = {}
        for n in grads:  # the parameters with a gradient, by group
            members.setdefault(group_of(n), []).append(n)
        assert set(report.norms) == set(report.weight_norms) == set(report.update_ratios) == set(members)
        assert "transformer.h.0" not in members and idle not in grads
        for g, names in members.items():
            w_before = math.sqrt(sq(before[n] for n in names))
            assert report.weight_norms[g] == pytest.approx(w_before, rel=1e-6), g
            sgd = lr * math.sqrt(sq(grads[n] for n in names))
            assert report.lr_update_ratios[g] == pytest.approx(sgd / w_before, rel=1e-6), g
            delta = math.sqrt(sq(before[n] - after[n] for n in names))
            want = delta / math.sqrt(sq(after[n] for n in names))
            assert report.update_ratios[g] == pytest.approx(want, rel=1e-6), g


def test_noise_scale_discard_window_after_a_micro_batch_that_raised() -> None:
    """GPT-2: the second window's first micro-batch is read, the second raises inside its block (as an
    out-of-memory error would), and the loop gives the window up: gradients cleared, ``discard_window()``. The
    window run again gives the estimates of the two clean windows against float64, not of the given-up
    micro-batch counted with the retried ones (which step() would then count as a window of three)."""
    model, loss_fn = zoo("gpt2")
    reference = copy.deepcopy(model)
    ns = NoiseScale(2, ema=0.5)
    pairs = [reference_pair(reference, loss_fn, [0, 1]), reference_pair(reference, loss_fn, [2, 3])]
    window(ns, model, loss_fn, [0, 1])
    ns.step(model)
    model.zero_grad()
    assert ns.discard_window() == 0  # nothing in progress: nothing dropped
    window(ns, model, loss_fn, [2])
    with pytest.raises(RuntimeError, match="out of memory"), ns.micro_batch(model):
        (loss_fn(model, 3) / 2).backward()
        raise RuntimeError("CUDA out of memory (simulated)")
    model.zero_grad()
    assert ns.discard_window() == 1  # the micro-batch read before the failure; the one that raised never counted
    assert ns.steps == 1
    with pytest.raises(ValueError, match="got 0"):  # the window is empty now
        ns.step(model)
    window(ns, model, loss_fn, [2, 3])
    ns.step(model)
    assert ns.steps == 2
    assert_estimates(ns, pairs, 2)


def test_flight_recorder_records_layers_unfrozen_after_the_first_step(tmp_path: Path) -> None:
    """GPT-2 fine-tuned with gradual unfreezing: the embeddings (``wte``, tied to the head, and ``wpe``) frozen for
    the first five steps, then ``wpe`` trained, then both. The groups first seen at steps 5 and 6 get their
    columns (the ring, of 5 steps, has wrapped around by then), the steps before hold None for them, and every
    figure of every dumped step matches float64. (A group the first step did not have was refused.)"""
    model, loss_fn = zoo("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    recorder = FlightRecorder(capacity=5)
    wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
    want: list[dict[str, Any]] = []
    for step in range(8):
        wpe.requires_grad_(step >= 5)
        wte.requires_grad_(step >= 6)
        optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        recorder.record(tg.grad_stats(model.named_parameters()).grouped(gpt2_group), loss=loss)
        grads = grads64(model)
        row: dict[str, Any] = {"step": step, "loss": float(loss.detach()), "total_norm": math.sqrt(sq(grads.values()))}
        for g in ("wte", "wpe", "h.0", "h.1", "ln_f"):
            mine = [t for n, t in grads.items() if gpt2_group(n) == g]
            row[f"group/{g}/norm"] = math.sqrt(sq(mine)) if mine else None
            row[f"group/{g}/max_abs"] = max(float(t.abs().max()) for t in mine) if mine else None
            row[f"group/{g}/nonfinite"] = sum(int((~t.isfinite()).sum()) for t in mine) if mine else None
        want.append(row)
        optimizer.step()
    with open(recorder.dump(tmp_path / "flight.jsonl")) as f:
        dumped = [json.loads(line) for line in f]
    assert [d["step"] for d in dumped] == [3, 4, 5, 6, 7]
    rows = recorder.to_dicts()
    for got in (dumped, rows):
        for d, w in zip(got, want[3:]):
            assert d["loss"] == pytest.approx(w["loss"], rel=1e-6)
            for key, value in w.items():
                if value is None or key.endswith(("/nonfinite", "max_abs", "step")):
                    assert d[key] == value, (w["step"], key)
                else:
                    assert d[key] == pytest.approx(value, rel=1e-6), (w["step"], key)
    assert [r["group/wpe/norm"] is None for r in rows] == [True, True, False, False, False]
    assert [r["group/wte/norm"] is None for r in rows] == [True, True, True, False, False]
    # the layout of the ring: the groups of the first step, then those first seen later
    assert [k.split("/")[1] for k in rows[0] if k.endswith("/norm")] == ["h.0", "h.1", "ln_f", "wpe", "wte"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_update_ratio_of_16_bit_weights_within_the_documented_rounding(dtype: torch.dtype) -> None:
    """GPT-2 in pure bfloat16 / float16 with Adam: Δw is taken in the weights' dtype, so each measured ||Δw|| and
    ratio is within the dtype's unit roundoff (2^-8, 2^-11; docs/integrations.md) of float64's, plus the op's own
    float32 sums; and the whole model's ||Δw|| within 1e-4 (the bounds docs/integrations.md states)."""
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    model, loss_fn = zoo("gpt2")
    model.to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    ratio = UpdateRatio(model.named_parameters())
    assert ratio.nbytes == sum(p.numel() * 2 for p in model.parameters())  # the weights' dtype: 2 bytes each
    for step in range(3):
        optimizer.zero_grad()
        loss_fn(model, step).backward()
        before = weights64(model)
        with ratio:
            optimizer.step()
        report = grad_and_weight_stats(model.named_parameters(), update=ratio.stats).report()
        after = weights64(model)
        total = 0.0
        for n, w in after.items():
            delta = float((before[n] - w).norm())
            total += delta * delta
            assert report.delta_norms[n] == pytest.approx(delta, rel=unit + 1e-5, abs=1e-30), n
            assert report.update_ratios[n] == pytest.approx(ratio_of(delta, float(w.norm())), rel=unit + 1e-5), n
        got = math.sqrt(math.fsum(d * d for d in report.delta_norms.values()))
        assert got == pytest.approx(math.sqrt(total), rel=1e-4)


@pytest.fixture(scope="module")
def ddp_accumulation_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, str]]]:
    """Two gloo ranks running tests/_monitors_ddp_worker.py's accumulation check (NoiseScale.micro_batch and step
    given the DDP module) on the zoo's models."""
    return _two_ranks(tmp_path_factory, "ddp_accumulation", ["accumulation_resnet", "accumulation_gpt2"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["accumulation_resnet", "accumulation_gpt2"])
def test_noise_scale_accumulation_under_ddp_counts_every_rank_in_the_big_batch(
        ddp_accumulation_results: Any, name: str) -> None:
    """micro_batch(ddp_model) / step(ddp_model) with no_sync() accumulation on 2 gloo ranks: .grad is DDP's mean over
    both ranks' micro-batches, so the big batch holds micro-batches x local_batch_size x 2 samples. Each rank's
    figures match the float64 reference (computed in the worker from a plain copy of the model). step() refuses a
    DDP module whose noise_scale_hook is the same NoiseScale (each step would be folded in twice)."""
    outcomes = [r.get(name, {"status": "fail", "detail": "not reached"}) for r in ddp_accumulation_results]
    failed = [f"--- rank {rank}:\n{o['detail']}" for rank, o in enumerate(outcomes) if o["status"] != "ok"]
    assert not failed, "\n".join(failed)
