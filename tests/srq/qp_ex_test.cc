// The ibv_qp_ex post-send API on RC: a loopback QP pair in this process,
// every builder and setter, data checked byte for byte, completions, batch
// semantics (nothing before wr_complete, wr_abort posts nothing, the first
// builder error stops the batch and is returned by wr_complete).
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cstring>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"

HARNESS_TEST_ENVIRONMENT(.tag = "srqtest");

namespace {

using harness::poll_n;

constexpr int kAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
constexpr uint64_t kRcOps = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
                            IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
                            IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

class QpEx : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    std::string why;
    ctx_ = harness::open_shm0(&why);
    ASSERT_NE(ctx_, nullptr) << why;
    pd_ = ibv_alloc_pd(ctx_);
    cq_a_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    cq_b_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_TRUE(pd_ && cq_a_ && cq_b_);
    mem_.assign(1 << 16, 0);
    mr_ = ibv_reg_mr(pd_, mem_.data(), mem_.size(), kAccess);
    ASSERT_NE(mr_, nullptr);
  }
  void TearDown() override {
    for (auto* q : qps_) ibv_destroy_qp(q);
    if (mr_) ibv_dereg_mr(mr_);
    if (cq_a_) ibv_destroy_cq(cq_a_);
    if (cq_b_) ibv_destroy_cq(cq_b_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
  }

  ibv_qp* make_qp_ex(uint64_t ops, ibv_cq* cq, uint32_t max_send_sge = 2, uint32_t max_inline = 64) {
    ibv_qp_init_attr_ex a{};
    a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.pd = pd_;
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 32;
    a.cap.max_recv_wr = 8;
    a.cap.max_send_sge = max_send_sge;
    a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = max_inline;
    a.send_ops_flags = ops;
    ibv_qp* q = ibv_create_qp_ex(ctx_, &a);
    if (q) qps_.push_back(q);
    return q;
  }
  ibv_qp* make_qp(ibv_cq* cq) {
    ibv_qp* q = harness::create_qp(pd_, cq, IBV_QPT_RC, 32, 16, 2);
    if (q) qps_.push_back(q);
    return q;
  }
  // A (the qp_ex QP) <-> B (a plain QP), connected in this process.
  void connect(ibv_qp* a, ibv_qp* b) {
    uint16_t lid = harness::port_lid(ctx_);
    ASSERT_EQ(harness::connect_qp(a, b->qp_num, lid, kAccess), 0);
    ASSERT_EQ(harness::connect_qp(b, a->qp_num, lid, kAccess), 0);
  }
  void post_recv(ibv_qp* q, uint64_t wr_id, uint64_t off, uint32_t len) {
    ibv_sge sge{addr(off), len, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_recv(q, &wr, &bad), 0);
  }
  uint64_t addr(uint64_t off) { return reinterpret_cast<uint64_t>(mem_.data() + off); }
  uint8_t* at(uint64_t off) { return mem_.data() + off; }
  uint64_t word(uint64_t off) {
    uint64_t v;
    std::memcpy(&v, at(off), 8);
    return v;
  }

  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq *cq_a_ = nullptr, *cq_b_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> mem_;
  std::vector<ibv_qp*> qps_;
};

