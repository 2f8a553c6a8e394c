// Runs the wq_demo program under `shmrdma run` and watches it from outside
// with `shmrdma status --json`: a clean run, a held run whose objects are
// listed, and a run killed with SIGKILL whose context is reclaimed.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <string>

#include "home.h"

HARNESS_TEST_ENVIRONMENT(.tag = "itest", .root_only = false);

namespace {

using harness::Child;
using harness::Home;
using harness::Result;

constexpr int kReadyTimeoutMs = 20'000;

std::string wq_demo_bin() { return harness::getenv_str("WQ_DEMO_BIN"); }

std::vector<std::string> demo_argv(bool hold) {
  std::vector<std::string> a = {harness::Home::bin(), "--home", Home::get().path(), "run", "--", wq_demo_bin()};
  if (hold) a.push_back("--hold");
  return a;
}

// Starts `shmrdma run -- wq_demo --hold` and waits for "READY <pid>".
// Returns the pid from that line (the run command execs, so it is the child).
pid_t start_held(Child& c) {
  if (!c.start(demo_argv(true), harness::kDialog)) {
    ADD_FAILURE() << c.output();
    return -1;
  }
  auto line = c.wait_line("READY ", kReadyTimeoutMs);
  if (!line) {
    Result r = c.wait(1000);
    ADD_FAILURE() << "wq_demo --hold did not print READY within " << kReadyTimeoutMs << " ms: " << r.describe();
    return -1;
  }
  pid_t pid = static_cast<pid_t>(std::strtol(line->c_str() + 6, nullptr, 10));
  EXPECT_EQ(pid, c.pid()) << "READY line: " << *line << " (shmrdma run should exec the program in place)";
  return pid;
}

class WqDemo : public ::testing::Test {
 protected:
  void SetUp() override {
    if (wq_demo_bin().empty()) GTEST_FAIL() << "WQ_DEMO_BIN is not set";
  }
};

TEST_F(WqDemo, RunsToCompletion) {
  HARNESS_REQUIRE_DEVICE();
  Result r = harness::run(demo_argv(false));
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.describe();
  EXPECT_EQ(r.err, "") << "wq_demo wrote to stderr";
  // Its context is gone once it exited: the process itself removed its
  // segment (checked before `status`, which would sweep a leftover one).
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "wq_demo left context files behind: " << harness::join(harness::Home::get().ctx_files());
  nlohmann::json st = Home::get().status();
  EXPECT_TRUE(Home::pids(st).empty()) << st.dump(2);
}

TEST_F(WqDemo, HeldObjectsAreListedByStatus) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  pid_t pid = start_held(c);
  ASSERT_GT(pid, 0);

  nlohmann::json st = Home::get().status();
  nlohmann::json p = Home::find_process(st, pid);
  ASSERT_FALSE(p.is_null()) << "pid " << pid << " is not listed:\n" << st.dump(2);
  EXPECT_EQ(p.value("command", ""), "wq_demo") << p.dump(2);
  ASSERT_TRUE(p.contains("objects")) << p.dump(2);
  const auto& o = p["objects"];
  EXPECT_EQ(o.value("pd", -1), 1) << o.dump();
  EXPECT_EQ(o.value("cq", -1), 1) << o.dump();
  EXPECT_EQ(o.value("wq", -1), 4) << o.dump();
  EXPECT_EQ(o.value("rwq_ind_table", -1), 1) << o.dump();
  ASSERT_TRUE(p.contains("wqs") && p["wqs"].is_array()) << p.dump(2);
  EXPECT_EQ(p["wqs"].size(), 4u) << p.dump(2);
  int big_rdy = 0, small_reset = 0;
  std::vector<uint32_t> nums;
  for (const auto& w : p["wqs"]) {
    nums.push_back(w.value("wq_num", 0u));
    if (w.value("max_wr", 0) == 128 && w.value("max_sge", 0) == 4 && w.value("state", "") == "RDY") ++big_rdy;
    if (w.value("max_wr", 0) == 16 && w.value("max_sge", 0) == 1 && w.value("state", "") == "RESET") ++small_reset;
  }
  EXPECT_EQ(big_rdy, 1) << "expected exactly one WQ with max_wr 128, max_sge 4, state RDY:\n" << p["wqs"].dump(2);
  EXPECT_EQ(small_reset, 3) << "expected three WQs with max_wr 16, max_sge 1, state RESET:\n" << p["wqs"].dump(2);
  std::sort(nums.begin(), nums.end());
  EXPECT_EQ(std::adjacent_find(nums.begin(), nums.end()), nums.end()) << "WQ numbers repeat: " << p["wqs"].dump();
  EXPECT_EQ(harness::Home::get().ctx_segments().size(), 1u) << harness::join(harness::Home::get().ctx_files());

