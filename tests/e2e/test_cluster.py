# SPDX-License-Identifier: AGPL-3.0-only
"""A whole cluster on one machine (see cluster_harness): 3 IAMs, 2 apiservers, a watcher
and 3 edges, each in its own network namespace. Creates spread over the edges and quotas
stay exact across apiservers; sandboxes keep running through kill -9 of the IAM leader, an
apiserver, the watcher and an edge, with creates and execs back within seconds; delegation
nests without escalation; internal listeners only talk to peers with a certificate of the
cluster's CA, and projects cannot see each other's sandboxes.

Run with `-s` to see the figures (spread, creates/s, recovery times)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable

import grpc
import httpx
import pytest

import cluster_harness as ch
import grpc_stubs
from cluster_harness import APIS, EDGES, HOSTS, Cluster
from opendsec import DSecClient, DSecRunArgs, NotFoundError, ResourceExhaustedError, Sandbox, SandboxInfo
from opendsec.errors import DSecError

# Small sandboxes; the TTL only matters if a test and its cleanup both fail.
SMALL = dict(image="root/base", memory_limit_mb=64, cpu_cores_limit=0.1, ttl_seconds=1800)
# A shell loop the faults must not interrupt: /tmp/c counts up 5 times a second. Each
# value is renamed into place, so a read never sees the file between its truncation and
# its write (empty).
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/c; sleep 0.2; done"
RECOVERY_S = 15.0
# How long a recovery is waited for (beyond the limit, so that a slow one is still measured).
GIVE_UP_S = RECOVERY_S + 10.0
# Answers that refuse an action for lack of rights (as on one node: 403, or 404 for
# something outside the key's project).
DENIED = {"permission_denied", "not_found"}


@pytest.fixture(scope="module")
def cluster(server):
    why = ch.netns_available()
    if why:
        pytest.skip(f"the cluster tests need network namespaces: {why}")
    c = Cluster()
    try:
        c.up()
        yield c
    finally:
        left = c.down()
    assert not left, f"the cluster left these behind after an orderly stop: {left}"


# ---- helpers -------------------------------------------------------------------------


def _client(cluster: Cluster, api: str, key: str | None = None) -> DSecClient:
    """A client of apiserver `api` with `key` (default: the bootstrap admin key)."""
    return DSecClient(api_url=cluster.api_url(api), api_key=key or cluster.admin_key)


def _edge_of(sandbox_id: str) -> str:
    return sandbox_id.split("-", 1)[0]


async def _gather_limited(coros: list, limit: int) -> list:
    """Awaits all, at most `limit` at a time; exceptions are returned, not raised."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)


def _split(results: list) -> tuple[list[Sandbox], list[BaseException]]:
    return ([r for r in results if isinstance(r, Sandbox)],
            [r for r in results if not isinstance(r, Sandbox)])


async def _stop_all(sandboxes: list[Sandbox]) -> list[BaseException]:
    """Stops them (each through the client that made it); returns the failures."""
    results = await _gather_limited([s.stop() for s in sandboxes], 32)
    return [r for r in results if isinstance(r, BaseException)]


async def _refused(coro, codes: set[str]) -> DSecError:
    """Awaits `coro`, which must fail with one of `codes` (not a transport or server error)."""
    with pytest.raises(DSecError) as e:
        await coro
    assert e.value.code in codes, f"expected one of {codes}, got {e.value!r}"
    return e.value


# ---- 1. spread and exact quota --------------------------------------------------------


@pytest.mark.skipif(not shutil.which("prometheus"), reason="Prometheus is not installed (deploy/deps.sh installs it)")
async def test_prometheus_scrapes_every_role(cluster):
    """Debian's Prometheus scrapes all nine components on their mutual-TLS listeners with
    a `monitor` certificate (admitted to GET /metrics and nothing else) and the apiservers'
    public API with the admin key; its queries return the creates, execs and latency
    histograms this test caused and the IAM replica the cluster calls its leader."""
    from test_metrics import Prometheus

    cert, key = ch.issue_cert(ch.CERTS, "monitor", "prom")
    tls = (f"    scheme: https\n"
           f"    tls_config: {{ca_file: '{ch.CERTS / 'ca.pem'}', cert_file: '{cert}', key_file: '{key}'}}\n")
    members = ", ".join(f"'{h.addr}'" for h in HOSTS.values())
    apis = ", ".join(f"'{HOSTS[a].public_addr}'" for a in APIS)
    jobs = ("  - job_name: cluster\n" + tls + f"    static_configs: [{{targets: [{members}]}}]\n"
            "  - job_name: api\n"
            f"    authorization: {{type: Bearer, credentials: '{cluster.admin_key}'}}\n"
            f"    static_configs: [{{targets: [{apis}]}}]\n")
    # The monitor certificate reads metrics only: an edge's API and IAM's are closed to it.
    mctx = ch.tls_context(ch.CERTS / "ca.pem", cert, key)
    assert ch.tls_get(HOSTS["edge1"].addr, "/metrics", mctx)[0] == 200
    for host, path in (("edge1", "/v1/sandboxes"), ("iam1", "/iam/leader"), ("api1", "/healthz")):
        code, body = ch.tls_get(HOSTS[host].addr, path, mctx)
        assert code == 403 and b"GET /metrics only" in body, (host, path, code, body)
    prom = Prometheus(jobs=jobs)
    try:
        n = len(HOSTS)
        assert prom.until('count(up{job="cluster"} == 1)', lambda v: v == n, timeout=60) == n, \
            prom.query('up{job="cluster"}')
        assert prom.until('count(up{job="api"} == 1)', lambda v: v == 2) == 2
        created = 'sum(dsec_sandbox_creates_total{job="cluster",outcome="ok"})'
        latency = 'sum(dsec_sandbox_create_seconds_count{job="cluster"})'
        execs = 'sum(dsec_exec_seconds_count{job="cluster"})'
        before = {q: prom.value(q) or 0.0 for q in (created, latency, execs)}
        async with _client(cluster, "api1") as c:
            made = [await c.run_sandbox(DSecRunArgs(**SMALL, labels={"t": "prom"})) for _ in range(3)]
            try:
                for s in made[:2]:
                    assert (await s.run_shell("echo hi")).stdout == "hi\n"
            finally:
                for s in made:
                    await s.stop()
        for q, more in ((created, 3), (latency, 3), (execs, 2)):
            want = before[q] + more
            assert prom.until(q, lambda v, w=want: v >= w) == want, (q, before[q], prom.value(q))
        # The creates landed on the edges that made them.
        by_edge = Counter(_edge_of(s.id) for s in made)
        for edge, k in by_edge.items():
            q = f'sum(dsec_sandbox_creates_total{{job="cluster",instance="{HOSTS[edge].addr}",outcome="ok"}})'
            assert (prom.value(q) or 0) >= k, (edge, q)
        p50 = prom.value(f'histogram_quantile(0.5, sum by (le) ({latency.replace("_count", "_bucket")[4:-1]}))')
        assert p50 is not None and p50 > 0, p50
        # One replica leads, the one the cluster calls its leader, and every replica has a term.
        leader = cluster.iam_leader()
        lead = prom.until('count(dsec_iam_raft_leader{job="cluster"} == 1)', lambda v: v == 1)
        assert lead == 1, prom.query('dsec_iam_raft_leader{job="cluster"}')
        who = prom.query('dsec_iam_raft_leader{job="cluster"} == 1')[0]["metric"]["instance"]
        assert who == HOSTS[leader].addr, (who, leader)
        assert prom.value('count(dsec_iam_raft_term{job="cluster"} >= 1)') == 3
        # The apiservers counted the creates they forwarded.
        posts = 'sum(dsec_http_requests_total{job="api",role="apiserver",route="/v1/sandboxes",method="POST"})'
        assert (prom.until(posts, lambda v: v >= 3) or 0) >= 3
        print(f"\nPrometheus scraped {n} components over mTLS and 2 apiservers; create p50 {p50:.3f} s")
    finally:
        prom.close()


