# SPDX-License-Identifier: AGPL-3.0-only
"""The `microvm` backend: a Firecracker VMM per sandbox, booted from the same guest kernel
(as vmlinux), initramfs and root disk as the `vm` backend, with aether reached over vsock.
It needs hardware KVM and a Firecracker v1.16 binary; where the server reports the backend
unavailable, each test is skipped with the server's reason. What every backend does is in
test_backends.py (its microvm cases: `-k microvm`); here what is the microvm backend's own."""

import os
import pwd
import time
from pathlib import Path

import pytest

from conftest import DATA, cgroup_file, cgroup_mode, leftovers, server_down, server_up, wait_for
from opendsec import DSecClient, DSecRunArgs
from test_vm import ask, smaps_rollup_kib, start_holder


def vmm_processes(sandbox_id: str) -> list[int]:
    """Firecracker and vsockproxy processes of one sandbox."""
    pids = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = p.read_bytes()
        except OSError:
            continue
        if (b"firecracker" in cmd or b"vsockproxy" in cmd) and sandbox_id.encode() in cmd:
            pids.append(int(p.parent.name))
    return pids


@pytest.fixture
async def need_microvm(client):
    st = await client.status()
    b = [x for x in st["nodes"][0]["backends"] if x["name"] == "microvm"][0]
    if not b["available"]:
        pytest.skip(f"skipped: no hardware KVM or Firecracker on this host: {b['detail']}")
    print(f"\nmicrovm backend: {b['detail']}", flush=True)


async def test_microvm_runs_the_seed_example_and_forks_with_memory(client, need_microvm):
    t0 = time.monotonic()
    sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
            cpu_cores_limit=1, memory_limit_mb=1024, network_rules={"pypi": True}))
    boot = time.monotonic() - t0
    copies = []
    try:
        assert sb.info.backend == "microvm"
        r = await sb.run_shell("python3 -c 'print(6*7)'")
        assert r.stdout == "42\n", r
        print(f"created and answering in {boot:.2f} s", flush=True)
        guest = (await sb.exec(["uname", "-r"])).stdout.strip()
        assert guest.endswith("-cloud-amd64"), guest
        assert vmm_processes(sb.id), "no Firecracker process for the sandbox"
        # The VMM runs jailed as `nobody` under Firecracker's own seccomp policy (the musl
        # build's; a glibc build's filter allows everything).
        for pid in vmm_processes(sb.id):
            exe = Path(f"/proc/{pid}/exe").resolve()
            if "firecracker" not in exe.name:
                continue
            status = dict(l.split(":", 1) for l in Path(f"/proc/{pid}/status").read_text().splitlines())
            uids = status["Uid"].split()
            assert uids[0] == uids[1] == str(pwd.getpwnam("nobody").pw_uid), status["Uid"]
            assert status["Seccomp"].strip() == "2", status["Seccomp"]
            assert status["NoNewPrivs"].strip() == "1", status["NoNewPrivs"]
            assert Path(f"/proc/{pid}/root").resolve() != Path("/"), "the VMM is not chrooted"
            elf = Path(f"/proc/{pid}/exe").read_bytes()[:4096]
            assert b"/lib64/ld-linux" not in elf, f"{exe} is the glibc build, without a seccomp policy"

        # A process holding a value only in its memory: the copies must have it.
        value = await start_holder(sb)
        t0 = time.monotonic()
        copies = await sb.fork(count=4)
        took = time.monotonic() - t0
        fork = sb.last_fork
        print(f"fork of 4: {took:.2f} s, source paused {fork['source_paused_ms']} ms", flush=True)
        assert fork["memory_preserved"] is True
        # The snapshot the source's VMM wrote to the RAM directory is not charged to the
        # source's memory limit (it would sit at its limit, OOM-killed on its next save).
        v2 = cgroup_mode() == "v2"
        used = int(cgroup_file("memory", sb.id, "memory.current" if v2 else "memory.usage_in_bytes").read_text())
        limit = int(cgroup_file("memory", sb.id, "memory.max" if v2 else "memory.limit_in_bytes").read_text())
        print(f"source's VMM after the fork: {used >> 20} MiB charged of its {limit >> 20} MiB limit")
        assert used < 0.8 * limit, (used, limit)
        assert all(c.info.forked_from == sb.id for c in copies)
        for i, c in enumerate(copies):
            assert await ask(c, f"get {10 + i}", 10 + i) == value, c.id
        for i, c in enumerate(copies):
            assert await ask(c, f"set {20 + i} {1000 + i}", 20 + i) == 1000 + i
        assert await ask(sb, "get 40", 40) == value
        for c in copies:
            r = await c.exec(["sh", "-c", "echo $DSEC_SANDBOX_ID"])
            assert r.stdout.strip() == c.id

        # Pause to disk and back: the process and its memory survive.
        await sb.pause(to_disk=True)
        assert wait_for(lambda: not [p for p in vmm_processes(sb.id)], timeout=10)
        await sb.resume()
        assert await ask(sb, "get 50", 50) == value
    finally:
        for c in copies:
            await c.stop()
        await sb.stop()
    for c in [sb, *copies]:
        assert wait_for(lambda: not vmm_processes(c.id), timeout=10), f"Firecracker of {c.id} outlived it"
        assert leftovers(c.id) == []
        assert not Path(f"/run/netns/dsfc-{c.id}").exists()


