// Data-path error handling through the public verbs API, in one process: two
// contexts on shm0, RC QPs of one connected to QPs of the other.
//
// Each case builds fresh objects; TearDown destroys them (every destroy must
// succeed) and checks with `shmrdma status --json` that the object counts of
// this process are back to zero while its contexts are open, and that the
// process is no longer listed once they are closed.
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "home.h"
#include "verbs.h"

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

namespace {

using harness::wc_str;
using Clock = std::chrono::steady_clock;

constexpr int kAllAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
constexpr size_t kBuf = 16384;

struct PairOpts {
  int a_qp_access = kAllAccess;  // initiator QP's qp_access_flags
  int b_qp_access = kAllAccess;  // target QP's qp_access_flags
  int b_mr_access = kAllAccess;  // target MR access
  int a_mr_access = kAllAccess;  // initiator MR access
  uint8_t rnr_retry = 7;
  uint8_t b_min_rnr_timer = 1;  // 0.01 ms
  uint32_t max_send_wr = 16;
  uint32_t max_send_sge = 4;
  uint32_t max_recv_wr = 16;
  uint32_t max_recv_sge = 4;
  uint32_t max_inline = 64;
  bool connect = true;  // up to RTS on both sides
  uint8_t a_timeout = 14;   // initiator's transport timer: 4.096 us << timeout
  uint8_t a_retry_cnt = 7;
};

// A: the initiator (context 0), B: the target (context 1).
struct Pair {
  ibv_qp* a = nullptr;
  ibv_qp* b = nullptr;
  ibv_cq* acq = nullptr;
  ibv_cq* bcq = nullptr;
  ibv_mr* amr = nullptr;
  ibv_mr* bmr = nullptr;
  uint8_t* abuf = nullptr;
  uint8_t* bbuf = nullptr;
  ibv_qp_cap acap{};

  ibv_sge a_sge(size_t off, uint32_t len) const {
    return ibv_sge{reinterpret_cast<uintptr_t>(abuf) + off, len, amr->lkey};
  }
  ibv_sge b_sge(size_t off, uint32_t len) const {
    return ibv_sge{reinterpret_cast<uintptr_t>(bbuf) + off, len, bmr->lkey};
  }
  uint64_t b_addr(size_t off = 0) const { return reinterpret_cast<uintptr_t>(bbuf) + off; }
};

int post(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, ibv_sge* sg, int nsge, uint64_t raddr = 0, uint32_t rkey = 0,
         int flags = IBV_SEND_SIGNALED, ibv_send_wr** bad_out = nullptr) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sg;
  wr.num_sge = nsge;
  wr.send_flags = static_cast<unsigned>(flags);
  if (op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = raddr;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = 1;
    wr.wr.atomic.swap = 2;
  } else {
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
  }
  if (op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(0x1234);
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp, &wr, &bad);
  if (bad_out) *bad_out = bad;
  return rc;
}

bool is_atomic(ibv_wr_opcode op) {
  return op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP;
}

int post_recv(ibv_qp* qp, uint64_t wr_id, ibv_sge* sg, int nsge, ibv_recv_wr** bad_out = nullptr) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sg;
  wr.num_sge = nsge;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_recv(qp, &wr, &bad);
  if (bad_out) *bad_out = bad;
  return rc;
}

// No completion arrives on `cq` within ms.
::testing::AssertionResult no_completion(ibv_cq* cq, int ms) {
  ibv_wc wc{};
  if (harness::poll_one(cq, &wc, ms)) return ::testing::AssertionFailure() << "unexpected completion " << wc_str(wc);
  return ::testing::AssertionSuccess();
}

class Errors : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    nlohmann::json st = harness::Home::get().status();
    ASSERT_TRUE(harness::Home::find_process(st, ::getpid()).is_null()) << "this process is listed before it opened a context";
    for (int i = 0; i < 2; ++i) {
      std::string why;
      ctx_[i] = harness::open_shm0(&why);
      ASSERT_NE(ctx_[i], nullptr) << why;
      pd_[i] = ibv_alloc_pd(ctx_[i]);
      ASSERT_NE(pd_[i], nullptr) << "ibv_alloc_pd: " << std::strerror(errno);
      lid_[i] = harness::port_lid(ctx_[i]);
      ASSERT_NE(lid_[i], 0) << "port 1 has no LID";
    }
    ibv_device_attr da{};
    ASSERT_EQ(ibv_query_device(ctx_[0], &da), 0);
    dev_ = da;
    set_up_ = true;
  }

  void TearDown() override {
    if (!set_up_) {
      close_contexts();
      return;
    }
    // Destroy in reverse order of creation: every destroy must succeed.
    while (!cleanup_.empty()) {
      cleanup_.back()();
      cleanup_.pop_back();
    }
    for (int i = 0; i < 2; ++i) {
      if (pd_[i]) {
        EXPECT_EQ(ibv_dealloc_pd(pd_[i]), 0) << "ibv_dealloc_pd";
      }
      pd_[i] = nullptr;
    }
    // Nothing left while the contexts are still open.
    nlohmann::json st = harness::Home::get().status();
    nlohmann::json me = harness::Home::find_process(st, ::getpid());
    EXPECT_FALSE(me.is_null()) << "this process (two open contexts) is not listed:\n" << st.dump(2);
    if (!me.is_null() && me.contains("objects")) {
      for (const char* k : {"pd", "cq", "wq", "rwq_ind_table", "qp", "mr"})
        EXPECT_EQ(me["objects"].value(k, -1), 0) << "status lists " << k << " objects after every one was destroyed:\n"
                                                 << me.dump(2);
    }
    close_contexts();
    st = harness::Home::get().status();
    EXPECT_TRUE(harness::Home::find_process(st, ::getpid()).is_null())
        << "this process is still listed after closing its contexts:\n" << st.dump(2);
    EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "ctx-* files remain after closing every context";
  }

  void close_contexts() {
    for (int i = 0; i < 2; ++i) {
      if (ctx_[i]) {
        EXPECT_EQ(ibv_close_device(ctx_[i]), 0);
      }
      ctx_[i] = nullptr;
    }
  }

  uint8_t* alloc(size_t len) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, len)) return nullptr;
    std::memset(p, 0, len);
    cleanup_.push_back([p] { std::free(p); });
    cleanup_obj_.push_back(nullptr);
    return static_cast<uint8_t*>(p);
  }

  ibv_cq* new_cq(int side, int n = 64) {
    ibv_cq* cq = ibv_create_cq(ctx_[side], n, nullptr, nullptr, 0);
    if (cq) {
      cleanup_.push_back([cq] { EXPECT_EQ(ibv_destroy_cq(cq), 0) << "ibv_destroy_cq"; });
      cleanup_obj_.push_back(cq);
    }
    return cq;
  }

  ibv_pd* new_pd(int side) {
    ibv_pd* pd = ibv_alloc_pd(ctx_[side]);
    if (pd) {
      cleanup_.push_back([pd] { EXPECT_EQ(ibv_dealloc_pd(pd), 0) << "ibv_dealloc_pd"; });
      cleanup_obj_.push_back(pd);
    }
    return pd;
  }

  ibv_mr* new_mr(ibv_pd* pd, void* addr, size_t len, int access) {
    ibv_mr* mr = ibv_reg_mr(pd, addr, len, access);
    if (mr) {
      cleanup_.push_back([mr] { EXPECT_EQ(ibv_dereg_mr(mr), 0) << "ibv_dereg_mr"; });
      cleanup_obj_.push_back(mr);
    }
    return mr;
  }

  ibv_qp* new_qp(ibv_pd* pd, ibv_cq* cq, const PairOpts& o, ibv_qp_cap* cap_out = nullptr) {
    ibv_qp_init_attr ia{};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = o.max_send_wr;
    ia.cap.max_recv_wr = o.max_recv_wr;
    ia.cap.max_send_sge = o.max_send_sge;
    ia.cap.max_recv_sge = o.max_recv_sge;
    ia.cap.max_inline_data = o.max_inline;
    ibv_qp* qp = ibv_create_qp(pd, &ia);
    if (qp) {
      cleanup_.push_back([qp] { EXPECT_EQ(ibv_destroy_qp(qp), 0) << "ibv_destroy_qp"; });
      cleanup_obj_.push_back(qp);
      if (cap_out) *cap_out = ia.cap;
    }
    return qp;
  }

  // A pair for the list tests: 64 WRs each way, the receiver's RNR timer
  // at its shortest (SENDs past the posted receives wait for more).
  void make_list_pair(Pair* p) {
    PairOpts o;
    o.max_send_wr = 64;
    o.max_recv_wr = 64;
    o.b_min_rnr_timer = 1;
    make_pair(p, o);
  }

  // Two QPs, A in context 0 and B in context 1, with their own CQ and a
  // registered buffer each; connected and in RTS unless !o.connect.
  void make_pair(Pair* p, const PairOpts& o = PairOpts{}) {
    p->acq = new_cq(0);
    p->bcq = new_cq(1);
    ASSERT_TRUE(p->acq && p->bcq) << "ibv_create_cq: " << std::strerror(errno);
    p->abuf = alloc(kBuf);
    p->bbuf = alloc(kBuf);
    ASSERT_TRUE(p->abuf && p->bbuf);
    p->amr = new_mr(pd_[0], p->abuf, kBuf, o.a_mr_access);
    ASSERT_NE(p->amr, nullptr) << "ibv_reg_mr: " << std::strerror(errno);
    p->bmr = new_mr(pd_[1], p->bbuf, kBuf, o.b_mr_access);
    ASSERT_NE(p->bmr, nullptr) << "ibv_reg_mr: " << std::strerror(errno);
    p->a = new_qp(pd_[0], p->acq, o, &p->acap);
    ASSERT_NE(p->a, nullptr) << "ibv_create_qp: " << std::strerror(errno);
    p->b = new_qp(pd_[1], p->bcq, o);
    ASSERT_NE(p->b, nullptr) << "ibv_create_qp: " << std::strerror(errno);
    if (!o.connect) return;
    ASSERT_EQ(harness::qp_to_init(p->a, o.a_qp_access), 0);
    ASSERT_EQ(harness::qp_to_init(p->b, o.b_qp_access), 0);
    ASSERT_EQ(harness::qp_to_rtr(p->a, p->b->qp_num, lid_[1], 1), 0);
    ASSERT_EQ(harness::qp_to_rtr(p->b, p->a->qp_num, lid_[0], o.b_min_rnr_timer), 0);
    ASSERT_EQ(harness::qp_to_rts(p->a, o.rnr_retry, o.a_timeout, o.a_retry_cnt), 0);
    ASSERT_EQ(harness::qp_to_rts(p->b, o.rnr_retry), 0);
  }

  // The QP is in ERR and a further SEND on it completes with WR_FLUSH_ERR.
  void expect_err_and_flush(ibv_qp* qp, ibv_cq* cq, const char* what) {
    EXPECT_EQ(harness::qp_state(qp), IBV_QPS_ERR)
        << what << ": QP state " << harness::qp_state_name(harness::qp_state(qp)) << " after an error completion, expected ERR";
    ASSERT_EQ(post(qp, IBV_WR_SEND, 9999, nullptr, 0), 0) << what << ": post_send on a QP in ERR";
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(cq, &wc)) << what << ": no completion for a WR posted in ERR";
    EXPECT_EQ(wc.wr_id, 9999u) << wc_str(wc);
    EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << what << ": WR posted in ERR: " << wc_str(wc);
  }

  // Posts one WR on a fresh pair and expects exactly `want` on A's CQ, then
  // ERR + flush.
  void expect_status(const Pair& p, ibv_wr_opcode op, ibv_sge* sg, int nsge, uint64_t raddr, uint32_t rkey,
                     ibv_wc_status want, const char* what) {
    ASSERT_EQ(post(p.a, op, 77, sg, nsge, raddr, rkey), 0) << what << ": post_send";
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << what << ": no completion within 5 s";
    EXPECT_EQ(wc.wr_id, 77u) << what;
    EXPECT_EQ(wc.status, want) << what << ": got " << wc_str(wc) << ", expected status "
                               << ibv_wc_status_str(want);
    expect_err_and_flush(p.a, p.acq, what);
  }

  ibv_context* ctx_[2] = {nullptr, nullptr};
  ibv_pd* pd_[2] = {nullptr, nullptr};
  uint16_t lid_[2] = {0, 0};
  ibv_device_attr dev_{};
  bool set_up_ = false;
  std::vector<std::function<void()>> cleanup_;
  std::vector<const void*> cleanup_obj_;  // the object of each cleanup_ entry (nullptr: memory)

  // Destroys an object made by new_qp/new_mr now instead of in TearDown.
  void destroy_now(const void* obj) {
    for (size_t i = cleanup_obj_.size(); i-- > 0;)
      if (cleanup_obj_[i] == obj) {
        cleanup_[i]();
        cleanup_.erase(cleanup_.begin() + static_cast<ptrdiff_t>(i));
        cleanup_obj_.erase(cleanup_obj_.begin() + static_cast<ptrdiff_t>(i));
        return;
      }
    ADD_FAILURE() << "destroy_now: unknown object";
  }
};

