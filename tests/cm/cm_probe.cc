// cm_probe: our own two-process RDMA CM checks through the stock librdmacm
// (run under `shmrdma run`, as the stock tools are). Every line it prints is
// something the test (cm_test.cc) looks for; it exits 0 only when what it
// was asked to check held.
//
//   cm_probe server ADDR PORT accept|reject|hold
//       accept: accept with private data "srv-hello", check the client's
//               private data, receive 4096 bytes and send them back (byte
//               for byte), print ESTABLISHED and DISCONNECTED as they come.
//       reject: reject with private data "no-thanks".
//       hold:   print REQUEST and never answer; exit 0 on REJECTED (the
//               client went away) or get killed by a fault test.
//       wait:   print REQUEST, accept once a line comes on stdin; print
//               ACCEPT-FAILED <errno> if that fails, exit 0 on REJECTED.
//   cm_probe client ADDR PORT EXPECTED_EVENT
//       connect with private data "cli-hello"; print every event as
//       "EVENT <name> <status> <ms since connect>" (and the peer's private
//       data); on ESTABLISHED send a pattern and check the echo; exit 0 once
//       EXPECTED_EVENT came (within 10 s).
//       timewait: as accept, then after DISCONNECTED and its own
//               rdma_disconnect wait for TIMEWAIT_EXIT (print it, exit 0).
//     ADDR "ib-any": bind the AF_IB wildcard with the TCP port space's
//       service id for PORT (an AF_IB listener); its connection requests
//       must carry AF_IB addresses (prints AF_IB-REQUEST).
//   cm_probe client ADDR PORT TIMEWAIT-EXIT: as DISCONNECT-SELF, then wait
//       for TIMEWAIT_EXIT after the DISCONNECTED.
//   cm_probe errors ADDR      bad input, options and readiness, in-process.
//   cm_probe afib ADDR        the AF_IB command set (librdmacm's probe chose
//       it), QUERY's options and the path record, in-process.
//   cm_probe nochannel        rdma_create_event_channel must fail ENOENT.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <infiniband/ib.h>
#include <rdma/rdma_cma.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <rdma/rdma_verbs.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The ucma ABI (rdma/rdma_user_cm.h, which cannot be included beside
// rdma_cma.h): the few commands the bad-input checks write themselves.
enum : uint32_t {
  kCmdCreateId = 0,
  kCmdDestroyId = 1,
  kCmdQueryRoute = 5,
  kCmdGetOption = 13,
  kCmdQuery = 19,
  kCmdBind = 20,
  kCmdJoinMcast = 22
};
enum : uint32_t { kQueryAddr = 0, kQueryPath = 1, kQueryGid = 2 };
struct rdma_ucm_cmd_hdr {
  uint32_t cmd;
  uint16_t in, out;
};
struct rdma_ucm_create_id {
  uint64_t uid, response;
  uint16_t ps;
  uint8_t qp_type, reserved[5];
};
struct rdma_ucm_create_id_resp {
  uint32_t id;
};
struct rdma_ucm_destroy_id {
  uint64_t response;
  uint32_t id, reserved;
};
struct rdma_ucm_destroy_id_resp {
  uint32_t events_reported;
};
struct rdma_ucm_query {
  uint64_t response;
  uint32_t id, option;
};
struct rdma_ucm_query_route_resp {
  uint8_t bytes[512];  // bigger than the real one (232 bytes)
};
struct ib_user_path_rec {  // rdma/ib_user_sa.h
  uint8_t dgid[16], sgid[16];
  uint16_t dlid, slid;
  uint32_t raw_traffic, flow_label, reversible, mtu;
  uint16_t pkey;
  uint8_t hop_limit, traffic_class, numb_path, sl, mtu_selector, rate_selector, rate, packet_life_time_selector,
      packet_life_time, preference;
};
struct rdma_ucm_query_route_resp_real {
  uint64_t node_guid;
  ib_user_path_rec ib_route[2];
  sockaddr_in6 src_addr, dst_addr;
  uint32_t num_paths;
  uint8_t port_num, reserved[3];
  uint32_t ibdev_index, reserved1;
};
struct rdma_ucm_query_addr_resp {
  uint64_t node_guid;
  uint8_t port_num, reserved;
  uint16_t pkey, src_size, dst_size;
  sockaddr_storage src_addr, dst_addr;
  uint32_t ibdev_index, reserved1;
};
struct rdma_ucm_bind {
  uint32_t id;
  uint16_t addr_size, reserved;
  sockaddr_storage addr;
};
struct rdma_ucm_join_mcast {
  uint64_t response, uid;
  uint32_t id;
  uint16_t addr_size, join_flags;
  sockaddr_storage addr;
};
struct rdma_ucm_resolve_addr {
  uint32_t id, timeout_ms;
  uint16_t src_size, dst_size;
  uint32_t reserved;
  sockaddr_storage src_addr, dst_addr;
};
struct rdma_ucm_resolve_route {
  uint32_t id, timeout_ms;
};
struct rdma_ucm_get_event {
  uint64_t response;
};
struct rdma_ucm_event_head {  // the start of rdma_ucm_event_resp
  uint64_t uid;
  uint32_t id, event, status;
  uint8_t rest[512];
};
struct ib_path_rec_data {  // rdma/ib_user_sa.h; path_rec: the SA PathRecord (infiniband/sa.h ibv_path_record)
  uint32_t flags, reserved;
  uint8_t path_rec[64];
};
static_assert(sizeof(ib_user_path_rec) == 64 && sizeof(rdma_ucm_query_route_resp_real) == 208);
static_assert(sizeof(rdma_ucm_resolve_addr) == 272 && sizeof(ib_path_rec_data) == 72);
static_assert(sizeof(rdma_ucm_query_addr_resp) == 280 && sizeof(rdma_ucm_bind) == 136);
static_assert(sizeof(rdma_ucm_create_id) == 24 && sizeof(rdma_ucm_destroy_id) == 16 && sizeof(rdma_ucm_query) == 16);

int64_t now_ms() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

