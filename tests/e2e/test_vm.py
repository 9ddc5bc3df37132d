# SPDX-License-Identifier: AGPL-3.0-only
"""The `vm` backend: a QEMU microvm per sandbox (TCG on hosts without hardware
virtualisation), booted from the guest kernel and root disk the image store builds, with
aether as the guest's init reached over virtio-serial. Skipped where QEMU is missing.
What every backend does (exec, files, pause, snapshot, fork, commit, restarts...) is in
test_backends.py; here what is the vm backend's own."""

import contextlib
import os
import pwd
import shutil
import time
from pathlib import Path

import pytest

from conftest import cgroup_file, cgroup_mode, wait_for
from opendsec import DSecClient, DSecRunArgs


def qemu_processes(sandbox_id: str) -> list[int]:
    pids = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = p.read_bytes()
        except OSError:
            continue
        if (b"qemu-system" in cmd or b"vmux" in cmd) and sandbox_id.encode() in cmd:
            pids.append(int(p.parent.name))
    return pids


@pytest.fixture
def need_qemu():
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("skipped: qemu-system-x86_64 is not installed")


async def test_vm_sandbox_runs_the_seed_example_in_its_own_kernel(client, need_qemu):
    st = await client.status()
    vm = [b for b in st["nodes"][0]["backends"] if b["name"] == "vm"][0]
    assert vm["available"], vm
    print(f"\nvm backend: {vm['detail']}", flush=True)
    t0 = time.monotonic()
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=512))
    boot = time.monotonic() - t0
    try:
        assert sb.info.backend == "vm"
        r = await sb.run_shell("python3 -c 'print(6*7)'")
        assert r.stdout == "42\n", r
        print(f"created and answering in {boot:.1f} s; python3 -c 'print(6*7)' -> {r.stdout.strip()}", flush=True)
        # Its own kernel: the guest kernel, not the host's.
        guest = (await sb.exec(["uname", "-r"])).stdout.strip()
        assert guest.endswith("-cloud-amd64"), guest
        boot_id = (await sb.exec(["cat", "/proc/sys/kernel/random/boot_id"])).stdout.strip()
        assert boot_id and boot_id != Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        # The runtime API works over the VM channel: files, streamed output, exit codes.
        await sb.files.write("/root/note.txt", b"in the vm\n")
        assert await sb.files.read("/root/note.txt") == b"in the vm\n"
        r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
        # The root is the image's disk under a writable overlay.
        mounts = (await sb.exec(["cat", "/proc/mounts"])).stdout
        assert " / overlay " in mounts, mounts
        assert qemu_processes(sb.id), "no QEMU process for the sandbox"
        # QEMU runs as `nobody` under its own seccomp filter, not as root: an escape from
        # the emulator lands there.
        for pid in qemu_processes(sb.id):
            if b"qemu-system" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            status = dict(l.split(":", 1) for l in Path(f"/proc/{pid}/status").read_text().splitlines())
            uids = status["Uid"].split()
            assert uids[0] == uids[1] == str(pwd.getpwnam("nobody").pw_uid), status["Uid"]
            assert status["Seccomp"].strip() == "2", status["Seccomp"]
    finally:
        await sb.stop()
    assert wait_for(lambda: not qemu_processes(sb.id), timeout=10), "QEMU or vmux outlived the sandbox"


# A Python process that holds a random value in memory and answers over a FIFO: "get N"
# writes "N value" to /tmp/out, "set N V" changes the value first. Nothing but the
# process's memory holds the value.
HOLDER = r"""
import os, random
value = random.getrandbits(62)
os.mkfifo("/tmp/cmd")
while True:
    with open("/tmp/cmd") as f:
        for line in f:
            parts = line.split()
            if parts[0] == "set":
                value = int(parts[2])
            with open("/tmp/out.tmp", "w") as o:
                o.write(f"{parts[1]} {value}\n")
            os.rename("/tmp/out.tmp", "/tmp/out")
"""


