// Shared receive queues through the public verbs API: creation rules and
// errors, modify/query, posting, QPs on an SRQ, the SRQ limit event and
// LAST_WQE_REACHED, all within this process (loopback QPs). The
// multi-process cases are in srq_mp_test.cc.
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <atomic>
#include <cstring>
#include <set>
#include <vector>

#include "home.h"
#include "verbs.h"

HARNESS_TEST_ENVIRONMENT(.tag = "srqtest");

namespace {

using harness::connect_qp;
using harness::next_async_event;
using harness::poll_n;

constexpr int kAll = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

class Srq : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    std::string why;
    ctx_ = harness::open_shm0(&why);
    ASSERT_NE(ctx_, nullptr) << why;
    ASSERT_EQ(ibv_query_device(ctx_, &dev_), 0);
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr);
    cq_ = ibv_create_cq(ctx_, 256, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr);
    buf_.assign(1 << 16, 0);
    mr_ = ibv_reg_mr(pd_, buf_.data(), buf_.size(), kAll);
    ASSERT_NE(mr_, nullptr);
    // Drain events a previous test may have left behind.
    ibv_async_event ev;
    while (next_async_event(ctx_, &ev, 0)) {
    }
  }
  void TearDown() override {
    for (auto it = qps_.rbegin(); it != qps_.rend(); ++it) ibv_destroy_qp(*it);
    for (auto* s : srqs_) ibv_destroy_srq(s);
    if (mr_) ibv_dereg_mr(mr_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (ctx_) ibv_close_device(ctx_);
  }

  ibv_srq* make_srq(uint32_t max_wr, uint32_t max_sge = 1, ibv_pd* pd = nullptr) {
    ibv_srq_init_attr a{};
    a.attr.max_wr = max_wr;
    a.attr.max_sge = max_sge;
    ibv_srq* s = ibv_create_srq(pd ? pd : pd_, &a);
    if (s) srqs_.push_back(s);
    return s;
  }
  void forget_srq(ibv_srq* s) { std::erase(srqs_, s); }

  ibv_qp* make_qp(ibv_srq* srq, ibv_pd* pd = nullptr, ibv_cq* cq = nullptr) {
    ibv_qp_init_attr a{};
    a.send_cq = cq ? cq : cq_;
    a.recv_cq = cq ? cq : cq_;
    a.srq = srq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = 64;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 2;
    a.cap.max_recv_sge = 2;
    ibv_qp* q = ibv_create_qp(pd ? pd : pd_, &a);
    if (q) qps_.push_back(q);
    return q;
  }
  void forget_qp(ibv_qp* q) { std::erase(qps_, q); }

  int post_srq(ibv_srq* s, uint64_t wr_id, uint64_t off, uint32_t len) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data() + off), len, mr_->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    return ibv_post_srq_recv(s, &wr, &bad);
  }

  int send(ibv_qp* q, uint64_t wr_id, uint64_t off, uint32_t len, uint32_t imm = 0, bool with_imm = false) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data() + off), len, mr_->lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = with_imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    wr.imm_data = htonl(imm);
    wr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(q, &wr, &bad);
  }

  // A connected loopback pair: `client` (own RQ) -> `server` (on `srq`).
  void pair(ibv_srq* srq, ibv_qp** client, ibv_qp** server) {
    *server = make_qp(srq);
    ASSERT_NE(*server, nullptr) << std::strerror(errno);
    *client = make_qp(nullptr);
    ASSERT_NE(*client, nullptr) << std::strerror(errno);
    uint16_t lid = harness::port_lid(ctx_);
    ASSERT_EQ(connect_qp(*server, (*client)->qp_num, lid, kAll), 0);
    ASSERT_EQ(connect_qp(*client, (*server)->qp_num, lid, kAll), 0);
  }

  ibv_context* ctx_ = nullptr;
  ibv_device_attr dev_{};
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<uint8_t> buf_;
  std::vector<ibv_srq*> srqs_;
  std::vector<ibv_qp*> qps_;
};

TEST_F(Srq, DeviceAdvertisesSrqs) {
  EXPECT_GT(dev_.max_srq, 0);
  EXPECT_GT(dev_.max_srq_wr, 0);
  EXPECT_GT(dev_.max_srq_sge, 0);
}

TEST_F(Srq, CreateRoundsUpAndWritesBack) {
  ibv_srq_init_attr a{};
  a.srq_context = this;
  a.attr.max_wr = 100;
  a.attr.max_sge = 3;
  ibv_srq* s = ibv_create_srq(pd_, &a);
  ASSERT_NE(s, nullptr) << std::strerror(errno);
  srqs_.push_back(s);
  EXPECT_EQ(a.attr.max_wr, 128u);
  EXPECT_EQ(a.attr.max_sge, 4u);
  EXPECT_EQ(s->context, ctx_);
  EXPECT_EQ(s->pd, pd_);
  EXPECT_EQ(s->srq_context, this);
  ibv_srq_attr q{};
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.max_wr, 128u);
  EXPECT_EQ(q.max_sge, 4u);
  EXPECT_EQ(q.srq_limit, 0u) << "a new SRQ is not armed";
}

TEST_F(Srq, CreateLimits) {
  errno = 0;
  EXPECT_EQ(make_srq(0), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(make_srq(static_cast<uint32_t>(dev_.max_srq_wr) + 1), nullptr);
  EXPECT_EQ(errno, EINVAL);
  errno = 0;
  EXPECT_EQ(make_srq(16, static_cast<uint32_t>(dev_.max_srq_sge) + 1), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // The largest advertised values work.
  ibv_srq* s = make_srq(static_cast<uint32_t>(dev_.max_srq_wr), static_cast<uint32_t>(dev_.max_srq_sge));
  ASSERT_NE(s, nullptr) << std::strerror(errno);
  ibv_srq_attr q{};
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.max_wr, static_cast<uint32_t>(dev_.max_srq_wr));
  EXPECT_EQ(q.max_sge, static_cast<uint32_t>(dev_.max_srq_sge));
}

TEST_F(Srq, MaxSrqIsDeviceWide) {
  // Another context holds some SRQs: this one gets what is left of max_srq.
  std::string why;
  ibv_context* ctx2 = harness::open_shm0(&why);
  ASSERT_NE(ctx2, nullptr) << why;
  ibv_pd* pd2 = ibv_alloc_pd(ctx2);
  ASSERT_NE(pd2, nullptr);
  std::vector<ibv_srq*> theirs;
  for (int i = 0; i < 10; ++i) {
    ibv_srq_init_attr a{};
    a.attr.max_wr = 1;
    a.attr.max_sge = 1;
    ibv_srq* s = ibv_create_srq(pd2, &a);
    ASSERT_NE(s, nullptr) << std::strerror(errno);
    theirs.push_back(s);
  }
  int made = 0;
  errno = 0;
  while (made < dev_.max_srq && make_srq(1)) ++made;
  int err = errno;
  EXPECT_EQ(made, dev_.max_srq - 10);
  EXPECT_EQ(err, ENOMEM);
  // Freeing one of theirs makes room for one of ours.
  ASSERT_EQ(ibv_destroy_srq(theirs.back()), 0);
  theirs.pop_back();
  EXPECT_NE(make_srq(1), nullptr) << std::strerror(errno);
  for (auto* s : theirs) EXPECT_EQ(ibv_destroy_srq(s), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd2), 0);
  EXPECT_EQ(ibv_close_device(ctx2), 0);
}

