// SPDX-License-Identifier: MIT
//
// Unit tests for src/context.h (context.cc, pd.cc, cq.cc, wq.cc): the object
// tables of one open context, their reference rules, the WQ state machine,
// posting and flushing receive WQEs, the read-only inspection of a segment,
// heap exhaustion and device-wide accounting across contexts.

#include "context.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "device_setup.h"
#include "proc.h"

namespace shmrdma {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kHeap = 16ull << 20;

std::string unique_name() {
  static std::atomic<int> n{0};
  return "ut" + std::to_string(::getpid()) + "c" + std::to_string(n++);
}

class ContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shmrdma-ut-ctx-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    home_ = tmpl;
    name_ = unique_name();
    UpResult up;
    std::string why;
    ASSERT_EQ(device_up(home_, name_, 1, &up, &why), 0) << why;
    paths_ = device_paths(home_, name_);
    ASSERT_EQ(LocalContext::open(paths_, kHeap, &ctx_), 0);
    ASSERT_NE(ctx_, nullptr);
  }
  void TearDown() override {
    ctx_.reset();
    std::string why;
    device_down(home_, name_, true, &why);
    fs::remove_all(home_);
  }

  // Our registry slot, found by segment file name.
  bool my_info(LocalContext& c, ContextInfo* out) {
    std::string seg = fs::path(c.segment_path()).filename();
    for (auto& i : c.registry().live_contexts())
      if (i.segment == seg) {
        *out = i;
        return true;
      }
    return false;
  }
  ContextObjects inspect(LocalContext& c) {
    ContextInfo info{};
    ContextObjects o;
    EXPECT_TRUE(my_info(c, &info));
    EXPECT_EQ(inspect_context(paths_, info, &o), 0);
    return o;
  }
  uint32_t held(LocalContext& c, layout::ObjKind k) {
    ContextInfo info{};
    EXPECT_TRUE(my_info(c, &info));
    return info.held[k];
  }
  uint32_t pd() {
    uint32_t i = ~0u;
    EXPECT_EQ(ctx_->create_pd(&i), 0);
    return i;
  }
  CqInfo cq(uint32_t cqe = 64) {
    CqInfo c{};
    EXPECT_EQ(ctx_->create_cq(cqe, &c), 0);
    return c;
  }
  WqInfo wq(uint32_t p, uint32_t c, uint32_t max_wr = 8, uint32_t max_sge = 1) {
    WqInfo w{};
    EXPECT_EQ(ctx_->create_wq(p, c, max_wr, max_sge, &w), 0);
    return w;
  }
  int modify(const WqInfo& w, WqState next, WqState* out = nullptr) {
    return ctx_->modify_wq(w.index, kWqAttrState, WqState::kUnknown, next, out);
  }
  int post(const WqInfo& w, uint64_t wr_id, uint32_t num_sge = 1) {
    std::vector<SgeIn> sges(std::max<uint32_t>(num_sge, 1), SgeIn{0x1000, 64, 7});
    return ctx_->post_wq_recv(w, wr_id, sges.data(), num_sge);
  }
  std::vector<ibv_wc> drain(const CqInfo& c) {
    std::vector<ibv_wc> out;
    ibv_wc buf[16];
    for (;;) {
      int n = ctx_->poll_cq(c, 16, buf);
      if (n <= 0) break;
      out.insert(out.end(), buf, buf + n);
    }
    return out;
  }

  std::string home_, name_;
  DevicePaths paths_;
  std::unique_ptr<LocalContext> ctx_;
};

TEST_F(ContextTest, OpenRegistersAndCreatesTheSegment) {
  EXPECT_TRUE(fs::exists(ctx_->segment_path()));
  EXPECT_EQ(fs::path(ctx_->segment_path()).parent_path(), fs::path(paths_.device_dir));
  EXPECT_STREQ(ctx_->device().name, name_.c_str());
  ContextInfo info{};
  ASSERT_TRUE(my_info(*ctx_, &info));
  EXPECT_EQ(info.pid, static_cast<uint32_t>(::getpid()));
  EXPECT_EQ(info.start_time, process_start_time(::getpid()));
  EXPECT_EQ(fs::file_size(ctx_->segment_path()), layout::compute_context_layout(kHeap).total_size);
  ContextObjects o = inspect(*ctx_);
  EXPECT_EQ(o.pds + o.cqs + o.wqs + o.ind_tables, 0u);
}

TEST_F(ContextTest, OpenOnADeviceThatIsNotUp) {
  std::unique_ptr<LocalContext> c;
  EXPECT_EQ(LocalContext::open(device_paths(home_, "utnodev"), kHeap, &c), ENOENT);
  EXPECT_EQ(c, nullptr);
}

TEST_F(ContextTest, FailedOpenLeavesNothingBehind) {
  // A heap no file system or address space can hold: the segment cannot be
  // created or mapped, and the registry slot taken for it is given back.
  auto files = [&] {
    size_t n = 0;
    for (auto& e : fs::directory_iterator(paths_.device_dir)) n += e.path().filename() != "registry";
    return n;
  };
  size_t files_before = files();
  std::unique_ptr<LocalContext> c;
  EXPECT_NE(LocalContext::open(paths_, uint64_t{1} << 50, &c), 0);
  EXPECT_EQ(c, nullptr);
  EXPECT_EQ(files(), files_before);
  EXPECT_EQ(ctx_->registry().live_contexts().size(), 1u) << "only ours";
}