async def test_spread_and_exact_quota(cluster):
    async with _client(cluster, "api1") as a1, _client(cluster, "api2") as a2:
        made: list[Sandbox] = []
        try:
            n = 300
            t0 = time.monotonic()
            results = await _gather_limited(
                [(a1, a2)[i % 2].run_sandbox(DSecRunArgs(**SMALL, labels={"test": "spread"})) for i in range(n)], 16)
            took = time.monotonic() - t0
            made, failed = _split(results)
            assert not failed, f"{len(failed)} of {n} creates failed, e.g. {failed[:3]}"
            counts = Counter(_edge_of(s.id) for s in made)
            print(f"\nspread of {n} sandboxes: {dict(sorted(counts.items()))}; "
                  f"{n / took:.1f} creates/s ({took:.1f} s at concurrency 16)", flush=True)
            assert set(counts) == set(EDGES), counts
            for e in EDGES:
                assert 60 <= counts[e] <= 140, counts
            # One usage call through either apiserver covers every edge's sandboxes.
            used = (await a2.usage(labels={"test": "spread"}))["sandboxes"]
            assert sorted(u["id"] for u in used) == sorted(s.id for s in made)
            await _exact_quota_across_apiservers(cluster, a1)
        finally:
            stop_failures = await _stop_all(made)
        assert not stop_failures, stop_failures[:3]
        assert await a2.list_sandboxes(labels={"test": "spread"}) == []


async def _exact_quota_across_apiservers(cluster: Cluster, admin: DSecClient) -> None:
    """70 concurrent creates against a quota of 50, half through each apiserver."""
    project = "root/q50"
    await admin.create_project(project, sandboxes=50)
    key = (await admin.create_key("q50-agent", project=project, agent=True))["key"]
    args = DSecRunArgs(**SMALL, project=project)
    async with _client(cluster, "api1", key) as k1, _client(cluster, "api2", key) as k2:
        ok: list[Sandbox] = []
        try:
            ok, refused = _split(await asyncio.gather(*((k1, k2)[i % 2].run_sandbox(args) for i in range(70)),
                                                      return_exceptions=True))
            print(f"quota 50, 70 concurrent creates: {len(ok)} made, {len(refused)} refused", flush=True)
            assert len(ok) == 50, [r for r in refused if not isinstance(r, ResourceExhaustedError)][:3]
            assert all(isinstance(r, ResourceExhaustedError) and r.status == 429 and r.code == "resource_exhausted"
                       for r in refused), refused[:3]
            assert all(s.info.project == project for s in ok)
            with pytest.raises(ResourceExhaustedError):
                await k2.run_sandbox(args)
            # A stop through one apiserver frees the slot for a create through the other,
            # and only that one.
            await Sandbox(k1, ok.pop().info).stop()
            ok.append(await k2.run_sandbox(args))
            with pytest.raises(ResourceExhaustedError):
                await k1.run_sandbox(args)
        finally:
            stop_failures = await _stop_all(ok)
        assert not stop_failures, stop_failures[:3]


# ---- 2. faults ------------------------------------------------------------------------


