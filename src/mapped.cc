#include "mapped.h"

#include "layout.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace shmrdma {

namespace {

constexpr uint64_t kMaxRegions = 4096;  // shared regions alive at once, process-wide
constexpr uint64_t kMaxPeerMappings = 1024;

constexpr char kMemfdName[] = "shmrdma-mr";
constexpr char kMemfdPath[] = "/memfd:shmrdma-mr";  // how /proc/self/maps names our memfds

struct Region {
  int fd;          // -1 once the last MR went and the range had to stay shared
  uint64_t start;  // page-aligned
  uint64_t len;    // page multiple
  uint64_t ino;    // the memfd's inode: identifies the region to peers and in /proc/self/maps
  uint32_t refs;   // MRs on the region
};

std::mutex g_mu;
std::vector<Region>* g_regions = nullptr;  // leaked on purpose: regions outlive contexts
bool g_atfork = false;

uint64_t page_size() { return static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)); }

// After populating a fresh mapping (up to kPopulatePeerMax), one load from
// each of its pages, so that the CPU's translation of every page is made
// now, at registration or at the first use of a peer's region, and not in the
// first operations that move bytes through it (as hardware's MRs, pinned
// and translated at registration). On a bare-metal or EPT guest a page's
// first access after population is a page walk (tens of ns); under shadow
// paging it is a trap to the hypervisor: on the VMs we measure on, a
// populated 1 MiB mapping took 1.07-1.54 ms for its first memset and
// 0.013-0.034 ms once each page had been read (the reads taking the 1.1-1.4
// ms instead), and perftest's first 1 MiB WRITE 2.7 ms (source and
// destination both fresh), a fifth of ib_write_bw -n 500's run. Reading
// changes nothing: other threads may write the range meanwhile, and the
// value read is thrown away, so ThreadSanitizer is told not to see these
// loads (they are for the MMU, not data the program uses).
__attribute__((no_sanitize("thread"))) void touch_pages(const void* p, uint64_t len) noexcept {
  const uint64_t ps = page_size();
  const auto* b = static_cast<const volatile uint8_t*>(p);
  for (uint64_t off = 0; off < len; off += ps) (void)b[off];
}

// The memory system calls this file makes, straight to the kernel: programs
// interpose mmap/mremap/munmap (UCX's memory hooks patch every object's
// relocations, and pass a garbage new_address to a five-argument mremap);
// nothing of theirs must run in the middle of a move, nor see our remaps of
// memory whose contents do not change.
void* sys_mmap(void* addr, uint64_t len, int prot, int flags, int fd) {
  long r = ::syscall(SYS_mmap, addr, len, prot, flags, fd, 0L);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void*>(r);
}
void* sys_mremap(void* from, uint64_t len, int flags, void* to) {
  long r = ::syscall(SYS_mremap, from, len, len, flags, to);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void*>(r);
}
int sys_munmap(void* addr, uint64_t len) { return static_cast<int>(::syscall(SYS_munmap, addr, len)); }

bool tier_enabled() {
#if defined(__SANITIZE_ADDRESS__)
  // Moving whole pages would copy AddressSanitizer's redzones and shadowed
  // heap memory: ASan builds use the CMA tier only.
  return false;
#endif
  const char* e = std::getenv("SHMRDMA_MAPPED");
  return !(e && std::strcmp(e, "0") == 0);
}

// SHMRDMA_MAPPED=single: never use a userfaultfd (only single-threaded
// processes are moved, as before it), to test and measure that fallback.
bool uffd_allowed() {
  const char* e = std::getenv("SHMRDMA_MAPPED");
  return !(e && std::strcmp(e, "single") == 0);
}

bool single_threaded() {
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return false;
  int n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n == 1;
}

struct Mapping {
  uint64_t lo, hi, off, ino;
  char perms[5];
  bool anon;  // anonymous memory (no file), including the brk heap
  bool ours;  // one of our memfds
};

