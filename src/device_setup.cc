#include "device_setup.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <set>

#include <infiniband/verbs.h>

#include "async.h"
#include "gid_table.h"

namespace shmrdma {

namespace {

// The device node is a character device with the numbers of /dev/full: it
// never has to do anything (no kernel command is ever sent), and should
// libibverbs itself write a kernel command it fails cleanly with ENOSPC.
constexpr unsigned kCdevMajor = 1, kCdevMinor = 7;

int mkdirs(const std::string& path, mode_t mode) {
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), mode) != 0 && errno != EEXIST) return errno;
  }
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return errno;
  return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

int remove_tree(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT ? 0 : errno;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        if (!std::strcmp(e->d_name, ".") || !std::strcmp(e->d_name, "..")) continue;
        remove_tree(path + "/" + e->d_name);
      }
      ::closedir(d);
    }
    return ::rmdir(path.c_str()) == 0 ? 0 : errno;
  }
  return ::unlink(path.c_str()) == 0 ? 0 : errno;
}

uint64_t random_guid() {
  uint64_t g = 0;
  if (::getrandom(&g, sizeof g, 0) != sizeof g) g = static_cast<uint64_t>(::time(nullptr)) * 0x9e3779b97f4a7c15ull;
  // EUI-64 with the locally administered bit set and the group bit clear:
  // never a manufacturer's GUID. The low byte is left for port numbers.
  g = (g & 0x00ffffffffffff00ull) | (0x02ull << 56);
  return g;
}

// LIDs already used by other devices under the same home.
std::set<uint16_t> used_lids(const std::string& home, const std::string& except) {
  std::set<uint16_t> lids;
  for (const std::string& n : list_devices(home)) {
    if (n == except) continue;
    Registry r;
    if (Registry::attach(device_paths(home, n), &r) != 0) continue;
    for (uint32_t p = 0; p < r.device().num_ports; ++p) lids.insert(r.device().ports[p].lid);
  }
  return lids;
}

struct Writer {
  int rc = 0;
  void file(const std::string& path, const std::string& text) {
    if (rc) return;
    rc = write_file_atomic(path, text + "\n", 0444);
  }
  void dir(const std::string& path) {
    if (rc) return;
    rc = mkdirs(path, 0755);
  }
};

// Entries of class/infiniband_verbs naming this device under another node
// name (left by an older layout) would make libibverbs list it twice.
void remove_stale_uverbs(const DevicePaths& p) {
  std::string dir = p.sysfs_root + "/class/infiniband_verbs";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.' || p.uverbs_name == e->d_name) continue;
    std::string ibdev;
    if (read_small_file(dir + "/" + e->d_name + "/ibdev", &ibdev) == 0 && ibdev == p.name) stale.emplace_back(e->d_name);
  }
  ::closedir(d);
  for (const auto& s : stale) remove_tree(dir + "/" + s);
}

// The kernel's rate_show: "<rate> Gb/sec (<width>X<speed name>)".
std::string rate_text(uint32_t width, uint32_t speed) {
  int w = width == 1 ? 1 : width == 16 ? 2 : width == 2 ? 4 : width == 4 ? 8 : width == 8 ? 12 : 1;
  int tenths = 25;
  const char* name = "";
  switch (speed) {
    case 2: tenths = 50, name = " DDR"; break;
    case 4: tenths = 100, name = " QDR"; break;
    case 8: tenths = 100, name = " FDR10"; break;
    case 16: tenths = 140, name = " FDR"; break;
    case 32: tenths = 250, name = " EDR"; break;
    case 64: tenths = 500, name = " HDR"; break;
    case 128: tenths = 1000, name = " NDR"; break;
    default: break;
  }
  tenths *= w;
  return std::to_string(tenths / 10) + (tenths % 10 ? ".5" : "") + " Gb/sec (" + std::to_string(w) + "X" + name + ")";
}

