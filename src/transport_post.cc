// The shared-memory transport: posting. A posted send is validated and
// queued in the QP's private send queue, and the queue is driven (executed
// in order, see transport.cc) by the posting thread itself, and by
// progress_all from poll_cq while a WQE waits. Send completions, the flushes
// of the error states and the periodic look for dead peers live here too.
#include <endian.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "async.h"
#include "context.h"
#include "count.h"
#include "gid_table.h"
#include "mover.h"
#include "proc.h"
#include "transport_internal.h"


namespace shmrdma {

using namespace transport;

// The fast path takes inline WRs of several SGEs up to this many bytes
// (gathered into Qp::fast_gather); longer ones go the general way, as before.
constexpr uint64_t kFastInlineGather = sizeof(Qp::fast_gather);

namespace {

// Out of line: the one-SGE post does not pay for this loop's registers.
[[gnu::noinline]] void* gather_inline(Qp* qp, const ibv_send_wr& wr) noexcept {
  uint8_t* d = qp->fast_gather;
  for (int k = 0; k < wr.num_sge; ++k) {
    const uint32_t n = wr.sg_list[k].length;
    if (n) std::memcpy(d, reinterpret_cast<const void*>(wr.sg_list[k].addr), n);
    d += n;
  }
  return qp->fast_gather;
}

}  // namespace


int LocalContext::enqueue_send(Qp* qp, const SendWr& wr) noexcept {
  uint32_t st = qp->state();
  if (st == IBV_QPS_RESET || st == IBV_QPS_INIT || st == IBV_QPS_RTR) return EINVAL;
  if (qp->qp_type == IBV_QPT_XRC_RECV) return EINVAL;  // a receive-only QP has no send queue
  // The operations of each transport (IBA table 4): UC has no READ or
  // atomics, UD only SENDs.
  switch (wr.opcode) {
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM: break;
    case IBV_WR_SEND_WITH_INV:
    case IBV_WR_BIND_MW:
    case IBV_WR_LOCAL_INV:
      if (qp->qp_type == IBV_QPT_UD) return EINVAL;
      break;
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM:
      if (qp->qp_type == IBV_QPT_UD) return EINVAL;
      break;
    case IBV_WR_RDMA_READ:
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD:
      if (qp->qp_type != IBV_QPT_RC && qp->qp_type != IBV_QPT_XRC_SEND) return EINVAL;
      break;
    default: return EINVAL;  // not an operation shmrdma implements
  }
  if (qp->qp_type == IBV_QPT_UD && !wr.av) return EINVAL;
  const uint32_t num_sge = is_local_op(wr.opcode) ? 0 : wr.num_sge;  // no data: SGEs are ignored
  uint64_t total = 0;
  bool inl = false;
  if (int rc = check_send_shape(qp->caps, wr.opcode, num_sge, wr.sg_list, wr.send_flags, &total, &inl)) return rc;

  BiasingGuard lk(qp->sq_lock);
  if (qp->sq_tail - qp->sq_retire >= qp->caps.max_send_wr) return ENOMEM;
  SendSlot* s = qp->slot(qp->sq_tail);
  s->wr_id = wr.wr_id;
  s->opcode = wr.opcode;
  s->send_flags = wr.send_flags | (qp->sq_sig_all ? IBV_SEND_SIGNALED : 0);
  s->imm_data = wr.imm_data;
  s->remote_addr = wr.remote_addr;
  s->rkey = wr.rkey;
  s->length = total;
  s->executed = 0;
  // Only what the operation and the transport read (the slot is private).
  if (is_atomic(wr.opcode)) {
    s->compare_add = wr.compare_add;
    s->swap = wr.swap;
  }
  if (qp->qp_type == IBV_QPT_UD) {
    s->remote_qpn = wr.remote_qpn;
    s->remote_qkey = wr.remote_qkey;
    s->av = *wr.av;
  }
  if (qp->qp_type == IBV_QPT_XRC_SEND) s->xrc_srqn = wr.xrc_srqn;
  if (wr.opcode == IBV_WR_BIND_MW) {
    s->mw_index = wr.mw_index;
    s->mw_mr = wr.mw_mr;
    s->mw_mr_lkey = wr.mw_mr_lkey;
    s->mw_access = wr.mw_access;
    s->mw_addr = wr.mw_addr;
    s->mw_length = wr.mw_length;
  }
  if (inl) {
    s->num_sge = 0;
    s->inline_len = static_cast<uint32_t>(total);
    uint8_t* dst = qp->inline_data(s);
    for (uint32_t k = 0; k < num_sge; ++k) {
      if (wr.sg_list[k].length) std::memcpy(dst, reinterpret_cast<const void*>(wr.sg_list[k].addr), wr.sg_list[k].length);
      dst += wr.sg_list[k].length;
    }
  } else {
    s->num_sge = num_sge;
    s->inline_len = 0;
    if (num_sge) std::memcpy(qp->sges(s), wr.sg_list, num_sge * sizeof(ibv_sge));
  }
  qp->sq_tail += 1;
  mark_pending(qp);
  return 0;
}

// execute_fast's full check of the target QP entry, each field read once,
// after its version (acquire, pairs with the owner's bump after a change):
// live, the QPN and type we connected to, RTR, RTS, SQD or SQE (consecutive
// values), connected to us on our device. On success the QP keeps the
// version and what a WRITE reads (Qp::tgt). Caller holds qp->sq_lock.
layout::QpEntry* LocalContext::check_target(Qp* qp, const Peer& peer) noexcept {
  qp->tgt = Qp::TargetCache{};
  // The peer is the one our destination names (else the general path finds it).
  if (peer.slot != layout::qpn_slot(qp->attr.dest_qp_num) || peer.device != qp->peer_dev) return nullptr;
  layout::QpEntry* t = peer.qp(qp->remote_index);
  if (!t) return nullptr;
  const uint32_t v = t->version.load(std::memory_order_acquire);
  if (t->state.load(std::memory_order_acquire) != layout::kLive || t->qpn != qp->attr.dest_qp_num ||
      t->qp_type != qp->qp_type)
    return nullptr;
  const uint32_t ts = t->qp_state.load(std::memory_order_acquire);  // pairs with the owner's release in modify_qp
  if (ts - IBV_QPS_RTR > IBV_QPS_SQE - IBV_QPS_RTR || t->dest_qpn != qp->qpn || t->dest_device != dir_.self_id())
    return nullptr;
  const uint32_t access = t->access, pd = t->pd_index;
  const uint32_t wpd = (access & IBV_ACCESS_REMOTE_WRITE) && pd < Qp::kNoWritePd ? pd : Qp::kNoWritePd;
  const uint32_t rpd = (access & IBV_ACCESS_REMOTE_READ) && pd < Qp::kNoWritePd ? pd : Qp::kNoWritePd;
  const uint32_t apd = (access & IBV_ACCESS_REMOTE_ATOMIC) && pd < Qp::kNoWritePd ? pd : Qp::kNoWritePd;
  const uint32_t slid = registry_.device().ports[std::max<uint32_t>(qp->attr.port_num, 1) - 1].lid;
  qp->tgt = Qp::TargetCache{peer.stamp, t, v, access, pd, wpd, rpd, apd, slid};
  // The SEND leaf: send_leaf for a target without an SRQ whose SENDs stage,
  // srq_send_leaf for one with an SRQ; none on a RoCE path.
  const bool srq = t->srq_index != layout::kNoIndex;
  qp->set_leaf_off(Qp::kLeafNoSend, qp->path_by_gid || (!srq && !may_stage(IBV_WR_SEND, t)));
  qp->set_leaf_off(Qp::kLeafSrq, srq);
  return t;
}

// post_send's fast path (context.h execute_fast). The same checks as
// execute, in the same order, each on one read of the untrusted entry; any
// that does not pass, and any cache that misses, hands the WQE to the
// general path untouched (kNotHandled), which waits, resolves, fills the
// caches or fails it exactly as before. Inline in post_send, its one caller.
[[gnu::always_inline]] inline LocalContext::Exec LocalContext::execute_fast(Qp* qp, const ibv_send_wr& wr, uint64_t len,
                                                                            bool inl, uint32_t* status) noexcept {
  Peer* pp;
  layout::QpEntry* t = fast_target(qp, &pp);
  if (!t) [[unlikely]]
    return Exec::kNotHandled;
  Peer& peer = *pp;

  // Our side: the inline bytes where the application has them (the call
  // executes before it returns), or the SGE checked against our MR table:
  // live, an MR, not on-demand, this lkey and our PD in one word
  // (MrState::fast_match), then the range.
  // (src: kept in a register; the IoVec that deliver and the slow WRITE
  // take is made only where they are called.)
  void* src = nullptr;
  if (len) {
    const ibv_sge& g = wr.sg_list[0];
    if (inl) {
      // Inline bytes in several SGEs (UCX's active messages: its header,
      // then the payload) are gathered first, so one source moves as before.
      src = wr.num_sge > 1 ? gather_inline(qp, wr) : reinterpret_cast<void*>(g.addr);
    } else {
      src = const_cast<void*>(fast_source(qp, g, len));
      if (!src) [[unlikely]]
        return Exec::kNotHandled;
    }
  }

  const uint32_t op = wr.opcode;
  if (op <= IBV_WR_RDMA_WRITE_WITH_IMM) {
    if (len) {
      // The one-word hit (remote_write_hit); else remote_hit's, which also
      // answers for MRs moved with CMA.
      uint8_t* dst = remote_write_hit(qp, peer, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr, len);
      if (!dst || !move_out_small(dst, src, len)) [[unlikely]]
        if (write_fast_slow(qp, peer, wr, dst, IoVec{src, len}, len)) return Exec::kNotHandled;
    }
    if (op == IBV_WR_RDMA_WRITE) {
      count::sent_rc(cnt_, qp, IBV_WR_RDMA_WRITE, len);  // counters: packets and bytes
      return Exec::kDone;
    }
  }

  // SEND, SEND_WITH_IMM, the receive of WRITE_WITH_IMM. What deliver reads
  // (a WRITE's moves above do not: a miss goes the general way, which sets
  // it itself).
  qp->local_odp = false;
  const IoVec local[1] = {{src, len}};
  const uint32_t nlocal = len ? 1 : 0;
  const bool uc = qp->qp_type == IBV_QPT_UC;
  layout::Cqe cqe{};
  cqe.qp_num = t->qpn;
  cqe.src_qp = qp->qpn;
  cqe.slid = static_cast<uint16_t>(qp->tgt.slid);
  cqe.opcode = op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  if (wr.send_flags & IBV_SEND_SOLICITED) cqe.flags = layout::kCqeSolicited;
  if (op != IBV_WR_SEND) {
    cqe.imm_data = wr.imm_data;
    cqe.wc_flags = IBV_WC_WITH_IMM;
  }
  Exec r = uc ? Exec::kDone : Exec::kError;
  *status = IBV_WC_SUCCESS;  // deliver sets it when it fails the WQE (kError)
  Deliver d = Deliver::kNotStaged;
  if (may_stage(op, t)) d = deliver_staged(qp, peer, t, op, len, local, nlocal, cqe, !uc);
  if (d == Deliver::kNotStaged) d = deliver(qp, peer, t, op, len, local, nlocal, nullptr, !uc, cqe, status);
  switch (d) {
    case Deliver::kDone: r = Exec::kDone; break;
    case Deliver::kNoReceive: r = uc ? Exec::kDone : Exec::kNotHandled; break;  // UC drops; RC: the RNR wait
    case Deliver::kBusy: r = Exec::kNotHandled; break;
    case Deliver::kResponderError:
    case Deliver::kGone:
    case Deliver::kNotStaged: break;
  }
  if (r == Exec::kDone) count::sent_rc(cnt_, qp, op, len);  // counters: packets and bytes
  return r;
}

namespace {

// The send slot's header from the WR (the data: post_send).
inline void fill_header(Qp* qp, SendSlot* s, const ibv_send_wr& wr, uint64_t total) noexcept {
  const uint32_t op = wr.opcode;
  s->wr_id = wr.wr_id;
  s->opcode = op;
  s->send_flags = wr.send_flags | (qp->sq_sig_all ? IBV_SEND_SIGNALED : 0);
  s->imm_data = wr.imm_data;
  s->length = total;
  s->executed = 0;
  if (op >= IBV_WR_ATOMIC_CMP_AND_SWP) {
    s->remote_addr = wr.wr.atomic.remote_addr;
    s->rkey = wr.wr.atomic.rkey;
    s->compare_add = wr.wr.atomic.compare_add;
    s->swap = wr.wr.atomic.swap;
  } else {
    s->remote_addr = wr.wr.rdma.remote_addr;
    s->rkey = wr.wr.rdma.rkey;
  }
}

}  // namespace

// execute_fast's WRITE of len bytes from `local` that remote_write_hit did
// not answer (dst nullptr) or move_out_small did not move: remote_hit, and
// move_out. 0, or nonzero when the general path must take the WQE (a miss,
// or a failed move, which it moves again and reports).
int LocalContext::write_fast_slow(Qp* qp, const Peer& peer, const ibv_send_wr& wr, uint8_t* dst, IoVec local,
                                  uint64_t len) noexcept {
  bool direct = dst != nullptr;
  IoVec remote{dst, len};
  if (!direct) {
    Remote rm;
    if (!(qp->tgt.access & IBV_ACCESS_REMOTE_WRITE) ||
        !remote_hit(qp, peer, wr.wr.rdma.rkey, true, qp->tgt.pd, IBV_ACCESS_REMOTE_WRITE, wr.wr.rdma.remote_addr,
                    len, &rm))
      return 1;
    direct = rm.local != nullptr;
    remote.base = direct ? static_cast<void*>(rm.local) : reinterpret_cast<void*>(rm.host);
    if (direct && move_out_small(rm.local, local.base, len)) return 0;
  }
  return move_out(peer.pid, direct, &local, 1, &remote, 1, true);
}

// ibv_post_send's common case, one WR straight from the application's
// ibv_send_wr into the send slot (no intermediate SendWr), then executed at
// once under the same lock: RC and UC QPs, the operations that need nothing
// the provider resolves (no address handle, no window). Everything else is
// kPostGeneral: the provider goes through enqueue_send. Same checks and
// errors as enqueue_send (check_send_shape). When the queue is empty, the
// WR has one SGE (or inline bytes) and is a WRITE or SEND, execute_fast
// runs it from the ibv_send_wr itself and nothing is written into the slot;
// whatever it does not take (a target to wait for, a cache to fill, an error
// to report) goes the general way: slot, then progress_locked.
[[gnu::always_inline]] inline int LocalContext::post_send(Qp* qp, const ibv_send_wr& wr) noexcept {
  const uint32_t op = wr.opcode;
  const uint32_t type = qp->qp_type;
  const ibv_sge* sg = wr.sg_list;
  uint64_t total = 0;
  bool inl = false;
  bool fast;  // the shape execute_fast takes: WRITE .. SEND_WITH_IMM with at most one SGE
  if (wr.num_sge == 1 && op <= IBV_WR_SEND_WITH_IMM && (type == IBV_QPT_RC || type == IBV_QPT_UC) &&
      qp->state() == IBV_QPS_RTS) [[likely]] {
    // The common WR, with check_send_shape's answer for one SGE of an
    // operation that carries data out (inline applies, no atomic's rule;
    // caps.max_send_sge is at least 1: qp.cc).
    if (!sg) return EINVAL;
    total = sg->length;
    inl = wr.send_flags & IBV_SEND_INLINE;
    if (total > (inl ? uint64_t{qp->caps.max_inline_data} : uint64_t{kMaxMsgBytes})) return EINVAL;  // max_msg_sz
    fast = true;
  } else {
    // IBV_WR_RDMA_WRITE .. IBV_WR_SEND_WITH_IMM (0-3) on RC and UC; READ and
    // the atomics (4-6) on RC only (UC rejects them in enqueue_send).
    if (!((type == IBV_QPT_RC && op <= IBV_WR_ATOMIC_FETCH_AND_ADD) ||
          (type == IBV_QPT_UC && op <= IBV_WR_SEND_WITH_IMM)))
      return kPostGeneral;
    const uint32_t st = qp->state();
    if (st == IBV_QPS_RESET || st == IBV_QPS_INIT || st == IBV_QPS_RTR) return EINVAL;
    if (wr.num_sge < 0) return EINVAL;
    const uint32_t num_sge = static_cast<uint32_t>(wr.num_sge);
    if (int rc = check_send_shape(qp->caps, op, num_sge, sg, wr.send_flags, &total, &inl)) return rc;
    // A one-SGE READ or atomic (RC only, above): its own fast path (transport.cc).
    if (op >= IBV_WR_RDMA_READ && num_sge == 1) return post_fast_in(qp, wr, total);
    // Inline bytes in several SGEs are gathered by execute_fast (up to
    // kFastInlineGather bytes).
    fast = op <= IBV_WR_SEND_WITH_IMM && (num_sge <= 1 || (inl && total <= kFastInlineGather));
  }

  BiasingGuard lk(qp->sq_lock);
  const uint32_t tail = qp->sq_tail;
  if (tail - qp->sq_retire >= qp->caps.max_send_wr) return ENOMEM;
  Exec r = Exec::kNotHandled;
  uint32_t status;  // read only after execute_fast's kError, which sets it
  if (fast && qp->sq_exec == tail && qp->state() == IBV_QPS_RTS) [[likely]] {
    r = execute_fast(qp, wr, total, inl, &status);  // counts what it executed (count::sent_rc)
    if (r == Exec::kDone) [[likely]] {
      qp->sq_tail = qp->sq_exec = tail + 1;
      if (qp->leaf_off.load(std::memory_order_relaxed) & Qp::kLeafQueued) [[unlikely]]
        qp->set_leaf_off(Qp::kLeafQueued, false);  // the queue is empty again: the leaves may take the next
      if ((wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all) {
        complete_send(qp, wr.wr_id, op, total, IBV_WC_SUCCESS);
        qp->sq_retire = qp->sq_exec;  // a signaled completion retires every earlier WQE
      }
      return 0;
    }
  }
  const bool failed = r == Exec::kError;
  queue_locked(qp, wr, total, inl, failed, failed ? status : uint32_t{IBV_WC_SUCCESS});
  return 0;
}

// post_send's WR that execute_fast did not finish, under qp->sq_lock: into
// the send slot, then failed with `status` (execute_fast's kError: it
// reached the target) or executed the general way.
void LocalContext::queue_locked(Qp* qp, const ibv_send_wr& wr, uint64_t total, bool inl, bool failed,
                                uint32_t status) noexcept {
  SendSlot* s = qp->slot(qp->sq_tail);
  fill_header(qp, s, wr, total);
  if (failed) {
    qp->sq_tail += 1;
    fail_head(qp, s, status);
    return;
  }
  const uint32_t num_sge = static_cast<uint32_t>(wr.num_sge);
  const ibv_sge* sg = wr.sg_list;
  if (inl) {
    // The small path: the bytes themselves go into the slot.
    s->num_sge = 0;
    s->inline_len = static_cast<uint32_t>(total);
    uint8_t* dst = qp->inline_data(s);
    for (uint32_t k = 0; k < num_sge; ++k) {
      if (sg[k].length) std::memcpy(dst, reinterpret_cast<const void*>(sg[k].addr), sg[k].length);
      dst += sg[k].length;
    }
  } else {
    s->num_sge = num_sge;
    s->inline_len = 0;
    ibv_sge* d = qp->sges(s);
    for (uint32_t k = 0; k < num_sge; ++k) d[k] = sg[k];
  }
  qp->sq_tail += 1;
  progress_locked(qp);
  qp->set_leaf_off(Qp::kLeafQueued, qp->sq_exec != qp->sq_tail || qp->rnr_backoff);
}

// post_send_list's single WR that post_send did not finish (rc: its answer):
// the general way, or its error.
int LocalContext::post_one_slow(Qp* qp, ibv_send_wr* wr, int rc, ibv_send_wr** bad_wr, GeneralPost general,
                                void* arg) noexcept {
  if (rc == kPostGeneral) rc = general(arg, wr);
  if (rc && bad_wr) *bad_wr = wr;
  progress(qp);
  return rc;
}

namespace {

// What write_leaf and read_leaf require before they look at the access: the
// send queue at tail empty with room, the QP in RTS, the target's entry as
// cached (fast_target's hit, without its refresh: check_target) and the
// counter groups. The peer, or nullptr.
[[gnu::always_inline]] inline const Peer* one_sided_leaf_peer(const Qp* qp, uint32_t tail) noexcept {
  if (qp->sq_exec != tail || tail - qp->sq_retire >= qp->caps.max_send_wr || qp->state() != IBV_QPS_RTS)
    return nullptr;
  const Peer* pp = qp->peer.get();
  if (!pp || qp->path_by_gid || !cached_target(qp, *pp) || !count::fast_groups(qp)) return nullptr;
  return pp;
}

}  // namespace

// ibv_post_send's cheapest call, tried before anything else: one RDMA WRITE
// of 1 to 16 bytes on an RC or UC QP whose caches all answer (the target
// entry, the rkey, the counter groups), its queue empty, its send CQ's FIFO
// with one producer and room. It does what post_send and execute_fast do for
// it, in the same order, and declines (kNotHandled) before it has changed
// anything whenever one of them would do more: then post_send_list takes
// the WR as before (the provider's post_write calls it).
//
// Why a path of its own: it is a leaf (no call, few values live at once),
// so it saves at most one register and spills nothing, where
// post_send_list saves six and spills more. Nearly every store the WRITE
// makes is then one it needs (the bytes, the lock, the counters, the queue
// positions, the completion): 23 signaled, 13 not, instead of 33 and 22
// (bench/results/callgrind.md). Stores are what such a post waits on when the
// target's line is contended: x86 makes stores visible in order, so while
// the store of the bytes waits for a line the target is polling (UCX's
// put_bw responder does), every later store queues behind it and the
// thread stalls once the store buffer is full (bench/README.md).
template <bool kLarge>
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::write_leaf_locked(Qp* qp, const ibv_send_wr& wr,
                                                                                const void* src, uint32_t len) noexcept {
  // (Few values are kept from the checks to the move and from the move on:
  // what is needed after the move is read again, so the leaf fits the
  // call-clobbered registers.)
  const uint32_t tail = qp->sq_tail;
  const Peer* pp = one_sided_leaf_peer(qp, tail);
  if (!pp) return Leaf::kNotHandled;
  // The completion's slot must be free (claimed below, once nothing can fail).
  if (((wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all) && !leaf_completion_ready(qp))
    return Leaf::kNotHandled;
  uint8_t* dst = remote_write_hit(qp, *pp, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr, len);
  if constexpr (kLarge) {
    // More than 16 bytes: move_out's memmove (move_one: both sides are
    // reachable here), the last byte stored last, as execute_fast moves
    // them.
    if (!dst) return Leaf::kNotHandled;
    move_one(dst, src, len, true);
  } else {
    if (!dst || !move_out_small(dst, src, len)) return Leaf::kNotHandled;  // overlapping: nothing moved
  }
  count::sent_rc_groups(qp, count::fast_groups(qp), IBV_WR_RDMA_WRITE, len);  // counters: packets and bytes
  qp->sq_tail = qp->sq_exec = tail + 1;
  if (!(wr.send_flags & IBV_SEND_SIGNALED) && !qp->sq_sig_all) return Leaf::kDone;
  return leaf_complete(qp, wr.wr_id, IBV_WC_RDMA_WRITE, tail);  // complete_send's success
}

int LocalContext::write_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  // post_send's shape checks for this one shape (a WR that fails one is
  // declined, and post_send reports it); the source: the inline bytes where
  // the application has them, or the SGE checked against our MR table as
  // execute_fast checks it.
  uint32_t len;
  const void* src = leaf_source(qp, *wr, &len, kMaxMsgBytes);  // 1 byte to max_msg_sz
  if (!src) return leaf_declined(qp, wr, bad_wr, Leaf::kNotHandled);
  // More than 16 bytes out of line: the common small WRITE calls nothing.
  if (len > 16) [[unlikely]]
    return write_leaf_large(qp, wr, bad_wr, src, len);
  return run_leaf(qp, wr, bad_wr,
                  [&]() __attribute__((always_inline)) { return write_leaf_locked<false>(qp, *wr, src, len); });
}

int LocalContext::write_leaf_large(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, const void* src,
                                   uint32_t len) noexcept {
  return run_leaf(qp, wr, bad_wr,
                  [&]() __attribute__((always_inline)) { return write_leaf_locked<true>(qp, *wr, src, len); });
}

// ibv_post_send's cheapest READ, tried before anything else (the provider's
// post_send): one RDMA READ of 1 byte to max_msg_sz on an RC QP into one SGE
// of ours that our MR table answers with local write (fast_dest:
// execute_fast_in's check), from a range of an MR the QP's rkey cache
// answers in one word for reading (remote_read_hit: granting remote read,
// in the PD of a target QP that grants remote read, reachable here as a
// whole), with write_leaf's queue, target and completion conditions. It
// does what post_fast_in and execute_fast_in do for it, in the same order
// (the bytes, the counters, the queue, the completion with the READ's
// length), and declines before changing anything otherwise (kNotHandled:
// post_send_list takes the WR, as before).
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::read_leaf_locked(Qp* qp, const ibv_send_wr& wr,
                                                                               void* dst, uint32_t len) noexcept {
  const uint32_t tail = qp->sq_tail;
  const Peer* pp = one_sided_leaf_peer(qp, tail);
  if (!pp) return Leaf::kNotHandled;
  const bool signaled = (wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  if (signaled && !leaf_completion_ready(qp)) return Leaf::kNotHandled;
  const uint8_t* src = remote_read_hit(qp, *pp, wr.wr.rdma.rkey, wr.wr.rdma.remote_addr, len);
  if (!src) return Leaf::kNotHandled;
  // execute_fast_in's copy: up to 16 bytes with every load before any
  // store, longer ones a memmove (both ends may be in one MR of ours).
  move_one(dst, src, len, false);
  count::sent_rc_in(cnt_, qp, IBV_WR_RDMA_READ, len);  // counters: request, response
  qp->sq_tail = qp->sq_exec = tail + 1;
  if (!signaled) return Leaf::kDone;
  return leaf_complete(qp, wr.wr_id, IBV_WC_RDMA_READ, tail, len);  // complete_send's success
}

// read_leaf's shape (post_send's shape checks for this one shape; a WR
// that fails one is declined, and post_send reports it): one SGE of 1 byte
// to max_msg_sz (inline does not apply to a READ: check_send_shape), RC;
// and its destination, that SGE through fast_dest. Else nullptr.
void* LocalContext::read_leaf_dest(const Qp* qp, const ibv_send_wr& wr) const noexcept {
  const ibv_sge* g = wr.sg_list;
  if (wr.num_sge != 1 || !g || qp->qp_type != IBV_QPT_RC || g->length - 1 >= kMaxMsgBytes) return nullptr;
  return fast_dest(qp, *g, g->length);
}

int LocalContext::read_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  void* dst = read_leaf_dest(qp, *wr);
  if (!dst) return leaf_declined(qp, wr, bad_wr, Leaf::kNotHandled);
  const uint32_t len = wr->sg_list->length;
  return run_leaf(qp, wr, bad_wr, [&]() __attribute__((always_inline)) { return read_leaf_locked(qp, *wr, dst, len); });
}

// ibv_post_send's cheapest atomic, tried before anything else (the
// provider's post_send): one CMP_AND_SWP or FETCH_AND_ADD on an RC QP, its
// 8-byte SGE one of ours that our MR table answers with local write
// (fast_dest), the target 8-byte aligned in an MR the QP's rkey cache
// answers in one word for atomics (remote_atomic_hit: granting remote
// atomics, in the mapped tier, in the PD of a target QP that grants remote
// atomics, reachable here as a whole), with read_leaf's queue, target and
// completion conditions. It does what post_fast_in and execute_fast_in do
// for it, in the same order (the CPU atomic, the old value into our SGE,
// the counters, the queue, the completion of 8 bytes), and declines before
// changing anything otherwise (kNotHandled: post_send_list takes the WR,
// and execute reports a misaligned target or a missing grant).
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::atomic_leaf_locked(Qp* qp, const ibv_send_wr& wr,
                                                                                 void* dst) noexcept {
  const uint32_t tail = qp->sq_tail;
  const Peer* pp = one_sided_leaf_peer(qp, tail);
  if (!pp) return Leaf::kNotHandled;
  const bool signaled = (wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  if (signaled && !leaf_completion_ready(qp)) return Leaf::kNotHandled;
  const uint64_t addr = wr.wr.atomic.remote_addr;
  uint8_t* p = addr % 8 ? nullptr : remote_atomic_hit(qp, *pp, wr.wr.atomic.rkey, addr);
  if (!p) return Leaf::kNotHandled;
  std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(p));
  uint64_t old;
  const bool cas = wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP;
  if (cas) {
    old = wr.wr.atomic.compare_add;
    word.compare_exchange_strong(old, wr.wr.atomic.swap, std::memory_order_acq_rel, std::memory_order_acquire);
  } else {
    old = word.fetch_add(wr.wr.atomic.compare_add, std::memory_order_acq_rel);
  }
  std::memcpy(dst, &old, 8);
  count::sent_rc_in(cnt_, qp, wr.opcode, 8);  // counters: request, response
  qp->sq_tail = qp->sq_exec = tail + 1;
  if (!signaled) return Leaf::kDone;
  return leaf_complete(qp, wr.wr_id, cas ? IBV_WC_COMP_SWAP : IBV_WC_FETCH_ADD, tail, 8);  // complete_send's success
}

// The atomic leaf's shape (check_send_shape's for an atomic: one SGE of 8
// bytes, inline ignored; RC only) and its destination: our SGE through
// fast_dest, or nullptr.
void* LocalContext::atomic_leaf_dest(const Qp* qp, const ibv_send_wr& wr) const noexcept {
  const ibv_sge* g = wr.sg_list;
  if (wr.num_sge != 1 || !g || g->length != 8 || qp->qp_type != IBV_QPT_RC) return nullptr;
  return fast_dest(qp, *g, 8);
}

int LocalContext::atomic_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  void* dst = atomic_leaf_dest(qp, *wr);
  if (!dst) return leaf_declined(qp, wr, bad_wr, Leaf::kNotHandled);
  return run_leaf(qp, wr, bad_wr, [&]() __attribute__((always_inline)) { return atomic_leaf_locked(qp, *wr, dst); });
}

ibv_send_wr* LocalContext::atomic_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept {
  return run_leaves(
      qp, wr, r, [](const ibv_send_wr& w) __attribute__((always_inline)) { return is_atomic(w.opcode); },
      [&](const ibv_send_wr& w) __attribute__((always_inline)) {
        void* dst = atomic_leaf_dest(qp, w);
        return dst ? atomic_leaf_locked(qp, w, dst) : Leaf::kNotHandled;
      });
}

ibv_send_wr* LocalContext::write_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept {
  return run_leaves(
      qp, wr, r, [](const ibv_send_wr& w) __attribute__((always_inline)) { return w.opcode == IBV_WR_RDMA_WRITE; },
      [&](const ibv_send_wr& w) __attribute__((always_inline)) {
        uint32_t len;
        const void* src = leaf_source(qp, w, &len, kMaxMsgBytes);  // write_leaf's shape
        if (!src) return Leaf::kNotHandled;
        return len > 16 ? write_leaf_locked<true>(qp, w, src, len) : write_leaf_locked<false>(qp, w, src, len);
      });
}

ibv_send_wr* LocalContext::read_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept {
  return run_leaves(
      qp, wr, r, [](const ibv_send_wr& w) __attribute__((always_inline)) { return w.opcode == IBV_WR_RDMA_READ; },
      [&](const ibv_send_wr& w) __attribute__((always_inline)) {
        void* dst = read_leaf_dest(qp, w);
        return dst ? read_leaf_locked(qp, w, dst, w.sg_list->length) : Leaf::kNotHandled;
      });
}

int LocalContext::post_leaf_list(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  while (wr) {
    // The provider's choice for a single WR (Qp::leaf_off: a hint, each
    // leaf checks it all again under sq_lock).
    const uint8_t off = qp->leaf_off.load(std::memory_order_relaxed);
    const uint32_t op = wr->opcode;
    Leaf r = Leaf::kNotHandled;
    ibv_send_wr* at = wr;
    if (op == IBV_WR_RDMA_WRITE) {
      if (!(off & Qp::kLeafQueued)) at = write_leaf_run(qp, wr, &r);
    } else if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM) {
      if (!off)
        at = send_leaf_run(qp, wr, &r);
      else if (off == Qp::kLeafSrq)
        at = srq_send_leaf_run(qp, wr, &r);
    } else if (op == IBV_WR_RDMA_READ) {
      if (!(off & Qp::kLeafQueued)) at = read_leaf_run(qp, wr, &r);
    } else if (is_atomic(op)) {
      if (!(off & Qp::kLeafQueued)) at = atomic_leaf_run(qp, wr, &r);
    }
    if (r == Leaf::kNotHandled) return post_send_list(qp, at, bad_wr, leaf_general_, qp->user);
    if (r == Leaf::kArmed) {
      own_send_armed(qp->send_cq, IBV_WC_SUCCESS);
      at = at->next;
    }
    wr = at;
  }
  return 0;
}

