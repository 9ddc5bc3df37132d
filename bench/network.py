# SPDX-License-Identifier: AGPL-3.0-only
"""What sandbox networking costs: the time network setup adds to a create (p50/p99 of
creates with egress rules against creates with network="none", same image, same node), and
TCP throughput from a sandbox to an allowed host against the node itself sending to the same
host.

The node (`dsec up`) runs in its own network namespace; the "allowed host" is another
namespace behind it (203.0.113.10, a TCP sink); the benchmark talks to the node's API over a
veth from the root namespace. Everything is removed afterwards.

Usage: python3 bench/network.py [-n 40] [--mib 256]   (root; `make bench-network`)
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdk/python"))

from opendsec import DSecClient, DSecRunArgs  # noqa: E402

DSEC = os.environ.get("DSEC_BIN", str(ROOT / "target/debug/dsec"))
IMAGES = Path(os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test")) / "images"
DATA = Path("/var/tmp/dsec-bench-net")
NODE, WORLD = "dsecb-node", "dsecb-world"
API = "192.0.2.6:7631"
SINK = ("203.0.113.10", 9000)

SINK_CODE = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.sendall(b"k"); c.close()
"""

# Sends MiB to the sink and prints the seconds from connect to the sink's ack.
SEND_CODE = r"""
import socket, sys, time
host, port, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = b"x" * (1 << 20)
t0 = time.monotonic()
s = socket.create_connection((host, port), timeout=30)
for _ in range(mib):
    s.sendall(buf)
s.shutdown(socket.SHUT_WR)
assert s.recv(1) == b"k"
print(time.monotonic() - t0)
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def in_ns(ns: str, *argv: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{ns}", "--", *argv]


def topology_up() -> None:
    for ns in (NODE, WORLD):
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    # root <-> node: the API
    sh("ip", "link", "add", "name", "dsecb-api", "type", "veth", "peer", "name", "api", "netns", NODE)
    sh("ip", "addr", "add", "192.0.2.5/30", "dev", "dsecb-api")
    sh("ip", "link", "set", "dsecb-api", "up")
    sh("ip", "-n", NODE, "addr", "add", "192.0.2.6/30", "dev", "api")
    sh("ip", "-n", NODE, "link", "set", "api", "up")
    # node <-> world: the uplink
    sh("ip", "-n", NODE, "link", "add", "name", "up0", "type", "veth", "peer", "name", "down0", "netns", WORLD)
    sh("ip", "-n", NODE, "addr", "add", "192.0.2.1/30", "dev", "up0")
    sh("ip", "-n", NODE, "link", "set", "up0", "up")
    sh("ip", "-n", NODE, "route", "add", "default", "via", "192.0.2.2")
    sh("ip", "-n", WORLD, "addr", "add", "192.0.2.2/30", "dev", "down0")
    sh("ip", "-n", WORLD, "addr", "add", f"{SINK[0]}/32", "dev", "lo")
    sh("ip", "-n", WORLD, "link", "set", "down0", "up")


def topology_down() -> None:
    for ns in (NODE, WORLD):
        out = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in out:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", ns, check=False)
    sh("ip", "link", "del", "dsecb-api", check=False)


def dsec(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_CONFIG=str(DATA / "client.toml"))
    return subprocess.run(in_ns(NODE, DSEC, *args), check=True, capture_output=True, text=True, env=env, timeout=180)


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


async def create_times(c: DSecClient, n: int, args: DSecRunArgs) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        sb = await c.run_sandbox(args)
        out.append((time.monotonic() - t0) * 1000)
        await sb.stop()
    return out


async def measure(n: int, mib: int) -> dict:
    key = [l.split("=", 1)[1].strip().strip('"') for l in (DATA / "client.toml").read_text().splitlines()
           if l.startswith("api_key")][0]
    res: dict = {}
    async with DSecClient(api_url=f"http://{API}", api_key=key) as c:
        small = dict(image="root/py:3.11", memory_limit_mb=256, cpu_cores_limit=1.0)
        none = DSecRunArgs(**small, network="none")
        rules = DSecRunArgs(**small, network_rules={f"{SINK[0]}:{SINK[1]}": True})
        await create_times(c, 2, none)  # warm caches
        # Interleave the two kinds so drift hits both alike.
        t_none, t_net = [], []
        for _ in range(n):
            t_none += await create_times(c, 1, none)
            t_net += await create_times(c, 1, rules)
        res["create_ms"] = {
            "network_none": {"p50": statistics.median(t_none), "p99": pct(t_none, 99)},
            "network_rules": {"p50": statistics.median(t_net), "p99": pct(t_net, 99)},
        }
        res["create_ms"]["added"] = {
            "p50": res["create_ms"]["network_rules"]["p50"] - res["create_ms"]["network_none"]["p50"],
            "p99": res["create_ms"]["network_rules"]["p99"] - res["create_ms"]["network_none"]["p99"],
        }
        sb = await c.run_sandbox(rules)
        try:
            runs_sb, runs_host = [], []
            for _ in range(3):
                r = await sb.exec(["python3", "-c", SEND_CODE, SINK[0], str(SINK[1]), str(mib)], timeout=120)
                assert r.exit_code == 0, r.stderr
                runs_sb.append(float(r.stdout))
                h = subprocess.run(in_ns(NODE, sys.executable, "-c", SEND_CODE, SINK[0], str(SINK[1]), str(mib)),
                                   check=True, capture_output=True, text=True, timeout=120)
                runs_host.append(float(h.stdout))
        finally:
            await sb.stop()
        res["tcp_mib_s"] = {
            "sandbox_to_allowed_host": mib / statistics.median(runs_sb),
            "node_to_same_host": mib / statistics.median(runs_host),
            "mib_per_run": mib,
            "runs": 3,
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=40, help="creates of each kind")
    ap.add_argument("--mib", type=int, default=256, help="MiB per throughput run")
    ap.add_argument("--out", default=str(ROOT / "bench/results/network.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces, containers)", file=sys.stderr)
        return 1
    topology_down()
    subprocess.run(["rm", "-rf", str(DATA)], check=False)
    DATA.mkdir(parents=True)
    (DATA / "config.toml").write_text(
        f'[edge]\nstate_dir = "{DATA}/edge"\nimage_store = "{IMAGES}"\n')
    sink = None
    try:
        topology_up()
        sink = subprocess.Popen(in_ns(WORLD, sys.executable, "-c", SINK_CODE, *map(str, SINK)),
                                stdout=subprocess.PIPE, text=True)
        assert sink.stdout and sink.stdout.readline().strip() == "ready"
        dsec("up", "--data-dir", str(DATA), "--listen", API)
        res = asyncio.run(measure(a.n, a.mib))
    finally:
        try:
            dsec("down", "--data-dir", str(DATA))
        except Exception as e:  # noqa: BLE001 - report and keep cleaning up
            print(f"dsec down: {e}", file=sys.stderr)
        if sink:
            sink.kill()
        topology_down()
        subprocess.run(["rm", "-rf", str(DATA)], check=False)
    res["cpus"] = os.cpu_count()
    c = res["create_ms"]
    print(f"create (root/py:3.11, sequential, n={a.n} each; {res['cpus']} CPUs)")
    print(f"  network \"none\":       p50 {c['network_none']['p50']:7.1f} ms  p99 {c['network_none']['p99']:7.1f} ms")
    print(f"  with egress rules:    p50 {c['network_rules']['p50']:7.1f} ms  p99 {c['network_rules']['p99']:7.1f} ms")
    print(f"  network setup adds:   p50 {c['added']['p50']:7.1f} ms  p99 {c['added']['p99']:7.1f} ms")
    t = res["tcp_mib_s"]
    print(f"TCP to an allowed host ({t['mib_per_run']} MiB, median of {t['runs']})")
    print(f"  sandbox -> host:      {t['sandbox_to_allowed_host']:8.0f} MiB/s")
    print(f"  node -> same host:    {t['node_to_same_host']:8.0f} MiB/s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
