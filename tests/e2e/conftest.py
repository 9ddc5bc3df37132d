# SPDX-License-Identifier: AGPL-3.0-only
"""End-to-end fixtures: one `dsec up` for the session (own data dir and port), images built
once and kept between runs, and leak checks that look at the host itself."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DSEC = os.environ.get("DSEC_BIN", str(ROOT / "target/debug/dsec"))
DATA = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test"))
LISTEN = os.environ.get("DSEC_TEST_LISTEN", "127.0.0.1:7611")

sys.path.insert(0, str(ROOT / "sdk/python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostclean  # noqa: E402

from opendsec import DSecClient, NotFoundError  # noqa: E402


def dsec(*args: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["DSEC_CONFIG"] = str(DATA / "client.toml")
    e.pop("DSEC_API_URL", None)
    e.pop("DSEC_API_KEY", None)
    if env:
        e.update(env)
    r = subprocess.run([DSEC, *args], capture_output=True, text=True, timeout=timeout, env=e)
    if check and r.returncode != 0:
        raise AssertionError(f"dsec {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def cgroup_mode() -> str:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "v2"
    return "hybrid" if Path("/sys/fs/cgroup/unified/cgroup.controllers").exists() else "v1"


def cgroup_rel(sandbox_id: str) -> str:
    """A sandbox's cgroup below each hierarchy's root: `dsec/<bucket>/<id>`, the bucket
    being the id's last character (as the edge's `cgroup::sandbox_cgroup_path`)."""
    last = sandbox_id[-1:].lower()
    return f"dsec/{last if last.isascii() and last.isalnum() else '_'}/{sandbox_id}"


def cgroup_file(controller: str, sandbox_id: str, name: str) -> Path:
    if cgroup_mode() == "v2":
        return Path("/sys/fs/cgroup") / cgroup_rel(sandbox_id) / name
    return Path("/sys/fs/cgroup") / controller / cgroup_rel(sandbox_id) / name


def leftovers(sandbox_id: str | None = None) -> list[str]:
    """Everything a sandbox (or any, with None) could leave on the host."""
    pat = sandbox_id or "*"
    out: list[str] = []
    # Sandboxes mount in a namespace of their own; the host's is checked too.
    for pid in ["self", *hostclean.mountns_holders(DATA)]:
        for mp in hostclean.mounts_under(DATA / "edge/sandboxes", pid):
            if sandbox_id is None or sandbox_id in mp:
                out.append(f"mount {mp}" + ("" if pid == "self" else " (sandboxes' namespace)"))
    cg = [p for d in ("dsec", "dsec/*") for root in ("/sys/fs/cgroup/*", "/sys/fs/cgroup")
          for p in glob.glob(f"{root}/{d}/{pat}") if sandbox_id or len(Path(p).name) > 1]
    out += [f"cgroup {p}" for p in cg if os.path.isdir(p)]
    out += [f"dir {p}" for p in glob.glob(str(DATA / "edge/sandboxes" / pat))]
    out += [f"runtime state {p}" for p in glob.glob(str(DATA / f"edge/runtime/*/dsec-{pat}"))]
    out += [f"in the node's /sys/fs/cgroup tmpfs: {p}" for p in cgroup_tmpfs_leftovers(pat)]
    return out


def cgroup_tmpfs_leftovers(pat: str) -> list[str]:
    """What is under the mounts of a v1 or hybrid node's /sys/fs/cgroup tmpfs for sandboxes
    `pat`: on hybrid hosts crun, with the unified mount hidden from it, once made a
    directory and a file there for each create that nothing removed. Seen through a bind of
    the tmpfs alone, in a mount namespace of its own (nothing is left mounted)."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return []
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount --bind /sys/fs/cgroup /mnt && cd /mnt && ls -d */dsec/{pat} */dsec/*/{pat} 2>/dev/null"],
                       capture_output=True, text=True)
    return r.stdout.split()


def aether_processes() -> list[int]:
    pids = []
    for p in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if Path(p).read_bytes().startswith(b"/.dsec/aether"):
                pids.append(int(p.split("/")[2]))
        except OSError:
            pass
    return pids


JS = ROOT / "tests/e2e/js"
# The npm release the JavaScript tests pin (js/package.json and package-lock.json say the same).
E2B_JS_VERSION = "2.51.0"


def build_images() -> None:
    """Everything the suite needs from outside, fetched here, in the host's network
    namespace: tests that run an edge inside a namespace of their own (the cluster, the
    network lab) have no route to a package registry."""
    # An image is built again when its spec or its files (images/<name>/) changed since it
    # was built into this image store (a kept test directory would otherwise test the old
    # image). The record lives in the store, which the nested harness shares with its guest.
    built = DATA / "images" / "built-specs.json"
    seen = json.loads(built.read_text()) if built.exists() else {}
    for spec in ("images/base.toml", "images/py-3.11.toml", "images/code-interpreter.toml"):
        h = hashlib.sha256((ROOT / spec).read_bytes())
        for f in sorted((ROOT / spec).with_suffix("").rglob("*")):  # images/<name>/, its files
            if f.is_file():
                h.update(f.read_bytes())
        fresh = seen.get(spec) == h.hexdigest()
        dsec("image", "build", str(ROOT / spec), *(["--if-missing"] if fresh else []),
             "--data-dir", str(DATA), timeout=1800)
        seen[spec] = h.hexdigest()
        built.write_text(json.dumps(seen))
    # The VM guest kernel (Debian's linux-image-cloud-amd64) and its initramfs.
    dsec("image", "vm-kernel", "--data-dir", str(DATA), timeout=1800)
    installed = JS / "node_modules/e2b/package.json"
    if shutil.which("npm") and (not installed.exists()
                                or json.loads(installed.read_text())["version"] != E2B_JS_VERSION
                                or not (JS / "node_modules/@e2b/code-interpreter/package.json").exists()
                                or not (JS / "node_modules/playwright-core/package.json").exists()):
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=JS,
                       check=True, timeout=600)


def server_up(extra: tuple[str, ...] = ()) -> None:
    dsec("up", "--data-dir", str(DATA), "--listen", LISTEN, *extra, timeout=120)


def server_down(*extra: str) -> None:
    dsec("down", "--data-dir", str(DATA), *extra, check=False, timeout=180)


@contextlib.contextmanager
def node_config(text: str):
    """The test server restarted with `text` as its <data-dir>/config.toml, and restarted
    without it after (for a module fixture)."""
    cfg = DATA / "config.toml"
    assert not cfg.exists(), f"{cfg} is the test's own; remove the stale one"
    server_down()
    cfg.write_text(text)
    try:
        server_up()
        yield
    finally:
        server_down()
        cfg.unlink(missing_ok=True)
        server_up()


async def pool_ready(c: DSecClient, pool: str) -> int:
    """How many members of warm pool `pool` are ready (from `dsec status`)."""
    pools = (await c.status())["nodes"][0].get("pools", [])
    return next(p["ready"] for p in pools if p["name"] == pool)


async def wait_pool(c: DSecClient, pool: str, n: int, timeout: float = 60) -> float:
    """Waits until pool `pool` has `n` members ready; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await pool_ready(c, pool) == n:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise AssertionError(f"pool {pool} did not fill: {await pool_ready(c, pool)} of {n} ready")


@pytest.fixture(scope="session", autouse=True)
def server():
    if os.geteuid() != 0:
        pytest.exit("the end-to-end tests create containers and need root", returncode=1)
    DATA.mkdir(parents=True, exist_ok=True)
    server_down()
    server_up()
    # After `up`: a spec's `run` steps execute in sandboxes of the running node.
    build_images()
    os.environ["DSEC_CONFIG"] = str(DATA / "client.toml")
    os.environ.pop("DSEC_API_URL", None)
    os.environ.pop("DSEC_API_KEY", None)
    yield
    server_down()
    left = leftovers()
    assert not left, f"left behind after the session: {left}"
    assert not aether_processes(), "sandbox processes outlived the server"
    assert not hostclean.mountns_holders(DATA), "the sandboxes' mount namespace outlived the server"
    # Lazy image layers and their file system go with the server (its daemon once they are).
    # (The store itself may be a mount: the nested harness shares the host's.)
    lazy_mounts = hostclean.mounts_under(DATA / "images/layers") + hostclean.mounts_under(DATA / "images/lazyfs")
    assert not lazy_mounts, f"lazy image layers stayed mounted: {lazy_mounts}"
    wait_for(lambda: not lazyfs_processes(), timeout=10)


def processes_where(pred) -> list[int]:
    """Pids of the processes whose argv (a list of bytes) `pred` takes."""
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = p.read_bytes().split(b"\0")
        except OSError:
            continue
        if pred(argv):
            out.append(int(p.parent.name))
    return out


def lazyfs_processes() -> list[int]:
    """`dsec lazyfs` daemons serving this suite's image store."""
    return processes_where(lambda argv: b"lazyfs" in argv and str(DATA / "images").encode() in argv)


@pytest.fixture
async def client():
    async with make_client("async") as c:
        yield c
        await stop_what_is_left(c)


def make_client(kind: str):
    """The async client, or (``sync``) the synchronous one behind the async interface
    (`sync_facade.py`), so that one test runs through either."""
    if kind == "sync":
        import sync_facade
        return sync_facade.client()
    return DSecClient()


async def stop_what_is_left(c) -> None:
    # Each test stops what it made; anything still listed here is a bug in the test or a
    # leak in the server.
    for s in await c.list_sandboxes():
        try:
            await (await c.get_sandbox(s.id)).stop()
        except NotFoundError:
            pass  # stopped meanwhile (a function call's sandbox goes after the call)


def wait_for(pred, timeout: float = 10.0, every: float = 0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return pred()
