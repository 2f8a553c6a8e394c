#include "registry.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "channel.h"
#include "directory.h"
#include "proc.h"

namespace shmrdma {

using layout::ContextSlot;
using layout::RegistrySegment;

namespace {

constexpr int kLockTimeoutSeconds = 10;

void copy_slot(const ContextSlot& s, uint32_t index, ContextInfo* out) {
  out->slot = index;
  out->generation = s.generation;
  out->pid = s.pid;
  out->start_time = s.start_time;
  char name[sizeof s.segment + 1];
  std::memcpy(name, s.segment, sizeof s.segment);
  name[sizeof s.segment] = '\0';
  out->segment = name;
  std::memcpy(out->held, s.held, sizeof out->held);
}

// ".chan<digits>": a completion channel FIFO (channel.h).
bool is_channel_suffix(const char* p) {
  const size_t n = std::strlen(kChannelSuffix);
  if (std::strncmp(p, kChannelSuffix, n) != 0 || !p[n]) return false;
  for (p += n; *p; ++p)
    if (*p < '0' || *p > '9') return false;
  return true;
}

// A file a context creates: ctx-<digits>-<digits>, optionally followed by
// ".async" (its async event FIFO) or ".chan<digits>" (a completion channel).
// *base_len receives the length of the ctx-<slot>-<generation> part.
bool is_context_file(const char* name, size_t* base_len = nullptr) {
  if (std::strncmp(name, "ctx-", 4) != 0) return false;
  const char* p = name + 4;
  int dashes = 0;
  for (; *p && *p != '.'; ++p) {
    if (*p == '-') ++dashes;
    else if (*p < '0' || *p > '9') return false;
  }
  if (*p && std::strcmp(p, kAsyncSuffix) != 0 && !is_channel_suffix(p)) return false;
  if (base_len) *base_len = static_cast<size_t>(p - name);
  return dashes == 1;
}

}  // namespace

int Registry::create(const DevicePaths& paths, const layout::DeviceRecord& record, Registry* out,
                     const std::vector<PortNetView>* net) noexcept {
  layout::DeviceRecord device = record;
  if (device.net.link_layer == 0) device.net.link_layer = layout::kLinkLayerIb;  // a zeroed record is IB
  if (device.net.link_layer == layout::kLinkLayerIb) device.net.gid_layout = layout::kGidLayoutIb;
  // Peers on other devices of the home name this one by its home id.
  if (device.home_id == 0) device.home_id = choose_home_id(paths.home, paths.name);
  if (device.home_id == 0) return ENOSPC;
  Mapping m;
  int rc = Mapping::create(paths.registry, layout::registry_size(), layout::SegmentKind::kRegistry, &m);
  if (rc) return rc;
  auto* s = static_cast<RegistrySegment*>(m.base());
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  rc = pthread_mutex_init(&s->lock, &attr);
  for (uint32_t i = 0; i < layout::kAtomicStripes && rc == 0; ++i) rc = pthread_mutex_init(&s->atomic_locks[i], &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc) {
    ::unlink(paths.registry.c_str());
    return rc;
  }
  s->next_qpn.store(limits::kFirstQpn, std::memory_order_relaxed);
  s->device = device;
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) s->contexts[i].state.store(layout::kFree, std::memory_order_relaxed);
  Registry r;
  r.map_ = std::move(m);
  r.paths_ = paths;
  r.device_ = device;
  // The ports' records, before anyone can see the segment (no lock needed).
  for (uint32_t p = 1; p <= device.num_ports && p <= limits::kMaxPorts; ++p) {
    PortNetView v;
    if (net && p <= net->size()) {
      v = (*net)[p - 1];
    } else {
      // IB: GID[0] = fe80::/64 + port GUID.
      v.valid_mask = 1;
      v.gids[0].gid[0] = 0xfe;
      v.gids[0].gid[1] = 0x80;
      for (int b = 0; b < 8; ++b) v.gids[0].gid[8 + b] = static_cast<uint8_t>(device.ports[p - 1].port_guid >> (56 - 8 * b));
      v.gids[0].type = layout::kGidTypeIb;
    }
    v.link &= ~layout::kLinkAdminDown;
    if (device.ports[p - 1].state == layout::kPortDown) v.link |= layout::kLinkAdminDown;
    r.write_net_locked(p, v, nullptr);
  }
  r.map_.publish();
  *out = std::move(r);
  return 0;
}

