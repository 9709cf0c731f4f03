// The bookkeeping of the CUDA kernel's metadata (csrc/cuda/metadata_cache_cuda.cuh; docs/cuda.md, "Metadata and CUDA
// graphs"): where a call's metadata lives, and for long lists the cache: lookup, admission, pins, eviction and when
// an evicted entry's memory may be freed. Plain C++ over a policy that does the device work, so that
// tests/cpp/test_metadata_cache.cpp checks it on the CPU with a fake device (and under ThreadSanitizer,
// scripts/check_cache_sanitizer.sh).
//
// One Cache per device. The rules it keeps:
//  * A list of at most policy.inline_items() items needs no device memory: the kernels take it as a parameter
//    (get() returns an inline lease). Longer lists go through the cache.
//  * An entry is pinned from the lookup that returns it until the caller has enqueued the kernels that read it
//    (the Lease's lifetime). Eviction only takes unpinned entries.
//  * When a lease ends, its reader records a "last read" marker on its own stream (which its call found not
//    capturing) and the cache's frees are ordered after it (policy.end_read). An evicted entry's free is therefore
//    ordered after every read of it: eviction waits on those markers only, and never queries, records on or keeps
//    another caller's stream. A reader that cannot record its marker (its stream found capturing after all, or an
//    error) leaves the entry stuck: never evicted nor freed, still counted against the capacity.
//  * No device work under the lock: allocation, fill, markers and frees run outside it. A miss inserts its entry
//    (pinned, "filling") before it allocates; another call on the same key meanwhile takes the per-call path.
//    If the caller's stream is capturing after the fill (another thread began a capture on it since the call's
//    check), the allocation and fill may be in that capture and never run: the entry stays "filling" (never served)
//    and stuck (never freed), and the call takes the per-call path.
//  * Every failure path leaves the table consistent: a failed miss removes its entry and hands its memory back; an
//    entry evicted by a miss that then throws (host memory) is still freed; a free that fails is retried by a later
//    call (memory and marker are never dropped on the floor, and keeping them allocates nothing).
//  * Admission: when the table is full, a missed key is admitted only if the least recently used unpinned entry has
//    been idle longer than the key's own reuse distance (from a small table of recently missed keys). Lists that
//    alternate in a fixed order, more of them than the capacity, then keep a stable set of entries (the rest take
//    the per-call path) instead of evicting each other on every call; a key seen once (a copy at a new address)
//    evicts nothing.
//
// Policy (never called with the cache's lock held; it must not call back into the cache):
//   using Stream;                                   trivially copyable; used only during the call that passes it
//   using Item;                                     trivially copyable (the key is compared with memcmp)
//   using Ready;                                    "the fill of an entry has run", e.g. an event
//   size_t inline_items();                          lists up to this long are passed as kernel parameters
//   void* allocate(size_t bytes, Stream s);         stream-ordered on s; nullptr when out of memory
//   void fill(void* data, const Item* items, size_t n, Stream s);      enqueue the writes on s
//   Ready fill_done(Stream s);                      recorded on s after the fill
//   bool capturing(Stream s) noexcept;              s is capturing now (true when it cannot tell)
//   bool fill_complete(const Ready& r);             the host sees the fill done: later readers need not wait
//   void wait(const Ready& r, Stream s);            s waits for the fill
//   bool end_read(Stream s) noexcept;               records s's "last read" marker and orders every free enqueued
//                                                   from now on after it; false when it cannot (nothing ordered)
//   bool release(void* data, size_t bytes) noexcept;    free, ordered after every end_read so far; false: not done
//   void release_on(void* data, size_t bytes, Stream s) noexcept;     error path: free ordered after s's work
//   void drop(Ready& r) noexcept;                   when the entry is freed
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

// Test-only: runs between an eviction candidate's two atomic loads (tests/cpp/test_metadata_cache.cpp defines it).
#ifndef TORCH_GRADSTATS_CACHE_TEST_HOOK
#define TORCH_GRADSTATS_CACHE_TEST_HOOK(entry_data)
#endif

namespace torch_gradstats::metadata_cache {

template <class Policy>
class Cache {
 public:
  using Stream = typename Policy::Stream;
  using Item = typename Policy::Item;
  using Ready = typename Policy::Ready;
  static_assert(std::is_trivially_copyable_v<Item>, "keys are compared with memcmp");

  static constexpr size_t kCapacity = 16;  // live entries per device
  static constexpr size_t kGhosts = 1024;  // recently missed keys remembered for admission (direct-mapped)

  struct Entry {
    uint64_t hash = 0;
    std::vector<Item> key;  // the metadata itself: a pure function of the key
    void* data = nullptr;
    size_t bytes = 0;
    Ready ready{};
    bool filling = true;                  // under the lock: its miss is still writing it
    std::atomic<bool> stuck{false};       // a reader could not order the free after its reads: never freed
    std::atomic<bool> fill_seen{false};   // the host saw the fill complete
    uint64_t last_use = 0;
    std::atomic<int64_t> pins{0};         // taken under the lock, released without it (Lease)
  };

