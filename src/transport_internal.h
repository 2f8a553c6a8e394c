// The shared-memory transport's private helpers, shared by its parts:
// transport_post.cc (posting, progress, send completions, flushes),
// transport.cc (executing RC/UC/XRC work requests and the one-sided data
// movement), transport_take.cc (the receive-take protocol: a receive WQE of
// the target, taken so that it completes exactly once even when an
// initiator dies) and transport_ud.cc (UD and multicast).
#pragma once

#include <time.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

#include <infiniband/verbs.h>

#include "context.h"
#include "count.h"
#include "layout.h"
#include "qp.h"

namespace shmrdma::transport {

inline uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// IB spec table 45: the RNR NAK timer field encoding, in microseconds.
// Longest RNR back-off (deliver): hardware's shortest RNR timer is 10 us.
constexpr uint64_t kRnrBackoffNs = 10'000;

inline uint64_t rnr_timer_us(uint32_t code) {
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,    40,    60,    80,    120,   160,   240,   320,
                                          480,    640,   960,   1280,  1920,  2560,  3840,  5120,  7680,  10240, 15360,
                                          20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[code & 31];
}

inline uint32_t wc_opcode(uint32_t wr_opcode) {
  switch (wr_opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM:
    case IBV_WR_SEND_WITH_INV: return IBV_WC_SEND;
    case IBV_WR_BIND_MW: return IBV_WC_BIND_MW;
    case IBV_WR_LOCAL_INV: return IBV_WC_LOCAL_INV;
    case IBV_WR_RDMA_READ: return IBV_WC_RDMA_READ;
    case IBV_WR_ATOMIC_CMP_AND_SWP: return IBV_WC_COMP_SWAP;
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return IBV_WC_FETCH_ADD;
    default: return IBV_WC_SEND;
  }
}

// Peer::ring with a cache, its miss out of line: the view is validated into
// the cache, which then holds it (as Peer::ring does).
[[gnu::noinline]] inline Ring* rq_ring_miss(const Peer& peer, uint64_t offset, uint64_t bytes, uint32_t capacity,
                                     uint32_t stride, RingCache* cache) noexcept {
  Ring fresh;
  if (!peer.ring(offset, bytes, capacity, stride, &fresh)) return nullptr;
  *cache = RingCache{peer.stamp, offset, capacity, stride, fresh};
  return &cache->ring;
}

// rq_ring's hit: *cache holds the ring of this geometry in this peer.
[[gnu::always_inline]] inline bool rq_ring_hit(const Peer& peer, uint64_t offset, uint32_t capacity, uint32_t stride,
                                               const RingCache& cache) noexcept {
  return cache.stamp == peer.stamp && cache.offset == offset && cache.capacity == capacity && cache.stride == stride;
}

[[gnu::always_inline]] inline Ring* rq_ring(const Peer& peer, uint64_t offset, uint64_t bytes, uint32_t capacity,
                                            uint32_t stride, RingCache* cache) noexcept {
  if (rq_ring_hit(peer, offset, capacity, stride, *cache)) [[likely]]
    return &cache->ring;
  return rq_ring_miss(peer, offset, bytes, capacity, stride, cache);
}

// The RNR back-off (deliver): the last attempt found no receive (an RNR
// NAK). Hardware retries after the responder's RNR timer; we go on as soon
// as a batch of receives is posted, or after at most kRnrBackoffNs.
// Retrying on every single receive instead keeps sender and receiver in
// lock step, each message paying a round trip between cores. Looked at
// before the receive record is reserved: a backing-off sender writes
// nothing of the target's (a record a dead holder left is looked at once
// the back-off ends, at most kRnrBackoffNs later). True while it lasts.
//
// A sender that polls meanwhile calls this on every poll. The receive ring's
// positions it reads are lines the receiver writes on every post, and a
// read on every poll took them back each time, so every post_recv waited a
// cache-line hand-off for its CAS (ib_send_bw, where the receiver is the
// bottleneck: the CAS was over half of post_recv's samples). So only every
// kRnrLookEvery-th call looks (and reads the clock): the back-off ends at
// most that many polls late, while the receiver already has a batch posted.
// look_now: the call is one of the rare ones made for an application that
// does not poll (LocalContext::rnr_look_now_): it looks.
constexpr uint32_t kRnrLookEvery = 8;
inline bool rnr_backing_off(Qp* qp, const Ring& rq, bool look_now) noexcept {
  if (!qp->rnr_backoff) return false;
  if (++qp->rnr_backoff_looks % kRnrLookEvery != 0 && !look_now) return true;
  const uint32_t batch = std::clamp<uint32_t>(rq.capacity() / 4, 1, 32);
  if (rq.size_approx() < batch && now_ns() - qp->rnr_backoff_since_ns < kRnrBackoffNs) return true;
  qp->rnr_backoff = false;
  return false;
}
// The back-off starts: an attempt found no receive.
inline void start_rnr_backoff(Qp* qp) noexcept {
  qp->rnr_backoff = true;
  qp->rnr_backoff_since_ns = now_ns();
  qp->rnr_backoff_looks = 0;
}

// An initiator that found no receive in t's queue (or the SRQ se, when it
// is a basic SRQ t takes from) tells the receiver someone waits: its
// post_recv wakes us (cq.cc wake_initiator; srq.cc srq_posted for an SRQ).
// The caller then looks once more: the fence pairs with the one the
// receiver runs after posting, so either we see its WQE or it sees the flag.
inline void announce_waiting(layout::QpEntry* t, layout::SrqEntry* se) noexcept {
  if (!t->initiator_waiting.load(std::memory_order_relaxed))  // the line stays shared while it is set
    t->initiator_waiting.store(1, std::memory_order_relaxed);
  if (se && !se->initiator_waiting.load(std::memory_order_relaxed))
    se->initiator_waiting.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline bool is_atomic(uint32_t op) { return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD; }

inline bool consumes_recv(uint32_t op) {
  return op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM ||
         op == IBV_WR_SEND_WITH_INV;
}

// Operations the owner executes on its own objects (mw.cc).
inline bool is_local_op(uint32_t op) { return op == IBV_WR_BIND_MW || op == IBV_WR_LOCAL_INV; }


// The largest move inside the push of a receive completion (deliver_staged's
// push_staged, send_leaf, srq_send_leaf): the CQ slot stays reserved and
// unpublished for at most that copy, ~2.5 us here. Above it the copy's drain
// is a few hundredths of a percent of the message and the bytes move first.
inline constexpr uint32_t kMoveInPushBytes = 256 * 1024;
inline constexpr uint32_t kMaxMsgBytes = limits::kMaxMsgSz;  // max_msg_sz (the provider's query_device)


// The shape checks of every send post (ibv_post_send(3)), one copy for both
// entry points (LocalContext::post_send from the ibv_send_wr, enqueue_send
// from a SendWr): the SGE count against the QP's cap, a list wherever SGEs
// are named, the inline size (inline applies to operations that carry data
// out: not READ, atomics or local operations, whose SGEs the caller passes
// as num_sge 0), an atomic's one 8-byte SGE, max_msg_sz (2^31). 0 with the
// total length and whether the bytes go inline, or EINVAL.
inline int check_send_shape(const QpCaps& caps, uint32_t op, uint32_t num_sge, const ibv_sge* sg, uint32_t flags,
                            uint64_t* total, bool* inl) noexcept {
  if (num_sge > caps.max_send_sge || (num_sge && !sg)) return EINVAL;
  uint64_t t = num_sge == 1 ? sg[0].length : 0;
  if (num_sge > 1)
    for (uint32_t k = 0; k < num_sge; ++k) t += sg[k].length;
  const bool atomic = is_atomic(op);
  const bool in = (flags & IBV_SEND_INLINE) && !atomic && op != IBV_WR_RDMA_READ && !is_local_op(op);
  if (in && t > caps.max_inline_data) return EINVAL;
  if (atomic && (num_sge != 1 || sg[0].length != 8)) return EINVAL;
  if (t > kMaxMsgBytes) return EINVAL;  // max_msg_sz
  *total = t;
  *inl = in;
  return 0;
}

constexpr uint64_t kGrhBytes = 40;  // the GRH area ahead of a UD message

// A receive completion the owner writes itself (flush, abort).
inline layout::Cqe recv_status_cqe(uint64_t wr_id, uint32_t status, uint32_t qpn) {
  layout::Cqe c{};
  c.wr_id = wr_id;
  c.status = status;
  c.opcode = IBV_WC_RECV;
  c.qp_num = qpn;
  return c;
}

}  // namespace shmrdma::transport

namespace shmrdma {

// The target of execute_fast and execute_fast_in: the peer and the target
// QP entry, checked in full once per version of the entry (layout.h
// QpEntry::version, check_target), then while the owner has not changed it,
// and we changed neither peer nor destination (modify_qp and
// set_destination clear Qp::tgt), the checks hold and the one word is all
// that is read.
// fast_target's hit: the target entry check_target kept, while its version
// and the peer are the ones it checked (nullptr: check it again).
[[gnu::always_inline]] inline layout::QpEntry* cached_target(const Qp* qp, const Peer& peer) noexcept {
  layout::QpEntry* t = qp->tgt.entry;
  if (!t || qp->tgt.peer_stamp != peer.stamp || t->version.load(std::memory_order_acquire) != qp->tgt.version)
    return nullptr;
  return t;
}

[[gnu::always_inline]] inline layout::QpEntry* LocalContext::fast_target(Qp* qp, Peer** peer) noexcept {
  Peer* pp = qp->peer.get();
  if (!pp) [[unlikely]]
    return nullptr;
  if (qp->path_by_gid && !destination_holds(qp)) return nullptr;
  *peer = pp;
  layout::QpEntry* t = cached_target(qp, *pp);
  if (!t) [[unlikely]]
    t = check_target(qp, *pp);
  return t;
}

// The hit path of resolve_remote (transport.cc), inline for the post's fast
// path and for receive buffers: the cached snapshot (an MR's, validated when
// it was taken) answers while the entry is live and its seqlock still has
// the value it had then. The same checks as resolve_remote on the copy.
inline bool LocalContext::remote_hit(Qp* qp, const Peer& peer, uint32_t key, bool rkey, uint32_t pd, uint32_t need,
                                     uint64_t addr, uint64_t len, Remote* out) const noexcept {
  // Each cache holds keys of one kind (resolve_remote), so rc.rkey == rkey.
  // The tag is the key and the peer object's stamp (Peer::stamp, never 0;
  // an empty cache has 0): the same key of the same peer names the same
  // entry (peer.mr(key_index(key)), the one resolve_remote cached).
  const Qp::RemoteKeyCache& rc = rkey ? qp->rkey_cache : qp->recv_key_cache;
  if (rc.key != key || rc.peer_stamp != peer.stamp) return false;
  auto* e = static_cast<layout::MrEntry*>(const_cast<void*>(rc.entry));
  if (e->state.load(std::memory_order_acquire) != layout::kLive ||  // A1 pairs with R1
      std::atomic_ref<uint32_t>(e->generation).load(std::memory_order_acquire) != rc.gen)
    return false;
  const Qp::MrSnapshot& sn = rc.snap;
  if (sn.pd != pd || (sn.access & need) != need || (sn.access & kAccessOnDemand)) return false;
  if (addr < sn.iova || len > sn.length || addr - sn.iova > sn.length - len) return false;  // any untrusted length
  const uint64_t host = sn.host + (addr - sn.iova);
  out->host = host;
  out->odp = false;
  if (peer.self_process) {
    out->local = reinterpret_cast<uint8_t*>(host);
    out->mapped = sn.tier == layout::kTierMapped;
    return true;
  }
  if (sn.tier != layout::kTierMapped || host < sn.map_start || len > sn.map_len ||
      host - sn.map_start > sn.map_len - len) {
    out->local = nullptr;  // CMA
    out->mapped = false;
    return true;
  }
  if (!rc.map) return false;  // not mapped yet: resolve_remote finds it
  out->local = rc.map->base + (host - sn.map_start);
  out->mapped = true;
  return true;
}

// A one-word hit of key cache rc (armed, Qp::RemoteKeyCache::wtag or
// rtag, by arm_write_hit): the cache names this peer and that tag is `tag`,
// which says the key, the PD and everything arm_write_hit checked of the
// snapshot; then, as remote_hit, the entry is live with the seqlock value
// of the snapshot (another process writes it), and the range is inside the
// MR (iova + length does not wrap: arm_write_hit). The local address of
// addr, or nullptr.
[[gnu::always_inline]] inline uint8_t* one_word_hit(const Qp::RemoteKeyCache& rc, uint64_t armed, const Peer& peer,
                                                    uint64_t tag, uint64_t addr, uint64_t len) noexcept {
  if (rc.peer_stamp != peer.stamp || armed != tag) return nullptr;
  auto* e = static_cast<layout::MrEntry*>(const_cast<void*>(rc.entry));
  if (e->state.load(std::memory_order_acquire) != layout::kLive ||  // A1 pairs with R1
      std::atomic_ref<uint32_t>(e->generation).load(std::memory_order_acquire) != rc.gen)
    return nullptr;
  const uint64_t off = addr - rc.snap.iova;  // below iova: wraps past length (no wrap in the MR's range)
  if (off > rc.snap.length || len > rc.snap.length - off) return nullptr;
  return rc.wbase + off;
}

// The WRITE's hit: the tag's PD is the target QP's as we cached it
// (TargetCache::wpd, kNoWritePd when the QP does not grant remote write).
inline uint8_t* LocalContext::remote_write_hit(const Qp* qp, const Peer& peer, uint32_t rkey, uint64_t addr,
                                               uint64_t len) noexcept {
  return one_word_hit(qp->rkey_cache, qp->rkey_cache.wtag, peer, uint64_t{rkey} << 32 | qp->tgt.wpd, addr, len);
}

// A READ's (read_leaf): the rkey cache's read tag against the target QP's
// PD as we cached it for reads (TargetCache::rpd).
inline const uint8_t* LocalContext::remote_read_hit(const Qp* qp, const Peer& peer, uint32_t rkey, uint64_t addr,
                                                    uint64_t len) noexcept {
  return one_word_hit(qp->rkey_cache, qp->rkey_cache.rtag, peer, uint64_t{rkey} << 32 | qp->tgt.rpd, addr, len);
}

// An atomic's (atomic_leaf): the rkey cache's atomic tag against the target
// QP's PD as we cached it for atomics (TargetCache::apd).
inline uint8_t* LocalContext::remote_atomic_hit(const Qp* qp, const Peer& peer, uint32_t rkey,
                                                uint64_t addr) noexcept {
  return one_word_hit(qp->rkey_cache, qp->rkey_cache.atag, peer, uint64_t{rkey} << 32 | qp->tgt.apd, addr, 8);
}

// A receive buffer's (the SEND leaves): the receive key cache's tag says
// the lkey, the PD (the target QP's, from its owner's memory: compared as
// remote_hit compares it) and that the MR grants local write, is not
// on-demand and is reachable here as a whole (arm_write_hit).
inline uint8_t* LocalContext::recv_write_hit(const Qp* qp, const Peer& peer, uint32_t lkey, uint32_t pd,
                                             uint64_t addr, uint64_t len) noexcept {
  // (A pd of kNoWritePd or above, which the peer may have written, could
  // match an unarmed tag, kNoWriteTag.)
  if (pd >= Qp::kNoWritePd) return nullptr;
  return one_word_hit(qp->recv_key_cache, qp->recv_key_cache.wtag, peer, uint64_t{lkey} << 32 | pd, addr, len);
}

// The local address of byte addr of the MR whose snapshot rc holds, or
// nullptr: for an address under a key remote_hit has just answered for in
// the same call (the entry live with the snapshot's seqlock value, the PD
// and access it needs), so only the range is new. srq_send_leaf's hint for
// the next WQE's buffer (own_dest_line). It is remote_hit's range part for
// one byte, written apart on purpose: remote_hit's own range part, split out
// and called here, cost the leaf 14 instructions more per message (UCX
// am_bw over rc_verbs: 553 against 539), for the fields of a Remote this
// hint does not need.
[[gnu::always_inline]] inline uint8_t* snapshot_byte(const Qp::RemoteKeyCache& rc, const Peer& peer,
                                                     uint64_t addr) noexcept {
  const Qp::MrSnapshot& sn = rc.snap;
  const uint64_t off = addr - sn.iova;  // below iova: wraps past length
  if (off >= sn.length) return nullptr;
  const uint64_t host = sn.host + off;
  if (peer.self_process) return reinterpret_cast<uint8_t*>(host);
  if (sn.tier != layout::kTierMapped || !rc.map || host - sn.map_start >= sn.map_len) return nullptr;  // as remote_hit
  return rc.map->base + (host - sn.map_start);
}

inline void LocalContext::arm_write_hit(Qp::RemoteKeyCache& rc, const Peer& peer) noexcept {
  rc.wtag = rc.rtag = rc.atag = Qp::kNoWriteTag;
  rc.wbase = nullptr;
  const Qp::MrSnapshot& sn = rc.snap;
  if (!rc.entry || rc.peer_stamp != peer.stamp || sn.kind != layout::kKindMr || sn.key != rc.key) return;
  // The rkey cache: a WRITE's target (wtag), a READ's source (rtag) and an
  // atomic's target (atag, in the mapped tier only); the other: a SEND's
  // receive buffer (wtag).
  const uint32_t need = rc.rkey ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_LOCAL_WRITE;
  const bool read = rc.rkey && (sn.access & IBV_ACCESS_REMOTE_READ);
  const bool atomic = rc.rkey && (sn.access & IBV_ACCESS_REMOTE_ATOMIC) && sn.tier == layout::kTierMapped;
  if ((!(sn.access & need) && !read && !atomic) || (sn.access & kAccessOnDemand) || sn.pd >= Qp::kNoWritePd) return;
  if (sn.iova + sn.length < sn.iova) return;  // a range that wraps
  uint8_t* base;
  if (peer.self_process) {
    base = reinterpret_cast<uint8_t*>(sn.host);
  } else {
    // The whole MR inside the mapping: every range of it is (remote_hit's check).
    if (sn.tier != layout::kTierMapped || !rc.map || sn.host < sn.map_start || sn.length > sn.map_len ||
        sn.host - sn.map_start > sn.map_len - sn.length)
      return;
    base = rc.map->base + (sn.host - sn.map_start);
  }
  rc.wbase = base;
  const uint64_t tag = uint64_t{rc.key} << 32 | sn.pd;
  if (sn.access & need) rc.wtag = tag;
  if (read) rc.rtag = tag;
  if (atomic) rc.atag = tag;
}

// What the SEND leaves (send_leaf, srq_send_leaf) require of qp's send
// queue at tail: empty (nothing queued ahead of the WR), no RNR back-off
// (declined first, so that a sender ahead of its receiver pays little
// here), room for the WR, RTS.
[[gnu::always_inline]] inline bool send_leaf_queue_ready(const Qp* qp, uint32_t tail) noexcept {
  return qp->sq_exec == tail && !qp->rnr_backoff && tail - qp->sq_retire < qp->caps.max_send_wr &&
         qp->state() == IBV_QPS_RTS;
}

// Whether a leaf's signaled WR has the slot leaf_complete writes: its send
// CQ's FIFO with one producer and room (room_single).
[[gnu::always_inline]] inline bool leaf_completion_ready(const Qp* qp) noexcept {
  return qp->send_local && qp->send_local->room_single();
}

// A leaf's (write_leaf, read_leaf, send_leaf, srq_send_leaf) signaled
// success, WQE tail of qp (byte_len: a READ's length, as complete_send),
// into the slot its check looked at (room_single: one producer, under our
// sq_lock, so still the one at the FIFO's tail, still free). No fence
// (complete_send, local_cq.h); a success qualifies for a next-completion
// arming only: kArmed, and the caller fires it (leaf_declined).
[[gnu::always_inline]] inline LocalContext::Leaf leaf_complete(Qp* qp, uint64_t wr_id, uint32_t wc_opcode,
                                                               uint32_t tail, uint32_t byte_len = 0) noexcept {
  LocalCq* l = qp->send_local;
  uint32_t pos;
  LocalCqSlot* s = l->claim_single(&pos);
  l->put(s, pos, wr_id, IBV_WC_SUCCESS, wc_opcode, byte_len, qp->qpn);
  qp->sq_retire = tail + 1;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  return l->entry->notify.load(std::memory_order_relaxed) == layout::kNotifyNext ? LocalContext::Leaf::kArmed
                                                                                 : LocalContext::Leaf::kDone;
}

// Every send completion of our QPs comes here (successes, errors, flushes,
// the peer-death RETRY_EXC_ERR, UD), under qp->sq_lock: into the send CQ's
// FIFO of our own completions (local_cq.h), in the order they are made, so a
// flush never overtakes an earlier success. (A CQ with completion
// timestamps has no such FIFO: all its completions take the shared ring.)
inline void LocalContext::complete_send(Qp* qp, uint64_t wr_id, uint32_t opcode, uint64_t length,
                                        uint32_t status) noexcept {
  count::send_completed(cnt_, qp, status);  // counters: send_err, retry counts
  const uint32_t byte_len = (opcode == IBV_WR_RDMA_READ || transport::is_atomic(opcode)) ? static_cast<uint32_t>(length) : 0;
  if (LocalCq* l = qp->send_local) [[likely]] {
    uint32_t pos;
    LocalCqSlot* s = l->reserve(&pos);
    if (!s) [[unlikely]] {
      own_send_overrun(qp->send_cq);  // full: the completion is lost, as on hardware
      return;
    }
    l->put(s, pos, wr_id, status, transport::wc_opcode(opcode), byte_len, qp->qpn);
    // No fence: arm_cq takes and drops our sq_lock after arming (local_cq.h),
    // so either the poll the application makes after arming sees this
    // completion, or we see the arming. A send completion qualifies for a
    // solicited-only arming when it is an error (as push_cqe's qualifies()).
    std::atomic_signal_fence(std::memory_order_seq_cst);
    const uint32_t m = l->entry->notify.load(std::memory_order_relaxed);
    if (m == layout::kNotifyNext || (m == layout::kNotifySolicited && status != IBV_WC_SUCCESS)) [[unlikely]]
      own_send_armed(qp->send_cq, status);
    return;
  }
  complete_send_shared(qp, wr_id, opcode, byte_len, status);
}

inline void LocalContext::complete_send(Qp* qp, const SendSlot* s, uint32_t status) noexcept {
  complete_send(qp, s->wr_id, s->opcode, s->length, status);
}

}  // namespace shmrdma
