// Completion channels. A channel is a FIFO next to its context's segment
// (<segment>.chan<N>, N < kMaxChannels); its read end is the application's
// ibv_comp_channel fd. Producers of completions (the owner and peers) write
// 8-byte tokens into it:
//
//   event     a CQ bound to this channel was armed and got a completion:
//             kind kChanEvent, the CQ's table index and generation;
//   progress  a receiver posted a receive that an initiator of this context
//             was waiting for (RNR): kind kChanProgress; the reader runs the
//             context's progress (the waiting send executes, its completion
//             may fire a real event) and goes back to waiting.
//
// Trust: tokens are never pointers. The owner translates an event token
// through its private tables (index in range, CQ live, same generation,
// bound to the channel it was read from); anything else is dropped.
#pragma once

#include <cstdint>
#include <string>

namespace shmrdma {

inline constexpr uint32_t kMaxChannels = 1024;  // per context
inline constexpr const char* kChannelSuffix = ".chan";

enum class ChanKind : uint8_t { kEvent = 1, kProgress = 2 };

inline constexpr uint64_t chan_token(ChanKind kind, uint32_t index, uint32_t generation) {
  return (uint64_t{static_cast<uint8_t>(kind)} << 56) | (uint64_t{generation & 0xffffff} << 32) | index;
}
inline constexpr ChanKind chan_token_kind(uint64_t t) { return static_cast<ChanKind>(t >> 56); }
inline constexpr uint32_t chan_token_generation(uint64_t t) { return static_cast<uint32_t>(t >> 32) & 0xffffff; }
inline constexpr uint32_t chan_token_index(uint64_t t) { return static_cast<uint32_t>(t); }

// The value a CqEntry stores in `channel`: the channel number and the low 16
// bits of its generation, so a peer's cached FIFO of an older channel with
// the same number is recognised as stale.
inline constexpr uint32_t chan_value(uint32_t number, uint32_t generation) {
  return ((generation & 0xffff) << 16) | (number & 0xffff);
}
inline constexpr uint32_t chan_number(uint32_t value) { return value & 0xffff; }

inline std::string channel_path(const std::string& segment_path, uint32_t number) {
  return segment_path + kChannelSuffix + std::to_string(number);
}

// Opens another context's channel FIFO for writing tokens: O_RDWR (so a
// write never raises SIGPIPE once the owner closed its end: the bytes go to
// a pipe nobody reads), O_NONBLOCK (a full FIFO drops the token, never
// blocks us), O_NOFOLLOW; must be a FIFO of our uid. -1 on failure.
int open_channel_writer(const std::string& path) noexcept;
// Writes one token without blocking. True when written.
bool write_channel_token(int fd, uint64_t token) noexcept;

}  // namespace shmrdma
