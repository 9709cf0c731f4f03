"""CUDA parity tests of multi_tensor_stats against the float64 reference.

Skipped cleanly without a GPU; nothing here touches CUDA at import. On a GPU, tests that are about the compiled
kernel itself (launch count, capture-time error) also need the CUDA kernel to be registered; the parity tests run
with whatever kernel serves CUDA (the fused one, or the pure-PyTorch fallback under TORCH_GRADSTATS_FORCE_FALLBACK).
"""

from __future__ import annotations

import pytest
import torch

import torch_gradstats
from torch_gradstats.ops import INF, NAN, ZERO, reference_multi_tensor_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

OP = torch.ops.torch_gradstats.multi_tensor_stats.default
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def has_cuda_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CUDA")


needs_cuda_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or not has_cuda_kernel(), reason="needs the compiled CUDA kernel"
)


def rtol_for(tensors) -> float:
    return 1e-12 if all(t.dtype == torch.float64 for t in tensors) else 1e-5


def assert_matches(got, tensors) -> None:
    """Compare one result with the reference: counts and amax exactly, sumsq within the contract's tolerance."""
    sumsq, amax, counts = got
    ref_sumsq, ref_amax, ref_counts = reference_multi_tensor_stats(tensors)
    device = tensors[0].device
    for out in (sumsq, amax, counts):
        assert out.device == device
    assert sumsq.dtype == torch.float64 and amax.dtype == torch.float64 and counts.dtype == torch.int64
    assert counts.shape == (len(tensors), 3)
    assert torch.equal(counts, ref_counts), (counts, ref_counts)
    torch.testing.assert_close(amax, ref_amax, rtol=0, atol=0, equal_nan=True)
    if all(t.dtype == torch.float64 for t in tensors):
        torch.testing.assert_close(sumsq, ref_sumsq, rtol=1e-12, atol=0, equal_nan=True)
    else:  # per tensor: float64 tensors of a mixed list get the tighter bound
        for i, t in enumerate(tensors):
            torch.testing.assert_close(sumsq[i], ref_sumsq[i], rtol=rtol_for([t]), atol=0, equal_nan=True)


def check(tensors) -> None:
    assert_matches(torch_gradstats.multi_tensor_stats(tensors), tensors)


def randn(n, dtype, gen=None, scale=1.0):
    return (torch.randn(n, device="cuda", dtype=torch.float32, generator=gen) * scale).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(1234)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_many_sizes(dtype, gen):
    # Sizes around the 16-byte vector, the 64 KB tile and several tiles, odd lengths included.
    vec = 16 // torch.tensor([], dtype=dtype).element_size()
    tile = 64 * 1024 // torch.tensor([], dtype=dtype).element_size()
    sizes = [1, vec - 1, vec, vec + 1, 1000, tile - 1, tile, tile + 1, 3 * tile + 7, 1 << 20]
    check([randn(n, dtype, gen) for n in sizes])


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    info = torch.finfo(dtype)
    nan, inf = float("nan"), float("inf")
    cases = [
        [0.0, -0.0, 1.0, nan, inf, -inf, info.max, -info.max, info.tiny, info.smallest_normal / 4],
        [inf, -inf, 2.0, 0.0],  # inf and no NaN: sumsq = amax = +inf
        [info.max] * 37 + [-info.max] * 5,  # squares overflow the dtype, not float64 (except float64 itself)
        [info.tiny] * 19,  # squares underflow float32, not float64
        [-0.0] * 9,
        [nan] * 3,
    ]
    if dtype == torch.float32:
        cases.append([1e20, -1e20, 3e19] * 11)
    tensors = [torch.tensor(c, dtype=dtype, device="cuda") for c in cases]
    check(tensors)
    sumsq, amax, counts = OP(tensors)
    assert counts[0].tolist() == [2, 1, 2]
    assert torch.isinf(sumsq[1]) and torch.isinf(amax[1]) and counts[1].tolist() == [1, 0, 2]
    if dtype != torch.float64:
        assert torch.isfinite(sumsq[2]) and sumsq[3] > 0
    assert torch.isnan(sumsq[5]) and torch.isnan(amax[5])