class CounterWatch:
    """Reads every sandbox's /tmp/c in a loop, alternating between the apiservers, and
    keeps every reading. Failed reads (a component is down) are only counted."""

    def __init__(self, clients: list[DSecClient], infos: list[SandboxInfo]):
        self.clients = clients
        self.infos = infos
        self.readings: dict[str, list[int]] = {i.id: [] for i in infos}
        self.failed = 0
        self._stop = asyncio.Event()

    async def _read(self, client: DSecClient, info: SandboxInfo) -> None:
        try:
            r = await asyncio.wait_for(Sandbox(client, info).exec(["cat", "/tmp/c"]), 5)
        except (DSecError, asyncio.TimeoutError):
            self.failed += 1
            return
        if r.exit_code == 0 and r.stdout.strip().isdigit():
            self.readings[info.id].append(int(r.stdout))

    async def run(self) -> None:
        n = 0
        while not self._stop.is_set():
            client = self.clients[n % len(self.clients)]
            n += 1
            await asyncio.gather(*(self._read(client, i) for i in self.infos))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()

    def latest(self) -> dict[str, int]:
        return {k: v[-1] for k, v in self.readings.items() if v}

    async def wait_all_read(self, timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        while len(self.latest()) < len(self.infos):
            assert time.monotonic() < end, f"unread sandboxes: {set(self.readings) - set(self.latest())}"
            await asyncio.sleep(0.1)


async def _two_per_edge(clients: list[DSecClient], args: DSecRunArgs) -> list[Sandbox]:
    """Creates sandboxes until every edge runs two of them; stops the extra ones. Placement
    samples nodes at random (power of two choices), so an edge may be passed over for a
    few rounds."""
    kept: dict[str, list[Sandbox]] = {e: [] for e in EDGES}
    extra: list[Sandbox] = []
    try:
        for _ in range(40):
            missing = sum(max(0, 2 - len(v)) for v in kept.values())
            if not missing:
                break
            made, failed = _split(await asyncio.gather(*(clients[i % 2].run_sandbox(args) for i in range(missing)),
                                                       return_exceptions=True))
            for sb in made:
                edge = kept.get(_edge_of(sb.id))
                (edge if edge is not None and len(edge) < 2 else extra).append(sb)
            assert not failed, failed[:3]
        assert all(len(v) == 2 for v in kept.values()), {e: len(v) for e, v in kept.items()}
    except BaseException:
        extra += [s for v in kept.values() for s in v]
        raise
    finally:
        await _stop_all(extra)
    return [s for v in kept.values() for s in v]


async def _time_to_create(clients: list[DSecClient], args: DSecRunArgs, t0: float) -> float:
    """Seconds from t0 until a create succeeds (the sandbox is stopped again)."""
    n = 0
    while time.monotonic() - t0 < GIVE_UP_S:
        client = clients[n % len(clients)]
        n += 1
        try:
            sb = await asyncio.wait_for(client.run_sandbox(args), 5)
        except (DSecError, asyncio.TimeoutError):
            await asyncio.sleep(0.1)
            continue
        took = time.monotonic() - t0
        try:
            await sb.stop()
        except DSecError:
            pass  # the teardown stops it
        return took
    return float("inf")


async def _time_to_exec(clients: list[DSecClient], infos: list[SandboxInfo], t0: float) -> float:
    """Seconds from t0 until every sandbox has answered an exec."""
    pending = {i.id: i for i in infos}

    async def answers(client: DSecClient, info: SandboxInfo) -> bool:
        try:
            r = await asyncio.wait_for(Sandbox(client, info).exec(["cat", "/tmp/c"]), 5)
        except (DSecError, asyncio.TimeoutError):
            return False
        return r.exit_code == 0

    n = 0
    while pending and time.monotonic() - t0 < GIVE_UP_S:
        client = clients[n % len(clients)]
        n += 1
        ok = await asyncio.gather(*(answers(client, i) for i in pending.values()))
        for sid, answered in zip(list(pending), ok):
            if answered:
                del pending[sid]
        if pending:
            await asyncio.sleep(0.1)
    return time.monotonic() - t0 if not pending else float("inf")


async def _fault(cluster: Cluster, target: str, clients: dict[str, DSecClient],
                 args: DSecRunArgs, infos: list[SandboxInfo]) -> None:
    """kill -9 of `target` ("iam-leader" or a host name), the recovery times measured while
    it is down (for an edge: creates while down, execs until its sandboxes answer after a
    restart), then it is restarted."""
    victim = await asyncio.to_thread(cluster.iam_leader) if target == "iam-leader" else target
    cluster.kill9(victim)
    t0 = time.monotonic()
    alive = [clients[a] for a in APIS if cluster.alive(a)]
    if HOSTS[victim].role == "edge":
        create_s = await _time_to_create(alive, args, t0)
        cluster.start(victim)
        exec_s = await _time_to_exec(alive, infos, t0)
    else:
        create_s, exec_s = await asyncio.gather(_time_to_create(alive, args, t0), _time_to_exec(alive, infos, t0))
        cluster.start(victim)
    restart_s = await asyncio.to_thread(cluster.wait_healthy, victim)
    print(f"kill -9 {victim} ({target}): a create succeeds after {create_s:.2f} s, every sandbox answers "
          f"after {exec_s:.2f} s; healthy {restart_s:.2f} s after its restart", flush=True)
    assert create_s < RECOVERY_S, f"no create within {RECOVERY_S} s after kill -9 of {victim}"
    assert exec_s < RECOVERY_S, f"sandboxes not all answering within {RECOVERY_S} s after kill -9 of {victim}"


async def _iam_intact(cluster: Cluster, project: str, key: str, key_id: str) -> None:
    """The project and the key made before the faults are there, through every apiserver."""
    for api in APIS:
        async with _client(cluster, api) as admin:
            assert project in {p["path"] for p in await admin.projects()}, api
            assert key_id in {k.get("key_id") for k in await admin.keys()}, api
        async with _client(cluster, api, key) as agent:
            assert (await agent.whoami())["project"] == project, api


async def test_faults_keep_sandboxes(cluster):
    project = "root/faults"
    async with _client(cluster, "api1") as admin:
        await admin.create_project(project, sandboxes=50)
        made_key = await admin.create_key("faults-agent", project=project, agent=True)
    key = made_key["key"]
    args = DSecRunArgs(**SMALL, project=project)
    async with _client(cluster, "api1", key) as k1, _client(cluster, "api2", key) as k2:
        clients = {"api1": k1, "api2": k2}
        sandboxes: list[Sandbox] = []
        try:
            sandboxes = await _two_per_edge([k1, k2], args)
            for sb in sandboxes:
                await sb.exec_background(cmd=COUNTER, timeout=1800, tag="counter")
            infos = [s.info for s in sandboxes]
            watch = CounterWatch([k1, k2], infos)
            task = asyncio.create_task(watch.run())
            try:
                await watch.wait_all_read()
                before = watch.latest()
                for target in ("iam-leader", "api1", "watcher", "edge2"):
                    await _fault(cluster, target, clients, args, infos)
                    await _iam_intact(cluster, project, key, made_key["key_id"])
                await asyncio.to_thread(cluster.wait_edges_healthy)
                await asyncio.sleep(1.0)
            finally:
                watch.stop()
                await task
            reads = sum(len(v) for v in watch.readings.values())
            print(f"workload: {reads} counter reads, {watch.failed} failed while components were down", flush=True)
            _assert_counters_ran_through(watch, before)
            await _assert_counters_still_run(k1, infos)
        finally:
            stop_failures = await _stop_all(sandboxes)
        assert not stop_failures, stop_failures[:3]


def _assert_counters_ran_through(watch: CounterWatch, before: dict[str, int]) -> None:
    """Every counter only ever went up (its loop was never restarted) and is past where it
    was before the faults."""
    for sid, values in watch.readings.items():
        assert all(a <= b for a, b in zip(values, values[1:])), f"{sid}'s counter went back: {values}"
        assert values[-1] > before[sid], f"{sid}'s counter stopped at {values[-1]}"


async def _assert_counters_still_run(client: DSecClient, infos: list[SandboxInfo]) -> None:
    async def read(info: SandboxInfo) -> int:
        return int((await Sandbox(client, info).exec(["cat", "/tmp/c"])).stdout)

    first = await asyncio.gather(*(read(i) for i in infos))
    await asyncio.sleep(1.0)
    second = await asyncio.gather(*(read(i) for i in infos))
    stalled = [i.id for i, a, b in zip(infos, first, second) if b <= a]
    assert not stalled, f"counter loops no longer running in {stalled}"


# ---- 3. nested delegation -------------------------------------------------------------


async def test_nested_delegation(cluster):
    team, sub = "root/team", "root/team/sub"
    async with _client(cluster, "api1") as admin:
        await admin.create_project(team, sandboxes=20, cpu_cores=4, memory_mb=4096)
        team_key = (await admin.create_key("team-agent", project=team, agent=True))["key"]
    async with _client(cluster, "api2", team_key) as agent:
        await agent.create_project(sub, sandboxes=5)
        # A sub-project cannot get more than the team has.
        over = {"permission_denied", "resource_exhausted", "invalid_argument"}
        await _refused(agent.create_project(f"{team}/big", sandboxes=30), over)
        await _refused(agent.set_quota(sub, sandboxes=30), over)
        # Nor can the agent raise its own project's quota or reach outside it.
        await _refused(agent.set_quota(team, sandboxes=1000), DENIED)
        await _refused(agent.create_project("root/elsewhere"), DENIED)
        quotas = {p["path"]: p["quota"] for p in await agent.projects()}
        assert set(quotas) == {team, sub}, quotas
        assert quotas[sub]["sandboxes"] == 5 and quotas[team]["sandboxes"] == 20, quotas
        sub_key = (await agent.create_key("sub-agent", project=sub, agent=True))["key"]
    async with _client(cluster, "api1", sub_key) as s1, _client(cluster, "api2", sub_key) as s2:
        ok: list[Sandbox] = []
        try:
            ok, refused = _split(await asyncio.gather(
                *((s1, s2)[i % 2].run_sandbox(DSecRunArgs(**SMALL)) for i in range(7)), return_exceptions=True))
            print(f"\n{sub} (quota 5): {len(ok)} of 7 concurrent creates made", flush=True)
            assert len(ok) == 5 and all(isinstance(r, ResourceExhaustedError) for r in refused), refused
            assert all(s.info.project == sub for s in ok)
        finally:
            stop_failures = await _stop_all(ok)
        assert not stop_failures, stop_failures[:3]


async def test_events_of_every_edge_through_either_apiserver(cluster):
    """`GET /v1/events` through an apiserver merges every edge's events: paged from a
    cursor, each event comes once, in order; a long poll wakes on a new one; another
    project sees none of them."""
    team, other = "root/ev-team", "root/ev-other"
    async with _client(cluster, "api1") as admin:
        await admin.create_project(team, sandboxes=12)
        await admin.create_project(other, sandboxes=2)
        key = (await admin.create_key("ev", project=team, agent=True))["key"]
        okey = (await admin.create_key("ev-other", project=other, agent=True))["key"]
    async with _client(cluster, "api1", key) as c1, _client(cluster, "api2", key) as c2, \
            _client(cluster, "api2", okey) as o:
        start = (await c2.events(limit=1, newest_first=True))["next"]
        made: list[Sandbox] = []
        try:
            made = list(await asyncio.gather(
                *((c1, c2)[i % 2].run_sandbox(DSecRunArgs(**SMALL)) for i in range(8))))
            assert len({_edge_of(s.id) for s in made}) >= 2, [s.id for s in made]
        finally:
            assert not await _stop_all(made)
        want = {(t, s.id) for s in made for t in ("created", "stopped")}
        seen: list[dict] = []
        after = start
        for _ in range(40):
            page = await c1.events(after=after, limit=3)
            seen += page["events"]
            assert page["next"] >= after
            after = page["next"]
            if {(e["type"], e["sandbox"]) for e in seen} >= want:
                break
        got = [(e["type"], e["sandbox"]) for e in seen]
        assert set(got) == want and len(got) == len(want), got
        assert [e["seq"] for e in seen] == sorted(e["seq"] for e in seen)
        assert {e["edge"] for e in seen} == {_edge_of(s.id) for s in made}
        # Newest first, with an offset, through the other apiserver.
        newest = (await c2.events(after=start, limit=2, offset=1, newest_first=True))["events"]
        assert [e["id"] for e in newest] == [e["id"] for e in reversed(seen)][1:3]
        assert (await o.events(after=start))["events"] == []
        # A long poll through api2 wakes on an event of any edge.
        t0 = time.monotonic()
        waiting = asyncio.create_task(c2.events(after=after, wait_seconds=30))
        await asyncio.sleep(0.5)
        sb = await c1.run_sandbox(DSecRunArgs(**SMALL))
        try:
            polled = await asyncio.wait_for(waiting, 40)
            assert [(e["type"], e["sandbox"]) for e in polled["events"]] == [("created", sb.id)], polled
            assert time.monotonic() - t0 < 20, "the long poll did not wake on the event"
        finally:
            await sb.stop()
        # Webhooks stay a single node's: the apiserver says so.
        async with httpx.AsyncClient(base_url=cluster.api_url("api1"),
                                     headers={"Authorization": f"Bearer {key}"}) as raw:
            r = await raw.get("/v1/webhooks")
            assert r.status_code == 501 and "GET /v1/events is served" in r.json()["message"], r.text


# ---- 4. mTLS and isolation ------------------------------------------------------------


async def test_mtls_and_isolation(cluster):
    for name in ("edge1", "iam1"):
        _assert_needs_cluster_certificate(cluster, name)
    await _assert_projects_isolated(cluster)


def _tls_call(addr: str, ctx, method: str, path: str, headers: dict[str, str] | None = None,
              body: bytes = b"") -> tuple[int, str]:
    """One HTTP/1.1 request over TLS with `ctx`'s client certificate: (status, body)."""
    import socket

    host, port = addr.rsplit(":", 1)
    head = f"{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(head.encode() + b"\r\n" + body)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")


