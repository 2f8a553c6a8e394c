// Verbs contracts that generic test suites exercise (issue 14), between two
// processes through `shmrdma run`:
//   - memory-window binds over an MR with LOCAL_WRITE | MW_BIND only, the
//     bind's access carrying LOCAL_WRITE too (type 1 and type 2), and a type 1
//     rebind of length 0 invalidating the window;
//   - ibv_rereg_mr: access, PD and translation changes seen by the peer's very
//     next operation, rights added and removed, with the key the MR holds;
//   - QP reuse: both QPs of a pair go to ERR and back through RESET, INIT,
//     RTR and RTS and then carry traffic like new ones, in both directions;
//   - sends that had to wait (RNR) execute once they can, while their
//     initiator makes no verbs call at all, as on a NIC.
//
// As a gtest it starts `dp_contract --worker owner|peer` connected by a
// socketpair on fd 3. The peer executes commands on its RC QP and answers
// with the completion status (and a hash of the bytes):
//   write RKEY ADDR LEN BYTE | read RKEY ADDR LEN | send LEN BYTE |
//   recv LEN | err | reconnect | sendasync LEN BYTE | wait |
//   stalled RKEY ADDR BYTE | quit
// After an error completion of write/read/send the peer moves its QP through
// RESET to RTS again by itself (the owner's QP stays in RTS).
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cinttypes>
#include <ctime>
#include <cstdarg>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;
using harness::Hello;
using harness::poll_status;
using harness::fnv;
using harness::map_buf;

constexpr size_t kLen = 64 << 10;
constexpr int kQpAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                          IBV_ACCESS_REMOTE_ATOMIC;

bool connect_qp(ibv_qp* qp, const Hello& peer) {
  return harness::connect_qp(qp, peer.qpn, peer.lid, kQpAccess) == 0;
}

bool reconnect(ibv_qp* qp, const Hello& peer) { return harness::qp_to_reset(qp) == 0 && connect_qp(qp, peer); }

int post_recv(ibv_qp* qp, uint8_t* p, uint32_t len, uint32_t lkey, uint64_t wr_id) {
  ibv_sge s{reinterpret_cast<uintptr_t>(p), len, lkey};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &s;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &wr, &bad);
}

