// The fused CUDA kernel of torch_gradstats::multi_tensor_stats (contract: DESIGN.md; design notes: docs/cuda.md).
//
// Two launches for any number of tensors, deterministic, no host sync:
//  1. `tile_stats_kernel`: a persistent grid (sized from the SM count) walks a flattened list of tiles; a tile is a
//     contiguous span of one tensor. Every element is read once with 16-byte loads (scalar head/tail only at
//     unaligned tile edges); one block reduces a tile in a fixed order and writes that tile's partial.
//  2. `finalize_kernel`: one warp per tensor reduces that tensor's partials in a fixed order, turns the NaN/Inf
//     counts into the special values of sumsq/amax and writes the outputs.
// Which block handles which tile never changes a result, so the bits are the same on every call and every GPU.
//
// Tensor metadata (pointer, numel, dtype, tiling) for an unbounded number of tensors lives in a device buffer that
// is cached by content (see MetadataCache): in steady state (same gradients, same addresses) nothing is copied at
// all; a cache miss costs one cudaMemcpyAsync from an immutable pinned buffer. Both are CUDA-graph capturable.
#include "multi_tensor_stats.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

namespace torch_gradstats {
namespace {

// ----------------------------------------------------------------------------------------------------------------
// Tuning constants (fixed: they define the reduction order, hence the bits of the result).
constexpr int kThreads = 256;                  // threads per block, both kernels
constexpr int kUnroll = 4;                     // 16-byte loads in flight per thread
constexpr int64_t kVecBytes = 16;              // one vector load
constexpr int64_t kTileBytes = 64 * 1024;      // nominal tile: 16 vector loads per thread
constexpr int64_t kMaxTilesPerTensor = 4096;   // bigger tensors get bigger tiles (bounds the finalize work)
constexpr int kBlocksPerSM = 4;                // persistent grid = SMs * this
constexpr int kWarpsPerFinalizeBlock = kThreads / 32;
// Per-thread counters are 32-bit; a tile never gives one thread more than 2^31 elements below this size.
constexpr int64_t kMaxNumel = int64_t(1) << 50;

enum DTypeTag : int32_t { kTagHalf = 0, kTagBFloat16 = 1, kTagFloat = 2, kTagDouble = 3 };

// One entry per input tensor, in the device metadata buffer. The tensor's elements are the flat span
// [ptr, ptr + numel) (the input is dense; see the host code), cut into tiles of tile_elems elements.
struct TensorMeta {
  const void* ptr;
  int64_t numel;
  int64_t tile_elems;  // a multiple of the elements per 16 bytes
  int64_t first_tile;  // index of this tensor's first tile in the flattened tile list
  int32_t dtype;       // DTypeTag
  int32_t pad;
};
static_assert(sizeof(TensorMeta) == 40, "TensorMeta layout is shared by host and device");

// ----------------------------------------------------------------------------------------------------------------
// Per-dtype bit patterns. Classification comes from the bits: with a = bits & kAbs, zero <=> a == 0 (so -0.0 too),
// inf <=> a == kExp, NaN <=> a > kExp, finite <=> a < kExp; for finite values, a orders like |x|.
struct HalfTraits {
  using bits_t = uint16_t;
  static constexpr bits_t kAbs = 0x7fff, kExp = 0x7c00;
  static __device__ __forceinline__ double to_double(bits_t b) { return __half2float(__ushort_as_half(b)); }
};
struct BFloat16Traits {
  using bits_t = uint16_t;
  static constexpr bits_t kAbs = 0x7fff, kExp = 0x7f80;
  static __device__ __forceinline__ double to_double(bits_t b) { return __uint_as_float(uint32_t(b) << 16); }
};
struct FloatTraits {
  using bits_t = uint32_t;
  static constexpr bits_t kAbs = 0x7fffffffu, kExp = 0x7f800000u;
  static __device__ __forceinline__ double to_double(bits_t b) { return __uint_as_float(b); }
};
struct DoubleTraits {
  using bits_t = uint64_t;
  static constexpr bits_t kAbs = 0x7fffffffffffffffull, kExp = 0x7ff0000000000000ull;
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

// Reads elements [start, end) of the flat span at `base` with this block: a scalar head up to the first 16-byte
// boundary, 16-byte vector loads (kUnroll in flight per thread), a scalar tail after the last boundary.
template <class Tr>
__device__ __forceinline__ Partial tile_partial(const void* base, int64_t start, int64_t end) {
  using bits_t = typename Tr::bits_t;
  constexpr int64_t es = sizeof(bits_t);
  ThreadAcc<Tr> acc;
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(base) + uintptr_t(start) * es;
  const uintptr_t a1 = reinterpret_cast<uintptr_t>(base) + uintptr_t(end) * es;
  uintptr_t vb = (a0 + kVecBytes - 1) & ~uintptr_t(kVecBytes - 1);
  uintptr_t ve = a1 & ~uintptr_t(kVecBytes - 1);
  if (vb > ve) vb = ve = a1;  // no whole vector inside: everything is head
  const int tid = threadIdx.x;

  const int64_t n_head = int64_t(vb - a0) / es;  // < 16 / es
  if (tid < n_head) acc.visit(__ldg(reinterpret_cast<const bits_t*>(a0) + tid));

  const uint4* vp = reinterpret_cast<const uint4*>(vb);
  const int64_t n_vec = int64_t(ve - vb) / kVecBytes;
  int64_t v = tid;
  for (; v + int64_t(kUnroll - 1) * kThreads < n_vec; v += int64_t(kUnroll) * kThreads) {
    uint4 r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) r[k] = __ldg(vp + v + int64_t(k) * kThreads);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) acc.visit_vec(r[k]);
  }
  for (; v < n_vec; v += kThreads) acc.visit_vec(__ldg(vp + v));

