// Registered memory as applications manage it: buffers that are registered,
// deregistered, freed and allocated again at the same address, file
// mappings, one buffer under two MRs. A peer process WRITEs into the
// owner's MR and READs from it; the owner checks that the WRITE reached the
// memory it sees at that address and the peer checks that the READ returned
// what the owner wrote there.
//
// As a gtest (no arguments) it starts two workers of this executable through
// `shmrdma run`, connected by a socketpair on fd 3:
//
//   dp_memory --worker owner|peer --scenario NAME
//
// Scenarios (owner side):
//   plain    mmap, fill, register
//   remap    mmap, register, deregister, munmap; mmap again at the same
//            address, fill, register
//   realloc  malloc(64 MiB), register, deregister, free; malloc(64 MiB)
//            again (glibc mmaps it and usually gets the same address back),
//            fill, register
//   heap     the same with 64 KiB (from the brk heap)
//   file     a MAP_SHARED file mapping; the WRITE must reach the file
//   twice    the same buffer under two MRs; the first is deregistered
//   fork     a child forked after the registration writes to its copy of the
//            buffer; the parent must not see that write
//   fork-neighbor  the same for a small allocation that shares a page with a
//            registered heap buffer (memory the application never registered)
//   threads  two other threads store into the middle of the buffer all the
//            time: while it is registered (every store must survive the move
//            into shared memory), while a child is forked, and while the peer
//            writes and reads; the MR must be in the mapped tier all the same
//
// Every owner also checks the MR's tier in `shmrdma status --json`: mapped
// for anonymous memory, CMA ("not private anonymous") for the file.
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "home.h"
#include "verbs.h"
#include "wire.h"
#include "worker.h"

namespace {

using harness::die;

constexpr size_t kLen = 1u << 20;
constexpr size_t kBigLen = 64u << 20;  // realloc: above glibc's largest mmap threshold, always mmap'd
constexpr size_t kProbe = 256u << 10;  // the peer writes the first and reads the last kProbe bytes
constexpr uint8_t kOld = 0x33;      // content before the buffer was freed / re-made
constexpr uint8_t kCurrent = 0x22;  // what the owner holds when the peer reads
constexpr uint8_t kWritten = 0x77;  // what the peer writes
char* g_neighbor = nullptr;         // fork-neighbor

struct Hello {
  uint32_t magic = 0x44504d45;
  uint32_t qpn = 0;
  uint16_t lid = 0;
  uint16_t premap = 0;  // owner: its MR is in the mapped tier and small enough for the peer to map it at connect
  uint32_t rkey = 0;
  uint64_t addr = 0;
  uint64_t len = 0;
};

struct Ep {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
};

void open_ep(Ep* e) {
  std::string why;
  e->ctx = harness::open_shm0(&why);
  if (!e->ctx) die("%s", why.c_str());
  e->pd = ibv_alloc_pd(e->ctx);
  e->cq = e->pd ? ibv_create_cq(e->ctx, 64, nullptr, nullptr, 0) : nullptr;
  if (!e->cq) die("pd/cq: %s", std::strerror(errno));
  ibv_qp_init_attr ia{};
  ia.send_cq = e->cq;
  ia.recv_cq = e->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 8;
  ia.cap.max_recv_wr = 8;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  e->qp = ibv_create_qp(e->pd, &ia);
  if (!e->qp) die("ibv_create_qp: %s", std::strerror(errno));
}

// The views of other processes' shmrdma regions this process has mapped:
// the lines of /proc/self/maps that name a shmrdma memfd whose inode is not
// that of the region holding `own` (this process's registered buffer).
int peer_views(const void* own) {
  std::FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) die("/proc/self/maps: %s", std::strerror(errno));
  struct View {
    uintptr_t lo, hi;
    unsigned long inode;
  };
  std::vector<View> views;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    if (!std::strstr(line, "/memfd:shmrdma-mr")) continue;
    View v{};
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %*s %*s %*s %lu", &v.lo, &v.hi, &v.inode) == 3) views.push_back(v);
  }
  std::fclose(f);
  const auto at = reinterpret_cast<uintptr_t>(own);
  unsigned long own_inode = 0;
  for (const View& v : views)
    if (at >= v.lo && at < v.hi) own_inode = v.inode;
  return static_cast<int>(std::count_if(views.begin(), views.end(), [&](const View& v) { return v.inode != own_inode; }));
}

void connect_ep(Ep* e, const Hello& peer) {
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (harness::qp_to_init(e->qp, access) || harness::qp_to_rtr(e->qp, peer.qpn, peer.lid) || harness::qp_to_rts(e->qp))
    die("connect failed");
}

