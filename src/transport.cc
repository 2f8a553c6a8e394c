// The shared-memory transport (RC, UC, XRC): executing a work request.
// The RC transport: the initiator executes its own work requests. Posting a
// send is the doorbell and the work: the posting thread validates the WQE,
// resolves the target QP in the peer's segment, takes a receive WQE from the
// target's receive queue when the operation consumes one, moves the data,
// and writes the completions (the target's receive completion into the
// target's CQ, our send completion into ours).
//
// Trust: the peer's QP, MR, CQ and ring descriptors come from its shared
// segment. They are validated before use and can only misdirect data within
// the peer's own memory (CMA targets the peer's pid) or make the operation
// fail; our own buffers are resolved from our private MR table only.
//
// The transport is split by responsibility: transport_post.cc posts and
// drives the send queue and writes send completions, this file executes an
// RC/UC/XRC WQE (target resolution, one-sided data movement), and
// transport_take.cc takes the target's receive WQE for two-sided
// operations; transport_ud.cc is UD. transport_internal.h holds what they
// share.
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

// The target's MR for `key` as a key of `kind` (lkey or rkey), checked
// against the PD, the access it must grant and the range. On success *out
// has the host address in the target's address space and, when the bytes
// can be touched directly (the target is this process, or the MR is in the
// mapped tier and we mapped it), a local pointer to them.
bool LocalContext::resolve_remote(Qp* qp, Peer& peer, uint32_t key, bool rkey, uint32_t pd, uint32_t need,
                                  uint64_t addr, uint64_t len, Remote* out, uint32_t target_qpn) noexcept {
  layout::MrEntry* e = peer.mr(layout::key_index(key));
  if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) return false;  // A1 pairs with R1
  // One snapshot of the untrusted entry inside the owner's seqlock (layout.h
  // mr_entry_read), for MRs (re-registration) and windows (binds) alike;
  // everything below uses the copy. The owner's write is a few stores: a
  // bounded retry outlasts it unless the owner is preempted in the middle.
  //
  // The QP keeps the last MR's snapshot (Qp::RemoteKeyCache, one for rkeys,
  // one for receive buffers' lkeys): while the
  // entry's seqlock still has the value it had then, the copy is the entry's
  // content and is used again without reading the entry. Windows are read
  // every time (their validity, mw_key, changes outside the seqlock). A peer
  // that rewinds its seqlock to an old value gets its old snapshot back:
  // validated like any snapshot, it can only direct the access within its
  // own memory.
  std::atomic_ref<uint32_t> gen(e->generation);
  Qp::RemoteKeyCache& rc = rkey ? qp->rkey_cache : qp->recv_key_cache;
  Qp::MrSnapshot fresh;
  const Qp::MrSnapshot* snp = &rc.snap;
  const bool cached = rc.entry == e && rc.key == key && rc.rkey == rkey && rc.peer_stamp == peer.stamp &&
                      gen.load(std::memory_order_acquire) == rc.gen;
  if (!cached) {
    Qp::MrSnapshot& sn = fresh;
    snp = &fresh;
    bool stable = false;
    uint32_t g = 0;
    for (int attempt = 0; attempt < 256 && !stable; ++attempt) {
      if (attempt) {
        if (attempt % 16 == 0)
          sched_yield();
        else
          __builtin_ia32_pause();
      }
      uint64_t mk = 0;
      const layout::EntryRead r = layout::mr_entry_read(e, &g, [&] {
        sn.kind = e->kind;
        if (sn.kind != layout::kKindMr && !rkey) return false;  // a memory window (mw.cc): an rkey only
        mk = e->mw_key.load(std::memory_order_acquire);
        // A window answers only while bound and valid with exactly this key.
        if (sn.kind != layout::kKindMr && mk != (layout::kMwValid | key)) return false;
        sn.key = sn.kind != layout::kKindMr ? key : rkey ? e->rkey : e->lkey;
        sn.pd = e->pd_index;
        sn.access = e->access;
        sn.mw_qpn = e->mw_qpn;
        sn.iova = e->iova;
        sn.length = e->length;
        sn.host = e->host_addr;
        sn.tier = e->tier;
        sn.memfd = e->memfd;
        sn.map_start = e->map_start;
        sn.map_len = e->map_len;
        sn.map_id = e->map_id;
        return true;
      });
      if (r == layout::EntryRead::kRefused) return false;
      stable = r == layout::EntryRead::kStable &&
               (sn.kind == layout::kKindMr || e->mw_key.load(std::memory_order_relaxed) == mk);
    }
    if (!stable) return false;
    // Only a key the MR answers to is cached: remote_hit, which compares
    // the key alone, would take any other for it.
    if (sn.kind == layout::kKindMr && sn.key == key) {
      rc.entry = e;
      rc.key = key;
      rc.rkey = rkey;
      rc.peer_stamp = peer.stamp;
      rc.gen = g;
      rc.snap = sn;
      rc.map.reset();
      arm_write_hit(rc, peer);
    }
  }
  const Qp::MrSnapshot& sn = *snp;
  if (sn.kind == layout::kKindMw2 && sn.mw_qpn != target_qpn) return false;  // type 2B: bound to one QP
  if (sn.key != key || sn.pd != pd || (sn.access & need) != need) return false;
  if (addr < sn.iova || len > sn.length || addr - sn.iova > sn.length - len) return false;
  out->host = sn.host + (addr - sn.iova);
  out->local = nullptr;
  out->mapped = false;
  out->odp = sn.access & kAccessOnDemand;
  if (out->odp) return true;  // CMA only, even within this process: EFAULT, never a fault
  if (peer.self_process) {
    out->local = reinterpret_cast<uint8_t*>(out->host);
    out->mapped = sn.tier == layout::kTierMapped;
    return true;
  }
  const uint64_t map_start = sn.map_start, map_len = sn.map_len;
  if (sn.tier != layout::kTierMapped || out->host < map_start || len > map_len ||
      out->host - map_start > map_len - len)
    return true;  // CMA
  // The mapping of the cached snapshot, once found.
  const bool this_snapshot = sn.kind == layout::kKindMr && rc.entry == e && rc.key == key && rc.rkey == rkey;
  if (this_snapshot && rc.map) {
    out->local = rc.map->base + (out->host - map_start);
    out->mapped = true;
    return true;
  }
  // Small per-QP cache of mappings: the common case takes no lock.
  const uint32_t ncache = static_cast<uint32_t>(qp->map_cache.size());
  for (uint32_t n = 0, i = qp->map_cache_last; n < ncache; ++n, i = (i + 1) % ncache) {
    auto& c = qp->map_cache[i];  // the entry that hit last time first
    if (c.map && c.peer_stamp == peer.stamp && c.memfd == sn.memfd && c.map_id == sn.map_id &&
        c.map->start == map_start && c.map->len == map_len) {
      qp->map_cache_last = i;
      out->local = c.map->base + (out->host - map_start);
      out->mapped = true;
      if (this_snapshot) {
        rc.map = c.map;
        arm_write_hit(rc, peer);
      }
      return true;
    }
  }
  std::shared_ptr<PeerMapping> m = peer.mappings.get(peer.pid, sn.memfd, sn.map_id, map_start, map_len);
  if (!m) return true;  // could not map: CMA still works
  auto& slot = qp->map_cache[qp->map_cache_next++ % qp->map_cache.size()];
  slot.map = m;
  slot.peer_stamp = peer.stamp;
  slot.memfd = sn.memfd;
  slot.map_id = sn.map_id;
  if (this_snapshot) {
    rc.map = m;
    arm_write_hit(rc, peer);
  }
  out->local = m->base + (out->host - map_start);
  out->mapped = true;
  return true;
}

