#include "heap.h"

#include <iterator>
#include <new>

namespace shmrdma {

void HeapAllocator::reset(uint64_t offset, uint64_t size) {
  free_.clear();
  free_bytes_ = 0;
  if (size >= 64) {
    uint64_t start = round(offset);
    uint64_t end = (offset + size) & ~uint64_t{63};
    if (end > start) {
      free_.emplace(start, end - start);
      free_bytes_ = end - start;
    }
  }
}

uint64_t HeapAllocator::allocate(uint64_t size, uint64_t align) noexcept {
  if (size == 0 || align < 64 || (align & (align - 1)) != 0) return 0;
  size = round(size);
  try {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      uint64_t start = it->first, len = it->second;
      uint64_t aligned = (start + align - 1) & ~(align - 1);
      if (aligned < start || aligned - start > len || len - (aligned - start) < size) continue;
      uint64_t head = aligned - start;
      uint64_t tail = len - head - size;
      free_.erase(it);
      if (head) free_.emplace(start, head);
      if (tail) free_.emplace(aligned + size, tail);
      free_bytes_ -= size;
      return aligned;
    }
  } catch (const std::bad_alloc&) {
  }
  return 0;
}

void HeapAllocator::release(uint64_t offset, uint64_t size) noexcept {
  if (size == 0) return;
  size = round(size);
  try {
    // A block that overlaps free space is a double release (possibly of a
    // block already merged with a neighbour): ignore it, keep the map sane.
    auto above = free_.lower_bound(offset);
    if (above != free_.end() && above->first < offset + size) return;
    if (above != free_.begin()) {
      auto below = std::prev(above);
      if (below->first + below->second > offset) return;
    }
    auto [it, inserted] = free_.emplace(offset, size);
    if (!inserted) return;
    free_bytes_ += size;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  } catch (const std::bad_alloc&) {
    // The block is leaked inside the segment; the segment dies with the context.
  }
}

}  // namespace shmrdma