TEST_F(QpEx, CreateRules) {
  ibv_qp* q = make_qp_ex(kRcOps, cq_a_);
  ASSERT_NE(q, nullptr) << std::strerror(errno);
  ibv_qp_ex* x = ibv_qp_to_qp_ex(q);
  ASSERT_NE(x, nullptr) << "VERBS_QP_EX not set";
  EXPECT_EQ(&x->qp_base, q);
  for (auto fn : {(void*)x->wr_start, (void*)x->wr_complete, (void*)x->wr_abort, (void*)x->wr_rdma_write,
                  (void*)x->wr_rdma_write_imm, (void*)x->wr_send, (void*)x->wr_send_imm, (void*)x->wr_rdma_read,
                  (void*)x->wr_atomic_cmp_swp, (void*)x->wr_atomic_fetch_add, (void*)x->wr_set_sge,
                  (void*)x->wr_set_sge_list, (void*)x->wr_set_inline_data, (void*)x->wr_set_inline_data_list})
    EXPECT_NE(fn, nullptr);
  // A QP of the classic API has no ibv_qp_ex.
  ibv_qp* plain = make_qp(cq_a_);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(ibv_qp_to_qp_ex(plain), nullptr);

  // Send ops RC does not have here.
  // (Memory window operations are supported: tests/datapath/dp_mw.cc.)
  for (uint64_t bad : {uint64_t{IBV_QP_EX_WITH_TSO}, uint64_t{IBV_QP_EX_WITH_ATOMIC_WRITE}, uint64_t{1} << 40}) {
    errno = 0;
    EXPECT_EQ(make_qp_ex(kRcOps | bad, cq_a_), nullptr) << bad;
    EXPECT_EQ(errno, EOPNOTSUPP) << bad;
  }
  // comp_mask must name the PD.
  ibv_qp_init_attr_ex a{};
  a.comp_mask = IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  a.send_cq = cq_a_;
  a.recv_cq = cq_a_;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 4;
  a.cap.max_send_sge = 1;
  a.send_ops_flags = IBV_QP_EX_WITH_SEND;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // Each transport's operations only (IBA table 4): UD sends, UC no READ
  // or atomics.
  a.comp_mask |= IBV_QP_INIT_ATTR_PD;
  a.pd = pd_;
  a.qp_type = IBV_QPT_UD;
  a.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  a.qp_type = IBV_QPT_UC;
  a.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_READ;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  for (ibv_qp_type t : {IBV_QPT_UD, IBV_QPT_UC}) {
    a.qp_type = t;
    a.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM;
    ibv_qp* q = ibv_create_qp_ex(ctx_, &a);
    ASSERT_NE(q, nullptr) << std::strerror(errno);
    EXPECT_NE(ibv_qp_to_qp_ex(q), nullptr);
    EXPECT_EQ(ibv_destroy_qp(q), 0);
  }
}