// ---------------------------------------------------------------------------
// ibv_query_qp_data_in_order: shmrdma promises no in-order placement within a
// message (memcpy and process_vm_writev store a message's bytes in no fixed
// order; only an RDMA WRITE's last byte is stored last), so the answer is 0
// for every opcode, connected or not (docs/ARCHITECTURE.md, data path).

TEST_F(Errors, QueryQpDataInOrderPromisesNothing) {
  Pair p;
  make_pair(&p);
  for (ibv_wr_opcode op : {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
                           IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD})
    for (ibv_qp* q : {p.a, p.b}) EXPECT_EQ(ibv_query_qp_data_in_order(q, op, 0), 0) << "opcode " << op;
  EXPECT_EQ(ibv_query_qp_data_in_order(p.a, IBV_WR_RDMA_WRITE, 1u << 31), 0) << "an unknown flag";
}

// ---------------------------------------------------------------------------
// Local protection

TEST_F(Errors, WrongLkeyOnSendIsLocProtErr) {
  Pair p;
  make_pair(&p);
  ibv_sge r = p.b_sge(0, 64);
  ASSERT_EQ(post_recv(p.b, 1, &r, 1), 0);
  ibv_sge s = p.a_sge(0, 64);
  s.lkey += 1;
  expect_status(p, IBV_WR_SEND, &s, 1, 0, 0, IBV_WC_LOC_PROT_ERR, "SEND with lkey+1");
  EXPECT_TRUE(no_completion(p.bcq, 100)) << "the target saw a completion for a SEND that failed locally";
}

TEST_F(Errors, WrongLkeyOnWriteIsLocProtErr) {
  Pair p;
  make_pair(&p);
  ibv_sge s = p.a_sge(0, 64);
  s.lkey += 1;
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_LOC_PROT_ERR, "WRITE with lkey+1");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << "a WRITE that failed locally changed target byte " << i;
}

TEST_F(Errors, LocalSgeOutsideMrIsLocProtErr) {
  Pair p;
  make_pair(&p);
  ibv_sge s = p.a_sge(kBuf - 32, 64);  // runs 32 bytes past the MR
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_LOC_PROT_ERR, "local SGE past the MR");
}

TEST_F(Errors, ReadIntoMrWithoutLocalWriteIsLocProtErr) {
  PairOpts o;
  o.a_mr_access = IBV_ACCESS_REMOTE_READ;  // valid without LOCAL_WRITE, but a READ cannot land in it
  Pair p;
  make_pair(&p, o);
  ibv_sge s = p.a_sge(0, 64);
  expect_status(p, IBV_WR_RDMA_READ, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_LOC_PROT_ERR,
                "READ into a local MR without LOCAL_WRITE");
}

TEST_F(Errors, LkeyOfAnotherPdIsLocProtErr) {
  Pair p;
  make_pair(&p);
  ibv_pd* other = new_pd(0);
  ASSERT_NE(other, nullptr);
  uint8_t* buf = alloc(4096);
  ibv_mr* mr = new_mr(other, buf, 4096, kAllAccess);
  ASSERT_NE(mr, nullptr);
  ibv_sge s{reinterpret_cast<uintptr_t>(buf), 64, mr->lkey};
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_LOC_PROT_ERR,
                "local SGE with the lkey of an MR of another PD");
}

// ---------------------------------------------------------------------------
// Remote access

TEST_F(Errors, WrongRkeyIsRemAccessErr) {
  struct Case {
    ibv_wr_opcode op;
    const char* what;
  } cases[] = {{IBV_WR_RDMA_WRITE, "WRITE with rkey+1"},
               {IBV_WR_RDMA_WRITE_WITH_IMM, "WRITE_WITH_IMM with rkey+1"},
               {IBV_WR_RDMA_READ, "READ with rkey+1"},
               {IBV_WR_ATOMIC_FETCH_AND_ADD, "FETCH_AND_ADD with rkey+1"},
               {IBV_WR_ATOMIC_CMP_AND_SWP, "CMP_AND_SWP with rkey+1"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Pair p;
    make_pair(&p);
    ibv_sge r = p.b_sge(4096, 64);
    ASSERT_EQ(post_recv(p.b, 1, &r, 1), 0);
    bool atomic = c.op == IBV_WR_ATOMIC_FETCH_AND_ADD || c.op == IBV_WR_ATOMIC_CMP_AND_SWP;
    ibv_sge s = p.a_sge(0, atomic ? 8 : 64);
    expect_status(p, c.op, &s, 1, p.b_addr(), p.bmr->rkey + 1, IBV_WC_REM_ACCESS_ERR, c.what);
    for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << c.what << " changed target byte " << i;
    if (c.op == IBV_WR_RDMA_WRITE_WITH_IMM) {
      ibv_wc wc{};
      if (harness::poll_one(p.bcq, &wc, 100)) {
        EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "the target completed a receive for a WRITE_WITH_IMM with a bad rkey: "
                                             << wc_str(wc);
      }
    }
  }
}

TEST_F(Errors, RemoteRangeOutsideMrIsRemAccessErr) {
  struct Case {
    ibv_wr_opcode op;
    int64_t off;
    uint32_t len;
    const char* what;
  } cases[] = {{IBV_WR_RDMA_WRITE, static_cast<int64_t>(kBuf) - 4, 8, "WRITE over the MR's end"},
               {IBV_WR_RDMA_WRITE, -8, 16, "WRITE starting before the MR"},
               {IBV_WR_RDMA_WRITE, static_cast<int64_t>(kBuf), 1, "WRITE one byte past the MR"},
               {IBV_WR_RDMA_READ, static_cast<int64_t>(kBuf) - 4, 8, "READ over the MR's end"},
               {IBV_WR_RDMA_READ, -1, 4, "READ starting before the MR"},
               {IBV_WR_ATOMIC_FETCH_AND_ADD, static_cast<int64_t>(kBuf), 8, "FETCH_AND_ADD past the MR"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, c.len);
    expect_status(p, c.op, &s, 1, p.b_addr() + c.off, p.bmr->rkey, IBV_WC_REM_ACCESS_ERR, c.what);
    for (size_t i = 0; i < kBuf; ++i) ASSERT_EQ(p.bbuf[i], 0) << c.what << " changed target byte " << i;
  }
}

TEST_F(Errors, MrWithoutRemoteAccessIsRemAccessErr) {
  struct Case {
    int mr_access;
    ibv_wr_opcode op;
    const char* what;
  } cases[] = {
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_RDMA_WRITE,
       "WRITE to an MR without REMOTE_WRITE"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_RDMA_READ,
       "READ from an MR without REMOTE_READ"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, IBV_WR_ATOMIC_FETCH_AND_ADD,
       "FETCH_AND_ADD on an MR without REMOTE_ATOMIC"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
       "CMP_AND_SWP on an MR without REMOTE_ATOMIC"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    PairOpts o;
    o.b_mr_access = c.mr_access;
    Pair p;
    make_pair(&p, o);
    bool atomic = c.op == IBV_WR_ATOMIC_FETCH_AND_ADD || c.op == IBV_WR_ATOMIC_CMP_AND_SWP;
    ibv_sge s = p.a_sge(0, atomic ? 8 : 64);
    expect_status(p, c.op, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR, c.what);
    for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << c.what << " changed target byte " << i;
  }
}

TEST_F(Errors, QpWithoutRemoteAccessFlagsIsRemAccessErr) {
  struct Case {
    int qp_access;
    ibv_wr_opcode op;
    const char* what;
  } cases[] = {
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_RDMA_WRITE,
       "WRITE to a QP without REMOTE_WRITE in qp_access_flags"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_RDMA_WRITE_WITH_IMM,
       "WRITE_WITH_IMM to a QP without REMOTE_WRITE in qp_access_flags"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_RDMA_READ,
       "READ from a QP without REMOTE_READ in qp_access_flags"},
      {IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
       "CMP_AND_SWP on a QP without REMOTE_ATOMIC in qp_access_flags"},
      {0, IBV_WR_RDMA_WRITE, "WRITE to a QP with qp_access_flags 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    PairOpts o;
    o.b_qp_access = c.qp_access;
    Pair p;
    make_pair(&p, o);
    ibv_sge r = p.b_sge(4096, 64);
    ASSERT_EQ(post_recv(p.b, 1, &r, 1), 0);
    bool atomic = c.op == IBV_WR_ATOMIC_FETCH_AND_ADD || c.op == IBV_WR_ATOMIC_CMP_AND_SWP;
    ibv_sge s = p.a_sge(0, atomic ? 8 : 64);
    expect_status(p, c.op, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR, c.what);
    for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << c.what << " changed target byte " << i;
  }
}

TEST_F(Errors, QpAccessFlagsChangedInRtsAreEnforced) {
  // RTS -> RTS may change qp_access_flags; the new flags apply at once.
  Pair p;
  make_pair(&p);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS), 0);
  ibv_sge s = p.a_sge(0, 64);
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR,
                "WRITE after REMOTE_WRITE was removed from the target QP in RTS");
}

// The initiator keeps what it checked of the target QP while the target's
// entry keeps its version (QpEntry::version): a change after a WRITE that
// passed applies to the very next one.
TEST_F(Errors, TargetAccessChangedAfterAWriteIsEnforced) {
  Pair p;
  make_pair(&p);
  ibv_sge s = p.a_sge(0, 64);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 76, &s, 1, p.b_addr(), p.bmr->rkey), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "first WRITE: no completion within 5 s";
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS), 0);
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR,
                "WRITE after REMOTE_WRITE was removed from the target QP, once a WRITE had passed");
}

TEST_F(Errors, RkeyOfMrInAnotherPdIsRemAccessErr) {
  Pair p;
  make_pair(&p);
  ibv_pd* other = new_pd(1);  // the target's context, another PD than its QP's
  ASSERT_NE(other, nullptr);
  uint8_t* buf = alloc(4096);
  ibv_mr* mr = new_mr(other, buf, 4096, kAllAccess);
  ASSERT_NE(mr, nullptr);
  ibv_sge s = p.a_sge(0, 64);
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, reinterpret_cast<uintptr_t>(buf), mr->rkey, IBV_WC_REM_ACCESS_ERR,
                "WRITE with the rkey of an MR in another PD of the target");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(buf[i], 0) << "the WRITE changed byte " << i;
}

TEST_F(Errors, RecvSgeWithBadLkeyIsLocProtErrAtTarget) {
  Pair p;
  make_pair(&p);
  ibv_sge r = p.b_sge(0, 64);
  r.lkey += 1;
  ASSERT_EQ(post_recv(p.b, 5, &r, 1), 0);
  ibv_sge s = p.a_sge(0, 32);
  ASSERT_EQ(post(p.a, IBV_WR_SEND, 77, &s, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_REM_OP_ERR) << "sender of a SEND into a receive with a bad lkey: " << wc_str(wc);
  ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
  EXPECT_EQ(wc.wr_id, 5u);
  EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR) << "receive with a bad lkey: " << wc_str(wc);
  EXPECT_EQ(harness::qp_state(p.b), IBV_QPS_ERR) << "the target QP after a local protection error on a receive";
  expect_err_and_flush(p.a, p.acq, "sender after REM_OP_ERR");
}

// ---------------------------------------------------------------------------
// Posting errors (return values, bad_wr)

