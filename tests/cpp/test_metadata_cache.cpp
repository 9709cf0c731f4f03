// The metadata cache's bookkeeping (csrc/cuda/metadata_cache.h) over a fake device (ctest; no GPU, no torch).
//
// The fake device models what the CUDA policy relies on: streams are queues of operations that run later, in
// order, when the test lets the "device" make progress; a wait runs only once the stream it waits for has reached
// the recorded position; a free poisons its block and hands it back to a pool that reuses blocks. A kernel of the
// op is a Read that checks its block still holds the metadata of its key. So a free that runs before a read it
// should have waited for, or a block handed to another key while a read is queued, fails a Read; a free of a
// block that a caller has pinned fails at once. A marker recorded on a stream while it is being captured, a wait
// on such a marker, and any use of a destroyed stream count as violations too.
//
// As on CUDA, asking whether a stream is capturing and recording a marker on it are two calls: between them the
// test's hook (between_steps) can let another thread act, e.g. begin a capture on that stream.
//
// The fake policy offers the calls of the earlier protocol too (order_free_after, order_free_after_unless_capturing),
// so this file also builds against that version of the header: the tests marked "fails on the earlier protocol"
// then fail, as they should.
//
//   test_metadata_cache [iterations per thread]   (default 100000; scripts/check_cache_sanitizer.sh passes fewer)
#include <functional>

// Called by the cache between its two loads of an eviction candidate (the entry's block): a test acts there.
std::function<void(void*)> between_eviction_loads;
#define TORCH_GRADSTATS_CACHE_TEST_HOOK(entry_data) \
  (between_eviction_loads ? between_eviction_loads(entry_data) : void())

#include "cuda/metadata_cache.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <future>
#include <iostream>
#include <mutex>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// Host allocation failures on demand: while alloc_countdown >= 0 on a thread, its allocation number alloc_countdown
// (counting from 0) throws std::bad_alloc. The fake device's own allocations are exempt (it models the device).
thread_local int64_t alloc_countdown = -1;
thread_local bool alloc_exempt = false;

void* operator new(std::size_t size) {
  if (alloc_countdown >= 0 && !alloc_exempt && alloc_countdown-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // this operator new is malloc's: free is its delete
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok && ++failures <= 30) std::cerr << "FAILED: " << what << "\n";
}

struct Item {
  uint64_t a, b;
};

constexpr uint64_t kPoison = 0xdddddddddddddddd;

struct Block {
  std::vector<uint64_t> words;  // the "device memory"
  bool free = true;
  int pins = 0;  // callers between get() and their read's enqueue (the test's own count, not the cache's)
};

struct FakeStream;

struct Op {
  enum Kind { kFill, kRead, kWait, kFree } kind;
  Block* block = nullptr;
  std::vector<Item> items;  // kFill: what to write; kRead: what must be there
  FakeStream* other = nullptr;
  uint64_t position = 0;
};

struct FakeStream {
  std::deque<Op> queue;
  uint64_t enqueued = 0, completed = 0;
  bool capturing = false;
  bool paused = false;     // the device runs nothing of it (work in flight)
  bool destroyed = false;  // its handle must not be used any more (its queued work still runs)
};

// Every enqueue, query and execution under one lock: the "driver".
struct FakeDevice {
  std::mutex mu;
  std::vector<std::unique_ptr<Block>> blocks;
  std::vector<std::unique_ptr<FakeStream>> streams;
  FakeStream* free_stream = nullptr;
  bool out_of_memory = false;
  size_t inline_items = 0;  // lists up to this long are "kernel parameters"
  int64_t live_blocks = 0;
  int64_t allocations = 0;
  int64_t fills = 0;
  int64_t live_events = 0;  // fill markers created and not yet dropped
  int fail_next_fill = 0;   // 1: fill throws; 2: fill_done throws; 3: allocate throws
  int fail_next_marker = 0;   // the next marker cannot be recorded
  int fail_next_release = 0;  // the next free fails
  std::atomic<int64_t> violations{0};
  std::mutex log_mu;
  // Called without the driver's lock between the two steps of a query-and-record (the stream and "query" when the
  // query comes first, "record" when the record does): another thread can act there.
  std::function<void(FakeStream*, const char*)> between_steps;
  std::function<void()> on_fill;  // called (without the driver's lock) when a fill is enqueued

  FakeDevice() { free_stream = new_stream(); }

  FakeStream* new_stream() {
    std::lock_guard<std::mutex> lock(mu);
    streams.push_back(std::make_unique<FakeStream>());
    return streams.back().get();
  }

  void violation(const std::string& what) {
    if (violations.fetch_add(1) < 10) {
      std::lock_guard<std::mutex> lock(log_mu);
      std::cerr << "violation: " << what << "\n";
    }
  }