def vmm_memory_kib(sandbox_id: str) -> dict[str, int]:
    """The smaps_rollup counters (kB) of the sandbox's Firecracker process."""
    return smaps_rollup_kib(p for p in vmm_processes(sandbox_id)
                            if b"firecracker" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0])


async def test_microvm_fork_of_eight_keeps_memory_reseeds_and_shares_pages(client, need_microvm):
    sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
            memory_limit_mb=512))
    copies = []
    try:
        # Worth sharing: 128 MiB held by a Python process, next to the value holder.
        await sb.exec_background(["python3", "-c",
                                  "import time; b = bytearray(range(256)) * (512 * 1024); time.sleep(100000)"])
        value = await start_holder(sb)
        source = vmm_memory_kib(sb.id)["Pss"]
        t0 = time.monotonic()
        copies = await sb.fork(count=8)
        took = time.monotonic() - t0
        assert sb.last_fork["memory_preserved"] is True
        for i, c in enumerate(copies):
            assert await ask(c, f"get {10 + i}", 10 + i) == value, c.id
        rand = set()
        for c in [sb, *copies]:
            r = await c.exec(["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
                                          "cat /proc/sys/kernel/random/uuid"])
            rand.add(r.stdout)
        assert len(rand) == 9, rand
        r = await copies[0].exec(["date", "+%s"])
        assert abs(int(r.stdout) - time.time()) < 5, r
        mem = [vmm_memory_kib(c.id) for c in copies]
        per_copy = [m["Pss"] for m in mem]
        shared = [m["Shared_Clean"] + m["Shared_Dirty"] for m in mem]
        total = sum(per_copy)
        print(f"\nfork of 8 (nested under TCG): {took:.1f} s, source paused "
              f"{sb.last_fork['source_paused_ms']} ms; source PSS {source / 1024:.0f} MiB, copies "
              f"{total / 1024:.0f} MiB in all ({total / 8 / 1024:.0f} MiB each), "
              f"{total / (8 * source):.2f} of 8 x the source's; pages each copy shares with "
              f"the others: {min(shared) / 1024:.0f}-{max(shared) / 1024:.0f} MiB", flush=True)
        # The copies map one memory file: what they have not written is one copy in the
        # page cache, counted once among them all. (Each also writes some after the
        # restore, its guest kernel going on: 80-120 MiB each here.)
        assert all(s > 32 * 1024 for s in shared), shared
        assert total < 8 * source, (source, per_copy)
    finally:
        for c in copies:
            await c.stop()
        await sb.stop()
    for c in [sb, *copies]:
        assert wait_for(lambda: not vmm_processes(c.id), timeout=30), f"Firecracker of {c.id} outlived it"
        assert leftovers(c.id) == []