TEST_F(Srq, CreateEx) {
  ibv_srq_init_attr_ex a{};
  a.attr.max_wr = 10;
  a.attr.max_sge = 1;
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ;
  a.srq_type = IBV_SRQT_BASIC;
  a.pd = pd_;
  a.cq = cq_;
  a.srq_context = this;
  ibv_srq* s = ibv_create_srq_ex(ctx_, &a);
  ASSERT_NE(s, nullptr) << std::strerror(errno);
  srqs_.push_back(s);
  EXPECT_EQ(a.attr.max_wr, 16u);
  EXPECT_EQ(s->context, ctx_);
  EXPECT_EQ(s->pd, pd_);
  EXPECT_EQ(s->srq_context, this);
  uint32_t num = 0;
  EXPECT_EQ(ibv_get_srq_num(s, &num), 0);

  // Basic via the short path (TYPE|PD only) also works.
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
  ibv_srq* s2 = ibv_create_srq_ex(ctx_, &a);
  ASSERT_NE(s2, nullptr) << std::strerror(errno);
  srqs_.push_back(s2);

  // An XRC SRQ needs its XRC domain (tests/datapath/dp_xrc.cc covers XRC);
  // tag matching is not supported.
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ;
  a.srq_type = IBV_SRQT_XRC;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  a.srq_type = IBV_SRQT_TM;
  a.comp_mask |= IBV_SRQ_INIT_ATTR_TM;
  a.tm_cap.max_num_tags = 16;
  a.tm_cap.max_ops = 16;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EOPNOTSUPP);
  // No PD.
  a = ibv_srq_init_attr_ex{};
  a.attr.max_wr = 10;
  a.attr.max_sge = 1;
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_CQ;
  a.srq_type = IBV_SRQT_BASIC;
  a.cq = cq_;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // Limits through the extended path too.
  a.comp_mask |= IBV_SRQ_INIT_ATTR_PD;
  a.pd = pd_;
  a.attr.max_wr = static_cast<uint32_t>(dev_.max_srq_wr) + 1;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(Srq, SrqNumbersAreDistinct) {
  std::set<uint32_t> nums;
  for (int i = 0; i < 8; ++i) {
    ibv_srq* s = make_srq(4);
    ASSERT_NE(s, nullptr);
    uint32_t n = 0;
    ASSERT_EQ(ibv_get_srq_num(s, &n), 0);
    EXPECT_LE(n, 0xffffffu);
    nums.insert(n);
  }
  EXPECT_EQ(nums.size(), 8u);
}

TEST_F(Srq, ModifyAndQuery) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_srq_attr a{};
  a.srq_limit = 5;
  ASSERT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), 0);
  ibv_srq_attr q{};
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.srq_limit, 5u);
  EXPECT_EQ(q.max_wr, 16u);
  // Limit above max_wr.
  a.srq_limit = 17;
  EXPECT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), EINVAL);
  // The limit may equal max_wr; 0 disarms.
  a.srq_limit = 16;
  EXPECT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), 0);
  a.srq_limit = 0;
  EXPECT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), 0);
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.srq_limit, 0u);
  // Resizing is not supported (and not advertised).
  EXPECT_FALSE(dev_.device_cap_flags & IBV_DEVICE_SRQ_RESIZE);
  a.max_wr = 32;
  EXPECT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_MAX_WR), EINVAL);
  a.srq_limit = 1;
  EXPECT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT), EINVAL);
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.max_wr, 16u);
  EXPECT_EQ(q.srq_limit, 0u) << "a failed modify changes nothing";
  // Unknown attribute bits.
  EXPECT_EQ(ibv_modify_srq(s, &a, 1 << 5), EINVAL);
}

TEST_F(Srq, PostUntilFullThenEnomem) {
  ibv_srq* s = make_srq(8, 2);
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 8; ++i) ASSERT_EQ(post_srq(s, i, 64 * i, 64), 0) << i;
  // One more fails with ENOMEM and names the WR.
  ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data()), 64, mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = 99;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_srq_recv(s, &wr, &bad), ENOMEM);
  EXPECT_EQ(bad, &wr);
}

TEST_F(Srq, PostListStopsAtTheFirstFailure) {
  ibv_srq* s = make_srq(4, 1);
  ASSERT_NE(s, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_EQ(post_srq(s, i, 0, 16), 0);
  ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data()), 16, mr_->lkey};
  ibv_recv_wr w[3]{};
  for (int i = 0; i < 3; ++i) {
    w[i].wr_id = 10 + i;
    w[i].sg_list = &sge;
    w[i].num_sge = 1;
    w[i].next = i < 2 ? &w[i + 1] : nullptr;
  }
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_srq_recv(s, &w[0], &bad), ENOMEM);
  EXPECT_EQ(bad, &w[1]) << "the first WR fits, the second does not";
}

TEST_F(Srq, PostTooManySges) {
  ibv_srq* s = make_srq(8, 2);
  ASSERT_NE(s, nullptr);
  ibv_sge sge[3];
  for (auto& g : sge) g = ibv_sge{reinterpret_cast<uint64_t>(buf_.data()), 8, mr_->lkey};
  ibv_recv_wr wr{};
  wr.sg_list = sge;
  wr.num_sge = 3;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_srq_recv(s, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
  wr.num_sge = -1;
  bad = nullptr;
  EXPECT_EQ(ibv_post_srq_recv(s, &wr, &bad), EINVAL);
  wr.num_sge = 2;
  EXPECT_EQ(ibv_post_srq_recv(s, &wr, &bad), 0);
}

TEST_F(Srq, DestroyIsBusyWhileQpsUseIt) {
  ibv_srq* s = make_srq(8);
  ASSERT_NE(s, nullptr);
  ibv_qp* q1 = make_qp(s);
  ASSERT_NE(q1, nullptr) << std::strerror(errno);
  ibv_qp* q2 = make_qp(s);
  ASSERT_NE(q2, nullptr);
  EXPECT_EQ(ibv_destroy_srq(s), EBUSY);
  ASSERT_EQ(ibv_destroy_qp(q1), 0);
  forget_qp(q1);
  EXPECT_EQ(ibv_destroy_srq(s), EBUSY);
  ASSERT_EQ(ibv_destroy_qp(q2), 0);
  forget_qp(q2);
  EXPECT_EQ(ibv_destroy_srq(s), 0);
  forget_srq(s);
}

TEST_F(Srq, PdIsBusyWhileAnSrqUsesIt) {
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd, nullptr);
  ibv_srq* s = make_srq(8, 1, pd);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY);
  ASSERT_EQ(ibv_destroy_srq(s), 0);
  forget_srq(s);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

