# SPDX-License-Identifier: AGPL-3.0-only
"""Pulls from a real OCI registry: Debian's `docker-registry` (the CNCF distribution
server) on loopback, fed by Debian's `skopeo` from OCI layouts this file makes (several
layers, a whiteout and an opaque directory, gzip and zstd layers, a multi-arch index).
Then what a registry or a caller can get wrong: a missing tag, a wrong digest, bad
credentials, a manifest of too many layers, a damaged blob, a tenant pointing the node
at a registry it may not reach."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import DATA, DSEC, dsec, node_config, wait_for
from opendsec import DSecClient, DSecRunArgs, NotFoundError, PermissionDeniedError

pytestmark = pytest.mark.skipif(
    not (shutil.which("docker-registry") and shutil.which("skopeo") and shutil.which("zstd")
         and shutil.which("htpasswd") and Path("/bin/busybox").exists()),
    reason="needs Debian's docker-registry, skopeo, zstd, htpasswd and busybox-static (deploy/deps.sh installs them)",
)

WORK = DATA.parent / f"{DATA.name}-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """A `docker-registry` on loopback, its storage under WORK/<name>."""

    def __init__(self, name: str, htpasswd: str | None = None, tls: bool = False):
        self.dir = WORK / name
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "storage").mkdir(parents=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.scheme = "https" if tls else "http"
        auth = ""
        if htpasswd:
            (self.dir / "htpasswd").write_text(htpasswd)
            auth = f"auth:\n  htpasswd:\n    realm: test\n    path: {self.dir / 'htpasswd'}\n"
        tls_cfg = ""
        if tls:
            # A CA of the test's own, and the registry's certificate for 127.0.0.1 signed by it.
            d = self.dir
            run = lambda *a: subprocess.run(a, check=True, capture_output=True, cwd=d)  # noqa: E731
            run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
                "-keyout", "ca.key", "-out", "ca.pem")
            run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
                "-keyout", "tls.key", "-out", "tls.csr")
            (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
            run("openssl", "x509", "-req", "-in", "tls.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", "tls.pem")
            self.ca = d / "ca.pem"
            tls_cfg = f"  tls:\n    certificate: {d / 'tls.pem'}\n    key: {d / 'tls.key'}\n"
        (self.dir / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.dir / 'storage'}\n"
            f"http:\n  addr: {self.host}\n" + tls_cfg + auth)
        self.log = open(self.dir / "registry.log", "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.dir / "config.yml")],
                                     stdout=self.log, stderr=subprocess.STDOUT)

        def up() -> bool:
            try:
                ctx = None
                if tls:
                    import ssl
                    ctx = ssl.create_default_context(cafile=str(self.ca))
                urllib.request.urlopen(f"{self.scheme}://{self.host}/v2/", timeout=1, context=ctx)
                return True
            except urllib.error.HTTPError as e:
                return e.code == 401
            except OSError:
                return False
        wait_for(up, timeout=20)

    def push(self, layout: Path, ref: str, creds: str | None = None) -> None:
        cmd = ["skopeo", "copy", "--all", "--quiet", "--dest-tls-verify=false",
               "--preserve-digests", f"oci:{layout}:v1", f"docker://{self.host}/{ref}"]
        if creds:
            cmd[2:2] = ["--dest-creds", creds]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":", 1)[1]
        return self.dir / "storage/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def put_manifest(self, repo: str, tag: str, manifest: dict) -> None:
        body = json.dumps(manifest).encode()
        req = urllib.request.Request(f"http://{self.host}/v2/{repo}/manifests/{tag}", data=body, method="PUT",
                                     headers={"Content-Type": manifest["mediaType"]})
        urllib.request.urlopen(req, timeout=10)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def tar_of(entries: list[tuple]) -> bytes:
    """A tar of (name, kind, data/target, mode) entries, kind one of file, dir, symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, kind, data, mode in entries:
            ti = tarfile.TarInfo(name)
            ti.mode, ti.mtime = mode, 1_700_000_000
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                t.addfile(ti)
            elif kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, data
                t.addfile(ti)
            else:
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


