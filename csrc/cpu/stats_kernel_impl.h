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
//
// The parts, each included by the next: kernel_basics.h (bits, exact path, generic kernel), simd_ops.h (x86
// register operations), simd_blocks.h (x86 block kernels, exponent fields packed into bytes); this file holds the
// exponent histogram's counts and the span loop.
#pragma once

#include "simd_blocks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace torch_gradstats::cpu::CPU_CAPABILITY {
namespace {

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
