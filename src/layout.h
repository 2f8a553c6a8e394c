// Every type that lives in shared memory, in one place.
//
// Trust boundary: a segment is a file that other processes of the same uid
// can map and write. Nothing read back from it is trusted: geometry (table
// sizes, offsets) is recomputed privately by compute_*_layout() and compared
// with the header, indices are bounds-checked or masked before use, counts
// and lengths are clamped. A corrupt peer may make its own operations fail;
// it must never crash another process.
//
// Rules for the types below: standard layout, trivially copyable, fixed-width
// fields, offsets never pointers, every atomic always lock-free (it is shared
// between processes, where a lock-based std::atomic would not work).
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device_limits.h"

namespace shmrdma::layout {

inline constexpr uint32_t kLayoutVersion = 17;
inline constexpr uint64_t kMagic = 0x414d4452'4d485300ull;  // "\0SHMRDMA" little endian
inline constexpr uint32_t kCacheLine = 64;
inline constexpr uint32_t kPageSize = 4096;
inline constexpr uint32_t kAtomicStripes = 64;

static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "cross-process atomics must not fall back to a process-local lock");
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "cross-process atomics must not fall back to a process-local lock");

enum class SegmentKind : uint32_t { kRegistry = 1, kContext = 2 };

// Publication protocol: the creator fills the whole segment, then stores
// ready = kReadyMagic with release (R0). An attacher loads ready with acquire
// (A0 pairs with R0) before it reads anything else.
inline constexpr uint32_t kReadyMagic = 0x52454459;  // "READ"

struct SegmentHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t kind;            // SegmentKind
  uint64_t layout_size;     // size of the whole file in bytes
  std::atomic<uint32_t> ready;
  uint32_t owner_pid;
  uint64_t owner_start_time;  // /proc/<pid>/stat starttime: a reused pid differs
};
static_assert(sizeof(SegmentHeader) == 40);
static_assert(offsetof(SegmentHeader, ready) == 24);
static_assert(std::is_standard_layout_v<SegmentHeader>);

// ---------------------------------------------------------------- counters
//
// Per-port counters (src/counters.h). Every count is a u64 at index Counter
// of an array; the same array shape is used by the per-QP records, the
// per-context per-port blocks and the registry's per-port totals, so folding
// one into another is a loop.
enum Counter : uint32_t {
  kCntXmitPkts = 0,    // packets the port sent (requests, and responses of READ/atomics)
  kCntXmitBytes,       // payload bytes of those
  kCntRcvPkts,         // packets the port received
  kCntRcvBytes,        // payload bytes of those
  kCntMcastXmitPkts,   // of kCntXmitPkts: multicast (UD to a multicast LID)
  kCntMcastRcvPkts,    // of kCntRcvPkts: multicast
  kCntRnrNakRcvd,      // RNR NAKs the requester got (rxe rcvd_rnr_err)
  kCntRnrNakSent,      // RNR NAKs the responder sent (rxe send_rnr_err)
  kCntRetryExc,        // sends completed with IBV_WC_RETRY_EXC_ERR
  kCntRnrRetryExc,     // sends completed with IBV_WC_RNR_RETRY_EXC_ERR
  kCntSendErr,         // send completions with an error status (flushes excluded)
  kCntUdDropNoRecv,    // UD messages that arrived with no receive posted
  kCntUdDropInvalid,   // UD messages that reached no QP: no such QP, QP not receiving, wrong Q_Key
  kCntRdmaSends,       // SEND operations completed (rxe rdma_sends)
  kCntRdmaRecvs,       // receive WQEs completed successfully (rxe rdma_recvs)
  kCntLinkDowned,      // `shmrdma port down` of an active port (registry totals only)
  kCounters
};
static_assert(kCounters == 16);

// The counts of one QP, written only by the QP's owner while it holds the
// QP's send lock (relaxed load + relaxed store: no read-modify-write on the
// data path). Group kGroupLocal counts for the QP's own port (what it sends,
// and the responses it receives), group kGroupRemote for the port the
// destination lives on (what it receives, and the responses it sends): the
// initiator executes, so it counts both ends. port[g] is the 1-based port
// group g counts for (0: none yet); when it changes, the group is first
// folded into the context's per-port block (ContextCounters). A destination
// on another device of the home (a peer found by LID or GID there) is
// counted for that device: port[g] is then foreign_label(its home_id, its
// port) (> 0xff, so never one of ours) and tag[g] its device_tag
// (counters.h); such a group folds into that device's
// RegistrySegment::foreign_counters instead, and readers of that device sum
// it from our segment. A separate table from QpEntry, one record per
// cache-line multiple, so a peer reading a QpEntry never shares a line with
// a record being written.
inline constexpr uint32_t kGroupLocal = 0, kGroupRemote = 1, kGroups = 2;
struct alignas(kCacheLine) QpCounterRecord {
  std::atomic<uint32_t> port[kGroups];
  std::atomic<uint64_t> v[kGroups][kCounters];
  std::atomic<uint32_t> tag[kGroups];  // foreign labels only: the device's incarnation
};
static_assert(sizeof(QpCounterRecord) == 320);
static_assert(offsetof(QpCounterRecord, v) == 8);
static_assert(offsetof(QpCounterRecord, tag) == 8 + 8 * kGroups * kCounters);
static_assert(std::is_standard_layout_v<QpCounterRecord>);

// The per-port counts a context folded out of its QP records (destroyed QPs,
// groups that changed ports), indexed port - 1. Written by the owner under
// its private fold lock as a seqlock: `seq` odd while a fold moves counts
// from a record into `ports` (readers retry), even otherwise. qp_hwm: the
// records [0, qp_hwm) may be non-zero (readers never look further).
struct ContextCounters {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> qp_hwm;
  uint32_t reserved[14];
  std::atomic<uint64_t> ports[limits::kMaxPorts][kCounters];
};
static_assert(offsetof(ContextCounters, ports) == kCacheLine);
static_assert(sizeof(ContextCounters) == kCacheLine + 8 * kCounters * limits::kMaxPorts);