class Layout:
    """An OCI image layout written by hand: blobs, image manifests and an index."""

    def __init__(self, path: Path):
        self.path = path
        shutil.rmtree(path, ignore_errors=True)
        (path / "blobs/sha256").mkdir(parents=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob(self, data: bytes, media_type: str, **extra) -> dict:
        d = hashlib.sha256(data).hexdigest()
        (self.path / "blobs/sha256" / d).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{d}", "size": len(data), **extra}

    def layer(self, entries: list[tuple], compression: str) -> tuple[dict, str]:
        raw = tar_of(entries)
        diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
        if compression == "gzip":
            data, mt = gzip.compress(raw, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip"
        else:
            data = subprocess.run(["zstd", "-q", "-c"], input=raw, capture_output=True, check=True).stdout
            mt = "application/vnd.oci.image.layer.v1.tar+zstd"
        return self.blob(data, mt), diff_id

    def image(self, layers: list[tuple[dict, str]], env: list[str], arch: str = "amd64") -> dict:
        config = {"architecture": arch, "os": "linux",
                  "config": {"Env": env, "WorkingDir": "/work"},
                  "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]}}
        cdesc = self.blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": cdesc, "layers": [l for l, _ in layers]}
        return self.blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json",
                         platform={"architecture": arch, "os": "linux"})

    def tag(self, desc: dict) -> None:
        d = {k: v for k, v in desc.items() if k != "platform"}
        d["annotations"] = {"org.opencontainers.image.ref.name": "v1"}
        (self.path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [d]}))


def busybox() -> list[tuple]:
    """A shell and the tools the checks use: Debian's static busybox, as small images
    (Alpine's) carry one."""
    tools = ["sh", "cat", "ls", "readlink", "pwd", "echo"]
    return ([("bin", "dir", None, 0o755), ("bin/busybox", "file", Path("/bin/busybox").read_bytes(), 0o755)]
            + [(f"bin/{t}", "symlink", "busybox", 0o777) for t in tools])


def env_image(layout: Layout) -> tuple[dict, dict]:
    """linux/amd64: a base layer (gzip), and one (zstd) that deletes a file (whiteout),
    replaces a directory's contents (opaque) and adds a file; linux/arm64: other
    content. Returns the index's descriptor and the amd64 manifest's."""
    base = layout.layer(busybox() + [
        ("work", "dir", None, 0o755),
        ("etc", "dir", None, 0o755), ("etc/env-name", "file", b"pulled-env\n", 0o644),
        ("opt", "dir", None, 0o755), ("opt/gone", "file", b"old\n", 0o644),
        ("opt/cache", "dir", None, 0o755), ("opt/cache/stale", "file", b"stale\n", 0o644),
        ("usr/local/bin/tool", "file", b"#!/bin/sh\necho tool-ran\n", 0o755),  # parents implicit
    ], "gzip")
    top = layout.layer([
        ("opt", "dir", None, 0o755), ("opt/.wh.gone", "file", b"", 0o644),
        ("opt/cache", "dir", None, 0o755), ("opt/cache/.wh..wh..opq", "file", b"", 0o644),
        ("opt/cache/fresh", "file", b"fresh\n", 0o644),
        ("opt/link", "symlink", "/etc/env-name", 0o777),
    ], "zstd")
    amd64 = layout.image([base, top], ["FOO=from-config", "PATH=/usr/local/bin:/usr/bin:/bin"])
    other = layout.layer([("etc", "dir", None, 0o755), ("etc/env-name", "file", b"arm64\n", 0o644)], "gzip")
    arm64 = layout.image([other], ["FOO=arm"], arch="arm64")
    index = layout.blob(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                                    "manifests": [arm64, amd64]}).encode(),
                        "application/vnd.oci.image.index.v1+json")
    layout.tag(index)
    return index, amd64


@pytest.fixture(scope="module", autouse=True)
def remove_images():
    """Removes the images this file made (named root/pt-*, and the bases builds pulled,
    <project>/from-*), and so their layers."""
    yield
    listed = json.loads(dsec("image", "ls", "--data-dir", str(DATA), "--json").stdout)
    for i in listed:
        if i["reference"].startswith("root/pt-") or "/from-" in i["reference"]:
            dsec("image", "rm", i["reference"], "--data-dir", str(DATA), check=False)


@pytest.fixture(scope="module")
def registry():
    r = Registry("plain")
    layout = Layout(WORK / "layout-env")
    index, amd64 = env_image(layout)
    r.push(layout.path, "team/env:v1")
    r.index, r.amd64, r.layout = index, amd64, layout
    yield r
    r.stop()
    shutil.rmtree(layout.path, ignore_errors=True)


