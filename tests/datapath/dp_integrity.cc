// Data integrity of the RC data path between two processes, through the
// public verbs API only.
//
// As a gtest (no arguments) it makes a socketpair and starts two workers of
// this same executable through `shmrdma run`: a server (the target) and a
// client (the initiator), each with one end of the socketpair as fd 3. It
// does so twice: with the mapped data mover (peers map registered memory)
// and with SHMRDMA_MAPPED=0 (process_vm_readv/writev).
//
//   dp_integrity --worker server|client --seed S --ops N --budget-ms B
//
// Both workers derive the same sequence of operations from the seed (a
// Generator): opcode, size (0 B .. 4 MiB), remote offset, immediate data,
// atomic operands, and the payload, a pattern of (seed, op number, byte
// offset). So each side verifies what it sees without being told:
//
//  - the client chooses its own SGE lists (1..max_send_sge pieces at random
//    offsets with gaps), inline or not, signaled or not, fences and chains;
//    it checks every completion (in order, opcode, status) and, when an
//    operation is retired by a signaled completion, the bytes of every READ
//    (against its shadow copy of the server's RDMA region) and the original
//    value of every atomic (against its model of the counters), plus the
//    guard bytes around them;
//  - the server pre-posts receives with random SGE lists (1..max_recv_sge)
//    for the operations that consume one, and checks each receive
//    completion (opcode, byte_len, imm, flags) and every byte of it,
//    including the guard bytes around and after the message;
//  - at checkpoints the client drains its send queue and asks the server to
//    compare its whole RDMA region and its counters with the model.
//
// Every wait has a deadline; any mismatch prints the details and exits 1.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;

using Clock = std::chrono::steady_clock;

constexpr uint64_t kRLen = 16ull << 20;       // server RDMA region
constexpr uint32_t kACount = 512;             // server atomic counters
constexpr uint32_t kMaxMsg = 4u << 20;        // largest message
constexpr uint32_t kRecvWindow = 8;           // receives the server keeps posted
constexpr uint64_t kRecvSlot = kMaxMsg + (64u << 10);
constexpr uint64_t kLocalLen = 64ull << 20;   // client local region
constexpr uint8_t kCanary = 0xC3;
constexpr int kWaitMs = 60000;                // any single wait

uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(fmix64(seed ^ 0x243f6a8885a308d3ULL)) {}
  uint64_t next() {
    s += 0x9e3779b97f4a7c15ULL;
    return fmix64(s);
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  uint64_t range(uint64_t lo, uint64_t hi) { return lo + below(hi - lo + 1); }  // inclusive
};

// The payload pattern: byte j of stream `key`.
inline uint64_t pword(uint64_t key, uint64_t w) { return fmix64(key ^ (w * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL)); }
inline uint8_t pbyte(uint64_t key, uint64_t j) { return static_cast<uint8_t>(pword(key, j >> 3) >> ((j & 7) * 8)); }

void pfill(uint8_t* dst, uint64_t len, uint64_t key, uint64_t j) {
  uint64_t i = 0;
  while (i < len && (j & 7)) dst[i++] = pbyte(key, j++);
  while (len - i >= 8) {
    uint64_t w = pword(key, j >> 3);
    std::memcpy(dst + i, &w, 8);
    i += 8;
    j += 8;
  }
  while (i < len) dst[i++] = pbyte(key, j++);
}

// Index of the first byte that differs from the pattern, or -1.
int64_t pcheck(const uint8_t* src, uint64_t len, uint64_t key, uint64_t j) {
  uint64_t i = 0;
  while (i < len && (j & 7)) {
    if (src[i] != pbyte(key, j)) return static_cast<int64_t>(i);
    ++i, ++j;
  }
  while (len - i >= 8) {
    uint64_t w = pword(key, j >> 3), g;
    std::memcpy(&g, src + i, 8);
    if (g != w) break;
    i += 8;
    j += 8;
  }
  while (i < len) {
    if (src[i] != pbyte(key, j)) return static_cast<int64_t>(i);
    ++i, ++j;
  }
  return -1;
}

int64_t canary_check(const uint8_t* p, uint64_t len) {
  for (uint64_t i = 0; i < len; ++i)
    if (p[i] != kCanary) return static_cast<int64_t>(i);
  return -1;
}

uint64_t key_op(uint64_t seed, uint64_t idx) { return fmix64(seed * 0x100000001b3ULL ^ (idx + 1) * 0xc2b2ae3d27d4eb4fULL); }
uint64_t key_init(uint64_t seed) { return fmix64(seed ^ 0x5bd1e9955bd1e995ULL); }

enum Kind : uint8_t { kSend, kSendImm, kWrite, kWriteImm, kRead, kCas, kFaa, kKinds };
const char* kind_name(int k) {
  static const char* n[] = {"SEND", "SEND_WITH_IMM", "RDMA_WRITE", "RDMA_WRITE_WITH_IMM", "RDMA_READ",
                            "ATOMIC_CMP_AND_SWP", "ATOMIC_FETCH_AND_ADD"};
  return k >= 0 && k < kKinds ? n[k] : "FENCE";
}
bool consumes(Kind k) { return k == kSend || k == kSendImm || k == kWriteImm; }
bool is_atomic(Kind k) { return k == kCas || k == kFaa; }
bool has_imm(Kind k) { return k == kSendImm || k == kWriteImm; }
bool remote_range(Kind k) { return k == kWrite || k == kWriteImm || k == kRead; }

struct Op {
  uint64_t idx = 0;
  Kind kind = kSend;
  uint32_t len = 0;
  uint64_t roff = 0;
  uint32_t aidx = 0;
  uint64_t compare_add = 0, swap = 0, expect_old = 0;
  uint32_t imm = 0;  // network order
  uint64_t key = 0;
  uint64_t sub = 0;  // seed of the side-local choices
};

