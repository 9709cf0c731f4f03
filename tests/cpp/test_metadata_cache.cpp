// The metadata cache's bookkeeping (csrc/cuda/metadata_cache.h) over a fake device (ctest; no GPU, no torch).
//
// The fake device models what the CUDA policy relies on: streams are queues of operations that run later, in
// order, when the test lets the "device" make progress; a wait runs only once the stream it waits for has reached
// the recorded position; a free poisons its block and hands it back to a pool that reuses blocks. A kernel of the
// op is a Read that checks its block still holds the metadata of its key. So a free that runs before a read it
// should have waited for, or a block handed to another key while a read is queued, fails a Read; a free of a
// block that a caller has pinned fails at once; and a marker recorded on a stream while it is being captured is
// counted as a violation too.
//
//   test_metadata_cache [iterations per thread]   (default 100000; scripts/check_cache_sanitizer.sh passes fewer)
#include "cuda/metadata_cache.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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
  bool paused = false;  // the device runs nothing of it (work in flight)
};

// Every enqueue, query and execution under one lock: the "driver".
struct FakeDevice {
  std::mutex mu;
  std::vector<std::unique_ptr<Block>> blocks;
  std::vector<std::unique_ptr<FakeStream>> streams;
  FakeStream* free_stream = nullptr;
  size_t max_blocks = 1 << 20;
  int64_t live_blocks = 0;
  int64_t fills = 0;
  int fail_next_fill = 0;       // 1: fill throws; 2: fill_done throws
  std::atomic<int64_t> violations{0};
  std::mutex log_mu;

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
    s->queue.push_back(std::move(op));
    s->enqueued += 1;
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

struct FakePolicy {
  using Stream = FakeStream*;
  using Item = ::Item;
  struct Ready {
    FakeStream* stream = nullptr;
    uint64_t position = 0;
  };
  FakeDevice* dev;

  void* allocate(size_t bytes, Stream) {
    std::lock_guard<std::mutex> lock(dev->mu);
    const size_t words = bytes / sizeof(uint64_t);
    for (auto& b : dev->blocks) {  // reuse only blocks whose free has run (like a pool without internal deps)
      if (b->free && b->words.size() >= words) {
        b->free = false;
        dev->live_blocks += 1;
        return b.get();
      }
    }
    if (dev->blocks.size() >= dev->max_blocks) return nullptr;
    dev->blocks.push_back(std::make_unique<Block>());
    Block* b = dev->blocks.back().get();
    b->words.assign(std::max<size_t>(words, 8), kPoison);
    b->free = false;
    dev->live_blocks += 1;
    return b;
  }
  void fill(void* data, const Item* items, size_t n, Stream s) {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->fail_next_fill == 1) {
      dev->fail_next_fill = 0;
      throw std::runtime_error("fill failed");
    }
    dev->fills += 1;
    dev->enqueue(s, Op{Op::kFill, static_cast<Block*>(data), std::vector<Item>(items, items + n)});
  }
  Ready fill_done(Stream s) {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (dev->fail_next_fill == 2) {
      dev->fail_next_fill = 0;
      throw std::runtime_error("event record failed");
    }
    return {s, s->enqueued};
  }
  void wait(const Ready& r, Stream s) {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->capturing) dev->violation("a wait enqueued on a capturing stream");
    dev->enqueue(s, Op{Op::kWait, nullptr, {}, r.stream, r.position});
  }
  void drop(Ready&) noexcept {}
  void order_free_after(Stream s) {
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->capturing) dev->violation("a marker recorded on a capturing stream");
    dev->enqueue(dev->free_stream, Op{Op::kWait, nullptr, {}, s, s->enqueued});
  }
  bool order_free_after_unless_capturing(Stream s) {  // the check and the record in one step of the "driver"
    std::lock_guard<std::mutex> lock(dev->mu);
    if (s->capturing) return false;
    dev->enqueue(dev->free_stream, Op{Op::kWait, nullptr, {}, s, s->enqueued});
    return true;
  }
  void release(void* data, size_t) {
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->enqueue(dev->free_stream, Op{Op::kFree, static_cast<Block*>(data), {}});
  }
  void release_on(void* data, size_t, Stream s) noexcept {
    std::lock_guard<std::mutex> lock(dev->mu);
    dev->enqueue(s, Op{Op::kFree, static_cast<Block*>(data), {}});
  }
};

