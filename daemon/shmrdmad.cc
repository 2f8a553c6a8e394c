// shmrdmad: the per-(state home, network namespace) daemon. Today it follows
// the interfaces RoCE devices are bound to: a route-netlink socket (libnl)
// subscribed to link and address changes; on any change (and once a second
// as a safety net) it re-reads each interface and publishes the port record
// (GID table, MTU, carrier) through Registry::update_port_net, rewrites the
// sysfs files and raises IBV_EVENT_GID_CHANGE / PORT_ACTIVE / PORT_ERR in
// every open context (device_setup.h apply_port_net).
//
// It is never on a data path: killing it stops only the following of the
// interface (`shmrdma up` restarts it). Control requests come over a unix
// socket in <home>/daemon/ (src/daemon_client.h) from the same uid only;
// anything malformed gets an error line and the connection closed. The
// request table (handlers_) is where RDMA CM (issue 11) will add its own.
//
// Usage: shmrdmad --home DIR [--foreground]
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <netlink/netlink.h>
#include <netlink/socket.h>
#include <linux/rtnetlink.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cm.h"
#include "daemon_client.h"
#include "device_setup.h"
#include "gid_table.h"
#include "net/netif.h"
#include "paths.h"
#include "proc.h"
#include "registry.h"
#include "segment.h"

namespace shmrdma {
namespace {

constexpr int kMaxClients = 32;
constexpr size_t kMaxRequest = 1024;
constexpr int64_t kClientTimeoutMs = 5000;
constexpr int64_t kPeriodicRefreshMs = 1000;
constexpr int64_t kIdleExitMs = 2000;     // no device of ours left for this long: exit
constexpr off_t kLogRotateBytes = 1 << 20;

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

FILE* g_log = stderr;

void logf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void logf(const char* fmt, ...) {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t{};
  gmtime_r(&ts.tv_sec, &t);
  char stamp[40];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &t);
  std::fprintf(g_log, "%s.%03ldZ shmrdmad[%d]: ", stamp, ts.tv_nsec / 1000000, static_cast<int>(::getpid()));
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(g_log, fmt, ap);
  va_end(ap);
  std::fputc('\n', g_log);
  std::fflush(g_log);
}

struct Served {
  std::string name;
  std::unique_ptr<Registry> reg;
  dev_t st_dev = 0;
  ino_t st_ino = 0;
  std::string left_out;  // GIDs that did not fit the table, last logged
};

struct Client {
  int fd = -1;
  std::string in, out;
  int64_t since = 0;
  bool closing = false;  // replied: close once `out` is sent
  bool dead = false;     // the peer went away or the socket failed
};

class Daemon {
 public:
  Daemon(std::string home, DaemonPaths paths)
      : home_(std::move(home)), paths_(std::move(paths)), cm_(home_, paths_, [](const std::string& m) {
          logf("%s", m.c_str());
        }) {
    handlers_["ping"] = [this](const std::string&) {
      return "ok pid=" + std::to_string(::getpid()) + " devices=" + std::to_string(devices_.size());
    };
    handlers_["refresh"] = [this](const std::string&) {
      refresh("requested");
      return "ok devices=" + std::to_string(devices_.size());
    };
    handlers_["stop"] = [this](const std::string&) {
      stop_ = true;
      logf("stop requested");
      return std::string("ok");
    };
  }
  ~Daemon() {
    for (Client& c : clients_) ::close(c.fd);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (sig_fd_ >= 0) ::close(sig_fd_);
    if (nl_) nl_socket_free(nl_);
  }

  int setup(std::string* why);
  int run();

 private:
  void refresh(const char* reason);
  void rescan_devices();
  void refresh_device(Served& d);
  void on_netlink();
  void on_accept();
  void on_client(Client& c, short revents);
  void handle_request(Client& c, std::string line);
  int connect_netlink(std::string* why);

