// Multicast on UD QPs through the public verbs API: members in separate
// processes (this binary run as `dp_mcast --member NAME EXPECT` through
// `shmrdma run`) attach to a group; a sender in the test process sends to the
// group's MLID/MGID and every attached QP receives each message exactly once,
// byte for byte, with a GRH. A QP that is not attached (or detached) gets
// nothing, the sender gets its own messages only while it is attached
// (hardware loopback), and the attach/detach errors are the documented ones.
#include <infiniband/verbs.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"

namespace {

constexpr uint16_t kMlid = 0xc001;
constexpr uint32_t kQkey = 0x11111111;
constexpr uint32_t kMsgLen = 512;
constexpr uint32_t kSlots = 16;

ibv_gid group_gid() {
  ibv_gid g{};
  g.raw[0] = 0xff;
  g.raw[1] = 0x0e;
  g.raw[15] = 0x42;
  return g;
}

uint8_t pattern(uint32_t seq, uint32_t i) { return static_cast<uint8_t>(seq * 31 + i * 7 + 1); }

// One process's verbs objects: a UD QP in RTS with receives posted.
struct Ud {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf;
  std::string err;

  bool open() {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (!list || n < 1) return fail("no device");
    ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    if (!ctx) return fail("ibv_open_device");
    pd = ibv_alloc_pd(ctx);
    cq = pd ? ibv_create_cq(ctx, 64, nullptr, nullptr, 0) : nullptr;
    if (!cq) return fail("pd/cq");
    buf.assign(size_t{kSlots} * (kMsgLen + 40), 0);
    mr = ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
    if (!mr) return fail("reg_mr");
    qp = harness::create_qp(pd, cq, IBV_QPT_UD, 16, kSlots);
    if (!qp) return fail("create_qp");
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qkey = kQkey;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY)) return fail("INIT");
    a = {};
    a.qp_state = IBV_QPS_RTR;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE)) return fail("RTR");
    a = {};
    a.qp_state = IBV_QPS_RTS;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) return fail("RTS");
    for (uint32_t i = 0; i < kSlots; ++i)
      if (!post_recv(i)) return fail("post_recv");
    return true;
  }
  bool post_recv(uint32_t slot) {
    ibv_sge sge{reinterpret_cast<uint64_t>(buf.data()) + uint64_t{slot} * (kMsgLen + 40), kMsgLen + 40, mr->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return ibv_post_recv(qp, &wr, &bad) == 0;
  }
  bool fail(const char* what) {
    err = std::string(what) + ": " + std::strerror(errno);
    return false;
  }
  // Receives for `ms`: every message is checked; returns how many arrived
  // (-1 on a bad one, with err set).
  int receive(int ms, uint32_t sender_qpn, uint32_t* seq_sum) {
    int got = 0;
    auto deadline = harness::Clock::now() + harness::Ms(ms);
    while (harness::Clock::now() < deadline) {
      ibv_wc wc{};
      int n = ibv_poll_cq(cq, 1, &wc);
      if (n < 0) return fail("poll_cq"), -1;
      if (n == 0) continue;
      if (wc.opcode & IBV_WC_RECV) {
        if (wc.status != IBV_WC_SUCCESS) return err = "recv status " + std::to_string(wc.status), -1;
        if (!(wc.wc_flags & IBV_WC_GRH)) return err = "no IBV_WC_GRH", -1;
        if (wc.byte_len != kMsgLen + 40) return err = "byte_len " + std::to_string(wc.byte_len), -1;
        if (sender_qpn && wc.src_qp != sender_qpn) return err = "src_qp " + std::to_string(wc.src_qp), -1;
        const uint8_t* m = buf.data() + wc.wr_id * (kMsgLen + 40);
        ibv_gid g = group_gid();
        if (std::memcmp(m + 24, g.raw, 16) != 0) return err = "GRH dgid is not the group", -1;
        uint32_t seq = 0;
        std::memcpy(&seq, m + 40, 4);
        for (uint32_t i = 4; i < kMsgLen; ++i)
          if (m[40 + i] != pattern(seq, i)) return err = "payload byte " + std::to_string(i) + " differs", -1;
        *seq_sum += seq;
        ++got;
        if (!post_recv(static_cast<uint32_t>(wc.wr_id))) return fail("post_recv"), -1;
      }
    }
    return got;
  }
  ~Ud() {
    if (qp) ibv_destroy_qp(qp);
    if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
  }
};

