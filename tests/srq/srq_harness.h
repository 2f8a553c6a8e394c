// Harness of the SRQ and qp_ex tests: a private state home per test binary
// (mkdtemp, `shmrdma up`, the environment of `shmrdma env` exported into this
// process, `down --force` and removal at the end), child processes run
// through `shmrdma run` with line-oriented stdin/stdout and deadlines, and
// small verbs helpers. Only the public libibverbs API and the `shmrdma`
// command are used; the project's internal headers are off limits.
#pragma once

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace srqt {

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

// A child with a pipe to its stdin and one from its stdout+stderr. The
// destructor kills (SIGKILL) and reaps it if it still runs.
class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill(); }

  bool start(const std::vector<std::string>& args) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0) return fail("pipe");
    if (::pipe2(out, O_CLOEXEC) != 0) {
      ::close(in[0]);
      ::close(in[1]);
      return fail("pipe");
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, out[1], 2);
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = ::posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    if (rc != 0) {
      ::close(in[1]);
      ::close(out[0]);
      pid_ = -1;
      out_ = "posix_spawnp " + args[0] + ": " + std::strerror(rc);
      return false;
    }
    in_ = in[1];
    fd_ = out[0];
    return true;
  }

  pid_t pid() const { return pid_; }
  const std::string& output() const { return out_; }

  bool write_line(const std::string& line) {
    if (in_ < 0) return false;
    std::string s = line + "\n";
    return ::write(in_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
  }

  // The first line of output starting with `prefix` that was not returned
  // before, or nullopt at the deadline / end of output.
  std::optional<std::string> wait_line(const std::string& prefix, int timeout_ms) {
    auto deadline = Clock::now() + Ms(timeout_ms);
    for (;;) {
      size_t pos = scanned_;
      while (pos < out_.size()) {
        size_t nl = out_.find('\n', pos);
        if (nl == std::string::npos) break;
        std::string line = out_.substr(pos, nl - pos);
        pos = nl + 1;
        scanned_ = pos;
        if (line.rfind(prefix, 0) == 0) return line;
      }
      if (fd_ < 0 || Clock::now() >= deadline) return std::nullopt;
      drain(std::min(ms_left(deadline), 50));
    }
  }

  // Waits for exit (killing it at the deadline); true when it exited 0.
  bool wait_exit(int timeout_ms, std::string* why) {
    auto deadline = Clock::now() + Ms(timeout_ms);
    close_in();
    for (;;) {
      int st = 0;
      pid_t r = pid_ > 0 ? ::waitpid(pid_, &st, WNOHANG) : -1;
      if (r == pid_ && pid_ > 0) {
        pid_ = -1;
        auto until = Clock::now() + Ms(2000);
        while (fd_ >= 0 && Clock::now() < until) drain(50);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
        *why = WIFEXITED(st) ? "exit code " + std::to_string(WEXITSTATUS(st))
                             : "killed by signal " + std::to_string(WTERMSIG(st));
        return false;
      }
      if (pid_ <= 0) {
        *why = "not running";
        return false;
      }
      if (Clock::now() >= deadline) {
        kill();
        *why = "TIMED OUT (killed)";
        return false;
      }
      drain(20);
    }
  }

  void kill() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int st = 0;
      while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
      }
      pid_ = -1;
    }
    drain(0);
    close_in();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  bool fail(const char* what) {
    out_ = std::string(what) + ": " + std::strerror(errno);
    return false;
  }
  void close_in() {
    if (in_ >= 0) ::close(in_);
    in_ = -1;
  }
  void drain(int timeout_ms) {
    if (fd_ < 0) return;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return;
    char b[16384];
    ssize_t k = ::read(fd_, b, sizeof b);
    if (k > 0) {
      out_.append(b, static_cast<size_t>(k));
    } else if (k == 0 || errno != EINTR) {
      ::close(fd_);
      fd_ = -1;
    }
  }

  pid_t pid_ = -1;
  int in_ = -1, fd_ = -1;
  size_t scanned_ = 0;
  std::string out_;
};

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

