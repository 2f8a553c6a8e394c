// The verbs contract of receive work queues, indirection tables, PDs and CQs
// on shm0, in this process through the stock libibverbs (see the man pages
// ibv_create_wq, ibv_modify_wq, ibv_post_wq_recv, ibv_create_rwq_ind_table,
// ibv_alloc_pd, ibv_create_cq).
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "home.h"

HARNESS_TEST_ENVIRONMENT(.tag = "itest", .root_only = false);

namespace {

using harness::Home;

ibv_context* open_shm0() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) return nullptr;
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  return ctx;
}

struct Counts {
  int pd = -1, cq = -1, wq = -1, ind = -1;
  bool operator==(const Counts&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Counts& c) {
  return os << "{pd " << c.pd << ", cq " << c.cq << ", wq " << c.wq << ", rwq_ind_table " << c.ind << "}";
}

// This process's object counts as `shmrdma status --json` reports them. With
// several contexts open in this process, their counts are summed.
Counts status_counts() {
  Counts c{0, 0, 0, 0};
  nlohmann::json st = Home::get().status();
  bool found = false;
  for (const auto& d : st["devices"])
    for (const auto& p : d["processes"]) {
      if (p.value("pid", -1LL) != ::getpid()) continue;
      found = true;
      const auto& o = p["objects"];
      c.pd += o.value("pd", 0);
      c.cq += o.value("cq", 0);
      c.wq += o.value("wq", 0);
      c.ind += o.value("rwq_ind_table", 0);
    }
  if (!found) ADD_FAILURE() << "this process is not listed by shmrdma status:\n" << st.dump(2);
  return c;
}

class Verbs : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    ctx_ = open_shm0();
    ASSERT_NE(ctx_, nullptr) << "cannot open shm0: " << std::strerror(errno);
    ASSERT_EQ(ibv_query_device_ex(ctx_, nullptr, &attr_), 0);
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr) << std::strerror(errno);
    cq_ = ibv_create_cq(ctx_, 1024, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr) << std::strerror(errno);
  }

  void TearDown() override {
    if (!ctx_) return;
    for (auto it = inds_.rbegin(); it != inds_.rend(); ++it) EXPECT_EQ(ibv_destroy_rwq_ind_table(*it), 0);
    for (auto it = wqs_.rbegin(); it != wqs_.rend(); ++it) EXPECT_EQ(ibv_destroy_wq(*it), 0);
    for (auto it = cqs_.rbegin(); it != cqs_.rend(); ++it) EXPECT_EQ(ibv_destroy_cq(*it), 0);
    for (auto it = pds_.rbegin(); it != pds_.rend(); ++it) EXPECT_EQ(ibv_dealloc_pd(*it), 0);
    if (cq_) { EXPECT_EQ(ibv_destroy_cq(cq_), 0); }
    if (pd_) { EXPECT_EQ(ibv_dealloc_pd(pd_), 0); }
    for (ibv_context* c : others_) EXPECT_EQ(ibv_close_device(c), 0);
    EXPECT_EQ(ibv_close_device(ctx_), 0);
  }

  ibv_wq_init_attr wq_attr(uint32_t max_wr, uint32_t max_sge) {
    ibv_wq_init_attr a{};
    a.wq_type = IBV_WQT_RQ;
    a.max_wr = max_wr;
    a.max_sge = max_sge;
    a.pd = pd_;
    a.cq = cq_;
    return a;
  }

  // Creates a WQ that TearDown destroys.
  ibv_wq* make_wq(uint32_t max_wr = 16, uint32_t max_sge = 1, ibv_cq* cq = nullptr) {
    ibv_wq_init_attr a = wq_attr(max_wr, max_sge);
    if (cq) a.cq = cq;
    ibv_wq* wq = ibv_create_wq(ctx_, &a);
    EXPECT_NE(wq, nullptr) << "ibv_create_wq(" << max_wr << ", " << max_sge << "): " << std::strerror(errno);
    if (wq) wqs_.push_back(wq);
    return wq;
  }

  void forget_wq(ibv_wq* wq) { wqs_.erase(std::remove(wqs_.begin(), wqs_.end(), wq), wqs_.end()); }

  static int modify(ibv_wq* wq, uint32_t mask, ibv_wq_state next, ibv_wq_state curr = IBV_WQS_RESET) {
    ibv_wq_attr m{};
    m.attr_mask = mask;
    m.wq_state = next;
    m.curr_wq_state = curr;
    return ibv_modify_wq(wq, &m);
  }
  static int to_state(ibv_wq* wq, ibv_wq_state next) { return modify(wq, IBV_WQ_ATTR_STATE, next); }

  // Posts one receive with `num_sge` SGEs; returns the verb's result.
  int post(ibv_wq* wq, uint64_t wr_id, int num_sge = 1, ibv_recv_wr** bad_out = nullptr) {
    std::vector<ibv_sge> sges(std::max(num_sge, 1));
    for (auto& s : sges) s = ibv_sge{reinterpret_cast<uintptr_t>(buf_), sizeof buf_, 0};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = sges.data();
    wr.num_sge = num_sge;
    ibv_recv_wr* bad = nullptr;
    int rc = ibv_post_wq_recv(wq, &wr, &bad);
    if (rc) { EXPECT_EQ(bad, &wr) << "*bad_wr must point at the failed WR"; }
    if (bad_out) *bad_out = bad;
    return rc;
  }

  std::vector<ibv_wc> drain(ibv_cq* cq, int max = 100000) {
    std::vector<ibv_wc> out;
    std::vector<ibv_wc> wc(64);
    for (;;) {
      int n = ibv_poll_cq(cq, static_cast<int>(wc.size()), wc.data());
      EXPECT_GE(n, 0);
      if (n <= 0) break;
      out.insert(out.end(), wc.begin(), wc.begin() + n);
      if (static_cast<int>(out.size()) > max) break;
    }
    return out;
  }

  ibv_context* ctx_ = nullptr;
  ibv_device_attr_ex attr_{};
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::vector<ibv_wq*> wqs_;
  std::vector<ibv_cq*> cqs_;
  std::vector<ibv_pd*> pds_;
  std::vector<ibv_rwq_ind_table*> inds_;
  std::vector<ibv_context*> others_;
  char buf_[256] = {};
};

