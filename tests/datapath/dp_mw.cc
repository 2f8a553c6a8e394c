// Memory windows (ibv_alloc_mw, ibv_bind_mw, IBV_WR_BIND_MW, IBV_WR_LOCAL_INV,
// IBV_WR_SEND_WITH_INV and their ibv_qp_ex builders) between two processes.
//
// As a gtest (no arguments) it starts two workers of this executable through
// `shmrdma run`, connected by a socketpair on fd 3:
//
//   dp_mw --worker owner|peer
//
// The owner has the memory, the MRs and the windows and drives the test; the
// peer executes commands on its RC QP connected to the owner's and answers
// with the completion status (and a hash of what a READ returned):
//   write RKEY ADDR LEN BYTE | read RKEY ADDR LEN | sendinv RKEY | quit
// After an error completion the peer moves its QP through RESET to RTS again.
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;
using harness::Hello;
using harness::poll_status;
using harness::fnv;

constexpr size_t kLen = 64 << 10;
constexpr int kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                          IBV_ACCESS_REMOTE_ATOMIC;

bool connect_qp(ibv_qp* qp, const Hello& peer) {
  return harness::connect_qp(qp, peer.qpn, peer.lid, kQpAccess) == 0;
}

bool reconnect(ibv_qp* qp, const Hello& peer) { return harness::qp_to_reset(qp) == 0 && connect_qp(qp, peer); }

// ------------------------------------------------------------------ peer

