// The `shmrdma` command: device lifecycle (up, down), the environment that
// makes the stock libibverbs load our plugin (env, run), and status.
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <limits.h>
#include <link.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "context.h"
#include "daemon_client.h"
#include "device_setup.h"
#include "gid_table.h"
#include "net/netif.h"
#include "paths.h"
#include "proc.h"
#include "registry.h"
#include "segment.h"
#include "shmrdma_config.h"

namespace {

using shmrdma::DevicePaths;

constexpr const char* kPluginFile = "libshmrdma-rdmav34.so";

std::string dirname_of(const std::string& p) {
  auto pos = p.find_last_of('/');
  return pos == std::string::npos ? "." : (pos == 0 ? "/" : p.substr(0, pos));
}

bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

std::string self_dir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  return dirname_of(buf);
}

// <prefix>/<bindir>/shmrdma -> <prefix>
std::string install_prefix() {
  std::string prefix = self_dir();
  std::string bindir = SHMRDMA_BINDIR;
  for (size_t i = 0; i <= bindir.size(); ++i)
    if (i == bindir.size() || bindir[i] == '/') prefix = dirname_of(prefix);
  return prefix;
}

// The plugin is found relative to this executable, so a private --prefix
// install (or the build tree) works without configuration.
std::string plugin_dir() {
  if (const char* d = std::getenv("SHMRDMA_PROVIDER_DIR"); d && *d) return d;
  std::string build_tree = dirname_of(self_dir()) + "/providers/shmrdma";
  if (exists(build_tree + "/" + kPluginFile)) return build_tree;
  return install_prefix() + "/" + SHMRDMA_PLUGIN_SUBDIR;
}

// The shim that makes completion channels work (tools/shim): next to the
// plugin when SHMRDMA_PROVIDER_DIR names a directory holding both, in
// <prefix>/<shim subdir> once installed, in tools/shim of the build tree.
constexpr const char* kShimFile = "libshmrdma-shim.so";
std::string shim_path() {
  for (const std::string& p : {plugin_dir() + "/" + kShimFile,
                               install_prefix() + "/" + SHMRDMA_SHIM_SUBDIR + "/" + kShimFile,
                               self_dir() + "/shim/" + kShimFile})
    if (exists(p)) return p;
  return "";
}

// Whether libibverbs loads our plugin by itself: a system install's driver
// file says "driver <plugin_base>" (libibverbs/dynamic_driver.c reads lines
// "driver NAME-OR-PATH", skipping blank lines and '#' comments). Only this
// build's own plugin counts, so a build tree or a private prefix on a host
// with the package installed still sets RDMAV_DRIVERS (libibverbs loads
// those first, and the first provider that claims a device gets it).
bool driver_file_loads(const std::string& plugin_base) {
  const std::string driver_file = SHMRDMA_DRIVER_FILE;
  if (driver_file.empty()) return false;
  std::string text;
  if (shmrdma::read_small_file(driver_file, &text) != 0) return false;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    std::vector<std::string> fields;
    size_t i = 0;
    while (i < line.size()) {
      size_t b = line.find_first_not_of(" \t", i);
      if (b == std::string::npos) break;
      size_t e = line.find_first_of(" \t", b);
      if (e == std::string::npos) e = line.size();
      fields.push_back(line.substr(b, e - b));
      i = e;
    }
    if (fields.size() >= 2 && fields[0] == "driver" && fields[1] == plugin_base) return true;
  }
  return false;
}

// LD_PRELOAD with the shim in front of what was there, after any sanitizer
// runtime (which must be the first object loaded). In a build with
// AddressSanitizer our own runtime goes first: instrumented programs check
// it, and stock programs need it to load the instrumented plugin.
std::string preload_with_shim(const std::string& shim) {
  std::vector<std::string> first, rest;
  auto is_runtime = [](const std::string& p) {
    std::string b = p.substr(p.find_last_of('/') + 1);
    return b.rfind("libasan", 0) == 0 || b.rfind("libclang_rt.asan", 0) == 0 || b.rfind("libtsan", 0) == 0;
  };
#if defined(__SANITIZE_ADDRESS__)
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        std::string n = info->dlpi_name ? info->dlpi_name : "";
        if (n.find("/libasan.so") != std::string::npos) static_cast<std::vector<std::string>*>(data)->push_back(n);
        return 0;
      },
      &first);
#endif
  std::string old = std::getenv("LD_PRELOAD") ? std::getenv("LD_PRELOAD") : "";
  size_t i = 0;
  while (i < old.size()) {
    size_t j = old.find_first_of(": ", i);
    if (j == std::string::npos) j = old.size();
    std::string e = old.substr(i, j - i);
    i = j + 1;
    if (e.empty() || e == shim || std::find(first.begin(), first.end(), e) != first.end()) continue;
    (is_runtime(e) ? first : rest).push_back(e);
  }
  std::string out;
  for (const auto& v : {first, std::vector<std::string>{shim}, rest})
    for (const auto& e : v) out += (out.empty() ? "" : ":") + e;
  return out;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Env {
  std::vector<std::pair<std::string, std::string>> vars;
};

