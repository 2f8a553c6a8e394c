// Completion queues: ibv_create_cq / ibv_create_cq_ex (with the ibv_cq_ex
// poll API), resize, arming (req_notify_cq), completion events, and the
// completion channel entry points the shim calls (shim_abi.h).
#include <sched.h>

#include <climits>
#include <ctime>
#include <cerrno>
#include <new>

#include <algorithm>

#include "channel.h"
#include "provider.h"
#include "shim_abi.h"
#include "srq_inline.h"

namespace shmrdma::provider {

static_assert(kWcSuccess == IBV_WC_SUCCESS && kWcWrFlushErr == IBV_WC_WR_FLUSH_ERR && kWcOpRecv == IBV_WC_RECV,
              "the core's completion codes are libibverbs' values");

namespace {

// Points the consumer's cursor at position pos (caller holds poll_lock, or
// the CQ is not handed out yet).
void set_next(Cq* cq, uint32_t pos) {
  cq->next_slot.store(cq->info.ring.slot_header(pos), std::memory_order_relaxed);
  cq->next_pos.store(pos, std::memory_order_relaxed);
}

Cq* create_common(ibv_context* ibctx, int cqe, ibv_comp_channel* channel, int comp_vector, uint32_t flags) {
  if (cqe < 1 || static_cast<uint32_t>(cqe) > limits::kMaxCqe || comp_vector < 0 ||
      static_cast<uint32_t>(comp_vector) >= limits::kNumCompVectors) {
    errno = EINVAL;
    return nullptr;
  }
  LocalContext* core = to_ctx(ibctx)->core;
  uint32_t chan = layout::kNoIndex;
  if (channel) {
    // Only channels made by the shim for this context carry our events;
    // without the shim libibverbs cannot make one for a shmrdma context.
    chan = channel->context == ibctx ? core->channel_by_fd(channel->fd) : layout::kNoIndex;
    if (chan == layout::kNoIndex) {
      errno = EINVAL;
      return nullptr;
    }
  }
  auto* cq = new (std::nothrow) Cq{};
  if (!cq) {
    errno = ENOMEM;
    return nullptr;
  }
  if (int rc = core->create_cq(static_cast<uint32_t>(cqe), chan, flags, &cq->info)) {
    delete cq;
    errno = rc;
    return nullptr;
  }
  set_next(cq, cq->info.ring.consumer_position());
  // Before any QP can complete into it: our own send completions tell the
  // empty poll through this CQ's word.
  if (cq->info.local) cq->info.local->ready = &cq->local_ready;
  // libibverbs fills channel, cq_context, the mutex and the condition
  // variable (and counts the CQ in channel->refcnt) after we return.
  cq->vcq.cq.context = ibctx;
  cq->vcq.cq.cqe = static_cast<int>(cq->info.capacity);
  cq->vcq.cq.handle = cq->info.index;
  core->set_cq_user(cq->info.index, &cq->vcq.cq);
  return cq;
}

Cq* to_cq_ex(ibv_cq_ex* c) { return to_cq(ibv_cq_ex_to_cq(c)); }


// Whether the next completion looks ready (no lock; advisory).
[[gnu::always_inline]] inline bool next_ready(const Cq* cq) {
  return cq->next_slot.load(std::memory_order_relaxed)->seq.load(std::memory_order_relaxed) ==
         cq->next_pos.load(std::memory_order_relaxed) + 1;
}

// Whether our own send completions may wait (the CQ's private FIFO).
[[gnu::always_inline]] inline bool own_ready(const Cq* cq) {
  return cq->local_ready.load(std::memory_order_relaxed) != 0;
}

// Whether anything looks ready, in either source.
[[gnu::always_inline]] inline bool any_ready(const Cq* cq) { return own_ready(cq) || next_ready(cq); }

// Takes up to n completions from the shared ring's cursor into wc (caller
// holds poll_lock): LocalContext::poll_cq_wc, then the cursor is stored back.
[[gnu::always_inline]] inline int take_shared(Cq* cq, LocalContext* core, int n, ibv_wc* wc, uint64_t* ts = nullptr) {
  uint32_t pos = cq->next_pos.load(std::memory_order_relaxed);
  RingSlotHeader* slot = cq->next_slot.load(std::memory_order_relaxed);
  const int done = core->poll_cq_wc(cq->info, &pos, &slot, n, wc, ts);
  cq->next_slot.store(slot, std::memory_order_relaxed);
  cq->next_pos.store(pos, std::memory_order_relaxed);
  if (done > 0) core->note_taken(static_cast<uint32_t>(done));
  return done;
}

// Takes up to n completions into wc (caller holds poll_lock): our own send
// completions first, then the shared ring's. What is promised is the order
// within one work queue (InfiniBand's work-completion ordering rules are per
// work queue; ibv_poll_cq(3) defines no order between queues: it returns
// "the first num_entries" completions), and each queue's completions are all
// in one source: a send queue's in the FIFO, a receive queue's in the ring.
// So a receive that entered the CQ before a send completion may be handed
// out after it. (A CQ with timestamps has no FIFO: ts is only read
// for its completions.)
[[gnu::always_inline]] inline int take(Cq* cq, LocalContext* core, int n, ibv_wc* wc, uint64_t* ts = nullptr) {
  int own = 0;
  if (n > 0 && own_ready(cq)) [[unlikely]] {
    own = cq->info.local->take(n, wc, cq->local_ready);
    if (own > 0) core->note_taken(static_cast<uint32_t>(own));
    if (own == n) return own;
  }
  int got = own + take_shared(cq, core, n - own, wc + own, ts);
  // An error completion of ours waits behind what the ring held (local_cq.h take).
  if (got < n && own_ready(cq) && cq->info.local->error_next()) [[unlikely]] {
    const int e = cq->info.local->take_any(n - got, wc + got, cq->local_ready);
    core->note_taken(static_cast<uint32_t>(e));
    got += e;
  }
  return got;
}

// A busy poller gives its CPU away when its peer cannot be running. Two
// processes that busy-poll for each other's completions (fi_pingpong over
// "verbs;ofi_rxm", rstream, MPI) may share one CPU (two vCPUs and any other
// load): each would then spin a whole scheduler slice (~4 ms) before the
// other runs, and every round trip would cost milliseconds. So every 1024th
// poll of a CQ (a poll the fast path sends to poll_slow anyway) yields when
// no completion was taken since the previous such poll and none is ready:
// after 1024-2047 empty polls in a row, some tens of µs of spinning. A poller
// that keeps finding completions never yields, and an empty poll costs
// nothing more. With nothing else runnable the yield returns at once.
// "No completion" counts every CQ of the context: a process that keeps
// receiving on one CQ while it looks at another that rarely completes (UCX
// polls its send CQ, which completes once per 64 sends, whenever its receive
// CQ is empty) is not starved and does not yield.
[[gnu::noinline]] void yield_if_starved(Cq* cq, LocalContext* core) {
  const uint32_t taken = core->completions_taken();
  if (taken == cq->yield_taken.load(std::memory_order_relaxed) && !any_ready(cq)) sched_yield();
  cq->yield_taken.store(taken, std::memory_order_relaxed);
}

// An empty poll without the lock: true when no completion is ready. Every
// 64th empty poll still goes through the locked path, whose empty polls
// watch for a producer that died mid-push (LocalContext::skip_dead_push).
[[gnu::always_inline]] inline bool nothing_ready(Cq* cq) {
  if (any_ready(cq)) return false;
  const uint32_t n = cq->polls.load(std::memory_order_relaxed) + 1;
  cq->polls.store(n, std::memory_order_relaxed);
  if (__builtin_expect((n & 1023) == 0, 0)) yield_if_starved(cq, to_ctx(cq->vcq.cq.context)->core);
  return (n & 63) != 0;
}

// Pops the next completion into cq->cur (caller holds poll_lock), with the
// conversion of ibv_poll_cq.
bool pop_one(Cq* cq) {
  uint64_t ts = 0;
  if (take(cq, to_ctx(cq->vcq.cq.context)->core, 1, &cq->cur, &ts) != 1) return false;
  // Producers stamp when they push; two racing producers may land in the
  // ring in the other order. A completion is visible only after those
  // before it in the ring, so the later stamp bounds it: stamps stay
  // monotonic in the order they are polled.
  cq->last_ts = std::max(cq->last_ts, ts);
  cq->cur_ts = cq->last_ts;
  cq->vcq.cq_ex.wr_id = cq->cur.wr_id;
  cq->vcq.cq_ex.status = cq->cur.status;
  return true;
}

int start_poll(ibv_cq_ex* ibcq, ibv_poll_cq_attr* attr) noexcept {
  if (attr && attr->comp_mask) return EINVAL;
  Cq* cq = to_cq_ex(ibcq);
  to_ctx(ibcq->context)->core->progress_all();
  if (nothing_ready(cq)) return ENOENT;
  cq->poll_lock.lock();  // held until end_poll
  if (!pop_one(cq)) {
    cq->poll_lock.unlock();  // ENOENT: the application does not call end_poll
    return ENOENT;
  }
  return 0;
}

int next_poll(ibv_cq_ex* ibcq) noexcept { return pop_one(to_cq_ex(ibcq)) ? 0 : ENOENT; }
void end_poll(ibv_cq_ex* ibcq) noexcept { to_cq_ex(ibcq)->poll_lock.unlock(); }
ibv_wc_opcode read_opcode(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.opcode; }
uint32_t read_vendor_err(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.vendor_err; }
uint32_t read_byte_len(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.byte_len; }
__be32 read_imm_data(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.imm_data; }
uint32_t read_qp_num(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.qp_num; }
uint32_t read_src_qp(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.src_qp; }
unsigned int read_wc_flags(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.wc_flags; }
uint32_t read_slid(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.slid; }
uint8_t read_sl(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.sl; }
uint8_t read_dlid_path_bits(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur.dlid_path_bits; }
uint64_t read_completion_ts(ibv_cq_ex* c) noexcept { return to_cq_ex(c)->cur_ts; }
// The device clock is CLOCK_MONOTONIC: its wall-clock time is the stamp plus
// the current offset of CLOCK_REALTIME from it.
uint64_t read_completion_wallclock_ns(ibv_cq_ex* c) noexcept {
  timespec mono{}, real{};
  clock_gettime(CLOCK_MONOTONIC, &mono);
  clock_gettime(CLOCK_REALTIME, &real);
  const int64_t offset = (int64_t{real.tv_sec} - int64_t{mono.tv_sec}) * 1000000000 + (real.tv_nsec - mono.tv_nsec);
  return static_cast<uint64_t>(static_cast<int64_t>(to_cq_ex(c)->cur_ts) + offset);
}

// ------------------------------------------------- shim entry points

int shim_owns_context(ibv_context* ibctx) noexcept {
  // verbs_set_ops copies our data-path ops into the context: an exact test,
  // and it reads nothing private of another provider's context.
  return ibctx && ibctx->ops.poll_cq == poll_cq;
}

int shim_create_channel(ibv_context* ibctx, int* fd) noexcept {
  uint32_t number = 0;
  return to_ctx(ibctx)->core->create_channel(fd, &number);
}

int shim_destroy_channel(ibv_context* ibctx, int fd) noexcept {
  LocalContext* core = to_ctx(ibctx)->core;
  uint32_t n = core->channel_by_fd(fd);
  if (n == layout::kNoIndex) return EINVAL;
  return core->destroy_channel(n);
}

int shim_get_cq_event(ibv_comp_channel* channel, ibv_cq** out_cq, void** cq_context) noexcept {
  if (!channel || !out_cq || !cq_context) return EINVAL;
  LocalContext* core = to_ctx(channel->context)->core;
  uint32_t n = core->channel_by_fd(channel->fd);
  if (n == layout::kNoIndex) return EINVAL;
  void* user = nullptr;
  int rc = core->get_channel_event(n, channel->fd, &user, [](void* u) { cq_event(static_cast<ibv_cq*>(u)); });
  if (rc) return rc;
  auto* cq = static_cast<ibv_cq*>(user);
  *out_cq = cq;
  *cq_context = cq->cq_context;
  return 0;
}

const shmrdma_shim_ops kShimOps = {
    SHMRDMA_SHIM_ABI,         sizeof(shmrdma_shim_ops), shim_owns_context,
    shim_create_channel,      shim_destroy_channel,     shim_get_cq_event,
};

}  // namespace

ibv_cq* create_cq(ibv_context* ibctx, int cqe, ibv_comp_channel* channel, int comp_vector) noexcept {
  Cq* cq = create_common(ibctx, cqe, channel, comp_vector, 0);
  return cq ? &cq->vcq.cq : nullptr;
}

ibv_cq_ex* create_cq_ex(ibv_context* ibctx, ibv_cq_init_attr_ex* attr) noexcept {
  if (!attr) {
    errno = EINVAL;
    return nullptr;
  }
  // Completion timestamps (device clock and wall clock) are supported; CVLAN,
  // flow tags and tag matching are not, nor parent domains; UCX and others
  // fall back to ibv_create_cq on EOPNOTSUPP.
  constexpr uint64_t kTimestampFlags =
      IBV_WC_EX_WITH_COMPLETION_TIMESTAMP | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
  if ((attr->wc_flags & ~(uint64_t{IBV_WC_STANDARD_FLAGS} | kTimestampFlags)) ||
      (attr->comp_mask & ~uint32_t{IBV_CQ_INIT_ATTR_MASK_FLAGS | IBV_CQ_INIT_ATTR_MASK_PD})) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  // A parent domain (pd.cc) has no allocators here: nothing to take from it,
  // but it must be one of ours.
  if ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) &&
      (!attr->parent_domain || attr->parent_domain->context != ibctx || !to_pd(attr->parent_domain)->parent)) {
    errno = EINVAL;
    return nullptr;
  }
  uint32_t flags = 0;
  if (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) {
    if (attr->flags & ~uint32_t{IBV_CREATE_CQ_ATTR_SINGLE_THREADED | IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN}) {
      errno = EOPNOTSUPP;
      return nullptr;
    }
    if (attr->flags & IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN) flags |= layout::kCqIgnoreOverrun;
  }
  if (attr->wc_flags & kTimestampFlags) flags |= layout::kCqTimestamp;
  if (attr->cqe > static_cast<uint32_t>(INT_MAX) || attr->comp_vector > static_cast<uint32_t>(INT_MAX)) {
    errno = EINVAL;
    return nullptr;
  }
  Cq* cq = create_common(ibctx, static_cast<int>(attr->cqe), attr->channel, static_cast<int>(attr->comp_vector),
                         flags);
  if (!cq) return nullptr;
  if (attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_PD) {
    cq->parent_domain = attr->parent_domain;
    pd_hold(cq->parent_domain);
  }
  ibv_cq_ex& x = cq->vcq.cq_ex;
  x.comp_mask = 0;
  x.start_poll = start_poll;
  x.next_poll = next_poll;
  x.end_poll = end_poll;
  x.read_opcode = read_opcode;
  x.read_vendor_err = read_vendor_err;
  x.read_byte_len = read_byte_len;
  x.read_imm_data = read_imm_data;
  x.read_qp_num = read_qp_num;
  x.read_src_qp = read_src_qp;
  x.read_wc_flags = read_wc_flags;
  x.read_slid = read_slid;
  x.read_sl = read_sl;
  x.read_dlid_path_bits = read_dlid_path_bits;
  // Only what the CQ was created with can be read (ibv_create_cq_ex(3)), as
  // with mlx5: the timestamp readers of other CQs stay NULL.
  if (attr->wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP) x.read_completion_ts = read_completion_ts;
  if (attr->wc_flags & IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK)
    x.read_completion_wallclock_ns = read_completion_wallclock_ns;
  return &x;
}

