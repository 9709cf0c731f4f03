// The bookkeeping of the CUDA kernel's metadata cache (csrc/cuda/multi_tensor_stats.cu; docs/cuda.md, "Metadata
// and CUDA graphs"): lookup, pins, LRU order, eviction and when an evicted entry's memory may be freed. Plain C++
// over a policy that does the device work, so that tests/cpp/test_metadata_cache.cpp checks it on the CPU with a
// fake device (and under ThreadSanitizer, scripts/check_cache_sanitizer.sh).
//
// One Cache per device. The rules it keeps:
//  * An entry is pinned from the lookup that returns it until the caller has enqueued the kernels that read it
//    (the Lease's lifetime). Eviction only takes unpinned entries, so every read of an evicted entry is already
//    enqueued on one of its user streams.
//  * Work that orders the free after those reads is recorded only on the stream of the call being made (whose
//    caller is not capturing), never on another thread's stream: an entry whose users include other streams waits,
//    retired, until each of them makes its next call. Only when kMaxRetired entries wait does the cache order a
//    free after another caller's stream, and then only after one that the policy finds not capturing; if that
//    does not bring the list under its bound, misses take the caller's per-call path instead of allocating.
//  * Memory a failed miss allocated is handed back before the error propagates.
//
// Policy (called with the cache's lock held; it must not call back into the cache):
//   using Stream;                                   trivially copyable, equality-comparable
//   using Item;                                     trivially copyable (the key is compared with memcmp)
//   using Ready;                                    "the fill of an entry has run", e.g. an event
//   void* allocate(size_t bytes, Stream s);         stream-ordered on s; nullptr when out of memory
//   void fill(void* data, const Item* items, size_t n, Stream s);      enqueue the writes on s
//   Ready fill_done(Stream s);                      recorded on s after the fill
//   void wait(const Ready& r, Stream s);            s waits for the fill (a hit from a stream that did not fill)
//   void drop(Ready& r) noexcept;                   when the entry is freed
//   void order_free_after(Stream s);                frees enqueued from now on run after every op enqueued on s so
//                                                   far (CUDA: an event recorded on s, waited for by a free stream)
//   bool order_free_after_unless_capturing(Stream s);   the same, for a stream of another caller, unless s is
//                                                   being captured (or that cannot be told): false, nothing done
//   void release(void* data, size_t bytes);         free, ordered after every order_free_after so far
//   void release_on(void* data, size_t bytes, Stream s) noexcept;     error path: free ordered after s's work
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch_gradstats::metadata_cache {

template <class Policy>
class Cache {
 public:
  using Stream = typename Policy::Stream;
  using Item = typename Policy::Item;
  using Ready = typename Policy::Ready;
  static_assert(std::is_trivially_copyable_v<Item>, "keys are compared with memcmp");

  static constexpr size_t kCapacity = 16;     // live entries per device
  static constexpr size_t kMaxRetired = 16;  // evicted entries waiting for their user streams

  struct Entry {
    uint64_t hash = 0;
    std::vector<Item> key;  // the metadata itself: a pure function of the key
    void* data = nullptr;
    size_t bytes = 0;
    Ready ready{};
    std::vector<Stream> users;    // every stream that has read it (live), or has yet to order its free (retired)
    uint64_t last_use = 0;
    std::atomic<int64_t> pins{0};  // taken under the lock, released without it (Lease)
  };

  // A pinned entry: its memory stays valid until reset() or destruction, which the caller does once the kernels
  // that read it are enqueued. Empty (data() == nullptr) when the metadata cannot be cached.
  class Lease {
   public:
    Lease() = default;
    explicit Lease(Entry* e) : e_(e) {}
    Lease(Lease&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        e_ = std::exchange(o.e_, nullptr);
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    const void* data() const { return e_ ? e_->data : nullptr; }
    // Release: the reads enqueued before it happen-before an eviction that sees the pin gone (acquire).
    void reset() noexcept {
      if (e_) std::exchange(e_, nullptr)->pins.fetch_sub(1, std::memory_order_release);
    }

   private:
    Entry* e_ = nullptr;
  };

  struct Info {
    int64_t entries, bytes, retired, pinned;
  };

  explicit Cache(Policy policy) : policy_(std::move(policy)) {}
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;
  ~Cache() = default;  // entries are not freed here: the owner decides (the CUDA one is never destroyed)

  Policy& policy() { return policy_; }

  // The entry for `items` (hash `hash`, `bytes` of device memory), pinned, filled on `stream` if missing; empty
  // when it cannot be cached (the policy has no memory for it, or too many evicted entries still wait).
  // `stream` must not be capturing.
  Lease get(const Item* items, size_t n, uint64_t hash, size_t bytes, Stream stream) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!retired_.empty()) mark_retired(stream);
    ++clock_;
    for (auto& e : entries_) {
      if (e->hash == hash && e->key.size() == n && std::memcmp(e->key.data(), items, n * sizeof(Item)) == 0) {
        if (std::find(e->users.begin(), e->users.end(), stream) == e->users.end()) {
          policy_.wait(e->ready, stream);  // first read from this stream: after the fill (later ones follow it)
          e->users.push_back(stream);
        }
        e->last_use = clock_;
        e->pins.fetch_add(1, std::memory_order_relaxed);  // under the lock: an eviction cannot miss it
        return Lease(e.get());
      }
    }
    if (retired_.size() >= kMaxRetired) mark_idle_retired();
    if (retired_.size() >= kMaxRetired) return Lease();  // bounded memory first: the per-call path
    auto e = std::make_unique<Entry>();
    e->hash = hash;
    e->key.assign(items, items + n);
    e->bytes = bytes;
    e->users.reserve(2);
    entries_.reserve(kCapacity + 1);
    void* data = policy_.allocate(bytes, stream);
    if (data == nullptr) return Lease();
    {
      // Hands the block back if the fill or its marker fails (stream-ordered after whatever was enqueued).
      struct Unwind {
        Policy& p;
        void* data;
        size_t bytes;
        Stream s;
        bool armed = true;
        ~Unwind() {
          if (armed) p.release_on(data, bytes, s);
        }
      } unwind{policy_, data, bytes, stream};
      policy_.fill(data, items, n, stream);
      e->ready = policy_.fill_done(stream);
      e->users.push_back(stream);
      unwind.armed = false;
    }
    e->data = data;
    e->last_use = clock_;
    e->pins.store(1, std::memory_order_relaxed);
    live_bytes_ += bytes;
    Entry* raw = e.get();
    entries_.push_back(std::move(e));
    while (entries_.size() > kCapacity && evict_lru(stream)) {
    }
    return Lease(raw);
  }

  Info info() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t pinned = 0;
    for (auto& e : entries_) pinned += e->pins.load(std::memory_order_acquire) > 0;
    return {int64_t(entries_.size()), int64_t(live_bytes_), int64_t(retired_.size()), pinned};
  }

 private:
  // The least recently used unpinned entry leaves the table; false when every entry is pinned (the table then
  // stays over capacity until a later miss: at most one entry over per concurrent caller). Its free is ordered
  // after `stream` now, and after each other user stream at that stream's next call.
  bool evict_lru(Stream stream) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if ((*it)->pins.load(std::memory_order_acquire) != 0) continue;
      if (victim == entries_.end() || (*it)->last_use < (*victim)->last_use) victim = it;
    }
    if (victim == entries_.end()) return false;
    std::unique_ptr<Entry> e = std::move(*victim);
    entries_.erase(victim);
    live_bytes_ -= e->bytes;
    auto own = std::find(e->users.begin(), e->users.end(), stream);
    if (own != e->users.end()) {
      policy_.order_free_after(stream);
      e->users.erase(own);
    }
    if (e->users.empty()) {
      free_entry(*e);
    } else {
      retired_.push_back(std::move(e));
    }
    return true;
  }

  // `stream` is making a call: every retired entry it has read can now be ordered after it (one marker for all).
  void mark_retired(Stream stream) {
    bool marked = false;
    for (auto it = retired_.begin(); it != retired_.end();) {
      Entry& e = **it;
      auto own = std::find(e.users.begin(), e.users.end(), stream);
      if (own != e.users.end()) {
        if (!marked) policy_.order_free_after(stream);
        marked = true;
        e.users.erase(own);
      }
      if (e.users.empty()) {
        free_entry(e);
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Too many entries wait for streams that have not called since: order them, oldest first, after those of their
  // streams that are not capturing now, until the list is back under its bound.
  void mark_idle_retired() {
    for (auto it = retired_.begin(); it != retired_.end() && retired_.size() >= kMaxRetired;) {
      Entry& e = **it;
      for (auto u = e.users.begin(); u != e.users.end();) {
        u = policy_.order_free_after_unless_capturing(*u) ? e.users.erase(u) : u + 1;
      }
      if (e.users.empty()) {
        free_entry(e);
        it = retired_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void free_entry(Entry& e) {
    policy_.release(e.data, e.bytes);
    policy_.drop(e.ready);
    e.data = nullptr;
  }

  Policy policy_;
  std::mutex mu_;
  uint64_t clock_ = 0;
  size_t live_bytes_ = 0;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<std::unique_ptr<Entry>> retired_;  // oldest first
};

}  // namespace torch_gradstats::metadata_cache
