// Per-port counters through the public verbs API and the `shmrdma` command:
// a known amount of traffic between two processes, then exact deltas in
// `shmrdma status --json` and in the sysfs counter files, while the QPs
// live, after they are destroyed, after the client exits cleanly and after
// the server is SIGKILLed (its context reclaimed). Once on port 1 of shm0,
// once on port 2 of a 2-port device (port 1 must not move).
//
// As a gtest it starts two workers of this executable through `shmrdma run`,
// connected by a socketpair on fd 3:
//
//   dp_counters --worker server|client --dev NAME --port N --dir DIR
//
// The client waits for files DIR/go1 and DIR/go2 between its phases and
// prints PHASE1 (traffic done, every completion checked), PHASE2 (QPs
// destroyed on both sides), then exits. The server prints IDLE after
// destroying its QPs and waits to be killed.
//
// Traffic (RC path MTU 4096; payload bytes):
//   RC SEND 10 x 100 B (1 packet each), 5 x 10000 B (3 packets each; the
//   first two of two SGEs);
//   RC RDMA WRITE 4 x 1000 B (1 packet), 3 x 9000 B (3 packets);
//   RC RDMA READ 2 x 5000 B (1-packet request, 2 response packets);
//   UD SEND 6 x 200 B: 3 delivered, 2 with no receive posted, 1 wrong Q_Key;
//   RC SEND 100 B on a second QP with no receive and rnr_retry 0: one RNR
//   NAK, then IBV_WC_RNR_RETRY_EXC_ERR;
//   RC SEND 3 x 10000 B (3 packets each; the last of two SGEs) into a third
//   QP, whose receives come from an SRQ.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;

constexpr uint32_t kQkey = 0x1234567;
constexpr size_t kBuf = 1u << 20;
constexpr uint32_t kRecvSlot = 16384;
constexpr uint32_t kRcRecvs = 15, kUdRecvs = 3, kSrqRecvs = 3;

struct Hello {
  uint32_t rc = 0, rc2 = 0, ud = 0, rc3 = 0;
  uint16_t lid = 0, pad = 0;
  uint32_t rkey = 0;
  uint64_t addr = 0;
};

ibv_context* open_dev(const std::string& name) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ibv_context* ctx = nullptr;
  for (int i = 0; list && i < n; ++i)
    if (name == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  return ctx;
}

void to_rts(ibv_qp* qp, uint32_t port, uint32_t dest, uint16_t dlid, uint8_t rnr_retry) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = static_cast<uint8_t>(port);
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE;
  REQUIRE(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), "INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dest;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 1;  // 10 us
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = static_cast<uint8_t>(port);
  REQUIRE(!ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
          "RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = rnr_retry;
  a.max_rd_atomic = 16;
  REQUIRE(!ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                             IBV_QP_MAX_QP_RD_ATOMIC),
          "RTS");
}

void ud_to_rts(ibv_qp* qp, uint32_t port) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = static_cast<uint8_t>(port);
  a.qkey = kQkey;
  REQUIRE(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY), "UD INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  REQUIRE(!ibv_modify_qp(qp, &a, IBV_QP_STATE), "UD RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  REQUIRE(!ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN), "UD RTS");
}

struct Objects {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  // The first RC QP's sends complete alone into scq, so its single SENDs
  // and WRITEs take the provider's shortest paths (a send CQ with one
  // producer), the rest the general one; both count.
  ibv_cq* scq = nullptr;
  // The third RC QP receives through srq and its sends complete alone into
  // scq3.
  ibv_cq* scq3 = nullptr;
  ibv_srq* srq = nullptr;
  ibv_qp *rc = nullptr, *rc2 = nullptr, *ud = nullptr, *rc3 = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf;

