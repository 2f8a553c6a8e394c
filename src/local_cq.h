// Our own send completions: a private FIFO per CQ, in process memory.
//
// Every send completion of our QPs (success, error, FLUSH_ERR, RETRY_EXC_ERR,
// UD, ...) is made by this process: the initiator executes every WQE, and
// flushes run here. Only this process polls the CQ. So send completions need
// no shared-memory ring and none of its multi-producer protocol against
// peers (CqEntry's P1-P4 in cq.cc); they go here, and ibv_poll_cq hands them
// out from here and from the shared ring (receive completions, pushed by
// peers and by our own receive flushes).
//
// Producers: the QPs that can call `reserve` here, those whose send CQ this
// is (complete_send: send_local == this) or whose receive CQ it is
// (flush_own_recv's receive flushes: recv_cq == the CQ's index), each always
// under its own sq_lock, so one QP's completions enter in the order they
// were made. The context keeps them in `producers` (under its mu_: create_qp
// adds, destroy_qp removes; nothing else sets send_local or recv_cq). A
// bounded queue of sequenced slots (the scheme of ring.h without its
// shared-memory hardening): a producer claims position pos when its slot's
// seq reads pos (free for pos), writes the ibv_wc, then stores seq = pos + 1
// (release: published). The consumer (the CQ's poller, under the provider's
// poll_lock) reads the slot at `head` when seq == head + 1 (acquire), copies
// the ibv_wc and stores seq = head + capacity (release: free for the next
// lap). Full (the slot still holds last lap's item): the completion is lost
// and the CQ has overrun (IBV_EVENT_CQ_ERR, as for the shared ring).
//
// The claim. With one producer (the usual CQ: one QP sends into it) `tail`
// has one writer, and the claim is a plain load and store; with more (QPs of
// several threads share the CQ) it is a CAS. `multi_` says which; only
// producers read it, each under its sq_lock, and it changes only under the
// context's mu_ (LocalContext::own_producers_changed):
//  - one -> two, in create_qp: multi_ = 1 is stored while the existing
//    producer's sq_lock is held. That producer's next reserve takes the
//    lock after (acquire) and sees it; its last plain store of tail
//    happened before our unlock, so before the new QP's first reserve (the
//    new QP is not handed to the application yet: it cannot post before
//    create_qp returns). From then on every claim is a CAS.
//  - two -> one, in destroy_qp: the leaving QP ran its last reserve before
//    destroy_qp took its sq_lock (and it is no longer in live_qps_, so
//    progress_all cannot run it again); multi_ = 0 is stored under the
//    remaining producer's sq_lock, so that producer's next (plain) claim
//    happens after every CAS of the other and reads the latest tail.
//  - none -> one: nobody claims; the new QP is not yet visible.
// So while multi_ is 0 exactly one QP can call reserve, always under the
// same lock, and its load and store of tail are never interleaved with
// another claim.
//
// Arming without a fence in the producer (complete_send, flush_own_recv):
// after publishing, the producer reads CqEntry::notify behind only a
// compiler barrier (no seq_cst fence: the one locked instruction that waited
// for the store buffer, which holds the WRITE's store, to drain). arm_cq
// pays instead: after storing notify (and its fence, for peers' pushes) it
// takes and drops the sq_lock of every producer (under mu_, so the set does
// not change meanwhile; lock order mu_ then sq_lock, as resize_cq). For each
// producer critical section that publishes a completion, either arm_cq's
// lock comes after its unlock in the lock's order: then the publish
// happens-before arm_cq returns, and the poll the application makes after
// arming sees it; or arm_cq's unlock comes before its lock: then arm_cq's
// notify store happens-before the producer's notify load, which sees the
// arming (or a later value: someone fired, or re-armed) and fires. A QP
// created after arm_cq released mu_ takes mu_ after it, so the arming
// happens-before all its completions; a QP destroyed before arm_cq took mu_
// finished its completions before. Peers' pushes into the shared ring keep
// P4's fence, and arm_cq its fence for them.
//
// `ready` (the provider's Cq::local_ready, a word the empty poll already
// tests together with the context's qps_pending_) says "maybe non-empty":
// a producer stores 1 after it published; the consumer, having found the
// next slot unpublished, exchanges it to 0 and looks at the slot again. The
// exchange reads the latest 1 stored (an RMW reads the last value in the
// modification order): when that came from a producer whose publication it
// did not see yet, it synchronizes with that producer's release, so the
// look after it sees the slot published and sets the word back; a producer
// that stores 1 later leaves it 1. So the word is never 0 while a published
// completion waits: the empty poll, which reads only this word, misses none.
#pragma once

