// Shared receive queues (IBV_SRQT_BASIC and IBV_SRQT_XRC).
//
// An XRC SRQ also records its domain and its own CQ in the SrqEntry: the
// initiator of an XRC send finds it by its number (context slot + index +
// generation bits), checks it is an XRC SRQ of the target XRC_RECV QP's
// domain, takes a WQE and completes it into that CQ (transport.cc).
//
// An SRQ is a ring of receive WQEs in the owner's segment heap, described to
// peers by an SrqEntry: the owner produces (post_srq_recv; several threads
// may post, one at a time under the provider's Srq::post_lock, which the
// thread that posts takes without a locked instruction), peers consume when
// a message arrives for any QP attached to the SRQ (transport.cc reads the SrqEntry of the target QP).
// The owner never consumes from it itself: moving a QP to the error state
// does not flush the SRQ (it is not per QP), and destroying the SRQ simply
// discards what is still posted.
//
// An initiator whose send finds the SRQ empty and waits (RNR) sets the
// SrqEntry's initiator_waiting beside its target QP's; the owner's next
// post_srq_recv call (srq_posted, once per ibv_post_srq_recv) wakes the
// initiators of the QPs attached to the SRQ, as post_recv wakes a QP's.
//
// The limit event: SrqEntry::limit is armed by modify_srq (IBV_SRQ_LIMIT).
// Whoever claims a WQE (a peer, usually) checks it afterwards: when fewer
// WQEs than the limit remain it disarms the limit with an atomic exchange
// and raises IBV_EVENT_SRQ_LIMIT_REACHED in the owner's context. The
// exchange makes that one event per arming, whatever the number of
// concurrent consumers.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "context.h"

namespace shmrdma {

int LocalContext::create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, SrqInfo* out) noexcept {
  return create_srq_impl(pd, max_wr, max_sge, layout::kNoIndex, layout::kNoIndex, out);
}

int LocalContext::create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, uint32_t xrcd, uint32_t cq,
                             SrqInfo* out) noexcept {
  if (xrcd == layout::kNoIndex || cq == layout::kNoIndex) return EINVAL;
  return create_srq_impl(pd, max_wr, max_sge, xrcd, cq, out);
}

int LocalContext::create_srq_impl(uint32_t pd, uint32_t max_wr, uint32_t max_sge, uint32_t xrcd, uint32_t cq,
                                  SrqInfo* out) noexcept {
  const bool xrc = xrcd != layout::kNoIndex;
  if (max_wr < 1 || max_wr > limits::kMaxSrqWr || max_sge > limits::kMaxSrqSge) return EINVAL;
  uint32_t capacity = Ring::capacity_for(max_wr);
  // An SRQ always has room for at least one SGE: max_sge 0 is handed back as 1.
  uint32_t sges = round_up_pow2(std::max<uint32_t>(max_sge, 1));
  if (capacity == 0 || capacity > limits::kMaxSrqWr || sges > limits::kMaxSrqSge) return EINVAL;
  uint32_t stride = recv_wqe_stride(sges);
  std::lock_guard lk(mu_);
  if (srqs_.empty()) {
    try {
      srqs_.resize(layout_.srq_slots);
    } catch (const std::bad_alloc&) {
      return ENOMEM;
    }
  }
  if (pd >= pds_.size() || !pds_[pd].live) return EINVAL;
  if (xrc && (xrcd >= xrcds_.size() || !xrcds_[xrcd].live || cq >= cqs_.size() || !cqs_[cq].live)) return EINVAL;
  uint32_t i = 0;
  while (i < srqs_.size() && srqs_[i].live) ++i;
  if (i == srqs_.size()) return ENOMEM;
  Ring ring;
  uint64_t off = 0, bytes = 0;
  if (int rc = alloc_ring(capacity, stride, &ring, &off, &bytes)) return rc;
  if (int rc = charge(layout::kObjSrq, limits::kMaxSrq)) {
    heap_free(off, bytes);
    return rc;
  }
  auto* e = table<layout::SrqEntry>(layout_.srq_table) + i;
  e->generation += 1;
  // SRQ numbers have their own 24-bit space: context slot, table index and
  // the low bits of the generation, so they are unique device-wide.
  uint32_t srq_num = ((slot_ & 0xff) << 16) | ((i & 0xfff) << 4) | (e->generation & 0xf);
  e->srq_num = srq_num;
  e->pd_index = pd;
  e->capacity = capacity;
  e->max_sge = sges;
  e->slot_stride = stride;
  e->limit.store(0, std::memory_order_relaxed);
  e->initiator_waiting.store(0, std::memory_order_relaxed);
  e->ring_offset = off;
  e->ring_bytes = bytes;
  e->srq_type = xrc ? IBV_SRQT_XRC : IBV_SRQT_BASIC;
  e->cq_index = xrc ? cq : layout::kNoIndex;
  e->xrcd_dev = xrc ? xrcds_[xrcd].dev : 0;
  e->xrcd_ino = xrc ? xrcds_[xrcd].ino : 0;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  SrqState_& s = srqs_[i];
  s = SrqState_{};
  s.live = true;
  s.pd = pd;
  s.xrcd = xrcd;
  s.cq = cq;
  if (xrc) {
    xrcds_[xrcd].refs += 1;  // close_xrcd: EBUSY
    cqs_[cq].refs += 1;      // destroy_cq: EBUSY
  }
  s.ring_off = off;
  s.ring_bytes = bytes;
  s.info = SrqInfo{i, srq_num, capacity, sges, ring};
  pds_[pd].refs += 1;
  *out = s.info;
  return 0;
}