constexpr int kRemote = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// The same buffer address, made again after the old one was released.
uint8_t* remake(const std::string& scenario, Ep& e, std::vector<ibv_mr*>* keep, std::string* note) {
  if (scenario == "plain") {
    void* p = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    return static_cast<uint8_t*>(p);
  }
  if (scenario == "remap") {
    void* p = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    std::memset(p, kOld, kLen);
    ibv_mr* mr = ibv_reg_mr(e.pd, p, kLen, kRemote);
    if (!mr) die("first ibv_reg_mr: %s", std::strerror(errno));
    if (ibv_dereg_mr(mr)) die("ibv_dereg_mr");
    if (::munmap(p, kLen)) die("munmap");
    void* q = ::mmap(p, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (q != p) die("could not map the same address again");
    *note = "same address again";
    return static_cast<uint8_t*>(q);
  }
  if (scenario == "realloc" || scenario == "heap") {
    size_t n = scenario == "heap" ? (64u << 10) : kBigLen;
    auto* p = static_cast<uint8_t*>(std::malloc(n));
    if (!p) die("malloc");
    std::memset(p, kOld, n);
    ibv_mr* mr = ibv_reg_mr(e.pd, p, n, kRemote);
    if (!mr) die("first ibv_reg_mr: %s", std::strerror(errno));
    if (ibv_dereg_mr(mr)) die("ibv_dereg_mr");
    std::free(p);
    auto* q = static_cast<uint8_t*>(std::malloc(n));
    if (!q) die("malloc");
    *note = q == p ? "malloc returned the same address" : "malloc returned another address";
    return q;
  }
  if (scenario == "file") {
    char path[] = "/tmp/shmrdma-dpmem-XXXXXX";
    int fd = ::mkstemp(path);
    if (fd < 0 || ::ftruncate(fd, kLen)) die("temp file");
    ::unlink(path);
    void* p = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) die("mmap file");
    *note = std::to_string(fd);  // the owner checks the file through this descriptor
    return static_cast<uint8_t*>(p);
  }
  if (scenario == "fork-neighbor") {
    // A heap buffer that ends inside a page, and a small allocation placed
    // in that same page.
    size_t n = (64u << 10) + 100;
    auto* p = static_cast<uint8_t*>(std::malloc(n));
    if (!p) die("malloc");
    const uintptr_t first = reinterpret_cast<uintptr_t>(p) / 4096, last = (reinterpret_cast<uintptr_t>(p) + n - 1) / 4096;
    for (int i = 0; i < 64 && !g_neighbor; ++i) {
      auto* c = static_cast<char*>(std::malloc(48));
      uintptr_t pg = reinterpret_cast<uintptr_t>(c) / 4096;
      if (pg >= first && pg <= last) g_neighbor = c;
    }
    if (!g_neighbor) die("could not place an allocation in a page of the buffer");
    *g_neighbor = 'P';
    *note = "neighbor allocation in the buffer's last page";
    return p;
  }
  if (scenario == "twice" || scenario == "fork" || scenario == "threads") {
    void* p = ::mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap");
    if (scenario == "twice") {
      std::memset(p, kCurrent, kLen);
      ibv_mr* first = ibv_reg_mr(e.pd, p, kLen, kRemote);
      if (!first) die("first ibv_reg_mr: %s", std::strerror(errno));
      keep->push_back(first);  // deregistered after the second registration
    }
    return static_cast<uint8_t*>(p);
  }
  die("unknown scenario %s", scenario.c_str());
}

