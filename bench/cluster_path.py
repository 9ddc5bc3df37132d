# SPDX-License-Identifier: AGPL-3.0-only
"""What the cluster's control plane costs: creates per second through an apiserver next to
the same creates sent straight to one edge, and the latency the apiserver hop adds to cheap
sandbox calls (p50/p99).

    python3 bench/cluster_path.py --count 120 --concurrency 8 --requests 500
Brings up the end-to-end tests' cluster (tests/e2e/cluster_harness.py: 3 IAMs, 2
apiservers, a watcher and 3 edges, each in its own network namespace; needs root) and
always tears it down. "Straight to an edge" is the edge's cluster listener, the one the
apiservers forward to: mutual TLS with the apiserver's cluster certificate and the caller's
principal in `x-dsec-principal` instead of an API key. Every component and this client
share the host's cores, so the figures are for comparing the two paths, not for sizing.

Phases, in this order:
  a) creates (POST /v1/sandboxes, then a DELETE of each, both timed), `--count` at
     `--concurrency`, through api1 to the whole cluster (placement spreads them);
  the apiserver hop: with one sandbox on edge1 (`--hop-cpu` cores), `--requests` sequential
     GET /v1/sandboxes/{id} and exec of `true`, through api1 and straight to edge1,
     interleaved, one keep-alive connection per path;
  b) the same creates straight to edge1, then
  c) through api1 with edge2 and edge3 stopped, so that placement can only use edge1:
     the like-for-like comparison with b (b and c both run with edge2 and edge3 stopped;
     --skip-edge1-only leaves c out and runs b with all edges up). The harness restarts
     the stopped edges at teardown to stop them cleanly.
Prints the figures and writes JSON to bench/results/cluster_path.json (--out).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import ssl
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DSEC_BIN", str(ROOT / "target/debug/dsec"))
sys.path.insert(0, str(ROOT / "tests/e2e"))
sys.path.insert(0, str(ROOT / "sdk/python"))
import cluster_harness as ch  # noqa: E402
from cluster_harness import CERTS, EDGES, HOSTS, Cluster  # noqa: E402
from conftest import DATA, DSEC, dsec  # noqa: E402

# Where an edge's cluster listener takes the caller's principal (set by an apiserver).
PRINCIPAL_HEADER = "x-dsec-principal"
# The principal an apiserver forwards for the bootstrap admin key (root project).
PRINCIPAL = {"name": "bench", "kind": "human", "key_id": "", "project": "root"}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def lat_summary(lat_s: list[float], digits: int = 2) -> dict:
    if not lat_s:
        return {"count": 0}
    return {
        "count": len(lat_s),
        "p50_ms": round(pct(lat_s, 50) * 1000, digits),
        "p90_ms": round(pct(lat_s, 90) * 1000, digits),
        "p99_ms": round(pct(lat_s, 99) * 1000, digits),
        "mean_ms": round(statistics.mean(lat_s) * 1000, digits),
        "max_ms": round(max(lat_s) * 1000, digits),
    }


def principal_header() -> str:
    raw = json.dumps(PRINCIPAL, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def edge_of(sandbox_id: str) -> str:
    return sandbox_id.split("-", 1)[0]


# ---- clients ---------------------------------------------------------------------------


def peer_ssl(check_hostname: bool) -> ssl.SSLContext:
    """Trusts the cluster CA and presents api1's certificate (role apiserver)."""
    ctx = ssl.create_default_context(cafile=str(CERTS / "ca.pem"))
    ctx.check_hostname = check_hostname
    ctx.load_cert_chain(str(CERTS / "api1.pem"), str(CERTS / "api1.key"))
    return ctx


def api_client(cluster: Cluster, api: str = "api1") -> httpx.Client:
    return httpx.Client(base_url=cluster.api_url(api), timeout=180,
                        headers={"Authorization": f"Bearer {cluster.admin_key}"})


def edge_client(edge: str, check_hostname: bool = True) -> httpx.Client:
    return httpx.Client(base_url=f"https://{HOSTS[edge].addr}", timeout=180, verify=peer_ssl(check_hostname),
                        headers={PRINCIPAL_HEADER: principal_header()})


