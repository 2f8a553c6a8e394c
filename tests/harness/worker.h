// The worker side of two-process tests: a worker reports on stdout, line
// by line, and the driver judges its output. die() ends the worker at once
// ("FAIL: ..."), REQUIRE() dies on a false condition, CHECK() counts a
// failure and goes on (the worker prints check_failures at the end).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>

namespace harness {

[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Failed CHECKs of this worker so far.
inline int check_failures = 0;

// FNV-1a of p[0..n).
uint64_t fnv(const uint8_t* p, size_t n);

// Private anonymous read-write memory of len bytes (dies on failure).
uint8_t* map_buf(size_t len);

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