int post_send(ibv_qp* qp, uint8_t* p, uint32_t len, uint32_t lkey, uint64_t wr_id) {
  ibv_sge s{reinterpret_cast<uintptr_t>(p), len, lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &s;
  wr.num_sge = 1;
  ibv_send_wr* bad = nullptr;
  return ibv_post_send(qp, &wr, &bad);
}

// Drains `cq` until it has been empty for 100 ms: how many completions, and
// whether every one was a flush.
int drain_flushes(ibv_cq* cq, bool* all_flush) {
  int n = 0;
  *all_flush = true;
  ibv_wc wc{};
  while (harness::poll_one(cq, &wc, 100)) {
    ++n;
    if (wc.status != IBV_WC_WR_FLUSH_ERR) *all_flush = false;
  }
  return n;
}

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
  uint8_t* buf = map_buf(kLen);
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
    char reply[128];
    if (cmd == "err") {
      if (harness::qp_to_err(qp) != 0) die("peer to ERR");
      bool all_flush = false;
      int n = drain_flushes(cq, &all_flush);
      std::snprintf(reply, sizeof reply, "%d %d", n, all_flush ? 1 : 0);
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    if (cmd == "sendasync") {  // posts a SEND and answers at once; "wait" polls its completion
      uint64_t len = 0;
      unsigned byte = 0;
      in >> len >> byte;
      if (len > kLen) die("bad command %s", line.c_str());
      for (size_t i = 0; i < len; ++i) buf[i] = static_cast<uint8_t>(byte + i);
      std::snprintf(reply, sizeof reply, "%d 0", post_send(qp, buf, static_cast<uint32_t>(len), mr->lkey, 9));
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    if (cmd == "stalled") {
      // A signaled SEND of 8 bytes (wr_id 9: "wait" polls it), then an
      // unsignaled WRITE of the one byte BYTE to ADDR, answered at once;
      // then nothing but the wait for the next command on the socket.
      uint32_t rkey = 0;
      uint64_t addr = 0;
      unsigned byte = 0;
      in >> rkey >> addr >> byte;
      for (size_t i = 0; i < 8; ++i) buf[i] = static_cast<uint8_t>(0xa0 + i);
      buf[64] = static_cast<uint8_t>(byte);
      const int rs = post_send(qp, buf, 8, mr->lkey, 9);
      ibv_sge s{reinterpret_cast<uintptr_t>(buf + 64), 1, mr->lkey};
      ibv_send_wr wr{};
      wr.wr_id = 10;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.sg_list = &s;
      wr.num_sge = 1;
      wr.wr.rdma.remote_addr = addr;
      wr.wr.rdma.rkey = rkey;
      ibv_send_wr* bad = nullptr;
      const int rw = ibv_post_send(qp, &wr, &bad);
      std::snprintf(reply, sizeof reply, "%d %d", rs ? 1000 + rs : 0, rw);
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    if (cmd == "wait") {
      ibv_wc wc{};
      int st = poll_status(cq, &wc);
      if (st == IBV_WC_SUCCESS && wc.wr_id != 9) st = 2000;
      std::snprintf(reply, sizeof reply, "%d 0", st);
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    if (cmd == "newqp") {  // the owner's side is now QP number N
      in >> owner.qpn;
      std::snprintf(reply, sizeof reply, "%s", reconnect(qp, owner) ? "ok" : "failed");
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    if (cmd == "reconnect") {
      std::snprintf(reply, sizeof reply, "%d 0", reconnect(qp, owner) ? 0 : 1);
      if (!ctl.send_line(reply)) die("reply");
      continue;
    }
    uint32_t rkey = 0;
    uint64_t addr = 0, len = 0;
    unsigned byte = 0;
    int st = 0;
    uint64_t hash = 0;
    if (cmd == "recv") {
      in >> len;
      if (len > kLen) die("bad command %s", line.c_str());
      std::memset(buf, 0, len);
      int rc = post_recv(qp, buf, static_cast<uint32_t>(len), mr->lkey, 7);
      if (!ctl.send_line("posted")) die("reply");
      ibv_wc wc{};
      st = rc ? 1000 + rc : poll_status(cq, &wc);
      if (st == IBV_WC_SUCCESS && (wc.opcode != IBV_WC_RECV || wc.byte_len != len || wc.wr_id != 7)) st = 2000;
      hash = fnv(buf, len);
    } else {
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
        wr.opcode = cmd == "write" ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
        wr.wr.rdma.remote_addr = addr;
        wr.wr.rdma.rkey = rkey;
      } else if (cmd == "send") {
        in >> len >> byte;
        if (len > kLen) die("bad command %s", line.c_str());
        for (size_t i = 0; i < len; ++i) buf[i] = static_cast<uint8_t>(byte + i);
        wr.opcode = IBV_WR_SEND;
      } else {
        die("unknown command %s", line.c_str());
      }
      sge.length = static_cast<uint32_t>(len);
      ibv_send_wr* bad = nullptr;
      int rc = ibv_post_send(qp, &wr, &bad);
      st = rc ? 1000 + rc : poll_status(cq);
      if (cmd == "read") hash = fnv(buf, len);
      if (st != IBV_WC_SUCCESS && !reconnect(qp, owner)) die("reconnect after %s", line.c_str());
    }
    std::snprintf(reply, sizeof reply, "%d %" PRIu64, st, hash);
    if (!ctl.send_line(reply)) die("reply");
  }
  if (ibv_destroy_qp(qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
    die("teardown");
  ::munmap(buf, kLen);
  std::printf("PEER done\n");
  return 0;
}

// ----------------------------------------------------------------- owner

struct Owner {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_pd* pd2 = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  Hello peer;
  harness::LineReader ctl{harness::kCtlFd};

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
  int write(uint32_t rkey, const uint8_t* p, size_t len, uint8_t byte) {
    return cmd("write " + std::to_string(rkey) + " " + std::to_string(reinterpret_cast<uintptr_t>(p)) + " " +
               std::to_string(len) + " " + std::to_string(byte));
  }
  int read(uint32_t rkey, const uint8_t* p, size_t len, uint64_t* hash = nullptr) {
    return cmd("read " + std::to_string(rkey) + " " + std::to_string(reinterpret_cast<uintptr_t>(p)) + " " +
                   std::to_string(len) + " 0",
               hash);
  }
  int bind1(ibv_mw* mw, ibv_mr* m, uint8_t* addr, size_t len, unsigned access) {
    return harness::bind_mw_type1(qp, cq, mw, m, addr, len, access);
  }
  int bind2(ibv_mw* mw, ibv_mr* m, uint32_t rkey, uint8_t* addr, size_t len, unsigned access) {
    return harness::bind_mw_type2(qp, cq, mw, m, rkey, addr, len, access);
  }
};

bool all_are(const uint8_t* p, size_t n, uint8_t v) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != v) return false;
  return true;
}

void windows(Owner& o) {
  uint8_t* buf = map_buf(kLen);
  std::memset(buf, 0xee, kLen);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
  if (!mr) die("reg_mr: %s", std::strerror(errno));
  CHECK(o.write(mr->rkey, buf, 16, 1) == IBV_WC_REM_ACCESS_ERR, "WRITE through the MR's own rkey");

  // Type 1: the bind's access carries LOCAL_WRITE; the window grants REMOTE_WRITE only.
  ibv_mw* mw1 = ibv_alloc_mw(o.pd, IBV_MW_TYPE_1);
  if (!mw1) die("alloc_mw 1");
  CHECK(o.bind1(mw1, mr, buf + 4096, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS,
        "type 1 bind granting REMOTE_WRITE (LOCAL_WRITE in the bind's access)");
  CHECK(o.write(mw1->rkey, buf + 4096 + 8, 1000, 0x31) == IBV_WC_SUCCESS, "WRITE through the type 1 window");
  CHECK(all_are(buf + 4096 + 8, 1000, 0x31) && buf[4096 + 7] == 0xee && buf[4096 + 1008] == 0xee,
        "the type 1 window's WRITE changed exactly its bytes");
  CHECK(o.read(mw1->rkey, buf + 4096, 16) == IBV_WC_REM_ACCESS_ERR, "READ through a write-only window");
  // Rebind with length 0 (MR given): the window is invalid.
  CHECK(o.bind1(mw1, mr, buf + 4096, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS,
        "type 1 rebind of length 0");
  CHECK(o.write(mw1->rkey, buf + 4096, 16, 0x32) == IBV_WC_REM_ACCESS_ERR && buf[4096] == 0xee,
        "WRITE after the rebind of length 0");
  // Remote atomic rights on an MR with LOCAL_WRITE: allowed.
  CHECK(o.bind1(mw1, mr, buf, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ) ==
            IBV_WC_SUCCESS,
        "type 1 bind granting REMOTE_ATOMIC | REMOTE_READ");
  {
    uint64_t h = 0;
    CHECK(o.read(mw1->rkey, buf, 64, &h) == IBV_WC_SUCCESS && h == fnv(buf, 64), "READ through the atomic window");
  }
  CHECK(o.bind1(mw1, nullptr, nullptr, 0, 0) == IBV_WC_SUCCESS, "type 1 unbind");

  // Type 2 through IBV_WR_BIND_MW, the same access.
  ibv_mw* mw2 = ibv_alloc_mw(o.pd, IBV_MW_TYPE_2);
  if (!mw2) die("alloc_mw 2");
  const uint32_t k2 = ibv_inc_rkey(mw2->rkey);
  CHECK(o.bind2(mw2, mr, k2, buf + 16384, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == IBV_WC_SUCCESS,
        "type 2 bind granting REMOTE_WRITE (LOCAL_WRITE in the bind's access)");
  CHECK(o.write(k2, buf + 16384 + 100, 200, 0x41) == IBV_WC_SUCCESS, "WRITE through the type 2 window");
  CHECK(all_are(buf + 16384 + 100, 200, 0x41) && buf[16384 + 99] == 0xee && buf[16384 + 300] == 0xee,
        "the type 2 window's WRITE changed exactly its bytes");
  CHECK(o.write(k2, buf + 16384 + 4090, 16, 0x42) == IBV_WC_REM_ACCESS_ERR, "WRITE past the type 2 window");
  CHECK(o.read(k2, buf + 16384, 16) == IBV_WC_REM_ACCESS_ERR, "READ through the write-only type 2 window");
  CHECK(ibv_dereg_mr(mr) == EBUSY, "dereg_mr with a bound type 2 window");
  {
    ibv_send_wr wr{};
    wr.wr_id = 13;
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = k2;
    ibv_send_wr* bad = nullptr;
    CHECK(ibv_post_send(o.qp, &wr, &bad) == 0 && poll_status(o.cq) == IBV_WC_SUCCESS, "LOCAL_INV");
  }
  CHECK(ibv_dealloc_mw(mw2) == 0 && ibv_dealloc_mw(mw1) == 0, "dealloc_mw");
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  ::munmap(buf, kLen);
  std::printf("windows: done\n");
}

void rereg(Owner& o) {
  uint8_t* buf = map_buf(kLen);
  uint8_t* buf2 = map_buf(kLen);
  std::memset(buf, 0xee, kLen);
  std::memset(buf2, 0xdd, kLen);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) die("reg_mr");
  const uint32_t key0 = mr->rkey;
  CHECK(o.write(mr->rkey, buf, 16, 1) == IBV_WC_REM_ACCESS_ERR && buf[0] == 0xee, "WRITE before the rereg");

  // Rights added.
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == 0,
        "rereg adding REMOTE_WRITE: %s", std::strerror(errno));
  CHECK(o.write(mr->rkey, buf + 10, 500, 0x51) == IBV_WC_SUCCESS, "WRITE after REMOTE_WRITE was added");
  CHECK(all_are(buf + 10, 500, 0x51) && buf[9] == 0xee && buf[510] == 0xee, "the WRITE's bytes");
  CHECK(o.write(key0, buf + 10, 4, 0x52) == IBV_WC_SUCCESS && all_are(buf + 10, 4, 0x52),
        "WRITE with the key the peer had before the rereg (0x%x, now 0x%x)", key0, mr->rkey);
  CHECK(o.read(mr->rkey, buf, 16) == IBV_WC_REM_ACCESS_ERR, "READ without REMOTE_READ");

  // Rights changed: READ added, WRITE removed.
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0,
        "rereg to REMOTE_READ");
  CHECK(o.write(mr->rkey, buf, 16, 0x53) == IBV_WC_REM_ACCESS_ERR && buf[0] == 0xee,
        "WRITE after REMOTE_WRITE was removed");
  {
    uint64_t h = 0;
    CHECK(o.read(mr->rkey, buf, 4096, &h) == IBV_WC_SUCCESS && h == fnv(buf, 4096), "READ after REMOTE_READ was added");
  }

  // PD: another PD than the QP's -> no access; back -> access.
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, o.pd2, nullptr, 0, 0) == 0 && mr->pd == o.pd2, "rereg to pd2");
  CHECK(o.read(mr->rkey, buf, 16) == IBV_WC_REM_ACCESS_ERR, "READ with the MR in another PD");
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS, o.pd, nullptr, 0,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ) == 0 &&
            mr->pd == o.pd,
        "rereg back to pd");
  CHECK(o.write(mr->rkey, buf + 100, 32, 0x54) == IBV_WC_SUCCESS && all_are(buf + 100, 32, 0x54),
        "WRITE after the PD came back");

  // Translation: the key now names buf2.
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, buf2, kLen / 2, 0) == 0 && mr->addr == buf2 &&
            mr->length == kLen / 2,
        "rereg to buf2");
  CHECK(o.write(mr->rkey, buf2 + 64, 1024, 0x55) == IBV_WC_SUCCESS, "WRITE into the new translation");
  CHECK(all_are(buf2 + 64, 1024, 0x55) && buf2[63] == 0xdd && buf2[64 + 1024] == 0xdd, "its bytes in buf2");
  CHECK(o.write(mr->rkey, buf + 2000, 16, 0x56) == IBV_WC_REM_ACCESS_ERR && buf[2000] == 0xee,
        "WRITE at the old translation");
  CHECK(o.write(mr->rkey, buf2 + kLen / 2 - 8, 16, 0x57) == IBV_WC_REM_ACCESS_ERR, "WRITE past the new length");
  {
    uint64_t h = 0;
    CHECK(o.read(mr->rkey, buf2, 2048, &h) == IBV_WC_SUCCESS && h == fnv(buf2, 2048), "READ of the new translation");
  }
  // And back (the mapped tier moves the range again).
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, nullptr, buf, kLen, 0) == 0, "rereg back to buf");
  CHECK(o.write(mr->rkey, buf + kLen - 16, 16, 0x58) == IBV_WC_SUCCESS && all_are(buf + kLen - 16, 16, 0x58),
        "WRITE after the translation came back");
  // Owner writes after the rereg are seen by the peer's READ (no stale copy).
  std::memset(buf + 8192, 0x59, 4096);
  {
    uint64_t h = 0;
    CHECK(o.read(mr->rkey, buf + 8192, 4096, &h) == IBV_WC_SUCCESS && h == fnv(buf + 8192, 4096), "READ of buf");
  }
  // Bad input leaves the MR as it was.
  CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0, IBV_ACCESS_REMOTE_WRITE) != 0,
        "REMOTE_WRITE without LOCAL_WRITE");
  CHECK(o.write(mr->rkey, buf, 8, 0x5a) == IBV_WC_SUCCESS && all_are(buf, 8, 0x5a), "WRITE after the refused rereg");
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  ::munmap(buf, kLen);
  ::munmap(buf2, kLen);
  std::printf("rereg: done\n");
}