// The shared sequence of operations. With a model it also keeps the shadow
// of the server's RDMA region and the atomic counters.
class Generator {
 public:
  Generator(uint64_t seed, bool model) : seed_(seed), model_(model) {
    if (model_) {
      shadow_.resize(kRLen);
      pfill(shadow_.data(), kRLen, key_init(seed), 0);
      counters_.resize(kACount);
      for (uint32_t i = 0; i < kACount; ++i) counters_[i] = initial_counter(seed, i);
    }
  }
  static uint64_t initial_counter(uint64_t seed, uint32_t i) { return pword(key_init(seed) ^ 0xa70a70a7ULL, i); }

  uint64_t index() const { return idx_; }
  const std::vector<uint8_t>& shadow() const { return shadow_; }
  const std::vector<uint64_t>& counters() const { return counters_; }

  Op next() {
    Op op;
    op.idx = idx_++;
    Rng r(seed_ * 0x9e3779b97f4a7c15ULL + op.idx);
    static constexpr Kind first[] = {kSend, kSendImm, kWrite, kWriteImm, kRead, kCas, kFaa};
    if (op.idx < kKinds) {
      op.kind = first[op.idx];
    } else {
      uint64_t w = r.below(100);  // SEND 20, SEND_IMM 14, WRITE 20, WRITE_IMM 12, READ 20, CAS 7, FAA 7
      op.kind = w < 20 ? kSend : w < 34 ? kSendImm : w < 54 ? kWrite : w < 66 ? kWriteImm : w < 86 ? kRead
                : w < 93 ? kCas : kFaa;
    }
    if (is_atomic(op.kind)) {
      op.len = 8;
    } else {
      uint64_t c = r.below(1000);
      if (c < 50) op.len = 0;
      else if (c < 350) op.len = static_cast<uint32_t>(r.range(1, 64));
      else if (c < 620) op.len = static_cast<uint32_t>(r.range(65, 4096));
      else if (c < 870) op.len = static_cast<uint32_t>(r.range(4097, 65536));
      else if (c < 990) {
        uint64_t e = r.range(16, 21);
        op.len = static_cast<uint32_t>(r.range((1ull << e) + 1, 2ull << e));
      } else {
        op.len = kMaxMsg;
      }
    }
    if (remote_range(op.kind)) op.roff = r.below(kRLen - op.len + 1);
    op.imm = static_cast<uint32_t>(r.next());
    op.key = key_op(seed_, op.idx);
    if (is_atomic(op.kind)) {
      op.aidx = static_cast<uint32_t>(r.below(kACount));
      bool hit = r.below(2) == 0;
      uint64_t x = r.next() | 1, y = r.next();
      uint64_t add = r.below(4) == 0 ? r.below(16) : r.next();
      if (model_) {
        uint64_t& v = counters_[op.aidx];
        op.expect_old = v;
        if (op.kind == kCas) {
          op.compare_add = hit ? v : v ^ x;
          op.swap = y;
          if (op.compare_add == v) v = y;
        } else {
          op.compare_add = add;
          v += add;
        }
      }
    }
    op.sub = r.next();
    if (model_ && (op.kind == kWrite || op.kind == kWriteImm)) pfill(shadow_.data() + op.roff, op.len, op.key, 0);
    return op;
  }

 private:
  uint64_t seed_;
  bool model_;
  uint64_t idx_ = 0;
  std::vector<uint8_t> shadow_;
  std::vector<uint64_t> counters_;
};

// An SGE list inside an area: pieces at random offsets with random gaps.
struct Layout {
  struct Piece {
    uint64_t off;  // in the area
    uint32_t len;
  };
  std::vector<Piece> pieces;
  uint64_t area = 0;  // bytes, including the guards
};

Layout make_layout(Rng& r, uint64_t total, uint32_t max_sge) {
  Layout l;
  uint32_t n;
  if (total == 0) {
    n = static_cast<uint32_t>(r.below(3));  // 0, 1 or 2 empty SGEs
  } else {
    uint64_t c = r.below(10);
    n = c < 4 ? 1 : static_cast<uint32_t>(r.range(1, std::min<uint64_t>(max_sge, c < 8 ? 4 : max_sge)));
  }
  std::vector<uint64_t> cuts;
  for (uint32_t i = 0; i + 1 < n; ++i) cuts.push_back(r.below(total + 1));
  std::sort(cuts.begin(), cuts.end());
  uint64_t prev = 0, pos = r.below(64);
  for (uint32_t i = 0; i < n; ++i) {
    uint64_t end = i + 1 < n ? cuts[i] : total;
    uint64_t gap = r.below(3) == 0 ? 0 : r.below(64);
    pos += gap;
    l.pieces.push_back({pos, static_cast<uint32_t>(end - prev)});
    pos += end - prev;
    prev = end;
  }
  l.area = pos + 64;
  return l;
}

// Checks the guard bytes of an area: everything outside the first `covered`
// message bytes of the pieces must still be canary. Returns the area offset
// of the first bad byte or -1.
int64_t check_guards(const uint8_t* area, const Layout& l, uint64_t covered) {
  uint64_t pos = 0, msg = 0;
  for (const auto& p : l.pieces) {
    if (int64_t k = canary_check(area + pos, p.off - pos); k >= 0) return static_cast<int64_t>(pos) + k;
    uint64_t used = std::min<uint64_t>(p.len, covered > msg ? covered - msg : 0);
    if (int64_t k = canary_check(area + p.off + used, p.len - used); k >= 0)
      return static_cast<int64_t>(p.off + used) + k;
    msg += p.len;
    pos = p.off + p.len;
  }
  if (int64_t k = canary_check(area + pos, l.area - pos); k >= 0) return static_cast<int64_t>(pos) + k;
  return -1;
}

std::string hexdump(const uint8_t* p, size_t n) {
  std::string s;
  char b[4];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    s += b;
  }
  return s;
}

// ---------------------------------------------------------------------------
// Worker setup