  void enqueue(FakeStream* s, Op op) {  // mu held
    if (s->destroyed) violation("work enqueued on a destroyed stream");
    s->queue.push_back(std::move(op));
    s->enqueued += 1;
  }

  void set(FakeStream* s, bool FakeStream::*flag, bool value) {
    std::lock_guard<std::mutex> lock(mu);
    s->*flag = value;
  }

  // Runs up to `budget` operations, taking streams in an order drawn from `rng`. Returns how many ran.
  int progress(std::mt19937_64& rng, int budget) {
    std::lock_guard<std::mutex> lock(mu);
    int ran = 0;
    for (int round = 0; round < budget; ++round) {
      const size_t start = rng() % streams.size();
      bool any = false;
      for (size_t k = 0; k < streams.size() && !any; ++k) any = step(*streams[(start + k) % streams.size()]);
      if (!any) break;
      ++ran;
    }
    return ran;
  }

  void drain() {
    std::mt19937_64 rng(7);
    while (progress(rng, 1 << 20) > 0) {
    }
  }

  bool step(FakeStream& s) {  // mu held
    if (s.paused || s.queue.empty()) return false;
    Op& op = s.queue.front();
    switch (op.kind) {
      case Op::kWait:
        if (op.other->completed < op.position) return false;
        break;
      case Op::kFill:
        for (size_t i = 0; i < op.items.size(); ++i) {
          op.block->words[2 * i] = op.items[i].a;
          op.block->words[2 * i + 1] = op.items[i].b;
        }
        break;
      case Op::kRead:
        if (op.block->free) {
          violation("a queued read found its block freed");
          break;
        }
        for (size_t i = 0; i < op.items.size(); ++i) {
          if (op.block->words[2 * i] != op.items[i].a || op.block->words[2 * i + 1] != op.items[i].b) {
            violation("a queued read found another key's metadata or poison");
            break;
          }
        }
        break;
      case Op::kFree:
        if (op.block->free) violation("double free");
        if (op.block->pins > 0) violation("a pinned entry's memory was freed");
        std::fill(op.block->words.begin(), op.block->words.end(), kPoison);
        op.block->free = true;
        live_blocks -= 1;
        break;
    }
    s.queue.pop_front();
    s.completed += 1;
    return true;
  }
};

struct DeviceScope {  // in every call of the fake policy: its allocations never fail
  bool was = alloc_exempt;
  DeviceScope() { alloc_exempt = true; }
  ~DeviceScope() { alloc_exempt = was; }
};

struct FakePolicy {
  using Stream = FakeStream*;
  using Item = ::Item;
  struct Ready {
    FakeStream* stream = nullptr;
    uint64_t position = 0;
  };
  FakeDevice* dev;

