// Asynchronous events. Every context has a FIFO next to its segment
// (<segment>.async); its read end is the context's async_fd, from which
// ibv_get_async_event reads one 16-byte descriptor per event. The owner and
// peers (a peer that moves our QP to the error state, overruns our CQ, ...)
// write descriptors into it.
//
// Trust: libibverbs turns the descriptor's element into an object pointer.
// Nobody writes pointers: the element is a token (kind, table index,
// generation) that the owner's async_event op translates through its private
// tables, so a corrupt descriptor can never become a wild pointer.
#pragma once

#include <cstdint>
#include <string>

namespace shmrdma {

enum class AsyncKind : uint8_t { kPort = 0, kQp = 1, kCq = 2, kSrq = 3, kWq = 4 };

inline constexpr uint64_t async_token(AsyncKind kind, uint32_t index, uint32_t generation) {
  return (uint64_t{static_cast<uint8_t>(kind)} << 56) | (uint64_t{generation & 0xffffff} << 32) | index;
}
inline constexpr AsyncKind token_kind(uint64_t t) { return static_cast<AsyncKind>(t >> 56); }
inline constexpr uint32_t token_generation(uint64_t t) { return static_cast<uint32_t>(t >> 32) & 0xffffff; }
inline constexpr uint32_t token_index(uint64_t t) { return static_cast<uint32_t>(t); }

// The kernel's struct ib_uverbs_async_event_desc.
struct AsyncDesc {
  uint64_t element;
  uint32_t event_type;
  uint32_t reserved;
};
static_assert(sizeof(AsyncDesc) == 16);

// Creates the FIFO (mode 0600, must not exist) and opens its blocking read
// end and a non-blocking write end. Returns 0 or errno.
int create_async_fifo(const std::string& path, int* read_fd, int* write_fd) noexcept;
// Opens another context's FIFO for writing (non-blocking). -1 on failure.
int open_async_fifo_writer(const std::string& path) noexcept;
// Writes one event; never blocks (a full FIFO drops it). True when written.
bool write_async_event(int fd, uint32_t event_type, uint64_t element) noexcept;

}  // namespace shmrdma
