// RoCE across two network namespaces that share one state home (the
// pod-to-pod case), through the public verbs API only.
//
// The environment makes two namespaces joined by a veth pair (198.18.0.1 in
// nsA, 198.18.0.2 in nsB; names carry the pid), a private state home, and a
// RoCE device bound to each veth end (`ip netns exec NS shmrdma up --netdev`).
// It removes all of it at the end, also when a test failed. Workers run as
//   ip netns exec NS shmrdma --home H run -- dp_roce --worker ROLE --scenario S
// with $DP_DEVICE naming their device and fd 3 the control socketpair.
//
// Scenarios:
//  - errors (one worker, nsA): GRH mandatory (ibv_create_ah NULL + EINVAL,
//    ibv_modify_qp EINVAL), a sgid_index naming no entry (EINVAL), RC to a
//    GID no device holds and to the zero GID: IBV_WC_RETRY_EXC_ERR within a
//    deadline; UD to an unknown GID: the send completes, nothing arrives.
//  - pair (server nsB, client nsA): UD with GRH byte for byte, the GRH area
//    (20 zero bytes, the IPv4 header at offset 20 with a valid checksum),
//    wc.slid 0, IBV_WC_GRH, wc.sl the RoCE packet type; the reply through ibv_create_ah_from_wc;
//    multicast to ::ffff:224.1.2.3 and ff0e::1:2 with members in both
//    namespaces; RC SEND / WRITE / READ / atomics over GIDs byte for byte;
//    then the server removes the address whose GID the client's RC and UD
//    use (198.18.0.3, GID index 2) and refreshes its device: the next RC send
//    fails with IBV_WC_RETRY_EXC_ERR, the next UD send is dropped.
//  - integrity: dp_integrity's random-operation workers (every opcode,
//    random sizes, byte for byte) over GIDs, one in each namespace.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"

namespace {

constexpr int kWaitMs = 10000;
std::string g_role = "driver";

[[noreturn]] void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stdout, "FAIL [%s]: ", g_role.c_str());
  std::vfprintf(stdout, fmt, ap);
  std::fprintf(stdout, "\n");
  std::fflush(stdout);
  va_end(ap);
  std::_Exit(1);
}
#define REQUIRE(c, ...) \
  do {                  \
    if (!(c)) die(__VA_ARGS__); \
  } while (0)

