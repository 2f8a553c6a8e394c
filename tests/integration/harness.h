// Shared harness of the integration tests: a private state home per test
// binary, child processes with timeouts, and `shmrdma status --json`.
//
// Only the public libibverbs API and the `shmrdma` command are used here; the
// project's internal headers are off limits to these tests.
//
// Every test binary registers HomeEnvironment (see SHMRDMA_TEST_ENVIRONMENT
// below). Its SetUp runs before any test, hence before the first libibverbs
// call of the process: it creates the home with mkdtemp, runs
// `shmrdma --home H up --name shm0`, and setenv()s what `shmrdma --home H env`
// exports. TearDown runs `shmrdma --home H down --force` and removes H.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace itest {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

inline constexpr int kDefaultTimeoutMs = 30'000;

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// The `shmrdma` executable under test (meson passes it in SHMRDMA_BIN).
inline std::string shmrdma_bin() { return env_or_empty("SHMRDMA_BIN"); }

inline int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Ms>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Waits for `pid` until `deadline`; on timeout kills it (SIGKILL), reaps it
// and returns false. *status receives the wait status.
inline bool wait_until(pid_t pid, Clock::time_point deadline, int* status) {
  for (;;) {
    int st = 0;
    pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) {
      *status = st;
      return true;
    }
    if (r < 0 && errno != EINTR) {
      *status = -1;
      return true;  // not our child any more (already reaped)
    }
    if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      *status = st;
      return false;
    }
    std::this_thread::sleep_for(Ms(5));
  }
}

struct Result {
  bool started = false;    // posix_spawn succeeded
  bool timed_out = false;  // killed by us at the deadline
  int exit_code = -1;      // -1 unless exited normally
  int term_signal = 0;     // signal that ended it, if any
  std::string out, err;

  bool ok() const { return started && !timed_out && exit_code == 0; }
  std::string describe() const {
    std::string s;
    if (!started) return "could not start: " + err;
    if (timed_out) s += "TIMED OUT (killed); ";
    if (term_signal) s += "killed by signal " + std::to_string(term_signal) + "; ";
    s += "exit code " + std::to_string(exit_code) + "\n--- stdout ---\n" + out + "--- stderr ---\n" + err;
    return s;
  }
};

inline void fill_status(int st, Result* r) {
  if (st == -1) return;
  if (WIFEXITED(st)) r->exit_code = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) r->term_signal = WTERMSIG(st);
}

inline std::vector<char*> to_argv(std::vector<std::string>& args) {
  std::vector<char*> v;
  for (auto& a : args) v.push_back(a.data());
  v.push_back(nullptr);
  return v;
}

