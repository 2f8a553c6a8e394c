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

// Receive takes (layout::QpEntry::rx_take): the WQE an initiator is
// delivering into a QP. One at a time per QP; see transport.cc.
inline uint32_t take_next_idle(uint32_t v) noexcept { return (v & ~layout::kTakeMask) + 4; }

// Idle -> reserved by (slot, generation). false with *v the busy value.
inline bool take_reserve(layout::QpEntry* t, uint32_t slot, uint32_t generation, uint32_t* v) noexcept {
  uint32_t cur = t->rx_take.load(std::memory_order_acquire);
  *v = cur;
  if ((cur & layout::kTakeMask) != layout::kTakeIdle) return false;
  if (!t->rx_take.compare_exchange_strong(cur, cur | layout::kTakeReserved, std::memory_order_acq_rel)) {
    *v = cur;
    return false;
  }
  t->rx_holder_slot.store(slot, std::memory_order_relaxed);
  t->rx_holder_generation.store(generation, std::memory_order_relaxed);
  *v = cur | layout::kTakeReserved;
  return true;
}

// Reserved -> taken: wr_id is the WQE now held (before its ring slot goes).
inline uint32_t take_hold(layout::QpEntry* t, uint32_t reserved, uint64_t wr_id) noexcept {
  t->rx_take_wr_id.store(wr_id, std::memory_order_relaxed);
  uint32_t taken = (reserved & ~layout::kTakeMask) | layout::kTakeTaken;
  t->rx_take.store(taken, std::memory_order_release);
  return taken;
}

// Ends the record at value v (reserved or taken) if it is still v: true
// when this caller ended it (and so completes the WQE of a taken record).
inline bool take_end(layout::QpEntry* t, uint32_t v) noexcept {
  return t->rx_take.compare_exchange_strong(v, take_next_idle(v), std::memory_order_acq_rel);
}

// Taken -> completing: true when this caller completes the WQE. It then
// pushes the completion and calls take_done; until then the record stays
// busy, so completions of one QP leave in the order their WQEs were taken.
inline bool take_complete_begin(layout::QpEntry* t, uint32_t taken) noexcept {
  uint32_t v = taken;
  return t->rx_take.compare_exchange_strong(v, (taken & ~layout::kTakeMask) | layout::kTakeCompleting,
                                            std::memory_order_acq_rel);
}
inline void take_done(layout::QpEntry* t, uint32_t taken) noexcept {
  t->rx_take.store(take_next_idle(taken), std::memory_order_release);
}

// The owner's side: ends a taken record, if any, and hands back its wr_id
// to complete (flush). A reserved one is left to its initiator.
inline bool take_reclaim(layout::QpEntry* t, uint64_t* wr_id) noexcept {
  uint32_t v = t->rx_take.load(std::memory_order_acquire);
  if ((v & layout::kTakeMask) != layout::kTakeTaken) return false;
  *wr_id = t->rx_take_wr_id.load(std::memory_order_acquire);
  return take_end(t, v);
}

// RESET: whatever is held is discarded.
inline void take_discard(layout::QpEntry* t) noexcept {
  uint32_t v = t->rx_take.load(std::memory_order_acquire);
  while (!t->rx_take.compare_exchange_weak(v, take_next_idle(v), std::memory_order_acq_rel)) {
  }
}

}  // namespace shmrdma