// ---------------------------------------------------------------- registry

// State of a shared table entry. Writers fill the entry, then store kLive
// with release (R1); readers load state with acquire (A1 pairs with R1).
// Entries are only ever written by the process that owns them.
enum EntryState : uint32_t { kFree = 0, kLive = 1 };

// Object kinds that count against device-wide limits.
enum ObjKind : uint32_t { kObjPd = 0, kObjCq, kObjWq, kObjIndTable, kObjQp, kObjSrq, kObjMr, kObjAh,
                          kObjKinds };

inline constexpr uint8_t kPortDown = 1, kPortActive = 4;  // ibv_port_state values a port takes

struct PortRecord {
  uint16_t lid;
  uint8_t state;       // ibv_port_state: kPortActive, or kPortDown after `shmrdma port down`
  uint8_t reserved[5];
  uint64_t port_guid;  // GID[0] = fe80::/64 + port_guid
};
static_assert(sizeof(PortRecord) == 16);

// The personality of a device (fixed at creation). link_layer is the
// ibv_port_attr value: kLinkLayerIb (LIDs, the default) or kLinkLayerEthernet
// (RoCE: bound to a host network interface, GIDs from its addresses, GRH
// mandatory). gid_layout says how the GID table is filled from the
// interface's addresses (gid_table.h build_gid_table).
enum LinkLayer : uint8_t { kLinkLayerIb = 1, kLinkLayerEthernet = 2 };  // = IBV_LINK_LAYER_*
enum GidLayout : uint8_t { kGidLayoutIb = 0, kGidLayoutRxe = 1, kGidLayoutMlx5 = 2 };

// The interface a RoCE device is bound to, as its creator saw it. The
// network namespace is named by st_dev/st_ino of the creator's
// /proc/self/ns/net; the ifindex is the interface's in that namespace (it
// survives a rename). The current name, MTU and carrier are in PortNet.
struct NetBinding {
  uint64_t netns_dev;
  uint64_t netns_ino;
  uint32_t ifindex;
  uint8_t link_layer;  // LinkLayer
  uint8_t gid_layout;  // GidLayout
  uint8_t mac[6];      // at creation: the GUIDs are its EUI-64
  char ifname[16];     // at creation (IFNAMSIZ), NUL-terminated
};
static_assert(sizeof(NetBinding) == 48);