// Our side of a WQE: its inline bytes, or its SGEs checked against our MRs.
bool LocalContext::gather_local(Qp* qp, SendSlot* s, IoVec* local, uint32_t* n, bool* odp) noexcept {
  *n = 0;
  if (odp) *odp = false;
  qp->local_odp = false;
  if (s->inline_len) {
    local[(*n)++] = {qp->inline_data(s), s->inline_len};
    return true;
  }
  const bool into_local = s->opcode == IBV_WR_RDMA_READ || is_atomic(s->opcode);
  ibv_sge* sg = qp->sges(s);
  for (uint32_t k = 0; k < s->num_sge; ++k) {
    if (sg[k].length == 0) continue;
    const void* p = resolve_local(sg[k].lkey, qp->pd, sg[k].addr, sg[k].length, into_local ? kAccessLocalWrite : 0);
    if (!p) return false;
    if (local_is_odp(sg[k].lkey)) {
      // On-demand memory must be mapped by now (else a local protection
      // error); the move then goes through CMA (qp->local_odp).
      if (!local_range_mapped(reinterpret_cast<uintptr_t>(p), sg[k].length)) return false;
      qp->local_odp = true;
      if (odp) *odp = true;
    }
    local[(*n)++] = {const_cast<void*>(p), sg[k].length};
  }
  return true;
}

