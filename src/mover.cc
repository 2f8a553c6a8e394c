#include "mover.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

namespace shmrdma {

namespace {

constexpr size_t kMaxIov = 64;  // 2 * max_sge, far below IOV_MAX

size_t total(const IoVec* v, size_t n) {
  size_t t = 0;
  for (size_t i = 0; i < n; ++i) t += v[i].len;
  return t;
}

// memcpy between two iovec lists of equal total length.
void copy_lists(const IoVec* dst, size_t nd, const IoVec* src, size_t ns) {
  size_t di = 0, doff = 0, si = 0, soff = 0;
  while (di < nd && si < ns) {
    size_t n = std::min(dst[di].len - doff, src[si].len - soff);
    if (n) move_bytes(static_cast<char*>(dst[di].base) + doff, static_cast<const char*>(src[si].base) + soff, n);
    doff += n;
    soff += n;
    if (doff == dst[di].len) ++di, doff = 0;
    if (soff == src[si].len) ++si, soff = 0;
  }
}

int cma(bool write, pid_t pid, const IoVec* local, size_t nlocal, const IoVec* remote, size_t nremote) {
  if (nlocal > kMaxIov || nremote > kMaxIov) return EINVAL;
  iovec l[kMaxIov], r[kMaxIov];
  size_t want = 0;
  for (size_t i = 0; i < nlocal; ++i) l[i] = {local[i].base, local[i].len}, want += local[i].len;
  for (size_t i = 0; i < nremote; ++i) r[i] = {remote[i].base, remote[i].len};
  if (want == 0) return 0;
  ssize_t n = write ? ::process_vm_writev(pid, l, nlocal, r, nremote, 0) : ::process_vm_readv(pid, l, nlocal, r, nremote, 0);
  if (n < 0) return errno;
  // A partial transfer means an address past the first failing one is not
  // mapped in the other process.
  return static_cast<size_t>(n) == want ? 0 : EFAULT;
}

// move_out's one buffer each side, reachable here.
[[gnu::noinline]] int move_out_one(const IoVec* local, const IoVec* remote, bool last_byte_last) noexcept {
  if (local->len != remote->len) return EINVAL;
  move_one(remote->base, local->base, local->len, last_byte_last);
  return 0;
}

// move_out for lists, or memory of another process: out of line, so that
// move_out's common case (move_one) does not set up this one's frame (its
// IoVec arrays and cma's iovec arrays, inlined: 4 KiB of stack, whose lines
// the copy's call then touched cold).
[[gnu::noinline]] int move_out_lists(pid_t pid, bool same_process, const IoVec* local, size_t nlocal,
                                     const IoVec* remote, size_t nremote, bool last_byte_last) noexcept {
  size_t len = total(local, nlocal);
  if (len != total(remote, nremote)) return EINVAL;
  if (len == 0) return 0;
  if (!last_byte_last || len == 1) {
    if (same_process) {
      copy_lists(remote, nremote, local, nlocal);
      return 0;
    }
    return cma(true, pid, local, nlocal, remote, nremote);
  }
  // Split off the final byte of both lists.
  IoVec l[kMaxIov], r[kMaxIov];
  if (nlocal > kMaxIov || nremote > kMaxIov) return EINVAL;
  std::memcpy(l, local, nlocal * sizeof(IoVec));
  std::memcpy(r, remote, nremote * sizeof(IoVec));
  size_t nl = nlocal, nr = nremote;
  while (nl && l[nl - 1].len == 0) --nl;
  while (nr && r[nr - 1].len == 0) --nr;
  IoVec ltail{static_cast<char*>(l[nl - 1].base) + l[nl - 1].len - 1, 1};
  IoVec rtail{static_cast<char*>(r[nr - 1].base) + r[nr - 1].len - 1, 1};
  l[nl - 1].len -= 1;
  r[nr - 1].len -= 1;
  if (same_process) {
    copy_lists(r, nr, l, nl);
    // Release: every byte above is visible before the last one to a reader
    // that sees the last one (with acquire, or any load on x86).
    std::atomic_ref<char>(*static_cast<char*>(rtail.base))
        .store(*static_cast<const char*>(ltail.base), std::memory_order_release);
    return 0;
  }
#if defined(__x86_64__) || defined(__i386__)
  // One system call: the final byte as its own last segment of both lists.
  // The kernel copies the remote segments in order, each with its own copy
  // instructions, and x86 keeps stores of separate instructions in order, so
  // the final byte is stored after every other one.
  if (nl == kMaxIov || nr == kMaxIov) {
    if (int rc = cma(true, pid, l, nl, r, nr)) return rc;
    return cma(true, pid, &ltail, 1, &rtail, 1);
  }
  if (l[nl - 1].len == 0) --nl;
  if (r[nr - 1].len == 0) --nr;
  l[nl++] = ltail;
  r[nr++] = rtail;
  return cma(true, pid, l, nl, r, nr);
#else
  if (int rc = cma(true, pid, l, nl, r, nr)) return rc;
  return cma(true, pid, &ltail, 1, &rtail, 1);
#endif
}

}  // namespace

void move_pieces(char* d, const char* s, size_t len) noexcept {
  const auto dn = reinterpret_cast<uintptr_t>(d), sn = reinterpret_cast<uintptr_t>(s);
  if (dn < sn + len && sn < dn + len) {  // overlapping: one memmove keeps its direction right
    std::memmove(d, s, len);
    return;
  }
  for (size_t off = 0; off < len; off += kMovePiece) std::memcpy(d + off, s + off, std::min(kMovePiece, len - off));
}

int move_out(pid_t pid, bool same_process, const IoVec* local, size_t nlocal, const IoVec* remote, size_t nremote,
             bool last_byte_last) noexcept {
  // Two tail calls: move_out itself keeps no frame.
  if (same_process && nlocal == 1 && nremote == 1) return move_out_one(local, remote, last_byte_last);
  return move_out_lists(pid, same_process, local, nlocal, remote, nremote, last_byte_last);
}

int move_in(pid_t pid, bool same_process, const IoVec* local, size_t nlocal, const IoVec* remote,
            size_t nremote) noexcept {
  if (total(local, nlocal) != total(remote, nremote)) return EINVAL;
  if (same_process) {
    copy_lists(local, nlocal, remote, nremote);
    return 0;
  }
  return cma(false, pid, local, nlocal, remote, nremote);
}

}  // namespace shmrdma