async def test_a_node_certificate_cannot_act_for_anyone(cluster):
    """An escaped edge holds its own certificate. With it, it cannot act as the
    administrator on another edge (a forged principal header is not honoured) nor write
    projects, quotas or keys to IAM; an apiserver's certificate can do both."""
    import base64
    import json as _json

    admin = {"name": "admin", "kind": "human", "key_id": "", "project": "root"}
    forged = {"x-dsec-principal": base64.urlsafe_b64encode(_json.dumps(admin).encode()).decode().rstrip("=")}
    edge2 = ch.tls_context(ch.CERTS / "ca.pem", ch.CERTS / "edge2.pem", ch.CERTS / "edge2.key")
    api1 = cluster.peer_context()
    status, text = _tls_call(HOSTS["edge1"].addr, edge2, "GET", "/v1/sandboxes", forged)
    print(f"\nedge2's certificate listing edge1's sandboxes as the admin: {status} {text[:160]}")
    assert status == 401, text
    status, _ = _tls_call(HOSTS["edge1"].addr, api1, "GET", "/v1/sandboxes", forged)
    assert status == 200, "an apiserver's forwarded principal must still work"
    # IAM's service is gRPC: the escaped edge's certificate may not write a project; an
    # apiserver's may.
    _, _, iam_pb2, iam_pb2_grpc, _ = grpc_stubs.load()
    tag = str(int(time.time() * 1000))
    cmd = iam_pb2.Command(create_project=iam_pb2.CreateProject(actor="root", path=f"root/edge-made-{tag}"))
    with _grpc_channel("iam1", "edge2") as ch_:
        with pytest.raises(grpc.RpcError) as refused:
            iam_pb2_grpc.IamStub(ch_).Apply(cmd, timeout=10)
    print(f"edge2's certificate creating a project in IAM: {refused.value.code()} {refused.value.details()}")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    with _grpc_channel("iam1", "api1") as ch_:
        iam_pb2_grpc.IamStub(ch_).Apply(cmd, timeout=15)
    async with _client(cluster, "api1") as admin:
        assert f"root/edge-made-{tag}" in {p["path"] for p in await admin.projects()}