// Other threads storing into buf[kProbe, len - kProbe) (threads scenario):
// writer w stores 1, 2, 3... into its words in turn, v into word v mod its
// word count, slowly enough that a lap outlasts a registration, so a store
// lost in the move stays visible as an older value once they stop.
class Writers {
 public:
  static constexpr uint64_t kN = 2;
  void start(uint8_t* buf, size_t len) {
    words_ = reinterpret_cast<uint64_t*>(buf + kProbe);
    per_ = (len - 2 * kProbe) / 8 / kN;
    if (last_[0].load() == 0) std::memset(words_, 0, per_ * kN * 8);  // the first start: nothing stored yet
    stop_ = false;
    for (uint64_t w = 0; w < kN; ++w)
      ts_.emplace_back([this, w] {
        for (uint64_t v = last_[w].load() + 1; !stop_.load(std::memory_order_relaxed); ++v) {
          reinterpret_cast<volatile uint64_t*>(words_)[(v % per_) * kN + w] = v;
          last_[w].store(v, std::memory_order_release);
          for (int k = 0; k < 40; ++k) __builtin_ia32_pause();
          if (v % 16 == 0) std::this_thread::yield();  // leave the CPUs to the owner and the peer (sanitizers, load)
        }
      });
    for (uint64_t w = 0; w < kN; ++w)
      while (last_[w].load() < 3) std::this_thread::yield();
  }
  // Stops them; the number of words that do not hold their writer's last
  // store there (*first: the first such word's index, its value, the store).
  uint64_t stop_and_check(std::string* first) {
    stop_ = true;
    for (auto& t : ts_) t.join();
    ts_.clear();
    uint64_t bad = 0;
    for (uint64_t w = 0; w < kN; ++w) {
      const uint64_t l = last_[w].load();
      for (uint64_t j = 0; j < per_; ++j) {
        const uint64_t want = l >= j ? l - (l - j) % per_ : 0, got = words_[j * kN + w];
        if (got != want && bad++ == 0)
          *first = "word " + std::to_string(j * kN + w) + " holds " + std::to_string(got) + ", its writer stored " +
                   std::to_string(want) + " there";
      }
    }
    return bad;
  }

 private:
  uint64_t* words_ = nullptr;
  uint64_t per_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> last_[kN] = {};
  std::vector<std::thread> ts_;
};

// The MR's tier and reason in `shmrdma status --json` ("" when not listed).
std::string status_tier(uint32_t rkey) {
  const char* bin = std::getenv("SHMRDMA_BIN");
  if (!bin) return "";
  std::string cmd = std::string(bin) + " status --json";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return "";
  std::string out;
  char chunk[4096];
  while (size_t n = std::fread(chunk, 1, sizeof chunk, f)) out.append(chunk, n);
  ::pclose(f);
  try {
    const nlohmann::json st = nlohmann::json::parse(out);
    for (const auto& d : st["devices"])
      for (const auto& p : d["processes"])
        if (p.value("pid", -1LL) == static_cast<long long>(::getpid()) && p.contains("mrs"))
          for (const auto& m : p["mrs"])
            if (m.value("rkey", 0u) == rkey) return m.value("tier", "") + (m.contains("why") ? " (" + m.value("why", "") + ")" : "");
  } catch (const std::exception& ex) {
    std::printf("status: %s\n", ex.what());
  }
  std::printf("status: pid %d not listed\n", static_cast<int>(::getpid()));
  return "";
}

