// Queue pairs: the private state of a QP owned by this process, and the work
// requests the provider hands to the core. Enum values are libibverbs' own
// (infiniband/verbs.h is a public, header-only dependency of the core).
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "biased_lock.h"
#include "counters.h"
#include "layout.h"
#include "mapped.h"
#include "peer.h"
#include "ring.h"
#include "spin_lock.h"

namespace shmrdma {

class LocalContext;
class LocalCq;

struct QpCaps {
  uint32_t max_send_wr = 0;
  uint32_t max_recv_wr = 0;
  uint32_t max_send_sge = 0;
  uint32_t max_recv_sge = 0;
  uint32_t max_inline_data = 0;
};

struct QpCreateArgs {
  uint32_t qp_type = IBV_QPT_RC;
  uint32_t pd = 0;
  uint32_t send_cq = 0;
  uint32_t recv_cq = 0;
  uint32_t srq = layout::kNoIndex;
  uint32_t xrcd = layout::kNoIndex;  // XRC_RECV: its domain (no PD, CQs or queues)
  bool sq_sig_all = false;
  QpCaps caps;
};

// What modify/query use: the fields of ibv_qp_attr shmrdma implements.
struct QpAttr {
  uint32_t qp_state = IBV_QPS_RESET;
  uint32_t cur_qp_state = IBV_QPS_RESET;
  uint32_t path_mtu = IBV_MTU_4096;
  uint32_t path_mig_state = IBV_MIG_MIGRATED;
  uint32_t qkey = 0;
  uint32_t rq_psn = 0;
  uint32_t sq_psn = 0;
  uint32_t dest_qp_num = 0;
  uint32_t qp_access_flags = 0;
  uint16_t pkey_index = 0;
  uint16_t dlid = 0;
  uint8_t sl = 0;
  uint8_t src_path_bits = 0;
  uint8_t static_rate = 0;
  uint8_t is_global = 0;
  uint8_t ah_port_num = 0;
  ibv_global_route grh{};
  uint8_t en_sqd_async_notify = 0;
  uint8_t sq_draining = 0;
  uint8_t max_rd_atomic = 0;
  uint8_t max_dest_rd_atomic = 0;
  uint8_t min_rnr_timer = 0;
  uint8_t port_num = 0;
  uint8_t timeout = 0;
  uint8_t retry_cnt = 0;
  uint8_t rnr_retry = 0;
};

// An address vector (what an ibv_ah holds): where a UD message goes. The
// provider copies it into every UD work request, as an HCA's WQE carries it.
struct AddressVector {
  uint16_t dlid = 0;
  uint8_t sl = 0;
  uint8_t is_global = 0;
  uint8_t port_num = 0;
  uint8_t sgid_index = 0;
  uint8_t hop_limit = 0;
  uint8_t traffic_class = 0;
  uint32_t flow_label = 0;
  uint8_t dgid[16] = {};
};

struct SendWr {
  uint64_t wr_id = 0;
  uint32_t opcode = 0;      // ibv_wr_opcode
  uint32_t send_flags = 0;  // ibv_send_flags
  uint32_t imm_data = 0;    // network byte order
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint64_t compare_add = 0;
  uint64_t swap = 0;
  uint32_t num_sge = 0;
  const ibv_sge* sg_list = nullptr;
  // UD: the destination.
  const AddressVector* av = nullptr;
  uint32_t remote_qpn = 0;
  uint32_t remote_qkey = 0;
  // XRC_SEND: the SRQ number at the target (wr.qp_type.xrc.remote_srqn).
  uint32_t xrc_srqn = 0;
  // IBV_WR_BIND_MW: the window (its MR-table index), the MR (index and lkey;
  // kNoIndex: none) and the range and access to bind; rkey is the new key
  // (only its low 8 bits are taken). IBV_WR_LOCAL_INV: rkey is the key to
  // invalidate; IBV_WR_SEND_WITH_INV: imm_data is (host order).
  uint32_t mw_index = layout::kNoIndex;
  uint32_t mw_mr = layout::kNoIndex;
  uint32_t mw_mr_lkey = 0;
  uint32_t mw_access = 0;
  uint64_t mw_addr = 0;
  uint64_t mw_length = 0;
};

// A send WQE in the owner's private send queue. The SGE list (or the inline
// bytes) follows the header in the same stride.
struct SendSlot {
  uint64_t wr_id;
  uint64_t remote_addr;
  uint64_t compare_add;
  uint64_t swap;
  uint64_t length;        // total bytes
  uint32_t opcode;
  uint32_t send_flags;
  uint32_t imm_data;
  uint32_t rkey;
  uint32_t num_sge;       // 0 with inline data
  uint32_t inline_len;
  uint8_t executed;       // done, waiting for a later signaled completion to retire it
  uint8_t reserved[7];
  uint32_t remote_qpn;    // UD
  uint32_t remote_qkey;   // UD
  AddressVector av;       // UD
  uint32_t xrc_srqn;      // XRC_SEND
  uint32_t reserved2;
  uint32_t mw_index, mw_mr, mw_mr_lkey, mw_access;  // IBV_WR_BIND_MW (SendWr)
  uint64_t mw_addr, mw_length;
};

struct Qp {
  // TargetCache::wpd without remote write (pd_index values >= this are
  // never cached), RemoteKeyCache::wtag without a WRITE hit.
  static constexpr uint32_t kNoWritePd = 0xfffffffe;
  static constexpr uint64_t kNoWriteTag = ~uint64_t{0};

