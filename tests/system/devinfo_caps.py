#!/usr/bin/env python3
"""Stock `ibv_devinfo -v` (through `shmrdma run`) shows the capabilities of
issue 14: the ODP caps (general and per transport), the device memory size
and the completion timestamp clock and mask.
"""

import os
import re
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import systest  # noqa: E402


def section(out, name):
    """The indented flag lines that follow `name:` in ibv_devinfo -v."""
    m = re.search(name + r":\s*\n((?:\t\t\t\t\t[A-Z_]+\n)+)", out)
    return m.group(1).split() if m else []


def main():
    systest.require_root()
    systest.require_program("ibv_devinfo")
    with systest.Home() as home:
        rc, out = systest._run(home.run_argv(["ibv_devinfo", "-v", "-d", "shm0"]))
        if rc != 0:
            systest.fail(f"ibv_devinfo -v failed (exit {rc}):\n{out}")
        want = {
            "general_odp_caps": ["ODP_SUPPORT", "ODP_SUPPORT_IMPLICIT"],
            "rc_odp_caps": ["SUPPORT_SEND", "SUPPORT_RECV", "SUPPORT_WRITE", "SUPPORT_READ", "SUPPORT_ATOMIC",
                            "SUPPORT_SRQ"],
            "uc_odp_caps": ["SUPPORT_SEND", "SUPPORT_RECV", "SUPPORT_WRITE", "SUPPORT_SRQ"],
            "ud_odp_caps": ["SUPPORT_SEND", "SUPPORT_RECV", "SUPPORT_SRQ"],
            "xrc_odp_caps": ["SUPPORT_SEND", "SUPPORT_RECV", "SUPPORT_WRITE", "SUPPORT_READ", "SUPPORT_ATOMIC",
                             "SUPPORT_SRQ"],
        }
        for name, flags in want.items():
            got = section(out, name)
            if got != flags:
                systest.fail(f"{name}: {got}, expected {flags}\n{out}")
        checks = [
            (r"maximum available device memory:\s+262144Bytes", "max_dm_size"),
            (r"completion timestamp_mask:\s+0xffffffffffffffff", "completion timestamp mask"),
            (r"hca_core_clock:\s+1000000kHZ", "hca_core_clock"),
        ]
        for pattern, what in checks:
            if not re.search(pattern, out):
                systest.fail(f"ibv_devinfo -v does not show the {what} ({pattern}):\n{out}")
        systest.log("ibv_devinfo -v shows the ODP caps, max_dm_size and the timestamp clock")


if __name__ == "__main__":
    main()