int run_peer() {
  std::string why;
  ibv_context* ctx = harness::open_shm0(&why);
  if (!ctx) die("%s", why.c_str());
  ibv_pd* pd = ibv_alloc_pd(ctx);
  ibv_cq* cq = pd ? ibv_create_cq(ctx, 64, nullptr, nullptr, 0) : nullptr;
  if (!cq) die("pd/cq");
  ibv_qp* qp = harness::create_qp(pd, cq, IBV_QPT_RC, 8, 8);
  if (!qp) die("ibv_create_qp");
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, kLen));
  ibv_mr* mr = ibv_reg_mr(pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) die("ibv_reg_mr");
  Hello owner = harness::exchange_hello(ctx, qp);
  if (!connect_qp(qp, owner)) die("connect");
  harness::LineReader ctl(harness::kCtlFd);
  std::string line;
  for (;;) {
    if (ctl.poll_line(&line, 60000) != 1) die("no command");
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "quit") break;
    uint32_t rkey = 0;
    uint64_t addr = 0, len = 0;
    unsigned byte = 0;
    ibv_send_wr wr{};
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf), 0, mr->lkey};
    wr.wr_id = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (cmd == "write" || cmd == "read") {
      in >> rkey >> addr >> len >> byte;
      if (len > kLen) die("bad command %s", line.c_str());
      std::memset(buf, cmd == "write" ? static_cast<int>(byte) : 0, len);
      sge.length = static_cast<uint32_t>(len);
      wr.opcode = cmd == "write" ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
      wr.wr.rdma.remote_addr = addr;
      wr.wr.rdma.rkey = rkey;
    } else if (cmd == "sendinv") {
      in >> rkey;
      std::memset(buf, 0x42, 16);
      sge.length = 16;
      wr.opcode = IBV_WR_SEND_WITH_INV;
      wr.invalidate_rkey = rkey;
    } else {
      die("unknown command %s", line.c_str());
    }
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qp, &wr, &bad);
    int st = rc ? 1000 + rc : poll_status(cq);
    char reply[128];
    std::snprintf(reply, sizeof reply, "%d %" PRIu64, st, cmd == "read" ? fnv(buf, len) : 0);
    if (st != IBV_WC_SUCCESS && !reconnect(qp, owner)) die("reconnect after %s", line.c_str());
    if (!ctl.send_line(reply)) die("reply");
  }
  if (ibv_destroy_qp(qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
    die("teardown");
  std::free(buf);
  std::printf("PEER done\n");
  return 0;
}

// ----------------------------------------------------------------- owner

struct Owner {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_pd* pd2 = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;   // connected to the peer; created with the ibv_qp_ex API
  ibv_qp_ex* qpx = nullptr;
  ibv_qp* eqp = nullptr;  // in pd2, for bind errors (local operations: it enters ERR and is reset)
  ibv_cq* ecq = nullptr;
  uint8_t* buf = nullptr;
  ibv_mr* mr = nullptr;       // LOCAL_WRITE | MW_BIND: no remote access of its own
  ibv_mr* mr_nobind = nullptr;
  ibv_mr* mr_nolw = nullptr;  // REMOTE_READ | MW_BIND, no LOCAL_WRITE
  Hello peer;
  harness::LineReader ctl{harness::kCtlFd};

  // Runs a peer command: the completion status (and the READ's hash).
  int cmd(const std::string& c, uint64_t* hash = nullptr) {
    if (!ctl.send_line(c)) die("send %s", c.c_str());
    std::string r;
    if (ctl.poll_line(&r, 30000) != 1) die("no reply to %s", c.c_str());
    int st = -1;
    uint64_t h = 0;
    std::istringstream(r) >> st >> h;
    if (hash) *hash = h;
    return st;
  }
  // The peer's RDMA WRITE / READ at remote address `addr` (a zero-based
  // window or MR: an offset), or at the address of `p`.
  int write_at(uint32_t rkey, uint64_t addr, size_t len, uint8_t byte) {
    return cmd("write " + std::to_string(rkey) + " " + std::to_string(addr) + " " + std::to_string(len) + " " +
               std::to_string(byte));
  }
  int read_at(uint32_t rkey, uint64_t addr, size_t len, uint64_t* hash = nullptr) {
    return cmd("read " + std::to_string(rkey) + " " + std::to_string(addr) + " " + std::to_string(len) + " 0", hash);
  }
  int write(uint32_t rkey, const uint8_t* p, size_t len, uint8_t byte) {
    return write_at(rkey, reinterpret_cast<uintptr_t>(p), len, byte);
  }
  int read(uint32_t rkey, const uint8_t* p, size_t len, uint64_t* hash = nullptr) {
    return read_at(rkey, reinterpret_cast<uintptr_t>(p), len, hash);
  }
  void fill() {
    for (size_t i = 0; i < kLen; ++i) buf[i] = static_cast<uint8_t>(i * 7 + 3);
  }

  int bind1(ibv_qp* q, ibv_cq* c, ibv_mw* mw, ibv_mr* m, uint8_t* addr, size_t len, unsigned access) {
    return harness::bind_mw_type1(q, c, mw, m, addr, len, access);
  }
  int bind2(ibv_qp* q, ibv_cq* c, ibv_mw* mw, uint32_t rkey, uint8_t* addr, size_t len, unsigned access) {
    return harness::bind_mw_type2(q, c, mw, mr, rkey, addr, len, access);
  }
  int local_inv(ibv_qp* q, ibv_cq* c, uint32_t rkey) {
    ibv_send_wr wr{};
    wr.wr_id = 13;
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = rkey;
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(q, &wr, &bad)) return 1000 + rc;
    ibv_wc wc{};
    int st = poll_status(c, &wc);
    if (st == IBV_WC_SUCCESS && wc.opcode != IBV_WC_LOCAL_INV) return 2000;
    return st;
  }
  void reset_eqp() {
    if (!reconnect(eqp, peer)) die("reset eqp");
  }
};