int run_owner(const std::string& scenario) {
  Ep e;
  open_ep(&e);
  std::vector<ibv_mr*> extra;
  std::string note;
  uint8_t* buf = remake(scenario, e, &extra, &note);
  size_t len = scenario == "heap" ? (64u << 10) : scenario == "realloc" ? kBigLen
             : scenario == "fork-neighbor" ? (64u << 10) + 100 : kLen;
  std::memset(buf, kCurrent, len);
  Writers writers;
  const bool threads = scenario == "threads";
  if (threads) writers.start(buf, len);
  ibv_mr* mr = ibv_reg_mr(e.pd, buf, len, kRemote);
  if (!mr) die("ibv_reg_mr: %s", std::strerror(errno));
  if (threads) {
    std::string first;
    if (uint64_t lost = writers.stop_and_check(&first))
      die("%" PRIu64 " stores of other threads were lost while ibv_reg_mr moved the buffer: %s", lost, first.c_str());
    writers.start(buf, len);  // and again while fork() and the peer run
  }
  for (ibv_mr* m : extra)
    if (ibv_dereg_mr(m)) die("ibv_dereg_mr of the first MR");
  const std::string tier = status_tier(mr->rkey);
#if defined(__SANITIZE_ADDRESS__)
  const char* forced = nullptr;
  const bool want_mapped = false;  // sanitizer builds use the CMA tier only
#else
  const char* forced = std::getenv("SHMRDMA_MAPPED");  // 0: the CMA tier only; single: no userfaultfd
  const bool want_mapped = scenario != "file" && !(forced && std::strcmp(forced, "0") == 0);
#endif
  bool any = forced && std::strcmp(forced, "single") == 0;
#if defined(__SANITIZE_THREAD__)
  any = any || scenario == "heap";  // TSan's allocator serves malloc() from memory of its own
#endif
  if (!any && (want_mapped ? tier != "mapped" : tier.rfind("cma (", 0) != 0))
    die("scenario %s: shmrdma status shows the MR's tier as \"%s\", expected %s", scenario.c_str(), tier.c_str(),
        want_mapped ? "mapped" : "cma with a reason");
  note += note.empty() ? "" : ", ";
  note += tier + " tier";
  if (threads) {
    pid_t c = ::fork();
    if (c == 0) {
      std::memset(buf, 0x99, len);
      std::_Exit(0);
    }
    int st = 0;
    ::waitpid(c, &st, 0);
    if (buf[0] != kCurrent || buf[len - 1] != kCurrent)
      die("a child forked while other threads wrote the registered buffer wrote to its copy and the parent sees it");
  }
  if (scenario == "fork") {
    // The child writes into its copy of the registered buffer.
    pid_t c = ::fork();
    if (c == 0) {
      std::memset(buf, 0x99, len);
      std::_Exit(0);
    }
    int st = 0;
    ::waitpid(c, &st, 0);
    if (buf[0] != kCurrent)
      die("a child forked after ibv_reg_mr wrote to its copy of the buffer and the parent sees it (byte 0 is "
          "0x%02x, expected 0x%02x): fork() no longer gives the child a private copy of registered memory",
          buf[0], kCurrent);
  }
  if (scenario == "fork-neighbor") {
    // The child writes into its copy of an allocation that was never
    // registered (it only shares a page with a registered buffer).
    pid_t c = ::fork();
    if (c == 0) {
      *g_neighbor = 'C';
      std::_Exit(0);
    }
    int st = 0;
    ::waitpid(c, &st, 0);
    if (*g_neighbor != 'P')
      die("a child forked after ibv_reg_mr wrote to its copy of a 48-byte malloc() block that only shares a page "
          "with the registered buffer, and the parent sees the write: fork() no longer isolates unregistered memory");
  }
  // The application keeps using the buffer after registration.
  buf[len - 1] = kCurrent;
  Hello me, peer;
  me.qpn = e.qp->qp_num;
  me.lid = harness::port_lid(e.ctx);
  me.rkey = mr->rkey;
  me.addr = reinterpret_cast<uintptr_t>(buf);
  me.len = len;
  me.premap = tier == "mapped" && len <= kLen;
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("hello");
  if (!harness::read_all(harness::kCtlFd, &peer, sizeof peer, 30000)) die("no hello");
  connect_ep(&e, peer);
  harness::LineReader ctl(harness::kCtlFd);
  ctl.send_line("GO");
  std::string line;
  if (ctl.poll_line(&line, 30000) != 1) die("the peer did not report");
  std::printf("peer: %s (%s)\n", line.c_str(), note.c_str());
  size_t half = std::min(kProbe, len / 2);
  size_t bad = half;
  for (size_t i = 0; i < half; ++i)
    if (buf[i] != kWritten) {
      bad = i;
      break;
    }
  if (bad != half)
    die("scenario %s (%s): the peer's RDMA WRITE did not reach the owner's memory: byte %zu is 0x%02x, expected "
        "0x%02x",
        scenario.c_str(), note.c_str(), bad, buf[bad], kWritten);
  if (scenario == "file") {
    int fd = std::atoi(note.c_str());
    ::msync(buf, len, MS_SYNC);
    std::vector<uint8_t> f(half);
    if (::pread(fd, f.data(), half, 0) != static_cast<ssize_t>(half)) die("pread");
    for (size_t i = 0; i < half; ++i)
      if (f[i] != kWritten) die("the WRITE is in the mapping but not in the file (byte %zu is 0x%02x)", i, f[i]);
  }
  if (threads) {
    std::string first;
    if (uint64_t lost = writers.stop_and_check(&first))
      die("%" PRIu64 " stores of other threads into the shared buffer were lost while the peer wrote: %s", lost,
          first.c_str());
  }
  if (line.rfind("READ ok", 0) != 0)
    die("scenario %s (%s): the peer's RDMA READ did not return the owner's memory: %s", scenario.c_str(), note.c_str(),
        line.c_str());
  ctl.send_line("BYE");
  if (ibv_destroy_qp(e.qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(e.cq) || ibv_dealloc_pd(e.pd) ||
      ibv_close_device(e.ctx))
    die("teardown");
  if (scenario == "realloc" || scenario == "heap" || scenario == "fork-neighbor") std::free(buf);
  else ::munmap(buf, len);
  std::printf("OWNER OK %s\n", scenario.c_str());
  return 0;
}

int run_peer() {
  Ep e;
  open_ep(&e);
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, kLen)) die("alloc");
  auto* buf = static_cast<uint8_t*>(mem);
  ibv_mr* mr = ibv_reg_mr(e.pd, buf, kLen, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) die("ibv_reg_mr");
  Hello me, owner;
  me.qpn = e.qp->qp_num;
  me.lid = harness::port_lid(e.ctx);
  if (!harness::read_all(harness::kCtlFd, &owner, sizeof owner, 30000) || owner.magic != me.magic) die("no hello");
  if (!harness::write_all(harness::kCtlFd, &me, sizeof me)) die("hello");
  // The owner registered its buffer before it said hello: connecting maps
  // it here (Peer::premap_regions), before any operation needs it.
  const int views_before = peer_views(buf);
  connect_ep(&e, owner);
  const int views_after = peer_views(buf);
  if (owner.premap && views_after <= views_before)
    die("connecting did not map the owner's mapped-tier MR (views of other processes' regions: %d before, %d after): "
        "the first WRITE or READ would map it in the data path",
        views_before, views_after);
  harness::LineReader ctl(harness::kCtlFd);
  std::string line;
  if (ctl.poll_line(&line, 30000) != 1 || line != "GO") die("owner not ready");
  size_t half = std::min<size_t>(kProbe, owner.len / 2);
  std::memset(buf, kWritten, half);
  std::memset(buf + half, 0, half);
  ibv_sge w{reinterpret_cast<uintptr_t>(buf), static_cast<uint32_t>(half), mr->lkey};
  ibv_sge r{reinterpret_cast<uintptr_t>(buf + half), static_cast<uint32_t>(half), mr->lkey};
  ibv_send_wr wr[2]{};
  wr[0].wr_id = 1;
  wr[0].opcode = IBV_WR_RDMA_WRITE;
  wr[0].sg_list = &w;
  wr[0].num_sge = 1;
  wr[0].send_flags = IBV_SEND_SIGNALED;
  wr[0].wr.rdma.remote_addr = owner.addr;
  wr[0].wr.rdma.rkey = owner.rkey;
  wr[0].next = &wr[1];
  wr[1].wr_id = 2;
  wr[1].opcode = IBV_WR_RDMA_READ;
  wr[1].sg_list = &r;
  wr[1].num_sge = 1;
  wr[1].send_flags = IBV_SEND_SIGNALED;
  wr[1].wr.rdma.remote_addr = owner.addr + owner.len - half;
  wr[1].wr.rdma.rkey = owner.rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(e.qp, wr, &bad)) die("ibv_post_send: %s", std::strerror(rc));
  for (int i = 0; i < 2; ++i) {
    ibv_wc wc{};
    if (!harness::poll_one(e.cq, &wc, 10000)) die("no completion");
    if (wc.status != IBV_WC_SUCCESS) die("completion %s", harness::wc_str(wc).c_str());
  }
  std::string result = "READ ok";
  for (size_t i = 0; i < half; ++i)
    if (buf[half + i] != kCurrent) {
      char b[160];
      std::snprintf(b, sizeof b, "READ bad: byte %zu is 0x%02x, the owner holds 0x%02x%s", i, buf[half + i], kCurrent,
                    buf[half + i] == kOld ? " (the content the buffer had before it was freed)" : "");
      result = b;
      break;
    }
  ctl.send_line(result);
  ctl.poll_line(&line, 30000);
  if (ibv_destroy_qp(e.qp) || ibv_dereg_mr(mr) || ibv_destroy_cq(e.cq) || ibv_dealloc_pd(e.pd) ||
      ibv_close_device(e.ctx))
    die("teardown");
  std::free(mem);
  std::printf("PEER done: %s\n", result.c_str());
  return 0;
}

// ---------------------------------------------------------------------------

class Memory : public ::testing::TestWithParam<std::string> {};

TEST_P(Memory, PeerWriteAndReadSeeTheOwnersMemory) {
  HARNESS_REQUIRE_DEVICE();
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' allocators never put a small allocation in the pages of
  // a large one, so the scenario cannot be set up (and sanitizer builds use
  // the CMA tier, which shares no pages).
  if (std::string(GetParam()) == "fork-neighbor") GTEST_SKIP() << "not reproducible under a sanitizer's allocator";
#endif
  harness::run_worker_pair({"--scenario", GetParam()}, 60);
}

INSTANTIATE_TEST_SUITE_P(Scenarios, Memory,
                         ::testing::Values("plain", "remap", "realloc", "heap", "file", "twice", "fork",
                                           "fork-neighbor", "threads"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace

HARNESS_TEST_ENVIRONMENT(.tag = "dptest");

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--worker") {
    std::string role = argv[2], scenario = "plain";
    for (int i = 3; i + 1 < argc; i += 2)
      if (std::string(argv[i]) == "--scenario") scenario = argv[i + 1];
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return role == "owner" ? run_owner(scenario) : run_peer();
  }
  return harness::run_tests_as_root(argc, argv);
}