[[noreturn]] void die(const char* what) {
  std::printf("FAIL %s: %s\n", what, std::strerror(errno));
  std::fflush(stdout);
  std::exit(1);
}

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL %s (errno %d %s)\n", what.c_str(), errno, std::strerror(errno));
    std::fflush(stdout);
    std::exit(1);
  }
  std::printf("ok %s\n", what.c_str());
  std::fflush(stdout);
}

sockaddr_storage addr_of(const char* ip, int port) {
  sockaddr_storage ss{};
  auto* a4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, ip, &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<uint16_t>(port));
  } else if (inet_pton(AF_INET6, ip, &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    std::printf("FAIL bad address %s\n", ip);
    std::exit(2);
  }
  return ss;
}

// The AF_IB wildcard with the TCP port space's service id for port (the
// address librdmacm's AF_IB probe binds, with a port).
sockaddr_storage ib_wildcard(int port) {
  sockaddr_storage ss{};
  auto* ib = reinterpret_cast<sockaddr_ib*>(&ss);
  ib->sib_family = AF_IB;
  ib->sib_pkey = htobe16(0xffff);
  ib->sib_sid = htobe64(0x01060000ull | static_cast<uint64_t>(port));
  ib->sib_sid_mask = htobe64(port ? ~0ull : 0xFFFFFFFFFFFF0000ull);
  return ss;
}

// An AF_IB address naming a GID: ::ffff:a.b.c.d for an IPv4 address.
sockaddr_storage ib_gid_of(const char* ip, uint16_t pkey) {
  sockaddr_storage ss{};
  auto* ib = reinterpret_cast<sockaddr_ib*>(&ss);
  ib->sib_family = AF_IB;
  ib->sib_pkey = htobe16(pkey);
  ib->sib_addr.sib_addr32[2] = htobe32(0xffff);
  if (inet_pton(AF_INET, ip, &ib->sib_addr.sib_addr32[3]) != 1) {
    std::printf("FAIL bad address %s\n", ip);
    std::exit(2);
  }
  return ss;
}

// Waits (poll on the channel fd, then rdma_get_cm_event) up to ms.
rdma_cm_event* next_event(rdma_event_channel* ch, int ms) {
  pollfd p{ch->fd, POLLIN, 0};
  if (::poll(&p, 1, ms) != 1) return nullptr;
  rdma_cm_event* ev = nullptr;
  if (rdma_get_cm_event(ch, &ev) != 0) die("rdma_get_cm_event");
  return ev;
}

constexpr size_t kMsg = 4096;

// One registration, two halves: receives land in rx, the client sends from
// tx. A receive is posted before the connect, so the peer's echo may arrive
// at any time after the client's SEND completes; it must not land in memory
// the client is still writing.
struct Conn {
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(2 * kMsg);
  uint8_t* rx() { return buf.data(); }
  uint8_t* tx() { return buf.data() + kMsg; }
};

void make_qp(rdma_cm_id* id, Conn* c) {
  ibv_qp_init_attr qa{};
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = qa.cap.max_recv_wr = 4;
  qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
  qa.sq_sig_all = 1;
  if (rdma_create_qp(id, nullptr, &qa) != 0) die("rdma_create_qp");
  c->mr = rdma_reg_msgs(id, c->buf.data(), c->buf.size());
  if (!c->mr) die("rdma_reg_msgs");
}

bool wait_wc(ibv_cq* cq, ibv_wc* wc, int ms) {
  const int64_t until = now_ms() + ms;
  while (now_ms() < until) {
    int n = ibv_poll_cq(cq, 1, wc);
    if (n < 0) return false;
    if (n == 1) return wc->status == IBV_WC_SUCCESS;
  }
  return false;
}

void print_event(rdma_cm_event* ev, int64_t t0) {
  std::printf("EVENT %s %d %lld", rdma_event_str(ev->event), ev->status, static_cast<long long>(now_ms() - t0));
  const void* pd = ev->param.conn.private_data;
  const uint8_t len = ev->param.conn.private_data_len;
  if (pd && len) std::printf(" pd=%.*s pdlen=%u", static_cast<int>(strnlen(static_cast<const char*>(pd), len)),
                             static_cast<const char*>(pd), len);
  std::printf("\n");
  std::fflush(stdout);
}

