// Shared harness of the data-path tests: a private state home per test
// binary (mkdtemp, `shmrdma up`, the environment of `shmrdma env`, `down
// --force` and removal at the end), child processes with deadlines, and
// `shmrdma status --json`.
//
// Only the public libibverbs API and the `shmrdma` command are used by these
// tests; the project's internal headers are off limits.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dp {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

inline std::string getenv_str(const char* n) {
  const char* v = std::getenv(n);
  return v ? v : "";
}

inline int ms_left(Clock::time_point deadline) {
  auto d = std::chrono::duration_cast<Ms>(deadline - Clock::now()).count();
  return d < 0 ? 0 : static_cast<int>(d);
}

struct RunResult {
  bool started = false;
  bool timed_out = false;
  int exit_code = -1;
  int term_signal = 0;
  std::string out;  // stdout and stderr

  bool ok() const { return started && !timed_out && exit_code == 0; }
  std::string describe() const {
    if (!started) return "could not start: " + out;
    std::string s;
    if (timed_out) s += "TIMED OUT (killed); ";
    if (term_signal) s += "killed by signal " + std::to_string(term_signal) + "; ";
    return s + "exit code " + std::to_string(exit_code) + "\n--- output ---\n" + out;
  }
};

inline void decode_status(int st, RunResult* r) {
  if (WIFEXITED(st)) r->exit_code = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) r->term_signal = WTERMSIG(st);
}

// A child process with stdout+stderr to a pipe that the parent drains, and
// optionally one extra descriptor passed as fd 3. Killed (SIGKILL) and reaped
// by the destructor if still running.
class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill(); }

  bool start(const std::vector<std::string>& args, int pass_fd = -1) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) {
      out_ = std::string("pipe: ") + std::strerror(errno);
      return false;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    posix_spawn_file_actions_adddup2(&fa, p[1], 2);
    if (pass_fd >= 0) posix_spawn_file_actions_adddup2(&fa, pass_fd, 3);  // dup2 clears FD_CLOEXEC
    std::vector<char*> argv;
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = ::posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(p[1]);
    if (rc != 0) {
      ::close(p[0]);
      pid_ = -1;
      out_ = "posix_spawnp " + args[0] + ": " + std::strerror(rc);
      return false;
    }
    fd_ = p[0];
    ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
    return true;
  }

  pid_t pid() const { return pid_; }

  // Reads whatever output is available (waits up to timeout_ms for some).
  void drain(int timeout_ms = 0) {
    if (fd_ < 0) return;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return;
    char b[65536];
    for (;;) {
      ssize_t k = ::read(fd_, b, sizeof b);
      if (k > 0) {
        out_.append(b, static_cast<size_t>(k));
        continue;
      }
      if (k == 0) {
        ::close(fd_);
        fd_ = -1;
      }
      return;
    }
  }

  const std::string& output() const { return out_; }

  // Waits until a line of output contains `text` (true) or the deadline.
  bool wait_output(const std::string& text, Clock::time_point deadline) {
    while (out_.find(text) == std::string::npos) {
      if (fd_ < 0 || Clock::now() >= deadline) return false;
      drain(std::min(ms_left(deadline), 50));
      if (exited()) {
        drain(0);
        return out_.find(text) != std::string::npos;
      }
    }
    return true;
  }

  // Has it exited (reaped here; the status is kept)?
  bool exited() {
    if (pid_ < 0) return true;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      pid_ = -1;
      return true;
    }
    return false;
  }

  // Waits until exit or the deadline; on the deadline kills it.
  RunResult wait(Clock::time_point deadline) {
    RunResult r;
    r.started = true;
    while (!exited()) {
      if (Clock::now() >= deadline) {
        r.timed_out = true;
        kill();
        break;
      }
      drain(std::min(ms_left(deadline), 20));
    }
    // The rest of the output (bounded: a grandchild may hold the pipe open).
    auto until = Clock::now() + Ms(2000);
    while (fd_ >= 0 && Clock::now() < until) drain(50);
    close_fd();
    decode_status(status_, &r);
    r.out = out_;
    return r;
  }

  void kill(int sig = SIGKILL) {
    if (pid_ > 0) {
      ::kill(pid_, sig);
      int st = 0;
      while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
      }
      status_ = st;
      pid_ = -1;
    }
    drain(0);
    close_fd();
  }

  // Sends a signal without reaping (the caller reaps with wait()).
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }

 private:
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
  int status_ = 0;
  std::string out_;
};

inline RunResult run(const std::vector<std::string>& args, int timeout_ms = 30000) {
  Child c;
  RunResult r;
  if (!c.start(args)) {
    r.out = c.output();
    return r;
  }
  return c.wait(Clock::now() + Ms(timeout_ms));
}

inline std::string shell_unquote(const std::string& s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '\'') {
      size_t j = s.find('\'', i + 1);
      if (j == std::string::npos) j = s.size();
      out += s.substr(i + 1, j - i - 1);
      i = j + 1;
    } else if (s[i] == '\\' && i + 1 < s.size()) {
      out += s[i + 1];
      i += 2;
    } else {
      out += s[i++];
    }
  }
  return out;
}

// The per-binary state home with device shm0.
class Home {
 public:
  static Home& get() {
    static Home h;
    return h;
  }
  const std::string& path() const { return path_; }
  const std::string& skip_reason() const { return skip_; }
  const std::string& fail_reason() const { return fail_; }
  bool ok() const { return ok_; }
  std::string bin() const { return getenv_str("SHMRDMA_BIN"); }

