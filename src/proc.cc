#include "proc.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace shmrdma {

namespace {

// Reads /proc/<pid>/stat. The comm field may contain spaces and ')' so the
// fields are counted from the LAST ')'.
bool read_stat(pid_t pid, char* state, uint64_t* start_time) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ') return false;
  p += 2;  // field 3 (state)
  *state = *p;
  // Skip to field 22: we are at field 3, so 19 more separators.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return false;
    ++p;
  }
  char* end = nullptr;
  unsigned long long v = std::strtoull(p, &end, 10);
  if (end == p) return false;
  *start_time = v;
  return true;
}

}  // namespace

uint64_t process_start_time(pid_t pid) noexcept {
  char state = 0;
  uint64_t st = 0;
  if (pid <= 0 || !read_stat(pid, &state, &st)) return 0;
  return st;
}

bool process_alive(pid_t pid, uint64_t start_time) noexcept {
  char state = 0;
  uint64_t st = 0;
  if (pid <= 0 || !read_stat(pid, &state, &st)) return false;
  if (state == 'Z' || state == 'X') return false;
  return st == start_time;
}

ProcessId self_process() noexcept {
  // getpid() is cheap; the start time only changes with the pid (fork).
  // initial-exec: 16 bytes of static TLS, so the dlopen'ed provider never
  // calls __tls_get_addr here (LeakSanitizer of GCC 12 misreads the dynamic
  // TLS blocks of glibc 2.36 at exit and aborts the process).
  static thread_local ProcessId cached __attribute__((tls_model("initial-exec"))){0, 0};
  pid_t now = ::getpid();
  if (cached.pid != now) cached = ProcessId{now, process_start_time(now)};
  return cached;
}

}  // namespace shmrdma
