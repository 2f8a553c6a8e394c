#!/usr/bin/env python3
"""Draws bench/results/latest.png from latest.csv (run by bench/run.py).

    python3 bench/plot.py results/latest.csv results/latest.png

Three panels: latency by size, bandwidth by size, message rate at 8 B;
shmrdma in solid lines, the peers dashed, the floors in grey. Points are
medians over the rounds, bars span min to max.
"""

import csv
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    runs = defaultdict(list)  # (impl, test, variant, size, figure) -> values
    probes = defaultdict(list)  # figure -> values
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["status"] not in ("ok", "partial") or not r["value"]:
                continue
            v = float(r["value"])
            if r["impl"] == "floor":
                probes[r["figure"]].append(v)
            else:
                runs[(r["impl"], r["test"], r["variant"], int(r["size_B"]), r["figure"])].append(v)
    return runs, probes


def series(runs, figure, pred):
    """{label: [(size, median, min, max)]} for the runs that pred() accepts."""
    out = defaultdict(list)
    for (impl, test, variant, size, fig), vals in runs.items():
        if fig != figure or not pred(impl, test, variant, size):
            continue
        if impl == "shmrdma":
            label = f"shmrdma {test}"
        elif impl == "ucx":
            label = f"ucx {test} ({variant})"
        else:
            label = f"fi_pingpong ({variant})"
        out[label].append((size, statistics.median(vals), min(vals), max(vals)))
    return {k: sorted(v) for k, v in out.items()}


SHM_COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
PEER_COLORS = ["#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
               "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#393b79", "#637939", "#8c6d31"]


def draw(ax, data):
    shm_i = peer_i = 0
    for label, pts in sorted(data.items(), key=lambda kv: (not kv[0].startswith("shmrdma"), kv[0])):
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        lo = [p[1] - p[2] for p in pts]
        hi = [p[3] - p[1] for p in pts]
        shm = label.startswith("shmrdma")
        if shm:
            color = SHM_COLORS[shm_i % len(SHM_COLORS)]
            shm_i += 1
        else:
            color = PEER_COLORS[peer_i % len(PEER_COLORS)]
            peer_i += 1
        ax.errorbar(xs, ys, yerr=[lo, hi], label=label, color=color, marker="o" if shm else "s",
                    linestyle="-" if shm else "--", linewidth=2.2 if shm else 1.1, markersize=5 if shm else 4,
                    capsize=2, alpha=1.0 if shm else 0.8)


def size_label(x, _pos=None):
    x = int(round(x))
    if x >= 1 << 20:
        return f"{x >> 20}M"
    if x >= 1 << 10:
        return f"{x >> 10}K"
    return str(x)


def main():
    csv_path, png_path = sys.argv[1], sys.argv[2]
    runs, probes = load(csv_path)
    med = {k: statistics.median(v) for k, v in probes.items()}
    fig, axes = plt.subplots(1, 3, figsize=(20, 7), gridspec_kw={"width_ratios": [1.1, 1.1, 0.8]})

    # latency by size
    ax = axes[0]
    lat = series(runs, "lat_us",
                 lambda i, t, v, s: "lat" in t or i == "fi" or (t in ("ucp_get", "ucp_fadd") and s <= 64))
    draw(ax, lat)
    cl = med.get("cacheline_halfrtt_ns_median")
    if cl:
        xs, ys = [], []
        for s in (2, 64, 65536, 1048576):
            bw = med.get(f"memcpy_GBps_{s}")
            extra = s / (bw * 1e3) if bw else 0.0
            if s > 64 and not bw:
                continue
            xs.append(s)
            ys.append(cl / 1000 + extra)
        ax.plot(xs, ys, color="grey", linewidth=3, alpha=0.5, label="floor: cache-line hand-off + memcpy")
    pvm = med.get("pvm_write_lat_ns_8")
    if pvm:
        ax.axhline(pvm / 1000, color="grey", linestyle=":", label="process_vm_writev 8 B call")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("latency, µs (median; one-way for send/write/ping-pong, round trip for read/atomic/get/fadd)")
    ax.set_title("Latency by size (lower is better)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(size_label))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")

    # bandwidth by size
    ax = axes[1]
    bw = series(runs, "bw_GBps", lambda i, t, v, s: ("bw" in t or t == "ucp_get") and s >= 4096)
    draw(ax, bw)
    xs = sorted(int(k.rsplit("_", 1)[1]) for k in med if k.startswith("memcpy_GBps_"))
    if xs:
        ax.plot(xs, [med[f"memcpy_GBps_{x}"] for x in xs], color="grey", linewidth=3, alpha=0.5,
                label="floor: memcpy (one core)")
    xs = sorted(int(k.rsplit("_", 1)[1]) for k in med if k.startswith("pvm_write_GBps_"))
    if xs:
        ax.plot(xs, [med[f"pvm_write_GBps_{x}"] for x in xs], color="grey", linestyle=":", linewidth=2,
                label="process_vm_writev")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bandwidth, GB/s (1e9 B/s, median)")
    ax.set_title("Bandwidth by size (higher is better)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(size_label))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")

    # message rate at 8 B
    ax = axes[2]
    rate = series(runs, "rate_Mpps", lambda i, t, v, s: s == 8 and ("bw" in t or t in ("ucp_get",)))
    items = sorted(((lab, pts[0][1], pts[0][2], pts[0][3]) for lab, pts in rate.items()), key=lambda x: x[1])
    if items:
        labels = [x[0] for x in items]
        vals = [x[1] for x in items]
        err = [[x[1] - x[2] for x in items], [x[3] - x[1] for x in items]]
        colors = ["tab:blue" if lab.startswith("shmrdma") else "tab:orange" for lab in labels]
        ax.barh(range(len(items)), vals, xerr=err, color=colors, capsize=2)
        ax.set_yticks(range(len(items)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_xscale("log")
    ax.set_xlabel("million messages/s (median, log)")
    ax.set_title("Message rate, 8 B (higher is better)")
    ax.grid(True, axis="x", which="both", alpha=0.3)

    fig.suptitle("shmrdma beside its peers (ucx_perftest, fi_pingpong) and the floors (bench/probes)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
