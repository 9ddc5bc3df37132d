# SPDX-License-Identifier: AGPL-3.0-only
"""Floors for the `vm` backend's benchmarks: the QEMU a sandbox runs, driven by hand.

A floor takes the command line of a sandbox's QEMU (`/proc/PID/cmdline`), moves its own
files (pid, sockets, console, memory file) into a scratch directory, runs it in a network
namespace of its own with a tap of the name the command line gives, and talks QMP itself
(a few lines here, sharing no code with the edge). The guest is the sandbox's own
(kernel, initramfs, root disk, aether as init); its host end is the same `dsec-aether
vmux` a sandbox has, and "answers" means an exec of `true` came back, as in the benchmarks. What the
floor leaves out is the edge: records, IAM, cgroups, namespaces made on the fly, the
API.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CLONE_NEWNET = 0x40000000


class Qmp:
    """Just enough of QMP."""

    def __init__(self, path: Path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(str(path))
        self.f = self.s.makefile("rb")
        self.read()  # the greeting
        self.call("qmp_capabilities")

    def read(self) -> dict:
        while True:
            line = self.f.readline()
            if not line:
                raise RuntimeError("QEMU closed QMP")
            v = json.loads(line)
            if "event" not in v:
                return v

    def call(self, cmd: str, args: dict | None = None, fd: int | None = None) -> dict:
        line = json.dumps({"execute": cmd, **({"arguments": args} if args else {})}).encode() + b"\n"
        if fd is None:
            self.s.sendall(line)
        else:
            socket.send_fds(self.s, [line], [fd])
        v = self.read()
        if "error" in v:
            raise RuntimeError(f"QMP {cmd}: {v['error']}")
        return v["return"]

    def ignore_shared(self) -> None:
        self.call("migrate-set-capabilities",
                  {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})

    def save(self, dest: Path) -> None:
        """The device state (x-ignore-shared: the memory file is the memory) into `dest`."""
        self.call("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        with open(dest, "wb") as f:
            self.call("getfd", {"fdname": "raw"}, fd=f.fileno())
        self.call("migrate", {"uri": "fd:raw"})
        while True:
            s = self.call("query-migrate").get("status")
            if s == "completed":
                return
            if s in ("failed", "cancelled"):
                raise RuntimeError(f"migration {s}")
            time.sleep(0.001)

    def load(self, src: Path) -> None:
        with open(src, "rb") as f:
            self.call("getfd", {"fdname": "raw"}, fd=f.fileno())
        self.call("migrate-incoming", {"uri": "fd:raw"})
        while self.call("query-status")["status"] == "inmigrate":
            time.sleep(0.002)

    def load_mapped(self, src: Path) -> None:
        """A `mapped-ram` save (the edge's `mapped` capture) whose memory the VM maps
        from the same file: the ROM blocks and the device state are read, no guest page."""
        self.call("migrate-set-capabilities", {"capabilities": [
            {"capability": "mapped-ram", "state": True}, {"capability": "multifd", "state": True}]})
        with open(src, "rb") as f:
            self.call("add-fd", {"fdset-id": 9}, fd=f.fileno())
        self.call("migrate-incoming", {"uri": "file:/dev/fdset/9"})
        while self.call("query-status")["status"] == "inmigrate":
            time.sleep(0.002)

    def wait_connected(self, label: str, within: float = 10) -> None:
        t0 = time.perf_counter()
        while True:
            for c in self.call("query-chardev"):
                if c.get("label") == label and not c.get("filename", "").startswith("disconnected:"):
                    return
            if time.perf_counter() - t0 > within:
                raise RuntimeError(f"nothing connected to chardev {label}")
            time.sleep(0.002)


def qemu_cmdline(pid: int) -> list[str]:
    return [x.decode() for x in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def opt(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def call(sock: Path, req: dict, within: float = 60) -> dict:
    """Sends `req` to aether through the host end listening on `sock` (retrying until it
    is there and answers) and returns its reply. Requests are JSON lines; replies are
    frames (`[kind u8][len u32]`), the last one JSON."""
    line = json.dumps(req).encode() + b"\n"
    t0 = time.perf_counter()
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(max(0.1, within - (time.perf_counter() - t0)))
                s.connect(str(sock))
                s.sendall(line)
                f = s.makefile("rb")
                while True:
                    head = f.read(5)
                    if len(head) < 5:
                        raise ConnectionError("closed")
                    body = f.read(int.from_bytes(head[1:], "big"))
                    if head[:1] == b"J":
                        return json.loads(body)
        except OSError:
            pass
        if time.perf_counter() - t0 > within:
            raise RuntimeError(f"no answer from the guest on {sock} within {within} s")
        time.sleep(0.005)


TRUE = {"op": "exec", "argv": ["true"], "max_output_bytes": 1 << 16}


def first_exec(sock: Path, within: float = 60) -> None:
    """Until an exec of `true` in the guest has answered (what the benchmarks time)."""
    r = call(sock, TRUE, within)
    if r.get("reply") != "exec" or r.get("exit_code") != 0:
        raise RuntimeError(f"exec of true failed: {r}")


def restored(sock: Path) -> None:
    """What a restored guest is told first: the clock, fresh entropy (else copies share
    random numbers) and its id (the qemu-vm-fork recipe's step 6)."""
    call(sock, {"op": "restored", "sandbox_id": "raw", "unix_ms": int(time.time() * 1000),
                "entropy": os.urandom(32).hex()})


class RawVm:
    """One QEMU started from a sandbox's command line in scratch directory `work`.

    `mem` is the memory file and `share` how it is mapped; `incoming` makes it wait for a
    saved state (`-incoming defer`) instead of starting stopped (`-S`)."""

    def __init__(self, cmd: list[str], work: Path, aether: str | None, mem: Path, share: bool,
                 incoming: bool, netns: str):
        self.work = work
        self.mem = mem
        work.mkdir(parents=True, exist_ok=True)
        sdir = str(Path(opt(cmd, "-pidfile")).parent)
        args = [a.replace(sdir, str(work)) for a in cmd]
        out = []
        skip = False
        for i, a in enumerate(args):
            if skip:
                skip = False
                continue
            if a in ("-runas", "-run-with", "-incoming"):
                skip = True
                continue
            if a == "-S":
                continue
            if a.startswith("memory-backend-ram,"):
                # A sandbox's own memory may be anonymous; the recipe needs it in a file.
                a = a.replace("memory-backend-ram,", "memory-backend-file,", 1) + ",mem-path=,share="
            if a.startswith("memory-backend-file,"):
                a = ",".join(
                    f"mem-path={mem}" if o.startswith("mem-path=") else
                    f"share={'on' if share else 'off'}" if o.startswith("share=") else o
                    for o in a.split(","))
            out.append(a)
        out += ["-incoming", "defer"] if incoming else ["-S"]
        self.args = out
        self.qmp_path = Path(opt(out, "-qmp").split(",")[0].removeprefix("unix:"))
        chardevs = [out[i + 1] for i, a in enumerate(out) if a == "-chardev"]
        self.chardev = next(o.split("=", 1)[1] for c in chardevs if "id=ch," in c
                            for o in c.split(",") if o.startswith("path="))
        self.wake = next((o.split("=", 1)[1] for c in chardevs if "id=wake," in c
                          for o in c.split(",") if o.startswith("path=")), None)
        self.sock = work / "aether.sock"
        self.netns = netns
        self.p: subprocess.Popen | None = None
        self.vmux: subprocess.Popen | None = None
        self.q: Qmp | None = None
        self.aether = aether

    def spawn(self) -> None:
        ns_fd = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        libc = ctypes.CDLL(None, use_errno=True)

        def enter_netns() -> None:
            if libc.setns(ns_fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")

        try:
            self.p = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True,
                                      preexec_fn=enter_netns, pass_fds=(ns_fd,))
        finally:
            os.close(ns_fd)

    def connect(self) -> Qmp:
        assert self.p is not None
        while not self.qmp_path.exists():
            if self.p.poll() is not None:
                raise RuntimeError(f"raw QEMU did not start: {self.p.stderr.read().decode()[-2000:]}")
            time.sleep(0.002)
        self.q = Qmp(self.qmp_path)
        return self.q

    def host_end(self) -> None:
        """The channel's host end (as a sandbox's), then the guest may run."""
        assert self.q is not None and self.aether is not None
        cmd = [self.aether, "vmux", str(self.sock), self.chardev] + ([self.wake] if self.wake else [])
        self.vmux = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.q.wait_connected("ch")
        self.q.call("cont")

    def close(self) -> None:
        for p in (self.p, self.vmux):
            if p and p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.work, ignore_errors=True)


class Netns:
    """Network namespaces for raw VMs, each with a tap of the name the command line gives."""

    def __init__(self, cmd: list[str], n: int):
        self.tap = next((o.split("=", 1)[1] for a in cmd for o in a.split(",")
                         if o.startswith("ifname=")), None)
        self.names = [f"dsec-raw-{os.getpid()}-{i}" for i in range(n)]

    def __enter__(self) -> list[str]:
        for ns in self.names:
            subprocess.run(["ip", "netns", "add", ns], check=True)
            if self.tap:
                subprocess.run(["ip", "-n", ns, "tuntap", "add", "dev", self.tap, "mode", "tap",
                                "vnet_hdr"], check=True)
        return self.names

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def scratch(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))


