// The two kernels of the op: the per-dtype bit patterns, what one thread accumulates, the fixed-order reductions,
// the reading of a tile, then tile_stats_kernel and finalize_kernel (the order of the steps: multi_tensor_stats.cu).
// Part of multi_tensor_stats.cu and included by it alone: one translation unit, so everything here keeps the
// internal linkage of the anonymous namespace.
#pragma once

#include "exponent_histogram.cuh"
#include "multi_tensor_stats.h"
#include "packed16.h"
#include "tensor_meta.cuh"

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace torch_gradstats {
namespace {

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
// Reading a tile, and the two kernels.

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

}  // namespace
}  // namespace torch_gradstats