namespace {

// A READ's bytes from a reachable source (the mapped tier or this
// process): up to 16 bytes with every load before any store (source and
// destination may overlap: both can be in one MR of this process), longer
// ones with move_bytes (a memmove; above kMovePiece in pieces, mover.h).
inline void copy_in(void* dst, const void* src, size_t len) noexcept {
  if (len <= 16)
    copy_upto16(dst, src, len);
  else
    move_bytes(dst, src, len);
}

}  // namespace

int LocalContext::post_fast_in(Qp* qp, const ibv_send_wr& wr, uint64_t total) noexcept {
  BiasingGuard lk(qp->sq_lock);
  const uint32_t tail = qp->sq_tail;
  if (tail - qp->sq_retire >= qp->caps.max_send_wr) return ENOMEM;
  if (qp->sq_exec == tail && qp->state() == IBV_QPS_RTS && execute_fast_in(qp, wr, total) == Exec::kDone) [[likely]] {
    qp->sq_tail = qp->sq_exec = tail + 1;
    if ((wr.send_flags & IBV_SEND_SIGNALED) || qp->sq_sig_all) {
      complete_send(qp, wr.wr_id, wr.opcode, total, IBV_WC_SUCCESS);
      qp->sq_retire = qp->sq_exec;  // a signaled completion retires every earlier WQE
    }
    return 0;
  }
  queue_locked(qp, wr, total, false, false, IBV_WC_SUCCESS);
  return 0;
}

