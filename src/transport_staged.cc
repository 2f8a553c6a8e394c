// The shared-memory transport: staged receives. A SEND, SEND_WITH_IMM or
// RDMA_WRITE_WITH_IMM of an RC or UC QP into a QP without an SRQ does not
// take the target's receive WQE: the initiator promises the message the WQE
// at the target's next position and pushes a receive completion saying so
// (layout::StagedCqe). Up to layout::kStagedMaxData bytes travel in that
// completion; larger messages are moved into the WQE's buffers first. The
// receiver takes the WQE when it polls the completion (finish_staged),
// copies the bytes of a small one into its buffers and hands out an
// ordinary completion. The initiator writes the CQE's line of the target's
// (and a large message's bytes), not the WQE's slot nor the take record's
// claim and release; the receiver's application finds a small message's
// bytes in its own cache.
//
// Positions. QpEntry::rx_staged_next is the position after the last one
// promised. Only the holder of the target's take record promises (one at a
// time: the position whose slot is published, so a WQE is there) and moves
// it on, after the CQE is in; the general path (deliver) takes a WQE only
// when no promise is outstanding (rx_staged_next is the ring's consumer
// position) and moves it past the WQE it took. So the WQEs of one QP are
// still taken in ring order and its receive completions come out in that
// order: promised ones by their CQEs' order in the CQ, the others after them.
//
// Crashes. An initiator that dies while it stages has claimed nothing: its
// CQE is in the CQ (the receiver finishes it) or it is not (nothing
// happened; a reserved but unpublished CQ slot is skipped by the poll, cq.cc
// skip_dead_push). One that dies after its CQE went in but before it moved
// rx_staged_next on leaves that position unpromised: the receiver still
// takes it with the CQE, and the next initiator finds rx_staged_next behind
// the ring and catches up.
//
// Flush and reset. The owner's flush or reset drains its receive queue;
// first stash_staged waits for a staging initiator to finish (the take
// record reserved; Dekker: the initiator reserves the record, then reads the
// QP's state, the owner stores the state, then reads the record) and takes
// the promised WQEs out of the ring into StagedRx::stash, where their CQEs
// find them. So a message the initiator already completed is received,
// as on hardware, whose receive completion was written when the message
// arrived, before the flush.
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "context.h"
#include "count.h"
#include "cq_push.h"
#include "mover.h"
#include "srq_inline.h"
#include "transport_internal.h"