  std::string home_;
  DaemonPaths paths_;
  nl_sock* nl_ = nullptr;
  int listen_fd_ = -1;
  int sig_fd_ = -1;
  std::vector<Client> clients_;
  std::vector<Served> devices_;
  std::map<std::string, std::function<std::string(const std::string&)>> handlers_;
  CmService cm_;  // RDMA CM (daemon/cm.h): its own sockets beside the control socket
  bool dirty_ = true;
  bool stop_ = false;
  int64_t last_refresh_ = 0;
  int64_t idle_since_ = -1;
};

int on_nl_valid(nl_msg*, void* arg) {
  *static_cast<bool*>(arg) = true;
  return NL_OK;
}

int Daemon::connect_netlink(std::string* why) {
  nl_ = nl_socket_alloc();
  if (!nl_) {
    *why = "out of memory";
    return ENOMEM;
  }
  // Notifications, not replies: no sequence numbers to check.
  nl_socket_disable_seq_check(nl_);
  nl_socket_modify_cb(nl_, NL_CB_VALID, NL_CB_CUSTOM, on_nl_valid, &dirty_);
  if (int rc = nl_connect(nl_, NETLINK_ROUTE); rc < 0) {
    *why = std::string("cannot open a route netlink socket: ") + nl_geterror(rc);
    return EIO;
  }
  if (int rc = nl_socket_add_memberships(nl_, RTNLGRP_LINK, RTNLGRP_IPV4_IFADDR, RTNLGRP_IPV6_IFADDR, 0); rc < 0) {
    *why = std::string("cannot subscribe to link and address changes: ") + nl_geterror(rc);
    return EIO;
  }
  nl_socket_set_nonblocking(nl_);
  nl_socket_set_buffer_size(nl_, 1 << 20, 0);
  return 0;
}

int Daemon::setup(std::string* why) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  sig_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  ::signal(SIGPIPE, SIG_IGN);
  if (int rc = connect_netlink(why)) return rc;

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (paths_.sock.size() >= sizeof addr.sun_path) {
    *why = "the control socket path " + paths_.sock + " is too long for a unix socket (use a shorter --home)";
    return ENAMETOOLONG;
  }
  std::memcpy(addr.sun_path, paths_.sock.c_str(), paths_.sock.size() + 1);
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) {
    *why = std::string("socket: ") + std::strerror(errno);
    return errno;
  }
  ::unlink(paths_.sock.c_str());  // we hold the lock: a socket file left here is a dead daemon's
  const mode_t old = ::umask(0177);
  const int brc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  ::umask(old);
  if (brc != 0 || ::listen(listen_fd_, 16) != 0) {
    *why = "cannot listen on " + paths_.sock + ": " + std::strerror(errno);
    return errno;
  }
  if (int rc = cm_.setup(why)) return rc;
  const ProcessId self = self_process();
  if (int rc = write_file_atomic(paths_.pid, std::to_string(self.pid) + " " + std::to_string(self.start_time) + "\n",
                                 0600)) {
    *why = "cannot write " + paths_.pid + ": " + std::strerror(rc);
    return rc;
  }
  return 0;
}

void Daemon::rescan_devices() {
  std::vector<Served> next;
  for (const std::string& n : list_devices(home_)) {
    DevicePaths p = device_paths(home_, n);
    struct stat st{};
    if (::stat(p.registry.c_str(), &st) != 0) continue;
    Served s;
    for (Served& d : devices_)
      if (d.name == n && d.st_dev == st.st_dev && d.st_ino == st.st_ino) s = std::move(d);
    if (!s.reg) {
      auto reg = std::make_unique<Registry>();
      if (Registry::attach(p, reg.get()) != 0) continue;
      const layout::NetBinding& b = reg->device().net;
      if (b.link_layer != layout::kLinkLayerEthernet || b.netns_dev != paths_.netns_dev ||
          b.netns_ino != paths_.netns_ino)
        continue;  // IB, or bound in another namespace (its own daemon follows it)
      logf("following %s (bound to ifindex %u, created as %s)", n.c_str(), b.ifindex, b.ifname);
      s = Served{n, std::move(reg), st.st_dev, st.st_ino, {}};
    }
    next.push_back(std::move(s));
  }
  for (const Served& d : devices_) {
    bool kept = false;
    for (const Served& n : next) kept = kept || n.reg.get() == d.reg.get();
    if (!kept && d.reg) logf("%s is gone", d.name.c_str());
  }
  devices_ = std::move(next);
}

std::string describe_gid(const PortNetView& v, uint32_t i) {
  return gid_short_text(v.gids[i].gid) + " (" + gid_type_sysfs_name(v.gids[i].type) + ", index " +
         std::to_string(i) + ")";
}