  // Where a call's metadata is: inline (the kernels take it as a parameter), a pinned cache entry (data() stays
  // valid until reset(), which the caller does once the kernels that read it are enqueued), or neither (the
  // per-call path). The stream is the call's own and lives no longer than the lease.
  class Lease {
   public:
    Lease() = default;
    static Lease inline_metadata() {
      Lease l;
      l.inline_ = true;
      return l;
    }
    Lease(Lease&& o) noexcept
        : cache_(o.cache_), e_(std::exchange(o.e_, nullptr)), stream_(o.stream_), inline_(o.inline_) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        cache_ = o.cache_;
        e_ = std::exchange(o.e_, nullptr);
        stream_ = o.stream_;
        inline_ = o.inline_;
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    bool is_inline() const { return inline_; }
    const void* data() const { return e_ ? e_->data : nullptr; }
    // The reads are enqueued: record this stream's marker, then unpin. Release: what was enqueued before it
    // happens-before an eviction that sees the pin gone (acquire), and so do the marker's ordering of frees and the
    // stuck flag when the marker failed.
    void reset() noexcept {
      if (!e_) return;
      Entry* e = std::exchange(e_, nullptr);
      if (!cache_->policy_.end_read(stream_)) e->stuck.store(true, std::memory_order_relaxed);
      e->pins.fetch_sub(1, std::memory_order_release);
    }

   private:
    friend class Cache;
    Lease(Cache* cache, Entry* e, Stream s) : cache_(cache), e_(e), stream_(s) {}
    Cache* cache_ = nullptr;
    Entry* e_ = nullptr;
    Stream stream_{};
    bool inline_ = false;
  };

  struct Info {
    int64_t entries, bytes, retired, pinned;  // retired: stuck entries and frees waiting for a retry
  };

  explicit Cache(Policy policy) : policy_(std::move(policy)) { entries_.reserve(kCapacity); }
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;
  ~Cache() = default;  // entries are not freed here: the owner decides (the CUDA one is never destroyed)

  Policy& policy() { return policy_; }

  // Where the metadata of `items` (hash `hash`, `bytes` of device memory) is for a call on `stream` (not
  // capturing): inline for a short list; else the entry, pinned, filled on `stream` if missing and admitted; else
  // empty (the per-call path: not admitted, no memory, or its entry being filled by another call).
  Lease get(const Item* items, size_t n, uint64_t hash, size_t bytes, Stream stream) {
    if (n <= policy_.inline_items()) return Lease::inline_metadata();
    Entry* hit = nullptr;
    Entry* fresh = nullptr;
    {
      // Evicted entries and frees that failed before: freed when this scope ends, outside the lock (declared
      // first, it outlives the lock_guard), a throw included (an insertion that throws after its eviction).
      struct ToFree {
        Cache* cache;
        List list;
        ~ToFree() { cache->free_entries(list); }
      } to_free{this, {}};
      std::lock_guard<std::mutex> lock(mu_);
      to_free.list.swap(pending_);
      const uint64_t now = ++clock_;
      Entry* match = nullptr;
      for (auto& e : entries_) {
        if (e->hash == hash && e->key.size() == n && std::memcmp(e->key.data(), items, n * sizeof(Item)) == 0) {
          match = e.get();
          break;
        }
      }
      if (match != nullptr && !match->filling) {  // filling: another call writes it; this one takes the per-call path
        match->last_use = now;
        match->pins.fetch_add(1, std::memory_order_relaxed);  // under the lock: an eviction cannot miss it
        hit = match;
      }
      if (match == nullptr && admit(hash, now, to_free.list)) {
        auto e = std::make_unique<Entry>();
        e->hash = hash;
        e->key.assign(items, items + n);
        e->bytes = bytes;
        e->last_use = now;
        e->pins.store(1, std::memory_order_relaxed);
        fresh = e.get();
        entries_.push_back(std::move(e));  // cannot throw: capacity reserved
        live_bytes_ += bytes;
      }
    }
    if (hit != nullptr) {
      Lease lease(this, hit, stream);  // from here a throw unpins
      if (!hit->fill_seen.load(std::memory_order_acquire)) {
        if (policy_.fill_complete(hit->ready)) {
          hit->fill_seen.store(true, std::memory_order_release);
        } else {
          policy_.wait(hit->ready, stream);  // a read before the fill has run (on another stream, perhaps)
        }
      }
      return lease;
    }
    if (fresh == nullptr) return Lease();
    return fill_new(fresh, items, n, bytes, stream);
  }

