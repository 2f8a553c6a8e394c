// Unreliable datagram (UD) and unreliable connected (UC) queue pairs and
// address handles, through the public libibverbs API only.
//
// Two kinds of cases:
//
//  - Local (one process, one context on shm0): address handles (create,
//    destroy, bad port, a PD with an AH cannot be freed), the attribute masks
//    of ibv_modify_qp for UD and UC, and the opcodes post_send must refuse on
//    UD (RDMA, atomics) and UC (READ, atomics).
//
//  - Pairs: as a gtest, each scenario starts two workers of this executable
//    through `shmrdma run` (a server and a client), connected by a
//    socketpair on fd 3:
//
//      dp_ud --worker server|client --scenario NAME
//
//    ud-lid      SENDs (0 .. 4096 bytes, SGE lists on both sides, with and
//                without immediate data) from two client QPs through an AH
//                without GRH; the server checks every completion field (GRH
//                flag clear, src_qp, slid, byte_len = payload + 40, imm) and
//                every byte, then replies through ibv_create_ah_from_wc
//    ud-grh      the same through an AH with a GRH: IBV_WC_GRH is set and the
//                40 bytes carry the sender's GID (sgid) and the receiver's
//                (dgid); the reply through ibv_create_ah_from_wc arrives with
//                a GRH too. (Every context on shm0 shares port 1, so the two
//                GIDs are equal here: a swap of sgid and dgid goes unseen.)
//    ud-fanout   one chain of WRs from one QP to two server QPs, alternately
//                through an AH with and without GRH
//    ud-many     three sender threads (own contexts and QPs) send bursts to
//                one server QP at once: each message arrives exactly once,
//                intact, and the receives complete in the order they were
//                posted (a QP's receive queue is FIFO; only SRQs are not)
//    ud-deadsender  a sender process is SIGKILLed while it streams (three
//                times): the server QP stays RTS, its receives can still be
//                posted, every successful receive holds an intact message,
//                receives complete in posting order (none is passed over),
//                and a new sender's messages arrive (it sends batches until
//                the server has enough: datagrams are dropped while the
//                server's queue is empty, as when a killed sender's
//                completions wait behind a CQ slot it left reserved)
//    ud-deadpeer the receiving process exits without cleanup while three
//                senders (own contexts) stream into its posted receives:
//                every send still completes (SUCCESS) within 5 s and the
//                senders' QPs stay RTS
//    ud-qkey     a wrong remote_qkey is dropped silently (the sender
//                succeeds, the receive stays posted and takes the next good
//                message); remote_qkey with bit 31 set uses the sender QP's
//                own qkey
//    ud-norecv   a SEND to a QP with no receive posted is dropped silently;
//                the QP goes on and takes the next one (and a SEND to a QPN
//                nobody has succeeds at the sender)
//    ud-len      a SEND above the port MTU (4097 bytes) completes with
//                LOC_LEN_ERR at the sender and delivers nothing; a receive of
//                exactly 40 + payload succeeds, one byte less is LOC_LEN_ERR
//    uc-data     RDMA_WRITE, RDMA_WRITE_WITH_IMM, SEND, SEND_WITH_IMM of 0 ..
//                1 MiB with SGE lists, every byte and the guard bytes around
//                checked
//    uc-norecv   a SEND with no receive posted is dropped: the sender
//                succeeds at once (no RNR wait), both QPs stay RTS and the
//                next SEND arrives
//    uc-badrkey  an RDMA_WRITE with rkey+1 is dropped: the sender succeeds,
//                the target memory is unchanged, both QPs stay RTS and a
//                WRITE with the right rkey then lands
//
// Every wait has a deadline. A worker that finds a mismatch prints
// "FAIL [role] dp_ud.cc:LINE: condition: details" and exits 1.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kGrh = 40;          // the GRH area in front of every UD receive
constexpr uint32_t kMtu = 4096;        // port 1 active MTU (checked)
constexpr uint32_t kServerQkey = 0x11111111;
constexpr uint32_t kClientQkey = 0x22222222;
constexpr uint32_t kOtherQkey = 0x33333333;
constexpr uint8_t kCanary = 0xEE;
constexpr int kWaitMs = 10000;         // any single completion or control-line wait
constexpr int kSilentMs = 200;         // "nothing arrives" window
constexpr uint32_t kServerSqPsn = 0x1357, kClientSqPsn = 0x2468;
constexpr uint32_t kInline = 64;       // max_inline_data asked for at QP creation

// ---------------------------------------------------------------------------
// Worker plumbing

std::string g_role = "?";

[[noreturn]] __attribute__((format(printf, 3, 4))) void fail_at(int line, const char* cond, const char* fmt, ...) {
  std::fprintf(stdout, "FAIL [%s] dp_ud.cc:%d: %s", g_role.c_str(), line, cond);
  if (fmt && *fmt) {
    if (*cond) std::fprintf(stdout, ": ");
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stdout, fmt, ap);
    va_end(ap);
  }
  std::fprintf(stdout, "\n");
  std::fflush(stdout);
  std::_Exit(1);
}

#define REQUIRE(cond, fmt, ...)                                        \
  do {                                                                 \
    if (!(cond)) fail_at(__LINE__, #cond, fmt __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
#define DIE(fmt, ...) fail_at(__LINE__, "", fmt __VA_OPT__(, ) __VA_ARGS__)

__attribute__((format(printf, 1, 2))) void note(const char* fmt, ...) {
  std::fprintf(stdout, "[%s] ", g_role.c_str());
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fprintf(stdout, "\n");
  std::fflush(stdout);
}

harness::LineReader& ctl() {
  static harness::LineReader r(harness::kCtlFd);
  return r;
}

void say(const std::string& s) {
  if (!ctl().send_line(s)) DIE("control channel: cannot send \"%s\" (peer gone?)", s.c_str());
}

// Waits for exactly `want` on the control channel.
void hear(const std::string& want, int ms = 30000) {
  std::string line;
  int r = ctl().poll_line(&line, ms);
  if (r == 0) DIE("control channel: no \"%s\" from the peer within %d ms", want.c_str(), ms);
  if (r < 0)
    DIE("control channel: the peer closed it while we waited for \"%s\" (it failed; see its output)", want.c_str());
  if (line != want) DIE("control channel: got \"%s\", expected \"%s\"", line.c_str(), want.c_str());
}

std::string wc_str(const ibv_wc& wc) {
  char b[320];
  std::snprintf(b, sizeof b,
                "{wr_id %" PRIu64 ", status %s (%d), opcode %d, byte_len %u, wc_flags 0x%x, imm 0x%08x, qp_num %u, "
                "src_qp %u, slid %u, sl %u, dlid_path_bits %u}",
                wc.wr_id, ibv_wc_status_str(wc.status), static_cast<int>(wc.status), static_cast<int>(wc.opcode),
                wc.byte_len, wc.wc_flags, ntohl(wc.imm_data), wc.qp_num, wc.src_qp, wc.slid, wc.sl, wc.dlid_path_bits);
  return b;
}

// One completion within ms (dies otherwise; a poll error dies too).
ibv_wc get_wc(ibv_cq* cq, const char* what, int ms = kWaitMs) {
  ibv_wc wc{};
  if (!harness::poll_one(cq, &wc, ms)) DIE("%s: no completion within %d ms", what, ms);
  if (static_cast<int>(wc.status) == -1) DIE("%s: ibv_poll_cq returned an error", what);
  return wc;
}

// Nothing arrives on cq within ms.
void expect_silence(ibv_cq* cq, const char* what, int ms = kSilentMs) {
  ibv_wc wc{};
  if (harness::poll_one(cq, &wc, ms)) DIE("%s: unexpected completion %s", what, wc_str(wc).c_str());
}

// The payload pattern: byte i of message `seed`.
inline uint8_t pat(uint32_t seed, size_t i) {
  uint64_t x = (static_cast<uint64_t>(seed) + 1) * 0x9E3779B97F4A7C15ull +
               static_cast<uint64_t>(i) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  return static_cast<uint8_t>(x >> 40);
}

// A message laid out over pieces of a buffer (an SGE list), with gaps.
struct Piece {
  size_t off;
  uint32_t len;
};

// `total` bytes in `parts` pieces from `base`, each followed by a `gap`.
std::vector<Piece> layout(size_t base, uint32_t total, int parts, uint32_t gap = 64) {
  std::vector<Piece> v;
  if (total == 0 || parts <= 0) return v;
  parts = std::min<int>(parts, static_cast<int>(total));
  size_t off = base;
  uint32_t left = total;
  for (int j = 0; j < parts; ++j) {
    // Unequal pieces: the first ones are smaller.
    const uint32_t share = total / static_cast<uint32_t>(parts) / 2 + static_cast<uint32_t>(j);
    uint32_t len = j + 1 == parts ? left : std::max<uint32_t>(1, share);
    len = std::min(len, left - static_cast<uint32_t>(parts - j - 1));
    v.push_back({off, len});
    off += len + gap;
    left -= len;
  }
  return v;
}

size_t span_end(const std::vector<Piece>& v, size_t base) {
  return v.empty() ? base : v.back().off + v.back().len;
}

struct Ep {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* scq = nullptr;
  ibv_cq* rcq = nullptr;
  ibv_mr* mr = nullptr;
  uint8_t* buf = nullptr;
  size_t len = 0;
  uint16_t lid = 0;
  ibv_gid gid{};
  std::vector<ibv_qp*> qps;
  std::vector<ibv_ah*> ahs;

  void open(size_t buflen, int access) {
    std::string why;
    ctx = harness::open_shm0(&why);
    REQUIRE(ctx != nullptr, "%s", why.c_str());
    ibv_port_attr pa{};
    REQUIRE(ibv_query_port(ctx, 1, &pa) == 0, "ibv_query_port");
    REQUIRE(pa.active_mtu == IBV_MTU_4096, "port 1 active_mtu %d; these tests assume 4096", pa.active_mtu);
    lid = pa.lid;
    REQUIRE(ibv_query_gid(ctx, 1, 0, &gid) == 0, "ibv_query_gid(port 1, index 0): %s", std::strerror(errno));
    pd = ibv_alloc_pd(ctx);
    REQUIRE(pd != nullptr, "ibv_alloc_pd: %s", std::strerror(errno));
    scq = ibv_create_cq(ctx, 1024, nullptr, nullptr, 0);
    rcq = ibv_create_cq(ctx, 1024, nullptr, nullptr, 0);
    REQUIRE(scq && rcq, "ibv_create_cq: %s", std::strerror(errno));
    void* p = nullptr;
    REQUIRE(posix_memalign(&p, 4096, buflen) == 0, "posix_memalign");
    buf = static_cast<uint8_t*>(p);
    len = buflen;
    std::memset(buf, kCanary, len);
    mr = ibv_reg_mr(pd, buf, len, access);
    REQUIRE(mr != nullptr, "ibv_reg_mr: %s", std::strerror(errno));
  }

  ibv_qp* qp(ibv_qp_type type, uint32_t recv_wr = 64) {
    ibv_qp_init_attr ia{};
    ia.send_cq = scq;
    ia.recv_cq = rcq;
    ia.qp_type = type;
    ia.cap.max_send_wr = 64;
    ia.cap.max_recv_wr = recv_wr;
    ia.cap.max_send_sge = 4;
    ia.cap.max_recv_sge = 4;
    ia.cap.max_inline_data = kInline;
    ibv_qp* q = ibv_create_qp(pd, &ia);
    REQUIRE(q != nullptr, "ibv_create_qp(%s): %s", type == IBV_QPT_UD ? "UD" : "UC", std::strerror(errno));
    REQUIRE(ia.cap.max_inline_data >= kInline, "ibv_create_qp(%s): max_inline_data %u, asked for %u",
            type == IBV_QPT_UD ? "UD" : "UC", ia.cap.max_inline_data, kInline);
    qps.push_back(q);
    return q;
  }

  // To port 1 with LID dlid (0: our own LID; every context on one device
  // shares port 1).
  ibv_ah* ah(bool global, const uint8_t* dgid, uint16_t dlid = 0) {
    ibv_ah_attr a{};
    a.dlid = dlid ? dlid : lid;
    a.port_num = 1;
    a.is_global = global ? 1 : 0;
    if (global) {
      std::memcpy(a.grh.dgid.raw, dgid, 16);
      a.grh.sgid_index = 0;
      a.grh.hop_limit = 1;
    }
    ibv_ah* h = ibv_create_ah(pd, &a);
    REQUIRE(h != nullptr, "ibv_create_ah(dlid %u, is_global %d): %s", a.dlid, a.is_global, std::strerror(errno));
    ahs.push_back(h);
    return h;
  }

  std::vector<ibv_sge> sges(const std::vector<Piece>& v) const {
    std::vector<ibv_sge> s;
    for (const auto& p : v) s.push_back(ibv_sge{reinterpret_cast<uintptr_t>(buf + p.off), p.len, mr->lkey});
    return s;
  }

  // Writes the pattern of `seed` over the pieces (logical bytes 0..).
  void fill(const std::vector<Piece>& v, uint32_t seed) {
    size_t i = 0;
    for (const auto& p : v)
      for (uint32_t k = 0; k < p.len; ++k) buf[p.off + k] = pat(seed, i++);
  }

  void close() {
    for (ibv_qp* q : qps) REQUIRE(ibv_destroy_qp(q) == 0, "ibv_destroy_qp");
    for (ibv_ah* h : ahs) REQUIRE(ibv_destroy_ah(h) == 0, "ibv_destroy_ah");
    REQUIRE(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
    REQUIRE(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0, "ibv_destroy_cq");
    int rc = ibv_dealloc_pd(pd);
    REQUIRE(rc == 0, "ibv_dealloc_pd after every AH was destroyed: %d", rc);
    REQUIRE(ibv_close_device(ctx) == 0, "ibv_close_device");
    std::free(buf);
  }
};

// The logical byte stream of a receive laid over pieces: byte i.
uint8_t* at(Ep& e, const std::vector<Piece>& v, size_t i) {
  for (const auto& p : v) {
    if (i < p.len) return e.buf + p.off + i;
    i -= p.len;
  }
  return nullptr;
}

// Checks a received message over pieces: logical bytes [from, from+n) are
// the pattern of seed; logical bytes after from+n and the gaps between
// pieces (up to `end`) still hold the canary.
void check_recv(Ep& e, const std::vector<Piece>& v, size_t from, uint32_t n, uint32_t seed, size_t region_base,
                size_t region_end, const char* what) {
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t got = *at(e, v, from + i);
    if (got != pat(seed, i))
      DIE("%s: payload byte %u of %u is 0x%02x, expected 0x%02x (byte %u of the next expected message: 0x%02x)",
          what, i, n, got, pat(seed, i), i, pat(seed + 1, i));
  }
  // Everything in [region_base, region_end) that is neither GRH nor payload.
  std::vector<bool> used(region_end - region_base, false);
  size_t i = 0;
  for (const auto& p : v)
    for (uint32_t k = 0; k < p.len; ++k, ++i)
      if (i < from + n) used[p.off + k - region_base] = true;
  for (size_t k = 0; k < used.size(); ++k)
    if (!used[k] && e.buf[region_base + k] != kCanary)
      DIE("%s: byte %zu of the receive region (outside the %zu bytes the message covers) was changed to 0x%02x", what,
          k, from + n, e.buf[region_base + k]);
}

int post_recv(ibv_qp* qp, uint64_t wr_id, std::vector<ibv_sge> sg) {
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sg.empty() ? nullptr : sg.data();
  wr.num_sge = static_cast<int>(sg.size());
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp, &wr, &bad);
}

struct Send {
  ibv_wr_opcode op = IBV_WR_SEND;
  uint64_t wr_id = 0;
  std::vector<ibv_sge> sg;
  ibv_ah* ah = nullptr;
  uint32_t rqpn = 0, rqkey = 0;
  uint32_t imm = 0;  // host order
  uint64_t raddr = 0;
  uint32_t rkey = 0;
  unsigned flags = IBV_SEND_SIGNALED;
};

int post_send(ibv_qp* qp, const Send& s, ibv_send_wr** bad_out = nullptr) {
  ibv_send_wr wr{};
  wr.wr_id = s.wr_id;
  std::vector<ibv_sge> sg = s.sg;
  wr.sg_list = sg.empty() ? nullptr : sg.data();
  wr.num_sge = static_cast<int>(sg.size());
  wr.opcode = s.op;
  wr.send_flags = s.flags;
  if (s.op == IBV_WR_SEND_WITH_IMM || s.op == IBV_WR_RDMA_WRITE_WITH_IMM) wr.imm_data = htonl(s.imm);
  if (s.ah) {
    wr.wr.ud.ah = s.ah;
    wr.wr.ud.remote_qpn = s.rqpn;
    wr.wr.ud.remote_qkey = s.rqkey;
  } else if (s.op == IBV_WR_ATOMIC_CMP_AND_SWP || s.op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = s.raddr;
    wr.wr.atomic.rkey = s.rkey;
    wr.wr.atomic.compare_add = 1;
    wr.wr.atomic.swap = 2;
  } else {
    wr.wr.rdma.remote_addr = s.raddr;
    wr.wr.rdma.rkey = s.rkey;
  }
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp, &wr, &bad);
  if (bad_out) *bad_out = bad == &wr ? reinterpret_cast<ibv_send_wr*>(1) : bad;  // 1: "our WR"
  return rc;
}

