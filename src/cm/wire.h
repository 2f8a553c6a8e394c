// IB CM messages (InfiniBand Architecture Specification vol. 1, chapter 12.6)
// as shmrdmad daemons exchange them: a 24-byte MAD common header (management
// class 0x07, class version 2, method Send) and the 232-byte CM payload,
// every field big-endian at the spec's offset. The same bytes can later go
// to other hosts inside a RoCE v2 UD packet to QP1.
//
// Fields narrower than a byte boundary are packed as the spec draws them,
// the first-named field in the most significant bits of its word.
// Everything received is untrusted: the parser only checks the header and
// the length; the state machine checks ids, states and values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace shmrdma::cm {

template <int N>
struct Be {
  uint8_t b[N];
  uint64_t get() const noexcept {
    uint64_t v = 0;
    for (int i = 0; i < N; ++i) v = (v << 8) | b[i];
    return v;
  }
  void set(uint64_t v) noexcept {
    for (int i = N - 1; i >= 0; --i, v >>= 8) b[i] = static_cast<uint8_t>(v);
  }
  // Bits [hi..lo] of the field (hi counted from the least significant bit).
  uint32_t bits(int hi, int lo) const noexcept {
    return static_cast<uint32_t>((get() >> lo) & ((uint64_t{1} << (hi - lo + 1)) - 1));
  }
  void set_bits(int hi, int lo, uint64_t v) noexcept {
    const uint64_t mask = ((uint64_t{1} << (hi - lo + 1)) - 1) << lo;
    set((get() & ~mask) | ((v << lo) & mask));
  }
};
using Be8 = Be<1>;
using Be16 = Be<2>;
using Be32 = Be<4>;
using Be64 = Be<8>;

inline constexpr uint8_t kMadBaseVersion = 1;
inline constexpr uint8_t kMgmtClassCm = 0x07;
inline constexpr uint8_t kCmClassVersion = 2;
inline constexpr uint8_t kMethodSend = 0x03;

enum AttrId : uint16_t {
  kAttrReq = 0x0010,
  kAttrMra = 0x0011,
  kAttrRej = 0x0012,
  kAttrRep = 0x0013,
  kAttrRtu = 0x0014,
  kAttrDreq = 0x0015,
  kAttrDrep = 0x0016,
  kAttrSidrReq = 0x0017,
  kAttrSidrRep = 0x0018,
};

// REJ reason codes (table 112) the daemon uses.
enum RejReason : uint16_t {
  kRejNoQp = 1,
  kRejNoResources = 2,
  kRejTimeout = 3,  // unused here
  kRejInvalidCommInstance = 5,
  kRejInvalidServiceId = 8,   // no listener: the active side sees status 8 (librdmacm: ECONNREFUSED)
  kRejStaleConn = 10,
  kRejInvalidCommId = 13,
  kRejConsumer = 28,
};
// SIDR_REP status (table 119).
enum SidrStatus : uint8_t { kSidrSuccess = 0, kSidrUnsupported = 1, kSidrReject = 2, kSidrNoQp = 3 };

struct MadHeader {
  uint8_t base_version, mgmt_class, class_version, method;
  Be16 status, class_specific;
  Be64 tid;
  Be16 attr_id, reserved;
  Be32 attr_mod;
};
static_assert(sizeof(MadHeader) == 24);

struct CmPath {
  Be16 local_lid, remote_lid;
  uint8_t local_gid[16], remote_gid[16];
  Be32 flow_rate;      // flow label 31..12, packet rate 5..0
  uint8_t traffic_class, hop_limit;
  Be8 sl_subnet;       // SL 7..4, subnet local 3
  Be8 ack_timeout;     // local ACK timeout 7..3
};
static_assert(sizeof(CmPath) == 44);

inline constexpr size_t kReqPrivate = 92, kRepPrivate = 196, kRtuPrivate = 224, kRejPrivate = 148,
                        kDreqPrivate = 220, kDrepPrivate = 224, kMraPrivate = 222, kSidrReqPrivate = 216,
                        kSidrRepPrivate = 136;

