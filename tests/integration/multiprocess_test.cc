// Several processes on one device at the same time: each sees its own
// objects in `shmrdma status --json`, WQ numbers are unique device-wide, and
// the device limits are shared by all processes.
#include <infiniband/verbs.h>
#include <signal.h>

#include <cstring>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "home.h"

HARNESS_TEST_ENVIRONMENT(.tag = "itest", .root_only = false);

namespace {

using harness::Child;
using harness::Home;
using harness::Result;

constexpr int kTimeoutMs = 30'000;

std::string holder_bin() { return harness::getenv_str("OBJ_HOLDER_BIN"); }

// The holders are started directly: they inherit the environment the
// harness took from `shmrdma env` (wq_demo_test covers `shmrdma run`).
std::vector<std::string> holder_argv(std::vector<std::string> args) {
  std::vector<std::string> a = {holder_bin()};
  a.insert(a.end(), args.begin(), args.end());
  return a;
}

struct Ready {
  pid_t pid = -1;
  size_t pd = 0, cq = 0, wq = 0;
  std::vector<uint32_t> wq_nums;
};

// Parses "READY <pid> <pd> <cq> <wq> <wq_num>...".
Ready parse_ready(const std::string& line) {
  Ready r;
  std::istringstream in(line);
  std::string word;
  in >> word >> r.pid >> r.pd >> r.cq >> r.wq;
  uint32_t n;
  while (in >> n) r.wq_nums.push_back(n);
  return r;
}

class MultiProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    ASSERT_FALSE(holder_bin().empty()) << "OBJ_HOLDER_BIN is not set";
  }
};

TEST_F(MultiProcess, TwoProcessesCreateAtTheSameTimeAndEachIsListed) {
  struct Spec {
    std::vector<std::string> args;
    int pd, cq, wq;
    uint32_t max_wr;
  };
  // Enough WQs in each that their creations interleave.
  std::vector<Spec> specs = {
      {{"--pd", "2", "--cq", "1", "--wq", "300", "--max-wr", "64", "--rdy", "--go"}, 2, 1, 300, 64},
      {{"--pd", "1", "--cq", "3", "--wq", "200", "--max-wr", "8", "--go"}, 1, 3, 200, 8},
  };
  std::vector<std::unique_ptr<Child>> kids;
  for (auto& s : specs) {
    kids.push_back(std::make_unique<Child>());
    ASSERT_TRUE(kids.back()->start(holder_argv(s.args), harness::kDialog)) << kids.back()->output();
  }
  // Both have the device open before either creates anything.
  for (auto& k : kids) {
    auto line = k->wait_line("OPEN ", kTimeoutMs);
    ASSERT_TRUE(line.has_value()) << "no OPEN line: " << k->wait(1000).describe();
  }
  for (auto& k : kids) ASSERT_TRUE(k->write_line("GO"));
  std::vector<Ready> ready;
  for (auto& k : kids) {
    auto line = k->wait_line("READY ", kTimeoutMs);
    ASSERT_TRUE(line.has_value()) << "no READY line: " << k->wait(1000).describe();
    ready.push_back(parse_ready(*line));
    EXPECT_EQ(ready.back().pid, k->pid());
  }

  nlohmann::json st = Home::get().status();
  std::set<uint32_t> all_nums;
  size_t total_wqs = 0;
  for (size_t i = 0; i < kids.size(); ++i) {
    SCOPED_TRACE("process " + std::to_string(i));
    const Spec& s = specs[i];
    nlohmann::json p = Home::find_process(st, kids[i]->pid());
    ASSERT_FALSE(p.is_null()) << "pid " << kids[i]->pid() << " not listed:\n" << st.dump(2);
    EXPECT_EQ(p.value("command", ""), "obj_holder");
    const auto& o = p["objects"];
    EXPECT_EQ(o.value("pd", -1), s.pd) << o.dump();
    EXPECT_EQ(o.value("cq", -1), s.cq) << o.dump();
    EXPECT_EQ(o.value("wq", -1), s.wq) << o.dump();
    EXPECT_EQ(o.value("rwq_ind_table", -1), 0) << o.dump();
    ASSERT_EQ(p["wqs"].size(), static_cast<size_t>(s.wq));
    std::set<uint32_t> listed;
    for (const auto& w : p["wqs"]) {
      EXPECT_EQ(w.value("max_wr", 0u), s.max_wr) << w.dump();
      EXPECT_EQ(w.value("max_sge", 0u), 1u) << w.dump();
      EXPECT_EQ(w.value("state", ""), i == 0 ? "RDY" : "RESET") << w.dump();
      listed.insert(w.value("wq_num", 0u));
    }
    // The WQ numbers status shows are the ones verbs handed to that process.
    std::set<uint32_t> reported(ready[i].wq_nums.begin(), ready[i].wq_nums.end());
    EXPECT_EQ(listed, reported);
    all_nums.insert(reported.begin(), reported.end());
    total_wqs += ready[i].wq_nums.size();
  }
  EXPECT_EQ(all_nums.size(), total_wqs) << "two processes got the same WQ number";

  for (auto& k : kids) ASSERT_TRUE(k->write_line("done"));
  for (auto& k : kids) {
    Result r = k->wait(kTimeoutMs);
    EXPECT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("OK"), std::string::npos) << r.describe();
  }
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "a holder left context files behind: " << harness::join(harness::Home::get().ctx_files());
  st = Home::get().status();
  EXPECT_TRUE(Home::pids(st).empty()) << st.dump(2);
}

