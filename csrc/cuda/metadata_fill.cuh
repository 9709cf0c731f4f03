// A long list's metadata written to the device by fill kernels whose parameters carry it, and how long a list
// may be to travel in the op's own kernel parameters instead.
// Part of multi_tensor_stats.cu and included by it alone: one translation unit, so everything here keeps the
// internal linkage of the anonymous namespace.
#pragma once

#include "tensor_meta.cuh"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace torch_gradstats {
namespace {

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

}  // namespace
}  // namespace torch_gradstats