using Cache = torch_gradstats::metadata_cache::Cache<FakePolicy>;
constexpr size_t kCapacity = Cache::kCapacity;

// Key k: 1 to 5 items; hashes collide on purpose (k % 7), so the content compare decides.
struct Key {
  std::vector<Item> items;
  uint64_t hash;
  size_t bytes() const { return items.size() * sizeof(Item); }
};

Key make_key(int k) {
  Key key;
  for (int i = 0; i <= k % 5; ++i) key.items.push_back({uint64_t(k) * 1000 + uint64_t(i), ~uint64_t(k)});
  key.hash = uint64_t(k % 7);
  return key;
}

// One call of the op: look up, (let the device run meanwhile), enqueue the kernel's read, unpin.
bool call(Cache& cache, FakeDevice& dev, const Key& key, FakeStream* s, std::mt19937_64* rng = nullptr) {
  Cache::Lease lease = cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s);
  if (lease.data() == nullptr) return false;  // the per-call path
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
  return true;
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
  for (int k = 0; k < 40; ++k) call(cache, dev, make_key(k), s);
  dev.drain();  // everything enqueued so far runs, every free included
  expect(!block->free, "pinned: the held entry's memory was freed while pinned");
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    dev.enqueue(s, Op{Op::kRead, block, held.items});
  }
  lease.reset();
  dev.drain();
  expect(dev.violations.load() == 0, "pinned: a read saw freed memory");
  expect(cache.info().entries == int64_t(kCapacity), "pinned: the table is back at capacity");
  // Unpinned now: the next misses evict it.
  for (int k = 100; k < 140; ++k) call(cache, dev, make_key(k), s);
  dev.drain();
  expect(block->free || dev.live_blocks <= int64_t(kCapacity), "pinned: evicted once unpinned");
  expect(dev.violations.load() == 0, "pinned: no violation after eviction");
}

void test_all_pinned_goes_over_capacity_then_back() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  std::vector<Cache::Lease> leases;
  std::vector<Key> keys;
  for (int k = 0; k < int(kCapacity) + 3; ++k) keys.push_back(make_key(k));
  for (const Key& key : keys) leases.push_back(cache.get(key.items.data(), key.items.size(), key.hash, key.bytes(), s));
  expect(cache.info().entries == int64_t(kCapacity) + 3, "all pinned: nothing can be evicted");
  expect(cache.info().pinned == int64_t(kCapacity) + 3, "all pinned: every entry counts as pinned");
  leases.clear();
  call(cache, dev, make_key(500), s);
  expect(cache.info().entries == int64_t(kCapacity), "all pinned: one miss evicts back to capacity");
  dev.drain();
  expect(dev.live_blocks == int64_t(kCapacity), "all pinned: evicted memory freed");
  expect(dev.violations.load() == 0, "all pinned: no violation");
}

void test_lru_order_and_hits() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  for (int k = 0; k < int(kCapacity); ++k) call(cache, dev, make_key(k), s);
  expect(dev.fills == int64_t(kCapacity), "lru: one fill per miss");
  for (int k = 0; k < int(kCapacity); ++k) call(cache, dev, make_key(k), s);
  expect(dev.fills == int64_t(kCapacity), "lru: hits fill nothing (colliding hashes included)");
  call(cache, dev, make_key(0), s);        // 0 is now the most recent; 1 the least
  call(cache, dev, make_key(99), s);       // evicts 1
  const int64_t before = dev.fills;
  call(cache, dev, make_key(0), s);
  expect(dev.fills == before, "lru: the recently used entry stayed");
  call(cache, dev, make_key(1), s);
  expect(dev.fills == before + 1, "lru: the least recently used entry was evicted");
  dev.drain();
  expect(dev.violations.load() == 0, "lru: no violation");
}

