// The exponent histogram of the overload multi_tensor_stats.histogram: per-warp tables in shared memory and their
// flushes into the output rows.
// Part of multi_tensor_stats.cu and included by it alone: one translation unit, so everything here keeps the
// internal linkage of the anonymous namespace.
#pragma once

#include "multi_tensor_stats.h"
#include "tensor_meta.cuh"

#include <cstdint>
#include <type_traits>

namespace torch_gradstats {
namespace {

// ----------------------------------------------------------------------------------------------------------------
// Exponent histogram (the overload multi_tensor_stats.histogram; docs/cuda.md, "The exponent histogram"). Each warp
// counts its elements' buckets in a table of its own in shared memory (uint32, shared-memory atomics); a block flushes
// its tables into the output row of the tensor it counted (one global 64-bit atomic add per non-zero bucket) when it
// moves on to another tensor, a warp after each of its warp tiles (one tensor each). Integer adds: the result does
// not depend on their order.
constexpr int kBuckets = int(kHistogramBuckets);
constexpr int kWarps = kThreads / 32;
// A block flushes before the elements it has counted since its last flush would pass this, so that no warp's uint32
// counter can overflow (a single larger tile is flushed alone; see kMaxHistogramNumel).
constexpr int64_t kHistogramFlushElems = int64_t(1) << 31;
// With a histogram, tensors of at most 2^46 elements: a tile then has at most 2^34 + 8 elements (4096 tiles per
// tensor), and a warp counts at most 1/8 of its vectors plus one per lane and the scalar edges: < 2^32.
constexpr int64_t kMaxHistogramNumel = int64_t(1) << 46;
static_assert(kMaxHistogramNumel / kMaxTilesPerTensor / kWarps + 32 * 8 + 32 < (int64_t(1) << 32),
              "a warp's histogram counters could overflow");

// The bucket of a finite non-zero element, from a = its bits & kAbs (0 < a < kExp): floor(log2 |x|) from the
// exponent field, or for a subnormal from its mantissa's highest set bit; clamped to [0, kBuckets) (float64 only).
template <class Tr>
__device__ __forceinline__ int exponent_bucket(typename Tr::bits_t a) {
  const int field = int(a >> Tr::kShift);
  int e = field - Tr::kBias;  // float64: a subnormal's field 0 gives 2^-1023, bucket 0, where all of them go
  if constexpr (sizeof(typename Tr::bits_t) < 8) {
    if (field == 0) [[unlikely]] {  // the leading-zero count only for subnormals
      e = 1 - Tr::kBias - Tr::kShift + 31 - __clz(uint32_t(a));
    }
  }
  e -= int(kHistogramMinExponent);
  return e < 0 ? 0 : (e < kBuckets ? e : kBuckets - 1);
}

// Counts elements into a warp's table; ExponentCounter<false> (the op without a histogram) does nothing and
// compiles away.
template <bool kEnabled>
struct ExponentCounter {
  template <class Tr>
  __device__ __forceinline__ void count(typename Tr::bits_t) const {}
  template <class Tr, int V>
  __device__ __forceinline__ void count_run(const uint4 (&)[V]) const {}
};
template <>
struct ExponentCounter<true> {
  uint32_t* table;  // this warp's kBuckets counters, in shared memory

  template <class Tr>
  __device__ __forceinline__ void count(typename Tr::bits_t b) const {
    using bits_t = typename Tr::bits_t;
    using wide_t = std::conditional_t<sizeof(bits_t) == 8, uint64_t, uint32_t>;
    const wide_t a = wide_t(b & Tr::kAbs);
    if (a - 1 < wide_t(Tr::kExp) - 1) atomicAdd(table + exponent_bucket<Tr>(bits_t(a)), 1u);  // 0 < a < kExp
  }
  template <class Tr, int V>
  __device__ __forceinline__ void count_run(const uint4 (&r)[V]) const {
    using bits_t = typename Tr::bits_t;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const bits_t* e = reinterpret_cast<const bits_t*>(&r[k]);
#pragma unroll
      for (int j = 0; j < int(sizeof(uint4) / sizeof(bits_t)); ++j) count<Tr>(e[j]);
    }
  }
};

// The block's kWarps tables of kBuckets counters (only the histogram kernel refers to them, so only it has them).
__device__ __forceinline__ uint32_t* histogram_tables() {
  __shared__ uint32_t tables[kWarps * kBuckets];
  return tables;
}

// Every thread of the block: adds the sum of the warps' tables into `row` (int64 [kBuckets], as unsigned: two's
// complement adds alike) and zeroes them. Each bucket is read and zeroed by one thread; the barriers order that after
// every warp's counting and before any warp counts again.
__device__ __forceinline__ void flush_block_histogram(uint32_t* tables, unsigned long long* row) {
  __syncthreads();
  for (int b = threadIdx.x; b < kBuckets; b += kThreads) {
    unsigned long long sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sum += tables[w * kBuckets + b];
      tables[w * kBuckets + b] = 0;
    }
    if (sum != 0) atomicAdd(row + b, sum);
  }
  __syncthreads();
}

// Every lane of one warp: adds the warp's table into `row` and zeroes it.
__device__ __forceinline__ void flush_warp_histogram(uint32_t* table, unsigned long long* row, int lane) {
  __syncwarp();
  for (int b = lane; b < kBuckets; b += 32) {
    const uint32_t c = table[b];
    if (c != 0) {
      atomicAdd(row + b, (unsigned long long)c);
      table[b] = 0;
    }
  }
  __syncwarp();
}

}  // namespace
}  // namespace torch_gradstats
