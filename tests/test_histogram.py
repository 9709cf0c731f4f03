"""The op's histogram overload: exact exponent counts on every CPU path (each instruction-set variant of the compiled
kernel, the pure-PyTorch fallback, the float64 reference) against numpy.frexp, with the other three outputs
unchanged, and the overload's place in torch.compile, vmap and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_gradstats
from tests.test_cpu_kernel import VARIANTS, run_with_capability, special_inputs, variant_capability
from torch_gradstats.ops.fallback_histogram import fallback_multi_tensor_stats_histogram
from torch_gradstats.ops.op import (
    HISTOGRAM_BUCKETS,
    HISTOGRAM_MIN_EXPONENT,
    HistogramStats,
    multi_tensor_stats,
    reference_multi_tensor_stats,
)

histogram_op = torch.ops.torch_gradstats.multi_tensor_stats.histogram


def numpy_histogram(t: torch.Tensor) -> np.ndarray:
    """The expected row: numpy.frexp of the float64 values (|x| = m * 2**e, 0.5 <= m < 1: floor(log2|x|) = e - 1)."""
    x = t.detach().to(torch.float64).reshape(-1).numpy()
    x = x[np.isfinite(x) & (x != 0)]
    _, e = np.frexp(np.abs(x))
    bucket = np.clip(e.astype(np.int64) - 1 - HISTOGRAM_MIN_EXPONENT, 0, HISTOGRAM_BUCKETS - 1)
    return np.bincount(bucket, minlength=HISTOGRAM_BUCKETS)


def histogram_inputs() -> list[torch.Tensor]:
    """special_inputs() plus the histogram's own edge cases: every binade of each dtype, values past float32's range
    in float64, broadcast and overlapping views, a tensor split between the CPU kernel's tasks."""
    g = torch.Generator().manual_seed(1)
    out = special_inputs()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        info = torch.finfo(dtype)
        wide = torch.randn(20_011, generator=g, dtype=torch.float64) * torch.exp2(
            torch.randint(-170, 150, (20_011,), generator=g).to(torch.float64)
        )
        x = wide.to(dtype)
        specials = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), info.max, -info.max, info.tiny,
                    info.tiny / 2, info.tiny * info.eps, 2.0**-149, 2.0**-150, 2.0**127, 2.0**128, 1e300, 1e-300,
                    5e-324]  # fmt: skip
        x[: len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
        out += [x, x[1:], x[::7], x[:63], x[:64], x[:65], x.view(-1)[:2000].view(40, 50).t()]
        out.append(torch.tensor([info.tiny / 4], dtype=dtype).expand(9, 3))  # a broadcast subnormal
        out.append(x[:100].as_strided((50, 4), (2, 1)))  # overlapping: every element counted with its multiplicity
        # every field of the dtype once: each bucket of a 16-bit dtype's range
        if dtype in (torch.float16, torch.bfloat16):
            out.append(torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype))
    out.append(torch.randn(300_001, generator=g))  # split between tasks: atomic adds into one row
    # Blocks of different scales whose fields reach 0 to 40 binades below their largest, with zeros: the GFNI
    # kernel counts the 16 fields below a block's largest at once (while reading the next block) and the rest one
    # by one; float16 flushes the lowest to zero.
    k = torch.arange(3 * 4096 + 77, dtype=torch.float64)
    edges = torch.exp2(-(k % 41)) * torch.exp2(torch.div(k, 4096, rounding_mode="floor") * 5)
    edges[::97] = 0.0
    out += [edges.to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)]
    # One block of 4,096 per span width, 1 to 24 binades below its largest (the AVX2 and AVX512 kernels count 8
    # fields at a time bit-sliced while at least 5 are left, the rest by byte compares), some near the bottom of the
    # range, where a window reaches field 0.
    w = torch.arange(1, 25, dtype=torch.float64).repeat_interleave(4096)
    i = torch.arange(w.numel(), dtype=torch.float64)
    spans = torch.exp2(-torch.remainder(i, w)) * torch.where(w > 18, 2.0**-118, 2.0**(w - 10))
    spans[::89] = 0.0
    out += [spans.to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)]
    # Gaussian-like blocks with subnormals, alone or with a value 20 binades down (found one by one)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2 * 4096 + 5, generator=g).to(dtype)
        x[7], x[4096 + 11] = torch.finfo(dtype).tiny / 4, torch.finfo(dtype).tiny / 2
        x[4096 + 3000] = 2.0**-20
        out.append(x)
    # Heavy-tailed blocks, log-uniform magnitudes over 20 to 150 binades with zeros: the GFNI kernel counts window
    # after window of 16 fields below a block's largest, down to the subnormals; the others take their own paths.
    for dtype, lo, hi in ((torch.bfloat16, -22, -2), (torch.float32, -22, -2), (torch.float16, -20, 10),
                          (torch.float32, -140, 10), (torch.bfloat16, -135, 0), (torch.float32, -40, -9)):  # fmt: skip
        u = torch.rand(3 * 4096 + 19, generator=g, dtype=torch.float64) * (hi - lo) + lo
        sign = torch.randint(0, 2, u.shape, generator=g).to(torch.float64) * 2 - 1
        x = (torch.exp2(u) * sign).to(dtype)
        x[::101] = 0.0
        out.append(x)
    return out