int Registry::attach(const DevicePaths& paths, Registry* out) noexcept {
  Mapping m;
  int rc = Mapping::attach(paths.registry, layout::SegmentKind::kRegistry, layout::registry_size(), &m);
  if (rc) return rc;
  auto* s = static_cast<RegistrySegment*>(m.base());
  layout::DeviceRecord d;
  std::memcpy(&d, &s->device, sizeof d);
  d.name[sizeof d.name - 1] = '\0';
  if (d.num_ports < 1 || d.num_ports > limits::kMaxPorts || paths.name != d.name || d.home_id == 0 ||
      d.home_id > layout::kMaxHomeId)
    return EPROTO;
  // The personality (untrusted like the rest).
  const bool ib = d.net.link_layer == layout::kLinkLayerIb && d.net.gid_layout == layout::kGidLayoutIb;
  const bool eth = d.net.link_layer == layout::kLinkLayerEthernet &&
                   (d.net.gid_layout == layout::kGidLayoutRxe || d.net.gid_layout == layout::kGidLayoutMlx5);
  if (!ib && !eth) return EPROTO;
  d.net.ifname[sizeof d.net.ifname - 1] = '\0';
  Registry r;
  r.map_ = std::move(m);
  r.paths_ = paths;
  r.device_ = d;
  *out = std::move(r);
  return 0;
}

int Registry::lock() noexcept {
  timespec deadline{};
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += kLockTimeoutSeconds;
  int rc = pthread_mutex_timedlock(&seg()->lock, &deadline);
  if (rc == EOWNERDEAD) {
    // The previous holder died inside a critical section. Every critical
    // section leaves the slot table consistent at each store, and
    // reclaim_locked() recomputes what a dead owner held, so mark it usable.
    pthread_mutex_consistent(&seg()->lock);
    reclaim_locked(nullptr);
    return 0;
  }
  return rc;
}

void Registry::unlock() noexcept { pthread_mutex_unlock(&seg()->lock); }

class Registry::Guard {
 public:
  explicit Guard(Registry& r) : r_(r), rc_(r.lock()) {}
  ~Guard() {
    if (rc_ == 0) r_.unlock();
  }
  int rc() const { return rc_; }

 private:
  Registry& r_;
  int rc_;
};

int Registry::register_context(uint32_t* slot, uint32_t* generation, std::string* segment) noexcept {
  Guard g(*this);
  if (g.rc()) return g.rc();
  reclaim_locked(nullptr);
  ProcessId self = self_process();
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
    ContextSlot& s = seg()->contexts[i];
    if (s.state.load(std::memory_order_relaxed) != layout::kFree) continue;
    s.pid = static_cast<uint32_t>(self.pid);
    s.start_time = self.start_time;
    s.generation += 1;
    std::memset(s.held, 0, sizeof s.held);
    std::memset(s.segment, 0, sizeof s.segment);
    std::snprintf(s.segment, sizeof s.segment, "ctx-%u-%u", i, s.generation);
    *slot = i;
    *generation = s.generation;
    *segment = s.segment;
    // R1: the slot's fields are visible to anyone who sees kLive (A1).
    s.state.store(layout::kLive, std::memory_order_release);
    return 0;
  }
  return ENOMEM;
}

void Registry::unregister_context(uint32_t slot, uint32_t generation, const PortCounters* counts,
                                  uint32_t n) noexcept {
  if (slot >= limits::kMaxContexts) return;
  Guard g(*this);
  if (g.rc()) return;  // a later reclaim frees it once we are gone (and folds its counts)
  ContextSlot& s = seg()->contexts[slot];
  if (s.generation != generation || s.pid != static_cast<uint32_t>(self_process().pid)) return;
  if (counts) add_totals(counts, n);
  std::memset(s.held, 0, sizeof s.held);
  s.state.store(layout::kFree, std::memory_order_release);
}

