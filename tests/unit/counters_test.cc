// SPDX-License-Identifier: MIT
//
// Unit tests for src/counters.h: summing one context's counters (its
// per-port block and QP records) treats what it reads as untrusted numbers,
// and folding keeps the sum unchanged.
#include "counters.h"

#include <gtest/gtest.h>

#include <memory>

namespace shmrdma {
namespace {

struct Fake {
  layout::ContextCounters block{};
  std::unique_ptr<layout::QpCounterRecord[]> recs{new layout::QpCounterRecord[8]()};
};

layout::DeviceRecord dev(uint32_t ports) {
  layout::DeviceRecord d{};
  d.num_ports = ports;
  for (uint32_t p = 0; p < ports; ++p) d.ports[p].lid = static_cast<uint16_t>(p + 1);
  return d;
}

TEST(Counters, SumsBlockAndRecordsPerPort) {
  Fake f;
  f.block.ports[0][layout::kCntXmitPkts].store(5);
  f.block.ports[1][layout::kCntRcvBytes].store(7);
  f.block.qp_hwm.store(2);
  f.recs[0].port[layout::kGroupLocal].store(1);
  f.recs[0].v[layout::kGroupLocal][layout::kCntXmitPkts].store(3);
  f.recs[0].port[layout::kGroupRemote].store(2);
  f.recs[0].v[layout::kGroupRemote][layout::kCntRcvBytes].store(11);
  f.recs[1].port[layout::kGroupLocal].store(2);
  f.recs[1].v[layout::kGroupLocal][layout::kCntSendErr].store(1);
  PortCounters out[2];
  sum_context_counters(&f.block, f.recs.get(), 8, 2, out);
  EXPECT_EQ(out[0].v[layout::kCntXmitPkts], 8u);
  EXPECT_EQ(out[1].v[layout::kCntRcvBytes], 18u);
  EXPECT_EQ(out[1].v[layout::kCntSendErr], 1u);
  EXPECT_EQ(out[0].v[layout::kCntRcvBytes], 0u);
}

TEST(Counters, UntrustedPortsAndHighWaterMarkAreBounded) {
  Fake f;
  f.block.qp_hwm.store(1000000);  // clamped to the 8 records
  f.recs[0].port[0].store(0);     // no port yet
  f.recs[0].v[0][0].store(100);
  f.recs[1].port[0].store(3);     // beyond the device's 2 ports
  f.recs[1].v[0][0].store(100);
  f.recs[2].port[0].store(0xffffffff);
  f.recs[2].v[0][0].store(100);
  f.recs[7].port[1].store(1);
  f.recs[7].v[1][0].store(4);
  PortCounters out[2];
  sum_context_counters(&f.block, f.recs.get(), 8, 2, out);
  EXPECT_EQ(out[0].v[0], 4u);
  EXPECT_EQ(out[1].v[0], 0u);
  // A seqlock left odd (a dead owner mid-fold) still gives an answer.
  f.block.seq.store(1);
  PortCounters again[2];
  sum_context_counters(&f.block, f.recs.get(), 8, 2, again);
  EXPECT_EQ(again[0].v[0], 4u);
}

TEST(Counters, FoldingAndSwitchingPortsKeepTheSum) {
  Fake f;
  CounterSink k;
  k.attach(&f.block, f.recs.get(), 8, dev(2), nullptr);
  layout::QpCounterRecord* r = k.claim(3);
  ASSERT_EQ(r, &f.recs[3]);
  EXPECT_EQ(f.block.qp_hwm.load(), 4u);
  std::atomic<uint64_t>* g = k.group(r, layout::kGroupRemote, 1);
  ASSERT_NE(g, nullptr);
  g[layout::kCntRcvPkts].store(6);
  g = k.group(r, layout::kGroupRemote, 2);  // another port: port 1's counts are folded first
  ASSERT_NE(g, nullptr);
  g[layout::kCntRcvPkts].store(g[layout::kCntRcvPkts].load() + 2);
  EXPECT_EQ(k.group(r, layout::kGroupRemote, 3), nullptr);  // not a port of the device
  EXPECT_EQ(k.group(r, layout::kGroupRemote, 0), nullptr);
  auto t = k.totals();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].v[layout::kCntRcvPkts], 6u);
  EXPECT_EQ(t[1].v[layout::kCntRcvPkts], 2u);
  k.fold_record(r);  // destroy_qp
  EXPECT_EQ(r->v[layout::kGroupRemote][layout::kCntRcvPkts].load(), 0u);
  EXPECT_EQ(r->port[layout::kGroupRemote].load(), 0u);
  t = k.totals();
  EXPECT_EQ(t[0].v[layout::kCntRcvPkts], 6u);
  EXPECT_EQ(t[1].v[layout::kCntRcvPkts], 2u);
  EXPECT_EQ(f.block.seq.load() % 2, 0u);
  EXPECT_EQ(k.lid_port(2), 2u);
  EXPECT_EQ(k.lid_port(9), 0u);
}