def assert_histograms_exact(tensors: list[torch.Tensor], hist: torch.Tensor) -> None:
    assert hist.dtype == torch.int64 and hist.shape == (len(tensors), HISTOGRAM_BUCKETS)
    for i, t in enumerate(tensors):
        want = torch.from_numpy(numpy_histogram(t))
        if not torch.equal(hist[i], want):
            diff = (hist[i] - want).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"tensors[{i}] ({t.dtype}, {tuple(t.shape)}): buckets {diff} differ")


def assert_histogram_call_exact(tensors: list[torch.Tensor]) -> None:
    out = multi_tensor_stats(tensors, histogram=True)
    assert isinstance(out, HistogramStats)
    assert_histograms_exact(tensors, out.exponent_histogram)
    plain = multi_tensor_stats(tensors)
    torch.testing.assert_close(out.sumsq, plain.sumsq, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out.amax, plain.amax, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out.counts, plain.counts)
    numels = torch.tensor([t.numel() for t in tensors])
    assert torch.equal(out.exponent_histogram.sum(1) + out.counts.sum(1), numels)


def test_reference_matches_numpy():
    tensors = histogram_inputs()
    assert_histograms_exact(tensors, reference_multi_tensor_stats(tensors, histogram=True)[3])


@pytest.mark.skipif(not torch_gradstats.HAS_EXTENSION, reason="compiled extension not loaded")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_kernel_variant_exact(variant, monkeypatch):
    # On a CPU with GFNI and AVX512-BITALG, "avx512-without-gfni" checks the AVX512 kernel's bit-sliced windows too.
    capability = variant_capability(variant, monkeypatch)
    counting = {"default": "table", "avx2": "bit-sliced", "avx512-without-gfni": "bit-sliced"}.get(variant)
    if variant == "avx512":  # GFNI where the CPU has it (known where /proc/cpuinfo is)
        counting = {True: "GFNI", False: "bit-sliced"}.get(cpu_has_gfni_bitalg(), "")
    out = run_with_capability(
        capability,
        f"""
        from tests.test_histogram import assert_histogram_call_exact, histogram_inputs
        import torch_gradstats._C as ext
        assert cpu_capability() == {capability.upper()!r}, cpu_capability()
        assert {counting!r} in ext.cpu_histogram_counting(), ext.cpu_histogram_counting()
        assert_histogram_call_exact(histogram_inputs())
        torch.set_num_threads(1)
        assert_histogram_call_exact(histogram_inputs()[-40:])
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def cpu_has_gfni_bitalg() -> bool | None:
    """Whether this CPU has GFNI and AVX512-BITALG (the AVX512 kernel then counts 16 fields at once), or None where
    /proc/cpuinfo cannot tell."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else {"gfni", "avx512_bitalg"} <= set(flags)


def test_in_process_exact():  # the compiled kernel where it is loaded, else the fallback
    assert_histogram_call_exact(histogram_inputs())


@pytest.mark.parametrize("chunk", [1 << 10, 1 << 18])
def test_fallback_exact(chunk):
    tensors = histogram_inputs()
    _, _, counts, hist = fallback_multi_tensor_stats_histogram(tensors, chunk)
    assert_histograms_exact(tensors, hist)
    ref = reference_multi_tensor_stats(tensors)
    assert torch.equal(counts, ref[2])


def test_flush_denormal_does_not_change_counts():
    x = torch.full((5000,), torch.finfo(torch.float32).tiny / 8)
    before = multi_tensor_stats([x], histogram=True).exponent_histogram
    with_ftz = torch.set_flush_denormal(True)
    try:
        after = multi_tensor_stats([x], histogram=True).exponent_histogram
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(before, after)
    if with_ftz:  # the CPU supports it: the subnormals still land in their bucket, -129 (x == 2**-129)
        assert after[0, -129 - HISTOGRAM_MIN_EXPONENT] == 5000


def test_raw_overload_and_fake_shapes():
    ts = [torch.randn(10), torch.randn(3, 4, dtype=torch.float64)]
    hist = histogram_op(ts)[3]
    assert hist.shape == (2, HISTOGRAM_BUCKETS) and hist.dtype == torch.int64
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = histogram_op([torch.empty(10), torch.empty(5, dtype=torch.float16)])
        assert [tuple(o.shape) for o in fake] == [(2,), (2,), (2, 3), (2, HISTOGRAM_BUCKETS)]


def test_compiled_fullgraph_is_one_node():
    ts = [torch.randn(100), torch.randn(7, 9).to(torch.bfloat16)]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(xs):
        return multi_tensor_stats(xs, histogram=True).exponent_histogram.sum(0)

    assert torch.equal(f(ts), multi_tensor_stats(ts, histogram=True).exponent_histogram.sum(0))


def test_vmap():
    x = torch.randn(4, 50)
    y = torch.randn(30)
    hist = torch.vmap(lambda a, b: histogram_op([a, b])[3], in_dims=(0, None))(x, y)
    assert hist.shape == (4, 2, HISTOGRAM_BUCKETS)
    for i in range(4):
        assert torch.equal(hist[i], multi_tensor_stats([x[i], y], histogram=True).exponent_histogram)


def test_histogram_argument_must_be_bool():
    with pytest.raises(TypeError, match="histogram must be a bool"):
        multi_tensor_stats([torch.randn(3)], histogram=1)  # type: ignore[call-overload]


def test_errors_name_the_tensor():
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        multi_tensor_stats([torch.randn(3), torch.arange(3)], histogram=True)
    with pytest.raises(ValueError, match="at least one tensor"):
        multi_tensor_stats([], histogram=True)
