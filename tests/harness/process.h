// Processes of the two-process tests: a child with pipes and deadlines, and
// run() for a command that runs to completion. Every wait has a deadline; a
// child still running when its Child goes out of scope is killed and reaped.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace harness {

using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

inline constexpr int kDefaultTimeoutMs = 30'000;

// The value of environment variable `name`, or "" when unset.
std::string getenv_str(const char* name);

// Milliseconds until `deadline`, 0 when it has passed.
inline int ms_left(Clock::time_point deadline) {
  auto d = std::chrono::duration_cast<Ms>(deadline - Clock::now()).count();
  return d < 0 ? 0 : static_cast<int>(d);
}

// The path of this program (/proc/self/exe): test binaries run themselves
// as the workers of their process pairs.
std::string self_exe();

// Undoes sh single quoting as `shmrdma env` writes it: 'a'\''b' -> a'b.
std::string shell_unquote(const std::string& s);

// How a process ended.
struct Result {
  bool started = false;    // posix_spawn succeeded
  bool timed_out = false;  // killed by us at the deadline
  int exit_code = -1;      // -1 unless it exited normally
  int term_signal = 0;     // the signal that ended it, if any
  std::string out;         // stdout (with stderr, when the child merged them)
  std::string err;         // stderr, when kept apart

  bool ok() const { return started && !timed_out && exit_code == 0; }
  std::string describe() const;
};

// Where a child's standard descriptors go.
struct Stdio {
  bool stdin_pipe = false;    // a pipe that write_line() feeds; else /dev/null
  bool stderr_apart = false;  // stderr collected on its own (errors()); else merged into output()
  int fd3 = -1;               // a descriptor the child gets as fd 3 (the control socket of worker pairs)
};

// A dialog: stdin from write_line(), stdout read line by line, stderr apart.
inline constexpr Stdio kDialog{true, true, -1};

class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { kill(); }

  // Starts args[0] (searched in PATH). On failure the reason is in output().
  bool start(const std::vector<std::string>& args, const Stdio& stdio = {});

  pid_t pid() const { return pid_; }

  // Everything read so far from stdout (and stderr when merged), and stderr
  // when kept apart.
  const std::string& output() const { return out_; }
  const std::string& errors() const { return err_; }

  // Reads what is available, waiting up to timeout_ms for something.
  void drain(int timeout_ms = 0);

  // Waits until the output contains `text` anywhere (true) or the deadline.
  bool wait_output(const std::string& text, Clock::time_point deadline);

  // The next line of output not returned before (without '\n'); nullopt at
  // the deadline or at the end of output (*eof says which).
  std::optional<std::string> read_line(int timeout_ms, bool* eof = nullptr);

  // Reads lines until one starts with `prefix` and returns it; nullopt at
  // the deadline or the end of output.
  std::optional<std::string> wait_line(const std::string& prefix, int timeout_ms);

  bool write_line(const std::string& line);
  void close_stdin();

  // Has it exited (reaped here; its status is kept for wait())?
  bool exited();

  // Waits for exit until the deadline (then kills it), reads the rest of its
  // output (for at most 2 s more: a grandchild may hold the pipes open).
  Result wait(Clock::time_point deadline);
  Result wait(int timeout_ms = kDefaultTimeoutMs) { return wait(Clock::now() + Ms(timeout_ms)); }

  // Sends `sig` and reaps the child; returns its wait status (0 if it was
  // not running). Output already written stays readable through output().
  int kill(int sig = SIGKILL);

  // Sends a signal without reaping (wait() reaps).
  void signal(int sig);

 private:
  void close_fds();

  pid_t pid_ = -1;
  int in_ = -1, out_fd_ = -1, err_fd_ = -1;
  int status_ = 0;
  size_t line_pos_ = 0;  // read_line's cursor in out_
  std::string out_, err_;
};

// Starts `c` with $DP_DEVICE set to `device` (empty: unset) for it alone:
// open_shm0 (verbs.h) in that child opens that device.
bool start_on(Child& c, const std::string& device, const std::vector<std::string>& args, const Stdio& stdio = {});

// Starts the two workers of a pair, each with one end of a new socketpair
// as fd 3 (wire.h), `b` on `b_device` when it is not empty (start_on).
// False when either could not start (the reason is in its output()).
bool start_pair(Child& a, const std::vector<std::string>& a_args, Child& b, const std::vector<std::string>& b_args,
                const std::string& b_device = "");

// Runs a command to completion with stdin from /dev/null, stdout and stderr
// apart; kills it at the timeout.
Result run(const std::vector<std::string>& args, int timeout_ms = kDefaultTimeoutMs);

}  // namespace harness
