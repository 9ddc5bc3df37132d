# SPDX-License-Identifier: AGPL-3.0-only
"""Isolation and limits, each checked against the host so that it fails if missing."""

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import DATA, cgroup_file, leftovers, wait_for
from opendsec import DSecRunArgs


async def test_cannot_see_host_processes_or_other_sandboxes_files(client):
    a = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    b = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        # Host processes: our own pid and the server's are not visible; PID 1 is aether.
        r = await a.run_shell("ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/1/cmdline | tr '\\0' ' '")
        count, init = r.stdout.split("\n", 1)
        assert int(count) < 10, r.stdout
        assert init.startswith("/.dsec/aether")
        host_pid = (DATA / "dsec.pid").read_text().strip()
        r = await a.run_shell(f"test -e /proc/{os.getpid()}/cmdline -o -e /proc/{host_pid}/cmdline && echo seen || echo hidden")
        assert r.stdout.strip() == "hidden"
        # Files: what a writes, b cannot find anywhere.
        assert (await a.run_shell("echo secret-a > /root/secret && sync")).exit_code == 0
        r = await b.run_shell("cat /root/secret 2>&1; grep -rs secret-a /root /tmp /var 2>/dev/null | head -1")
        assert "secret-a" not in r.stdout
        assert "No such file" in r.stdout
        # The host cannot see it in its own root either, and the image is unchanged.
        assert not Path("/root/secret").exists()
        r = await a.run_shell("touch /etc/written-in-sandbox && ls /etc/written-in-sandbox")
        assert r.exit_code == 0
        layers = list((DATA / "images/layers").glob("*/etc/written-in-sandbox"))
        assert layers == []
        c = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
        assert (await c.run_shell("ls /etc/written-in-sandbox")).exit_code != 0
        await c.stop()
    finally:
        await a.stop()
        await b.stop()