// What a leaf did not finish: its WR completed into a send CQ armed for the
// next completion (kArmed), or the WR goes the list's way (kNotHandled).
int LocalContext::leaf_declined(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, Leaf r) noexcept {
  if (r == Leaf::kArmed) {
    own_send_armed(qp->send_cq, IBV_WC_SUCCESS);
    return 0;
  }
  return post_send_list(qp, wr, bad_wr, leaf_general_, qp->user);  // the provider's arg: its ibv_qp
}

int LocalContext::post_send_list(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, GeneralPost general,
                                 void* arg) noexcept {
  if (wr && !wr->next) [[likely]] {
    // One WR, the common call: no list to walk.
    const int rc = post_send(qp, *wr);
    if (rc == 0) [[likely]]
      return 0;
    return post_one_slow(qp, wr, rc, bad_wr, general, arg);
  }
  int rc = 0;
  bool queued = false;
  for (; wr; wr = wr->next) {
    rc = post_send(qp, *wr);
    if (rc == kPostGeneral) [[unlikely]] {
      rc = general(arg, wr);
      queued = true;
    }
    if (rc) [[unlikely]] {
      if (bad_wr) *bad_wr = wr;
      break;
    }
  }
  if (queued || rc) [[unlikely]]
    progress(qp);
  return rc;
}

