// The RDMA CM service's private types (daemon/cm.cc, cm_commands.cc,
// cm_exchange.cc): channels, ids, events, multicast joins, and the
// service's state (CmService::Impl). See cm.h for the whole picture.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <endian.h>
#include <infiniband/sa.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_user_cm.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <random>

#include "cm/cm_proto.h"
#include "cm/wire.h"
#include "device_setup.h"
#include "paths.h"
#include "directory.h"
#include "gid_table.h"
#include "registry.h"

#include "cm.h"

namespace shmrdma {
namespace cmsvc {


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
constexpr uint8_t kPacketLifeTime = 16;     // RoCE paths (cma.c CMA_IBOE_PACKET_LIFETIME)
constexpr uint8_t kMraServiceTimeout = 24;  // cm.c CM_MRA_SETTING: 4.096 us * 2^24, about 68.7 s
constexpr uint8_t kRoceRate = 3;            // IB_RATE_10_GBPS: what iboe_get_rate gives for a veth (10 Gb/s)

// IBA time values (4.096 us * 2^t) in ms, as cm.c's cm_convert_to_ms rounds them.
inline int64_t iba_time_ms(int t) { return int64_t{1} << std::max(t - 8, 0); }
// A destination nobody holds: looked for again at this interval (the
// kernel's neighbour resolution; a device that comes up with it meanwhile
// resolves) until the caller's timeout_ms, then ADDR_ERROR -ETIMEDOUT.
constexpr int kResolveRetryMs = 100;

inline int64_t now_ms() {
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

// An address as an id holds it: IPv4 (as v4-mapped IPv6), IPv6 or AF_IB
// (ip = the GID), the port, and the sockaddr fields the kernel keeps.
struct Addr {
  uint16_t family = 0;
  uint8_t ip[16] = {};
  uint16_t port = 0;            // host order (AF_IB: the service id's low 16 bits)
  uint32_t flowinfo_be = 0;     // sin6_flowinfo / sib_flowinfo, as given
  uint16_t pkey_be = 0;         // AF_IB: sib_pkey
  uint64_t sid = 0, sid_mask = 0;  // AF_IB: service id and mask, host order
  uint64_t scope_id = 0;        // sin6_scope_id / sib_scope_id
  bool any() const {
    static const uint8_t zero[16] = {};
    static const uint8_t v4any[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0};
    if (family == AF_IB) return !std::memcmp(ip, zero, 16);  // ib_addr_any
    return !std::memcmp(ip, zero, 16) || !std::memcmp(ip, v4any, 16);
  }
  bool loopback() const {
    static const uint8_t v6lo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    if (family == AF_IB) return false;  // a GID: never an IP loopback address
    return !std::memcmp(ip, v6lo, 16) || (v4() && ip[12] == 127);
  }
  bool v4() const {
    static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return family != AF_IB && !std::memcmp(ip, pre, 12);
  }
  bool same_ip(const Addr& o) const { return !std::memcmp(ip, o.ip, 16); }
};

// struct sockaddr_ib, as the kernel's ABI has it (librdmacm's
// <infiniband/ib.h>; kept here so that the daemon does not need
// librdmacm's headers to build).
#ifndef AF_IB
#define AF_IB 27
#endif
struct sockaddr_ib {
  unsigned short int sib_family;
  uint16_t sib_pkey;      // big-endian
  uint32_t sib_flowinfo;  // big-endian
  uint8_t sib_addr[16];   // the GID
  uint64_t sib_sid;       // big-endian
  uint64_t sib_sid_mask;  // big-endian
  uint64_t sib_scope_id;
};
static_assert(sizeof(sockaddr_ib) == 48 && offsetof(sockaddr_ib, sib_addr) == 8 &&
              offsetof(sockaddr_ib, sib_sid) == 24);

// The port spaces' service ids as AF_IB addresses carry them (rdma_cma.h).
constexpr uint64_t kIbPsMask = 0xFFFFFFFFFFFF0000ull;
constexpr uint64_t kIbPsTcp = 0x0000000001060000ull, kIbPsUdp = 0x0000000001110000ull,
                   kIbPsIb = 0x00000000013F0000ull;

// The kernel's rdma_addr_size: the sockaddr's length for its family, 0 for
// a family RDMA CM does not take (AF_INET, AF_INET6, AF_IB only).
inline size_t addr_size_for(sa_family_t fam) {
  switch (fam) {
    case AF_INET:
      return sizeof(sockaddr_in);
    case AF_INET6:
      return sizeof(sockaddr_in6);
    case AF_IB:
      return sizeof(sockaddr_ib);
    default:
      return 0;
  }
}
inline size_t rdma_addr_size(const void* p) {
  sa_family_t fam;
  std::memcpy(&fam, p, sizeof fam);
  return addr_size_for(fam);
}

// Parses the sockaddr the command carries (len: the room it has).
inline int parse_addr(const void* p, size_t len, Addr* out) {
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
    out->flowinfo_be = a.sin6_flowinfo;
    out->scope_id = a.sin6_scope_id;
    return 0;
  }
  if (fam == AF_IB) {
    if (len < sizeof(sockaddr_ib)) return EINVAL;
    sockaddr_ib a;
    std::memcpy(&a, p, sizeof a);
    out->family = AF_IB;
    std::memcpy(out->ip, &a.sib_addr, 16);
    out->pkey_be = a.sib_pkey;
    out->flowinfo_be = a.sib_flowinfo;
    out->sid = be64toh(a.sib_sid);
    out->sid_mask = be64toh(a.sib_sid_mask);
    out->scope_id = a.sib_scope_id;
    out->port = static_cast<uint16_t>(out->sid & out->sid_mask);  // cma_port for AF_IB
    return 0;
  }
  return EAFNOSUPPORT;
}

// The sockaddr librdmacm expects back, in a slot of len bytes (a longer
// address is cut, as the kernel's QUERY_ROUTE cuts AF_IB to sockaddr_in6).
inline void store_addr(const Addr& a, void* slot, size_t len) {
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
    s.sin6_flowinfo = a.flowinfo_be;
    s.sin6_scope_id = static_cast<uint32_t>(a.scope_id);
    std::memcpy(&s.sin6_addr, a.ip, 16);
    std::memcpy(slot, &s, std::min(len, sizeof s));
  } else if (a.family == AF_IB) {
    sockaddr_ib s{};
    s.sib_family = AF_IB;
    s.sib_pkey = a.pkey_be;
    s.sib_flowinfo = a.flowinfo_be;
    std::memcpy(&s.sib_addr, a.ip, 16);
    s.sib_sid = htobe64(a.sid);
    s.sib_sid_mask = htobe64(a.sid_mask);
    s.sib_scope_id = a.scope_id;
    std::memcpy(slot, &s, std::min(len, sizeof s));
  }
}

// The size the kernel reports for an id's address (rdma_addr_size of it).
inline uint16_t addr_size_of(const Addr& a) { return static_cast<uint16_t>(addr_size_for(a.family)); }

// A path record as the kernel's RDMA CM holds it for an id on a RoCE port
// (cma.c cma_resolve_iboe_route on the active side, cm.c
// cm_format_path_from_req on the passive side).
struct PathRec {
  bool set = false;
  uint8_t sgid[16] = {}, dgid[16] = {};
  uint64_t service_id = 0;
  uint32_t flow_label = 0;  // 20 bits
  uint8_t hop_limit = 0, traffic_class = 0, sl = 0, mtu = 0, rate = 0, packet_life_time = 0;
  uint16_t pkey = 0xffff;
};

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
  Registry* reg = nullptr;  // held by the DeviceDirectory (lives as long as it)
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
  uint16_t port_ps = 0;   // the port space its port is in (AF_IB: chosen by the service id)
  PathRec path;           // RESOLVE_ROUTE (active) or the REQ (passive)
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
  int64_t retry_ms = kRetryMs;  // an MRA extends it (cm.c cm_mra_handler)
  bool mra_rcvd = false;        // MRA_REQ_RCVD / MRA_REP_RCVD: later MRAs are duplicates
  bool dreq_rcvd = false;       // the peer disconnected: our DISCONNECT is its DREP (timewait)
  int64_t timewait_at = -1;     // TIMEWAIT_EXIT is due (-1: not in timewait)
  // An address resolution waiting for its destination (the kernel's
  // RDMA_CM_ADDR_QUERY; st stays Bound): until this time, else -1; the
  // source and device it found, taken on success.
  int64_t resolve_deadline = -1;
  Addr resolve_src;
  DevBind resolve_dev;
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
  RDMA_CM_EVENT_TIMEWAIT_EXIT = 15,
};

