"""Exponent histograms above the op: grad_stats(histogram=True), the report's fp16/bf16/fp8 underflow and overflow
fractions (checked against a direct count over the gradient values), and the TensorBoard and W&B histograms (read
back from a real event file and a real wandb.Histogram)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import torch_gradstats as tg
from torch_gradstats.ops.op import HISTOGRAM_BUCKETS, HISTOGRAM_MIN_EXPONENT
from torch_gradstats.stats import gradients as stats_module
from torch_gradstats.stats.exponents import FORMATS, ExponentHistogram


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model(torch.randn(8, 16)).pow(2).sum().backward()
    g = model[0].weight.grad
    # values at each format's edges: 2**-14 (fp16's smallest normal: not underflow), just below it (underflow),
    # 448/480 (e4m3: largest finite, and past it but below 2**9: "representable" at this resolution), 2**9 and 2**16
    # (overflow in e4m3, and in fp16/e5m2), 1e-40 (bf16 underflow), zeros, a NaN and an Inf
    edge = [2.0**-14, 2.0**-14 * 0.99, 2.0**-6, 2.0**-6 * 0.99, 448.0, 480.0, 2.0**9, 2.0**16, 65504.0, 1e-40, 0.0, 0.0,
            float("nan"), float("inf"), -(2.0**16), 2.0**-126, 2.0**-127]  # fmt: skip
    g.view(-1)[: len(edge)] = torch.tensor(edge)
    model[2].bias.grad.zero_()
    return model


def _direct_fractions(grads: list[torch.Tensor]) -> dict[str, float]:
    """The fractions counted directly from the values, as the docs define them."""
    x = torch.cat([g.reshape(-1).to(torch.float64) for g in grads])
    finite = x[torch.isfinite(x)].abs()
    out = {}
    for name, f in FORMATS.items():
        out[f"underflow/{name}"] = ((finite > 0) & (finite < 2.0**f.min_exponent)).sum().item() / x.numel()
        out[f"overflow/{name}"] = (finite >= 2.0 ** (f.max_exponent + 1)).sum().item() / x.numel()
    return out


def test_global_and_per_tensor_histograms():
    model = _model_with_grads()
    grads = [p.grad for p in model.parameters()]
    s = tg.grad_stats(model.named_parameters(), histogram=True)
    rows = tg.grad_stats(model.named_parameters(), histogram=True, per_tensor=True).exponent_histogram
    assert s.exponent_histogram.shape == (HISTOGRAM_BUCKETS,) and rows.shape == (len(grads), HISTOGRAM_BUCKETS)
    assert torch.equal(rows.sum(0), s.exponent_histogram)
    want = tg.multi_tensor_stats(grads, histogram=True).exponent_histogram
    assert torch.equal(rows, want)
    assert tg.grad_stats(model.named_parameters()).exponent_histogram is None


def test_report_fractions_equal_a_direct_count():
    model = _model_with_grads()
    grads = [p.grad for p in model.parameters()]
    report = tg.grad_stats(model.named_parameters(), histogram=True).report()
    d = report.to_dict(prefix="grad/")
    direct = _direct_fractions(grads)
    for key, value in direct.items():
        assert d["grad/" + key] == pytest.approx(value, rel=0, abs=0), key
    # the edges: fp16 underflow counts 2**-14*0.99, 2**-6*0.99 is >= 2**-14, 1e-40, 2**-126, 2**-127 (and randn's tail)
    assert round(d["grad/overflow/fp16"] * report.numel) == 2  # 2**16 and -2**16; 65504 is representable
    assert round(d["grad/overflow/fp8_e4m3"] * report.numel) == 4  # 2**9, +-2**16, 65504; not 448 nor 480
    assert round(d["grad/underflow/bf16"] * report.numel) == 2  # 1e-40 and 2**-127
    assert report.exponent_histogram is not None
    assert sum(report.exponent_histogram.counts) == report.numel - report.zero_count - report.nan_count - 1


def test_fractions_are_absent_without_histogram_and_in_framework_styles():
    model = _model_with_grads()
    plain = tg.grad_stats(model.named_parameters()).report().to_dict()
    assert not any(k.startswith(("underflow/", "overflow/")) for k in plain)
    styled = tg.grad_stats(model.named_parameters(), histogram=True).report().to_dict(style="hf")
    assert set(styled) == {"grad_norm"}


def test_report_is_still_one_transfer(monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = stats_module.to_host
    monkeypatch.setattr(stats_module, "to_host", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model_with_grads()
    tg.grad_stats(model.named_parameters(), histogram=True, per_tensor=True).report()
    assert len(calls) == 1


def test_empty_and_bad_arguments():
    empty = tg.grad_stats([], histogram=True)
    assert empty.exponent_histogram.shape == (HISTOGRAM_BUCKETS,) and int(empty.exponent_histogram.sum()) == 0
    r = empty.report()
    assert r.to_dict()["underflow/fp16"] == 0.0
    with pytest.raises(ValueError, match="pass histogram=True"):
        tg.grad_stats([], per_tensor=True)
    with pytest.raises(TypeError, match="grad_stats: histogram must be a bool .True or False., got str"):
        tg.grad_stats([], histogram="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="per_tensor must be a bool"):
        tg.grad_stats([], histogram=True, per_tensor=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="277"):
        ExponentHistogram((1, 2), 3)


def test_exponent_histogram_edges_and_range():
    counts = [0] * HISTOGRAM_BUCKETS
    counts[149] = 5  # [1, 2)
    counts[150] = 2  # [2, 4)
    h = ExponentHistogram(tuple(counts), 10)
    assert h.nonzero_range() == (149, 151)
    edges = h.edges()
    assert len(edges) == HISTOGRAM_BUCKETS + 1 and edges[149] == 1.0 and edges[151] == 4.0
    assert edges[0] == 2.0**HISTOGRAM_MIN_EXPONENT and edges[-1] == 2.0**128
    assert h.overflow("fp8_e4m3") == 0.0 and h.underflow("bf16") == 0.0


def test_tensorboard_writes_the_exponent_histogram(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    model = _model_with_grads()
    report = tg.grad_stats(model.named_parameters(), histogram=True).report()
    writer = SummaryWriter(str(tmp_path))
    TensorBoardSink(writer, histograms=True).log(report, 3)
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    (event,) = acc.Histograms("grad/exponents")
    assert event.step == 3
    hist = event.histogram_value
    first, end = report.exponent_histogram.nonzero_range()
    assert list(hist.bucket) == list(report.exponent_histogram.counts[first:end])
    assert list(hist.bucket_limit) == [2.0 ** (HISTOGRAM_MIN_EXPONENT + b + 1) for b in range(first, end)]
    assert hist.num == sum(report.exponent_histogram.counts)
    assert hist.min == 2.0 ** (HISTOGRAM_MIN_EXPONENT + first)
    scalars = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}
    assert scalars["grad/overflow/fp16"] == pytest.approx(report.to_dict()["overflow/fp16"], rel=1e-6)


def test_wandb_histogram_from_the_report():
    pytest.importorskip("wandb")
    from torch_gradstats.integrations.wandb import exponent_histogram

    model = _model_with_grads()
    report = tg.grad_stats(model.named_parameters(), histogram=True).report()
    h = exponent_histogram(report.exponent_histogram)
    first, end = report.exponent_histogram.nonzero_range()
    assert list(h.histogram) == list(report.exponent_histogram.counts[first:end])
    assert np.allclose(h.bins, [HISTOGRAM_MIN_EXPONENT + b for b in range(first, end + 1)])
    # the finite non-zero values' log2 |g| fall in these bins (numpy's own histogram over the same edges)
    x = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(torch.float64)
    x = x[torch.isfinite(x) & (x != 0)].abs().log2().floor()
    want, _ = np.histogram(x.numpy(), bins=np.asarray(h.bins))
    assert list(want) == list(h.histogram)
    empty = exponent_histogram(ExponentHistogram((0,) * HISTOGRAM_BUCKETS, 0))
    assert list(empty.histogram) == [0]


@pytest.mark.parametrize("clip", ["none", "max_grad_norm", "adaptive"])
def test_trainer_logs_the_fractions_of_the_gradients_before_clipping(tmp_path: Path, clip: str):
    import json

    from torch_gradstats.integrations import JSONLSink
    from torch_gradstats.training import Trainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[int, dict] = {}

    def spy(trainer: Trainer) -> None:  # the gradients as the stats read them (before any clip)
        seen[trainer.global_step] = tg.grad_stats(model.named_parameters(), histogram=True).report().to_dict()

    kwargs = {"none": {}, "max_grad_norm": {"max_grad_norm": 1e-3}, "adaptive": {"adaptive_clip": tg.AdaptiveClip()}}
    sink = JSONLSink(tmp_path / "log.jsonl")
    trainer = Trainer(model, opt, nn.CrossEntropyLoss(), log_to=[sink], log_every=2, histogram=True,
                      after_backward=spy, **kwargs[clip])  # fmt: skip
    data = [(torch.randn(16, 4), torch.randint(0, 2, (16,))) for _ in range(5)]
    trainer.fit(data, epochs=1)
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4]
    for row in rows:
        for fmt in FORMATS:
            for kind in ("underflow", "overflow"):
                assert row[f"{kind}/{fmt}"] == seen[row["step"]][f"{kind}/{fmt}"]
    with pytest.raises(TypeError, match="histogram must be a bool"):
        Trainer(model, opt, nn.CrossEntropyLoss(), histogram=1)  # type: ignore[arg-type]