// The sysfs tree programs of this network namespace get: its view (the
// InfiniBand devices of the home and the RoCE devices bound to interfaces of
// this namespace, as the kernel's exclusive netns mode shows them), made or
// updated now; with SHMRDMA_NETNS_MODE=shared the home's whole tree (every
// device, as the kernel's shared mode).
std::string sysfs_root(const std::string& home) {
  const char* mode = std::getenv("SHMRDMA_NETNS_MODE");
  if (mode && !std::strcmp(mode, "shared")) return home + "/sys";
  if (mode && *mode && std::strcmp(mode, "exclusive"))
    fmt::print(stderr, "shmrdma: SHMRDMA_NETNS_MODE={} is neither shared nor exclusive; using exclusive\n", mode);
  uint64_t dev = 0, ino = 0;
  std::string why;
  if (int rc = shmrdma::current_netns(&dev, &ino); rc) {
    why = std::string("cannot identify this network namespace: ") + std::strerror(rc);
  } else if (shmrdma::sync_netns_view(home, dev, ino, &why) == 0) {
    return shmrdma::netns_view_root(home, dev, ino);
  }
  fmt::print(stderr, "shmrdma: {}; programs see every device of {}\n", why, home);
  return home + "/sys";
}

// What a program needs to use the devices under `home`: the state home and
// the sysfs tree always; RDMAV_DRIVERS unless the driver file of a system
// install already loads this plugin; the shim in LD_PRELOAD.
Env environment(const std::string& home, const std::string& sysfs) {
  Env e;
  e.vars = {{"SHMRDMA_HOME", home}, {"SYSFS_PATH", sysfs}};
  if (std::string drivers = plugin_dir() + "/libshmrdma"; !driver_file_loads(drivers)) {
    if (const char* old = std::getenv("RDMAV_DRIVERS"); old && *old) {
      std::string o = old;
      if (o.find(drivers) == std::string::npos) drivers += ":" + o;
      else drivers = o;
    }
    e.vars.emplace_back("RDMAV_DRIVERS", drivers);
  }
  if (std::string shim = shim_path(); !shim.empty()) e.vars.emplace_back("LD_PRELOAD", preload_with_shim(shim));
  return e;
}

std::string comm_of(uint32_t pid) {
  std::string s;
  if (shmrdma::read_small_file("/proc/" + std::to_string(pid) + "/comm", &s) != 0) return "?";
  return s;
}

const char* wq_state_name(uint32_t s) {
  switch (s) {
    case 0: return "RESET";
    case 1: return "RDY";
    case 2: return "ERR";
    default: return "UNKNOWN";
  }
}

// The daemon binary: $SHMRDMAD, the build tree's daemon/shmrdmad, or next
// to this executable once installed.
std::string daemon_binary() {
  if (const char* d = std::getenv("SHMRDMAD"); d && *d) return d;
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "shmrdmad";
  buf[n] = '\0';
  std::string exe_dir = dirname_of(buf);
  if (std::string b = dirname_of(exe_dir) + "/daemon/shmrdmad"; exists(b)) return b;
  return exe_dir + "/shmrdmad";
}