void reuse(Owner& o) {
  uint8_t* buf = map_buf(kLen);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr) die("reg_mr");
  for (int round = 0; round < 6; ++round) {
    const int how = round % 3;
    bool sent_early = false;
    if (how == 0) {
      // Both QPs moved to ERR with a receive outstanding (flushed); the
      // owner comes back first.
      CHECK(post_recv(o.qp, buf, 4096, mr->lkey, 100 + round) == 0, "post_recv");
      CHECK(harness::qp_to_err(o.qp) == 0, "owner to ERR");
      bool all_flush = false;
      CHECK(drain_flushes(o.cq, &all_flush) == 1 && all_flush, "owner's receive flushed");
      CHECK(o.cmd("err") == 0, "peer flushes");
      CHECK(reconnect(o.qp, o.peer), "owner reconnect");
      CHECK(o.cmd("reconnect") == 0, "peer reconnect");
    } else if (how == 1) {
      // A responder error puts both in ERR: a SEND longer than the receive.
      // The peer goes through RESET back to RTS at once, the owner later.
      CHECK(post_recv(o.qp, buf, 1024, mr->lkey, 100 + round) == 0, "post_recv");
      int st = o.cmd("send 3000 1");
      CHECK(st == IBV_WC_REM_INV_REQ_ERR, "SEND longer than the receive: %d", st);
      ibv_wc wc{};
      CHECK(poll_status(o.cq, &wc) == IBV_WC_LOC_LEN_ERR && wc.wr_id == uint64_t(100 + round), "owner's receive: %s",
            harness::wc_str(wc).c_str());
      CHECK(harness::qp_state(o.qp) == IBV_QPS_ERR, "owner in %s", harness::qp_state_name(harness::qp_state(o.qp)));
      bool all_flush = false;
      drain_flushes(o.cq, &all_flush);
      CHECK(all_flush, "only flushes after the error");
      CHECK(reconnect(o.qp, o.peer), "owner reconnect");
    } else {
      // Both in ERR; the peer comes back first and posts its SEND while the
      // owner is still in ERR (it waits like a transport retry).
      // A SEND of the peer already waits for the owner when both enter ERR
      // (it is flushed); a QP after RESET must not inherit that wait.
      CHECK(harness::qp_to_err(o.qp) == 0, "owner to ERR");
      CHECK(o.cmd("sendasync 100 0") == 0, "peer posts a SEND to a QP in ERR");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      {
        uint64_t all_flush = 0;
        CHECK(o.cmd("err", &all_flush) == 1 && all_flush == 1, "peer's waiting SEND flushed");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // longer than the peer's transport timeout
      CHECK(o.cmd("reconnect") == 0, "peer reconnect");
      CHECK(o.cmd("sendasync 3000 " + std::to_string(round * 10)) == 0, "peer posts its SEND");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      CHECK(reconnect(o.qp, o.peer), "owner reconnect");
      std::memset(buf, 0, 8192);
      CHECK(post_recv(o.qp, buf, 4096, mr->lkey, 200 + round) == 0, "post_recv");
      CHECK(o.cmd("wait") == IBV_WC_SUCCESS, "the SEND posted before the owner came back (round %d)", round);
      sent_early = true;
    }
    CHECK(harness::qp_state(o.qp) == IBV_QPS_RTS, "owner in %s", harness::qp_state_name(harness::qp_state(o.qp)));
    // Traffic in both directions like a new pair.
    if (!sent_early) {
      std::memset(buf, 0, 8192);
      CHECK(post_recv(o.qp, buf, 4096, mr->lkey, 200 + round) == 0, "post_recv");
      CHECK(o.cmd("send 3000 " + std::to_string(round * 10)) == IBV_WC_SUCCESS, "peer SEND after reuse (round %d)",
            round);
    }
    {
      ibv_wc wc{};
      CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.wr_id == uint64_t(200 + round) && wc.byte_len == 3000,
            "owner's receive after reuse: %s", harness::wc_str(wc).c_str());
      bool ok = true;
      for (size_t i = 0; i < 3000; ++i) ok = ok && buf[i] == static_cast<uint8_t>(round * 10 + i);
      CHECK(ok, "SEND payload after reuse");
    }
    CHECK(o.write(mr->rkey, buf + 5000, 700, static_cast<uint8_t>(0x60 + round)) == IBV_WC_SUCCESS &&
              all_are(buf + 5000, 700, static_cast<uint8_t>(0x60 + round)),
          "peer WRITE after reuse (round %d)", round);
    // Owner -> peer.
    for (size_t i = 0; i < 2000; ++i) buf[8192 + i] = static_cast<uint8_t>(i * 3 + round);
    if (!o.ctl.send_line("recv 2000")) die("send recv");
    std::string r;
    if (o.ctl.poll_line(&r, 30000) != 1 || r != "posted") die("peer did not post: %s", r.c_str());
    CHECK(post_send(o.qp, buf + 8192, 2000, mr->lkey, 300 + round) == 0, "owner post_send");
    {
      ibv_wc wc{};
      CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.wr_id == uint64_t(300 + round),
            "owner SEND after reuse: %s", harness::wc_str(wc).c_str());
    }
    if (o.ctl.poll_line(&r, 30000) != 1) die("no recv reply");
    int st = -1;
    uint64_t h = 0;
    std::istringstream(r) >> st >> h;
    CHECK(st == IBV_WC_SUCCESS && h == fnv(buf + 8192, 2000), "peer's receive after reuse: %d", st);
  }
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  ::munmap(buf, kLen);
  std::printf("reuse: done\n");
}

