# SPDX-License-Identifier: AGPL-3.0-only
"""Tenants against each other, the node and shared images: each test is an attack a key of a
non-root project makes, and shows it refused while the honest path still works.

1. Images: a tenant commits over a shared image (`root/base`) → 403, the image unchanged;
   it commits into its own namespace, and a sibling project neither sees nor starts it.
2. Network: a rule naming a private range (the sandbox pool, cloud metadata) → 400 naming
   the range; with `0.0.0.0/0` allowed, a sandbox still cannot connect to another
   project's sandbox, the node's addresses or 169.254.169.254 (netlab, where a server
   answers at each of those, so a failure is the policy's doing).
3. Gateway: a keyless request for a port of a sandbox that is not public (created through
   the native API, or through the gateway with allowPublicTraffic=false) → 401/403, while a
   public E2B sandbox's port still answers through the released `e2b` SDK; a signed upload
   URL writes only the path it was signed for."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from conftest import DATA, dsec
from netlab import API_IP, API_PORT, HOST_PORT, HTTP_PORT, METADATA_IP, NODE_IP, PYPI_IP
from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError, PermissionDeniedError
from test_network import PY, blocked, gateway, lab, node, node_connect, probe_named  # noqa: F401

SERVER = "import http.server as h; h.ThreadingHTTPServer(('0.0.0.0', 8000), h.SimpleHTTPRequestHandler).serve_forever()"


async def tenant(admin: DSecClient, name: str) -> tuple[str, DSecClient]:
    """A fresh project under root and an agent key of it."""
    project = f"root/{name}-{os.urandom(3).hex()}"
    await admin.create_project(project, sandboxes=20)
    k = await admin.create_key(f"{name}-agent", project=project, agent=True)
    return project, DSecClient(api_url=admin.api_url, api_key=k["key"])


def digest(ref: str) -> str:
    out = json.loads(dsec("image", "inspect", ref, "--data-dir", str(DATA), "--json").stdout)
    return out["digest"]


async def images_of(c: DSecClient) -> dict[str, dict]:
    return {i["reference"]: i for i in (await c._request("GET", "/v1/images"))["images"]}


# ---- 1. images belong to projects --------------------------------------------------------


async def test_a_tenant_cannot_replace_a_shared_image(client):
    before = digest("root/base")
    project, eve = await tenant(client, "eve")
    _, bob = await tenant(client, "bob")
    async with eve, bob:
        sb = await eve.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300))
        try:
            # The attack: a planted /bin/sh, committed over the image everybody starts.
            r = await sb.run_shell("mv /bin/sh /bin/.sh && printf '#!/bin/.sh\\necho pwned\\n' > /bin/sh && chmod +x /bin/sh")
            assert r.exit_code == 0, r.stderr
            for target in ("root/base", "root/base:latest", "root/py:3.11", f"{project}x/img:1"):
                with pytest.raises(PermissionDeniedError) as e:
                    await sb.commit(target, overwrite=True)
                assert e.value.status == 403 and e.value.code == "permission_denied", e.value
                assert f"{project}/" in e.value.message, e.value.message
            print(f"\ncommit over root/base by {project}: {e.value.status} {e.value.code}: {e.value.message}")
            assert digest("root/base") == before, "the shared image changed"
            fresh = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=120))
            try:
                assert (await fresh.run_shell("echo clean")).stdout == "clean\n"
            finally:
                await fresh.stop()

            # Its own namespace works, and stays its own.
            mine = f"{project}/tools:v1"
            made = await sb.commit(mine)
            assert made.image == mine
            assert mine in await images_of(eve)
            assert "root/base:latest" in await images_of(eve), "shared base images are readable"
            m = (await images_of(client))[mine]["manifest"]
            assert sb.id not in m["source"], m["source"]
            assert mine not in await images_of(bob), "a sibling lists another project's image"
            with pytest.raises(NotFoundError):
                await bob.run_sandbox(DSecRunArgs(image=mine, ttl_seconds=60))
            again = await eve.run_sandbox(DSecRunArgs(image=mine, ttl_seconds=60))
            try:
                assert (await again.exec(argv=["/bin/sh"])).stdout == "pwned\n", "its own image has its change"
            finally:
                await again.stop()
            # A sibling cannot overwrite it either.
            other = await bob.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=60))
            try:
                with pytest.raises(PermissionDeniedError):
                    await other.commit(mine, overwrite=True)
            finally:
                await other.stop()
            assert (await images_of(client))[mine]["digest"] == made.digest
        finally:
            await sb.stop()
    dsec("image", "rm", f"{project}/tools:v1", "--data-dir", str(DATA))


def build(c: DSecClient, spec: dict) -> tuple[list[str], dict]:
    """`POST /v1/images/builds` with `c`'s key: the log lines and the last answer."""
    r = httpx.post(f"{c.api_url}/v1/images/builds", json=spec, timeout=900,
                   headers={"Authorization": f"Bearer {c.api_key}"})
    if r.status_code != 200:
        return [], {"status": r.status_code, **r.json()}
    lines = [json.loads(l) for l in r.text.splitlines() if l.strip()]
    return [l["log"] for l in lines if "log" in l], lines[-1]


