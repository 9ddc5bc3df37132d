#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""A burst of creates submitted at once, each followed by one exec, through the SDK:
served from a warm pool of the same size (`[[edge.pools]]`) and without one, next to
the floor measured in the same run, a plain `<runtime> run /bin/true` of the same image
for the same number at once.

    python3 bench/burst.py -n 1000 [--e2b]

Prints, for each: p50 and p99 of create -> first exec and of the creates' answers, when
the first was ready, and the wall time of the burst; a single create's time (what the
first of a burst should be near); a single pooled create's time, one at a time on a quiet
node; and the floor of the SDK itself, the same number of calls that do nothing
(`whoami`) sent at once from the same client (what no create in a burst can beat). Next to them, where the time went: when the server made its first and last
sandbox of the burst (`created_at_ms`, the same clock; for a pooled one, when it was
handed out) and when the client had the creates' answers; the edge's log has each
hand-out's steps (`phases=`). JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from benchlib import DSEC, lat_summary, pool_ready, run, server_down, server_up, store_of, write_result  # noqa: E402
from gateway_latency import read_env  # noqa: E402
from create_latency import bench_oci  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402

POOL = "burst"
# The pool's limits: the burst asks for exactly these, so it matches.
MEMORY_MB = 64
CPU = 0.1


def args() -> DSecRunArgs:
    return DSecRunArgs(image="root/base", memory_limit_mb=MEMORY_MB, cpu_cores_limit=CPU,
                       labels={"bench": "burst"})


async def burst(url: str, key: str, n: int) -> dict:
    """n creates at once, each then `true`; all stopped after."""
    async with DSecClient(api_url=url, api_key=key, timeout=600) as c:
        lat: list[float] = []
        ready_at: list[float] = []
        pooled = 0
        failures = 0
        made_at: list[int] = []
        answered: list[float] = []
        t0 = time.perf_counter()
        t0_ms = time.time() * 1000

        async def one() -> str | None:
            nonlocal pooled, failures
            s = time.perf_counter()
            try:
                sb = await c.run_sandbox(args())
                answered.append(time.perf_counter() - s)
                await sb.exec(["true"])
            except Exception:  # noqa: BLE001 (counted, and the burst goes on)
                failures += 1
                return None
            e = time.perf_counter()
            lat.append(e - s)
            ready_at.append(e - t0)
            pooled += sb.info.from_pool == POOL
            made_at.append(sb.info.created_at_ms)
            return sb.id

        ids = await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        sem = asyncio.Semaphore(16)

        async def stop(i: str) -> None:
            async with sem:
                await (await c.get_sandbox(i)).stop()

        await asyncio.gather(*(stop(i) for i in ids if i))
    out = lat_summary(lat) if lat else {}
    out.update(wall_s=round(wall, 2), first_ready_s=round(min(ready_at), 3) if ready_at else None,
               from_pool=pooled, failures=failures)
    if answered:
        out["create_answered"] = lat_summary(answered)
    if made_at:
        # The server's side, on the same clock: when the first and the last sandbox were
        # made (for a pooled one, handed out), from the burst's start. What the client
        # sees beyond that is queueing in the client and the execs.
        out.update(server_first_ms=round(min(made_at) - t0_ms, 1), server_last_ms=round(max(made_at) - t0_ms, 1))
    return out


async def e2b_burst(n: int) -> dict:
    """n `AsyncSandbox.create` at once through the E2B gateway with the released `e2b`
    SDK (its environment from the server's e2b.env), each then `commands.run("true")`;
    all killed after."""
    import e2b

    lat: list[float] = []
    ready_at: list[float] = []
    made: list = []
    failures = 0
    t0 = time.perf_counter()

    async def one() -> None:
        nonlocal failures
        s = time.perf_counter()
        try:
            sb = await e2b.AsyncSandbox.create(template="root/base", timeout=600)
            made.append(sb)
            await sb.commands.run("true")
        except Exception:  # noqa: BLE001 (counted, and the burst goes on)
            failures += 1
            return
        e = time.perf_counter()
        lat.append(e - s)
        ready_at.append(e - t0)

    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    sem = asyncio.Semaphore(16)

    async def kill(sb) -> None:
        async with sem:
            try:
                await sb.kill()
            except Exception:  # noqa: BLE001
                pass

    await asyncio.gather(*(kill(sb) for sb in made))
    out = lat_summary(lat) if lat else {}
    out.update(wall_s=round(wall, 2), first_ready_s=round(min(ready_at), 3) if ready_at else None,
               from_pool=0, failures=failures)
    return out


