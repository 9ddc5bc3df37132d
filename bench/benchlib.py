# SPDX-License-Identifier: AGPL-3.0-only
"""What the single-server benches share: the `dsec` binary, percentiles, a server of their
own (`dsec up` on a data dir, images built if missing) and where results go."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdk/python"))
DSEC = os.environ.get("DSEC_BIN", str(ROOT / "target/debug/dsec"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def lat_summary(lat_s: list[float]) -> dict:
    return {
        "count": len(lat_s),
        "p50_ms": round(pct(lat_s, 50) * 1000, 3),
        "p90_ms": round(pct(lat_s, 90) * 1000, 3),
        "p99_ms": round(pct(lat_s, 99) * 1000, 3),
        "mean_ms": round(statistics.mean(lat_s) * 1000, 3),
        "max_ms": round(max(lat_s) * 1000, 3),
    }


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def store_of(data: Path, image_store: str | None) -> Path:
    return Path(image_store) if image_store else data / "images"


def server_up(data: Path, listen: str, store: Path, *extra: str) -> tuple[str, str]:
    """Builds the images if missing, (re)starts `dsec up` on `data` and returns its API URL
    and key."""
    subprocess.run([DSEC, "down", "--data-dir", str(data)], capture_output=True)
    run([DSEC, "up", "--data-dir", str(data), "--listen", listen, *extra, "--image-store", str(store)])
    # After `up`: a spec's `run` steps execute in sandboxes of the running node.
    for spec in ("images/base.toml", "images/py-3.11.toml"):
        run([DSEC, "image", "build", str(ROOT / spec), "--if-missing", "--data-dir", str(data),
             "--store", str(store)])
    return credentials(data)


def credentials(data: Path) -> tuple[str, str]:
    """The API URL and key `dsec up` wrote to `<data>/client.toml`."""
    cfg = dict(l.split(" = ", 1) for l in (data / "client.toml").read_text().splitlines() if " = " in l)
    return json.loads(cfg["api_url"]), json.loads(cfg["api_key"])


def server_down(data: Path) -> None:
    run([DSEC, "down", "--data-dir", str(data)])


@contextlib.contextmanager
def configured_server(data: Path, listen: str, store: Path, config: str, *extra: str):
    """`server_up` with `config` as <data>/config.toml; yields the API URL and key, and
    stops the server and removes the file after."""
    cfg = data / "config.toml"
    cfg.write_text(config)
    try:
        yield server_up(data, listen, store, *extra)
    finally:
        try:
            server_down(data)
        finally:
            cfg.unlink(missing_ok=True)


async def pool_ready(c, pool: str) -> int:
    """Ready members of warm pool `pool` (0 if the node has no such pool); `c` is a
    `DSecClient`."""
    pools = (await c.status())["nodes"][0].get("pools", [])
    return next((p["ready"] for p in pools if p["name"] == pool), 0)


def proc_cpu(pid: int) -> float:
    """CPU seconds process `pid` and its waited-for children have used so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def write_result(bench: str, out: dict) -> Path:
    """Writes `out` (with the time added) to bench/results/<bench>-<unix time>.json (in
    the nested-KVM harness: to $NESTED_OUT, which it copies back to the host)."""
    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if os.environ.get("DSEC_NESTED"):
        out["nested"] = "KVM nested in an outer VM under TCG: timings mean little"
    res = Path(os.environ["NESTED_OUT"]) if os.environ.get("NESTED_OUT") else ROOT / "bench/results"
    res.mkdir(parents=True, exist_ok=True)
    path = res / f"{bench}-{int(time.time())}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    return path
