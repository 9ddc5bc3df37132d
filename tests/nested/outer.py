# SPDX-License-Identifier: AGPL-3.0-only
"""The nested-KVM harness: an outer QEMU VM under TCG with `-cpu max`, in which `kvm_amd`
loads (QEMU emulates AMD SVM with nested paging) and Firecracker and `qemu -accel kvm` run
on real KVM, one level down.

The outer VM needs no root disk of its own. It boots Debian's cloud kernel (the package the
`vm` backend's guest kernel comes from) with a small initramfs that mounts the host's root
directory read-only over virtiofs and puts a tmpfs overlay on top, so the guest sees this
checkout, its build, Firecracker, Python and every Debian package at the host's paths, and
whatever it writes stays in its own memory. Its stage-2 init (`guest_init.sh`) mounts the
kernel filesystems, loads KVM, brings up QEMU's user network and runs one command given
through a second, writable virtiofs share (`/nested-io`), which also carries the command's
exit status and any files it leaves for the host. The VM powers off when the command ends;
nothing of it outlives `run()`.

    python3 tests/nested/outer.py [--mem MiB] [--timeout S] [--out DIR] -- COMMAND...

runs COMMAND inside (in the checkout's directory) and exits with its status.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DATA = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test"))
# Kept between runs: the kernel package, unpacked, and the initramfs built from it.
CACHE = Path(os.environ.get("DSEC_NESTED_CACHE", "/var/tmp/dsec-nested-cache"))
# QEMU 7.2's (in its qemu-system-common), Debian 13's own package, or where
# deploy/deps.sh puts 7.2's beside QEMU 10.
VIRTIOFSD = next((p for p in ("/usr/lib/qemu/virtiofsd", "/usr/libexec/virtiofsd",
                              "/usr/local/libexec/virtiofsd") if Path(p).exists()),
                 "/usr/local/libexec/virtiofsd")
BUSYBOX = "/bin/busybox"
# Modules the initramfs loads (with what they depend on) to mount the host's root.
INITRAMFS_MODULES = ["virtio_pci", "virtiofs", "overlay"]
IO_TAG = "nestedio"
ROOT_TAG = "hostroot"
RC_FILE = "rc"
CMD_FILE = "cmd.sh"


class HarnessError(Exception):
    pass


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise HarnessError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r


def guest_kernel_package() -> tuple[str, str, str]:
    """(release, package, version) of the guest kernel the image store caches, or of the
    candidate of Debian's linux-image-cloud-amd64 when none is cached yet."""
    kernels = sorted((DATA / "images/guest").glob("kernel-*/kernel.json"))
    if kernels:
        k = json.loads(kernels[-1].read_text())
        return k["version"], k["package"], k["package_version"]
    dep = _run(["apt-cache", "depends", "linux-image-cloud-amd64"]).stdout
    pkg = next(l.split(":", 1)[1].strip() for l in dep.splitlines() if "Depends:" in l
               and "linux-image-" in l)
    pol = _run(["apt-cache", "policy", pkg]).stdout
    ver = next(l.split(":", 1)[1].strip() for l in pol.splitlines() if "Candidate:" in l)
    return pkg.removeprefix("linux-image-"), pkg, ver


def ensure_kernel() -> Path:
    """The kernel package unpacked under the cache, with `modules.dep` made by depmod:
    returns the directory holding `boot/` and `lib/modules/<release>/`."""
    release, pkg, ver = guest_kernel_package()
    out = CACHE / f"kernel-{release}"
    if (out / "lib/modules" / release / "modules.dep").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as t:
        _run(["apt-get", "download", f"{pkg}={ver}"], cwd=t)
        deb = next(Path(t).glob("*.deb"))
        unpacked = Path(t) / "k"
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
        _run(["depmod", "-b", str(unpacked), release])
        shutil.rmtree(out, ignore_errors=True)
        unpacked.rename(out)
    return out


def release_of(kdir: Path) -> str:
    return next((kdir / "lib/modules").iterdir()).name


def module_order(kdir: Path, names: list[str]) -> list[Path]:
    """The modules `names` need, dependencies first (from modules.dep)."""
    moddir = kdir / "lib/modules" / release_of(kdir)
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    by_name = {Path(p).name.split(".ko")[0].replace("-", "_"): p for p in deps}
    builtin = {Path(l).name.split(".ko")[0].replace("-", "_")
               for l in (moddir / "modules.builtin").read_text().split()}
    order: list[str] = []

    def visit(p: str) -> None:
        if p in order:
            return
        for d in reversed(deps[p]):
            visit(d)
        order.append(p)

    for n in names:
        key = n.replace("-", "_")
        if key in builtin:
            continue
        if key not in by_name:
            raise HarnessError(f"the guest kernel has no module {n}")
        visit(by_name[key])
    return [moddir / p for p in order]


