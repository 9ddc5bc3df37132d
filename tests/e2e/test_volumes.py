# SPDX-License-Identifier: AGPL-3.0-only
"""Volumes: file systems the node keeps apart from sandboxes, mounted by many at once.

1. A volume outlives the sandboxes that wrote it and a restart of the node; two sandboxes
   share it (one read-only: its writes fail); the volume file API sees what sandboxes
   wrote and the reverse; a delete waits until no sandbox mounts it and leaves nothing.
2. Attacks on the node through the volume file API: links a sandbox planted (absolute, up
   and out, to `/`), `..` in paths, chmod through a link: nothing outside the volume is
   read, written or changed; a FIFO is refused at once (it would hold a node thread), a
   deep tree is removed.
3. Tenants: another project's volume is invisible (list, get, files, delete, mount by id
   or name all 404); bad mount paths are refused with 400.
4. Limits: a volume's size counts against its project's disk quota (a second one past it
   is 429) and a sandbox cannot write more than the volume holds (ENOSPC in the
   sandbox, the node's disk untouched)."""

from __future__ import annotations

import asyncio
import glob
import hashlib
import os
from pathlib import Path

import pytest

from conftest import DATA, leftovers, processes_where, server_down, server_up
from opendsec import (
    DSecClient,
    DSecRunArgs,
    InvalidArgumentError,
    NotFoundError,
    PreconditionError,
    ResourceExhaustedError,
)


async def tenant(admin: DSecClient, name: str, **quota) -> tuple[str, DSecClient]:
    project = f"root/{name}-{os.urandom(3).hex()}"
    await admin.create_project(project, sandboxes=10, **quota)
    k = await admin.create_key(f"{name}-agent", project=project, agent=True)
    return project, DSecClient(api_url=admin.api_url, api_key=k["key"])


def loop_devices_of(vid: str) -> list[str]:
    """Loop devices whose backing file is volume `vid`'s disk."""
    out = []
    for f in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            if vid in Path(f).read_text():
                out.append(f)
        except OSError:
            pass
    return out


async def test_a_volume_outlives_sandboxes_and_restarts_and_is_shared(client):
    vol = await client.create_volume(f"shared-{os.urandom(3).hex()}", size_mb=64)
    vid = vol["id"]
    assert vol["size_mb"] == 64 and vol["project"] == "root"
    try:
        a = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300,
                                                 volumes={"/mnt/data": vol["name"]}))
        b = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300,
                                                 volumes={"/data": {"volume": vid, "read_only": True}}))
        assert a.info.volumes == [{"volume": vid, "path": "/mnt/data"}], a.info.volumes
        r = await a.run_shell("echo from-a > /mnt/data/a.txt && mkdir -p /mnt/data/d && id -u")
        assert r.exit_code == 0, r.stderr
        r = await b.run_shell("cat /data/a.txt")
        assert r.stdout == "from-a\n", r
        # Read-only: the kernel refuses the write.
        r = await b.run_shell("echo x > /data/b.txt")
        assert r.exit_code != 0 and "Read-only file system" in r.stderr, r
        # The node's file API sees the sandbox's file, and the sandbox sees the API's.
        files = client.volume(vid)
        assert await files.read("/a.txt") == b"from-a\n"
        await files.write("d/from-api.txt", b"hello", mode=0o600, uid=1000, gid=1000)
        r = await a.run_shell("cat /mnt/data/d/from-api.txt; stat -c '%u %g %a' /mnt/data/d/from-api.txt")
        assert r.stdout == "hello1000 1000 600\n", r
        names = [e["path"] for e in await files.list("/", depth=2)]
        assert names == ["/a.txt", "/d", "/d/from-api.txt"], names
        assert (await client.get_volume(vid))["used_bytes"] > 0

        # Mounted: a delete is refused and names who mounts it.
        with pytest.raises(PreconditionError) as e:
            await client.delete_volume(vid)
        assert a.id in e.value.message or b.id in e.value.message, e.value.message
        await a.stop()
        await b.stop()

        # The node restarts: the volume and its files are still there.
        server_down()
        server_up()
        async with DSecClient() as again:
            assert vid in [v["id"] for v in await again.volumes()]
            assert await again.volume(vid).read("a.txt") == b"from-a\n"
            c = await again.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=120,
                                                    volumes={"/srv/v": vid}))
            try:
                r = await c.run_shell("cat /srv/v/a.txt /srv/v/d/from-api.txt")
                assert r.stdout == "from-a\nhello", r
            finally:
                await c.stop()
            await again.delete_volume(vid)
            with pytest.raises(NotFoundError):
                await again.get_volume(vid)
            vid = ""
    finally:
        if vid:
            async with DSecClient() as c2:
                for s in await c2.list_sandboxes():
                    await (await c2.get_sandbox(s.id)).stop()
                await c2.delete_volume(vid)
    assert not (DATA / "edge/volumes" / vol["id"]).exists()
    assert not loop_devices_of(vol["id"]), "the volume's loop device outlived it"


