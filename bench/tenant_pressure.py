# SPDX-License-Identifier: AGPL-3.0-only
"""What one hostile sandbox can do to the others on its node: the create p50 and the DNS
lookup p50 (and the stop p50) of other sandboxes on an idle node, then while one sandbox (0.5 cores) burns its
CPU (the floor any busy neighbour costs), then while it floods the DNS proxy with random
names under a name its rules allow (every name answered with an address, so each answer
asks the node to open it), with the node's peak RSS over the run.

It runs in netlab (tests/e2e/netlab.py): the node (`dsec up`) in a network namespace of its
own, the upstream DNS server and the "internet" in another; no traffic leaves the machine.
The figures are compared within the same run: the flood's p50s against the idle ones, the
three conditions interleaved over a few rounds so that drift over the run falls on each.

Usage: python3 bench/tenant_pressure.py [-n 60] [--names 10000] [--rounds 3]   (root; images from
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

from benchlib import DSEC, lat_summary, pct, proc_cpu, write_result  # noqa: E402
from opendsec import DSecRunArgs  # noqa: E402

import netlab  # noqa: E402
from netlab import NODE_DIR, PYPI_IP, Netlab  # noqa: E402

IMAGES = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test")) / "images"
TINY = dict(image="root/base", memory_limit_mb=32, cpu_cores_limit=0.05, ttl_seconds=900)
PY = dict(image="root/py:3.11", memory_limit_mb=128, cpu_cores_limit=0.5, ttl_seconds=900,
          network_rules={"pypi": True})

# Sends queries for random names under pypi.test to the sandbox's resolver as fast as it
# can until a stop file appears (UDP, not waiting for answers; at least `n` names), and prints how many
# it sent, how many answers came back and how many sends its own namespace refused.
FLOOD = r"""
import os, socket, struct, sys, time
n, server, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
sent = answers = refused = 0
t0 = time.monotonic()
while sent < n or not (sent % 256 == 0 and os.path.exists(stop)):
    name = os.urandom(6).hex() + ".pypi.test"
    q = struct.pack(">6H", sent & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
    try:
        s.sendto(q, (server, 53))
        sent += 1
    except BlockingIOError:
        time.sleep(0.001)
    except PermissionError:
        # Dropped by the sandbox namespace's own DNS guard: the attacker just goes on.
        sent += 1
        refused += 1
    try:
        while True:
            s.recv(4096)
            answers += 1
    except BlockingIOError:
        pass
print(sent, answers, refused, round(time.monotonic() - t0, 2))
"""

# Burns CPU until a stop file appears.
SPIN = ("import os, sys\ni = 0\nwhile not (i % 100000 == 0 and os.path.exists(sys.argv[1])):\n"
        "    i += 1\n")

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


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")


def cpu_times() -> list[float]:
    """The machine's CPU time so far, by kind (the first fields of /proc/stat's cpu line)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:1 + len(CPU_FIELDS)]
    return [int(x) / os.sysconf("SC_CLK_TCK") for x in fields]


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


