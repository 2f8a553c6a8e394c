#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to stock RDMA tools moving data
# over shmrdma: installs dependencies, builds, installs, brings up shm0, lists
# it, then runs an ib_write_bw, an ib_send_lat and an ibv_rc_pingpong pair
# over it (server and client as separate processes, on localhost) and prints
# their results. Run from the repository root as root (or with sudo available).
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX="${PREFIX:-/usr/local}"
bash scripts/install-deps.sh
meson setup build --prefix "$PREFIX" --buildtype=release -Dtests=false --reconfigure >/dev/null 2>&1 ||
  meson setup build --prefix "$PREFIX" --buildtype=release -Dtests=false >/dev/null
ninja -C build >/dev/null
SUDO=""; if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO meson install -C build --quiet
SHMRDMA="$PREFIX/bin/shmrdma"

echo "== shmrdma up"
$SUDO "$SHMRDMA" up --name shm0
echo "== shmrdma run ibv_devices"
"$SHMRDMA" run ibv_devices
echo "== shmrdma run ibv_devinfo -d shm0"
"$SHMRDMA" run ibv_devinfo -d shm0

# A server/client pair: the server in the background, the client once the
# server listens on its TCP port, both under a timeout so nothing hangs.
SERVER_PID=""
cleanup() { if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
listening() {  # TCP port $1 in state LISTEN (0A), IPv4 or IPv6
  local hex; hex=$(printf '%04X' "$1")
  grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:[0-9A-F]+ 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
# pair PORT FILTER PROGRAM ARGS...: prints the client's lines matching FILTER.
pair() {
  local port="$1" filter="$2"; shift 2
  local out; out=$(mktemp)
  echo "== $* -p $port   (server: shmrdma run $1 ... &, client: shmrdma run $1 ... localhost)"
  timeout 60 "$SHMRDMA" run "$@" -p "$port" >"$out.server" 2>&1 &
  SERVER_PID=$!
  local waited=0
  until listening "$port"; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null || [ "$waited" -ge 200 ]; then
      echo "demo: the $1 server did not start:"; cat "$out.server"; exit 1
    fi
    sleep 0.1; waited=$((waited + 1))
  done
  if ! timeout 60 "$SHMRDMA" run "$@" -p "$port" localhost >"$out" 2>&1; then
    echo "demo: the $1 client failed:"; cat "$out"; echo "-- server:"; cat "$out.server"; exit 1
  fi
  if ! wait "$SERVER_PID"; then
    SERVER_PID=""; echo "demo: the $1 server failed:"; cat "$out.server"; exit 1
  fi
  SERVER_PID=""
  grep -E "$filter" "$out" || { echo "demo: no result lines from $1:"; cat "$out"; exit 1; }
  rm -f "$out" "$out.server"
}
# perftest's result table: its header and its rows.
pair 23901 '^ *#bytes|^ *[0-9]+ +[0-9]+ +[0-9.]+' ib_write_bw -d shm0
pair 23902 '^ *#bytes|^ *[0-9]+ +[0-9]+ +[0-9.]+' ib_send_lat -d shm0
# ibv_rc_pingpong: bytes moved and time per round trip (-c checks the data).
pair 23903 ' bytes in | iters in ' ibv_rc_pingpong -d shm0 -g 0 -c

echo "== shmrdma status"
"$SHMRDMA" status
echo "demo: done. Use any verbs program with: $SHMRDMA run PROGRAM ARGS..."
