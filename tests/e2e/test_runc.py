# SPDX-License-Identifier: AGPL-3.0-only
"""The same container backend driven by runc instead of crun (a second server on its own
port and data directory, sharing the image store)."""

import glob
import os
from pathlib import Path

import pytest

from conftest import DATA, dsec
from opendsec import DSecClient, DSecRunArgs

RUNC_DATA = Path(str(DATA) + "-runc")
RUNC_LISTEN = "127.0.0.1:7612"


@pytest.fixture(scope="module")
def runc_server():
    if not any(Path(p, "runc").exists() for p in ("/usr/sbin", "/usr/bin", "/usr/local/bin")):
        pytest.skip("runc is not installed")
    args = ("--data-dir", str(RUNC_DATA))
    dsec("down", *args, check=False)
    # The main test server already runs this machine's sandbox network (its nftables
    # table, address pool and DNS proxy port); a second node on the same host goes without.
    RUNC_DATA.mkdir(parents=True, exist_ok=True)
    (RUNC_DATA / "config.toml").write_text("[edge.network]\nenabled = false\n")
    dsec("up", *args, "--listen", RUNC_LISTEN, "--oci-runtime", "runc", "--image-store", str(DATA / "images"))
    yield
    dsec("down", *args)
    assert glob.glob(str(RUNC_DATA / "edge/sandboxes/*")) == []


async def test_runc_runs_limits_forks_and_cleans_up(runc_server):
    cfg = (RUNC_DATA / "client.toml").read_text()
    key = [l.split("=", 1)[1].strip().strip('"') for l in cfg.splitlines() if l.startswith("api_key")][0]
    async with DSecClient(api_url=f"http://{RUNC_LISTEN}", api_key=key) as c:
        st = await c.status()
        detail = st["nodes"][0]["backends"][0]["detail"]
        assert detail.startswith("runc"), detail
        sb = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", memory_limit_mb=64))
        try:
            assert (await sb.run_shell("python3 -c 'print(6*7)'")).stdout == "42\n"
            r = await sb.exec(["python3", "-c", "b = bytearray(200 << 20)"])
            assert r.exit_code == 137 and r.oom_killed
            r = await sb.run_shell("grep Seccomp: /proc/self/status; ls /proc | grep -cE '^[0-9]+$'")
            assert r.stdout.startswith("Seccomp:\t2") and int(r.stdout.split()[-1]) < 10
            forks = await sb.fork(count=2)
            for f in forks:
                await f.stop()
        finally:
            await sb.stop()
        assert await c.list_sandboxes() == []
    # Sandboxes' cgroups are dsec/<bucket>/<id>; the one-character buckets stay until shutdown.
    assert not [p for p in glob.glob("/sys/fs/cgroup/*/dsec/*") + glob.glob("/sys/fs/cgroup/*/dsec/*/*")
                if os.path.isdir(p) and len(os.path.basename(p)) > 1]