int Registry::charge(uint32_t slot, uint32_t generation, layout::ObjKind kind, uint32_t limit) noexcept {
  if (slot >= limits::kMaxContexts || kind >= layout::kObjKinds) return EINVAL;
  Guard g(*this);
  if (g.rc()) return g.rc();
  ContextSlot& mine = seg()->contexts[slot];
  if (mine.generation != generation || mine.state.load(std::memory_order_relaxed) != layout::kLive)
    return EIO;  // our slot was taken from us: someone thought we were dead
  auto held = [&] {
    uint64_t total = 0;
    for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
      const ContextSlot& s = seg()->contexts[i];
      if (s.state.load(std::memory_order_relaxed) == layout::kLive) total += s.held[kind];
    }
    return total;
  };
  // At the limit, objects of processes that died may still be counted:
  // reclaim them before refusing.
  if (held() >= limit && (reclaim_locked(nullptr) == 0 || held() >= limit)) return ENOMEM;
  mine.held[kind] += 1;
  return 0;
}

void Registry::uncharge(uint32_t slot, uint32_t generation, layout::ObjKind kind) noexcept {
  if (slot >= limits::kMaxContexts || kind >= layout::kObjKinds) return;
  Guard g(*this);
  if (g.rc()) return;
  ContextSlot& mine = seg()->contexts[slot];
  if (mine.generation != generation) return;
  if (mine.held[kind] > 0) mine.held[kind] -= 1;
}

// ----------------------------------------------------------------- ports

uint8_t Registry::port_state(uint32_t port) const noexcept {
  if (!valid() || port < 1 || port > device_.num_ports) return 0;
  uint8_t s = std::atomic_ref<uint8_t>(seg()->device.ports[port - 1].state).load(std::memory_order_relaxed);
  return (s == layout::kPortDown || s == layout::kPortActive) ? s : layout::kPortActive;  // untrusted
}

int Registry::port_net(uint32_t port, PortNetView* out) const noexcept {
  if (!valid()) return EINVAL;
  return read_port_net(*seg(), device_.num_ports, port, out);
}

int Registry::port_net_settled(uint32_t port, PortNetView* out) const noexcept {
  int rc = port_net(port, out);
  for (int i = 0; i < 100 && rc == EAGAIN; ++i) {
    ::usleep(1000);
    rc = port_net(port, out);
  }
  return rc;
}

uint32_t Registry::port_net_seq(uint32_t port) const noexcept {
  return valid() ? shmrdma::port_net_seq(*seg(), device_.num_ports, port) : 0;
}

bool Registry::gid_index_of(uint32_t port, const uint8_t gid[16], uint8_t type_filter, uint32_t* index) const noexcept {
  PortNetView v;
  return port_net(port, &v) == 0 && shmrdma::gid_index_of(v, gid, type_filter, index);
}