TEST_F(Srq, QpOnSrqMustShareItsPdAndContext) {
  ibv_pd* other = ibv_alloc_pd(ctx_);
  ASSERT_NE(other, nullptr);
  ibv_srq* s = make_srq(8);
  ASSERT_NE(s, nullptr);
  errno = 0;
  EXPECT_EQ(make_qp(s, other), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_dealloc_pd(other), 0);

  // An SRQ of another context.
  std::string why;
  ibv_context* ctx2 = harness::open_shm0(&why);
  ASSERT_NE(ctx2, nullptr) << why;
  ibv_pd* pd2 = ibv_alloc_pd(ctx2);
  ibv_cq* cq2 = ibv_create_cq(ctx2, 16, nullptr, nullptr, 0);
  ASSERT_TRUE(pd2 && cq2);
  ibv_qp_init_attr a{};
  a.send_cq = cq2;
  a.recv_cq = cq2;
  a.srq = s;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 4;
  a.cap.max_send_sge = 1;
  errno = 0;
  ibv_qp* q = ibv_create_qp(pd2, &a);
  EXPECT_EQ(q, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (q) ibv_destroy_qp(q);
  ibv_destroy_cq(cq2);
  ibv_dealloc_pd(pd2);
  ibv_close_device(ctx2);
}

TEST_F(Srq, QpOnSrqHasNoReceiveQueue) {
  ibv_srq* s = make_srq(8);
  ASSERT_NE(s, nullptr);
  ibv_qp_init_attr a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.srq = s;
  a.qp_type = IBV_QPT_RC;
  a.cap.max_send_wr = 4;
  a.cap.max_recv_wr = 100;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 3;
  ibv_qp* q = ibv_create_qp(pd_, &a);
  ASSERT_NE(q, nullptr) << std::strerror(errno);
  qps_.push_back(q);
  EXPECT_EQ(q->srq, s);
  EXPECT_EQ(a.cap.max_recv_wr, 0u);
  EXPECT_EQ(a.cap.max_recv_sge, 0u);
  ibv_qp_attr qa{};
  ibv_qp_init_attr qi{};
  ASSERT_EQ(ibv_query_qp(q, &qa, IBV_QP_CAP, &qi), 0);
  EXPECT_EQ(qi.srq, s);
  ASSERT_EQ(harness::qp_to_init(q, kAll), 0);
  // Receives go to the SRQ: ibv_post_recv on the QP is EINVAL.
  ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data()), 16, mr_->lkey};
  ibv_recv_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_recv(q, &wr, &bad), EINVAL);
  EXPECT_EQ(bad, &wr);
}

TEST_F(Srq, TwoQpsShareOneSrqLoopback) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c1, *s1, *c2, *s2;
  pair(s, &c1, &s1);
  pair(s, &c2, &s2);
  if (HasFatalFailure()) return;
  for (int i = 0; i < 4; ++i) ASSERT_EQ(post_srq(s, 1000 + i, 4096 + 1024 * i, 1024), 0);
  for (int i = 0; i < 256; ++i) buf_[i] = static_cast<uint8_t>(i);
  ASSERT_EQ(send(c1, 1, 0, 100, 7, true), 0);
  ASSERT_EQ(send(c2, 2, 100, 50), 0);
  ibv_wc wc[4];
  ASSERT_EQ(poll_n(cq_, wc, 4), 4);
  int recvs = 0;
  std::set<uint32_t> qpns;
  for (auto& w : wc) {
    ASSERT_EQ(w.status, IBV_WC_SUCCESS) << ibv_wc_status_str(w.status);
    if (w.opcode != IBV_WC_RECV) continue;
    ++recvs;
    qpns.insert(w.qp_num);
    EXPECT_GE(w.wr_id, 1000u);
    uint64_t off = 4096 + 1024 * (w.wr_id - 1000);
    if (w.qp_num == s1->qp_num) {
      EXPECT_EQ(w.byte_len, 100u);
      EXPECT_TRUE(w.wc_flags & IBV_WC_WITH_IMM);
      EXPECT_EQ(ntohl(w.imm_data), 7u);
      EXPECT_EQ(w.src_qp, c1->qp_num);
      EXPECT_EQ(std::memcmp(buf_.data() + off, buf_.data(), 100), 0);
    } else {
      EXPECT_EQ(w.qp_num, s2->qp_num);
      EXPECT_EQ(w.byte_len, 50u);
      EXPECT_EQ(w.src_qp, c2->qp_num);
      EXPECT_EQ(std::memcmp(buf_.data() + off, buf_.data() + 100, 50), 0);
    }
  }
  EXPECT_EQ(recvs, 2);
  EXPECT_EQ(qpns.size(), 2u) << "one receive completion per server QP";
}