PROBE_STEP = ("hostname > /probe-hostname; ls /dev > /probe-dev; cat /proc/self/mountinfo > /probe-mounts; "
              "grep CapEff /proc/self/status > /probe-caps; tr '\\0' ' ' < /proc/1/cmdline > /probe-pid1")


async def test_a_build_step_runs_in_a_sandbox_not_on_the_host(client):
    """A `run` step is a tenant's program: it runs in a sandbox (its hostname, /dev, mounts,
    capabilities and agent), never as host root; builds write only the key's images."""
    import socket

    project, eve = await tenant(client, "eve")
    async with eve:
        _, refused = build(eve, {"name": "root/base:latest", "from": "root/base", "step": [{"run": "true"}]})
        assert refused["status"] == 403 and refused["code"] == "permission_denied", refused
        ref = f"{project}/probe:1"
        log, last = build(eve, {"name": ref, "from": "root/base", "step": [{"run": PROBE_STEP}]})
        assert last.get("image") == ref, (last, log[-20:])
        assert any(l.startswith("  (in sandbox ") for l in log), log
        sb = await eve.run_sandbox(DSecRunArgs(image=ref, ttl_seconds=120))
        try:
            got = {f: await sb.files.read_text(f"/probe-{f}") for f in ("hostname", "dev", "mounts", "caps", "pid1")}
        finally:
            await sb.stop()
        print(f"\nbuild step: hostname={got['hostname'].strip()!r} pid1={got['pid1'].strip()!r} "
              f"{got['caps'].strip()} /dev={got['dev'].split()}")
        assert got["hostname"].strip() != socket.gethostname(), "the step saw the host's hostname"
        host_disks = set(os.listdir("/sys/block"))
        assert not host_disks & set(got["dev"].split()), f"host block devices in the step's /dev: {got['dev']}"
        assert "mem" not in got["dev"].split() and "kvm" not in got["dev"].split()
        root = [l.split() for l in got["mounts"].splitlines() if l.split()[4] == "/"]
        assert root and root[-1][root[-1].index("-") + 1] == "overlay", got["mounts"]
        assert not int(got["caps"].split()[1], 16) & (1 << 21), "the step had CAP_SYS_ADMIN"
        assert got["pid1"].startswith("/.dsec/aether"), got["pid1"]

        # A failing step fails the build, says why, and tags nothing.
        log, last = build(eve, {"name": f"{project}/broken:1", "from": "root/base",
                                "step": [{"run": "echo about to fail; exit 7"}]})
        assert last["error"]["code"] == "failed_precondition" and "exited with 7" in last["error"]["message"], last
        assert "about to fail" in last["error"]["message"]
        assert f"{project}/broken:1" not in await images_of(eve)
    dsec("image", "rm", ref, "--data-dir", str(DATA))


# ---- 2. the network keeps sandboxes apart ------------------------------------------------


async def test_rules_cannot_open_other_sandboxes_the_node_or_metadata(lab, node: DSecClient):
    project, eve = await tenant(node, "eve")
    _, bob = await tenant(node, "bob")
    async with eve, bob:
        for rule, rng in [("10.200.0.0/16", "10.0.0.0/8"), ("169.254.169.254/32", "169.254.0.0/16"),
                          ("169.254.169.254:80", "169.254.0.0/16"), ("127.0.0.1", "127.0.0.0/8"),
                          ("192.168.0.0/16", "192.168.0.0/16")]:
            with pytest.raises(InvalidArgumentError) as e:
                await eve.run_sandbox(DSecRunArgs(**PY, network_rules={rule: True}))
            assert e.value.status == 400 and rng in e.value.message, e.value.message
        print(f"\nrule {rule} → 400: {e.value.message[:160]}")

        victim = await bob.run_sandbox(DSecRunArgs(**PY, network_rules={}))
        vaddr = victim.info.network["address"]
        await victim.exec_background(argv=["python3", "-c", SERVER])
        end = time.monotonic() + 15
        while (seen := await node_connect(lab, vaddr, 8000)) != "OK" and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert seen == "OK", f"the victim's server at {vaddr}:8000 is not up: {seen}"

        # Everything public is allowed: only the never-ranges stay closed.
        sb = await eve.run_sandbox(DSecRunArgs(**PY, network_rules={"0.0.0.0/0": True}))
        # A rule change at runtime is refused the same way and leaves the rules as they were.
        with pytest.raises(InvalidArgumentError):
            await sb.set_network_rules({"0.0.0.0/0": True, "10.200.0.0/16": True})
        gw = gateway(sb.info.network["address"])
        got = await probe_named(sb, 'tenant rules {"0.0.0.0/0": true}', {
            f"{PYPI_IP}:{HTTP_PORT} (public, allowed)": ("connect", PYPI_IP, HTTP_PORT),
            f"another project's sandbox {vaddr}:8000": ("connect", vaddr, 8000),
            f"GET http://{vaddr}:8000/": ("http", f"http://{vaddr}:8000/"),
            f"metadata {METADATA_IP}:80": ("connect", METADATA_IP, 80),
            f"node uplink {NODE_IP}:{HOST_PORT}": ("connect", NODE_IP, HOST_PORT),
            f"node API {API_IP}:{API_PORT}": ("connect", API_IP, API_PORT),
            f"own gateway {gw}:{HOST_PORT}": ("connect", gw, HOST_PORT),
        })
        assert got.pop(f"{PYPI_IP}:{HTTP_PORT} (public, allowed)") == "OK"
        for label, v in got.items():
            assert blocked(v), f"{label} got through: {v}"
        assert lab.host_connections() == [], "a sandbox reached the node's own service"


