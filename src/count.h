// The data-path hooks of the per-port counters (design: counters.h). Each is
// one call from transport.cc, made under the initiator QP's send lock; each
// update is a relaxed load + relaxed store on the QP's own record.
//
// What is counted (payload bytes, not headers; a message of L bytes is
// max(1, ceil(L / path MTU)) packets, UD's MTU is 4096):
//  - a request the initiator executed to the end: sent on its port, received
//    on the destination's port (RC/UC/XRC: the port the path's DLID names;
//    UD: the destination QP's port). READ: a 1-packet request, the data
//    comes back as responses (sent by the destination's port, received on
//    ours). Atomics: 1 packet of 8 bytes each way. Requests that complete in
//    error are counted in send_err (and the retry counters), not as packets;
//  - UD messages that reach a QP count as received there whether or not a
//    receive was posted (kCntUdDropNoRecv counts the latter); messages that
//    reach no QP (no such QP, not receiving, Q_Key mismatch) count
//    kCntUdDropInvalid on the port the destination LID names (the sender's
//    when none does);
//  - RNR NAKs: one when a send first finds no receive, one more per RNR
//    timer period it keeps waiting (at most rnr_retry + 1 unless infinite);
//  - acknowledgements are not modelled (no packets counted for them);
//  - a destination on another device of the home is counted for its port
//    there (a foreign label, counters.h), as one on ours is for ours.
#pragma once

#include "counters.h"
#include "directory.h"
#include "qp.h"

namespace shmrdma::count {

// One counter of the QP's own record, which only its send lock's holder
// writes: no read-modify-write is needed, only that a reader (shmrdma
// status, ibv_read_counters, another process) never sees a torn value. On
// x86-64 one `add` into the aligned word does that: an aligned 8-byte
// access is single-copy atomic there, and the instruction replaces the
// relaxed load, add and relaxed store (three instructions, and a register)
// on the posts' hot path. The asm says it reads and writes *a. Elsewhere,
// and under ThreadSanitizer (which does not see inside asm), the relaxed
// load and store.
[[gnu::always_inline]] inline void bump(std::atomic<uint64_t>& a, uint64_t n) noexcept {
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
  static_assert(sizeof a == 8 && alignof(std::atomic<uint64_t>) == 8);
  asm volatile("addq %1, %0" : "+m"(a) : "er"(n));
#else
  a.store(a.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);  // single writer: no RMW
#endif
}

inline bool multicast_lid(uint16_t lid) noexcept { return lid >= 0xc000 && lid <= 0xfffe; }

// QpCounting's destination label for the QP's current peer_dev / peer_port
// (configure, and sent when the path was resolved later).
void relabel(Qp* qp) noexcept;

// The group kGroupRemote of record `rec` for port `port` of device `dev`
// (nullptr / ours: our port; another device: its foreign label).
inline std::atomic<uint64_t>* remote_group(CounterSink& k, layout::QpCounterRecord* rec, const HomeDevice* dev,
                                           uint32_t port) noexcept {
  if (!dev || dev->self) [[likely]]
    return k.group(rec, layout::kGroupRemote, port);
  return k.group(rec, layout::kGroupRemote, foreign_label(dev->home_id, port), device_tag(dev->record()));
}

// A request of qp executed successfully: operation op of len bytes (UD:
// to destination LID dlid).
inline void sent_op(CounterSink& k, Qp* qp, uint32_t op, uint64_t len, uint16_t dlid) noexcept {
  if (op == IBV_WR_BIND_MW || op == IBV_WR_LOCAL_INV || !qp->cnt.rec) return;  // local: no packets
  const QpCounting& q = qp->cnt;
  const uint64_t pkts = len ? ((len - 1) >> q.mtu_shift) + 1 : 1;
  const bool read = op == IBV_WR_RDMA_READ;
  const bool atomic = op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
  const uint64_t req_pkts = (read || atomic) ? 1 : pkts, req_bytes = read ? 0 : atomic ? 8 : len;
  std::atomic<uint64_t>* l = k.group(q.rec, layout::kGroupLocal, q.port);
  if (!l) return;
  bump(l[layout::kCntXmitPkts], req_pkts);
  bump(l[layout::kCntXmitBytes], req_bytes);
  if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_SEND_WITH_INV) bump(l[layout::kCntRdmaSends], 1);
  if (qp->qp_type == IBV_QPT_UD) {
    if (multicast_lid(dlid)) bump(l[layout::kCntMcastXmitPkts], 1);
    return;  // its destinations count in ud_arrived
  }
  if (qp->peer_dev != q.rdev) [[unlikely]]
    relabel(qp);
  std::atomic<uint64_t>* r = k.group(q.rec, layout::kGroupRemote, q.rport, q.rtag);
  if (!r) return;
  bump(r[layout::kCntRcvPkts], req_pkts);
  bump(r[layout::kCntRcvBytes], req_bytes);
  if (read || atomic) {
    const uint64_t resp_pkts = read ? pkts : 1, resp_bytes = read ? len : 8;
    bump(r[layout::kCntXmitPkts], resp_pkts);
    bump(r[layout::kCntXmitBytes], resp_bytes);
    bump(l[layout::kCntRcvPkts], resp_pkts);
    bump(l[layout::kCntRcvBytes], resp_bytes);
  }
}