TEST_F(Srq, LimitEventOncePerArming) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  for (int i = 0; i < 8; ++i) ASSERT_EQ(post_srq(s, i, 8192 + 64 * i, 64), 0);
  ibv_srq_attr a{};
  a.srq_limit = 6;
  ASSERT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), 0);
  ibv_async_event ev{};
  ibv_wc wc[2];
  // 8 -> 7 posted: not below 6 yet.
  ASSERT_EQ(send(c, 1, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  EXPECT_FALSE(next_async_event(ctx_, &ev, 200)) << "event " << ibv_event_type_str(ev.event_type);
  // 7 -> 6: still not below.
  ASSERT_EQ(send(c, 2, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  EXPECT_FALSE(next_async_event(ctx_, &ev, 200));
  // 6 -> 5: below the limit.
  ASSERT_EQ(send(c, 3, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  ASSERT_TRUE(next_async_event(ctx_, &ev, 5000)) << "no SRQ limit event";
  EXPECT_EQ(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED) << ibv_event_type_str(ev.event_type);
  EXPECT_EQ(ev.element.srq, s);
  ibv_srq_attr q{};
  ASSERT_EQ(ibv_query_srq(s, &q), 0);
  EXPECT_EQ(q.srq_limit, 0u) << "the event disarms the limit";
  // Further consumption raises nothing until re-armed.
  ASSERT_EQ(send(c, 4, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  EXPECT_FALSE(next_async_event(ctx_, &ev, 200)) << "second event " << ibv_event_type_str(ev.event_type);
  // Re-arm at 4 with 4 posted: the next consumption (4 -> 3) fires again.
  a.srq_limit = 4;
  ASSERT_EQ(ibv_modify_srq(s, &a, IBV_SRQ_LIMIT), 0);
  ASSERT_EQ(send(c, 5, 0, 8), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  ASSERT_TRUE(next_async_event(ctx_, &ev, 5000)) << "no event after re-arming";
  EXPECT_EQ(ev.event_type, IBV_EVENT_SRQ_LIMIT_REACHED);
  EXPECT_EQ(ev.element.srq, s);
}

TEST_F(Srq, ErrorStateRaisesLastWqeReachedAndDoesNotFlushTheSrq) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c1, *s1, *c2, *s2;
  pair(s, &c1, &s1);
  pair(s, &c2, &s2);
  if (HasFatalFailure()) return;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(post_srq(s, 500 + i, 16384 + 64 * i, 64), 0);

  ASSERT_EQ(harness::qp_to_err(s1), 0);
  ibv_async_event ev{};
  ASSERT_TRUE(next_async_event(ctx_, &ev, 5000)) << "no LAST_WQE_REACHED";
  EXPECT_EQ(ev.event_type, IBV_EVENT_QP_LAST_WQE_REACHED) << ibv_event_type_str(ev.event_type);
  EXPECT_EQ(ev.element.qp, s1);
  // Once per entry into ERR.
  ASSERT_EQ(harness::qp_to_err(s1), 0);
  EXPECT_FALSE(next_async_event(ctx_, &ev, 200)) << "second event " << ibv_event_type_str(ev.event_type);

  // The SRQ was not flushed: no flush completions, and the other QP still
  // receives into the WQEs posted before.
  ibv_wc wc[4];
  EXPECT_EQ(ibv_poll_cq(cq_, 4, wc), 0) << "flushed WQE wr_id " << wc[0].wr_id;
  ASSERT_EQ(send(c2, 9, 0, 32), 0);
  ASSERT_EQ(poll_n(cq_, wc, 2), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(wc[i].status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc[i].status);
    if (wc[i].opcode == IBV_WC_RECV) {
      EXPECT_EQ(wc[i].wr_id, 500u) << "the first WQE posted to the SRQ";
      EXPECT_EQ(wc[i].qp_num, s2->qp_num);
    }
  }
  // Back to RESET and ERR again: a new event.
  ibv_qp_attr ra{};
  ra.qp_state = IBV_QPS_RESET;
  ASSERT_EQ(ibv_modify_qp(s1, &ra, IBV_QP_STATE), 0);
  ASSERT_EQ(harness::qp_to_err(s1), 0);
  ASSERT_TRUE(next_async_event(ctx_, &ev, 5000));
  EXPECT_EQ(ev.event_type, IBV_EVENT_QP_LAST_WQE_REACHED);
  EXPECT_EQ(ev.element.qp, s1);
}


// The provider's SRQ SEND leaf (1 to 16 bytes) checks the WQE at the SRQ's
// head before it claims it; these are the WQEs it must leave to the general
// path, which completes them in error as for any SEND (the responder's
// completion first, then the requester's).
class SrqSmall : public Srq {
 protected:
  // The pair, the client with a send CQ of its own (the leaf takes a
  // signaled WR only when its completion has the CQ's single producer), and
  // one small SEND through it that fills the sender's caches (the leaf takes
  // a WR only when they answer; the first goes the general way).
  void warm_pair(ibv_srq* s, ibv_qp** c, ibv_qp** sv) {
    ccq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_NE(ccq_, nullptr);
    *sv = make_qp(s);
    ASSERT_NE(*sv, nullptr) << std::strerror(errno);
    *c = harness::create_qp(pd_, ccq_, IBV_QPT_RC, 64, 16, 2, 64);  // two SGEs, 64 inline bytes
    ASSERT_NE(*c, nullptr) << std::strerror(errno);
    qps_.push_back(*c);
    uint16_t lid = harness::port_lid(ctx_);
    ASSERT_EQ(connect_qp(*sv, (*c)->qp_num, lid, kAll), 0);
    ASSERT_EQ(connect_qp(*c, (*sv)->qp_num, lid, kAll), 0);
    ASSERT_EQ(post_srq(s, 1, 2048, 64), 0);
    ASSERT_EQ(send(*c, 1, 0, 8), 0);
    ibv_wc w{};
    ASSERT_EQ(poll_n(ccq_, &w, 1), 1);
    ASSERT_EQ(w.status, IBV_WC_SUCCESS) << str(w);
    ASSERT_EQ(poll_n(cq_, &w, 1), 1);
    ASSERT_EQ(w.status, IBV_WC_SUCCESS) << str(w);
  }
  // An SRQ of 16 (*s) behind a server QP (*sv) whose CQ is an extended
  // one with wc_flags (*cqx, the test destroys it after *sv), and a client
  // (*c) with a send CQ of its own (ccq_), connected; the client's bytes
  // 32768 + i are 0x40 + i (i < 64).
  void ex_pair(uint64_t wc_flags, ibv_srq** s, ibv_cq_ex** cqx, ibv_qp** sv, ibv_qp** c) {
    *s = make_srq(16);
    ASSERT_NE(*s, nullptr);
    ibv_cq_init_attr_ex ca{};
    ca.cqe = 64;
    ca.wc_flags = wc_flags;
    *cqx = ibv_create_cq_ex(ctx_, &ca);
    ASSERT_NE(*cqx, nullptr) << std::strerror(errno);
    ccq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_NE(ccq_, nullptr);
    *sv = make_qp(*s, nullptr, ibv_cq_ex_to_cq(*cqx));
    ASSERT_NE(*sv, nullptr) << std::strerror(errno);
    *c = harness::create_qp(pd_, ccq_, IBV_QPT_RC, 64, 16, 2, 64);
    ASSERT_NE(*c, nullptr) << std::strerror(errno);
    qps_.push_back(*c);
    const uint16_t lid = harness::port_lid(ctx_);
    ASSERT_EQ(connect_qp(*sv, (*c)->qp_num, lid, kAll), 0);
    ASSERT_EQ(connect_qp(*c, (*sv)->qp_num, lid, kAll), 0);
    for (uint32_t i = 0; i < 64; ++i) buf_[32768 + i] = static_cast<uint8_t>(0x40 + i);
  }
  void TearDown() override {
    for (auto* q : qps_) ibv_destroy_qp(q);
    qps_.clear();
    if (ccq_) ibv_destroy_cq(ccq_);
    Srq::TearDown();
  }
  ibv_cq* ccq_ = nullptr;
  // A SEND of two inline SGEs of a and b bytes (at most 64 in all; UCX's
  // shape: its 9-byte header, then the payload) from c, bytes 0xa0 + i of
  // the first and 0xc0 + i of the second; both completions, the sender's and
  // the receiver's, in *snd and *rcv.
  void send_two_inline(ibv_qp* c, ibv_qp* sv, uint32_t a, uint32_t b, ibv_wc* snd, ibv_wc* rcv) {
    uint8_t head[64], tail[64];
    for (int i = 0; i < 64; ++i) head[i] = static_cast<uint8_t>(0xa0 + i), tail[i] = static_cast<uint8_t>(0xc0 + i);
    // An empty first SGE without an address, as a caller may pass one.
    ibv_sge sge[2] = {{a ? reinterpret_cast<uint64_t>(head) : 0, a, 0}, {reinterpret_cast<uint64_t>(tail), b, 0}};
    ibv_send_wr wr{};
    wr.wr_id = 77;
    wr.sg_list = sge;
    wr.num_sge = 2;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_send_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_send(c, &wr, &bad), 0);
    std::memset(head, 0, sizeof head);  // inline: the bytes went with the post
    std::memset(tail, 0, sizeof tail);
    ASSERT_EQ(poll_n(ccq_, snd, 1), 1);
    ASSERT_EQ(poll_n(cq_, rcv, 1), 1);
    EXPECT_EQ(rcv->qp_num, sv->qp_num);
  }
  static std::string str(const ibv_wc& w) {
    return std::string(ibv_wc_status_str(w.status)) + " opcode " + std::to_string(w.opcode);
  }
};

TEST_F(SrqSmall, TwoInlineSgesArriveWhole) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  // 16 bytes, 17 (an 8-byte Open MPI message over UCX), 64 (the most the
  // leaf takes) and 20 after an empty SGE, each into a fresh buffer.
  const uint32_t sizes[][2] = {{8, 8}, {9, 8}, {9, 55}, {0, 20}};
  for (uint32_t k = 0; k < 4; ++k) {
    const uint32_t a = sizes[k][0], b = sizes[k][1];
    const uint64_t off = 4096 + 128 * k;
    ASSERT_EQ(post_srq(s, 5 + k, off, 100), 0);
    ibv_wc snd{}, rcv{};
    send_two_inline(c, sv, a, b, &snd, &rcv);
    if (HasFatalFailure()) return;
    EXPECT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
    EXPECT_EQ(snd.opcode, IBV_WC_SEND);
    EXPECT_EQ(snd.wr_id, 77u);
    ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv);
    EXPECT_EQ(rcv.opcode, IBV_WC_RECV);
    EXPECT_EQ(rcv.wr_id, 5u + k);
    EXPECT_EQ(rcv.byte_len, a + b);
    EXPECT_EQ(rcv.src_qp, c->qp_num);
    for (uint32_t i = 0; i < a; ++i) EXPECT_EQ(buf_[off + i], 0xa0 + i) << a << "+" << b << ": byte " << i;
    for (uint32_t i = 0; i < b; ++i) EXPECT_EQ(buf_[off + a + i], 0xc0 + i) << a << "+" << b << ": byte " << a + i;
    EXPECT_EQ(buf_[off + a + b], 0) << "nothing past the message";
  }
}

// Two inline SGEs (UCX's shape) of every split of 1 to 64 bytes, each sent
// twice in a row, into two WQEs (up to 20 bytes travel in the completion
// and the receiver's poll puts them in the buffer; from 21 the leaf writes
// both parts straight into the buffer). Then a 32-byte send whose second
// part is read from the very buffer its first part lands in (a loopback
// send out of its own receive buffer): the bytes the post carried arrive,
// not what the first part's stores left there.
TEST_F(SrqSmall, TwoInlineSgesOfEverySplitAndAnOverlapArriveAsPosted) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  uint8_t head[64], tail[64];
  for (int i = 0; i < 64; ++i) head[i] = static_cast<uint8_t>(0x20 + i), tail[i] = static_cast<uint8_t>(0x70 + i);
  const auto post_two = [&](const uint8_t* s0, uint32_t a, const uint8_t* s1, uint32_t b, uint64_t id) {
    ibv_sge sge[2] = {{reinterpret_cast<uint64_t>(s0), a, 0}, {reinterpret_cast<uint64_t>(s1), b, 0}};
    ibv_send_wr wr{};
    wr.wr_id = id;
    wr.sg_list = sge;
    wr.num_sge = 2;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_send_wr* bad = nullptr;
    return ibv_post_send(c, &wr, &bad);
  };
  constexpr uint64_t kDst[2] = {8192, 8192 + 256};
  for (uint32_t len = 1; len <= 64; ++len)
    for (uint32_t a = 0; a <= len; ++a) {
      const uint32_t b = len - a;
      for (int k = 0; k < 2; ++k) {
        std::memset(buf_.data() + kDst[k], 0x5a, 128);
        ASSERT_EQ(post_srq(s, 100 + k, kDst[k] + 16, 100), 0);
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(post_two(head, a, tail, b, 200 + k), 0);
        ibv_wc snd{};
        ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
        ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
      }
      for (int k = 0; k < 2; ++k) {
        ibv_wc rcv{};
        ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
        ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv) << " " << a << "+" << b << ", send " << k;
        EXPECT_EQ(rcv.wr_id, 100u + k);
        EXPECT_EQ(rcv.byte_len, len);
        const uint8_t* d = buf_.data() + kDst[k];
        for (uint32_t i = 0; i < 16; ++i) ASSERT_EQ(d[i], 0x5a) << a << "+" << b << ", send " << k << ": byte " << i;
        for (uint32_t i = 0; i < a; ++i)
          ASSERT_EQ(d[16 + i], head[i]) << a << "+" << b << ", send " << k << ": byte " << i;
        for (uint32_t i = 0; i < b; ++i)
          ASSERT_EQ(d[16 + a + i], tail[i]) << a << "+" << b << ", send " << k << ": byte " << a + i;
        for (uint32_t i = 16 + len; i < 128; ++i)
          ASSERT_EQ(d[i], 0x5a) << a << "+" << b << ", send " << k << ": byte " << i - 16;
      }
    }
  // The overlap: 8 + 24 bytes (into the buffer) whose second part starts
  // 2 bytes into the buffer it goes to.
  uint8_t* dst = buf_.data() + kDst[0] + 16;
  for (int i = 0; i < 64; ++i) dst[i] = static_cast<uint8_t>(0xb0 + i);
  uint8_t want[32];
  std::memcpy(want, head, 8);
  std::memcpy(want + 8, dst + 2, 24);
  ASSERT_EQ(post_srq(s, 300, kDst[0] + 16, 100), 0);
  ASSERT_EQ(post_two(head, 8, dst + 2, 24, 301), 0);
  ibv_wc snd{}, rcv{};
  ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
  ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
  ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
  ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv);
  EXPECT_EQ(rcv.byte_len, 32u);
  for (int i = 0; i < 32; ++i) ASSERT_EQ(dst[i], want[i]) << "byte " << i;
  EXPECT_EQ(dst[32], 0xb0 + 32) << "nothing past the message";
}

TEST_F(SrqSmall, BufferTooSmallIsLocLenAtTheReceiverAndRemInvReqAtTheSender) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  std::memset(buf_.data() + 4096, 0x5a, 64);
  ASSERT_EQ(post_srq(s, 6, 4096, 4), 0);  // 4 bytes for a 16-byte message
  ibv_wc snd{}, rcv{};
  send_two_inline(c, sv, 8, 8, &snd, &rcv);
  if (HasFatalFailure()) return;
  EXPECT_EQ(rcv.status, IBV_WC_LOC_LEN_ERR) << str(rcv);
  EXPECT_EQ(rcv.wr_id, 6u);
  EXPECT_EQ(snd.status, IBV_WC_REM_INV_REQ_ERR) << str(snd);
  EXPECT_EQ(snd.wr_id, 77u);
  for (int i = 0; i < 64; ++i) ASSERT_EQ(buf_[4096 + i], 0x5a) << "byte " << i << " of the receive buffer was written";
}