// Child: attach (unless mode is "detached": attach then detach), tell the
// parent through a file, and count what arrives within 3 s.
int member_main(const std::string& dir, const std::string& name, const std::string& mode) {
  Ud u;
  if (!u.open()) {
    std::printf("member %s: %s\n", name.c_str(), u.err.c_str());
    return 2;
  }
  ibv_gid g = group_gid();
  if (ibv_attach_mcast(u.qp, &g, kMlid)) {
    std::printf("member %s: attach: %s\n", name.c_str(), std::strerror(errno));
    return 2;
  }
  if (mode == "detached" && ibv_detach_mcast(u.qp, &g, kMlid)) {
    std::printf("member %s: detach: %s\n", name.c_str(), std::strerror(errno));
    return 2;
  }
  { std::ofstream(dir + "/ready-" + name) << "1"; }
  // Receive until the parent says it is done (or 30 s), then 200 ms more.
  uint32_t sum = 0;
  int got = 0;
  auto deadline = harness::Clock::now() + harness::Ms(30000);
  bool done = false;
  while (!done && harness::Clock::now() < deadline) {
    done = std::filesystem::exists(dir + "/done");
    int n = u.receive(done ? 200 : 20, 0, &sum);
    if (n < 0) {
      std::printf("member %s: %s\n", name.c_str(), u.err.c_str());
      return 3;
    }
    got += n;
  }
  std::printf("RECEIVED %d SUM %u\n", got, sum);
  return 0;
}

