// Queue pairs: creation, destruction, receive posting, query.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "context.h"
#include "count.h"

namespace shmrdma {

int LocalContext::create_qp(const QpCreateArgs& a, Qp** out) noexcept {
  if (a.qp_type != IBV_QPT_RC && a.qp_type != IBV_QPT_UC && a.qp_type != IBV_QPT_UD &&
      a.qp_type != IBV_QPT_XRC_SEND && a.qp_type != IBV_QPT_XRC_RECV)
    return EOPNOTSUPP;
  // XRC_SEND: PD and send CQ, no receive side. XRC_RECV: only a domain (no
  // PD, CQs or queues: its receives come from the XRC SRQ each message names).
  const bool xrc_send = a.qp_type == IBV_QPT_XRC_SEND, xrc_recv = a.qp_type == IBV_QPT_XRC_RECV;
  if (xrc_recv ? a.xrcd == layout::kNoIndex : a.xrcd != layout::kNoIndex) return EINVAL;
  if ((xrc_send || xrc_recv) && a.srq != layout::kNoIndex) return EINVAL;
  const QpCaps c = xrc_recv ? QpCaps{} : a.caps;
  if (c.max_send_wr > limits::kMaxQpWr || c.max_recv_wr > limits::kMaxQpWr || c.max_send_sge > limits::kMaxSge ||
      c.max_recv_sge > limits::kMaxSge || c.max_inline_data > limits::kMaxInlineData)
    return EINVAL;
  // XRC QPs have no receive queue of their own, like a QP on an SRQ.
  bool has_srq = a.srq != layout::kNoIndex || xrc_send || xrc_recv;
  // With an SRQ no receive queue is allocated: its caps only pass the limit check above.
  std::unique_ptr<Qp> qp(new (std::nothrow) Qp());
  if (!qp) return ENOMEM;
  // Send queue: at least one WQE, rounded up to a power of two.
  QpCaps got;
  got.max_send_wr = round_up_pow2(std::max<uint32_t>(c.max_send_wr, 1));
  got.max_send_sge = round_up_pow2(std::max<uint32_t>(c.max_send_sge, 1));
  got.max_inline_data = c.max_inline_data ? std::max<uint32_t>(static_cast<uint32_t>(layout::align_up(c.max_inline_data, 64)),
                                                                 got.max_send_sge * sizeof(ibv_sge))
                                          : got.max_send_sge * sizeof(ibv_sge);
  got.max_inline_data = std::min(got.max_inline_data, limits::kMaxInlineData);
  if (!has_srq) {
    got.max_recv_wr = Ring::capacity_for(std::max<uint32_t>(c.max_recv_wr, 1));
    got.max_recv_sge = round_up_pow2(std::max<uint32_t>(c.max_recv_sge, 1));
    if (got.max_recv_wr > limits::kMaxQpWr || got.max_recv_sge > limits::kMaxSge) return EINVAL;
  }
  if (got.max_send_wr > limits::kMaxQpWr || got.max_send_sge > limits::kMaxSge) return EINVAL;
  uint32_t payload = std::max<uint32_t>(got.max_send_sge * sizeof(ibv_sge), got.max_inline_data);
  qp->sq_stride = static_cast<uint32_t>(layout::align_up(sizeof(SendSlot) + payload, 8));
  try {
    qp->sq_storage.assign(size_t{got.max_send_wr} * qp->sq_stride / 8, 0);
  } catch (const std::bad_alloc&) {
    return ENOMEM;
  }
  qp->sq_mask = got.max_send_wr - 1;

  std::lock_guard lk(mu_);
  const uint32_t pd = xrc_recv ? layout::kNoIndex : a.pd;
  const uint32_t send_cq = xrc_recv ? layout::kNoIndex : a.send_cq;
  const uint32_t recv_cq = (xrc_recv || xrc_send) ? layout::kNoIndex : a.recv_cq;
  if (xrc_recv) {
    if (a.xrcd >= xrcds_.size() || !xrcds_[a.xrcd].live) return EINVAL;
  } else {
    if (pd >= pds_.size() || !pds_[pd].live || send_cq >= cqs_.size() || !cqs_[send_cq].live) return EINVAL;
    if (!xrc_send && (recv_cq >= cqs_.size() || !cqs_[recv_cq].live)) return EINVAL;
  }
  if (a.srq != layout::kNoIndex && !srq_usable(a.srq, a.pd)) return EINVAL;  // srq.cc: live, same PD
  // The FIFOs of own completions the QP will complete into (local_cq.h):
  // room in their producer lists now, so nothing fails after the QP exists.
  qp->send_local = send_cq != layout::kNoIndex ? cqs_[send_cq].info.local : nullptr;
  qp->recv_cq = recv_cq;
  LocalCq* fifos[2];
  own_fifos(qp.get(), fifos);
  try {
    for (LocalCq* l : fifos)
      if (l) l->producers.reserve(l->producers.size() + 1);
  } catch (...) {
    return ENOMEM;
  }
  uint32_t i = 0;
  while (i < qps_.size() && qps_[i]) ++i;
  if (i == qps_.size()) return ENOMEM;
  uint64_t rq_off = 0, rq_bytes = 0;
  Ring rq;
  uint32_t stride = 0;
  if (!has_srq) {
    stride = recv_wqe_stride(got.max_recv_sge);
    if (int rc = alloc_ring(got.max_recv_wr, stride, &rq, &rq_off, &rq_bytes)) return rc;
  }
  if (int rc = charge(layout::kObjQp, limits::kMaxQp)) {
    if (rq_bytes) heap_free(rq_off, rq_bytes);
    return rc;
  }
  auto* e = table<layout::QpEntry>(layout_.qp_table) + i;
  uint32_t gen = e->generation + 1;
  uint32_t qpn = layout::make_qpn(slot_, i, layout::kQpnQp, gen);
  while (qpn < 2) qpn = layout::make_qpn(slot_, i, layout::kQpnQp, ++gen);  // 0 and 1 are special QPs
  e->generation = gen;
  e->qpn = qpn;
  e->qp_type = a.qp_type;
  e->qp_state.store(IBV_QPS_RESET, std::memory_order_relaxed);
  e->pd_index = pd;
  e->send_cq = send_cq;
  e->recv_cq = recv_cq;
  e->srq_index = a.srq;
  e->rq_capacity = got.max_recv_wr;
  e->rq_max_sge = got.max_recv_sge;
  e->rq_stride = stride;
  e->rq_ring_offset = rq_off;
  e->rq_ring_bytes = rq_bytes;
  e->dest_qpn = 0;
  e->access = 0;
  e->initiator_waiting.store(0, std::memory_order_relaxed);
  e->rx_take.store(0, std::memory_order_relaxed);
  e->rx_holder.store(layout::holder_word(layout::kNoIndex, 0), std::memory_order_relaxed);
  e->rx_take_wr_id.store(0, std::memory_order_relaxed);
  e->xrcd_dev = xrc_recv ? xrcds_[a.xrcd].dev : 0;
  e->xrcd_ino = xrc_recv ? xrcds_[a.xrcd].ino : 0;
  e->rx_take_srqn.store(0, std::memory_order_relaxed);
  e->rx_take_pos.store(0, std::memory_order_relaxed);
  e->rx_staged_next.store(0, std::memory_order_relaxed);  // the new ring's first position
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  qp->index = i;
  qp->qpn = qpn;
  qp->qp_type = a.qp_type;
  qp->pd = pd;
  qp->pd_match = mr_fast_match(pd, 0);
  qp->send_cq = send_cq;
  qp->srq = a.srq;
  qp->xrcd = xrc_recv ? a.xrcd : layout::kNoIndex;
  qp->handles = 1;
  qp->sq_sig_all = a.sq_sig_all;
  qp->caps = xrc_recv ? QpCaps{} : got;
  qp->shared = e;
  qp->cnt.rec = cnt_.claim(i);
  count::configure(cnt_, qp.get());
  qp->rq = rq;
  qp->rq_off = rq_off;
  qp->rq_bytes = rq_bytes;
  if (pd != layout::kNoIndex) pds_[pd].refs += 1;
  if (send_cq != layout::kNoIndex) cqs_[send_cq].refs += 1;
  if (recv_cq != layout::kNoIndex) cqs_[recv_cq].refs += 1;
  if (a.srq != layout::kNoIndex) srq_ref(a.srq, +1);  // destroy_srq: EBUSY while attached
  if (xrc_recv) xrcds_[a.xrcd].refs += 1;             // close_xrcd: EBUSY while used
  *out = qp.get();
  live_qps_.push_back(qp.get());  // never allocates: reserved for every slot at open
  // A producer of its FIFOs from now on (reserved above: no allocation).
  // A second producer makes the claim a CAS before this QP can post.
  for (LocalCq* l : fifos)
    if (l) {
      l->producers.push_back(qp.get());
      own_producers_changed(l);
    }
  {
    // Its staged receives (transport_staged.cc) from now on: an RC or UC
    // QP's, from its receive queue or (SrqInlineCqe) its SRQ.
    StagedRx& sr = staged_rx_[i];
    std::lock_guard g(sr.lock);
    const bool rc_uc = a.qp_type == IBV_QPT_RC || a.qp_type == IBV_QPT_UC;
    sr.live = rc_uc && !has_srq;
    sr.qpn = sr.live ? qpn : 0;
    sr.srq_qp.store(rc_uc && has_srq ? qpn | uint64_t{pd} << 32 : 0, std::memory_order_release);
    sr.pd = pd;
    sr.rq = sr.live ? rq : Ring{};
    sr.stash.clear();
  }
  qps_[i] = std::move(qp);
  return 0;
}

void LocalContext::own_fifos(const Qp* qp, LocalCq* out[2]) const noexcept {
  out[0] = qp->send_local;
  out[1] = qp->recv_cq < cqs_.size() && cqs_[qp->recv_cq].live ? cqs_[qp->recv_cq].info.local : nullptr;
  if (out[1] == out[0]) out[1] = nullptr;
}

// The claim's mode follows the producer count (local_cq.h): several, a CAS;
// one, a plain store. The mode changes under the sq_lock of the one producer
// that may be running: the existing one when a second was just added (the
// new QP is not handed out yet), the remaining one when the other left
// (destroy_qp waited for its last completion). Caller holds mu_.
void LocalContext::own_producers_changed(LocalCq* l) noexcept {
  const bool multi = l->producers.size() > 1;
  if (l->multi() == multi) return;
  if (l->producers.empty()) {  // cannot happen (two -> none is two steps); nobody runs
    l->set_multi(false);
    return;
  }
  // Only one -> two and two -> one change the mode: producers[0] is the
  // producer that may be running.
  Qp* running = l->producers.front();
  running->sq_lock.lock();
  l->set_multi(multi);
  running->sq_lock.unlock();
}

// Multicast (UD only; a multicast GID and LID, IBA 4.1.1 / 10.5).
// On Ethernet (RoCE) a group is its MGID alone (IPv6 multicast ff00::/8 or
// an IPv4 multicast address mapped, ::ffff:224.0.0.0/4); the LID is
// ignored, as rxe and mlx5 do, and kept as 0.
namespace {
bool roce_mgid(const uint8_t g[16]) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return g[0] == 0xff || (std::memcmp(g, kPrefix, 12) == 0 && (g[12] & 0xf0) == 0xe0);
}
}  // namespace