  uint32_t index = 0;
  uint32_t qpn = 0;
  uint32_t qp_type = IBV_QPT_RC;
  uint32_t pd = 0;
  uint64_t pd_match = 0;  // LocalContext::mr_fast_match(pd, 0): post_send ORs in the SGE's lkey
  uint32_t send_cq = 0;
  uint32_t recv_cq = 0;
  // The send CQ's FIFO of our own send completions (CqInfo::local; it lives
  // as long as the CQ, which outlives the QP), nullptr: the shared ring.
  LocalCq* send_local = nullptr;
  uint32_t srq = layout::kNoIndex;
  uint32_t xrcd = layout::kNoIndex;  // XRC_RECV
  uint32_t handles = 1;              // XRC_RECV: creator + ibv_open_qp handles
  bool sq_sig_all = false;
  QpCaps caps;
  QpAttr attr;                     // last values set by modify_qp (for query_qp)
  layout::QpEntry* shared = nullptr;

  // Receive queue (absent with an SRQ). Its producers are the owner's
  // posting threads, serialized by rq_lock (the thread that posts receives
  // takes it without a locked instruction: biased_lock.h), so a post moves
  // the ring's position with a plain store (Ring::try_reserve_sp).
  Ring rq;
  BiasedLock rq_lock;
  uint64_t rq_off = 0, rq_bytes = 0;

  // Send queue: private ring of SendSlot. retire <= exec <= tail.
  BiasedLock sq_lock;  // the posting thread takes it without a locked instruction (biased_lock.h)
  std::vector<uint64_t> sq_storage;  // 8-byte units
  uint32_t sq_stride = 0;            // bytes
  uint32_t sq_mask = 0;
  uint32_t sq_retire = 0, sq_exec = 0, sq_tail = 0;
  std::atomic<uint32_t> sq_pending{0};  // WQEs posted but not executed (for progress from poll)
  // The bad_wr of the post a leaf runs (under sq_lock), kept here rather
  // than in a register across the leaf, which has none to spare (7
  // instructions per SEND, callgrind): it is needed only when the leaf
  // declines (LocalContext::leaf_declined).
  ibv_send_wr** leaf_bad_wr = nullptr;
  // What the provider reads, without the lock, before it offers a WR to a
  // leaf (write_leaf, send_leaf, srq_send_leaf): a hint only (each leaf
  // checks it all again under sq_lock); written under sq_lock. kLeafQueued:
  // the last post left WQEs queued or an RNR back-off (a sender ahead of its
  // receiver: the leaves would decline, so the next post goes the general
  // way, and a post that finds the queue empty again clears it).
  // kLeafNoSend: check_target found the target one no SEND leaf takes (no
  // staging without an SRQ, a RoCE path). kLeafSrq: the target has an SRQ,
  // so the SEND leaf is srq_send_leaf, not send_leaf.
  static constexpr uint8_t kLeafQueued = 1, kLeafNoSend = 2, kLeafSrq = 4;
  std::atomic<uint8_t> leaf_off{0};
  void set_leaf_off(uint8_t bit, bool on) noexcept {
    const uint8_t v = leaf_off.load(std::memory_order_relaxed);
    const uint8_t n = on ? v | bit : v & ~bit;
    if (n != v) leaf_off.store(n, std::memory_order_relaxed);
  }