// ------------------------------------------------------------ ibv_create_wq

// The other objects `shmrdma status` lists: QPs, SRQs, MRs, memory windows
// (entries of the MR table, counted apart) and AHs, counted from the segment
// and the registry, and gone once destroyed.
TEST_F(Verbs, StatusCountsQpSrqMrMwAh) {
  auto objects = [] {
    nlohmann::json st = Home::get().status();
    for (const auto& d : st["devices"])
      for (const auto& p : d["processes"])
        if (p.value("pid", -1LL) == ::getpid()) return p["objects"];
    ADD_FAILURE() << "this process is not listed by shmrdma status:\n" << st.dump(2);
    return nlohmann::json{};
  };
  auto expect = [&](int qp, int srq, int mr, int mw, int ah) {
    nlohmann::json o = objects();
    EXPECT_EQ(o.value("qp", -1), qp) << o.dump();
    EXPECT_EQ(o.value("srq", -1), srq) << o.dump();
    EXPECT_EQ(o.value("mr", -1), mr) << o.dump();
    EXPECT_EQ(o.value("mw", -1), mw) << o.dump();
    EXPECT_EQ(o.value("ah", -1), ah) << o.dump();
  };
  expect(0, 0, 0, 0, 0);
  ibv_qp_init_attr qa{};
  qa.send_cq = cq_;
  qa.recv_cq = cq_;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {4, 4, 1, 1, 0};
  ibv_qp* qp = ibv_create_qp(pd_, &qa);
  ASSERT_NE(qp, nullptr) << std::strerror(errno);
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = 4;
  sa.attr.max_sge = 1;
  ibv_srq* srq = ibv_create_srq(pd_, &sa);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  std::vector<char> buf(4096);
  ibv_mr* mr = ibv_reg_mr(pd_, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  ibv_mw* mw = ibv_alloc_mw(pd_, IBV_MW_TYPE_1);
  ASSERT_NE(mw, nullptr) << std::strerror(errno);
  ibv_ah_attr aa{};
  aa.dlid = 1;
  aa.port_num = 1;
  ibv_ah* ah = ibv_create_ah(pd_, &aa);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);
  expect(1, 1, 1, 1, 1);
  EXPECT_EQ(ibv_destroy_ah(ah), 0);
  EXPECT_EQ(ibv_dealloc_mw(mw), 0);
  EXPECT_EQ(ibv_dereg_mr(mr), 0);
  EXPECT_EQ(ibv_destroy_srq(srq), 0);
  EXPECT_EQ(ibv_destroy_qp(qp), 0);
  expect(0, 0, 0, 0, 0);
}

TEST_F(Verbs, CreateWqMaxWrZeroIsEinval) {
  ibv_wq_init_attr a = wq_attr(0, 1);
  errno = 0;
  EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
}

TEST_F(Verbs, CreateWqMaxWrAboveDeviceMaxIsEinval) {
  uint32_t max = static_cast<uint32_t>(attr_.orig_attr.max_qp_wr);
  for (uint32_t v : {max + 1, max * 2, 0x80000001u, 0xffffffffu}) {
    ibv_wq_init_attr a = wq_attr(v, 1);
    errno = 0;
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr) << "max_wr " << v;
    EXPECT_EQ(errno, EINVAL) << "max_wr " << v;
  }
}

TEST_F(Verbs, CreateWqMaxSgeAboveDeviceMaxIsEinval) {
  uint32_t max = static_cast<uint32_t>(attr_.orig_attr.max_sge);
  for (uint32_t v : {max + 1, 0x80000001u, 0xffffffffu}) {
    ibv_wq_init_attr a = wq_attr(16, v);
    errno = 0;
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr) << "max_sge " << v;
    EXPECT_EQ(errno, EINVAL) << "max_sge " << v;
  }
}

TEST_F(Verbs, CreateWqRoundsMaxWr) {
  uint32_t max = static_cast<uint32_t>(attr_.orig_attr.max_qp_wr);
  struct Case { uint32_t req, want; };
  // The smallest ring has 2 entries; other sizes go up to a power of two.
  for (Case c : {Case{1, 2}, Case{2, 2}, Case{3, 4}, Case{5, 8}, Case{100, 128}, Case{128, 128},
                 Case{129, 256}, Case{max - 1, max}, Case{max, max}}) {
    ibv_wq_init_attr a = wq_attr(c.req, 1);
    ibv_wq* wq = ibv_create_wq(ctx_, &a);
    ASSERT_NE(wq, nullptr) << "max_wr " << c.req << ": " << std::strerror(errno);
    EXPECT_EQ(a.max_wr, c.want) << "max_wr " << c.req;
    EXPECT_GE(a.max_wr, c.req) << "handed back below the request";
    EXPECT_EQ(ibv_destroy_wq(wq), 0);
  }
}

TEST_F(Verbs, CreateWqRoundsMaxSge) {
  uint32_t max = static_cast<uint32_t>(attr_.orig_attr.max_sge);
  struct Case { uint32_t req, want; };
  for (Case c : {Case{0, 1}, Case{1, 1}, Case{2, 2}, Case{3, 4}, Case{max, max}}) {
    ibv_wq_init_attr a = wq_attr(16, c.req);
    ibv_wq* wq = ibv_create_wq(ctx_, &a);
    ASSERT_NE(wq, nullptr) << "max_sge " << c.req << ": " << std::strerror(errno);
    EXPECT_GE(a.max_sge, c.req) << "handed back below the request";
    EXPECT_EQ(a.max_sge, c.want) << "max_sge " << c.req;
    EXPECT_LE(a.max_sge, max);
    EXPECT_EQ(ibv_destroy_wq(wq), 0);
  }
}