std::string hex(const uint8_t* p, size_t n) {
  std::string s;
  char b[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

void v4_gid(const char* ip, uint8_t out[16]) {
  std::memset(out, 0, 16);
  out[10] = out[11] = 0xff;
  REQUIRE(inet_pton(AF_INET, ip, out + 12) == 1, "inet_pton %s", ip);
}

// ------------------------------------------------------------------ workers

struct Ep {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  uint8_t* buf = nullptr;
  size_t len = 1 << 20;
  ibv_mr* mr = nullptr;

  void open() {
    std::string why;
    ctx = harness::open_shm0(&why);
    REQUIRE(ctx, "open: %s", why.c_str());
    ibv_port_attr pa{};
    REQUIRE(ibv_query_port(ctx, 1, &pa) == 0, "ibv_query_port");
    REQUIRE(pa.link_layer == IBV_LINK_LAYER_ETHERNET, "link layer %d, want Ethernet", pa.link_layer);
    REQUIRE(pa.lid == 0, "lid %u on Ethernet", pa.lid);
    pd = ibv_alloc_pd(ctx);
    REQUIRE(pd, "ibv_alloc_pd");
    cq = ibv_create_cq(ctx, 256, nullptr, nullptr, 0);
    REQUIRE(cq, "ibv_create_cq");
    buf = static_cast<uint8_t*>(aligned_alloc(4096, len));
    std::memset(buf, 0, len);
    mr = ibv_reg_mr(pd, buf, len,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                        IBV_ACCESS_REMOTE_ATOMIC);
    REQUIRE(mr, "ibv_reg_mr");
  }
  ibv_gid gid(int index) {
    ibv_gid g{};
    REQUIRE(ibv_query_gid(ctx, 1, index, &g) == 0, "ibv_query_gid %d", index);
    return g;
  }
  ibv_qp* qp(ibv_qp_type type) {
    ibv_qp* q = harness::create_qp(pd, cq, type, 64, 64);
    REQUIRE(q, "ibv_create_qp: %s", std::strerror(errno));
    return q;
  }
  ibv_ah* ah(const uint8_t dgid[16], int sgid_index, bool global = true, int* err = nullptr) {
    ibv_ah_attr a{};
    a.port_num = 1;
    a.is_global = global;
    a.sl = 3;
    std::memcpy(a.grh.dgid.raw, dgid, 16);
    a.grh.sgid_index = static_cast<uint8_t>(sgid_index);
    a.grh.hop_limit = 64;
    a.grh.traffic_class = 0x20;
    errno = 0;
    ibv_ah* h = ibv_create_ah(pd, &a);
    if (err) *err = h ? 0 : errno;
    return h;
  }
  ibv_sge sge(size_t off, uint32_t n) { return ibv_sge{reinterpret_cast<uintptr_t>(buf + off), n, mr->lkey}; }
};

void ud_up(ibv_qp* q, uint32_t qkey) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qkey = qkey;
  REQUIRE(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0, "UD INIT");
  a.qp_state = IBV_QPS_RTR;
  REQUIRE(ibv_modify_qp(q, &a, IBV_QP_STATE) == 0, "UD RTR");
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  REQUIRE(ibv_modify_qp(q, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "UD RTS");
}

// INIT, then RTR with a GRH path to (dgid, dest_qpn): the modify's result.
int rc_to_rtr(ibv_qp* q, uint32_t dest_qpn, const uint8_t dgid[16], int sgid_index, bool global = true) {
  ibv_qp_attr a{};
  if (harness::qp_state(q) == IBV_QPS_RESET) {
    int rc = harness::qp_to_init(q, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                   IBV_ACCESS_REMOTE_ATOMIC);
    REQUIRE(rc == 0, "RC INIT: %d", rc);
  }
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest_qpn;
  a.max_dest_rd_atomic = 4;
  a.min_rnr_timer = 1;
  a.ah_attr.port_num = 1;
  a.ah_attr.is_global = global;
  std::memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(sgid_index);
  a.ah_attr.grh.hop_limit = 64;
  return ibv_modify_qp(q, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int post_send(ibv_qp* q, ibv_wr_opcode op, ibv_sge sg, uint64_t wr_id, ibv_ah* ah = nullptr, uint32_t rqpn = 0,
              uint64_t raddr = 0, uint32_t rkey = 0) {
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = &sg;
  wr.num_sge = 1;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (op == IBV_WR_SEND_WITH_IMM) wr.imm_data = htonl(0xABCD0000u + static_cast<uint32_t>(wr_id));
  if (ah) {
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = rqpn;
    wr.wr.ud.remote_qkey = 0x11111111;
  } else if (op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = raddr;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = 5;
  } else {
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
  }
  return ibv_post_send(q, &wr, &bad);
}

void post_recv(ibv_qp* q, ibv_sge sg, uint64_t wr_id) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  wr.sg_list = &sg;
  wr.num_sge = 1;
  REQUIRE(ibv_post_recv(q, &wr, &bad) == 0, "ibv_post_recv");
}

ibv_wc wait_wc(ibv_cq* cq, const char* what, int ms = kWaitMs) {
  ibv_wc wc{};
  REQUIRE(harness::poll_one(cq, &wc, ms), "%s: no completion within %d ms", what, ms);
  return wc;
}

void expect_silence(ibv_cq* cq, const char* what, int ms = 300) {
  ibv_wc wc{};
  REQUIRE(!harness::poll_one(cq, &wc, ms), "%s: unexpected completion %s", what, harness::wc_str(wc).c_str());
}

void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 8)) & 0xff);
}
bool same_pattern(const uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 8)) & 0xff)) return false;
  return true;
}

