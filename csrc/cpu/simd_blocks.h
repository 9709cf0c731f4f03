// The x86 block kernels (float32, float16, bfloat16 on integer bits; float64 in double) and the packing of each
// block's exponent fields into bytes on the way, with the bit-sliced counting of CPUs without GFNI.
// Part of stats_kernel_impl.h, included through it once per instruction set (see there): everything here lives in
// that translation unit's torch_gradstats::cpu::<CPU_CAPABILITY> namespace, with internal linkage.
#pragma once

#include "simd_ops.h"

#if defined(TORCH_GRADSTATS_SIMD)
namespace torch_gradstats::cpu::CPU_CAPABILITY {
namespace {

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

}  // namespace
}  // namespace torch_gradstats::cpu::CPU_CAPABILITY
#endif  // TORCH_GRADSTATS_SIMD
