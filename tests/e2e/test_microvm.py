# SPDX-License-Identifier: AGPL-3.0-only
"""The `microvm` backend: a Firecracker VMM per sandbox, booted from the same guest kernel
(as vmlinux), initramfs and root disk as the `vm` backend, with aether reached over vsock.
It needs hardware KVM and a Firecracker v1.16 binary; where the server reports the backend
unavailable, each test is skipped with the server's reason."""

import time
from pathlib import Path

import pytest

from conftest import leftovers, wait_for
from opendsec import DSecRunArgs
from test_vm import HOLDER, ask, wait_for_file


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
            cpu_cores_limit=1, memory_limit_mb=1024))
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

        # A process holding a value only in its memory: the copies must have it.
        await sb.files.write("/tmp/holder.py", HOLDER.encode())
        await sb.exec_background(["python3", "/tmp/holder.py"])
        assert await wait_for_file(sb, "/tmp/cmd")
        value = await ask(sb, "get 1", 1)
        t0 = time.monotonic()
        copies = await sb.fork(count=4)
        took = time.monotonic() - t0
        fork = sb.last_fork
        print(f"fork of 4: {took:.2f} s, source paused {fork['source_paused_ms']} ms", flush=True)
        assert fork["memory_preserved"] is True
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