  // Waiting state of the WQE at sq_exec (receiver not ready / peer absent).
  uint64_t wait_started_ns = 0;
  uint32_t rnr_attempts = 0;
  uint32_t timeout_attempts = 0;
  // RNR back-off (transport.cc deliver): after finding the target's queue
  // empty, the send goes on once a batch of receives is posted or the
  // back-off time passed, like an RNR NAK's timer.
  bool rnr_backoff = false;
  uint64_t rnr_backoff_since_ns = 0;
  uint32_t rnr_backoff_looks = 0;  // calls of rnr_backing_off in this back-off (transport_internal.h)

  // A busy receive record of a target QP (transport.cc take_holder_dead).
  uint32_t busy_take = 0, busy_take_qpn = 0;
  uint64_t busy_since_ns = 0;
  uint64_t busy_claim_since_ns = 0;  // since when its holder's announced slot is seen claimed (0: not seen)
  uint32_t busy_claim_pos = 0;

  // Connection (from RTR). peer_dev: the device of the home the path
  // resolved to (directory.h; nullptr: not resolved yet), peer_port its
  // port. UD: the device and port of the last address vector sent to
  // (ud_av: that vector's address; resolved again when it changes).
  HomeDevice* peer_dev = nullptr;
  uint32_t peer_port = 0;
  // Every change of peer_dev goes through here: the counters' fast groups
  // (QpCounting::fast_local) were made for the old one.
  void set_peer_dev(HomeDevice* d) noexcept {
    peer_dev = d;
    cnt.fast_local = cnt.fast_remote = nullptr;
  }
  uint64_t resolve_retry_ns = 0;  // RC/UC without peer_dev: when resolution was last tried
  // RoCE (address.cc Resolved): peer_dev was found by GID and holds while
  // its port's table keeps peer_gid_seq and ours own_gid_seq; ud_sgid: our
  // source GID for the UD GRH area, of type ud_sgid_type.
  bool path_by_gid = false;
  uint32_t peer_gid_seq = 0, own_gid_seq = 0;
  uint8_t ud_sgid[16] = {};
  uint8_t ud_sgid_type = 0;
  uint32_t ud_mtu = 0;  // Ethernet: our port's active MTU (bytes), the largest UD message; 0: 4096
  AddressVector ud_av{};
  bool ud_av_valid = false;
  std::shared_ptr<Peer> peer;
  uint32_t remote_index = 0;
  // The target QP entry as execute_fast last checked it in full (under
  // sq_lock): the peer (its stamp), the entry, the entry's version read
  // before the check, and the two fields a WRITE uses. While the peer and
  // the version are the same, the checks hold (layout.h QpEntry::version).
  // tgt_entry nullptr: nothing checked.
  struct TargetCache {
    uint64_t peer_stamp = 0;
    layout::QpEntry* entry = nullptr;
    uint32_t version = 0;
    uint32_t access = 0, pd = 0;
    // The PD a WRITE's rkey must be in, when the entry grants remote write
    // (else kNoWritePd): half of the one word RemoteKeyCache::wtag is
    // compared with.
    uint32_t wpd = kNoWritePd;
    // The same for a READ (RemoteKeyCache::rtag): the PD when the entry
    // grants remote read, else kNoWritePd.
    uint32_t rpd = kNoWritePd;
    // And for an atomic (RemoteKeyCache::atag): the PD when the entry
    // grants remote atomics, else kNoWritePd.
    uint32_t apd = kNoWritePd;
    // Our port's LID, the slid of the receive completions we make (the
    // port is fixed while this cache is: modify_qp empties it).
    uint32_t slid = 0;
  };
  TargetCache tgt;
  std::shared_ptr<Peer> xrc_peer;  // XRC_SEND: the owner of the SRQ named last

  bool mcast_attached = false;  // attached to a multicast group at some point

  // The WQE being executed has an SGE in an on-demand MR (gather_local):
  // its bytes move with CMA only. Under sq_lock.
  bool local_odp = false;

  // post_send's fast path gathers inline bytes of several SGEs here
  // (transport_post.cc kFastInlineGather), under sq_lock.
  alignas(8) uint8_t fast_gather[64];

  // The receive side has been flushed after entering ERR.
  bool rq_flushed = false;
  void* user = nullptr;  // the application's ibv_qp, for async events