TEST_F(Verbs, CreatedWqHasItsAttributes) {
  int ctx_tag = 0;
  ibv_wq_init_attr a = wq_attr(16, 2);
  a.wq_context = &ctx_tag;
  ibv_wq* w1 = ibv_create_wq(ctx_, &a);
  ASSERT_NE(w1, nullptr);
  wqs_.push_back(w1);
  EXPECT_EQ(w1->context, ctx_);
  EXPECT_EQ(w1->wq_context, &ctx_tag);
  EXPECT_EQ(w1->pd, pd_);
  EXPECT_EQ(w1->cq, cq_);
  EXPECT_EQ(w1->wq_type, IBV_WQT_RQ);
  EXPECT_EQ(w1->state, IBV_WQS_RESET);
  EXPECT_NE(w1->wq_num, 0u);
  EXPECT_LE(w1->wq_num, 0xffffffu) << "WQ numbers are 24-bit";
  ibv_wq* w2 = make_wq();
  ASSERT_NE(w2, nullptr);
  EXPECT_NE(w1->wq_num, w2->wq_num);
}

TEST_F(Verbs, CreateWqUnsupportedTypeIsEinval) {
  for (int t : {1, 2, 42}) {
    ibv_wq_init_attr a = wq_attr(16, 1);
    a.wq_type = static_cast<ibv_wq_type>(t);
    errno = 0;
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr) << "wq_type " << t;
    EXPECT_EQ(errno, EINVAL) << "wq_type " << t;
  }
}

TEST_F(Verbs, CreateWqCreateFlagsAreNotSupported) {
  for (uint32_t f : {uint32_t{IBV_WQ_FLAGS_CVLAN_STRIPPING}, uint32_t{IBV_WQ_FLAGS_SCATTER_FCS},
                     uint32_t{IBV_WQ_FLAGS_DELAY_DROP}, uint32_t{IBV_WQ_FLAGS_PCI_WRITE_END_PADDING}}) {
    ibv_wq_init_attr a = wq_attr(16, 1);
    a.comp_mask = IBV_WQ_INIT_ATTR_FLAGS;
    a.create_flags = f;
    errno = 0;
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr) << "create_flags " << f;
    EXPECT_EQ(errno, EOPNOTSUPP) << "create_flags " << f;
  }
  // The FLAGS bit with no flag set asks for nothing unsupported.
  ibv_wq_init_attr a = wq_attr(16, 1);
  a.comp_mask = IBV_WQ_INIT_ATTR_FLAGS;
  a.create_flags = 0;
  ibv_wq* wq = ibv_create_wq(ctx_, &a);
  ASSERT_NE(wq, nullptr) << std::strerror(errno);
  wqs_.push_back(wq);
}

TEST_F(Verbs, CreateWqUnknownCompMaskFails) {
  ibv_wq_init_attr a = wq_attr(16, 1);
  a.comp_mask = IBV_WQ_INIT_ATTR_RESERVED;
  errno = 0;
  EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
  EXPECT_TRUE(errno == EINVAL || errno == EOPNOTSUPP) << std::strerror(errno);
}

TEST_F(Verbs, CreateWqWithPdOrCqOfAnotherContextFails) {
  ibv_context* other = open_shm0();
  ASSERT_NE(other, nullptr);
  others_.push_back(other);
  ibv_pd* opd = ibv_alloc_pd(other);
  ASSERT_NE(opd, nullptr);
  ibv_cq* ocq = ibv_create_cq(other, 16, nullptr, nullptr, 0);
  ASSERT_NE(ocq, nullptr);
  ibv_wq_init_attr a = wq_attr(16, 1);
  a.pd = opd;
  errno = 0;
  EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  a = wq_attr(16, 1);
  a.cq = ocq;
  errno = 0;
  EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_destroy_cq(ocq), 0);
  EXPECT_EQ(ibv_dealloc_pd(opd), 0);
}

// ------------------------------------------------------------ ibv_modify_wq

TEST_F(Verbs, ModifyWithEmptyOrUnknownMaskIsEinval) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(modify(wq, 0, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_RESERVED, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_RESERVED, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | (1u << 17), IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(modify(wq, 0x80000000u, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(wq->state, IBV_WQS_RESET) << "a refused modify changed the state";
  EXPECT_EQ(post(wq, 1), EINVAL) << "a refused modify moved the WQ out of RESET";
}

TEST_F(Verbs, ModifyWithCurrentStateMismatchIsEinval) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE, IBV_WQS_RDY, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE, IBV_WQS_RDY, IBV_WQS_ERR), EINVAL);
  EXPECT_EQ(wq->state, IBV_WQS_RESET);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE, IBV_WQS_RDY, IBV_WQS_RESET), 0);
  EXPECT_EQ(wq->state, IBV_WQS_RDY);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE, IBV_WQS_ERR, IBV_WQS_RESET), EINVAL);
  EXPECT_EQ(wq->state, IBV_WQS_RDY);
  EXPECT_EQ(post(wq, 1), 0) << "a refused modify changed the WQ's state";
}

TEST_F(Verbs, ModifyToInvalidStateIsEinval) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(to_state(wq, IBV_WQS_UNKNOWN), EINVAL);
  EXPECT_EQ(to_state(wq, static_cast<ibv_wq_state>(7)), EINVAL);
  EXPECT_EQ(wq->state, IBV_WQS_RESET);
}

