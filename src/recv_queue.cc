#include "recv_queue.h"

#include <cerrno>
#include <cstring>

namespace shmrdma {

uint32_t recv_wqe_stride(uint32_t max_sge) noexcept {
  return static_cast<uint32_t>(layout::align_up(
      kRingSlotHeaderBytes + sizeof(layout::RecvWqeHeader) + uint64_t{max_sge} * sizeof(layout::WireSge),
      layout::kCacheLine));
}

}  // namespace shmrdma