bool send_to_group(Ud& s, ibv_ah* ah, uint32_t seq) {
  uint8_t* m = s.buf.data();  // slot 0 of the sender's buffer doubles as the send buffer
  std::memcpy(m, &seq, 4);
  for (uint32_t i = 4; i < kMsgLen; ++i) m[i] = pattern(seq, i);
  ibv_sge sge{reinterpret_cast<uint64_t>(m), kMsgLen, s.mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = seq;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = 0xffffff;
  wr.wr.ud.remote_qkey = kQkey;
  if (ibv_post_send(s.qp, &wr, &bad)) return false;
  auto deadline = harness::Clock::now() + harness::Ms(5000);
  while (harness::Clock::now() < deadline) {
    ibv_wc wc{};
    int n = ibv_poll_cq(s.cq, 1, &wc);
    if (n < 0) return false;
    if (n == 1 && !(wc.opcode & IBV_WC_RECV)) return wc.status == IBV_WC_SUCCESS && wc.wr_id == seq;
    if (n == 1) {
      ADD_FAILURE() << "the sender received while polling for its send";  // loopback phase polls elsewhere
      return false;
    }
  }
  return false;
}

// Attached: the send completes and the sender's own QP receives it.
bool send_to_group_loopback(Ud& s, ibv_ah* ah, uint32_t seq) {
  uint8_t* m = s.buf.data() + size_t{kSlots - 1} * (kMsgLen + 40);  // the last slot: receives use the others
  std::memcpy(m, &seq, 4);
  for (uint32_t i = 4; i < kMsgLen; ++i) m[i] = pattern(seq, i);
  ibv_sge sge{reinterpret_cast<uint64_t>(m), kMsgLen, s.mr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = seq;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = 0xffffff;
  wr.wr.ud.remote_qkey = kQkey;
  if (ibv_post_send(s.qp, &wr, &bad)) return false;
  bool sent = false, got = false;
  auto deadline = harness::Clock::now() + harness::Ms(5000);
  while (!(sent && got) && harness::Clock::now() < deadline) {
    ibv_wc wc{};
    int n = ibv_poll_cq(s.cq, 1, &wc);
    if (n < 0) return false;
    if (n == 0) continue;
    if (wc.status != IBV_WC_SUCCESS) return false;
    if (!(wc.opcode & IBV_WC_RECV)) {
      sent = wc.wr_id == seq;
      continue;
    }
    const uint8_t* r = s.buf.data() + wc.wr_id * (kMsgLen + 40) + 40;
    if (wc.src_qp != s.qp->qp_num || std::memcmp(r, m, kMsgLen) != 0) return false;
    got = true;
  }
  return sent && got;
}

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

TEST(Multicast, EveryAttachedQpInEveryProcessGetsEachMessageOnce) {
  HARNESS_REQUIRE_DEVICE();
  auto& home = harness::Home::get();
  std::string dir = home.path() + "/mcast";
  std::filesystem::create_directories(dir);
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  harness::Child a, b, gone;
  ASSERT_TRUE(a.start(home.run_argv({self, "--member", dir, "a", "attached"})));
  ASSERT_TRUE(b.start(home.run_argv({self, "--member", dir, "b", "attached"})));
  ASSERT_TRUE(gone.start(home.run_argv({self, "--member", dir, "c", "detached"})));
  auto deadline = harness::Clock::now() + harness::Ms(20000);
  while (harness::Clock::now() < deadline && !(std::filesystem::exists(dir + "/ready-a") &&
                                          std::filesystem::exists(dir + "/ready-b") &&
                                          std::filesystem::exists(dir + "/ready-c")))
    std::this_thread::sleep_for(harness::Ms(10));
  ASSERT_TRUE(std::filesystem::exists(dir + "/ready-a") && std::filesystem::exists(dir + "/ready-b") &&
              std::filesystem::exists(dir + "/ready-c"))
      << a.output() << b.output() << gone.output();

  Ud s;
  ASSERT_TRUE(s.open()) << s.err;
  ibv_port_attr pa{};
  ASSERT_EQ(ibv_query_port(s.ctx, 1, &pa), 0);
  ibv_ah_attr aa{};
  aa.dlid = kMlid;
  aa.port_num = 1;
  aa.is_global = 1;
  aa.grh.dgid = group_gid();
  aa.grh.hop_limit = 1;
  ibv_ah* ah = ibv_create_ah(s.pd, &aa);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);
  // Phase 1: the sender is not attached: only the members get the messages.
  uint32_t expect_sum = 0;
  for (uint32_t seq = 1; seq <= 10; ++seq) {
    ASSERT_TRUE(send_to_group(s, ah, seq)) << "send " << seq;
    expect_sum += seq;
  }
  uint32_t own = 0;
  EXPECT_EQ(s.receive(200, 0, &own), 0) << "an unattached sender received its own multicast " << s.err;
  // Phase 2: attached, the sender receives its own messages too.
  ibv_gid g = group_gid();
  ASSERT_EQ(ibv_attach_mcast(s.qp, &g, kMlid), 0);
  ASSERT_EQ(ibv_attach_mcast(s.qp, &g, kMlid), 0) << "attaching twice is not an error";
  ASSERT_TRUE(send_to_group_loopback(s, ah, 11));
  expect_sum += 11;
  ASSERT_EQ(ibv_detach_mcast(s.qp, &g, kMlid), 0);
  EXPECT_EQ(ibv_detach_mcast(s.qp, &g, kMlid), EINVAL) << "detaching a QP that is not attached";
  { std::ofstream(dir + "/done") << "1"; }

  for (auto* c : {&a, &b}) {
    harness::Result r = c->wait(harness::Clock::now() + harness::Ms(20000));
    ASSERT_TRUE(r.ok()) << r.describe();
    EXPECT_NE(r.out.find("RECEIVED 11 SUM " + std::to_string(expect_sum)), std::string::npos) << r.out;
  }
  harness::Result r = gone.wait(harness::Clock::now() + harness::Ms(20000));
  ASSERT_TRUE(r.ok()) << r.describe();
  EXPECT_NE(r.out.find("RECEIVED 0 SUM 0"), std::string::npos) << "a detached QP received:\n" << r.out;
  EXPECT_EQ(ibv_destroy_ah(ah), 0);
}

TEST(Multicast, AttachErrors) {
  HARNESS_REQUIRE_DEVICE();
  Ud u;
  ASSERT_TRUE(u.open()) << u.err;
  ibv_gid g = group_gid();
  ibv_gid unicast{};
  unicast.raw[0] = 0xfe;
  unicast.raw[1] = 0x80;
  EXPECT_EQ(ibv_attach_mcast(u.qp, &unicast, kMlid), EINVAL) << "not a multicast GID";
  EXPECT_EQ(ibv_attach_mcast(u.qp, &g, 0x0001), EINVAL) << "a unicast LID";
  EXPECT_EQ(ibv_attach_mcast(u.qp, &g, 0xffff), EINVAL) << "the permissive LID";
  EXPECT_EQ(ibv_detach_mcast(u.qp, &g, kMlid), EINVAL) << "never attached";
  // Only UD QPs join groups.
  ibv_qp_init_attr ia{};
  ia.send_cq = u.cq;
  ia.recv_cq = u.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 1;
  ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* rc = ibv_create_qp(u.pd, &ia);
  ASSERT_NE(rc, nullptr);
  EXPECT_EQ(ibv_attach_mcast(rc, &g, kMlid), EINVAL);
  EXPECT_EQ(ibv_destroy_qp(rc), 0);
  // query_device advertises the limits.
  ibv_device_attr da{};
  ASSERT_EQ(ibv_query_device(u.ctx, &da), 0);
  EXPECT_GT(da.max_mcast_grp, 0);
  EXPECT_GT(da.max_mcast_qp_attach, 0);
  EXPECT_GE(da.max_total_mcast_qp_attach, da.max_mcast_qp_attach);
  // A QP destroyed while attached leaves the group.
  EXPECT_EQ(ibv_attach_mcast(u.qp, &g, kMlid), 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--member") return member_main(argv[2], argv[3], argv[4]);
  return harness::run_tests_as_root(argc, argv);
}
