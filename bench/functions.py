#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""Function calls (`[[edge.functions]]`) through the SDK, one after another: a function
served by a warm pool and the same function without one, next to the floor measured in
the same run, the entry point run directly on the host (`subprocess.run` with the same
input on stdin) and the same entry point as an exec in a running sandbox.

    python3 bench/functions.py -n 200

Prints p50/p90/p99 of each and the per-call overhead over the direct run; JSON goes to
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path

from benchlib import configured_server, lat_summary, pool_ready, store_of, write_result  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402

POOL = "fn"
MEMORY_MB = 64
ENTRY = ["sh", "-c", "read -r line; printf '{\"got\": %s}' \"$line\""]
INPUT = {"prompt": "hello", "n": 3}


def config(pool_size: int) -> str:
    return (f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nmemory_mb = {MEMORY_MB}\n'
            f'size = {pool_size}\nrefill_per_second = 200\n\n'
            f'[[edge.functions]]\nname = "echo-pooled"\npool = "{POOL}"\nentry = {json.dumps(ENTRY)}\n\n'
            f'[[edge.functions]]\nname = "echo-cold"\nimage = "root/base"\nentry = {json.dumps(ENTRY)}\n')


def direct(n: int) -> dict:
    data = json.dumps(INPUT)
    lat = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        r = subprocess.run(ENTRY, input=data, capture_output=True, text=True, check=True)
        if i >= 10:
            lat.append(time.perf_counter() - t0)
        assert json.loads(r.stdout) == {"got": INPUT}
    return lat_summary(lat)


async def calls(url: str, key: str, name: str, n: int, pool_size: int) -> dict:
    async with DSecClient(api_url=url, api_key=key) as c:
        lat, pooled, server_ms = [], 0, []
        for _ in range(n):
            if pool_size:
                # Calls one after another, each given a ready member: what a pool is for.
                while (await pool_ready(c, POOL)) < 1:
                    await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            r = await c.call(name, INPUT)
            lat.append(time.perf_counter() - t0)
            assert r.output == {"got": INPUT}, r
            pooled += r.from_pool == POOL
            server_ms.append(r.duration_ms / 1000)
        out = lat_summary(lat)
        out.update(from_pool=pooled, node_p50_ms=lat_summary(server_ms)["p50_ms"])
        return out


async def exec_in_running(url: str, key: str, n: int) -> dict:
    async with DSecClient(api_url=url, api_key=key) as c:
        sb = await c.run_sandbox(DSecRunArgs(image="root/base"))
        try:
            lat = []
            for i in range(n + 10):
                t0 = time.perf_counter()
                r = await sb.exec(ENTRY, stdin=json.dumps(INPUT))
                if i >= 10:
                    lat.append(time.perf_counter() - t0)
                assert json.loads(r.stdout) == {"got": INPUT}
            return lat_summary(lat)
        finally:
            await sb.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="calls per kind")
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--data-dir", default="/var/tmp/dsec-functions")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7616")
    a = ap.parse_args()
    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    store = store_of(data, a.image_store)
    out: dict = {"bench": "functions", "n": a.n, "pool_size": a.pool_size}
    print(f"floor: the entry point run directly on the host x {a.n}", flush=True)
    out["direct"] = direct(a.n)
    with configured_server(data, a.listen, store, config(a.pool_size)) as (url, key):
        print(f"exec of the entry point in a running sandbox x {a.n}", flush=True)
        out["exec_in_running"] = asyncio.run(exec_in_running(url, key, a.n))
        print(f"calls served by a pool of {a.pool_size} x {a.n}", flush=True)
        out["pooled"] = asyncio.run(calls(url, key, "echo-pooled", a.n, a.pool_size))
        print(f"calls without a pool x {a.n}", flush=True)
        out["cold"] = asyncio.run(calls(url, key, "echo-cold", a.n, 0))
    d = out["direct"]["p50_ms"]
    print(f"\n{'per call':28} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}  over direct")
    for k, label in (("direct", "direct on the host (floor)"), ("exec_in_running", "exec, running sandbox"),
                     ("pooled", "call, from the pool"), ("cold", "call, no pool")):
        s = out[k]
        print(f"{label:28} {s['p50_ms']:8.2f} {s['p90_ms']:8.2f} {s['p99_ms']:8.2f}  {s['p50_ms'] - d:+8.2f}")
    print(f"pooled calls served from the pool: {out['pooled']['from_pool']} of {a.n}; "
          f"node-side p50 {out['pooled']['node_p50_ms']} ms (pooled), {out['cold']['node_p50_ms']} ms (no pool)")
    write_result("functions", out)


if __name__ == "__main__":
    main()
