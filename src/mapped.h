// The mapped data-mover tier: registered memory that peers map into their
// own address space, so a remote WRITE, READ or atomic is a memcpy or a CPU
// atomic instead of a system call.
//
// Owner side: at registration a private, anonymous, read-write range of a
// single-threaded process is moved into a memfd in place (the bytes are
// copied into the memfd and the memfd is mremap()ed over the same
// addresses: the application sees the same memory at the same address).
// From then on the pages are shared: a later fork() shares them with the
// child instead of copying them. SHMRDMA_MAPPED=0 turns the tier off.
//
// Peer side: the memfd is opened through /proc/<owner>/fd/<n> (the same
// permission as process_vm_writev) and mapped once per region.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace shmrdma {

struct SharedRegion {
  int memfd = -1;
  uint64_t start = 0;  // page-aligned address in the owner
  uint64_t len = 0;    // page multiple
};

// Makes [addr, addr + len) part of a shared region, creating one when the
// memory qualifies (see above). Returns false when it does not: the MR then
// uses the CMA tier. Process-wide; thread-safe.
bool share_region(uint64_t addr, uint64_t len, SharedRegion* out) noexcept;

// A peer's view of one of its regions.
struct PeerMapping {
  uint8_t* base = nullptr;
  uint64_t len = 0;
  uint64_t start = 0;  // the region's start in the owner's address space
  ~PeerMapping();
};

class PeerMappings {
 public:
  // The local view of the owner's region (memfd number in the owner,
  // region start and length from the owner's untrusted MrEntry). nullptr
  // when it cannot be mapped.
  std::shared_ptr<PeerMapping> get(pid_t owner, int memfd, uint64_t start, uint64_t len) noexcept;

 private:
  struct Key {
    int memfd;
    uint64_t start, len;
    bool operator<(const Key& o) const {
      return memfd != o.memfd ? memfd < o.memfd : start != o.start ? start < o.start : len < o.len;
    }
  };
  std::mutex mu_;
  std::map<Key, std::shared_ptr<PeerMapping>> maps_;
};

}  // namespace shmrdma