async def start_holder(sb) -> int:
    """Starts HOLDER in `sb` and returns the value it holds."""
    await sb.files.write("/tmp/holder.py", HOLDER.encode())
    await sb.exec_background(["python3", "/tmp/holder.py"])
    assert await wait_for_file(sb, "/tmp/cmd")
    return await ask(sb, "get 1", 1)


async def ask(sb, cmd: str, nonce: int) -> int:
    """Sends `cmd nonce ...` to the holder and returns the value it answers with."""
    script = (
        f'echo "{cmd}" > /tmp/cmd; '
        f'for i in $(seq 400); do grep -q "^{nonce} " /tmp/out 2>/dev/null && break; sleep 0.05; done; cat /tmp/out'
    )
    r = await sb.exec(["sh", "-c", script], timeout=60)
    nonce_seen, value = r.stdout.split()
    assert int(nonce_seen) == nonce, r
    return int(value)


def smaps_rollup_kib(pids) -> dict[str, int]:
    """The smaps_rollup counters (kB) of processes `pids`, summed: `Pss` (their share of
    every page they map), `Shared_Clean` + `Shared_Dirty` (pages others map too), …"""
    out: dict[str, int] = {}
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            k, v = line.split(":", 1)
            out[k] = out.get(k, 0) + int(v.split()[0])
    return out


def qemu_pss_kib(sandbox_id: str) -> int:
    """PSS of the sandbox's QEMU process (its share of every page it maps)."""
    qemu = [p for p in qemu_processes(sandbox_id)
            if b"qemu-system" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return smaps_rollup_kib(qemu).get("Pss", 0)


# A process rewriting 1,024 pages of its memory without end: round v writes every page,
# in order, with v's byte (v odd) or zeros (v even), and first checks that the page still
# holds round v-1. A page that holds anything else (in a fork copy: a page of the memory
# from another instant) is counted in /tmp/churn.bad; /tmp/churn.round is the round.
CHURN = r"""
import os
N, P = 1024, 4096
buf = bytearray(N * P)
def fill(v):
    return bytes([v % 251 + 1]) * P if v % 2 else bytes(P)
v, bad = 1, 0
while True:
    page, old = fill(v), fill(v - 1)
    for k in range(N):
        if buf[k * P:(k + 1) * P] != old:
            bad += 1
            with open("/tmp/churn.bad", "w") as f:
                f.write(f"{bad} pages wrong, the last page {k} in round {v}\n")
        buf[k * P:(k + 1) * P] = page
    v += 1
    with open("/tmp/churn.part", "w") as f:
        f.write(str(v))
    os.rename("/tmp/churn.part", "/tmp/churn.round")
"""


async def churn_round(sb) -> int:
    r = await sb.exec(["cat", "/tmp/churn.round"])
    assert r.exit_code == 0, r
    return int(r.stdout)


async def churned_on(sb, rounds: int = 3) -> int:
    """Waits until the churning process of `sb` has done `rounds` more rounds (each
    checks every page); its round then, after asserting no page was wrong."""
    import asyncio

    start = await churn_round(sb)
    end = time.monotonic() + 60
    while (now := await churn_round(sb)) < start + rounds:
        assert time.monotonic() < end, f"{sb.id}: the churn stopped at round {now}"
        await asyncio.sleep(0.2)
    r = await sb.exec(["cat", "/tmp/churn.bad"])
    assert r.exit_code != 0, f"{sb.id}: {r.stdout.strip()}"
    return now


async def test_vm_fork_of_memory_being_rewritten_is_consistent(client, need_qemu):
    """A fork taken while the guest rewrites its memory (pages going from data to zeros
    and back while the capture runs) gives copies a memory from one instant: no page of
    an earlier round where a later one is due (what a save that left a page's old bytes in
    place would show)."""
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=512))
    copies = []
    try:
        await sb.files.write("/tmp/churn.py", CHURN)
        await sb.exec_background(["python3", "/tmp/churn.py"])
        assert await wait_for_file(sb, "/tmp/churn.round")
        first = await churned_on(sb)
        for _ in range(3):
            copies += await sb.fork(count=2)
            print(f"\nfork while rewriting: source stood still {sb.last_fork['source_paused_ms']} ms", flush=True)
        rounds = [await churned_on(c) for c in copies]
        last = await churned_on(sb)
        print(f"rounds: source {first} -> {last}, copies {rounds}", flush=True)
    finally:
        for c in copies:
            await c.stop()
        await sb.stop()