#include <emmintrin.h>
#include <infiniband/verbs.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "layout.h"

namespace shmrdma {

struct Qp;

struct alignas(64) LocalCqSlot {
  std::atomic<uint32_t> seq;  // pos: free for pos; pos + 1: published for pos
  uint32_t pad;
  ibv_wc wc;  // the completion, as ibv_poll_cq hands it out (trusted: ours)
};
static_assert(sizeof(LocalCqSlot) == 64 && offsetof(LocalCqSlot, wc) == 8);

class LocalCq {
 public:
  // capacity: a power of two >= 2 (Ring::capacity_for). nullptr: no memory.
  static LocalCq* create(uint32_t capacity, layout::CqEntry* entry) noexcept {
    auto* l = new (std::nothrow) LocalCq;
    if (!l) return nullptr;
    l->slots_ = alloc_slots(capacity);
    if (!l->slots_) {
      delete l;
      return nullptr;
    }
    l->mask_ = capacity - 1;
    l->entry = entry;
    return l;
  }
  static void destroy(LocalCq* l) noexcept {
    if (!l) return;
    std::free(l->slots_);
    delete l;
  }

  // ---------------------------------------------------------- producers

  // Claims the next position: its slot (write slot->wc, then publish), or
  // nullptr when the FIFO is full. The caller holds its QP's sq_lock (the
  // top of this file: one producer claims with a plain store, several with
  // reserve_multi's CAS).
  [[gnu::always_inline]] LocalCqSlot* reserve(uint32_t* pos_out) noexcept {
    if (multi_.load(std::memory_order_relaxed)) [[unlikely]]
      return reserve_multi(pos_out);
    LocalCqSlot* s = free_at_tail(pos_out);
    if (s) [[likely]]
      tail_.store(*pos_out + 1, std::memory_order_relaxed);
    return s;
  }
  // reserve in two steps, for the one producer (multi() false, under its
  // sq_lock): the slot at tail when it is free, not yet claimed (nullptr:
  // several producers, or full); then claim_single claims that slot (still
  // the one at tail, still free: no other producer), once nothing can fail.
  [[gnu::always_inline]] LocalCqSlot* peek_single(uint32_t* pos_out) noexcept {
    if (multi_.load(std::memory_order_relaxed)) [[unlikely]]
      return nullptr;
    return free_at_tail(pos_out);
  }
  [[gnu::always_inline]] LocalCqSlot* claim_single(uint32_t* pos_out) noexcept {
    const uint32_t pos = tail_.load(std::memory_order_relaxed);
    tail_.store(pos + 1, std::memory_order_relaxed);
    *pos_out = pos;
    return slots_ + (pos & mask_);
  }
  // A send completion into slot s (opcode: an ibv_wc_opcode), every other
  // field 0, in four stores.
  [[gnu::always_inline]] static void fill(LocalCqSlot* s, uint64_t wr_id, uint32_t status, uint32_t opcode,
                                          uint32_t byte_len, uint32_t qp_num) noexcept {
    static_assert(sizeof(ibv_wc) == 48 && offsetof(ibv_wc, status) == 8 && offsetof(ibv_wc, opcode) == 12 &&
                  offsetof(ibv_wc, vendor_err) == 16 && offsetof(ibv_wc, byte_len) == 20 &&
                  offsetof(ibv_wc, qp_num) == 28 && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
    auto* d = reinterpret_cast<char*>(&s->wc);
    const uint64_t w1 = uint64_t{opcode} << 32 | status, w2 = uint64_t{byte_len} << 32,
                   w3 = uint64_t{qp_num} << 32;
    __builtin_memcpy(d, &wr_id, 8);
    // Bytes 8-23 and 32-47 in one 16-byte store each: a success's status,
    // and a SEND's opcode and byte_len, are 0, so the common completion
    // writes one zero register twice.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 8),
                     _mm_set_epi64x(static_cast<int64_t>(w2), static_cast<int64_t>(w1)));
    __builtin_memcpy(d + 24, &w3, 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), _mm_setzero_si128());
  }
  [[gnu::always_inline]] void publish(LocalCqSlot* s, uint32_t pos) noexcept {
    s->seq.store(pos + 1, std::memory_order_release);
    ready->store(1, std::memory_order_release);
  }

