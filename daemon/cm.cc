// shmrdmad's RDMA CM service: see cm.h, src/cm/cm_proto.h (the shim's
// side) and src/cm/wire.h (the IB CM messages between daemons).
//
// State per channel (one SEQPACKET connection = one open of
// /dev/infiniband/rdma_cm in some process): its ids and its event queue.
// Ids are numbered daemon-wide; a command naming an id of another channel
// fails with EINVAL, an unknown id with ENOENT (ucma_get_ctx). A channel
// whose last descriptor is closed (the process exited or was killed) shows
// as EOF: its ids go, listeners and ports are freed, and peers get a REJ
// (handshake) or DREQ (connected).
//
// Connection set-up (RC), as the kernel's cma.c / cm.c do it:
//   active  CONNECT  -> REQ (retried every kRetryMs, kMaxRetries times, then
//                       UNREACHABLE status -ETIMEDOUT)
//   passive REQ      -> CONNECT_REQUEST event on the listener's channel with
//                       a new id (no listener: REJ reason 8)
//   passive ACCEPT   -> REP (retried like REQ until the RTU)
//   active  REP      -> CONNECT_RESPONSE (librdmacm moves its QP to RTR/RTS
//                       and writes ACCEPT) -> RTU
//   passive RTU      -> ESTABLISHED
//   DISCONNECT -> DREQ; the peer answers DREP at once and sees DISCONNECTED;
//   the DREP (or the DREQ's timeout) gives the initiator its DISCONNECTED.
// Every datagram is untrusted: sender uid (SCM_CREDENTIALS) and path, MAD
// header and size, comm ids and states are checked before anything changes.
#include "cm.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_user_cm.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <random>

#include "cm/cm_proto.h"
#include "cm/wire.h"
#include "device_setup.h"
#include "paths.h"
#include "gid_directory.h"
#include "gid_table.h"
#include "registry.h"

namespace shmrdma {

std::string cm_channel_path(const DaemonPaths& d) {
  return d.sock.substr(0, d.sock.size() - 5) + SHMRDMA_CM_SOCK_SUFFIX;
}
std::string cm_mad_path(const DaemonPaths& d) { return d.sock.substr(0, d.sock.size() - 5) + SHMRDMA_CM_MAD_SUFFIX; }

namespace {

constexpr int kRetryMs = 400;      // REQ / REP / DREQ retransmission interval
constexpr int kMaxRetries = 3;     // then UNREACHABLE / CONNECT_ERROR / DISCONNECTED (within 2 s)
constexpr size_t kMaxChannels = 1024;
constexpr size_t kMaxOutbox = 4096;
constexpr int64_t kOutboxMaxAgeMs = 2000;
constexpr int kOutboxTickMs = 2;
constexpr uint32_t kMaxBacklog = 1024;  // /proc/sys/net/rdma_ucm/max_backlog's default
constexpr uint8_t kDefaultAckTimeout = 17;  // RoCE: packet life time 16 + 1 (cma.c)
constexpr uint8_t kHopLimit = 64;
constexpr uint32_t kUdpQkey = 0x01234567;

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

enum class St {
  Idle,
  Bound,
  AddrResolved,
  RouteResolved,
  Listen,
  ReqSent,      // active: REQ out, waiting for REP
  ReqRcvd,      // passive: CONNECT_REQUEST queued or reported, waiting for ACCEPT/REJECT
  RepSent,      // passive: REP out, waiting for RTU
  RepRcvd,      // active: CONNECT_RESPONSE queued, waiting for ACCEPT (-> RTU)
  Established,
  DreqSent,
  Disconnected,
  Rejected,
};

// An IP address (IPv4 as v4-mapped IPv6) and port, and the family it came as.
struct Addr {
  uint16_t family = 0;
  uint8_t ip[16] = {};
  uint16_t port = 0;  // host order
  bool any() const {
    static const uint8_t zero[16] = {};
    static const uint8_t v4any[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0};
    return !std::memcmp(ip, zero, 16) || !std::memcmp(ip, v4any, 16);
  }
  bool loopback() const {
    static const uint8_t v6lo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    return !std::memcmp(ip, v6lo, 16) || (v4() && ip[12] == 127);
  }
  bool v4() const {
    static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return !std::memcmp(ip, pre, 12);
  }
  bool same_ip(const Addr& o) const { return !std::memcmp(ip, o.ip, 16); }
};

// Parses the sockaddr the command carries (sockaddr_in6-sized or storage).
int parse_addr(const void* p, size_t len, Addr* out) {
  sa_family_t fam;
  if (len < sizeof fam) return EINVAL;
  std::memcpy(&fam, p, sizeof fam);
  *out = Addr{};
  if (fam == AF_INET) {
    if (len < sizeof(sockaddr_in)) return EINVAL;
    sockaddr_in a;
    std::memcpy(&a, p, sizeof a);
    out->family = AF_INET;
    out->ip[10] = out->ip[11] = 0xff;
    std::memcpy(out->ip + 12, &a.sin_addr, 4);
    out->port = ntohs(a.sin_port);
    return 0;
  }
  if (fam == AF_INET6) {
    if (len < sizeof(sockaddr_in6)) return EINVAL;
    sockaddr_in6 a;
    std::memcpy(&a, p, sizeof a);
    out->family = AF_INET6;
    std::memcpy(out->ip, &a.sin6_addr, 16);
    out->port = ntohs(a.sin6_port);
    return 0;
  }
  return EAFNOSUPPORT;
}

// The sockaddr librdmacm expects back (a sockaddr_in6-sized slot).
void store_addr(const Addr& a, void* slot, size_t len) {
  std::memset(slot, 0, len);
  if (a.family == AF_INET) {
    sockaddr_in s{};
    s.sin_family = AF_INET;
    s.sin_port = htons(a.port);
    std::memcpy(&s.sin_addr, a.ip + 12, 4);
    std::memcpy(slot, &s, std::min(len, sizeof s));
  } else if (a.family == AF_INET6) {
    sockaddr_in6 s{};
    s.sin6_family = AF_INET6;
    s.sin6_port = htons(a.port);
    std::memcpy(&s.sin6_addr, a.ip, 16);
    std::memcpy(slot, &s, std::min(len, sizeof s));
  }
}

struct Event {
  rdma_ucm_event_resp resp{};
  uint32_t owner = 0;  // the id it counts for (CONNECT_REQUEST: the listener)
  uint32_t child = 0;  // CONNECT_REQUEST: the new id
  uint32_t mc = 0;     // MULTICAST_JOIN: the join it counts for too
};

// A multicast join of an id (JOIN_IP_MCAST / JOIN_MCAST).
struct Join {
  uint32_t handle = 0;
  uint32_t owner = 0;  // the id
  uint64_t uid = 0;
  Addr addr;
  uint32_t events_reported = 0;
};

struct Channel {
  int fd = -1;
  uint64_t key = 0;
  std::deque<Event> events;
  bool dead = false;
};

// The device side of an id: which RoCE device, port and GID it uses.
struct DevBind {
  bool set = false;
  Registry* reg = nullptr;  // owned by the GidDirectory (lives as long as it)
  uint64_t node_guid = 0;   // as DeviceRecord holds it
  uint32_t port = 1;
  uint32_t gid_index = 0;
  uint8_t sgid[16] = {};
  uint32_t active_mtu = IBV_MTU_1024;
};

struct Id {
  uint32_t handle = 0;
  Channel* ch = nullptr;
  uint64_t uid = 0;
  uint16_t ps = 0;
  uint8_t qp_type = 0;
  St st = St::Idle;
  Addr src, dst;
  bool port_bound = false;
  DevBind dev;
  uint8_t dgid[16] = {};
  uint32_t backlog = 0;
  uint32_t listener = 0;  // passive ids: the listener's handle (0 once gone)
  bool reported = false;  // passive ids: the CONNECT_REQUEST was handed out
  uint8_t tos = 0;
  bool reuseaddr = false;
  int afonly = -1;
  uint8_t ack_timeout = 0;  // 0: default
  uint32_t events_reported = 0;
  // The IB CM exchange.
  uint32_t local_comm = 0, remote_comm = 0;
  std::string peer;  // the peer daemon's MAD socket
  uint32_t local_qpn = 0, remote_qpn = 0, local_psn = 0, remote_psn = 0;
  uint8_t responder_resources = 0, initiator_depth = 0;  // for our QP (RTR / RTS)
  uint8_t retry_count = 7, rnr_retry = 7;                // for our QP's RTS
  uint32_t qkey = 0;
  cm::Mad last{};            // what the timer retransmits
  int retries_left = 0;
  int64_t retry_at = -1;     // -1: no timer
};

// The event numbers of the ucma ABI (rdma_cma.h enum rdma_cm_event_type,
// whose header clashes with rdma_user_cm.h).
enum : uint32_t {
  RDMA_CM_EVENT_ADDR_RESOLVED = 0,
  RDMA_CM_EVENT_ADDR_ERROR = 1,
  RDMA_CM_EVENT_ROUTE_RESOLVED = 2,
  RDMA_CM_EVENT_ROUTE_ERROR = 3,
  RDMA_CM_EVENT_CONNECT_REQUEST = 4,
  RDMA_CM_EVENT_CONNECT_RESPONSE = 5,
  RDMA_CM_EVENT_CONNECT_ERROR = 6,
  RDMA_CM_EVENT_UNREACHABLE = 7,
  RDMA_CM_EVENT_REJECTED = 8,
  RDMA_CM_EVENT_ESTABLISHED = 9,
  RDMA_CM_EVENT_DISCONNECTED = 10,
  RDMA_CM_EVENT_MULTICAST_JOIN = 12,
  RDMA_CM_EVENT_MULTICAST_ERROR = 13,
};

// The IP port spaces' service id (cma.c cma_get_service_id).
uint64_t service_id_of(uint16_t ps, uint16_t port) { return (uint64_t{ps} << 16) | port; }

struct ReplyOut {
  int err = 0;
  uint32_t flags = 0;
  std::vector<uint8_t> body;
};

template <class T>
bool take(const std::vector<uint8_t>& in, T* out) {
  // The kernel copies sizeof(cmd) from the user's buffer; we have what the
  // shim copied (hdr.in bytes, capped): short commands read as zero-filled.
  std::memset(out, 0, sizeof *out);
  std::memcpy(out, in.data(), std::min(in.size(), sizeof *out));
  return true;
}

template <class T>
void put(ReplyOut* r, const T& v, uint16_t out) {
  r->body.resize(std::min<size_t>(sizeof v, out));
  std::memcpy(r->body.data(), &v, r->body.size());
}

}  // namespace

struct CmService::Impl {
  Impl(std::string home, DaemonPaths paths, Logger log)
      : home(std::move(home)), paths(std::move(paths)), log(std::move(log)), gids(this->home) {
    std::random_device rd;
    rng.seed((uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid()));
  }
  ~Impl() {
    for (auto& c : channels) ::close(c->fd);
    if (listen_fd >= 0) ::close(listen_fd);
    if (mad_fd >= 0) ::close(mad_fd);
    if (listen_fd >= 0) ::unlink(chan_path.c_str());
    if (mad_fd >= 0) ::unlink(mad_path.c_str());
  }

