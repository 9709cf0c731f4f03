"""Inputs that are views the kernels cannot read as a flat span: expanded (stride-0) views, whose statistics come from
their distinct elements without materializing them, views sliced with gaps (copied), and overlapping as_strided views
(copied when small, a clear error when the copy would be far larger than their memory). Every result is checked
against the float64 reference on the materialized tensor, through the wrapper, torch.ops and, where the compiled
library is loaded, its direct entry point."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torch_gradstats as tg
from torch_gradstats.ops.op import reference_multi_tensor_stats

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}
op = torch.ops.torch_gradstats.multi_tensor_stats.default
needs_extension = pytest.mark.skipif(not tg.HAS_EXTENSION, reason="needs the compiled library")


def entry_points():
    """Every way to call the op on plain CPU tensors: (name, function returning (sumsq, amax, counts))."""
    points = [("wrapper", tg.multi_tensor_stats), ("torch.ops", op)]
    if tg.HAS_EXTENSION:
        from torch_gradstats import _C

        points.append(("direct_stats", _C.direct_stats))
    return points


def assert_stats_equal(got, want, dtypes, where):
    """sumsq within the contract's relative error, amax and counts exactly, NaN/Inf in the same places."""
    sumsq, amax, counts = got
    torch.testing.assert_close(counts, want[2], rtol=0, atol=0, msg=lambda m: f"{where}: counts: {m}")
    torch.testing.assert_close(amax, want[1], rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: amax: {m}")
    for i, dtype in enumerate(dtypes):
        g, w = sumsq[i].item(), want[0][i].item()
        if math.isnan(w) or math.isinf(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), (where, i, g, w)
        else:
            assert abs(g - w) <= RTOL[dtype] * abs(w), (where, i, dtype, g, w)


def assert_matches_reference(tensors):
    want = reference_multi_tensor_stats(tensors)  # reads each tensor whole: sizes that fit only
    for name, call in entry_points():
        assert_stats_equal(call(tensors), want, [t.dtype for t in tensors], name)


def views(dtype, device="cpu"):
    """Views of every kind that fit in memory once materialized; the specials sit in their distinct elements."""
    g = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    def tensor(values):
        return torch.tensor(values, dtype=dtype, device=device)

    specials = tensor([float("nan"), float("inf"), 0.0, -0.0, 1.5, -float("inf")])
    strided = randn(6, 8)[:, ::2]  # not dense: its distinct elements are copied
    base = randn(4000)
    return [
        randn(5).expand(3, 5),
        randn(4, 1, 3).expand(4, 6, 3),  # broadcast in the middle
        randn(1, 1).expand(7, 9),  # several broadcast dims
        randn(2, 1, 3, 1).expand(2, 5, 3, 4),
        randn(3, 1).expand(3, 5).t(),  # expanded and transposed
        randn(4, 1, 5).expand(4, 3, 5).permute(2, 1, 0),
        strided.unsqueeze(0).expand(3, 6, 4),  # expand of a non-contiguous tensor
        strided.t().unsqueeze(1).expand(4, 7, 6),
        specials.expand(4, 6),
        specials[None, :, None].expand(3, 6, 5),
        tensor([0.0]).expand(70_000),  # more than one segment of the kernel, materialized
        tensor([float("inf")]).expand(3, 4),
        tensor([-0.0]).expand(5),
        randn(3, 1).expand(3, 0),  # empty
        randn(0, 1).expand(0, 4),
        base.as_strided((4, 3), (0, 1)),  # stride 0 by as_strided
        base.as_strided((1, 5), (0, 1)),  # stride 0 on a size-1 dim: no repeat
        base.as_strided((2, 3, 5), (0, 7, 2), 11),  # broadcast over a view with gaps, at an offset
        torch._neg_view(randn(3, 1)).expand(3, 4),  # a negated view: the sign does not matter
        base[:2000].as_strided((991, 10), (1, 1)),  # overlapping (sliding windows): small, copied
        base[:200].as_strided((50, 4, 3), (2, 0, 1)),  # overlapping and broadcast
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_match_the_reference_on_the_materialized_tensor(dtype):
    tensors = views(dtype)
    assert_matches_reference(tensors)
    for t in tensors:  # one at a time too: a tensor's figures do not depend on its neighbours
        assert_matches_reference([t])


def test_mixed_list_of_views_and_dense_tensors():
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(100_000, generator=g), torch.randn(3, generator=g).expand(40_000, 3),
               torch.randn(7, generator=g, dtype=torch.float64)[::2], torch.randn(5, 5, generator=g).half().t(),
               torch.randn(1, generator=g).bfloat16().expand(2, 3, 4)]  # fmt: skip
    assert_matches_reference(tensors)


@needs_extension
def test_expanded_views_of_two_to_the_34_elements_take_milliseconds():
    """x.expand(2**34) is never materialized (that would take 64 GiB for float32): its figures come from x, the
    counts exact in int64, the sums scaled. Each case is compared with the reference on its distinct elements."""
    n = 2**34
    g = torch.Generator().manual_seed(3)
    mixed = torch.tensor([0.0, 2.0, float("inf"), 0.5])
    cases = [  # (view, its distinct elements, how many times each appears)
        (torch.ones(1).expand(n), torch.ones(1), n),
        (torch.zeros(1, dtype=torch.float16).expand(n), torch.zeros(1, dtype=torch.float16), n),
        (torch.tensor([float("nan")]).expand(n), torch.tensor([float("nan")]), n),
        (torch.tensor([float("-inf")], dtype=torch.bfloat16).expand(n), torch.tensor([-float("inf")]), n),
        (mixed.expand(2**32, 4), mixed, 2**32),
        (torch.randn(3, 1, 5, generator=g, dtype=torch.float64).expand(3, 2**30, 5).transpose(0, 1),
         None, 2**30),
        (torch.randn(4, 6, generator=g)[:, ::2].unsqueeze(1).expand(4, 2**32, 3), None, 2**32),  # copied: 12 elements
    ]  # fmt: skip
    tensors = [view for view, _, _ in cases]
    distinct = [d if d is not None else view.select(1 if view.stride(1) == 0 else 0, 0).contiguous()
                for view, d, _ in cases]  # fmt: skip
    ref = reference_multi_tensor_stats(distinct)
    repeat = torch.tensor([r for _, _, r in cases], dtype=torch.int64)
    want = (ref[0] * repeat.double(), ref[1], ref[2] * repeat[:, None])
    for name, call in entry_points():
        call(tensors)  # warm
        start = time.perf_counter()
        got = call(tensors)
        elapsed = time.perf_counter() - start
        assert elapsed < 0.5, f"{name}: {elapsed:.3f} s: materialized?"
        assert_stats_equal(got, want, [t.dtype for t in tensors], name)
        assert got[2][0].tolist() == [0, 0, 0] and got[2][1].tolist() == [n, 0, 0]  # exactly 2**34 zeros
        assert got[2][2].tolist() == [0, n, 0] and got[2][3].tolist() == [0, 0, n]
        assert got[2][4].tolist() == [2**32, 0, 2**32]


@needs_extension
def test_element_counts_summing_past_int64():
    """Two views of 2**62 elements each: their sum overflows int64, the counts of each do not."""
    from torch_gradstats import _C

    tensors = [torch.zeros(1).expand(2**62), torch.ones(1, dtype=torch.float64).expand(2**62), torch.ones(3)]
    for name, call in [("direct_stats", _C.direct_stats), ("wrapper", tg.multi_tensor_stats), ("torch.ops", op)]:
        sumsq, amax, counts = call(tensors)
        assert counts.tolist() == [[2**62, 0, 0], [0, 0, 0], [0, 0, 0]], name
        assert sumsq.tolist() == [0.0, float(2**62), 3.0] and amax.tolist() == [0.0, 1.0, 1.0], name


@needs_extension
def test_overlapping_view_far_larger_than_its_memory_is_a_clear_error():
    base = torch.randn(2**20)  # 4 MiB
    windows = base.as_strided((2**20 - 1023, 1024), (1, 1))  # copying it would take 4 GiB
    for name, call in entry_points():
        with pytest.raises(ValueError, match=r"tensors\[1\] \(shape \[1047553, 1024\], dtype Float, strides \[1, 1\]\)"
                           r" is a view whose elements overlap in memory.* 4290777088 bytes"):  # fmt: skip
            call([torch.ones(2), windows])
    # Expanded as well: the broadcast dimension is left out before the overlap is judged.
    with pytest.raises(ValueError, match=r"tensors\[0\] .* overlap in memory"):
        tg.multi_tensor_stats([windows.unsqueeze(1).expand(-1, 2**20, -1)])
    # Within the bound, or at most twice its memory, it is copied and every element counts as often as it appears.
    assert_matches_reference([base[:3000].as_strided((1000, 2000), (1, 1))])  # 8 MB: within the bound
    zeros = torch.zeros(2**24)  # 64 MiB
    twice = zeros.as_strided((2, 2**24 - 8), (8, 1))  # a copy of 128 MiB: past the bound, within twice its memory
    for name, call in entry_points():
        assert call([twice])[2].tolist() == [[2 * (2**24 - 8), 0, 0]], name


@needs_extension
def test_opcheck_and_compile_with_views():
    samples = [
        [torch.randn(3).expand(4, 3), torch.randn(5, 1, dtype=torch.bfloat16).expand(5, 6).t()],
        [torch.randn(6, 4)[:, ::2].unsqueeze(0).expand(2, 6, 2), torch.ones(1).expand(0)],
        [torch.randn(30).as_strided((10, 4), (2, 1)), torch.randn(2).as_strided((2, 3), (1, 0))],
    ]
    for sample in samples:
        torch.library.opcheck(op, (sample,))
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def stats(x):
        return tg.multi_tensor_stats([x.expand(2**20, 3), x.t()])

    x = torch.randn(1, 3)
    got = stats(x)
    want = reference_multi_tensor_stats([x.expand(2**20, 3), x.t()])
    assert_stats_equal(got, want, [torch.float32] * 2, "compiled")


_OOM_CHILD = """
import resource
import torch
import torch_gradstats as tg
from torch_gradstats import _C

torch.set_num_threads(1)
op = torch.ops.torch_gradstats.multi_tensor_stats.default
x = torch.randn(2**25)  # 128 MiB
view = x[::2]  # not dense: read from a copy of 64 MiB
small = torch.randn(10)
tg.multi_tensor_stats([small, torch.randn(100)[::2]])  # everything loaded and started before the limit
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 32 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
for call in (tg.multi_tensor_stats, op, _C.direct_stats):
    try:
        call([small, view])
    except RuntimeError as e:
        print(type(e).__name__, "|", str(e).splitlines()[0])
    else:
        print("no error")
"""


@needs_extension
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_failed_copy_names_the_tensor_its_shape_dtype_and_bytes():
    """A child whose address space is limited cannot allocate the contiguous copy of a sliced tensor: the error says
    which tensor, its shape and dtype, and how many bytes were asked for."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    env.pop("TORCH_GRADSTATS_FORCE_FALLBACK", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_OOM_CHILD)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3, proc.stdout
    for line in lines:
        assert line.startswith("RuntimeError | multi_tensor_stats: tensors[1] (shape [16777216], dtype Float, "
                               "strides [2]) is not dense and is read from a contiguous copy: allocating its "
                               "67108864 bytes failed"), line  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_views_on_cuda():
    """The CUDA entry reads views as the CPU kernel does: the distinct elements of expanded ones, scaled on the
    device; the same figures under CUDA graph capture and replay."""
    assert tg.HAS_EXTENSION
    for dtype in DTYPES:
        tensors = views(dtype, "cuda")
        want = reference_multi_tensor_stats([t.cpu() for t in tensors])
        for name, call in entry_points():
            got = [x.cpu() for x in call(tensors)]
            assert_stats_equal(got, want, [t.dtype for t in tensors], f"{name} {dtype}")
    huge = [torch.ones(1, device="cuda").expand(2**34), torch.zeros(3, 1, device="cuda").expand(3, 2**32)]
    start = time.perf_counter()
    got = op(huge)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 0.5
    assert got[2].tolist() == [[0, 0, 0], [3 * 2**32, 0, 0]] and got[0].tolist() == [float(2**34), 0.0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(huge)  # warm, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(huge)
    graph.replay()
    torch.cuda.synchronize()
    assert captured[2].tolist() == [[0, 0, 0], [3 * 2**32, 0, 0]] and captured[0].tolist() == [float(2**34), 0.0]