def open_edge(edge: str) -> httpx.Client:
    """A client of `edge`'s cluster listener, checked with GET /v1/status (200). The
    certificates carry the hosts' IPs, so the host name check stays on when it can."""
    last: object = None
    for check_hostname in (True, False):
        c = edge_client(edge, check_hostname)
        try:
            r = c.get("/v1/status")
            if r.status_code == 200:
                if not check_hostname:
                    print(f"  note: {edge}'s certificate did not pass the host name check ({last}); "
                          "going on without it", flush=True)
                return c
            last = f"HTTP {r.status_code}: {r.text[:300]}"
        except (httpx.HTTPError, ssl.SSLError) as e:
            last = f"{type(e).__name__}: {e}"
        c.close()
    raise RuntimeError(f"{edge}'s cluster listener does not take the forwarded principal: {last}")


# ---- creates ---------------------------------------------------------------------------


def create_body(ttl: int) -> dict:
    # The TTL only matters if the bench and its teardown both fail.
    return {"image": "root/base", "memory_limit_mb": 64, "cpu_cores_limit": 0.1, "ttl_seconds": ttl,
            "labels": {"bench": "cluster_path"}}


def create_and_delete(client: httpx.Client, n: int, c: int, body: dict) -> dict:
    """`n` creates at concurrency `c`, then a DELETE of each made at the same concurrency."""
    lock = threading.Lock()
    lat: list[float] = []
    ids: list[str] = []
    errors: list[str] = []

    def create(_: int) -> None:
        t0 = time.perf_counter()
        try:
            r = client.post("/v1/sandboxes", json=body)
            took = time.perf_counter() - t0
            ok = r.status_code == 201
            what = r.json()["id"] if ok else f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ok, what, took = False, f"{type(e).__name__}: {e}", 0.0
        with lock:
            if ok:
                lat.append(took)
                ids.append(what)
            else:
                errors.append(what)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(create, range(n)))
    wall = time.perf_counter() - t0

    del_lat: list[float] = []
    del_errors: list[str] = []

    def delete(sid: str) -> None:
        t = time.perf_counter()
        try:
            r = client.delete(f"/v1/sandboxes/{sid}")
            ok, what = r.is_success, f"{sid}: HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            ok, what = False, f"{sid}: {type(e).__name__}: {e}"
        took = time.perf_counter() - t
        with lock:
            (del_lat.append(took) if ok else del_errors.append(what))

    t1 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        list(pool.map(delete, ids))
    del_wall = time.perf_counter() - t1

    for e in (errors + del_errors)[:5]:
        print(f"    failure: {e}", file=sys.stderr, flush=True)
    return {
        "created": len(ids),
        "failures": len(errors),
        "creates_per_s": round(len(ids) / wall, 2),
        "wall_s": round(wall, 2),
        "create": lat_summary(lat, 1),
        "spread": dict(sorted(Counter(edge_of(i) for i in ids).items())),
        "deleted": len(del_lat),
        "delete_failures": len(del_errors),
        "deletes_per_s": round(len(del_lat) / del_wall, 2) if del_lat else 0.0,
        "delete_wall_s": round(del_wall, 2),
        "delete": lat_summary(del_lat, 1),
        "errors": (errors + del_errors)[:5],
    }


def warm_edges(edges: dict[str, httpx.Client], body: dict) -> None:
    """One create and delete on each edge, so that no phase pays for a first use there."""
    for name, c in edges.items():
        r = c.post("/v1/sandboxes", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"warm-up create on {name} failed: HTTP {r.status_code}: {r.text[:300]}")
        c.delete(f"/v1/sandboxes/{r.json()['id']}").raise_for_status()


def stop_edges_for_placement(cluster: Cluster, api: httpx.Client, stop: tuple[str, ...], timeout: float = 90) -> float:
    """Stops `stop` (SIGTERM; the harness restarts them at teardown to stop cleanly) and
    waits until api1's view has them unhealthy; returns how long that took."""
    cluster._terminate(stop, 120)
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < timeout:
        try:
            r = api.get("/v1/status")
            r.raise_for_status()
            last = {n["name"]: n["healthy"] for n in r.json()["nodes"]}
            if last.get("edge1") and not any(last.get(e) for e in stop):
                return time.monotonic() - t0
        except (httpx.HTTPError, KeyError, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"api1 still sees {stop} as healthy after {timeout} s: {last}")


# ---- the apiserver hop -----------------------------------------------------------------