  size_t inline_items() const { return dev->inline_items; }
  void* allocate(size_t bytes, Stream s) {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->destroyed) dev->violation("allocation on a destroyed stream");
    if (dev->fail_next_fill == 3) {
      dev->fail_next_fill = 0;
      throw std::runtime_error("allocation failed");
    }
    if (dev->out_of_memory) return nullptr;
    const size_t words = bytes / sizeof(uint64_t);
    for (auto& b : dev->blocks) {  // reuse only blocks whose free has run (like a pool without internal deps)
      if (b->free && b->words.size() >= words) {
        b->free = false;
        dev->live_blocks += 1;
        dev->allocations += 1;
        return b.get();
      }
    }
    dev->blocks.push_back(std::make_unique<Block>());
    Block* b = dev->blocks.back().get();
    b->words.assign(std::max<size_t>(words, 8), kPoison);
    b->free = false;
    dev->live_blocks += 1;
    dev->allocations += 1;
    return b;
  }
  // On a capturing stream the fill and its marker go into the capture: the fill never runs, and the marker reads
  // as complete (an event never recorded).
  void fill(void* data, const Item* items, size_t n, Stream s) {
    const DeviceScope device;
    if (dev->on_fill) dev->on_fill();
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->fail_next_fill == 1) {
      dev->fail_next_fill = 0;
      throw std::runtime_error("fill failed");
    }
    dev->fills += 1;
    if (!s->capturing) dev->enqueue(s, Op{Op::kFill, static_cast<Block*>(data), std::vector<Item>(items, items + n)});
  }
  Ready fill_done(Stream s) {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->fail_next_fill == 2) {
      dev->fail_next_fill = 0;
      throw std::runtime_error("event record failed");
    }
    dev->live_events += 1;
    return {s, s->capturing ? 0 : s->enqueued};
  }
  bool capturing(Stream s) noexcept {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    return s->capturing;
  }
  bool fill_complete(const Ready& r) {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    return r.stream->completed >= r.position;
  }
  void wait(const Ready& r, Stream s) {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->capturing) dev->violation("a wait enqueued on a capturing stream");
    dev->enqueue(s, Op{Op::kWait, nullptr, {}, r.stream, r.position});
  }
  void drop(Ready& r) noexcept {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (r.stream != nullptr) dev->live_events -= 1;
    r.stream = nullptr;
  }
  // The reader's marker: recorded on its own stream, then (second step) the stream is asked whether it is
  // capturing after all; the free stream waits on the marker only if not.
  bool end_read(Stream s) noexcept {
    const DeviceScope device;
    Ready marker;
    bool captured = false;
    {
      std::lock_guard<std::mutex> lock(dev->mu);
      if (s->destroyed) dev->violation("a marker recorded on a destroyed stream");
      if (dev->fail_next_marker > 0) {
        dev->fail_next_marker -= 1;
        return false;
      }
      marker = {s, s->enqueued};
      captured = s->capturing;
    }
    if (dev->between_steps) dev->between_steps(s, "record");
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->capturing) return false;
    if (captured) dev->violation("the free stream waits on a marker recorded in a capture");
    dev->enqueue(dev->free_stream, Op{Op::kWait, nullptr, {}, marker.stream, marker.position});
    return true;
  }
  // The earlier protocol's markers, recorded by the cache on a user stream at eviction time.
  void order_free_after(Stream s) {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->destroyed) dev->violation("a marker recorded on a destroyed stream");
    if (dev->fail_next_marker > 0) {
      dev->fail_next_marker -= 1;
      throw std::runtime_error("marker record failed");
    }
    if (s->capturing) dev->violation("a marker recorded on a capturing stream");
    dev->enqueue(dev->free_stream, Op{Op::kWait, nullptr, {}, s, s->enqueued});
  }
  bool order_free_after_unless_capturing(Stream s) {
    const DeviceScope device;  // the query, then (second step) the record
    {
      std::lock_guard<std::mutex> lock(dev->mu);
      if (s->destroyed) dev->violation("a destroyed stream was queried");
      if (s->capturing) return false;
    }
    if (dev->between_steps) dev->between_steps(s, "query");
    order_free_after(s);
    return true;
  }
  bool release(void* data, size_t) noexcept {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->fail_next_release > 0) {
      dev->fail_next_release -= 1;
      return false;
    }
    dev->enqueue(dev->free_stream, Op{Op::kFree, static_cast<Block*>(data), {}});
    return true;
  }
  void release_on(void* data, size_t, Stream s) noexcept {
    const DeviceScope device;
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->enqueue(s, Op{Op::kFree, static_cast<Block*>(data), {}});
  }
};

using Cache = torch_gradstats::metadata_cache::Cache<FakePolicy>;
constexpr size_t kCapacity = Cache::kCapacity;

// Key k: 1 to 5 items; with `collide`, hashes collide on purpose (k % 7), so the content compare decides (and the
// admission rule, which remembers missed keys by hash alone, is fooled: tests of admission use distinct hashes).
struct Key {
  std::vector<Item> items;
  uint64_t hash;
  size_t bytes() const { return items.size() * sizeof(Item); }
};

Key make_key(int k, bool collide = false) {
  Key key;
  for (int i = 0; i <= k % 5; ++i) key.items.push_back({uint64_t(k) * 1000 + uint64_t(i), ~uint64_t(k)});
  key.hash = collide ? uint64_t(k % 7) : (uint64_t(k) + 1) * 0x9e3779b97f4a7c15ull;
  return key;
}

enum Kind { kPerCall = 0, kCached = 1, kInline = 2 };

template <class L>
bool is_inline(const L& lease) {
  if constexpr (requires { lease.is_inline(); }) {
    return lease.is_inline();
  } else {
    return false;  // the earlier protocol had no inline path
  }
}

// One call of the op: look up, (let the device run meanwhile), enqueue the kernel's read, end the lease.
Kind call(Cache& cache, FakeDevice& dev, const Key& key, FakeStream* s, std::mt19937_64* rng = nullptr) {
  Cache::Lease lease = cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s);
  if (is_inline(lease)) return kInline;
  if (lease.data() == nullptr) return kPerCall;
  auto* block = static_cast<Block*>(const_cast<void*>(lease.data()));
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    block->pins += 1;
  }
  if (rng) {
    dev.progress(*rng, int((*rng)() % 8));
    if ((*rng)() % 16 == 0) std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    dev.enqueue(s, Op{Op::kRead, block, key.items});
    block->pins -= 1;
  }
  lease.reset();
  return kCached;
}

// A key used twice in a row: its second miss has the shortest reuse distance, so it is admitted whenever an
// unpinned entry can make room.
Kind call_twice(Cache& cache, FakeDevice& dev, const Key& key, FakeStream* s) {
  call(cache, dev, key, s);
  return call(cache, dev, key, s);
}

Block* block_of(Cache& cache, const Key& key, FakeStream* s) {
  Cache::Lease lease = cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s);
  return static_cast<Block*>(const_cast<void*>(lease.data()));
}