void Daemon::refresh_device(Served& d) {
  const layout::NetBinding& b = d.reg->device().net;
  net::InterfaceState s;
  std::string why;
  int rc = net::read_interface("", b.ifindex, &s, &why);
  if (rc && rc != ENODEV) {
    logf("%s: cannot read interface %u: %s", d.name.c_str(), b.ifindex, why.c_str());
    return;
  }
  PortNetView cur;
  if (d.reg->port_net_settled(1, &cur) != 0) cur = PortNetView{};  // a dead writer's record: rewritten whole
  PortNetView next = net::port_view(s, rc == 0, static_cast<layout::GidLayout>(b.gid_layout), cur);
  // Addresses beyond the table's kGidTableLen entries are left out: said
  // once each time the set changes.
  std::string left_out =
      rc == 0 ? gids_text(gids_left_out(static_cast<layout::GidLayout>(b.gid_layout), s.mac, s.addrs)) : "";
  if (left_out != d.left_out) {
    if (!left_out.empty())
      logf("%s: the GID table has %u entries; addresses of %s left out of it: %s", d.name.c_str(),
           limits::kGidTableLen, s.name.c_str(), left_out.c_str());
    else if (!d.left_out.empty())
      logf("%s: every address of %s fits the GID table again", d.name.c_str(), s.name.c_str());
    d.left_out = std::move(left_out);
  }
  PortNetChange c;
  if (apply_port_net(*d.reg, 1, next, &c, &why) != 0) {
    logf("%s: cannot publish the port record: %s", d.name.c_str(), why.c_str());
    return;
  }
  if (!c.gids && !c.state && !c.other) return;
  PortNetView now;
  if (d.reg->port_net(1, &now) != 0) return;
  if (!(now.link & layout::kLinkPresent) && (cur.link & layout::kLinkPresent))
    logf("%s: interface %s (ifindex %u) is gone", d.name.c_str(), cur.ifname, b.ifindex);
  if (std::strcmp(cur.ifname, now.ifname) != 0 && now.ifname[0] && cur.ifname[0])
    logf("%s: interface %s renamed to %s", d.name.c_str(), cur.ifname, now.ifname);
  if (cur.ifmtu != now.ifmtu && now.ifmtu)
    logf("%s: MTU %u -> %u (active_mtu %u)", d.name.c_str(), cur.ifmtu, now.ifmtu, 128u << now.active_mtu);
  for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
    const bool was = cur.valid(i), is = now.valid(i);
    if (was && (!is || std::memcmp(cur.gids[i].gid, now.gids[i].gid, 16)))
      logf("%s: GID removed: %s", d.name.c_str(), describe_gid(cur, i).c_str());
    if (is && (!was || std::memcmp(cur.gids[i].gid, now.gids[i].gid, 16)))
      logf("%s: GID added: %s", d.name.c_str(), describe_gid(now, i).c_str());
  }
  if (c.state)
    logf("%s: port %s (interface %s%s%s)", d.name.c_str(), c.new_state == layout::kPortActive ? "ACTIVE" : "DOWN",
         (now.link & layout::kLinkPresent) ? "present" : "absent", (now.link & layout::kLinkUp) ? ", up" : ", down",
         (now.link & layout::kLinkCarrier) ? ", carrier" : ", no carrier");
}

void Daemon::refresh(const char*) {
  dirty_ = false;
  last_refresh_ = now_ms();
  try {
    rescan_devices();
    for (Served& d : devices_) refresh_device(d);
  } catch (const std::exception& e) {
    logf("refresh failed: %s", e.what());
  }
  if (devices_.empty()) {
    if (idle_since_ < 0) idle_since_ = now_ms();
  } else {
    idle_since_ = -1;
  }
}

void Daemon::on_netlink() {
  for (int i = 0; i < 64; ++i) {
    int rc = nl_recvmsgs_default(nl_);
    if (rc >= 0) continue;
    if (rc == -NLE_AGAIN) break;
    // ENOBUFS (we fell behind) and the like: we lost notifications, so read
    // everything again.
    dirty_ = true;
    if (rc != -NLE_NOMEM) logf("netlink: %s", nl_geterror(rc));
    break;
  }
}

void Daemon::on_accept() {
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid()) {
      logf("refused a connection from uid %u (pid %d): only uid %u may use this daemon", cred.uid,
           static_cast<int>(cred.pid), ::geteuid());
      ::close(fd);
      continue;
    }
    if (static_cast<int>(clients_.size()) >= kMaxClients) {
      static const char kBusy[] = "error busy\n";
      (void)::send(fd, kBusy, sizeof kBusy - 1, MSG_NOSIGNAL);
      ::close(fd);
      continue;
    }
    clients_.push_back(Client{fd, {}, {}, now_ms(), false, false});
  }
}

