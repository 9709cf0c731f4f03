"""Builds torch_gradstats._C: a CUDAExtension when torch is a CUDA build and a CUDA toolkit is found, else a
CppExtension. Build with `pip install --no-build-isolation -e .` against the torch you run with.

The CPU kernels are compiled once per instruction set (csrc/cpu/stats_kernel_<isa>.cpp): only the AVX2 and AVX512
files get their instruction-set flags, everything else is baseline, and the op picks one at run time from what the
running CPU has (as ATen does), so a wheel built on any x86-64 machine runs on every x86-64 CPU.

OpenMP: at::parallel_for is inlined from ATen's headers and runs single-threaded without it, so it is enabled for
each compiler that can: GCC/Linux clang `-fopenmp`, MSVC `/openmp`, Apple clang `-Xpreprocessor -fopenmp` with libomp
(Homebrew's, or LIBOMP_PREFIX); where none is found the build says so and the CPU op runs on one thread.

Environment:
  USE_CUDA=0                          build the CPU kernel only
  TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"  GPU architectures. The default needs no GPU at build time: SASS for sm_80 and
                                      sm_90, plus PTX for compute_90 so that newer GPUs can JIT-compile the kernel
                                      instead of failing with "no kernel image is available"
  LIBOMP_PREFIX                       macOS: where libomp is installed (include/omp.h, lib/libomp.dylib)
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
        "torch_gradstats: torch is not importable by this build. If torch is installed, pip is building in an "
        "isolated environment without it: run `pip install --no-build-isolation .` (or `-e .`) instead. Otherwise "
        "install torch first, e.g. `pip install 'torch==2.13.0+cpu'` or your CUDA build, then run that command."
    )

ROOT = Path(__file__).parent
CSRC = Path("csrc")
X86 = platform.machine().lower() in ("x86_64", "amd64")
# Instruction-set flags of each csrc/cpu/stats_kernel_<isa>.cpp, per compiler family (ATen uses the same sets).
ISA_FLAGS = {
    "avx2": {"unix": ["-mavx2", "-mfma", "-mf16c"], "msvc": ["/arch:AVX2"]},
    "avx512": {
        "unix": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mpopcnt"],
        "msvc": ["/arch:AVX512"],
    },
    "avx512_gfni": {  # MSVC defines no __GFNI__: there it builds the AVX512 kernel again
        "unix": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mpopcnt", "-mgfni",
                 "-mavx512bitalg"],
        "msvc": ["/arch:AVX512"],
    },
}


def openmp_flags(compiler_type: str) -> tuple[list[str], list[str]]:
    """(compile, link) flags that enable OpenMP for this compiler, or none (with a note) where it cannot."""
    if compiler_type == "msvc":
        return ["/openmp"], []
    if sys.platform != "darwin":
        return ["-fopenmp"], ["-fopenmp"]
    torch_lib = Path(torch.__file__).parent / "lib"
    for prefix in (os.environ.get("LIBOMP_PREFIX"), "/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"):
        if prefix and (Path(prefix) / "include" / "omp.h").exists():
            # Link torch's own libomp where it ships one: one OpenMP runtime in the process.
            lib = torch_lib if (torch_lib / "libomp.dylib").exists() else Path(prefix) / "lib"
            return ["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"], [f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"]
    print("torch_gradstats: NOTE: no OpenMP for this compiler (no libomp found; set LIBOMP_PREFIX or "
          "`brew install libomp`): the CPU op will run single-threaded")  # fmt: skip
    return [], []


class BuildExtension(cpp_extension.BuildExtension):
    """Adds the compiler-specific flags, and compiles each stats_kernel_<isa>.cpp with its instruction-set flags."""

    def build_extension(self, ext):
        kind = "msvc" if self.compiler.compiler_type == "msvc" else "unix"
        omp_compile, omp_link = openmp_flags(self.compiler.compiler_type)
        base = (["/O2"] if kind == "msvc" else ["-O3", "-fvisibility=hidden"]) + omp_compile
        ext.extra_compile_args["cxx"] += base
        ext.extra_link_args += omp_link
        isa_sources = {isa: [s for s in ext.sources if s.endswith(f"_{isa}.cpp")] for isa in ISA_FLAGS}
        for isa, sources in isa_sources.items():
            if not sources:
                continue
            ext.sources = [s for s in ext.sources if s not in sources]
            args = {**ext.extra_compile_args, "cxx": ext.extra_compile_args["cxx"] + ISA_FLAGS[isa][kind]}
            # Linked after the baseline objects, so any inline function both define is taken from a baseline one.
            ext.extra_objects += self.compiler.compile(
                sources, output_dir=self.build_temp, macros=ext.define_macros, include_dirs=ext.include_dirs,
                extra_postargs=args, depends=ext.depends,
            )  # fmt: skip
        super().build_extension(ext)


def build_cuda() -> bool:
    if os.environ.get("USE_CUDA", "").strip() == "0":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    sources = [str(CSRC / "ops.cpp"), str(CSRC / "python_module.cpp")]
    sources += [str(CSRC / "cpu" / "multi_tensor_stats_cpu.cpp"), str(CSRC / "cpu" / "stats_kernel_default.cpp")]
    sources += [str(CSRC / "cpu" / "policies_cpu.cpp")]
    if X86:
        sources += [str(CSRC / "cpu" / f"stats_kernel_{isa}.cpp") for isa in ISA_FLAGS]
    kwargs = {"name": "torch_gradstats._C", "include_dirs": [str(ROOT / CSRC)]}
    if not build_cuda():
        return cpp_extension.CppExtension(sources=sources, extra_compile_args={"cxx": []}, **kwargs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    sources += sorted(str(p) for p in (CSRC / "cuda").glob("*.cu"))
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]
    return cpp_extension.CUDAExtension(sources=sources, extra_compile_args={"cxx": [], "nvcc": nvcc}, **kwargs)


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