// The files of one port that follow its live record (state, rate, GID
// table). libibverbs reads GIDs only from these files: they are the table
// libibverbs sees, the registry's PortNet is the table our data path sees,
// and every writer of one rewrites the other right after (the registry first).
void write_port_files(Writer& w, const DevicePaths& p, const layout::DeviceRecord& d, uint32_t port,
                      const PortNetView& v) {
  const std::string pd = p.ibdev_dir + "/ports/" + std::to_string(port);
  const bool eth = d.net.link_layer == layout::kLinkLayerEthernet;
  const bool active = v.state == layout::kPortActive;
  w.file(pd + "/state", active ? "4: ACTIVE" : "1: DOWN");
  w.file(pd + "/phys_state", active ? "5: LinkUp" : "3: Disabled");
  w.file(pd + "/rate", rate_text(v.active_width, v.active_speed));
  for (uint32_t g = 0; g < limits::kGidTableLen; ++g) {
    const std::string i = std::to_string(g);
    static const uint8_t kZero[16] = {};
    w.file(pd + "/gids/" + i, gid_full_text(v.valid(g) ? v.gids[g].gid : kZero));
    // Every index has a type file (libibverbs fails the query without one);
    // an empty slot reads as the kernel's default.
    w.file(pd + "/gid_attrs/types/" + i, gid_type_sysfs_name(v.valid(g) ? v.gids[g].type : uint8_t{layout::kGidTypeIb}));
    // The netdev of each RoCE entry (resolved with if_nametoindex in the
    // reader's namespace); empty for IB and for empty slots.
    w.file(pd + "/gid_attrs/ndevs/" + i, eth && v.valid(g) ? std::string(v.ifname) : std::string());
  }
}

int write_sysfs(const DevicePaths& p, const Registry& reg, std::string* why) {
  const layout::DeviceRecord& d = reg.device();
  const bool eth = d.net.link_layer == layout::kLinkLayerEthernet;
  remove_stale_uverbs(p);
  Writer w;
  w.dir(p.uverbs_dir);
  w.file(p.sysfs_root + "/class/infiniband_verbs/abi_version", "6");
  w.file(p.uverbs_dir + "/ibdev", p.name);
  w.file(p.uverbs_dir + "/dev", std::to_string(kCdevMajor) + ":" + std::to_string(kCdevMinor));
  w.file(p.uverbs_dir + "/abi_version", "1");
  w.dir(p.ibdev_dir + "/device");
  w.file(p.ibdev_dir + "/device/modalias", "shmrdma:" + p.name);
  w.file(p.ibdev_dir + "/node_type", "1: CA");
  w.file(p.ibdev_dir + "/node_guid", guid_string(d.node_guid));
  w.file(p.ibdev_dir + "/sys_image_guid", guid_string(d.sys_image_guid));
  w.file(p.ibdev_dir + "/node_desc", "shmrdma " + p.name);
  w.file(p.ibdev_dir + "/fw_ver", "0.1.0");
  w.file(p.ibdev_dir + "/hca_type", "shmrdma");
  w.file(p.ibdev_dir + "/hw_rev", "1");
  w.file(p.ibdev_dir + "/board_id", "SHMRDMA");
  w.file(p.ibdev_dir + "/" + kHomeFile, p.home);
  for (uint32_t i = 0; i < d.num_ports; ++i) {
    const layout::PortRecord& port = d.ports[i];
    std::string pd = p.ibdev_dir + "/ports/" + std::to_string(i + 1);
    w.dir(pd + "/gids");
    w.dir(pd + "/gid_attrs/types");
    w.dir(pd + "/gid_attrs/ndevs");
    w.dir(pd + "/pkeys");
    char lid[16];
    std::snprintf(lid, sizeof lid, "0x%x", eth ? 0 : port.lid);
    w.file(pd + "/lid", lid);
    w.file(pd + "/lid_mask_count", "0");
    w.file(pd + "/sm_lid", eth ? "0x0" : "0x1");
    w.file(pd + "/sm_sl", "0");
    w.file(pd + "/link_layer", eth ? "Ethernet" : "InfiniBand");
    w.file(pd + "/cap_mask", eth ? "0x00010000" : "0x00000000");  // RoCE: IB_PORT_CM_SUP, as rxe
    PortNetView v;
    if (int rc = reg.port_net_settled(i + 1, &v); rc && !w.rc) w.rc = rc;
    if (!w.rc) write_port_files(w, p, d, i + 1, v);
    for (uint32_t k = 0; k < limits::kPkeyTableLen; ++k) w.file(pd + "/pkeys/" + std::to_string(k), "0xffff");
  }
  if (eth) {
    // device/net/<ifname>: where pyverbs and others look for the netdev.
    // Rewritten whole, since the interface may have been renamed.
    remove_tree(p.ibdev_dir + "/device/net");
    PortNetView v;
    if (reg.port_net_settled(1, &v) == 0 && v.ifname[0] && (v.link & layout::kLinkPresent)) {
      w.dir(p.ibdev_dir + "/device/net/" + v.ifname);
      w.file(p.ibdev_dir + "/device/net/" + v.ifname + "/ifindex", std::to_string(d.net.ifindex));
    }
  }
  if (w.rc && why) *why = "cannot write the sysfs tree under " + p.sysfs_root + ": " + std::strerror(w.rc);
  return w.rc;
}