TEST_F(SrqSmall, BufferWithABadLkeyIsLocProtAtTheReceiverAndRemOpAtTheSender) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  ibv_sge sge{reinterpret_cast<uint64_t>(buf_.data() + 4096), 64, mr_->lkey + 0x100};
  ibv_recv_wr wr{};
  wr.wr_id = 8;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_srq_recv(s, &wr, &bad), 0);
  ibv_wc snd{}, rcv{};
  send_two_inline(c, sv, 9, 8, &snd, &rcv);
  if (HasFatalFailure()) return;
  EXPECT_EQ(rcv.status, IBV_WC_LOC_PROT_ERR) << str(rcv);
  EXPECT_EQ(rcv.wr_id, 8u);
  EXPECT_EQ(snd.status, IBV_WC_REM_OP_ERR) << str(snd);
}

// Every size the leaf takes (1 to 64 bytes), with and without an immediate,
// two SENDs each, one right after the other (up to 20 bytes, 16 with an
// immediate, travel in the receive completion and the receiver's poll puts
// them in the buffer; larger ones go into the buffer). Both arrive byte for
// byte, nothing around them changes, and each completion says what a SEND's
// says.
TEST_F(SrqSmall, EverySizeWithAndWithoutImmediateArrivesExactly) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  constexpr uint64_t kSrc = 32768, kDst[2] = {8192, 8192 + 256};
  for (uint32_t i = 0; i < 64; ++i) buf_[kSrc + i] = static_cast<uint8_t>(0x11 + 3 * i);
  for (int with_imm = 0; with_imm < 2; ++with_imm)
    for (uint32_t len = 1; len <= 64; ++len) {
      for (int k = 0; k < 2; ++k) {
        std::memset(buf_.data() + kDst[k], 0x5a, 128);
        ASSERT_EQ(post_srq(s, 1000 + 100 * k + len, kDst[k] + 16, 100), 0);
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_EQ(send(c, 2000 + 100 * k + len, kSrc, len, 0xabc00 + len, with_imm), 0);
        ibv_wc snd{};
        ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
        ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
        EXPECT_EQ(snd.wr_id, 2000u + 100 * k + len);
      }
      for (int k = 0; k < 2; ++k) {
        ibv_wc rcv{};
        ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
        ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv) << " at " << len << " bytes, send " << k;
        EXPECT_EQ(rcv.opcode, IBV_WC_RECV);
        EXPECT_EQ(rcv.wr_id, 1000u + 100 * k + len);
        EXPECT_EQ(rcv.byte_len, len);
        EXPECT_EQ(rcv.qp_num, sv->qp_num);
        EXPECT_EQ(rcv.src_qp, c->qp_num);
        EXPECT_EQ(rcv.slid, harness::port_lid(ctx_));
        EXPECT_EQ(rcv.wc_flags & IBV_WC_WITH_IMM, with_imm ? uint32_t{IBV_WC_WITH_IMM} : 0u) << len;
        if (with_imm) {
          EXPECT_EQ(ntohl(rcv.imm_data), 0xabc00 + len);
        }
        const uint64_t d = kDst[k];
        for (uint32_t i = 0; i < 16; ++i) ASSERT_EQ(buf_[d + i], 0x5a) << len << " bytes, send " << k << ": byte " << i;
        for (uint32_t i = 0; i < len; ++i)
          ASSERT_EQ(buf_[d + 16 + i], static_cast<uint8_t>(0x11 + 3 * i)) << len << " bytes, send " << k << ": byte " << i;
        for (uint32_t i = 16 + len; i < 128; ++i)
          ASSERT_EQ(buf_[d + i], 0x5a) << len << " bytes, send " << k << ": byte " << i - 16;
      }
    }
}

