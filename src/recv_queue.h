// What every receive queue shares: a QP's receive queue, a WQ and an SRQ are
// all rings of receive WQEs (RecvWqeHeader + WireSge in one slot), posted by
// their owner and consumed by peers (transport.cc) or by the owner when it
// discards or flushes them.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "layout.h"
#include "ring.h"

namespace shmrdma {

// One SGE of a receive as the application posts it: the layout of
// ibv_sge and of the WQE's layout::WireSge (16 bytes: addr, length, lkey),
// so a post copies an application's SGE array into the slot as it is.
struct SgeIn {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};
static_assert(sizeof(SgeIn) == sizeof(layout::WireSge) && offsetof(SgeIn, length) == offsetof(layout::WireSge, length) &&
              offsetof(SgeIn, lkey) == offsetof(layout::WireSge, lkey));

// Slot stride of a receive ring whose WQEs hold up to max_sge SGEs.
uint32_t recv_wqe_stride(uint32_t max_sge) noexcept;

// Writes one receive WQE into the ring: its header, then the num_sge SGEs
// at `sges` (16-byte SgeIn / ibv_sge / WireSge entries, copied as bytes).
// The caller holds the lock that serializes the ring's producers (every
// receive ring has one kind of producer, its owner's posting threads: a
// QP's Qp::rq_lock, the provider's Srq::post_lock and Wq::post_lock), so
// the position moves with a plain store (Ring::try_reserve_sp: no CAS); it
// checked num_sge against the queue's max_sge. 0 with *pos the ring
// position filled, ENOMEM (full) or EAGAIN (the slot is ahead of the
// producer position: the ring's shared state was overwritten). Inline: it
// is most of every post_recv.
inline int post_recv_wqe(Ring ring, uint64_t wr_id, const void* sges, uint32_t num_sge, uint32_t* pos) noexcept {
  RingResult r = ring.try_reserve_sp();
  if (!r) [[unlikely]]
    return r.status == RingStatus::full ? ENOMEM : EAGAIN;
  const layout::RecvWqeHeader h{wr_id, num_sge, 0};
  std::memcpy(r.handle.payload, &h, sizeof h);
  std::byte* out = r.handle.payload + sizeof h;
  if (num_sge == 1) [[likely]]
    std::memcpy(out, sges, sizeof(layout::WireSge));
  else if (num_sge)
    std::memcpy(out, sges, size_t{num_sge} * sizeof(layout::WireSge));
  ring.publish(r.handle);
  *pos = r.handle.pos;
  return 0;
}

// Claims every posted WQE (at most one lap, so it is bounded even against a
// producer that keeps posting) and passes each wr_id to on_wqe. A slot
// adopted before our release (transport.cc: an initiator that found the
// holder of a take record dead may take over the slot that holder announced,
// which can be one we just claimed) is not ours: it is left out.
template <typename F>
void drain_recv_ring(Ring ring, F&& on_wqe) noexcept {
  for (uint32_t n = 0; n < ring.capacity(); ++n) {
    RingResult r = ring.try_claim();
    if (!r) break;
    layout::RecvWqeHeader h;
    std::memcpy(&h, r.handle.payload, sizeof h);
    if (ring.release_cas(r.handle)) on_wqe(h.wr_id);
  }
}

// Receive takes (layout::QpEntry::rx_take): the WQE an initiator is
// delivering into a QP. One at a time per QP; see transport.cc.
inline uint32_t take_next_idle(uint32_t v) noexcept { return (v & ~layout::kTakeMask) + 4; }

// Idle -> reserved by holder (layout::holder_word). false with *v the busy value.
inline bool take_reserve(layout::QpEntry* t, uint64_t holder, uint32_t* v) noexcept {
  uint32_t cur = t->rx_take.load(std::memory_order_acquire);
  *v = cur;
  if ((cur & layout::kTakeMask) != layout::kTakeIdle) return false;
  // seq_cst: a staging holder then reads the QP's state, Dekker with the
  // owner's flush (transport_staged.cc stash_staged); lock cmpxchg either way.
  if (!t->rx_take.compare_exchange_strong(cur, cur | layout::kTakeReserved, std::memory_order_seq_cst)) {
    *v = cur;
    return false;
  }
  t->rx_holder.store(holder, std::memory_order_relaxed);
  *v = cur | layout::kTakeReserved;
  return true;
}

// The ring position the holder of reserved record t is about to claim
// (ring.h try_claim_announced): before every claim attempt, so a holder that
// dies with the slot claimed and unreleased leaves its position behind.
// Relaxed: whoever reads it either found the holder dead (its stores all
// happened) or validates it against the slot's seq; the claim CAS releases it.
inline void take_announce(layout::QpEntry* t, uint32_t pos) noexcept {
  t->rx_take_pos.store(pos, std::memory_order_relaxed);
}

// Reserved -> taken: wr_id is the WQE now held (before its ring slot goes).
// A CAS: false when the record is no longer ours (RESET discarded it, or it
// was taken over), and then neither is the WQE. *taken: the new value.
inline bool take_hold(layout::QpEntry* t, uint32_t reserved, uint64_t wr_id, uint32_t* taken) noexcept {
  t->rx_take_wr_id.store(wr_id, std::memory_order_relaxed);
  *taken = (reserved & ~layout::kTakeMask) | layout::kTakeTaken;
  return t->rx_take.compare_exchange_strong(reserved, *taken, std::memory_order_acq_rel);
}

// Takes over record v (reserved or taken) of a dead holder: it becomes
// reserved by holder (layout::holder_word) with a new counter, keeping the
// position the dead holder announced, whose slot the new holder then adopts.
// false when v changed (someone else took it over or ended it). *nv: the new
// value.
inline bool take_transfer(layout::QpEntry* t, uint32_t v, uint64_t holder, uint32_t* nv) noexcept {
  *nv = take_next_idle(v) | layout::kTakeReserved;
  if (!t->rx_take.compare_exchange_strong(v, *nv, std::memory_order_acq_rel)) return false;
  t->rx_holder.store(holder, std::memory_order_relaxed);
  return true;
}

// Ends the record at value v (reserved or taken) if it is still v: true
// when this caller ended it (and so completes the WQE of a taken record).
inline bool take_end(layout::QpEntry* t, uint32_t v) noexcept {
  return t->rx_take.compare_exchange_strong(v, take_next_idle(v), std::memory_order_acq_rel);
}

// Taken -> completing: true when this caller completes the WQE. It then
// pushes the completion and calls take_done; until then the record stays
// busy, so completions of one QP leave in the order their WQEs were taken.
inline uint32_t take_completing(uint32_t taken) noexcept { return (taken & ~layout::kTakeMask) | layout::kTakeCompleting; }
inline bool take_complete_begin(layout::QpEntry* t, uint32_t taken) noexcept {
  uint32_t v = taken;
  return t->rx_take.compare_exchange_strong(v, take_completing(taken), std::memory_order_acq_rel);
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
