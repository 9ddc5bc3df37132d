# SPDX-License-Identifier: AGPL-3.0-only
"""The `vm` backend: a QEMU microvm per sandbox (TCG on hosts without hardware
virtualisation), booted from the guest kernel and root disk the image store builds, with
aether as the guest's init reached over virtio-serial. Skipped where QEMU is missing."""

import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import wait_for
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
    # Opt-in until an intermittent hang is understood: now and then the first VM of a
    # server's run does not answer (its console shows aether serving the channel, but the
    # first command never returns). Run with DSEC_TEST_VM=1.
    if os.environ.get("DSEC_TEST_VM") != "1":
        pytest.skip("skipped: set DSEC_TEST_VM=1 to run the vm backend tests")


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
        assert guest.endswith("-cloud-amd64") and guest != os.uname().release, guest
        # The runtime API works over the VM channel: files, streamed output, exit codes.
        await sb.files.write("/root/note.txt", b"in the vm\n")
        assert await sb.files.read("/root/note.txt") == b"in the vm\n"
        r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
        # The root is the image's disk under a writable overlay.
        mounts = (await sb.exec(["cat", "/proc/mounts"])).stdout
        assert " / overlay " in mounts, mounts
        assert qemu_processes(sb.id), "no QEMU process for the sandbox"
    finally:
        await sb.stop()
    assert wait_for(lambda: not qemu_processes(sb.id), timeout=10), "QEMU or vmux outlived the sandbox"


async def test_vm_sandbox_survives_an_edge_restart(client, need_qemu):
    from conftest import server_up, DATA
    sb = await client.run_sandbox(DSecRunArgs(image="root/base", backend="vm"))
    try:
        await sb.exec(["sh", "-c", "echo kept > /root/state"])
        pid = int((DATA / "dsec.pid").read_text())
        os.kill(pid, 9)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=10)
        server_up()
        async with DSecClient() as c2:
            again = await c2.get_sandbox(sb.id)
            assert again.info.state == "running"
            r = await again.exec(["cat", "/root/state"])
            assert r.stdout == "kept\n", r
            await again.stop()
    finally:
        async with DSecClient() as c3:
            for s in await c3.list_sandboxes():
                await (await c3.get_sandbox(s.id)).stop()
    assert wait_for(lambda: not qemu_processes(sb.id), timeout=10)
