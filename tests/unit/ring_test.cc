// SPDX-License-Identifier: MIT
//
// Unit tests for src/ring.h: geometry, boundary conditions (full/empty exactly
// at capacity), FIFO order, index wrap-around across 2^32, robustness against
// a scribbled shared state (run under ASan: nothing may be touched outside
// the slot array), and a threaded MPMC fuzz test (run under TSan: the
// acquire/release pairs must order every payload access).

#include "ring.h"

#include "cq_push.h"
#include "layout.h"
#include "peer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <random>
#include <thread>
#include <vector>

namespace shmrdma {
namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kTsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr bool kTsan = true;
#else
constexpr bool kTsan = false;
#endif
#else
constexpr bool kTsan = false;
#endif

// Exactly bytes_for() bytes, 64-byte aligned, so that ASan flags any access
// one byte past the slot array.
class RingMem {
 public:
  RingMem(uint32_t capacity, uint32_t stride)
      : bytes_(Ring::bytes_for(capacity, stride)),
        p_(static_cast<std::byte*>(
            ::operator new(bytes_, std::align_val_t{kRingCacheLine}))) {}
  ~RingMem() { ::operator delete(p_, std::align_val_t{kRingCacheLine}); }
  RingMem(const RingMem&) = delete;
  RingMem& operator=(const RingMem&) = delete;

  RingShared* shared() const { return reinterpret_cast<RingShared*>(p_); }
  std::byte* slots() const { return Ring::slots_after(shared()); }
  std::byte* begin() const { return p_; }
  std::byte* end() const { return p_ + bytes_; }

 private:
  std::size_t bytes_;
  std::byte* p_;
};

Ring make_ring(const RingMem& m, uint32_t capacity, uint32_t stride,
               uint32_t initial_pos = 0) {
  auto r = Ring::format(m.shared(), m.slots(), capacity, stride, initial_pos);
  EXPECT_TRUE(r.has_value());
  return r.value_or(Ring{});
}

// Test-only backdoor into the shared state (this is what a hostile peer can
// do). Uses the atomics, so it is race-free against the ring itself.
std::atomic<uint32_t>& seq_of(const RingMem& m, uint32_t stride,
                              uint32_t index) {
  return reinterpret_cast<RingSlotHeader*>(m.slots() +
                                           std::size_t{index} * stride)
      ->seq;
}

// ------------------------------------------------------------- geometry

TEST(RingGeometry, RoundUpPow2) {
  static_assert(round_up_pow2(0) == 1);
  static_assert(round_up_pow2(1) == 1);
  static_assert(round_up_pow2(2) == 2);
  static_assert(round_up_pow2(3) == 4);
  static_assert(round_up_pow2(100) == 128);
  static_assert(round_up_pow2(128) == 128);
  static_assert(round_up_pow2(129) == 256);
  static_assert(round_up_pow2(uint32_t{1} << 31) == uint32_t{1} << 31);
  static_assert(round_up_pow2((uint32_t{1} << 31) + 1) == 0);
  static_assert(round_up_pow2(UINT32_MAX) == 0);

  // Same at run time.
  const std::vector<uint32_t> in = {
      0, 1, 2, 3, 100, 128, 0x80000000u, 0x80000001u, 0xFFFFFFFFu};
  const uint32_t want[] = {1, 1, 2, 4, 128, 128, 0x80000000u, 0, 0};
  for (std::size_t i = 0; i < std::size(want); ++i)
    EXPECT_EQ(round_up_pow2(in[i]), want[i]) << "input " << in[i];
  for (uint32_t v = 2; v <= 4096; ++v) {
    const uint32_t r = round_up_pow2(v);
    EXPECT_TRUE(std::has_single_bit(r));
    EXPECT_GE(r, v);
    EXPECT_LT(r / 2, v);
  }
}

TEST(RingGeometry, CapacityFor) {
  EXPECT_EQ(Ring::capacity_for(0), Ring::kMinCapacity);
  EXPECT_EQ(Ring::capacity_for(1), Ring::kMinCapacity);
  EXPECT_EQ(Ring::capacity_for(3), 4u);
  EXPECT_EQ(Ring::capacity_for(1000), 1024u);
  EXPECT_EQ(Ring::capacity_for(Ring::kMaxCapacity), Ring::kMaxCapacity);
  EXPECT_EQ(Ring::capacity_for(Ring::kMaxCapacity + 1), 0u);
  EXPECT_EQ(Ring::capacity_for(UINT32_MAX), 0u);
}

TEST(RingGeometry, ValidGeometryAndSizes) {
  EXPECT_TRUE(Ring::valid_geometry(2, 64));
  EXPECT_TRUE(Ring::valid_geometry(128, 576));  // stride need not be pow2
  EXPECT_TRUE(Ring::valid_geometry(Ring::kMaxCapacity, Ring::kMaxStride));
  EXPECT_FALSE(Ring::valid_geometry(0, 64));
  EXPECT_FALSE(Ring::valid_geometry(1, 64));
  EXPECT_FALSE(Ring::valid_geometry(96, 64));
  EXPECT_FALSE(Ring::valid_geometry(Ring::kMaxCapacity * 2, 64));
  EXPECT_FALSE(Ring::valid_geometry(128, 0));
  EXPECT_FALSE(Ring::valid_geometry(128, 32));
  EXPECT_FALSE(Ring::valid_geometry(128, 96));
  EXPECT_FALSE(Ring::valid_geometry(128, Ring::kMaxStride + 64));

  EXPECT_EQ(Ring::slot_bytes_for(128, 64), 128u * 64u);
  EXPECT_EQ(Ring::bytes_for(128, 64), sizeof(RingShared) + 128u * 64u);
  EXPECT_EQ(Ring::bytes_for(3, 64), 0u);
  EXPECT_EQ(Ring::slot_bytes_for(4, 100), 0u);
  EXPECT_EQ(Ring::bytes_for(Ring::kMaxCapacity, Ring::kMaxStride),
            sizeof(RingShared) + (std::size_t{1} << 40));
}

TEST(RingGeometry, FormatAndAttachRejectBadArguments) {
  RingMem m(8, 64);
  EXPECT_FALSE(Ring::format(nullptr, m.slots(), 8, 64));
  EXPECT_FALSE(Ring::format(m.shared(), nullptr, 8, 64));
  EXPECT_FALSE(Ring::format(m.shared(), m.slots() + 8, 8, 64));  // misaligned
  EXPECT_FALSE(Ring::format(m.shared(), m.slots(), 6, 64));
  EXPECT_FALSE(Ring::format(m.shared(), m.slots(), 8, 80));
  EXPECT_FALSE(Ring::attach(m.shared(), m.slots(), 1, 64));
  EXPECT_FALSE(Ring::attach(m.shared(), m.slots() + 32, 8, 64));
  EXPECT_FALSE(Ring{}.attached());
  EXPECT_EQ(Ring{}.payload_size(), 0u);

  auto r = Ring::format(m.shared(), m.slots(), 8, 64);
  ASSERT_TRUE(r);
  EXPECT_TRUE(r->attached());
  EXPECT_EQ(r->capacity(), 8u);
  EXPECT_EQ(r->stride(), 64u);
  EXPECT_EQ(r->payload_size(), 64u - kRingSlotHeaderBytes);
}

// Two views (as in two processes) of one ring see each other's items.
TEST(RingBasic, AttachSharesState) {
  RingMem m(16, 64);
  Ring owner = make_ring(m, 16, 64);
  auto peer = Ring::attach(m.shared(), m.slots(), 16, 64);
  ASSERT_TRUE(peer);
  const uint64_t v = 0x1122334455667788ull;
  ASSERT_EQ(owner.try_push(&v, sizeof v), RingStatus::ok);
  EXPECT_TRUE(peer->peek_ready());
  uint64_t out = 0;
  ASSERT_EQ(peer->try_pop(&out, sizeof out), RingStatus::ok);
  EXPECT_EQ(out, v);
  EXPECT_EQ(owner.size_approx(), 0u);
}

// ------------------------------------------------------------ boundaries

TEST(RingBasic, FullExactlyAtCapacityMpmc) {
  RingMem m(128, 64);
  Ring r = make_ring(m, 128, 64);
  for (uint32_t i = 0; i < 128; ++i) {
    RingResult res = r.try_reserve();
    ASSERT_TRUE(res) << "reserve " << i;
    std::memcpy(res.handle.payload, &i, sizeof i);
    r.publish(res.handle);
    EXPECT_EQ(r.size_approx(), i + 1);
  }
  EXPECT_EQ(r.try_reserve().status, RingStatus::full);
  EXPECT_EQ(r.try_reserve_sp().status, RingStatus::full);
  const uint32_t x = 7;
  EXPECT_EQ(r.try_push(&x, sizeof x), RingStatus::full);
  EXPECT_EQ(r.size_approx(), 128u);

  // Freeing one slot admits exactly one more item.
  uint32_t out = 0;
  ASSERT_EQ(r.try_pop(&out, sizeof out), RingStatus::ok);
  EXPECT_EQ(out, 0u);
  EXPECT_EQ(r.try_push(&x, sizeof x), RingStatus::ok);
  EXPECT_EQ(r.try_push(&x, sizeof x), RingStatus::full);
}

TEST(RingBasic, FullExactlyAtCapacitySingleProducer) {
  RingMem m(128, 64);
  Ring r = make_ring(m, 128, 64);
  // Reserved but unpublished slots count as occupied too.
  for (uint32_t i = 0; i < 128; ++i) ASSERT_TRUE(r.try_reserve_sp()) << i;
  EXPECT_EQ(r.try_reserve_sp().status, RingStatus::full);
  EXPECT_EQ(r.try_reserve().status, RingStatus::full);
}

TEST(RingBasic, EmptyReturnsEmpty) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  uint32_t v = 0;
  EXPECT_FALSE(r.peek_ready());
  EXPECT_EQ(r.try_claim().status, RingStatus::empty);
  EXPECT_EQ(r.try_claim_sc().status, RingStatus::empty);
  EXPECT_EQ(r.try_pop(&v, sizeof v), RingStatus::empty);
  EXPECT_EQ(r.size_approx(), 0u);

  ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  ASSERT_EQ(r.try_pop(&v, sizeof v), RingStatus::ok);
  EXPECT_EQ(r.try_pop(&v, sizeof v), RingStatus::empty);
  EXPECT_EQ(r.try_claim_sc().status, RingStatus::empty);
  EXPECT_FALSE(r.peek_ready());
}

