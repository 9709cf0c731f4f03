// Runs of float16/bfloat16 values read as packed 32-bit words (two elements per word): the per-element work of the
// CUDA kernel's 16-bit path (csrc/cuda/stats_kernels.cuh; design: docs/cuda.md, "16-bit inputs").
//
// Plain C++ as well as CUDA, so that tests/cpp/test_packed16.cpp checks every bit trick here against a per-element
// reference on the CPU (the CUDA tests then check the kernel that uses it against the float64 reference).
//
// With a = w & 0x7fff7fff each 16-bit half h of `a` is |bits| of one element (h <= 0x7fff), and:
//  - h + kCarry reaches the half's bit 15 exactly when h >= the exponent mask (the element is Inf or NaN);
//  - h + 0x7fff reaches bit 15 exactly when h != 0 (so a zero, +0 or -0, leaves it clear);
// and neither sum leaves its half (0x7fff + 0x7fff < 0x10000), so both tests run on the two halves at once.
// A half's max over a run is its integer max (finite |bits| order like |x|); the high half's max is the max of the
// whole words, whose low halves only break ties.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define TORCH_GRADSTATS_HD __host__ __device__ __forceinline__
#else
#define TORCH_GRADSTATS_HD inline
#endif

namespace torch_gradstats::packed16 {

constexpr uint32_t kAbs2 = 0x7fff7fffu;  // clears both sign bits
constexpr uint32_t kTop2 = 0x80008000u;  // bit 15 of each half

// A run's float32 sum of squares at or above this is kept: it can hold squares that fell below float32's normal
// range (2^-126; each then off by at most 2^-150), but 32 of those are < 2^-144 absolute, < 2^-44 of the sum. Below
// it (and for an Inf from overflow) the run's squares are taken again in float64.
constexpr float kRunSumMin = 0x1p-100f;

TORCH_GRADSTATS_HD uint32_t popcount(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return uint32_t(__popc(x));
#else
  return uint32_t(__builtin_popcount(x));
#endif
}

TORCH_GRADSTATS_HD float bits_as_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
#endif
}

struct BFloat16Words {
  static constexpr uint32_t kCarry = 0x00800080u;  // 0x7f80 (Inf) + 0x0080 = 0x8000
  // A bfloat16 is the high half of a float32.
  static TORCH_GRADSTATS_HD void to_float2(uint32_t w, float& lo, float& hi) {
    lo = bits_as_float(w << 16);
    hi = bits_as_float(w & 0xffff0000u);
  }
};

#if !defined(__CUDA_ARCH__)
inline float half_bits_to_float(uint32_t h) {  // exact, host only (the device converts in hardware)
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  const int exp = int((h >> 10) & 0x1fu);
  const float mant = float(h & 0x3ffu);
  if (exp == 0) return sign * std::ldexp(mant, -24);  // zero or subnormal
  if (exp == 31) return (h & 0x3ffu) ? NAN : sign * INFINITY;
  return sign * std::ldexp(mant + 1024.0f, exp - 25);
}
#endif

struct HalfWords {
  static constexpr uint32_t kCarry = 0x04000400u;  // 0x7c00 (Inf) + 0x0400 = 0x8000
  static TORCH_GRADSTATS_HD void to_float2(uint32_t w, float& lo, float& hi) {
#if defined(__CUDA_ARCH__)
    const float2 f = __half22float2(__halves2half2(__ushort_as_half(uint16_t(w)), __ushort_as_half(uint16_t(w >> 16))));
    lo = f.x;
    hi = f.y;
#else
    lo = half_bits_to_float(w & 0xffffu);
    hi = half_bits_to_float(w >> 16);
#endif
  }
};

// What one run of words holds: its float32 sum of squares, its zeros, its max |bits|, and whether any element is
// Inf or NaN (then `amax` and `sum` mean nothing: the caller reads the run again element by element).
struct Run {
  float sum;
  uint32_t zeros;
  uint32_t amax;
  bool special;
};

// Squares of 16-bit values are exact in float32 (8 or 11 significant bits squared fit in 24), so the sum rounds
// once per add; two chains (low and high halves) halve the dependent-add latency. Fixed order: same bits per run.
template <int N, class Words>
TORCH_GRADSTATS_HD Run scan_run(const uint32_t* w) {
  float s_lo = 0.0f, s_hi = 0.0f;
  uint32_t special = 0, zeros = 0, max_lo = 0, max_word = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int k = 0; k < N; ++k) {
    const uint32_t a = w[k] & kAbs2;
    special |= a + Words::kCarry;
    zeros += popcount(~(a + kAbs2) & kTop2);
    max_lo = (a & 0xffffu) > max_lo ? (a & 0xffffu) : max_lo;
    max_word = a > max_word ? a : max_word;
    float lo, hi;
    Words::to_float2(w[k], lo, hi);
    s_lo = fmaf(lo, lo, s_lo);
    s_hi = fmaf(hi, hi, s_hi);
  }
  const uint32_t max_hi = max_word >> 16;
  return Run{s_lo + s_hi, zeros, max_hi > max_lo ? max_hi : max_lo, (special & kTop2) != 0};
}

// The run's float32 sum can stand for its float64 sum of squares (see kRunSumMin); false for +Inf from overflow.
TORCH_GRADSTATS_HD bool run_sum_is_kept(float sum) {
  return sum >= kRunSumMin && sum <= 0x1.fffffep127f;
}

}  // namespace torch_gradstats::packed16
