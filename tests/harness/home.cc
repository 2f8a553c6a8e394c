#include "home.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace harness {

namespace {
constexpr const char* kHomePrefix = "shmrdma-";
constexpr const char* kDevice = "shm0";
}  // namespace

Home& Home::get() {
  static Home h;
  return h;
}

Result Home::shmrdma(const std::vector<std::string>& args, int timeout_ms) const {
  std::vector<std::string> argv = {bin(), "--home", path_};
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv, timeout_ms);
}

std::vector<std::string> Home::run_argv(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {bin(), "--home", path_, "run", "--"};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

nlohmann::json Home::status() const {
  Result r = shmrdma({"status", "--json"});
  if (!r.ok()) {
    ADD_FAILURE() << "shmrdma status --json failed: " << r.describe();
    return nullptr;
  }
  try {
    return nlohmann::json::parse(r.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "shmrdma status --json printed invalid JSON (" << e.what() << "):\n" << r.out;
    return nullptr;
  }
}

nlohmann::json Home::find_process(const nlohmann::json& status, long long pid, const std::string& dev) {
  if (!status.is_object() || !status.contains("devices")) return nullptr;
  for (const auto& d : status["devices"]) {
    if (d.value("name", "") != dev || !d.contains("processes")) continue;
    for (const auto& p : d["processes"])
      if (p.value("pid", -1LL) == pid) return p;
  }
  return nullptr;
}

std::vector<long long> Home::pids(const nlohmann::json& status, const std::string& dev) {
  std::vector<long long> out;
  if (!status.is_object() || !status.contains("devices")) return out;
  for (const auto& d : status["devices"])
    if (d.value("name", "") == dev && d.contains("processes"))
      for (const auto& p : d["processes"]) out.push_back(p.value("pid", -1LL));
  return out;
}

std::vector<std::string> Home::ctx_files(const std::string& dev) const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(path_ + "/devices/" + dev, ec)) {
    std::string n = e.path().filename().string();
    if (n.rfind("ctx-", 0) == 0) out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> Home::ctx_segments(const std::string& dev) const {
  std::vector<std::string> out;
  for (const std::string& n : ctx_files(dev))
    if (n.find_first_not_of("0123456789-", 4) == std::string::npos) out.push_back(n);
  return out;
}

bool Home::up_device(const std::string& name, std::string* why) {
  if (std::find(extra_.begin(), extra_.end(), name) != extra_.end()) return true;
  Result r = shmrdma({"up", "--name", name});
  if (!r.ok()) {
    *why = "shmrdma up --name " + name + " failed: " + r.describe();
    return false;
  }
  extra_.push_back(name);
  return true;
}

// A test binary that crashed never ran its teardown: bring down and remove
// the homes of test processes that are gone (/tmp/shmrdma-<tag>-<pid>-*).
void Home::sweep_stale_homes() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/tmp", ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(kHomePrefix, 0) != 0) continue;
    const size_t tag_end = n.find('-', std::strlen(kHomePrefix));
    if (tag_end == std::string::npos) continue;
    const size_t pid_end = n.find('-', tag_end + 1);
    if (pid_end == std::string::npos) continue;
    const std::string pid_str = n.substr(tag_end + 1, pid_end - tag_end - 1);
    if (pid_str.empty() || pid_str.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t owner = static_cast<pid_t>(std::stol(pid_str));
    if (owner == ::getpid() || ::kill(owner, 0) == 0 || errno != ESRCH) continue;
    if (!e.is_directory(ec) || !std::filesystem::exists(e.path() / "devices", ec)) continue;
    for (const auto& d : std::filesystem::directory_iterator(e.path() / "devices", ec))
      run({bin(), "--home", e.path().string(), "down", "--name", d.path().filename().string(), "--force"});
    std::filesystem::remove_all(e.path(), ec);
  }
}

void Home::setup(const HomeOptions& options) {
  ::signal(SIGPIPE, SIG_IGN);  // a child that died must not kill the test
  const std::string not_root = "not root: `shmrdma up` must create the device node under /dev/infiniband";
  if (options.root_only && ::geteuid() != 0) {
    skip_ = not_root;
    std::printf("SKIP: %s\n", skip_.c_str());
    return;
  }
  if (bin().empty()) {
    fail_ = "SHMRDMA_BIN is not set (meson passes the path of the shmrdma executable)";
    return;
  }
  sweep_stale_homes();
  std::string tmpl = "/tmp/" + std::string(kHomePrefix) + options.tag + "-" + std::to_string(::getpid()) + "-XXXXXX";
  if (!::mkdtemp(tmpl.data())) {
    fail_ = std::string("mkdtemp: ") + std::strerror(errno);
    return;
  }
  path_ = tmpl;
  Result up = shmrdma({"up", "--name", kDevice});
  if (!up.ok()) {
    const bool cdev_problem = up.exit_code == 2 && up.err.find("device node") != std::string::npos;
    if (cdev_problem && ::geteuid() != 0)
      skip_ = not_root + " (create it once as root, see the hint):\n" + up.err;
    else
      fail_ = "`shmrdma --home " + path_ + " up --name shm0` failed: " + up.describe();
    return;
  }
  Result env = shmrdma({"env"});
  if (!env.ok()) {
    fail_ = "`shmrdma env` failed: " + env.describe();
    return;
  }
  const std::string kExport = "export ";
  size_t pos = 0;
  while (pos < env.out.size()) {
    size_t nl = env.out.find('\n', pos);
    if (nl == std::string::npos) nl = env.out.size();
    const std::string line = env.out.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.rfind(kExport, 0) != 0) continue;
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    ::setenv(line.substr(kExport.size(), eq - kExport.size()).c_str(), shell_unquote(line.substr(eq + 1)).c_str(), 1);
  }
  for (const char* k : {"SYSFS_PATH", "RDMAV_DRIVERS"}) {
    if (getenv_str(k).empty()) {
      fail_ = std::string("`shmrdma env` did not export ") + k + ":\n" + env.out;
      return;
    }
  }
  ok_ = true;
}