TEST_F(Errors, TooManySgesIsEinvalWithBadWr) {
  Pair p;
  make_pair(&p);
  const int max = static_cast<int>(p.acap.max_send_sge);
  ASSERT_GE(max, 1);
  std::vector<ibv_sge> sg(static_cast<size_t>(max) + 1);
  for (int i = 0; i <= max; ++i) sg[static_cast<size_t>(i)] = p.a_sge(static_cast<size_t>(i) * 8, 8);
  // A chain: a good WRITE, then one with max_send_sge + 1 SGEs, then another good one.
  ibv_send_wr w[3]{};
  for (int i = 0; i < 3; ++i) {
    w[i].wr_id = 100 + static_cast<uint64_t>(i);
    w[i].opcode = IBV_WR_RDMA_WRITE;
    w[i].send_flags = IBV_SEND_SIGNALED;
    w[i].sg_list = sg.data();
    w[i].num_sge = 1;
    w[i].wr.rdma.remote_addr = p.b_addr();
    w[i].wr.rdma.rkey = p.bmr->rkey;
    if (i < 2) w[i].next = &w[i + 1];
  }
  w[1].num_sge = max + 1;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(p.a, &w[0], &bad), EINVAL) << "post_send with max_send_sge+1 = " << max + 1 << " SGEs";
  EXPECT_EQ(bad, &w[1]) << "bad_wr must point at the WR with too many SGEs";
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "the good WR before the bad one was not executed";
  EXPECT_EQ(wc.wr_id, 100u) << wc_str(wc);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_TRUE(no_completion(p.acq, 100)) << "WRs at or after bad_wr must not be executed";
  // Exactly max_send_sge works.
  w[1].num_sge = max;
  w[1].next = nullptr;
  EXPECT_EQ(ibv_post_send(p.a, &w[1], &bad), 0) << "post_send with max_send_sge SGEs";
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS) << "a rejected post must not change the QP state";
}

TEST_F(Errors, TooManyRecvSgesIsEinvalWithBadWr) {
  Pair p;
  ibv_qp_cap bcap{};
  make_pair(&p);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  ASSERT_EQ(ibv_query_qp(p.b, &qa, IBV_QP_CAP, &qi), 0);
  bcap = qi.cap;
  const int max = static_cast<int>(bcap.max_recv_sge);
  std::vector<ibv_sge> sg(static_cast<size_t>(max) + 1);
  for (int i = 0; i <= max; ++i) sg[static_cast<size_t>(i)] = p.b_sge(static_cast<size_t>(i) * 8, 8);
  ibv_recv_wr w[2]{};
  w[0].wr_id = 1;
  w[0].sg_list = sg.data();
  w[0].num_sge = 1;
  w[0].next = &w[1];
  w[1].wr_id = 2;
  w[1].sg_list = sg.data();
  w[1].num_sge = max + 1;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(p.b, &w[0], &bad), EINVAL) << "post_recv with max_recv_sge+1 = " << max + 1 << " SGEs";
  EXPECT_EQ(bad, &w[1]);
}

TEST_F(Errors, OversizedInlineIsEinval) {
  Pair p;
  make_pair(&p);
  const uint32_t max = p.acap.max_inline_data;
  ASSERT_GT(max, 0u) << "asked for 64 bytes of inline data";
  ASSERT_LT(max + 1, kBuf);
  ibv_sge s = p.a_sge(0, max + 1);
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, &s, 1, p.b_addr(), p.bmr->rkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE, &bad),
            EINVAL)
      << "inline WRITE of max_inline_data+1 = " << max + 1 << " bytes";
  EXPECT_NE(bad, nullptr);
  // Spread over two SGEs: the total counts.
  ibv_sge two[2] = {p.a_sge(0, max / 2 + 1), p.a_sge(4096, max - max / 2)};
  EXPECT_EQ(post(p.a, IBV_WR_SEND, 2, two, 2, 0, 0, IBV_SEND_SIGNALED | IBV_SEND_INLINE, &bad), EINVAL)
      << "inline SEND of max_inline_data+1 bytes in two SGEs";
  EXPECT_TRUE(no_completion(p.acq, 50));
  // Exactly max_inline_data is fine.
  for (uint32_t i = 0; i < max; ++i) p.abuf[i] = static_cast<uint8_t>(i * 7 + 1);
  s = p.a_sge(0, max);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 3, &s, 1, p.b_addr(), p.bmr->rkey, IBV_SEND_SIGNALED | IBV_SEND_INLINE), 0);
  std::memset(p.abuf, 0xee, max);  // inline: the buffer is ours again at once
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  for (uint32_t i = 0; i < max; ++i)
    ASSERT_EQ(p.bbuf[i], static_cast<uint8_t>(i * 7 + 1)) << "inline WRITE byte " << i;
}

TEST_F(Errors, PostSendBeforeRtsIsEinval) {
  PairOpts o;
  o.connect = false;
  Pair p;
  make_pair(&p, o);
  ibv_sge s = p.a_sge(0, 8);
  auto try_send = [&](const char* state) {
    ibv_send_wr* bad = nullptr;
    EXPECT_EQ(post(p.a, IBV_WR_SEND, 1, &s, 1, 0, 0, IBV_SEND_SIGNALED, &bad), EINVAL) << "post_send in " << state;
    EXPECT_NE(bad, nullptr) << "bad_wr after post_send in " << state;
    EXPECT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, &s, 1, p.b_addr(), p.bmr->rkey), EINVAL) << "WRITE in " << state;
  };
  ibv_sge r = p.a_sge(4096, 64);
  ibv_recv_wr* rbad = nullptr;
  EXPECT_EQ(post_recv(p.a, 1, &r, 1, &rbad), EINVAL) << "post_recv in RESET";
  EXPECT_NE(rbad, nullptr) << "bad_wr after post_recv in RESET";
  try_send("RESET");
  ASSERT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);
  ASSERT_EQ(harness::qp_to_init(p.b, kAllAccess), 0);
  try_send("INIT");
  EXPECT_EQ(post_recv(p.a, 1, &r, 1), 0) << "post_recv in INIT is allowed";
  ASSERT_EQ(harness::qp_to_rtr(p.a, p.b->qp_num, lid_[1]), 0);
  try_send("RTR");
  EXPECT_EQ(post_recv(p.a, 2, &r, 1), 0) << "post_recv in RTR is allowed";
  EXPECT_TRUE(no_completion(p.acq, 50));
}

TEST_F(Errors, RegMrRemoteWriteWithoutLocalWriteIsEinval) {
  uint8_t* buf = alloc(4096);
  errno = 0;
  ibv_mr* mr = ibv_reg_mr(pd_[0], buf, 4096, IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(mr, nullptr) << "ibv_reg_mr(REMOTE_WRITE without LOCAL_WRITE) succeeded";
  if (mr) {
    EXPECT_EQ(ibv_dereg_mr(mr), 0);
  } else {
    EXPECT_EQ(errno, EINVAL);
  }
  errno = 0;
  mr = ibv_reg_mr(pd_[0], buf, 4096, IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ(mr, nullptr) << "ibv_reg_mr(REMOTE_ATOMIC without LOCAL_WRITE) succeeded";
  if (mr) {
    EXPECT_EQ(ibv_dereg_mr(mr), 0);
  } else {
    EXPECT_EQ(errno, EINVAL);
  }
  mr = ibv_reg_mr(pd_[0], buf, 4096, IBV_ACCESS_REMOTE_READ);
  EXPECT_NE(mr, nullptr) << "ibv_reg_mr(REMOTE_READ only) is valid: " << std::strerror(errno);
  if (mr) {
    EXPECT_EQ(ibv_dereg_mr(mr), 0);
  }
}

// ---------------------------------------------------------------------------
// Error state, flushes, message errors

TEST_F(Errors, ErrorCompletionMovesQpToErrAndFlushesEverything) {
  Pair p;
  make_pair(&p);
  // Receives posted on the initiator before the error must be flushed too.
  ibv_sge r = p.a_sge(8192, 64);
  ASSERT_EQ(post_recv(p.a, 501, &r, 1), 0);
  ASSERT_EQ(post_recv(p.a, 502, &r, 1), 0);
  ibv_sge s = p.a_sge(0, 64);
  // Three WRs in one post: the bad one first, the other two behind it.
  ibv_send_wr w[3]{};
  for (int i = 0; i < 3; ++i) {
    w[i].wr_id = 10 + static_cast<uint64_t>(i);
    w[i].opcode = IBV_WR_RDMA_WRITE;
    w[i].send_flags = IBV_SEND_SIGNALED;
    w[i].sg_list = &s;
    w[i].num_sge = 1;
    w[i].wr.rdma.remote_addr = p.b_addr();
    w[i].wr.rdma.rkey = p.bmr->rkey;
    if (i < 2) w[i].next = &w[i + 1];
  }
  w[0].wr.rdma.rkey += 1;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.a, &w[0], &bad), 0);
  std::vector<ibv_wc> got;
  auto deadline = Clock::now() + std::chrono::seconds(5);
  while (got.size() < 5 && Clock::now() < deadline) {
    ibv_wc wc{};
    if (harness::poll_one(p.acq, &wc, 100)) got.push_back(wc);
  }
  ASSERT_EQ(got.size(), 5u) << "expected 3 send + 2 receive completions";
  int send_seen = 0, recv_seen = 0;
  for (const auto& wc : got) {
    if (wc.wr_id >= 10 && wc.wr_id <= 12) {
      EXPECT_EQ(wc.wr_id, 10u + static_cast<uint64_t>(send_seen)) << "send completions out of order";
      EXPECT_EQ(wc.status, send_seen == 0 ? IBV_WC_REM_ACCESS_ERR : IBV_WC_WR_FLUSH_ERR) << wc_str(wc);
      ++send_seen;
    } else {
      EXPECT_EQ(wc.wr_id, 501u + static_cast<uint64_t>(recv_seen)) << wc_str(wc);
      EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << "posted receive of a QP in ERR: " << wc_str(wc);
      EXPECT_EQ(wc.opcode, IBV_WC_RECV) << wc_str(wc);
      ++recv_seen;
    }
  }
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_ERR);
  // A receive posted in ERR is flushed too.
  ASSERT_EQ(post_recv(p.a, 503, &r, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "no flush completion for a receive posted in ERR";
  EXPECT_EQ(wc.wr_id, 503u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << wc_str(wc);
  expect_err_and_flush(p.a, p.acq, "after the error");
  // ERR -> RESET -> INIT works, and the QP is empty afterwards.
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(p.a, &a, IBV_QP_STATE), 0);
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RESET);
  EXPECT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);
  EXPECT_TRUE(no_completion(p.acq, 50));
}