  void open(const std::string& dev) {
    ctx = open_dev(dev);
    REQUIRE(ctx, "cannot open %s", dev.c_str());
    pd = ibv_alloc_pd(ctx);
    cq = pd ? ibv_create_cq(ctx, 256, nullptr, nullptr, 0) : nullptr;
    scq = cq ? ibv_create_cq(ctx, 64, nullptr, nullptr, 0) : nullptr;
    scq3 = scq ? ibv_create_cq(ctx, 64, nullptr, nullptr, 0) : nullptr;
    REQUIRE(scq3, "pd/cq: %s", std::strerror(errno));
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = 8;
    sa.attr.max_sge = 1;
    srq = ibv_create_srq(pd, &sa);
    REQUIRE(srq, "create_srq: %s", std::strerror(errno));
    buf.assign(kBuf, 0x5a);
    mr = ibv_reg_mr(pd, buf.data(), buf.size(),
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    REQUIRE(mr, "reg_mr: %s", std::strerror(errno));
    ibv_qp_init_attr ia{};
    ia.send_cq = scq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = 64;
    ia.cap.max_recv_wr = 32;
    ia.cap.max_send_sge = 2;
    ia.cap.max_recv_sge = 1;
    rc = ibv_create_qp(pd, &ia);
    ia.send_cq = scq3;
    ia.srq = srq;
    rc3 = ibv_create_qp(pd, &ia);
    rc2 = harness::create_qp(pd, cq, IBV_QPT_RC, 64, 32);
    ud = harness::create_qp(pd, cq, IBV_QPT_UD, 64, 32);
    REQUIRE(rc && rc2 && ud && rc3, "create_qp: %s", std::strerror(errno));
  }
  void destroy_qps() {
    REQUIRE(!ibv_destroy_qp(rc) && !ibv_destroy_qp(rc2) && !ibv_destroy_qp(ud) && !ibv_destroy_qp(rc3), "destroy_qp");
    rc = rc2 = ud = rc3 = nullptr;
  }
  void close() {
    ibv_dereg_mr(mr);
    ibv_destroy_srq(srq);
    ibv_destroy_cq(scq3);
    ibv_destroy_cq(scq);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
  }
  ibv_sge sge(size_t off, uint32_t len) const { return {reinterpret_cast<uint64_t>(buf.data()) + off, len, mr->lkey}; }
  void post_recv(ibv_qp* qp, uint64_t id, size_t off) {
    ibv_sge s = sge(off, kRecvSlot);
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = id;
    wr.sg_list = &s;
    wr.num_sge = 1;
    REQUIRE(!ibv_post_recv(qp, &wr, &bad), "post_recv: %s", std::strerror(errno));
  }
  ibv_wc poll(ibv_cq* from = nullptr) {
    ibv_wc wc{};
    REQUIRE(harness::poll_one(from ? from : cq, &wc, 10000), "no completion within 10 s");
    return wc;
  }
};

void send_line(harness::LineReader& ctl, const std::string& s) { REQUIRE(ctl.send_line(s), "control channel: write"); }
std::string read_line(harness::LineReader& ctl, int ms = 30000) {
  std::string l;
  REQUIRE(ctl.poll_line(&l, ms) == 1, "control channel: no line within %d ms", ms);
  return l;
}

bool wait_file(const std::string& path, int ms) {
  auto deadline = harness::Clock::now() + harness::Ms(ms);
  while (harness::Clock::now() < deadline) {
    if (std::filesystem::exists(path)) return true;
    std::this_thread::sleep_for(harness::Ms(10));
  }
  return false;
}

int server(const std::string& dev, uint32_t port) {
  harness::LineReader ctl(harness::kCtlFd);
  Objects o;
  o.open(dev);
  ibv_port_attr pa{};
  REQUIRE(!ibv_query_port(o.ctx, static_cast<uint8_t>(port), &pa), "query_port");
  Hello h;
  h.rc = o.rc->qp_num;
  h.rc2 = o.rc2->qp_num;
  h.rc3 = o.rc3->qp_num;
  h.ud = o.ud->qp_num;
  h.lid = pa.lid;
  h.rkey = o.mr->rkey;
  h.addr = reinterpret_cast<uint64_t>(o.buf.data());
  REQUIRE(harness::write_all(harness::kCtlFd, &h, sizeof h), "hello");
  Hello c;
  REQUIRE(harness::read_all(harness::kCtlFd, &c, sizeof c, 30000), "client hello");
  to_rts(o.rc, port, c.rc, c.lid, 7);
  to_rts(o.rc2, port, c.rc2, c.lid, 7);
  to_rts(o.rc3, port, c.rc3, c.lid, 7);
  ud_to_rts(o.ud, port);
  for (uint32_t i = 0; i < kRcRecvs; ++i) o.post_recv(o.rc, i, size_t{i} * kRecvSlot);
  for (uint32_t i = 0; i < kUdRecvs; ++i) o.post_recv(o.ud, 100 + i, size_t{kRcRecvs + i} * kRecvSlot);
  for (uint32_t i = 0; i < kSrqRecvs; ++i) {
    ibv_sge sg = o.sge(size_t{kRcRecvs + kUdRecvs + i} * kRecvSlot, kRecvSlot);
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = 50 + i;
    wr.sg_list = &sg;
    wr.num_sge = 1;
    REQUIRE(!ibv_post_srq_recv(o.srq, &wr, &bad), "post_srq_recv: %s", std::strerror(errno));
  }
  send_line(ctl, "ready");
  REQUIRE(read_line(ctl) == "sent", "expected 'sent'");
  uint32_t rc_got = 0, ud_got = 0, srq_got = 0;
  while (rc_got + ud_got + srq_got < kRcRecvs + kUdRecvs + kSrqRecvs) {
    ibv_wc wc = o.poll();
    REQUIRE(wc.status == IBV_WC_SUCCESS, "server completion %s", harness::wc_str(wc).c_str());
    (wc.wr_id >= 100 ? ud_got : wc.wr_id >= 50 ? srq_got : rc_got) += 1;
  }
  REQUIRE(rc_got == kRcRecvs && ud_got == kUdRecvs && srq_got == kSrqRecvs, "server got %u RC, %u UD, %u SRQ receives",
          rc_got, ud_got, srq_got);
  ibv_wc extra{};
  REQUIRE(ibv_poll_cq(o.cq, 1, &extra) == 0, "unexpected completion %s", harness::wc_str(extra).c_str());
  {
    // The server's own traffic (its process holds counts too): one WRITE.
    ibv_sge sg = o.sge(0, 3000);
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = 7;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = c.addr;
    wr.wr.rdma.rkey = c.rkey;
    REQUIRE(!ibv_post_send(o.rc, &wr, &bad), "server post_send: %s", std::strerror(errno));
    ibv_wc wc = o.poll(o.scq);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 7, "server WRITE: %s", harness::wc_str(wc).c_str());
  }
  send_line(ctl, "recvd");
  REQUIRE(read_line(ctl, 60000) == "destroy", "expected 'destroy'");
  o.destroy_qps();
  send_line(ctl, "destroyed");
  std::printf("IDLE\n");
  for (;;) pause();  // killed by the test
}

