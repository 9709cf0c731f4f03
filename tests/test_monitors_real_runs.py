"""Groups and exponent histograms on the architectures people train (tests/model_zoo.py), in real training runs:
GPT-2 with its tied embedding, a ResNet with a frozen block, the checkpointed encoder, and the Trainer under
bfloat16 autocast with a GradScaler whose scale grows during the run. Every figure is compared with a float64
reference computed here from the raw gradients (``torch.frexp`` for the exponents), not through the library.
(NoiseScale, UpdateRatio and the weight norms have theirs in tests/test_monitors_models.py.)"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from model_zoo import CheckpointedEncoder, gpt2, resnet
from torch import nn

import torch_gradstats as tg
import torch_gradstats.training._trainer as trainer_module
from torch_gradstats.training import Trainer

# A reentrant checkpoint whose inputs need no gradient warns: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")

FORMATS = {"fp16": (-14, 15), "bf16": (-126, 127), "fp8_e4m3": (-6, 8), "fp8_e5m2": (-14, 15)}


def layer_of(name: str) -> str:
    """The "layer" grouping written out: the outermost ``<container>.<number>``, else the owning module."""
    m = re.match(r"(.*?\.\d+)(\.|$)", name)
    return m.group(1) if m else name.rpartition(".")[0] or name


def reference_groups(model: nn.Module, by: Callable[[str], str | None]) -> dict[str, dict[str, float]]:
    """Per group, from ``model.named_parameters()`` (a tied parameter once) in float64: norm, max |g|, NaN + Inf."""
    out: dict[str, dict[str, float]] = {}
    for name, p in model.named_parameters():
        g = by(name)
        if p.grad is None or g is None:
            continue
        x = p.grad.detach().to(torch.float64)
        row = out.setdefault(g, {"sumsq": 0.0, "max_abs": 0.0, "nonfinite": 0})
        row["sumsq"] += float(x.square().sum())
        amax = float(x.abs().max())  # NaN if x holds one
        row["max_abs"] = math.nan if math.isnan(amax) or math.isnan(row["max_abs"]) else max(row["max_abs"], amax)
        row["nonfinite"] += int((~x.isfinite()).sum())
    return out


def assert_groups(model: nn.Module, by: Any, ref_by: Callable[[str], str | None]) -> None:
    stats = tg.grad_stats(model.named_parameters())
    report = stats.report(groups=stats.grouped(by)).groups
    want = reference_groups(model, ref_by)
    assert list(report.norms) == list(want)
    for g, row in want.items():
        norm = math.sqrt(row["sumsq"])
        if math.isfinite(norm):
            assert report.norms[g] == pytest.approx(norm, rel=1e-6), g
        else:
            assert math.isnan(report.norms[g]) == math.isnan(norm) and math.isinf(report.norms[g]) == math.isinf(norm)
        if math.isnan(row["max_abs"]):
            assert math.isnan(report.max_abs[g]), g
        else:
            assert report.max_abs[g] == pytest.approx(row["max_abs"], rel=1e-6), g
        assert report.nan_counts[g] + report.inf_counts[g] == row["nonfinite"], g


def gpt2_backward(model: nn.Module, seed: int = 0) -> None:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


def test_gpt2_layers_count_the_tied_embedding_once() -> None:
    """GPT-2's lm_head.weight is transformer.wte.weight: one parameter, listed under its first name, so its gradient
    (both uses summed by autograd) is in transformer.wte's group once, and lm_head is no group. The blocks are
    transformer.h.0 and .1; every group's norm, max |g| and NaN/Inf count match the float64 reference, and the
    groups' squares add up to the total."""
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    gpt2_backward(model)
    stats = tg.grad_stats(model.named_parameters())
    groups = stats.grouped("layer")
    assert groups.names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                            "transformer.ln_f"]
    assert float(groups.sumsq.sum()) == pytest.approx(float(stats.total_norm) ** 2, rel=1e-9)
    assert_groups(model, "layer", layer_of)
    assert_groups(model, 2, lambda n: ".".join(n.split(".")[:2]))
    assert_groups(model, r"\.h\.(\d+)\.", lambda n: m.group(1) if (m := re.search(r"\.h\.(\d+)\.", n)) else None)

    # A NaN in one block, +-Inf in the other, a module without gradients: each lands in its own group only.
    model.transformer.h[0].attn.c_attn.weight.grad[0, 0] = math.nan
    model.transformer.h[1].mlp.c_fc.bias.grad[3:5] = torch.tensor([math.inf, -math.inf])
    for p in model.transformer.h[1].attn.parameters():
        p.grad = None
    assert_groups(model, "layer", layer_of)


