// What both kernels read about each tensor (TensorMeta), from device memory or from their kernel parameters,
// and the tuning constants that fix the reduction order.
// Part of multi_tensor_stats.cu and included by it alone: one translation unit, so everything here keeps the
// internal linkage of the anonymous namespace.
#pragma once

#include <cstdint>

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

}  // namespace
}  // namespace torch_gradstats
