// ibv_modify_qp: the QP state machine of the InfiniBand spec (11.2.5.3 and
// the kernel's transition table), with the attributes each transition
// requires and allows.
#include <cerrno>

#include "context.h"
#include "count.h"

namespace shmrdma {

namespace {

struct Transition {
  bool valid = false;
  uint32_t required = 0;
  uint32_t optional = 0;
};

// RC attributes per transition.
Transition rc_transition(uint32_t cur, uint32_t next) {
  constexpr uint32_t S = IBV_QP_STATE;
  Transition t;
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return {true, S, 0};
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) t = {true, S | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      break;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) t = {true, S, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      if (next == IBV_QPS_RTR)
        t = {true,
             S | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                 IBV_QP_MIN_RNR_TIMER,
             IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      break;
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS)
        t = {true, S | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
             IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE};
      break;
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS)
        t = {true, S,
             IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER};
      if (next == IBV_QPS_SQD) t = {true, S, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      break;
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS)
        t = {true, S,
             IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER};
      if (next == IBV_QPS_SQD)
        t = {true, S,
             IBV_QP_AV | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_MIN_RNR_TIMER |
                 IBV_QP_PATH_MIG_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                 IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_PORT};
      break;
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) t = {true, S, IBV_QP_CUR_STATE};
      break;
    default:
      break;
  }
  return t;
}

// UC attributes per transition: RC's without the acknowledgement and
// RDMA-read/atomic resources.
Transition uc_transition(uint32_t cur, uint32_t next) {
  constexpr uint32_t S = IBV_QP_STATE;
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return {true, S, 0};
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) return {true, S | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0};
      break;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) return {true, S, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS};
      if (next == IBV_QPS_RTR)
        return {true, S | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
                IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX};
      break;
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS)
        return {true, S | IBV_QP_SQ_PSN,
                IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MIG_STATE};
      break;
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS)
        return {true, S, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE};
      if (next == IBV_QPS_SQD) return {true, S, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      break;
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS)
        return {true, S, IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PATH_MIG_STATE};
      if (next == IBV_QPS_SQD)
        return {true, S, IBV_QP_AV | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PATH_MIG_STATE};
      break;
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) return {true, S, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS};
      break;
    default:
      break;
  }
  return {};
}

// UD attributes per transition: no connection, a Q_Key instead.
Transition ud_transition(uint32_t cur, uint32_t next) {
  constexpr uint32_t S = IBV_QP_STATE;
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) return {true, S, 0};
  switch (cur) {
    case IBV_QPS_RESET:
      if (next == IBV_QPS_INIT) return {true, S | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0};
      break;
    case IBV_QPS_INIT:
      if (next == IBV_QPS_INIT) return {true, S, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY};
      if (next == IBV_QPS_RTR) return {true, S, IBV_QP_PKEY_INDEX | IBV_QP_QKEY};
      break;
    case IBV_QPS_RTR:
      if (next == IBV_QPS_RTS) return {true, S | IBV_QP_SQ_PSN, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      break;
    case IBV_QPS_RTS:
      if (next == IBV_QPS_RTS) return {true, S, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      if (next == IBV_QPS_SQD) return {true, S, IBV_QP_EN_SQD_ASYNC_NOTIFY};
      break;
    case IBV_QPS_SQD:
      if (next == IBV_QPS_RTS) return {true, S, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      if (next == IBV_QPS_SQD) return {true, S, IBV_QP_PKEY_INDEX | IBV_QP_QKEY};
      break;
    case IBV_QPS_SQE:
      if (next == IBV_QPS_RTS) return {true, S, IBV_QP_CUR_STATE | IBV_QP_QKEY};
      break;
    default:
      break;
  }
  return {};
}

// XRC_SEND (the kernel's XRC_INI): RC's table, except that INIT->RTR needs
// no responder resources (MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER: an initiator
// only QP answers nothing; accepted when given).
Transition xrc_ini_transition(uint32_t cur, uint32_t next) {
  Transition t = rc_transition(cur, next);
  if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
    constexpr uint32_t kResponder = IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    t.required &= ~kResponder;
    t.optional |= kResponder;
  }
  return t;
}

// XRC_RECV (XRC_TGT, the responder side): RC's table, except that
// RTR->RTS needs only TIMEOUT and SQ_PSN (the kernel's qp_state_table; the
// requester attributes RETRY_CNT, RNR_RETRY and MAX_QP_RD_ATOMIC are
// accepted when given, ibv_xsrq_pingpong leaves them out).
Transition xrc_tgt_transition(uint32_t cur, uint32_t next) {
  Transition t = rc_transition(cur, next);
  if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
    constexpr uint32_t kRequester = IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    t.required &= ~kRequester;
    t.optional |= kRequester;
  }
  return t;
}

