// Completion queues of a context: a ring of Cqe in the context segment. Many
// producers (this process and peers), one consumer (this process's poller).
//
// Producer protocol (every push, the owner's own and a peer's, on CqEntry):
//   P1  producers.fetch_add(1) (seq_cst), then load resizing and state
//       (seq_cst): when a resize is in progress or the CQ is being
//       destroyed, undo the increment and back off (bounded).
//   P2  read the ring geometry from the CqEntry, validate it (Peer::ring),
//       push the CQE.
//   P3  producers.fetch_sub(1) (release).
//   P4  fence (seq_cst), load notify (the fast push, cq_push.h, publishes
//       with a seq_cst CAS and loads notify seq_cst instead of the
//       fence, which orders them the same): when the CQ is armed and the CQE
//       qualifies (solicited_only: a solicited or an error completion), CAS
//       notify to kNotifyNone; the producer whose CAS wins writes one event
//       token to the CQ's completion channel (channel.h). A token that cannot
//       be written puts the arming back.
//
// Resize (owner, serialised with its polls): resizing = 1 (seq_cst), wait
// until producers == 0. Dekker with P1: either the owner sees a producer's
// increment and waits for its P3, or the producer sees resizing and backs
// off, so once the owner saw 0 no push is in progress and none can start.
// Then it moves the queued CQEs in order into the new ring, writes the new
// geometry and stores resizing = 0 with release (a producer whose P1 load
// sees 0 then reads the new geometry), and frees the old ring. Destroy uses
// the same handshake on `state`, so no push writes into a freed ring.
//
// Arming (owner): raise notify to the requested mode with a CAS, then a
// seq_cst fence. With P4 this is the usual "no lost event" pairing: a
// completion pushed concurrently with the arming is either seen by the poll
// the application makes after arming, or its producer sees the arming. Our
// own completions (the CQ's FIFO, local_cq.h) have no fence after their
// publish: arm_cq then also takes and drops the sq_lock of each of the
// FIFO's producers, which gives the same either-or.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "async.h"
#include "channel.h"
#include "context.h"
#include "cq_push.h"

