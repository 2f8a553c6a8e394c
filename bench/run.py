#!/usr/bin/env python3
"""shmrdma benchmark harness: shmrdma beside its peers and beside the floor.

    bench/run.sh [--quick] [--rounds N] [--only REGEX] ...   (see --help)

One run:
  1. installs what is missing from Debian packages (perftest, ucx-utils,
     libfabric-bin, python3-matplotlib), builds shmrdma (ninja -C build) and
     the floor probes in bench/probes/ (cc -O2, into bench/.build/);
  2. brings up a private shmrdma device (a fresh SHMRDMA_HOME);
  3. runs ROUNDS rounds; a round goes through every comparison group
     (same size, same kind of figure) and in each group runs the shmrdma
     perftest pairs and then the peers' pairs (ucx_perftest, fi_pingpong),
     server pinned to CPU A and client to CPU B; a cache-line ping-pong probe
     is taken before each round and after the last, so every round is labelled
     "near", "far" or "smt" (vCPU placement: two cores close together, far
     apart, or two hardware threads of one core), and after every run, so
     that each run is labelled by its own probes too (the placement can flip
     within a round; the near figures are those of near runs); the memcpy / CMA probes
     run before the first round and (but with --quick) after the last, the
     spin floor (ib_write_lat's own loop with a plain store) at every boundary;
  4. writes bench/results/latest.{md,csv,png}.

Every process pair runs under `timeout` and a Python-side deadline; a pair
that fails or hangs is killed and recorded as a failure with its reason.
Python 3 standard library only; the plot is drawn by bench/plot.py with
matplotlib, in this interpreter or in /usr/bin/python3 (Debian's).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
PROBES_SRC = os.path.join(BENCH, "probes")
PROBES_BIN = os.path.join(BENCH, ".build")

KiB = 1024
MiB = 1024 * 1024
DEVICE = "shm0"  # the device `shmrdma up` makes in the run's private SHMRDMA_HOME

# Debian package per binary the harness needs.
NEEDED = {
    "ib_write_lat": "perftest",
    "ucx_perftest": "ucx-utils",
    "fi_pingpong": "libfabric-bin",
    "mpirun": "openmpi-bin",  # the Open MPI ping-pong (probes/mpi_pingpong.c)
    "mpicc": "libopenmpi-dev",
    "taskset": "util-linux",
    "timeout": "coreutils",
}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def human_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.{digits}f}"


# --------------------------------------------------------------------------
# What runs: process pairs ("Spec"), comparison rows ("Row"), groups.
# --------------------------------------------------------------------------


@dataclass
class Spec:
    """One process pair (server + client) of one tool at one size."""

    key: str  # unique, e.g. "shmrdma/ib_write_lat/2"
    impl: str  # shmrdma | ucx | fi | ucx-verbs (UCX over shmrdma) | mpi
    variant: str  # shmrdma | posix | sm | uct-posix | shm | rc_verbs | ucx-rc_v (over shmrdma) | ucx-sm | vader
    test: str  # ib_write_lat, tag_lat, pingpong, ...
    size: int
    server: list[str]  # argv without the wrapper (timeout/taskset/shmrdma run); [] for one command (mpirun)
    client: list[str]  # argv, the server host included
    env: dict[str, str] = field(default_factory=dict)
    parser: str = "perftest"  # perftest | ucx | fi
    timeout: float = 40.0

    @property
    def label(self) -> str:
        if self.impl == "shmrdma":
            return f"shmrdma {self.test}"
        if self.impl == "ucx":
            return f"ucx {self.test} ({self.variant})"
        if self.impl == "ucx-verbs":
            return f"ucx {self.test} (rc_verbs over shmrdma)"
        if self.impl == "mpi":
            return {"ucx-rc_v": "Open MPI ping-pong (pml ucx, rc_v over shmrdma)",
                    "ucx-sm": "Open MPI ping-pong (pml ucx, UCX sm)"}.get(
                        self.variant, "Open MPI ping-pong (pml ob1, btl vader)")
        return f"fi_pingpong ({self.variant})"

    @property
    def on_shmrdma(self) -> bool:
        """Runs under `shmrdma run` (uses the device)."""
        return self.impl in ("shmrdma", "ucx-verbs") or (self.impl == "mpi" and self.variant == "ucx-rc_v")


@dataclass
class Row:
    """One line of the results table: a shmrdma figure, its floor, its peers."""

    rid: str
    label: str
    kind: str  # lat (us, lower is better) | bw (GB/s) | rate (Mmsg/s)
    shm: str  # Spec key
    size: int
    floor: str | None  # floor formula name, see floor_value()
    peers: list[str]  # Spec keys


@dataclass
class Result:
    spec: Spec
    ok: bool
    figures: dict[str, float]
    reason: str
    duration: float
    load1: float
    cmd: str
    group: str = ""
    # the cache-line probes right before and after this run (ns): the placement
    # can flip within a round, so each run is classed by its own
    probe_before: float | None = None
    probe_after: float | None = None


FIGURE_UNITS = {
    "lat_us": "us",
    "lat_avg_us": "us",
    "bw_GBps": "GB/s",
    "rate_Mpps": "Mmsg/s",
}


def primary_figure(kind: str) -> str:
    return {"lat": "lat_us", "bw": "bw_GBps", "rate": "rate_Mpps"}[kind]


class Plan:
    """Builds every Spec and Row of a run, from the mode's iteration counts."""

    def __init__(self, quick: bool, shmrdma: str, ucx_tls: list[str], host: str, mpi_probe: str | None = None,
                 mpi_env: list[str] | None = None):
        self.quick = quick
        self.mpi_probe = mpi_probe
        self.mpi_env = mpi_env or []
        self.shmrdma = shmrdma
        self.host = host
        self.ucx_tls = ucx_tls
        self.specs: dict[str, Spec] = {}
        self.rows: list[Row] = []
        self.groups: list[tuple[str, list[str]]] = []
        self._build()

    # iteration counts: (default, quick)
    def n(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def add(self, spec: Spec) -> str:
        assert spec.key not in self.specs, spec.key
        self.specs[spec.key] = spec
        return spec.key

    # ---- the tools ----
    def perftest(self, tool: str, size: int | None, iters: int, extra: list[str] | None = None,
                 tag: str = "", timeout: float = 40.0) -> str:
        args = [tool]
        if size is not None:
            args += ["-s", str(size)]
        args += ["-n", str(iters)] + (extra or [])
        test = tool + (f" {tag}" if tag else "")
        key = f"shmrdma/{tool}{'/' + tag.replace(' ', '') if tag else ''}/{size or 8}"
        return self.add(Spec(key, "shmrdma", "shmrdma", test, size or 8, args, args, parser="perftest",
                             timeout=timeout))

    def ucx(self, test: str, size: int, iters: int, tls: str, uct: bool = False, warmup: int | None = None,
            timeout: float = 40.0, extra: list[str] | None = None) -> str:
        args = ["-t", test, "-s", str(size), "-n", str(iters), "-f", "-v"] + (extra or [])
        if warmup is not None:
            args += ["-w", str(warmup)]
        if uct:
            args += ["-x", "posix", "-d", "memory"]
            variant = "uct-posix"
            env = {}
        else:
            variant = tls
            env = {"UCX_TLS": f"{tls},self"}
        key = f"ucx/{test}/{variant}/{size}"
        return self.add(Spec(key, "ucx", variant, test, size, ["ucx_perftest"], ["ucx_perftest"] + args, env=env,
                             parser="ucx", timeout=timeout))

    def ucxv(self, test: str, size: int, iters: int, warmup: int, timeout: float = 40.0) -> str:
        """A UCT test over rc_verbs on the shmrdma device: what UCX (and MPI over
        it) get, async thread and all."""
        args = ["-t", test, "-s", str(size), "-n", str(iters), "-f", "-v", "-w", str(warmup),
                "-x", "rc_verbs", "-d", f"{DEVICE}:1"]
        env = {"UCX_NET_DEVICES": f"{DEVICE}:1", "UCX_TLS": "rc_verbs"}
        key = f"ucx-verbs/{test}/rc_verbs/{size}"
        return self.add(Spec(key, "ucx-verbs", "rc_verbs", test, size, ["ucx_perftest"], ["ucx_perftest"] + args,
                             env=env, parser="ucx", timeout=timeout))

    def mpi(self, variant: str, size: int, iters: int, timeout: float = 60.0) -> str | None:
        """The Open MPI ping-pong (one mpirun, two ranks): pml ucx with
        UCX_TLS=rc_v over shmrdma, pml ucx with UCX's own shared memory
        (UCX_TLS=sm: the same MPI and UCP layers without shmrdma), or pml ob1
        with btl vader (no RDMA)."""
        if not self.mpi_probe:
            return None
        argv = ["mpirun", "-np", "2", "--bind-to", "none"]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if variant in ("ucx-rc_v", "ucx-sm"):
            argv += ["--mca", "pml", "ucx", "--mca", "osc", "^ucx", "--mca", "btl", "^openib,uct"]
        if variant == "ucx-rc_v":
            argv += ["-x", "UCX_TLS=rc_v,self", "-x", f"UCX_NET_DEVICES={DEVICE}:1"]
            for kv in self.mpi_env:  # --shmrdma-env reaches the ranks
                argv += ["-x", kv.partition("=")[0]]
        elif variant == "ucx-sm":
            # pml ucx declines to run unless UCX offers one of pml_ucx_tls on
            # one of pml_ucx_devices (Open MPI 4.1: rc_verbs, ..., on mlx*).
            argv += ["--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any", "-x", "UCX_TLS=sm,self"]
        else:
            argv += ["--mca", "pml", "ob1", "--mca", "btl", "vader,self"]
        argv += [self.mpi_probe, str(size), str(iters)]
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
        key = f"mpi/pingpong/{variant}/{size}"
        return self.add(Spec(key, "mpi", variant, "pingpong", size, [], argv, env=env, parser="mpi", timeout=timeout))

    def fi(self, size: int, iters: int, timeout: float = 40.0) -> str:
        args = ["-p", "shm", "-e", "rdm", "-S", str(size), "-I", str(iters)]
        key = f"fi/pingpong/shm/{size}"
        return self.add(Spec(key, "fi", "shm", "fi_pingpong", size, ["fi_pingpong"] + args, ["fi_pingpong"] + args,
                             parser="fi", timeout=timeout))

    def row(self, rid, label, kind, shm, size, floor, peers) -> None:
        self.rows.append(Row(rid, label, kind, shm, size, floor, [p for p in peers if p]))

    def _build(self) -> None:
        n = self.n
        tls = self.ucx_tls
        P = self.perftest

        def ucp(test, size, iters, **kw):
            return [self.ucx(test, size, iters, t, **kw) for t in tls]

        # ---------------- latency, small ----------------
        for size in (2, 64):
            g = []
            s_send = P("ib_send_lat", size, n(20000, 5000))
            s_write = P("ib_write_lat", size, n(20000, 5000))
            s_read = P("ib_read_lat", size, n(20000, 5000))
            g += [s_send, s_write, s_read]
            psize = 8 if size == 2 else size  # UCX/libfabric runs at 8 B where perftest uses 2 B
            tag = ucp("tag_lat", psize, n(100000, 20000), warmup=n(10000, 2000))
            am = self.ucx("am_lat", psize, n(100000, 20000), "posix", uct=True, warmup=n(10000, 2000))
            put = self.ucx("put_lat", psize, n(100000, 20000), "posix", uct=True, warmup=n(10000, 2000))
            # one outstanding operation: a latency, like ib_read_lat's
            get = ucp("ucp_get", psize, n(100000, 20000), warmup=n(10000, 2000), extra=["-O", "1"])
            fi = self.fi(8, n(10000, 2000)) if size == 2 else None
            if size == 2:
                s_atomic = P("ib_atomic_lat", None, n(20000, 5000))
                fadd = ucp("ucp_fadd", 8, n(100000, 20000), warmup=n(10000, 2000), extra=["-O", "1"])
                g.append(s_atomic)
            g += tag + [am, put] + get + ([fi] if fi else [])
            if size == 2:
                g += fadd
            sz = human_size(size)
            self.row(f"send_lat_{size}", f"ib_send_lat {sz}", "lat", s_send, size, "handoff", tag + [am, fi])
            self.row(f"write_lat_{size}", f"ib_write_lat {sz}", "lat", s_write, size, "handoff", [put, am])
            self.row(f"read_lat_{size}", f"ib_read_lat {sz}", "lat", s_read, size, "handoff", get)
            if size == 2:
                self.row("atomic_lat_8", "ib_atomic_lat 8 B", "lat", s_atomic, 8, "handoff", fadd)
            self.groups.append((f"lat {sz}", g))

        # ---------------- latency, large ----------------
        for size, lat_iters, ucx_iters, fi_iters in ((64 * KiB, n(2000, 500), n(2000, 500), n(1000, 300)),
                                                     (MiB, n(300, 100), n(300, 100), n(200, 50))):
            s_send = P("ib_send_lat", size, lat_iters, timeout=60)
            s_write = P("ib_write_lat", size, lat_iters, timeout=60)
            tag = ucp("tag_lat", size, ucx_iters, warmup=n(100, 20), timeout=60)
            put = ucp("ucp_put_lat", size, ucx_iters, warmup=n(100, 20), timeout=60)
            fi = self.fi(size, fi_iters, timeout=60)
            sz = human_size(size)
            self.row(f"send_lat_{size}", f"ib_send_lat {sz}", "lat", s_send, size, "handoff+copy", tag + [fi])
            self.row(f"write_lat_{size}", f"ib_write_lat {sz}", "lat", s_write, size, "handoff+copy", put)
            self.groups.append((f"lat {sz}", [s_send, s_write] + tag + put + [fi]))

        # ---------------- bandwidth / message rate ----------------
        # perftest's bandwidth tests have no warm-up, time the whole run, and
        # unless told -N (or given more than 20,000 iterations) store a
        # timestamp per post and per completion in arrays malloc()ed for the
        # run, whose pages are first touched inside the timed loop (on a
        # shadow-paging guest ~10 us each, one page per 512 messages): -N,
        # and runs long enough (30-80 ms) that the first touches of the
        # buffers and queues are a small part of them, so the figure is the
        # steady state, as the memcpy floor's and UCX's (with warm-up) are.
        # A 4 KiB run of 20,000 iterations measured half the rate of one of
        # 200,000 (bench/README.md).
        bw_iters = {8: (n(100000, 20000), n(1000000, 200000)),
                    4 * KiB: (n(200000, 5000), n(50000, 10000)),
                    64 * KiB: (n(50000, 1000), n(5000, 1000)),
                    MiB: (n(2000, 200), n(500, 200))}
        for size, (pt_iters, ucx_iters) in bw_iters.items():
            kind = "rate" if size == 8 else "bw"
            floor = None if size == 8 else "memcpy"
            sz = human_size(size)
            to = 60 if size >= MiB else 40
            s_write = P("ib_write_bw", size, pt_iters, ["-N"], timeout=to)
            s_send = P("ib_send_bw", size, pt_iters, ["-N"], timeout=to)
            s_read = P("ib_read_bw", size, pt_iters, ["-N"], timeout=to)
            g = [s_write, s_send, s_read]
            s_q16 = None
            if size in (8, 64 * KiB):
                s_q16 = P("ib_write_bw", size, max(pt_iters // 4, 100), ["-q", "16", "-N"], tag="-q 16",
                          timeout=to)
                g.append(s_q16)
            tag = ucp("tag_bw", size, ucx_iters, warmup=n(1000, 200) if size < MiB else n(50, 10), timeout=to)
            put = self.ucx("put_bw", size, ucx_iters, "posix", uct=True,
                           warmup=n(1000, 200) if size < MiB else n(50, 10), timeout=to)
            if size == 8:
                am = self.ucx("am_bw", 8, ucx_iters, "posix", uct=True, warmup=n(10000, 2000), timeout=to)
                get = [f"ucx/ucp_get/{t}/8" for t in tls]  # the latency group's runs serve the rate row too
                g += tag + [put, am]
                write_peers, send_peers = [put, am], tag + [am]
            else:
                get = ucp("ucp_get", size, ucx_iters, warmup=n(1000, 200) if size < MiB else n(50, 10), timeout=to)
                g += tag + [put] + get
                write_peers, send_peers = [put], tag
            what = "msg rate" if kind == "rate" else "BW"
            self.row(f"write_bw_{size}", f"ib_write_bw {sz} {what}", kind, s_write, size, floor, write_peers)
            self.row(f"send_bw_{size}", f"ib_send_bw {sz} {what}", kind, s_send, size, floor, send_peers)
            self.row(f"read_bw_{size}", f"ib_read_bw {sz} {what}", kind, s_read, size, floor, get)
            if s_q16:
                self.row(f"write_bw_q16_{size}", f"ib_write_bw -q 16 {sz} {what}", kind, s_q16, size, floor,
                         write_peers)
            self.groups.append((f"bw {sz}", g))

        # ---------------- what applications get: UCX and Open MPI over shmrdma ----------------
        # UCX always runs an async thread (so does everything built on it):
        # these rows hold UCX over rc_verbs on shmrdma against perftest over the
        # same device in the same round (targets: put_lat, am_lat <= 1.5x;
        # put_bw >= 0.5x), and Open MPI over UCX against Open MPI's own
        # shared memory (vader).
        g = []
        v_put = self.ucxv("put_lat", 8, n(100000, 20000), n(10000, 2000))
        v_am = self.ucxv("am_lat", 8, n(100000, 20000), n(10000, 2000))
        v_bw = self.ucxv("put_bw", 8, n(1000000, 200000), n(10000, 2000))
        g += [v_put, v_am, v_bw]
        self.row("ucxv_put_lat_8", "ucx put_lat 8 B, rc_verbs over shmrdma (peer: ib_write_lat 2 B)", "lat", v_put,
                 8, "handoff", ["shmrdma/ib_write_lat/2"])
        self.row("ucxv_am_lat_8", "ucx am_lat 8 B, rc_verbs over shmrdma (peer: ib_send_lat 2 B)", "lat", v_am, 8,
                 "handoff", ["shmrdma/ib_send_lat/2"])
        self.row("ucxv_put_bw_8", "ucx put_bw 8 B msg rate, rc_verbs over shmrdma (peer: ib_write_bw 8 B)", "rate",
                 v_bw, 8, None, ["shmrdma/ib_write_bw/8"])
        for size, iters in ((8, n(20000, 5000)), (KiB, n(20000, 5000)), (64 * KiB, n(2000, 500)), (MiB, n(200, 50))):
            mu = self.mpi("ucx-rc_v", size, iters)
            mv = self.mpi("vader", size, iters)
            if not mu:
                continue
            g += [mu, mv]
            sz = human_size(size)
            if size == 8:
                self.row("mpi_lat_8", "Open MPI ping-pong 8 B, pml ucx rc_v over shmrdma (peer: vader)", "lat", mu,
                         size, "handoff", [mv])
                # The same MPI and UCP layers over UCX's own shared memory:
                # what pml ucx costs without shmrdma, so the row above can be
                # read as transport cost plus the layers' own.
                ms = self.mpi("ucx-sm", size, iters)
                g.append(ms)
                self.row("mpi_lat_8_ucx_sm", "Open MPI ping-pong 8 B, pml ucx rc_v over shmrdma (peer: pml ucx over "
                         "UCX sm)", "lat", mu, size, "handoff", [ms])
            elif size == KiB:
                # A message UCX sends by copy (bcopy, up to its 8 KiB
                # segments): one SEND of one SGE into the SRQ. No target.
                self.row("mpi_lat_1k", "Open MPI ping-pong 1 KiB, pml ucx rc_v over shmrdma (peer: vader)", "lat", mu,
                         size, "handoff", [mv])
            else:
                self.row(f"mpi_bw_{size}", f"Open MPI stream {sz} BW, pml ucx rc_v over shmrdma (peer: vader)", "bw",
                         mu, size, "memcpy", [mv])
        self.groups.append(("apps", g))

    def restrict(self, pattern: str) -> None:
        """Keeps the rows whose id or label matches, and the runs they need."""
        rx = re.compile(pattern)
        self.rows = [r for r in self.rows if rx.search(r.rid) or rx.search(r.label)]
        need = set()
        for r in self.rows:
            need.add(r.shm)
            need.update(r.peers)
        self.groups = [(name, [k for k in keys if k in need]) for name, keys in self.groups]
        self.groups = [(name, keys) for name, keys in self.groups if keys]


# --------------------------------------------------------------------------
# Output parsers: tool output -> standard figures (+ the tool's own ones).
# --------------------------------------------------------------------------

MIB_PER_S_TO_GBPS = MiB / 1e9  # perftest and ucx_perftest print MB/s with MB = 2^20 bytes


def parse_perftest(out: str) -> dict[str, float]:
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes"):
            header = line
            for row in lines[i + 1:]:
                toks = row.split()
                if toks and re.fullmatch(r"\d+", toks[0]):
                    vals = [float(t) for t in toks if re.fullmatch(r"[-+0-9.eE]+", t)]
                    if "t_typical" in header and len(vals) >= 9:
                        names = ["bytes", "iters", "t_min_us", "t_max_us", "t_typical_us", "t_avg_us",
                                 "t_stdev_us", "p99_us", "p999_us"]
                        f = dict(zip(names, vals))
                        f["lat_us"] = f["t_typical_us"]
                        f["lat_avg_us"] = f["t_avg_us"]
                        return f
                    if "BW average" in header and len(vals) >= 5:
                        f = {"bytes": vals[0], "iters": vals[1], "bw_peak_MiBps": vals[2],
                             "bw_avg_MiBps": vals[3], "msgrate_Mpps": vals[4]}
                        f["bw_GBps"] = vals[3] * MIB_PER_S_TO_GBPS
                        f["rate_Mpps"] = vals[4]
                        return f
                    raise ValueError(f"unrecognised perftest row: {row.strip()!r}")
            raise ValueError("perftest table has no data row")
    raise ValueError("no perftest result table (#bytes ...) in the client's output")


def parse_ucx(out: str) -> dict[str, float]:
    lines = out.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("iterations,") and i + 1 < len(lines):
            names = lines[i].strip().split(",")
            vals = lines[i + 1].strip().split(",")
            if len(vals) != len(names):
                break
            raw = {k: float(v) for k, v in zip(names, vals)}
            pct = [k for k in raw if k.endswith("_percentile_lat")]
            f = {"iters": raw["iterations"], "lat_p50_us": raw[pct[0]] if pct else float("nan"),
                 "lat_moving_avg_us": raw["avg_lat"], "lat_overall_us": raw["overall_lat"],
                 "bw_avg_MiBps": raw["avg_bw"], "bw_overall_MiBps": raw["overall_bw"],
                 "mr_avg_pps": raw["avg_mr"], "mr_overall_pps": raw["overall_mr"]}
            f["lat_us"] = f["lat_p50_us"]
            f["lat_avg_us"] = f["lat_overall_us"]
            f["bw_GBps"] = raw["overall_bw"] * MIB_PER_S_TO_GBPS
            f["rate_Mpps"] = raw["overall_mr"] / 1e6
            return f
    raise ValueError("no ucx_perftest result (iterations,... CSV line) in the client's output")


def parse_fi(out: str) -> dict[str, float]:
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.split()[:2] == ["bytes", "#sent"] and i + 1 < len(lines):
            toks = lines[i + 1].split()
            # bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
            if len(toks) < 8:
                break
            mbps, usec, mx = float(toks[5]), float(toks[6]), float(toks[7])
            f = {"MBps_1e6": mbps, "usec_per_xfer": usec, "Mxfers_per_s": mx}
            f["lat_us"] = usec  # one-way (half round trip), mean: fi_pingpong prints no median
            f["lat_avg_us"] = usec
            f["bw_GBps"] = mbps / 1e3
            f["rate_Mpps"] = mx
            return f
    raise ValueError("no fi_pingpong result line (bytes #sent ...) in the client's output")


def parse_mpi(out: str) -> dict[str, float]:
    for line in out.splitlines():
        if line.startswith("mpi_pingpong "):
            kv = dict(t.split("=", 1) for t in line.split()[1:] if "=" in t)
            f = {"bytes": float(kv["bytes"]), "iters": float(kv["iters"]), "lat_us": float(kv["lat_us"]),
                 "bw_GBps": float(kv["bw_GBps"])}
            f["lat_avg_us"] = f["lat_us"]
            f["rate_Mpps"] = f["bw_GBps"] * 1e3 / max(f["bytes"], 1)
            return f
    raise ValueError("no `mpi_pingpong bytes=...` line in mpirun's output")


PARSERS = {"perftest": parse_perftest, "ucx": parse_ucx, "fi": parse_fi, "mpi": parse_mpi}


# --------------------------------------------------------------------------
# Running process pairs.
# --------------------------------------------------------------------------


def listening_ports() -> set[int]:
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[3] == "0A":
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


def used_ports() -> set[int]:
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) > 2:
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return ports


class Ports:
    """Distinct TCP ports for every pair, skipping ports in any use."""

    def __init__(self, base: int):
        self.next = base

    def get(self) -> int:
        busy = used_ports()
        while self.next in busy or self.next > 60000:
            self.next = 20000 if self.next > 60000 else self.next + 1
        p = self.next
        self.next += 1
        return p


CONNECT_FAILURE = re.compile(r"Couldn't connect|Unable to open file descriptor for socket connection|"
                             r"connect\(\) failed|Connection refused|ctrl/connect|ctrl_init", re.I)


def kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


NOISE = re.compile(r"^(#bytes|local address|remote address|-+$|\*+$|\+-+)|\|\s*$")
ERRORS = re.compile(r"error|fail|couldn|unable|refused|abort|denied|not found|no such|invalid|cannot|timed? ?out",
                    re.I)


def tail(text: str, n: int = 3, width: int = 240) -> str:
    """The lines of a tool's output that say why it failed: its error lines
    if it printed any, else its last lines (table headers left out)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not NOISE.search(ln.strip())]
    errs = [ln for ln in lines if ERRORS.search(ln)]
    s = " / ".join((errs or lines)[-n:])
    return s[:width]


class Runner:
    def __init__(self, args, shmrdma: str, home: str, ports: Ports):
        self.args = args
        self.shmrdma = shmrdma
        self.home = home
        self.ports = ports
        cpus = args.cpus.split(",")
        self.cpu_server, self.cpu_client = cpus[0], cpus[1]
        self.env = dict(os.environ)
        self.env["SHMRDMA_HOME"] = home
        if SNAPSHOT_DIR:
            self.env["SHMRDMA_PROVIDER_DIR"] = os.path.join(SNAPSHOT_DIR, "providers", "shmrdma")
        for kv in args.shmrdma_env:
            k, _, v = kv.partition("=")
            self.env[k] = v

    def wrap(self, spec: Spec, argv: list[str], cpu: str, limit: float) -> list[str]:
        w = ["timeout", "-k", "2", f"{limit:.0f}"] + sched_prefix(self.args) + ["taskset", "-c", cpu]
        if spec.on_shmrdma:
            w += [self.shmrdma, "run"]
        return w + argv

    def port_args(self, spec: Spec, port: int, side: str) -> list[str]:
        if spec.impl == "shmrdma":
            return ["-p", str(port)]
        if spec.impl in ("ucx", "ucx-verbs"):
            return ["-p", str(port)]
        return ["-B", str(port)] if side == "server" else ["-P", str(port)]

    def run_one(self, spec: Spec) -> Result:
        """A spec that is one command (mpirun starts both ranks), on both CPUs."""
        limit = spec.timeout * self.args.timeout_scale
        env = dict(self.env)
        env.update(spec.env)
        argv = self.wrap(spec, spec.client, f"{self.cpu_server},{self.cpu_client}", limit)
        cmd = " ".join(shlex.quote(a) for a in argv)
        t0 = time.monotonic()
        load1 = os.getloadavg()[0]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                             start_new_session=True, stdin=subprocess.DEVNULL)
        boost(self.args, p.pid)
        try:
            out, _ = p.communicate(timeout=limit + 5)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            kill_group(p)
            out, _ = p.communicate()
            rc = 124
        finally:
            kill_group(p)
        out = out or ""
        figures: dict[str, float] = {}
        ok, reason = False, ""
        if rc in (124, 137, -9):
            reason = f"timeout: killed after {limit:.0f}s: {tail(out, 2) or 'nothing'}"
        elif rc != 0:
            reason = f"rc={rc}: {tail(out)}"
        else:
            try:
                figures = PARSERS[spec.parser](out)
                ok = True
            except (ValueError, KeyError, IndexError) as e:
                reason = f"unparsable output ({e}): {tail(out)}"
        if self.args.keep_logs:
            d = os.path.join(self.args.out, "logs")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{spec.key.replace('/', '_')}.{int(time.time() * 1000)}.log"), "w") as f:
                f.write(f"$ {cmd}\n--- (rc={rc})\n{out}\n")
        return Result(spec, ok, figures, reason, time.monotonic() - t0, load1, cmd)

    def run(self, spec: Spec) -> Result:
        if not spec.server:
            return self.run_one(spec)
        port = self.ports.get()
        limit = spec.timeout * self.args.timeout_scale
        env = dict(self.env)
        env.update(spec.env)
        server_argv = self.wrap(spec, spec.server + self.port_args(spec, port, "server"), self.cpu_server, limit + 5)
        client_argv = self.wrap(spec, spec.client + self.port_args(spec, port, "client") + [self.args.host],
                                self.cpu_client, limit)
        cmd = " ".join(shlex.quote(a) for a in server_argv) + "  &&  " + " ".join(shlex.quote(a) for a in client_argv)
        t0 = time.monotonic()
        load1 = os.getloadavg()[0]
        sout = tempfile.TemporaryFile(mode="w+")
        server = subprocess.Popen(server_argv, stdout=sout, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True, stdin=subprocess.DEVNULL)
        boost(self.args, server.pid)
        client: subprocess.Popen | None = None
        client_out, client_rc, reason = "", None, ""
        try:
            # wait until the server listens (or dies)
            deadline = time.monotonic() + 10
            while port not in listening_ports():
                if server.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            for attempt in range(5):
                if server.poll() is not None:
                    break
                client = subprocess.Popen(client_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                          text=True, start_new_session=True, stdin=subprocess.DEVNULL)
                boost(self.args, client.pid)
                try:
                    client_out, _ = client.communicate(timeout=limit + 5)
                    client_rc = client.returncode
                except subprocess.TimeoutExpired:
                    kill_group(client)
                    client_out, _ = client.communicate()
                    client_rc = 124
                if client_rc == 0 or not CONNECT_FAILURE.search(client_out or ""):
                    break
                time.sleep(0.3 * (attempt + 1))
            # the server finishes on its own right after the client
            try:
                server.wait(timeout=10 if client_rc == 0 else 2)
            except subprocess.TimeoutExpired:
                pass
        finally:
            kill_group(server)
            if client is not None:
                kill_group(client)
        client_out = client_out or ""
        sout.seek(0)
        server_out = sout.read()
        sout.close()
        dur = time.monotonic() - t0
        figures: dict[str, float] = {}
        ok = False
        if client_rc is None:
            reason = f"server exited (rc={server.returncode}) before a client could run: {tail(server_out)}"
        elif client_rc in (124, 137, -9):
            reason = (f"timeout: killed after {limit:.0f}s; client said: {tail(client_out, 2) or 'nothing'}; "
                      f"server said: {tail(server_out, 2) or 'nothing'}")
        elif client_rc != 0:
            reason = f"client rc={client_rc}: {tail(client_out)}; server rc={server.returncode}: {tail(server_out, 2)}"
        else:
            try:
                figures = PARSERS[spec.parser](client_out)
                ok = True
            except (ValueError, KeyError, IndexError) as e:
                reason = f"unparsable output ({e}): {tail(client_out)}"
        if ok and server.returncode not in (0, None) and spec.impl == "shmrdma":
            # keep the figures but say it: a perftest server should exit 0
            reason = f"server rc={server.returncode}: {tail(server_out, 2)}"
        if self.args.keep_logs:
            d = os.path.join(self.args.out, "logs")
            os.makedirs(d, exist_ok=True)
            name = spec.key.replace("/", "_")
            with open(os.path.join(d, f"{name}.{int(time.time() * 1000)}.log"), "w") as f:
                f.write(f"$ {cmd}\n--- client (rc={client_rc})\n{client_out}\n--- server (rc={server.returncode})\n"
                        f"{server_out}\n")
        return Result(spec, ok, figures, reason, dur, load1, cmd)


# --------------------------------------------------------------------------
# Probes.
# --------------------------------------------------------------------------


def build_probes(cc: str) -> dict[str, str]:
    os.makedirs(PROBES_BIN, exist_ok=True)
    out = {}
    # the headers beside them (probe_util.h, probe_verbs.h): what they share
    headers = max((os.path.getmtime(os.path.join(PROBES_SRC, h)) for h in os.listdir(PROBES_SRC)
                   if h.endswith(".h")), default=0)
    for src in sorted(os.listdir(PROBES_SRC)):
        if not src.endswith((".c", ".cc")):
            continue
        name = os.path.splitext(src)[0]
        path = os.path.join(PROBES_SRC, src)
        binp = os.path.join(PROBES_BIN, name)
        if name.startswith("mpi_") and not shutil.which("mpicc"):
            log(f"no mpicc (Debian: libopenmpi-dev): probe {name} and the Open MPI rows are left out")
            continue
        newest = max(os.path.getmtime(path), headers)
        if not os.path.exists(binp) or os.path.getmtime(binp) < newest:
            compiler = cc if src.endswith(".c") else os.environ.get("CXX", "c++")
            if name.startswith("mpi_"):
                compiler = "mpicc"
            cmd = [compiler, "-O2", "-Wall", "-Wextra", "-o", binp, path]
            with open(path, encoding="utf-8") as f:
                if "<infiniband/verbs.h>" in f.read():
                    cmd.append("-libverbs")  # a verbs probe (qp_memory), run under `shmrdma run`
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if r.returncode != 0:
                raise SystemExit(f"probe build failed: {' '.join(cmd)}\n{r.stdout}")
        out[name] = binp
    return out


def boost(args, pid: int) -> None:
    """Gives the new session of `pid` the nice value asked for. With
    autogroup scheduling (kernel.sched_autogroup_enabled, Debian's default)
    the CPU is shared between sessions first and a process's own nice value
    only counts inside its session, so without this every other session's
    build still takes its full share from a busy-polling pair."""
    if args.rt or not args.nice:
        return
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(args.nice))
    except OSError:
        pass


def sched_prefix(args) -> list[str]:
    """How every measured process is started: nice, or SCHED_FIFO with --rt."""
    if args.rt:
        return ["chrt", "-f", "1"]
    return ["nice", "-n", str(args.nice)] if args.nice else []


def run_probe(args, argv: list[str], timeout: float = 60,
              env: dict[str, str] | None = None) -> tuple[dict[str, float], str]:
    p = subprocess.Popen(["timeout", "-k", "2", str(int(timeout))] + sched_prefix(args) + argv,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         stdin=subprocess.DEVNULL, env=env)
    boost(args, p.pid)
    try:
        out, err = p.communicate(timeout=timeout + 5)
    except subprocess.TimeoutExpired:
        kill_group(p)
        return {}, f"timeout after {timeout}s"
    finally:
        kill_group(p)
    r = subprocess.CompletedProcess(argv, p.returncode, out, err)
    vals = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                vals[parts[0]] = float(parts[1])
            except ValueError:
                pass
    if r.returncode != 0:
        return vals, f"rc={r.returncode}: {tail(r.stderr + r.stdout)}"
    return vals, ""


# --------------------------------------------------------------------------
# Setup: packages, shmrdma build, device.
# --------------------------------------------------------------------------


def python_with_matplotlib() -> str | None:
    candidates = [sys.executable, "/usr/bin/python3"]
    for py in candidates:
        if py and os.path.exists(py):
            r = subprocess.run([py, "-c", "import matplotlib"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if r.returncode == 0:
                return py
    return None


def ensure_packages(notes: list[str]) -> None:
    missing = sorted({pkg for binary, pkg in NEEDED.items() if shutil.which(binary) is None})
    if not os.path.exists("/usr/bin/python3") or python_with_matplotlib() is None:
        missing.append("python3-matplotlib")
    if not missing:
        return
    log(f"installing missing packages: {' '.join(missing)}")
    if os.geteuid() != 0 and shutil.which("sudo") is None:
        notes.append(f"could not install {' '.join(missing)} (not root, no sudo)")
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = sudo + ["apt-get", "install", "-y", "-q", "--no-install-recommends"] + missing
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        subprocess.run(sudo + ["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        notes.append(f"apt-get install {' '.join(missing)} failed: {tail(r.stdout)}")
        log(notes[-1])


def build_shmrdma(args, notes: list[str]) -> str:
    """Builds shmrdma and returns the shmrdma command to benchmark: a private
    snapshot of the build tree's command and plugin, so that a rebuild during
    the run (others build in build/ too) cannot change or remove what is
    measured."""
    if args.shmrdma:
        return os.path.abspath(args.shmrdma)
    build = os.path.join(REPO, "build")
    if not args.no_build:
        if not os.path.exists(os.path.join(build, "build.ninja")):
            # A release build, as scripts/demo.sh sets up the same directory: figures of
            # meson's default (debugoptimized) would not be the ones users get.
            log("configuring shmrdma (meson setup build --buildtype=release -Dtests=false)")
            subprocess.run(["bash", os.path.join(REPO, "scripts", "install-deps.sh")], cwd=REPO)
            subprocess.run(["meson", "setup", "build", "--buildtype=release", "-Dtests=false"], cwd=REPO)
        out = ""
        for attempt in range(3):
            log("building shmrdma (ninja -C build)")
            plugin = plugin_targets(build)
            # the shim too: `shmrdma run` preloads it (completion channels, which UCX needs)
            targets = ["tools/shmrdma", "tools/shim/libshmrdma-shim.so"] + plugin if plugin else []
            r = subprocess.run(["ninja", "-C", build] + targets, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out = r.stdout
            if r.returncode == 0:
                break
            time.sleep(10)
        else:
            notes.append(f"ninja -C build failed ({tail(out, 2)}); benchmarked the existing build")
            log(notes[-1])
    for attempt in range(6):
        snap = snapshot_build(build)
        if snap:
            return snap
        log("build/tools/shmrdma or its plugin is missing (a rebuild in progress?); retrying in 10 s")
        time.sleep(10)
    raise SystemExit("no usable build/tools/shmrdma and build/providers/shmrdma/libshmrdma-rdmav*.so")


def plugin_targets(build: str) -> list[str]:
    d = os.path.join(build, "providers", "shmrdma")
    names = [n[:-2] for n in os.listdir(d) if n.startswith("libshmrdma-rdmav") and n.endswith(".so.p")] \
        if os.path.isdir(d) else []
    return [f"providers/shmrdma/{n}" for n in names]


SNAPSHOT_DIR: str | None = None


def snapshot_build(build: str) -> str | None:
    """Copies the command, the plugin and the shim, in the build tree's layout
    (the command finds the plugin at ../providers/shmrdma/ and the shim at
    shim/), to a private folder."""
    global SNAPSHOT_DIR
    exe = os.path.join(build, "tools", "shmrdma")
    pdir = os.path.join(build, "providers", "shmrdma")
    plugins = [n for n in os.listdir(pdir) if re.fullmatch(r"libshmrdma-rdmav\d+\.so", n)] \
        if os.path.isdir(pdir) else []
    if not os.path.exists(exe) or not plugins:
        return None
    snap = tempfile.mkdtemp(prefix="shmrdma-bench-build-")
    try:
        os.makedirs(os.path.join(snap, "tools"))
        os.makedirs(os.path.join(snap, "providers", "shmrdma"))
        shutil.copy2(exe, os.path.join(snap, "tools", "shmrdma"))
        for p in plugins:
            shutil.copy2(os.path.join(pdir, p), os.path.join(snap, "providers", "shmrdma", p))
        shim = os.path.join(build, "tools", "shim", "libshmrdma-shim.so")
        if os.path.exists(shim):  # `shmrdma run` finds it at <exe dir>/shim/ in the build layout
            os.makedirs(os.path.join(snap, "tools", "shim"))
            shutil.copy2(shim, os.path.join(snap, "tools", "shim", "libshmrdma-shim.so"))
        r = subprocess.run([os.path.join(snap, "tools", "shmrdma"), "--help"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)
        if r.returncode != 0:
            raise OSError("the copied shmrdma --help failed")
    except (OSError, subprocess.SubprocessError):
        shutil.rmtree(snap, ignore_errors=True)
        return None
    SNAPSHOT_DIR = snap
    return os.path.join(snap, "tools", "shmrdma")


def shmrdma_processes(shmrdma: str, env: dict) -> str:
    """The processes `shmrdma status --json` lists on any device ('' when none)."""
    try:
        st = subprocess.run([shmrdma, "status", "--json"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=30)
        data = json.loads(st.stdout)
        procs = [p for d in data.get("devices", []) for p in d.get("processes", [])]
        return json.dumps(procs)[:400] if procs else ""
    except Exception as e:  # noqa: BLE001 - informational only
        return f"(status --json unreadable: {e})"


def git_describe() -> str:
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "src", "providers", "tools"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.strip()
        return head + (" + uncommitted changes in src/providers/tools" if dirty else "")
    except OSError:
        return "?"


def meson_buildtype() -> str:
    try:
        r = subprocess.run(["meson", "introspect", "--buildoptions", os.path.join(REPO, "build")],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        opts = {o["name"]: o["value"] for o in json.loads(r.stdout)}
        return f"buildtype={opts.get('buildtype')}, b_ndebug={opts.get('b_ndebug')}"
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# --------------------------------------------------------------------------
# Statistics and reports.
# --------------------------------------------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def iqr(xs):
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def cost_ratio(kind: str, shm: float | None, other: float | None) -> float | None:
    """How many times slower shmrdma is than `other` (>1: shmrdma slower)."""
    if shm is None or other is None or shm <= 0 or other <= 0:
        return None
    return shm / other if kind == "lat" else other / shm


def better(kind: str, a: float, b: float) -> bool:
    return a < b if kind == "lat" else a > b


class Report:
    def __init__(self, args, plan: Plan, command: str):
        self.args = args
        self.plan = plan
        self.command = command
        self.results: list[tuple[int, Result]] = []  # (round, result)
        self.probes: list[tuple[int, str, dict[str, float], str]] = []  # (boundary, kind, values, error)
        self.notes: list[str] = []
        self.meta: dict[str, str] = {}
        self.meta_history: dict = load_history()

    # ---- placement ----
    def boundary_pingpong(self) -> dict[int, float]:
        out = {}
        for b, kind, vals, _err in self.probes:
            if kind == "pingpong" and "cacheline_halfrtt_ns_median" in vals:
                out[b] = vals["cacheline_halfrtt_ns_median"]
        return out

    def best_probe(self) -> float | None:
        """The run's best cache-line probe between two cores: SMT probes (--smt-max-ns) are left out."""
        vals = [v for v in self.boundary_pingpong().values() if v > self.args.smt_max_ns]
        return min(vals) if vals else None

    def classify(self, probes: list[float]) -> str:
        """The placement the cache-line probes around a round or a run show."""
        if probes and any(p <= self.args.smt_max_ns for p in probes):
            # Two hardware threads of one core at either end: the round or run
            # went (at least partly) with the L1/L2 shared, a placement of its
            # own that says nothing about near or far.
            return "smt"
        best = self.best_probe()
        if best is None or not probes:
            return "unknown"
        # Near: within near_factor of the run's best, and a hand-off that is
        # near in absolute terms (a run whose every probe is far, ~200 ns, has
        # no near round however alike they are).
        return ("near" if max(probes) <= self.args.near_factor * best
                and max(probes) <= self.args.near_max_ns else "far")

    def placement(self) -> dict[int, tuple[float | None, float | None, str]]:
        pp = self.boundary_pingpong()
        out = {}
        for r in range(1, self.args.rounds + 1):
            before, after = pp.get(r - 1), pp.get(r)
            out[r] = (before, after, self.classify([p for p in (before, after) if p is not None]))
        return out

    def run_probe_pair(self, rnd: int, res: "Result") -> tuple[float | None, float | None]:
        """The probes before and after one run: its own, else (a report of a
        harness that probed only between rounds) its round's."""
        if res.probe_before is not None or res.probe_after is not None:
            return res.probe_before, res.probe_after
        pp = self.boundary_pingpong()
        return pp.get(rnd - 1), pp.get(rnd)

    def run_probes(self, rnd: int, res: "Result") -> list[float]:
        return [p for p in self.run_probe_pair(rnd, res) if p is not None]

    def run_label(self, rnd: int, res: "Result") -> str:
        return self.classify(self.run_probes(rnd, res))

    def probe_values(self, name: str) -> list[float]:
        return [vals[name] for _b, _k, vals, _e in self.probes if name in vals]

    def near_probe_values(self, name: str) -> list[float]:
        """name's values from probes whose own hand-off was near (pingpong's,
        spin_floor's, stream_bw's); the other probes tell no placement."""
        own = {"pingpong": "cacheline_halfrtt_ns_median", "spin_floor": "spin2_handoff_ns_median",
               "stream_bw": "stream_handoff_ns_median"}
        return [vals[name] for _b, k, vals, _e in self.probes
                if name in vals and k in own and own[k] in vals and self.classify([vals[own[k]]]) == "near"]

    # ---- floors ----
    def floor_value(self, row: Row, around: list[float] | None = None) -> tuple[float | None, str]:
        """The row's floor: over the whole run, or for one run whose cache-line
        hand-off is the mean of the probes around it (run_probes). The whole
        run's hand-off is the median of the rounds' boundary probes (the last
        probe at each boundary), not of every probe: --wait-near probes a far
        placement again and again until it turns near, and those far probes
        stand for no round."""
        cl = median(list(self.boundary_pingpong().values()))
        if around:
            cl = statistics.mean(around)
        if row.floor is None:
            return None, ""
        if row.floor == "handoff":
            return (cl / 1000 if cl else None), "cache-line hand-off"
        if row.floor == "handoff+copy":
            bw = median(self.probe_values(f"memcpy_GBps_{row.size}"))
            if not cl or not bw:
                return None, ""
            return cl / 1000 + row.size / (bw * 1e3), "hand-off + one memcpy"
        if row.floor == "memcpy":
            bw = median(self.probe_values(f"memcpy_GBps_{row.size}"))
            return bw, "memcpy"
        return None, ""

    # ---- per spec ----
    def values(self, key: str, fig: str, near: bool = False) -> list[float]:
        """The figure of every run of key (near: of its runs with near placement)."""
        return [res.figures[fig] for r, res in self.results
                if res.spec.key == key and res.ok and fig in res.figures
                and (not near or self.run_label(r, res) == "near")]

    def by_round(self, key: str, fig: str) -> dict[int, tuple[float, "Result"]]:
        return {r: (res.figures[fig], res) for r, res in self.results
                if res.spec.key == key and res.ok and fig in res.figures}

    def failures(self, key: str) -> list[tuple[int, str]]:
        return [(r, res.reason) for r, res in self.results if res.spec.key == key and not res.ok]

    def attempts(self, key: str) -> int:
        return sum(1 for _r, res in self.results if res.spec.key == key)

    def summary_rows(self) -> list[dict]:
        rows = []
        for row in self.plan.rows:
            fig = primary_figure(row.kind)
            vals = self.values(row.shm, fig)
            med = median(vals)
            near_med = median(self.values(row.shm, fig, near=True))
            floor, floor_src = self.floor_value(row)
            shm_r = self.by_round(row.shm, fig)
            # the rounds whose shmrdma run had near placement (its own probes)
            near = {r for r, (_v, res) in shm_r.items() if self.run_label(r, res) == "near"}
            near_floor = (median([self.floor_value(row, self.run_probes(r, shm_r[r][1]))[0] for r in near])
                          if near and row.floor else None)
            best_peer, best_val = None, None
            for pk in row.peers:
                pv = median(self.values(pk, fig))
                if pv is not None and (best_val is None or better(row.kind, pv, best_val)):
                    best_peer, best_val = pk, pv
            # Ratios are paired per round (shmrdma and its floor / peer measured
            # in the same round, so under much the same placement and load),
            # then the median over the rounds; the near ratios pair only runs
            # that both had near placement (the floor: the probes around the
            # shmrdma run).
            rf = {r: cost_ratio(row.kind, v, self.floor_value(row, self.run_probes(r, res))[0])
                  for r, (v, res) in shm_r.items()}
            rf = {r: x for r, x in rf.items() if x is not None}
            peer_r = self.by_round(best_peer, fig) if best_peer else {}
            rp = {r: cost_ratio(row.kind, v, peer_r[r][0]) for r, (v, _res) in shm_r.items() if r in peer_r}
            rp = {r: x for r, x in rp.items() if x is not None}
            both_near = {r for r in near if r in peer_r and self.run_label(r, peer_r[r][1]) == "near"}
            rows.append(dict(
                row=row, fig=fig, vals=vals, median=med, near_median=near_med, n_near=len(near),
                floor=floor, near_floor=near_floor, floor_src=floor_src, best_peer=best_peer, best_val=best_val,
                near_peer=median(self.values(best_peer, fig, near=True)) if best_peer else None,
                r_floor=median(list(rf.values())), r_peer=median(list(rp.values())),
                r_floor_near=median([x for r, x in rf.items() if r in near]),
                r_peer_near=median([x for r, x in rp.items() if r in both_near]),
                failures=self.failures(row.shm), attempts=self.attempts(row.shm),
                peer_failures={pk: self.failures(pk) for pk in row.peers if self.failures(pk)},
            ))
        return rows

    def anomalies(self, srows: list[dict]) -> list[str]:
        """Figures that deserve a second look before anyone acts on them."""
        out = []
        for key, spec in self.plan.specs.items():
            mc = median(self.probe_values(f"memcpy_GBps_{spec.size}"))
            bw = median(self.values(key, "bw_GBps"))
            is_bw = spec.impl != "shmrdma" and spec.size >= 4096 and ("bw" in spec.test or spec.test == "ucp_get")
            if is_bw and mc and bw and bw > 1.2 * mc:
                out.append(f"{spec.label} {human_size(spec.size)}: {fmt(bw)} GB/s is above the one-copy floor "
                           f"(memcpy {fmt(mc)} GB/s at that size): not one full copy per message, or a cache "
                           f"effect the probe does not see")
        for s in srows:
            row, med = s["row"], s["median"]
            if med is None:
                continue
            label = f"shmrdma {row.label}"
            if s["r_floor"] is not None and s["r_floor"] < 0.8:
                out.append(f"{label}: {fmt(med)} is better than the floor ({fmt(s['floor'])}, {s['floor_src']}; "
                           f"ratio {fmt(s['r_floor'], 2)})"
                           + (": expected for an initiator-executed read/atomic on idle target memory"
                              if row.rid.startswith(("read_lat", "atomic_lat")) else ""))
            # more than 2x between runs of the same placement: noise that placement does not explain
            shm_r = self.by_round(row.shm, s["fig"])
            for lab in ("near", "far", "smt", "unknown"):
                vals = [v for r, (v, res) in shm_r.items() if self.run_label(r, res) == lab]
                if len(vals) >= 2 and min(vals) > 0 and max(vals) / min(vals) > 2:
                    out.append(f"{label}: {lab} runs spread {fmt(min(vals))}–{fmt(max(vals))} (more than 2x): "
                               f"noisy")
            if row.kind == "lat":
                avgs = self.values(row.shm, "lat_avg_us")
                a = median(avgs)
                if a and a > 5 * med:
                    out.append(f"{label}: t_avg {fmt(a)} µs is {a / med:.0f}x t_typical: a long tail "
                               f"(preemption on a loaded machine, or stalls in the data path)")
        return out

    # ---- writers ----
    def write_csv(self, path: str) -> None:
        with open(path + ".tmp", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", "placement", "probe_before_ns", "probe_after_ns", "group", "key", "impl", "variant",
                        "test", "size_B", "figure", "value", "unit", "status", "reason", "duration_s", "loadavg1",
                        "command"])
            # the report's header, so that --from-csv can draw the same report again
            w.writerow(["meta", "", "", "", "", "command", "", "", "", "", "", "", "", "meta", self.command, "", "",
                        ""])
            for k, v in self.meta.items():
                w.writerow(["meta", "", "", "", "", k, "", "", "", "", "", "", "", "meta", v, "", "", ""])
            for n in self.notes:
                w.writerow(["meta", "", "", "", "", "note", "", "", "", "", "", "", "", "meta", n, "", "", ""])
            for b, kind, vals, err in self.probes:
                if not vals:
                    w.writerow([f"boundary {b}", "", "", "", "probe", f"floor/{kind}", "floor", "probe", kind, "",
                                "", "", "", "failed", err, "", "", ""])
                for name, v in vals.items():
                    unit = "ns" if name.endswith(("_ns", "_ns_median", "_ns_min")) or "_ns_" in name else "GB/s"
                    m = re.search(r"_(\d+)$", name)
                    w.writerow([f"boundary {b}", "", "", "", "probe", f"floor/{kind}", "floor", "probe", kind,
                                m.group(1) if m else "", name, f"{v:.6g}", unit, "ok" if not err else "partial",
                                err, "", "", ""])
            for r, res in self.results:
                before, after = self.run_probe_pair(r, res)
                label = self.run_label(r, res)
                s = res.spec
                common = [r, label, f"{before:.1f}" if before else "", f"{after:.1f}" if after else "",
                          res.group, s.key, s.impl, s.variant, s.test, s.size]
                tailc = [f"{res.duration:.2f}", f"{res.load1:.2f}", res.cmd]
                if not res.ok:
                    w.writerow(common + ["", "", "", "failed", res.reason] + tailc)
                    continue
                for i, (name, v) in enumerate(res.figures.items()):
                    if i == 1:
                        tailc = tailc[:2] + [""]  # the command once per run
                    unit = FIGURE_UNITS.get(name, "")
                    if not unit:
                        unit = ("us" if name.endswith("_us") else "MiB/s" if name.endswith("MiBps") else
                                "Mmsg/s" if name.endswith("Mpps") else "msg/s" if name.endswith("_pps") else "")
                    w.writerow(common + [name, f"{v:.6g}", unit, "ok", res.reason] + tailc)
        os.replace(path + ".tmp", path)

    def load_csv(self, path: str) -> None:
        """Reads back a latest.csv written by write_csv (for --from-csv)."""
        probes: dict[tuple[int, str], tuple[dict[str, float], str]] = {}
        runs: dict[tuple[int, str], Result] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r["round"] == "meta":
                    if r["key"] == "command":
                        self.command = r["reason"]
                    elif r["key"] == "note":
                        self.notes.append(r["reason"])
                    else:
                        self.meta[r["key"]] = r["reason"]
                    continue
                if r["round"].startswith("boundary "):
                    b = int(r["round"].split()[1])
                    vals, err = probes.setdefault((b, r["test"]), ({}, r["reason"]))
                    if r["figure"] and r["value"]:
                        vals[r["figure"]] = float(r["value"])
                    continue
                rnd, key = int(r["round"]), r["key"]
                if (rnd, key) not in runs:
                    spec = self.plan.specs.get(key) or Spec(key, r["impl"], r["variant"], r["test"],
                                                            int(r["size_B"] or 0), [], [])
                    runs[(rnd, key)] = Result(spec, r["status"] != "failed", {}, r["reason"],
                                              float(r["duration_s"] or 0), float(r["loadavg1"] or 0), r["command"],
                                              r["group"],
                                              float(r["probe_before_ns"]) if r["probe_before_ns"] else None,
                                              float(r["probe_after_ns"]) if r["probe_after_ns"] else None)
                if r["status"] == "ok" and r["figure"]:
                    runs[(rnd, key)].figures[r["figure"]] = float(r["value"])
        self.probes = [(b, kind, vals, err) for (b, kind), (vals, err) in probes.items()]
        self.results = [(rnd, res) for (rnd, _k), res in runs.items()]
        self.args.rounds = max([r for r, _ in self.results], default=0)

    def write_md(self, path: str) -> None:
        place = self.placement()
        srows = self.summary_rows()
        L = []
        L.append("# shmrdma benchmark: latest run")
        L.append("")
        L.append("```")
        L.append(self.command)
        L.append("```")
        L.append("")
        for k, v in self.meta.items():
            L.append(f"- {k}: {v}")
        L.append("")
        loads = [res.load1 for _r, res in self.results]
        ncpu = os.cpu_count() or 1
        if loads and statistics.mean(loads) > ncpu:
            how = ("its pairs ran SCHED_FIFO" if self.args.rt else
                   f"its pairs ran at nice {self.args.nice}, session included, which keeps most of the CPU for them"
                   if self.args.nice else "its pairs ran at nice 0 and shared the CPU with everything else")
            L.append(f"**Note: the machine was busy during this run (mean 1-minute load average "
                     f"{statistics.mean(loads):.1f} on {ncpu} CPUs);** {how}. Whole-run averages (every BW and "
                     f"message rate, fi_pingpong latency) suffer first: check their spread, and use `--rt` or "
                     f"`--wait-idle 600` for the steadiest figures.")
            L.append("")
        L.append("Figures are medians over the rounds. Latency: µs, perftest `t_typical` / ucx_perftest 50th "
                 "percentile / fi_pingpong mean, one-way (half round trip) for send/write and ping-pong peers, "
                 "full round trip for read/atomic and one-sided peers (ucp_get, ucp_fadd). BW: GB/s (1e9 B/s). "
                 "Msg rate: millions of messages/s. **Ratios are costs: how many times slower shmrdma is** "
                 "(latency: shmrdma / other; BW and rate: other / shmrdma); > 1 means shmrdma is slower, < 1 faster.")
        L.append("")
        L.append("## Results")
        L.append("")
        labels = {self.run_label(r, res) for r, res in self.results}
        if "near" in labels and labels - {"near"}:
            L.append("Placement changed during the run: each cell gives the figure over all rounds and, after `·`, "
                     "over the runs with *near* placement only (each run is classed by the probes right before "
                     "and after it, since the placement can flip within a round: see placement below).")
        elif "near" not in labels:
            L.append("No run had near placement (see placement below): every figure is a "
                     "far-placement figure.")
        L.append("Ratios are the median of per-round ratios: shmrdma against the floor probed around its run, "
                 "and against the best peer's run in the same round (the near ratios: only pairs of runs that "
                 "were both near).")
        L.append("")
        L.append("| metric | shmrdma median | floor | best peer | ratio to floor | ratio to best peer | "
                 "spread (min–max; IQR) | ok/runs |")
        L.append("|---|---:|---|---|---:|---:|---|---:|")
        unit = {"lat": "µs", "bw": "GB/s", "rate": "Mmsg/s"}

        mixed = any(lab != "near" for lab in labels)

        def two(a, b, digits=3):
            if a is None:
                return "—"
            return fmt(a, digits) + (f" · {fmt(b, digits)}" if b is not None and mixed else "")

        for s in srows:
            row = s["row"]
            u = unit[row.kind]
            if s["median"] is None:
                reason = s["failures"][-1][1] if s["failures"] else "no result"
                L.append(f"| {row.label} ({u}) | **FAILED** | — | — | — | — | {mdesc(reason)} | "
                         f"0/{s['attempts']} |")
                continue
            floor = (f"{two(s['floor'], s['near_floor'])} ({s['floor_src']})" if s["floor"] is not None else "n/a")
            if s["best_peer"]:
                spec = self.plan.specs[s["best_peer"]]
                peer = f"{two(s['best_val'], s['near_peer'])} ({spec.label} {human_size(spec.size)})"
            else:
                peer = "failed" if s["peer_failures"] else "n/a"
            q = iqr(s["vals"])
            spread = f"{fmt(min(s['vals']))}–{fmt(max(s['vals']))}" + (f"; {fmt(q[0])}–{fmt(q[1])}" if q else "")
            okc = f"{len(s['vals'])}/{s['attempts']}"
            L.append(f"| {row.label} ({u}) | {two(s['median'], s['near_median'])} | {floor} | {peer} | "
                     f"{two(s['r_floor'], s['r_floor_near'], 2)} | {two(s['r_peer'], s['r_peer_near'], 2)} | "
                     f"{spread} | {okc} |")
        L.append("")
        # failures
        fails = []
        for r, res in self.results:
            if not res.ok:
                fails.append(f"- round {r}, {res.spec.label} {human_size(res.spec.size)}: {mdesc(res.reason)}")
            elif res.reason:
                fails.append(f"- round {r}, {res.spec.label} {human_size(res.spec.size)} (figures kept): "
                             f"{mdesc(res.reason)}")
        for b, kind, _vals, err in self.probes:
            if err:
                fails.append(f"- probe {kind} at boundary {b}: {mdesc(err)}")
        L.append("## Failures")
        L.append("")
        L.extend(fails or ["none"])
        L.append("")
        # placement
        best = self.best_probe()
        L.append("## Rounds and vCPU placement")
        L.append("")
        L.append(f"Cache-line ping-pong (half round trip, CPU {self.args.cpus}) before each round and after the "
                 f"last; best of the run {fmt(best)} ns; a round is *near* when both of its probes are within "
                 f"{self.args.near_factor}x of the best and at most {fmt(self.args.near_max_ns)} ns "
                 f"(`--near-max-ns`), *smt* when either is at most {fmt(self.args.smt_max_ns)} ns "
                 f"(`--smt-max-ns`: the two vCPUs were hardware threads of one core, sharing its caches; left "
                 f"out of the best), else *far*. The placement can flip within a round, so every run is probed "
                 f"right after it too (the probe before it is the one after the run before) and classed by the "
                 f"same rule on its own two probes: the near figures are those of near runs.")
        L.append("")
        no_near = bool(place) and not any(lab == "near" for _b, _a, lab in place.values())
        if no_near:
            L.append(f"**No near round in this run:** every round had a probe above "
                     f"{fmt(self.args.near_max_ns)} ns (or more than {self.args.near_factor}x the run's best) "
                     f"or one of SMT siblings, so the vCPUs never sat near throughout a round. Targets that are "
                     f"judged on near rounds cannot be judged from this run; its figures are far-placement "
                     f"figures.")
            L.append("")
        hist = self.meta_history
        if best and hist and hist.get("best_halfrtt_ns"):
            hb = hist["best_halfrtt_ns"]
            if no_near:
                L.append(f"Best probe this machine has shown: {fmt(hb)} ns ({hist.get('date', '?')}).")
            elif best > self.args.near_factor * hb:
                L.append(f"**The whole run had far placement:** its best probe is {best / hb:.1f}x the best this "
                         f"machine has shown ({fmt(hb)} ns on {hist.get('date', '?')}, kept in "
                         f"`bench/.build/probe-history.json`), so even its *near* rounds are far. Latencies are "
                         f"inflated accordingly; compare ratios, not absolute figures, with other runs.")
            else:
                L.append(f"Best probe this machine has shown: {fmt(hb)} ns ({hist.get('date', '?')}).")
            L.append("")
        L.append("| round | probe before (ns) | probe after (ns) | placement | near runs | "
                 "load avg (1 min) at start |")
        L.append("|---:|---:|---:|---|---:|---:|")
        for r, (b, a, lab) in place.items():
            loads = [res.load1 for rr, res in self.results if rr == r]
            nr = [self.run_label(rr, res) == "near" for rr, res in self.results if rr == r]
            L.append(f"| {r} | {fmt(b)} | {fmt(a)} | {lab} | {sum(nr)}/{len(nr)} | "
                     f"{fmt(loads[0]) if loads else '—'} |")
        L.append("")
        # floors
        L.append("## Floors (probes in bench/probes)")
        L.append("")
        L.append("| probe | median | min | max | samples | median of the near probes |")
        L.append("|---|---:|---:|---:|---:|---:|")
        names = []
        for _b, _k, vals, _e in self.probes:
            for name in vals:
                if name not in names:
                    names.append(name)
        for name in names:
            v = self.probe_values(name)
            nv = self.near_probe_values(name)
            L.append(f"| {name} | {fmt(median(v))} | {fmt(min(v))} | {fmt(max(v))} | {len(v)} | "
                     f"{fmt(median(nv)) if nv else '—'} |")
        L.append("")
        L.append("The last column: the probes that tell their own placement (`pingpong`'s hand-off, "
                 "`spin_floor`'s and `stream_bw`'s, which they measure beside their loops), near ones only. "
                 "`spin2_halfrtt`: "
                 "ib_write_lat's own loop (spin on a byte the peer stores, no pause) with a plain store in "
                 "place of the post, what ib_write_lat costs with a provider that takes no time; "
                 "`spin2_pause_halfrtt`: the same loop with a pause in the spin; `stream_*_GBps_*`: WRITEs "
                 "and SENDs over shmrdma from a loop that costs next to nothing (probes/stream_bw.c), what the "
                 "provider moves per second without perftest's per-message bookkeeping, with its own hand-off "
                 "`stream_handoff_ns_median` (bench/README.md).")
        L.append("")
        # every peer
        L.append("## Peers, every run")
        L.append("")
        L.append("| peer | size | latency µs (median) | BW GB/s (median) | Mmsg/s (median) | ok/runs | last failure |")
        L.append("|---|---:|---:|---:|---:|---:|---|")
        for key, spec in self.plan.specs.items():
            if spec.impl == "shmrdma" or self.attempts(key) == 0:
                continue
            lat = median(self.values(key, "lat_us"))
            bw = median(self.values(key, "bw_GBps"))
            mr = median(self.values(key, "rate_Mpps"))
            f = self.failures(key)
            L.append(f"| {spec.label} | {human_size(spec.size)} | {fmt(lat)} | {fmt(bw)} | {fmt(mr)} | "
                     f"{len(self.values(key, 'lat_us'))}/{self.attempts(key)} | {mdesc(f[-1][1]) if f else ''} |")
        L.append("")
        ucx_ok = {}
        for key, spec in self.plan.specs.items():
            if spec.impl == "ucx" and spec.variant in ("posix", "sm"):
                ucx_ok.setdefault(spec.variant, [0, 0])
                ucx_ok[spec.variant][0] += len(self.values(key, "lat_us"))
                ucx_ok[spec.variant][1] += self.attempts(key)
        if ucx_ok:
            L.append("UCX_TLS variants (UCP tests): " + ", ".join(
                f"`{v},self` {a}/{b} runs ok" for v, (a, b) in ucx_ok.items()) +
                "; UCT tests (am_lat, put_lat, am_bw, put_bw) use `-x posix -d memory`.")
            L.append("")
        anomalies = self.anomalies(srows)
        L.append("## Checks")
        L.append("")
        L.extend(f"- {a}" for a in anomalies) if anomalies else L.append("nothing flagged")
        L.append("")
        if self.notes:
            L.append("## Notes")
            L.append("")
            L.extend(f"- {n}" for n in self.notes)
            L.append("")
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(L))
        os.replace(path + ".tmp", path)