// execute's checks for a READ or an atomic of an RC QP, in its order, each
// on one read of the untrusted entry; whatever does not pass, or is not at
// hand, is kNotHandled and execute sees the WQE as if this had not run.
LocalContext::Exec LocalContext::execute_fast_in(Qp* qp, const ibv_send_wr& wr, uint64_t len) noexcept {
  Peer* pp;
  layout::QpEntry* t = fast_target(qp, &pp);  // as execute_fast
  if (!t) [[unlikely]]
    return Exec::kNotHandled;
  Peer& peer = *pp;
  // Our SGE: it receives the bytes, so its MR must grant local write
  // (gather_local's into_local); live, an MR, not on-demand, this lkey and
  // our PD in MrState::fast_match, then the range. A READ of 0 bytes names
  // no memory (gather_local skips empty SGEs).
  const ibv_sge& g = wr.sg_list[0];
  void* dst = nullptr;
  if (len) {
    const uint32_t i = layout::key_index(g.lkey);
    if (i >= mr_slots_) [[unlikely]]  // mrs_.size(), as execute_fast
      return Exec::kNotHandled;
    const MrState& m = mrs_[i];
    const uint64_t off = g.addr - m.iova;  // wraps (and fails) below iova: our MRs are shorter than 2^63
    if (m.fast_match != (qp->pd_match | g.lkey) || !(m.access & kAccessLocalWrite) || off > m.length ||
        len > m.length - off) [[unlikely]]
      return Exec::kNotHandled;
    dst = reinterpret_cast<void*>(m.addr + off);
  }
  qp->local_odp = false;
  Remote rm;
  if (wr.opcode == IBV_WR_RDMA_READ) {
    if (len) {
      if (!(qp->tgt.access & IBV_ACCESS_REMOTE_READ) ||
          !remote_hit(qp, peer, wr.wr.rdma.rkey, true, qp->tgt.pd, IBV_ACCESS_REMOTE_READ, wr.wr.rdma.remote_addr,
                      len, &rm)) [[unlikely]]
        return Exec::kNotHandled;
      if (rm.local) {
        copy_in(dst, rm.local, len);
      } else {
        // CMA: a failed read changed nothing we keep; the general path reads
        // again and reports.
        IoVec l{dst, len}, r{reinterpret_cast<void*>(rm.host), len};
        if (move_in(peer.pid, false, &l, 1, &r, 1)) return Exec::kNotHandled;
      }
    }
  } else {
    // The atomics: an 8-byte aligned target (else execute fails it with
    // IBV_WC_REM_INV_REQ_ERR), an MR in the mapped tier (CPU atomics are
    // atomic with every other RDMA atomic on it; the CMA tier's striped lock
    // is execute's).
    const uint64_t addr = wr.wr.atomic.remote_addr;
    if ((addr % 8) || !(qp->tgt.access & IBV_ACCESS_REMOTE_ATOMIC) ||
        !remote_hit(qp, peer, wr.wr.atomic.rkey, true, qp->tgt.pd, IBV_ACCESS_REMOTE_ATOMIC, addr, 8, &rm) ||
        !rm.mapped) [[unlikely]]
      return Exec::kNotHandled;
    std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(rm.local));
    uint64_t old;
    if (wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
      old = wr.wr.atomic.compare_add;
      word.compare_exchange_strong(old, wr.wr.atomic.swap, std::memory_order_acq_rel, std::memory_order_acquire);
    } else {
      old = word.fetch_add(wr.wr.atomic.compare_add, std::memory_order_acq_rel);
    }
    std::memcpy(dst, &old, 8);
  }
  count::sent_rc_in(cnt_, qp, wr.opcode, len);  // counters: what progress counts (count::sent)
  return Exec::kDone;
}

