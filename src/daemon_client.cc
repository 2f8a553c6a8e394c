#include "daemon_client.h"

#include <dirent.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "proc.h"
#include "segment.h"

namespace shmrdma {

namespace {

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

}  // namespace

DaemonPaths daemon_paths(const std::string& home, uint64_t netns_dev, uint64_t netns_ino) {
  DaemonPaths d;
  d.dir = home + "/daemon";
  const std::string base = d.dir + "/netns-" + std::to_string(netns_dev) + "-" + std::to_string(netns_ino);
  d.lock = base + ".lock";
  d.pid = base + ".pid";
  d.sock = base + ".sock";
  d.log = base + ".log";
  d.netns_dev = netns_dev;
  d.netns_ino = netns_ino;
  return d;
}

int current_netns(uint64_t* dev, uint64_t* ino) noexcept {
  struct stat st{};
  if (::stat("/proc/self/ns/net", &st) != 0) return errno;
  *dev = st.st_dev;
  *ino = st.st_ino;
  return 0;
}

int daemon_request(const DaemonPaths& d, const std::string& request, std::string* reply, int timeout_ms) noexcept {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (d.sock.size() >= sizeof addr.sun_path) return ENAMETOOLONG;
  std::memcpy(addr.sun_path, d.sock.c_str(), d.sock.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return errno;
  int rc = 0;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
    rc = errno;
    ::close(fd);
    return rc;
  }
  const int64_t deadline = now_ms() + timeout_ms;
  const std::string line = request + "\n";
  size_t sent = 0;
  std::string got;
  while (rc == 0) {
    const int64_t left = deadline - now_ms();
    if (left <= 0) {
      rc = ETIMEDOUT;
      break;
    }
    pollfd p{fd, static_cast<short>(sent < line.size() ? POLLOUT : POLLIN), 0};
    int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    if (sent < line.size()) {
      ssize_t w = ::send(fd, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
      if (w < 0) rc = (errno == EAGAIN || errno == EINTR) ? 0 : errno;
      else sent += static_cast<size_t>(w);
      continue;
    }
    char buf[512];
    ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r < 0) {
      if (errno != EAGAIN && errno != EINTR) rc = errno;
      continue;
    }
    if (r == 0) {
      rc = ECONNRESET;
      break;
    }
    got.append(buf, static_cast<size_t>(r));
    if (auto nl = got.find('\n'); nl != std::string::npos) {
      if (reply) *reply = got.substr(0, nl);
      break;
    }
    if (got.size() > 4096) rc = EPROTO;
  }
  ::close(fd);
  return rc;
}

int daemon_pid(const DaemonPaths& d) noexcept {
  std::string text;
  if (read_small_file(d.pid, &text) != 0) return 0;
  long long pid = 0;
  unsigned long long start = 0;
  if (std::sscanf(text.c_str(), "%lld %llu", &pid, &start) != 2 || pid <= 0 || pid > (1ll << 30)) return 0;
  return process_alive(static_cast<pid_t>(pid), start) ? static_cast<int>(pid) : 0;
}

std::vector<DaemonPaths> list_daemons(const std::string& home) {
  std::vector<DaemonPaths> out;
  DIR* dir = ::opendir((home + "/daemon").c_str());
  if (!dir) return out;
  while (dirent* e = ::readdir(dir)) {
    unsigned long long dev = 0, ino = 0;
    char tail[8] = {};
    if (std::sscanf(e->d_name, "netns-%llu-%llu.%7s", &dev, &ino, tail) != 3 || std::strcmp(tail, "pid") != 0)
      continue;
    out.push_back(daemon_paths(home, dev, ino));
  }
  ::closedir(dir);
  return out;
}

}  // namespace shmrdma