TEST_F(Verbs, RdyResetRdyWorks) {
  ibv_wq* wq = make_wq(4, 1);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  EXPECT_EQ(wq->state, IBV_WQS_RDY);
  EXPECT_EQ(to_state(wq, IBV_WQS_RDY), 0) << "RDY->RDY";
  for (int i = 0; i < 4; ++i) ASSERT_EQ(post(wq, 100 + i), 0);
  EXPECT_EQ(post(wq, 104), ENOMEM);
  ASSERT_EQ(to_state(wq, IBV_WQS_RESET), 0);
  EXPECT_EQ(wq->state, IBV_WQS_RESET);
  EXPECT_EQ(post(wq, 1), EINVAL) << "posting in RESET";
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  EXPECT_EQ(wq->state, IBV_WQS_RDY);
  // RESET discarded what was posted: the full ring is available again, and
  // nothing was completed.
  for (int i = 0; i < 4; ++i) EXPECT_EQ(post(wq, 200 + i), 0) << "post #" << i << " after RDY->RESET->RDY";
  EXPECT_EQ(post(wq, 204), ENOMEM);
  EXPECT_TRUE(drain(cq_).empty()) << "RESET must not complete the discarded receives";
}

TEST_F(Verbs, ErrToRdyIsEinval) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  EXPECT_EQ(wq->state, IBV_WQS_ERR);
  EXPECT_EQ(to_state(wq, IBV_WQS_RDY), EINVAL);
  EXPECT_EQ(wq->state, IBV_WQS_ERR);
  // The way out of ERR is through RESET.
  EXPECT_EQ(to_state(wq, IBV_WQS_RESET), 0);
  EXPECT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  EXPECT_EQ(post(wq, 1), 0);
}

TEST_F(Verbs, ResetToErrWorks) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  EXPECT_EQ(wq->state, IBV_WQS_ERR);
}

TEST_F(Verbs, ModifyCurrStateOnlyKeepsState) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_CURR_STATE, IBV_WQS_RDY, IBV_WQS_RESET), 0);
  EXPECT_EQ(wq->state, IBV_WQS_RESET);
  EXPECT_EQ(modify(wq, IBV_WQ_ATTR_CURR_STATE, IBV_WQS_RDY, IBV_WQS_RDY), EINVAL);
}

// -------------------------------------------------------- ibv_post_wq_recv

TEST_F(Verbs, PostInResetIsEinval) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(post(wq, 1, 1, &bad), EINVAL);
  EXPECT_NE(bad, nullptr);
}

TEST_F(Verbs, PostWithTooManySgesIsEinval) {
  ibv_wq_init_attr a = wq_attr(8, 2);
  ibv_wq* wq = ibv_create_wq(ctx_, &a);
  ASSERT_NE(wq, nullptr);
  wqs_.push_back(wq);
  ASSERT_EQ(a.max_sge, 2u);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  EXPECT_EQ(post(wq, 1, 3), EINVAL);
  EXPECT_EQ(post(wq, 2, -1), EINVAL) << "negative num_sge";
  EXPECT_EQ(post(wq, 3, 2), 0);
  EXPECT_EQ(post(wq, 4, 0), 0) << "a receive with no SGE";

  // In a chain, the WRs before the bad one are posted and *bad_wr points at
  // the bad one; the ones after it are not posted.
  ibv_sge sg[3];
  for (auto& s : sg) s = ibv_sge{reinterpret_cast<uintptr_t>(buf_), 16, 0};
  ibv_recv_wr w[3] = {};
  w[0].wr_id = 10;
  w[0].sg_list = sg;
  w[0].num_sge = 1;
  w[0].next = &w[1];
  w[1].wr_id = 11;
  w[1].sg_list = sg;
  w[1].num_sge = 3;
  w[1].next = &w[2];
  w[2].wr_id = 12;
  w[2].sg_list = sg;
  w[2].num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(ibv_post_wq_recv(wq, w, &bad), EINVAL);
  EXPECT_EQ(bad, &w[1]);

  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  std::vector<ibv_wc> wc = drain(cq_);
  std::vector<uint64_t> ids;
  for (const auto& c : wc) ids.push_back(c.wr_id);
  EXPECT_EQ(ids, (std::vector<uint64_t>{3, 4, 10})) << "exactly the accepted receives are flushed";
}

TEST_F(Verbs, PostBeyondCapacityIsEnomemWithBadWr) {
  ibv_wq* wq = make_wq(100, 3);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  for (int i = 0; i < 128; ++i) ASSERT_EQ(post(wq, i), 0) << "post #" << i + 1 << " of 128";
  ibv_recv_wr* bad = nullptr;
  EXPECT_EQ(post(wq, 128, 1, &bad), ENOMEM);
  // A chain on a full queue fails at its head.
  ibv_sge sg{reinterpret_cast<uintptr_t>(buf_), 16, 0};
  ibv_recv_wr w[2] = {};
  w[0].sg_list = w[1].sg_list = &sg;
  w[0].num_sge = w[1].num_sge = 1;
  w[0].next = &w[1];
  EXPECT_EQ(ibv_post_wq_recv(wq, w, &bad), ENOMEM);
  EXPECT_EQ(bad, &w[0]);
}

TEST_F(Verbs, ErrFlushesPostedReceivesInOrder) {
  // 300 receives: more than the provider polls in one batch.
  ibv_cq* cq = ibv_create_cq(ctx_, 512, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_wq* wq = make_wq(300, 1, cq);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  for (uint64_t i = 0; i < 300; ++i) ASSERT_EQ(post(wq, 0xabc00000 + i * 7), 0);
  EXPECT_EQ(ibv_poll_cq(cq, 16, std::vector<ibv_wc>(16).data()), 0) << "completions before the flush";
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);

  std::vector<ibv_wc> wc(400);
  int n = ibv_poll_cq(cq, 400, wc.data());
  ASSERT_EQ(n, 300);
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE("completion #" + std::to_string(i));
    EXPECT_EQ(wc[i].wr_id, 0xabc00000 + uint64_t(i) * 7);
    EXPECT_EQ(wc[i].status, IBV_WC_WR_FLUSH_ERR) << ibv_wc_status_str(wc[i].status);
    EXPECT_EQ(wc[i].opcode, IBV_WC_RECV);
    EXPECT_EQ(wc[i].qp_num, wq->wq_num);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_EQ(ibv_poll_cq(cq, 400, wc.data()), 0) << "each receive is flushed once";
  // Flushed receives leave the queue: after RESET->RDY it holds 512 again.
  ASSERT_EQ(to_state(wq, IBV_WQS_RESET), 0);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  for (int i = 0; i < 512; ++i) ASSERT_EQ(post(wq, i), 0) << "post #" << i;
}