// Runs argv[0] (searched in PATH) with stdin from /dev/null, capturing stdout
// and stderr separately. Kills it and marks timed_out after timeout_ms.
inline Result run(std::vector<std::string> args, int timeout_ms = kDefaultTimeoutMs) {
  Result r;
  int out_p[2], err_p[2];
  if (::pipe2(out_p, O_CLOEXEC) != 0) {
    r.err = std::strerror(errno);
    return r;
  }
  if (::pipe2(err_p, O_CLOEXEC) != 0) {
    r.err = std::strerror(errno);
    ::close(out_p[0]);
    ::close(out_p[1]);
    return r;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out_p[1], 1);
  posix_spawn_file_actions_adddup2(&fa, err_p[1], 2);
  std::vector<char*> argv = to_argv(args);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(out_p[1]);
  ::close(err_p[1]);
  if (rc != 0) {
    r.err = "posix_spawnp " + args[0] + ": " + std::strerror(rc);
    ::close(out_p[0]);
    ::close(err_p[0]);
    return r;
  }
  r.started = true;
  auto deadline = Clock::now() + Ms(timeout_ms);
  pollfd fds[2] = {{out_p[0], POLLIN, 0}, {err_p[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    int left = remaining_ms(deadline);
    if (left == 0) break;
    int n = ::poll(fds, 2, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      ssize_t k = ::read(fds[i].fd, buf, sizeof buf);
      if (k > 0) {
        sinks[i]->append(buf, static_cast<size_t>(k));
      } else if (k == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds)
    if (f.fd >= 0) ::close(f.fd);
  int st = 0;
  r.timed_out = !wait_until(pid, deadline, &st);
  fill_status(st, &r);
  return r;
}

// A long-running child with a pipe to its stdin and one from its stdout;
// its stderr goes to a file that is read for diagnostics. The destructor
// kills and reaps it if it is still running.
class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill_and_reap(); }

  bool start(std::vector<std::string> args, std::string* why) {
    int in_p[2], out_p[2];
    if (::pipe2(in_p, O_CLOEXEC) != 0 || ::pipe2(out_p, O_CLOEXEC) != 0) {
      *why = std::string("pipe: ") + std::strerror(errno);
      return false;
    }
    std::string tmpl = "/tmp/shmrdma-itest-" + std::to_string(::getpid()) + "-stderr-XXXXXX";
    int efd = ::mkstemp(tmpl.data());
    if (efd < 0) {
      *why = std::string("mkstemp: ") + std::strerror(errno);
      return false;
    }
    err_path_ = tmpl;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in_p[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out_p[1], 1);
    posix_spawn_file_actions_adddup2(&fa, efd, 2);
    std::vector<char*> argv = to_argv(args);
    int rc = ::posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in_p[0]);
    ::close(out_p[1]);
    ::close(efd);
    if (rc != 0) {
      ::close(in_p[1]);
      ::close(out_p[0]);
      pid_ = -1;
      *why = "posix_spawnp " + args[0] + ": " + std::strerror(rc);
      return false;
    }
    in_ = in_p[1];
    out_ = out_p[0];
    return true;
  }

  pid_t pid() const { return pid_; }

  // Reads one line of the child's stdout (without '\n'). nullopt on timeout
  // or EOF; *eof tells which.
  std::optional<std::string> read_line(int timeout_ms, bool* eof = nullptr) {
    auto deadline = Clock::now() + Ms(timeout_ms);
    if (eof) *eof = false;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        all_out_ += line + "\n";
        return line;
      }
      if (out_ < 0) {
        if (eof) *eof = true;
        return std::nullopt;
      }
      int left = remaining_ms(deadline);
      if (left == 0) return std::nullopt;
      pollfd p{out_, POLLIN, 0};
      int n = ::poll(&p, 1, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      char b[4096];
      ssize_t k = ::read(out_, b, sizeof b);
      if (k > 0) {
        buf_.append(b, static_cast<size_t>(k));
      } else if (k == 0 || errno != EINTR) {
        ::close(out_);
        out_ = -1;
      }
    }
  }

  // Reads lines until one starts with `prefix`; returns it (nullopt on
  // timeout or EOF).
  std::optional<std::string> wait_for(const std::string& prefix, int timeout_ms) {
    auto deadline = Clock::now() + Ms(timeout_ms);
    for (;;) {
      auto l = read_line(remaining_ms(deadline));
      if (!l) return std::nullopt;
      if (l->rfind(prefix, 0) == 0) return l;
    }
  }

  bool write_line(const std::string& line) {
    if (in_ < 0) return false;
    std::string s = line + "\n";
    return ::write(in_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
  }

  void close_stdin() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }

  // Waits for exit; drains the rest of stdout into out(). On timeout the
  // child is killed and the result says timed_out.
  Result wait(int timeout_ms = kDefaultTimeoutMs) {
    Result r;
    r.started = pid_ > 0;
    auto deadline = Clock::now() + Ms(timeout_ms);
    bool eof = false;
    while (!eof && remaining_ms(deadline) > 0) {
      if (!read_line(remaining_ms(deadline), &eof) && !eof) break;
    }
    if (pid_ > 0) {
      int st = 0;
      r.timed_out = !wait_until(pid_, deadline, &st);
      fill_status(st, &r);
      pid_ = -1;
    }
    r.out = all_out_ + buf_;
    r.err = stderr_text();
    close_fds();
    return r;
  }

  // SIGKILL, reap; returns the wait status.
  int kill_and_reap(int sig = SIGKILL) {
    int st = 0;
    if (pid_ > 0) {
      ::kill(pid_, sig);
      while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
    close_fds();
    return st;
  }

  std::string stderr_text() const {
    std::string s;
    if (err_path_.empty()) return s;
    if (FILE* f = std::fopen(err_path_.c_str(), "r")) {
      char b[4096];
      size_t k;
      while ((k = std::fread(b, 1, sizeof b, f)) > 0) s.append(b, k);
      std::fclose(f);
    }
    return s;
  }

  std::string output_so_far() const { return all_out_ + buf_; }

 private:
  void close_fds() {
    close_stdin();
    if (out_ >= 0) ::close(out_);
    out_ = -1;
    if (!err_path_.empty() && pid_ <= 0) {
      ::unlink(err_path_.c_str());
      err_path_.clear();
    }
  }

  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buf_, all_out_, err_path_;
};

// Undoes sh single quoting as written by `shmrdma env`: 'a'\''b' -> a'b.
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

// The per-binary state home.
class Home {
 public:
  static Home& get() {
    static Home h;
    return h;
  }

  const std::string& path() const { return path_; }
  bool ok() const { return ok_; }
  const std::string& skip_reason() const { return skip_; }
  const std::string& fail_reason() const { return fail_; }

  // `shmrdma --home H <args...>`
  Result shmrdma(std::vector<std::string> args, int timeout_ms = kDefaultTimeoutMs) const {
    std::vector<std::string> argv = {shmrdma_bin(), "--home", path_};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, timeout_ms);
  }

  // Parsed `shmrdma --home H status --json`; on failure adds a gtest failure
  // and returns null.
  nlohmann::json status() const {
    Result r = shmrdma({"status", "--json"});
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

  // The status entry of process `pid` on device `dev`, or null if not listed.
  static nlohmann::json find_process(const nlohmann::json& status, pid_t pid, const std::string& dev = "shm0") {
    if (!status.is_object() || !status.contains("devices")) return nullptr;
    for (const auto& d : status["devices"]) {
      if (d.value("name", "") != dev || !d.contains("processes")) continue;
      for (const auto& p : d["processes"])
        if (p.contains("pid") && p["pid"].get<long long>() == pid) return p;
    }
    return nullptr;
  }

  // All pids listed on `dev`.
  static std::vector<long long> pids(const nlohmann::json& status, const std::string& dev = "shm0") {
    std::vector<long long> out;
    if (!status.is_object() || !status.contains("devices")) return out;
    for (const auto& d : status["devices"])
      if (d.value("name", "") == dev && d.contains("processes"))
        for (const auto& p : d["processes"]) out.push_back(p.value("pid", -1LL));
    return out;
  }

  void setup() {
    ::signal(SIGPIPE, SIG_IGN);  // a child that died must not kill the test
    if (shmrdma_bin().empty()) {
      fail_ = "SHMRDMA_BIN is not set (meson passes the path of the shmrdma executable)";
      return;
    }
    sweep_stale_homes();
    std::string tmpl = "/tmp/shmrdma-itest-" + std::to_string(::getpid()) + "-XXXXXX";
    if (!::mkdtemp(tmpl.data())) {
      fail_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    path_ = tmpl;
    Result up = shmrdma({"up", "--name", "shm0"});
    if (!up.ok()) {
      bool cdev_problem = up.exit_code == 2 && up.err.find("device node") != std::string::npos;
      if (cdev_problem && ::geteuid() != 0) {
        skip_ = "`shmrdma up` cannot create the device node under /dev/infiniband because this is not "
                "root; create it once as root (see the hint) to run these tests:\n" + up.err;
      } else {
        fail_ = "`shmrdma --home " + path_ + " up --name shm0` failed: " + up.describe();
      }
      return;
    }
    Result env = shmrdma({"env"});
    if (!env.ok()) {
      fail_ = "`shmrdma env` failed: " + env.describe();
      return;
    }
    size_t pos = 0;
    int vars = 0;
    while (pos < env.out.size()) {
      size_t nl = env.out.find('\n', pos);
      if (nl == std::string::npos) nl = env.out.size();
      std::string line = env.out.substr(pos, nl - pos);
      pos = nl + 1;
      const std::string kExport = "export ";
      if (line.rfind(kExport, 0) != 0) continue;
      auto eq = line.find('=');
      if (eq == std::string::npos) continue;
      std::string key = line.substr(kExport.size(), eq - kExport.size());
      std::string val = shell_unquote(line.substr(eq + 1));
      ::setenv(key.c_str(), val.c_str(), 1);
      ++vars;
    }
    for (const char* k : {"SYSFS_PATH", "RDMAV_DRIVERS"}) {
      if (env_or_empty(k).empty()) {
        fail_ = std::string("`shmrdma env` did not export ") + k + ":\n" + env.out;
        return;
      }
    }
    if (vars == 0) {
      fail_ = "`shmrdma env` printed no export lines:\n" + env.out;
      return;
    }
    ok_ = true;
  }

  // A test binary that crashed never ran its TearDown: bring down and remove
  // the homes and files (/tmp/shmrdma-itest-<pid>-*) of test processes that
  // are gone.
  static void sweep_stale_homes() {
    const std::string prefix = "shmrdma-itest-";
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/tmp", ec)) {
      std::string n = e.path().filename().string();
      if (n.rfind(prefix, 0) != 0) continue;
      size_t dash = n.find('-', prefix.size());
      std::string pid_str = n.substr(prefix.size(), dash == std::string::npos ? 0 : dash - prefix.size());
      if (pid_str.empty() || pid_str.find_first_not_of("0123456789") != std::string::npos) continue;
      pid_t owner = static_cast<pid_t>(std::stol(pid_str));
      if (owner == ::getpid() || ::kill(owner, 0) == 0 || errno != ESRCH) continue;
      if (e.is_directory(ec))  // a home (else a child's stderr file)
        run({shmrdma_bin(), "--home", e.path().string(), "down", "--name", "shm0", "--force"});
      std::filesystem::remove_all(e.path(), ec);
    }
  }

  void teardown() {
    if (path_.empty()) return;
    Result down = shmrdma({"down", "--name", "shm0", "--force"});
    if (ok_ && !down.ok()) ADD_FAILURE() << "`shmrdma down --force` failed: " << down.describe();
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    path_.clear();
  }

 private:
  Home() = default;
  std::string path_, skip_, fail_;
  bool ok_ = false;
};

class HomeEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { Home::get().setup(); }
  void TearDown() override { Home::get().teardown(); }
};