async def measure(lab: Netlab, n: int, names: int, rounds: int) -> dict:
    """Interleaves the three conditions over `rounds` rounds (idle, CPU neighbour, DNS flood
    in each), so drift over the run falls on all three alike."""
    lab.set_zone("*", [["A", PYPI_IP, 30]])
    per = max(1, n // rounds)
    got = {k: {"create": [], "stop": [], "dns": []} for k in ("idle", "cpu", "flood")}
    flood_out = []
    async with lab.client() as c:
        prober = await c.run_sandbox(DSecRunArgs(**PY))
        flooder = await c.run_sandbox(DSecRunArgs(**PY))
        gw = str(__import__("ipaddress").IPv4Address(flooder.info.network["address"]) - 1)

        node = node_pid()

        async def sample(into: dict) -> None:
            n0 = proc_cpu(node)
            t0 = cpu_times()
            made, stopped = await creates(c, per)
            into["create"] += made
            into["stop"] += stopped
            into["dns"] += await lookups(prober, max(1, 50 // rounds))
            t1 = cpu_times()
            into["node_cpu_s"] = into.get("node_cpu_s", 0.0) + proc_cpu(node) - n0
            into.setdefault("cpu_s", [0.0] * len(t0))
            into["cpu_s"] = [a + (y - x) for a, x, y in zip(into["cpu_s"], t0, t1)]

        async def under(argv: list[str], into: dict, stop: str) -> str:
            task = asyncio.create_task(flooder.exec(argv=argv, timeout=900))
            await asyncio.sleep(0.5)
            await sample(into)
            still = not task.done()
            await flooder.exec(argv=["touch", stop], timeout=30)
            r = await task
            assert still, f"the load ended before the measurements did: {r.stdout} {r.stderr}"
            return r.stdout

        try:
            await creates(c, 3)  # warm up
            with PeakRss(node_pid()) as rss:
                for r in range(rounds):
                    await sample(got["idle"])
                    # The floor a flood is judged against: a neighbour using all the CPU
                    # its limit gives it, with no network at all.
                    await under(["python3", "-c", SPIN, f"/tmp/spin{r}"], got["cpu"],
                                f"/tmp/spin{r}")
                    flood_out.append(await under(
                        ["python3", "-c", FLOOD, str(names // rounds), gw, f"/tmp/flood{r}"],
                        got["flood"], f"/tmp/flood{r}"))
        finally:
            await prober.stop()
            await flooder.stop()
    sent = answered = refused = 0
    took = 0.0
    for line in flood_out:
        a, b, c_, d = line.split()
        sent, answered, refused, took = sent + int(a), answered + int(b), refused + int(c_), took + float(d)
    summary = {k: {m: lat_summary(v) for m, v in got[k].items() if m not in ("cpu_s", "node_cpu_s")} for k in got}
    for k in got:
        # Where the machine's CPU went while each condition was measured, as a share of
        # all of it (user, system, softirq, idle, ...).
        t = got[k]["cpu_s"]
        summary[k]["node_cpu_s"] = round(got[k]["node_cpu_s"], 2)
        summary[k]["host_cpu_share"] = {name: round(v / sum(t), 3) for name, v in zip(CPU_FIELDS, t)}
    return {
        "n": per * rounds,
        "rounds": rounds,
        "flood": {"names_sent": sent, "answered": answered, "refused_in_sandbox": refused,
                  "seconds": round(took, 2)},
        "idle": summary["idle"],
        "cpu_neighbour": summary["cpu"],
        "flooded": summary["flood"],
        "create_p50_ratio": round(pct(got["flood"]["create"], 50) / pct(got["idle"]["create"], 50), 3),
        "cpu_neighbour_create_p50_ratio": round(
            pct(got["cpu"]["create"], 50) / pct(got["idle"]["create"], 50), 3),
        "dns_p50_ratio": round(pct(got["flood"]["dns"], 50) / pct(got["idle"]["dns"], 50), 3),
        "node_peak_rss_mib": round(rss.peak_kib / 1024, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=60, help="creates measured per condition")
    ap.add_argument("--names", type=int, default=10_000, help="random names the flooder sends, at least")
    ap.add_argument("--rounds", type=int, default=3, help="rounds the conditions are interleaved over")
    a = ap.parse_args()
    why = netlab.unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    lab = Netlab(dsec=DSEC, image_store=IMAGES)
    try:
        lab.up()
        out = asyncio.run(measure(lab, a.n, a.names, a.rounds))
    finally:
        left = lab.down()
        if left:
            print(f"netlab left: {left}")
    f = out["flood"]
    print(f"\nflood: {f['names_sent']} random names in {f['seconds']} s, {f['answered']} answered; "
          f"{f['refused_in_sandbox']} refused by the sandbox's own namespace, the rest dropped "
          f"by the node's per-sandbox limits; all through the measurements")
    print(f"{'p50 (ms), ratio to idle':<26}{'idle':>8}{'CPU neighbour':>15}{'DNS flood':>16}")
    for what, key in (("create of another", "create"), ("stop of another", "stop"),
                      ("DNS lookup of another", "dns")):
        i = out["idle"][key]["p50_ms"]
        c, b = out["cpu_neighbour"][key]["p50_ms"], out["flooded"][key]["p50_ms"]
        print(f"{what:<26}{i:>8.1f}{c:>8.1f} ({c / i:.2f}){b:>9.1f} ({b / i:.2f})")
    print(f"{'host CPU busy / softirq':<26}" + "".join(
        f"{out[k]['host_cpu_share']['idle'] and 1 - out[k]['host_cpu_share']['idle']:>{w}.0%}"
        f"/{out[k]['host_cpu_share']['softirq']:.0%}" for k, w in
        (("idle", 5), ("cpu_neighbour", 9), ("flooded", 10))))
    print(f"{'node CPU seconds':<26}{out['idle']['node_cpu_s']:>8.2f}"
          f"{out['cpu_neighbour']['node_cpu_s']:>15.2f}{out['flooded']['node_cpu_s']:>16.2f}")
    print(f"node peak RSS over the run: {out['node_peak_rss_mib']} MiB")
    write_result("tenant_pressure", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
