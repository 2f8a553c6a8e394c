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
      // ucma_bind_ip: rdma_addr_size_in6 (AF_INET or AF_INET6 only) before the id.
      const size_t size = rdma_addr_size(&cmd.addr);
      if (!size || size > sizeof cmd.addr) r.err = EINVAL;
      else cmd_bind(c, cmd.id, &cmd.addr, size, &r);
      break;
    }
    case RDMA_USER_CM_CMD_BIND: {
      rdma_ucm_bind cmd;
      take(in, &cmd);
      // ucma_bind: addr_size must be rdma_addr_size of the address (AF_INET,
      // AF_INET6 or AF_IB), checked before the id.
      if (cmd.reserved || !cmd.addr_size || cmd.addr_size != rdma_addr_size(&cmd.addr)) r.err = EINVAL;
      else cmd_bind(c, cmd.id, &cmd.addr, cmd.addr_size, &r);
      break;
    }
    case RDMA_USER_CM_CMD_RESOLVE_IP: {
      rdma_ucm_resolve_ip cmd;
      take(in, &cmd);
      Addr src, dst;
      const bool has_src = cmd.src_addr.sin6_family != 0;
      const size_t ssize = rdma_addr_size(&cmd.src_addr), dsize = rdma_addr_size(&cmd.dst_addr);
      if ((has_src && (!ssize || ssize > sizeof cmd.src_addr)) || !dsize || dsize > sizeof cmd.dst_addr) {
        r.err = EINVAL;  // ucma_resolve_ip: rdma_addr_size_in6
        break;
      }
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
      // ucma_resolve_addr: each size must be rdma_addr_size of its address; a source is optional.
      if (cmd.reserved || (cmd.src_size && cmd.src_size != rdma_addr_size(&cmd.src_addr)) || !cmd.dst_size ||
          cmd.dst_size != rdma_addr_size(&cmd.dst_addr)) {
        r.err = EINVAL;
        break;
      }
      const bool has_src = cmd.src_size != 0;
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
      if ((r.err = resolve_route(id))) break;
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
      const size_t size = rdma_addr_size(&cmd.addr);  // ucma_join_ip_multicast: rdma_addr_size_in6
      if (!size || size > sizeof cmd.addr) r.err = EINVAL;
      else cmd_join(c, cmd.id, cmd.uid, &cmd.addr, size, RDMA_MC_JOIN_FLAG_FULLMEMBER, h.out, &r);
      break;
    }
    case RDMA_USER_CM_CMD_JOIN_MCAST: {
      rdma_ucm_join_mcast cmd;
      take(in, &cmd);
      if (!rdma_addr_size(&cmd.addr)) r.err = EINVAL;  // ucma_join_multicast: rdma_addr_size_kss
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

// cma.c cma_select_ib_ps: the port space an AF_IB address's service id
// names (0: none the id may use); makes the id's service id ps | port.
static uint16_t select_ib_ps(uint16_t id_ps, Addr* a) {
  const uint64_t mask = a->sid_mask & kIbPsMask, sid = a->sid & mask;
  uint64_t sid_ps = 0;
  uint16_t ps = 0;
  if (id_ps == RDMA_PS_IB && sid == (kIbPsIb & mask)) {
    sid_ps = kIbPsIb;
    ps = RDMA_PS_IB;
  } else if ((id_ps == RDMA_PS_IB || id_ps == RDMA_PS_TCP) && sid == (kIbPsTcp & mask)) {
    sid_ps = kIbPsTcp;
    ps = RDMA_PS_TCP;
  } else if ((id_ps == RDMA_PS_IB || id_ps == RDMA_PS_UDP) && sid == (kIbPsUdp & mask)) {
    sid_ps = kIbPsUdp;
    ps = RDMA_PS_UDP;
  }
  if (ps) {
    a->sid = sid_ps | a->port;
    a->sid_mask |= kIbPsMask;
  }
  return ps;
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
  uint16_t ps = id->ps;
  if (a.family == AF_IB) {
    // An AF_IB address other than the wildcard names a GID, which the
    // kernel looks for on InfiniBand ports only (cma_validate_port): on a
    // host with RoCE ports alone that is ENODEV. The wildcard binds no
    // device, as for IP (librdmacm's AF_IB probe binds exactly that).
    if (!a.any()) {
      r->err = ENODEV;
      return;
    }
    if (!(ps = select_ib_ps(id->ps, &a))) {
      r->err = EPROTONOSUPPORT;  // cma_get_port
      return;
    }
  } else if (!a.any() && !a.loopback()) {
    if (!local_ip(a)) {
      r->err = EADDRNOTAVAIL;
      return;
    }
    if ((r->err = set_device_for(a, &d))) return;  // a local address no RoCE device holds: ENODEV
  }
  const Addr old = id->src;
  const uint16_t old_ps = id->port_ps;
  id->src = a;
  id->port_ps = ps;
  if ((r->err = bind_port(id, a.port))) {
    id->src = old;
    id->port_ps = old_ps;
    return;
  }
  if (a.family == AF_IB) {  // cma_bind_port: the service id now names the port exactly
    id->src.sid = (id->src.sid & id->src.sid_mask) | id->src.port;
    id->src.sid_mask = ~0ull;
  }
  id->dst = Addr{};
  id->dst.family = a.family;  // rdma_bind_addr: the destination takes the source's family
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
  if (dst.family == AF_IB || (src && src->family == AF_IB) || id->src.family == AF_IB) {
    resolve_ib(c, id, src, dst, r);
    return;
  }
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

// AF_IB address resolution (cma.c cma_resolve_ib_addr / cma_resolve_ib_dev):
// the destination is a GID; the device is the one of this namespace whose
// port holds it (then the source GID is the same), else one with an active
// port holding a GID of the same subnet prefix; the P_Key must be in the
// port's table (RoCE: 0xffff only). No device: ENODEV, from the command.
// A wildcard destination is loopback: the first active port, its GID 0.
// Both ends must be AF_IB (resolve_prepare_src). On RoCE the route then
// fails (RESOLVE_ROUTE: ENODEV), as the kernel has no netdev for such an id.
void CmService::Impl::resolve_ib(Channel& c, Id* id, const Addr* src, const Addr& dst, ReplyOut* r) {
  if (id->st == St::Idle) {
    Addr s;
    if (src) {
      s = *src;
    } else {
      s.family = dst.family;  // cma_bind_addr: a wildcard of the destination's family
      if (dst.family == AF_IB) s.pkey_be = dst.pkey_be;
      else if (dst.v4()) s.ip[10] = s.ip[11] = 0xff;
    }
    sockaddr_storage sa{};
    store_addr(s, &sa, sizeof sa);
    ReplyOut br;
    cmd_bind(c, id->handle, &sa, rdma_addr_size(&sa), &br);
    if ((r->err = br.err)) return;
  }
  if (id->st != St::Bound || id->src.family != dst.family) {
    r->err = EINVAL;
    return;
  }
  uint8_t sgid[16];
  Addr src_after = id->src;
  if (dst.any()) {
    Addr lo;
    if (loopback_source(&lo, true)) {
      r->err = ENODEV;  // cma_bind_loopback: no device
      return;
    }
    std::memcpy(sgid, lo.ip, 16);
    std::memset(src_after.ip, 0, 16);
    src_after.ip[15] = 1;  // cma_set_loopback: the source becomes ::1
  } else {
    if ((ntohs(dst.pkey_be) & 0x7fff) != 0x7fff) {
      r->err = ENODEV;  // no port has that P_Key
      return;
    }
    Addr exact;
    std::memcpy(exact.ip, dst.ip, 16);
    DevBind probe;
    if (set_device_for(exact, &probe) == 0) std::memcpy(sgid, dst.ip, 16);
    else if (!ns_gid_like(dst.ip, sgid)) {
      r->err = ENODEV;
      return;
    }
    std::memcpy(src_after.ip, sgid, 16);
  }
  Addr sg;
  std::memcpy(sg.ip, sgid, 16);
  DevBind d;
  if ((r->err = set_device_for(sg, &d))) return;
  id->dev = d;
  id->src = src_after;
  id->dst = dst;
  std::memcpy(id->dgid, dst.any() ? sgid : dst.ip, 16);
  id->st = St::AddrResolved;
  queue(id, event_for(id, RDMA_CM_EVENT_ADDR_RESOLVED, 0), id->handle);
}

// The route of an IP id on a RoCE port: one path (cma.c cma_resolve_iboe_route).
int CmService::Impl::resolve_route(Id* id) {
  if (!id->dev.set) return EINVAL;
  if (id->src.family == AF_IB || id->dst.family == AF_IB) return ENODEV;  // no netdev bound to it
  PathRec& p = id->path;
  p = PathRec{};
  p.set = true;
  std::memcpy(p.sgid, id->dev.sgid, 16);
  std::memcpy(p.dgid, id->dgid, 16);
  p.hop_limit = kHopLimit;
  p.pkey = 0xffff;
  p.sl = 0;  // iboe_tos_to_sl: no VLAN, no traffic classes
  p.traffic_class = id->tos;
  p.mtu = static_cast<uint8_t>(id->dev.active_mtu);
  p.rate = kRoceRate;
  p.packet_life_time = id->ack_timeout ? static_cast<uint8_t>(id->ack_timeout - 1) : kPacketLifeTime;
  // RoCE v2 (cma_get_roce_udp_flow_label): the IPv6 source's flow label, else a hash of the ports.
  uint32_t fl = id->src.family == AF_INET6 ? ntohl(id->src.flowinfo_be) & 0xFFFFF : 0;
  if (!fl) fl = (uint32_t{id->src.port} * 31 + id->dst.port) & 0xFFFFF;
  p.flow_label = fl;
  return 0;
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
  store_addr(id->src, &resp.src_addr, id->src.family == AF_INET ? sizeof(sockaddr_in) : sizeof resp.src_addr);
  store_addr(id->dst, &resp.dst_addr, id->dst.family == AF_INET ? sizeof(sockaddr_in) : sizeof resp.dst_addr);
  resp.ibdev_index = 0xffffffff;  // unknown: librdmacm matches the node GUID
  if (id->dev.set) {
    resp.node_guid = htobe64(id->dev.node_guid);
    resp.port_num = static_cast<uint8_t>(id->dev.port);
    ib_user_path_rec& u = resp.ib_route[0];
    if (id->path.set) {  // ib_copy_path_rec_to_user (RoCE: no LIDs)
      const PathRec& p = id->path;
      resp.num_paths = 1;
      std::memcpy(u.sgid, p.sgid, 16);
      std::memcpy(u.dgid, p.dgid, 16);
      u.flow_label = htonl(p.flow_label);
      u.reversible = 1;
      u.mtu = p.mtu;
      u.pkey = htons(p.pkey);
      u.hop_limit = p.hop_limit;
      u.traffic_class = p.traffic_class;
      u.sl = p.sl;
      u.mtu_selector = 2;  // exactly
      u.rate_selector = 2;
      u.rate = p.rate;
      u.packet_life_time_selector = 2;
      u.packet_life_time = p.packet_life_time;
    } else {  // ucma_copy_iboe_route without a path: the GIDs and the P_Key
      std::memcpy(u.sgid, id->dev.sgid, 16);
      std::memcpy(u.dgid, id->dgid, 16);
      u.pkey = htons(0xffff);
    }
  }
  put(r, resp, out);
}

// QUERY_ADDR (gid false) and QUERY_GID (gid true): ucma_query_addr /
// ucma_query_gid. The GID form gives both ends as sockaddr_ib: an AF_IB
// address as it is, an IP one as its GID with the service id of the port.
void CmService::Impl::query_addr(Id* id, bool gid, uint16_t out, ReplyOut* r) {
  if (out < sizeof(rdma_ucm_query_addr_resp)) {
    r->err = ENOSPC;
    return;
  }
  rdma_ucm_query_addr_resp resp{};
  if (id->dev.set) {
    resp.node_guid = htobe64(id->dev.node_guid);
    resp.port_num = static_cast<uint8_t>(id->dev.port);
    resp.pkey = htons(0xffff);
  }
  resp.ibdev_index = 0xffffffff;
  if (!gid) {
    resp.src_size = addr_size_of(id->src);
    resp.dst_size = addr_size_of(id->dst);
    store_addr(id->src, &resp.src_addr, sizeof resp.src_addr);
    store_addr(id->dst, &resp.dst_addr, sizeof resp.dst_addr);
  } else {
    resp.src_size = resp.dst_size = sizeof(sockaddr_ib);
    for (int end = 0; end < 2; ++end) {
      const Addr& a = end == 0 ? id->src : id->dst;
      Addr ib;
      if (a.family == AF_IB) {
        ib = a;
      } else {
        ib.family = AF_IB;
        ib.pkey_be = resp.pkey;
        if (id->dev.set) std::memcpy(ib.ip, end == 0 ? id->dev.sgid : id->dgid, 16);  // rdma_read_gids
        ib.sid = service_id_of(id->ps, a.port);  // rdma_get_service_id
      }
      store_addr(ib, end == 0 ? static_cast<void*>(&resp.src_addr) : static_cast<void*>(&resp.dst_addr),
                 sizeof resp.src_addr);
    }
  }
  put(r, resp, out);
}

// QUERY_PATH (ucma_query_path): the path records in the SA's wire format,
// as many as fit while more than one record's room is left (the kernel's
// loop), after the count.
void CmService::Impl::query_path(Id* id, uint16_t out, ReplyOut* r) {
  if (out < sizeof(rdma_ucm_query_path_resp)) {
    r->err = ENOSPC;
    return;
  }
  rdma_ucm_query_path_resp head{};
  head.num_paths = id->path.set ? 1 : 0;
  std::vector<uint8_t> body(sizeof head);
  size_t left = out - sizeof head;
  for (uint32_t i = 0; i < head.num_paths && left > sizeof(ib_path_rec_data); ++i, left -= sizeof(ib_path_rec_data)) {
    const PathRec& p = id->path;
    ibv_path_record w{};
    w.service_id = htobe64(p.service_id);
    std::memcpy(w.dgid.raw, p.dgid, 16);
    std::memcpy(w.sgid.raw, p.sgid, 16);
    w.flowlabel_hoplimit = htonl((p.flow_label << 8) | p.hop_limit);
    w.tclass = p.traffic_class;
    w.reversible_numpath = 0x80;  // reversible, numb_path 0 (as the kernel's record)
    w.pkey = htons(p.pkey);
    w.qosclass_sl = htons(p.sl & 0xf);
    w.mtu = static_cast<uint8_t>(0x80 | (p.mtu & 0x3f));  // selector 2: exactly
    w.rate = static_cast<uint8_t>(0x80 | (p.rate & 0x3f));
    w.packetlifetime = static_cast<uint8_t>(0x80 | (p.packet_life_time & 0x3f));
    ib_path_rec_data d{};
    d.flags = IB_PATH_GMP | IB_PATH_PRIMARY | IB_PATH_BIDIRECTIONAL;
    static_assert(sizeof w == sizeof d.path_rec);
    std::memcpy(d.path_rec, &w, sizeof w);
    const size_t at = body.size();
    body.resize(at + sizeof d);
    std::memcpy(body.data() + at, &d, sizeof d);
  }
  std::memcpy(body.data(), &head, sizeof head);
  r->body = std::move(body);
}

void CmService::Impl::cmd_query(Channel& c, const std::vector<uint8_t>& in, uint16_t out, ReplyOut* r) {
  rdma_ucm_query cmd;
  take(in, &cmd);
  Id* id = find(c, cmd.id, &r->err);
  if (!id) return;
  switch (cmd.option) {
    case RDMA_USER_CM_QUERY_ADDR:
      query_addr(id, false, out, r);
      return;
    case RDMA_USER_CM_QUERY_PATH:
      query_path(id, out, r);
      return;
    case RDMA_USER_CM_QUERY_GID:
      query_addr(id, true, out, r);
      return;
    default:
      r->err = ENOSYS;  // ucma_query
      return;
  }
}

// Calls fn with the GID view of port 1 of each active RoCE device of this
// namespace, in name order, until fn returns true; whether one did.
bool CmService::Impl::for_each_ns_port(const std::function<bool(const PortNetView&)>& fn) {
  for (const std::string& n : list_devices(home)) {
    Registry reg;
    if (Registry::attach(device_paths(home, n), &reg) != 0) continue;
    const layout::NetBinding& b = reg.device().net;
    if (b.link_layer != layout::kLinkLayerEthernet || b.netns_dev != paths.netns_dev || b.netns_ino != paths.netns_ino)
      continue;
    PortNetView v;
    if (reg.port_net_settled(1, &v) != 0 || v.state != IBV_PORT_ACTIVE) continue;
    if (fn(v)) return true;
  }
  return false;
}

// A GID of an active RoCE port of this namespace with the subnet prefix
// (first 8 bytes) of dgid, as cma_resolve_ib_dev takes when none is dgid.
bool CmService::Impl::ns_gid_like(const uint8_t dgid[16], uint8_t sgid[16]) {
  return for_each_ns_port([&](const PortNetView& v) {
    for (uint32_t i = 0; i < limits::kGidTableLen; ++i)
      if (v.valid(i) && !std::memcmp(v.gids[i].gid, dgid, 8)) {
        std::memcpy(sgid, v.gids[i].gid, 16);
        return true;
      }
    return false;
  });
}

// Loopback: the first active RoCE device of this namespace (in name
// order), its first IPv4 GID (else its first non-link-local one), as the
// kernel takes the first active port for a loopback destination.
int CmService::Impl::loopback_source(Addr* s, bool gid0) {
  const bool found = for_each_ns_port([&](const PortNetView& v) {
    int pick = gid0 && v.valid(0) ? 0 : -1;  // AF_IB loopback (cma_bind_loopback): GID 0
    for (uint32_t i = 0; i < limits::kGidTableLen && !(gid0 && pick == 0); ++i) {
      if (!v.valid(i) || v.gids[i].gid[0] == 0xfe) continue;
      Addr a;
      std::memcpy(a.ip, v.gids[i].gid, 16);
      if (a.v4()) {
        pick = static_cast<int>(i);
        break;
      }
      if (pick < 0) pick = static_cast<int>(i);
    }
    if (pick < 0) return false;
    std::memcpy(s->ip, v.gids[pick].gid, 16);
    return true;
  });
  return found ? 0 : EADDRNOTAVAIL;
}

void CmService::Impl::cmd_connect(Channel& c, const std::vector<uint8_t>& in, ReplyOut* r) {
  rdma_ucm_connect cmd;
  take(in, &cmd);
  if (!cmd.conn_param.valid) {
    r->err = EINVAL;  // ucma_connect, before the id
    return;
  }
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
  q.pkey.set(id->path.pkey);
  q.mtu_rnr.set_bits(7, 4, id->path.mtu);
  q.mtu_rnr.set_bits(2, 0, p.rnr_retry_count & 7);
  q.retries_srq.set_bits(7, 4, 15);
  q.retries_srq.set_bits(3, 3, p.srq ? 1 : 0);
  std::memcpy(q.primary.local_gid, id->dev.sgid, 16);
  std::memcpy(q.primary.remote_gid, id->dgid, 16);
  // The primary path as cm.c cm_format_req writes it from the route (RoCE: no LIDs).
  q.primary.flow_rate.set_bits(31, 12, id->path.flow_label);
  q.primary.flow_rate.set_bits(5, 0, id->path.rate);
  q.primary.traffic_class = id->path.traffic_class;
  q.primary.hop_limit = id->path.hop_limit;
  q.primary.sl_subnet.set_bits(7, 4, id->path.sl);
  q.primary.sl_subnet.set_bits(3, 3, id->path.hop_limit <= 1 ? 1 : 0);
  q.primary.ack_timeout.set_bits(7, 3, std::min(31, id->path.packet_life_time + 1));
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
    if (o.get() == id || o->st != St::Listen || o->port_ps != id->port_ps || o->src.port != id->src.port) continue;
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
    case St::Disconnected:
      // The peer's DREQ was answered when it came; the kernel answers it
      // here (ib_send_cm_drep) and enters timewait then.
      if (id->dreq_rcvd && id->timewait_at == -1) enter_timewait(id);
      return;
    case St::DreqSent:
      return;  // ours is on its way
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
  // ucma_process_join: the size, then the flags, then the id (with a device).
  if (len != rdma_addr_size(addr) || (flags != RDMA_MC_JOIN_FLAG_FULLMEMBER &&
                                      flags != RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER)) {
    r->err = EINVAL;
    return;
  }
  Id* id = find(c, handle, &r->err);
  if (!id) return;
  Addr a;
  if ((r->err = parse_addr(addr, len, &a))) return;
  if (id->dev.set && id->src.family == AF_IB) {
    r->err = ENODEV;  // cma_iboe_join_multicast: an AF_IB id has no netdev
    return;
  }
  if (a.family == AF_IB) {
    r->err = EINVAL;  // a RoCE group is named by its IP address
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