uint64_t raw_clock(ibv_context* ctx) {
  ibv_values_ex v{};
  v.comp_mask = IBV_VALUES_MASK_RAW_CLOCK;
  if (ibv_query_rt_values_ex(ctx, &v) != 0 || !(v.comp_mask & IBV_VALUES_MASK_RAW_CLOCK)) die("ibv_query_rt_values_ex");
  return static_cast<uint64_t>(v.raw_clock.tv_sec) * 1000000000ull + static_cast<uint64_t>(v.raw_clock.tv_nsec);
}

uint64_t wall_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// The peer's SEND finds no receive (RNR, retried for ever) and its WRITE
// queues behind it; then the peer waits on its control socket, making no
// verbs call. Once the owner posts a receive, both must execute by
// themselves: the owner spins on the WRITE's byte without polling either.
void unattended(Owner& o) {
  uint8_t* buf = map_buf(kLen);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr) die("reg_mr");
  volatile uint8_t* flag = buf + 4096;
  *flag = 0;
  const std::string c = "stalled " + std::to_string(mr->rkey) + " " +
                        std::to_string(reinterpret_cast<uintptr_t>(buf + 4096)) + " 77";
  CHECK(o.cmd(c) == 0, "the peer posts a SEND and a WRITE");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(*flag == 0, "the WRITE executed before the SEND it was posted after (no receive yet)");
  CHECK(post_recv(o.qp, buf, 64, mr->lkey, 55) == 0, "post_recv");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (*flag != 77 && std::chrono::steady_clock::now() < until) {
  }
  CHECK(*flag == 77, "the WRITE did not arrive within 10 s of the receive while its initiator made no verbs call");
  ibv_wc wc{};
  CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.wr_id == 55 && wc.byte_len == 8, "the receive: %s",
        harness::wc_str(wc).c_str());
  for (size_t i = 0; i < 8; ++i) CHECK(buf[i] == 0xa0 + i, "byte %zu of the SEND", i);
  CHECK(o.cmd("wait") == IBV_WC_SUCCESS, "the peer's SEND completed");
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  ::munmap(buf, kLen);
  std::printf("unattended: done\n");
}