def pull(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    return dsec("image", "pull", *args, "--data-dir", str(DATA), "--json", check=check, timeout=300, env=env)


def store_tmp() -> list[str]:
    return sorted(p.name for p in (DATA / "images/tmp").iterdir())


async def test_a_multi_arch_image_with_whiteouts_pulls_and_runs(client, registry):
    before = store_tmp()
    r = pull(f"{registry.host}/team/env:v1", "--plain-http", "--as", "root/pt-pulled-env:v1")
    out = json.loads(r.stdout)
    assert out["image"] == "root/pt-pulled-env:v1" and out["layers"] == 2, out
    assert out["source_digest"] == registry.amd64["digest"], out  # the amd64 manifest, not arm64
    sb = await client.run_sandbox(DSecRunArgs(image="root/pt-pulled-env:v1"))
    try:
        r = await sb.run_shell(
            "cat /etc/env-name; ls /opt; ls /opt/cache; readlink /opt/link; "
            "tool; echo FOO=$FOO; pwd")
        lines = r.stdout.split()
        assert lines == ["pulled-env", "cache", "link", "fresh", "/etc/env-name", "tool-ran",
                         "FOO=from-config", "/work"], r.stdout
    finally:
        await sb.stop()
    # A second pull fetches nothing: the layers are in the store by their blobs' digests.
    again = json.loads(pull(f"{registry.host}/team/env:v1", "--plain-http", "--as", "root/pt-pulled-env:v2").stdout)
    assert (again["fetched_layers"], again["cached_layers"]) == (0, 2), again
    assert again["digest"] == out["digest"]
    # By the index's digest: the same image.
    by_digest = json.loads(pull(f"{registry.host}/team/env@{registry.index['digest']}", "--plain-http",
                                "--as", "root/pt-pulled-env:v3").stdout)
    assert by_digest["digest"] == out["digest"]
    assert store_tmp() == before


@pytest.mark.parametrize("backend", ["container", "vm"])
async def test_an_image_lacking_its_working_directory_starts_in_it(client, registry, backend):
    """An image of busybox alone, whose config names a working directory (`/work`) it
    does not have: it starts in that directory, made for it, on both backends (a VM's
    agent used to refuse it, and the create waited for the agent until its timeout)."""
    if backend == "vm" and not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed")
    layout = Layout(WORK / "layout-bare")
    layout.tag(layout.image([layout.layer(busybox(), "gzip")], ["PATH=/bin"]))
    registry.push(layout.path, "team/bare:v1")
    pull(f"{registry.host}/team/bare:v1", "--plain-http", "--as", "root/pt-bare:v1")
    sb = await asyncio.wait_for(client.run_sandbox(DSecRunArgs(image="root/pt-bare:v1", backend=backend)), 120)
    try:
        r = await sb.run_shell("pwd; ls /")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split()[0] == "/work" and "work" in r.stdout.split()[1:], r.stdout
    finally:
        await sb.stop()
    shutil.rmtree(layout.path, ignore_errors=True)


def test_what_a_registry_or_a_caller_gets_wrong_is_a_clear_error_and_nothing_is_named(registry):
    before = store_tmp()
    cases = {
        "missing tag": (f"{registry.host}/team/env:nope", "not_found"),
        "missing repository": (f"{registry.host}/team/none:v1", "not_found"),
        "wrong digest": (f"{registry.host}/team/env@sha256:{'0' * 64}", "not_found"),
    }
    for what, (ref, code) in cases.items():
        r = pull(ref, "--plain-http", "--as", "root/pt-pull-never:v1", check=False)
        assert r.returncode != 0, what
        assert f"error ({code})" in r.stderr and "pulling" in r.stderr, (what, r.stderr)
    # A manifest of 1,000 layers (one blob named 1,000 times): refused before a blob is fetched.
    layer = registry.amd64  # any descriptor the registry has; its config is a real blob
    m = json.loads((registry.layout.path / "blobs/sha256" / registry.amd64["digest"][7:]).read_bytes())
    bomb = {**m, "layers": [m["layers"][0]] * 1000}
    registry.push(registry.layout.path, "team/bomb:v0")  # its blobs, linked in the repository
    registry.put_manifest("team/bomb", "v1", bomb)
    r = pull(f"{registry.host}/team/bomb:v1", "--plain-http", "--as", "root/pt-pull-never:v1", check=False)
    assert "error (failed_precondition)" in r.stderr and "1000 layers, over the limit" in r.stderr, r.stderr
    # One layer that says it is a petabyte: refused before it is fetched.
    huge = {**m, "layers": [{**m["layers"][0], "size": 10**15}]}
    registry.put_manifest("team/bomb", "v2", huge)
    r = pull(f"{registry.host}/team/bomb:v2", "--plain-http", "--as", "root/pt-pull-never:v1", check=False)
    assert "error (failed_precondition)" in r.stderr and "over the limit" in r.stderr, r.stderr
    assert layer
    # Not an image reference at all.
    r = pull("Not A Reference!", "--plain-http", check=False)
    assert r.returncode != 0 and "not an image reference" in r.stderr, r.stderr
    r = dsec("image", "ls", "--data-dir", str(DATA), "--json")
    assert "root/pt-pull-never:" not in r.stdout
    assert store_tmp() == before


def test_a_damaged_blob_is_refused_and_nothing_is_named():
    r = Registry("damaged")
    layout = Layout(WORK / "layout-damaged")
    try:
        big = os.urandom(200_000)
        layer = layout.layer([("data", "file", big, 0o644)], "gzip")
        desc = layout.image([layer], [])
        layout.tag({k: v for k, v in desc.items() if k != "platform"})
        r.push(layout.path, "team/damaged:v1")
        blob = r.blob_file(layer[0]["digest"])
        data = blob.read_bytes()
        blob.write_bytes(data[: len(data) // 2])  # truncated in the registry's storage
        before = store_tmp()
        p = pull(f"{r.host}/team/damaged:v1", "--plain-http", "--as", "root/pt-damaged:v1", check=False)
        assert p.returncode != 0
        assert "error (failed_precondition)" in p.stderr and "ended after" in p.stderr, p.stderr
        assert layer[0]["digest"] in p.stderr, p.stderr
        blob.write_bytes(data[:-10] + b"x" * 10)  # the right size, the wrong bytes
        p = pull(f"{r.host}/team/damaged:v1", "--plain-http", "--as", "root/pt-damaged:v1", check=False)
        assert "error (failed_precondition)" in p.stderr and "content sha256:" in p.stderr, p.stderr
        assert "root/pt-damaged" not in dsec("image", "ls", "--data-dir", str(DATA), "--json").stdout
        assert store_tmp() == before
    finally:
        r.stop()
        shutil.rmtree(layout.path, ignore_errors=True)


def test_credentials_are_checked_and_docker_config_is_read(tmp_path):
    hashed = subprocess.run(["htpasswd", "-nbB", "puller", "s3cret"], capture_output=True, text=True,
                            check=True).stdout.strip()
    r = Registry("auth", htpasswd=hashed + "\n")
    layout = Layout(WORK / "layout-auth")
    try:
        desc = layout.image([layout.layer([("hello", "file", b"hi\n", 0o644)], "gzip")], [])
        layout.tag({k: v for k, v in desc.items() if k != "platform"})
        r.push(layout.path, "team/private:v1", creds="puller:s3cret")
        ref = f"{r.host}/team/private:v1"
        p = pull(ref, "--plain-http", "--as", "root/pt-private:v1", check=False)
        assert "error (permission_denied)" in p.stderr and "credentials" in p.stderr, p.stderr
        p = dsec("image", "pull", ref, "--plain-http", "--as", "root/pt-private:v1", "--data-dir", str(DATA),
                 "--username", "puller", "--password-stdin", check=False)
        assert p.returncode != 0  # no password on stdin
        bad = subprocess.run([DSEC, "image", "pull", ref, "--plain-http", "--as",
                              "root/pt-private:v1", "--data-dir", str(DATA), "--username", "puller",
                              "--password-stdin"], input="wrong\n", capture_output=True, text=True, timeout=120,
                             env={**os.environ, "DSEC_CONFIG": str(DATA / "client.toml")})
        assert bad.returncode != 0 and "permission_denied" in bad.stderr, bad.stderr
        # Docker's config.json, as `docker login` writes it.
        (tmp_path / "config.json").write_text(json.dumps(
            {"auths": {r.host: {"auth": base64.b64encode(b"puller:s3cret").decode()}}}))
        ok = dsec("image", "pull", ref, "--plain-http", "--as", "root/pt-private:v1", "--data-dir", str(DATA),
                  "--json", env={"DOCKER_CONFIG": str(tmp_path)})
        assert json.loads(ok.stdout)["image"] == "root/pt-private:v1"
        # Pushed back under another name: refused without the credentials, then sent with
        # them, and pulled again with the same layers.
        dest = f"{r.host}/team/copy:v2"
        p = dsec("image", "push", "root/pt-private:v1", dest, "--plain-http", "--data-dir", str(DATA), check=False)
        assert p.returncode != 0 and "error (permission_denied)" in p.stderr, p.stderr
        pushed = json.loads(dsec("image", "push", "root/pt-private:v1", dest, "--plain-http", "--no-lazy",
                                 "--data-dir", str(DATA), "--json", env={"DOCKER_CONFIG": str(tmp_path)}).stdout)
        assert pushed["pushed_blobs"] == 2 and pushed["digest"].startswith("sha256:"), pushed
        again = json.loads(dsec("image", "push", "root/pt-private:v1", dest, "--plain-http", "--no-lazy",
                                "--data-dir", str(DATA), "--json", env={"DOCKER_CONFIG": str(tmp_path)}).stdout)
        assert (again["pushed_blobs"], again["skipped_blobs"], again["digest"]) == (0, 2, pushed["digest"])
        back = json.loads(dsec("image", "pull", dest, "--plain-http", "--as", "root/pt-copy:v1", "--data-dir",
                               str(DATA), "--json", env={"DOCKER_CONFIG": str(tmp_path)}).stdout)
        assert back["source_digest"] == pushed["digest"]
        listed = {i["reference"]: i for i in json.loads(dsec("image", "ls", "--data-dir", str(DATA), "--json").stdout)}
        assert listed["root/pt-copy:v1"]["manifest"]["layers"] == listed["root/pt-private:v1"]["manifest"]["layers"]
    finally:
        r.stop()
        shutil.rmtree(layout.path, ignore_errors=True)


async def test_a_tenant_cannot_point_the_node_at_a_registry_it_may_not_reach(client, registry):
    project = f"root/puller-{os.urandom(3).hex()}"
    await client.create_project(project)
    k = await client.create_key("tenant", project=project)
    async with DSecClient(api_key=k["key"]) as t:
        # The loopback registry is not one the node lets tenants pull from.
        with pytest.raises(PermissionDeniedError) as e:
            await t.pull_image(f"{registry.host}/team/env:v1", target=f"{project}/env:v1")
        assert "pull_registries" in e.value.message
        # Nor may it talk plain HTTP or bring its own CA, even to an allowed registry.
        with pytest.raises(PermissionDeniedError) as e:
            await t.pull_image("docker.io/library/busybox:latest", target=f"{project}/bb:v1", plain_http=True)
        assert "plain_http" in e.value.message
        # And it names images only in its own project.
        with pytest.raises(PermissionDeniedError) as e:
            await t.pull_image("busybox:latest", target="root/bb:v1")
        assert "belongs to project root" in e.value.message


def test_a_registry_over_tls_is_trusted_only_with_its_ca():
    r = Registry("tls", tls=True)
    layout = Layout(WORK / "layout-tls")
    try:
        # Content of its own each run, so that the store has not got the layer already.
        desc = layout.image([layout.layer([("hello", "file", os.urandom(64), 0o644)], "zstd")], [])
        layout.tag({k: v for k, v in desc.items() if k != "platform"})
        r.push(layout.path, "team/tls:v1")
        ref = f"{r.host}/team/tls:v1"
        # HTTPS by default; the registry's CA is nobody's the node trusts.
        p = pull(ref, "--as", "root/pt-tls:v1", check=False)
        assert p.returncode != 0 and "error (unavailable)" in p.stderr and "certificate" in p.stderr.lower(), p.stderr
        ok = json.loads(pull(ref, "--as", "root/pt-tls:v1", "--ca-cert", str(r.ca)).stdout)
        assert ok["image"] == "root/pt-tls:v1" and ok["fetched_layers"] == 1, ok
    finally:
        r.stop()
        shutil.rmtree(layout.path, ignore_errors=True)


async def test_import_and_export_round_trip_with_skopeo(client, registry, tmp_path):
    src = json.loads(pull(f"{registry.host}/team/env:v1", "--plain-http", "--as", "root/pt-rt-src:v1").stdout)
    # `docker save` format (which has no zstd), written by skopeo from an image of gzip
    # layers in the registry: imported, it runs.
    gz = Layout(tmp_path / "gz-layout")
    desc = gz.image([gz.layer(busybox(), "gzip"),
                     gz.layer([("etc", "dir", None, 0o755), ("etc/env-name", "file", b"pulled-env\n", 0o644),
                               ("opt", "dir", None, 0o755), ("opt/cache", "dir", None, 0o755),
                               ("opt/cache/fresh", "file", b"x", 0o644)], "gzip")],
                    ["FOO=from-config"])
    gz.tag({k: v for k, v in desc.items() if k != "platform"})
    registry.push(gz.path, "team/gz:v1")
    archive = tmp_path / "env.tar"
    p = subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false",
                        f"docker://{registry.host}/team/gz:v1", f"docker-archive:{archive}:team/gz:v1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    imp = json.loads(dsec("image", "import", str(archive), "--as", "root/pt-rt-saved:v1", "--data-dir", str(DATA),
                          "--json").stdout)
    sb = await client.run_sandbox(DSecRunArgs(image="root/pt-rt-saved:v1"))
    try:
        r = await sb.run_shell("cat /etc/env-name; ls /opt/cache; echo $FOO")
        assert r.stdout.split() == ["pulled-env", "fresh", "from-config"], r.stdout
    finally:
        await sb.stop()
    # Export, then import: the same image, digest and all.
    layout = tmp_path / "layout"
    dsec("image", "export", "root/pt-rt-src:v1", str(layout), "--data-dir", str(DATA))
    again = json.loads(dsec("image", "import", str(layout), "--as", "root/pt-rt-back:v1", "--data-dir", str(DATA),
                            "--json").stdout)
    assert again["digest"] == src["digest"], (again, src)
    # The layout is one skopeo reads: pushed to the registry and pulled back, the same layers.
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:v1",
                    f"docker://{registry.host}/team/roundtrip:v1"], check=True, capture_output=True, timeout=120)
    back = json.loads(pull(f"{registry.host}/team/roundtrip:v1", "--plain-http", "--as", "root/pt-rt-pulled:v1").stdout)
    listed = {i["reference"]: i for i in json.loads(dsec("image", "ls", "--data-dir", str(DATA), "--json").stdout)}
    layers = lambda ref: listed[ref]["manifest"]["layers"]  # noqa: E731
    assert layers("root/pt-rt-pulled:v1") == layers("root/pt-rt-src:v1")
    assert back["layers"] == imp["layers"] == 2


