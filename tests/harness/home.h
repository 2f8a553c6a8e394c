// The private state home of one test binary: made with mkdtemp under /tmp
// (named after the test process's pid), device shm0 brought up in it, the
// environment of `shmrdma env` exported into this process before its first
// libibverbs call; at the end every device brought up here goes down
// (--force) and the home is removed. Homes of test processes that died
// without their teardown are swept by the next test binary.
//
// Register it once per test binary with HARNESS_TEST_ENVIRONMENT(options)
// and start every test with HARNESS_REQUIRE_DEVICE().
#pragma once

#include <sys/types.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "process.h"

namespace harness {

struct HomeOptions {
  // Part of the home's name: /tmp/shmrdma-<tag>-<pid>-XXXXXX.
  const char* tag = "test";
  // Skip every test when not root (else only when `shmrdma up` cannot make
  // the device node for lack of privileges).
  bool root_only = true;
};

class Home {
 public:
  static Home& get();

  const std::string& path() const { return path_; }
  const std::string& skip_reason() const { return skip_; }
  const std::string& fail_reason() const { return fail_; }
  bool ok() const { return ok_; }
  static std::string bin() { return getenv_str("SHMRDMA_BIN"); }

  // `shmrdma --home H <args...>`.
  Result shmrdma(const std::vector<std::string>& args, int timeout_ms = kDefaultTimeoutMs) const;

  // argv that runs `args` through `shmrdma --home H run --`.
  std::vector<std::string> run_argv(const std::vector<std::string>& args) const;

  // Parsed `shmrdma --home H status --json`; on failure a gtest failure and null.
  nlohmann::json status() const;

  // The status entry of process `pid` on device `dev`, or null if not listed.
  static nlohmann::json find_process(const nlohmann::json& status, long long pid, const std::string& dev = "shm0");
  // Every pid listed on `dev`.
  static std::vector<long long> pids(const nlohmann::json& status, const std::string& dev = "shm0");

  // Every file named ctx-* in H/devices/<dev>, sorted: what open verbs
  // contexts keep there. None may outlive its process.
  std::vector<std::string> ctx_files(const std::string& dev = "shm0") const;
  // The context segments among them (ctx-<slot>-<generation>), one per open context.
  std::vector<std::string> ctx_segments(const std::string& dev = "shm0") const;

  // Brings up one more IB device of this home once (removed at teardown).
  // False, with the reason in *why, on failure.
  bool up_device(const std::string& name, std::string* why);

  void setup(const HomeOptions& options);
  void teardown();

 private:
  Home() = default;
  static void sweep_stale_homes();

  std::string path_, skip_, fail_;
  std::vector<std::string> extra_;
  bool ok_ = false;
};

class HomeEnvironment : public ::testing::Environment {
 public:
  explicit HomeEnvironment(HomeOptions options) : options_(options) {}
  void SetUp() override { Home::get().setup(options_); }
  void TearDown() override { Home::get().teardown(); }

 private:
  HomeOptions options_;
};

// main() of a test binary whose tests all need root (`shmrdma up` makes the
// device node): exit 77 (meson: skipped) when not root, else the tests.
int run_tests_as_root(int argc, char** argv);

// Words joined by single spaces.
std::string join(const std::vector<std::string>& v);

// Runs this test program's two workers as a pair under the home (`--worker
// owner` and `--worker peer`, each followed by `extra`), waits up to
// `seconds` for the owner and at most 10 s more for the peer, prints both
// outputs, and expects both to exit 0 and no process to be left on any
// device. Returns the owner's result (not started: the pair did not start).
Result run_worker_pair(const std::vector<std::string>& extra, int seconds);

}  // namespace harness

// Registers the home of this test binary; once, at namespace scope.
#define HARNESS_TEST_ENVIRONMENT(...)                                              \
  static ::testing::Environment* const harness_home_env_ [[maybe_unused]] =       \
      ::testing::AddGlobalTestEnvironment(new ::harness::HomeEnvironment(::harness::HomeOptions{__VA_ARGS__}))

// First statement of every test: skip (with the reason) when the device
// cannot be set up for lack of privileges, fail when it cannot otherwise.
#define HARNESS_REQUIRE_DEVICE()                                                \
  do {                                                                          \
    auto& h_ = ::harness::Home::get();                                          \
    if (!h_.skip_reason().empty()) GTEST_SKIP() << h_.skip_reason();            \
    ASSERT_TRUE(h_.ok()) << "test home setup failed: " << h_.fail_reason();     \
  } while (0)