// The interleaving of two threads on one stream (e.g. the default stream): one holds its entry between lookup and
// launch while the other's misses evict. Unpinned, the entry would be evicted and its free ordered before the
// first thread's read.
void test_pinned_entry_survives_evictions_on_its_own_stream() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  const Key held = make_key(1000);
  Cache::Lease lease = cache.get(held.items.data(), held.items.size(), held.hash, held.bytes(), s);
  expect(lease.data() != nullptr, "pinned: the first lookup caches");
  auto* block = static_cast<Block*>(const_cast<void*>(lease.data()));
  for (int k = 0; k < 40; ++k) call_twice(cache, dev, make_key(k), s);
  dev.drain();  // everything enqueued so far runs, every free included
  expect(!block->free, "pinned: the held entry's memory was freed while pinned");
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    dev.enqueue(s, Op{Op::kRead, block, held.items});
  }
  lease.reset();
  dev.drain();
  expect(dev.violations.load() == 0, "pinned: a read saw freed memory");
  expect(cache.info().entries == int64_t(kCapacity), "pinned: the table is at capacity");
  // Unpinned now: the next admitted misses evict it.
  for (int k = 100; k < 140; ++k) call_twice(cache, dev, make_key(k), s);
  dev.drain();
  expect(block->free && dev.live_blocks == int64_t(kCapacity), "pinned: evicted and freed once unpinned");
  expect(dev.violations.load() == 0, "pinned: no violation after eviction");
}

void test_all_pinned_stays_at_capacity() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  std::vector<Cache::Lease> leases;
  for (int k = 0; k < int(kCapacity); ++k) {
    const Key key = make_key(k);
    leases.push_back(cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s));
  }
  for (int k = 100; k < 103; ++k) {
    expect(call_twice(cache, dev, make_key(k), s) == kPerCall, "all pinned: a miss takes the per-call path");
  }
  expect(cache.info().entries == int64_t(kCapacity), "all pinned: never over capacity");
  expect(cache.info().pinned == int64_t(kCapacity), "all pinned: every entry counts as pinned");
  leases.clear();
  expect(call_twice(cache, dev, make_key(500), s) == kCached, "all pinned: unpinned, a miss is admitted again");
  expect(cache.info().entries == int64_t(kCapacity), "all pinned: one eviction made room");
  dev.drain();
  expect(dev.live_blocks == int64_t(kCapacity), "all pinned: evicted memory freed");
  expect(dev.violations.load() == 0, "all pinned: no violation");
}

void test_lru_victim_and_admission() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  for (int k = 0; k < int(kCapacity); ++k) call(cache, dev, make_key(k, true), s);
  expect(dev.fills == int64_t(kCapacity), "lru: one fill per miss while there is room");
  for (int k = 0; k < int(kCapacity); ++k) call(cache, dev, make_key(k, true), s);
  expect(dev.fills == int64_t(kCapacity), "lru: hits fill nothing (colliding hashes included)");
  expect(call(cache, dev, make_key(99), s) == kPerCall, "lru: a key seen once evicts nothing");
  expect(dev.fills == int64_t(kCapacity) && dev.allocations == int64_t(kCapacity), "lru: ... nor allocates");
  call(cache, dev, make_key(0, true), s);  // 0 is now the most recent; 1 the least
  expect(call(cache, dev, make_key(99), s) == kCached, "lru: seen again soon, it is admitted");
  const int64_t before = dev.fills;
  call(cache, dev, make_key(0, true), s);
  expect(dev.fills == before, "lru: the recently used entry stayed");
  call_twice(cache, dev, make_key(1, true), s);
  expect(dev.fills == before + 1, "lru: the least recently used entry was the one evicted");
  dev.drain();
  expect(dev.violations.load() == 0, "lru: no violation");
}

// An entry read on stream A (whose work stays queued) is evicted by calls on stream B: B's calls enqueue nothing
// on A; the free waits for A's read through the marker A recorded when its lease ended.
void test_eviction_by_another_stream_waits_for_the_readers_marker() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* a = dev.new_stream();
  FakeStream* b = dev.new_stream();
  const Key key = make_key(7);
  dev.set(a, &FakeStream::paused, true);  // A's fill and read stay queued
  call(cache, dev, key, a);
  Block* block = dev.blocks.back().get();
  for (int k = 100; k < 100 + int(kCapacity) - 1; ++k) call(cache, dev, make_key(k), b);
  call_twice(cache, dev, make_key(300), b);  // evicts A's entry, the least recently used
  expect(cache.info().entries == int64_t(kCapacity), "other stream: A's entry evicted");
  size_t on_a = 0;
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    on_a = a->queue.size();
  }
  expect(on_a == 2, "other stream: B's calls enqueued nothing on A");
  dev.drain();
  expect(!block->free, "other stream: freed before A's read ran");
  dev.set(a, &FakeStream::paused, false);
  dev.drain();
  expect(block->free, "other stream: freed once A's read ran");
  expect(dev.violations.load() == 0, "other stream: no violation");
}