  // The one producer's slot at tail, unclaimed: free (seq == pos; pairs
  // with the consumer's release), or nullptr when it still holds last lap's
  // item (full).
  [[gnu::always_inline]] LocalCqSlot* free_at_tail(uint32_t* pos_out) noexcept {
    const uint32_t pos = tail_.load(std::memory_order_relaxed);
    LocalCqSlot* s = slots_ + (pos & mask_);
    if (s->seq.load(std::memory_order_acquire) != pos) [[unlikely]]
      return nullptr;
    *pos_out = pos;
    return s;
  }

  // ------------------------------------------------------- producer set

  // The QPs that can reserve here (the top of this file), each once; under
  // the context's mu_ (LocalContext::own_producers_changed keeps the claim's
  // mode in step with it).
  std::vector<Qp*> producers;
  // The claim's mode: several producers (CAS) or one. Stored under mu_ and
  // under the sq_lock of the one producer that may be running (the top of
  // this file).
  void set_multi(bool multi) noexcept { multi_.store(multi ? 1 : 0, std::memory_order_relaxed); }
  bool multi() const noexcept { return multi_.load(std::memory_order_relaxed) != 0; }

  // ----------------------------------------------------------- consumer

  // Takes up to n (>= 1) completions into wc; the caller is the single
  // consumer (it holds the CQ's poll lock). When it finds the next slot
  // unpublished it clears `ready` (*this->ready, passed by the provider,
  // which has it at hand) and looks again (see the top of this file); a take
  // that stops at n leaves it set, so the poll that finds the FIFO empty
  // clears it (one busier empty poll after a burst, none per completion).
  //
  // The first completion is taken in straight-line code (the usual poll
  // asks for one, or finds one), the rest in take_rest's loop.
  //
  // take stops before an error completion: a caller hands out what the
  // shared ring holds first and then takes it with take_any. That keeps a
  // QP's receive successes already in the ring ahead of its send queue's
  // error (a QP's error state ends its successes on both queues; no success
  // of a QP may follow its error completion out of one CQ).
  [[gnu::always_inline]] int take(int n, ibv_wc* wc, std::atomic<uint32_t>& rdy) noexcept {
    if (take_first(wc, rdy) <= 0) [[unlikely]]
      return 0;
    if (n == 1) [[likely]]
      return 1;
    return 1 + take_rest(n - 1, wc + 1, rdy);
  }
  // take's first completion, in straight-line code: 1 when one was taken
  // into *wc; 0 when none was published (`ready` settled); -1 when the next
  // is an error completion (not taken; see take).
  [[gnu::always_inline]] int take_first(ibv_wc* wc, std::atomic<uint32_t>& rdy) noexcept {
    const uint32_t pos = head_;
    LocalCqSlot* s = slots_ + (pos & mask_);
    if (s->seq.load(std::memory_order_acquire) != pos + 1) [[unlikely]] {
      settle(s, pos, rdy);
      return 0;
    }
    if (s->wc.status != IBV_WC_SUCCESS) [[unlikely]]
      return -1;
    std::memcpy(wc, &s->wc, sizeof(ibv_wc));
    s->seq.store(pos + mask_ + 1, std::memory_order_release);
    head_ = pos + 1;
    return 1;
  }
  // take after its first completion: up to n (>= 1) more, stopping before
  // an error completion.
  [[gnu::noinline]] int take_rest(int n, ibv_wc* wc, std::atomic<uint32_t>& rdy) noexcept {
    return take_loop(n, wc, rdy, true);
  }
  // Up to n (>= 1), errors included (after the shared ring was looked at).
  [[gnu::noinline]] int take_any(int n, ibv_wc* wc, std::atomic<uint32_t>& rdy) noexcept {
    return take_loop(n, wc, rdy, false);
  }
  // Whether the next completion is published and an error (take stopped there).
  bool error_next() const noexcept {
    const LocalCqSlot* s = slots_ + (head_ & mask_);
    return s->seq.load(std::memory_order_acquire) == head_ + 1 && s->wc.status != IBV_WC_SUCCESS;
  }
  int take(int n, ibv_wc* wc) noexcept { return take(n, wc, *ready); }

  // --------------------------------------------- with producers stopped

