#include "counters.h"
#include "directory.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "count.h"
#include "device_setup.h"
#include "registry.h"
#include "segment.h"

namespace shmrdma {

using layout::kCounters;

std::vector<NamedCounter> ib_counters(const PortCounters& c) {
  const uint64_t* v = c.v;
  auto minus = [](uint64_t a, uint64_t b) { return a > b ? a - b : 0; };
  // Events that cannot happen on a port of shared memory (symbol and link
  // errors, VL15, switch relay, buffer overruns, constraint violations,
  // discards and transmit waits: traffic is never held back or lost on the
  // way) are 0, as their hardware counterparts on a clean link.
  return {
      {"VL15_dropped", 0},
      {"excessive_buffer_overrun_errors", 0},
      {"link_downed", v[layout::kCntLinkDowned]},
      {"link_error_recovery", 0},
      {"local_link_integrity_errors", 0},
      {"multicast_rcv_packets", v[layout::kCntMcastRcvPkts]},
      {"multicast_xmit_packets", v[layout::kCntMcastXmitPkts]},
      {"port_rcv_constraint_errors", 0},
      {"port_rcv_data", v[layout::kCntRcvBytes] / 4},  // 4-octet units, as Linux sysfs
      {"port_rcv_errors", 0},
      {"port_rcv_packets", v[layout::kCntRcvPkts]},
      {"port_rcv_remote_physical_errors", 0},
      {"port_rcv_switch_relay_errors", 0},
      {"port_xmit_constraint_errors", 0},
      {"port_xmit_data", v[layout::kCntXmitBytes] / 4},
      {"port_xmit_discards", 0},
      {"port_xmit_packets", v[layout::kCntXmitPkts]},
      {"port_xmit_wait", 0},
      {"symbol_error", 0},
      {"unicast_rcv_packets", minus(v[layout::kCntRcvPkts], v[layout::kCntMcastRcvPkts])},
      {"unicast_xmit_packets", minus(v[layout::kCntXmitPkts], v[layout::kCntMcastXmitPkts])},
  };
}

std::vector<NamedCounter> hw_counters(const PortCounters& c) {
  const uint64_t* v = c.v;
  // Zero because the event cannot happen here: duplicate and out-of-sequence
  // requests, sequence-error NAKs and completer retransmissions need a lossy
  // or reordering wire; ack_deferred needs a deferred completer. lifespan is
  // the kernel's cache time of these values: ours are snapshots (README).
  return {
      {"sent_pkts", v[layout::kCntXmitPkts]},
      {"rcvd_pkts", v[layout::kCntRcvPkts]},
      {"duplicate_request", 0},
      {"out_of_seq_request", 0},
      {"rcvd_rnr_err", v[layout::kCntRnrNakRcvd]},
      {"send_rnr_err", v[layout::kCntRnrNakSent]},
      {"rcvd_seq_err", 0},
      {"ack_deferred", 0},
      {"retry_exceeded_err", v[layout::kCntRetryExc]},
      {"retry_rnr_exceeded_err", v[layout::kCntRnrRetryExc]},
      {"completer_retry_err", 0},
      {"send_err", v[layout::kCntSendErr]},
      {"link_downed", v[layout::kCntLinkDowned]},
      {"rdma_sends", v[layout::kCntRdmaSends]},
      {"rdma_recvs", v[layout::kCntRdmaRecvs]},
      {"lifespan", 0},
      {"sent_bytes", v[layout::kCntXmitBytes]},
      {"rcvd_bytes", v[layout::kCntRcvBytes]},
      {"rcvd_ud_dropped", v[layout::kCntUdDropNoRecv]},
      {"rcvd_ud_invalid", v[layout::kCntUdDropInvalid]},
  };
}

// ------------------------------------------------------------------- sink

void CounterSink::attach(layout::ContextCounters* block, layout::QpCounterRecord* records, uint32_t slots,
                         const layout::DeviceRecord& dev, DeviceDirectory* dir) noexcept {
  dir_ = dir;
  block_ = block;
  records_ = records;
  slots_ = slots;
  nports_ = std::min<uint32_t>(dev.num_ports, limits::kMaxPorts);
  for (uint32_t p = 0; p < nports_; ++p) lids_[p] = dev.ports[p].lid;
}

layout::QpCounterRecord* CounterSink::claim(uint32_t index) noexcept {
  if (!records_ || index >= slots_) return nullptr;
  std::lock_guard lk(mu_);
  if (block_->qp_hwm.load(std::memory_order_relaxed) <= index)
    block_->qp_hwm.store(index + 1, std::memory_order_release);
  return records_ + index;  // zero: never used, or zeroed by fold_record
}

void CounterSink::fold_group_locked(layout::QpCounterRecord* r, uint32_t g) noexcept {
  const uint32_t port = r->port[g].load(std::memory_order_relaxed);
  if (is_foreign_label(port)) {
    // Into the other device's foreign_counters, before the record is
    // zeroed (both inside the fold's odd seq: add_foreign_counters).
    uint64_t n[kCounters];
    bool any = false;
    for (uint32_t i = 0; i < kCounters; ++i) any |= (n[i] = r->v[g][i].load(std::memory_order_relaxed)) != 0;
    if (any && dir_) {
      HomeDevice* d = dir_->by_id(label_home_id(port));
      if (d && !d->self && !d->gone.load(std::memory_order_relaxed) &&
          device_tag(d->record()) == r->tag[g].load(std::memory_order_relaxed))
        d->registry->add_foreign(label_port(port), n);  // else the device is gone, and its counters with it
    }
    for (uint32_t i = 0; i < kCounters; ++i) r->v[g][i].store(0, std::memory_order_relaxed);
    return;
  }
  for (uint32_t i = 0; i < kCounters; ++i) {
    const uint64_t n = r->v[g][i].load(std::memory_order_relaxed);
    if (n && port >= 1 && port <= nports_) block_->ports[port - 1][i].fetch_add(n, std::memory_order_relaxed);
    r->v[g][i].store(0, std::memory_order_relaxed);
  }
}

// Seqlock writer (one at a time: mu_): odd, release fence, the moves, even
// with release. Readers (sum_context_counters) retry on an odd or changed seq.
#define SHMRDMA_FOLD(body)                                                         \
  do {                                                                             \
    const uint32_t s0 = block_->seq.load(std::memory_order_relaxed);               \
    block_->seq.store(s0 + 1, std::memory_order_relaxed);                          \
    std::atomic_thread_fence(std::memory_order_release);                           \
    body;                                                                          \
    block_->seq.store(s0 + 2, std::memory_order_release);                          \
  } while (0)

std::atomic<uint64_t>* CounterSink::switch_port(layout::QpCounterRecord* r, uint32_t g, uint32_t label,
                                                uint32_t tag) noexcept {
  // Untrusted (a peer's QpEntry::port): a port of ours, or of another device.
  const bool ok = is_foreign_label(label)
                      ? label_port(label) >= 1 && label_port(label) <= limits::kMaxPorts && g == layout::kGroupRemote
                      : label >= 1 && label <= nports_;
  if (!ok || !block_) return nullptr;
  std::lock_guard lk(mu_);
  SHMRDMA_FOLD({
    fold_group_locked(r, g);
    r->tag[g].store(is_foreign_label(label) ? tag : 0, std::memory_order_relaxed);
    r->port[g].store(label, std::memory_order_relaxed);
  });
  return r->v[g];
}

void CounterSink::fold_record(layout::QpCounterRecord* r) noexcept {
  if (!r || !block_) return;
  std::lock_guard lk(mu_);
  SHMRDMA_FOLD({
    for (uint32_t g = 0; g < layout::kGroups; ++g) {
      fold_group_locked(r, g);
      r->port[g].store(0, std::memory_order_relaxed);
      r->tag[g].store(0, std::memory_order_relaxed);
    }
  });
}

std::vector<uint32_t> CounterSink::fold_foreign() noexcept {
  std::vector<uint32_t> homes;
  if (!block_ || !records_) return homes;
  std::lock_guard lk(mu_);
  const uint32_t hwm = std::min(block_->qp_hwm.load(std::memory_order_relaxed), slots_);
  for (uint32_t q = 0; q < hwm; ++q) {
    layout::QpCounterRecord* r = records_ + q;
    for (uint32_t g = 0; g < layout::kGroups; ++g) {
      const uint32_t label = r->port[g].load(std::memory_order_relaxed);
      if (!is_foreign_label(label)) continue;
      SHMRDMA_FOLD({
        fold_group_locked(r, g);
        r->port[g].store(0, std::memory_order_relaxed);
        r->tag[g].store(0, std::memory_order_relaxed);
      });
      try {
        if (std::find(homes.begin(), homes.end(), label_home_id(label)) == homes.end())
          homes.push_back(label_home_id(label));
      } catch (...) {
      }
    }
  }
  return homes;
}

#undef SHMRDMA_FOLD

std::vector<PortCounters> CounterSink::totals() const noexcept {
  std::vector<PortCounters> out;
  try {
    out.resize(nports_);
  } catch (...) {
    return out;
  }
  if (block_) sum_context_counters(block_, records_, slots_, nports_, out.data());
  return out;
}

// ------------------------------------------------------------------ hooks

namespace count {

void ud_invalid_slow(CounterSink& k, Qp* qp, const SendSlot* s) noexcept {
  const uint32_t port = k.lid_port(s->av.dlid);
  if (port) {
    std::atomic<uint64_t>* r = k.group(qp->cnt.rec, layout::kGroupRemote, port);
    if (!r) return;
    bump(r[layout::kCntRcvPkts], 1);
    bump(r[layout::kCntRcvBytes], s->length);
    bump(r[layout::kCntUdDropInvalid], 1);
  } else if (std::atomic<uint64_t>* l = k.group(qp->cnt.rec, layout::kGroupLocal, qp->cnt.port)) {
    bump(l[layout::kCntUdDropInvalid], 1);
  }
}

void send_error_slow(CounterSink& k, Qp* qp, uint32_t status) noexcept {
  if (!qp->cnt.rec) return;
  std::atomic<uint64_t>* l = k.group(qp->cnt.rec, layout::kGroupLocal, qp->cnt.port);
  if (!l) return;
  bump(l[layout::kCntSendErr], 1);
  if (status == IBV_WC_RETRY_EXC_ERR) bump(l[layout::kCntRetryExc], 1);
  if (status == IBV_WC_RNR_RETRY_EXC_ERR) bump(l[layout::kCntRnrRetryExc], 1);
}

void sent_rc_slow(CounterSink& k, Qp* qp, uint32_t op, uint64_t len) noexcept {
  sent_op(k, qp, op, len, 0);  // relabels first when the destination changed
  QpCounting& q = qp->cnt;
  if (!q.rec) return;
  std::atomic<uint64_t>* l = k.group(q.rec, layout::kGroupLocal, q.port);
  std::atomic<uint64_t>* r = k.group(q.rec, layout::kGroupRemote, q.rport, q.rtag);
  if (l && r) {  // both count: the next ones go straight there
    q.fast_local = l;
    q.fast_remote = r;
  }
}

void relabel(Qp* qp) noexcept {
  QpCounting& q = qp->cnt;
  q.fast_local = q.fast_remote = nullptr;
  q.rdev = qp->peer_dev;
  q.rtag = 0;
  if (qp->peer_dev && !qp->peer_dev->self) {
    // A destination on another device of the home counts for its port there.
    q.rport = foreign_label(qp->peer_dev->home_id, qp->peer_port);
    q.rtag = device_tag(qp->peer_dev->record());
  } else if (qp->peer_dev && qp->peer_port) {
    q.rport = qp->peer_port;  // resolved (by LID or GID) on our own device
  } else {
    q.rport = q.dlid_port ? q.dlid_port : q.port;  // not resolved: the DLID's port, else (GRH only) ours
  }
}

void configure(CounterSink& k, Qp* qp) noexcept {
  QpCounting& q = qp->cnt;
  const QpAttr& a = qp->attr;
  const uint32_t n = std::max<uint32_t>(k.nports(), 1);
  q.port = static_cast<uint8_t>(std::clamp<uint32_t>(a.port_num, 1, n));
  q.dlid_port = static_cast<uint8_t>(k.lid_port(a.dlid));
  relabel(qp);
  q.mtu_shift = qp->qp_type == IBV_QPT_UD
                    ? 12
                    : static_cast<uint8_t>(7 + std::clamp<uint32_t>(a.path_mtu, IBV_MTU_256, IBV_MTU_4096));
}

}  // namespace count

// ----------------------------------------------------------------- reading

void sum_context_counters(const layout::ContextCounters* block, const layout::QpCounterRecord* records,
                          uint32_t slots, uint32_t nports, PortCounters* out, const ForeignFilter* foreign) noexcept {
  nports = std::min<uint32_t>(nports, limits::kMaxPorts);
  PortCounters tmp[limits::kMaxPorts];
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint32_t s0 = block->seq.load(std::memory_order_acquire);
    if ((s0 & 1) && attempt < 999) {
      sched_yield();
      continue;
    }
    for (uint32_t p = 0; p < nports; ++p) tmp[p] = PortCounters{};
    if (!foreign)
      for (uint32_t p = 0; p < nports; ++p)
        for (uint32_t i = 0; i < kCounters; ++i) tmp[p].v[i] += block->ports[p][i].load(std::memory_order_relaxed);
    const uint32_t hwm = std::min(block->qp_hwm.load(std::memory_order_acquire), slots);
    for (uint32_t q = 0; q < hwm; ++q) {
      const layout::QpCounterRecord& r = records[q];
      for (uint32_t g = 0; g < layout::kGroups; ++g) {
        uint32_t port = r.port[g].load(std::memory_order_relaxed);
        if (foreign) {
          if (!is_foreign_label(port) || label_home_id(port) != foreign->home_id ||
              r.tag[g].load(std::memory_order_relaxed) != foreign->tag)
            continue;
          port = label_port(port);
        }
        if (port < 1 || port > nports) continue;
        for (uint32_t i = 0; i < kCounters; ++i) tmp[port - 1].v[i] += r.v[g][i].load(std::memory_order_relaxed);
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (block->seq.load(std::memory_order_relaxed) == s0 || attempt == 999) break;
  }
  for (uint32_t p = 0; p < nports; ++p) out[p] += tmp[p];
}

int sum_context_file(const std::string& path, uint32_t pid, uint32_t nports, PortCounters* out,
                     const ForeignFilter* foreign) noexcept {
  Mapping m;
  int rc = Mapping::attach(path, layout::SegmentKind::kContext, 0, &m);
  if (rc) return rc;
  const auto* h = static_cast<const layout::ContextHeader*>(m.base());
  // Geometry from our own computation; the header must agree.
  const layout::ContextLayout l = layout::compute_context_layout(m.size() - layout::compute_context_layout(0).total_size);
  if (l.total_size != m.size() || h->counters != l.counters || h->qp_counters != l.qp_counters ||
      h->qp_slots != l.qp_slots || h->hdr.owner_pid != pid)
    return EPROTO;
  sum_context_counters(m.at<layout::ContextCounters>(l.counters), m.at<layout::QpCounterRecord>(l.qp_counters),
                       l.qp_slots, nports, out, foreign);
  return 0;
}

void add_foreign_counters(Registry& x, std::vector<PortCounters>* out) noexcept {
  const uint32_t n = std::min<uint32_t>({x.device().num_ports, limits::kMaxPorts, static_cast<uint32_t>(out->size())});
  const ForeignFilter f{x.device().home_id, device_tag(x.device())};
  const std::string& home = x.paths().home;
  try {
    std::vector<std::string> names = list_devices(home);
    std::vector<Registry> others;
    for (const std::string& name : names) {
      if (name == x.paths().name) continue;
      Registry y;
      if (Registry::attach(device_paths(home, name), &y) != 0 || y.device().home_id == f.home_id) continue;
      others.push_back(std::move(y));
    }
    PortCounters before[limits::kMaxPorts], after[limits::kMaxPorts], sum[limits::kMaxPorts];
    // Counts move from a record to foreign_counters inside the sender's
    // fold seqlock: a fold between the two reads of foreign_counters shows
    // as a change, and the snapshot is taken again (bounded).
    for (int attempt = 0; attempt < 8; ++attempt) {
      for (uint32_t p = 0; p < n; ++p) before[p] = after[p] = sum[p] = PortCounters{};
      x.read_foreign(before, n);
      for (Registry& y : others) y.sum_foreign(f, n, sum);
      x.read_foreign(after, n);
      if (std::memcmp(before, after, sizeof(PortCounters) * n) == 0) break;
    }
    for (uint32_t p = 0; p < n; ++p) {
      (*out)[p] += after[p];
      (*out)[p] += sum[p];
    }
  } catch (...) {
  }
}

}  // namespace shmrdma