// A producer that reserves and never publishes (it died) stalls a
// single-consumer ring; the consumer skips that slot and the ring keeps
// working for laps after. A slot nobody reserved, or one that is published,
// is never skipped.
TEST(RingBasic, ConsumerSkipsASlotAReservingProducerNeverPublished) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  EXPECT_FALSE(r.skip_unpublished_sc([](uint32_t) {})) << "an empty ring has nothing to skip";
  RingResult dead = r.try_reserve();  // the producer dies here
  ASSERT_TRUE(dead);
  uint32_t a = 11, b = 22, v = 0;
  ASSERT_EQ(r.try_push_cas(&a, sizeof a), RingStatus::ok);
  ASSERT_EQ(r.try_push_cas(&b, sizeof b), RingStatus::ok);
  EXPECT_EQ(r.try_claim_sc().status, RingStatus::empty) << "stalled behind the unpublished slot";
  EXPECT_EQ(r.consumer_position(), 0u);
  ASSERT_TRUE(r.skip_unpublished_sc([](uint32_t) {}));
  EXPECT_EQ(r.consumer_position(), 1u);
  EXPECT_FALSE(r.skip_unpublished_sc([](uint32_t) {})) << "the next slot is published";
  RingResult c = r.try_claim_sc();
  ASSERT_TRUE(c);
  std::memcpy(&v, c.handle.payload, sizeof v);
  r.release(c.handle);
  EXPECT_EQ(v, a);
  c = r.try_claim_sc();
  ASSERT_TRUE(c);
  std::memcpy(&v, c.handle.payload, sizeof v);
  r.release(c.handle);
  EXPECT_EQ(v, b);
  for (uint32_t i = 0; i < 12; ++i) {  // three more laps through the skipped slot
    ASSERT_EQ(r.try_push_cas(&i, sizeof i), RingStatus::ok) << i;
    c = r.try_claim_sc();
    ASSERT_TRUE(c) << i;
    std::memcpy(&v, c.handle.payload, sizeof v);
    r.release(c.handle);
    EXPECT_EQ(v, i);
  }
}

// What a receive completion's recovery reads (transport_take.cc
// recv_completion_delivered): the position a push reserved (the fill's
// second argument), where that slot stands (lap_of: published and untaken,
// not published, given back), whether the head is reserved and unpublished,
// and the hook skip_unpublished_sc runs before it gives the slot up.
TEST(RingBasic, APushTellsItsPositionAndTheSlotTellsWhereItStands) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  EXPECT_FALSE(r.head_reserved_unpublished()) << "empty";
  EXPECT_LT(r.lap_of(0), 0) << "free";
  uint32_t seen = 99;
  ASSERT_EQ(r.try_push_cas_with<4>([&](std::byte* p, uint32_t pos) {
    seen = pos;
    uint32_t a = 7;
    std::memcpy(p, &a, sizeof a);
  }), RingStatus::ok);
  EXPECT_EQ(seen, 0u);
  EXPECT_EQ(r.lap_of(0), 0) << "published, not taken";
  EXPECT_FALSE(r.head_reserved_unpublished()) << "published";
  RingResult dead = r.try_reserve();  // position 1: its producer dies
  ASSERT_TRUE(dead);
  EXPECT_EQ(dead.handle.pos, 1u);
  EXPECT_LT(r.lap_of(1), 0) << "reserved, not published";
  RingResult c = r.try_claim_sc();
  ASSERT_TRUE(c);
  r.release(c.handle);
  EXPECT_GT(r.lap_of(0), 0) << "taken and given back";
  EXPECT_TRUE(r.head_reserved_unpublished());
  uint32_t hooked = 99;
  ASSERT_TRUE(r.skip_unpublished_sc([&](uint32_t pos) {
    hooked = pos;
    EXPECT_LT(r.lap_of(pos), 0) << "the hook runs before the slot is given up";
  }));
  EXPECT_EQ(hooked, 1u);
  EXPECT_GT(r.lap_of(1), 0) << "given up";
  EXPECT_FALSE(r.head_reserved_unpublished());
  hooked = 99;
  EXPECT_FALSE(r.skip_unpublished_sc([&](uint32_t pos) { hooked = pos; })) << "nothing reserved";
  EXPECT_EQ(hooked, 99u) << "no hook without a slot to give up";
  for (uint32_t i = 0; i < 8; ++i) {  // two more laps: positions 2..9
    ASSERT_EQ(r.try_push_cas_with<4>([&](std::byte* p, uint32_t pos) {
      seen = pos;
      std::memcpy(p, &i, sizeof i);
    }), RingStatus::ok);
    EXPECT_EQ(seen, 2 + i);
    EXPECT_EQ(r.lap_of(2 + i), 0);
    c = r.try_claim_sc();
    ASSERT_TRUE(c);
    r.release(c.handle);
    EXPECT_GT(r.lap_of(2 + i), 0);
  }
  EXPECT_GT(r.lap_of(1), 0) << "an earlier lap's position stays behind";
}