int client(const std::string& dev, uint32_t port, const std::string& dir) {
  harness::LineReader ctl(harness::kCtlFd);
  Objects o;
  o.open(dev);
  ibv_port_attr pa{};
  REQUIRE(!ibv_query_port(o.ctx, static_cast<uint8_t>(port), &pa), "query_port");
  Hello s;
  REQUIRE(harness::read_all(harness::kCtlFd, &s, sizeof s, 30000), "server hello");
  Hello h;
  h.rc = o.rc->qp_num;
  h.rc2 = o.rc2->qp_num;
  h.rc3 = o.rc3->qp_num;
  h.ud = o.ud->qp_num;
  h.lid = pa.lid;
  h.rkey = o.mr->rkey;
  h.addr = reinterpret_cast<uint64_t>(o.buf.data());
  REQUIRE(harness::write_all(harness::kCtlFd, &h, sizeof h), "hello");
  to_rts(o.rc, port, s.rc, s.lid, 7);
  to_rts(o.rc2, port, s.rc2, s.lid, 0);  // no RNR retries
  to_rts(o.rc3, port, s.rc3, s.lid, 7);
  ud_to_rts(o.ud, port);
  REQUIRE(read_line(ctl) == "ready", "expected 'ready'");

  uint64_t id = 0;
  auto post = [&](ibv_qp* qp, ibv_wr_opcode op, uint32_t len, uint64_t roff, bool two_sges = false) {
    ibv_sge sg[2] = {o.sge(0, len), o.sge(len / 2, len - len / 2)};
    if (two_sges) sg[0].length = len / 2;
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = ++id;
    wr.opcode = op;
    wr.sg_list = sg;
    wr.num_sge = two_sges ? 2 : 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = s.addr + roff;
    wr.wr.rdma.rkey = s.rkey;
    REQUIRE(!ibv_post_send(qp, &wr, &bad), "post_send op %d: %s", op, std::strerror(errno));
    ibv_wc wc = o.poll(qp == o.rc ? o.scq : qp == o.rc3 ? o.scq3 : o.cq);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == id, "op %d len %u: %s", op, len, harness::wc_str(wc).c_str());
  };
  for (int i = 0; i < 10; ++i) post(o.rc, IBV_WR_SEND, 100, 0);
  for (int i = 0; i < 5; ++i) post(o.rc, IBV_WR_SEND, 10000, 0, i < 2);
  for (int i = 0; i < 4; ++i) post(o.rc, IBV_WR_RDMA_WRITE, 1000, 512 * 1024);
  for (int i = 0; i < 3; ++i) post(o.rc, IBV_WR_RDMA_WRITE, 9000, 512 * 1024);
  for (int i = 0; i < 2; ++i) post(o.rc, IBV_WR_RDMA_READ, 5000, 512 * 1024);
  for (int i = 0; i < 3; ++i) post(o.rc3, IBV_WR_SEND, 10000, 0, i == 2);

  ibv_ah_attr aa{};
  aa.dlid = s.lid;
  aa.port_num = static_cast<uint8_t>(port);
  ibv_ah* ah = ibv_create_ah(o.pd, &aa);
  REQUIRE(ah, "create_ah: %s", std::strerror(errno));
  for (int i = 0; i < 6; ++i) {
    ibv_sge sg = o.sge(0, 200);
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = ++id;
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = s.ud;
    wr.wr.ud.remote_qkey = i == 5 ? kQkey + 1 : kQkey;  // the last one: wrong Q_Key
    REQUIRE(!ibv_post_send(o.ud, &wr, &bad), "UD post_send: %s", std::strerror(errno));
    ibv_wc wc = o.poll();
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == id, "UD send %d: %s", i, harness::wc_str(wc).c_str());
  }
  // No receive on the server's second QP, no RNR retry.
  {
    ibv_sge sg = o.sge(0, 100);
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = ++id;
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    REQUIRE(!ibv_post_send(o.rc2, &wr, &bad), "post_send rc2: %s", std::strerror(errno));
    ibv_wc wc = o.poll();
    REQUIRE(wc.status == IBV_WC_RNR_RETRY_EXC_ERR, "RNR send: %s", harness::wc_str(wc).c_str());
  }
  send_line(ctl, "sent");
  REQUIRE(read_line(ctl) == "recvd", "expected 'recvd'");
  std::printf("PHASE1\n");
  REQUIRE(wait_file(dir + "/go1", 60000), "no go1");
  ibv_destroy_ah(ah);
  o.destroy_qps();
  send_line(ctl, "destroy");
  REQUIRE(read_line(ctl) == "destroyed", "expected 'destroyed'");
  std::printf("PHASE2\n");
  REQUIRE(wait_file(dir + "/go2", 60000), "no go2");
  o.close();
  std::printf("CLOSED\n");
  return 0;
}