int LocalContext::modify_srq(uint32_t index, uint32_t attr_mask, uint32_t max_wr, uint32_t srq_limit) noexcept {
  (void)max_wr;
  if (attr_mask & ~uint32_t{IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT}) return EINVAL;
  std::lock_guard lk(mu_);
  if (index >= srqs_.size() || !srqs_[index].live) return EINVAL;
  // Resizing (IBV_SRQ_MAX_WR) would have to move posted WQEs while peers
  // consume them; the device does not advertise IBV_DEVICE_SRQ_RESIZE.
  if (attr_mask & IBV_SRQ_MAX_WR) return EINVAL;
  if (attr_mask & IBV_SRQ_LIMIT) {
    if (srq_limit > srqs_[index].info.capacity) return EINVAL;
    // Release: nothing else to publish, but a consumer that sees the armed
    // limit must see a live entry (it is, since before create returned).
    table<layout::SrqEntry>(layout_.srq_table)[index].limit.store(srq_limit, std::memory_order_release);
  }
  return 0;
}

int LocalContext::query_srq(uint32_t index, uint32_t* max_wr, uint32_t* max_sge, uint32_t* srq_limit) noexcept {
  std::lock_guard lk(mu_);
  if (index >= srqs_.size() || !srqs_[index].live) return EINVAL;
  *max_wr = srqs_[index].info.capacity;
  *max_sge = srqs_[index].info.max_sge;
  // 0 once the limit event fired (the consumer disarmed it) or when never armed.
  *srq_limit = std::min(table<layout::SrqEntry>(layout_.srq_table)[index].limit.load(std::memory_order_acquire),
                        srqs_[index].info.capacity);
  return 0;
}

int LocalContext::destroy_srq(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= srqs_.size() || !srqs_[index].live) return EINVAL;
  if (srqs_[index].refs) return EBUSY;
  SrqState_& s = srqs_[index];
  auto* e = table<layout::SrqEntry>(layout_.srq_table) + index;
  e->limit.store(0, std::memory_order_relaxed);
  e->state.store(layout::kFree, std::memory_order_release);
  heap_free(s.ring_off, s.ring_bytes);
  if (s.pd < pds_.size() && pds_[s.pd].refs) pds_[s.pd].refs -= 1;
  if (s.xrcd < xrcds_.size() && xrcds_[s.xrcd].refs) xrcds_[s.xrcd].refs -= 1;
  if (s.cq < cqs_.size() && cqs_[s.cq].refs) cqs_[s.cq].refs -= 1;
  s = SrqState_{};
  uncharge(layout::kObjSrq);
  return 0;
}

int LocalContext::post_srq_recv(const SrqInfo& srq, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept {
  if (num_sge > srq.max_sge || (num_sge && !sges)) return EINVAL;
  uint32_t pos = 0;
  int rc = post_recv_wqe(srq.ring, wr_id, sges, num_sge, &pos);
  if (rc == 0) warm_post_slot_.store(srq.ring.slot_address(pos + 1), std::memory_order_relaxed);
  return rc;
}

void LocalContext::srq_posted(const SrqInfo& srq) noexcept {
  // Pairs with the initiator's fence between setting the SRQ's
  // initiator_waiting and looking at the ring again (transport_take.cc
  // deliver): either it sees the WQEs just posted or we see its flag.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  auto& waiting = table<layout::SrqEntry>(layout_.srq_table)[srq.index].initiator_waiting;
  if (!waiting.load(std::memory_order_relaxed) || !waiting.exchange(0, std::memory_order_relaxed)) [[likely]]
    return;
  // Every QP attached to the SRQ whose initiator waits: the flag does not
  // say which (each QP's own flag does: wake_initiator). mu_ then sq_lock,
  // as progress_all takes them.
  std::lock_guard lk(mu_);
  for (Qp* q : live_qps_)
    if (q->srq == srq.index) wake_initiator(q);
}

void LocalContext::set_srq_user(uint32_t index, void* user) noexcept {
  std::lock_guard lk(mu_);
  if (index < srqs_.size() && srqs_[index].live) srqs_[index].user = user;
}

bool LocalContext::srq_usable(uint32_t srq, uint32_t pd) const noexcept {
  // The IB spec associates an SRQ with a PD; a QP attached to it must be in
  // the same PD (its receive buffers are checked against that PD).
  return srq < srqs_.size() && srqs_[srq].live && srqs_[srq].pd == pd && srqs_[srq].xrcd == layout::kNoIndex;
}

void LocalContext::srq_ref(uint32_t srq, int delta) noexcept {
  if (srq >= srqs_.size() || !srqs_[srq].live) return;
  if (delta > 0) srqs_[srq].refs += 1;
  else if (srqs_[srq].refs) srqs_[srq].refs -= 1;
}

void* LocalContext::srq_user(uint32_t index, uint32_t generation) const noexcept {
  if (index >= srqs_.size() || !srqs_[index].live) return nullptr;
  if ((table<layout::SrqEntry>(layout_.srq_table)[index].generation & 0xffffff) != generation) return nullptr;
  return srqs_[index].user;
}

}  // namespace shmrdma
