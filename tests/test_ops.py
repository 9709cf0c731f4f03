"""The op contract on CPU: the dispatched kernel (compiled, or the pure-PyTorch one under
TORCH_GRADSTATS_FORCE_FALLBACK=1) against the float64 reference, which is itself checked against numpy."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_gradstats as tg
from torch_gradstats.bench.timing import peak_allocated_bytes
from torch_gradstats.ops import _fallback_workspace as fallback_workspace
from torch_gradstats.ops import fallback as fallback_module
from torch_gradstats.ops.op import (
    INF,
    NAN,
    OP_QUALNAME,
    ZERO,
    TensorStats,
    fallback_multi_tensor_stats,
    reference_multi_tensor_stats,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}
op = torch.ops.torch_gradstats.multi_tensor_stats.default


def assert_matches_reference(tensors, stats=None):
    """The op's outputs against the float64 reference: sumsq within the contract's relative error, amax and counts
    exactly, NaN/Inf in the same places."""
    stats = tg.multi_tensor_stats(tensors) if stats is None else stats
    ref = reference_multi_tensor_stats(tensors)
    assert stats.sumsq.dtype == torch.float64 and stats.sumsq.shape == (len(tensors),)
    assert stats.amax.dtype == torch.float64 and stats.amax.shape == (len(tensors),)
    assert stats.counts.dtype == torch.int64 and stats.counts.shape == (len(tensors), 3)
    torch.testing.assert_close(stats.counts, ref[2], rtol=0, atol=0)
    torch.testing.assert_close(stats.amax, ref[1], rtol=0, atol=0, equal_nan=True)
    for i, t in enumerate(tensors):
        got, want = stats.sumsq[i].item(), ref[0][i].item()
        if math.isnan(want) or math.isinf(want):
            assert got == want or (math.isnan(got) and math.isnan(want)), (i, got, want)
        else:
            assert math.isfinite(got), (i, t.dtype, got)
            assert abs(got - want) <= RTOL[t.dtype] * abs(want), (i, t.dtype, got, want)


def numpy_stats(t: torch.Tensor):
    x = t.detach().double().reshape(-1).numpy()
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    return float(np.sum(x * x)), amax, [int(np.sum(x == 0)), int(np.isnan(x).sum()), int(np.isinf(x).sum())]


# ---------------------------------------------------------------------------------------------- the reference


def test_reference_agrees_with_numpy():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(37, 5, generator=g).to(d) for d in DTYPES] + [torch.empty(0), torch.tensor(-0.0)]
    sumsq, amax, counts = reference_multi_tensor_stats(tensors)
    for i, t in enumerate(tensors):
        s, a, c = numpy_stats(t)
        assert sumsq[i].item() == pytest.approx(s, rel=1e-12)
        assert amax[i].item() == a
        assert counts[i].tolist() == c


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "numel", [1, 7, 15, 16, 17, 31, 511, 512, 513, 1000, 65535, 65536, 65537, 200_003], ids=lambda n: f"n{n}"
)
def test_random_parity(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * 3).to(dtype)
    x[:: max(1, numel // 5)] = 0  # some exact zeros
    assert_matches_reference([x])


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    finfo = torch.finfo(dtype)
    nan, inf = float("nan"), float("inf")
    cases = [
        torch.tensor([0.0, -0.0, 0.0], dtype=dtype),
        torch.tensor([1.0, nan, 2.0], dtype=dtype),
        torch.tensor([1.0, inf, -inf, 3.0], dtype=dtype),
        torch.tensor([nan, inf, -0.0, 5.0], dtype=dtype),
        torch.full((1000,), finfo.max, dtype=dtype),  # squares overflow every 16/32-bit accumulator
        torch.full((3,), -finfo.max, dtype=dtype),
        torch.full((777,), finfo.tiny, dtype=dtype),
        torch.tensor([finfo.tiny / 4, -finfo.tiny / 8], dtype=dtype),  # subnormals are neither zero nor lost
    ]
    if dtype != torch.float16:
        cases.append(torch.full((2049,), 1e20, dtype=dtype))
    else:
        cases.append(torch.full((4097,), 6e4, dtype=dtype))
    stats = tg.multi_tensor_stats(cases)
    assert_matches_reference(cases, stats)
    if dtype != torch.float64:  # the contract: finite sums for every finite 16/32-bit input
        assert torch.isfinite(stats.sumsq[4:]).all()
    assert stats.counts[0].tolist() == [3, 0, 0]
    assert stats.counts[1].tolist() == [0, 1, 0] and math.isnan(stats.sumsq[1]) and math.isnan(stats.amax[1])
    assert stats.counts[2].tolist() == [0, 0, 2] and stats.sumsq[2] == inf and stats.amax[2] == inf
    assert stats.counts[3].tolist() == [1, 1, 1] and math.isnan(stats.sumsq[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-12, 1e-20, 1e-30, 1e-38, 1e-44])
def test_vanishing_gradients_keep_their_precision(dtype, scale):
    """Squares of such values underflow float32: the kernel must not report a zero or imprecise norm."""
    x = (torch.randn(5000, dtype=torch.float64) * scale).to(dtype)
    mixed = x.clone()
    mixed[100] = 1e-10  # one moderately small value among tiny ones
    assert_matches_reference([x, mixed, torch.full((513,), scale, dtype=dtype)])


@pytest.mark.parametrize("where", [0, 1, 510, 511, 512, 65535, 65536, 99_999])
def test_single_nan_anywhere_in_a_long_tensor(where):
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(where))
    x[x == 0] = 1.0  # torch.randn can return an exact 0 (about once in 10^7 draws): this test counts no zeros
    x[where] = float("nan")
    x[(where + 7) % 100_000] = float("-inf")
    stats = tg.multi_tensor_stats([x, torch.ones(3)])
    assert stats.counts[0].tolist() == [0, 1, 1]
    assert math.isnan(stats.sumsq[0]) and math.isnan(stats.amax[0])
    assert stats.sumsq[1] == 3.0 and stats.counts[1].tolist() == [0, 0, 0]


def test_empty_and_zero_dim():
    tensors = [torch.empty(0), torch.empty(3, 0, 2, dtype=torch.float16), torch.tensor(-2.5), torch.empty(0)]
    stats = tg.multi_tensor_stats(tensors)
    assert stats.sumsq.tolist() == [0.0, 0.0, 6.25, 0.0]
    assert stats.amax.tolist() == [0.0, 0.0, 2.5, 0.0]
    assert stats.counts.tolist() == [[0, 0, 0]] * 4
    assert_matches_reference(tensors, stats)


def test_strided_inputs():
    base = torch.randn(64, 33)
    tensors = [
        base.t(),  # dense, permuted: read in place
        base.permute(1, 0).contiguous().t(),
        base[:, 1:],  # sliced, not dense
        base[::2, ::3],
        base[1:].reshape(-1)[5:],  # unaligned start
        torch.randn(5, 1).expand(5, 100),  # stride 0
        torch.randn(4, 6, 8).permute(2, 0, 1),
        torch.randn(3, 8, dtype=torch.bfloat16).t()[1:],
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    ]
    assert_matches_reference(tensors)


def test_mixed_dtypes_and_many_small_tensors():
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 2000, (3000,), generator=g).tolist()
    tensors = [torch.randn(n, generator=g).to(DTYPES[i % 4]) for i, n in enumerate(sizes)]
    tensors[1234][0] = float("nan")
    tensors[2345][-1:] = float("inf")
    assert_matches_reference(tensors)


def test_tensors_straddling_chunks():
    sizes = [65535, 1, 65536, 3, 131_073, 0, 100, 65_536 * 3 - 1]
    tensors = [torch.randn(n, dtype=torch.float32 if i % 2 else torch.bfloat16) for i, n in enumerate(sizes)]
    assert_matches_reference(tensors)


# ---------------------------------------------------------------------------------------------- properties


def bitwise(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor, so NaNs compare equal to themselves."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def test_deterministic_across_calls_and_thread_counts():
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g) * 1e3 for n in (10, 300_000, 70_000, 1)]
    first = tg.multi_tensor_stats(tensors)
    again = tg.multi_tensor_stats(tensors)
    for a, b in zip(first, again):
        assert torch.equal(bitwise(a), bitwise(b))
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 7):
            torch.set_num_threads(n)
            other = tg.multi_tensor_stats(tensors)
            for a, b in zip(first, other):
                assert torch.equal(bitwise(a), bitwise(b)), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_result_does_not_depend_on_position_in_the_list():
    """grad_stats over a whole model and over a subset must agree bit for bit on a shared parameter."""
    a = torch.randn(200_001, generator=torch.Generator().manual_seed(9)) * 7
    alone = tg.multi_tensor_stats([a])
    for before in ([torch.randn(777)], [torch.randn(65_535), torch.randn(3, dtype=torch.float16)]):
        placed = tg.multi_tensor_stats(before + [a])
        assert torch.equal(bitwise(placed.sumsq[-1:]), bitwise(alone.sumsq))
        assert torch.equal(placed.counts[-1:], alone.counts)


def test_inputs_not_modified():
    tensors = [torch.randn(1000), torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float16)]
    before = [t.clone() for t in tensors]
    tg.multi_tensor_stats(tensors)
    for t, b in zip(tensors, before):
        assert torch.equal(bitwise(t), bitwise(b))


def test_does_not_track_autograd():
    w = torch.randn(10, requires_grad=True)
    assert not tg.multi_tensor_stats([w]).sumsq.requires_grad
    assert not any(out.requires_grad for out in op([w * 2]))  # the raw op too: autograd falls through


special = st.sampled_from([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e20, -3e38, 6e4, 1e-40, 1.5])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 3000), st.lists(special, max_size=4), st.integers(0, 2**31)),
        min_size=1,
        max_size=6,
    )
)
def test_property_random_lists(specs):
    tensors = []
    for dtype, n, values, seed in specs:
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 10
        for j, v in enumerate(values):
            if n:
                x[(seed + 97 * j) % n] = v
        tensors.append(x.to(dtype))
    assert_matches_reference(tensors)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call", [tg.multi_tensor_stats, op], ids=["wrapper", "raw-op"])
def test_bad_inputs_name_the_tensor(call):
    good = torch.randn(3)
    with pytest.raises(ValueError, match="at least one tensor"):
        call([])
    for bad, msg in [
        # The compiled kernels print c10's dtype names (Long), the Python checks torch's (torch.int64).
        (torch.arange(3), r"tensors\[1\] has dtype (torch.int64|Long)"),
        (torch.ones(3, dtype=torch.bool), r"tensors\[1\] has dtype (torch.bool|Bool)"),
        (torch.randn(3, dtype=torch.complex64), r"tensors\[1\] has dtype (torch.complex64|ComplexFloat)"),
    ]:
        with pytest.raises(TypeError, match=msg):
            call([good, bad])
    with pytest.raises((ValueError, RuntimeError), match=r"tensors\[2\] has layout"):
        call([good, good, torch.eye(3).to_sparse()])


def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        tg.multi_tensor_stats([torch.randn(3), torch.randn(3, device="meta")])


def test_wrapper_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"tensors\[0\] is a list"):
        tg.multi_tensor_stats([[1.0, 2.0]])


def test_accepts_any_iterable():
    gen = (torch.full((4,), float(i)) for i in range(3))
    assert tg.multi_tensor_stats(gen).sumsq.tolist() == [0.0, 4.0, 16.0]


# ---------------------------------------------------------------------------------------------- registration


def test_opcheck():
    samples = [
        [torch.randn(5, 3)],
        [torch.randn(4, dtype=torch.bfloat16), torch.randn(2, 2, dtype=torch.double), torch.randn(7, dtype=torch.half)],
        [torch.empty(0), torch.tensor(1.0)],
        [torch.randn(6, 4).t(), torch.randn(8, 8)[::2, 1:]],
    ]
    for sample in samples:
        torch.library.opcheck(op, (sample,))


def test_meta_shapes():
    out = op([torch.empty(3, 4, device="meta"), torch.empty(0, device="meta", dtype=torch.float16)])
    assert [tuple(t.shape) for t in out] == [(2,), (2,), (2, 3)]
    assert [t.dtype for t in out] == [torch.float64, torch.float64, torch.int64]


def test_compile_fullgraph_without_recompiles():
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def global_norm_and_bad(grads):
        s = tg.multi_tensor_stats(grads)
        return s.sumsq.sum().sqrt(), s.counts[:, NAN].sum() + s.counts[:, INF].sum()

    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        grads = [torch.randn(10, 3, generator=gen) * (step + 1), torch.randn(4, generator=gen).bfloat16()]
        grads[0][0, 0] = float("nan") if step == 2 else 1.0
        norm, bad = global_norm_and_bad(grads)
        ref = reference_multi_tensor_stats(grads)
        if step < 2:  # float32 squares summed in float32 runs, then in float64 (docs/accuracy.md): a few ulps
            torch.testing.assert_close(norm, ref[0].sum().sqrt(), rtol=1e-6, atol=0.0)
        assert bad.item() == (1 if step == 2 else 0)
    assert counter.frame_count == 1, "recompiled"


def test_extension_state_is_reported():
    forced = os.environ.get("TORCH_GRADSTATS_FORCE_FALLBACK") == "1"
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("torch_gradstats::multi_tensor_stats", "CPU")
    assert tg.HAS_EXTENSION == has_cpu_kernel
    if forced:
        assert not tg.HAS_EXTENSION


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_gives_the_ops_bits_and_names_errors():
    """multi_tensor_stats on plain CPU tensors calls the compiled kernel without the dispatcher (test_cuda.py does the
    same on CUDA): the op's bits, the op's name in the profiler, the kernel's errors naming the tensor."""
    import torch_gradstats.ops.op as ops_mod
    from torch_gradstats import _C

    assert ops_mod._direct_stats is _C.direct_stats
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(5, generator=g).half(), torch.randn(70_001, generator=g).bfloat16(),
               torch.randn(1 << 17, generator=g), torch.randn(64, dtype=torch.float64, generator=g).view(8, 8).t(),
               torch.randn(30, generator=g)[::3], torch.empty(0)]  # fmt: skip
    tensors[2][7] = float("nan")
    direct = _C.direct_stats(tensors)
    assert type(direct) is TensorStats  # built in C++, fields and all
    assert direct.sumsq is direct[0] and direct.counts is direct[2] and len(direct) == 3
    for a, b in zip(direct, op(tensors)):
        assert torch.equal(a.view(torch.int64), b.view(torch.int64))
    assert_matches_reference(tensors, direct)
    param = torch.nn.Parameter(tensors[2].clone())  # to C++ a Parameter is a plain tensor
    assert torch.equal(_C.direct_stats([param])[2], op([param])[2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        tg.multi_tensor_stats(tensors)
    assert any(e.name == "torch_gradstats::multi_tensor_stats" for e in prof.events())
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype Long"):
        _C.direct_stats([tensors[0], torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="at least one tensor"):
        tg.multi_tensor_stats([])


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_result_type_is_only_ever_a_namedtuple_of_the_three_outputs():
    """The C++ side builds its result with tuple.__new__, which fills any tuple subclass; a C-level one (a struct
    sequence) would then free as many items as it has fields: read past the result, or leak one. Only a NamedTuple
    with the op's three fields is taken, and the type in use stays."""
    import collections
    import time

    from torch_gradstats import _C

    class WithDict(tuple):  # instances have a __dict__
        pass

    Pair = collections.namedtuple("Pair", "sumsq amax")
    Renamed = collections.namedtuple("Renamed", "a b c")
    Four = collections.namedtuple("Four", "sumsq amax counts extra")

    class Sub(TensorStats):
        __slots__ = ()

    for bad in (list, tuple, WithDict, time.struct_time, torch.return_types.max, Pair, Renamed, Four, Sub,
                TensorStats(None, None, None), "TensorStats"):  # fmt: skip
        with pytest.raises(TypeError, match="NamedTuple class with the fields"):
            _C.set_stats_type(bad)
    got = tg.multi_tensor_stats(torch.ones(3))
    assert type(got) is TensorStats and hash(got) == hash(tuple(got))
    _C.set_stats_type(TensorStats)  # taken again: the reference to the one it replaces is released
    assert type(tg.multi_tensor_stats(torch.ones(3))) is TensorStats


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_result_is_never_seen_half_built_by_a_finalizer():
    """Wrapping the outputs allocates, so the collector may run a __del__ that looks at every object: the result
    tuple must not exist with empty slots then. In a subprocess: reading an empty slot crashed."""
    code = (
        "import gc, torch, torch_gradstats as tg\n"
        "class Peek:\n"
        "    def __init__(self):\n"
        "        self.me = self\n"
        "    def __del__(self):\n"
        "        for o in gc.get_objects():\n"
        "            if isinstance(o, tg.TensorStats):\n"
        "                o.counts.shape\n"
        "x = [torch.ones(3)]\n"
        "for _ in range(20):\n"
        "    gc.collect(); gc.set_threshold(1, 1, 1)\n"
        "    Peek()\n"
        "    got = tg.multi_tensor_stats(x)\n"
        "    gc.set_threshold(700, 10, 10)\n"
        "    assert got.counts.tolist() == [[0, 0, 0]], got\n"
        "print('ok')\n"
    )
    _assert_child_prints_ok(code)


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_without_the_gil_keeps_its_tensors_from_swap_tensors():
    """While a large CPU call runs without the GIL, another thread's torch.utils.swap_tensors must find the tensor
    in use and refuse (as it does during torch.ops), not swap its memory out from under the kernel and free it.
    In a subprocess: the use after free crashed."""
    code = (
        "import threading, time, torch, torch_gradstats as tg\n"
        "n = 1 << 24\n"
        "lst = [torch.full((n,), 2.0)]\n"
        "stop, results, refused = [False], [], [0]\n"
        "def stats():\n"
        "    while not stop[0]:\n"
        "        results.append(tg.multi_tensor_stats(lst).sumsq.item())\n"
        "th = threading.Thread(target=stats); th.start()\n"
        "for _ in range(40):\n"
        "    y = torch.full((n,), 2.0)\n"
        "    try:\n"
        "        torch.utils.swap_tensors(lst[0], y)\n"
        "    except RuntimeError:\n"
        "        refused[0] += 1\n"
        "    del y\n"
        "    time.sleep(0.002)\n"
        "stop[0] = True; th.join()\n"
        "assert refused[0] > 0, 'no swap met a running call: the test checked nothing'\n"
        "assert set(results) == {4.0 * n}, set(results)\n"
        "print('ok')\n"
    )
    _assert_child_prints_ok(code)


def _has_cuda_kernel() -> bool:
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(OP_QUALNAME, "CUDA")


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _has_cuda_kernel(), reason="no CUDA kernel"))]
)
def test_direct_entry_point_leaves_what_the_dispatcher_must_see_to_it(device):
    """Anything the dispatcher treats differently gets None, and the wrapper takes torch.ops: subclasses, torch
    function and dispatch modes (which then see the op), fake and meta tensors, mixed device types, non-lists. A
    Parameter is served (to C++ it is a plain tensor)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_gradstats import _C

    t = torch.randn(10, device=device)
    assert torch.equal(_C.direct_stats([torch.nn.Parameter(t.clone())])[0], op([t])[0])

    class Sub(torch.Tensor):
        pass

    class SeeOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for arg in ([], (t,), [None], [t, "x"], [t.as_subclass(Sub)], [torch.empty(3, device="meta")],
                [t, torch.empty(3, device="meta")]):  # fmt: skip
        assert _C.direct_stats(arg) is None, arg
    with pytest.raises(TypeError):
        _C.direct_stats()
    with TorchFunctionMode():
        assert _C.direct_stats([t]) is None
    mode = SeeOps()
    with mode:
        assert _C.direct_stats([t]) is None
        tg.multi_tensor_stats([t])
    assert any("multi_tensor_stats" in name for name in mode.seen)
    with torch._subclasses.fake_tensor.FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(t)
        assert _C.direct_stats([fake]) is None
        assert tg.multi_tensor_stats([fake]).sumsq.shape == (1,)
    with torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.Functionalize):  # a thread-local dispatch key
        assert _C.direct_stats([t]) is None
    with torch.autocast(device, dtype=torch.bfloat16):  # autocast passes the op through: served directly
        assert torch.equal(_C.direct_stats([t])[0], op([t])[0])


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_declines_tensors_with_other_dispatch_keys():
    """A ZeroTensor (no data at all) and a tensor that escaped torch.func.grad (a functorch wrapper) are strided CPU
    torch.Tensors, but their dispatch keys change what the op sees: the direct call declines, torch.ops serves them."""
    code = (  # in a subprocess: a ZeroTensor's kernel read of its null data pointer would crash
        "import torch, torch_gradstats as tg\n"
        "from torch_gradstats import _C\n"
        "op = torch.ops.torch_gradstats.multi_tensor_stats.default\n"
        "zero = torch._efficientzerotensor(3)\n"
        "escaped = []\n"
        "torch.func.grad(lambda t: (escaped.append(t), (t * t).sum())[1])(torch.ones(5))\n"
        "for t in (zero, escaped[0]):\n"
        "    assert _C.direct_stats([t]) is None, torch._C._dispatch_keys(t)\n"
        "    assert all(torch.equal(a, b) for a, b in zip(tg.multi_tensor_stats([t]), op([t])))\n"
        "assert tg.multi_tensor_stats([zero]).counts.tolist() == [[3, 0, 0]]\n"
        "print('ok')\n"
    )
    _assert_child_prints_ok(code)


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_survives_a_finalizer_calling_it_during_the_call():
    """The collector may run while the call allocates, and a __del__ may call the op again on the same thread: the
    outer call must still read its own tensors. In a subprocess: reading freed tensors could crash."""
    code = (
        "import gc, torch, torch_gradstats\n"
        "from torch_gradstats._C import direct_stats\n"
        "op = torch.ops.torch_gradstats.multi_tensor_stats.default\n"
        "armed, keep = [False], []\n"
        "class Cyc:\n"
        "    def __init__(self, extra):\n"
        "        self.me = self\n"
        "        for i in range(extra):\n"
        "            setattr(self, 'b%d' % i, object.__new__(type('B', (), {})))\n"
        "    def __del__(self):\n"
        "        if armed[0]:\n"
        "            armed[0] = False\n"
        "            inner = [torch.full((2,), 1000.0 + k) for k in range(5)]\n"
        "            keep.append(inner)\n"
        "            torch_gradstats.multi_tensor_stats(inner)\n"
        "xs = [torch.randn(70000), torch.ones(4), torch.ones(4)]\n"
        "want = op(xs)\n"
        "gc.collect(); gc.set_threshold(1, 1, 1)\n"
        "fired = 0\n"
        "for attempt in range(50):\n"
        "    drain = [[] for _ in range(100)]\n"
        "    Cyc(attempt % 4)\n"
        "    armed[0] = True\n"
        "    got = direct_stats(xs)\n"
        "    fired += not armed[0]\n"
        "    armed[0] = False\n"
        "    del drain\n"
        "    assert all(torch.equal(a, b) for a, b in zip(got, want)), (attempt, got[0], want[0])\n"
        "gc.set_threshold(700, 10, 10)\n"
        "assert fired > 0, 'the finalizer never ran during a call: the test checked nothing'\n"
        "print('ok')\n"
    )
    _assert_child_prints_ok(code)


@pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")
def test_direct_entry_point_without_the_gil_survives_the_list_being_emptied():
    """A large CPU list runs without the GIL; another thread clearing the list (the only other reference to its
    tensors) must not free them under the kernel. In a subprocess: a use after free could crash."""
    code = (
        "import sys, threading, gc, torch\n"
        "from torch_gradstats import _C\n"
        "sys.setswitchinterval(10.0)  # the GIL changes hands only where the call releases it\n"
        "for _ in range(20):\n"
        "    lst = [torch.full((1 << 20,), 2.0) for _ in range(16)]\n"
        "    out, calling = [], threading.Event()\n"
        "    def call():\n"
        "        calling.set()\n"
        "        out.append(_C.direct_stats(lst))\n"
        "    th = threading.Thread(target=call)\n"
        "    th.start(); calling.wait(); lst.clear(); gc.collect(); th.join()\n"
        "    assert out[0][0].tolist() == [4.0 * (1 << 20)] * 16, out\n"
        "print('ok')\n"
    )
    _assert_child_prints_ok(code)


def test_forced_fallback_in_subprocess():
    code = (
        "import torch, torch_gradstats as tg\n"
        "assert not tg.HAS_EXTENSION\n"
        "assert not torch._C._dispatch_has_kernel_for_dispatch_key('torch_gradstats::multi_tensor_stats', 'CPU')\n"
        "s = tg.multi_tensor_stats([torch.tensor([3.0, 4.0, 0.0])])\n"
        "assert s.sumsq.tolist() == [25.0] and s.counts.tolist() == [[1, 0, 0]], s\n"
    )
    env = dict(os.environ, TORCH_GRADSTATS_FORCE_FALLBACK="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_columns():
    assert (ZERO, NAN, INF) == (0, 1, 2)


# ---------------------------------------------------------------------------------------------- hardening
def _assert_child_prints_ok(code: str) -> None:
    """Runs ``code`` with the compiled library in a child process (where a crash is a failed test, not a dead run),
    which must print ``ok``."""
    res = _run_child(code, fallback=False)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout[-2000:] + res.stderr[-2000:]


def _run_child(code: str, fallback: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TORCH_GRADSTATS_FORCE_FALLBACK", None)
    if fallback:
        env["TORCH_GRADSTATS_FORCE_FALLBACK"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("fallback", [False, True], ids=["compiled-or-default", "fallback"])
@pytest.mark.parametrize("kept_bytes", [0, 16], ids=["freed", "shrunk"])
def test_freed_storage_is_a_clear_error_not_a_crash(fallback, kept_bytes):
    """A tensor whose storage was freed (FSDP does this) or shrunk: the old fallback segfaulted, the compiled kernel
    read out of bounds. Every entry point must raise a ValueError naming the tensor, in a child process that
    survives to say so."""
    code = f"""