struct Hello {
  uint32_t magic = 0x44504954;
  uint32_t qpn = 0;
  uint16_t lid = 0;
  uint16_t pad = 0;
  uint32_t r_rkey = 0;
  uint64_t r_addr = 0;
  uint64_t r_len = 0;
  uint64_t a_addr = 0;
  uint32_t a_rkey = 0;
  uint32_t a_count = 0;
  uint8_t gid[16] = {};  // with $DP_GID_INDEX: the GID paths use (RoCE)
};

struct Verbs {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_qp_cap cap{};
  uint16_t lid = 0;
  int gid_index = -1;  // $DP_GID_INDEX: connect through GRH paths (RoCE), else by LID
  ibv_gid gid{};

  void open(uint32_t send_wr, uint32_t recv_wr) {
    std::string why;
    ctx = harness::open_shm0(&why);
    if (!ctx) die("open shm0: %s", why.c_str());
    lid = harness::port_lid(ctx);
    if (const char* g = std::getenv("DP_GID_INDEX"); g && *g) {
      gid_index = std::atoi(g);
      if (ibv_query_gid(ctx, 1, gid_index, &gid)) die("ibv_query_gid %d: %s", gid_index, std::strerror(errno));
    }
    pd = ibv_alloc_pd(ctx);
    if (!pd) die("ibv_alloc_pd: %s", std::strerror(errno));
    cq = ibv_create_cq(ctx, 1024, nullptr, nullptr, 0);
    if (!cq) die("ibv_create_cq: %s", std::strerror(errno));
    ibv_device_attr da{};
    if (ibv_query_device(ctx, &da)) die("ibv_query_device");
    ibv_qp_init_attr ia{};
    ia.send_cq = cq;
    ia.recv_cq = cq;
    ia.qp_type = IBV_QPT_RC;
    ia.cap.max_send_wr = send_wr;
    ia.cap.max_recv_wr = recv_wr;
    ia.cap.max_send_sge = static_cast<uint32_t>(da.max_sge);
    ia.cap.max_recv_sge = static_cast<uint32_t>(da.max_sge);
    ia.cap.max_inline_data = 256;
    qp = ibv_create_qp(pd, &ia);
    if (!qp) die("ibv_create_qp: %s", std::strerror(errno));
    cap = ia.cap;
    if (cap.max_send_sge < 1 || cap.max_recv_sge < 1 || cap.max_send_wr < send_wr) die("unexpected QP caps");
  }

  ibv_mr* reg(void* p, size_t len, int access) {
    ibv_mr* mr = ibv_reg_mr(pd, p, len, access);
    if (!mr) die("ibv_reg_mr(%zu bytes): %s", len, std::strerror(errno));
    return mr;
  }

  void connect(uint32_t qpn, uint16_t dlid, const uint8_t* dgid) {
    int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    if (int rc = harness::qp_to_init(qp, access)) die("to INIT: %s", std::strerror(rc));
    if (gid_index >= 0) {
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = IBV_MTU_1024;
      a.dest_qp_num = qpn;
      a.max_dest_rd_atomic = 16;
      a.min_rnr_timer = 1;
      a.ah_attr.port_num = 1;
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, dgid, 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
      a.ah_attr.grh.hop_limit = 64;
      if (int rc = ibv_modify_qp(qp, &a,
                                 IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        die("to RTR over GID index %d: %s", gid_index, std::strerror(rc));
    } else if (int rc = harness::qp_to_rtr(qp, qpn, dlid, 1)) {
      die("to RTR: %s", std::strerror(rc));
    }
    if (int rc = harness::qp_to_rts(qp, 7)) die("to RTS: %s", std::strerror(rc));
  }
};

uint8_t* big_alloc(size_t len) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, len)) die("posix_memalign(%zu)", len);
  std::memset(p, 0, len);
  return static_cast<uint8_t*>(p);
}

// ---------------------------------------------------------------------------
// Server

