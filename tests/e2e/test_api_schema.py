# SPDX-License-Identifier: AGPL-3.0-only
"""The API's committed OpenAPI document against what speaks it: the Python SDK's models
name exactly the fields the document gives (a field added to one and not the other fails
here), a running server serves every operation the document describes, and its sandbox,
network and error bodies carry only fields the document describes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "sdk/python"))

from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError  # noqa: E402
from opendsec import client as sdk  # noqa: E402

DOC = json.loads((ROOT / "crates/common/openapi.json").read_text())
SCHEMAS = DOC["components"]["schemas"]


def props(name: str) -> set[str]:
    return set(SCHEMAS[name]["properties"])


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_sdk_models_name_the_documents_fields():
    assert fields(DSecRunArgs) == props("CreateSandboxRequest"), (
        f"only in the SDK: {fields(DSecRunArgs) - props('CreateSandboxRequest')}; "
        f"only in openapi.json: {props('CreateSandboxRequest') - fields(DSecRunArgs)}")
    assert fields(sdk.SandboxInfo) == props("Sandbox"), (
        f"only in the SDK: {fields(sdk.SandboxInfo) - props('Sandbox')}; "
        f"only in openapi.json: {props('Sandbox') - fields(sdk.SandboxInfo)}")


async def test_a_servers_bodies_carry_only_documented_fields():
    async with DSecClient() as c:
        sb = await c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=120,
                                             network_rules={"pypi": True},
                                             egress_headers={"pypi.org": {"X-Key": "k"}},
                                             labels={"schema": "1"}))
        try:
            raw = await c._request("GET", f"/v1/sandboxes/{sb.id}")
            assert set(raw) <= props("Sandbox"), set(raw) - props("Sandbox")
            assert set(raw["network"]) <= props("NetworkInfo"), set(raw["network"]) - props("NetworkInfo")
            assert raw["network"]["egress_headers"] == {"pypi.org": {"X-Key": "k"}}
            assert set(raw["limits"]) <= props("Limits"), set(raw["limits"]) - props("Limits")
        finally:
            await sb.stop()
        with pytest.raises(InvalidArgumentError) as e:
            await c.run_sandbox(DSecRunArgs(image="root/base", egress_headers={"x y": {"A": "1"}}))
        assert e.value.code == "invalid_argument" and "egress_headers" in e.value.message


def test_the_server_serves_every_documented_operation():
    """Every operation of the generated document is routed by a running node: asked
    without a key it answers 401 (the route exists and wants one), never the router's
    404 or 405; the operations the document marks as taking no key answer without one."""
    url = DSecClient().api_url
    sample = {"id": "edge-000000000000", "port": "8080", "path": "index.html", "reference": "root%2Fbase:latest",
              "registry": "registry.example.com"}
    seen = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, item in DOC["paths"].items():
            concrete = path.replace("{name}:call", "f:call")
            for part in concrete.split("/"):
                if part.startswith("{") and part.endswith("}"):
                    concrete = concrete.replace(part, sample.get(part[1:-1], "nope-1"))
            for method, op in item.items():
                r = http.request(method.upper(), concrete)
                what = f"{method.upper()} {concrete}: {r.status_code} {r.text[:200]}"
                seen += 1
                if op.get("security") == [{}]:
                    # Health answers; the port proxy answers for the sandbox it names
                    # (here: one no edge has), not the router's "no such endpoint".
                    assert r.status_code != 405 and "no such endpoint" not in r.text, what
                    continue
                assert r.status_code == 401, what
                assert r.json()["code"] == "unauthenticated", what
    assert seen >= 75