// Calls f(const Mapping&) for each line of /proc/self/maps in address order
// until it returns false. false when the file cannot be read.
template <typename F>
bool for_each_mapping(F&& f) {
  FILE* file = std::fopen("/proc/self/maps", "re");
  if (!file) return false;
  char line[512];
  while (std::fgets(line, sizeof line, file)) {
    Mapping m{};
    unsigned long lo = 0, hi = 0, inode = 0;
    unsigned long long off = 0;
    unsigned dmaj = 0, dmin = 0;
    int pos = 0;
    if (std::sscanf(line, "%lx-%lx %4s %llx %x:%x %lu %n", &lo, &hi, m.perms, &off, &dmaj, &dmin, &inode, &pos) < 7)
      continue;
    const char* path = line + pos;
    while (*path == ' ') ++path;
    m.lo = lo;
    m.hi = hi;
    m.off = off;
    m.ino = inode;
    m.anon = inode == 0 && (*path == '\n' || *path == '\0' || std::strncmp(path, "[heap]", 6) == 0);
    m.ours = std::strncmp(path, kMemfdPath, sizeof kMemfdPath - 1) == 0;
    if (!f(m)) break;
  }
  std::fclose(file);
  return true;
}

// Every byte of [s, e) satisfies ok(mapping).
template <typename P>
bool covered_by(uint64_t s, uint64_t e, P&& ok) {
  uint64_t covered = s;
  bool good = true;
  bool read = for_each_mapping([&](const Mapping& m) {
    if (m.hi <= covered) return true;
    if (m.lo >= e) return false;
    if (m.lo > covered || !ok(m)) {  // a hole, or memory of another kind
      good = false;
      return false;
    }
    covered = m.hi;
    return covered < e;
  });
  return read && good && covered >= e;
}

// A piece of [s, e) inside one mapping (mremap moves within one mapping).
struct Piece {
  uint64_t lo, hi;
};
constexpr size_t kMaxPieces = 16;

// [s, e) is private anonymous read-write memory, in at most kMaxPieces
// mappings (*pieces, *npieces), none of which holds the calling thread's
// stack (it could not run while its stack is frozen, see move_frozen).
bool private_anonymous(uint64_t s, uint64_t e, Piece* pieces, size_t* npieces) {
  const auto sp = reinterpret_cast<uint64_t>(__builtin_frame_address(0));
  size_t n = 0;
  bool ok = covered_by(s, e, [&](const Mapping& m) {
    if (!m.anon || std::strcmp(m.perms, "rw-p") != 0 || n == kMaxPieces || (sp >= m.lo && sp < m.hi)) return false;
    pieces[n++] = Piece{std::max(m.lo, s), std::min(m.hi, e)};
    return true;
  });
  *npieces = n;
  return ok;
}

// [s, e) is still region r's memfd, mapped read-write at its own offset.
bool backed_by(const Region& r, uint64_t s, uint64_t e) {
  return covered_by(s, e, [&](const Mapping& m) {
    return m.ours && m.ino == r.ino && m.lo - m.off == r.start && std::strcmp(m.perms, "rw-s") == 0;
  });
}

// Replaces the pages of [s, s + n) with private anonymous copies of them, in
// one mremap (the range is never unmapped), with protection prot.
bool privatize(uint64_t s, uint64_t n, int prot) {
  void* tmp = sys_mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
  if (tmp == MAP_FAILED) return false;
  std::memcpy(tmp, reinterpret_cast<void*>(s), n);
  if (prot != (PROT_READ | PROT_WRITE)) ::mprotect(tmp, n, prot);
  if (sys_mremap(tmp, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(s)) == MAP_FAILED) {
    sys_munmap(tmp, n);
    return false;
  }
  return true;
}