// An entry read on stream A is evicted by calls on stream B while A's work is still queued: nothing is recorded on
// A by B's calls; the entry waits until A's next call, whose marker orders the free after A's queued read.
void test_eviction_by_another_stream_waits_for_its_next_call() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* a = dev.new_stream();
  FakeStream* b = dev.new_stream();
  const Key key = make_key(7);
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    a->paused = true;  // A's fill and read stay queued
  }
  call(cache, dev, key, a);
  Block* block = nullptr;
  for (auto& blk : dev.blocks) block = blk.get();
  for (int k = 100; k < 100 + int(kCapacity) + 1; ++k) call(cache, dev, make_key(k), b);
  expect(cache.info().retired == 1, "other stream: the evicted entry waits for A");
  size_t on_a = 0;
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    on_a = a->queue.size();
  }
  expect(on_a == 2, "other stream: B's calls enqueued nothing on A");
  dev.drain();
  expect(!block->free, "other stream: freed before A's read ran");
  call(cache, dev, make_key(300), a);  // A calls again: the free is ordered after A's queued work
  // (the one retired now is B's, evicted by A's miss)
  expect(cache.info().retired == 1, "other stream: A's call released the entry that waited for it");
  dev.drain();
  expect(!block->free, "other stream: the free ran while A was paused");
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    a->paused = false;
  }
  dev.drain();
  expect(block->free, "other stream: freed once A's read ran");
  expect(dev.violations.load() == 0, "other stream: no violation");
}

// Streams that used entries start capturing and never call again: nothing is ever recorded on them, the evicted
// entries wait, bounded: past the bound, misses take the per-call path (empty lease) instead of allocating.
void test_capturing_streams_are_never_marked_and_memory_stays_bounded() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  std::vector<FakeStream*> captured;
  for (int k = 0; k < int(kCapacity) * 3; ++k) {
    FakeStream* s = dev.new_stream();
    call(cache, dev, make_key(k), s);
    captured.push_back(s);
  }
  dev.drain();
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    for (FakeStream* s : captured) s->capturing = true;
  }
  FakeStream* eager = dev.new_stream();
  int per_call = 0;
  for (int k = 1000; k < 1100; ++k) per_call += !call(cache, dev, make_key(k), eager);
  dev.drain();
  const auto info = cache.info();
  expect(info.retired <= int64_t(Cache::kMaxRetired), "capture: retired entries stay bounded");
  expect(per_call > 0, "capture: past the bound, misses take the per-call path");
  expect(dev.live_blocks <= int64_t(kCapacity + Cache::kMaxRetired), "capture: memory stays bounded");
  // The captures end; an eager call on each stream orders what waited on it.
  {
    std::lock_guard<std::mutex> lock(dev.mu);
    for (FakeStream* s : captured) s->capturing = false;
  }
  for (FakeStream* s : captured) call(cache, dev, make_key(2000), s);
  expect(cache.info().retired == 0, "capture: every retired entry was released");
  expect(call(cache, dev, make_key(3000), eager), "capture: the cache serves misses again");
  dev.drain();
  expect(dev.violations.load() == 0, "capture: no violation (no marker on a capturing stream)");
}

// With more than kMaxRetired waiting on idle streams that are not capturing, the oldest is ordered after them.
void test_idle_streams_past_the_bound_are_marked_when_not_capturing() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  for (int k = 0; k < int(kCapacity) * 3; ++k) call(cache, dev, make_key(k), dev.new_stream());
  FakeStream* eager = dev.new_stream();
  int per_call = 0;
  for (int k = 1000; k < 1100; ++k) per_call += !call(cache, dev, make_key(k), eager);
  expect(per_call == 0, "idle: every miss is cached");
  expect(cache.info().retired <= int64_t(Cache::kMaxRetired), "idle: retired entries stay bounded");
  dev.drain();
  expect(dev.live_blocks <= int64_t(kCapacity + Cache::kMaxRetired), "idle: memory stays bounded");
  expect(dev.violations.load() == 0, "idle: no violation");
}