// Completion timestamps: receive completions stamped by the peer (the
// producer), send completions by the owner, both in the device clock of
// ibv_query_rt_values_ex and in wall-clock ns.
void timestamps(Owner& o) {
  ibv_device_attr_ex dx{};
  CHECK(ibv_query_device_ex(o.ctx, nullptr, &dx) == 0, "query_device_ex");
  CHECK(dx.hca_core_clock == 1000000, "hca_core_clock %" PRIu64 " kHz", dx.hca_core_clock);
  CHECK(dx.completion_timestamp_mask == ~uint64_t{0}, "completion_timestamp_mask 0x%" PRIx64,
        dx.completion_timestamp_mask);
  {
    ibv_values_ex v{};
    v.comp_mask = 0;
    CHECK(ibv_query_rt_values_ex(o.ctx, &v) == 0 && v.comp_mask == 0, "query_rt_values_ex without a mask");
    const uint64_t a = raw_clock(o.ctx), b = raw_clock(o.ctx);
    CHECK(a > 0 && b >= a, "raw clock %" PRIu64 " then %" PRIu64, a, b);
  }
  // Unsupported completion fields are refused; a CQ without timestamps has no readers for them.
  {
    ibv_cq_init_attr_ex ca{};
    ca.cqe = 16;
    ca.wc_flags = uint64_t{IBV_WC_STANDARD_FLAGS} | IBV_WC_EX_WITH_CVLAN;
    errno = 0;
    CHECK(ibv_create_cq_ex(o.ctx, &ca) == nullptr && errno == EOPNOTSUPP, "CVLAN: errno %d", errno);
    ca.wc_flags = IBV_WC_STANDARD_FLAGS;
    ibv_cq_ex* plain = ibv_create_cq_ex(o.ctx, &ca);
    CHECK(plain && !plain->read_completion_ts && !plain->read_completion_wallclock_ns,
          "a CQ without timestamp flags has no timestamp readers");
    if (plain) CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(plain)) == 0, "destroy");
  }
  ibv_cq_init_attr_ex ca{};
  ca.cqe = 64;
  ca.wc_flags = uint64_t{IBV_WC_STANDARD_FLAGS} | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
                IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
  ibv_cq_ex* cq = ibv_create_cq_ex(o.ctx, &ca);
  if (!cq) die("create_cq_ex with timestamps: %s", std::strerror(errno));
  CHECK(cq->read_completion_ts && cq->read_completion_wallclock_ns, "timestamp readers");
  ibv_qp_init_attr ia{};
  ia.send_cq = ibv_cq_ex_to_cq(cq);
  ia.recv_cq = ibv_cq_ex_to_cq(cq);
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 16;
  ia.cap.max_recv_wr = 16;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(o.pd, &ia);
  if (!qp) die("create_qp");
  // The peer's QP is connected to o.qp: this one replaces it on our side.
  ibv_qp* old = o.qp;
  ibv_cq* old_cq = o.cq;
  CHECK(harness::qp_to_err(old) == 0, "old QP to ERR");
  o.qp = qp;
  o.cq = ibv_cq_ex_to_cq(cq);
  if (!o.ctl.send_line("newqp " + std::to_string(qp->qp_num))) die("newqp");
  {
    std::string r;
    if (o.ctl.poll_line(&r, 30000) != 1 || r != "ok") die("peer newqp: %s", r.c_str());
  }
  if (!connect_qp(qp, o.peer)) die("connect ts qp");
  uint8_t* buf = map_buf(kLen);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) die("reg_mr");
  uint64_t last = 0;
  int monotonic_breaks = 0;
  for (int i = 0; i < 20; ++i) {
    const bool recv = i % 2 == 0;
    const uint64_t t0 = raw_clock(o.ctx), w0 = wall_ns();
    if (recv) {
      CHECK(post_recv(qp, buf, 4096, mr->lkey, 500 + i) == 0, "post_recv");
      CHECK(o.cmd("send 256 " + std::to_string(i)) == IBV_WC_SUCCESS, "peer SEND %d", i);
    } else {
      if (!o.ctl.send_line("recv 256")) die("recv");
      std::string r;
      if (o.ctl.poll_line(&r, 30000) != 1 || r != "posted") die("peer did not post");
      CHECK(post_send(qp, buf, 256, mr->lkey, 500 + i) == 0, "post_send");
    }
    uint64_t ts = 0, wall = 0;
    int st = -1;
    uint64_t wr_id = 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int rc = ENOENT;
    while ((rc = ibv_start_poll(cq, nullptr)) == ENOENT && std::chrono::steady_clock::now() < deadline) {
    }
    if (rc == 0) {
      st = cq->status;
      wr_id = cq->wr_id;
      ts = ibv_wc_read_completion_ts(cq);
      wall = ibv_wc_read_completion_wallclock_ns(cq);
      ibv_end_poll(cq);
    }
    const uint64_t t1 = raw_clock(o.ctx), w1 = wall_ns();
    if (!recv) {
      std::string r;
      if (o.ctl.poll_line(&r, 30000) != 1 || std::stoi(r) != IBV_WC_SUCCESS) CHECK(false, "peer's receive %d", i);
    }
    CHECK(rc == 0 && st == IBV_WC_SUCCESS && wr_id == uint64_t(500 + i), "completion %d: rc %d status %d", i, rc, st);
    if (recv && rc == 0 && st == IBV_WC_SUCCESS) {
      // The peer's bytes (byte i + j): the common CQ push declines a CQ
      // with timestamps, so the sender moves them on its general push.
      size_t bad = 256;
      for (size_t j = 0; j < 256 && bad == 256; ++j)
        if (buf[j] != static_cast<uint8_t>(i + j)) bad = j;
      CHECK(bad == 256, "receive %d: byte %zu is %u", i, bad, bad < 256 ? unsigned{buf[bad]} : 0u);
    }
    CHECK(ts >= t0 && ts <= t1, "%s completion %d stamped %" PRIu64 ", not in [%" PRIu64 ", %" PRIu64 "]",
          recv ? "receive" : "send", i, ts, t0, t1);
    constexpr uint64_t kSlack = 1000000;  // the two clocks are read one after the other
    CHECK(wall + kSlack >= w0 && wall <= w1 + kSlack, "wall clock %" PRIu64 " not in [%" PRIu64 ", %" PRIu64 "]", wall,
          w0, w1);
    if (ts < last) ++monotonic_breaks;
    last = ts;
  }
  CHECK(monotonic_breaks == 0, "timestamps went back %d time(s)", monotonic_breaks);
  // Two completions in one poll batch: the order of the ring, stamps not decreasing.
  CHECK(post_recv(qp, buf, 4096, mr->lkey, 600) == 0 && post_recv(qp, buf + 4096, 4096, mr->lkey, 601) == 0, "post_recv");
  CHECK(o.cmd("send 64 1") == IBV_WC_SUCCESS && o.cmd("send 64 2") == IBV_WC_SUCCESS, "two SENDs");
  {
    uint64_t a = 0, b = 0;
    int rc = ibv_start_poll(cq, nullptr);
    if (rc == 0) {
      a = ibv_wc_read_completion_ts(cq);
      rc = ibv_next_poll(cq);
      if (rc == 0) b = ibv_wc_read_completion_ts(cq);
      ibv_end_poll(cq);
    }
    CHECK(rc == 0 && a > 0 && b >= a, "batch stamps %" PRIu64 " %" PRIu64 " (rc %d)", a, b, rc);
  }
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  ::munmap(buf, kLen);
  CHECK(ibv_destroy_qp(old) == 0 && ibv_destroy_cq(old_cq) == 0, "destroy the old QP");
  std::printf("timestamps: done\n");
}

