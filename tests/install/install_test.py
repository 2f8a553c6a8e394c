#!/usr/bin/env python3
"""What `meson install` delivers, checked without root or a device.

  install_test.py version        `shmrdma --version` prints the project version
  install_test.py man PAGE...    each page renders without a warning (groff -ww, man --warnings)
  install_test.py destdir        `meson install --destdir` into a temporary directory, then:
                                 shmrdma.pc answers (version, provider, shim, bindir, statedir),
                                 the files it names exist, the installed command finds its plugin and
                                 shim relative to itself (`shmrdma env`), the completion parses.

The build's facts come from the environment meson sets (SHMRDMA_*). Exit 0
pass, 1 fail, 77 skip.
"""

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

SKIP = 77


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def run(args, env=None, timeout=60):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def check_version():
    want = "shmrdma " + os.environ["SHMRDMA_VERSION"]
    rc, out, err = run([os.environ["SHMRDMA_BIN"], "--version"])
    if rc != 0 or out.strip() != want:
        fail(f"`shmrdma --version`: exit {rc}, printed {out!r} (stderr {err!r}), expected {want!r}")
    print(f"PASS: {out.strip()}")


def check_man(pages):
    if not pages:
        fail("no pages given")
    if shutil.which("groff") is None:
        print("SKIP: groff is not installed (apt-get install groff-base)")
        sys.exit(SKIP)
    env = dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="80", MANROFFSEQ="")
    for page in pages:
        rc, out, err = run(["groff", "-man", "-ww", "-z", page], env=env)
        if rc != 0 or err:
            fail(f"groff -man -ww -z {page}: exit {rc}\n{err}")
        if shutil.which("man"):
            # What lintian runs: warnings of man's own preprocessing and of groff.
            rc, out, err = run(["man", "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", page], env=env)
            if rc != 0 or err:
                fail(f"man --warnings -l {page}: exit {rc}\n{err}")
            rc, out, err = run(["man", "-l", page], env=dict(env, MANPAGER="cat", PAGER="cat"))
            if rc != 0 or "NAME" not in out or "SEE ALSO" not in out:
                fail(f"man -l {page}: exit {rc}, output without NAME/SEE ALSO\n{out[:400]}{err}")
        print(f"PASS: {page} renders without warnings")


def pkg_config(pcdir, *args):
    env = dict(os.environ, PKG_CONFIG_PATH=pcdir, PKG_CONFIG_LIBDIR=pcdir)
    rc, out, err = run(["pkg-config", *args, "shmrdma"], env=env)
    if rc != 0:
        fail(f"pkg-config {' '.join(args)} shmrdma: exit {rc}\n{err}")
    return out.strip()