TEST_F(QpEx, EveryBuilderByteForByte) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b) << std::strerror(errno);
  connect(a, b);
  if (HasFatalFailure()) return;
  ibv_qp_ex* x = ibv_qp_to_qp_ex(a);
  ASSERT_NE(x, nullptr);

  for (int i = 0; i < 4096; ++i) mem_[i] = static_cast<uint8_t>(i * 7 + 3);         // sources
  for (int i = 0; i < 256; ++i) mem_[12000 + i] = static_cast<uint8_t>(255 - i);    // read source
  uint64_t five = 5;
  std::memcpy(at(16384), &five, 8);                                                 // atomic word
  post_recv(b, 100, 20000, 1024);  // consumed by WRITE_WITH_IMM
  post_recv(b, 101, 21024, 1024);  // SEND (inline)
  post_recv(b, 102, 22048, 1024);  // SEND_WITH_IMM (inline list)

  const char hello[] = "hello inline world";
  std::string part1 = "first part|", part2 = "second part";
  ibv_data_buf parts[2] = {{part1.data(), part1.size()}, {part2.data(), part2.size()}};
  ibv_sge two[2] = {{addr(300), 100, mr_->lkey}, {addr(500), 100, mr_->lkey}};

  ibv_wr_start(x);
  x->wr_flags = IBV_SEND_SIGNALED;
  x->wr_id = 1;
  ibv_wr_rdma_write(x, mr_->rkey, addr(8192));
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 300);
  x->wr_id = 2;
  ibv_wr_rdma_write_imm(x, mr_->rkey, addr(9000), htonl(0x11223344));
  ibv_wr_set_sge_list(x, 2, two);
  x->wr_id = 3;
  ibv_wr_send(x);
  ibv_wr_set_inline_data(x, const_cast<char*>(hello), sizeof hello);
  x->wr_id = 4;
  ibv_wr_send_imm(x, htonl(0xabcdef01));
  ibv_wr_set_inline_data_list(x, 2, parts);
  x->wr_id = 5;
  ibv_wr_rdma_read(x, mr_->rkey, addr(12000));
  ibv_wr_set_sge(x, mr_->lkey, addr(13000), 256);
  x->wr_id = 6;
  ibv_wr_atomic_cmp_swp(x, mr_->rkey, addr(16384), 5, 9);
  ibv_wr_set_sge(x, mr_->lkey, addr(16400), 8);
  x->wr_id = 7;
  ibv_wr_atomic_fetch_add(x, mr_->rkey, addr(16384), 10);
  ibv_wr_set_sge(x, mr_->lkey, addr(16408), 8);
  // Nothing is posted before wr_complete.
  ibv_wc wc[8];
  EXPECT_EQ(ibv_poll_cq(cq_a_, 8, wc), 0);
  EXPECT_EQ(ibv_poll_cq(cq_b_, 8, wc), 0);
  EXPECT_EQ(mem_[8192], 0) << "the write ran before wr_complete";
  ASSERT_EQ(ibv_wr_complete(x), 0);

  ASSERT_EQ(poll_n(cq_a_, wc, 7), 7);
  const ibv_wc_opcode want[7] = {IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE, IBV_WC_SEND,      IBV_WC_SEND,
                                 IBV_WC_RDMA_READ,  IBV_WC_COMP_SWAP,  IBV_WC_FETCH_ADD};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(wc[i].status, IBV_WC_SUCCESS) << i << ": " << ibv_wc_status_str(wc[i].status);
    EXPECT_EQ(wc[i].wr_id, uint64_t(i + 1));
    EXPECT_EQ(wc[i].opcode, want[i]) << i;
    EXPECT_EQ(wc[i].qp_num, a->qp_num);
  }
  ASSERT_EQ(poll_n(cq_b_, wc, 3), 3);
  EXPECT_EQ(wc[0].wr_id, 100u);
  EXPECT_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_TRUE(wc[0].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(ntohl(wc[0].imm_data), 0x11223344u);
  EXPECT_EQ(wc[0].byte_len, 200u);
  EXPECT_EQ(wc[1].wr_id, 101u);
  EXPECT_EQ(wc[1].opcode, IBV_WC_RECV);
  EXPECT_EQ(wc[1].byte_len, sizeof hello);
  EXPECT_FALSE(wc[1].wc_flags & IBV_WC_WITH_IMM);
  EXPECT_EQ(wc[2].wr_id, 102u);
  EXPECT_EQ(wc[2].opcode, IBV_WC_RECV);
  EXPECT_EQ(wc[2].byte_len, part1.size() + part2.size());
  EXPECT_EQ(ntohl(wc[2].imm_data), 0xabcdef01u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(wc[i].status, IBV_WC_SUCCESS);
    EXPECT_EQ(wc[i].qp_num, b->qp_num);
    EXPECT_EQ(wc[i].src_qp, a->qp_num);
  }

  EXPECT_EQ(std::memcmp(at(8192), at(0), 300), 0) << "RDMA write";
  EXPECT_EQ(mem_[8192 + 300], 0) << "RDMA write went past its length";
  EXPECT_EQ(std::memcmp(at(9000), at(300), 100), 0) << "write with imm, SGE 1";
  EXPECT_EQ(std::memcmp(at(9100), at(500), 100), 0) << "write with imm, SGE 2";
  EXPECT_EQ(std::memcmp(at(21024), hello, sizeof hello), 0) << "inline send";
  EXPECT_EQ(std::string(reinterpret_cast<char*>(at(22048)), part1.size() + part2.size()), part1 + part2);
  EXPECT_EQ(std::memcmp(at(13000), at(12000), 256), 0) << "RDMA read";
  EXPECT_EQ(word(16400), 5u) << "compare-and-swap returns the old value";
  EXPECT_EQ(word(16408), 9u) << "fetch-and-add returns the value after the swap";
  EXPECT_EQ(word(16384), 19u);
}

