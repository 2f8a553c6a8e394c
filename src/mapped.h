// The mapped data-mover tier: registered memory that peers map into their
// own address space, so a remote WRITE, READ or atomic is a memcpy or a CPU
// atomic instead of a system call.
//
// Owner side: at registration a private, anonymous, read-write range is
// moved into a memfd in place (the bytes are copied into the memfd and the
// memfd is mapped over the same addresses: the application sees the same
// memory at the same address). While it moves, other threads that touch the
// range wait on a userfaultfd (mapped.cc, Move), so no store of theirs is
// lost; where userfaultfd is not permitted only a single-threaded process is
// moved.
// Several MRs on one range share its region (reference-counted). When the
// last MR on a region goes, the range is moved back into private anonymous
// memory (when the process is single-threaded; else the
// memfd is closed and the mapping stays shared until the application unmaps
// it). fork() keeps the semantics of private memory: a pthread_atfork child
// handler gives the child a private copy of every shared range (the parent
// keeps the registered pages, as with pinned pages on an HCA), and closes
// the memfds in the child. SHMRDMA_MAPPED=0 turns the tier off.
//
// Peer side: the memfd is opened through /proc/<owner>/fd/<n> (the same
// permission as process_vm_writev) and mapped once per region.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace shmrdma {

struct SharedRegion {
  int memfd = -1;
  uint64_t start = 0;  // page-aligned address in the owner
  uint64_t len = 0;    // page multiple
  uint64_t id = 0;     // the memfd's inode number: peers check it when they open the fd
};

// Makes [addr, addr + len) part of a shared region, creating one when the
// memory qualifies (see above). Returns false when it does not, with the
// reason in *why (layout::TierWhy): the MR then uses the CMA tier.
// Process-wide; thread-safe.
bool share_region(uint64_t addr, uint64_t len, SharedRegion* out, uint16_t* why = nullptr) noexcept;

// Drops one reference taken by share_region (see above for the last one).
void release_region(const SharedRegion& r) noexcept;

// A peer's region up to this size is mapped with its page table filled
// (MAP_POPULATE; our own range too after a frozen move, share_region)
// rather than one fault per page at first touch: a 1 MiB view
// takes ~60 µs so, against ~300 µs of 256 write faults (each a fault on a
// shared mapping: no fault-around for writes), and those faults would come in
// the first WRITEs or SENDs into it, as hardware's pinned MRs never do. The
// regions hold every page already (share_region copies the whole range in),
// so this allocates nothing but page tables. Larger ones fault as they are
// touched, lest the first post into a huge MR stall for the whole of it.
inline constexpr uint64_t kPopulatePeerMax = uint64_t{64} << 20;

// A peer's view of one of its regions.
struct PeerMapping {
  uint8_t* base = nullptr;
  uint64_t len = 0;
  uint64_t start = 0;  // the region's start in the owner's address space
  ~PeerMapping();
};

class PeerMappings {
 public:
  // The local view of the owner's region (memfd number and inode in the
  // owner, region start and length from the owner's untrusted MrEntry). nullptr
  // when it cannot be mapped.
  std::shared_ptr<PeerMapping> get(pid_t owner, int memfd, uint64_t id, uint64_t start, uint64_t len) noexcept;

 private:
  struct Key {
    uint64_t id;
    int memfd;
    uint64_t start, len;
    bool operator<(const Key& o) const {
      return std::tie(id, memfd, start, len) < std::tie(o.id, o.memfd, o.start, o.len);
    }
  };
  std::mutex mu_;
  std::map<Key, std::shared_ptr<PeerMapping>> maps_;
};

}  // namespace shmrdma