int run_server(uint64_t seed) {
  Verbs v;
  v.open(4, 2 * kRecvWindow);
  uint8_t* R = big_alloc(kRLen);
  auto* A = reinterpret_cast<uint64_t*>(big_alloc(kACount * 8));
  uint8_t* RX = big_alloc(kRecvWindow * kRecvSlot);
  pfill(R, kRLen, key_init(seed), 0);
  for (uint32_t i = 0; i < kACount; ++i) A[i] = Generator::initial_counter(seed, i);
  ibv_mr* rmr = v.reg(R, kRLen, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  ibv_mr* amr = v.reg(A, kACount * 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
  ibv_mr* xmr = v.reg(RX, kRecvWindow * kRecvSlot, IBV_ACCESS_LOCAL_WRITE);

  Hello me;
  me.qpn = v.qp->qp_num;
  me.lid = v.lid;
  std::memcpy(me.gid, v.gid.raw, 16);
  me.r_addr = reinterpret_cast<uintptr_t>(R);
  me.r_rkey = rmr->rkey;
  me.r_len = kRLen;
  me.a_addr = reinterpret_cast<uintptr_t>(A);
  me.a_rkey = amr->rkey;
  me.a_count = kACount;
  Hello peer;
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("server: send hello");
  if (!harness::read_all(harness::kCtlFd, &peer, sizeof peer, kWaitMs) || peer.magic != me.magic) die("server: no hello");
  v.connect(peer.qpn, peer.lid, peer.gid);

  struct Posted {
    Op op;
    uint64_t ordinal;
    Layout lay;
    std::vector<ibv_sge> sges;
  };
  std::deque<Posted> posted;
  Generator rx(seed, false);
  uint64_t ordinal = 0;
  auto post_next = [&]() {
    Op op;
    do op = rx.next();
    while (!consumes(op.kind));
    Posted p;
    p.op = op;
    p.ordinal = ordinal++;
    Rng r(op.sub ^ 0x5e5e5e5e5e5e5e5eULL);
    uint64_t extra = r.below(3) == 0 ? 0 : r.range(1, 256);
    uint64_t capacity = (op.kind == kWriteImm ? 0 : op.len) + extra;
    p.lay = make_layout(r, capacity, v.cap.max_recv_sge);
    if (p.lay.area > kRecvSlot) die("receive layout too large");
    uint8_t* area = RX + (p.ordinal % kRecvWindow) * kRecvSlot;
    std::memset(area, kCanary, p.lay.area);
    for (const auto& pc : p.lay.pieces)
      p.sges.push_back(ibv_sge{reinterpret_cast<uintptr_t>(area + pc.off), pc.len, xmr->lkey});
    ibv_recv_wr wr{};
    wr.wr_id = p.ordinal;
    wr.sg_list = p.sges.empty() ? nullptr : p.sges.data();
    wr.num_sge = static_cast<int>(p.sges.size());
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(v.qp, &wr, &bad)) die("ibv_post_recv (%zu SGEs): %s", p.sges.size(), std::strerror(rc));
    posted.push_back(std::move(p));
  };
  for (uint32_t i = 0; i < kRecvWindow; ++i) post_next();

  uint64_t received = 0, recv_bytes = 0;
  auto handle = [&](const ibv_wc& wc) {
    if (posted.empty()) die("server: completion with no receive posted: %s", harness::wc_str(wc).c_str());
    Posted& p = posted.front();
    const Op& op = p.op;
    const char* kn = kind_name(op.kind);
    if (wc.status != IBV_WC_SUCCESS)
      die("server: op %" PRIu64 " (%s, %u bytes): receive completion %s", op.idx, kn, op.len, harness::wc_str(wc).c_str());
    if (wc.wr_id != p.ordinal)
      die("server: op %" PRIu64 " (%s): receive completion wr_id %" PRIu64 ", expected %" PRIu64 " (out of order)",
          op.idx, kn, wc.wr_id, p.ordinal);
    int want_opcode = op.kind == kWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
    if (wc.opcode != want_opcode)
      die("server: op %" PRIu64 " (%s): opcode %d, expected %d", op.idx, kn, wc.opcode, want_opcode);
    if (wc.byte_len != op.len)
      die("server: op %" PRIu64 " (%s): byte_len %u, expected %u", op.idx, kn, wc.byte_len, op.len);
    if (wc.qp_num != v.qp->qp_num) die("server: op %" PRIu64 ": qp_num %u, expected %u", op.idx, wc.qp_num, v.qp->qp_num);
    bool imm = wc.wc_flags & IBV_WC_WITH_IMM;
    if (imm != has_imm(op.kind)) die("server: op %" PRIu64 " (%s): IBV_WC_WITH_IMM is %d", op.idx, kn, int(imm));
    if (imm && wc.imm_data != op.imm)
      die("server: op %" PRIu64 " (%s): imm_data 0x%08x, expected 0x%08x", op.idx, kn, wc.imm_data, op.imm);
    uint8_t* area = RX + (p.ordinal % kRecvWindow) * kRecvSlot;
    uint64_t covered = op.kind == kWriteImm ? 0 : op.len;
    uint64_t msg = 0;
    for (const auto& pc : p.lay.pieces) {
      uint64_t n = std::min<uint64_t>(pc.len, covered > msg ? covered - msg : 0);
      if (int64_t k = pcheck(area + pc.off, n, op.key, msg); k >= 0)
        die("server: op %" PRIu64 " (%s, %u bytes, %zu receive SGEs): message byte %" PRIu64 " is 0x%02x, expected "
            "0x%02x (around: %s)",
            op.idx, kn, op.len, p.lay.pieces.size(), msg + static_cast<uint64_t>(k), area[pc.off + k],
            pbyte(op.key, msg + static_cast<uint64_t>(k)),
            hexdump(area + pc.off + k, std::min<uint64_t>(16, n - static_cast<uint64_t>(k))).c_str());
      msg += pc.len;
    }
    if (int64_t k = check_guards(area, p.lay, covered); k >= 0)
      die("server: op %" PRIu64 " (%s, %u bytes): receive area byte %" PRId64 " outside the message was overwritten "
          "(0x%02x)",
          op.idx, kn, op.len, k, area[k]);
    ++received;
    recv_bytes += op.len;
    posted.pop_front();
    post_next();
  };
  auto poll = [&]() -> int {
    ibv_wc wc[16];
    int n = ibv_poll_cq(v.cq, 16, wc);
    if (n < 0) die("server: ibv_poll_cq: %d", n);
    for (int i = 0; i < n; ++i) handle(wc[i]);
    return n;
  };

  Generator model(seed, true);
  auto checkpoint = [&](uint64_t n) -> std::string {
    // Every consuming op below n has been received.
    auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
    while (posted.front().op.idx < n) {
      if (poll() == 0 && Clock::now() > deadline)
        die("server: checkpoint %" PRIu64 ": op %" PRIu64 " (%s) never arrived", n, posted.front().op.idx,
            kind_name(posted.front().op.kind));
    }
    while (model.index() < n) model.next();
    const auto& sh = model.shadow();
    if (std::memcmp(R, sh.data(), kRLen) != 0) {
      uint64_t i = 0;
      while (R[i] == sh[i]) ++i;
      uint64_t j = i;
      while (j < kRLen && R[j] != sh[j]) ++j;
      char b[512];
      std::snprintf(b, sizeof b,
                    "RDMA region differs from the model after op %" PRIu64 ": first bad byte at offset %" PRIu64
                    " (0x%02x, expected 0x%02x), first run of bad bytes %" PRIu64 " long",
                    n - 1, i, R[i], sh[i], j - i);
      return b;
    }
    for (uint32_t i = 0; i < kACount; ++i) {
      if (A[i] != model.counters()[i]) {
        char b[256];
        std::snprintf(b, sizeof b, "atomic counter %u is 0x%016" PRIx64 ", the model says 0x%016" PRIx64, i, A[i],
                      model.counters()[i]);
        return b;
      }
    }
    return "";
  };

  harness::LineReader ctl(harness::kCtlFd);
  if (!ctl.send_line("READY")) die("server: control channel");
  auto idle_since = Clock::now();
  for (;;) {
    if (poll() > 0) idle_since = Clock::now();
    std::string line;
    int r = ctl.poll_line(&line, 0);
    if (r < 0) die("server: the client closed the control channel");
    if (r == 0) {
      if (Clock::now() - idle_since > std::chrono::milliseconds(kWaitMs)) die("server: nothing happened for 60 s");
      continue;
    }
    idle_since = Clock::now();
    char cmd = line.empty() ? '?' : line[0];
    uint64_t n = std::strtoull(line.c_str() + 1, nullptr, 10);
    if (cmd != 'C' && cmd != 'D') die("server: bad control line '%s'", line.c_str());
    std::string err = checkpoint(n);
    if (!err.empty()) {
      ctl.send_line("BAD " + err);
      die("server: %s", err.c_str());
    }
    ctl.send_line("OK " + std::to_string(n));
    if (cmd == 'D') {
      // Nothing more may arrive.
      ibv_wc wc;
      if (ibv_poll_cq(v.cq, 1, &wc) != 0) die("server: an extra completion after the end: %s", harness::wc_str(wc).c_str());
      std::printf("SERVER received=%" PRIu64 " bytes=%" PRIu64 " checkpoint=%" PRIu64 "\n", received, recv_bytes, n);
      break;
    }
  }
  if (ibv_destroy_qp(v.qp) || ibv_dereg_mr(rmr) || ibv_dereg_mr(amr) || ibv_dereg_mr(xmr) || ibv_destroy_cq(v.cq) ||
      ibv_dealloc_pd(v.pd) || ibv_close_device(v.ctx))
    die("server: teardown failed");
  std::free(R);
  std::free(A);
  std::free(RX);
  std::printf("SERVER OK\n");
  return 0;
}

// ---------------------------------------------------------------------------
// Client

// FIFO allocator of areas in the local region (frees are in order).
class AreaRing {
 public:
  explicit AreaRing(uint64_t cap) : cap_(cap) {}
  bool alloc(uint64_t need, uint64_t* start) {
    need = (need + 63) & ~uint64_t{63};
    if (need > cap_) die("area of %" PRIu64 " bytes larger than the region", need);
    if (live_.empty()) tail_ = 0;
    uint64_t at;
    if (live_.empty()) {
      at = 0;
    } else {
      uint64_t head = live_.front().first;
      if (tail_ > head) {  // no wrap: free space is [tail, cap) and [0, head)
        if (tail_ + need <= cap_) at = tail_;
        else if (need <= head) at = 0;
        else return false;
      } else {
        if (tail_ + need <= head) at = tail_;
        else return false;
      }
    }
    live_.push_back({at, at + need});
    tail_ = at + need;
    used_ += need;
    *start = at;
    return true;
  }
  void free_oldest() {
    used_ -= live_.front().second - live_.front().first;
    live_.pop_front();
  }
  uint64_t used() const { return used_; }

 private:
  uint64_t cap_, tail_ = 0, used_ = 0;
  std::deque<std::pair<uint64_t, uint64_t>> live_;
};

struct Stats {
  uint64_t ops = 0, bytes = 0, per_kind[kKinds] = {}, inline_ops = 0, unsignaled = 0, fences = 0, multi_sge = 0,
           zero_len = 0, big = 0, max_sge_used = 0, chains = 0, checkpoints = 0;
};

int run_client(uint64_t seed, uint64_t max_ops, uint64_t budget_ms, uint64_t min_ops) {
  const auto t_start = Clock::now();
  Verbs v;
  v.open(64, 4);
  const uint32_t sq_depth = v.cap.max_send_wr;
  uint8_t* L = big_alloc(kLocalLen);
  ibv_mr* lmr = v.reg(L, kLocalLen, IBV_ACCESS_LOCAL_WRITE);
  Hello me, peer;
  me.qpn = v.qp->qp_num;
  me.lid = v.lid;
  std::memcpy(me.gid, v.gid.raw, 16);
  if (!harness::read_all(harness::kCtlFd, &peer, sizeof peer, kWaitMs) || peer.magic != me.magic) die("client: no hello");
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("client: send hello");
  if (peer.r_len != kRLen || peer.a_count != kACount) die("client: server geometry differs");
  v.connect(peer.qpn, peer.lid, peer.gid);
  harness::LineReader ctl(harness::kCtlFd);
  std::string line;
  if (ctl.poll_line(&line, kWaitMs) != 1 || line != "READY") die("client: server not ready ('%s')", line.c_str());

  struct Pending {
    uint64_t seq = 0;
    bool fence = false;
    Op op;
    bool signaled = false;
    bool inl = false;
    bool has_area = false;
    uint64_t area_start = 0;
    Layout lay;
    std::vector<ibv_sge> sges;
    std::vector<uint8_t> expect;  // READ: the bytes the server region holds
  };
  std::deque<Pending> pending;  // posted or chained, not yet retired; references stay valid
  std::vector<Pending*> chain;  // built, not yet posted
  AreaRing ring(kLocalLen);
  Generator gen(seed, true);
  Stats st;
  uint64_t next_seq = 1, last_completed_seq = 0, signaled_pending = 0;
  uint32_t unsignaled_run = 0;

  auto wc_opcode_of = [](const Pending& p) -> int {
    if (p.fence) return IBV_WC_RDMA_WRITE;
    switch (p.op.kind) {
      case kSend:
      case kSendImm: return IBV_WC_SEND;
      case kWrite:
      case kWriteImm: return IBV_WC_RDMA_WRITE;
      case kRead: return IBV_WC_RDMA_READ;
      case kCas: return IBV_WC_COMP_SWAP;
      default: return IBV_WC_FETCH_ADD;
    }
  };

  auto verify = [&](const Pending& p) {
    if (p.fence || !p.has_area) return;
    const Op& op = p.op;
    uint8_t* area = L + p.area_start;
    const char* kn = kind_name(op.kind);
    if (op.kind == kRead) {
      uint64_t msg = 0;
      for (const auto& pc : p.lay.pieces) {
        if (pc.len && std::memcmp(area + pc.off, p.expect.data() + msg, pc.len) != 0) {
          uint64_t k = 0;
          while (area[pc.off + k] == p.expect[msg + k]) ++k;
          die("client: op %" PRIu64 " (READ of %u bytes at remote offset %" PRIu64 " into %zu SGEs): byte %" PRIu64
              " is 0x%02x, expected 0x%02x (got %s, want %s)",
              op.idx, op.len, op.roff, p.lay.pieces.size(), msg + k, area[pc.off + k], p.expect[msg + k],
              hexdump(area + pc.off + k, std::min<uint64_t>(16, pc.len - k)).c_str(),
              hexdump(p.expect.data() + msg + k, std::min<uint64_t>(16, pc.len - k)).c_str());
        }
        msg += pc.len;
      }
      if (int64_t k = check_guards(area, p.lay, op.len); k >= 0)
        die("client: op %" PRIu64 " (READ of %u bytes): local byte %" PRId64 " outside the SGEs was overwritten (0x%02x)",
            op.idx, op.len, k, area[k]);
    } else if (is_atomic(op.kind)) {
      uint64_t got;
      std::memcpy(&got, area + 8, 8);
      if (got != op.expect_old)
        die("client: op %" PRIu64 " (%s on counter %u, operand 0x%016" PRIx64 "): returned 0x%016" PRIx64
            ", expected the original value 0x%016" PRIx64,
            op.idx, kn, op.aidx, op.compare_add, got, op.expect_old);
      if (canary_check(area, 8) >= 0 || canary_check(area + 16, 8) >= 0)
        die("client: op %" PRIu64 " (%s): bytes around the 8-byte result were overwritten", op.idx, kn);
    }
  };

  auto poll = [&]() -> int {
    ibv_wc wc[16];
    int n = ibv_poll_cq(v.cq, 16, wc);
    if (n < 0) die("client: ibv_poll_cq: %d", n);
    for (int i = 0; i < n; ++i) {
      const ibv_wc& w = wc[i];
      // Identify the WR.
      const Pending* hit = nullptr;
      for (const auto& p : pending) {
        if (p.seq == w.wr_id) {
          hit = &p;
          break;
        }
        if (p.seq > w.wr_id) break;
      }
      if (!hit) die("client: completion for an unknown WR: %s", harness::wc_str(w).c_str());
      if (w.status != IBV_WC_SUCCESS)
        die("client: op %" PRIu64 " (%s, %u bytes, %zu SGEs%s%s): completion %s", hit->op.idx,
            hit->fence ? "FENCE" : kind_name(hit->op.kind), hit->op.len, hit->sges.size(), hit->inl ? ", inline" : "",
            hit->signaled ? "" : ", unsignaled", harness::wc_str(w).c_str());
      if (!hit->signaled) die("client: an unsignaled WR completed: %s", harness::wc_str(w).c_str());
      if (w.wr_id <= last_completed_seq) die("client: completions out of order: %s", harness::wc_str(w).c_str());
      if (w.opcode != wc_opcode_of(*hit))
        die("client: op %" PRIu64 " (%s): completion opcode %d, expected %d", hit->op.idx, kind_name(hit->op.kind),
            w.opcode, wc_opcode_of(*hit));
      if (w.qp_num != v.qp->qp_num) die("client: completion qp_num %u, expected %u", w.qp_num, v.qp->qp_num);
      last_completed_seq = w.wr_id;
      // Retire everything up to it (RC: in order).
      while (!pending.empty() && pending.front().seq <= w.wr_id) {
        verify(pending.front());
        if (pending.front().has_area) ring.free_oldest();
        if (pending.front().signaled) --signaled_pending;
        pending.pop_front();
      }
    }
    return n;
  };

  auto flush_chain = [&]() {
    if (chain.empty()) return;
    std::vector<ibv_send_wr> wrs(chain.size());
    for (size_t i = 0; i < chain.size(); ++i) {
      Pending& p = *chain[i];
      ibv_send_wr& w = wrs[i];
      w = ibv_send_wr{};
      w.wr_id = p.seq;
      w.sg_list = p.sges.empty() ? nullptr : p.sges.data();
      w.num_sge = static_cast<int>(p.sges.size());
      w.next = i + 1 < chain.size() ? &wrs[i + 1] : nullptr;
      if (p.fence) {
        w.opcode = IBV_WR_RDMA_WRITE;
        w.wr.rdma.remote_addr = peer.r_addr;
        w.wr.rdma.rkey = peer.r_rkey;
        w.send_flags = IBV_SEND_SIGNALED;
        continue;
      }
      const Op& op = p.op;
      Rng r(op.sub ^ 0xf1a9f1a9f1a9f1a9ULL);
      static constexpr ibv_wr_opcode opc[] = {IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE,
                                              IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ,
                                              IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD};
      w.opcode = opc[op.kind];
      unsigned flags = p.signaled ? IBV_SEND_SIGNALED : 0;
      if (p.inl) flags |= IBV_SEND_INLINE;
      if ((op.kind == kSend || op.kind == kSendImm) && r.below(4) == 0) flags |= IBV_SEND_SOLICITED;
      if ((op.kind == kRead || is_atomic(op.kind)) && r.below(4) == 0) flags |= IBV_SEND_FENCE;
      w.send_flags = flags;
      if (has_imm(op.kind)) w.imm_data = op.imm;
      if (is_atomic(op.kind)) {
        w.wr.atomic.remote_addr = peer.a_addr + 8ull * op.aidx;
        w.wr.atomic.rkey = peer.a_rkey;
        w.wr.atomic.compare_add = op.compare_add;
        w.wr.atomic.swap = op.swap;
      } else if (remote_range(op.kind)) {
        w.wr.rdma.remote_addr = peer.r_addr + op.roff;
        w.wr.rdma.rkey = peer.r_rkey;
      }
    }
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(v.qp, wrs.data(), &bad)) {
      size_t at = bad ? static_cast<size_t>(bad - wrs.data()) : 0;
      const Pending& p = *chain[std::min(at, chain.size() - 1)];
      die("client: ibv_post_send of a chain of %zu: %s at WR %zu (op %" PRIu64 " %s, %u bytes, %zu SGEs%s)",
          chain.size(), std::strerror(rc), at, p.op.idx, p.fence ? "FENCE" : kind_name(p.op.kind), p.op.len,
          p.sges.size(), p.inl ? ", inline" : "");
    }
    if (chain.size() > 1) ++st.chains;
    // Inline data was copied at post time: the buffers are ours again.
    for (Pending* p : chain)
      if (p->inl)
        for (const auto& s : p->sges) std::memset(reinterpret_cast<void*>(s.addr), 0xEE, s.length);
    chain.clear();
  };

  auto add_fence = [&]() {
    Pending p;
    p.seq = next_seq++;
    p.fence = true;
    p.signaled = true;
    pending.push_back(std::move(p));
    ++signaled_pending;
    chain.push_back(&pending.back());
    ++st.fences;
    unsignaled_run = 0;
    flush_chain();
  };

  // Makes room: posts what is built, then polls; adds a signaled fence when
  // nothing signaled is outstanding.
  auto wait_progress = [&](const char* what) {
    flush_chain();
    if (signaled_pending == 0 && !pending.empty()) add_fence();
    auto deadline = Clock::now() + std::chrono::milliseconds(kWaitMs);
    while (poll() == 0) {
      if (Clock::now() > deadline)
        die("client: no completion for 60 s while waiting for %s (%zu WRs outstanding, oldest op %" PRIu64 " %s)", what,
            pending.size(), pending.empty() ? 0 : pending.front().op.idx,
            pending.empty() ? "-" : kind_name(pending.front().op.kind));
    }
  };

  auto checkpoint = [&](uint64_t n, bool last) {
    flush_chain();
    if (!pending.empty() && !pending.back().signaled) add_fence();
    while (!pending.empty()) wait_progress("the checkpoint drain");
    ctl.send_line(std::string(last ? "D " : "C ") + std::to_string(n));
    std::string reply;
    int r = ctl.poll_line(&reply, kWaitMs);
    if (r != 1) die("client: no checkpoint reply from the server for op %" PRIu64, n);
    if (reply.rfind("OK", 0) != 0) die("client: server at checkpoint %" PRIu64 ": %s", n, reply.c_str());
    ++st.checkpoints;
  };

  const uint64_t low_water_area = kLocalLen / 2;
  uint64_t idx = 0;
  for (;; ++idx) {
    auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t_start).count();
    if (idx >= max_ops || (static_cast<uint64_t>(elapsed) > budget_ms && idx >= min_ops)) break;
    Op op = gen.next();
    Rng r(op.sub ^ 0xc11e47c11e47ULL);
    Pending p;
    p.op = op;
    // The local area.
    if (is_atomic(op.kind)) {
      p.lay.pieces.push_back({8, 8});
      p.lay.area = 24;
    } else {
      p.lay = make_layout(r, op.len, v.cap.max_send_sge);
    }
    // Room in the send queue (one slot kept for a fence) and in the region.
    while (pending.size() + 2 > sq_depth) wait_progress("send queue room");
    while (!ring.alloc(p.lay.area, &p.area_start)) wait_progress("local buffer room");
    p.has_area = true;
    uint8_t* area = L + p.area_start;
    std::memset(area, kCanary, p.lay.area);
    uint64_t msg = 0;
    for (const auto& pc : p.lay.pieces) {
      if (op.kind != kRead && !is_atomic(op.kind)) pfill(area + pc.off, pc.len, op.key, msg);
      p.sges.push_back(ibv_sge{reinterpret_cast<uintptr_t>(area + pc.off), pc.len, lmr->lkey});
      msg += pc.len;
    }
    if (op.kind == kRead) {
      const auto& sh = gen.shadow();
      p.expect.assign(sh.begin() + static_cast<ptrdiff_t>(op.roff),
                      sh.begin() + static_cast<ptrdiff_t>(op.roff + op.len));
    }
    p.inl = op.kind != kRead && !is_atomic(op.kind) && op.len <= v.cap.max_inline_data && r.below(2) == 0;
    bool low = pending.size() + 4 > sq_depth / 2 || ring.used() > low_water_area;
    p.signaled = r.below(2) == 0 || unsignaled_run >= 6 || low || idx + 1 == max_ops;
    unsignaled_run = p.signaled ? 0 : unsignaled_run + 1;
    p.seq = next_seq++;
    // Stats.
    ++st.ops;
    st.bytes += op.len;
    ++st.per_kind[op.kind];
    if (p.inl) ++st.inline_ops;
    if (!p.signaled) ++st.unsignaled;
    if (p.sges.size() > 1) ++st.multi_sge;
    st.max_sge_used = std::max<uint64_t>(st.max_sge_used, p.sges.size());
    if (op.len == 0) ++st.zero_len;
    if (op.len >= (1u << 20)) ++st.big;

    if (p.signaled) ++signaled_pending;
    pending.push_back(std::move(p));
    chain.push_back(&pending.back());
    if (chain.size() >= 1 + r.below(4)) flush_chain();
    poll();
    if ((idx + 1) % 250 == 0) checkpoint(idx + 1, false);
  }
  checkpoint(idx, true);
  double secs = std::chrono::duration<double>(Clock::now() - t_start).count();
  std::printf("RESULT ops=%" PRIu64 " bytes=%" PRIu64 " send=%" PRIu64 " send_imm=%" PRIu64 " write=%" PRIu64
              " write_imm=%" PRIu64 " read=%" PRIu64 " cas=%" PRIu64 " faa=%" PRIu64 " inline=%" PRIu64
              " unsignaled=%" PRIu64 " fences=%" PRIu64 " multi_sge=%" PRIu64 " max_sge=%" PRIu64 " zero_len=%" PRIu64
              " big=%" PRIu64 " chains=%" PRIu64 " checkpoints=%" PRIu64 " seconds=%.1f\n",
              st.ops, st.bytes, st.per_kind[kSend], st.per_kind[kSendImm], st.per_kind[kWrite], st.per_kind[kWriteImm],
              st.per_kind[kRead], st.per_kind[kCas], st.per_kind[kFaa], st.inline_ops, st.unsignaled, st.fences,
              st.multi_sge, st.max_sge_used, st.zero_len, st.big, st.chains, st.checkpoints, secs);
  if (ibv_destroy_qp(v.qp) || ibv_dereg_mr(lmr) || ibv_destroy_cq(v.cq) || ibv_dealloc_pd(v.pd) ||
      ibv_close_device(v.ctx))
    die("client: teardown failed");
  pending.clear();
  std::free(L);
  std::printf("CLIENT OK\n");
  return 0;
}

