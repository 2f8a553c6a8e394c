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

namespace shmrdma {

namespace {

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// IB spec table 45: the RNR NAK timer field encoding, in microseconds.
// Longest RNR back-off (deliver): hardware's shortest RNR timer is 10 us.
constexpr uint64_t kRnrBackoffNs = 10'000;

uint64_t rnr_timer_us(uint32_t code) {
  static constexpr uint32_t kTable[32] = {655360, 10,    20,    30,    40,    60,    80,    120,   160,   240,   320,
                                          480,    640,   960,   1280,  1920,  2560,  3840,  5120,  7680,  10240, 15360,
                                          20480,  30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520};
  return kTable[code & 31];
}

uint32_t wc_opcode(uint32_t wr_opcode) {
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

bool is_atomic(uint32_t op) { return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD; }

bool consumes_recv(uint32_t op) {
  return op == IBV_WR_SEND || op == IBV_WR_SEND_WITH_IMM || op == IBV_WR_RDMA_WRITE_WITH_IMM ||
         op == IBV_WR_SEND_WITH_INV;
}

// Operations the owner executes on its own objects (mw.cc).
bool is_local_op(uint32_t op) { return op == IBV_WR_BIND_MW || op == IBV_WR_LOCAL_INV; }

constexpr uint64_t kUdMtu = 4096;  // the port's active MTU: a UD message fits in one packet
constexpr uint64_t kGrhBytes = 40;
constexpr uint32_t kMulticastLidFirst = 0xc000, kMulticastLidLast = 0xfffe;  // IBA 4.1.1

// GID[0] of a port: the link-local prefix and the port GUID, network order.
void port_gid(const layout::PortRecord& port, uint8_t out[16]) {
  uint64_t prefix = htobe64(0xfe80000000000000ull), guid = htobe64(port.port_guid);
  std::memcpy(out, &prefix, 8);
  std::memcpy(out + 8, &guid, 8);
}

bool v4_mapped(const uint8_t g[16]) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g, kPrefix, 12) == 0;
}

// A multicast GID on Ethernet: IPv6 multicast (ff00::/8), or an IPv4
// multicast address mapped (::ffff:224.0.0.0/4).
bool roce_multicast_gid(const uint8_t g[16]) { return g[0] == 0xff || (v4_mapped(g) && (g[12] & 0xf0) == 0xe0); }

// RoCE packet types of a UD receive completion's sl (build_roce_grh).
constexpr uint8_t kRocePktGrh = 0x0, kRocePktIpv6 = 0x1, kRocePktIpv4 = 0x2, kRocePktUdp = 0x8;

void put16(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}

// The 40-byte GRH area of a UD message received over RoCE, as rxe hands it
// to the receiver and libibverbs' ibv_init_ah_from_wc parses it
// (get_grh_header_version): RoCE v2 between two IPv4-mapped GIDs puts the
// 20-byte IPv4 header at offset 20 (version 4, IHL 5, protocol UDP, a valid
// header checksum) after 20 zero bytes; any other GID gets an IPv6 header
// whose next header says the GID type (UDP 17 for RoCE v2, 0x1B for RoCE v1).
// Lengths are those of the packet (UDP 8 + BTH 12 + DETH 8 [+ ImmDt 4] +
// payload + ICRC 4).
//
// Returns the RoCE packet type a UD receive completion reports in its sl
// (what mlx5, the reference RoCE adapter, writes there on Ethernet, where the
// IB service level is not carried: bit 3 set for a UDP-encapsulated RoCE v2
// frame, bits 2:0 the L3 header: 0 GRH (RoCE v1), 1 IPv6, 2 IPv4). UCX's
// ud_verbs reads it to know where the destination address sits in the area.
uint8_t build_roce_grh(const AddressVector& av, const uint8_t sgid[16], uint8_t sgid_type, uint64_t len, bool imm,
                       uint8_t grh[kGrhBytes]) {
  std::memset(grh, 0, kGrhBytes);
  const uint32_t transport = 12 + 8 + (imm ? 4 : 0) + static_cast<uint32_t>(len) + 4;
  const bool v2 = sgid_type == layout::kGidTypeRoceV2;
  if (v2 && v4_mapped(sgid) && v4_mapped(av.dgid)) {
    uint8_t* ip = grh + 20;
    ip[0] = 0x45;
    ip[1] = av.traffic_class;
    put16(ip + 2, 20 + 8 + transport);
    put16(ip + 6, 0x4000);  // don't fragment
    ip[8] = av.hop_limit;
    ip[9] = 17;  // UDP
    std::memcpy(ip + 12, sgid + 12, 4);
    std::memcpy(ip + 16, av.dgid + 12, 4);
    uint32_t sum = 0;
    for (int i = 0; i < 20; i += 2) sum += uint32_t{ip[i]} << 8 | ip[i + 1];
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    put16(ip + 10, ~sum & 0xffff);
    return kRocePktUdp | kRocePktIpv4;
  }
  uint32_t w0 = htobe32((6u << 28) | (uint32_t{av.traffic_class} << 20) | (av.flow_label & 0xfffff));
  std::memcpy(grh, &w0, 4);
  put16(grh + 4, v2 ? 8 + transport : transport);
  grh[6] = v2 ? 17 : 0x1b;
  grh[7] = av.hop_limit;
  std::memcpy(grh + 8, sgid, 16);
  std::memcpy(grh + 24, av.dgid, 16);
  return v2 ? kRocePktUdp | kRocePktIpv6 : kRocePktGrh;
}

}  // namespace

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
  // mr_entry_update), for MRs (re-registration) and windows (binds) alike;
  // everything below uses the copy. The owner's write is a few stores: a
  // bounded retry outlasts it unless the owner is preempted in the middle.
  std::atomic_ref<uint32_t> gen(e->generation);
  uint32_t kind = 0, k = 0, epd = 0, eaccess = 0, mw_qpn = 0, tier = 0;
  uint64_t iova = 0, length = 0, host = 0, map_start = 0, map_len = 0, map_id = 0;
  int memfd = -1;
  bool stable = false;
  for (int attempt = 0; attempt < 256 && !stable; ++attempt) {
    if (attempt) {
      if (attempt % 16 == 0)
        sched_yield();
      else
        __builtin_ia32_pause();
    }
    const uint32_t g = gen.load(std::memory_order_acquire);
    if (g & 1) continue;
    kind = e->kind;
    if (kind != layout::kKindMr && !rkey) return false;  // a memory window (mw.cc): an rkey only
    const uint64_t mk = e->mw_key.load(std::memory_order_acquire);
    // A window answers only while bound and valid with exactly this key.
    if (kind != layout::kKindMr && mk != (layout::kMwValid | key)) return false;
    k = kind != layout::kKindMr ? key : rkey ? e->rkey : e->lkey;
    epd = e->pd_index;
    eaccess = e->access;
    mw_qpn = e->mw_qpn;
    iova = e->iova;
    length = e->length;
    host = e->host_addr;
    tier = e->tier;
    memfd = e->memfd;
    map_start = e->map_start;
    map_len = e->map_len;
    map_id = e->map_id;
    std::atomic_thread_fence(std::memory_order_acquire);
    stable = gen.load(std::memory_order_relaxed) == g &&
             (kind == layout::kKindMr || e->mw_key.load(std::memory_order_relaxed) == mk);
  }
  if (!stable) return false;
  if (kind == layout::kKindMw2 && mw_qpn != target_qpn) return false;  // type 2B: bound to one QP
  if (k != key || epd != pd || (eaccess & need) != need) return false;
  if (addr < iova || len > length || addr - iova > length - len) return false;
  out->host = host + (addr - iova);
  out->local = nullptr;
  out->mapped = false;
  out->odp = eaccess & kAccessOnDemand;
  if (out->odp) return true;  // CMA only, even within this process: EFAULT, never a fault
  if (peer.self_process) {
    out->local = reinterpret_cast<uint8_t*>(out->host);
    out->mapped = tier == layout::kTierMapped;
    return true;
  }
  if (tier != layout::kTierMapped || out->host < map_start || len > map_len || out->host - map_start > map_len - len)
    return true;  // CMA
  // Small per-QP cache of mappings: the common case takes no lock.
  const uint32_t ncache = static_cast<uint32_t>(qp->map_cache.size());
  for (uint32_t n = 0, i = qp->map_cache_last; n < ncache; ++n, i = (i + 1) % ncache) {
    auto& c = qp->map_cache[i];  // the entry that hit last time first
    if (c.map && c.peer_slot == peer.slot && c.peer_generation == peer.generation && c.peer_home == peer.home_id &&
        c.memfd == memfd &&
        c.map_id == map_id && c.map->start == map_start && c.map->len == map_len) {
      qp->map_cache_last = i;
      out->local = c.map->base + (out->host - map_start);
      out->mapped = true;
      return true;
    }
  }
  std::shared_ptr<PeerMapping> m = peer.mappings.get(peer.pid, memfd, map_id, map_start, map_len);
  if (!m) return true;  // could not map: CMA still works
  auto& slot = qp->map_cache[qp->map_cache_next++ % qp->map_cache.size()];
  slot.map = m;
  slot.peer_slot = peer.slot;
  slot.peer_generation = peer.generation;
  slot.peer_home = peer.home_id;
  slot.memfd = memfd;
  slot.map_id = map_id;
  out->local = m->base + (out->host - map_start);
  out->mapped = true;
  return true;
}