// SENDs of every size class (in the completion, in the buffer within the
// push, larger), with and without immediate data, signaled or not, posted
// as one list once the caches are warm: every receive in the order posted,
// byte for byte, and only the signaled SENDs complete, in order.
TEST_F(SrqSmall, AListOfSendsOfEverySizeArrivesInOrder) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  constexpr uint64_t kSrc = 32768, kDst = 4096, kSlot = 2048;
  for (uint64_t i = kSrc; i < buf_.size(); ++i) buf_[i] = static_cast<uint8_t>(i * 11 + 7);
  const uint32_t sizes[] = {1, 8, 20, 21, 64, 65, 200, 1000, 2048, 16, 3, 40};
  constexpr size_t kN = std::size(sizes);
  for (size_t k = 0; k < kN; ++k) {
    std::memset(buf_.data() + kDst + k * kSlot, 0x5a, kSlot);
    ASSERT_EQ(post_srq(s, 100 + k, kDst + k * kSlot, kSlot), 0);
  }
  ibv_sge sge[kN];
  ibv_send_wr wr[kN]{};
  for (size_t k = 0; k < kN; ++k) {
    sge[k] = {reinterpret_cast<uint64_t>(buf_.data() + kSrc + 7 * k), sizes[k], mr_->lkey};
    wr[k].wr_id = 200 + k;
    wr[k].sg_list = &sge[k];
    wr[k].num_sge = 1;
    wr[k].opcode = k % 3 == 1 ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    wr[k].imm_data = htonl(0xabc00 + static_cast<uint32_t>(k));
    wr[k].send_flags = k % 2 == 1 || k + 1 == kN ? IBV_SEND_SIGNALED : 0;
    wr[k].next = k + 1 < kN ? &wr[k + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  ASSERT_EQ(ibv_post_send(c, wr, &bad), 0);
  for (size_t k = 0; k < kN; ++k) {
    if (!(wr[k].send_flags & IBV_SEND_SIGNALED)) continue;
    ibv_wc snd{};
    ASSERT_EQ(poll_n(ccq_, &snd, 1), 1) << "the send completion of SEND " << k;
    ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
    EXPECT_EQ(snd.wr_id, 200 + k) << "send completions in the order posted";
  }
  for (size_t k = 0; k < kN; ++k) {
    SCOPED_TRACE(k);
    ibv_wc rcv{};
    ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
    ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv);
    EXPECT_EQ(rcv.wr_id, 100 + k) << "receives taken in the order posted";
    EXPECT_EQ(rcv.byte_len, sizes[k]);
    const bool imm = k % 3 == 1;
    EXPECT_EQ((rcv.wc_flags & IBV_WC_WITH_IMM) != 0, imm);
    if (imm) {
      EXPECT_EQ(ntohl(rcv.imm_data), 0xabc00 + k);
    }
    const uint8_t* d = buf_.data() + kDst + k * kSlot;
    for (uint32_t i = 0; i < sizes[k]; ++i) ASSERT_EQ(d[i], buf_[kSrc + 7 * k + i]) << "byte " << i;
    for (uint64_t i = sizes[k]; i < kSlot; ++i) ASSERT_EQ(d[i], 0x5a) << "byte " << i << " past the message";
  }
  ibv_wc extra{};
  EXPECT_EQ(ibv_poll_cq(ccq_, 1, &extra), 0) << "an unsignaled SEND completed";
}