def test_empty_tensors_and_lists_of_them():
    empties = [torch.empty(0, device="cuda", dtype=dt) for dt in DTYPES] + [torch.empty(3, 0, device="cuda")]
    check(empties)
    sumsq, amax, counts = OP(empties)
    assert torch.equal(sumsq, torch.zeros_like(sumsq)) and torch.equal(amax, torch.zeros_like(amax))
    assert int(counts.abs().sum()) == 0
    check([torch.empty(0, device="cuda"), torch.ones(5, device="cuda"), torch.empty(0, device="cuda", dtype=torch.half)])


def test_ten_thousand_small_mixed_tensors(gen):
    sizes = torch.randint(0, 300, (10_000,), generator=torch.Generator().manual_seed(0)).tolist()
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate(sizes)]
    tensors[17][0:1] = float("nan") if tensors[17].numel() else 0
    tensors[4001].zero_()
    check(tensors)


def test_mixed_dtypes_one_list(gen):
    tensors = [randn(n, DTYPES[i % 4], gen, scale=10.0 ** (i % 7 - 3)) for i, n in enumerate([5, 70_000, 33, 1 << 18])]
    check(tensors)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unaligned_views(dtype, gen):
    base = randn(300_001, dtype, gen)
    views = [base[1:], base[3:-2], base[7:20], base[5:6], base[1:1], base[9 : 9 + 70_000]]
    check(views)


@pytest.mark.parametrize("dtype", DTYPES)
def test_permuted_and_non_dense(dtype, gen):
    m = randn(64 * 33, dtype, gen).view(64, 33)
    cube = randn(4 * 5 * 6, dtype, gen).view(4, 5, 6)
    tensors = [
        m.t(),  # dense, permuted: read in place
        cube.permute(2, 0, 1),  # dense, permuted
        m[:, ::2],  # strided: made contiguous first
        m[1:, 1:],  # strided
        randn(5, dtype, gen).view(5, 1).expand(5, 7),  # overlapping: made contiguous first
        m.t()[3],  # strided 1-D slice
    ]
    assert not tensors[0].is_contiguous() and tensors[0].t().is_contiguous()  # dense but permuted
    check(tensors)


def test_deterministic_bits(gen):
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([3, 1 << 20, 12345, 70_001, 1 << 16])]
    first = OP(tensors)
    for _ in range(3):
        again = OP(tensors)
        for a, b in zip(first, again):
            assert torch.equal(a.view(torch.int64), b.view(torch.int64))


def test_inputs_not_modified(gen):
    tensors = [randn(1000, dt, gen) for dt in DTYPES] + [randn(64 * 8, torch.float32, gen).view(64, 8)[:, ::2]]
    tensors[0][3] = float("nan")
    before = [t.clone() for t in tensors]
    OP(tensors)
    torch.cuda.synchronize()
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8) if t.is_contiguous() else t.contiguous().view(torch.uint8),
                           b.contiguous().view(torch.uint8))