// push_peer_cqe: cq.cc (the CQ producer protocol).

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
  const bool local_op = is_local_op(wr.opcode);  // no data: SGEs are ignored
  const uint32_t num_sge = local_op ? 0 : wr.num_sge;
  if (num_sge > qp->caps.max_send_sge || (num_sge && !wr.sg_list)) return EINVAL;
  uint64_t total = 0;
  for (uint32_t k = 0; k < num_sge; ++k) total += wr.sg_list[k].length;
  bool inl = (wr.send_flags & IBV_SEND_INLINE) && !is_atomic(wr.opcode) && wr.opcode != IBV_WR_RDMA_READ &&
             !local_op;
  if (inl && total > qp->caps.max_inline_data) return EINVAL;
  if (is_atomic(wr.opcode) && (wr.num_sge != 1 || wr.sg_list[0].length != 8)) return EINVAL;
  if (total > (uint64_t{1} << 31)) return EINVAL;  // max_msg_sz

  std::lock_guard lk(qp->sq_lock);
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
  if (qp->sq_pending.fetch_add(1, std::memory_order_relaxed) == 0) qps_pending_.fetch_add(1, std::memory_order_relaxed);
  return 0;
}

void LocalContext::complete_send(Qp* qp, SendSlot* s, uint32_t status) noexcept {
  layout::Cqe c{};
  c.wr_id = s->wr_id;
  c.status = status;
  c.opcode = wc_opcode(s->opcode);
  c.byte_len = (s->opcode == IBV_WR_RDMA_READ || is_atomic(s->opcode)) ? static_cast<uint32_t>(s->length) : 0;
  c.qp_num = qp->qpn;
  count::send_completed(cnt_, qp, status);  // counters: send_err, retry counts
  (void)push_cqe(qp->send_cq, c, &qp->send_cq_cache);  // a full CQ has overrun; the completion is lost, as on hardware
}

