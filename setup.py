"""Builds torch_gradstats._C: a CUDAExtension when torch is a CUDA build and a CUDA toolkit is found, else a
CppExtension. Build with `pip install --no-build-isolation -e .` against the torch you run with.

Environment:
  USE_CUDA=0                          build the CPU kernel only
  TORCH_CUDA_ARCH_LIST="8.0;9.0"      GPU architectures (default: 8.0 and 9.0, so no GPU is needed at build time)
  TORCH_GRADSTATS_CPU_CAPABILITY      AVX2 or DEFAULT (default: AVX2 when this machine has AVX2, FMA and F16C)
"""

import os
import platform
import sys
from pathlib import Path

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(
        "torch_gradstats: torch must be installed before building, e.g. `pip install 'torch==2.13.0+cpu'` "
        "(or your CUDA build), then `pip install --no-build-isolation -e .`"
    )

ROOT = Path(__file__).parent
CSRC = Path("csrc")


def cpu_capability() -> str:
    """The at::vec instruction set the CPU kernel is compiled for (checked on the build machine)."""
    if "TORCH_GRADSTATS_CPU_CAPABILITY" in os.environ:
        return os.environ["TORCH_GRADSTATS_CPU_CAPABILITY"].upper()
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            flags = Path("/proc/cpuinfo").read_text().split()
        except OSError:
            return "DEFAULT"
        if {"avx2", "fma", "f16c"} <= set(flags):
            return "AVX2"
    return "DEFAULT"


def build_cuda() -> bool:
    if os.environ.get("USE_CUDA", "").strip() == "0":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    sources = [str(CSRC / "ops.cpp"), str(CSRC / "python_module.cpp")]
    sources += sorted(str(p) for p in (CSRC / "cpu").glob("*.cpp"))
    # at::parallel_for is inlined from ATen's headers: without -fopenmp it silently runs on one thread.
    cxx = ["-O3", "-fvisibility=hidden", "-fopenmp"]
    if cpu_capability() == "AVX2":
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    kwargs = {"name": "torch_gradstats._C", "include_dirs": [str(ROOT / CSRC)], "extra_link_args": ["-fopenmp"]}
    if not build_cuda():
        return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