int destroy_cq(ibv_cq* ibcq) noexcept {
  Cq* cq = to_cq(ibcq);
  // EBUSY while QPs/WQs use it. Afterwards no event can name it any more.
  if (int rc = to_ctx(ibcq->context)->core->destroy_cq(cq->info.index)) return rc;
  // As with the kernel: wait until every completion event handed out has
  // been acknowledged (ibv_ack_cq_events signals the condition).
  pthread_mutex_lock(&ibcq->mutex);
  while (ibcq->comp_events_completed != cq->events_reported) pthread_cond_wait(&ibcq->cond, &ibcq->mutex);
  pthread_mutex_unlock(&ibcq->mutex);
  pd_release(cq->parent_domain);
  delete cq;
  return 0;
}

namespace {

// poll_locked's general part, with poll_lock held and `got` completions
// already in wc (and the cursor moved past them): up to num_entries in all,
// or the empty poll's look for a dead producer when got is 0. Unlocks.
[[gnu::noinline]] int poll_rest(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc, int got) noexcept {
  got += take(cq, core, num_entries - got, wc + got);
  cq->poll_lock.unlock();
  return got;
}

// The poll lock the slow way: a fresh lock becomes biased to this thread,
// one biased to another thread is revoked (biased_lock.h).
[[gnu::noinline]] int poll_contended(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc) noexcept {
  cq->poll_lock.lock_biasing();
  return poll_rest(cq, core, num_entries, wc, 0);
}

// The end of a poll that took position pos's slot h and handed out `took`
// (0 or 1) completions from it into wc: the cursor past it, then the rest
// in poll_rest when more is ready and wanted (ibv_poll_cq(3) returns every
// completion available up to num_entries), else the lock goes.
[[gnu::always_inline]] inline int poll_one_done(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc,
                                                RingSlotHeader* h, uint32_t pos, int took) noexcept {
  if (took) core->note_taken(1);
  h = cq->info.ring.next_header(h, pos);
  ++pos;
  cq->next_slot.store(h, std::memory_order_relaxed);
  cq->next_pos.store(pos, std::memory_order_relaxed);
  if (num_entries > took && Ring::published_for(h, pos)) [[unlikely]]
    return poll_rest(cq, core, num_entries, wc, took);
  cq->poll_lock.unlock_owner();
  return took;
}

// poll_hit's staged CQE (take_cqe left it at position pos, slot h; its
// status, read once, is in wc): finished out of line, not taken again from
// the start in poll_rest. An SRQ SEND's bytes in its completion, the
// usual one, here (take_srq_inline); the others in take_staged, as
// poll_cq_wc takes them. It may give nothing to hand out (0): the poll goes
// on with the next.
[[gnu::noinline]] int poll_staged(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc, RingSlotHeader* h,
                                  uint32_t pos) noexcept {
  uint32_t status;
  std::memcpy(&status, &wc->status, sizeof status);
  const int took = status == layout::kSrqInlineStatus ? core->take_srq_inline(cq->info.ring, h, pos, wc)
                                                      : core->take_staged(cq->info.ring, h, pos, wc, nullptr);
  return poll_one_done(cq, core, num_entries, wc, h, pos, took);
}

// The locked part of poll_cq: something looked ready, or it is the 1024th
// poll, which also watches for a dead producer in the core. Completions go
// from their ring slots straight into the application's array. The usual
// case, one completion and then none ready, is straight-line code without
// calls (no registers to save); anything else continues in poll_rest.
[[gnu::always_inline]] inline int poll_hit(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc) noexcept {
  if (!wc) [[unlikely]] return -EINVAL;
  if (!cq->poll_lock.try_lock_owner()) [[unlikely]]
    return poll_contended(cq, core, num_entries, wc);
  uint32_t pos = cq->next_pos.load(std::memory_order_relaxed);
  RingSlotHeader* h = cq->next_slot.load(std::memory_order_relaxed);
  if (!Ring::published_for(h, pos)) [[unlikely]]
    return poll_rest(cq, core, num_entries, wc, 0);
  const Ring& ring = cq->info.ring;
  if (!core->take_cqe(ring, h, pos, wc)) [[unlikely]]  // a staged CQE
    return poll_staged(cq, core, num_entries, wc, h, pos);
  return poll_one_done(cq, core, num_entries, wc, h, pos, 1);
}

// poll_hit for our own send completions (own_ready said they may wait):
// from the private FIFO, then the shared ring when there is room left.
[[gnu::always_inline]] inline int poll_own(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc) noexcept {
  if (!wc) [[unlikely]] return -EINVAL;
  if (!cq->poll_lock.try_lock_owner()) [[unlikely]]
    return poll_contended(cq, core, num_entries, wc);
  const int got = take(cq, core, num_entries, wc);
  cq->poll_lock.unlock_owner();
  return got;
}

[[gnu::noinline]] int poll_locked(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc) noexcept {
  if (own_ready(cq)) return poll_own(cq, core, num_entries, wc);
  return poll_hit(cq, core, num_entries, wc);
}

// poll_cq when the context has work (queued sends, a peer's error report),
// our own send completions wait, or it is the 1024th poll of the CQ (the
// looks for dead peers and dead producers).
[[gnu::noinline]] int poll_slow(Cq* cq, LocalContext* core, uint32_t n, int num_entries, ibv_wc* wc) noexcept {
  core->progress_polled_slow(n);
  if ((n & 1023) == 0) yield_if_starved(cq, core);
  else if (!any_ready(cq)) return 0;
  return poll_locked(cq, core, num_entries, wc);
}

// The rest of poll_busy, with the poll lock held and `first` what
// take_first said (1: one of ours is in wc; 0: none of ours; -1: ours wait
// behind an error completion): more of ours, the shared ring's while room
// is left, then an error of ours that waited behind them. Unlocks.
[[gnu::noinline]] int poll_busy_rest(Cq* cq, LocalContext* core, int num_entries, ibv_wc* wc, int first) noexcept {
  int got = 0;
  if (first == 1) got = 1 + (num_entries > 1 ? cq->info.local->take_rest(num_entries - 1, wc + 1, cq->local_ready) : 0);
  core->note_taken(static_cast<uint32_t>(got));
  if (got < num_entries) got += take(cq, core, num_entries - got, wc + got);
  cq->poll_lock.unlock();
  return got;
}

// poll_cq when progress_idle said no: usually only because our own send
// completions wait (the context otherwise idle: progress_quiet). The usual
// case, a poll for one that finds one of ours, is straight-line code whose
// other ways out are tail calls (no registers to save), as poll_hit is for
// the shared ring; everything else goes to poll_slow or poll_busy_rest.
[[gnu::noinline]] int poll_busy(Cq* cq, LocalContext* core, uint32_t n, int num_entries, ibv_wc* wc) noexcept {
  if (!core->progress_quiet(n) || !wc || !cq->poll_lock.try_lock_owner()) [[unlikely]]
    return poll_slow(cq, core, n, num_entries, wc);
  const int first = cq->info.local->take_first(wc, cq->local_ready);
  if (first != 1 || num_entries != 1) [[unlikely]]
    return poll_busy_rest(cq, core, num_entries, wc, first);
  core->note_taken(1);
  cq->poll_lock.unlock_owner();
  return 1;
}

[[gnu::noinline]] int poll_no_entries(LocalContext* core, int num_entries) noexcept {
  if (num_entries < 0) return -EINVAL;
  core->progress_all();
  return 0;
}

}  // namespace

