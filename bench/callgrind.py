#!/usr/bin/env python3
"""Instruction counts per 8-byte message (callgrind), shmrdma beside UCX.

    python3 bench/callgrind.py [--build build] [--out bench/results/callgrind.md] [--quick]

For each case the initiator (client) runs under `valgrind --tool=callgrind`
with N1 and N2 messages (each --repeat times, the smallest total kept), and the
target (server) runs natively; the counts per message are the differences
divided by N2 - N1, so start-up and connection costs cancel out:

- whole process: every instruction of the initiator, its tool's loop included
  (perftest runs with -N: its peak-bandwidth report walks the per-message
  timestamps after the run, ~380 instructions per message that are report,
  not loop; perftest enables it by default up to 20,000 iterations), but
  not loops bounded by time (clock_spins: perftest's calibration of its
  cycle counter, whose count depends on how fast the process runs under
  valgrind and moved the difference by up to 250 per message at N2 - N1 =
  4000), with the instructions by object (the tool's own code apart from
  the provider's, libibverbs', UCX's);
- inside the provider's post_send and poll_cq (what ibv_post_send and
  ibv_poll_cq cost, inclusive), for the shmrdma cases. poll_cq per message
  mixes the empty polls and the one that returns the completion, as the tool
  makes them.

Cases: perftest ib_write_bw / ib_send_bw -s 8 over shmrdma (mapped tier and
SHMRDMA_MAPPED=0; and with lists of 16 WRs per post, -l 16), ucx_perftest put_bw / am_bw 8 B over UCT posix (the
shared-memory transport shmrdma is held against), and ucx_perftest put_bw /
am_bw over rc_verbs on shmrdma (what UCX gets). Instruction counts do not
depend on the machine's load (only the timings would), but the instructions
an initiator spends waiting do (polling for credits, FIFO space or a receive
posted late): the target runs natively, tens of times faster than the
initiator under callgrind, so the initiator does not wait for it, and of the
repeats the one that waited least (the smallest total) is kept; waiting only
adds instructions. The report flags repeats that still differ.

UCX over rc_verbs runs with UCX_IB_REG_METHODS=direct. Under valgrind UCM
cannot install its memory hooks, so UCX's registration cache fails
("rcache failed to install UCM event handler") and UCX falls back to its next
method, one implicit on-demand MR for all memory ("odp global key"), which
shmrdma offers (IBV_ODP_SUPPORT_IMPLICIT). That is not what UCX uses outside
valgrind (the cache: one ordinary MR per buffer), it sends every transfer
through the on-demand path, and UCX 1.13.1 then dies with SIGSEGV when it
closes the device: uct_ib_md_release_reg_method passes that MR's handle to
uct_ib_mem_dereg where a uct_md_mem_dereg_params_t is expected (whether the
garbage it reads faults depends on the heap, so some runs passed). `direct`
registers each buffer with ibv_reg_mr, as the cache does.

Needs valgrind (Debian: valgrind) and the packages of bench/run.py.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

KEEP = ""  # --keep DIR: the callgrind outputs and logs of every run
STORES = True  # --no-stores: without --cache-sim=yes (no store counts, about twice as fast)
BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
DEVICE = "shm0"


def log(msg: str) -> None:
    print(f"[callgrind {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# (name, tool, argv without port/host, env, on shmrdma, shmrdma function regexes)
def cases() -> list[dict]:
    # ibv_post_send / ibv_poll_cq, and the extended APIs (ibv_wr_*, ibv_start_poll...) where a tool uses them
    pt = {"post_send": r"::(post_send\(ibv_qp\*|wr_start\(|wr_complete\(|wr_rdma_write\w*\(|wr_send\w*\(|wr_set_\w+\()",
          "poll_cq": r"::(poll_cq\(ibv_cq\*|start_poll\(|next_poll\(|end_poll\()"}
    # UCX_IB_REG_METHODS=direct: see the module's docstring (no implicit ODP MR under valgrind)
    verbs_env = {"UCX_NET_DEVICES": f"{DEVICE}:1", "UCX_TLS": "rc_verbs", "UCX_IB_REG_METHODS": "direct"}
    return [
        dict(name="shmrdma ib_write_bw 8 B (mapped tier)", kind="perftest", argv=["ib_write_bw", "-s", "8", "-N"], env={},
             shm=True, funcs=pt),
        dict(name="shmrdma ib_write_bw 8 B (CMA tier, SHMRDMA_MAPPED=0)", kind="perftest",
             argv=["ib_write_bw", "-s", "8", "-N"], env={"SHMRDMA_MAPPED": "0"}, shm=True, funcs=pt),
        dict(name="shmrdma ib_send_bw 8 B", kind="perftest", argv=["ib_send_bw", "-s", "8", "-N"], env={}, shm=True,
             funcs=pt),
        # Lists of 16 WRs per ibv_post_send (N1 and N2 are multiples of 16).
        dict(name="shmrdma ib_write_bw 8 B, lists of 16 (-l 16)", kind="perftest",
             argv=["ib_write_bw", "-s", "8", "-N", "-l", "16"], env={}, shm=True, funcs=pt),
        dict(name="shmrdma ib_send_bw 8 B, lists of 16 (-l 16)", kind="perftest",
             argv=["ib_send_bw", "-s", "8", "-N", "-l", "16"], env={}, shm=True, funcs=pt),
        dict(name="UCX put_bw 8 B (uct posix)", kind="ucx",
             argv=["ucx_perftest", "-t", "put_bw", "-s", "8", "-x", "posix", "-d", "memory"], env={}, shm=False,
             funcs={}),
        dict(name="UCX am_bw 8 B (uct posix)", kind="ucx",
             argv=["ucx_perftest", "-t", "am_bw", "-s", "8", "-x", "posix", "-d", "memory"], env={}, shm=False,
             funcs={}),
        dict(name="UCX put_bw 8 B (rc_verbs over shmrdma)", kind="ucx",
             argv=["ucx_perftest", "-t", "put_bw", "-s", "8", "-x", "rc_verbs", "-d", f"{DEVICE}:1"], env=verbs_env,
             shm=True, funcs=pt),
        dict(name="UCX am_bw 8 B (rc_verbs over shmrdma)", kind="ucx",
             argv=["ucx_perftest", "-t", "am_bw", "-s", "8", "-x", "rc_verbs", "-d", f"{DEVICE}:1"], env=verbs_env,
             shm=True, funcs=pt),
    ]


def iters_args(kind: str, n: int) -> list[str]:
    # ucx_perftest: no warm-up, so that N is every message the client sends
    return ["-n", str(n)] if kind == "perftest" else ["-n", str(n), "-w", "0"]


def annotate_rows(path: str, *opts: str, show: str = "Ir") -> tuple[int, list[tuple[int, str]]]:
    """callgrind_annotate's program total and its (count, what) rows of event `show`, with opts."""
    r = subprocess.run(["callgrind_annotate", f"--show={show}", *opts, "--threshold=100", path],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)
    total = 0
    rows: list[tuple[int, str]] = []
    for line in r.stdout.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if not m:
            continue
        v = int(m.group(1).replace(",", ""))
        what = m.group(2)
        if what.startswith("PROGRAM TOTALS"):
            total = v
        else:
            rows.append((v, what))
    return total, rows


