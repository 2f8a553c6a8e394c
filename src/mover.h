// Data movers: how bytes get from one process's memory into another's.
// Today every remote transfer is one process_vm_writev/readv call (CMA), or
// plain memcpy when both sides live in this process; the mapped tier (peers
// mapping each other's registered memory) comes with the performance work.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

namespace shmrdma {

struct IoVec {
  void* base;
  size_t len;
};

// Copies the bytes of `local` into `remote` (in process pid). The remote
// side is written in order and, when last_byte_last, its final byte is
// written by a separate, later store so a peer spinning on it sees every
// other byte first. Returns 0, or the errno of the failure (ESRCH: the
// process is gone; EFAULT: an address is not mapped).
int move_out(pid_t pid, bool same_process, const IoVec* local, size_t nlocal, const IoVec* remote, size_t nremote,
             bool last_byte_last) noexcept;

// Copies the bytes of `remote` (in process pid) into `local`.
int move_in(pid_t pid, bool same_process, const IoVec* local, size_t nlocal, const IoVec* remote,
            size_t nremote) noexcept;

}  // namespace shmrdma
