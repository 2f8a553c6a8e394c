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
//   cm_probe errors ADDR      bad input, options and readiness, in-process.
//   cm_probe nochannel        rdma_create_event_channel must fail ENOENT.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sys/stat.h>
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
enum : uint32_t { kCmdCreateId = 0, kCmdDestroyId = 1, kCmdQueryRoute = 5, kCmdGetOption = 13 };
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

// Waits (poll on the channel fd, then rdma_get_cm_event) up to ms.
rdma_cm_event* next_event(rdma_event_channel* ch, int ms) {
  pollfd p{ch->fd, POLLIN, 0};
  if (::poll(&p, 1, ms) != 1) return nullptr;
  rdma_cm_event* ev = nullptr;
  if (rdma_get_cm_event(ch, &ev) != 0) die("rdma_get_cm_event");
  return ev;
}

constexpr size_t kMsg = 4096;

struct Conn {
  ibv_mr* mr = nullptr;
  std::vector<uint8_t> buf = std::vector<uint8_t>(kMsg);
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
  sockaddr_storage a = addr_of(ip, port);
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
      if (rdma_post_recv(id, nullptr, c.buf.data(), c.buf.size(), c.mr)) die("rdma_post_recv");
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
        if (c.buf[i] != static_cast<uint8_t>(i * 7 + 3)) {
          std::printf("FAIL byte %zu\n", i);
          return 1;
        }
      if (rdma_post_send(id, nullptr, c.buf.data(), kMsg, c.mr, 0)) die("rdma_post_send");
      if (!wait_wc(id->send_cq, &wc, 10000)) {
        std::printf("FAIL send completion\n");
        return 1;
      }
      std::printf("ECHOED\n");
      std::fflush(stdout);
    } else if (type == RDMA_CM_EVENT_DISCONNECTED) {
      rdma_disconnect(id);
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
      if (rdma_post_recv(id, nullptr, c.buf.data(), c.buf.size(), c.mr)) die("rdma_post_recv");
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
      for (size_t i = 0; i < kMsg; ++i) c.buf[i] = static_cast<uint8_t>(i * 7 + 3);
      std::vector<uint8_t> sent = c.buf;
      ibv_wc wc{};
      if (rdma_post_send(id, nullptr, c.buf.data(), kMsg, c.mr, 0) || !wait_wc(id->send_cq, &wc, 10000)) {
        std::printf("FAIL send\n");
        return 1;
      }
      std::fill(c.buf.begin(), c.buf.end(), 0);
      if (rdma_post_recv(id, nullptr, c.buf.data(), c.buf.size(), c.mr)) die("rdma_post_recv");
      if (!wait_wc(id->recv_cq, &wc, 10000) || c.buf != sent) {
        std::printf("FAIL echo\n");
        return 1;
      }
      std::printf("ECHO-OK\n");
      std::fflush(stdout);
      if (expected == "DISCONNECT-SELF") {
        if (rdma_disconnect(id)) die("rdma_disconnect");
        rdma_cm_event* dev = next_event(ch, 3000);
        if (!dev || dev->event != RDMA_CM_EVENT_DISCONNECTED) {
          std::printf("FAIL no DISCONNECTED after rdma_disconnect\n");
          return 1;
        }
        rdma_ack_cm_event(dev);
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

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string cmd = argc > 1 ? argv[1] : "";
  if (cmd == "server" && argc == 5) return server(argv[2], std::atoi(argv[3]), argv[4]);
  if (cmd == "client" && argc == 5) return client(argv[2], std::atoi(argv[3]), argv[4]);
  if (cmd == "errors" && argc == 3) return errors(argv[2]);
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
