"""Shared helpers of the system tests: stock RDMA tools run as separate
processes over a private shmrdma device.

Every test gets its own state home (mkdtemp), brings shm0 up there, runs a
server and a client through `shmrdma --home H run PROG ...`, and takes the
device down (--force) and removes the home at the end. Every wait has a
deadline; on a timeout both processes (their whole process groups) are
killed and the test fails.

Exit codes: 0 pass, 1 fail, 77 skip (meson's skip code).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77


def log(msg):
    print(msg, flush=True)


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def skip(msg):
    print("SKIP: " + msg, flush=True)
    sys.exit(SKIP)


def shmrdma_bin():
    b = os.environ.get("SHMRDMA_BIN", "")
    if not b:
        fail("SHMRDMA_BIN is not set (meson passes the path of the shmrdma executable)")
    return b


def require_root():
    if os.geteuid() != 0:
        skip("not root: `shmrdma up` must create the device node under /dev/infiniband")


def require_program(name):
    if shutil.which(name) is None:
        skip(f"{name} is not installed (apt-get install perftest ibverbs-utils)")


def _run(args, timeout=30, env=None):
    try:
        p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           env=env, text=True)
    except subprocess.TimeoutExpired as e:
        return 124, f"{' '.join(args)} timed out after {timeout}s (killed):\n{e.stdout}"
    except OSError as e:
        return 127, f"cannot run {args[0]}: {e}"
    return p.returncode, p.stdout


class Home:
    """A private SHMRDMA_HOME with shm0 up; `with Home() as h:`."""

    def __init__(self):
        self.path = None

    def __enter__(self):
        require_root()
        self.bin = shmrdma_bin()
        self.path = tempfile.mkdtemp(prefix="shmrdma-systest-")
        rc, out = self.shmrdma("up")
        if rc != 0:
            self.cleanup()
            fail(f"shmrdma up failed (exit {rc}):\n{out}")
        return self

    def __exit__(self, *exc):
        self.cleanup()
        return False

    def cleanup(self):
        if not self.path:
            return
        rc, out = _run([self.bin, "--home", self.path, "down", "--force"])
        if rc != 0:
            log(f"warning: shmrdma down --force exited {rc}:\n{out}")
        shutil.rmtree(self.path, ignore_errors=True)
        self.path = None

    def shmrdma(self, *args, timeout=30):
        return _run([self.bin, "--home", self.path, *args], timeout=timeout)

    def run_argv(self, prog_args):
        return [self.bin, "--home", self.path, "run", "--", *prog_args]


def _listening_ports():
    ports = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(f) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    if len(parts) > 3 and parts[3] == "0A":  # TCP_LISTEN
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


class Proc:
    """A child in its own process group, output to a temporary file."""

    def __init__(self, name, argv):
        self.name = name
        self.argv = argv
        self.out_file = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.out_file, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.rc = None

    def poll(self):
        if self.rc is None:
            self.rc = self.p.poll()
        return self.rc

    def wait(self, timeout):
        try:
            self.rc = self.p.wait(timeout=max(timeout, 0.01))
        except subprocess.TimeoutExpired:
            return None
        return self.rc

    def kill(self):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait()

    def output(self):
        self.out_file.seek(0)
        return self.out_file.read()


class PairResult:
    def __init__(self, server, client):
        self.server_rc = server.rc
        self.client_rc = client.rc if client else None
        self.server_out = server.output()
        self.client_out = client.output() if client else ""

    def describe(self):
        return (f"server exit {self.server_rc}, client exit {self.client_rc}\n"
                f"--- server output ---\n{self.server_out}\n--- client output ---\n{self.client_out}")


def run_pair(home, server_args, client_args, port, timeout=60, listen_timeout=20):
    """Starts the server, waits until it listens on `port`, runs the client,
    then waits for both. Kills both and fails the test on any timeout.
    `home` may place the two sides apart (RoceNet: server_argv/client_argv,
    each in its own network namespace, and listening_ports of the server's)."""
    server_argv = getattr(home, "server_argv", home.run_argv)
    client_argv = getattr(home, "client_argv", home.run_argv)
    listening = getattr(home, "listening_ports", _listening_ports)
    if port in listening():
        fail(f"TCP port {port} is already in use by another process; every system test has its own port")
    server = Proc("server", server_argv(server_args))
    client = None
    try:
        deadline = time.monotonic() + listen_timeout
        while port not in listening():
            if server.poll() is not None:
                fail(f"server exited (code {server.rc}) before listening on port {port}:\n{server.output()}")
            if time.monotonic() > deadline:
                fail(f"server did not listen on port {port} within {listen_timeout}s:\n{server.output()}")
            time.sleep(0.05)
        log(f"$ {' '.join(server.argv)}   # server, listening on {port}")
        log(f"$ {' '.join(client_argv(client_args))}")
        t0 = time.monotonic()
        client = Proc("client", client_argv(client_args))
        deadline = t0 + timeout
        if client.wait(deadline - time.monotonic()) is None:
            server.kill()
            client.kill()
            fail(f"client did not finish within {timeout}s (both killed)\n" + PairResult(server, client).describe())
        if server.wait(max(deadline - time.monotonic(), 15)) is None:
            server.kill()
            fail(f"server did not finish after the client exited (killed)\n" + PairResult(server, client).describe())
        log(f"pair finished in {time.monotonic() - t0:.2f}s")
        return PairResult(server, client)
    finally:
        server.kill()
        if client:
            client.kill()


_NUM = re.compile(r"^-?\d+(\.\d+)?$")


def parse_perftest_table(out):
    """The result table of a perftest tool: (header columns, [rows of floats]).
    The header is the line starting with '#bytes'; rows follow it until a
    dashed line."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            header = line.strip()
            rows = []
            for row in lines[i + 1:]:
                s = row.strip()
                if not s or s.startswith("---"):
                    break
                fields = s.split()
                if not all(_NUM.match(f) for f in fields):
                    break
                rows.append([float(f) for f in fields])
            return header, rows
    return None, []


class RoceNet:
    """Two network namespaces joined by a veth pair (addresses 198.18.0.1 and
    198.18.0.2, the benchmarking range), one shared state home, and a RoCE
    device in each: roceA<pid> on the veth end in nsA (the client's side),
    roceB<pid> in nsB (the server's). `with RoceNet() as net:`; the
    namespaces, the veth pair and the devices are removed also on failure.
    Names carry the pid, so concurrent tests never share them."""

    ADDR_A = "198.18.0.1"
    ADDR_B = "198.18.0.2"

    def __init__(self, gid_layout=None):
        pid = os.getpid()
        self.ns_a, self.ns_b = f"shmA{pid}", f"shmB{pid}"
        self.veth_a, self.veth_b = f"shva{pid}", f"shvb{pid}"
        self.dev_a, self.dev_b = f"roceA{pid}", f"roceB{pid}"
        self.gid_layout = gid_layout
        self.path = None
        self.made = []

    def _ip(self, *args):
        rc, out = _run(["ip", *args])
        if rc != 0:
            self.cleanup()
            fail(f"ip {' '.join(args)} failed (exit {rc}):\n{out}")

    def __enter__(self):
        require_root()
        if shutil.which("ip") is None:
            skip("ip (iproute2) is not installed")
        # meson's timeout sends SIGTERM: exit through the `with` so the pair
        # (run_pair's finally), the devices, daemons and namespaces go too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit("killed by SIGTERM (timeout?)"))
        self.bin = shmrdma_bin()
        self.path = tempfile.mkdtemp(prefix="shmrdma-roce-")
        try:
            for ns in (self.ns_a, self.ns_b):
                self._ip("netns", "add", ns)
                self.made.append(("ns", ns))
            self._ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
            self.made.append(("veth", self.veth_a))
            for ns, veth, addr in ((self.ns_a, self.veth_a, self.ADDR_A), (self.ns_b, self.veth_b, self.ADDR_B)):
                self._ip("link", "set", veth, "netns", ns)
                self._ip("-n", ns, "addr", "add", addr + "/24", "dev", veth)
                self._ip("-n", ns, "link", "set", veth, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
            for ns, veth, dev in ((self.ns_a, self.veth_a, self.dev_a), (self.ns_b, self.veth_b, self.dev_b)):
                args = ["up", "--name", dev, "--netdev", veth]
                if self.gid_layout:
                    args += ["--gid-layout", self.gid_layout]
                rc, out = self.shmrdma_in(ns, *args)
                if rc != 0:
                    self.cleanup()
                    fail(f"shmrdma up --netdev {veth} in {ns} failed (exit {rc}):\n{out}")
                self.made.append(("dev", (ns, dev)))
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc):
        self.cleanup()
        return False

    def cleanup(self):
        for kind, what in reversed(self.made):
            if kind == "dev":
                ns, dev = what
                rc, out = self.shmrdma_in(ns, "down", "--force", "--name", dev)
                if rc != 0:
                    log(f"warning: shmrdma down --name {dev} exited {rc}:\n{out}")
            elif kind == "veth":
                _run(["ip", "link", "del", what])  # gone with its namespace already, normally
            elif kind == "ns":
                _run(["ip", "netns", "del", what])
        self.made = []
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def shmrdma_in(self, ns, *args, timeout=30):
        return _run(["ip", "netns", "exec", ns, self.bin, "--home", self.path, *args], timeout=timeout)

    def run_argv_in(self, ns, prog_args):
        return ["ip", "netns", "exec", ns, self.bin, "--home", self.path, "run", "--", *prog_args]

    def server_argv(self, prog_args):
        return self.run_argv_in(self.ns_b, prog_args)

    def client_argv(self, prog_args):
        return self.run_argv_in(self.ns_a, prog_args)

    run_argv = client_argv

    def listening_ports(self):
        ports = set()
        rc, out = _run(["ip", "netns", "exec", self.ns_b, "cat", "/proc/net/tcp", "/proc/net/tcp6"])
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3] == "0A" and ":" in parts[1]:
                try:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
                except ValueError:
                    pass
        return ports