TEST_F(Verbs, FlushGoesToTheWqsOwnCq) {
  ibv_cq* cq2 = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
  ASSERT_NE(cq2, nullptr);
  cqs_.push_back(cq2);
  ibv_wq* a = make_wq(8, 1, cq_);
  ibv_wq* b = make_wq(8, 1, cq2);
  ASSERT_TRUE(a && b);
  ASSERT_EQ(to_state(a, IBV_WQS_RDY), 0);
  ASSERT_EQ(to_state(b, IBV_WQS_RDY), 0);
  ASSERT_EQ(post(a, 1), 0);
  ASSERT_EQ(post(b, 2), 0);
  ASSERT_EQ(post(b, 3), 0);
  ASSERT_EQ(to_state(b, IBV_WQS_ERR), 0);
  EXPECT_TRUE(drain(cq_).empty()) << "flushing WQ b completed on WQ a's CQ";
  auto wc = drain(cq2);
  ASSERT_EQ(wc.size(), 2u);
  EXPECT_EQ(wc[0].wr_id, 2u);
  EXPECT_EQ(wc[1].wr_id, 3u);
  for (auto& c : wc) EXPECT_EQ(c.qp_num, b->wq_num);
}

TEST_F(Verbs, PostInErrCompletesWithFlushError) {
  ibv_wq* wq = make_wq();
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  ASSERT_EQ(post(wq, 77), 0);
  auto wc = drain(cq_);
  ASSERT_EQ(wc.size(), 1u);
  EXPECT_EQ(wc[0].wr_id, 77u);
  EXPECT_EQ(wc[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(wc[0].opcode, IBV_WC_RECV);
}

// Flushing more receives than the CQ holds overruns it: the completions
// that fit are delivered in order, and the overrun is reported once as an
// IBV_EVENT_CQ_ERR naming that CQ.
TEST_F(Verbs, FlushIntoFullCqRaisesCqErrOnce) {
  ibv_cq* small = ibv_create_cq(ctx_, 2, nullptr, nullptr, 0);
  ASSERT_NE(small, nullptr);
  cqs_.push_back(small);
  ASSERT_GE(small->cqe, 2);
  const int over = small->cqe + 6;
  ibv_wq* wq = make_wq(static_cast<uint32_t>(over), 1, small);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  for (int i = 0; i < over; ++i) ASSERT_EQ(post(wq, 500 + i), 0);
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  auto wc = drain(small);
  ASSERT_EQ(wc.size(), static_cast<size_t>(small->cqe));
  for (size_t i = 0; i < wc.size(); ++i) EXPECT_EQ(wc[i].wr_id, 500 + i);

  pollfd p{ctx_->async_fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1) << "no async event after a CQ overrun";
  ibv_async_event ev{};
  ASSERT_EQ(ibv_get_async_event(ctx_, &ev), 0);
  EXPECT_EQ(ev.event_type, IBV_EVENT_CQ_ERR) << ibv_event_type_str(ev.event_type);
  if (ev.event_type == IBV_EVENT_CQ_ERR) {
    EXPECT_EQ(ev.element.cq, small);
  }
  ibv_ack_async_event(&ev);
  p.revents = 0;
  EXPECT_EQ(::poll(&p, 1, 200), 0) << "the overrun was reported more than once";
}

TEST_F(Verbs, PollCqArguments) {
  ibv_wc wc{};
  EXPECT_EQ(ibv_poll_cq(cq_, 0, &wc), 0);
  EXPECT_EQ(ibv_poll_cq(cq_, 1, &wc), 0) << "an empty CQ";
  EXPECT_LT(ibv_poll_cq(cq_, -1, &wc), 0);
}

// ------------------------------------------------- ibv_create_rwq_ind_table

TEST_F(Verbs, IndTableSizes) {
  uint32_t max = attr_.rss_caps.max_rwq_indirection_table_size;
  ASSERT_GE(max, 1u);
  uint32_t log_max = 0;
  while ((2u << log_max) <= max) ++log_max;
  ibv_wq* w = make_wq();
  ASSERT_NE(w, nullptr);
  std::vector<ibv_wq*> tbl(2 * max + 2, w);

  // Largest allowed size works.
  ibv_rwq_ind_table_init_attr ia{};
  ia.log_ind_tbl_size = log_max;
  ia.ind_tbl = tbl.data();
  ibv_rwq_ind_table* t = ibv_create_rwq_ind_table(ctx_, &ia);
  ASSERT_NE(t, nullptr) << "log size " << log_max << ": " << std::strerror(errno);
  EXPECT_EQ(t->context, ctx_);
  EXPECT_EQ(ibv_destroy_rwq_ind_table(t), 0);

  for (uint32_t log : {log_max + 1, log_max + 2, 31u, 32u, 0xffffffffu}) {
    ia.log_ind_tbl_size = log;
    errno = 0;
    EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr) << "log size " << log;
    EXPECT_EQ(errno, EINVAL) << "log size " << log;
  }
  // One WQ (log size 0).
  ia.log_ind_tbl_size = 0;
  t = ibv_create_rwq_ind_table(ctx_, &ia);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(ibv_destroy_rwq_ind_table(t), 0);
}

TEST_F(Verbs, IndTableOverAnotherContextsWqIsEinval) {
  ibv_context* other = open_shm0();
  ASSERT_NE(other, nullptr);
  others_.push_back(other);
  ibv_pd* opd = ibv_alloc_pd(other);
  ibv_cq* ocq = ibv_create_cq(other, 16, nullptr, nullptr, 0);
  ASSERT_TRUE(opd && ocq);
  ibv_wq_init_attr a{};
  a.wq_type = IBV_WQT_RQ;
  a.max_wr = 4;
  a.max_sge = 1;
  a.pd = opd;
  a.cq = ocq;
  ibv_wq* foreign = ibv_create_wq(other, &a);
  ASSERT_NE(foreign, nullptr);
  ibv_wq* mine = make_wq();
  ASSERT_NE(mine, nullptr);
  Counts before = status_counts();

  ibv_wq* tbl[2] = {mine, foreign};
  ibv_rwq_ind_table_init_attr ia{};
  ia.log_ind_tbl_size = 1;
  ia.ind_tbl = tbl;
  errno = 0;
  EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_wq* only_foreign[1] = {foreign};
  ia.log_ind_tbl_size = 0;
  ia.ind_tbl = only_foreign;
  errno = 0;
  EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(status_counts(), before) << "a refused table left an object behind";
  // The failed attempts took no reference: both WQs can go.
  EXPECT_EQ(ibv_destroy_wq(foreign), 0);
  EXPECT_EQ(ibv_destroy_cq(ocq), 0);
  EXPECT_EQ(ibv_dealloc_pd(opd), 0);
}

TEST_F(Verbs, IndTableWithNullEntryOrCompMaskIsEinval) {
  ibv_wq* w = make_wq();
  ASSERT_NE(w, nullptr);
  ibv_wq* tbl[2] = {w, nullptr};
  ibv_rwq_ind_table_init_attr ia{};
  ia.log_ind_tbl_size = 1;
  ia.ind_tbl = tbl;
  errno = 0;
  EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr);
  EXPECT_EQ(errno, EINVAL);
  tbl[1] = w;
  ia.comp_mask = IBV_CREATE_IND_TABLE_RESERVED;
  errno = 0;
  EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr);
  EXPECT_TRUE(errno == EINVAL || errno == EOPNOTSUPP) << std::strerror(errno);
  // A WQ refused in a table is not held by it.
  forget_wq(w);
  EXPECT_EQ(ibv_destroy_wq(w), 0);
}