import torch, torch_gradstats as tg
x = torch.ones(1000)
x.untyped_storage().resize_({kept_bytes})
for name, call in [("wrapper", lambda: tg.multi_tensor_stats([torch.ones(2), x])),
                   ("raw", lambda: torch.ops.torch_gradstats.multi_tensor_stats.default([torch.ones(2), x]))]:
    try:
        call()
        print(name, "NO ERROR")
    except ValueError as e:
        assert "tensors[1] needs 4000 bytes of storage but its storage holds {kept_bytes}" in str(e), str(e)
        print(name, "ok")
p = torch.nn.Parameter(torch.ones(1000))
p.grad = x
try:
    tg.grad_stats([("layer.weight", p)])
    print("grad_stats NO ERROR")
except ValueError as e:
    assert "parameter 'layer.weight'" in str(e) and "needs 4000 bytes" in str(e), str(e)
    print("grad_stats ok")
"""
    child = _run_child(code, fallback)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.split() == ["wrapper", "ok", "raw", "ok", "grad_stats", "ok"], child.stdout


def test_a_bare_tensor_is_one_tensor_not_a_list_of_rows():
    t = torch.ones(2, 3)
    s = tg.multi_tensor_stats(t)
    assert s.sumsq.tolist() == [6.0] and s.counts.tolist() == [[0, 0, 0]]  # not [3., 3.]: rows are not iterated
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = t.clone()
    assert tg.grad_stats(p).sumsq.tolist() == s.sumsq.tolist()  # the two agree
    with pytest.raises(RuntimeError, match="Expected a value of type 'List\\[Tensor\\]'"):
        op(t)  # the raw op takes a list only
    with pytest.raises(TypeError, match="expected a list of tensors, got a single tensor of shape \\(2, 3\\)"):
        reference_multi_tensor_stats(t)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided-nested", "jagged"])
def test_nested_tensor_is_named(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(ValueError, match=r"tensors\[1\] is a nested tensor; pass its components"):
        tg.multi_tensor_stats([torch.ones(2), nt])
    if layout == torch.strided:  # the raw op reaches a kernel registered for the nested keys
        with pytest.raises(ValueError, match=r"tensors\[1\] is a nested tensor"):
            op([torch.ones(2), nt])


@pytest.mark.parametrize(
    "bad,message",
    [
        ([torch.ones(3), torch.arange(3)], r"tensors\[1\] has dtype torch.int64"),
        ([], "expected at least one tensor"),
        ([torch.ones(3), torch.ones(2, device="meta")], r"tensors\[1\] is on meta"),
    ],
    ids=["int", "empty", "devices"],
)
def test_compile_shows_the_real_message(bad, message):
    """Under torch.compile(fullgraph=True) an input error used to surface as "Observed exception" with the message
    hidden; the fake kernel's check now raises it and Dynamo quotes it."""
    torch._dynamo.reset()

    @torch.compile(backend="eager", fullgraph=True)
    def f(ts):
        return tg.multi_tensor_stats(ts).sumsq.sum()

    with pytest.raises(Exception, match=message) as info:
        f(bad)
    assert "Observed exception" not in str(info.value)


