#include "process.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

extern char** environ;

namespace harness {

std::string getenv_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

std::string self_exe() {
  char b[4096];
  ssize_t n = ::readlink("/proc/self/exe", b, sizeof b - 1);
  if (n <= 0) return "";
  b[n] = '\0';
  return b;
}

std::string shell_unquote(const std::string& s) {
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

std::string Result::describe() const {
  if (!started) return "could not start: " + out + err;
  std::string s;
  if (timed_out) s += "TIMED OUT (killed); ";
  if (term_signal) s += "killed by signal " + std::to_string(term_signal) + "; ";
  s += "exit code " + std::to_string(exit_code) + "\n--- output ---\n" + out;
  if (!err.empty()) s += "--- stderr ---\n" + err;
  return s;
}

namespace {

void close_pair(int p[2]) {
  for (int i = 0; i < 2; ++i)
    if (p[i] >= 0) ::close(p[i]);
}

}  // namespace

bool Child::start(const std::vector<std::string>& args, const Stdio& stdio) {
  int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
  if ((stdio.stdin_pipe && ::pipe2(in, O_CLOEXEC) != 0) || ::pipe2(out, O_CLOEXEC) != 0 ||
      (stdio.stderr_apart && ::pipe2(err, O_CLOEXEC) != 0)) {
    out_ = std::string("pipe: ") + std::strerror(errno);
    close_pair(in);
    close_pair(out);
    close_pair(err);
    return false;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (stdio.stdin_pipe) posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  else posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  posix_spawn_file_actions_adddup2(&fa, stdio.stderr_apart ? err[1] : out[1], 2);
  if (stdio.fd3 >= 0) posix_spawn_file_actions_adddup2(&fa, stdio.fd3, 3);  // dup2 clears FD_CLOEXEC
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  int rc = ::posix_spawnp(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  for (int* p : {&in[0], &out[1], &err[1]}) {
    if (*p >= 0) ::close(*p);
    *p = -1;
  }
  if (rc != 0) {
    close_pair(in);
    close_pair(out);
    close_pair(err);
    pid_ = -1;
    out_ = "posix_spawnp " + args[0] + ": " + std::strerror(rc);
    return false;
  }
  in_ = in[1];
  out_fd_ = out[0];
  err_fd_ = err[0];
  for (int fd : {out_fd_, err_fd_})
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  return true;
}

void Child::drain(int timeout_ms) {
  pollfd p[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
  if (out_fd_ < 0 && err_fd_ < 0) {  // nothing to read: still honour the wait (callers loop on it)
    if (timeout_ms > 0) std::this_thread::sleep_for(Ms(std::min(timeout_ms, 5)));
    return;
  }
  int n = ::poll(p, 2, timeout_ms);  // negative descriptors are ignored by poll
  if (n <= 0) return;
  int* fds[2] = {&out_fd_, &err_fd_};
  std::string* sinks[2] = {&out_, &err_};
  for (int i = 0; i < 2; ++i) {
    if (*fds[i] < 0 || !(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    char b[65536];
    for (;;) {
      ssize_t k = ::read(*fds[i], b, sizeof b);
      if (k > 0) {
        sinks[i]->append(b, static_cast<size_t>(k));
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k == 0 || errno != EAGAIN) {
        ::close(*fds[i]);
        *fds[i] = -1;
      }
      break;
    }
  }
}

bool Child::wait_output(const std::string& text, Clock::time_point deadline) {
  while (out_.find(text) == std::string::npos) {
    if (out_fd_ < 0 || Clock::now() >= deadline) return false;
    drain(std::min(ms_left(deadline), 50));
    if (exited()) {
      drain(0);
      return out_.find(text) != std::string::npos;
    }
  }
  return true;
}

std::optional<std::string> Child::read_line(int timeout_ms, bool* eof) {
  auto deadline = Clock::now() + Ms(timeout_ms);
  if (eof) *eof = false;
  for (;;) {
    size_t nl = out_.find('\n', line_pos_);
    if (nl != std::string::npos) {
      std::string line = out_.substr(line_pos_, nl - line_pos_);
      line_pos_ = nl + 1;
      return line;
    }
    if (out_fd_ < 0) {
      if (eof) *eof = true;
      return std::nullopt;
    }
    int left = ms_left(deadline);
    if (left == 0) return std::nullopt;
    drain(std::min(left, 50));
  }
}

std::optional<std::string> Child::wait_line(const std::string& prefix, int timeout_ms) {
  auto deadline = Clock::now() + Ms(timeout_ms);
  for (;;) {
    auto line = read_line(ms_left(deadline));
    if (!line) return std::nullopt;
    if (line->rfind(prefix, 0) == 0) return line;
  }
}

bool Child::write_line(const std::string& line) {
  if (in_ < 0) return false;
  std::string s = line + "\n";
  return ::write(in_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
}

void Child::close_stdin() {
  if (in_ >= 0) ::close(in_);
  in_ = -1;
}

bool Child::exited() {
  if (pid_ < 0) return true;
  int st = 0;
  pid_t r = ::waitpid(pid_, &st, WNOHANG);
  if (r == pid_ || (r < 0 && errno == ECHILD)) {
    status_ = r == pid_ ? st : 0;
    pid_ = -1;
    return true;
  }
  return false;
}

Result Child::wait(Clock::time_point deadline) {
  Result r;
  r.started = true;
  while (!exited()) {
    if (Clock::now() >= deadline) {
      r.timed_out = true;
      kill();
      break;
    }
    drain(std::min(ms_left(deadline), 20));
  }
  auto until = Clock::now() + Ms(2000);
  while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < until) drain(50);
  close_fds();
  if (WIFEXITED(status_)) r.exit_code = WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) r.term_signal = WTERMSIG(status_);
  r.out = out_;
  r.err = err_;
  return r;
}

int Child::kill(int sig) {
  int st = 0;
  if (pid_ > 0) {
    ::kill(pid_, sig);
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    status_ = st;
    pid_ = -1;
  }
  drain(0);
  close_fds();
  return st;
}

void Child::signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

void Child::close_fds() {
  close_stdin();
  for (int* fd : {&out_fd_, &err_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

bool start_on(Child& c, const std::string& device, const std::vector<std::string>& args, const Stdio& stdio) {
  const std::string old = getenv_str("DP_DEVICE");
  if (device.empty()) ::unsetenv("DP_DEVICE");
  else ::setenv("DP_DEVICE", device.c_str(), 1);
  const bool ok = c.start(args, stdio);
  if (old.empty()) ::unsetenv("DP_DEVICE");
  else ::setenv("DP_DEVICE", old.c_str(), 1);
  return ok;
}

bool start_pair(Child& a, const std::vector<std::string>& a_args, Child& b, const std::vector<std::string>& b_args,
                const std::string& b_device) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
  const bool ok = a.start(a_args, {.fd3 = sv[0]}) &&
                  (b_device.empty() ? b.start(b_args, {.fd3 = sv[1]}) : start_on(b, b_device, b_args, {.fd3 = sv[1]}));
  ::close(sv[0]);
  ::close(sv[1]);
  return ok;
}

Result run(const std::vector<std::string>& args, int timeout_ms) {
  Child c;
  if (!c.start(args, Stdio{false, true, -1})) {
    Result r;
    r.err = c.output();
    return r;
  }
  return c.wait(timeout_ms);
}

}  // namespace harness