// ---------------------------------------------------------------------------
// The gtest driver

uint64_t env_u64(const char* name, uint64_t def) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 0) : def;
}

uint64_t field(const std::string& out, const std::string& name) {
  auto pos = out.find(" " + name + "=");
  if (pos == std::string::npos) return 0;
  return std::strtoull(out.c_str() + pos + name.size() + 2, nullptr, 10);
}

// Runs one worker pair; `mapped` false runs it with SHMRDMA_MAPPED=0 (the
// CMA data mover instead of the mapped tier). `client_device` non-empty:
// the client opens that device of the same home (the server stays on
// shm0), so every operation crosses devices (peers found through the home's
// device directory by LID).
void run_pair(bool mapped, const std::string& client_device = "") {
  auto& home = harness::Home::get();
  const uint64_t seed = env_u64("DP_SEED", 20261129) + (mapped ? 0 : 1);
  const uint64_t ops = env_u64("DP_OPS", 4000);
  const uint64_t budget_ms = env_u64("DP_BUDGET_MS", 25000);
  const uint64_t min_ops = std::min<uint64_t>(ops, 400);
  std::printf("seed %" PRIu64 " (DP_SEED=%" PRIu64 " reproduces), up to %" PRIu64 " ops or %" PRIu64 " ms, %s tier%s%s\n",
              seed, seed - (mapped ? 0 : 1), ops, budget_ms, mapped ? "mapped" : "CMA",
              client_device.empty() ? "" : ", client on ", client_device.c_str());
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  std::string exe = harness::self_exe();
  harness::Child server, client;
  auto sargs = home.run_argv({exe, "--worker", "server", "--seed", std::to_string(seed)});
  auto cargs = home.run_argv({exe, "--worker", "client", "--seed", std::to_string(seed), "--ops", std::to_string(ops),
                              "--budget-ms", std::to_string(budget_ms), "--min-ops", std::to_string(min_ops)});
  std::string old = harness::getenv_str("SHMRDMA_MAPPED");
  if (!mapped) ::setenv("SHMRDMA_MAPPED", "0", 1);
  bool started = server.start(sargs, {.fd3 = sv[0]}) && harness::start_on(client, client_device, cargs, {.fd3 = sv[1]});
  if (!mapped) {
    if (old.empty()) ::unsetenv("SHMRDMA_MAPPED");
    else ::setenv("SHMRDMA_MAPPED", old.c_str(), 1);
  }
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_TRUE(started) << server.output() << client.output();
  // Whichever ends first: if it failed, give the other a moment, then stop it.
  auto deadline = harness::Clock::now() + std::chrono::milliseconds(budget_ms + 60000);
  while (!server.exited() && !client.exited() && harness::Clock::now() < deadline) {
    server.drain(0);
    client.drain(20);
  }
  harness::Result c = client.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(20)));
  harness::Result s = server.wait(std::min(deadline, harness::Clock::now() + std::chrono::seconds(20)));
  std::printf("--- client ---\n%s--- server ---\n%s", c.out.c_str(), s.out.c_str());
  EXPECT_TRUE(c.ok()) << "client: " << c.describe();
  EXPECT_TRUE(s.ok()) << "server: " << s.describe();
  EXPECT_NE(c.out.find("CLIENT OK"), std::string::npos);
  EXPECT_NE(s.out.find("SERVER OK"), std::string::npos);
  if (c.ok()) {
    EXPECT_GE(field(c.out, "ops"), min_ops);
    for (const char* k : {"send", "send_imm", "write", "write_imm", "read", "cas", "faa", "inline", "unsignaled",
                          "multi_sge", "zero_len", "big", "chains", "checkpoints"})
      EXPECT_GT(field(c.out, k), 0u) << "the run exercised no '" << k << "'";
  }
  // Nothing left behind.
  nlohmann::json st = home.status();
  for (const auto& d : st["devices"]) EXPECT_TRUE(d["processes"].empty()) << st.dump(2);
  EXPECT_TRUE(home.ctx_files().empty());
}

