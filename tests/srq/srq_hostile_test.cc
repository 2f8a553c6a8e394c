// A receiver that scribbles its own shared memory, as a hostile peer may,
// against the SRQ SEND leaf (1 to 64 bytes); and a receive record left
// completing by an initiator that died, written into the receiving QP's
// entry as that initiator would have left it. Unlike the other srq tests
// this one reads the context segment's layout (src/layout.h) to find the
// receiving QP's entry; everything else goes through the public verbs API,
// within this process (loopback QPs of one context).
//
// The leaf's one-word hit on a receive buffer (recv_write_hit) compares the
// sender's cached tag, lkey << 32 | PD, with the WQE's lkey and the target
// QP's pd_index, both in the receiver's memory. A cache entry the hit may
// not use (here: an on-demand MR, which the sender must move with CMA) keeps
// the tag all ones, so lkey 0xffffffff with pd_index 0xffffffff would match
// it and the sender would write through the entry's null base. It must
// not: the SEND fails as any SEND into a buffer of a bad lkey does.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "home.h"
#include "layout.h"
#include "verbs.h"

HARNESS_TEST_ENVIRONMENT(.tag = "srqhostile");

namespace {

using harness::poll_n;
using shmrdma::layout::ContextHeader;
using shmrdma::layout::QpEntry;

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// A second, writable view of the context segment that holds QP `qpn` (its
// number names the context slot: ctx-<slot>-<generation>), as a peer of that
// context sees it.
class SegmentView {
 public:
  ~SegmentView() {
    if (base_) ::munmap(base_, size_);
  }
  // The QP's entry, or nullptr (with the reason in *why).
  QpEntry* qp_entry(uint32_t qpn, std::string* why) {
    const std::string prefix = "ctx-" + std::to_string(shmrdma::layout::qpn_slot(qpn)) + "-";
    std::string name;
    for (const std::string& n : harness::Home::get().ctx_segments())
      if (n.rfind(prefix, 0) == 0) name = n;
    if (name.empty()) return *why = "no segment " + prefix + "*", nullptr;
    const std::string path = harness::Home::get().path() + "/devices/shm0/" + name;
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return *why = path + ": " + std::strerror(errno), nullptr;
    struct stat st{};
    if (::fstat(fd, &st) == 0 && st.st_size > 0) {
      size_ = static_cast<size_t>(st.st_size);
      void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      base_ = p == MAP_FAILED ? nullptr : p;
    }
    ::close(fd);
    if (!base_) return *why = path + ": cannot map it", nullptr;
    const auto* h = static_cast<const ContextHeader*>(base_);
    const uint32_t i = shmrdma::layout::qpn_index(qpn);
    if (i >= h->qp_slots || h->qp_table + (uint64_t{i} + 1) * sizeof(QpEntry) > size_)
      return *why = path + ": no QP table entry " + std::to_string(i), nullptr;
    auto* e = reinterpret_cast<QpEntry*>(static_cast<char*>(base_) + h->qp_table) + i;
    if (e->qpn != qpn) return *why = path + ": entry " + std::to_string(i) + " is another QP's", nullptr;
    return e;
  }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
};

class SrqHostile : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    std::string why;
    ctx_ = harness::open_shm0(&why);
    ASSERT_NE(ctx_, nullptr) << why;
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr);
    cq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ccq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_TRUE(cq_ && ccq_);
    buf_.assign(1 << 16, 0);
    mr_ = ibv_reg_mr(pd_, buf_.data(), buf_.size(), kAll);
    ASSERT_NE(mr_, nullptr);
  }
  void TearDown() override {
    for (auto* q : qps_) ibv_destroy_qp(q);
    if (srq_) ibv_destroy_srq(srq_);
    if (odp_mr_) ibv_dereg_mr(odp_mr_);
    if (mr_) ibv_dereg_mr(mr_);
    if (ccq_) ibv_destroy_cq(ccq_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
  }

  int post_srq(uint64_t wr_id, uint64_t addr, uint32_t len, uint32_t lkey) {
    ibv_sge sge{addr, len, lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_srq_recv(srq_, &wr, &bad);
  }
  // A signaled 8-byte SEND from c (the leaf's size, from our MR).
  int send8(ibv_qp* c, uint64_t wr_id) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data()), 8, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(c, &wr, &bad);
  }

  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;   // the receiver's (and the server QP's)
  ibv_cq* ccq_ = nullptr;  // the sender's own: the leaf wants its single producer
  ibv_mr* mr_ = nullptr;
  ibv_mr* odp_mr_ = nullptr;
  ibv_srq* srq_ = nullptr;
  std::vector<uint8_t> buf_;
  std::vector<ibv_qp*> qps_;
};