void test_failed_miss_returns_its_memory() {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* s = dev.new_stream();
  for (int mode = 1; mode <= 2; ++mode) {
    {
      std::lock_guard<std::mutex> lock(dev.mu);
      dev.fail_next_fill = mode;
    }
    bool threw = false;
    try {
      call(cache, dev, make_key(mode), s);
    } catch (const std::runtime_error&) {
      threw = true;
    }
    expect(threw, "error path: the failure propagates");
    dev.drain();
    expect(dev.live_blocks == 0, "error path: the block of a failed miss is freed (mode " + std::to_string(mode) + ")");
    expect(cache.info().entries == 0 && cache.info().bytes == 0, "error path: no entry is left behind");
  }
  expect(call(cache, dev, make_key(1), s), "error path: the next call caches");
  dev.max_blocks = dev.blocks.size();  // out of memory from here
  expect(!call(cache, dev, make_key(2), s), "error path: no memory -> the per-call path");
  dev.drain();
  expect(dev.live_blocks == 1 && cache.info().entries == 1, "error path: out of memory leaves the cache as it was");
  expect(dev.violations.load() == 0, "error path: no violation");
}

// 8 threads, each with two streams of its own and a shared one, over 48 keys (3 cache's worth): lookups, hits from
// new streams, evictions by other threads and streams, captures starting and ending, the device running queued
// work at random points. Every queued read must find its metadata; no pinned block may be freed.
void test_threads(int iterations) {
  FakeDevice dev;
  Cache cache(FakePolicy{&dev});
  FakeStream* shared = dev.new_stream();
  std::vector<Key> keys;
  for (int k = 0; k < 48; ++k) keys.push_back(make_key(k));
  std::atomic<int64_t> hits_or_misses{0}, per_call{0};
  auto worker = [&](int t) {
    std::mt19937_64 rng(uint64_t(t) * 7919 + 1);
    FakeStream* own[2] = {dev.new_stream(), dev.new_stream()};
    int capturing = -1, capture_left = 0;
    for (int i = 0; i < iterations; ++i) {
      if (capturing < 0 && rng() % 500 == 0) {  // one own stream starts a capture for a while
        capturing = int(rng() % 2);
        capture_left = 50 + int(rng() % 200);
        std::lock_guard<std::mutex> lock(dev.mu);
        own[capturing]->capturing = true;
      } else if (capturing >= 0 && --capture_left == 0) {
        std::lock_guard<std::mutex> lock(dev.mu);
        own[capturing]->capturing = false;
        capturing = -1;
      }
      const int pick = int(rng() % 8);
      FakeStream* s = pick == 0 ? shared : own[pick % 2];
      if (s != shared && int(pick % 2) == capturing) s = own[1 - capturing];  // no eager call on a capturing stream
      const size_t k = (rng() % 3 == 0) ? rng() % keys.size() : (rng() % 12 + size_t(t) * 4) % keys.size();
      if (call(cache, dev, keys[k], s, &rng)) {
        hits_or_misses.fetch_add(1, std::memory_order_relaxed);
      } else {
        per_call.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (capturing >= 0) {
      std::lock_guard<std::mutex> lock(dev.mu);
      own[capturing]->capturing = false;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  dev.drain();
  const auto info = cache.info();
  expect(dev.violations.load() == 0, "threads: " + std::to_string(dev.violations.load()) + " violations");
  expect(hits_or_misses.load() + per_call.load() == int64_t(8) * iterations, "threads: every call counted");
  expect(info.pinned == 0, "threads: no pin left");
  expect(info.entries <= int64_t(kCapacity) && info.retired <= int64_t(Cache::kMaxRetired), "threads: bounded");
  expect(dev.live_blocks == info.entries + info.retired, "threads: every block is an entry's (no leak)");
  std::cout << "threads: 8 x " << iterations << " calls, " << dev.fills << " fills (misses), " << per_call.load()
            << " per-call, " << info.entries << " live and " << info.retired << " retired at the end\n";
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 100000;
  test_pinned_entry_survives_evictions_on_its_own_stream();
  test_all_pinned_goes_over_capacity_then_back();
  test_lru_order_and_hits();
  test_eviction_by_another_stream_waits_for_its_next_call();
  test_capturing_streams_are_never_marked_and_memory_stays_bounded();
  test_idle_streams_past_the_bound_are_marked_when_not_capturing();
  test_failed_miss_returns_its_memory();
  test_threads(iterations);
  if (failures > 0) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "metadata cache: all checks passed\n";
  return 0;
}