// The WQE at sq_exec (slot s) failed with `status`: it completes with it and
// the QP enters the error state (RC, XRC) or SQE (UC, UD). Caller holds
// qp->sq_lock.
void LocalContext::fail_head(Qp* qp, SendSlot* s, uint32_t status) noexcept {
  complete_send(qp, s, status);
  qp->sq_exec += 1;
  qp->sq_retire = qp->sq_exec;
  qp->wait_started_ns = 0;
  if (qp->qp_type == IBV_QPT_RC || qp->qp_type == IBV_QPT_XRC_SEND)
    enter_error(qp);
  else
    enter_send_error(qp);
}

// Caller holds qp->sq_lock: WQEs are queued that progress_all must drive.
// The first QP with waiting sends wakes the progress thread (started the
// first time; progress_thread.cc).
void LocalContext::mark_pending(Qp* qp) noexcept {
  if (!qp->sq_pending.load(std::memory_order_relaxed) && qp->sq_pending.exchange(1, std::memory_order_relaxed) == 0 &&
      qps_pending_.fetch_add(1, std::memory_order_seq_cst) == 0)  // seq_cst: before kick_progress reads pt_sleeping_
    kick_progress();
}

void LocalContext::complete_send_shared(Qp* qp, uint64_t wr_id, uint32_t opcode, uint32_t byte_len,
                                        uint32_t status) noexcept {
  layout::Cqe c{};
  c.wr_id = wr_id;
  c.status = status;
  c.opcode = wc_opcode(opcode);
  c.byte_len = byte_len;
  c.qp_num = qp->qpn;
  (void)push_cqe(qp->send_cq, c, &qp->send_cq_cache);  // a full CQ has overrun; the completion is lost, as on hardware
}