  const int64_t n_tail = int64_t(a1 - ve) / es;  // < 16 / es
  if (tid < n_tail) acc.visit(__ldg(reinterpret_cast<const bits_t*>(ve) + tid));

  return {acc.sumsq, Tr::to_double(acc.amax_bits), acc.zeros, acc.nans, acc.infs};
}

// Kernel 1: one partial per tile. Partials are stored structure-of-arrays: sumsq[T], amax[T], counts[3][T].
__global__ void __launch_bounds__(kThreads) tile_stats_kernel(const TensorMeta* __restrict__ meta,
                                                              const int32_t* __restrict__ tile_tensor,
                                                              int64_t num_tiles, double* __restrict__ p_sumsq,
                                                              double* __restrict__ p_amax,
                                                              int64_t* __restrict__ p_counts) {
  __shared__ Partial warp_results[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const TensorMeta m = meta[tile_tensor[t]];
    const int64_t start = (t - m.first_tile) * m.tile_elems;
    const int64_t end = start + m.tile_elems < m.numel ? start + m.tile_elems : m.numel;
    Partial p;
    switch (m.dtype) {
      case kTagHalf: p = tile_partial<HalfTraits>(m.ptr, start, end); break;
      case kTagBFloat16: p = tile_partial<BFloat16Traits>(m.ptr, start, end); break;
      case kTagFloat: p = tile_partial<FloatTraits>(m.ptr, start, end); break;
      default: p = tile_partial<DoubleTraits>(m.ptr, start, end); break;
    }
    p = warp_reduce(p);
    if (lane == 0) warp_results[warp] = p;
    __syncthreads();
    if (threadIdx.x == 0) {
      Partial r = warp_results[0];
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) r = combine(r, warp_results[w]);
      p_sumsq[t] = r.sumsq;
      p_amax[t] = r.amax;
      p_counts[t] = int64_t(r.zeros);
      p_counts[num_tiles + t] = int64_t(r.nans);
      p_counts[2 * num_tiles + t] = int64_t(r.infs);
    }
    __syncthreads();  // warp_results is reused by the next tile
  }
}

// Kernel 2: one warp per tensor reduces its partials (lane-strided, then a fixed tree) and writes the outputs.
__global__ void __launch_bounds__(kThreads) finalize_kernel(const TensorMeta* __restrict__ meta, int64_t num_tensors,
                                                            int64_t num_tiles, const double* __restrict__ p_sumsq,
                                                            const double* __restrict__ p_amax,
                                                            const int64_t* __restrict__ p_counts,
                                                            double* __restrict__ sumsq, double* __restrict__ amax,
                                                            int64_t* __restrict__ counts) {
  const int64_t i = int64_t(blockIdx.x) * kWarpsPerFinalizeBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= num_tensors) return;  // whole warps exit together
  const TensorMeta m = meta[i];
  const int64_t n_tiles = m.numel == 0 ? 0 : (m.numel + m.tile_elems - 1) / m.tile_elems;
  Partial p{0.0, 0.0, 0, 0, 0};