namespace {
// A receive completion the owner writes itself (flush, abort).
layout::Cqe recv_status_cqe(uint64_t wr_id, uint32_t status, uint32_t qpn) {
  layout::Cqe c{};
  c.wr_id = wr_id;
  c.status = status;
  c.opcode = IBV_WC_RECV;
  c.qp_num = qpn;
  return c;
}
}  // namespace

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
  flush_send_queue(qp);
}

void LocalContext::flush_qp(Qp* qp) noexcept {
  // Caller holds qp->sq_lock.
  flush_send_queue(qp);
  // A receive an initiator took and did not complete (it died, or is still
  // moving the data into a QP that has now failed) is the oldest: it goes
  // first, then the ones still queued. An XRC_RECV QP's receives come from
  // XRC SRQs: a taken one completes in the CQ of the SRQ it was taken from.
  uint64_t taken_wr_id = 0;
  uint32_t taken_srqn = 0;
  if (reclaim_take(qp, &taken_wr_id, &taken_srqn)) {
    const layout::Cqe c = recv_status_cqe(taken_wr_id, IBV_WC_WR_FLUSH_ERR, qp->qpn);
    if (qp->qp_type == IBV_QPT_XRC_RECV)
      push_xrc_recv_cqe(dir_.self(), taken_srqn, c);
    else
      (void)push_cqe(qp->recv_cq, c);
  }
  if (qp->rq.attached())
    drain_recv_ring(qp->rq, [&](uint64_t wr_id) {
      const layout::Cqe c = recv_status_cqe(wr_id, IBV_WC_WR_FLUSH_ERR, qp->qpn);
      (void)push_cqe(qp->recv_cq, c);
    });
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
  flush_qp(qp);
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

// Whether the receive completion with take tag `tag` of QP qp reached its CQ:
// still queued there (published), or already handed out by poll_cq. The
// ring is read first: poll_cq records the tag before it releases a slot.
bool LocalContext::recv_completion_delivered(Qp* qp, uint8_t tag) noexcept {
  if (qp->recv_cq < cqs_.size() && cqs_[qp->recv_cq].live) {
    bool found = false;
    cqs_[qp->recv_cq].info.ring.for_each_published([&](const std::byte* payload) {
      layout::Cqe c;
      std::memcpy(&c, payload, sizeof c);
      if (c.qp_num == qp->qpn && (c.opcode & IBV_WC_RECV) && c.take_tag == tag && c.status != IBV_WC_WR_FLUSH_ERR)
        found = true;
    });
    if (found) return true;
  }
  return last_recv_tag_[qp->index].load(std::memory_order_relaxed) == tag;
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
    if (!context_dead(q->rx_holder_slot.load(std::memory_order_relaxed),
                      q->rx_holder_generation.load(std::memory_order_relaxed)))
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
  uint32_t slot = t->rx_holder_slot.load(std::memory_order_relaxed);
  uint32_t gen = t->rx_holder_generation.load(std::memory_order_relaxed);
  if (!context_dead(slot, gen)) return TakeOver::kBusy;  // alive, or one of our own threads
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
      if (!take_transfer(t, v, holder_id(), generation_, nv)) return TakeOver::kBusy;
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
      !context_dead(e->rx_holder_slot.load(std::memory_order_relaxed),
                    e->rx_holder_generation.load(std::memory_order_relaxed)))
    return;
  const uint64_t wr_id = e->rx_take_wr_id.load(std::memory_order_acquire);
  const bool delivered = recv_completion_delivered(qp, static_cast<uint8_t>(v >> 2));
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
  const bool dead = context_dead(e->rx_holder_slot.load(std::memory_order_relaxed),
                                 e->rx_holder_generation.load(std::memory_order_relaxed));
  if (st == layout::kTakeCompleting) {
    // The initiator died while it wrote the receive completion: flush the
    // WQE unless that completion made it into our CQ.
    if (xrc || !dead) return false;
    *wr_id = e->rx_take_wr_id.load(std::memory_order_acquire);
    const bool delivered = recv_completion_delivered(qp, static_cast<uint8_t>(v >> 2));
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
LocalContext::Deliver LocalContext::deliver(Qp* qp, Peer& peer, layout::QpEntry* t, const SendSlot* s,
                                            const IoVec* local, uint32_t nlocal, const uint8_t* grh,
                                            bool rnr_wait, layout::Cqe cqe, uint32_t* status,
                                            const RecvSource* xrc) noexcept {
  const uint64_t len = s->length;
  uint32_t v = 0;
  bool adopted = false;  // the record came from a dead holder with the slot it claimed (take_holder_dead)
  if (!take_reserve(t, holder_id(), generation_, &v)) {
    switch (take_holder_dead(qp, peer, t, v, xrc ? xrc->srqn : layout::kNoIndex, &v)) {
      case TakeOver::kBusy: return Deliver::kBusy;
      case TakeOver::kAdopted: adopted = true; break;
      case TakeOver::kEnded:
        if (!take_reserve(t, holder_id(), generation_, &v)) return Deliver::kBusy;
        break;
    }
  }
  qp->busy_take_qpn = 0;
  // Names the ring of the positions we announce (published by the claim).
  if (xrc) t->rx_take_srqn.store(xrc->srqn, std::memory_order_relaxed);
  uint32_t held = v;  // the record's value while we hold it (reserved, then taken)
  auto gone = [&](uint32_t st) {
    take_end(t, held);
    *status = st;
    return Deliver::kGone;
  };
  // Where the receive WQE, its buffers and its completion queue live.
  Peer& rpeer = xrc ? *xrc->peer : peer;
  const uint32_t rpd = xrc ? xrc->pd : t->pd_index;
  const uint32_t rcq = xrc ? xrc->cq : t->recv_cq;
  uint32_t srq_index = t->srq_index;
  Ring rq;
  layout::SrqEntry* se = nullptr;
  if (xrc) {
    se = xrc->se;
    srq_index = xrc->srq_index;
    if (!rpeer.ring(se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, &rq, &qp->target_rq_cache))
      return gone(IBV_WC_REM_OP_ERR);
  } else if (t->srq_index != layout::kNoIndex) {
    se = peer.srq(t->srq_index);
    if (!se || se->state.load(std::memory_order_acquire) != layout::kLive ||
        !peer.ring(se->ring_offset, se->ring_bytes, se->capacity, se->slot_stride, &rq, &qp->target_rq_cache))
      return gone(IBV_WC_REM_OP_ERR);
  } else if (!peer.ring(t->rq_ring_offset, t->rq_ring_bytes, t->rq_capacity, t->rq_stride, &rq, &qp->target_rq_cache)) {
    return gone(IBV_WC_REM_OP_ERR);
  }
  if (rnr_wait && qp->rnr_backoff && !adopted) {  // (an adopted WQE is there to be used)
    // The last attempt found no receive (an RNR NAK). Hardware retries after
    // the responder's RNR timer; we go on as soon as a batch of receives is
    // posted, or after at most kRnrBackoffNs. Retrying on every single
    // receive instead keeps sender and receiver in lock step, each message
    // paying a round trip between cores.
    const uint32_t batch = std::clamp<uint32_t>(rq.capacity() / 4, 1, 32);
    if (rq.size_approx() < batch && now_ns() - qp->rnr_backoff_since_ns < kRnrBackoffNs) {
      take_end(t, v);
      return Deliver::kNoReceive;
    }
    qp->rnr_backoff = false;
  }
  uint32_t rq_max_sge = static_cast<uint32_t>((rq.payload_size() - sizeof(layout::RecvWqeHeader)) / sizeof(layout::WireSge));
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
      // Tell the receiver someone waits (its post_recv wakes us: cq.cc
      // wake_initiator), then look once more. The fence pairs with the one the
      // receiver runs after posting: either we see its WQE or it sees the flag.
      if (!t->initiator_waiting.load(std::memory_order_relaxed))  // the line stays shared while it is set
        t->initiator_waiting.store(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      claimed = rq.try_claim_announced(announce);
    }
  }
  if (!claimed) {
    take_end(t, v);
    if (claimed.status == RingStatus::contended) return Deliver::kBusy;
    if (rnr_wait) {
      qp->rnr_backoff = true;
      qp->rnr_backoff_since_ns = now_ns();
    }
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
  std::memcpy(rsge, claimed.handle.payload + sizeof h, rn * sizeof(layout::WireSge));
  uint32_t taken = 0;
  if (!take_hold(t, v, h.wr_id, &taken)) {
    (void)rq.release_cas(claimed.handle);  // discarded with the record, unless already adopted
    return Deliver::kBusy;
  }
  held = taken;
  if (!rq.release_cas(claimed.handle)) {
    take_end(t, taken);
    return Deliver::kBusy;
  }
  // The next send to this queue reads the next slot and then releases it (a
  // store): fetch its line for writing now, and again from progress_all
  // while we poll, so neither waits for the line to cross cores on the
  // critical path. The receiver does not touch a posted slot until it comes
  // round again, so taking the line early costs it nothing.
  const void* next_slot = rq.slot_address(claimed.handle.pos + 1);
  __builtin_prefetch(next_slot, 1);
  warm_rq_slot_.store(next_slot, std::memory_order_relaxed);
  // SRQ limit event (srq.cc): fewer WQEs left than the armed limit. The
  // exchange disarms it, so each arming raises one event.
  if (se) {
    uint32_t lim = se->limit.load(std::memory_order_relaxed);
    if (lim && rq.size_approx() < lim && se->limit.exchange(0, std::memory_order_acq_rel))
      rpeer.raise_async(IBV_EVENT_SRQ_LIMIT_REACHED, async_token(AsyncKind::kSrq, srq_index, se->generation));
  }

  const uint64_t total = len + (grh ? kGrhBytes : 0);
  cqe.wr_id = h.wr_id;
  cqe.take_tag = static_cast<uint8_t>(taken >> 2);
  cqe.byte_len = static_cast<uint32_t>(total);
  auto complete = [&](const layout::Cqe& c) {
    // Unless the owner flushed it. The record stays busy until the CQE is
    // in, so the next sender's completion cannot overtake this one.
    if (take_complete_begin(t, taken)) {
      (void)push_peer_cqe(rpeer, rcq, c, &qp->target_cq_cache);
      take_done(t, taken);
    }
  };
  auto responder_error = [&](uint32_t recv_status, uint32_t our_status) {
    // The responder's WQE completes in error and its QP enters the error
    // state; its owner flushes the rest at its next poll.
    cqe.status = recv_status;
    cqe.byte_len = 0;
    complete(cqe);
    t->qp_state.store(IBV_QPS_ERR, std::memory_order_release);
    auto* th = reinterpret_cast<layout::ContextHeader*>(peer.base);
    th->attention.fetch_add(1, std::memory_order_release);  // pairs with the acquire in progress_all
    *status = our_status;
    return Deliver::kResponderError;
  };

  if (s->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) {
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
    IoVec src[limits::kMaxSge + 1];
    uint32_t nsrc = 0;
    if (grh) src[nsrc++] = {const_cast<uint8_t*>(grh), kGrhBytes};
    for (uint32_t k = 0; k < nlocal; ++k) src[nsrc++] = local[k];
    const IoVec* remote = direct ? direct_iov : host_iov;  // CMA needs the target's own addresses
    if (int rc = move_out(rpeer.pid, direct, src, nsrc, remote, nremote, false)) {
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
  complete(cqe);
  return Deliver::kDone;
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
  if (!gather_local(qp, s, local, &nlocal)) {
    *status = IBV_WC_LOC_PROT_ERR;
    return Exec::kError;
  }
  const uint64_t len = s->length;

  Remote rm;
  auto remote_access = [&](uint32_t need, uint64_t bytes) -> bool {
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
  switch (deliver(qp, peer, t, s, local, nlocal, nullptr, !uc, cqe, status, xrc ? &xsrc : nullptr)) {
    case Deliver::kDone: break;
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

// UD: every WQE names its destination (address vector, QPN, Q_Key). A
// message nobody can take (no such QP, wrong LID/GID or Q_Key, no receive
// posted) is dropped and the send still completes, as on the wire. A
// multicast LID (with its GRH) reaches every QP attached to the group, the
// sender's own included when it is attached (hardware loopback).
LocalContext::Exec LocalContext::execute_ud(Qp* qp, SendSlot* s, uint32_t* status) noexcept {
  const uint64_t len = s->length;
  if (len > kUdMtu) {
    *status = IBV_WC_LOC_LEN_ERR;
    return Exec::kError;
  }
  IoVec local[limits::kMaxSge];
  uint32_t nlocal = 0;
  if (!gather_local(qp, s, local, &nlocal)) {
    *status = IBV_WC_LOC_PROT_ERR;
    return Exec::kError;
  }
  const layout::DeviceRecord& dev = registry_.device();
  const uint32_t nports = std::min<uint32_t>(dev.num_ports, limits::kMaxPorts);
  const AddressVector& av = s->av;
  // RoCE (Ethernet link layer): no LIDs, the GRH carries the address.
  const bool eth = ethernet();
  const bool multicast = eth ? av.is_global && roce_multicast_gid(av.dgid)
                             : av.dlid >= kMulticastLidFirst && av.dlid <= kMulticastLidLast;
  const bool imm = s->opcode == IBV_WR_SEND_WITH_IMM;
  const uint32_t qkey = (s->remote_qkey & 0x80000000u) ? qp->attr.qkey : s->remote_qkey;
  const uint32_t sport = std::clamp<uint32_t>(qp->attr.port_num, 1, nports);

  // The 40-byte GRH area: the header when the AH had one (IBA 8.3), else
  // left as zeros.
  uint8_t grh[kGrhBytes] = {};
  layout::Cqe cqe{};
  if (av.is_global && !eth) {
    uint32_t w0 = htobe32((6u << 28) | (uint32_t{av.traffic_class} << 20) | (av.flow_label & 0xfffff));
    uint16_t paylen = htobe16(static_cast<uint16_t>(len));
    std::memcpy(grh, &w0, 4);
    std::memcpy(grh + 4, &paylen, 2);
    grh[6] = 0x1b;  // next header: IBA transport
    grh[7] = av.hop_limit;
    port_gid(dev.ports[sport - 1], grh + 8);
    std::memcpy(grh + 24, av.dgid, 16);
    cqe.wc_flags = IBV_WC_GRH;
  }
  if (eth) cqe.wc_flags = IBV_WC_GRH;  // the area is written below, once the source GID is known
  cqe.src_qp = qp->qpn;
  cqe.slid = dev.ports[sport - 1].lid;
  cqe.sl = av.sl;  // on Ethernet the RoCE packet type instead (build_roce_grh)
  cqe.pkey_index = 0;
  cqe.opcode = IBV_WC_RECV;
  if (s->send_flags & IBV_SEND_SOLICITED) cqe.flags = layout::kCqeSolicited;
  if (s->opcode == IBV_WR_SEND_WITH_IMM) {
    cqe.imm_data = s->imm_data;
    cqe.wc_flags |= IBV_WC_WITH_IMM;
  }

  // One destination QP: kWait when another sender is delivering into it.
  auto send_to = [&](Peer& peer, uint32_t qpn, bool check_address) -> Exec {
    layout::QpEntry* t = peer.qp(layout::qpn_index(qpn));
    if (!t || t->state.load(std::memory_order_acquire) != layout::kLive || t->qpn != qpn || t->qp_type != IBV_QPT_UD)
      return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;  // counters: UD drops
    uint32_t ts = t->qp_state.load(std::memory_order_acquire);
    if (ts != IBV_QPS_RTR && ts != IBV_QPS_RTS && ts != IBV_QPS_SQD && ts != IBV_QPS_SQE)
      return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;
    if (check_address) {
      // The QP must be on the port the address resolved to (its device's
      // record is a validated private copy).
      const uint32_t tport = t->port;
      if (tport != qp->peer_port) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;
      if (av.is_global && !eth) {  // (on Ethernet the DGID is what found the port)
        uint8_t gid[16];
        port_gid(peer.device->record().ports[tport - 1], gid);
        if (std::memcmp(gid, av.dgid, 16) != 0) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;
      }
    }
    if (t->qkey != qkey) return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;
    layout::Cqe c = cqe;
    c.qp_num = t->qpn;
    const Deliver d = deliver(qp, peer, t, s, local, nlocal, grh, false, c, status);
    // counters (a destination on another device counts for its port there)
    if (d != Deliver::kBusy) count::ud_arrived(cnt_, qp, s, t, peer.device, d == Deliver::kNoReceive);
    switch (d) {
      case Deliver::kBusy: return Exec::kWait;
      case Deliver::kNoReceive: return Exec::kDone;  // dropped (counted above)
      default: return Exec::kDone;  // delivered, or the receiver's WQE failed: unacknowledged for us
    }
  };

  if (!multicast) {
    const uint32_t rqpn = s->remote_qpn & limits::kQpnMask;
    // The destination device and port of this address vector: resolved
    // when the vector differs from the last one this QP sent to, or its
    // device went away (directory.h).
    if (!qp->ud_av_valid || !same_address(qp->ud_av, av) || !destination_holds(qp)) {
      qp->ud_av = av;
      qp->ud_av_valid = true;
      Resolved r;
      resolve_address(av, &r);
      set_destination(qp, r);
    }
    // On Ethernet a UD message is one packet of the port's active MTU (the
    // interface MTU by rxe's rule), as on IB it is at most 4096 bytes.
    if (eth && qp->ud_mtu && len > qp->ud_mtu) {
      *status = IBV_WC_LOC_LEN_ERR;
      return Exec::kError;
    }
    if (eth && qp->peer_dev) cqe.sl = build_roce_grh(av, qp->ud_sgid, qp->ud_sgid_type, len, imm, grh);
    if (!qp->peer_dev) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;  // counters: nobody has it
    // The cached peer is still that context while its registry slot keeps
    // the generation (a shared-memory read; Peer::alive reads /proc).
    if (!qp->peer || qp->peer->device != qp->peer_dev || qp->peer->slot != layout::qpn_slot(rqpn) ||
        !qp->peer_dev->registry->slot_is(qp->peer->slot, qp->peer->generation))
      qp->peer = peer_of(qp->peer_dev, rqpn);
    if (!qp->peer) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;  // counters: no such context
    return send_to(*qp->peer, rqpn, true);
  }
  if (!av.is_global) return Exec::kDone;  // a multicast packet carries a GRH naming its group
  if (eth) {
    // Our source GID for the GRH area (a snapshot of our port's table).
    PortNetView v;
    if (registry_.port_net(sport, &v) != 0 || !v.valid(av.sgid_index)) return Exec::kDone;  // no source: dropped
    cqe.sl = build_roce_grh(av, v.gids[av.sgid_index].gid, v.gids[av.sgid_index].type, len, imm, grh);
  }
  // Members may be on any device of the home: each keeps its groups in its
  // registry (on Ethernet groups are MGIDs alone: the LID is 0).
  layout::McastMember members[limits::kMaxMcastQpAttach];
  const uint16_t mlid = eth ? 0 : av.dlid;
  for (HomeDevice* d : dir_.all(true)) {
    if ((d->record().net.link_layer == layout::kLinkLayerEthernet) != eth) continue;  // IB and RoCE never mix
    uint32_t n = d->registry->mcast_members(av.dgid, mlid, members, limits::kMaxMcastQpAttach);
    for (uint32_t i = 0; i < n; ++i) {
      std::shared_ptr<Peer> peer = d->peers.get(*d, members[i].slot, self_peer_);
      if (!peer || peer->generation != members[i].generation) continue;
      // A member another sender is delivering into is retried briefly; the
      // others must not get the message twice, so the WQE never waits.
      for (int tries = 0; tries < 1000 && send_to(*peer, members[i].qpn, false) == Exec::kWait; ++tries) {
      }
    }
  }
  return Exec::kDone;
}

void LocalContext::progress(Qp* qp) noexcept {
  std::lock_guard lk(qp->sq_lock);
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
      complete_send(qp, s, status);
      qp->sq_exec += 1;
      qp->sq_retire = qp->sq_exec;
      qp->wait_started_ns = 0;
      if (qp->qp_type == IBV_QPT_RC || qp->qp_type == IBV_QPT_XRC_SEND)
        enter_error(qp);
      else
        enter_send_error(qp);
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
  if (qp->sq_exec == qp->sq_tail && qp->sq_pending.exchange(0, std::memory_order_relaxed))
    qps_pending_.fetch_sub(1, std::memory_order_relaxed);
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

void LocalContext::progress_all() noexcept {
  // A hint: the receive WQE our next send will read (a peer's ring stays
  // mapped while we know it, and a prefetch never faults anyway).
  if (const void* w = warm_rq_slot_.load(std::memory_order_relaxed)) __builtin_prefetch(w, 1);
  if (const void* w = warm_post_slot_.load(std::memory_order_relaxed)) __builtin_prefetch(w, 1);
  auto* h = header();
  uint32_t att = h->attention.load(std::memory_order_acquire);  // pairs with the peer's release
  // Every 1024th call, and at most every 200 ms, look for dead peers.
  bool liveness = false;
  // A racy count (no read-modify-write on every poll): it only spaces out the looks.
  const uint32_t polls = polls_.load(std::memory_order_relaxed) + 1;
  polls_.store(polls, std::memory_order_relaxed);
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

namespace shmrdma {

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

}  // namespace shmrdma