// Device memory: capacity, memcpy in and out, and a zero-based DM MR as the
// target of the peer's READ/WRITE and the source/target of our SEND/receive.
void device_memory(Owner& o) {
  ibv_device_attr_ex dx{};
  CHECK(ibv_query_device_ex(o.ctx, nullptr, &dx) == 0 && dx.max_dm_size == (256u << 10), "max_dm_size %" PRIu64,
        dx.max_dm_size);
  auto alloc = [&](size_t len, uint32_t log_align = 0, uint32_t comp_mask = 0) {
    ibv_alloc_dm_attr a{};
    a.length = len;
    a.log_align_req = log_align;
    a.comp_mask = comp_mask;
    errno = 0;
    return ibv_alloc_dm(o.ctx, &a);
  };
  CHECK(alloc(0) == nullptr && errno == EINVAL, "length 0: errno %d", errno);
  CHECK(alloc(4096, 0, 1) == nullptr && errno == EINVAL, "unknown comp_mask: errno %d", errno);
  CHECK(alloc(dx.max_dm_size + 1) == nullptr && errno == ENOMEM, "over max_dm_size: errno %d", errno);
  constexpr size_t kDm = 64 << 10;
  ibv_dm* dm = alloc(kDm, 16);
  if (!dm) die("alloc_dm: %s", std::strerror(errno));
  ibv_dm* rest = alloc(dx.max_dm_size - kDm);
  CHECK(rest != nullptr, "the rest of the capacity: %s", std::strerror(errno));
  CHECK(alloc(4096) == nullptr && errno == ENOMEM, "past the capacity: errno %d", errno);
  if (rest) CHECK(ibv_free_dm(rest) == 0, "free_dm");
  ibv_dm* again = alloc(4096);
  CHECK(again != nullptr, "capacity given back by free_dm");
  if (again) CHECK(ibv_free_dm(again) == 0, "free_dm");

  std::vector<uint8_t> pat(kDm), back(kDm);
  for (size_t i = 0; i < kDm; ++i) pat[i] = static_cast<uint8_t>(i * 13 + 7);
  CHECK(ibv_memcpy_to_dm(dm, 0, pat.data(), kDm) == 0, "memcpy_to_dm");
  CHECK(ibv_memcpy_from_dm(back.data(), dm, 0, kDm) == 0 && back == pat, "memcpy_from_dm returns what went in");
  CHECK(ibv_memcpy_to_dm(dm, kDm - 8, pat.data(), 16) == EINVAL, "memcpy_to_dm past the end");
  CHECK(ibv_memcpy_from_dm(back.data(), dm, kDm + 1, 1) == EINVAL, "memcpy_from_dm past the end");

  const unsigned acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  errno = 0;
  CHECK(ibv_reg_dm_mr(o.pd, dm, 0, 4096, acc) == nullptr && errno == EINVAL, "reg_dm_mr without ZERO_BASED");
  errno = 0;
  CHECK(ibv_reg_dm_mr(o.pd, dm, kDm - 4096, 8192, acc | IBV_ACCESS_ZERO_BASED) == nullptr && errno == EINVAL,
        "reg_dm_mr past the end");
  constexpr uint64_t kOff = 4096, kMrLen = 32 << 10;
  ibv_mr* mr = ibv_reg_dm_mr(o.pd, dm, kOff, kMrLen, acc | IBV_ACCESS_ZERO_BASED);
  if (!mr) die("reg_dm_mr: %s", std::strerror(errno));
  CHECK(mr->length == kMrLen, "mr length");
  CHECK(ibv_free_dm(dm) == EBUSY, "free_dm with an MR on it");

  // The peer's READ and WRITE at zero-based addresses.
  uint64_t h = 0;
  CHECK(o.cmd("read " + std::to_string(mr->rkey) + " 100 1000 0", &h) == IBV_WC_SUCCESS &&
            h == fnv(pat.data() + kOff + 100, 1000),
        "peer READ of DM");
  CHECK(o.cmd("write " + std::to_string(mr->rkey) + " 2000 500 119") == IBV_WC_SUCCESS, "peer WRITE into DM");
  CHECK(ibv_memcpy_from_dm(back.data(), dm, 0, kDm) == 0, "memcpy_from_dm");
  {
    std::vector<uint8_t> want = pat;
    std::memset(want.data() + kOff + 2000, 119, 500);
    CHECK(back == want, "DM after the peer's WRITE: exactly its 500 bytes changed");
    pat = want;
  }
  CHECK(o.cmd("write " + std::to_string(mr->rkey) + " " + std::to_string(kMrLen - 8) + " 16 1") ==
            IBV_WC_REM_ACCESS_ERR,
        "peer WRITE past the DM MR");
  // Our SEND from DM, our receive into DM.
  if (!o.ctl.send_line("recv 256")) die("recv");
  std::string r;
  if (o.ctl.poll_line(&r, 30000) != 1 || r != "posted") die("peer did not post");
  CHECK(post_send(o.qp, reinterpret_cast<uint8_t*>(300), 256, mr->lkey, 700) == 0, "post_send from DM");
  CHECK(poll_status(o.cq) == IBV_WC_SUCCESS, "SEND from DM");
  if (o.ctl.poll_line(&r, 30000) != 1) die("no recv reply");
  {
    int st = -1;
    uint64_t hh = 0;
    std::istringstream(r) >> st >> hh;
    CHECK(st == IBV_WC_SUCCESS && hh == fnv(pat.data() + kOff + 300, 256), "the peer received DM bytes: %d", st);
  }
  CHECK(post_recv(o.qp, reinterpret_cast<uint8_t*>(8000), 4096, mr->lkey, 701) == 0, "post_recv into DM");
  CHECK(o.cmd("send 1000 5") == IBV_WC_SUCCESS, "peer SEND into DM");
  {
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.byte_len == 1000, "receive into DM: %s",
          harness::wc_str(wc).c_str());
    CHECK(ibv_memcpy_from_dm(back.data(), dm, kOff + 8000, 1000) == 0, "memcpy_from_dm");
    bool ok = true;
    for (size_t i = 0; i < 1000; ++i) ok = ok && back[i] == static_cast<uint8_t>(5 + i);
    CHECK(ok, "the SEND's bytes in DM");
  }
  CHECK(ibv_dereg_mr(mr) == 0, "dereg DM MR");
  CHECK(ibv_free_dm(dm) == 0, "free_dm after dereg");
  std::printf("dm: done\n");
}

