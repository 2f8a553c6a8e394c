// The `shmrdma` command: device lifecycle (up, down), the environment that
// makes the stock libibverbs load our plugin (env, run), and status.
#include <fcntl.h>
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
#include "device_setup.h"
#include "paths.h"
#include "proc.h"
#include "registry.h"
#include "segment.h"

namespace {

using shmrdma::DevicePaths;

constexpr const char* kPluginFile = "libshmrdma-rdmav34.so";

std::string dirname_of(const std::string& p) {
  auto pos = p.find_last_of('/');
  return pos == std::string::npos ? "." : (pos == 0 ? "/" : p.substr(0, pos));
}

bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

// The plugin is found relative to this executable, so a private --prefix
// install (or the build tree) works without configuration.
std::string plugin_dir() {
  if (const char* d = std::getenv("SHMRDMA_PROVIDER_DIR"); d && *d) return d;
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  std::string exe_dir = dirname_of(buf);
  std::string build_tree = dirname_of(exe_dir) + "/providers/shmrdma";
  if (exists(build_tree + "/" + kPluginFile)) return build_tree;
  // <prefix>/<bindir>/shmrdma -> <prefix>/<plugin_subdir>
  std::string prefix = exe_dir;
  std::string bindir = SHMRDMA_BINDIR;
  for (size_t i = 0; i <= bindir.size(); ++i)
    if (i == bindir.size() || bindir[i] == '/') prefix = dirname_of(prefix);
  return prefix + "/" + SHMRDMA_PLUGIN_SUBDIR;
}

// The shim that makes completion channels work (tools/shim): next to the
// plugin once installed, in tools/shim of the build tree.
constexpr const char* kShimFile = "libshmrdma-shim.so";
std::string shim_path() {
  if (std::string p = plugin_dir() + "/" + kShimFile; exists(p)) return p;
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = '\0';
  std::string p = dirname_of(buf) + "/shim/" + kShimFile;
  return exists(p) ? p : "";
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

Env environment(const std::string& home) {
  Env e;
  std::string drivers = plugin_dir() + "/libshmrdma";
  if (const char* old = std::getenv("RDMAV_DRIVERS"); old && *old) {
    std::string o = old;
    if (o.find(drivers) == std::string::npos) drivers += ":" + o;
    else drivers = o;
  }
  e.vars = {{"SHMRDMA_HOME", home}, {"SYSFS_PATH", home + "/sys"}, {"RDMAV_DRIVERS", drivers}};
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

int cmd_up(const std::string& home, const std::string& name, uint32_t ports) {
  shmrdma::UpResult r;
  std::string why;
  int rc = shmrdma::device_up(home, name, ports, &r, &why);
  if (rc) {
    fmt::print(stderr, "shmrdma up: {}\n", why);
    return 1;
  }
  DevicePaths p = shmrdma::device_paths(home, name);
  shmrdma::Registry reg;
  if (shmrdma::Registry::attach(p, &reg) == 0) {
    const auto& d = reg.device();
    fmt::print("{} {}: node GUID {}, {} port(s), LID", r.created ? "created" : "up", name,
               shmrdma::guid_string(d.node_guid), d.num_ports);
    for (uint32_t i = 0; i < d.num_ports; ++i) fmt::print(" {}", d.ports[i].lid);
    fmt::print("\n");
  }
  if (r.reclaimed) fmt::print("reclaimed {} context(s) of dead processes\n", r.reclaimed);
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
  if (int rc = shmrdma::device_down(home, name, force, &why); rc) {
    fmt::print(stderr, "shmrdma down: {}\n", why);
    return 1;
  }
  fmt::print("removed {}\n", name);
  return 0;
}

int cmd_env(const std::string& home) {
  for (const auto& [k, v] : environment(home).vars) fmt::print("export {}={}\n", k, shell_quote(v));
  return 0;
}

int cmd_run(const std::string& home, std::vector<std::string> argv) {
  if (argv.empty()) {
    fmt::print(stderr, "shmrdma run: no program given (usage: shmrdma run [--] PROGRAM [ARGS...])\n");
    return 2;
  }
  for (const auto& [k, v] : environment(home).vars) ::setenv(k.c_str(), v.c_str(), 1);
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
    for (uint32_t i = 0; i < d.num_ports; ++i) {
      nlohmann::json pj = {{"port", i + 1}, {"lid", d.ports[i].lid},
                           {"state", reg.port_state(i + 1) == shmrdma::layout::kPortDown ? "DOWN" : "ACTIVE"},
                           {"gid0", "fe80::" + shmrdma::guid_string(d.ports[i].port_guid)}};
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
    for (const auto& pj : dj["ports"]) {
      fmt::print("  port {}: {} LID {} GID[0] {}\n", pj["port"].get<int>(), pj["state"].get<std::string>(),
                 pj["lid"].get<int>(), pj["gid0"].get<std::string>());
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
  auto* down = app.add_subcommand("down", "remove a device");
  down->add_option("--name", name, "device name")->capture_default_str();
  down->add_flag("--force", force, "remove it even while processes use it");
  auto* env = app.add_subcommand("env", "print export lines for eval, to use the devices from this shell");
  auto* run = app.add_subcommand("run", "run PROGRAM [ARGS...] with the environment that loads shmrdma");
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
  if (*up) return cmd_up(home, name, ports);
  if (*down) return cmd_down(home, name, force);
  if (*env) return cmd_env(home);
  if (*run) return cmd_run(home, program);
  if (*status) return cmd_status(home, json);
  if (*port) return cmd_port(home, name, port_num, port_state == "up");
  if (*counters) return cmd_counters(home, only, json);
  return 2;
}
