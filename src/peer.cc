#include "peer.h"

#include <algorithm>
#include <cerrno>

#include <unistd.h>

#include "async.h"
#include "directory.h"
#include "proc.h"

namespace shmrdma {

bool Peer::ring(uint64_t offset, uint64_t bytes, uint32_t capacity, uint32_t stride, Ring* out) const noexcept {
  if (!Ring::valid_geometry(capacity, stride) || bytes != Ring::bytes_for(capacity, stride)) return false;
  if (offset < layout.heap_offset || offset % kRingCacheLine != 0 || offset > size || bytes > size - offset)
    return false;
  auto* rs = reinterpret_cast<RingShared*>(base + offset);
  auto r = Ring::attach(rs, Ring::slots_after(rs), capacity, stride);
  if (!r) return false;
  *out = *r;
  return true;
}

bool Peer::alive() const noexcept { return process_alive(pid, start_time); }

Peer::~Peer() {
  if (async_fd >= 0) ::close(async_fd);
  for (auto& [n, v] : chan_fds_)
    if (v.second >= 0) ::close(v.second);
}

namespace {

// premap_regions' bounds: the first entries of the peer's MR table it
// looks at (MRs take the lowest free indices), the regions it maps and
// their bytes per peer, and the bytes it maps in this process's lifetime
// (g_premapped): a job of many processes connecting to each other (MPI)
// does not map every region of every peer at connect, most of which it may
// never use; beyond these the first operation maps a region, as before.
// 32 MiB per peer cover perftest's buffer at its largest message size (-a:
// 8 MiB, two of them, in an allocation a page larger).
constexpr uint32_t kPremapScan = 256;
constexpr uint32_t kPremapRegions = 16;
constexpr uint64_t kPremapBytes = uint64_t{32} << 20;
constexpr uint64_t kPremapProcessBytes = uint64_t{256} << 20;
std::atomic<uint64_t> g_premapped{0};

}  // namespace

// Most verbs programs (perftest, the pingpongs, MPI's eager buffers)
// register their memory before they connect, and exchange its keys on the
// way; the first WRITE, READ or SEND into a peer's region then mapped it in
// the data path: the open and mmap (~0.2 ms) and the first translation of
// each of its pages (mapped.cc touch_pages: ~1.1 ms per MiB under shadow
// paging), ~2.5 ms inside the first of ib_write_bw -n 500's 1 MiB WRITEs,
// as hardware, whose MRs are pinned and translated at registration, never
// does. So the regions the peer has when one of our QPs connects to it are
// mapped then (PeerMappings keeps them, and remote_hit finds them there).
// Each entry is read inside the owner's seqlock (layout.h mr_entry_read)
// and PeerMappings::get checks the file it names; a region that is not
// mapped here is mapped on first use, as before. Bounded (kPremap*), so a
// peer with a huge table or huge regions, or many peers, cost little; once
// per Peer, so the QPs after the first cost one exchange.
void Peer::premap_regions() noexcept {
  if (self_process || !base || premapped.exchange(true, std::memory_order_relaxed)) return;
  const uint32_t n = std::min(layout.mr_slots, kPremapScan);
  uint32_t regions = 0;
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n && regions < kPremapRegions; ++i) {
    layout::MrEntry* e = mr(i);
    if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) continue;
    uint32_t kind = 0, g = 0;
    uint16_t tier = 0;
    int32_t memfd = -1;
    uint64_t start = 0, len = 0, id = 0;
    if (layout::mr_entry_read(e, &g, [&] {
          kind = e->kind;
          tier = e->tier;
          memfd = e->memfd;
          start = e->map_start;
          len = e->map_len;
          id = e->map_id;
          return true;
        }) != layout::EntryRead::kStable ||
        kind != layout::kKindMr || tier != layout::kTierMapped || len > kPremapBytes - bytes)
      continue;
    // This process's budget, taken before the mapping (and kept: a failed
    // get costs little, and the budget only bounds the work).
    uint64_t used = g_premapped.load(std::memory_order_relaxed);
    do {
      if (len > kPremapProcessBytes - used) return;
    } while (!g_premapped.compare_exchange_weak(used, used + len, std::memory_order_relaxed));
    if (mappings.get(pid, memfd, id, start, len)) {
      ++regions;
      bytes += len;
    }
  }
}

void Peer::raise_async(uint32_t event_type, uint64_t token) noexcept {
  std::call_once(async_once_, [this] { async_fd = open_async_fifo_writer(async_path); });
  (void)write_async_event(async_fd, event_type, token);
}

std::shared_ptr<Peer> PeerCache::get(HomeDevice& dev, uint32_t slot, const Peer& self) noexcept {
  Registry& registry = *dev.registry;
  ContextInfo info;
  if (!registry.context_slot(slot, &info)) return nullptr;
  try {
    std::lock_guard lk(mu_);
    auto it = peers_.find(slot);
    if (it != peers_.end() && it->second->generation == info.generation && it->second->pid == static_cast<pid_t>(info.pid))
      return it->second;
    auto p = std::make_shared<Peer>();
    p->device = &dev;
    p->registry = &registry;
    p->home_id = dev.home_id;
    p->slot = slot;
    p->generation = info.generation;
    p->pid = static_cast<pid_t>(info.pid);
    p->start_time = info.start_time;
    p->async_path = registry.paths().device_dir + "/" + info.segment + kAsyncSuffix;
    p->segment_path = registry.paths().device_dir + "/" + info.segment;
    if (dev.self && slot == self.slot && info.generation == self.generation) {
      p->self_process = true;
      p->base = self.base;
      p->size = self.size;
      p->layout = self.layout;
    } else {
      if (info.segment.rfind("ctx-", 0) != 0 || info.segment.find('/') != std::string::npos) return nullptr;
      int rc = Mapping::attach(registry.paths().device_dir + "/" + info.segment, layout::SegmentKind::kContext, 0,
                               &p->map);
      if (rc) return nullptr;
      auto* h = static_cast<layout::ContextHeader*>(p->map.base());
      // Geometry is recomputed from the size; the header must agree.
      uint64_t heap = p->map.size() - layout::compute_context_layout(0).total_size;
      layout::ContextLayout l = layout::compute_context_layout(heap);
      if (l.total_size != p->map.size() || h->qp_table != l.qp_table || h->cq_table != l.cq_table ||
          h->mr_table != l.mr_table || h->srq_table != l.srq_table || h->slot_index != slot ||
          h->slot_generation != info.generation || h->hdr.owner_pid != info.pid ||
          h->hdr.owner_start_time != info.start_time)
        return nullptr;
      p->self_process = p->pid == self_process().pid;
      p->base = static_cast<char*>(p->map.base());
      p->size = p->map.size();
      p->layout = l;
    }
    peers_[slot] = p;
    return p;
  } catch (...) {
    return nullptr;
  }
}

}  // namespace shmrdma