// Every file named ctx-* in H/devices/<dev>: what open verbs contexts keep
// there (a segment per context, and whatever companions it has). None may
// outlive its process.
inline std::vector<std::string> context_files(const std::string& dev = "shm0") {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(Home::get().path() + "/devices/" + dev, ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind("ctx-", 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The context segments among them: ctx-<slot>-<generation>, one per open
// verbs context.
inline std::vector<std::string> context_segments(const std::string& dev = "shm0") {
  std::vector<std::string> out;
  for (const std::string& n : context_files(dev))
    if (n.find_first_not_of("0123456789-", 4) == std::string::npos) out.push_back(n);
  return out;
}

inline std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

}  // namespace itest

// Registers the home environment; use once per test binary at namespace scope.
#define SHMRDMA_TEST_ENVIRONMENT()                                                       \
  static ::testing::Environment* const shmrdma_itest_env_ [[maybe_unused]] =            \
      ::testing::AddGlobalTestEnvironment(new ::itest::HomeEnvironment)

// First statement of every test: skip (with the reason) when the device
// cannot be set up for lack of privileges, fail when it cannot for any other
// reason.
#define REQUIRE_DEVICE()                                                   \
  do {                                                                     \
    auto& h_ = ::itest::Home::get();                                       \
    if (!h_.skip_reason().empty()) GTEST_SKIP() << h_.skip_reason();       \
    ASSERT_TRUE(h_.ok()) << "test home setup failed: " << h_.fail_reason(); \
  } while (0)