TEST_F(ContextTest, PdCreateDestroy) {
  uint32_t a = pd(), b = pd();
  EXPECT_NE(a, b);
  EXPECT_EQ(held(*ctx_, layout::kObjPd), 2u);
  EXPECT_EQ(inspect(*ctx_).pds, 2u);
  EXPECT_EQ(ctx_->destroy_pd(a), 0);
  EXPECT_EQ(ctx_->destroy_pd(a), EINVAL) << "already destroyed";
  EXPECT_EQ(ctx_->destroy_pd(limits::kCtxPdSlots), EINVAL);
  EXPECT_EQ(ctx_->destroy_pd(~0u), EINVAL);
  EXPECT_EQ(held(*ctx_, layout::kObjPd), 1u);
  EXPECT_EQ(inspect(*ctx_).pds, 1u);
  EXPECT_EQ(pd(), a) << "a freed index is reused";
  EXPECT_EQ(ctx_->destroy_pd(a), 0);
  EXPECT_EQ(ctx_->destroy_pd(b), 0);
  EXPECT_EQ(held(*ctx_, layout::kObjPd), 0u);
}

TEST_F(ContextTest, CqCreateRoundsAndValidates) {
  CqInfo c{};
  EXPECT_EQ(ctx_->create_cq(0, &c), EINVAL);
  EXPECT_EQ(ctx_->create_cq(limits::kMaxCqe + 1, &c), EINVAL);
  EXPECT_EQ(ctx_->create_cq(~0u, &c), EINVAL);
  CqInfo one = cq(1);
  EXPECT_EQ(one.capacity, 2u) << "minimum ring capacity";
  CqInfo hundred = cq(100);
  EXPECT_EQ(hundred.capacity, 128u);
  CqInfo exact = cq(256);
  EXPECT_EQ(exact.capacity, 256u);
  EXPECT_NE(one.index, hundred.index);
  EXPECT_EQ(held(*ctx_, layout::kObjCq), 3u);
  EXPECT_EQ(inspect(*ctx_).cqs, 3u);
  ibv_wc buf[4];
  EXPECT_EQ(ctx_->poll_cq(hundred, 4, buf), 0) << "a new CQ is empty";
  EXPECT_EQ(ctx_->destroy_cq(hundred.index), 0);
  EXPECT_EQ(ctx_->destroy_cq(hundred.index), EINVAL);
  EXPECT_EQ(ctx_->destroy_cq(limits::kCtxCqSlots), EINVAL);
  EXPECT_EQ(held(*ctx_, layout::kObjCq), 2u);
  EXPECT_EQ(inspect(*ctx_).cqs, 2u);
}

TEST_F(ContextTest, WqRounding) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index, 100, 3);
  EXPECT_EQ(w.capacity, 128u);
  EXPECT_EQ(w.max_sge, 4u);
  EXPECT_EQ(w.cq_index, c.index);
  EXPECT_EQ(w.ring.capacity(), 128u);
  EXPECT_GE(w.ring.payload_size(), sizeof(layout::RecvWqeHeader) + 4 * sizeof(layout::WireSge));
  WqInfo one = wq(p, c.index, 1, 1);
  EXPECT_EQ(one.capacity, 2u) << "minimum ring capacity";
  EXPECT_EQ(one.max_sge, 1u);
  WqInfo zero_sge = wq(p, c.index, 2, 0);
  EXPECT_EQ(zero_sge.capacity, 2u);
  EXPECT_EQ(zero_sge.max_sge, 1u) << "max_sge 0 is handed back as 1";
  WqInfo big = wq(p, c.index, limits::kMaxQpWr, limits::kMaxSge);  // both limits at once
  EXPECT_EQ(big.capacity, limits::kMaxQpWr);
  EXPECT_EQ(big.max_sge, limits::kMaxSge);
  WqInfo odd_wr = wq(p, c.index, limits::kMaxQpWr / 2 + 1, 1);
  EXPECT_EQ(odd_wr.capacity, limits::kMaxQpWr);
  WqInfo odd_sge = wq(p, c.index, 5, limits::kMaxSge / 2 + 1);
  EXPECT_EQ(odd_sge.capacity, 8u);
  EXPECT_EQ(odd_sge.max_sge, limits::kMaxSge);
  // WQ numbers: distinct, 24 bits, never the special QPs 0 and 1, and they
  // say where the WQ lives (peers find it from the number alone).
  ContextInfo me{};
  ASSERT_TRUE(my_info(*ctx_, &me));
  std::vector<WqInfo> all{w, one, zero_sge, big, odd_wr, odd_sge};
  std::vector<uint32_t> nums;
  for (const WqInfo& x : all) {
    EXPECT_GT(x.wq_num, 1u);
    EXPECT_LE(x.wq_num, limits::kQpnMask);
    EXPECT_EQ(layout::qpn_slot(x.wq_num), me.slot);
    EXPECT_EQ(layout::qpn_index(x.wq_num), x.index);
    EXPECT_EQ(layout::qpn_kind(x.wq_num), layout::kQpnWq);
    nums.push_back(x.wq_num);
  }
  std::sort(nums.begin(), nums.end());
  EXPECT_EQ(std::unique(nums.begin(), nums.end()), nums.end());
}

TEST_F(ContextTest, WqLimitsAreRejected) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w{};
  EXPECT_EQ(ctx_->create_wq(p, c.index, 0, 1, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p, c.index, limits::kMaxQpWr + 1, 1, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p, c.index, ~0u, 1, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p, c.index, 8, limits::kMaxSge + 1, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p, c.index, 8, ~0u, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p + 1, c.index, 8, 1, &w), EINVAL) << "no such PD";
  EXPECT_EQ(ctx_->create_wq(p, c.index + 1, 8, 1, &w), EINVAL) << "no such CQ";
  EXPECT_EQ(ctx_->create_wq(limits::kCtxPdSlots, c.index, 8, 1, &w), EINVAL);
  EXPECT_EQ(ctx_->create_wq(p, limits::kCtxCqSlots, 8, 1, &w), EINVAL);
  EXPECT_EQ(held(*ctx_, layout::kObjWq), 0u);
  EXPECT_EQ(inspect(*ctx_).wqs, 0u);
}