int errors_worker() {
  Ep e;
  e.open();
  uint8_t unknown[16], zero[16] = {};
  v4_gid("198.18.0.99", unknown);
  int err = 0;
  // GRH mandatory on Ethernet.
  REQUIRE(!e.ah(unknown, 1, false, &err) && err == EINVAL, "ibv_create_ah without GRH: errno %d, want EINVAL", err);
  // sgid_index naming no entry (the rxe layout has fe80 and ::ffff:A: 0 and 1).
  REQUIRE(!e.ah(unknown, 7, true, &err) && err == EINVAL, "ibv_create_ah sgid_index 7: errno %d, want EINVAL", err);
  REQUIRE(!e.ah(unknown, 200, true, &err) && err == EINVAL, "ibv_create_ah sgid_index 200: errno %d", err);
  ibv_ah* ah = e.ah(unknown, 1, true, &err);
  REQUIRE(ah, "ibv_create_ah to an unknown GID: errno %d (an unknown address is no error here)", err);
  // RC path without GRH / bad sgid_index.
  ibv_qp* rc = e.qp(IBV_QPT_RC);
  int r = rc_to_rtr(rc, 0x10000, unknown, 1, false);
  REQUIRE(r == EINVAL, "modify_qp RTR without GRH: %d, want EINVAL", r);
  r = rc_to_rtr(rc, 0x10000, unknown, 9);
  REQUIRE(r == EINVAL, "modify_qp RTR with sgid_index 9: %d, want EINVAL", r);
  REQUIRE(harness::qp_state(rc) == IBV_QPS_INIT, "a refused modify changed the state to %d", harness::qp_state(rc));
  // RC to a GID no device holds, and to the zero GID: unreachable.
  for (const uint8_t* dgid : {static_cast<const uint8_t*>(unknown), static_cast<const uint8_t*>(zero)}) {
    ibv_qp* q = e.qp(IBV_QPT_RC);
    r = rc_to_rtr(q, 0x10000, dgid, 1);
    REQUIRE(r == 0, "modify_qp RTR to %s: %d", hex(dgid, 16).c_str(), r);
    REQUIRE(harness::qp_to_rts(q, 7, 10, 2) == 0, "RTS");
    REQUIRE(post_send(q, IBV_WR_SEND, e.sge(0, 64), 1) == 0, "post_send");
    ibv_wc wc = wait_wc(e.cq, "RC send to an unknown GID");
    REQUIRE(wc.status == IBV_WC_RETRY_EXC_ERR, "RC to %s: %s, want RETRY_EXC_ERR", hex(dgid, 16).c_str(),
            harness::wc_str(wc).c_str());
  }
  // UD to an unknown GID: completes, silently dropped.
  ibv_qp* ud = e.qp(IBV_QPT_UD);
  ud_up(ud, 0x11111111);
  REQUIRE(post_send(ud, IBV_WR_SEND, e.sge(0, 64), 2, ah, 0x10000) == 0, "UD post_send");
  ibv_wc wc = wait_wc(e.cq, "UD send to an unknown GID");
  REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2, "UD to an unknown GID: %s", harness::wc_str(wc).c_str());
  expect_silence(e.cq, "after the UD send");
  // A UD message is one packet: at most the active MTU (1024 on a veth of
  // MTU 1500).
  ibv_port_attr pa{};
  REQUIRE(ibv_query_port(e.ctx, 1, &pa) == 0 && pa.active_mtu == IBV_MTU_1024, "active_mtu %d, want 1024",
          pa.active_mtu);
  REQUIRE(post_send(ud, IBV_WR_SEND, e.sge(0, 1025), 3, ah, 0x10000) == 0, "UD post_send 1025 bytes");
  wc = wait_wc(e.cq, "UD send over the MTU");
  REQUIRE(wc.status == IBV_WC_LOC_LEN_ERR && wc.wr_id == 3, "UD send of 1025 bytes: %s, want LOC_LEN_ERR",
          harness::wc_str(wc).c_str());
  std::printf("ERRORS OK\n");
  return 0;
}

// The control channel.
struct Hello {
  uint32_t magic = 0x524f4345;
  uint32_t ud_qpn = 0, ud2_qpn = 0, rc_qpn = 0;
  uint8_t gid1[16] = {}, gid2[16] = {};
  uint64_t addr = 0;
  uint32_t rkey = 0, pad = 0;
};
Hello exchange(const Hello& me) {
  Hello peer;
  REQUIRE(harness::write_all(harness::kCtlFd, &me, sizeof me), "hello: write");
  REQUIRE(harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000) && peer.magic == me.magic, "hello: read");
  return peer;
}
void say(char c) { REQUIRE(harness::write_all(harness::kCtlFd, &c, 1), "say %c", c); }
void hear(char want) {
  char c = 0;
  REQUIRE(harness::read_all(harness::kCtlFd, &c, 1, 60000) && c == want, "waited for '%c', got '%c'", want, c ? c : '-');
}

constexpr int kUdMsgs = 6;
uint32_t ud_size(int i) { return 1 + static_cast<uint32_t>(i) * 197; }  // 1 .. 986 (active MTU 1024)

uint16_t csum(const uint8_t* p, int n) {
  uint32_t s = 0;
  for (int i = 0; i < n; i += 2) s += uint32_t{p[i]} << 8 | p[i + 1];
  while (s >> 16) s = (s & 0xffff) + (s >> 16);
  return static_cast<uint16_t>(~s);
}