class Cpio:
    """A newc archive, written in memory."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
        self.ino += 1
        self.buf += b"070701" + b"".join(b"%08X" % f for f in fields)
        self.buf += name.encode() + b"\0"
        self.buf += b"\0" * (-len(self.buf) % 4)
        self.buf += data
        self.buf += b"\0" * (-len(self.buf) % 4)

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return bytes(self.buf)


INIT = r"""#!/bin/busybox sh
# Stage 1 of the outer VM: the host's root (read-only, over virtiofs) under a tmpfs overlay.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "nested-init: $*"; echo o > /proc/sysrq-trigger; sleep 5; }
for m in /lib/modules/*.ko; do insmod "$m" || fail "insmod $m failed"; done
mkdir -p /lower /rw /newroot
i=0
until mount -t virtiofs -o ro @ROOT_TAG@ /lower; do
    i=$((i + 1)); [ $i -gt 50 ] && fail "cannot mount the host's root"; sleep 0.1
done
mount -t tmpfs -o mode=0755 nested-rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work nested-root /newroot \
    || fail "cannot mount the overlay root"
stage2=$(sed -n 's/.*nested.init=\([^ ]*\).*/\1/p' /proc/cmdline)
umount /proc /sys /dev
exec switch_root /newroot /bin/bash "$stage2"
"""


def ensure_initramfs(kdir: Path) -> Path:
    mods = module_order(kdir, INITRAMFS_MODULES)
    script = INIT.replace("@ROOT_TAG@", ROOT_TAG)
    bb = Path(BUSYBOX).read_bytes()
    h = hashlib.sha256(script.encode() + bb)
    for m in mods:
        h.update(m.read_bytes())
    key = h.hexdigest()
    out = kdir / "nested-initramfs.cpio.gz"
    stamp = kdir / "nested-initramfs.key"
    if out.exists() and stamp.exists() and stamp.read_text() == key:
        return out
    c = Cpio()
    for d in ["bin", "dev", "proc", "sys", "lib", "lib/modules"]:
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.file("bin/busybox", bb, 0o755)
    c.symlink("bin/sh", "busybox")
    for i, m in enumerate(mods):
        c.file(f"lib/modules/{i:02d}-{m.name}", m.read_bytes())
    c.file("init", script.encode(), 0o755)
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(c.finish(), 1))
    tmp.rename(out)
    stamp.write_text(key)
    return out


def check_host_tools() -> None:
    if not shutil.which("qemu-system-x86_64"):
        raise HarnessError("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
    if not Path(VIRTIOFSD).exists():
        raise HarnessError(f"{VIRTIOFSD} is missing (bash deploy/deps.sh fetches it)")


class OuterVm:
    """One outer VM that runs `command` (a shell string) and powers off."""

    def __init__(self, command: str, *, mem_mb: int = 6144, cpus: int = 2,
                 timeout: float = 1800, env: dict[str, str] | None = None,
                 shares: list[tuple[Path, str]] | None = None, log=sys.stdout) -> None:
        self.command = command
        self.mem_mb = mem_mb
        self.cpus = cpus
        self.timeout = timeout
        self.env = env or {}
        # Host directories mounted read-write at a guest path (e.g. the image store: its
        # layers hold overlay whiteouts, which the guest's overlay root would hide).
        self.shares = shares or []
        self.log = log
        self.work = Path(tempfile.mkdtemp(prefix="dsec-nested-"))
        self.io = self.work / "io"
        self.io.mkdir()
        self.procs: list[subprocess.Popen] = []

    def _virtiofsd(self, tag: str, source: Path) -> Path:
        sock = self.work / f"{tag}.sock"
        p = subprocess.Popen(
            [VIRTIOFSD, f"--socket-path={sock}", "-o", f"source={source}", "-o", "cache=always",
             "-o", "sandbox=chroot", "-o", "log_level=err", "--thread-pool-size=4"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.work / f"{tag}.log", "wb"), start_new_session=True)
        self.procs.append(p)
        for _ in range(200):
            if sock.exists():
                return sock
            if p.poll() is not None:
                raise HarnessError(f"virtiofsd for {source} exited: "
                                   f"{(self.work / f'{tag}.log').read_text()[-1000:]}")
            time.sleep(0.02)
        raise HarnessError(f"virtiofsd for {source} did not create its socket")

    def run(self) -> int:
        check_host_tools()
        kdir = ensure_kernel()
        initrd = ensure_initramfs(kdir)
        release = release_of(kdir)
        # DSEC_NESTED tells benches their KVM figures are nested under TCG.
        lines = ["set -e", "export NESTED_OUT=/nested-io/out DSEC_NESTED=tcg", "mkdir -p $NESTED_OUT"]
        # The host's PATH: the guest runs the host's tools (pyenv's Python, cargo's builds).
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), **self.env}
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        for i, (_, guest) in enumerate(self.shares):
            g = shlex.quote(guest)
            lines += [f"mkdir -p {g}", f"mount -t virtiofs share{i} {g}"]
        lines += [f"cd {shlex.quote(str(ROOT))}", self.command]
        (self.io / CMD_FILE).write_text("\n".join(lines) + "\n")
        root_sock = self._virtiofsd(ROOT_TAG, Path("/"))
        io_sock = self._virtiofsd(IO_TAG, self.io)
        extra: list[str] = []
        for i, (host, _) in enumerate(self.shares):
            sock = self._virtiofsd(f"share{i}", host)
            extra += ["-chardev", f"socket,id=fsshare{i},path={sock}",
                      "-device", f"vhost-user-fs-pci,chardev=fsshare{i},tag=share{i}"]
        cmdline = (f"console=ttyS0 quiet loglevel=3 panic=-1 nested.init={HERE / 'guest_init.sh'}"
                   f" nested.io={IO_TAG} nested.modules={kdir / 'lib/modules' / release}")
        argv = [
            "qemu-system-x86_64", "-machine", "q35,accel=tcg", "-cpu", "max",
            "-smp", str(self.cpus), "-m", str(self.mem_mb),
            "-object", f"memory-backend-memfd,id=mem,size={self.mem_mb}M,share=on",
            "-numa", "node,memdev=mem",
            "-kernel", str(kdir / "boot" / f"vmlinuz-{release}"), "-initrd", str(initrd),
            "-append", cmdline,
            "-chardev", f"socket,id=fsroot,path={root_sock}",
            "-device", f"vhost-user-fs-pci,chardev=fsroot,tag={ROOT_TAG}",
            "-chardev", f"socket,id=fsio,path={io_sock}",
            "-device", f"vhost-user-fs-pci,chardev=fsio,tag={IO_TAG}",
            *extra,
            "-netdev", "user,id=n0", "-device", "virtio-net-pci,netdev=n0",
            "-device", "virtio-rng-pci",
            "-display", "none", "-serial", "stdio", "-monitor", "none", "-no-reboot",
        ]
        q = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(q)

        def pump() -> None:
            assert q.stdout is not None
            for raw in iter(q.stdout.readline, b""):
                self.log.write(raw.decode(errors="replace").replace("\r", ""))
                self.log.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        try:
            q.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.log.write(f"\nnested: the outer VM ran past {self.timeout:.0f} s; killed\n")
            return 124
        t.join(timeout=5)
        rc = self.io / RC_FILE
        if not rc.exists():
            raise HarnessError("the outer VM stopped without its command's exit status "
                               "(see the console output above)")
        return int(rc.read_text().strip() or "1")

    def collect(self, dest: Path) -> None:
        """Copies what the command left under /nested-io/out to `dest`."""
        src = self.io / "out"
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> "OuterVm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Run a command inside the nested-KVM outer VM (QEMU TCG, -cpu max).",
        epilog="example: python3 tests/nested/outer.py -- python3 -m pytest -q tests/e2e/test_microvm.py")
    ap.add_argument("--mem", type=int, default=6144, help="outer VM memory in MiB (default 6144)")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before the VM is killed")
    ap.add_argument("--out", type=Path, help="copy what the command writes to $NESTED_OUT here")
    ap.add_argument("--share", action="append", default=[], metavar="HOST:GUEST",
                    help="mount host directory HOST read-write at GUEST in the outer VM")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command given")
    if os.geteuid() != 0:
        ap.error("the harness runs virtiofsd on the host's root and needs root")
    # Killed (a timeout, ^C): the VM and virtiofsd go too, via OuterVm.close.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    passthrough = {k: v for k, v in os.environ.items()
                   if k.startswith(("DSEC_", "BENCH_", "PYTEST_"))}
    with OuterVm(shlex.join(cmd), mem_mb=a.mem, cpus=a.cpus, timeout=a.timeout,
                 env=passthrough,
                 shares=[(Path(h), g) for h, _, g in (x.partition(":") for x in a.share)]) as vm:
        t0 = time.monotonic()
        try:
            rc = vm.run()
        except HarnessError as e:
            print(f"nested: {e}", file=sys.stderr)
            return 2
        if a.out:
            vm.collect(a.out)
        print(f"nested: the command exited {rc} after {time.monotonic() - t0:.0f} s "
              "(outer VM boot included)", file=sys.stderr)
        return rc


if __name__ == "__main__":
    sys.exit(main())