TEST_F(QpEx, InlineBufferMayBeReusedAfterTheSetter) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b);
  connect(a, b);
  if (HasFatalFailure()) return;
  ibv_qp_ex* x = ibv_qp_to_qp_ex(a);
  post_recv(b, 1, 20000, 64);
  char msg[16] = "original bytes!";
  ibv_wr_start(x);
  x->wr_id = 9;
  x->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(x);
  ibv_wr_set_inline_data(x, msg, sizeof msg);
  std::memset(msg, 'X', sizeof msg);  // reused before wr_complete
  ASSERT_EQ(ibv_wr_complete(x), 0);
  ibv_wc wc[1];
  ASSERT_EQ(poll_n(cq_b_, wc, 1), 1);
  EXPECT_EQ(std::memcmp(at(20000), "original bytes!", 16), 0);
  ASSERT_EQ(poll_n(cq_a_, wc, 1), 1);
}

TEST_F(QpEx, WrIdAndFlagsAreTakenAtBuilderTime) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b);
  connect(a, b);
  if (HasFatalFailure()) return;
  ibv_qp_ex* x = ibv_qp_to_qp_ex(a);
  ibv_wr_start(x);
  x->wr_id = 41;
  x->wr_flags = 0;  // unsignaled: no completion
  ibv_wr_rdma_write(x, mr_->rkey, addr(8192));
  x->wr_id = 1000;  // changed after the builder: does not apply to it
  x->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 16);
  x->wr_id = 42;
  x->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(x, mr_->rkey, addr(8300));
  x->wr_id = 2000;
  ibv_wr_set_sge(x, mr_->lkey, addr(16), 16);
  ASSERT_EQ(ibv_wr_complete(x), 0);
  ibv_wc wc[2];
  ASSERT_EQ(poll_n(cq_a_, wc, 2, 1000), 1);
  EXPECT_EQ(wc[0].wr_id, 42u);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS);
}

TEST_F(QpEx, AbortPostsNothing) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b);
  connect(a, b);
  if (HasFatalFailure()) return;
  ibv_qp_ex* x = ibv_qp_to_qp_ex(a);
  std::memset(at(0), 0x5a, 64);
  post_recv(b, 77, 20000, 64);
  ibv_wr_start(x);
  x->wr_id = 1;
  x->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 32);
  ibv_wr_rdma_write(x, mr_->rkey, addr(8192));
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 32);
  ibv_wr_abort(x);
  ibv_wc wc[2];
  EXPECT_EQ(poll_n(cq_a_, wc, 1, 300), 0) << "an aborted WQE completed";
  EXPECT_EQ(poll_n(cq_b_, wc, 1, 300), 0) << "an aborted send was received";
  EXPECT_EQ(mem_[8192], 0) << "an aborted write ran";
  // wr_complete after wr_abort has no batch.
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  // The QP still works, and the receive was not consumed.
  ibv_wr_start(x);
  x->wr_id = 2;
  ibv_wr_send(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  ASSERT_EQ(ibv_wr_complete(x), 0);
  ASSERT_EQ(poll_n(cq_b_, wc, 1), 1);
  EXPECT_EQ(wc[0].wr_id, 77u);
  EXPECT_EQ(wc[0].byte_len, 8u);
  ASSERT_EQ(poll_n(cq_a_, wc, 1), 1);
  EXPECT_EQ(wc[0].wr_id, 2u);
}

