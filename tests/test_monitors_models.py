"""The monitors (UpdateRatio, NoiseScale, FlightRecorder) on the architectures people train (tests/model_zoo.py): a
training loop with evaluation under ``torch.inference_mode`` and ``torch.no_grad`` between the steps, AMP with a
GradScaler (skipped steps included), a lasting change of level, parameters frozen mid-run and checkpoints. Every
figure is compared with a float64 reference computed here from the gradients and weights, not by the library."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from model_zoo import CheckpointedEncoder, gpt2, resnet
from torch import nn

import torch_gradstats as tg
from torch_gradstats import FlightRecorder, NoiseScale
from torch_gradstats.updates import UpdateRatio

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


# ================================================================================================= NoiseScale
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
