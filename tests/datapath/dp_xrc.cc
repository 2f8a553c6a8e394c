// XRC (eXtended Reliable Connected) through the public verbs API.
//
// Local cases (one process): XRC domains (private, shared through a file,
// O_CREAT / O_EXCL / ENOENT), SRQ numbers, close_xrcd EBUSY while SRQs or
// QPs use the domain, ibv_open_qp, creation errors.
//
// Pair case: two processes through `shmrdma run` (the gtest starts this
// binary twice, `--worker target` and `--worker initiator`, with a
// socketpair as fd 3). Both open one XRC domain through the same file (the
// initiator first checks that it is not open yet: ENOENT without O_CREAT).
// The target has XRC_RECV QPs and XRC SRQs; the initiator's XRC_SEND QPs
// send into the target's SRQ (byte for byte, SEND / SEND_WITH_IMM /
// RDMA_WRITE_WITH_IMM), into its own SRQ through the target's XRC_RECV QP
// (the SRQ in another process than the QP), do RDMA WRITE and READ, and fail
// with IBV_WC_REM_INV_REQ_ERR when the SRQ number names no SRQ or an SRQ of
// another domain.
#include <arpa/inet.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "worker.h"

namespace {

using harness::die;
using harness::wc_str;

// ------------------------------------------------------------ helpers

constexpr int kSock = 3;

void send_line(const std::string& s) {
  std::string l = s + "\n";
  size_t off = 0;
  while (off < l.size()) {
    ssize_t n = ::write(kSock, l.data() + off, l.size() - off);
    REQUIRE(n > 0, "write to the peer: %s", std::strerror(errno));
    off += static_cast<size_t>(n);
  }
}

std::string recv_line(int timeout_ms = 30000) {
  static std::string buf;
  auto deadline = harness::Clock::now() + harness::Ms(timeout_ms);
  for (;;) {
    auto nl = buf.find('\n');
    if (nl != std::string::npos) {
      std::string l = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      return l;
    }
    pollfd p{kSock, POLLIN, 0};
    int left = harness::ms_left(deadline);
    REQUIRE(left > 0, "timed out waiting for the peer");
    if (::poll(&p, 1, left) <= 0) continue;
    char b[512];
    ssize_t n = ::read(kSock, b, sizeof b);
    REQUIRE(n > 0, "the peer closed the connection");
    buf.append(b, static_cast<size_t>(n));
  }
}

std::vector<uint64_t> fields(const std::string& l, const char* tag) {
  REQUIRE(l.rfind(tag, 0) == 0, "expected '%s ...', got '%s'", tag, l.c_str());
  std::vector<uint64_t> v;
  const char* p = l.c_str() + std::strlen(tag);
  char* end = nullptr;
  for (;;) {
    uint64_t x = std::strtoull(p, &end, 0);
    if (end == p) break;
    v.push_back(x);
    p = end;
  }
  return v;
}

ibv_xrcd* open_domain(ibv_context* ctx, int fd, int oflags) {
  ibv_xrcd_init_attr a{};
  a.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
  a.fd = fd;
  a.oflags = oflags;
  return ibv_open_xrcd(ctx, &a);
}

ibv_srq* create_xrc_srq(ibv_context* ctx, ibv_pd* pd, ibv_xrcd* xrcd, ibv_cq* cq, uint32_t max_wr = 64) {
  ibv_srq_init_attr_ex a{};
  a.attr.max_wr = max_wr;
  a.attr.max_sge = 2;
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_PD;
  a.srq_type = IBV_SRQT_XRC;
  a.xrcd = xrcd;
  a.cq = cq;
  a.pd = pd;
  return ibv_create_srq_ex(ctx, &a);
}

ibv_qp* create_xrc_recv(ibv_context* ctx, ibv_xrcd* xrcd) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_XRC_RECV;
  a.comp_mask = IBV_QP_INIT_ATTR_XRCD;
  a.xrcd = xrcd;
  return ibv_create_qp_ex(ctx, &a);
}

ibv_qp* create_xrc_send(ibv_context* ctx, ibv_pd* pd, ibv_cq* cq) {
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_XRC_SEND;
  a.send_cq = cq;
  a.cap.max_send_wr = 64;
  a.cap.max_send_sge = 2;
  a.cap.max_inline_data = 64;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  a.pd = pd;
  return ibv_create_qp_ex(ctx, &a);
}