void Daemon::handle_request(Client& c, std::string line) {
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
  const std::string verb = line.substr(0, line.find(' '));
  const std::string rest = verb.size() < line.size() ? line.substr(verb.size() + 1) : std::string();
  auto it = handlers_.find(verb);
  std::string reply;
  if (it == handlers_.end()) {
    reply = "error unknown request";
  } else {
    try {
      reply = it->second(rest);
    } catch (const std::exception& e) {
      reply = std::string("error ") + e.what();
    }
  }
  c.out += reply + "\n";
  c.closing = true;  // one request per connection
}

void Daemon::on_client(Client& c, short revents) {
  if (revents & POLLIN) {
    char buf[512];
    for (;;) {
      ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n > 0) {
        if (c.closing) continue;  // one request per connection: the rest is ignored
        c.in.append(buf, static_cast<size_t>(n));
        if (auto nl = c.in.find('\n'); nl != std::string::npos) {
          handle_request(c, c.in.substr(0, nl));
        } else if (c.in.size() > kMaxRequest) {
          c.out += "error request too long\n";
          c.closing = true;
        }
        continue;
      }
      if (n == 0) {
        if (!c.closing) c.dead = true;  // peer gone before a full request: drop it
        break;
      }
      if (errno != EAGAIN && errno != EINTR) c.dead = true;
      break;
    }
  }
  if ((revents & (POLLERR | POLLHUP)) && !(revents & POLLIN)) c.dead = true;
  if (!c.dead && !c.out.empty()) {
    ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
    if (n > 0) c.out.erase(0, static_cast<size_t>(n));
    else if (n < 0 && errno != EAGAIN && errno != EINTR) c.dead = true;
  }
}

int Daemon::run() {
  refresh("start");
  logf("serving %zu device(s) for network namespace %llu:%llu", devices_.size(),
       static_cast<unsigned long long>(paths_.netns_dev), static_cast<unsigned long long>(paths_.netns_ino));
  while (!stop_) {
    std::vector<pollfd> fds;
    fds.push_back({nl_socket_get_fd(nl_), POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    fds.push_back({sig_fd_, POLLIN, 0});
    for (const Client& c : clients_)
      fds.push_back({c.fd, static_cast<short>(POLLIN | (c.out.empty() ? 0 : POLLOUT)), 0});
    const size_t cm_first = fds.size();
    cm_.add_fds(&fds);
    const int64_t until_refresh = last_refresh_ + kPeriodicRefreshMs - now_ms();
    int timeout = dirty_ ? 0 : static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(until_refresh, 500)));
    if (const int cm_timeout = cm_.timeout_ms(); cm_timeout >= 0) timeout = std::min(timeout, cm_timeout);
    int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0 && errno != EINTR) {
      logf("poll: %s", std::strerror(errno));
      return 1;
    }
    if (n > 0) {
      if (fds[2].revents & POLLIN) {
        signalfd_siginfo si{};
        if (::read(sig_fd_, &si, sizeof si) == sizeof si) {
          logf("signal %u: stopping", si.ssi_signo);
          stop_ = true;
        }
      }
      if (fds[0].revents & POLLIN) on_netlink();
      if (fds[0].revents & (POLLERR | POLLHUP)) dirty_ = true;
      // Interface changes before requests: a "refresh" then answers with
      // what the last notification said.
      if (dirty_) refresh("netlink");
      if (fds[1].revents & POLLIN) on_accept();
      for (size_t i = 3; i < cm_first && i - 3 < clients_.size(); ++i)
        if (fds[i].revents) on_client(clients_[i - 3], fds[i].revents);
    }
    cm_.handle(fds.data() + cm_first, fds.size() - cm_first);  // also runs its timers
    const int64_t now = now_ms();
    for (Client& c : clients_) {
      if (c.dead || (c.closing && c.out.empty()) || now - c.since > kClientTimeoutMs) {
        ::close(c.fd);
        c.fd = -1;
      }
    }
    std::erase_if(clients_, [](const Client& c) { return c.fd < 0; });
    if (dirty_ || now - last_refresh_ >= kPeriodicRefreshMs) refresh("periodic");
    if (cm_.channels() > 0) idle_since_ = devices_.empty() ? now_ms() : -1;  // open CM channels keep it
    if (idle_since_ >= 0 && now_ms() - idle_since_ >= kIdleExitMs) {
      logf("no RoCE device of this network namespace left: stopping");
      break;
    }
  }
  // Flush the replies of the last requests (a "stop" is answered).
  for (Client& c : clients_)
    if (!c.dead && !c.out.empty()) (void)::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
  std::string pidtext;
  if (read_small_file(paths_.pid, &pidtext) == 0 && std::atoi(pidtext.c_str()) == ::getpid()) {
    ::unlink(paths_.sock.c_str());
    ::unlink(paths_.pid.c_str());
  }
  logf("stopped");
  return 0;
}