async def test_microvm_diff_snapshots_write_only_the_dirty_pages(client, need_microvm):
    """With `firecracker_diff_snapshots = true` a VM tracks dirty pages: its first fork
    writes all its memory (Full); a later one writes only the pages changed since (a Diff,
    laid over a copy of the first). The copies of each fork hold the memory as it was at
    their fork, and the 128 MiB left untouched in between is not written again."""
    import re

    cfg = DATA / "config.toml"
    assert not cfg.exists(), f"{cfg} is the test's own; remove the stale one"
    server_down()
    cfg.write_text("[edge]\nfirecracker_diff_snapshots = true\n")
    made = []
    try:
        server_up()
        async with DSecClient() as c2:
            sb = await c2.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
                    memory_limit_mb=512))
            made.append(sb)
            await sb.exec_background(["python3", "-c",
                                      "import time; b = bytearray(range(256)) * (512 * 1024); time.sleep(100000)"])
            value = await start_holder(sb)
            first = await sb.fork(count=1)
            made += first
            full_ms = sb.last_fork["source_paused_ms"]
            assert await ask(first[0], "get 10", 10) == value
            assert await ask(sb, "set 2 424242", 2) == 424242
            second = await sb.fork(count=2)
            made += second
            diff_ms = sb.last_fork["source_paused_ms"]
            for i, c in enumerate(second):
                assert await ask(c, f"get {20 + i}", 20 + i) == 424242, "a Diff copy lost the change"
                r = await c.exec(["sh", "-c", "grep -qs bytearray /proc/[0-9]*/cmdline && echo alive"])
                assert r.stdout == "alive\n", r
            assert await ask(first[0], "get 11", 11) == value, "the second fork changed the first's copy"
            log = (DATA / "dsec.log").read_text(errors="replace")
            diffs = [int(m.group(1)) for line in log.splitlines() if "Diff snapshot" in line and sb.id in line
                     for m in [re.search(r"dirty_bytes=(\d+)", line)] if m]
            assert len(diffs) == 1, f"expected one Diff snapshot of {sb.id}, the log has {diffs}"
            print(f"\ndiff snapshots (nested under TCG): first fork (Full) paused the source {full_ms} ms; "
                  f"the second (Diff, {diffs[0] / 2**20:.1f} MiB dirty) {diff_ms} ms", flush=True)
            assert diffs[0] < 128 * 2**20, f"the Diff wrote {diffs[0]} bytes: more than was changed"
    finally:
        async with DSecClient() as c3:
            for m in made:
                await (await c3.get_sandbox(m.id)).stop()
        cfg.unlink()
        server_down()
        server_up()
    for m in made:
        assert wait_for(lambda: not vmm_processes(m.id), timeout=30)
        assert leftovers(m.id) == []


async def test_microvm_egress_follows_its_rules(client, need_microvm):
    sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
            memory_limit_mb=256, network_rules={"pypi": True}))
    # A TCP connection to port 443 (the registries' TLS is not the point here).
    probe = ("import socket, sys\n"
             "try:\n"
             "    socket.create_connection((sys.argv[1], 443), timeout=20).close(); print('open')\n"
             "except Exception as e:\n"
             "    print('closed', type(e).__name__, e)\n")
    try:
        await sb.files.write("/tmp/probe.py", probe.encode())
        r = await sb.exec(["python3", "/tmp/probe.py", "pypi.org"], timeout=90)
        assert r.stdout.startswith("open"), r
        r = await sb.exec(["python3", "/tmp/probe.py", "deb.debian.org"], timeout=90)
        assert r.stdout.startswith("closed"), r
        await sb.set_network_rules({})
        r = await sb.exec(["python3", "/tmp/probe.py", "pypi.org"], timeout=90)
        assert r.stdout.startswith("closed"), r
    finally:
        await sb.stop()


async def test_microvm_sessions_pty_and_streams_over_vsock(client, need_microvm):
    import asyncio

    from test_runtime import read_until

    sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
            memory_limit_mb=256))
    try:
        # A persistent shell session keeps its directory and environment.
        s = await sb.sessions.create()
        await s.run("cd /var; export A=1")
        assert (await s.run("pwd; echo $A")).stdout == "/var\n1\n"
        # A terminal: a REPL, resized, interrupted, exited.
        p = await sb.pty(["python3", "-i", "-q"], cols=80, rows=24)
        await p.send_stdin("import os\nprint(6*7)\n")
        await read_until(p, b"42", timeout=60)
        await p.resize(120, 40)
        await p.send_stdin('print("SIZE", os.get_terminal_size(0))\n')
        await read_until(p, b"SIZE os.terminal_size(columns=120, lines=40)", timeout=30)
        await p.send_stdin("import time; time.sleep(30)\n")
        await asyncio.sleep(0.5)
        await p.send_stdin(b"\x03")
        await read_until(p, b"KeyboardInterrupt", timeout=20)
        await p.send_stdin("exit()\n")
        assert (await asyncio.wait_for(p.wait(), 20)).exit_code == 0
        # Output streamed as it comes, and a file of a few MiB each way.
        got = []
        st = await sb.exec_stream(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.2; done"])
        async for stream, chunk in st:
            got.append(chunk)
        assert b"".join(c if isinstance(c, bytes) else c.encode() for c in got) == b"line1\nline2\nline3\n"
        blob = os.urandom(3 << 20)
        await sb.files.write("/root/blob", blob)
        assert await sb.files.read("/root/blob") == blob
    finally:
        await sb.stop()