// A producer that was only slow (its slot was skipped before it published)
// learns it from try_push_cas and pushes again; its late bytes never reach
// the consumer as an entry of the skipped position.
TEST(RingBasic, ASkippedSlowProducerSeesAbandoned) {
  RingMem m(2, 64);
  Ring r = make_ring(m, 2, 64);
  // Emulate try_push_cas split at its reservation: reserve, let the consumer
  // skip, then attempt the publishing CAS the way try_push_cas does.
  RingResult slow = r.try_reserve();
  ASSERT_TRUE(slow);
  ASSERT_TRUE(r.skip_unpublished_sc([](uint32_t) {}));
  // The next lap's producer may now take that slot; our publish must fail.
  uint32_t x = 5, v = 0;
  ASSERT_EQ(r.try_push_cas(&x, sizeof x), RingStatus::ok);
  ASSERT_EQ(r.try_push_cas(&x, sizeof x), RingStatus::ok);  // wraps onto the skipped slot's next lap
  EXPECT_EQ(r.try_push_cas(&x, sizeof x), RingStatus::full);
  for (int i = 0; i < 2; ++i) {
    RingResult c = r.try_claim_sc();
    ASSERT_TRUE(c);
    std::memcpy(&v, c.handle.payload, sizeof v);
    r.release(c.handle);
    EXPECT_EQ(v, x);
  }
  EXPECT_EQ(r.try_claim_sc().status, RingStatus::empty);
}

TEST(RingBasic, FifoOrder) {
  RingMem m(128, 64);
  Ring r = make_ring(m, 128, 64);
  uint32_t next_in = 0, next_out = 0;
  std::mt19937 rng(1);
  // Random interleaving of pushes and pops keeps the ring at varying fill.
  while (next_out < 10000) {
    if (next_in < 10000 && (rng() % 3 != 0)) {
      const RingStatus s = r.try_push(&next_in, sizeof next_in);
      if (s == RingStatus::ok) {
        ++next_in;
      } else {
        ASSERT_EQ(s, RingStatus::full);
      }
    } else {
      uint32_t v = 0;
      const RingStatus s = r.try_pop(&v, sizeof v);
      if (s == RingStatus::ok) {
        ASSERT_EQ(v, next_out++);
      } else {
        ASSERT_EQ(s, RingStatus::empty);
      }
    }
  }
}

// A slot reserved earlier but published later holds back the consumer; this
// is what lets producers fill slots in place without copying.
TEST(RingBasic, OutOfOrderPublishIsConsumedInPositionOrder) {
  RingMem m(8, 64);
  Ring r = make_ring(m, 8, 64);
  RingResult a = r.try_reserve();
  RingResult b = r.try_reserve();
  ASSERT_TRUE(a);
  ASSERT_TRUE(b);
  EXPECT_NE(a.handle.payload, b.handle.payload);
  std::memset(a.handle.payload, 'A', r.payload_size());
  std::memset(b.handle.payload, 'B', r.payload_size());
  r.publish(b.handle);
  EXPECT_FALSE(r.peek_ready());
  EXPECT_EQ(r.try_claim().status, RingStatus::empty);
  r.publish(a.handle);
  EXPECT_TRUE(r.peek_ready());

  RingResult c1 = r.try_claim();
  ASSERT_TRUE(c1);
  EXPECT_EQ(static_cast<char>(c1.handle.payload[0]), 'A');
  RingResult c2 = r.try_claim_sc();
  ASSERT_TRUE(c2);
  EXPECT_EQ(static_cast<char>(c2.handle.payload[r.payload_size() - 1]), 'B');
  r.release(c2.handle);
  r.release(c1.handle);
  EXPECT_EQ(r.size_approx(), 0u);
}

// A consumer holding a claimed slot keeps the producer from reusing it.
TEST(RingBasic, HeldClaimBlocksProducerReuse) {
  RingMem m(2, 64);
  Ring r = make_ring(m, 2, 64);
  const uint32_t v = 1;
  ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  RingResult c = r.try_claim();
  ASSERT_TRUE(c);
  EXPECT_EQ(r.try_push(&v, sizeof v), RingStatus::full);
  EXPECT_EQ(r.try_reserve_sp().status, RingStatus::full);
  r.release(c.handle);
  EXPECT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
}

TEST(RingBasic, PayloadGeometryAndInvalidLengths) {
  constexpr uint32_t kStride = 576;  // 16 B WQE header + 32 SGEs + slot header
  RingMem m(4, kStride);
  Ring r = make_ring(m, 4, kStride);
  ASSERT_EQ(r.payload_size(), kStride - kRingSlotHeaderBytes);

  std::vector<std::byte> big(r.payload_size() + 1, std::byte{0x5a});
  EXPECT_EQ(r.try_push(big.data(), big.size()), RingStatus::invalid);
  EXPECT_EQ(r.try_push(nullptr, 1), RingStatus::invalid);
  EXPECT_EQ(r.size_approx(), 0u);  // an invalid push consumes nothing
  ASSERT_EQ(r.try_push(big.data(), r.payload_size()), RingStatus::ok);
  EXPECT_EQ(r.try_pop(big.data(), big.size()), RingStatus::invalid);
  EXPECT_EQ(r.try_pop(nullptr, 1), RingStatus::invalid);
  EXPECT_EQ(r.size_approx(), 1u);  // an invalid pop consumes nothing
  ASSERT_EQ(r.try_pop(big.data(), r.payload_size()), RingStatus::ok);
  EXPECT_EQ(r.try_push(nullptr, 0), RingStatus::ok);  // empty payload is fine

  for (int i = 0; i < 8; ++i) {
    RingResult res = r.try_reserve();
    if (!res) {
      ASSERT_EQ(res.status, RingStatus::full);
      ASSERT_EQ(r.try_pop(nullptr, 0), RingStatus::ok);
      continue;
    }
    const auto off = static_cast<std::size_t>(res.handle.payload - m.slots());
    EXPECT_EQ(off % kStride, kRingSlotHeaderBytes);  // right after the seq
    EXPECT_EQ(reinterpret_cast<uintptr_t>(res.handle.payload) % 8, 0u);
    std::memset(res.handle.payload, i, r.payload_size());  // whole payload
    r.publish(res.handle);
  }
}

// ------------------------------------------------------------ wrap-around

class RingWrap : public ::testing::TestWithParam<uint32_t> {};