  // Completions held. Only with no producer running (every QP that
  // completes here has its sq_lock held) and no consumer.
  uint32_t held() const noexcept { return tail_.load(std::memory_order_relaxed) - head_; }
  uint32_t capacity() const noexcept { return mask_ + 1; }

  // Moves what is held, in order, into a new slot array of `capacity`
  // (>= held()). Same conditions as held(). false: no memory (unchanged).
  bool resize(uint32_t capacity) noexcept {
    LocalCqSlot* fresh = alloc_slots(capacity);
    if (!fresh) return false;
    const uint32_t n = held();
    for (uint32_t k = 0; k < n; ++k) {
      const uint32_t pos = head_ + k;
      std::memcpy(&fresh[k].wc, &slots_[pos & mask_].wc, sizeof(ibv_wc));
      fresh[k].seq.store(k + 1, std::memory_order_relaxed);
    }
    std::free(slots_);
    slots_ = fresh;
    mask_ = capacity - 1;
    head_ = 0;
    tail_.store(n, std::memory_order_relaxed);
    if (n) ready->store(1, std::memory_order_release);
    return true;
  }

  // The consumer's "maybe non-empty" word: own_ready, or the provider's
  // (set before the CQ is handed out, so before any producer runs).
  std::atomic<uint32_t>* ready = &own_ready;
  std::atomic<uint32_t> own_ready{0};
  // Our CqEntry (its notify word: the arming, which peers' pushes take too).
  layout::CqEntry* entry = nullptr;

 private:
  // The next slot (at pos) was unpublished: clear `ready`, then look again
  // (the top of this file says why no completion is missed).
  static void settle(LocalCqSlot* s, uint32_t pos, std::atomic<uint32_t>& rdy) noexcept {
    rdy.exchange(0, std::memory_order_acq_rel);
    if (s->seq.load(std::memory_order_acquire) == pos + 1) rdy.store(1, std::memory_order_relaxed);
  }

  int take_loop(int n, ibv_wc* wc, std::atomic<uint32_t>& rdy, bool stop_at_error) noexcept {
    uint32_t pos = head_;
    int got = 0;
    for (;;) {
      LocalCqSlot* s = slots_ + (pos & mask_);
      if (s->seq.load(std::memory_order_acquire) != pos + 1) {
        settle(s, pos, rdy);
        break;
      }
      if (stop_at_error && s->wc.status != IBV_WC_SUCCESS) break;
      std::memcpy(&wc[got], &s->wc, sizeof(ibv_wc));
      s->seq.store(pos + mask_ + 1, std::memory_order_release);
      ++pos;
      if (++got == n) break;
    }
    head_ = pos;
    return got;
  }

  // reserve with several producers: a failed CAS means another producer
  // claimed, and `pos` is refreshed. Inline, as the one claim was: a call
  // here would cost the posts that complete inline (post_fast_in) saved
  // registers on every call, signaled or not.
  [[gnu::always_inline]] LocalCqSlot* reserve_multi(uint32_t* pos_out) noexcept {
    uint32_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      LocalCqSlot* s = slots_ + (pos & mask_);
      const int32_t d = static_cast<int32_t>(s->seq.load(std::memory_order_acquire) - pos);  // pairs with release
      if (d == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed, std::memory_order_relaxed)) {
          *pos_out = pos;
          return s;
        }
      } else if (d < 0) {
        return nullptr;  // last lap's item is still there: full
      } else {
        pos = tail_.load(std::memory_order_relaxed);  // another producer took pos
      }
    }
  }

  LocalCq() = default;
  static LocalCqSlot* alloc_slots(uint32_t capacity) noexcept {
    void* p = std::aligned_alloc(alignof(LocalCqSlot), std::size_t{capacity} * sizeof(LocalCqSlot));
    if (!p) return nullptr;
    auto* s = static_cast<LocalCqSlot*>(p);
    for (uint32_t k = 0; k < capacity; ++k) {
      new (&s[k]) LocalCqSlot{};
      s[k].seq.store(k, std::memory_order_relaxed);
    }
    return s;
  }

  // Producers' line: the claim counter, the claim's mode (the top of this
  // file) and the geometry they read.
  alignas(64) std::atomic<uint32_t> tail_{0};
  std::atomic<uint32_t> multi_{0};  // 1: several producers (CAS); see set_multi
  uint32_t mask_ = 0;
  LocalCqSlot* slots_ = nullptr;
  // The consumer's.
  alignas(64) uint32_t head_ = 0;
};

}  // namespace shmrdma