// XRC_RECV to RTS the way ibv_xsrq_pingpong moves it (RTS: TIMEOUT | SQ_PSN).
int tgt_connect(ibv_qp* qp, uint32_t dest, uint16_t lid) {
  if (int rc = harness::qp_to_rtr(qp, dest, lid)) return rc;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.sq_psn = 0;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN);
}

// XRC_SEND: INIT->RTR without responder attributes, RTS like RC.
int ini_connect(ibv_qp* qp, uint32_t dest, uint16_t lid) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest;
  a.ah_attr.dlid = lid;
  a.ah_attr.port_num = 1;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN))
    return rc;
  return harness::qp_to_rts(qp, 7, 14, 7);
}

uint8_t pattern(uint32_t msg, size_t i) { return static_cast<uint8_t>((msg * 131u + i * 7u + 3u) & 0xff); }

int post_xrc(ibv_qp* qp, ibv_wr_opcode op, uint64_t wr_id, uint32_t srqn, ibv_sge* sg, int nsge, uint64_t raddr = 0,
             uint32_t rkey = 0, uint32_t imm = 0) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = op;
  wr.sg_list = sg;
  wr.num_sge = nsge;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  wr.qp_type.xrc.remote_srqn = srqn;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

int post_srq(ibv_srq* srq, uint64_t wr_id, void* addr, uint32_t len, uint32_t lkey) {
  ibv_sge sg{reinterpret_cast<uintptr_t>(addr), len, lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sg;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_srq_recv(srq, &wr, &bad);
}

// The messages the initiator sends into the target's SRQ, in this order.
struct Msg {
  ibv_wr_opcode op;
  uint32_t len;
};
const Msg kMsgs[] = {{IBV_WR_SEND, 1},        {IBV_WR_SEND, 100},           {IBV_WR_SEND, 4096},
                     {IBV_WR_SEND, 65536},    {IBV_WR_SEND_WITH_IMM, 3000}, {IBV_WR_SEND, 0},
                     {IBV_WR_RDMA_WRITE_WITH_IMM, 5000}, {IBV_WR_SEND, 200000}};
constexpr uint32_t kNumMsgs = sizeof kMsgs / sizeof kMsgs[0];
constexpr size_t kSlot = 256 * 1024;                   // one receive buffer per message
constexpr size_t kWriteOff = kSlot * kNumMsgs;          // RDMA_WRITE_WITH_IMM's target
constexpr size_t kRdmaOff = kWriteOff + kSlot;          // plain RDMA WRITE / READ
constexpr size_t kTargetBuf = kRdmaOff + kSlot;

// ------------------------------------------------------------ workers

int run_target(const std::string& domain_file) {
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  REQUIRE(ctx, "%s", why.c_str());
  const uint16_t lid = harness::port_lid(ctx);
  REQUIRE(recv_line() == "absent-checked", "protocol");
  int fd = ::open(domain_file.c_str(), O_RDONLY | O_CREAT, 0600);
  REQUIRE(fd >= 0, "open %s: %s", domain_file.c_str(), std::strerror(errno));
  ibv_xrcd* xrcd = open_domain(ctx, fd, O_CREAT);
  REQUIRE(xrcd, "ibv_open_xrcd(O_CREAT): %s", std::strerror(errno));
  ibv_xrcd* priv = open_domain(ctx, -1, 0);
  REQUIRE(priv, "ibv_open_xrcd(fd -1): %s", std::strerror(errno));
  ibv_pd* pd = ibv_alloc_pd(ctx);
  REQUIRE(pd, "alloc_pd");
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, kTargetBuf));
  std::memset(buf, 0xee, kTargetBuf);
  ibv_mr* mr = ibv_reg_mr(pd, buf, kTargetBuf,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  REQUIRE(mr, "reg_mr: %s", std::strerror(errno));
  ibv_cq* cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  ibv_cq* pcq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  REQUIRE(cq && pcq, "create_cq");
  ibv_srq* srq = create_xrc_srq(ctx, pd, xrcd, cq);
  REQUIRE(srq, "create XRC SRQ: %s", std::strerror(errno));
  ibv_srq* psrq = create_xrc_srq(ctx, pd, priv, pcq);  // another domain
  REQUIRE(psrq, "create XRC SRQ (private domain): %s", std::strerror(errno));
  uint32_t srqn = 0, psrqn = 0;
  REQUIRE(ibv_get_srq_num(srq, &srqn) == 0 && ibv_get_srq_num(psrq, &psrqn) == 0 && srqn != psrqn, "get_srq_num");
  ibv_qp* tgt[3];
  for (auto& q : tgt) {
    q = create_xrc_recv(ctx, xrcd);
    REQUIRE(q, "create XRC_RECV: %s", std::strerror(errno));
    REQUIRE(harness::qp_to_init(q, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) == 0, "XRC_RECV to INIT");
  }
  for (uint32_t k = 0; k < kNumMsgs; ++k)
    REQUIRE(post_srq(srq, 1000 + k, buf + k * kSlot, kSlot, mr->lkey) == 0, "post_srq_recv");
  char line[512];
  std::snprintf(line, sizeof line, "T %u %u %u %u %u %u %" PRIu64 " %u", tgt[0]->qp_num, tgt[1]->qp_num,
                tgt[2]->qp_num, srqn, psrqn, mr->rkey, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(buf)), lid);
  send_line(line);
  auto ini = fields(recv_line(), "I");
  REQUIRE(ini.size() == 3, "protocol");
  for (int i = 0; i < 3; ++i)
    REQUIRE(tgt_connect(tgt[i], static_cast<uint32_t>(ini[i]), lid) == 0, "XRC_RECV to RTR/RTS: %s", std::strerror(errno));
  send_line("go");

  // Every message in order, byte for byte, completed in the SRQ's CQ with
  // the XRC_RECV QP's number.
  for (uint32_t k = 0; k < kNumMsgs; ++k) {
    ibv_wc wc{};
    REQUIRE(harness::poll_one(cq, &wc, 20000), "no receive completion for message %u", k);
    REQUIRE(wc.status == IBV_WC_SUCCESS, "message %u: %s", k, wc_str(wc).c_str());
    REQUIRE(wc.wr_id == 1000 + k, "message %u: wr_id %" PRIu64, k, wc.wr_id);
    REQUIRE(wc.qp_num == tgt[0]->qp_num, "message %u: qp_num %u, expected the XRC_RECV QP %u", k, wc.qp_num,
          tgt[0]->qp_num);
    REQUIRE(wc.src_qp == ini[0], "message %u: src_qp %u", k, wc.src_qp);
    const Msg& m = kMsgs[k];
    if (m.op == IBV_WR_RDMA_WRITE_WITH_IMM) {
      REQUIRE(wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == k,
            "message %u: %s", k, wc_str(wc).c_str());
      for (size_t i = 0; i < m.len; ++i)
        REQUIRE(buf[kWriteOff + i] == pattern(k, i), "WRITE_WITH_IMM byte %zu differs", i);
      continue;
    }
    REQUIRE(wc.opcode == IBV_WC_RECV && wc.byte_len == m.len, "message %u: %s", k, wc_str(wc).c_str());
    if (m.op == IBV_WR_SEND_WITH_IMM)
      REQUIRE((wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == k, "message %u: imm %s", k, wc_str(wc).c_str());
    for (size_t i = 0; i < m.len; ++i)
      REQUIRE(buf[k * kSlot + i] == pattern(k, i), "message %u byte %zu: %u, expected %u", k, i, buf[k * kSlot + i],
            pattern(k, i));
    REQUIRE(m.len == kSlot || buf[k * kSlot + m.len] == 0xee, "message %u wrote past its length", k);
  }
  send_line("received");
  REQUIRE(recv_line() == "done", "protocol");
  for (size_t i = 0; i < 4096; ++i) REQUIRE(buf[kRdmaOff + i] == pattern(77, i), "RDMA WRITE byte %zu differs", i);
  ibv_wc wc{};
  REQUIRE(ibv_poll_cq(pcq, 1, &wc) == 0, "the other domain's SRQ got a completion: %s", wc_str(wc).c_str());
  REQUIRE(ibv_poll_cq(cq, 1, &wc) == 0, "unexpected completion %s", wc_str(wc).c_str());

  // Teardown: the domains are busy while SRQs / QPs use them.
  REQUIRE(ibv_close_xrcd(xrcd) == EBUSY, "close_xrcd with SRQ and QPs: not EBUSY");
  REQUIRE(ibv_close_xrcd(priv) == EBUSY, "close_xrcd (private) with an SRQ: not EBUSY");
  for (auto& q : tgt) REQUIRE(ibv_destroy_qp(q) == 0, "destroy XRC_RECV");
  REQUIRE(ibv_close_xrcd(xrcd) == EBUSY, "close_xrcd with an SRQ: not EBUSY");
  REQUIRE(ibv_destroy_cq(cq) == EBUSY, "destroy_cq of an XRC SRQ's CQ: not EBUSY");
  REQUIRE(ibv_destroy_srq(srq) == 0 && ibv_destroy_srq(psrq) == 0, "destroy_srq");
  REQUIRE(ibv_close_xrcd(xrcd) == 0 && ibv_close_xrcd(priv) == 0, "close_xrcd");
  REQUIRE(ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(pcq) == 0, "destroy_cq");
  REQUIRE(ibv_dereg_mr(mr) == 0 && ibv_dealloc_pd(pd) == 0, "dereg/dealloc");
  ::close(fd);
  REQUIRE(ibv_close_device(ctx) == 0, "close_device");
  std::free(buf);
  std::printf("TARGET OK\n");
  return 0;
}

