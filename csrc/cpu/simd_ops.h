// The few register operations the x86 block kernels need, per register width (AVX512, AVX2), and the horizontal
// reductions in a fixed order.
// Part of stats_kernel_impl.h, included through it once per instruction set (see there): everything here lives in
// that translation unit's torch_gradstats::cpu::<CPU_CAPABILITY> namespace, with internal linkage.
#pragma once

#include "kernel_basics.h"

#if defined(TORCH_GRADSTATS_SIMD)
namespace torch_gradstats::cpu::CPU_CAPABILITY {
namespace {

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

}  // namespace
}  // namespace torch_gradstats::cpu::CPU_CAPABILITY
#endif  // TORCH_GRADSTATS_SIMD