TEST_F(Verbs, WqInIndTableIsBusyUntilTableGoes) {
  ibv_wq* a = make_wq();
  ibv_wq* b = make_wq();
  ASSERT_TRUE(a && b);
  ibv_wq* tbl[4] = {a, b, a, a};  // one WQ may appear several times
  ibv_rwq_ind_table_init_attr ia{};
  ia.log_ind_tbl_size = 2;
  ia.ind_tbl = tbl;
  ibv_rwq_ind_table* t1 = ibv_create_rwq_ind_table(ctx_, &ia);
  ASSERT_NE(t1, nullptr);
  ia.log_ind_tbl_size = 0;
  ibv_rwq_ind_table* t2 = ibv_create_rwq_ind_table(ctx_, &ia);  // {a}
  ASSERT_NE(t2, nullptr);
  EXPECT_NE(t1->ind_tbl_num, t2->ind_tbl_num);

  EXPECT_EQ(ibv_destroy_wq(a), EBUSY);
  EXPECT_EQ(ibv_destroy_wq(b), EBUSY);
  EXPECT_EQ(ibv_destroy_rwq_ind_table(t1), 0);
  EXPECT_EQ(ibv_destroy_wq(b), 0);
  forget_wq(b);
  EXPECT_EQ(ibv_destroy_wq(a), EBUSY) << "still in the second table";
  EXPECT_EQ(ibv_destroy_rwq_ind_table(t2), 0);
  EXPECT_EQ(ibv_destroy_wq(a), 0);
  forget_wq(a);
  EXPECT_EQ(status_counts(), (Counts{1, 1, 0, 0}));
}

// ------------------------------------------- PD and CQ lifetime, EBUSY

