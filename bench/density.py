#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""How a node holds many sandboxes at once: N container sandboxes (64 MiB, networking
on, one CIDR rule each) created through the SDK and all kept running, then each asked
for an exec, the server killed with SIGKILL and started again with all of them running,
each asked again, and all stopped with `dsec down`; then the host is checked for
anything left.

    python3 bench/density.py -n 3000 -c 16

Prints creates/s of the first and the last 500 (the cost of a create as the node fills:
the ratio should stay near 1) next to the floor measured in the same run: a plain
`<runtime> run /bin/true` on an overlay of the same image, sequential, on the empty node
and with all N running (what the kernel's own cost of one more container becomes), where the server's side of those creates went (its
`phases=` log lines), node memory per sandbox, exec latency with all running, the time
until the API answers after the restart, the time `dsec down` took, and what was left.
JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchlib import DSEC, credentials, pct, run, server_up, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402
from create_latency import bench_oci  # noqa: E402


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rate(done_at: list[float], first: int, last: int) -> float:
    """Creates per second between the `first`-th and the `last`-th completion."""
    span = done_at[last - 1] - done_at[first - 1] if last > first else 0.0
    return (last - first) / span if span > 0 else float("nan")


def phases_by_id(log: Path, since: int) -> dict[str, dict[str, float]]:
    """The `phases=` (ms per step) of each "sandbox running" line of the log since `since`."""
    out: dict[str, dict[str, float]] = {}
    with open(log, "rb") as f:
        f.seek(since)
        for line in f.read().decode(errors="replace").splitlines():
            if "sandbox running" not in line or "phases=" not in line or "sandbox=" not in line:
                continue
            sid = line.split("sandbox=", 1)[1].split()[0]
            out[sid] = {p.split(":")[0]: float(p.split(":")[1])
                        for p in line.split("phases=", 1)[1].split()[0].split(",")}
    return out


def mean_phases(per: dict[str, dict[str, float]], ids: list[str]) -> dict[str, float]:
    steps: dict[str, list[float]] = {}
    for i in ids:
        for k, v in per.get(i, {}).items():
            steps.setdefault(k, []).append(v)
    return {k: round(statistics.mean(v), 2) for k, v in steps.items()}


def host_mounts() -> int:
    """Entries in the host's mount table (every new mount namespace copies them)."""
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def mountns_holders() -> list[int]:
    """Processes holding a sandboxes' mount namespace (`dsec-mountns`)."""
    pids = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if p.read_bytes().startswith(b"dsec-mountns\0"):
                pids.append(int(p.parent.name))
        except OSError:
            pass
    return pids


def host_leftovers(data: Path) -> dict[str, int]:
    """What sandboxes leave on a host, counted: network namespaces, node-side interfaces,
    elements in the node's nftables sets, sandbox cgroups, mounts under the data directory
    and holders of the sandboxes' mount namespace."""
    ns = list(Path("/run/dsec/netns").glob("dsec-*"))
    ifaces = [p for p in Path("/sys/class/net").iterdir() if p.name.startswith("dsv")]
    elems = 0
    for s in ("c", "p", "x", "xp", "c1", "p1", "x1", "xp1"):
        r = subprocess.run(["nft", "list", "set", "inet", "dsec", s], capture_output=True, text=True)
        elems += r.stdout.count('"dsv')
    cgroups = 0
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup/unified")):
        d = root / "dsec"
        if d.is_dir():
            # dsec/<bucket>/<id>: buckets (one character) and what is in them.
            for c in d.iterdir():
                if c.is_dir():
                    cgroups += 1 if len(c.name) > 1 else sum(1 for x in c.iterdir() if x.is_dir())
    mounts = sum(1 for line in Path("/proc/self/mountinfo").read_text().splitlines()
                 if line.split()[4].startswith(str(data) + "/"))
    return {"netns": len(ns), "interfaces": len(ifaces), "nft_elements": elems, "cgroups": cgroups,
            "mounts": mounts, "mountns_holders": len(mountns_holders())}


async def create_all(client: DSecClient, n: int, c: int, memory_mb: int) -> tuple[list[str], list[float], list[float], int]:
    """Creates n sandboxes, c at a time; returns their ids in completion order, the
    completion times, the latencies and the failures."""
    sem = asyncio.Semaphore(c)
    ids: list[str] = []
    done_at: list[float] = []
    lat: list[float] = []
    failures = 0
    t_start = time.perf_counter()
    last_print = [t_start]

    async def one(i: int) -> None:
        nonlocal failures
        async with sem:
            t0 = time.perf_counter()
            try:
                sb = await client.run_sandbox(DSecRunArgs(
                    image="root/base", memory_limit_mb=memory_mb, cpu_cores_limit=0.1, ttl_seconds=7200,
                    network_rules={f"203.0.113.{i % 256}/32": True}, labels={"bench": "density"}))
            except Exception as e:  # counted, reported
                failures += 1
                print(f"  create {i} failed: {e}", file=sys.stderr)
                return
            now = time.perf_counter()
            ids.append(sb.id)
            done_at.append(now - t_start)
            lat.append(now - t0)
            if now - last_print[0] > 10:
                last_print[0] = now
                print(f"  {len(ids)} running after {now - t_start:.0f} s", flush=True)

    await asyncio.gather(*(one(i) for i in range(n)))
    return ids, done_at, lat, failures


async def exec_all(client: DSecClient, ids: list[str], c: int) -> tuple[list[float], list[str]]:
    """`echo <id>` in each; returns the latencies and the ids that did not answer right."""
    sem = asyncio.Semaphore(c)
    lat: list[float] = []
    bad: list[str] = []

    async def one(i: str) -> None:
        async with sem:
            try:
                sb = await client.get_sandbox(i)
                t0 = time.perf_counter()
                r = await sb.exec(["echo", i])
                lat.append(time.perf_counter() - t0)
                if r.stdout != f"{i}\n":
                    bad.append(i)
            except Exception as e:
                print(f"  exec in {i} failed: {e}", file=sys.stderr)
                bad.append(i)

    await asyncio.gather(*(one(i) for i in ids))
    return lat, bad


def restart(data: Path, listen: str, store: Path, runtime: str) -> dict:
    """SIGKILL the server, start it again; how long until the API answers and `dsec up`
    returns."""
    pid = int((data / "dsec.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    while Path(f"/proc/{pid}").exists():
        time.sleep(0.01)
    url, key = credentials(data)
    t0 = time.perf_counter()
    up = subprocess.Popen([DSEC, "up", "--data-dir", str(data), "--listen", listen, "--image-store", str(store),
                           "--oci-runtime", runtime], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    api_s = None
    with httpx.Client(timeout=2) as h:
        while api_s is None and time.perf_counter() - t0 < 600:
            try:
                r = h.get(f"{url}/v1/sandboxes", headers={"Authorization": f"Bearer {key}"})
                if r.status_code == 200:
                    api_s = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    out, _ = up.communicate(timeout=600)
    up_s = time.perf_counter() - t0
    if up.returncode != 0:
        raise SystemExit(f"dsec up failed after the restart:\n{out}")
    return {"api_answers_s": round(api_s, 2) if api_s is not None else None, "up_returned_s": round(up_s, 2)}


def floor_p50_ms(a: argparse.Namespace, store: Path) -> float:
    """p50 of 20 sequential plain runtime runs of /bin/true on an overlay of root/base."""
    m = json.loads(run([DSEC, "image", "inspect", "root/base:latest", "--store", str(store)]).stdout)["manifest"]
    hybrid = Path("/sys/fs/cgroup/unified/cgroup.controllers").exists() and a.runtime.endswith("crun")
    return bench_oci(a.runtime, [store / "layers" / l for l in m["layers"]], 20, 1, hybrid)["p50_ms"]


async def main_async(a: argparse.Namespace) -> dict:
    data = Path(a.data_dir)
    store = store_of(data, a.image_store)
    url, key = server_up(data, a.listen, store, "--oci-runtime", a.runtime)
    out: dict = {"bench": "density", "n": a.n, "concurrency": a.c, "memory_mb": a.memory_mb,
                 "runtime": a.runtime, "host_cpus": os.cpu_count()}
    log = data / "dsec.log"
    since = log.stat().st_size if log.exists() else 0
    floor0 = floor_p50_ms(a, store)
    mem0 = mem_available_mib()
    mounts0 = host_mounts()
    print(f"creating {a.n} sandboxes ({a.memory_mb} MiB, one CIDR rule each), {a.c} at a time", flush=True)
    async with DSecClient(api_url=url, api_key=key, timeout=300) as client:
        t0 = time.perf_counter()
        ids, done_at, lat, failures = await create_all(client, a.n, a.c, a.memory_mb)
        create_s = time.perf_counter() - t0
        mem1 = mem_available_mib()
        w = min(500, len(ids) // 2)
        first, last = rate(done_at, 1, w), rate(done_at, len(ids) - w + 1, len(ids))
        per = phases_by_id(log, since) if log.exists() else {}
        out["create"] = {
            "created": len(ids), "failures": failures, "wall_s": round(create_s, 1),
            "window": w, "first_per_s": round(first, 1), "last_per_s": round(last, 1),
            "last_over_first": round(last / first, 2),
            "p50_ms": round(pct(lat, 50) * 1000, 1), "p99_ms": round(pct(lat, 99) * 1000, 1),
            "phases_first_ms": mean_phases(per, ids[:w]), "phases_last_ms": mean_phases(per, ids[-w:]),
        }
        out["node_memory_per_sandbox_mib"] = round((mem0 - mem1) / max(len(ids), 1), 2)
        out["host_mount_table"] = {"before": mounts0, "all_running": host_mounts()}
        print(f"  the floor again with all {len(ids)} running", flush=True)
        floor1 = floor_p50_ms(a, store)
        out["floor_runtime_run_p50_ms"] = {"empty": floor0, "all_running": floor1,
                                           "full_over_empty": round(floor1 / floor0, 2)}
        print(f"  exec in each of the {len(ids)}", flush=True)
        elat, bad = await exec_all(client, ids, a.c)
        out["exec_all_running"] = {"p50_ms": round(pct(elat, 50) * 1000, 2) if elat else None,
                                   "p99_ms": round(pct(elat, 99) * 1000, 2) if elat else None,
                                   "wrong": len(bad)}
    print("  kill -9 of the server and a restart with all running", flush=True)
    out["restart"] = restart(data, a.listen, store, a.runtime)
    async with DSecClient(api_url=url, api_key=key, timeout=300) as client:
        listed = {s.id for s in await client.list_sandboxes(labels={"bench": "density"})}
        elat2, bad2 = await exec_all(client, ids, a.c)
    out["restart"]["listed"] = len(listed & set(ids))
    out["restart"]["exec_wrong"] = len(bad2)
    print("  dsec down (stops them all)", flush=True)
    t0 = time.perf_counter()
    run([DSEC, "down", "--data-dir", str(data)], timeout=3600)
    out["stop_all_s"] = round(time.perf_counter() - t0, 1)
    out["left_on_host"] = host_leftovers(data)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3000, help="sandboxes to hold at once")
    ap.add_argument("-c", type=int, default=16, help="concurrency of the creates and execs")
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--runtime", default="crun")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-density")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7614")
    a = ap.parse_args()
    out = asyncio.run(main_async(a))
    c = out["create"]
    print(f"\n{c['created']} of {a.n} created ({c['failures']} failed) in {c['wall_s']} s at concurrency {a.c}")
    print(f"creates/s, first {c['window']}: {c['first_per_s']}; last {c['window']}: {c['last_per_s']} "
          f"(last/first {c['last_over_first']})")
    print(f"create p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms")
    f = out["floor_runtime_run_p50_ms"]
    print(f"floor, plain `{a.runtime} run` p50: {f['empty']} ms on the empty node, {f['all_running']} ms "
          f"with all running (x{f['full_over_empty']})")
    steps = sorted(set(c["phases_first_ms"]) | set(c["phases_last_ms"]))
    if steps:
        print(f"\nthe server's side of a create (mean ms):\n{'':10} {'first':>8} {'last':>8}")
        for k in steps:
            print(f"{k:10} {c['phases_first_ms'].get(k, 0):8.2f} {c['phases_last_ms'].get(k, 0):8.2f}")
    print(f"\nnode memory per sandbox: {out['node_memory_per_sandbox_mib']} MiB")
    m = out["host_mount_table"]
    print(f"host mount table: {m['before']} entries before, {m['all_running']} with all running")
    e = out["exec_all_running"]
    print(f"exec with all running: p50 {e['p50_ms']} ms, p99 {e['p99_ms']} ms, wrong answers {e['wrong']}")
    r = out["restart"]
    print(f"after kill -9 and dsec up: API answers in {r['api_answers_s']} s (dsec up returned in "
          f"{r['up_returned_s']} s); {r['listed']} listed, {r['exec_wrong']} wrong execs")
    print(f"dsec down with all running: {out['stop_all_s']} s")
    print(f"left on the host: {out['left_on_host']}")
    write_result("density", out)


if __name__ == "__main__":
    main()
