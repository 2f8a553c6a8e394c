#include "async.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace shmrdma {

int create_async_fifo(const std::string& path, int* read_fd, int* write_fd) noexcept {
  if (::mkfifo(path.c_str(), 0600) != 0) return errno;
  // O_RDWR: opening does not wait for a writer, and the FIFO never reports
  // end-of-file while we hold it (peers come and go).
  int r = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (r < 0) {
    int e = errno;
    ::unlink(path.c_str());
    return e;
  }
  int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (w < 0) {
    int e = errno;
    ::close(r);
    ::unlink(path.c_str());
    return e;
  }
  *read_fd = r;
  *write_fd = w;
  return 0;
}

int open_async_fifo_writer(const std::string& path) noexcept {
  int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -1;
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool write_async_event(int fd, uint32_t event_type, uint64_t element) noexcept {
  if (fd < 0) return false;
  AsyncDesc d{element, event_type, 0};
  // 16 bytes < PIPE_BUF: the write is atomic, never interleaved.
  return ::write(fd, &d, sizeof d) == static_cast<ssize_t>(sizeof d);
}

}  // namespace shmrdma