TEST_F(ContextTest, ObjectsInUseCannotBeDestroyed) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index);
  EXPECT_EQ(ctx_->destroy_pd(p), EBUSY);
  EXPECT_EQ(ctx_->destroy_cq(c.index), EBUSY);
  // Two WQs on the same PD and CQ: both must go before either can.
  WqInfo w2 = wq(p, c.index);
  EXPECT_EQ(ctx_->destroy_wq(w.index), 0);
  EXPECT_EQ(ctx_->destroy_wq(w.index), EINVAL);
  EXPECT_EQ(ctx_->destroy_pd(p), EBUSY);
  EXPECT_EQ(ctx_->destroy_cq(c.index), EBUSY);
  EXPECT_EQ(ctx_->destroy_wq(w2.index), 0);
  EXPECT_EQ(ctx_->destroy_cq(c.index), 0);
  EXPECT_EQ(ctx_->destroy_pd(p), 0);
  ContextObjects o = inspect(*ctx_);
  EXPECT_EQ(o.pds + o.cqs + o.wqs, 0u);
}

TEST_F(ContextTest, IndirectionTables) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w0 = wq(p, c.index), w1 = wq(p, c.index);
  uint32_t list[2] = {w0.index, w1.index};
  uint32_t idx = ~0u, num = ~0u;
  EXPECT_EQ(ctx_->create_ind_table(limits::kMaxLogIndTblSize + 1, list, &idx, &num), EINVAL);
  EXPECT_EQ(ctx_->create_ind_table(1, nullptr, &idx, &num), EINVAL);
  uint32_t bad[2] = {w0.index, w1.index + 100};
  EXPECT_EQ(ctx_->create_ind_table(1, bad, &idx, &num), EINVAL);
  EXPECT_EQ(held(*ctx_, layout::kObjIndTable), 0u);

  ASSERT_EQ(ctx_->create_ind_table(1, list, &idx, &num), 0);
  uint32_t only_w0[1] = {w0.index};
  uint32_t idx2 = ~0u, num2 = ~0u;
  ASSERT_EQ(ctx_->create_ind_table(0, only_w0, &idx2, &num2), 0);
  EXPECT_NE(idx, idx2);
  EXPECT_NE(num, num2);
  EXPECT_EQ(held(*ctx_, layout::kObjIndTable), 2u);
  EXPECT_EQ(inspect(*ctx_).ind_tables, 2u);

  EXPECT_EQ(ctx_->destroy_wq(w0.index), EBUSY);
  EXPECT_EQ(ctx_->destroy_wq(w1.index), EBUSY);
  EXPECT_EQ(ctx_->destroy_ind_table(idx), 0);
  EXPECT_EQ(ctx_->destroy_ind_table(idx), EINVAL);
  EXPECT_EQ(ctx_->destroy_wq(w1.index), 0);
  EXPECT_EQ(ctx_->destroy_wq(w0.index), EBUSY) << "still in the second table";
  EXPECT_EQ(ctx_->destroy_ind_table(idx2), 0);
  EXPECT_EQ(ctx_->destroy_wq(w0.index), 0);
  EXPECT_EQ(ctx_->destroy_ind_table(limits::kCtxIndTableSlots), EINVAL);
  EXPECT_EQ(held(*ctx_, layout::kObjIndTable), 0u);
  EXPECT_EQ(inspect(*ctx_).ind_tables, 0u);
}

TEST_F(ContextTest, IndirectionTableMayRepeatAWq) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index);
  std::vector<uint32_t> list(1u << limits::kMaxLogIndTblSize, w.index);
  uint32_t idx, num;
  ASSERT_EQ(ctx_->create_ind_table(limits::kMaxLogIndTblSize, list.data(), &idx, &num), 0);
  EXPECT_EQ(ctx_->destroy_wq(w.index), EBUSY);
  EXPECT_EQ(ctx_->destroy_ind_table(idx), 0);
  EXPECT_EQ(ctx_->destroy_wq(w.index), 0) << "every reference of the table is dropped";
}

TEST_F(ContextTest, WqStateMachine) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kReset) << "a new WQ is in RESET";
  WqState out = WqState::kUnknown;
  EXPECT_EQ(modify(w, WqState::kRdy, &out), 0);
  EXPECT_EQ(out, WqState::kRdy);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kRdy);
  EXPECT_EQ(modify(w, WqState::kRdy, &out), 0) << "RDY -> RDY";
  EXPECT_EQ(modify(w, WqState::kErr, &out), 0);
  EXPECT_EQ(out, WqState::kErr);
  EXPECT_EQ(modify(w, WqState::kRdy, &out), EINVAL) << "ERR -> RDY";
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kErr);
  EXPECT_EQ(modify(w, WqState::kErr), 0) << "ERR -> ERR";
  EXPECT_EQ(modify(w, WqState::kReset, &out), 0) << "ERR -> RESET";
  EXPECT_EQ(out, WqState::kReset);
  EXPECT_EQ(modify(w, WqState::kReset), 0) << "RESET -> RESET";
  EXPECT_EQ(modify(w, WqState::kErr), 0) << "RESET -> ERR";
  EXPECT_EQ(modify(w, WqState::kReset), 0);
  EXPECT_EQ(modify(w, WqState::kRdy), 0);
  EXPECT_EQ(modify(w, WqState::kReset), 0) << "RDY -> RESET";
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kReset);
  EXPECT_EQ(modify(w, WqState::kUnknown), EINVAL);
  EXPECT_EQ(modify(w, static_cast<WqState>(7)), EINVAL);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kReset);
  EXPECT_EQ(ctx_->wq_state(limits::kCtxWqSlots), WqState::kUnknown);
}