TEST_F(QpEx, BuilderErrorsAreReportedByWrComplete) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_, /*max_send_sge=*/2, /*max_inline=*/64);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b);
  connect(a, b);
  if (HasFatalFailure()) return;
  ibv_qp_ex* x = ibv_qp_to_qp_ex(a);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  ASSERT_EQ(ibv_query_qp(a, &qa, IBV_QP_CAP, &qi), 0);
  const uint32_t max_sge = qi.cap.max_send_sge, max_inline = qi.cap.max_inline_data;
  post_recv(b, 300, 20000, 64);
  ibv_wc wc[4];

  // [ok write][too many SGEs][ok send]: the first is posted, the rest not.
  std::vector<ibv_sge> many(max_sge + 1, ibv_sge{addr(0), 4, mr_->lkey});
  ibv_wr_start(x);
  x->wr_flags = IBV_SEND_SIGNALED;
  x->wr_id = 1;
  ibv_wr_rdma_write(x, mr_->rkey, addr(8192));
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  x->wr_id = 2;
  ibv_wr_send(x);
  ibv_wr_set_sge_list(x, many.size(), many.data());
  x->wr_id = 3;
  ibv_wr_send(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  ASSERT_EQ(poll_n(cq_a_, wc, 2, 500), 1) << "only the WQE before the failed one is posted";
  EXPECT_EQ(wc[0].wr_id, 1u);
  EXPECT_EQ(poll_n(cq_b_, wc, 1, 200), 0) << "a send after the failed WQE was posted";

  // Inline data longer than max_inline_data.
  std::vector<char> big(max_inline + 1, 'i');
  ibv_wr_start(x);
  x->wr_id = 4;
  ibv_wr_send(x);
  ibv_wr_set_inline_data(x, big.data(), big.size());
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  // Inline data on an RDMA read.
  ibv_wr_start(x);
  ibv_wr_rdma_read(x, mr_->rkey, addr(12000));
  ibv_wr_set_inline_data(x, big.data(), 8);
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  // A setter before any builder.
  ibv_wr_start(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  x->wr_id = 5;
  ibv_wr_send(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  // An atomic whose SGE is not 8 bytes (refused when posted).
  ibv_wr_start(x);
  ibv_wr_atomic_fetch_add(x, mr_->rkey, addr(16384), 1);
  ibv_wr_set_sge(x, mr_->lkey, addr(16400), 4);
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  // wr_complete without wr_start.
  EXPECT_EQ(ibv_wr_complete(x), EINVAL);
  EXPECT_EQ(poll_n(cq_a_, wc, 1, 200), 0) << "a failed batch posted something";
  EXPECT_EQ(poll_n(cq_b_, wc, 1, 200), 0);

  // A builder of an operation the QP was not created with.
  ibv_qp* c = make_qp_ex(IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE, cq_a_);
  ASSERT_NE(c, nullptr);
  ibv_qp_ex* cx = ibv_qp_to_qp_ex(c);
  ASSERT_NE(cx, nullptr);
  ibv_wr_start(cx);
  ibv_wr_rdma_read(cx, mr_->rkey, addr(12000));
  ibv_wr_set_sge(cx, mr_->lkey, addr(13000), 8);
  EXPECT_EQ(ibv_wr_complete(cx), EINVAL);

  // After all that the QP works and the receive is still there.
  ibv_wr_start(x);
  x->wr_id = 6;
  x->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(x);
  ibv_wr_set_sge(x, mr_->lkey, addr(0), 8);
  ASSERT_EQ(ibv_wr_complete(x), 0);
  ASSERT_EQ(poll_n(cq_b_, wc, 1), 1);
  EXPECT_EQ(wc[0].wr_id, 300u);
  ASSERT_EQ(poll_n(cq_a_, wc, 1), 1);
  EXPECT_EQ(wc[0].wr_id, 6u);
}

TEST_F(QpEx, ClassicPostSendStillWorksOnAQpEx) {
  ibv_qp* a = make_qp_ex(kRcOps, cq_a_);
  ibv_qp* b = make_qp(cq_b_);
  ASSERT_TRUE(a && b);
  connect(a, b);
  if (HasFatalFailure()) return;
  std::memset(at(0), 0x42, 32);
  ibv_sge sge{addr(0), 32, mr_->lkey};
  ibv_send_wr wr{};
  wr.wr_id = 8;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = addr(8192);
  wr.wr.rdma.rkey = mr_->rkey;
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(a, &wr, &bad), 0);
  ibv_wc wc[1];
  ASSERT_EQ(poll_n(cq_a_, wc, 1), 1);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS);
  EXPECT_EQ(std::memcmp(at(8192), at(0), 32), 0);
}

}  // namespace