// ------------------------------------------------------------------ checks

using Counts = std::map<std::string, uint64_t>;  // "counters/x" and "hw_counters/y"

// The counters of (dev, port) in `shmrdma status --json`.
bool status_counts(const std::string& dev, uint32_t port, Counts* out) {
  nlohmann::json st = harness::Home::get().status();
  if (!st.is_object()) return false;
  for (const auto& d : st["devices"]) {
    if (d.value("name", "") != dev) continue;
    for (const auto& p : d["ports"]) {
      if (p.value("port", 0u) != port) continue;
      if (!p.contains("counters") || !p.contains("hw_counters")) {
        ADD_FAILURE() << "no counters for " << dev << " port " << port << ":\n" << p.dump(2);
        return false;
      }
      out->clear();
      for (const char* kind : {"counters", "hw_counters"})
        for (const auto& [k, v] : p[kind].items()) (*out)[std::string(kind) + "/" + k] = v.get<uint64_t>();
      return true;
    }
  }
  ADD_FAILURE() << "device " << dev << " port " << port << " not in status:\n" << st.dump(2);
  return false;
}

// The sysfs files (refreshed by the status call just before) agree with it.
void check_sysfs(const std::string& dev, uint32_t port, const Counts& c) {
  std::string base = harness::getenv_str("SYSFS_PATH") + "/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/";
  for (const auto& [k, v] : c) {
    std::ifstream f(base + k);
    uint64_t got = 0;
    ASSERT_TRUE(f >> got) << "cannot read " << base + k;
    EXPECT_EQ(got, v) << base + k;
  }
  for (const char* must : {"counters/port_xmit_data", "counters/port_rcv_data", "counters/port_xmit_packets",
                           "counters/port_rcv_packets", "counters/symbol_error", "counters/VL15_dropped",
                           "counters/unicast_xmit_packets", "counters/multicast_rcv_packets", "hw_counters/sent_pkts",
                           "hw_counters/rcvd_rnr_err", "hw_counters/retry_exceeded_err", "hw_counters/lifespan"})
    EXPECT_TRUE(c.count(must)) << must << " missing";
  EXPECT_EQ(c.at("counters/port_xmit_data"), c.at("hw_counters/sent_bytes") / 4);
  EXPECT_EQ(c.at("counters/port_rcv_data"), c.at("hw_counters/rcvd_bytes") / 4);
}

