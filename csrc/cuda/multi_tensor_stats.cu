// The fused CUDA kernel of torch_gradstats::multi_tensor_stats (contract: docs/design.md; design notes: docs/cuda.md).
//
// Two launches for any number of tensors, deterministic, no host sync:
//  1. `tile_stats_kernel`: a persistent grid (sized from the SM count) walks a flattened list of tiles; a tile is a
//     contiguous span of one tensor. Every element is read once with 16-byte loads (scalar head/tail only at
//     unaligned tile edges); one block (or, for a whole tensor of at most 8 KB, one warp) reduces a tile in a fixed
//     order and writes that tile's partial.
//  2. `finalize_kernel`: one warp (or, for a tensor of many tiles, one block) reduces each tensor's partials in a
//     fixed order, turns the NaN/Inf counts into the special values of sumsq/amax and writes the outputs.
// Which block handles which tile never changes a result, so the bits are the same on every call and every GPU.
// The overload multi_tensor_stats.histogram runs the same two launches (tile_stats_kernel<true> also counts each
// element's binary exponent into exponent_histogram, zeroed before them, with integer atomic adds: exact in any order).
//
// Tensor metadata (pointer, numel, dtype, tiling, broadcast repeat) of a list of at most 80 tensors (680 with CUDA
// 12.1+) is a kernel parameter of both kernels (MetaInline, __grid_constant__): nothing is allocated, written or
// cached, eager or captured. A longer list's metadata is written to the device by `fill_metadata_kernel`, whose kernel
// parameters carry it (no memcpy, no host buffer to keep alive). Eager calls keep it in a content-addressed cache
// whose memory is the cache's own (a CUDA memory pool, never PyTorch's caching allocator, so never a CUDA-graph
// pool): in steady state nothing is written at all. A capturing stream never touches the cache: its graph gets its
// own copy, written once while it is captured into memory of the same pool that the graph owns (a CUDA user
// object frees it when the graph is destroyed), so a replay runs the two kernels and nothing else; where that is
// not possible, fill kernels captured with the call rewrite a per-call temporary on every replay (docs/cuda.md,
// "Metadata and CUDA graphs").
#include "metadata_cache.h"
#include "multi_tensor_stats.h"
#include "packed16.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

