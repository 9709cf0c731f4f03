// The per-element kernels of the CPU op, compiled once per instruction set: stats_kernel_<isa>.cpp defines
// CPU_CAPABILITY (DEFAULT, AVX2, AVX512 or AVX512_GFNI) and includes this file, which puts everything in
// torch_gradstats::cpu::<CPU_CAPABILITY> (as ATen does with its CPU_CAPABILITY kernels). Only the x86 translation
// units are compiled with their instruction-set flags; AVX512_GFNI is AVX512 (CPU_CAPABILITY_AVX512) plus GFNI.
//
// Accumulation. A span is summed in blocks of kBlockElems elements in the accumulation type (float for 16/32-bit
// inputs, double for float64) with several independent vector accumulators; block sums are added in double. A block
// that holds a NaN or an Inf, or whose float sum overflowed, is redone exactly in double element by element. A float
// block of only tiny values (vanishing gradients) is summed again scaled by a power of two, so that its squares do not
// underflow.
//
// Classification. Zeros, NaNs and Infs are recognised from the bit patterns (integer compares of |bits| with the
// exponent mask), never from float compares, which the DAZ mode (torch.set_flush_denormal) would change.
//
// Two block kernels:
//  - the x86 SIMD one (AVX2, AVX512) for float32, float16 and bfloat16 works on the integer bits: |bits| by a mask,
//    their integer max and min per block (for non-negative IEEE values the integer order is the value order, NaN
//    above Inf), and squares of the values widened to float: bfloat16 by a 16-bit shift (unpack with zeros), float16
//    by F16C. Max bits >= Inf bits means a NaN or an Inf (exact path); min bits == 0 means the block holds a zero,
//    and only then are its zeros counted (again from the bits, the block is still in L1). amax is exact (the
//    largest |x| itself).
//    float64 likewise, with max |x| in double and a zero detected by an integer compare.
//  - the generic one (at::vec) for every dtype in the DEFAULT build: sums and max |x| in vectors, zeros counted
//    from the bits in a second loop over the block.
//
// Exponent histogram (the op's histogram overload): the elements' exponent fields are counted in the same read of
// memory. The x86 kernels pack each field into a byte inside the statistics' own loop (FieldPacker, from the |bits|
// registers it holds) and count a block's fields while they are in L1, 64 bytes at a time. The AVX512_GFNI build
// (CPUs with GFNI and AVX512-BITALG) counts the 16 fields below the block's largest at once (WindowCounter), one
// register per iteration of the next block's loop, so that the counting overlaps that block's memory reads; the
// few fields further down are found and counted one by one. The AVX2 and AVX512 builds count, after the block's
// loop, 8 fields at a time from the largest down, bit-sliced (SlicedWindow), and the last few by byte compares. The
// baseline build (and float64's 2,048 fields) increments a table per field value, in interleaved copies so that
// consecutive increments of the same field do not wait on each other.
// At the end of the span the field counts become buckets: a normal field E is one bucket; field 0 holds the zeros
// (known from the statistics) and the subnormals, which are then found again and bucketed by their mantissa (spans
// with subnormals only); the all-ones field holds the NaNs and Infs, which are not in the histogram.
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

#if defined(TORCH_GRADSTATS_SIMD)
// ---------------------------------------------------------------------------------------------------------------
// x86 SIMD block kernels: the few operations they need, per register width.
// ---------------------------------------------------------------------------------------------------------------
#if defined(CPU_CAPABILITY_AVX512)
using VI = __m512i;
using VF = __m512;
inline VI loadi(const void* p) { return _mm512_loadu_si512(p); }
inline VI set1_32(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline VI set1_16(uint16_t v) { return _mm512_set1_epi16(static_cast<short>(v)); }
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VI and_i(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI max32(VI a, VI b) { return _mm512_max_epi32(a, b); }
inline VI min32(VI a, VI b) { return _mm512_min_epi32(a, b); }
inline VI max16(VI a, VI b) { return _mm512_max_epi16(a, b); }
inline VI min16(VI a, VI b) { return _mm512_min_epi16(a, b); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF set1_f(float v) { return _mm512_set1_ps(v); }
inline VF as_float(VI a) { return _mm512_castsi512_ps(a); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
// bfloat16 -> float: each 16-bit value moved to the top half of a 32-bit lane (the lane order does not matter).
inline VF bf16_lo(VI a) { return _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), a)); }
inline VF bf16_hi(VI a) { return _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), a)); }
inline VF f16_lo(VI a) { return _mm512_cvtph_ps(_mm512_castsi512_si256(a)); }
inline VF f16_hi(VI a) { return _mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1)); }
// Halves of a register combined down to 128 bits, for the horizontal reductions.
#define TORCH_GRADSTATS_NARROW_I(name, op256, op128)                                              \
  inline __m128i name(VI a) {                                                                      \
    const __m256i h = op256(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));           \
    return op128(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));                       \
  }
