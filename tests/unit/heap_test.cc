// SPDX-License-Identifier: MIT
//
// Unit tests for src/heap.h: the private allocator of a context segment's
// heap area. First-fit over a coalesced free list; every block is a multiple
// of 64 bytes and aligned as requested; 0 means failure.

#include "heap.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <vector>

namespace shmrdma {
namespace {

constexpr uint64_t kBase = 3 * 4096;  // never 0: 0 is the failure value

uint64_t round64(uint64_t v) { return (v + 63) & ~uint64_t{63}; }

TEST(Heap, StartsWithOneFreeBlock) {
  HeapAllocator h(kBase, 65536);
  EXPECT_EQ(h.bytes_free(), 65536u);
  // The whole heap in one piece proves it is one block.
  EXPECT_EQ(h.allocate(65536, 64), kBase);
  EXPECT_EQ(h.bytes_free(), 0u);
}

TEST(Heap, ResetTrimsToCacheLines) {
  HeapAllocator h(100, 1000);  // [100, 1100) -> [128, 1088)
  EXPECT_EQ(h.bytes_free(), 960u);
  EXPECT_EQ(h.allocate(64, 64), 128u);
  h.reset(kBase, 63);  // smaller than one cache line: nothing usable
  EXPECT_EQ(h.bytes_free(), 0u);
  EXPECT_EQ(h.allocate(64, 64), 0u);
  h.reset(kBase, 4096);  // reset forgets everything allocated before
  EXPECT_EQ(h.bytes_free(), 4096u);
  EXPECT_EQ(h.allocate(4096, 4096), kBase);
}

TEST(Heap, DefaultConstructedIsEmpty) {
  HeapAllocator h;
  EXPECT_EQ(h.bytes_free(), 0u);
  EXPECT_EQ(h.allocate(64, 64), 0u);
}

TEST(Heap, AllocateRoundsTo64AndAccountsBytes) {
  HeapAllocator h(kBase, 65536);
  uint64_t a = h.allocate(100, 64);
  EXPECT_EQ(a, kBase);
  EXPECT_EQ(h.bytes_free(), 65536u - 128);
  uint64_t b = h.allocate(1, 64);
  EXPECT_EQ(b, kBase + 128);
  EXPECT_EQ(h.bytes_free(), 65536u - 192);
  h.release(a, 100);
  EXPECT_EQ(h.bytes_free(), 65536u - 64);
  // First fit: the hole left by a is reused.
  EXPECT_EQ(h.allocate(128, 64), kBase);
  h.release(b, 1);
  h.release(kBase, 128);
  EXPECT_EQ(h.bytes_free(), 65536u);
}

TEST(Heap, RejectsBadArguments) {
  HeapAllocator h(kBase, 65536);
  EXPECT_EQ(h.allocate(0, 64), 0u);
  EXPECT_EQ(h.allocate(64, 0), 0u);
  EXPECT_EQ(h.allocate(64, 32), 0u);    // below a cache line
  EXPECT_EQ(h.allocate(64, 96), 0u);    // not a power of two
  EXPECT_EQ(h.allocate(64, 4097), 0u);  // not a power of two
  EXPECT_EQ(h.bytes_free(), 65536u);
  h.release(kBase, 0);  // releasing nothing changes nothing
  EXPECT_EQ(h.bytes_free(), 65536u);
}

TEST(Heap, HonoursAlignment64And4096) {
  HeapAllocator h(kBase, 8 * 4096);
  uint64_t a = h.allocate(64, 64);
  ASSERT_EQ(a, kBase);
  uint64_t p = h.allocate(4096, 4096);
  ASSERT_NE(p, 0u);
  EXPECT_EQ(p % 4096, 0u);
  EXPECT_EQ(p, kBase + 4096);
  EXPECT_EQ(h.bytes_free(), 8u * 4096 - 64 - 4096);
  // The gap before the aligned block stays free and is used first.
  uint64_t c = h.allocate(64, 64);
  EXPECT_EQ(c, kBase + 64);
  // An aligned request skips gaps that are too small once aligned.
  uint64_t q = h.allocate(100, 4096);
  EXPECT_EQ(q % 4096, 0u);
  EXPECT_EQ(q, kBase + 2 * 4096);
}

TEST(Heap, AlignmentWithAnUnalignedBase) {
  HeapAllocator h(64, 5 * 4096);  // [64, 20544)
  uint64_t p = h.allocate(4096, 4096);
  EXPECT_EQ(p, 4096u);
  uint64_t q = h.allocate(64, 1024);
  EXPECT_EQ(q, 1024u);  // from the head fragment [64, 4096)
  uint64_t r = h.allocate(64, 64);
  EXPECT_EQ(r, 64u);
  EXPECT_EQ(h.bytes_free(), 5u * 4096 - 4096 - 128);
}

TEST(Heap, ExhaustionReturnsZero) {
  HeapAllocator h(kBase, 4096);
  EXPECT_EQ(h.allocate(4097, 64), 0u);  // larger than the heap
  EXPECT_EQ(h.bytes_free(), 4096u);
  std::vector<uint64_t> blocks;
  for (int i = 0; i < 64; ++i) {
    uint64_t b = h.allocate(64, 64);
    ASSERT_NE(b, 0u) << i;
    blocks.push_back(b);
  }
  EXPECT_EQ(h.bytes_free(), 0u);
  EXPECT_EQ(h.allocate(64, 64), 0u);
  EXPECT_EQ(h.bytes_free(), 0u);
  // Fragmented: 2 KiB free in total, but no 128-byte run.
  for (size_t i = 0; i < blocks.size(); i += 2) h.release(blocks[i], 64);
  EXPECT_EQ(h.bytes_free(), 2048u);
  EXPECT_EQ(h.allocate(128, 64), 0u);
  EXPECT_EQ(h.bytes_free(), 2048u);
  EXPECT_NE(h.allocate(64, 64), 0u);
}

TEST(Heap, CoalescesInEveryReleaseOrder) {
  std::vector<int> order{0, 1, 2, 3};
  do {
    HeapAllocator h(kBase, 4096);
    uint64_t b[4];
    for (int i = 0; i < 4; ++i) {
      b[i] = h.allocate(1024, 64);
      ASSERT_EQ(b[i], kBase + 1024u * i);
    }
    ASSERT_EQ(h.allocate(64, 64), 0u);
    for (int i : order) h.release(b[i], 1024);
    EXPECT_EQ(h.bytes_free(), 4096u);
    // Only a fully coalesced free list can hand out the whole heap again.
    EXPECT_EQ(h.allocate(4096, 64), kBase) << order[0] << order[1] << order[2] << order[3];
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST(Heap, MergesWithBothNeighbours) {
  HeapAllocator h(kBase, 3 * 1024);
  uint64_t a = h.allocate(1024, 64), b = h.allocate(1024, 64), c = h.allocate(1024, 64);
  h.release(a, 1024);
  h.release(c, 1024);
  EXPECT_EQ(h.allocate(2048, 64), 0u);  // two separate 1 KiB holes
  h.release(b, 1024);                   // joins a, b and c
  EXPECT_EQ(h.allocate(3072, 64), kBase);
}

TEST(Heap, DoubleReleaseOfAStandaloneBlockIsIgnored) {
  HeapAllocator h(kBase, 4096);
  uint64_t a = h.allocate(64, 64), b = h.allocate(64, 64), c = h.allocate(64, 64);
  ASSERT_TRUE(a && b && c);
  h.release(b, 64);
  uint64_t before = h.bytes_free();
  h.release(b, 64);
  EXPECT_EQ(h.bytes_free(), before);
  // The same block is handed out once only.
  EXPECT_EQ(h.allocate(64, 64), b);
  EXPECT_NE(h.allocate(64, 64), b);
}

// Allocates 64-byte blocks until the heap is exhausted and checks that no two
// overlap and that no more bytes came out than the heap has.
void expect_consistent_after_draining(HeapAllocator& h, std::map<uint64_t, uint64_t> live, uint64_t heap_bytes) {
  for (int guard = 0; guard < 10000; ++guard) {
    uint64_t p = h.allocate(64, 64);
    if (!p) break;
    auto it = live.upper_bound(p);
    bool overlap = (it != live.end() && it->first < p + 64) ||
                   (it != live.begin() && std::prev(it)->first + std::prev(it)->second > p);
    EXPECT_FALSE(overlap) << "block " << p << " handed out twice";
    if (overlap) return;
    live.emplace(p, 64);
  }
  uint64_t used = 0;
  for (auto& [o, l] : live) used += l;
  EXPECT_LE(used, heap_bytes);
  EXPECT_EQ(h.bytes_free(), 0u);
}

// Regression: release() once detected a double release only when the block's
// offset was still a key of the free map. A block coalesced into its
// predecessor is no longer a key, so a second release inserted an
// overlapping free entry and corrupted the accounting.
TEST(Heap, DoubleReleaseOfABlockMergedIntoItsPredecessorIsIgnored) {
  HeapAllocator h(kBase, 4096);
  uint64_t a = h.allocate(64, 64), b = h.allocate(64, 64), c = h.allocate(64, 64);
  ASSERT_TRUE(a && b && c);
  h.release(a, 64);
  h.release(b, 64);  // merges into a's free block: {a: 128}
  uint64_t before = h.bytes_free();
  h.release(b, 64);  // double release
  EXPECT_EQ(h.bytes_free(), before);
  EXPECT_LE(h.bytes_free(), 4096u);
  expect_consistent_after_draining(h, {{c, 64}}, 4096);
}

TEST(Heap, DoubleReleaseOfABlockMergedWithTheFreeTailIsIgnored) {
  HeapAllocator h(kBase, 4096);
  uint64_t a = h.allocate(64, 64), b = h.allocate(64, 64);
  ASSERT_TRUE(a && b);
  h.release(b, 64);  // merges with the free tail: {b: 4096-64}
  h.release(a, 64);  // the tail merges into a: {a: 4096}
  EXPECT_EQ(h.bytes_free(), 4096u);
  h.release(b, 64);  // double release of a block inside a free block
  EXPECT_EQ(h.bytes_free(), 4096u);
  expect_consistent_after_draining(h, {}, 4096);
}

// Randomised: every result is checked against a model of the live blocks.
// A failed allocation must be a real failure: no free gap of the model can
// hold the aligned request.
void run_random(uint32_t seed) {
  SCOPED_TRACE(seed);
  const uint64_t heap_off = kBase + 64;  // not page aligned on purpose
  const uint64_t heap_len = 1u << 20;
  HeapAllocator h(heap_off, heap_len);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded size
  std::map<uint64_t, uint64_t> asked;  // offset -> size passed to allocate
  uint64_t used = 0;
  std::mt19937 rng(seed);
  const uint64_t aligns[] = {64, 64, 64, 128, 256, 4096};
  int allocated = 0, failed = 0;
  for (int op = 0; op < 20000; ++op) {
    bool do_alloc = live.empty() || (rng() % 100) < 55;
    if (do_alloc) {
      uint64_t size = (rng() % 4 == 0) ? 1 + rng() % 65536 : 1 + rng() % 2048;
      uint64_t align = aligns[rng() % std::size(aligns)];
      uint64_t p = h.allocate(size, align);
      if (p) {
        ++allocated;
        uint64_t len = round64(size);
        ASSERT_EQ(p % align, 0u);
        ASSERT_GE(p, heap_off);
        ASSERT_LE(p + len, heap_off + heap_len);
        auto it = live.upper_bound(p);
        if (it != live.end()) {
          ASSERT_LE(p + len, it->first) << "overlaps the next live block";
        }
        if (it != live.begin()) {
          auto pr = std::prev(it);
          ASSERT_LE(pr->first + pr->second, p) << "overlaps the previous live block";
        }
        live.emplace(p, len);
        asked.emplace(p, size);
        used += len;
      } else {
        ++failed;
        // Check every gap of the model.
        uint64_t cur = (heap_off + 63) & ~uint64_t{63};
        uint64_t len = round64(size);
        auto fits = [&](uint64_t gs, uint64_t ge) {
          uint64_t a = (gs + align - 1) & ~(align - 1);
          return a >= gs && a <= ge && ge - a >= len;
        };
        for (auto& [o, l] : live) {
          ASSERT_FALSE(fits(cur, o)) << "allocate(" << size << ", " << align << ") failed but [" << cur << ", " << o
                                     << ") is free";
          cur = o + l;
        }
        ASSERT_FALSE(fits(cur, heap_off + heap_len)) << "tail gap";
      }
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      h.release(it->first, asked[it->first]);
      used -= it->second;
      asked.erase(it->first);
      live.erase(it);
    }
    ASSERT_EQ(h.bytes_free(), heap_len - used) << "op " << op;
  }
  EXPECT_GT(allocated, 1000);
  EXPECT_GT(failed, 0) << "the test should also exercise exhaustion";
  for (auto& [o, s] : asked) h.release(o, s);
  EXPECT_EQ(h.bytes_free(), heap_len);
  EXPECT_EQ(h.allocate(heap_len, 64), heap_off);
}

TEST(Heap, RandomisedAgainstAModel) {
  for (uint32_t seed : {1u, 2u, 3u, 42u, 12345u}) run_random(seed);
}

}  // namespace
}  // namespace shmrdma