void Registry::write_net_locked(uint32_t port, PortNetView v, PortNetChange* change) noexcept {
  PortNetView old;
  const bool had_old = read_port_net(*seg(), device_.num_ports, port, &old) == 0;
  const bool ethernet = device_.net.link_layer == layout::kLinkLayerEthernet;
  constexpr uint32_t kRunning = layout::kLinkPresent | layout::kLinkUp | layout::kLinkCarrier;
  if (!ethernet) v.link = (v.link & layout::kLinkAdminDown) | kRunning;  // an IB port has no interface
  const bool active = (v.link & kRunning) == kRunning && !(v.link & layout::kLinkAdminDown);
  v.state = active ? layout::kPortActive : layout::kPortDown;
  v.phys_state = active ? 5 : 3;  // LinkUp : Disabled, as rxe
  if (ethernet) {
    v.active_mtu = rxe_active_mtu(v.ifmtu);
    eth_speed_to_ib(v.speed_mbps, &v.active_width, &v.active_speed);
  } else {
    v.active_mtu = 5;     // IBV_MTU_4096
    // 4X HDR, 200 Gb/s (25 GB/s): what the device moves (a memcpy, ~25-35 GB/s
    // from 64 KiB up), as a real port of that speed reports it. Consumers size
    // their protocols from it: UCX derives its rendezvous threshold from this
    // bandwidth divided among the processes of the node, and 4X EDR (100 Gb/s,
    // half of it per rank for two ranks) made eager copies through 8 KiB
    // bounce buffers look as good as one zero-copy RDMA READ up to ~90 KiB.
    v.active_width = 2;   // 4X
    v.active_speed = 64;  // HDR
  }
  const uint8_t prev_state = port_state(port);
  // link_downed (IB LinkDownedCounter): an active port going down.
  if (!active && prev_state == layout::kPortActive) seg()->port_counters[port - 1][layout::kCntLinkDowned] += 1;
  write_port_net(*seg(), port, v);
  device_.ports[port - 1].state = v.state;
  if (change) {
    change->new_state = v.state;
    change->state = prev_state != v.state;
    bool gids = !had_old || old.valid_mask != v.valid_mask;
    for (uint32_t i = 0; i < limits::kGidTableLen && !gids; ++i)
      gids = v.valid(i) && (old.gids[i].type != v.gids[i].type || std::memcmp(old.gids[i].gid, v.gids[i].gid, 16));
    change->gids = gids;
    change->other = !had_old || old.ifmtu != v.ifmtu || old.speed_mbps != v.speed_mbps ||
                    std::strcmp(old.ifname, v.ifname) != 0 || std::memcmp(old.mac, v.mac, 6) != 0;
  }
}

int Registry::update_port_net(uint32_t port, const PortNetView& v, PortNetChange* change) noexcept {
  if (!valid() || port < 1 || port > device_.num_ports) return EINVAL;
  Guard g(*this);
  if (g.rc()) return g.rc();
  PortNetView next = v;
  const uint32_t admin = seg()->net[port - 1].link.load(std::memory_order_relaxed) & layout::kLinkAdminDown;
  next.link = (v.link & ~layout::kLinkAdminDown) | admin;
  write_net_locked(port, next, change);
  return 0;
}

int Registry::set_port_state(uint32_t port, uint8_t state, PortNetChange* change) noexcept {
  if (!valid() || port < 1 || port > device_.num_ports || (state != layout::kPortDown && state != layout::kPortActive))
    return EINVAL;
  Guard g(*this);
  if (g.rc()) return g.rc();
  PortNetView v;
  // A record left odd by a dead writer is rewritten from what it holds.
  if (int rc = read_port_net(*seg(), device_.num_ports, port, &v); rc == EAGAIN) v = PortNetView{};
  else if (rc) return rc;
  if (state == layout::kPortDown) v.link |= layout::kLinkAdminDown;
  else v.link &= ~layout::kLinkAdminDown;
  write_net_locked(port, v, change);
  return 0;
}

void Registry::retire() noexcept {
  if (!valid()) return;
  Guard g(*this);
  if (g.rc()) return;
  for (uint32_t p = 1; p <= device_.num_ports; ++p) {
    PortNetView v;
    if (read_port_net(*seg(), device_.num_ports, p, &v) != 0) v = PortNetView{};
    v.valid_mask = 0;
    v.link = layout::kLinkAdminDown;
    write_net_locked(p, v, nullptr);
  }
}

// ------------------------------------------------------------- multicast

bool Registry::member_live(const layout::McastMember& m) const noexcept {
  if (m.slot >= limits::kMaxContexts) return false;
  const ContextSlot& c = seg()->contexts[m.slot];
  return c.state.load(std::memory_order_acquire) == layout::kLive && c.generation == m.generation;
}