def valgrind() -> list[str]:
    """valgrind's command line for callgrind, with the cache simulation that counts stores (Dw) unless
    --no-stores."""
    return ["valgrind", "--tool=callgrind"] + (["--cache-sim=yes"] if STORES else [])


def program_stores(path: str, spins: set[str]) -> int | None:
    """The run's data writes (callgrind's Dw: one per store instruction, a push and a call's return
    address included) outside the clock spins, None without --cache-sim."""
    if not STORES:
        return None
    total, rows = annotate_rows(path, "--inclusive=yes", "--auto=no", show="Dw")
    return total - spun_in(rows, spins) if total else None


def function_part(name: str) -> str:
    """`function` of callgrind_annotate's `file:function [object]`."""
    fn = name.split(" [")[0]
    return fn.split(":", 1)[1] if ":" in fn.split("(")[0] else fn


def spun_in(rows: list[tuple[int, str]], spins: set[str]) -> int:
    """What the functions in spins (clock_spins' names) took, from inclusive rows (a function listed
    more than once, under several objects' names, counted once)."""
    spun: dict[str, int] = {}
    for v, what in rows:
        if what.split(" [")[0] in spins:
            spun[what] = max(v, spun.get(what, 0))
    return sum(spun.values())


CLOCK_RX = re.compile(r":(__)?(gettimeofday|clock_gettime)(_syscall)?\b")
SPIN_CALLS = 1000  # a function that reads the clock this often is a spin bounded by time, not by work


