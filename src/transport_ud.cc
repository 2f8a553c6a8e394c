// The shared-memory transport: UD (datagrams, multicast groups, the GRH
// area of RoCE and IB datagrams).
#include <endian.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "async.h"
#include "context.h"
#include "count.h"
#include "gid_table.h"
#include "mover.h"
#include "proc.h"
#include "transport_internal.h"


namespace shmrdma {

using namespace transport;

namespace {

constexpr uint64_t kUdMtu = 4096;  // the port's active MTU: a UD message fits in one packet
constexpr uint32_t kMulticastLidFirst = 0xc000, kMulticastLidLast = 0xfffe;  // IBA 4.1.1

// GID[0] of a port: the link-local prefix and the port GUID, network order.
void port_gid(const layout::PortRecord& port, uint8_t out[16]) {
  uint64_t prefix = htobe64(0xfe80000000000000ull), guid = htobe64(port.port_guid);
  std::memcpy(out, &prefix, 8);
  std::memcpy(out + 8, &guid, 8);
}

bool v4_mapped(const uint8_t g[16]) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g, kPrefix, 12) == 0;
}

// A multicast GID on Ethernet: IPv6 multicast (ff00::/8), or an IPv4
// multicast address mapped (::ffff:224.0.0.0/4).
bool roce_multicast_gid(const uint8_t g[16]) { return g[0] == 0xff || (v4_mapped(g) && (g[12] & 0xf0) == 0xe0); }

// RoCE packet types of a UD receive completion's sl (build_roce_grh).
constexpr uint8_t kRocePktGrh = 0x0, kRocePktIpv6 = 0x1, kRocePktIpv4 = 0x2, kRocePktUdp = 0x8;

void put16(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}

// The 40-byte GRH area of a UD message received over RoCE, as rxe hands it
// to the receiver and libibverbs' ibv_init_ah_from_wc parses it
// (get_grh_header_version): RoCE v2 between two IPv4-mapped GIDs puts the
// 20-byte IPv4 header at offset 20 (version 4, IHL 5, protocol UDP, a valid
// header checksum) after 20 zero bytes; any other GID gets an IPv6 header
// whose next header says the GID type (UDP 17 for RoCE v2, 0x1B for RoCE v1).
// Lengths are those of the packet (UDP 8 + BTH 12 + DETH 8 [+ ImmDt 4] +
// payload + ICRC 4).
//
// Returns the RoCE packet type a UD receive completion reports in its sl
// (what mlx5, the reference RoCE adapter, writes there on Ethernet, where the
// IB service level is not carried: bit 3 set for a UDP-encapsulated RoCE v2
// frame, bits 2:0 the L3 header: 0 GRH (RoCE v1), 1 IPv6, 2 IPv4). UCX's
// ud_verbs reads it to know where the destination address sits in the area.
uint8_t build_roce_grh(const AddressVector& av, const uint8_t sgid[16], uint8_t sgid_type, uint64_t len, bool imm,
                       uint8_t grh[kGrhBytes]) {
  std::memset(grh, 0, kGrhBytes);
  const uint32_t transport = 12 + 8 + (imm ? 4 : 0) + static_cast<uint32_t>(len) + 4;
  const bool v2 = sgid_type == layout::kGidTypeRoceV2;
  if (v2 && v4_mapped(sgid) && v4_mapped(av.dgid)) {
    uint8_t* ip = grh + 20;
    ip[0] = 0x45;
    ip[1] = av.traffic_class;
    put16(ip + 2, 20 + 8 + transport);
    put16(ip + 6, 0x4000);  // don't fragment
    ip[8] = av.hop_limit;
    ip[9] = 17;  // UDP
    std::memcpy(ip + 12, sgid + 12, 4);
    std::memcpy(ip + 16, av.dgid + 12, 4);
    uint32_t sum = 0;
    for (int i = 0; i < 20; i += 2) sum += uint32_t{ip[i]} << 8 | ip[i + 1];
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    put16(ip + 10, ~sum & 0xffff);
    return kRocePktUdp | kRocePktIpv4;
  }
  uint32_t w0 = htobe32((6u << 28) | (uint32_t{av.traffic_class} << 20) | (av.flow_label & 0xfffff));
  std::memcpy(grh, &w0, 4);
  put16(grh + 4, v2 ? 8 + transport : transport);
  grh[6] = v2 ? 17 : 0x1b;
  grh[7] = av.hop_limit;
  std::memcpy(grh + 8, sgid, 16);
  std::memcpy(grh + 24, av.dgid, 16);
  return v2 ? kRocePktUdp | kRocePktIpv6 : kRocePktGrh;
}


}  // namespace