// The GRH area of a RoCE v2 message between two IPv4-mapped GIDs.
void check_v4_grh(const uint8_t* g, const uint8_t sgid[16], const uint8_t dgid[16], uint32_t len, bool imm,
                  const char* what) {
  for (int i = 0; i < 20; ++i) REQUIRE(g[i] == 0, "%s: GRH area byte %d is %02x, want 0", what, i, g[i]);
  const uint8_t* ip = g + 20;
  REQUIRE(ip[0] == 0x45, "%s: IPv4 version/IHL %02x", what, ip[0]);
  REQUIRE(ip[1] == 0x20, "%s: TOS %02x, want the traffic class 0x20", what, ip[1]);
  const uint32_t tot = uint32_t{ip[2]} << 8 | ip[3];
  const uint32_t want = 20 + 8 + 12 + 8 + (imm ? 4 : 0) + len + 4;
  REQUIRE(tot == want, "%s: IPv4 total length %u, want %u", what, tot, want);
  REQUIRE(ip[8] == 64, "%s: TTL %u, want the hop limit 64", what, ip[8]);
  REQUIRE(ip[9] == 17, "%s: protocol %u, want UDP", what, ip[9]);
  REQUIRE(csum(ip, 20) == 0, "%s: IPv4 header checksum invalid (%s)", what, hex(ip, 20).c_str());
  REQUIRE(std::memcmp(ip + 12, sgid + 12, 4) == 0 && std::memcmp(ip + 16, dgid + 12, 4) == 0,
          "%s: addresses %s, want %s -> %s", what, hex(ip + 12, 8).c_str(), hex(sgid + 12, 4).c_str(),
          hex(dgid + 12, 4).c_str());
}

// On Ethernet a UD receive completion's sl is the RoCE packet type, as mlx5
// reports it (UCX's ud_verbs reads it): 0x8 RoCE v2 (UDP) | L3 header 2 IPv4
// or 1 IPv6. The sender's sl (3) is not carried.
constexpr uint8_t kPktV2Ipv4 = 0xa, kPktV2Ipv6 = 0x9;

void check_ud_wc(const ibv_wc& wc, uint32_t src_qp, uint32_t len, const char* what, uint8_t want_sl = kPktV2Ipv4) {
  REQUIRE(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "%s: %s", what, harness::wc_str(wc).c_str());
  REQUIRE(wc.wc_flags & IBV_WC_GRH, "%s: no IBV_WC_GRH", what);
  REQUIRE(wc.slid == 0, "%s: slid %u, want 0 on Ethernet", what, wc.slid);
  REQUIRE(wc.sl == want_sl, "%s: sl %#x, want the RoCE packet type %#x", what, wc.sl, want_sl);
  REQUIRE(wc.src_qp == src_qp, "%s: src_qp %u, want %u", what, wc.src_qp, src_qp);
  REQUIRE(wc.byte_len == len + 40, "%s: byte_len %u, want %u", what, wc.byte_len, len + 40);
}

const uint8_t kMgid6[16] = {0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x02};