def _grpc_channel(host: str, cert: str | None, ca_dir=None) -> grpc.Channel:
    """A gRPC channel to `host`'s cluster listener presenting `cert`'s certificate (from
    the cluster's CA, or the CA in `ca_dir`); `cert` None: plaintext HTTP/2."""
    addr = HOSTS[host].addr
    if cert is None:
        return grpc.insecure_channel(addr)
    d = ca_dir or ch.CERTS
    creds = grpc.ssl_channel_credentials(
        root_certificates=(ch.CERTS / "ca.pem").read_bytes(),
        private_key=(d / f"{cert}.key").read_bytes(),
        certificate_chain=(d / f"{cert}.pem").read_bytes(),
    )
    return grpc.secure_channel(addr, creds)


# A listener that refuses the connection (at the handshake, or right after it for a role it
# does not admit) gives the client no answer: gRPC reports the channel unavailable, or the
# deadline passing while it tries again.
NO_ANSWER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def _grpc_code(call) -> grpc.StatusCode:
    """The status code `call()` fails with (OK if it answers)."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_grpc_listeners_take_calls_from_cluster_peers_only(cluster):
    """The roles' gRPC services, called by a separate gRPC implementation (gRPC C-core,
    stubs generated by protoc from proto/): an edge answers an apiserver's certificate
    with a principal, lets the watcher read its status only, and refuses another edge's
    certificate, a call that names no caller, plaintext and another CA's certificate; the
    IAM and the watcher refuse plaintext and another CA's certificate too."""
    import base64
    import json as _json

    cluster_pb2, cluster_pb2_grpc, iam_pb2, iam_pb2_grpc, sandbox_pb2 = grpc_stubs.load()
    admin = {"name": "admin", "kind": "human", "key_id": "", "project": "root"}
    principal = [("x-dsec-principal",
                  base64.urlsafe_b64encode(_json.dumps(admin).encode()).decode().rstrip("="))]
    cluster.foreign_context()  # issues api1's certificate under another CA
    foreign = ch.FOREIGN_CERTS

    def edge(cert, ca_dir=None):
        return cluster_pb2_grpc.EdgeStub(_grpc_channel("edge1", cert, ca_dir))

    status = edge("api1").Status(cluster_pb2.StatusRequest(), metadata=principal, timeout=10)
    assert status.name == "edge1" and status.healthy, status
    listing = edge("api1").List(cluster_pb2.ListSandboxesRequest(), metadata=principal, timeout=10)
    assert isinstance(listing.sandboxes, Iterable)
    refusals = {
        "no caller named": lambda: edge("api1").List(cluster_pb2.ListSandboxesRequest(), timeout=10),
        "the watcher creating": lambda: edge("watcher").Create(
            cluster_pb2.CreateCall(request=sandbox_pb2.CreateSandboxRequest(image="root/base")),
            metadata=principal, timeout=10),
        "another edge as the admin": lambda: edge("edge2").List(
            cluster_pb2.ListSandboxesRequest(), metadata=principal, timeout=10),
        "plaintext": lambda: edge(None).Status(cluster_pb2.StatusRequest(), metadata=principal, timeout=10),
        "another CA": lambda: edge("api1", foreign).Status(
            cluster_pb2.StatusRequest(), metadata=principal, timeout=10),
    }
    codes = {label: _grpc_code(call) for label, call in refusals.items()}
    print(f"\nedge1's gRPC service refuses: {codes}")
    assert {k: codes[k] for k in ("no caller named", "the watcher creating", "another edge as the admin")} == {
        "no caller named": grpc.StatusCode.UNAUTHENTICATED,
        "the watcher creating": grpc.StatusCode.PERMISSION_DENIED,
        "another edge as the admin": grpc.StatusCode.PERMISSION_DENIED,
    }, codes
    assert {codes["plaintext"], codes["another CA"]} <= NO_ANSWER, codes
    watcher_status = edge("watcher").Status(cluster_pb2.StatusRequest(), metadata=principal, timeout=10)
    assert watcher_status.name == "edge1"

    def iam(cert, ca_dir=None):
        return iam_pb2_grpc.IamStub(_grpc_channel("iam1", cert, ca_dir))

    ask = iam_pb2.ActorRequest(actor="root")
    assert any(p.path == "root" for p in iam("api1").Projects(ask, timeout=10).projects)
    # An edge reserves and releases quota; listing projects and key hashes is not its to do.
    for listing in (lambda: iam("edge2").Keys(ask, timeout=10), lambda: iam("edge2").Projects(ask, timeout=10)):
        assert _grpc_code(listing) == grpc.StatusCode.PERMISSION_DENIED
    codes = {
        "plaintext": _grpc_code(lambda: iam(None).Projects(ask, timeout=10)),
        "another CA": _grpc_code(lambda: iam("api1", foreign).Projects(ask, timeout=10)),
        "the watcher": _grpc_code(lambda: iam("watcher").Projects(ask, timeout=10)),
    }
    print(f"iam1's gRPC service refuses: {codes}")
    assert set(codes.values()) <= NO_ANSWER, codes

    def watcher(cert, ca_dir=None):
        return cluster_pb2_grpc.WatcherStub(_grpc_channel("watcher", cert, ca_dir))

    view = watcher("api1").View(cluster_pb2.StatusRequest(), timeout=10)
    assert {n.name for n in view.nodes} == set(EDGES), view
    codes = {
        "plaintext": _grpc_code(lambda: watcher(None).View(cluster_pb2.StatusRequest(), timeout=10)),
        "another CA": _grpc_code(lambda: watcher("api1", foreign).View(cluster_pb2.StatusRequest(), timeout=10)),
        "an edge": _grpc_code(lambda: watcher("edge1").View(cluster_pb2.StatusRequest(), timeout=10)),
    }
    print(f"the watcher's gRPC service refuses: {codes}")
    assert set(codes.values()) <= NO_ANSWER, codes