TEST_F(Errors, ReceiveTooSmallIsRemInvReqAndLocLen) {
  Pair p;
  make_pair(&p);
  ibv_sge r = p.b_sge(0, 16);
  ASSERT_EQ(post_recv(p.b, 42, &r, 1), 0);
  ibv_sge r2 = p.b_sge(64, 128);
  ASSERT_EQ(post_recv(p.b, 43, &r2, 1), 0);
  ibv_sge s = p.a_sge(0, 64);
  ASSERT_EQ(post(p.a, IBV_WR_SEND, 77, &s, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "no sender completion";
  EXPECT_EQ(wc.status, IBV_WC_REM_INV_REQ_ERR) << "sender of 64 bytes into a 16-byte receive: " << wc_str(wc);
  ASSERT_TRUE(harness::poll_one(p.bcq, &wc)) << "no receiver completion";
  EXPECT_EQ(wc.wr_id, 42u);
  EXPECT_EQ(wc.status, IBV_WC_LOC_LEN_ERR) << "16-byte receive of a 64-byte SEND: " << wc_str(wc);
  EXPECT_EQ(harness::qp_state(p.b), IBV_QPS_ERR) << "receiver QP after LOC_LEN_ERR";
  ASSERT_TRUE(harness::poll_one(p.bcq, &wc)) << "the second receive was not flushed";
  EXPECT_EQ(wc.wr_id, 43u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR) << wc_str(wc);
  expect_err_and_flush(p.a, p.acq, "sender after REM_INV_REQ_ERR");
  expect_err_and_flush(p.b, p.bcq, "receiver after LOC_LEN_ERR");
}

TEST_F(Errors, SendWithImmIntoSmallReceiveAndExactFit) {
  Pair p;
  make_pair(&p);
  // An exact fit over several receive SGEs succeeds.
  for (int i = 0; i < 64; ++i) p.abuf[i] = static_cast<uint8_t>(0xa0 + i);
  ibv_sge rs[3] = {p.b_sge(0, 10), p.b_sge(100, 0), p.b_sge(200, 54)};
  ASSERT_EQ(post_recv(p.b, 1, rs, 3), 0);
  ibv_sge s = p.a_sge(0, 64);
  ASSERT_EQ(post(p.a, IBV_WR_SEND_WITH_IMM, 2, &s, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_EQ(wc.byte_len, 64u);
  EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(wc.imm_data, htonl(0x1234));
  for (int i = 0; i < 10; ++i) EXPECT_EQ(p.bbuf[i], 0xa0 + i);
  for (int i = 0; i < 54; ++i) EXPECT_EQ(p.bbuf[200 + i], 0xa0 + 10 + i);
  EXPECT_EQ(p.bbuf[10], 0);
  EXPECT_EQ(p.bbuf[254], 0);
}

// ---------------------------------------------------------------------------
// Receiver not ready

TEST_F(Errors, RnrRetryExceededWithinBoundedTime) {
  // min_rnr_timer 10 = 0.32 ms; rnr_retry r waits about (r + 1) timer periods.
  constexpr double kTimerMs = 0.32;
  for (uint8_t retry = 0; retry <= 6; ++retry) {
    SCOPED_TRACE("rnr_retry " + std::to_string(retry));
    PairOpts o;
    o.rnr_retry = retry;
    o.b_min_rnr_timer = 10;
    Pair p;
    make_pair(&p, o);
    ibv_sge s = p.a_sge(0, 64);
    auto t0 = Clock::now();
    ASSERT_EQ(post(p.a, IBV_WR_SEND, 77, &s, 1), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc, 5000)) << "no completion within 5 s with rnr_retry " << int(retry);
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR) << wc_str(wc);
    EXPECT_LT(ms, 2000.0) << "RNR retries took too long";
    EXPECT_GE(ms, kTimerMs * retry * 0.9) << "gave up before rnr_retry timer periods had passed";
    expect_err_and_flush(p.a, p.acq, "after RNR_RETRY_EXC_ERR");
    // A receive posted now on the target gets nothing.
    ibv_sge r = p.b_sge(0, 64);
    ASSERT_EQ(post_recv(p.b, 1, &r, 1), 0);
    EXPECT_TRUE(no_completion(p.bcq, 20));
  }
}

TEST_F(Errors, RnrRetryWithLongTimerIsNotImmediate) {
  // min_rnr_timer 18 = 5.12 ms, rnr_retry 3: at least ~15 ms.
  PairOpts o;
  o.rnr_retry = 3;
  o.b_min_rnr_timer = 18;
  Pair p;
  make_pair(&p, o);
  ibv_sge s = p.a_sge(0, 8);
  auto t0 = Clock::now();
  ASSERT_EQ(post(p.a, IBV_WR_SEND, 77, &s, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc, 5000));
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(wc.status, IBV_WC_RNR_RETRY_EXC_ERR) << wc_str(wc);
  EXPECT_GE(ms, 15.0);
  EXPECT_LT(ms, 2000.0);
}

TEST_F(Errors, RnrRetrySevenWaitsForAReceive) {
  PairOpts o;
  o.rnr_retry = 7;
  o.b_min_rnr_timer = 1;
  Pair p;
  make_pair(&p, o);
  for (int i = 0; i < 100; ++i) p.abuf[i] = static_cast<uint8_t>(i + 1);
  ibv_sge s = p.a_sge(0, 100);
  ASSERT_EQ(post(p.a, IBV_WR_SEND, 77, &s, 1), 0);
  // Also a WRITE behind it: it must wait for the SEND (RC order).
  std::memset(p.abuf + 200, 0x5a, 32);
  ibv_sge ws = p.a_sge(200, 32);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 78, &ws, 1, p.b_addr(1000), p.bmr->rkey), 0);
  EXPECT_TRUE(no_completion(p.acq, 500)) << "rnr_retry 7 must wait for a receive";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
  EXPECT_EQ(p.bbuf[1000], 0) << "a WRITE behind a waiting SEND was executed before it";
  ibv_sge r = p.b_sge(0, 128);
  ASSERT_EQ(post_recv(p.b, 9, &r, 1), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "the SEND did not complete after a receive was posted";
  EXPECT_EQ(wc.wr_id, 77u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.wr_id, 78u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
  EXPECT_EQ(wc.wr_id, 9u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_EQ(wc.byte_len, 100u);
  EXPECT_EQ(wc.opcode, IBV_WC_RECV);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(p.bbuf[i], i + 1) << "byte " << i;
  for (int i = 0; i < 32; ++i) ASSERT_EQ(p.bbuf[1000 + i], 0x5a) << "WRITE byte " << i;
}

// ---------------------------------------------------------------------------
// Idioms and the QP state machine

TEST_F(Errors, ZeroLengthWriteWithRkeyZeroSucceeds) {
  Pair p;
  make_pair(&p);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, nullptr, 0, 0, 0), 0) << "0-byte WRITE, no SGE, rkey 0";
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "UCX-style flush (0-byte WRITE, rkey 0): " << wc_str(wc);
  ibv_sge s = p.a_sge(0, 0);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 2, &s, 1, 0, 0), 0) << "0-byte WRITE, one empty SGE, rkey 0";
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
}

TEST_F(Errors, ModifyQpMissingRequiredAttributesIsEinval) {
  PairOpts o;
  o.connect = false;
  Pair p;
  make_pair(&p, o);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = kAllAccess;
  EXPECT_EQ(ibv_modify_qp(p.a, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS), EINVAL)
      << "RESET->INIT without IBV_QP_PORT";
  EXPECT_EQ(ibv_modify_qp(p.a, &a, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), EINVAL)
      << "RESET->INIT without IBV_QP_PKEY_INDEX";
  EXPECT_EQ(ibv_modify_qp(p.a, &a, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), EINVAL)
      << "RESET->? without IBV_QP_STATE";
  a.port_num = 9;
  EXPECT_EQ(ibv_modify_qp(p.a, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), EINVAL)
      << "RESET->INIT with port 9";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RESET) << "a failed modify changed the state";
  ASSERT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);

  ibv_qp_attr r{};
  r.qp_state = IBV_QPS_RTR;
  r.path_mtu = IBV_MTU_4096;
  r.dest_qp_num = p.b->qp_num;
  r.max_dest_rd_atomic = 1;
  r.min_rnr_timer = 1;
  r.ah_attr.dlid = lid_[1];
  r.ah_attr.port_num = 1;
  const int all = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  for (int missing : {IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_DEST_QPN, IBV_QP_RQ_PSN, IBV_QP_MAX_DEST_RD_ATOMIC,
                      IBV_QP_MIN_RNR_TIMER}) {
    EXPECT_EQ(ibv_modify_qp(p.a, &r, all & ~missing), EINVAL) << "INIT->RTR without attribute mask " << missing;
  }
  EXPECT_EQ(ibv_modify_qp(p.a, &r, all | IBV_QP_SQ_PSN), EINVAL) << "INIT->RTR with IBV_QP_SQ_PSN (not allowed)";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_INIT);
  ASSERT_EQ(ibv_modify_qp(p.a, &r, all), 0);

  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = 14;
  s.retry_cnt = 7;
  s.rnr_retry = 7;
  s.max_rd_atomic = 1;
  const int rts = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                  IBV_QP_MAX_QP_RD_ATOMIC;
  for (int missing : {IBV_QP_SQ_PSN, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_MAX_QP_RD_ATOMIC}) {
    EXPECT_EQ(ibv_modify_qp(p.a, &s, rts & ~missing), EINVAL) << "RTR->RTS without attribute mask " << missing;
  }
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTR);
  EXPECT_EQ(ibv_modify_qp(p.a, &s, rts), 0);
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
}

TEST_F(Errors, InvalidTransitionsAreEinval) {
  PairOpts o;
  o.connect = false;
  Pair p;
  make_pair(&p, o);
  auto to = [&](ibv_qp_state st, int mask) {
    ibv_qp_attr a{};
    a.qp_state = st;
    a.port_num = 1;
    a.qp_access_flags = kAllAccess;
    a.path_mtu = IBV_MTU_1024;
    a.dest_qp_num = p.b->qp_num;
    a.ah_attr.dlid = lid_[1];
    a.ah_attr.port_num = 1;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    return ibv_modify_qp(p.a, &a, mask);
  };
  const int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  const int rts_mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_MAX_QP_RD_ATOMIC;
  EXPECT_EQ(to(IBV_QPS_RTR, rtr_mask), EINVAL) << "RESET->RTR";
  EXPECT_EQ(to(IBV_QPS_RTS, rts_mask), EINVAL) << "RESET->RTS";
  EXPECT_EQ(to(IBV_QPS_SQD, IBV_QP_STATE), EINVAL) << "RESET->SQD";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RESET);
  ASSERT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);
  EXPECT_EQ(to(IBV_QPS_RTS, rts_mask), EINVAL) << "INIT->RTS";
  EXPECT_EQ(to(IBV_QPS_SQD, IBV_QP_STATE), EINVAL) << "INIT->SQD";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_INIT);
  ASSERT_EQ(to(IBV_QPS_RTR, rtr_mask), 0);
  EXPECT_EQ(to(IBV_QPS_INIT, IBV_QP_STATE), EINVAL) << "RTR->INIT";
  EXPECT_EQ(to(IBV_QPS_RTR, rtr_mask), EINVAL) << "RTR->RTR with INIT->RTR attributes";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTR);
  ASSERT_EQ(to(IBV_QPS_RTS, rts_mask), 0);
  EXPECT_EQ(to(IBV_QPS_RTR, IBV_QP_STATE), EINVAL) << "RTS->RTR";
  EXPECT_EQ(to(IBV_QPS_INIT, IBV_QP_STATE), EINVAL) << "RTS->INIT";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
  // Any state -> ERR and ERR -> RESET are valid; ERR -> RTS is not.
  ASSERT_EQ(to(IBV_QPS_ERR, IBV_QP_STATE), 0);
  EXPECT_EQ(to(IBV_QPS_RTS, rts_mask), EINVAL) << "ERR->RTS";
  EXPECT_EQ(to(IBV_QPS_INIT, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), EINVAL)
      << "ERR->INIT";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_ERR);
  EXPECT_EQ(to(IBV_QPS_RESET, IBV_QP_STATE), 0) << "ERR->RESET";
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RESET);
}

TEST_F(Errors, SendQueueFullIsEnomem) {
  PairOpts o;
  o.max_send_wr = 8;
  o.rnr_retry = 7;
  Pair p;
  make_pair(&p, o);
  const uint32_t depth = p.acap.max_send_wr;
  ASSERT_GE(depth, 8u);
  ASSERT_LE(depth, 64u);
  // SENDs to a target with no receive wait in the send queue.
  ibv_sge s = p.a_sge(0, 8);
  for (uint32_t i = 0; i < depth; ++i) ASSERT_EQ(post(p.a, IBV_WR_SEND, i, &s, 1), 0) << "SEND " << i << " of " << depth;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(post(p.a, IBV_WR_SEND, depth, &s, 1, 0, 0, IBV_SEND_SIGNALED, &bad), ENOMEM)
      << "post_send on a full send queue (" << depth << " WRs waiting)";
  EXPECT_NE(bad, nullptr);
  // Receives arrive: everything completes in order, and the queue has room again.
  std::vector<ibv_sge> r(depth);
  for (uint32_t i = 0; i < depth; ++i) {
    r[i] = p.b_sge(64 * i, 64);
    ASSERT_EQ(post_recv(p.b, i, &r[i], 1), 0);
  }
  for (uint32_t i = 0; i < depth; ++i) {
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "SEND " << i << " did not complete";
    EXPECT_EQ(wc.wr_id, i);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  }
  EXPECT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1000, &s, 1, p.b_addr(), p.bmr->rkey), 0) << "post after the queue drained";
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
}

TEST_F(Errors, UnsignaledWrsOccupyTheSendQueueUntilASignaledCompletion) {
  PairOpts o;
  o.max_send_wr = 8;
  Pair p;
  make_pair(&p, o);
  const uint32_t depth = p.acap.max_send_wr;
  ibv_sge s = p.a_sge(0, 8);
  for (uint32_t i = 0; i + 1 < depth; ++i)
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, i, &s, 1, p.b_addr(), p.bmr->rkey, 0), 0) << "unsignaled WRITE " << i;
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 100, &s, 1, p.b_addr(), p.bmr->rkey, 0), 0);
  EXPECT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 101, &s, 1, p.b_addr(), p.bmr->rkey, 0), ENOMEM)
      << "unsignaled WRs must hold their send-queue slots until a later signaled completion";
  EXPECT_TRUE(no_completion(p.acq, 50)) << "unsignaled WRs produced a completion";
}