def raw_boot(cmd: list[str], aether: str, ram_dir: Path, netns: str) -> tuple[float, RawVm]:
    """Seconds from starting QEMU to the first exec's answer, booting from the sandbox's kernel,
    initramfs and disk; the VM is returned running (the caller closes it)."""
    work = scratch("dsec-raw-boot-")
    mem = ram_dir / f"raw-{work.name}.ram"
    vm = RawVm(cmd, work, aether, mem, share=True, incoming=False, netns=netns)
    t0 = time.perf_counter()
    try:
        vm.spawn()
        vm.connect()
        vm.host_end()
        first_exec(vm.sock, within=300)
    except BaseException:
        vm.close()
        mem.unlink(missing_ok=True)
        raise
    return time.perf_counter() - t0, vm


def raw_fork(source: RawVm, cmd: list[str], aether: str, netns: list[str]) -> dict:
    """The recipe of a memory-sharing fork, by hand, of the running raw VM `source` into
    len(netns) copies: stop it, save its device state (x-ignore-shared: its memory file is
    the memory), then start every copy at once on that file mapped privately, load the
    state, connect its host end, `cont`, tell each guest it was restored (clock, entropy)
    and run `true` in each. The source is not resumed (a
    resumed source would write into the file the copies map), which is the recipe's
    cheapest form. Returns the stall (stop through the saved state) and the time until
    every copy answered."""
    assert source.q is not None
    mem = source.mem
    dev = source.work / "dev"
    t0 = time.perf_counter()
    source.q.call("stop")
    source.q.ignore_shared()
    source.q.save(dev)
    stall = time.perf_counter() - t0
    copies = [RawVm(cmd, scratch("dsec-raw-copy-"), aether, mem, share=False, incoming=True, netns=ns)
              for ns in netns]
    try:
        for c in copies:
            c.spawn()
        for c in copies:
            c.connect().ignore_shared()
            c.q.load(dev)
            c.host_end()
        for c in copies:
            restored(c.sock)
            first_exec(c.sock)
        answered = time.perf_counter() - t0
    finally:
        for c in copies:
            c.close()
    return {"stall_s": stall, "all_answer_s": answered}