void LocalContext::flush_send_queue(Qp* qp) noexcept {
  // Caller holds qp->sq_lock. A WQE that was waiting (transport retry, RNR)
  // is flushed: its wait ends with it.
  qp->wait_started_ns = 0;
  qp->rnr_attempts = qp->timeout_attempts = 0;
  qp->rnr_backoff = false;
  while (qp->sq_exec != qp->sq_tail) {
    complete_send(qp, qp->slot(qp->sq_exec), IBV_WC_WR_FLUSH_ERR);
    qp->sq_exec += 1;
  }
  qp->sq_retire = qp->sq_exec;
  if (qp->sq_pending.exchange(0, std::memory_order_relaxed)) qps_pending_.fetch_sub(1, std::memory_order_relaxed);
}

// UC and UD: a send-side error moves the QP to SQE (IBA 10.8.3.3): the rest
// of the send queue is flushed and receives go on.
void LocalContext::enter_send_error(Qp* qp) noexcept {
  qp->shared->qp_state.store(IBV_QPS_SQE, std::memory_order_release);
  layout::bump_version(qp->shared);
  flush_send_queue(qp);
}

// A receive flush of ours (flush_qp, under qp->sq_lock) goes where the
// error that caused it went: into the receive CQ's FIFO of own completions
// when it has one, so it comes out after the send queue's error completion
// (hardware writes the cause, then the flushes) and, like every error of
// the FIFO, after what the shared ring held (local_cq.h take): a receive
// that completed before the error is never handed out after it.
void LocalContext::flush_own_recv(Qp* qp, const layout::Cqe& c) noexcept {
  const uint32_t cq = qp->recv_cq;
  LocalCq* l = cq < cqs_.size() && cqs_[cq].live ? cqs_[cq].info.local : nullptr;
  if (!l) {
    (void)push_cqe(cq, c);
    return;
  }
  uint32_t pos;
  LocalCqSlot* s = l->reserve(&pos);
  if (!s) [[unlikely]] {
    own_send_overrun(cq);  // full: lost, as on hardware
    return;
  }
  l->put(s, pos, c.wr_id, c.status, c.opcode, 0, c.qp_num);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // as complete_send: arm_cq takes our sq_lock
  const uint32_t m = l->entry->notify.load(std::memory_order_relaxed);
  if (m == layout::kNotifyNext || m == layout::kNotifySolicited) own_send_armed(cq, c.status);  // an error
}