  // Mappings of peers' mapped-tier MRs this QP used last (lookups without a lock).
  struct MapCacheEntry {
    std::shared_ptr<PeerMapping> map;
    uint64_t peer_stamp = 0;  // Peer::stamp: which peer object (its slot, generation and home)
    int memfd = -1;
    uint64_t map_id = 0;
  };
  std::array<MapCacheEntry, 4> map_cache{};
  // The last remote MR this QP resolved (transport.cc resolve_remote): its
  // entry in the peer's segment, the seqlock value and the validated copy
  // taken then, and its mapping once found.
  struct MrSnapshot {
    uint32_t kind = 0, key = 0, pd = 0, access = 0, mw_qpn = 0, tier = 0;
    uint64_t iova = 0, length = 0, host = 0, map_start = 0, map_len = 0, map_id = 0;
    int memfd = -1;
  };
  struct RemoteKeyCache {
    const void* entry = nullptr;  // nullptr: empty
    uint32_t key = 0;
    bool rkey = false;
    // Peer::stamp of that peer (0: empty): which peer object, so its slot,
    // generation and home (set once when the Peer is made) in one word.
    uint64_t peer_stamp = 0;
    uint32_t gen = 1;  // odd: matches no stable seqlock value
    MrSnapshot snap;
    std::shared_ptr<PeerMapping> map;
    // A WRITE's hit in one word (transport_internal.h remote_write_hit; in
    // recv_key_cache a SEND's into a receive buffer, recv_write_hit):
    // key << 32 | snap.pd, set (LocalContext::arm_write_hit) only while the
    // snapshot is an MR's that grants remote write (local write for a
    // receive buffer), is not on-demand, has a
    // PD below kNoWritePd and a range that does not wrap, and whose every
    // byte is reachable here: wbase is the local address of its iova (the
    // target is this process, or the MR lies wholly inside `map`). Else
    // kNoWriteTag (its low half matches no TargetCache::wpd).
    uint64_t wtag = kNoWriteTag;
    // A READ's hit (remote_read_hit), in the rkey cache: the same word,
    // set under the same conditions for an MR that grants remote read.
    uint64_t rtag = kNoWriteTag;
    // An atomic's (remote_atomic_hit), in the rkey cache: the same word, for
    // an MR that grants remote atomics and is in the mapped tier (a CPU
    // atomic on it is atomic with every other RDMA atomic on it; the CMA
    // tier's striped lock is execute's).
    uint64_t atag = kNoWriteTag;
    uint8_t* wbase = nullptr;  // for any tag
  };

  // One for rkeys (WRITE/READ/atomic targets), one for the lkeys of the
  // target's receive buffers (SEND), so a QP that does both keeps both.
  RemoteKeyCache rkey_cache, recv_key_cache;
  uint32_t map_cache_next = 0;
  uint32_t map_cache_last = 0;  // the entry that hit last
  // Rings of peers this QP's sends feed, validated once (peer.h RingCache):
  // the target's receive queue or SRQ, the target's receive CQ, our send CQ.
  RingCache target_rq_cache, target_cq_cache, send_cq_cache;

  QpCounting cnt;  // per-port counters (counters.h, count.h)

  // RESET: the QP behaves like a new one (IBA 10.3.1.1). Everything the send
  // side learnt or was waiting for on the old connection goes: the wait of
  // the WQE that was at sq_exec (else the next wait would inherit its
  // elapsed time and fail at once with a retry error), RNR back-off, a busy
  // receive record seen at the old target, and the caches of the old
  // target's rings and mappings. The caller holds sq_lock.
  void reset_connection_state() noexcept {
    wait_started_ns = 0;
    rnr_attempts = timeout_attempts = 0;
    rnr_backoff = false;
    rnr_backoff_since_ns = 0;
    rnr_backoff_looks = 0;
    busy_take = busy_take_qpn = 0;
    busy_since_ns = busy_claim_since_ns = 0;
    busy_claim_pos = 0;
    peer.reset();
    remote_index = 0;
    tgt = TargetCache{};
    xrc_peer.reset();
    map_cache = {};
    rkey_cache = RemoteKeyCache{};
    recv_key_cache = RemoteKeyCache{};
    map_cache_next = map_cache_last = 0;
    target_rq_cache = RingCache{};
    target_cq_cache = RingCache{};
  }

  SendSlot* slot(uint32_t pos) noexcept {
    return reinterpret_cast<SendSlot*>(reinterpret_cast<char*>(sq_storage.data()) + size_t{pos & sq_mask} * sq_stride);
  }
  ibv_sge* sges(SendSlot* s) noexcept { return reinterpret_cast<ibv_sge*>(s + 1); }
  uint8_t* inline_data(SendSlot* s) noexcept { return reinterpret_cast<uint8_t*>(s + 1); }
  uint32_t state() const noexcept { return shared->qp_state.load(std::memory_order_acquire); }
};

}  // namespace shmrdma
