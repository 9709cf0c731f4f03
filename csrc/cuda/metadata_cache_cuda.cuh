// The CUDA side of the metadata cache (metadata_cache.h holds its bookkeeping): a memory pool per device, the
// device policy of the bookkeeping, and the buffers it makes for graphs being captured.
// Part of multi_tensor_stats.cu and included by it alone: one translation unit, so everything here keeps the
// internal linkage of the anonymous namespace.
#pragma once

#include "metadata_cache.h"
#include "metadata_fill.cuh"
#include "tensor_meta.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace torch_gradstats {
namespace {

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
    free_released();
    DeviceState& ds = device_state(device);
    if (!ds.cache) return MetadataLease();
    return ds.cache->get(meta.data(), meta.size(), hash, metadata_bytes(int64_t(meta.size()), num_tiles), stream);
  }

  // Frees the buffers of graphs destroyed since the last call, if any: one atomic load when there are none. Called
  // by every eager call (a workload of short lists only would otherwise keep them until a long list comes).
  void free_released() noexcept {
    if (released_.load(std::memory_order_relaxed) != nullptr) free_released_graph_buffers();
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

}  // namespace
}  // namespace torch_gradstats