TEST_F(ContextTest, ModifyWqMaskAndCurrentState) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index);
  WqState out = WqState::kUnknown;
  EXPECT_EQ(ctx_->modify_wq(w.index, 0, WqState::kReset, WqState::kRdy, &out), EINVAL) << "empty mask";
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrFlags, WqState::kReset, WqState::kRdy, &out), EOPNOTSUPP);
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrState | kWqAttrFlags, WqState::kReset, WqState::kRdy, &out),
            EOPNOTSUPP);
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrReserved | kWqAttrState, WqState::kReset, WqState::kRdy, &out), EINVAL);
  EXPECT_EQ(ctx_->modify_wq(w.index, 1u << 31, WqState::kReset, WqState::kRdy, &out), EINVAL);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kReset) << "failed calls change nothing";
  // curr_state must match when given.
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrState | kWqAttrCurrState, WqState::kRdy, WqState::kErr, &out), EINVAL);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kReset);
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrState | kWqAttrCurrState, WqState::kReset, WqState::kRdy, &out), 0);
  EXPECT_EQ(out, WqState::kRdy);
  // curr_state alone is a check that changes nothing.
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrCurrState, WqState::kRdy, WqState::kErr, &out), 0);
  EXPECT_EQ(out, WqState::kRdy);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kRdy);
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrCurrState, WqState::kReset, WqState::kErr, &out), EINVAL);
  // Unknown or destroyed WQ.
  EXPECT_EQ(ctx_->modify_wq(w.index + 1, kWqAttrState, WqState::kReset, WqState::kRdy, &out), EINVAL);
  EXPECT_EQ(ctx_->modify_wq(limits::kCtxWqSlots, kWqAttrState, WqState::kReset, WqState::kRdy, &out), EINVAL);
  EXPECT_EQ(ctx_->destroy_wq(w.index), 0);
  EXPECT_EQ(ctx_->modify_wq(w.index, kWqAttrState, WqState::kReset, WqState::kRdy, &out), EINVAL);
}

TEST_F(ContextTest, ErrFlushesPostedWqesInOrder) {
  uint32_t p = pd();
  CqInfo c = cq(64);
  WqInfo w = wq(p, c.index, 16, 2);
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  for (uint64_t id = 100; id < 110; ++id) ASSERT_EQ(post(w, id, 2), 0);
  EXPECT_TRUE(drain(c).empty()) << "nothing completes while RDY and nobody sends";
  ASSERT_EQ(modify(w, WqState::kErr), 0);
  auto cqes = drain(c);
  ASSERT_EQ(cqes.size(), 10u);
  for (size_t i = 0; i < cqes.size(); ++i) {
    EXPECT_EQ(cqes[i].wr_id, 100 + i);
    EXPECT_EQ(cqes[i].status, kWcWrFlushErr);
    EXPECT_EQ(cqes[i].opcode, kWcOpRecv);
    EXPECT_EQ(cqes[i].qp_num, w.wq_num);
    EXPECT_EQ(cqes[i].byte_len, 0u);
  }
  // A WQE posted to a WQ in ERR is flushed at once.
  EXPECT_EQ(post(w, 555), 0);
  cqes = drain(c);
  ASSERT_EQ(cqes.size(), 1u);
  EXPECT_EQ(cqes[0].wr_id, 555u);
  EXPECT_EQ(cqes[0].status, kWcWrFlushErr);
  // Flushing emptied the queue: it holds a full ring again.
  for (uint32_t i = 0; i < w.capacity; ++i) ASSERT_EQ(post(w, 1000 + i), 0) << i;
  cqes = drain(c);
  ASSERT_EQ(cqes.size(), w.capacity);
  for (uint32_t i = 0; i < w.capacity; ++i) EXPECT_EQ(cqes[i].wr_id, 1000 + i);
  EXPECT_EQ(modify(w, WqState::kErr), 0) << "ERR -> ERR with nothing posted";
  EXPECT_TRUE(drain(c).empty());
}

TEST_F(ContextTest, ResetDiscardsPostedWqes) {
  uint32_t p = pd();
  CqInfo c = cq(64);
  WqInfo w = wq(p, c.index, 4, 1);
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_EQ(post(w, id), 0);
  ASSERT_EQ(modify(w, WqState::kReset), 0);
  EXPECT_TRUE(drain(c).empty()) << "RESET discards without completions";
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  // The ring starts again from empty: a whole capacity fits.
  for (uint32_t i = 0; i < w.capacity; ++i) ASSERT_EQ(post(w, 10 + i), 0) << i;
  EXPECT_EQ(post(w, 99), ENOMEM);
  ASSERT_EQ(modify(w, WqState::kErr), 0);
  auto cqes = drain(c);
  ASSERT_EQ(cqes.size(), w.capacity) << "only what was posted after the reset is flushed";
  for (uint32_t i = 0; i < w.capacity; ++i) EXPECT_EQ(cqes[i].wr_id, 10 + i);
}