int LocalContext::attach_mcast(Qp* qp, const uint8_t gid[16], uint16_t lid) noexcept {
  if (!qp || qp->qp_type != IBV_QPT_UD) return EINVAL;
  if (ethernet()) {
    if (!roce_mgid(gid)) return EINVAL;
    lid = 0;
  } else if (gid[0] != 0xff || lid < 0xc000 || lid == 0xffff) {
    return EINVAL;
  }
  int rc = registry_.mcast_attach(gid, lid, slot_, generation_, qp->qpn);
  if (rc == 0) qp->mcast_attached = true;
  return rc;
}

int LocalContext::detach_mcast(Qp* qp, const uint8_t gid[16], uint16_t lid) noexcept {
  if (!qp || qp->qp_type != IBV_QPT_UD) return EINVAL;
  return registry_.mcast_detach(gid, ethernet() ? 0 : lid, slot_, generation_, qp->qpn);
}

int LocalContext::destroy_qp(Qp* qp, uint32_t handle_xrcd) noexcept {
  std::lock_guard lk(mu_);
  if (!qp || qp->index >= qps_.size() || qps_[qp->index].get() != qp) return EINVAL;
  if (qp->qp_type == IBV_QPT_XRC_RECV) {
    // Each handle holds the domain it came through; the QP lives until its
    // last handle goes (the creator's or an ibv_open_qp one).
    if (handle_xrcd < xrcds_.size() && xrcds_[handle_xrcd].refs) xrcds_[handle_xrcd].refs -= 1;
    if (qp->handles > 1) {
      qp->handles -= 1;
      return 0;
    }
  }
  {
    // No post or progress may be running on this QP now (the application
    // must not use a QP it destroys); take the lock to be sure.
    std::lock_guard sq(qp->sq_lock);
  }
  cnt_.fold_record(qp->cnt.rec);  // its counts stay with the context (counters.h)
  qp->cnt.rec = nullptr;
  if (qp->sq_pending.load(std::memory_order_relaxed)) qps_pending_.fetch_sub(1, std::memory_order_relaxed);
  qp->shared->qp_state.store(IBV_QPS_RESET, std::memory_order_release);
  qp->shared->state.store(layout::kFree, std::memory_order_release);
  layout::bump_version(qp->shared);  // and so its reuse: initiators that cached it check again
  {
    // Before its ring goes: a poll that finishes a staged CQE of this QP
    // no longer finds it (the CQE gives nothing, as for a QP that is gone).
    StagedRx& sr = staged_rx_[qp->index];
    std::lock_guard g(sr.lock);
    sr.live = false;
    if (const uint64_t q = sr.srq_qp.load(std::memory_order_relaxed))
      sr.srq_qp.store(q | StagedRx::kSrqQpGone, std::memory_order_release);
    sr.rq = Ring{};
    std::deque<StashedWqe>().swap(sr.stash);
  }
  if (qp->rq_bytes) heap_free(qp->rq_off, qp->rq_bytes);
  if (qp->pd < pds_.size() && pds_[qp->pd].refs) pds_[qp->pd].refs -= 1;
  if (qp->send_cq < cqs_.size() && cqs_[qp->send_cq].refs) cqs_[qp->send_cq].refs -= 1;
  if (qp->recv_cq < cqs_.size() && cqs_[qp->recv_cq].refs) cqs_[qp->recv_cq].refs -= 1;
  if (qp->srq != layout::kNoIndex) srq_ref(qp->srq, -1);
  live_qps_.erase(std::find(live_qps_.begin(), live_qps_.end(), qp));
  // No producer of its FIFOs any more (its last completion is behind the
  // sq_lock taken above); one that remains alone claims without a CAS.
  LocalCq* fifos[2];
  own_fifos(qp, fifos);
  for (LocalCq* l : fifos)
    if (l) {
      auto it = std::find(l->producers.begin(), l->producers.end(), qp);
      if (it != l->producers.end()) l->producers.erase(it);
      own_producers_changed(l);
    }
  if (qp->mcast_attached) registry_.mcast_detach_qp(slot_, generation_, qp->qpn);  // the kernel detaches too
  qps_[qp->index].reset();
  uncharge(layout::kObjQp);
  return 0;
}