// Many laps with the free-running indices starting near (or exactly at) the
// u32 wrap point: full and empty must still be detected exactly, and FIFO
// order must survive the wrap.
TEST_P(RingWrap, FullEmptyAndFifoAcrossU32Wrap) {
  constexpr uint32_t kCap = 8;
  const uint32_t start = GetParam();
  RingMem m(kCap, 64);
  Ring r = make_ring(m, kCap, 64, start);
  uint64_t next_in = 0, next_out = 0;

  for (int lap = 0; lap < 64; ++lap) {
    const bool single = lap % 2 == 1;  // alternate MPMC and SP/SC paths
    for (uint32_t i = 0; i < kCap; ++i) {
      RingResult res = single ? r.try_reserve_sp() : r.try_reserve();
      ASSERT_TRUE(res) << "lap " << lap << " item " << i;
      EXPECT_EQ(res.handle.pos, static_cast<uint32_t>(start + next_in));
      std::memcpy(res.handle.payload, &next_in, sizeof next_in);
      ++next_in;
      r.publish(res.handle);
    }
    ASSERT_EQ(r.try_reserve().status, RingStatus::full) << "lap " << lap;
    ASSERT_EQ(r.try_reserve_sp().status, RingStatus::full) << "lap " << lap;
    ASSERT_EQ(r.size_approx(), kCap);
    for (uint32_t i = 0; i < kCap; ++i) {
      RingResult res = single ? r.try_claim_sc() : r.try_claim();
      ASSERT_TRUE(res) << "lap " << lap << " item " << i;
      uint64_t v = 0;
      std::memcpy(&v, res.handle.payload, sizeof v);
      ASSERT_EQ(v, next_out++);
      r.release(res.handle);
    }
    ASSERT_EQ(r.try_claim().status, RingStatus::empty) << "lap " << lap;
    ASSERT_EQ(r.try_claim_sc().status, RingStatus::empty) << "lap " << lap;
    ASSERT_EQ(r.size_approx(), 0u);
  }

  // Partial fills so that full/empty boundaries fall at every offset.
  std::mt19937 rng(start);
  for (int step = 0; step < 20000; ++step) {
    if (rng() % 2) {
      const bool was_full = next_in - next_out == kCap;
      const RingStatus s = r.try_push(&next_in, sizeof next_in);
      ASSERT_EQ(s, was_full ? RingStatus::full : RingStatus::ok);
      if (s == RingStatus::ok) ++next_in;
    } else {
      const bool was_empty = next_in == next_out;
      uint64_t v = 0;
      const RingStatus s = r.try_pop(&v, sizeof v);
      ASSERT_EQ(s, was_empty ? RingStatus::empty : RingStatus::ok);
      if (s == RingStatus::ok) {
        ASSERT_EQ(v, next_out++);
      }
    }
  }

  // The indices really did travel past the starting point by next_in steps
  // (crossing 2^32 for the starts near UINT32_MAX).
  EXPECT_EQ(m.shared()->producer_pos.load(std::memory_order_relaxed),
            static_cast<uint32_t>(start + next_in));
  EXPECT_EQ(m.shared()->consumer_pos.load(std::memory_order_relaxed),
            static_cast<uint32_t>(start + next_out));
}

INSTANTIATE_TEST_SUITE_P(StartPositions, RingWrap,
                         ::testing::Values(0u, UINT32_MAX, UINT32_MAX - 3,
                                           UINT32_MAX - 100, 0x7FFFFFFEu,
                                           0x80000000u));

// ------------------------------------------------- known room

// The CQ consumer's way (ibv_poll_cq): its position, published_for, release_sc.
bool take_sc(const Ring& r, uint64_t* v) {
  const uint32_t pos = r.consumer_position();
  RingSlotHeader* h = r.slot_header(pos);
  if (!Ring::published_for(h, pos)) return false;
  std::memcpy(v, reinterpret_cast<std::byte*>(h) + kRingSlotHeaderBytes, sizeof *v);
  r.release_sc(h, pos);
  return true;
}

RingStatus push_within(const Ring& r, uint32_t* room, uint64_t v) {
  return r.try_push_cas_within<sizeof v>(room, [&](std::byte* p) { std::memcpy(p, &v, sizeof v); });
}

class RingRoom : public ::testing::TestWithParam<uint32_t> {};

// A producer that keeps the room it learnt (try_reserve_within) pushes
// exactly when the ring has a free slot (full exactly at capacity, at every
// offset, across the u32 wrap), its items come out in order, and what it
// knows never runs past what the consumer gave back: room is at most
// consumer_pos + capacity.
TEST_P(RingRoom, KnowsNoMoreRoomThanTheConsumerGaveBack) {
  constexpr uint32_t kCap = 8;
  const uint32_t start = GetParam();
  RingMem m(kCap, 64);
  Ring r = make_ring(m, kCap, 64, start);
  uint32_t room = r.producer_position();  // knows nothing
  uint64_t next_in = 0, next_out = 0;
  std::mt19937 rng(start);
  for (int step = 0; step < 20000; ++step) {
    if (rng() % 2) {
      const bool was_full = next_in - next_out == kCap;
      const RingStatus st = push_within(r, &room, next_in);
      ASSERT_EQ(st, was_full ? RingStatus::full : RingStatus::ok) << step;
      if (st == RingStatus::ok) ++next_in;
    } else {
      uint64_t v = 0;
      const bool got = take_sc(r, &v);
      ASSERT_EQ(got, next_in != next_out) << step;
      if (got) {
        ASSERT_EQ(v, next_out++) << step;
      }
    }
    ASSERT_LE(static_cast<uint32_t>(room - r.consumer_position()), kCap) << step;
  }
  EXPECT_EQ(r.producer_position(), static_cast<uint32_t>(start + next_in));
}

INSTANTIATE_TEST_SUITE_P(StartPositions, RingRoom,
                         ::testing::Values(0u, UINT32_MAX, UINT32_MAX - 3, 0x7FFFFFFEu));

// What the room is for: a position known free is reserved without a look at
// its slot (a slot the consumer scribbled on: reserved all the same, and the
// publication finds it not free and says so, as for a slot given up; the
// slot-reading try_reserve sees it and gives up). And the consumer's position
// (untrusted) is believed only when it is at most one lap behind the
// producers: ahead of them, or more than a lap behind, the slots are read.
TEST(RingRoomHostile, AKnownFreeSlotIsNotReadAndAnImpossibleConsumerPositionTeachesNothing) {
  constexpr uint32_t kCap = 4;
  RingMem m(kCap, 64);
  Ring r = make_ring(m, kCap, 64);
  uint32_t room = r.producer_position();
  ASSERT_EQ(push_within(r, &room, 1), RingStatus::ok);
  EXPECT_EQ(room, kCap) << "learnt from consumer_pos 0";
  seq_of(m, 64, 1).store(77);
  EXPECT_EQ(push_within(r, &room, 2), RingStatus::abandoned);
  EXPECT_EQ(r.producer_position(), 2u) << "position 1 was reserved without reading its slot";
  seq_of(m, 64, 2).store(77);
  uint64_t v = 3;
  EXPECT_EQ(r.try_push_cas(&v, sizeof v), RingStatus::contended) << "try_reserve reads the slot";
  EXPECT_EQ(r.producer_position(), 2u);

  RingMem m2(kCap, 64);
  Ring q = make_ring(m2, kCap, 64);
  uint32_t room2 = q.producer_position();
  for (uint64_t i = 0; i < kCap; ++i) ASSERT_EQ(push_within(q, &room2, i), RingStatus::ok) << i;
  EXPECT_EQ(push_within(q, &room2, 9), RingStatus::full);
  m2.shared()->consumer_pos.store(kCap + 5);  // ahead of the producers
  EXPECT_EQ(push_within(q, &room2, 9), RingStatus::full);
  m2.shared()->consumer_pos.store(0u - 1);  // more than a lap behind
  EXPECT_EQ(push_within(q, &room2, 9), RingStatus::full);
  EXPECT_EQ(room2, kCap) << "neither was learnt";
  EXPECT_EQ(q.producer_position(), kCap);
  m2.shared()->consumer_pos.store(0);
  for (uint64_t i = 0; i < kCap; ++i) {
    ASSERT_TRUE(take_sc(q, &v)) << i;
    EXPECT_EQ(v, i);
  }
}

