"""The compiled CPU kernel itself: every instruction-set variant against the float64 reference, its run-time choice,
and results that depend neither on the thread count nor on torch.set_flush_denormal.

Each variant runs in a subprocess started with ATEN_CPU_CAPABILITY (read once, when torch loads), which the kernel
follows. Skipped when the compiled extension is not loaded (the pure-PyTorch fallback has no variants)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_gradstats
from torch_gradstats.ops.op import reference_multi_tensor_stats

pytestmark = pytest.mark.skipif(not torch_gradstats.HAS_EXTENSION, reason="compiled extension not loaded")
op = torch.ops.torch_gradstats.multi_tensor_stats.default
RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-12}


def cpu_capability() -> str:
    import torch_gradstats._C as ext

    return ext.cpu_capability()


def special_inputs() -> list[torch.Tensor]:
    """Random and special values of every dtype, at lengths around the kernel's vector, block and segment sizes."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        info = torch.finfo(dtype)
        for n in (1, 15, 33, 2047, 2048, 2049, 4097, 65_537, 70_001):
            out.append(torch.randn(n, generator=g).to(dtype))
        x = torch.randn(5000, generator=g).to(dtype)
        x[[3, 2048, 4999]] = 0.0
        x[7] = -0.0
        out.append(x)
        for value in (float("nan"), float("inf"), -float("inf")):
            y = torch.randn(3000, generator=g).to(dtype)
            y[2500] = value
            out.append(y)
        out.append(torch.full((4099,), info.max, dtype=dtype))  # squares overflow a float accumulator
        out.append(torch.full((4099,), -info.max, dtype=dtype).index_fill_(0, torch.tensor([5]), 0.0))
        out.append(torch.full((3001,), info.smallest_normal / 4, dtype=dtype))  # subnormal
        sub = torch.randn(2100, generator=g).to(dtype) * info.smallest_normal
        out.append(sub)  # normal and subnormal mixed
        out.append(torch.full((2500,), info.tiny * 2**10, dtype=dtype))  # tiny: vanishing-gradient rescue
        out.append(torch.zeros(2049, dtype=dtype))
        out.append(torch.randn(64, 33, generator=g).to(dtype).t())  # permuted, read in place
        out.append(torch.randn(40, 70, generator=g).to(dtype)[:, ::3])  # strided, copied
        out.append(torch.empty(0, dtype=dtype))
    # float16's largest values (their squares fit a float) and bfloat16 runs whose float32 squares overflow although
    # every value is finite (the block is redone in double).
    out.append(torch.full((5000,), 65504.0, dtype=torch.float16))
    out.append(torch.full((5000,), 1e30, dtype=torch.bfloat16))
    big = torch.randn(5000, generator=g).to(torch.bfloat16)
    big[1000:1100] = 3e38
    out.append(big)
    return out


def assert_matches_reference(tensors: list[torch.Tensor]) -> None:
    sumsq, amax, counts = op(tensors)
    ref = reference_multi_tensor_stats(tensors)
    torch.testing.assert_close(counts, ref[2], rtol=0, atol=0)
    torch.testing.assert_close(amax, ref[1], rtol=0, atol=0, equal_nan=True)
    for i, t in enumerate(tensors):
        got, want = sumsq[i].item(), ref[0][i].item()
        if math.isnan(want) or math.isinf(want):
            assert got == want or (math.isnan(got) and math.isnan(want)), (i, t.dtype, got, want)
        else:
            assert abs(got - want) <= RTOL[t.dtype] * abs(want), (i, t.dtype, t.shape, got, want)


