# SPDX-License-Identifier: AGPL-3.0-only
"""Warm pools (`[[edge.pools]]`): members made ahead, handed out only to a create that
asks for what they are, refilled after, kept across a restart, and as fresh and as
isolated as a new sandbox: their own id, nobody's state, the tenant's project, quota,
rules and environment."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from conftest import DATA, leftovers, node_config, pool_ready, server_down, server_up, wait_pool
from test_e2b import e2b  # noqa: F401 (the fixture: the released e2b SDK, set up for the gateway)
from opendsec import DSecClient, DSecRunArgs, NotFoundError, ResourceExhaustedError

# No other test asks for this memory limit, so only this file's creates match the pool.
POOL_MB = 80
POOL = "small"
E2B_POOL = "e2b"


@pytest.fixture(scope="module", autouse=True)
def pooled_node():
    with node_config(f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nmemory_mb = {POOL_MB}\nsize = 2\n'
                     # What the E2B gateway's `base` template asks for: its image, the
                     # node's default limits.
                     f'\n[[edge.pools]]\nname = "{E2B_POOL}"\nimage = "root/py:3.11"\nsize = 1\n'):
        yield


async def ready(c: DSecClient, pool: str = POOL) -> int:
    return await pool_ready(c, pool)


async def wait_full(c: DSecClient) -> None:
    await wait_pool(c, POOL, 2)


def pooled(**kw) -> DSecRunArgs:
    return DSecRunArgs(image="root/base", memory_limit_mb=POOL_MB, **kw)


async def test_only_a_matching_create_takes_a_member_and_the_pool_refills(client):
    await wait_full(client)
    listed = {s.id for s in await client.list_sandboxes()}
    other = await client.run_sandbox(DSecRunArgs(image="root/base"))
    assert other.info.from_pool is None, "a create of other limits got a pool member"
    assert await ready(client) == 2
    sb = await client.run_sandbox(pooled(env={"FOO": "from-the-create"}, labels={"t": "pool"}))
    try:
        assert sb.info.from_pool == POOL
        assert sb.id not in listed, "a waiting member was listed"
        assert sb.info.labels == {"t": "pool"} and sb.info.project == "root"
        assert sb.info.limits["memory_mb"] == POOL_MB
        assert (await sb.run_shell("echo $FOO")).stdout == "from-the-create\n"
        assert sb.id in {s.id for s in await client.list_sandboxes()}
        await wait_full(client)
    finally:
        await sb.stop()
        await other.stop()


async def test_a_pooled_sandbox_is_fresh_isolated_and_gets_the_tenants_rules(client):
    await wait_full(client)
    uid = os.urandom(3).hex()
    a, b = f"root/pa-{uid}", f"root/pb-{uid}"
    await client.create_project(a)
    await client.create_project(b)
    ka, kb = await client.create_key("a", project=a), await client.create_key("b", project=b)
    async with DSecClient(api_key=ka["key"]) as ca, DSecClient(api_key=kb["key"]) as cb:
        x = await ca.run_sandbox(pooled(network_rules={"203.0.113.9/32": True}))
        try:
            assert x.info.from_pool == POOL and x.info.project == a
            assert x.info.network["rules"] == {"203.0.113.9/32": True}
            # The rule is in the node's table for this sandbox's interface, put there at
            # hand-out (the member waited with none).
            iface = "dsv" + x.id.split("-", 1)[1]
            elems = subprocess.run(["nft", "list", "set", "inet", "dsec", "c1"],
                                   capture_output=True, text=True).stdout
            assert any(iface in line and "203.0.113.9" in line for line in elems.splitlines()), elems
            await x.run_shell("echo a-secret > /root/secret")
            await wait_full(client)
            y = await cb.run_sandbox(pooled())
            try:
                assert y.info.from_pool == POOL and y.info.project == b and y.id != x.id
                assert y.info.network["rules"] == {}
                r = await y.run_shell("cat /root/secret 2>&1; ls /root")
                assert "a-secret" not in r.stdout, "a pooled sandbox holds another tenant's file"
                with pytest.raises(NotFoundError):
                    await cb.get_sandbox(x.id)
                assert x.id not in {s.id for s in await cb.list_sandboxes()}
                assert y.info.port_token != x.info.port_token
            finally:
                await y.stop()
        finally:
            await x.stop()


async def test_quota_refuses_a_pooled_create_and_the_member_stays(client):
    await wait_full(client)
    project = f"root/pq-{os.urandom(3).hex()}"
    await client.create_project(project, sandboxes=1)
    k = await client.create_key("q", project=project, agent=True)
    async with DSecClient(api_key=k["key"]) as agent:
        first = await agent.run_sandbox(pooled())
        try:
            assert first.info.from_pool == POOL
            await wait_full(client)
            with pytest.raises(ResourceExhaustedError):
                await agent.run_sandbox(pooled())
            assert await ready(client) == 2, "a refused create used up a member"
        finally:
            await first.stop()


async def test_members_wait_again_after_a_restart(client):
    await wait_full(client)
    server_down("--keep-sandboxes")
    server_up()
    async with DSecClient() as c2:
        # Back at once: adopted, not made again.
        assert await ready(c2) == 2
        sb = await c2.run_sandbox(pooled())
        try:
            assert sb.info.from_pool == POOL
            assert (await sb.run_shell("echo ok")).stdout == "ok\n"
        finally:
            await sb.stop()


def waiting_members() -> list[str]:
    """Ids of the pool's members now waiting (from their records on disk)."""
    out = []
    for st in (DATA / "edge/sandboxes").glob("*/state.json"):
        try:
            if json.loads(st.read_text()).get("pool_waiting") == POOL:
                out.append(st.parent.name)
        except (OSError, ValueError):
            pass
    return out


async def test_a_member_that_dies_while_waiting_is_replaced_not_handed_out(client):
    await wait_full(client)
    dead = waiting_members()[0]
    init = int((DATA / f"edge/sandboxes/{dead}/init.pid").read_text())
    os.kill(init, signal.SIGKILL)
    for _ in range(100):
        if dead not in waiting_members() and not (DATA / f"edge/sandboxes/{dead}").exists():
            break
        await asyncio.sleep(0.1)
    assert dead not in waiting_members(), "a dead member still waits in the pool"
    assert leftovers(dead) == [], leftovers(dead)
    await wait_full(client)
    made = [await client.run_sandbox(pooled()) for _ in range(2)]
    try:
        assert all(s.info.from_pool == POOL and s.id != dead for s in made)
        for s in made:
            assert (await s.run_shell("echo ok")).stdout == "ok\n"
    finally:
        for s in made:
            await s.stop()


async def test_an_e2b_create_takes_a_member_of_a_matching_pool(client, e2b):  # noqa: F811
    await wait_pool(client, E2B_POOL, 1)
    sb = await asyncio.to_thread(e2b.Sandbox.create, timeout=60)
    try:
        info = (await client.get_sandbox(sb.sandbox_id)).info
        assert info.from_pool == E2B_POOL, info
        assert info.project == "root/e2b" and info.labels.get("e2b.template") == "base", info
        r = await asyncio.to_thread(sb.commands.run, "echo from-e2b")
        assert r.stdout == "from-e2b\n"
    finally:
        await asyncio.to_thread(sb.kill)
