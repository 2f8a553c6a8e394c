#include "mapped.h"

#include <dirent.h>
#include <pthread.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
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

bool tier_enabled() {
#if defined(__SANITIZE_ADDRESS__)
  // Moving whole pages would copy AddressSanitizer's redzones and shadowed
  // heap memory: ASan builds use the CMA tier only.
  return false;
#endif
  const char* e = std::getenv("SHMRDMA_MAPPED");
  return !(e && std::strcmp(e, "0") == 0);
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

bool private_anonymous(uint64_t s, uint64_t e) {
  return covered_by(s, e, [](const Mapping& m) { return m.anon && std::strcmp(m.perms, "rw-p") == 0; });
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
  void* tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (tmp == MAP_FAILED) return false;
  std::memcpy(tmp, reinterpret_cast<void*>(s), n);
  if (prot != (PROT_READ | PROT_WRITE)) ::mprotect(tmp, n, prot);
  if (::mremap(tmp, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(s)) == MAP_FAILED) {
    ::munmap(tmp, n);
    return false;
  }
  return true;
}

// fork(): the child gets private copies of every shared range (mapped.h).
void atfork_prepare() { g_mu.lock(); }
void atfork_parent() { g_mu.unlock(); }
void atfork_child() {
  if (g_regions && !g_regions->empty()) {
    struct Range {
      uint64_t lo, hi;
      int prot;
    };
    std::vector<Range> ranges;  // the child is single-threaded: allocation is safe
    try {
      for_each_mapping([&](const Mapping& m) {
        if (!m.ours) return true;
        for (const Region& r : *g_regions)
          if (r.ino == m.ino && m.perms[0] == 'r') {
            int prot = PROT_READ | (m.perms[1] == 'w' ? PROT_WRITE : 0) | (m.perms[2] == 'x' ? PROT_EXEC : 0);
            ranges.push_back({m.lo, m.hi, prot});
            break;
          }
        return true;
      });
    } catch (...) {
    }
    for (const Range& r : ranges)
      if (!privatize(r.lo, r.hi - r.lo, r.prot)) {
        static constexpr char kMsg[] = "shmrdma: fork: could not give the child a private copy of registered memory\n";
        (void)!::write(2, kMsg, sizeof kMsg - 1);
      }
    for (const Region& r : *g_regions)
      if (r.fd >= 0) ::close(r.fd);
    g_regions->clear();
  }
  g_mu.unlock();
}

}  // namespace

bool share_region(uint64_t addr, uint64_t len, SharedRegion* out) noexcept {
  if (!tier_enabled() || len == 0) return false;
  const uint64_t ps = page_size();
  uint64_t s = addr & ~(ps - 1), e = (addr + len + ps - 1) & ~(ps - 1);
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
  // Another thread could write the range between the copy and the remap and
  // lose its store: only a single-threaded process is moved.
  if (!single_threaded() || !private_anonymous(s, e)) return false;
  int fd = ::memfd_create(kMemfdName, MFD_CLOEXEC);
  if (fd < 0) return false;
  uint64_t n = e - s;
  struct stat st{};
  void* tmp = MAP_FAILED;
  if (::fstat(fd, &st) == 0 && ::ftruncate(fd, static_cast<off_t>(n)) == 0)
    tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (tmp == MAP_FAILED) {
    ::close(fd);
    return false;
  }
  Region r{fd, s, n, static_cast<uint64_t>(st.st_ino), 1};
  try {
    g_regions->reserve(g_regions->size() + 1);  // nothing can fail after the move
  } catch (...) {
    ::munmap(tmp, n);
    ::close(fd);
    return false;
  }
  std::memcpy(tmp, reinterpret_cast<void*>(s), n);
  // One system call replaces the private pages with the shared ones: the
  // range is never unmapped in between.
  void* moved = ::mremap(tmp, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(s));
  if (moved == MAP_FAILED) {
    ::munmap(tmp, n);
    ::close(fd);
    return false;
  }
  g_regions->push_back(r);
  *out = SharedRegion{fd, s, n, r.ino};
  return true;
}

void release_region(const SharedRegion& sr) noexcept {
  std::lock_guard lk(g_mu);
  if (!g_regions) return;
  auto it = std::find_if(g_regions->begin(), g_regions->end(), [&](const Region& r) {
    return r.fd == sr.memfd && r.fd >= 0 && r.start == sr.start && r.ino == sr.id && r.refs > 0;
  });
  if (it == g_regions->end() || --it->refs > 0) return;
  // The last MR: the range goes back to private anonymous memory, unless
  // another thread could be writing it (its store could be lost) or the
  // application changed the mapping; then it stays shared without the fd.
  ::close(it->fd);
  it->fd = -1;
  if (single_threaded() && backed_by(*it, it->start, it->start + it->len) &&
      privatize(it->start, it->len, PROT_READ | PROT_WRITE))
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
    // big, or touching the mapping would fault.
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_ino) != id ||
        static_cast<uint64_t>(st.st_size) < len) {
      ::close(fd);
      return nullptr;
    }
    void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return nullptr;
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