// Runs a command to completion; returns its exit code (-1 on failure to
// start, timeout or signal) and its output.
inline int run(const std::vector<std::string>& args, std::string* out, int timeout_ms = 30000) {
  Child c;
  if (!c.start(args)) {
    *out = c.output();
    return -1;
  }
  std::string why;
  bool ok = c.wait_exit(timeout_ms, &why);
  *out = c.output() + (ok ? "" : "\n[" + why + "]");
  return ok ? 0 : (why.rfind("exit code ", 0) == 0 ? std::atoi(why.c_str() + 10) : -1);
}

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
  static std::string bin() { return getenv_str("SHMRDMA_BIN"); }

  // argv that runs `args` through `shmrdma --home H run --`.
  std::vector<std::string> run_argv(std::vector<std::string> args) const {
    std::vector<std::string> argv = {bin(), "--home", path_, "run", "--"};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  int shmrdma(std::vector<std::string> args, std::string* out) const {
    std::vector<std::string> argv = {bin(), "--home", path_};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(argv, out);
  }

  void setup() {
    ::signal(SIGPIPE, SIG_IGN);
    if (::geteuid() != 0) {
      skip_ = "not root: `shmrdma up` must create the device node under /dev/infiniband";
      return;
    }
    if (bin().empty()) {
      fail_ = "SHMRDMA_BIN is not set (meson passes the path of the shmrdma executable)";
      return;
    }
    char tmpl[] = "/tmp/shmrdma-srqtest-XXXXXX";
    if (!::mkdtemp(tmpl)) {
      fail_ = std::string("mkdtemp: ") + std::strerror(errno);
      return;
    }
    path_ = tmpl;
    std::string out;
    if (shmrdma({"up"}, &out) != 0) {
      fail_ = "shmrdma up failed: " + out;
      return;
    }
    if (shmrdma({"env"}, &out) != 0) {
      fail_ = "shmrdma env failed: " + out;
      return;
    }
    size_t pos = 0;
    while (pos < out.size()) {
      size_t nl = out.find('\n', pos);
      if (nl == std::string::npos) nl = out.size();
      std::string line = out.substr(pos, nl - pos);
      pos = nl + 1;
      if (line.rfind("export ", 0) != 0) continue;
      auto eq = line.find('=');
      if (eq == std::string::npos) continue;
      ::setenv(line.substr(7, eq - 7).c_str(), shell_unquote(line.substr(eq + 1)).c_str(), 1);
    }
    if (getenv_str("SYSFS_PATH").empty() || getenv_str("RDMAV_DRIVERS").empty()) {
      fail_ = "shmrdma env did not export SYSFS_PATH and RDMAV_DRIVERS:\n" + out;
      return;
    }
    ok_ = true;
  }

  void teardown() {
    if (path_.empty()) return;
    std::string out;
    if (shmrdma({"down", "--force"}, &out) != 0 && ok_) ADD_FAILURE() << "shmrdma down --force failed: " << out;
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

// ------------------------------------------------------------------ verbs

inline ibv_context* open_shm0(std::string* why) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list) {
    *why = std::string("ibv_get_device_list: ") + std::strerror(errno);
    return nullptr;
  }
  ibv_context* ctx = nullptr;
  for (int i = 0; i < n && !ctx; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "shm0") == 0) ctx = ibv_open_device(list[i]);
  if (!ctx) *why = "device shm0 not found or ibv_open_device failed: " + std::string(std::strerror(errno));
  ibv_free_device_list(list);
  return ctx;
}

inline uint16_t port_lid(ibv_context* ctx) {
  ibv_port_attr pa{};
  if (ibv_query_port(ctx, 1, &pa)) return 0;
  return pa.lid;
}

inline int qp_to_init(ibv_qp* qp, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = access;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

inline int qp_to_rtr(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 1;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

inline int qp_to_rts(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  return ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_MAX_QP_RD_ATOMIC);
}

inline int qp_to_err(ibv_qp* qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

// INIT -> RTR -> RTS towards `dest_qpn`; 0 or the first error.
inline int connect_qp(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, int access) {
  if (int rc = qp_to_init(qp, access)) return rc;
  if (int rc = qp_to_rtr(qp, dest_qpn, dlid)) return rc;
  return qp_to_rts(qp);
}

// Polls until `n` completions arrived or the deadline; returns how many.
inline int poll_n(ibv_cq* cq, ibv_wc* wc, int n, int timeout_ms = 10000) {
  auto deadline = Clock::now() + Ms(timeout_ms);
  int got = 0;
  while (got < n) {
    int k = ibv_poll_cq(cq, n - got, wc + got);
    if (k < 0) return got;
    got += k;
    if (got < n) {
      if (Clock::now() >= deadline) break;
      if (k == 0) std::this_thread::yield();
    }
  }
  return got;
}

// Waits up to timeout_ms for an async event (non-blocking async_fd + poll).
// The event is acknowledged before returning.
inline bool next_async_event(ibv_context* ctx, ibv_async_event* ev, int timeout_ms) {
  int fl = ::fcntl(ctx->async_fd, F_GETFL);
  if (!(fl & O_NONBLOCK)) ::fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
  auto deadline = Clock::now() + Ms(timeout_ms);
  for (;;) {
    if (ibv_get_async_event(ctx, ev) == 0) {
      ibv_ack_async_event(ev);
      return true;
    }
    int left = ms_left(deadline);
    if (left == 0) return false;
    pollfd p{ctx->async_fd, POLLIN, 0};
    (void)::poll(&p, 1, left);
  }
}

}  // namespace srqt

#define SRQT_ENVIRONMENT()                                                      \
  static ::testing::Environment* const srqt_env_ [[maybe_unused]] =            \
      ::testing::AddGlobalTestEnvironment(new ::srqt::HomeEnvironment)

#define SRQT_REQUIRE_DEVICE()                                                   \
  do {                                                                          \
    auto& h_ = ::srqt::Home::get();                                             \
    if (!h_.skip_reason().empty()) GTEST_SKIP() << h_.skip_reason();            \
    ASSERT_TRUE(h_.ok()) << "test home setup failed: " << h_.fail_reason();     \
  } while (0)
