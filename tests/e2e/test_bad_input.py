# SPDX-License-Identifier: AGPL-3.0-only
"""Bad requests get the right status, a machine-readable code and a sentence; none leaves
anything behind."""

import httpx
import pytest

from conftest import leftovers
from opendsec import (AuthenticationError, DSecClient, DSecRunArgs, InvalidArgumentError,
                      NotFoundError)


@pytest.fixture
async def raw(client):
    async with httpx.AsyncClient(base_url=client.api_url, headers={"Authorization": f"Bearer {client.api_key}"}) as h:
        yield h


def err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == code, body
    assert len(body["message"]) > 20, body
    return body["message"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"image": "root/base", "memory_limit_mb": 0}, "memory_limit_mb"),
        ({"image": "root/base", "memory_limit_mb": -5}, "memory_limit_mb"),
        ({"image": "root/base", "memory_limit_mb": 10 ** 9}, "memory_limit_mb"),
        ({"image": "root/base", "cpu_cores_limit": 0}, "cpu_cores_limit"),
        ({"image": "root/base", "cpu_cores_limit": -1}, "cpu_cores_limit"),
        ({"image": "root/base", "cpu_cores_limit": 4096}, "cpu_cores_limit"),
        ({"image": "root/base", "disk_limit_mb": 0}, "disk_limit_mb"),
        ({"image": "root/base", "pids_limit": 1.5}, "pids_limit"),
        ({"image": "root/base", "ttl_seconds": 0}, "ttl_seconds"),
        ({"image": "root/base", "ttl_seconds": 10 ** 12}, "ttl_seconds"),
        ({"image": "root/base", "backend": "teleporter"}, "backend"),
        ({"image": "root/base", "memroy_limit_mb": 5}, "memroy_limit_mb"),
        ({"image": "../../etc/passwd"}, "image reference"),
        ({}, "image"),
    ],
)
async def test_bad_create_requests(raw, body, field):
    r = await raw.post("/v1/sandboxes", json=body)
    assert field in err(r, 400, "invalid_argument")
    assert leftovers() == []


async def test_unknown_image_is_not_found(client):
    with pytest.raises(NotFoundError) as e:
        await client.run_sandbox(DSecRunArgs(image="root/nonexistent:1"))
    assert "dsec image build" in e.value.message and e.value.status == 404
    assert leftovers() == []


async def test_malformed_json(raw):
    r = await raw.post("/v1/sandboxes", content=b'{"image": "root/base",', headers={"content-type": "application/json"})
    assert "not valid JSON" in err(r, 400, "invalid_argument")
    r = await raw.post("/v1/sandboxes", content=b"[1,2]")
    assert "does not match" in err(r, 400, "invalid_argument")
    r = await raw.post("/v1/sandboxes")
    err(r, 400, "invalid_argument")


async def test_missing_and_wrong_api_keys(client):
    async with httpx.AsyncClient(base_url=client.api_url) as h:
        r = await h.get("/v1/sandboxes")
        assert "missing API key" in err(r, 401, "unauthenticated")
        r = await h.get("/v1/sandboxes", headers={"Authorization": "Bearer dsk.notarealkey"})
        assert "not recognised" in err(r, 401, "unauthenticated")
    async with DSecClient(api_url=client.api_url, api_key="dsk.wrong") as bad:
        with pytest.raises(AuthenticationError):
            await bad.run_sandbox(DSecRunArgs(image="root/base"))
    assert leftovers() == []


async def test_unknown_and_malformed_sandbox_ids(raw, client):
    r = await raw.get("/v1/sandboxes/local-000000000000")
    assert "does not exist" in err(r, 404, "not_found")
    r = await raw.post("/v1/sandboxes/local-000000000000/exec", json={"cmd": "true"})
    err(r, 404, "not_found")
    r = await raw.delete("/v1/sandboxes/..%2F..%2Fetc")
    assert "not a sandbox id" in err(r, 400, "invalid_argument")
    r = await raw.get("/v1/sandboxes/elsewhere-000000000000")
    assert "edge elsewhere" in err(r, 404, "not_found")
    with pytest.raises(NotFoundError):
        await client.get_sandbox("local-zzzzzzzzzzzz")
    r = await raw.get("/v2/nothing")
    err(r, 404, "not_found")


async def test_bad_exec_and_fork_requests(client, raw):
    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    try:
        r = await raw.post(f"/v1/sandboxes/{sb.id}/exec", json={})
        assert "exactly one of cmd" in err(r, 400, "invalid_argument")
        r = await raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"argv": ["/no/such/program"]})
        assert "does not exist" in err(r, 400, "invalid_argument")
        r = await raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true", "cwd": "relative"})
        assert "absolute" in err(r, 400, "invalid_argument")
        r = await raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true", "timeout_seconds": -1})
        assert "timeout_seconds" in err(r, 400, "invalid_argument")
        r = await raw.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": 0})
        assert "count" in err(r, 400, "invalid_argument")
        r = await raw.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": 100000})
        assert "count" in err(r, 400, "invalid_argument")
        with pytest.raises(InvalidArgumentError):
            await sb.set_timeout(0)
        assert [s.id for s in await client.list_sandboxes()] == [sb.id]
    finally:
        await sb.stop()
    assert leftovers() == []


async def test_microvm_on_a_host_that_cannot_run_it_says_what_is_missing(raw):
    st = (await raw.get("/v1/status")).json()
    b = [x for x in st["nodes"][0]["backends"] if x["name"] == "microvm"][0]
    if b["available"]:
        pytest.skip("skipped: this host can run microVMs")
    r = await raw.post("/v1/sandboxes", json={"image": "root/base", "backend": "microvm"})
    msg = err(r, 503, "unavailable")
    assert "backend microvm is unavailable" in msg and b["detail"] in msg, msg
    assert leftovers() == []