  std::string home;
  DaemonPaths paths;
  Logger log;
  GidDirectory gids;
  std::mt19937_64 rng;
  std::string chan_path, mad_path;
  int listen_fd = -1, mad_fd = -1;
  std::vector<std::unique_ptr<Channel>> channels;
  std::map<uint32_t, std::unique_ptr<Id>> ids;
  std::map<uint32_t, uint32_t> by_comm;  // local comm id -> handle
  std::map<uint32_t, Join> joins;        // multicast joins by handle (numbered with the ids)
  struct Outgoing {
    std::string peer;
    cm::Mad mad;
    int64_t since;
  };
  std::deque<Outgoing> outbox;
  uint32_t next_handle = 1;

  int setup(std::string* why);
  void on_accept();
  void on_channel(Channel& c);
  void close_channel(Channel& c);
  void on_mad();

  // Commands.
  ReplyOut command(Channel& c, const shmrdma_cm_request& h, const std::vector<uint8_t>& in,
                   const std::vector<uint8_t>& opt);
  Id* find(Channel& c, uint32_t handle, int* err);
  void cmd_create(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_destroy(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_bind(Channel& c, uint32_t handle, const void* addr, size_t len, ReplyOut* r);
  void cmd_resolve(Channel& c, uint32_t handle, const Addr* src, const Addr& dst, ReplyOut* r);
  void cmd_query_route(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_query(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_connect(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_listen(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_accept(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_reject(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_disconnect(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_init_qp_attr(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_get_event(Channel& c, uint16_t out, ReplyOut* r);
  void cmd_set_option(Channel& c, const std::vector<uint8_t>& in, const std::vector<uint8_t>& opt, ReplyOut* r);
  void cmd_notify(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r);
  void cmd_join(Channel& c, uint32_t handle, uint64_t uid, const void* addr, size_t len, uint16_t flags,
                uint16_t out, ReplyOut* r);
  void cmd_leave(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_connect_ud(Id* id, const rdma_ucm_conn_param& p, ReplyOut* r);
  void cmd_accept_ud(Id* id, const rdma_ucm_accept& cmd, ReplyOut* r);
  void on_sidr_req(const std::string& from, const cm::Mad& m);
  void on_sidr_rep(const std::string& from, const cm::Mad& m);
  void fill_ah(const Id* id, const uint8_t dgid[16], ib_uverbs_ah_attr* ah);
  void cmd_migrate(Channel& c, const shmrdma_cm_request& h, const std::vector<uint8_t>& in, uint16_t out,
                   ReplyOut* r);

  // Ids, ports, events.
  Id* new_id(Channel* c, uint64_t uid, uint16_t ps, uint8_t qp_type);
  uint32_t destroy_id(Id* id, bool* drained);
  void teardown(Id* id);
  int bind_port(Id* id, uint16_t port);
  int set_device_for(const Addr& a, DevBind* d);
  bool local_ip(const Addr& a);
  void queue(Id* id, Event ev, uint32_t owner);
  Event event_for(Id* id, uint32_t type, int32_t status);
  void token(Channel& c);
  int loopback_source(Addr* s);

  // The exchange.
  std::string peer_for(const uint8_t gid[16]);
  uint32_t new_comm(uint32_t handle);
  bool send_mad(const std::string& peer, const cm::Mad& m);
  void flush_outbox();
  void send_rej(const std::string& peer, uint32_t local_comm, uint32_t remote_comm, uint16_t reason,
                uint8_t msg, const uint8_t* pd, size_t pd_len);
  void arm(Id* id, const cm::Mad& m);
  void on_req(const std::string& from, const cm::Mad& m);
  void on_rep(const std::string& from, const cm::Mad& m);
  void on_rtu(const std::string& from, const cm::Mad& m);
  void on_rej(const std::string& from, const cm::Mad& m);
  void on_dreq(const std::string& from, const cm::Mad& m);
  void on_drep(const std::string& from, const cm::Mad& m);
  Id* by_local_comm(uint32_t comm, const std::string& from);
  void timers();
};

int CmService::Impl::setup(std::string* why) {
  chan_path = cm_channel_path(paths);
  mad_path = cm_mad_path(paths);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (std::max(chan_path.size(), mad_path.size()) >= sizeof a.sun_path) {
    *why = "the CM socket path " + chan_path + " is too long for a unix socket (use a shorter --home)";
    return ENAMETOOLONG;
  }
  listen_fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  mad_fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd < 0 || mad_fd < 0) {
    *why = std::string("socket: ") + std::strerror(errno);
    return errno;
  }
  const mode_t old = ::umask(0177);
  ::unlink(chan_path.c_str());  // the daemon holds the lock: these are a dead daemon's
  ::unlink(mad_path.c_str());
  std::memcpy(a.sun_path, chan_path.c_str(), chan_path.size() + 1);
  int rc = ::bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  if (rc == 0) rc = ::listen(listen_fd, 64);
  if (rc == 0) {
    std::memset(a.sun_path, 0, sizeof a.sun_path);
    std::memcpy(a.sun_path, mad_path.c_str(), mad_path.size() + 1);
    rc = ::bind(mad_fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  ::umask(old);
  if (rc != 0) {
    *why = "cannot bind the CM sockets " + chan_path + ", " + mad_path + ": " + std::strerror(errno);
    return errno;
  }
  int one = 1;
  ::setsockopt(mad_fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one);
  return 0;
}

void CmService::Impl::on_accept() {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::geteuid() ||
        channels.size() >= kMaxChannels) {
      log("CM: refused a channel from uid " + std::to_string(cred.uid) + " pid " + std::to_string(cred.pid));
      ::close(fd);
      continue;
    }
    auto c = std::make_unique<Channel>();
    c->fd = fd;
    do c->key = rng();
    while (!c->key);
    channels.push_back(std::move(c));
  }
}

void CmService::Impl::on_channel(Channel& c) {
  for (int round = 0; round < 16; ++round) {
    alignas(8) uint8_t buf[sizeof(shmrdma_cm_request) + SHMRDMA_CM_MAX_IN + SHMRDMA_CM_MAX_OPT];
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    iovec iov{buf, sizeof buf};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = ::recvmsg(c.fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno != EAGAIN && errno != EINTR) c.dead = true;
      return;
    }
    if (n == 0) {
      c.dead = true;  // every descriptor of the channel is closed
      return;
    }
    int reply_fd = -1;
    for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      const size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < nfd; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
        if (reply_fd < 0) reply_fd = fd;
        else ::close(fd);  // one is all a request may carry
      }
    }
    if (reply_fd < 0 || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || static_cast<size_t>(n) < sizeof(shmrdma_cm_request)) {
      if (reply_fd >= 0) ::close(reply_fd);
      continue;  // malformed: nobody to answer, or nothing to answer
    }
    shmrdma_cm_request h;
    std::memcpy(&h, buf, sizeof h);
    ReplyOut r;
    if (h.magic != SHMRDMA_CM_MAGIC || h.in > SHMRDMA_CM_MAX_IN || h.optlen > SHMRDMA_CM_MAX_OPT ||
        sizeof h + h.in + h.optlen != static_cast<size_t>(n)) {
      r.err = EINVAL;
    } else if (h.kind == SHMRDMA_CM_HELLO) {
      r.err = 0;
    } else if (h.kind == SHMRDMA_CM_COMMAND) {
      std::vector<uint8_t> in(buf + sizeof h, buf + sizeof h + h.in);
      std::vector<uint8_t> opt(buf + sizeof h + h.in, buf + sizeof h + h.in + h.optlen);
      try {
        r = command(c, h, in, opt);
      } catch (const std::exception& e) {
        log(std::string("CM: command failed: ") + e.what());
        r = ReplyOut{};
        r.err = ENOMEM;
      }
    } else {
      r.err = EINVAL;
    }
    if (r.body.size() > std::min<size_t>(h.out, SHMRDMA_CM_MAX_OUT)) r.body.resize(std::min<size_t>(h.out, SHMRDMA_CM_MAX_OUT));
    shmrdma_cm_reply rep{};
    rep.magic = SHMRDMA_CM_MAGIC;
    rep.err = r.err;
    rep.flags = r.flags;
    rep.len = r.err ? 0 : static_cast<uint32_t>(r.body.size());
    rep.key = c.key;
    std::vector<uint8_t> out(sizeof rep + rep.len);
    std::memcpy(out.data(), &rep, sizeof rep);
    if (rep.len) std::memcpy(out.data() + sizeof rep, r.body.data(), rep.len);
    // The reply socket is fresh and empty: this never blocks. A caller that
    // gave up (timeout) closed its end: EPIPE, ignored.
    (void)::send(reply_fd, out.data(), out.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::close(reply_fd);
  }
}

void CmService::Impl::token(Channel& c) {
  static const char t = 'e';
  (void)::send(c.fd, &t, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

void CmService::Impl::queue(Id* id, Event ev, uint32_t owner) {
  ev.owner = owner;
  Channel& c = *id->ch;
  const bool was_empty = c.events.empty();
  c.events.push_back(ev);
  if (was_empty) token(c);
}

Event CmService::Impl::event_for(Id* id, uint32_t type, int32_t status) {
  Event ev;
  ev.resp.uid = id->uid;
  ev.resp.id = id->handle;
  ev.resp.event = type;
  ev.resp.status = static_cast<uint32_t>(status);
  return ev;
}

Id* CmService::Impl::new_id(Channel* c, uint64_t uid, uint16_t ps, uint8_t qp_type) {
  auto id = std::make_unique<Id>();
  while (!next_handle || ids.count(next_handle) || joins.count(next_handle)) ++next_handle;
  id->handle = next_handle++;
  id->ch = c;
  id->uid = uid;
  id->ps = ps;
  id->qp_type = qp_type;
  id->qkey = ps == RDMA_PS_UDP || ps == RDMA_PS_IPOIB ? kUdpQkey : 0;
  Id* raw = id.get();
  ids[raw->handle] = std::move(id);
  return raw;
}

Id* CmService::Impl::find(Channel& c, uint32_t handle, int* err) {
  auto it = ids.find(handle);
  if (it == ids.end()) {
    *err = ENOENT;
    return nullptr;
  }
  if (it->second->ch != &c) {
    *err = EINVAL;
    return nullptr;
  }
  *err = 0;
  return it->second.get();
}

// Tell the peer we are gone (handshake: REJ; connected: DREQ), stop timers.
void CmService::Impl::teardown(Id* id) {
  switch (id->st) {
    case St::ReqSent:
      send_rej(id->peer, id->local_comm, 0, cm::kRejTimeout, 0, nullptr, 0);
      break;
    case St::ReqRcvd:
    case St::RepSent:
    case St::RepRcvd:
      send_rej(id->peer, id->local_comm, id->remote_comm, cm::kRejConsumer, id->st == St::RepRcvd ? 1 : 0,
               nullptr, 0);
      break;
    case St::Established: {
      cm::Mad m;
      cm::init_mad(&m, cm::kAttrDreq, id->local_comm);
      m.dreq.local_comm_id.set(id->local_comm);
      m.dreq.remote_comm_id.set(id->remote_comm);
      m.dreq.remote_qpn.set_bits(31, 8, id->remote_qpn);
      send_mad(id->peer, m);
      break;
    }
    default:
      break;
  }
  id->retry_at = -1;
  if (id->local_comm) by_comm.erase(id->local_comm);
  id->local_comm = 0;
}

// Removes the id and its unreported events; a listener takes the ids of
// its unreported connection requests with it. Returns events_reported;
// *drained: the channel's queue went from non-empty to empty.
uint32_t CmService::Impl::destroy_id(Id* id, bool* drained) {
  Channel& c = *id->ch;
  const bool had = !c.events.empty();
  std::vector<uint32_t> children;
  std::erase_if(c.events, [&](const Event& e) {
    if (e.owner != id->handle) return false;
    if (e.child) children.push_back(e.child);
    return true;
  });
  for (uint32_t h : children) {
    auto it = ids.find(h);
    if (it != ids.end()) {
      bool ignored = false;
      destroy_id(it->second.get(), &ignored);
    }
  }
  if (id->st == St::Listen)
    for (auto& [h, other] : ids)
      if (other->listener == id->handle) other->listener = 0;
  std::erase_if(joins, [&](const auto& j) { return j.second.owner == id->handle; });
  teardown(id);
  const uint32_t reported = id->events_reported;
  ids.erase(id->handle);
  *drained = had && c.events.empty();
  return reported;
}

void CmService::Impl::close_channel(Channel& c) {
  std::vector<uint32_t> mine;
  for (auto& [h, id] : ids)
    if (id->ch == &c) mine.push_back(h);
  for (uint32_t h : mine) {
    auto it = ids.find(h);
    if (it == ids.end()) continue;  // went with its listener
    bool ignored = false;
    destroy_id(it->second.get(), &ignored);
  }
  ::close(c.fd);
  c.fd = -1;
}

// Does this host (the daemon's namespace) have the address on an interface?
bool CmService::Impl::local_ip(const Addr& a) {
  int s = ::socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  sockaddr_in6 sa{};
  sa.sin6_family = AF_INET6;
  std::memcpy(&sa.sin6_addr, a.ip, 16);
  const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  ::close(s);
  return ok;
}

// The RoCE device of this namespace whose GID table holds the address.
int CmService::Impl::set_device_for(const Addr& a, DevBind* d) {
  GidMatch m;
  if (!gids.lookup(a.ip, layout::kGidTypeRoceV2, &m) && !gids.lookup(a.ip, kGidTypeAny, &m)) {
    gids.refresh();
    if (!gids.lookup(a.ip, layout::kGidTypeRoceV2, &m) && !gids.lookup(a.ip, kGidTypeAny, &m)) return ENODEV;
  }
  const layout::DeviceRecord& rec = m.registry->device();
  if (rec.net.netns_dev != paths.netns_dev || rec.net.netns_ino != paths.netns_ino) return ENODEV;
  d->set = true;
  d->reg = m.registry;
  d->node_guid = rec.node_guid;
  d->port = m.port;
  d->gid_index = m.gid_index;
  std::memcpy(d->sgid, a.ip, 16);
  PortNetView v;
  if (m.registry->port_net_settled(m.port, &v) == 0 && v.active_mtu) d->active_mtu = v.active_mtu;
  return 0;
}

int CmService::Impl::bind_port(Id* id, uint16_t port) {
  auto clash = [&](uint16_t p) {
    for (auto& [h, o] : ids) {
      if (o.get() == id || !o->port_bound || o->ps != id->ps || o->src.port != p) continue;
      if (!o->src.any() && !id->src.any() && !o->src.same_ip(id->src)) continue;
      if (id->reuseaddr && o->reuseaddr && o->st != St::Listen) continue;
      if (o->listener) continue;  // passive ids share their listener's port
      return true;
    }
    return false;
  };
  if (port) {
    if (clash(port)) return EADDRINUSE;
    id->src.port = port;
  } else {
    std::uniform_int_distribution<int> dist(32768, 60999);
    int tries = 0;
    do {
      port = static_cast<uint16_t>(dist(rng));
      if (++tries > 1000) return EADDRNOTAVAIL;
    } while (clash(port));
    id->src.port = port;
  }
  id->port_bound = true;
  return 0;
}

ReplyOut CmService::Impl::command(Channel& c, const shmrdma_cm_request& h, const std::vector<uint8_t>& in,
                                  const std::vector<uint8_t>& opt) {
  ReplyOut r;
  switch (h.cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID:
      cmd_create(c, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_DESTROY_ID:
      cmd_destroy(c, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_BIND_IP: {
      rdma_ucm_bind_ip cmd;
      take(in, &cmd);
      cmd_bind(c, cmd.id, &cmd.addr, sizeof cmd.addr, &r);
      break;
    }
    case RDMA_USER_CM_CMD_BIND: {
      rdma_ucm_bind cmd;
      take(in, &cmd);
      if (cmd.addr_size > sizeof cmd.addr) r.err = EINVAL;
      else cmd_bind(c, cmd.id, &cmd.addr, cmd.addr_size, &r);
      break;
    }
    case RDMA_USER_CM_CMD_RESOLVE_IP: {
      rdma_ucm_resolve_ip cmd;
      take(in, &cmd);
      Addr src, dst;
      const bool has_src = cmd.src_addr.sin6_family != 0;
      if ((has_src && (r.err = parse_addr(&cmd.src_addr, sizeof cmd.src_addr, &src))) ||
          (r.err = parse_addr(&cmd.dst_addr, sizeof cmd.dst_addr, &dst)))
        break;
      cmd_resolve(c, cmd.id, has_src ? &src : nullptr, dst, &r);
      break;
    }
    case RDMA_USER_CM_CMD_RESOLVE_ADDR: {
      rdma_ucm_resolve_addr cmd;
      take(in, &cmd);
      Addr src, dst;
      if (cmd.src_size > sizeof cmd.src_addr || cmd.dst_size > sizeof cmd.dst_addr) {
        r.err = EINVAL;
        break;
      }
      const bool has_src = cmd.src_size != 0 && cmd.src_addr.ss_family != 0;
      if ((has_src && (r.err = parse_addr(&cmd.src_addr, cmd.src_size, &src))) ||
          (r.err = parse_addr(&cmd.dst_addr, cmd.dst_size, &dst)))
        break;
      cmd_resolve(c, cmd.id, has_src ? &src : nullptr, dst, &r);
      break;
    }
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE: {
      rdma_ucm_resolve_route cmd;
      take(in, &cmd);
      Id* id = find(c, cmd.id, &r.err);
      if (!id) break;
      if (id->st != St::AddrResolved && id->st != St::RouteResolved) {
        r.err = EINVAL;
        break;
      }
      id->st = St::RouteResolved;
      queue(id, event_for(id, RDMA_CM_EVENT_ROUTE_RESOLVED, 0), id->handle);
      break;
    }
    case RDMA_USER_CM_CMD_QUERY_ROUTE:
      cmd_query_route(c, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_QUERY:
      cmd_query(c, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_CONNECT:
      cmd_connect(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_LISTEN:
      cmd_listen(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_ACCEPT:
      cmd_accept(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_REJECT:
      cmd_reject(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_DISCONNECT:
      cmd_disconnect(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_INIT_QP_ATTR:
      cmd_init_qp_attr(c, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_GET_EVENT:
      cmd_get_event(c, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_SET_OPTION:
      cmd_set_option(c, in, opt, &r);
      break;
    case RDMA_USER_CM_CMD_NOTIFY:
      cmd_notify(c, in, &r);
      break;
    case RDMA_USER_CM_CMD_MIGRATE_ID:
      cmd_migrate(c, h, in, h.out, &r);
      break;
    case RDMA_USER_CM_CMD_GET_OPTION:
      r.err = ENOSYS;  // as the kernel: no handler
      break;
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST: {
      rdma_ucm_join_ip_mcast cmd;
      take(in, &cmd);
      cmd_join(c, cmd.id, cmd.uid, &cmd.addr, sizeof cmd.addr, RDMA_MC_JOIN_FLAG_FULLMEMBER, h.out, &r);
      break;
    }
    case RDMA_USER_CM_CMD_JOIN_MCAST: {
      rdma_ucm_join_mcast cmd;
      take(in, &cmd);
      if (cmd.addr_size > sizeof cmd.addr) r.err = EINVAL;
      else cmd_join(c, cmd.id, cmd.uid, &cmd.addr, cmd.addr_size, cmd.join_flags, h.out, &r);
      break;
    }
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
      cmd_leave(c, in, h.out, &r);
      break;
    default:
      r.err = EINVAL;  // ucma_write: a command beyond its table
      break;
  }
  return r;
}

void CmService::Impl::cmd_create(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_create_id cmd;
  take(in, &cmd);
  if (out < sizeof(rdma_ucm_create_id_resp)) {
    r->err = ENOSPC;
    return;
  }
  uint8_t qp_type;
  switch (cmd.ps) {
    case RDMA_PS_TCP:
      qp_type = IBV_QPT_RC;
      break;
    case RDMA_PS_UDP:
    case RDMA_PS_IPOIB:
      qp_type = IBV_QPT_UD;
      break;
    case RDMA_PS_IB:
      qp_type = cmd.qp_type;
      break;
    default:
      r->err = EINVAL;
      return;
  }
  Id* id = new_id(&c, cmd.uid, cmd.ps, qp_type);
  rdma_ucm_create_id_resp resp{};
  resp.id = id->handle;
  put(r, resp, out);
}

void CmService::Impl::cmd_destroy(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_destroy_id cmd;
  take(in, &cmd);
  if (out < sizeof(rdma_ucm_destroy_id_resp)) {
    r->err = ENOSPC;
    return;
  }
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  bool drained = false;
  rdma_ucm_destroy_id_resp resp{};
  resp.events_reported = destroy_id(id, &drained);
  if (drained) r->flags |= SHMRDMA_CM_REPLY_DRAIN;
  put(r, resp, out);
}

void CmService::Impl::cmd_bind(Channel& c, uint32_t handle, const void* addr, size_t len, ReplyOut* r) {
  Id* id = find(c, handle, &r->err);
  if (!id) return;
  Addr a;
  if ((r->err = parse_addr(addr, len, &a))) return;
  if (id->st != St::Idle) {
    r->err = EINVAL;
    return;
  }
  DevBind d;
  if (!a.any() && !a.loopback()) {
    if (!local_ip(a)) {
      r->err = EADDRNOTAVAIL;
      return;
    }
    if ((r->err = set_device_for(a, &d))) return;  // a local address no RoCE device holds: ENODEV
  }
  const Addr old = id->src;
  id->src = a;
  if ((r->err = bind_port(id, a.port))) {
    id->src = old;
    return;
  }
  id->dev = d;
  id->st = St::Bound;
}

void CmService::Impl::cmd_resolve(Channel& c, uint32_t handle, const Addr* src, const Addr& dst, ReplyOut* r) {
  Id* id = find(c, handle, &r->err);
  if (!id) return;
  if (id->st == St::Idle) {
    Addr s;
    if (src) {
      s = *src;
    } else {
      s.family = dst.family;
      if (dst.v4()) s.ip[10] = s.ip[11] = 0xff;
    }
    ReplyOut br;
    sockaddr_in6 sa{};
    store_addr(s, &sa, sizeof sa);
    cmd_bind(c, handle, &sa, sizeof sa, &br);
    if (br.err) {
      r->err = br.err;
      return;
    }
  }
  if (id->st != St::Bound && id->st != St::AddrResolved) {
    r->err = EINVAL;
    return;
  }
  id->dst = dst;
  int status = 0;
  // The source: the bound address, else the one the host would route from.
  Addr s = id->src;
  if (s.any() || s.loopback()) {
    if (dst.loopback()) {
      status = -loopback_source(&s);
    } else {
      int u = ::socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      sockaddr_in6 sa{};
      sa.sin6_family = AF_INET6;
      sa.sin6_port = htons(4791);
      std::memcpy(&sa.sin6_addr, dst.ip, 16);
      socklen_t len = sizeof sa;
      if (u >= 0 && ::connect(u, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
          ::getsockname(u, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
        std::memcpy(s.ip, &sa.sin6_addr, 16);
      } else {
        status = -(errno ? errno : ENETUNREACH);
      }
      if (u >= 0) ::close(u);
    }
  }
  DevBind d = id->dev;
  if (status == 0 && !d.set) status = -set_device_for(s, &d);
  if (status == 0) {
    // The destination: the GID some device of the home holds.
    uint8_t dgid[16];
    std::memcpy(dgid, dst.loopback() ? s.ip : dst.ip, 16);
    const bool mcast = dst.v4() ? (dst.ip[12] & 0xf0) == 0xe0 : dst.ip[0] == 0xff;  // a group: no peer to find
    if (!mcast && peer_for(dgid).empty()) status = -EHOSTUNREACH;
    else std::memcpy(id->dgid, dgid, 16);
  }
  if (status) {
    queue(id, event_for(id, RDMA_CM_EVENT_ADDR_ERROR, status), id->handle);
    return;
  }
  id->dev = d;
  if (id->src.any() || id->src.loopback()) {
    const uint16_t port = id->src.port;
    std::memcpy(id->src.ip, s.ip, 16);
    id->src.family = dst.family;
    id->src.port = port;
  }
  id->st = St::AddrResolved;
  queue(id, event_for(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0), id->handle);
}

void CmService::Impl::cmd_query_route(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_query cmd;
  take(in, &cmd);
  if (out < sizeof(rdma_ucm_query_route_resp)) {
    r->err = ENOSPC;
    return;
  }
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  rdma_ucm_query_route_resp resp{};
  store_addr(id->src, &resp.src_addr, sizeof resp.src_addr);
  store_addr(id->dst, &resp.dst_addr, sizeof resp.dst_addr);
  resp.ibdev_index = 0xffffffff;  // unknown: librdmacm matches the node GUID
  if (id->dev.set) {
    resp.node_guid = htobe64(id->dev.node_guid);
    resp.port_num = static_cast<uint8_t>(id->dev.port);
    ib_user_path_rec& p = resp.ib_route[0];
    std::memcpy(p.sgid, id->dev.sgid, 16);
    std::memcpy(p.dgid, id->dgid, 16);
    p.pkey = htons(0xffff);
    if (id->st >= St::RouteResolved && id->st != St::Listen) {
      resp.num_paths = 1;
      p.reversible = 1;
      p.numb_path = 1;
      p.mtu = id->dev.active_mtu;
      p.mtu_selector = 2;  // exactly
      p.hop_limit = kHopLimit;
      p.traffic_class = id->tos;
      p.rate = 3;  // 10 Gb/s, nominal
      p.rate_selector = 2;
      p.packet_life_time = 16;
      p.packet_life_time_selector = 2;
    }
  }
  put(r, resp, out);
}

void CmService::Impl::cmd_query(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_query cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  if (cmd.option != RDMA_USER_CM_QUERY_ADDR) {
    r->err = ENOSYS;  // path and GID queries belong to the AF_IB set, which the probe never chooses here
    return;
  }
  if (out < sizeof(rdma_ucm_query_addr_resp)) {
    r->err = ENOSPC;
    return;
  }
  rdma_ucm_query_addr_resp resp{};
  if (id->dev.set) {
    resp.node_guid = htobe64(id->dev.node_guid);
    resp.port_num = static_cast<uint8_t>(id->dev.port);
  }
  resp.pkey = htons(0xffff);
  resp.src_size = resp.dst_size = sizeof(sockaddr_in6);
  store_addr(id->src, &resp.src_addr, sizeof resp.src_addr);
  store_addr(id->dst, &resp.dst_addr, sizeof resp.dst_addr);
  resp.ibdev_index = 0xffffffff;
  put(r, resp, out);
}

// Loopback: the first active RoCE device of this namespace (in name
// order), its first IPv4 GID (else its first non-link-local one), as the
// kernel takes the first active port for a loopback destination.
int CmService::Impl::loopback_source(Addr* s) {
  for (const std::string& n : list_devices(home)) {
    Registry reg;
    if (Registry::attach(device_paths(home, n), &reg) != 0) continue;
    const layout::NetBinding& b = reg.device().net;
    if (b.link_layer != layout::kLinkLayerEthernet || b.netns_dev != paths.netns_dev || b.netns_ino != paths.netns_ino)
      continue;
    PortNetView v;
    if (reg.port_net_settled(1, &v) != 0 || v.state != IBV_PORT_ACTIVE) continue;
    int pick = -1;
    for (uint32_t i = 0; i < limits::kGidTableLen; ++i) {
      if (!v.valid(i) || v.gids[i].gid[0] == 0xfe) continue;
      Addr a;
      std::memcpy(a.ip, v.gids[i].gid, 16);
      if (a.v4()) {
        pick = static_cast<int>(i);
        break;
      }
      if (pick < 0) pick = static_cast<int>(i);
    }
    if (pick < 0) continue;
    std::memcpy(s->ip, v.gids[pick].gid, 16);
    return 0;
  }
  return EADDRNOTAVAIL;
}

std::string CmService::Impl::peer_for(const uint8_t gid[16]) {
  GidMatch m;
  if (!gids.lookup(gid, kGidTypeAny, &m)) {
    gids.refresh();
    if (!gids.lookup(gid, kGidTypeAny, &m)) return {};
  }
  const layout::NetBinding& b = m.registry->device().net;
  if (b.link_layer != layout::kLinkLayerEthernet) return {};
  return cm_mad_path(daemon_paths(home, b.netns_dev, b.netns_ino));
}

uint32_t CmService::Impl::new_comm(uint32_t handle) {
  uint32_t comm;
  do comm = static_cast<uint32_t>(rng());
  while (!comm || by_comm.count(comm));
  by_comm[comm] = handle;
  return comm;
}

// False only when the peer's socket is gone (its daemon is not running).
// A full receive queue (unix datagram sockets hold max_dgram_qlen
// messages, 10 by default: a burst of connects fills it) is not a loss: the
// message waits in the outbox and goes out from the timer loop.
bool CmService::Impl::send_mad(const std::string& peer, const cm::Mad& m) {
  if (peer.empty()) return false;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (peer.size() >= sizeof a.sun_path) return false;
  std::memcpy(a.sun_path, peer.c_str(), peer.size() + 1);
  if (outbox.empty() || outbox.size() > kMaxOutbox) {
    if (::sendto(mad_fd, &m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&a), sizeof a) ==
        static_cast<ssize_t>(sizeof m))
      return true;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS && errno != EINTR) return false;
    if (outbox.size() > kMaxOutbox) return true;  // as a lost datagram: the retransmission timer covers it
  }
  outbox.push_back(Outgoing{peer, m, now_ms()});
  return true;
}

void CmService::Impl::flush_outbox() {
  const int64_t now = now_ms();
  while (!outbox.empty()) {
    Outgoing& o = outbox.front();
    if (now - o.since > kOutboxMaxAgeMs) {  // as a lost datagram
      outbox.pop_front();
      continue;
    }
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, o.peer.c_str(), o.peer.size() + 1);
    if (::sendto(mad_fd, &o.mad, sizeof o.mad, MSG_DONTWAIT | MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&a),
                 sizeof a) != static_cast<ssize_t>(sizeof o.mad) &&
        (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EINTR))
      return;  // still full: try again on the next tick
    outbox.pop_front();
  }
}

void CmService::Impl::send_rej(const std::string& peer, uint32_t local_comm, uint32_t remote_comm, uint16_t reason,
                               uint8_t msg, const uint8_t* pd, size_t pd_len) {
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrRej, local_comm ? local_comm : remote_comm);
  m.rej.local_comm_id.set(local_comm);
  m.rej.remote_comm_id.set(remote_comm);
  m.rej.msg_rejected.set_bits(7, 6, msg);
  m.rej.reason.set(reason);
  if (pd && pd_len) std::memcpy(m.rej.private_data, pd, std::min(pd_len, cm::kRejPrivate));
  send_mad(peer, m);
}

void CmService::Impl::arm(Id* id, const cm::Mad& m) {
  id->last = m;
  id->retries_left = kMaxRetries;
  id->retry_at = now_ms() + kRetryMs;
}

void CmService::Impl::cmd_connect(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_connect cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  const rdma_ucm_conn_param& p = cmd.conn_param;
  if (id->st != St::RouteResolved || !id->dev.set) {
    r->err = EINVAL;
    return;
  }
  if (id->qp_type == IBV_QPT_UD) {
    cmd_connect_ud(id, p, r);
    return;
  }
  if (p.private_data_len > cm::kUserReqPrivate) {
    r->err = EINVAL;
    return;
  }
  id->peer = peer_for(id->dgid);
  if (id->peer.empty()) {
    r->err = EHOSTUNREACH;
    return;
  }
  id->local_comm = new_comm(id->handle);
  id->local_qpn = p.qp_num & 0xffffff;
  id->local_psn = static_cast<uint32_t>(rng()) & 0xffffff;
  id->responder_resources = p.responder_resources;
  id->initiator_depth = p.initiator_depth;
  id->retry_count = p.retry_count & 7;
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrReq, id->local_comm);
  cm::Req& q = m.req;
  q.local_comm_id.set(id->local_comm);
  q.service_id.set(service_id_of(id->ps, id->dst.port));
  q.local_ca_guid.set(id->dev.node_guid);
  q.qpn_resp.set_bits(31, 8, id->local_qpn);
  q.qpn_resp.set_bits(7, 0, p.responder_resources);
  q.eecn_init.set_bits(7, 0, p.initiator_depth);
  q.reecn_misc.set_bits(7, 3, 20);  // remote CM response timeout
  q.reecn_misc.set_bits(2, 1, id->qp_type == IBV_QPT_UC ? 1 : 0);
  q.reecn_misc.set_bits(0, 0, p.flow_control & 1);
  q.psn_misc.set_bits(31, 8, id->local_psn);
  q.psn_misc.set_bits(7, 3, 20);
  q.psn_misc.set_bits(2, 0, p.retry_count & 7);
  q.pkey.set(0xffff);
  q.mtu_rnr.set_bits(7, 4, id->dev.active_mtu);
  q.mtu_rnr.set_bits(2, 0, p.rnr_retry_count & 7);
  q.retries_srq.set_bits(7, 4, 15);
  q.retries_srq.set_bits(3, 3, p.srq ? 1 : 0);
  std::memcpy(q.primary.local_gid, id->dev.sgid, 16);
  std::memcpy(q.primary.remote_gid, id->dgid, 16);
  q.primary.traffic_class = id->tos;
  q.primary.hop_limit = kHopLimit;
  q.primary.ack_timeout.set_bits(7, 3, id->ack_timeout ? id->ack_timeout : kDefaultAckTimeout);
  cm::CmaHeader hdr{};
  hdr.ip_version = id->dst.v4() ? 4 << 4 : 6 << 4;
  hdr.port.set(id->src.port);
  std::memcpy(hdr.src_addr, id->src.ip, 16);
  std::memcpy(hdr.dst_addr, id->dst.ip, 16);
  std::memcpy(q.private_data, &hdr, sizeof hdr);
  std::memcpy(q.private_data + sizeof hdr, p.private_data, p.private_data_len);
  id->st = St::ReqSent;
  arm(id, m);
  if (!send_mad(id->peer, m)) id->retry_at = now_ms();  // the peer daemon is not there: fail at once
}

void CmService::Impl::cmd_listen(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_listen cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  if (id->st == St::Idle) {
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    ReplyOut br;
    cmd_bind(c, cmd.id, &sa, sizeof sa, &br);
    if ((r->err = br.err)) return;
  }
  if (id->st != St::Bound && id->st != St::Listen) {
    r->err = EINVAL;
    return;
  }
  for (auto& [h, o] : ids) {
    if (o.get() == id || o->st != St::Listen || o->ps != id->ps || o->src.port != id->src.port) continue;
    if (o->src.any() || id->src.any() || o->src.same_ip(id->src)) {
      r->err = EADDRINUSE;
      return;
    }
  }
  id->backlog = cmd.backlog > 0 && cmd.backlog < kMaxBacklog ? cmd.backlog : kMaxBacklog;
  id->st = St::Listen;
}

void CmService::Impl::cmd_accept(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_accept cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  const rdma_ucm_conn_param& p = cmd.conn_param;
  if (id->st == St::RepRcvd) {
    // The active side after CONNECT_RESPONSE: librdmacm moved its QP, we send the RTU.
    cm::Mad m;
    cm::init_mad(&m, cm::kAttrRtu, id->local_comm);
    m.rtu.local_comm_id.set(id->local_comm);
    m.rtu.remote_comm_id.set(id->remote_comm);
    if (p.valid && p.private_data_len)
      std::memcpy(m.rtu.private_data, p.private_data, std::min<size_t>(p.private_data_len, cm::kRtuPrivate));
    send_mad(id->peer, m);
    id->last = m;  // a duplicate REP is answered with it again
    id->retry_at = -1;
    id->st = St::Established;
    return;
  }
  if (id->st != St::ReqRcvd) {
    r->err = EINVAL;
    return;
  }
  if (id->qp_type == IBV_QPT_UD) {
    cmd_accept_ud(id, cmd, r);
    return;
  }
  if (p.private_data_len > cm::kRepPrivate) {
    r->err = EINVAL;
    return;
  }
  id->uid = cmd.uid;
  id->local_qpn = p.qp_num & 0xffffff;
  id->local_psn = static_cast<uint32_t>(rng()) & 0xffffff;
  id->responder_resources = p.responder_resources;
  id->initiator_depth = p.initiator_depth;
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrRep, id->local_comm);
  cm::Rep& q = m.rep;
  q.local_comm_id.set(id->local_comm);
  q.remote_comm_id.set(id->remote_comm);
  q.local_qpn.set_bits(31, 8, id->local_qpn);
  q.starting_psn.set_bits(31, 8, id->local_psn);
  q.responder_resources = p.responder_resources;
  q.initiator_depth = p.initiator_depth;
  q.ack_failover.set_bits(7, 3, 15);
  q.ack_failover.set_bits(0, 0, p.flow_control & 1);
  q.rnr_srq.set_bits(7, 5, p.rnr_retry_count & 7);
  q.rnr_srq.set_bits(4, 4, p.srq ? 1 : 0);
  q.local_ca_guid.set(id->dev.node_guid);
  std::memcpy(q.private_data, p.private_data, p.private_data_len);
  id->st = St::RepSent;
  arm(id, m);
  if (!send_mad(id->peer, m)) id->retry_at = now_ms();
}

void CmService::Impl::cmd_reject(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_reject cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  if (id->st != St::ReqRcvd && id->st != St::RepRcvd) {
    r->err = EINVAL;
    return;
  }
  if (cmd.private_data_len > cm::kRejPrivate) {
    r->err = EINVAL;
    return;
  }
  const uint16_t reason = cmd.reason ? uint16_t{cmd.reason} : uint16_t{cm::kRejConsumer};
  if (reason != cm::kRejConsumer && reason != 35 /* vendor option not supported */) {
    r->err = EINVAL;
    return;
  }
  if (id->qp_type == IBV_QPT_UD) {
    if (cmd.private_data_len > cm::kSidrRepPrivate) {
      r->err = EINVAL;
      return;
    }
    cm::Mad m;
    cm::init_mad(&m, cm::kAttrSidrRep, id->remote_comm);
    m.sidr_rep.request_id.set(id->remote_comm);
    m.sidr_rep.status = cm::kSidrReject;
    std::memcpy(m.sidr_rep.private_data, cmd.private_data, cmd.private_data_len);
    send_mad(id->peer, m);
    id->st = St::Rejected;
    return;
  }
  send_rej(id->peer, id->local_comm, id->remote_comm, reason, id->st == St::RepRcvd ? 1 : 0, cmd.private_data,
           cmd.private_data_len);
  id->retry_at = -1;
  id->st = St::Rejected;
}

void CmService::Impl::cmd_disconnect(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_disconnect cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  switch (id->st) {
    case St::Established: {
      cm::Mad m;
      cm::init_mad(&m, cm::kAttrDreq, id->local_comm);
      m.dreq.local_comm_id.set(id->local_comm);
      m.dreq.remote_comm_id.set(id->remote_comm);
      m.dreq.remote_qpn.set_bits(31, 8, id->remote_qpn);
      id->st = St::DreqSent;
      arm(id, m);
      if (!send_mad(id->peer, m)) id->retry_at = now_ms();
      return;
    }
    case St::RepSent:
    case St::RepRcvd:
    case St::ReqSent:
      teardown(id);
      id->st = St::Disconnected;
      return;
    case St::DreqSent:
    case St::Disconnected:
      return;  // the DREP went out when the DREQ came (or ours is on its way)
    default:
      r->err = EINVAL;
      return;
  }
}

void CmService::Impl::cmd_init_qp_attr(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_init_qp_attr cmd;
  take(in, &cmd);
  if (out < sizeof(ib_uverbs_qp_attr)) {
    r->err = ENOSPC;
    return;
  }
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  if (!id->dev.set) {
    r->err = EINVAL;
    return;
  }
  ib_uverbs_qp_attr a{};
  a.qp_state = cmd.qp_state;
  a.port_num = static_cast<uint8_t>(id->dev.port);
  const bool conn = id->remote_qpn != 0 || id->st == St::RepSent || id->st == St::RepRcvd ||
                    id->st == St::Established || id->st == St::ReqRcvd;
  const bool ud = id->qp_type == IBV_QPT_UD;
  switch (cmd.qp_state) {
    case IBV_QPS_INIT:
      a.qp_attr_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
      a.pkey_index = 0;
      if (ud) {
        a.qp_attr_mask |= IBV_QP_QKEY;
        a.qkey = id->qkey;
      } else {
        a.qp_attr_mask |= IBV_QP_ACCESS_FLAGS;
        // Before the exchange: no remote access (cma.c); after it what the
        // connection grants (cm.c: remote write, read and atomics with
        // responder resources).
        if (conn)
          a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE |
                              (id->responder_resources ? uint32_t{IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC} : 0u);
      }
      break;
    case IBV_QPS_RTR:
      if (ud) {
        a.qp_attr_mask = IBV_QP_STATE;
        break;
      }
      if (!conn || !id->remote_qpn) {
        r->err = EINVAL;
        return;
      }
      a.qp_attr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
      if (id->qp_type == IBV_QPT_RC) a.qp_attr_mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      a.path_mtu = id->dev.active_mtu;
      a.dest_qp_num = id->remote_qpn;
      a.rq_psn = id->remote_psn;
      a.max_dest_rd_atomic = id->responder_resources;
      a.min_rnr_timer = 0;
      std::memcpy(a.ah_attr.grh.dgid, id->dgid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(id->dev.gid_index);
      a.ah_attr.grh.hop_limit = kHopLimit;
      a.ah_attr.grh.traffic_class = id->tos;
      a.ah_attr.is_global = 1;
      a.ah_attr.port_num = static_cast<uint8_t>(id->dev.port);
      break;
    case IBV_QPS_RTS:
      if (ud) {
        a.qp_attr_mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
        break;
      }
      if (!conn || !id->remote_qpn) {
        r->err = EINVAL;
        return;
      }
      a.qp_attr_mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY;
      if (id->qp_type == IBV_QPT_RC) a.qp_attr_mask |= IBV_QP_MAX_QP_RD_ATOMIC;
      a.sq_psn = id->local_psn;
      a.timeout = id->ack_timeout ? id->ack_timeout : kDefaultAckTimeout;
      a.retry_cnt = id->retry_count;
      a.rnr_retry = id->rnr_retry;
      a.max_rd_atomic = id->initiator_depth;
      break;
    default:
      r->err = EINVAL;
      return;
  }
  put(r, a, out);
}

void CmService::Impl::cmd_get_event(Channel& c, uint16_t out, ReplyOut* r) {
  if (out < sizeof(rdma_ucm_event_resp)) {
    r->err = ENOSPC;
    return;
  }
  if (c.events.empty()) {
    r->flags |= SHMRDMA_CM_REPLY_EMPTY;
    return;
  }
  Event ev = c.events.front();
  c.events.pop_front();
  if (c.events.empty()) r->flags |= SHMRDMA_CM_REPLY_DRAIN;
  auto it = ids.find(ev.owner);
  if (it != ids.end()) it->second->events_reported++;
  if (ev.mc) {
    auto j = joins.find(ev.mc);
    if (j != joins.end()) j->second.events_reported++;
  }
  if (ev.child) {
    auto ch = ids.find(ev.child);
    if (ch != ids.end()) ch->second->reported = true;
  }
  put(r, ev.resp, out);
}

void CmService::Impl::cmd_set_option(Channel& c, const std::vector<uint8_t>& in, const std::vector<uint8_t>& opt,
                                     ReplyOut* r) {
  rdma_ucm_set_option cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  if (cmd.optlen != opt.size()) {
    r->err = EINVAL;
    return;
  }
  if (cmd.level == RDMA_OPTION_ID) {
    switch (cmd.optname) {
      case RDMA_OPTION_ID_TOS:
        if (opt.size() != 1) break;
        id->tos = opt[0];
        return;
      case RDMA_OPTION_ID_REUSEADDR:
      case RDMA_OPTION_ID_AFONLY: {
        if (opt.size() != sizeof(int)) break;
        int v;
        std::memcpy(&v, opt.data(), sizeof v);
        if (id->st != St::Idle) break;  // rdma_set_reuseaddr / rdma_set_afonly: EINVAL once bound
        if (cmd.optname == RDMA_OPTION_ID_REUSEADDR) id->reuseaddr = v != 0;
        else id->afonly = v != 0;
        return;
      }
      case RDMA_OPTION_ID_ACK_TIMEOUT:
        if (opt.size() != 1) break;
        id->ack_timeout = std::min<uint8_t>(opt[0], 31);
        return;
      default:
        r->err = ENOSYS;
        return;
    }
    r->err = EINVAL;
    return;
  }
  if (cmd.level == RDMA_OPTION_IB && cmd.optname == RDMA_OPTION_IB_PATH) {
    r->err = EINVAL;  // RoCE: paths come from address resolution, not from an SA
    return;
  }
  r->err = ENOSYS;
}

void CmService::Impl::cmd_notify(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_notify cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  // IBV_EVENT_COMM_EST on the passive side stands for the RTU (cm.c ib_cm_notify).
  if (cmd.event == IBV_EVENT_COMM_EST && id->st == St::RepSent) {
    id->retry_at = -1;
    id->st = St::Established;
    queue(id, event_for(id, RDMA_CM_EVENT_ESTABLISHED, 0), id->handle);
  }
}

void CmService::Impl::cmd_migrate(Channel& c, const shmrdma_cm_request& h, const std::vector<uint8_t>& in,
                                  uint16_t out, ReplyOut* r) {
  rdma_ucm_migrate_id cmd;
  take(in, &cmd);
  if (out < sizeof(rdma_ucm_migrate_resp)) {
    r->err = ENOSPC;
    return;
  }
  Channel* from = nullptr;
  for (auto& ch : channels)
    if (ch->key == h.peer_key && !ch->dead) from = ch.get();
  if (!from) {
    r->err = EINVAL;
    return;
  }
  Id* id = find(*from, cmd.id, &r->err);
  if (!id) return;
  rdma_ucm_migrate_resp resp{};
  resp.events_reported = id->events_reported;
  if (from != &c) {
    const bool had_old = !from->events.empty(), had_new = !c.events.empty();
    std::vector<Event> moving;
    std::erase_if(from->events, [&](const Event& e) {
      if (e.owner != id->handle) return false;
      moving.push_back(e);
      return true;
    });
    id->ch = &c;
    for (const Event& e : moving) {
      c.events.push_back(e);
      if (e.child) {
        auto ch = ids.find(e.child);
        if (ch != ids.end()) ch->second->ch = &c;
      }
    }
    if (had_old && from->events.empty()) r->flags |= SHMRDMA_CM_REPLY_DRAIN_PEER;
    if (!had_new && !c.events.empty()) token(c);
  }
  put(r, resp, out);
}

// ------------------------------------------------------------- the exchange

Id* CmService::Impl::by_local_comm(uint32_t comm, const std::string& from) {
  auto it = by_comm.find(comm);
  if (it == by_comm.end()) return nullptr;
  auto id = ids.find(it->second);
  if (id == ids.end() || id->second->peer != from) return nullptr;
  return id->second.get();
}

void CmService::Impl::on_req(const std::string& from, const cm::Mad& m) {
  const cm::Req& q = m.req;
  const uint32_t remote_comm = static_cast<uint32_t>(q.local_comm_id.get());
  // A retransmission of a REQ we already took: answer as before.
  for (auto& [h, o] : ids)
    if (o->remote_comm == remote_comm && o->peer == from && o->local_comm) {
      if (o->st == St::RepSent) send_mad(from, o->last);
      return;
    }
  const uint64_t sid = q.service_id.get();
  const uint16_t ps = static_cast<uint16_t>(sid >> 16), port = static_cast<uint16_t>(sid);
  cm::CmaHeader hdr;
  std::memcpy(&hdr, q.private_data, sizeof hdr);
  Addr dst, src;
  std::memcpy(dst.ip, hdr.dst_addr, 16);
  std::memcpy(src.ip, hdr.src_addr, 16);
  dst.family = src.family = (hdr.ip_version >> 4) == 4 ? AF_INET : AF_INET6;
  dst.port = port;
  src.port = static_cast<uint16_t>(hdr.port.get());
  Id* l = nullptr;
  if ((sid >> 32) == 0 && hdr.cma_version == 0) {
    for (auto& [h, o] : ids) {
      if (o->st != St::Listen || o->ps != ps || o->src.port != port) continue;
      if (!o->src.any() && !o->src.same_ip(dst) && !(o->src.loopback() && dst.loopback())) continue;
      if (o->afonly == 1 && o->src.family != dst.family && !o->src.any()) continue;
      l = o.get();
      break;
    }
  }
  if (!l) {
    send_rej(from, 0, remote_comm, cm::kRejInvalidServiceId, 0, nullptr, 0);
    return;
  }
  uint32_t pending = 0;
  for (auto& [h, o] : ids) pending += o->listener == l->handle && !o->reported;
  Addr here;
  std::memcpy(here.ip, q.primary.remote_gid, 16);
  DevBind d;
  if (pending >= l->backlog || set_device_for(here, &d) != 0) {
    send_rej(from, 0, remote_comm, cm::kRejNoResources, 0, nullptr, 0);
    return;
  }
  // uid 0 until ACCEPT names one (ucma): events before that (a REJ) reach
  // librdmacm by handle, which drops them as the kernel's would be dropped.
  Id* id = new_id(l->ch, 0, l->ps, l->qp_type);
  id->listener = l->handle;
  id->st = St::ReqRcvd;
  id->src = dst;
  id->dst = src;
  id->port_bound = false;
  id->dev = d;
  std::memcpy(id->dgid, q.primary.local_gid, 16);
  id->peer = from;
  id->remote_comm = remote_comm;
  id->local_comm = new_comm(id->handle);
  id->remote_qpn = q.qpn_resp.bits(31, 8);
  id->remote_psn = q.psn_misc.bits(31, 8);
  // From the passive side's view (cm.c cm_format_req_event): what the
  // active side reads at once is what we must answer as responder.
  id->responder_resources = static_cast<uint8_t>(q.eecn_init.bits(7, 0));
  id->initiator_depth = static_cast<uint8_t>(q.qpn_resp.bits(7, 0));
  id->retry_count = static_cast<uint8_t>(q.psn_misc.bits(2, 0));
  id->rnr_retry = static_cast<uint8_t>(q.mtu_rnr.bits(2, 0));
  id->tos = q.primary.traffic_class;
  id->ack_timeout = static_cast<uint8_t>(q.primary.ack_timeout.bits(7, 3));
  const uint32_t mtu = q.mtu_rnr.bits(7, 4);
  if (mtu >= IBV_MTU_256 && mtu < id->dev.active_mtu) id->dev.active_mtu = mtu;
  Event ev = event_for(l, RDMA_CM_EVENT_CONNECT_REQUEST, 0);
  ev.resp.id = id->handle;
  ev.child = id->handle;
  rdma_ucm_conn_param& p = ev.resp.param.conn;
  p.qp_num = id->remote_qpn;
  std::memcpy(p.private_data, q.private_data + sizeof hdr, cm::kUserReqPrivate);
  p.private_data_len = cm::kUserReqPrivate;
  p.responder_resources = id->responder_resources;
  p.initiator_depth = id->initiator_depth;
  p.flow_control = static_cast<uint8_t>(q.reecn_misc.bits(0, 0));
  p.retry_count = id->retry_count;
  p.rnr_retry_count = id->rnr_retry;
  p.srq = static_cast<uint8_t>(q.retries_srq.bits(3, 3));
  p.valid = 1;
  queue(l, ev, l->handle);
}

void CmService::Impl::on_rep(const std::string& from, const cm::Mad& m) {
  const cm::Rep& q = m.rep;
  Id* id = by_local_comm(static_cast<uint32_t>(q.remote_comm_id.get()), from);
  if (!id) {
    send_rej(from, 0, static_cast<uint32_t>(q.local_comm_id.get()), cm::kRejInvalidCommId, 1, nullptr, 0);
    return;
  }
  if (id->st == St::Established && id->last.hdr.attr_id.get() == cm::kAttrRtu) {
    send_mad(from, id->last);  // our RTU was lost
    return;
  }
  if (id->st != St::ReqSent) return;
  id->remote_comm = static_cast<uint32_t>(q.local_comm_id.get());
  id->remote_qpn = q.local_qpn.bits(31, 8);
  id->remote_psn = q.starting_psn.bits(31, 8);
  id->rnr_retry = static_cast<uint8_t>(q.rnr_srq.bits(7, 5));
  // As cm.c cm_rep_handler: the peer's responder resources are our
  // initiator depth, its initiator depth our responder resources.
  id->initiator_depth = q.responder_resources;
  id->responder_resources = q.initiator_depth;
  id->retry_at = -1;
  id->st = St::RepRcvd;
  Event ev = event_for(id, RDMA_CM_EVENT_CONNECT_RESPONSE, 0);
  rdma_ucm_conn_param& p = ev.resp.param.conn;
  p.qp_num = id->remote_qpn;
  std::memcpy(p.private_data, q.private_data, cm::kRepPrivate);
  p.private_data_len = static_cast<uint8_t>(cm::kRepPrivate);
  p.responder_resources = id->responder_resources;  // swapped, as cm_format_rep_event
  p.initiator_depth = id->initiator_depth;
  p.flow_control = static_cast<uint8_t>(q.ack_failover.bits(0, 0));
  p.rnr_retry_count = id->rnr_retry;
  p.srq = static_cast<uint8_t>(q.rnr_srq.bits(4, 4));
  p.valid = 1;
  queue(id, ev, id->handle);
}

void CmService::Impl::on_rtu(const std::string& from, const cm::Mad& m) {
  Id* id = by_local_comm(static_cast<uint32_t>(m.rtu.remote_comm_id.get()), from);
  if (!id || id->st != St::RepSent || id->remote_comm != m.rtu.local_comm_id.get()) return;
  id->retry_at = -1;
  id->st = St::Established;
  queue(id, event_for(id, RDMA_CM_EVENT_ESTABLISHED, 0), id->handle);
}

void CmService::Impl::on_rej(const std::string& from, const cm::Mad& m) {
  Id* id = by_local_comm(static_cast<uint32_t>(m.rej.remote_comm_id.get()), from);
  if (!id && m.rej.remote_comm_id.get() == 0) {
    // The active side gave up before it saw our REP: it knows only its own comm id.
    const uint32_t theirs = static_cast<uint32_t>(m.rej.local_comm_id.get());
    for (auto& [h, o] : ids)
      if (o->remote_comm == theirs && o->peer == from && o->local_comm && o->listener) id = o.get();
  }
  if (!id) return;
  if (id->st != St::ReqSent && id->st != St::RepSent && id->st != St::RepRcvd && id->st != St::ReqRcvd) return;
  id->retry_at = -1;
  by_comm.erase(id->local_comm);
  id->local_comm = 0;
  const bool passive_unreported = id->st == St::ReqRcvd && !id->reported;
  id->st = St::Rejected;
  if (passive_unreported) return;  // the REQ's event is still queued: the application learns on accept
  Event ev = event_for(id, RDMA_CM_EVENT_REJECTED, static_cast<int32_t>(m.rej.reason.get()));
  rdma_ucm_conn_param& p = ev.resp.param.conn;
  std::memcpy(p.private_data, m.rej.private_data, cm::kRejPrivate);
  p.private_data_len = static_cast<uint8_t>(cm::kRejPrivate);
  p.valid = 1;
  queue(id, ev, id->handle);
}

void CmService::Impl::on_dreq(const std::string& from, const cm::Mad& m) {
  const uint32_t remote = static_cast<uint32_t>(m.dreq.local_comm_id.get());
  cm::Mad rep;
  cm::init_mad(&rep, cm::kAttrDrep, m.hdr.tid.get());
  rep.drep.remote_comm_id.set(remote);
  Id* id = by_local_comm(static_cast<uint32_t>(m.dreq.remote_comm_id.get()), from);
  if (id && id->remote_comm == remote) {
    rep.drep.local_comm_id.set(id->local_comm);
    send_mad(from, rep);
    if (id->st == St::Established || id->st == St::RepSent || id->st == St::RepRcvd || id->st == St::DreqSent) {
      id->retry_at = -1;
      id->st = St::Disconnected;
      queue(id, event_for(id, RDMA_CM_EVENT_DISCONNECTED, 0), id->handle);
    }
    return;
  }
  rep.drep.local_comm_id.set(static_cast<uint32_t>(m.dreq.remote_comm_id.get()));
  send_mad(from, rep);  // an id already gone (or a retransmission): the DREQ is answered anyway
}

void CmService::Impl::on_drep(const std::string& from, const cm::Mad& m) {
  Id* id = by_local_comm(static_cast<uint32_t>(m.drep.remote_comm_id.get()), from);
  if (!id || id->st != St::DreqSent) return;
  id->retry_at = -1;
  id->st = St::Disconnected;
  queue(id, event_for(id, RDMA_CM_EVENT_DISCONNECTED, 0), id->handle);
}

void CmService::Impl::on_mad() {
  for (int round = 0; round < 64; ++round) {
    cm::Mad m;
    sockaddr_un from{};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(ucred))];
    iovec iov{&m, sizeof m};
    msghdr mh{};
    mh.msg_name = &from;
    mh.msg_namelen = sizeof from;
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = ::recvmsg(mad_fd, &mh, MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0) return;
    const ucred* cred = nullptr;
    for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) cred = reinterpret_cast<ucred*>(CMSG_DATA(c));
    if (!cred || cred->uid != ::geteuid()) continue;  // same user only
    if (!cm::valid_mad(&m, static_cast<size_t>(n))) continue;
    if (mh.msg_namelen <= offsetof(sockaddr_un, sun_path)) continue;
    std::string path(from.sun_path, strnlen(from.sun_path, sizeof from.sun_path));
    const std::string dir = paths.dir + "/netns-";
    if (path.compare(0, dir.size(), dir) != 0 || path.size() < 4 ||
        path.compare(path.size() - 4, 4, SHMRDMA_CM_MAD_SUFFIX) != 0)
      continue;  // not a CM socket of this home
    switch (m.hdr.attr_id.get()) {
      case cm::kAttrReq:
        on_req(path, m);
        break;
      case cm::kAttrRep:
        on_rep(path, m);
        break;
      case cm::kAttrRtu:
        on_rtu(path, m);
        break;
      case cm::kAttrRej:
        on_rej(path, m);
        break;
      case cm::kAttrDreq:
        on_dreq(path, m);
        break;
      case cm::kAttrDrep:
        on_drep(path, m);
        break;
      case cm::kAttrSidrReq:
        on_sidr_req(path, m);
        break;
      case cm::kAttrSidrRep:
        on_sidr_rep(path, m);
        break;
      default:
        break;  // MRA: we never delay, and a peer's MRA needs no answer
    }
  }
}

void CmService::Impl::timers() {
  flush_outbox();
  const int64_t now = now_ms();
  for (auto& [h, idp] : ids) {
    Id* id = idp.get();
    if (id->retry_at < 0 || id->retry_at > now) continue;
    if (id->retries_left-- > 0 && send_mad(id->peer, id->last)) {
      id->retry_at = now + kRetryMs;
      continue;
    }
    id->retry_at = -1;
    switch (id->st) {
      case St::ReqSent:
        by_comm.erase(id->local_comm);
        id->local_comm = 0;
        id->st = St::Rejected;
        queue(id, event_for(id, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT), id->handle);
        break;
      case St::RepSent:
        send_rej(id->peer, id->local_comm, id->remote_comm, cm::kRejTimeout, 1, nullptr, 0);
        by_comm.erase(id->local_comm);
        id->local_comm = 0;
        id->st = St::Rejected;
        queue(id, event_for(id, RDMA_CM_EVENT_CONNECT_ERROR, -ETIMEDOUT), id->handle);
        break;
      case St::DreqSent:
        id->st = St::Disconnected;
        queue(id, event_for(id, RDMA_CM_EVENT_DISCONNECTED, 0), id->handle);
        break;
      default:
        break;
    }
  }
}

// ------------------------------------------------------ UD (SIDR) and multicast

void CmService::Impl::fill_ah(const Id* id, const uint8_t dgid[16], ib_uverbs_ah_attr* ah) {
  std::memset(ah, 0, sizeof *ah);
  std::memcpy(ah->grh.dgid, dgid, 16);
  ah->grh.sgid_index = static_cast<uint8_t>(id->dev.gid_index);
  ah->grh.hop_limit = kHopLimit;
  ah->grh.traffic_class = id->tos;
  ah->is_global = 1;
  ah->port_num = static_cast<uint8_t>(id->dev.port);
}

void CmService::Impl::cmd_connect_ud(Id* id, const rdma_ucm_conn_param& p, ReplyOut* r) {
  if (p.private_data_len > cm::kUserSidrReqPrivate) {
    r->err = EINVAL;
    return;
  }
  id->peer = peer_for(id->dgid);
  if (id->peer.empty()) {
    r->err = EHOSTUNREACH;
    return;
  }
  id->local_comm = new_comm(id->handle);
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrSidrReq, id->local_comm);
  m.sidr_req.request_id.set(id->local_comm);
  m.sidr_req.pkey.set(0xffff);
  m.sidr_req.service_id.set(service_id_of(id->ps, id->dst.port));
  cm::CmaHeader hdr{};
  hdr.ip_version = id->dst.v4() ? 4 << 4 : 6 << 4;
  hdr.port.set(id->src.port);
  std::memcpy(hdr.src_addr, id->src.ip, 16);
  std::memcpy(hdr.dst_addr, id->dst.ip, 16);
  std::memcpy(m.sidr_req.private_data, &hdr, sizeof hdr);
  std::memcpy(m.sidr_req.private_data + sizeof hdr, p.private_data, p.private_data_len);
  id->st = St::ReqSent;
  arm(id, m);
  if (!send_mad(id->peer, m)) id->retry_at = now_ms();
}

void CmService::Impl::cmd_accept_ud(Id* id, const rdma_ucm_accept& cmd, ReplyOut* r) {
  const rdma_ucm_conn_param& p = cmd.conn_param;
  if (p.private_data_len > cm::kSidrRepPrivate) {
    r->err = EINVAL;
    return;
  }
  id->uid = cmd.uid;
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrSidrRep, id->remote_comm);
  m.sidr_rep.request_id.set(id->remote_comm);
  m.sidr_rep.status = cm::kSidrSuccess;
  m.sidr_rep.qpn.set_bits(31, 8, p.qp_num & 0xffffff);
  m.sidr_rep.service_id.set(service_id_of(id->ps, id->src.port));
  m.sidr_rep.qkey.set(p.qkey ? p.qkey : id->qkey);
  std::memcpy(m.sidr_rep.private_data, p.private_data, p.private_data_len);
  send_mad(id->peer, m);
  id->last = m;  // a retransmitted SIDR_REQ is answered with it again
  id->st = St::Established;
}

void CmService::Impl::on_sidr_req(const std::string& from, const cm::Mad& m) {
  const cm::SidrReq& q = m.sidr_req;
  const uint32_t req_id = static_cast<uint32_t>(q.request_id.get());
  for (auto& [h, o] : ids)
    if (o->qp_type == IBV_QPT_UD && o->remote_comm == req_id && o->peer == from && o->listener) {
      if (o->st == St::Established || o->st == St::Rejected) send_mad(from, o->last);
      return;  // a retransmission
    }
  const uint64_t sid = q.service_id.get();
  const uint16_t ps = static_cast<uint16_t>(sid >> 16), port = static_cast<uint16_t>(sid);
  cm::CmaHeader hdr;
  std::memcpy(&hdr, q.private_data, sizeof hdr);
  Addr dst, src;
  std::memcpy(dst.ip, hdr.dst_addr, 16);
  std::memcpy(src.ip, hdr.src_addr, 16);
  dst.family = src.family = (hdr.ip_version >> 4) == 4 ? AF_INET : AF_INET6;
  dst.port = port;
  src.port = static_cast<uint16_t>(hdr.port.get());
  Id* l = nullptr;
  if ((sid >> 32) == 0 && hdr.cma_version == 0)
    for (auto& [h, o] : ids) {
      if (o->st != St::Listen || o->ps != ps || o->src.port != port || o->qp_type != IBV_QPT_UD) continue;
      if (!o->src.any() && !o->src.same_ip(dst) && !(o->src.loopback() && dst.loopback())) continue;
      l = o.get();
      break;
    }
  DevBind d;
  if (!l || set_device_for(dst, &d) != 0) {
    cm::Mad rep;
    cm::init_mad(&rep, cm::kAttrSidrRep, req_id);
    rep.sidr_rep.request_id.set(req_id);
    rep.sidr_rep.status = l ? cm::kSidrNoQp : cm::kSidrUnsupported;
    rep.sidr_rep.service_id.set(sid);
    send_mad(from, rep);
    return;
  }
  Id* id = new_id(l->ch, 0, l->ps, l->qp_type);  // uid 0 until ACCEPT (see on_req)
  id->listener = l->handle;
  id->st = St::ReqRcvd;
  id->src = dst;
  id->dst = src;
  id->dev = d;
  std::memcpy(id->dgid, src.ip, 16);
  id->peer = from;
  id->remote_comm = req_id;
  Event ev = event_for(l, RDMA_CM_EVENT_CONNECT_REQUEST, 0);
  ev.resp.id = id->handle;
  ev.child = id->handle;
  rdma_ucm_ud_param& p = ev.resp.param.ud;
  std::memcpy(p.private_data, q.private_data + sizeof hdr, cm::kUserSidrReqPrivate);
  p.private_data_len = static_cast<uint8_t>(cm::kUserSidrReqPrivate);
  fill_ah(id, id->dgid, &p.ah_attr);
  queue(l, ev, l->handle);
}

void CmService::Impl::on_sidr_rep(const std::string& from, const cm::Mad& m) {
  const cm::SidrRep& q = m.sidr_rep;
  Id* id = by_local_comm(static_cast<uint32_t>(q.request_id.get()), from);
  if (!id || id->st != St::ReqSent || id->qp_type != IBV_QPT_UD) return;
  id->retry_at = -1;
  by_comm.erase(id->local_comm);
  id->local_comm = 0;
  if (q.status != cm::kSidrSuccess) {
    id->st = St::Rejected;
    Event ev = event_for(id, q.status == cm::kSidrReject ? RDMA_CM_EVENT_REJECTED : RDMA_CM_EVENT_UNREACHABLE,
                         q.status);
    std::memcpy(ev.resp.param.ud.private_data, q.private_data, cm::kSidrRepPrivate);
    ev.resp.param.ud.private_data_len = static_cast<uint8_t>(cm::kSidrRepPrivate);
    queue(id, ev, id->handle);
    return;
  }
  id->st = St::Established;
  id->remote_qpn = q.qpn.bits(31, 8);
  Event ev = event_for(id, RDMA_CM_EVENT_ESTABLISHED, 0);
  rdma_ucm_ud_param& p = ev.resp.param.ud;
  p.qp_num = id->remote_qpn;
  p.qkey = static_cast<uint32_t>(q.qkey.get());
  fill_ah(id, id->dgid, &p.ah_attr);
  std::memcpy(p.private_data, q.private_data, cm::kSidrRepPrivate);
  p.private_data_len = static_cast<uint8_t>(cm::kSidrRepPrivate);
  queue(id, ev, id->handle);
}

// Joins are local: delivery to a group looks at every device of the home
// (the data path's multicast), so the daemon only hands out what the
// application attaches its QP with: the MGID (IPv4: ::ffff:a.b.c.d, as the
// kernel maps it for RoCE v2; IPv6: the address), no LID.
void CmService::Impl::cmd_join(Channel& c, uint32_t handle, uint64_t uid, const void* addr, size_t len,
                               uint16_t flags, uint16_t out, ReplyOut* r) {
  if (out < sizeof(rdma_ucm_create_id_resp)) {
    r->err = ENOSPC;
    return;
  }
  Id* id = find(c, handle, &r->err);
  if (!id) return;
  Addr a;
  if ((r->err = parse_addr(addr, len, &a))) return;
  if (flags != RDMA_MC_JOIN_FLAG_FULLMEMBER && flags != RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER) {
    r->err = EINVAL;
    return;
  }
  const bool mcast = a.v4() ? (a.ip[12] & 0xf0) == 0xe0 : a.ip[0] == 0xff;
  if (!mcast) {
    r->err = EINVAL;
    return;
  }
  if (!id->dev.set || (id->st != St::Bound && id->st != St::AddrResolved && id->st != St::RouteResolved)) {
    r->err = EINVAL;  // rdma_join_multicast: the id must be bound to a device
    return;
  }
  for (auto& [h, j] : joins)
    if (j.owner == id->handle && j.addr.same_ip(a)) {
      r->err = EADDRINUSE;
      return;
    }
  Join j;
  while (!next_handle || ids.count(next_handle) || joins.count(next_handle)) ++next_handle;
  j.handle = next_handle++;
  j.owner = id->handle;
  j.uid = uid;
  j.addr = a;
  joins[j.handle] = j;
  Event ev;
  ev.resp.uid = uid;
  ev.resp.id = j.handle;
  ev.resp.event = RDMA_CM_EVENT_MULTICAST_JOIN;
  ev.mc = j.handle;
  rdma_ucm_ud_param& p = ev.resp.param.ud;
  p.qp_num = 0xffffff;
  p.qkey = id->qkey ? id->qkey : kUdpQkey;
  fill_ah(id, a.ip, &p.ah_attr);
  queue(id, ev, id->handle);
  rdma_ucm_create_id_resp resp{};
  resp.id = j.handle;
  put(r, resp, out);
}

void CmService::Impl::cmd_leave(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_destroy_id cmd;
  take(in, &cmd);
  if (out < sizeof(rdma_ucm_destroy_id_resp)) {
    r->err = ENOSPC;
    return;
  }
  auto it = joins.find(cmd.id);
  if (it == joins.end()) {
    r->err = ENOENT;
    return;
  }
  auto owner = ids.find(it->second.owner);
  if (owner == ids.end() || owner->second->ch != &c) {
    r->err = EINVAL;
    return;
  }
  const bool had = !c.events.empty();
  std::erase_if(c.events, [&](const Event& e) { return e.mc == cmd.id; });
  if (had && c.events.empty()) r->flags |= SHMRDMA_CM_REPLY_DRAIN;
  rdma_ucm_destroy_id_resp resp{};
  resp.events_reported = it->second.events_reported;
  joins.erase(it);
  put(r, resp, out);
}

// ------------------------------------------------------------------ CmService

CmService::CmService(std::string home, DaemonPaths paths, Logger log)
    : impl_(std::make_unique<Impl>(std::move(home), std::move(paths), std::move(log))) {}
CmService::~CmService() = default;

int CmService::setup(std::string* why) { return impl_->setup(why); }

void CmService::add_fds(std::vector<pollfd>* fds) {
  fds->push_back({impl_->listen_fd, POLLIN, 0});
  fds->push_back({impl_->mad_fd, POLLIN, 0});
  for (auto& c : impl_->channels) fds->push_back({c->fd, POLLIN, 0});
}

void CmService::handle(const pollfd* fds, size_t n) {
  Impl& s = *impl_;
  if (n >= 2 && (fds[1].revents & POLLIN)) s.on_mad();
  // Channels by position (add_fds listed them in order; new ones come after).
  for (size_t i = 2; i < n && i - 2 < s.channels.size(); ++i) {
    Channel& c = *s.channels[i - 2];
    if (fds[i].fd != c.fd) continue;
    if (fds[i].revents & POLLIN) s.on_channel(c);
    if ((fds[i].revents & (POLLHUP | POLLERR)) && !(fds[i].revents & POLLIN)) c.dead = true;
  }
  for (auto& c : s.channels)
    if (c->dead && c->fd >= 0) s.close_channel(*c);
  std::erase_if(s.channels, [](const std::unique_ptr<Channel>& c) { return c->fd < 0; });
  if (n >= 1 && (fds[0].revents & POLLIN)) s.on_accept();
  s.timers();
}

int CmService::timeout_ms() const {
  int64_t next = -1;
  for (auto& [h, id] : impl_->ids)
    if (id->retry_at >= 0 && (next < 0 || id->retry_at < next)) next = id->retry_at;
  if (!impl_->outbox.empty()) return kOutboxTickMs;
  if (next < 0) return -1;
  return static_cast<int>(std::max<int64_t>(0, next - now_ms()));
}

size_t CmService::channels() const { return impl_->channels.size(); }

}  // namespace shmrdma