int server(const char* ip, int port, const std::string& mode) {
  rdma_event_channel* ch = rdma_create_event_channel();
  if (!ch) die("rdma_create_event_channel");
  rdma_cm_id* listen = nullptr;
  if (rdma_create_id(ch, &listen, nullptr, RDMA_PS_TCP)) die("rdma_create_id");
  const bool ib_any = std::strcmp(ip, "ib-any") == 0;
  sockaddr_storage a = ib_any ? ib_wildcard(port) : addr_of(ip, port);
  if (rdma_bind_addr(listen, reinterpret_cast<sockaddr*>(&a))) die("rdma_bind_addr");
  if (rdma_listen(listen, 4)) die("rdma_listen");
  std::printf("LISTENING\n");
  std::fflush(stdout);
  const int64_t t0 = now_ms();
  Conn c;
  rdma_cm_id* id = nullptr;
  for (;;) {
    rdma_cm_event* ev = next_event(ch, 60000);
    if (!ev) {
      std::printf("FAIL no event\n");
      return 1;
    }
    print_event(ev, t0);
    const rdma_cm_event_type type = ev->event;
    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) {
      id = ev->id;
      if (ib_any) {  // cma_save_ib_info: the new id's addresses are AF_IB, the path's GIDs
        const auto* l = reinterpret_cast<const sockaddr_ib*>(rdma_get_local_addr(id));
        const auto* r = reinterpret_cast<const sockaddr_ib*>(rdma_get_peer_addr(id));
        const bool ok = l->sib_family == AF_IB && r->sib_family == AF_IB &&
                        be64toh(l->sib_sid) == (0x01060000ull | static_cast<uint64_t>(port)) &&
                        l->sib_addr.sib_addr32[2] == htobe32(0xffff) && r->sib_addr.sib_addr32[2] == htobe32(0xffff);
        std::printf("%s\n", ok ? "AF_IB-REQUEST" : "FAIL the request's addresses are not AF_IB");
        if (!ok) return 1;
      }
      const char* pd = static_cast<const char*>(ev->param.conn.private_data);
      const bool pd_ok = pd && ev->param.conn.private_data_len == 56 && std::strcmp(pd, "cli-hello") == 0;
      rdma_ack_cm_event(ev);
      if (!pd_ok) {
        std::printf("FAIL the request's private data\n");
        return 1;
      }
      if (mode == "hold") {
        std::printf("REQUEST\n");
        std::fflush(stdout);
        continue;  // never answered: wait for what the client's end does
      }
      if (mode == "wait") {  // accept once the test writes a line to stdin
        std::printf("REQUEST\n");
        std::fflush(stdout);
        char line[16];
        if (!std::fgets(line, sizeof line, stdin)) return 1;
      }
      if (mode == "reject") {
        static const char no[] = "no-thanks";
        if (rdma_reject(id, no, sizeof no)) die("rdma_reject");
        rdma_destroy_id(id);
        rdma_destroy_id(listen);
        rdma_destroy_event_channel(ch);
        std::printf("REJECTED-SENT\n");
        return 0;
      }
      make_qp(id, &c);
      if (rdma_post_recv(id, nullptr, c.rx(), kMsg, c.mr)) die("rdma_post_recv");
      static const char hello[] = "srv-hello";
      rdma_conn_param cp{};
      cp.private_data = hello;
      cp.private_data_len = sizeof hello;
      cp.responder_resources = cp.initiator_depth = 1;
      cp.rnr_retry_count = 7;
      if (rdma_accept(id, &cp)) {
        if (mode != "wait") die("rdma_accept");
        std::printf("ACCEPT-FAILED %d\n", errno);  // the client went away first
        std::fflush(stdout);
        return 0;
      }
      std::printf("ACCEPTED\n");
      std::fflush(stdout);
      continue;
    }
    rdma_ack_cm_event(ev);
    if (type == RDMA_CM_EVENT_ESTABLISHED) {
      ibv_wc wc{};
      if (!wait_wc(id->recv_cq, &wc, 10000) || wc.byte_len != kMsg) {
        std::printf("FAIL receive\n");
        return 1;
      }
      for (size_t i = 0; i < kMsg; ++i)
        if (c.rx()[i] != static_cast<uint8_t>(i * 7 + 3)) {
          std::printf("FAIL byte %zu\n", i);
          return 1;
        }
      if (rdma_post_send(id, nullptr, c.rx(), kMsg, c.mr, 0)) die("rdma_post_send");
      if (!wait_wc(id->send_cq, &wc, 10000)) {
        std::printf("FAIL send completion\n");
        return 1;
      }
      std::printf("ECHOED\n");
      std::fflush(stdout);
    } else if (type == RDMA_CM_EVENT_DISCONNECTED) {
      rdma_disconnect(id);
      if (mode == "timewait") {  // our rdma_disconnect answered the DREQ: timewait, then its exit
        rdma_cm_event* tw = next_event(ch, 5000);
        if (!tw || tw->event != RDMA_CM_EVENT_TIMEWAIT_EXIT || tw->id != id) {
          std::printf("FAIL no TIMEWAIT_EXIT after the disconnect\n");
          return 1;
        }
        print_event(tw, t0);
        rdma_ack_cm_event(tw);
      }
      rdma_dereg_mr(c.mr);
      rdma_destroy_qp(id);
      rdma_destroy_id(id);
      rdma_destroy_id(listen);
      rdma_destroy_event_channel(ch);
      return 0;
    } else if (type == RDMA_CM_EVENT_REJECTED && (mode == "hold" || mode == "wait")) {
      return 0;
    }
  }
}

int client(const char* ip, int port, const std::string& expected) {
  rdma_event_channel* ch = rdma_create_event_channel();
  if (!ch) die("rdma_create_event_channel");
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP)) die("rdma_create_id");
  sockaddr_storage a = addr_of(ip, port);
  const int64_t t0 = now_ms();
  if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&a), 2000)) die("rdma_resolve_addr");
  Conn c;
  const int64_t until = now_ms() + 10000;
  int64_t connected_at = t0;
  while (now_ms() < until) {
    rdma_cm_event* ev = next_event(ch, static_cast<int>(until - now_ms()));
    if (!ev) break;
    const rdma_cm_event_type type = ev->event;
    print_event(ev, connected_at);
    rdma_ack_cm_event(ev);
    if (rdma_event_str(type) == expected) {
      std::printf("GOT %s\n", expected.c_str());
      return 0;
    }
    if (type == RDMA_CM_EVENT_ADDR_RESOLVED) {
      if (rdma_resolve_route(id, 2000)) die("rdma_resolve_route");
    } else if (type == RDMA_CM_EVENT_ROUTE_RESOLVED) {
      make_qp(id, &c);
      if (rdma_post_recv(id, nullptr, c.rx(), kMsg, c.mr)) die("rdma_post_recv");  // for the echo
      char hello[56] = "cli-hello";
      rdma_conn_param cp{};
      cp.private_data = hello;
      cp.private_data_len = sizeof hello;
      cp.responder_resources = cp.initiator_depth = 1;
      cp.retry_count = 7;
      cp.rnr_retry_count = 7;
      connected_at = now_ms();
      std::printf("CONNECTING\n");
      std::fflush(stdout);
      if (rdma_connect(id, &cp)) die("rdma_connect");
    } else if (type == RDMA_CM_EVENT_ESTABLISHED) {
      for (size_t i = 0; i < kMsg; ++i) c.tx()[i] = static_cast<uint8_t>(i * 7 + 3);
      ibv_wc wc{};
      if (rdma_post_send(id, nullptr, c.tx(), kMsg, c.mr, 0) || !wait_wc(id->send_cq, &wc, 10000)) {
        std::printf("FAIL send\n");
        return 1;
      }
      if (!wait_wc(id->recv_cq, &wc, 10000) || wc.byte_len != kMsg) {
        std::printf("FAIL echo: no receive completion of %zu bytes\n", kMsg);
        return 1;
      }
      if (std::memcmp(c.rx(), c.tx(), kMsg) != 0) {
        std::printf("FAIL echo: the bytes differ\n");
        return 1;
      }
      std::printf("ECHO-OK\n");
      std::fflush(stdout);
      if (expected == "DISCONNECT-SELF" || expected == "TIMEWAIT-EXIT") {
        if (rdma_disconnect(id)) die("rdma_disconnect");
        rdma_cm_event* dev = next_event(ch, 3000);
        if (!dev || dev->event != RDMA_CM_EVENT_DISCONNECTED) {
          std::printf("FAIL no DISCONNECTED after rdma_disconnect\n");
          return 1;
        }
        rdma_ack_cm_event(dev);
        if (expected == "TIMEWAIT-EXIT") {  // the DREP came: timewait, then TIMEWAIT_EXIT
          rdma_cm_event* tw = next_event(ch, 5000);
          if (!tw || tw->event != RDMA_CM_EVENT_TIMEWAIT_EXIT || tw->id != id) {
            std::printf("FAIL no TIMEWAIT_EXIT after DISCONNECTED\n");
            return 1;
          }
          print_event(tw, connected_at);
          rdma_ack_cm_event(tw);
          rdma_dereg_mr(c.mr);
          rdma_destroy_qp(id);
          rdma_destroy_id(id);
          rdma_destroy_event_channel(ch);
          std::printf("GOT TIMEWAIT-EXIT\n");
          return 0;
        }
        rdma_dereg_mr(c.mr);
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
        std::printf("GOT DISCONNECT-SELF\n");
        return 0;
      }
    }
  }
  std::printf("FAIL %s did not come\n", expected.c_str());
  return 1;
}