// On-demand paging: an ODP MR over a range with a hole that is mapped later,
// implicit ODP, ibv_advise_mr and its errors; accesses to unmapped memory
// complete with access errors and neither side crashes.
void on_demand(Owner& o) {
  ibv_device_attr_ex dx{};
  CHECK(ibv_query_device_ex(o.ctx, nullptr, &dx) == 0, "query_device_ex");
  CHECK((dx.odp_caps.general_caps & IBV_ODP_SUPPORT) && (dx.odp_caps.general_caps & IBV_ODP_SUPPORT_IMPLICIT),
        "general odp caps 0x%" PRIx64, dx.odp_caps.general_caps);
  const uint32_t rc_want = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                           IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC;
  CHECK((dx.odp_caps.per_transport_caps.rc_odp_caps & rc_want) == rc_want, "rc odp caps 0x%x",
        dx.odp_caps.per_transport_caps.rc_odp_caps);
  const size_t half = kLen / 2;
  uint8_t* buf = map_buf(kLen);
  uint8_t* hole = buf + half;
  CHECK(::munmap(hole, half) == 0, "munmap");
  std::memset(buf, 0xcc, half);
  const unsigned acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  errno = 0;
  CHECK(ibv_reg_mr(o.pd, buf, kLen, acc) == nullptr && errno == EFAULT, "non-ODP MR over a hole: errno %d", errno);
  ibv_mr* mr = ibv_reg_mr(o.pd, buf, kLen, acc | IBV_ACCESS_ON_DEMAND);
  if (!mr) die("ODP reg_mr: %s", std::strerror(errno));
  CHECK(o.write(mr->rkey, buf + 100, 1000, 0x21) == IBV_WC_SUCCESS && all_are(buf + 100, 1000, 0x21) &&
            buf[99] == 0xcc && buf[1100] == 0xcc,
        "peer WRITE into mapped ODP memory");
  CHECK(o.write(mr->rkey, hole + 10, 100, 0x22) == IBV_WC_REM_ACCESS_ERR, "peer WRITE into the hole");
  CHECK(o.read(mr->rkey, hole, 64) == IBV_WC_REM_ACCESS_ERR, "peer READ of the hole");
  CHECK(o.write(mr->rkey, buf + half - 8, 16, 0x23) == IBV_WC_REM_ACCESS_ERR, "peer WRITE across into the hole");
  // Advice.
  ibv_sge sg{reinterpret_cast<uintptr_t>(buf), static_cast<uint32_t>(half), mr->lkey};
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &sg, 1) == 0,
        "PREFETCH_WRITE (FLUSH)");
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 1) == 0, "PREFETCH");
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &sg, 1) == 0, "PREFETCH_NO_FAULT");
  ibv_sge hs{reinterpret_cast<uintptr_t>(hole), 4096, mr->lkey};
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, IBV_ADVISE_MR_FLAG_FLUSH, &hs, 1) == EFAULT,
        "PREFETCH of the hole");
  ibv_sge out{reinterpret_cast<uintptr_t>(buf) + kLen - 8, 16, mr->lkey};
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &out, 1) == EFAULT, "PREFETCH past the MR");
  CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 1u << 5, &sg, 1) == EINVAL, "unknown flag");
  CHECK(ibv_advise_mr(o.pd, static_cast<ibv_advise_mr_advice>(99), 0, &sg, 1) == EOPNOTSUPP, "unknown advice");
  CHECK(ibv_advise_mr(o.pd2, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 1) == EPERM, "MR of another PD");
  {
    uint8_t* plain_buf = map_buf(4096);
    ibv_mr* plain = ibv_reg_mr(o.pd, plain_buf, 4096, IBV_ACCESS_LOCAL_WRITE);
    ibv_sge ps{reinterpret_cast<uintptr_t>(plain_buf), 4096, plain ? plain->lkey : 0};
    CHECK(plain && ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &ps, 1) == EINVAL, "advise on a non-ODP MR");
    ibv_mr* ro = ibv_reg_mr(o.pd, plain_buf, 4096, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_REMOTE_READ);
    ibv_sge rs{reinterpret_cast<uintptr_t>(plain_buf), 4096, ro ? ro->lkey : 0};
    CHECK(ro && ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &rs, 1) == EPERM,
          "PREFETCH_WRITE of a read-only ODP MR");
    CHECK(ro && ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &rs, 1) == 0, "PREFETCH of a read-only ODP MR");
    if (ro) CHECK(ibv_dereg_mr(ro) == 0, "dereg");
    if (plain) CHECK(ibv_dereg_mr(plain) == 0, "dereg");
    ::munmap(plain_buf, 4096);
  }
  // The hole mapped later is covered by the MR.
  void* p = ::mmap(hole, half, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  CHECK(p == hole, "mmap the hole");
  CHECK(o.write(mr->rkey, hole + 10, 100, 0x24) == IBV_WC_SUCCESS && all_are(hole + 10, 100, 0x24) && hole[9] == 0,
        "peer WRITE into memory mapped after the registration");
  {
    for (size_t i = 0; i < 4096; ++i) hole[4096 + i] = static_cast<uint8_t>(i ^ 0x5a);
    uint64_t h = 0;
    CHECK(o.read(mr->rkey, hole + 4096, 4096, &h) == IBV_WC_SUCCESS && h == fnv(hole + 4096, 4096),
          "peer READ of memory mapped after the registration");
  }
  // Our own ODP memory as a SEND's source and a receive's target.
  if (!o.ctl.send_line("recv 512")) die("recv");
  std::string r;
  if (o.ctl.poll_line(&r, 30000) != 1 || r != "posted") die("peer did not post");
  CHECK(post_send(o.qp, hole + 4096, 512, mr->lkey, 800) == 0 && poll_status(o.cq) == IBV_WC_SUCCESS,
        "SEND from ODP memory");
  if (o.ctl.poll_line(&r, 30000) != 1) die("no recv reply");
  {
    int st = -1;
    uint64_t hh = 0;
    std::istringstream(r) >> st >> hh;
    CHECK(st == IBV_WC_SUCCESS && hh == fnv(hole + 4096, 512), "the peer received the ODP bytes: %d", st);
  }
  CHECK(post_recv(o.qp, hole + 16384, 4096, mr->lkey, 801) == 0, "post_recv into ODP memory");
  CHECK(o.cmd("send 700 3") == IBV_WC_SUCCESS, "peer SEND into ODP memory");
  {
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.byte_len == 700, "receive into ODP: %s",
          harness::wc_str(wc).c_str());
    bool ok = true;
    for (size_t i = 0; i < 700; ++i) ok = ok && hole[16384 + i] == static_cast<uint8_t>(3 + i);
    CHECK(ok, "the SEND's bytes in ODP memory");
  }
  // Implicit ODP: the whole address space, memory of any origin.
  ibv_mr* imr = ibv_reg_mr(o.pd, nullptr, SIZE_MAX, acc | IBV_ACCESS_ON_DEMAND);
  CHECK(imr != nullptr, "implicit ODP MR: %s", std::strerror(errno));
  if (imr) {
    uint8_t* later = map_buf(8192);
    CHECK(o.write(imr->rkey, later + 8, 64, 0x31) == IBV_WC_SUCCESS && all_are(later + 8, 64, 0x31) && later[7] == 0,
          "peer WRITE through the implicit ODP MR");
    CHECK(::munmap(later, 8192) == 0, "munmap");
    CHECK(o.write(imr->rkey, later + 8, 64, 0x32) == IBV_WC_REM_ACCESS_ERR, "peer WRITE to unmapped memory (implicit)");
    ibv_sge is{reinterpret_cast<uintptr_t>(buf), 4096, imr->lkey};
    CHECK(ibv_advise_mr(o.pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &is, 1) == 0,
          "advise on the implicit MR");
    CHECK(ibv_dereg_mr(imr) == 0, "dereg implicit");
  }
  // A local SEND from unmapped ODP memory: a local protection error.
  CHECK(::munmap(hole, half) == 0, "munmap again");
  CHECK(post_send(o.qp, hole, 64, mr->lkey, 802) == 0 && poll_status(o.cq) == IBV_WC_LOC_PROT_ERR,
        "SEND from unmapped ODP memory");
  {
    bool all_flush = false;
    drain_flushes(o.cq, &all_flush);
  }
  CHECK(reconnect(o.qp, o.peer), "reconnect after the local error");
  CHECK(ibv_dereg_mr(mr) == 0, "dereg ODP MR");
  ::munmap(buf, half);
  std::printf("odp: done\n");
}

void* test_alloc(ibv_pd*, void*, size_t, size_t, uint64_t) { return IBV_ALLOCATOR_USE_DEFAULT; }
void test_free(ibv_pd*, void*, void*, uint64_t) {}