struct Req {
  Be32 local_comm_id, reserved0;
  Be64 service_id, local_ca_guid;
  Be32 reserved1, local_qkey;
  Be32 qpn_resp;       // local QPN 31..8, responder resources 7..0
  Be32 eecn_init;      // local EECN 31..8, initiator depth 7..0
  Be32 reecn_misc;     // remote EECN 31..8, remote CM response timeout 7..3, transport type 2..1, e2e flow 0
  Be32 psn_misc;       // starting PSN 31..8, local CM response timeout 7..3, retry count 2..0
  Be16 pkey;
  Be8 mtu_rnr;         // path MTU 7..4, RDC exists 3, RNR retry count 2..0
  Be8 retries_srq;     // max CM retries 7..4, SRQ 3, extended transport 2..0
  CmPath primary, alternate;
  uint8_t private_data[kReqPrivate];
};
struct Rep {
  Be32 local_comm_id, remote_comm_id, local_qkey;
  Be32 local_qpn;      // 31..8
  Be32 local_eecn;     // 31..8
  Be32 starting_psn;   // 31..8
  uint8_t responder_resources, initiator_depth;
  Be8 ack_failover;    // target ACK delay 7..3, failover accepted 2..1, e2e flow 0
  Be8 rnr_srq;         // RNR retry count 7..5, SRQ 4
  Be64 local_ca_guid;
  uint8_t private_data[kRepPrivate];
};
struct Rtu {
  Be32 local_comm_id, remote_comm_id;
  uint8_t private_data[kRtuPrivate];
};
struct Rej {
  Be32 local_comm_id, remote_comm_id;
  Be8 msg_rejected;    // 7..6: 0 REQ, 1 REP, 2 other
  Be8 info_length;     // 7..1
  Be16 reason;
  uint8_t ari[72];
  uint8_t private_data[kRejPrivate];
};
struct Dreq {
  Be32 local_comm_id, remote_comm_id;
  Be32 remote_qpn;     // 31..8
  uint8_t private_data[kDreqPrivate];
};
struct Drep {
  Be32 local_comm_id, remote_comm_id;
  uint8_t private_data[kDrepPrivate];
};
struct Mra {
  Be32 local_comm_id, remote_comm_id;
  Be8 msg_mraed;       // 7..6
  Be8 service_timeout; // 7..3
  uint8_t private_data[kMraPrivate];
};
struct SidrReq {
  Be32 request_id;
  Be16 pkey, reserved;
  Be64 service_id;
  uint8_t private_data[kSidrReqPrivate];
};
struct SidrRep {
  Be32 request_id;
  uint8_t status, info_length;
  Be16 reserved;
  Be32 qpn;            // 31..8
  Be64 service_id;
  Be32 qkey;
  uint8_t info[72];
  uint8_t private_data[kSidrRepPrivate];
};
static_assert(sizeof(Req) == 232 && sizeof(Rep) == 232 && sizeof(Rtu) == 232 && sizeof(Rej) == 232 &&
                  sizeof(Dreq) == 232 && sizeof(Drep) == 232 && sizeof(Mra) == 232 && sizeof(SidrReq) == 232 &&
                  sizeof(SidrRep) == 232,
              "every CM payload is the 232 bytes after the MAD header (IBA 12.6)");
static_assert(offsetof(Req, primary) == 52 && offsetof(Req, private_data) == 140);
static_assert(offsetof(Rep, local_ca_guid) == 28 && offsetof(Rej, ari) == 12 && offsetof(SidrRep, info) == 24);

struct Mad {
  MadHeader hdr;
  union {
    uint8_t raw[232];
    Req req;
    Rep rep;
    Rtu rtu;
    Rej rej;
    Dreq dreq;
    Drep drep;
    Mra mra;
    SidrReq sidr_req;
    SidrRep sidr_rep;
  };
};
static_assert(sizeof(Mad) == 256 && std::is_trivially_copyable_v<Mad> && std::is_standard_layout_v<Mad>);

inline void init_mad(Mad* m, uint16_t attr, uint64_t tid) noexcept {
  std::memset(m, 0, sizeof *m);
  m->hdr.base_version = kMadBaseVersion;
  m->hdr.mgmt_class = kMgmtClassCm;
  m->hdr.class_version = kCmClassVersion;
  m->hdr.method = kMethodSend;
  m->hdr.tid.set(tid);
  m->hdr.attr_id.set(attr);
}

// A received datagram is a CM MAD we handle: exact size, header fields.
inline bool valid_mad(const void* p, size_t len) noexcept {
  if (len != sizeof(Mad)) return false;
  const auto* m = static_cast<const Mad*>(p);
  const uint16_t a = static_cast<uint16_t>(m->hdr.attr_id.get());
  return m->hdr.base_version == kMadBaseVersion && m->hdr.mgmt_class == kMgmtClassCm &&
         m->hdr.class_version == kCmClassVersion && m->hdr.method == kMethodSend && a >= kAttrReq &&
         a <= kAttrSidrRep;
}

// The RDMA CM's header at the start of REQ / SIDR_REQ private data for IP
// port spaces (the kernel's cma_hdr): version 0, IP version in the high
// nibble, the destination port, then source and destination addresses
// (IPv4 as the last 4 bytes of each 16).
struct CmaHeader {
  uint8_t cma_version;
  uint8_t ip_version;  // 4 << 4 or 6 << 4
  Be16 port;           // the active side's source port (the kernel's cma_save_ip_info)
  uint8_t src_addr[16];
  uint8_t dst_addr[16];
};
static_assert(sizeof(CmaHeader) == 36);
inline constexpr size_t kUserReqPrivate = kReqPrivate - sizeof(CmaHeader);          // 56
inline constexpr size_t kUserSidrReqPrivate = kSidrReqPrivate - sizeof(CmaHeader);  // 180

}  // namespace shmrdma::cm