namespace torch_gradstats {
namespace {

// ----------------------------------------------------------------------------------------------------------------
// Tuning constants (fixed: they define the reduction order, hence the bits of the result).
constexpr int kThreads = 256;                  // threads per block, both kernels
constexpr int kUnroll = 4;                     // 16-byte loads in flight per thread
constexpr int64_t kVecBytes = 16;              // one vector load
constexpr int64_t kTileBytes = 64 * 1024;      // nominal tile: 16 vector loads per thread
constexpr int64_t kWarpTileBytes = 8 * 1024;   // a tensor this small is one tile, read by one warp
constexpr int64_t kMaxTilesPerTensor = 4096;   // bigger tensors get bigger tiles (bounds the finalize work)
constexpr int kBlocksPerSM = 4;                // persistent grid = SMs * this
constexpr int kWarpsPerFinalizeBlock = kThreads / 32;
constexpr int64_t kFinalizeWarpTiles = 64;     // more partials than this: a whole block reduces them
constexpr int64_t kFinalizeOnePerBlock = 2048;  // lists up to this long get a finalize block per tensor
// Per-thread counters are 32-bit; a tile never gives one thread more than 2^31 elements below this size.
constexpr int64_t kMaxNumel = int64_t(1) << 50;

enum DTypeTag : int32_t { kTagHalf = 0, kTagBFloat16 = 1, kTagFloat = 2, kTagDouble = 3 };

// One entry per input tensor. The tensor's elements are the flat span [ptr, ptr + numel) (the input is dense; see
// the host code), cut into tiles of tile_elems elements. Entries are in tile order, not list order: first the
// tensors read by whole blocks (and the empty ones), then those read by one warp (one tile each), each class in list
// order; `index` is the tensor's place in the list (its output row).
struct TensorMeta {
  const void* ptr;
  int64_t numel;
  int64_t tile_elems;  // a multiple of the elements per 16 bytes
  int64_t first_tile;  // index of this tensor's first tile in the flattened tile list
  int64_t repeat;      // the tensor is a broadcast view read once: sumsq, counts and histogram times this (>= 1)
  int32_t dtype;       // DTypeTag
  int32_t index;       // the output row
};
static_assert(sizeof(TensorMeta) == 48, "TensorMeta layout is shared by host and device");

// Where the kernels find the entries (one type per source; every member is uniform across the grid):
//  * MetaInMemory: device memory (a cache entry, a graph's buffer or the per-call temporary): TensorMeta[N], then
//    the entry of every tile, int32[T];
//  * MetaInline<K>: the kernel parameters themselves (__grid_constant__: read in place, no copy per thread), for
//    lists of at most K tensors: nothing to allocate, write or cache, and a captured call's graph holds it in its
//    kernel nodes. A block tile's entry is found by a binary search over first_tile; a warp tile's is direct.
struct MetaInMemory {
  const TensorMeta* meta;
  const int32_t* tile_entry;
  __device__ __forceinline__ const TensorMeta& at(int64_t j) const { return meta[j]; }
  __device__ __forceinline__ int32_t entry_of(int64_t t, int64_t /*num_block_tiles*/) const { return tile_entry[t]; }
};
template <int K>
struct MetaInline {
  int32_t count;      // entries in use
  int32_t num_block;  // entries [0, num_block) are the block-read (and empty) tensors
  TensorMeta m[K];
  __device__ __forceinline__ const TensorMeta& at(int64_t j) const { return m[j]; }
  __device__ __forceinline__ int32_t entry_of(int64_t t, int64_t num_block_tiles) const {
    if (t >= num_block_tiles) return num_block + int32_t(t - num_block_tiles);  // warp tiles: one per entry
    int32_t lo = 0, hi = num_block - 1;  // the last entry whose first tile is <= t (an empty one never is last)
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (m[mid].first_tile <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
};

// ----------------------------------------------------------------------------------------------------------------
// Per-dtype bit patterns. Classification comes from the bits: with a = bits & kAbs, zero <=> a == 0 (so -0.0 too),
// inf <=> a == kExp, NaN <=> a > kExp, finite <=> a < kExp; for finite values, a orders like |x|. The exponent
// field is a >> kShift (the mantissa has kShift bits), biased by kBias.
// Words: how packed16.h reads two of them from a 32-bit word (16-bit dtypes only).
struct HalfTraits {
  using bits_t = uint16_t;
  using Words = packed16::HalfWords;
  static constexpr bits_t kAbs = 0x7fff, kExp = 0x7c00;
  static constexpr int kShift = 10, kBias = 15;  // exponent field: a >> kShift; mantissa bits: kShift
  static __device__ __forceinline__ double to_double(bits_t b) { return __half2float(__ushort_as_half(b)); }
};
struct BFloat16Traits {
  using bits_t = uint16_t;
  using Words = packed16::BFloat16Words;
  static constexpr bits_t kAbs = 0x7fff, kExp = 0x7f80;
  static constexpr int kShift = 7, kBias = 127;
  static __device__ __forceinline__ double to_double(bits_t b) { return __uint_as_float(uint32_t(b) << 16); }
};
struct FloatTraits {
  using bits_t = uint32_t;
  using Words = void;
  static constexpr bits_t kAbs = 0x7fffffffu, kExp = 0x7f800000u;
  static constexpr int kShift = 23, kBias = 127;
  static __device__ __forceinline__ double to_double(bits_t b) { return __uint_as_float(b); }
};
struct DoubleTraits {
  using bits_t = uint64_t;
  using Words = void;
  static constexpr bits_t kAbs = 0x7fffffffffffffffull, kExp = 0x7ff0000000000000ull;
  static constexpr int kShift = 52, kBias = 1023;
  static __device__ __forceinline__ double to_double(bits_t b) { return __longlong_as_double((long long)b); }
};

// What one thread accumulates over its elements of a tile. sumsq is float64 (a float32/bfloat16 square can
// overflow or underflow float32, never float64); NaN/Inf elements may poison sumsq, which is harmless because the
// finalize step overrides sumsq whenever the NaN or Inf count is non-zero.
template <class Tr>
struct ThreadAcc {
  double sumsq = 0.0;
  typename Tr::bits_t amax_bits = 0;  // max |x| over finite elements, as bits
  uint32_t zeros = 0, nans = 0, infs = 0;

  __device__ __forceinline__ void visit(typename Tr::bits_t b) {
    using bits_t = typename Tr::bits_t;
    const bits_t a = bits_t(b & Tr::kAbs);
    zeros += (a == 0);
    nans += (a > Tr::kExp);
    infs += (a == Tr::kExp);
    amax_bits = (a < Tr::kExp && a > amax_bits) ? a : amax_bits;
    const double v = Tr::to_double(b);
    sumsq = fma(v, v, sumsq);
  }
  __device__ __forceinline__ void visit_vec(const uint4& v) {
    using bits_t = typename Tr::bits_t;
    const bits_t* e = reinterpret_cast<const bits_t*>(&v);
#pragma unroll
    for (int k = 0; k < int(sizeof(uint4) / sizeof(bits_t)); ++k) visit(e[k]);
  }

  // V vectors held in registers, one run. 16-bit dtypes are read as packed words (packed16.h: two elements per
  // integer operation, squares summed in float32): the exact per-element visit only for a run that holds an Inf or
  // a NaN, and float64 squares only for a run whose float32 sum cannot stand for them (an overflow, or squares
  // below float32's normal range). float32 and float64 go element by element.
  template <int V>
  __device__ __forceinline__ void visit_run(const uint4 (&r)[V]) {
    using bits_t = typename Tr::bits_t;
    if constexpr (std::is_void_v<typename Tr::Words>) {
#pragma unroll
      for (int k = 0; k < V; ++k) visit_vec(r[k]);
    } else {
      constexpr int kElems = V * int(sizeof(uint4) / sizeof(bits_t));
      const packed16::Run run = packed16::scan_run<kElems / 2, typename Tr::Words>(reinterpret_cast<const uint32_t*>(r));
      if (run.special) {
        *this = visit_exact(*this, Vecs<V>::of(r));
        return;
      }
      zeros += run.zeros;
      amax_bits = bits_t(run.amax) > amax_bits ? bits_t(run.amax) : amax_bits;
      if (packed16::run_sum_is_kept(run.sum)) {
        sumsq += double(run.sum);
      } else if (run.zeros != uint32_t(kElems)) {
        sumsq = exact_sumsq(Vecs<V>::of(r), sumsq);
      }
    }
  }

  // The rare paths of visit_run, out of line so that the common path keeps its registers (64, the launch bound).
  template <int V>
  struct Vecs {
    uint4 v[V];
    static __device__ __forceinline__ Vecs of(const uint4 (&r)[V]) {
      Vecs out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = r[k];
      return out;
    }
  };
  // By value in and out: a pointer to the accumulator would keep it out of registers everywhere.
  template <int V>
  static __device__ __noinline__ ThreadAcc visit_exact(ThreadAcc acc, const Vecs<V> r) {
#pragma unroll
    for (int k = 0; k < V; ++k) acc.visit_vec(r.v[k]);
    return acc;
  }
  template <int V>
  static __device__ __noinline__ double exact_sumsq(const Vecs<V> r, double sumsq) {
    using bits_t = typename Tr::bits_t;
    const bits_t* e = reinterpret_cast<const bits_t*>(r.v);
#pragma unroll
    for (int k = 0; k < V * int(sizeof(uint4) / sizeof(bits_t)); ++k) {
      const double x = Tr::to_double(e[k]);
      sumsq = fma(x, x, sumsq);
    }
    return sumsq;
  }
};

// A block's (or a tensor's) result, in the form the partials workspace stores.
struct Partial {
  double sumsq;
  double amax;
  unsigned long long zeros, nans, infs;
};

__device__ __forceinline__ Partial combine(const Partial& x, const Partial& y) {
  return {x.sumsq + y.sumsq, fmax(x.amax, y.amax), x.zeros + y.zeros, x.nans + y.nans, x.infs + y.infs};
}

// Fixed-shape tree over the 32 lanes; lane 0 ends with the warp's result.
__device__ __forceinline__ Partial warp_reduce(Partial p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Partial o;
    o.sumsq = __shfl_down_sync(0xffffffffu, p.sumsq, offset);
    o.amax = __shfl_down_sync(0xffffffffu, p.amax, offset);
    o.zeros = __shfl_down_sync(0xffffffffu, p.zeros, offset);
    o.nans = __shfl_down_sync(0xffffffffu, p.nans, offset);
    o.infs = __shfl_down_sync(0xffffffffu, p.infs, offset);
    p = combine(p, o);
  }
  return p;
}

// Fixed-shape reduction over a block: the warp trees, then the warp results in order. Thread 0 ends with the block's
// result; every thread must call it (two barriers), and `warp_results` may be reused as soon as it returns.
__device__ __forceinline__ Partial block_reduce(Partial p, Partial* warp_results) {
  p = warp_reduce(p);
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = p;
  __syncthreads();
  Partial r = warp_results[0];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) r = combine(r, warp_results[w]);
  }
  __syncthreads();  // every read of warp_results is done
  return r;
}

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

// Reads elements [start, end) of the flat span at `base` with kWorkers threads (a block, or one warp for a small
// tile), `worker` being this thread's index among them: a scalar head up to the first 16-byte boundary, 16-byte
// vector loads (kUnroll in flight per thread), a scalar tail after the last boundary. `counter` counts each element
// read (exactly once: where it is loaded) into the histogram, when there is one.
template <class Tr, int kWorkers, bool kHistogram>
__device__ __forceinline__ Partial tile_partial(const void* base, int64_t start, int64_t end, int worker,
                                                const ExponentCounter<kHistogram>& counter) {
  using bits_t = typename Tr::bits_t;
  constexpr int64_t es = sizeof(bits_t);
  ThreadAcc<Tr> acc;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(base) + uintptr_t(start) * es;
  const uintptr_t a1 = reinterpret_cast<uintptr_t>(base) + uintptr_t(end) * es;
  uintptr_t vb = (a0 + kVecBytes - 1) & ~uintptr_t(kVecBytes - 1);
  uintptr_t ve = a1 & ~uintptr_t(kVecBytes - 1);
  if (vb > ve) vb = ve = a1;  // no whole vector inside: everything is head
  const int tid = worker;

  const int64_t n_head = int64_t(vb - a0) / es;  // < 16 / es
  if (tid < n_head) {
    const bits_t b = __ldg(reinterpret_cast<const bits_t*>(a0) + tid);
    acc.visit(b);
    counter.template count<Tr>(b);
  }

  const uint4* vp = reinterpret_cast<const uint4*>(vb);
  const int64_t n_vec = int64_t(ve - vb) / kVecBytes;
  int64_t v = tid;
  for (; v + int64_t(kUnroll - 1) * kWorkers < n_vec; v += int64_t(kUnroll) * kWorkers) {
    uint4 r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = __ldg(vp + v + int64_t(k) * kWorkers);
    acc.visit_run(r);
    counter.template count_run<Tr>(r);
  }
  for (; v < n_vec; v += kWorkers) {
    const uint4 r[1] = {__ldg(vp + v)};
    acc.visit_run(r);
    counter.template count_run<Tr>(r);
  }

  const int64_t n_tail = int64_t(a1 - ve) / es;  // < 16 / es
  if (tid < n_tail) {
    const bits_t b = __ldg(reinterpret_cast<const bits_t*>(ve) + tid);
    acc.visit(b);
    counter.template count<Tr>(b);
  }

  return {acc.sumsq, Tr::to_double(acc.amax_bits), acc.zeros, acc.nans, acc.infs};
}

__device__ __forceinline__ int64_t tiles_of(const TensorMeta& m) {
  return m.numel == 0 ? 0 : (m.numel + m.tile_elems - 1) / m.tile_elems;
}

template <int kWorkers, bool kHistogram>
__device__ __forceinline__ Partial tile_partial_of(const TensorMeta& m, int64_t t, int worker,
                                                   const ExponentCounter<kHistogram>& counter) {
  const int64_t start = (t - m.first_tile) * m.tile_elems;
  const int64_t end = start + m.tile_elems < m.numel ? start + m.tile_elems : m.numel;
  switch (m.dtype) {
    case kTagHalf: return tile_partial<HalfTraits, kWorkers>(m.ptr, start, end, worker, counter);
    case kTagBFloat16: return tile_partial<BFloat16Traits, kWorkers>(m.ptr, start, end, worker, counter);
    case kTagFloat: return tile_partial<FloatTraits, kWorkers>(m.ptr, start, end, worker, counter);
    default: return tile_partial<DoubleTraits, kWorkers>(m.ptr, start, end, worker, counter);
  }
}

__device__ __forceinline__ void store_partial(const Partial& r, int64_t t, int64_t num_tiles, double* p_sumsq,
                                              double* p_amax, int64_t* p_counts) {
  p_sumsq[t] = r.sumsq;
  p_amax[t] = r.amax;
  p_counts[t] = int64_t(r.zeros);
  p_counts[num_tiles + t] = int64_t(r.nans);
  p_counts[2 * num_tiles + t] = int64_t(r.infs);
}

// Kernel 1: one partial per tile. Partials are stored structure-of-arrays: sumsq[T], amax[T], counts[3][T].
// Tiles [0, num_block_tiles) are read by whole blocks, each block a contiguous run of them (so a block moves from
// one tensor to the next at most once per tensor boundary); the rest, each a whole tensor of at most
// kWarpTileBytes, by single warps (warp-stride over every warp of the grid), reduced with shuffles alone: a block's
// reduction and its two barriers would cost more than reading such a tile. Whole blocks and whole warps take each
// loop's trips together. The launch bounds keep the persistent grid's kBlocksPerSM blocks resident (<= 64 registers).
// kHistogram (the overload): every element is also counted into `histogram` (int64 [N, kBuckets], zeroed before the
// launch); the plain instantiation has no histogram code at all (`histogram` is unused).
template <bool kHistogram, class Src>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM) tile_stats_kernel(const __grid_constant__ Src src,
                                                              int64_t num_tiles, int64_t num_block_tiles,
                                                              double* __restrict__ p_sumsq,
                                                              double* __restrict__ p_amax,
                                                              int64_t* __restrict__ p_counts,
                                                              unsigned long long* __restrict__ histogram) {
  __shared__ Partial warp_results[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  ExponentCounter<kHistogram> counter;
  if constexpr (kHistogram) {
    uint32_t* tables = histogram_tables();
    for (int j = threadIdx.x; j < kWarps * kBuckets; j += kThreads) tables[j] = 0;
    __syncthreads();  // zeroed before any warp counts (every thread gets here: no return comes before)
    counter.table = tables + warp * kBuckets;
  }
  [[maybe_unused]] int64_t pending = 0;  // histogram: elements (whole tiles) counted since the block's last flush
  const int64_t begin = int64_t(blockIdx.x) * num_block_tiles / gridDim.x;
  const int64_t end = (int64_t(blockIdx.x) + 1) * num_block_tiles / gridDim.x;
  int32_t j = begin < end ? src.entry_of(begin, num_block_tiles) : 0;
  for (int64_t t = begin; t < end; ++t) {
    while (t >= src.at(j).first_tile + tiles_of(src.at(j))) ++j;  // the next tensor (past any empty one)
    const TensorMeta& m = src.at(j);
    const Partial r = block_reduce(tile_partial_of<kThreads>(m, t, threadIdx.x, counter), warp_results);
    if (threadIdx.x == 0) store_partial(r, t, num_tiles, p_sumsq, p_amax, p_counts);
    if constexpr (kHistogram) {
      // The tables are flushed when the block's next tile is another tensor's (or there is none), or before they
      // could overflow. Every value tested is the same for the whole block, so all its threads flush together.
      pending += m.tile_elems;
      if (t + 1 >= end || t + 1 >= m.first_tile + tiles_of(m) || pending + m.tile_elems > kHistogramFlushElems) {
        flush_block_histogram(histogram_tables(), histogram + int64_t(m.index) * kBuckets);
        pending = 0;
      }
    }
  }
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t t = num_block_tiles + int64_t(blockIdx.x) * (kThreads / 32) + warp; t < num_tiles; t += warps) {
    const TensorMeta& m = src.at(src.entry_of(t, num_block_tiles));
    const Partial p = warp_reduce(tile_partial_of<32>(m, t, lane, counter));
    if (lane == 0) store_partial(p, t, num_tiles, p_sumsq, p_amax, p_counts);
    // A warp tile is a whole tensor: its counts go to that tensor's row now. The block's flushes above have left
    // every table zeroed, with a barrier after them.
    if constexpr (kHistogram) flush_warp_histogram(counter.table, histogram + int64_t(m.index) * kBuckets, lane);
  }
}

