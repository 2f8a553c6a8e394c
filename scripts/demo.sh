#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to stock RDMA tools running over
# shmrdma: installs dependencies, builds, installs, brings up shm0 and runs
# the demo. Run from the repository root as root (or with sudo available).
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
echo "== shmrdma run ibv_devinfo -v"
"$SHMRDMA" run ibv_devinfo -v
echo "== shmrdma status"
"$SHMRDMA" status
echo "demo: done. Use any verbs program with: $SHMRDMA run PROGRAM ARGS..."