// What the traffic above adds to its port (both processes are on it).
Counts expected_delta() {
  // SENDs, WRITEs, READ requests + responses, UD; the server's WRITE.
  const uint64_t pkts = 10 + 15 + 4 + 9 + 2 + 4 + 6 + 1 + 9;
  const uint64_t bytes = 1000 + 50000 + 4000 + 27000 + 0 + 10000 + 1200 + 3000 + 30000;
  return {
      {"counters/port_xmit_packets", pkts},  {"counters/port_rcv_packets", pkts},
      {"counters/unicast_xmit_packets", pkts}, {"counters/unicast_rcv_packets", pkts},
      {"counters/multicast_xmit_packets", 0}, {"counters/multicast_rcv_packets", 0},
      {"hw_counters/sent_pkts", pkts},       {"hw_counters/rcvd_pkts", pkts},
      {"hw_counters/sent_bytes", bytes},     {"hw_counters/rcvd_bytes", bytes},
      {"hw_counters/rdma_sends", 10 + 5 + 6 + 3}, {"hw_counters/rdma_recvs", kRcRecvs + kUdRecvs + kSrqRecvs},
      {"hw_counters/rcvd_ud_dropped", 2},    {"hw_counters/rcvd_ud_invalid", 1},
      {"hw_counters/rcvd_rnr_err", 1},       {"hw_counters/send_rnr_err", 1},
      {"hw_counters/retry_rnr_exceeded_err", 1}, {"hw_counters/retry_exceeded_err", 0},
      {"hw_counters/send_err", 1},           {"counters/link_downed", 0},
      {"counters/symbol_error", 0},          {"counters/port_xmit_discards", 0},
  };
}

void expect_delta(const Counts& before, const Counts& now, const Counts& want, const std::string& when) {
  for (const auto& [k, v] : want) {
    ASSERT_TRUE(before.count(k) && now.count(k)) << k << " missing (" << when << ")";
    EXPECT_EQ(now.at(k) - before.at(k), v) << k << " " << when << ": before " << before.at(k) << ", now " << now.at(k);
  }
}

void expect_unchanged(const Counts& before, const Counts& now, const std::string& when) {
  for (const auto& [k, v] : before) EXPECT_EQ(now.count(k) ? now.at(k) : ~0ull, v) << k << " " << when;
}