#pragma unroll 4
  for (int64_t k = lane; k < n_tiles; k += 32) {
    const int64_t t = m.first_tile + k;
    p = combine(p, Partial{p_sumsq[t], p_amax[t], (unsigned long long)p_counts[t],
                           (unsigned long long)p_counts[num_tiles + t], (unsigned long long)p_counts[2 * num_tiles + t]});
  }
  p = warp_reduce(p);
  if (lane == 0) {
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

// Device metadata: [TensorMeta x N][int32 tile -> tensor x T], built on the host from the key.
struct DeviceMetadata {
  at::Tensor buffer;  // uint8 on the device
  int64_t num_tiles;
};

// Why a content-addressed cache: kernel parameters hold at most ~32 KB (about 800 tensors) and a per-call copy from
// pinned memory is not capture-safe unless its source stays unchanged and alive as long as the graph. Keyed by
// (device, pointer, numel, dtype of every tensor), the metadata is immutable; a training loop that reuses its
// gradient buffers hits every step and copies nothing, and a captured graph only ever reads a device buffer that
// the cache keeps alive (entries used under capture are never evicted). A miss while capturing copies from a slice
// of a pinned arena reserved by the first eager call and never reused; with no eager call before, it is an error.
class MetadataCache {
 public:
  DeviceMetadata get(const std::vector<int64_t>& key, const std::vector<TensorMeta>& host_meta, int64_t num_tiles,
                     c10::DeviceIndex device, const c10::cuda::CUDAStream& stream, bool capturing) {
    std::lock_guard<std::mutex> lock(mu_);
    ++clock_;
    if (!capturing && !arena_.defined()) {
      arena_ = at::empty({int64_t(kArenaBytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    for (auto& e : entries_) {
      if (e->device == device && e->key == key) {
        e->last_use = clock_;
        if (capturing) {
          e->used_by_graph = true;
        } else if (stream != e->stream) {
          // Used on another stream than the upload's: order this use after the upload, and keep the memory from
          // being reused before this use ends.
          C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), e->copied, 0));
          c10::cuda::CUDACachingAllocator::recordStream(e->device_buf.storage().data_ptr(), stream);
        }
        return {e->device_buf, e->num_tiles};
      }
    }
    const size_t meta_bytes = host_meta.size() * sizeof(TensorMeta);
    const size_t bytes = meta_bytes + size_t(num_tiles) * sizeof(int32_t);
    const auto device_options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device);

    if (capturing) {
      // A miss under capture (e.g. torch.compile's cudagraphs copy inputs to static buffers): no allocation of
      // pinned memory nor event call is legal now, so the source is carved from the arena reserved by an earlier
      // eager call, never reused or freed (a graph may replay it forever); the copy becomes a node of the graph.
      // The device buffer comes from the graph's pool like any temporary and is not cached: it is only filled
      // when the graph replays.
      const size_t need = (bytes + 15) & ~size_t(15);
      TORCH_CHECK(arena_.defined() && arena_used_ + need <= kArenaBytes,
                  "multi_tensor_stats: these tensors (this combination of addresses, sizes and dtypes) are seen for "
                  "the first time while the CUDA stream is capturing a graph, and ",
                  arena_.defined() ? "the reserve for such uploads is used up" : "no eager call came before",
                  ". Call multi_tensor_stats once on the same tensors before capture (a warm-up call): the metadata "
                  "it uploads is then reused by the captured graph without any copy.");
      uint8_t* h = arena_.data_ptr<uint8_t>() + arena_used_;
      arena_used_ += need;
      fill_host(h, host_meta);
      at::Tensor device_buf = at::empty({int64_t(bytes)}, device_options);
      C10_CUDA_CHECK(cudaMemcpyAsync(device_buf.data_ptr(), h, bytes, cudaMemcpyHostToDevice, stream.stream()));
      return {device_buf, num_tiles};
    }
    release_finished();

    // The cached buffer outlives this call, so it is allocated for a side stream of its own and uploaded there:
    // the calling stream's allocations may be routed to a CUDA-graph private pool (torch.compile's cudagraph trees
    // run their warm-up that way), which must never hold a buffer the cache keeps. The calling stream waits for the
    // upload, and is recorded as a user of the buffer so the allocator never recycles it under a running kernel.
    const c10::cuda::CUDAStream upload = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
    auto entry = std::make_unique<Entry>();
    entry->device = device;
    entry->key = key;
    entry->num_tiles = num_tiles;
    entry->stream = upload;
    entry->host_buf = at::empty({int64_t(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    uint8_t* h = entry->host_buf.data_ptr<uint8_t>();
    fill_host(h, host_meta);
    {
      const c10::cuda::CUDAStreamGuard on_upload_stream(upload);
      entry->device_buf = at::empty({int64_t(bytes)}, device_options);
    }
    C10_CUDA_CHECK(cudaMemcpyAsync(entry->device_buf.data_ptr(), h, bytes, cudaMemcpyHostToDevice, upload.stream()));
    // The pinned source must not be freed (and reused) before the copy has run: remember when it has.
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&entry->copied, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(entry->copied, upload.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), entry->copied, 0));
    c10::cuda::CUDACachingAllocator::recordStream(entry->device_buf.storage().data_ptr(), stream);
    entry->last_use = clock_;
    DeviceMetadata result{entry->device_buf, num_tiles};
    entries_.push_back(std::move(entry));
    evict_if_full();
    return result;
  }

 private:
  static constexpr size_t kCapacity = 16;
  static constexpr size_t kArenaBytes = size_t(4) << 20;  // pinned reserve for misses under capture (~10k tensors)

  static void fill_host(uint8_t* h, const std::vector<TensorMeta>& host_meta) {
    const size_t meta_bytes = host_meta.size() * sizeof(TensorMeta);
    std::memcpy(h, host_meta.data(), meta_bytes);
    int32_t* tile_tensor = reinterpret_cast<int32_t*>(h + meta_bytes);
    for (size_t i = 0; i < host_meta.size(); ++i) {
      const TensorMeta& m = host_meta[i];
      const int64_t n = m.numel == 0 ? 0 : (m.numel + m.tile_elems - 1) / m.tile_elems;
      std::fill(tile_tensor + m.first_tile, tile_tensor + m.first_tile + n, int32_t(i));
    }
  }

  struct Entry {
    c10::DeviceIndex device = 0;
    std::vector<int64_t> key;
    int64_t num_tiles = 0;
    at::Tensor device_buf, host_buf;
    cudaEvent_t copied = nullptr;
    c10::cuda::CUDAStream stream = c10::cuda::getDefaultCUDAStream();
    uint64_t last_use = 0;
    bool used_by_graph = false;
  };
  struct PendingHost {
    at::Tensor host_buf;
    cudaEvent_t copied;
  };

  // Evicts the least recently used entry no captured graph refers to. Its device buffer goes back to the caching
  // allocator (stream-ordered, so safe); its pinned buffer waits for its copy to have run.
  void evict_if_full() {
    if (entries_.size() <= kCapacity) return;
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!(*it)->used_by_graph && (victim == entries_.end() || (*it)->last_use < (*victim)->last_use)) victim = it;
    }
    if (victim == entries_.end()) return;
    pending_.push_back({std::move((*victim)->host_buf), (*victim)->copied});
    entries_.erase(victim);
  }

  void release_finished() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      const cudaError_t status = cudaEventQuery(it->copied);
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();  // cudaEventQuery's "not ready" is not an error; don't leave it sticky
        ++it;
        continue;
      }
      C10_CUDA_CHECK(status);
      C10_CUDA_CHECK(cudaEventDestroy(it->copied));
      it = pending_.erase(it);
    }
  }

  std::mutex mu_;
  uint64_t clock_ = 0;
  at::Tensor arena_;  // pinned; slices handed out under capture are never reused
  size_t arena_used_ = 0;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<PendingHost> pending_;
};