def wait_for_file(sb, path: str, timeout: float = 60.0) -> bool:
    import asyncio

    async def loop():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if await sb.files.exists(path):
                return True
            await asyncio.sleep(0.2)
        return False

    return loop()


async def test_vm_fork_copies_share_memory(client, need_qemu):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=512))
    copies = []
    try:
        # Something worth sharing: a Python process holding 128 MiB.
        await sb.exec_background(["python3", "-c", "import time; b = bytearray(range(256)) * (512 * 1024); time.sleep(100000)"])
        await asyncio_sleep(8)
        source = qemu_pss_kib(sb.id)
        copies = await sb.fork(count=8)
        await asyncio_sleep(3)
        per_copy = [qemu_pss_kib(c.id) for c in copies]
        total = sum(per_copy)
        print(f"\n8 copies of a 512 MiB guest (TCG): source PSS {source / 1024:.0f} MiB, copies "
              f"{total / 1024:.0f} MiB in all ({total / 8 / 1024:.0f} MiB each), "
              f"{total / (8 * source):.2f} of 8 x the source's", flush=True)
        assert all(p > 0 for p in per_copy), per_copy
        assert total < 0.5 * 8 * source, (source, per_copy)
        for c in copies:
            r = await c.exec(["echo", "alive"])
            assert r.stdout == "alive\n"
    finally:
        for c in copies:
            await c.stop()
        await sb.stop()


async def asyncio_sleep(s: float):
    import asyncio
    await asyncio.sleep(s)


def _cpu_seconds(sandbox_id: str) -> float:
    if cgroup_mode() == "v2":
        stat = cgroup_file("cpu", sandbox_id, "cpu.stat").read_text()
        return int(stat.split("usage_usec")[1].split()[0]) / 1e6
    return int(cgroup_file("cpuacct", sandbox_id, "cpuacct.usage").read_text()) / 1e9