// The daemon of this state home and network namespace answers, starting it
// when it does not. 0, or an errno with a sentence in *why.
int ensure_daemon(const std::string& home, shmrdma::DaemonPaths* out, bool* started, std::string* why) {
  uint64_t dev = 0, ino = 0;
  if (int rc = shmrdma::current_netns(&dev, &ino); rc) {
    *why = std::string("cannot identify this network namespace: ") + std::strerror(rc);
    return rc;
  }
  *out = shmrdma::daemon_paths(home, dev, ino);
  *started = false;
  std::string reply;
  for (int attempt = 0; attempt < 20; ++attempt) {
    if (shmrdma::daemon_request(*out, "refresh", &reply, 2000) == 0 && reply.rfind("ok", 0) == 0) return 0;
    if (attempt > 0) {
      ::usleep(100000);  // one that is stopping still holds the lock
      if (attempt % 5 != 0) continue;
    }
    const std::string bin = daemon_binary();
    pid_t pid = ::fork();
    if (pid < 0) {
      *why = std::string("fork: ") + std::strerror(errno);
      return errno;
    }
    if (pid == 0) {
      ::execl(bin.c_str(), bin.c_str(), "--home", home.c_str(), static_cast<char*>(nullptr));
      fmt::print(stderr, "shmrdma up: cannot run the daemon {}: {}\n", bin, std::strerror(errno));
      ::_exit(127);
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    if (code == 0) *started = true;
    else if (code != 3) {  // 3: another one runs (or is stopping); ask it again
      *why = "the daemon " + bin + " did not start (exit " + std::to_string(code) + "; see " + out->log + ")";
      return EIO;
    }
  }
  *why = "the daemon does not answer on " + out->sock + " (see " + out->log + ")";
  return ETIMEDOUT;
}

const char* mtu_text(uint32_t m) {
  switch (m) {
    case 1: return "256";
    case 2: return "512";
    case 3: return "1024";
    case 4: return "2048";
    default: return "4096";
  }
}

// The GIDs of the interface that do not fit the table, as text (empty when
// all fit): `up` says so once the device is up.
std::string g_gids_left_out;

// Reads the interface and checks it can carry a RoCE device; nothing is
// created before every check passed.
bool roce_spec(const std::string& home, const std::string& name, const std::string& netdev, const std::string& gid_layout,
               bool layout_given, shmrdma::RoceSpec* spec, std::string* why) {
  namespace layout = shmrdma::layout;
  shmrdma::net::InterfaceState s;
  if (int rc = shmrdma::net::read_interface(netdev, 0, &s, why); rc) {
    if (rc == ENODEV)
      *why += " (an interface of another network namespace is not visible here: run the command inside that "
              "namespace, e.g. `ip netns exec NS shmrdma up --name NAME --netdev " + netdev + "`)";
    return false;
  }
  if (!s.ethernet) {
    *why = "interface " + netdev + " is not an Ethernet interface (RoCE needs a MAC address)";
    return false;
  }
  if (!shmrdma::net::has_usable_address(s)) {
    *why = "interface " + netdev + " has no IPv4 or global IPv6 address (a link-local fe80:: address gives no "
           "routable GID); add one first, e.g. `ip addr add 198.18.0.1/24 dev " + netdev + "`";
    return false;
  }
  uint64_t ns_dev = 0, ns_ino = 0;
  if (int rc = shmrdma::net::netns_identity(&ns_dev, &ns_ino); rc) {
    *why = std::string("cannot identify this network namespace (/proc/self/ns/net): ") + std::strerror(rc);
    return false;
  }
  layout::NetBinding& b = spec->binding;
  b = layout::NetBinding{};
  b.netns_dev = ns_dev;
  b.netns_ino = ns_ino;
  b.ifindex = s.ifindex;
  b.link_layer = layout::kLinkLayerEthernet;
  b.gid_layout = gid_layout == "mlx5" ? layout::kGidLayoutMlx5 : layout::kGidLayoutRxe;
  if (!layout_given) {
    // `up` of a device that exists keeps its layout unless told otherwise
    // (device_up refuses a different one).
    shmrdma::Registry reg;
    if (shmrdma::Registry::attach(shmrdma::device_paths(home, name), &reg) == 0 &&
        reg.device().net.link_layer == layout::kLinkLayerEthernet)
      b.gid_layout = reg.device().net.gid_layout;
  }
  std::memcpy(b.mac, s.mac, 6);
  std::snprintf(b.ifname, sizeof b.ifname, "%s", s.name.c_str());
  spec->port = shmrdma::net::port_view(s, true, static_cast<layout::GidLayout>(b.gid_layout), shmrdma::PortNetView{});
  g_gids_left_out = shmrdma::gids_text(
      shmrdma::gids_left_out(static_cast<layout::GidLayout>(b.gid_layout), s.mac, s.addrs));
  return true;
}

int cmd_up(const std::string& home, const std::string& name, uint32_t ports, const std::string& netdev,
           const std::string& gid_layout, bool layout_given) {
  shmrdma::UpResult r;
  std::string why;
  shmrdma::RoceSpec spec;
  if (!netdev.empty() && !roce_spec(home, name, netdev, gid_layout, layout_given, &spec, &why)) {
    fmt::print(stderr, "shmrdma up: {}\n", why);
    return 1;
  }
  int rc = shmrdma::device_up(home, name, ports, &r, &why, netdev.empty() ? nullptr : &spec);
  if (rc) {
    fmt::print(stderr, "shmrdma up: {}\n", why);
    return 1;
  }
  DevicePaths p = shmrdma::device_paths(home, name);
  shmrdma::Registry reg;
  if (shmrdma::Registry::attach(p, &reg) == 0) {
    const auto& d = reg.device();
    if (d.net.link_layer == shmrdma::layout::kLinkLayerEthernet) {
      shmrdma::PortNetView v;
      (void)reg.port_net(1, &v);
      fmt::print("{} {}: RoCE on {} (ifindex {}), node GUID {}, port {}, active_mtu {}", r.created ? "created" : "up",
                 name, v.ifname[0] ? v.ifname : d.net.ifname, d.net.ifindex, shmrdma::guid_string(d.node_guid),
                 v.state == shmrdma::layout::kPortActive ? "ACTIVE" : "DOWN", mtu_text(v.active_mtu));
      for (uint32_t i = 0; i < shmrdma::limits::kGidTableLen; ++i)
        if (v.valid(i))
          fmt::print("\n  GID[{}] {}, {}", i, shmrdma::gid_short_text(v.gids[i].gid),
                     v.gids[i].type == shmrdma::layout::kGidTypeRoceV2 ? "RoCE v2" : "RoCE v1");
      fmt::print("\n");
    } else {
      fmt::print("{} {}: node GUID {}, {} port(s), LID", r.created ? "created" : "up", name,
                 shmrdma::guid_string(d.node_guid), d.num_ports);
      for (uint32_t i = 0; i < d.num_ports; ++i) fmt::print(" {}", d.ports[i].lid);
      fmt::print("\n");
    }
  }
  if (!netdev.empty() && !g_gids_left_out.empty())
    fmt::print(stderr, "shmrdma up: warning: the GID table has {} entries; addresses of {} left out of it: {}\n",
               shmrdma::limits::kGidTableLen, netdev, g_gids_left_out);
  if (r.reclaimed) fmt::print("reclaimed {} context(s) of dead processes\n", r.reclaimed);
  // A RoCE device follows its interface through the daemon of this
  // namespace: started (or restarted) here.
  if (shmrdma::Registry reg2; shmrdma::Registry::attach(p, &reg2) == 0 &&
                              reg2.device().net.link_layer == shmrdma::layout::kLinkLayerEthernet) {
    uint64_t dev = 0, ino = 0;
    const auto& b = reg2.device().net;
    if (shmrdma::current_netns(&dev, &ino) == 0 && (dev != b.netns_dev || ino != b.netns_ino)) {
      fmt::print(stderr, "shmrdma up: {} is bound to an interface of another network namespace; run `shmrdma up` "
                 "there to (re)start the daemon that follows it\n", name);
    } else {
      shmrdma::DaemonPaths dp;
      bool started = false;
      if (int drc = ensure_daemon(home, &dp, &started, &why); drc) {
        fmt::print(stderr, "shmrdma up: {} is up but will not follow {}: {}\n", name, b.ifname, why);
        return 1;
      }
      if (started) fmt::print("started shmrdmad (pid {}, log {})\n", shmrdma::daemon_pid(dp), dp.log);
    }
  }
  if (!r.cdev_ready) {
    fmt::print(stderr,
               "shmrdma up: cannot create the device node {} (needs root once).\n"
               "Run this once as root, then `shmrdma up` again:\n  sudo sh -c '{}'\n",
               p.cdev, r.cdev_hint);
    return 2;
  }
  return 0;
}

int cmd_down(const std::string& home, const std::string& name, bool force) {
  std::string why;
  // The daemon following a RoCE device is told right away (it stops with
  // the last device of its namespace); it would notice within a second anyway.
  bool roce = false;
  shmrdma::DaemonPaths dp;
  if (shmrdma::Registry reg; shmrdma::Registry::attach(shmrdma::device_paths(home, name), &reg) == 0) {
    const auto& b = reg.device().net;
    roce = b.link_layer == shmrdma::layout::kLinkLayerEthernet;
    dp = shmrdma::daemon_paths(home, b.netns_dev, b.netns_ino);
  }
  if (int rc = shmrdma::device_down(home, name, force, &why); rc) {
    fmt::print(stderr, "shmrdma down: {}\n", why);
    return 1;
  }
  fmt::print("removed {}\n", name);
  if (roce) {
    std::string reply;
    if (shmrdma::daemon_request(dp, "refresh", &reply, 2000) == 0 && reply.find("devices=0") != std::string::npos) {
      const int pid = shmrdma::daemon_pid(dp);
      (void)shmrdma::daemon_request(dp, "stop", &reply, 2000);
      for (int i = 0; i < 100 && pid > 0 && shmrdma::daemon_pid(dp) == pid; ++i) ::usleep(20000);
      fmt::print("stopped shmrdmad (pid {}): no RoCE device left in its network namespace\n", pid);
    }
  }
  return 0;
}

int cmd_env(const std::string& home) {
  for (const auto& [k, v] : environment(home, sysfs_root(home)).vars) fmt::print("export {}={}\n", k, shell_quote(v));
  return 0;
}

// `shmrdma run --private-sys`: programs that read /sys/class/infiniband
// directly (UCX's GID type detection, pyverbs' device/net) see our tree
// there. In a private mount namespace (root only) /sys/class becomes a
// tmpfs holding bind mounts of every original class directory, plus
// infiniband and infiniband_verbs of `sysfs` (this namespace's view, whose
// links point into the state home). Nothing outside the program's own mount
// namespace changes.
int private_sys(const std::string& home, const std::string& sysfs, std::string* why) {
  if (::geteuid() != 0) {
    *why = "--private-sys needs root (a private mount namespace)";
    return EPERM;
  }
  const std::string ours = sysfs + "/class";
  if (::access((home + "/sys/class/infiniband").c_str(), F_OK) != 0 ||
      ::access((ours + "/infiniband").c_str(), F_OK) != 0) {
    *why = "no devices under " + home + " (shmrdma up first)";
    return ENOENT;
  }
  int orig = -1;
  auto fail = [&](const std::string& what) {
    *why = what + ": " + std::strerror(errno);
    int e = errno;
    if (orig >= 0) ::close(orig);
    return e;
  };
  if (::unshare(CLONE_NEWNS) != 0) return fail("unshare(CLONE_NEWNS)");
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return fail("making / private");
  // Opened in the new namespace: bind mounts take their source from it.
  if ((orig = ::open("/sys/class", O_PATH | O_DIRECTORY | O_CLOEXEC)) < 0) return fail("/sys/class");
  std::vector<std::string> classes;
  if (DIR* d = ::opendir(("/proc/self/fd/" + std::to_string(orig)).c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.' && std::strcmp(e->d_name, "infiniband") && std::strcmp(e->d_name, "infiniband_verbs"))
        classes.emplace_back(e->d_name);
    ::closedir(d);
  }
  if (::mount("tmpfs", "/sys/class", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755") != 0)
    return fail("mounting a tmpfs on /sys/class");
  const std::string from = "/proc/self/fd/" + std::to_string(orig) + "/";
  for (const std::string& c : classes) {
    const std::string to = "/sys/class/" + c;
    if (::mkdir(to.c_str(), 0755) != 0 || ::mount((from + c).c_str(), to.c_str(), nullptr, MS_BIND | MS_REC, nullptr))
      return fail("bind-mounting " + to);
  }
  for (const char* c : {"infiniband", "infiniband_verbs"}) {
    const std::string to = std::string("/sys/class/") + c;
    if (::mkdir(to.c_str(), 0755) != 0 || ::mount((ours + "/" + c).c_str(), to.c_str(), nullptr, MS_BIND, nullptr))
      return fail("bind-mounting " + to);
  }
  ::close(orig);
  return 0;
}

int cmd_run(const std::string& home, std::vector<std::string> argv) {
  bool priv = false;
  if (!argv.empty() && argv[0] == "--private-sys") {
    priv = true;
    argv.erase(argv.begin());
    if (!argv.empty() && argv[0] == "--") argv.erase(argv.begin());
  }
  if (argv.empty()) {
    fmt::print(stderr, "shmrdma run: no program given (usage: shmrdma run [--private-sys] [--] PROGRAM [ARGS...])\n");
    return 2;
  }
  const std::string sysfs = sysfs_root(home);
  if (std::string why; priv && private_sys(home, sysfs, &why) != 0) {
    fmt::print(stderr, "shmrdma run: {}\n", why);
    return 126;
  }
  for (const auto& [k, v] : environment(home, sysfs).vars) ::setenv(k.c_str(), v.c_str(), 1);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  ::execvp(args[0], args.data());
  fmt::print(stderr, "shmrdma run: cannot run {}: {}\n", argv[0], std::strerror(errno));
  return 127;
}

// The device's per-port counters (read now; the sysfs snapshot is rewritten
// on the way): {"counters": {...}, "hw_counters": {...}} per port.
nlohmann::json port_counters_json(shmrdma::Registry& reg, std::string* error) {
  std::vector<shmrdma::PortCounters> c;
  nlohmann::json out = nlohmann::json::array();
  if (int rc = shmrdma::refresh_counters(reg, &c); rc && c.empty()) {
    *error = std::strerror(rc);
    return out;
  }
  for (const auto& pc : c) {
    nlohmann::json ib = nlohmann::json::object(), hw = nlohmann::json::object();
    for (const auto& n : shmrdma::ib_counters(pc)) ib[n.name] = n.value;
    for (const auto& n : shmrdma::hw_counters(pc)) hw[n.name] = n.value;
    out.push_back({{"counters", ib}, {"hw_counters", hw}});
  }
  return out;
}

void print_port_counters(const nlohmann::json& pj) {
  if (!pj.contains("counters")) return;
  const auto& c = pj["counters"];
  const auto& h = pj["hw_counters"];
  fmt::print("    xmit {} pkts {} bytes, rcv {} pkts {} bytes; rnr_nak rcvd {} sent {}; retry_exc {} rnr_retry_exc {} "
             "send_err {}; ud dropped {} invalid {}; link_downed {}\n",
             c["port_xmit_packets"].get<uint64_t>(), h["sent_bytes"].get<uint64_t>(),
             c["port_rcv_packets"].get<uint64_t>(), h["rcvd_bytes"].get<uint64_t>(), h["rcvd_rnr_err"].get<uint64_t>(),
             h["send_rnr_err"].get<uint64_t>(), h["retry_exceeded_err"].get<uint64_t>(),
             h["retry_rnr_exceeded_err"].get<uint64_t>(), h["send_err"].get<uint64_t>(),
             h["rcvd_ud_dropped"].get<uint64_t>(), h["rcvd_ud_invalid"].get<uint64_t>(),
             c["link_downed"].get<uint64_t>());
}

int cmd_counters(const std::string& home, const std::string& only, bool json) {
  nlohmann::json out = nlohmann::json::array();
  int status = 0;
  for (const std::string& name : shmrdma::list_devices(home)) {
    if (!only.empty() && name != only) continue;
    shmrdma::Registry reg;
    nlohmann::json dj{{"name", name}};
    if (int rc = shmrdma::Registry::attach(shmrdma::device_paths(home, name), &reg); rc) {
      dj["error"] = std::strerror(rc);
      status = 1;
    } else {
      std::string err;
      nlohmann::json pc = port_counters_json(reg, &err);
      if (!err.empty()) {
        dj["error"] = err;
        status = 1;
      }
      dj["ports"] = nlohmann::json::array();
      for (size_t i = 0; i < pc.size(); ++i) {
        nlohmann::json pj = pc[i];
        pj["port"] = i + 1;
        dj["ports"].push_back(pj);
      }
    }
    out.push_back(dj);
  }
  if (!only.empty() && out.empty()) {
    fmt::print(stderr, "shmrdma counters: no device {} under {}\n", only, home);
    return 1;
  }
  if (json) {
    fmt::print("{}\n", nlohmann::json{{"home", home}, {"devices", out}}.dump(2));
    return status;
  }
  for (const auto& dj : out) {
    if (dj.contains("error")) {
      fmt::print("{}: cannot read counters ({})\n", dj["name"].get<std::string>(), dj["error"].get<std::string>());
      continue;
    }
    for (const auto& pj : dj["ports"]) {
      fmt::print("{} port {}:\n", dj["name"].get<std::string>(), pj["port"].get<int>());
      for (const char* kind : {"counters", "hw_counters"})
        for (const auto& [k, v] : pj[kind].items()) fmt::print("  {}/{} {}\n", kind, k, v.get<uint64_t>());
    }
  }
  return status;
}

const char* tier_why_name(uint16_t why) {
  switch (why) {
    case shmrdma::layout::kTierWhyDisabled: return "mapped tier off: SHMRDMA_MAPPED=0 or a sanitizer build";
    case shmrdma::layout::kTierWhyMemory: return "not private anonymous read-write memory";
    case shmrdma::layout::kTierWhyThreads: return "multi-threaded process and userfaultfd not permitted";
    case shmrdma::layout::kTierWhyKernel: return "the kernel refused the move";
    case shmrdma::layout::kTierWhyResources: return "out of regions, descriptors or memory";
    case shmrdma::layout::kTierWhyWindow: return "unbound memory window";
    case shmrdma::layout::kTierWhyOdp: return "on-demand paging (CMA only)";
    default: return "unknown";
  }
}

int cmd_status(const std::string& home, bool json) {
  nlohmann::json out = nlohmann::json::array();
  for (const std::string& name : shmrdma::list_devices(home)) {
    DevicePaths p = shmrdma::device_paths(home, name);
    shmrdma::Registry reg;
    nlohmann::json dj;
    dj["name"] = name;
    if (int rc = shmrdma::Registry::attach(p, &reg); rc) {
      dj["error"] = std::strerror(rc);
      out.push_back(dj);
      continue;
    }
    const auto& d = reg.device();
    dj["node_guid"] = shmrdma::guid_string(d.node_guid);
    dj["device_node"] = p.cdev;
    dj["ports"] = nlohmann::json::array();
    std::string cerr;
    nlohmann::json pc = port_counters_json(reg, &cerr);  // also refreshes the sysfs counter files
    if (!cerr.empty()) dj["counters_error"] = cerr;
    const bool eth = d.net.link_layer == shmrdma::layout::kLinkLayerEthernet;
    dj["link_layer"] = eth ? "Ethernet" : "InfiniBand";
    if (eth) {
      shmrdma::PortNetView v;
      (void)reg.port_net(1, &v);
      uint64_t dev = 0, ino = 0;
      const bool here = shmrdma::current_netns(&dev, &ino) == 0 && dev == d.net.netns_dev && ino == d.net.netns_ino;
      dj["netdev"] = {{"name", v.ifname},
                      {"ifindex", d.net.ifindex},
                      {"name_at_creation", d.net.ifname},
                      {"netns", std::to_string(d.net.netns_dev) + ":" + std::to_string(d.net.netns_ino)},
                      {"netns_is_ours", here},
                      {"present", (v.link & shmrdma::layout::kLinkPresent) != 0},
                      {"up", (v.link & shmrdma::layout::kLinkUp) != 0},
                      {"carrier", (v.link & shmrdma::layout::kLinkCarrier) != 0},
                      {"mtu", v.ifmtu},
                      {"speed_mbps", v.speed_mbps}};
      dj["gid_layout"] = d.net.gid_layout == shmrdma::layout::kGidLayoutMlx5 ? "mlx5" : "rxe";
      shmrdma::DaemonPaths dp = shmrdma::daemon_paths(home, d.net.netns_dev, d.net.netns_ino);
      const int pid = shmrdma::daemon_pid(dp);
      dj["daemon"] = {{"running", pid > 0}, {"pid", pid}, {"log", dp.log}, {"socket", dp.sock}};
    }
    for (uint32_t i = 0; i < d.num_ports; ++i) {
      shmrdma::PortNetView v;
      const int vrc = reg.port_net_settled(i + 1, &v);
      nlohmann::json pj = {{"port", i + 1}, {"lid", eth ? 0 : d.ports[i].lid},
                           {"state", reg.port_state(i + 1) == shmrdma::layout::kPortDown ? "DOWN" : "ACTIVE"},
                           {"gid0", "fe80::" + shmrdma::guid_string(d.ports[i].port_guid)}};
      if (vrc == 0) {
        pj["phys_state"] = v.phys_state == 5 ? "LINK_UP" : "DISABLED";
        pj["active_mtu"] = std::stoi(mtu_text(v.active_mtu));
        pj["gids"] = nlohmann::json::array();
        for (uint32_t g = 0; g < shmrdma::limits::kGidTableLen; ++g)
          if (v.valid(g))
            pj["gids"].push_back({{"index", g}, {"gid", shmrdma::gid_short_text(v.gids[g].gid)},
                                  {"type", v.gids[g].type == shmrdma::layout::kGidTypeRoceV2 ? "RoCE v2"
                                           : v.gids[g].type == shmrdma::layout::kGidTypeRoceV1 ? "RoCE v1"
                                                                                               : "IB"}});
        if (eth && !pj["gids"].empty()) pj["gid0"] = pj["gids"][0]["gid"];
      }
      if (i < pc.size()) {
        pj["counters"] = pc[i]["counters"];
        pj["hw_counters"] = pc[i]["hw_counters"];
      }
      dj["ports"].push_back(pj);
    }
    dj["processes"] = nlohmann::json::array();
    for (const auto& c : reg.live_contexts()) {
      nlohmann::json cj;
      cj["pid"] = c.pid;
      cj["command"] = comm_of(c.pid);
      cj["context_slot"] = c.slot;
      shmrdma::ContextObjects o;
      if (int rc = shmrdma::inspect_context(p, c, &o); rc) {
        cj["error"] = std::strerror(rc);
      } else {
        cj["objects"] = {{"pd", o.pds},   {"cq", o.cqs},   {"wq", o.wqs}, {"rwq_ind_table", o.ind_tables},
                         {"qp", o.qps},   {"srq", o.srqs}, {"mr", o.mrs}, {"mw", o.mws},
                         {"ah", c.held[shmrdma::layout::kObjAh]}};
        cj["wqs"] = nlohmann::json::array();
        for (const auto& w : o.wq_list)
          cj["wqs"].push_back({{"wq_num", w.wq_num}, {"state", wq_state_name(w.state)}, {"max_wr", w.capacity},
                               {"max_sge", w.max_sge}});
        cj["mrs"] = nlohmann::json::array();
        for (const auto& m : o.mr_list) {
          nlohmann::json mj = {{"index", m.index}, {"rkey", m.rkey}, {"length", m.length},
                               {"tier", m.tier == shmrdma::layout::kTierMapped ? "mapped" : "cma"}};
          if (m.tier != shmrdma::layout::kTierMapped) mj["why"] = tier_why_name(m.tier_why);
          cj["mrs"].push_back(mj);
        }
      }
      dj["processes"].push_back(cj);
    }
    out.push_back(dj);
  }
  if (json) {
    fmt::print("{}\n", nlohmann::json{{"home", home}, {"devices", out}}.dump(2));
    return 0;
  }
  if (out.empty()) {
    fmt::print("no shmrdma devices under {} (start one with: shmrdma up)\n", home);
    return 0;
  }
  for (const auto& dj : out) {
    if (dj.contains("error")) {
      fmt::print("{}: unusable registry ({})\n", dj["name"].get<std::string>(), dj["error"].get<std::string>());
      continue;
    }
    fmt::print("{}: node GUID {}, device node {}\n", dj["name"].get<std::string>(),
               dj["node_guid"].get<std::string>(), dj["device_node"].get<std::string>());
    const bool eth = dj["link_layer"] == "Ethernet";
    if (eth) {
      const auto& nd = dj["netdev"];
      fmt::print("  RoCE on {} (ifindex {}{}): {}{}, MTU {}, GID layout {}\n",
                 nd["present"].get<bool>() ? nd["name"].get<std::string>() : nd["name_at_creation"].get<std::string>(),
                 nd["ifindex"].get<uint32_t>(), nd["netns_is_ours"].get<bool>() ? "" : ", another network namespace",
                 !nd["present"].get<bool>() ? "interface gone" : nd["up"].get<bool>() ? "up" : "down",
                 nd["present"].get<bool>() && nd["up"].get<bool>() && !nd["carrier"].get<bool>() ? ", no carrier" : "",
                 nd["mtu"].get<uint32_t>(), dj["gid_layout"].get<std::string>());
      const auto& dm = dj["daemon"];
      if (dm["running"].get<bool>())
        fmt::print("  followed by shmrdmad pid {} (log {})\n", dm["pid"].get<int>(), dm["log"].get<std::string>());
      else
        fmt::print("  shmrdmad is not running: the device does not follow {} (`shmrdma up --name {} --netdev {}` "
                   "in its namespace restarts it; log {})\n",
                   nd["name"].get<std::string>(), dj["name"].get<std::string>(), nd["name"].get<std::string>(),
                   dm["log"].get<std::string>());
    }
    for (const auto& pj : dj["ports"]) {
      if (eth) {
        fmt::print("  port {}: {} ({}), active_mtu {}\n", pj["port"].get<int>(), pj["state"].get<std::string>(),
                   pj.value("phys_state", std::string("?")), pj.value("active_mtu", 0));
        for (const auto& g : pj.value("gids", nlohmann::json::array()))
          fmt::print("    GID[{}] {}, {}\n", g["index"].get<int>(), g["gid"].get<std::string>(),
                     g["type"].get<std::string>());
      } else {
        fmt::print("  port {}: {} LID {} GID[0] {}\n", pj["port"].get<int>(), pj["state"].get<std::string>(),
                   pj["lid"].get<int>(), pj["gid0"].get<std::string>());
      }
      print_port_counters(pj);
    }
    if (dj.contains("counters_error"))
      fmt::print("  counters unreadable ({})\n", dj["counters_error"].get<std::string>());
    if (dj["processes"].empty()) fmt::print("  no open contexts\n");
    for (const auto& cj : dj["processes"]) {
      fmt::print("  pid {} ({})", cj["pid"].get<uint32_t>(), cj["command"].get<std::string>());
      if (cj.contains("error")) {
        fmt::print(": segment unreadable ({})\n", cj["error"].get<std::string>());
        continue;
      }
      const auto& o = cj["objects"];
      fmt::print(": {} PD, {} CQ, {} WQ, {} RWQ_IND_TABLE, {} QP, {} SRQ, {} MR, {} MW, {} AH\n", o["pd"].get<int>(),
                 o["cq"].get<int>(), o["wq"].get<int>(), o["rwq_ind_table"].get<int>(), o["qp"].get<int>(),
                 o["srq"].get<int>(), o["mr"].get<int>(), o["mw"].get<int>(), o["ah"].get<int>());
      for (const auto& w : cj["wqs"])
        fmt::print("    WQ {:#x}: {} max_wr {} max_sge {}\n", w["wq_num"].get<uint32_t>(),
                   w["state"].get<std::string>(), w["max_wr"].get<uint32_t>(), w["max_sge"].get<uint32_t>());
      for (const auto& m : cj["mrs"])
        fmt::print("    MR rkey {:#x}: {} bytes, {} tier{}\n", m["rkey"].get<uint32_t>(), m["length"].get<uint64_t>(),
                   m["tier"].get<std::string>(), m.contains("why") ? " (" + m["why"].get<std::string>() + ")" : "");
    }
  }
  return 0;
}

int cmd_port(const std::string& home, const std::string& name, uint32_t port, bool up) {
  std::string why;
  int notified = 0;
  if (int rc = shmrdma::port_set_state(home, name, port, up, &notified, &why)) {
    fmt::print(stderr, "shmrdma port: {}\n", why.empty() ? std::strerror(rc) : why);
    return 1;
  }
  fmt::print("{} port {}: {} ({} process(es) notified)\n", name, port, up ? "ACTIVE" : "DOWN", notified);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmrdma: a software RDMA device in user space, over shared memory"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("shmrdma ") + SHMRDMA_VERSION, "print the version and exit");
  std::string home = shmrdma::state_home();
  app.add_option("--home", home, "state directory (default: $SHMRDMA_HOME, /run/shmrdma for root, "
                                 "$XDG_RUNTIME_DIR/shmrdma otherwise)");

  std::string name = "shm0";
  uint32_t ports = 0;
  bool force = false, json = false;
  std::vector<std::string> program;

  auto* up = app.add_subcommand("up", "create the device (idempotent) and reclaim what dead processes left");
  up->add_option("--name", name, "device name")->capture_default_str();
  up->add_option("--ports", ports, "number of ports (default 1)")->check(CLI::Range(1u, shmrdma::limits::kMaxPorts));
  std::string netdev, gid_layout = "rxe";
  up->add_option("--netdev", netdev,
                 "make a RoCE device bound to this network interface of this network namespace "
                 "(Ethernet link layer, GIDs from its addresses); without it the device is InfiniBand");
  up->add_option("--gid-layout", gid_layout, "GID table layout of a RoCE device: rxe (RoCE v2 entries) or mlx5 "
                                             "(v1/v2 pairs)")
      ->check(CLI::IsMember({"rxe", "mlx5"}))
      ->capture_default_str();
  auto* down = app.add_subcommand("down", "remove a device");
  down->add_option("--name", name, "device name")->capture_default_str();
  down->add_flag("--force", force, "remove it even while processes use it");
  auto* env = app.add_subcommand("env", "print export lines for eval, to use the devices from this shell");
  auto* run = app.add_subcommand("run", "run [--private-sys] PROGRAM [ARGS...] with the environment that loads "
                                      "shmrdma (--private-sys, root: /sys/class/infiniband shows our devices, in a "
                                      "private mount namespace)");
  auto* port = app.add_subcommand("port", "take a port down or up (port state, sysfs, IBV_EVENT_PORT_ERR/ACTIVE)");
  uint32_t port_num = 1;
  std::string port_state;
  port->add_option("--name", name, "device name")->capture_default_str();
  port->add_option("--port", port_num, "port number")->capture_default_str();
  port->add_option("state", port_state, "down or up")->required()->check(CLI::IsMember({"down", "up"}));
  auto* status = app.add_subcommand("status", "list devices, their ports with counters, processes and objects");
  status->add_flag("--json", json, "machine-readable output");
  auto* counters = app.add_subcommand("counters", "per-port counters (also rewrites the sysfs counter files)");
  std::string only;
  counters->add_option("--name", only, "only this device");
  counters->add_flag("--json", json, "machine-readable output");

  // `run` takes the rest of the command line verbatim (options included), so
  // it is split off before CLI11 sees it.
  int cli_argc = argc;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--home") {
      ++i;
      continue;
    }
    if (a.rfind("--home=", 0) == 0) continue;
    if (a == "run") {
      cli_argc = i + 1;
      int first = i + 1;
      if (first < argc && std::string(argv[first]) == "--") ++first;
      for (int k = first; k < argc; ++k) program.emplace_back(argv[k]);
    }
    break;
  }
  try {
    app.parse(cli_argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (*up) {
    if (netdev.empty() && up->count("--gid-layout")) {
      fmt::print(stderr, "shmrdma up: --gid-layout needs --netdev (it is the layout of a RoCE device)\n");
      return 2;
    }
    return cmd_up(home, name, ports, netdev, gid_layout, up->count("--gid-layout") > 0);
  }
  if (*down) return cmd_down(home, name, force);
  if (*env) return cmd_env(home);
  if (*run) return cmd_run(home, program);
  if (*status) return cmd_status(home, json);
  if (*port) return cmd_port(home, name, port_num, port_state == "up");
  if (*counters) return cmd_counters(home, only, json);
  return 2;
}
