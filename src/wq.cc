// Receive work queues (IBV_WQT_RQ) and their indirection tables.
//
// A WQ is a ring of receive WQEs in the owner's segment: the owner produces
// (post_wq_recv; several threads may post, one at a time under the
// provider's Wq::post_lock, which the thread that posts takes without a
// locked instruction), peers consume when a message arrives, and the owner
// itself consumes when it flushes the queue.
#include <algorithm>
#include <cerrno>
#include <cstring>

#include "context.h"

namespace shmrdma {

namespace {

bool transition_allowed(WqState from, WqState to) {
  switch (to) {
    case WqState::kReset: return true;                         // any state may be reset
    case WqState::kErr: return true;                           // any state may fail
    case WqState::kRdy: return from == WqState::kReset || from == WqState::kRdy;
    default: return false;
  }
}

}  // namespace

int LocalContext::create_wq(uint32_t pd, uint32_t cq, uint32_t max_wr, uint32_t max_sge, WqInfo* out) noexcept {
  if (max_wr < 1 || max_wr > limits::kMaxQpWr || max_sge > limits::kMaxSge) return EINVAL;
  uint32_t capacity = Ring::capacity_for(max_wr);
  // A WQ always has room for at least one SGE: max_sge 0 is handed back as 1.
  uint32_t sges = round_up_pow2(std::max<uint32_t>(max_sge, 1));
  if (capacity == 0 || capacity > limits::kMaxQpWr || sges > limits::kMaxSge) return EINVAL;
  uint32_t stride = recv_wqe_stride(sges);
  std::lock_guard lk(mu_);
  if (pd >= pds_.size() || !pds_[pd].live || cq >= cqs_.size() || !cqs_[cq].live) return EINVAL;
  uint32_t i = 0;
  while (i < wqs_.size() && wqs_[i].live) ++i;
  if (i == wqs_.size()) return ENOMEM;
  Ring ring;
  uint64_t off = 0, bytes = 0;
  if (int rc = alloc_ring(capacity, stride, &ring, &off, &bytes)) return rc;
  if (int rc = charge(layout::kObjWq, limits::kMaxWq)) {
    heap_free(off, bytes);
    return rc;
  }
  auto* e = table<layout::WqEntry>(layout_.wq_table) + i;
  e->generation += 1;
  uint32_t wq_num = layout::make_qpn(slot_, i, layout::kQpnWq, e->generation);
  e->wq_num = wq_num;
  e->wq_type = 0;  // IBV_WQT_RQ
  e->wq_state.store(static_cast<uint32_t>(WqState::kReset), std::memory_order_relaxed);
  e->pd_index = pd;
  e->cq_index = cq;
  e->capacity = capacity;
  e->max_sge = sges;
  e->slot_stride = stride;
  e->ring_offset = off;
  e->ring_bytes = bytes;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  WqState_& s = wqs_[i];
  s = WqState_{};
  s.live = true;
  s.pd = pd;
  s.cq = cq;
  s.ring_off = off;
  s.ring_bytes = bytes;
  s.info = WqInfo{i, wq_num, capacity, sges, cq, ring};
  pds_[pd].refs += 1;
  cqs_[cq].refs += 1;
  *out = s.info;
  return 0;
}

WqState LocalContext::wq_state(uint32_t index) const noexcept {
  if (index >= layout_.wq_slots) return WqState::kUnknown;
  // Acquire: a poster that sees the new state also sees what the modifier
  // did before publishing it (pairs with the release in modify_wq).
  uint32_t v = table<layout::WqEntry>(layout_.wq_table)[index].wq_state.load(std::memory_order_acquire);
  return v <= static_cast<uint32_t>(WqState::kErr) ? static_cast<WqState>(v) : WqState::kUnknown;
}

int LocalContext::modify_wq(uint32_t index, uint32_t attr_mask, WqState curr, WqState next, WqState* state_out) noexcept {
  if (attr_mask == 0 || (attr_mask & ~(kWqAttrReserved - 1))) return EINVAL;
  if (attr_mask & kWqAttrFlags) return EOPNOTSUPP;  // no WQ flags (VLAN stripping, FCS...) exist here
  std::unique_lock lk(mu_);
  if (index >= wqs_.size() || !wqs_[index].live) return EINVAL;
  auto* e = table<layout::WqEntry>(layout_.wq_table) + index;
  WqState now = wq_state(index);
  if ((attr_mask & kWqAttrCurrState) && curr != now) return EINVAL;
  if (attr_mask & kWqAttrState) {
    if (next > WqState::kErr || !transition_allowed(now, next)) return EINVAL;
    WqInfo info = wqs_[index].info;
    if (next == WqState::kReset && now != WqState::kReset) {
      // Back to RESET discards whatever is posted, as on hardware. The ring
      // is drained rather than re-formatted: a peer that claimed a slot just
      // before the state change still releases it into the same lap.
      e->wq_state.store(static_cast<uint32_t>(WqState::kReset), std::memory_order_release);
      drain_recv_ring(info.ring, [](uint64_t) {});
    } else {
      e->wq_state.store(static_cast<uint32_t>(next), std::memory_order_release);
    }
    if (next == WqState::kErr) flush_wq(info);
    now = next;
  }
  if (state_out) *state_out = now;
  return 0;
}

void LocalContext::flush_wq(const WqInfo& wq) noexcept {
  drain_recv_ring(wq.ring, [&](uint64_t wr_id) {
    layout::Cqe c{};
    c.wr_id = wr_id;
    c.status = kWcWrFlushErr;
    c.opcode = kWcOpRecv;
    c.qp_num = wq.wq_num;
    (void)push_cqe(wq.cq_index, c);  // a full CQ loses it, as an overrun would
  });
}

int LocalContext::post_wq_recv(const WqInfo& wq, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept {
  if (num_sge > wq.max_sge) return EINVAL;
  WqState st = wq_state(wq.index);
  if (st != WqState::kRdy && st != WqState::kErr) return EINVAL;
  uint32_t pos = 0;
  if (int rc = post_recv_wqe(wq.ring, wr_id, sges, num_sge, &pos)) return rc;
  // A WQ in the error state completes what is posted to it with a flush
  // error right away; recheck after publishing so a concurrent move to ERR
  // cannot strand this WQE.
  if (wq_state(wq.index) == WqState::kErr) {
    std::lock_guard lk(mu_);
    if (wq.index < wqs_.size() && wqs_[wq.index].live) flush_wq(wqs_[wq.index].info);
  }
  return 0;
}

int LocalContext::destroy_wq(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= wqs_.size() || !wqs_[index].live) return EINVAL;
  if (wqs_[index].refs) return EBUSY;
  WqState_& s = wqs_[index];
  table<layout::WqEntry>(layout_.wq_table)[index].state.store(layout::kFree, std::memory_order_release);
  heap_free(s.ring_off, s.ring_bytes);
  if (s.pd < pds_.size() && pds_[s.pd].refs) pds_[s.pd].refs -= 1;
  if (s.cq < cqs_.size() && cqs_[s.cq].refs) cqs_[s.cq].refs -= 1;
  s = WqState_{};
  uncharge(layout::kObjWq);
  return 0;
}

int LocalContext::create_ind_table(uint32_t log_size, const uint32_t* wq_indices, uint32_t* index,
                                   uint32_t* ind_tbl_num) noexcept {
  if (log_size > limits::kMaxLogIndTblSize || !wq_indices) return EINVAL;
  uint32_t n = 1u << log_size;
  std::lock_guard lk(mu_);
  for (uint32_t k = 0; k < n; ++k)
    if (wq_indices[k] >= wqs_.size() || !wqs_[wq_indices[k]].live) return EINVAL;
  uint32_t i = 0;
  while (i < inds_.size() && inds_[i].live) ++i;
  if (i == inds_.size()) return ENOMEM;
  uint64_t bytes = uint64_t{n} * sizeof(uint32_t);
  uint64_t off = heap_alloc(bytes);
  if (!off) return ENOMEM;
  if (int rc = charge(layout::kObjIndTable, limits::kMaxRwqIndTables)) {
    heap_free(off, bytes);
    return rc;
  }
  IndState s;
  try {
    s.wqs.assign(wq_indices, wq_indices + n);
  } catch (const std::bad_alloc&) {
    uncharge(layout::kObjIndTable);
    heap_free(off, bytes);
    return ENOMEM;
  }
  std::memcpy(map_.at<uint32_t>(off), wq_indices, bytes);
  auto* e = table<layout::IndTableEntry>(layout_.ind_table) + i;
  e->generation += 1;
  e->log_size = log_size;
  e->ind_tbl_num = i;
  e->wq_list_offset = off;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  for (uint32_t w : s.wqs) wqs_[w].refs += 1;
  s.live = true;
  s.list_off = off;
  s.list_bytes = bytes;
  inds_[i] = std::move(s);
  *index = i;
  *ind_tbl_num = i;
  return 0;
}

int LocalContext::destroy_ind_table(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= inds_.size() || !inds_[index].live) return EINVAL;
  IndState& s = inds_[index];
  table<layout::IndTableEntry>(layout_.ind_table)[index].state.store(layout::kFree, std::memory_order_release);
  for (uint32_t w : s.wqs)
    if (w < wqs_.size() && wqs_[w].refs) wqs_[w].refs -= 1;
  heap_free(s.list_off, s.list_bytes);
  s = IndState{};
  uncharge(layout::kObjIndTable);
  return 0;
}

}  // namespace shmrdma