# ---- 3. the gateway gives nothing away ---------------------------------------------------


def until_served(get) -> httpx.Response:
    """The answer once the sandbox's server is up (the gateway says 502 until then)."""
    for _ in range(150):
        r = get()
        if r.status_code != 502:
            return r
        time.sleep(0.1)
    return get()


async def test_gateway_ports_want_credentials_unless_public(client):
    from test_e2b import E2B_VERSION, e2b_env, pip_pinned

    pip_pinned("e2b", E2B_VERSION)
    import e2b

    env = e2b_env()
    url = env["E2B_SANDBOX_URL"]
    _, eve = await tenant(client, "eve")
    _, bob = await tenant(client, "bob")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    async with eve, bob:
        sb = await eve.run_sandbox(DSecRunArgs(image="root/py:3.11", ttl_seconds=300))
        public = e2b.Sandbox.create("base", timeout=120)
        private = e2b.Sandbox.create("base", timeout=120, network={"allow_public_traffic": False})
        try:
            await sb.exec_background(argv=["python3", "-c", SERVER])
            host = f"8000-{sb.id}.localhost"
            # The attack: no key, no token, a native sandbox of another project.
            r = until_served(lambda: httpx.get(f"{url}/", headers={"Host": host}))
            print(f"\nkeyless GET of a native sandbox's port through the gateway: {r.status_code} {r.text[:200]}")
            assert r.status_code == 401, r.text
            # Another tenant's key, and a made-up one, get nowhere; the owner's key gets through.
            r = httpx.get(f"{url}/", headers={"Host": host, "X-API-Key": bob.api_key})
            assert r.status_code == 403, r.text
            r = httpx.get(f"{url}/", headers={"Host": host, "X-API-Key": "dsk." + "a" * 32})
            assert r.status_code == 401, r.text
            r = until_served(lambda: httpx.get(f"{url}/", headers={"Host": host, "X-API-Key": eve.api_key}))
            assert r.status_code == 200 and "Directory listing" in r.text, r.text

            for s in (public, private):
                s.commands.run(f"python3 -c \"{SERVER}\"", background=True, timeout=0)
            # E2B's default stays: a public sandbox's port answers anyone with the URL.
            r = until_served(lambda: httpx.get(f"{url}/", headers={"Host": public.get_host(8000)}))
            assert r.status_code == 200 and "Directory listing" in r.text, r.text
            phost = private.get_host(8000)
            assert httpx.get(f"{url}/", headers={"Host": phost}).status_code == 401
            assert httpx.get(f"{url}/", headers={"Host": phost, "E2B-Traffic-Access-Token": "x" * 40}).status_code == 403
            r = until_served(lambda: httpx.get(f"{url}/", headers={
                "Host": phost, "E2B-Traffic-Access-Token": private.traffic_access_token}))
            assert r.status_code == 200, r.text

            # A signed upload URL writes its own path and nothing else: a second part naming
            # another file is refused, and a part's filename does not move the write.
            up = public.upload_url("/tmp/signed.txt")
            r = httpx.post(up, files=[("file", ("signed.txt", b"ok")), ("file", ("/root/.bashrc", b"evil"))])
            assert r.status_code == 400 and "signed" in r.text, r.text
            r = httpx.post(up, files={"file": ("/root/.profile", b"moved?")})
            assert r.status_code == 200, r.text
            got = public.commands.run("cat /tmp/signed.txt; grep -c moved /root/.profile || true",
                                      user="root").stdout
            assert got == "moved?0\n", got
        finally:
            public.kill()
            private.kill()
            await sb.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