// UD: every WQE names its destination (address vector, QPN, Q_Key). A
// message nobody can take (no such QP, wrong LID/GID or Q_Key, no receive
// posted) is dropped and the send still completes, as on the wire. A
// multicast LID (with its GRH) reaches every QP attached to the group, the
// sender's own included when it is attached (hardware loopback).
LocalContext::Exec LocalContext::execute_ud(Qp* qp, SendSlot* s, uint32_t* status) noexcept {
  const uint64_t len = s->length;
  if (len > kUdMtu) {
    *status = IBV_WC_LOC_LEN_ERR;
    return Exec::kError;
  }
  IoVec local[limits::kMaxSge];
  uint32_t nlocal = 0;
  if (!gather_local(qp, s, local, &nlocal)) {
    *status = IBV_WC_LOC_PROT_ERR;
    return Exec::kError;
  }
  const layout::DeviceRecord& dev = registry_.device();
  const uint32_t nports = std::min<uint32_t>(dev.num_ports, limits::kMaxPorts);
  const AddressVector& av = s->av;
  // RoCE (Ethernet link layer): no LIDs, the GRH carries the address.
  const bool eth = ethernet();
  const bool multicast = eth ? av.is_global && roce_multicast_gid(av.dgid)
                             : av.dlid >= kMulticastLidFirst && av.dlid <= kMulticastLidLast;
  const bool imm = s->opcode == IBV_WR_SEND_WITH_IMM;
  const uint32_t qkey = (s->remote_qkey & 0x80000000u) ? qp->attr.qkey : s->remote_qkey;
  const uint32_t sport = std::clamp<uint32_t>(qp->attr.port_num, 1, nports);

  // The 40-byte GRH area: the header when the AH had one (IBA 8.3), else
  // left as zeros.
  uint8_t grh[kGrhBytes] = {};
  layout::Cqe cqe{};
  if (av.is_global && !eth) {
    uint32_t w0 = htobe32((6u << 28) | (uint32_t{av.traffic_class} << 20) | (av.flow_label & 0xfffff));
    uint16_t paylen = htobe16(static_cast<uint16_t>(len));
    std::memcpy(grh, &w0, 4);
    std::memcpy(grh + 4, &paylen, 2);
    grh[6] = 0x1b;  // next header: IBA transport
    grh[7] = av.hop_limit;
    port_gid(dev.ports[sport - 1], grh + 8);
    std::memcpy(grh + 24, av.dgid, 16);
    cqe.wc_flags = IBV_WC_GRH;
  }
  if (eth) cqe.wc_flags = IBV_WC_GRH;  // the area is written below, once the source GID is known
  cqe.src_qp = qp->qpn;
  cqe.slid = dev.ports[sport - 1].lid;
  cqe.sl = av.sl;  // on Ethernet the RoCE packet type instead (build_roce_grh)
  cqe.pkey_index = 0;
  cqe.opcode = IBV_WC_RECV;
  if (s->send_flags & IBV_SEND_SOLICITED) cqe.flags = layout::kCqeSolicited;
  if (s->opcode == IBV_WR_SEND_WITH_IMM) {
    cqe.imm_data = s->imm_data;
    cqe.wc_flags |= IBV_WC_WITH_IMM;
  }

  // One destination QP: kWait when another sender is delivering into it.
  auto send_to = [&](Peer& peer, uint32_t qpn, bool check_address) -> Exec {
    layout::QpEntry* t = peer.qp(layout::qpn_index(qpn));
    if (!t || t->state.load(std::memory_order_acquire) != layout::kLive || t->qpn != qpn || t->qp_type != IBV_QPT_UD)
      return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;  // counters: UD drops
    uint32_t ts = t->qp_state.load(std::memory_order_acquire);
    if (ts != IBV_QPS_RTR && ts != IBV_QPS_RTS && ts != IBV_QPS_SQD && ts != IBV_QPS_SQE)
      return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;
    if (check_address) {
      // The QP must be on the port the address resolved to (its device's
      // record is a validated private copy).
      const uint32_t tport = t->port;
      if (tport != qp->peer_port) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;
      if (av.is_global && !eth) {  // (on Ethernet the DGID is what found the port)
        uint8_t gid[16];
        port_gid(peer.device->record().ports[tport - 1], gid);
        if (std::memcmp(gid, av.dgid, 16) != 0) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;
      }
    }
    if (t->qkey != qkey) return count::ud_invalid(cnt_, qp, s, check_address), Exec::kDone;
    layout::Cqe c = cqe;
    c.qp_num = t->qpn;
    const Deliver d = deliver(qp, peer, t, s->opcode, s->length, local, nlocal, grh, false, c, status);
    // counters (a destination on another device counts for its port there)
    if (d != Deliver::kBusy) count::ud_arrived(cnt_, qp, s, t, peer.device, d == Deliver::kNoReceive);
    switch (d) {
      case Deliver::kBusy: return Exec::kWait;
      case Deliver::kNoReceive: return Exec::kDone;  // dropped (counted above)
      default: return Exec::kDone;  // delivered, or the receiver's WQE failed: unacknowledged for us
    }
  };

  if (!multicast) {
    const uint32_t rqpn = s->remote_qpn & limits::kQpnMask;
    // The destination device and port of this address vector: resolved
    // when the vector differs from the last one this QP sent to, or its
    // device went away (directory.h).
    if (!qp->ud_av_valid || !same_address(qp->ud_av, av) || !destination_holds(qp)) {
      qp->ud_av = av;
      qp->ud_av_valid = true;
      Resolved r;
      resolve_address(av, &r);
      set_destination(qp, r);
    }
    // On Ethernet a UD message is one packet of the port's active MTU (the
    // interface MTU by rxe's rule), as on IB it is at most 4096 bytes.
    if (eth && qp->ud_mtu && len > qp->ud_mtu) {
      *status = IBV_WC_LOC_LEN_ERR;
      return Exec::kError;
    }
    if (eth && qp->peer_dev) cqe.sl = build_roce_grh(av, qp->ud_sgid, qp->ud_sgid_type, len, imm, grh);
    if (!qp->peer_dev) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;  // counters: nobody has it
    // The cached peer is still that context while its registry slot keeps
    // the generation (a shared-memory read; Peer::alive reads /proc).
    if (!qp->peer || qp->peer->device != qp->peer_dev || qp->peer->slot != layout::qpn_slot(rqpn) ||
        !qp->peer_dev->registry->slot_is(qp->peer->slot, qp->peer->generation))
      qp->peer = peer_of(qp->peer_dev, rqpn);
    if (!qp->peer) return count::ud_invalid(cnt_, qp, s, true), Exec::kDone;  // counters: no such context
    return send_to(*qp->peer, rqpn, true);
  }
  if (!av.is_global) return Exec::kDone;  // a multicast packet carries a GRH naming its group
  if (eth) {
    // Our source GID for the GRH area (a snapshot of our port's table).
    PortNetView v;
    if (registry_.port_net(sport, &v) != 0 || !v.valid(av.sgid_index)) return Exec::kDone;  // no source: dropped
    cqe.sl = build_roce_grh(av, v.gids[av.sgid_index].gid, v.gids[av.sgid_index].type, len, imm, grh);
  }
  // Members may be on any device of the home: each keeps its groups in its
  // registry (on Ethernet groups are MGIDs alone: the LID is 0).
  layout::McastMember members[limits::kMaxMcastQpAttach];
  const uint16_t mlid = eth ? 0 : av.dlid;
  for (HomeDevice* d : dir_.all(true)) {
    if ((d->record().net.link_layer == layout::kLinkLayerEthernet) != eth) continue;  // IB and RoCE never mix
    uint32_t n = d->registry->mcast_members(av.dgid, mlid, members, limits::kMaxMcastQpAttach);
    for (uint32_t i = 0; i < n; ++i) {
      std::shared_ptr<Peer> peer = d->peers.get(*d, members[i].slot, self_peer_);
      if (!peer || peer->generation != members[i].generation) continue;
      // A member another sender is delivering into is retried briefly; the
      // others must not get the message twice, so the WQE never waits.
      for (int tries = 0; tries < 1000 && send_to(*peer, members[i].qpn, false) == Exec::kWait; ++tries) {
      }
    }
  }
  return Exec::kDone;
}

}  // namespace shmrdma