void LocalContext::query_qp(Qp* qp, QpAttr* attr) noexcept {
  *attr = qp->attr;
  attr->qp_state = qp->state();
  attr->cur_qp_state = attr->qp_state;
}

static_assert(sizeof(ibv_sge) == sizeof(SgeIn) && offsetof(ibv_sge, addr) == offsetof(SgeIn, addr) &&
              offsetof(ibv_sge, length) == offsetof(SgeIn, length) && offsetof(ibv_sge, lkey) == offsetof(SgeIn, lkey));

int LocalContext::post_recv_list(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept {
  if (!wr) [[unlikely]]
    return 0;  // an empty list posts nothing, whatever the QP
  int rc = 0;
  bool posted = false;
  uint32_t pos = 0;
  // Receives of a QP on an SRQ go to the SRQ; XRC QPs have no receive
  // queue; a QP in RESET takes none.
  if (qp->srq != layout::kNoIndex || !qp->rq.attached() || qp->state() == IBV_QPS_RESET) [[unlikely]] {
    rc = EINVAL;
  } else {
    const uint32_t max_sge = qp->caps.max_recv_sge;
    BiasingGuard producers(qp->rq_lock);  // the ring's producers, one at a time
    for (; wr; wr = wr->next) {
      const int n = wr->num_sge;
      if (n < 0 || static_cast<uint32_t>(n) > max_sge || (n && !wr->sg_list)) [[unlikely]] {
        rc = EINVAL;
        break;
      }
      rc = post_recv_wqe(qp->rq, wr->wr_id, wr->sg_list, static_cast<uint32_t>(n), &pos);
      if (rc) [[unlikely]]
        break;
      posted = true;
    }
  }
  if (rc && bad_wr) *bad_wr = wr;
  if (!posted) return rc;
  // The slot the next post fills was last written by the initiator that
  // released it: progress_all fetches its line for writing while we poll,
  // so the next post (and the fence after it) does not wait for it.
  warm_post_slot_.store(qp->rq.slot_address(pos + 1), std::memory_order_relaxed);
  wake_initiator(qp);  // cq.cc: a peer's send may wait for these receives (RNR)
  if (qp->state() == IBV_QPS_ERR) [[unlikely]] {
    // Receives posted to a QP in the error state complete with a flush error.
    std::lock_guard lk(qp->sq_lock);
    qp->rq_flushed = false;
    flush_qp(qp);
  }
  return rc;
}

}  // namespace shmrdma