layout::McastGroup* Registry::find_group(const uint8_t gid[16], uint16_t mlid) noexcept {
  for (auto& g : seg()->mcast)
    if (g.state == layout::kLive && g.mlid == mlid && std::memcmp(g.gid, gid, 16) == 0) return &g;
  return nullptr;
}

int Registry::mcast_attach(const uint8_t gid[16], uint16_t mlid, uint32_t slot, uint32_t generation,
                           uint32_t qpn) noexcept {
  Guard g(*this);
  if (g.rc()) return g.rc();
  layout::McastGroup* grp = find_group(gid, mlid);
  if (!grp) {
    // A free group, or one whose members are all gone.
    for (auto& c : seg()->mcast) {
      bool empty = c.state != layout::kLive;
      if (!empty) {
        empty = true;
        for (uint32_t i = 0; i < std::min<uint32_t>(c.nmembers, limits::kMaxMcastQpAttach); ++i)
          empty = empty && !member_live(c.members[i]);
      }
      if (empty) {
        grp = &c;
        break;
      }
    }
    if (!grp) return ENOMEM;
    std::memset(grp, 0, sizeof *grp);
    std::memcpy(grp->gid, gid, 16);
    grp->mlid = mlid;
    grp->state = layout::kLive;
  }
  uint32_t n = std::min<uint32_t>(grp->nmembers, limits::kMaxMcastQpAttach);
  // Compact away stale members, and find this QP if it is attached already.
  uint32_t kept = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const layout::McastMember m = grp->members[i];
    if (m.slot == slot && m.generation == generation && m.qpn == qpn) return 0;
    if (member_live(m)) grp->members[kept++] = m;
  }
  if (kept == limits::kMaxMcastQpAttach) {
    grp->nmembers = static_cast<uint16_t>(kept);
    return ENOMEM;
  }
  grp->members[kept++] = layout::McastMember{slot, generation, qpn, 0};
  grp->nmembers = static_cast<uint16_t>(kept);
  return 0;
}

int Registry::mcast_detach(const uint8_t gid[16], uint16_t mlid, uint32_t slot, uint32_t generation,
                           uint32_t qpn) noexcept {
  Guard g(*this);
  if (g.rc()) return g.rc();
  layout::McastGroup* grp = find_group(gid, mlid);
  if (!grp) return EINVAL;
  uint32_t n = std::min<uint32_t>(grp->nmembers, limits::kMaxMcastQpAttach);
  for (uint32_t i = 0; i < n; ++i) {
    const layout::McastMember& m = grp->members[i];
    if (m.slot == slot && m.generation == generation && m.qpn == qpn) {
      grp->members[i] = grp->members[n - 1];
      grp->nmembers = static_cast<uint16_t>(n - 1);
      if (n == 1) grp->state = layout::kFree;
      return 0;
    }
  }
  return EINVAL;
}

void Registry::mcast_detach_qp(uint32_t slot, uint32_t generation, uint32_t qpn) noexcept {
  Guard g(*this);
  if (g.rc()) return;
  for (auto& grp : seg()->mcast) {
    if (grp.state != layout::kLive) continue;
    uint32_t n = std::min<uint32_t>(grp.nmembers, limits::kMaxMcastQpAttach);
    for (uint32_t i = 0; i < n;) {
      const layout::McastMember& m = grp.members[i];
      if (m.slot == slot && m.generation == generation && m.qpn == qpn) {
        grp.members[i] = grp.members[--n];
      } else {
        ++i;
      }
    }
    grp.nmembers = static_cast<uint16_t>(n);
    if (n == 0) grp.state = layout::kFree;
  }
}

uint32_t Registry::mcast_members(const uint8_t gid[16], uint16_t mlid, layout::McastMember* out,
                                 uint32_t max) noexcept {
  Guard g(*this);
  if (g.rc()) return 0;
  layout::McastGroup* grp = find_group(gid, mlid);
  if (!grp) return 0;
  uint32_t n = std::min<uint32_t>(grp->nmembers, limits::kMaxMcastQpAttach), got = 0;
  for (uint32_t i = 0; i < n && got < max; ++i)
    if (member_live(grp->members[i])) out[got++] = grp->members[i];
  return got;
}

