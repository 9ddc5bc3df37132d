# SPDX-License-Identifier: AGPL-3.0-only
"""A warm pool of `vm` sandboxes: the first member boots, is saved, and the rest are
restored from that save (boot once per image, restore many). A member handed out is one
the create asked for, answers at once, and is its own machine: restored from the save
(its QEMU loads it instead of booting), with its own id, a reseeded random generator and
the host's time. Skipped where QEMU is missing."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from conftest import DATA, leftovers, node_config, server_down, server_up, wait_pool
from opendsec import DSecClient, DSecRunArgs

POOL = "vms"
# No other test asks for a vm of this memory, so only this file's creates match.
POOL_MB = 320


@pytest.fixture(scope="module", autouse=True)
def vm_pool_node():
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("skipped: qemu-system-x86_64 is not installed")
    with node_config(f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nbackend = "vm"\n'
                     f'memory_mb = {POOL_MB}\nsize = 2\n'):
        yield


async def wait_full(c: DSecClient) -> float:
    # Booting the first member under TCG takes a while.
    return await wait_pool(c, POOL, 2, timeout=300)


def pooled() -> DSecRunArgs:
    return DSecRunArgs(image="root/base", backend="vm", memory_limit_mb=POOL_MB)


def restored(sandbox_id: str) -> bool:
    """Whether the sandbox's QEMU was started to load a saved state (`-incoming`) rather
    than to boot."""
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = p.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"qemu-system" in a for a in cmd[:1]) and any(sandbox_id.encode() in a for a in cmd):
            return b"-incoming" in cmd
    raise AssertionError(f"no QEMU process for {sandbox_id}")


async def own_machine(sb) -> str:
    """Checks what a restored member must have of its own; returns 16 random bytes it read."""
    guest_now = int((await sb.exec(["date", "+%s"])).stdout)
    assert abs(guest_now - time.time()) < 30, "a restored member kept the saved clock"
    assert (await sb.run_shell("echo $DSEC_SANDBOX_ID")).stdout.strip() == sb.id
    return (await sb.exec(["sh", "-c", "head -c 16 /dev/urandom | od -An -tx1"])).stdout


async def test_vm_members_are_restored_from_one_boot_and_are_each_their_own(client):
    await wait_full(client)
    first = [await client.run_sandbox(pooled()) for _ in range(2)]
    later = []
    try:
        assert all(sb.info.from_pool == POOL for sb in first)
        # One member was booted and saved; the other was restored from that save.
        assert sum(restored(sb.id) for sb in first) >= 1, "the pool booted every member"
        for sb in first:
            await own_machine(sb)
        # The pool makes up for them from its save: every new member is a restore.
        took = await wait_full(client)
        print(f"\nvm pool refilled 2 members in {took:.1f} s (restored)", flush=True)
        later = [await client.run_sandbox(pooled()) for _ in range(2)]
        assert all(sb.info.from_pool == POOL and restored(sb.id) for sb in later)
        x, y = later
        assert x.id != y.id
        # Restored from the same memory, yet not the same random state.
        assert await own_machine(x) != await own_machine(y), "two restored members share their random state"
        # Files of one are not in the other.
        await x.files.write("/root/mine", b"x's\n")
        assert not await y.files.exists("/root/mine")
    finally:
        for sb in first + later:
            await sb.stop()


async def test_stopping_the_node_leaves_no_vm_or_save_behind(client):
    await wait_full(client)
    server_down()
    left = leftovers()
    assert not left, f"left behind: {left}"
    assert not list((DATA / "edge/fork-tmp").glob("pool-*")), "a pool's save outlived the node"
    server_up()