TEST_F(ContextTest, PostRules) {
  uint32_t p = pd();
  CqInfo c = cq(256);
  WqInfo w = wq(p, c.index, 100, 3);  // capacity 128, max_sge 4
  EXPECT_EQ(post(w, 1), EINVAL) << "WQ in RESET";
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  EXPECT_EQ(post(w, 1, w.max_sge + 1), EINVAL) << "too many SGEs";
  EXPECT_EQ(post(w, 1, 0), 0) << "no SGE at all is fine";
  EXPECT_EQ(post(w, 2, w.max_sge), 0);
  for (uint32_t i = 2; i < w.capacity; ++i) ASSERT_EQ(post(w, 1 + i), 0) << i;
  EXPECT_EQ(post(w, 9999), ENOMEM) << "full exactly at capacity";
  EXPECT_EQ(post(w, 9999), ENOMEM);
  ASSERT_EQ(modify(w, WqState::kErr), 0);
  auto cqes = drain(c);
  ASSERT_EQ(cqes.size(), w.capacity);
  for (uint32_t i = 0; i < w.capacity; ++i) EXPECT_EQ(cqes[i].wr_id, 1 + i);
  // After a RESET, posting is refused again.
  ASSERT_EQ(modify(w, WqState::kReset), 0);
  EXPECT_EQ(post(w, 1), EINVAL);
}

TEST_F(ContextTest, FlushIntoAFullCqDoesNotHang) {
  uint32_t p = pd();
  CqInfo c = cq(2);
  WqInfo w = wq(p, c.index, 8, 1);
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  for (uint32_t i = 0; i < w.capacity; ++i) ASSERT_EQ(post(w, i), 0);
  ASSERT_EQ(modify(w, WqState::kErr), 0);
  auto cqes = drain(c);
  ASSERT_EQ(cqes.size(), c.capacity) << "what does not fit is lost, as on an overrun";
  EXPECT_EQ(cqes[0].wr_id, 0u);
  EXPECT_EQ(cqes[1].wr_id, 1u);
}

TEST_F(ContextTest, PollReturnsAtMostN) {
  uint32_t p = pd();
  CqInfo c = cq(16);
  WqInfo w = wq(p, c.index, 8, 1);
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  for (uint32_t i = 0; i < 5; ++i) ASSERT_EQ(post(w, i), 0);
  ASSERT_EQ(modify(w, WqState::kErr), 0);
  ibv_wc buf[5];
  EXPECT_EQ(ctx_->poll_cq(c, 0, buf), 0);
  EXPECT_EQ(ctx_->poll_cq(c, 2, buf), 2);
  EXPECT_EQ(buf[0].wr_id, 0u);
  EXPECT_EQ(buf[1].wr_id, 1u);
  EXPECT_EQ(ctx_->poll_cq(c, 5, buf), 3);
  EXPECT_EQ(buf[2].wr_id, 4u);
  EXPECT_EQ(ctx_->poll_cq(c, 5, buf), 0);
}

