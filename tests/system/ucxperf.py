#!/usr/bin/env python3
"""ucx_perftest (UCT level) over a RoCE device of shmrdma, server and client
in two network namespaces (systest.RoceNet).

ucx_perftest's server takes the test's parameters from the client, the
device name included: at the UCT level both processes open the client's
device (roceA), so the server in the other namespace runs with
SHMRDMA_NETNS_MODE=shared, which lists every device of the home there (as
this tool needs the kernel's shared netns mode with rxe; in the default,
exclusive view each namespace lists only its own RoCE device).

  ucxperf.py --tl ud_verbs --test am_lat --port 23331 [--size 8] [--iters 500]
             [--private-sys] [-- -D bcopy]

Both sides run `ucx_perftest -x TL -d DEV:1` under `shmrdma run` (with
--private-sys: `shmrdma run --private-sys`, so UCX reads our GID types from
/sys/class/infiniband). Passes when both exit 0, nothing says WARN or ERROR,
and the client's "Final:" line has the iteration count asked for with
non-zero latencies and message rates. A message UCX drops on receive (its ud
transport checks the destination address in the GRH area) would hang the
pair: the deadline fails it.
"""

import argparse
import os
import re
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import systest  # noqa: E402

_FINAL = re.compile(r"^Final:\s+(\d+)\s+(.*)$", re.M)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tl", required=True, help="UCT transport: rc_verbs, ud_verbs")
    ap.add_argument("--test", required=True, help="ucx_perftest -t: am_lat, put_lat, am_bw, ...")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--timeout", type=int, default=45)
    ap.add_argument("--private-sys", action="store_true", help="shmrdma run --private-sys on both sides")
    ap.add_argument("extra", nargs="*", help="more ucx_perftest flags for both sides (after --), e.g. -D bcopy")
    a = ap.parse_args()

    systest.require_root()
    systest.require_program("ucx_perftest")
    flags = ["-t", a.test, "-s", str(a.size), "-n", str(a.iters), "-x", a.tl, "-p", str(a.port)] + a.extra
    with systest.RoceNet() as net:
        run = ["run", "--private-sys"] if a.private_sys else ["run"]

        def side(dev, ns, extra, env=()):
            # UCX_NET_DEVICES keeps UCX's own device scan to ours; -d names it for UCT.
            return (["ip", "netns", "exec", ns, "env", f"UCX_NET_DEVICES={dev}:1", *env, net.bin, "--home", net.path] +
                    run + ["--", "ucx_perftest", "-d", f"{dev}:1"] + flags + extra)

        # The server opens the device the client names (see above).
        net.server_argv = lambda _args: side(net.dev_b, net.ns_b, [], ["SHMRDMA_NETNS_MODE=shared"])
        net.client_argv = lambda _args: side(net.dev_a, net.ns_a, [net.ADDR_B])
        r = systest.run_pair(net, [], [], a.port, timeout=a.timeout)
    print(r.client_out)
    if r.server_rc != 0 or r.client_rc != 0:
        systest.fail(f"ucx_perftest did not exit 0 on both sides\n" + r.describe())
    for who, out in (("server", r.server_out), ("client", r.client_out)):
        bad = [line for line in out.splitlines() if " WARN " in line or " ERROR " in line]
        if bad:
            systest.fail(f"the {who} printed UCX warnings or errors:\n" + "\n".join(bad) + "\n" + r.describe())
    m = _FINAL.search(r.client_out)
    if not m:
        systest.fail("no 'Final:' line in the client's output\n" + r.describe())
    iters = int(m.group(1))
    vals = [float(v) for v in m.group(2).split()]
    if iters != a.iters:
        systest.fail(f"{iters} iterations in the Final line, asked for {a.iters}\n" + r.describe())
    # 50%ile, average, overall latency (usec); average, overall MB/s; average, overall msg/s.
    # (MB/s is printed with two decimals: 8-byte messages on a loaded machine show 0.00.)
    if len(vals) < 7 or not all(v > 0 for v in vals[0:3] + vals[5:7]) or not all(v >= 0 for v in vals[3:5]):
        systest.fail(f"Final line values {vals} (latencies and message rates must be > 0)\n" + r.describe())
    print(f"PASS: ucx_perftest {' '.join(flags)} across namespaces ({net.dev_a} -> {net.dev_b})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
