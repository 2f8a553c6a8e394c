// The core of one open verbs context: its registry slot, its shared segment
// and the objects in it. Independent of libibverbs' private ABI; the provider
// translates ibv_* structs to these calls.
//
// Threading: control-path calls (create/modify/destroy) serialise on an
// internal mutex. Data-path calls (post_wq_recv, poll_cq) take no lock of
// the core's (a receive queue's posts hold the provider's lock of that
// queue: one producer at a time); the rings are lock-free.
#pragma once

#include <emmintrin.h>
#include <pthread.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "biased_lock.h"
#include "counters.h"
#include "directory.h"
#include "heap.h"
#include "layout.h"
#include "mover.h"
#include "paths.h"
#include "peer.h"
#include "qp.h"
#include "recv_queue.h"
#include "registry.h"
#include "local_cq.h"
#include "ring.h"
#include "segment.h"
#include "cq_push.h"

namespace shmrdma {

// Values of ibv_wq_state / ibv_wq_attr_mask / ibv_wc_* that the core needs,
// kept numerically identical to verbs.h (checked by static_asserts in the
// provider) so the core does not depend on libibverbs headers.
enum class WqState : uint32_t { kReset = 0, kRdy = 1, kErr = 2, kUnknown = 3 };
inline constexpr uint32_t kWqAttrState = 1u << 0;
inline constexpr uint32_t kWqAttrCurrState = 1u << 1;
inline constexpr uint32_t kWqAttrFlags = 1u << 2;
inline constexpr uint32_t kWqAttrReserved = 1u << 3;
inline constexpr uint32_t kWcSuccess = 0;
inline constexpr uint32_t kWcWrFlushErr = 5;
inline constexpr uint32_t kWcOpRecv = 1u << 7;

struct CqInfo {
  uint32_t index;
  uint32_t capacity;
  Ring ring;
  // Our own send completions (local_cq.h); nullptr for CQs with completion
  // timestamps, whose send completions stay in the shared ring (below).
  LocalCq* local = nullptr;
};

struct WqInfo {
  uint32_t index;
  uint32_t wq_num;
  uint32_t capacity;  // == max_wr handed back
  uint32_t max_sge;   // handed back
  uint32_t cq_index;
  Ring ring;
};

// A shared receive queue (srq.cc), as the provider holds it.
struct SrqInfo {
  uint32_t index;
  uint32_t srq_num;
  uint32_t capacity;  // == max_wr handed back
  uint32_t max_sge;   // handed back
  Ring ring;
};

struct MrInfo {
  uint32_t index;
  uint32_t lkey;
  uint32_t rkey;
};

// A memory window (mw.cc): its entry in the MR table and its first rkey.
struct MwInfo {
  uint32_t index;
  uint32_t rkey;
};

// Access flags (ibv_access_flags values) the core checks.
inline constexpr uint32_t kAccessLocalWrite = 1u << 0;
inline constexpr uint32_t kAccessRemoteWrite = 1u << 1;
inline constexpr uint32_t kAccessRemoteRead = 1u << 2;
inline constexpr uint32_t kAccessRemoteAtomic = 1u << 3;
inline constexpr uint32_t kAccessMwBind = 1u << 4;
inline constexpr uint32_t kAccessZeroBased = 1u << 5;
inline constexpr uint32_t kAccessOnDemand = 1u << 6;
// ibv_advise_mr's advice and flag values (providers check they match).
inline constexpr uint32_t kAdvisePrefetch = 0, kAdvisePrefetchWrite = 1, kAdvisePrefetchNoFault = 2;
inline constexpr uint32_t kAdviseFlagFlush = 1u << 0;
inline constexpr uint32_t kAccessHugetlb = 1u << 7;
inline constexpr uint32_t kAccessOptionalFirst = 1u << 20;  // IBV_ACCESS_OPTIONAL_FIRST: ignorable hints
inline constexpr uint32_t kRereg_ChangeTranslation = 1u << 0;
inline constexpr uint32_t kRereg_ChangePd = 1u << 1;
inline constexpr uint32_t kRereg_ChangeAccess = 1u << 2;

// LocalContext::cqe_to_wc moves a CQE into an ibv_wc 16 bytes at a time.
static_assert(sizeof(ibv_wc) == 48 && offsetof(ibv_wc, wr_id) == offsetof(layout::Cqe, wr_id) &&
              offsetof(ibv_wc, status) == offsetof(layout::Cqe, status) &&
              offsetof(ibv_wc, opcode) == offsetof(layout::Cqe, opcode) &&
              offsetof(ibv_wc, vendor_err) == offsetof(layout::Cqe, vendor_err) &&
              offsetof(ibv_wc, byte_len) == offsetof(layout::Cqe, byte_len) &&
              offsetof(ibv_wc, imm_data) == offsetof(layout::Cqe, imm_data) &&
              offsetof(ibv_wc, qp_num) == offsetof(layout::Cqe, qp_num) &&
              offsetof(ibv_wc, src_qp) == offsetof(layout::Cqe, src_qp) &&
              offsetof(ibv_wc, wc_flags) == offsetof(layout::Cqe, wc_flags) &&
              offsetof(ibv_wc, pkey_index) == offsetof(layout::Cqe, pkey_index) &&
              offsetof(ibv_wc, slid) == offsetof(layout::Cqe, slid) &&
              offsetof(ibv_wc, sl) == offsetof(layout::Cqe, sl) &&
              offsetof(ibv_wc, dlid_path_bits) == offsetof(layout::Cqe, dlid_path_bits) &&
              offsetof(layout::Cqe, take_tag) == 47 && sizeof(ibv_wc_status) == 4 && sizeof(ibv_wc_opcode) == 4,
              "an ibv_wc is a Cqe's first 46 bytes, field for field");

// A receive WQE as a staged receive takes it (transport_staged.cc): its
// ring position, wr_id and SGEs.
struct StashedWqe {
  uint32_t pos = 0, num_sge = 0;
  uint64_t wr_id = 0;
  layout::WireSge sge[limits::kMaxSge];
};

// How often, in ms, waiting sends are retried by a blocked
// ibv_get_cq_event and by the progress thread: SHMRDMA_RETRY_POLL_MS, 2 by
// default (cq.cc).
int retry_poll_ms() noexcept;

class LocalContext {
 public:
  // Default size of the heap that holds a context's rings. The file is
  // sparse: only pages that rings touch use memory.
  static constexpr uint64_t kDefaultHeapSize = uint64_t{512} << 20;

  // Attaches to the device's registry, registers this process and creates
  // its context segment. ENOENT when the device is not up.
  static int open(const DevicePaths& paths, uint64_t heap_size, std::unique_ptr<LocalContext>* out) noexcept;
  ~LocalContext();

  const layout::DeviceRecord& device() const noexcept { return registry_.device(); }
  // The live state of a port (1-based): `shmrdma port` may have changed it.
  uint8_t port_state(uint32_t port) const noexcept { return registry_.port_state(port); }
  Registry& registry() noexcept { return registry_; }
  const std::string& segment_path() const noexcept { return map_.path(); }

  // Protection domains.
  int create_pd(uint32_t* index) noexcept;
  int destroy_pd(uint32_t index) noexcept;  // EBUSY while objects use it

  // Completion queues. `cqe` is rounded up to a power of two.
  int create_cq(uint32_t cqe, CqInfo* out) noexcept;
  // With a completion channel (its number from create_channel, or kNoIndex)
  // and layout::CqFlags.
  int create_cq(uint32_t cqe, uint32_t channel, uint32_t flags, CqInfo* out) noexcept;
  int destroy_cq(uint32_t index) noexcept;  // EBUSY while WQs/QPs use it
  // Moves the CQ to a ring of at least `cqe` entries, keeping the queued
  // completions in order while peers keep producing (see cq.cc). EINVAL when
  // more completions are queued than the new ring holds. The caller
  // serialises this with its polls of the CQ and updates its CqInfo.
  int resize_cq(uint32_t index, uint32_t cqe, CqInfo* out) noexcept;
  // Arms the CQ: the next completion (solicited_only: the next solicited or
  // error completion) writes an event token to its channel.
  int arm_cq(uint32_t index, bool solicited_only) noexcept;