// A raw command straight to the channel fd (what librdmacm writes).
ssize_t raw(rdma_event_channel* ch, const void* cmd, size_t len) { return ::write(ch->fd, cmd, len); }

int errors(const char* ip) {
  rdma_event_channel* ch = rdma_create_event_channel();
  check(ch != nullptr, "rdma_create_event_channel");
  struct stat st{};
  check(::fstat(ch->fd, &st) == 0 && S_ISCHR(st.st_mode), "the channel is a character device to fstat");
  // Readiness: nothing queued -> no POLLIN; non-blocking get_event -> EAGAIN.
  pollfd p{ch->fd, POLLIN, 0};
  check(::poll(&p, 1, 0) == 0, "an empty channel is not readable");
  const int fl = ::fcntl(ch->fd, F_GETFL);
  check(::fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK) == 0, "O_NONBLOCK on the channel");
  rdma_cm_event* ev = nullptr;
  check(rdma_get_cm_event(ch, &ev) != 0 && errno == EAGAIN, "rdma_get_cm_event on an empty O_NONBLOCK channel: EAGAIN");
  ::fcntl(ch->fd, F_SETFL, fl);

  // Kernel validation of the command header.
  uint32_t shortcmd = kCmdCreateId;
  check(raw(ch, &shortcmd, sizeof shortcmd) < 0 && errno == EINVAL, "a command shorter than its header: EINVAL");
  rdma_ucm_cmd_hdr hdr{99, 0, 0};
  check(raw(ch, &hdr, sizeof hdr) < 0 && errno == EINVAL, "an unknown command: EINVAL");
  struct {
    rdma_ucm_cmd_hdr h;
    uint8_t body[64];
  } big{};
  big.h = {kCmdCreateId, 200, 4};
  check(raw(ch, &big, sizeof big) < 0 && errno == EINVAL, "in longer than the write: EINVAL");
  big.h = {kCmdGetOption, 16, 0};
  check(raw(ch, &big, sizeof big) < 0 && errno == ENOSYS, "GET_OPTION: ENOSYS");
  struct {
    rdma_ucm_cmd_hdr h;
    rdma_ucm_create_id c;
  } create{};
  create.h = {kCmdCreateId, sizeof create.c, 4};
  create.c.ps = RDMA_PS_TCP;
  create.c.response = 16;  // a pointer into nowhere
  check(raw(ch, &create, sizeof create) < 0 && errno == EFAULT, "a response pointer into nowhere: EFAULT");
  create.c.ps = 0x4242;
  rdma_ucm_create_id_resp cresp{};
  create.c.response = reinterpret_cast<uintptr_t>(&cresp);
  check(raw(ch, &create, sizeof create) < 0 && errno == EINVAL, "an unknown port space: EINVAL");
  create.h.out = 2;
  create.c.ps = RDMA_PS_TCP;
  check(raw(ch, &create, sizeof create) < 0 && errno == ENOSPC, "a response too small: ENOSPC");
  struct {
    rdma_ucm_cmd_hdr h;
    rdma_ucm_destroy_id d;
  } destroy{};
  rdma_ucm_destroy_id_resp dresp{};
  destroy.h = {kCmdDestroyId, sizeof destroy.d, sizeof dresp};
  destroy.d.response = reinterpret_cast<uintptr_t>(&dresp);
  destroy.d.id = 0x7ffffff0;
  check(raw(ch, &destroy, sizeof destroy) < 0 && errno == ENOENT, "an id nobody has: ENOENT");

  // An id of another channel: EINVAL (ucma_get_ctx).
  rdma_event_channel* other = rdma_create_event_channel();
  check(other != nullptr, "a second channel");
  rdma_cm_id* foreign = nullptr;
  check(rdma_create_id(other, &foreign, nullptr, RDMA_PS_TCP) == 0, "an id on the second channel");
  {
    struct {
      rdma_ucm_cmd_hdr h;
      rdma_ucm_query q;
    } qr{};
    rdma_ucm_query_route_resp resp{};
    qr.h = {kCmdQueryRoute, sizeof qr.q, sizeof resp};
    qr.q.response = reinterpret_cast<uintptr_t>(&resp);
    // librdmacm's handle is the first field after the public rdma_cm_id; ask the
    // daemon with the handle the kernel would have given: find it by trying.
    bool saw_einval = false;
    for (uint32_t h = 1; h < 64 && !saw_einval; ++h) {
      qr.q.id = h;
      saw_einval = raw(ch, &qr, sizeof qr) < 0 && errno == EINVAL;
    }
    check(saw_einval, "an id of another channel: EINVAL");
  }
  // dup: a duplicate descriptor is the same channel; the original still works after closing it.
  const int dupfd = ::dup(ch->fd);
  check(dupfd >= 0, "dup of the channel");
  struct stat st2{};
  check(::fstat(dupfd, &st2) == 0 && S_ISCHR(st2.st_mode), "the duplicate is a character device too");
  ::close(dupfd);

  // Bind: an address nobody holds, a port taken, options.
  rdma_cm_id* id = nullptr;
  check(rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) == 0, "rdma_create_id");
  sockaddr_storage nobody = addr_of("198.51.100.77", 0);
  check(rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&nobody)) != 0 && errno == EADDRNOTAVAIL,
        "binding an address no interface has: EADDRNOTAVAIL");
  int one = 1;
  check(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, sizeof one) == 0, "REUSEADDR before bind");
  uint8_t tos = 32, ack = 16;
  check(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, sizeof tos) == 0, "TOS");
  check(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &ack, sizeof ack) == 0, "ACK_TIMEOUT");
  check(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &one, sizeof one) != 0 && errno == EINVAL,
        "TOS of the wrong size: EINVAL");
  check(rdma_set_option(id, 77, 1, &one, sizeof one) != 0 && errno == ENOSYS, "an unknown option level: ENOSYS");
  sockaddr_storage mine = addr_of(ip, 18515);
  check(rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&mine)) == 0, "binding our own address");
  check(id->verbs != nullptr, "a bound address attaches its RoCE device (id->verbs)");
  check(rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR, &one, sizeof one) != 0 && errno == EINVAL,
        "REUSEADDR once bound: EINVAL");
  check(rdma_listen(id, 0) == 0, "listen");
  rdma_cm_id* id2 = nullptr;
  check(rdma_create_id(ch, &id2, nullptr, RDMA_PS_TCP) == 0, "a second id");
  check(rdma_bind_addr(id2, reinterpret_cast<sockaddr*>(&mine)) != 0 && errno == EADDRINUSE,
        "the same port again: EADDRINUSE");
  sockaddr_storage any = addr_of("0.0.0.0", 0);
  check(rdma_bind_addr(id2, reinterpret_cast<sockaddr*>(&any)) == 0 && id2->verbs == nullptr,
        "a wildcard bind attaches no device");
  check(rdma_connect(id2, nullptr) != 0 && errno == EINVAL, "connect before the route: EINVAL");

  // Events and readiness: an address resolution queues ADDR_RESOLVED.
  rdma_cm_id* id3 = nullptr;
  check(rdma_create_id(ch, &id3, nullptr, RDMA_PS_TCP) == 0, "a third id");
  sockaddr_storage dst = addr_of(ip, 18516);
  check(rdma_resolve_addr(id3, nullptr, reinterpret_cast<sockaddr*>(&dst), 1000) == 0, "rdma_resolve_addr");
  check(::poll(&p, 1, 2000) == 1 && (p.revents & POLLIN), "a queued event makes the channel readable");
  check(rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED && ev->status == 0,
        "ADDR_RESOLVED");
  check(::poll(&p, 1, 0) == 0, "the channel is not readable once the queue is empty");
  rdma_ack_cm_event(ev);
  check(rdma_resolve_route(id3, 1000) == 0, "rdma_resolve_route");
  check(rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ROUTE_RESOLVED, "ROUTE_RESOLVED");
  check(id3->route.num_paths == 1 && id3->port_num == 1 && id3->verbs != nullptr, "the route names the device and port");
  rdma_ack_cm_event(ev);
  char toolong[57] = {};
  rdma_conn_param cp{};
  cp.private_data = toolong;
  cp.private_data_len = sizeof toolong;
  check(rdma_connect(id3, &cp) != 0 && errno == EINVAL, "57 bytes of REQ private data: EINVAL");
  // An unreported event does not hang rdma_destroy_id; a resolve to nobody: ADDR_ERROR.
  rdma_cm_id* id4 = nullptr;
  check(rdma_create_id(ch, &id4, nullptr, RDMA_PS_TCP) == 0, "a fourth id");
  check(rdma_resolve_addr(id4, nullptr, reinterpret_cast<sockaddr*>(&dst), 1000) == 0, "a resolve left unread");
  check(::poll(&p, 1, 2000) == 1, "readable with the unread event");
  check(rdma_destroy_id(id4) == 0, "rdma_destroy_id with its event unread returns");
  check(::poll(&p, 1, 0) == 0, "destroying the id took its event (and the readiness) with it");
  rdma_destroy_id(id3);
  rdma_destroy_id(id2);
  rdma_destroy_id(id);
  rdma_destroy_id(foreign);
  rdma_destroy_event_channel(other);
  rdma_destroy_event_channel(ch);
  std::printf("ERRORS-OK\n");
  return 0;
}

