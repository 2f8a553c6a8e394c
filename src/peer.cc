#include "peer.h"

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
