#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""Create-to-first-exec latency and throughput of OpenDsec container sandboxes, against the
floor: a plain OCI runtime run of the same image (same overlay of the same layers, the
runtime's default namespaces) in the same run.

    python3 bench/create_latency.py -n 200 -c 16
Prints p50/p90/p99 and sandboxes per second for both, where the server's side of a create
went (from its log: admit, reserve, record, network, backend, agent), and writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import DSEC, pct, run, server_down, server_up, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402


def summary(lat_s: list[float], wall_s: float, failures: int) -> dict:
    return {
        "count": len(lat_s),
        "failures": failures,
        "p50_ms": round(pct(lat_s, 50) * 1000, 1),
        "p90_ms": round(pct(lat_s, 90) * 1000, 1),
        "p99_ms": round(pct(lat_s, 99) * 1000, 1),
        "mean_ms": round(statistics.mean(lat_s) * 1000, 1),
        "per_second": round(len(lat_s) / wall_s, 1),
        "wall_s": round(wall_s, 2),
    }


async def bench_dsec(api_url: str, api_key: str, image: str, n: int, c: int) -> dict:
    sem = asyncio.Semaphore(c)
    lat: list[float] = []
    failures = 0
    ids: list[str] = []
    async with DSecClient(api_url=api_url, api_key=api_key) as client:
        async def one() -> None:
            nonlocal failures
            async with sem:
                t0 = time.perf_counter()
                try:
                    sb = await client.run_sandbox(DSecRunArgs(image=image, memory_limit_mb=128, labels={"bench": "1"}))
                    ids.append(sb.id)
                    r = await sb.exec(["/bin/true"])
                    assert r.exit_code == 0
                    lat.append(time.perf_counter() - t0)
                except Exception as e:  # counted, reported
                    failures += 1
                    print(f"  failure: {e}", file=sys.stderr)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()

        async def stop(i: str) -> None:
            async with sem:
                await (await client.get_sandbox(i)).stop()

        await asyncio.gather(*(stop(i) for i in ids))
        out = summary(lat, wall, failures)
        out["stop_all_s"] = round(time.perf_counter() - t1, 2)
        out["ids"] = ids
        return out


def bench_oci(runtime: str, layers: list[Path], n: int, c: int, hybrid: bool) -> dict:
    """The floor: `<runtime> run` of /bin/true on an overlay of the same layers."""
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-oci-", dir="/var/tmp"))
    spec_dir = work / "spec"
    spec_dir.mkdir()
    run([runtime, "spec"], cwd=spec_dir)
    spec = json.loads((spec_dir / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["/bin/true"]
    lower = ":".join(str(p) for p in reversed(layers))
    lat: list[float] = []
    failures = 0

    def one(i: int) -> None:
        nonlocal failures
        d = work / f"c{i}"
        (d / "upper").mkdir(parents=True)
        (d / "work").mkdir()
        (d / "rootfs").mkdir()
        s = dict(spec)
        s["root"] = {"path": str(d / "rootfs"), "readonly": False}
        s["linux"] = dict(spec["linux"], cgroupsPath=f"/dsec-bench/c{i}")
        (d / "config.json").write_text(json.dumps(s))
        cmd = f"{runtime} --root {work}/state run --bundle {d} bench-{i}"
        if hybrid:
            # As the edge does: crun sees a v1 host, and what it makes for the unified
            # line of /proc/self/cgroup lands in the bundle, not in the node's tmpfs.
            (d / "cgroup-unified").mkdir()
            cmd = (f"umount /sys/fs/cgroup/unified 2>/dev/null; "
                   f"mount --bind {d}/cgroup-unified /sys/fs/cgroup/unified && {cmd}")
        t0 = time.perf_counter()
        try:
            run(["mount", "-t", "overlay", "overlay", "-o",
                 f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work", str(d / "rootfs")])
            run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], stdin=subprocess.DEVNULL)
            lat.append(time.perf_counter() - t0)
        except subprocess.CalledProcessError as e:
            failures += 1
            print(f"  oci failure: {e.stderr.strip()}", file=sys.stderr)
        finally:
            subprocess.run(["umount", str(d / "rootfs")], capture_output=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as ex:
        list(ex.map(one, range(n)))
    wall = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    for ctl in Path("/sys/fs/cgroup").iterdir():
        p = ctl / "dsec-bench"
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir():
                    child.rmdir()
            p.rmdir()
    return summary(lat, wall, failures)


def phases(log: Path, since: int, ids: set[str]) -> dict:
    """Where the server's side of each create went: the `phases=` of its "sandbox running"
    log lines (admit, reserve, record, network, backend, agent; ms), for the sandboxes of
    this run. Returns each phase's p50 and mean and its share of the total."""
    per: dict[str, list[float]] = {}
    with open(log, "rb") as f:
        f.seek(since)
        for line in f.read().decode(errors="replace").splitlines():
            if "sandbox running" not in line or "phases=" not in line:
                continue
            sid = line.split("sandbox=", 1)[1].split()[0] if "sandbox=" in line else ""
            if sid not in ids:
                continue
            for part in line.split("phases=", 1)[1].split()[0].split(","):
                name, ms = part.split(":")
                per.setdefault(name, []).append(float(ms))
    total = sum(statistics.mean(v) for v in per.values()) or 1.0
    return {k: {"p50_ms": round(pct(v, 50), 2), "mean_ms": round(statistics.mean(v), 2),
                "share": round(statistics.mean(v) / total, 3)} for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="sandboxes to create")
    ap.add_argument("-c", type=int, default=16, help="concurrency")
    ap.add_argument("--image", default="root/base:latest")
    ap.add_argument("--runtime", default="crun", help="OCI runtime for both OpenDsec and the floor")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7613")
    a = ap.parse_args()

    data = Path(a.data_dir)
    store = store_of(data, a.image_store)
    url, key = server_up(data, a.listen, store, "--oci-runtime", a.runtime)
    try:
        manifest = json.loads(run([DSEC, "image", "inspect", a.image, "--store", str(store)]).stdout)["manifest"]
        layers = [store / "layers" / l for l in manifest["layers"]]
        hybrid = Path("/sys/fs/cgroup/unified/cgroup.controllers").exists() and a.runtime.endswith("crun")
        print(f"OpenDsec create->first exec, {a.image}, n={a.n}, concurrency={a.c}, runtime={a.runtime}")
        log = data / "dsec.log"
        since = log.stat().st_size if log.exists() else 0
        d = asyncio.run(bench_dsec(url, key, a.image, a.n, a.c))
        d["server_phases"] = phases(log, since, set(d.pop("ids"))) if log.exists() else {}
        print(f"plain `{a.runtime} run /bin/true` on an overlay of the same layers (floor)")
        o = bench_oci(a.runtime, layers, a.n, a.c, hybrid)
    finally:
        server_down(data)
    rows = [("opendsec", d), (f"{a.runtime} run (floor)", o)]
    print(f"\n{'':22} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'per s':>7} {'fail':>5}")
    for name, r in rows:
        print(f"{name:22} {r['p50_ms']:8.1f} {r['p90_ms']:8.1f} {r['p99_ms']:8.1f} {r['per_second']:7.1f} {r['failures']:5d}")
    if d.get("server_phases"):
        print(f"\nthe server's side of a create, by step ({len(d['server_phases'])} steps):")
        print(f"{'':12} {'p50 ms':>8} {'mean ms':>8} {'share':>6}")
        for k, v in d["server_phases"].items():
            print(f"{k:12} {v['p50_ms']:8.2f} {v['mean_ms']:8.2f} {v['share']:6.0%}")
    out = {"bench": "create_latency", "image": a.image, "n": a.n, "concurrency": a.c, "runtime": a.runtime,
           "host_cpus": os.cpu_count(), "opendsec": d, "oci_floor": o}
    write_result("create_latency", out)


if __name__ == "__main__":
    main()