async def test_the_volume_file_api_never_leaves_the_volume(client):
    shadow = Path("/etc/shadow")
    before = (hashlib.sha256(shadow.read_bytes()).hexdigest(), shadow.stat().st_mode)
    vol = await client.create_volume(f"links-{os.urandom(3).hex()}", size_mb=32)
    try:
        sb = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300,
                                                  volumes={"/v": vol["id"]}))
        try:
            # The attack: links a sandbox plants for the node to follow.
            r = await sb.run_shell(
                "cd /v && ln -s /etc/shadow shadow && ln -s ../../../../../../etc up"
                " && ln -s / root && mkdir sub && ln -s ../../.. sub/out && mkfifo pipe"
                " && d=/v/deep && for i in $(seq 600); do d=$d/d; done && mkdir -p $d && echo ok")
            assert r.stdout == "ok\n", r
        finally:
            await sb.stop()
        files = client.volume(vol["id"])
        for path in ("shadow", "up/shadow", "root/etc/shadow", "sub/out/etc/shadow",
                     "../../../../etc/shadow", "/../etc/passwd"):
            with pytest.raises(NotFoundError):
                await files.read(path)
        # Writes through the links land inside the volume or nowhere.
        for path in ("up/pwned-by-volume", "root/tmp/pwned-by-volume", "sub/out/tmp/pwned-by-volume"):
            try:
                await files.write(path, b"x")
            except NotFoundError:
                pass
        assert not Path("/etc/pwned-by-volume").exists()
        assert not Path("/tmp/pwned-by-volume").exists()
        # A FIFO would hold the node's thread waiting for a peer: refused at once.
        for op in (files.read("pipe"), files.write("pipe", b"x")):
            with pytest.raises(InvalidArgumentError) as e:
                await asyncio.wait_for(op, 10)
            assert "not a regular file" in e.value.message, e.value.message
        # A deep tree goes without the node recursing through it.
        await files.remove("deep")
        assert "deep" not in [e["name"] for e in await files.list("/")]
        # chmod and chown through a link to the host's file.
        with pytest.raises(NotFoundError):
            await files.update("shadow", mode=0o777, uid=1000)
        # A remove of a link removes the link.
        await files.remove("root")
        assert Path("/etc/passwd").exists()
        after = (hashlib.sha256(shadow.read_bytes()).hexdigest(), shadow.stat().st_mode)
        assert after == before, "the host's /etc/shadow changed"
        with pytest.raises(InvalidArgumentError):
            await files.remove("/")
        link = await files.stat("shadow")
        assert link["type"] == "symlink" and link["target"] == "/etc/shadow", link
    finally:
        await client.delete_volume(vol["id"])


