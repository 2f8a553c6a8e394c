#include "netns.h"

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>
#include <sstream>

namespace harness {

namespace fs = std::filesystem;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string slurp_trimmed(const std::string& path) {
  std::string s = slurp(path);
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

namespace {

// What the signal handler runs: set up by NetnsPair::write_cleanup. Only one
// pair is live at a time (tests of a binary run one after the other).
char g_cleanup[8192];
pid_t g_kill_first[64];
int g_kill_count = 0;

// Kills pid only while it is an unreaped child of ours (running: waitpid
// says 0), so a pid the system gave to someone else is never signalled.
// waitpid and kill are async-signal-safe.
void kill_if_our_child(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, WNOHANG) == 0) ::kill(pid, SIGKILL);
}

bool is_our_child(pid_t pid) {
  siginfo_t info{};
  return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0;
}

void on_fatal_signal(int) {
  for (int i = 0; i < g_kill_count; ++i) kill_if_our_child(g_kill_first[i]);
  const char* argv[] = {"/bin/sh", "-c", g_cleanup, nullptr};
  ::execv("/bin/sh", const_cast<char* const*>(argv));
  ::_exit(1);
}

}  // namespace

std::string NetnsPair::ip(std::vector<std::string> args) const {
  args.insert(args.begin(), "ip");
  Result r = run(args);
  if (r.ok()) return "";
  std::string shown;
  for (const auto& a : args) shown += (shown.empty() ? "" : " ") + a;
  return shown + ": " + r.describe();
}

std::vector<std::string> NetnsPair::in_ns(const std::string& ns, std::vector<std::string> args) const {
  if (ns.empty()) return args;
  args.insert(args.begin(), {"ip", "netns", "exec", ns});
  return args;
}

std::vector<std::string> NetnsPair::shm_cmd(const std::string& ns, std::vector<std::string> args) const {
  args.insert(args.begin(), {bin, "--home", home});
  return in_ns(ns, std::move(args));
}

Result NetnsPair::shm(const std::string& ns, std::vector<std::string> args, int timeout_ms) const {
  return run(shm_cmd(ns, std::move(args)), timeout_ms);
}

std::vector<std::string> NetnsPair::app(const std::string& ns, std::vector<std::string> args) const {
  args.insert(args.begin(), {"run", "--"});
  return shm_cmd(ns, std::move(args));
}

std::vector<pid_t> NetnsPair::daemon_pids() const {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(home + "/daemon", ec)) {
    if (e.path().extension() != ".pid") continue;
    const long pid = std::atol(slurp(e.path()).c_str());
    if (pid > 1) out.push_back(static_cast<pid_t>(pid));
  }
  return out;
}

std::string NetnsPair::daemon_logs() const {
  std::string all;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(home + "/daemon", ec))
    if (e.path().extension() == ".log") all += "--- " + e.path().string() + "\n" + slurp(e.path());
  return all;
}

void NetnsPair::write_cleanup() {
  // Daemons by their pid files, devices down from where they were made
  // (their device nodes are in the machine-wide /dev), namespaces, home.
  std::snprintf(g_cleanup, sizeof g_cleanup,
                "for f in %s/daemon/*.pid; do [ -f \"$f\" ] && kill -9 $(cut -d' ' -f1 \"$f\"); done; "
                "for d in %s/devices/*; do [ -d \"$d\" ] || continue; n=$(basename \"$d\"); "
                "for ns in %s %s; do ip netns exec $ns %s --home %s down --force --name $n; done; "
                "%s --home %s down --force --name $n; done; "
                "ip netns del %s; ip netns del %s; rm -rf %s; exit 1",
                home.c_str(), home.c_str(), ns_a.c_str(), ns_b.c_str(), bin.c_str(), home.c_str(), bin.c_str(),
                home.c_str(), ns_a.c_str(), ns_b.c_str(), home.c_str());
  g_kill_count = 0;
  for (pid_t p : kill_first_)
    if (g_kill_count < static_cast<int>(sizeof g_kill_first / sizeof g_kill_first[0]))
      g_kill_first[g_kill_count++] = p;
}