def _assert_needs_cluster_certificate(cluster: Cluster, name: str) -> None:
    """Host `name`'s internal listener answers a peer with an apiserver certificate of the
    cluster's CA, and refuses TLS without a client certificate or with another CA's."""
    addr = HOSTS[name].addr
    status, line = ch.tls_probe(addr, cluster.peer_context())
    assert status == 200, f"{name} ({addr}) answered {line!r} to an apiserver certificate"
    others = {
        "no client certificate": ch.tls_context(ch.CERTS / "ca.pem"),
        "a certificate of another CA": cluster.foreign_context(),
    }
    for label, ctx in others.items():
        status, why = ch.tls_probe(addr, ctx)
        print(f"\n{name} with {label}: {why}", flush=True)
        assert status is None, f"{name} ({addr}) answered {why!r} to a peer with {label}"


async def _assert_projects_isolated(cluster: Cluster) -> None:
    """Project B's key cannot get, exec in, stop or list project A's sandbox."""
    a, b = "root/iso-a", "root/iso-b"
    async with _client(cluster, "api1") as admin:
        await admin.create_project(a)
        await admin.create_project(b)
        ka = (await admin.create_key("iso-a", project=a))["key"]
        kb = (await admin.create_key("iso-b", project=b))["key"]
    async with _client(cluster, "api1", ka) as ca:
        sa = await ca.run_sandbox(DSecRunArgs(**SMALL))
        try:
            for api in APIS:
                await _assert_invisible(cluster, api, kb, sa.info)
            # Still A's and still running after B's attempts.
            assert (await ca.get_sandbox(sa.id)).info.project == a
            assert (await sa.exec(cmd="echo mine")).stdout == "mine\n"
        finally:
            await sa.stop()