async def test_another_projects_volume_does_not_exist_for_a_tenant(client):
    _, eve = await tenant(client, "eve")
    bob_project, bob = await tenant(client, "bob")
    async with eve, bob:
        secret = await eve.create_volume("secret", size_mb=16)
        try:
            await eve.volume(secret["id"]).write("key.txt", b"eve's")
            assert [v["id"] for v in await bob.volumes()] == []
            with pytest.raises(NotFoundError):
                await bob.get_volume(secret["id"])
            with pytest.raises(NotFoundError):
                await bob.volume(secret["id"]).read("key.txt")
            with pytest.raises(NotFoundError):
                await bob.volume(secret["id"]).write("key.txt", b"bob's")
            with pytest.raises(NotFoundError):
                await bob.delete_volume(secret["id"])
            for ref in (secret["id"], "secret"):
                with pytest.raises(NotFoundError):
                    await bob.run_sandbox(DSecRunArgs(image="root/base", volumes={"/mnt": ref}))
            assert await eve.volume(secret["id"]).read("key.txt") == b"eve's"
            # Bob's own volume of the same name is his, and eve's stays hers.
            mine = await bob.create_volume("secret", size_mb=16)
            assert mine["project"] == bob_project and mine["id"] != secret["id"]
            await bob.delete_volume(mine["id"])
            # Mount paths that are not a place of the sandbox's own.
            for path in ("/", "relative", "/proc/x", "/dev", "/a/../etc", "/.dsec/x"):
                with pytest.raises(InvalidArgumentError) as e:
                    await eve.run_sandbox(DSecRunArgs(image="root/base", volumes={path: "secret"}))
                assert "mount path" in e.value.message, e.value.message
            with pytest.raises(InvalidArgumentError):
                await eve.create_volume("Bad Name")
            assert await eve.list_sandboxes() == []
        finally:
            await eve.delete_volume(secret["id"])


async def test_a_volume_counts_against_disk_quota_and_cannot_overflow(client):
    project, t = await tenant(client, "quota", disk_mb=300)
    async with t:
        v = await t.create_volume("small", size_mb=32)
        try:
            with pytest.raises(ResourceExhaustedError):
                await t.create_volume("big", size_mb=280)
            usage = next(p for p in await client.projects() if p["path"] == project)["usage"]
            assert usage["disk_mb"] >= 32, usage
            sb = await t.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300, disk_limit_mb=64,
                                                 volumes={"/v": "small"}))
            try:
                r = await sb.run_shell("dd if=/dev/zero of=/v/fill bs=1M count=64 2>&1; echo rc=$?")
                assert "No space left on device" in r.stdout, r
                assert "rc=0" not in r.stdout, r
            finally:
                await sb.stop()
        finally:
            await t.delete_volume(v["id"])
        usage = next(p for p in await client.projects() if p["path"] == project)["usage"]
        assert usage.get("disk_mb", 0) == 0, usage


def test_the_cli_makes_fills_reads_and_removes_a_volume(tmp_path):
    import json

    from conftest import dsec

    name = f"cli-{os.urandom(3).hex()}"
    vid = dsec("volume", "create", name, "--size", "32").stdout.strip()
    try:
        src = tmp_path / "in.bin"
        src.write_bytes(os.urandom(3 << 20))
        put = json.loads(dsec("volume", "put", vid, str(src), "/d/in.bin", "--json").stdout)
        assert (put["path"], put["size"]) == ("/d/in.bin", 3 << 20), put
        out = tmp_path / "out.bin"
        dsec("volume", "get", vid, "/d/in.bin", "--out", str(out))
        assert out.read_bytes() == src.read_bytes()
        listed = json.loads(dsec("volume", "files", vid, "/", "--depth", "2", "--json").stdout)
        assert [e["path"] for e in listed] == ["/d", "/d/in.bin"], listed
        table = dsec("volume", "ls").stdout
        assert vid in table and name in table, table
        r = dsec("run", "--rm", "-v", f"{name}:/mnt/v:ro", "root/base", "--", "sh", "-c",
                 "wc -c < /mnt/v/d/in.bin; touch /mnt/v/x", check=False)
        assert r.stdout.strip().startswith(str(3 << 20)), r
        assert "Read-only file system" in r.stdout + r.stderr, r
    finally:
        dsec("volume", "rm", vid)
    assert vid not in dsec("volume", "ls").stdout


def virtiofsd_processes(sandbox_id: str) -> list[int]:
    """virtiofsd daemons serving sandbox `sandbox_id`'s volumes."""
    return processes_where(lambda argv: argv[0].endswith(b"virtiofsd")
                           and any(sandbox_id.encode() in a for a in argv))


