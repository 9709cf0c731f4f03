"""Hostile inputs to the exponent histogram: the argument checks, the host-side ExponentHistogram, negative views in
the pure-PyTorch fallback, and a limit of the 277 buckets.

Every count is compared with numpy.frexp of the float64 values (floor(log2 |x|) = e - 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_gradstats as tg
from torch_gradstats.ops.fallback import fallback_multi_tensor_stats
from torch_gradstats.ops.fallback_histogram import fallback_multi_tensor_stats_histogram
from torch_gradstats.ops.op import HISTOGRAM_BUCKETS, HISTOGRAM_MIN_EXPONENT
from torch_gradstats.stats.exponents import FORMATS, ExponentHistogram, FloatFormat

_INT_DTYPES = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}


def frexp_histogram(tensors: list[torch.Tensor]) -> np.ndarray:
    """The expected rows: numpy.frexp of the float64 values, clamped to the 277 buckets."""
    rows = []
    for t in tensors:
        x = t.detach().resolve_neg().reshape(-1).to(torch.float64).numpy()
        x = x[np.isfinite(x) & (x != 0)]
        _, e = np.frexp(x)
        bucket = np.clip(e.astype(np.int64) - 1 - HISTOGRAM_MIN_EXPONENT, 0, HISTOGRAM_BUCKETS - 1)
        rows.append(np.bincount(bucket, minlength=HISTOGRAM_BUCKETS))
    return np.stack(rows)


def every_exponent(dtype: torch.dtype) -> torch.Tensor:
    """Every exponent field of `dtype` (NaN/Inf's too), each subnormal binade (both signs), ±0 and ±max; float64 adds
    values beyond float32's range on both sides."""
    mb = _MANTISSA_BITS[dtype]
    info = torch.finfo(dtype)
    fields = torch.arange(0, 1 << (torch.finfo(dtype).bits - 1 - mb), dtype=torch.int64) << mb
    subnormals = torch.tensor([1 << k for k in range(mb)] + [(1 << mb) - 1], dtype=torch.int64)
    bits = torch.cat([fields, subnormals, fields + 1])
    values = bits.view(torch.float64) if dtype == torch.float64 else bits.to(_INT_DTYPES[dtype]).view(dtype)
    extra = [0.0, -0.0, float("nan"), -float("inf"), info.max, -info.max, info.tiny, -info.tiny / 2]
    if dtype == torch.float64:
        extra += [2.0**-149, 2.0**-150, 1.5 * 2.0**-150, 2.0**128, -(2.0**128), 1e300, 5e-324, 2.0**127 * 1.999]
    return torch.cat([values, -values, torch.tensor(extra, dtype=torch.float64).to(dtype)])


# ------------------------------------------------------------------------------------------------ argument checks
@pytest.mark.parametrize("value", [np.bool_(True), np.bool_(False)])
def test_numpy_bool_histogram_is_named_as_numpy(value):
    # numpy's bool type is also called "bool": "histogram must be a bool, got bool" told the caller nothing.
    with pytest.raises(TypeError, match=r"histogram must be a bool .*got numpy\.bool"):
        tg.multi_tensor_stats([torch.ones(3)], histogram=value)


def test_trainer_names_numpy_bool_histogram():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="numpy"):
        tg.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                   histogram=np.bool_(True))  # fmt: skip


def test_callback_names_numpy_bool_histogram():
    pytest.importorskip("lightning")
    from torch_gradstats.integrations.lightning import GradStatsCallback

    with pytest.raises(TypeError, match="numpy"):
        GradStatsCallback(histogram=np.bool_(True))


# ------------------------------------------------------------------------------------------ ExponentHistogram
def test_exponent_histogram_rejects_impossible_counts():
    ok = [0] * HISTOGRAM_BUCKETS
    ok[149] = 3
    with pytest.raises(ValueError, match=r"counts must be >= 0, got -1 in bucket 5"):
        ExponentHistogram(tuple(-1 if b == 5 else 0 for b in range(HISTOGRAM_BUCKETS)), 10)  # fractions < 0
    with pytest.raises(ValueError, match=r"add up to 3, more than numel \(2\)"):
        ExponentHistogram(tuple(ok), 2)  # fractions > 1
    with pytest.raises(ValueError, match=r"add up to 3, more than numel \(0\)"):
        ExponentHistogram(tuple(ok), 0)  # every fraction was silently 0.0
    with pytest.raises(TypeError, match=r"counts\[0\] must be an int, got float"):
        ExponentHistogram(tuple(float(c) for c in ok), 3)
    with pytest.raises(TypeError, match=r"numel must be an int, got bool"):
        ExponentHistogram(tuple(ok), True)


