#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""What watching a full node costs: N container sandboxes created through the SDK with a
webhook registered, and at n = 10 and n = N the time of `GET /v1/usage` (what `dsec top`
calls), of `dsec top --once` (the whole CLI process), of a page of `GET /v1/events` (the
oldest 1,000, and the newest 10), each next to `GET /v1/sandboxes` in the same run (a pass
over the same sandbox map: the floor of any answer about every sandbox), and how late the
webhook receiver got each `created` event (its arrival minus the event's time), for the
first 100 sandboxes and the last 100.

    python3 bench/observe.py -n 1000 -c 16

JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from benchlib import DSEC, configured_server, lat_summary, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402


class Receiver:
    """Records when each webhook delivery arrived, by sandbox."""

    def __init__(self) -> None:
        self.arrived: dict[str, float] = {}
        self.at_ms: dict[str, int] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if body.get("type") == "created":
                    outer.arrived[body["sandbox"]] = time.time()
                    outer.at_ms[body["sandbox"]] = body["at_ms"]
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def lag_s(self, ids: list[str]) -> list[float]:
        return [max(0.0, self.arrived[i] * 1000 - self.at_ms[i]) / 1000 for i in ids if i in self.arrived]


async def timed(http: httpx.AsyncClient, path: str, reps: int) -> dict:
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = await http.get(path)
        r.raise_for_status()
        lat.append(time.perf_counter() - t0)
    s = lat_summary(lat)
    s["bytes"] = len(r.content)
    return s


def top_once(api_url: str, key: str, reps: int) -> dict:
    env = {"DSEC_API_URL": api_url, "DSEC_API_KEY": key, "PATH": "/usr/bin:/bin"}
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([DSEC, "top", "--once"], check=True, capture_output=True, env=env)
        lat.append(time.perf_counter() - t0)
    return lat_summary(lat)


async def measure(http: httpx.AsyncClient, api_url: str, key: str, start: int, reps: int) -> dict:
    return {
        "usage": await timed(http, "/v1/usage", reps),
        "list_floor": await timed(http, "/v1/sandboxes", reps),
        "events_oldest_1000": await timed(http, f"/v1/events?after={start}&limit=1000", reps),
        "events_newest_10": await timed(http, f"/v1/events?after={start}&limit=10&order=desc", reps),
        "dsec_top_once": top_once(api_url, key, max(3, reps // 4)),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=1000, help="sandboxes (default 1000)")
    ap.add_argument("-c", type=int, default=16, help="creates at once (default 16)")
    ap.add_argument("--reps", type=int, default=20, help="calls per measurement (default 20)")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench-observe")
    ap.add_argument("--listen", default="127.0.0.1:7690")
    ap.add_argument("--image-store", default=None)
    a = ap.parse_args()
    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    rcv = Receiver()
    config = '[edge.events]\nwebhook_allow = ["127.0.0.0/8"]\n'
    with configured_server(data, a.listen, store_of(data, a.image_store), config) as (url, key):
        async with DSecClient(api_url=url, api_key=key, timeout=120) as c, \
                httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            start = (await c.events(limit=1, newest_first=True))["next"]
            hook = await c.create_webhook(rcv.url, types=["created"])
            ids: list[str] = []
            sem = asyncio.Semaphore(a.c)

            async def one(i: int) -> None:
                async with sem:
                    sb = await c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64,
                                                         ttl_seconds=3600, labels={"bench": "observe"}))
                    ids.append(sb.id)

            out: dict = {"n": a.n, "concurrency": a.c}
            await asyncio.gather(*(one(i) for i in range(10)))
            # Two readings of each (the node reads every 5 s by default).
            await asyncio.sleep(11)
            out["at_10"] = await measure(http, url, key, start, a.reps)
            t0 = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(10, a.n)))
            out["create_s"] = round(time.monotonic() - t0, 1)
            await asyncio.sleep(11)
            out[f"at_{a.n}"] = await measure(http, url, key, start, a.reps)
            deadline = time.monotonic() + 60
            while len(rcv.arrived) < a.n and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            out["webhook_delivered"] = len(rcv.arrived)
            out["webhook_lag_first_100"] = lat_summary(rcv.lag_s(ids[:100]))
            out["webhook_lag_last_100"] = lat_summary(rcv.lag_s(ids[-100:]))
            await c.delete_webhook(hook["id"])
    rcv.srv.shutdown()
    first, last = out["at_10"], out[f"at_{a.n}"]
    print(f"\n{a.n} sandboxes made in {out['create_s']} s at c={a.c}")
    print(f"{'p50 ms':<24}{'n=10':>10}{f'n={a.n}':>10}{'last/first':>12}")
    for k in ("usage", "list_floor", "events_oldest_1000", "events_newest_10", "dsec_top_once"):
        f, l = first[k]["p50_ms"], last[k]["p50_ms"]
        print(f"{k:<24}{f:>10.2f}{l:>10.2f}{l / f if f else float('nan'):>12.1f}")
    print(f"webhook lag p50/p99 ms: first 100 {out['webhook_lag_first_100']['p50_ms']}/"
          f"{out['webhook_lag_first_100']['p99_ms']}, last 100 {out['webhook_lag_last_100']['p50_ms']}/"
          f"{out['webhook_lag_last_100']['p99_ms']} ({out['webhook_delivered']} of {a.n} delivered)")
    write_result("observe", out)


if __name__ == "__main__":
    asyncio.run(main())
