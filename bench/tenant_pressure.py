# SPDX-License-Identifier: AGPL-3.0-only
"""What one hostile sandbox can do to the others on its node: the create p50 and the DNS
lookup p50 (and the stop p50) of other sandboxes on an idle node, then while one sandbox (0.5 cores) burns its
CPU (the floor any busy neighbour costs), then while it floods the DNS proxy with random
names under a name its rules allow (every name answered with an address, so each answer
asks the node to open it), with the node's peak RSS over the run.

It runs in netlab (tests/e2e/netlab.py): the node (`dsec up`) in a network namespace of its
own, the upstream DNS server and the "internet" in another; no traffic leaves the machine.
The figures are compared within the same run: the flood's p50s against the idle ones.

Usage: python3 bench/tenant_pressure.py [-n 30] [--names 10000]   (root; images from
`make test`, or DSEC_TEST_DIR's store)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/e2e"))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import DSEC, lat_summary, pct, write_result  # noqa: E402
from opendsec import DSecRunArgs  # noqa: E402

import netlab  # noqa: E402
from netlab import NODE_DIR, PYPI_IP, Netlab  # noqa: E402

IMAGES = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test")) / "images"
TINY = dict(image="root/base", memory_limit_mb=32, cpu_cores_limit=0.05, ttl_seconds=900)
PY = dict(image="root/py:3.11", memory_limit_mb=128, cpu_cores_limit=0.5, ttl_seconds=900,
          network_rules={"pypi": True})

# Sends queries for random names under pypi.test to the sandbox's resolver as fast as it
# can for `seconds` (UDP, not waiting for answers; at least `n` names), and prints how many
# it sent and how many answers came back.
FLOOD = r"""
import os, socket, struct, sys, time
n, seconds, server = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
sent = answers = 0
t0 = time.monotonic()
while sent < n or time.monotonic() - t0 < seconds:
    name = os.urandom(6).hex() + ".pypi.test"
    q = struct.pack(">6H", sent & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    try:
        s.sendto(q, (server, 53))
        sent += 1
    except BlockingIOError:
        time.sleep(0.001)
    try:
        while True:
            s.recv(4096)
            answers += 1
    except BlockingIOError:
        pass
print(sent, answers, round(time.monotonic() - t0, 2))
"""

# Burns CPU for `seconds`.
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"

# Resolves pypi.test `n` times, printing each lookup's seconds.
LOOKUPS = r"""
import socket, sys, time
for _ in range(int(sys.argv[1])):
    t0 = time.monotonic()
    socket.gethostbyname("pypi.test")
    print(round(time.monotonic() - t0, 6))
    time.sleep(0.02)
"""


def node_pid() -> int:
    return int((NODE_DIR / "dsec.pid").read_text().strip())


class PeakRss:
    """Samples the node process's resident memory every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))
            except OSError:
                return
            time.sleep(0.05)

    def __enter__(self) -> "PeakRss":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


async def creates(c, n: int) -> tuple[list[float], list[float]]:
    """n sandboxes made and stopped one after another: (create times, stop times)."""
    made, stopped = [], []
    for _ in range(n):
        t0 = time.monotonic()
        sb = await c.run_sandbox(DSecRunArgs(**TINY))
        t1 = time.monotonic()
        await sb.stop()
        made.append(t1 - t0)
        stopped.append(time.monotonic() - t1)
    return made, stopped


async def lookups(sb, n: int) -> list[float]:
    r = await sb.exec(argv=["python3", "-c", LOOKUPS, str(n)], timeout=300)
    assert r.exit_code == 0, r.stderr
    return [float(x) for x in r.stdout.split()]


async def measure(lab: Netlab, n: int, names: int, seconds: float) -> dict:
    lab.set_zone("*", [["A", PYPI_IP, 30]])
    async with lab.client() as c:
        prober = await c.run_sandbox(DSecRunArgs(**PY))
        flooder = await c.run_sandbox(DSecRunArgs(**PY))
        try:
            await creates(c, 3)  # warm up
            idle_create, idle_stop = await creates(c, n)
            idle_dns = await lookups(prober, 50)
            # The floor a flood is judged against: a neighbour using all the CPU its
            # limit gives it, with no network at all.
            spin = asyncio.create_task(flooder.exec(
                argv=["python3", "-c", SPIN, str(seconds)], timeout=600))
            await asyncio.sleep(0.5)
            spin_create, spin_stop = await creates(c, n)
            spin_dns = await lookups(prober, 50)
            await spin
            gw = str(__import__("ipaddress").IPv4Address(flooder.info.network["address"]) - 1)
            with PeakRss(node_pid()) as rss:
                flood = asyncio.create_task(flooder.exec(
                    argv=["python3", "-c", FLOOD, str(names), str(seconds), gw], timeout=600))
                await asyncio.sleep(0.5)
                busy_create, busy_stop = await creates(c, n)
                busy_dns = await lookups(prober, 50)
                still = not flood.done()
                fr = await flood
            assert still, "the flood ended before the measurements did: raise --seconds"
            sent, answered, took = fr.stdout.split()
        finally:
            await prober.stop()
            await flooder.stop()
    return {
        "n": n,
        "flood": {"names_sent": int(sent), "answered": int(answered), "seconds": float(took)},
        "idle": {"create": lat_summary(idle_create), "stop": lat_summary(idle_stop),
                 "dns": lat_summary(idle_dns)},
        "cpu_neighbour": {"create": lat_summary(spin_create), "stop": lat_summary(spin_stop),
                          "dns": lat_summary(spin_dns)},
        "flooded": {"create": lat_summary(busy_create), "stop": lat_summary(busy_stop),
                    "dns": lat_summary(busy_dns)},
        "create_p50_ratio": round(pct(busy_create, 50) / pct(idle_create, 50), 3),
        "cpu_neighbour_create_p50_ratio": round(pct(spin_create, 50) / pct(idle_create, 50), 3),
        "dns_p50_ratio": round(pct(busy_dns, 50) / pct(idle_dns, 50), 3),
        "node_peak_rss_mib": round(rss.peak_kib / 1024, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=30, help="creates measured per phase")
    ap.add_argument("--names", type=int, default=10_000, help="random names the flooder sends, at least")
    ap.add_argument("--seconds", type=float, default=20, help="how long it floods, at least")
    a = ap.parse_args()
    why = netlab.unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    lab = Netlab(dsec=DSEC, image_store=IMAGES)
    try:
        lab.up()
        out = asyncio.run(measure(lab, a.n, a.names, a.seconds))
    finally:
        left = lab.down()
        if left:
            print(f"netlab left: {left}")
    f = out["flood"]
    print(f"\nflood: {f['names_sent']} random names in {f['seconds']} s, {f['answered']} answered "
          f"(the rest dropped by the per-sandbox rate limit), all through the measurements")
    print(f"{'p50 (ms), ratio to idle':<26}{'idle':>8}{'CPU neighbour':>15}{'DNS flood':>16}")
    for what, key in (("create of another", "create"), ("stop of another", "stop"),
                      ("DNS lookup of another", "dns")):
        i = out["idle"][key]["p50_ms"]
        c, b = out["cpu_neighbour"][key]["p50_ms"], out["flooded"][key]["p50_ms"]
        print(f"{what:<26}{i:>8.1f}{c:>8.1f} ({c / i:.2f}){b:>9.1f} ({b / i:.2f})")
    print(f"node peak RSS over the run: {out['node_peak_rss_mib']} MiB")
    write_result("tenant_pressure", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
