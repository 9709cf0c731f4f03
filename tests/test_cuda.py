"""CUDA parity tests of multi_tensor_stats against the float64 reference.

Skipped cleanly without a GPU; nothing here touches CUDA at import. On a GPU, tests that are about the compiled
kernel itself (launch count, capture-time error) also need the CUDA kernel to be registered; the parity tests run
with whatever kernel serves CUDA (the fused one, or the pure-PyTorch fallback under TORCH_GRADSTATS_FORCE_FALLBACK).
"""

from __future__ import annotations

import pytest
import torch

import torch_gradstats
from torch_gradstats.ops.op import INF, NAN, ZERO, reference_multi_tensor_stats

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [4096, 4097, 70_000])  # a warp tile (8 KB), the smallest block tile, 2 tiles
def test_16bit_runs_mix_zeros_specials_and_tiny_values(dtype, numel, gen):
    """The 16-bit path reads each thread's 4 vectors in flight (32 elements) as one run of packed words: a run with
    an Inf or NaN is recounted element by element, so its zeros must count once; a run of tiny values takes
    float64 squares; a run of zeros adds nothing. Specials at lane and run edges, the remainder loop and the tail."""
    info = torch.finfo(dtype)
    base = torch.zeros(numel, device="cuda", dtype=dtype)
    ones = randn(numel, dtype, gen)
    # bfloat16: squares below 2**-100, so the run is summed again in float64; float16's squares never are (2**-48
    # at least), so its runs of tiny values stay on the float32 path
    tiny = torch.full((numel,), info.smallest_normal, device="cuda", dtype=dtype) * 3
    tensors = []
    for values in (base, ones, tiny):
        for spot in (0, 7, 8, 31, 32 * 8, 32 * 8 * 4 - 1, numel // 2, numel - 3, numel - 1):
            for special in (float("nan"), float("inf"), -float("inf"), info.tiny / 4):
                x = values.clone()
                x[spot] = special
                x[spot // 2] = 0.0  # a zero in the same or an earlier run
                tensors.append(x)
    check(tensors)


def test_empty_tensors_and_lists_of_them():
    empties = [torch.empty(0, device="cuda", dtype=dt) for dt in DTYPES] + [torch.empty(3, 0, device="cuda")]
    check(empties)
    sumsq, amax, counts = OP(empties)
    assert torch.equal(sumsq, torch.zeros_like(sumsq)) and torch.equal(amax, torch.zeros_like(amax))
    assert int(counts.abs().sum()) == 0
    check(
        [torch.empty(0, device="cuda"), torch.ones(5, device="cuda"), torch.empty(0, device="cuda", dtype=torch.half)]
    )


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


def test_a_tensors_bits_do_not_depend_on_its_companions(gen):
    """A tensor's result depends on the tensor alone: the same bits alone, in a short list (a finalize block per
    tensor) and in a list of more than 2,048 (a finalize warp per tensor), for a tensor of a few tiles and for ones
    of more than 64 tiles (reduced by a whole block), NaN and Inf included."""
    big = randn(100 * (1 << 14) + 5, torch.float32, gen)  # > 64 tiles of 64 KB
    huge = randn(5000 * (1 << 15), torch.bfloat16, gen)  # the tile count capped at 4,096 with bigger tiles
    mid = randn(3 * (1 << 14) + 1, torch.float16, gen)
    special = randn(80 * (1 << 14), torch.float32, gen)
    special[12345], special[999_999] = float("nan"), float("inf")
    subjects = [big, huge, mid, special]
    alone = [OP([t]) for t in subjects]
    short = OP(subjects + [randn(7, torch.float32, gen)])
    fillers = [randn(3, torch.float64, gen) for _ in range(2100)]
    long = OP(fillers[:1000] + subjects[::-1] + fillers[1000:])
    for j, t in enumerate(subjects):
        for out, row in ((short, j), (long, 1000 + len(subjects) - 1 - j)):
            for got, want in zip(out, alone[j]):
                assert torch.equal(got[row].view(torch.int64), want[0].view(torch.int64)), (j, row)
    check(subjects)


def test_inputs_not_modified(gen):
    tensors = [randn(1000, dt, gen) for dt in DTYPES] + [randn(64 * 8, torch.float32, gen).view(64, 8)[:, ::2]]
    tensors[0][3] = float("nan")
    before = [t.clone() for t in tensors]
    OP(tensors)
    torch.cuda.synchronize()
    for t, b in zip(tensors, before):
        assert torch.equal(
            t.view(torch.uint8) if t.is_contiguous() else t.contiguous().view(torch.uint8),
            b.contiguous().view(torch.uint8),
        )


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
    # As under torch.compile(mode="reduce-overhead"), whose graphs read inputs from fresh static buffers: the graph
    # carries its own metadata, so no eager call has to come first.
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
    OP(tensors)  # warm-up: writes the metadata once
    OP(tensors)  # (a full table admits a list at its second call)
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


# ---------------------------------------------------------------------------------------------------------------
# Utilities for the tests of the compiled kernel's metadata cache (csrc/cuda/metadata_cache_cuda.cuh, MetadataCache).


def cuda_activity(fn) -> list[str]:
    """Names of the device-side events (kernels, memcpy, memset) that running fn issues, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def memcpys(names: list[str]) -> list[str]:
    # CUPTI names them "Memcpy HtoD (Pinned -> Device)" and the like.
    return [n for n in names if n.lower().startswith("memcpy")]


def fills(names: list[str]) -> list[str]:
    """Launches of the kernel that writes tensor metadata (from its parameters) to the device."""
    return [n for n in names if "fill_metadata" in n]


def cache_info() -> dict[str, int]:
    """State of the compiled kernel's metadata cache (csrc/cuda/metadata_cache_cuda.cuh, MetadataCache::info)."""
    values = torch.ops.torch_gradstats._cuda_metadata_cache_info()
    keys = ("entries", "bytes", "retired", "captured_calls", "fill_launches", "pool_reserved", "graph_buffers",
            "graph_buffer_bytes", "pinned", "capacity", "inline_items")  # fmt: skip
    return dict(zip(keys, values))


def inline_limit() -> int:
    """The longest list whose metadata the compiled kernel passes as kernel parameters: no cache, no fill."""
    return cache_info()["inline_items"] if has_cuda_kernel() else 0


def cached(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` followed by one-element views of a new buffer, so that the list is longer than inline_limit() and
    its metadata goes through the cache (or a graph's buffer when captured)."""
    pad = inline_limit() + 1 - len(tensors)
    if pad <= 0:
        return tensors
    return tensors + list(torch.rand(pad, device=tensors[0].device).split(1))


def distinct_lists(gen, count: int, base: int) -> list[list[torch.Tensor]]:
    """`count` lists of 3 tensors whose sizes no other test uses, padded past the inline limit (cached()), so the
    first call on each is a cache miss."""
    return [cached([randn(base + 13 * k + j, DTYPES[(k + j) % 4], gen) for j in range(3)]) for k in range(count)]


# Sleeping cycles that keep the GPU busy far longer than the host needs to enqueue what follows (~50 ms at 2 GHz).
GPU_SLEEP_CYCLES = 100_000_000


@needs_cuda_kernel
@pytest.mark.parametrize("shape", ["10000_small", "5_large", "5_large_inline"])
def test_steady_state_writes_no_metadata(shape, gen):
    # Sizes unique to this test: the first call must miss the metadata cache (a positive control for the filter).
    if shape == "10000_small":
        tensors = [randn(65 + i % 97, DTYPES[i % 4], gen) for i in range(10_000)]
    else:
        tensors = [randn((1 << 22) + 5 + i, DTYPES[i % 4], gen) for i in range(5)]
        tensors = tensors if shape == "5_large_inline" else cached(tensors)
    miss = cuda_activity(lambda: OP(tensors))
    if shape == "5_large_inline":  # kernel parameters: not even the first call writes metadata
        assert not fills(miss) and not memcpys(miss) and len(miss) == 2, miss
        return
    assert fills(miss), miss  # a miss writes the metadata with fill kernels...
    assert not memcpys(miss), miss  # ...from their parameters: no copy from host memory
    OP(tensors)  # a full table admits a list at its second call (docs/cuda.md, "Admission")
    hit = cuda_activity(lambda: OP(tensors))
    assert not fills(hit) and not memcpys(hit), hit  # steady state: the cached metadata is read as it is
    assert len(hit) == 2, hit  # the two kernels of the op and nothing else
    assert_matches(OP(tensors), tensors)


@pytest.mark.parametrize("fill_on", ["default_stream", "side_stream"])
def test_cache_hit_from_another_stream_than_the_fill(fill_on, gen):
    # The miss fills the metadata on one stream, behind a long sleep, so the fill is still pending when the other
    # stream's call hits the cache: that call must wait for it (cudaStreamWaitEvent), not read a half-written buffer.
    base = 40_000 if fill_on == "default_stream" else 50_000
    tensors = [randn(base + i, DTYPES[i % 4], gen) for i in range(6)] + [randn(3 << 20, torch.bfloat16, gen)]
    tensors = cached(tensors)
    tensors[2][7] = float("nan")
    tensors[5][0] = 0.0
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(default)  # the inputs are ready on both streams before the sleep below
    first_stream, second_stream = (default, side) if fill_on == "default_stream" else (side, default)
    with torch.cuda.stream(first_stream):
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        OP(tensors)  # (a full table admits a list at its second call)
        first = OP(tensors)  # the fill, enqueued behind the sleep
    with torch.cuda.stream(second_stream):
        second = OP(tensors)  # hit, on another stream
    if has_cuda_kernel():  # (the pure-PyTorch kernel has no fill to wait for)
        assert not first_stream.query(), "the fill finished before the second call: the test checked nothing"
    default.wait_stream(side)
    torch.cuda.synchronize()
    assert_matches(first, tensors)
    assert_matches(second, tensors)
    for a, b in zip(first, second):  # same bits on both streams
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))


def test_cache_eviction_then_reuse_of_evicted_lists(gen):
    # The cache holds 16 entries (kCapacity). A list called twice in a row is admitted at its second call, evicting
    # the least recently used entry: 24 such lists evict the first 8.
    lists = distinct_lists(gen, 24, 5_000)
    for ts in lists:
        assert_matches(OP(ts), ts)
        assert_matches(OP(ts), ts)
    for k, ts in enumerate(lists[:6]):  # evicted by now; change their contents in place, then call again
        with torch.no_grad():
            for t in ts:
                t.mul_(-3.0)
            ts[k % 3][k] = float("inf") if k % 2 else 0.0
    if has_cuda_kernel():  # proof that the first list was evicted: calling it again writes its metadata again
        got = []
        names = cuda_activity(lambda: got.append(OP(lists[0])))
        assert fills(names), names
        assert_matches(got[0], lists[0])
    for ts in lists[:6] + lists[-4:]:
        assert_matches(OP(ts), ts)


def test_cache_eviction_while_kernels_in_flight(gen):
    # Everything below is enqueued while the GPU sleeps: the big list's entry is evicted (its memory freed
    # stream-ordered) before its fill and kernels have run, then it is filled again.
    big = [randn(1 << 26, torch.bfloat16, gen), randn((1 << 24) + 3, torch.float32, gen)]
    big[0][-1] = 1e4
    big = cached(big)
    lists = distinct_lists(gen, 20, 9_000)
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    calls = [(big, OP(big)), (big, OP(big))]  # admitted by its second call at the latest
    for ts in lists:  # each twice: admitted; the big list's entry is the least recently used, evicted first
        calls += [(ts, OP(ts)), (ts, OP(ts))]
    calls.append((big, OP(big)))  # a miss again, while its first launch has not run
    calls += [(ts, OP(ts)) for ts in lists[:4]]  # evicted too
    if has_cuda_kernel():
        assert not torch.cuda.current_stream().query(), "the GPU caught up with the host: nothing was in flight"
    torch.cuda.synchronize()
    for ts, got in calls:
        assert_matches(got, ts)


@pytest.mark.parametrize(
    "dtype, scale",
    [
        (torch.bfloat16, 1e-30),  # squares (1e-60) underflow float32 to zero
        (torch.float32, 1e-30),
        (torch.float32, 1e-40),  # float32 subnormals
        (torch.float32, 1e-20),  # squares in float32's subnormal range: a float32 sum would lose precision
        (torch.bfloat16, 1e-20),
        (torch.float32, 1e18),  # each square fits float32, their sum does not
        (torch.bfloat16, 1e18),
        (torch.float16, 1e-6),  # float16 subnormals
    ],
)
def test_tiny_and_huge_values(dtype, scale, gen):
    # Inputs a float32 fast path would get wrong; each must match the float64 reference (and stay finite).
    base = (torch.randn(200_001, dtype=torch.float64, device="cuda", generator=gen) * scale).to(dtype)
    base[0] = scale  # so that base[:1] is not rounded to zero
    tensors = [base[:1], base[1:8], base[:1000], base[3:70_003], base]  # unaligned views and several tiles
    check(tensors)
    sumsq, amax, _ = OP(tensors)
    assert torch.isfinite(sumsq).all() and (sumsq > 0).all() and (amax > 0).all(), (sumsq, amax)
    if scale < 1:
        assert bool((base != 0).any()) and float(base.abs().max()) < 1e4 * scale  # the inputs really are tiny
    if scale == 1e-40 or dtype == torch.float16:
        assert float(base.abs().max()) < torch.finfo(dtype).smallest_normal  # all subnormal


def test_float16_near_its_max_sums_finite(gen):
    # 6e4 squared is 3.6e9, far beyond float16's 65504: sumsq must be computed in a wider type and stay finite.
    n = 100_003
    sign = torch.where(torch.arange(n, device="cuda") % 3 == 0, -1.0, 1.0)
    tensors = [
        (sign * 6e4).to(torch.float16),
        ((torch.rand(n, device="cuda", generator=gen) * 2 - 1) * 65504).to(torch.float16),
        torch.full((17,), 65504.0, device="cuda", dtype=torch.float16)[1:],
    ]
    check(tensors)
    sumsq, amax, counts = OP(tensors)
    assert torch.isfinite(sumsq).all() and int(counts[:, INF].sum()) == 0
    assert float(amax[0]) == 60000.0 and float(amax[2]) == 65504.0
    exact = torch.tensor(n * 3.6e9, dtype=torch.float64, device="cuda")
    torch.testing.assert_close(sumsq[0], exact, rtol=1e-5, atol=0)  # the contract's bound for 16-bit inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_tiny_and_normal_values(dtype, gen):
    # Tiles of tiny values next to tiles of normal ones, both in one tensor and as separate tensors of one list.
    tile = 64 * 1024 // torch.tensor([], dtype=dtype).element_size()
    normal = torch.randn(2 * tile, device="cuda", generator=gen)
    tiny = torch.randn(2 * tile + 5, device="cuda", generator=gen) * 1e-30
    interleaved = torch.randn(4099, device="cuda", generator=gen)
    interleaved[::2] *= 1e-30
    almost_all_tiny = torch.randn(3 * tile, device="cuda", generator=gen) * 1e-25
    almost_all_tiny[tile + 11] = 1e-3  # one normal value in a tile of tiny ones
    tensors = [t.to(dtype) for t in (torch.cat([normal, tiny]), tiny, normal, interleaved, almost_all_tiny)]
    tensors.append(torch.cat([tiny, normal]).to(dtype)[1:])
    check(tensors)
    if dtype == torch.float32:
        subnormal = (torch.randn(333, device="cuda", generator=gen) * 1e-40).to(dtype)
        check([subnormal, tensors[2], torch.cat([subnormal, tensors[0]])])


@pytest.mark.parametrize("pool_asserts", [False, True], ids=["results", "inductor_pool_asserts"])
def test_reduce_overhead_cached_metadata_not_in_or_clobbered_by_cudagraph_pool(pool_asserts, gen):
    # torch.compile(mode="reduce-overhead") runs its warm-up calls eagerly with every allocation of the thread routed
    # to the cudagraph trees' private pool. Anything the op kept from such a call (a cached metadata buffer) would be
    # a live block the trees do not track: their checkpoint restore frees it ("could not find <ptr>") or hands it to
    # a later recording, whose replays overwrite it. "results" checks every output and an eager call after each
    # step; "inductor_pool_asserts" turns on inductor's own check that every live block of the pool is one it tracks
    # (docs/cuda.md, "Why the previous design failed under reduce-overhead").
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step_fn(grads, pad):
        # The one-element views of `pad` take both lists past the inline limit (as cached() does), so that their
        # metadata goes through the cache in the eager warm-up and into graph-owned buffers when recorded, not into
        # kernel parameters.
        n, padding = len(grads), list(pad.split(1))
        stats = torch_gradstats.multi_tensor_stats(grads + padding)
        halves = [g * 0.5 for g in grads]  # temporaries from the graph's pool, read by the op as well
        halves_sumsq = torch_gradstats.multi_tensor_stats(halves + padding).sumsq[:n]
        return stats.sumsq[:n], stats.amax[:n], stats.counts[:n], halves_sumsq

    compiled = torch.compile(step_fn, mode="reduce-overhead", dynamic=False)

    def run_and_check(grads, step):
        torch.compiler.cudagraph_mark_step_begin()
        out = [o.clone() for o in compiled(grads, pad)]  # outputs live in the pool until the next replay: copy them
        try:
            assert_matches(out[:3], grads)
            ref_halves = reference_multi_tensor_stats([g * 0.5 for g in grads])[0]
            torch.testing.assert_close(out[3], ref_halves, rtol=1e-5, atol=0, equal_nan=True)
            check(grads + list(pad.split(1)))  # eager, after the compiled call: hits the entry the warm-up created
        except AssertionError as exc:
            raise AssertionError(f"step {step}: {exc}") from exc

    def fill(grads, step):
        with torch.no_grad():
            for i, g in enumerate(grads):
                g.copy_(randn(g.numel(), g.dtype, gen, scale=10.0 ** (step % 4 - 1)))
            if step == 3:
                grads[1][5] = float("inf")
            if step == 4:
                grads[3][-1] = float("nan")

    def make(sizes):  # sizes differ between the two variants, so neither hits the other's cache entries
        return [randn(n + 2 * pool_asserts, DTYPES[i % 4], gen) for i, n in enumerate(sizes)]

    captured_before = cache_info()["captured_calls"] if has_cuda_kernel() else 0
    pad = torch.rand(inline_limit() + 1, device="cuda")
    with inductor_config.patch({"triton.slow_path_cudagraph_asserts": pool_asserts}):
        grads_a = make([7, 1 << 17, 999, 70_013, 4096])
        for step in range(6):  # warm-up, recording, replays; gradients changed in place between steps
            fill(grads_a, step)
            run_and_check(grads_a, step)
        fresh_a = make([7, 1 << 17, 999, 70_013, 4096])  # new tensors, same shapes: replays the same graph
        run_and_check(fresh_a, "new tensors")
        grads_b = make([33, 50_001, 1 << 16])  # other shapes: another warm-up and recording in the same pool
        for step in range(3):
            fill(grads_b, step)
            run_and_check(grads_b, f"b{step}")
        for step in range(2):  # back to the first graph, then eager hits on every list seen so far
            fill(grads_a, step + 6)
            run_and_check(grads_a, f"a{step + 6}")
        for grads in (grads_a, fresh_a, grads_b):
            check(grads + list(pad.split(1)))
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped: the test did not test them"
    if has_cuda_kernel():  # two recordings (two graphs), two op calls in each
        assert cache_info()["captured_calls"] >= captured_before + 4, "the op never ran under capture"
    torch._dynamo.reset()


@needs_cuda_kernel
def test_capture_of_lists_longer_than_one_fill_launch(gen):
    # 2,000 tensors need several fill launches (680 entries per launch with 32 KB of parameters, 80 with 4 KB) to
    # write the graph's metadata while it is captured: replays after in-place changes must see every tensor's.
    tensors = [randn(1 + (i * 37) % 300, DTYPES[i % 4], gen) for i in range(2_000)]
    torch.cuda.synchronize()
    before = cache_info()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(tensors)
    after = cache_info()
    assert after["captured_calls"] == before["captured_calls"] + 1
    assert after["fill_launches"] - before["fill_launches"] >= 3, (before, after)
    for step in range(2):
        with torch.no_grad():
            for i, t in enumerate(tensors):
                t.copy_(randn(t.numel(), t.dtype, gen, scale=2.0**step))
            tensors[1999][-1] = float("inf")
            tensors[817][0] = float("nan")  # in the second fill launch's range
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(captured, tensors)


def settled_graph_buffers(timeout_s: float = 5.0) -> dict[str, int]:
    """cache_info() once no graph destroyed earlier is still waiting for CUDA to run its buffer's destructor (that
    runs on a CUDA thread, some time after the graph's last launch)."""
    import gc
    import time

    gc.collect()
    torch.cuda.synchronize()
    info, deadline = cache_info(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        again = cache_info()
        if again["graph_buffers"] == info["graph_buffers"]:
            return again
        info = again
    return info


def ours(names: list[str]) -> list[str]:
    """This extension's kernels among a profile's events (torch itself may add kernels to a replay)."""
    return [n for n in names if any(k in n for k in ("tile_stats", "finalize", "fill_metadata"))]


@needs_cuda_kernel
def test_captured_call_owns_its_metadata_and_replays_only_the_two_kernels(gen):
    # The metadata is written once while the graph is captured, into a buffer the graph owns (a CUDA user object):
    # a replay runs the two kernels and nothing else of ours, and destroying the graph frees the buffer.
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([3, 70_003, 1 << 16, 4_097, 123, 9_999])]
    tensors = cached(tensors)  # past the inline limit: one-element views, one tile each
    # Tiles: 3 f16 -> 1; 70,003 bf16 (140 KB) -> 3 of 64 KB; 65,536 f32 (256 KB) -> 4; 4,097 f64 -> 1; 123 f16 -> 1;
    # 9,999 bf16 -> 1; the padding 1 each. Metadata: 48 bytes per tensor and 4 per tile.
    expected_bytes = len(tensors) * 48 + (11 + len(tensors) - 6) * 4
    before = settled_graph_buffers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(tensors)
    during = cache_info()
    assert during["graph_buffers"] - before["graph_buffers"] == 1, (before, during)
    assert during["graph_buffer_bytes"] - before["graph_buffer_bytes"] == expected_bytes, (before, during)
    names = ours(cuda_activity(graph.replay))
    assert any("tile_stats" in n for n in names), names  # the profiler sees the graph's kernels
    assert not fills(names) and len(names) == 2, names
    for step in range(3):
        with torch.no_grad():
            for t in tensors:
                t.copy_(randn(t.numel(), t.dtype, gen, scale=4.0**step))
            tensors[step][step] = [float("nan"), float("inf"), 0.0][step]
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(captured, tensors)
    del graph  # CUDA runs the buffer's destructor on its own thread; the next call of the op frees the buffer
    after = settled_graph_buffers()
    assert after["graph_buffers"] == before["graph_buffers"], (before, after)
    assert after["graph_buffer_bytes"] == before["graph_buffer_bytes"], (before, after)


@needs_cuda_kernel
def test_graph_destroyed_with_a_replay_in_flight_keeps_its_metadata_until_it_ran(gen):
    # The graph is destroyed while its replay waits behind a long sleep. Then, on a side stream the sleep does not
    # hold up, calls miss the cache with lists whose metadata has the same size: each frees the buffers of released
    # graphs and allocates from the same pool, and its fill runs at once. Had the graph's buffer been freed before
    # its pending replay (CUDA must release the graph's reference only after its last launch), one of them could
    # take that block and overwrite it first.
    sizes = [11, 80_001, 3_333]  # float16, bfloat16, float32: 5 tiles, 140 bytes of metadata
    first = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate(sizes)]
    first[1][5] = float("nan")
    first[2][7] = 0.0
    first = cached(first)  # the same padding in every list: metadata of the same size
    others = [cached([randn(n + 1 + k, DTYPES[i % 4], gen) for i, n in enumerate(sizes)]) for k in range(20)]
    settled_graph_buffers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(first)
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    graph.replay()
    del graph
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        results = []
        for ts in others:  # a full table admits a list at its second call: that one allocates from the pool
            OP(ts)
            results.append(OP(ts))
    side.synchronize()
    assert not torch.cuda.current_stream().query(), "the sleep ended before the calls above: nothing was in flight"
    torch.cuda.synchronize()
    assert_matches(captured, first)
    for ts, got in zip(others, results):
        assert_matches(got, ts)


def settle() -> None:
    # The memory pool trims its free memory at a synchronization; the first one may come before the last frees ran.
    torch.cuda.synchronize()
    torch.cuda.synchronize()


@needs_cuda_kernel
def test_memory_bounded_over_1000_distinct_lists(gen):
    # Every list is new (a cache miss): views at 1,000 offsets of one 256 MB buffer, each with 4,096 tiles, so an
    # entry holds ~16 KB of metadata and 1,000 entries kept alive would hold ~16 MB. Memory measured: the caching
    # allocator's (per-call temporaries must die with their call) and the cache's own (its entries, its pool).
    big = randn(1 << 26, torch.float32, gen)
    small = randn(77, torch.bfloat16, gen)
    n = (1 << 26) - 4096
    lists = [cached([big[16 * k : 16 * k + n], small]) for k in range(1_020)]
    for ts in lists[:20]:  # reach the steady state (full cache, caching-allocator blocks for the temporaries)
        OP(ts)
    settle()
    start, allocated0 = cache_info(), torch.cuda.memory_allocated()
    peak_bytes = peak_entries = 0
    for k, ts in enumerate(lists[20:]):
        got = OP(ts)
        info = cache_info()
        peak_bytes, peak_entries = max(peak_bytes, info["bytes"]), max(peak_entries, info["entries"])
        if k % 199 == 0:
            assert_matches(got, ts)
        del got
    settle()
    end = cache_info()
    assert end["fill_launches"] - start["fill_launches"] >= 1_000, (start, end)  # they really were misses
    # Entries evicted here were read on this stream only: freed at once. (Retired ones of earlier tests, read on
    # streams that have not called since, may still wait for them.)
    assert peak_entries <= 16 and end["retired"] <= start["retired"], (start, end)
    entry_bytes = len(lists[0]) * 48 + (4096 + len(lists[0]) - 1) * 4
    assert peak_bytes <= 16 * entry_bytes, (peak_bytes, entry_bytes)
    assert torch.cuda.memory_allocated() == allocated0, "a per-call temporary outlived its call"
    # Evicted entries return to the cache's memory pool, stream-ordered; 1,000 entries kept would be ~16 MB.
    assert end["pool_reserved"] - start["pool_reserved"] <= 4 << 20, (start, end)


@needs_cuda_kernel
def test_captured_graph_replays_after_1000_lists_evicted_everything(gen):
    grads = cached([randn(n, DTYPES[i % 4], gen) for i, n in enumerate([5, 70_001, 1 << 16, 333])])
    OP(grads)  # an eager call first: its cache entry is then evicted by the lists below
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = OP(grads)
    for ts in distinct_lists(gen, 1_000, 200_000):  # 1,000 lists, each called twice: every earlier entry is evicted
        OP(ts)
        OP(ts)
    with torch.no_grad():
        for g in grads:
            g.copy_(randn(g.numel(), g.dtype, gen, scale=7.0))
        grads[2][9] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(captured, grads)


@needs_cuda_kernel
def test_capture_on_one_thread_while_another_misses_the_cache(gen):
    # Thread B captures in the default (global) mode while thread A's eager calls miss the cache, which allocates
    # and creates events: done under the relaxed capture mode, they must not invalidate B's capture.
    import threading

    fresh = distinct_lists(gen, 20, 310_000)
    side_a = torch.cuda.Stream()
    side_a.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_a):  # the caching allocator then holds blocks (for side_a) for every call below
        for ts in fresh:
            OP(ts)
    fresh = [[t.clone() for t in ts] for ts in fresh]  # new addresses: misses again, 20 of them (evictions too)
    grads = cached([randn(n, DTYPES[i % 4], gen) for i, n in enumerate([11, 4097, 50_000])])
    torch.cuda.synchronize()
    capturing, done = threading.Event(), threading.Event()
    results, errors = [], []

    def eager_thread():
        try:
            capturing.wait(timeout=30)
            with torch.cuda.stream(side_a):
                for ts in fresh:  # a full table admits a list at its second call: that one allocates and fills
                    OP(ts)
                    results.append((ts, OP(ts)))
        except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # reported on the main thread
            errors.append(exc)
        finally:
            done.set()

    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    thread = threading.Thread(target=eager_thread)
    thread.start()
    with torch.cuda.stream(capture_stream):
        graph.capture_begin()  # global mode; no empty_cache before it (unlike torch.cuda.graph)
        try:
            captured = OP(grads)
            capturing.set()
            done.wait(timeout=60)
        finally:
            graph.capture_end()
    thread.join()
    assert not errors, errors
    side_a.synchronize()
    for ts, got in results:
        assert_matches(got, ts)
    with torch.no_grad():
        grads[1][3] = float("-inf")
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(captured, grads)


@needs_cuda_kernel
def test_threads_evicting_each_other_read_their_own_metadata(gen):
    # 8 threads call the op (the eager entry point releases the GIL, so several are inside it at once) on 48 lists,
    # three cache's worth: entries are looked up by one thread while another's misses evict. Half the threads share
    # the default stream, the others have streams of their own; every call orders the cache's frees after its own
    # reads when it ends. Each result must match its own list, and no entry stays pinned.
    import threading

    lists = distinct_lists(gen, 48, 420_000)
    expected = [reference_multi_tensor_stats(ts) for ts in lists]
    torch.cuda.synchronize()
    errors: list[Exception] = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            stream = torch.cuda.current_stream() if t % 2 == 0 else torch.cuda.Stream()
            with torch.cuda.stream(stream):
                start.wait()
                for i in range(300):
                    k = (t * 7 + i * 5) % len(lists)
                    got = torch_gradstats.multi_tensor_stats(lists[k])
                    if i % 50 == 49:
                        stream.synchronize()
                    if not torch.equal(got.counts, expected[k][2]) or not torch.equal(got.amax, expected[k][1]):
                        raise AssertionError(f"thread {t}, call {i}: list {k} got another list's statistics")
                stream.synchronize()
        except (RuntimeError, AssertionError, ValueError, TypeError) as exc:  # reported on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    info = cache_info()
    assert info["pinned"] == 0 and info["entries"] <= info["capacity"] == 16, info


@needs_cuda_kernel
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cache_capacity_is_per_device(gen):
    # 16 lists on each of two devices: neither evicts the other's (a shared 16-entry table would thrash).
    per_device = {}
    for d in (0, 1):
        with torch.cuda.device(d):
            g = torch.Generator(device=f"cuda:{d}").manual_seed(d)
            per_device[d] = [
                cached([(torch.randn(600_000 + 11 * k + j, device=f"cuda:{d}", generator=g)) for j in range(2)])
                for k in range(16)
            ]
            for ts in per_device[d]:  # twice: a full table admits a list at its second call
                OP(ts)
                OP(ts)
    for d in (0, 1):
        with torch.cuda.device(d):
            names = cuda_activity(lambda d=d: [OP(ts) for ts in per_device[d]])
            assert not fills(names), f"device {d}: the other device's calls evicted its entries"
            assert cache_info()["entries"] == 16


@needs_cuda_kernel
def test_many_short_lists_need_no_metadata_eager_or_captured(gen):
    # A call per DDP bucket or per hook: 100 distinct lists alternating for 3 steps, and a list of exactly the inline
    # limit. Their metadata is a kernel parameter: no fill, no cache entry, no graph buffer; a replay runs two kernels.
    lists = [[randn(1 + 97 * k + j, DTYPES[(k + j) % 4], gen) for j in range(1 + k % 5)] for k in range(100)]
    limit = inline_limit()
    at_limit = [randn(1 + (i * 31) % 200, DTYPES[i % 4], gen) for i in range(limit)]
    lists[7][0][3] = float("nan")
    before = cache_info()
    for _ in range(3):
        for ts in lists + [at_limit]:
            assert_matches(OP(ts), ts)
    names = cuda_activity(lambda: OP(at_limit))
    assert not fills(names) and len(names) == 2, names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [OP(ts) for ts in lists[:10]]
    after = cache_info()
    assert after["fill_launches"] == before["fill_launches"], (before, after)
    assert after["entries"] <= before["entries"] and after["graph_buffers"] == before["graph_buffers"], (before, after)
    assert after["captured_calls"] == before["captured_calls"] + 10, (before, after)
    names = ours(cuda_activity(graph.replay))
    assert len(names) == 20 and not fills(names), names
    with torch.no_grad():
        for ts in lists[:10]:
            ts[-1].mul_(-2.0)
    graph.replay()
    torch.cuda.synchronize()
    for ts, got in zip(lists[:10], captured):
        assert_matches(got, ts)
    # One tensor more: the cache's path again.
    longer = at_limit + [randn(5, torch.float32, gen)]
    assert fills(cuda_activity(lambda: OP(longer))), "a list past the inline limit must write its metadata"


@needs_cuda_kernel
@pytest.mark.parametrize("overload", ["plain", "histogram"])
def test_broadcast_views_cost_no_extra_launch(overload, gen):
    # The repeat of broadcast (stride-0) dimensions is applied by the finalize kernel: the two launches only (the
    # histogram's zeroing aside), however many broadcast tensors the list holds.
    row = randn(1000, torch.float32, gen)
    row[3] = 0.0
    views = [row.expand(7, 1000), randn(300, torch.bfloat16, gen).view(300, 1).expand(300, 5),
             torch.tensor(3.0, device="cuda").expand(10, 10), randn(1 << 17, torch.float16, gen).expand(3, -1),
             randn(77, torch.float64, gen)]  # fmt: skip
    op = OP if overload == "plain" else torch.ops.torch_gradstats.multi_tensor_stats.histogram
    OP(views)
    names = [n for n in cuda_activity(lambda: op(views)) if not n.lower().startswith(("memset", "memcpy"))]
    kernels = [n for n in names if "tile_stats" in n or "finalize" in n]
    assert len(kernels) == 2 and len(names) <= 3, names  # (a fill of zeros for the histogram, nothing per view)
    got = op(views)
    assert_matches(got[:3], views)
    if overload == "histogram":
        ref = torch.ops.torch_gradstats.multi_tensor_stats.histogram([v.cpu() for v in views])[3]
        assert torch.equal(got[3].cpu(), ref), (got[3].cpu() - ref).abs().sum(dim=1)


def cond_stats(pred: torch.Tensor, tensors: list[torch.Tensor]):
    def take(*ts):
        got = OP(list(ts))
        return got[0], got[1], got[2]

    def doubled(*ts):
        got = OP([t * 2 for t in ts])
        return got[0], got[1], got[2]

    return torch.cond(pred, take, doubled, tuple(tensors))


@needs_cuda_kernel
def test_op_inside_cond_and_while_loop_compiled_on_cuda(gen):
    tensors = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([5, 70_001, 4_097])]
    tensors[1][3] = float("nan")
    compiled = torch.compile(cond_stats, fullgraph=True)
    for flag in (True, False):
        got = compiled(torch.tensor(flag, device="cuda"), tensors)
        assert_matches(got, tensors if flag else [t * 2 for t in tensors])

    def loop(x):
        def body(i, x, total):
            return i + 1, x * 2, total + OP([x])[0]

        zero = torch.zeros(1, dtype=torch.float64, device="cuda")
        return torch.while_loop(lambda i, x, total: i < 3, body, (torch.tensor(0, device="cuda"), x, zero))

    x = randn(50_000, torch.float32, gen)
    _, _, total = torch.compile(loop, fullgraph=True)(x)
    expected = sum(reference_multi_tensor_stats([x * k])[0] for k in (1, 2, 4))
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)


@needs_cuda_kernel
def test_op_inside_cond_captured_into_conditional_nodes(gen):
    # torch.cond captured into a CUDA graph's conditional nodes: each branch's call is captured into the body graph
    # of an IF node. The metadata buffer must live as long as the executable graph, which replays below after the
    # cudaGraph_t is gone (torch destroys it after instantiation) and after 300 misses reused the cache's pool.
    from torch._higher_order_ops.cudagraph_conditional_nodes import (
        ControlFlowOpWarmupDispatchMode,
        CUDAGraphCaptureControlFlowOpDispatchMode,
    )

    # Past the inline limit (cached()): metadata passed as kernel parameters would need no buffer at all.
    tensors = cached([randn(n, DTYPES[i % 4], gen) for i, n in enumerate([7, 90_001, 4_099])])
    pred = torch.tensor(True, device="cuda")
    with ControlFlowOpWarmupDispatchMode():
        cond_stats(pred, tensors)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph), CUDAGraphCaptureControlFlowOpDispatchMode():
            captured = cond_stats(pred, tensors)
    except RuntimeError as exc:  # conditional nodes need CUDA 12.4+ (driver and toolkit)
        if "conditional" in str(exc).lower() or "12.4" in str(exc):
            pytest.skip(f"no CUDA graph conditional nodes here: {exc}")
        raise
    for ts in distinct_lists(gen, 300, 700_000):  # each twice: a full table admits a list at its second call
        OP(ts)
        OP(ts)
    torch.cuda.synchronize()
    for step, flag in enumerate([True, False, True]):
        pred.fill_(flag)
        with torch.no_grad():
            for t in tensors:
                t.copy_(randn(t.numel(), t.dtype, gen, scale=3.0**step))
            tensors[step][step] = float("inf")
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(captured, tensors if flag else [t * 2 for t in tensors])


@needs_cuda_kernel
def test_nested_captures_on_two_streams_each_own_their_metadata(gen):
    # One thread captures two graphs at once (an inner capture on a second stream while the outer one is open):
    # each call attaches its buffer to its own capture's graph, and each graph replays on its own.
    outer_in = cached([randn(n, DTYPES[i % 4], gen) for i, n in enumerate([9, 80_003])])
    inner_in = cached([randn(n, DTYPES[(i + 1) % 4], gen) for i, n in enumerate([13, 5_003, 1 << 16])])
    before = settled_graph_buffers()
    outer, inner = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s_outer, s_inner = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s_outer):
        outer.capture_begin(capture_error_mode="thread_local")
        try:
            got_outer = OP(outer_in)
            with torch.cuda.stream(s_inner):
                inner.capture_begin(capture_error_mode="thread_local")
                try:
                    got_inner = OP(inner_in)
                finally:
                    inner.capture_end()
        finally:
            outer.capture_end()
    assert settled_graph_buffers()["graph_buffers"] - before["graph_buffers"] == 2
    for step in range(2):
        with torch.no_grad():
            for t in outer_in + inner_in:
                t.copy_(randn(t.numel(), t.dtype, gen, scale=2.0**step))
            inner_in[step][0] = float("nan")
        outer.replay()
        inner.replay()
        torch.cuda.synchronize()
        assert_matches(got_outer, outer_in)
        assert_matches(got_inner, inner_in)
    del outer, inner
    assert settled_graph_buffers()["graph_buffers"] == before["graph_buffers"]


# ---------------------------------------------------------------------------------------------------------------
# torch.compile with CUDA graphs (cudagraph trees) around real training steps.
#
# The models below compute exactly: integer inputs and targets, weights on a grid of 1/4 (re-rounded after every
# optimizer step), a loss linear in the output. Every product and sum of the forward and backward passes is then
# exact in float32 whatever the kernel or summation order, so the gradients of the compiled model and of its eager
# twin are the same bits, and so must be every statistic the op returns on them.


def exact_model(seed: int, device: str = "cuda") -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False)
    ).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=gen).float() / 4)
    return model


def exact_batches(
    steps: int, nan_step: int, inf_step: int, device: str = "cuda"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    batches = []
    for step in range(steps):
        x = torch.randint(-3, 4, (4, 16), generator=gen).float()
        y = torch.randint(-2, 3, (4, 8), generator=gen).float()
        if step == nan_step:
            x[0, 0] = float("nan")
        if step == inf_step:
            x[1, 2] = float("inf")
        batches.append((x.to(device), y.to(device)))
    return batches


def train_step(model, optimizer, x, y):
    """One real step: forward, backward, the raw op, grad_stats, fused clipping, optimizer step."""
    loss = (model(x) * y).sum()
    loss.backward()
    params = list(model.parameters())
    raw = torch_gradstats.multi_tensor_stats([p.grad for p in params])
    stats = torch_gradstats.grad_stats(model.named_parameters())
    clipped = torch_gradstats.clip_grad_norm_(model.named_parameters(), max_norm=40.0)
    with torch.no_grad():
        for p in params:
            p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a non-finite step changes nothing
    optimizer.step()
    with torch.no_grad():
        for p in params:
            p.copy_(torch.round(p * 4) / 4)  # back onto the grid: the next step computes exactly again
    return (
        raw.sumsq,
        raw.amax,
        raw.counts,
        stats.sumsq,
        stats.amax,
        stats.counts,
        stats.total_norm,
        clipped.clip_norm,
        clipped.clip_coef,
    )


def run_training(mode: str | None, device: str = "cuda", steps: int = 20, nan_step: int = 5, inf_step: int = 9):
    """Per-step outputs of train_step, compiled with `mode` (None: eager), and the model's final weights."""
    model = exact_model(0, device)
    # Gradients with fixed addresses, marked static: compiled optimizers then read them in place under CUDA graphs.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
        if mode is not None:
            torch._dynamo.mark_static_address(p.grad)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0**-3)
    step_fn = train_step if mode is None else torch.compile(train_step, mode=mode)
    history = []
    for x, y in exact_batches(steps, nan_step, inf_step, device):
        if mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        out = step_fn(model, optimizer, x, y)
        history.append([o.detach().clone() for o in out])  # CUDA-graph outputs are overwritten by the next replay
        optimizer.zero_grad(set_to_none=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return history, [p.detach().clone() for p in model.parameters()]


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that any NaN equals any NaN (NaN payloads are the producing kernel's business)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.is_floating_point():
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: {a} != {b}"
        a, b = a.nan_to_num(nan=0.0), b.nan_to_num(nan=0.0)
        bits = {torch.float64: torch.int64, torch.float32: torch.int32}[a.dtype]
        a, b = a.view(bits), b.view(bits)
    assert torch.equal(a, b), f"{what}: {a} != {b}"


@needs_cuda_kernel
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compiled_training_loop_matches_eager_bit_for_bit(mode):
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, eager_weights = run_training(None)
    before = cache_info()
    # GEMMs stay cuBLAS under max-autotune (its Triton templates are not under test here); CUDA graphs stay on.
    with inductor_config.patch({"max_autotune_gemm_backends": "ATEN", "triton.slow_path_cudagraph_asserts": True}):
        compiled, compiled_weights = run_training(mode)
    after = cache_info()
    torch._dynamo.reset()
    assert after["captured_calls"] > before["captured_calls"], (
        "the op never ran inside a captured CUDA graph, so this test checked nothing about CUDA graphs; "
        f"cudagraph skips: {dict(counters['inductor'])}"
    )
    names = ["raw.sumsq", "raw.amax", "raw.counts", "sumsq", "amax", "counts", "total_norm", "clip_norm", "clip_coef"]
    for step, (e, c) in enumerate(zip(eager, compiled)):
        for name, a, b in zip(names, e, c):
            assert_same_bits(a, b, f"step {step}: {name}")
    for a, b in zip(eager_weights, compiled_weights):
        assert_same_bits(a, b, "final weights")
    # The run saw what it was meant to: changing gradients, one NaN step, one Inf step, finite steps otherwise.
    nan_counts = [int(h[2][:, NAN].sum()) for h in eager]
    inf_counts = [int(h[2][:, INF].sum()) for h in eager]
    assert nan_counts[5] > 0 and sum(nan_counts) == nan_counts[5] + nan_counts[9], nan_counts
    assert inf_counts[9] > 0 or nan_counts[9] > 0, (inf_counts, nan_counts)
    finite = [float(h[6]) for k, h in enumerate(eager) if k not in (5, 9)]
    assert len(set(finite)) > 10, finite  # the gradients changed from step to step
    assert any(float(h[8]) < 1.0 for h in eager), "clipping never scaled: max_norm too large to test it"
    assert max(float(w.abs().max()) for w in eager_weights) <= 16, "weights grew past the range computed exactly"


@needs_cuda_kernel
def test_trainer_compiled_reduce_overhead_matches_eager():
    from torch_gradstats.training import Trainer, clear_compile_cache

    def fit(compile_mode):
        model = exact_model(1)
        optimizer = torch.optim.SGD(model.parameters(), lr=2.0**-3)
        trainer = Trainer(
            model,
            optimizer,
            lambda out, y: (out * y).mean(),
            max_grad_norm=40.0,
            skip_nonfinite=True,
            compile=compile_mode is not None,
            compile_mode=compile_mode,
            progress=False,
        )
        return trainer.fit(exact_batches(12, nan_step=3, inf_step=7), epochs=2)

    clear_compile_cache()
    torch._dynamo.reset()
    eager = fit(None)
    compiled = fit("reduce-overhead")
    clear_compile_cache()
    torch._dynamo.reset()
    for e, c in zip(eager, compiled):
        assert (e.nan_count, e.inf_count, e.nonfinite_steps, e.skipped_steps) == (
            c.nan_count,
            c.inf_count,
            c.nonfinite_steps,
            c.skipped_steps,
        )
        assert e.first_nonfinite_step == c.first_nonfinite_step == e.epoch * 12 + 3
        assert e.first_nonfinite_param == c.first_nonfinite_param
        assert len(e.history) == len(c.history) == 12
        for re, rc in zip(e.history, c.history):
            assert (re.nan_count, re.inf_count, re.skipped) == (rc.nan_count, rc.inf_count, rc.skipped)
            if re.nan_count == re.inf_count == 0:
                # The compiled forward may round differently from the eager one once the weights leave the grid.
                assert rc.total_norm == pytest.approx(re.total_norm, rel=1e-5)
    assert eager[0].skipped_steps == 2


@needs_cuda_kernel
def test_reduce_overhead_two_lists_alternating_and_a_list_that_changes_shape(gen):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def stats_fn(grads):
        s = torch_gradstats.multi_tensor_stats(grads)
        return s.sumsq.sqrt(), s.amax, s.counts

    compiled = torch.compile(stats_fn, mode="reduce-overhead")
    list_a = [randn(n, DTYPES[i % 4], gen) for i, n in enumerate([9, 70_000, 4099])]
    list_b = [randn(n, DTYPES[(i + 1) % 4], gen) for i, n in enumerate([1 << 17, 3, 333, 12_345])]
    before = cache_info()

    def call_and_check(grads, label):
        torch.compiler.cudagraph_mark_step_begin()
        out = [o.clone() for o in compiled(grads)]
        ref_sumsq, ref_amax, ref_counts = reference_multi_tensor_stats(grads)
        assert torch.equal(out[2], ref_counts), label
        torch.testing.assert_close(out[1], ref_amax, rtol=0, atol=0, equal_nan=True, msg=label)
        torch.testing.assert_close(out[0], ref_sumsq.sqrt(), rtol=1e-5, atol=0, equal_nan=True, msg=label)

    for step in range(8):  # two graphs in one tree, alternating; contents change in place between calls
        for name, grads in (("a", list_a), ("b", list_b)):
            with torch.no_grad():
                for g in grads:
                    g.copy_(randn(g.numel(), g.dtype, gen, scale=3.0 ** (step % 3)))
                if step == 4:
                    grads[-1][1] = float("nan")
                if step == 6:
                    grads[0][0] = float("inf")
            call_and_check(grads, f"{name}{step}")
    for step in range(6):  # new shapes: dynamic-shape graph, re-recorded per shape; then a shape seen before
        size = [1000, 1001, 5000, 70_001, 1001, 1000][step]
        grads = [randn(size, torch.float32, gen), randn(size // 2 + 1, torch.bfloat16, gen)]
        grads[1][-1] = float("inf") if step % 2 else 0.0
        call_and_check(grads, f"shape {size}")
    assert cache_info()["captured_calls"] >= before["captured_calls"] + 3, "the op never ran under capture"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


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


def test_grad_stats_keeps_the_gradient_sizes_on_the_device():
    """Step after step the same sizes: the numel tensor is made once (no pinned copy per step) and stays right."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).cuda()
    model(torch.randn(4, 5, device="cuda")).sum().backward()
    first = torch_gradstats.grad_stats(model.named_parameters())
    second = torch_gradstats.grad_stats(model.named_parameters())
    assert second.numel is first.numel and first.numel.tolist() == [15, 3, 6, 2]
    model[1].bias.grad = None
    assert torch_gradstats.grad_stats(model.named_parameters()).numel.tolist() == [15, 3, 6]


@needs_cuda_kernel
def test_eager_entry_point_skips_the_dispatcher_with_the_same_bits(gen):
    """torch_gradstats.multi_tensor_stats on plain CUDA tensors calls the CUDA kernel directly: same bits as the op,
    the profiler still sees the op's name, and kernel errors still name the tensor."""
    from torch_gradstats import _C

    tensors = [randn(n, dt, gen) for n, dt in [(5, torch.float16), (70_001, torch.bfloat16), (1 << 20, torch.float32)]]
    tensors.append(randn(64, torch.float64, gen).view(8, 8).t())
    direct = _C.direct_stats(tensors)
    assert direct is not None
    for a, b in zip(direct, OP(tensors)):
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch_gradstats.multi_tensor_stats(tensors)
    assert any(e.name == "torch_gradstats::multi_tensor_stats" for e in prof.events())
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype"):
        torch_gradstats.multi_tensor_stats([tensors[0], torch.zeros(3, dtype=torch.long, device="cuda")])
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu"):
        torch_gradstats.multi_tensor_stats([tensors[0], torch.zeros(3)])
