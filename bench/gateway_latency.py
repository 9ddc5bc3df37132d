#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""What the E2B-compatible gateway adds per command: `commands.run("true")` through the
released `e2b` SDK (sync, as most E2B programs call it) against the gateway, next to the
same command through the native `opendsec` SDK (`sb.exec`) and the native REST API called
synchronously with httpx, all on one server in the same run.

E2B's SDK runs every command as `/bin/bash -l -c <cmd>` as the user `user` (a login
shell reads /etc/profile and ~/.profile first), so the native paths are timed twice: with
`sh -c true` as root, and with the very command the E2B SDK sends. The gateway's own cost
is the difference to the second; the rest is the command. A raw Connect call of
`process.Start` (httpx, no SDK, one request per call) is shown for reference.

    python3 bench/gateway_latency.py -n 200
Starts its own server (like the other benches; --attach uses one already running, with
its e2b.env in --data-dir), prints p50/p90/p99 per path and the gateway's added latency,
and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from benchlib import credentials, lat_summary, server_down, server_up, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition("=")
        if k and not k.startswith("#"):
            out[k] = v
    return out


def bench_e2b(n: int, image: str) -> dict:
    import e2b

    sb = e2b.Sandbox.create(template=image, timeout=600)
    try:
        for _ in range(10):
            sb.commands.run("true")
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            r = sb.commands.run("true")
            lat.append(time.perf_counter() - t0)
            assert r.exit_code == 0
        raw = bench_connect(sb, n)
        return lat_summary(lat), raw
    finally:
        sb.kill()


def bench_connect(sb, n: int) -> dict:
    """`process.Start` of `bash -l -c true` as a raw Connect streaming call (JSON codec),
    the stream read to its end: the gateway and the sandbox without the E2B SDK."""
    import json
    import struct

    import httpx

    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}}).encode()
    frame = struct.pack(">BI", 0, len(body)) + body
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
               "E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983",
               "X-Access-Token": sb._envd_access_token,
               "Authorization": "Basic " + __import__("base64").b64encode(b"user:").decode()}
    url = os.environ["E2B_SANDBOX_URL"] + "/process.Process/Start"
    lat = []
    with httpx.Client() as h:
        for i in range(n + 10):
            t0 = time.perf_counter()
            r = h.post(url, content=frame, headers=headers)
            assert r.status_code == 200 and b'"end"' in r.content, r.content
            if i >= 10:
                lat.append(time.perf_counter() - t0)
    return lat_summary(lat)


async def bench_native(url: str, key: str, n: int, image: str) -> tuple[dict, dict]:
    import httpx

    async with DSecClient(api_url=url, api_key=key) as c:
        sb = await c.run_sandbox(DSecRunArgs(image=image))
        try:
            for _ in range(10):
                await sb.exec(["sh", "-c", "true"])
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = await sb.exec(["sh", "-c", "true"])
                lat.append(time.perf_counter() - t0)
                assert r.exit_code == 0
            # The command E2B's SDK sends, as the user it names.
            login = ["/bin/bash", "-l", "-c", "true"]
            same = []
            for i in range(n + 10):
                t0 = time.perf_counter()
                r = await sb.exec(login, user="user")
                if i >= 10:
                    same.append(time.perf_counter() - t0)
                assert r.exit_code == 0
            # The REST call itself, synchronously, as the e2b SDK's client makes its calls.
            rest = []
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as h:
                for _ in range(n):
                    t0 = time.perf_counter()
                    h.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true"}).raise_for_status()
                    rest.append(time.perf_counter() - t0)
                # The call the gateway makes for it: the same command, streamed.
                streamed = []
                body = {"argv": login, "user": "user", "stream": True, "stdin": ""}
                for i in range(n + 10):
                    t0 = time.perf_counter()
                    r = h.post(f"/v1/sandboxes/{sb.id}/exec", json=body)
                    r.raise_for_status()
                    if i >= 10:
                        streamed.append(time.perf_counter() - t0)
            return lat_summary(lat), lat_summary(rest), lat_summary(same), lat_summary(streamed)
        finally:
            await sb.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="commands to time per path")
    ap.add_argument("--image", default="root/py:3.11", help="image (the e2b path names it as its template)")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7615")
    ap.add_argument("--attach", action="store_true", help="use the server already running in --data-dir")
    a = ap.parse_args()
    data = Path(a.data_dir)
    started = False
    try:
        if not a.attach:
            server_up(data, a.listen, store_of(data, a.image_store))
            started = True
        url, key = credentials(data)
        os.environ.update(read_env(data / "e2b.env"))
        print(f"e2b SDK through the gateway ({os.environ['E2B_API_URL']}): commands.run('true') x {a.n}", flush=True)
        gw, connect = bench_e2b(a.n, a.image)
        print(f"native: opendsec sb.exec and the REST call x {a.n} ({url})", flush=True)
        native, rest, same, streamed = asyncio.run(bench_native(url, key, a.n, a.image))
    finally:
        if started:
            server_down(data)

    print(f"\n{'command round trip':36} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for name, r in (("e2b commands.run via the gateway", gw),
                    ("raw Connect Start via the gateway", connect),
                    ("opendsec sb.exec, bash -l as user", same),
                    ("REST /exec streamed, bash -l as user", streamed),
                    ("opendsec sb.exec (native SDK)", native),
                    ("REST POST /exec (sync httpx)", rest)):
        print(f"{name:36} {r['p50_ms']:9.2f} {r['p90_ms']:9.2f} {r['p99_ms']:9.2f} {r['mean_ms']:9.2f}")
    added = gw["p50_ms"] - native["p50_ms"]
    own = gw["p50_ms"] - same["p50_ms"]
    print(f"\nthe E2B path takes {added:.2f} ms more at p50 than the native SDK's `sh -c true` "
          f"({gw['p50_ms'] - rest['p50_ms']:.2f} ms over the bare REST call): the command E2B's SDK "
          f"sends (bash -l as user) costs {same['p50_ms'] - native['p50_ms']:.2f} ms of it, and "
          f"the gateway with the E2B SDK adds {own:.2f} ms over the native SDK running that command, "
          f"{gw['p50_ms'] - streamed['p50_ms']:.2f} ms over the streamed REST call it makes")
    out = {"bench": "gateway_latency", "image": a.image, "n": a.n, "host_cpus": os.cpu_count(),
           "e2b_via_gateway": gw, "raw_connect_via_gateway": connect, "opendsec_native_sdk": native,
           "opendsec_native_same_command": same, "rest_exec_streamed_same_command": streamed,
           "rest_exec_sync": rest,
           "added_p50_ms": round(added, 3), "gateway_added_same_command_p50_ms": round(own, 3)}
    write_result("gateway_latency", out)


if __name__ == "__main__":
    main()