TEST_F(Errors, UnsignaledSlotsAreFreedByASignaledCompletion) {
  PairOpts o;
  o.max_send_wr = 8;
  Pair p;
  make_pair(&p, o);
  const uint32_t depth = p.acap.max_send_wr;
  ibv_sge s = p.a_sge(0, 8);
  for (int round = 0; round < 4; ++round) {
    for (uint32_t i = 0; i + 1 < depth; ++i)
      ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, i, &s, 1, p.b_addr(), p.bmr->rkey, 0), 0) << "round " << round;
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1000 + static_cast<uint64_t>(round), &s, 1, p.b_addr(), p.bmr->rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.wr_id, 1000u + static_cast<uint64_t>(round)) << "only the signaled WR completes";
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  }
}

TEST_F(Errors, AtomicMisalignedOrWrongLength) {
  {
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, 4);
    ibv_send_wr* bad = nullptr;
    int rc = post(p.a, IBV_WR_ATOMIC_FETCH_AND_ADD, 1, &s, 1, p.b_addr(), p.bmr->rkey, IBV_SEND_SIGNALED, &bad);
    if (rc == 0) {
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc));
      EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "a 4-byte atomic succeeded: " << wc_str(wc);
    } else {
      EXPECT_EQ(rc, EINVAL);
    }
  }
  {
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, 8);
    ASSERT_EQ(post(p.a, IBV_WR_ATOMIC_FETCH_AND_ADD, 1, &s, 1, p.b_addr(4), p.bmr->rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "an atomic on a misaligned address succeeded: " << wc_str(wc);
    EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_ERR);
    for (size_t i = 0; i < 16; ++i) ASSERT_EQ(p.bbuf[i], 0) << "byte " << i;
  }
}

// ---------------------------------------------------------------------------
// A one-SGE READ or atomic executes straight from the ibv_send_wr once the
// target QP's entry and the rkey are cached (the first one of a QP fills the
// caches on the general path): the same bytes, completions and errors as the
// general path. Each case warms the caches with a good operation first.

// Reads `len` bytes at B's offset roff into A's offset loff, signaled: true
// when it completed with SUCCESS, opcode RDMA_READ and byte_len len.
::testing::AssertionResult read_ok(const Pair& p, uint64_t id, size_t loff, size_t roff, uint32_t len) {
  ibv_sge s = p.a_sge(loff, len);
  if (int rc = post(p.a, IBV_WR_RDMA_READ, id, &s, 1, p.b_addr(roff), p.bmr->rkey))
    return ::testing::AssertionFailure() << "post_send READ: " << std::strerror(rc);
  ibv_wc wc{};
  if (!harness::poll_one(p.acq, &wc)) return ::testing::AssertionFailure() << "no completion within 5 s";
  if (wc.wr_id != id || wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RDMA_READ || wc.byte_len != len)
    return ::testing::AssertionFailure() << "READ of " << len << " bytes: " << wc_str(wc) << " byte_len " << wc.byte_len;
  return ::testing::AssertionSuccess();
}

TEST_F(Errors, ReadOfOneSgeEverySizeAfterAWarmRead) {
  Pair p;
  make_pair(&p);
  for (size_t i = 0; i < kBuf; ++i) p.bbuf[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSERT_TRUE(read_ok(p, 1, 0, 0, 8)) << "the warm-up READ";
  // 0 bytes, both sides of the 16-byte inline copy, unaligned, a page, all.
  const uint32_t sizes[] = {0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 64, 4096, static_cast<uint32_t>(kBuf)};
  uint64_t id = 10;
  for (uint32_t len : sizes) {
    SCOPED_TRACE(len);
    const size_t loff = len == kBuf ? 0 : 3, roff = len == kBuf ? 0 : 5;
    std::memset(p.abuf, 0xee, kBuf);
    ASSERT_TRUE(read_ok(p, id++, loff, roff, len));
    for (size_t i = 0; i < len; ++i) ASSERT_EQ(p.abuf[loff + i], p.bbuf[roff + i]) << "byte " << i;
    if (loff) {
      EXPECT_EQ(p.abuf[loff - 1], 0xee) << "the byte before the SGE changed";
    }
    if (loff + len < kBuf) {
      EXPECT_EQ(p.abuf[loff + len], 0xee) << "the byte after the SGE changed";
    }
  }
  // Unsignaled READs, the last signaled: one completion, every READ done.
  std::memset(p.abuf, 0, kBuf);
  for (int k = 0; k < 4; ++k) {
    ibv_sge s = p.a_sge(static_cast<size_t>(k) * 8, 8);
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_READ, 100 + static_cast<uint64_t>(k), &s, 1, p.b_addr(64 + static_cast<size_t>(k) * 8),
                   p.bmr->rkey, k == 3 ? IBV_SEND_SIGNALED : 0),
              0);
  }
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  EXPECT_EQ(wc.wr_id, 103u) << "only the signaled READ completes: " << wc_str(wc);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_TRUE(no_completion(p.acq, 50));
  for (size_t i = 0; i < 32; ++i) ASSERT_EQ(p.abuf[i], p.bbuf[64 + i]) << "byte " << i;
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
}

TEST_F(Errors, WarmReadIntoMrWithoutLocalWriteOrOutsideTheMrFails) {
  struct Case {
    int64_t roff;
    bool read_only_local;
    ibv_wc_status want;
    const char* what;
  } cases[] = {{0, true, IBV_WC_LOC_PROT_ERR, "READ into a local MR without LOCAL_WRITE"},
               {static_cast<int64_t>(kBuf) - 4, false, IBV_WC_REM_ACCESS_ERR, "READ over the target MR's end"},
               {-1, false, IBV_WC_REM_ACCESS_ERR, "READ starting before the target MR"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Pair p;
    make_pair(&p);
    uint8_t* ro = alloc(4096);
    ASSERT_NE(ro, nullptr);
    ibv_mr* romr = new_mr(pd_[0], ro, 4096, IBV_ACCESS_REMOTE_READ);
    ASSERT_NE(romr, nullptr) << std::strerror(errno);
    std::memset(p.bbuf, 0x5a, kBuf);
    ASSERT_TRUE(read_ok(p, 1, 0, 0, 8)) << "the warm-up READ";
    ibv_sge s = c.read_only_local ? ibv_sge{reinterpret_cast<uintptr_t>(ro), 8, romr->lkey} : p.a_sge(64, 8);
    expect_status(p, IBV_WR_RDMA_READ, &s, 1, p.b_addr() + c.roff, p.bmr->rkey, c.want, c.what);
    for (size_t i = 0; i < 4096; ++i) ASSERT_EQ(ro[i], 0) << "the read-only MR's byte " << i << " changed";
    for (size_t i = 64; i < 72; ++i) ASSERT_EQ(p.abuf[i], 0) << "the SGE's byte " << i << " changed";
  }
}

// A change of the target QP's access after a READ that passed applies to
// the very next one (the READ's own fast path keeps the target's access for
// reads apart from its access for writes).
TEST_F(Errors, TargetAccessChangedAfterAReadIsEnforced) {
  Pair p;
  make_pair(&p);
  ASSERT_TRUE(read_ok(p, 77, 0, 0, 64)) << "first READ";
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS), 0);
  std::memset(p.bbuf, 0x5a, 64);
  std::memset(p.abuf, 0, 64);
  ibv_sge s = p.a_sge(0, 64);
  expect_status(p, IBV_WR_RDMA_READ, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR,
                "READ after REMOTE_READ was removed from the target QP, once a READ had passed");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.abuf[i], 0) << "the READ changed byte " << i;
}

TEST_F(Errors, TargetAccessChangedAfterAnAtomicIsEnforced) {
  Pair p;
  make_pair(&p);
  ibv_sge s = p.a_sge(0, 8);
  for (uint64_t id = 1; id <= 2; ++id) {
    ASSERT_EQ(post(p.a, IBV_WR_ATOMIC_FETCH_AND_ADD, id, &s, 1, p.b_addr(), p.bmr->rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS), 0);
  const uint64_t before = 7;
  std::memcpy(p.bbuf, &before, 8);
  std::memset(p.abuf, 0xa5, 8);
  expect_status(p, IBV_WR_ATOMIC_FETCH_AND_ADD, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR,
                "FETCH_AND_ADD after REMOTE_ATOMIC was removed from the target QP, once two had passed");
  uint64_t now = 0;
  std::memcpy(&now, p.bbuf, 8);
  EXPECT_EQ(now, before) << "the refused atomic changed the target";
  for (size_t i = 0; i < 8; ++i) ASSERT_EQ(p.abuf[i], 0xa5) << "the refused atomic changed local byte " << i;
}

// A key that answered one kind of access answers no other that its MR or
// the target QP does not grant: a WRITE that passed (twice: the second finds
// the key and the target cached), then a READ, where the MR or the QP lacks
// REMOTE_READ; a READ, then a WRITE, where they lack REMOTE_WRITE; a WRITE,
// then an atomic, where they lack REMOTE_ATOMIC; an atomic, then a WRITE or
// a READ.
TEST_F(Errors, AWarmKeyAnswersOnlyTheAccessTheMrAndTheQpGrant) {
  constexpr int kLw = IBV_ACCESS_LOCAL_WRITE;
  constexpr int kRwr = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  struct Case {
    int qp_access, mr_access;
    ibv_wr_opcode first, then;
    const char* what;
  } cases[] = {
      {kAllAccess, kLw | IBV_ACCESS_REMOTE_WRITE, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ,
       "READ from an MR without REMOTE_READ, after a WRITE into it"},
      {kAllAccess, kLw | IBV_ACCESS_REMOTE_READ, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
       "WRITE into an MR without REMOTE_WRITE, after a READ from it"},
      {kLw | IBV_ACCESS_REMOTE_WRITE, kAllAccess, IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ,
       "READ through a QP without REMOTE_READ, after a WRITE through it"},
      {kLw | IBV_ACCESS_REMOTE_READ, kAllAccess, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE,
       "WRITE through a QP without REMOTE_WRITE, after a READ through it"},
      {kAllAccess, kLw | kRwr, IBV_WR_RDMA_WRITE, IBV_WR_ATOMIC_FETCH_AND_ADD,
       "FETCH_AND_ADD on an MR without REMOTE_ATOMIC, after a WRITE into it"},
      {kAllAccess, kLw | kRwr, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
       "CMP_AND_SWP on an MR without REMOTE_ATOMIC, after a READ from it"},
      {kLw | kRwr, kAllAccess, IBV_WR_RDMA_WRITE, IBV_WR_ATOMIC_FETCH_AND_ADD,
       "FETCH_AND_ADD through a QP without REMOTE_ATOMIC, after a WRITE through it"},
      {kAllAccess, kLw | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_WRITE,
       "WRITE into an MR without REMOTE_WRITE, after an atomic on it"},
      {kAllAccess, kLw | IBV_ACCESS_REMOTE_ATOMIC, IBV_WR_ATOMIC_FETCH_AND_ADD, IBV_WR_RDMA_READ,
       "READ from an MR without REMOTE_READ, after an atomic on it"},
      {kLw | IBV_ACCESS_REMOTE_ATOMIC, kAllAccess, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_RDMA_WRITE,
       "WRITE through a QP without REMOTE_WRITE, after an atomic through it"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    PairOpts o;
    o.b_qp_access = c.qp_access;
    o.b_mr_access = c.mr_access;
    Pair p;
    make_pair(&p, o);
    for (uint64_t id = 1; id <= 2; ++id) {
      ibv_sge s = p.a_sge(0, is_atomic(c.first) ? 8 : 64);
      ASSERT_EQ(post(p.a, c.first, id, &s, 1, p.b_addr(), p.bmr->rkey), 0);
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "no completion within 5 s";
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    }
    std::memset(p.abuf, 0xa5, 64);
    std::memset(p.bbuf, 0x5a, 64);
    ibv_sge s = p.a_sge(0, is_atomic(c.then) ? 8 : 64);
    expect_status(p, c.then, &s, 1, p.b_addr(), p.bmr->rkey, IBV_WC_REM_ACCESS_ERR, c.what);
    for (size_t i = 0; i < 64; ++i) {
      ASSERT_EQ(p.abuf[i], 0xa5) << c.what << " changed local byte " << i;
      ASSERT_EQ(p.bbuf[i], 0x5a) << c.what << " changed target byte " << i;
    }
  }
}

TEST_F(Errors, WarmAtomicsAreExactAndMisalignedOrOutsideFail) {
  {
    Pair p;
    make_pair(&p);
    uint64_t v = 40;
    std::memcpy(p.bbuf + 8, &v, 8);
    ibv_sge s = p.a_sge(3, 8);  // the result lands unaligned: only the target must be aligned
    // post() adds compare_add 1 (FETCH_AND_ADD) and swaps to 2 when equal to 1 (CMP_AND_SWP).
    const struct {
      ibv_wr_opcode op;
      uint64_t old, now;
    } steps[] = {{IBV_WR_ATOMIC_FETCH_AND_ADD, 40, 41},
                 {IBV_WR_ATOMIC_FETCH_AND_ADD, 41, 42},
                 {IBV_WR_ATOMIC_CMP_AND_SWP, 42, 42},  // 42 != 1: no swap, the old value back
                 {IBV_WR_ATOMIC_FETCH_AND_ADD, 42, 43}};
    uint64_t id = 1;
    for (const auto& st : steps) {
      ASSERT_EQ(post(p.a, st.op, id, &s, 1, p.b_addr(8), p.bmr->rkey), 0);
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc));
      EXPECT_EQ(wc.wr_id, id) << wc_str(wc);
      EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
      EXPECT_EQ(wc.opcode, st.op == IBV_WR_ATOMIC_CMP_AND_SWP ? IBV_WC_COMP_SWAP : IBV_WC_FETCH_ADD) << wc_str(wc);
      EXPECT_EQ(wc.byte_len, 8u) << wc_str(wc);
      uint64_t old = 0, now = 0;
      std::memcpy(&old, p.abuf + 3, 8);
      std::memcpy(&now, p.bbuf + 8, 8);
      EXPECT_EQ(old, st.old) << "step " << id;
      EXPECT_EQ(now, st.now) << "step " << id;
      ++id;
    }
    v = 1;
    std::memcpy(p.bbuf + 8, &v, 8);
    ASSERT_EQ(post(p.a, IBV_WR_ATOMIC_CMP_AND_SWP, 9, &s, 1, p.b_addr(8), p.bmr->rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    std::memcpy(&v, p.bbuf + 8, 8);
    EXPECT_EQ(v, 2u) << "CMP_AND_SWP with an equal value swaps";
  }
  struct Case {
    int64_t off;
    ibv_wc_status want;
    const char* what;
  } cases[] = {{4, IBV_WC_REM_INV_REQ_ERR, "FETCH_AND_ADD on a misaligned address after a good one"},
               {1, IBV_WC_REM_INV_REQ_ERR, "FETCH_AND_ADD one byte off alignment after a good one"},
               {static_cast<int64_t>(kBuf), IBV_WC_REM_ACCESS_ERR, "FETCH_AND_ADD past the MR after a good one"},
               {-8, IBV_WC_REM_ACCESS_ERR, "FETCH_AND_ADD before the MR after a good one"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, 8);
    // Two warm-up atomics: the second finds the key and the target cached.
    for (uint64_t id = 1; id <= 2; ++id) {
      ASSERT_EQ(post(p.a, IBV_WR_ATOMIC_FETCH_AND_ADD, id, &s, 1, p.b_addr(kBuf - 8), p.bmr->rkey), 0);
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc));
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "the warm-up atomic on the MR's last word: " << wc_str(wc);
    }
    p.bbuf[kBuf - 8] = 0;
    std::memset(p.abuf, 0x77, 64);
    expect_status(p, IBV_WR_ATOMIC_FETCH_AND_ADD, &s, 1, p.b_addr() + c.off, p.bmr->rkey, c.want, c.what);
    for (size_t i = 0; i < kBuf; ++i) ASSERT_EQ(p.bbuf[i], 0) << c.what << " changed target byte " << i;
    for (size_t i = 0; i < 8; ++i) ASSERT_EQ(p.abuf[i], 0x77) << c.what << " wrote a result byte " << i;
  }
}