// Posts and waits for the signaled completion; returns it.
ibv_wc send_and_wait(Ep& e, ibv_qp* qp, const Send& s, const char* what) {
  int rc = post_send(qp, s);
  REQUIRE(rc == 0, "%s: ibv_post_send returned %d (%s)", what, rc, std::strerror(rc));
  ibv_wc wc = get_wc(e.scq, what);
  REQUIRE(wc.wr_id == s.wr_id, "%s: completion %s, expected wr_id %" PRIu64, what, wc_str(wc).c_str(), s.wr_id);
  return wc;
}

void send_ok(Ep& e, ibv_qp* qp, const Send& s, const char* what) {
  ibv_wc wc = send_and_wait(e, qp, s, what);
  REQUIRE(wc.status == IBV_WC_SUCCESS, "%s: sender completion %s, expected SUCCESS", what, wc_str(wc).c_str());
}

int qp_state(ibv_qp* qp) { return harness::qp_state(qp); }

// UD: RESET -> INIT -> RTR -> RTS with the masks the verbs man page gives.
void ud_up(ibv_qp* qp, uint32_t qkey, uint32_t sq_psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qkey = qkey;
  int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  REQUIRE(rc == 0, "UD RESET->INIT (STATE|PKEY_INDEX|PORT|QKEY): %d", rc);
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTR;
  rc = ibv_modify_qp(qp, &a, IBV_QP_STATE);
  REQUIRE(rc == 0, "UD INIT->RTR (STATE): %d", rc);
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = sq_psn;
  rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
  REQUIRE(rc == 0, "UD RTR->RTS (STATE|SQ_PSN): %d", rc);
}

// UC: connected to (dest_qpn, dlid).
void uc_up(ibv_qp* qp, uint32_t dest_qpn, uint16_t dlid, uint32_t rq_psn, uint32_t sq_psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  REQUIRE(rc == 0, "UC RESET->INIT: %d", rc);
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;  // messages of many packets
  a.dest_qp_num = dest_qpn;
  a.rq_psn = rq_psn;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN);
  REQUIRE(rc == 0, "UC INIT->RTR (STATE|AV|PATH_MTU|DEST_QPN|RQ_PSN): %d", rc);
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = sq_psn;
  rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN);
  REQUIRE(rc == 0, "UC RTR->RTS (STATE|SQ_PSN): %d", rc);
}

struct Hello {
  uint32_t magic = 0x44505544;
  uint32_t qpn[2] = {0, 0};
  uint32_t qkey = 0;
  uint16_t lid = 0;
  uint16_t pad = 0;
  uint8_t gid[16] = {};
  uint32_t rkey = 0;
  uint32_t pad2 = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
};

Hello hello_of(const Ep& e) {
  Hello h;
  for (size_t i = 0; i < e.qps.size() && i < 2; ++i) h.qpn[i] = e.qps[i]->qp_num;
  h.lid = e.lid;
  std::memcpy(h.gid, e.gid.raw, 16);
  h.rkey = e.mr->rkey;
  h.addr = reinterpret_cast<uintptr_t>(e.buf);
  h.len = e.len;
  return h;
}

// The server speaks first.
Hello exchange(const Hello& me, bool server) {
  Hello peer;
  if (server) {
    REQUIRE(harness::write_all(harness::kCtlFd, &me, sizeof me), "hello: write");
    REQUIRE(harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000), "hello: no hello from the client within 30 s");
  } else {
    REQUIRE(harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000), "hello: no hello from the server within 30 s");
    REQUIRE(harness::write_all(harness::kCtlFd, &me, sizeof me), "hello: write");
  }
  REQUIRE(peer.magic == me.magic, "hello: bad magic 0x%08x", peer.magic);
  return peer;
}

