// What every block kernel of the CPU op stands on: the block length, each dtype's bits and exponent field, the
// exact per-element path, and the generic (at::vec) block kernel of the DEFAULT build.
// Part of stats_kernel_impl.h, included through it once per instruction set (see there): everything here lives in
// that translation unit's torch_gradstats::cpu::<CPU_CAPABILITY> namespace, with internal linkage.
#pragma once

#include "stats_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <limits>
#include <tuple>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define TORCH_GRADSTATS_SIMD 1
#endif

namespace torch_gradstats::cpu::CPU_CAPABILITY {
namespace {

// Block length: 4 accumulator chains of 8 (AVX2, DEFAULT) or 16 (AVX512) float lanes, so at most 64 adds per lane
// and a float block sum's relative error <= ~70 ulp (< 1e-5) either way.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kBlockElems = 4096;
#else
constexpr int64_t kBlockElems = 2048;
#endif

#if defined(TORCH_GRADSTATS_SIMD)
// Every cache line is prefetched this far ahead. The hardware prefetchers alone left the op ~10% behind torch.sum
// on memory-bound lists (two EPYC cores: float32 0.79-0.93 of torch.sum's rate, 0.96-1.06 with this; 1 and 4 KiB
// measured, 4 KiB better). Prefetches past the end of a span are harmless: they never fault.
constexpr int64_t kPrefetchBytes = 4096;
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}
#endif

// A float block whose max |x| is below 2^-40 is summed again scaled by 2^90. Below the threshold, squares of its
// elements may fall under FLT_MIN and lose precision; above it, what such elements lose is < 1e-9 of the block's
// largest square. Scaled, any float (subnormals included) squares to a normal float and 4096 squares stay < 2^112.
constexpr double kTinyThreshold = 0x1p-40;
constexpr float kTinyScale = 0x1p90f;

// Bit layout of each input dtype: U holds the bits, kAbs clears the sign, kInf is +Inf (all exponent bits).
template <typename T>
struct Bits;
template <>
struct Bits<double> {
  using U = uint64_t;
  static constexpr U kAbs = 0x7fffffffffffffffULL, kInf = 0x7ff0000000000000ULL;
};
template <>
struct Bits<float> {
  using U = uint32_t;
  static constexpr U kAbs = 0x7fffffffU, kInf = 0x7f800000U;
};
template <>
struct Bits<c10::Half> {
  using U = uint16_t;
  static constexpr U kAbs = 0x7fff, kInf = 0x7c00;
};
template <>
struct Bits<c10::BFloat16> {
  using U = uint16_t;
  static constexpr U kAbs = 0x7fff, kInf = 0x7f80;
};

// Each dtype's exponent field: |bits| >> kShift is the field (0 .. kFields - 1), kBias its bias, kMantissa the
// mantissa's bits. A normal value with field E has floor(log2 |x|) = E - kBias; a subnormal with mantissa m has
// floor(log2 |x|) = 1 - kBias - kMantissa + floor(log2 m).
template <typename T>
struct Exponent;
template <>
struct Exponent<float> {
  static constexpr int kShift = 23, kFields = 256, kBias = 127, kMantissa = 23;
};
template <>
struct Exponent<c10::BFloat16> {
  static constexpr int kShift = 7, kFields = 256, kBias = 127, kMantissa = 7;
};
template <>
struct Exponent<c10::Half> {
  static constexpr int kShift = 10, kFields = 32, kBias = 15, kMantissa = 10;
};
template <>
struct Exponent<double> {
  static constexpr int kShift = 52, kFields = 2048, kBias = 1023, kMantissa = 52;
};

template <typename T>
typename Bits<T>::U abs_bits(const T* x) {
  typename Bits<T>::U u;
  std::memcpy(&u, x, sizeof(u));
  return u & Bits<T>::kAbs;
}

template <typename T>
int64_t count_zero_bits(const T* x, int64_t n) {
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; ++i) {
    zeros += abs_bits(x + i) == 0;
  }
  return zeros;
}

