"""CUDA tests of the histogram overload, multi_tensor_stats.histogram: the exponent histogram against two oracles.

Each histogram is compared exactly with the float64 reference (``reference_multi_tensor_stats(..., histogram=True)``,
torch.frexp on the device) and with counts derived here with numpy.frexp on the host, and its first three outputs
with the plain op's bits. Skipped cleanly without a GPU; nothing here touches CUDA at import. The tests run with
whatever kernel serves CUDA (the compiled one, or the pure-PyTorch fallback under TORCH_GRADSTATS_FORCE_FALLBACK);
those about the compiled kernel itself also need it to be registered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_gradstats
from torch_gradstats.ops.op import reference_multi_tensor_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
BUCKETS = 277
MIN_EXPONENT = -149
PLAIN_OP = torch.ops.torch_gradstats.multi_tensor_stats.default
HIST_OP = torch.ops.torch_gradstats.multi_tensor_stats.histogram
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}
INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}  # fmt: skip


def has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_gradstats::{op}", "CUDA")


# The build has the compiled CUDA kernel (of the plain op: the histogram overload's is what the test checks).
needs_cuda_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_cuda_kernel("multi_tensor_stats"), reason="needs the compiled CUDA kernel"
)


def frexp_histogram(tensors) -> np.ndarray:
    """The histogram from numpy.frexp on the host: |x| = m * 2**e with 0.5 <= m < 1, so floor(log2 |x|) = e - 1."""
    flat = [t.detach().reshape(-1).to(torch.float64).cpu().numpy() for t in tensors]
    x = np.concatenate(flat)
    ids = np.repeat(np.arange(len(tensors), dtype=np.int64), [f.size for f in flat])
    keep = np.isfinite(x) & (x != 0)
    _, e = np.frexp(np.abs(x[keep]))
    bucket = np.clip(e.astype(np.int64) - 1 - MIN_EXPONENT, 0, BUCKETS - 1)
    return np.bincount(ids[keep] * BUCKETS + bucket, minlength=len(tensors) * BUCKETS).reshape(-1, BUCKETS)


def check(tensors, numpy_oracle: bool = True):
    """The overload through both entry points against the reference, numpy.frexp and the plain op; returns it."""
    out = torch_gradstats.multi_tensor_stats(tensors, histogram=True)
    via_op = HIST_OP(tensors)
    ref = reference_multi_tensor_stats(tensors, histogram=True)
    hist = out.exponent_histogram
    assert hist.dtype == torch.int64 and hist.shape == (len(tensors), BUCKETS) and hist.device == tensors[0].device
    assert torch.equal(hist, ref[3]), (hist - ref[3]).nonzero()[:10]
    assert torch.equal(via_op[3], hist)
    if numpy_oracle:
        np.testing.assert_array_equal(hist.cpu().numpy(), frexp_histogram(tensors))
    # Every finite non-zero element is in its row once: the row sums to numel - zeros - NaNs - Infs.
    numel = torch.tensor([t.numel() for t in tensors], device=hist.device)
    assert torch.equal(hist.sum(1), numel - out.counts.sum(1))
    # The statistics are the plain op's, bit for bit (the same read, another instantiation of the kernel).
    plain = PLAIN_OP(tensors)
    for a, b in zip(plain, out[:3]):
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))
    for a, b in zip(via_op[:3], out[:3]):
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))
    assert torch.equal(out.counts, ref[2])
    torch.testing.assert_close(out.amax, ref[1], rtol=0, atol=0, equal_nan=True)
    return out


@pytest.fixture
def gen():
    return torch.Generator(device=DEVICE).manual_seed(4321)


def spread(n: int, dtype: torch.dtype, gen, lo: int = -30, hi: int = 30) -> torch.Tensor:
    """Normal values scaled by random powers of two in [2**lo, 2**hi): many buckets per tensor."""
    x = torch.randn(n, device=DEVICE, dtype=torch.float64, generator=gen)
    e = torch.randint(lo, hi, (n,), device=DEVICE, generator=gen).to(torch.float64)
    return (x * torch.exp2(e)).to(dtype)


def random_bits(n: int, dtype: torch.dtype, gen) -> torch.Tensor:
    """Uniformly random bit patterns: every exponent field, subnormals, zeros rarely, NaNs and Infs."""
    words = torch.randint(-(1 << 31), 1 << 31, (n * torch.finfo(dtype).bits // 32,), device=DEVICE,
                          dtype=torch.int64, generator=gen)
    return words.to(torch.int32).view(dtype)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Zeros, NaN, Infs, the max, every power of two of the dtype (subnormals included) and the largest value under
    each (its bits minus one), both signs; for float64 also values beyond float32's range and below 2**-149 (the
    clamped last and first buckets)."""
    fi = torch.finfo(dtype)
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), fi.max, fi.tiny, fi.tiny * fi.eps, 1.0, 0.75]
    if dtype == torch.float64:
        specials += [1e300, 2.0**128, 2.0**127, 3.5e38, 2.0**-149, 2.0**-150, 1e-300, 5e-324, 2.0**-1022, 1e-45]
    shift = MANTISSA_BITS[dtype]
    fields = 1 << (fi.bits - 1 - shift)  # the all-ones field (NaN and Inf) is fields - 1
    powers = torch.tensor([1 << k for k in range(shift)] + [f << shift for f in range(1, fields - 1)])
    as_bits = torch.cat([powers, powers - 1]).to(INT_OF[dtype]).view(dtype)  # 0 under the smallest subnormal
    x = torch.cat([torch.tensor(specials, dtype=torch.float64).to(dtype), as_bits])
    return torch.cat([x, -x]).to(DEVICE)