// ibv_post_srq_recv is thread-safe: receives posted to one SRQ by four
// threads at once are each taken exactly once, every one holding the SEND
// it took (bytes that travel in the completion, 8, and bytes the sender
// writes into the buffer, 40). (The SRQ's producers are serialized by a
// lock, and the ring's position moves with a plain store: without the lock
// two posts reserve one slot, and a WQE is lost or taken twice.)
TEST_F(SrqSmall, ReceivesPostedByFourThreadsAtOnceAreEachTakenOnce) {
  constexpr uint32_t kThreads = 4, kEach = 64, kDepth = kThreads * kEach, kSlot = 64, kDst = 8192;
  ibv_srq* s = make_srq(kDepth);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  for (uint32_t round = 0; round < 30; ++round) {
    const uint32_t len = round % 2 ? 40 : 8;
    std::atomic<int> failed{0};
    harness::all_at_once(kThreads, [&](uint32_t t) {
      for (uint32_t i = 0; i < kEach; ++i) {
        const uint32_t id = t * kEach + i;
        if (post_srq(s, id, kDst + uint64_t{id} * kSlot, kSlot) != 0) failed.fetch_add(1);
      }
    });
    ASSERT_EQ(failed.load(), 0) << "round " << round << ": a post failed with room in the SRQ";
    std::vector<bool> seen(kDepth, false);
    for (uint32_t k = 0; k < kDepth; ++k) {
      for (uint32_t i = 0; i < len; ++i) buf_[i] = static_cast<uint8_t>(round * 7 + k * 3 + i);
      ASSERT_EQ(send(c, k, 0, len), 0);
      ibv_wc w{};
      ASSERT_EQ(poll_n(ccq_, &w, 1), 1) << "round " << round << " send " << k;
      ASSERT_EQ(w.status, IBV_WC_SUCCESS) << str(w);
      ASSERT_EQ(poll_n(cq_, &w, 1), 1) << "round " << round << ": no receive for send " << k;
      ASSERT_EQ(w.status, IBV_WC_SUCCESS) << str(w);
      ASSERT_EQ(w.byte_len, len);
      ASSERT_LT(w.wr_id, kDepth);
      ASSERT_FALSE(seen[w.wr_id]) << "round " << round << ": receive " << w.wr_id << " taken twice";
      seen[w.wr_id] = true;
      const uint8_t* d = buf_.data() + kDst + w.wr_id * kSlot;
      for (uint32_t i = 0; i < len; ++i)
        ASSERT_EQ(d[i], static_cast<uint8_t>(round * 7 + k * 3 + i))
            << "round " << round << ": receive " << w.wr_id << " byte " << i << " is not send " << k << "'s";
    }
  }
}

// The design, seen from outside: a SEND of up to 20 bytes into an SRQ lands
// in its buffer when its completion is polled (its bytes came in the
// completion), the first of two in a row (after a receive was polled: an
// answer) as the second; a larger one lands before. (On the wire all would
// be in the buffer by the time the completion can be polled; the
// difference shows only to a reader that does not poll.)
TEST_F(SrqSmall, ASmallSendLandsWhenItsCompletionIsPolled) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  for (uint32_t i = 0; i < 64; ++i) buf_[32768 + i] = static_cast<uint8_t>(0x80 + i);
  for (const uint32_t len : {17u, 21u}) {
    std::memset(buf_.data() + 8192, 0, 512);
    ASSERT_EQ(post_srq(s, 3, 8192, 64), 0);
    ASSERT_EQ(post_srq(s, 5, 8192 + 256, 64), 0);
    for (int k = 0; k < 2; ++k) {
      ASSERT_EQ(send(c, 4, 32768, len), 0);
      ibv_wc snd{};
      ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
      ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
    }
    for (int k = 0; k < 2; ++k) {
      if (len <= 20)
        EXPECT_EQ(buf_[8192 + 256 * k], 0)
            << "send " << k << " of " << len << " bytes: written before its completion was polled";
      else
        EXPECT_EQ(buf_[8192 + 256 * k], 0x80)
            << "send " << k << ": too large to go in its completion, not written before it was polled";
    }
    for (int k = 0; k < 2; ++k) {
      ibv_wc rcv{};
      ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
      ASSERT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv);
      EXPECT_EQ(rcv.wr_id, k ? 5u : 3u);
      EXPECT_EQ(rcv.byte_len, len);
      for (uint32_t i = 0; i < len; ++i)
        ASSERT_EQ(buf_[8192 + 256 * k + i], 0x80 + i) << len << " bytes, send " << k << ": byte " << i;
    }
  }
}

// The receive completion of a small SEND that came in it outlives the QP it
// came to, as any completion does: polled after the QP's destruction, it
// still puts the bytes in and hands out the WQE.
TEST_F(SrqSmall, ASmallSendsCompletionOutlivesItsQp) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  for (uint32_t i = 0; i < 8; ++i) buf_[32768 + i] = static_cast<uint8_t>(0x30 + i);
  std::memset(buf_.data() + 8192, 0, 512);
  ASSERT_EQ(post_srq(s, 9, 8192, 64), 0);
  ASSERT_EQ(post_srq(s, 10, 8192 + 256, 64), 0);
  for (int k = 0; k < 2; ++k) {
    ASSERT_EQ(send(c, 4, 32768, 8), 0);
    ibv_wc snd{};
    ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
    ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
  }
  ASSERT_EQ(buf_[8192 + 256], 0) << "the second did not come in its completion";
  const uint32_t qpn = sv->qp_num;
  forget_qp(sv);
  ASSERT_EQ(ibv_destroy_qp(sv), 0);
  for (int k = 0; k < 2; ++k) {
    ibv_wc rcv{};
    ASSERT_EQ(poll_n(cq_, &rcv, 1), 1);
    EXPECT_EQ(rcv.status, IBV_WC_SUCCESS) << str(rcv);
    EXPECT_EQ(rcv.wr_id, 9u + k);
    EXPECT_EQ(rcv.qp_num, qpn);
    EXPECT_EQ(rcv.byte_len, 8u);
    for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(buf_[8192 + 256 * k + i], 0x30 + i) << "send " << k << ": byte " << i;
  }
}