def clock_spins(path: str) -> set[str]:
    """The functions that call gettimeofday or clock_gettime at least SPIN_CALLS times: loops bounded
    by time, whose instruction count depends on how fast the process runs under valgrind, not on what
    it sends. perftest calibrates its cycle counter so (get_cpu_mhz: about 300,000 gettimeofday calls
    in 7-8 million instructions that differ by a million between runs); its timed loop with -N reads
    the cycle counter (rdtsc), as ucx_perftest's does."""
    r = subprocess.run(["callgrind_annotate", "--show=Ir", "--tree=caller", "--inclusive=yes", "--threshold=100",
                        path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)
    spins: set[str] = set()
    callers: list[tuple[str, int]] = []
    for line in r.stdout.splitlines():
        m = re.match(r"\s*[\d,]+\s+\(\s*[\d.]+%\)\s+<\s+(.*) \(([\d,]+)x\)(?: \[.*\])?$", line)
        if m:
            callers.append((m.group(1), int(m.group(2).replace(",", ""))))
            continue
        m = re.match(r"\s*[\d,]+\s+\(\s*[\d.]+%\)\s+\*\s+(.*)$", line)
        if m:
            if CLOCK_RX.search(m.group(1).split(" [")[0]):
                spins.update(name for name, calls in callers if calls >= SPIN_CALLS)
            callers = []
        elif not line.strip():
            callers = []
    return spins


def self_by_object(path: str, skip: set[str]) -> dict[str, int]:
    """Exclusive Ir by object (file name of the binary or library), read from the callgrind output
    itself (callgrind_annotate names the object on some rows only), leaving out the functions in skip
    and the clock reads."""
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}}
    objs: dict[str, int] = {}
    ob = fn = ""
    after_call = False
    ir_col = 1
    with open(path, errors="replace") as fh:
        for line in fh:
            if line.startswith("positions:"):
                ir_col = len(line.split()) - 1
                continue
            m = re.match(r"(c?)(ob|fn)=(?:\((\d+)\))?\s*(.*)$", line.rstrip("\n"))
            if m:
                kind, ident, name = m.group(2), m.group(3), m.group(4)
                if ident is not None:
                    if name:
                        names[kind][ident] = name
                    name = names[kind].get(ident, "")
                if not m.group(1):  # ob= / fn=: whose costs follow; cob= / cfn= name a call's target
                    if kind == "ob":
                        ob = os.path.basename(name)
                    else:
                        fn = name
                continue
            if line.startswith("calls="):
                after_call = True
                continue
            if not line or not (line[0].isdigit() or line[0] in "+-*"):
                continue
            if after_call:  # the call's inclusive cost: the callee's own lines count it
                after_call = False
                continue
            if fn in skip or CLOCK_RX.search(":" + fn):
                continue
            parts = line.split()
            if len(parts) > ir_col:
                objs[ob] = objs.get(ob, 0) + int(parts[ir_col])
    return objs


def annotate(path: str) -> tuple[int, dict[str, int], int, dict[str, int], set[str]]:
    """Total Ir and the inclusive Ir of every function, from callgrind_annotate; then what the clock
    spins (clock_spins) took, inclusive, and the instructions by object outside them (exclusive)."""
    total, rows = annotate_rows(path, "--inclusive=yes")
    funcs: dict[str, int] = {}
    for v, what in rows:
        funcs[what] = max(v, funcs.get(what, 0))
    spins = clock_spins(path)
    objs = self_by_object(path, {function_part(n) for n in spins})
    return total, funcs, spun_in(rows, spins), objs, spins


def func_ir(funcs: dict[str, int], rx: str) -> int | None:
    """The provider's functions (in libshmrdma-rdmav*.so) matching rx, summed (inclusive counts; none
    of them calls another). Only the rows callgrind_annotate names with the object: code the compiler
    inlined from headers into such a function (rows without an object name) is left out, so this
    undercounts; the verbs_cost rows are exact (run_verbs)."""
    total = None
    for name, v in funcs.items():
        if "libshmrdma-rdmav" in name and re.search(rx, name) and ":" in name.split("(")[0]:
            total = v if total is None else total + v
    return total


def per_function(f1: dict[str, int], f2: dict[str, int], d: int) -> list[tuple[float, str]]:
    """The provider's functions, inclusive instructions per message (func_ir's rows), costliest first."""
    per = []
    for name, v2 in f2.items():
        if "libshmrdma-rdmav" not in name:
            continue
        v = (v2 - f1.get(name, 0)) / d
        if v >= 1:
            per.append((v, short_name(name)))
    return sorted(per, reverse=True)


def short_name(name: str) -> str:
    """file:function [object] from callgrind_annotate, as `function` without namespaces or arguments."""
    fn = function_part(name).replace("(anonymous namespace)::", "")
    fn = re.sub(r"\(.*", "", fn)
    return fn.replace("shmrdma::provider::", "").replace("shmrdma::", "").replace("(anonymous namespace)::", "")