int run_owner() {
  Owner o;
  std::string why;
  o.ctx = harness::open_shm0(&why);
  if (!o.ctx) die("%s", why.c_str());
  ibv_device_attr da{};
  if (ibv_query_device(o.ctx, &da)) die("query_device");
  CHECK(da.max_mw > 0, "max_mw %d", da.max_mw);
  CHECK((da.device_cap_flags & IBV_DEVICE_MEM_WINDOW) && (da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B),
        "device_cap_flags 0x%x", da.device_cap_flags);
  o.pd = ibv_alloc_pd(o.ctx);
  o.pd2 = ibv_alloc_pd(o.ctx);
  o.cq = ibv_create_cq(o.ctx, 64, nullptr, nullptr, 0);
  o.ecq = ibv_create_cq(o.ctx, 64, nullptr, nullptr, 0);
  if (!o.pd || !o.pd2 || !o.cq || !o.ecq) die("pd/cq");

  // Allocation: both types, bad type, the PD is busy while windows exist.
  {
    ibv_pd* p = ibv_alloc_pd(o.ctx);
    ibv_mw* a = ibv_alloc_mw(p, IBV_MW_TYPE_1);
    ibv_mw* b = ibv_alloc_mw(p, IBV_MW_TYPE_2);
    CHECK(a && b, "ibv_alloc_mw: %s", std::strerror(errno));
    if (a && b) {
      CHECK(a->type == IBV_MW_TYPE_1 && b->type == IBV_MW_TYPE_2 && a->pd == p && a->rkey != b->rkey, "mw fields");
      errno = 0;
      CHECK(ibv_alloc_mw(p, static_cast<ibv_mw_type>(3)) == nullptr && errno == EINVAL, "type 3: errno %d", errno);
      CHECK(ibv_dealloc_pd(p) == EBUSY, "dealloc_pd with windows");
      CHECK(ibv_dealloc_mw(a) == 0, "dealloc_mw");
      CHECK(ibv_dealloc_pd(p) == EBUSY, "dealloc_pd with one window");
      CHECK(ibv_dealloc_mw(b) == 0, "dealloc_mw");
    }
    CHECK(ibv_dealloc_pd(p) == 0, "dealloc_pd after the windows");
  }

  ibv_qp_init_attr_ex ia{};
  ia.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  ia.pd = o.pd;
  ia.send_cq = o.cq;
  ia.recv_cq = o.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 16;
  ia.cap.max_recv_wr = 16;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ia.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV |
                      IBV_QP_EX_WITH_SEND_WITH_INV;
  o.qp = ibv_create_qp_ex(o.ctx, &ia);
  if (!o.qp) die("ibv_create_qp_ex with MW send ops: %s", std::strerror(errno));
  o.qpx = ibv_qp_to_qp_ex(o.qp);
  ibv_qp_init_attr ea{};
  ea.send_cq = o.ecq;
  ea.recv_cq = o.ecq;
  ea.qp_type = IBV_QPT_RC;
  ea.cap.max_send_wr = 8;
  ea.cap.max_recv_wr = 1;
  ea.cap.max_send_sge = 1;
  ea.cap.max_recv_sge = 1;
  o.eqp = ibv_create_qp(o.pd2, &ea);
  if (!o.eqp) die("eqp");
  o.buf = static_cast<uint8_t*>(std::aligned_alloc(4096, kLen));
  o.fill();
  o.mr = ibv_reg_mr(o.pd, o.buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  o.mr_nobind = ibv_reg_mr(o.pd, o.buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  o.mr_nolw = ibv_reg_mr(o.pd, o.buf, kLen, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND);
  if (!o.mr || !o.mr_nobind || !o.mr_nolw) die("reg_mr: %s", std::strerror(errno));
  o.peer = harness::exchange_hello(o.ctx, o.qp);
  if (!connect_qp(o.qp, o.peer) || !connect_qp(o.eqp, o.peer)) die("connect");

  uint8_t* const w1 = o.buf + 4096;  // type 1 window: [w1, w1 + 8192)
  constexpr size_t kW1 = 8192;
  uint64_t h = 0;

  // ---- type 1: bind, READ and WRITE byte for byte, out of the window, rebind, unbind.
  ibv_mw* mw1 = ibv_alloc_mw(o.pd, IBV_MW_TYPE_1);
  if (!mw1) die("alloc_mw type 1");
  const uint32_t key0 = mw1->rkey;
  CHECK(o.read(key0, w1, 64) == IBV_WC_REM_ACCESS_ERR, "READ through an unbound window");
  CHECK(o.bind1(o.qp, o.cq, mw1, o.mr, w1, kW1, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS,
        "type 1 bind");
  const uint32_t key1 = mw1->rkey;
  CHECK(key1 == ibv_inc_rkey(key0), "new rkey 0x%x after 0x%x", key1, key0);
  CHECK(o.read(key1, w1, kW1, &h) == IBV_WC_SUCCESS && h == fnv(w1, kW1), "READ of the whole window");
  CHECK(o.write(key1, w1 + 100, 1000, 0x5a) == IBV_WC_SUCCESS, "WRITE into the window");
  {
    bool ok = o.buf[4096 + 99] == static_cast<uint8_t>((4096 + 99) * 7 + 3) &&
              o.buf[4096 + 1100] == static_cast<uint8_t>((4096 + 1100) * 7 + 3);
    for (size_t i = 100; i < 1100; ++i) ok = ok && w1[i] == 0x5a;
    CHECK(ok, "the WRITE through the window changed exactly its 1000 bytes");
  }
  CHECK(o.read(key1, w1 + kW1 - 16, 16, &h) == IBV_WC_SUCCESS && h == fnv(w1 + kW1 - 16, 16), "READ of the last bytes");
  CHECK(o.write(key1, w1 + kW1 - 10, 20, 1) == IBV_WC_REM_ACCESS_ERR, "WRITE past the end of the window");
  CHECK(o.read(key1, w1 - 8, 16, &h) == IBV_WC_REM_ACCESS_ERR, "READ before the window");
  CHECK(o.read(key0, w1, 16) == IBV_WC_REM_ACCESS_ERR, "READ with the key before the bind");
  CHECK(o.buf[4096 + kW1] == static_cast<uint8_t>((4096 + kW1) * 7 + 3), "byte after the window untouched");
  CHECK(ibv_dereg_mr(o.mr) == EBUSY, "dereg_mr with a bound window");
  // Rebind read-only: the old key is dead, WRITE is refused.
  CHECK(o.bind1(o.qp, o.cq, mw1, o.mr, w1, 4096, IBV_ACCESS_REMOTE_READ) == IBV_WC_SUCCESS, "type 1 rebind");
  const uint32_t key2 = mw1->rkey;
  CHECK(key2 != key1, "rebind keeps the key");
  CHECK(o.read(key1, w1, 16) == IBV_WC_REM_ACCESS_ERR, "READ with the previous bind's key");
  CHECK(o.read(key2, w1, 4096, &h) == IBV_WC_SUCCESS && h == fnv(w1, 4096), "READ after the rebind");
  CHECK(o.write(key2, w1, 16, 2) == IBV_WC_REM_ACCESS_ERR, "WRITE through a read-only window");
  // Unbind (length 0, no MR).
  CHECK(o.bind1(o.qp, o.cq, mw1, nullptr, nullptr, 0, 0) == IBV_WC_SUCCESS, "type 1 unbind");
  CHECK(o.read(key2, w1, 16) == IBV_WC_REM_ACCESS_ERR, "READ after unbind (old key)");
  CHECK(o.read(mw1->rkey, w1, 16) == IBV_WC_REM_ACCESS_ERR, "READ after unbind (current key)");

  // ---- type 2: bind with a new key (post_send), LOCAL_INV, ibv_wr_bind_mw, SEND_WITH_INV, ibv_wr_local_inv.
  uint8_t* const w2 = o.buf + 32768;
  constexpr size_t kW2 = 4096;
  o.fill();
  ibv_mw* mw2 = ibv_alloc_mw(o.pd, IBV_MW_TYPE_2);
  if (!mw2) die("alloc_mw type 2");
  const uint32_t k2a = ibv_inc_rkey(mw2->rkey);
  CHECK(o.bind2(o.qp, o.cq, mw2, k2a, w2, kW2, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS,
        "type 2 bind");
  CHECK(o.read(k2a, w2, kW2, &h) == IBV_WC_SUCCESS && h == fnv(w2, kW2), "READ through the type 2 window");
  CHECK(o.write(k2a, w2 + 10, 100, 0x77) == IBV_WC_SUCCESS, "WRITE through the type 2 window");
  {
    bool ok = w2[9] == static_cast<uint8_t>((32768 + 9) * 7 + 3) && w2[110] == static_cast<uint8_t>((32768 + 110) * 7 + 3);
    for (size_t i = 10; i < 110; ++i) ok = ok && w2[i] == 0x77;
    CHECK(ok, "the WRITE through the type 2 window changed exactly its bytes");
  }
  CHECK(o.read(mw2->rkey, w2, 16) == IBV_WC_REM_ACCESS_ERR, "READ with the allocation key");
  CHECK(o.read(k2a, w2 + kW2 - 8, 16) == IBV_WC_REM_ACCESS_ERR, "READ past the type 2 window");
  CHECK(o.local_inv(o.qp, o.cq, k2a) == IBV_WC_SUCCESS, "LOCAL_INV");
  CHECK(o.read(k2a, w2, 16) == IBV_WC_REM_ACCESS_ERR, "READ after LOCAL_INV");
  CHECK(ibv_dereg_mr(o.mr_nobind) == 0, "dereg of an MR without windows");
  o.mr_nobind = ibv_reg_mr(o.pd, o.buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!o.mr_nobind) die("reg_mr");

  // ibv_wr_bind_mw with the next key.
  const uint32_t k2b = ibv_inc_rkey(k2a);
  {
    ibv_mw_bind_info bi{};
    bi.mr = o.mr;
    bi.addr = reinterpret_cast<uintptr_t>(w2);
    bi.length = kW2;
    bi.mw_access_flags = IBV_ACCESS_REMOTE_READ;
    ibv_wr_start(o.qpx);
    o.qpx->wr_id = 21;
    o.qpx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_bind_mw(o.qpx, mw2, k2b, &bi);
    CHECK(ibv_wr_complete(o.qpx) == 0, "ibv_wr_complete (bind)");
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 21,
          "ibv_wr_bind_mw completion %s", harness::wc_str(wc).c_str());
  }
  CHECK(o.read(k2b, w2, kW2, &h) == IBV_WC_SUCCESS && h == fnv(w2, kW2), "READ after ibv_wr_bind_mw");
  CHECK(o.read(k2a, w2, 16) == IBV_WC_REM_ACCESS_ERR, "READ with the invalidated key");
  CHECK(o.bind2(o.qp, o.cq, mw2, ibv_inc_rkey(k2b), w2, kW2, IBV_ACCESS_REMOTE_READ) == IBV_WC_MW_BIND_ERR,
        "type 2 bind of a valid window");
  // That error moved the QP to ERR; back to RTS (same QP number): the window is still valid.
  CHECK(reconnect(o.qp, o.peer), "reconnect");
  CHECK(o.read(k2b, w2, 16, &h) == IBV_WC_SUCCESS && h == fnv(w2, 16), "READ through the still valid window");

  // SEND_WITH_INV from the peer invalidates it; the receive completion says so.
  {
    ibv_sge s{reinterpret_cast<uintptr_t>(o.buf), 64, o.mr->lkey};
    ibv_recv_wr rwr{};
    rwr.wr_id = 31;
    rwr.sg_list = &s;
    rwr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    CHECK(ibv_post_recv(o.qp, &rwr, &bad) == 0, "post_recv");
    CHECK(o.cmd("sendinv " + std::to_string(k2b)) == IBV_WC_SUCCESS, "SEND_WITH_INV");
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.wr_id == 31 && wc.opcode == IBV_WC_RECV &&
              (wc.wc_flags & IBV_WC_WITH_INV) && wc.invalidated_rkey == k2b && wc.byte_len == 16,
          "receive of SEND_WITH_INV: %s, invalidated_rkey 0x%x (want 0x%x)", harness::wc_str(wc).c_str(),
          wc.invalidated_rkey, k2b);
    CHECK(o.buf[0] == 0x42 && o.buf[15] == 0x42, "SEND_WITH_INV payload");
  }
  CHECK(o.read(k2b, w2, 16) == IBV_WC_REM_ACCESS_ERR, "READ after SEND_WITH_INV");

  // Bind again (post_send), invalidate with ibv_wr_local_inv.
  const uint32_t k2c = ibv_inc_rkey(k2b);
  CHECK(o.bind2(o.qp, o.cq, mw2, k2c, w2, kW2, IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS, "type 2 bind again");
  CHECK(o.write(k2c, w2, 8, 0x11) == IBV_WC_SUCCESS && w2[0] == 0x11 && w2[7] == 0x11 && w2[8] != 0x11,
        "WRITE after the third bind");
  ibv_wr_start(o.qpx);
  o.qpx->wr_id = 22;
  o.qpx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_local_inv(o.qpx, k2c);
  CHECK(ibv_wr_complete(o.qpx) == 0, "ibv_wr_complete (local inv)");
  {
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.opcode == IBV_WC_LOCAL_INV, "ibv_wr_local_inv completion");
  }
  CHECK(o.write(k2c, w2, 8, 0x12) == IBV_WC_REM_ACCESS_ERR && w2[0] == 0x11, "WRITE after ibv_wr_local_inv");

  // SEND_WITH_INV of a key that names no valid window: an invalid request at
  // both ends (the owner's QP enters ERR; the rest uses eqp).
  {
    ibv_sge s{reinterpret_cast<uintptr_t>(o.buf), 64, o.mr->lkey};
    ibv_recv_wr rwr{};
    rwr.wr_id = 32;
    rwr.sg_list = &s;
    rwr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    CHECK(ibv_post_recv(o.qp, &rwr, &bad) == 0, "post_recv");
    CHECK(o.cmd("sendinv " + std::to_string(k2c)) == IBV_WC_REM_INV_REQ_ERR, "SEND_WITH_INV of an invalidated key");
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_REM_INV_REQ_ERR && wc.wr_id == 32, "receive of a bad SEND_WITH_INV: %s",
          harness::wc_str(wc).c_str());
  }

  // ---- zero-based: a type 2 window bound with IBV_ACCESS_ZERO_BASED takes
  // offsets from its start as remote addresses; type 1 windows cannot be
  // zero based (o10-36.2.2: ibv_bind_mw refuses it with EINVAL, as mlx5).
  {
    CHECK(reconnect(o.qp, o.peer), "reconnect after the bad SEND_WITH_INV");
    o.fill();
    uint8_t* const wz = w2 + 512;
    constexpr size_t kWz = 2048;
    const uint32_t k2d = ibv_inc_rkey(k2c);
    CHECK(o.bind2(o.qp, o.cq, mw2, k2d, wz, kWz,
                  IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_ZERO_BASED) == IBV_WC_SUCCESS,
          "zero-based type 2 bind");
    CHECK(o.read_at(k2d, 0, kWz, &h) == IBV_WC_SUCCESS && h == fnv(wz, kWz), "READ of the whole zero-based window");
    CHECK(o.read_at(k2d, 1000, 48, &h) == IBV_WC_SUCCESS && h == fnv(wz + 1000, 48), "READ at offset 1000");
    CHECK(o.write_at(k2d, 100, 50, 0x66) == IBV_WC_SUCCESS, "WRITE at offset 100");
    bool ok = wz[99] == static_cast<uint8_t>((32768 + 512 + 99) * 7 + 3) &&
              wz[150] == static_cast<uint8_t>((32768 + 512 + 150) * 7 + 3);
    for (size_t i = 100; i < 150; ++i) ok = ok && wz[i] == 0x66;
    CHECK(ok, "the zero-based WRITE changed exactly bytes 100..149 of the window");
    CHECK(o.read_at(k2d, kWz - 8, 16) == IBV_WC_REM_ACCESS_ERR, "READ past the end of the zero-based window");
    CHECK(o.write_at(k2d, reinterpret_cast<uintptr_t>(wz), 8, 0x67) == IBV_WC_REM_ACCESS_ERR && wz[0] != 0x67,
          "WRITE at the window's virtual address (not an offset)");
    CHECK(o.local_inv(o.qp, o.cq, k2d) == IBV_WC_SUCCESS, "LOCAL_INV of the zero-based window");
    CHECK(o.read_at(k2d, 0, 16) == IBV_WC_REM_ACCESS_ERR, "READ after LOCAL_INV of the zero-based window");
    // Rebound without ZERO_BASED, the same window takes virtual addresses again.
    const uint32_t k2e = ibv_inc_rkey(k2d);
    CHECK(o.bind2(o.qp, o.cq, mw2, k2e, wz, kWz, IBV_ACCESS_REMOTE_READ) == IBV_WC_SUCCESS, "type 2 rebind, not zero based");
    CHECK(o.read(k2e, wz, 64, &h) == IBV_WC_SUCCESS && h == fnv(wz, 64), "READ at the virtual address after the rebind");
    CHECK(o.read_at(k2e, 0, 16) == IBV_WC_REM_ACCESS_ERR, "READ at offset 0 after the rebind");
    CHECK(o.local_inv(o.qp, o.cq, k2e) == IBV_WC_SUCCESS, "LOCAL_INV");
    const uint32_t key_before = mw1->rkey;
    CHECK(o.bind1(o.qp, o.cq, mw1, o.mr, w1, 64, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ZERO_BASED) == 1000 + EINVAL &&
              mw1->rkey == key_before,
          "zero-based type 1 bind: EINVAL, key unchanged");
  }

  // ---- zero-based MRs and MRs at an iova of the caller's choice (ibv_reg_mr_iova).
  {
    o.fill();
    const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    ibv_mr* zmr = ibv_reg_mr(o.pd, o.buf + 8192, 8192, acc | IBV_ACCESS_ZERO_BASED);
    CHECK(zmr != nullptr, "reg_mr ZERO_BASED: %s", std::strerror(errno));
    if (zmr) {
      CHECK(o.read_at(zmr->rkey, 0, 8192, &h) == IBV_WC_SUCCESS && h == fnv(o.buf + 8192, 8192),
            "READ of a zero-based MR at offset 0");
      CHECK(o.write_at(zmr->rkey, 4000, 96, 0x5b) == IBV_WC_SUCCESS && o.buf[8192 + 4000] == 0x5b &&
                o.buf[8192 + 4095] == 0x5b && o.buf[8192 + 4096] != 0x5b,
            "WRITE of a zero-based MR at offset 4000");
      CHECK(o.read_at(zmr->rkey, 8190, 4) == IBV_WC_REM_ACCESS_ERR, "READ past a zero-based MR");
      CHECK(o.read(zmr->rkey, o.buf + 8192, 16) == IBV_WC_REM_ACCESS_ERR, "READ of a zero-based MR at its virtual address");
      ibv_mw* zw = ibv_alloc_mw(o.pd, IBV_MW_TYPE_2);
      CHECK(zw != nullptr, "alloc_mw");
      ibv_mr* zbind = ibv_reg_mr(o.pd, o.buf + 8192, 8192, acc | IBV_ACCESS_MW_BIND | IBV_ACCESS_ZERO_BASED);
      CHECK(zbind != nullptr, "reg_mr ZERO_BASED | MW_BIND");
      if (zw && zbind) {
        ibv_send_wr wr{};
        wr.wr_id = 14;
        wr.opcode = IBV_WR_BIND_MW;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.bind_mw.mw = zw;
        wr.bind_mw.rkey = ibv_inc_rkey(zw->rkey);
        wr.bind_mw.bind_info.mr = zbind;
        wr.bind_mw.bind_info.addr = 0;
        wr.bind_mw.bind_info.length = 64;
        wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
        ibv_send_wr* bad = nullptr;
        CHECK(ibv_post_send(o.qp, &wr, &bad) == 0, "post bind over a zero-based MR");
        CHECK(poll_status(o.cq) == IBV_WC_MW_BIND_ERR, "a window over a zero-based MR: IBV_WC_MW_BIND_ERR (as rxe)");
        CHECK(reconnect(o.qp, o.peer), "reconnect after the bind error");
      }
      CHECK(!zw || ibv_dealloc_mw(zw) == 0, "dealloc_mw");
      CHECK(!zbind || ibv_dereg_mr(zbind) == 0, "dereg zero-based MW_BIND MR");
      CHECK(ibv_dereg_mr(zmr) == 0, "dereg zero-based MR");
    }
    constexpr uint64_t kIova = 0x7000'0000'0000ull;
    ibv_mr* imr = ibv_reg_mr_iova(o.pd, o.buf + 16384, 4096, kIova, acc);
    CHECK(imr != nullptr, "reg_mr_iova: %s", std::strerror(errno));
    if (imr) {
      CHECK(o.read_at(imr->rkey, kIova + 100, 200, &h) == IBV_WC_SUCCESS && h == fnv(o.buf + 16384 + 100, 200),
            "READ at iova + 100");
      CHECK(o.write_at(imr->rkey, kIova + 4095, 1, 0x5c) == IBV_WC_SUCCESS && o.buf[16384 + 4095] == 0x5c,
            "WRITE of the last byte at iova + 4095");
      CHECK(o.read_at(imr->rkey, kIova + 4095, 2) == IBV_WC_REM_ACCESS_ERR, "READ past iova + length");
      CHECK(o.read(imr->rkey, o.buf + 16384, 16) == IBV_WC_REM_ACCESS_ERR, "READ at the buffer's address, not the iova");
      CHECK(ibv_dereg_mr(imr) == 0, "dereg iova MR");
    }
  }

  // ---- bind errors (each moves eqp to ERR; it is reset after each).
  ibv_mw* mwe = ibv_alloc_mw(o.pd, IBV_MW_TYPE_1);
  if (!mwe) die("alloc_mw");
  CHECK(o.bind1(o.eqp, o.ecq, mwe, o.mr_nobind, o.buf, 64, IBV_ACCESS_REMOTE_READ) == IBV_WC_MW_BIND_ERR,
        "bind to an MR without IBV_ACCESS_MW_BIND");
  o.reset_eqp();
  CHECK(o.bind1(o.eqp, o.ecq, mwe, o.mr, o.buf + kLen - 32, 64, IBV_ACCESS_REMOTE_READ) == IBV_WC_MW_BIND_ERR,
        "bind past the end of the MR");
  o.reset_eqp();
  CHECK(o.bind1(o.eqp, o.ecq, mwe, o.mr_nolw, o.buf, 64, IBV_ACCESS_REMOTE_WRITE) == IBV_WC_MW_BIND_ERR,
        "REMOTE_WRITE window on an MR without LOCAL_WRITE");
  o.reset_eqp();
  CHECK(o.bind1(o.eqp, o.ecq, mwe, o.mr_nolw, o.buf, 64, IBV_ACCESS_REMOTE_READ) == IBV_WC_SUCCESS,
        "REMOTE_READ window on an MR without LOCAL_WRITE");
  CHECK(o.bind2(o.eqp, o.ecq, mw2, ibv_inc_rkey(k2c), w2, 64, IBV_ACCESS_REMOTE_READ) == IBV_WC_MW_BIND_ERR,
        "type 2 bind through a QP of another PD");
  o.reset_eqp();
  CHECK(o.local_inv(o.eqp, o.ecq, mwe->rkey) == IBV_WC_LOC_QP_OP_ERR, "LOCAL_INV of a type 1 window");
  o.reset_eqp();
  {
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_BIND_MW;
    wr.bind_mw.mw = mwe;  // type 1: ibv_bind_mw only
    wr.bind_mw.bind_info.mr = o.mr;
    wr.bind_mw.bind_info.length = 64;
    wr.bind_mw.bind_info.addr = reinterpret_cast<uintptr_t>(o.buf);
    ibv_send_wr* bad = nullptr;
    CHECK(ibv_post_send(o.eqp, &wr, &bad) == EINVAL && bad == &wr, "IBV_WR_BIND_MW of a type 1 window");
  }

  CHECK(o.ctl.send_line("quit"), "quit");
  CHECK(ibv_dealloc_mw(mwe) == 0 && ibv_dealloc_mw(mw2) == 0 && ibv_dealloc_mw(mw1) == 0, "dealloc_mw");
  CHECK(ibv_dereg_mr(o.mr) == 0 && ibv_dereg_mr(o.mr_nobind) == 0 && ibv_dereg_mr(o.mr_nolw) == 0, "dereg_mr");
  CHECK(ibv_destroy_qp(o.qp) == 0 && ibv_destroy_qp(o.eqp) == 0, "destroy_qp");
  CHECK(ibv_destroy_cq(o.cq) == 0 && ibv_destroy_cq(o.ecq) == 0, "destroy_cq");
  CHECK(ibv_dealloc_pd(o.pd) == 0 && ibv_dealloc_pd(o.pd2) == 0, "dealloc_pd");
  CHECK(ibv_close_device(o.ctx) == 0, "close");
  std::free(o.buf);
  std::printf("OWNER done: %d failure(s)\n", harness::check_failures);
  return harness::check_failures ? 1 : 0;
}

// ---------------------------------------------------------------------------

TEST(MemoryWindows, Type1Type2InvalidateAndErrors) {
  HARNESS_REQUIRE_DEVICE();
  harness::Result o = harness::run_worker_pair({}, 90);
  EXPECT_NE(o.out.find("OWNER done: 0 failure(s)"), std::string::npos) << o.out;
}

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return std::string(argv[2]) == "owner" ? run_owner() : run_peer();
  }
  return harness::run_tests_as_root(argc, argv);
}