// A destination on another device of the home: the group is labelled with
// that device's home id, port and tag; its own device's sum never sees it,
// the other device's (ForeignFilter) sees exactly the groups for it.
TEST(Counters, ForeignGroupsCountForTheirDeviceOnly) {
  Fake f;
  CounterSink k;
  k.attach(&f.block, f.recs.get(), 8, dev(2), nullptr);
  layout::QpCounterRecord* r = k.claim(0);
  layout::QpCounterRecord* r2 = k.claim(1);
  ASSERT_TRUE(r && r2);
  EXPECT_GT(foreign_label(1, 1), 0xffu);
  EXPECT_EQ(label_home_id(foreign_label(77, 2)), 77u);
  EXPECT_EQ(label_port(foreign_label(77, 2)), 2u);
  std::atomic<uint64_t>* g = k.group(r, layout::kGroupRemote, foreign_label(7, 1), 0x1234);
  ASSERT_NE(g, nullptr);
  g[layout::kCntRcvPkts].store(5);
  // The same device id with another tag (a recreated device) is another label.
  std::atomic<uint64_t>* g2 = k.group(r2, layout::kGroupRemote, foreign_label(7, 1), 0x9999);
  ASSERT_NE(g2, nullptr);
  g2[layout::kCntRcvPkts].store(100);
  // Local groups are never foreign, nor are ports beyond kMaxPorts.
  EXPECT_EQ(k.group(r, layout::kGroupLocal, foreign_label(7, 1), 0x1234), nullptr);
  EXPECT_EQ(k.group(r, layout::kGroupRemote, foreign_label(7, 0), 0x1234), nullptr);
  EXPECT_EQ(k.group(r, layout::kGroupRemote, foreign_label(7, 200), 0x1234), nullptr);
  std::atomic<uint64_t>* l = k.group(r, layout::kGroupLocal, 1);
  ASSERT_NE(l, nullptr);
  l[layout::kCntXmitPkts].store(5);
  auto own = k.totals();
  ASSERT_EQ(own.size(), 2u);
  EXPECT_EQ(own[0].v[layout::kCntXmitPkts], 5u);
  EXPECT_EQ(own[0].v[layout::kCntRcvPkts] + own[1].v[layout::kCntRcvPkts], 0u);  // not ours
  PortCounters theirs[2];
  const ForeignFilter flt{7, 0x1234};
  sum_context_counters(&f.block, f.recs.get(), 8, 2, theirs, &flt);
  EXPECT_EQ(theirs[0].v[layout::kCntRcvPkts], 5u);
  EXPECT_EQ(theirs[0].v[layout::kCntXmitPkts], 0u);  // the sender's own port is not theirs
  EXPECT_EQ(theirs[1].v[layout::kCntRcvPkts], 0u);
  PortCounters other[2];
  const ForeignFilter flt8{8, 0x1234};
  sum_context_counters(&f.block, f.recs.get(), 8, 2, other, &flt8);
  EXPECT_EQ(other[0].v[layout::kCntRcvPkts], 0u);
  // Close without a directory: the foreign groups are folded away (their
  // device cannot be found), ours stay.
  auto homes = k.fold_foreign();
  ASSERT_EQ(homes.size(), 1u);
  EXPECT_EQ(homes[0], 7u);
  EXPECT_EQ(r->port[layout::kGroupRemote].load(), 0u);
  EXPECT_EQ(r->v[layout::kGroupRemote][layout::kCntRcvPkts].load(), 0u);
  EXPECT_EQ(k.totals()[0].v[layout::kCntXmitPkts], 5u);
  EXPECT_EQ(f.block.seq.load() % 2, 0u);
}

TEST(Counters, SysfsNamesAndUnits) {
  PortCounters c;
  c.v[layout::kCntXmitBytes] = 4003;
  c.v[layout::kCntXmitPkts] = 10;
  c.v[layout::kCntMcastXmitPkts] = 3;
  uint64_t data = 0, ucast = 0;
  for (const auto& n : ib_counters(c)) {
    if (n.name == "port_xmit_data") data = n.value;
    if (n.name == "unicast_xmit_packets") ucast = n.value;
  }
  EXPECT_EQ(data, 1000u);  // 4-octet units
  EXPECT_EQ(ucast, 7u);
  EXPECT_EQ(ib_counters(c).size(), 21u);
  bool lifespan = false;
  for (const auto& n : hw_counters(c)) lifespan |= n.name == "lifespan";
  EXPECT_TRUE(lifespan);
}

}  // namespace
}  // namespace shmrdma