async def _assert_invisible(cluster: Cluster, api: str, key: str, info: SandboxInfo) -> None:
    """Through `api`, the key's project sees no trace of the sandbox: 404 for get, exec
    and stop, and it is not listed."""
    async with _client(cluster, api, key) as other:
        with pytest.raises(NotFoundError):
            await other.get_sandbox(info.id)
        with pytest.raises(NotFoundError):
            await Sandbox(other, info).exec(cmd="true")
        assert info.id not in {s.id for s in await other.list_sandboxes()}
        assert info.id not in {u["id"] for u in (await other.usage())["sandboxes"]}
    # The SDK's stop() ignores not_found (stopping twice is fine), so ask directly.
    async with httpx.AsyncClient(base_url=cluster.api_url(api), headers={"Authorization": f"Bearer {key}"}) as raw:
        r = await raw.delete(f"/v1/sandboxes/{info.id}")
        assert r.status_code == 404 and r.json()["code"] == "not_found", (api, r.status_code, r.text)


# ---- 5. VM state across edges ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["vm", "microvm"])
async def test_vm_fork_and_resume_on_another_edge(cluster, backend):
    """A VM's memory goes with it to another edge: copies forked there hold the source
    process's value, and a sandbox paused to disk resumes there, same process and value,
    under a new id; the old id is gone. The other edge pulls the state over mutual TLS.
    Both VM backends: QEMU (`vm`) and Firecracker (`microvm`, where the edges have KVM)."""
    from test_microvm import vmm_processes
    from test_vm import ask, qemu_processes, start_holder

    st = cluster.status()
    avail = {b["name"]: b for n in st["nodes"] for b in n.get("backends", []) if b["name"] == backend}
    if backend not in avail or not avail[backend]["available"]:
        why = avail[backend]["detail"] if backend in avail else "no edge reports it"
        pytest.skip(f"skipped: the {backend} backend is unavailable on the edges: {why}")
    processes = qemu_processes if backend == "vm" else vmm_processes
    async with _client(cluster, "api1") as c:
        sb = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256,
                                             ttl_seconds=1800, labels={"test": f"{backend}-move"}))
        made = [sb]
        try:
            value = await start_holder(sb)
            source_edge = _edge_of(sb.id)
            target = next(e for e in EDGES if e != source_edge)

            t0 = time.monotonic()
            copies = await sb.fork(count=2, edge=target)
            fork_s = time.monotonic() - t0
            made += copies
            assert [_edge_of(x.id) for x in copies] == [target, target], [x.id for x in copies]
            for i, cp in enumerate(copies):
                assert cp.info.forked_from == sb.id
                assert await ask(cp, f"get {10 + i}", 10 + i) == value, "a copy on the other edge lost the memory"
            assert await ask(sb, "get 2", 2) == value

            # A kept snapshot restores on another edge too, and stays for later.
            snap = await sb.snapshot()
            assert _edge_of(snap.id) == source_edge
            there = await c.restore_snapshot(snap.id, count=1, edge=target)
            made += there
            assert _edge_of(there[0].id) == target
            assert await ask(there[0], "get 5", 5) == value, "a snapshot restored on the other edge lost the memory"
            assert snap.id in [s.id for s in await c.list_snapshots()]
            await c.delete_snapshot(snap.id)

            old = sb.id
            await sb.pause(to_disk=True)
            assert not processes(old)
            t0 = time.monotonic()
            info = await sb.resume(edge=target)
            move_s = time.monotonic() - t0
            assert info.moved_from == old and _edge_of(info.id) == target and info.state == "running", info
            assert await ask(sb, "get 3", 3) == value, "the moved sandbox lost its process's memory"
            with pytest.raises(NotFoundError):
                await c.get_sandbox(old)
            assert not processes(old)
            accel = "TCG" if backend == "vm" else "KVM nested under TCG" if os.environ.get("DSEC_NESTED") else "KVM"
            print(f"\n{backend} to another edge ({accel}): fork of 2 there {fork_s:.2f} s "
                  f"(source paused {sb.last_fork['source_paused_ms']} ms); resume there from disk {move_s:.2f} s",
                  flush=True)
            # Refused clearly: an edge that does not exist.
            with pytest.raises(DSecError) as e:
                await copies[0].fork(count=1, edge="nowhere")
            assert "nowhere" in str(e.value)
        finally:
            for x in made:
                try:
                    await x.stop()
                except NotFoundError:
                    pass


# ---- 6. Lazy image chunks from another edge --------------------------------------------


def _tls_get(addr: str, ctx, path: str) -> tuple[int, bytes]:
    """`GET path` over TLS with `ctx`'s client certificate: (status, body bytes)."""
    import socket

    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return int(head.split(b" ", 2)[1]), body