std::string hex(const uint8_t* p, size_t n) {
  std::string s;
  char b[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

// Checks a UD receive completion and its GRH area; `grh` points at the 40
// bytes in front of the payload (contiguous in these tests).
void check_ud_wc(const ibv_wc& wc, const char* what, uint64_t wr_id, uint32_t payload, bool global, uint32_t src_qp,
                 uint16_t slid, uint32_t my_qpn, bool has_imm, uint32_t imm, const uint8_t* grh, const uint8_t* sgid,
                 const uint8_t* dgid) {
  std::string w = wc_str(wc);
  REQUIRE(wc.status == IBV_WC_SUCCESS, "%s: %s", what, w.c_str());
  REQUIRE(wc.wr_id == wr_id, "%s: %s; receives complete in the order they were posted, expected wr_id %" PRIu64, what,
          w.c_str(), wr_id);
  REQUIRE(wc.opcode == IBV_WC_RECV, "%s: %s, expected opcode IBV_WC_RECV (%d)", what, w.c_str(), IBV_WC_RECV);
  REQUIRE(wc.byte_len == payload + kGrh, "%s: %s, expected byte_len %u (payload %u + 40 bytes of GRH area)", what,
          w.c_str(), payload + kGrh, payload);
  REQUIRE(!!(wc.wc_flags & IBV_WC_GRH) == global, "%s: %s: IBV_WC_GRH is %s, but the sender's AH %s", what,
          w.c_str(), (wc.wc_flags & IBV_WC_GRH) ? "set" : "clear", global ? "has a GRH" : "has no GRH");
  REQUIRE(!!(wc.wc_flags & IBV_WC_WITH_IMM) == has_imm, "%s: %s: IBV_WC_WITH_IMM is %s for a %s", what, w.c_str(),
          (wc.wc_flags & IBV_WC_WITH_IMM) ? "set" : "clear", has_imm ? "SEND_WITH_IMM" : "SEND");
  if (has_imm) REQUIRE(ntohl(wc.imm_data) == imm, "%s: %s, expected imm 0x%08x", what, w.c_str(), imm);
  REQUIRE(wc.src_qp == src_qp, "%s: %s, expected src_qp %u (the sending QP)", what, w.c_str(), src_qp);
  REQUIRE(wc.slid == slid, "%s: %s, expected slid %u (the sender port's LID)", what, w.c_str(), slid);
  REQUIRE(wc.qp_num == my_qpn, "%s: %s, expected qp_num %u", what, w.c_str(), my_qpn);
  if (global) {
    REQUIRE(std::memcmp(grh + 8, sgid, 16) == 0, "%s: GRH sgid (bytes 8..23) is %s, expected the sender's GID %s", what,
            hex(grh + 8, 16).c_str(), hex(sgid, 16).c_str());
    REQUIRE(std::memcmp(grh + 24, dgid, 16) == 0,
            "%s: GRH dgid (bytes 24..39) is %s, expected the destination GID %s", what, hex(grh + 24, 16).c_str(),
            hex(dgid, 16).c_str());
  }
}

// ---------------------------------------------------------------------------
// UD: SENDs through an AH (with or without GRH), reply through an AH made
// from the completion.

struct UdMsg {
  uint32_t size;
  int send_parts;
  int recv_parts;  // 1: one SGE for GRH + payload; 2: 40-byte GRH SGE + payload SGE(s)
  bool imm;
  bool inl;  // IBV_SEND_INLINE
};

const std::vector<UdMsg>& ud_msgs() {
  static const std::vector<UdMsg> m = {
      {0, 0, 1, false, false},    {1, 1, 1, false, false},    {1, 1, 2, true, true},
      {40, 2, 2, false, false},   {1000, 3, 1, true, false},  {1000, 3, 3, false, false},
      {2048, 2, 2, false, false}, {4095, 4, 1, false, false}, {4096, 1, 1, false, false},
      {4096, 4, 3, true, false},  {64, 3, 1, true, true},     {17, 2, 2, false, true},
      {3, 3, 1, true, false},     {4096, 3, 2, false, false},
  };
  return m;
}
constexpr size_t kUdSlot = 16384;  // per-message receive region
constexpr uint32_t kReplySize = 300;
constexpr uint32_t kReplySeed = 0xABC;

// Receive pieces: the GRH area and the payload, over `parts` SGEs.
std::vector<Piece> ud_recv_layout(size_t base, uint32_t payload_room, int parts) {
  std::vector<Piece> v;
  if (parts <= 1) return {Piece{base, kGrh + payload_room}};
  v.push_back({base, kGrh});
  auto rest = layout(base + kGrh + 64, payload_room, parts - 1);
  v.insert(v.end(), rest.begin(), rest.end());
  return v;
}

int ud_server(bool global) {
  Ep e;
  e.open(ud_msgs().size() * kUdSlot + kUdSlot, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kServerQkey, kServerSqPsn);
  const auto& msgs = ud_msgs();
  std::vector<std::vector<Piece>> rl(msgs.size());
  for (size_t k = 0; k < msgs.size(); ++k) {
    rl[k] = ud_recv_layout(k * kUdSlot, kMtu, msgs[k].recv_parts);
    int rc = post_recv(qp, k, e.sges(rl[k]));
    REQUIRE(rc == 0, "post_recv %zu: %d", k, rc);
  }
  Hello me = hello_of(e);
  me.qkey = kServerQkey;
  Hello cl = exchange(me, true);
  say("GO");
  ibv_wc last{};
  for (size_t k = 0; k < msgs.size(); ++k) {
    const UdMsg& m = msgs[k];
    char what[160];
    std::snprintf(what, sizeof what, "message %zu (%u bytes%s%s, %d send SGEs, %d receive SGEs, %s)", k, m.size,
                  m.imm ? ", with imm" : "", m.inl ? ", inline" : "", m.send_parts, m.recv_parts,
                  global ? "GRH" : "no GRH");
    ibv_wc wc = get_wc(e.rcq, what);
    uint8_t* grh = e.buf + rl[k][0].off;
    check_ud_wc(wc, what, k, m.size, global, cl.qpn[k % 2], cl.lid, qp->qp_num, m.imm,
                0xC0DE0000u + static_cast<uint32_t>(k), grh, cl.gid, e.gid.raw);
    check_recv(e, rl[k], kGrh, m.size, static_cast<uint32_t>(k), k * kUdSlot, span_end(rl[k], k * kUdSlot) + 64, what);
    last = wc;
  }
  expect_silence(e.rcq, "after the last message");
  hear("SENT");
  // Reply to the sender of the last message through an AH made from its
  // completion and GRH area.
  uint8_t* grh = e.buf + (msgs.size() - 1) * kUdSlot;
  ibv_ah* ah = ibv_create_ah_from_wc(e.pd, &last, reinterpret_cast<ibv_grh*>(grh), 1);
  REQUIRE(ah != nullptr,
          "ibv_create_ah_from_wc(wc %s, GRH area %s): %s (libibverbs needs IP version 6 in the top 4 bits of the GRH "
          "and the dgid in the port's GID table)",
          wc_str(last).c_str(), hex(grh, 40).c_str(), std::strerror(errno));
  e.ahs.push_back(ah);
  size_t src = msgs.size() * kUdSlot;
  auto sl = layout(src, kReplySize, 2);
  e.fill(sl, kReplySeed);
  Send s;
  s.wr_id = 500;
  s.sg = e.sges(sl);
  s.ah = ah;
  s.rqpn = last.src_qp;
  s.rqkey = kClientQkey;
  s.op = IBV_WR_SEND_WITH_IMM;
  s.imm = 0xFEED;
  send_ok(e, qp, s, "reply through the AH from ibv_create_ah_from_wc");
  say("REPLIED");
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

int ud_client(bool global) {
  Ep e;
  const auto& msgs = ud_msgs();
  e.open(2 * kUdSlot + 4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qa = e.qp(IBV_QPT_UD);
  ibv_qp* qb = e.qp(IBV_QPT_UD);
  ud_up(qa, kClientQkey, kClientSqPsn);
  ud_up(qb, kClientQkey, kClientSqPsn);
  // The reply goes to the sender of the last message.
  ibv_qp* replyq = (msgs.size() - 1) % 2 ? qb : qa;
  auto rl = ud_recv_layout(0, kMtu, 1);
  REQUIRE(post_recv(replyq, 900, e.sges(rl)) == 0, "post_recv");
  Hello me = hello_of(e);
  me.qkey = kClientQkey;
  Hello sv = exchange(me, false);
  ibv_ah* ah = e.ah(global, sv.gid, sv.lid);
  hear("GO");
  for (size_t k = 0; k < msgs.size(); ++k) {
    const UdMsg& m = msgs[k];
    size_t base = 2 * kUdSlot;
    std::memset(e.buf + base, 0, e.len - base);
    auto sl = layout(base, m.size, m.send_parts);
    e.fill(sl, static_cast<uint32_t>(k));
    Send s;
    s.wr_id = 100 + k;
    s.sg = e.sges(sl);
    s.ah = ah;
    s.rqpn = sv.qpn[0];
    s.rqkey = kServerQkey;
    s.op = m.imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    s.imm = 0xC0DE0000u + static_cast<uint32_t>(k);
    if (m.inl) s.flags |= IBV_SEND_INLINE;
    char what[96];
    std::snprintf(what, sizeof what, "message %zu (%u bytes%s)", k, m.size, m.inl ? ", inline" : "");
    ibv_qp* q = k % 2 ? qb : qa;
    if (m.inl) {
      // Inline: the data is taken at post time; the buffer may change at once.
      int rc = post_send(q, s);
      REQUIRE(rc == 0, "%s: ibv_post_send: %d", what, rc);
      std::memset(e.buf + base, 0xA5, e.len - base);
      ibv_wc wc = get_wc(e.scq, what);
      REQUIRE(wc.wr_id == s.wr_id && wc.status == IBV_WC_SUCCESS, "%s: %s", what, wc_str(wc).c_str());
    } else {
      send_ok(e, q, s, what);
    }
  }
  say("SENT");
  hear("REPLIED");
  ibv_wc wc = get_wc(e.rcq, "the server's reply");
  check_ud_wc(wc, "the server's reply", 900, kReplySize, global, sv.qpn[0], sv.lid, replyq->qp_num, true, 0xFEED,
              e.buf, sv.gid, e.gid.raw);
  check_recv(e, rl, kGrh, kReplySize, kReplySeed, 0, span_end(rl, 0), "the server's reply");
  expect_silence(e.rcq, "after the reply", 50);
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD fan-out: one client QP, one chain of WRs (one ibv_post_send) to two
// server QPs, alternately through an AH with and without a GRH.

constexpr int kFanMsgs = 8;
uint32_t fan_size(int i) { return 100 + 37 * static_cast<uint32_t>(i) * static_cast<uint32_t>(i); }
bool fan_global(int i) { return (i / 2) % 2 == 1; }
bool fan_imm(int i) { return i % 3 == 0; }

int fan_server() {
  Ep e;
  e.open(kFanMsgs * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* s[2] = {e.qp(IBV_QPT_UD), e.qp(IBV_QPT_UD)};
  ud_up(s[0], kServerQkey, kServerSqPsn);
  ud_up(s[1], kServerQkey, kServerSqPsn);
  std::vector<std::vector<Piece>> rl(kFanMsgs);
  for (int i = 0; i < kFanMsgs; ++i) {
    rl[static_cast<size_t>(i)] = ud_recv_layout(static_cast<size_t>(i) * 8192, 4096, 1 + i % 2);
    REQUIRE(post_recv(s[i % 2], static_cast<uint64_t>(i), e.sges(rl[static_cast<size_t>(i)])) == 0, "post_recv");
  }
  Hello me = hello_of(e);
  Hello cl = exchange(me, true);
  say("GO");
  int next[2] = {0, 1};  // the next message index each server QP expects
  for (int n = 0; n < kFanMsgs; ++n) {
    ibv_wc wc = get_wc(e.rcq, "fan-out message");
    int j = wc.qp_num == s[0]->qp_num ? 0 : wc.qp_num == s[1]->qp_num ? 1 : -1;
    REQUIRE(j >= 0, "completion %s for neither server QP (%u, %u)", wc_str(wc).c_str(), s[0]->qp_num, s[1]->qp_num);
    int i = next[j];
    REQUIRE(i < kFanMsgs, "server QP %d got more messages than were sent to it: %s", j, wc_str(wc).c_str());
    next[j] += 2;
    char what[160];
    std::snprintf(what, sizeof what, "fan-out message %d (%u bytes, to server QP %d, %s%s)", i, fan_size(i), j,
                  fan_global(i) ? "GRH" : "no GRH", fan_imm(i) ? ", with imm" : "");
    const size_t base = static_cast<size_t>(i) * 8192;
    check_ud_wc(wc, what, static_cast<uint64_t>(i), fan_size(i), fan_global(i), cl.qpn[0], cl.lid, s[j]->qp_num,
                fan_imm(i), 0xF00 + static_cast<uint32_t>(i), e.buf + base, cl.gid, e.gid.raw);
    check_recv(e, rl[static_cast<size_t>(i)], kGrh, fan_size(i), 300 + static_cast<uint32_t>(i), base, base + 8192,
               what);
  }
  expect_silence(e.rcq, "after the fan-out chain");
  hear("SENT");
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

int fan_client() {
  Ep e;
  e.open(kFanMsgs * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qa = e.qp(IBV_QPT_UD);
  ud_up(qa, kClientQkey, kClientSqPsn);
  Hello sv = exchange(hello_of(e), false);
  ibv_ah* ah[2] = {e.ah(false, nullptr, sv.lid), e.ah(true, sv.gid, sv.lid)};
  hear("GO");
  std::vector<ibv_send_wr> wr(kFanMsgs);
  std::vector<std::vector<ibv_sge>> sg(kFanMsgs);
  for (int i = 0; i < kFanMsgs; ++i) {
    auto sl = layout(static_cast<size_t>(i) * 8192, fan_size(i), 1 + i % 3);
    e.fill(sl, 300 + static_cast<uint32_t>(i));
    sg[static_cast<size_t>(i)] = e.sges(sl);
    ibv_send_wr& w = wr[static_cast<size_t>(i)];
    w = ibv_send_wr{};
    w.wr_id = static_cast<uint64_t>(i);
    w.sg_list = sg[static_cast<size_t>(i)].data();
    w.num_sge = static_cast<int>(sg[static_cast<size_t>(i)].size());
    w.opcode = fan_imm(i) ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    w.imm_data = htonl(0xF00 + static_cast<uint32_t>(i));
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.ud.ah = ah[fan_global(i) ? 1 : 0];
    w.wr.ud.remote_qpn = sv.qpn[i % 2];
    w.wr.ud.remote_qkey = kServerQkey;
    w.next = i + 1 < kFanMsgs ? &wr[static_cast<size_t>(i) + 1] : nullptr;
  }
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qa, wr.data(), &bad);
  REQUIRE(rc == 0, "ibv_post_send of a chain of %d UD WRs to two QPs: %d", kFanMsgs, rc);
  for (int i = 0; i < kFanMsgs; ++i) {
    ibv_wc wc = get_wc(e.scq, "fan-out send");
    REQUIRE(wc.wr_id == static_cast<uint64_t>(i) && wc.status == IBV_WC_SUCCESS,
            "fan-out send %d: %s (sends complete in order)", i, wc_str(wc).c_str());
    REQUIRE(wc.opcode == IBV_WC_SEND, "fan-out send %d: %s, expected opcode IBV_WC_SEND", i, wc_str(wc).c_str());
  }
  say("SENT");
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD many senders: three client threads, each with its own context and QP,
// send bursts to one server QP at the same time; with enough receives
// posted, every message arrives exactly once, intact.

constexpr int kManyThreads = 3;
constexpr int kManyPerThread = 100;
constexpr int kManyTotal = kManyThreads * kManyPerThread;
constexpr size_t kManySlot = kGrh + kMtu + 24;
uint32_t many_size(int t, int s) { return static_cast<uint32_t>((t * 7919 + s * 131) % 4097); }  // 0 .. 4096
uint32_t many_seed(int t, int s) { return 50000 + static_cast<uint32_t>(t * 1000 + s); }

int many_server() {
  Ep e;
  e.open(kManyTotal * kManySlot + 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD, kManyTotal + 8);
  ud_up(qp, kServerQkey, kServerSqPsn);
  for (int k = 0; k < kManyTotal; ++k) {
    int rc = post_recv(qp, static_cast<uint64_t>(k), {ibv_sge{reinterpret_cast<uintptr_t>(e.buf + k * kManySlot),
                                                                static_cast<uint32_t>(kManySlot), e.mr->lkey}});
    REQUIRE(rc == 0, "post_recv %d of %d: %d", k, kManyTotal, rc);
  }
  exchange(hello_of(e), true);
  std::string line;
  REQUIRE(ctl().poll_line(&line, 30000) == 1, "no QPN list from the client");
  uint32_t qpn[kManyThreads] = {};
  REQUIRE(std::sscanf(line.c_str(), "QPNS %u %u %u", &qpn[0], &qpn[1], &qpn[2]) == 3, "bad line \"%s\"",
          line.c_str());
  say("GO");
  std::vector<int> seen(kManyTotal, 0), slot_done(kManyTotal, 0);
  int last_seq[kManyThreads] = {-1, -1, -1}, out_of_order = 0;
  int misordered = 0;  // receive completions not in the order the receives were posted
  std::string first_misordered;
  for (int n = 0; n < kManyTotal; ++n) {
    char what[96];
    std::snprintf(what, sizeof what, "completion %d of %d from %d concurrent senders", n, kManyTotal, kManyThreads);
    ibv_wc wc = get_wc(e.rcq, what);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && (wc.wc_flags & IBV_WC_WITH_IMM) &&
                wc.wr_id < static_cast<uint64_t>(kManyTotal),
            "%s: %s", what, wc_str(wc).c_str());
    const int k = static_cast<int>(wc.wr_id);  // the receive (and its slot)
    REQUIRE(slot_done[static_cast<size_t>(k)]++ == 0, "%s: %s: receive %d completed twice", what, wc_str(wc).c_str(),
            k);
    if (k != n && misordered++ == 0)
      first_misordered = "completion " + std::to_string(n) + " is " + wc_str(wc) + " (receive " + std::to_string(k) +
                         "), but receive " + std::to_string(n) + " was posted before it";
    const uint32_t imm = ntohl(wc.imm_data);
    const int t = static_cast<int>(imm >> 16), sq = static_cast<int>(imm & 0xFFFF);
    REQUIRE(t < kManyThreads && sq < kManyPerThread, "%s: %s: imm names no message that was sent", what,
            wc_str(wc).c_str());
    REQUIRE(seen[static_cast<size_t>(t * kManyPerThread + sq)]++ == 0, "%s: message %d of sender %d arrived twice",
            what, sq, t);
    if (sq < last_seq[t]) ++out_of_order;
    last_seq[t] = std::max(last_seq[t], sq);
    // Every context on shm0 shares port 1: the senders' LID and GID are ours.
    check_ud_wc(wc, what, static_cast<uint64_t>(k), many_size(t, sq), t == 1, qpn[t], e.lid, qp->qp_num, true, imm,
                e.buf + k * kManySlot, e.gid.raw, e.gid.raw);
    std::vector<Piece> rl = {Piece{k * kManySlot, static_cast<uint32_t>(kManySlot)}};
    check_recv(e, rl, kGrh, many_size(t, sq), many_seed(t, sq), k * kManySlot, (k + 1) * kManySlot, what);
  }
  expect_silence(e.rcq, "after every message of the concurrent senders");
  REQUIRE(misordered == 0,
          "receives of one QP must complete in the order they were posted; %d of %d completions were out of order, "
          "the first: %s (every message arrived once and intact)",
          misordered, kManyTotal, first_misordered.c_str());
  hear("SENT");
  say("BYE");
  e.close();
  note("OK (%d messages; %d arrived after a later one of the same sender)", kManyTotal, out_of_order);
  return 0;
}

int many_client() {
  Hello me;  // the senders live in their own contexts; the main thread only talks
  Hello sv = exchange(me, false);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  uint32_t qpn[kManyThreads] = {};
  std::vector<std::thread> th;
  for (int t = 0; t < kManyThreads; ++t)
    th.emplace_back([&, t] {
      Ep e;
      e.open(kMtu * 2 + 4096, IBV_ACCESS_LOCAL_WRITE);
      ibv_qp* qp = e.qp(IBV_QPT_UD);
      ud_up(qp, kClientQkey, kClientSqPsn);
      ibv_ah* ah = e.ah(t == 1, sv.gid, sv.lid);
      qpn[t] = qp->qp_num;
      ready.fetch_add(1);
      auto until = Clock::now() + std::chrono::seconds(30);
      while (!go.load()) {
        REQUIRE(Clock::now() < until, "sender %d: never told to start", t);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      int outstanding = 0;
      for (int sq = 0; sq < kManyPerThread; ++sq) {
        // Two source buffers, alternately: a buffer is rewritten only after
        // the send that used it completed.
        if (outstanding == 2) {
          ibv_wc wc = get_wc(e.scq, "concurrent sender");
          REQUIRE(wc.status == IBV_WC_SUCCESS, "sender %d: %s", t, wc_str(wc).c_str());
          --outstanding;
        }
        auto sl = layout(static_cast<size_t>(sq % 2) * (kMtu + 1024), many_size(t, sq), 1 + sq % 3);
        e.fill(sl, many_seed(t, sq));
        Send s;
        s.op = IBV_WR_SEND_WITH_IMM;
        s.wr_id = static_cast<uint64_t>(sq);
        s.sg = e.sges(sl);
        s.ah = ah;
        s.rqpn = sv.qpn[0];
        s.rqkey = kServerQkey;
        s.imm = (static_cast<uint32_t>(t) << 16) | static_cast<uint32_t>(sq);
        int rc = post_send(qp, s);
        REQUIRE(rc == 0, "sender %d message %d: ibv_post_send: %d", t, sq, rc);
        ++outstanding;
      }
      while (outstanding) {
        ibv_wc wc = get_wc(e.scq, "concurrent sender");
        REQUIRE(wc.status == IBV_WC_SUCCESS, "sender %d: %s", t, wc_str(wc).c_str());
        --outstanding;
      }
      ready.fetch_add(1);
      while (go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      e.close();
    });
  auto until = Clock::now() + std::chrono::seconds(30);
  while (ready.load() < kManyThreads) {
    REQUIRE(Clock::now() < until, "the sender threads did not come up");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  say("QPNS " + std::to_string(qpn[0]) + " " + std::to_string(qpn[1]) + " " + std::to_string(qpn[2]));
  hear("GO");
  go.store(true);
  until = Clock::now() + std::chrono::seconds(60);
  while (ready.load() < 2 * kManyThreads) {
    REQUIRE(Clock::now() < until, "the sender threads did not finish within 60 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  say("SENT");
  hear("BYE");
  go.store(false);
  for (auto& t : th) t.join();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD: a sender is SIGKILLed while it streams to the server QP (three rounds,
// a fresh sender process each). Whatever the dead sender was in the middle
// of, the server's QP stays RTS, every receive that completes successfully
// holds a whole, intact message, and a new sender's messages then arrive.

constexpr int kDeadRounds = 3;
constexpr uint32_t kDeadSize = 2000;
constexpr int kDeadSlots = 512;
constexpr int kDeadPosted = 256;
constexpr int kDeadFinal = 20;
constexpr size_t kDeadSlot = kGrh + kDeadSize + 24;
uint32_t dead_seed(uint32_t imm) { return 70000u + imm * 7u; }

int dead_server() {
  Ep e;
  e.open(kDeadSlots * kDeadSlot + 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD, kDeadSlots + 8);
  ud_up(qp, kServerQkey, kServerSqPsn);
  int next_slot = 0;
  std::deque<std::pair<long, int>> posted;  // (post number, slot) of the pending receives, in posting order
  long post_seq = 0, max_done_seq = -1;
  auto post_slot = [&](int j) {
    posted.push_back({post_seq++, j});
    std::memset(e.buf + static_cast<size_t>(j) * kDeadSlot, kCanary, kDeadSlot);
    int rc = post_recv(qp, static_cast<uint64_t>(j),
                       {ibv_sge{reinterpret_cast<uintptr_t>(e.buf + static_cast<size_t>(j) * kDeadSlot),
                                static_cast<uint32_t>(kDeadSlot), e.mr->lkey}});
    REQUIRE(rc == 0,
            "post_recv of slot %d returned %d (%s) with %zu receives pending on a QP created with max_recv_wr %d "
            "(after %ld posts; a sender was killed while it delivered into this QP)",
            j, rc, std::strerror(rc), posted.size() - 1, kDeadSlots + 8, post_seq);
  };
  for (; next_slot < kDeadPosted; ++next_slot) post_slot(next_slot);
  exchange(hello_of(e), true);
  long good = 0, final_good = 0;
  int misordered = 0;  // receive completions not in the order the receives were posted
  std::string first_misordered;
  std::vector<std::string> errors;
  // Checks one completion; reposts its slot.
  auto take = [&](const ibv_wc& wc, const char* phase) {
    const int j = static_cast<int>(wc.wr_id);
    REQUIRE(j >= 0 && j < kDeadSlots, "%s: completion with an unknown wr_id: %s", phase, wc_str(wc).c_str());
    auto it = std::find_if(posted.begin(), posted.end(), [j](const auto& x) { return x.second == j; });
    REQUIRE(it != posted.end(), "%s: %s: slot %d is not posted", phase, wc_str(wc).c_str(), j);
    if (it != posted.begin() && misordered++ == 0)
      first_misordered = std::string(phase) + ": " + wc_str(wc) + ", but the receive of slot " +
                         std::to_string(posted.front().second) + " was posted before it";
    max_done_seq = std::max(max_done_seq, it->first);
    posted.erase(it);
    if (wc.status != IBV_WC_SUCCESS) {
      errors.push_back(std::string(phase) + ": " + wc_str(wc));
    } else {
      const uint32_t imm = ntohl(wc.imm_data);
      char what[160];
      std::snprintf(what, sizeof what, "%s: message imm 0x%08x in slot %d", phase, imm, j);
      check_ud_wc(wc, what, wc.wr_id, kDeadSize, false, wc.src_qp, e.lid, qp->qp_num, true, imm,
                  nullptr, nullptr, nullptr);
      const size_t base = static_cast<size_t>(j) * kDeadSlot;
      std::vector<Piece> rl = {Piece{base, static_cast<uint32_t>(kDeadSlot)}};
      check_recv(e, rl, kGrh, kDeadSize, dead_seed(imm), base, base + kDeadSlot, what);
      ++good;
      if ((imm >> 24) == 0xFF) ++final_good;
    }
    post_slot(j);
  };
  for (int r = 0; r < kDeadRounds; ++r) {
    say("BLAST " + std::to_string(r));
    const std::string killed = "KILLED " + std::to_string(r);
    auto until = Clock::now() + std::chrono::seconds(30);
    std::string line;
    for (;;) {
      REQUIRE(Clock::now() < until, "round %d: no \"%s\" within 30 s", r, killed.c_str());
      ibv_wc wc{};
      int n = ibv_poll_cq(e.rcq, 1, &wc);
      REQUIRE(n >= 0, "ibv_poll_cq: %d", n);
      if (n == 1) {
        take(wc, "while a sender streams and is killed");
        continue;
      }
      int got = ctl().poll_line(&line, 0);
      REQUIRE(got >= 0, "the client closed the control channel (it failed; see its output)");
      if (got == 1) {
        REQUIRE(line == killed, "got \"%s\", expected \"%s\"", line.c_str(), killed.c_str());
        break;
      }
    }
    // Late completions of the dead sender's messages.
    ibv_wc wc{};
    while (harness::poll_one(e.rcq, &wc, 300)) take(wc, "after the sender was killed");
    REQUIRE(qp_state(qp) == IBV_QPS_RTS, "round %d: server QP state %s after a sender was killed", r,
            harness::qp_state_name(qp_state(qp)));
  }
  // A new sender sends batches of kDeadFinal SENDs until kDeadFinal of
  // them arrived. (A sender killed between reserving a slot of our receive
  // CQ and publishing it holds back the completions behind that slot until
  // our poll gives the slot up, after 2 s: until then the receives it took
  // are not reposted, the queue may be empty, and a datagram that finds no
  // receive is dropped, as UD does.)
  say("FINAL");
  auto until = Clock::now() + std::chrono::seconds(25);
  while (final_good < kDeadFinal) {
    REQUIRE(Clock::now() < until,
            "only %ld of %d messages of a new sender (sent in batches after the killed senders, each completed "
            "successfully at the sender) arrived within 25 s; the server QP is %s with %zu receives posted (%ld good "
            "completions in all; %zu error completions)",
            final_good, kDeadFinal, harness::qp_state_name(qp_state(qp)), posted.size(), good, errors.size());
    ibv_wc wc{};
    if (harness::poll_one(e.rcq, &wc, 100)) take(wc, "from the new sender");
  }
  say("ENOUGH");
  hear("SENT");
  // The rest of the last batch: every SEND completed at the sender before SENT.
  for (ibv_wc wc{}; harness::poll_one(e.rcq, &wc, 300);) take(wc, "from the new sender");
  expect_silence(e.rcq, "after the new sender's messages");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "server QP state %s", harness::qp_state_name(qp_state(qp)));
  // Receives passed over: still pending although a later one completed.
  std::string holes;
  int nholes = 0;
  for (const auto& x : posted)
    if (x.first < max_done_seq) {
      ++nholes;
      holes += " " + std::to_string(x.second);
    }
  REQUIRE(misordered == 0,
          "receives of one QP must complete in the order they were posted; %d completions were out of order, the "
          "first: %s. %d receive(s) were passed over and never completed at all (slot%s), although later ones did "
          "(%ld good completions, %zu error completions)",
          misordered, first_misordered.c_str(), nholes, holes.c_str(), good, errors.size());
  say("BYE");
  e.close();
  for (const auto& x : errors) note("error completion: %s", x.c_str());
  note("OK (%ld good messages, %zu error completions)", good, errors.size());
  return 0;
}

// A SEND_WITH_IMM of the scenario's message `imm` to the server's QP, its
// kDeadSize bytes (dead_seed(imm)) written into pieces `sl` of e's buffer.
Send dead_send(Ep& e, ibv_ah* ah, const Hello& sv, uint64_t wr_id, uint32_t imm, const std::vector<Piece>& sl) {
  e.fill(sl, dead_seed(imm));
  Send s;
  s.op = IBV_WR_SEND_WITH_IMM;
  s.wr_id = wr_id;
  s.sg = e.sges(sl);
  s.ah = ah;
  s.rqpn = sv.qpn[0];
  s.rqkey = kServerQkey;
  s.imm = imm;
  return s;
}

// The streaming sender (a child process; it never returns: it is killed).
[[noreturn]] void dead_blaster(const Hello& sv, int round, int ready_fd) {
  g_role += " sender " + std::to_string(round);
  Ep e;
  e.open(32 * 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kClientQkey, kClientSqPsn);
  ibv_ah* ah = e.ah(false, nullptr);
  int outstanding = 0;
  bool told = false;
  auto until = Clock::now() + std::chrono::seconds(30);
  for (uint32_t sq = 0; Clock::now() < until; ++sq) {
    if (outstanding == 16) {
      ibv_wc wc = get_wc(e.scq, "streaming sender");
      REQUIRE(wc.status == IBV_WC_SUCCESS, "%s", wc_str(wc).c_str());
      --outstanding;
      if (!told) {
        told = true;
        char c = 'r';
        REQUIRE(::write(ready_fd, &c, 1) == 1, "ready pipe");
      }
    }
    const uint32_t imm = (static_cast<uint32_t>(round) << 24) | (sq & 0xFFFFFF);
    const Send s = dead_send(e, ah, sv, sq, imm,
                             layout(static_cast<size_t>(sq % 32) * 4096, kDeadSize, 1 + static_cast<int>(sq % 3), 16));
    int rc = post_send(qp, s);
    REQUIRE(rc == 0, "ibv_post_send: %d", rc);
    ++outstanding;
  }
  DIE("not killed within 30 s");
}

int dead_client() {
  Hello me;  // no context in this process until the senders are dead
  Hello sv = exchange(me, false);
  for (int r = 0; r < kDeadRounds; ++r) {
    hear("BLAST " + std::to_string(r));
    int p[2];
    REQUIRE(::pipe(p) == 0, "pipe");
    pid_t pid = ::fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
      ::close(p[0]);
      dead_blaster(sv, r, p[1]);
    }
    ::close(p[1]);
    pollfd pf{p[0], POLLIN, 0};
    REQUIRE(::poll(&pf, 1, 20000) == 1, "round %d: the sender did not start streaming within 20 s", r);
    char c;
    REQUIRE(::read(p[0], &c, 1) == 1, "round %d: the sender died before it streamed", r);
    ::close(p[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 30 * r));
    ::kill(pid, SIGKILL);
    int st = 0;
    REQUIRE(::waitpid(pid, &st, 0) == pid, "waitpid");
    REQUIRE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "round %d: the sender ended on its own (status 0x%x)", r, st);
    say("KILLED " + std::to_string(r));
  }
  hear("FINAL");
  auto t_final = Clock::now();
  Ep e;
  e.open(4 * 4096, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kClientQkey, kClientSqPsn);
  ibv_ah* ah = e.ah(false, nullptr, sv.lid);
  // Batches of kDeadFinal until the server has kDeadFinal of them (see
  // dead_server), one every 500 ms at most.
  int batch = 0;
  for (;; ++batch) {
    REQUIRE(batch < 50, "the server did not get %d of the new sender's SENDs in %d batches of %d", kDeadFinal, batch,
            kDeadFinal);
    for (uint32_t i = 0; i < kDeadFinal; ++i) {
      const uint32_t imm = 0xFF000000u | static_cast<uint32_t>(batch) << 8 | i;
      send_ok(e, qp, dead_send(e, ah, sv, i, imm, layout(0, kDeadSize, 2)),
              "a new sender's SEND after the killed ones");
    }
    std::string line;
    const int got = ctl().poll_line(&line, 500);
    REQUIRE(got >= 0, "the server closed the control channel (it failed; see its output)");
    if (got == 1) {
      REQUIRE(line == "ENOUGH", "got \"%s\", expected \"ENOUGH\"", line.c_str());
      break;
    }
  }
  note("the server had %d of the new sender's SENDs %.0f ms after FINAL, in %d batch(es) of %d", kDeadFinal,
       std::chrono::duration<double, std::milli>(Clock::now() - t_final).count(), batch + 1, kDeadFinal);
  say("SENT");
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD: the receiving process dies (exits without destroying anything) while a
// sender streams to it. Datagrams to a QP that is gone are lost: every send
// still completes successfully, promptly, and the sender's QP stays RTS.

constexpr int kDeadpeerRecvs = 1024;
constexpr int kDeadpeerThreads = 3;

int deadpeer_server() {
  Ep e;
  e.open(kDeadpeerRecvs * 4160, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD, kDeadpeerRecvs);
  ud_up(qp, kServerQkey, kServerSqPsn);
  // Receives for a while: the senders are writing into them when we vanish.
  for (int k = 0; k < kDeadpeerRecvs; ++k)
    REQUIRE(post_recv(qp, static_cast<uint64_t>(k),
                      {ibv_sge{reinterpret_cast<uintptr_t>(e.buf + k * 4160), 4160, e.mr->lkey}}) == 0,
            "post_recv");
  exchange(hello_of(e), true);
  say("GO");
  hear("STREAMING");
  for (int k = 0; k < 2; ++k) {
    ibv_wc wc = get_wc(e.rcq, "a message from the streaming senders");
    REQUIRE(wc.status == IBV_WC_SUCCESS, "%s", wc_str(wc).c_str());
  }
  note("exiting without cleanup while the client streams");
  std::_Exit(0);  // as if killed: nothing destroyed
}

int deadpeer_client() {
  Hello me;  // the senders have their own contexts
  Hello sv = exchange(me, false);
  hear("GO");
  std::atomic<bool> dead{false};
  std::atomic<int> started{0};
  std::atomic<long> after_death_total{0};
  std::vector<std::thread> th;
  for (int t = 0; t < kDeadpeerThreads; ++t)
    th.emplace_back([&, t] {
      Ep e;
      e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
      ibv_qp* qp = e.qp(IBV_QPT_UD);
      ud_up(qp, kClientQkey, kClientSqPsn);
      ibv_ah* ah = e.ah(t == 1, sv.gid, sv.lid);
      int outstanding = 0;
      long done = 0, after_death = 0;
      auto until = Clock::now() + std::chrono::seconds(40);
      for (uint32_t sq = 0; after_death < 300; ++sq) {
        REQUIRE(Clock::now() < until, "sender %d: the server did not exit within 40 s (%ld sends completed)", t, done);
        if (outstanding == 2) {
          bool was_dead = dead.load();
          char what[120];
          std::snprintf(what, sizeof what, "sender %d: UD send %ld (%s)", t, done,
                        was_dead ? "the receiving process has exited" : "to a live receiver");
          ibv_wc wc = get_wc(e.scq, what, 20000);  // generous: sanitizer builds on a loaded 2-core machine
          REQUIRE(wc.status == IBV_WC_SUCCESS, "%s: %s", what, wc_str(wc).c_str());
          --outstanding;
          if (++done == 5) started.fetch_add(1);
          if (was_dead) ++after_death;
        }
        auto sl = layout(static_cast<size_t>(sq % 2) * 8192, (sq * 131 + static_cast<uint32_t>(t) * 7919) % 4097,
                         1 + static_cast<int>(sq % 3));
        e.fill(sl, sq);
        Send s;
        s.op = IBV_WR_SEND_WITH_IMM;
        s.imm = sq;
        s.wr_id = sq;
        s.sg = e.sges(sl);
        s.ah = ah;
        s.rqpn = sv.qpn[0];
        s.rqkey = kServerQkey;
        int rc = post_send(qp, s);
        REQUIRE(rc == 0, "sender %d: ibv_post_send %u: %d", t, sq, rc);
        ++outstanding;
      }
      while (outstanding) {
        ibv_wc wc = get_wc(e.scq, "UD send after the receiving process exited", 20000);
        REQUIRE(wc.status == IBV_WC_SUCCESS, "sender %d: %s", t, wc_str(wc).c_str());
        --outstanding;
      }
      REQUIRE(qp_state(qp) == IBV_QPS_RTS, "sender %d: QP state %s", t, harness::qp_state_name(qp_state(qp)));
      after_death_total.fetch_add(after_death);
      e.close();
    });
  auto until = Clock::now() + std::chrono::seconds(30);
  while (started.load() < kDeadpeerThreads) {
    REQUIRE(Clock::now() < until, "the senders did not start streaming");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  say("STREAMING");
  std::string line;
  int r = ctl().poll_line(&line, 30000);
  REQUIRE(r < 0, "expected the server to exit (control channel closed), got %d \"%s\"", r, line.c_str());
  dead.store(true);
  for (auto& t : th) t.join();
  note("OK (%ld sends completed after the receiver exited)", after_death_total.load());
  return 0;
}

// ---------------------------------------------------------------------------
// UD qkey: a mismatch is dropped silently; bit 31 selects the sender's own qkey.

// The client's sends, in order, and whether each must arrive.
struct QkeyStep {
  int qp;          // 0: client QP with qkey kServerQkey, 1: client QP with kOtherQkey
  uint32_t rqkey;  // remote_qkey of the WR
  bool delivered;
  const char* what;
};
const std::vector<QkeyStep>& qkey_steps() {
  static const std::vector<QkeyStep> s = {
      {0, kServerQkey + 1, false, "remote_qkey = the server's qkey + 1"},
      {1, kOtherQkey, false, "remote_qkey = another qkey"},
      {0, kServerQkey, true, "remote_qkey = the server's qkey"},
      {0, 0x80000000u, true, "remote_qkey with bit 31 set from a QP whose own qkey is the server's"},
      {1, 0x80000000u, false, "remote_qkey with bit 31 set from a QP whose own qkey differs"},
      {1, 0xFFFFFFFFu, false, "remote_qkey 0xffffffff (bit 31) from a QP whose own qkey differs"},
      {1, kServerQkey, true, "remote_qkey = the server's qkey from a QP whose own qkey differs"},
      {0, 0, false, "remote_qkey 0"},
      {0, 0x80000001u, true, "remote_qkey 0x80000001 (bit 31) from a QP whose own qkey is the server's"},
  };
  return s;
}

int qkey_server() {
  Ep e;
  e.open(8 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kServerQkey, kServerSqPsn);
  // Query: the qkey set at INIT.
  {
    ibv_qp_attr a{};
    ibv_qp_init_attr ia{};
    REQUIRE(ibv_query_qp(qp, &a, IBV_QP_QKEY | IBV_QP_STATE, &ia) == 0, "ibv_query_qp");
    REQUIRE(a.qkey == kServerQkey, "ibv_query_qp: qkey 0x%08x, set 0x%08x", a.qkey, kServerQkey);
    REQUIRE(ia.qp_type == IBV_QPT_UD, "ibv_query_qp: qp_type %d", ia.qp_type);
  }
  // Receives for the messages that must arrive, in order, plus one spare.
  const auto& steps = qkey_steps();
  int want = 0;
  for (const auto& s : steps) want += s.delivered;
  std::vector<std::vector<Piece>> rl;
  for (int k = 0; k <= want; ++k) {
    rl.push_back(ud_recv_layout(static_cast<size_t>(k) * 8192, 1024, 1));
    REQUIRE(post_recv(qp, static_cast<uint64_t>(k), e.sges(rl.back())) == 0, "post_recv");
  }
  Hello me = hello_of(e);
  Hello cl = exchange(me, true);
  int next = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const QkeyStep& st = steps[i];
    say("READY " + std::to_string(i));
    hear("SENT " + std::to_string(i));
    char what[200];
    std::snprintf(what, sizeof what, "step %zu: %s (remote_qkey 0x%08x, server qkey 0x%08x)", i, st.what, st.rqkey,
                  kServerQkey);
    if (!st.delivered) {
      expect_silence(e.rcq, what);
      continue;
    }
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    check_ud_wc(wc, what, static_cast<uint64_t>(next), 64 + static_cast<uint32_t>(i), false, cl.qpn[st.qp], cl.lid,
                qp->qp_num, false, 0, nullptr, nullptr, nullptr);
    size_t base = static_cast<size_t>(next) * 8192;
    check_recv(e, rl[static_cast<size_t>(next)], kGrh, 64 + static_cast<uint32_t>(i), static_cast<uint32_t>(i), base,
               base + 8192, what);
    ++next;
  }
  expect_silence(e.rcq, "after the last step");
  say("BYE");
  e.close();
  note("OK (%d delivered, %zu dropped)", next, steps.size() - static_cast<size_t>(next));
  return 0;
}

int qkey_client() {
  Ep e;
  e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* q[2] = {e.qp(IBV_QPT_UD), e.qp(IBV_QPT_UD)};
  ud_up(q[0], kServerQkey, kClientSqPsn);
  ud_up(q[1], kOtherQkey, kClientSqPsn);
  Hello sv = exchange(hello_of(e), false);
  ibv_ah* ah = e.ah(false, nullptr, sv.lid);
  const auto& steps = qkey_steps();
  for (size_t i = 0; i < steps.size(); ++i) {
    const QkeyStep& st = steps[i];
    hear("READY " + std::to_string(i));
    auto sl = layout(0, 64 + static_cast<uint32_t>(i), 2);
    e.fill(sl, static_cast<uint32_t>(i));
    Send s;
    s.wr_id = i;
    s.sg = e.sges(sl);
    s.ah = ah;
    s.rqpn = sv.qpn[0];
    s.rqkey = st.rqkey;
    char what[200];
    std::snprintf(what, sizeof what, "step %zu: %s (remote_qkey 0x%08x)", i, st.what, st.rqkey);
    send_ok(e, q[st.qp], s, what);  // a qkey mismatch is the receiver's business: the send succeeds
    REQUIRE(qp_state(q[st.qp]) == IBV_QPS_RTS, "%s: sender QP state %s", what, harness::qp_state_name(qp_state(q[st.qp])));
    say("SENT " + std::to_string(i));
  }
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD: no receive posted.

int norecv_ud_server() {
  Ep e;
  e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kServerQkey, kServerSqPsn);
  Hello cl = exchange(hello_of(e), true);
  say("READY 1");  // nothing posted
  hear("SENT 1");
  expect_silence(e.rcq, "a SEND to a UD QP with no receive posted");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "QP state %s after a SEND arrived with no receive posted",
          harness::qp_state_name(qp_state(qp)));
  auto rl = ud_recv_layout(0, 2048, 2);
  REQUIRE(post_recv(qp, 7, e.sges(rl)) == 0, "post_recv");
  say("READY 2");
  hear("SENT 2");
  const char* what = "the SEND after the one that found no receive";
  ibv_wc wc = get_wc(e.rcq, what, 5000);
  check_ud_wc(wc, what, 7, 500, false, cl.qpn[0], cl.lid, qp->qp_num, false, 0, nullptr, nullptr, nullptr);
  check_recv(e, rl, kGrh, 500, 2, 0, span_end(rl, 0) + 64, what);
  expect_silence(e.rcq, "after the second SEND");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "QP state %s", harness::qp_state_name(qp_state(qp)));
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

int norecv_ud_client() {
  Ep e;
  e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kClientQkey, kClientSqPsn);
  Hello sv = exchange(hello_of(e), false);
  ibv_ah* ah = e.ah(false, nullptr, sv.lid);
  for (uint32_t n = 1; n <= 2; ++n) {
    hear("READY " + std::to_string(n));
    auto sl = layout(0, 500, 1);
    e.fill(sl, n);
    Send s;
    s.wr_id = n;
    s.sg = e.sges(sl);
    s.ah = ah;
    s.rqpn = sv.qpn[0];
    s.rqkey = kServerQkey;
    if (n == 1) {
      // A QPN nobody has: an unreliable datagram is lost, the sender succeeds.
      Send x = s;
      x.wr_id = 50;
      x.rqpn = 0xFFFFF0;
      send_ok(e, qp, x, "SEND to QPN 0xfffff0 (no such QP)");
      REQUIRE(qp_state(qp) == IBV_QPS_RTS, "sender QP state %s after a SEND to a QPN nobody has",
              harness::qp_state_name(qp_state(qp)));
    }
    auto t0 = Clock::now();
    send_ok(e, qp, s, n == 1 ? "SEND to a QP with no receive posted" : "SEND to a QP with a receive posted");
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    REQUIRE(ms < 2000, "the UD SEND took %.0f ms to complete", ms);
    REQUIRE(qp_state(qp) == IBV_QPS_RTS, "sender QP state %s", harness::qp_state_name(qp_state(qp)));
    say("SENT " + std::to_string(n));
  }
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UD lengths: above the MTU at the sender, a receive too small at the target.

constexpr uint32_t kLenPayload = 1000;

int len_server() {
  Ep e;
  e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UD);
  ud_up(qp, kServerQkey, kServerSqPsn);
  // R0: room for anything (it must not take the oversized message).
  auto r0 = ud_recv_layout(0, 8000, 1);
  REQUIRE(post_recv(qp, 10, e.sges(r0)) == 0, "post_recv");
  Hello cl = exchange(hello_of(e), true);
  say("READY 1");
  hear("SENT 1");
  expect_silence(e.rcq, "a 4097-byte UD SEND (above the MTU) that failed at the sender");
  // R1: exactly GRH + payload over two SGEs; R2: one byte short.
  auto r1 = ud_recv_layout(8192 + 512, kLenPayload, 2);
  auto r2 = ud_recv_layout(2 * 8192 + 512, kLenPayload - 1, 1);
  REQUIRE(post_recv(qp, 11, e.sges(r1)) == 0, "post_recv");
  REQUIRE(post_recv(qp, 12, e.sges(r2)) == 0, "post_recv");
  say("READY 2");
  hear("SENT 2");
  {
    const char* what = "the first 1000-byte SEND (into the receive posted before the oversized SEND)";
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    check_ud_wc(wc, what, 10, kLenPayload, false, cl.qpn[1], cl.lid, qp->qp_num, false, 0, nullptr, nullptr, nullptr);
    check_recv(e, r0, kGrh, kLenPayload, 1, 0, 8192, what);
  }
  {
    const char* what = "the second 1000-byte SEND into a receive of exactly 40 + 1000 bytes (2 SGEs)";
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    check_ud_wc(wc, what, 11, kLenPayload, false, cl.qpn[1], cl.lid, qp->qp_num, false, 0, nullptr, nullptr, nullptr);
    check_recv(e, r1, kGrh, kLenPayload, 2, 8192, 2 * 8192, what);
  }
  {
    const char* what = "the third 1000-byte SEND into a receive of 40 + 999 bytes";
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    REQUIRE(wc.wr_id == 12, "%s: %s", what, wc_str(wc).c_str());
    REQUIRE(wc.status == IBV_WC_LOC_LEN_ERR, "%s: %s, expected status LOC_LEN_ERR", what, wc_str(wc).c_str());
  }
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

int len_client() {
  Ep e;
  e.open(4 * 8192, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qa = e.qp(IBV_QPT_UD);
  ibv_qp* qb = e.qp(IBV_QPT_UD);
  ud_up(qa, kClientQkey, kClientSqPsn);
  ud_up(qb, kClientQkey, kClientSqPsn);
  Hello sv = exchange(hello_of(e), false);
  ibv_ah* ah = e.ah(false, nullptr, sv.lid);
  hear("READY 1");
  {
    auto sl = layout(0, kMtu + 1, 1);
    e.fill(sl, 99);
    Send s;
    s.wr_id = 1;
    s.sg = e.sges(sl);
    s.ah = ah;
    s.rqpn = sv.qpn[0];
    s.rqkey = kServerQkey;
    ibv_wc wc = send_and_wait(e, qa, s, "a 4097-byte UD SEND (port MTU 4096)");
    REQUIRE(wc.status == IBV_WC_LOC_LEN_ERR, "a 4097-byte UD SEND: %s, expected status LOC_LEN_ERR",
            wc_str(wc).c_str());
  }
  say("SENT 1");
  hear("READY 2");
  // Three SENDs from the other QP (the first may have left qa in error).
  for (uint32_t n = 1; n <= 3; ++n) {
    auto sl = layout(8192, kLenPayload, 2);
    e.fill(sl, n);
    Send s;
    s.wr_id = 10 + n;
    s.sg = e.sges(sl);
    s.ah = ah;
    s.rqpn = sv.qpn[0];
    s.rqkey = kServerQkey;
    char what[80];
    std::snprintf(what, sizeof what, "1000-byte SEND %u", n);
    ibv_wc wc = send_and_wait(e, qb, s, what);
    if (n < 3) REQUIRE(wc.status == IBV_WC_SUCCESS, "%s: %s", what, wc_str(wc).c_str());
    else note("the SEND into the short receive completed at the sender with %s", ibv_wc_status_str(wc.status));
  }
  say("SENT 2");
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UC data: WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM, every byte checked.

constexpr size_t kUcRegion = (1u << 20) + 64 * 1024;  // per buffer area
constexpr size_t kUcWriteBase = 4096;                 // WRITEs land here in the server buffer
constexpr size_t kUcRecvBase = kUcWriteBase + kUcRegion;
constexpr size_t kUcBuf = kUcRecvBase + kUcRegion + 8192;

struct UcStep {
  ibv_wr_opcode op;
  uint32_t size;
  int send_parts;
  int recv_parts;
};

std::vector<UcStep> uc_steps() {
  std::vector<UcStep> v;
  const uint32_t sizes[] = {0, 1, 63, 4095, 4096, 4097, 65539, 1u << 20};
  const ibv_wr_opcode ops[] = {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM};
  int k = 0;
  for (uint32_t sz : sizes)
    for (ibv_wr_opcode op : ops) {
      v.push_back({op, sz, sz == 0 ? (k % 2) : 1 + k % 4, 1 + (k / 2) % 4});
      ++k;
    }
  return v;
}

const char* op_name(ibv_wr_opcode op) {
  switch (op) {
    case IBV_WR_RDMA_WRITE: return "RDMA_WRITE";
    case IBV_WR_RDMA_WRITE_WITH_IMM: return "RDMA_WRITE_WITH_IMM";
    case IBV_WR_SEND: return "SEND";
    case IBV_WR_SEND_WITH_IMM: return "SEND_WITH_IMM";
    case IBV_WR_RDMA_READ: return "RDMA_READ";
    case IBV_WR_ATOMIC_CMP_AND_SWP: return "ATOMIC_CMP_AND_SWP";
    case IBV_WR_ATOMIC_FETCH_AND_ADD: return "ATOMIC_FETCH_AND_ADD";
    default: return "?";
  }
}

// The remote offset of step k's WRITE (varies the alignment).
size_t uc_write_off(size_t k) { return kUcWriteBase + (k * 13) % 61; }

void check_guarded(Ep& e, size_t off, uint32_t n, uint32_t seed, size_t guard, const char* what) {
  for (uint32_t i = 0; i < n; ++i)
    if (e.buf[off + i] != pat(seed, i))
      DIE("%s: byte %u of %u is 0x%02x, expected 0x%02x", what, i, n, e.buf[off + i], pat(seed, i));
  for (size_t i = 1; i <= guard && i <= off; ++i)
    if (e.buf[off - i] != kCanary)
      DIE("%s: guard byte %zu before the target was changed to 0x%02x", what, i, e.buf[off - i]);
  for (size_t i = 0; i < guard && off + n + i < e.len; ++i)
    if (e.buf[off + n + i] != kCanary)
      DIE("%s: guard byte %zu after the target was changed to 0x%02x", what, i, e.buf[off + n + i]);
}

int uc_data_server() {
  Ep e;
  e.open(kUcBuf, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello cl = exchange(hello_of(e), true);
  uc_up(qp, cl.qpn[0], cl.lid, kClientSqPsn, kServerSqPsn);
  {
    ibv_qp_attr a{};
    ibv_qp_init_attr ia{};
    REQUIRE(ibv_query_qp(qp, &a, IBV_QP_STATE | IBV_QP_DEST_QPN, &ia) == 0, "ibv_query_qp");
    REQUIRE(ia.qp_type == IBV_QPT_UC, "ibv_query_qp: qp_type %d, expected UC", ia.qp_type);
    REQUIRE(a.qp_state == IBV_QPS_RTS && a.dest_qp_num == cl.qpn[0], "ibv_query_qp: state %d dest_qp_num %u",
            a.qp_state, a.dest_qp_num);
  }
  say("UP");
  hear("UP");
  auto steps = uc_steps();
  for (size_t k = 0; k < steps.size(); ++k) {
    const UcStep& st = steps[k];
    char what[160];
    std::snprintf(what, sizeof what, "step %zu: UC %s of %u bytes (%d send SGEs, %d receive SGEs)", k, op_name(st.op),
                  st.size, st.send_parts, st.recv_parts);
    std::memset(e.buf, kCanary, e.len);
    std::vector<Piece> rl;
    bool consumes = st.op != IBV_WR_RDMA_WRITE;
    if (st.op == IBV_WR_SEND || st.op == IBV_WR_SEND_WITH_IMM) {
      rl = layout(kUcRecvBase, std::max<uint32_t>(st.size, 1) + 100, st.recv_parts);  // room to spare
    } else {
      rl = {Piece{kUcRecvBase, 16}};  // a receive a WRITE marker / WRITE_WITH_IMM consumes but does not fill
    }
    int rc = post_recv(qp, k, e.sges(rl));
    REQUIRE(rc == 0, "%s: post_recv: %d", what, rc);
    say("READY " + std::to_string(k));
    ibv_wc wc = get_wc(e.rcq, what);
    std::string w = wc_str(wc);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == k, "%s: %s", what, w.c_str());
    REQUIRE(wc.qp_num == qp->qp_num, "%s: %s", what, w.c_str());
    const uint32_t seed = 1000 + static_cast<uint32_t>(k);
    if (!consumes) {
      // A 0-byte SEND_WITH_IMM (imm = k) follows each plain WRITE: UC keeps
      // a QP's messages in order, so the WRITE has landed when it completes.
      REQUIRE(wc.opcode == IBV_WC_RECV && wc.byte_len == 0 && (wc.wc_flags & IBV_WC_WITH_IMM) &&
                  ntohl(wc.imm_data) == k,
              "%s: the marker SEND_WITH_IMM after the WRITE: %s", what, w.c_str());
    } else {
      bool imm = st.op == IBV_WR_SEND_WITH_IMM || st.op == IBV_WR_RDMA_WRITE_WITH_IMM;
      int want_op = st.op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
      REQUIRE(wc.opcode == want_op, "%s: %s, expected opcode %d", what, w.c_str(), want_op);
      REQUIRE(wc.byte_len == st.size, "%s: %s, expected byte_len %u", what, w.c_str(), st.size);
      REQUIRE(!!(wc.wc_flags & IBV_WC_WITH_IMM) == imm, "%s: %s: IBV_WC_WITH_IMM %s", what, w.c_str(),
              imm ? "missing" : "set without imm");
      if (imm) REQUIRE(ntohl(wc.imm_data) == seed, "%s: %s, expected imm 0x%08x", what, w.c_str(), seed);
      REQUIRE(!(wc.wc_flags & IBV_WC_GRH), "%s: %s: IBV_WC_GRH on a UC receive", what, w.c_str());
    }
    if (st.op == IBV_WR_SEND || st.op == IBV_WR_SEND_WITH_IMM) {
      check_recv(e, rl, 0, st.size, seed, kUcRecvBase, span_end(rl, kUcRecvBase) + 64, what);
      for (size_t i = 0; i < kUcRecvBase; ++i)
        REQUIRE(e.buf[i] == kCanary, "%s: a SEND changed buffer byte %zu outside its receive", what, i);
    } else {
      check_guarded(e, uc_write_off(k), st.size, seed, 256, what);
      for (uint32_t i = 0; i < 16; ++i)
        REQUIRE(e.buf[kUcRecvBase + i] == kCanary, "%s: the receive consumed by a WRITE was written (byte %u)", what,
                i);
      for (size_t i = kUcRecvBase; i < e.len; ++i)
        REQUIRE(e.buf[i] == kCanary, "%s: a WRITE changed buffer byte %zu outside its target", what, i);
    }
    expect_silence(e.rcq, what, 0);
    hear("SENT " + std::to_string(k));
  }
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "QP state %s at the end", harness::qp_state_name(qp_state(qp)));
  say("BYE");
  e.close();
  note("OK (%zu steps)", steps.size());
  return 0;
}

int uc_data_client() {
  Ep e;
  e.open(kUcRegion + 64 * 1024, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello sv = exchange(hello_of(e), false);
  uc_up(qp, sv.qpn[0], sv.lid, kServerSqPsn, kClientSqPsn);
  hear("UP");
  say("UP");
  auto steps = uc_steps();
  for (size_t k = 0; k < steps.size(); ++k) {
    const UcStep& st = steps[k];
    char what[160];
    std::snprintf(what, sizeof what, "step %zu: UC %s of %u bytes", k, op_name(st.op), st.size);
    hear("READY " + std::to_string(k));
    const uint32_t seed = 1000 + static_cast<uint32_t>(k);
    std::memset(e.buf, 0, e.len);
    auto sl = layout(0, st.size, st.send_parts, 128);
    e.fill(sl, seed);
    Send s;
    s.op = st.op;
    s.wr_id = k;
    s.sg = e.sges(sl);
    s.imm = seed;
    s.raddr = sv.addr + uc_write_off(k);
    s.rkey = sv.rkey;
    if (st.size > 1 && st.size <= kInline) {
      // Inline: the data is taken at post time; the buffer may change at once.
      s.flags |= IBV_SEND_INLINE;
      int rc = post_send(qp, s);
      REQUIRE(rc == 0, "%s: ibv_post_send: %d", what, rc);
      std::memset(e.buf, 0xA5, 4096);
      ibv_wc wc = get_wc(e.scq, what);
      REQUIRE(wc.wr_id == s.wr_id && wc.status == IBV_WC_SUCCESS, "%s: %s", what, wc_str(wc).c_str());
    } else {
      send_ok(e, qp, s, what);
    }
    if (st.op == IBV_WR_RDMA_WRITE) {
      Send m;
      m.op = IBV_WR_SEND_WITH_IMM;
      m.wr_id = 10000 + k;
      m.imm = static_cast<uint32_t>(k);
      send_ok(e, qp, m, "the 0-byte SEND_WITH_IMM marker after a WRITE");
    }
    say("SENT " + std::to_string(k));
  }
  hear("BYE");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "QP state %s at the end", harness::qp_state_name(qp_state(qp)));
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UC: a SEND with no receive posted is dropped.

int uc_norecv_server() {
  Ep e;
  e.open(16384, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello cl = exchange(hello_of(e), true);
  uc_up(qp, cl.qpn[0], cl.lid, kClientSqPsn, kServerSqPsn);
  say("READY 1");  // no receive posted
  hear("SENT 1");
  expect_silence(e.rcq, "a UC SEND with no receive posted");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "target QP state %s after a UC SEND found no receive, expected RTS",
          harness::qp_state_name(qp_state(qp)));
  auto rl = layout(1024, 2000, 3);
  REQUIRE(post_recv(qp, 5, e.sges(rl)) == 0, "post_recv");
  say("READY 2");
  hear("SENT 2");
  const char* what = "the UC SEND after the dropped one";
  ibv_wc wc = get_wc(e.rcq, what, 5000);
  REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 5 && wc.opcode == IBV_WC_RECV && wc.byte_len == 1500,
          "%s: %s, expected SUCCESS, wr_id 5, IBV_WC_RECV, byte_len 1500", what, wc_str(wc).c_str());
  check_recv(e, rl, 0, 1500, 2, 1024, span_end(rl, 1024) + 64, what);
  expect_silence(e.rcq, "after the second SEND");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "target QP state %s", harness::qp_state_name(qp_state(qp)));
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

int uc_norecv_client() {
  Ep e;
  e.open(16384, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello sv = exchange(hello_of(e), false);
  uc_up(qp, sv.qpn[0], sv.lid, kServerSqPsn, kClientSqPsn);
  for (uint32_t n = 1; n <= 2; ++n) {
    hear("READY " + std::to_string(n));
    auto sl = layout(0, 1500, 2);
    e.fill(sl, n);
    Send s;
    s.wr_id = n;
    s.sg = e.sges(sl);
    auto t0 = Clock::now();
    send_ok(e, qp, s, n == 1 ? "a UC SEND to a QP with no receive posted" : "a UC SEND with a receive posted");
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    REQUIRE(ms < 2000, "the UC SEND took %.0f ms to complete (UC has no RNR wait)", ms);
    REQUIRE(qp_state(qp) == IBV_QPS_RTS, "sender QP state %s", harness::qp_state_name(qp_state(qp)));
    say("SENT " + std::to_string(n));
  }
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------
// UC: a WRITE with a bad rkey is dropped.

int uc_badrkey_server() {
  Ep e;
  e.open(65536, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello cl = exchange(hello_of(e), true);
  uc_up(qp, cl.qpn[0], cl.lid, kClientSqPsn, kServerSqPsn);
  // Markers (0-byte SEND_WITH_IMM) follow each WRITE.
  REQUIRE(post_recv(qp, 1, {}) == 0, "post_recv");
  REQUIRE(post_recv(qp, 2, {}) == 0, "post_recv");
  say("READY");
  hear("SENT 1");
  {
    const char* what = "the marker SEND after a WRITE with rkey+1";
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 1 && ntohl(wc.imm_data) == 1, "%s: %s", what,
            wc_str(wc).c_str());
  }
  for (size_t i = 0; i < e.len; ++i)
    REQUIRE(e.buf[i] == kCanary, "a UC WRITE with rkey+1 changed target byte %zu to 0x%02x", i, e.buf[i]);
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "target QP state %s after a WRITE with a bad rkey, expected RTS",
          harness::qp_state_name(qp_state(qp)));
  say("CHECKED 1");
  hear("SENT 2");
  {
    const char* what = "the marker SEND after a WRITE with the right rkey";
    ibv_wc wc = get_wc(e.rcq, what, 5000);
    REQUIRE(wc.status == IBV_WC_SUCCESS && wc.wr_id == 2 && ntohl(wc.imm_data) == 2, "%s: %s", what,
            wc_str(wc).c_str());
  }
  check_guarded(e, 8192, 4096, 2, 8192, "a UC WRITE with the right rkey after one with rkey+1");
  REQUIRE(qp_state(qp) == IBV_QPS_RTS, "target QP state %s", harness::qp_state_name(qp_state(qp)));
  say("BYE");
  e.close();
  note("OK");
  return 0;
}

int uc_badrkey_client() {
  Ep e;
  e.open(16384, IBV_ACCESS_LOCAL_WRITE);
  ibv_qp* qp = e.qp(IBV_QPT_UC);
  Hello sv = exchange(hello_of(e), false);
  uc_up(qp, sv.qpn[0], sv.lid, kServerSqPsn, kClientSqPsn);
  hear("READY");
  for (uint32_t n = 1; n <= 2; ++n) {
    auto sl = layout(0, 4096, 1);
    e.fill(sl, n);
    Send s;
    s.op = IBV_WR_RDMA_WRITE;
    s.wr_id = n;
    s.sg = e.sges(sl);
    s.raddr = sv.addr + 8192;
    s.rkey = n == 1 ? sv.rkey + 1 : sv.rkey;
    send_ok(e, qp, s, n == 1 ? "a UC WRITE with rkey+1 (dropped at the target; the sender succeeds)"
                             : "a UC WRITE with the right rkey");
    REQUIRE(qp_state(qp) == IBV_QPS_RTS, "sender QP state %s after a WRITE %s", harness::qp_state_name(qp_state(qp)),
            n == 1 ? "with rkey+1" : "");
    Send m;
    m.op = IBV_WR_SEND_WITH_IMM;
    m.wr_id = 100 + n;
    m.imm = n;
    send_ok(e, qp, m, "the marker SEND_WITH_IMM");
    say("SENT " + std::to_string(n));
    if (n == 1) hear("CHECKED 1");
  }
  hear("BYE");
  e.close();
  note("OK");
  return 0;
}

// ---------------------------------------------------------------------------

int run_worker(const std::string& role, const std::string& scenario) {
  g_role = role + " " + scenario;
  bool server = role == "server";
  if (scenario == "ud-lid") return server ? ud_server(false) : ud_client(false);
  if (scenario == "ud-grh") return server ? ud_server(true) : ud_client(true);
  if (scenario == "ud-fanout") return server ? fan_server() : fan_client();
  if (scenario == "ud-many") return server ? many_server() : many_client();
  if (scenario == "ud-deadsender") return server ? dead_server() : dead_client();
  if (scenario == "ud-deadpeer") return server ? deadpeer_server() : deadpeer_client();
  if (scenario == "ud-qkey") return server ? qkey_server() : qkey_client();
  if (scenario == "ud-norecv") return server ? norecv_ud_server() : norecv_ud_client();
  if (scenario == "ud-len") return server ? len_server() : len_client();
  if (scenario == "uc-data") return server ? uc_data_server() : uc_data_client();
  if (scenario == "uc-norecv") return server ? uc_norecv_server() : uc_norecv_client();
  if (scenario == "uc-badrkey") return server ? uc_badrkey_server() : uc_badrkey_client();
  DIE("unknown scenario %s", scenario.c_str());
}

// ---------------------------------------------------------------------------
// Process pairs

class Pair : public ::testing::TestWithParam<std::string> {};

// The client on `client_device` (empty: shm0 like the server).
void run_pair(const std::string& scenario, const std::string& client_device) {
  auto& home = harness::Home::get();
  if (!client_device.empty()) {
    std::string why;
    ASSERT_TRUE(home.up_device(client_device, &why)) << why;
  }
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string exe = harness::self_exe();
  harness::Child server, client;
  ASSERT_TRUE(server.start(home.run_argv({exe, "--worker", "server", "--scenario", scenario}), {.fd3 = sv[0]}))
      << server.output();
  ASSERT_TRUE(harness::start_on(client, client_device, home.run_argv({exe, "--worker", "client", "--scenario", scenario}),
                           {.fd3 = sv[1]}))
      << client.output();
  ::close(sv[0]);
  ::close(sv[1]);
  auto deadline = harness::Clock::now() + std::chrono::seconds(90);
  harness::Result s = server.wait(deadline);
  harness::Result c = client.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(15)));
  std::printf("--- server ---\n%s--- client ---\n%s", s.out.c_str(), c.out.c_str());
  EXPECT_TRUE(s.ok()) << "server: " << s.describe();
  EXPECT_TRUE(c.ok()) << "client: " << c.describe();
  if (scenario.find("dead") != std::string::npos) {
    // Killed senders: `shmrdma up` reclaims their contexts.
    harness::Result up = home.shmrdma({"up"});
    EXPECT_TRUE(up.ok()) << up.describe();
  }
  nlohmann::json st = home.status();
  if (st.is_object() && st.contains("devices")) {
    for (const auto& d : st["devices"]) {
      EXPECT_TRUE(!d.contains("processes") || d["processes"].empty())
          << "processes still listed after both workers exited:\n" << st.dump(2);
    }
  }
}

TEST_P(Pair, ServerAndClient) {
  HARNESS_REQUIRE_DEVICE();
  run_pair(GetParam(), "");
}

// The scenarios whose workers exchange addresses, with the client on a
// second device (shm1) of the home: UD by LID and by GRH (the reply through
// ibv_create_ah_from_wc), fan-out, drops, Q_Keys, lengths and a dead
// receiver, UC data, drops and bad rkeys, all across devices.
class PairAcrossDevices : public ::testing::TestWithParam<std::string> {};

TEST_P(PairAcrossDevices, ServerAndClient) {
  HARNESS_REQUIRE_DEVICE();
  run_pair(GetParam(), "shm1");
}

INSTANTIATE_TEST_SUITE_P(Scenarios, PairAcrossDevices,
                         ::testing::Values("ud-lid", "ud-grh", "ud-fanout", "ud-deadpeer", "ud-qkey", "ud-norecv",
                                           "ud-len", "uc-data", "uc-norecv", "uc-badrkey"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

INSTANTIATE_TEST_SUITE_P(Scenarios, Pair,
                         ::testing::Values("ud-lid", "ud-grh", "ud-fanout", "ud-many", "ud-deadsender", "ud-deadpeer",
                                           "ud-qkey", "ud-norecv", "ud-len", "uc-data", "uc-norecv", "uc-badrkey"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// ---------------------------------------------------------------------------
// Local: one context in this process.

class Local : public ::testing::Test {
 protected:
  void SetUp() override {
    HARNESS_REQUIRE_DEVICE();
    std::string why;
    ctx_ = harness::open_shm0(&why);
    ASSERT_NE(ctx_, nullptr) << why;
    pd_ = ibv_alloc_pd(ctx_);
    ASSERT_NE(pd_, nullptr) << "ibv_alloc_pd: " << std::strerror(errno);
    cq_ = ibv_create_cq(ctx_, 64, nullptr, nullptr, 0);
    ASSERT_NE(cq_, nullptr) << "ibv_create_cq: " << std::strerror(errno);
    ibv_port_attr pa{};
    ASSERT_EQ(ibv_query_port(ctx_, 1, &pa), 0);
    lid_ = pa.lid;
    ASSERT_NE(lid_, 0) << "port 1 has no LID";
    ASSERT_EQ(ibv_query_gid(ctx_, 1, 0, &gid_), 0) << "ibv_query_gid(port 1, index 0): " << std::strerror(errno);
    ibv_device_attr da{};
    ASSERT_EQ(ibv_query_device(ctx_, &da), 0);
    nports_ = da.phys_port_cnt;
    ASSERT_GE(nports_, 1);
    void* p = nullptr;
    ASSERT_EQ(posix_memalign(&p, 4096, 8192), 0);
    buf_ = static_cast<uint8_t*>(p);
    std::memset(buf_, 0, 8192);
    mr_ = ibv_reg_mr(pd_, buf_, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                          IBV_ACCESS_REMOTE_ATOMIC);
    ASSERT_NE(mr_, nullptr) << "ibv_reg_mr: " << std::strerror(errno);
  }

  void TearDown() override {
    for (auto it = qps_.rbegin(); it != qps_.rend(); ++it) EXPECT_EQ(ibv_destroy_qp(*it), 0) << "ibv_destroy_qp";
    for (ibv_ah* h : ahs_) EXPECT_EQ(ibv_destroy_ah(h), 0) << "ibv_destroy_ah";
    if (mr_) {
      EXPECT_EQ(ibv_dereg_mr(mr_), 0);
    }
    if (cq_) {
      EXPECT_EQ(ibv_destroy_cq(cq_), 0);
    }
    if (pd_) {
      EXPECT_EQ(ibv_dealloc_pd(pd_), 0) << "ibv_dealloc_pd after every AH was destroyed";
    }
    if (ctx_) {
      nlohmann::json st = harness::Home::get().status();
      nlohmann::json me = harness::Home::find_process(st, ::getpid());
      if (!me.is_null() && me.contains("objects"))
        for (const char* k : {"pd", "cq", "qp", "mr", "ah"})
          if (me["objects"].contains(k)) {
            EXPECT_EQ(me["objects"].value(k, -1), 0)
                << "status lists " << k << " objects after every one was destroyed:\n" << me.dump(2);
          }
      EXPECT_EQ(ibv_close_device(ctx_), 0);
    }
    std::free(buf_);
  }

  ibv_qp* new_qp(ibv_qp_type t) {
    ibv_qp* qp = harness::create_qp(pd_, cq_, t, 16, 16, 2);
    if (qp) qps_.push_back(qp);
    return qp;
  }

  ibv_ah_attr ah_attr(bool global) const {
    ibv_ah_attr a{};
    a.dlid = lid_;
    a.port_num = 1;
    a.is_global = global;
    if (global) {
      a.grh.dgid = gid_;
      a.grh.sgid_index = 0;
      a.grh.hop_limit = 1;
    }
    return a;
  }

  // Destroys an AH made here now (it is no longer destroyed in TearDown).
  int destroy_ah_now(ibv_ah* h) {
    ahs_.erase(std::remove(ahs_.begin(), ahs_.end(), h), ahs_.end());
    return ibv_destroy_ah(h);
  }

  int modify(ibv_qp* qp, ibv_qp_attr a, int mask) { return ibv_modify_qp(qp, &a, mask); }

  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  uint8_t* buf_ = nullptr;
  uint16_t lid_ = 0;
  ibv_gid gid_{};
  int nports_ = 0;
  std::vector<ibv_qp*> qps_;
  std::vector<ibv_ah*> ahs_;
};

TEST_F(Local, CreateAndDestroyAh) {
  for (bool global : {false, true}) {
    SCOPED_TRACE(global ? "is_global 1" : "is_global 0");
    ibv_ah_attr a = ah_attr(global);
    ibv_ah* ah = ibv_create_ah(pd_, &a);
    ASSERT_NE(ah, nullptr) << "ibv_create_ah: " << std::strerror(errno);
    EXPECT_EQ(ah->pd, pd_);
    EXPECT_EQ(ah->context, ctx_);
    EXPECT_EQ(ibv_destroy_ah(ah), 0);
  }
  // Many at once, destroyed in another order.
  std::vector<ibv_ah*> v;
  for (int i = 0; i < 32; ++i) {
    ibv_ah_attr a = ah_attr(i % 2);
    ibv_ah* ah = ibv_create_ah(pd_, &a);
    ASSERT_NE(ah, nullptr) << "AH " << i << ": " << std::strerror(errno);
    v.push_back(ah);
  }
  for (size_t i = 0; i < v.size(); i += 2) EXPECT_EQ(ibv_destroy_ah(v[i]), 0);
  for (size_t i = 1; i < v.size(); i += 2) EXPECT_EQ(ibv_destroy_ah(v[i]), 0);
}

TEST_F(Local, DeallocPdWithAnAhIsEbusy) {
  ibv_pd* pd = ibv_alloc_pd(ctx_);
  ASSERT_NE(pd, nullptr);
  ibv_ah_attr a = ah_attr(false);
  ibv_ah* ah = ibv_create_ah(pd, &a);
  ASSERT_NE(ah, nullptr) << "ibv_create_ah: " << std::strerror(errno);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "ibv_dealloc_pd while an AH on it exists";
  ibv_ah_attr g = ah_attr(true);
  ibv_ah* ah2 = ibv_create_ah(pd, &g);
  ASSERT_NE(ah2, nullptr) << "ibv_create_ah on the PD after the refused dealloc: " << std::strerror(errno);
  EXPECT_EQ(ibv_destroy_ah(ah), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), EBUSY) << "ibv_dealloc_pd while a second AH on it exists";
  EXPECT_EQ(ibv_destroy_ah(ah2), 0);
  EXPECT_EQ(ibv_dealloc_pd(pd), 0) << "ibv_dealloc_pd once its AHs are destroyed";
}

TEST_F(Local, CreateAhOnABadPortIsEinval) {
  for (int port : {0, nports_ + 1, 255}) {
    ibv_ah_attr a = ah_attr(false);
    a.port_num = static_cast<uint8_t>(port);
    errno = 0;
    ibv_ah* ah = ibv_create_ah(pd_, &a);
    if (ah) ahs_.push_back(ah);
    EXPECT_EQ(ah, nullptr) << "ibv_create_ah with port_num " << port << " (the device has " << nports_ << " port(s))";
    EXPECT_EQ(errno, EINVAL) << "errno after ibv_create_ah with port_num " << port << ": " << std::strerror(errno);
  }
}

TEST_F(Local, UdModifyQpAttributeMasks) {
  ibv_qp* qp = new_qp(IBV_QPT_UD);
  ASSERT_NE(qp, nullptr) << "ibv_create_qp(UD): " << std::strerror(errno);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qkey = kServerQkey;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE;
  const int init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
  EXPECT_EQ(modify(qp, a, init | IBV_QP_ACCESS_FLAGS), EINVAL) << "UD RESET->INIT with IBV_QP_ACCESS_FLAGS";
  for (int missing : {IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_QKEY})
    EXPECT_EQ(modify(qp, a, init & ~missing), EINVAL) << "UD RESET->INIT without attribute mask " << missing;
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RESET) << "a refused modify changed the state";
  ASSERT_EQ(modify(qp, a, init), 0) << "UD RESET->INIT with STATE|PKEY_INDEX|PORT|QKEY";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_INIT);
  {
    ibv_qp_attr q{};
    ibv_qp_init_attr ia{};
    ASSERT_EQ(ibv_query_qp(qp, &q, IBV_QP_QKEY, &ia), 0);
    EXPECT_EQ(q.qkey, kServerQkey) << "ibv_query_qp: the qkey set at INIT";
    EXPECT_EQ(ia.qp_type, IBV_QPT_UD);
  }
  ibv_qp_attr r{};
  r.qp_state = IBV_QPS_RTR;
  ASSERT_EQ(modify(qp, r, IBV_QP_STATE), 0) << "UD INIT->RTR with IBV_QP_STATE only";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTR);
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.sq_psn = 123;
  EXPECT_EQ(modify(qp, s, IBV_QP_STATE), EINVAL) << "UD RTR->RTS without IBV_QP_SQ_PSN";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTR);
  ASSERT_EQ(modify(qp, s, IBV_QP_STATE | IBV_QP_SQ_PSN), 0) << "UD RTR->RTS with STATE|SQ_PSN";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTS);
}

TEST_F(Local, UcModifyQpAttributeMasks) {
  ibv_qp* qp = new_qp(IBV_QPT_UC);
  ASSERT_NE(qp, nullptr) << "ibv_create_qp(UC): " << std::strerror(errno);
  ibv_qp* peer = new_qp(IBV_QPT_UC);
  ASSERT_NE(peer, nullptr);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  const int init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  for (int missing : {IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_ACCESS_FLAGS})
    EXPECT_EQ(modify(qp, a, init & ~missing), EINVAL) << "UC RESET->INIT without attribute mask " << missing;
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RESET);
  ASSERT_EQ(modify(qp, a, init), 0) << "UC RESET->INIT with STATE|PKEY_INDEX|PORT|ACCESS_FLAGS";

  ibv_qp_attr r{};
  r.qp_state = IBV_QPS_RTR;
  r.path_mtu = IBV_MTU_4096;
  r.dest_qp_num = peer->qp_num;
  r.rq_psn = 0;
  r.max_dest_rd_atomic = 1;
  r.min_rnr_timer = 1;
  r.ah_attr.dlid = lid_;
  r.ah_attr.port_num = 1;
  const int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
  for (int missing : {IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_DEST_QPN, IBV_QP_RQ_PSN})
    EXPECT_EQ(modify(qp, r, rtr & ~missing), EINVAL) << "UC INIT->RTR without attribute mask " << missing;
  EXPECT_EQ(modify(qp, r, rtr | IBV_QP_MAX_DEST_RD_ATOMIC), EINVAL) << "UC INIT->RTR with IBV_QP_MAX_DEST_RD_ATOMIC";
  EXPECT_EQ(modify(qp, r, rtr | IBV_QP_MIN_RNR_TIMER), EINVAL) << "UC INIT->RTR with IBV_QP_MIN_RNR_TIMER";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_INIT) << "a refused modify changed the state";
  ASSERT_EQ(modify(qp, r, rtr), 0) << "UC INIT->RTR with STATE|AV|PATH_MTU|DEST_QPN|RQ_PSN";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTR);

  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.sq_psn = 0;
  s.timeout = 14;
  s.retry_cnt = 7;
  s.rnr_retry = 7;
  s.max_rd_atomic = 1;
  const int rts = IBV_QP_STATE | IBV_QP_SQ_PSN;
  EXPECT_EQ(modify(qp, s, IBV_QP_STATE), EINVAL) << "UC RTR->RTS without IBV_QP_SQ_PSN";
  for (int extra : {IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_MAX_QP_RD_ATOMIC})
    EXPECT_EQ(modify(qp, s, rts | extra), EINVAL)
        << "UC RTR->RTS with attribute mask " << extra << " (not a UC attribute)";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTR);
  ASSERT_EQ(modify(qp, s, rts), 0) << "UC RTR->RTS with STATE|SQ_PSN";
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTS);
  ibv_qp_attr q{};
  ibv_qp_init_attr ia{};
  ASSERT_EQ(ibv_query_qp(qp, &q, IBV_QP_STATE | IBV_QP_DEST_QPN, &ia), 0);
  EXPECT_EQ(ia.qp_type, IBV_QPT_UC);
  EXPECT_EQ(q.dest_qp_num, peer->qp_num);
}

// post_send must refuse `ops` on qp with EINVAL and point bad_wr at the WR.
void expect_refused(ibv_qp* qp, ibv_cq* cq, const std::vector<ibv_wr_opcode>& ops, ibv_sge sge, uint64_t raddr,
                    uint32_t rkey, ibv_ah* ah, uint32_t rqpn, const char* qp_kind) {
  for (ibv_wr_opcode op : ops) {
    SCOPED_TRACE(std::string(qp_kind) + " " + op_name(op));
    Send s;
    s.op = op;
    s.wr_id = 42;
    bool atomic = op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
    sge.length = atomic ? 8 : 64;
    s.sg = {sge};
    s.raddr = raddr;
    s.rkey = rkey;
    if (ah) {
      // A UD WR names its destination through wr.ud; the rdma/atomic fields
      // share that union, so they are not set.
      s.ah = ah;
      s.rqpn = rqpn;
      s.rqkey = kServerQkey;
    }
    ibv_send_wr* bad = nullptr;
    int rc = post_send(qp, s, &bad);
    EXPECT_EQ(rc, EINVAL) << "ibv_post_send of " << op_name(op) << " on a " << qp_kind << " QP";
    EXPECT_EQ(bad, reinterpret_cast<ibv_send_wr*>(1)) << "*bad_wr must point at the refused WR";
    if (rc == 0) {
      ibv_wc wc{};
      harness::poll_one(cq, &wc, 1000);
    }
  }
  ibv_wc wc{};
  EXPECT_FALSE(harness::poll_one(cq, &wc, 50)) << "a refused WR produced a completion: " << wc_str(wc);
  EXPECT_EQ(harness::qp_state(qp), IBV_QPS_RTS) << "a refused post_send changed the QP state";
}

TEST_F(Local, UdRefusesRdmaAndAtomics) {
  ibv_qp* qp = new_qp(IBV_QPT_UD);
  ASSERT_NE(qp, nullptr) << "ibv_create_qp(UD): " << std::strerror(errno);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qkey = kServerQkey;
  ASSERT_EQ(modify(qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY), 0);
  a.qp_state = IBV_QPS_RTR;
  ASSERT_EQ(modify(qp, a, IBV_QP_STATE), 0);
  a.qp_state = IBV_QPS_RTS;
  ASSERT_EQ(modify(qp, a, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
  ibv_ah_attr aa = ah_attr(false);
  ibv_ah* ah = ibv_create_ah(pd_, &aa);
  ASSERT_NE(ah, nullptr) << "ibv_create_ah: " << std::strerror(errno);
  ahs_.push_back(ah);
  ibv_sge sge{reinterpret_cast<uintptr_t>(buf_), 64, mr_->lkey};
  expect_refused(qp, cq_,
                 {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP,
                  IBV_WR_ATOMIC_FETCH_AND_ADD},
                 sge, 0, 0, ah, qp->qp_num, "UD");
}

TEST_F(Local, UcRefusesReadAndAtomics) {
  ibv_qp* qp = new_qp(IBV_QPT_UC);
  ASSERT_NE(qp, nullptr) << "ibv_create_qp(UC): " << std::strerror(errno);
  ibv_qp* peer = new_qp(IBV_QPT_UC);
  ASSERT_NE(peer, nullptr);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  ASSERT_EQ(modify(qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS), 0);
  ibv_qp_attr r{};
  r.qp_state = IBV_QPS_RTR;
  r.path_mtu = IBV_MTU_4096;
  r.dest_qp_num = peer->qp_num;
  r.ah_attr.dlid = lid_;
  r.ah_attr.port_num = 1;
  ASSERT_EQ(modify(qp, r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN), 0);
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  ASSERT_EQ(modify(qp, s, IBV_QP_STATE | IBV_QP_SQ_PSN), 0);
  ibv_sge sge{reinterpret_cast<uintptr_t>(buf_), 64, mr_->lkey};
  expect_refused(qp, cq_, {IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD}, sge,
                 reinterpret_cast<uintptr_t>(buf_) + 4096, mr_->rkey, nullptr, 0, "UC");
}

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string role = argv[2], scenario;
    for (int i = 3; i + 1 < argc; i += 2)
      if (std::string(argv[i]) == "--scenario") scenario = argv[i + 1];
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    ::signal(SIGPIPE, SIG_IGN);
    return run_worker(role, scenario);
  }
  return harness::run_tests_as_root(argc, argv);
}