// progress: WQE s of qp executed successfully (Exec::kDone).
inline void sent(CounterSink& k, Qp* qp, const SendSlot* s) noexcept { sent_op(k, qp, s->opcode, s->length, s->av.dlid); }

// The two groups sent_rc keeps (QpCounting::fast_local / fast_remote), when
// they are set: then they are the ones group() would return, since a change
// of destination device clears them (Qp::set_peer_dev); nullptr otherwise.
inline std::atomic<uint64_t>* fast_groups(const Qp* qp) noexcept { return qp->cnt.fast_local; }

// post_send's fast path (execute_fast): an RC/UC WRITE, WRITE_WITH_IMM,
// SEND or SEND_WITH_IMM of len bytes executed; what sent() counts for them.
// sent_rc_slow (counters.cc) counts as sent_op and keeps the two groups in
// QpCounting for the next ones.
void sent_rc_slow(CounterSink& k, Qp* qp, uint32_t op, uint64_t len) noexcept;
// sent_rc's counting into the groups l (fast_groups(qp), not nullptr) and
// QpCounting::fast_remote: no slow path, no call (write_leaf's too).
[[gnu::always_inline]] inline void sent_rc_groups(Qp* qp, std::atomic<uint64_t>* l, uint32_t op,
                                                  uint64_t len) noexcept {
  const QpCounting& q = qp->cnt;
  std::atomic<uint64_t>* r = q.fast_remote;
  const uint64_t pkts = ((len - (len != 0)) >> q.mtu_shift) + 1;  // at least 1
  bump(l[layout::kCntXmitPkts], pkts);
  bump(l[layout::kCntXmitBytes], len);
  if (op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM) bump(l[layout::kCntRdmaSends], 1);
  bump(r[layout::kCntRcvPkts], pkts);
  bump(r[layout::kCntRcvBytes], len);
}
// send_leaf: an RC/UC SEND or SEND_WITH_IMM of len bytes (at most 64: one
// packet at any MTU) received by the target; sent_rc's and recv_done's
// counts into the groups l (fast_groups(qp), not nullptr).
[[gnu::always_inline]] inline void sent_small_send(Qp* qp, std::atomic<uint64_t>* l, uint64_t len) noexcept {
  std::atomic<uint64_t>* r = qp->cnt.fast_remote;
  bump(l[layout::kCntXmitPkts], 1);
  bump(l[layout::kCntXmitBytes], len);
  bump(l[layout::kCntRdmaSends], 1);
  bump(r[layout::kCntRcvPkts], 1);
  bump(r[layout::kCntRcvBytes], len);
  bump(r[layout::kCntRdmaRecvs], 1);
}
// send_leaf: an RC/UC SEND or SEND_WITH_IMM of len bytes (any length)
// received by the target; sent_rc's and recv_done's counts into the groups l
// (fast_groups(qp), not nullptr).
[[gnu::always_inline]] inline void sent_send(Qp* qp, std::atomic<uint64_t>* l, uint32_t op, uint64_t len) noexcept {
  sent_rc_groups(qp, l, op, len);
  bump(qp->cnt.fast_remote[layout::kCntRdmaRecvs], 1);
}
inline void sent_rc(CounterSink& k, Qp* qp, uint32_t op, uint64_t len) noexcept {
  std::atomic<uint64_t>* l = fast_groups(qp);
  if (!l) [[unlikely]]
    return sent_rc_slow(k, qp, op, len);
  sent_rc_groups(qp, l, op, len);
}

// execute_fast_in (transport.cc): an RC READ of len bytes or an atomic
// executed; what sent_op counts for it (a one-packet request of 0 bytes or
// 8, the response's packets and bytes the other way), through the groups
// sent_rc keeps (sent_rc_slow counts as sent_op and keeps them).
inline void sent_rc_in(CounterSink& k, Qp* qp, uint32_t op, uint64_t len) noexcept {
  const QpCounting& q = qp->cnt;
  std::atomic<uint64_t>* l = fast_groups(qp);
  if (!l) [[unlikely]]
    return sent_rc_slow(k, qp, op, len);
  std::atomic<uint64_t>* r = q.fast_remote;
  const bool read = op == IBV_WR_RDMA_READ;
  const uint64_t req_bytes = read ? 0 : 8;
  const uint64_t resp_pkts = read ? ((len - (len != 0)) >> q.mtu_shift) + 1 : 1, resp_bytes = read ? len : 8;
  bump(l[layout::kCntXmitPkts], 1);
  bump(l[layout::kCntXmitBytes], req_bytes);
  bump(r[layout::kCntRcvPkts], 1);
  bump(r[layout::kCntRcvBytes], req_bytes);
  bump(r[layout::kCntXmitPkts], resp_pkts);
  bump(r[layout::kCntXmitBytes], resp_bytes);
  bump(l[layout::kCntRcvPkts], resp_pkts);
  bump(l[layout::kCntRcvBytes], resp_bytes);
}