def mdesc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, fewer iterations (under a minute): a smoke test")
    ap.add_argument("--rounds", type=int, help="rounds (default 5; --quick: 1)")
    ap.add_argument("--only", metavar="REGEX", help="only the table rows whose id or label matches, e.g. 'lat'")
    ap.add_argument("--cpus", default="0,1", help="server CPU,client CPU (default 0,1)")
    ap.add_argument("--near-factor", type=float, default=1.5,
                    help="a round is near when its ping-pong probes are within this factor of the best (1.5)")
    ap.add_argument("--near-max-ns", type=float, default=120.0,
                    help="...and at most this cache-line hand-off in ns (120: near placement is ~35-100 ns on "
                         "these VMs, far ~200 ns and more)")
    ap.add_argument("--smt-max-ns", type=float, default=20.0,
                    help="a probe at most this is two hardware threads of one core (~14 ns on these VMs): such a "
                         "round is labelled smt, neither near nor far (20)")
    ap.add_argument("--ucx-tls", default="posix,sm",
                    help="UCX_TLS variants for the UCP peer tests, ',self' appended (default posix,sm)")
    ap.add_argument("--no-peers", action="store_true", help="shmrdma and the floors only")
    ap.add_argument("--shmrdma", help="the shmrdma command to use (default: build/tools/shmrdma, built first)")
    ap.add_argument("--no-build", action="store_true", help="do not run ninja -C build")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install missing packages")
    ap.add_argument("--shmrdma-env", action="append", default=[], metavar="K=V",
                    help="environment for the shmrdma runs, e.g. SHMRDMA_MAPPED=0 (repeatable)")
    ap.add_argument("--nice", type=int, default=-20,
                    help="nice value of every benchmark process and of its session's autogroup (default -20, "
                         "0 = leave as is): on a shared machine busy-polling pairs otherwise get a fraction of "
                         "the CPU and measure the scheduler")
    ap.add_argument("--rt", action="store_true",
                    help="run every pair and probe as SCHED_FIFO (chrt -f 1): the steadiest figures on a loaded "
                         "machine, but everything else on the two CPUs gets only the kernel's RT leftover "
                         "(5%%) meanwhile")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="first wait up to SECONDS for the 1-minute load average to fall below half the CPUs")
    ap.add_argument("--wait-near", type=float, default=0, metavar="SECONDS",
                    help="before each round, probe the cache-line hand-off again every 2 s, up to SECONDS, until "
                         "it is near (at most --near-max-ns): the vCPUs' placement flips on its own, and the "
                         "targets are judged on near runs (a round is still classed by its probes); within a "
                         "round, a run whose probe before it is far waits too, up to SECONDS per round in all")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every pair's timeout")
    ap.add_argument("--host", default="localhost", help="server host name the clients use (localhost)")
    ap.add_argument("--out", default=os.path.join(BENCH, "results"), help="output directory (bench/results)")
    ap.add_argument("--keep-logs", action="store_true", help="keep every pair's output in OUT/logs/")
    ap.add_argument("--from-csv", metavar="CSV",
                    help="run nothing: draw latest.md and latest.png in OUT again from a latest.csv")
    a = ap.parse_args(argv)
    if a.rounds is None:
        a.rounds = 1 if a.quick else 5
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if len(a.cpus.split(",")) != 2:
        ap.error("--cpus takes two CPUs: SERVER,CLIENT")
    if os.geteuid() != 0:
        a.nice = max(a.nice, 0)  # only root may raise priority
        a.rt = False
    return a