  // Completion channels (channel.h). create_channel makes the FIFO and hands
  // back its blocking read end (the caller owns it) and the channel number.
  int create_channel(int* read_fd, uint32_t* number) noexcept;
  int destroy_channel(uint32_t number) noexcept;  // EBUSY while CQs use it
  uint32_t channel_by_fd(int fd) const noexcept;  // kNoIndex if not ours
  // Reads tokens from channel `number` (read end `fd`) until one names a CQ
  // event: returns 0 with *cq_user (set_cq_user's pointer), on which
  // on_event ran under the context's lock (so a destroy_cq that follows
  // sees it). Progress tokens run progress_all; while sends wait, a blocking
  // wait wakes up regularly to retry them. Returns an errno (EAGAIN on a
  // non-blocking fd with nothing to report, EINTR, ...).
  int get_channel_event(uint32_t number, int fd, void** cq_user, void (*on_event)(void*)) noexcept;
  // After a receive was posted to `qp`: wakes an initiator that waits for
  // one (QpEntry::initiator_waiting) with a progress token.
  void wake_initiator(Qp* qp) noexcept;
  // Pops up to `n` completions into out (single consumer: the caller
  // serialises polls of one CQ), from the ring's consumer position, through
  // the provider's path (poll_cq_wc). Returns the number popped.
  int poll_cq(const CqInfo& cq, int n, ibv_wc* out) noexcept;
  // cq.cc. every: each call looks (ibv_poll_cq calls it once in 1024 polls),
  // else one in 16 (the locked empty polls of ibv_start_poll, one in 64).
  void skip_dead_push(const CqInfo& cq, bool every = false) noexcept;
  // ibv_poll_cq's path (and ibv_start_poll's, with ts): 1 to n completions
  // from the cursor *pos, *slot (the header of pos's slot: Ring::
  // slot_header), which the caller keeps privately (it is the single
  // consumer: it serialises polls of the CQ), each taken by take_cqe. The
  // cursor moves on past what was taken; after a dead producer's slot was
  // given up it is read back from the ring.
  [[gnu::always_inline]] int poll_cq_wc(const CqInfo& cq, uint32_t* pos, RingSlotHeader** slot, int n, ibv_wc* wc,
                                        uint64_t* ts = nullptr) noexcept {
    const Ring& ring = cq.ring;
    uint32_t p = *pos;
    RingSlotHeader* h = *slot;
    int got = 0;
    while (got < n) {
      if (!Ring::published_for(h, p)) {
        if (got == 0) [[unlikely]] {
          // ibv_poll_cq comes here empty once in 1024 polls and looks each
          // time; ibv_start_poll (ts) once in 64 empty polls, looking in 1 of 16.
          skip_dead_push(cq, ts == nullptr);
          p = ring.consumer_position();
          h = ring.slot_header(p);
        }
        break;
      }
      // (A staged CQE may give nothing to hand out: the loop goes on.)
      int took = take_cqe(ring, h, p, &wc[got], ts);
      if (!took) [[unlikely]]
        took = take_staged(ring, h, p, &wc[got], ts);
      got += took;
      h = ring.next_header(h, p);
      ++p;
    }
    *pos = p;
    *slot = h;
    return got;
  }
  // Takes position p's slot h, found published for p (Ring::published_for):
  // converts its CQE into *w (cqe_to_wc: every shared byte read once; *ts
  // its timestamp), prefetches a receive's buffer, and gives the slot back
  // (Ring::release_sc). The single consumer's, like poll_cq_wc.
  // A staged CQE (layout.h StagedCqe, told by its status) is left as it is
  // (false): take_staged takes it, out of line, so that the common path
  // makes no call.
  [[gnu::always_inline]] bool take_cqe(const Ring& ring, RingSlotHeader* h, uint32_t p, ibv_wc* w,
                                       uint64_t* ts = nullptr) noexcept {
    const auto* payload = reinterpret_cast<const std::byte*>(h) + kRingSlotHeaderBytes;
    cqe_to_wc(payload, w);
    static_assert(offsetof(layout::Cqe, timestamp) == 6 * 8 && offsetof(layout::Cqe, buf_hint) == 6 * 8);
    const auto* w6 = reinterpret_cast<const uint64_t*>(payload) + 6;
    if (ts) *ts = __atomic_load_n(w6, __ATOMIC_RELAXED);
    // The status, from the private copy, to a valid ibv_wc_status (read as
    // a number: it is no valid enum value yet).
    uint32_t status;
    std::memcpy(&status, &w->status, sizeof status);
    static_assert(layout::kStagedStatus > IBV_WC_TM_RNDV_INCOMPLETE &&
                  layout::kSrqInlineStatus > IBV_WC_TM_RNDV_INCOMPLETE);
    if (status > IBV_WC_TM_RNDV_INCOMPLETE) [[unlikely]] {
      if (status == layout::kStagedStatus || status == layout::kSrqInlineStatus) return false;
      w->status = IBV_WC_GENERAL_ERR;
    }
    // A receive's buf_hint: the line the initiator wrote starts back now
    // (in a CQ with timestamps a stamp is prefetched in vain: a prefetch
    // never faults).
    if ((w->opcode & IBV_WC_RECV) && w->status != IBV_WC_WR_FLUSH_ERR) [[unlikely]] {
      if (const uint64_t hint = __atomic_load_n(w6, __ATOMIC_RELAXED))
        __builtin_prefetch(reinterpret_cast<const void*>(hint));
    }
    ring.release_sc(h, p);
    return true;
  }
  // The staged CQE that take_cqe left at position p's slot h (its status,
  // read once, is in *w): finished into *w (finish_staged, or
  // finish_srq_inline for an SrqInlineCqe), and the slot given back. 1, or 0
  // when it gives nothing to hand out.
  // (transport_staged.cc: out of line, so that the common path makes no call.)
  [[gnu::noinline]] int take_staged(const Ring& ring, RingSlotHeader* h, uint32_t p, ibv_wc* w,
                                    uint64_t* ts) noexcept;
  // take_staged's for an SrqInlineCqe, inline (srq_inline.h): the
  // provider's poll takes the usual staged CQE of an SRQ without a call.
  [[gnu::always_inline]] inline int take_srq_inline(const Ring& ring, RingSlotHeader* h, uint32_t p,
                                                    ibv_wc* w) noexcept;
  // One CQE from its ring slot (untrusted: every byte is read once, in
  // three 16-byte loads) into an ibv_wc, whose first 46 bytes have the
  // Cqe's layout: each 16 bytes are masked in their register (opcode to 8
  // bits, QP numbers to 24, wc_flags to the flags that exist, the SL to 4
  // bits, the CQE's flags byte cleared) and stored; the last byte, padding in
  // an ibv_wc, keeps the CQE's take_tag byte (a StagedCqe's kind: take_staged
  // reads it there). The caller then clamps the status, a private copy by
  // now (take_cqe).
  static void cqe_to_wc(const std::byte* payload, ibv_wc* w) noexcept {
    constexpr uint32_t kFlags = IBV_WC_GRH | IBV_WC_WITH_IMM | IBV_WC_IP_CSUM_OK | IBV_WC_WITH_INV |
                                IBV_WC_TM_SYNC_REQ | IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID;
    constexpr int kAll = -1;
    // _mm_set_epi32 takes the 32-bit lanes from the highest to the lowest.
    const __m128i m0 = _mm_set_epi32(0xff, kAll, kAll, kAll);                     // wr_id, status, opcode
    const __m128i m1 = _mm_set_epi32(limits::kQpnMask, kAll, kAll, kAll);         // vendor_err .. qp_num
    const __m128i m2 = _mm_set_epi32(static_cast<int>(0xff00ff0fu), kAll, kFlags,
                                     limits::kQpnMask);  // src_qp .. dlid_path_bits, (flags), take_tag
    const auto* in = reinterpret_cast<const __m128i*>(payload);
    auto* out = reinterpret_cast<__m128i*>(w);
    _mm_storeu_si128(out, _mm_and_si128(_mm_loadu_si128(in), m0));
    _mm_storeu_si128(out + 1, _mm_and_si128(_mm_loadu_si128(in + 1), m1));
    _mm_storeu_si128(out + 2, _mm_and_si128(_mm_loadu_si128(in + 2), m2));
    // What follows reads the copy from *w (two compares with memory
    // operands) rather than picking the fields out of the registers.
    asm("" : "+m"(*w));
  }
  static constexpr std::size_t kWcTakeTag = 47;  // cqe_to_wc: Cqe::take_tag (a StagedCqe's kind) in ibv_wc's padding
  static_assert(offsetof(ibv_wc, dlid_path_bits) + 1 < kWcTakeTag && sizeof(ibv_wc) == kWcTakeTag + 1);