// Kernel 2: each tensor's partials are reduced in a fixed order that depends on its tile count alone, then the NaN
// and Inf counts become the special values of sumsq/amax and the outputs are written. A tensor of at most
// kFinalizeWarpTiles tiles is reduced by one warp (lane-strided, then the warp tree); a larger one by a whole block
// (thread-strided, the warp trees, then the warp results in order), because one warp walking thousands of partials
// waits on memory latency for tens of microseconds. Block b takes tensors [b * per_block, (b + 1) * per_block):
// the small ones one per warp at once, then the large ones one after the other with every thread. per_block is
// the host's choice and never changes a result.

// This worker's share of tensor `m`'s partials: tiles worker, worker + kWorkers, ... in order.
template <int kWorkers>
__device__ __forceinline__ Partial strided_partials(const TensorMeta& m, int64_t n_tiles, int worker,
                                                    int64_t num_tiles, const double* __restrict__ p_sumsq,
                                                    const double* __restrict__ p_amax,
                                                    const int64_t* __restrict__ p_counts) {
  Partial p{0.0, 0.0, 0, 0, 0};
#pragma unroll 4
  for (int64_t k = worker; k < n_tiles; k += kWorkers) {
    const int64_t t = m.first_tile + k;
    p = combine(p, Partial{p_sumsq[t], p_amax[t], (unsigned long long)p_counts[t],
                           (unsigned long long)p_counts[num_tiles + t], (unsigned long long)p_counts[2 * num_tiles + t]});
  }
  return p;
}

