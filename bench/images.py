#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""Lazy start of a large image against a full pull, on a cold node, from one local
registry (Debian's `docker-registry` on loopback) in the same run.

The image: a small base (busybox) and a layer of `--mib` MiB in many files (`--files`
files of mixed sizes and as many small ones), gzip. It is pushed by skopeo, then:

1. full: `dsec image pull --no-lazy` (fetch every blob, check it, unpack it), create a
   sandbox, first exec: the floor.
2. `dsec image push` of that image to another repository (its lazy layers: EROFS images
   and chunk tables), then the image and its layers removed from the node (cold again).
3. lazy: `dsec image pull` (finds the lazy layers, mounts them), create a sandbox, first
   exec; the bytes fetched by then (chunk tables, config, and the chunks read); then a
   read of one large file, and of the whole tree, with the bytes fetched after each.

    python3 bench/images.py --mib 2048 [--prefetch]

JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import io
import json
import os
import random
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

from benchlib import DSEC, run, server_down, server_up, store_of, write_result  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402

CHUNK = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    def __init__(self, d: Path):
        self.dir = d
        shutil.rmtree(d, ignore_errors=True)
        (d / "storage").mkdir(parents=True)
        self.host = f"127.0.0.1:{free_port()}"
        (d / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {d / 'storage'}\nhttp:\n  addr: {self.host}\n")
        self.log = open(d / "registry.log", "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                break
            except OSError:
                if time.time() - t0 > 20:
                    raise SystemExit("the registry did not start")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Layout:
    def __init__(self, path: Path):
        self.path = path
        shutil.rmtree(path, ignore_errors=True)
        (path / "blobs/sha256").mkdir(parents=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')

    def blob_file(self, src: Path, media_type: str) -> dict:
        h = hashlib.sha256()
        with open(src, "rb") as f:
            while b := f.read(1 << 20):
                h.update(b)
        d = h.hexdigest()
        src.rename(self.path / "blobs/sha256" / d)
        return {"mediaType": media_type, "digest": f"sha256:{d}", "size": (self.path / "blobs/sha256" / d).stat().st_size}

    def blob(self, data: bytes, media_type: str) -> dict:
        tmp = self.path / "tmp-blob"
        tmp.write_bytes(data)
        return self.blob_file(tmp, media_type)

    def layer(self, fill) -> tuple[dict, str]:
        """A gzip layer that `fill(tarfile)` writes; returns its descriptor and diff_id."""
        tmp = self.path / "tmp-layer"
        raw = hashlib.sha256()

        class Tee(io.RawIOBase):
            def __init__(self, out):
                self.out = out

            def write(self, b):
                raw.update(b)
                return self.out.write(b)

            def writable(self):
                return True

        with open(tmp, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1, mtime=0) as gz:
            with tarfile.open(fileobj=Tee(gz), mode="w|", format=tarfile.PAX_FORMAT) as t:
                fill(t)
        return self.blob_file(tmp, "application/vnd.oci.image.layer.v1.tar+gzip"), "sha256:" + raw.hexdigest()

    def image(self, layers: list[tuple[dict, str]]) -> None:
        config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                  "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]}}
        cdesc = self.blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": cdesc, "layers": [l for l, _ in layers]}
        m = self.blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
        m["annotations"] = {"org.opencontainers.image.ref.name": "v1"}
        (self.path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [m]}))


def add(t: tarfile.TarFile, name: str, data: bytes | None = None, mode: int = 0o644, link: str | None = None):
    ti = tarfile.TarInfo(name)
    ti.mtime, ti.mode = 1_700_000_000, mode
    if link is not None:
        ti.type, ti.linkname = tarfile.SYMTYPE, link
        t.addfile(ti)
    elif data is None:
        ti.type = tarfile.DIRTYPE
        t.addfile(ti)
    else:
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))