// client_exits: the client closes its device and exits, then the server is
// SIGKILLed; otherwise both are SIGKILLed (client first).
void run_pair(const std::string& dev, uint32_t port, uint32_t nports, bool client_exits) {
  auto& home = harness::Home::get();
  char tmpl[] = "/tmp/shmrdma-dpcnt-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<Counts> before(nports + 1);
  for (uint32_t p = 1; p <= nports; ++p) ASSERT_TRUE(status_counts(dev, p, &before[p]));

  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const std::string exe = harness::self_exe(), ps = std::to_string(port);
  harness::Child server, client;
  ASSERT_TRUE(server.start(home.run_argv({exe, "--worker", "server", "--dev", dev, "--port", ps, "--dir", dir}), {.fd3 = sv[0]}));
  ASSERT_TRUE(client.start(home.run_argv({exe, "--worker", "client", "--dev", dev, "--port", ps, "--dir", dir}), {.fd3 = sv[1]}));
  ::close(sv[0]);
  ::close(sv[1]);
  auto deadline = harness::Clock::now() + std::chrono::seconds(60);
  auto dump = [&] { return "--- server ---\n" + server.output() + "--- client ---\n" + client.output(); };
  ASSERT_TRUE(client.wait_output("PHASE1", deadline)) << dump();

  const Counts want = expected_delta();
  auto check_all = [&](const std::string& when) {
    for (uint32_t p = 1; p <= nports; ++p) {
      Counts now;
      ASSERT_TRUE(status_counts(dev, p, &now)) << when;
      if (p == port)
        expect_delta(before[p], now, want, when);
      else
        expect_unchanged(before[p], now, when + " (the other port)");
      check_sysfs(dev, p, now);
    }
  };
  check_all("while the QPs live");
  std::ofstream(dir + "/go1").put('1');
  ASSERT_TRUE(client.wait_output("PHASE2", deadline)) << dump();
  ASSERT_TRUE(server.wait_output("IDLE", deadline)) << dump();
  check_all("after both sides destroyed their QPs");
  if (client_exits) {
    std::ofstream(dir + "/go2").put('1');
    harness::Result c = client.wait(deadline);
    EXPECT_TRUE(c.ok()) << c.describe() << dump();
    check_all("after the client closed its device and exited");
  } else {
    client.kill(SIGKILL);
    check_all("after the client was SIGKILLed (its context reclaimed)");
  }
  server.kill(SIGKILL);
  check_all("after the server was SIGKILLed (its context reclaimed)");
  nlohmann::json st = home.status();
  for (const auto& d : st["devices"])
    if (d.value("name", "") == dev) {
      EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
    }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST(Counters, Port1TrafficIsCountedAndSurvivesDestroyExitAndKill) {
  HARNESS_REQUIRE_DEVICE();
  run_pair("shm0", 1, 1, true);
}

TEST(Counters, Port2TrafficIsCountedOnPort2) {
  HARNESS_REQUIRE_DEVICE();
  auto& home = harness::Home::get();
  harness::Result up = home.shmrdma({"up", "--name", "shm2p", "--ports", "2"});
  ASSERT_TRUE(up.ok()) << up.describe();
  run_pair("shm2p", 2, 2, false);
  harness::Result down = home.shmrdma({"down", "--name", "shm2p", "--force"});
  EXPECT_TRUE(down.ok()) << down.describe();
}

TEST(Counters, PortDownCountsLinkDowned) {
  HARNESS_REQUIRE_DEVICE();
  auto& home = harness::Home::get();
  Counts before, now;
  ASSERT_TRUE(status_counts("shm0", 1, &before));
  ASSERT_TRUE(home.shmrdma({"port", "down"}).ok());
  ASSERT_TRUE(home.shmrdma({"port", "down"}).ok());  // already down: no second event
  ASSERT_TRUE(home.shmrdma({"port", "up"}).ok());
  ASSERT_TRUE(status_counts("shm0", 1, &now));
  EXPECT_EQ(now.at("counters/link_downed") - before.at("counters/link_downed"), 1u);
  EXPECT_EQ(now.at("hw_counters/link_downed") - before.at("hw_counters/link_downed"), 1u);
  // `shmrdma counters --json` reads the same numbers.
  harness::Result r = home.shmrdma({"counters", "--name", "shm0", "--json"});
  ASSERT_TRUE(r.ok()) << r.describe();
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["devices"][0]["ports"][0]["counters"]["link_downed"].get<uint64_t>(), now.at("counters/link_downed"));
}

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string role = argv[2], dev = "shm0", dir;
    uint32_t port = 1;
    for (int i = 3; i + 1 < argc; i += 2) {
      std::string k = argv[i];
      if (k == "--dev") dev = argv[i + 1];
      if (k == "--port") port = static_cast<uint32_t>(std::stoul(argv[i + 1]));
      if (k == "--dir") dir = argv[i + 1];
    }
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    ::signal(SIGPIPE, SIG_IGN);
    return role == "server" ? server(dev, port) : client(dev, port, dir);
  }
  return harness::run_tests_as_root(argc, argv);
}
