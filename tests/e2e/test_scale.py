# SPDX-License-Identifier: AGPL-3.0-only
"""100 sandboxes created concurrently through the SDK, each runs a command, all stop."""

import asyncio

from conftest import aether_processes, leftovers
from opendsec import DSecRunArgs


async def test_hundred_concurrent_sandboxes(client):
    n = 100
    before = set(aether_processes())

    async def one(i: int) -> str:
        sb = await client.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64, labels={"batch": "scale"}))
        r = await sb.run_shell(f"echo sandbox-{i}")
        assert r.exit_code == 0 and r.stdout == f"sandbox-{i}\n"
        return sb.id

    ids = await asyncio.gather(*(one(i) for i in range(n)))
    assert len(set(ids)) == n
    listed = await client.list_sandboxes(labels={"batch": "scale"})
    assert {s.id for s in listed} == set(ids)
    assert len(set(aether_processes()) - before) == n

    async def stop(i: str) -> None:
        await (await client.get_sandbox(i)).stop()

    await asyncio.gather(*(stop(i) for i in ids))
    assert await client.list_sandboxes(labels={"batch": "scale"}) == []
    assert set(aether_processes()) - before == set()
    for i in ids:
        assert leftovers(i) == []