int write_counter_files(const DevicePaths& p, uint32_t nports, const std::vector<PortCounters>& c) {
  Writer w;
  for (uint32_t i = 0; i < nports && i < c.size(); ++i) {
    const std::string pd = p.ibdev_dir + "/ports/" + std::to_string(i + 1);
    // Never recreate the tree of a device that was brought down meanwhile.
    if (::access(pd.c_str(), F_OK) != 0) return ENOENT;
    w.dir(pd + "/counters");
    for (const NamedCounter& n : ib_counters(c[i])) w.file(pd + "/counters/" + n.name, std::to_string(n.value));
    w.dir(pd + "/hw_counters");
    for (const NamedCounter& n : hw_counters(c[i])) w.file(pd + "/hw_counters/" + n.name, std::to_string(n.value));
  }
  return w.rc;
}

bool cdev_ok(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == kCdevMajor &&
         minor(st.st_rdev) == kCdevMinor;
}

void ensure_cdev(const DevicePaths& p, UpResult* out) {
  if (cdev_ok(p.cdev)) {
    out->cdev_ready = true;
    return;
  }
  if (::geteuid() == 0) {
    ::mkdir("/dev/infiniband", 0755);
    ::unlink(p.cdev.c_str());
    if (::mknod(p.cdev.c_str(), S_IFCHR | 0666, makedev(kCdevMajor, kCdevMinor)) == 0) {
      ::chmod(p.cdev.c_str(), 0666);  // umask must not keep other users' programs out
      out->cdev_ready = cdev_ok(p.cdev);
      if (out->cdev_ready) return;
    }
  }
  out->cdev_hint = "mkdir -p /dev/infiniband && mknod -m 666 " + p.cdev + " c " + std::to_string(kCdevMajor) + " " +
                   std::to_string(kCdevMinor);
}

// Attaches to the registry, giving a concurrent creator up to two seconds to
// publish it (a registry that stays unpublished longer lost its creator).
int attach_settled(const DevicePaths& p, Registry* reg) {
  int rc = Registry::attach(p, reg);
  for (int i = 0; i < 200 && rc == EAGAIN; ++i) {
    ::usleep(10000);
    rc = Registry::attach(p, reg);
  }
  return rc;
}

}  // namespace

int raise_port_event(Registry& reg, uint32_t port, uint32_t event_type) {
  int notified = 0;
  for (const ContextInfo& c : reg.live_contexts()) {
    int fd = open_async_fifo_writer(reg.paths().device_dir + "/" + c.segment + kAsyncSuffix);
    if (fd < 0) continue;
    if (write_async_event(fd, event_type, port)) notified += 1;
    ::close(fd);
  }
  return notified;
}

int refresh_counters(Registry& reg, std::vector<PortCounters>* out) {
  std::vector<PortCounters> c;
  if (int rc = reg.read_counters(&c)) return rc;
  add_foreign_counters(reg, &c);  // what peers on other devices of the home sent us (counters.h)
  int rc = write_counter_files(reg.paths(), reg.device().num_ports, c);
  if (out) *out = std::move(c);
  return rc;
}

std::string guid_string(uint64_t guid) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%04x:%04x:%04x", unsigned(guid >> 48) & 0xffff,
                unsigned(guid >> 32) & 0xffff, unsigned(guid >> 16) & 0xffff, unsigned(guid) & 0xffff);
  return buf;
}

