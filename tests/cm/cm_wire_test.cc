// The IB CM wire format (src/cm/wire.h): big-endian fields, the bit packing
// the spec draws, and what a receiver accepts as a CM MAD.
#include <gtest/gtest.h>

#include <cstring>

#include "cm/wire.h"

namespace {

using namespace shmrdma::cm;

TEST(CmWire, FieldsAreBigEndianAtTheirOffsets) {
  Mad m;
  init_mad(&m, kAttrReq, 0x0102030405060708ull);
  const auto* raw = reinterpret_cast<const uint8_t*>(&m);
  EXPECT_EQ(raw[0], 1);     // base version
  EXPECT_EQ(raw[1], 0x07);  // CM class
  EXPECT_EQ(raw[2], 2);     // class version
  EXPECT_EQ(raw[3], 0x03);  // Send
  for (int i = 0; i < 8; ++i) EXPECT_EQ(raw[8 + i], i + 1) << "transaction id byte " << i;
  EXPECT_EQ(raw[16], 0x00);
  EXPECT_EQ(raw[17], 0x10);  // attribute REQ
  m.req.local_comm_id.set(0xa1b2c3d4);
  EXPECT_EQ(raw[24], 0xa1);
  EXPECT_EQ(raw[27], 0xd4);
  m.req.service_id.set(0x0000000001060000ull | 7471);
  EXPECT_EQ(raw[24 + 8 + 5], 0x06);
  EXPECT_EQ(raw[24 + 8 + 6], 7471 >> 8);
  EXPECT_EQ(raw[24 + 8 + 7], 7471 & 0xff);
}

TEST(CmWire, BitFieldsPackAsTheSpecDrawsThem) {
  Mad m;
  init_mad(&m, kAttrReq, 1);
  Req& q = m.req;
  q.qpn_resp.set_bits(31, 8, 0xabcdef);
  q.qpn_resp.set_bits(7, 0, 0x42);
  EXPECT_EQ(q.qpn_resp.get(), 0xabcdef42u);
  q.psn_misc.set_bits(31, 8, 0x123456);
  q.psn_misc.set_bits(7, 3, 20);
  q.psn_misc.set_bits(2, 0, 7);
  EXPECT_EQ(q.psn_misc.bits(31, 8), 0x123456u);
  EXPECT_EQ(q.psn_misc.bits(7, 3), 20u);
  EXPECT_EQ(q.psn_misc.bits(2, 0), 7u);
  EXPECT_EQ(q.psn_misc.b[3], (20 << 3) | 7);
  q.mtu_rnr.set_bits(7, 4, 3);  // IBV_MTU_1024
  q.mtu_rnr.set_bits(2, 0, 6);
  EXPECT_EQ(q.mtu_rnr.b[0], 0x36);
  // Setting one field leaves its neighbours alone, and values are masked.
  q.qpn_resp.set_bits(7, 0, 0x1ff);
  EXPECT_EQ(q.qpn_resp.bits(31, 8), 0xabcdefu);
  EXPECT_EQ(q.qpn_resp.bits(7, 0), 0xffu);
}

TEST(CmWire, ReceiversAcceptOnlyCmMadsOfTheRightSize) {
  Mad m;
  init_mad(&m, kAttrRep, 9);
  EXPECT_TRUE(valid_mad(&m, sizeof m));
  EXPECT_FALSE(valid_mad(&m, sizeof m - 1));
  EXPECT_FALSE(valid_mad(&m, sizeof m + 1));
  Mad bad = m;
  bad.hdr.mgmt_class = 0x01;
  EXPECT_FALSE(valid_mad(&bad, sizeof bad));
  bad = m;
  bad.hdr.class_version = 1;
  EXPECT_FALSE(valid_mad(&bad, sizeof bad));
  bad = m;
  bad.hdr.attr_id.set(0x0019);  // LAP: not served
  EXPECT_FALSE(valid_mad(&bad, sizeof bad));
  bad.hdr.attr_id.set(0x000f);
  EXPECT_FALSE(valid_mad(&bad, sizeof bad));
}

TEST(CmWire, PrivateDataRoomIsTheKernels) {
  EXPECT_EQ(kUserReqPrivate, 56u);
  EXPECT_EQ(kUserSidrReqPrivate, 180u);
  EXPECT_EQ(kRepPrivate, 196u);
  EXPECT_EQ(kRejPrivate, 148u);
  EXPECT_EQ(kSidrRepPrivate, 136u);
}

TEST(CmWire, MraAndPathFieldsSitWhereTheSpecPutsThem) {
  // MRA (IBA 12.6.6): comm ids, message MRAed in the top 2 bits of byte 8,
  // service timeout in the top 5 bits of byte 9, private data from byte 10.
  Mad m;
  init_mad(&m, kAttrMra, 3);
  m.mra.local_comm_id.set(0x11223344);
  m.mra.remote_comm_id.set(0x55667788);
  m.mra.msg_mraed.set_bits(7, 6, 1);  // REP
  m.mra.service_timeout.set_bits(7, 3, 24);
  const auto* p = reinterpret_cast<const uint8_t*>(&m) + sizeof(MadHeader);
  EXPECT_EQ(p[0], 0x11);
  EXPECT_EQ(p[7], 0x88);
  EXPECT_EQ(p[8], 0x40);
  EXPECT_EQ(p[9], 24 << 3);
  EXPECT_EQ(offsetof(Mra, private_data), 10u);
  EXPECT_TRUE(valid_mad(&m, sizeof m));
  // The REQ's primary path: flow label 31..12 and packet rate 5..0 of the
  // word at 36 of the path, SL in the top nibble of byte 42, subnet local bit 3.
  Mad q;
  init_mad(&q, kAttrReq, 4);
  q.req.primary.flow_rate.set_bits(31, 12, 0xABCDE);
  q.req.primary.flow_rate.set_bits(5, 0, 3);
  q.req.primary.sl_subnet.set_bits(7, 4, 5);
  q.req.primary.sl_subnet.set_bits(3, 3, 1);
  const auto* r = reinterpret_cast<const uint8_t*>(&q.req.primary);
  EXPECT_EQ(r[36], 0xAB);
  EXPECT_EQ(r[37], 0xCD);
  EXPECT_EQ(r[38], 0xE0);
  EXPECT_EQ(r[39], 0x03);
  EXPECT_EQ(r[42], 0x58);
}

}  // namespace
