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
//
// This file: the service's sockets, channels, event queues, ids and ports,
// and CmService itself; the ucma commands are in cm_commands.cc, the IB CM
// exchange in cm_exchange.cc.
#include "cm_impl.h"

namespace shmrdma {

std::string cm_channel_path(const DaemonPaths& d) {
  return d.sock.substr(0, d.sock.size() - 5) + SHMRDMA_CM_SOCK_SUFFIX;
}
std::string cm_mad_path(const DaemonPaths& d) { return d.sock.substr(0, d.sock.size() - 5) + SHMRDMA_CM_MAD_SUFFIX; }

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
  id->port_ps = ps;
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
  if (!find_gid(a.ip, layout::kGidTypeRoceV2, &m) && !find_gid(a.ip, kGidTypeAny, &m)) return ENODEV;
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
      if (o.get() == id || !o->port_bound || o->port_ps != id->port_ps || o->src.port != p) continue;
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
  // Channels by position (add_fds listed them in order; new ones come after).
  // Their commands go first, then the peers' MADs: when a LISTEN and a REQ
  // for it are both pending, the REQ finds the listener (perftest -R sets up
  // its RDMA CM listener and its client connects at the same moment, right
  // after its TCP handshake; under load both reach the daemon in one wake-up).
  for (size_t i = 2; i < n && i - 2 < s.channels.size(); ++i) {
    Channel& c = *s.channels[i - 2];
    if (fds[i].fd != c.fd) continue;
    if (fds[i].revents & POLLIN) s.on_channel(c);
    if ((fds[i].revents & (POLLHUP | POLLERR)) && !(fds[i].revents & POLLIN)) c.dead = true;
  }
  if (n >= 2 && (fds[1].revents & POLLIN)) s.on_mad();
  for (auto& c : s.channels)
    if (c->dead && c->fd >= 0) s.close_channel(*c);
  std::erase_if(s.channels, [](const std::unique_ptr<Channel>& c) { return c->fd < 0; });
  if (n >= 1 && (fds[0].revents & POLLIN)) s.on_accept();
  s.timers();
}

int CmService::timeout_ms() const {
  int64_t next = -1;
  for (auto& [h, id] : impl_->ids) {
    if (id->retry_at >= 0 && (next < 0 || id->retry_at < next)) next = id->retry_at;
    if (id->timewait_at >= 0 && (next < 0 || id->timewait_at < next)) next = id->timewait_at;
  }
  if (!impl_->outbox.empty()) return kOutboxTickMs;
  if (next < 0) return -1;
  return static_cast<int>(std::max<int64_t>(0, next - now_ms()));
}

size_t CmService::channels() const { return impl_->channels.size(); }

}  // namespace shmrdma