async def test_privileges_are_reduced(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        r = await sb.run_shell("grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status")
        fields = dict(line.split(":\t") for line in r.stdout.strip().splitlines())
        cap = int(fields["CapEff"], 16)
        assert not cap & (1 << 21), "CAP_SYS_ADMIN kept"
        assert not cap & (1 << 13), "CAP_NET_RAW kept"
        assert not cap & (1 << 19), "CAP_SYS_PTRACE kept"
        assert fields["NoNewPrivs"].strip() == "1"
        assert fields["Seccomp"].strip() == "2"
        # mount, unshare of a user namespace, raw sockets: all refused.
        assert (await sb.run_shell("mount -t tmpfs x /mnt")).exit_code != 0
        r = await sb.exec(["python3", "-c", "import ctypes, os; l = ctypes.CDLL(None, use_errno=True); "
                           "print(l.unshare(0x10000000), os.strerror(ctypes.get_errno()))"])
        assert r.stdout == "-1 Operation not permitted\n", r
        assert (await sb.run_shell("unshare -U true")).exit_code != 0
        r = await sb.exec(["python3", "-c", "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)"])
        assert r.exit_code != 0 and "Operation not permitted" in r.stderr
        # The seccomp profile is an allow list: what it does not name is refused, such as
        # the kernel crypto and vsock socket families, a personality that changes how the
        # kernel treats the process, kcmp, and io_uring.
        probe = ("import ctypes, os, socket\n"
                 "l = ctypes.CDLL(None, use_errno=True)\n"
                 "def err(rc): return 'ok' if rc >= 0 else os.strerror(ctypes.get_errno())\n"
                 "for fam in (38, 40):\n"
                 "    try: socket.socket(fam, socket.SOCK_SEQPACKET); print(fam, 'ok')\n"
                 "    except OSError as e: print(fam, e.strerror)\n"
                 "print('personality', err(l.personality(0x0400000)))\n"
                 "print('kcmp', err(l.syscall(312, 1, 1, 0, 0, 0)))\n"
                 "print('io_uring_setup', err(l.syscall(425, 1, 0)))\n"
                 "print('socket inet', err(l.socket(2, 1, 0)))\n")
        r = await sb.exec(["python3", "-c", probe])
        assert r.stdout.splitlines() == [
            "38 Operation not permitted", "40 Operation not permitted",
            "personality Operation not permitted", "kcmp Operation not permitted",
            "io_uring_setup Operation not permitted", "socket inet ok"], r
        # Masked and read-only kernel files.
        assert (await sb.run_shell("head -c1 /proc/kcore | wc -c")).stdout.strip() == "0"
        assert (await sb.run_shell("echo 1 > /proc/sys/kernel/domainname")).exit_code != 0
        assert (await sb.run_shell("touch /sys/x")).exit_code != 0
    finally:
        await sb.stop()


async def test_sys_is_read_only_and_shows_no_interface_of_the_node_or_other_sandboxes(client):
    """Every sandbox's /sys is a read-only bind of one sysfs seen from a network namespace
    of its own: the node's interfaces (its uplinks, the veths of other sandboxes) are not
    there, and nothing in it can be written or remounted writable."""
    a = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    b = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        node = set(os.listdir("/sys/class/net"))
        assert any(n.startswith("dsv") for n in node), node
        for sb in (a, b):
            r = await sb.run_shell("ls /sys/class/net; ls /sys/devices/virtual/net")
            seen = set(r.stdout.split())
            assert seen <= {"lo"}, r.stdout
            # The rest of sysfs is there: the CPUs (what nproc and os.cpu_count() read).
            r = await sb.exec(["python3", "-c", "import os; print(os.cpu_count())"])
            assert r.stdout.strip() == str(os.cpu_count()), r
            assert (await sb.run_shell("cat /sys/devices/system/cpu/online")).exit_code == 0
        r = await a.run_shell(
            "echo 1 > /sys/kernel/mm/ksm/run; echo rc=$?; "
            "mount -o remount,rw /sys; echo rc=$?; "
            "grep ' /sys ' /proc/self/mountinfo")
        assert r.stdout.count("rc=0") == 0, r.stdout
        line = [l for l in r.stdout.splitlines() if " /sys " in l]
        assert line and " ro," in line[0] + ",", r.stdout
        # One interface of the node, looked up by name, is not there either.
        some = sorted(n for n in node if n.startswith("dsv"))[0]
        r = await a.run_shell(f"test -e /sys/class/net/{some} && echo seen || echo hidden")
        assert r.stdout.strip() == "hidden"
    finally:
        await a.stop()
        await b.stop()


async def test_agent_channel_cannot_be_reached_or_read_from_inside(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        # No socket path inside the sandbox leads to aether.
        r = await sb.run_shell("find / -xdev -type s 2>/dev/null | wc -l")
        assert r.stdout.strip() == "0"
        # Its descriptors and memory are closed to sandbox processes (non-dumpable, no ptrace).
        r = await sb.run_shell("ls -l /proc/1/fd 2>&1; cat /proc/1/environ 2>&1 | head -c 100")
        assert "Permission denied" in r.stdout
        r = await sb.exec(["python3", "-c", "import ctypes; print(ctypes.CDLL(None).ptrace(16, 1, 0, 0))"])
        assert r.stdout.strip() == "-1"
        # Replacing the shell does not break the agent.
        await sb.run_shell("cp /bin/sh /bin/sh.real; echo broken > /bin/bash; echo broken > /bin/dash")
        r = await sb.exec(["/usr/bin/python3", "-c", "print('still here')"])
        assert r.stdout == "still here\n"
    finally:
        await sb.stop()


async def test_memory_limit_kills_and_is_reported(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", memory_limit_mb=64))
    try:
        r = await sb.exec(["python3", "-c", "b = bytearray(200 * 1024 * 1024); print('allocated')"])
        assert r.exit_code == 137 and r.signal == 9
        assert r.oom_killed is True
        assert "allocated" not in r.stdout
        assert (await sb.refresh()).oom_kills >= 1
        # Under the limit works, and the sandbox lives on.
        r = await sb.exec(["python3", "-c", "b = bytearray(16 * 1024 * 1024); print('ok')"])
        assert r.stdout == "ok\n" and r.oom_killed is False
        limit = int(cgroup_file("memory", sb.id, "memory.limit_in_bytes").read_text()) if cgroup_file("memory", sb.id, "memory.limit_in_bytes").exists() else int(cgroup_file("memory", sb.id, "memory.max").read_text())
        assert limit == 64 * 1024 * 1024
    finally:
        await sb.stop()


async def test_fork_bomb_hits_pids_limit_and_host_stays_responsive(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", pids_limit=64))
    try:
        current = cgroup_file("pids", sb.id, "pids.current")
        bomb = asyncio.create_task(sb.exec(["/bin/bash", "-c", "f(){ f | f & }; f; sleep 60"], timeout=4))
        peak = 0
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end and not bomb.done():
            peak = max(peak, int(current.read_text()))
            # The host still runs programs promptly (the test fails on the timeout otherwise).
            subprocess.run(["true"], check=True, timeout=5)
            await asyncio.sleep(0.05)
        r = await bomb
        assert r.timed_out
        assert 50 <= peak <= 64, f"peak {peak} processes"
        # The sandbox recovers once the bomb is killed.
        r = await sb.run_shell("echo alive", timeout=30)
        assert r.stdout == "alive\n"
    finally:
        await sb.stop()


async def _cores_used(sb, seconds: float) -> float:
    usage = cgroup_file("cpuacct", sb.id, "cpuacct.usage")
    read = (lambda: int(usage.read_text())) if usage.exists() else (
        lambda: int(dict(l.split() for l in cgroup_file("cpu", sb.id, "cpu.stat").read_text().splitlines())["usage_usec"]) * 1000)
    code = f"""
import multiprocessing, time
def spin():
    end = time.time() + {seconds}
    while time.time() < end: pass
ps = [multiprocessing.Process(target=spin) for _ in range(2)]
[p.start() for p in ps]; [p.join() for p in ps]
"""
    before, t0 = read(), time.monotonic()
    await sb.exec(["python3", "-c", code], timeout=60)
    return (read() - before) / 1e9 / (time.monotonic() - t0)


@pytest.mark.skipif(os.cpu_count() < 2, reason="needs 2 cores to tell 1 core from 2")
async def test_cpu_limit_holds_busy_loops_to_one_core(client):
    one = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", cpu_cores_limit=1))
    half = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", cpu_cores_limit=0.5))
    try:
        used_one = await _cores_used(one, 3)
        used_half = await _cores_used(half, 3)
        assert 0.6 <= used_one <= 1.15, used_one
        assert 0.25 <= used_half <= 0.6, used_half
    finally:
        await one.stop()
        await half.stop()


async def test_writable_layer_cannot_grow_past_disk_limit(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", disk_limit_mb=64))
    try:
        r = await sb.run_shell("dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; df -m / | tail -1")
        assert "No space left on device" in r.stdout
        size = int(r.stdout.strip().splitlines()[-1].split()[1])
        assert 60 <= size <= 64
        r = await sb.run_shell("rm /root/big && echo small > /root/small && cat /root/small")
        assert r.stdout == "small\n"
    finally:
        await sb.stop()


async def test_stop_kills_what_the_runtime_lost(client):
    """A container whose OCI runtime state is gone (a runtime that crashed, a state
    directory wiped) still dies at stop: the sandbox's cgroup is emptied by the edge, so
    no process of it is left running unowned, also while it is paused."""
    import shutil

    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    await sb.run_shell("sleep 1000 >/dev/null 2>&1 & echo started")
    pids = [int(p) for p in cgroup_file("pids", sb.id, "cgroup.procs").read_text().split()]
    assert len(pids) >= 2
    await sb.pause()
    # The runtime's own state directory for the container (`<state>/runtime/<runtime>/`).
    states = list((DATA / "edge/runtime").glob(f"*/dsec-{sb.id}"))
    assert states, f"no runtime state for {sb.id} under {DATA / 'edge/runtime'}"
    for d in states:
        shutil.rmtree(d)
    await sb.stop()
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 15), \
        f"processes of {sb.id} outlived its stop: {[p for p in pids if Path(f'/proc/{p}').exists()]}"
    assert leftovers(sb.id) == []


async def test_stop_removes_everything(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    await sb.run_shell("sleep 1000 >/dev/null 2>&1 & echo started")
    assert leftovers(sb.id), "a running sandbox should have mounts, cgroups and a directory"
    procs = cgroup_file("pids", sb.id, "cgroup.procs")
    pids = [int(p) for p in procs.read_text().split()]
    assert len(pids) >= 2
    await sb.stop()
    assert leftovers(sb.id) == []
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 5)


def _procs_of(sandbox_id: str) -> list[int]:
    return [int(p) for p in cgroup_file("pids", sandbox_id, "cgroup.procs").read_text().split()]


def _threads(pid: int) -> list[str]:
    out = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.append((t / "comm").read_text().strip())
        except OSError:
            pass
    return out


async def test_orphans_are_reaped_and_the_reaper_runs_only_while_there_are_children(client):
    """The agent is PID 1: orphans re-parented to it are reaped (no zombie stays), by a
    thread that exists only while it has children (an idle sandbox costs the node one
    thread fewer)."""
    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    agent = next(p for p in _procs_of(sb.id)
                 if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"/.dsec/aether"))
    # The accept loop and the node's kept connection: no thread waits for children.
    assert len(_threads(agent)) <= 2 and "reaper" not in _threads(agent), _threads(agent)
    # An orphan that lives on: its parent shell exits at once.
    await sb.run_shell("(sleep 3 >/dev/null 2>&1 &); echo started")
    assert "reaper" in _threads(agent), _threads(agent)
    await sb.run_shell("for i in 1 2 3 4 5; do (sleep 0.1 &); done; echo started")

    def zombies() -> list[int]:
        z = []
        for p in _procs_of(sb.id):
            try:
                if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    z.append(p)
            except OSError:
                pass
        return z

    time.sleep(1)
    assert wait_for(lambda: not zombies(), 5), f"zombies left: {zombies()}"
    # Once the last child is gone, so is the reaper; the next command brings it back.
    assert wait_for(lambda: "reaper" not in _threads(agent) and len(_threads(agent)) <= 2, 10), \
        _threads(agent)
    assert (await sb.run_shell("echo back")).stdout.strip() == "back"
    assert not zombies()
    await sb.stop()