// Exact path: every element in double, classified from its bits. Used for blocks the fast paths reject.
template <typename T>
void accumulate_exact(const T* x, int64_t n, Partial& p) {
  for (int64_t i = 0; i < n; ++i) {
    const auto a = abs_bits(x + i);
    if (a > Bits<T>::kInf) {
      ++p.nans;
    } else if (a == Bits<T>::kInf) {
      ++p.infs;
    } else {
      const double v = static_cast<double>(x[i]);
      p.sumsq += v * v;
      p.amax = std::max(p.amax, std::abs(v));
      p.zeros += a == 0;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Generic block kernel (at::vec): every dtype in the DEFAULT build.
// ---------------------------------------------------------------------------------------------------------------
using at::vec::Vectorized;

// Accumulation type and vector loads for each input dtype: two vectors of acc_t per step.
template <typename T>
struct Loader {  // float, double: load as is
  using acc_t = T;
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static void load(const T* x, Vec& a, Vec& b) {
    a = Vec::loadu(x);
    b = Vec::loadu(x + Vec::size());
  }
};

template <typename half_t>
struct ReducedLoader {  // float16, bfloat16: one 16-bit vector widened to two float vectors
  using acc_t = float;
  using Vec = Vectorized<float>;
  static constexpr int64_t kStep = Vectorized<half_t>::size();
  static_assert(kStep == 2 * Vec::size(), "a 16-bit vector must widen to exactly two float vectors");
  static void load(const half_t* x, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<half_t>(Vectorized<half_t>::loadu(x));
  }
};
template <>
struct Loader<c10::Half> : ReducedLoader<c10::Half> {};
template <>
struct Loader<c10::BFloat16> : ReducedLoader<c10::BFloat16> {};

template <typename acc_t>
struct BlockSums {
  acc_t sumsq;
  acc_t amax;
};

// Sum of squares and max |x| of one block in acc_t, no NaN/Inf test (a NaN or Inf makes the sum non-finite). With
// kScaled, every value is first multiplied by kTinyScale (a power of two, so exactly).
template <typename T, bool kScaled>
BlockSums<typename Loader<T>::acc_t> sum_block_generic(const T* x, int64_t n) {
  using L = Loader<T>;
  using acc_t = typename L::acc_t;
  using Vec = typename L::Vec;
  const Vec zero(acc_t(0));
  const Vec scale(acc_t(kScaled ? kTinyScale : 1.0f));
  // Four independent chains of each accumulator hide the FMA/add latency.
  Vec sq[4] = {zero, zero, zero, zero}, mx[4] = {zero, zero, zero, zero};
  const auto update = [&](Vec v, int k) {
    if constexpr (kScaled) {
      v = v * scale;
    }
    sq[k] = at::vec::fmadd(v, v, sq[k]);
    // clamp_min(v, m) is max(v, m) in one instruction; it need not propagate NaN, the exact path handles those.
    mx[k] = at::vec::clamp_min(v.abs(), mx[k]);
  };
  int64_t i = 0;
  for (; i + 2 * L::kStep <= n; i += 2 * L::kStep) {
    Vec v0, v1, v2, v3;
    L::load(x + i, v0, v1);
    L::load(x + i + L::kStep, v2, v3);
    update(v0, 0);
    update(v1, 1);
    update(v2, 2);
    update(v3, 3);
  }
  for (; i + L::kStep <= n; i += L::kStep) {
    Vec v0, v1;
    L::load(x + i, v0, v1);
    update(v0, 0);
    update(v1, 1);
  }
  const auto add = [](Vec u, Vec v) { return u + v; };
  const auto max = [](Vec u, Vec v) { return at::vec::clamp_min(u, v); };
  BlockSums<acc_t> r{
      at::vec::vec_reduce_all<acc_t>(add, (sq[0] + sq[1]) + (sq[2] + sq[3])),
      at::vec::vec_reduce_all<acc_t>(max, at::vec::clamp_min(at::vec::clamp_min(mx[0], mx[1]),
                                                              at::vec::clamp_min(mx[2], mx[3])))};
  for (; i < n; ++i) {
    const acc_t v = static_cast<acc_t>(x[i]) * (kScaled ? acc_t(kTinyScale) : acc_t(1));
    r.sumsq += v * v;
    r.amax = std::max(r.amax, std::abs(v));
  }
  return r;
}

template <typename T>
void accumulate_block_generic(const T* x, int64_t n, Partial& p) {
  using acc_t = typename Loader<T>::acc_t;
  auto r = sum_block_generic<T, false>(x, n);
  if (!std::isfinite(r.sumsq)) {  // a NaN or an Inf, or float overflow
    accumulate_exact(x, n, p);
    return;
  }
  double unscale = 1.0;
  if (std::is_same_v<acc_t, float> && r.amax > 0 && r.amax < kTinyThreshold) {
    r = sum_block_generic<T, true>(x, n);
    unscale = 1.0 / kTinyScale;
  }
  p.sumsq += static_cast<double>(r.sumsq) * unscale * unscale;
  p.amax = std::max(p.amax, static_cast<double>(r.amax) * unscale);
  p.zeros += count_zero_bits(x, n);
}

}  // namespace
}  // namespace torch_gradstats::cpu::CPU_CAPABILITY