TEST(Integrity, RandomOperationsMappedTier) {
  HARNESS_REQUIRE_DEVICE();
  run_pair(true);
}

TEST(Integrity, RandomOperationsCmaTier) {
  HARNESS_REQUIRE_DEVICE();
  run_pair(false);
}

// Server on shm0, client on shm1 of the same home: RC between two devices.
TEST(Integrity, RandomOperationsAcrossDevices) {
  HARNESS_REQUIRE_DEVICE();
  std::string why;
  ASSERT_TRUE(harness::Home::get().up_device("shm1", &why)) << why;
  run_pair(true, "shm1");
}

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string role = argv[2];
    uint64_t seed = 1, ops = 1000, budget = 30000, min_ops = 100;
    for (int i = 3; i + 1 < argc; i += 2) {
      std::string k = argv[i];
      uint64_t val = std::strtoull(argv[i + 1], nullptr, 0);
      if (k == "--seed") seed = val;
      else if (k == "--ops") ops = val;
      else if (k == "--budget-ms") budget = val;
      else if (k == "--min-ops") min_ops = val;
    }
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    if (role == "server") return run_server(seed);
    if (role == "client") return run_client(seed, ops, budget, min_ops);
    die("unknown role %s", role.c_str());
  }
  return harness::run_tests_as_root(argc, argv);
}
