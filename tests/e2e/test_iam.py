# SPDX-License-Identifier: AGPL-3.0-only
"""IAM on one node: nested projects with delegated quotas, agent keys, exact quota
enforcement under concurrency, release on stop and on TTL, isolation between projects,
revocation, and state that survives a kill -9 of the server."""

import asyncio
import os
import signal

import pytest

from conftest import DATA, dsec, server_up, wait_for
import httpx

from opendsec import AuthenticationError, DSecClient, DSecRunArgs, NotFoundError, ResourceExhaustedError
from opendsec.errors import DSecError


def _uid() -> str:
    return os.urandom(3).hex()


async def _usage(admin: DSecClient, project: str) -> dict:
    return next(p for p in await admin.projects() if p["path"] == project)["usage"]


async def test_quota_is_exact_under_concurrency_and_released_on_stop(client):
    project = f"root/q-{_uid()}"
    await client.create_project(project, sandboxes=50)
    k = await client.create_key("rl-trainer", project=project, agent=True)
    async with DSecClient(api_key=k["key"]) as agent:
        made = await asyncio.gather(*(agent.run_sandbox(DSecRunArgs(image="root/base")) for _ in range(60)),
                                    return_exceptions=True)
        ok = [m for m in made if not isinstance(m, BaseException)]
        refused = [m for m in made if isinstance(m, BaseException)]
        try:
            assert len(ok) == 50, [repr(r) for r in refused if not isinstance(r, ResourceExhaustedError)]
            assert all(isinstance(r, ResourceExhaustedError) for r in refused), refused
            assert "quota" in refused[0].message and project in refused[0].message
            assert all(s.info.project == project for s in ok)
            assert (await _usage(client, project))["sandboxes"] == 50
        finally:
            await asyncio.gather(*(s.stop() for s in ok))
        assert (await _usage(client, project))["sandboxes"] == 0
        # Freed quota can be used again.
        again = await agent.run_sandbox(DSecRunArgs(image="root/base"))
        await again.stop()


async def test_nested_delegation_and_no_escalation(client):
    team = f"root/team-{_uid()}"
    await client.create_project(team, sandboxes=10, cpu_cores=4)
    k = await client.create_key("team-agent", project=team, agent=True)
    async with DSecClient(api_key=k["key"]) as agent:
        assert (await agent.whoami())["project"] == team
        # Sub-projects within its share; siblings cannot over-delegate.
        await agent.create_project(f"{team}/a", sandboxes=6)
        with pytest.raises(DSecError) as e:
            await agent.create_project(f"{team}/b", sandboxes=5)
        assert e.value.code == "permission_denied" and "delegated 6" in e.value.message
        await agent.create_project(f"{team}/b", sandboxes=4)
        with pytest.raises(DSecError) as e:
            await agent.create_project(f"{team}/b/deep", cpu_cores=5)
        assert e.value.code == "permission_denied"
        # It cannot raise its own quota, nor reach outside its project.
        with pytest.raises(DSecError) as e:
            await agent.set_quota(team, sandboxes=1000)
        assert e.value.code == "permission_denied"
        with pytest.raises(NotFoundError):
            await agent.create_project("root/elsewhere")
        with pytest.raises(NotFoundError):
            await agent.run_sandbox(DSecRunArgs(image="root/base", project="root"))
        assert {p["path"] for p in await agent.projects()} == {team, f"{team}/a", f"{team}/b"}
        # A key made in a sub-project is limited to it, and a child's usage counts upwards.
        k2 = await agent.create_key("sub-agent", project=f"{team}/b", agent=True)
        async with DSecClient(api_key=k2["key"]) as sub:
            sbs = [await sub.run_sandbox(DSecRunArgs(image="root/base", cpu_cores_limit=1)) for _ in range(4)]
            try:
                with pytest.raises(ResourceExhaustedError):
                    await sub.run_sandbox(DSecRunArgs(image="root/base", cpu_cores_limit=0.5))
                assert (await _usage(client, team))["cpu_cores"] == 4
                # The team's cpu quota (4) is used up by its sub-project.
                with pytest.raises(ResourceExhaustedError):
                    await agent.run_sandbox(DSecRunArgs(image="root/base", cpu_cores_limit=0.5, project=f"{team}/a"))
            finally:
                for s in sbs:
                    await s.stop()
        assert not [x for x in await agent.keys() if x["project"] == "root"], "an agent sees the admin's keys"