int run_initiator(const std::string& domain_file) {
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  REQUIRE(ctx, "%s", why.c_str());
  // Nobody has the domain open yet: without O_CREAT it does not exist.
  int fd = ::open(domain_file.c_str(), O_RDONLY | O_CREAT, 0600);
  REQUIRE(fd >= 0, "open %s: %s", domain_file.c_str(), std::strerror(errno));
  errno = 0;
  REQUIRE(!open_domain(ctx, fd, 0) && errno == ENOENT, "open_xrcd without O_CREAT of a domain nobody has open: errno %d",
        errno);
  send_line("absent-checked");
  auto t = fields(recv_line(), "T");
  REQUIRE(t.size() == 8, "protocol");
  const uint32_t srqn = static_cast<uint32_t>(t[3]), psrqn = static_cast<uint32_t>(t[4]);
  const uint32_t rkey = static_cast<uint32_t>(t[5]);
  const uint64_t raddr = t[6];
  const uint16_t lid = static_cast<uint16_t>(t[7]);
  // The target has it open now: it is shared through the file.
  ibv_xrcd* xrcd = open_domain(ctx, fd, 0);
  REQUIRE(xrcd, "open_xrcd of the target's domain without O_CREAT: %s", std::strerror(errno));
  errno = 0;
  REQUIRE(!open_domain(ctx, fd, O_CREAT | O_EXCL) && errno == EINVAL, "O_EXCL on an open domain: errno %d", errno);
  ibv_pd* pd = ibv_alloc_pd(ctx);
  constexpr size_t kLocal = 2 * kSlot;
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, kLocal));
  auto* rbuf = static_cast<uint8_t*>(std::aligned_alloc(4096, kLocal));
  std::memset(rbuf, 0xee, kLocal);
  ibv_mr* mr = ibv_reg_mr(pd, buf, kLocal, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* rmr = ibv_reg_mr(pd, rbuf, kLocal, IBV_ACCESS_LOCAL_WRITE);
  REQUIRE(pd && mr && rmr, "pd/mr");
  ibv_cq* scq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  ibv_cq* rcq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
  REQUIRE(scq && rcq, "create_cq");
  ibv_srq* my_srq = create_xrc_srq(ctx, pd, xrcd, rcq);
  REQUIRE(my_srq, "create XRC SRQ: %s", std::strerror(errno));
  uint32_t my_srqn = 0;
  REQUIRE(ibv_get_srq_num(my_srq, &my_srqn) == 0 && my_srqn != srqn, "get_srq_num");
  ibv_qp* ini[3];
  for (auto& q : ini) {
    q = create_xrc_send(ctx, pd, scq);
    REQUIRE(q, "create XRC_SEND: %s", std::strerror(errno));
    REQUIRE(harness::qp_to_init(q, 0) == 0, "XRC_SEND to INIT");
  }
  char line[256];
  std::snprintf(line, sizeof line, "I %u %u %u", ini[0]->qp_num, ini[1]->qp_num, ini[2]->qp_num);
  send_line(line);
  REQUIRE(recv_line() == "go", "protocol");
  for (int i = 0; i < 3; ++i)
    REQUIRE(ini_connect(ini[i], static_cast<uint32_t>(t[i]), lid) == 0, "XRC_SEND to RTR/RTS: %s", std::strerror(errno));

  auto expect_send = [&](uint64_t wr_id, ibv_wc_status st) {
    ibv_wc wc{};
    REQUIRE(harness::poll_one(scq, &wc, 20000), "no send completion for wr %" PRIu64, wr_id);
    REQUIRE(wc.wr_id == wr_id && wc.status == st, "send wr %" PRIu64 ": %s, expected status %s", wr_id,
          wc_str(wc).c_str(), ibv_wc_status_str(st));
    REQUIRE(wc.qp_num == ini[0]->qp_num || st != IBV_WC_SUCCESS, "send completion qp_num %u", wc.qp_num);
  };

  // 1. Into the target's SRQ through its XRC_RECV QP, in order.
  for (uint32_t k = 0; k < kNumMsgs; ++k) {
    const Msg& m = kMsgs[k];
    uint8_t* src = m.len <= kLocal ? buf : nullptr;
    REQUIRE(src, "message too big");
    for (size_t i = 0; i < m.len; ++i) src[i] = pattern(k, i);
    ibv_sge sg{reinterpret_cast<uintptr_t>(src), m.len, mr->lkey};
    uint64_t ra = m.op == IBV_WR_RDMA_WRITE_WITH_IMM ? raddr + kWriteOff : 0;
    REQUIRE(post_xrc(ini[0], m.op, k, srqn, &sg, m.len ? 1 : 0, ra, rkey, k) == 0, "post_send %u", k);
    expect_send(k, IBV_WC_SUCCESS);
  }
  REQUIRE(recv_line() == "received", "protocol");

  // 2. Into our own SRQ through the target's XRC_RECV QP: the QP is in the
  // target process, the SRQ (and its CQ) here.
  for (uint32_t k = 0; k < 2; ++k)
    REQUIRE(post_srq(my_srq, 500 + k, rbuf + k * kSlot, kSlot, rmr->lkey) == 0, "post_srq_recv");
  for (uint32_t k = 0; k < 2; ++k) {
    const uint32_t len = k ? 70000 : 33;
    for (size_t i = 0; i < len; ++i) buf[i] = pattern(40 + k, i);
    ibv_sge sg{reinterpret_cast<uintptr_t>(buf), len, mr->lkey};
    REQUIRE(post_xrc(ini[0], IBV_WR_SEND, 100 + k, my_srqn, &sg, 1) == 0, "post_send into our SRQ");
    expect_send(100 + k, IBV_WC_SUCCESS);
    ibv_wc wc{};
    REQUIRE(harness::poll_one(rcq, &wc, 20000), "no completion in our SRQ's CQ");
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 500 + k && wc.byte_len == len && wc.qp_num == t[0] &&
              wc.opcode == IBV_WC_RECV && wc.src_qp == ini[0]->qp_num,
          "receive into our SRQ: %s (expected qp_num %u)", wc_str(wc).c_str(), static_cast<uint32_t>(t[0]));
    for (size_t i = 0; i < len; ++i) REQUIRE(rbuf[k * kSlot + i] == pattern(40 + k, i), "byte %zu differs", i);
  }

  // 3. RDMA WRITE and READ through the XRC_RECV QP (the SRQ's PD checks the rkey).
  for (size_t i = 0; i < 4096; ++i) buf[i] = pattern(77, i);
  ibv_sge wsg{reinterpret_cast<uintptr_t>(buf), 4096, mr->lkey};
  REQUIRE(post_xrc(ini[0], IBV_WR_RDMA_WRITE, 200, srqn, &wsg, 1, raddr + kRdmaOff, rkey) == 0, "post WRITE");
  expect_send(200, IBV_WC_SUCCESS);
  ibv_sge rsg{reinterpret_cast<uintptr_t>(rbuf), 4096, rmr->lkey};
  REQUIRE(post_xrc(ini[0], IBV_WR_RDMA_READ, 201, srqn, &rsg, 1, raddr + kRdmaOff, rkey) == 0, "post READ");
  expect_send(201, IBV_WC_SUCCESS);
  REQUIRE(std::memcmp(rbuf, buf, 4096) == 0, "RDMA READ returned other bytes");
  // A bad rkey is a remote access error, as on RC.
  REQUIRE(post_xrc(ini[0], IBV_WR_RDMA_WRITE, 202, srqn, &wsg, 1, raddr + kRdmaOff, rkey + 1) == 0, "post WRITE");
  expect_send(202, IBV_WC_REM_ACCESS_ERR);
  REQUIRE(harness::qp_state(ini[0]) == IBV_QPS_ERR, "XRC_SEND after a remote access error: %s",
        harness::qp_state_name(harness::qp_state(ini[0])));

  // 4. An SRQ number that names no SRQ, and one of another domain.
  const uint32_t bogus = (srqn & 0xff0000) | (4000u << 4) | 5u;
  ibv_sge one{reinterpret_cast<uintptr_t>(buf), 8, mr->lkey};
  REQUIRE(post_xrc(ini[1], IBV_WR_SEND, 300, bogus, &one, 1) == 0, "post_send");
  expect_send(300, IBV_WC_REM_INV_REQ_ERR);
  REQUIRE(harness::qp_state(ini[1]) == IBV_QPS_ERR, "XRC_SEND after REM_INV_REQ_ERR is not in ERR");
  REQUIRE(post_xrc(ini[2], IBV_WR_SEND, 301, psrqn, &one, 1) == 0, "post_send");
  expect_send(301, IBV_WC_REM_INV_REQ_ERR);
  send_line("done");

  // Teardown: EBUSY while our SRQ uses the domain.
  for (auto& q : ini) REQUIRE(ibv_destroy_qp(q) == 0, "destroy XRC_SEND");
  REQUIRE(ibv_close_xrcd(xrcd) == EBUSY, "close_xrcd with an SRQ: not EBUSY");
  REQUIRE(ibv_destroy_srq(my_srq) == 0, "destroy_srq");
  REQUIRE(ibv_close_xrcd(xrcd) == 0, "close_xrcd");
  REQUIRE(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0, "destroy_cq");
  REQUIRE(ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(rmr) == 0 && ibv_dealloc_pd(pd) == 0, "dereg/dealloc");
  ::close(fd);
  REQUIRE(ibv_close_device(ctx) == 0, "close_device");
  std::free(buf);
  std::free(rbuf);
  std::printf("INITIATOR OK\n");
  return 0;
}