void Home::teardown() {
  if (path_.empty()) return;
  extra_.push_back(kDevice);
  for (const auto& d : extra_) {
    Result r = shmrdma({"down", "--force", "--name", d});
    if (ok_ && !r.ok()) ADD_FAILURE() << "shmrdma down --force --name " << d << " failed: " << r.describe();
  }
  extra_.clear();
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
  path_.clear();
}

int run_tests_as_root(int argc, char** argv) {
  if (::geteuid() != 0) {
    std::printf("SKIP: not root: `shmrdma up` must create the device node under /dev/infiniband\n");
    return 77;  // meson: skipped
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

Result run_worker_pair(const std::vector<std::string>& extra, int seconds) {
  auto& home = Home::get();
  const std::string exe = self_exe();
  std::vector<std::string> owner_args = {exe, "--worker", "owner"}, peer_args = {exe, "--worker", "peer"};
  owner_args.insert(owner_args.end(), extra.begin(), extra.end());
  peer_args.insert(peer_args.end(), extra.begin(), extra.end());
  Child owner, peer;
  if (!start_pair(owner, home.run_argv(owner_args), peer, home.run_argv(peer_args))) {
    ADD_FAILURE() << "the pair did not start: " << owner.output() << peer.output();
    return Result{};
  }
  const auto deadline = Clock::now() + std::chrono::seconds(seconds);
  Result o = owner.wait(deadline);
  Result p = peer.wait(std::min(deadline, Clock::now() + std::chrono::seconds(10)));
  std::printf("--- owner ---\n%s--- peer ---\n%s", o.out.c_str(), p.out.c_str());
  EXPECT_TRUE(o.ok()) << "owner: " << o.describe();
  EXPECT_TRUE(p.ok()) << "peer: " << p.describe();
  nlohmann::json st = home.status();
  for (const auto& d : st["devices"]) EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
  return o;
}

}  // namespace harness
