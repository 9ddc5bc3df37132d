# SPDX-License-Identifier: AGPL-3.0-only
"""Function calls (`[[edge.functions]]`, `POST /v1/functions/{name}:call`): the input
reaches the entry point on stdin, its stdout comes back as the output, a failing function
answers with its exit code and stderr, a slow one is stopped at its timeout, each call runs
in a fresh sandbox of its own (from the function's warm pool when it has one) that is
stopped after, quotas apply to the caller's project, and a function limited to some
projects does not exist for the others."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from conftest import node_config, pool_ready, wait_pool
from opendsec import (
    DeadlineExceededError,
    DSecClient,
    DSecRunArgs,
    FunctionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

# No other test asks for this memory limit, so only this file's calls match the pool.
POOL_MB = 88
POOL = "fnpool"
TEAM = f"root/fn-{os.urandom(3).hex()}"

FUNCTIONS = {
    # Echoes its input back inside an object.
    "echo": {"pool": POOL, "entry": ["sh", "-c", "read -r line; printf '{\"got\": %s}' \"$line\""]},
    # Prints what an earlier call left in its sandbox, then leaves something itself.
    "leaves": {"pool": POOL, "entry": ["sh", "-c", "cat /root/left 2>/dev/null; echo mark > /root/left"]},
    "fails": {"image": "root/base", "entry": ["sh", "-c", "echo broken >&2; exit 3"]},
    "slow": {"image": "root/base", "entry": ["sleep", "30"], "timeout_seconds": 2},
    "team-only": {"image": "root/base", "entry": ["echo", "\"team\""], "projects": [TEAM]},
}


def toml_value(v: object) -> str:
    # JSON strings, numbers and arrays of strings are valid TOML values.
    return json.dumps(v)


@pytest.fixture(scope="module", autouse=True)
def node_with_functions():
    text = f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nmemory_mb = {POOL_MB}\nsize = 2\n'
    for name, f in FUNCTIONS.items():
        text += f'\n[[edge.functions]]\nname = "{name}"\n'
        text += "".join(f"{k} = {toml_value(v)}\n" for k, v in f.items())
    with node_config(text):
        yield


async def wait_full(c: DSecClient) -> None:
    await wait_pool(c, POOL, 2)


async def gone(c: DSecClient, sandbox_id: str, timeout: float = 30) -> bool:
    for _ in range(int(timeout * 10)):
        if sandbox_id not in {s.id for s in await c.list_sandboxes()}:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_the_input_goes_in_and_the_output_comes_out_from_a_pool_member(client):
    await wait_full(client)
    value = {"text": "héllo \"quoted\"\nnext line", "n": [1, 2.5, None], "deep": {"a": {"b": True}}}
    r = await client.call("echo", value)
    assert r.output == {"got": value}
    assert r.exit_code == 0 and r.from_pool == POOL, r
    assert r.duration_ms >= r.run_ms
    # Its sandbox is stopped after the call, and the pool makes up for it.
    assert await gone(client, r.sandbox_id), "a call's sandbox was left running"
    await wait_full(client)
    names = {f["name"] for f in await client.functions()}
    assert {"echo", "leaves", "fails", "slow"} <= names and "team-only" not in names


async def test_each_call_is_a_fresh_sandbox(client):
    await wait_full(client)
    seen = set()
    for _ in range(3):
        r = await client.call("leaves")
        # Nothing an earlier call wrote is there.
        assert r.output is None, f"a call saw an earlier call's file: {r.output!r}"
        assert r.sandbox_id not in seen
        seen.add(r.sandbox_id)


async def test_a_failing_function_reports_its_exit_code_and_stderr(client):
    with pytest.raises(FunctionError) as e:
        await client.call("fails", {"x": 1})
    assert e.value.result.exit_code == 3 and e.value.result.stderr == "broken\n"
    r = await client.call("fails", check=False)
    assert (r.exit_code, r.output) == (3, None)
    assert await gone(client, r.sandbox_id)


async def test_a_slow_function_is_stopped_at_its_timeout(client):
    before = {s.id for s in await client.list_sandboxes()}
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(DeadlineExceededError) as e:
        await client.call("slow")
    assert asyncio.get_running_loop().time() - t0 < 20, "the call waited for the whole sleep"
    assert "2" in e.value.message and e.value.status == 504
    # A shorter limit than the function's own is kept; a longer one is refused.
    with pytest.raises(DeadlineExceededError):
        await client.call("slow", timeout=1)
    with pytest.raises(InvalidArgumentError):
        await client.call("slow", timeout=3)
    for _ in range(300):
        if not ({s.id for s in await client.list_sandboxes()} - before):
            break
        await asyncio.sleep(0.1)
    assert not ({s.id for s in await client.list_sandboxes()} - before), "a timed-out call left its sandbox"


async def test_unknown_functions_and_bad_requests_are_clear_errors(client):
    with pytest.raises(NotFoundError) as e:
        await client.call("no-such-function")
    assert "GET /v1/functions" in e.value.message
    async with httpx.AsyncClient(base_url=client.api_url,
                                 headers={"Authorization": f"Bearer {client.api_key}"}) as h:
        r = await h.post("/v1/functions/echo", json={})
        assert r.status_code == 404 and "NAME:call" in r.json()["message"]
        r = await h.post("/v1/functions/echo:call", json={"inptu": 1})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text


async def test_quota_and_projects_apply_to_calls(client):
    await client.create_project(TEAM, sandboxes=1)
    k = await client.create_key("fn", project=TEAM)
    other = f"root/fx-{os.urandom(3).hex()}"
    await client.create_project(other)
    ko = await client.create_key("fx", project=other)
    async with DSecClient(api_key=k["key"]) as team, DSecClient(api_key=ko["key"]) as outsider:
        r = await team.call("team-only")
        assert r.output == "team"
        with pytest.raises(NotFoundError):
            await outsider.call("team-only")
        assert "team-only" not in {f["name"] for f in await outsider.functions()}
        # The call's sandbox counts against the caller's project until it has stopped
        # (just after the call answered); with the project's one sandbox taken, a call is
        # refused.
        assert await gone(client, r.sandbox_id)
        await wait_full(client)
        held = await team.run_sandbox(DSecRunArgs(image="root/base"))
        try:
            with pytest.raises(ResourceExhaustedError):
                await team.call("echo", 1)
            assert await pool_ready(client, POOL) == 2, "a refused call used up a pool member"
        finally:
            await held.stop()
        # Another project's key cannot charge a call to this project.
        with pytest.raises(NotFoundError):
            await outsider.call("echo", 1, project=TEAM)
