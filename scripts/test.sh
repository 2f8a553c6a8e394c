#!/usr/bin/env bash
# The whole test suite: installs dependencies, builds, and runs the unit,
# integration, stress, data-path, event and system tests; then every suite of
# our own programs again under ASan+UBSan and under TSan (the stock tools run
# in the plain build only); and compiles the release configuration, tests
# included. Every build here has -Dwerror=true (the default is off, so that
# other compilers and packagers' flags never fail a build on a warning).
# Run from the repository root as root.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

build_only() {
  local dir="$1"; shift
  if [ -d "$dir" ]; then
    meson setup "$dir" --reconfigure -Dwerror=true "$@" >/dev/null
  else
    meson setup "$dir" -Dwerror=true "$@" >/dev/null
  fi
  ninja -C "$dir"
}

# A phase whose tests fail does not stop the others (a build that fails
# does): the closing summary counts every phase and repeats what failed. A
# phase whose `meson test` fails is remembered (FAILED_PHASES), so that the
# run fails even when its log names no failed test.
FAILED_PHASES=""
run_suite() {
  local dir="$1"; shift
  local suites=()
  while [ $# -gt 0 ] && [ "$1" = "--suite" ]; do suites+=("$1" "$2"); shift 2; done
  build_only "$dir" "$@"
  rm -f "$dir/meson-logs/testlog.json"  # only this run's results count
  meson test -C "$dir" --print-errorlogs --num-processes 2 --no-rebuild "${suites[@]}" ||
    FAILED_PHASES="$FAILED_PHASES $dir"
}

echo "== build and test (debugoptimized): every suite"
run_suite build-test
echo "== ASan+UBSan: every suite of our own programs (data path and events included)"
# The process-killing UD scenarios stay with the plain build: their timing
# under ASan on a loaded 2-core machine is not what they test.
GTEST_FILTER='-*ud_deadpeer*:*ud_deadsender*' \
LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
  run_suite build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dsystem_tests=false
echo "== TSan: every suite of our own programs (data path and events included)"
# Stock programs cannot load a TSan-instrumented plugin, so the cases that run
# them through `shmrdma run` are left to the other two builds; the
# process-killing UD scenarios stay with the plain build (see ASan above). The
# RoCE control-plane cases named here run stock ibv_devinfo / ibv_asyncwatch,
# and the RDMA CM cases named here run stock librdmacm tools (cm_probe, ours,
# runs here: the daemon's CM code under TSan).
GTEST_FILTER='-StockTools.*:SrqMultiProcess.StockIbvSrqPingpong:*ud_deadpeer*:*ud_deadsender*:RoceCtl.DevicesInTwoNamespacesLookLikeRxe:RoceCtl.Mlx5LayoutHasV1V2Pairs:RoceCtl.FollowsTheInterfaceWithinASecond:RoceCtl.MoreAddressesThanTheTableHolds:CmStock.*:CmUcx.*:CmFaults.DaemonKilledKeepsEstablishedQps' \
TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp" \
  run_suite build-tsan -Db_sanitize=thread -Db_lundef=false -Dsystem_tests=false
echo "== release build (-O3, tests included): compiles without a warning"
# GCC at -O3 warns where -O2 does not (-Wrestrict, -Wstringop-*); compiling is
# enough, the suites above ran the code.
build_only build-release --buildtype=release
# The close, over every suite that ran: what each failed test said (its
# GoogleTest failure messages, or the end of its output), last, so that a
# log's tail holds it; then one plain line of counts.
FAILED_PHASES="$FAILED_PHASES" python3 - build-test build-asan build-tsan <<'PY'
import json, os, re, sys
passed = failed = skipped = 0
said = []
for d in sys.argv[1:]:
    try:
        lines = open(f"{d}/meson-logs/testlog.json").read().splitlines()
    except OSError:
        lines = []
    phase_failed = d in os.environ.get("FAILED_PHASES", "").split()
    if phase_failed and not any(json.loads(ln).get("result") not in ("OK", "EXPECTEDFAIL", "SKIP")
                                for ln in lines):
        failed += 1  # meson test failed, and its log names no failed test
        said.append(f"== {d}: meson test failed without a failed test in its log (see above)")
    for line in lines:
        t = json.loads(line)
        r = t.get("result")
        if r in ("OK", "EXPECTEDFAIL"):
            passed += 1
        elif r == "SKIP":
            skipped += 1
        else:
            failed += 1
            out = (t.get("stdout") or "").splitlines()
            keep, take = [], 0
            for ln in out:  # from each "file:line: Failure" to the end of its test
                if re.search(r":\d+: Failure$", ln) or ln.startswith("[  FAILED  ]"):
                    take = 40
                elif ln.startswith(("[ RUN", "[       OK ]")):
                    take = 0
                if take:
                    keep.append(ln)
                    take -= 1
            said.append(f"== {d}: {t.get('name')}: {r}")
            said += (keep or out[-25:])[:160]
if said:
    print("== what the failed tests said")
    print("\n".join(said))
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
PY