int pair_server() {
  g_role = "server";
  Ep e;
  e.open();
  // A second address: GID index 2 (what the client's last RC and UD use,
  // removed at the end). Our device's table is refreshed by `shmrdma up`.
  const std::string bin = harness::getenv_str("SHMRDMA_BIN"), home = harness::getenv_str("DP_ROCE_HOME"),
                    ifn = harness::getenv_str("DP_ROCE_IF"), dev = harness::getenv_str("DP_DEVICE");
  // `ip` runs without our preloaded shim: in a sanitizer build the shim
  // brings the sanitizer's runtime into `ip`, whose own leaks it then reports.
  std::string cmd = "env -u LD_PRELOAD ip addr add 198.18.0.3/24 dev " + ifn + " && " + bin + " --home " + home + " up --name " + dev +
                    " --netdev " + ifn + " >/dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0, "%s", cmd.c_str());
  uint8_t want2[16];
  v4_gid("198.18.0.3", want2);
  ibv_gid g2 = e.gid(2);
  REQUIRE(std::memcmp(g2.raw, want2, 16) == 0, "GID[2] %s after adding 198.18.0.3", hex(g2.raw, 16).c_str());
  ibv_qp* ud = e.qp(IBV_QPT_UD);
  ud_up(ud, 0x11111111);
  ibv_qp* rc = e.qp(IBV_QPT_RC);
  for (int i = 0; i < kUdMsgs; ++i) post_recv(ud, e.sge(size_t(i) * 2048, 2048), 100 + i);
  Hello me;
  me.ud_qpn = ud->qp_num;
  me.rc_qpn = rc->qp_num;
  std::memcpy(me.gid1, e.gid(1).raw, 16);
  std::memcpy(me.gid2, g2.raw, 16);
  me.addr = reinterpret_cast<uintptr_t>(e.buf);
  me.rkey = e.mr->rkey;
  Hello cl = exchange(me);
  // UD with GRH, byte for byte, then the reply through ibv_create_ah_from_wc.
  say('U');
  ibv_wc last{};
  for (int i = 0; i < kUdMsgs; ++i) {
    char what[64];
    std::snprintf(what, sizeof what, "UD message %d (%u bytes)", i, ud_size(i));
    ibv_wc wc = wait_wc(e.cq, what);
    REQUIRE(wc.wr_id == uint64_t(100 + i), "%s: wr_id %llu", what, (unsigned long long)wc.wr_id);
    check_ud_wc(wc, cl.ud_qpn, ud_size(i), what);
    const uint8_t* area = e.buf + size_t(i) * 2048;
    check_v4_grh(area, cl.gid1, me.gid1, ud_size(i), i % 2, what);
    REQUIRE(same_pattern(area + 40, ud_size(i), i), "%s: payload differs", what);
    last = wc;
  }
  ibv_ah* back = ibv_create_ah_from_wc(e.pd, &last, reinterpret_cast<ibv_grh*>(e.buf + (kUdMsgs - 1) * 2048), 1);
  REQUIRE(back, "ibv_create_ah_from_wc: %s", std::strerror(errno));
  fill(e.buf + 64 * 1024, 500, 77);
  REQUIRE(post_send(ud, IBV_WR_SEND, e.sge(64 * 1024, 500), 7, back, last.src_qp) == 0, "reply");
  ibv_wc wc = wait_wc(e.cq, "the reply's send completion");
  REQUIRE(wc.status == IBV_WC_SUCCESS, "reply: %s", harness::wc_str(wc).c_str());
  hear('R');
  // Multicast: attach, let the client send to both groups, one message each.
  uint8_t mgid4[16];
  v4_gid("224.1.2.3", mgid4);
  for (const uint8_t* mg : {static_cast<const uint8_t*>(mgid4), kMgid6}) {
    ibv_gid g;
    std::memcpy(g.raw, mg, 16);
    REQUIRE(ibv_attach_mcast(ud, &g, 0) == 0, "ibv_attach_mcast %s: %s", hex(mg, 16).c_str(), std::strerror(errno));
  }
  post_recv(ud, e.sge(0, 2048), 200);
  post_recv(ud, e.sge(2048, 2048), 201);
  say('M');
  for (int i = 0; i < 2; ++i) {
    ibv_wc m = wait_wc(e.cq, "a multicast message");
    check_ud_wc(m, cl.ud_qpn, 300, "multicast", m.wr_id == 200 ? kPktV2Ipv4 : kPktV2Ipv6);
    REQUIRE(same_pattern(e.buf + (m.wr_id - 200) * 2048 + 40, 300, 50 + i), "multicast %d: payload differs", i);
  }
  expect_silence(e.cq, "after the multicast messages (each group once)");
  // RC over GIDs: the client connects to our GID index 2 (removed later).
  REQUIRE(rc_to_rtr(rc, cl.rc_qpn, cl.gid1, 2) == 0, "server RC RTR");
  REQUIRE(harness::qp_to_rts(rc, 7, 10, 2) == 0, "server RC RTS");
  post_recv(rc, e.sge(128 * 1024, 65536), 300);
  say('C');
  wc = wait_wc(e.cq, "the RC SEND");
  REQUIRE(wc.status == IBV_WC_SUCCESS && wc.byte_len == 40000 && wc.wr_id == 300, "RC SEND: %s",
          harness::wc_str(wc).c_str());
  REQUIRE(same_pattern(e.buf + 128 * 1024, 40000, 9), "RC SEND payload differs");
  hear('W');
  REQUIRE(same_pattern(e.buf + 256 * 1024, 30000, 10), "RC WRITE payload differs");
  // Remove 198.18.0.3 and refresh the device: the client's path is gone.
  cmd = "env -u LD_PRELOAD ip addr del 198.18.0.3/24 dev " + ifn + " && " + bin + " --home " + home + " up --name " + dev +
        " --netdev " + ifn + " >/dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0, "%s", cmd.c_str());
  post_recv(ud, e.sge(0, 2048), 400);
  say('X');
  hear('D');
  expect_silence(e.cq, "a UD message to a removed GID");
  std::printf("SERVER OK\n");
  return 0;
}

