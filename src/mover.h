// Data movers: how bytes get from one process's memory into another's.
// Today every remote transfer is one process_vm_writev/readv call (CMA), or
// plain memcpy when both sides live in this process; the mapped tier (peers
// mapping each other's registered memory) comes with the performance work.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <emmintrin.h>

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

// n (4 to 16) bytes from s to d in two loads and two stores of 4 or 8
// bytes, overlapping each other when n is not 8 or 16; every load comes
// before any store, so s and d may overlap.
inline void copy_4_to_16(char* d, const char* s, size_t n) noexcept {
  if (n >= 8) {
    uint64_t a, b;
    __builtin_memcpy(&a, s, 8);
    __builtin_memcpy(&b, s + n - 8, 8);
    __builtin_memcpy(d, &a, 8);
    __builtin_memcpy(d + n - 8, &b, 8);
  } else {
    uint32_t a, b;
    __builtin_memcpy(&a, s, 4);
    __builtin_memcpy(&b, s + n - 4, 4);
    __builtin_memcpy(d, &a, 4);
    __builtin_memcpy(d + n - 4, &b, 4);
  }
}

// n (0 to 16) bytes from s to d without a call: copy_4_to_16 from 4 bytes
// on, below that the first, middle and last byte (three loads, then three
// stores). Every load comes before any store, so s and d may overlap.
[[gnu::always_inline]] inline void copy_upto16(void* dst, const void* src, size_t n) noexcept {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (n >= 4) {
    copy_4_to_16(d, s, n);
  } else if (n) {
    const char a = s[0], b = s[n / 2], c = s[n - 1];
    d[0] = a;
    d[n / 2] = b;
    d[n - 1] = c;
  }
}

// Bytes 0-7 and 8-15 of len (1 to 16) bytes at s, zero past len, in
// registers: overlapping loads of 8, 4 or 1 byte(s), none past s + len (a
// small message's bytes going into its completion: send_leaf).
[[gnu::always_inline]] inline void load_small(const uint8_t* s, uint32_t len, uint64_t* lo, uint64_t* hi) noexcept {
  if (len >= 8) {
    uint64_t a, b;
    __builtin_memcpy(&a, s, 8);
    __builtin_memcpy(&b, s + len - 8, 8);  // bytes len-8 .. len-1
    *lo = a;
    *hi = len == 8 ? 0 : b >> (8 * (16 - len));  // bytes 8 .. len-1
  } else if (len >= 4) {
    uint32_t a, b;
    __builtin_memcpy(&a, s, 4);
    __builtin_memcpy(&b, s + len - 4, 4);  // bytes len-4 .. len-1 (overlapping the first four: the same values)
    *lo = a | uint64_t{b} << (8 * (len - 4));
    *hi = 0;
  } else {
    *lo = s[0] | uint64_t{s[len / 2]} << (8 * (len / 2)) | uint64_t{s[len - 1]} << (8 * (len - 1));
    *hi = 0;
  }
}

// Copies n (17 to 64) bytes in at most four 16-byte loads and then as many
// stores (overlapping when n is not a multiple of 16): every load before
// any store, so s and d may overlap, and no call (a memcpy of a size known
// only at run time is a call or `rep movsb`).
[[gnu::always_inline]] inline void copy_17_to_64(uint8_t* d, const uint8_t* s, uint32_t n) noexcept {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + n - 16));
  if (n <= 32) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + n - 16), z);
    return;
  }
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(n <= 48 ? s + 16 : s + 32));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(n <= 48 ? d + 16 : d + 32), c);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d + n - 16), z);
}

// n (0 to 64) bytes without a call: copy_upto16 or copy_17_to_64, so s and
// d may overlap.
[[gnu::always_inline]] inline void copy_upto64(uint8_t* d, const uint8_t* s, uint32_t n) noexcept {
  if (n <= 16)
    copy_upto16(d, s, n);
  else
    copy_17_to_64(d, s, n);
}

// The inverse of load_small: len (1 to 16) bytes from lo (bytes 0-7) and
// hi (8-15) to d, in overlapping stores of 8, 4 or 1 byte(s), none past
// d + len.
[[gnu::always_inline]] inline void store_small(uint8_t* d, uint32_t len, uint64_t lo, uint64_t hi) noexcept {
  if (len >= 8) {
    __builtin_memcpy(d, &lo, 8);
    if (len > 8) {
      const uint64_t t = len == 16 ? hi : lo >> (8 * (len - 8)) | hi << (8 * (16 - len));  // bytes len-8 .. len-1
      __builtin_memcpy(d + len - 8, &t, 8);
    }
  } else if (len >= 4) {
    const uint32_t a = static_cast<uint32_t>(lo), b = static_cast<uint32_t>(lo >> (8 * (len - 4)));
    __builtin_memcpy(d, &a, 4);
    __builtin_memcpy(d + len - 4, &b, 4);  // bytes len-4 .. len-1
  } else {
    d[0] = static_cast<uint8_t>(lo);
    d[len / 2] = static_cast<uint8_t>(lo >> (8 * (len / 2)));
    d[len - 1] = static_cast<uint8_t>(lo >> (8 * (len - 1)));
  }
}

// store_small for len 1 to 20: bytes 16-19 from top.
[[gnu::always_inline]] inline void store_upto20(uint8_t* d, uint32_t len, uint64_t lo, uint64_t hi,
                                                uint32_t top) noexcept {
  if (len <= 16) {
    store_small(d, len, lo, hi);
    return;
  }
  __builtin_memcpy(d, &lo, 8);
  __builtin_memcpy(d + 8, &hi, 8);
  const uint32_t t = len == 20 ? top : static_cast<uint32_t>(hi >> (8 * (len - 12)) | uint64_t{top} << (8 * (20 - len)));
  __builtin_memcpy(d + len - 4, &t, 4);  // bytes len-4 .. len-1
}