void LocalContext::flush_qp(Qp* qp) noexcept {
  // Caller holds qp->sq_lock.
  flush_send_queue(qp);
  // A receive an initiator took and did not complete (it died, or is still
  // moving the data into a QP that has now failed) is the oldest: it goes
  // first, then the ones still queued. An XRC_RECV QP's receives come from
  // XRC SRQs: a taken one completes in the CQ of the SRQ it was taken from.
  // WQEs promised to staged completions still in the CQ complete with them
  // (the messages arrived before the error), so they are kept out of the flush.
  stash_staged(qp);
  uint64_t taken_wr_id = 0;
  uint32_t taken_srqn = 0;
  if (reclaim_take(qp, &taken_wr_id, &taken_srqn)) {
    const layout::Cqe c = recv_status_cqe(taken_wr_id, IBV_WC_WR_FLUSH_ERR, qp->qpn);
    if (qp->qp_type == IBV_QPT_XRC_RECV)
      push_xrc_recv_cqe(dir_.self(), taken_srqn, c);
    else
      flush_own_recv(qp, c);
  }
  if (qp->rq.attached()) {
    std::lock_guard g(staged_rx_[qp->index].lock);  // with finish_staged's claims (transport_staged.cc)
    drain_recv_ring(qp->rq, [&](uint64_t wr_id) {
      const layout::Cqe c = recv_status_cqe(wr_id, IBV_WC_WR_FLUSH_ERR, qp->qpn);
      flush_own_recv(qp, c);
    });
  }
  const bool first_flush = !qp->rq_flushed;
  qp->rq_flushed = true;
  // A QP on an SRQ reports that no more receives will complete on it
  // (IBV_EVENT_QP_LAST_WQE_REACHED), which consumers wait for on teardown:
  // once per entry into the error state. The SRQ itself is not flushed.
  if (qp->srq != layout::kNoIndex && first_flush)
    raise_async(IBV_EVENT_QP_LAST_WQE_REACHED, async_token(AsyncKind::kQp, qp->index, qp->shared->generation));
}