async def single(url: str, key: str, n: int = 10) -> float:
    """p50 of a single create -> first exec on a quiet node, in seconds."""
    async with DSecClient(api_url=url, api_key=key, timeout=120) as c:
        lat = []
        for _ in range(n):
            s = time.perf_counter()
            sb = await c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=MEMORY_MB + 1))
            await sb.exec(["true"])
            lat.append(time.perf_counter() - s)
            await sb.stop()
    return sorted(lat)[len(lat) // 2]


async def single_pooled(url: str, key: str, n: int = 20) -> dict:
    """Pooled creates one at a time on a quiet node: the create's answer and create ->
    first exec, p50 in ms."""
    async with DSecClient(api_url=url, api_key=key, timeout=120) as c:
        answer, ready = [], []
        for _ in range(n):
            s = time.perf_counter()
            sb = await c.run_sandbox(args())
            answer.append(time.perf_counter() - s)
            await sb.exec(["true"])
            ready.append(time.perf_counter() - s)
            assert sb.info.from_pool == POOL, "a single create missed the pool"
            await sb.stop()
    return {"answer_p50_ms": lat_summary(answer)["p50_ms"], "ready_p50_ms": lat_summary(ready)["p50_ms"]}


async def request_floor(url: str, key: str, n: int) -> dict:
    """n calls that do nothing (`whoami`) at once through the SDK, twice on one client
    (the second on kept-alive connections); the second's p50 and wall."""
    async with DSecClient(api_url=url, api_key=key, timeout=120) as c:
        for _ in range(2):
            lat: list[float] = []
            t0 = time.perf_counter()

            async def one() -> None:
                await c.whoami()
                lat.append(time.perf_counter() - t0)

            await asyncio.gather(*(one() for _ in range(n)))
            wall = time.perf_counter() - t0
    out = lat_summary(lat)
    out["wall_s"] = round(wall, 3)
    return out


async def fill(url: str, key: str, n: int) -> float:
    async with DSecClient(api_url=url, api_key=key, timeout=60) as c:
        t0 = time.perf_counter()
        while await pool_ready(c, POOL) < n:
            await asyncio.sleep(0.5)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=1000, help="creates in the burst (and the pool's size)")
    ap.add_argument("--floor-n", type=int, default=100, help="plain runtime runs at once, for the floor")
    ap.add_argument("--runtime", default="crun")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-burst")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7615")
    ap.add_argument("--e2b", action="store_true",
                    help="also --floor-n creates at once through the E2B gateway with the released e2b SDK")
    a = ap.parse_args()
    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    store = store_of(data, a.image_store)
    cfg = data / "config.toml"
    out: dict = {"bench": "burst", "n": a.n, "runtime": a.runtime}
    try:
        cfg.unlink(missing_ok=True)
        url, key = server_up(data, a.listen, store, "--oci-runtime", a.runtime)
        print("single create -> first exec, quiet node", flush=True)
        out["single_create_p50_ms"] = round(asyncio.run(single(url, key)) * 1000, 1)
        print(f"{a.n} creates at once, no pool", flush=True)
        out["no_pool"] = asyncio.run(burst(url, key, a.n))
        if a.e2b:
            import os

            os.environ.update(read_env(data / "e2b.env"))
            print(f"{a.floor_n} creates at once through the E2B gateway (e2b SDK)", flush=True)
            out["e2b_no_pool"] = asyncio.run(e2b_burst(a.floor_n))
        cfg.write_text(f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nmemory_mb = {MEMORY_MB}\n'
                       f'cpu_cores = {CPU}\nsize = {a.n}\nrefill_per_second = 1000\n')
        url, key = server_up(data, a.listen, store, "--oci-runtime", a.runtime)
        print(f"filling a pool of {a.n}", flush=True)
        out["pool_fill_s"] = round(asyncio.run(fill(url, key, a.n)), 1)
        print("single pooled creates, one at a time", flush=True)
        out["pool_single"] = asyncio.run(single_pooled(url, key))
        asyncio.run(fill(url, key, a.n))
        print(f"{a.n} calls that do nothing at once (the SDK's floor)", flush=True)
        out["request_floor"] = asyncio.run(request_floor(url, key, a.n))
        print(f"{a.n} creates at once, from the pool", flush=True)
        out["pool"] = asyncio.run(burst(url, key, a.n))
    finally:
        subprocess_down(data)
        cfg.unlink(missing_ok=True)
    m = json.loads(run([DSEC, "image", "inspect", "root/base:latest", "--store", str(store)]).stdout)["manifest"]
    hybrid = Path("/sys/fs/cgroup/unified/cgroup.controllers").exists() and a.runtime.endswith("crun")
    print(f"floor: {a.floor_n} plain `{a.runtime} run` at once", flush=True)
    t0 = time.perf_counter()
    o = bench_oci(a.runtime, [store / "layers" / l for l in m["layers"]], a.floor_n, a.floor_n, hybrid)
    out["floor"] = {"n": a.floor_n, "wall_s": round(time.perf_counter() - t0, 2), "p50_ms": o["p50_ms"]}

    print(f"\nsingle create -> first exec (quiet node): p50 {out['single_create_p50_ms']} ms")
    for k in ("no_pool", "e2b_no_pool", "pool"):
        if k not in out:
            continue
        b = out[k]
        n = a.floor_n if k.startswith("e2b") else a.n
        print(f"{n} at once, {k.replace('_', ' ')}: p50 {b.get('p50_ms')} ms, p99 {b.get('p99_ms')} ms, "
              f"first ready {b['first_ready_s']} s, all in {b['wall_s']} s "
              f"({b['from_pool']} from the pool, {b['failures']} failed); server made the first at "
              f"{b.get('server_first_ms')} ms, the last at {b.get('server_last_ms')} ms; creates answered "
              f"p50 {b.get('create_answered', {}).get('p50_ms')} ms")
    print(f"pool of {a.n} filled in {out['pool_fill_s']} s")
    ps = out["pool_single"]
    print(f"single pooled create, one at a time: answered p50 {ps['answer_p50_ms']} ms, "
          f"-> first exec p50 {ps['ready_p50_ms']} ms")
    rf = out["request_floor"]
    print(f"floor of the SDK: {a.n} calls that do nothing at once: p50 {rf['p50_ms']} ms, "
          f"p99 {rf['p99_ms']} ms, all in {rf['wall_s']} s")
    f = out["floor"]
    print(f"floor: {f['n']} plain `{a.runtime} run` at once in {f['wall_s']} s (p50 {f['p50_ms']} ms)")
    write_result("burst", out)


def subprocess_down(data: Path) -> None:
    try:
        server_down(data)
    except Exception:  # noqa: BLE001 (already down)
        pass


if __name__ == "__main__":
    main()