TEST_F(Errors, PostRecvOnAFullQueueIsEnomemWithBadWr) {
  Pair p;
  PairOpts o;
  o.max_recv_wr = 4;
  make_pair(&p, o);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qia{};
  ASSERT_EQ(ibv_query_qp(p.b, &qa, IBV_QP_CAP, &qia), 0);
  const uint32_t depth = qa.cap.max_recv_wr;
  ASSERT_GE(depth, 4u);
  ASSERT_LE(depth, 64u);
  // One list of depth + 2 WRs: the first depth are posted, bad_wr is the next.
  std::vector<ibv_sge> sg(depth + 2);
  std::vector<ibv_recv_wr> w(depth + 2);
  for (uint32_t i = 0; i < depth + 2; ++i) {
    sg[i] = p.b_sge(i * 16, 16);
    w[i] = ibv_recv_wr{};
    w[i].wr_id = 500 + i;
    w[i].sg_list = &sg[i];
    w[i].num_sge = 1;
    w[i].next = i + 1 < depth + 2 ? &w[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(p.b, w.data(), &bad), ENOMEM) << "a list longer than the receive queue";
  EXPECT_EQ(bad, &w[depth]) << "bad_wr must be the first WR that did not fit";
  // One more, alone: still full.
  bad = nullptr;
  EXPECT_EQ(post_recv(p.b, 600, &sg[0], 1, &bad), ENOMEM) << "one WR on the full queue";
  EXPECT_NE(bad, nullptr) << "bad_wr not set for the WR that did not fit";
  // The posted ones are intact and in order: each SEND lands in the next.
  ibv_sge s = p.a_sge(0, 4);
  for (uint32_t i = 0; i < depth; ++i) {
    std::memset(p.abuf, static_cast<int>(i + 1), 4);
    ASSERT_EQ(post(p.a, IBV_WR_SEND, i, &s, 1), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
    EXPECT_EQ(wc.wr_id, 500u + i) << "receives complete in the order they were posted: " << wc_str(wc);
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    EXPECT_EQ(wc.byte_len, 4u);
    for (size_t k = 0; k < 4; ++k) ASSERT_EQ(p.bbuf[i * 16 + k], i + 1) << "receive " << i << " byte " << k;
  }
  // Room again: a list of two fits, and an empty list posts nothing.
  EXPECT_EQ(ibv_post_recv(p.b, &w[depth], &bad), 0) << "the two WRs left, once the queue has room";
  EXPECT_TRUE(no_completion(p.bcq, 20));
}

// ibv_post_recv is thread-safe: receives posted to one QP by four threads at
// once are each taken exactly once, in the order they went in, every one
// holding the SEND it took. (The producers of a QP's receive queue are
// serialized by a lock, and the ring's position moves with a plain store:
// without the lock two posts reserve one slot, and a WQE is lost or taken
// twice.) The first thread to post owns the lock's bias; the others revoke it.
TEST_F(Errors, ReceivesPostedByFourThreadsAtOnceAreEachTakenOnce) {
  Pair p;
  PairOpts o;
  constexpr uint32_t kThreads = 4, kEach = 64, kDepth = kThreads * kEach;
  o.max_recv_wr = kDepth;
  make_pair(&p, o);
  ibv_sge s = p.a_sge(0, 8);
  for (uint32_t round = 0; round < 30; ++round) {
    std::atomic<int> failed{0};
    harness::all_at_once(kThreads, [&](uint32_t t) {
      for (uint32_t i = 0; i < kEach; ++i) {
        const uint32_t id = t * kEach + i;
        ibv_sge g = p.b_sge(size_t{id} * 16, 16);
        if (post_recv(p.b, id, &g, 1) != 0) failed.fetch_add(1);
      }
    });
    ASSERT_EQ(failed.load(), 0) << "round " << round << ": a post failed with room in the queue";
    std::vector<bool> seen(kDepth, false);
    for (uint32_t k = 0; k < kDepth; ++k) {
      const uint64_t v = uint64_t{round} << 32 | k;
      std::memcpy(p.abuf, &v, 8);
      ASSERT_EQ(post(p.a, IBV_WR_SEND, k, &s, 1), 0);
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "round " << round << " send " << k;
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "round " << round << " send " << k << ": " << wc_str(wc);
      ASSERT_TRUE(harness::poll_one(p.bcq, &wc)) << "round " << round << ": no receive for send " << k;
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
      ASSERT_EQ(wc.byte_len, 8u);
      ASSERT_LT(wc.wr_id, kDepth) << wc_str(wc);
      ASSERT_FALSE(seen[wc.wr_id]) << "round " << round << ": receive " << wc.wr_id << " taken twice";
      seen[wc.wr_id] = true;
      uint64_t got = 0;
      std::memcpy(&got, p.bbuf + wc.wr_id * 16, 8);
      ASSERT_EQ(got, v) << "round " << round << ": receive " << wc.wr_id << " does not hold send " << k;
    }
    EXPECT_TRUE(no_completion(p.bcq, 0)) << "round " << round;
  }
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------
// The target goes away or is not ready: the transport retries, then fails.

// timeout 12 = 16.8 ms, retry_cnt 3: about 67 ms until RETRY_EXC_ERR.
constexpr double kTransportMs = 4.096e-3 * (1 << 12) * (3 + 1);

class Transport : public Errors {
 protected:
  // `min_wait`: the transport must have retried for its timer before giving
  // up (a QPN whose context does not exist may fail at once).
  void expect_retry_exceeded(const Pair& p, const char* what, bool min_wait = true) {
    ibv_sge s = p.a_sge(0, 64);
    auto t0 = Clock::now();
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 77, &s, 1, p.b_addr(), p.bmr->rkey), 0) << what;
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc, 10000)) << what << ": no completion within 10 s";
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR) << what << ": " << wc_str(wc);
    if (min_wait) {
      EXPECT_GE(ms, kTransportMs * 0.5) << what << ": gave up before the transport timer ran out";
    }
    EXPECT_LT(ms, 5000.0) << what;
    expect_err_and_flush(p.a, p.acq, what);
  }
  PairOpts opts() {
    PairOpts o;
    o.a_timeout = 12;
    o.a_retry_cnt = 3;
    return o;
  }
};

TEST_F(Transport, TargetQpDestroyedIsRetryExcErr) {
  Pair p;
  make_pair(&p, opts());
  destroy_now(p.b);
  expect_retry_exceeded(p, "WRITE to a destroyed QP");
}

TEST_F(Transport, TargetQpInResetIsRetryExcErr) {
  Pair p;
  make_pair(&p, opts());
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE), 0);
  expect_retry_exceeded(p, "WRITE to a QP in RESET");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << "byte " << i;
}

TEST_F(Transport, TargetQpInErrIsRetryExcErr) {
  Pair p;
  make_pair(&p, opts());
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE), 0);
  expect_retry_exceeded(p, "WRITE to a QP in ERR");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << "byte " << i;
}

// As above, after a WRITE that passed (the initiator kept the target's
// checks): the change applies to the next WRITE.
TEST_F(Transport, TargetQpInErrOrDestroyedAfterAWriteIsRetryExcErr) {
  for (int destroy = 0; destroy < 2; ++destroy) {
    const char* what = destroy ? "WRITE to a QP destroyed after a WRITE" : "WRITE to a QP moved to ERR after a WRITE";
    Pair p;
    make_pair(&p, opts());
    ibv_sge s = p.a_sge(0, 64);
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 76, &s, 1, p.b_addr(), p.bmr->rkey), 0) << what;
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << what << ": first WRITE: no completion within 5 s";
    ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << what << ": " << wc_str(wc);
    for (size_t i = 0; i < 64; ++i) p.bbuf[i] = 0;
    if (destroy) {
      destroy_now(p.b);
    } else {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_ERR;
      ASSERT_EQ(ibv_modify_qp(p.b, &a, IBV_QP_STATE), 0) << what;
    }
    expect_retry_exceeded(p, what);
    if (!destroy) {
      for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << what << ": byte " << i;
    }
  }
}