struct DeviceRecord {
  char name[64];       // NUL-terminated ibdev name, e.g. "shm0"
  uint64_t node_guid;  // network byte order is applied at the verbs boundary
  uint64_t sys_image_guid;
  uint64_t created_unix_ns;
  uint32_t num_ports;
  // Unique among the devices of one state home (1..kMaxHomeId, chosen by
  // Registry::create): peers on other devices name this device by it (take
  // holders in QpEntry, QpEntry::dest_device). src/directory.h.
  uint32_t home_id;
  PortRecord ports[limits::kMaxPorts];
  NetBinding net;      // link_layer kLinkLayerIb: only link_layer and gid_layout are meaningful
};
inline constexpr uint32_t kMaxHomeId = 0xfffffe;  // 24 bits (holder ids are home_id << 8 | slot; all ones: kNoIndex)
// A take holder or a connection's far end, home-wide: (device, context slot).
inline constexpr uint32_t make_holder(uint32_t home_id, uint32_t slot) { return (home_id << 8) | (slot & 0xff); }
inline constexpr uint32_t holder_home_id(uint32_t holder) { return holder >> 8; }
inline constexpr uint32_t holder_slot(uint32_t holder) { return holder & 0xff; }
// A take holder with its context's generation (QpEntry::rx_holder).
inline constexpr uint64_t holder_word(uint32_t holder, uint32_t generation) {
  return holder | uint64_t{generation} << 32;
}
inline constexpr uint32_t holder_of(uint64_t word) { return static_cast<uint32_t>(word); }
inline constexpr uint32_t holder_generation(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
static_assert(sizeof(DeviceRecord) == 96 + 16 * limits::kMaxPorts + sizeof(NetBinding));
static_assert(std::is_trivially_copyable_v<DeviceRecord>, "Registry::attach takes a private copy");

// ------------------------------------------------------ GID table, per port
//
// The GID table and the link state of one port, live (they follow the
// interface: the daemon rewrites them). Not in DeviceRecord, which is
// copied privately at attach and holds what never changes; this changes, so
// readers always read it here, through the seqlock:
//   writer (the command or the daemon, holding the registry lock, so there
//   is one writer at a time): seq.store(s + 1, relaxed); fence(release) (W0);
//   fields with relaxed stores; seq.store(s + 2, release) (W1).
//   reader: s1 = seq.load(acquire) (A pairs with W1), retry while odd;
//   fields with relaxed loads; fence(acquire) (pairs with W0); s2 =
//   seq.load(relaxed); the copy is whole when s1 == s2. Retries are bounded
//   (gid_table.h read_port_net): a writer that died mid-update leaves seq odd
//   and readers fail (EAGAIN) instead of spinning; the next writer repairs it.
// Every field is untrusted when read: types are checked, names
// NUL-terminated, indices bounded by kGidTableLen.
enum GidType : uint8_t { kGidTypeIb = 0, kGidTypeRoceV1 = 1, kGidTypeRoceV2 = 2 };  // = IBV_GID_TYPE_*
inline constexpr uint32_t kGidValid = 1u << 31;  // GidSlot::attr: the slot holds a GID; bits 7..0 its GidType

struct GidSlot {
  std::atomic<uint64_t> gid[2];  // the 16 GID bytes as they are on the wire, copied into two words
  std::atomic<uint32_t> attr;    // kGidValid | GidType, or 0 for an empty slot
  uint32_t reserved;
};
static_assert(sizeof(GidSlot) == 24);

// PortNet::link bits. kLinkPresent: the interface exists (in the binding's
// namespace); kLinkUp: it is administratively up (IFF_UP); kLinkCarrier: it
// is running with carrier (IFF_RUNNING / IFF_LOWER_UP); kLinkAdminDown:
// `shmrdma port down` holds the port down whatever the interface does.
inline constexpr uint32_t kLinkPresent = 1u << 0, kLinkUp = 1u << 1, kLinkCarrier = 1u << 2,
                          kLinkAdminDown = 1u << 3;

struct PortNet {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> link;      // kLink* bits
  std::atomic<uint32_t> ifmtu;     // the interface MTU in bytes (0: IB, or unknown)
  std::atomic<uint32_t> speed_mbps;  // the interface speed (0: unknown)
  std::atomic<uint64_t> ifname[2];   // current interface name, 16 bytes NUL-padded
  std::atomic<uint64_t> mac;         // current MAC in the low 6 bytes (as on the wire)
  std::atomic<uint32_t> phys_state;  // ibv_port_attr::phys_state (5 LinkUp, 3 Disabled, 2 Polling)
  std::atomic<uint32_t> active_mtu;  // enum ibv_mtu derived from ifmtu (rxe's rule)
  std::atomic<uint32_t> active_width;  // ibv_port_attr encodings
  std::atomic<uint32_t> active_speed;
  uint32_t reserved[2];
  GidSlot gids[limits::kGidTableLen];
};
static_assert(offsetof(PortNet, gids) == kCacheLine);
static_assert(sizeof(PortNet) == kCacheLine + sizeof(GidSlot) * limits::kGidTableLen);
static_assert(std::is_standard_layout_v<PortNet>);

// One open verbs context. Slot state transitions (kFree -> kLive -> kFree)
// happen under the registry lock; `held` is written by the owner under the
// same lock, so the sum over live slots is exact when read under the lock.
struct ContextSlot {
  std::atomic<uint32_t> state;  // EntryState
  uint32_t pid;
  uint64_t start_time;
  uint32_t generation;          // bumped on every reuse of the slot
  uint32_t reserved;
  char segment[48];             // file name of the context segment, NUL-terminated
  uint32_t held[kObjKinds];
};
static_assert(sizeof(ContextSlot) == 72 + 4 * kObjKinds);
static_assert(offsetof(ContextSlot, state) == 0);
static_assert(std::is_standard_layout_v<ContextSlot>);

// A multicast group of the device: UD QPs attached to (GID, MLID). Written
// under the registry lock; a member whose context slot is no longer live
// with that generation is stale (its process closed or died) and skipped.
struct McastMember {
  uint32_t slot;        // context slot of the QP's owner
  uint32_t generation;  // of that slot
  uint32_t qpn;
  uint32_t reserved;
};
struct McastGroup {
  uint32_t state;     // kFree / kLive
  uint16_t mlid;
  uint16_t nmembers;  // members[0, nmembers) are in use
  uint8_t gid[16];
  McastMember members[limits::kMaxMcastQpAttach];
};
static_assert(sizeof(McastGroup) == 24 + 16 * limits::kMaxMcastQpAttach);

struct RegistrySegment {
  SegmentHeader hdr;
  uint32_t reserved0;
  uint32_t reserved1;
  // Control-path lock (process-shared, robust: a holder that dies is
  // detected with EOWNERDEAD). Never taken on a data path.
  alignas(kCacheLine) pthread_mutex_t lock;
  alignas(kCacheLine) std::atomic<uint32_t> next_qpn;  // unused since QPNs encode their location
  uint32_t reserved2;
  DeviceRecord device;
  alignas(kCacheLine) ContextSlot contexts[limits::kMaxContexts];
  // RDMA atomics that cannot use a CPU atomic on mapped memory serialise on
  // one of these (chosen by target process and address), which makes them
  // atomic with respect to every other RDMA atomic on the device
  // (IBV_ATOMIC_HCA). Robust and process-shared like `lock`.
  alignas(kCacheLine) pthread_mutex_t atomic_locks[kAtomicStripes];
  alignas(kCacheLine) McastGroup mcast[limits::kMaxMcastGroups];
  // Per-port counts of contexts that are gone (closed normally, or reclaimed
  // after their process died), and link_downed; indexed port - 1. Changed
  // and read under `lock`.
  alignas(kCacheLine) uint64_t port_counters[limits::kMaxPorts][kCounters];
  // Per-port counts that contexts of other devices of the home folded for
  // our ports (traffic their QPs sent here: QPs destroyed, groups that moved
  // to another destination, contexts closed), indexed port - 1. Lock-free:
  // those contexts add with fetch_add, readers load (counters.h).
  alignas(kCacheLine) std::atomic<uint64_t> foreign_counters[limits::kMaxPorts][kCounters];
  // GID table and link state per port (index port - 1), seqlocked (see
  // PortNet). Filled at creation for both personalities (IB: GID[0] =
  // fe80::/64 + port GUID, type IB), so a device is found by GID alike.
  alignas(kCacheLine) PortNet net[limits::kMaxPorts];
};
static_assert(std::is_standard_layout_v<RegistrySegment>);
static_assert(offsetof(RegistrySegment, lock) == kCacheLine);
static_assert(offsetof(RegistrySegment, next_qpn) % kCacheLine == 0);
static_assert(std::is_trivially_copyable_v<pthread_mutex_t>);
static_assert(offsetof(RegistrySegment, port_counters) % kCacheLine == 0);
static_assert(offsetof(RegistrySegment, foreign_counters) % kCacheLine == 0);
static_assert(offsetof(RegistrySegment, net) % kCacheLine == 0);

inline constexpr uint64_t registry_size() {
  return (sizeof(RegistrySegment) + kPageSize - 1) / kPageSize * kPageSize;
}

// ------------------------------------------------------ context segments

struct PdEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
};
static_assert(sizeof(PdEntry) == 8);

