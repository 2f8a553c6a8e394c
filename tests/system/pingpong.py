#!/usr/bin/env python3
"""ibv_rc_pingpong / ibv_srq_pingpong / ibv_uc_pingpong / ibv_ud_pingpong
(server + client as separate processes) over shmrdma.

  pingpong.py --tool ibv_rc_pingpong --port 23131 --size 4096 [--iters 200] [--gid IDX|none] [-- EXTRA...]

Runs `TOOL -g 0 -s SIZE -n ITERS -p PORT -c` on both sides (-c: the tool
validates the received buffers). Passes when both exit 0, both print
"ITERS iters in ... seconds" and neither reports invalid data.

--gid none leaves -g out: ibv_ud_pingpong then sends through an address
handle without a GRH (with -g it makes one with the peer's GID).

ibv_xsrq_pingpong (XRC: send QPs into the peer's XRC SRQ through an XRC
domain both open via /tmp/xrc_domain) has other flags: -n is its number of
tests, -c its number of clients, and it neither validates the data nor prints
timings. It runs `TOOL -g 0 -s SIZE -n ITERS -p PORT` on both sides and passes
when both exit 0 and print "success".
"""

import argparse
import os
import re
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import systest  # noqa: E402

ITERS_LINE = re.compile(r"^(\d+) iters in ([\d.]+) seconds = ([\d.]+) usec/iter", re.M)
BYTES_LINE = re.compile(r"^(\d+) bytes in ([\d.]+) seconds", re.M)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--gid", default="0", help="GID index for -g, or 'none' to leave -g out")
    ap.add_argument("--roce", action="store_true",
                    help="across two network namespaces: a RoCE device in each (systest.RoceNet), -d for each side")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()

    systest.require_root()
    systest.require_program(a.tool)
    gid = [] if a.gid == "none" else ["-g", a.gid]
    if a.tool == "ibv_xsrq_pingpong":
        return run_xsrq(a, gid)
    flags = gid + ["-s", str(a.size), "-n", str(a.iters), "-p", str(a.port), "-c"] + a.extra
    if a.roce:
        with systest.RoceNet() as net:
            return check(a, flags, systest.run_pair(net, [a.tool, "-d", net.dev_b] + flags,
                                                    [a.tool, "-d", net.dev_a] + flags + [net.ADDR_B], a.port,
                                                    timeout=a.timeout))
    with systest.Home() as home:
        return check(a, flags, systest.run_pair(home, [a.tool] + flags, [a.tool] + flags + ["localhost"], a.port,
                                                timeout=a.timeout))


def check(a, flags, r):
    print(r.describe())
    if r.server_rc != 0 or r.client_rc != 0:
        systest.fail(f"{a.tool} did not exit 0 on both sides\n" + r.describe())
    for side, out in (("server", r.server_out), ("client", r.client_out)):
        m = ITERS_LINE.search(out)
        if not m:
            systest.fail(f"the {side} printed no 'N iters in' line\n" + r.describe())
        if int(m.group(1)) != a.iters:
            systest.fail(f"the {side} did {m.group(1)} iterations, asked for {a.iters}\n" + r.describe())
        b = BYTES_LINE.search(out)
        # The pingpongs count size * iters * 2 bytes (both directions).
        if not b or int(b.group(1)) != a.size * a.iters * 2:
            systest.fail(f"the {side} reports {b.group(1) if b else 'no'} bytes, expected "
                         f"{a.size * a.iters * 2}\n" + r.describe())
        if "invalid data" in out.lower() or "failed" in out.lower() or "couldn't" in out.lower():
            systest.fail(f"the {side} reports an error\n" + r.describe())
    print(f"PASS: {a.tool} {' '.join(flags)}")
    return 0


def run_xsrq(a, gid):
    flags = gid + ["-s", str(a.size), "-n", str(a.iters), "-p", str(a.port)] + a.extra
    with systest.Home() as home:
        r = systest.run_pair(home, [a.tool] + flags, [a.tool] + flags + ["localhost"], a.port, timeout=a.timeout)
        print(r.describe())
        if r.server_rc != 0 or r.client_rc != 0:
            systest.fail(f"{a.tool} did not exit 0 on both sides\n" + r.describe())
        for side, out in (("server", r.server_out), ("client", r.client_out)):
            if not re.search(r"^success$", out, re.M):
                systest.fail(f"the {side} did not print 'success'\n" + r.describe())
            if "failed" in out.lower() or "couldn't" in out.lower() or "unable" in out.lower():
                systest.fail(f"the {side} reports an error\n" + r.describe())
        print(f"PASS: {a.tool} {' '.join(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
