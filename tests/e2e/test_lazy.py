# SPDX-License-Identifier: AGPL-3.0-only
"""Lazy images through a real registry (Debian's `docker-registry` on loopback):
`dsec image push` sends an image's layers as EROFS images with chunk tables too; a pull
of it names the image at once, mounts its layers, and sandboxes read them while only the
chunks they touch are fetched. A registry that serves bytes other than the published
chunk tables say gives the sandbox an I/O error, never those bytes; `image rm` takes the
mounts and the cached chunks away."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import DATA, dsec, lazyfs_processes, node_config
from opendsec import DSecClient, DSecRunArgs
from test_pull import WORK, Layout, Registry, busybox

pytestmark = pytest.mark.skipif(
    not (shutil.which("docker-registry") and shutil.which("skopeo") and Path("/bin/busybox").exists()
         and Path("/dev/fuse").exists() and "erofs" in Path("/proc/filesystems").read_text()),
    reason="needs EROFS and FUSE, and Debian's docker-registry, skopeo and busybox-static",
)

STORE = DATA / "images"
CHUNK = 1 << 20
BIG = [(f"data/big{i}.bin", os.urandom(3 * CHUNK // 2)) for i in range(12)]
SMALL = [(f"data/small/{i}.txt", f"small file {i}\n".encode()) for i in range(200)]


def pull(*args: str, check: bool = True) -> dict | str:
    r = dsec("image", "pull", *args, "--plain-http", "--data-dir", str(DATA), "--json", check=check,
             timeout=300)
    return json.loads(r.stdout) if r.returncode == 0 else r.stderr


def push(image: str, dest: str, *extra: str) -> dict:
    return json.loads(dsec("image", "push", image, dest, "--plain-http", *extra, "--data-dir", str(DATA),
                           "--json", timeout=300).stdout)


def host_mounts() -> dict[str, str]:
    """Mount point -> file system type, in this (the host's) mount namespace."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        sep = f.index("-")
        out[f[4].encode().decode("unicode_escape")] = f[sep + 1]
    return out


def chunks_held(hexd: str) -> int:
    return sum(bin(b).count("1") for b in (STORE / "lazy" / hexd / "have").read_bytes())


def layers_of(reference: str) -> list[str]:
    listed = {i["reference"]: i for i in json.loads(dsec("image", "ls", "--data-dir", str(DATA), "--json").stdout)}
    return listed[reference]["manifest"]["layers"]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read(), dict(r.headers)


@pytest.fixture(scope="module")
def registry():
    r = Registry("lazy")
    layout = Layout(WORK / "layout-lazy")
    tools = busybox() + [("bin/sha256sum", "symlink", "busybox", 0o777),
                         ("bin/wc", "symlink", "busybox", 0o777)]
    base = layout.layer(tools, "gzip")
    files = [("data", "dir", None, 0o755), ("data/small", "dir", None, 0o755)]
    files += [(name, "file", data, 0o644) for name, data in BIG + SMALL]
    data = layout.layer(files, "gzip")
    desc = layout.image([base, data], ["PATH=/bin"])
    layout.tag(desc)
    r.push(layout.path, "team/src:v1")
    out = pull(f"{r.host}/team/src:v1", "--as", "root/lz-src:v1")
    assert out["lazy"] is False, out  # skopeo pushed no lazy layers: fetched whole
    yield r
    for ref in ("root/lz-src:v1", "root/lz-lazy:v1", "root/lz-whole:v1", "root/lz-forged:v1", "root/lz-again:v1",
                "root/lz-vm:v1"):
        dsec("image", "rm", ref, "--data-dir", str(DATA), check=False)
    r.stop()
    shutil.rmtree(layout.path, ignore_errors=True)


async def test_a_pushed_image_starts_lazily_and_reads_back_whole(client, registry):
    pushed = push("root/lz-src:v1", f"{registry.host}/team/lazy:v1")
    assert pushed["lazy_digest"].startswith("sha256:"), pushed
    # Listed under the referrers tag of the image's manifest (distribution 2.8 has no
    # referrers API).
    code, body, _ = http("GET", f"http://{registry.host}/v2/team/lazy/manifests/sha256-"
                                f"{pushed['digest'].split(':')[1]}",
                         headers={"Accept": "application/vnd.oci.image.index.v1+json"})
    assert code == 200 and pushed["lazy_digest"] in body.decode()

    out = pull(f"{registry.host}/team/lazy:v1", "--as", "root/lz-lazy:v1")
    assert out["lazy"] is True and out["layers"] == 2, out
    assert out["fetched_bytes"] < 64 << 10, out  # the config and two chunk tables
    layers = layers_of("root/lz-lazy:v1")
    mounts = host_mounts()
    for hexd in layers:
        assert mounts.get(str(STORE / "layers" / hexd)) == "erofs", hexd
        assert (STORE / "lazy" / hexd / "source.json").exists()
    data_layer = layers[1]
    total = len(json.loads((STORE / "lazy" / data_layer / "source.json").read_text())["table"]["chunks"])
    before = chunks_held(data_layer)

    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-lazy:v1"))
    try:
        r = await sb.run_shell("cat /data/small/7.txt; sha256sum /data/big3.bin")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "small file 7"
        assert lines[1].split()[0] == hashlib.sha256(BIG[3][1]).hexdigest()
        after_one = chunks_held(data_layer)
        # A 1.5 MiB file spans two or three chunks; the metadata and small files one more.
        assert after_one - before <= 4 and after_one < total // 2, (before, after_one, total)

        # Everything reads back as it was, and the sandbox writes over the lazy layer.
        r = await sb.run_shell("sha256sum /data/big*.bin | sort -k2; cat /data/small/*.txt | wc -l; "
                               "echo mine > /data/small/7.txt && cat /data/small/7.txt")
        assert r.exit_code == 0, r.stderr
        got = {line.split()[1]: line.split()[0] for line in r.stdout.splitlines()[:len(BIG)]}
        assert got == {"/" + n: hashlib.sha256(d).hexdigest() for n, d in BIG}
        assert r.stdout.splitlines()[len(BIG):] == [str(len(SMALL)), "mine"]
        assert chunks_held(data_layer) == total
    finally:
        await sb.stop()

    # A second sandbox of the image sees the layer as published, not the first's write.
    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-lazy:v1"))
    try:
        r = await sb.run_shell("cat /data/small/7.txt")
        assert r.stdout == "small file 7\n", r.stdout
    finally:
        await sb.stop()

    # --no-lazy: the same image fetched whole.
    whole = pull(f"{registry.host}/team/lazy:v1", "--as", "root/lz-whole:v1", "--no-lazy")
    assert whole["lazy"] is False and whole["fetched_layers"] + whole["cached_layers"] == 2, whole

    dsec("image", "rm", "root/lz-lazy:v1", "--data-dir", str(DATA))
    mounts = host_mounts()
    for hexd in layers:
        assert str(STORE / "layers" / hexd) not in mounts
        assert not (STORE / "lazy" / hexd).exists()
        assert not (STORE / "layers" / hexd).exists()


def upload_blob(host: str, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _, _, h = http("POST", f"http://{host}/v2/{repo}/blobs/uploads/", b"")
    loc = h["Location"]
    url = (loc if loc.startswith("http") else f"http://{host}{loc}")
    url += ("&" if "?" in url else "?") + f"digest={digest}"
    http("PUT", url, data, {"Content-Type": "application/octet-stream"})
    return digest


async def test_a_vm_of_a_lazy_image_boots_from_its_layers(client, registry):
    """A `vm` sandbox's root is the image's layers as EROFS disks: a lazy layer's disk is
    its file on the lazy file system, so the VM boots and runs having fetched only the
    chunks its guest read, and no copy of the layer is made. The suite's Debian image,
    pushed and pulled back lazily."""
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed")
    push("root/base", f"{registry.host}/team/base:v1")
    out = pull(f"{registry.host}/team/base:v1", "--as", "root/lz-vm:v1")
    assert out["lazy"] is True, out
    layers = layers_of("root/lz-vm:v1")
    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-vm:v1", backend="vm"))
    try:
        r = await sb.run_shell("cat /etc/os-release | head -1; sha256sum /usr/bin/env; "
                               "grep -c ' erofs ' /proc/mounts")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith('PRETTY_NAME="Debian'), r.stdout
        # The stage and each layer, every one an EROFS disk.
        assert int(r.stdout.splitlines()[2]) == 1 + len(layers), r.stdout
        qemu_args = " ".join(
            Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
            for p in os.listdir("/proc") if p.isdigit() and Path(f"/proc/{p}/cmdline").exists()
            and sb.id in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
        for hexd in layers:
            assert f"lazyfs/{hexd}," in qemu_args, f"layer {hexd} is not read from the lazy file system"
            assert not (STORE / "erofs" / f"{hexd}.img").exists(), "a lazy layer was copied for the VM"
        held = sum(chunks_held(h) for h in layers)
        total = sum(len(json.loads((STORE / "lazy" / h / "source.json").read_text())["table"]["chunks"])
                    for h in layers)
        print(f"\nvm of a lazy image: {held} of {total} chunks fetched by its first command", flush=True)
        assert held < total, "the VM's boot fetched every chunk of the image"
    finally:
        await sb.stop()
    # The same bytes as the image it was pushed from.
    ref = await client.run_sandbox(DSecRunArgs(image="root/base"))
    try:
        r2 = await ref.run_shell("sha256sum /usr/bin/env")
        assert r2.stdout == r.stdout.splitlines()[1] + "\n", (r.stdout, r2.stdout)
    finally:
        await ref.stop()


async def test_a_registry_serving_other_bytes_gives_io_errors_not_those_bytes(client, registry):
    pushed = push("root/lz-src:v1", f"{registry.host}/team/forged:v1")
    repo, host = "team/forged", registry.host
    _, body, _ = http("GET", f"http://{host}/v2/{repo}/manifests/{pushed['lazy_digest']}",
                      headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    art = json.loads(body)
    # The data layer as another blob (4 KiB of zeros more, so that this node registers
    # it afresh), and a chunk table that says chunk 5 is other bytes than the blob holds:
    # what a registry serving a forged blob looks like to a node that trusts the table.
    edesc, tdesc = art["layers"][2], art["layers"][3]
    _, eb, _ = http("GET", f"http://{host}/v2/{repo}/blobs/{edesc['digest']}")
    eb = eb + b"\0" * 4096
    chunks = [hashlib.sha256(eb[i:i + CHUNK]).hexdigest() for i in range(0, len(eb), CHUNK)]
    chunks[5] = hashlib.sha256(b"not what the blob holds").hexdigest()
    forged = json.dumps({"size": len(eb), "chunk_size": CHUNK, "chunks": chunks}).encode()
    art["layers"][2] = {**edesc, "digest": upload_blob(host, repo, eb), "size": len(eb)}
    art["layers"][3] = {**tdesc, "digest": upload_blob(host, repo, forged), "size": len(forged)}
    mbody = json.dumps(art).encode()
    mdigest = "sha256:" + hashlib.sha256(mbody).hexdigest()
    http("PUT", f"http://{host}/v2/{repo}/manifests/{mdigest}", mbody,
         {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
                            "size": len(mbody), "artifactType": "application/vnd.opendsec.erofs.v1"}]}
    http("PUT", f"http://{host}/v2/{repo}/manifests/sha256-{pushed['digest'].split(':')[1]}",
         json.dumps(index).encode(), {"Content-Type": "application/vnd.oci.image.index.v1+json"})

    out = pull(f"{host}/{repo}:v1", "--as", "root/lz-forged:v1")
    assert out["lazy"] is True, out
    data_layer = layers_of("root/lz-forged:v1")[1]
    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-forged:v1"))
    try:
        r = await sb.run_shell("for f in /data/big*.bin; do sha256sum $f || echo FAILED $f; done")
        want = {"/" + n: hashlib.sha256(d).hexdigest() for n, d in BIG}
        failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
        assert failed, r.stdout  # the forged chunk's file could not be read
        assert "Input/output error" in r.stderr or "I/O error" in r.stderr, r.stderr
        for line in r.stdout.splitlines():
            if not line.startswith("FAILED"):
                digest, name = line.split()
                assert want[name] == digest, line  # every file read is whole and right
    finally:
        await sb.stop()
    have = (STORE / "lazy" / data_layer / "have").read_bytes()
    assert not have[5 // 8] & (1 << (5 % 8)), "the forged chunk was kept"


async def test_a_lazy_image_starts_again_after_its_daemon_is_killed(client, registry):
    push("root/lz-src:v1", f"{registry.host}/team/again:v1")
    out = pull(f"{registry.host}/team/again:v1", "--as", "root/lz-again:v1")
    assert out["lazy"] is True, out
    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-again:v1"))
    await sb.stop()
    daemons = lazyfs_processes()
    assert len(daemons) == 1, daemons
    os.kill(daemons[0], signal.SIGKILL)
    deadline = time.time() + 10
    while Path(f"/proc/{daemons[0]}").exists() and time.time() < deadline:
        time.sleep(0.05)
    # The next sandbox of the image finds its layers mounted afresh from a new daemon.
    sb = await client.run_sandbox(DSecRunArgs(image="root/lz-again:v1"))
    try:
        r = await sb.run_shell("sha256sum /data/big5.bin; cat /data/small/3.txt")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split()[0] == hashlib.sha256(BIG[5][1]).hexdigest()
        assert r.stdout.splitlines()[1] == "small file 3"
    finally:
        await sb.stop()
    again = lazyfs_processes()
    assert len(again) == 1 and again != daemons, (daemons, again)


async def test_a_tenants_pull_is_lazy_only_from_registries_the_node_trusts(client, registry):
    """A lazy layer is an EROFS image whoever pushed it made, parsed by the node's
    kernel: a tenant's pull mounts one only from `[edge] lazy_registries`."""
    trusted = Registry("lazy-trusted")
    try:
        push("root/lz-src:v1", f"{registry.host}/team/tenant:v1")
        push("root/lz-src:v1", f"{trusted.host}/team/tenant:v1")
        hosts = json.dumps([registry.host, trusted.host])
        with node_config(f"[edge]\ninsecure_registries = {hosts}\npull_registries = {hosts}\n"
                         f"lazy_registries = {json.dumps([trusted.host])}\n"):
            project = f"root/lazy-{os.urandom(3).hex()}"
            async with DSecClient() as admin:
                await admin.create_project(project)
                k = await admin.create_key("tenant", project=project)
            async with DSecClient(api_key=k["key"]) as t:
                whole = await t.pull_image(f"{registry.host}/team/tenant:v1", target=f"{project}/whole:v1")
                assert whole["lazy"] is False, whole
                lazy = await t.pull_image(f"{trusted.host}/team/tenant:v1", target=f"{project}/lazy:v1")
                assert lazy["lazy"] is True, lazy
                for image in (f"{project}/whole:v1", f"{project}/lazy:v1"):
                    sb = await t.run_sandbox(DSecRunArgs(image=image))
                    try:
                        r = await sb.run_shell("sha256sum /data/big2.bin")
                        assert r.stdout.split()[0] == hashlib.sha256(BIG[2][1]).hexdigest(), (image, r)
                    finally:
                        await sb.stop()
                    await t.remove_image(image)
    finally:
        trusted.stop()