// The empty poll stays in this small frame (and the usual poll that finds
// one completion, poll_hit, inlined: it calls nothing either): the context's progress check
// (context.h progress_idle, spaced by the CQ's poll count) and one look at
// the next slot's sequence word. (wc is looked at only when there is
// something to write into it: NULL with a completion ready is EINVAL.)
int poll_cq(ibv_cq* ibcq, int num_entries, ibv_wc* wc) noexcept {
  LocalContext* core = to_ctx(ibcq->context)->core;
  if (__builtin_expect(num_entries <= 0, 0)) return poll_no_entries(core, num_entries);
  Cq* cq = to_cq(ibcq);
  const uint32_t n = cq->polls.load(std::memory_order_relaxed) + 1;
  cq->polls.store(n, std::memory_order_relaxed);
  if (!core->progress_idle(n, cq->local_ready)) [[unlikely]]
    return poll_busy(cq, core, n, num_entries, wc);
  if (!next_ready(cq)) return 0;
  return poll_hit(cq, core, num_entries, wc);
}

int resize_cq(ibv_cq* ibcq, int cqe) noexcept {
  if (cqe < 1 || static_cast<uint32_t>(cqe) > limits::kMaxCqe) return EINVAL;
  Cq* cq = to_cq(ibcq);
  std::lock_guard lk(cq->poll_lock);  // the ring's single consumer is us while it moves
  CqInfo info;
  if (int rc = to_ctx(ibcq->context)->core->resize_cq(cq->info.index, static_cast<uint32_t>(cqe), &info)) return rc;
  cq->info = info;
  set_next(cq, info.ring.consumer_position());
  ibcq->cqe = static_cast<int>(info.capacity);
  return 0;
}

int req_notify_cq(ibv_cq* ibcq, int solicited_only) noexcept {
  return to_ctx(ibcq->context)->core->arm_cq(to_cq(ibcq)->info.index, solicited_only != 0);
}

void cq_event(ibv_cq* ibcq) noexcept {
  pthread_mutex_lock(&ibcq->mutex);
  to_cq(ibcq)->events_reported += 1;
  pthread_mutex_unlock(&ibcq->mutex);
}

}  // namespace shmrdma::provider

// The shim's entry point (shim_abi.h): the only symbol the plugin exports
// besides what libibverbs needs.
extern "C" __attribute__((visibility("default"))) const shmrdma_shim_ops* shmrdma_shim_ops(uint32_t abi) {
  return abi == SHMRDMA_SHIM_ABI ? &shmrdma::provider::kShimOps : nullptr;
}