// A userfaultfd that also handles faults taken in the kernel (a system call
// of another thread reading or writing the range must wait, not fail with
// EFAULT as it would with UFFD_USER_MODE_ONLY): the userfaultfd() system call
// where vm.unprivileged_userfaultfd or CAP_SYS_PTRACE allows it, else
// /dev/userfaultfd where its permissions do. -1 when neither.
int open_userfaultfd(uint64_t features = 0) {
  int fd = static_cast<int>(::syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK));
  if (fd < 0 && errno == EPERM) {
    int dev = ::open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev >= 0) {
      fd = ::ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
      ::close(dev);
    }
  }
  if (fd < 0) return -1;
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = features;
  if (::ioctl(fd, UFFDIO_API, &api) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The move of a range that other threads may be using (share_region). The
// range is registered with a userfaultfd (missing pages), so once its pages
// are taken away every access to it waits in the kernel instead of seeing a
// fresh zero page. Then, on a helper thread (below):
//   1. mremap(MREMAP_DONTUNMAP) takes each piece's pages to `park`, in one
//      step per piece: the range stays mapped, now empty, and every access
//      to it (a store of another thread, a system call, a peer's CMA access)
//      blocks on the userfaultfd;
//   2. the bytes are copied from `park` into the memfd (through `view`);
//   3. the memfd is mapped over the range with MAP_FIXED, in one step;
//   4. UFFDIO_WAKE (and closing the userfaultfd) releases the waiting
//      threads: their faults retry and find the memfd's pages, holding every
//      byte as it was when the pages were taken.
// No store is lost (nobody can store into the range between 1 and 3) and
// every wait is bounded by the copy of the range (the helper waits for
// nothing). If a step fails, the parked pages go back where they were
// (mremap, or UFFDIO_COPY as the last resort) before the waiters are woken.
//
// Why a helper thread: the thread that moves must not touch the frozen range
// itself, or it waits for itself forever. The calling thread's stack is
// checked (private_anonymous), but its thread control block (where the stack
// protector's canary and errno live) can sit in the brk heap, and the heap is
// a range applications register. A fresh thread has its stack, TCB and TLS in
// its own new mapping, runs with every signal blocked (no handler of the
// application runs on it) and calls nothing that allocates. The provider is
// linked with -z now, so no lazy symbol binding (which touches the loader's
// heap data) happens in the window either.
struct Move {
  int uffd;
  int memfd;
  uint64_t s, n;
  uint8_t* park;  // n bytes reserved; piece i goes to park + (lo - s)
  uint8_t* view;  // the memfd, mapped read-write
  const Piece* pieces;
  size_t npieces;
  int err;  // 0 when the range is now the memfd
};

void* move_frozen(void* arg) {
  auto* m = static_cast<Move*>(arg);
  size_t parked = 0;
  for (; parked < m->npieces; ++parked) {
    const Piece& p = m->pieces[parked];
    void* to = m->park + (p.lo - m->s);
    if (sys_mremap(reinterpret_cast<void*>(p.lo), p.hi - p.lo, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to) ==
        MAP_FAILED) {
      m->err = errno;
      break;
    }
  }
  if (m->err == 0) {
    std::memcpy(m->view, m->park, m->n);
    void* at = sys_mmap(reinterpret_cast<void*>(m->s), m->n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, m->memfd);
    if (at == MAP_FAILED) m->err = errno;
  }
  if (m->err != 0) {
    // Put the parked pages back: the range is still the registered, empty
    // mapping (nobody could fill it), so no byte is lost either way.
    for (size_t i = 0; i < parked; ++i) {
      const Piece& p = m->pieces[i];
      void* from = m->park + (p.lo - m->s);
      if (sys_mremap(from, p.hi - p.lo, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(p.lo)) != MAP_FAILED)
        continue;
      uffdio_copy c{};
      c.dst = p.lo;
      c.src = reinterpret_cast<uint64_t>(from);
      c.len = p.hi - p.lo;
      c.mode = UFFDIO_COPY_MODE_DONTWAKE;
      if (::ioctl(m->uffd, UFFDIO_COPY, &c) != 0 && errno != EEXIST) {
        static constexpr char kMsg[] = "shmrdma: ibv_reg_mr: could not restore memory after a failed move\n";
        (void)!::write(2, kMsg, sizeof kMsg - 1);
      }
    }
  }
  uffdio_range all{m->s, m->n};
  (void)::ioctl(m->uffd, UFFDIO_WAKE, &all);
  return nullptr;
}

// The way back (release_region) in a process that may have other threads:
// the memfd's mapping is registered for missing and minor faults, one
// mremap(MREMAP_DONTUNMAP) takes its page table entries to `park` (the old
// mapping stays, still the memfd, and every access to it now waits: minor
// faults for pages in the memfd, missing faults for holes), the bytes are
// copied from `park` into private anonymous memory, which one mremap puts
// over the range, and the waiters are woken onto it. If a step fails the old
// mapping is still the memfd's, holding every byte: the waiters resume on it.
struct MoveBack {
  uint64_t s, n;
  uint8_t* park;  // n bytes reserved
  uint8_t* priv;  // n bytes of private anonymous memory
  int uffd;
  int err;
};

void* move_back_frozen(void* arg) {
  auto* m = static_cast<MoveBack*>(arg);
  if (sys_mremap(reinterpret_cast<void*>(m->s), m->n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, m->park) ==
      MAP_FAILED) {
    m->err = errno;
  } else {
    std::memcpy(m->priv, m->park, m->n);
    if (sys_mremap(m->priv, m->n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(m->s)) == MAP_FAILED)
      m->err = errno;
  }
  uffdio_range all{m->s, m->n};
  (void)::ioctl(m->uffd, UFFDIO_WAKE, &all);
  return nullptr;
}

// Runs fn(arg) on a helper thread with every signal blocked (see Move).
// false when the thread cannot be made (nothing was done).
bool run_helper(void* (*fn)(void*), void* arg) {
  sigset_t all, old;
  ::sigfillset(&all);
  if (::pthread_sigmask(SIG_BLOCK, &all, &old) != 0) return false;
  pthread_attr_t attr;
  pthread_t t;
  int rc = ::pthread_attr_init(&attr);
  if (rc == 0) {
    (void)::pthread_attr_setstacksize(&attr, 64 << 10);
    rc = ::pthread_create(&t, &attr, fn, arg);
    ::pthread_attr_destroy(&attr);
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (rc != 0) return false;
  ::pthread_join(t, nullptr);
  return true;
}

// release_region's move back with other threads about (MoveBack); false
// when it was not done (the range is then still the memfd's).
bool privatize_frozen(uint64_t s, uint64_t n) {
  if (!uffd_allowed()) return false;
  int uffd = open_userfaultfd(UFFD_FEATURE_MINOR_SHMEM);
  if (uffd < 0) return false;
  void* park = sys_mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1);
  void* priv = park == MAP_FAILED ? MAP_FAILED : sys_mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
  bool done = false;
  if (priv != MAP_FAILED) {
    uffdio_register reg{};
    reg.range.start = s;
    reg.range.len = n;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_MINOR;
    if (::ioctl(uffd, UFFDIO_REGISTER, &reg) == 0) {
      MoveBack m{s, n, static_cast<uint8_t*>(park), static_cast<uint8_t*>(priv), uffd, 0};
      done = run_helper(move_back_frozen, &m) && m.err == 0;
    }
  }
  ::close(uffd);  // unregisters the old mapping if it is still there
  if (park != MAP_FAILED) sys_munmap(park, n);
  if (priv != MAP_FAILED && !done) sys_munmap(priv, n);
  return done;
}

// The move of a single-threaded process (no userfaultfd needed: nobody else
// can touch the range): copy, then one mremap of the memfd over the range.
int move_alone(uint64_t s, uint64_t n, void* view) {
  std::memcpy(view, reinterpret_cast<void*>(s), n);
  void* moved = sys_mremap(view, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(s));
  return moved == MAP_FAILED ? errno : 0;
}

// fork(): the child gets private copies of every shared range (mapped.h).
// The copies are taken in the parent, before the fork (prepare), and the
// child only moves them into place: a copy taken in the child after fork()
// returned could pick up stores the parent's threads (or the parent itself,
// running on) make after the fork. If a snapshot cannot be made, the child
// copies that range itself (privatize), as a last resort.
struct Snapshot {
  uint64_t lo, hi;
  int prot;
  void* copy;  // MAP_FAILED: none, the child copies
};
std::vector<Snapshot>* g_snaps = nullptr;

void atfork_prepare() {
  g_mu.lock();
  if (!g_regions || g_regions->empty()) return;
  try {
    if (!g_snaps) g_snaps = new std::vector<Snapshot>();
    g_snaps->clear();
    for_each_mapping([&](const Mapping& m) {
      if (!m.ours) return true;
      for (const Region& r : *g_regions)
        if (r.ino == m.ino && m.perms[0] == 'r') {
          int prot = PROT_READ | (m.perms[1] == 'w' ? PROT_WRITE : 0) | (m.perms[2] == 'x' ? PROT_EXEC : 0);
          g_snaps->push_back({m.lo, m.hi, prot, MAP_FAILED});
          break;
        }
      return true;
    });
  } catch (...) {
    return;  // no list: the child finds the ranges itself
  }
  for (Snapshot& sn : *g_snaps) {
    const uint64_t n = sn.hi - sn.lo;
    void* c = sys_mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    if (c == MAP_FAILED) continue;
    std::memcpy(c, reinterpret_cast<void*>(sn.lo), n);
    if (sn.prot != (PROT_READ | PROT_WRITE)) ::mprotect(c, n, sn.prot);
    sn.copy = c;
  }
}

void atfork_parent() {
  if (g_snaps) {
    for (const Snapshot& sn : *g_snaps)
      if (sn.copy != MAP_FAILED) sys_munmap(sn.copy, sn.hi - sn.lo);
    g_snaps->clear();
  }
  g_mu.unlock();
}

void atfork_child() {
  if (g_regions && !g_regions->empty()) {
    std::vector<Snapshot> ranges;  // the child is single-threaded: allocation is safe
    if (g_snaps && !g_snaps->empty()) {
      ranges.swap(*g_snaps);
    } else {
      try {
        for_each_mapping([&](const Mapping& m) {
          if (!m.ours) return true;
          for (const Region& r : *g_regions)
            if (r.ino == m.ino && m.perms[0] == 'r') {
              int prot = PROT_READ | (m.perms[1] == 'w' ? PROT_WRITE : 0) | (m.perms[2] == 'x' ? PROT_EXEC : 0);
              ranges.push_back({m.lo, m.hi, prot, MAP_FAILED});
              break;
            }
          return true;
        });
      } catch (...) {
      }
    }
    for (const Snapshot& r : ranges) {
      const uint64_t n = r.hi - r.lo;
      // The parent's snapshot moves into place (one mremap, the range never
      // unmapped); without one, the child copies.
      bool ok = r.copy != MAP_FAILED
                    ? sys_mremap(r.copy, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(r.lo)) != MAP_FAILED
                    : false;
      if (!ok && r.copy != MAP_FAILED) sys_munmap(r.copy, n);
      if (!ok && !privatize(r.lo, n, r.prot)) {
        static constexpr char kMsg[] = "shmrdma: fork: could not give the child a private copy of registered memory\n";
        (void)!::write(2, kMsg, sizeof kMsg - 1);
      }
    }
    for (const Region& r : *g_regions)
      if (r.fd >= 0) ::close(r.fd);
    g_regions->clear();
  }
  g_mu.unlock();
}

}  // namespace