int pair_client() {
  g_role = "client";
  Ep e;
  e.open();
  ibv_qp* ud = e.qp(IBV_QPT_UD);
  ud_up(ud, 0x11111111);
  ibv_qp* ud2 = e.qp(IBV_QPT_UD);  // a second member of the groups, here
  ud_up(ud2, 0x11111111);
  ibv_qp* rc = e.qp(IBV_QPT_RC);
  Hello me;
  me.ud_qpn = ud->qp_num;
  me.ud2_qpn = ud2->qp_num;
  me.rc_qpn = rc->qp_num;
  std::memcpy(me.gid1, e.gid(1).raw, 16);
  Hello sv = exchange(me);
  ibv_ah* ah = e.ah(sv.gid1, 1);
  REQUIRE(ah, "ibv_create_ah to the server: %s", std::strerror(errno));
  post_recv(ud, e.sge(512 * 1024, 2048), 900);
  ibv_wc reply{};
  hear('U');
  for (int i = 0; i < kUdMsgs; ++i) {
    fill(e.buf + size_t(i) * 4096, ud_size(i), i);
    REQUIRE(post_send(ud, i % 2 ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND, e.sge(size_t(i) * 4096, ud_size(i)), i, ah,
                      sv.ud_qpn) == 0,
            "UD post_send %d", i);
    ibv_wc wc = wait_wc(e.cq, "a UD send completion");
    if (wc.wr_id == 900) {  // the reply may overtake our last send completion
      reply = wc;
      wc = wait_wc(e.cq, "a UD send completion");
    }
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == uint64_t(i), "UD send %d: %s", i, harness::wc_str(wc).c_str());
  }
  ibv_wc wc = reply.wr_id == 900 ? reply : wait_wc(e.cq, "the server's reply");
  REQUIRE(wc.wr_id == 900, "reply wr_id %llu", (unsigned long long)wc.wr_id);
  check_ud_wc(wc, sv.ud_qpn, 500, "the reply");
  check_v4_grh(e.buf + 512 * 1024, sv.gid1, me.gid1, 500, false, "the reply");
  REQUIRE(same_pattern(e.buf + 512 * 1024 + 40, 500, 77), "the reply's payload differs");
  say('R');
  // Multicast: our second QP joins too; our sending QP does not.
  uint8_t mgid4[16];
  v4_gid("224.1.2.3", mgid4);
  const uint8_t* groups[2] = {mgid4, kMgid6};
  for (const uint8_t* mg : groups) {
    ibv_gid g;
    std::memcpy(g.raw, mg, 16);
    REQUIRE(ibv_attach_mcast(ud2, &g, 0) == 0, "ibv_attach_mcast: %s", std::strerror(errno));
  }
  post_recv(ud2, e.sge(600 * 1024, 2048), 950);
  post_recv(ud2, e.sge(604 * 1024, 2048), 951);
  hear('M');
  for (int i = 0; i < 2; ++i) {
    ibv_ah* mah = e.ah(groups[i], 1);
    REQUIRE(mah, "ibv_create_ah to a multicast GID: %s", std::strerror(errno));
    fill(e.buf + 700 * 1024, 300, 50 + i);
    REQUIRE(post_send(ud, IBV_WR_SEND, e.sge(700 * 1024, 300), 20 + i, mah, 0xffffff) == 0, "multicast send");
    bool sent = false, got = false;
    for (int k = 0; k < 2; ++k) {
      ibv_wc m = wait_wc(e.cq, "multicast completions");
      if (m.wr_id == uint64_t(20 + i)) {
        REQUIRE(m.status == IBV_WC_SUCCESS, "multicast send: %s", harness::wc_str(m).c_str());
        sent = true;
      } else {
        REQUIRE(m.qp_num == ud2->qp_num, "multicast arrived at QP %u", m.qp_num);
        check_ud_wc(m, ud->qp_num, 300, "multicast (local member)", i == 0 ? kPktV2Ipv4 : kPktV2Ipv6);
        got = true;
      }
    }
    REQUIRE(sent && got, "multicast %d: send %d, local member %d", i, sent, got);
  }
  expect_silence(e.cq, "after multicast (the sender is not a member)");
  // RC over GIDs, to the server's GID index 2.
  hear('C');
  REQUIRE(rc_to_rtr(rc, sv.rc_qpn, sv.gid2, 1) == 0, "client RC RTR");
  REQUIRE(harness::qp_to_rts(rc, 7, 10, 2) == 0, "client RC RTS");
  fill(e.buf, 40000, 9);
  REQUIRE(post_send(rc, IBV_WR_SEND, e.sge(0, 40000), 1) == 0, "RC SEND");
  wc = wait_wc(e.cq, "RC SEND completion");
  REQUIRE(wc.status == IBV_WC_SUCCESS, "RC SEND: %s", harness::wc_str(wc).c_str());
  fill(e.buf + 64 * 1024, 30000, 10);
  REQUIRE(post_send(rc, IBV_WR_RDMA_WRITE, e.sge(64 * 1024, 30000), 2, nullptr, 0, sv.addr + 256 * 1024, sv.rkey) == 0,
          "RC WRITE");
  wc = wait_wc(e.cq, "RC WRITE completion");
  REQUIRE(wc.status == IBV_WC_SUCCESS, "RC WRITE: %s", harness::wc_str(wc).c_str());
  std::memset(e.buf + 128 * 1024, 0, 30000);
  REQUIRE(post_send(rc, IBV_WR_RDMA_READ, e.sge(128 * 1024, 30000), 3, nullptr, 0, sv.addr + 256 * 1024, sv.rkey) == 0,
          "RC READ");
  wc = wait_wc(e.cq, "RC READ completion");
  REQUIRE(wc.status == IBV_WC_SUCCESS && same_pattern(e.buf + 128 * 1024, 30000, 10), "RC READ: %s",
          harness::wc_str(wc).c_str());
  uint64_t before = ~0ull;  // the server's word at +1000 KiB starts 0
  REQUIRE(post_send(rc, IBV_WR_ATOMIC_FETCH_AND_ADD, e.sge(256 * 1024, 8), 4, nullptr, 0, sv.addr + 1000 * 1024,
                    sv.rkey) == 0,
          "RC FETCH_ADD");
  wc = wait_wc(e.cq, "RC FETCH_ADD completion");
  std::memcpy(&before, e.buf + 256 * 1024, 8);
  REQUIRE(wc.status == IBV_WC_SUCCESS && before == 0, "FETCH_ADD: %s, old %llu", harness::wc_str(wc).c_str(),
          (unsigned long long)before);
  say('W');
  hear('X');
  // The server's GID index 2 is gone: RC fails, UD is dropped.
  REQUIRE(post_send(rc, IBV_WR_RDMA_WRITE, e.sge(64 * 1024, 100), 5, nullptr, 0, sv.addr, sv.rkey) == 0, "RC WRITE");
  wc = wait_wc(e.cq, "RC WRITE to a removed GID");
  REQUIRE(wc.status == IBV_WC_RETRY_EXC_ERR && wc.wr_id == 5, "RC WRITE to a removed GID: %s, want RETRY_EXC_ERR",
          harness::wc_str(wc).c_str());
  ibv_ah* gone = e.ah(sv.gid2, 1);
  REQUIRE(gone, "ibv_create_ah");
  REQUIRE(post_send(ud, IBV_WR_SEND, e.sge(0, 64), 6, gone, sv.ud_qpn) == 0, "UD send");
  wc = wait_wc(e.cq, "UD send to a removed GID");
  REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 6, "UD send to a removed GID: %s", harness::wc_str(wc).c_str());
  say('D');
  std::printf("CLIENT OK\n");
  return 0;
}