TEST_F(SrqHostile, HostileReceiverPdDoesNotMatchAnUnarmedKeyCache) {
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = 16;
  sa.attr.max_sge = 1;
  srq_ = ibv_create_srq(pd_, &sa);
  ASSERT_NE(srq_, nullptr) << std::strerror(errno);
  ibv_qp_init_attr qa{};
  qa.send_cq = cq_;
  qa.recv_cq = cq_;
  qa.srq = srq_;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = 16;
  qa.cap.max_send_sge = 1;
  ibv_qp* sv = ibv_create_qp(pd_, &qa);
  ASSERT_NE(sv, nullptr) << std::strerror(errno);
  qps_.push_back(sv);
  ibv_qp* c = harness::create_qp(pd_, ccq_, IBV_QPT_RC, 16, 16);
  ASSERT_NE(c, nullptr) << std::strerror(errno);
  qps_.push_back(c);
  const uint16_t lid = harness::port_lid(ctx_);
  ASSERT_EQ(harness::connect_qp(sv, c->qp_num, lid, kAll), 0);
  ASSERT_EQ(harness::connect_qp(c, sv->qp_num, lid, kAll), 0);
  for (uint32_t i = 0; i < 8; ++i) buf_[i] = static_cast<uint8_t>(0x30 + i);

  // The receive buffers: an on-demand MR. Within one process the sender
  // writes any other MR directly, and its one-word hit is armed for it; an
  // on-demand one it moves with CMA (never a fault), so the key cache that
  // names it stays unarmed, its tag all ones (arm_write_hit).
  std::vector<uint8_t> odp(8192, 0x5a);
  odp_mr_ = ibv_reg_mr(pd_, odp.data(), odp.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
  ASSERT_NE(odp_mr_, nullptr) << std::strerror(errno);
  const uint64_t odp_addr = reinterpret_cast<uint64_t>(odp.data());

  // (1) Two honest SENDs: the first fills the sender's caches of the target
  // (the leaf takes a WR only once they answer); the second, into the
  // on-demand buffer, leaves the receive key cache naming that MR, unarmed.
  ASSERT_EQ(post_srq(1, reinterpret_cast<uint64_t>(buf_.data()) + 2048, 64, mr_->lkey), 0);
  ASSERT_EQ(post_srq(2, odp_addr, 64, odp_mr_->lkey), 0);
  for (uint64_t k = 1; k <= 2; ++k) {
    ASSERT_EQ(send8(c, k), 0);
    ibv_wc w{};
    ASSERT_EQ(poll_n(ccq_, &w, 1), 1);
    ASSERT_EQ(w.status, IBV_WC_SUCCESS) << harness::wc_str(w);
    ASSERT_EQ(poll_n(cq_, &w, 1), 1);
    ASSERT_EQ(w.status, IBV_WC_SUCCESS) << harness::wc_str(w);
    ASSERT_EQ(w.wr_id, k);
  }
  for (uint32_t i = 0; i < 8; ++i) ASSERT_EQ(odp[i], 0x30 + i) << "the honest SEND's byte " << i;

  // (2) The receiver turns hostile: its QP's PD index and a WQE's lkey, both
  // in its own memory, all ones. The provider takes any lkey at post time
  // (it checks buffers when a message arrives). The buffer's address is
  // inside the on-demand MR, 4 KiB in: a write through the unarmed cache's
  // null base would go to address 0x1000.
  SegmentView view;
  std::string why;
  QpEntry* e = view.qp_entry(sv->qp_num, &why);
  ASSERT_NE(e, nullptr) << why;
  const uint32_t pd_index = e->pd_index;
  ASSERT_LT(pd_index, 0xfffffffeu);
  e->pd_index = 0xffffffff;
  ASSERT_EQ(post_srq(3, odp_addr + 4096, 64, 0xffffffff), 0);

  // (3) The next small SEND takes the leaf (its caches answer) and finds
  // that WQE. The PD of all ones is no PD: no hit, and the leaf declines
  // (the real key compares unequal); the general path (deliver) resolves
  // the lkey in the receiver's MR table, finds none, and fails as for any
  // bad lkey: the receiver's WQE with IBV_WC_LOC_PROT_ERR (its QP enters the
  // error state), the sender's with IBV_WC_REM_OP_ERR (responder_error).
  ASSERT_EQ(send8(c, 3), 0);
  ibv_wc snd{}, rcv{};
  ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
  ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
  e->pd_index = pd_index;  // (before any other assertion can end the test)
  EXPECT_EQ(snd.status, IBV_WC_REM_OP_ERR) << harness::wc_str(snd);
  EXPECT_EQ(snd.wr_id, 3u);
  EXPECT_EQ(rcv.status, IBV_WC_LOC_PROT_ERR) << harness::wc_str(rcv);
  EXPECT_EQ(rcv.wr_id, 3u);
  EXPECT_EQ(harness::qp_state(sv), IBV_QPS_ERR);
  for (size_t i = 8; i < odp.size(); ++i) ASSERT_EQ(odp[i], 0x5a) << "byte " << i << " of the on-demand MR was written";
}


// An initiator that dies while it completes a receive (its record left
// completing, layout.h kTakeCompleting) may or may not have put the receive
// completion into the CQ. The owner tells which from the CQ slot the
// initiator noted before it published (QpEntry::rx_take_cq): without the
// completion the WQE completes with IBV_WC_REM_ABORT_ERR, with it nothing
// more. Here 300 receive completions of the QP wait unpolled in its CQ,
// every value of an 8-bit take tag among them: a completion that never
// arrived is not taken for one of them (as it was while a one-byte tag in
// the CQE told them apart). The dead initiator is written into the entry:
// our own context's holder word with another generation, which no live
// context has.
TEST_F(SrqHostile, DeadInitiatorsCompletingRecordIsTold) {
  using shmrdma::layout::holder_generation;
  using shmrdma::layout::holder_of;
  using shmrdma::layout::holder_word;
  using shmrdma::layout::kTakeCompleting;
  using shmrdma::layout::kTakeMask;
  constexpr uint32_t kN = 300, kSlot = 64, kQkey = 0x11111111;
  ibv_cq* rcq = ibv_create_cq(ctx_, 1024, nullptr, nullptr, 0);
  ibv_cq* scq = ibv_create_cq(ctx_, 1024, nullptr, nullptr, 0);
  ASSERT_TRUE(rcq && scq);
  struct Cleanup {
    ibv_cq* a;
    ibv_cq* b;
    std::vector<ibv_qp*>* qps;
    ibv_ah* ah = nullptr;
    ~Cleanup() {
      for (auto* q : *qps) ibv_destroy_qp(q);
      qps->clear();
      if (ah) ibv_destroy_ah(ah);
      ibv_destroy_cq(a);
      ibv_destroy_cq(b);
    }
  } cleanup{rcq, scq, &qps_};
  ibv_qp* r = harness::create_qp(pd_, rcq, IBV_QPT_UD, 16, kN + 8);
  ibv_qp* s = harness::create_qp(pd_, scq, IBV_QPT_UD, kN + 8, 16);
  ASSERT_TRUE(r && s) << std::strerror(errno);
  qps_.push_back(r);
  qps_.push_back(s);
  for (ibv_qp* q : {r, s}) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qkey = kQkey;
    ASSERT_EQ(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY), 0);
    a.qp_state = IBV_QPS_RTR;
    ASSERT_EQ(ibv_modify_qp(q, &a, IBV_QP_STATE), 0);
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 1;
    ASSERT_EQ(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
  }
  ibv_ah_attr aa{};
  aa.dlid = harness::port_lid(ctx_);
  aa.port_num = 1;
  cleanup.ah = ibv_create_ah(pd_, &aa);
  ASSERT_NE(cleanup.ah, nullptr) << std::strerror(errno);
  const uint64_t base = reinterpret_cast<uint64_t>(buf_.data());
  auto post_recv = [&](uint64_t wr_id) {
    ibv_sge sge{base + 4096 + wr_id * kSlot, kSlot, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_recv(r, &wr, &bad);
  };
  auto send = [&](uint64_t wr_id) {
    ibv_sge sge{base, 8, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.ud.ah = cleanup.ah;
    wr.wr.ud.remote_qpn = r->qp_num;
    wr.wr.ud.remote_qkey = kQkey;
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(s, &wr, &bad) != 0) return false;
    ibv_wc w{};
    return poll_n(scq, &w, 1) == 1 && w.status == IBV_WC_SUCCESS;
  };
  ASSERT_LE(4096 + (kN + 1) * kSlot, buf_.size());
  for (uint64_t k = 0; k <= kN; ++k) ASSERT_EQ(post_recv(k), 0) << k;
  for (uint64_t k = 0; k < kN; ++k) ASSERT_TRUE(send(k)) << "UD SEND " << k;

  SegmentView view;
  std::string why;
  QpEntry* e = view.qp_entry(r->qp_num, &why);
  ASSERT_NE(e, nullptr) << why;
  const uint32_t idle = e->rx_take.load();
  ASSERT_EQ(idle & kTakeMask, 0u) << "the record is idle after the SENDs";
  const uint64_t holder = e->rx_holder.load();
  const uint64_t dead = holder_word(holder_of(holder), holder_generation(holder) + 1000);
  // The owner's liveness pass, which ends a dead initiator's record, runs
  // from its polls, of any CQ of the context: polls of the sender's (empty)
  // CQ for `ms` run it (at most every 200 ms) while the receive
  // completions stay in theirs.
  auto liveness = [&](int ms) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    ibv_wc w{};
    while (std::chrono::steady_clock::now() < until) ASSERT_EQ(ibv_poll_cq(scq, 1, &w), 0);
  };
  // Polls until `want` completions came (and then for `quiet_ms` more, in
  // which nothing else may come).
  auto drain = [&](std::vector<ibv_wc>* got, size_t want, int quiet_ms) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
    std::chrono::steady_clock::time_point quiet_from{};
    for (;;) {
      ibv_wc w{};
      const int n = ibv_poll_cq(rcq, 1, &w);
      ASSERT_GE(n, 0);
      if (n == 1) got->push_back(w);
      const auto now = std::chrono::steady_clock::now();
      if (got->size() >= want && quiet_from == std::chrono::steady_clock::time_point{}) quiet_from = now;
      if (got->size() >= want && now - quiet_from > std::chrono::milliseconds(quiet_ms)) return;
      ASSERT_TRUE(now < until) << "only " << got->size() << " of " << want << " receive completions in 8 s";
    }
  };

  // (1) A dead initiator's completing record for a WQE (wr_id 0xdead)
  // whose completion it never pushed: the record's value is one no push
  // noted.
  e->rx_take_wr_id.store(0xdead);
  e->rx_holder.store(dead);
  e->rx_take.store((idle & ~kTakeMask) + 4 + kTakeCompleting);
  liveness(600);
  EXPECT_EQ(e->rx_take.load() & kTakeMask, 0u) << "the owner ended the record";
  std::vector<ibv_wc> got;
  drain(&got, kN + 1, 300);
  ASSERT_EQ(got.size(), kN + 1u);
  for (uint32_t k = 0; k < kN; ++k) {
    ASSERT_EQ(got[k].status, IBV_WC_SUCCESS) << harness::wc_str(got[k]);
    ASSERT_EQ(got[k].wr_id, k);
  }
  EXPECT_EQ(got[kN].status, IBV_WC_REM_ABORT_ERR) << harness::wc_str(got[kN]);
  EXPECT_EQ(got[kN].wr_id, 0xdeadu);
  EXPECT_EQ(got[kN].qp_num, r->qp_num);

  // (2) One whose completion did reach the CQ (the record as the last
  // real completion left it completing, and the slot it noted): nothing
  // more completes, whether the completion waits in the CQ or was polled.
  ASSERT_TRUE(send(kN)) << "UD SEND " << kN;
  const uint64_t note = e->rx_take_cq.load();
  ASSERT_EQ(static_cast<uint32_t>(note >> 32) & kTakeMask, kTakeCompleting) << "a push noted its slot";
  for (int polled = 0; polled < 2; ++polled) {
    e->rx_holder.store(dead);
    e->rx_take.store(static_cast<uint32_t>(note >> 32));
    liveness(600);
    EXPECT_EQ(e->rx_take.load() & kTakeMask, 0u) << "the owner ended the record";
    got.clear();
    drain(&got, polled ? 0 : 1, 300);
    ASSERT_EQ(got.size(), polled ? 0u : 1u) << (got.size() > 1 ? harness::wc_str(got[1]) : std::string());
    if (!polled) {
      EXPECT_EQ(got[0].status, IBV_WC_SUCCESS) << harness::wc_str(got[0]);
      EXPECT_EQ(got[0].wr_id, kN);
    }
  }

  // The QP goes on: a new receive takes the next SEND.
  ASSERT_EQ(post_recv(kN + 1), 0);
  ASSERT_TRUE(send(kN + 1));
  got.clear();
  drain(&got, 1, 0);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].status, IBV_WC_SUCCESS) << harness::wc_str(got[0]);
  EXPECT_EQ(got[0].wr_id, kN + 1);
}

}  // namespace