def hop(paths: dict[str, httpx.Client], method: str, url: str, body: dict | None, m: int, warmup: int) -> dict:
    """`m` sequential requests on each path, interleaved (the order alternating) so that
    load from elsewhere on the host falls on both alike."""
    names = list(paths)

    def once(name: str) -> float:
        t0 = time.perf_counter()
        r = paths[name].request(method, url, json=body)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{method} {url} via {name}: HTTP {r.status_code}: {r.text[:300]}")
        if body is not None and r.json().get("exit_code") != 0:
            raise RuntimeError(f"exec via {name} did not exit 0: {r.text[:300]}")
        return took

    for _ in range(warmup):
        for n in names:
            once(n)
    lat: dict[str, list[float]] = {n: [] for n in names}
    for i in range(m):
        for n in (names if i % 2 == 0 else names[::-1]):
            lat[n].append(once(n))
    api, edge = names
    out = {n: lat_summary(lat[n], 3) for n in names}
    out["added_p50_ms"] = round(out[api]["p50_ms"] - out[edge]["p50_ms"], 3)
    out["added_p99_ms"] = round(out[api]["p99_ms"] - out[edge]["p99_ms"], 3)
    # The median of the per-pair differences: less sensitive to drift over the run.
    out["added_paired_median_ms"] = round(statistics.median(a - b for a, b in zip(lat[api], lat[edge])) * 1000, 3)
    return out


# ---- main ------------------------------------------------------------------------------


def host_note() -> dict:
    cpus = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cpus
    return {"host_cpus": cpus, "usable_cpus": usable, "loadavg": os.getloadavg()}


