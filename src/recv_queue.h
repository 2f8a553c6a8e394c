// What every receive queue shares: a QP's receive queue, a WQ and an SRQ are
// all rings of receive WQEs (RecvWqeHeader + WireSge in one slot), posted by
// their owner and consumed by peers (transport.cc) or by the owner when it
// discards or flushes them.
#pragma once

#include <cstdint>
#include <cstring>

#include "layout.h"
#include "ring.h"

namespace shmrdma {

struct SgeIn {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

// Slot stride of a receive ring whose WQEs hold up to max_sge SGEs.
uint32_t recv_wqe_stride(uint32_t max_sge) noexcept;

// Writes one receive WQE into the ring (MPMC-safe producer). The caller
// checked num_sge against the queue's max_sge. 0, ENOMEM (full) or EAGAIN.
int post_recv_wqe(Ring ring, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept;

// Claims every posted WQE (at most one lap, so it is bounded even against a
// producer that keeps posting) and passes each wr_id to on_wqe.
template <typename F>
void drain_recv_ring(Ring ring, F&& on_wqe) noexcept {
  for (uint32_t n = 0; n < ring.capacity(); ++n) {
    RingResult r = ring.try_claim();
    if (!r) break;
    layout::RecvWqeHeader h;
    std::memcpy(&h, r.handle.payload, sizeof h);
    ring.release(r.handle);
    on_wqe(h.wr_id);
  }
}

}  // namespace shmrdma
