// Process identity: a pid alone is reused by the kernel, so a process is
// identified by its pid and its start time (/proc/<pid>/stat field 22).
#pragma once

#include <sys/types.h>

#include <cstdint>

namespace shmrdma {

// Start time of `pid` in clock ticks since boot, or 0 when it does not exist.
uint64_t process_start_time(pid_t pid) noexcept;

// True when a process with this pid and start time still runs (zombies count
// as dead: they will never touch shared memory again).
bool process_alive(pid_t pid, uint64_t start_time) noexcept;

struct ProcessId {
  pid_t pid;
  uint64_t start_time;
};

// This process, cached; refreshed after fork.
ProcessId self_process() noexcept;

}  // namespace shmrdma