// A CQE in the CQ's ring comes from any producer (peers too): poll_cq hands
// out every field that holds a valid value as it is, and clamps the rest.
TEST_F(ContextTest, PollClampsAGarbageCqe) {
  CqInfo c = cq(16);
  layout::Cqe good{};
  good.wr_id = 0x0123456789abcdefull;
  good.status = IBV_WC_REM_ACCESS_ERR;
  good.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
  good.vendor_err = 0x12345678;
  good.byte_len = 0x9abcdef0;
  good.imm_data = 0xdeadbeef;
  good.qp_num = 0xabcdef;
  good.src_qp = 0x123456;
  good.wc_flags = IBV_WC_GRH | IBV_WC_WITH_IMM;
  good.pkey_index = 0xbeef;
  good.slid = 0xcafe;
  good.sl = 0xa;
  good.dlid_path_bits = 0x7f;
  good.flags = 0xff;
  layout::Cqe bad;
  std::memset(&bad, 0xff, sizeof bad);
  ASSERT_EQ(c.ring.try_push_cas(&good, sizeof good), RingStatus::ok);
  ASSERT_EQ(c.ring.try_push_cas(&bad, sizeof bad), RingStatus::ok);
  ibv_wc wc[2];
  std::memset(wc, 0x5a, sizeof wc);
  ASSERT_EQ(ctx_->poll_cq(c, 2, wc), 2);
  EXPECT_EQ(wc[0].wr_id, good.wr_id);
  EXPECT_EQ(wc[0].status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_EQ(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
  EXPECT_EQ(wc[0].vendor_err, good.vendor_err);
  EXPECT_EQ(wc[0].byte_len, good.byte_len);
  EXPECT_EQ(wc[0].imm_data, good.imm_data);
  EXPECT_EQ(wc[0].qp_num, good.qp_num);
  EXPECT_EQ(wc[0].src_qp, good.src_qp);
  EXPECT_EQ(wc[0].wc_flags, unsigned{IBV_WC_GRH | IBV_WC_WITH_IMM});
  EXPECT_EQ(wc[0].pkey_index, good.pkey_index);
  EXPECT_EQ(wc[0].slid, good.slid);
  EXPECT_EQ(wc[0].sl, good.sl);
  EXPECT_EQ(wc[0].dlid_path_bits, good.dlid_path_bits);
  EXPECT_EQ(wc[1].wr_id, ~uint64_t{0});
  EXPECT_EQ(wc[1].status, IBV_WC_GENERAL_ERR);
  EXPECT_EQ(static_cast<uint32_t>(wc[1].opcode), 0xffu);
  EXPECT_EQ(wc[1].vendor_err, ~0u);
  EXPECT_EQ(wc[1].byte_len, ~0u);
  EXPECT_EQ(wc[1].qp_num, limits::kQpnMask);
  EXPECT_EQ(wc[1].src_qp, limits::kQpnMask);
  EXPECT_EQ(wc[1].wc_flags, unsigned{IBV_WC_GRH | IBV_WC_WITH_IMM | IBV_WC_IP_CSUM_OK | IBV_WC_WITH_INV |
                                     IBV_WC_TM_SYNC_REQ | IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID});
  EXPECT_EQ(wc[1].pkey_index, 0xffff);
  EXPECT_EQ(wc[1].slid, 0xffff);
  EXPECT_EQ(wc[1].sl, 0xf);
  EXPECT_EQ(wc[1].dlid_path_bits, 0xff);
  // The CQE's flags byte does not reach the ibv_wc's padding after dlid_path_bits.
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(&wc[0])[offsetof(ibv_wc, dlid_path_bits) + 1], 0);
  EXPECT_EQ(ctx_->poll_cq(c, 2, wc), 0);
}

TEST_F(ContextTest, InspectSeesLiveObjects) {
  uint32_t p0 = pd(), p1 = pd();
  CqInfo c0 = cq(), c1 = cq();
  WqInfo w0 = wq(p0, c0.index, 100, 3);
  WqInfo w1 = wq(p1, c1.index, 8, 1);
  ASSERT_EQ(modify(w1, WqState::kRdy), 0);
  uint32_t list[1] = {w0.index};
  uint32_t ind, num;
  ASSERT_EQ(ctx_->create_ind_table(0, list, &ind, &num), 0);

  ContextObjects o = inspect(*ctx_);
  EXPECT_EQ(o.pds, 2u);
  EXPECT_EQ(o.cqs, 2u);
  EXPECT_EQ(o.wqs, 2u);
  EXPECT_EQ(o.ind_tables, 1u);
  ASSERT_EQ(o.wq_list.size(), 2u);
  auto find = [&](uint32_t num) {
    return std::find_if(o.wq_list.begin(), o.wq_list.end(), [&](const ContextObjects::Wq& w) { return w.wq_num == num; });
  };
  auto a = find(w0.wq_num), b = find(w1.wq_num);
  ASSERT_NE(a, o.wq_list.end());
  ASSERT_NE(b, o.wq_list.end());
  EXPECT_EQ(a->state, static_cast<uint32_t>(WqState::kReset));
  EXPECT_EQ(a->capacity, 128u);
  EXPECT_EQ(a->max_sge, 4u);
  EXPECT_EQ(a->pd, p0);
  EXPECT_EQ(a->cq, c0.index);
  EXPECT_EQ(b->state, static_cast<uint32_t>(WqState::kRdy));
  EXPECT_EQ(b->capacity, 8u);
  EXPECT_EQ(b->max_sge, 1u);
  EXPECT_EQ(b->pd, p1);
  EXPECT_EQ(b->cq, c1.index);

  ASSERT_EQ(ctx_->destroy_ind_table(ind), 0);
  ASSERT_EQ(ctx_->destroy_wq(w0.index), 0);
  ASSERT_EQ(ctx_->destroy_cq(c0.index), 0);
  ASSERT_EQ(ctx_->destroy_pd(p0), 0);
  o = inspect(*ctx_);
  EXPECT_EQ(o.pds, 1u);
  EXPECT_EQ(o.cqs, 1u);
  EXPECT_EQ(o.wqs, 1u);
  EXPECT_EQ(o.ind_tables, 0u);
  ASSERT_EQ(o.wq_list.size(), 1u);
  EXPECT_EQ(o.wq_list[0].wq_num, w1.wq_num);

  // Once the context is closed its segment is gone.
  ContextInfo info{};
  ASSERT_TRUE(my_info(*ctx_, &info));
  ctx_.reset();
  ContextObjects after;
  EXPECT_EQ(inspect_context(paths_, info, &after), ENOENT);
}

TEST_F(ContextTest, InspectRejectsAForeignSegment) {
  ContextInfo info{};
  ASSERT_TRUE(my_info(*ctx_, &info));
  ContextObjects o;
  ContextInfo wrong = info;
  wrong.pid += 1;  // the header names another owner
  EXPECT_EQ(inspect_context(paths_, wrong, &o), EPROTO);
  wrong = info;
  wrong.segment = "registry";  // a segment of another kind
  EXPECT_EQ(inspect_context(paths_, wrong, &o), EPROTO);
}

TEST_F(ContextTest, InspectRejectsCorruptGeometry) {
  ContextInfo info{};
  ASSERT_TRUE(my_info(*ctx_, &info));
  Mapping raw;  // a second view of our own segment, as a corrupt peer would scribble it
  ASSERT_EQ(Mapping::attach(ctx_->segment_path(), layout::SegmentKind::kContext, 0, &raw), 0);
  auto* h = static_cast<layout::ContextHeader*>(raw.base());
  ContextObjects o;
  const uint64_t wq_table = h->wq_table;
  h->wq_table = raw.size();  // would read past the end
  EXPECT_EQ(inspect_context(paths_, info, &o), EPROTO);
  h->wq_table = wq_table;
  const uint32_t pd_slots = h->pd_slots;
  h->pd_slots = ~0u;
  EXPECT_EQ(inspect_context(paths_, info, &o), EPROTO);
  h->pd_slots = pd_slots;
  EXPECT_EQ(inspect_context(paths_, info, &o), 0);
}

TEST_F(ContextTest, InspectOfATooSmallSegment) {
  // A published context segment smaller than the fixed tables: the heap size
  // an inspector derives from the file size must not wrap around.
  std::string path = paths_.device_dir + "/ctx-250-1";
  {
    Mapping m;
    ASSERT_EQ(Mapping::create(path, 8192, layout::SegmentKind::kContext, &m), 0);
    m.publish();
  }
  ContextInfo info{};
  info.pid = static_cast<uint32_t>(::getpid());
  info.segment = "ctx-250-1";
  ContextObjects o;
  EXPECT_EQ(inspect_context(paths_, info, &o), EPROTO);
  ::unlink(path.c_str());
}

TEST_F(ContextTest, InspectClampsAGarbageWqState) {
  uint32_t p = pd();
  CqInfo c = cq();
  WqInfo w = wq(p, c.index);
  Mapping raw;
  ASSERT_EQ(Mapping::attach(ctx_->segment_path(), layout::SegmentKind::kContext, 0, &raw), 0);
  layout::ContextLayout l = layout::compute_context_layout(kHeap);
  auto* e = raw.at<layout::WqEntry>(l.wq_table) + w.index;
  ASSERT_EQ(e->wq_num, w.wq_num);
  e->wq_state.store(99);
  EXPECT_EQ(ctx_->wq_state(w.index), WqState::kUnknown);
  ContextObjects o = inspect(*ctx_);
  ASSERT_EQ(o.wq_list.size(), 1u);
  EXPECT_EQ(o.wq_list[0].state, static_cast<uint32_t>(WqState::kUnknown));
  // Posting to a WQ whose shared state is garbage is refused, not crashed.
  EXPECT_EQ(post(w, 1), EINVAL);
  e->wq_state.store(static_cast<uint32_t>(WqState::kReset));
}

// Every ring a CQ entry has had has its own epoch (layout::CqEntry::
// ring_epoch): what producers learnt of one ring's free slots holds for it
// alone (cq_push.h push_slot). Create and resize move it on; it is never
// reset, so a new CQ in a freed entry does not start where an old one was.
TEST_F(ContextTest, EveryRingOfACqEntryHasItsOwnEpoch) {
  Mapping raw;
  ASSERT_EQ(Mapping::attach(ctx_->segment_path(), layout::SegmentKind::kContext, 0, &raw), 0);
  const layout::ContextLayout l = layout::compute_context_layout(kHeap);
  CqInfo c = cq(4);
  const auto* e = raw.at<layout::CqEntry>(l.cq_table) + c.index;
  std::vector<uint32_t> seen{e->ring_epoch};
  auto moved_on = [&](const char* what) {
    EXPECT_EQ(std::count(seen.begin(), seen.end(), e->ring_epoch), 0) << what;
    seen.push_back(e->ring_epoch);
  };
  CqInfo out{};
  ASSERT_EQ(ctx_->resize_cq(c.index, 4, &out), 0);
  moved_on("a resize to the same size");
  ASSERT_EQ(ctx_->resize_cq(c.index, 100, &out), 0);
  moved_on("a resize to a larger size");
  EXPECT_EQ(ctx_->resize_cq(c.index, 0, &out), EINVAL);
  EXPECT_EQ(e->ring_epoch, seen.back()) << "a resize that fails formats no ring";
  ASSERT_EQ(ctx_->destroy_cq(c.index), 0);
  CqInfo again = cq(4);
  ASSERT_EQ(again.index, c.index) << "the freed entry is reused";
  moved_on("a new CQ in the entry");
  ASSERT_EQ(ctx_->destroy_cq(again.index), 0);
}

// A producer that died between reserving a CQ slot and publishing it
// (LocalContext::skip_dead_push): the completion behind the slot waits, and
// once the slot has stayed reserved for 2 s an empty poll gives it up and
// the next poll hands the completion out. (A look reads whether the slot is
// reserved only when the consumer has not moved since the previous look.)
TEST_F(ContextTest, ACqSlotADeadProducerReservedIsGivenUpAfterTwoSeconds) {
  using Clock = std::chrono::steady_clock;
  CqInfo c = cq(4);
  ASSERT_TRUE(c.ring.try_reserve()) << "the producer that dies";
  layout::Cqe e{};
  e.wr_id = 42;
  e.status = IBV_WC_SUCCESS;
  e.opcode = IBV_WC_RECV;
  e.byte_len = 8;
  ASSERT_EQ(c.ring.try_push_cas(&e, sizeof e), RingStatus::ok);
  ibv_wc wc[4];
  const Clock::time_point start = Clock::now();
  int n = 0;
  while ((n = ctx_->poll_cq(c, 4, wc)) == 0 && Clock::now() - start < std::chrono::seconds(10)) ::usleep(1000);
  const auto waited = Clock::now() - start;
  ASSERT_EQ(n, 1) << "the slot was never given up";
  EXPECT_EQ(wc[0].wr_id, 42u);
  EXPECT_EQ(wc[0].status, IBV_WC_SUCCESS);
  EXPECT_GE(waited, std::chrono::seconds(2)) << "given up before it stalled for 2 s";
  EXPECT_EQ(ctx_->poll_cq(c, 4, wc), 0);
  ASSERT_EQ(ctx_->destroy_cq(c.index), 0);
}

TEST_F(ContextTest, HeapExhaustionLeaksNothing) {
  ContextObjects before = inspect(*ctx_);
  uint32_t held_before = held(*ctx_, layout::kObjCq);
  CqInfo c{};
  // 2^20 CQEs need 64 MiB of ring; the heap has 16 MiB.
  EXPECT_EQ(ctx_->create_cq(limits::kMaxCqe, &c), ENOMEM);
  ContextObjects after = inspect(*ctx_);
  EXPECT_EQ(after.cqs, before.cqs);
  EXPECT_EQ(held(*ctx_, layout::kObjCq), held_before);
  CqInfo small = cq(1024);
  EXPECT_EQ(small.capacity, 1024u);

  // Fill most of the heap with one big WQ (16384 x 576 bytes = 9 MiB), then
  // a second one does not fit, until the first is destroyed.
  uint32_t p = pd();
  WqInfo big = wq(p, small.index, limits::kMaxQpWr, limits::kMaxSge);
  WqInfo w{};
  EXPECT_EQ(ctx_->create_wq(p, small.index, limits::kMaxQpWr, limits::kMaxSge, &w), ENOMEM);
  EXPECT_EQ(held(*ctx_, layout::kObjWq), 1u);
  EXPECT_EQ(inspect(*ctx_).wqs, 1u);
  ASSERT_EQ(ctx_->destroy_wq(big.index), 0);
  EXPECT_EQ(ctx_->create_wq(p, small.index, limits::kMaxQpWr, limits::kMaxSge, &w), 0)
      << "the destroyed WQ's ring went back to the heap";
  // Many create/destroy cycles do not leak heap.
  ASSERT_EQ(ctx_->destroy_wq(w.index), 0);
  for (int i = 0; i < 10; ++i) {
    WqInfo x{};
    ASSERT_EQ(ctx_->create_wq(p, small.index, limits::kMaxQpWr, limits::kMaxSge, &x), 0) << i;
    ASSERT_EQ(ctx_->destroy_wq(x.index), 0);
  }
}

TEST_F(ContextTest, NewRingsAreClean) {
  // A ring reusing the heap of a destroyed one starts empty, whatever the
  // old one left in its slots.
  uint32_t p = pd();
  CqInfo c = cq(64);
  WqInfo w = wq(p, c.index, 32, 1);
  ASSERT_EQ(modify(w, WqState::kRdy), 0);
  for (uint32_t i = 0; i < 20; ++i) ASSERT_EQ(post(w, i), 0);
  ASSERT_EQ(ctx_->destroy_wq(w.index), 0);
  WqInfo w2 = wq(p, c.index, 32, 1);
  ASSERT_EQ(modify(w2, WqState::kRdy), 0);
  ASSERT_EQ(modify(w2, WqState::kErr), 0);
  EXPECT_TRUE(drain(c).empty()) << "stale WQEs of the destroyed WQ must not be flushed";
}

TEST_F(ContextTest, DestructorRemovesSegmentAndSlot) {
  std::unique_ptr<LocalContext> second;
  ASSERT_EQ(LocalContext::open(paths_, kHeap, &second), 0);
  EXPECT_NE(second->segment_path(), ctx_->segment_path());
  std::string path = second->segment_path();
  std::string file = fs::path(path).filename();
  ContextInfo info{};
  ASSERT_TRUE(my_info(*second, &info));
  uint32_t p;
  ASSERT_EQ(second->create_pd(&p), 0);  // closing with live objects is fine
  EXPECT_TRUE(fs::exists(path));
  EXPECT_TRUE(fs::exists(path + kAsyncSuffix));
  EXPECT_EQ(ctx_->registry().live_contexts().size(), 2u);
  second.reset();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + kAsyncSuffix)) << "the async FIFO goes with the segment";
  auto live = ctx_->registry().live_contexts();
  ASSERT_EQ(live.size(), 1u);
  EXPECT_NE(live[0].segment, file);
  EXPECT_NE(live[0].slot, info.slot);
  EXPECT_TRUE(fs::exists(ctx_->segment_path()));
  // The slot is free: the next open may take it, with a new generation.
  std::unique_ptr<LocalContext> third;
  ASSERT_EQ(LocalContext::open(paths_, kHeap, &third), 0);
  ContextInfo info3{};
  ASSERT_TRUE(my_info(*third, &info3));
  EXPECT_EQ(info3.slot, info.slot);
  EXPECT_EQ(info3.generation, info.generation + 1);
  EXPECT_EQ(held(*third, layout::kObjPd), 0u) << "nothing inherited from the previous owner";
}