// A completion queue. Producers (the owner and peers) follow the protocol of
// src/cq.cc: `producers` counts pushes in progress (incremented before the
// geometry is read, decremented after publish) and `resizing` is set by the
// owner while it swaps rings (resize_cq): a producer that sees it backs off
// and retries, the owner waits for `producers` to drain before it moves the
// queued CQEs and publishes the new geometry. After a push, a producer that
// finds the CQ armed (`notify`) disarms it with a CAS and writes an event
// token to the owner's completion channel number `channel`.
struct CqEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t capacity;     // ring slots (power of two)
  uint32_t slot_stride;
  uint64_t ring_offset;  // offset of the RingShared header from the segment start
  uint64_t ring_bytes;
  std::atomic<uint32_t> notify;     // CqNotify: armed by the owner, disarmed by the producer that fires
  uint32_t channel;                 // completion channel: bits 15..0 number, 31..16 its generation; kNoIndex: none
  std::atomic<uint32_t> producers;  // pushes in progress
  std::atomic<uint32_t> resizing;   // nonzero while the owner swaps rings
  uint32_t flags;                   // CqFlags
  // Moved on by the owner whenever it formats a ring for this entry (create,
  // resize; never reset): what a producer knows of a ring's free slots
  // (RingCache::room, cq_push.h push_slot) holds for one epoch of one entry.
  // Written before the state goes live or the resize ends (R1, resizing's
  // release); producers read it counted in (P1), when no ring swap runs.
  uint32_t ring_epoch;
  uint32_t reserved[2];
};
static_assert(sizeof(CqEntry) == 64);
static_assert(offsetof(CqEntry, notify) == 32);

enum CqNotify : uint32_t { kNotifyNone = 0, kNotifySolicited = 1, kNotifyNext = 2 };
// kCqTimestamp: producers stamp Cqe::timestamp (IBV_WC_EX_WITH_COMPLETION_TIMESTAMP*).
enum CqFlags : uint32_t { kCqIgnoreOverrun = 1u << 0, kCqTimestamp = 1u << 1 };

struct WqEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t wq_num;
  uint32_t wq_type;                 // ibv_wq_type
  std::atomic<uint32_t> wq_state;   // ibv_wq_state, written by the owner with release
  uint32_t pd_index;
  uint32_t cq_index;
  uint32_t capacity;                // ring slots (power of two) == max_wr
  uint32_t max_sge;
  uint32_t slot_stride;
  uint64_t ring_offset;
  uint64_t ring_bytes;
};
static_assert(sizeof(WqEntry) == 56);
static_assert(offsetof(WqEntry, wq_state) == 16);

struct IndTableEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t log_size;
  uint32_t ind_tbl_num;
  uint64_t wq_list_offset;  // uint32_t WQ table indices, 1 << log_size of them
};
static_assert(sizeof(IndTableEntry) == 24);

// A memory region. Keys: bits 31..16 the table index, bits 15..0 a random
// tag in [0, 0xfffe] (never 0xffff, so key+1 always changes the tag and
// fails the check). lkey and rkey have independent tags.
struct MrEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t lkey;
  uint32_t rkey;
  uint32_t pd_index;
  uint32_t access;     // ibv_access_flags
  uint64_t iova;       // address the keys are valid for (hca_va)
  uint64_t length;
  uint64_t host_addr;  // where the bytes are in the owner's address space
  // Data mover tier (MrTier). kMapped: the bytes live in a memfd the owner
  // holds open as fd `memfd`; the region [map_start, map_start + map_len) of
  // the owner's address space is that memfd from offset 0, so a peer maps it
  // and reaches host_addr at offset host_addr - map_start.
  // map_id is the memfd's inode number: fd numbers are reused, so a peer
  // checks it when it opens the fd and keys its mappings by it.
  // tier_why (TierWhy): why an MR is in the CMA tier, for `shmrdma status`.
  uint16_t tier;
  uint16_t tier_why;
  int32_t memfd;
  uint64_t map_start;
  uint64_t map_len;
  uint64_t map_id;
  // Memory windows live in this table too (same key space: key_index names
  // the entry). kind: MrKind. A window's entry is kLive from alloc_mw to
  // dealloc_mw; lkey/rkey are 0 and never match. While bound, pd_index,
  // access, iova, length, host_addr and the tier fields describe the bound
  // range of the MR (copied from it). mw_key is (kMwValid | rkey) while the
  // window is bound and valid, the bare rkey otherwise. The owner changes a
  // window like a seqlock: generation odd (release fence), fields, mw_key,
  // generation even (release); readers check generation and mw_key before
  // and after their snapshot. A peer invalidates (IBV_WR_SEND_WITH_INV) with
  // a CAS of mw_key from (kMwValid | rkey) to rkey: the only write a peer
  // makes to this table. Type 2 windows only answer accesses that arrive at
  // QP mw_qpn (type 2B).
  uint32_t kind;
  uint32_t mw_qpn;
  std::atomic<uint64_t> mw_key;
};
static_assert(sizeof(MrEntry) == 96);