TEST_F(Transport, TargetConnectedElsewhereIsRetryExcErr) {
  // B is connected to C, not to A: A's packets are not B's to accept.
  Pair p;
  PairOpts o = opts();
  o.connect = false;
  make_pair(&p, o);
  ibv_qp* c = new_qp(pd_[0], p.acq, o);
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);
  ASSERT_EQ(harness::qp_to_init(p.b, kAllAccess), 0);
  ASSERT_EQ(harness::qp_to_rtr(p.a, p.b->qp_num, lid_[1]), 0);
  ASSERT_EQ(harness::qp_to_rtr(p.b, c->qp_num, lid_[0]), 0);
  ASSERT_EQ(harness::qp_to_rts(p.a, 7, o.a_timeout, o.a_retry_cnt), 0);
  ASSERT_EQ(harness::qp_to_rts(p.b), 0);
  expect_retry_exceeded(p, "WRITE to a QP connected to another QP");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(p.bbuf[i], 0) << "byte " << i;
}

TEST_F(Transport, ConnectedToANonexistentQpnIsRetryExcErr) {
  Pair p;
  PairOpts o = opts();
  o.connect = false;
  make_pair(&p, o);
  ASSERT_EQ(harness::qp_to_init(p.a, kAllAccess), 0);
  ASSERT_EQ(harness::qp_to_rtr(p.a, p.b->qp_num ^ 0x800000, lid_[1]), 0);
  ASSERT_EQ(harness::qp_to_rts(p.a, 7, o.a_timeout, o.a_retry_cnt), 0);
  expect_retry_exceeded(p, "WRITE to a QPN nobody has", false);
}

// ---------------------------------------------------------------------------
// Keys that are no longer valid.

TEST_F(Errors, RkeyOfDeregisteredMrIsRemAccessErr) {
  Pair p;
  make_pair(&p);
  uint8_t* buf = alloc(4096);
  ibv_mr* mr = new_mr(pd_[1], buf, 4096, kAllAccess);
  ASSERT_NE(mr, nullptr);
  const uint32_t rkey = mr->rkey;
  const uint64_t addr = reinterpret_cast<uintptr_t>(buf);
  destroy_now(mr);
  ibv_sge s = p.a_sge(0, 64);
  expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, addr, rkey, IBV_WC_REM_ACCESS_ERR, "WRITE with the rkey of a deregistered MR");
  for (size_t i = 0; i < 64; ++i) ASSERT_EQ(buf[i], 0) << "byte " << i;
}

// ibv_rereg_mr keeps the keys, as mlx5 and rxe do for access and PD changes
// (applications keep using the rkey they sent their peers): what changes
// applies to that key at once. Removed rights are refused with it.
TEST_F(Errors, ReregMrAppliesToTheKeyAtOnce) {
  uint8_t* buf = alloc(8192);
  ibv_mr* mr = new_mr(pd_[1], buf, 8192, kAllAccess);
  ASSERT_NE(mr, nullptr);
  const uint32_t old_rkey = mr->rkey;
  ASSERT_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ),
            0);
  EXPECT_EQ(mr->rkey, old_rkey) << "rereg_mr changed the rkey";
  {
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, 64);
    expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, reinterpret_cast<uintptr_t>(buf), old_rkey, IBV_WC_REM_ACCESS_ERR,
                  "WRITE after ibv_rereg_mr removed REMOTE_WRITE");
  }
  ASSERT_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, kAllAccess), 0);
  {
    Pair p;
    make_pair(&p);
    std::memset(p.abuf, 0x42, 64);
    ibv_sge s = p.a_sge(0, 64);
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, &s, 1, reinterpret_cast<uintptr_t>(buf), old_rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << "WRITE after ibv_rereg_mr added REMOTE_WRITE back: " << wc_str(wc);
    for (size_t i = 0; i < 64; ++i) ASSERT_EQ(buf[i], 0x42) << "byte " << i;
  }
  // Rereg to a smaller range (CHANGE_TRANSLATION): the rest is out of reach.
  ASSERT_EQ(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, buf, 4096, 0), 0);
  {
    Pair p;
    make_pair(&p);
    ibv_sge s = p.a_sge(0, 64);
    expect_status(p, IBV_WR_RDMA_WRITE, &s, 1, reinterpret_cast<uintptr_t>(buf) + 4096, mr->rkey, IBV_WC_REM_ACCESS_ERR,
                  "WRITE past the range of an MR shrunk by ibv_rereg_mr");
  }
}

TEST_F(Errors, UnsupportedOpcodesAreRejectedAtPost) {
  Pair p;
  make_pair(&p);
  ibv_sge s = p.a_sge(0, 8);
  for (ibv_wr_opcode op : {IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV, IBV_WR_TSO}) {
    ibv_send_wr* bad = nullptr;
    int rc = post(p.a, op, 5, &s, 1, p.b_addr(), p.bmr->rkey, IBV_SEND_SIGNALED, &bad);
    if (rc == 0) {
      // Accepted: then it must complete, in error, rather than do anything.
      ibv_wc wc{};
      ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "opcode " << op << " accepted but never completed";
      EXPECT_NE(wc.status, IBV_WC_SUCCESS) << "opcode " << op << " succeeded";
      return;
    }
    EXPECT_TRUE(rc == EINVAL || rc == EOPNOTSUPP) << "opcode " << op << ": " << rc;
    EXPECT_NE(bad, nullptr) << "opcode " << op;
  }
  EXPECT_TRUE(no_completion(p.acq, 50));
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
}

// One WR of a list (ListWr::wr, linked by the caller).
struct ListWr {
  ibv_send_wr wr{};
  ibv_sge sge{};
};

ListWr list_wr(ibv_wr_opcode op, uint64_t id, ibv_sge s, bool signaled, uint64_t raddr = 0, uint32_t rkey = 0,
               bool inl = false) {
  ListWr w;
  w.sge = s;
  w.wr.wr_id = id;
  w.wr.opcode = op;
  w.wr.num_sge = 1;
  w.wr.send_flags = (signaled ? unsigned{IBV_SEND_SIGNALED} : 0u) | (inl ? unsigned{IBV_SEND_INLINE} : 0u);
  w.wr.wr.rdma.remote_addr = raddr;
  w.wr.wr.rdma.rkey = rkey;
  if (op == IBV_WR_SEND_WITH_IMM) w.wr.imm_data = htonl(0x5000 + static_cast<uint32_t>(id));
  return w;
}

// Links ws into one list (sg_list set here: the vector does not move after).
ibv_send_wr* link_list(std::vector<ListWr>& ws) {
  for (size_t i = 0; i < ws.size(); ++i) {
    ws[i].wr.sg_list = &ws[i].sge;
    ws[i].wr.next = i + 1 < ws.size() ? &ws[i + 1].wr : nullptr;
  }
  return &ws[0].wr;
}

// Polls a list's completions for up to 10 s, until nsend send completions
// (p.acq) and nrecv receive completions (p.bcq) are in; when `at` receives
// are in, no more may arrive before more() posts receives.
void poll_list(Pair& p, size_t nsend, size_t nrecv, size_t at, const std::function<void()>& more,
               std::vector<ibv_wc>* sends, std::vector<ibv_wc>* recvs) {
  ibv_wc wc{};
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  bool posted = false;
  while ((sends->size() < nsend || recvs->size() < nrecv) && Clock::now() < deadline) {
    if (ibv_poll_cq(p.acq, 1, &wc) == 1) sends->push_back(wc);
    if (ibv_poll_cq(p.bcq, 1, &wc) == 1) recvs->push_back(wc);
    if (!posted && recvs->size() == at) {
      EXPECT_TRUE(no_completion(p.bcq, 20)) << "a SEND arrived without a receive";
      more();
      posted = true;
    }
  }
}

// Every kind of WR a single post takes on its cheapest path (WRITEs and
// READs small and large, SENDs inline, small, in place and with immediate
// data, atomics, signaled or not) posted as one list once every cache is warm, then
// WRs that no such path takes (a SEND of 0 bytes) with more behind them, and
// SENDs beyond the posted receives (they wait for receives, RNR, and what
// follows them waits too): everything arrives, in the order posted, byte for
// byte, and only the signaled WRs complete, each with its length.
TEST_F(Errors, AListOfEveryKindArrivesInOrderByteForByte) {
  Pair p;
  make_list_pair(&p);
  for (size_t i = 0; i < kBuf; ++i) {
    p.abuf[i] = static_cast<uint8_t>(i * 13 + 1);
    p.bbuf[i] = static_cast<uint8_t>(i * 7 + 5);
  }
  constexpr size_t kRecvOff = 8192, kRecvLen = 512;
  uint64_t rid = 500;
  const auto post_recvs = [&](int n) {
    for (int k = 0; k < n; ++k, ++rid) {
      ibv_sge r = p.b_sge(kRecvOff + (rid - 500) % 14 * kRecvLen, kRecvLen);
      ASSERT_EQ(post_recv(p.b, rid, &r, 1), 0);
    }
  };
  // Warm-up: a WRITE, a READ and a SEND, one at a time.
  post_recvs(1);
  {
    ibv_sge s = p.a_sge(0, 8);
    ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, &s, 1, p.b_addr(0), p.bmr->rkey), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    ASSERT_TRUE(read_ok(p, 2, 4096, 4096, 8));
    ASSERT_EQ(post(p.a, IBV_WR_SEND, 3, &s, 1), 0);
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  }
  post_recvs(8);

  struct Want {
    uint64_t id;
    ibv_wr_opcode op;
    size_t loff, roff;  // roff: the target offset (WRITE), source (READ); a SEND's: its receive's
    uint32_t len;
    bool signaled;
  };
  std::vector<Want> want = {
      {10, IBV_WR_RDMA_WRITE, 0, 16, 8, false},
      {11, IBV_WR_SEND, 16, 0, 5, true},  // inline
      {12, IBV_WR_RDMA_WRITE, 32, 64, 100, true},
      {13, IBV_WR_RDMA_READ, 4200, 4300, 12, false},
      {27, IBV_WR_ATOMIC_FETCH_AND_ADD, 13000, 3000, 8, true},
      {28, IBV_WR_ATOMIC_CMP_AND_SWP, 13008, 3008, 8, false},
      {29, IBV_WR_ATOMIC_CMP_AND_SWP, 13016, 3016, 8, true},  // compares unequal: no swap
      {14, IBV_WR_SEND_WITH_IMM, 200, 0, 200, false},
      {15, IBV_WR_RDMA_READ, 5000, 5003, 3000, true},
      {16, IBV_WR_SEND, 300, 0, 16, true},
      {17, IBV_WR_RDMA_WRITE, 400, 2000, 1, true},
      {18, IBV_WR_SEND, 0, 0, 0, true},  // no leaf takes 0 bytes: the list's general way from here
      {19, IBV_WR_SEND, 500, 0, 40, true},
      {20, IBV_WR_RDMA_WRITE, 600, 2100, 24, false},
      {21, IBV_WR_SEND, 700, 0, 300, true},
      {22, IBV_WR_SEND_WITH_IMM, 800, 0, 9, true},  // the 8 receives end here
      {23, IBV_WR_SEND, 900, 0, 33, true},          // RNR: waits for a receive
      {24, IBV_WR_RDMA_WRITE, 1000, 2200, 50, true},
      {25, IBV_WR_SEND, 1100, 0, 2, false},
      {26, IBV_WR_RDMA_READ, 12000, 6200, 64, true},
  };
  const auto word = [&](size_t off) {
    uint64_t v;
    std::memcpy(&v, p.bbuf + off, 8);
    return v;
  };
  constexpr uint64_t kAdd = 0x10001, kSwap = 0x1122334455667788;
  std::vector<uint64_t> old_word;  // each atomic's target before the list
  std::vector<ListWr> ws;
  for (const Want& w : want) {
    const bool send = w.op == IBV_WR_SEND || w.op == IBV_WR_SEND_WITH_IMM;
    // A SEND's remote address and rkey name the MR too (an application may
    // reuse its WRs): a SEND ignores them.
    ws.push_back(list_wr(w.op, w.id, p.a_sge(w.loff, w.len), w.signaled, p.b_addr(send ? 10000 : w.roff),
                         p.bmr->rkey, w.id == 11));
    if (is_atomic(w.op)) {
      auto& a = ws.back().wr.wr.atomic;
      a.remote_addr = p.b_addr(w.roff);
      a.rkey = p.bmr->rkey;
      old_word.push_back(word(w.roff));
      // FETCH_AND_ADD adds kAdd; CMP_AND_SWP 28 compares equal and swaps, 29 not.
      a.compare_add = w.op == IBV_WR_ATOMIC_FETCH_AND_ADD ? kAdd : w.id == 28 ? old_word.back() : ~old_word.back();
      a.swap = kSwap;
    }
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.a, link_list(ws), &bad), 0);
  // The SENDs past the eighth receive wait; three more receives let them in.
  std::vector<ibv_wc> sends, recvs;
  size_t signaled = 0, nsend = 0;
  for (const Want& w : want) {
    signaled += w.signaled;
    nsend += w.op == IBV_WR_SEND || w.op == IBV_WR_SEND_WITH_IMM;
  }
  poll_list(p, signaled, nsend, 8, [&] { post_recvs(3); }, &sends, &recvs);
  ASSERT_EQ(sends.size(), signaled) << "send completions";
  ASSERT_EQ(recvs.size(), nsend) << "receive completions";
  EXPECT_TRUE(no_completion(p.acq, 20));
  size_t si = 0, ri = 0;
  for (const Want& w : want) {
    SCOPED_TRACE(w.id);
    const bool send = w.op == IBV_WR_SEND || w.op == IBV_WR_SEND_WITH_IMM;
    if (w.signaled) {
      const ibv_wc& c = sends[si++];
      EXPECT_EQ(c.wr_id, w.id) << "send completions in the order posted: " << wc_str(c);
      EXPECT_EQ(c.status, IBV_WC_SUCCESS) << wc_str(c);
      const ibv_wc_opcode op = send                                  ? IBV_WC_SEND
                               : w.op == IBV_WR_RDMA_READ            ? IBV_WC_RDMA_READ
                               : w.op == IBV_WR_ATOMIC_FETCH_AND_ADD ? IBV_WC_FETCH_ADD
                               : w.op == IBV_WR_ATOMIC_CMP_AND_SWP   ? IBV_WC_COMP_SWAP
                                                                     : IBV_WC_RDMA_WRITE;
      EXPECT_EQ(c.opcode, op) << wc_str(c);
      if (w.op == IBV_WR_RDMA_READ || is_atomic(w.op)) {
        EXPECT_EQ(c.byte_len, w.len);
      }
    }
    if (send) {
      const ibv_wc& c = recvs[ri];
      const uint64_t r = 501 + ri++;  // after the warm-up's
      EXPECT_EQ(c.wr_id, r) << "receives taken in the order posted: " << wc_str(c);
      EXPECT_EQ(c.status, IBV_WC_SUCCESS) << wc_str(c);
      EXPECT_EQ(c.byte_len, w.len) << wc_str(c);
      const bool imm = w.op == IBV_WR_SEND_WITH_IMM;
      EXPECT_EQ((c.wc_flags & IBV_WC_WITH_IMM) != 0, imm) << wc_str(c);
      if (imm) {
        EXPECT_EQ(ntohl(c.imm_data), 0x5000 + w.id);
      }
      const uint8_t* got = p.bbuf + kRecvOff + (r - 500) % 14 * kRecvLen;
      for (uint32_t i = 0; i < w.len; ++i) ASSERT_EQ(got[i], p.abuf[w.loff + i]) << "SEND byte " << i;
    } else if (w.op == IBV_WR_RDMA_WRITE) {
      for (uint32_t i = 0; i < w.len; ++i) ASSERT_EQ(p.bbuf[w.roff + i], p.abuf[w.loff + i]) << "WRITE byte " << i;
    } else if (is_atomic(w.op)) {
      const uint64_t before = old_word[w.id - 27];
      uint64_t got = 0;
      std::memcpy(&got, p.abuf + w.loff, 8);
      EXPECT_EQ(got, before) << "the atomic's old value";
      EXPECT_EQ(word(w.roff), w.id == 27 ? before + kAdd : w.id == 28 ? kSwap : before) << "the atomic's target";
    } else {
      for (uint32_t i = 0; i < w.len; ++i) ASSERT_EQ(p.abuf[w.loff + i], p.bbuf[w.roff + i]) << "READ byte " << i;
    }
  }
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
}