TEST_F(ContextTest, DeviceWideChargeAcrossTwoContexts) {
  std::unique_ptr<LocalContext> other;
  ASSERT_EQ(LocalContext::open(paths_, kHeap, &other), 0);
  const uint32_t mine = 3000, theirs = limits::kMaxPd - mine;
  std::vector<uint32_t> a, b;
  for (uint32_t i = 0; i < mine; ++i) {
    uint32_t idx;
    ASSERT_EQ(ctx_->create_pd(&idx), 0) << i;
    a.push_back(idx);
  }
  for (uint32_t i = 0; i < theirs; ++i) {
    uint32_t idx;
    ASSERT_EQ(other->create_pd(&idx), 0) << i;
    b.push_back(idx);
  }
  uint32_t idx;
  EXPECT_EQ(ctx_->create_pd(&idx), ENOMEM) << "device-wide limit reached";
  EXPECT_EQ(other->create_pd(&idx), ENOMEM);
  EXPECT_EQ(held(*ctx_, layout::kObjPd), mine);
  EXPECT_EQ(held(*other, layout::kObjPd), theirs);
  ASSERT_EQ(ctx_->destroy_pd(a.back()), 0);
  EXPECT_EQ(other->create_pd(&idx), 0) << "one freed in one context can be created in the other";
  EXPECT_EQ(ctx_->create_pd(&idx), ENOMEM);
  // Closing a context gives back everything it held.
  other.reset();
  for (uint32_t i = 0; i < theirs + 1; ++i) ASSERT_EQ(ctx_->create_pd(&idx), 0) << i;
  EXPECT_EQ(ctx_->create_pd(&idx), ENOMEM);
}

}  // namespace
}  // namespace shmrdma
