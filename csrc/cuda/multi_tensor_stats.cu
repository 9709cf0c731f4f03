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
//
// The kernels and their parts are in stats_kernels.cuh (tensor_meta.cuh: what they read of each tensor;
// exponent_histogram.cuh: the histogram's counting), the metadata upload in metadata_fill.cuh, the cache's CUDA side
// in metadata_cache_cuda.cuh; this file holds the host side: tiling, the choice of metadata source, the launches.

#include "metadata_cache_cuda.cuh"
#include "metadata_fill.cuh"
#include "multi_tensor_stats.h"
#include "stats_kernels.cuh"
#include "tensor_meta.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace torch_gradstats {
namespace {

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
  if (in_params) {
    cache.count_per_call(capturing, 0);  // (the captured-call count covers every path)
    if (!capturing) cache.free_released();  // (a long list's get() and for_capture() do it themselves)
  }
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