// One raw command on a channel only this code uses (librdmacm never reads
// its events): header, then the body.
template <class T>
ssize_t raw_cmd(int fd, uint32_t cmd, const T& body, uint16_t out) {
  struct {
    rdma_ucm_cmd_hdr h;
    T b;
  } m{};
  m.h = {cmd, static_cast<uint16_t>(sizeof(T)), out};
  m.b = body;
  return ::write(fd, &m, sizeof m);
}

// Waits for the next event on a raw channel (its token, then GET_EVENT).
bool raw_event(int fd, rdma_ucm_event_head* ev) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 3000) != 1) return false;
  rdma_ucm_get_event g{reinterpret_cast<uintptr_t>(ev)};
  return raw_cmd(fd, 12, g, sizeof *ev) > 0;
}

int afib(const char* ip) {
  rdma_event_channel* ch = rdma_create_event_channel();
  check(ch != nullptr, "rdma_create_event_channel");
  // librdmacm took the AF_IB set: only then does rdma_bind_addr take a sockaddr_ib (ucma_addrlen).
  rdma_cm_id* id = nullptr;
  check(rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) == 0, "rdma_create_id");
  sockaddr_storage w = ib_wildcard(0);
  check(rdma_bind_addr(id, reinterpret_cast<sockaddr*>(&w)) == 0,
        "binding the AF_IB wildcard (librdmacm uses the AF_IB set)");
  const auto* l = reinterpret_cast<const sockaddr_ib*>(rdma_get_local_addr(id));
  const uint64_t sid = be64toh(l->sib_sid);
  check(l->sib_family == AF_IB && (sid & ~0xffffull) == 0x01060000ull && (sid & 0xffff) != 0 &&
            l->sib_sid_mask == ~0ull && id->verbs == nullptr,
        "the bound AF_IB address names the TCP port space and a port, and no device");
  rdma_cm_id* id2 = nullptr;
  check(rdma_create_id(ch, &id2, nullptr, RDMA_PS_TCP) == 0, "a second id");
  sockaddr_storage g = ib_gid_of(ip, 0xffff);
  check(rdma_bind_addr(id2, reinterpret_cast<sockaddr*>(&g)) != 0 && errno == ENODEV,
        "binding an AF_IB GID on a RoCE-only host: ENODEV (cma_validate_port)");
  sockaddr_storage nokey = ib_gid_of(ip, 0x1234);
  check(rdma_resolve_addr(id2, nullptr, reinterpret_cast<sockaddr*>(&nokey), 1000) != 0 && errno == ENODEV,
        "resolving an AF_IB GID with a P_Key no port has: ENODEV");
  rdma_destroy_id(id2);
  check(rdma_create_id(ch, &id2, nullptr, RDMA_PS_TCP) == 0, "a fresh id");
  check(rdma_resolve_addr(id2, nullptr, reinterpret_cast<sockaddr*>(&g), 1000) == 0, "resolving an AF_IB GID");
  rdma_cm_event* ev = nullptr;
  check(rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED, "ADDR_RESOLVED");
  rdma_ack_cm_event(ev);
  const auto* s2 = reinterpret_cast<const sockaddr_ib*>(rdma_get_local_addr(id2));
  check(id2->verbs != nullptr && id2->port_num == 1 && s2->sib_family == AF_IB &&
            !std::memcmp(&s2->sib_addr, &reinterpret_cast<sockaddr_ib*>(&g)->sib_addr, 16),
        "an AF_IB resolution attaches the device holding the GID, and takes it as the source");
  check(!std::memcmp(id2->route.addr.addr.ibaddr.dgid.raw, &reinterpret_cast<sockaddr_ib*>(&g)->sib_addr, 16),
        "QUERY_GID: the destination GID");
  check(rdma_resolve_route(id2, 1000) != 0 && errno == ENODEV,
        "the route of an AF_IB id on a RoCE port: ENODEV (no netdev)");
  // The AF_IB wildcard as destination is loopback (cma_resolve_loopback):
  // the first active port, its GID 0 both ways, the source ::1.
  rdma_cm_id* lo = nullptr;
  check(rdma_create_id(ch, &lo, nullptr, RDMA_PS_TCP) == 0, "an id for the AF_IB loopback");
  sockaddr_storage zero = ib_wildcard(0);
  check(rdma_resolve_addr(lo, nullptr, reinterpret_cast<sockaddr*>(&zero), 1000) == 0 &&
            rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED,
        "resolving the AF_IB wildcard: ADDR_RESOLVED");
  rdma_ack_cm_event(ev);
  const auto* los = reinterpret_cast<const sockaddr_ib*>(rdma_get_local_addr(lo));
  // QUERY_GID copies AF_IB addresses as they are: the GIDs librdmacm sees are ::1 and the wildcard.
  check(lo->verbs != nullptr && lo->port_num == 1 && los->sib_family == AF_IB &&
            los->sib_addr.sib_addr32[3] == htobe32(1) && lo->route.addr.addr.ibaddr.sgid.raw[15] == 1 &&
            lo->route.addr.addr.ibaddr.dgid.global.interface_id == 0,
        "AF_IB loopback: a device and port, the source ::1");
  rdma_destroy_id(lo);
  rdma_cm_id* id3 = nullptr;
  check(rdma_create_id(ch, &id3, nullptr, RDMA_PS_TCP) == 0, "a third id");
  sockaddr_storage mine = addr_of(ip, 0);
  check(rdma_bind_addr(id3, reinterpret_cast<sockaddr*>(&mine)) == 0, "an IPv4 bind through BIND");
  check(rdma_get_local_addr(id3)->sa_family == AF_INET && id3->verbs != nullptr,
        "QUERY_ADDR: an IPv4 source, the device");
  check(rdma_resolve_addr(id3, nullptr, reinterpret_cast<sockaddr*>(&g), 1000) != 0 && errno == EINVAL,
        "an AF_IB destination for an IPv4 source: EINVAL");

  // The path record of an IP route (QUERY_PATH, as librdmacm converts it).
  rdma_cm_id* id4 = nullptr;
  check(rdma_create_id(ch, &id4, nullptr, RDMA_PS_TCP) == 0, "a fourth id");
  uint8_t tos = 32, ack = 14;
  check(rdma_set_option(id4, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, sizeof tos) == 0, "TOS 32");
  check(rdma_set_option(id4, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &ack, sizeof ack) == 0, "ACK_TIMEOUT 14");
  sockaddr_storage dst = addr_of(ip, 18600);
  check(rdma_resolve_addr(id4, nullptr, reinterpret_cast<sockaddr*>(&dst), 1000) == 0, "rdma_resolve_addr (IPv4)");
  check(rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ADDR_RESOLVED, "ADDR_RESOLVED");
  rdma_ack_cm_event(ev);
  check(id4->route.num_paths == 0, "no path before the route");
  check(rdma_resolve_route(id4, 1000) == 0, "rdma_resolve_route");
  check(rdma_get_cm_event(ch, &ev) == 0 && ev->event == RDMA_CM_EVENT_ROUTE_RESOLVED, "ROUTE_RESOLVED");
  rdma_ack_cm_event(ev);
  uint8_t gid[16] = {};
  gid[10] = gid[11] = 0xff;
  inet_pton(AF_INET, ip, gid + 12);
  check(id4->route.num_paths == 1 && id4->route.path_rec != nullptr, "one path");
  const ibv_sa_path_rec& pr = id4->route.path_rec[0];
  const uint16_t sport = ntohs(reinterpret_cast<sockaddr_in*>(rdma_get_local_addr(id4))->sin_port);
  std::printf("path: hop %u tclass %u pkey %#x mtu %u rate %u life %u sl %u dlid %u flow %#x sport %u\n",
              pr.hop_limit, pr.traffic_class, ntohs(pr.pkey), pr.mtu, pr.rate, pr.packet_life_time, pr.sl,
              ntohs(pr.dlid), ntohl(pr.flow_label), sport);
  check(!std::memcmp(pr.sgid.raw, gid, 16) && !std::memcmp(pr.dgid.raw, gid, 16), "the path's GIDs are ::ffff:a.b.c.d");
  check(pr.dlid == 0 && pr.slid == 0 && pr.pkey == htons(0xffff) && pr.hop_limit == 64 && pr.traffic_class == 32 &&
            pr.sl == 0 && pr.reversible == 1,
        "RoCE: no LIDs, P_Key 0xffff, hop limit 64, traffic class = TOS, SL 0, reversible");
  check(pr.mtu == IBV_MTU_1024 && pr.mtu_selector == 2 && pr.rate == 3 && pr.rate_selector == 2,
        "MTU 1024 (1500-byte link), exactly; rate 10 Gb/s, exactly");
  check(pr.packet_life_time == 13 && pr.packet_life_time_selector == 2, "packet life time = ACK_TIMEOUT - 1");
  check(ntohl(pr.flow_label) == ((sport * 31u + 18600u) & 0xFFFFF), "RoCE v2 flow label: a hash of the ports");

  // Raw commands on a channel of their own: sizes, options, the kernel's errnos.
  rdma_event_channel* rc = rdma_create_event_channel();
  check(rc != nullptr, "a raw channel");
  const int fd = rc->fd;
  rdma_ucm_create_id cr{};
  rdma_ucm_create_id_resp cresp{};
  cr.response = reinterpret_cast<uintptr_t>(&cresp);
  cr.ps = RDMA_PS_TCP;
  cr.uid = 7;
  check(raw_cmd(fd, kCmdCreateId, cr, sizeof cresp) > 0, "CREATE_ID");
  const uint32_t h = cresp.id;
  rdma_ucm_bind b{};
  b.id = h;
  std::memcpy(&b.addr, &w, sizeof(sockaddr_ib));
  b.addr_size = sizeof(sockaddr_in6);
  check(raw_cmd(fd, kCmdBind, b, 0) < 0 && errno == EINVAL, "BIND: an addr_size that is not the family's: EINVAL");
  b.addr_size = 0;
  check(raw_cmd(fd, kCmdBind, b, 0) < 0 && errno == EINVAL, "BIND: addr_size 0: EINVAL");
  reinterpret_cast<sockaddr*>(&b.addr)->sa_family = AF_UNIX;
  b.addr_size = sizeof(sockaddr_un);
  check(raw_cmd(fd, kCmdBind, b, 0) < 0 && errno == EINVAL, "BIND: a family RDMA CM does not take: EINVAL");
  std::memcpy(&b.addr, &w, sizeof(sockaddr_ib));
  b.addr_size = sizeof(sockaddr_ib);
  b.reserved = 1;
  check(raw_cmd(fd, kCmdBind, b, 0) < 0 && errno == EINVAL, "BIND: reserved not 0: EINVAL");
  b.reserved = 0;
  reinterpret_cast<sockaddr_ib*>(&b.addr)->sib_sid = htobe64(0x0000000001110000ull);  // UDP's for a TCP id
  check(raw_cmd(fd, kCmdBind, b, 0) < 0 && errno == EPROTONOSUPPORT,
        "BIND: a service id of another port space: EPROTONOSUPPORT");
  rdma_ucm_query q{};
  rdma_ucm_query_addr_resp qa{};
  q.response = reinterpret_cast<uintptr_t>(&qa);
  q.id = h;
  q.option = 7;
  check(raw_cmd(fd, kCmdQuery, q, sizeof qa) < 0 && errno == ENOSYS, "QUERY: an unknown option: ENOSYS");
  q.option = kQueryAddr;
  check(raw_cmd(fd, kCmdQuery, q, sizeof qa - 1) < 0 && errno == ENOSPC, "QUERY_ADDR: too little room: ENOSPC");
  q.option = kQueryGid;
  check(raw_cmd(fd, kCmdQuery, q, 8) < 0 && errno == ENOSPC, "QUERY_GID: too little room: ENOSPC");
  q.option = kQueryPath;
  check(raw_cmd(fd, kCmdQuery, q, 4) < 0 && errno == ENOSPC, "QUERY_PATH: less than its header: ENOSPC");
  q.option = kQueryAddr;
  check(raw_cmd(fd, kCmdQuery, q, sizeof qa) > 0 && qa.src_size == 0 && qa.dst_size == 0 && qa.node_guid == 0,
        "QUERY_ADDR of a fresh id: no addresses, no device");
  // Resolve and route the raw id, then QUERY_PATH with room for exactly one record.
  rdma_ucm_resolve_addr ra{};
  ra.id = h;
  ra.timeout_ms = 1000;
  ra.dst_size = sizeof(sockaddr_in);
  std::memcpy(&ra.dst_addr, &dst, sizeof(sockaddr_in));
  ra.src_size = 4;
  check(raw_cmd(fd, 21, ra, 0) < 0 && errno == EINVAL, "RESOLVE_ADDR: a source size that is not its family's: EINVAL");
  ra.src_size = 0;
  check(raw_cmd(fd, 21, ra, 0) > 0, "RESOLVE_ADDR");
  rdma_ucm_event_head e{};
  check(raw_event(fd, &e) && e.event == RDMA_CM_EVENT_ADDR_RESOLVED && e.uid == 7, "its ADDR_RESOLVED");
  q.option = kQueryAddr;
  check(raw_cmd(fd, kCmdQuery, q, sizeof qa) > 0 && qa.src_size == sizeof(sockaddr_in) &&
            qa.dst_size == sizeof(sockaddr_in) && qa.node_guid != 0 && qa.port_num == 1 && qa.pkey == htons(0xffff),
        "QUERY_ADDR: IPv4 sizes, the device, P_Key 0xffff");
  q.option = kQueryGid;
  check(raw_cmd(fd, kCmdQuery, q, sizeof qa) > 0 && qa.src_size == sizeof(sockaddr_ib) &&
            reinterpret_cast<sockaddr_ib*>(&qa.src_addr)->sib_family == AF_IB &&
            !std::memcmp(&reinterpret_cast<sockaddr_ib*>(&qa.src_addr)->sib_addr, gid, 16) &&
            be64toh(reinterpret_cast<sockaddr_ib*>(&qa.dst_addr)->sib_sid) == 0x01060000ull + 18600,
        "QUERY_GID: both ends as sockaddr_ib, the GIDs and the TCP service ids");
  rdma_ucm_resolve_route rr{h, 1000};
  check(raw_cmd(fd, 4, rr, 0) > 0 && raw_event(fd, &e) && e.event == RDMA_CM_EVENT_ROUTE_RESOLVED, "its route");
  struct {
    uint32_t num_paths, reserved;
    ib_path_rec_data d[2];
  } pp;
  std::memset(&pp, 0xaa, sizeof pp);
  q.response = reinterpret_cast<uintptr_t>(&pp);
  q.option = kQueryPath;
  check(raw_cmd(fd, kCmdQuery, q, 8 + 72) > 0 && pp.num_paths == 1 && pp.d[0].flags == 0xaaaaaaaa,
        "QUERY_PATH with room for one record: the count, but no record (the kernel's loop wants more room)");
  check(raw_cmd(fd, kCmdQuery, q, sizeof pp) > 0 && pp.num_paths == 1 && pp.d[0].flags == (1 | 2 | 8 | 32) &&
            pp.d[1].flags == 0xaaaaaaaa,
        "QUERY_PATH: one record, GMP | PRIMARY | BIDIRECTIONAL");
  const uint8_t* w8 = pp.d[0].path_rec;  // the SA PathRecord: sgid at 24, dlid at 40, hop limit at 47, P_Key at 50
  check(!std::memcmp(w8 + 24, gid, 16) && w8[40] == 0 && w8[41] == 0 && w8[47] == 64 && w8[50] == 0xff &&
            w8[51] == 0xff && w8[54] == (0x80 | IBV_MTU_1024) && w8[55] == (0x80 | 3) && w8[56] == (0x80 | 16),
        "the record's fields at the SA's offsets (MTU, rate, life time with selector 2)");
  rdma_ucm_query_route_resp_real qr{};
  q.response = reinterpret_cast<uintptr_t>(&qr);
  check(raw_cmd(fd, kCmdQueryRoute, q, sizeof qr) > 0 && qr.num_paths == 1 && qr.ib_route[0].hop_limit == 64 &&
            qr.ib_route[0].pkey == htons(0xffff) && qr.ib_route[0].dlid == 0 && qr.ib_route[0].mtu == IBV_MTU_1024 &&
            qr.ib_route[0].packet_life_time == 16 && !std::memcmp(qr.ib_route[0].sgid, gid, 16),
        "QUERY_ROUTE: the same path record");
  // CONNECT (ucma_connect): `in` must reach the ECE fields (the shim copies
  // what the handler reads), then conn_param.valid is checked before the id.
  struct Connect {
    uint8_t b[288];  // rdma_ucm_connect: conn_param (272), id, reserved, ece
  } cn{};
  struct ShortConnect {
    uint8_t b[16];
  } sc{};
  check(raw_cmd(fd, 6, sc, 0) < 0 && errno == EINVAL, "CONNECT shorter than its fixed part: EINVAL");
  const uint32_t nobody = 0x7ffffff0;
  std::memcpy(cn.b + 272, &nobody, 4);
  check(raw_cmd(fd, 6, cn, 0) < 0 && errno == EINVAL, "CONNECT without conn_param.valid: EINVAL, before the id");
  cn.b[271] = 1;
  check(raw_cmd(fd, 6, cn, 0) < 0 && errno == ENOENT, "CONNECT (valid) naming an id nobody has: ENOENT");
  rdma_ucm_join_mcast j{};
  rdma_ucm_create_id_resp jr{};
  j.response = reinterpret_cast<uintptr_t>(&jr);
  j.id = h;
  sockaddr_storage grp = addr_of("224.0.1.99", 0);
  std::memcpy(&j.addr, &grp, sizeof(sockaddr_in));
  j.addr_size = sizeof(sockaddr_in6);
  check(raw_cmd(fd, kCmdJoinMcast, j, sizeof jr) < 0 && errno == EINVAL, "JOIN_MCAST: a wrong addr_size: EINVAL");
  rdma_ucm_destroy_id d{};
  rdma_ucm_destroy_id_resp dr{};
  d.response = reinterpret_cast<uintptr_t>(&dr);
  d.id = h;
  check(raw_cmd(fd, kCmdDestroyId, d, sizeof dr) > 0 && dr.events_reported == 2, "DESTROY_ID: two events reported");
  rdma_destroy_event_channel(rc);
  rdma_destroy_id(id4);
  rdma_destroy_id(id3);
  rdma_destroy_id(id2);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(ch);
  std::printf("AFIB-OK\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "server" && argc == 5) return server(argv[2], std::atoi(argv[3]), argv[4]);
  if (cmd == "client" && argc == 5) return client(argv[2], std::atoi(argv[3]), argv[4]);
  if (cmd == "errors" && argc == 3) return errors(argv[2]);
  if (cmd == "afib" && argc == 3) return afib(argv[2]);
  if (cmd == "nochannel") {
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch || errno != ENOENT) {
      std::printf("FAIL rdma_create_event_channel: %s\n", ch ? "succeeded" : std::strerror(errno));
      return 1;
    }
    std::printf("ENOENT\n");
    return 0;
  }
  std::fprintf(stderr, "usage: cm_probe server|client|errors|nochannel ...\n");
  return 2;
}
