// The shared-memory transport: the receive-take protocol. A message that
// consumes a receive WQE of the target (SEND, SEND_WITH_IMM,
// RDMA_WRITE_WITH_IMM) takes one from the target's RQ or SRQ under the
// target QP's receive record (layout.h rx_take), which names the holder, so
// that the WQE completes exactly once even when the initiator dies at any
// point (taken over by the next initiator, or completed by the owner).
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
#include "cq_push.h"
#include "gid_table.h"
#include "mover.h"
#include "proc.h"
#include "transport_internal.h"


namespace shmrdma {

using namespace transport;

// holder: home-wide (layout.h make_holder), so an initiator of another
// device of the home is looked up in that device's registry.
bool LocalContext::context_dead(uint32_t holder, uint32_t generation) noexcept {
  const uint32_t home_id = layout::holder_home_id(holder), slot = layout::holder_slot(holder);
  ContextInfo info;
  if (home_id != dir_.self_id()) return !dir_.context_live(home_id, slot, generation, &info);
  if (slot == slot_ && generation == generation_) return false;
  return !registry_.context_slot(slot, &info) || info.generation != generation ||
         !process_alive(static_cast<pid_t>(info.pid), info.start_time);
}

// Whether the receive completion of QP qp's take record at completing value
// v, whose holder died, reached qp's receive CQ. The holder noted the CQ
// slot it reserved before it published it (QpEntry::rx_take_cq): no note
// of v, no slot reserved, nothing published. The slot of the note is
//  - published and not taken yet: delivered;
//  - not published: the holder died first (skip_dead_push gives the slot up);
//  - given back: taken by poll_cq (delivered) unless skip_dead_push gave it
//    up (CqState::skipped, written before the slot's seq changes).
// The record's completions are serial, so no other receive completion of qp
// was pushed since. (A CQ resized after the holder's push is read as it is
// now: the holder died past its publication, or the resize would still wait
// for it.)
bool LocalContext::recv_completion_delivered(Qp* qp, uint32_t v) noexcept {
  const uint64_t note = qp->shared->rx_take_cq.load(std::memory_order_acquire);
  if (static_cast<uint32_t>(note >> 32) != v) return false;
  if (qp->recv_cq >= cqs_.size() || !cqs_[qp->recv_cq].live) return false;  // the CQ is gone, with its completions
  const CqState& cq = cqs_[qp->recv_cq];
  const uint32_t pos = static_cast<uint32_t>(note);
  const int32_t lap = cq.info.ring.lap_of(pos);
  if (lap == 0) return true;
  if (lap < 0) return false;
  return !cq.was_skipped(pos);
}

// The ring the receive WQEs of take record t come from: t's RQ or SRQ in
// peer's segment or, for an XRC_RECV QP, the XRC SRQ srqn wherever it lives
// (*hold keeps its owner mapped).
bool LocalContext::take_ring(Peer& peer, layout::QpEntry* t, uint32_t srqn, std::shared_ptr<Peer>* hold,
                             Ring* out) noexcept {
  if (t->qp_type == IBV_QPT_XRC_RECV) {
    Peer* owner = nullptr;
    layout::SrqEntry* se = find_xrc_srq(peer.device, srqn, hold, &owner);
    return se && owner->ring(se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, out);
  }
  if (t->srq_index != layout::kNoIndex) {
    layout::SrqEntry* se = peer.srq(t->srq_index);
    return se && se->state.load(std::memory_order_acquire) == layout::kLive &&
           peer.ring(se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, out);
  }
  return peer.ring(t->rq_ring_offset, t->rq_ring_bytes, t->rq_capacity, t->rq_stride, out);
}

// Whether SRQ position pos, claimed and unreleased, may be held by a live
// initiator: one delivering into another QP of peer on t's SRQ whose record
// is busy and announces pos. Every claimer of a basic SRQ holds the record of
// one of its owner's QPs and announces its position before it claims, so a
// slot no live holder announces is a dead holder's. (An XRC SRQ is shared
// with QPs of other processes: callers rely on a grace period alone.)
bool LocalContext::srq_claim_live(Peer& peer, const layout::QpEntry* t, uint32_t pos) noexcept {
  const uint32_t srq = t->srq_index;
  for (uint32_t i = 0; i < peer.layout.qp_slots; ++i) {
    layout::QpEntry* q = peer.qp(i);
    if (!q || q == t || q->state.load(std::memory_order_acquire) != layout::kLive || q->srq_index != srq) continue;
    if ((q->rx_take.load(std::memory_order_acquire) & layout::kTakeMask) == layout::kTakeIdle ||
        q->rx_take_pos.load(std::memory_order_relaxed) != pos)
      continue;
    if (!holder_dead(q->rx_holder.load(std::memory_order_relaxed)))
      return true;
  }
  return false;
}

// A busy receive record (another initiator delivers into t, or one died
// while it did). Only a value unchanged for a grace period is looked at, so
// a holder that just reserved (and has not yet written its identity) is
// safe; a live holder (or one of our own threads) is waited for (kBusy).
// A dead holder's record:
//  - reserved or taken, with the ring slot it announced (rx_take_pos) still
//    claimed and unreleased: the holder died before it released the slot,
//    so before it wrote into the WQE. The record passes to us (kAdopted, *nv
//    its new value, reserved by us) and the caller delivers its own message
//    into that WQE: no receive is lost or passed over. On an SRQ another
//    QP's live initiator may hold that position (the dead one lost the claim
//    to it and died before it announced the next): it is adopted only after
//    it stayed claimed for 2 s and no live holder announces it; a live
//    claimer whose slot is adopted all the same finds out by its release
//    CAS and lets go. A WQE of another XRC SRQ than the caller's (srqn)
//    completes with IBV_WC_REM_ABORT_ERR instead.
//  - completing (it died while it wrote the receive completion): left to the
//    owner (reclaim_dead_completion), kBusy;
//  - otherwise it ends (kEnded); the WQE of a taken one (its slot released,
//    the data partly moved) completes with IBV_WC_REM_ABORT_ERR (its message
//    never fully arrived).
LocalContext::TakeOver LocalContext::take_holder_dead(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t v,
                                                      uint32_t srqn, uint32_t* nv) noexcept {
  const uint64_t now = now_ns();
  if (qp->busy_take != v || qp->busy_take_qpn != t->qpn) {
    qp->busy_take = v;
    qp->busy_take_qpn = t->qpn;
    qp->busy_since_ns = now;
    qp->busy_claim_since_ns = 0;
    return TakeOver::kBusy;
  }
  if (now - qp->busy_since_ns < 100'000'000ull) return TakeOver::kBusy;
  qp->busy_since_ns = now;  // look again in another grace period at most
  if (!holder_dead(t->rx_holder.load(std::memory_order_relaxed))) return TakeOver::kBusy;  // alive, or one of our own threads
  uint64_t wr_id = t->rx_take_wr_id.load(std::memory_order_acquire);
  const uint32_t tsrqn = t->rx_take_srqn.load(std::memory_order_relaxed);
  const uint32_t st = v & layout::kTakeMask;
  if (st == layout::kTakeReserved || st == layout::kTakeTaken) {
    const uint32_t pos = t->rx_take_pos.load(std::memory_order_relaxed);
    const bool xrc_t = t->qp_type == IBV_QPT_XRC_RECV;
    std::shared_ptr<Peer> hold;
    Ring ring;
    RingHandle h{};
    if (take_ring(peer, t, tsrqn, &hold, &ring) && ring.claimed_unreleased(pos, &h)) {
      if (st == layout::kTakeReserved && (xrc_t || t->srq_index != layout::kNoIndex)) {
        if (!qp->busy_claim_since_ns || qp->busy_claim_pos != pos) {
          qp->busy_claim_since_ns = now;
          qp->busy_claim_pos = pos;
          return TakeOver::kBusy;
        }
        if (now - qp->busy_claim_since_ns < 2'000'000'000ull) return TakeOver::kBusy;
        if (!xrc_t && srq_claim_live(peer, t, pos)) return TakeOver::kBusy;
      }
      if (!take_transfer(t, v, holder_word_, nv)) return TakeOver::kBusy;
      if (!xrc_t || tsrqn == srqn) return TakeOver::kAdopted;
      // Another XRC SRQ's WQE: taken over like deliver does, then aborted.
      layout::RecvWqeHeader wqe;
      std::memcpy(&wqe, h.payload, sizeof wqe);
      uint32_t taken = 0;
      if (!take_hold(t, *nv, wqe.wr_id, &taken)) return TakeOver::kBusy;
      if (!ring.release_cas(h)) {
        take_end(t, taken);
        return TakeOver::kEnded;
      }
      if (take_complete_begin(t, taken)) {
        push_xrc_recv_cqe(peer.device, tsrqn, recv_status_cqe(wqe.wr_id, IBV_WC_REM_ABORT_ERR, t->qpn));
        take_done(t, taken);
      }
      return TakeOver::kEnded;
    }
  }
  // A record left completing: only the owner can tell whether the receive
  // completion reached its CQ (reclaim_dead_completion); until it ends the
  // record, we wait, so no later completion of t overtakes that one. (The
  // CQ of an XRC SRQ may be another process's: ended here, as before.)
  if (st == layout::kTakeCompleting && t->qp_type != IBV_QPT_XRC_RECV) return TakeOver::kBusy;
  if (!take_end(t, v)) return TakeOver::kBusy;
  if (st == layout::kTakeTaken) {
    const layout::Cqe c = recv_status_cqe(wr_id, IBV_WC_REM_ABORT_ERR, t->qpn);
    if (t->qp_type == IBV_QPT_XRC_RECV)
      push_xrc_recv_cqe(peer.device, tsrqn, c);  // the XRC SRQ's CQ
    else
      (void)push_peer_cqe(peer, t->recv_cq, c);
  }
  return TakeOver::kEnded;
}

// A receive completion a dead initiator was writing into our QP's CQ (its
// record stuck completing; see take_holder_dead): unless it arrived, the WQE
// completes with IBV_WC_REM_ABORT_ERR. Ending the record lets the next
// initiator in. Called from the periodic liveness pass (progress_all).
void LocalContext::reclaim_dead_completion(Qp* qp) noexcept {
  if (qp->qp_type == IBV_QPT_XRC_RECV) return;
  layout::QpEntry* e = qp->shared;
  const uint32_t v = e->rx_take.load(std::memory_order_acquire);
  if ((v & layout::kTakeMask) != layout::kTakeCompleting ||
      !holder_dead(e->rx_holder.load(std::memory_order_relaxed)))
    return;
  const uint64_t wr_id = e->rx_take_wr_id.load(std::memory_order_acquire);
  const bool delivered = recv_completion_delivered(qp, v);
  if (take_end(e, v) && !delivered) (void)push_cqe(qp->recv_cq, recv_status_cqe(wr_id, IBV_WC_REM_ABORT_ERR, qp->qpn));
}

// The owner's side of its QP's take record, when the QP is flushed (ERR) or
// reset: true with the WQE to complete (*wr_id; *srqn its XRC SRQ) when the
// record held one nobody else will complete, and then the record is ended:
//  - taken: always (the initiator's completion then finds the record ended);
//    a slot its holder left claimed goes back to the ring (a live holder's
//    release CAS then fails and it lets go of the WQE);
//  - completing, by a dead initiator: unless its completion reached the CQ;
//  - reserved, by a dead initiator that left the slot it announced claimed
//    and unreleased (see take_holder_dead; on an SRQ only when no live
//    initiator announces that position; never on an XRC SRQ, which may have
//    claimers in other processes): the WQE of that slot.
// A reserved record of a live initiator is left to it.
bool LocalContext::reclaim_take(Qp* qp, uint64_t* wr_id, uint32_t* srqn) noexcept {
  layout::QpEntry* e = qp->shared;
  const bool xrc = qp->qp_type == IBV_QPT_XRC_RECV;
  const uint32_t v = e->rx_take.load(std::memory_order_acquire);
  const uint32_t st = v & layout::kTakeMask;
  if (st == layout::kTakeIdle) return false;
  *srqn = e->rx_take_srqn.load(std::memory_order_relaxed);
  const bool dead = holder_dead(e->rx_holder.load(std::memory_order_relaxed));
  if (st == layout::kTakeCompleting) {
    // The initiator died while it wrote the receive completion: flush the
    // WQE unless that completion made it into our CQ.
    if (xrc || !dead) return false;
    *wr_id = e->rx_take_wr_id.load(std::memory_order_acquire);
    const bool delivered = recv_completion_delivered(qp, v);
    return take_end(e, v) && !delivered;
  }
  const uint32_t pos = e->rx_take_pos.load(std::memory_order_relaxed);
  std::shared_ptr<Peer> hold;
  Ring ring;
  RingHandle h{};
  const bool held = take_ring(self_peer_, e, *srqn, &hold, &ring) && ring.claimed_unreleased(pos, &h);
  if (st == layout::kTakeTaken) {
    *wr_id = e->rx_take_wr_id.load(std::memory_order_acquire);
    if (!take_end(e, v)) return false;
    if (held) (void)ring.release_cas(h);
    return true;
  }
  if (!dead || !held || xrc || (e->srq_index != layout::kNoIndex && srq_claim_live(self_peer_, e, pos)))
    return false;
  layout::RecvWqeHeader wqe;
  std::memcpy(&wqe, h.payload, sizeof wqe);
  if (!take_end(e, v) || !ring.release_cas(h)) return false;
  *wr_id = wqe.wr_id;
  return true;
}


// Delivers a message that consumes one of target QP t's receive WQEs (SEND,
// SEND_WITH_IMM, RDMA_WRITE_WITH_IMM; a UD SEND is preceded by its 40-byte
// GRH area `grh`): takes the WQE (recorded in t's receive record, so it
// completes exactly once even if we die), scatters the data into it and
// writes the receive completion `cqe` (wr_id, status and byte_len filled
// here). rnr_wait: an empty queue is waited for (RC) rather than dropped.
// xrc: the WQE comes from that XRC SRQ (possibly in another process than t,
// which only keeps the take record); its PD checks the receive buffers and
// its CQ gets the completion.
LocalContext::Deliver LocalContext::deliver(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t opcode, uint64_t len,
                                            const IoVec* local, uint32_t nlocal, const uint8_t* grh,
                                            bool rnr_wait, layout::Cqe& cqe, uint32_t* status,
                                            const RecvSource* xrc) noexcept {
  // Where the receive WQE, its buffers and its completion queue live.
  Peer& rpeer = xrc ? *xrc->peer : peer;
  const uint32_t rpd = xrc ? xrc->pd : t->pd_index;
  const uint32_t rcq = xrc ? xrc->cq : t->recv_cq;
  uint32_t srq_index = t->srq_index;
  // The receive ring's validated view: the QP's cached one (target_rq_cache),
  // used in place, validated again (rq_ring_miss) when it names another ring.
  Ring* rqp = nullptr;
  layout::SrqEntry* se = nullptr;
  if (xrc) {
    se = xrc->se;
    srq_index = xrc->srq_index;
    rqp = rq_ring(rpeer, se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, &qp->target_rq_cache);
  } else if (srq_index != layout::kNoIndex) {
    se = peer.srq(srq_index);
    if (se && se->state.load(std::memory_order_acquire) == layout::kLive)
      rqp = rq_ring(peer, se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, &qp->target_rq_cache);
  } else {
    rqp = rq_ring(peer, t->rq_ring_offset, t->rq_ring_bytes, t->rq_capacity, t->rq_stride, &qp->target_rq_cache);
  }
  if (!rqp) [[unlikely]] {
    *status = IBV_WC_REM_OP_ERR;
    return Deliver::kGone;
  }
  Ring& rq = *rqp;
  if (rnr_wait && rnr_backing_off(qp, rq, rnr_look_now()))
    return Deliver::kNoReceive;
  uint32_t v = 0;
  bool adopted = false;  // the record came from a dead holder with the slot it claimed (take_holder_dead)
  if (!take_reserve(t, holder_word_, &v)) {
    switch (take_holder_dead(qp, peer, t, v, xrc ? xrc->srqn : layout::kNoIndex, &v)) {
      case TakeOver::kBusy: return Deliver::kBusy;
      case TakeOver::kAdopted: adopted = true; break;
      case TakeOver::kEnded:
        if (!take_reserve(t, holder_word_, &v)) return Deliver::kBusy;
        break;
    }
  }
  qp->busy_take_qpn = 0;
  // Staged receives (transport_staged.cc): the positions before
  // rx_staged_next are promised to completions the receiver has still to
  // poll, so this message's WQE comes after them: it waits until the
  // receiver took them. (A position behind the ring's is one a flush, a
  // reset or a holder that died left: it no longer holds anything back.)
  const bool staged_order = !xrc && srq_index == layout::kNoIndex && t->qp_type != IBV_QPT_UD;
  if (staged_order && !adopted) {
    const int32_t ahead =
        static_cast<int32_t>(t->rx_staged_next.load(std::memory_order_relaxed) - rq.consumer_position());
    if (ahead > 0 && static_cast<uint32_t>(ahead) <= rq.capacity()) {
      take_end(t, v);
      return Deliver::kBusy;
    }
  }
  // Names the ring of the positions we announce (published by the claim).
  if (xrc) t->rx_take_srqn.store(xrc->srqn, std::memory_order_relaxed);
  // payload_size() of an attached ring (stride >= Ring::kMinStride, so no wrap).
  static_assert(Ring::kMinStride >= kRingSlotHeaderBytes + sizeof(layout::RecvWqeHeader));
  uint32_t rq_max_sge = static_cast<uint32_t>((rq.stride() - kRingSlotHeaderBytes - sizeof(layout::RecvWqeHeader)) /
                                              sizeof(layout::WireSge));
  rq_max_sge = std::min(rq_max_sge, limits::kMaxSge);
  // Every position we try to claim is announced in the record first, so if
  // we die holding the slot the next initiator adopts it (take_holder_dead).
  auto announce = [t](uint32_t pos) { take_announce(t, pos); };
  RingResult claimed;
  if (adopted) {
    // The dead holder's slot: ours, unless the owner flushed it meanwhile.
    if (rq.claimed_unreleased(t->rx_take_pos.load(std::memory_order_relaxed), &claimed.handle))
      claimed.status = RingStatus::ok;
    else
      claimed.status = RingStatus::contended;
  } else {
    claimed = rq.try_claim_announced(announce);
    if (!claimed && claimed.status != RingStatus::contended && rnr_wait) {
      announce_waiting(t, xrc ? nullptr : se);
      claimed = rq.try_claim_announced(announce);
    }
  }
  if (!claimed) {
    take_end(t, v);
    if (claimed.status == RingStatus::contended) return Deliver::kBusy;
    if (rnr_wait) start_rnr_backoff(qp);
    return Deliver::kNoReceive;
  }
  // Copy the WQE out of shared memory, record the take, then free the slot.
  // Both are CASes: a record we no longer hold (RESET discarded it) or a slot
  // someone adopted (we were taken for dead, or the owner's flush ended our
  // record first) is not ours, nor is the WQE: let go, the send is retried.
  layout::RecvWqeHeader h;
  layout::WireSge rsge[limits::kMaxSge];
  std::memcpy(&h, claimed.handle.payload, sizeof h);
  uint32_t rn = std::min(h.num_sge, rq_max_sge);
  if (rn == 1)
    std::memcpy(rsge, claimed.handle.payload + sizeof h, sizeof(layout::WireSge));  // inlined
  else
    std::memcpy(rsge, claimed.handle.payload + sizeof h, rn * sizeof(layout::WireSge));
  uint32_t taken = 0;
  if (!take_hold(t, v, h.wr_id, &taken)) {
    (void)rq.release_cas(claimed.handle);  // discarded with the record, unless already adopted
    return Deliver::kBusy;
  }
  if (!rq.release_cas(claimed.handle)) {
    take_end(t, taken);
    return Deliver::kBusy;
  }
  if (staged_order) t->rx_staged_next.store(claimed.handle.pos + 1, std::memory_order_relaxed);
  // The next send to this queue reads the next slot and then releases it (a
  // CAS). A prefetch now, and again from progress_all while we poll, brings
  // the line close for that read; `complete` below then asks for the line
  // for writing once this message is out (Ring::own_line), so the next
  // send's release_cas does not wait for it to cross cores. The receiver does
  // not touch a posted slot until it comes round again, so taking the line
  // early costs it nothing.
  RingSlotHeader* next_slot = rq.next_header(Ring::slot_header_of(claimed.handle), claimed.handle.pos);
  __builtin_prefetch(next_slot, 1);
  warm_rq_slot_.store(next_slot, std::memory_order_relaxed);
  // SRQ limit event (srq.cc): fewer WQEs left than the armed limit. The
  // exchange disarms it, so each arming raises one event.
  if (se) {
    uint32_t lim = se->limit.load(std::memory_order_relaxed);
    if (lim && rq.size_approx() < lim && se->limit.exchange(0, std::memory_order_acq_rel))
      rpeer.raise_async(IBV_EVENT_SRQ_LIMIT_REACHED, async_token(AsyncKind::kSrq, srq_index, se->generation));
  }

  // The target is gone with its WQE: the record we hold (taken) ends.
  auto gone = [t, taken, status](uint32_t st) {
    take_end(t, taken);
    *status = st;
    return Deliver::kGone;
  };
  const uint64_t total = len + (grh ? kGrhBytes : 0);
  cqe.wr_id = h.wr_id;
  cqe.byte_len = static_cast<uint32_t>(total);
  auto complete = [&](const layout::Cqe& c) {
    // Unless the owner flushed it. The record stays busy until the CQE is
    // in, so the next sender's completion cannot overtake this one.
    if (take_complete_begin(t, taken)) {
      const cqpush::CqNote note{&t->rx_take_cq, take_completing(taken)};
      (void)push_peer_cqe(rpeer, rcq, c, &qp->target_cq_cache, &note);
      take_done(t, taken);
    }
    Ring::own_line(next_slot);
  };
  auto responder_error = [&](uint32_t recv_status, uint32_t our_status) {
    // The responder's WQE completes in error and its QP enters the error
    // state; its owner flushes the rest at its next poll.
    cqe.status = recv_status;
    cqe.byte_len = 0;
    complete(cqe);
    t->qp_state.store(IBV_QPS_ERR, std::memory_order_release);
    layout::bump_version(t);  // its initiators (we) check it in full again
    auto* th = reinterpret_cast<layout::ContextHeader*>(peer.base);
    th->attention.fetch_add(1, std::memory_order_release);  // pairs with the acquire in progress_all
    *status = our_status;
    return Deliver::kResponderError;
  };

  // The common SEND: one source buffer, no GRH, the first receive buffer
  // holds it all, its lkey answered by the QP's cache (remote_hit) and
  // reachable with memcpy: moved straight (up to 16 bytes inline), with the
  // same checks the general scatter below makes. Anything else (a cache
  // miss, CMA, several buffers) goes that way from the start: nothing has
  // been written yet. (The general scatter asks resolve_remote alone, which
  // answers from the same cache, so remote_hit stays inline here.)
  Remote fast;
  if (opcode != IBV_WR_RDMA_WRITE_WITH_IMM && rn != 0 && nlocal == 1 && !grh && total != 0 && local[0].len == total &&
      rsge[0].length >= total && !qp->local_odp &&
      remote_hit(qp, rpeer, rsge[0].lkey, false, rpd, IBV_ACCESS_LOCAL_WRITE, rsge[0].addr, total, &fast) &&
      fast.local) {
    move_one(fast.local, local[0].base, total, false);  // move_out's one-buffer case: it cannot fail
  } else if (opcode != IBV_WR_RDMA_WRITE_WITH_IMM) {
    // Scatter into the receive buffers, checked against the target's MRs.
    IoVec direct_iov[limits::kMaxSge], host_iov[limits::kMaxSge];
    uint32_t nremote = 0;
    uint64_t room = 0, need = total;
    bool direct = true;  // every receive buffer is reachable with memcpy
    for (uint32_t k = 0; k < rn && need; ++k) {
      uint64_t take = std::min<uint64_t>(rsge[k].length, need);
      if (take == 0) continue;
      Remote r;
      if (!resolve_remote(qp, rpeer, rsge[k].lkey, false, rpd, IBV_ACCESS_LOCAL_WRITE, rsge[k].addr, take, &r))
        return responder_error(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR);
      direct_iov[nremote] = {r.local, take};
      host_iov[nremote] = {reinterpret_cast<void*>(r.host), take};
      ++nremote;
      direct = direct && r.local && !qp->local_odp;  // ODP memory on either side: CMA
      room += take;
      need -= take;
    }
    if (room < total) return responder_error(IBV_WC_LOC_LEN_ERR, IBV_WC_REM_INV_REQ_ERR);
    // The source: our bytes, after the GRH area of a UD message.
    IoVec with_grh[limits::kMaxSge + 1];
    const IoVec* src = local;
    uint32_t nsrc = nlocal;
    if (grh) {
      with_grh[0] = {const_cast<uint8_t*>(grh), kGrhBytes};
      for (uint32_t k = 0; k < nlocal; ++k) with_grh[k + 1] = local[k];
      src = with_grh;
      nsrc = nlocal + 1;
    }
    const IoVec* remote = direct ? direct_iov : host_iov;  // CMA needs the target's own addresses
    // A small message into one buffer is copied inline (move_out_small).
    if (direct && nsrc == 1 && nremote == 1 && src[0].len == remote[0].len &&
        move_out_small(remote[0].base, src[0].base, src[0].len)) {
    } else if (int rc = move_out(rpeer.pid, direct, src, nsrc, remote, nremote, false)) {
      if (rc == ESRCH) return gone(IBV_WC_RETRY_EXC_ERR);  // the target is gone with its WQE
      return responder_error(IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR);
    }
  }
  // SEND_WITH_INV: the window is invalid before the receiver can see the
  // completion. A key that names no valid type 2 window of the receiver's
  // PD is an invalid request (rxe: RESPST_ERR_INVALIDATE_RKEY).
  if ((cqe.wc_flags & IBV_WC_WITH_INV) && !invalidate_remote_mw(rpeer, rpd, cqe.imm_data, false))
    return responder_error(IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_INV_REQ_ERR);
  cqe.status = IBV_WC_SUCCESS;
  count::recv_done(cnt_, qp, t, peer.device);  // counters: rdma_recvs
  // complete(), with push_peer_cqe's common push inline (cq_push.h).
  if (take_complete_begin(t, taken)) {
    layout::CqEntry* ce = rpeer.cq(rcq);
    const cqpush::CqNote note{&t->rx_take_cq, take_completing(taken)};
    const cqpush::Fast f = cqpush::push_common(rpeer, ce, cqe, &qp->target_cq_cache, &note);
    if (f != cqpush::Fast::kPushed) [[unlikely]]
      (void)push_peer_cqe_rest(rpeer, rcq, cqe, &qp->target_cq_cache, ce, static_cast<int>(f), &note);
    take_done(t, taken);
  }
  return Deliver::kDone;
}

layout::SrqEntry* LocalContext::find_xrc_srq(HomeDevice* dev, uint32_t srqn, std::shared_ptr<Peer>* cache,
                                             Peer** owner) noexcept {
  if (!dev) return nullptr;
  const uint32_t slot = layout::srqn_slot(srqn);
  // Looked up in the cached peer first, then once more in a fresh one (the
  // slot may now hold another context).
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt || !*cache || (*cache)->slot != slot || (*cache)->device != dev)
      *cache = dev->peers.get(*dev, slot, self_peer_);
    if (!*cache) return nullptr;
    Peer& p = **cache;
    layout::SrqEntry* se = p.srq(layout::srqn_index(srqn));
    if (se && se->state.load(std::memory_order_acquire) == layout::kLive &&  // A1 pairs with R1
        se->srq_num == srqn && se->srq_type == IBV_SRQT_XRC) {
      *owner = &p;
      return se;
    }
  }
  return nullptr;
}