// Streams of other threads read entries, then go idle. Calls on an eager stream evict their entries. Whenever the
// cache asks one of those streams whether it is capturing, its thread begins a capture before the record that
// follows (the race of two calls). Fails on the earlier protocol, which ordered its frees after idle streams past
// a bound ("a marker recorded on a capturing stream"); the cache must never query or record on them.
void test_capture_begun_by_another_thread_between_query_and_record() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  std::vector<FakeStream*> others;
  for (int k = 0; k < int(kCapacity) * 3; ++k) {
    FakeStream* s = dev.new_stream();
    call_twice(cache, dev, make_key(k), s);
    others.push_back(s);
  }
  dev.drain();
  std::atomic<int> touched{0};
  dev.between_steps = [&](FakeStream* s, const char*) {
    if (std::find(others.begin(), others.end(), s) == others.end()) return;
    touched.fetch_add(1);
    std::thread capturer([&dev, s] { dev.set(s, &FakeStream::capturing, true); });  // that stream's thread
    capturer.join();
  };
  FakeStream* eager = dev.new_stream();
  int cached = 0;
  for (int k = 1000; k < 1100; ++k) cached += call_twice(cache, dev, make_key(k), eager) == kCached;
  dev.drain();
  expect(touched.load() == 0, "capture race: the cache asked about another thread's stream " +
                                  std::to_string(touched.load()) + " times");
  expect(cached == 100, "capture race: every admitted miss was cached");
  expect(dev.live_blocks == cache.info().entries, "capture race: every evicted entry was freed");
  expect(dev.violations.load() == 0, "capture race: no violation");
}

// A stream (an ExternalStream) is destroyed after its calls; its handle must never be used again. Fails on the
// earlier protocol, which kept the handle among an entry's users and marked it later.
void test_destroyed_streams_are_never_touched() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  for (int k = 0; k < int(kCapacity) * 3; ++k) {
    FakeStream* s = dev.new_stream();
    call_twice(cache, dev, make_key(k), s);
    dev.set(s, &FakeStream::destroyed, true);
  }
  FakeStream* eager = dev.new_stream();
  for (int k = 1000; k < 1100; ++k) call_twice(cache, dev, make_key(k), eager);
  dev.drain();
  expect(cache.info().retired == 0, "destroyed: nothing waits for a stream");
  expect(dev.live_blocks == cache.info().entries, "destroyed: every evicted entry was freed");
  expect(dev.violations.load() == 0, "destroyed: no use of a destroyed stream");
}

// The caller's own stream starts being captured (by another thread sharing it) between the record of its marker
// and the capture query that follows: the marker may be in the capture, so the free must not wait on it; the
// entry is never freed instead (no use-after-free), and the cache stays usable.
void test_capture_begun_on_the_readers_stream_keeps_the_entry() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  const Key key = make_key(5);
  bool once = true;
  dev.between_steps = [&](FakeStream* stream, const char* step) {
    if (stream != s || std::string(step) != "record" || !once) return;
    once = false;
    std::thread capturer([&dev, s] { dev.set(s, &FakeStream::capturing, true); });
    capturer.join();
  };
  call(cache, dev, key, s);
  Block* block = dev.blocks.back().get();
  expect(!once, "own stream: the marker is recorded when the lease ends");
  expect(cache.info().retired == 1 && cache.info().pinned == 0, "own stream: the entry is kept, unpinned");
  FakeStream* eager = dev.new_stream();
  for (int k = 1000; k < 1060; ++k) call_twice(cache, dev, make_key(k), eager);
  dev.drain();
  expect(!block->free, "own stream: the entry whose marker may be captured was freed");
  expect(cache.info().entries == int64_t(kCapacity), "own stream: the rest of the table still works");
  expect(dev.violations.load() == 0, "own stream: no violation");
}

// A reader whose marker cannot be recorded ends its lease (the entry becomes stuck, then unpinned) while an eviction
// examines that entry, between its loads of the pins and the stuck flag. The eviction must not take it: its read is
// ordered before no free. Fails when the eviction loads the stuck flag first (it sees neither: freed before the read).
void test_entry_stuck_during_an_eviction_scan_is_kept() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  FakeStream* other = dev.new_stream();
  for (int k = 0; k < int(kCapacity); ++k) call(cache, dev, make_key(k), s);
  dev.drain();
  const Key key = make_key(0);
  Cache::Lease reader = cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s);
  auto* block = static_cast<Block*>(const_cast<void*>(reader.data()));
  expect(block != nullptr, "stuck in a scan: the reader hits");
  dev.set(s, &FakeStream::paused, true);  // the reader's kernel stays queued
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    dev.enqueue(s, Op{Op::kRead, block, key.items});
  }
  for (int k = 1; k < int(kCapacity); ++k) call(cache, dev, make_key(k), other);  // the reader's entry is the LRU
  const Key evictor = make_key(300);
  call(cache, dev, evictor, other);  // first sighting: not admitted
  bool fired = false;
  between_eviction_loads = [&](void* data) {
    if (data != block || fired) return;
    fired = true;
    dev.fail_next_marker = 1;
    std::thread([&reader] { reader.reset(); }).join();  // the reader's thread
  };
  expect(call(cache, dev, evictor, other) == kCached, "stuck in a scan: the second sighting is admitted");
  between_eviction_loads = nullptr;
  expect(fired, "stuck in a scan: the reader ended its lease during the scan");
  dev.drain();
  expect(!block->free, "stuck in a scan: the stuck entry was freed before its reader's read");
  dev.set(s, &FakeStream::paused, false);
  dev.drain();
  const auto info = cache.info();
  expect(info.retired == 1 && info.pinned == 0, "stuck in a scan: the entry is kept, unpinned");
  expect(dev.violations.load() == 0, "stuck in a scan: no violation");
}

