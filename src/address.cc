// Address resolution, the one seam between an address (LID or GID) and a
// device of the home, its port and, through the QPN, a QP in that device's
// registry (directory.h). RC/UC resolve their path at RTR, UD the address
// vector of each send (cached per QP while it does not change), multicast
// looks at every device's groups.
//
// InfiniBand devices are found by DLID (LIDs are unique across a home). On an
// Ethernet port (RoCE) the LID is 0 and the GRH is mandatory: the DGID is
// looked up in the GID tables of every Ethernet device of the home,
// including devices bound to interfaces of other network namespaces that
// share it. A match stays valid while neither GID table changes (each
// port's seqlock value, one load per send); a GID that left the target's
// table makes the next send resolve again and find nobody.
#include <time.h>

#include <cstring>

#include "context.h"
#include "gid_table.h"

namespace shmrdma {

namespace {
uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}
}  // namespace

bool LocalContext::same_address(const AddressVector& a, const AddressVector& b) noexcept {
  return a.dlid == b.dlid && a.is_global == b.is_global && a.port_num == b.port_num &&
         a.sgid_index == b.sgid_index && (!a.is_global || std::memcmp(a.dgid, b.dgid, 16) == 0);
}

int LocalContext::check_ethernet_av(uint32_t port, bool is_global, uint32_t sgid_index) const noexcept {
  if (!ethernet()) return 0;
  if (!is_global) return EINVAL;  // RoCE: the GRH carries the address (rdma_check_ah_attr)
  PortNetView v;
  if (registry_.port_net(port, &v) != 0 || !v.valid(sgid_index)) return EINVAL;
  return 0;
}

void LocalContext::resolve_address(const AddressVector& av, Resolved* r) noexcept {
  *r = Resolved{};
  if (!ethernet()) {
    r->dev = dir_.by_lid(av.dlid, &r->port);
    return;
  }
  if (!av.is_global) return;
  const uint32_t sport = av.port_num ? av.port_num : 1;
  PortNetView v;
  uint8_t type = kGidTypeAny;
  if (registry_.port_net(sport, &v) == 0 && v.valid(av.sgid_index)) {
    type = v.gids[av.sgid_index].type;  // a v2 source reaches v2 entries (mlx5 lists each GID as v1 and v2)
    std::memcpy(r->sgid, v.gids[av.sgid_index].gid, 16);
    r->sgid_type = type;
    r->own_seq = v.seq;  // the snapshot's: a later change makes destination_holds fail
    if (v.active_mtu >= 1 && v.active_mtu <= 5) r->own_mtu = 128u << v.active_mtu;  // enum ibv_mtu
  } else {
    return;  // our own source GID is gone: nothing can be sent
  }
  r->by_gid = true;
  r->dev = dir_.by_gid(av.dgid, type, &r->port, &r->seq);
}

void LocalContext::set_destination(Qp* qp, const Resolved& r) noexcept {
  qp->tgt = Qp::TargetCache{};  // post_send checks the target in full again (transport_post.cc)
  qp->set_peer_dev(r.dev);
  qp->peer_port = r.port;
  qp->path_by_gid = r.by_gid;
  qp->peer_gid_seq = r.seq;
  qp->own_gid_seq = r.own_seq;
  std::memcpy(qp->ud_sgid, r.sgid, 16);
  qp->ud_sgid_type = r.sgid_type;
  qp->ud_mtu = r.own_mtu;
}

bool LocalContext::destination_holds(const Qp* qp) const noexcept {
  const HomeDevice* d = qp->peer_dev;
  if (!d || d->gone.load(std::memory_order_relaxed)) return false;
  if (!qp->path_by_gid) return true;
  const uint32_t sport = qp->attr.port_num ? qp->attr.port_num : 1;
  return d->registry->port_net_seq(qp->peer_port) == qp->peer_gid_seq &&
         registry_.port_net_seq(sport) == qp->own_gid_seq;
}

bool LocalContext::resolve_path(Qp* qp, bool now) noexcept {
  if (!now) {
    const uint64_t t = mono_ns();
    if (t - qp->resolve_retry_ns < 1'000'000) return qp->peer_dev != nullptr;
    qp->resolve_retry_ns = t;
  }
  const QpAttr& a = qp->attr;
  AddressVector av;
  av.dlid = a.dlid;
  av.is_global = a.is_global;
  av.port_num = a.ah_port_num ? a.ah_port_num : a.port_num;
  av.sgid_index = a.grh.sgid_index;
  std::memcpy(av.dgid, a.grh.dgid.raw, 16);
  Resolved r;
  resolve_address(av, &r);
  set_destination(qp, r);
  // Published for peers that check whether we are connected to them.
  qp->shared->dest_device = r.dev ? r.dev->home_id : 0;
  layout::bump_version(qp->shared);  // initiators check our entry in full again (QpEntry::version)
  return r.dev != nullptr;
}

}  // namespace shmrdma
