// shmrdmad's RDMA CM service: the IB CM exchange with the other daemons of
// the home (REQ/REP/RTU/REJ/DREQ/DREP, SIDR), retransmission and the outbox.
// See cm.cc and src/cm/wire.h.
#include "cm_impl.h"

namespace shmrdma {

std::string CmService::Impl::peer_for(const uint8_t gid[16]) {
  GidMatch m;
  if (!find_gid(gid, kGidTypeAny, &m)) return {};
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
  id->retry_ms = kRetryMs;
  id->mra_rcvd = false;
  id->retry_at = now_ms() + kRetryMs;
}

// The MRA the kernel's CM sends for a user-space id when the REQ (msg 0) or
// the REP (msg 1) it has not answered yet comes again: RDMA CM prepares it
// as soon as it hands the message to ucma (cma.c ib_prepare_cm_mra), and
// cm.c's duplicate handlers send it, service timeout 24 (about 68.7 s).
void CmService::Impl::send_mra(Id* id, uint8_t msg, uint64_t tid) {
  cm::Mad m;
  cm::init_mad(&m, cm::kAttrMra, tid);
  m.mra.local_comm_id.set(id->local_comm);
  m.mra.remote_comm_id.set(id->remote_comm);
  m.mra.msg_mraed.set_bits(7, 6, msg);
  m.mra.service_timeout.set_bits(7, 3, kMraServiceTimeout);
  send_mad(id->peer, m);
}

// An MRA for our REQ (ReqSent) or REP (RepSent) stretches the wait for the
// answer to the service timeout plus the ACK timeout, for this try and the
// next ones (cm.c cm_mra_handler, ib_modify_mad); a second MRA is a duplicate.
void CmService::Impl::on_mra(const std::string& from, const cm::Mad& m) {
  Id* id = by_local_comm(static_cast<uint32_t>(m.mra.remote_comm_id.get()), from);
  if (!id || id->mra_rcvd || id->retry_at < 0) return;
  const uint32_t msg = m.mra.msg_mraed.bits(7, 6);
  const bool req = id->st == St::ReqSent && id->qp_type != IBV_QPT_UD && msg == 0;
  const bool rep = id->st == St::RepSent && msg == 1 && m.mra.local_comm_id.get() == id->remote_comm;
  if (!req && !rep) return;
  const int ack = id->ack_timeout ? id->ack_timeout : kDefaultAckTimeout;
  id->retry_ms = iba_time_ms(static_cast<int>(m.mra.service_timeout.bits(7, 3))) + iba_time_ms(ack);
  id->retry_at = now_ms() + id->retry_ms;
  id->mra_rcvd = true;
}

// cm.c cm_enter_timewait: the connection's QP stays in timewait for the ACK
// timeout (4.096 us * 2^t: 512 ms for the default 17); then RDMA CM reports
// TIMEWAIT_EXIT to the id if it still exists and is disconnected.
void CmService::Impl::enter_timewait(Id* id) {
  const int ack = id->ack_timeout ? id->ack_timeout : kDefaultAckTimeout;
  id->timewait_at = now_ms() + iba_time_ms(ack);
}

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
      else if (o->st == St::ReqRcvd) send_mra(o.get(), 0, m.hdr.tid.get());  // not answered yet
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
      if (o->st != St::Listen || o->port_ps != ps || o->src.port != port) continue;
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
  id->port_ps = l->port_ps;
  id->st = St::ReqRcvd;
  id->src = dst;
  id->dst = src;
  id->port_bound = false;
  id->dev = d;
  std::memcpy(id->dgid, q.primary.local_gid, 16);
  // The path as cm.c cm_format_path_from_req reads it from the REQ.
  PathRec& path = id->path;
  path.set = true;
  std::memcpy(path.sgid, q.primary.remote_gid, 16);
  std::memcpy(path.dgid, q.primary.local_gid, 16);
  path.service_id = sid;
  path.flow_label = q.primary.flow_rate.bits(31, 12);
  path.hop_limit = q.primary.hop_limit;
  path.traffic_class = q.primary.traffic_class;
  path.pkey = static_cast<uint16_t>(q.pkey.get());
  path.sl = static_cast<uint8_t>(q.primary.sl_subnet.bits(7, 4));
  path.mtu = static_cast<uint8_t>(q.mtu_rnr.bits(7, 4));
  path.rate = static_cast<uint8_t>(q.primary.flow_rate.bits(5, 0));
  const uint8_t lat = static_cast<uint8_t>(q.primary.ack_timeout.bits(7, 3));
  path.packet_life_time = static_cast<uint8_t>(lat - (lat > 0));
  if (l->src.family == AF_IB) {
    // cma_save_ib_info: an AF_IB listener's ids have AF_IB addresses, the GIDs of the path.
    Addr s, t;
    s.family = t.family = AF_IB;
    s.pkey_be = t.pkey_be = htons(path.pkey);
    s.flowinfo_be = t.flowinfo_be = htonl(path.flow_label);
    std::memcpy(s.ip, path.sgid, 16);
    std::memcpy(t.ip, path.dgid, 16);
    s.sid = sid;
    s.sid_mask = ~0ull;
    s.port = port;
    id->src = s;
    id->dst = t;
  }
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
  if (id->st == St::RepRcvd && id->remote_comm == q.local_comm_id.get()) {
    send_mra(id, 1, m.hdr.tid.get());  // librdmacm has not moved its QP yet (cm_dup_rep_handler)
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
      id->dreq_rcvd = true;
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
  enter_timewait(id);
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
      case cm::kAttrMra:
        on_mra(path, m);
        break;
      default:
        break;
    }
  }
}

void CmService::Impl::timers() {
  flush_outbox();
  const int64_t now = now_ms();
  for (auto& [h, idp] : ids) {
    Id* id = idp.get();
    if (id->timewait_at >= 0 && id->timewait_at <= now) {
      id->timewait_at = -2;  // done
      if (id->st == St::Disconnected) queue(id, event_for(id, RDMA_CM_EVENT_TIMEWAIT_EXIT, 0), id->handle);
    }
    if (id->retry_at < 0 || id->retry_at > now) continue;
    if (id->retries_left-- > 0 && send_mad(id->peer, id->last)) {
      id->retry_at = now + id->retry_ms;
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
        enter_timewait(id);  // DREQ_ERROR enters timewait too
        break;
      case St::Bound:
        if (id->resolve_deadline >= 0) resolve_retry(id, now);  // cm_commands.cc
        break;
      default:
        break;
    }
  }
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
      if (o->st != St::Listen || o->port_ps != ps || o->src.port != port || o->qp_type != IBV_QPT_UD) continue;
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

}  // namespace shmrdma