// Another thread begins a capture on the caller's stream between the op's capture check and its miss's fill: the
// fill is captured and never runs. The entry must never be served (its block holds no metadata) nor freed (the
// capture may own the block). Fails when the miss publishes its entry regardless (hits read poison).
void test_capture_begun_before_the_fill_keeps_the_entry_unserved() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  FakeStream* other = dev.new_stream();
  const Key key = make_key(9);
  dev.on_fill = [&dev, s] { std::thread([&dev, s] { dev.set(s, &FakeStream::capturing, true); }).join(); };
  const Kind first = call(cache, dev, key, s);
  dev.on_fill = nullptr;
  dev.set(s, &FakeStream::capturing, false);  // that capture ends; its graph is the other thread's
  Block* block = dev.blocks.back().get();
  expect(first == kPerCall, "capture before the fill: the call takes the per-call path");
  int served = 0;
  for (int i = 0; i < 3; ++i) served += call(cache, dev, key, other) != kPerCall;
  expect(served == 0, "capture before the fill: the entry was served " + std::to_string(served) + " times");
  auto info = cache.info();
  expect(info.entries == 1 && info.retired == 1 && info.pinned == 0, "capture before the fill: kept, unpinned");
  for (int k = 1000; k < 1060; ++k) call_twice(cache, dev, make_key(k), other);
  dev.drain();
  expect(!block->free, "capture before the fill: the entry was freed");
  expect(cache.info().entries == int64_t(kCapacity), "capture before the fill: the rest of the table works");
  expect(dev.violations.load() == 0, "capture before the fill: no violation");
}

void test_failures_leave_the_cache_consistent() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  for (int mode = 1; mode <= 3; ++mode) {  // fill, fill marker, allocation
    dev.fail_next_fill = mode;
    bool threw = false;
    try {
      call(cache, dev, make_key(mode), s);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    expect(threw, "failure: it propagates");
    dev.drain();
    const std::string m = " (mode " + std::to_string(mode) + ")";
    expect(dev.live_blocks == 0, "failure: the block of a failed miss is freed" + m);
    expect(dev.live_events == 0, "failure: no fill marker leaked" + m);
    const auto info = cache.info();
    expect(info.entries == 0 && info.bytes == 0 && info.pinned == 0, "failure: no entry is left behind" + m);
  }
  expect(call(cache, dev, make_key(1), s) == kCached, "failure: the next call caches");
  // A marker that cannot be recorded (on the earlier protocol: a throw in an eviction, after its insert and its erase).
  for (int k = 2; k <= int(kCapacity); ++k) call(cache, dev, make_key(k), s);
  dev.fail_next_marker = 1;
  try {
    call_twice(cache, dev, make_key(40), s);
  } catch (const std::runtime_error&) {
  }
  dev.drain();
  auto info = cache.info();
  expect(info.pinned == 0, "failure: a failed marker leaves no entry pinned");
  expect(dev.live_blocks == info.entries, "failure: a failed marker leaks no block");
  expect(dev.live_events == info.entries, "failure: a failed marker leaks no fill marker");
  expect(call_twice(cache, dev, make_key(41), s) == kCached, "failure: later misses are cached");
  // A free that fails is retried by a later call.
  dev.fail_next_release = 1;
  call_twice(cache, dev, make_key(42), s);
  const int64_t waiting = cache.info().retired;
  call(cache, dev, make_key(42), s);
  dev.drain();
  info = cache.info();
  expect(waiting == info.retired + 1, "failure: the failed free waited, then was retried");
  expect(dev.live_blocks == info.entries && dev.live_events == info.entries, "failure: the retried free ran");
  dev.out_of_memory = true;
  const int64_t entries = info.entries;
  expect(call_twice(cache, dev, make_key(43), s) == kPerCall, "failure: no memory -> the per-call path");
  dev.drain();
  expect(cache.info().entries == entries - 1 && dev.live_blocks == entries - 1,
         "failure: out of memory leaves a consistent table (the evicted entry freed, nothing inserted)");
  expect(dev.violations.load() == 0, "failure: no violation");
}