def run_with_capability(capability: str, code: str) -> str:
    """Runs `code` (after `from tests.test_cpu_kernel import *`) in a fresh interpreter with ATEN_CPU_CAPABILITY."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    env.pop("TORCH_GRADSTATS_FORCE_FALLBACK", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    script = "from tests.test_cpu_kernel import *\n" + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


def supported_variants() -> list[str]:
    """The variants this CPU can run: the baseline always, AVX2 and AVX512 where ATen would use them."""
    best = torch.backends.cpu.get_cpu_capability()
    return ["default"] + [v for v in ("avx2", "avx512") if {"AVX2": 1, "AVX512": 2}.get(best, 0) >= (v == "avx512") + 1]


def test_capability_follows_aten():
    # The variants forced through ATEN_CPU_CAPABILITY are checked in test_variant_matches_reference.
    best = torch.backends.cpu.get_cpu_capability()
    assert cpu_capability() == {"AVX512": "AVX512", "AVX2": "AVX2"}.get(best, "DEFAULT")


#: The kernel variants a test runs in subprocesses. "avx512-without-gfni": on a CPU with GFNI and AVX512-BITALG the
#: op runs a second build of the AVX512 kernel (stats_kernel_avx512_gfni.cpp); TORCH_GRADSTATS_CPU_GFNI=0 runs the
#: other one, which older AVX512 CPUs get.
VARIANTS = ["default", "avx2", "avx512", "avx512-without-gfni"]


def variant_capability(variant: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ATEN_CPU_CAPABILITY of a VARIANTS entry, with its environment set (skips where the CPU cannot run it)."""
    capability = variant.split("-")[0]
    if capability not in supported_variants():
        pytest.skip(f"this CPU cannot run the {capability} kernel")
    if variant.endswith("-without-gfni"):
        monkeypatch.setenv("TORCH_GRADSTATS_CPU_GFNI", "0")
    return capability


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_reference(variant, monkeypatch):
    capability = variant_capability(variant, monkeypatch)
    out = run_with_capability(
        capability,
        f"""
        assert cpu_capability() == {capability.upper()!r}, cpu_capability()
        assert_matches_reference(special_inputs())
        assert_thread_invariant(special_inputs())
        print("ok")
        """,
    )
    assert out.strip() == "ok"


def test_matches_reference_in_process():
    assert_matches_reference(special_inputs())


@contextlib.contextmanager
def threads_and_flush(threads: int, flush: bool):
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(flush)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)  # torch has no getter; off is its default and what every test assumes
        torch.set_num_threads(old_threads)


def assert_thread_invariant(tensors: list[torch.Tensor], flush_modes=(False, True)) -> None:
    """Bitwise the same outputs for 1, 2 and 3 threads, with and without flush-denormal."""
    with threads_and_flush(1, False):
        want = op(tensors)
    for flush in flush_modes:
        for threads in (1, 2, 3):
            with threads_and_flush(threads, flush):
                got = op(tensors)
            for name, a, b in zip(("sumsq", "amax", "counts"), got, want):
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (name, threads, flush)


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="flush-denormal is not supported on this CPU")
def test_flush_denormal_does_not_change_counts_or_sums():
    # 100,000 float64 subnormals over two segments: under flush-denormal, a kernel that compared floats counted
    # them as zeros in the caller's thread only (100,000 zeros with 1 thread, 65,536 with 2).
    x = torch.full((100_000,), 1e-310, dtype=torch.float64)
    f32 = torch.full((100_000,), 1e-40, dtype=torch.float32)
    bf16 = torch.full((100_000,), 1e-39, dtype=torch.bfloat16)
    ref = reference_multi_tensor_stats([x, f32, bf16])
    for threads in (1, 2):
        with threads_and_flush(threads, True):
            sumsq, amax, counts = op([x, f32, bf16])
        assert counts[:, 0].tolist() == [0, 0, 0], (threads, counts)
        torch.testing.assert_close(amax, ref[1], rtol=0, atol=0)
        torch.testing.assert_close(sumsq, ref[0], rtol=1e-5, atol=0)


def test_thread_count_and_flush_denormal_do_not_change_bits():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g).to(dt) for n, dt in
               [(300_000, torch.float32), (200_001, torch.bfloat16), (131_073, torch.float16),
                (150_000, torch.float64)]]  # fmt: skip
    for t in tensors:  # subnormals, zeros and tiny values scattered over every segment
        t[::7] *= torch.finfo(t.dtype).smallest_normal
        t[::11] = 0.0
    assert_thread_invariant(tensors)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("objdump") is None,
                    reason="needs x86-64 and objdump")  # fmt: skip
def test_only_the_isa_kernels_use_avx():
    # A CPU without AVX runs every function of the library except the AVX2/AVX512/AVX512_GFNI kernels: none of the
    # others may hold a VEX/EVEX instruction (an inline function compiled in an AVX translation unit, linked for all).
    import torch_gradstats._C as ext

    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ext.__file__], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    offenders, function = set(), ""
    for line in asm.splitlines():
        if line.endswith(">:"):
            function = line
        elif re.search(r"\t(v[a-z0-9]+|kmov[a-z]*)\s", line) and not re.search(r"::AVX(2|512|512_GFNI)::", function):
            offenders.add(function)
    assert not offenders, sorted(offenders)[:5]
