#include "gid_directory.h"

#include <sys/stat.h>
#include <time.h>

#include <algorithm>

#include "device_setup.h"

namespace shmrdma {

namespace {

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

bool GidDirectory::find_locked(const uint8_t gid[16], uint8_t type_filter, GidMatch* out) noexcept {
  for (Device& d : live_) {
    const uint32_t nports = d.registry->device().num_ports;
    for (uint32_t p = 1; p <= nports; ++p) {
      PortNetView v;
      uint32_t index = 0;
      if (d.registry->port_net(p, &v) != 0 || !gid_index_of(v, gid, type_filter, &index)) continue;
      out->registry = d.registry.get();
      out->port = p;
      out->gid_index = index;
      out->type = v.gids[index].type;
      out->link_layer = d.registry->device().net.link_layer;
      out->port_state = v.state;
      out->seq = v.seq;
      return true;
    }
  }
  return false;
}

void GidDirectory::rescan_locked() noexcept {
  try {
    last_scan_ns_ = now_ns();
    scanned_ = true;
    std::vector<std::string> names = list_devices(home_);
    std::vector<Device> next;
    for (const std::string& n : names) {
      DevicePaths paths = device_paths(home_, n);
      struct stat st{};
      if (::stat(paths.registry.c_str(), &st) != 0) continue;
      auto it = std::find_if(live_.begin(), live_.end(), [&](const Device& d) { return d.name == n; });
      if (it != live_.end() && it->st_dev == st.st_dev && it->st_ino == st.st_ino) {
        next.push_back(std::move(*it));
        live_.erase(it);
        continue;
      }
      auto reg = std::make_unique<Registry>();
      if (Registry::attach(paths, reg.get()) != 0) continue;  // not ready yet, or another layout: next scan
      next.push_back(Device{n, std::move(reg), st.st_dev, st.st_ino});
    }
    // What is left in live_ is gone or was replaced.
    for (Device& d : live_) retired_.push_back(std::move(d));
    live_ = std::move(next);
  } catch (...) {
    // Out of memory: keep what we had.
  }
}

bool GidDirectory::lookup(const uint8_t gid[16], uint8_t type_filter, GidMatch* out) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (!scanned_) rescan_locked();
  if (find_locked(gid, type_filter, out)) return true;
  if (now_ns() - last_scan_ns_ < kRescanIntervalNs) return false;
  rescan_locked();
  return find_locked(gid, type_filter, out);
}

void GidDirectory::refresh() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  rescan_locked();
}

}  // namespace shmrdma