void LocalContext::push_xrc_recv_cqe(HomeDevice* dev, uint32_t srqn, const layout::Cqe& c) noexcept {
  std::shared_ptr<Peer> cache;
  Peer* owner = nullptr;
  layout::SrqEntry* se = find_xrc_srq(dev, srqn, &cache, &owner);
  if (!se) return;  // the SRQ is gone, and its CQ with it
  (void)push_peer_cqe(*owner, se->cq_index, c);
}


namespace {

// srq_send_leaf's largest message in two inline SGEs: UCX's active
// messages carry a 9-byte header (the AM id and 8 header bytes), so an
// 8-byte Open MPI message over UCX is 17 bytes; 64 covers the short ones
// (one packet at any MTU). From one SGE (UCX's bcopy sends, up to its
// segment size, 8 KiB by default) up to kMoveInPushBytes: its bytes move
// inside the push, as deliver moves them.
constexpr uint32_t kSrqLeafMaxBytes = 64;
static_assert(kSrqLeafMaxBytes <= 64);  // gathered, copy_upto64
constexpr uint32_t kSrqLeafMaxOneSge = kMoveInPushBytes;

}  // namespace

// ibv_post_send's cheapest SEND into a QP with an SRQ (the provider's
// post_send, when check_target found the target's SRQ: Qp::kLeafSrq): one
// SEND or SEND_WITH_IMM on an RC or UC QP, of 1 to kSrqLeafMaxOneSge bytes
// from one SGE or of 1 to kSrqLeafMaxBytes as inline bytes in two (UCX's active messages: its header, then the
// payload), with every cache answering: the target entry, the
// SRQ's ring and the receive buffer's key; its queue empty, no RNR back-off,
// and its send CQ's FIFO with one producer and room. It does what post_send,
// execute_fast and deliver do for it, in the same order and with the same
// receive-take protocol (reserve, announce, claim, hold, release, complete),
// and declines (kNotHandled) whenever one of them would do more: then
// post_send_list takes the WR as before. A message of up to 20 bytes (16
// with an immediate; below: inl) is not written into the WQE's buffer: its
// bytes and the buffer travel in the completion and the receiver's poll
// puts them there (layout.h SrqInlineCqe), so the sender writes one line of
// the receiver's per message, not two.
//
// The one difference from deliver: the WQE is read and its buffer checked
// before the slot is claimed, at the SRQ's consumer position, which is then
// claimed exactly (Ring::try_claim_at: a CAS from that position). A claimed
// WQE must be completed, and deliver completes one whose buffer does not
// hold the message in error; the leaf claims only a WQE it can complete with
// success, and a claim that finds the position taken declines with nothing
// claimed. (The slot's bytes cannot change between the read and a claim
// that succeeds: the owner writes a slot only once it was claimed and
// released.) After the claim it declines only where deliver returns kBusy
// (the record or the slot no longer ours), with the same effect.
//
// kLarge: the instance for one SGE of more than kSrqLeafMaxBytes (out of
// line, srq_send_leaf_large), so the common short message pays nothing for
// it: its bytes move with move_one.
template <bool kLarge>
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::srq_send_leaf_locked(Qp* qp,
                                                                                   const ibv_send_wr& wr) noexcept {
  const uint32_t tail = qp->sq_tail;
  if (!send_leaf_queue_ready(qp, tail)) return Leaf::kNotHandled;
  // The bytes: one SGE (leaf_source, src; up to kSrqLeafMaxOneSge), or two
  // inline ones (s0, a and s1, b; src nullptr; post_send's checks for them:
  // max_send_sge, max_inline_data), which gather() puts together where they
  // must be one (in fixed-size moves: a memcpy of a run-time size is a call;
  // an empty SGE, which may have no address, moves nothing).
  const ibv_sge* g0 = wr.sg_list;
  uint8_t gathered[kSrqLeafMaxBytes];
  uint32_t len = 0;
  const void* src = nullptr;
  const uint8_t *s0 = nullptr, *s1 = nullptr;
  uint32_t a = 0, b = 0;
  if (wr.num_sge == 1) {
    src = leaf_source(qp, wr, &len, kLarge ? kSrqLeafMaxOneSge : kSrqLeafMaxBytes);
    if (!src) {
      if constexpr (!kLarge)
        if (len > kSrqLeafMaxBytes) return srq_send_leaf_large(qp, wr);  // (len: set when the shape passed)
      return Leaf::kNotHandled;
    }
  } else if (kLarge) {
    return Leaf::kNotHandled;
  } else if (wr.num_sge == 2 && g0 && (wr.send_flags & IBV_SEND_INLINE) && qp->caps.max_send_sge >= 2 &&
             (qp->qp_type == IBV_QPT_RC || qp->qp_type == IBV_QPT_UC)) {
    a = g0[0].length;
    b = g0[1].length;
    len = a + b;
    if (a > kSrqLeafMaxBytes || b > kSrqLeafMaxBytes || len - 1 >= kSrqLeafMaxBytes ||
        len > qp->caps.max_inline_data)
      return Leaf::kNotHandled;
    s0 = reinterpret_cast<const uint8_t*>(g0[0].addr);
    s1 = reinterpret_cast<const uint8_t*>(g0[1].addr);
  } else {
    return Leaf::kNotHandled;
  }
  const auto gather = [&]() __attribute__((always_inline)) {
    copy_upto64(gathered, s0, a);
    copy_upto64(gathered + a, s1, b);
    return static_cast<const uint8_t*>(gathered);
  };
  // fast_target's hit, without its refresh (check_target).
  Peer* pp = qp->peer.get();
  if (!pp || qp->path_by_gid) return Leaf::kNotHandled;
  Peer& peer = *pp;
  layout::QpEntry* t = cached_target(qp, peer);
  if (!t || !count::fast_groups(qp)) return Leaf::kNotHandled;
  const bool signaled = (wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  if (signaled && !leaf_completion_ready(qp)) return Leaf::kNotHandled;
  // deliver's SRQ, live, and its ring as cached (rq_ring's hit); the
  // receive CQ.
  const uint32_t srq_index = t->srq_index;
  if (srq_index == layout::kNoIndex) return Leaf::kNotHandled;
  layout::SrqEntry* se = peer.srq(srq_index);
  if (!se || se->state.load(std::memory_order_acquire) != layout::kLive) return Leaf::kNotHandled;
  RingCache& rc = qp->target_rq_cache;
  if (!rq_ring_hit(peer, se->ring_offset, se->capacity, se->slot_stride, rc)) return Leaf::kNotHandled;
  Ring& rq = rc.ring;
  static_assert(Ring::kMinStride >= kRingSlotHeaderBytes + sizeof(layout::RecvWqeHeader));
  if (rq.stride() - kRingSlotHeaderBytes - sizeof(layout::RecvWqeHeader) < sizeof(layout::WireSge))
    return Leaf::kNotHandled;  // no SGE fits a slot (deliver: rq_max_sge 0)
  const uint32_t cq_index = t->recv_cq;
  layout::CqEntry* ce = peer.cq(cq_index);
  if (!ce) return Leaf::kNotHandled;
  // Up to 20 bytes (16 with an immediate) travel in the completion
  // (layout.h SrqInlineCqe), unless the CQ takes timestamps or this
  // context's sends never stage (SHMRDMA_STAGED_SEND=0): the receiver's poll
  // puts them into its buffer, whose line then never leaves the receiver's
  // cache, and the sender writes one line of the receiver's per message
  // instead of two. The receiver pays for the bytes in its buffer with one
  // line transfer (the CQE's), not two in a row (the CQE's, then, once the
  // application reads them, the buffer's): Open MPI's 8-byte ping-pong over
  // UCX's rc_verbs, alternating builds, medians of 8 pairs, far: 0.612 us
  // with the bytes of an answer (a send after a receive) in the buffer,
  // 0.478 with them in the completion; near: 0.224, 0.212. Larger messages
  // go into the buffer, which must be ours to write with memcpy.
  const uint32_t op = wr.opcode;
  const bool imm = op == IBV_WR_SEND_WITH_IMM;
  const bool inl = !kLarge && staged_send_ &&
                   len <= (imm ? layout::kSrqInlineMaxDataImm : layout::kSrqInlineMaxData) &&
                   !(ce->flags & layout::kCqTimestamp);
  // Bytes that travel in the completion are read from one place: two
  // inline SGEs are put together now, long before they are read (a read
  // right after would wait for the stores that put them there).
  if (inl && !src) src = gather();

  // The record, then the WQE at the consumer position: published, its
  // first buffer holding the message (and, unless inl, ours to write).
  uint32_t v = 0;
  if (!take_reserve(t, holder_word_, &v)) return Leaf::kNotHandled;  // deliver handles a busy record
  qp->busy_take_qpn = 0;
  const uint32_t pos = rq.consumer_position();
  RingHandle h{};
  layout::RecvWqeHeader hd;
  layout::WireSge g;
  if (!rq.published_at(pos, &h) ||
      (std::memcpy(&hd, h.payload, sizeof hd), std::memcpy(&g, h.payload + sizeof hd, sizeof g), hd.num_sge == 0) ||
      g.length < len) {
    take_end(t, v);
    return Leaf::kNotHandled;
  }
  // The buffer: the one-word hit (recv_write_hit: reachable here), else
  // remote_hit's answer (its local address, nullptr for the CMA tier).
  uint8_t* dst = recv_write_hit(qp, peer, g.lkey, t->pd_index, g.addr, len);
  if (!dst) {
    Remote r;
    if (!remote_hit(qp, peer, g.lkey, false, t->pd_index, IBV_ACCESS_LOCAL_WRITE, g.addr, len, &r) ||
        (!inl && !r.local)) {
      take_end(t, v);
      return Leaf::kNotHandled;
    }
    dst = r.local;
  }
  // Announced, then claimed exactly (deliver: try_claim_announced).
  take_announce(t, pos);
  const RingResult claimed = rq.try_claim_at(pos);
  if (!claimed) {
    take_end(t, v);
    return Leaf::kNotHandled;
  }
  uint32_t taken = 0;
  if (!take_hold(t, v, hd.wr_id, &taken)) {
    (void)rq.release_cas(claimed.handle);  // discarded with the record, unless already adopted (deliver)
    return Leaf::kNotHandled;
  }
  if (!rq.release_cas(claimed.handle)) {
    take_end(t, taken);
    return Leaf::kNotHandled;
  }
  // deliver's warm-up of the next slot, and the SRQ limit event.
  RingSlotHeader* next_slot = rq.next_header(Ring::slot_header_of(claimed.handle), pos);
  __builtin_prefetch(next_slot, 1);
  warm_rq_slot_.store(next_slot, std::memory_order_relaxed);
  if (const uint32_t lim = se->limit.load(std::memory_order_relaxed);
      lim && rq.size_approx() < lim && se->limit.exchange(0, std::memory_order_acq_rel)) [[unlikely]]
    peer.raise_async(IBV_EVENT_SRQ_LIMIT_REACHED, async_token(AsyncKind::kSrq, srq_index, se->generation));

  // The completion as deliver pushes it, with the bytes in it (inl: the
  // buffer checked above goes in it too) or in the buffer (put_bytes: a
  // move that overlaps our source is a memmove).
  layout::Cqe cqe{};
  const uint8_t flags = (wr.send_flags & IBV_SEND_SOLICITED) ? layout::kCqeSolicited : 0;
  if (inl) {
    // The SrqInlineCqe (layout.h) in seven 8-byte words: wr_id, status |
    // addr_lo, addr_hi | lkey, (data 16-19 or the immediate) | qp_num,
    // src_qp | len, data 0-3, (data 4-5, slid, data 6-7, flags, 0),
    // data 8-15.
    static_assert(offsetof(layout::SrqInlineCqe, data4) == 24 && offsetof(layout::SrqInlineCqe, src_qp_len) == 32 &&
                  offsetof(layout::SrqInlineCqe, data0) == 36 && offsetof(layout::SrqInlineCqe, data1) == 40 &&
                  offsetof(layout::SrqInlineCqe, slid) == 42 && offsetof(layout::SrqInlineCqe, data2) == 44 &&
                  offsetof(layout::SrqInlineCqe, flags) == 46 && offsetof(layout::SrqInlineCqe, take_tag) == 47 &&
                  offsetof(layout::SrqInlineCqe, data3) == 48 && sizeof(layout::SrqInlineCqe) == 56 &&
                  __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
    uint64_t lo, hi;
    uint32_t top;
    load_upto20(static_cast<const uint8_t*>(src), len, &lo, &hi, &top);
    const uint64_t slid = static_cast<uint16_t>(qp->tgt.slid);
    const uint64_t w[7] = {
        hd.wr_id,
        uint64_t{layout::kSrqInlineStatus} | (g.addr & 0xffffffffu) << 32,
        g.addr >> 32 | uint64_t{g.lkey} << 32,
        (imm ? uint64_t{wr.imm_data} : top) | uint64_t{t->qpn} << 32,
        (qp->qpn & limits::kQpnMask) | uint64_t{len} << 24 | (lo & 0xffffffffu) << 32,
        (lo >> 32 & 0xffff) | slid << 16 | (lo >> 48) << 32 |
            uint64_t{static_cast<uint8_t>(flags | (imm ? layout::kCqeSrqImm : 0))} << 48,
        hi,
    };
    static_assert(sizeof w == sizeof cqe);
    std::memcpy(&cqe, w, sizeof cqe);
  } else {
    cqe.wr_id = hd.wr_id;
    cqe.status = IBV_WC_SUCCESS;
    cqe.opcode = IBV_WC_RECV;
    cqe.byte_len = len;
    cqe.qp_num = t->qpn;
    cqe.src_qp = qp->qpn;
    cqe.slid = static_cast<uint16_t>(qp->tgt.slid);
    // The buffer's address in the receiver (push_common declines a CQ with
    // timestamps): the snapshot the hit used, which holds this key.
    cqe.buf_hint = qp->recv_key_cache.snap.host + (g.addr - qp->recv_key_cache.snap.iova);
    cqe.flags = flags;
    if (imm) {
      cqe.imm_data = wr.imm_data;
      cqe.wc_flags = IBV_WC_WITH_IMM;
    }
  }
  // Unless inl, the bytes go into the buffer once the CQ slot is reserved,
  // right before the CQE (the push's fill): every locked instruction of the
  // take and of the push but the publication comes before them, so the
  // buffer line's transfer (the receiver's application read it last)
  // overlaps the CQE line's instead of preceding it. The WQE is ours to
  // complete from take_complete_begin on (the owner leaves a live holder's
  // completing record alone), and the receiver reads the buffer only after
  // the publication. Where the push falls back (nothing published), the
  // bytes are written again, the same ones, before push_peer_cqe_rest.
  const auto put_bytes = [&]() __attribute__((always_inline)) {
    if (inl) return;
    const uint8_t* from = static_cast<const uint8_t*>(src);
    if (!from) {
      // Two inline SGEs (UCX's active messages: a header, then the
      // payload) straight into the buffer, not copied twice through
      // gathered; unless the first part's stores would overwrite bytes of
      // the second before they are read (a loopback send out of its own
      // receive buffer).
      const uintptr_t d = reinterpret_cast<uintptr_t>(dst), q = reinterpret_cast<uintptr_t>(s1);
      if (d + a <= q || q + b <= d) {
        copy_upto64(dst, s0, a);
        copy_upto64(dst + a, s1, b);
        return;
      }
      from = gather();
    }
    // 1 to 64 bytes without a call: copy_upto64 loads everything before it
    // stores, so an overlap (a loopback send out of its own receive buffer)
    // is fine too; more with move_one (a memmove).
    if constexpr (kLarge)
      move_one(dst, from, len, false);
    else
      copy_upto64(dst, from, len);
  };
  if (take_complete_begin(t, taken)) {
    // (Its CQE is a success: an armed CQ fires for it if it is solicited.)
    const cqpush::CqNote note{&t->rx_take_cq, take_completing(taken)};
    const cqpush::Fast f =
        cqpush::push_built(peer, ce, cqe, &qp->target_cq_cache, flags & layout::kCqeSolicited, put_bytes, &note);
    if (f != cqpush::Fast::kPushed) [[unlikely]] {
      if (f == cqpush::Fast::kFallback) put_bytes();
      (void)push_peer_cqe_rest(peer, cq_index, cqe, &qp->target_cq_cache, ce, static_cast<int>(f), &note);
    }
    take_done(t, taken);
  }
  // The message is out: take the next slot's line now, as deliver does
  // (Ring::own_line), not in the next send's release_cas.
  Ring::own_line(next_slot);
  // After a message that went into its buffer, the next presumably does
  // too: the first line of the buffer it will fill, that of the WQE after
  // this one (another QP of the SRQ may take it first: then this was in
  // vain), is asked for writing now (own_dest_line), when that WQE is posted
  // and in the MR of this one's buffer (the common case: one MR for all of
  // them), so remote_hit's answer for this one vouches for the key
  // (snapshot_byte). After one that went in its completion nothing of the
  // next buffer is touched: the receiver writes it itself when it polls,
  // and a line we fetched, even only for reading, would have to be taken
  // back from us then (a read prefetch here made Open MPI's 8-byte
  // ping-pong, far, 0.58 us against 0.48 without it).
  if (!inl && Ring::published_for(next_slot, pos + 1)) {
    const std::byte* np = reinterpret_cast<const std::byte*>(next_slot) + kRingSlotHeaderBytes;
    layout::RecvWqeHeader nhd;
    layout::WireSge ng;
    std::memcpy(&nhd, np, sizeof nhd);
    std::memcpy(&ng, np + sizeof nhd, sizeof ng);
    if (nhd.num_sge != 0 && ng.length != 0 && ng.lkey == g.lkey)
      if (uint8_t* line = snapshot_byte(qp->recv_key_cache, peer, ng.addr)) own_dest_line(line);
  }
  // Counters: packets and bytes both ways, the send, the receive (sent_rc,
  // recv_done; fast_groups answered above).
  if constexpr (kLarge)
    count::sent_send(qp, count::fast_groups(qp), wr.opcode, len);
  else
    count::sent_small_send(qp, count::fast_groups(qp), len);  // one packet at any MTU
  qp->sq_tail = qp->sq_exec = tail + 1;
  if (!signaled) return Leaf::kDone;
  return leaf_complete(qp, wr.wr_id, IBV_WC_SEND, tail);  // complete_send's success
}

int LocalContext::srq_send_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  return run_leaf(qp, wr, bad_wr,
                  [&]() __attribute__((always_inline)) { return srq_send_leaf_locked<false>(qp, *wr); });
}

ibv_send_wr* LocalContext::srq_send_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept {
  return run_leaves(
      qp, wr, r,
      [](const ibv_send_wr& w)
          __attribute__((always_inline)) { return w.opcode == IBV_WR_SEND || w.opcode == IBV_WR_SEND_WITH_IMM; },
      [&](const ibv_send_wr& w) __attribute__((always_inline)) { return srq_send_leaf_locked<false>(qp, w); });
}

LocalContext::Leaf LocalContext::srq_send_leaf_large(Qp* qp, const ibv_send_wr& wr) noexcept {
  return srq_send_leaf_locked<true>(qp, wr);
}

}  // namespace shmrdma
