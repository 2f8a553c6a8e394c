// LocalCq (src/local_cq.h), the FIFO of a process's own completions: what
// a producer puts comes out of take as the ibv_wc it stands for (every field
// as put, the rest 0), in order, none lost or taken twice, across laps and
// resizes, with one producer and with several claiming at once; a full FIFO
// refuses and takes again once the consumer has taken; take stops before an
// error and take_any takes it; `ready` is set by a put and cleared by the
// take that finds the FIFO empty.
#include "local_cq.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace shmrdma {
namespace {

struct Want {
  uint64_t wr_id;
  uint32_t status, opcode, byte_len, qp_num;
};

// What put(w) must come out as: the ibv_wc with those fields, every other
// byte 0 (compared byte for byte, so no field is left behind).
void expect_wc(const ibv_wc& got, const Want& w) {
  ibv_wc want;
  std::memset(&want, 0, sizeof want);
  want.wr_id = w.wr_id;
  want.status = static_cast<ibv_wc_status>(w.status);
  want.opcode = static_cast<ibv_wc_opcode>(w.opcode);
  want.byte_len = w.byte_len;
  want.qp_num = w.qp_num;
  EXPECT_EQ(0, std::memcmp(&got, &want, sizeof want))
      << "wr_id " << got.wr_id << "/" << w.wr_id << " status " << got.status << "/" << w.status << " opcode "
      << got.opcode << "/" << w.opcode << " byte_len " << got.byte_len << "/" << w.byte_len << " qp_num "
      << got.qp_num << "/" << w.qp_num << " vendor_err " << got.vendor_err << " imm " << got.imm_data
      << " src_qp " << got.src_qp << " wc_flags " << got.wc_flags;
}

bool put(LocalCq* l, const Want& w) {
  uint32_t pos;
  LocalCqSlot* s = l->reserve(&pos);
  if (!s) return false;
  l->put(s, pos, w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num);
  return true;
}

// A completion for index k, every field different from the last one's.
Want nth(uint64_t k) {
  static const uint32_t ops[] = {IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_COMP_SWAP,
                                 IBV_WC_FETCH_ADD, IBV_WC_RECV, IBV_WC_RECV_RDMA_WITH_IMM};
  return Want{0x0123456789abcdefull ^ (k * 0x9e3779b97f4a7c15ull), IBV_WC_SUCCESS, ops[k % 7],
              static_cast<uint32_t>(k * 2654435761u), static_cast<uint32_t>(0xffffff - k)};
}

struct Fifo {
  explicit Fifo(uint32_t capacity) : l(LocalCq::create(capacity, nullptr)) {}
  ~Fifo() { LocalCq::destroy(l); }
  LocalCq* l;
};

TEST(LocalCq, WhatIsPutIsTakenAsItsWcInOrderAcrossLaps) {
  Fifo f(8);
  LocalCq* l = f.l;
  EXPECT_EQ(0u, l->own_ready.load());
  ibv_wc wc[8];
  EXPECT_EQ(0, l->take(8, wc));
  uint64_t put_n = 0, taken = 0;
  // Batches of 1..8 put, then taken in polls of 1..8 entries: many laps.
  for (int round = 0; round < 200; ++round) {
    const uint32_t batch = 1 + round % 8;
    for (uint32_t k = 0; k < batch; ++k) ASSERT_TRUE(put(l, nth(put_n++)));
    EXPECT_EQ(1u, l->own_ready.load());
    const int ask = 1 + (round * 5) % 8;
    while (taken < put_n) {
      const int got = l->take(ask, wc);
      ASSERT_GT(got, 0);
      ASSERT_LE(got, ask);
      for (int i = 0; i < got; ++i) expect_wc(wc[i], nth(taken++));
    }
    EXPECT_EQ(0, l->take(ask, wc));
    EXPECT_EQ(0u, l->own_ready.load()) << "a take that found the FIFO empty clears ready";
  }
  EXPECT_EQ(put_n, taken);
}

TEST(LocalCq, AFullFifoRefusesAndTakesAgainOnceTaken) {
  Fifo f(4);
  LocalCq* l = f.l;
  for (uint64_t k = 0; k < 4; ++k) ASSERT_TRUE(put(l, nth(k)));
  EXPECT_FALSE(put(l, nth(99))) << "full";
  EXPECT_EQ(4u, l->held());
  ibv_wc wc[4];
  ASSERT_EQ(1, l->take(1, wc));
  expect_wc(wc[0], nth(0));
  ASSERT_TRUE(put(l, nth(4))) << "one taken: one free";
  EXPECT_FALSE(put(l, nth(99)));
  ASSERT_EQ(4, l->take(4, wc));
  for (int i = 0; i < 4; ++i) expect_wc(wc[i], nth(1 + i));
  // The one producer's two-step claim sees the same room.
  for (uint64_t k = 5; k < 9; ++k) {
    ASSERT_TRUE(l->room_single());
    uint32_t pos;
    LocalCqSlot* s = l->claim_single(&pos);
    const Want w = nth(k);
    l->put(s, pos, w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num);
  }
  EXPECT_FALSE(l->room_single()) << "full";
  ASSERT_EQ(4, l->take(4, wc));
  for (int i = 0; i < 4; ++i) expect_wc(wc[i], nth(5 + i));
}

TEST(LocalCq, TakeStopsBeforeAnErrorAndTakeAnyTakesIt) {
  Fifo f(8);
  LocalCq* l = f.l;
  ASSERT_TRUE(put(l, nth(0)));
  const Want err{77, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0x123456};
  const Want err2{78, IBV_WC_RETRY_EXC_ERR, IBV_WC_RDMA_WRITE, 0, 0x654321};
  ASSERT_TRUE(put(l, err));
  ASSERT_TRUE(put(l, err2));
  ibv_wc wc[8];
  EXPECT_FALSE(l->error_next());
  ASSERT_EQ(1, l->take(8, wc));
  expect_wc(wc[0], nth(0));
  EXPECT_TRUE(l->error_next());
  EXPECT_EQ(0, l->take(8, wc)) << "take stops before an error";
  ASSERT_EQ(2, l->take_any(8, wc, l->own_ready));
  expect_wc(wc[0], err);
  expect_wc(wc[1], err2);
  EXPECT_FALSE(l->error_next());
}

TEST(LocalCq, ResizeKeepsWhatIsHeldInOrder) {
  Fifo f(4);
  LocalCq* l = f.l;
  uint64_t put_n = 0, taken = 0;
  ibv_wc wc[16];
  // Move the positions off zero first, so the held items wrap in the old array.
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(put(l, nth(put_n++)));
  ASSERT_EQ(3, l->take(3, wc));
  taken = 3;
  for (int k = 0; k < 4; ++k) ASSERT_TRUE(put(l, nth(put_n++)));
  ASSERT_TRUE(l->resize(16));
  EXPECT_EQ(4u, l->held());
  for (int k = 0; k < 12; ++k) ASSERT_TRUE(put(l, nth(put_n++)));
  EXPECT_FALSE(put(l, nth(99)));
  ASSERT_EQ(16, l->take(16, wc));
  for (int i = 0; i < 16; ++i) expect_wc(wc[i], nth(taken++));
  ASSERT_TRUE(l->resize(2));
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(put(l, nth(put_n++)));
  EXPECT_FALSE(put(l, nth(99)));
  ASSERT_EQ(2, l->take(16, wc));
  for (int i = 0; i < 2; ++i) expect_wc(wc[i], nth(taken++));
}

// Several producers claim at once (set_multi: the CAS), each its own
// sequence; one consumer takes as they go, through a FIFO small enough to be
// full most of the time. Each producer's completions come out in its order,
// each once, with its fields.
TEST(LocalCq, SeveralProducersAtOnceAreEachTakenOnceInTheirOrder) {
  constexpr int kProducers = 4;
  constexpr uint32_t kEach = 20000;
  Fifo f(8);
  LocalCq* l = f.l;
  l->set_multi(true);
  std::atomic<bool> go{false}, stop{false};
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      while (!go.load()) std::this_thread::yield();
      for (uint32_t k = 0; k < kEach && !stop.load();) {
        const Want w{uint64_t{static_cast<uint32_t>(p)} << 32 | k, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, k,
                     static_cast<uint32_t>(p)};
        if (put(l, w))
          ++k;
        else
          std::this_thread::yield();  // full
      }
    });
  }
  std::vector<uint32_t> next(kProducers, 0);
  uint64_t taken = 0;
  bool bad = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  go.store(true);
  ibv_wc wc[5];
  while (!bad && taken < uint64_t{kProducers} * kEach && std::chrono::steady_clock::now() < deadline) {
    const int got = l->take(1 + taken % 5, wc);
    for (int i = 0; i < got && !bad; ++i) {
      const uint32_t p = static_cast<uint32_t>(wc[i].wr_id >> 32), k = static_cast<uint32_t>(wc[i].wr_id);
      if (p >= uint32_t{kProducers} || next[p] != k) {
        ADD_FAILURE() << "completion " << taken << ": producer " << p << " item " << k << ", expected item "
                      << (p < uint32_t{kProducers} ? next[p] : 0);
        bad = true;
        break;
      }
      expect_wc(wc[i], Want{wc[i].wr_id, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, k, p});
      ++next[p];
      ++taken;
    }
  }
  // The producers stop by themselves unless the consumer gave up.
  stop.store(true);
  for (auto& t : producers) t.join();
  if (bad) return;
  EXPECT_EQ(uint64_t{kProducers} * kEach, taken);
  EXPECT_EQ(0, l->take(5, wc)) << "nothing more";
}

}  // namespace
}  // namespace shmrdma