LocalContext::Exec LocalContext::execute(Qp* qp, SendSlot* s, uint32_t* status) noexcept {
  if (qp->qp_type == IBV_QPT_UD) return execute_ud(qp, s, status);
  if (is_local_op(s->opcode)) {
    // Memory windows (mw.cc): local, they need no peer.
    *status = s->opcode == IBV_WR_BIND_MW ? execute_bind(qp, s) : execute_local_inv(s);
    return *status == IBV_WC_SUCCESS ? Exec::kDone : Exec::kError;
  }
  // The clock is read only when the WQE has to wait (a vDSO clock read
  // costs as much as a whole small WRITE).
  uint64_t now_cached = 0;
  auto now = [&now_cached] { return now_cached ? now_cached : (now_cached = now_ns()); };
  const QpAttr& a = qp->attr;
  // UC is unacknowledged: what RC would wait for or fail on (an absent
  // target, a missing receive, a remote error) silently drops the message
  // and the send completes.
  const bool uc = qp->qp_type == IBV_QPT_UC;
  // Transport-level wait: the target does not answer (absent, not ready, not
  // connected to us). Retried for timeout * (retry_cnt + 1), as the
  // transport timer and retry count would; a target process known to be dead
  // fails at once.
  auto transport_wait = [&]() -> Exec {
    if (uc) return Exec::kDone;
    if (qp->peer && !qp->peer->alive()) {
      *status = IBV_WC_RETRY_EXC_ERR;
      return Exec::kError;
    }
    if (!qp->wait_started_ns) qp->wait_started_ns = now();
    if (a.timeout != 0) {
      uint64_t period_ns = uint64_t{4096} << a.timeout;
      if (now() - qp->wait_started_ns > period_ns * (uint64_t{a.retry_cnt} + 1)) {
        *status = IBV_WC_RETRY_EXC_ERR;
        return Exec::kError;
      }
    }
    return Exec::kWait;
  };
  auto fail = [&](uint32_t st) -> Exec {
    if (uc) return Exec::kDone;
    *status = st;
    return Exec::kError;
  };

  // A path found by GID holds while both GID tables keep their seqlock
  // values (two loads); else it is resolved again, and a GID that left the
  // target's table leaves the destination unreachable (retried, then
  // IBV_WC_RETRY_EXC_ERR).
  if (qp->path_by_gid && !destination_holds(qp)) {
    (void)resolve_path(qp, true);
    qp->peer.reset();
  }
  if (!qp->peer || qp->peer->slot != layout::qpn_slot(a.dest_qp_num) || qp->peer->device != qp->peer_dev) {
    // The path's device (resolved at RTR; again when it is gone, or never
    // resolved: an unreachable destination is retried like a lost packet).
    if (!qp->peer_dev || qp->peer_dev->gone.load(std::memory_order_acquire)) (void)resolve_path(qp, false);
    qp->peer = peer_of(qp->peer_dev, a.dest_qp_num);
    if (!qp->peer) return transport_wait();
  }
  Peer& peer = *qp->peer;
  layout::QpEntry* t = peer.qp(qp->remote_index);
  // XRC_SEND connects to an XRC_RECV QP; the others to their own type.
  const bool xrc = qp->qp_type == IBV_QPT_XRC_SEND;
  const uint32_t want_type = xrc ? uint32_t{IBV_QPT_XRC_RECV} : qp->qp_type;
  if (!t || t->state.load(std::memory_order_acquire) != layout::kLive || t->qpn != a.dest_qp_num ||
      t->qp_type != want_type) {
    // The peer context we cached may have been replaced by a new one in the
    // same slot, or its device by a new one: look again next time.
    if (!peer.alive() || peer.device->gone.load(std::memory_order_acquire)) qp->peer.reset();
    return transport_wait();
  }
  uint32_t ts = t->qp_state.load(std::memory_order_acquire);  // pairs with the owner's release in modify_qp
  // Connected to us: our QPN on our device (QPNs are unique per device only).
  if ((ts != IBV_QPS_RTR && ts != IBV_QPS_RTS && ts != IBV_QPS_SQD && ts != IBV_QPS_SQE) || t->dest_qpn != qp->qpn ||
      t->dest_device != dir_.self_id())
    return transport_wait();
  uint32_t tpd = t->pd_index;
  const uint32_t taccess = t->access;
  // The process whose memory the operation touches: the target's, or with
  // XRC the owner of the SRQ the WQE names. Every XRC request names one
  // (the XRCETH of each packet): it must exist, be an XRC SRQ and be in the
  // XRC_RECV QP's domain, else the responder answers with an Invalid
  // Request NAK (IBV_WC_REM_INV_REQ_ERR, as mlx5 reports it). Its PD checks
  // the rkeys and receive buffers, its CQ gets the receive completion.
  Peer* dpeer = &peer;
  RecvSource xsrc;
  if (xrc) {
    const uint32_t srqn = s->xrc_srqn;
    Peer* owner = nullptr;
    layout::SrqEntry* se = find_xrc_srq(peer.device, srqn, &qp->xrc_peer, &owner);
    if (!se) return fail(IBV_WC_REM_INV_REQ_ERR);
    const uint64_t tdev = t->xrcd_dev, tino = t->xrcd_ino;
    if (se->xrcd_dev != tdev || se->xrcd_ino != tino) return fail(IBV_WC_REM_INV_REQ_ERR);
    xsrc.peer = owner;
    xsrc.se = se;
    xsrc.srq_index = layout::srqn_index(srqn);
    xsrc.srqn = srqn;
    xsrc.pd = se->pd_index;
    xsrc.cq = se->cq_index;
    dpeer = owner;
    tpd = xsrc.pd;
  }
  Peer& mpeer = *dpeer;

  IoVec local[limits::kMaxSge];
  uint32_t nlocal = 0;
  if (s->inline_len) {  // the small path: the bytes are in the slot (gather_local's first case, without the call)
    qp->local_odp = false;
    local[0] = {qp->inline_data(s), s->inline_len};
    nlocal = 1;
  } else if (!gather_local(qp, s, local, &nlocal)) {
    *status = IBV_WC_LOC_PROT_ERR;
    return Exec::kError;
  }
  const uint64_t len = s->length;

  Remote rm;
  auto remote_access = [&](uint32_t need, uint64_t bytes) __attribute__((always_inline)) -> bool {
    if ((taccess & need) != need) return false;
    return resolve_remote(qp, mpeer, s->rkey, true, tpd, need, s->remote_addr, bytes, &rm, t->qpn);
  };
  auto move_failed = [&](int rc) -> Exec {
    // EFAULT on an on-demand MR: its memory is not mapped (an access error);
    // our own ODP SGEs were checked mapped before, so the fault is theirs.
    if (rc == EFAULT && rm.odp) return fail(IBV_WC_REM_ACCESS_ERR);
    if (rc == EFAULT && qp->local_odp) return fail(IBV_WC_LOC_PROT_ERR);
    return fail((rc == ESRCH || rc == EPERM) ? IBV_WC_RETRY_EXC_ERR : IBV_WC_REM_OP_ERR);
  };

  // One-sided data movement first (WRITE, WRITE_WITH_IMM, READ, atomics).
  if (s->opcode == IBV_WR_RDMA_WRITE || s->opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
    if (len) {
      if (!remote_access(IBV_ACCESS_REMOTE_WRITE, len)) return fail(IBV_WC_REM_ACCESS_ERR);
      const bool direct = rm.local && !qp->local_odp;
      IoVec remote{direct ? static_cast<void*>(rm.local) : reinterpret_cast<void*>(rm.host), len};
      if (int rc = move_out(mpeer.pid, direct, local, nlocal, &remote, 1, true)) return move_failed(rc);
    }
  } else if (s->opcode == IBV_WR_RDMA_READ) {
    if (len) {
      if (!remote_access(IBV_ACCESS_REMOTE_READ, len)) return fail(IBV_WC_REM_ACCESS_ERR);
      const bool direct = rm.local && !qp->local_odp;
      IoVec remote{direct ? static_cast<void*>(rm.local) : reinterpret_cast<void*>(rm.host), len};
      if (int rc = move_in(mpeer.pid, direct, local, nlocal, &remote, 1)) return move_failed(rc);
    }
  } else if (is_atomic(s->opcode)) {
    if (s->remote_addr % 8) return fail(IBV_WC_REM_INV_REQ_ERR);
    if (!remote_access(IBV_ACCESS_REMOTE_ATOMIC, 8)) return fail(IBV_WC_REM_ACCESS_ERR);
    uint64_t old = 0;
    if (rm.mapped) {
      // Every peer of a mapped-tier MR reaches it through a mapping, so CPU
      // atomics are atomic with respect to all RDMA atomics on it.
      std::atomic_ref<uint64_t> word(*reinterpret_cast<uint64_t*>(rm.local));
      if (s->opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
        old = s->compare_add;
        word.compare_exchange_strong(old, s->swap, std::memory_order_acq_rel, std::memory_order_acquire);
      } else {
        old = word.fetch_add(s->compare_add, std::memory_order_acq_rel);
      }
    } else {
      // CMA tier: read-modify-write under the device's striped atomic lock.
      uint32_t stripe = static_cast<uint32_t>((rm.host >> 3) ^ static_cast<uint64_t>(mpeer.pid) * 0x9e3779b9u);
      // The target device's stripes: every RDMA atomic on this memory takes them.
      Registry& areg = *mpeer.registry;
      if (areg.lock_atomic(stripe) != 0) return fail(IBV_WC_REM_OP_ERR);
      uint64_t next = 0;
      IoVec mine{&old, 8}, theirs{reinterpret_cast<void*>(rm.host), 8};
      const bool same = mpeer.self_process && !rm.odp;
      int rc = move_in(mpeer.pid, same, &mine, 1, &theirs, 1);
      if (rc == 0) {
        bool store = true;
        if (s->opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
          store = old == s->compare_add;
          next = s->swap;
        } else {
          next = old + s->compare_add;
        }
        IoVec nv{&next, 8};
        if (store) rc = move_out(mpeer.pid, same, &nv, 1, &theirs, 1, false);
      }
      areg.unlock_atomic(stripe);
      if (rc) return move_failed(rc);
    }
    if (qp->local_odp) {  // our ODP result buffer: written through CMA too
      IoVec src{&old, 8};
      if (int rc = move_out(::getpid(), false, &src, 1, &local[0], 1, false)) return move_failed(rc);
    } else {
      std::memcpy(local[0].base, &old, 8);
    }
  }

  if (!consumes_recv(s->opcode)) {
    qp->wait_started_ns = 0;
    return Exec::kDone;
  }

  // Two-sided: the target's next receive WQE (its RQ or its SRQ).
  layout::Cqe cqe{};
  cqe.qp_num = t->qpn;
  cqe.src_qp = qp->qpn;
  cqe.slid = registry_.device().ports[std::max<uint32_t>(a.port_num, 1) - 1].lid;
  cqe.opcode = s->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  if (s->send_flags & IBV_SEND_SOLICITED) cqe.flags = layout::kCqeSolicited;  // wakes solicited_only arming
  if (s->opcode == IBV_WR_SEND_WITH_INV) {
    cqe.imm_data = s->imm_data;  // invalidated_rkey (host order); deliver() invalidates it
    cqe.wc_flags = IBV_WC_WITH_INV;
  } else if (s->opcode != IBV_WR_SEND) {
    cqe.imm_data = s->imm_data;
    cqe.wc_flags = IBV_WC_WITH_IMM;
  }
  // A SEND into a QP without an SRQ is promised the receiver's next WQE
  // (transport_staged.cc).
  Deliver d = Deliver::kNotStaged;
  if (!xrc && may_stage(s->opcode, t)) d = deliver_staged(qp, peer, t, s->opcode, s->length, local, nlocal, cqe, !uc);
  if (d == Deliver::kNotStaged)
    d = deliver(qp, peer, t, s->opcode, s->length, local, nlocal, nullptr, !uc, cqe, status, xrc ? &xsrc : nullptr);
  switch (d) {
    case Deliver::kDone:
    case Deliver::kNotStaged: break;
    case Deliver::kBusy: return Exec::kWait;
    case Deliver::kResponderError:
    case Deliver::kGone: return fail(*status);
    case Deliver::kNoReceive: {
      if (uc) break;  // dropped
      // Receiver not ready: wait (rnr_retry 7 = forever); its next post_recv
      // wakes us (initiator_waiting).
      if (!qp->wait_started_ns) qp->wait_started_ns = now();
      count::rnr_nak(cnt_, qp, now(), rnr_timer_us(t->min_rnr_timer) * 1000, a.rnr_retry);  // counters: RNR NAKs
      if (a.rnr_retry != 7) {
        uint64_t period_ns = rnr_timer_us(t->min_rnr_timer) * 1000;
        if (now() - qp->wait_started_ns > period_ns * (uint64_t{a.rnr_retry} + 1)) {
          *status = IBV_WC_RNR_RETRY_EXC_ERR;
          return Exec::kError;
        }
      }
      // A receiver whose context is gone fails the send. (A process that died
      // without closing it is found by check_peer's periodic look: /proc on
      // every retry of an RNR wait cost three syscalls each.)
      if (!peer.self_process && !peer.registry->slot_is(peer.slot, peer.generation)) {
        *status = IBV_WC_RETRY_EXC_ERR;
        return Exec::kError;
      }
      return Exec::kWait;
    }
  }
  qp->wait_started_ns = 0;
  return Exec::kDone;
}

}  // namespace shmrdma