uint32_t Registry::alloc_qpn() noexcept {
  for (;;) {
    uint32_t n = seg()->next_qpn.fetch_add(1, std::memory_order_relaxed) & limits::kQpnMask;
    if (n >= limits::kFirstQpn) return n;
  }
}

int Registry::lock_atomic(uint32_t stripe) noexcept {
  pthread_mutex_t* m = &seg()->atomic_locks[stripe % layout::kAtomicStripes];
  timespec deadline{};
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += kLockTimeoutSeconds;
  int rc = pthread_mutex_timedlock(m, &deadline);
  if (rc == EOWNERDEAD) {
    // The holder died between reading and writing an 8-byte value: its
    // operation never completed, the value is whole either way.
    pthread_mutex_consistent(m);
    rc = 0;
  }
  return rc;
}

void Registry::unlock_atomic(uint32_t stripe) noexcept {
  pthread_mutex_unlock(&seg()->atomic_locks[stripe % layout::kAtomicStripes]);
}

bool Registry::context_slot(uint32_t slot, ContextInfo* out) noexcept {
  if (slot >= limits::kMaxContexts) return false;
  const ContextSlot& s = seg()->contexts[slot];
  if (s.state.load(std::memory_order_acquire) != layout::kLive) return false;  // A1 pairs with R1
  copy_slot(s, slot, out);
  return out->pid != 0;
}

bool Registry::slot_is(uint32_t slot, uint32_t generation) noexcept {
  if (slot >= limits::kMaxContexts) return false;
  const ContextSlot& s = seg()->contexts[slot];
  if (s.state.load(std::memory_order_acquire) != layout::kLive) return false;
  return std::atomic_ref<uint32_t>(const_cast<uint32_t&>(s.generation)).load(std::memory_order_relaxed) == generation;
}

int Registry::reclaim_locked(std::vector<ContextInfo>* reclaimed) noexcept {
  int count = 0;
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
    ContextSlot& s = seg()->contexts[i];
    if (s.state.load(std::memory_order_relaxed) != layout::kLive) continue;
    if (process_alive(static_cast<pid_t>(s.pid), s.start_time)) continue;
    ContextInfo info;
    copy_slot(s, i, &info);
    if (is_context_file(info.segment.c_str())) {
      // Its counts survive it: folded into the device totals before the
      // segment goes (an unreadable segment has none to give).
      PortCounters counts[limits::kMaxPorts];
      const uint32_t n = std::min<uint32_t>(device_.num_ports, limits::kMaxPorts);
      if (sum_context_file(paths_.device_dir + "/" + info.segment, s.pid, n, counts) == 0) add_totals(counts, n);
      ::unlink((paths_.device_dir + "/" + info.segment).c_str());
      ::unlink((paths_.device_dir + "/" + info.segment + kAsyncSuffix).c_str());
    }
    std::memset(s.held, 0, sizeof s.held);
    s.state.store(layout::kFree, std::memory_order_release);
    if (reclaimed) reclaimed->push_back(std::move(info));
    ++count;
  }
  // Segment files that no live slot names are left over from a process that
  // died between creating its file and registering it, or after freeing it.
  if (DIR* d = ::opendir(paths_.device_dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      size_t base = 0;
      if (!is_context_file(e->d_name, &base)) continue;
      bool referenced = false;
      for (uint32_t i = 0; i < limits::kMaxContexts && !referenced; ++i) {
        const ContextSlot& s = seg()->contexts[i];
        referenced = s.state.load(std::memory_order_relaxed) == layout::kLive && base < sizeof s.segment &&
                     std::strncmp(s.segment, e->d_name, base) == 0 && s.segment[base] == '\0';
      }
      if (!referenced) ::unlinkat(::dirfd(d), e->d_name, 0);
    }
    ::closedir(d);
  }
  return count;
}

