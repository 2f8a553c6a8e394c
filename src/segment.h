// A shared-memory segment: a file in the state directory mapped MAP_SHARED.
// Created O_EXCL with mode 0600; attaching validates the header (magic,
// layout version, kind, size) against what this build expects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "layout.h"

namespace shmrdma {

class Mapping {
 public:
  Mapping() = default;
  ~Mapping() { reset(); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept { *this = static_cast<Mapping&&>(o); }
  Mapping& operator=(Mapping&& o) noexcept;

  // Creates `path` (must not exist), sizes it to `size` bytes (sparse) and
  // maps it. Fills in the header except `ready`. Returns 0 or an errno.
  static int create(const std::string& path, uint64_t size, layout::SegmentKind kind,
                    Mapping* out) noexcept;

  // Maps an existing segment after checking its header. `expected_size` of 0
  // accepts any size the header and the file agree on. Returns 0, ENOENT,
  // EAGAIN (not ready yet) or EPROTO (header does not match this build).
  static int attach(const std::string& path, layout::SegmentKind kind, uint64_t expected_size,
                    Mapping* out) noexcept;

  void reset() noexcept;

  // Publishes the segment (R0): everything written before is visible to an
  // attacher that saw ready (A0).
  void publish() noexcept;

  void* base() const noexcept { return base_; }
  uint64_t size() const noexcept { return size_; }
  int fd() const noexcept { return fd_; }
  const std::string& path() const noexcept { return path_; }
  layout::SegmentHeader* header() const noexcept {
    return static_cast<layout::SegmentHeader*>(base_);
  }
  template <typename T>
  T* at(uint64_t offset) const noexcept {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + offset);
  }
  bool contains(uint64_t offset, uint64_t len) const noexcept {
    return offset <= size_ && len <= size_ - offset;
  }

  // Gives the pages of [offset, offset+len) back to the system (tmpfs hole).
  void discard(uint64_t offset, uint64_t len) noexcept;

 private:
  void* base_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
  std::string path_;
};

// Writes `text` to `path` atomically (temp file + rename). Returns 0 or errno.
int write_file_atomic(const std::string& path, const std::string& text, unsigned mode = 0644) noexcept;
// Reads a small text file, trailing newline stripped. Returns 0 or errno.
int read_small_file(const std::string& path, std::string* out) noexcept;

}  // namespace shmrdma