TEST_F(Verbs, DeallocPdBusyWhileWqUsesIt) {
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd, nullptr);
  ibv_wq_init_attr a = wq_attr(16, 1);
  a.pd = pd;
  ibv_wq* w1 = ibv_create_wq(ctx_, &a);
  ibv_wq* w2 = ibv_create_wq(ctx_, &a);
  ASSERT_TRUE(w1 && w2);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY);
  EXPECT_EQ(ibv_destroy_wq(w1), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "one WQ still uses it";
  EXPECT_EQ(ibv_destroy_wq(w2), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

TEST_F(Verbs, DestroyCqBusyWhileWqUsesIt) {
  ibv_cq* cq = ibv_create_cq(ctx_, 16, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  ibv_wq* w = make_wq(16, 1, cq);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(ibv_destroy_cq(cq), EBUSY);
  EXPECT_EQ(ibv_destroy_wq(w), 0);
  forget_wq(w);
  EXPECT_EQ(ibv_destroy_cq(cq), 0);
}

TEST_F(Verbs, DeallocPdWithoutUsersWorks) {
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd, nullptr);
  EXPECT_EQ(pd->context, ctx_);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
}

// ------------------------------------------------------------ ibv_create_cq

TEST_F(Verbs, CreateCqArguments) {
  int max = attr_.orig_attr.max_cqe;
  for (int bad : {0, -1, max + 1, 0x7fffffff}) {
    errno = 0;
    EXPECT_EQ(ibv_create_cq(ctx_, bad, nullptr, nullptr, 0), nullptr) << "cqe " << bad;
    EXPECT_EQ(errno, EINVAL) << "cqe " << bad;
  }
  errno = 0;
  EXPECT_EQ(ibv_create_cq(ctx_, 16, nullptr, nullptr, ctx_->num_comp_vectors), nullptr)
      << "comp_vector out of range";
  EXPECT_EQ(errno, EINVAL);
  for (int want : {1, 2, 3, 100, 1000, max}) {
    ibv_cq* cq = ibv_create_cq(ctx_, want, nullptr, nullptr, 0);
    ASSERT_NE(cq, nullptr) << "cqe " << want << ": " << std::strerror(errno);
    EXPECT_GE(cq->cqe, want);
    EXPECT_LE(cq->cqe, max) << "cqe " << want;
    EXPECT_EQ(cq->context, ctx_);
    EXPECT_EQ(ibv_destroy_cq(cq), 0);
  }
}

TEST_F(Verbs, CqHoldsItsCqeCompletions) {
  // A CQ created for N entries holds N completions: flush N receives into it.
  ibv_cq* cq = ibv_create_cq(ctx_, 100, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_wq* wq = make_wq(static_cast<uint32_t>(cq->cqe), 1, cq);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  for (int i = 0; i < cq->cqe; ++i) ASSERT_EQ(post(wq, i), 0);
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  EXPECT_EQ(drain(cq).size(), static_cast<size_t>(cq->cqe));
}

// ----------------------------------------- failed creates leave nothing

TEST_F(Verbs, FailedCreatesLeaveNoObjectBehind) {
  ibv_wq* w = make_wq();
  ASSERT_NE(w, nullptr);
  Counts before = status_counts();
  ASSERT_EQ(before, (Counts{1, 1, 1, 0}));
  for (int round = 0; round < 50; ++round) {
    ibv_wq_init_attr a = wq_attr(0, 1);
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
    a = wq_attr(1u << 30, 1);
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
    a = wq_attr(16, 1000);
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
    a = wq_attr(16, 1);
    a.wq_type = static_cast<ibv_wq_type>(3);
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
    a = wq_attr(16, 1);
    a.comp_mask = IBV_WQ_INIT_ATTR_FLAGS;
    a.create_flags = IBV_WQ_FLAGS_SCATTER_FCS;
    EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr);
    EXPECT_EQ(ibv_create_cq(ctx_, 0, nullptr, nullptr, 0), nullptr);
    EXPECT_EQ(ibv_create_cq(ctx_, attr_.orig_attr.max_cqe + 1, nullptr, nullptr, 0), nullptr);
    std::vector<ibv_wq*> tbl(256, w);
    ibv_rwq_ind_table_init_attr ia{};
    ia.log_ind_tbl_size = 8;
    ia.ind_tbl = tbl.data();
    EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr);
  }
  EXPECT_EQ(status_counts(), before);
  // The WQ named in the refused tables was not pinned by them.
  forget_wq(w);
  EXPECT_EQ(ibv_destroy_wq(w), 0);
  EXPECT_EQ(status_counts(), (Counts{1, 1, 0, 0}));
}

// The device limits are reachable exactly, the next object is refused, and
// freeing one makes room for one more. (The fixture holds one PD and one CQ.)
TEST_F(Verbs, PdLimitIsExact) {
  int max = attr_.orig_attr.max_pd;
  ASSERT_GT(max, 1);
  for (int i = 1; i < max; ++i) {
    ibv_pd* pd = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd, nullptr) << "PD #" << i + 1 << " of max_pd " << max << ": " << std::strerror(errno);
    pds_.push_back(pd);
  }
  errno = 0;
  EXPECT_EQ(ibv_alloc_pd(ctx_), nullptr) << "PD beyond max_pd";
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(status_counts().pd, max);
  EXPECT_EQ(ibv_dealloc_pd(pds_.back()), 0);
  pds_.pop_back();
  ibv_pd* again = ibv_alloc_pd(ctx_);
  ASSERT_NE(again, nullptr) << "freeing a PD did not make room: " << std::strerror(errno);
  pds_.push_back(again);
}

TEST_F(Verbs, CqLimitIsExact) {
  int max = attr_.orig_attr.max_cq;
  ASSERT_GT(max, 1);
  for (int i = 1; i < max; ++i) {
    ibv_cq* cq = ibv_create_cq(ctx_, 1, nullptr, nullptr, 0);
    ASSERT_NE(cq, nullptr) << "CQ #" << i + 1 << " of max_cq " << max << ": " << std::strerror(errno);
    cqs_.push_back(cq);
  }
  errno = 0;
  EXPECT_EQ(ibv_create_cq(ctx_, 1, nullptr, nullptr, 0), nullptr) << "CQ beyond max_cq";
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(status_counts().cq, max);
}

TEST_F(Verbs, WqAndIndTableLimitsAreExact) {
  uint32_t max_wq = attr_.max_wq_type_rq;
  ASSERT_GT(max_wq, 1u);
  // Failures first: they must not use up the budget.
  for (int i = 0; i < 100; ++i) {
    ibv_wq_init_attr a = wq_attr(0, 1);
    ASSERT_EQ(ibv_create_wq(ctx_, &a), nullptr);
  }
  for (uint32_t i = 0; i < max_wq; ++i) {
    ibv_wq* w = make_wq(1, 1);
    ASSERT_NE(w, nullptr) << "WQ #" << i + 1 << " of max_wq_type_rq " << max_wq;
  }
  ibv_wq_init_attr a = wq_attr(1, 1);
  errno = 0;
  EXPECT_EQ(ibv_create_wq(ctx_, &a), nullptr) << "WQ beyond max_wq_type_rq";
  EXPECT_EQ(errno, ENOMEM);
  std::set<uint32_t> nums;
  for (ibv_wq* w : wqs_) nums.insert(w->wq_num);
  EXPECT_EQ(nums.size(), wqs_.size()) << "WQ numbers repeat";

  uint32_t max_ind = attr_.rss_caps.max_rwq_indirection_tables;
  ASSERT_GT(max_ind, 1u);
  for (uint32_t i = 0; i < max_ind; ++i) {
    ibv_wq* one[1] = {wqs_[i % wqs_.size()]};
    ibv_rwq_ind_table_init_attr ia{};
    ia.log_ind_tbl_size = 0;
    ia.ind_tbl = one;
    ibv_rwq_ind_table* t = ibv_create_rwq_ind_table(ctx_, &ia);
    ASSERT_NE(t, nullptr) << "table #" << i + 1 << " of " << max_ind << ": " << std::strerror(errno);
    inds_.push_back(t);
  }
  ibv_wq* one[1] = {wqs_[0]};
  ibv_rwq_ind_table_init_attr ia{};
  ia.ind_tbl = one;
  errno = 0;
  EXPECT_EQ(ibv_create_rwq_ind_table(ctx_, &ia), nullptr) << "table beyond max_rwq_indirection_tables";
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(status_counts(), (Counts{1, 1, static_cast<int>(max_wq), static_cast<int>(max_ind)}));
}