// deliver: a receive WQE of QP t (on device dev) completed successfully.
// UD: t's own port (untrusted, checked by group()); the others the path's.
inline void recv_done(CounterSink& k, Qp* qp, const layout::QpEntry* t, const HomeDevice* dev) noexcept {
  QpCounting& q = qp->cnt;
  if (fast_groups(qp)) [[likely]] {  // RC/UC: sent_rc's groups
    bump(q.fast_remote[layout::kCntRdmaRecvs], 1);
    return;
  }
  if (!q.rec) return;
  std::atomic<uint64_t>* r = nullptr;
  if (qp->qp_type == IBV_QPT_UD) {
    r = remote_group(k, q.rec, dev, t->port);
  } else {
    if (qp->peer_dev != q.rdev) [[unlikely]]
      relabel(qp);
    r = k.group(q.rec, layout::kGroupRemote, q.rport, q.rtag);
  }
  if (r) bump(r[layout::kCntRdmaRecvs], 1);
}

// execute_ud: UD message s reached QP t of device dev (no_recv: it had no
// receive posted).
inline void ud_arrived(CounterSink& k, Qp* qp, const SendSlot* s, const layout::QpEntry* t, const HomeDevice* dev,
                       bool no_recv) noexcept {
  if (!qp->cnt.rec) return;
  std::atomic<uint64_t>* r = remote_group(k, qp->cnt.rec, dev, t->port);
  if (!r) return;
  bump(r[layout::kCntRcvPkts], 1);
  bump(r[layout::kCntRcvBytes], s->length);
  if (multicast_lid(s->av.dlid)) bump(r[layout::kCntMcastRcvPkts], 1);
  if (no_recv) bump(r[layout::kCntUdDropNoRecv], 1);
}

// execute_ud: a unicast UD message s reached no QP (no such QP, not
// receiving, wrong Q_Key or address). Counted on the port its LID names
// (as received there), else on the sender's port. Multicast members that
// vanished are not drops (they left the group).
void ud_invalid_slow(CounterSink& k, Qp* qp, const SendSlot* s) noexcept;
inline void ud_invalid(CounterSink& k, Qp* qp, const SendSlot* s, bool unicast) noexcept {
  if (unicast && qp->cnt.rec) ud_invalid_slow(k, qp, s);
}

// execute: an RC send found no receive at QP t and waits (RNR) since
// qp->wait_started_ns; period_ns: t's RNR timer; rnr_retry: 7 = forever.
inline void rnr_nak(CounterSink& k, Qp* qp, uint64_t now, uint64_t period_ns, uint32_t rnr_retry) noexcept {
  QpCounting& q = qp->cnt;
  if (!q.rec) return;
  const uint64_t start = qp->wait_started_ns;
  if (q.rnr_wait != start) {
    q.rnr_wait = start;
    q.rnr_naks = 0;
  }
  uint64_t n = 1 + (now > start && period_ns ? (now - start) / period_ns : 0);
  if (rnr_retry != 7 && n > uint64_t{rnr_retry} + 1) n = uint64_t{rnr_retry} + 1;
  if (n <= q.rnr_naks) return;
  const uint64_t d = n - q.rnr_naks;
  q.rnr_naks = n;
  if (std::atomic<uint64_t>* l = k.group(q.rec, layout::kGroupLocal, q.port)) bump(l[layout::kCntRnrNakRcvd], d);
  if (qp->peer_dev != q.rdev) [[unlikely]]
    relabel(qp);
  if (std::atomic<uint64_t>* r = k.group(q.rec, layout::kGroupRemote, q.rport, q.rtag))
    bump(r[layout::kCntRnrNakSent], d);
}

// complete_send: a send completion with `status` (only errors count).
void send_error_slow(CounterSink& k, Qp* qp, uint32_t status) noexcept;
inline void send_completed(CounterSink& k, Qp* qp, uint32_t status) noexcept {
  if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR) [[unlikely]]
    send_error_slow(k, qp, status);
}

// modify_qp (under the send lock): the QP's port, the DLID's port, the MTU.
void configure(CounterSink& k, Qp* qp) noexcept;

}  // namespace shmrdma::count