async def test_lazy_chunks_come_from_another_edge_before_the_registry(cluster):
    """A node whose lazy layer lacks a chunk asks the cluster's edges first: with the
    registry gone, the chunks an edge holds still arrive (checked against the chunk table),
    and one no edge holds is an I/O error. Only an edge certificate gets chunks from an
    edge. The second node is a store of the test's own, its lazy file system told of
    edge1 as a cluster edge's is (`lazy/peers.json`)."""
    import hashlib
    import json
    import shutil
    from pathlib import Path

    import subprocess

    from conftest import DATA, DSEC, dsec
    from test_pull import WORK, Layout, Registry, busybox

    if not (shutil.which("docker-registry") and shutil.which("skopeo") and Path("/bin/busybox").exists()
            and Path("/dev/fuse").exists() and "erofs" in Path("/proc/filesystems").read_text()):
        pytest.skip("needs EROFS and FUSE, and Debian's docker-registry, skopeo and busybox-static")
    chunk = 1 << 20
    reg = Registry("peer-lazy")
    layout = Layout(WORK / "layout-peer-lazy")
    other = WORK / "peer-node"
    shutil.rmtree(other, ignore_errors=True)
    big = [(f"data/b{i}.bin", os.urandom(3 * chunk // 2)) for i in range(8)]
    base = layout.layer(busybox(), "gzip")
    data = layout.layer([("data", "dir", None, 0o755)] + [(n, "file", d, 0o644) for n, d in big], "gzip")
    layout.tag(layout.image([base, data], ["PATH=/bin"]))
    reg.push(layout.path, "team/peer:v1")

    def cli(*args: str, data_dir: Path = DATA) -> dict:
        r = dsec("image", *args, "--plain-http", "--data-dir", str(data_dir), "--json", timeout=300)
        return json.loads(r.stdout)

    def lazy_file(data_dir: Path, hexd: str) -> Path:
        return data_dir / "images" / "lazyfs" / hexd

    def held(data_dir: Path, hexd: str) -> set[int]:
        bits = (data_dir / "images" / "lazy" / hexd / "have").read_bytes()
        return {i for i in range(len(bits) * 8) if bits[i // 8] >> (i % 8) & 1}

    refs = ("root/peer-src:v1", "root/peer-lazy:v1")
    daemon = None
    try:
        cli("pull", f"{reg.host}/team/peer:v1", "--as", refs[0])
        cli("push", refs[0], f"{reg.host}/team/peerlazy:v1")
        # edge1's store (the cluster's, shared by its edges) pulls it lazily and reads
        # chunks 1 and 2 of the data layer.
        assert cli("pull", f"{reg.host}/team/peerlazy:v1", "--as", refs[1])["lazy"] is True
        listed = {i["reference"]: i for i in json.loads(dsec("image", "ls", "--data-dir", str(DATA),
                                                             "--json").stdout)}
        hexd = listed[refs[1]]["manifest"]["layers"][1]
        with open(lazy_file(DATA, hexd), "rb") as f:
            f.seek(chunk)
            want = f.read(2 * chunk)
        table = json.loads((DATA / "images" / "lazy" / hexd / "source.json").read_text())["table"]
        last = len(table["chunks"]) - 1
        assert {1, 2} <= held(DATA, hexd) and last not in held(DATA, hexd)

        # The endpoint: an edge certificate gets a held chunk; an apiserver's is refused.
        ch.issue_cert(ch.CERTS, "edge", "peer-node")
        edge_ctx = ch.tls_context(ch.CERTS / "ca.pem", ch.CERTS / "peer-node.pem", ch.CERTS / "peer-node.key")
        status, body = _tls_get(HOSTS["edge1"].addr, edge_ctx, f"/v1/lazy/{hexd}/chunks/1")
        assert status == 200 and hashlib.sha256(body).hexdigest() == table["chunks"][1], status
        status, body = _tls_get(HOSTS["edge1"].addr, cluster.peer_context(), f"/v1/lazy/{hexd}/chunks/1")
        print(f"\nan apiserver certificate asking edge1 for a chunk: {status} {body[:120]!r}", flush=True)
        assert status == 403, body
        status, _ = _tls_get(HOSTS["edge1"].addr, edge_ctx, f"/v1/lazy/{hexd}/chunks/{last}")
        assert status == 404
        status, _ = _tls_get(HOSTS["edge1"].addr, edge_ctx, "/v1/lazy/..%2f..%2fetc/chunks/0")
        assert status in (400, 404)

        # The other node: a store with the blob registered as a lazy pull leaves it (its
        # source and an empty cache), served by its own lazy file system; the registry
        # goes away first.
        store2 = other / "images"
        blob2 = store2 / "lazy" / hexd
        blob2.mkdir(parents=True)
        (store2 / "tmp").mkdir()
        shutil.copy(DATA / "images" / "lazy" / hexd / "source.json", blob2 / "source.json")
        with open(blob2 / "data", "wb") as f:
            f.truncate(table["size"])
        (blob2 / "have").write_bytes(bytes((len(table["chunks"]) + 7) // 8))
        reg.stop()
        daemon = subprocess.Popen([DSEC, "lazyfs", "--store", str(store2), "--cache-mb", "0"],
                                  stdout=subprocess.DEVNULL, stderr=open(other / "lazyfs.log", "wb"))
        deadline = time.monotonic() + 10
        while not lazy_file(other, hexd).exists():
            assert daemon.poll() is None and time.monotonic() < deadline, (other / "lazyfs.log").read_text()
            time.sleep(0.05)
        # No peers yet: only the registry, which is gone.
        with pytest.raises(OSError), open(lazy_file(other, hexd), "rb") as f:
            f.seek(chunk)
            f.read(1)
        assert not {1, 2} & held(other, hexd)
        peers = {"tls": {"ca": str(ch.CERTS / "ca.pem"), "cert": str(ch.CERTS / "peer-node.pem"),
                         "key": str(ch.CERTS / "peer-node.key")},
                 "edges": {"edge1": HOSTS["edge1"].addr}}
        (store2 / "lazy" / "peers.json").write_text(json.dumps(peers))
        t0 = time.monotonic()
        with open(lazy_file(other, hexd), "rb") as f:
            f.seek(chunk)
            got = f.read(2 * chunk)
        took = time.monotonic() - t0
        assert got == want, "the chunks from edge1 are not the layer's"
        assert {1, 2} <= held(other, hexd)
        print(f"2 chunks from edge1 with the registry down: {took * 1000:.0f} ms", flush=True)
        with pytest.raises(OSError) as e, open(lazy_file(other, hexd), "rb") as f:
            f.seek(last * chunk)
            f.read(1)
        assert e.value.errno == 5, e.value  # EIO: no edge holds it and the registry is gone
        log = (other / "lazyfs.log").read_text()
        assert "peer edges for lazy chunks" in log, log
    finally:
        reg.stop()
        for ref in refs:
            dsec("image", "rm", ref, "--data-dir", str(DATA), check=False)
        if daemon is not None:
            subprocess.run(["umount", "-l", str(other / "images" / "lazyfs")], capture_output=True)
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:  # cleaned up even if it did not exit as it should
                daemon.kill()
                daemon.wait()
        shutil.rmtree(other, ignore_errors=True)
        shutil.rmtree(layout.path, ignore_errors=True)