# ---------------------------------------------------------------------------------------------- the fallback


def _fallback_cases():
    g = torch.Generator().manual_seed(11)
    base = torch.randn(97, 61, generator=g)
    cases = [torch.randn(n, generator=g).to(d) * 5 for n in (1, 2, 3, 31, 32, 33, 100, 1000, 4097) for d in DTYPES]
    cases += [
        torch.empty(0),
        torch.tensor(2.5),
        torch.tensor(-0.0, dtype=torch.float16),
        base.t(),
        base[:, 1:],
        base[::3, ::2],
        torch.randn(7, 1, generator=g).expand(7, 300),
        torch.randn(4, 6, 50, generator=g).permute(2, 0, 1),
        base.to(torch.bfloat16).t()[2:],
        torch.full((5000,), float("nan")),
        torch.full((3000,), float("-inf"), dtype=torch.float16),
        torch.full((2049,), torch.finfo(torch.float32).max),
        torch.full((300,), 1e-40),
        torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-45, -3.0] * 50),
    ]
    cases[30][17] = float("nan")  # float32, 1000 elements
    cases[35][-1] = float("-inf")  # float64, 4097 elements
    return cases


@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 2, 16, 64, 4096, 1 << 18])
def test_fallback_matches_the_reference_at_any_chunk_size(chunk):
    """Small chunks force every path: tensors cut into pieces (dense and not), padded rows, batches of rows."""
    tensors = _fallback_cases()
    out = TensorStats(*fallback_multi_tensor_stats(tensors, chunk_elems=chunk))
    assert_matches_reference(tensors, out)
    exact = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]  # 16/32-bit may square in float32
    torch.testing.assert_close(
        out.sumsq[exact], reference_multi_tensor_stats(tensors)[0][exact], rtol=1e-12, atol=0, equal_nan=True
    )