// The owner's write of an MR-table entry, MRs and windows alike: a seqlock on
// `generation` (odd while the fields change). Peers read it with
// mr_entry_read: generation, the fields, then generation again, using the
// copy only when both reads are the same even value; so a re-registration
// (access, PD, translation) is seen whole by the very next access.
template <typename F>
inline void mr_entry_update(MrEntry* e, F&& fill) {
  std::atomic_ref<uint32_t> gen(e->generation);
  const uint32_t g = gen.load(std::memory_order_relaxed);
  gen.store(g | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  fill();
  gen.store((g | 1) + 1, std::memory_order_release);
}

// A peer's read of an MR-table entry (another process's, untrusted) inside
// mr_entry_update's seqlock, once: read() copies the fields the caller
// needs out of *e and returns false to give up on the entry (kRefused: a
// decision on fields that may be torn, which the caller takes as final).
// kStable: the copy is of one write, the generation *gen_out (even, the
// same before and after); kTorn: the owner was writing, try again. The
// reader of a window checks its mw_key again after kStable (mw.cc changes
// it outside the seqlock).
enum class EntryRead { kStable, kTorn, kRefused };
template <typename F>
inline EntryRead mr_entry_read(MrEntry* e, uint32_t* gen_out, F&& read) {
  std::atomic_ref<uint32_t> gen(e->generation);
  const uint32_t g = gen.load(std::memory_order_acquire);
  if (g & 1) return EntryRead::kTorn;
  if (!read()) return EntryRead::kRefused;
  std::atomic_thread_fence(std::memory_order_acquire);
  if (gen.load(std::memory_order_relaxed) != g) return EntryRead::kTorn;
  *gen_out = g;
  return EntryRead::kStable;
}
static_assert(offsetof(MrEntry, mw_key) % 8 == 0);

enum MrTier : uint16_t { kTierCma = 0, kTierMapped = 1 };
enum TierWhy : uint16_t {
  kTierWhyNone = 0,       // mapped
  kTierWhyDisabled = 1,   // SHMRDMA_MAPPED=0, or a sanitizer build
  kTierWhyMemory = 2,     // not private anonymous read-write memory in a few mappings (file, shared, stack...)
  kTierWhyThreads = 3,    // other threads run and userfaultfd is not permitted (mapped.cc)
  kTierWhyKernel = 4,     // the kernel refused a step of the move
  kTierWhyResources = 5,  // out of regions, file descriptors or memory
  kTierWhyWindow = 6,     // a memory window that is not bound
  kTierWhyOdp = 7,        // an on-demand-paging MR: CMA only, so unmapped pages are access errors
};
enum MrKind : uint32_t { kKindMr = 0, kKindMw1 = 1, kKindMw2 = 2 };
inline constexpr uint64_t kMwValid = uint64_t{1} << 32;

inline constexpr uint32_t key_index(uint32_t key) { return key >> 16; }

// A queue pair, as peers see it. The owner writes everything but
// `qp_state` (which a peer may move to ERR when it detects a fatal error on
// the responder side, as hardware would) and `initiator_waiting`.
struct QpEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t qpn;
  uint32_t qp_type;                  // ibv_qp_type
  std::atomic<uint32_t> qp_state;    // ibv_qp_state
  uint32_t pd_index;
  uint32_t send_cq;
  uint32_t recv_cq;
  uint32_t srq_index;                // kNoIndex without an SRQ
  uint32_t rq_capacity;              // 0 with an SRQ
  uint32_t rq_max_sge;
  uint32_t rq_stride;
  uint64_t rq_ring_offset;
  uint64_t rq_ring_bytes;
  // Connection, valid from RTR on (written before qp_state with release).
  uint32_t dest_qpn;
  uint32_t access;                   // qp_access_flags: what remote peers may do
  uint16_t dlid;
  uint8_t port;
  uint8_t min_rnr_timer;
  uint32_t qkey;
  // The device of the home the path (DLID or DGID) resolved to at RTR
  // (DeviceRecord::home_id; 0: none). An initiator delivers into this QP
  // only when it is that device's QP named by dest_qpn (directory.h).
  uint32_t dest_device;
  // The receive an initiator is delivering into this QP (transport.cc,
  // "receive takes"): rx_take is a counter << 2 | kTake* state; the holder is
  // the initiator's context slot and generation, and rx_take_wr_id the WQE it
  // took from the RQ or SRQ. Whoever moves a taken record on to the next idle
  // value completes that WQE exactly once: the initiator with the receive
  // completion, the owner with a flush when its QP enters the error state, or
  // another initiator that found the holder dead. rx_take_pos: the ring
  // position the holder announced before each attempt to claim it (ring.h
  // try_claim_announced), so a holder that dies with the slot claimed and
  // unreleased leaves a trace of it and the slot can be adopted.
  // rx_holder: holder_word(holder, generation), one word so that the
  // holder writes it with one store and a reader never pairs one holder's
  // slot with another's generation; the holder is home-wide:
  // make_holder(home id of the initiator's device, its context slot), so an
  // initiator on another device of the home is checked for liveness in its
  // own device's registry.
  std::atomic<uint32_t> rx_take;
  std::atomic<uint64_t> rx_holder;
  std::atomic<uint64_t> rx_take_wr_id;
  // rx_take_srqn: the XRC SRQ the receive in rx_take was taken from (written
  // by the holder before it moves the record to taken), so its completion or
  // flush goes to that SRQ's CQ.
  std::atomic<uint32_t> rx_take_srqn;
  std::atomic<uint32_t> rx_take_pos;
  // Staged receives (transport_staged.cc; RC and UC QPs without an SRQ): the
  // receive queue position after the last one promised to a message by its
  // receive completion (StagedCqe). Positions before it are the receiver's
  // to take when it polls that completion; an initiator takes a WQE itself
  // only at this position. Written under the take record by its holder,
  // read by the owner when it flushes or resets.
  std::atomic<uint32_t> rx_staged_next;
  uint32_t reserved_line1;
  // rx_take_cq: where the holder of a completing record put its receive
  // completion: the record's completing value << 32 | the position of the
  // CQ ring slot it reserved, written before it publishes the slot (and
  // again for each slot it reserves), so that when it dies the owner knows
  // whether the completion reached the CQ (recv_completion_delivered). A
  // value of another record value says it reserved none.
  std::atomic<uint64_t> rx_take_cq;
  // Third cache line. Set by an initiator whose sends to this QP wait for a
  // receive (RNR); the owner's post_recv reads it after every post and wakes
  // the initiator. Apart from the receive record, which initiators write on
  // every delivery, so that the owner's reads do not pull that line away.
  alignas(64) std::atomic<uint32_t> initiator_waiting;
  // Bumped (release) by the owner after every change an initiator's checks
  // depend on: each modify_qp, the error states, destroy (and so reuse of
  // the slot; create leaves it as it is). An initiator that checked the
  // entry in full after reading version v (acquire) may skip those checks
  // while it still reads v (transport_post.cc execute_fast). Never reset.
  std::atomic<uint32_t> version;
  uint32_t reserved_line2a[2];
  // XRC: the XRC domain of an XRC_RECV QP (see kXrcdPrivateDev).
  uint64_t xrcd_dev;
  uint64_t xrcd_ino;
  uint32_t reserved_line2[8];
};
static_assert(sizeof(QpEntry) == 192);
static_assert(offsetof(QpEntry, rx_holder) == offsetof(QpEntry, rx_take) + 4, "beside rx_take, in its line");
static_assert(offsetof(QpEntry, rx_take) / 64 == 1 && offsetof(QpEntry, initiator_waiting) == 128);
static_assert(offsetof(QpEntry, version) / kCacheLine == 2,
              "apart from the take record: a WRITE's check reads a line only RNR waits write");