// cq_push.h push_slot: what a producer knew of a CQ's ring holds for that
// entry's ring epoch only (layout::CqEntry::ring_epoch). A resize formats a
// new ring, possibly where an old one of the same capacity was (so the
// producer's RingCache still holds it), with positions from 0 again: the
// room learnt of the old ring would have a push overwrite a completion the
// resize moved in. Another entry's ring in the same memory: the same.
TEST(RingRoom, PushSlotForgetsTheRoomOfAnotherRingEpochOrEntry) {
  constexpr uint32_t kCap = 4;
  RingMem m(kCap, 64);
  layout::CqEntry e{};
  e.ring_epoch = 1;
  RingCache cache;
  cache.ring = make_ring(m, kCap, 64);
  const layout::CqEntry* entry = &e;
  auto push = [&](uint64_t v) {
    return cqpush::push_slot(entry, &cache, [&](std::byte* p) { std::memcpy(p, &v, sizeof v); });
  };
  uint64_t v = 0;
  for (uint64_t i = 0; i < kCap; ++i) ASSERT_EQ(push(i), RingStatus::ok);
  for (uint64_t i = 0; i < kCap; ++i) ASSERT_TRUE(take_sc(cache.ring, &v));
  for (uint64_t i = kCap; i < 2 * kCap; ++i) ASSERT_EQ(push(i), RingStatus::ok);
  ASSERT_EQ(cache.room, 2 * kCap) << "knows positions 4-7 free";
  // The resize: the same memory formatted again, the four completions moved
  // in (positions 0-3: full), the epoch moved on.
  auto reformat_full = [&] {
    Ring fresh = make_ring(m, kCap, 64);
    for (uint64_t i = kCap; i < 2 * kCap; ++i) ASSERT_EQ(fresh.try_push(&i, sizeof i), RingStatus::ok);
  };
  reformat_full();
  e.ring_epoch = 2;
  EXPECT_EQ(push(100), RingStatus::full);
  // Another entry, with the epoch the first had: as new.
  cache.room = 2 * kCap;
  reformat_full();
  layout::CqEntry other{};
  other.ring_epoch = 2;
  entry = &other;
  EXPECT_EQ(push(101), RingStatus::full);
  for (uint64_t i = kCap; i < 2 * kCap; ++i) {
    ASSERT_TRUE(take_sc(cache.ring, &v));
    EXPECT_EQ(v, i) << "a moved completion was overwritten";
  }
}

// ------------------------------------------------------------ corruption

// A sequence number that is "ahead" of every index can only be explained by
// corruption (or a peer that lost its mind); the operation must give up
// after a bounded number of attempts instead of chasing it forever.
TEST(RingCorruption, SeqAheadReportsContended) {
  RingMem m(8, 64);
  Ring r = make_ring(m, 8, 64);
  seq_of(m, 64, 0).store(1000, std::memory_order_relaxed);
  EXPECT_EQ(r.try_reserve().status, RingStatus::contended);
  EXPECT_EQ(r.try_reserve_sp().status, RingStatus::contended);
  const uint32_t v = 1;
  EXPECT_EQ(r.try_push(&v, sizeof v), RingStatus::contended);
  EXPECT_EQ(m.shared()->producer_pos.load(std::memory_order_relaxed), 0u);

  seq_of(m, 64, 0).store(0, std::memory_order_relaxed);  // repair
  ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  seq_of(m, 64, 0).store(5000, std::memory_order_relaxed);
  EXPECT_EQ(r.try_claim().status, RingStatus::contended);
  EXPECT_EQ(r.try_claim_sc().status, RingStatus::contended);
  EXPECT_FALSE(r.peek_ready());
}

TEST(RingCorruption, SeqBehindReportsFullOrEmpty) {
  RingMem m(8, 64);
  Ring r = make_ring(m, 8, 64);
  // Slot 0 looks like it still holds an item from lap "-1".
  seq_of(m, 64, 0).store(static_cast<uint32_t>(-7), std::memory_order_relaxed);
  EXPECT_EQ(r.try_reserve().status, RingStatus::full);
  EXPECT_EQ(r.try_reserve_sp().status, RingStatus::full);
  EXPECT_EQ(r.try_claim().status, RingStatus::empty);
}

TEST(RingCorruption, ScribbledIndicesStayInBounds) {
  constexpr uint32_t kCap = 16;
  RingMem m(kCap, 64);
  Ring r = make_ring(m, kCap, 64);
  const uint32_t values[] = {0xDEADBEEFu, 0xFFFFFFFFu, 0x80000000u, 17, 3};
  for (uint32_t p : values) {
    for (uint32_t c : values) {
      m.shared()->producer_pos.store(p, std::memory_order_relaxed);
      m.shared()->consumer_pos.store(c, std::memory_order_relaxed);
      EXPECT_LE(r.size_approx(), kCap);
      (void)r.peek_ready();
      for (int i = 0; i < 4; ++i) {
        RingResult w = i % 2 ? r.try_reserve_sp() : r.try_reserve();
        if (w) {
          ASSERT_GE(w.handle.payload, m.slots());
          ASSERT_LE(w.handle.payload + r.payload_size(), m.end());
          std::memset(w.handle.payload, 0xEE, r.payload_size());
          r.publish(w.handle);
        }
        RingResult c2 = i % 2 ? r.try_claim_sc() : r.try_claim();
        if (c2) {
          ASSERT_GE(c2.handle.payload, m.slots());
          ASSERT_LE(c2.handle.payload + r.payload_size(), m.end());
          r.release(c2.handle);
        }
      }
    }
  }
}

// Random scribbling of every shared word interleaved with every operation.
// The slot array sits between two guard zones; whatever the state, no
// operation may touch a guard byte (and under ASan, the exact-size variant
// below catches even a one-byte overrun).
void chaos(Ring& r, std::byte* slots, uint32_t capacity, uint32_t stride,
           RingShared* shared, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<RingHandle> held_w, held_c;
  std::array<std::byte, 1024> buf{};
  std::byte* const lo = slots;
  std::byte* const hi = slots + std::size_t{capacity} * stride;
  auto in_bounds = [&](const RingHandle& h) {
    return h.payload >= lo && h.payload + r.payload_size() <= hi &&
           (h.payload - lo) % stride == kRingSlotHeaderBytes;
  };
  for (int step = 0; step < 200000; ++step) {
    const uint32_t op = rng() % 14;
    // Corrupt only occasionally so that normal paths get exercised too.
    if (op == 0 && rng() % 4 == 0) {
      const uint32_t which = rng() % capacity;
      // Mix plausible (near current positions) and wild values.
      const uint32_t val =
          rng() % 2 ? rng()
                    : shared->producer_pos.load(std::memory_order_relaxed) +
                          (rng() % 5) - 2;
      reinterpret_cast<RingSlotHeader*>(slots + std::size_t{which} * stride)
          ->seq.store(val, std::memory_order_relaxed);
    } else if (op == 1 && rng() % 8 == 0) {
      (rng() % 2 ? shared->producer_pos : shared->consumer_pos)
          .store(rng() % 3 ? rng() : rng() % 64, std::memory_order_relaxed);
    } else if (op == 2 || op == 3) {
      RingResult w = op == 2 ? r.try_reserve() : r.try_reserve_sp();
      if (w) {
        ASSERT_TRUE(in_bounds(w.handle));
        std::memset(w.handle.payload, static_cast<int>(step), r.payload_size());
        if (rng() % 4 == 0)
          held_w.push_back(w.handle);
        else
          r.publish(w.handle);
      } else {
        ASSERT_NE(w.status, RingStatus::ok);
        ASSERT_NE(w.status, RingStatus::invalid);
      }
    } else if (op == 4 || op == 5) {
      RingResult c = op == 4 ? r.try_claim() : r.try_claim_sc();
      if (c) {
        ASSERT_TRUE(in_bounds(c.handle));
        std::memcpy(buf.data(), c.handle.payload, r.payload_size());
        if (rng() % 4 == 0)
          held_c.push_back(c.handle);
        else
          r.release(c.handle);
      }
    } else if (op == 6 && !held_w.empty()) {
      r.publish(held_w.back());
      held_w.pop_back();
    } else if (op == 7 && !held_c.empty()) {
      r.release(held_c.back());
      held_c.pop_back();
    } else if (op == 8) {
      (void)r.try_push(buf.data(), rng() % (r.payload_size() + 2));
    } else if (op == 9) {
      (void)r.try_pop(buf.data(), rng() % (r.payload_size() + 2));
    } else if (op == 10) {
      ASSERT_LE(r.size_approx(), capacity);
      (void)r.peek_ready();
    } else if (op == 11) {
      // Publishing/releasing a handle with a wild position (a confused
      // caller) still only touches a slot header inside the array.
      const RingHandle wild{nullptr, static_cast<uint32_t>(rng())};
      if (rng() % 2)
        r.publish(wild);
      else
        r.release(wild);
    }
  }
}