int mkdir_private(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return errno;
  struct stat st{};
  if (::lstat(dir.c_str(), &st) != 0) return errno;
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) return EPERM;  // not ours: never write into it
  return 0;
}

FILE* open_log(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && st.st_size > kLogRotateBytes) ::rename(path.c_str(), (path + ".1").c_str());
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  return ::fdopen(fd, "a");
}

int daemon_main(int argc, char** argv) {
  std::string home;
  bool foreground = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--home" && i + 1 < argc) home = argv[++i];
    else if (a.rfind("--home=", 0) == 0) home = a.substr(7);
    else if (a == "--foreground") foreground = true;
    else {
      std::fprintf(stderr, "usage: shmrdmad --home DIR [--foreground]\n");
      return 2;
    }
  }
  if (home.empty()) home = state_home();
  uint64_t ns_dev = 0, ns_ino = 0;
  if (int rc = current_netns(&ns_dev, &ns_ino)) {
    std::fprintf(stderr, "shmrdmad: cannot identify the network namespace: %s\n", std::strerror(rc));
    return 1;
  }
  DaemonPaths paths = daemon_paths(home, ns_dev, ns_ino);
  if (int rc = mkdir_private(home); rc) {
    std::fprintf(stderr, "shmrdmad: cannot use %s: %s\n", home.c_str(), std::strerror(rc));
    return 1;
  }
  if (int rc = mkdir_private(paths.dir); rc) {
    std::fprintf(stderr, "shmrdmad: cannot use %s: %s\n", paths.dir.c_str(), std::strerror(rc));
    return 1;
  }
  int lock_fd = ::open(paths.lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0 || ::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const bool running = lock_fd >= 0 && errno == EWOULDBLOCK;
    std::fprintf(stderr, "shmrdmad: %s\n",
                 running ? "already running for this state directory and network namespace"
                         : ("cannot lock " + paths.lock + ": " + std::strerror(errno)).c_str());
    return running ? 3 : 1;
  }
  FILE* log = open_log(paths.log);
  if (!log) {
    std::fprintf(stderr, "shmrdmad: cannot open the log %s: %s\n", paths.log.c_str(), std::strerror(errno));
    return 1;
  }
  int ready[2] = {-1, -1};
  if (!foreground) {
    // Detach: the parent returns once the child listens (exit 0) or failed.
    if (::pipe2(ready, O_CLOEXEC) != 0) return 1;
    pid_t pid = ::fork();
    if (pid < 0) return 1;
    if (pid > 0) {
      ::close(ready[1]);
      char c = 0;
      ssize_t n;
      do n = ::read(ready[0], &c, 1);
      while (n < 0 && errno == EINTR);
      return n == 1 && c == '1' ? 0 : 1;
    }
    ::close(ready[0]);
    ::setsid();
    int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) {
      ::dup2(devnull, 0);
      ::close(devnull);
    }
    ::dup2(::fileno(log), 1);
    ::dup2(::fileno(log), 2);
    if (::chdir("/") != 0) { /* stays where it was */ }
  }
  g_log = log;
  Daemon d(home, paths);
  std::string why;
  if (int rc = d.setup(&why); rc) {
    logf("cannot start: %s", why.c_str());
    if (foreground) std::fprintf(stderr, "shmrdmad: %s\n", why.c_str());
    return 1;
  }
  logf("started (home %s, log %s)", home.c_str(), paths.log.c_str());
  if (ready[1] >= 0) {
    (void)::write(ready[1], "1", 1);
    ::close(ready[1]);
  }
  return d.run();
}

}  // namespace
}  // namespace shmrdma

int main(int argc, char** argv) { return shmrdma::daemon_main(argc, argv); }