async def test_projects_cannot_see_each_others_sandboxes(client):
    a, b = f"root/a-{_uid()}", f"root/b-{_uid()}"
    await client.create_project(a)
    await client.create_project(b)
    ka, kb = (await client.create_key("a", project=a)), (await client.create_key("b", project=b))
    async with DSecClient(api_key=ka["key"]) as ca, DSecClient(api_key=kb["key"]) as cb:
        sa = await ca.run_sandbox(DSecRunArgs(image="root/base"))
        try:
            # 404, not 403: B cannot tell A's sandbox exists.
            with pytest.raises(NotFoundError):
                await cb.get_sandbox(sa.id)
            assert sa.id not in [s.id for s in await cb.list_sandboxes()]
            async with httpx.AsyncClient(base_url=cb.api_url,
                                         headers={"Authorization": f"Bearer {kb['key']}"}) as raw:
                for method, path, body in (("POST", f"/v1/sandboxes/{sa.id}/exec", {"cmd": "true"}),
                                           ("DELETE", f"/v1/sandboxes/{sa.id}", None),
                                           ("GET", f"/v1/sandboxes/{sa.id}/files?path=/etc/hostname", None),
                                           ("GET", f"/v1/sandboxes/{sa.id}/ports/80/", None)):
                    r = await raw.request(method, path, json=body)
                    assert r.status_code == 404 and r.json()["code"] == "not_found", (path, r.text)
            # The admin sees everything; A sees its own.
            assert sa.id in [s.id for s in await client.list_sandboxes()]
            assert (await ca.get_sandbox(sa.id)).info.project == a
            assert (await sa.run_shell("echo mine")).stdout == "mine\n"
        finally:
            await sa.stop()
        # A revoked key stops working at once.
        await client.revoke_key(kb["key_id"])
        with pytest.raises(AuthenticationError):
            await cb.list_sandboxes()