// Parent domains: pd_context, objects created with one are objects of its
// PD (across processes), allocators refused (queues live in the shared
// segment), EBUSY for its PD.
void parent_domains(Owner& o) {
  ibv_pd* base = ibv_alloc_pd(o.ctx);
  if (!base) die("alloc_pd");
  int cookie = 0;
  ibv_parent_domain_init_attr pa{};
  pa.pd = base;
  pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS;
  pa.alloc = test_alloc;
  pa.free = test_free;
  errno = 0;
  CHECK(ibv_alloc_parent_domain(o.ctx, &pa) == nullptr && errno == EOPNOTSUPP, "allocators: errno %d", errno);
  pa = ibv_parent_domain_init_attr{};
  pa.pd = nullptr;
  errno = 0;
  CHECK(ibv_alloc_parent_domain(o.ctx, &pa) == nullptr && errno == EINVAL, "no PD: errno %d", errno);
  pa.pd = base;
  pa.comp_mask = 1u << 7;
  errno = 0;
  CHECK(ibv_alloc_parent_domain(o.ctx, &pa) == nullptr && errno == EINVAL, "unknown comp_mask: errno %d", errno);
  {
    ibv_td_init_attr ta{};
    errno = 0;
    CHECK(ibv_alloc_td(o.ctx, &ta) == nullptr && errno == EOPNOTSUPP, "thread domains: errno %d", errno);
  }
  pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT | IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS;
  pa.pd_context = &cookie;  // allocators NULL: the provider's own
  ibv_pd* pd = ibv_alloc_parent_domain(o.ctx, &pa);
  if (!pd) die("alloc_parent_domain: %s", std::strerror(errno));
  CHECK(pd->context == o.ctx, "context");
  pa.pd = pd;
  pa.comp_mask = 0;
  errno = 0;
  CHECK(ibv_alloc_parent_domain(o.ctx, &pa) == nullptr && errno == EINVAL, "parent of a parent: errno %d", errno);
  CHECK(ibv_dealloc_pd(base) == EBUSY, "dealloc_pd of a PD with a parent domain");

  ibv_cq_init_attr_ex ca{};
  ca.cqe = 32;
  ca.wc_flags = IBV_WC_STANDARD_FLAGS;
  ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  ca.parent_domain = base;  // not a parent domain
  errno = 0;
  CHECK(ibv_create_cq_ex(o.ctx, &ca) == nullptr && errno == EINVAL, "CQ with a PD as parent domain: errno %d", errno);
  ca.parent_domain = pd;
  ibv_cq_ex* cq = ibv_create_cq_ex(o.ctx, &ca);
  if (!cq) die("create_cq_ex with a parent domain: %s", std::strerror(errno));
  ibv_qp_init_attr ia{};
  ia.send_cq = ibv_cq_ex_to_cq(cq);
  ia.recv_cq = ibv_cq_ex_to_cq(cq);
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 8;
  ia.cap.max_recv_wr = 8;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = ibv_create_qp(pd, &ia);
  if (!qp) die("create_qp on a parent domain: %s", std::strerror(errno));
  CHECK(qp->pd == pd, "qp->pd");
  uint8_t* buf = map_buf(kLen);
  ibv_mr* mr = ibv_reg_mr(pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_mr* bmr = ibv_reg_mr(base, buf, kLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!mr || !bmr) die("reg_mr");
  ibv_qp* old = o.qp;
  CHECK(harness::qp_to_err(old) == 0, "old QP to ERR");
  if (!o.ctl.send_line("newqp " + std::to_string(qp->qp_num))) die("newqp");
  {
    std::string r;
    if (o.ctl.poll_line(&r, 30000) != 1 || r != "ok") die("peer newqp: %s", r.c_str());
  }
  if (!connect_qp(qp, o.peer)) die("connect");
  ibv_cq* ocq = o.cq;
  o.qp = qp;
  o.cq = ibv_cq_ex_to_cq(cq);
  std::memset(buf, 0, kLen);
  CHECK(post_recv(qp, buf, 4096, mr->lkey, 900) == 0, "post_recv");
  CHECK(o.cmd("send 2000 9") == IBV_WC_SUCCESS, "peer SEND to the parent domain's QP");
  {
    ibv_wc wc{};
    CHECK(poll_status(o.cq, &wc) == IBV_WC_SUCCESS && wc.byte_len == 2000 && wc.wr_id == 900, "receive: %s",
          harness::wc_str(wc).c_str());
    bool ok = true;
    for (size_t i = 0; i < 2000; ++i) ok = ok && buf[i] == static_cast<uint8_t>(9 + i);
    CHECK(ok, "SEND payload");
  }
  CHECK(o.write(mr->rkey, buf + 8192, 300, 0x44) == IBV_WC_SUCCESS && all_are(buf + 8192, 300, 0x44),
        "peer WRITE through an MR of the parent domain");
  CHECK(o.write(bmr->rkey, buf + 9000, 300, 0x45) == IBV_WC_SUCCESS && all_are(buf + 9000, 300, 0x45),
        "peer WRITE through an MR of its PD (the same PD)");
  // Back to the original QP for the rest of the run.
  CHECK(harness::qp_to_err(qp) == 0, "parent QP to ERR");
  o.qp = old;
  o.cq = ocq;
  if (!o.ctl.send_line("newqp " + std::to_string(old->qp_num))) die("newqp");
  {
    std::string r;
    if (o.ctl.poll_line(&r, 30000) != 1 || r != "ok") die("peer newqp: %s", r.c_str());
  }
  {
    bool all_flush = false;
    drain_flushes(ocq, &all_flush);
  }
  CHECK(reconnect(old, o.peer), "reconnect the old QP");
  CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc of a parent domain with a QP, a CQ and an MR");
  CHECK(ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(bmr) == 0, "dereg");
  CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc of a parent domain with a QP and a CQ");
  CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
  CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc of a parent domain with a CQ");
  CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)) == 0, "destroy_cq");
  {
    ibv_mw* mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    CHECK(mw && ibv_dealloc_pd(pd) == EBUSY, "dealloc of a parent domain with a window");
    if (mw) CHECK(ibv_dealloc_mw(mw) == 0, "dealloc_mw");
  }
  CHECK(ibv_dealloc_pd(pd) == 0, "dealloc the parent domain");
  CHECK(ibv_dealloc_pd(base) == 0, "dealloc its PD afterwards");
  ::munmap(buf, kLen);
  std::printf("parent: done\n");
}

int run_owner() {
  Owner o;
  std::string why;
  o.ctx = harness::open_shm0(&why);
  if (!o.ctx) die("%s", why.c_str());
  o.pd = ibv_alloc_pd(o.ctx);
  o.pd2 = ibv_alloc_pd(o.ctx);
  o.cq = ibv_create_cq(o.ctx, 64, nullptr, nullptr, 0);
  if (!o.pd || !o.pd2 || !o.cq) die("pd/cq");
  ibv_qp_init_attr ia{};
  ia.send_cq = o.cq;
  ia.recv_cq = o.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 16;
  ia.cap.max_recv_wr = 16;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  o.qp = ibv_create_qp(o.pd, &ia);
  if (!o.qp) die("create_qp");
  o.peer = harness::exchange_hello(o.ctx, o.qp);
  if (!connect_qp(o.qp, o.peer)) die("connect");
  const char* only = std::getenv("DP_CONTRACT_ONLY");
  std::string sel = only ? only : "";
  if (sel.empty() || sel == "windows") windows(o);
  if (sel.empty() || sel == "rereg") rereg(o);
  if (sel.empty() || sel == "reuse") reuse(o);
  if (sel.empty() || sel == "dm") device_memory(o);
  if (sel.empty() || sel == "odp") on_demand(o);
  if (sel.empty() || sel == "parent") parent_domains(o);
  if (sel.empty() || sel == "timestamps") timestamps(o);
  if (sel.empty() || sel == "unattended") unattended(o);
  CHECK(o.ctl.send_line("quit"), "quit");
  CHECK(ibv_destroy_qp(o.qp) == 0 && ibv_destroy_cq(o.cq) == 0, "destroy");
  CHECK(ibv_dealloc_pd(o.pd) == 0 && ibv_dealloc_pd(o.pd2) == 0, "dealloc_pd");
  CHECK(ibv_close_device(o.ctx) == 0, "close");
  std::printf("OWNER done: %d failure(s)\n", harness::check_failures);
  return harness::check_failures ? 1 : 0;
}

void run_pair(const char* only) {
  ::setenv("DP_CONTRACT_ONLY", only, 1);
  harness::Result o = harness::run_worker_pair({}, 60);
  EXPECT_NE(o.out.find("OWNER done: 0 failure(s)"), std::string::npos) << o.out;
}

TEST(Contract, WindowBindsGrantRemoteWriteOverLocalWriteMr) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("windows");
}

TEST(Contract, ReregSeenByThePeersNextOperation) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("rereg");
}

TEST(Contract, QpPairReusedAfterErr) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("reuse");
}

TEST(Contract, DeviceMemory) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("dm");
}

TEST(Contract, OnDemandPaging) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("odp");
}

TEST(Contract, ParentDomains) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("parent");
}

TEST(Contract, WaitingSendsExecuteWithoutVerbsCalls) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("unattended");
}

TEST(Contract, CompletionTimestamps) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("timestamps");
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