// A miss that evicts, with each of its host allocations (the eviction's list, the new entry, its key) failing in
// turn; then the same with the victim's free failing too. Each failure propagates and leaves the table consistent:
// the victim freed or waiting for a retry, no block or fill marker leaked, the byte count right, nothing pinned.
// Fails on a cache that drops its victim when the insertion throws (a leaked block), that counts the victim's bytes
// out before a throw keeps it, or whose noexcept free of a failed release allocates (std::terminate).
void test_host_allocation_failures_leave_the_cache_consistent() {
  for (int release_fails = 0; release_fails <= 1; ++release_fails) {
    FakeDevice dev;
    Cache cache(FakePolicy{&dev});
    FakeStream* s = dev.new_stream();
    auto key = [](int j) { return make_key(5 * j); };  // one item each: every entry holds the same bytes
    const int64_t entry_bytes = int64_t(key(0).bytes());
    int next = 0;
    bool completed = false;
    for (int fail_at = 0; !completed && fail_at < 50; ++fail_at) {
      while (cache.info().entries < int64_t(kCapacity)) call(cache, dev, key(next++), s);  // full: a miss evicts
      const Key fresh = key(next++);
      call(cache, dev, fresh, s);  // first sighting: the second one is admitted
      dev.fail_next_release = release_fails;
      bool threw = false;
      alloc_countdown = fail_at;
      try {
        Cache::Lease lease = cache.get(fresh.items.data(), fresh.items.size(), fresh.hash, fresh.bytes(), s);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      alloc_countdown = -1;
      completed = !threw;
      dev.fail_next_release = 0;
      dev.drain();
      const std::string m = " (allocation " + std::to_string(fail_at) + (release_fails ? ", its free failing)" : ")");
      auto info = cache.info();
      expect(info.pinned == 0, "host allocation: no entry left pinned" + m);
      expect(info.bytes == entry_bytes * info.entries, "host allocation: the byte count matches the entries" + m);
      expect(dev.live_blocks == info.entries + info.retired && dev.live_events == info.entries + info.retired,
             "host allocation: every block and fill marker is an entry's or waits for a retry" + m);
      call(cache, dev, key(0), s);  // retries a failed free
      dev.drain();
      info = cache.info();
      expect(info.retired == 0 && dev.live_blocks == info.entries, "host allocation: the free was retried" + m);
    }
    expect(completed, "host allocation: the miss completes once no allocation fails");
    expect(dev.violations.load() == 0, "host allocation: no violation");
  }
}

// Fills (kernel launches) run without the cache's lock: another thread's call must not wait for them. Fails on the
// earlier protocol, which filled under the lock.
void test_fill_runs_without_the_cache_lock() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  std::vector<std::future<void>> probes;
  dev.on_fill = [&] {
    probes.push_back(std::async(std::launch::async, [&cache] { (void)cache.info(); }));
    if (probes.back().wait_for(std::chrono::milliseconds(500)) != std::future_status::ready) {
      dev.violation("a fill was enqueued under the cache's lock");
    }
  };
  call(cache, dev, make_key(1), s);
  call(cache, dev, make_key(2), s);
  for (auto& p : probes) p.get();
  dev.on_fill = nullptr;
  expect(probes.size() == 2, "lock: both misses filled");
  expect(dev.violations.load() == 0, "lock: no fill under the lock");
}

// Many distinct small lists per step (a call per DDP bucket, per hook): passed as kernel parameters, they need no
// device metadata at all. Fails on the earlier protocol (an allocation and a fill on nearly every call).
void test_many_small_lists_allocate_nothing() {
  FakeDevice dev;
  dev.inline_items = 64;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  int inline_calls = 0;
  for (int step = 0; step < 10; ++step) {
    for (int k = 0; k < 100; ++k) inline_calls += call(cache, dev, make_key(k), s) == kInline;
  }
  expect(inline_calls == 1000, "small lists: every call inline (" + std::to_string(inline_calls) + ")");
  expect(dev.allocations == 0 && dev.fills == 0,
         "small lists: " + std::to_string(dev.allocations) + " allocations, " + std::to_string(dev.fills) + " fills");
  expect(cache.info().entries == 0, "small lists: no entry");
}