def field_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every exponent field of float32/float64 with the mantissas 0, 1, all ones and one in the middle, both signs."""
    bits, mantissa = (32, 23) if dtype == torch.float32 else (64, 52)
    fields = torch.arange(0, 1 << (bits - 1 - mantissa), dtype=torch.int64)
    mantissas = torch.tensor([0, 1, (1 << mantissa) - 1, 1 << (mantissa - 1)], dtype=torch.int64)
    words = (fields[:, None] << mantissa | mantissas[None, :]).reshape(-1)
    if dtype == torch.float32:
        pos = words.to(torch.int32)
        neg = pos | torch.tensor(-(1 << 31), dtype=torch.int32)
    else:
        pos = words
        neg = pos | torch.tensor(-(1 << 63), dtype=torch.int64)
    return torch.cat([pos, neg]).view(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_pattern(dtype):
    # All 65,536 values: every bucket a 16-bit dtype has, its subnormals, zeros, NaNs and Infs. Whole (block tiles),
    # shifted by one element (an unaligned head), and as warp tiles (2,048 elements each, at odd offsets).
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).to(DEVICE)
    check([every, every[1:], every[3:-5]])
    check([every[k : k + 2048] for k in range(0, 1 << 16, 2048)] + [every[k + 1 : k + 2048] for k in (0, 31744)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_in_warp_and_block_tiles(dtype, gen):
    edges = edge_values(dtype)
    pad = spread(70_001, dtype, gen)
    at_edges = torch.cat([edges, pad, edges, pad[:12_345], edges])  # head, middle and tail of block tiles
    tensors = [edges, edges[1:], at_edges, at_edges[1:], at_edges[3:-3]]
    if dtype in (torch.float32, torch.float64):
        tensors.append(field_patterns(dtype))
    check(tensors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_bit_patterns(dtype, gen):
    x = random_bits(1 << 20, dtype, gen)
    check([x, x[1:], x[: 1 << 10], x[5 : 5 + 4097]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_lengths_and_unaligned_views(dtype, gen):
    tensors = [spread(n, dtype, gen) for n in (1, 3, 4097)]
    tensors += [t[1:] for t in tensors] + [spread(70_003, dtype, gen)[1:], spread(70_003, dtype, gen)[7:-1]]
    check(tensors)


def test_empty_tensors(gen):
    x = spread(1000, torch.float32, gen)
    empty = torch.empty(0, device=DEVICE)
    out = check([empty, x, torch.empty(0, 5, device=DEVICE, dtype=torch.bfloat16), empty])
    assert int(out.exponent_histogram[[0, 2, 3]].abs().sum()) == 0
    assert int(check([empty]).exponent_histogram.abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_permuted_and_expanded_views(dtype, gen):
    m = spread(300 * 70, dtype, gen).view(300, 70)
    row = spread(1000, dtype, gen).view(1, 1000)
    col = spread(301, dtype, gen).view(301, 1)
    tensors = [
        m[:, ::2],  # strided: read from a copy
        m.t(),  # permuted, dense: read in place
        m[1:, 3:],
        row.expand(7, 1000),  # broadcast: counted once, then scaled by the repeat
        col.expand(301, 5),
        torch.tensor(3.0, device=DEVICE, dtype=dtype).expand(10, 10),
        spread(1 << 17, dtype, gen).view(1, -1).expand(3, -1),  # a broadcast block-tile tensor
    ]
    out = check(tensors)
    assert torch.equal(out.exponent_histogram[3], 7 * check([row]).exponent_histogram[0])


def test_ten_thousand_small_tensors(gen):
    tensors = [
        spread(1 + i % 301, DTYPES[i % 4], gen, lo=i % 40 - 60, hi=i % 40 - 20)
        if i % 1000
        else spread(20_000 + i, DTYPES[(i // 1000) % 4], gen)  # a few block tiles among the warp tiles
        for i in range(10_000)
    ]
    tensors[17][0] = float("nan")
    tensors[18][-1] = 0.0
    tensors[19][0] = float("-inf")
    check(tensors)


def test_several_and_many_tiles_interleaved_dtypes(gen):
    # Tensors of several 64 KB tiles side by side (a block's next tile is often another tensor's: its counts must
    # go to the right row), odd tile remainders, and a tensor of more than 4,096 nominal tiles (larger tiles).
    tensors = [
        spread(3 * 16_384 + 7, torch.float32, gen),
        spread(5 * 32_768 + 1, torch.bfloat16, gen),
        spread(17, torch.float16, gen),
        spread(1 << 22, torch.float32, gen),
        spread(7 * 8_192 + 3, torch.float64, gen),
        spread(1 << 22, torch.float16, gen, lo=-24, hi=15),
    ]
    tensors[3][12345] = float("inf")
    small = check(tensors)
    big = spread((1 << 27) + 12_345, torch.bfloat16, gen)  # 256 MB: 4,096 tiles of about 64 KB
    out = check([tensors[2], big, tensors[0]], numpy_oracle=False)
    # A tensor's row does not depend on its companions.
    assert torch.equal(out.exponent_histogram[0], small.exponent_histogram[2])
    assert torch.equal(out.exponent_histogram[2], small.exponent_histogram[0])


def test_deterministic(gen):
    tensors = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([7, 1 << 20, 999, 70_003, 1 << 18])]
    first = HIST_OP(tensors)[3]
    for _ in range(3):
        assert torch.equal(HIST_OP(tensors)[3], first)


def test_cpu_and_cuda_kernels_agree(gen):
    tensors = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([1, 3, 4097, 70_001, 1 << 20, 0, 300])]
    tensors += [random_bits(100_003, dt, gen) for dt in DTYPES] + [edge_values(dt) for dt in DTYPES]
    on_cuda = torch_gradstats.multi_tensor_stats(tensors, histogram=True)
    on_cpu = torch_gradstats.multi_tensor_stats([t.cpu() for t in tensors], histogram=True)
    assert torch.equal(on_cuda.exponent_histogram.cpu(), on_cpu.exponent_histogram)
    assert torch.equal(on_cuda.counts.cpu(), on_cpu.counts)


def test_cuda_graph_capture_and_replay(gen):
    grads = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([7, 1 << 17, 999, 70_003, 0, 4096, 1 << 20])]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs require
        torch_gradstats.multi_tensor_stats(grads, histogram=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch_gradstats.multi_tensor_stats(grads, histogram=True)
        captured_plain = torch_gradstats.multi_tensor_stats(grads)
    graph.replay()
    torch.cuda.synchronize()
    eager = check(grads)
    assert torch.equal(captured.exponent_histogram, eager.exponent_histogram)
    assert torch.equal(captured.counts, eager.counts) and torch.equal(captured_plain.counts, eager.counts)
    for step in range(2):  # new values in place: each replay counts them afresh (the output is zeroed per replay)
        with torch.no_grad():
            for g in grads:
                g.copy_(spread(g.numel(), g.dtype, gen, lo=-10 * step - 5, hi=10 * step + 5))
            grads[1][5] = float("inf")
            grads[3][-1] = 0.0
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_multi_tensor_stats(grads, histogram=True)
        assert torch.equal(captured.exponent_histogram, ref[3])
        np.testing.assert_array_equal(captured.exponent_histogram.cpu().numpy(), frexp_histogram(grads))
        assert torch.equal(captured.counts, ref[2]) and torch.equal(captured_plain.counts, ref[2])


def test_capture_of_tensors_never_seen_eagerly(gen):
    fresh = [spread(12_345, torch.float32, gen), spread(77, torch.bfloat16, gen), spread(70_001, torch.float16, gen)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = HIST_OP(fresh)
    for step in range(2):
        with torch.no_grad():
            for t in fresh:
                t.copy_(spread(t.numel(), t.dtype, gen, lo=-3 - step, hi=3 + step))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[3], reference_multi_tensor_stats(fresh, histogram=True)[3])


def test_torch_compile_fullgraph(gen):
    tensors = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([10, 70_000, 3, 4097])]

    @torch.compile(fullgraph=True)
    def summary(ts):
        stats = torch_gradstats.multi_tensor_stats(ts, histogram=True)
        return stats.exponent_histogram.sum(0), stats

    total, stats = summary(tensors)
    ref = reference_multi_tensor_stats(tensors, histogram=True)
    assert torch.equal(stats.exponent_histogram, ref[3])
    assert torch.equal(total, ref[3].sum(0))
    torch._dynamo.reset()


def test_opcheck(gen):
    tensors = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([10, 4099, 1, 0])]
    torch.library.opcheck(HIST_OP, (tensors,))


def test_bad_input_names_the_tensor(gen):
    x = spread(10, torch.float32, gen)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        torch_gradstats.multi_tensor_stats([x, torch.zeros(3, dtype=torch.long, device=DEVICE)], histogram=True)
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        torch_gradstats.multi_tensor_stats([x, torch.zeros(3)], histogram=True)


@needs_cuda_kernel
def test_compiled_kernel_counts_in_the_same_two_launches(gen):
    """The overload runs the compiled kernel: its two kernels and the output's zeroing, not the fallback's ops."""
    from torch.profiler import ProfilerActivity, profile

    from torch_gradstats import _C

    assert has_cuda_kernel("multi_tensor_stats.histogram"), "the histogram overload has no CUDA kernel"
    tensors = [spread(n, DTYPES[i % 4], gen) for i, n in enumerate([64 + i % 100 for i in range(1000)] + [1 << 22])]
    HIST_OP(tensors)  # warm-up: writes the metadata once
    HIST_OP(tensors)  # (a full metadata cache admits a list at its second call)
    torch.cuda.synchronize()
    for call in (HIST_OP, lambda ts: torch_gradstats.multi_tensor_stats(ts, histogram=True)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(tensors)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert sum("tile_stats_kernel" in n for n in names) == 1, names
        assert sum("finalize_kernel" in n for n in names) == 1, names
        assert len(names) <= 3, names  # and the zeroing of the histogram
    direct = _C.direct_histogram_stats(tensors)  # the direct entry point has the CUDA kernel too
    assert direct is not None and torch.equal(direct[3], HIST_OP(tensors)[3])