@pytest.mark.parametrize("chunk", [1, 16, 4096, 1 << 18])
def test_fallback_off_the_cpu_takes_the_exact_sync_free_path(chunk, monkeypatch):
    """Off the CPU a batch never reads a value back (no sync): every batch takes the same ops, squares in float64
    (exact for 16/32-bit values) and counts every time. Run on the CPU by telling the fallback it is elsewhere."""
    monkeypatch.setattr(fallback_module, "_branches_on_host", lambda device: False)
    tensors = _fallback_cases()
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, _f=orig, **k: reads.append(_n) or _f(*a, **k))
    out = TensorStats(*fallback_multi_tensor_stats(tensors, chunk_elems=chunk))
    monkeypatch.undo()
    assert reads == []
    assert_matches_reference(tensors, out)
    torch.testing.assert_close(out.sumsq, reference_multi_tensor_stats(tensors)[0], rtol=1e-12, atol=0, equal_nan=True)


def _sumsq_path(x: torch.Tensor) -> str:
    """Which squares the fallback used for ``x`` (one row): 'float64' (exact squares) or 'float32' (squares and
    their sum rounded to float32), told apart by the bits of the result; the probes below make the two differ."""
    got = fallback_multi_tensor_stats([x])[0].item()
    exact = (x.double() ** 2).sum().item()
    rounded = (x.float() * x.float()).sum().double().item()
    assert exact != rounded, "this probe cannot tell the paths apart"
    assert got in (exact, rounded), (got, exact, rounded)
    return "float64" if got == exact else "float32"