@pytest.fixture(scope="module")
def private_registry():
    """A registry on loopback that wants a login (puller:s3cret), holding one image."""
    hashed = subprocess.run(["htpasswd", "-nbB", "puller", "s3cret"], capture_output=True, text=True,
                            check=True).stdout.strip()
    r = Registry("private", htpasswd=hashed + "\n")
    layout = Layout(WORK / "layout-private")
    desc = layout.image([layout.layer([("hello", "file", b"hi\n", 0o644)], "gzip")], [])
    layout.tag({k: v for k, v in desc.items() if k != "platform"})
    r.push(layout.path, "team/private:v1", creds="puller:s3cret")
    yield r
    r.stop()
    shutil.rmtree(layout.path, ignore_errors=True)


@pytest.fixture(scope="module")
def insecure_node(registry, private_registry):
    """The test server restarted with the loopback registries as ones it talks plain HTTP
    to, and ones every project (the E2B gateway's root/e2b too) may pull from."""
    hosts = json.dumps([registry.host, private_registry.host])
    with node_config(f'[edge]\ninsecure_registries = {hosts}\npull_registries = {hosts}\n'):
        yield registry


async def test_a_build_from_a_registry_image_pulls_it_first(insecure_node, tmp_path):
    registry = insecure_node
    spec = tmp_path / "spec.toml"
    spec.write_text(f'name = "root/pt-built:v1"\nfrom = "{registry.host}/team/env:v1"\n'
                    '[[step]]\nrun = "echo built > /etc/built"\n')
    dsec("image", "build", str(spec), "--data-dir", str(DATA), timeout=300)
    async with DSecClient() as c:
        sb = await c.run_sandbox(DSecRunArgs(image="root/pt-built:v1"))
        try:
            r = await sb.run_shell("cat /etc/built /etc/env-name; echo $FOO; ls /opt/cache")
            assert r.stdout.split() == ["built", "pulled-env", "from-config", "fresh"], r.stdout
        finally:
            await sb.stop()
        # The base is the building project's, named after the reference.
        base = [i for i in await c.images() if i["reference"].startswith("root/from-")]
        assert any(i["manifest"]["source"].startswith(f"pull {registry.host}/team/env@") for i in base), base
        for i in base:
            dsec("image", "rm", i["reference"], "--data-dir", str(DATA), check=False)
        # A tenant's build may not pull from a registry the node keeps from tenants.
        project = f"root/pt-t{os.urandom(3).hex()}"
        await c.create_project(project)
        k = await c.create_key("builder", project=project)
    async with DSecClient(api_key=k["key"]) as t:
        r = await t._http.send("POST", "/v1/images/builds",
                               json={"name": f"{project}/x:v1", "from": "127.0.0.1:1/team/env:v1"})
    last = json.loads(r.text.strip().splitlines()[-1])
    assert last["error"]["code"] == "permission_denied" and "pull_registries" in last["error"]["message"], last


