// The worker side of two-process tests: a worker reports on stdout, line
// by line, and the driver judges its output. die() ends the worker at once
// ("FAIL: ..."), REQUIRE() dies on a false condition, CHECK() counts a
// failure and goes on (the worker prints check_failures at the end).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

#include <infiniband/verbs.h>

namespace harness {

[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Failed CHECKs of this worker so far.
inline int check_failures = 0;

// FNV-1a of p[0..n).
uint64_t fnv(const uint8_t* p, size_t n);

// Private anonymous read-write memory of len bytes (dies on failure).
uint8_t* map_buf(size_t len);

// What the two workers of an RC pair tell each other over the control
// channel (wire.h) to connect their QPs.
struct Hello {
  uint32_t qpn = 0;
  uint16_t lid = 0;
  uint16_t pad = 0;
};

// Sends this QP's Hello and returns the peer's (dies after 30 s).
Hello exchange_hello(ibv_context* ctx, ibv_qp* qp);

}  // namespace harness

#define REQUIRE(c, ...)                        \
  do {                                         \
    if (!(c)) ::harness::die(__VA_ARGS__);     \
  } while (0)

#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++::harness::check_failures;                        \
      std::printf("FAIL line %d: %s: ", __LINE__, #cond); \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
    }                                                     \
  } while (0)
