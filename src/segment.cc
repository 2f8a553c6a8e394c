#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "proc.h"

namespace shmrdma {

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    reset();
    base_ = o.base_;
    size_ = o.size_;
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.base_ = nullptr;
    o.size_ = 0;
    o.fd_ = -1;
  }
  return *this;
}

void Mapping::reset() noexcept {
  if (base_) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
  base_ = nullptr;
  size_ = 0;
  fd_ = -1;
  path_.clear();
}

int Mapping::create(const std::string& path, uint64_t size, layout::SegmentKind kind,
                    Mapping* out) noexcept {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return e;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return e;
  }
  // A fork()ed child must not inherit a writable view of the parent's queues
  // (the same rule ibv_fork_init applies to registered memory).
  ::madvise(p, size, MADV_DONTFORK);
  Mapping m;
  m.base_ = p;
  m.size_ = size;
  m.fd_ = fd;
  m.path_ = path;
  auto* h = m.header();
  ProcessId self = self_process();
  h->magic = layout::kMagic;
  h->layout_version = layout::kLayoutVersion;
  h->kind = static_cast<uint32_t>(kind);
  h->layout_size = size;
  h->owner_pid = static_cast<uint32_t>(self.pid);
  h->owner_start_time = self.start_time;
  h->ready.store(0, std::memory_order_relaxed);
  *out = std::move(m);
  return 0;
}

int Mapping::attach(const std::string& path, layout::SegmentKind kind, uint64_t expected_size,
                    Mapping* out) noexcept {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return errno;
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    return EPROTO;
  }
  if (st.st_size == 0) {
    // Created (O_EXCL) but not sized yet: its creator is between open and
    // ftruncate. Like an unpublished segment, it is not ready.
    ::close(fd);
    return EAGAIN;
  }
  if (static_cast<uint64_t>(st.st_size) < sizeof(layout::SegmentHeader)) {
    ::close(fd);
    return EPROTO;
  }
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (expected_size != 0 && size != expected_size) {
    ::close(fd);
    return EPROTO;
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    return e;
  }
  ::madvise(p, size, MADV_DONTFORK);
  Mapping m;
  m.base_ = p;
  m.size_ = size;
  m.fd_ = fd;
  m.path_ = path;
  auto* h = m.header();
  // A0 pairs with R0 in publish(): after this, the creator's writes are visible.
  if (h->ready.load(std::memory_order_acquire) != layout::kReadyMagic) return EAGAIN;
  if (h->magic != layout::kMagic || h->layout_version != layout::kLayoutVersion ||
      h->kind != static_cast<uint32_t>(kind) || h->layout_size != size)
    return EPROTO;
  *out = std::move(m);
  return 0;
}

void Mapping::publish() noexcept {
  // R0 pairs with A0 in attach().
  header()->ready.store(layout::kReadyMagic, std::memory_order_release);
}

void Mapping::discard(uint64_t offset, uint64_t len) noexcept {
  uint64_t begin = layout::align_up(offset, layout::kPageSize);
  uint64_t end = (offset + len) / layout::kPageSize * layout::kPageSize;
  if (fd_ < 0 || end <= begin || !contains(begin, end - begin)) return;
  // Best effort: on a file system without hole punching the pages just stay.
  (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(begin),
                    static_cast<off_t>(end - begin));
}

int write_file_atomic(const std::string& path, const std::string& text, unsigned mode) noexcept {
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return errno;
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return e;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  ::fchmod(fd, mode);
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return e;
  }
  return 0;
}

int read_small_file(const std::string& path, std::string* out) noexcept {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char buf[4096];
  ssize_t n = ::read(fd, buf, sizeof buf);
  int e = errno;
  ::close(fd);
  if (n < 0) return e;
  std::string s(buf, static_cast<size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  *out = std::move(s);
  return 0;
}

}  // namespace shmrdma