MetadataCache& metadata_cache() {
  static auto* cache = new MetadataCache();  // leaked on purpose: no CUDA calls during static destruction
  return *cache;
}

Stats multi_tensor_stats_cuda(at::TensorList tensors) {
  check_inputs(tensors);
  const at::Device device = tensors[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "multi_tensor_stats: the CUDA kernel got tensors on ", device);
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  const int64_t n = int64_t(tensors.size());
  TORCH_CHECK_VALUE(n < std::numeric_limits<int32_t>::max(), "multi_tensor_stats: too many tensors (", n, ")");

  // Dense tensors (contiguous or permuted) are read in place as the flat span of their storage; others are made
  // contiguous first. `dense_copies` keeps those copies alive until both kernels are enqueued, after which the
  // caching allocator (stream-ordered) may recycle them safely.
  std::vector<at::Tensor> dense_copies;
  std::vector<TensorMeta> host_meta(static_cast<size_t>(n));
  std::vector<int64_t> key(static_cast<size_t>(n) * 3);
  int64_t num_tiles = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor* t = &tensors[i];
    if (!t->is_non_overlapping_and_dense()) {
      dense_copies.push_back(t->contiguous());
      t = &dense_copies.back();
    }
    const int64_t numel = t->numel();
    const int64_t es = int64_t(t->element_size());
    TORCH_CHECK_VALUE(numel <= kMaxNumel, "multi_tensor_stats: tensors[", i, "] has ", numel,
                      " elements; at most 2^50 are supported");
    const void* ptr = numel == 0 ? nullptr : t->const_data_ptr();
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(ptr) % uintptr_t(es) == 0, "multi_tensor_stats: tensors[", i,
                      "] has a data pointer that is not aligned to its element size");
    const int64_t vec_elems = kVecBytes / es;
    int64_t tile_elems = kTileBytes / es;
    const int64_t needed = (numel + kMaxTilesPerTensor - 1) / kMaxTilesPerTensor;
    if (needed > tile_elems) tile_elems = (needed + vec_elems - 1) / vec_elems * vec_elems;
    const int32_t tag = dtype_tag(t->scalar_type());
    host_meta[i] = TensorMeta{ptr, numel, tile_elems, num_tiles, tag, 0};
    num_tiles += numel == 0 ? 0 : (numel + tile_elems - 1) / tile_elems;
    key[3 * i] = int64_t(reinterpret_cast<uintptr_t>(ptr));
    key[3 * i + 1] = numel;
    key[3 * i + 2] = tag;
  }
  TORCH_CHECK_VALUE(num_tiles < std::numeric_limits<int32_t>::max(), "multi_tensor_stats: too many tiles (",
                    num_tiles, ")");

  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  const DeviceMetadata md = metadata_cache().get(key, host_meta, num_tiles, device.index(), stream,
                                                 capture != cudaStreamCaptureStatusNone);
  const auto* d_meta = reinterpret_cast<const TensorMeta*>(md.buffer.const_data_ptr());
  const auto* d_tile_tensor = reinterpret_cast<const int32_t*>(
      static_cast<const uint8_t*>(md.buffer.const_data_ptr()) + size_t(n) * sizeof(TensorMeta));

  Stats out = empty_stats(n, device);
  // Partials workspace, structure of arrays: sumsq[T], amax[T], counts[3][T] (5 x 8 bytes per tile).
  at::Tensor workspace;
  double* p_sumsq = nullptr;
  double* p_amax = nullptr;
  int64_t* p_counts = nullptr;
  if (num_tiles > 0) {
    workspace = at::empty({5 * num_tiles}, at::TensorOptions().dtype(at::kDouble).device(device));
    p_sumsq = workspace.data_ptr<double>();
    p_amax = p_sumsq + num_tiles;
    p_counts = reinterpret_cast<int64_t*>(p_amax + num_tiles);
    const int64_t grid = std::min<int64_t>(num_tiles, int64_t(sm_count(device.index())) * kBlocksPerSM);
    tile_stats_kernel<<<unsigned(grid), kThreads, 0, stream.stream()>>>(d_meta, d_tile_tensor, num_tiles, p_sumsq,
                                                                        p_amax, p_counts);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t finalize_grid = (n + kWarpsPerFinalizeBlock - 1) / kWarpsPerFinalizeBlock;
  finalize_kernel<<<unsigned(finalize_grid), kThreads, 0, stream.stream()>>>(
      d_meta, n, num_tiles, p_sumsq, p_amax, p_counts, std::get<0>(out).data_ptr<double>(),
      std::get<1>(out).data_ptr<double>(), std::get<2>(out).data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_gradstats, CUDA, m) { m.impl("multi_tensor_stats", &multi_tensor_stats_cuda); }

}  // namespace torch_gradstats
