// shmrdmad's RDMA CM service: the ucma commands the shim forwards (one
// handler per rdma_user_cm.h command, with the kernel's checks and errnos).
// See cm.cc.
#include "cm_impl.h"

namespace shmrdma {

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
      cmd_resolve(c, cmd.id, has_src ? &src : nullptr, dst, cmd.timeout_ms, &r);
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
      cmd_resolve(c, cmd.id, has_src ? &src : nullptr, dst, cmd.timeout_ms, &r);
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

// As the kernel's rdma_resolve_ip (core/addr.c): no route to the destination
// fails the command itself (ENETUNREACH, no event; the id stays bound); a
// routed destination is resolved like a neighbour: held by a device of the
// home, ADDR_RESOLVED at once; held by nobody, looked for again until
// timeout_ms passed, then ADDR_ERROR with -ETIMEDOUT (the kernel wakes a
// pending request only when a neighbour becomes valid, else at its timeout).
void CmService::Impl::cmd_resolve(Channel& c, uint32_t handle, const Addr* src, const Addr& dst, uint32_t timeout_ms,
                                  ReplyOut* r) {
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
  if ((id->st != St::Bound && id->st != St::AddrResolved) || id->resolve_deadline >= 0) {
    r->err = EINVAL;  // the kernel: not ADDR_BOUND / ADDR_RESOLVED (a query in progress is ADDR_QUERY)
    return;
  }
  id->dst = dst;
  int status = 0;
  // The source: the bound address, else the one the host would route from.
  Addr s = id->src;
  const bool unbound = s.any() || s.loopback();
  if (dst.loopback()) {
    if (unbound) status = -loopback_source(&s);
  } else {
    // The route, in the daemon's namespace (the caller's): a UDP connect
    // (from the bound source, if any) asks the kernel's routing table.
    int u = ::socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (u < 0) {
      r->err = errno;
      return;
    }
    sockaddr_in6 sa{};
    sa.sin6_family = AF_INET6;
    if (!unbound) {
      std::memcpy(&sa.sin6_addr, s.ip, 16);
      (void)::bind(u, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    }
    sa.sin6_port = htons(4791);
    std::memcpy(&sa.sin6_addr, dst.ip, 16);
    socklen_t len = sizeof sa;
    if (::connect(u, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 ||
        ::getsockname(u, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
      r->err = errno ? errno : ENETUNREACH;
      ::close(u);
      return;
    }
    ::close(u);
    if (unbound) std::memcpy(s.ip, &sa.sin6_addr, 16);
  }
  DevBind d = id->dev;
  if (status == 0 && !d.set) status = -set_device_for(s, &d);
  if (status) {
    queue(id, event_for(id, RDMA_CM_EVENT_ADDR_ERROR, status), id->handle);
    return;
  }
  // The destination: the GID some device of the home holds.
  std::memcpy(id->dgid, dst.loopback() ? s.ip : dst.ip, 16);
  const bool mcast = dst.v4() ? (dst.ip[12] & 0xf0) == 0xe0 : dst.ip[0] == 0xff;  // a group: no peer to find
  if (!mcast && peer_for(id->dgid).empty()) {
    const int64_t now = now_ms();
    id->st = St::Bound;
    id->resolve_src = s;
    id->resolve_dev = d;
    id->resolve_deadline = now + timeout_ms;
    id->retries_left = 0;  // the timer looks again, it sends nothing
    id->retry_at = std::min(now + kResolveRetryMs, id->resolve_deadline);
    return;
  }
  resolve_done(id, s, d);
}

void CmService::Impl::resolve_done(Id* id, const Addr& s, const DevBind& d) {
  id->dev = d;
  if (id->src.any() || id->src.loopback()) {
    const uint16_t port = id->src.port;
    std::memcpy(id->src.ip, s.ip, 16);
    id->src.family = id->dst.family;
    id->src.port = port;
  }
  id->st = St::AddrResolved;
  queue(id, event_for(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0), id->handle);
}

// The timer of a pending resolution (CmService::Impl::timers).
void CmService::Impl::resolve_retry(Id* id, int64_t now) {
  if (!peer_for(id->dgid).empty()) {
    id->resolve_deadline = -1;
    resolve_done(id, id->resolve_src, id->resolve_dev);
  } else if (now >= id->resolve_deadline) {
    id->resolve_deadline = -1;
    queue(id, event_for(id, RDMA_CM_EVENT_ADDR_ERROR, -ETIMEDOUT), id->handle);
  } else {
    id->retries_left = 0;
    id->retry_at = std::min(now + kResolveRetryMs, id->resolve_deadline);
  }
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

}  // namespace shmrdma