def test_resnet_layers_with_a_frozen_block_and_the_downsample() -> None:
    """The ResNet's blocks (in-place residual add, ReLU(inplace=True)) with layer1.0 frozen: no group for it, the
    strided block's downsample in layer2.0, the stem's conv1 and bn1 and the head fc groups of their own."""
    model = resnet()
    for p in model.layer1[0].parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    stats = tg.grad_stats(model.named_parameters())
    groups = stats.grouped("layer")
    assert groups.names == ["conv1", "bn1", "layer1.1", "layer2.0", "layer2.1", "fc"]
    assert groups.members["layer2.0.downsample.0.weight"] == "layer2.0"
    assert groups.members["layer2.0.downsample.1.bias"] == "layer2.0"
    assert_groups(model, "layer", layer_of)
    assert_groups(model, 1, lambda n: n.split(".")[0])


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_encoder_layers(use_reentrant: bool) -> None:
    """nn.TransformerEncoder layers under torch.utils.checkpoint: one group per encoder.layers.<i>, figures equal to
    those of the same model run without checkpointing (and to the float64 reference)."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    plain = CheckpointedEncoder(use_reentrant, checkpointed=False)
    model = CheckpointedEncoder(use_reentrant)
    for m in (plain, model):
        m(x).square().mean().backward()
    stats = tg.grad_stats(model.named_parameters())
    assert stats.grouped("layer").names == ["embed", "encoder.layers.0", "encoder.layers.1", "head"]
    assert_groups(model, "layer", layer_of)
    plain_norms = tg.grad_stats(plain.named_parameters()).grouped("layer").norms
    torch.testing.assert_close(stats.grouped("layer").norms, plain_norms, rtol=1e-6, atol=0.0)


# ---------------------------------------------------------------------------------------------- histograms
def frexp_fractions(grads: Iterable[torch.Tensor]) -> dict[str, float]:
    """underflow/<fmt> and overflow/<fmt> of docs/histograms.md from torch.frexp: |x| = m 2^e with m in [0.5, 1),
    so floor(log2 |x|) = e - 1; over every element, zeros, NaN and Inf in the denominator only."""
    values = torch.cat([g.detach().reshape(-1).to(torch.float64) for g in grads])
    finite = values[values.isfinite() & (values != 0)]
    exponent = torch.frexp(finite).exponent - 1
    out = {}
    for fmt, (lo, hi) in FORMATS.items():
        out[f"underflow/{fmt}"] = int((exponent < lo).sum()) / values.numel()
        out[f"overflow/{fmt}"] = int((exponent > hi).sum()) / values.numel()
    return out


@pytest.mark.parametrize("max_grad_norm", [None, 0.01], ids=["unclipped", "clipped"])
def test_trainer_histogram_fractions_are_those_of_the_unscaled_gradients_before_clipping(
        monkeypatch: pytest.MonkeyPatch, max_grad_norm: float | None) -> None:
    """Trainer(histogram=True) on the ResNet under bfloat16 autocast with a GradScaler whose scale grows 8-fold
    during the run (and, with max_grad_norm, a clip that scales every gradient by ~1e-3): each logging step's
    fractions are exactly those of the gradients after unscale_ and before the clip (docs/histograms.md,
    docs/training.md). Read on the scaled gradients they would move by 16 binades (the scale 2^16)."""
    seen: dict[str, dict[str, float]] = {}
    clip = trainer_module.clip_grad_norm_

    def recording_clip(params: Any, *args: Any, **kwargs: Any) -> Any:
        params = list(params)
        seen["before_clip"] = frexp_fractions(p.grad for _, p in params if p.grad is not None)
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "clip_grad_norm_", recording_clip)
    model = resnet()

    class Check:
        def __init__(self) -> None:
            self.steps: list[int] = []

        def log(self, report: Any, step: int) -> None:
            got = report.to_dict()
            if max_grad_norm is None:  # .grad is still what the stats read (the optimizer does not change it)
                want = frexp_fractions(p.grad for p in model.parameters() if p.grad is not None)
            else:
                want = seen.pop("before_clip")
                assert got["clip_coef"] < 0.1
            assert {k: got[k] for k in want} == want, step
            assert got["underflow/fp8_e4m3"] > 0.01  # the fractions are not trivially 0
            self.steps.append(step)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(14)]
    check = Check()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(),
                      amp_dtype=torch.bfloat16, scaler=scaler, histogram=True, log_to=[check], log_every=1,
                      accumulation_steps=2, max_grad_norm=max_grad_norm)
    trainer.fit(data, epochs=1)
    assert check.steps == list(range(7))
    assert scaler.get_scale() == 2.0**19  # grew at steps 2, 4 and 6: the reads saw three different scales


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_gpt2_16_bit_gradients_histogram_with_subnormals_and_zeros(dtype: torch.dtype) -> None:
    """A GPT-2 trained in pure float16 / bfloat16 with a small loss: many gradient elements are float16 subnormals
    (and some are zeros). The histogram equals torch.frexp's exponents bucket for bucket, the whole model's and the
    per-parameter rows alike, and the fractions are those of the reference."""
    model = gpt2().to(dtype)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    (model(input_ids=ids, labels=ids).loss * 1e-3).backward()
    grads = [p.grad for p in model.parameters()]
    values = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
    assert int((values == 0).sum()) > 0
    if dtype == torch.float16:
        assert int(((values != 0) & (values.abs() < 2.0**-14)).sum()) > 1000  # float16 subnormals
    finite = values[values.isfinite() & (values != 0)]
    want = torch.bincount(torch.frexp(finite).exponent - 1 + 149, minlength=277)
    stats = tg.grad_stats(model.named_parameters(), histogram=True)
    assert torch.equal(stats.exponent_histogram.cpu(), want)
    per_param = tg.grad_stats(model.named_parameters(), histogram=True, per_tensor=True).exponent_histogram
    assert per_param.shape == (len(grads), 277)
    assert torch.equal(per_param.sum(0).cpu(), want)
    got = stats.report().to_dict()
    reference = frexp_fractions(grads)
    assert {k: got[k] for k in reference} == reference