TEST(RingCorruption, RandomScribblingNeverLeavesSlotArray) {
  constexpr uint32_t kCap = 16, kStride = 128;
  constexpr std::size_t kGuard = 4096;
  const std::size_t bytes = Ring::bytes_for(kCap, kStride);
  auto* raw = static_cast<std::byte*>(
      ::operator new(bytes + 2 * kGuard, std::align_val_t{kRingCacheLine}));
  std::memset(raw, 0xA5, kGuard);
  std::memset(raw + kGuard + bytes, 0xA5, kGuard);
  auto* shared = reinterpret_cast<RingShared*>(raw + kGuard);
  auto ring = Ring::format(shared, Ring::slots_after(shared), kCap, kStride);
  ASSERT_TRUE(ring);
  chaos(*ring, Ring::slots_after(shared), kCap, kStride, shared, 42);
  const bool guards_ok =
      std::all_of(raw, raw + kGuard,
                  [](std::byte b) { return b == std::byte{0xA5}; }) &&
      std::all_of(raw + kGuard + bytes, raw + 2 * kGuard + bytes,
                  [](std::byte b) { return b == std::byte{0xA5}; });
  ::operator delete(raw, std::align_val_t{kRingCacheLine});
  EXPECT_TRUE(guards_ok);
}

TEST(RingCorruption, RandomScribblingExactAllocation) {
  // Slots placed apart from the header, each in an exact-size allocation.
  constexpr uint32_t kCap = 8, kStride = 64;
  auto* shared = static_cast<RingShared*>(
      ::operator new(sizeof(RingShared), std::align_val_t{kRingCacheLine}));
  auto* slots = static_cast<std::byte*>(::operator new(
      Ring::slot_bytes_for(kCap, kStride), std::align_val_t{kRingCacheLine}));
  auto ring = Ring::format(shared, slots, kCap, kStride, UINT32_MAX - 50);
  ASSERT_TRUE(ring);
  for (uint32_t seed = 1; seed <= 3; ++seed)
    chaos(*ring, slots, kCap, kStride, shared, seed);
  ::operator delete(slots, std::align_val_t{kRingCacheLine});
  ::operator delete(shared, std::align_val_t{kRingCacheLine});
}

// Concurrent version: one thread scribbles the shared atomics while others
// run every operation. Nothing may hang or hand out an out-of-range slot.
// Payloads are not touched here because a scribbled seq legitimately lets two
// threads own one slot (that is the "garbage" a hostile peer can cause) and
// TSan would rightly flag the resulting payload race.
TEST(RingCorruption, ConcurrentScribblingIsBounded) {
  constexpr uint32_t kCap = 16, kStride = 64;
  RingMem m(kCap, kStride);
  Ring r = make_ring(m, kCap, kStride);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bad{0};
  auto check = [&](const RingResult& res) {
    if (res && (res.handle.payload < m.slots() ||
                res.handle.payload + r.payload_size() > m.end()))
      bad.fetch_add(1, std::memory_order_relaxed);
  };
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t) {
    workers.emplace_back([&, t] {
      Ring view = r;  // each thread has its own private view
      for (int i = 0; i < (kTsan ? 20000 : 200000); ++i) {
        RingResult w = view.try_reserve();
        check(w);
        if (w) view.publish(w.handle);
        RingResult c = view.try_claim();
        check(c);
        if (c) view.release(c.handle);
        if (view.size_approx() > kCap) bad.fetch_add(1);
        if (t == 0) (void)view.peek_ready();
      }
    });
  }
  std::thread scribbler([&] {
    std::mt19937 rng(7);
    while (!stop.load(std::memory_order_relaxed)) {
      const uint32_t v = rng();
      switch (v % 3) {
        case 0:
          seq_of(m, kStride, (v >> 8) % kCap).store(rng());
          break;
        case 1:
          m.shared()->producer_pos.store(rng());
          break;
        default:
          m.shared()->consumer_pos.store(rng());
          break;
      }
      std::this_thread::yield();
    }
  });
  for (auto& w : workers) w.join();
  stop.store(true);
  scribbler.join();
  EXPECT_EQ(bad.load(), 0u);
}

// ------------------------------------------------------------ threaded fuzz

struct ItemHeader {
  uint32_t producer;
  uint32_t seq;
  uint32_t len;  // bytes of data following the header
  uint32_t reserved;
  uint64_t checksum;
};
static_assert(sizeof(ItemHeader) == 24);