void LocalContext::enter_error(Qp* qp) noexcept {
  qp->shared->qp_state.store(IBV_QPS_ERR, std::memory_order_release);
  layout::bump_version(qp->shared);
  flush_qp(qp);
}

void LocalContext::progress(Qp* qp) noexcept {
  std::lock_guard lk(qp->sq_lock);
  progress_locked(qp);
}

// Executes the send queue from sq_exec on, in order, until it is empty or a
// WQE has to wait. Caller holds qp->sq_lock. sq_pending (and the context's
// qps_pending_) says whether WQEs are left for progress_all to drive.
void LocalContext::progress_locked(Qp* qp) noexcept {
  progress_calls_.store(progress_calls_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  while (qp->sq_exec != qp->sq_tail) {
    uint32_t st = qp->state();
    if (st == IBV_QPS_ERR) {
      flush_qp(qp);
      return;
    }
    if (st == IBV_QPS_SQE) {
      flush_send_queue(qp);
      return;
    }
    if (st != IBV_QPS_RTS) break;  // SQD: hold what is queued
    SendSlot* s = qp->slot(qp->sq_exec);
    uint32_t status = IBV_WC_SUCCESS;
    Exec r = execute(qp, s, &status);
    if (r == Exec::kWait) break;
    if (r == Exec::kError) {
      fail_head(qp, s, status);
      return;
    }
    count::sent(cnt_, qp, s);  // counters: packets and bytes
    s->executed = 1;
    qp->sq_exec += 1;
    if (s->send_flags & IBV_SEND_SIGNALED) {
      complete_send(qp, s, IBV_WC_SUCCESS);
      qp->sq_retire = qp->sq_exec;  // a signaled completion retires every earlier WQE
    }
  }
  if (qp->sq_exec != qp->sq_tail) {
    mark_pending(qp);
  } else if (qp->sq_pending.load(std::memory_order_relaxed) && qp->sq_pending.exchange(0, std::memory_order_relaxed)) {
    qps_pending_.fetch_sub(1, std::memory_order_relaxed);
  }
}

void LocalContext::check_peer(Qp* qp) noexcept {
  // Caller holds mu_. A connected QP whose peer process died moves to the
  // error state: the oldest outstanding send fails with RETRY_EXC_ERR (the
  // transport would have given up on it), the rest and every posted receive
  // are flushed, and the application gets IBV_EVENT_QP_FATAL.
  // UC and UD have no connection to lose: nothing tells them a peer died.
  if (qp->qp_type != IBV_QPT_RC && qp->qp_type != IBV_QPT_XRC_SEND && qp->qp_type != IBV_QPT_XRC_RECV) return;
  uint32_t st = qp->state();
  if (st != IBV_QPS_RTR && st != IBV_QPS_RTS && st != IBV_QPS_SQD && st != IBV_QPS_SQE) return;
  std::shared_ptr<Peer> peer = qp->peer;
  bool dead;
  if (peer) {
    dead = !peer->self_process && !peer->alive();
  } else {
    // Not reached yet: dead when the path's device has no live context in
    // the slot the QPN names (an unresolved path is waited for instead).
    HomeDevice* d = qp->peer_dev;
    if (!d) return;
    ContextInfo info;
    dead = !d->registry->context_slot(layout::qpn_slot(qp->attr.dest_qp_num), &info) ||
           !process_alive(static_cast<pid_t>(info.pid), info.start_time);
  }
  if (!dead) return;
  std::lock_guard sq(qp->sq_lock);
  if (qp->sq_exec != qp->sq_tail) {
    complete_send(qp, qp->slot(qp->sq_exec), IBV_WC_RETRY_EXC_ERR);
    qp->sq_exec += 1;
    qp->sq_retire = qp->sq_exec;
  }
  enter_error(qp);
  raise_async(IBV_EVENT_QP_FATAL, async_token(AsyncKind::kQp, qp->index, qp->shared->generation));
}

// progress_all's slow path (context.h has the inline check every poll
// makes): queued sends, an attention bump from a peer, or the periodic look
// for dead peers.
void LocalContext::progress_all_slow(uint32_t polls) noexcept {
  auto* h = header();
  uint32_t att = h->attention.load(std::memory_order_acquire);  // pairs with the peer's release
  // Every 1024th call, and at most every 200 ms, look for dead peers.
  bool liveness = false;
  if ((polls & 1023) == 0) {
    uint64_t now = now_ns(), last = last_liveness_ns_.load(std::memory_order_relaxed);
    liveness = now - last > 200'000'000ull &&
               last_liveness_ns_.compare_exchange_strong(last, now, std::memory_order_relaxed);
  }
  if (qps_pending_.load(std::memory_order_relaxed) == 0 && att == attention_seen_ && !liveness) return;
  std::lock_guard lk(mu_);
  bool attention = att != attention_seen_;
  attention_seen_ = att;
  // Only live QPs: the cost follows the QPs this context has, not the size
  // of its QP table.
  for (Qp* q : live_qps_) {
    if (liveness) check_peer(q);
    if (liveness) reclaim_dead_completion(q);
    if (attention && q->state() == IBV_QPS_ERR && !q->rq_flushed) {
      std::lock_guard sq(q->sq_lock);
      flush_qp(q);
      continue;
    }
    if (q->sq_pending.load(std::memory_order_relaxed)) progress(q);
  }
}

}  // namespace shmrdma
