# SPDX-License-Identifier: AGPL-3.0-only
"""What egress headers cost: the time one HTTPS (and plain HTTP) request from a sandbox
takes when the node's header proxy sets its headers (a TLS handshake with the sandbox, one
with the server, the request relayed), against the same request from a sandbox without
headers, which goes straight to the server (the floor); and whether that holds with many
sandboxes with headers on the node: creates with headers, first against last, and the
request time in the first sandbox against the last.

Runs test_network's lab (tests/e2e/netlab.py: the node in its own network namespace, echo
servers over HTTP and TLS behind it); everything is removed afterwards.

Usage: python3 bench/egress_headers.py [-n 200] [--sandboxes 300]   (root;
`make bench-headers`)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchlib import DSEC, ROOT, pct  # noqa: E402

sys.path.insert(0, str(ROOT / "tests/e2e"))
import netlab  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402

IMAGES = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test")) / "images"
CA_IN_SANDBOX = "/tmp/lab-ca.pem"

# n GETs of https://pypi.test/ (or http://), a new connection each; prints the ms of each
# and the X-Secret the server got last.
LOOP = r"""
import json, socket, ssl, sys, time
n, tls, cafile = int(sys.argv[1]), sys.argv[2] == "tls", sys.argv[3] or None
ctx = ssl.create_default_context(cafile=cafile)
times, got = [], None
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection(("pypi.test", 443 if tls else 80), timeout=10)
    if tls:
        s = ctx.wrap_socket(s, server_hostname="pypi.test")
    s.sendall(b"GET / HTTP/1.1\r\nHost: pypi.test\r\nConnection: close\r\n\r\n")
    buf = b""
    while True:
        c = s.recv(65536)
        if not c:
            break
        buf += c
    s.close()
    times.append((time.perf_counter() - t0) * 1000)
    got = json.loads(buf.partition(b"\r\n\r\n")[2])["headers"].get("x-secret")
print(json.dumps({"ms": times, "secret": got}))
"""

ARGS = dict(image="root/py:3.11", memory_limit_mb=64, cpu_cores_limit=0.5, ttl_seconds=1800)
HEADERS = {"pypi.test": {"X-Secret": "bench"}}


async def loop(sb, n: int, tls: bool, cafile: str = "") -> dict:
    r = await sb.exec(argv=["python3", "-c", LOOP, str(n), "tls" if tls else "plain", cafile], timeout=600)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def summary(ms: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(ms), 2), "p99_ms": round(pct(ms, 99), 2)}


async def measure(c: DSecClient, n: int, sandboxes: int) -> dict:
    ca = (netlab.LAB_CA / "ca.pem").read_text()
    rules = {"pypi": True}
    with_h = await c.run_sandbox(DSecRunArgs(**ARGS, network_rules=rules, egress_headers=HEADERS))
    plain = await c.run_sandbox(DSecRunArgs(**ARGS, network_rules=rules))
    await plain.files.write(CA_IN_SANDBOX, ca)
    out: dict = {}
    for tls in (True, False):
        kind = "https" if tls else "http"
        await loop(with_h, 5, tls)  # warm: names resolved, certificate made
        await loop(plain, 5, tls, CA_IN_SANDBOX if tls else "")
        a = await loop(with_h, n, tls)
        b = await loop(plain, n, tls, CA_IN_SANDBOX if tls else "")
        assert a["secret"] == "bench" and b["secret"] is None, (a["secret"], b["secret"])
        out[kind] = {"with_headers": summary(a["ms"]), "direct": summary(b["ms"]),
                     "added_p50_ms": round(statistics.median(a["ms"]) - statistics.median(b["ms"]), 2)}
        print(f"{kind:>5}: with headers p50 {out[kind]['with_headers']['p50_ms']:.2f} ms "
              f"p99 {out[kind]['with_headers']['p99_ms']:.2f}; direct p50 {out[kind]['direct']['p50_ms']:.2f} "
              f"p99 {out[kind]['direct']['p99_ms']:.2f}; added at p50 {out[kind]['added_p50_ms']:.2f} ms",
              flush=True)

    # Many sandboxes with headers: creates first against last, requests first against last.
    made, create_ms = [with_h], []
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            sb = await c.run_sandbox(DSecRunArgs(**ARGS, network_rules=rules,
                                                 egress_headers={"pypi.test": {"X-Secret": f"s{i}"}}))
            create_ms.append((time.perf_counter() - t0) * 1000)
            made.append(sb)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sandboxes)))
    wall = time.perf_counter() - t0
    k = max(1, sandboxes // 10)
    first, last = create_ms[:k], create_ms[-k:]
    req_first = await loop(made[0], 50, True)
    req_last = await loop(made[-1], 50, True)
    assert req_last["secret"].startswith("s"), req_last
    out["scale"] = {
        "sandboxes_with_headers": len(made),
        "create_first_tenth_p50_ms": round(statistics.median(first), 1),
        "create_last_tenth_p50_ms": round(statistics.median(last), 1),
        "create_wall_s": round(wall, 1),
        "https_first_sandbox_p50_ms": round(statistics.median(req_first["ms"]), 2),
        "https_last_sandbox_p50_ms": round(statistics.median(req_last["ms"]), 2),
    }
    s = out["scale"]
    print(f"{len(made)} sandboxes with headers: create p50 first tenth {s['create_first_tenth_p50_ms']} ms, "
          f"last tenth {s['create_last_tenth_p50_ms']} ms ({s['create_wall_s']} s, 8 at a time); HTTPS p50 "
          f"in the first {s['https_first_sandbox_p50_ms']} ms, in the last {s['https_last_sandbox_p50_ms']} ms",
          flush=True)
    sem2 = asyncio.Semaphore(16)

    async def stop(sb) -> None:
        async with sem2:
            await sb.stop()

    await asyncio.gather(*(stop(sb) for sb in made + [plain]))
    return out


async def run(n: int, sandboxes: int) -> dict:
    lab = netlab.Netlab(dsec=DSEC, image_store=IMAGES)
    try:
        lab.up()
        async with lab.client() as c:
            return await measure(c, n, sandboxes)
    finally:
        left = lab.down()
        if left:
            print(f"the lab left: {left}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=200, help="requests of each kind")
    ap.add_argument("--sandboxes", type=int, default=300, help="sandboxes with headers for the scale part")
    ap.add_argument("--out", default=str(ROOT / "bench/results/egress_headers.json"))
    a = ap.parse_args()
    out = asyncio.run(run(a.n, a.sandboxes))
    out["n"] = a.n
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