bool share_region(uint64_t addr, uint64_t len, SharedRegion* out, uint16_t* why) noexcept {
  uint16_t no_why = 0;
  if (!why) why = &no_why;
  *why = layout::kTierWhyDisabled;
  if (!tier_enabled() || len == 0) return false;
  const uint64_t ps = page_size();
  uint64_t s = addr & ~(ps - 1), e = (addr + len + ps - 1) & ~(ps - 1);
  *why = layout::kTierWhyResources;
  std::lock_guard lk(g_mu);
  try {
    if (!g_regions) g_regions = new std::vector<Region>();
  } catch (...) {
    return false;
  }
  if (!g_atfork) {
    if (::pthread_atfork(atfork_prepare, atfork_parent, atfork_child) != 0) return false;
    g_atfork = true;
  }
  // Another MR on memory that is already shared: the same region. A region
  // matches only while its memfd still backs the range (the application may
  // have unmapped it and got new memory at the same address).
  for (Region& r : *g_regions)
    if (r.fd >= 0 && s >= r.start && e <= r.start + r.len && backed_by(r, s, e)) {
      r.refs += 1;
      *out = SharedRegion{r.fd, r.start, r.len, r.ino};
      *why = layout::kTierWhyNone;
      return true;
    }
  // Forget ranges left shared whose mappings are gone.
  std::erase_if(*g_regions, [](const Region& r) {
    if (r.fd >= 0) return false;
    bool mapped = false;
    for_each_mapping([&](const Mapping& m) {
      mapped = m.ours && m.ino == r.ino;
      return !mapped;
    });
    return !mapped;
  });
  if (g_regions->size() >= kMaxRegions) return false;
  Piece pieces[kMaxPieces];
  size_t npieces = 0;
  if (!private_anonymous(s, e, pieces, &npieces)) {
    *why = layout::kTierWhyMemory;
    return false;
  }
  // Other threads may store into the range while it moves: with a
  // userfaultfd they wait instead (Move). Without one, only a process that
  // has no other thread is moved.
  int uffd = uffd_allowed() ? open_userfaultfd() : -1;
  if (uffd < 0 && !single_threaded()) {
    *why = layout::kTierWhyThreads;
    return false;
  }
  const uint64_t n = e - s;
  // Sealed against shrinking once it has its size (PeerMappings::get maps
  // only such a file): a peer's view of it can then never find its pages
  // gone, where a load or store would raise SIGBUS in the peer.
  int fd = ::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  struct stat st{};
  void* view = MAP_FAILED;
  void* park = MAP_FAILED;
  if (fd >= 0 && ::fstat(fd, &st) == 0 && ::ftruncate(fd, static_cast<off_t>(n)) == 0 &&
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0)
    view = sys_mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd);
  if (view != MAP_FAILED && uffd >= 0) park = sys_mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1);
  Region r{fd, s, n, static_cast<uint64_t>(st.st_ino), 1};
  bool prepared = view != MAP_FAILED;
  try {
    if (prepared) g_regions->reserve(g_regions->size() + 1);  // nothing can fail after the move
  } catch (...) {
    prepared = false;
  }
  bool ready = prepared && (uffd < 0 || park != MAP_FAILED);
  if (ready && uffd >= 0) {
    uffdio_register reg{};
    reg.range.start = s;
    reg.range.len = n;
    reg.mode = UFFDIO_REGISTER_MODE_MISSING;
    if (::ioctl(uffd, UFFDIO_REGISTER, &reg) != 0) {
      *why = layout::kTierWhyKernel;
      ready = false;
    }
  }
  int err = ready ? 0 : -1;
  bool moved_frozen = false;
  if (ready && uffd >= 0) {
    (void)::syscall(-1);  // binds the symbol before the window (see Move)
    Move m{uffd, fd, s, n, static_cast<uint8_t*>(park), static_cast<uint8_t*>(view), pieces, npieces, 0};
    err = run_helper(move_frozen, &m) ? m.err : -1;
    if (err) *why = layout::kTierWhyKernel;
    moved_frozen = err == 0;
  }
  if (err != 0 && prepared && uffd >= 0 && single_threaded()) {
    // A kernel that refused a step of the frozen move (MREMAP_DONTUNMAP came
    // in 5.7; the range is as it was): the plain move, alone.
    ::close(uffd);
    uffd = -1;
    err = 0;
  }
  if (prepared && uffd < 0 && err == 0) {
    err = move_alone(s, n, view);  // the view becomes the range
    view = err ? view : MAP_FAILED;
    if (err) *why = layout::kTierWhyKernel;
  }
  if (uffd >= 0) ::close(uffd);  // also unregisters what is left registered
  if (park != MAP_FAILED) sys_munmap(park, n);
  if (view != MAP_FAILED) sys_munmap(view, n);
  if (err) {
    if (fd >= 0) ::close(fd);
    return false;
  }
  // The frozen move mapped the memfd over the range afresh (move_alone's
  // mremap keeps the view's page table): fill it, as for a peer's view
  // (kPopulatePeerMax), so that the application's first stores into its
  // registered memory take no fault per page (~1.5-2 µs each here). Read
  // population is enough and 7x cheaper than MADV_POPULATE_WRITE: a read
  // fault maps up to 16 pages already in the memfd (fault-around), and a
  // shmem page is mapped writable either way (no write notification). 1 MiB
  // in a process with two threads: ibv_reg_mr ~0.1 ms longer, its first
  // memset 0.38 ms -> 0.013 ms. Other threads may touch the range
  // meanwhile; a kernel before 5.14 refuses the advice, and the pages fault
  // in as before.
  if (moved_frozen && n <= kPopulatePeerMax && ::madvise(reinterpret_cast<void*>(s), n, MADV_POPULATE_READ) == 0)
    touch_pages(reinterpret_cast<void*>(s), n);
  g_regions->push_back(r);
  *out = SharedRegion{fd, s, n, r.ino};
  *why = layout::kTierWhyNone;
  return true;
}

