#!/usr/bin/env python3
"""Port counters of RoCE devices for traffic between devices: a stock
pingpong pair across the two namespaces of systest.RoceNet (the server on
roceB in nsB, the client on roceA in nsA), then every device's counters must
show what it received from the other and what it sent, exactly:

  roce_counters.py --tool ibv_rc_pingpong|ibv_ud_pingpong --size N --port P [--iters 200]

Each side sends `iters` SENDs of `size` bytes and receives as many: RC over
the path MTU 1024 (active_mtu of a 1500-byte veth) is ceil(size / 1024)
packets a message, UD one packet. Checked in the sysfs snapshot the closing
contexts leave (ports/1/counters, ports/1/hw_counters: read before anything
else refreshes them) and in `shmrdma counters --json` of each namespace.
"""

import argparse
import json
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import systest  # noqa: E402


def sysfs_counters(net, dev):
    base = os.path.join(net.path, "sys", "class", "infiniband", dev, "ports", "1")
    out = {}
    for kind in ("counters", "hw_counters"):
        d = os.path.join(base, kind)
        if not os.path.isdir(d):
            systest.fail(f"{d} is missing")
        out[kind] = {}
        for name in os.listdir(d):
            with open(os.path.join(d, name)) as f:
                out[kind][name] = int(f.read().strip())
    return out


def json_counters(net, ns, dev):
    rc, out = net.shmrdma_in(ns, "counters", "--name", dev, "--json")
    if rc != 0:
        systest.fail(f"shmrdma counters --name {dev} --json exited {rc}:\n{out}")
    try:
        port = json.loads(out)["devices"][0]["ports"][0]
    except (ValueError, KeyError, IndexError) as e:
        systest.fail(f"shmrdma counters --json: {e}:\n{out}")
    return {"counters": port["counters"], "hw_counters": port["hw_counters"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True, choices=["ibv_rc_pingpong", "ibv_ud_pingpong"])
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()

    systest.require_root()
    systest.require_program(a.tool)
    flags = ["-g", "1", "-s", str(a.size), "-n", str(a.iters), "-p", str(a.port)]
    pkts = a.iters * (1 if a.tool == "ibv_ud_pingpong" else -(-a.size // 1024))
    nbytes = a.iters * a.size
    want = {
        "counters": {"port_rcv_packets": pkts, "port_xmit_packets": pkts, "port_rcv_data": nbytes // 4,
                     "port_xmit_data": nbytes // 4, "unicast_rcv_packets": pkts},
        "hw_counters": {"rcvd_pkts": pkts, "sent_pkts": pkts, "rcvd_bytes": nbytes, "sent_bytes": nbytes,
                        "rdma_recvs": a.iters, "rdma_sends": a.iters, "rcvd_ud_invalid": 0, "rcvd_ud_dropped": 0},
    }
    with systest.RoceNet() as net:
        r = systest.run_pair(net, [a.tool, "-d", net.dev_b] + flags, [a.tool, "-d", net.dev_a] + flags + [net.ADDR_B],
                             a.port)
        if r.server_rc != 0 or r.client_rc != 0:
            systest.fail(f"{a.tool} did not exit 0 on both sides\n" + r.describe())
        errors = []
        for ns, dev in ((net.ns_a, net.dev_a), (net.ns_b, net.dev_b)):
            for where, got in (("sysfs", sysfs_counters(net, dev)), ("shmrdma counters", json_counters(net, ns, dev))):
                for kind, names in want.items():
                    for name, value in names.items():
                        if got[kind].get(name) != value:
                            errors.append(f"{dev} {where} {kind}/{name} = {got[kind].get(name)}, want {value}")
        if errors:
            systest.fail("\n".join(errors) + "\n" + r.describe())
    print(f"PASS: {a.tool} {' '.join(flags)}: both devices counted {pkts} packets / {nbytes} bytes each way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
