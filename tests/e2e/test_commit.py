# SPDX-License-Identifier: AGPL-3.0-only
"""Commit ("pack"): a sandbox's filesystem changes become a new image. Files written,
changed and deleted in the sandbox (a whiteout), a directory replaced (an opaque
directory), owners, modes and symlinks all reach sandboxes started from the new image,
whichever backend made it and whichever runs it; env and workdir come from the base."""

import json
import os
import secrets
import shutil
import stat
import textwrap

import pytest

from conftest import DATA, dsec
from opendsec import AlreadyExistsError, DSecRunArgs, InvalidArgumentError

BASE = "root/commit-base:1"

# What the sandbox changes before the commit.
CHANGES = textwrap.dedent(
    """\
    set -e
    mkdir -p /root/proj
    printf 'hello\\n' > /root/proj/new.txt
    chown 1234:1234 /root/proj/new.txt
    printf '#!/bin/sh\\necho tool-ok\\n' > /usr/local/bin/tool
    chmod 0750 /usr/local/bin/tool
    ln -s /root/proj/new.txt /root/link
    rm /etc/commit-doomed
    rm -rf /opt/work/sub
    mkdir /opt/work/sub
    printf 'c\\n' > /opt/work/sub/c.txt
    printf 'changed\\n' > /opt/work/base-only.txt
    """
)

# What a sandbox of the committed image reports.
CHECK = textwrap.dedent(
    """\
    echo "new=$(cat /root/proj/new.txt)"
    echo "owner=$(stat -c %u:%g /root/proj/new.txt)"
    echo "tool=$(/usr/local/bin/tool) mode=$(stat -c %a /usr/local/bin/tool)"
    echo "link=$(readlink /root/link)"
    if [ -e /etc/commit-doomed ]; then echo doomed=present; else echo doomed=gone; fi
    echo "sub=$(ls -A /opt/work/sub | tr '\\n' ' ')"
    echo "base=$(cat /opt/work/base-only.txt)"
    echo "kept=$(cat /etc/commit-kept)"
    echo "env=$COMMIT_BASE_ENV"
    """
)

EXPECTED = [
    "new=hello",
    "owner=1234:1234",
    "tool=tool-ok mode=750",
    "link=/root/proj/new.txt",
    "doomed=gone",
    "sub=c.txt ",
    "base=changed",
    "kept=still here",
    "env=from-the-base",
]


@pytest.fixture(scope="module")
def commit_base(tmp_path_factory):
    """An image with env, a workdir, a file to delete and a directory to replace."""
    spec = tmp_path_factory.mktemp("spec") / "commit-base.toml"
    spec.write_text(
        textwrap.dedent(
            f"""\
            name = "{BASE}"
            from = "root/base:latest"
            workdir = "/opt/work"
            env = {{ COMMIT_BASE_ENV = "from-the-base" }}

            [[step]]
            file = "/etc/commit-doomed"
            content = "delete me\\n"

            [[step]]
            file = "/etc/commit-kept"
            content = "still here\\n"

            [[step]]
            file = "/opt/work/sub/a.txt"
            content = "a\\n"

            [[step]]
            file = "/opt/work/sub/b.txt"
            content = "b\\n"

            [[step]]
            file = "/opt/work/base-only.txt"
            content = "base\\n"
            """
        )
    )
    dsec("image", "build", str(spec), "--if-missing", "--data-dir", str(DATA), timeout=600)
    return BASE


def new_ref(what: str) -> str:
    return f"root/committed-{what}:t{secrets.token_hex(4)}"


def base_layers() -> list[str]:
    r = dsec("image", "inspect", BASE, "--data-dir", str(DATA), "--json")
    return json.loads(r.stdout)["manifest"]["layers"]