def make_image(layout: Layout, mib: int, files: int) -> dict:
    def base(t):
        add(t, "bin", mode=0o755)
        add(t, "bin/busybox", Path("/bin/busybox").read_bytes(), 0o755)
        for tool in ("sh", "cat", "ls", "sha256sum", "find", "wc", "echo", "head", "xargs"):
            add(t, f"bin/{tool}", link="busybox", mode=0o777)

    rnd = random.Random(7)
    # Compressible like real files (gzip -1 about halves it): random runs and repeats.
    pool = os.urandom(8 << 20)
    sizes = [rnd.randint(1, 2 * mib * CHUNK // files) for _ in range(files)]
    scale = mib * CHUNK / sum(sizes)
    sizes = [max(1, int(s * scale)) for s in sizes]

    def data(t):
        add(t, "app", mode=0o755)
        add(t, "app/entry.sh", b"#!/bin/sh\necho ready\n", 0o755)
        for d in range(files // 100 + 1):
            add(t, f"app/d{d}", mode=0o755)
        for i, n in enumerate(sizes):
            off = rnd.randrange(0, len(pool) - min(n, len(pool) // 2))
            half = (pool[off:off + n // 2] * 2)[: n // 2]
            add(t, f"app/d{i // 100}/f{i}.bin", (half + pool[off:off + n - len(half)])[:n])
            add(t, f"app/d{i // 100}/s{i}.txt", f"small file {i}\n".encode())

    b = layout.layer(base)
    d = layout.layer(data)
    layout.image([b, d])
    return {"files": 2 * files + 2, "bytes": sum(sizes)}


def dsec(args: list[str], data: Path, store: Path) -> dict:
    r = run([DSEC, *args, "--data-dir", str(data), "--store", str(store), "--json"], timeout=3600)
    return json.loads(r.stdout)


def chunks_held(store: Path, layers: list[str]) -> int:
    n = 0
    for layer in layers:
        have = store / "lazy" / layer / "have"
        if have.exists():
            n += sum(bin(b).count("1") for b in have.read_bytes())
    return n


async def first_exec(url: str, key: str, image: str) -> tuple[float, float, object]:
    """Seconds to create a sandbox of `image`, then to its first exec's answer."""
    c = DSecClient(url, key)
    t0 = time.perf_counter()
    sb = await c.run_sandbox(DSecRunArgs(image=image))
    t1 = time.perf_counter()
    r = await sb.run_shell("/app/entry.sh")
    t2 = time.perf_counter()
    assert r.stdout.strip() == "ready", r
    return t1 - t0, t2 - t1, (c, sb)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048, help="size of the large layer's files (MiB)")
    ap.add_argument("--files", type=int, default=3000, help="large files (as many small ones again)")
    ap.add_argument("--data", default="/var/tmp/dsec-bench-images")
    ap.add_argument("--listen", default="127.0.0.1:7689")
    ap.add_argument("--image-store", default=None)
    ap.add_argument("--prefetch", action="store_true",
                    help="[edge] lazy_prefetch: fetch the rest of a layer in the background after its first read")
    a = ap.parse_args()
    data = Path(a.data)
    store = store_of(data, a.image_store)
    work = data.parent / f"{data.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = data / "config.toml"
    data.mkdir(parents=True, exist_ok=True)
    if a.prefetch:
        cfg.write_text("[edge]\nlazy_prefetch = true\n")
    else:
        cfg.unlink(missing_ok=True)
    url, key = server_up(data, a.listen, store)
    out_prefetch = a.prefetch
    reg = Registry(work / "registry")
    out: dict = {"mib": a.mib, "prefetch": out_prefetch}
    try:
        t0 = time.perf_counter()
        layout = Layout(work / "layout")
        out["image"] = make_image(layout, a.mib, a.files)
        out["layout_bytes"] = sum(p.stat().st_size for p in (layout.path / "blobs/sha256").iterdir())
        run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{layout.path}:v1",
             f"docker://{reg.host}/bench/src:v1"], timeout=3600)
        print(f"image made and pushed by skopeo in {time.perf_counter() - t0:.1f} s "
              f"({out['layout_bytes'] / 2**20:.0f} MiB of blobs)")
        shutil.rmtree(layout.path, ignore_errors=True)

        # 1. Full pull, create, first exec; both from a cold page cache.
        run(["sync"])
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        t0 = time.perf_counter()
        full = dsec(["image", "pull", f"{reg.host}/bench/src:v1", "--plain-http", "--no-lazy",
                     "--as", "root/bench-img-src:v1"], data, store)
        pull_s = time.perf_counter() - t0
        create_s, exec_s, (c, sb) = await first_exec(url, key, "root/bench-img-src:v1")
        await sb.stop()
        await c.close()
        out["full"] = {"pull_s": round(pull_s, 3), "create_s": round(create_s, 3), "exec_s": round(exec_s, 3),
                       "first_exec_s": round(pull_s + create_s + exec_s, 3),
                       "fetched_bytes": full["fetched_bytes"]}
        print(f"full pull: {pull_s:.2f} s ({full['fetched_bytes'] / 2**20:.0f} MiB fetched), create "
              f"{create_s * 1000:.0f} ms, first exec {exec_s * 1000:.0f} ms")

        # 2. Its lazy layers, then a cold node again.
        t0 = time.perf_counter()
        pushed = dsec(["image", "push", "root/bench-img-src:v1", f"{reg.host}/bench/lazy:v1", "--plain-http"],
                      data, store)
        out["push_s"] = round(time.perf_counter() - t0, 3)
        print(f"push with lazy layers: {out['push_s']:.1f} s ({pushed['pushed_bytes'] / 2**20:.0f} MiB sent)")
        dsec(["image", "rm", "root/bench-img-src:v1"], data, store)
        run(["sync"])
        Path("/proc/sys/vm/drop_caches").write_text("1\n")

        # 3. Lazy pull, create, first exec.
        t0 = time.perf_counter()
        lazy = dsec(["image", "pull", f"{reg.host}/bench/lazy:v1", "--plain-http", "--as",
                     "root/bench-img-lazy:v1"], data, store)
        pull_s = time.perf_counter() - t0
        assert lazy["lazy"], lazy
        listed = {i["reference"]: i for i in dsec(["image", "ls"], data, store)}
        layers = listed["root/bench-img-lazy:v1"]["manifest"]["layers"]
        total = sum(len(json.loads((store / "lazy" / l / "source.json").read_text())["table"]["chunks"])
                    for l in layers)
        at_pull = chunks_held(store, layers)
        create_s, exec_s, (c, sb) = await first_exec(url, key, "root/bench-img-lazy:v1")
        at_exec = chunks_held(store, layers)
        first = pull_s + create_s + exec_s
        out["lazy"] = {"pull_s": round(pull_s, 3), "create_s": round(create_s, 3), "exec_s": round(exec_s, 3),
                       "first_exec_s": round(first, 3),
                       "pull_fetched_bytes": lazy["fetched_bytes"],
                       "chunks_at_pull": at_pull, "chunks_at_first_exec": at_exec, "chunks_total": total,
                       "fetched_at_first_exec_bytes": lazy["fetched_bytes"] + at_exec * CHUNK}
        print(f"lazy pull: {pull_s:.2f} s, create {create_s * 1000:.0f} ms, first exec {exec_s * 1000:.0f} ms; "
              f"fetched by then: {out['lazy']['fetched_at_first_exec_bytes'] / 2**20:.1f} MiB "
              f"({at_exec} of {total} chunks)")
        t0 = time.perf_counter()
        r = await sb.run_shell("sha256sum /app/d7/f700.bin")
        one = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = await sb.run_shell("find /app -type f | xargs cat | wc -c")
        whole = time.perf_counter() - t0
        assert r.exit_code == 0, r
        out["lazy"]["one_file_s"] = round(one, 3)
        out["lazy"]["whole_tree_read_s"] = round(whole, 3)
        out["lazy"]["chunks_after_whole_read"] = chunks_held(store, layers)
        await sb.stop()
        await c.close()
        ratio = first / out["full"]["first_exec_s"]
        out["lazy_over_full"] = round(ratio, 4)
        print(f"\ncold node, {a.mib} MiB image of {out['image']['files']} files:")
        print(f"  time to first exec: lazy {first:.2f} s vs full pull {out['full']['first_exec_s']:.2f} s "
              f"= {ratio:.3f} (target < 0.25)")
        print(f"  then one file {one * 1000:.0f} ms; reading the whole tree {whole:.1f} s "
              f"({out['lazy']['chunks_after_whole_read']} of {total} chunks)")
        dsec(["image", "rm", "root/bench-img-lazy:v1"], data, store)
    finally:
        reg.stop()
        server_down(data)
        cfg.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    write_result("images", out)


if __name__ == "__main__":
    asyncio.run(main())
