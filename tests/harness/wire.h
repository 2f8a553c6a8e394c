// The control channel of the data-path worker pairs: fd 3 of each worker is
// one end of a socketpair made by the test driver. Fixed-size records and
// text lines, every read with a deadline.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

namespace harness {

inline constexpr int kCtlFd = 3;

// Writes all of buf (blocking; the peer reads promptly or is dead: EPIPE).
inline bool write_all(int fd, const void* buf, size_t len) {
  const char* p = static_cast<const char*>(buf);
  while (len) {
    ssize_t k = ::write(fd, p, len);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    len -= static_cast<size_t>(k);
  }
  return true;
}

// Reads exactly len bytes before the deadline.
inline bool read_all(int fd, void* buf, size_t len, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char* p = static_cast<char*>(buf);
  while (len) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pf{fd, POLLIN, 0};
    int n = ::poll(&pf, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    ssize_t k = ::read(fd, p, len);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    len -= static_cast<size_t>(k);
  }
  return true;
}

// Line reader over a descriptor: poll_line() never blocks longer than
// timeout_ms.
class LineReader {
 public:
  explicit LineReader(int fd) : fd_(fd) {}
  // 1: *line set; 0: no full line yet (timeout); -1: EOF or error.
  int poll_line(std::string* line, int timeout_ms) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        *line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return 1;
      }
      if (eof_) return -1;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd pf{fd_, POLLIN, 0};
      int n = ::poll(&pf, 1, left.count() > 0 ? static_cast<int>(left.count()) : 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return 0;
      char b[4096];
      ssize_t k = ::read(fd_, b, sizeof b);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        eof_ = true;
        continue;
      }
      buf_.append(b, static_cast<size_t>(k));
    }
  }
  bool send_line(const std::string& s) {
    std::string l = s + "\n";
    return write_all(fd_, l.data(), l.size());
  }

 private:
  int fd_;
  std::string buf_;
  bool eof_ = false;
};

}  // namespace harness