// The outputs of the tensor of entry `m`. A broadcast view was read once: its sumsq and counts are multiplied by the
// repeat of its broadcast dimensions here (amax is unchanged), so it costs no launch of its own.
__device__ __forceinline__ void write_output(Partial p, const TensorMeta& m, double* __restrict__ sumsq,
                                             double* __restrict__ amax, int64_t* __restrict__ counts) {
  const int64_t i = m.index;
  if (m.repeat != 1) {
    p.sumsq *= double(m.repeat);  // NaN and inf are overridden below
    p.zeros *= (unsigned long long)m.repeat;  // <= the view's numel: no overflow
    p.nans *= (unsigned long long)m.repeat;
    p.infs *= (unsigned long long)m.repeat;
  }
  if (p.nans > 0) {
    p.sumsq = p.amax = __longlong_as_double(0x7ff8000000000000ll);  // quiet NaN
  } else if (p.infs > 0) {
    p.sumsq = p.amax = __longlong_as_double(0x7ff0000000000000ll);  // +inf
  }
  sumsq[i] = p.sumsq;
  amax[i] = p.amax;
  counts[i * kNumCounts + kZero] = int64_t(p.zeros);
  counts[i * kNumCounts + kNan] = int64_t(p.nans);
  counts[i * kNumCounts + kInf] = int64_t(p.infs);
}

// The histogram row of a broadcast view, times its repeat (after the tile kernel's adds: the same stream).
template <int kWorkers>
__device__ __forceinline__ void scale_histogram_row(unsigned long long* histogram, const TensorMeta& m, int worker) {
  if (histogram == nullptr || m.repeat == 1) return;
  unsigned long long* row = histogram + int64_t(m.index) * kBuckets;
  for (int b = worker; b < kBuckets; b += kWorkers) row[b] *= (unsigned long long)m.repeat;
}