static_assert(offsetof(QpEntry, rx_take) / kCacheLine == offsetof(QpEntry, rx_take_pos) / kCacheLine &&
                  offsetof(QpEntry, rx_take) / kCacheLine == offsetof(QpEntry, rx_staged_next) / kCacheLine &&
                  offsetof(QpEntry, rx_take) / kCacheLine == offsetof(QpEntry, rx_take_cq) / kCacheLine,
              "the take record is one cache line: the holder's announcements cost no extra line transfer");
// The owner's bump of QpEntry::version (after the change it publishes).
inline void bump_version(QpEntry* e) noexcept { e->version.fetch_add(1, std::memory_order_release); }
inline constexpr uint32_t kTakeIdle = 0, kTakeReserved = 1, kTakeCompleting = 2, kTakeTaken = 3, kTakeMask = 3;

struct SrqEntry {
  std::atomic<uint32_t> state;
  uint32_t generation;
  uint32_t srq_num;
  uint32_t pd_index;
  uint32_t capacity;
  uint32_t max_sge;
  uint32_t slot_stride;
  std::atomic<uint32_t> limit;  // SRQ limit; 0 when not armed
  uint64_t ring_offset;
  uint64_t ring_bytes;
  // XRC SRQs (srq_type IBV_SRQT_XRC): their domain (dev, ino: see kXrcdPrivateDev) and the CQ
  // (index in the owner's table) their receive completions go to.
  uint32_t srq_type;  // ibv_srq_type
  uint32_t cq_index;  // kNoIndex for a basic SRQ
  uint64_t xrcd_dev;
  uint64_t xrcd_ino;
  // A basic SRQ: set by an initiator whose send found it empty and waits
  // (RNR) on a QP attached to it, beside that QP's own initiator_waiting;
  // the owner's next post wakes the waiters (srq.cc srq_posted). An XRC SRQ
  // does not use it: its XRC_RECV QPs may live in other processes.
  std::atomic<uint32_t> initiator_waiting;
  uint32_t reserved;
};
static_assert(sizeof(SrqEntry) == 80);

// An XRC domain is named by the file behind the descriptor it was opened
// with (st_dev, st_ino), so every process that opens the same file shares
// it. A private domain (fd -1) has dev kXrcdPrivateDev and an ino made of
// the owner's context slot, generation and a counter.
inline constexpr uint64_t kXrcdPrivateDev = ~uint64_t{0};

// SRQ numbers: bits 23..16 context slot, 15..4 table index, 3..0 low bits
// of the entry's generation (srq.cc). A peer finds an XRC SRQ from its number.
inline constexpr uint32_t srqn_slot(uint32_t srqn) { return (srqn >> 16) & 0xff; }
inline constexpr uint32_t srqn_index(uint32_t srqn) { return (srqn >> 4) & 0xfff; }

inline constexpr uint32_t kNoIndex = 0xffffffff;

// QP and WQ numbers say where the object lives, so a peer finds a QP from
// its number alone: bits 23..16 context slot, 15..4 table index, 3 kind,
// 2..0 low bits of the entry's generation (a stale number rarely matches).
enum QpnKind : uint32_t { kQpnQp = 0, kQpnWq = 1 };
inline constexpr uint32_t make_qpn(uint32_t slot, uint32_t index, QpnKind kind, uint32_t gen) {
  return ((slot & 0xff) << 16) | ((index & 0xfff) << 4) | (uint32_t{kind} << 3) | (gen & 7);
}
inline constexpr uint32_t qpn_slot(uint32_t qpn) { return (qpn >> 16) & 0xff; }
inline constexpr uint32_t qpn_index(uint32_t qpn) { return (qpn >> 4) & 0xfff; }
inline constexpr QpnKind qpn_kind(uint32_t qpn) { return static_cast<QpnKind>((qpn >> 3) & 1); }
static_assert(limits::kMaxContexts <= 256 && limits::kMaxQp <= 4096 && limits::kMaxWq <= 4096,
              "QPNs have 8 bits of context slot and 12 bits of table index");

struct ContextHeader {
  SegmentHeader hdr;
  uint32_t slot_index;      // index of this context in the registry
  uint32_t slot_generation;
  uint32_t pd_slots, cq_slots, wq_slots, ind_slots;
  uint64_t pd_table, cq_table, wq_table, ind_table;  // offsets from the segment start
  uint32_t mr_slots, qp_slots, srq_slots, reserved;
  uint64_t mr_table, qp_table, srq_table;
  uint64_t heap_offset, heap_size;
  uint64_t counters, qp_counters;  // ContextCounters, QpCounterRecord table (qp_slots entries)
  // Bumped (release) by a peer that moved one of our QPs to the error state;
  // the owner's next poll notices (acquire) and flushes that QP's queues.
  std::atomic<uint32_t> attention;
  uint32_t reserved2;
};
static_assert(std::is_standard_layout_v<ContextHeader>);

