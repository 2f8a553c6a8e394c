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
// shared-memory hardening): a producer claims position pos when pos is less
// than a capacity ahead of the consumer's `head` (free), writes the
// completion (the first 32 bytes of its ibv_wc, in two 16-byte stores), then
// the slot's seq = pos + 1 (release: published). The consumer (the CQ's
// poller, under the provider's poll_lock) reads the slot at `head` when seq
// is head + 1 (acquire), copies those 32 bytes and zeroes the other 16 of
// the ibv_wc it hands out, and, after the last slot it takes in a poll,
// stores head (release: those slots are free for the next lap). Full: the
// completion is lost and the CQ has overrun (IBV_EVENT_CQ_ERR, as for the
// shared ring).
//
// Why this shape: a signaled post's completion is three stores, where the
// whole ibv_wc in the slot took five with its seq, and the consumer frees a
// poll's slots with its one store of head instead of one per slot. Stores
// are what a post waits on when the line its data goes to is contended (the
// top of write_leaf_locked, transport_post.cc), and UCX signals every short
// put. Producers read head with acquire (pairs with the consumer's release:
// its reads of a slot happen before the producer that reuses it writes).
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

// One completion (trusted: ours). Every completion of the FIFO is
// {wr_id, status, opcode, byte_len, qp_num}, the other fields of its ibv_wc 0:
// the slot keeps the first 32 bytes of that ibv_wc (from wr_id to qp_num).
struct alignas(64) LocalCqSlot {
  std::atomic<uint32_t> seq;  // pos + 1 once the completion for pos is published
  uint32_t pad[3];
  alignas(16) unsigned char wc[32];
};
static_assert(sizeof(LocalCqSlot) == 64 && offsetof(LocalCqSlot, wc) == 16);

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

  // Claims the next position: its slot (then put), or nullptr when the FIFO
  // is full. The caller holds its QP's sq_lock (the top of this file: one
  // producer claims with a plain store, several with reserve_multi's CAS).
  [[gnu::always_inline]] LocalCqSlot* reserve(uint32_t* pos_out) noexcept {
    if (multi_.load(std::memory_order_relaxed)) [[unlikely]]
      return reserve_multi(pos_out);
    LocalCqSlot* s = free_at_tail(pos_out);
    if (s) [[likely]]
      tail_.store(*pos_out + 1, std::memory_order_relaxed);
    return s;
  }
  // reserve in two steps, for the one producer (multi() false, under its
  // sq_lock): whether the slot at tail is free (false: several producers,
  // or full); then claim_single claims that slot (still the one at tail,
  // still free: no other producer), once nothing can fail.
  [[gnu::always_inline]] bool room_single() const noexcept {
    return !multi_.load(std::memory_order_relaxed) && free_for(tail_.load(std::memory_order_relaxed));
  }
  [[gnu::always_inline]] LocalCqSlot* claim_single(uint32_t* pos_out) noexcept {
    const uint32_t pos = tail_.load(std::memory_order_relaxed);
    tail_.store(pos + 1, std::memory_order_relaxed);
    *pos_out = pos;
    return slots_ + (pos & mask_);
  }
  // The completion for pos (status: an ibv_wc_status, opcode: an
  // ibv_wc_opcode) into its claimed slot s and published: three stores,
  // then `ready` set.
  [[gnu::always_inline]] void put(LocalCqSlot* s, uint32_t pos, uint64_t wr_id, uint32_t status, uint32_t opcode,
                                  uint32_t byte_len, uint32_t qp_num) noexcept {
    static_assert(sizeof(ibv_wc) == 48 && offsetof(ibv_wc, status) == 8 && offsetof(ibv_wc, opcode) == 12 &&
                  offsetof(ibv_wc, vendor_err) == 16 && offsetof(ibv_wc, byte_len) == 20 &&
                  offsetof(ibv_wc, imm_data) == 24 && offsetof(ibv_wc, qp_num) == 28 &&
                  __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
    const uint64_t w1 = uint64_t{opcode} << 32 | status, w2 = uint64_t{byte_len} << 32,
                   w3 = uint64_t{qp_num} << 32;
    _mm_store_si128(reinterpret_cast<__m128i*>(s->wc),
                    _mm_set_epi64x(static_cast<int64_t>(w1), static_cast<int64_t>(wr_id)));
    _mm_store_si128(reinterpret_cast<__m128i*>(s->wc + 16),
                    _mm_set_epi64x(static_cast<int64_t>(w3), static_cast<int64_t>(w2)));
    s->seq.store(pos + 1, std::memory_order_release);
    ready->store(1, std::memory_order_release);
  }

  // Whether position pos is free: less than a capacity ahead of the
  // consumer's head.
  [[gnu::always_inline]] bool free_for(uint32_t pos) const noexcept {
    return pos - head_.load(std::memory_order_acquire) <= mask_;  // pairs with the consumer's release
  }
  // The one producer's slot at tail, unclaimed: free, or nullptr (full).
  [[gnu::always_inline]] LocalCqSlot* free_at_tail(uint32_t* pos_out) noexcept {
    const uint32_t pos = tail_.load(std::memory_order_relaxed);
    if (!free_for(pos)) [[unlikely]]
      return nullptr;
    *pos_out = pos;
    return slots_ + (pos & mask_);
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
    const uint32_t pos = head_.load(std::memory_order_relaxed);  // ours: the one consumer
    const LocalCqSlot* s = slots_ + (pos & mask_);
    if (s->seq.load(std::memory_order_acquire) != pos + 1) [[unlikely]] {
      settle(s, pos, rdy);
      return 0;
    }
    if (status(s) != IBV_WC_SUCCESS) [[unlikely]]
      return -1;
    copy_out(wc, s);
    head_.store(pos + 1, std::memory_order_release);  // the slot is free
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
    const uint32_t pos = head_.load(std::memory_order_relaxed);
    const LocalCqSlot* s = slots_ + (pos & mask_);
    return s->seq.load(std::memory_order_acquire) == pos + 1 && status(s) != IBV_WC_SUCCESS;
  }
  int take(int n, ibv_wc* wc) noexcept { return take(n, wc, *ready); }

  // --------------------------------------------- with producers stopped

  // Completions held. Only with no producer running (every QP that
  // completes here has its sq_lock held) and no consumer.
  uint32_t held() const noexcept {
    return tail_.load(std::memory_order_relaxed) - head_.load(std::memory_order_relaxed);
  }
  uint32_t capacity() const noexcept { return mask_ + 1; }

  // Moves what is held, in order, into a new slot array of `capacity`
  // (>= held()). Same conditions as held(). false: no memory (unchanged).
  bool resize(uint32_t capacity) noexcept {
    LocalCqSlot* fresh = alloc_slots(capacity);
    if (!fresh) return false;
    const uint32_t n = held(), head = head_.load(std::memory_order_relaxed);
    for (uint32_t k = 0; k < n; ++k) {
      std::memcpy(fresh[k].wc, slots_[(head + k) & mask_].wc, sizeof fresh[k].wc);
      fresh[k].seq.store(k + 1, std::memory_order_relaxed);
    }
    std::free(slots_);
    slots_ = fresh;
    mask_ = capacity - 1;
    head_.store(0, std::memory_order_relaxed);
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
  // A published slot's status (ibv_wc's, at byte 8).
  static uint32_t status(const LocalCqSlot* s) noexcept {
    uint32_t v;
    std::memcpy(&v, s->wc + 8, sizeof v);
    return v;
  }
  // The completion of a published slot as ibv_poll_cq hands it out: its 32
  // bytes, then 16 zero bytes.
  [[gnu::always_inline]] static void copy_out(ibv_wc* wc, const LocalCqSlot* s) noexcept {
    auto* d = reinterpret_cast<char*>(wc);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_load_si128(reinterpret_cast<const __m128i*>(s->wc)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(s->wc + 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), _mm_setzero_si128());
  }

  // The next slot (at pos) was unpublished: clear `ready`, then look again
  // (the top of this file says why no completion is missed).
  static void settle(const LocalCqSlot* s, uint32_t pos, std::atomic<uint32_t>& rdy) noexcept {
    rdy.exchange(0, std::memory_order_acq_rel);
    if (s->seq.load(std::memory_order_acquire) == pos + 1) rdy.store(1, std::memory_order_relaxed);
  }

  int take_loop(int n, ibv_wc* wc, std::atomic<uint32_t>& rdy, bool stop_at_error) noexcept {
    const uint32_t start = head_.load(std::memory_order_relaxed);
    uint32_t pos = start;
    int got = 0;
    for (;;) {
      const LocalCqSlot* s = slots_ + (pos & mask_);
      if (s->seq.load(std::memory_order_acquire) != pos + 1) {
        settle(s, pos, rdy);
        break;
      }
      if (stop_at_error && status(s) != IBV_WC_SUCCESS) break;
      copy_out(&wc[got], s);
      ++pos;
      if (++got == n) break;
    }
    if (pos != start) head_.store(pos, std::memory_order_release);  // the slots taken are free
    return got;
  }

  // reserve with several producers: a failed CAS means another producer
  // claimed, and `pos` is refreshed. Inline, as the one claim was: a call
  // here would cost the posts that complete inline (post_fast_in) saved
  // registers on every call, signaled or not.
  [[gnu::always_inline]] LocalCqSlot* reserve_multi(uint32_t* pos_out) noexcept {
    uint32_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      if (!free_for(pos)) {
        // Full, unless another producer claimed pos meanwhile (then the
        // head may have passed it: look at the tail now).
        const uint32_t now = tail_.load(std::memory_order_relaxed);
        if (now == pos) return nullptr;
        pos = now;
        continue;
      }
      // A failed CAS refreshes pos (another producer claimed it).
      if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed, std::memory_order_relaxed)) {
        *pos_out = pos;
        return slots_ + (pos & mask_);
      }
    }
  }

  LocalCq() = default;
  static LocalCqSlot* alloc_slots(uint32_t capacity) noexcept {
    void* p = std::aligned_alloc(alignof(LocalCqSlot), std::size_t{capacity} * sizeof(LocalCqSlot));
    if (!p) return nullptr;
    auto* s = static_cast<LocalCqSlot*>(p);
    for (uint32_t k = 0; k < capacity; ++k) new (&s[k]) LocalCqSlot{};  // seq 0: unpublished (pos + 1 > 0)
    return s;
  }

  // Producers' line: the claim counter, the claim's mode (the top of this
  // file) and the geometry they read.
  alignas(64) std::atomic<uint32_t> tail_{0};
  std::atomic<uint32_t> multi_{0};  // 1: several producers (CAS); see set_multi
  uint32_t mask_ = 0;
  LocalCqSlot* slots_ = nullptr;
  // The consumer's: the next position to take (stored, release, after a
  // poll's last take: every slot before it is free).
  alignas(64) std::atomic<uint32_t> head_{0};
};

}  // namespace shmrdma