def test_exponent_histogram_takes_numpy_counts_as_ints():
    x = np.array([1.0, 0.5, 2.0**-20, 0.0, 3e38], dtype=np.float32)
    counts = frexp_histogram([torch.from_numpy(x)])[0]  # numpy int64s, as np.bincount gives them
    h = ExponentHistogram(tuple(counts), np.int64(x.size))
    assert all(type(c) is int for c in h.counts) and type(h.numel) is int
    assert hash(h) == hash(ExponentHistogram(tuple(int(c) for c in counts), x.size))
    assert h.underflow("fp16") == 1 / 5 and h.overflow("fp16") == 1 / 5


def test_exponent_histogram_unknown_format_is_a_value_error():
    h = ExponentHistogram((0,) * HISTOGRAM_BUCKETS, 0)
    with pytest.raises(ValueError, match=r"unknown format 'fp4'; expected one of fp16, bf16"):
        h.underflow("fp4")
    with pytest.raises(TypeError, match="format name or a FloatFormat, got int"):
        h.overflow(16)  # type: ignore[arg-type]
    assert h.overflow(FloatFormat(-14, 15)) == 0.0 and set(FORMATS) == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}


def test_float64_beyond_float32_shares_the_last_bucket():
    """The contract's limit, as documented: float64 values at or above 2**128 count in bucket 276 with float32's top
    binade [2**127, 2**128), so the bf16 overflow fraction (|x| >= 2**128) cannot see them: it stays 0."""
    g = torch.tensor([1e300, 2.0**128, 2.0**127, 1.0], dtype=torch.float64, requires_grad=True)
    g.grad = g.detach().clone()
    stats = tg.grad_stats([g], histogram=True)
    assert int(stats.exponent_histogram[HISTOGRAM_BUCKETS - 1]) == 3
    report = stats.report()
    assert report.exponent_histogram is not None and report.exponent_histogram.overflow("bf16") == 0.0


# ------------------------------------------------------------------------------------------------- fallback
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_fallback_histogram_reads_negative_views(dtype):
    # torch._neg_view (and .conj() of a real tensor's neg views) has no bits to view: x.view(int) raised.
    x = every_exponent(dtype)
    views = [torch._neg_view(x), torch._neg_view(x[::3]), x[:5]]
    out = fallback_multi_tensor_stats_histogram(views)
    assert np.array_equal(out.exponent_histogram.numpy() if hasattr(out, "exponent_histogram") else out[3].numpy(),
                          frexp_histogram(views))
    plain = tg.multi_tensor_stats([v.resolve_neg() for v in views])
    assert torch.equal(out[2], plain.counts)
    torch.testing.assert_close(out[1], plain.amax, rtol=0, atol=0, equal_nan=True)


def test_fallback_stats_reads_negative_views():
    x = torch.randn(10)
    torch.testing.assert_close(fallback_multi_tensor_stats([torch._neg_view(x)])[1],
                               tg.multi_tensor_stats([x]).amax)  # fmt: skip


# ------------------------------------------------------------------------------------------------ integrations
def test_wandb_exponent_histogram_rejects_a_tensor():
    pytest.importorskip("wandb")
    from torch_gradstats.integrations.wandb import exponent_histogram

    with pytest.raises(TypeError, match="ExponentHistogram"):
        exponent_histogram(torch.zeros(HISTOGRAM_BUCKETS, dtype=torch.int64))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yes", None])
def test_tensorboard_sink_histograms_must_be_a_bool(tmp_path, value):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from torch_gradstats.integrations.tensorboard import TensorBoardSink

    writer = SummaryWriter(str(tmp_path))
    try:
        with pytest.raises(TypeError, match="histograms"):
            TensorBoardSink(writer, histograms=value)
    finally:
        writer.close()
