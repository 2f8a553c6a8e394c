#include "recv_queue.h"

#include <cerrno>
#include <cstring>

namespace shmrdma {

uint32_t recv_wqe_stride(uint32_t max_sge) noexcept {
  return static_cast<uint32_t>(layout::align_up(
      kRingSlotHeaderBytes + sizeof(layout::RecvWqeHeader) + uint64_t{max_sge} * sizeof(layout::WireSge),
      layout::kCacheLine));
}

int post_recv_wqe(Ring ring, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept {
  RingResult r = ring.try_reserve();
  if (!r) return r.status == RingStatus::full ? ENOMEM : EAGAIN;
  layout::RecvWqeHeader h{wr_id, num_sge, 0};
  std::memcpy(r.handle.payload, &h, sizeof h);
  std::byte* out = r.handle.payload + sizeof h;
  for (uint32_t k = 0; k < num_sge; ++k) {
    layout::WireSge w{sges[k].addr, sges[k].length, sges[k].lkey};
    std::memcpy(out + k * sizeof w, &w, sizeof w);
  }
  ring.publish(r.handle);
  return 0;
}

}  // namespace shmrdma