HISTORY = os.path.join(PROBES_BIN, "probe-history.json")


def load_history() -> dict:
    """The best cache-line hand-off this machine has shown (machine-local)."""
    try:
        with open(HISTORY) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def update_history(report: "Report") -> None:
    best = report.best_probe()
    if best is None:
        return
    hist = load_history()
    if not hist.get("best_halfrtt_ns") or best < hist["best_halfrtt_ns"]:
        try:
            os.makedirs(PROBES_BIN, exist_ok=True)
            with open(HISTORY, "w") as f:
                json.dump({"best_halfrtt_ns": round(best, 1), "date": time.strftime("%Y-%m-%d %H:%M")}, f)
        except OSError:
            pass


def draw_png(report: Report, csv_path: str, png_path: str) -> None:
    py = python_with_matplotlib()
    if py is None:
        report.notes.append("no plot: matplotlib not importable (python3-matplotlib)")
        return
    r = subprocess.run([py, os.path.join(BENCH, "plot.py"), csv_path, png_path], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    if r.returncode != 0:
        report.notes.append(f"plot failed: {tail(r.stdout)}")


def redraw(args, command: str) -> int:
    # The MPI rows exist only with the probe's path; nothing runs here, so
    # its usual place stands in (without it the redrawn report lost them).
    plan = Plan(args.quick, "shmrdma", [t.strip() for t in args.ucx_tls.split(",") if t.strip()], args.host,
                os.path.join(PROBES_BIN, "mpi_pingpong"))
    if args.only:
        plan.restrict(args.only)
    report = Report(args, plan, command)
    src = os.path.abspath(args.from_csv)
    report.load_csv(src)
    mode = report.meta.get("mode", "")  # how the pairs ran, for the report's wording
    args.rt = "SCHED_FIFO" in mode
    m = re.search(r"nice (-?\d+)", mode)
    args.nice = int(m.group(1)) if m else args.nice
    csv_path = os.path.join(args.out, "latest.csv")
    report.write_csv(csv_path)
    draw_png(report, csv_path, os.path.join(args.out, "latest.png"))
    report.write_md(os.path.join(args.out, "latest.md"))
    log(f"drew {args.out}/latest.md and latest.png again from {src}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = os.environ.get("BENCH_COMMAND") or " ".join(shlex.quote(x) for x in [sys.argv[0]] + argv)
    os.makedirs(args.out, exist_ok=True)
    if args.from_csv:
        return redraw(args, command)
    t_start = time.monotonic()
    notes: list[str] = []

    if not args.no_install:
        ensure_packages(notes)
    shmrdma = build_shmrdma(args, notes)
    probes = build_probes(os.environ.get("CC", "cc"))
    ucx_tls = [t.strip() for t in args.ucx_tls.split(",") if t.strip()]
    plan = Plan(args.quick, shmrdma, ucx_tls, args.host, probes.get("mpi_pingpong"), args.shmrdma_env)
    if args.only:
        plan.restrict(args.only)
    if args.no_peers:
        for r in plan.rows:
            r.peers = []
        keep = {r.shm for r in plan.rows}
        plan.groups = [(n, [k for k in ks if k in keep]) for n, ks in plan.groups]
    report = Report(args, plan, command)
    report.notes.extend(notes)
    report.meta["date"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    report.meta["host"] = (f"{socket.gethostname()}, {os.cpu_count()} CPUs ({cpu_model()}), "
                           f"kernel {platform.release()}")
    report.meta["shmrdma"] = f"{git_describe()}, {meson_buildtype()}" + (
        f", env {' '.join(args.shmrdma_env)}" if args.shmrdma_env else "")
    report.meta["mode"] = (f"{'quick' if args.quick else 'default'}: {args.rounds} round(s), server on CPU "
                           f"{args.cpus.split(',')[0]}, client on CPU {args.cpus.split(',')[1]}, "
                           + ("SCHED_FIFO (chrt -f 1)" if args.rt else f"nice {args.nice}")
                           + (f", each round waited up to {fmt(args.wait_near)} s for a near probe, and its runs "
                              f"up to {fmt(args.wait_near)} s in all (--wait-near)"
                              if args.wait_near > 0 else ""))
    if args.wait_idle > 0:
        limit = (os.cpu_count() or 2) / 2
        deadline = time.monotonic() + args.wait_idle
        while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
            log(f"waiting for the load average ({os.getloadavg()[0]:.1f}) to fall below {limit:.1f}")
            time.sleep(15)
    report.meta["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())

    home = tempfile.mkdtemp(prefix="shmrdma-bench-")
    ports = Ports(20000 + (os.getpid() % 200) * 100)
    runner = Runner(args, shmrdma, home, ports)
    env = runner.env

    def device(*cmd: str) -> tuple[int, str]:
        try:
            r = subprocess.run([shmrdma, *cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=30)
            return r.returncode, r.stdout
        except (OSError, subprocess.SubprocessError) as e:
            return -1, str(e)

    rc, out = device("up")
    device_up = rc == 0
    if rc != 0:
        report.notes.append(f"`shmrdma up` failed: {tail(out)}")
        log(report.notes[-1])
    elif "qp_memory" in probes:
        # Memory per idle RC QP with perftest's default queue sizes.
        vals, err = run_probe(args, [shmrdma, "run", probes["qp_memory"]], timeout=30, env=env)
        report.probes.append((0, "qp_memory", vals, err))
        log(f"memory per idle RC QP: {fmt(vals.get('qp_mem_bytes_write_bw'))} B (ib_write_bw depths), "
            f"{fmt(vals.get('qp_mem_bytes_send_bw'))} B (ib_send_bw depths)")

    total = sum(len(keys) for _n, keys in plan.groups) * args.rounds
    done = 0

    def probe_boundary(b: int, full: bool) -> float | None:
        vals, err = run_probe(args, [probes["pingpong"], *args.cpus.split(",")], timeout=30)
        report.probes.append((b, "pingpong", vals, err))
        msg = f"probe {b}: cache-line half RTT {fmt(vals.get('cacheline_halfrtt_ns_median'))} ns"
        if full:
            v2, e2 = run_probe(args, [probes["memcpy_bw"], args.cpus.split(",")[0]], timeout=60)
            report.probes.append((b, "memcpy", v2, e2))
            v3, e3 = run_probe(args, [probes["pvm"], *args.cpus.split(",")], timeout=60)
            report.probes.append((b, "pvm", v3, e3))
            msg += (f", memcpy 1 MiB {fmt(v2.get('memcpy_GBps_1048576'))} GB/s, "
                    f"process_vm_writev 8 B {fmt(v3.get('pvm_write_lat_ns_8'))} ns")
        log(msg)
        return vals.get("cacheline_halfrtt_ns_median")

    def probe_spin(b: int) -> None:
        """The spin floor (probes/spin_floor.c: ib_write_lat's own loop with a
        plain store for the post) at boundary b, with the hand-off it measured
        itself, which tells its placement."""
        if "spin_floor" not in probes:
            return
        vals, err = run_probe(args, [probes["spin_floor"], *args.cpus.split(",")], timeout=30)
        report.probes.append((b, "spin_floor", vals, err))
        log(f"probe {b}: ib_write_lat's loop with a plain store {fmt(vals.get('spin2_halfrtt_ns_median'))} ns "
            f"(with a pause {fmt(vals.get('spin2_pause_halfrtt_ns_median'))} ns; its hand-off "
            f"{fmt(vals.get('spin2_handoff_ns_median'))} ns)")

    def probe_stream(b: int) -> None:
        """The streams at boundary b (probes/stream_bw.c: 64 KiB and 1 MiB
        WRITEs and SENDs over shmrdma with a loop that costs next to nothing,
        what the provider moves without perftest's per-message bookkeeping),
        with the hand-off it measured itself, which tells its placement."""
        if "stream_bw" not in probes or not device_up:
            return
        vals, err = run_probe(args, [shmrdma, "run", probes["stream_bw"], *args.cpus.split(",")], timeout=60,
                              env=env)
        report.probes.append((b, "stream_bw", vals, err))
        log(f"probe {b}: streams without perftest's loop: 64 KiB WRITE {fmt(vals.get('stream_write_GBps_65536'))}"
            f" / SEND {fmt(vals.get('stream_send_GBps_65536'))} GB/s (its hand-off "
            f"{fmt(vals.get('stream_handoff_ns_median'))} ns){f'; {err}' if err else ''}")

    def probe_run() -> float | None:
        """The cache-line probe after a run (15 ms): the next run's "before"."""
        vals, _err = run_probe(args, [probes["pingpong"], *args.cpus.split(",")], timeout=30)
        return vals.get("cacheline_halfrtt_ns_median")

    def wait_near(b: int, last: float | None) -> float | None:
        """--wait-near: probe boundary b again every 2 s until the hand-off is near (at most
        --near-max-ns) or the wait is over; the last probe is the round's "before" probe."""
        deadline = time.monotonic() + args.wait_near
        while (last is None or last > args.near_max_ns) and time.monotonic() < deadline:
            time.sleep(2)
            last = probe_boundary(b, False)
        return last

    try:
        last = probe_boundary(0, True)
        probe_spin(0)
        probe_stream(0)
        for rnd in range(1, args.rounds + 1):
            if args.wait_near > 0:
                last = wait_near(rnd - 1, last)
            # --wait-near within the round too: a run whose "before" probe is
            # far waits (probing every second) while the round's budget of
            # --wait-near seconds lasts
            budget_end = time.monotonic() + args.wait_near
            for gname, keys in plan.groups:
                for key in keys:
                    spec = plan.specs[key]
                    while (args.wait_near > 0 and (last is None or last > args.near_max_ns)
                           and time.monotonic() < budget_end):
                        time.sleep(1)
                        last = probe_run()
                    before = last
                    res = runner.run(spec)
                    last = probe_run()
                    res.group = gname
                    res.probe_before, res.probe_after = before, last
                    report.results.append((rnd, res))
                    done += 1
                    figname = ("lat_us" if "lat" in spec.test or spec.impl == "fi" or (spec.impl == "mpi" and
                                                                                     spec.size == 8) else
                               "rate_Mpps" if spec.size == 8 else "bw_GBps")
                    fig = res.figures.get(figname)
                    status = f"{fmt(fig)} {FIGURE_UNITS[figname]}" if res.ok else f"FAILED: {res.reason[:160]}"
                    log(f"[{done}/{total}] r{rnd} {spec.label} {human_size(spec.size)}: {status} "
                        f"({res.duration:.1f}s; hand-off {fmt(before)} / {fmt(last)} ns)")
                    if not res.ok and spec.on_shmrdma:
                        # reclaim what the killed processes left behind
                        device("up")
            last = probe_boundary(rnd, rnd == args.rounds and not args.quick)
            probe_spin(rnd)
            probe_stream(rnd)
            # partial results after every round: an interrupted run still leaves a report
            report.write_csv(os.path.join(args.out, "latest.csv"))
            report.write_md(os.path.join(args.out, "latest.md"))
    except KeyboardInterrupt:
        report.notes.append("interrupted (Ctrl-C): the report covers the rounds done")
    finally:
        leftover = shmrdma_processes(shmrdma, env)
        if leftover:
            report.notes.append(f"`shmrdma status --json` after the run (all pairs ended) still lists processes: "
                                f"{leftover}")
        rc, out = device("down", "--force")
        if rc != 0:
            report.notes.append(f"`shmrdma down --force` failed: {tail(out)}")
        shutil.rmtree(home, ignore_errors=True)
        if SNAPSHOT_DIR:
            shutil.rmtree(SNAPSHOT_DIR, ignore_errors=True)

    report.meta["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report.meta["wall time"] = f"{time.monotonic() - t_start:.0f} s"
    csv_path = os.path.join(args.out, "latest.csv")
    md_path = os.path.join(args.out, "latest.md")
    png_path = os.path.join(args.out, "latest.png")
    report.write_csv(csv_path)
    draw_png(report, csv_path, png_path)
    report.write_md(md_path)
    update_history(report)
    log(f"wrote {md_path}, {csv_path}" + (f", {png_path}" if os.path.exists(png_path) else ""))
    with open(md_path) as f:
        print(f.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