template <class Src>
__global__ void __launch_bounds__(kThreads) finalize_kernel(const __grid_constant__ Src src, int64_t num_tensors,
                                                            int64_t per_block, int64_t num_tiles,
                                                            const double* __restrict__ p_sumsq,
                                                            const double* __restrict__ p_amax,
                                                            const int64_t* __restrict__ p_counts,
                                                            double* __restrict__ sumsq, double* __restrict__ amax,
                                                            int64_t* __restrict__ counts,
                                                            unsigned long long* __restrict__ histogram) {
  __shared__ Partial warp_results[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t first = int64_t(blockIdx.x) * per_block;
  const int64_t last = first + per_block < num_tensors ? first + per_block : num_tensors;
  bool large = false;
  if (warp < last - first) {  // small tensors: one warp each
    const TensorMeta m = src.at(first + warp);
    const int64_t n_tiles = tiles_of(m);
    large = n_tiles > kFinalizeWarpTiles;
    if (!large) {
      const Partial p = warp_reduce(strided_partials<32>(m, n_tiles, lane, num_tiles, p_sumsq, p_amax, p_counts));
      if (lane == 0) write_output(p, m, sumsq, amax, counts);
      scale_histogram_row<32>(histogram, m, lane);
    }
  }
  // A block without a large tensor (every block of a list of small ones) is done: the walk below would read each of
  // its tensors' metadata again, one dependent load after the other, to find none.
  if (!__syncthreads_or(large)) return;
  for (int64_t i = first; i < last; ++i) {  // large tensors: the whole block (the test is the same for every thread)
    const TensorMeta m = src.at(i);
    const int64_t n_tiles = tiles_of(m);
    if (n_tiles <= kFinalizeWarpTiles) continue;
    const Partial r = block_reduce(
        strided_partials<kThreads>(m, n_tiles, threadIdx.x, num_tiles, p_sumsq, p_amax, p_counts), warp_results);
    if (threadIdx.x == 0) write_output(r, m, sumsq, amax, counts);
    scale_histogram_row<kThreads>(histogram, m, threadIdx.x);
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Host side.

int32_t dtype_tag(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kTagHalf;
    case at::kBFloat16: return kTagBFloat16;
    case at::kFloat: return kTagFloat;
    default: return kTagDouble;  // check_inputs admits nothing else
  }
}

// A non-empty tensor of at most kWarpTileBytes: one tile (kTileBytes is larger), read by one warp.
bool is_warp_tile(int64_t numel, int64_t es) {
  return numel > 0 && numel * es <= kWarpTileBytes;
}

int sm_count(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() <= size_t(device)) cache.resize(size_t(device) + 1, 0);
  if (cache[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

// ----------------------------------------------------------------------------------------------------------------
// Metadata upload by kernel parameters.
//
// The metadata buffer is [TensorMeta x N][int32 tile -> tensor x T]. It is written by `fill_metadata_kernel`, whose
// parameters carry up to K TensorMeta entries: the launch copies them (a captured launch copies them into the
// graph's kernel node), so no host buffer has to outlive the call, pinned or not, and no memcpy is involved. The
// tile table is expanded on the device from the entries (it is far larger than them for big tensors).
template <int K>
struct FillArgs {
  TensorMeta* meta_out;      // TensorMeta[N]
  int32_t* tile_tensor_out;  // int32[T]
  int32_t first;             // index in the whole list of m[0]
  int32_t count;             // entries of m in use
  TensorMeta m[K];
};
// 4 KB of kernel parameters everywhere; 32 KB (32,764 bytes) with CUDA 12.1+ at build time and run time.
constexpr int kFillSmall = 80;
static_assert(sizeof(FillArgs<kFillSmall>) <= 4096, "kernel parameters are limited to 4 KB before CUDA 12.1");
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
#define TORCH_GRADSTATS_LARGE_PARAMS 1
constexpr int kFillLarge = 680;
static_assert(sizeof(FillArgs<kFillLarge>) <= 32764, "kernel parameters are limited to 32,764 bytes");
#endif
constexpr int kFillThreads = 128;

// One block per tensor: thread 0 writes its TensorMeta, all threads write its range of the tile table.
// __grid_constant__: the parameters are read in place (no per-thread copy of up to 32 KB).
template <int K>
__global__ void __launch_bounds__(kFillThreads) fill_metadata_kernel(const __grid_constant__ FillArgs<K> args) {
  const int j = blockIdx.x;
  if (j >= args.count) return;
  const TensorMeta& m = args.m[j];
  const int32_t index = args.first + j;
  if (threadIdx.x == 0) args.meta_out[index] = m;
  const int64_t n_tiles = m.numel == 0 ? 0 : (m.numel + m.tile_elems - 1) / m.tile_elems;
  for (int64_t k = threadIdx.x; k < n_tiles; k += kFillThreads) args.tile_tensor_out[m.first_tile + k] = index;
}

template <int K>
int64_t launch_fill(const TensorMeta* host_meta, int64_t n, TensorMeta* meta_out, int32_t* tile_tensor_out,
                    cudaStream_t stream) {
  // Up to 32 KB: off the stack, this call's; reusable as soon as a launch returns (it copied them).
  const auto buf = std::make_unique<FillArgs<K>>();
  FillArgs<K>& a = *buf;
  a.meta_out = meta_out;
  a.tile_tensor_out = tile_tensor_out;
  int64_t launches = 0;
  for (int64_t first = 0; first < n; first += K) {
    const int count = int(std::min<int64_t>(K, n - first));
    a.first = int32_t(first);
    a.count = count;
    std::memcpy(a.m, host_meta + first, size_t(count) * sizeof(TensorMeta));
    fill_metadata_kernel<K><<<unsigned(count), kFillThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ++launches;
  }
  return launches;
}

bool driver_takes_large_params() {
#ifdef TORCH_GRADSTATS_LARGE_PARAMS
  static const bool large = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12010;
  }();
  return large;
#else
  return false;
#endif
}

// Writes the metadata of `n` tensors to `meta_out` (and the tile table after it) on `stream`; returns the number
// of launches.
int64_t fill_metadata(const TensorMeta* host_meta, int64_t n, uint8_t* out, cudaStream_t stream) {
  auto* meta_out = reinterpret_cast<TensorMeta*>(out);
  auto* tile_out = reinterpret_cast<int32_t*>(out + size_t(n) * sizeof(TensorMeta));
#ifdef TORCH_GRADSTATS_LARGE_PARAMS
  if (n > kFillSmall && driver_takes_large_params()) {
    return launch_fill<kFillLarge>(host_meta, n, meta_out, tile_out, stream);
  }
#endif
  return launch_fill<kFillSmall>(host_meta, n, meta_out, tile_out, stream);
}

// Lists of at most this many tensors pass their metadata as kernel parameters (MetaInline): 4 KB of them everywhere,
// 32 KB with CUDA 12.1+ at build time and run time. Both kernels' other parameters fit in the rest.
constexpr int kInlineSmall = 80;
static_assert(sizeof(MetaInline<kInlineSmall>) + 96 <= 4096, "kernel parameters are limited to 4 KB");
#ifdef TORCH_GRADSTATS_LARGE_PARAMS
constexpr int kInlineLarge = 680;
static_assert(sizeof(MetaInline<kInlineLarge>) + 96 <= 32764, "kernel parameters are limited to 32,764 bytes");
#endif

size_t inline_items() {
#ifdef TORCH_GRADSTATS_LARGE_PARAMS
  if (driver_takes_large_params()) return kInlineLarge;
#endif
  return kInlineSmall;
}

size_t metadata_bytes(int64_t n, int64_t num_tiles) {
  return size_t(n) * sizeof(TensorMeta) + size_t(num_tiles) * sizeof(int32_t);
}

// ----------------------------------------------------------------------------------------------------------------
// The metadata cache (eager calls), and the buffers it makes for graphs being captured.
//
// Rules it relies on (docs/cuda.md, "Metadata and CUDA graphs"):
//  1. Nothing it keeps comes from PyTorch's caching allocator: cudagraph trees route every allocation of the thread
//     that runs their warm-up and recording to their private pool, and a block kept there is one they do not track.
//     Its memory comes from a CUDA memory pool of its own per device (cudaMemPoolCreate), allocated and freed
//     stream-ordered (cudaMallocFromPoolAsync / cudaFreeAsync) on streams that are never captured: the caller's when
//     it is not capturing, the cache's own upload and free streams otherwise.
//  2. A capturing stream never reads it: the graph gets a buffer of its own (for_capture), or the caller takes the
//     per-call path, whose buffer and parameters belong to the graph. So no graph ever depends on an entry.
//  3. The bookkeeping (metadata_cache.h, tested on the CPU): an entry is pinned from its lookup until the kernels
//     that read it are enqueued, and only unpinned entries are evicted. When a lease ends, the reader records an
//     event on its own stream and the cache's free stream waits on it; an evicted entry's free is enqueued on the
//     free stream, so it follows every read. No other thread's stream is ever queried or recorded on, no stream
//     handle is kept past the call, and nothing is launched under the cache's lock.
//  4. Calls to CUDA that could invalidate another thread's capture in cudaStreamCaptureModeGlobal (allocation,
//     event and stream creation) are made under cudaStreamCaptureModeRelaxed for this thread.
//  5. Capacity is per device: 16 entries each, under a lock of their own.

// Switches this thread to the relaxed capture mode; noexcept, for the paths that must not throw.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept {
    ok_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
    if (!ok_) (void)cudaGetLastError();
  }
  ~RelaxedCaptureMode() {
    if (ok_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool ok_ = false;
};

// The device side of the cache's bookkeeping (the policy of metadata_cache.h), one per device. Called without the
// cache's lock, under the caller's CUDAGuard for this device, with the caller's stream (not capturing when the call
// began) and only during that call.
struct CudaCachePolicy {
  using Stream = cudaStream_t;
  using Item = TensorMeta;
  using Ready = cudaEvent_t;

  cudaMemPool_t pool = nullptr;
  cudaStream_t free_stream = nullptr;  // frees wait here on the readers' markers, never on the callers' streams
  cudaEvent_t last_read = nullptr;     // re-recorded by each reader (a wait takes the event's state at the call)
  std::unique_ptr<std::mutex> last_read_mu = std::make_unique<std::mutex>();  // one record-and-wait at a time
  std::atomic<int64_t>* fill_launches = nullptr;

  size_t inline_items() const { return torch_gradstats::inline_items(); }
  void* allocate(size_t bytes, cudaStream_t stream) {
    const RelaxedCaptureMode relaxed;
    void* ptr = nullptr;
    const cudaError_t err = cudaMallocFromPoolAsync(&ptr, bytes, pool, stream);
    if (err == cudaErrorMemoryAllocation) {
      // The GPU is full, possibly of blocks PyTorch's caching allocator keeps free: take the per-call path, whose
      // allocation that allocator can serve (or free its cache for and retry).
      (void)cudaGetLastError();
      return nullptr;
    }
    C10_CUDA_CHECK(err);
    return ptr;
  }
  void fill(void* data, const TensorMeta* items, size_t n, cudaStream_t stream) {
    fill_launches->fetch_add(fill_metadata(items, int64_t(n), static_cast<uint8_t*>(data), stream),
                             std::memory_order_relaxed);
  }
  cudaEvent_t fill_done(cudaStream_t stream) {
    const RelaxedCaptureMode relaxed;
    cudaEvent_t ready = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    const cudaError_t err = cudaEventRecord(ready, stream);
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(ready);
      C10_CUDA_CHECK(err);
    }
    return ready;
  }
  // After a miss's fill: another thread may have begun a capture on this stream since the call's check, and then
  // the allocation, fill and event may be in it (never run eagerly). True also when the query fails.
  bool capturing(cudaStream_t stream) noexcept {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) == cudaSuccess) return status != cudaStreamCaptureStatusNone;
    (void)cudaGetLastError();
    return true;
  }
  bool fill_complete(cudaEvent_t ready) {
    const RelaxedCaptureMode relaxed;
    if (cudaEventQuery(ready) == cudaSuccess) return true;
    (void)cudaGetLastError();  // cudaErrorNotReady
    return false;
  }
  void wait(cudaEvent_t ready, cudaStream_t stream) { C10_CUDA_CHECK(cudaStreamWaitEvent(stream, ready, 0)); }
  void drop(cudaEvent_t& ready) noexcept {
    if (ready != nullptr) (void)cudaEventDestroy(ready);  // legal while pending: released when it completes
    ready = nullptr;
  }
  // The reader's marker, on its own stream right after its kernels: it covers them. Then the capture query: a
  // capture that another thread began on this stream meanwhile may hold the marker, and the free stream must not
  // wait on it (it would join that capture): false, and the entry is never freed.
  bool end_read(cudaStream_t stream) noexcept {
    try {
      std::lock_guard<std::mutex> lock(*last_read_mu);
      if (cudaEventRecord(last_read, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(stream, &status) != cudaSuccess || status != cudaStreamCaptureStatusNone ||
          cudaStreamWaitEvent(free_stream, last_read, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
      return true;
    } catch (...) {  // the lock
      return false;
    }
  }
  bool release(void* data, size_t) noexcept {
    const RelaxedCaptureMode relaxed;
    if (cudaFreeAsync(data, free_stream) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  // A failed miss: after whatever of its fill was enqueued on `stream`.
  void release_on(void* data, size_t, cudaStream_t stream) noexcept {
    const RelaxedCaptureMode relaxed;
    if (cudaFreeAsync(data, stream) != cudaSuccess) (void)cudaGetLastError();
  }
};

using EntryCache = metadata_cache::Cache<CudaCachePolicy>;
using MetadataLease = EntryCache::Lease;

class MetadataCache {
 public:
  MetadataCache() : num_devices_(size_t(c10::cuda::device_count())), devices_(new DeviceState[num_devices_]) {}

  // The pinned entry for `meta` (hash `hash`) on `device`, filled on `stream` if missing; empty when it cannot be
  // cached (no CUDA memory pools on this device, not admitted, no memory left for it, being filled by another call,
  // or `stream` found capturing after its fill), in which case the caller takes the per-call path. `stream` was not
  // capturing at the call's check.
  MetadataLease get(const std::vector<TensorMeta>& meta, uint64_t hash, int64_t num_tiles, c10::DeviceIndex device,
                    cudaStream_t stream) {
    if (released_.load(std::memory_order_relaxed) != nullptr) free_released_graph_buffers();  // one load per call
    DeviceState& ds = device_state(device);
    if (!ds.cache) return MetadataLease();
    return ds.cache->get(meta.data(), meta.size(), hash, metadata_bytes(int64_t(meta.size()), num_tiles), stream);
  }

  // Device pointer of the metadata for `meta`, for the graph that `capturing` is being captured into: written now,
  // on the cache's upload stream, and waited for, so it is complete before the graph can run; owned by the graph
  // through a CUDA user object, whose destructor hands it back once the graph and every executable made from it are
  // destroyed and their last launch has completed. Replays then read it as it is: no fill kernels in the graph.
  // nullptr (the caller takes the per-call path) without CUDA memory pools, without memory for it, or when the
  // capture has no graph to attach it to, or is no longer the same capture after the wait.
  const uint8_t* for_capture(const std::vector<TensorMeta>& meta, int64_t num_tiles, c10::DeviceIndex device,
                             cudaStream_t capturing) {
    // Relaxed: this thread may allocate, wait for a stream of its own and create objects during its capture.
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    unsigned long long capture_id = 0;
    if (capture_graph(capturing, &capture_id) == nullptr) return nullptr;
    DeviceState& ds = device_state(device);
    if (!ds.cache) return nullptr;
    free_released_graph_buffers();
    auto owned = std::make_unique<GraphBuffer>();  // before the allocation: nothing to undo if this throws
    owned->cache = this;
    owned->device = device;
    owned->bytes = metadata_bytes(int64_t(meta.size()), num_tiles);
    const cudaError_t alloc = cudaMallocFromPoolAsync(&owned->data, owned->bytes, ds.pool, ds.upload_stream);
    if (alloc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    C10_CUDA_CHECK(alloc);
    graph_buffers_.fetch_add(1, std::memory_order_relaxed);  // from here every path frees it or hands it to CUDA
    graph_buffer_bytes_.fetch_add(int64_t(owned->bytes), std::memory_order_relaxed);
    // Frees the buffer on every exit before the user object owns it (an error, or the capture gone meanwhile).
    struct Unwind {
      MetadataCache* cache;
      std::unique_ptr<GraphBuffer>& owned;
      cudaStream_t upload;
      ~Unwind() {
        if (!owned) return;
        (void)cudaStreamSynchronize(upload);  // no fill may still be writing the buffer when it is freed
        (void)cudaGetLastError();
        cache->free_or_keep(owned.release());
      }
    } unwind{this, owned, ds.upload_stream};
    fill_launches_.fetch_add(fill_metadata(meta.data(), int64_t(meta.size()), static_cast<uint8_t*>(owned->data),
                                           ds.upload_stream),
                             std::memory_order_relaxed);
    // The upload stream is the cache's own and is never captured, so waiting for it cannot wait on a capture. No
    // lock is held meanwhile: other threads' calls go on.
    C10_CUDA_CHECK(cudaStreamSynchronize(ds.upload_stream));  // written before the graph exists, let alone runs
    // The capture may have ended (or been invalidated by another thread) during the wait: ask again, and attach
    // only to the same capture's graph.
    unsigned long long id_now = 0;
    cudaGraph_t graph = capture_graph(capturing, &id_now);
    if (graph == nullptr || id_now != capture_id) return nullptr;
    cudaUserObject_t object = nullptr;
    C10_CUDA_CHECK(cudaUserObjectCreate(&object, owned.get(), &GraphBuffer::release, 1,
                                        cudaUserObjectNoDestructorSync));
    const uint8_t* data = static_cast<const uint8_t*>(owned->data);
    (void)owned.release();  // the user object owns it: its destructor queues it for the next call to free
    if (cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove) != cudaSuccess) {
      (void)cudaGetLastError();
      C10_CUDA_CHECK(cudaUserObjectRelease(object, 1));  // the destructor queues the buffer to be freed
      return nullptr;
    }
    captured_calls_.fetch_add(1, std::memory_order_relaxed);
    return data;
  }

  void count_per_call(bool capturing, int64_t launches) {
    captured_calls_.fetch_add(capturing ? 1 : 0, std::memory_order_relaxed);
    fill_launches_.fetch_add(launches, std::memory_order_relaxed);
  }

  // For tests and debugging: [entries of `device`, bytes they hold, its retired entries, calls
  // made while capturing, fill launches so far, bytes reserved by the memory pool of `device`, metadata buffers
  // owned by CUDA graphs and not yet freed, the bytes they hold, pinned entries of `device`, entries per device,
  // the longest list whose metadata is passed as kernel parameters (never cached)]. "Retired": entries kept because
  // a reader could not order their free, and frees waiting for a retry.
  // The counts of calls, launches and graph buffers cover every device. Buffers of graphs destroyed by now are
  // freed first.
  std::vector<int64_t> info(c10::DeviceIndex device) {
    free_released_graph_buffers();
    EntryCache::Info entries{0, 0, 0, 0};
    int64_t reserved = 0;
    if (size_t(device) < num_devices_ && devices_[device].initialized.load(std::memory_order_acquire) &&
        devices_[device].cache) {
      DeviceState& ds = devices_[device];
      entries = ds.cache->info();
      uint64_t value = 0;
      C10_CUDA_CHECK(cudaMemPoolGetAttribute(ds.pool, cudaMemPoolAttrReservedMemCurrent, &value));
      reserved = int64_t(value);
    }
    return {entries.entries, entries.bytes, entries.retired, captured_calls_.load(), fill_launches_.load(),
            reserved, graph_buffers_.load(), graph_buffer_bytes_.load(), entries.pinned,
            int64_t(EntryCache::kCapacity), int64_t(inline_items())};
  }

 private:
  struct DeviceState {
    std::mutex init_mu;
    std::atomic<bool> initialized{false};
    cudaMemPool_t pool = nullptr;
    cudaStream_t upload_stream = nullptr;  // writes the buffers of graphs being captured; never part of a capture
    cudaStream_t free_stream = nullptr;
    std::unique_ptr<EntryCache> cache;     // null without CUDA memory pools
  };

  // The metadata of one captured call, owned by its graph through a CUDA user object. CUDA runs the destructor on an
  // internal thread, where no CUDA call is allowed, once the graph and every executable made from it are destroyed
  // and their last launch has completed: it only pushes the buffer on a lock-free list (no lock, no allocation:
  // it cannot throw), which the next call of the op frees.
  struct GraphBuffer {
    MetadataCache* cache = nullptr;
    c10::DeviceIndex device = 0;
    void* data = nullptr;
    size_t bytes = 0;
    GraphBuffer* next = nullptr;

    static void CUDART_CB release(void* self) noexcept {
      auto* buffer = static_cast<GraphBuffer*>(self);
      std::atomic<GraphBuffer*>& head = buffer->cache->released_;
      GraphBuffer* old = head.load(std::memory_order_relaxed);
      do {
        buffer->next = old;
      } while (!head.compare_exchange_weak(old, buffer, std::memory_order_release, std::memory_order_relaxed));
    }
  };

  // The graph `stream` is being captured into (and the capture's id), or nullptr when it is not capturing.
  static cudaGraph_t capture_graph(cudaStream_t stream, unsigned long long* id) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
#if CUDART_VERSION >= 12000
    const cudaError_t query = cudaStreamGetCaptureInfo(stream, &status, id, &graph);
#else
    const cudaError_t query = cudaStreamGetCaptureInfo_v2(stream, &status, id, &graph);
#endif
    if (query != cudaSuccess || status != cudaStreamCaptureStatusActive) {
      (void)cudaGetLastError();  // the error this query left, so that no later launch check reports it
      return nullptr;
    }
    return graph;
  }

  // Once nothing can read the buffer any more; in relaxed capture mode. The buffer is deleted (and no longer
  // counted) only once its free is enqueued; when that fails it goes back on the list for a later call to retry,
  // with a warning the first time: the error is not the current call's, so it does not fail it.
  void free_or_keep(GraphBuffer* buffer) noexcept {
    cudaError_t err = cudaErrorUnknown;
    try {
      const c10::cuda::CUDAGuard on_buffer_device(buffer->device);
      err = cudaFreeAsync(buffer->data, devices_[buffer->device].free_stream);
    } catch (...) {  // the device switch
    }
    if (err == cudaSuccess) {
      graph_buffers_.fetch_sub(1, std::memory_order_relaxed);
      graph_buffer_bytes_.fetch_sub(int64_t(buffer->bytes), std::memory_order_relaxed);
      delete buffer;
      return;
    }
    (void)cudaGetLastError();
    GraphBuffer::release(buffer);
    try {
      TORCH_WARN_ONCE("multi_tensor_stats: freeing the metadata buffer of a destroyed CUDA graph failed (",
                      cudaGetErrorString(err), "); it is kept and retried by later calls");
    } catch (...) {  // a warning turned into an error
    }
  }

  // Frees the buffers of destroyed graphs. Their last launch has completed (CUDA releases a graph's references only
  // then), so nothing can read them any more.
  void free_released_graph_buffers() noexcept {
    GraphBuffer* list = released_.exchange(nullptr, std::memory_order_acquire);
    if (list == nullptr) return;
    const RelaxedCaptureMode relaxed;
    while (list != nullptr) {
      GraphBuffer* next = list->next;
      free_or_keep(list);  // one that fails goes back on released_, not on this list: no retry loop here
      list = next;
    }
  }

  // Created once per device, on its first use, and never destroyed (no CUDA calls during static destruction).
  DeviceState& device_state(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && size_t(device) < num_devices_, "multi_tensor_stats: no CUDA device ", int(device));
    DeviceState& ds = devices_[device];
    if (ds.initialized.load(std::memory_order_acquire)) return ds;
    std::lock_guard<std::mutex> lock(ds.init_mu);
    if (ds.initialized.load(std::memory_order_relaxed)) return ds;
    const RelaxedCaptureMode relaxed;
    const c10::cuda::CUDAGuard on_device(device);
    int supported = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    if (supported) {
      cudaMemPoolProps props = {};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      C10_CUDA_CHECK(cudaMemPoolCreate(&ds.pool, &props));
      // Reuse freed memory only once its free has completed (or by event dependencies), never by making an
      // allocating stream wait on the cache's free stream (which waits on other streams' work).
      int no = 0;
      C10_CUDA_CHECK(cudaMemPoolSetAttribute(ds.pool, cudaMemPoolReuseAllowInternalDependencies, &no));
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&ds.free_stream, cudaStreamNonBlocking));
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&ds.upload_stream, cudaStreamNonBlocking));
      CudaCachePolicy policy;
      policy.pool = ds.pool;
      policy.free_stream = ds.free_stream;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&policy.last_read, cudaEventDisableTiming));
      policy.fill_launches = &fill_launches_;
      ds.cache = std::make_unique<EntryCache>(std::move(policy));
    }
    ds.initialized.store(true, std::memory_order_release);
    return ds;
  }

  const size_t num_devices_;
  std::unique_ptr<DeviceState[]> devices_;
  std::atomic<GraphBuffer*> released_{nullptr};  // buffers of destroyed graphs, to be freed
  std::atomic<int64_t> captured_calls_{0};
  std::atomic<int64_t> fill_launches_{0};
  std::atomic<int64_t> graph_buffers_{0};      // GraphBuffers created and not yet freed
  std::atomic<int64_t> graph_buffer_bytes_{0};  // the bytes they hold
};