void release_region(const SharedRegion& sr) noexcept {
  std::lock_guard lk(g_mu);
  if (!g_regions) return;
  auto it = std::find_if(g_regions->begin(), g_regions->end(), [&](const Region& r) {
    return r.fd == sr.memfd && r.fd >= 0 && r.start == sr.start && r.ino == sr.id && r.refs > 0;
  });
  if (it == g_regions->end() || --it->refs > 0) return;
  // The last MR: the range goes back to private anonymous memory (with the
  // frozen move when other threads may be writing it, MoveBack), unless the
  // application changed the mapping or the kernel refuses; then it stays
  // shared without the fd.
  ::close(it->fd);
  it->fd = -1;
  if (!backed_by(*it, it->start, it->start + it->len)) return;
  if (privatize_frozen(it->start, it->len) ||
      (single_threaded() && privatize(it->start, it->len, PROT_READ | PROT_WRITE)))
    g_regions->erase(it);
}

PeerMapping::~PeerMapping() {
  if (base) ::munmap(base, len);
}

std::shared_ptr<PeerMapping> PeerMappings::get(pid_t owner, int memfd, uint64_t id, uint64_t start,
                                               uint64_t len) noexcept {
  if (memfd < 0 || len == 0 || len > (uint64_t{1} << 40) || start % page_size() || len % page_size()) return nullptr;
  try {
    std::lock_guard lk(mu_);
    Key k{id, memfd, start, len};
    auto it = maps_.find(k);
    if (it != maps_.end()) return it->second;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/fd/%d", static_cast<int>(owner), memfd);
    int fd = ::open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st{};
    // The file must be the region's (fd numbers are reused) and really be that
    // big, or touching the mapping would fault; and sealed against shrinking
    // (share_region seals its memfds), else its owner could truncate it under
    // our view, and our next access through it would raise SIGBUS here.
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_ino) != id ||
        static_cast<uint64_t>(st.st_size) < len || seals < 0 || !(seals & F_SEAL_SHRINK)) {
      ::close(fd);
      return nullptr;
    }
    const bool populate = len <= kPopulatePeerMax;  // and translate (touch_pages)
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return nullptr;
    if (populate) touch_pages(p, len);
    auto m = std::make_shared<PeerMapping>();
    m->base = static_cast<uint8_t*>(p);
    m->len = len;
    m->start = start;
    if (maps_.size() >= kMaxPeerMappings) maps_.clear();  // bounded: old views go once nobody holds them
    maps_[k] = m;
    return m;
  } catch (...) {
    return nullptr;
  }
}

}  // namespace shmrdma