def test_an_e2b_template_from_a_registry_image_builds_and_runs(insecure_node, tmp_path):
    """E2B's `Template.from_dockerfile("FROM <registry image>…")`: the node pulls the image,
    builds the template on it, and its sandboxes run commands in /home/user (as root: E2B's
    default user `user` is another piece of work)."""
    import uuid

    from test_e2b import E2B_VERSION, e2b_env, pip_pinned

    registry = insecure_node
    layout = tmp_path / "base-layout"
    dsec("image", "export", "root/base", str(layout), "--data-dir", str(DATA))
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout}:latest",
                    f"docker://{registry.host}/team/debian:v1"], check=True, capture_output=True, timeout=300)
    pip_pinned("e2b", E2B_VERSION)
    import e2b
    from e2b import Template

    env = e2b_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    tag = uuid.uuid4().hex[:8]
    try:
        t = Template().from_dockerfile(f"FROM {registry.host}/team/debian:v1\nRUN echo from-registry > /mark\n")
        Template.build(t, f"reg{tag}:v1")
        sb = e2b.Sandbox.create(f"reg{tag}:v1")
        try:
            r = sb.commands.run("cat /mark; pwd")
            assert r.stdout == "from-registry\n/home/user\n", r.stdout
        finally:
            sb.kill()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def test_a_pull_holds_disk_in_its_projects_quota(insecure_node):
    """A pulled image holds its size in its project's disk quota before it is named: a
    project cannot fill the node's disk with pulls."""
    from opendsec import ResourceExhaustedError

    registry = insecure_node
    uid = os.urandom(3).hex()
    small, big = f"root/pt-small-{uid}", f"root/pt-big-{uid}"
    async with DSecClient() as c:
        await c.create_project(small, disk_mb=1)
        await c.create_project(big, disk_mb=200)
        ks = await c.create_key("s", project=small)
        kb = await c.create_key("b", project=big)
        async with DSecClient(api_key=ks["key"]) as t:
            with pytest.raises(ResourceExhaustedError) as e:
                await t.pull_image(f"{registry.host}/team/env:v1", target=f"{small}/env:v1")
            assert "quota" in e.value.message and small in e.value.message, e.value.message
            assert f"{small}/env:v1" not in [i["reference"] for i in await t.images()]
        async with DSecClient(api_key=kb["key"]) as t:
            done = await t.pull_image(f"{registry.host}/team/env:v1", target=f"{big}/env:v1")
            assert done["image"] == f"{big}/env:v1"
        usage = next(p for p in await c.projects() if p["path"] == big)["usage"]
        assert usage["disk_mb"] >= 1, usage
    for ref in (f"{big}/env:v1",):
        dsec("image", "rm", ref, "--data-dir", str(DATA), check=False)