def test_fallback_float32_squares_only_inside_their_safe_range():
    """float32 rows square in float32 only when every nonzero |x| is in [2**-63, 2**56): their squares are then
    normal float32 numbers that cannot overflow; the boundary values themselves and values beyond them go exact."""
    f32 = torch.float32
    below = lambda v: torch.nextafter(torch.tensor(v, dtype=f32), torch.tensor(0.0, dtype=f32)).item()  # noqa: E731
    big = 2.0**55 * (1 + 2.0**-23)  # its float32 square is rounded, so the paths differ
    small = 2.0**-62 * (1 + 2.0**-23)
    assert _sumsq_path(torch.tensor([big], dtype=f32)) == "float32"
    assert _sumsq_path(torch.tensor([big, below(2.0**56)], dtype=f32)) == "float32"
    assert _sumsq_path(torch.tensor([big, 2.0**56], dtype=f32)) == "float64"
    assert _sumsq_path(torch.tensor([big, 1e30], dtype=f32)) == "float64"
    assert _sumsq_path(torch.tensor([small, 2.0**-63], dtype=f32)) == "float32"
    assert _sumsq_path(torch.tensor([small, below(2.0**-63)], dtype=f32)) == "float64"
    assert _sumsq_path(torch.tensor([small, 0.0, -0.0], dtype=f32)) == "float32"  # zeros square to zero
    assert _sumsq_path(torch.tensor([small, 0.0, 1e-45], dtype=f32)) == "float64"  # a subnormal


