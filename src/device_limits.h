// Device limits: the single source of truth for what shmrdma advertises in
// ibv_query_device and what it enforces. Every number here is checked where
// the object is created; nothing is advertised that is not enforced.
#pragma once

#include <cstdint>

namespace shmrdma::limits {

// Object counts are device-wide: the registry sums what every live context
// holds before it lets one more object be created.
inline constexpr uint32_t kMaxContexts = 256;   // open contexts on one device
inline constexpr uint32_t kMaxPd = 4096;
inline constexpr uint32_t kMaxCq = 4096;
inline constexpr uint32_t kMaxWq = 4096;
inline constexpr uint32_t kMaxRwqIndTables = 1024;
inline constexpr uint32_t kMaxQp = 4096;
inline constexpr uint32_t kMaxSrq = 4096;
inline constexpr uint32_t kMaxMr = 65536;
// Device memory (ibv_alloc_dm): what one context may hold in all
// (max_dm_size); DM is memory of the process that allocates it.
inline constexpr uint64_t kMaxDmSize = uint64_t{256} << 10;
inline constexpr uint32_t kMaxDmLogAlign = 21;  // log_align_req up to 2 MiB
inline constexpr uint32_t kMaxAh = 65536;

// Per-context table capacities. A context may hold up to the device-wide
// limit of each kind, so its tables are sized to that limit.
inline constexpr uint32_t kCtxPdSlots = kMaxPd;
inline constexpr uint32_t kCtxCqSlots = kMaxCq;
inline constexpr uint32_t kCtxWqSlots = kMaxWq;
inline constexpr uint32_t kCtxIndTableSlots = kMaxRwqIndTables;

// Queue geometry.
inline constexpr uint32_t kMaxQpWr = 16384;       // max_qp_wr, also WQ/SRQ max_wr
inline constexpr uint32_t kMaxSge = 32;           // max_sge (send and receive)
inline constexpr uint32_t kMaxCqe = 1u << 20;     // max_cqe (power of two)
inline constexpr uint32_t kMaxSrqWr = kMaxQpWr;
inline constexpr uint32_t kMaxQpRdAtom = 16;   // max_qp_rd_atom / max_qp_init_rd_atom
inline constexpr uint32_t kMaxInlineData = 512;  // bytes copied into the WQE at post time
inline constexpr uint32_t kMaxMsgSz = 1u << 31;   // max_msg_sz: the bytes of one message
inline constexpr uint32_t kMaxSrqSge = kMaxSge;

// RSS: indirection tables of 2^0 .. 2^kMaxLogIndTblSize WQs.
inline constexpr uint32_t kMaxLogIndTblSize = 7;  // 128 WQs per table
inline constexpr uint32_t kMaxRwqIndTableSize = 1u << kMaxLogIndTblSize;

inline constexpr uint32_t kMaxPorts = 8;
// Multicast: groups per device and QPs per group (max_total_mcast_qp_attach
// is their product).
inline constexpr uint32_t kMaxMcastGroups = 64;
inline constexpr uint32_t kMaxMcastQpAttach = 32;
inline constexpr uint32_t kGidTableLen = 16;
inline constexpr uint32_t kPkeyTableLen = 1;
inline constexpr uint32_t kNumCompVectors = 1;

// Identity. vendor_id 0x02534d is a locally administered OUI (bit 1 of the
// first octet set), so it is never a real hardware vendor's; perftest and
// others switch to vendor-specific paths for Mellanox/Intel/Chelsio/EFA ids.
inline constexpr uint32_t kVendorId = 0x02534d;
inline constexpr uint32_t kVendorPartId = 0x5348;
inline constexpr uint32_t kHwVer = 1;

// QP and WQ numbers share one 24-bit space, as on hardware. 0 and 1 are the
// special QPs of the InfiniBand spec.
inline constexpr uint32_t kFirstQpn = 0x100;
inline constexpr uint32_t kQpnMask = 0xffffff;

}  // namespace shmrdma::limits