namespace shmrdma {

using namespace transport;

namespace {

// The WQE at handle h (untrusted payload) as the poll or a stash keeps it:
// at most max_sge SGEs.
void read_wqe(const RingHandle& h, uint32_t max_sge, StashedWqe* w) noexcept {
  layout::RecvWqeHeader hd;
  std::memcpy(&hd, h.payload, sizeof hd);
  w->pos = h.pos;
  w->wr_id = hd.wr_id;
  w->num_sge = std::min(hd.num_sge, max_sge);
  // One SGE (the common receive) in a copy of fixed size: a copy of
  // variable size is `rep movsq`, tens of cycles to start, on the poll that
  // hands a message over.
  if (w->num_sge == 1) [[likely]]
    std::memcpy(w->sge, h.payload + sizeof hd, sizeof(layout::WireSge));
  else
    std::memcpy(w->sge, h.payload + sizeof hd, size_t{w->num_sge} * sizeof(layout::WireSge));
}

// The SGEs a WQE of a receive ring of this stride holds.
uint32_t ring_max_sge(const Ring& rq) noexcept {
  static_assert(Ring::kMinStride >= kRingSlotHeaderBytes + sizeof(layout::RecvWqeHeader));
  const uint32_t n = static_cast<uint32_t>((rq.stride() - kRingSlotHeaderBytes - sizeof(layout::RecvWqeHeader)) /
                                           sizeof(layout::WireSge));
  return std::min(n, limits::kMaxSge);
}

}  // namespace

// deliver_staged's move of len bytes into the buffers of the WQE at h,
// each checked as deliver checks them (resolve_remote: live MR of t's PD,
// local write, in range): false when they do not hold it or the move fails
// (deliver then does it all again and reports what fails).
bool LocalContext::stage_in_place(Qp* qp, Peer& peer, layout::QpEntry* t, const Ring& rq, const RingHandle& h,
                                  uint64_t len, const IoVec* local, uint32_t nlocal) noexcept {
  layout::RecvWqeHeader hd;
  std::memcpy(&hd, h.payload, sizeof hd);
  const uint32_t rn = std::min(hd.num_sge, ring_max_sge(rq));
  IoVec direct_iov[limits::kMaxSge], host_iov[limits::kMaxSge];
  uint32_t nremote = 0;
  bool direct = !qp->local_odp;  // ODP memory on either side: CMA
  uint64_t need = len;
  for (uint32_t k = 0; k < rn && need; ++k) {
    layout::WireSge g;
    std::memcpy(&g, h.payload + sizeof hd + size_t{k} * sizeof g, sizeof g);
    const uint64_t take = std::min<uint64_t>(g.length, need);
    if (take == 0) continue;
    Remote r;
    if (!resolve_remote(qp, peer, g.lkey, false, t->pd_index, IBV_ACCESS_LOCAL_WRITE, g.addr, take, &r)) return false;
    direct_iov[nremote] = {r.local, take};
    host_iov[nremote] = {reinterpret_cast<void*>(r.host), take};
    ++nremote;
    direct = direct && r.local;
    need -= take;
  }
  if (need) return false;  // too short
  if (len == 0) return true;
  const IoVec* remote = direct ? direct_iov : host_iov;  // CMA needs the target's own addresses
  return move_out(peer.pid, direct, local, nlocal, remote, nremote, false) == 0;
}

// deliver_staged's CQE sc into t's receive CQ ce, then the promise of
// position sc.pos, and the take record (v) ends. move() moves the message's
// bytes into the WQE's buffer (or does nothing): inside the push, once its
// slot is reserved and right before the CQE is written into it, else (the
// common push fell back before that) ahead of the general push.
template <typename Move>
[[gnu::always_inline]] inline LocalContext::Deliver LocalContext::push_staged(Qp* qp, Peer& peer, layout::QpEntry* t, const Ring& rq,
                                                layout::CqEntry* ce, const layout::StagedCqe& sc, uint32_t v,
                                                Move&& move) noexcept {
  const uint32_t sn = sc.pos;
  layout::Cqe c;
  std::memcpy(&c, &sc, sizeof c);
  // push_peer_cqe with its common push inline (cq_push.h), as deliver's.
  bool moved = false;
  const cqpush::Fast f = cqpush::push_common(peer, ce, c, &qp->target_cq_cache, [&]() __attribute__((always_inline)) {
    move();
    moved = true;
  });
  if (!moved) move();  // the push fell back before its slot: the bytes first, as always
  const bool pushed =
      f == cqpush::Fast::kPushed || push_peer_cqe_rest(peer, t->recv_cq, c, &qp->target_cq_cache, ce, static_cast<int>(f));
  if (pushed) {
    // The promise, once the CQE is in. (A CQE that could not go in - the CQ
    // overran, which its owner learns from IBV_EVENT_CQ_ERR - leaves the
    // WQE for the next message.)
    t->rx_staged_next.store(sn + 1, std::memory_order_relaxed);
    count::recv_done(cnt_, qp, t, peer.device);  // counters: rdma_recvs
  }
  take_done(t, v);
  // The next message reads the next slot: fetch it now (for reading: the
  // receiver writes it when it takes the WQE).
  __builtin_prefetch(rq.slot_address(sn + 1), 0);
  return Deliver::kDone;
}

LocalContext::Deliver LocalContext::deliver_staged(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t opcode, uint64_t len,
                                                   const IoVec* local, uint32_t nlocal, const layout::Cqe& cqe,
                                                   bool rnr_wait) noexcept {
  Ring* rqp = rq_ring(peer, t->rq_ring_offset, t->rq_ring_bytes, t->rq_capacity, t->rq_stride, &qp->target_rq_cache);
  layout::CqEntry* ce = peer.cq(t->recv_cq);
  if (!rqp || !ce) [[unlikely]]
    return Deliver::kNotStaged;  // deliver reports it
  Ring& rq = *rqp;
  if (rnr_wait && rnr_backing_off(qp, rq, rnr_look_now()))
    return Deliver::kNoReceive;  // before anything of the target's is written
  uint32_t v = 0;
  if (!take_reserve(t, holder_word_, &v)) return Deliver::kNotStaged;  // deliver handles a busy record
  // After the reservation (seq_cst): an owner's flush that began before it
  // is seen here; one that begins after it waits for our take_done.
  const uint32_t ts = t->qp_state.load(std::memory_order_seq_cst);
  if (ts - IBV_QPS_RTR > IBV_QPS_SQE - IBV_QPS_RTR) [[unlikely]] {
    take_end(t, v);
    return Deliver::kNotStaged;  // deliver and execute tell what that means
  }
  // The WQE this message is promised: at rx_staged_next, published. A
  // position behind the ring's (a flush, a reset, a holder that died before
  // it moved it on) catches up first.
  uint32_t sn = t->rx_staged_next.load(std::memory_order_relaxed);
  RingHandle h{};
  if (!rq.published_at(sn, &h)) {
    const uint32_t head = rq.consumer_position();
    const int32_t behind = static_cast<int32_t>(head - sn);
    if (behind > 0) {
      sn = head;
      t->rx_staged_next.store(sn, std::memory_order_relaxed);
    }
    bool found = behind > 0 && rq.published_at(sn, &h);
    if (!found && rnr_wait) {
      announce_waiting(t, nullptr);
      found = rq.published_at(sn, &h);
    }
    if (!found) {
      take_end(t, v);
      if (rnr_wait) start_rnr_backoff(qp);
      return Deliver::kNoReceive;
    }
  }
  // The WQE's buffers must hold the message and be the receiver's to write,
  // as deliver checks them: the initiator learns of a responder error as on
  // the wire (deliver reports it, once the receiver took what was promised).
  // The common case, one buffer that the QP's cache answers, inline here.
  layout::StagedCqe sc;
  std::memcpy(&sc, &cqe, sizeof sc);
  sc.pos = sn;
  sc.status = layout::kStagedStatus;
  sc.byte_len = static_cast<uint32_t>(len);
  if (opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
    // Its bytes went where the rkey named (execute): only the WQE is promised.
    sc.kind = layout::kStagedWriteImm;
    return push_staged(qp, peer, t, rq, ce, sc, v, [] {});
  }
  const bool inl = len <= layout::kStagedMaxData && nlocal <= 1 && !(ce->flags & layout::kCqTimestamp) &&
                   !qp->local_odp;
  layout::RecvWqeHeader hd;
  layout::WireSge g;
  std::memcpy(&hd, h.payload, sizeof hd);
  std::memcpy(&g, h.payload + sizeof hd, sizeof g);
  Remote r;
  const bool one = len == 0 || (hd.num_sge != 0 && g.length >= len &&
                                remote_hit(qp, peer, g.lkey, false, t->pd_index, IBV_ACCESS_LOCAL_WRITE, g.addr, len, &r));
  if (inl && one) {
    sc.kind = layout::kStagedInline;
    // The bytes in registers as send_leaf loads them (zero past len), then
    // into the completion's three fields.
    static_assert(layout::kStagedMaxData == 20);
    uint64_t lo = 0, hi = 0;
    uint32_t top = 0;
    if (len) load_upto20(static_cast<const uint8_t*>(local[0].base), static_cast<uint32_t>(len), &lo, &hi, &top);
    uint8_t bytes[layout::kStagedMaxData];
    std::memcpy(bytes, &lo, 8);
    std::memcpy(bytes + 8, &hi, 8);
    std::memcpy(bytes + 16, &top, 4);
    std::memcpy(sc.data0, bytes, sizeof sc.data0);
    std::memcpy(sc.data1, bytes + 4, sizeof sc.data1);
    std::memcpy(sc.data2, bytes + 12, sizeof sc.data2);
  } else {
    // The bytes go into the WQE's buffers now, before the CQE says so: into
    // the one buffer remote_hit answered for (move_out: reachable here, a
    // copy), else through stage_in_place, which resolves every buffer.
    sc.kind = layout::kStagedInPlace;
    if (one && r.local && !qp->local_odp && nlocal == 1 && local[0].len == len) {
      // move_out's one-buffer case. Up to kMoveInPushBytes inside the push,
      // once the CQ slot is reserved: the push's first locked instruction
      // (P1, cq_push.h) waits for the stores the copy still has in flight,
      // and its publication for the slot's line, which the receiver is
      // polling; reserved first, the copy's tail drains while the slot's
      // line comes. The slot is then held unpublished while the bytes move
      // (later completions into that CQ wait behind it, as a resize or
      // destroy of it waits for its producers), hence the bound.
      uint8_t* d = r.local;
      const void* s = local[0].base;
      const auto mv = [d, s, len]() __attribute__((always_inline)) { move_one(d, s, len, false); };
      if (len <= kMoveInPushBytes) return push_staged(qp, peer, t, rq, ce, sc, v, mv);
      mv();
      return push_staged(qp, peer, t, rq, ce, sc, v, [] {});
    }
    if (!stage_in_place(qp, peer, t, rq, h, len, local, nlocal)) {
      take_end(t, v);
      return Deliver::kNotStaged;  // deliver moves it again and reports what fails
    }
  }
  return push_staged(qp, peer, t, rq, ce, sc, v, [] {});
}


// send_leaf's messages: up to 16 bytes travel in the completion
// (kStagedInline), 17 up to kMoveInPushBytes go into the receive buffer
// inside the push (kStagedInPlace), as deliver_staged puts them; larger
// ones take deliver_staged's way (their bytes move before the push).
constexpr uint32_t kSendLeafMaxBytes = kMoveInPushBytes;
constexpr uint32_t kSendLeafInlineBytes = 16;

// ibv_post_send's cheapest SEND, tried before anything else (the provider's
// post_send): one SEND or SEND_WITH_IMM of 1 to kSendLeafMaxBytes on an RC
// or UC QP (leaf_source: inline, or an SGE our MR table answers) into a QP
// without an SRQ, staged (kStagedInline up to 16 bytes, kStagedInPlace
// above, into a buffer this process reaches), with every cache answering: the target
// entry, its receive ring and CQ, the receive buffer's key; its queue empty,
// no RNR back-off, and its send CQ's FIFO with one producer and room. It
// does what post_send, execute_fast, deliver_staged and push_staged do for
// it, in the same order, and declines (kNotHandled)
// whenever one of them would do more, before it has changed anything but the
// take record (reserved and ended again, as deliver_staged does when it hands
// a message to deliver): then post_send_list takes the WR as before.
//
// What it saves is what the general path spends moving values between its
// layers: the receive completion is built once, in registers, and written
// straight into the target CQ's reserved slot (push_common_with), not built
// in a Cqe, copied into a StagedCqe and copied again into the slot; the
// bytes are loaded into registers (load_small) and go into that completion
// without a buffer; no Exec or Deliver answers, no status out-parameter.
// In two parts, send_leaf_open and send_leaf_one, so that a list's SENDs
// (send_leaf_run) open the target once for several.
//
// send_leaf_staged's first half, once per SEND (send_leaf) or once per run
// of a list's SENDs (send_leaf_run): the target and its caches (fast_target's
// hit, without its refresh: check_target; the receive ring as cached,
// rq_ring_hit's; the receive CQ), then deliver_staged's order: the take
// record reserved, then the state (seq_cst after the reservation: Dekker
// with the owner's flush, stash_staged), then rx_staged_next. false: nothing
// held (a record reserved is ended again).
[[gnu::always_inline]] inline bool LocalContext::send_leaf_open(Qp* qp, StagedTarget* o) noexcept {
  Peer* pp = qp->peer.get();
  if (!pp || qp->path_by_gid) return false;
  layout::QpEntry* t = cached_target(qp, *pp);
  // SEND and SEND_WITH_IMM stage alike (may_stage).
  if (!t || !may_stage(IBV_WR_SEND, t)) return false;
  if (!rq_ring_hit(*pp, t->rq_ring_offset, t->rq_capacity, t->rq_stride, qp->target_rq_cache)) return false;
  const uint32_t cq_index = t->recv_cq;
  layout::CqEntry* ce = pp->cq(cq_index);
  if (!ce) return false;
  uint32_t v = 0;
  if (!take_reserve(t, holder_word_, &v)) return false;
  const uint32_t ts = t->qp_state.load(std::memory_order_seq_cst);
  if (ts - IBV_QPS_RTR > IBV_QPS_SQE - IBV_QPS_RTR) [[unlikely]] {
    take_end(t, v);
    return false;
  }
  *o = {pp, t, ce, cq_index, v, t->rx_staged_next.load(std::memory_order_relaxed), false};
  return true;
}

// The rest of one SEND, with o open (a run's SEND first checks the room for
// its send completion, which send_leaf_staged checks before it opens o):
// the WQE at o.sn, published, whose first buffer holds the message
// (anything else, catching up included, is deliver_staged's), the
// completion into the receive CQ, the promise, the counters and the send
// completion. kInPlace: the bytes (17 to kSendLeafMaxBytes) into the
// buffer, else (up to 16) in the completion. kRun: one of a run's SENDs
// (send_leaf_run), which holds o's record and counts itself into the CQ's
// producers once (o.entered) for all of them; else the single SEND's push
// (P1-P4) and the record ends here. kNotHandled: this SEND changed nothing
// (a single one ends the record again; a run's caller ends it).
template <bool kInPlace, bool kRun>
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::send_leaf_one(Qp* qp, StagedTarget& o,
                                                                            const ibv_send_wr& wr, const void* src,
                                                                            uint32_t len, uint32_t tail,
                                                                            bool signaled) noexcept {
  constexpr bool inl = !kInPlace;
  Peer& peer = *o.peer;
  layout::QpEntry* t = o.t;
  const uint32_t sn = o.sn;
  const RingCache& rc = qp->target_rq_cache;
  RingHandle h{};
  layout::RecvWqeHeader hd;
  layout::WireSge g;
  Remote r;
  // The buffer: the one-word hit (recv_write_hit), else remote_hit's; one
  // the bytes go into (not inl) must be reachable here (its local address:
  // the CMA tier is deliver_staged's).
  uint8_t* dst = nullptr;
  if ((kRun && signaled && !leaf_completion_ready(qp)) || !rc.ring.published_at(sn, &h) ||
      (std::memcpy(&hd, h.payload, sizeof hd), std::memcpy(&g, h.payload + sizeof hd, sizeof g), hd.num_sge == 0) ||
      g.length < len ||
      (!(dst = recv_write_hit(qp, peer, g.lkey, t->pd_index, g.addr, len)) &&
       (!remote_hit(qp, peer, g.lkey, false, t->pd_index, IBV_ACCESS_LOCAL_WRITE, g.addr, len, &r) ||
        (!inl && !(dst = r.local))))) {
    if constexpr (!kRun) take_end(t, o.v);
    return Leaf::kNotHandled;
  }

  // The StagedCqe (layout.h), written into the reserved slot in seven 8-byte
  // stores: pos | data 0-3, status | data 4-7, data 8-11 | byte_len,
  // imm_data | qp_num, src_qp | wc_flags, (pkey_index, slid, sl,
  // dlid_path_bits, flags, kind), data 12-19 (16-19 zero).
  uint64_t lo = 0, hi = 0;
  if constexpr (inl) load_small(static_cast<const uint8_t*>(src), len, &lo, &hi);
  const bool solicited = wr.send_flags & IBV_SEND_SOLICITED;
  static_assert(offsetof(layout::StagedCqe, data0) == 4 && offsetof(layout::StagedCqe, data1) == 12 &&
                offsetof(layout::StagedCqe, byte_len) == 20 && offsetof(layout::StagedCqe, imm_data) == 24 &&
                offsetof(layout::StagedCqe, src_qp) == 32 && offsetof(layout::StagedCqe, pkey_index) == 40 &&
                offsetof(layout::StagedCqe, slid) == 42 && offsetof(layout::StagedCqe, flags) == 46 &&
                offsetof(layout::StagedCqe, data2) == 48 && sizeof(layout::StagedCqe) == 56 &&
                __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
  const auto fill = [&](std::byte* d) __attribute__((always_inline)) {
    // Not inl: the bytes into the buffer first, once the slot is reserved
    // (so a push that finds no slot has written nothing), published with
    // the completion. A push that falls back after this has written them;
    // deliver_staged writes them again, the same ones.
    if constexpr (!inl) {
      if (len <= 64)
        copy_17_to_64(dst, static_cast<const uint8_t*>(src), len);
      else
        move_one(dst, src, len, false);  // move_out's one-buffer move (push_staged: up to kMoveInPushBytes)
    }
    const bool imm = wr.opcode == IBV_WR_SEND_WITH_IMM;
    const uint64_t slid = static_cast<uint16_t>(qp->tgt.slid);
    const auto put = [d](int i, uint64_t w) __attribute__((always_inline)) { std::memcpy(d + 8 * i, &w, 8); };
    put(0, uint64_t{sn} | lo << 32);
    put(1, uint64_t{layout::kStagedStatus} | (lo >> 32) << 32);
    put(2, (hi & 0xffffffffu) | uint64_t{len} << 32);
    put(3, (imm ? uint64_t{wr.imm_data} : 0) | uint64_t{t->qpn} << 32);
    put(4, uint64_t{qp->qpn} | (imm ? uint64_t{IBV_WC_WITH_IMM} << 32 : 0));
    put(5, slid << 16 | uint64_t{solicited} << 48 |
               uint64_t{inl ? layout::kStagedInline : layout::kStagedInPlace} << 56);
    put(6, hi >> 32);
    static_assert(layout::kCqeSolicited == 1);
  };
  cqpush::Fast f;
  if constexpr (kRun) {
    if (!o.entered) {
      if (!cqpush::enter(peer, o.ce, &qp->target_cq_cache)) [[unlikely]]
        return Leaf::kNotHandled;
      o.entered = true;
    }
    f = cqpush::push_entered(o.ce, &qp->target_cq_cache, solicited, fill);
  } else {
    f = cqpush::push_common_with(peer, o.ce, &qp->target_cq_cache, solicited, fill);
  }
  if (f == cqpush::Fast::kFallback) [[unlikely]] {
    if constexpr (!kRun) take_end(t, o.v);  // nothing was published
    return Leaf::kNotHandled;
  }
  if (f == cqpush::Fast::kArmed) [[unlikely]] {
    if constexpr (kRun) {
      cqpush::leave(o.ce);  // the event fires outside the count; the run's next push counts itself in again
      o.entered = false;
    }
    send_leaf_armed_peer(peer, qp, o.cq_index, o.ce, solicited);
  }
  // push_staged: the promise, the record ends (a run's, after its last
  // SEND); the next slot.
  t->rx_staged_next.store(sn + 1, std::memory_order_relaxed);
  o.sn = sn + 1;
  if constexpr (!kRun) take_done(t, o.v);
  __builtin_prefetch(rc.ring.slot_address(sn + 1), 0);

  // Counters: packets and bytes both ways, the send, the receive (sent_rc,
  // recv_done).
  if (std::atomic<uint64_t>* l = count::fast_groups(qp)) [[likely]] {
    if constexpr (inl)
      count::sent_small_send(qp, l, len);  // one packet at any MTU
    else
      count::sent_send(qp, l, wr.opcode, len);  // packets by the path MTU
  } else {
    count::sent_rc(cnt_, qp, wr.opcode, len);
    count::recv_done(cnt_, qp, t, peer.device);
  }
  qp->sq_tail = qp->sq_exec = tail + 1;
  if (!signaled) return Leaf::kDone;
  return leaf_complete(qp, wr.wr_id, IBV_WC_SEND, tail);  // complete_send's success
}

// send_leaf_locked's rest, for the bytes in the completion (up to 16) or in
// the buffer (kInPlace: 17 to kSendLeafMaxBytes).
template <bool kInPlace>
[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::send_leaf_staged(Qp* qp, const ibv_send_wr& wr,
                                                                                const void* src, uint32_t len,
                                                                                uint32_t tail) noexcept {
  // The send completion's room first (send_leaf_one checks it for a run).
  const bool signaled = (wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
  if (signaled && !leaf_completion_ready(qp)) return Leaf::kNotHandled;
  StagedTarget o;
  if (!send_leaf_open(qp, &o)) return Leaf::kNotHandled;
  return send_leaf_one<kInPlace, false>(qp, o, wr, src, len, tail, signaled);
}

[[gnu::always_inline]] inline LocalContext::Leaf LocalContext::send_leaf_locked(Qp* qp,
                                                                               const ibv_send_wr& wr) noexcept {
  // First what declines a sender that is ahead of its receiver (SENDs
  // queued behind one that found no receive, an RNR back-off: the general
  // way, rnr_backing_off), so that such a run of posts pays little here.
  const uint32_t tail = qp->sq_tail;
  if (!send_leaf_queue_ready(qp, tail)) return Leaf::kNotHandled;
  uint32_t len;
  const void* src = leaf_source(qp, wr, &len, kSendLeafMaxBytes);
  if (!src) return Leaf::kNotHandled;
  // 17 bytes and up out of line: the common small SEND pays one compare.
  if (len > kSendLeafInlineBytes) [[unlikely]]
    return send_leaf_in_place(qp, wr, src, len, tail);
  return send_leaf_staged<false>(qp, wr, src, len, tail);
}

LocalContext::Leaf LocalContext::send_leaf_in_place(Qp* qp, const ibv_send_wr& wr, const void* src, uint32_t len,
                                                    uint32_t tail) noexcept {
  return send_leaf_staged<true>(qp, wr, src, len, tail);
}

int LocalContext::send_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept {
  return run_leaf(qp, wr, bad_wr, [&]() __attribute__((always_inline)) { return send_leaf_locked(qp, *wr); });
}

// A run of a list's SENDs (post_leaf_list), each as send_leaf takes it, but
// the take record reserved once and the receive CQ's producer count (P1/P3)
// taken once for up to kSendRunMax of them: a SEND alone pays five locked
// instructions (the record's reservation, P1, the CQ slot's reservation and
// publication, P3), one of a run two (the slot's). The record stays
// reserved across the run; each SEND's promise is made once its CQE is in,
// as one SEND's, so the receiver, a flush (stash_staged waits for the
// record) and a holder's death see what they see between two single SENDs.
// Bounded so that the owner's flush waits no longer for a run than for a
// few SENDs. The WR it stops at and *r as run_leaves answers them.
constexpr int kSendRunMax = 16;

ibv_send_wr* LocalContext::send_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept {
  if (!qp->sq_lock.try_lock_owner()) {
    *r = Leaf::kNotHandled;
    return wr;
  }
  StagedTarget o{};
  bool open = false;
  int done = 0;  // SENDs of this opening
  Leaf x = Leaf::kNotHandled;
  const auto close = [&]() __attribute__((always_inline)) {
    if (o.entered) cqpush::leave(o.ce);
    if (done)
      take_done(o.t, o.v);
    else
      take_end(o.t, o.v);
    open = false;
  };
  for (;;) {
    const uint32_t tail = qp->sq_tail;
    uint32_t len;
    const void* src;
    if (!send_leaf_queue_ready(qp, tail) || !(src = leaf_source(qp, *wr, &len, kSendLeafMaxBytes))) {
      x = Leaf::kNotHandled;
      break;
    }
    if (!open) {
      if (!send_leaf_open(qp, &o)) {
        x = Leaf::kNotHandled;
        break;
      }
      open = true;
      done = 0;
    }
    const bool signaled = (wr->send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all;
    x = len > kSendLeafInlineBytes ? send_leaf_one<true, true>(qp, o, *wr, src, len, tail, signaled)
                                   : send_leaf_one<false, true>(qp, o, *wr, src, len, tail, signaled);
    if (x == Leaf::kNotHandled) break;
    ++done;
    if (x != Leaf::kDone || !(wr = wr->next) || (wr->opcode != IBV_WR_SEND && wr->opcode != IBV_WR_SEND_WITH_IMM))
      break;
    if (done == kSendRunMax) close();
  }
  if (open) close();
  qp->sq_lock.unlock_owner();
  *r = x;
  return wr;
}

// send_leaf's receive completion went into a CQ armed for it: its channel
// gets the token (push_peer_cqe_rest, as push_staged's push; the arming
// looks only at whether the CQE is solicited or an error).
void LocalContext::send_leaf_armed_peer(const Peer& peer, Qp* qp, uint32_t cq_index, layout::CqEntry* e,
                                        bool solicited) noexcept {
  layout::Cqe c{};
  c.status = layout::kStagedStatus;
  c.flags = solicited ? layout::kCqeSolicited : 0;
  (void)push_peer_cqe_rest(peer, cq_index, c, &qp->target_cq_cache, e, static_cast<int>(cqpush::Fast::kArmed));
}

void LocalContext::stash_staged(Qp* qp) noexcept {
  if ((qp->qp_type != IBV_QPT_RC && qp->qp_type != IBV_QPT_UC) || qp->srq != layout::kNoIndex || !qp->rq.attached())
    return;
  layout::QpEntry* e = qp->shared;
  // The state our caller stored, before the record is read (Dekker with
  // deliver_staged). A staging initiator holds the record reserved for a
  // few hundred instructions: wait for it (bounded; a dead one is done).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const uint64_t start = now_ns();
  for (unsigned i = 0;; ++i) {
    const uint32_t v = e->rx_take.load(std::memory_order_seq_cst);
    if ((v & layout::kTakeMask) != layout::kTakeReserved) break;
    if ((i & 63) == 63) {
      if (now_ns() - start > 10'000'000ull ||
          holder_dead(e->rx_holder.load(std::memory_order_relaxed)))
        break;
      sched_yield();
    }
  }
  StagedRx& sr = staged_rx_[qp->index];
  std::lock_guard g(sr.lock);
  Ring rq = qp->rq;
  const uint32_t sn = e->rx_staged_next.load(std::memory_order_acquire);
  const uint32_t max_sge = ring_max_sge(rq);
  for (uint32_t n = 0; n < 2 * rq.capacity(); ++n) {
    const uint32_t head = rq.consumer_position();
    const int32_t ahead = static_cast<int32_t>(sn - head);
    if (ahead <= 0 || static_cast<uint32_t>(ahead) > rq.capacity()) break;
    RingResult r = rq.try_claim_at(head);
    if (!r) {
      if (r.status == RingStatus::contended) continue;  // another consumer moved on: look again
      break;
    }
    StashedWqe w;
    read_wqe(r.handle, max_sge, &w);
    if (!rq.release_cas(r.handle)) continue;  // adopted meanwhile: not ours
    try {
      sr.stash.push_back(w);
    } catch (...) {
      // No room to keep it: it completes as flushed instead.
      flush_own_recv(qp, recv_status_cqe(w.wr_id, IBV_WC_WR_FLUSH_ERR, qp->qpn));
    }
  }
}

bool LocalContext::finish_staged(const std::byte* payload, ibv_wc* w) noexcept {
  layout::StagedCqe c;
  std::memcpy(&c, payload, sizeof c);
  const uint32_t qi = layout::qpn_index(c.qp_num);
  if (qi >= layout_.qp_slots || c.kind < layout::kStagedInline || c.kind > layout::kStagedWriteImm) return false;
  StagedRx& sr = staged_rx_[qi];
  StashedWqe wqe;
  uint32_t pd;
  {
    BiasingGuard g(sr.lock);
    if (!sr.live || sr.qpn != (c.qp_num & limits::kQpnMask)) return false;  // its QP is gone
    pd = sr.pd;
    bool have = false;
    while (!sr.stash.empty()) {
      const int32_t d = static_cast<int32_t>(sr.stash.front().pos - c.pos);
      if (d > 0) return false;  // before what the stash holds: not a promise we kept
      if (d == 0) {
        wqe = sr.stash.front();
        sr.stash.pop_front();
        have = true;
        break;
      }
      // A promise whose CQE never reached us (it was lost, or bogus): the
      // later ones go on.
      sr.stash.pop_front();
    }
    if (!have) {
      // Every other consumer of a promised position holds sr.lock (the
      // flush's and the reset's drains too) or claims only past the
      // promises (deliver): a plain claim.
      RingResult r = sr.rq.try_claim_at_sc(c.pos);
      if (!r) return false;  // taken by a flush or reset, or a bogus CQE
      read_wqe(r.handle, ring_max_sge(sr.rq), &wqe);
      // A promised position is never announced by a take record's holder,
      // so nobody adopts it: a plain release (no locked instruction, so the
      // line's transfer back from the initiator, who read it, does not stall
      // us here).
      sr.rq.release(r.handle);
    }
  }
  uint32_t status = IBV_WC_SUCCESS, opcode = IBV_WC_RECV, byte_len = c.byte_len;
  if (c.kind == layout::kStagedWriteImm) {
    opcode = IBV_WC_RECV_RDMA_WITH_IMM;  // its bytes went where its rkey named
  } else if (c.kind == layout::kStagedInPlace) {
    // The initiator moved the bytes already (and checked the buffers).
    uint64_t room = 0;
    for (uint32_t k = 0; k < wqe.num_sge; ++k) room += wqe.sge[k].length;
    byte_len = static_cast<uint32_t>(std::min<uint64_t>(c.byte_len, room));
  } else {
    // The bytes into the WQE's buffers, each checked against our MRs as a
    // receive buffer (resolve_local: live MR of the QP's PD, local write, in
    // range).
    //
    // The bytes in registers, from the 8-byte words of the StagedCqe (layout.h)
    // that hold them, as send_leaf wrote them: bytes 0-7 (lo), 8-15 (hi),
    // 16-19 (top). Each word lies inside one of the stores that copied the
    // CQE into c, so its load takes the stored value at once; the 8 bytes of
    // data1 (offset 12) straddle two of them, and a load of those waits for
    // both stores to reach the cache first.
    static_assert(offsetof(layout::StagedCqe, data0) == 4 && offsetof(layout::StagedCqe, data1) == 12 &&
                  offsetof(layout::StagedCqe, data2) == 48 && layout::kStagedMaxData == 20 &&
                  __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
    uint64_t w0, w1, w2, w6;
    const auto* cb = reinterpret_cast<const std::byte*>(&c);
    std::memcpy(&w0, cb, 8);
    std::memcpy(&w1, cb + 8, 8);
    std::memcpy(&w2, cb + 16, 8);
    std::memcpy(&w6, cb + 48, 8);
    const uint64_t lo = w0 >> 32 | (w1 & ~uint64_t{0xffffffff});
    const uint64_t hi = (w2 & 0xffffffff) | w6 << 32;
    const uint32_t top = static_cast<uint32_t>(w6 >> 32);
    const uint32_t len = std::min(c.byte_len, layout::kStagedMaxData);
    uint32_t done = 0;
    // The common case: a first buffer that holds up to 16 bytes, written
    // from the registers (store_small: store_upto20 would cost the poll a
    // compare more for the 17-20 bytes only deliver_staged sends).
    const layout::WireSge& s0 = wqe.sge[0];
    if (len <= 16 && wqe.num_sge != 0 && s0.length >= len) [[likely]] {
      if (len) {
        if (void* p = const_cast<void*>(resolve_local(s0.lkey, pd, s0.addr, len, kAccessLocalWrite)))
          store_small(static_cast<uint8_t*>(p), len, lo, hi);
        else
          status = IBV_WC_LOC_PROT_ERR;
      }
      done = len;
    } else {
      // Several buffers, or more than 16 bytes.
      uint8_t data[layout::kStagedMaxData];
      std::memcpy(data, &lo, 8);
      std::memcpy(data + 8, &hi, 8);
      std::memcpy(data + 16, &top, 4);
      for (uint32_t k = 0; k < wqe.num_sge && done < len; ++k) {
        const layout::WireSge& s = wqe.sge[k];
        const uint32_t take = std::min(s.length, len - done);
        if (take == 0) continue;
        const void* p = resolve_local(s.lkey, pd, s.addr, take, kAccessLocalWrite);
        if (!p) {
          status = IBV_WC_LOC_PROT_ERR;
          break;
        }
        std::memcpy(const_cast<void*>(p), data + done, take);
        done += take;
      }
    }
    if (status == IBV_WC_SUCCESS && done < len) status = IBV_WC_LOC_LEN_ERR;
    byte_len = status == IBV_WC_SUCCESS ? len : 0;
    if (status != IBV_WC_SUCCESS) staged_responder_error(qi, c.qp_num & limits::kQpnMask);
  }
  w->wr_id = wqe.wr_id;
  w->status = static_cast<ibv_wc_status>(status);
  w->opcode = static_cast<ibv_wc_opcode>(opcode);
  w->vendor_err = 0;
  w->byte_len = byte_len;
  return true;
}

// A responder error of a staged receive (finish_staged, finish_srq_inline),
// as deliver's: the QP enters the error state and is flushed at our next
// progress pass. Only if the QP at index qi is still QP qpn, looked at under
// its StagedRx lock, which create_qp and destroy_qp take when they begin and
// end a QP there: a completion polled after its QP's destruction reports
// its error without putting a QP created at that index meanwhile in error.
void LocalContext::staged_responder_error(uint32_t qi, uint32_t qpn) noexcept {
  StagedRx& sr = staged_rx_[qi];
  BiasingGuard g(sr.lock);
  const uint64_t sq = sr.srq_qp.load(std::memory_order_relaxed);
  if (!(sr.live && sr.qpn == qpn) && !(sq != 0 && !(sq & StagedRx::kSrqQpGone) && static_cast<uint32_t>(sq) == qpn))
    return;
  layout::QpEntry* e = table<layout::QpEntry>(layout_.qp_table) + qi;
  e->qp_state.store(IBV_QPS_ERR, std::memory_order_release);
  layout::bump_version(e);
  header()->attention.fetch_add(1, std::memory_order_release);
}

int LocalContext::take_staged(const Ring& ring, RingSlotHeader* h, uint32_t p, ibv_wc* w, uint64_t* ts) noexcept {
  const auto* payload = reinterpret_cast<const std::byte*>(h) + kRingSlotHeaderBytes;
  uint32_t status;
  std::memcpy(&status, &w->status, sizeof status);
  if (status == layout::kSrqInlineStatus) {
    if (ts) *ts = 0;  // (its last bytes are data: never in a CQ with timestamps)
    return take_srq_inline(ring, h, p, w);
  }
  // An inline one's timestamp bytes are data (it never goes into a CQ with
  // timestamps); an in-place one keeps its stamp (take_cqe read it).
  static_assert(offsetof(layout::StagedCqe, kind) == kWcTakeTag);
  if (ts && __atomic_load_n(reinterpret_cast<const uint8_t*>(payload) + kWcTakeTag, __ATOMIC_RELAXED) !=
                layout::kStagedInPlace)
    *ts = 0;
  const bool took = finish_staged(payload, w);
  ring.release_sc(h, p);
  return took ? 1 : 0;
}

}  // namespace shmrdma