TEST_F(MultiProcess, KillingOneLeavesTheOtherIntact) {
  Child a, b;
  ASSERT_TRUE(a.start(holder_argv({"--pd", "1", "--cq", "1", "--wq", "3", "--rdy"}), harness::kDialog)) << a.output();
  ASSERT_TRUE(b.start(holder_argv({"--pd", "2", "--cq", "2", "--wq", "2"}), harness::kDialog)) << b.output();
  ASSERT_TRUE(a.wait_line("READY ", kTimeoutMs).has_value()) << a.wait(1000).describe();
  ASSERT_TRUE(b.wait_line("READY ", kTimeoutMs).has_value()) << b.wait(1000).describe();
  pid_t apid = a.pid();
  a.kill(SIGKILL);

  nlohmann::json st = Home::get().status();
  EXPECT_TRUE(Home::find_process(st, apid).is_null()) << st.dump(2);
  nlohmann::json p = Home::find_process(st, b.pid());
  ASSERT_FALSE(p.is_null()) << st.dump(2);
  EXPECT_EQ(p["objects"].value("pd", -1), 2);
  EXPECT_EQ(p["objects"].value("cq", -1), 2);
  EXPECT_EQ(p["objects"].value("wq", -1), 2);
  EXPECT_EQ(harness::Home::get().ctx_segments().size(), 1u) << harness::join(harness::Home::get().ctx_files());

  // The survivor still works to the end.
  ASSERT_TRUE(b.write_line("done"));
  Result r = b.wait(kTimeoutMs);
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "left over: " << harness::join(harness::Home::get().ctx_files());
}

// max_pd is a device limit: what one process holds, another cannot have.
TEST_F(MultiProcess, DeviceLimitsAreSharedBetweenProcesses) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_NE(list, nullptr);
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  ASSERT_NE(ctx, nullptr) << std::strerror(errno);
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(ctx, &attr), 0);
  const int max_pd = attr.max_pd;
  const int held = max_pd - 96;
  ASSERT_GT(held, 0);

  Child a;
  ASSERT_TRUE(a.start(holder_argv({"--pd", std::to_string(held)}), harness::kDialog)) << a.output();
  auto line = a.wait_line("READY ", kTimeoutMs);
  ASSERT_TRUE(line.has_value()) << a.wait(1000).describe();

  std::vector<ibv_pd*> mine;
  for (int i = 0; i < max_pd; ++i) {
    ibv_pd* pd = ibv_alloc_pd(ctx);
    if (!pd) {
      EXPECT_EQ(errno, ENOMEM) << std::strerror(errno);
      break;
    }
    mine.push_back(pd);
  }
  EXPECT_EQ(static_cast<int>(mine.size()), max_pd - held)
      << "with " << held << " PDs held by another process, this one got " << mine.size();

  // A second holder asking for more is refused too.
  {
    Child b;
    ASSERT_TRUE(b.start(holder_argv({"--pd", "1"}), harness::kDialog)) << b.output();
    auto l = b.read_line(kTimeoutMs);
    ASSERT_TRUE(l.has_value()) << "no answer from a third process: " << b.wait(1000).describe();
    EXPECT_EQ(*l, "FAIL pd " + std::to_string(ENOMEM)) << "a third process got a PD beyond max_pd";
    b.close_stdin();  // lets it go if it wrongly got its PD
    Result rb = b.wait(kTimeoutMs);
    EXPECT_EQ(rb.exit_code, 3) << rb.describe();
  }

  // Once the holder lets go, its share is free for this process.
  ASSERT_TRUE(a.write_line("done"));
  Result ra = a.wait(kTimeoutMs);
  EXPECT_TRUE(ra.ok()) << ra.describe();
  for (int i = 0; i < held; ++i) {
    ibv_pd* pd = ibv_alloc_pd(ctx);
    ASSERT_NE(pd, nullptr) << "PD #" << mine.size() + 1 << " after the holder exited: " << std::strerror(errno);
    mine.push_back(pd);
  }
  EXPECT_EQ(static_cast<int>(mine.size()), max_pd);
  for (ibv_pd* pd : mine) EXPECT_EQ(ibv_dealloc_pd(pd), 0);
  EXPECT_EQ(ibv_close_device(ctx), 0);
}

// A killed process's share of a device limit is given back once its context
// is reclaimed (here by `shmrdma up`).
TEST_F(MultiProcess, KilledProcessShareIsReclaimed) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ASSERT_NE(list, nullptr);
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  ASSERT_NE(ctx, nullptr) << std::strerror(errno);
  ibv_device_attr attr{};
  ASSERT_EQ(ibv_query_device(ctx, &attr), 0);
  const int max_pd = attr.max_pd;

  Child a;
  ASSERT_TRUE(a.start(holder_argv({"--pd", std::to_string(max_pd)}), harness::kDialog)) << a.output();
  ASSERT_TRUE(a.wait_line("READY ", kTimeoutMs).has_value()) << a.wait(1000).describe();
  errno = 0;
  EXPECT_EQ(ibv_alloc_pd(ctx), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  a.kill(SIGKILL);

  Result up = Home::get().shmrdma({"up", "--name", "shm0"});
  ASSERT_TRUE(up.ok()) << up.describe();
  EXPECT_NE(up.out.find("reclaimed 1 context"), std::string::npos) << up.out;
  ibv_pd* pd = ibv_alloc_pd(ctx);
  EXPECT_NE(pd, nullptr) << "the killed process's PDs were not given back: " << std::strerror(errno);
  if (pd) { EXPECT_EQ(ibv_dealloc_pd(pd), 0); }
  EXPECT_EQ(ibv_close_device(ctx), 0);
}

}  // namespace