void Registry::add_totals(const PortCounters* counts, uint32_t n) noexcept {
  n = std::min<uint32_t>({n, device_.num_ports, limits::kMaxPorts});
  for (uint32_t p = 0; p < n; ++p)
    for (uint32_t i = 0; i < layout::kCounters; ++i)
      if (i != layout::kCntLinkDowned) seg()->port_counters[p][i] += counts[p].v[i];  // link_downed: ours alone
}

void Registry::add_foreign(uint32_t port, const uint64_t counts[layout::kCounters]) noexcept {
  if (!valid() || port < 1 || port > std::min<uint32_t>(device_.num_ports, limits::kMaxPorts)) return;
  for (uint32_t i = 0; i < layout::kCounters; ++i)
    if (counts[i] && i != layout::kCntLinkDowned)
      seg()->foreign_counters[port - 1][i].fetch_add(counts[i], std::memory_order_relaxed);
}

void Registry::read_foreign(PortCounters* out, uint32_t n) const noexcept {
  if (!valid()) return;
  n = std::min<uint32_t>({n, device_.num_ports, limits::kMaxPorts});
  for (uint32_t p = 0; p < n; ++p)
    for (uint32_t i = 0; i < layout::kCounters; ++i)
      out[p].v[i] = seg()->foreign_counters[p][i].load(std::memory_order_relaxed);
}

int Registry::read_counters(std::vector<PortCounters>* out, uint32_t* unreadable) noexcept {
  if (unreadable) *unreadable = 0;
  const uint32_t n = std::min<uint32_t>(device_.num_ports, limits::kMaxPorts);
  try {
    out->assign(n, PortCounters{});
  } catch (...) {
    return ENOMEM;
  }
  Guard g(*this);
  if (g.rc()) return g.rc();
  reclaim_locked(nullptr);
  for (uint32_t p = 0; p < n; ++p)
    for (uint32_t i = 0; i < layout::kCounters; ++i) (*out)[p].v[i] = seg()->port_counters[p][i];
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
    const ContextSlot& s = seg()->contexts[i];
    if (s.state.load(std::memory_order_acquire) != layout::kLive) continue;
    ContextInfo info;
    copy_slot(s, i, &info);
    // ENOENT / EAGAIN: a context still being opened (nothing counted yet).
    const int rc = is_context_file(info.segment.c_str())
                       ? sum_context_file(paths_.device_dir + "/" + info.segment, info.pid, n, out->data())
                       : EPROTO;
    if (rc && rc != ENOENT && rc != EAGAIN && unreadable) *unreadable += 1;
  }
  return 0;
}

void Registry::sum_foreign(const ForeignFilter& f, uint32_t nports, PortCounters* out) noexcept {
  Guard g(*this);
  if (g.rc()) return;
  reclaim_locked(nullptr);
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
    const ContextSlot& s = seg()->contexts[i];
    if (s.state.load(std::memory_order_acquire) != layout::kLive) continue;
    ContextInfo info;
    copy_slot(s, i, &info);
    if (is_context_file(info.segment.c_str()))
      (void)sum_context_file(paths_.device_dir + "/" + info.segment, info.pid, nports, out, &f);
  }
}

int Registry::reclaim_dead(std::vector<ContextInfo>* reclaimed) noexcept {
  Guard g(*this);
  if (g.rc()) return -g.rc();
  return reclaim_locked(reclaimed);
}

std::vector<ContextInfo> Registry::live_contexts() noexcept {
  std::vector<ContextInfo> out;
  Guard g(*this);
  if (g.rc()) return out;
  reclaim_locked(nullptr);
  for (uint32_t i = 0; i < limits::kMaxContexts; ++i) {
    const ContextSlot& s = seg()->contexts[i];
    if (s.state.load(std::memory_order_acquire) != layout::kLive) continue;  // A1 pairs with R1
    ContextInfo info;
    copy_slot(s, i, &info);
    out.push_back(std::move(info));
  }
  return out;
}

}  // namespace shmrdma