// Several threads post to one WQ at once: every receive is accepted exactly
// once up to the capacity, and the flush returns each wr_id exactly once.
TEST_F(Verbs, ConcurrentPostersFillTheQueueExactly) {
  constexpr int kThreads = 4;
  ibv_cq* cq = ibv_create_cq(ctx_, 4096, nullptr, nullptr, 0);
  ASSERT_NE(cq, nullptr);
  cqs_.push_back(cq);
  ibv_wq* wq = make_wq(2048, 1, cq);
  ASSERT_NE(wq, nullptr);
  ASSERT_EQ(to_state(wq, IBV_WQS_RDY), 0);
  std::vector<std::vector<uint64_t>> accepted(kThreads);
  std::vector<int> other_errors(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ibv_sge sg{reinterpret_cast<uintptr_t>(buf_), 16, 0};
      for (uint64_t i = 0; i < 1024; ++i) {
        ibv_recv_wr wr{};
        wr.wr_id = (uint64_t(t) << 32) | i;
        wr.sg_list = &sg;
        wr.num_sge = 1;
        ibv_recv_wr* bad = nullptr;
        int rc = ibv_post_wq_recv(wq, &wr, &bad);
        if (rc == 0) accepted[t].push_back(wr.wr_id);
        else if (rc != ENOMEM) ++other_errors[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  size_t total = 0;
  for (int t = 0; t < kThreads; ++t) {
    total += accepted[t].size();
    EXPECT_EQ(other_errors[t], 0) << "thread " << t << " got errors other than ENOMEM";
  }
  EXPECT_EQ(total, 2048u) << "4 x 1024 posts into a queue of 2048";
  ASSERT_EQ(to_state(wq, IBV_WQS_ERR), 0);
  std::vector<ibv_wc> wc = drain(cq);
  ASSERT_EQ(wc.size(), total);
  // Per thread, completions come back in that thread's posting order.
  std::vector<std::vector<uint64_t>> seen(kThreads);
  for (const auto& c : wc) {
    int t = static_cast<int>(c.wr_id >> 32);
    ASSERT_LT(t, kThreads);
    seen[t].push_back(c.wr_id);
    EXPECT_EQ(c.status, IBV_WC_WR_FLUSH_ERR);
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(seen[t], accepted[t]) << "thread " << t;
}

// Closing a context with objects still in it frees them all.
TEST(Lifecycle, CloseWithLiveObjectsCleansUp) {
  HARNESS_REQUIRE_DEVICE();
  ibv_context* ctx = open_shm0();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  ASSERT_TRUE(pd && cq);
  ibv_wq_init_attr a{};
  a.wq_type = IBV_WQT_RQ;
  a.max_wr = 32;
  a.max_sge = 1;
  a.pd = pd;
  a.cq = cq;
  ibv_wq* wq = ibv_create_wq(ctx, &a);
  ASSERT_NE(wq, nullptr);
  ibv_wq* tbl[1] = {wq};
  ibv_rwq_ind_table_init_attr ia{};
  ia.ind_tbl = tbl;
  ASSERT_NE(ibv_create_rwq_ind_table(ctx, &ia), nullptr);
  EXPECT_EQ(status_counts(), (Counts{1, 1, 1, 1}));
  EXPECT_EQ(harness::Home::get().ctx_segments().size(), 1u) << harness::join(harness::Home::get().ctx_files());
  EXPECT_EQ(ibv_close_device(ctx), 0);
  // Checked before `status`, which would sweep a leftover segment.
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "ibv_close_device left context files behind: " << harness::join(harness::Home::get().ctx_files());
  nlohmann::json st = Home::get().status();
  EXPECT_TRUE(Home::find_process(st, ::getpid()).is_null()) << st.dump(2);
  // Their share of the device limits is free again.
  ctx = open_shm0();
  ASSERT_NE(ctx, nullptr);
  ibv_device_attr_ex attr{};
  ASSERT_EQ(ibv_query_device_ex(ctx, nullptr, &attr), 0);
  std::vector<ibv_pd*> pds;
  for (int i = 0; i < attr.orig_attr.max_pd; ++i) {
    ibv_pd* p = ibv_alloc_pd(ctx);
    ASSERT_NE(p, nullptr) << "PD #" << i + 1 << ": " << std::strerror(errno);
    pds.push_back(p);
  }
  for (ibv_pd* p : pds) EXPECT_EQ(ibv_dealloc_pd(p), 0);
  EXPECT_EQ(ibv_close_device(ctx), 0);
}

// Everything a test created is gone once it closed its context.
TEST(Lifecycle, ClosingTheContextRemovesItFromStatus) {
  HARNESS_REQUIRE_DEVICE();
  ibv_context* ctx = open_shm0();
  ASSERT_NE(ctx, nullptr);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ASSERT_NE(pd, nullptr);
  EXPECT_EQ(status_counts(), (Counts{1, 0, 0, 0}));
  EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  EXPECT_EQ(ibv_close_device(ctx), 0);
  // Checked before `status`, which would sweep a leftover segment.
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "ibv_close_device left context files behind: " << harness::join(harness::Home::get().ctx_files());
  nlohmann::json st = Home::get().status();
  EXPECT_TRUE(Home::find_process(st, ::getpid()).is_null()) << st.dump(2);
}

}  // namespace
