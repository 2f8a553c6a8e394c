#!/usr/bin/env python3
"""Port events reach other processes: stock ibv_asyncwatch (through
`shmrdma run`) sees IBV_EVENT_PORT_ERR and IBV_EVENT_PORT_ACTIVE for port 2
when `shmrdma port --port 2 down` / `up` run in another process, ibv_devinfo
shows the port state in between, and ports 1 and 3 are untouched.
"""

import os
import re
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import systest  # noqa: E402


def wait_for(proc, pattern, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, proc.output()):
            return True
        if proc.poll() is not None:
            return bool(re.search(pattern, proc.output()))
        time.sleep(0.05)
    return False


def port_states(home):
    rc, out = systest._run(home.run_argv(["ibv_devinfo", "-d", "shm0"]))
    if rc != 0:
        systest.fail(f"ibv_devinfo failed (exit {rc}):\n{out}")
    return re.findall(r"state:\s+(PORT_\w+)", out)


def main():
    systest.require_root()
    systest.require_program("ibv_asyncwatch")
    with systest.Home() as home:
        # A three-port device next to shm0 would be another home; shm0 with 3 ports.
        rc, out = home.shmrdma("down", "--force")
        rc, out = home.shmrdma("up", "--ports", "3")
        if rc != 0:
            systest.fail(f"shmrdma up --ports 3 failed:\n{out}")
        watch = systest.Proc("ibv_asyncwatch", home.run_argv(["ibv_asyncwatch", "-d", "shm0"]))
        try:
            if not wait_for(watch, r"async event FD", 20):
                systest.fail("ibv_asyncwatch did not start:\n" + watch.output())
            time.sleep(0.2)
            rc, out = home.shmrdma("port", "--port", "2", "down")
            if rc != 0 or "1 process(es) notified" not in out:
                systest.fail(f"shmrdma port --port 2 down (exit {rc}):\n{out}")
            if not wait_for(watch, r"IBV_EVENT_PORT_ERR \(10\), port 2", 10):
                systest.fail("ibv_asyncwatch saw no IBV_EVENT_PORT_ERR for port 2:\n" + watch.output())
            states = port_states(home)
            if states != ["PORT_ACTIVE", "PORT_DOWN", "PORT_ACTIVE"]:
                systest.fail(f"port states with port 2 down: {states}")
            rc, out = home.shmrdma("port", "--port", "2", "up")
            if rc != 0:
                systest.fail(f"shmrdma port --port 2 up (exit {rc}):\n{out}")
            if not wait_for(watch, r"IBV_EVENT_PORT_ACTIVE \(9\), port 2", 10):
                systest.fail("ibv_asyncwatch saw no IBV_EVENT_PORT_ACTIVE for port 2:\n" + watch.output())
            states = port_states(home)
            if states != ["PORT_ACTIVE"] * 3:
                systest.fail(f"port states after port 2 came back: {states}")
            events = re.findall(r"event_type (\w+) \(\d+\), port (\d+)", watch.output())
            if events != [("IBV_EVENT_PORT_ERR", "2"), ("IBV_EVENT_PORT_ACTIVE", "2")]:
                systest.fail(f"unexpected events {events}:\n" + watch.output())
            rc, out = home.shmrdma("port", "--port", "4", "down")
            if rc == 0:
                systest.fail("shmrdma port --port 4 succeeded on a 3-port device:\n" + out)
            print(watch.output())
        finally:
            watch.kill()


if __name__ == "__main__":
    main()