def print_results(out: dict) -> None:
    h = out["host"]
    print(f"\nhost: {h['host_cpus']} CPUs ({h['usable_cpus']} usable), load average {h['loadavg'][0]:.2f} at start; "
          "3 IAMs, 2 apiservers, the watcher, 3 edges, their sandboxes and this client all share them")
    print(f"\ncreates: {out['count']} at concurrency {out['concurrency']} "
          "(POST /v1/sandboxes, root/base, 64 MB, 0.1 core), then DELETE of each")
    print(f"{'':26} {'creates/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'fail':>5} {'deletes/s':>9} {'del p50':>8} "
          f"{'del p99':>8}  spread")
    labels = {"api_cluster": "api1 -> 3 edges", "edge1_direct": "straight to edge1",
              "api_edge1_only": "api1 -> edge1 only"}
    for k, label in labels.items():
        r = out["creates"].get(k)
        if r is None:
            continue
        print(f"{label:26} {r['creates_per_s']:9.1f} {r['create'].get('p50_ms', 0):8.1f} "
              f"{r['create'].get('p99_ms', 0):8.1f} {r['failures']:5d} {r['deletes_per_s']:9.1f} "
              f"{r['delete'].get('p50_ms', 0):8.1f} {r['delete'].get('p99_ms', 0):8.1f}  {r['spread']}")
    c = out["creates"]
    if "api_edge1_only" in c and c["edge1_direct"]["creates_per_s"]:
        ratio = c["api_edge1_only"]["creates_per_s"] / c["edge1_direct"]["creates_per_s"]
        print(f"through api1 to edge1 alone: {ratio:.0%} of the creates/s straight to edge1; "
              f"p50 {c['api_edge1_only']['create']['p50_ms'] - c['edge1_direct']['create']['p50_ms']:+.1f} ms")
    if c["edge1_direct"]["creates_per_s"]:
        ratio = c["api_cluster"]["creates_per_s"] / c["edge1_direct"]["creates_per_s"]
        print(f"through api1 to 3 edges: {ratio:.2f}x the creates/s straight to one edge")

    print(f"\napiserver hop: {out['requests']} sequential requests per path, interleaved, keep-alive; one sandbox "
          f"on edge1 ({out['hop']['sandbox_cpu_cores_limit']:g} core)")
    print(f"{'':28} {'api1 p50':>9} {'api1 p99':>9} {'edge p50':>9} {'edge p99':>9} {'+p50 ms':>8} {'+p99 ms':>8} "
          f"{'+paired':>8}")
    for k, label in (("get", "GET /v1/sandboxes/{id}"), ("exec", "POST .../exec `true`")):
        r = out["hop"][k]
        print(f"{label:28} {r['api1']['p50_ms']:9.2f} {r['api1']['p99_ms']:9.2f} {r['edge1']['p50_ms']:9.2f} "
              f"{r['edge1']['p99_ms']:9.2f} {r['added_p50_ms']:8.2f} {r['added_p99_ms']:8.2f} "
              f"{r['added_paired_median_ms']:8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=120, help="sandboxes created per create phase")
    ap.add_argument("--concurrency", type=int, default=8, help="creates (and deletes) in flight")
    ap.add_argument("--requests", type=int, default=500, help="sequential GETs and execs per path for the hop")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests per path before the hop is timed")
    ap.add_argument("--hop-cpu", type=float, default=1.0,
                    help="cpu_cores_limit of the hop's sandbox (enough that its execs are not throttled)")
    ap.add_argument("--ttl", type=int, default=1800, help="TTL of the bench's sandboxes (a safety net)")
    ap.add_argument("--skip-edge1-only", action="store_true",
                    help="leave out phase c (through api1 with edge2 and edge3 stopped)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/cluster_path.json"))
    a = ap.parse_args()

    if os.geteuid() != 0:
        sys.exit("the cluster bench creates network namespaces and containers: run it as root")
    why = ch.netns_available()
    if why:
        sys.exit(f"the cluster bench needs network namespaces: {why}")
    # A SIGTERM (e.g. from `timeout`) still tears the cluster down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    print(f"dsec: {DSEC}; images in {DATA / 'images'}", flush=True)
    dsec("image", "build", str(ROOT / "images/base.toml"), "--if-missing", "--data-dir", str(DATA), timeout=1800)
    out: dict = {"bench": "cluster_path", "count": a.count, "concurrency": a.concurrency, "requests": a.requests,
                 "host": host_note(),
                 "note": "all components (3 IAMs, 2 apiservers, watcher, 3 edges) and the client share "
                         "the host's cores"}
    body = create_body(a.ttl)
    cluster = Cluster()
    clients: list[httpx.Client] = []
    try:
        print("bringing up the cluster (3 IAMs, 2 apiservers, a watcher, 3 edges)", flush=True)
        t0 = time.monotonic()
        cluster.up()
        print(f"  up in {time.monotonic() - t0:.1f} s", flush=True)
        api = api_client(cluster)
        clients.append(api)
        edges = {e: open_edge(e) for e in EDGES}
        clients += edges.values()
        edge1 = edges["edge1"]
        print("  edges answer GET /v1/status on their cluster listeners with the forwarded principal", flush=True)
        warm_edges(edges, body)

        creates: dict = {}
        out["creates"] = creates
        print(f"a) {a.count} creates through api1 (3 edges), concurrency {a.concurrency}", flush=True)
        creates["api_cluster"] = create_and_delete(api, a.count, a.concurrency, body)
        print(f"apiserver hop: {a.requests} GETs and {a.requests} execs per path", flush=True)
        # At 0.1 core (the creates' limit) the sandbox's CFS quota is 10 ms per 100 ms, and
        # execs stall up to ~90 ms waiting for the next period on both paths alike.
        r = edge1.post("/v1/sandboxes", json={**body, "cpu_cores_limit": a.hop_cpu})
        if r.status_code != 201:
            raise RuntimeError(f"creating the hop's sandbox on edge1 failed: HTTP {r.status_code}: {r.text[:300]}")
        sid = r.json()["id"]
        try:
            paths = {"api1": api, "edge1": edge1}
            out["hop"] = {
                "sandbox": sid,
                "sandbox_cpu_cores_limit": a.hop_cpu,
                "get": hop(paths, "GET", f"/v1/sandboxes/{sid}", None, a.requests, a.warmup),
                "exec": hop(paths, "POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]}, a.requests, a.warmup),
            }
        finally:
            edge1.delete(f"/v1/sandboxes/{sid}")

        # b and c back to back, under the same conditions (edge2 and edge3 stopped for both
        # unless c is skipped), so that the difference between them is the apiserver's.
        if not a.skip_edge1_only:
            print("stopping edge2 and edge3 so that api1 can only place on edge1", flush=True)
            took = stop_edges_for_placement(cluster, api, ("edge2", "edge3"))
            print(f"  api1 saw them unhealthy {took:.1f} s after they stopped", flush=True)
        out["edge2_edge3_stopped_for_b_and_c"] = not a.skip_edge1_only
        print(f"b) {a.count} creates straight to edge1, concurrency {a.concurrency}", flush=True)
        creates["edge1_direct"] = create_and_delete(edge1, a.count, a.concurrency, body)
        if not a.skip_edge1_only:
            print(f"c) {a.count} creates through api1 (edge1 only), concurrency {a.concurrency}", flush=True)
            creates["api_edge1_only"] = create_and_delete(api, a.count, a.concurrency, body)
        out["host"]["loadavg_end"] = os.getloadavg()
    finally:
        for c in clients:
            c.close()
        print("tearing the cluster down", flush=True)
        left = cluster.down()
        if left:
            print(f"  teardown had to force these away: {left}", file=sys.stderr, flush=True)
        left_ns = ch.namespaces()
        if left_ns:
            print(f"  namespaces still there: {left_ns}", file=sys.stderr, flush=True)

    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print_results(out)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
