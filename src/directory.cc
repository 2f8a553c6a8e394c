#include "directory.h"

#include <sys/stat.h>
#include <time.h>

#include <set>

#include "device_setup.h"
#include "paths.h"
#include "proc.h"

namespace shmrdma {

namespace {

uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

bool file_id(const std::string& path, dev_t* dev, ino_t* ino) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return false;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return true;
}

bool unicast_lid(uint16_t lid) { return lid != 0 && lid < 0xc000; }

}  // namespace

uint32_t choose_home_id(const std::string& home, const std::string& name) noexcept {
  try {
    std::set<uint32_t> used;
    for (const std::string& n : list_devices(home)) {
      if (n == name) continue;
      Registry r;
      if (Registry::attach(device_paths(home, n), &r) == 0) used.insert(r.device().home_id);
    }
    for (uint32_t id = 1; id <= layout::kMaxHomeId; ++id)
      if (!used.count(id)) return id;
  } catch (...) {
  }
  return 0;
}

void DeviceDirectory::init(const std::string& home, Registry* own) noexcept {
  try {
    home_ = home;
    if (!own) return;  // a process without a device of its own (shmrdmad): every device is another's
    self_ = std::make_shared<HomeDevice>();
    self_->self = true;
    self_->registry = own;
    self_->home_id = own->device().home_id;
    (void)file_id(own->paths().registry, &self_->file_dev, &self_->file_ino);
    self_id_ = self_->home_id;
    std::lock_guard lk(mu_);
    by_name_[own->paths().name] = self_;
  } catch (...) {
  }
}

void DeviceDirectory::rescan(bool force) noexcept {
  std::lock_guard lk(mu_);
  rescan_locked(force);
}

void DeviceDirectory::rescan_locked(bool force) noexcept {
  const uint64_t now = mono_ns();
  if (!force && now - last_scan_ns_ < kMinRescanNs) return;
  last_scan_ns_ = now;
  try {
    std::vector<std::string> names = list_devices(home_);
    std::set<std::string> present(names.begin(), names.end());
    // Devices that left, or whose registry is another file now (down + up).
    for (auto it = by_name_.begin(); it != by_name_.end();) {
      HomeDevice& d = *it->second;
      dev_t fd = 0;
      ino_t fi = 0;
      const bool same = present.count(it->first) &&
                        file_id(d.registry->paths().registry, &fd, &fi) && fd == d.file_dev && fi == d.file_ino;
      if (same || d.self) {  // our own device stays ours for the context's life
        ++it;
        continue;
      }
      d.gone.store(true, std::memory_order_release);
      retired_.push_back(it->second);
      it = by_name_.erase(it);
    }
    for (const std::string& n : names) {
      if (by_name_.count(n)) continue;
      auto d = std::make_shared<HomeDevice>();
      // Untrusted like any segment: attach checks header, kind, size and the
      // device record (name, port count).
      if (Registry::attach(device_paths(home_, n), &d->owned) != 0) continue;
      d->registry = &d->owned;
      d->home_id = d->owned.device().home_id;
      if (d->home_id == 0 || d->home_id > layout::kMaxHomeId || d->home_id == self_id_) continue;
      if (!file_id(d->owned.paths().registry, &d->file_dev, &d->file_ino)) continue;
      by_name_[n] = std::move(d);
    }
  } catch (...) {
  }
}

HomeDevice* DeviceDirectory::find_lid_locked(uint16_t lid, uint32_t* port) noexcept {
  for (auto& [name, d] : by_name_) {
    const layout::DeviceRecord& r = d->record();
    for (uint32_t p = 0; p < r.num_ports && p < limits::kMaxPorts; ++p)
      if (r.ports[p].lid == lid) {
        *port = p + 1;
        return d.get();
      }
  }
  return nullptr;
}

HomeDevice* DeviceDirectory::by_lid(uint16_t lid, uint32_t* port) noexcept {
  if (!unicast_lid(lid) || !self_) return nullptr;
  // The own device without a lock (its record is a private copy).
  const layout::DeviceRecord& own = self_->record();
  for (uint32_t p = 0; p < own.num_ports && p < limits::kMaxPorts; ++p)
    if (own.ports[p].lid == lid) {
      *port = p + 1;
      return self_.get();
    }
  std::lock_guard lk(mu_);
  if (HomeDevice* d = find_lid_locked(lid, port)) {
    if (!d->gone.load(std::memory_order_acquire)) return d;
  }
  rescan_locked(false);
  return find_lid_locked(lid, port);
}

bool DeviceDirectory::gid_on(HomeDevice& d, const uint8_t gid[16], uint8_t type, uint32_t* port,
                             uint32_t* seq) noexcept {
  const layout::DeviceRecord& r = d.record();
  if (r.net.link_layer != layout::kLinkLayerEthernet) return false;  // an IB GID is not a RoCE address
  for (uint32_t p = 1; p <= r.num_ports && p <= limits::kMaxPorts; ++p) {
    // The seq first: a match found under it holds while it does not change.
    const uint32_t s = d.registry->port_net_seq(p);
    uint32_t index = 0;
    if ((s & 1) == 0 && d.registry->gid_index_of(p, gid, type, &index)) {
      *port = p;
      *seq = s;
      return true;
    }
  }
  return false;
}

HomeDevice* DeviceDirectory::by_gid(const uint8_t gid[16], uint8_t type, uint32_t* port, uint32_t* seq) noexcept {
  if (self_ && gid_on(*self_, gid, type, port, seq)) return self_.get();
  std::lock_guard lk(mu_);
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& [name, d] : by_name_)
      if (!d->self && !d->gone.load(std::memory_order_acquire) && gid_on(*d, gid, type, port, seq)) return d.get();
    if (pass == 0) rescan_locked(false);
  }
  return nullptr;
}

HomeDevice* DeviceDirectory::by_id(uint32_t home_id) noexcept {
  if (!self_ || home_id == 0) return nullptr;
  if (home_id == self_id_) return self_.get();
  std::lock_guard lk(mu_);
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& [name, d] : by_name_)
      if (d->home_id == home_id) return d.get();
    if (pass == 0) rescan_locked(false);
  }
  return nullptr;
}

std::vector<HomeDevice*> DeviceDirectory::all(bool rescan) noexcept {
  std::vector<HomeDevice*> out;
  try {
    std::lock_guard lk(mu_);
    if (rescan) rescan_locked(false);
    out.reserve(by_name_.size());
    for (auto& [name, d] : by_name_) out.push_back(d.get());
  } catch (...) {
  }
  return out;
}

bool DeviceDirectory::context_live(uint32_t home_id, uint32_t slot, uint32_t generation, ContextInfo* info) noexcept {
  HomeDevice* d = by_id(home_id);
  if (!d) return false;
  return d->registry->context_slot(slot, info) && info->generation == generation &&
         process_alive(static_cast<pid_t>(info->pid), info->start_time);
}

}  // namespace shmrdma