// The whole geometry of a context segment, computed in one place. Attachers
// compute it themselves and reject a header that disagrees.
struct ContextLayout {
  uint64_t pd_table, cq_table, wq_table, ind_table;
  uint32_t pd_slots, cq_slots, wq_slots, ind_slots;
  uint64_t mr_table, qp_table, srq_table;
  uint32_t mr_slots, qp_slots, srq_slots;
  uint64_t counters, qp_counters;
  uint64_t heap_offset, heap_size, total_size;
};

inline constexpr uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

inline constexpr ContextLayout compute_context_layout(uint64_t heap_size) {
  ContextLayout l{};
  l.pd_slots = limits::kCtxPdSlots;
  l.cq_slots = limits::kCtxCqSlots;
  l.wq_slots = limits::kCtxWqSlots;
  l.ind_slots = limits::kCtxIndTableSlots;
  l.mr_slots = limits::kMaxMr;
  l.qp_slots = limits::kMaxQp;
  l.srq_slots = limits::kMaxSrq;
  uint64_t off = align_up(sizeof(ContextHeader), kPageSize);
  l.pd_table = off;
  off = align_up(off + sizeof(PdEntry) * l.pd_slots, kCacheLine);
  l.cq_table = off;
  off = align_up(off + sizeof(CqEntry) * l.cq_slots, kCacheLine);
  l.wq_table = off;
  off = align_up(off + sizeof(WqEntry) * l.wq_slots, kCacheLine);
  l.ind_table = off;
  off = align_up(off + sizeof(IndTableEntry) * l.ind_slots, kCacheLine);
  l.mr_table = off;
  off = align_up(off + sizeof(MrEntry) * l.mr_slots, kCacheLine);
  l.qp_table = off;
  off = align_up(off + sizeof(QpEntry) * l.qp_slots, kCacheLine);
  l.srq_table = off;
  off = align_up(off + sizeof(SrqEntry) * l.srq_slots, kCacheLine);
  l.counters = off;
  off = align_up(off + sizeof(ContextCounters), kCacheLine);
  l.qp_counters = off;
  off = align_up(off + sizeof(QpCounterRecord) * l.qp_slots, kPageSize);
  l.heap_offset = off;
  l.heap_size = align_up(heap_size, kPageSize);
  l.total_size = l.heap_offset + l.heap_size;
  return l;
}

// ---------------------------------------------------- work queue entries

// Scatter/gather element as stored in a ring slot.
struct WireSge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};
static_assert(sizeof(WireSge) == 16);

// A receive WQE: this header followed by num_sge WireSge in the same slot.
struct RecvWqeHeader {
  uint64_t wr_id;
  uint32_t num_sge;   // untrusted: consumers clamp it to the queue's private max_sge
  uint32_t reserved;
};
static_assert(sizeof(RecvWqeHeader) == 16);

// A completion as stored in a CQ ring slot. Producers are the owner (local
// send completions, flushes) and peers (receive completions); all fields are
// untrusted when read: the poller clamps enums and lengths before handing
// them to the application.
struct Cqe {
  uint64_t wr_id;
  uint32_t status;      // ibv_wc_status
  uint32_t opcode;      // ibv_wc_opcode
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;    // network byte order, as in ibv_wc
  uint32_t qp_num;      // local QP or WQ number the completion belongs to
  uint32_t src_qp;
  uint32_t wc_flags;    // ibv_wc_flags
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
  uint8_t flags;        // CqeFlags
  uint8_t take_tag;     // 0 (a StagedCqe's kind)
  union {
    // CLOCK_MONOTONIC ns when the producer pushed it, in CQs created with
    // kCqTimestamp (the device clock: hca_core_clock 1 GHz).
    uint64_t timestamp;
    // In other CQs, a receive completion whose bytes the initiator moved
    // into the receiver's buffer may carry that buffer's address in the
    // receiver (0: none): the poller prefetches it (take_cqe), so the line
    // the initiator wrote starts back while the poll goes on, before the
    // application reads it. Untrusted, and only ever prefetched.
    uint64_t buf_hint;
  };
};
static_assert(sizeof(Cqe) == 56, "with the 8-byte slot header a CQE still fills one cache line");
// kCqeSolicited: the sender asked for a solicited event (IBV_SEND_SOLICITED);
// it wakes a CQ armed with solicited_only. kCqeSrqImm: an SrqInlineCqe's
// message carries an immediate (below).
enum CqeFlags : uint8_t { kCqeSolicited = 1u << 0, kCqeSrqImm = 1u << 1 };
static_assert(std::is_trivially_copyable_v<Cqe>);