def run_case(c: dict, n: int, shmrdma: str, home: str, port: int, tmp: str) -> tuple[dict | None, str]:
    env = dict(os.environ)
    env["SHMRDMA_HOME"] = home
    env.update(c["env"])
    pre = [shmrdma, "run"] if c["shm"] else []
    out = os.path.join(tmp, f"cg.{port}.out")
    # Only the initiator under callgrind: the target runs natively, tens of times faster, so the
    # initiator never waits for it (credits, FIFO space, receives posted late), and what it spends
    # polling for its own completions is the message's cost. With both under callgrind the
    # initiator's share of waiting depended on how the two were scheduled: UCX am_bw over posix
    # came out at -764 instructions per message on a loaded machine (N1's run waited more).
    # As root it also runs at nice -20, its session's autogroup included (bench/run.py: with autogroup
    # scheduling a plain nice does nothing against another session's build), so that other work on the
    # machine rarely takes its CPU: tools with flow control (ucx_perftest's am_bw window) make the
    # initiator spin while the receiver is off its CPU.
    root = os.geteuid() == 0
    server = (["nice", "-n", "-20"] if root else []) + pre + c["argv"] + iters_args(c["kind"], n) + \
        ["-p", str(port)]
    client = pre + valgrind() + ["--dump-instr=yes", f"--callgrind-out-file={out}"] + c["argv"] + \
        iters_args(c["kind"], n) + ["-p", str(port), "localhost"]
    s = subprocess.Popen(["timeout", "300"] + server, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    if root:
        try:
            with open(f"/proc/{s.pid}/autogroup", "w") as fh:
                fh.write("-20")
        except OSError:
            pass  # no autogroup scheduling here: the nice value alone
    time.sleep(1.0)  # let the server listen
    try:
        r = subprocess.run(["timeout", "300"] + client, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    finally:
        try:
            s.wait(timeout=20)
        except subprocess.TimeoutExpired:
            s.kill()
            s.wait()
    if r.returncode != 0 or not os.path.exists(out):
        if KEEP:
            with open(os.path.join(KEEP, f"{re.sub(r'[^A-Za-z0-9]+', '_', c['name'])}.{n}.log"), "w") as fh:
                fh.write(r.stdout + "\n--- server ---\n" + (s.stdout.read() if s.stdout else ""))
        tail = " / ".join(ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("=="))[-300:]
        return None, f"client rc={r.returncode}: {tail}"
    total, funcs, spun, objs, spins = annotate(out)
    res = {"total": total - spun, "spun": spun, "stores": program_stores(out, spins), "objs": objs,
           "locked": locked_executed(out)}
    for k, rx in c["funcs"].items():
        res[k] = func_ir(funcs, rx)
    res["funcs"] = funcs
    if KEEP:
        shutil.copy(out, os.path.join(KEEP, f"{re.sub(r'[^A-Za-z0-9]+', '_', c['name'])}.{n}.{port}"))
    os.unlink(out)
    return res, ""


VERBS_MODES = [
    ("empty", "an empty poll_cq", {"poll_cq": 1}),
    ("write", "8 B WRITE, signaled (post; the poll returning its completion)", {"post_send": 1, "poll_cq": 1}),
    ("write_unsig", "8 B WRITE, unsignaled (1 in 64 signaled, as perftest's cq_mod)", {"post_send": 1}),
    ("write_inline", "8 B WRITE, inline, unsignaled (1 in 64 signaled)", {"post_send": 1}),
    ("send", "8 B SEND, signaled (post; the two polls returning the send and the receive completion)",
     {"post_send": 1, "poll_cq": 2}),
    ("read", "8 B READ, signaled (post; the poll returning its completion)", {"post_send": 1, "poll_cq": 1}),
    ("read_unsig", "8 B READ, unsignaled (1 in 64 signaled, as perftest's cq_mod)", {"post_send": 1}),
    ("fadd", "8 B fetch-and-add, signaled (post; the poll returning its completion)",
     {"post_send": 1, "poll_cq": 1}),
    ("recv", "ibv_post_recv of one WR of one SGE", {"post_recv": 1}),
    ("recv16", "ibv_post_recv of a list of 16 WRs of one SGE each (per call)", {"post_recv": 1}),
    ("srq_answer", "17 B SEND of two inline SGEs into an SRQ, an answer (Open MPI's 8 B message over UCX's "
     "rc_verbs; 1 in 64 signaled; post; the poll returning its receive completion and, 1 in 64, the send's)",
     {"post_send": 1, "poll_cq": 1}),
    ("srq_stream", "16 B SEND of two inline SGEs into an SRQ in a stream (UCX's am_bw of 8 B; its bytes in the "
     "completion; 1 in 64 signaled; post; the polls returning the completions)", {"post_send": 1, "poll_cq": 1}),
]


def build_verbs_probe() -> str:
    out_dir = os.path.join(BENCH, ".build")
    os.makedirs(out_dir, exist_ok=True)
    exe = os.path.join(out_dir, "verbs_cost")
    src = os.path.join(BENCH, "probes", "verbs_cost.c")
    subprocess.run(["cc", "-O2", "-o", exe, src, "-libverbs"], check=True)
    return exe


def locked_cost() -> tuple[float | None, float | None]:
    """bench/probes/locked_cost.c's ns per locked instruction and per ordinary load-add-store, natively."""
    exe = os.path.join(BENCH, ".build", "locked_cost")
    src = os.path.join(BENCH, "probes", "locked_cost.c")
    if subprocess.run(["cc", "-O2", "-o", exe, src]).returncode != 0:
        return None, None
    r = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    v = dict(ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)
    try:
        return float(v["locked_ns"]), float(v["plain_ns"])
    except (KeyError, ValueError):
        return None, None


# The provider's entry points as callgrind names them (--toggle-collect patterns).
VERBS_ENTRY = {"post_send": "shmrdma::provider::post_send(*", "poll_cq": "shmrdma::provider::poll_cq(*",
               "post_recv": "shmrdma::provider::post_recv(*"}


def annotate_self(path: str) -> tuple[int, dict[str, int]]:
    """Total Ir and the exclusive Ir of every function, one row per function and source file its code
    came from (its own, and each header whose inline code the compiler put into it), as
    `function (file)`."""
    total, rows = annotate_rows(path, "--inclusive=no", "--auto=no")
    funcs: dict[str, int] = {}
    for v, what in rows:
        if ":" in what.split("(")[0]:
            fn = f"{short_name(what)} ({os.path.basename(what.split(':', 1)[0])})"
            funcs[fn] = funcs.get(fn, 0) + v
    return total, funcs


# Locked instructions: a lock-prefixed one, an xchg with memory (locked without the prefix: GCC's
# seq_cst store) and mfence. Each waits for every earlier store to leave the store buffer and keeps
# later loads waiting until it is done; on the 2-vCPU EPYC host of the notes a lock cmpxchg on a
# line in the L1 costs ~5.6 ns back to back (about 20 cycles, ~20 times an ordinary instruction), so
# these, not the instruction count, set what a path that has several costs in time even when nobody
# else touches its lines (bench/probes/locked_cost.c measures it where the report is made).
_LOCKED_ADDRS: dict[str, set[int] | None] = {}


def locked_addrs(obj: str) -> set[int] | None:
    """The addresses (the object's own, as callgrind names them for a shared object) of obj's locked
    instructions, from objdump; None when objdump cannot read it."""
    if obj in _LOCKED_ADDRS:
        return _LOCKED_ADDRS[obj]
    got: set[int] | None = None
    if os.path.isfile(obj) and shutil.which("objdump"):
        r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        if r.returncode == 0:
            got = set()
            for line in r.stdout.splitlines():
                m = re.match(r"\s*([0-9a-f]+):\s+(\S.*)$", line)
                if not m:
                    continue
                insn = m.group(2)
                if insn.startswith("lock ") or insn.startswith("mfence") or (insn.startswith("xchg") and "(" in insn):
                    got.add(int(m.group(1), 16))
    _LOCKED_ADDRS[obj] = got
    return got


def locked_executed(path: str) -> int | None:
    """How many locked instructions (locked_addrs) the run executed: callgrind's per-instruction Ir
    (--dump-instr=yes) at those addresses, over every object objdump reads. None without per-instruction
    data."""
    names: dict[str, str] = {}
    counts: dict[str, dict[int, int]] = {}
    ob = ""
    last = [0, 0]
    after_calls = False
    instr = False

    def name(v: str) -> str:
        m = re.match(r"\((\d+)\)\s*(.*)$", v)
        if not m:
            return v.strip()
        if m.group(2):
            names[m.group(1)] = m.group(2).strip()
        return names.get(m.group(1), "")

    def sub(tok: str, i: int) -> int:
        if tok == "*":
            return last[i]
        if tok[0] in "+-":
            return last[i] + int(tok, 0)
        return int(tok, 0)

    with open(path) as fh:
        for line in fh:
            c = line[:1]
            if c.isdigit() or c in "+-*":
                if not instr:
                    continue
                tok = line.split()
                if len(tok) < 2:
                    continue
                last = [sub(tok[0], 0), sub(tok[1], 1)]
                if after_calls:  # a call's inclusive cost: not the instruction's own
                    after_calls = False
                    continue
                if len(tok) > 2 and ob:
                    d = counts.setdefault(ob, {})
                    d[last[0]] = d.get(last[0], 0) + int(tok[2])
            elif line.startswith("positions:"):
                instr = line.split()[1:3] == ["instr", "line"]
            elif line.startswith("ob="):
                ob = name(line[3:])
            elif line.startswith("cob="):
                name(line[4:])
            elif line.startswith("calls="):
                after_calls = True
    if not instr:
        return None
    n = 0
    for obj, d in counts.items():
        addrs = locked_addrs(obj)
        if addrs:
            n += sum(v for a, v in d.items() if a in addrs)
    return n


def run_verbs(exe: str, mode: str, n: int, shmrdma: str, home: str, tmp: str,
              which: list[str]) -> tuple[dict | None, str]:
    """The probe under callgrind (one process), once per entry point in `which`, collecting only while
    that entry point runs (--toggle-collect): the run's total is the entry point's exact inclusive count
    (every instruction under it: its own, what the compiler inlined into it, its callees, libc's), and
    its per-function exclusive counts say where they went."""
    env = dict(os.environ, SHMRDMA_HOME=home)
    res: dict = {"funcs": {}}
    for k in which:
        out = os.path.join(tmp, f"cg.verbs.{mode}.{k}.{n}")
        r = subprocess.run(["timeout", "300", shmrdma, "run", *valgrind(),
                            "--dump-instr=yes", f"--callgrind-out-file={out}", f"--toggle-collect={VERBS_ENTRY[k]}",
                            exe, mode, str(n)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            tail = " / ".join(ln for ln in r.stdout.splitlines() if ln.strip() and not ln.startswith("=="))[-300:]
            return None, f"rc={r.returncode}: {tail}"
        total, funcs = annotate_self(out)
        res[k] = total
        res[k + "_stores"] = program_stores(out, set())  # collected inside the entry point only: no clock spins
        res[k + "_locked"] = locked_executed(out)
        res["funcs"][k] = funcs
        if KEEP:
            shutil.copy(out, os.path.join(KEEP, f"verbs_{mode}.{k}.{n}"))
        os.unlink(out)
    return res, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(REPO, "build"))
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "callgrind.md"))
    ap.add_argument("--quick", action="store_true", help="N1=2000, N2=6000 instead of 10000, 30000")
    ap.add_argument("--only", default="", help="regex on the case names")
    ap.add_argument("--verbs", action="store_true",
                    help="also the per-call counts of bench/probes/verbs_cost.c (one process, two QPs)")
    ap.add_argument("--verbs-only", action="store_true", help="only those")
    ap.add_argument("--keep", default="", help="keep every callgrind output (and failed runs' logs) in this directory")
    ap.add_argument("--repeat", type=int, default=3,
                    help="run each case this many times per N and keep the smallest total (least waiting)")
    ap.add_argument("--no-stores", action="store_true",
                    help="no cache simulation: no store counts (callgrind's Dw), about twice as fast")
    ap.add_argument("--functions", type=int, default=25,
                    help="per case, list the provider's N costliest functions per message (inclusive; 0: none)")
    args = ap.parse_args()
    global KEEP, STORES
    STORES = not args.no_stores
    if args.keep:
        KEEP = os.path.abspath(args.keep)
        os.makedirs(KEEP, exist_ok=True)
    for tool in ("valgrind", "callgrind_annotate", "ib_write_bw", "ucx_perftest"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} not found (Debian: valgrind, perftest, ucx-utils)")
    shmrdma = os.path.join(args.build, "tools", "shmrdma")
    n1, n2 = (2000, 6000) if args.quick else (10000, 30000)
    load0 = os.getloadavg()[0]
    home = tempfile.mkdtemp(prefix="shmrdma-cg-")
    tmp = tempfile.mkdtemp(prefix="shmrdma-cg-out-")
    env = dict(os.environ, SHMRDMA_HOME=home)
    r = subprocess.run([shmrdma, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise SystemExit(f"shmrdma up failed: {r.stdout}")
    rows = []
    verbs_rows = []
    locked_ns = plain_ns = None
    port = 25000 + os.getpid() % 1000 * 10
    try:
        for c in cases():
            if args.verbs_only or (args.only and not re.search(args.only, c["name"])):
                continue
            got = []
            why = ""
            spread = 0.0
            for n in (n1, n2):
                runs = []
                for _ in range(args.repeat):
                    port += 1
                    log(f"{c['name']}: {n} messages")
                    res, why = run_case(c, n, shmrdma, home, port, tmp)
                    if res is None:
                        break
                    runs.append(res)
                if len(runs) < args.repeat:
                    break
                # waiting only adds instructions: keep the run that waited least
                totals = [r["total"] for r in runs]
                spread = max(spread, max(totals) - min(totals))
                got.append(min(runs, key=lambda r: r["total"]))
            row = {"name": c["name"], "why": why}
            if len(got) == 2:
                d = n2 - n1
                row["total"] = (got[1]["total"] - got[0]["total"]) / d
                if got[0]["stores"] is not None and got[1]["stores"] is not None:
                    row["stores"] = (got[1]["stores"] - got[0]["stores"]) / d
                if got[0]["locked"] is not None and got[1]["locked"] is not None:
                    row["locked"] = (got[1]["locked"] - got[0]["locked"]) / d
                row["spread"] = spread / d
                if row["total"] <= 0:
                    row["why"] = "not a count: N2's run took fewer instructions than N1's (waiting)"
                elif args.repeat > 1 and row["spread"] > 0.05 * row["total"]:
                    row["why"] = (f"repeats differed by {row['spread']:,.0f} per message (waiting); "
                                  "the smallest kept")
                for k in c["funcs"]:
                    a, b = got[0].get(k), got[1].get(k)
                    row[k] = (b - a) / d if a is not None and b is not None else None
                row["per_func"] = per_function(got[0]["funcs"], got[1]["funcs"], d)[:args.functions]
                o1, o2 = got[0]["objs"], got[1]["objs"]
                row["objs"] = sorted(((o2.get(k, 0) - o1.get(k, 0)) / d, k) for k in set(o1) | set(o2))[::-1]
                row["spun"] = max(got[0]["spun"], got[1]["spun"])
            rows.append(row)
            log(f"{c['name']}: { {k: v for k, v in row.items() if k != 'per_func'} }")
        if args.verbs or args.verbs_only:
            exe = build_verbs_probe()
            locked_ns, plain_ns = locked_cost()
            for mode, what, per in VERBS_MODES:
                got = []
                why = ""
                for n in (n1, n2):
                    log(f"verbs_cost {mode}: {n}")
                    res, why = run_verbs(exe, mode, n, shmrdma, home, tmp, list(per))
                    if res is None:
                        break
                    got.append(res)
                row = {"mode": mode, "what": what, "why": why}
                if len(got) == 2:
                    d = n2 - n1
                    for k, calls in per.items():
                        a, b = got[0].get(k), got[1].get(k)
                        row[k] = (b - a) / d / calls if a is not None and b is not None else None
                        for x in ("_stores", "_locked"):
                            a, b = got[0].get(k + x), got[1].get(k + x)
                            row[k + x] = (b - a) / d / calls if a is not None and b is not None else None
                    pf = []
                    for k in per:
                        f1, f2 = got[0]["funcs"][k], got[1]["funcs"][k]
                        for fn, v2 in f2.items():
                            v = (v2 - f1.get(fn, 0)) / d / per[k]
                            if v >= 1:
                                pf.append((v, f"{k}: {fn}"))
                    row["per_func"] = sorted(pf, reverse=True)[:args.functions]
                verbs_rows.append(row)
                log(f"verbs_cost {mode}: { {k: v for k, v in row.items() if k != 'per_func'} }")
    finally:
        subprocess.run([shmrdma, "down", "--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def f(v):
        return "—" if v is None else f"{v:,.0f}"

    git = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout.strip()
    L = ["# Instructions per 8-byte message (callgrind)", "",
         f"- date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}; shmrdma {git}; "
         f"N1={n1}, N2={n2} messages (per message = difference / (N2 - N1))",
         "- command: `python3 bench/callgrind.py" + " ".join([""] + sys.argv[1:]) + "`",
         f"- load average at start {load0:.1f}, at end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
         + (" (**a loaded machine: the waiting loops' share, and so the SEND-side and am_bw counts, are less "
            "reliable**)" if max(load0, os.getloadavg()[0]) > (os.cpu_count() or 2) else ""),
         f"- the initiating process (the client) under callgrind, the target natively and at nice -20 as root "
         f"(tens of times faster and rarely off its CPU, so the initiator does not wait for it); each N run {args.repeat} time(s), the smallest total kept (waiting "
         "only adds instructions); instruction counts do not depend on the machine's load, but the share of "
         "empty polls does, so a row whose repeats differed says so; UCX over rc_verbs with UCX_IB_REG_METHODS=direct "
         "(under valgrind UCX's registration cache fails and UCX would use one implicit ODP MR instead, and then "
         "crash at exit: see the script's docstring)",
         "- stores: the store instructions among them (callgrind's Dw, with --cache-sim=yes; pushes and calls' "
         "return addresses count). They matter apart from the instructions: x86 makes stores visible in order, "
         "so when a message's bytes go to a line the target is polling (ucx_perftest's put_bw responder reads "
         "the buffer it is written into; every receiver polls its CQ), each later store waits behind that "
         "line's transfer once the store buffer is full (bench/README.md)", "",
         "- locked: the locked instructions among them (lock-prefixed, xchg with memory, mfence; see the "
         "verbs_cost table below for what one costs), in every object of the process",
         "",
         "| case | whole initiating process | stores | locked | provider post_send | provider poll_cq | note |",
         "|---|---:|---:|---:|---:|---:|---|"]

    def g(v):  # a count that waiting moved by a fraction below zero is none
        return "—" if v is None else f"{max(v, 0.0):.1f}".rstrip("0").rstrip(".")
    for r in rows:
        L.append(f"| {r['name']} | {f(r.get('total'))} | {f(r.get('stores'))} | {g(r.get('locked'))} | "
                 f"{f(r.get('post_send'))} | {f(r.get('poll_cq'))} | {r['why'] or ''} |")
    L.append("")
    by = {r["name"]: r.get("total") for r in rows}
    cases_by_name = {c["name"]: c for c in cases()}
    pairs = [("shmrdma ib_write_bw 8 B (mapped tier)", "UCX put_bw 8 B (uct posix)", "WRITE"),
             ("shmrdma ib_send_bw 8 B", "UCX am_bw 8 B (uct posix)", "SEND")]
    objs = {r["name"]: dict((k, v) for v, k in r.get("objs", [])) for r in rows}
    for a, b, what in pairs:
        if by.get(a) and by.get(b):
            tool = objs[a].get(cases_by_name[a]["argv"][0], 0)
            L.append(f"- {what}: shmrdma {by[a]:,.0f} against UCX posix {by[b]:,.0f} instructions per message in "
                     f"the whole initiating process: {by[a] / by[b]:.2f}x (target <= 2x); {tool:,.0f} of the "
                     f"{by[a]:,.0f} are {cases_by_name[a]['argv'][0]}'s own code (below), which leaves "
                     f"{2 * by[b] - tool:,.0f} for everything else within the target")
    L.append("")
    if any(r.get("objs") for r in rows):
        L += ["## By object", "",
              "Exclusive instructions per message in each object (the tool, libibverbs, the provider, UCX's "
              "libraries, libc), outside the clock spins; objects under one instruction per message left out.", ""]
        for r in rows:
            if not r.get("objs"):
                continue
            spun = f" (clock spins left out: up to {r['spun']:,.0f} instructions per run)" if r.get("spun") else ""
            L += [f"### {r['name']}{spun}", "", "| object | per message |", "|---|---:|"]
            L += [f"| {k} | {v:,.0f} |" for v, k in r["objs"] if v >= 1]
            L.append("")
    if verbs_rows:
        L += ["## Per verb call (bench/probes/verbs_cost.c)", "",
              "One process, two RC QPs connected to each other (the data moves with memcpy, as between processes "
              "in the mapped tier; under valgrind MRs of separate processes fall back to the CMA tier, see the "
              "notes). Inclusive instructions of the provider's post_send and poll_cq per call, exact: callgrind "
              "collects only while each of them runs (--toggle-collect), so everything under it counts, what the "
              "compiler inlined from headers included (the per-function tables below are exclusive and add up to "
              "it). Targets (issue 12): "
              "an 8 B WRITE post <= 250, a signaled SEND post <= 400, an empty poll_cq <= 30, a poll returning one "
              "completion <= 80. The READ, atomic and post_recv rows have no target of their own (issue 12 "
              "judges ib_read_bw, ib_read_lat, ib_atomic_lat and ib_send_* on the harness).", "",
              "Locked: how many of them are locked instructions (lock-prefixed, xchg with memory, mfence), "
              "each of which waits for the store buffer to drain and holds later loads until it is done"
              + (f": {locked_ns:.1f} ns each here, back to back on a line in the L1, against {plain_ns:.2f} ns "
                 "for an ordinary dependent add (bench/probes/locked_cost.c)" if locked_ns else "")
              + ". A path's time follows them more than its instruction count.", "",
              "| call | provider post_send | its stores | locked | provider poll_cq | locked | provider post_recv "
              "| locked | note |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]

        for r in verbs_rows:
            L.append(f"| {r['what']} | {f(r.get('post_send'))} | {f(r.get('post_send_stores'))} | "
                     f"{g(r.get('post_send_locked'))} | {f(r.get('poll_cq'))} | {g(r.get('poll_cq_locked'))} | "
                     f"{f(r.get('post_recv'))} | {g(r.get('post_recv_locked'))} | {r['why'] or ''} |")
        L.append("")
    if args.functions:
        for r in verbs_rows:
            if r.get("per_func"):
                L += [f"### verbs_cost {r['mode']}: per call, exclusive (entry point: function)", "",
                      "| function | per call |", "|---|---:|"]
                L += [f"| `{fn}` | {v:,.0f} |" for v, fn in r["per_func"]]
                L.append("")
        L += ["## Inside the provider, per function", "",
              "Inclusive instructions per message of the provider's costliest functions (callers include their "
              "callees, so the column does not add up), from the same runs.", ""]
        for r in rows:
            if not r.get("per_func"):
                continue
            L += [f"### {r['name']}", "", "| function | per message |", "|---|---:|"]
            L += [f"| `{fn}` | {v:,.0f} |" for v, fn in r["per_func"]]
            L.append("")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write("\n".join(L))
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