@pytest.mark.parametrize("length", [300, 256])  # padded rows take the bits path, full rows squares first
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fallback_rows_far_from_one_keep_the_contract(dtype, length):
    """Rows whose float32 squares would overflow (1e30) or underflow (1e-30), alone, mixed with ordinary rows in
    one batch, and with zeros or a single large value among small ones, all against the reference."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(length, generator=g, dtype=torch.float64)
    scales = [1.0, 1e-3, 1e3] if dtype == torch.float16 else [1.0, 1e30, 1e-30, 1e-19, 1e18, 2.0**56, 2.0**-63]
    rows = [(base * s).to(dtype) for s in scales]
    with_zeros = [r.clone() for r in rows]
    for r in with_zeros:
        r[::3] = 0
    one_big = (base * 1e-30).to(dtype)
    one_big[7] = 1e3 if dtype == torch.float16 else 1e30
    subnormal = (base * (1e-6 if dtype == torch.float16 else 1e-40)).to(dtype)
    huge = torch.full((4097,), 6e4 if dtype == torch.float16 else 1e30, dtype=dtype)
    special = rows[0].clone()
    special[[5, 9, 11]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    tensors = rows + with_zeros + [one_big, subnormal, huge, special, huge[:4096]]
    out = TensorStats(*fallback_multi_tensor_stats(tensors))
    assert_matches_reference(tensors, out)
    alone = [fallback_multi_tensor_stats([t]) for t in tensors]  # each row's path is its own, not its batch's
    for i, a in enumerate(alone):
        assert torch.equal(bitwise(out.sumsq[i : i + 1]), bitwise(a[0])), i
        assert torch.equal(out.counts[i : i + 1], a[2]), i


def test_fallback_skips_no_nan_or_inf():
    """Batches without any |x| at +inf's bits skip the NaN/Inf counts; a batch that has one counts them all."""
    g = torch.Generator().manual_seed(4)
    plain = [torch.randn(1000, generator=g) for _ in range(3)]
    for value, column in ((math.nan, NAN), (math.inf, INF), (-math.inf, INF)):
        with_special = [t.clone() for t in plain]
        with_special[1][500] = value
        out = fallback_multi_tensor_stats(with_special)
        assert out[2][:, column].tolist() == [0, 1, 0]
        assert out[2][:, 3 - column].tolist() == [0, 0, 0]
        assert_matches_reference(with_special, TensorStats(*out))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fallback_float32_path_bits_do_not_depend_on_threads_or_flush_denormal(dtype):
    """Squares taken in float32 are normal numbers, so neither the thread count (torch splits elementwise ops
    across threads, and only the calling thread flushes denormals) nor torch.set_flush_denormal changes a bit;
    zero/NaN/Inf counts and amax come from the bits on every path."""
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(n, generator=g).to(dtype) for n in (1, 5, 1000, 70_000, 300_000)]
    zeros = torch.randn(100_000, generator=g).to(dtype)
    zeros[::7] = 0
    tiny = torch.full((50_000,), 1e-6 if dtype == torch.float16 else 1e-39, dtype=dtype)  # subnormal
    tiny_full = tiny[: 1 << 15]  # a full row: read squares first
    tensors += [zeros, tiny, zeros[: 1 << 16], tiny_full] + [torch.randn(40, generator=g).to(dtype) for _ in range(300)]
    threads = torch.get_num_threads()
    results = {}
    try:
        for flush in (False, True):
            if flush and not torch.set_flush_denormal(True):
                break
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results[flush, n] = [bitwise(t) for t in fallback_multi_tensor_stats(tensors)]
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    first = results[False, 1]
    assert_matches_reference(tensors, TensorStats(*fallback_multi_tensor_stats(tensors)))
    # the subnormal tensor's sumsq and amax are the docstring's one exception where a thread flushes denormals
    keep = [i for i in range(len(tensors)) if tensors[i] is not tiny and tensors[i] is not tiny_full]
    for key, other in results.items():
        torch.testing.assert_close(other[2], first[2], rtol=0, atol=0)  # counts, every tensor
        assert torch.equal(other[1][keep], first[1][keep]), key
        assert torch.equal(other[0][keep], first[0][keep]), key


