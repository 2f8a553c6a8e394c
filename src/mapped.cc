#include "mapped.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace shmrdma {

namespace {

constexpr uint64_t kMaxRegions = 4096;  // fds we keep for shared regions, process-wide
constexpr uint64_t kMaxPeerMappings = 1024;

std::mutex g_mu;
std::vector<SharedRegion>* g_regions = nullptr;  // leaked on purpose: regions outlive contexts

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

// Every byte of [s, e) is in private anonymous read-write mappings.
bool private_anonymous(uint64_t s, uint64_t e) {
  FILE* f = std::fopen("/proc/self/maps", "re");
  if (!f) return false;
  char line[512];
  uint64_t covered = s;
  bool ok = true;
  while (ok && covered < e && std::fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0;
    char perms[5] = {};
    unsigned long long off = 0;
    unsigned dmaj = 0, dmin = 0;
    unsigned long inode = 0;
    int pos = 0;
    if (std::sscanf(line, "%lx-%lx %4s %llx %x:%x %lu %n", &lo, &hi, perms, &off, &dmaj, &dmin, &inode, &pos) < 7)
      continue;
    if (hi <= covered || lo >= e) continue;
    if (lo > covered) {  // a hole
      ok = false;
      break;
    }
    const char* path = line + pos;
    while (*path == ' ') ++path;
    bool anon = inode == 0 && (*path == '\n' || *path == '\0' || std::strncmp(path, "[heap]", 6) == 0);
    if (!anon || std::strcmp(perms, "rw-p") != 0) ok = false;
    covered = hi;
  }
  std::fclose(f);
  return ok && covered >= e;
}

}  // namespace

bool share_region(uint64_t addr, uint64_t len, SharedRegion* out) noexcept {
  if (!tier_enabled() || len == 0) return false;
  const uint64_t ps = page_size();
  uint64_t s = addr & ~(ps - 1), e = (addr + len + ps - 1) & ~(ps - 1);
  std::lock_guard lk(g_mu);
  try {
    if (!g_regions) g_regions = new std::vector<SharedRegion>();
    // No reuse of earlier regions: the application may have unmapped one and
    // got new memory at the same address, and a stale match would send
    // peers' writes into the old memfd. A range that is already shared is
    // not private anonymous memory any more and takes the CMA tier below.
    if (g_regions->size() >= kMaxRegions) return false;
  } catch (...) {
    return false;
  }
  // Another thread could write the range between the copy and the remap and
  // lose its store: only a single-threaded process is moved.
  if (!single_threaded() || !private_anonymous(s, e)) return false;
  int fd = ::memfd_create("shmrdma-mr", MFD_CLOEXEC);
  if (fd < 0) return false;
  uint64_t n = e - s;
  void* tmp = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(n)) == 0)
    tmp = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (tmp == MAP_FAILED) {
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
  SharedRegion r{fd, s, n};
  try {
    g_regions->push_back(r);
  } catch (...) {
    // Keep the fd open anyway: the region stays valid, just not reusable.
  }
  *out = r;
  return true;
}

PeerMapping::~PeerMapping() {
  if (base) ::munmap(base, len);
}

std::shared_ptr<PeerMapping> PeerMappings::get(pid_t owner, int memfd, uint64_t start, uint64_t len) noexcept {
  if (memfd < 0 || len == 0 || len > (uint64_t{1} << 40) || start % page_size() || len % page_size()) return nullptr;
  try {
    std::lock_guard lk(mu_);
    Key k{memfd, start, len};
    auto it = maps_.find(k);
    if (it != maps_.end()) return it->second;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/fd/%d", static_cast<int>(owner), memfd);
    int fd = ::open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st{};
    // The file must really be that big, or touching the mapping would fault.
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < len) {
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