// ------------------------------------------------------------- the network

struct Net {
  std::string ns_a, ns_b, veth_a, veth_b, dev_a, dev_b, home, skip, fail;
  bool ok = false;
  std::vector<std::string> undo;  // shell commands, run in reverse

  static bool sh(const std::string& c) { return std::system((c + " >/dev/null 2>&1").c_str()) == 0; }

  void setup() {
    ::signal(SIGPIPE, SIG_IGN);
    if (::geteuid() != 0) {
      skip = "not root: namespaces and `shmrdma up` need root";
      return;
    }
    const std::string bin = harness::getenv_str("SHMRDMA_BIN");
    if (bin.empty()) {
      fail = "SHMRDMA_BIN is not set";
      return;
    }
    const std::string pid = std::to_string(::getpid());
    ns_a = "dprA" + pid, ns_b = "dprB" + pid, veth_a = "dpva" + pid, veth_b = "dpvb" + pid;
    dev_a = "roceA" + pid, dev_b = "roceB" + pid;
    char tmpl[] = "/tmp/shmrdma-dproce-XXXXXX";
    if (!::mkdtemp(tmpl)) {
      fail = "mkdtemp";
      return;
    }
    home = tmpl;
    undo.push_back("rm -rf " + home);
    auto step = [&](const std::string& c, const std::string& u) {
      if (!fail.empty()) return;
      if (!sh(c)) {
        fail = "failed: " + c;
        return;
      }
      if (!u.empty()) undo.push_back(u);
    };
    step("ip netns add " + ns_a, "ip netns del " + ns_a);
    step("ip netns add " + ns_b, "ip netns del " + ns_b);
    step("ip link add " + veth_a + " type veth peer name " + veth_b, "ip link del " + veth_a);
    step("ip link set " + veth_a + " netns " + ns_a, "");
    step("ip link set " + veth_b + " netns " + ns_b, "");
    step("ip -n " + ns_a + " addr add 198.18.0.1/24 dev " + veth_a, "");
    step("ip -n " + ns_b + " addr add 198.18.0.2/24 dev " + veth_b, "");
    step("ip -n " + ns_a + " link set " + veth_a + " up && ip -n " + ns_a + " link set lo up", "");
    step("ip -n " + ns_b + " link set " + veth_b + " up && ip -n " + ns_b + " link set lo up", "");
    step("ip netns exec " + ns_a + " " + bin + " --home " + home + " up --name " + dev_a + " --netdev " + veth_a,
         "ip netns exec " + ns_a + " " + bin + " --home " + home + " down --force --name " + dev_a);
    step("ip netns exec " + ns_b + " " + bin + " --home " + home + " up --name " + dev_b + " --netdev " + veth_b,
         "ip netns exec " + ns_b + " " + bin + " --home " + home + " down --force --name " + dev_b);
    if (!fail.empty()) return;
    // The environment `shmrdma env` gives (SYSFS_PATH, RDMAV_DRIVERS) comes
    // with `shmrdma run` for each worker.
    ok = true;
  }
  void teardown() {
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) sh(*it);
    undo.clear();
  }
  std::vector<std::string> run_argv(const std::string& ns, std::vector<std::string> args) const {
    std::vector<std::string> v = {"ip", "netns", "exec", ns, harness::getenv_str("SHMRDMA_BIN"), "--home", home, "run", "--"};
    v.insert(v.end(), args.begin(), args.end());
    return v;
  }
};