// A list of 40 small SENDs (1 to 64 bytes, from the MR and inline, every
// third with immediate data, every other signaled), longer than one opening
// of the target takes (the sender opens it for up to 16 SENDs at a time),
// into 25 receives: the first 25 arrive at once, the rest wait for
// receives (RNR) and arrive once 15 more are posted; every receive is taken
// once, in the order posted, with its bytes, length and immediate data, and
// nothing is written past a message's end; the signaled SENDs complete in
// order.
TEST_F(Errors, AListOfSendsLongerThanARunArrivesInOrder) {
  Pair p;
  make_list_pair(&p);
  for (size_t i = 0; i < kBuf; ++i) p.abuf[i] = static_cast<uint8_t>(i * 13 + 1);
  constexpr size_t kRecvOff = 4096, kRecvLen = 128;
  constexpr uint8_t kCanary = 0xEE;
  constexpr int kN = 40, kFirst = 25;
  uint64_t rid = 500;
  const auto post_recvs = [&](int n) {
    for (int k = 0; k < n; ++k, ++rid) {
      std::memset(p.bbuf + kRecvOff + (rid - 500) * kRecvLen, kCanary, kRecvLen);
      ibv_sge r = p.b_sge(kRecvOff + (rid - 500) * kRecvLen, kRecvLen);
      ASSERT_EQ(post_recv(p.b, rid, &r, 1), 0);
    }
  };
  // One 8-byte SEND into one new receive: both complete, the receive with
  // wr_id want.
  const auto send_one = [&](uint64_t want) {
    post_recvs(1);
    ibv_sge s = p.a_sge(0, 8);
    ASSERT_EQ(post(p.a, IBV_WR_SEND, 1, &s, 1), 0);
    ibv_wc wc{};
    ASSERT_TRUE(harness::poll_one(p.acq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    ASSERT_TRUE(harness::poll_one(p.bcq, &wc));
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
    EXPECT_EQ(wc.wr_id, want) << wc_str(wc);
  };
  // Warm-up: one SEND, so that every cache answers the list.
  send_one(500);
  post_recvs(kFirst);
  const auto len_of = [](int i) { return static_cast<uint32_t>(1 + (i * 23) % 64); };
  const auto off_of = [](int i) { return static_cast<size_t>(64 + i * 64); };
  std::vector<ListWr> ws;
  size_t signaled = 0;
  for (int i = 0; i < kN; ++i) {
    const ibv_wr_opcode op = i % 3 == 2 ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    const bool sig = i % 2 == 1 || i == kN - 1;
    signaled += sig;
    const bool inl = i % 4 == 0 && len_of(i) <= p.acap.max_inline_data;
    ws.push_back(list_wr(op, static_cast<uint64_t>(10 + i), p.a_sge(off_of(i), len_of(i)), sig, 0, 0, inl));
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(p.a, link_list(ws), &bad), 0);
  std::vector<ibv_wc> sends, recvs;
  poll_list(p, signaled, kN, kFirst, [&] { post_recvs(kN - kFirst); }, &sends, &recvs);
  ASSERT_EQ(recvs.size(), size_t{kN}) << "receive completions";
  ASSERT_EQ(sends.size(), signaled) << "send completions";
  EXPECT_TRUE(no_completion(p.bcq, 20));
  EXPECT_TRUE(no_completion(p.acq, 20));
  size_t si = 0;
  for (int i = 0; i < kN; ++i) {
    SCOPED_TRACE(i);
    const ibv_send_wr& w = ws[static_cast<size_t>(i)].wr;
    if (w.send_flags & IBV_SEND_SIGNALED) {
      const ibv_wc& c = sends[si++];
      EXPECT_EQ(c.wr_id, w.wr_id) << "send completions in the order posted: " << wc_str(c);
      EXPECT_EQ(c.status, IBV_WC_SUCCESS) << wc_str(c);
      EXPECT_EQ(c.opcode, IBV_WC_SEND) << wc_str(c);
    }
    const ibv_wc& c = recvs[static_cast<size_t>(i)];
    const uint64_t r = 501 + static_cast<uint64_t>(i);  // after the warm-up's
    EXPECT_EQ(c.wr_id, r) << "receives taken in the order posted: " << wc_str(c);
    EXPECT_EQ(c.status, IBV_WC_SUCCESS) << wc_str(c);
    EXPECT_EQ(c.opcode, IBV_WC_RECV) << wc_str(c);
    EXPECT_EQ(c.byte_len, len_of(i)) << wc_str(c);
    EXPECT_EQ(c.qp_num, p.b->qp_num) << wc_str(c);
    const bool imm = w.opcode == IBV_WR_SEND_WITH_IMM;
    EXPECT_EQ((c.wc_flags & IBV_WC_WITH_IMM) != 0, imm) << wc_str(c);
    if (imm) {
      EXPECT_EQ(ntohl(c.imm_data), 0x5000u + 10u + static_cast<uint32_t>(i));
    }
    const uint8_t* got = p.bbuf + kRecvOff + (r - 500) * kRecvLen;
    for (uint32_t j = 0; j < len_of(i); ++j) ASSERT_EQ(got[j], p.abuf[off_of(i) + j]) << "SEND byte " << j;
    for (uint32_t j = len_of(i); j < kRecvLen; ++j) ASSERT_EQ(got[j], kCanary) << "written past the end, byte " << j;
  }
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS);
  // The sender counted itself out of the receive CQ's producers: a resize,
  // which waits for them, succeeds, and a SEND lands in the new ring.
  EXPECT_EQ(ibv_resize_cq(p.bcq, p.bcq->cqe * 2), 0) << "the receive CQ's producers did not drain";
  send_one(500 + kN + 1);
}

// A list whose third WR is bad: the two before it are done (on their
// cheapest path, the caches warm), *bad_wr names it, nothing after it runs.
TEST_F(Errors, AListStopsAtABadWrAfterWarmOnes) {
  Pair p;
  make_pair(&p);
  for (size_t i = 0; i < kBuf; ++i) p.abuf[i] = static_cast<uint8_t>(i + 1);
  ibv_sge s = p.a_sge(0, 8);
  ASSERT_EQ(post(p.a, IBV_WR_RDMA_WRITE, 1, &s, 1, p.b_addr(0), p.bmr->rkey), 0);
  ibv_wc wc{};
  ASSERT_TRUE(harness::poll_one(p.acq, &wc));
  ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  std::memset(p.bbuf, 0, kBuf);
  std::vector<ListWr> ws = {list_wr(IBV_WR_RDMA_WRITE, 10, p.a_sge(100, 8), false, p.b_addr(100), p.bmr->rkey),
                            list_wr(IBV_WR_RDMA_WRITE, 11, p.a_sge(200, 40), true, p.b_addr(200), p.bmr->rkey),
                            list_wr(IBV_WR_RDMA_WRITE, 12, p.a_sge(300, 8), true, p.b_addr(300), p.bmr->rkey),
                            list_wr(IBV_WR_RDMA_WRITE, 13, p.a_sge(400, 8), true, p.b_addr(400), p.bmr->rkey)};
  ibv_send_wr* head = link_list(ws);
  ws[2].wr.num_sge = static_cast<int>(p.acap.max_send_sge) + 1;
  ibv_send_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_send(p.a, head, &bad), EINVAL);
  EXPECT_EQ(bad, &ws[2].wr) << "bad_wr must name the WR with too many SGEs";
  ASSERT_TRUE(harness::poll_one(p.acq, &wc)) << "the signaled WR before the bad one";
  EXPECT_EQ(wc.wr_id, 11u) << wc_str(wc);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << wc_str(wc);
  EXPECT_TRUE(no_completion(p.acq, 50)) << "WRs at or after bad_wr must not run";
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(p.bbuf[100 + i], p.abuf[100 + i]) << "the first WRITE, byte " << i;
  for (uint32_t i = 0; i < 40; ++i) EXPECT_EQ(p.bbuf[200 + i], p.abuf[200 + i]) << "the second WRITE, byte " << i;
  for (uint32_t i = 0; i < 8; ++i) {
    EXPECT_EQ(p.bbuf[300 + i], 0) << "the bad WR moved byte " << i;
    EXPECT_EQ(p.bbuf[400 + i], 0) << "the WR after the bad one moved byte " << i;
  }
  EXPECT_EQ(harness::qp_state(p.a), IBV_QPS_RTS) << "a rejected post must not change the QP state";
}

}  // namespace

int main(int argc, char** argv) {
  return harness::run_tests_as_root(argc, argv);
}