// ------------------------------------------------------------ gtest

class XrcLocal : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    std::string why;
    ctx_ = harness::open_shm0(&why);
    ASSERT_NE(ctx_, nullptr) << why;
    pd_ = ibv_alloc_pd(ctx_);
    cq_ = ibv_create_cq(ctx_, 16, nullptr, nullptr, 0);
    ASSERT_TRUE(pd_ && cq_);
    file_ = harness::Home::get().path() + "/domain-" + ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fd_ = ::open(file_.c_str(), O_RDONLY | O_CREAT, 0600);
    ASSERT_GE(fd_, 0);
  }
  void TearDown() override {
    if (cq_) {
      EXPECT_EQ(ibv_destroy_cq(cq_), 0);
    }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0);
    }
    if (ctx_) {
      EXPECT_EQ(ibv_close_device(ctx_), 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  std::string file_;
  int fd_ = -1;
};

TEST_F(XrcLocal, DomainFlags) {
  errno = 0;
  EXPECT_EQ(open_domain(ctx_, fd_, 0), nullptr);
  EXPECT_EQ(errno, ENOENT) << "without O_CREAT, a domain nobody has open";
  ibv_xrcd* a = open_domain(ctx_, fd_, O_CREAT | O_EXCL);
  ASSERT_NE(a, nullptr) << std::strerror(errno);
  errno = 0;
  EXPECT_EQ(open_domain(ctx_, fd_, O_CREAT | O_EXCL), nullptr);
  EXPECT_EQ(errno, EINVAL) << "O_EXCL on an open domain";
  // The same file through another descriptor is the same domain.
  int fd2 = ::open(file_.c_str(), O_RDONLY);
  ASSERT_GE(fd2, 0);
  ibv_xrcd* b = open_domain(ctx_, fd2, 0);
  ASSERT_NE(b, nullptr) << std::strerror(errno);
  ::close(fd2);  // the domain does not need the descriptor
  ibv_xrcd* p = open_domain(ctx_, -1, 0);
  ASSERT_NE(p, nullptr) << "private domain: " << std::strerror(errno);
  // No descriptor / flags: EINVAL, like the kernel command.
  ibv_xrcd_init_attr bad{};
  bad.comp_mask = IBV_XRCD_INIT_ATTR_FD;
  bad.fd = fd_;
  errno = 0;
  EXPECT_EQ(ibv_open_xrcd(ctx_, &bad), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_close_xrcd(a), 0);
  EXPECT_EQ(ibv_close_xrcd(b), 0);
  EXPECT_EQ(ibv_close_xrcd(p), 0);
  // Closed everywhere: gone again.
  errno = 0;
  EXPECT_EQ(open_domain(ctx_, fd_, 0), nullptr);
  EXPECT_EQ(errno, ENOENT);
}

TEST_F(XrcLocal, SrqNumbersAndBusyDomain) {
  ibv_xrcd* x = open_domain(ctx_, fd_, O_CREAT);
  ASSERT_NE(x, nullptr);
  ibv_srq* s1 = create_xrc_srq(ctx_, pd_, x, cq_);
  ibv_srq* s2 = create_xrc_srq(ctx_, pd_, x, cq_);
  ASSERT_TRUE(s1 && s2) << std::strerror(errno);
  uint32_t n1 = 0, n2 = 0;
  ASSERT_EQ(ibv_get_srq_num(s1, &n1), 0);
  ASSERT_EQ(ibv_get_srq_num(s2, &n2), 0);
  EXPECT_NE(n1, n2);
  EXPECT_EQ(n1 & ~0xffffffu, 0u) << "SRQ numbers are 24 bits";
  EXPECT_EQ(ibv_close_xrcd(x), EBUSY);
  EXPECT_EQ(ibv_destroy_cq(cq_), EBUSY) << "an XRC SRQ's CQ is in use";
  EXPECT_EQ(ibv_destroy_srq(s1), 0);
  EXPECT_EQ(ibv_close_xrcd(x), EBUSY);
  EXPECT_EQ(ibv_destroy_srq(s2), 0);
  ibv_qp* q = create_xrc_recv(ctx_, x);
  ASSERT_NE(q, nullptr) << std::strerror(errno);
  EXPECT_EQ(q->qp_type, IBV_QPT_XRC_RECV);
  EXPECT_EQ(ibv_close_xrcd(x), EBUSY) << "an XRC_RECV QP uses the domain";
  EXPECT_EQ(ibv_destroy_qp(q), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
}

TEST_F(XrcLocal, CreationErrors) {
  ibv_xrcd* x = open_domain(ctx_, fd_, O_CREAT);
  ASSERT_NE(x, nullptr);
  ibv_srq_init_attr_ex a{};
  a.attr.max_wr = 8;
  a.attr.max_sge = 1;
  a.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_PD;  // no CQ
  a.srq_type = IBV_SRQT_XRC;
  a.xrcd = x;
  a.pd = pd_;
  errno = 0;
  EXPECT_EQ(ibv_create_srq_ex(ctx_, &a), nullptr);
  EXPECT_EQ(errno, EINVAL);
  ibv_qp_init_attr_ex qa{};
  qa.qp_type = IBV_QPT_XRC_RECV;
  qa.comp_mask = IBV_QP_INIT_ATTR_PD;  // no domain
  qa.pd = pd_;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &qa), nullptr);
  EXPECT_NE(errno, 0);
  // XRC_SEND has no receive side: an SRQ is refused.
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = 4;
  sa.attr.max_sge = 1;
  ibv_srq* basic = ibv_create_srq(pd_, &sa);
  ASSERT_NE(basic, nullptr);
  ibv_qp_init_attr_ex xs{};
  xs.qp_type = IBV_QPT_XRC_SEND;
  xs.send_cq = cq_;
  xs.srq = basic;
  xs.cap.max_send_wr = 4;
  xs.cap.max_send_sge = 1;
  xs.comp_mask = IBV_QP_INIT_ATTR_PD;
  xs.pd = pd_;
  errno = 0;
  EXPECT_EQ(ibv_create_qp_ex(ctx_, &xs), nullptr);
  EXPECT_EQ(errno, EINVAL);
  EXPECT_EQ(ibv_destroy_srq(basic), 0);
  // An XRC_RECV QP takes no posts.
  ibv_qp* r = create_xrc_recv(ctx_, x);
  ASSERT_NE(r, nullptr);
  ibv_recv_wr rw{};
  ibv_recv_wr* bad = nullptr;
  EXPECT_NE(ibv_post_recv(r, &rw, &bad), 0);
  EXPECT_EQ(ibv_destroy_qp(r), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
}

TEST_F(XrcLocal, OpenQp) {
  ibv_xrcd* x = open_domain(ctx_, fd_, O_CREAT);
  ibv_xrcd* y = open_domain(ctx_, fd_, 0);  // the same domain through a second handle
  ibv_xrcd* p = open_domain(ctx_, -1, 0);   // another domain
  ASSERT_TRUE(x && y && p);
  ibv_qp* q = create_xrc_recv(ctx_, x);
  ASSERT_NE(q, nullptr);
  ASSERT_EQ(harness::qp_to_init(q, 0), 0);
  ibv_qp_open_attr oa{};
  oa.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
  oa.qp_num = q->qp_num;
  oa.qp_type = IBV_QPT_XRC_RECV;
  oa.xrcd = p;
  errno = 0;
  EXPECT_EQ(ibv_open_qp(ctx_, &oa), nullptr) << "opened through another domain";
  EXPECT_EQ(errno, EINVAL);
  oa.xrcd = y;
  oa.qp_num = q->qp_num ^ 0x10;
  EXPECT_EQ(ibv_open_qp(ctx_, &oa), nullptr) << "no such QP";
  oa.qp_num = q->qp_num;
  ibv_qp* o = ibv_open_qp(ctx_, &oa);
  ASSERT_NE(o, nullptr) << std::strerror(errno);
  EXPECT_EQ(o->qp_num, q->qp_num);
  EXPECT_EQ(ibv_close_xrcd(y), EBUSY) << "the opened handle uses it";
  // The QP outlives its creator's handle.
  EXPECT_EQ(ibv_destroy_qp(q), 0);
  EXPECT_EQ(ibv_close_xrcd(x), 0);
  EXPECT_EQ(harness::qp_state(o), IBV_QPS_INIT);
  EXPECT_EQ(ibv_destroy_qp(o), 0);
  EXPECT_EQ(ibv_close_xrcd(y), 0);
  EXPECT_EQ(ibv_close_xrcd(p), 0);
}

TEST(XrcPair, TwoProcessesShareADomain) {
  HARNESS_REQUIRE_DEVICE();
  auto& home = harness::Home::get();
  const std::string file = home.path() + "/xrc-domain-pair";
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string exe = harness::self_exe();
  harness::Child target, initiator;
  bool started = target.start(home.run_argv({exe, "--worker", "target", file}), {.fd3 = sv[0]}) &&
                 initiator.start(home.run_argv({exe, "--worker", "initiator", file}), {.fd3 = sv[1]});
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_TRUE(started) << target.output() << initiator.output();
  auto deadline = harness::Clock::now() + std::chrono::seconds(90);
  while (!target.exited() && !initiator.exited() && harness::Clock::now() < deadline) {
    target.drain(0);
    initiator.drain(20);
  }
  harness::Result i = initiator.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(20)));
  harness::Result t = target.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(20)));
  std::printf("--- initiator ---\n%s--- target ---\n%s", i.out.c_str(), t.out.c_str());
  EXPECT_TRUE(i.ok()) << i.describe();
  EXPECT_TRUE(t.ok()) << t.describe();
  EXPECT_NE(i.out.find("INITIATOR OK"), std::string::npos);
  EXPECT_NE(t.out.find("TARGET OK"), std::string::npos);
  nlohmann::json st = home.status();
  for (const auto& d : st["devices"]) EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
}

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 3 && std::string(argv[1]) == "--worker") {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::string role = argv[2];
    if (role == "target") return run_target(argv[3]);
    if (role == "initiator") return run_initiator(argv[3]);
    die("unknown role %s", role.c_str());
  }
  return harness::run_tests_as_root(argc, argv);
}
