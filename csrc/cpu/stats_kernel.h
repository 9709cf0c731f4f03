// Interface between the CPU op (multi_tensor_stats_cpu.cpp, compiled for the baseline CPU) and the per-element
// kernels, compiled once per instruction set from stats_kernel_impl.h (stats_kernel_default.cpp,
// stats_kernel_avx2.cpp, stats_kernel_avx512.cpp). The op picks one at run time (see cpu_kernel_capability()).
#pragma once

#include "multi_tensor_stats.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>

namespace torch_gradstats::cpu {

// Statistics of one span of elements. Sums and amax cover the finite elements only; the op derives the NaN/Inf
// semantics of its outputs from the counts.
struct Partial {
  double sumsq = 0.0;
  double amax = 0.0;
  int64_t zeros = 0;
  int64_t nans = 0;
  int64_t infs = 0;

  void merge(const Partial& o) {
    sumsq += o.sumsq;
    amax = std::max(amax, o.amax);
    zeros += o.zeros;
    nans += o.nans;
    infs += o.infs;
  }
};

// Where a span's exponent histogram goes (the op's histogram overload): added into the kHistogramBuckets entries of
// `row`, a row of the output; with atomic adds when `shared` (other tasks add into the same row: a tensor whose
// segments were split between tasks). Integer adds, so the result is the same in any order.
struct HistogramRow {
  int64_t* row = nullptr;  // nullptr: no histogram
  bool shared = false;
};

// Statistics of `n` contiguous elements of `dtype` (float16, bfloat16, float32 or float64) at `data`, and their
// exponent histogram added into `histogram` when it has a row. n <= 2^31 with a histogram (the op passes segments).
// Zeros, NaNs and Infs are classified from the bit patterns, so the counts do not depend on the FTZ/DAZ mode;
// the caller runs it with FTZ/DAZ cleared so that the sums do not either.
using AccumulateFn = Partial (*)(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram);

// Each instruction-set variant: accumulate(), and how it counts the exponent histogram (histogram_counting(), for
// `python -m torch_gradstats info`).
namespace DEFAULT {
Partial accumulate(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram);
const char* histogram_counting();
}
#if defined(__x86_64__) || defined(_M_X64)
#define TORCH_GRADSTATS_X86_KERNELS 1
namespace AVX2 {
Partial accumulate(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram);
const char* histogram_counting();
}
namespace AVX512 {
Partial accumulate(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram);
const char* histogram_counting();
}
namespace AVX512_GFNI {  // AVX512 with GFNI and AVX512-BITALG: the histogram counted 16 fields per register
Partial accumulate(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram);
const char* histogram_counting();
}
#endif

}  // namespace torch_gradstats::cpu