std::vector<std::string> list_devices(const std::string& home) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir((home + "/devices").c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      if (!valid_device_name(e->d_name, nullptr)) continue;
      if (::access((home + "/devices/" + e->d_name + "/registry").c_str(), F_OK) == 0) out.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

int rewrite_sysfs(Registry& reg, std::string* why) { return write_sysfs(reg.paths(), reg, why); }

std::string netns_view_root(const std::string& home, uint64_t netns_dev, uint64_t netns_ino) {
  return home + "/netns/" + std::to_string(netns_dev) + "-" + std::to_string(netns_ino);
}

bool visible_in_netns(const layout::NetBinding& b, uint64_t netns_dev, uint64_t netns_ino) {
  if (b.link_layer != layout::kLinkLayerEthernet) return true;
  return b.netns_dev == netns_dev && b.netns_ino == netns_ino;
}

namespace {

// `link` is a symbolic link to `target` afterwards (replaced atomically).
int ensure_link(const std::string& link, const std::string& target) {
  char buf[4096];
  const ssize_t n = ::readlink(link.c_str(), buf, sizeof buf - 1);
  if (n >= 0 && std::string(buf, static_cast<size_t>(n)) == target) return 0;
  const size_t slash = link.find_last_of('/');
  const std::string tmp = link.substr(0, slash + 1) + "." + link.substr(slash + 1) + ".tmp";
  ::unlink(tmp.c_str());
  if (::symlink(target.c_str(), tmp.c_str()) != 0) return errno;
  if (::rename(tmp.c_str(), link.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    return e;
  }
  return 0;
}

// Removes every entry of `dir` (dot files and `keep` aside) not in `wanted`.
void remove_unwanted(const std::string& dir, const std::set<std::string>& wanted, const char* keep) {
  std::vector<std::string> extra;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.' || (keep && !std::strcmp(e->d_name, keep)) || wanted.count(e->d_name)) continue;
      extra.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  for (const auto& x : extra) remove_tree(dir + "/" + x);
}

// Views change under an exclusive flock of <home>/netns/.lock: two `up`s in
// different namespaces would otherwise remove each other's new links.
class ViewLock {
 public:
  explicit ViewLock(const std::string& home) {
    if (mkdirs(home + "/netns", 0700) != 0) return;
    fd_ = ::open((home + "/netns/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ >= 0) {
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~ViewLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  ViewLock(const ViewLock&) = delete;
  ViewLock& operator=(const ViewLock&) = delete;

 private:
  int fd_ = -1;
};

int sync_view_locked(const std::string& home, uint64_t netns_dev, uint64_t netns_ino, std::string* why) {
  const std::string root = netns_view_root(home, netns_dev, netns_ino);
  const std::string ib = root + "/class/infiniband", uv = root + "/class/infiniband_verbs";
  int rc = mkdirs(ib, 0755);
  if (!rc) rc = mkdirs(uv, 0755);
  std::string abi;
  if (!rc && (read_small_file(uv + "/abi_version", &abi) != 0 || abi != "6"))
    rc = write_file_atomic(uv + "/abi_version", "6\n", 0444);
  std::set<std::string> want_ib, want_uv;
  for (const std::string& name : list_devices(home)) {
    if (rc) break;
    const DevicePaths p = device_paths(home, name);
    Registry reg;
    // A device being created or removed meanwhile is left out: its `up` or
    // `down` syncs the views again when it is done.
    if (Registry::attach(p, &reg) != 0 || ::access(p.uverbs_dir.c_str(), F_OK) != 0 ||
        !visible_in_netns(reg.device().net, netns_dev, netns_ino))
      continue;
    want_ib.insert(name);
    want_uv.insert(p.uverbs_name);
    if ((rc = ensure_link(ib + "/" + name, p.ibdev_dir)) == 0) rc = ensure_link(uv + "/" + p.uverbs_name, p.uverbs_dir);
  }
  if (rc) {
    if (why) *why = "cannot write the device view " + root + ": " + std::strerror(rc);
    return rc;
  }
  remove_unwanted(ib, want_ib, nullptr);
  remove_unwanted(uv, want_uv, "abi_version");
  return 0;
}

}  // namespace

int sync_netns_view(const std::string& home, uint64_t netns_dev, uint64_t netns_ino, std::string* why) {
  ViewLock lock(home);
  return sync_view_locked(home, netns_dev, netns_ino, why);
}

void sync_netns_views(const std::string& home) {
  ViewLock lock(home);
  std::vector<std::pair<uint64_t, uint64_t>> views;
  if (DIR* d = ::opendir((home + "/netns").c_str())) {
    while (dirent* e = ::readdir(d)) {
      unsigned long long dev = 0, ino = 0;
      char tail = 0;
      if (e->d_name[0] != '.' && std::sscanf(e->d_name, "%llu-%llu%c", &dev, &ino, &tail) == 2)
        views.emplace_back(dev, ino);
    }
    ::closedir(d);
  }
  for (const auto& [dev, ino] : views) (void)sync_view_locked(home, dev, ino, nullptr);
}

int apply_port_net(Registry& reg, uint32_t port, const PortNetView& v, PortNetChange* change, std::string* why) {
  PortNetChange c;
  if (int rc = reg.update_port_net(port, v, &c); rc) {
    *why = std::string("cannot update the port record: ") + std::strerror(rc);
    return rc;
  }
  // Registry first, then the files libibverbs reads, then the events: a
  // process woken by an event reads the new table wherever it looks.
  if (c.gids || c.state || c.other) {
    if (int rc = write_sysfs(reg.paths(), reg, why); rc) return rc;
  }
  if (c.state) (void)refresh_counters(reg, nullptr);  // link_downed
  if (c.gids) raise_port_event(reg, port, IBV_EVENT_GID_CHANGE);
  if (c.state)
    raise_port_event(reg, port, c.new_state == layout::kPortActive ? IBV_EVENT_PORT_ACTIVE : IBV_EVENT_PORT_ERR);
  if (change) *change = c;
  return 0;
}

int device_up(const std::string& home, const std::string& name, uint32_t ports, UpResult* out, std::string* why,
              const RoceSpec* roce) {
  std::string reason;
  if (!valid_device_name(name, &reason)) {
    *why = "invalid device name '" + name + "': " + reason;
    return EINVAL;
  }
  if (ports > limits::kMaxPorts) {
    *why = "--ports must be between 1 and " + std::to_string(limits::kMaxPorts);
    return EINVAL;
  }
  if (roce && ports > 1) {
    *why = "a RoCE device (--netdev) has one port";
    return EINVAL;
  }
  if (roce && roce->binding.link_layer != layout::kLinkLayerEthernet) {
    *why = "internal error: a RoCE binding without the Ethernet link layer";
    return EINVAL;
  }
  DevicePaths p = device_paths(home, name);
  if (int rc = mkdirs(home, 0700)) {
    *why = "cannot create " + home + ": " + std::strerror(rc);
    return rc;
  }
  if (int rc = mkdirs(p.device_dir, 0700)) {
    *why = "cannot create " + p.device_dir + ": " + std::strerror(rc);
    return rc;
  }
  Registry reg;
  int rc = attach_settled(p, &reg);
  if (rc == EPROTO || rc == EAGAIN) {
    // A registry of another layout version, or one whose creator died before
    // publishing it: nothing can use it, so it is replaced.
    ::unlink(p.registry.c_str());
    rc = ENOENT;
  }
  if (rc == 0 && roce) {
    // The name is taken unless it is this very binding (then `up` repairs it).
    const layout::NetBinding& have = reg.device().net;
    const bool same = have.link_layer == layout::kLinkLayerEthernet && have.netns_dev == roce->binding.netns_dev &&
                      have.netns_ino == roce->binding.netns_ino && have.ifindex == roce->binding.ifindex;
    if (!same) {
      *why = "the name " + name + " is already taken by " +
             (have.link_layer == layout::kLinkLayerEthernet
                  ? std::string("a RoCE device bound to ") + have.ifname +
                        (have.netns_ino == roce->binding.netns_ino && have.netns_dev == roce->binding.netns_dev
                             ? ""
                             : " of another network namespace")
                  : std::string("an InfiniBand device")) +
             " (choose another --name, or `shmrdma down --name " + name + "` first)";
      return EEXIST;
    }
    if (have.gid_layout != roce->binding.gid_layout) {
      *why = "device " + name + " is already up with the " +
             (have.gid_layout == layout::kGidLayoutMlx5 ? "mlx5" : "rxe") +
             " GID layout; bring it down first to change that";
      return EEXIST;
    }
    if ((rc = apply_port_net(reg, 1, roce->port, nullptr, why)) != 0) return rc;
  }
  if (rc == 0) {
    if (ports != 0 && reg.device().num_ports != ports) {
      *why = "device " + name + " is already up with " + std::to_string(reg.device().num_ports) +
             " port(s); bring it down first to change that";
      return EEXIST;
    }
    out->created = false;
    out->reclaimed = reg.reclaim_dead();
  } else if (rc == ENOENT) {
    if (ports == 0) ports = 1;
    layout::DeviceRecord d{};
    std::snprintf(d.name, sizeof d.name, "%s", name.c_str());
    d.node_guid = random_guid();
    d.sys_image_guid = d.node_guid;
    d.num_ports = ports;
    timespec ts{};
    clock_gettime(CLOCK_REALTIME, &ts);
    d.created_unix_ns = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
    std::vector<PortNetView> net;
    if (roce) {
      // rxe: node and port GUID are the EUI-64 of the MAC; no LID.
      d.net = roce->binding;
      d.node_guid = guid_from_mac(roce->binding.mac);
      d.sys_image_guid = d.node_guid;
      d.ports[0].lid = 0;
      d.ports[0].state = layout::kPortActive;  // then derived from the link (Registry::update_port_net)
      d.ports[0].port_guid = d.node_guid;
      net.push_back(roce->port);
    } else {
      std::set<uint16_t> taken = used_lids(home, name);
      uint16_t lid = 1;
      for (uint32_t i = 0; i < ports; ++i) {
        while (taken.count(lid)) ++lid;
        d.ports[i].lid = lid++;
        d.ports[i].state = 4;  // IBV_PORT_ACTIVE
        d.ports[i].port_guid = d.node_guid + i + 1;
      }
    }
    rc = Registry::create(p, d, &reg, roce ? &net : nullptr);
    if (rc == EEXIST) rc = attach_settled(p, &reg);  // someone else won the race
    if (rc) {
      *why = "cannot create the registry " + p.registry + ": " + std::strerror(rc);
      return rc;
    }
    out->created = true;
  } else {
    *why = "cannot open the registry " + p.registry + ": " + std::strerror(rc);
    return rc;
  }
  if ((rc = write_sysfs(p, reg, why)) != 0) return rc;
  (void)refresh_counters(reg, nullptr);
  ensure_cdev(p, out);
  sync_netns_views(home);
  return 0;
}

int port_set_state(const std::string& home, const std::string& name, uint32_t port, bool active, int* notified,
                   std::string* why) {
  *notified = 0;
  DevicePaths p = device_paths(home, name);
  Registry reg;
  int rc = Registry::attach(p, &reg);
  if (rc) {
    *why = "device " + name + " is not up under " + home + " (" + std::strerror(rc) + ")";
    return rc;
  }
  if (port < 1 || port > reg.device().num_ports) {
    *why = "device " + name + " has " + std::to_string(reg.device().num_ports) + " port(s)";
    return EINVAL;
  }
  PortNetChange change;
  if ((rc = reg.set_port_state(port, active ? layout::kPortActive : layout::kPortDown, &change)) != 0) {
    *why = std::string("cannot change the port state: ") + std::strerror(rc);
    return rc;
  }
  if ((rc = write_sysfs(p, reg, why)) != 0) return rc;
  (void)refresh_counters(reg, nullptr);  // link_downed
  // The event, port number as its element (as the kernel's descriptors), to
  // every open context (ibv_get_async_event in each of them).
  // IB: always (what `shmrdma port` always did); RoCE: when the state changed
  // (`port up` of a port whose interface is down leaves it down).
  if (reg.device().net.link_layer == layout::kLinkLayerIb || change.state)
    *notified = raise_port_event(reg, port, change.new_state == layout::kPortActive ? IBV_EVENT_PORT_ACTIVE
                                                                                   : IBV_EVENT_PORT_ERR);
  return 0;
}

int device_down(const std::string& home, const std::string& name, bool force, std::string* why) {
  DevicePaths p = device_paths(home, name);
  Registry reg;
  int rc = Registry::attach(p, &reg);
  if (rc == 0) {
    auto live = reg.live_contexts();
    if (!live.empty() && !force) {
      std::string pids;
      for (const auto& c : live) pids += (pids.empty() ? "" : ", ") + std::to_string(c.pid);
      *why = "device " + name + " is in use by process(es) " + pids + " (use --force to remove it anyway)";
      return EBUSY;
    }
  } else if (rc == ENOENT && ::access(p.ibdev_dir.c_str(), F_OK) != 0) {
    *why = "device " + name + " is not up";
    return ENOENT;
  }
  if (rc == 0) reg.retire();  // mappings other processes keep (DeviceDirectory) stop matching it
  remove_tree(p.uverbs_dir);
  remove_tree(p.ibdev_dir);
  remove_tree(p.device_dir);
  if (cdev_ok(p.cdev)) ::unlink(p.cdev.c_str());
  sync_netns_views(home);
  return 0;
}

}  // namespace shmrdma
