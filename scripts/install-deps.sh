#!/usr/bin/env bash
# Installs what shmrdma needs to build, test and demo on Debian 12, from
# Debian's own packages. Idempotent; needs root (or sudo).
set -euo pipefail

PACKAGES=(
  build-essential g++ meson ninja-build pkg-config
  libibverbs-dev ibverbs-utils ibverbs-providers rdma-core perftest
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  libnl-3-dev libnl-route-3-dev iproute2
  librdmacm-dev rdmacm-utils libfabric-bin ucx-utils
  python3 groff-base man-db
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