namespace shmrdma {

// A blocked ibv_get_cq_event, and the progress thread (progress_thread.cc),
// retry waiting sends this often (the transport's timer; progress tokens
// usually wake a blocked waiter sooner): 2 ms, or
// SHMRDMA_RETRY_POLL_MS (1 .. 3,600,000; man 7 shmrdma). A long period
// shows whether a waiter is woken rather than found by the timer (tests).
int retry_poll_ms() noexcept {
  static const int ms = [] {
    const char* v = std::getenv("SHMRDMA_RETRY_POLL_MS");
    if (!v || !*v) return 2;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    return *end || n < 1 || n > 3'600'000 ? 2 : static_cast<int>(n);
  }();
  return ms;
}

namespace {

constexpr uint32_t kCqeStride =
    static_cast<uint32_t>(layout::align_up(kRingSlotHeaderBytes + sizeof(layout::Cqe), layout::kCacheLine));

// How long a producer waits for the owner's resize, and the owner for the
// pushes in progress (a producer that died mid-push never finishes).
constexpr uint64_t kQuiesceWaitNs = 2'000'000'000ull;

uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void backoff(unsigned i) {
  if (i < 64) {
    __builtin_ia32_pause();
  } else if (i < 256) {
    sched_yield();
  } else {
    timespec ts{0, 50'000};
    nanosleep(&ts, nullptr);
  }
}

// Waits (bounded) until no push is in progress on `e`. True when drained.
bool wait_producers(layout::CqEntry* e) {
  uint64_t start = 0;
  for (unsigned i = 0;; ++i) {
    if (e->producers.load(std::memory_order_seq_cst) == 0) return true;
    if (!start) start = mono_ns();
    else if (mono_ns() - start > kQuiesceWaitNs) return false;
    backoff(i);
  }
}

bool qualifies(uint32_t mode, const layout::Cqe& c) {
  if (mode == layout::kNotifyNext) return true;
  return mode == layout::kNotifySolicited && ((c.flags & layout::kCqeSolicited) || layout::error_cqe(c));
}

// P4. Returns the mode this producer took (kNotifyNone: nothing to fire).
uint32_t take_notify(layout::CqEntry* e, const layout::Cqe& c) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the fence in arm_cq
  uint32_t m = e->notify.load(std::memory_order_relaxed);
  for (int i = 0; i < 16; ++i) {
    if (!qualifies(m, c)) return layout::kNotifyNone;  // unarmed, or garbage from a corrupt peer
    if (e->notify.compare_exchange_weak(m, layout::kNotifyNone, std::memory_order_relaxed,
                                        std::memory_order_relaxed))
      return m;
  }
  return layout::kNotifyNone;
}

// The token could not be written: arm again, unless someone re-armed or fired.
void rearm(layout::CqEntry* e, uint32_t mode) {
  uint32_t none = layout::kNotifyNone;
  e->notify.compare_exchange_strong(none, mode, std::memory_order_relaxed, std::memory_order_relaxed);
}

}  // namespace

// ---------------------------------------------------------- channel FIFOs

int open_channel_writer(const std::string& path) noexcept {
  int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -1;
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool write_channel_token(int fd, uint64_t token) noexcept {
  if (fd < 0) return false;
  // 8 bytes < PIPE_BUF: atomic, never interleaved with another writer's.
  return ::write(fd, &token, sizeof token) == static_cast<ssize_t>(sizeof token);
}

bool Peer::notify_channel(uint32_t channel, uint64_t token) noexcept {
  if (channel == layout::kNoIndex) return false;
  const uint32_t n = chan_number(channel);
  if (n >= kMaxChannels || segment_path.empty()) return false;
  try {
    std::lock_guard lk(chan_mu_);
    auto& slot = chan_fds_.try_emplace(n, 0u, -1).first->second;
    if (slot.second >= 0 && slot.first != channel) {
      // The owner destroyed that channel and made a new one with its number.
      ::close(slot.second);
      slot.second = -1;
    }
    if (slot.second < 0) {
      slot.second = open_channel_writer(channel_path(segment_path, n));
      slot.first = channel;
    }
    return write_channel_token(slot.second, token);
  } catch (...) {
    return false;
  }
}

int LocalContext::create_channel(int* read_fd, uint32_t* number) noexcept {
  std::lock_guard lk(mu_);
  if (chans_.empty()) {
    try {
      chans_.resize(kMaxChannels);
    } catch (...) {
      return ENOMEM;
    }
  }
  uint32_t n = 0;
  while (n < chans_.size() && chans_[n].live) ++n;
  if (n == chans_.size()) return EMFILE;
  std::string path;
  try {
    path = channel_path(map_.path(), n);
  } catch (...) {
    return ENOMEM;
  }
  ::unlink(path.c_str());  // left over if an earlier unlink failed
  int r = -1, w = -1;
  if (int rc = create_async_fifo(path, &r, &w)) return rc;  // same FIFO semantics as the async one
  ChanState& c = chans_[n];
  c.live = true;
  c.generation += 1;
  c.refs = 0;
  c.read_fd = r;
  c.write_fd = w;
  *read_fd = r;
  *number = n;
  return 0;
}

int LocalContext::destroy_channel(uint32_t number) noexcept {
  std::lock_guard lk(mu_);
  if (number >= chans_.size() || !chans_[number].live) return EINVAL;
  ChanState& c = chans_[number];
  if (c.refs) return EBUSY;
  ::close(c.write_fd);
  ::unlink(channel_path(map_.path(), number).c_str());
  c.live = false;
  c.read_fd = c.write_fd = -1;
  return 0;
}

uint32_t LocalContext::channel_by_fd(int fd) const noexcept {
  std::lock_guard lk(mu_);
  for (uint32_t n = 0; n < chans_.size(); ++n)
    if (chans_[n].live && chans_[n].read_fd == fd) return n;
  return layout::kNoIndex;
}

void LocalContext::close_channels() noexcept {
  for (uint32_t n = 0; n < chans_.size(); ++n) {
    if (!chans_[n].live) continue;
    ::close(chans_[n].write_fd);
    if (map_.base()) ::unlink(channel_path(map_.path(), n).c_str());
    chans_[n].live = false;
  }
}

int LocalContext::get_channel_event(uint32_t number, int fd, void** cq_user, void (*on_event)(void*)) noexcept {
  for (;;) {
    if (qps_pending_.load(std::memory_order_relaxed)) {
      // Sends wait (for a receive, for the target): retry them regularly
      // while we block, as the transport's timers would.
      int fl = ::fcntl(fd, F_GETFL);
      if (fl >= 0 && !(fl & O_NONBLOCK)) {
        pollfd p{fd, POLLIN, 0};
        int k = ::poll(&p, 1, retry_poll_ms());
        if (k < 0) return errno;
        if (k == 0) {
          progress_all_looking();
          continue;
        }
      }
    }
    uint64_t tok = 0;
    ssize_t n = ::read(fd, &tok, sizeof tok);
    if (n < 0) return errno;
    if (n == 0) return EIO;  // cannot happen while we hold a write end
    if (n != sizeof tok) continue;  // a torn token from a corrupt writer: dropped
    switch (chan_token_kind(tok)) {
      case ChanKind::kProgress:
        progress_all_looking();
        continue;
      case ChanKind::kEvent: {
        const uint32_t index = chan_token_index(tok), gen = chan_token_generation(tok);
        std::lock_guard lk(mu_);
        if (index < cqs_.size() && cqs_[index].live && cqs_[index].user && cqs_[index].channel != layout::kNoIndex &&
            chan_number(cqs_[index].channel) == number &&
            (table<layout::CqEntry>(layout_.cq_table)[index].generation & 0xffffff) == gen) {
          *cq_user = cqs_[index].user;
          if (on_event) on_event(*cq_user);
          return 0;
        }
        continue;  // stale (CQ destroyed) or forged
      }
      default:
        continue;
    }
  }
}

void LocalContext::wake_initiator(Qp* qp) noexcept {
  // Pairs with the initiator's fence between setting initiator_waiting and
  // looking at our receive queue again: either it sees the WQE just posted
  // or we see its flag.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  auto& waiting = qp->shared->initiator_waiting;
  if (!waiting.load(std::memory_order_relaxed) || !waiting.exchange(0, std::memory_order_relaxed)) return;
  const uint32_t qpn = qp->attr.dest_qp_num;
  std::shared_ptr<Peer> peer;
  HomeDevice* dev = nullptr;
  {
    // The peer our own sends use, when it is that context (no registry read).
    std::lock_guard sq(qp->sq_lock);
    dev = qp->peer_dev;
    if (qp->peer && qp->peer->slot == layout::qpn_slot(qpn) && qp->peer->device == dev) peer = qp->peer;
  }
  if (!peer) peer = peer_of(dev, qpn);
  if (!peer) return;
  layout::QpEntry* q = peer->qp(layout::qpn_index(qpn));
  if (!q || q->state.load(std::memory_order_acquire) != layout::kLive || q->qpn != qpn) return;  // A1 / R1
  // The initiator may block on the channel of its send CQ or of its
  // receive CQ (waiting for the reply): tell both.
  const uint32_t cq_index[2] = {q->send_cq, q->recv_cq};
  uint32_t done = layout::kNoIndex;
  for (uint32_t i : cq_index) {
    layout::CqEntry* e = peer->cq(i);
    if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) continue;
    const uint32_t ch = e->channel;
    if (ch == layout::kNoIndex || ch == done) continue;
    done = ch;
    (void)peer->notify_channel(ch, chan_token(ChanKind::kProgress, 0, 0));
  }
}

// ------------------------------------------------------- completion queues

int LocalContext::create_cq(uint32_t cqe, CqInfo* out) noexcept {
  return create_cq(cqe, layout::kNoIndex, 0, out);
}

int LocalContext::create_cq(uint32_t cqe, uint32_t channel, uint32_t flags, CqInfo* out) noexcept {
  if (cqe < 1 || cqe > limits::kMaxCqe) return EINVAL;
  if (flags & ~uint32_t{layout::kCqIgnoreOverrun | layout::kCqTimestamp}) return EINVAL;
  uint32_t capacity = Ring::capacity_for(cqe);
  if (capacity == 0 || capacity > limits::kMaxCqe) return EINVAL;
  std::lock_guard lk(mu_);
  uint32_t chan = layout::kNoIndex;
  if (channel != layout::kNoIndex) {
    if (channel >= chans_.size() || !chans_[channel].live) return EINVAL;
    chan = chan_value(channel, chans_[channel].generation);
  }
  uint32_t i = 0;
  while (i < cqs_.size() && cqs_[i].live) ++i;
  if (i == cqs_.size()) return ENOMEM;
  Ring ring;
  uint64_t off = 0, bytes = 0;
  if (int rc = alloc_ring(capacity, kCqeStride, &ring, &off, &bytes)) return rc;
  auto* e = table<layout::CqEntry>(layout_.cq_table) + i;
  // Our own send completions get a private FIFO of the same capacity
  // (local_cq.h), except in a CQ with completion timestamps: there every
  // completion takes the shared ring, whose producers stamp in push order,
  // so the stamps the consumer hands out stay monotonic (provider cq.cc
  // pop_one) without merging two sources by time.
  LocalCq* local = nullptr;
  if (!(flags & layout::kCqTimestamp)) {
    local = LocalCq::create(capacity, e);
    if (!local) {
      heap_free(off, bytes);
      return ENOMEM;
    }
  }
  if (int rc = charge(layout::kObjCq, limits::kMaxCq)) {
    LocalCq::destroy(local);
    heap_free(off, bytes);
    return rc;
  }
  e->generation += 1;
  e->ring_epoch += 1;
  e->capacity = capacity;
  e->slot_stride = kCqeStride;
  e->ring_offset = off;
  e->ring_bytes = bytes;
  e->notify.store(layout::kNotifyNone, std::memory_order_relaxed);
  e->channel = chan;
  e->producers.store(0, std::memory_order_relaxed);
  e->resizing.store(0, std::memory_order_relaxed);
  e->flags = flags;
  e->state.store(layout::kLive, std::memory_order_release);  // R1
  CqState& s = cqs_[i];
  s = CqState{};
  s.live = true;
  s.ring_off = off;
  s.ring_bytes = bytes;
  s.info = CqInfo{i, capacity, ring, local};
  s.channel = chan;
  s.flags = flags;
  if (channel != layout::kNoIndex) chans_[channel].refs += 1;
  *out = s.info;
  return 0;
}

int LocalContext::destroy_cq(uint32_t index) noexcept {
  std::lock_guard lk(mu_);
  if (index >= cqs_.size() || !cqs_[index].live) return EINVAL;
  if (cqs_[index].refs) return EBUSY;
  auto* e = table<layout::CqEntry>(layout_.cq_table) + index;
  // Producers check `state` after announcing themselves (P1): once none is
  // in progress, none writes into the ring any more.
  e->state.store(layout::kFree, std::memory_order_seq_cst);
  (void)wait_producers(e);  // a producer that died mid-push never finishes; bounded
  e->notify.store(layout::kNotifyNone, std::memory_order_relaxed);
  heap_free(cqs_[index].ring_off, cqs_[index].ring_bytes);
  // No QP uses the CQ any more (refs): nobody completes into its FIFO.
  LocalCq::destroy(cqs_[index].info.local);
  if (cqs_[index].channel != layout::kNoIndex) {
    uint32_t n = chan_number(cqs_[index].channel);
    if (n < chans_.size() && chans_[n].refs) chans_[n].refs -= 1;
  }
  cqs_[index] = CqState{};
  uncharge(layout::kObjCq);
  return 0;
}

int LocalContext::resize_cq(uint32_t index, uint32_t cqe, CqInfo* out) noexcept {
  if (cqe < 1 || cqe > limits::kMaxCqe) return EINVAL;
  uint32_t capacity = Ring::capacity_for(cqe);
  if (capacity == 0 || capacity > limits::kMaxCqe) return EINVAL;
  std::lock_guard lk(mu_);
  if (index >= cqs_.size() || !cqs_[index].live) return EINVAL;
  CqState& s = cqs_[index];
  auto* e = table<layout::CqEntry>(layout_.cq_table) + index;
  Ring fresh;
  uint64_t off = 0, bytes = 0;
  if (int rc = alloc_ring(capacity, kCqeStride, &fresh, &off, &bytes)) return rc;
  // The FIFO of our own send completions: its producers are our QPs that
  // complete into this CQ, each under its sq_lock (complete_send, and the
  // receive flushes of flush_own_recv); holding
  // them all (after mu_, the usual order) stops them. The caller holds the
  // CQ's poll lock: no consumer either.
  LocalCq* local = s.info.local;
  auto own_producers = [&](bool lock) {
    if (!local) return;
    for (Qp* q : local->producers) {  // send_local == local or recv_cq == index (qp.cc own_fifos)
      if (lock) q->sq_lock.lock();
      else q->sq_lock.unlock();
    }
  };
  own_producers(true);
  // Each kind of completion must fit: shrinking below what either holds
  // is EINVAL (ibv_resize_cq(3)), as before with the one ring.
  if (local && local->held() > capacity) {
    own_producers(false);
    heap_free(off, bytes);
    return EINVAL;
  }
  e->resizing.store(1, std::memory_order_seq_cst);
  if (!wait_producers(e)) {
    e->resizing.store(0, std::memory_order_release);
    own_producers(false);
    heap_free(off, bytes);
    return EBUSY;  // a push never finished (its producer died mid-push)
  }
  // No push is in progress and none can start: the old ring holds exactly
  // what was published, and we are its only consumer.
  Ring old = s.info.ring;
  if (old.size_approx() > capacity || (local && !local->resize(capacity))) {
    const bool shrink = old.size_approx() > capacity;
    e->resizing.store(0, std::memory_order_release);
    own_producers(false);
    heap_free(off, bytes);
    return shrink ? EINVAL : ENOMEM;
  }
  own_producers(false);
  Ring next = fresh;
  for (uint32_t k = 0; k < old.capacity(); ++k) {
    RingResult r = old.try_claim_sc();
    if (!r) break;
    RingStatus st = next.try_push(r.handle.payload, sizeof(layout::Cqe));
    old.release(r.handle);
    if (st != RingStatus::ok) break;  // cannot happen: counted above
  }
  e->capacity = capacity;
  e->slot_stride = kCqeStride;
  e->ring_offset = off;
  e->ring_bytes = bytes;
  e->ring_epoch += 1;  // what producers knew of the old ring's room
  e->resizing.store(0, std::memory_order_release);  // producers that see 0 see the new geometry
  heap_free(s.ring_off, s.ring_bytes);
  s.ring_off = off;
  s.ring_bytes = bytes;
  s.info.capacity = capacity;
  s.info.ring = next;
  *out = s.info;
  return 0;
}

int LocalContext::arm_cq(uint32_t index, bool solicited_only) noexcept {
  if (index >= cqs_.size() || !cqs_[index].live) return EINVAL;
  if (cqs_[index].channel == layout::kNoIndex) return 0;  // no channel: nobody to tell
  auto* e = table<layout::CqEntry>(layout_.cq_table) + index;
  const uint32_t want = solicited_only ? layout::kNotifySolicited : layout::kNotifyNext;
  auto raise = [&] {
    uint32_t m = e->notify.load(std::memory_order_relaxed);
    for (int i = 0; i < 64; ++i) {
      // "Next" is stronger than "solicited": arming never weakens the mode.
      uint32_t next = (m == layout::kNotifyNext || m == layout::kNotifySolicited) ? std::max(m, want) : want;
      if (next == m) break;
      if (e->notify.compare_exchange_weak(m, next, std::memory_order_relaxed, std::memory_order_relaxed)) break;
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the fence in take_notify (P4)
  };
  LocalCq* local = cqs_[index].info.local;  // the CQ's for its life (resize keeps it)
  if (!local) {
    raise();
    return 0;
  }
  // Our own completions' producers read notify without a fence (local_cq.h):
  // each one's critical section either ends before we take its sq_lock (its
  // completion is seen by the poll after arming) or begins after we drop it
  // (it sees the arming). mu_ keeps the producer set still; mu_ then
  // sq_lock, the order of resize_cq and progress_all.
  std::lock_guard lk(mu_);
  if (!cqs_[index].live || cqs_[index].info.local != local) return EINVAL;
  raise();
  for (Qp* q : local->producers) {
    q->sq_lock.lock();
    q->sq_lock.unlock();
  }
  return 0;
}

// ------------------------------------------------------------- producers

namespace {

using cqpush::Fast;
using cqpush::push_common;

// P4 after a published push: takes the arming (take_notify) and writes the
// event token, into our own channel (own: write_own(token), from our private
// table) or the peer's; a token that cannot be written arms the CQ again.
// True when this producer wrote the token.
template <typename F>
bool fire_notify(const Peer& peer, bool own, uint32_t cq_index, layout::CqEntry* e, const layout::Cqe& cqe,
                 F&& write_own) noexcept {
  const uint32_t mode = take_notify(e, cqe);
  if (mode == layout::kNotifyNone) return false;
  const uint64_t token = chan_token(ChanKind::kEvent, cq_index, e->generation);
  const bool written = own ? write_own(token) : const_cast<Peer&>(peer).notify_channel(e->channel, token);
  if (!written) rearm(e, mode);
  return written;
}

// fire_notify's write_own for our own CQ cq_index: the channel's write end
// is in our private tables (LocalContext::cqs_, chans_).
template <typename Cqs, typename Chans>
bool write_own_token(const Cqs& cqs, const Chans& chans, uint32_t cq_index, uint64_t token) noexcept {
  const uint32_t ch = cqs[cq_index].channel;
  const uint32_t n = chan_number(ch);
  return ch != layout::kNoIndex && n < chans.size() && chans[n].live && write_channel_token(chans[n].write_fd, token);
}

// P4 of a kArmed push_common: the CQ's completion channel gets its token.
template <typename Cqs, typename Chans>
void armed_push(const Peer& peer, bool own, uint32_t cq_index, layout::CqEntry* e, const layout::Cqe& cqe,
                const Cqs& cqs, const Chans& chans) noexcept {
  auto write_own = [&](uint64_t token) { return write_own_token(cqs, chans, cq_index, token); };
  (void)fire_notify(peer, own, cq_index, e, cqe, write_own);
}

}  // namespace

LocalContext::Push LocalContext::push_shared_cqe(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe,
                                                 bool* fire, RingCache* cache, const cqpush::CqNote* note) noexcept {
  *fire = false;
  layout::CqEntry* e = peer.cq(cq_index);
  if (!e || e->state.load(std::memory_order_acquire) != layout::kLive) return Push::kGone;  // A1 pairs with R1
  uint64_t start = 0;
  for (unsigned i = 0;; ++i) {  // P1
    e->producers.fetch_add(1, std::memory_order_seq_cst);
    bool resizing = e->resizing.load(std::memory_order_seq_cst) != 0;
    if (!resizing && e->state.load(std::memory_order_seq_cst) == layout::kLive) break;
    e->producers.fetch_sub(1, std::memory_order_release);
    if (!resizing) return Push::kGone;
    if (!start) start = mono_ns();
    else if (mono_ns() - start > kQuiesceWaitNs) return Push::kFull;
    backoff(i);
  }
  Push r = Push::kGone;
  // P2: the geometry, read once after P1 (a resize may have changed it):
  // the view cached for exactly these values, else a freshly validated one.
  const uint64_t off = e->ring_offset, bytes = e->ring_bytes;
  const uint32_t cap = e->capacity, stride = e->slot_stride;
  Ring fresh;
  const Ring* rp = peer.ring(off, bytes, cap, stride, &fresh, cache);
  if (rp && rp->payload_size() >= sizeof cqe) {
    const Ring& ring = *rp;
    // The completion timestamp, only for CQs that asked for it (the clock
    // stays off the data path otherwise). The consumer keeps a CQ's stamps
    // monotonic in ring order (provider cq.cc).
    layout::Cqe stamped;
    const layout::Cqe* c = &cqe;
    if (e->flags & layout::kCqTimestamp) {
      stamped = cqe;
      stamped.timestamp = mono_ns();
      c = &stamped;
    }
    // Bounded retry: a CQ that stays full has overrun, as on hardware.
    r = Push::kFull;
    for (int i = 0; i < 4; ++i) {
      RingStatus st = ring.try_push_cas_with<sizeof(layout::Cqe)>([&](std::byte* payload, uint32_t pos) {
        if (note) note->note(pos);
        std::memcpy(payload, c, sizeof *c);
      });
      if (st == RingStatus::ok) {
        r = Push::kOk;
        break;
      }
      if (st != RingStatus::contended && st != RingStatus::abandoned) break;
    }
  }
  e->producers.fetch_sub(1, std::memory_order_release);  // P3
  if (r != Push::kOk) return r;
  auto own = [&](uint64_t token) { return write_own_token(cqs_, chans_, cq_index, token); };
  *fire = fire_notify(peer, &peer == &self_peer_, cq_index, e, cqe, own);  // P4
  return r;
}

// push_cqe and push_peer_cqe: the common push inline; everything else (an
// armed CQ's token, the full protocol of push_shared_cqe, an overrun's async
// event) in an out-of-line cold lambda, so the common push calls nothing.
bool LocalContext::push_cqe(uint32_t cq_index, const layout::Cqe& cqe, RingCache* cache) noexcept {
  if (cq_index >= cqs_.size() || !cqs_[cq_index].live) return false;
  layout::CqEntry* e = self_peer_.cq(cq_index);
  const Fast f = push_common(self_peer_, e, cqe, cache);
  if (f == Fast::kPushed) [[likely]]
    return true;
  return [this, cq_index, &cqe, cache, e, f]() __attribute__((noinline, cold)) {
    if (f == Fast::kArmed) {
      armed_push(self_peer_, true, cq_index, e, cqe, cqs_, chans_);
      return true;
    }
    bool fired = false;
    Push r = push_shared_cqe(self_peer_, cq_index, cqe, &fired, cache);
    if (r == Push::kOk) return true;
    // The CQ has overrun: the completion is lost and the application learns
    // it from an IBV_EVENT_CQ_ERR, once.
    if (r == Push::kFull && !(cqs_[cq_index].flags & layout::kCqIgnoreOverrun) &&
        !cqs_[cq_index].overrun_reported.exchange(true, std::memory_order_relaxed)) {
      uint32_t gen = table<layout::CqEntry>(layout_.cq_table)[cq_index].generation;
      raise_async(IBV_EVENT_CQ_ERR, async_token(AsyncKind::kCq, cq_index, gen));
    }
    return false;
  }();
}

bool LocalContext::push_peer_cqe(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe,
                                 RingCache* cache, const cqpush::CqNote* note) noexcept {
  layout::CqEntry* e = peer.cq(cq_index);
  const Fast f = push_common(peer, e, cqe, cache, note);
  if (f == Fast::kPushed) [[likely]]
    return true;
  return push_peer_cqe_rest(peer, cq_index, cqe, cache, e, static_cast<int>(f), note);
}

// What push_peer_cqe does beyond the common push (cq_push.h push_common
// answered f, not kPushed, for entry e of peer's CQ cq_index): the armed
// CQ's token, or the full protocol of push_shared_cqe and an overrun's event.
bool LocalContext::push_peer_cqe_rest(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe, RingCache* cache,
                                      layout::CqEntry* e, int f, const cqpush::CqNote* note) noexcept {
  if (static_cast<Fast>(f) == Fast::kArmed) {
    armed_push(peer, &peer == &self_peer_, cq_index, e, cqe, cqs_, chans_);
    return true;
  }
  bool fired = false;
  Push r = push_shared_cqe(peer, cq_index, cqe, &fired, cache, note);
  if (r == Push::kOk) return true;
  if (r == Push::kFull && e && !(e->flags & layout::kCqIgnoreOverrun))
    const_cast<Peer&>(peer).raise_async(IBV_EVENT_CQ_ERR, async_token(AsyncKind::kCq, cq_index, e->generation));
  return false;
}

int LocalContext::poll_cq(const CqInfo& cq, int n, ibv_wc* out) noexcept {
  if (n <= 0) return 0;
  // Our own send completions first (no order between a CQ's send and
  // receive completions is promised), then the shared ring's.
  const int own = cq.local && cq.local->ready->load(std::memory_order_relaxed) ? cq.local->take(n, out) : 0;
  if (own == n) return own;
  uint32_t pos = cq.ring.consumer_position();  // release_sc keeps it current
  RingSlotHeader* slot = cq.ring.slot_header(pos);
  int got = own + poll_cq_wc(cq, &pos, &slot, n - own, out + own);
  // An error completion of ours waits behind what the ring held (local_cq.h take).
  if (got < n && cq.local && cq.local->error_next()) got += cq.local->take_any(n - got, out + got, *cq.local->ready);
  return got;
}

void LocalContext::own_send_armed(uint32_t cq_index, uint32_t status) noexcept {
  if (cq_index >= cqs_.size()) return;
  layout::Cqe c{};
  c.status = status;
  layout::CqEntry* e = table<layout::CqEntry>(layout_.cq_table) + cq_index;
  auto own = [&](uint64_t token) { return write_own_token(cqs_, chans_, cq_index, token); };
  (void)fire_notify(self_peer_, true, cq_index, e, c, own);  // P4, as for a push into the shared ring
}

void LocalContext::own_send_overrun(uint32_t cq_index) noexcept {
  // As push_cqe's: the completion is lost and the application learns it
  // from an IBV_EVENT_CQ_ERR, once.
  if (cq_index >= cqs_.size() || (cqs_[cq_index].flags & layout::kCqIgnoreOverrun) ||
      cqs_[cq_index].overrun_reported.exchange(true, std::memory_order_relaxed))
    return;
  const uint32_t gen = table<layout::CqEntry>(layout_.cq_table)[cq_index].generation;
  raise_async(IBV_EVENT_CQ_ERR, async_token(AsyncKind::kCq, cq_index, gen));
}

// A producer that died between reserving a CQ slot and publishing it would
// stall the CQ forever: every later completion waits behind that slot. Once
// in a while an empty poll looks whether the head slot is reserved but
// unpublished, and after it stayed so for kStallNs gives it up (Ring::
// skip_unpublished_sc; a producer that was merely slow pushes again). The
// time counts from the first look that found the slot reserved, not from
// the first that found the ring empty at that position: a producer that
// reserves the slot after the ring was idle for a while is not taken for
// dead right away. A slot given up is remembered (CqState::skipped).
//
// Whether the slot is reserved is told by producer_pos, the line every
// producer's reservation writes: a look reads it only when the consumer is
// still at the position the previous look saw. While completions come in,
// the position moves between looks and no look touches that line; reading
// it took the line from the producer once per look, and a 64 KiB SEND
// reserves its slot before it copies (send_leaf), so the look mostly found
// it reserved and read producer_pos: ~90 ns more per push (its load and
// CAS each waited for the line; rdtsc, near).
void LocalContext::skip_dead_push(const CqInfo& cq, bool every) noexcept {
  constexpr uint64_t kStallNs = 2'000'000'000ull;
  if (cq.index >= cqs_.size()) return;
  CqState& st = cqs_[cq.index];
  // ibv_poll_cq calls this once in 1024 polls; ibv_start_poll locks one
  // empty poll in 64 (nothing_ready), of which 1 in 16 looks.
  if (!every && (++st.empty_polls & 15) != 0) return;
  Ring ring = cq.ring;
  const uint32_t pos = ring.consumer_position();
  if (!st.looked || st.look_pos != pos) {
    st.looked = true;
    st.look_pos = pos;
    st.stall_since_ns = 0;  // moved on since the last look: nothing stalls yet
    return;
  }
  if (!ring.head_reserved_unpublished()) {
    st.stall_since_ns = 0;  // empty (or published): nothing stalls
    return;
  }
  const uint64_t now = mono_ns();
  if (!st.stall_since_ns) {  // (a timer running is one for look_pos: a move resets it)
    st.stall_since_ns = now;
    return;
  }
  if (now - st.stall_since_ns < kStallNs) return;
  st.stall_since_ns = 0;
  std::atomic<uint64_t>* noted = nullptr;
  const bool skipped = ring.skip_unpublished_sc([&](uint32_t p) {
    // Release: whoever sees the slot given up (its seq, acquire) sees this.
    noted = &st.skipped[st.skipped_next++ % CqState::kSkipped];
    noted->store(uint64_t{1} << 32 | p, std::memory_order_release);
  });
  if (!skipped && noted) noted->store(0, std::memory_order_relaxed);  // published meanwhile: not given up
}

}  // namespace shmrdma