Net& net() {
  static Net n;
  return n;
}

class NetEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { net().setup(); }
  void TearDown() override { net().teardown(); }
};
const auto* const kNetEnv [[maybe_unused]] = ::testing::AddGlobalTestEnvironment(new NetEnvironment);

#define REQUIRE_NET()                                            \
  do {                                                           \
    if (!net().skip.empty()) GTEST_SKIP() << net().skip;         \
    ASSERT_TRUE(net().ok) << "network setup failed: " << net().fail; \
  } while (0)

// Runs a server in nsB (on roceB) and a client in nsA (on roceA) with a
// socketpair as fd 3 of both; both must exit 0 and print `ok_text`.
void run_pair(const std::vector<std::string>& server_args, const std::vector<std::string>& client_args,
              const std::string& server_ok, const std::string& client_ok, int budget_s = 120) {
  Net& n = net();
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ::setenv("DP_ROCE_HOME", n.home.c_str(), 1);
  ::setenv("DP_ROCE_IF", n.veth_b.c_str(), 1);
  harness::Child server, client;
  bool started = harness::start_on(server, n.dev_b, n.run_argv(n.ns_b, server_args), {.fd3 = sv[0]}) &&
                 harness::start_on(client, n.dev_a, n.run_argv(n.ns_a, client_args), {.fd3 = sv[1]});
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_TRUE(started) << server.output() << client.output();
  auto deadline = harness::Clock::now() + std::chrono::seconds(budget_s);
  while (!server.exited() && !client.exited() && harness::Clock::now() < deadline) {
    server.drain(0);
    client.drain(20);
  }
  harness::Result c = client.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(30)));
  harness::Result s = server.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(30)));
  std::printf("--- server ---\n%s--- client ---\n%s", s.out.c_str(), c.out.c_str());
  EXPECT_TRUE(s.ok()) << "server: " << s.describe();
  EXPECT_TRUE(c.ok()) << "client: " << c.describe();
  EXPECT_NE(s.out.find(server_ok), std::string::npos);
  EXPECT_NE(c.out.find(client_ok), std::string::npos);
}

TEST(Roce, ErrorsGrhSgidIndexUnknownGid) {
  REQUIRE_NET();
  harness::Child w;
  ASSERT_TRUE(harness::start_on(w, net().dev_a, net().run_argv(net().ns_a, {harness::self_exe(), "--worker", "errors"})));
  harness::Result r = w.wait(harness::Clock::now() + std::chrono::seconds(60));
  std::printf("%s", r.out.c_str());
  EXPECT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("ERRORS OK"), std::string::npos);
}

TEST(Roce, UdGrhMulticastRcAndRemovedGid) {
  REQUIRE_NET();
  run_pair({harness::self_exe(), "--worker", "server"}, {harness::self_exe(), "--worker", "client"}, "SERVER OK", "CLIENT OK");
}

// dp_integrity's workers over GIDs ($DP_GID_INDEX), one per namespace.
TEST(Roce, IntegrityOverGids) {
  REQUIRE_NET();
  const std::string exe = harness::getenv_str("DP_INTEGRITY_BIN");
  ASSERT_FALSE(exe.empty()) << "DP_INTEGRITY_BIN is not set (meson passes dp_integrity's path)";
  ::setenv("DP_GID_INDEX", "1", 1);
  run_pair({exe, "--worker", "server", "--seed", "20261201"},
           {exe, "--worker", "client", "--seed", "20261201", "--ops", "3000", "--budget-ms", "25000", "--min-ops",
            "300"},
           "SERVER OK", "CLIENT OK", 150);
  ::unsetenv("DP_GID_INDEX");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    ::signal(SIGPIPE, SIG_IGN);
    const std::string role = argv[2];
    g_role = role;
    if (role == "errors") return errors_worker();
    if (role == "server") return pair_server();
    if (role == "client") return pair_client();
    die("unknown role %s", role.c_str());
  }
  if (::geteuid() != 0) {
    std::printf("SKIP: not root: namespaces and `shmrdma up` need root\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