def check_layer(digest: str) -> None:
    """The sandbox's layer on disk: overlayfs whiteouts and opaque markers, nothing of the
    sandbox's own plumbing."""
    root = DATA / "images/layers" / digest
    wh = os.lstat(root / "etc/commit-doomed")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0, "no 0/0 whiteout for the deleted file"
    assert os.getxattr(root / "opt/work/sub", "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    assert sorted(os.listdir(root / "opt/work/sub")) == ["c.txt"]
    for runtime_made in (".dsec", "etc/hosts", "etc/resolv.conf"):
        assert not os.path.lexists(root / runtime_made), f"{runtime_made} is in the layer"
    names = [n for _, _, files in os.walk(root) for n in files]
    assert not any(n.startswith(".wh.") for n in names), names
    for d, _, _ in os.walk(root):
        attrs = os.listxattr(d, follow_symlinks=False)
        assert not [a for a in attrs if a.startswith("trusted.overlay.") and a != "trusted.overlay.opaque"], (d, attrs)


async def check_image(client, image: str, backend: str) -> None:
    sb = await client.run_sandbox(DSecRunArgs(image=image, backend=backend))
    try:
        r = await sb.run_shell(CHECK)
        assert r.exit_code == 0, r
        got, want = r.stdout.splitlines(), list(EXPECTED)
        if backend == "vm":
            # The vm backend does not give commands the image's env yet (its guest agent
            # gets none); the manifest's env is checked on its own.
            got = [x for x in got if not x.startswith("env=")]
            want = [x for x in want if not x.startswith("env=")]
        assert got == want, f"{backend} sandbox of {image}:\n{r.stdout}{r.stderr}"
        if backend == "container":
            # The agent runs in the image's workdir (commands default to /), so relative
            # file paths resolve there. A VM's agent is the guest's init, started in /.
            st = await sb.files.stat("base-only.txt")
            assert st["path"] == "/opt/work/base-only.txt", st
    finally:
        await sb.stop()


async def test_container_commit_makes_an_image_new_sandboxes_start_from(client, commit_base):
    sb = await client.run_sandbox(DSecRunArgs(image=commit_base, env={"ONLY_THIS_SANDBOX": "1"}))
    try:
        r = await sb.run_shell(CHANGES)
        assert r.exit_code == 0, r
        ref = new_ref("ctr")
        res = await sb.commit(ref)
        print(f"\ncommitted {sb.id} as {res.image}: {len(res.layers)} layers, "
              f"{res.size_bytes} bytes, paused {res.paused_ms} ms", flush=True)
        assert res.image == ref and len(res.digest) == 64
        assert res.layers[:-1] == base_layers() and len(res.layers) == len(base_layers()) + 1
        assert res.size_bytes > 0 and res.paused_ms >= 0
        check_layer(res.layers[-1])
        # The source keeps running, unfrozen.
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"

        # An existing name: refused (409) without overwrite, replaced with it.
        with pytest.raises(AlreadyExistsError) as ex:
            await sb.commit(ref)
        assert ex.value.status == 409 and "overwrite" in ex.value.message
        again = await sb.commit(ref, overwrite=True)
        assert again.image == ref and again.layers == res.layers

        # A bad reference: 400, saying what a good one looks like.
        for bad in ("Bad Ref", "noslash", "root/../etc:x", "root/x:"):
            with pytest.raises(InvalidArgumentError) as ex:
                await sb.commit(bad)
            assert ex.value.status == 400 and "ns/name" in ex.value.message, ex.value
    finally:
        await sb.stop()

    await check_image(client, ref, "container")
    # The manifest says where the image came from; the create-time env is not baked in.
    m = json.loads(dsec("image", "inspect", ref, "--data-dir", str(DATA), "--json").stdout)["manifest"]
    assert m["source"] == f"commit of a sandbox of project root (from {BASE})", m
    assert m["env"] == {"COMMIT_BASE_ENV": "from-the-base"} and m["workdir"] == "/opt/work", m


async def test_commit_cli_and_errors(client, commit_base):
    sb = await client.run_sandbox(DSecRunArgs(image=commit_base))
    try:
        help_text = dsec("commit", "--help").stdout
        assert "Example:" in help_text and "dsec commit local-" in help_text and "--overwrite" in help_text
        await sb.run_shell("echo cli > /root/cli.txt")
        ref = new_ref("cli")
        r = dsec("commit", sb.id, ref)
        assert r.stdout.strip() == ref and "layers" in r.stderr, r
        r = dsec("commit", sb.id, ref, check=False)
        assert r.returncode != 0 and "already_exists (409)" in r.stderr, r.stderr
        r = dsec("commit", sb.id, ref, "--overwrite", "--json")
        out = json.loads(r.stdout)
        assert out["image"] == ref and len(out["layers"]) == len(base_layers()) + 1, out
        r = dsec("commit", sb.id, "NOT a ref", check=False)
        assert r.returncode != 0 and "invalid_argument (400)" in r.stderr, r.stderr
        r = dsec("commit", "local-000000000000", new_ref("none"), check=False)
        assert r.returncode != 0 and "not_found (404)" in r.stderr, r.stderr
        # The body is checked like every other route's.
        status, body = await raw_post(client, f"/v1/sandboxes/{sb.id}/commit", {"image": ref, "bogus": 1})
        assert status == 400 and body["code"] == "invalid_argument", body
        status, body = await raw_post(client, f"/v1/sandboxes/{sb.id}/commit", None)
        assert status == 400 and body["code"] == "invalid_argument", body
    finally:
        await sb.stop()
    sb2 = await client.run_sandbox(DSecRunArgs(image=ref))
    try:
        assert (await sb2.exec(["cat", "/root/cli.txt"])).stdout == "cli\n"
    finally:
        await sb2.stop()


async def raw_post(client, path: str, body):
    # The SDK's transport, below its error handling: the raw status and body.
    r = await client._http.send("POST", path, json=body)
    return r.status_code, r.json()


@pytest.fixture
def need_qemu():
    if not shutil.which("qemu-system-x86_64"):
        print("\nskipping the vm commit test: qemu-system-x86_64 is not installed", flush=True)
        pytest.skip("qemu-system-x86_64 is not installed")


async def test_vm_commit_streams_the_guest_changes_into_an_image(client, commit_base, need_qemu):
    sb = await client.run_sandbox(DSecRunArgs(image=commit_base, backend="vm", memory_limit_mb=512))
    try:
        r = await sb.run_shell(CHANGES)
        assert r.exit_code == 0, r
        ref = new_ref("vm")
        res = await sb.commit(ref)
        print(f"\ncommitted vm {sb.id} as {res.image}: {res.size_bytes} bytes", flush=True)
        assert res.image == ref and res.paused_ms == 0
        assert res.layers[:-1] == base_layers()
        check_layer(res.layers[-1])
        assert (await sb.run_shell("echo alive")).stdout == "alive\n"
        with pytest.raises(AlreadyExistsError):
            await sb.commit(ref)
        with pytest.raises(InvalidArgumentError):
            await sb.commit("root/Bad:x")
    finally:
        await sb.stop()
    # The guest's overlayfs whiteouts and opaque markers hold for both consumers: a
    # container's overlay of the layers and a VM's root disk built from them.
    await check_image(client, ref, "container")
    await check_image(client, ref, "vm")
    m = json.loads(dsec("image", "inspect", ref, "--data-dir", str(DATA), "--json").stdout)["manifest"]
    assert m["source"] == f"commit of a sandbox of project root (from {BASE})", m
    assert m["env"] == {"COMMIT_BASE_ENV": "from-the-base"} and m["workdir"] == "/opt/work", m