  Info info() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t pinned = 0, stuck = 0;
    for (auto& e : entries_) {
      pinned += e->pins.load(std::memory_order_acquire) > 0;
      stuck += e->stuck.load(std::memory_order_relaxed);
    }
    return {int64_t(entries_.size()), int64_t(live_bytes_), stuck + int64_t(pending_.size()), pinned};
  }

 private:
  using List = std::list<std::unique_ptr<Entry>>;  // of entries to free: moved between lists without allocating

  struct Ghost {
    uint64_t hash = 0;
    uint64_t seen = 0;  // clock of its last miss (or last use, for an evicted entry); 0: empty
  };

  // A miss at `now`: room for its entry, evicting into `to_free` when the table is full and the admission rule
  // allows (mu_ held). False: not admitted.
  bool admit(uint64_t hash, uint64_t now, List& to_free) {
    Ghost& g = ghosts_[hash % kGhosts];
    const uint64_t reuse =
        (g.hash == hash && g.seen != 0) ? now - g.seen : std::numeric_limits<uint64_t>::max();  // first sighting
    g = {hash, now};
    if (entries_.size() < kCapacity) return true;
    // Full (it never goes over): the least recently used entry that may go makes room only if it has been idle
    // longer than the missed key's reuse distance.
    auto victim = lru_unpinned();
    if (victim == entries_.end() || now - (*victim)->last_use <= reuse) return false;  // the per-call path
    to_free.push_back(std::move(*victim));  // first: if it throws, nothing has changed
    ghosts_[to_free.back()->hash % kGhosts] = {to_free.back()->hash, to_free.back()->last_use};  // may earn it back
    live_bytes_ -= to_free.back()->bytes;
    entries_.erase(victim);
    return true;
  }

  typename std::vector<std::unique_ptr<Entry>>::iterator lru_unpinned() {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      Entry& e = **it;
      // Pins first: a reader sets stuck before its unpin (release), so a load that sees the unpin (acquire) sees
      // stuck too. The other order can see the stuck flag not yet set, then no pin, and free a stuck entry.
      const bool pinned = e.pins.load(std::memory_order_acquire) != 0;
      TORCH_GRADSTATS_CACHE_TEST_HOOK(e.data);
      if (e.filling || pinned || e.stuck.load(std::memory_order_relaxed)) continue;
      if (victim == entries_.end() || e.last_use < (*victim)->last_use) victim = it;
    }
    return victim;
  }

  // The miss's part outside the lock: allocate, fill, publish. Any failure removes the entry (and frees what it
  // allocated) before the error propagates.
  Lease fill_new(Entry* fresh, const Item* items, size_t n, size_t bytes, Stream stream) {
    struct Abandon {
      Cache* cache;
      Entry* e;
      bool armed = true;
      ~Abandon() {
        if (armed) cache->abandon(e);
      }
    } abandon{this, fresh};
    void* data = policy_.allocate(bytes, stream);
    if (data == nullptr) return Lease();
    Ready ready;
    {
      struct Unwind {  // hands the block back if the fill or its marker fails (after whatever was enqueued)
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
      ready = policy_.fill_done(stream);
      unwind.armed = false;
    }
    const bool captured = policy_.capturing(stream);  // the fill may never run eagerly; the capture may own data
    {
      std::lock_guard<std::mutex> lock(mu_);
      fresh->data = data;
      fresh->ready = ready;
      if (captured) {
        fresh->stuck.store(true, std::memory_order_relaxed);
        fresh->pins.store(0, std::memory_order_relaxed);
      } else {
        fresh->filling = false;
      }
    }
    abandon.armed = false;
    if (captured) return Lease();
    return Lease(this, fresh, stream);
  }

  // A miss that failed: its entry leaves the table (it holds no memory: the caller handed any back).
  void abandon(Entry* e) noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->get() == e) {
        live_bytes_ -= e->bytes;
        entries_.erase(it);
        return;
      }
    }
  }

  // Outside the lock. Every read of these entries has ended, so each release is ordered after them; one that fails
  // waits in pending_ for the next call. Allocates nothing (list nodes are spliced), so nothing here can throw.
  void free_entries(List& list) noexcept {
    for (auto it = list.begin(); it != list.end();) {
      if (policy_.release((*it)->data, (*it)->bytes)) {
        policy_.drop((*it)->ready);
        it = list.erase(it);
      } else {
        ++it;
      }
    }
    if (!list.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.splice(pending_.end(), list);
    }
  }

  Policy policy_;
  std::mutex mu_;
  uint64_t clock_ = 0;
  size_t live_bytes_ = 0;
  std::vector<std::unique_ptr<Entry>> entries_;
  List pending_;  // evicted, their free failed: retried by the next call
  std::array<Ghost, kGhosts> ghosts_{};
};

}  // namespace torch_gradstats::metadata_cache