// Long lists, more of them than the capacity, alternating in a fixed order: a stable set stays cached (the rest
// take the per-call path) instead of each miss evicting the entry the next call needs. Fails on the earlier
// protocol (LRU: no hit at all, an allocation per call). A new set of lists then takes its place.
void test_many_long_lists_alternate_without_thrashing() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  int64_t later_allocations = 0;
  int min_hits = 1 << 30;
  for (int step = 0; step < 10; ++step) {
    const int64_t before = dev.allocations;
    int cached = 0;  // hits: cached without an allocation
    for (int k = 0; k < 40; ++k) {
      const int64_t allocations = dev.allocations;
      cached += call(cache, dev, make_key(k), s) == kCached && dev.allocations == allocations;
    }
    if (step > 0) {
      later_allocations += dev.allocations - before;
      min_hits = std::min(min_hits, cached);
    }
  }
  expect(later_allocations == 0, "long lists: " + std::to_string(later_allocations) + " allocations after step 1");
  expect(min_hits == int(kCapacity), "long lists: " + std::to_string(min_hits) + " hits per step (16 expected)");
  int64_t settled_allocations = 0;
  int settled_hits = 0;
  for (int step = 0; step < 6; ++step) {
    const int64_t before = dev.allocations;
    int hits = 0;
    for (int k = 500; k < 508; ++k) {
      const int64_t allocations = dev.allocations;
      hits += call(cache, dev, make_key(k), s) == kCached && dev.allocations == allocations;
    }
    if (step >= 3) {
      settled_hits += hits;
      settled_allocations += dev.allocations - before;
    }
  }
  expect(settled_hits == 24 && settled_allocations == 0, "long lists: a new working set takes over");
  dev.drain();
  expect(dev.violations.load() == 0, "long lists: no violation");
}

// 8 threads, each with two streams of its own and a shared one, over 48 keys (3 cache's worth): lookups, hits from
// new streams, evictions by other threads and streams, captures starting and ending, the device running queued
// work at random points. Every queued read must find its metadata; no pinned block may be freed.
void test_threads(int iterations) {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* shared = dev.new_stream();
  std::vector<Key> keys;
  for (int k = 0; k < 48; ++k) keys.push_back(make_key(k, true));
  std::atomic<int64_t> cached{0}, per_call{0};
  auto worker = [&](int t) {
    std::mt19937_64 rng(uint64_t(t) * 7919 + 1);
    FakeStream* own[2] = {dev.new_stream(), dev.new_stream()};
    int capturing = -1, capture_left = 0;
    for (int i = 0; i < iterations; ++i) {
      if (capturing < 0 && rng() % 500 == 0) {  // one own stream starts a capture for a while
        capturing = int(rng() % 2);
        capture_left = 50 + int(rng() % 200);
        dev.set(own[capturing], &FakeStream::capturing, true);
      } else if (capturing >= 0 && --capture_left == 0) {
        dev.set(own[capturing], &FakeStream::capturing, false);
        capturing = -1;
      }
      const int pick = int(rng() % 8);
      FakeStream* s = pick == 0 ? shared : own[pick % 2];
      if (s != shared && int(pick % 2) == capturing) s = own[1 - capturing];  // no eager call on a capturing stream
      const size_t k = (rng() % 3 == 0) ? rng() % keys.size() : (rng() % 12 + size_t(t) * 4) % keys.size();
      if (call(cache, dev, keys[k], s, &rng) == kCached) {
        cached.fetch_add(1, std::memory_order_relaxed);
      } else {
        per_call.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (capturing >= 0) dev.set(own[capturing], &FakeStream::capturing, false);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  dev.drain();
  const auto info = cache.info();
  expect(dev.violations.load() == 0, "threads: " + std::to_string(dev.violations.load()) + " violations");
  expect(cached.load() + per_call.load() == int64_t(8) * iterations, "threads: every call counted");
  expect(info.pinned == 0 && info.retired == 0, "threads: no pin left, nothing stuck");
  expect(info.entries <= int64_t(kCapacity), "threads: bounded");
  expect(dev.live_blocks == info.entries, "threads: every block is an entry's (no leak)");
  expect(dev.live_events == info.entries, "threads: every fill marker is an entry's (no leak)");
  std::cout << "threads: 8 x " << iterations << " calls, " << dev.fills << " fills (misses), " << per_call.load()
            << " per-call, " << info.entries << " live at the end\n";
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 100000;
  test_pinned_entry_survives_evictions_on_its_own_stream();
  test_all_pinned_stays_at_capacity();
  test_lru_victim_and_admission();
  test_eviction_by_another_stream_waits_for_the_readers_marker();
  test_capture_begun_by_another_thread_between_query_and_record();
  test_destroyed_streams_are_never_touched();
  test_capture_begun_on_the_readers_stream_keeps_the_entry();
  test_entry_stuck_during_an_eviction_scan_is_kept();
  test_capture_begun_before_the_fill_keeps_the_entry_unserved();
  test_failures_leave_the_cache_consistent();
  test_host_allocation_failures_leave_the_cache_consistent();
  test_fill_runs_without_the_cache_lock();
  test_many_small_lists_allocate_nothing();
  test_many_long_lists_alternate_without_thrashing();
  test_threads(iterations);
  if (failures > 0) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "metadata cache: all checks passed\n";
  return 0;
}