// The IP port spaces' service id (cma.c cma_get_service_id).
inline uint64_t service_id_of(uint16_t ps, uint16_t port) { return (uint64_t{ps} << 16) | port; }

struct ReplyOut {
  int err = 0;
  uint32_t flags = 0;
  std::vector<uint8_t> body;
};

template <class T>
inline bool take(const std::vector<uint8_t>& in, T* out) {
  // The kernel copies sizeof(cmd) from the user's buffer; we have what the
  // shim copied (hdr.in bytes, capped): short commands read as zero-filled.
  std::memset(out, 0, sizeof *out);
  std::memcpy(out, in.data(), std::min(in.size(), sizeof *out));
  return true;
}

template <class T>
inline void put(ReplyOut* r, const T& v, uint16_t out) {
  r->body.resize(std::min<size_t>(sizeof v, out));
  std::memcpy(r->body.data(), &v, r->body.size());
}


}  // namespace cmsvc
using namespace cmsvc;  // only the CM service's own files include this header

struct CmService::Impl {
  Impl(std::string home, DaemonPaths paths, Logger log)
      : home(std::move(home)), paths(std::move(paths)), log(std::move(log)) {
    devices.init(this->home, nullptr);
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
  DeviceDirectory devices;  // every device of the home (none is the daemon's own)
  // A RoCE device of the home whose port holds `gid` (type layout::GidType or
  // kGidTypeAny): its registry (valid for the directory's life), port and
  // GID index. Looks at the home again once before it says no.
  struct GidMatch {
    Registry* registry = nullptr;
    uint32_t port = 0, gid_index = 0;
  };
  bool find_gid(const uint8_t gid[16], uint8_t type, GidMatch* m) {
    for (int pass = 0; pass < 2; ++pass) {
      uint32_t port = 0, seq = 0, index = 0;
      HomeDevice* d = devices.by_gid(gid, type, &port, &seq);
      if (d && d->registry->gid_index_of(port, gid, type, &index)) {
        *m = GidMatch{d->registry, port, index};
        return true;
      }
      if (pass == 0) devices.rescan(true);
    }
    return false;
  }
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
  void cmd_resolve(Channel& c, uint32_t handle, const Addr* src, const Addr& dst, uint32_t timeout_ms, ReplyOut* r);
  void resolve_done(Id* id, const Addr& s, const DevBind& d);
  void resolve_retry(Id* id, int64_t now);
  void cmd_query_route(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void cmd_query(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r);
  void query_addr(Id* id, bool gid, uint16_t out, ReplyOut* r);
  void query_path(Id* id, uint16_t out, ReplyOut* r);
  int resolve_route(Id* id);
  void resolve_ib(Channel& c, Id* id, const Addr* src, const Addr& dst, ReplyOut* r);
  void enter_timewait(Id* id);
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
  int loopback_source(Addr* s, bool gid0 = false);
  bool ns_gid_like(const uint8_t dgid[16], uint8_t sgid[16]);
  bool for_each_ns_port(const std::function<bool(const PortNetView&)>& fn);

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
  void on_mra(const std::string& from, const cm::Mad& m);
  void send_mra(Id* id, uint8_t msg, uint64_t tid);
  Id* by_local_comm(uint32_t comm, const std::string& from);
  void timers();
};

}  // namespace shmrdma