uint64_t fnv1a(const void* p, std::size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

// Fills `out` (payload_size bytes) with a self-checking item.
void make_item(std::byte* out, std::size_t payload, uint32_t producer,
               uint32_t seq) {
  ItemHeader h{producer, seq, 0, 0, 0};
  const uint64_t m = mix((uint64_t{producer} << 32) | seq);
  h.len = static_cast<uint32_t>(m % (payload - sizeof h + 1));
  for (uint32_t i = 0; i < h.len; ++i)
    out[sizeof h + i] = static_cast<std::byte>(mix(m + i));
  h.checksum = fnv1a(&h, offsetof(ItemHeader, checksum), 0xcbf29ce484222325ull);
  h.checksum = fnv1a(out + sizeof h, h.len, h.checksum);
  std::memcpy(out, &h, sizeof h);
}

// Validates a PRIVATE copy of an item; returns false on any inconsistency.
bool check_item(const std::byte* in, std::size_t payload, ItemHeader& h) {
  std::memcpy(&h, in, sizeof h);
  if (h.len > payload - sizeof h) return false;
  uint64_t c = fnv1a(&h, offsetof(ItemHeader, checksum), 0xcbf29ce484222325ull);
  c = fnv1a(in + sizeof h, h.len, c);
  return c == h.checksum;
}

enum class Side { multi, single };

struct FuzzConfig {
  int producers;
  int consumers;
  uint32_t items_per_producer;
  Side producer_side;
  Side consumer_side;
  uint32_t capacity;
  uint32_t stride;
};

void run_fuzz(const FuzzConfig& cfg) {
  ASSERT_TRUE(cfg.producer_side == Side::multi || cfg.producers == 1);
  ASSERT_TRUE(cfg.consumer_side == Side::multi || cfg.consumers == 1);
  RingMem m(cfg.capacity, cfg.stride);
  const Ring ring = make_ring(m, cfg.capacity, cfg.stride, UINT32_MAX - 1000);
  const std::size_t payload = ring.payload_size();
  const uint64_t total = uint64_t{cfg.items_per_producer} * cfg.producers;
  std::vector<std::atomic<uint8_t>> seen(total);
  std::atomic<uint64_t> consumed{0}, errors{0};
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);

  std::vector<std::thread> threads;
  for (int p = 0; p < cfg.producers; ++p) {
    threads.emplace_back([&, p] {
      Ring view = ring;
      std::vector<std::byte> tmp(payload);
      for (uint32_t s = 0; s < cfg.items_per_producer;) {
        if (std::chrono::steady_clock::now() > deadline) {
          errors.fetch_add(1);
          return;
        }
        if (cfg.producer_side == Side::multi && p % 2 == 1) {
          // Copying path.
          make_item(tmp.data(), payload, p, s);
          if (view.try_push(tmp.data(), payload) == RingStatus::ok)
            ++s;
          else
            std::this_thread::yield();
          continue;
        }
        // In-place path.
        RingResult w = cfg.producer_side == Side::single ? view.try_reserve_sp()
                                                         : view.try_reserve();
        if (!w) {
          std::this_thread::yield();
          continue;
        }
        make_item(w.handle.payload, payload, p, s);
        view.publish(w.handle);
        ++s;
      }
    });
  }
  for (int c = 0; c < cfg.consumers; ++c) {
    threads.emplace_back([&, c] {
      Ring view = ring;
      std::vector<std::byte> tmp(payload);
      // Within one consumer, each producer's items arrive in its order:
      // a consumer's claims are at strictly increasing positions.
      std::vector<int64_t> last(cfg.producers, -1);
      while (consumed.load(std::memory_order_relaxed) < total) {
        if (std::chrono::steady_clock::now() > deadline) {
          errors.fetch_add(1);
          return;
        }
        if (cfg.consumer_side == Side::multi && c % 2 == 1) {
          if (view.try_pop(tmp.data(), payload) != RingStatus::ok) {
            std::this_thread::yield();
            continue;
          }
        } else {
          RingResult r = cfg.consumer_side == Side::single ? view.try_claim_sc()
                                                           : view.try_claim();
          if (!r) {
            std::this_thread::yield();
            continue;
          }
          std::memcpy(tmp.data(), r.handle.payload, payload);
          view.release(r.handle);
        }
        ItemHeader h{};
        if (!check_item(tmp.data(), payload, h) ||
            h.producer >= static_cast<uint32_t>(cfg.producers) ||
            h.seq >= cfg.items_per_producer ||
            int64_t{h.seq} <= last[h.producer]) {
          errors.fetch_add(1);
        } else {
          last[h.producer] = h.seq;
          const uint64_t id =
              uint64_t{h.producer} * cfg.items_per_producer + h.seq;
          if (seen[id].exchange(1, std::memory_order_relaxed) != 0)
            errors.fetch_add(1);
        }
        consumed.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }
  for (auto& t : threads) t.join();

  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(consumed.load(), total);
  uint64_t missing = 0;
  for (auto& s : seen) missing += s.load(std::memory_order_relaxed) == 0;
  EXPECT_EQ(missing, 0u);
  EXPECT_EQ(ring.size_approx(), 0u);
}

uint32_t fuzz_items(uint32_t n) { return kTsan ? n / 15 : n; }

TEST(RingFuzz, MpmcFourByFour) {
  run_fuzz({4, 4, fuzz_items(200000), Side::multi, Side::multi, 64, 128});
}

TEST(RingFuzz, MpmcTinyRingHighContention) {
  run_fuzz({3, 3, fuzz_items(60000), Side::multi, Side::multi, 2, 64});
}

// Receive-queue shape: one (serialised) producer, many consumers.
TEST(RingFuzz, SingleProducerManyConsumers) {
  run_fuzz({1, 3, fuzz_items(400000), Side::single, Side::multi, 32, 576});
}

// Completion-queue shape: many producers, one consumer.
TEST(RingFuzz, ManyProducersSingleConsumer) {
  run_fuzz({3, 1, fuzz_items(300000), Side::multi, Side::single, 128, 64});
}

TEST(RingFuzz, SpscFastPaths) {
  run_fuzz({1, 1, fuzz_items(600000), Side::single, Side::single, 16, 64});
}

// ------------------------------------------------- adoptable claims
//
// try_claim_announced / claimed_unreleased / release_cas: a consumer that
// announces every position before it tries to claim it, and may die holding
// the slot; whoever finds it dead adopts the slot, and the CAS on the slot's
// seq decides who owns the entry.

// The announcement comes before the claim, and names the position claimed.
TEST(RingAdopt, AnnouncedClaimNamesItsPosition) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  std::vector<uint32_t> announced;
  auto note = [&](uint32_t p) { announced.push_back(p); };
  EXPECT_EQ(r.try_claim_announced(note).status, RingStatus::empty);
  EXPECT_TRUE(announced.empty()) << "nothing to claim, nothing announced";
  const uint32_t a = 1, b = 2;
  ASSERT_EQ(r.try_push(&a, sizeof a), RingStatus::ok);
  ASSERT_EQ(r.try_push(&b, sizeof b), RingStatus::ok);
  RingResult c = r.try_claim_announced(note);
  ASSERT_TRUE(c);
  EXPECT_EQ(c.handle.pos, 0u);
  ASSERT_EQ(announced.size(), 1u);
  EXPECT_EQ(announced[0], 0u);
  EXPECT_TRUE(r.release_cas(c.handle));
  EXPECT_FALSE(r.release_cas(c.handle)) << "released twice";
}

// Another consumer wins the position we announced: we announce again, the
// next position, before we claim that one.
TEST(RingAdopt, LosingTheClaimAnnouncesTheNextPosition) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  for (uint32_t v = 0; v < 3; ++v) ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  std::vector<uint32_t> announced;
  RingResult other{};
  RingResult c = r.try_claim_announced([&](uint32_t p) {
    announced.push_back(p);
    if (announced.size() == 1) other = r.try_claim();  // races us to p
  });
  ASSERT_TRUE(other);
  ASSERT_TRUE(c);
  EXPECT_EQ(other.handle.pos, 0u);
  EXPECT_EQ(c.handle.pos, 1u);
  EXPECT_EQ(announced, (std::vector<uint32_t>{0, 1}));
  uint32_t v = 0;
  std::memcpy(&v, c.handle.payload, sizeof v);
  EXPECT_EQ(v, 1u);
  EXPECT_TRUE(r.release_cas(other.handle));
  EXPECT_TRUE(r.release_cas(c.handle));
}

// own_line (a sender asking for the next slot's line before it claims it)
// writes nothing the protocol reads: in every state a slot can be in
// (published, claimed, released, never written), the slot's seq and payload
// stay what they were and the ring goes on as if it had not been called.
TEST(RingAdopt, OwnLineChangesNoSlotState) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  auto seq = [&](uint32_t pos) { return r.slot_header(pos)->seq.load(); };
  auto own_every_slot = [&] {
    for (uint32_t p = 0; p < 4; ++p) {
      const uint32_t before = seq(p);
      uint32_t payload_before = 0, payload_after = 0;
      std::memcpy(&payload_before, r.slot_header(p) + 1, sizeof payload_before);
      Ring::own_line(r.slot_header(p));
      std::memcpy(&payload_after, r.slot_header(p) + 1, sizeof payload_after);
      EXPECT_EQ(seq(p), before) << "slot " << p;
      EXPECT_EQ(payload_after, payload_before) << "slot " << p;
    }
  };
  own_every_slot();  // nothing written yet
  for (uint32_t v = 10; v < 13; ++v) ASSERT_EQ(r.try_push(&v, sizeof v), RingStatus::ok);
  own_every_slot();  // three published, one free
  RingResult c = r.try_claim_at(0);
  ASSERT_TRUE(c);
  own_every_slot();  // one claimed
  EXPECT_TRUE(r.release_cas(c.handle));
  own_every_slot();  // released
  EXPECT_FALSE(r.release_cas(c.handle)) << "released twice";
  // The ring goes on: the next claims see the values pushed, in order, and
  // the producer refills the released slot.
  for (uint32_t p = 1; p < 3; ++p) {
    RingResult n = r.try_claim_at(p);
    ASSERT_TRUE(n);
    uint32_t v = 0;
    std::memcpy(&v, n.handle.payload, sizeof v);
    EXPECT_EQ(v, 9 + p + 1);
    EXPECT_TRUE(r.release_cas(n.handle));
  }
  const uint32_t more = 13;
  ASSERT_EQ(r.try_push(&more, sizeof more), RingStatus::ok);
  ASSERT_EQ(r.try_push(&more, sizeof more), RingStatus::ok);
  EXPECT_EQ(r.try_claim_at(3).status, RingStatus::ok);
}

