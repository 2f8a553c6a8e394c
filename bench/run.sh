#!/usr/bin/env bash
# The shmrdma benchmark harness: bench/run.sh [--quick] [...]; see bench/README.md
# and `bench/run.sh --help`. Prefers Debian's python3 (where python3-matplotlib
# installs), falling back to whatever python3 is first on PATH.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=/usr/bin/python3
[ -x "$py" ] || py="$(command -v python3)"
BENCH_COMMAND="bench/run.sh${*:+ $*}" exec "$py" "$here/run.py" "$@"