// load_small for len 1 to 20: bytes 16-19 in *top (zero past len).
[[gnu::always_inline]] inline void load_upto20(const uint8_t* s, uint32_t len, uint64_t* lo, uint64_t* hi,
                                               uint32_t* top) noexcept {
  if (len <= 16) {
    load_small(s, len, lo, hi);
    *top = 0;
    return;
  }
  uint32_t t;
  __builtin_memcpy(lo, s, 8);
  __builtin_memcpy(hi, s + 8, 8);
  __builtin_memcpy(&t, s + len - 4, 4);  // bytes len-4 .. len-1
  *top = t >> (8 * (20 - len));         // bytes 16 .. len-1
}

// A memmove of len bytes; above kMovePiece, when the two ranges do not
// overlap, in pieces of kMovePiece (move_pieces, out of line). glibc on AMD
// stops using `rep movsb` for copies of the L2's size and more (its
// rep_movsb_stop_threshold), and on the EPYC (family 26, 1 MiB of L2) we
// measure on its other loop is the slower one: a 1 MiB memmove ran at
// 48-51 GB/s, the same bytes in 256 KiB pieces at 56 (4 MiB: +2%, 16 MiB:
// +6%). A piece costs one more call per 256 KiB where that does not apply.
constexpr size_t kMovePiece = 256 * 1024;
void move_pieces(char* d, const char* s, size_t len) noexcept;
[[gnu::always_inline]] inline void move_bytes(void* dst, const void* src, size_t len) noexcept {
  if (len <= kMovePiece) [[likely]] {
    __builtin_memmove(dst, src, len);
    return;
  }
  move_pieces(static_cast<char*>(dst), static_cast<const char*>(src), len);
}

// move_out's common case inline: one buffer each side, both reachable
// here (memmove above 16 bytes, copy_upto16 below), the last byte stored
// last with release when last_byte_last (see move_out). dst and src may
// overlap, except that with last_byte_last the source's last byte is read
// after the other bytes are stored (as move_out's lists do).
[[gnu::always_inline]] inline void move_one(void* dst, const void* src, size_t len, bool last_byte_last) noexcept {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (len == 0) return;
  if (!last_byte_last || len == 1) {
    if (len <= 16)
      copy_upto16(d, s, len);
    else
      move_bytes(d, s, len);
    return;
  }
  if (len <= 17)  // overlapping too: copy_upto16 loads before it stores
    copy_upto16(d, s, len - 1);
  else
    move_bytes(d, s, len - 1);
  __atomic_store_n(d + len - 1, s[len - 1], __ATOMIC_RELEASE);
}

// move_out's smallest case inline (the fast path of small WRITEs and
// SENDs): one buffer each side, both reachable here, 1 to 16 bytes, not
// overlapping. The last byte is stored last, with release, as move_out's
// last_byte_last does. False (nothing copied) for anything else.
//
// 8 bytes to an 8-byte aligned address (the common small message) are one
// store instead: x86 makes such a store visible at once (AMD64: a single
// store within an aligned 8-byte block; Intel: an aligned 8-byte access),
// so a peer spinning on the last byte sees every other byte with it. One
// store instead of three into a line the target may be polling.
[[gnu::always_inline]] inline bool move_out_small(void* dst, const void* src, size_t len) noexcept {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
#if defined(__x86_64__)
  if (len == 8 && (reinterpret_cast<uintptr_t>(d) & 7) == 0) {
    uint64_t v;
    __builtin_memcpy(&v, s, 8);
    __atomic_store_n(reinterpret_cast<uint64_t*>(d), v, __ATOMIC_RELEASE);
    return true;
  }
#endif
  if (len - 1 >= 16 || (d < s + len && s < d + len)) return false;
  const size_t n = len - 1;  // all but the last byte, in at most two loads and stores
  if (n >= 4)
    copy_4_to_16(d, s, n);
  else
    for (size_t i = 0; i < n; ++i) d[i] = s[i];
  __atomic_store_n(d + n, s[n], __ATOMIC_RELEASE);  // see move_out
  return true;
}

// Asks now for the line at dst for writing: the first line of a receive
// buffer a later send will write its bytes into (srq_send_leaf), so that
// send's stores do not wait for the line to leave the receiver's core (a
// prefetch brings it shared here: see Ring::own_line). A locked OR of 0
// into its first byte: it changes no byte, and being atomic it loses no
// store another process makes to that byte meanwhile (another sender that
// took the same WQE). The caller checked dst as a buffer it may write. It
// waits for the line itself, so it belongs after the message is out.
// Inline assembly on x86-64 (the other process's accesses are outside the
// C++ model anyway, and a sanitizer has nothing to check in it); elsewhere
// nothing, a hint only.
[[gnu::always_inline]] inline void own_dest_line(void* dst) noexcept {
#if defined(__x86_64__)
  asm volatile("lock orb $0, %0" : "+m"(*static_cast<unsigned char*>(dst)));
#else
  (void)dst;
#endif
}

// Copies the bytes of `remote` (in process pid) into `local`.
int move_in(pid_t pid, bool same_process, const IoVec* local, size_t nlocal, const IoVec* remote,
            size_t nremote) noexcept;

}  // namespace shmrdma