def test_fallback_says_mps_has_no_float64():
    """sumsq and amax are float64, which MPS cannot hold: the fallback (the only kernel MPS would get) says so and
    what to do, instead of failing inside torch on its first float64 buffer. Other devices pass."""
    with pytest.raises(NotImplementedError, match=r"MPS has no float64.*\.cpu\(\)"):
        fallback_module.require_float64(torch.device("mps"))
    for device in ("cpu", "cuda", "xpu", "meta"):
        fallback_module.require_float64(torch.device(device))


def test_fallback_rejects_a_chunk_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fallback_multi_tensor_stats([torch.ones(3)], chunk_elems=3)


def test_fallback_bits_do_not_depend_on_the_thread_count():
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=g) * 1e3 for n in (10, 300_000, 70_000, 1)]
    tensors += [torch.randn(1 << 20, generator=g, dtype=torch.float64), torch.randn(513, 700, generator=g).t()]
    tensors += [torch.randn(100, generator=g) for _ in range(200)]
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append([bitwise(t) for t in fallback_multi_tensor_stats(tensors)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tiny", [(torch.float64, 1e-310), (torch.float16, 3e-6)])
def test_fallback_counts_under_flush_denormal_do_not_depend_on_threads(dtype, tiny):
    """With torch.set_flush_denormal(True) the calling thread treats subnormal inputs as zero, other threads do not:
    comparisons gave 100,000 zeros on 1 thread and 65,536 on 2. The fallback reads zero/NaN/Inf from the bits."""
    x = torch.full((100_000,), tiny, dtype=dtype)
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            s = fallback_multi_tensor_stats([x, torch.zeros(3, dtype=dtype)])
            got.append((s[2].tolist(), bitwise(s[1]).tolist()))
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert got[0] == got[1]
    assert got[0][0] == [[0, 0, 0], [3, 0, 0]]  # subnormals are not zeros
    assert torch.tensor(got[0][1]).view(torch.float64)[0].item() == x[0].item()  # amax exact


def test_fallback_memory_is_bounded_by_its_chunk():
    """The old fallback copied each tensor whole to float64 (4.25x the largest float32 tensor). Measured with the
    allocator's own events: the fallback's extra memory stays within its documented bound for a small chunk,
    whatever the tensor sizes, and the reference (a whole float64 copy) shows the measurement can see a copy."""
    chunk = 1 << 12
    big = torch.randn(1 << 21)
    tensors = [big, torch.randn(2048, 1030)[:, 3:], torch.randn(3, 1).expand(3, 1 << 19)]
    tensors += [torch.randn(n).to(DTYPES[n % 4]) for n in range(1, 200)]
    bound = 56 * chunk + 200 * len(tensors) + 65536  # the documented bound + per-tensor bookkeeping + slack
    fallback_module.release_workspace()  # so the call below allocates its workspace in front of the profiler
    peak = peak_allocated_bytes(lambda: fallback_multi_tensor_stats(tensors, chunk_elems=chunk))
    assert peak <= bound, (peak, bound)
    assert peak_allocated_bytes(lambda: reference_multi_tensor_stats([big])) >= 8 * big.numel()


def test_float32_square_root_of_the_rounded_square_is_exact():
    """The fallback's squares-first path takes max |x| from the largest float32 square: it relies on the rounded
    square being strictly increasing in |x| and on its correctly rounded square root being |x|. Scaling by a power
    of two scales the square by a power of four exactly, so every significand (each float32 in [1, 2)) is every
    case away from underflow and overflow."""
    x = torch.arange(0x3F80_0000, 0x4000_0000, dtype=torch.int32).view(torch.float32)
    squares = x * x
    assert bool((squares[1:] > squares[:-1]).all())
    assert torch.equal(squares.double().sqrt().float(), x)  # the fallback's rounding: sqrt in float64, then float32


def test_fallback_cpu_workspace_is_per_thread_and_survives_inference_mode():
    """The CPU workspace is kept by each thread between calls: results are the same whichever thread, mode or
    order made it, and release_workspace() frees it (the next call makes a new one)."""
    g = torch.Generator().manual_seed(9)
    tensors = [torch.randn(n, generator=g) for n in (1 << 16, 1 << 16, 4096, 333, 1)]
    tensors[1][100] = 0.0
    want = [bitwise(t) for t in fallback_multi_tensor_stats(tensors)]
    fallback_module.release_workspace()
    with torch.inference_mode():  # buffers first made here are written below, outside inference mode
        inside = [bitwise(t) for t in fallback_multi_tensor_stats(tensors)]
    outside = [bitwise(t) for t in fallback_multi_tensor_stats(tensors)]
    results: list[list[torch.Tensor]] = []

    def work() -> None:
        for _ in range(20):
            results.append([bitwise(t) for t in fallback_multi_tensor_stats(tensors)])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80
    for got in [inside, outside, *results]:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert_matches_reference(tensors, TensorStats(*fallback_multi_tensor_stats(tensors)))
    # What a thread keeps is bounded by the default chunk: a call with a larger one leaves the kept buffers alone.
    kept = fallback_workspace._thread_state.cpu_workspace
    kept_bytes = sum(b.numel() for b in kept.buffers.values())
    big = [torch.randn(1 << 20, generator=g)]
    assert_matches_reference(big, TensorStats(*fallback_multi_tensor_stats(big, chunk_elems=1 << 20)))
    assert fallback_workspace._thread_state.cpu_workspace is kept
    assert sum(b.numel() for b in kept.buffers.values()) == kept_bytes <= 56 * fallback_module.FALLBACK_CHUNK_ELEMS