async def test_ttl_expiry_releases_quota_and_usage_survives_a_restart(client):
    p = f"root/ttl-{_uid()}"
    await client.create_project(p, sandboxes=2)
    short = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=2, project=p))
    kept = await client.run_sandbox(DSecRunArgs(image="root/base", project=p))
    with pytest.raises(ResourceExhaustedError):
        await client.run_sandbox(DSecRunArgs(image="root/base", project=p))
    await asyncio.sleep(3.5)
    assert (await _usage(client, p))["sandboxes"] == 1
    # kill -9 of the server: projects, keys and usage are all still there.
    pid = int((DATA / "dsec.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
    server_up()
    async with DSecClient() as admin:
        assert (await _usage(admin, p)) == {"sandboxes": 1, "cpu_cores": kept.info.limits["cpu_cores"],
                                             "memory_mb": kept.info.limits["memory_mb"],
                                             "disk_mb": kept.info.limits["disk_mb"]}
        again = await admin.run_sandbox(DSecRunArgs(image="root/base", project=p))
        for s in (again, await admin.get_sandbox(kept.id)):
            await s.stop()
        assert (await _usage(admin, p))["sandboxes"] == 0


async def test_snapshots_and_commits_count_against_the_disk_quota(client):
    """A project's disk quota holds its sandboxes' disks, its snapshots and its committed
    images: the snapshot or commit that would pass it is refused (and leaves nothing),
    deleting frees its share, a commit over an image counts once, and all of it survives
    a restart of the server."""
    p = f"root/disk-{_uid()}"
    await client.create_project(p, disk_mb=500)
    sb = await client.run_sandbox(DSecRunArgs(image="root/base", project=p, disk_limit_mb=256,
                                              memory_limit_mb=256))
    kept: list[str] = []
    try:
        assert (await _usage(client, p))["disk_mb"] == 256
        r = await sb.exec(argv=["sh", "-c", "head -c 100000000 /dev/urandom > /root/blob && sync"])
        assert r.exit_code == 0, r.stderr
        s1 = await sb.snapshot()
        kept.append(s1.id)
        held = (await _usage(client, p))["disk_mb"]
        assert 256 + 95 <= held <= 256 + 130, held
        s2 = await sb.snapshot()
        kept.append(s2.id)
        with pytest.raises(ResourceExhaustedError) as e:
            await sb.snapshot()
        assert "MiB of disk" in e.value.message and p in e.value.message, e.value.message
        assert len([x for x in await client.list_snapshots() if x.project == p]) == 2, "a refused snapshot was kept"
        # A commit is refused the same way, and no image appears.
        with pytest.raises(ResourceExhaustedError):
            await sb.commit(f"{p}/env:1")
        images = (await client._request("GET", "/v1/images"))["images"]
        assert not [i for i in images if i["reference"] == f"{p}/env:1"]
        await client.delete_snapshot(kept.pop(0))
        c1 = await sb.commit(f"{p}/env:1")
        after_commit = (await _usage(client, p))["disk_mb"]
        assert after_commit >= held + 95, (held, after_commit)
        # Committed again over the same name: still counted once.
        await sb.commit(f"{p}/env:1", overwrite=True)
        assert abs((await _usage(client, p))["disk_mb"] - after_commit) <= 5
        assert c1.image == f"{p}/env:1"
        # kill -9 and start again: what is kept is still held.
        pid = int((DATA / "dsec.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
        server_up()
        async with DSecClient() as admin:
            assert abs((await _usage(admin, p))["disk_mb"] - after_commit) <= 5
            await admin.delete_snapshot(kept.pop(0))
            await (await admin.get_sandbox(sb.id)).stop()
            left = (await _usage(admin, p))["disk_mb"]
            assert 95 <= left <= 130, left  # the image alone
    finally:
        async with DSecClient() as admin:
            for sid in kept:
                await admin.delete_snapshot(sid)
            try:
                await (await admin.get_sandbox(sb.id)).stop()
            except NotFoundError:
                pass


async def test_builds_hold_disk_in_the_images_project(client):
    """An image built on the node holds the bytes its build added in the image's project:
    the build that would pass the quota is refused before its name points at it."""
    import json

    p = f"root/bdisk-{_uid()}"
    await client.create_project(p, disk_mb=1)

    def build(name: str, size: int) -> dict:
        spec = {"name": name, "from": "root/base",
                "step": [{"file": "/blob", "content": "x" * size}]}
        r = httpx.post(f"{client.api_url}/v1/images/builds", json=spec, timeout=300,
                       headers={"Authorization": f"Bearer {client.api_key}"})
        assert r.status_code == 200, r.text
        return json.loads(r.text.splitlines()[-1])

    small = build(f"{p}/small:1", 100_000)
    assert small.get("image") == f"{p}/small:1", small
    assert (await _usage(client, p))["disk_mb"] == 1
    big = build(f"{p}/big:1", 2_000_000)
    assert big["error"]["code"] == "resource_exhausted", big
    assert "MiB of disk" in big["error"]["message"], big
    images = {i["reference"] for i in (await client._request("GET", "/v1/images"))["images"]}
    assert f"{p}/small:1" in images and f"{p}/big:1" not in images
    assert (await _usage(client, p))["disk_mb"] == 1
    for ref in (f"{p}/small:1",):
        dsec("image", "rm", ref, "--data-dir", str(DATA))


def test_cli_iam_commands():
    p = f"root/cli-{_uid()}"
    r = dsec("iam", "project-create", p, "--sandboxes", "3", "--cpus", "2")
    assert p in r.stdout and "0 / 3" in r.stdout
    r = dsec("iam", "key-create", "--project", p, "--name", "cli-agent", "--agent")
    key = r.stdout.strip()
    assert key.startswith("dsk.") and "only time" in r.stderr
    r = dsec("iam", "whoami", "--json", env={"DSEC_API_KEY": key, "DSEC_API_URL": "http://" + os.environ.get("DSEC_TEST_LISTEN", "127.0.0.1:7611")})
    assert f'"project": "{p}"' in r.stdout
    r = dsec("iam", "quota-set", p, "--sandboxes", "5")
    assert "0 / 5" in r.stdout
    r = dsec("iam", "key-ls")
    assert "cli-agent" in r.stdout and p in r.stdout
    assert p in dsec("iam", "project-ls").stdout
    r = dsec("iam", "project-create", "Root/Bad", check=False)
    assert r.returncode == 1 and "invalid_argument" in r.stderr