  RunResult shmrdma(std::vector<std::string> args, int timeout_ms = 30000) const {
    std::vector<std::string> argv = {bin(), "--home", path_};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, timeout_ms);
  }

  // argv that runs `args` through `shmrdma --home H run`.
  std::vector<std::string> run_argv(std::vector<std::string> args) const {
    std::vector<std::string> argv = {bin(), "--home", path_, "run", "--"};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  nlohmann::json status() const {
    RunResult r = shmrdma({"status", "--json"});
    if (!r.ok()) {
      ADD_FAILURE() << "shmrdma status --json failed: " << r.describe();
      return nullptr;
    }
    try {
      return nlohmann::json::parse(r.out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "shmrdma status --json printed invalid JSON (" << e.what() << "):\n" << r.out;
      return nullptr;
    }
  }

  // The status entry of `pid` on shm0 (null if not listed).
  static nlohmann::json find_process(const nlohmann::json& st, long long pid) {
    if (!st.is_object() || !st.contains("devices")) return nullptr;
    for (const auto& d : st["devices"]) {
      if (d.value("name", "") != "shm0" || !d.contains("processes")) continue;
      for (const auto& p : d["processes"])
        if (p.value("pid", -1LL) == pid) return p;
    }
    return nullptr;
  }

  std::vector<std::string> ctx_files() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(path_ + "/devices/shm0", ec)) {
      std::string n = e.path().filename().string();
      if (n.rfind("ctx-", 0) == 0) out.push_back(n);
    }
    return out;
  }

  // Creates the home, brings shm0 up and exports the environment. Must run
  // before the first libibverbs call of the process.
  void setup() {
    ::signal(SIGPIPE, SIG_IGN);
    if (::geteuid() != 0) {
      skip_ = "not root: `shmrdma up` must create the device node under /dev/infiniband";
      std::printf("SKIP: %s\n", skip_.c_str());
      return;
    }
    if (bin().empty()) {
      fail_ = "SHMRDMA_BIN is not set (meson passes the path of the shmrdma executable)";
      return;
    }
    char tmpl[] = "/tmp/shmrdma-dptest-XXXXXX";
    if (!::mkdtemp(tmpl)) {
      fail_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    path_ = tmpl;
    RunResult up = shmrdma({"up"});
    if (!up.ok()) {
      fail_ = "shmrdma up failed: " + up.describe();
      return;
    }
    RunResult env = shmrdma({"env"});
    if (!env.ok()) {
      fail_ = "shmrdma env failed: " + env.describe();
      return;
    }
    size_t pos = 0;
    while (pos < env.out.size()) {
      size_t nl = env.out.find('\n', pos);
      if (nl == std::string::npos) nl = env.out.size();
      std::string line = env.out.substr(pos, nl - pos);
      pos = nl + 1;
      if (line.rfind("export ", 0) != 0) continue;
      auto eq = line.find('=');
      if (eq == std::string::npos) continue;
      std::string key = line.substr(7, eq - 7);
      ::setenv(key.c_str(), shell_unquote(line.substr(eq + 1)).c_str(), 1);
    }
    if (getenv_str("SYSFS_PATH").empty() || getenv_str("RDMAV_DRIVERS").empty()) {
      fail_ = "shmrdma env did not export SYSFS_PATH and RDMAV_DRIVERS:\n" + env.out;
      return;
    }
    ok_ = true;
  }

  // Brings up one more device of this home (IB, its own LIDs) once; it is
  // removed at teardown. False (with the reason in *why) on failure.
  bool up_device(const std::string& name, std::string* why) {
    for (const auto& d : extra_)
      if (d == name) return true;
    RunResult r = shmrdma({"up", "--name", name});
    if (!r.ok()) {
      *why = "shmrdma up --name " + name + " failed: " + r.describe();
      return false;
    }
    extra_.push_back(name);
    return true;
  }

  void teardown() {
    if (path_.empty()) return;
    for (const auto& d : extra_) {
      RunResult r = shmrdma({"down", "--force", "--name", d});
      if (ok_ && !r.ok()) ADD_FAILURE() << "shmrdma down --force --name " << d << " failed: " << r.describe();
    }
    extra_.clear();
    RunResult down = shmrdma({"down", "--force"});
    if (ok_ && !down.ok()) ADD_FAILURE() << "shmrdma down --force failed: " << down.describe();
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    path_.clear();
  }

 private:
  Home() = default;
  std::string path_, skip_, fail_;
  std::vector<std::string> extra_;
  bool ok_ = false;
};

// Starts `c` with $DP_DEVICE set to `device` (empty: unset) for it alone
// (dp_verbs.h open_shm0 opens that device).
inline bool start_on(Child& c, const std::string& device, const std::vector<std::string>& args, int pass_fd = -1) {
  const std::string old = getenv_str("DP_DEVICE");
  if (device.empty()) ::unsetenv("DP_DEVICE");
  else ::setenv("DP_DEVICE", device.c_str(), 1);
  const bool ok = c.start(args, pass_fd);
  if (old.empty()) ::unsetenv("DP_DEVICE");
  else ::setenv("DP_DEVICE", old.c_str(), 1);
  return ok;
}

class HomeEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { Home::get().setup(); }
  void TearDown() override { Home::get().teardown(); }
};

}  // namespace dp

#define DP_TEST_ENVIRONMENT()                                                   \
  static ::testing::Environment* const dp_env_ [[maybe_unused]] =              \
      ::testing::AddGlobalTestEnvironment(new ::dp::HomeEnvironment)

#define DP_REQUIRE_DEVICE()                                                    \
  do {                                                                         \
    auto& h_ = ::dp::Home::get();                                              \
    if (!h_.skip_reason().empty()) GTEST_SKIP() << h_.skip_reason();           \
    ASSERT_TRUE(h_.ok()) << "test home setup failed: " << h_.fail_reason();    \
  } while (0)