// A small SEND's buffer is checked again when its completion is polled:
// deregistered since the message came, it is not written, and the WQE
// completes with IBV_WC_LOC_PROT_ERR (a receive buffer must stay
// registered until its WQE completes; the alternative would be a write into
// memory the application may have given back).
TEST_F(SrqSmall, ABufferDeregisteredBeforeThePollIsNotWritten) {
  ibv_srq* s = make_srq(16);
  ASSERT_NE(s, nullptr);
  ibv_qp *c, *sv;
  warm_pair(s, &c, &sv);
  if (HasFatalFailure()) return;
  std::vector<uint8_t> other(4096, 0x77);
  ibv_mr* mr2 = ibv_reg_mr(pd_, other.data(), other.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr2, nullptr);
  // The first message into a buffer of that MR fills the sender's cache of
  // its key (the general path, after a receive was polled: the bytes go into
  // the buffer); the second takes the leaf right after it (no receive
  // polled: its bytes come in its completion).
  ibv_sge sge[2] = {{reinterpret_cast<uint64_t>(other.data()) + 2048, 64, mr2->lkey},
                    {reinterpret_cast<uint64_t>(other.data()), 64, mr2->lkey}};
  ibv_recv_wr wr[2]{};
  for (int k = 0; k < 2; ++k) {
    wr[k].wr_id = 11 + k;
    wr[k].sg_list = &sge[k];
    wr[k].num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    ASSERT_EQ(ibv_post_srq_recv(s, &wr[k], &bad), 0);
  }
  for (uint32_t i = 0; i < 8; ++i) buf_[32768 + i] = static_cast<uint8_t>(0x30 + i);
  for (int k = 0; k < 2; ++k) {
    ibv_wc snd{};
    ASSERT_EQ(send(c, 4, 32768, 8), 0);
    ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
    ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
  }
  ASSERT_EQ(ibv_dereg_mr(mr2), 0);
  ibv_wc rcv[2]{};
  ASSERT_EQ(poll_n(cq_, &rcv[0], 1), 1);
  ASSERT_EQ(poll_n(cq_, &rcv[1], 1), 1);
  EXPECT_EQ(rcv[0].status, IBV_WC_SUCCESS) << str(rcv[0]);
  EXPECT_EQ(rcv[0].wr_id, 11u);
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(other[2048 + i], 0x30 + i) << "the first's byte " << i;
  EXPECT_EQ(rcv[1].status, IBV_WC_LOC_PROT_ERR) << str(rcv[1]);
  EXPECT_EQ(rcv[1].wr_id, 12u);
  for (int i = 0; i < 2048; ++i) ASSERT_EQ(other[i], 0x77) << "byte " << i << " of the second's buffer was written";
  // A responder error: the receiving QP is in the error state.
  ibv_qp_attr qa{};
  ibv_qp_init_attr qia{};
  ASSERT_EQ(ibv_query_qp(sv, &qa, IBV_QP_STATE, &qia), 0);
  EXPECT_EQ(qa.qp_state, IBV_QPS_ERR);
}

// Through ibv_start_poll / ibv_next_poll (a CQ without timestamps), a small
// SEND's bytes travel in its completion as through ibv_poll_cq: the poll puts
// them into the buffer, and the completion reads as any receive's.
TEST_F(SrqSmall, ThroughStartPollASmallSendArrivesWhole) {
  ibv_srq* s = nullptr;
  ibv_cq_ex* cqx = nullptr;
  ibv_qp *sv = nullptr, *c = nullptr;
  ASSERT_NO_FATAL_FAILURE(ex_pair(IBV_WC_STANDARD_FLAGS, &s, &cqx, &sv, &c));
  // Pairs of sends, the second polled with ibv_next_poll; the first pair
  // fills the sender's caches (the general path), the rest may take the leaf.
  for (uint32_t k = 0; k < 4; ++k) {
    const uint32_t len[2] = {5 + 4 * k, 6 + 4 * k};  // 5 to 18
    std::memset(buf_.data() + 8192, 0, 512);
    for (uint32_t j = 0; j < 2; ++j) ASSERT_EQ(post_srq(s, 40 + 2 * k + j, 8192 + 256 * j, 64), 0);
    for (uint32_t j = 0; j < 2; ++j) {
      ASSERT_EQ(send(c, 4 + j, 32768, len[j]), 0);
      ibv_wc snd{};
      ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
      ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
    }
    ibv_poll_cq_attr pa{};
    int rc = ENOENT;
    for (int i = 0; i < 10'000'000 && rc == ENOENT; ++i) rc = ibv_start_poll(cqx, &pa);
    ASSERT_EQ(rc, 0);
    for (uint32_t j = 0; j < 2; ++j) {
      if (j == 1) {
        rc = ENOENT;
        for (int i = 0; i < 10'000'000 && rc == ENOENT; ++i) rc = ibv_next_poll(cqx);
        ASSERT_EQ(rc, 0);
      }
      EXPECT_EQ(cqx->status, IBV_WC_SUCCESS);
      EXPECT_EQ(cqx->wr_id, 40u + 2 * k + j);
      EXPECT_EQ(ibv_wc_read_opcode(cqx), IBV_WC_RECV);
      EXPECT_EQ(ibv_wc_read_byte_len(cqx), len[j]);
      EXPECT_EQ(ibv_wc_read_qp_num(cqx), sv->qp_num);
      EXPECT_EQ(ibv_wc_read_src_qp(cqx), c->qp_num);
      EXPECT_EQ(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM, 0u);
    }
    ibv_end_poll(cqx);
    for (uint32_t j = 0; j < 2; ++j) {
      for (uint32_t i = 0; i < len[j]; ++i)
        ASSERT_EQ(buf_[8192 + 256 * j + i], 0x40 + i) << len[j] << " bytes: byte " << i;
      EXPECT_EQ(buf_[8192 + 256 * j + len[j]], 0);
    }
  }
  forget_qp(sv);
  ASSERT_EQ(ibv_destroy_qp(sv), 0);
  ASSERT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), 0);
}

// Into a receive CQ with completion timestamps, a small SEND's bytes go into
// the buffer before its completion (a timestamp fills the completion's last
// eight bytes): they arrive whole, and the completion has its stamp.
TEST_F(SrqSmall, IntoACqWithTimestampsTheBytesArriveWhole) {
  ibv_srq* s = nullptr;
  ibv_cq_ex* cqx = nullptr;
  ibv_qp *sv = nullptr, *c = nullptr;
  ASSERT_NO_FATAL_FAILURE(
      ex_pair(uint64_t{IBV_WC_STANDARD_FLAGS} | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP, &s, &cqx, &sv, &c));
  // The first fills the sender's caches (the general path), the rest may
  // take the leaf.
  for (uint32_t k = 0; k < 4; ++k) {
    const uint32_t len = 5 + 4 * k;  // 5 to 17
    std::memset(buf_.data() + 8192, 0, 64);
    ASSERT_EQ(post_srq(s, 20 + k, 8192, 64), 0);
    ASSERT_EQ(send(c, 4, 32768, len), 0);
    ibv_wc snd{};
    ASSERT_EQ(poll_n(ccq_, &snd, 1), 1);
    ASSERT_EQ(snd.status, IBV_WC_SUCCESS) << str(snd);
    ibv_poll_cq_attr pa{};
    int rc = ENOENT;
    for (int i = 0; i < 10'000'000 && rc == ENOENT; ++i) rc = ibv_start_poll(cqx, &pa);
    ASSERT_EQ(rc, 0);
    EXPECT_EQ(cqx->status, IBV_WC_SUCCESS);
    EXPECT_EQ(cqx->wr_id, 20u + k);
    EXPECT_EQ(ibv_wc_read_byte_len(cqx), len);
    EXPECT_NE(ibv_wc_read_completion_ts(cqx), 0u);
    ibv_end_poll(cqx);
    for (uint32_t i = 0; i < len; ++i) ASSERT_EQ(buf_[8192 + i], 0x40 + i) << len << " bytes: byte " << i;
    EXPECT_EQ(buf_[8192 + len], 0);
  }
  forget_qp(sv);
  ASSERT_EQ(ibv_destroy_qp(sv), 0);
  ASSERT_EQ(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), 0);
}

}  // namespace
