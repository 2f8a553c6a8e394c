// SPDX-License-Identifier: MIT
//
// Unit tests for src/layout.h: the geometry of context segments and the
// registry size, and the MR table's seqlock. Attachers recompute the
// geometry and compare it with what a header claims, so it must be a pure
// function of the heap size, its tables must not overlap each other, the
// header or the heap, and every offset must keep the alignment the rings
// and atomics rely on.

#include "layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace shmrdma::layout {
namespace {

constexpr uint64_t kHeapSizes[] = {0, 1, 63, 64, 4095, 4096, 4097, 16ull << 20, (16ull << 20) + 1, 512ull << 20,
                                   (1ull << 40) + 12345};

struct Range {
  const char* what;
  uint64_t begin, end;
};

std::vector<Range> ranges_of(const ContextLayout& l) {
  return {
      {"header", 0, sizeof(ContextHeader)},
      {"pd_table", l.pd_table, l.pd_table + sizeof(PdEntry) * l.pd_slots},
      {"cq_table", l.cq_table, l.cq_table + sizeof(CqEntry) * l.cq_slots},
      {"wq_table", l.wq_table, l.wq_table + sizeof(WqEntry) * l.wq_slots},
      {"ind_table", l.ind_table, l.ind_table + sizeof(IndTableEntry) * l.ind_slots},
      {"mr_table", l.mr_table, l.mr_table + sizeof(MrEntry) * l.mr_slots},
      {"qp_table", l.qp_table, l.qp_table + sizeof(QpEntry) * l.qp_slots},
      {"srq_table", l.srq_table, l.srq_table + sizeof(SrqEntry) * l.srq_slots},
      {"counters", l.counters, l.counters + sizeof(ContextCounters)},
      {"qp_counters", l.qp_counters, l.qp_counters + sizeof(QpCounterRecord) * l.qp_slots},
      {"heap", l.heap_offset, l.heap_offset + l.heap_size},
  };
}

bool same(const ContextLayout& a, const ContextLayout& b) {
  return a.pd_table == b.pd_table && a.cq_table == b.cq_table && a.wq_table == b.wq_table &&
         a.ind_table == b.ind_table && a.pd_slots == b.pd_slots && a.cq_slots == b.cq_slots &&
         a.wq_slots == b.wq_slots && a.ind_slots == b.ind_slots && a.mr_table == b.mr_table &&
         a.qp_table == b.qp_table && a.srq_table == b.srq_table && a.mr_slots == b.mr_slots &&
         a.qp_slots == b.qp_slots && a.srq_slots == b.srq_slots && a.heap_offset == b.heap_offset &&
         a.heap_size == b.heap_size && a.total_size == b.total_size && a.counters == b.counters &&
         a.qp_counters == b.qp_counters;
}

TEST(ContextLayout, IsDeterministic) {
  for (uint64_t h : kHeapSizes) {
    // volatile: make sure the second computation really happens at run time
    // and is compared with an independent one.
    volatile uint64_t vh = h;
    ContextLayout a = compute_context_layout(h);
    ContextLayout b = compute_context_layout(vh);
    EXPECT_TRUE(same(a, b)) << "heap " << h;
  }
  // Compile-time evaluation agrees with run-time evaluation.
  constexpr ContextLayout c = compute_context_layout(16ull << 20);
  volatile uint64_t vh = 16ull << 20;
  EXPECT_TRUE(same(c, compute_context_layout(vh)));
}

TEST(ContextLayout, TableSizesComeFromTheLimits) {
  ContextLayout l = compute_context_layout(1 << 20);
  EXPECT_EQ(l.pd_slots, limits::kCtxPdSlots);
  EXPECT_EQ(l.cq_slots, limits::kCtxCqSlots);
  EXPECT_EQ(l.wq_slots, limits::kCtxWqSlots);
  EXPECT_EQ(l.ind_slots, limits::kCtxIndTableSlots);
  EXPECT_EQ(l.mr_slots, limits::kMaxMr);
  EXPECT_EQ(l.qp_slots, limits::kMaxQp);
  EXPECT_EQ(l.srq_slots, limits::kMaxSrq);
  // A context may hold the device-wide maximum of each kind.
  EXPECT_GE(l.pd_slots, limits::kMaxPd);
  EXPECT_GE(l.cq_slots, limits::kMaxCq);
  EXPECT_GE(l.wq_slots, limits::kMaxWq);
  EXPECT_GE(l.ind_slots, limits::kMaxRwqIndTables);
}

TEST(ContextLayout, RegionsDoNotOverlapAndAreOrdered) {
  for (uint64_t h : kHeapSizes) {
    ContextLayout l = compute_context_layout(h);
    std::vector<Range> r = ranges_of(l);
    for (const Range& x : r) EXPECT_LE(x.begin, x.end) << x.what;
    for (size_t i = 0; i < r.size(); ++i)
      for (size_t j = i + 1; j < r.size(); ++j) {
        bool overlap = r[i].begin < r[j].end && r[j].begin < r[i].end && r[i].begin != r[i].end &&
                       r[j].begin != r[j].end;
        EXPECT_FALSE(overlap) << r[i].what << " [" << r[i].begin << "," << r[i].end << ") overlaps " << r[j].what
                              << " [" << r[j].begin << "," << r[j].end << ") heap " << h;
      }
    // In file order, each region starts at or after the end of the previous one.
    for (size_t i = 1; i < r.size(); ++i)
      EXPECT_GE(r[i].begin, r[i - 1].end) << r[i].what << " after " << r[i - 1].what;
  }
}

TEST(ContextLayout, OffsetsAreAligned) {
  for (uint64_t h : kHeapSizes) {
    ContextLayout l = compute_context_layout(h);
    // The first table starts on its own page, after the header page.
    EXPECT_EQ(l.pd_table % kPageSize, 0u) << h;
    EXPECT_GE(l.pd_table, sizeof(ContextHeader));
    EXPECT_EQ(l.cq_table % kCacheLine, 0u) << h;
    EXPECT_EQ(l.wq_table % kCacheLine, 0u) << h;
    EXPECT_EQ(l.ind_table % kCacheLine, 0u) << h;
    EXPECT_EQ(l.mr_table % kCacheLine, 0u) << h;
    EXPECT_EQ(l.qp_table % kCacheLine, 0u) << h;
    EXPECT_EQ(l.srq_table % kCacheLine, 0u) << h;
    // Counter records are written by their owner alone: each on lines of its own.
    EXPECT_EQ(l.counters % kCacheLine, 0u) << h;
    EXPECT_EQ(l.qp_counters % kCacheLine, 0u) << h;
    EXPECT_EQ(sizeof(QpCounterRecord) % kCacheLine, 0u);
    // The heap holds rings whose pages are punched out on release.
    EXPECT_EQ(l.heap_offset % kPageSize, 0u) << h;
    EXPECT_EQ(l.heap_size % kPageSize, 0u) << h;
    EXPECT_EQ(l.total_size % kPageSize, 0u) << h;
    // Atomics in the tables are naturally aligned.
    EXPECT_EQ(l.cq_table % alignof(CqEntry), 0u);
    EXPECT_EQ(l.wq_table % alignof(WqEntry), 0u);
    EXPECT_EQ(l.ind_table % alignof(IndTableEntry), 0u);
    EXPECT_EQ(l.mr_table % alignof(MrEntry), 0u);
    EXPECT_EQ(l.qp_table % alignof(QpEntry), 0u);
    EXPECT_EQ(l.srq_table % alignof(SrqEntry), 0u);
  }
}

TEST(ContextLayout, HeapIsAtTheEndAndTotalIsHeapEnd) {
  const uint64_t fixed = compute_context_layout(0).heap_offset;
  for (uint64_t h : kHeapSizes) {
    ContextLayout l = compute_context_layout(h);
    EXPECT_EQ(l.heap_size, align_up(h, kPageSize)) << h;
    EXPECT_GE(l.heap_size, h) << h;
    EXPECT_LT(l.heap_size - h, uint64_t{kPageSize}) << h;
    EXPECT_EQ(l.total_size, l.heap_offset + l.heap_size) << h;
    // Nothing after the heap: every table ends at or before the heap starts.
    for (const Range& r : ranges_of(l)) {
      if (std::string_view(r.what) != "heap") {
        EXPECT_LE(r.end, l.heap_offset) << r.what;
      }
    }
    // The fixed part does not depend on the heap size, which is what lets an
    // attacher recover the heap size from the file size.
    EXPECT_EQ(l.heap_offset, fixed) << h;
    EXPECT_TRUE(same(compute_context_layout(l.total_size - fixed), l)) << h;
  }
}

TEST(ContextLayout, HeapOffsetIsTight) {
  // The heap starts at the first page boundary after the last table, not
  // further: no whole page is wasted between the tables and the heap.
  ContextLayout l = compute_context_layout(4096);
  uint64_t last_end = 0;
  for (const Range& r : ranges_of(l))
    if (std::string_view(r.what) != "heap") last_end = std::max(last_end, r.end);
  EXPECT_EQ(l.heap_offset, align_up(last_end, kPageSize));
  EXPECT_EQ(l.pd_table, align_up(sizeof(ContextHeader), kPageSize));
}

TEST(RegistryLayout, SizeIsPageAlignedAndHoldsTheSegment) {
  constexpr uint64_t s = registry_size();
  EXPECT_EQ(s % kPageSize, 0u);
  EXPECT_GE(s, sizeof(RegistrySegment));
  EXPECT_LT(s - sizeof(RegistrySegment), uint64_t{kPageSize});
  EXPECT_EQ(offsetof(RegistrySegment, contexts) % kCacheLine, 0u);
  EXPECT_LE(offsetof(RegistrySegment, contexts) + sizeof(ContextSlot) * limits::kMaxContexts, s);
}

TEST(Layout, AlignUp) {
  EXPECT_EQ(align_up(0, 64), 0u);
  EXPECT_EQ(align_up(1, 64), 64u);
  EXPECT_EQ(align_up(64, 64), 64u);
  EXPECT_EQ(align_up(65, 64), 128u);
  EXPECT_EQ(align_up(4097, 4096), 8192u);
}

// mr_entry_read, the peers' side of mr_entry_update's seqlock
// (transport.cc resolve_remote and peer.cc premap_regions read every entry
// of another process's MR table through it).
TEST(MrEntrySeqlock, AStableReadCopiesOneWriteAndReturnsItsGeneration) {
  MrEntry e{};
  mr_entry_update(&e, [&] { e.lkey = e.rkey = 7; });
  uint32_t g = 99, lkey = 0, rkey = 0;
  EXPECT_EQ(mr_entry_read(&e, &g, [&] {
              lkey = e.lkey;
              rkey = e.rkey;
              return true;
            }),
            EntryRead::kStable);
  EXPECT_EQ(g, 2u);
  EXPECT_EQ(lkey, 7u);
  EXPECT_EQ(rkey, 7u);
}

TEST(MrEntrySeqlock, AnEntryBeingWrittenIsNotRead) {
  MrEntry e{};
  e.generation = 3;  // odd: the owner is between its two stores
  bool called = false;
  uint32_t g = 99;
  EXPECT_EQ(mr_entry_read(&e, &g, [&] { return called = true; }), EntryRead::kTorn);
  EXPECT_FALSE(called);
  EXPECT_EQ(g, 99u);
}

TEST(MrEntrySeqlock, AWriteDuringTheReadMakesItTorn) {
  MrEntry e{};
  uint32_t g = 99, lkey = 0;
  // The owner's whole update lands between the reader's two loads.
  EXPECT_EQ(mr_entry_read(&e, &g, [&] {
              lkey = e.lkey;
              mr_entry_update(&e, [&] { e.lkey = 5; });
              return true;
            }),
            EntryRead::kTorn);
  EXPECT_EQ(g, 99u);
  EXPECT_EQ(mr_entry_read(&e, &g, [&] { return (lkey = e.lkey), true; }), EntryRead::kStable);
  EXPECT_EQ(lkey, 5u);
  EXPECT_EQ(g, 2u);
}

TEST(MrEntrySeqlock, TheReadersRefusalIsFinal) {
  MrEntry e{};
  uint32_t g = 99;
  EXPECT_EQ(mr_entry_read(&e, &g, [] { return false; }), EntryRead::kRefused);
  EXPECT_EQ(g, 99u);
}

}  // namespace
}  // namespace shmrdma::layout