Transition transition(uint32_t qp_type, uint32_t cur, uint32_t next) {
  switch (qp_type) {
    case IBV_QPT_UC: return uc_transition(cur, next);
    case IBV_QPT_UD: return ud_transition(cur, next);
    case IBV_QPT_XRC_SEND: return xrc_ini_transition(cur, next);
    case IBV_QPT_XRC_RECV: return xrc_tgt_transition(cur, next);
    default: return rc_transition(cur, next);
  }
}

constexpr uint32_t kKnownMask = (IBV_QP_DEST_QPN << 1) - 1;

}  // namespace

int LocalContext::modify_qp(Qp* qp, const QpAttr& a, uint32_t mask) noexcept {
  if (mask & ~kKnownMask) return EINVAL;
  std::lock_guard lk(mu_);
  if (!qp || qp->index >= qps_.size() || qps_[qp->index].get() != qp) return EINVAL;
  uint32_t cur = qp->state();
  if ((mask & IBV_QP_CUR_STATE) && a.cur_qp_state != cur) return EINVAL;
  uint32_t next = (mask & IBV_QP_STATE) ? a.qp_state : cur;
  if (next > IBV_QPS_ERR) return EINVAL;
  Transition t = transition(qp->qp_type, cur, next);
  if (!(mask & IBV_QP_STATE)) return EINVAL;  // every transition names the new state
  if (!t.valid || (mask & t.required) != t.required || (mask & ~(t.required | t.optional))) return EINVAL;

  // Values.
  const layout::DeviceRecord& dev = registry_.device();
  if ((mask & IBV_QP_PORT) && (a.port_num < 1 || a.port_num > dev.num_ports)) return EINVAL;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index >= limits::kPkeyTableLen) return EINVAL;
  if ((mask & IBV_QP_ACCESS_FLAGS) &&
      (a.qp_access_flags & ~uint32_t{IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                     IBV_ACCESS_REMOTE_ATOMIC}))
    return EINVAL;
  if ((mask & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > IBV_MTU_4096)) return EINVAL;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > limits::kMaxQpRdAtom) return EINVAL;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > limits::kMaxQpRdAtom) return EINVAL;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return EINVAL;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return EINVAL;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return EINVAL;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return EINVAL;
  if ((mask & IBV_QP_DEST_QPN) && a.dest_qp_num > limits::kQpnMask) return EINVAL;
  if ((mask & IBV_QP_RQ_PSN) && a.rq_psn > 0xffffff) return EINVAL;
  if ((mask & IBV_QP_SQ_PSN) && a.sq_psn > 0xffffff) return EINVAL;
  if (mask & IBV_QP_AV) {
    if (a.ah_port_num && a.ah_port_num > dev.num_ports) return EINVAL;
    if (ethernet()) {
      // RoCE: a GRH is mandatory and its sgid_index must name a valid
      // entry of our port; the DGID is resolved at RTR (one nobody holds is
      // an unreachable destination, not an error here).
      const uint32_t port = a.ah_port_num ? a.ah_port_num : (mask & IBV_QP_PORT) ? a.port_num : qp->attr.port_num;
      if (check_ethernet_av(port ? port : 1, a.is_global, a.grh.sgid_index)) return EINVAL;
    } else {
      // The destination LID must be a port of some device of the home
      // (directory.h; a GRH is accepted, the LID still routes).
      uint32_t port = 0;
      if (!dir_.by_lid(a.dlid, &port) && !a.is_global) return EINVAL;
    }
  }

  // Apply.
  {
    // The target post_send checked goes with whatever changes here (the
    // destination, the path): checked in full again (Qp::tgt).
    std::lock_guard sq(qp->sq_lock);
    qp->tgt = Qp::TargetCache{};
  }
  QpAttr& s = qp->attr;
  if (mask & IBV_QP_PORT) s.port_num = a.port_num;
  if (mask & IBV_QP_PKEY_INDEX) s.pkey_index = a.pkey_index;
  if (mask & IBV_QP_ACCESS_FLAGS) s.qp_access_flags = a.qp_access_flags;
  if (mask & IBV_QP_PATH_MTU) s.path_mtu = a.path_mtu;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) s.max_rd_atomic = a.max_rd_atomic;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) s.max_dest_rd_atomic = a.max_dest_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) s.min_rnr_timer = a.min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) s.timeout = a.timeout;
  if (mask & IBV_QP_RETRY_CNT) s.retry_cnt = a.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) s.rnr_retry = a.rnr_retry;
  if (mask & IBV_QP_DEST_QPN) s.dest_qp_num = a.dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) s.rq_psn = a.rq_psn;
  if (mask & IBV_QP_SQ_PSN) s.sq_psn = a.sq_psn;
  if (mask & IBV_QP_QKEY) s.qkey = a.qkey;
  if (mask & IBV_QP_PATH_MIG_STATE) s.path_mig_state = a.path_mig_state;
  if (mask & IBV_QP_EN_SQD_ASYNC_NOTIFY) s.en_sqd_async_notify = a.en_sqd_async_notify;
  if (mask & IBV_QP_AV) {
    s.dlid = a.dlid;
    s.sl = a.sl;
    s.src_path_bits = a.src_path_bits;
    s.static_rate = a.static_rate;
    s.is_global = a.is_global;
    s.grh = a.grh;
    s.ah_port_num = a.ah_port_num;
  }
  layout::QpEntry* e = qp->shared;
  e->access = s.qp_access_flags;
  e->min_rnr_timer = s.min_rnr_timer;
  e->port = s.port_num;
  e->qkey = s.qkey;
  if ((next == IBV_QPS_RTR && cur == IBV_QPS_INIT) || (mask & IBV_QP_AV)) {
    e->dest_qpn = s.dest_qp_num;
    e->dlid = s.dlid;
    // The path's device of the home (written to e->dest_device before the
    // state is published), then the peer (it may not exist yet: the
    // connection is then resolved on first use, as a packet to an absent
    // QP would be retried).
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard sq(qp->sq_lock);
      (void)resolve_path(qp, true);
      qp->peer = peer_of(qp->peer_dev, s.dest_qp_num);
      qp->remote_index = layout::qpn_index(s.dest_qp_num);
      qp->tgt = Qp::TargetCache{};  // another target: checked in full again
      peer = qp->peer;
    }
    // The peer's regions, mapped now rather than by the first operations
    // (peer.cc premap_regions; outside the send queue's lock).
    if (peer) peer->premap_regions();
  }
  if (next == IBV_QPS_RESET) {
    // Everything posted is discarded; the QP starts over.
    std::lock_guard sq(qp->sq_lock);
    if (qp->sq_pending.exchange(0, std::memory_order_relaxed)) qps_pending_.fetch_sub(1, std::memory_order_relaxed);
    qp->sq_retire = qp->sq_exec = qp->sq_tail = 0;
    // Staged completions already in the CQ still complete (stash_staged).
    stash_staged(qp);
    if (qp->rq.attached()) {
      std::lock_guard g(staged_rx_[qp->index].lock);  // with finish_staged's claims (transport_staged.cc)
      drain_recv_ring(qp->rq, [](uint64_t) {});
    }
    // A receive an initiator still holds is discarded too: its completion
    // finds the take ended. A slot a dead initiator left claimed goes back
    // to the ring first (else the ring would stall there a lap later).
    uint64_t discarded_wr_id = 0;
    uint32_t discarded_srqn = 0;
    (void)reclaim_take(qp, &discarded_wr_id, &discarded_srqn);
    take_discard(e);
    qp->reset_connection_state();
    qp->set_peer_dev(nullptr);
    qp->peer_port = 0;
    qp->ud_av_valid = false;
    e->dest_device = 0;
    qp->rq_flushed = false;
    qp->attr = QpAttr{};
  }
  {
    std::lock_guard sq(qp->sq_lock);
    count::configure(cnt_, qp);  // counters: port, DLID's port, MTU
  }
  // Publish the new state last (release): a peer that sees it sees the
  // connection fields written above.
  e->qp_state.store(next, std::memory_order_release);
  layout::bump_version(e);  // initiators check this entry in full again (QpEntry::version)
  if (next == IBV_QPS_ERR) {
    std::lock_guard sq(qp->sq_lock);
    flush_qp(qp);
  }
  return 0;
}

}  // namespace shmrdma