// What counts as claimed and unreleased: only a published slot a consumer
// took and has not given back, at exactly that position.
TEST(RingAdopt, ClaimedUnreleasedOnlyForAHeldClaim) {
  RingMem m(4, 64);
  Ring r = make_ring(m, 4, 64);
  RingHandle h{};
  EXPECT_FALSE(r.claimed_unreleased(0, &h)) << "empty";
  RingResult res = r.try_reserve();
  ASSERT_TRUE(res);
  EXPECT_FALSE(r.claimed_unreleased(0, &h)) << "reserved, not published";
  r.publish(res.handle);
  EXPECT_FALSE(r.claimed_unreleased(0, &h)) << "published, nobody claimed it";
  RingResult c = r.try_claim_announced([](uint32_t) {});
  ASSERT_TRUE(c);
  ASSERT_TRUE(r.claimed_unreleased(0, &h));
  EXPECT_EQ(h.pos, 0u);
  EXPECT_EQ(h.payload, c.handle.payload);
  EXPECT_FALSE(r.claimed_unreleased(4, &h)) << "same slot, next lap";
  EXPECT_FALSE(r.claimed_unreleased(0u - 4u, &h)) << "same slot, previous lap";
  EXPECT_FALSE(r.claimed_unreleased(1, &h)) << "another slot";
  ASSERT_TRUE(r.release_cas(c.handle));
  EXPECT_FALSE(r.claimed_unreleased(0, &h)) << "released";
}

// A consumer dies holding a slot: the ring stalls a lap later until someone
// adopts the slot (reads the entry, releases it with the CAS); the dead
// consumer's own late release (a consumer that was only slow) then fails,
// and the ring goes on for laps, across the 2^32 wrap of positions.
TEST(RingAdopt, AdoptingADeadConsumersSlotAcrossTheWrap) {
  constexpr uint32_t kCap = 4;
  RingMem m(kCap, 64);
  Ring r = make_ring(m, kCap, 64, UINT32_MAX - 5);
  uint32_t next_in = 0, next_out = 0;
  for (int round = 0; round < 6; ++round) {
    // Fill the ring; a consumer claims the first entry and "dies".
    for (uint32_t k = 0; k < kCap; ++k, ++next_in)
      ASSERT_EQ(r.try_push(&next_in, sizeof next_in), RingStatus::ok) << round;
    uint32_t announced = 0;
    RingResult dead = r.try_claim_announced([&](uint32_t p) { announced = p; });
    ASSERT_TRUE(dead);
    ASSERT_EQ(announced, dead.handle.pos);
    // The others consume the rest; the producer cannot pass the held slot.
    for (uint32_t k = 1; k < kCap; ++k) {
      RingResult c = r.try_claim_announced([](uint32_t) {});
      ASSERT_TRUE(c);
      ASSERT_TRUE(r.release_cas(c.handle));
    }
    ASSERT_EQ(r.try_push(&next_in, sizeof next_in), RingStatus::full) << "stalled at the held slot";
    // The adopter finds the announced position claimed and takes it over.
    RingHandle h{};
    ASSERT_TRUE(r.claimed_unreleased(announced, &h)) << round;
    uint32_t v = 0;
    std::memcpy(&v, h.payload, sizeof v);
    EXPECT_EQ(v, next_out) << "the adopted entry is the dead consumer's";
    ASSERT_TRUE(r.release_cas(h));
    next_out += kCap;
    EXPECT_FALSE(r.release_cas(dead.handle)) << "the slow consumer learns its slot was adopted";
    EXPECT_FALSE(r.claimed_unreleased(announced, &h));
    // The producer may reuse the slot; a late release_cas cannot undo that.
    ASSERT_EQ(r.try_push(&next_in, sizeof next_in), RingStatus::ok);
    EXPECT_FALSE(r.release_cas(dead.handle));
    RingResult c = r.try_claim_announced([](uint32_t) {});
    ASSERT_TRUE(c);
    std::memcpy(&v, c.handle.payload, sizeof v);
    EXPECT_EQ(v, next_in);
    ASSERT_TRUE(r.release_cas(c.handle));
    ++next_in;
    ++next_out;
  }
  EXPECT_GT(r.consumer_position(), 0u);
  EXPECT_LT(r.consumer_position(), UINT32_MAX - 5) << "the positions crossed 2^32";
}

// Threads claim with announcements and hold their slot a moment; an adopter
// thread keeps taking over slots it finds claimed. Every entry is owned
// (read and successfully released) exactly once, whoever got it.
TEST(RingAdopt, ConcurrentAdoptionOwnsEveryEntryOnce) {
  constexpr uint32_t kCap = 8, kItems = kTsan ? 20000 : 200000;
  constexpr int kConsumers = 3;
  RingMem m(kCap, 64);
  Ring ring = make_ring(m, kCap, 64, UINT32_MAX - 100);
  std::vector<std::atomic<uint8_t>> owned(kItems);
  std::atomic<uint32_t> done{0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> adopted{0}, lost_races{0};
  std::vector<std::thread> th;
  th.emplace_back([&] {
    Ring v = ring;
    for (uint32_t i = 0; i < kItems && !stop.load(std::memory_order_relaxed);)
      if (v.try_push(&i, sizeof i) == RingStatus::ok)
        ++i;
      else
        std::this_thread::yield();  // five spinning threads may share one CPU (a loaded machine)
  });
  for (int c = 0; c < kConsumers; ++c)
    th.emplace_back([&] {
      Ring v = ring;
      while (!stop.load(std::memory_order_relaxed)) {
        RingResult res = v.try_claim_announced([](uint32_t) {});
        if (!res) {
          std::this_thread::yield();
          continue;
        }
        uint32_t x = 0;
        std::memcpy(&x, res.handle.payload, sizeof x);
        if (v.release_cas(res.handle)) {
          if (x < kItems && owned[x].fetch_add(1) == 0) done.fetch_add(1);
        } else {
          lost_races.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  th.emplace_back([&] {
    Ring v = ring;
    while (!stop.load(std::memory_order_relaxed)) {
      const uint32_t cons = v.consumer_position();
      for (uint32_t p = cons - kCap; p != cons; ++p) {
        RingHandle h{};
        if (!v.claimed_unreleased(p, &h)) continue;
        uint32_t x = 0;
        std::memcpy(&x, h.payload, sizeof x);
        if (v.release_cas(h)) {
          adopted.fetch_add(1, std::memory_order_relaxed);
          if (x < kItems && owned[x].fetch_add(1) == 0) done.fetch_add(1);
        }
      }
      std::this_thread::yield();
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (done.load() < kItems && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  stop.store(true);
  for (auto& t : th) t.join();
  ASSERT_EQ(done.load(), kItems);
  for (uint32_t i = 0; i < kItems; ++i) ASSERT_EQ(owned[i].load(), 1) << "entry " << i;
  EXPECT_EQ(adopted.load(), lost_races.load()) << "each adoption is one consumer's lost release";
}

}  // namespace
}  // namespace shmrdma