async def test_a_vm_mounts_volumes_shared_with_containers(client):
    """A vm sandbox mounts volumes (virtio-fs): it sees what a container and the file API
    wrote and the reverse; a read-only mount stays read-only when the guest's root remounts
    it; only `user.*` extended attributes pass; a VM that mounts volumes cannot be forked or
    paused to disk (409, saying why) but pauses in place; its daemons and binds go with it,
    and it goes when one of its daemons dies."""
    rw = await client.create_volume(f"vmrw-{os.urandom(3).hex()}", size_mb=64)
    ro = await client.create_volume(f"vmro-{os.urandom(3).hex()}", size_mb=64)
    try:
        await client.volume(ro["id"]).write("keep.txt", b"read me")
        c = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=300,
                                                 volumes={"/mnt/data": rw["id"]}))
        vm = await client.run_sandbox(DSecRunArgs(
            image="root/py:3.11", backend="vm", ttl_seconds=300,
            volumes={"/mnt/data": rw["id"], "/srv/ro": {"volume": ro["id"], "read_only": True}}))
        try:
            assert len(virtiofsd_processes(vm.id)) >= 2, "one virtiofsd per volume"
            r = await c.run_shell("echo from-container > /mnt/data/c.txt")
            assert r.exit_code == 0, r.stderr
            r = await vm.run_shell("cat /mnt/data/c.txt /srv/ro/keep.txt; echo; "
                                   "echo from-vm > /mnt/data/v.txt && chown 1000:1000 /mnt/data/v.txt")
            assert r.exit_code == 0 and r.stdout == "from-container\nread me\n", r
            r = await c.run_shell("cat /mnt/data/v.txt; stat -c '%u %g' /mnt/data/v.txt")
            assert r.stdout == "from-vm\n1000 1000\n", r
            assert await client.volume(rw["id"]).read("v.txt") == b"from-vm\n"

            # Read-only from the node's side: the guest's root cannot remount it writable.
            r = await vm.run_shell("echo x > /srv/ro/w.txt")
            assert r.exit_code != 0 and "Read-only file system" in r.stderr, r
            r = await vm.run_shell("mount -o remount,rw /srv/ro; echo x > /srv/ro/w.txt")
            assert r.exit_code != 0, r
            assert "w.txt" not in [e["path"] for e in await client.volume(ro["id"]).list("/")]

            # user.* attributes pass; trusted.* and security.* are refused.
            r = await vm.run_shell(
                "cd /mnt/data && python3 -c \"import os; os.setxattr('v.txt', 'user.k', b'v'); "
                "print(os.getxattr('v.txt', 'user.k').decode())\"")
            assert r.stdout == "v\n", r
            for name in ("trusted.overlay.opaque", "security.selinux"):
                r = await vm.run_shell(
                    f"cd /mnt/data && python3 -c \"import os; os.setxattr('v.txt', '{name}', b'y')\"")
                assert r.exit_code != 0 and "PermissionError" in r.stderr, (name, r)

            # Saving the VM is refused, saying why; a pause in place works.
            with pytest.raises(PreconditionError) as e:
                await vm.fork(count=1)
            assert "mounts volumes" in e.value.message, e.value.message
            with pytest.raises(PreconditionError) as e:
                await vm.pause(to_disk=True)
            assert "mounts volumes" in e.value.message, e.value.message
            await vm.pause()
            await vm.resume()
            r = await vm.run_shell("cat /mnt/data/v.txt")
            assert r.stdout == "from-vm\n", r

            with pytest.raises(PreconditionError):
                await client.delete_volume(ro["id"])
            # Nor is it paused to disk at its timeout (that would end it, files and all).
            with pytest.raises(InvalidArgumentError) as e:
                await client.run_sandbox(DSecRunArgs(image="root/base", backend="vm", on_timeout="pause_to_disk",
                                                     volumes={"/mnt/data": rw["id"]}))
            assert "paused to disk" in e.value.message, e.value.message

            # A volume's daemon that dies takes the VM with it (its mount would only fail).
            os.kill(virtiofsd_processes(vm.id)[0], 9)
            for _ in range(60):
                if vm.id not in {x.id for x in await client.list_sandboxes()}:
                    break
                await asyncio.sleep(0.5)
            assert vm.id not in {x.id for x in await client.list_sandboxes()}
        finally:
            await vm.stop()
            await c.stop()
        assert virtiofsd_processes(vm.id) == []
        assert leftovers(vm.id) == []
    finally:
        for v in (rw, ro):
            await client.delete_volume(v["id"])