  // Receive work queues (IBV_WQT_RQ).
  int create_wq(uint32_t pd, uint32_t cq, uint32_t max_wr, uint32_t max_sge, WqInfo* out) noexcept;
  // attr_mask: kWqAttr*. Returns 0 or EINVAL (bad mask, transition, or
  // current state mismatch); *state_out receives the state after the call.
  int modify_wq(uint32_t index, uint32_t attr_mask, WqState curr, WqState next, WqState* state_out) noexcept;
  int destroy_wq(uint32_t index) noexcept;  // EBUSY while in an indirection table
  // Posts one receive. EINVAL: too many SGEs or WQ in RESET; ENOMEM: full.
  // The caller holds the lock every post to this WQ takes (the provider's
  // Wq::post_lock), so the ring's position moves with a plain store
  // (Ring::try_reserve_sp).
  int post_wq_recv(const WqInfo& wq, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept;
  WqState wq_state(uint32_t index) const noexcept;

  // Memory regions. addr/length: the bytes in this process; iova: the
  // address the keys are valid for (== addr unless zero-based or reg_mr_iova).
  int create_mr(uint32_t pd, uint64_t addr, uint64_t length, uint64_t iova, uint32_t access, MrInfo* out) noexcept;
  int rereg_mr(uint32_t index, uint32_t flags, uint32_t pd, uint64_t addr, uint64_t length, uint64_t iova,
               uint32_t access, MrInfo* out) noexcept;
  int destroy_mr(uint32_t index) noexcept;
  // ibv_advise_mr (mr.cc): advice kAdvise*, flags kAdviseFlagFlush; the
  // SGEs (addr, length, lkey) must name ODP MRs of `pd`.
  int advise_mr(uint32_t pd, uint32_t advice, uint32_t flags, const uint64_t* addrs, const uint32_t* lengths,
                const uint32_t* lkeys, uint32_t n) noexcept;
  // Resolves a local SGE for the data path: the key must name a live MR of
  // `pd` with `need` access covering [addr, addr+len). Returns the host
  // address or nullptr. Reads only private state. Inline: a staged
  // receive's poll (finish_staged) checks its buffers with it.
  const void* resolve_local(uint32_t lkey, uint32_t pd, uint64_t addr, uint64_t len, uint32_t need) const noexcept {
    const uint32_t i = layout::key_index(lkey);
    if (i >= mrs_.size()) return nullptr;
    const MrState& s = mrs_[i];
    if (!s.live || s.kind != layout::kKindMr || s.lkey != lkey || s.pd != pd || (s.access & need) != need)
      return nullptr;
    if (addr < s.iova || len > s.length || addr - s.iova > s.length - len) return nullptr;
    return reinterpret_cast<const void*>(s.addr + (addr - s.iova));
  }

  // Memory windows (mw.cc). type: 1 or 2 (ibv_mw_type). A window takes an
  // entry of the MR table (and counts as an MR against the device limits)
  // and holds its PD (destroy_pd: EBUSY). Binding and invalidation are send
  // WRs (IBV_WR_BIND_MW, IBV_WR_LOCAL_INV) executed in order by progress();
  // an MR with bound windows cannot be deregistered or re-registered (EBUSY).
  int create_mw(uint32_t pd, uint32_t type, MwInfo* out) noexcept;
  int destroy_mw(uint32_t index) noexcept;

  // Address handles (pd.cc): 0, EINVAL (PD, port, SL, GID index, LID 0
  // without a GRH) or ENOMEM (device-wide limit).
  int create_ah(uint32_t pd, const AddressVector& av) noexcept;
  int destroy_ah(uint32_t pd) noexcept;

  // Queue pairs (RC, UC, UD). create_qp hands back the allocated caps.
  int create_qp(const QpCreateArgs& args, Qp** out) noexcept;
  int modify_qp(Qp* qp, const QpAttr& attr, uint32_t mask) noexcept;
  void query_qp(Qp* qp, QpAttr* attr) noexcept;
  // XRC_RECV: each handle (create_qp, open_qp) is destroyed with the domain
  // index it came through; the QP goes with its last handle.
  int destroy_qp(Qp* qp, uint32_t handle_xrcd = layout::kNoIndex) noexcept;
  // Multicast membership of a UD QP: 0, EINVAL (not UD, not a multicast
  // GID/LID, not attached) or ENOMEM (device limits).
  int attach_mcast(Qp* qp, const uint8_t gid[16], uint16_t lid) noexcept;
  int detach_mcast(Qp* qp, const uint8_t gid[16], uint16_t lid) noexcept;
  // Post verbs: 0, EINVAL (state, SGE count, opcode...), ENOMEM (full).
  // ibv_post_recv's list (qp.cc): each WR checked and written into the
  // receive ring in order; the first that fails stops the list (*bad_wr).
  // The wake-up of a waiting initiator and the flush in ERR follow the
  // last WQE posted, once per call.
  int post_recv_list(Qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) noexcept;
  // Queues one send WR; progress() then executes what is queued.
  int enqueue_send(Qp* qp, const SendWr& wr) noexcept;
  // ibv_post_send's common case (transport_post.cc): one WR queued straight
  // from the ibv_send_wr and executed; kPostGeneral when the WR needs the
  // provider's resolution (UD, XRC, windows): then enqueue_send + progress.
  static constexpr int kPostGeneral = -1;
  int post_send(Qp* qp, const ibv_send_wr& wr) noexcept;
  // ibv_post_send's list: each WR through post_send, those it does not take
  // through general(arg, wr) (the provider's conversion to a SendWr and
  // enqueue_send); the first error stops the list (*bad_wr). Then progress
  // when anything was queued or failed.
  using GeneralPost = int (*)(void* arg, const ibv_send_wr* wr) noexcept;
  // ibv_post_send (the provider's post_send): a single small WRITE is
  // offered to write_leaf first (transport_post.cc), a single small SEND to
  // send_leaf (transport_staged.cc) or srq_send_leaf (transport_take.cc).
  // Each takes ibv_post_send's arguments and returns its answer, so that
  // the provider tail-calls it: no frame between ibv_post_send and the
  // leaf. What a leaf declines (Leaf::kNotHandled) goes on through
  // post_send_list (leaf_declined, out of line; its arg for general is the
  // QP's user, the ibv_qp); kArmed: done, and the send CQ is armed for this
  // completion (leaf_declined fires it).
  enum class Leaf { kDone, kArmed, kNotHandled };
  int post_send_list(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, GeneralPost general,
                     void* arg) noexcept;
  [[gnu::noinline]] int write_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  // write_leaf's WRITE of more than 16 bytes (a memmove), out of line.
  [[gnu::noinline]] int write_leaf_large(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, const void* src,
                                         uint32_t len) noexcept;
  // A single RDMA READ of an RC QP (transport_post.cc).
  [[gnu::noinline]] int read_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  // A single CMP_AND_SWP or FETCH_AND_ADD of an RC QP (transport_post.cc).
  [[gnu::noinline]] int atomic_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  [[gnu::noinline]] int send_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  [[gnu::noinline]] int srq_send_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  [[gnu::noinline, gnu::cold]] int leaf_declined(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, Leaf r) noexcept;
  // ibv_post_send's list of more than one WR (the provider's post_send):
  // each WR in turn through its leaf, as the single WR takes it (a run of
  // WRs of one kind under one hold of the send lock: the *_leaf_run below,
  // the leaf alone, no fallback), until a leaf does not take one; that WR
  // and the rest go on through post_send_list. In the order posted: a leaf
  // executes its WR within the call, as post_send_list does.
  [[gnu::noinline]] int post_leaf_list(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) noexcept;
  [[gnu::noinline]] ibv_send_wr* write_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept;
  [[gnu::noinline]] ibv_send_wr* read_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept;
  [[gnu::noinline]] ibv_send_wr* atomic_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept;
  [[gnu::noinline]] ibv_send_wr* send_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept;
  [[gnu::noinline]] ibv_send_wr* srq_send_leaf_run(Qp* qp, ibv_send_wr* wr, Leaf* r) noexcept;
  // A *_leaf_run: from wr on, each WR that body (a leaf's body, answering a
  // Leaf) takes, while the next one `match`es, under one hold of qp's
  // sq_lock taken the owner's way. The WR it stopped at, by *r: kDone, the
  // first that does not match (nullptr: the list's end); kArmed, the last
  // it took, whose completion went into a send CQ armed for it; kNotHandled,
  // the first it did not take (wr itself when the lock is not ours to take
  // so).
  template <typename Match, typename Body>
  [[gnu::always_inline]] static ibv_send_wr* run_leaves(Qp* qp, ibv_send_wr* wr, Leaf* r, Match&& match,
                                                        Body&& body) noexcept {
    if (!qp->sq_lock.try_lock_owner()) {
      *r = Leaf::kNotHandled;
      return wr;
    }
    Leaf x;
    while ((x = body(*wr)) == Leaf::kDone && (wr = wr->next) && match(*wr)) {
    }
    qp->sq_lock.unlock_owner();
    *r = x;
    return wr;
  }
  // A leaf's run: locked() (the leaf's body, which answers a Leaf) under
  // qp's sq_lock taken the owner's way, with the post's bad_wr waiting in
  // qp->leaf_bad_wr; then 0, or what leaf_declined answers.
  template <typename Locked>
  [[gnu::always_inline]] int run_leaf(Qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr, Locked&& locked) noexcept {
    if (!qp->sq_lock.try_lock_owner()) return leaf_declined(qp, wr, bad_wr, Leaf::kNotHandled);
    qp->leaf_bad_wr = bad_wr;
    const Leaf r = locked();
    if (r == Leaf::kDone) [[likely]] {
      qp->sq_lock.unlock_owner();
      return 0;
    }
    ibv_send_wr** const b = qp->leaf_bad_wr;
    qp->sq_lock.unlock_owner();
    return leaf_declined(qp, wr, b, r);
  }
  // The provider's conversion that post_send_list hands what it does not
  // take (its `general`), for leaf_declined: set once, when the provider
  // opens the context.
  void set_leaf_general(GeneralPost general) noexcept { leaf_general_ = general; }
  // The post's source SGE checked against our MR table in one word
  // (MrState::fast_match: live, an MR, not on-demand, this lkey and the QP's
  // PD), then the range: its local address, or nullptr (the general path
  // checks it and reports what fails). execute_fast's and write_leaf's.
  [[gnu::always_inline]] const void* fast_source(const Qp* qp, const ibv_sge& g, uint64_t len) const noexcept {
    const uint32_t i = layout::key_index(g.lkey);
    if (i >= mr_slots_) [[unlikely]]  // mrs_.size()
      return nullptr;
    const MrState& m = mrs_[i];
    const uint64_t off = g.addr - m.iova;  // wraps (and fails) below iova: our MRs are shorter than 2^63
    if (m.fast_match != (qp->pd_match | g.lkey) || off > m.length || len > m.length - off) [[unlikely]]
      return nullptr;
    return reinterpret_cast<const void*>(m.addr + off);
  }
  // fast_source for a READ's destination, whose MR must grant local write
  // too (execute_fast_in's check).
  [[gnu::always_inline]] void* fast_dest(const Qp* qp, const ibv_sge& g, uint64_t len) const noexcept {
    const void* p = fast_source(qp, g, len);
    if (!p || !(mrs_[layout::key_index(g.lkey)].access & kAccessLocalWrite)) return nullptr;
    return const_cast<void*>(p);
  }
  // read_leaf's and atomic_leaf's shape and destination (transport_post.cc).
  [[gnu::always_inline]] inline void* read_leaf_dest(const Qp* qp, const ibv_send_wr& wr) const noexcept;
  [[gnu::always_inline]] inline void* atomic_leaf_dest(const Qp* qp, const ibv_send_wr& wr) const noexcept;
  template <bool kLarge>
  Leaf write_leaf_locked(Qp* qp, const ibv_send_wr& wr, const void* src, uint32_t len) noexcept;
  Leaf read_leaf_locked(Qp* qp, const ibv_send_wr& wr, void* dst, uint32_t len) noexcept;
  Leaf atomic_leaf_locked(Qp* qp, const ibv_send_wr& wr, void* dst) noexcept;
  Leaf send_leaf_locked(Qp* qp, const ibv_send_wr& wr) noexcept;
  // A SEND leaf's open target (transport_staged.cc send_leaf_open): the
  // peer, the target's QP entry, its receive CQ, the take record reserved
  // at value v, the next position to promise; entered: counted into the
  // CQ's producers (a run's, send_leaf_run).
  struct StagedTarget {
    Peer* peer;
    layout::QpEntry* t;
    layout::CqEntry* ce;
    uint32_t cq_index, v, sn;
    bool entered;
  };
  [[gnu::always_inline]] bool send_leaf_open(Qp* qp, StagedTarget* o) noexcept;
  template <bool kInPlace, bool kRun>
  [[gnu::always_inline]] Leaf send_leaf_one(Qp* qp, StagedTarget& o, const ibv_send_wr& wr, const void* src,
                                            uint32_t len, uint32_t tail, bool signaled) noexcept;
  template <bool kInPlace>
  [[gnu::always_inline]] Leaf send_leaf_staged(Qp* qp, const ibv_send_wr& wr, const void* src, uint32_t len, uint32_t tail) noexcept;
  [[gnu::noinline]] Leaf send_leaf_in_place(Qp* qp, const ibv_send_wr& wr, const void* src, uint32_t len,
                                            uint32_t tail) noexcept;
  template <bool kLarge>
  Leaf srq_send_leaf_locked(Qp* qp, const ibv_send_wr& wr) noexcept;
  [[gnu::noinline]] Leaf srq_send_leaf_large(Qp* qp, const ibv_send_wr& wr) noexcept;
  // A leaf's source (write_leaf, send_leaf, srq_send_leaf): the inline
  // bytes or the SGE (fast_source), when the WR has the shape they all take
  // (one SGE of 1 to max_len bytes, RC or UC, inline within
  // max_inline_data); else nullptr.
  [[gnu::always_inline]] const void* leaf_source(const Qp* qp, const ibv_send_wr& wr, uint32_t* len,
                                                 uint32_t max_len = 16) const noexcept {
    const ibv_sge* g = wr.sg_list;
    if (wr.num_sge != 1 || !g || (qp->qp_type != IBV_QPT_RC && qp->qp_type != IBV_QPT_UC)) return nullptr;
    *len = g->length;
    const bool inl = wr.send_flags & IBV_SEND_INLINE;
    if (*len - 1 >= max_len || (inl && *len > qp->caps.max_inline_data)) return nullptr;
    return inl ? reinterpret_cast<const void*>(g->addr) : fast_source(qp, *g, *len);
  }
  [[gnu::cold, gnu::noinline]] void send_leaf_armed_peer(const Peer& peer, Qp* qp, uint32_t cq_index,
                                                         layout::CqEntry* e, bool solicited) noexcept;
  // post_send's WR that execute_fast did not finish (transport_post.cc).
  [[gnu::noinline]] void queue_locked(Qp* qp, const ibv_send_wr& wr, uint64_t total, bool inl, bool failed,
                                      uint32_t status) noexcept;
  [[gnu::noinline, gnu::cold]] int post_one_slow(Qp* qp, ibv_send_wr* wr, int rc, ibv_send_wr** bad_wr,
                                                 GeneralPost general, void* arg) noexcept;
  void progress(Qp* qp) noexcept;
  // Progress for every QP with queued work, and flushes of QPs a peer moved
  // to the error state. Called by poll_cq on every poll: inline, and when
  // there is nothing to do it reads private words and one shared word (our
  // header's attention counter, which peers bump when they move one of our
  // QPs to the error state), then returns.
  void progress_all() noexcept {
    // A hint: the receive WQE our next send will read (a peer's ring stays
    // mapped while we know it, and a prefetch never faults anyway).
    // (nullptr when there is none: a prefetch of address 0 is a no-op.)
    __builtin_prefetch(warm_rq_slot_.load(std::memory_order_relaxed), 1);
    __builtin_prefetch(warm_post_slot_.load(std::memory_order_relaxed), 1);
    // A racy count (no read-modify-write on every poll): it only spaces out
    // the looks for dead peers (every 1024th poll).
    const uint32_t polls = polls_.load(std::memory_order_relaxed) + 1;
    polls_.store(polls, std::memory_order_relaxed);
    if ((polls & 1023) != 0 && qps_pending_.load(std::memory_order_relaxed) == 0 &&
        header()->attention.load(std::memory_order_acquire) == attention_seen_)  // pairs with the peer's release
      return;
    progress_all_slow(polls);
  }

  // progress_all for ibv_poll_cq, in two halves, counted by the caller (its
  // CQ's poll count `polls`, which spaces out the looks for dead peers):
  // progress_idle gives the same hints and makes the same checks, true when
  // there is nothing to do; otherwise progress_polled_slow does it.
  bool progress_idle(uint32_t polls) noexcept {
    __builtin_prefetch(warm_rq_slot_.load(std::memory_order_relaxed), 1);
    __builtin_prefetch(warm_post_slot_.load(std::memory_order_relaxed), 1);
    return (polls & 1023) != 0 && qps_pending_.load(std::memory_order_relaxed) == 0 &&
           header()->attention.load(std::memory_order_acquire) == attention_seen_;  // pairs with the peer's release
  }
  // The same, and also false when the CQ's own send completions may be
  // waiting (`local`: its LocalCq::ready word), folded into the test of
  // qps_pending_ so that the empty poll costs nothing more (one OR).
  bool progress_idle(uint32_t polls, const std::atomic<uint32_t>& local) noexcept {
    __builtin_prefetch(warm_rq_slot_.load(std::memory_order_relaxed), 1);
    __builtin_prefetch(warm_post_slot_.load(std::memory_order_relaxed), 1);
    return (polls & 1023) != 0 &&
           (qps_pending_.load(std::memory_order_relaxed) | local.load(std::memory_order_relaxed)) == 0 &&
           header()->attention.load(std::memory_order_acquire) == attention_seen_;  // pairs with the peer's release
  }
  // progress_idle's answer when it was false only because of `local`: no
  // prefetches this time (the caller made them).
  bool progress_quiet(uint32_t polls) noexcept {
    return (polls & 1023) != 0 && qps_pending_.load(std::memory_order_relaxed) == 0 &&
           header()->attention.load(std::memory_order_acquire) == attention_seen_;  // pairs with the peer's release
  }
  void progress_polled_slow(uint32_t polls) noexcept { progress_all_slow(polls); }

  // Completions taken from any CQ of this context (the provider's polls add
  // to it; racy and advisory: lost updates between threads still change
  // it). A CQ's starvation yield looks at it (providers/shmrdma/cq.cc).
  void note_taken(uint32_t n) noexcept {
    completions_taken_.store(completions_taken_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  uint32_t completions_taken() const noexcept { return completions_taken_.load(std::memory_order_relaxed); }

  // Async events (see async.h). The read end of the FIFO becomes the
  // context's async_fd: the caller takes ownership of it once.
  int take_async_read_fd() noexcept;
  void raise_async(uint32_t event_type, uint64_t token) noexcept;
  // The application object a token names (its ibv_* pointer, as recorded
  // with set_*_user), or nullptr when it names nothing live.
  void* resolve_async(uint64_t token) noexcept;
  void set_cq_user(uint32_t index, void* user) noexcept;

  // Receive WQ indirection tables (RSS).
  int create_ind_table(uint32_t log_size, const uint32_t* wq_indices, uint32_t* index, uint32_t* ind_tbl_num) noexcept;
  int destroy_ind_table(uint32_t index) noexcept;

  // Shared receive queues (srq.cc). max_wr and max_sge are rounded up to
  // powers of two and handed back in *out; the SRQ is created unarmed.
  int create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, SrqInfo* out) noexcept;
  // An XRC SRQ (IBV_SRQT_XRC) of domain `xrcd` (open_xrcd's index) whose
  // receive completions go to CQ `cq`.
  int create_srq(uint32_t pd, uint32_t max_wr, uint32_t max_sge, uint32_t xrcd, uint32_t cq, SrqInfo* out) noexcept;

  // XRC domains (xrcd.cc). A domain is the file behind `fd` (st_dev,
  // st_ino); fd -1 makes a private one. oflags: O_CREAT (create it when
  // nobody has it open; without it: ENOENT), O_EXCL (EINVAL when it is
  // open somewhere). close_xrcd: EBUSY while SRQs or QPs of this context use it.
  int open_xrcd(int fd, uint32_t oflags, uint32_t* index) noexcept;
  int close_xrcd(uint32_t index) noexcept;
  // ibv_open_qp: another handle on XRC_RECV QP `qpn` of this context, in
  // domain `xrcd`. EINVAL: no such QP (or another domain); EOPNOTSUPP: the
  // QP belongs to another context (only its owner can drive it).
  int open_qp(uint32_t qpn, uint32_t xrcd, Qp** out) noexcept;
  // attr_mask: IBV_SRQ_MAX_WR (resizing: not supported, EINVAL) and
  // IBV_SRQ_LIMIT (arms the limit event; 0 disarms; > max_wr: EINVAL).
  int modify_srq(uint32_t index, uint32_t attr_mask, uint32_t max_wr, uint32_t srq_limit) noexcept;
  int query_srq(uint32_t index, uint32_t* max_wr, uint32_t* max_sge, uint32_t* srq_limit) noexcept;
  int destroy_srq(uint32_t index) noexcept;  // EBUSY while QPs use it
  // Posts one receive. EINVAL: too many SGEs; ENOMEM: full. The caller
  // holds the lock every post to this SRQ takes (the provider's
  // Srq::post_lock), so the ring's position moves with a plain store
  // (Ring::try_reserve_sp).
  int post_srq_recv(const SrqInfo& srq, uint64_t wr_id, const SgeIn* sges, uint32_t num_sge) noexcept;
  // After an ibv_post_srq_recv call posted at least one WQE: wakes the
  // initiators that wait for a receive on a QP attached to the SRQ.
  void srq_posted(const SrqInfo& srq) noexcept;
  void set_srq_user(uint32_t index, void* user) noexcept;

 private:
  struct SrqState_ {
    bool live = false;
    uint32_t refs = 0;  // QPs attached
    uint32_t pd = 0;
    uint32_t xrcd = layout::kNoIndex, cq = layout::kNoIndex;  // XRC SRQs
    uint64_t ring_off = 0, ring_bytes = 0;
    SrqInfo info{};
    void* user = nullptr;  // the application's ibv_srq, for async events
  };
  std::vector<SrqState_> srqs_;  // sized on first create_srq
  struct XrcdState {
    bool live = false;
    uint64_t dev = 0, ino = 0;  // the domain key (st_dev, st_ino), layout.h
    uint32_t refs = 0;          // SRQs and QPs using it
    int lock_fd = -1;           // our own open of the file, flock(LOCK_SH) while open
  };
  std::vector<XrcdState> xrcds_;
  uint64_t xrcd_private_next_ = 0;
  int create_srq_impl(uint32_t pd, uint32_t max_wr, uint32_t max_sge, uint32_t xrcd, uint32_t cq,
                      SrqInfo* out) noexcept;
  // transport.cc: the live XRC SRQ numbered `srqn` (in any context), with
  // the peer that owns it. nullptr when no such SRQ exists.
  // dev: the device whose registry the SRQ number refers to.
  layout::SrqEntry* find_xrc_srq(HomeDevice* dev, uint32_t srqn, std::shared_ptr<Peer>* cache, Peer** owner) noexcept;
  // A receive taken from an XRC SRQ (of device dev) completes in that SRQ's CQ.
  void push_xrc_recv_cqe(HomeDevice* dev, uint32_t srqn, const layout::Cqe& c) noexcept;
  // Callers hold mu_. An SRQ a new QP of `pd` may use: live, same PD.
  bool srq_usable(uint32_t srq, uint32_t pd) const noexcept;
  void srq_ref(uint32_t srq, int delta) noexcept;
  void* srq_user(uint32_t index, uint32_t generation) const noexcept;

 private:
  LocalContext() = default;

  struct PdState { bool live = false; uint32_t refs = 0; };
  struct CqState {
    bool live = false;
    uint32_t refs = 0;
    uint64_t ring_off = 0, ring_bytes = 0;
    CqInfo info{};
    void* user = nullptr;
    std::atomic<bool> overrun_reported{false};
    uint32_t channel = layout::kNoIndex;  // CqEntry channel value
    uint32_t flags = 0;                   // layout::CqFlags
    // poll_cq's watch for a producer that died mid-push (skip_dead_push);
    // touched only under the CQ's poll lock.
    uint32_t empty_polls = 0;
    uint32_t look_pos = 0;  // the consumer position the last look saw
    bool looked = false;
    // When a look first found the slot at look_pos reserved (0: none since
    // the position last moved).
    uint64_t stall_since_ns = 0;
    // The ring positions of the last kSkipped slots skip_dead_push gave up
    // (1 << 32 | position; 0: none), each written before its slot is given
    // up, so that recv_completion_delivered tells a receive completion the
    // poller took from a slot that was given up. Written under the poll
    // lock; read by the owner's liveness pass (any thread).
    static constexpr uint32_t kSkipped = 16;
    std::atomic<uint64_t> skipped[kSkipped] = {};
    uint32_t skipped_next = 0;
    CqState() = default;
    CqState& operator=(const CqState& o) {
      channel = o.channel; flags = o.flags;
      live = o.live; refs = o.refs; ring_off = o.ring_off; ring_bytes = o.ring_bytes; info = o.info; user = o.user;
      overrun_reported.store(o.overrun_reported.load(std::memory_order_relaxed), std::memory_order_relaxed);
      empty_polls = o.empty_polls; look_pos = o.look_pos; looked = o.looked; stall_since_ns = o.stall_since_ns;
      for (uint32_t i = 0; i < kSkipped; ++i)
        skipped[i].store(o.skipped[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
      skipped_next = o.skipped_next;
      return *this;
    }
    bool was_skipped(uint32_t pos) const noexcept {
      for (const auto& x : skipped)
        if (x.load(std::memory_order_acquire) == (uint64_t{1} << 32 | pos)) return true;
      return false;
    }
    CqState(const CqState& o) { *this = o; }
  };
  struct WqState_ {
    bool live = false;
    uint32_t refs = 0;
    uint32_t pd = 0, cq = 0;
    uint64_t ring_off = 0, ring_bytes = 0;
    WqInfo info{};
  };
  // A cache line apart (alignas: an entry is two lines, its index a shift),
  // what a post's source check reads (fast_source) in its first 32 bytes.
  struct alignas(64) MrState {
    // post_send's one-word check of an SGE's MR (mr_fast_match): set while
    // this is a live MR (not a window) that is not on-demand, else 0.
    uint64_t fast_match = 0;
    uint64_t addr = 0, length = 0, iova = 0;
    bool live = false;
    uint32_t pd = 0, lkey = 0, rkey = 0, access = 0;
    SharedRegion region;  // the mapped tier's region (memfd -1: CMA tier)
    // Windows (kind != kKindMr): the current rkey and the MR the last bind
    // bound it to (kNoIndex: unbound). Whether it is still valid is the
    // shared entry's mw_key (a peer may have invalidated it).
    uint32_t kind = layout::kKindMr;
    uint32_t mw_key = 0;
    uint32_t mw_mr = layout::kNoIndex;
  };
  static_assert(sizeof(MrState) == 128);
  // What MrState::fast_match holds for an SGE with `lkey` posted on a QP of PD `pd`.
  static constexpr uint64_t mr_fast_match(uint32_t pd, uint32_t lkey) noexcept {
    return uint64_t{1} << 63 | uint64_t{pd & 0x7fffffff} << 32 | lkey;
  }
  struct IndState { bool live = false; std::vector<uint32_t> wqs; uint64_t list_off = 0, list_bytes = 0; };

  layout::ContextHeader* header() const noexcept { return static_cast<layout::ContextHeader*>(map_.base()); }
  template <typename T> T* table(uint64_t off) const noexcept { return map_.at<T>(off); }
  int charge(layout::ObjKind k, uint32_t limit) noexcept;
  void uncharge(layout::ObjKind k) noexcept;
  uint64_t heap_alloc(uint64_t bytes) noexcept;
  // Allocates and formats a ring in the heap. 0 with *ring, *off, *bytes set;
  // ENOMEM (heap full) or EINVAL (geometry) with nothing allocated.
  int alloc_ring(uint32_t capacity, uint32_t stride, Ring* ring, uint64_t* off, uint64_t* bytes) noexcept;
  void heap_free(uint64_t off, uint64_t bytes) noexcept;
  // Moves every posted WQE of a WQ in the error state to its CQ as a
  // flush-error completion.
  void flush_wq(const WqInfo& wq) noexcept;
  bool push_cqe(uint32_t cq_index, const layout::Cqe& cqe, RingCache* cache = nullptr) noexcept;

  // transport.cc
  // kNotHandled (execute_fast only): nothing was done, the WQE goes the general way.
  enum class Exec { kDone, kWait, kError, kNotHandled };
  struct Remote {
    uint64_t host = 0;        // address in the target process
    uint8_t* local = nullptr; // the same bytes in this process, when directly reachable
    bool mapped = false;      // the MR is in the mapped tier (CPU atomics apply)
    bool odp = false;         // an on-demand MR: only CMA (EFAULT, never a fault) reaches it
  };
  // target_qpn: the QP the access arrives at (type 2 windows answer only
  // accesses through the QP they were bound with).
  bool resolve_remote(Qp* qp, Peer& peer, uint32_t key, bool rkey, uint32_t pd, uint32_t need, uint64_t addr,
                      uint64_t len, Remote* out, uint32_t target_qpn = 0) noexcept;
  Exec execute(Qp* qp, SendSlot* s, uint32_t* status) noexcept;
  // The common RC/UC case of ibv_post_send (transport_post.cc, inline in
  // post_send): a WRITE, WRITE_WITH_IMM, SEND or SEND_WITH_IMM of len bytes
  // with at most one SGE (inl: its bytes are still in the application's
  // buffer), the send queue empty and the QP in RTS. Executes it straight
  // from the ibv_send_wr when everything is at hand: the peer known, the
  // target's entry checking out, our MR, the target's key in the QP's
  // cache. kNotHandled: nothing happened (the general path waits, resolves
  // and fails); kError: it failed after it reached the target (*status).
  Exec execute_fast(Qp* qp, const ibv_send_wr& wr, uint64_t len, bool inl, uint32_t* status) noexcept;
  // post_send's one-SGE RC RDMA READ or atomic (transport.cc), the shape
  // checked (total: its length): under the send-queue lock, executed from
  // the ibv_send_wr by execute_fast_in when the queue is empty and the QP in
  // RTS, else queued the general way (queue_locked). 0 or ENOMEM.
  [[gnu::noinline]] int post_fast_in(Qp* qp, const ibv_send_wr& wr, uint64_t total) noexcept;
  // execute_fast's READ and atomic counterpart: the same checks as execute
  // on one read of each untrusted entry (the target QP's through Qp::tgt,
  // the rkey's through remote_hit), our SGE's MR granting local write;
  // kDone, or kNotHandled with nothing changed (the general path decides:
  // a cache to fill, a misaligned atomic, the CMA tier's atomics, an error).
  Exec execute_fast_in(Qp* qp, const ibv_send_wr& wr, uint64_t len) noexcept;
  // execute_fast's full check of the target entry when its version moved
  // (Qp::tgt); nullptr: the general path decides.
  [[gnu::noinline]] layout::QpEntry* check_target(Qp* qp, const Peer& peer) noexcept;
  // The peer (*peer) and the target entry for execute_fast and execute_fast_in;
  // nullptr: the general path decides. transport_internal.h.
  layout::QpEntry* fast_target(Qp* qp, Peer** peer) noexcept;
  // resolve_remote's answer from the QP's cache of the last MR it resolved
  // (an MR, not a window, whose entry is live with the seqlock value it had),
  // with the same checks on the cached copy; false on a miss or anything the
  // general resolve_remote must look at (on-demand MRs, a mapping not found
  // yet). transport_internal.h.
  bool remote_hit(Qp* qp, const Peer& peer, uint32_t key, bool rkey, uint32_t pd, uint32_t need, uint64_t addr,
                  uint64_t len, Remote* out) const noexcept;
  // execute_fast's WRITE: the local address of [addr, addr + len) in the
  // peer's MR `rkey` from the rkey cache's one-word tag, or nullptr
  // (remote_hit or resolve_remote decide). transport_internal.h.
  static uint8_t* remote_write_hit(const Qp* qp, const Peer& peer, uint32_t rkey, uint64_t addr, uint64_t len) noexcept;
  static const uint8_t* remote_read_hit(const Qp* qp, const Peer& peer, uint32_t rkey, uint64_t addr,
                                        uint64_t len) noexcept;
  static uint8_t* remote_atomic_hit(const Qp* qp, const Peer& peer, uint32_t rkey, uint64_t addr) noexcept;
  // The SEND leaves' receive buffer: the local address of [addr, addr + len)
  // in the peer's MR `lkey`, a receive buffer of a QP of PD pd, from the
  // receive key cache's one-word tag, or nullptr (remote_hit decides).
  // transport_internal.h.
  static uint8_t* recv_write_hit(const Qp* qp, const Peer& peer, uint32_t lkey, uint32_t pd, uint64_t addr,
                                 uint64_t len) noexcept;
  [[gnu::noinline]] int write_fast_slow(Qp* qp, const Peer& peer, const ibv_send_wr& wr, uint8_t* dst, IoVec local,
                                        uint64_t len) noexcept;
  // resolve_remote: sets or clears rc's one-word hit (Qp::RemoteKeyCache::wtag):
  // a WRITE's for the rkey cache, a SEND's into a receive buffer for the other.
  static void arm_write_hit(Qp::RemoteKeyCache& rc, const Peer& peer) noexcept;
  // The WQE at sq_exec failed: its completion, then the error state (caller holds qp->sq_lock).
  void fail_head(Qp* qp, SendSlot* s, uint32_t status) noexcept;
  Exec execute_ud(Qp* qp, SendSlot* s, uint32_t* status) noexcept;
  // mw.cc: IBV_WR_BIND_MW and IBV_WR_LOCAL_INV, executed by the owner;
  // return a completion status.
  uint32_t execute_bind(Qp* qp, const SendSlot* s) noexcept;
  uint32_t execute_local_inv(const SendSlot* s) noexcept;
  // mw.cc: SEND_WITH_INV at the target: invalidates window `rkey` of `peer`
  // (PD pd). check_only: only whether it would succeed.
  bool invalidate_remote_mw(Peer& peer, uint32_t pd, uint32_t rkey, bool check_only) noexcept;
  // Callers hold mu_ and mw_mu_: EBUSY when a valid window is bound to MR `index`.
  int mr_has_windows(uint32_t index) noexcept;
  // *odp: an SGE is in an on-demand MR (checked mapped now; the move must
  // then use CMA, which fails with EFAULT instead of faulting).
  bool gather_local(Qp* qp, SendSlot* s, IoVec* local, uint32_t* n, bool* odp = nullptr) noexcept;
  // For ODP SGEs: is [addr, addr + len) of our address space mapped?
  bool local_range_mapped(uint64_t addr, uint64_t len) const noexcept;
  bool local_is_odp(uint32_t lkey) const noexcept {
    const uint32_t i = layout::key_index(lkey);
    return i < mrs_.size() && (mrs_[i].access & kAccessOnDemand);
  }
  // kNotStaged: deliver_staged did nothing; deliver takes the message.
  enum class Deliver { kDone, kNoReceive, kBusy, kResponderError, kGone, kNotStaged };
  // transport_staged.cc: a SEND of len bytes (`local`) to RC/UC QP t
  // without an SRQ, promised the receive WQE at t's next position: its
  // bytes go in the receive completion or into the WQE's buffers, and the
  // receiver takes the WQE when it polls (finish_staged). cqe: the receive
  // completion's fields but status, wr_id and byte_len. kDone, kNoReceive
  // (no WQE for it: an RNR, or a UC drop) or kNotStaged (deliver takes it,
  // and reports what failed).
  Deliver deliver_staged(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t opcode, uint64_t len, const IoVec* local,
                         uint32_t nlocal, const layout::Cqe& cqe, bool rnr_wait) noexcept;
  template <typename Move>
  Deliver push_staged(Qp* qp, Peer& peer, layout::QpEntry* t, const Ring& rq, layout::CqEntry* ce,
                      const layout::StagedCqe& sc, uint32_t v, Move&& move) noexcept;
  bool stage_in_place(Qp* qp, Peer& peer, layout::QpEntry* t, const Ring& rq, const RingHandle& h, uint64_t len,
                      const IoVec* local, uint32_t nlocal) noexcept;
  // Whether messages of this opcode to t are staged.
  bool may_stage(uint32_t opcode, const layout::QpEntry* t) const noexcept {
    return staged_send_ &&
           (opcode == IBV_WR_SEND || opcode == IBV_WR_SEND_WITH_IMM || opcode == IBV_WR_RDMA_WRITE_WITH_IMM) &&
           t->srq_index == layout::kNoIndex;
  }
  // The owner, before a flush or reset of its QP drains the receive queue:
  // the WQEs promised to staged completions still in the CQ are kept aside
  // (StagedRx::stash) for those completions, which then complete as usual.
  void stash_staged(Qp* qp) noexcept;
  // Where a delivered message's receive WQE comes from, when it is not t's
  // own RQ or SRQ: an XRC SRQ in `peer`'s segment, whose PD checks the
  // receive buffers and whose CQ gets the completion.
  struct RecvSource {
    Peer* peer = nullptr;
    layout::SrqEntry* se = nullptr;
    uint32_t srq_index = 0;
    uint32_t srqn = 0;
    uint32_t pd = 0;
    uint32_t cq = 0;
  };
  Deliver deliver(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t opcode, uint64_t len, const IoVec* local,
                  uint32_t nlocal, const uint8_t* grh, bool rnr_wait, layout::Cqe& cqe, uint32_t* status,
                  const RecvSource* xrc = nullptr) noexcept;
  // What take_holder_dead did with a busy take record.
  enum class TakeOver { kBusy, kEnded, kAdopted };
  TakeOver take_holder_dead(Qp* qp, Peer& peer, layout::QpEntry* t, uint32_t v, uint32_t srqn, uint32_t* nv) noexcept;
  bool take_ring(Peer& peer, layout::QpEntry* t, uint32_t srqn, std::shared_ptr<Peer>* hold, Ring* out) noexcept;
  bool srq_claim_live(Peer& peer, const layout::QpEntry* t, uint32_t pos) noexcept;
  bool reclaim_take(Qp* qp, uint64_t* wr_id, uint32_t* srqn) noexcept;
  void reclaim_dead_completion(Qp* qp) noexcept;
  void enter_send_error(Qp* qp) noexcept;
  void flush_send_queue(Qp* qp) noexcept;
  // Inline in transport_internal.h, for its callers in transport_post.cc and
  // transport.cc (the push into the CQ's FIFO of own completions is a few
  // instructions: no call for it).
  [[gnu::always_inline]] inline void complete_send(Qp* qp, uint64_t wr_id, uint32_t opcode, uint64_t length,
                                                   uint32_t status) noexcept;
  // complete_send into the shared ring (a CQ with completion timestamps).
  void complete_send_shared(Qp* qp, uint64_t wr_id, uint32_t opcode, uint32_t byte_len, uint32_t status) noexcept;
  // cq.cc: complete_send's rare cases for a CQ's own send completions: the
  // CQ is armed for this one (fire its event), or its FIFO is full (overrun).
  void own_send_armed(uint32_t cq_index, uint32_t status) noexcept;
  void own_send_overrun(uint32_t cq_index) noexcept;
  // qp.cc: the FIFOs qp completes into (its send CQ's, its receive CQ's;
  // nullptr where there is none, one entry when both are the same), and
  // the claim's mode of a FIFO after its producer set changed (caller holds
  // mu_; local_cq.h).
  void own_fifos(const Qp* qp, LocalCq* out[2]) const noexcept;
  static void own_producers_changed(LocalCq* l) noexcept;
  // flush_qp's receive flushes into the receive CQ's FIFO (transport_post.cc).
  void flush_own_recv(Qp* qp, const layout::Cqe& c) noexcept;
  inline void complete_send(Qp* qp, const SendSlot* s, uint32_t status) noexcept;  // transport_internal.h
  void enter_error(Qp* qp) noexcept;
  void check_peer(Qp* qp) noexcept;
  void progress_locked(Qp* qp) noexcept;  // caller holds qp->sq_lock
  void progress_all_slow(uint32_t polls) noexcept;
  void mark_pending(Qp* qp) noexcept;     // caller holds qp->sq_lock
  // The progress thread (progress_thread.cc): executes waiting sends while
  // the application makes no verbs call that would (a NIC executes what was
  // posted without being called again). kick_progress: qps_pending_ went
  // from 0 to 1 (starts the thread the first time); stop_progress: the
  // context closes; progress_pending: the thread's pass, progress of every
  // QP with waiting sends (progress_all_slow's, without what it does for
  // the attention count and dead peers, which stays with the polls).
  void kick_progress() noexcept;
  void stop_progress() noexcept;
  void progress_pending() noexcept;
  static void* progress_main(void* self) noexcept;
  // address.cc: the seam of address resolution. Where an address vector
  // leads: the device of the home and its port (1-based), by DLID on
  // InfiniBand, by DGID on Ethernet (RoCE: the GID table of any device of
  // the home, in any network namespace; then `by_gid`, and the match holds
  // while that port's table keeps `seq`). dev nullptr: nobody has it. Also
  // our own source GID (the vector's sgid_index) and its type, valid while
  // our port's table keeps own_seq.
  struct Resolved {
    HomeDevice* dev = nullptr;
    uint32_t port = 0;
    bool by_gid = false;
    uint32_t seq = 0;
    uint8_t sgid[16] = {};
    uint8_t sgid_type = 0;
    uint32_t own_seq = 0;
    uint32_t own_mtu = 0;  // Ethernet: our port's active MTU in bytes (a UD message's limit)
  };
  void resolve_address(const AddressVector& av, Resolved* r) noexcept;
  // Stores r into qp's cached destination (caller holds the send lock).
  static void set_destination(Qp* qp, const Resolved& r) noexcept;
  // Whether qp's cached destination still holds: its device is not gone and,
  // found by GID, both GID tables are unchanged (two loads).
  bool destination_holds(const Qp* qp) const noexcept;
  static bool same_address(const AddressVector& a, const AddressVector& b) noexcept;
  bool ethernet() const noexcept { return registry_.device().net.link_layer == layout::kLinkLayerEthernet; }
  // RoCE: the checks create_ah and modify_qp(IBV_QP_AV) make on an Ethernet
  // port: a GRH is mandatory and sgid_index must name a valid entry of our
  // port's table. 0 or EINVAL.
  int check_ethernet_av(uint32_t port, bool is_global, uint32_t sgid_index) const noexcept;
  // RC/UC: resolves qp's path (attr) into qp->peer_dev / peer_port (caller
  // holds the send lock). Throttled unless `now`: a path nobody holds is
  // looked at again at most every millisecond. True when resolved.
  bool resolve_path(Qp* qp, bool now) noexcept;
  void flush_qp(Qp* qp) noexcept;
  // note: a receive completion's holder notes where it goes (cq_push.h CqNote).
  bool push_peer_cqe(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe, RingCache* cache = nullptr,
                     const cqpush::CqNote* note = nullptr) noexcept;
  // cq.cc: push_peer_cqe past its common push (cq_push.h push_common, which
  // answered f for entry e), out of line for callers that inline that push.
  [[gnu::cold, gnu::noinline]] bool push_peer_cqe_rest(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe,
                                                       RingCache* cache, layout::CqEntry* e, int f,
                                                       const cqpush::CqNote* note = nullptr) noexcept;
  // cq.cc: the producer protocol of CqEntry shared by push_cqe and push_peer_cqe.
  enum class Push { kOk, kFull, kGone };
  Push push_shared_cqe(const Peer& peer, uint32_t cq_index, const layout::Cqe& cqe, bool* fire,
                       RingCache* cache = nullptr, const cqpush::CqNote* note = nullptr) noexcept;
  struct ChanState { bool live = false; uint32_t generation = 0, refs = 0; int read_fd = -1, write_fd = -1; };
  std::vector<ChanState> chans_;  // sized on first create_channel (under mu_), never resized
  void close_channels() noexcept;
  int qp_charge_and_slot(uint32_t* index) noexcept;

  mutable std::mutex mu_;
  Registry registry_;
  Mapping map_;
  layout::ContextLayout layout_{};
  HeapAllocator heap_;
  uint32_t slot_ = 0, generation_ = 0;
  int async_read_fd_ = -1, async_write_fd_ = -1;
  std::vector<PdState> pds_;
  std::vector<CqState> cqs_;
  std::atomic<uint32_t> completions_taken_{0};  // note_taken
  std::vector<WqState_> wqs_;
  std::vector<IndState> inds_;
  std::vector<MrState> mrs_;
  uint32_t mr_slots_ = 0;  // mrs_.size(), fixed at create (post_send's bound check)
  std::vector<std::unique_ptr<Qp>> qps_;
  std::vector<Qp*> live_qps_;  // the non-null entries of qps_, for progress_all
  // Staged receives (layout.h StagedCqe) of our RC and UC QPs without an
  // SRQ, per QP index, for the context's whole life: the poll that finishes
  // one (finish_staged) reads this, never the Qp, which another thread may
  // be destroying. `lock` orders that poll with stash_staged and with create
  // and destroy; nothing is locked under it.
  struct StagedRx {
    // The polling thread takes it without a locked instruction (biased_lock.h):
    // a locked instruction would wait for the stores before it, among them the
    // previous staged receive's release of a slot the initiator had read.
    BiasedLock lock;
    bool live = false;  // an RC or UC QP without an SRQ lives at this index
    uint32_t qpn = 0, pd = 0;
    // Or an RC or UC QP with an SRQ: its QP number | its PD << 32 (0: none),
    // which its SrqInlineCqes' poll (finish_srq_inline) reads without the
    // lock; written under it. Kept when the QP is destroyed (with
    // kSrqQpGone), until its index is reused: its receive completions still
    // in a CQ are handed out, as those of any destroyed QP are.
    std::atomic<uint64_t> srq_qp{0};
    static constexpr uint64_t kSrqQpGone = uint64_t{1} << 63;
    Ring rq;  // its receive queue
    std::deque<StashedWqe> stash;  // WQEs stash_staged took, in ring order
  };
  std::unique_ptr<StagedRx[]> staged_rx_;
  bool staged_send_ = true;  // SHMRDMA_STAGED_SEND=0: this context's sends never stage
  GeneralPost leaf_general_ = nullptr;  // set_leaf_general
  // take_staged's: a staged CQE (payload, untrusted) into *w; false when
  // there is nothing to hand out (not ours any more, or bogus).
  bool finish_staged(const std::byte* payload, ibv_wc* w) noexcept;
  // take_srq_inline's: an SrqInlineCqe (payload, untrusted) into *w; false
  // when there is nothing to hand out (its QP is not ours, or it is bogus).
  // (srq_inline.h)
  [[gnu::always_inline]] inline bool finish_srq_inline(const std::byte* payload, ibv_wc* w) noexcept;
  // Their responder error: QP qpn at index qi enters the error state, if it
  // is still there (transport_staged.cc).
  void staged_responder_error(uint32_t qi, uint32_t qpn) noexcept;
  bool context_dead(uint32_t holder, uint32_t generation) noexcept;  // holder: layout.h make_holder
  bool holder_dead(uint64_t word) noexcept {  // QpEntry::rx_holder
    return context_dead(layout::holder_of(word), layout::holder_generation(word));
  }
  bool recv_completion_delivered(Qp* qp, uint32_t v) noexcept;
  std::atomic<uint32_t> qps_pending_{0};  // QPs with queued, unexecuted sends
  // Nonzero while a thread runs progress for an application that does not
  // poll (get_channel_event, the progress thread): an RNR back-off then
  // looks at the receive queue on every call (transport_internal.h
  // rnr_backing_off), since such calls are rare.
  std::atomic<uint32_t> rnr_look_now_{0};
  bool rnr_look_now() const noexcept { return rnr_look_now_.load(std::memory_order_relaxed) != 0; }
  struct RnrLookNow {  // rnr_look_now() holds while one lives
    explicit RnrLookNow(LocalContext* c) noexcept : c_(c) { c_->rnr_look_now_.fetch_add(1, std::memory_order_relaxed); }
    ~RnrLookNow() { c_->rnr_look_now_.fetch_sub(1, std::memory_order_relaxed); }
    RnrLookNow(const RnrLookNow&) = delete;
    RnrLookNow& operator=(const RnrLookNow&) = delete;
    LocalContext* c_;
  };
  void progress_all_looking() noexcept {
    const RnrLookNow look(this);
    progress_all();
  }
  // Calls of progress_locked by anyone (a racy count, like polls_): the
  // progress thread leaves the queues to the application while it changes.
  std::atomic<uint32_t> progress_calls_{0};
  // The progress thread's state (progress_thread.cc).
  std::mutex pt_mu_;
  std::condition_variable pt_cv_;
  bool pt_stop_ = false;                  // under pt_mu_
  std::atomic<bool> pt_sleeping_{false};  // it waits on pt_cv_ for sends to wait (Dekker with mark_pending)
  std::atomic<pid_t> pt_pid_{0};          // the process that started it (0: none yet)
  pthread_t pt_thread_{};
  CounterSink cnt_;                       // per-port counters (counters.h); UD drops are counted there
  bool counting_ = false;                 // open() completed: close folds the counts and refreshes sysfs
  uint32_t attention_seen_ = 0;
  std::atomic<uint32_t> polls_{0};
  // Cache hints (progress_all prefetches both for writing while we poll):
  // the peer's receive slot our next send reads and releases (deliver), and
  // our own receive slot the next post fills (post_recv, post_srq_recv).
  std::atomic<const void*> warm_rq_slot_{nullptr};
  std::atomic<const void*> warm_post_slot_{nullptr};
  std::atomic<uint64_t> last_liveness_ns_{0};
  // Every device of the home (directory.h): peers are (device, slot).
  DeviceDirectory dir_;
  Peer self_peer_;
  // This context as a take holder, home-wide, with its generation
  // (layout.h holder_word of make_holder(home id, slot)): set by open.
  uint64_t holder_word_ = 0;
  // The peer context owning QPN qpn on device dev (mapped on first use).
  std::shared_ptr<Peer> peer_of(HomeDevice* dev, uint32_t qpn) noexcept {
    return dev ? dev->peers.get(*dev, layout::qpn_slot(qpn), self_peer_) : nullptr;
  }
  uint32_t mr_hint_ = 0;  // where the search for a free MR slot starts
  // Windows: their private state (mrs_ entries of window kind) changes under
  // mw_mu_, taken after mu_ when both are needed (execute may run under mu_
  // from progress_all). mw_list_: indices of live windows.
  std::mutex mw_mu_;
  std::vector<uint32_t> mw_list_;
};

// Read-only view of another context's segment, for `shmrdma status`.
struct ContextObjects {
  uint32_t pds = 0, cqs = 0, wqs = 0, ind_tables = 0, qps = 0, srqs = 0, mrs = 0, mws = 0;
  struct Wq { uint32_t wq_num, state, capacity, max_sge, pd, cq; };
  std::vector<Wq> wq_list;
  // Each MR's data-mover tier (layout::MrTier) and, for the CMA tier, why
  // (layout::TierWhy), as the owner published them (untrusted: shown only).
  struct Mr { uint32_t index, rkey; uint64_t length; uint16_t tier, tier_why; };
  std::vector<Mr> mr_list;
};
// Returns 0 and fills *out, or an errno (EPROTO for a segment that fails validation).
int inspect_context(const DevicePaths& paths, const ContextInfo& ctx, ContextObjects* out) noexcept;

}  // namespace shmrdma