  // The text form lists it too.
  Result text = Home::get().shmrdma({"status"});
  ASSERT_TRUE(text.ok()) << text.describe();
  EXPECT_NE(text.out.find("pid " + std::to_string(pid)), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("1 PD, 1 CQ, 4 WQ, 1 RWQ_IND_TABLE"), std::string::npos) << text.out;

  ASSERT_TRUE(c.write_line("go"));
  Result r = c.wait();
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.describe();

  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "wq_demo left context files behind: " << harness::join(harness::Home::get().ctx_files());
  st = Home::get().status();
  EXPECT_TRUE(Home::find_process(st, pid).is_null()) << "pid " << pid << " still listed after exit:\n" << st.dump(2);
}

TEST_F(WqDemo, SigtermReleasesHold) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  pid_t pid = start_held(c);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  Result r = c.wait();
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("OK"), std::string::npos) << r.describe();
  EXPECT_TRUE(Home::find_process(Home::get().status(), pid).is_null());
}

TEST_F(WqDemo, SigkilledProcessIsReclaimed) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  pid_t pid = start_held(c);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(harness::Home::get().ctx_segments().size(), 1u) << "a held wq_demo should have one context segment: " << harness::join(harness::Home::get().ctx_files());
  int st = c.kill(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);

  // `up` on a device that is already up reclaims the dead process's context.
  Result up = Home::get().shmrdma({"up", "--name", "shm0"});
  ASSERT_TRUE(up.ok()) << up.describe();
  EXPECT_NE(up.out.find("reclaimed 1 context"), std::string::npos)
      << "`shmrdma up` should report reclaiming the killed process's context:\n" << up.describe();

  // `up` itself removed the dead context's files (checked before `status`,
  // which sweeps too).
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "left over after up: " << harness::join(harness::Home::get().ctx_files());

  nlohmann::json s = Home::get().status();
  EXPECT_TRUE(Home::find_process(s, pid).is_null()) << "killed pid " << pid << " still listed:\n" << s.dump(2);
  EXPECT_TRUE(Home::pids(s).empty()) << s.dump(2);
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "left over: " << harness::join(harness::Home::get().ctx_files());

  // A second `up` has nothing left to reclaim, and the device still works.
  Result up2 = Home::get().shmrdma({"up", "--name", "shm0"});
  ASSERT_TRUE(up2.ok()) << up2.describe();
  EXPECT_EQ(up2.out.find("reclaimed"), std::string::npos) << up2.out;
  Result again = harness::run(demo_argv(false));
  ASSERT_TRUE(again.ok()) << again.describe();
  EXPECT_NE(again.out.find("OK"), std::string::npos);
}

TEST_F(WqDemo, StatusAloneDropsKilledProcess) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  pid_t pid = start_held(c);
  ASSERT_GT(pid, 0);
  c.kill(SIGKILL);
  nlohmann::json s = Home::get().status();
  EXPECT_TRUE(Home::find_process(s, pid).is_null()) << "killed pid " << pid << " listed as live:\n" << s.dump(2);
  EXPECT_TRUE(harness::Home::get().ctx_files().empty()) << "left over: " << harness::join(harness::Home::get().ctx_files());
}

TEST_F(WqDemo, DownWithoutForceRefusesWhileHeld) {
  HARNESS_REQUIRE_DEVICE();
  Child c;
  pid_t pid = start_held(c);
  ASSERT_GT(pid, 0);
  Result down = Home::get().shmrdma({"down", "--name", "shm0"});
  EXPECT_NE(down.exit_code, 0) << "`shmrdma down` without --force removed a device in use:\n" << down.describe();
  EXPECT_NE(down.err.find(std::to_string(pid)), std::string::npos) << down.describe();
  ASSERT_TRUE(c.write_line("go"));
  Result r = c.wait();
  ASSERT_TRUE(r.ok()) << r.describe();
  // If down wrongly succeeded, bring the device back for the next tests.
  if (down.exit_code == 0) { ASSERT_TRUE(Home::get().shmrdma({"up", "--name", "shm0"}).ok()); }
}

}  // namespace