def check_destdir():
    if shutil.which("pkg-config") is None:
        print("SKIP: pkg-config is not installed")
        sys.exit(SKIP)
    e = os.environ
    prefix, libdir, bindir = e["SHMRDMA_PREFIX"], e["SHMRDMA_LIBDIR"], e["SHMRDMA_BINDIR"]
    with tempfile.TemporaryDirectory(prefix="shmrdma-install-test-") as dest:
        rc, out, err = run(["meson", "install", "-C", e["MESON_BUILD_ROOT"], "--no-rebuild", "--quiet",
                            "--destdir", dest], timeout=120)
        if rc != 0:
            fail(f"meson install --destdir {dest}: exit {rc}\n{out}{err}")

        def staged(path):  # where an installed absolute path landed under the destdir
            return dest + path

        pcdir = staged(os.path.join(prefix, libdir, "pkgconfig"))
        if not os.path.isfile(os.path.join(pcdir, "shmrdma.pc")):
            fail(f"no shmrdma.pc in {pcdir}")
        checks = {
            "--modversion": e["SHMRDMA_VERSION"],
            "--variable=provider": e["SHMRDMA_PLUGIN_BASE"],
            "--variable=shim": e["SHMRDMA_SHIM"],
            "--variable=bindir": os.path.join(prefix, bindir),
            "--variable=statedir": "/run/shmrdma",
            "--variable=driverfile": e["SHMRDMA_DRIVER_FILE"],
        }
        for arg, want in checks.items():
            got = pkg_config(pcdir, arg)
            if got != want:
                fail(f"pkg-config {arg} shmrdma = {got!r}, expected {want!r}")
        provider = pkg_config(pcdir, "--variable=provider")
        for f in (provider + "-rdmav34.so", pkg_config(pcdir, "--variable=shim"),
                  pkg_config(pcdir, "--variable=shmrdma"), e["SHMRDMA_COMPLETION"],
                  os.path.join(prefix, e["SHMRDMA_MANDIR"], "man1", "shmrdma.1"),
                  os.path.join(prefix, e["SHMRDMA_MANDIR"], "man7", "shmrdma.7")):
            if not os.path.isfile(staged(f)):
                fail(f"{f} is not installed (looked in {staged(f)})")
        driver = e["SHMRDMA_DRIVER_FILE"]
        if driver:
            with open(staged(driver)) as fh:
                lines = [l.split() for l in fh if l.strip() and not l.lstrip().startswith("#")]
            if lines != [["driver", provider]]:
                fail(f"{driver} holds {lines}, expected one line 'driver {provider}'")

        # The installed command, run from the destdir, is a private-prefix
        # install: it must find the plugin and the shim next to itself.
        home = os.path.join(dest, "home")
        env = {k: v for k, v in os.environ.items() if k not in ("RDMAV_DRIVERS", "LD_PRELOAD", "SHMRDMA_PROVIDER_DIR")}
        rc, out, err = run([staged(os.path.join(prefix, bindir, "shmrdma")), "--home", home, "env"], env=env)
        if rc != 0:
            fail(f"installed shmrdma env: exit {rc}\n{err}")
        got = {}
        for line in out.splitlines():
            words = shlex.split(line)
            if len(words) != 2 or words[0] != "export" or "=" not in words[1]:
                fail(f"shmrdma env printed {line!r}, not an export line")
            k, v = words[1].split("=", 1)
            got[k] = v
        # A sanitizer build puts its runtime in front of the shim.
        preload = [p for p in got.get("LD_PRELOAD", "").split(":") if "/libasan.so" not in p]
        got["LD_PRELOAD"] = ":".join(preload)
        # RDMAV_DRIVERS even for a system install: a driver file names the
        # plugin at its final place, never this staged copy.
        # SYSFS_PATH: the view of this network namespace (shmrdma(1), SYSFS_PATH).
        ns = os.stat("/proc/self/ns/net")
        view = f"{home}/netns/{ns.st_dev}-{ns.st_ino}"
        want = {"SHMRDMA_HOME": home, "SYSFS_PATH": view, "LD_PRELOAD": staged(e["SHMRDMA_SHIM"]),
                "RDMAV_DRIVERS": staged(provider)}
        if got != want:
            fail(f"installed shmrdma env printed {got}, expected {want}")

        if shutil.which("bash"):
            rc, out, err = run(["bash", "-c", f"source {shlex.quote(staged(e['SHMRDMA_COMPLETION']))} && "
                                "complete -p shmrdma"])
            if rc != 0 or "_shmrdma" not in out:
                fail(f"the bash completion does not load: exit {rc}\n{out}{err}")
        print(f"PASS: meson install --destdir: shmrdma.pc answers, {len(checks)} values and the files they name "
              f"checked, the installed command finds its plugin")


def main():
    if len(sys.argv) < 2:
        fail("usage: install_test.py version | man PAGE... | destdir")
    what = sys.argv[1]
    if what == "version":
        check_version()
    elif what == "man":
        check_man(sys.argv[2:])
    elif what == "destdir":
        check_destdir()
    else:
        fail(f"unknown check {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