void NetnsPair::also_kill(pid_t pid) {
  std::erase_if(kill_first_, [](pid_t p) { return !is_our_child(p); });  // reaped meanwhile
  kill_first_.push_back(pid);
  if (made_) write_cleanup();
}

std::string NetnsPair::make(const NetnsOptions& o, const std::string& shmrdma_bin) {
  bin = shmrdma_bin;
  const std::string id = std::to_string(::getpid());
  ns_a = "shmrdma-" + o.tag + id + "a";
  ns_b = "shmrdma-" + o.tag + id + "b";
  if_a = o.if_prefix + "A" + id;
  if_b = o.if_prefix + "B" + id;
  net = o.net16 + "." + std::to_string(::getpid() % 250 + 1) + ".";
  a = net + "1";
  b = net + "2";
  std::string tmpl = "/tmp/shmrdma-" + o.tag + "-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) return "mkdtemp " + tmpl + ": " + std::strerror(errno);
  home = tmpl;
  made_ = true;
  write_cleanup();
  ::signal(SIGTERM, on_fatal_signal);
  ::signal(SIGINT, on_fatal_signal);
  ::signal(SIGPIPE, SIG_IGN);
  for (const std::vector<std::string>& step : std::vector<std::vector<std::string>>{
           {"netns", "add", ns_a},
           {"netns", "add", ns_b},
           {"link", "add", if_a, "type", "veth", "peer", "name", if_b},
           {"link", "set", if_a, "netns", ns_a},
           {"link", "set", if_b, "netns", ns_b},
           {"-n", ns_a, "addr", "add", a + "/24", "dev", if_a},
           {"-n", ns_b, "addr", "add", b + "/24", "dev", if_b},
           {"-n", ns_a, "link", "set", if_a, "up"},
           {"-n", ns_b, "link", "set", if_b, "up"},
           {"-n", ns_a, "link", "set", "lo", "up"},
           {"-n", ns_b, "link", "set", "lo", "up"},
       })
    if (std::string e = ip(step); !e.empty()) return e;
  return "";
}

void NetnsPair::remove() {
  if (!made_) return;
  made_ = false;
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  for (pid_t p : kill_first_) kill_if_our_child(p);
  kill_first_.clear();
  g_kill_count = 0;
  // Devices first, from the namespace they were made in, then whatever
  // daemon is left.
  for (const auto& ns : {ns_a, ns_b, std::string()}) {
    std::error_code ec;
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(home + "/devices", ec)) names.push_back(e.path().filename().string());
    for (const auto& n : names) (void)shm(ns, {"down", "--force", "--name", n});
  }
  for (pid_t p : daemon_pids()) ::kill(p, SIGKILL);
  run({"ip", "netns", "del", ns_a});
  run({"ip", "netns", "del", ns_b});
  std::error_code ec;
  fs::remove_all(home, ec);
}

void NetnsTest::SetUp() {
  if (::geteuid() != 0) GTEST_SKIP() << "not root: the test makes network namespaces and veth interfaces";
  if (!run({"ip", "-V"}).ok()) GTEST_SKIP() << "the `ip` command (iproute2) is not installed";
  const std::string bin = getenv_str("SHMRDMA_BIN");
  ASSERT_FALSE(bin.empty()) << "meson passes SHMRDMA_BIN";
  const std::string e = net_pair_.make(options_, bin);
  ASSERT_EQ(e, "") << "setting up the namespaces failed";
}

void NetnsTest::TearDown() {
  if (!net_pair_.made()) return;
  if (HasFailure()) std::printf("%s", net_pair_.daemon_logs().c_str());
  net_pair_.remove();
}

}  // namespace harness
