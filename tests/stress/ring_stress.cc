// SPDX-License-Identifier: MIT
//
// Multi-PROCESS stress test for src/ring.h. The ring, a "seen" bitmap and a
// few counters live in one MAP_SHARED|MAP_ANONYMOUS mapping; producer and
// consumer processes are fork()ed children that attach their own private
// Ring view to it, exactly like peers mapping a queue segment.
//
// Every item carries (producer id, sequence number, variable-length data,
// checksum). Consumers copy each item out of shared memory once, validate the
// private copy, and set the item's bit in the shared bitmap with fetch_or: a
// bit that was already set is a duplicate; a bit never set at the end is a
// lost item. Children report through their exit code; the parent never
// waits without a deadline and kills everything on timeout.

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ring.h"

namespace shmrdma {
namespace {

using Clock = std::chrono::steady_clock;

// Child exit codes. Distinct values so a failure says what went wrong.
enum ExitCode : int {
  kExitOk = 0,
  kExitTimeout = 2,    // own deadline passed
  kExitChecksum = 3,   // item failed validation
  kExitDuplicate = 4,  // item consumed twice
  kExitBadId = 5,      // producer id / sequence out of range
  kExitOrder = 6,      // a producer's items seen out of order
  kExitAborted = 7,    // stopped because another child failed
  kExitAttach = 8,     // Ring::attach refused the geometry
  kExitBadStatus = 9,  // ring returned a status that cannot happen here
};

const char* exit_name(int code) {
  switch (code) {
    case kExitOk:
      return "ok";
    case kExitTimeout:
      return "timeout";
    case kExitChecksum:
      return "checksum mismatch";
    case kExitDuplicate:
      return "duplicate item";
    case kExitBadId:
      return "item id out of range";
    case kExitOrder:
      return "per-producer order violated";
    case kExitAborted:
      return "aborted (another child failed)";
    case kExitAttach:
      return "attach failed";
    case kExitBadStatus:
      return "unexpected ring status";
    default:
      return "unknown";
  }
}

// Children give up well before the parent does, so that a stuck run is
// reported by the children themselves (with a meaningful exit code) and the
// parent's kill is only the last resort.
constexpr auto kChildDeadline = std::chrono::seconds(20);
constexpr auto kParentDeadline = std::chrono::seconds(30);

enum class Side { multi, single };

struct Config {
  int producers;
  int consumers;
  uint32_t items_per_producer;
  Side producer_side;
  Side consumer_side;
  uint32_t capacity;
  uint32_t stride;
};

// Shared control block at the start of the mapping. Counters that are hit by
// different processes sit on separate cache lines.
struct Control {
  alignas(kRingCacheLine) std::atomic<uint32_t> start;
  alignas(kRingCacheLine) std::atomic<uint32_t> abort;
  alignas(kRingCacheLine) std::atomic<uint64_t> consumed;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the cross-process bitmap and counters need lock-free atomics");

// --------------------------------------------------------------- items

struct ItemHeader {
  uint32_t producer;
  uint32_t seq;
  uint32_t len;  // bytes of data following the header
  uint32_t reserved;
  uint64_t checksum;
};

uint64_t fnv1a(const void* p, std::size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

void make_item(std::byte* out, std::size_t payload, uint32_t producer,
               uint32_t seq) {
  ItemHeader h{producer, seq, 0, 0, 0};
  const uint64_t m = mix((uint64_t{producer} << 32) | seq);
  h.len = static_cast<uint32_t>(m % (payload - sizeof h + 1));
  for (uint32_t i = 0; i < h.len; ++i)
    out[sizeof h + i] = static_cast<std::byte>(mix(m ^ i));
  h.checksum = fnv1a(&h, offsetof(ItemHeader, checksum), 0xcbf29ce484222325ull);
  h.checksum = fnv1a(out + sizeof h, h.len, h.checksum);
  std::memcpy(out, &h, sizeof h);
}

bool check_item(const std::byte* in, std::size_t payload, ItemHeader& h) {
  std::memcpy(&h, in, sizeof h);
  if (h.len > payload - sizeof h) return false;
  uint64_t c = fnv1a(&h, offsetof(ItemHeader, checksum), 0xcbf29ce484222325ull);
  c = fnv1a(in + sizeof h, h.len, c);
  return c == h.checksum;
}

// --------------------------------------------------------------- mapping

// Layout of the one shared mapping: [Control][bitmap words][RingShared+slots]
struct SharedArea {
  void* base = MAP_FAILED;
  std::size_t bytes = 0;
  Control* control = nullptr;
  std::atomic<uint64_t>* bitmap = nullptr;
  std::size_t bitmap_words = 0;
  RingShared* ring = nullptr;

  SharedArea() = default;
  SharedArea(const SharedArea&) = delete;
  SharedArea& operator=(const SharedArea&) = delete;
  ~SharedArea() {
    if (base != MAP_FAILED) munmap(base, bytes);
  }
};

std::size_t align_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

bool map_area(SharedArea& a, const Config& cfg) {
  const uint64_t total = uint64_t{cfg.items_per_producer} * cfg.producers;
  a.bitmap_words = static_cast<std::size_t>((total + 63) / 64);
  const std::size_t bitmap_off = align_up(sizeof(Control), kRingCacheLine);
  const std::size_t ring_off =
      align_up(bitmap_off + a.bitmap_words * sizeof(std::atomic<uint64_t>),
               kRingCacheLine);
  a.bytes = ring_off + Ring::bytes_for(cfg.capacity, cfg.stride);
  a.base = mmap(nullptr, a.bytes, PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (a.base == MAP_FAILED) return false;
  auto* b = static_cast<std::byte*>(a.base);
  // Fresh anonymous memory is zeroed; construct the atomics explicitly anyway
  // so their lifetimes formally begin before the children use them.
  a.control = std::construct_at(reinterpret_cast<Control*>(b));
  a.bitmap = reinterpret_cast<std::atomic<uint64_t>*>(b + bitmap_off);
  for (std::size_t i = 0; i < a.bitmap_words; ++i)
    std::construct_at(a.bitmap + i, uint64_t{0});
  a.ring = reinterpret_cast<RingShared*>(b + ring_off);
  return true;
}

// --------------------------------------------------------------- children

bool past(Clock::time_point deadline) { return Clock::now() > deadline; }

// Waits for the parent's go signal; false on deadline.
bool wait_start(const Control& c, Clock::time_point deadline) {
  // Acquire pairs with the parent's release store of `start` (the ring and
  // bitmap were also set up before fork, which already orders them).
  while (c.start.load(std::memory_order_acquire) == 0) {
    if (past(deadline)) return false;
    sched_yield();
  }
  return true;
}

int fail(Control& c, int code) {
  // Relaxed: only a hint for the other children to stop early.
  c.abort.store(1, std::memory_order_relaxed);
  return code;
}

int producer_main(SharedArea& a, const Config& cfg, uint32_t id) {
  const auto deadline = Clock::now() + kChildDeadline;
  auto ring =
      Ring::attach(a.ring, Ring::slots_after(a.ring), cfg.capacity, cfg.stride);
  if (!ring) return fail(*a.control, kExitAttach);
  if (!wait_start(*a.control, deadline)) return fail(*a.control, kExitTimeout);
  const std::size_t payload = ring->payload_size();
  std::vector<std::byte> tmp(payload);

  for (uint32_t seq = 0; seq < cfg.items_per_producer;) {
    if (a.control->abort.load(std::memory_order_relaxed) != 0)
      return kExitAborted;
    if (past(deadline)) return fail(*a.control, kExitTimeout);
    // Alternate between the copying and the in-place interface (the
    // single-producer fast path only has the in-place one).
    const bool copy = cfg.producer_side == Side::multi && (seq + id) % 3 == 0;
    if (copy) {
      make_item(tmp.data(), payload, id, seq);
      const RingStatus s = ring->try_push(tmp.data(), payload);
      if (s == RingStatus::ok) {
        ++seq;
      } else if (s == RingStatus::invalid) {
        return fail(*a.control, kExitBadStatus);
      } else {
        sched_yield();
      }
      continue;
    }
    const RingResult r = cfg.producer_side == Side::single
                             ? ring->try_reserve_sp()
                             : ring->try_reserve();
    if (!r) {
      if (r.status == RingStatus::invalid)
        return fail(*a.control, kExitBadStatus);
      sched_yield();
      continue;
    }
    make_item(r.handle.payload, payload, id, seq);
    ring->publish(r.handle);
    ++seq;
  }
  return kExitOk;
}

int consumer_main(SharedArea& a, const Config& cfg, uint32_t id) {
  const auto deadline = Clock::now() + kChildDeadline;
  auto ring =
      Ring::attach(a.ring, Ring::slots_after(a.ring), cfg.capacity, cfg.stride);
  if (!ring) return fail(*a.control, kExitAttach);
  if (!wait_start(*a.control, deadline)) return fail(*a.control, kExitTimeout);
  const std::size_t payload = ring->payload_size();
  const uint64_t total = uint64_t{cfg.items_per_producer} * cfg.producers;
  std::vector<std::byte> item(payload);
  // A consumer's claims are at increasing positions, so it must see each
  // producer's items in increasing sequence order.
  std::vector<int64_t> last(static_cast<std::size_t>(cfg.producers), -1);

  uint64_t n = 0;
  // Relaxed: `consumed` is a termination counter; item data is ordered by
  // the ring's own acquire/release pairs.
  while (a.control->consumed.load(std::memory_order_relaxed) < total) {
    if (a.control->abort.load(std::memory_order_relaxed) != 0)
      return kExitAborted;
    if (past(deadline)) return fail(*a.control, kExitTimeout);
    const bool copy = cfg.consumer_side == Side::multi && (n + id) % 2 == 0;
    if (copy) {
      const RingStatus s = ring->try_pop(item.data(), payload);
      if (s == RingStatus::invalid) return fail(*a.control, kExitBadStatus);
      if (s != RingStatus::ok) {
        sched_yield();
        continue;
      }
    } else {
      const RingResult r = cfg.consumer_side == Side::single
                               ? ring->try_claim_sc()
                               : ring->try_claim();
      if (!r) {
        if (r.status == RingStatus::invalid)
          return fail(*a.control, kExitBadStatus);
        sched_yield();
        continue;
      }
      // Copy the untrusted shared bytes once, validate only the copy.
      std::memcpy(item.data(), r.handle.payload, payload);
      ring->release(r.handle);
    }
    ++n;

    ItemHeader h{};
    if (!check_item(item.data(), payload, h))
      return fail(*a.control, kExitChecksum);
    if (h.producer >= static_cast<uint32_t>(cfg.producers) ||
        h.seq >= cfg.items_per_producer)
      return fail(*a.control, kExitBadId);
    if (int64_t{h.seq} <= last[h.producer]) return fail(*a.control, kExitOrder);
    last[h.producer] = h.seq;

    const uint64_t bit = uint64_t{h.producer} * cfg.items_per_producer + h.seq;
    // Relaxed: the RMW alone decides "first to set the bit"; nothing else is
    // published through the bitmap (the parent reads it after waitpid).
    const uint64_t mask = uint64_t{1} << (bit % 64);
    if (a.bitmap[bit / 64].fetch_or(mask, std::memory_order_relaxed) & mask)
      return fail(*a.control, kExitDuplicate);
    a.control->consumed.fetch_add(1, std::memory_order_relaxed);
  }
  return kExitOk;
}

// --------------------------------------------------------------- parent

struct Child {
  pid_t pid;
  std::string role;
  int status = 0;
  bool reaped = false;
};

void run_stress(const Config& cfg) {
  ASSERT_TRUE(cfg.producer_side == Side::multi || cfg.producers == 1);
  ASSERT_TRUE(cfg.consumer_side == Side::multi || cfg.consumers == 1);
  SharedArea area;
  ASSERT_TRUE(map_area(area, cfg)) << "mmap: " << std::strerror(errno);
  // Start near the top of the index space so the run crosses 2^32.
  ASSERT_TRUE(Ring::format(area.ring, Ring::slots_after(area.ring),
                           cfg.capacity, cfg.stride, UINT32_MAX - 777));

  std::vector<Child> children;
  auto spawn = [&](bool producer, uint32_t id) {
    const pid_t pid = fork();
    if (pid == 0) {
      // Child: never return into gtest; _exit skips atexit handlers and
      // stdio flushing inherited from the parent.
      _exit(producer ? producer_main(area, cfg, id)
                     : consumer_main(area, cfg, id));
    }
    children.push_back(
        {pid, (producer ? "producer " : "consumer ") + std::to_string(id)});
    return pid > 0;
  };
  bool forked = true;
  for (int p = 0; p < cfg.producers && forked; ++p)
    forked = spawn(true, static_cast<uint32_t>(p));
  for (int c = 0; c < cfg.consumers && forked; ++c)
    forked = spawn(false, static_cast<uint32_t>(c));
  if (!forked) area.control->abort.store(1, std::memory_order_relaxed);

  // Release pairs with the children's acquire in wait_start().
  area.control->start.store(1, std::memory_order_release);

  const auto deadline = Clock::now() + kParentDeadline;
  std::size_t live = 0;
  for (const Child& c : children) live += c.pid > 0;
  bool timed_out = false;
  while (live > 0) {
    for (Child& c : children) {
      if (c.pid <= 0 || c.reaped) continue;
      const pid_t r = waitpid(c.pid, &c.status, WNOHANG);
      if (r == c.pid || (r < 0 && errno == ECHILD)) {
        c.reaped = true;
        --live;
      }
    }
    if (live == 0) break;
    if (Clock::now() > deadline) {
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (timed_out) {
    for (Child& c : children)
      if (c.pid > 0 && !c.reaped) kill(c.pid, SIGKILL);
    // SIGKILL cannot be ignored, but still bound the reaping wait.
    const auto reap_deadline = Clock::now() + std::chrono::seconds(5);
    for (Child& c : children) {
      while (c.pid > 0 && !c.reaped && Clock::now() < reap_deadline) {
        const pid_t r = waitpid(c.pid, &c.status, WNOHANG);
        if (r == c.pid || (r < 0 && errno == ECHILD))
          c.reaped = true;
        else
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
  }

  ASSERT_TRUE(forked) << "fork failed: " << std::strerror(errno);
  ASSERT_FALSE(timed_out) << "children still running after "
                          << kParentDeadline.count() << " s; killed";
  bool all_ok = true;
  for (const Child& c : children) {
    if (WIFEXITED(c.status)) {
      const int code = WEXITSTATUS(c.status);
      EXPECT_EQ(code, kExitOk) << c.role << ": " << exit_name(code);
      all_ok = all_ok && code == kExitOk;
    } else {
      ADD_FAILURE() << c.role << " died of signal "
                    << (WIFSIGNALED(c.status) ? WTERMSIG(c.status) : -1);
      all_ok = false;
    }
  }
  if (!all_ok) return;

  // All children exited (waitpid synchronises with them), so these relaxed
  // reads see their final values.
  const uint64_t total = uint64_t{cfg.items_per_producer} * cfg.producers;
  EXPECT_EQ(area.control->consumed.load(std::memory_order_relaxed), total);
  uint64_t missing = 0;
  for (uint64_t i = 0; i < total; ++i) {
    const uint64_t w = area.bitmap[i / 64].load(std::memory_order_relaxed);
    missing += ((w >> (i % 64)) & 1) == 0;
  }
  EXPECT_EQ(missing, 0u) << "items never consumed";
  auto view = Ring::attach(area.ring, Ring::slots_after(area.ring),
                           cfg.capacity, cfg.stride);
  ASSERT_TRUE(view);
  EXPECT_EQ(view->size_approx(), 0u);
  EXPECT_FALSE(view->peek_ready());
}

// Sanitizer builds are several times slower; scale the work so the whole
// binary stays within a few seconds on a 2-core machine either way.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr uint32_t kScale = 4;
#else
constexpr uint32_t kScale = 1;
#endif

uint32_t items(uint32_t n) { return n / kScale; }

TEST(RingStress, TwoProducersTwoConsumers) {
  run_stress({2, 2, items(300000), Side::multi, Side::multi, 64, 256});
}

// Receive-queue shape: the owner posts (single-producer fast path), several
// peers take WQEs.
TEST(RingStress, OneProducerThreeConsumers) {
  run_stress({1, 3, items(400000), Side::single, Side::multi, 32, 576});
}

// Completion-queue shape: several producers, one polling consumer.
TEST(RingStress, ThreeProducersOneConsumer) {
  run_stress({3, 1, items(300000), Side::multi, Side::single, 128, 64});
}

// Tiny ring: producers and consumers constantly collide on the same slots.
TEST(RingStress, TinyRingHighContention) {
  run_stress({2, 2, items(60000), Side::multi, Side::multi, 2, 64});
}

}  // namespace
}  // namespace shmrdma