// A staged receive (transport_staged.cc): a SEND into an RC or UC QP without
// an SRQ whose initiator does not take the receive WQE. It promises the
// message the WQE at ring position `pos` of QP qp_num's receive queue and
// pushes this CQE; the receiver takes that WQE when it polls the CQE
// (finish_staged) and hands out an ordinary receive completion. The bytes
// of a small message travel in the CQE (kStagedInline: the receiver copies
// them into its buffers); a larger one's the initiator moved into the WQE's
// buffers before it pushed the CQE (kStagedInPlace). Same size and slot as
// a Cqe; `status` (kStagedStatus, no ibv_wc_status) tells them apart, so the
// poll's common path pays nothing for it. Inline bytes fill the fields a
// staged CQE does not need: opcode and vendor_err, and the timestamp (an
// inline one never goes into a CQ with timestamps; an in-place one keeps it).
inline constexpr uint32_t kStagedStatus = 0x53544745;
inline constexpr uint32_t kStagedMaxData = 20;
// kStagedWriteImm: the receive of an RDMA_WRITE_WITH_IMM (its bytes went
// where the rkey named; the WQE's buffers are not used).
enum StagedKind : uint8_t { kStagedInline = 1, kStagedInPlace = 2, kStagedWriteImm = 3 };
struct StagedCqe {
  uint32_t pos;         // Cqe::wr_id: the receive queue position promised
  uint8_t data0[4];     // data bytes 0-3
  uint32_t status;      // kStagedStatus
  uint8_t data1[8];     // Cqe::opcode, vendor_err: data bytes 4-11
  uint32_t byte_len;    // the message length (inline: at most kStagedMaxData)
  uint32_t imm_data;    // as Cqe
  uint32_t qp_num;      // the receiving QP
  uint32_t src_qp;      // the sender's QP
  uint32_t wc_flags;    // as Cqe
  uint16_t pkey_index;  // as Cqe
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
  uint8_t flags;
  uint8_t kind;         // Cqe::take_tag: StagedKind
  uint8_t data2[8];     // Cqe::timestamp: data bytes 12-19
};
static_assert(sizeof(StagedCqe) == sizeof(Cqe) && offsetof(StagedCqe, status) == offsetof(Cqe, status) &&
              offsetof(StagedCqe, byte_len) == offsetof(Cqe, byte_len) &&
              offsetof(StagedCqe, qp_num) == offsetof(Cqe, qp_num) &&
              offsetof(StagedCqe, slid) == offsetof(Cqe, slid) && offsetof(StagedCqe, flags) == offsetof(Cqe, flags) &&
              offsetof(StagedCqe, kind) == offsetof(Cqe, take_tag) &&
              offsetof(StagedCqe, data2) == offsetof(Cqe, timestamp) &&
              sizeof(StagedCqe::data0) + sizeof(StagedCqe::data1) + sizeof(StagedCqe::data2) == kStagedMaxData);
static_assert(std::is_trivially_copyable_v<StagedCqe>);

// A small SEND or SEND_WITH_IMM into an RC or UC QP with an SRQ whose bytes
// travel in its receive completion (srq_send_leaf, transport_take.cc). The
// initiator takes the SRQ's WQE as for any SEND (the receive-take protocol,
// so the WQE completes exactly once) and checks that its first buffer holds
// the message, but does not write that buffer: it names it here (addr and
// lkey, the WQE's first SGE) and the receiver's poll checks it against its
// own MRs as a receive buffer of the QP's PD and copies the bytes in
// (finish_srq_inline, transport_staged.cc). So the initiator writes one
// line of the receiver's, not two (the completion's and the buffer's); the
// receiver then stores the bytes into the buffer itself, on its critical
// path, which is why only a stream's messages take this way (srq_send_leaf).
// Same size and slot as a Cqe, told by its status; qp_num, slid, flags and
// take_tag where a Cqe has them. Never in a CQ with timestamps (its last
// eight bytes are data).
inline constexpr uint32_t kSrqInlineStatus = 0x51495253;
inline constexpr uint32_t kSrqInlineMaxData = 20;     // without an immediate
inline constexpr uint32_t kSrqInlineMaxDataImm = 16;  // with one (kCqeSrqImm)
struct SrqInlineCqe {
  uint64_t wr_id;       // as Cqe: the WQE's
  uint32_t status;      // kSrqInlineStatus
  uint32_t addr_lo;     // the buffer's address in the receiver (the WQE's first SGE)
  uint32_t addr_hi;
  uint32_t lkey;        // and its key
  uint8_t data4[4];     // Cqe::imm_data: data bytes 16-19, or the immediate (network order) with kCqeSrqImm
  uint32_t qp_num;      // as Cqe: the receiving QP
  uint32_t src_qp_len;  // the sender's QP (24 bits) | the message length << 24
  uint8_t data0[4];     // Cqe::wc_flags: data bytes 0-3
  uint8_t data1[2];     // Cqe::pkey_index: data bytes 4-5
  uint16_t slid;        // as Cqe
  uint8_t data2[2];     // Cqe::sl, dlid_path_bits: data bytes 6-7
  uint8_t flags;        // as Cqe: CqeFlags
  uint8_t take_tag;     // as Cqe
  uint8_t data3[8];     // Cqe::timestamp: data bytes 8-15
};
static_assert(sizeof(SrqInlineCqe) == sizeof(Cqe) && offsetof(SrqInlineCqe, status) == offsetof(Cqe, status) &&
              offsetof(SrqInlineCqe, data4) == offsetof(Cqe, imm_data) &&
              offsetof(SrqInlineCqe, qp_num) == offsetof(Cqe, qp_num) &&
              offsetof(SrqInlineCqe, data0) == offsetof(Cqe, wc_flags) &&
              offsetof(SrqInlineCqe, slid) == offsetof(Cqe, slid) &&
              offsetof(SrqInlineCqe, flags) == offsetof(Cqe, flags) &&
              offsetof(SrqInlineCqe, take_tag) == offsetof(Cqe, take_tag) &&
              offsetof(SrqInlineCqe, data3) == offsetof(Cqe, timestamp) &&
              sizeof(SrqInlineCqe::data0) + sizeof(SrqInlineCqe::data1) + sizeof(SrqInlineCqe::data2) +
                      sizeof(SrqInlineCqe::data3) + sizeof(SrqInlineCqe::data4) ==
                  kSrqInlineMaxData);
static_assert(std::is_trivially_copyable_v<SrqInlineCqe>);

// Whether c is an error completion (a staged one is not: it completes
// successfully unless the receiver finds its buffers gone).
inline bool error_cqe(const Cqe& c) noexcept {
  return c.status != 0 && c.status != kStagedStatus && c.status != kSrqInlineStatus;
}

}  // namespace shmrdma::layout