def test_cuda_graph_capture_and_replay(gen):
    grads = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([7, 1 << 17, 999, 70_003, 0, 4096])]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs require
        torch_gradstats.multi_tensor_stats(grads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch_gradstats.multi_tensor_stats(grads)
    for step in range(3):
        with torch.no_grad():
            for i, g in enumerate(grads):
                g.copy_(randn(g.numel(), g.dtype, gen, scale=10.0**step))
            grads[1][5] = float("inf")
            if step == 2:
                grads[3][-1] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(captured, grads)


def test_capture_of_tensors_never_seen_eagerly(gen):
    # As under torch.compile(mode="reduce-overhead"), whose graphs read inputs from fresh static buffers.
    OP([randn(10, torch.float32, gen)])  # some eager call in this process came first
    fresh = [randn(12345, torch.float32, gen), randn(77, torch.bfloat16, gen), randn(70_001, torch.float16, gen)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(fresh)
    for step in range(2):
        with torch.no_grad():
            for t in fresh:
                t.copy_(randn(t.numel(), t.dtype, gen, scale=3.0**step))
            fresh[2][-1] = float("nan") if step else 0.0
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(captured, fresh)
    check(fresh)  # eager still right afterwards


def test_torch_compile_fullgraph(gen):
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([10, 70_000, 3])]

    @torch.compile(fullgraph=True)
    def global_norm(ts):
        stats = torch_gradstats.multi_tensor_stats(ts)
        return stats.sumsq.sum().sqrt(), stats

    norm, stats = global_norm(tensors)
    assert_matches(stats, tensors)
    torch.testing.assert_close(norm, reference_multi_tensor_stats(tensors)[0].sum().sqrt(), rtol=1e-5, atol=0)


def test_opcheck(gen):
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([10, 4099, 1, 0])]
    torch.library.opcheck(OP, (tensors,))


@needs_cuda_kernel
@pytest.mark.parametrize("shape", ["10000_small", "5_large"])
def test_at_most_two_kernel_launches(shape, gen):
    if shape == "10000_small":
        tensors = [randn(64 + i % 100, DTYPES[i % 4], gen) for i in range(10_000)]
    else:
        tensors = [randn(1 << 22, DTYPES[i % 4], gen) for i in range(5)]
    OP(tensors)  # warm-up: uploads the metadata once
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        OP(tensors)
        torch.cuda.synchronize()
    kernels = [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))
    ]
    assert 1 <= len(kernels) <= 2, kernels


@pytest.mark.slow
def test_more_than_2_pow_31_elements():
    n = (1 << 31) + 77  # 4.3 GB in bfloat16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x[-1] = 1000.0  # the largest |x| sits past 2^31: a 32-bit index would miss it
    x[(1 << 31) + 5] = 0.0
    x[(1 << 31) + 6] = float("inf")
    small = torch.randn(100, device="cuda", dtype=torch.float16)
    sumsq, amax, counts = OP([small, x])
    # Reference in chunks (a float64 copy of the whole tensor would take 17 GB).
    ref_zero = ref_nan = ref_inf = 0
    finite_sumsq = torch.zeros((), dtype=torch.float64, device="cuda")
    finite_amax = torch.zeros((), dtype=torch.float64, device="cuda")
    for chunk in x.split(1 << 28):
        s, a, c = reference_multi_tensor_stats([chunk.clone()])
        ref_zero, ref_nan, ref_inf = ref_zero + int(c[0, ZERO]), ref_nan + int(c[0, NAN]), ref_inf + int(c[0, INF])
        if int(c[0, INF]) == 0:
            finite_sumsq += s[0]
            finite_amax = torch.maximum(finite_amax, a[0])
    assert counts[1].tolist() == [ref_zero, ref_nan, ref_inf] and ref_inf == 1
    assert torch.isinf(sumsq[1]) and torch.isinf(amax[1])
    # Without the inf, sumsq and amax are finite and must match the chunked reference.
    x[(1 << 31) + 6] = 0.0
    sumsq, amax, counts = OP([small, x])
    ref = torch.zeros((), dtype=torch.float64, device="cuda")
    ref_amax = torch.zeros((), dtype=torch.float64, device="cuda")
    for chunk in x.split(1 << 28):
        s, a, _ = reference_multi_tensor_stats([chunk.clone()])
        ref += s[0]
        ref_amax = torch.maximum(ref_amax, a[0])
    assert float(amax[1]) == 1000.0 == float(ref_amax)
    torch.testing.assert_close(sumsq[1], ref, rtol=1e-5, atol=0)
    assert int(counts[1, ZERO]) == ref_zero + 1
    assert_matches((sumsq[:1], amax[:1], counts[:1]), [small])