MetadataCache& metadata_cache() {
  static auto* cache = new MetadataCache();  // leaked on purpose: no CUDA calls during static destruction
  return *cache;
}

// Tile size of a tensor: 64 KB, or larger so that no tensor has more than kMaxTilesPerTensor tiles.
int64_t tile_elems_for(int64_t numel, int64_t es) {
  const int64_t vec_elems = kVecBytes / es;
  int64_t tile_elems = kTileBytes / es;
  const int64_t needed = (numel + kMaxTilesPerTensor - 1) / kMaxTilesPerTensor;
  if (needed > tile_elems) tile_elems = (needed + vec_elems - 1) / vec_elems * vec_elems;
  return tile_elems;
}

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

// Launches the two kernels over metadata `src` (the partials workspace and outputs given).
struct LaunchArgs {
  int64_t n, num_tiles, num_block_tiles, num_warp_tiles;
  double* p_sumsq;
  double* p_amax;
  int64_t* p_counts;
  Stats* out;
  unsigned long long* histogram;
  c10::DeviceIndex device;
  cudaStream_t stream;
};

template <class Src>
void launch_stats(const Src& src, const LaunchArgs& a) {
  if (a.num_tiles > 0) {
    const int64_t work = a.num_block_tiles + (a.num_warp_tiles + kThreads / 32 - 1) / (kThreads / 32);  // in blocks
    const int64_t grid = std::min<int64_t>(work, int64_t(sm_count(a.device)) * kBlocksPerSM);
    if (a.histogram != nullptr) {
      tile_stats_kernel<true, Src><<<unsigned(grid), kThreads, 0, a.stream>>>(
          src, a.num_tiles, a.num_block_tiles, a.p_sumsq, a.p_amax, a.p_counts, a.histogram);
    } else {
      tile_stats_kernel<false, Src><<<unsigned(grid), kThreads, 0, a.stream>>>(
          src, a.num_tiles, a.num_block_tiles, a.p_sumsq, a.p_amax, a.p_counts, nullptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // Short lists: a block per tensor, so the large tensors are reduced side by side; long ones: a warp per tensor.
  const int64_t per_block = a.n <= kFinalizeOnePerBlock ? 1 : kWarpsPerFinalizeBlock;
  const int64_t finalize_grid = (a.n + per_block - 1) / per_block;
  finalize_kernel<Src><<<unsigned(finalize_grid), kThreads, 0, a.stream>>>(
      src, a.n, per_block, a.num_tiles, a.p_sumsq, a.p_amax, a.p_counts, std::get<0>(*a.out).data_ptr<double>(),
      std::get<1>(*a.out).data_ptr<double>(), std::get<2>(*a.out).data_ptr<int64_t>(), a.histogram);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int K>
void launch_inline(const std::vector<TensorMeta>& meta, int32_t num_block, const LaunchArgs& a) {
  const auto src = std::make_unique<MetaInline<K>>();  // up to 32 KB: off the stack; the launch copies it
  src->count = int32_t(meta.size());
  src->num_block = num_block;
  std::memcpy(src->m, meta.data(), meta.size() * sizeof(TensorMeta));
  launch_stats(*src, a);
}

// With `histogram` non-null (the overload) it also allocates *histogram and fills it, in the same read.
Stats multi_tensor_stats_cuda(const TensorRefs& tensors, at::Tensor* histogram) {
  check_inputs(tensors);
  const at::Device device = tensors[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "multi_tensor_stats: the CUDA kernel got tensors on ", device);
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  const int64_t n = int64_t(tensors.size());
  TORCH_CHECK_VALUE(n < std::numeric_limits<int32_t>::max(), "multi_tensor_stats: too many tensors (", n, ")");

  // Dense tensors (contiguous or permuted) are read in place as the flat span of their storage; others as
  // NonDenseInputs says (multi_tensor_stats.h); a broadcast view's repeat goes into its entry, for the finalize
  // kernel. `dense_copies` keeps views and copies alive until both kernels are enqueued, after which the caching
  // allocator (stream-ordered) may recycle them safely.
  NonDenseInputs dense_copies;
  // This call's staging, in tile order (TensorMeta): block-read tensors from the front, warp-read ones from the
  // back (reversed into list order below). A re-entered op (an OOM observer) has its own.
  std::vector<TensorMeta> host_meta(static_cast<size_t>(n));
  uint64_t hash = uint64_t(n);
  int64_t num_block = 0, num_warp = 0, num_block_tiles = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* t = &tensors[i];
    int64_t repeat = 1;
    if (!t->is_non_overlapping_and_dense()) {
      t = &dense_copies.read(*t, size_t(i));
      const auto& repeats = dense_copies.repeats();
      if (!repeats.empty() && repeats.back().first == i) repeat = repeats.back().second;
    }
    const int64_t numel = t->numel();
    const int64_t es = int64_t(t->element_size());
    TORCH_CHECK_VALUE(numel <= kMaxNumel, "multi_tensor_stats: tensors[", i, "] has ", numel,
                      " elements; at most 2^50 are supported");
    const void* ptr = numel == 0 ? nullptr : t->const_data_ptr();
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(ptr) % uintptr_t(es) == 0, "multi_tensor_stats: tensors[", i,
                      "] has a data pointer that is not aligned to its element size");
    TORCH_CHECK_VALUE(histogram == nullptr || numel <= kMaxHistogramNumel, "multi_tensor_stats.histogram: tensors[",
                      i, "] has ", numel, " elements; at most 2^46 are supported on CUDA");
    const int64_t tile_elems = tile_elems_for(numel, es);
    const int32_t tag = dtype_tag(t->scalar_type());
    const TensorMeta m{ptr, numel, tile_elems, 0, repeat, tag, int32_t(i)};
    if (is_warp_tile(numel, es)) {
      host_meta[size_t(n - 1 - num_warp++)] = m;  // first_tile set below
    } else {
      host_meta[size_t(num_block++)] = m;
      host_meta[size_t(num_block - 1)].first_tile = num_block_tiles;
      num_block_tiles += numel == 0 ? 0 : (numel + tile_elems - 1) / tile_elems;
    }
    hash = mix(mix(mix(mix(hash, reinterpret_cast<uintptr_t>(ptr)), uint64_t(numel)), uint64_t(tag)),
               uint64_t(repeat));
  }
  std::reverse(host_meta.begin() + num_block, host_meta.end());
  for (int64_t j = num_block; j < n; ++j) host_meta[size_t(j)].first_tile = num_block_tiles + (j - num_block);
  const int64_t num_warp_tiles = num_warp;
  const int64_t num_tiles = num_block_tiles + num_warp_tiles;
  TORCH_CHECK_VALUE(num_tiles < std::numeric_limits<int32_t>::max(), "multi_tensor_stats: too many tiles (",
                    num_tiles, ")");

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  MetadataCache& cache = metadata_cache();
  // Short lists: the metadata rides in the kernel parameters, eager or captured (metadata_cache.h's rule).
  const bool in_params = size_t(n) <= inline_items();

  // Partials workspace, structure of arrays: sumsq[T], amax[T], counts[3][T] (5 x 8 bytes per tile). Like the
  // outputs it comes from the caching allocator; unlike them it dies at the end of the call.
  const size_t workspace_bytes = size_t(num_tiles) * 5 * sizeof(double);
  const auto byte_options = at::TensorOptions().dtype(at::kByte).device(device);
  at::Tensor scratch;
  // An eager call's entry stays pinned (never evicted, never freed) until both kernels that read it are enqueued.
  MetadataLease lease;
  const uint8_t* d_metadata = nullptr;
  if (!in_params) {
    if (capturing) {
      d_metadata = cache.for_capture(host_meta, num_tiles, device.index(), stream.stream());
    } else {
      lease = cache.get(host_meta, hash, num_tiles, device.index(), stream.stream());
      d_metadata = static_cast<const uint8_t*>(lease.data());
    }
  }
  if (in_params) cache.count_per_call(capturing, 0);  // (the captured-call count covers every path)
  if (in_params || d_metadata != nullptr) {
    if (workspace_bytes > 0) scratch = at::empty({int64_t(workspace_bytes)}, byte_options);
  } else {
    // Per call (when neither the cache nor a graph-owned buffer can hold it): the metadata sits after the
    // workspace in one temporary and is written by fill kernels on this stream; a captured graph owns both (its
    // pool holds the buffer, its nodes the parameters), and they are rewritten by every replay.
    const size_t bytes = workspace_bytes + metadata_bytes(n, num_tiles);
    scratch = at::empty({int64_t(bytes)}, byte_options);
    uint8_t* md = static_cast<uint8_t*>(scratch.data_ptr()) + workspace_bytes;
    const int64_t launches = fill_metadata(host_meta.data(), n, md, stream.stream());
    cache.count_per_call(capturing, launches);
    d_metadata = md;
  }

  Stats out = empty_stats(n, device);
  LaunchArgs args{n, num_tiles, num_block_tiles, num_warp_tiles, nullptr, nullptr, nullptr, &out, nullptr,
                  device.index(), stream.stream()};
  if (histogram != nullptr) {
    *histogram = zero_histogram(n, device);  // on this stream, before the kernel adds into it
    args.histogram = reinterpret_cast<unsigned long long*>(histogram->data_ptr<int64_t>());
  }
  if (num_tiles > 0) {
    args.p_sumsq = reinterpret_cast<double*>(scratch.data_ptr());
    args.p_amax = args.p_sumsq + num_tiles;
    args.p_counts = reinterpret_cast<int64_t*>(args.p_amax + num_tiles);
  }
  if (in_params) {
    if (n <= kInlineSmall) {
      launch_inline<kInlineSmall>(host_meta, int32_t(num_block), args);
    } else {
#ifdef TORCH_GRADSTATS_LARGE_PARAMS
      launch_inline<kInlineLarge>(host_meta, int32_t(num_block), args);
#endif
    }
  } else {
    const auto* meta = reinterpret_cast<const TensorMeta*>(d_metadata);
    const auto* tile_entry = reinterpret_cast<const int32_t*>(d_metadata + size_t(n) * sizeof(TensorMeta));
    launch_stats(MetaInMemory{meta, tile_entry}, args);
  }
  lease.reset();  // both reads are enqueued: this stream's marker, then the entry may be evicted
  return out;
}

// Debug query (tests): the metadata cache's state for the current device; see MetadataCache::info.
std::vector<int64_t> metadata_cache_info() {
  return metadata_cache().info(c10::cuda::current_device());
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_gradstats, CUDA, m) {
  m.impl("multi_tensor_stats", torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<&multi_tensor_stats_cuda, false>>());
  m.impl("multi_tensor_stats.histogram",
         torch::CppFunction::makeFromBoxedFunction<&boxed_kernel<&multi_tensor_stats_cuda, true>>());
  set_cuda_kernel(&multi_tensor_stats_cuda);  // and for the eager entry point that skips the dispatcher
}

// A second op of the namespace, defined here because only the CUDA build has the cache it reports on.
TORCH_LIBRARY_FRAGMENT(torch_gradstats, m) {
  m.def("_cuda_metadata_cache_info() -> int[]", &metadata_cache_info);
}

}  // namespace torch_gradstats