TORCH_GRADSTATS_NARROW_I(narrow_max32, _mm256_max_epi32, _mm_max_epi32)
TORCH_GRADSTATS_NARROW_I(narrow_min32, _mm256_min_epi32, _mm_min_epi32)
TORCH_GRADSTATS_NARROW_I(narrow_max16, _mm256_max_epi16, _mm_max_epi16)
TORCH_GRADSTATS_NARROW_I(narrow_min16, _mm256_min_epi16, _mm_min_epi16)
TORCH_GRADSTATS_NARROW_I(narrow_min_u8, _mm256_min_epu8, _mm_min_epu8)
#undef TORCH_GRADSTATS_NARROW_I
inline __m128 narrow_add(VF a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
using VD = __m512d;
inline VI set1_64(uint64_t v) { return _mm512_set1_epi64(static_cast<long long>(v)); }
inline VD zero_d() { return _mm512_setzero_pd(); }
inline VD as_double(VI a) { return _mm512_castsi512_pd(a); }
inline VD max_d(VD a, VD b) { return _mm512_max_pd(a, b); }
inline VD add_d(VD a, VD b) { return _mm512_add_pd(a, b); }
inline VD fmadd_d(VD a, VD b, VD c) { return _mm512_fmadd_pd(a, b, c); }
inline double hsum_d(VD v) { return _mm512_reduce_add_pd(v); }
inline double hmax_d(VD v) { return _mm512_reduce_max_pd(v); }
// For the exponent histogram: fields as bytes, and byte-wise counts.
template <int kShift>
inline VI srli32(VI a) { return _mm512_srli_epi32(a, kShift); }
template <int kShift>
inline VI srli16(VI a) { return _mm512_srli_epi16(a, kShift); }
inline VI packus32(VI a, VI b) { return _mm512_packus_epi32(a, b); }
inline VI packus16(VI a, VI b) { return _mm512_packus_epi16(a, b); }
inline VI set1_8(uint8_t v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline VI min_u8(VI a, VI b) { return _mm512_min_epu8(a, b); }
inline VI sub8(VI a, VI b) { return _mm512_sub_epi8(a, b); }
inline void storei(void* p, VI a) { _mm512_storeu_si512(p, a); }
// For the bit-sliced window (SlicedWindow).
inline VI xor_i(VI a, VI b) { return _mm512_xor_si512(a, b); }
inline VI xor3(VI a, VI b, VI c) { return _mm512_ternarylogic_epi64(a, b, c, 0x96); }
inline VI majority3(VI a, VI b, VI c) { return _mm512_ternarylogic_epi64(a, b, c, 0xe8); }
template <int kShift>
inline VI slli16(VI a) { return _mm512_slli_epi16(a, kShift); }
inline VI adds_u8(VI a, VI b) { return _mm512_adds_epu8(a, b); }
inline VI shuffle8(VI table, VI index) { return _mm512_shuffle_epi8(table, index); }
inline VI broadcast16(const uint8_t* p) {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}
inline int64_t sum_u8(VI a) { return _mm512_reduce_add_epi64(_mm512_sad_epu8(a, _mm512_setzero_si512())); }
// How many bytes of the registers given to add() equal `want`'s: per-byte counters, one masked add per register (a
// compare and an add, where a popcount of the mask also takes a mask move and a scalar add), at most 255 registers.
class ByteMatches {
 public:
  void add(VI a, VI want) { acc_ = _mm512_mask_add_epi8(acc_, _mm512_cmpeq_epi8_mask(a, want), acc_, set1_8(1)); }
  int64_t total() const { return sum_u8(acc_); }

 private:
  __m512i acc_ = _mm512_setzero_si512();
};
#if defined(__GFNI__) && defined(__AVX512BITALG__)
#define TORCH_GRADSTATS_GFNI 1
// Counts the 16 fields [top - 15, top] among registers of packed fields (64 bytes each), one register at a time:
// simd_block counts the previous block's registers this way while it reads the next block, so that the counting
// overlaps the memory reads. Each byte's distance d below top, offset by 0x70 with unsigned saturation, indexes a
// byte shuffle (bit 7 set, that is d >= 16 or a field above top, gives 0): two shuffles make one-hot bytes of the
// distances 0-7 and 8-15, an 8x8 bit transpose of each qword (gf2p8affineqb with the identity's bytes as the
// matrix operand) turns byte j into the set of the qword's 8 elements at distance j (+8), and a byte popcount
// counts them: 16 fields for 10 instructions per 64 elements, where byte compares take a compare and an add each.
class WindowCounter {
 public:
  WindowCounter() = default;  // counts nothing
  WindowCounter(const uint8_t* fields, int64_t regs, int top)
      : fields_(fields), regs_(regs), top_(_mm512_set1_epi8(static_cast<char>(top))) {}

  bool active() const { return fields_ != nullptr; }

  // Counts register r of the fields (nothing past the last one).
  void step(int64_t r) {
    if (r >= regs_) {
      return;
    }
    const __m512i one_hot[2] = {  // indexed by d's low 4 bits: d < 8 -> 1 << d, 8 <= d < 16 -> 1 << (d - 8)
        _mm512_set4_epi32(0, 0, static_cast<int>(0x80402010), 0x08040201),
        _mm512_set4_epi32(static_cast<int>(0x80402010), 0x08040201, 0, 0)};
    const __m512i unit_bytes = _mm512_set1_epi64(static_cast<long long>(0x8040201008040201ULL));
    const __m512i v = _mm512_loadu_si512(fields_ + 64 * r);
    const __m512i index = _mm512_adds_epu8(_mm512_sub_epi8(top_, v), _mm512_set1_epi8(0x70));
    for (int h = 0; h < 2; ++h) {
      const __m512i by_distance = _mm512_gf2p8affine_epi64_epi8(unit_bytes, _mm512_shuffle_epi8(one_hot[h], index), 0);
      acc_[h] = _mm512_add_epi8(acc_[h], _mm512_popcnt_epi8(by_distance));
    }
    if ((r & 15) == 15) {  // a byte adds at most 8 per register
      widen();
    }
  }

  // Counts the registers from `r` on.
  void finish(int64_t r) {
    for (; r < regs_; ++r) {
      step(r);
    }
  }

  // The counts as 16 32-bit lanes, lane j: how many fields equal top - 15 + j.
  __m512i counts() {
    widen();
    __m128i by_distance[2];  // the four 128-bit lanes added: 8 words, word k the count at distance k (+8)
    for (int h = 0; h < 2; ++h) {
      const __m256i half = _mm256_add_epi16(_mm512_castsi512_si256(wide_[h]), _mm512_extracti64x4_epi64(wide_[h], 1));
      by_distance[h] = _mm_add_epi16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
    }
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_set_m128i(by_distance[1], by_distance[0]));
    return _mm512_permutexvar_epi32(_mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), wide);
  }

 private:
  // The byte counts into 16-bit sums (a block's at most 4,096 fields fit): in each 128-bit lane, qword 0's bytes
  // become words by unpacklo, qword 1's by unpackhi, word k at distance k (+8) either way.
  void widen() {
    const __m512i zero = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      wide_[h] = _mm512_add_epi16(
          wide_[h], _mm512_add_epi16(_mm512_unpacklo_epi8(acc_[h], zero), _mm512_unpackhi_epi8(acc_[h], zero)));
      acc_[h] = zero;
    }
  }

  const uint8_t* fields_ = nullptr;
  int64_t regs_ = 0;
  __m512i top_ = _mm512_setzero_si512();
  __m512i acc_[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  __m512i wide_[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
};
#endif
// Whether any of the 64-bit |bits| seen was 0: their minimum.
struct ZeroTracker64 {
  VI m = set1_64(~uint64_t{0} >> 1);
  void add(VI a) { m = _mm512_min_epi64(m, a); }
  bool any() const { return _mm512_reduce_min_epi64(m) == 0; }
};
#else  // AVX2
using VI = __m256i;
using VF = __m256;
inline VI loadi(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VI set1_32(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline VI set1_16(uint16_t v) { return _mm256_set1_epi16(static_cast<short>(v)); }
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VI and_i(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI max32(VI a, VI b) { return _mm256_max_epi32(a, b); }
inline VI min32(VI a, VI b) { return _mm256_min_epi32(a, b); }
inline VI max16(VI a, VI b) { return _mm256_max_epi16(a, b); }
inline VI min16(VI a, VI b) { return _mm256_min_epi16(a, b); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF set1_f(float v) { return _mm256_set1_ps(v); }
inline VF as_float(VI a) { return _mm256_castsi256_ps(a); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF bf16_lo(VI a) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), a)); }
inline VF bf16_hi(VI a) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), a)); }
inline VF f16_lo(VI a) { return _mm256_cvtph_ps(_mm256_castsi256_si128(a)); }
inline VF f16_hi(VI a) { return _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)); }
inline __m128i narrow_max32(VI a) { return _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }
inline __m128i narrow_min32(VI a) { return _mm_min_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }
inline __m128i narrow_max16(VI a) { return _mm_max_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }
inline __m128i narrow_min16(VI a) { return _mm_min_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }
inline __m128i narrow_min_u8(VI a) { return _mm_min_epu8(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)); }
inline __m128 narrow_add(VF a) { return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); }
using VD = __m256d;
inline VI set1_64(uint64_t v) { return _mm256_set1_epi64x(static_cast<long long>(v)); }
inline VD zero_d() { return _mm256_setzero_pd(); }
inline VD as_double(VI a) { return _mm256_castsi256_pd(a); }
inline VD max_d(VD a, VD b) { return _mm256_max_pd(a, b); }
inline VD add_d(VD a, VD b) { return _mm256_add_pd(a, b); }
inline VD fmadd_d(VD a, VD b, VD c) { return _mm256_fmadd_pd(a, b, c); }
inline double hsum_d(VD v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
inline double hmax_d(VD v) {
  __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
}
// For the exponent histogram: fields as bytes, and byte-wise counts.
template <int kShift>
inline VI srli32(VI a) { return _mm256_srli_epi32(a, kShift); }
template <int kShift>
inline VI srli16(VI a) { return _mm256_srli_epi16(a, kShift); }
inline VI packus32(VI a, VI b) { return _mm256_packus_epi32(a, b); }
inline VI packus16(VI a, VI b) { return _mm256_packus_epi16(a, b); }
inline VI set1_8(uint8_t v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline VI min_u8(VI a, VI b) { return _mm256_min_epu8(a, b); }
inline VI sub8(VI a, VI b) { return _mm256_sub_epi8(a, b); }
inline void storei(void* p, VI a) { _mm256_storeu_si256(static_cast<__m256i*>(p), a); }
// For the bit-sliced window (SlicedWindow).
inline VI xor_i(VI a, VI b) { return _mm256_xor_si256(a, b); }
inline VI xor3(VI a, VI b, VI c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
inline VI majority3(VI a, VI b, VI c) {
  return _mm256_or_si256(_mm256_and_si256(a, b), _mm256_and_si256(_mm256_xor_si256(a, b), c));
}
template <int kShift>
inline VI slli16(VI a) { return _mm256_slli_epi16(a, kShift); }
inline VI adds_u8(VI a, VI b) { return _mm256_adds_epu8(a, b); }
inline VI shuffle8(VI table, VI index) { return _mm256_shuffle_epi8(table, index); }
inline VI broadcast16(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}
inline int64_t sum_u8(VI a) {
  const __m256i s = _mm256_sad_epu8(a, _mm256_setzero_si256());
  return _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
         _mm256_extract_epi64(s, 3);
}
// How many bytes of the registers given to add() equal `want`'s: per-byte counters (an equal byte compares to 0xff,
// that is -1), at most 255 registers.
class ByteMatches {
 public:
  void add(VI a, VI want) { acc_ = _mm256_sub_epi8(acc_, _mm256_cmpeq_epi8(a, want)); }
  int64_t total() const { return sum_u8(acc_); }

 private:
  __m256i acc_ = _mm256_setzero_si256();
};
// Whether any of the 64-bit |bits| seen was 0 (AVX2 has no 64-bit integer min): an OR of equality masks.
struct ZeroTracker64 {
  VI m = _mm256_setzero_si256();
  void add(VI a) { m = _mm256_or_si256(m, _mm256_cmpeq_epi64(a, _mm256_setzero_si256())); }
  bool any() const { return !_mm256_testz_si256(m, m); }
};
#endif

// Horizontal reductions of 128 bits, in a fixed order (the result depends on the data only).
inline float hsum(VF v) {
  __m128 s = narrow_add(v);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#define TORCH_GRADSTATS_HREDUCE(name, op, last)               \
  inline uint32_t name(__m128i m) {                           \
    m = op(m, _mm_shuffle_epi32(m, 0x4e));                    \
    m = op(m, _mm_shuffle_epi32(m, 0xb1));                    \
    last;                                                     \
  }
TORCH_GRADSTATS_HREDUCE(hmax32, _mm_max_epi32, return static_cast<uint32_t>(_mm_cvtsi128_si32(m)))
TORCH_GRADSTATS_HREDUCE(hmin32, _mm_min_epi32, return static_cast<uint32_t>(_mm_cvtsi128_si32(m)))
TORCH_GRADSTATS_HREDUCE(hmax16, _mm_max_epi16, m = _mm_max_epi16(m, _mm_srli_epi32(m, 16));
                        return static_cast<uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffU)
TORCH_GRADSTATS_HREDUCE(hmin16, _mm_min_epi16, m = _mm_min_epi16(m, _mm_srli_epi32(m, 16));
                        return static_cast<uint32_t>(_mm_cvtsi128_si32(m)) & 0xffffU)
TORCH_GRADSTATS_HREDUCE(hmin_u8, _mm_min_epu8, m = _mm_min_epu8(m, _mm_srli_epi32(m, 16));
                        m = _mm_min_epu8(m, _mm_srli_epi16(m, 8));
                        return static_cast<uint32_t>(_mm_cvtsi128_si32(m)) & 0xffU)
#undef TORCH_GRADSTATS_HREDUCE

// |x| of a dtype's |bits|, as float.
template <typename T>
float value_of_abs_bits(uint32_t a) {
  if constexpr (std::is_same_v<T, float>) {
    float f;
    std::memcpy(&f, &a, sizeof(f));
    return f;
  } else {
    return static_cast<float>(T(static_cast<uint16_t>(a), T::from_bits()));
  }
}

// A block's exponent fields as bytes, kBytes per register (the last one zero-padded), and what counting them needs
// from the block's statistics.
struct PackedFields {
  const uint8_t* bytes = nullptr;
  int64_t regs = 0;   // registers of bytes
  int64_t n = 0;      // elements (none: no block)
  int64_t zeros = 0;  // elements that are zero
  int highest = 0;    // the largest field
};

// Packs a block's exponent fields into bytes (the histogram's input) from the |bits| registers the statistics' loop
// already holds: one register of bytes per iteration of simd_block (kBytes elements), in any order within it (a
// count does not depend on it). With GFNI it also counts, one register per register packed, the previous block's
// fields (`behind`).
template <typename T>
class FieldPacker {
 public:
  using E = Exponent<T>;
  static constexpr int64_t kBytes = sizeof(VI);

#if defined(TORCH_GRADSTATS_GFNI)
  // `behind`: the previous block's 16 fields below its largest; `below`, when active, the 16 under those (a span of
  // heavy-tailed values, whose blocks hold more fields).
  explicit FieldPacker(uint8_t* out, WindowCounter behind = {}, WindowCounter below = {})
      : out_(out), behind_(behind), below_(below) {}
  WindowCounter& behind() { return behind_; }
  WindowCounter& below() { return below_; }
#else
  explicit FieldPacker(uint8_t* out) : out_(out) {}
#endif

  // One iteration's registers of masked |bits|: 4 of float32, 2 of a 16-bit type, kBytes elements either way.
  template <int kRegs>
  void add(const VI (&a)[kRegs]) {
    if constexpr (sizeof(T) == 4) {
      static_assert(kRegs == 4, "4 registers of float32 make a register of bytes");
      push(packus16(packus32(srli32<E::kShift>(a[0]), srli32<E::kShift>(a[1])),
                    packus32(srli32<E::kShift>(a[2]), srli32<E::kShift>(a[3]))));
    } else {
      static_assert(kRegs == 2, "2 registers of a 16-bit type make a register of bytes");
      push(packus16(srli16<E::kShift>(a[0]), srli16<E::kShift>(a[1])));
    }
  }

  // The block's last n < kBytes elements.
  void add_tail(const T* x, int64_t n) {
    if (n == 0) {
      return;
    }
    alignas(64) uint8_t tail[kBytes] = {};
    for (int64_t j = 0; j < n; ++j) {
      tail[j] = static_cast<uint8_t>(abs_bits(x + j) >> E::kShift);
    }
    push(loadi(tail));
  }

  int64_t regs() const { return regs_; }
  // The smallest field packed (0 for a zero, a subnormal, or the last register's padding).
  uint32_t lowest() const { return hmin_u8(narrow_min_u8(lowest_)); }
  // The largest field, from the block's largest |bits| (set by accumulate_block_simd).
  void set_highest(uint32_t max_bits) { highest_ = static_cast<int>(max_bits >> E::kShift); }
  PackedFields packed(int64_t n, int64_t zeros) const { return {out_, regs_, n, zeros, highest_}; }

 private:
  void push(VI b) {
    storei(out_ + regs_ * kBytes, b);
    lowest_ = min_u8(lowest_, b);
#if defined(TORCH_GRADSTATS_GFNI)
    behind_.step(regs_);
    if (below_.active()) {
      below_.step(regs_);
    }
#endif
    ++regs_;
  }

  uint8_t* out_;
  int64_t regs_ = 0;
  int highest_ = 0;
  VI lowest_ = set1_8(0xff);
#if defined(TORCH_GRADSTATS_GFNI)
  WindowCounter behind_;
  WindowCounter below_;
#endif
};

// The smallest non-zero field of a block (256 when every field is 0): a pass over its bytes, of field - 1 so that a
// 0 field (0xff) never lowers the minimum.
inline int lowest_nonzero_field(const PackedFields& f) {
  VI m = set1_8(0xff);
  for (int64_t r = 0; r < f.regs; ++r) {
    m = min_u8(m, sub8(loadi(f.bytes + r * static_cast<int64_t>(sizeof(VI))), set1_8(1)));
  }
  return static_cast<int>(hmin_u8(narrow_min_u8(m))) + 1;
}

#if !defined(TORCH_GRADSTATS_GFNI)
// Counts the 8 fields [top - 7, top] of a block's packed fields in one pass, where the CPU has no GFNI: each field
// byte becomes a one-hot bit (a byte shuffle of top - field), and the one-hot registers are added bit-sliced
// (carry-save adders over 16 registers at a time, as in Harley-Seal popcounts: level k holds bit k of each bit
// position's count),
// so 8 fields cost about a load, 3 byte operations and one adder per register where byte compares take 16
// operations. The 8 levels are transposed at the end (bit j of level k to bit k of level j), which turns them into
// per-byte counts that one sum of absolute differences adds up.
class SlicedWindow {
 public:
  // out[d]: how many of the block's fields equal top - d (d in [0, 8); top >= every field of the block).
  static void count(const PackedFields& f, int top, uint32_t out[8]) {
    SlicedWindow w;
    const VI top_v = set1_8(static_cast<uint8_t>(top));
    const auto one_hot = [&](int64_t r) {
      // d = top - field; d < 16 becomes 0x70 + d (the shuffle reads its low 4 bits), larger d saturates to >= 0x80
      // (the shuffle gives 0); the table has 1 << d for d < 8 and 0 for d in [8, 16).
      const VI d = sub8(top_v, loadi(f.bytes + r * kBytes));
      return shuffle8(table(), adds_u8(d, set1_8(0x70)));
    };
    int64_t r = 0;
    for (; r + 16 <= f.regs; r += 16) {
      w.add16([&, k = r]() mutable { return one_hot(k++); });  // made as the adders take them: few live registers
    }
    for (; r < f.regs; ++r) {
      w.carry(one_hot(r), 0);
    }
    w.totals(out);
  }

 private:
  static constexpr int64_t kBytes = sizeof(VI);
  static constexpr int kLevels = 8;  // counts up to 255
  static_assert(kBlockElems / kBytes < (1 << kLevels), "a block's registers must fit the levels");

  static VI table() {
    alignas(16) static constexpr uint8_t kOneHot[16] = {1, 2, 4, 8, 16, 32, 64, 128, 0, 0, 0, 0, 0, 0, 0, 0};
    return broadcast16(kOneHot);
  }

  // (high, low) = a + b + c, bit-wise: a full adder per bit.
  static void adder(VI& high, VI& low, VI a, VI b, VI c) {
    high = majority3(a, b, c);
    low = xor3(a, b, c);
  }

  // Adds x at level k and carries up.
  void carry(VI x, int k) {
    for (; k < kLevels; ++k) {
      const VI c = and_i(level_[k], x);
      level_[k] = xor_i(level_[k], x);
      x = c;
    }
  }

  // Harley-Seal: 16 registers (next() gives them in turn) into levels 0-3 with 15 adders; the sixteens are carried
  // from level 4 up.
  template <class Next>
  void add16(Next&& next) {
    VI& ones = level_[0];
    VI& twos = level_[1];
    VI& fours = level_[2];
    VI& eights = level_[3];
    const auto twos_of_2 = [&](VI& high) {  // 2 registers into ones; their carry
      const VI a = next();
      adder(high, ones, ones, a, next());
    };
    const auto fours_of_4 = [&](VI& high) {  // 4 registers into ones and twos; their carry
      VI twos_a, twos_b;
      twos_of_2(twos_a);
      twos_of_2(twos_b);
      adder(high, twos, twos, twos_a, twos_b);
    };
    VI eights_of_8[2];  // each half's 8 registers into ones, twos and fours; their carries
    for (VI& high : eights_of_8) {
      VI fours_a, fours_b;
      fours_of_4(fours_a);
      fours_of_4(fours_b);
      adder(high, fours, fours, fours_a, fours_b);
    }
    VI sixteens;
    adder(sixteens, eights, eights, eights_of_8[0], eights_of_8[1]);
    carry(sixteens, 4);
  }

  // Swaps bit j of level k with bit k of level j, in 3 rounds of masked shifts (the masks keep every shifted bit
  // within its byte, so 16-bit shifts serve).
  template <int kShift>
  void transpose_round(uint8_t mask) {
    const VI m = set1_8(mask);
    for (int k = 0; k < kLevels; ++k) {
      if ((k & kShift) == 0) {
        const VI t = and_i(xor_i(srli16<kShift>(level_[k]), level_[k + kShift]), m);
        level_[k + kShift] = xor_i(level_[k + kShift], t);
        level_[k] = xor_i(level_[k], slli16<kShift>(t));
      }
    }
  }

  void totals(uint32_t out[8]) {
    transpose_round<1>(0x55);
    transpose_round<2>(0x33);
    transpose_round<4>(0x0f);
    for (int j = 0; j < kLevels; ++j) {  // level j: each byte position's count of bit j
      out[j] = static_cast<uint32_t>(sum_u8(level_[j]));
    }
  }

  VI level_[kLevels] = {};
};
#endif

struct SimdBlock {
  float sumsq;       // sum of squares (scaled by kTinyScale^2 with kScaled), meaningless if max_bits >= Inf bits
  uint32_t max_bits;  // largest |bits|: the largest |x|, or a NaN/Inf when >= the dtype's Inf bits
  uint32_t min_bits;  // smallest |bits|: 0 when the block holds a zero (with kPack, 0 when it may: a field is 0)
};

// One block of float32, float16 or bfloat16: |bits| extrema on the integer registers, squares in float.
template <typename T, bool kScaled, bool kPack = false>
SimdBlock simd_block(const T* x, int64_t n, FieldPacker<T>* pack = nullptr) {
  constexpr bool k16 = sizeof(T) == 2;
  constexpr int64_t kElems = static_cast<int64_t>(sizeof(VI) / sizeof(T));  // elements per register
  constexpr int kRegs = k16 ? 2 : 4;  // registers per iteration: 4 float vectors either way
  const VI mask = k16 ? set1_16(Bits<T>::kAbs) : set1_32(Bits<T>::kAbs);
  const VF scale = set1_f(kTinyScale);
  VF sq[4] = {zero_f(), zero_f(), zero_f(), zero_f()};
  VI mx[2] = {zero_i(), zero_i()}, mn[2] = {mask, mask};  // the mask is above every |bits|
  // A local copy of the packer, written back at the end: its position then stays in a register (through *pack, the
  // byte stores, which may alias anything, made every iteration reload and store it).
  [[maybe_unused]] FieldPacker<T> packer = kPack ? *pack : FieldPacker<T>(nullptr);
  const auto square = [&](VF f, int k) {
    if constexpr (kScaled) {
      f = mul(f, scale);
    }
    sq[k] = fmadd(f, f, sq[k]);
  };
  int64_t i = 0;
  for (; i + kRegs * kElems <= n; i += kRegs * kElems) {
    [[maybe_unused]] VI masked[kRegs];
    for (int r = 0; r < kRegs; ++r) {
      prefetch_ahead(x + i + r * kElems);  // one register is one cache line (AVX512) or half of one (AVX2)
      const VI a = and_i(loadi(x + i + r * kElems), mask);
      if constexpr (kPack) {
        masked[r] = a;
      }
      if constexpr (k16) {
        mx[r & 1] = max16(mx[r & 1], a);
        if constexpr (!kPack) {  // packing: the packer's smallest field tells (one instruction per register)
          mn[r & 1] = min16(mn[r & 1], a);
        }
      } else {
        mx[r & 1] = max32(mx[r & 1], a);
        if constexpr (!kPack) {
          mn[r & 1] = min32(mn[r & 1], a);
        }
      }
      if constexpr (std::is_same_v<T, float>) {
        square(as_float(a), r);
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        square(bf16_lo(a), 2 * r);
        square(bf16_hi(a), 2 * r + 1);
      } else {
        square(f16_lo(a), 2 * r);
        square(f16_hi(a), 2 * r + 1);
      }
    }
    if constexpr (kPack) {
      packer.add(masked);
    }
  }
  if constexpr (kPack) {
    packer.add_tail(x + i, n - i);
    *pack = packer;
  }
  SimdBlock b;
  b.sumsq = hsum(add(add(sq[0], sq[1]), add(sq[2], sq[3])));
  if constexpr (k16) {
    b.max_bits = hmax16(narrow_max16(max16(mx[0], mx[1])));
    b.min_bits = kPack ? packer.lowest() : hmin16(narrow_min16(min16(mn[0], mn[1])));
  } else {
    b.max_bits = hmax32(narrow_max32(max32(mx[0], mx[1])));
    b.min_bits = kPack ? packer.lowest() : hmin32(narrow_min32(min32(mn[0], mn[1])));
  }
  for (; i < n; ++i) {
    const uint32_t a = abs_bits(x + i);
    b.max_bits = std::max(b.max_bits, a);
    b.min_bits = std::min(b.min_bits, a);
    const float v = value_of_abs_bits<T>(a) * (kScaled ? kTinyScale : 1.0f);
    b.sumsq += v * v;
  }
  return b;
}

// With `pack`, the block's exponent fields are packed into it on the way (the histogram's input).
template <typename T>
void accumulate_block_simd(const T* x, int64_t n, Partial& p, FieldPacker<T>* pack = nullptr) {
  const SimdBlock b = pack != nullptr ? simd_block<T, false, true>(x, n, pack) : simd_block<T, false>(x, n);
  if (pack != nullptr) {
    pack->set_highest(b.max_bits);
  }
  if (b.max_bits >= Bits<T>::kInf || !std::isfinite(b.sumsq)) {  // a NaN or an Inf, or float overflow
    accumulate_exact(x, n, p);
    return;
  }
  const double amax = value_of_abs_bits<T>(b.max_bits);
  double sumsq = b.sumsq;
  if (amax > 0 && amax < kTinyThreshold) {
    constexpr double kUnscale = 1.0 / (static_cast<double>(kTinyScale) * kTinyScale);
    sumsq = static_cast<double>(simd_block<T, true>(x, n).sumsq) * kUnscale;
  }
  p.sumsq += sumsq;
  p.amax = std::max(p.amax, amax);
  if (b.min_bits == 0) {
    p.zeros += count_zero_bits(x, n);
  }
}

// One block of float64, summed in double: |bits| by a mask, squares and max |x| of those values, whether a zero
// occurs from the bits. A NaN or an Inf makes the sum non-finite (exact path).
template <>
void accumulate_block_simd<double>(const double* x, int64_t n, Partial& p, FieldPacker<double>* /*pack*/) {
  constexpr int64_t kElems = static_cast<int64_t>(sizeof(VI) / sizeof(double));
  const VI mask = set1_64(Bits<double>::kAbs);
  VD sq[4] = {zero_d(), zero_d(), zero_d(), zero_d()}, mx[2] = {zero_d(), zero_d()};
  ZeroTracker64 zeros;
  int64_t i = 0;
  for (; i + 4 * kElems <= n; i += 4 * kElems) {
    for (int r = 0; r < 4; ++r) {
      prefetch_ahead(x + i + r * kElems);
      const VI a = and_i(loadi(x + i + r * kElems), mask);
      const VD v = as_double(a);
      sq[r] = fmadd_d(v, v, sq[r]);
      mx[r & 1] = max_d(mx[r & 1], v);
      zeros.add(a);
    }
  }
  double sumsq = hsum_d(add_d(add_d(sq[0], sq[1]), add_d(sq[2], sq[3])));
  double amax = hmax_d(max_d(mx[0], mx[1]));
  bool has_zero = zeros.any();
  for (; i < n; ++i) {
    const uint64_t a = abs_bits(x + i);
    double v;
    std::memcpy(&v, &a, sizeof(v));
    sumsq += v * v;
    amax = std::max(amax, v);
    has_zero |= a == 0;
  }
  if (!std::isfinite(sumsq)) {
    accumulate_exact(x, n, p);
    return;
  }
  p.sumsq += sumsq;
  p.amax = std::max(p.amax, amax);
  if (has_zero) {
    p.zeros += count_zero_bits(x, n);
  }
}
#endif  // TORCH_GRADSTATS_SIMD

// ---------------------------------------------------------------------------------------------------------------
// Exponent histogram.
// ---------------------------------------------------------------------------------------------------------------
// The histogram bucket of floor(log2 |x|) == e (float64's wider range clamped at both ends).
constexpr int64_t bucket_of(int64_t e) {
  return std::clamp<int64_t>(e - kHistogramMinExponent, 0, kHistogramBuckets - 1);
}

// Field counts of one span, in kWays interleaved tables (uint32: a span has at most 2^31 elements).
template <typename T>
class ExponentCounts {
 public:
  using E = Exponent<T>;
  static constexpr int kWays = E::kFields > 256 ? 1 : 4;  // float64's table is 8 KiB already

  ExponentCounts() { std::memset(table_, 0, sizeof(table_)); }

  // Counts the fields of x[0, n) one by one (the baseline build, and float64's 2,048 fields).
  void add(const T* x, int64_t n) {
    touch(0, E::kFields - 1);
    int64_t i = 0;
    for (; i + kWays <= n; i += kWays) {
      for (int w = 0; w < kWays; ++w) {
        ++table_[w][field(x + i + w)];
      }
    }
    for (; i < n; ++i) {
      ++table_[0][field(x + i)];
    }
  }

  // Adds the span's buckets into `out`: `zeros` is the span's zero count (part of field 0), x[0, n) the span (read
  // again only when it holds subnormals).
  void flush(const T* x, int64_t n, int64_t zeros, HistogramRow out) const {
    const auto add_to = [&](int64_t bucket, int64_t count) {
      if (out.shared) {
        std::atomic_ref<int64_t>(out.row[bucket]).fetch_add(count, std::memory_order_relaxed);
      } else {
        out.row[bucket] += count;
      }
    };
    // Normal values, in the fields counted; the last field is NaN and Inf.
    for (int f = std::max(1, low_); f <= std::min(high_, E::kFields - 2); ++f) {
      const int64_t count = total(f);
      if (count != 0) {
        add_to(bucket_of(f - E::kBias), count);
      }
    }
    const int64_t subnormals = total(0) - zeros;
    if (subnormals == 0) {
      return;
    }
    constexpr int64_t kSubnormalExponent = 1 - E::kBias - E::kMantissa;  // floor(log2) of mantissa 1
    if constexpr (kSubnormalExponent + E::kMantissa - 1 < kHistogramMinExponent) {
      add_to(0, subnormals);  // float64: all of them below 2^-149
    } else {
      int64_t counts[E::kMantissa] = {};  // by floor(log2 m)
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t a = abs_bits(x + i);
        if (a != 0 && (a >> E::kShift) == 0) {
          ++counts[std::bit_width(a) - 1];
        }
      }
      for (int k = 0; k < E::kMantissa; ++k) {
        if (counts[k] != 0) {
          add_to(bucket_of(kSubnormalExponent + k), counts[k]);
        }
      }
    }
  }

  static uint32_t field(const T* x) { return static_cast<uint32_t>(abs_bits(x) >> E::kShift); }

#if defined(TORCH_GRADSTATS_GFNI)
  // Adds a block's fields, given the counts of the 16 fields below its largest (`window`, which has counted all of
  // its registers). A block of 4,096 Gaussian-like gradients typically spans ~15 fields, so the window usually holds
  // every non-zero one. A block of heavy-tailed values holds more: while many of its elements are still uncounted,
  // the next 16 fields down are counted the same way (the block's fields are still in L1), the first such window by
  // `below` when it is active (it counted during the next block's read, like `window`); the few left after that
  // (the block's uncounted elements are not all zeros) are found and counted one by one. Returns whether the block
  // needed a second window (the caller then has `below` count the next block's).
  bool add_packed(const PackedFields& f, WindowCounter& window, WindowCounter* below = nullptr) {
    int lowest = f.highest - kWindow + 1;  // the field of the counts' lane 0
    int64_t counted = add_window(window.counts(), lowest);  // elements of a field >= 1
    touch(std::max(1, lowest), f.highest);
    bool wide = false;
    while (lowest > 1 && f.n - counted - f.zeros > kWindowAgain) {
      __m512i counts;
      if (!wide && below != nullptr && below->active()) {  // its top: f.highest - kWindow == lowest - 1
        counts = below->counts();
      } else {
        WindowCounter next(f.bytes, f.regs, lowest - 1);
        next.finish(0);
        counts = next.counts();
      }
      wide = true;
      lowest -= kWindow;
      counted += add_window(counts, lowest);
      touch(std::max(1, lowest), lowest + kWindow - 1);
    }
    if (lowest > 1 && f.n - counted > f.zeros) {  // fields below the windows (or subnormals)
      counted += count_below(f, lowest, f.n - counted - f.zeros);
    }
    table_[0][0] += static_cast<uint32_t>(f.n - counted);
    return wide;
  }

  // Adds the counts of fields [lowest, lowest + 15] (lane j: field lowest + j) but field 0 and below (zeros and
  // subnormals, counted otherwise; padding); returns how many it added.
  int64_t add_window(__m512i counts, int lowest) {
    if (lowest >= 1) {
      uint32_t* fields = &table_[0][lowest];
      _mm512_storeu_si512(fields, _mm512_add_epi32(_mm512_loadu_si512(fields), counts));
      return _mm512_reduce_add_epi32(counts);
    }
    alignas(64) uint32_t lanes[kWindow];
    _mm512_store_si512(lanes, counts);
    int64_t added = 0;
    for (int j = 1 - lowest; j < kWindow; ++j) {
      table_[0][lowest + j] += lanes[j];
      added += lanes[j];
    }
    return added;
  }

  // Counts one by one the elements whose field is in [1, below), found 64 at a time: the few that a window below the
  // largest field leaves out (in a block of Gaussian-like gradients, those 16 binades below its largest value). It
  // stops once it has found `most` of them, all there are unless the block holds subnormals.
  int64_t count_below(const PackedFields& f, int below, int64_t most) {
    const VI one = set1_8(1);
    const VI limit = set1_8(static_cast<uint8_t>(below - 1));
    int64_t counted = 0;
    for (int64_t r = 0; r < f.regs && counted < most; ++r) {
      const uint8_t* reg = f.bytes + r * kBytes;
      // field - 1 < below - 1, unsigned: a 0 field (zero, subnormal, padding) wraps to 255
      for (uint64_t m = _mm512_cmplt_epu8_mask(sub8(loadi(reg), one), limit); m != 0; m &= m - 1) {
        const int field = reg[std::countr_zero(m)];
        ++table_[0][field];
        low_ = std::min(low_, field);
        ++counted;
      }
    }
    return counted;
  }
#elif defined(TORCH_GRADSTATS_SIMD)
  // Adds a block's fields, from the largest down to the smallest non-zero one (a block of 4,096 gradients typically
  // spans ~15 fields, heavy-tailed ones ~20): 8 at a time bit-sliced (SlicedWindow) while at least kSlicedFields of
  // them are left, the rest by one byte compare per field and register; both instead of a dependent increment of a
  // table per element.
  void add_packed(const PackedFields& f) {
    const int lo = lowest_nonzero_field(f);
    const int hi = f.highest;
    if (hi - lo + 1 > kMaxCompareFields) {
      touch(0, E::kFields - 1);
      for (int64_t i = 0; i < f.n; ++i) {  // the first n bytes are the elements' fields
        ++table_[i % kWays][f.bytes[i]];
      }
      return;
    }
    touch(lo, hi);
    int64_t counted = 0;
    int top = hi;  // fields [lo, top] are left to count
    for (; top - lo + 1 >= kSlicedFields; top -= 8) {
      uint32_t window[8];
      SlicedWindow::count(f, top, window);
      for (int d = 0; d < 8 && top - d >= lo; ++d) {  // lo >= 1: field 0 (zeros, subnormals, padding) is left out
        table_[0][top - d] += window[d];
        counted += window[d];
      }
    }
    // kFieldsPerPass fields per pass over the block: independent accumulators, one load per register.
    for (int first = lo; first <= top; first += kFieldsPerPass) {
      VI want[kFieldsPerPass];
      ByteMatches matches[kFieldsPerPass];  // regs <= 64 registers each
      for (int k = 0; k < kFieldsPerPass; ++k) {
        want[k] = set1_8(static_cast<uint8_t>(first + k));  // past top (even wrapped past 255): counted, not used
      }
      for (int64_t r = 0; r < f.regs; ++r) {
        const VI v = loadi(f.bytes + r * kBytes);
        for (int k = 0; k < kFieldsPerPass; ++k) {
          matches[k].add(v, want[k]);
        }
      }
      for (int k = 0; k < kFieldsPerPass && first + k <= top; ++k) {
        const int64_t count = matches[k].total();
        table_[0][first + k] += static_cast<uint32_t>(count);
        counted += count;
      }
    }
    table_[0][0] += static_cast<uint32_t>(f.n - counted);  // zeros and subnormals: every other field is in [lo, hi]
  }
#endif

 private:
#if defined(TORCH_GRADSTATS_GFNI)
  static constexpr int kWindow = 16;  // fields a WindowCounter counts at once
  // More uncounted elements below a window than this: another window (~700 instructions for a block) costs less
  // than finding and counting them one by one (several cycles each).
  static constexpr int64_t kWindowAgain = 32;
#endif
#if defined(TORCH_GRADSTATS_SIMD)
  // Above this many distinct fields in a block, one increment per element costs less than a compare per field.
  static constexpr int kMaxCompareFields = 64;
  static constexpr int kFieldsPerPass = 4;
  // From this many fields left, a bit-sliced window of 8 (about 10 operations per register on AVX2, fewer on AVX512)
  // costs less than their byte compares (2 operations per field and register).
  static constexpr int kSlicedFields = 5;
  static constexpr int64_t kBytes = sizeof(VI);
#endif

  // Fields outside [low_, high_] have not been counted (flush() reads that range only).
  void touch(int low, int high) {
    low_ = std::min(low_, low);
    high_ = std::max(high_, high);
  }

  int64_t total(int f) const {
    int64_t sum = 0;
    for (int w = 0; w < kWays; ++w) {
      sum += table_[w][f];
    }
    return sum;
  }

  uint32_t table_[kWays][E::kFields];
  int low_ = E::kFields;
  int high_ = 0;
};

template <typename T>
void accumulate_block(const T* x, int64_t n, Partial& p) {
#if defined(TORCH_GRADSTATS_SIMD)
  accumulate_block_simd(x, n, p);
#else
  accumulate_block_generic(x, n, p);
#endif
}

template <typename T>
Partial accumulate_span(const T* x, int64_t n, HistogramRow histogram) {
  Partial p;
  if (histogram.row == nullptr) {
    for (int64_t b = 0; b < n; b += kBlockElems) {
      accumulate_block(x + b, std::min(kBlockElems, n - b), p);
    }
    return p;
  }
  ExponentCounts<T> exponents;
#if defined(TORCH_GRADSTATS_SIMD)
  if constexpr (Exponent<T>::kFields <= 256) {
    // Each block's fields are packed by the statistics' own loop and counted while they are in L1: with GFNI, inside
    // the next block's loop (so that the counting overlaps its memory reads), else right after it.
    alignas(64) uint8_t fields[2][kBlockElems];
    PackedFields previous;
    [[maybe_unused]] bool wide = false;  // the last block counted needed a second window: count two at once
    for (int64_t b = 0, k = 0; b < n; b += kBlockElems, ++k) {
      const int64_t len = std::min(kBlockElems, n - b);
#if defined(TORCH_GRADSTATS_GFNI)
      FieldPacker<T> packer(fields[k & 1], WindowCounter(previous.bytes, previous.regs, previous.highest),
                            wide ? WindowCounter(previous.bytes, previous.regs, previous.highest - 16)
                                 : WindowCounter());
#else
      FieldPacker<T> packer(fields[k & 1]);
#endif
      const int64_t zeros_before = p.zeros;
      accumulate_block_simd(x + b, len, p, &packer);
      if (previous.n != 0) {
#if defined(TORCH_GRADSTATS_GFNI)
        packer.behind().finish(packer.regs());  // this block may have fewer registers
        if (packer.below().active()) {
          packer.below().finish(packer.regs());
        }
        wide = exponents.add_packed(previous, packer.behind(), &packer.below());
#else
        exponents.add_packed(previous);
#endif
      }
      previous = packer.packed(len, p.zeros - zeros_before);
    }
    if (previous.n != 0) {
#if defined(TORCH_GRADSTATS_GFNI)
      WindowCounter last(previous.bytes, previous.regs, previous.highest);
      last.finish(0);
      exponents.add_packed(previous, last);
#else
      exponents.add_packed(previous);
#endif
    }
    exponents.flush(x, n, p.zeros, histogram);
    return p;
  }
#endif
  for (int64_t b = 0; b < n; b += kBlockElems) {
    const int64_t len = std::min(kBlockElems, n - b);
    accumulate_block(x + b, len, p);
    exponents.add(x + b, len);  // the block is still in L1
  }
  exponents.flush(x, n, p.zeros, histogram);
  return p;
}

}  // namespace

Partial accumulate(c10::ScalarType dtype, const void* data, int64_t n, HistogramRow histogram) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return accumulate_span(static_cast<const float*>(data), n, histogram);
    case c10::ScalarType::Double:
      return accumulate_span(static_cast<const double*>(data), n, histogram);
    case c10::ScalarType::Half:
      return accumulate_span(static_cast<const c10::Half*>(data), n, histogram);
    case c10::ScalarType::BFloat16:
      return accumulate_span(static_cast<const c10::BFloat16*>(data), n, histogram);
    default:
      return Partial{};  // unreachable: the op checks the dtypes first
  }
}

const char* histogram_counting() {
#if defined(TORCH_GRADSTATS_GFNI)
  return "16 exponent fields at once (GFNI, AVX512-BITALG), during the next block's read";
#elif defined(TORCH_GRADSTATS_SIMD)
  return "8 exponent fields at a time bit-sliced, the last few by byte compares";
#else
  return "one table increment per element";
#endif
}

}  // namespace torch_gradstats::cpu::CPU_CAPABILITY