async def test_a_projects_registry_login_is_sealed_used_and_no_other_projects(insecure_node, private_registry,
                                                                              tmp_path):
    """A project keeps a login for a private registry on the node; its pulls (and those of
    the projects inside it) use it. Another project neither sees it, nor pulls with it,
    nor changes or removes it; no answer and no file of the node holds the password."""
    r = private_registry
    ref = f"{r.host}/team/private:v1"
    uid = os.urandom(3).hex()
    a, b = f"root/pt-la-{uid}", f"root/pt-lb-{uid}"
    async with DSecClient() as c:
        for p in (a, f"{a}/sub", b):
            await c.create_project(p)
        ka, kb = await c.create_key("a", project=a), await c.create_key("b", project=b)
        async with DSecClient(api_key=ka["key"]) as ta, DSecClient(api_key=kb["key"]) as tb:
            try:
                with pytest.raises(PermissionDeniedError):
                    await ta.pull_image(ref, target=f"{a}/p:v1")
                await ta.set_registry_login(r.host, username="puller", password="wrong")
                with pytest.raises(PermissionDeniedError) as e:
                    await ta.pull_image(ref, target=f"{a}/p:v1")
                assert f"project {a} keeps" in e.value.message, e.value.message
                kept = await ta.set_registry_login(r.host, username="puller", password="s3cret")
                assert {k: kept[k] for k in ("project", "registry", "kind", "username")} == {
                    "project": a, "registry": r.host, "kind": "basic", "username": "puller"}, kept
                assert (await ta.pull_image(ref, target=f"{a}/p:v1"))["image"] == f"{a}/p:v1"
                assert (await ta.pull_image(ref, target=f"{a}/sub/p:v1"))["image"] == f"{a}/sub/p:v1"

                # Another project.
                assert await tb.registry_logins() == []
                with pytest.raises(PermissionDeniedError):
                    await tb.pull_image(ref, target=f"{b}/p:v1")
                with pytest.raises(PermissionDeniedError):
                    await tb.set_registry_login(r.host, username="puller", password="mine", project=a)
                with pytest.raises(PermissionDeniedError):
                    await tb.delete_registry_login(r.host, project=a)
                with pytest.raises(NotFoundError):
                    await tb.delete_registry_login(r.host)
                assert (await ta.pull_image(ref, target=f"{a}/p:v2"))["image"] == f"{a}/p:v2"

                # Nothing gives the password back.
                listed = await ta.registry_logins()
                assert [(x["project"], x["registry"]) for x in listed] == [(a, r.host)], listed
                assert "s3cret" not in json.dumps(listed) and "s3cret" not in json.dumps(await c.registry_logins())
                files = list((DATA / "images").glob("registry-credentials*"))
                assert files, "the logins are not kept in the image store"
                for f in files:
                    assert b"s3cret" not in f.read_bytes() and b"puller" not in f.read_bytes(), f
                    assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others"

                await ta.delete_registry_login(r.host)
                with pytest.raises(PermissionDeniedError):
                    await ta.pull_image(ref, target=f"{a}/p:v3")
            finally:
                for p in (a, b):
                    try:
                        await c.delete_registry_login(r.host, project=p)
                    except NotFoundError:
                        pass

    # The same from the node's CLI, for root; Docker's config.json (here none) comes first.
    env = {"DOCKER_CONFIG": str(tmp_path)}
    p = subprocess.run([DSEC, "image", "login", r.host, "--username", "puller", "--password-stdin",
                        "--data-dir", str(DATA)], input="s3cret\n", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "kept a basic login (user puller)" in p.stdout, p.stderr
    try:
        listed = json.loads(dsec("image", "logins", "--data-dir", str(DATA), "--json").stdout)
        assert [(x["project"], x["registry"]) for x in listed] == [("root", r.host)], listed
        done = json.loads(pull(ref, "--as", "root/pt-login:v1", env=env).stdout)
        assert done["image"] == "root/pt-login:v1"
    finally:
        dsec("image", "logout", r.host, "--data-dir", str(DATA), check=False)
    assert json.loads(dsec("image", "logins", "--data-dir", str(DATA), "--json").stdout) == []
    p = pull(ref, "--as", "root/pt-login:v2", check=False, env=env)
    assert p.returncode != 0 and "permission_denied" in p.stderr, p.stderr


async def test_removing_an_image_gives_its_quota_back_and_spares_what_a_snapshot_uses(insecure_node):
    """`remove_image` (and `dsec image rm` through the node) gives back the disk a pull
    held; a tenant removes only images of its own subtree; a snapshot of a sandbox keeps
    the image's layers, and restores from it still run once the image is gone."""
    registry = insecure_node
    uid = os.urandom(3).hex()
    mine, other = f"root/pt-rm-{uid}", f"root/pt-rmo-{uid}"
    async with DSecClient() as c:
        await c.create_project(mine, disk_mb=4096)  # a sandbox reserves 1 GiB
        await c.create_project(other)
        km, ko = await c.create_key("m", project=mine), await c.create_key("o", project=other)

        async def disk_mb() -> float:
            return next(p for p in await c.projects() if p["path"] == mine)["usage"]["disk_mb"]

        async with DSecClient(api_key=km["key"]) as t, DSecClient(api_key=ko["key"]) as o:
            await t.pull_image(f"{registry.host}/team/env:v1", target=f"{mine}/env:v1")
            held = await disk_mb()
            assert held >= 1, held
            # Another project's image does not exist for a tenant; a parent's is not its own.
            with pytest.raises(NotFoundError):
                await o.remove_image(f"{mine}/env:v1")
            with pytest.raises(PermissionDeniedError):
                await t.remove_image("root/base:latest")
            with pytest.raises(NotFoundError):
                await t.remove_image(f"{mine}/nothing:v1")
            assert f"{mine}/env:v1" in [i["reference"] for i in await t.images()]

            sb = await t.run_sandbox(DSecRunArgs(image=f"{mine}/env:v1", ttl_seconds=300))
            restored, snap = [], None
            try:
                await sb.run_shell("echo kept > /state")
                snap = await sb.snapshot()
                await sb.stop()
                done = await t.remove_image(f"{mine}/env:v1")
                assert done["removed"] and done["freed_layers"] == 0, done
                assert f"{mine}/env:v1" not in [i["reference"] for i in await t.images()]
                restored = await t.restore_snapshot(snap.id)
                r = await restored[0].run_shell("cat /state; ls /bin/busybox")
                assert r.stdout == "kept\n/bin/busybox\n", r
            finally:
                for x in restored:
                    await x.stop()
                await sb.stop()
                if snap is not None:
                    await t.delete_snapshot(snap.id)
            # Nothing of the project is left: the image's hold went with it.
            assert await disk_mb() == 0

    # Through the CLI, which goes through the running node: the quota comes back too.
    async with DSecClient(api_key=km["key"]) as t:
        await t.pull_image(f"{registry.host}/team/env:v1", target=f"{mine}/env:v2")
    async with DSecClient() as c:
        assert await disk_mb() >= 1
        out = json.loads(dsec("image", "rm", f"{mine}/env:v2", "--data-dir", str(DATA), "--json").stdout)
        # (its layers may stay: other images of this file share them)
        assert out["removed"] and out["image"] == f"{mine}/env:v2", out
        assert await disk_mb() == 0
