// Allocator for the heap area of a context segment. Its bookkeeping lives in
// the owner's private memory: peers never allocate in another process's
// segment, so nothing here is shared or needs to trust shared memory.
// Not thread-safe: the owner serialises control-path calls.
#pragma once

#include <cstdint>
#include <map>

namespace shmrdma {

class HeapAllocator {
 public:
  HeapAllocator() = default;
  HeapAllocator(uint64_t offset, uint64_t size) { reset(offset, size); }
  void reset(uint64_t offset, uint64_t size);

  // Returns the offset of a block of at least `size` bytes aligned to `align`
  // (a power of two >= 64), or 0 when the heap cannot satisfy the request.
  uint64_t allocate(uint64_t size, uint64_t align) noexcept;
  // Returns a block obtained from allocate() with the same size.
  void release(uint64_t offset, uint64_t size) noexcept;

  uint64_t bytes_free() const noexcept { return free_bytes_; }

 private:
  static uint64_t round(uint64_t size) { return (size + 63) & ~uint64_t{63}; }
  std::map<uint64_t, uint64_t> free_;  // offset -> length, coalesced
  uint64_t free_bytes_ = 0;
};

}  // namespace shmrdma