async def test_vm_limits_hold_for_qemu(client, need_qemu):
    """QEMU runs in the sandbox's cgroup: a guest spinning on its one vCPU gets half a host
    core with cpu_cores_limit=0.5, and the memory limit is the guest's plus QEMU's own."""
    sb = await client.run_sandbox(DSecRunArgs(image="root/base", backend="vm", memory_limit_mb=256,
                                              cpu_cores_limit=0.5))
    try:
        qemu = [p for p in qemu_processes(sb.id) if b"qemu-system" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert qemu, "no QEMU process"
        mem_file = "memory.max" if cgroup_mode() == "v2" else "memory.limit_in_bytes"
        procs = cgroup_file("memory", sb.id, "cgroup.procs").read_text().split()
        assert str(qemu[0]) in procs, (qemu, procs)
        limit = int(cgroup_file("memory", sb.id, mem_file).read_text())
        # The guest gets memory_limit_mb plus a quarter of disk_limit_mb (its writable layer is
        # a tmpfs in it); QEMU some hundreds of MiB.
        assert (256 << 20) < limit <= (1024 << 20), limit
        await sb.exec_background(cmd="while :; do :; done")
        await asyncio_sleep(1)
        t0, c0 = time.monotonic(), _cpu_seconds(sb.id)
        await asyncio_sleep(3)
        used = (_cpu_seconds(sb.id) - c0) / (time.monotonic() - t0)
        print(f"\nvm with cpu_cores_limit=0.5, guest spinning: QEMU used {used:.2f} cores", flush=True)
        assert 0.2 < used < 0.65, used
    finally:
        await sb.stop()
    assert wait_for(lambda: not cgroup_file("memory", sb.id, "cgroup.procs").parent.exists(), timeout=10), \
        "the VM's cgroup outlived it"


@contextlib.asynccontextmanager
async def own_server(name: str, listen: str, vm_config: str):
    """A second server of the test's own (no network: one per namespace), with
    `vm_config` under [edge.vm], so the session's keeps its defaults; yields a client."""
    import json
    import subprocess

    from conftest import DATA, DSEC

    data = Path(f"/var/tmp/dsec-test-{name}")
    data.mkdir(parents=True, exist_ok=True)
    (data / "config.toml").write_text(
        f'[edge]\nname = "{name}"\n[edge.network]\nenabled = false\n[edge.vm]\n{vm_config}\n')
    env = dict(os.environ, DSEC_CONFIG=str(data / "client.toml"))
    up = [DSEC, "up", "--data-dir", str(data), "--listen", listen, "--image-store", str(DATA / "images")]
    subprocess.run([DSEC, "down", "--data-dir", str(data)], capture_output=True, env=env)
    subprocess.run(up, check=True, capture_output=True, env=env, timeout=120)
    try:
        cfg = dict(l.split(" = ", 1) for l in (data / "client.toml").read_text().splitlines() if " = " in l)
        async with DSecClient(api_url=json.loads(cfg["api_url"]), api_key=json.loads(cfg["api_key"])) as c:
            c.data_dir = data
            yield c
    finally:
        subprocess.run([DSEC, "down", "--data-dir", str(data)], capture_output=True, env=env, timeout=180)
        shutil.rmtree(data, ignore_errors=True)


async def test_vm_on_a_full_pc_machine(need_qemu):
    """[edge.vm] machine = "q35": the same guest on a full PC (PCI Express virtio devices,
    ACPI, firmware) answers, and forks with its memory. A second server of its own, so the
    session's keeps its microvm default."""
    async with own_server("pcvm", "127.0.0.1:7621", 'machine = "q35"') as c:
        st = await c.status()
        vm = next(b for n in (st.get("nodes") or [st]) for b in n["backends"] if b["name"] == "vm")
        assert vm["available"] and "q35" in vm["detail"], vm
        sb = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=256))
        try:
            qemu = [p for p in qemu_processes(sb.id) if b"qemu-system" in Path(f"/proc/{p}/cmdline").read_bytes()]
            cmd = Path(f"/proc/{qemu[0]}/cmdline").read_bytes()
            assert b"q35," in cmd and b"virtio-serial-pci" in cmd, cmd
            r = await sb.exec(["sh", "-c", "ls /sys/bus/pci/devices | wc -l; python3 -c 'print(6*7)'"])
            pci, answer = r.stdout.split()
            assert int(pci) > 1 and answer == "42", r
            value = await start_holder(sb)
            [copy] = await sb.fork(count=1)
            assert await ask(copy, "get 2", 2) == value
            print(f"\nq35 machine (TCG): {pci} PCI devices in the guest; fork kept the memory", flush=True)
            await copy.stop()
        finally:
            await sb.stop()


async def test_vm_fork_captured_live_keeps_memory(need_qemu):
    """[edge.vm] fork_capture = "live": the source's memory goes to the copies by a live
    migration into a template QEMU (the source runs on meanwhile); the copies still hold
    the source's process and value, and the source goes on with its own. A second server
    of its own (no network: one per namespace), as for the q35 machine."""
    copies = []
    async with own_server("livefork", "127.0.0.1:7622", 'fork_capture = "live"') as c:
        data = c.data_dir
        sb = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=256))
        try:
            value = await start_holder(sb)
            copies = await sb.fork(count=2)
            assert sb.last_fork["memory_preserved"] is True
            for i, cp in enumerate(copies):
                assert await ask(cp, f"get {10 + i}", 10 + i) == value, cp.id
            assert await ask(copies[0], "set 20 4242", 20) == 4242
            assert await ask(sb, "get 21", 21) == value
            assert await ask(copies[1], "get 22", 22) == value
            log = (data / "dsec.log").read_text()
            assert "captured live" in log and "live capture failed" not in log, log[-3000:]
            # The template QEMU is gone, and its directory with it.
            assert not (data / "edge/sandboxes" / sb.id / "fork-template").exists()
            print(f"\nlive capture (TCG): source stood still {sb.last_fork['source_paused_ms']} ms", flush=True)
        finally:
            for cp in copies:
                await cp.stop()
            await sb.stop()
