# SPDX-License-Identifier: AGPL-3.0-only
"""Prometheus metrics as an operator reads them: Debian's Prometheus server scrapes the
node's `/metrics` with a root key, and queries through its HTTP API return what this test
did (creates by outcome, the create and exec latency histograms, sandboxes by state and
project, a DNS refusal, the network set-up latency, the IAM replica's Raft leadership). A tenant's key, and no key, are refused."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from conftest import LISTEN
from opendsec import DSecClient, DSecRunArgs, NotFoundError

pytestmark = pytest.mark.skipif(not shutil.which("prometheus"),
                                reason="skipped: Prometheus is not installed (deploy/deps.sh installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_value(text: str, series: str) -> float:
    """A series' value in the node's own /metrics text (0 when it has none yet)."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return 0.0


class Prometheus:
    """A Prometheus server scraping every second, with its own storage: the node with
    `key`, or what the scrape configs `jobs` (YAML list items) say."""

    def __init__(self, key: str = "", jobs: str | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-prom-"))
        self.port = free_port()
        if jobs is None:
            jobs = ("  - job_name: dsec\n"
                    "    metrics_path: /metrics\n"
                    f"    authorization: {{type: Bearer, credentials: '{key}'}}\n"
                    f"    static_configs: [{{targets: ['{LISTEN}']}}]\n")
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
            "scrape_configs:\n" + jobs)
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def query(self, q: str) -> list[dict]:
        r = self.http.get("/api/v1/query", params={"query": q})
        r.raise_for_status()
        return r.json()["data"]["result"]

    def value(self, q: str) -> float | None:
        res = self.query(q)
        return float(res[0]["value"][1]) if res else None

    def until(self, q: str, pred, timeout: float = 30.0) -> float | None:
        """Waits until the query's value satisfies ``pred``; returns the last value."""
        end = time.monotonic() + timeout
        v = None
        while time.monotonic() < end:
            try:
                v = self.value(q)
            except httpx.HTTPError:
                v = None
            if v is not None and pred(v):
                return v
            time.sleep(0.5)
        return v

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def test_prometheus_scrapes_what_the_node_did():
    async with DSecClient() as admin:
        # Only a root key reads the metrics: they name every project.
        project = f"root/metrics-{os.urandom(3).hex()}"
        await admin.create_project(project, sandboxes=4)
        tenant_key = (await admin.create_key("metrics-agent", project=project, agent=True))["key"]
        url = f"{admin.api_url}/metrics"
        async with httpx.AsyncClient(timeout=10) as h:
            r = await h.get(url)
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
            r = await h.get(url, headers={"Authorization": f"Bearer {tenant_key}"})
            assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
            assert project in r.json()["message"]
            r = await h.get(url, headers={"Authorization": f"Bearer {admin.api_key}"})
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/openmetrics-text")
            before = r.text

        ok = 'dsec_sandbox_creates_total{backend="container",outcome="ok"}'
        missing = 'dsec_sandbox_creates_total{backend="container",outcome="not_found"}'
        created_before = own_value(before, ok)
        missing_before = own_value(before, missing)
        count_before = own_value(before, 'dsec_sandbox_create_seconds_count{backend="container"}')
        exec_before = own_value(before, 'dsec_exec_seconds_count{backend="container"}')
        refused_before = own_value(before, 'dsec_dns_answers_total{outcome="refused"}')
        attach_before = own_value(before, 'dsec_netfilter_seconds_count{op="attach"}')

        prom = Prometheus(admin.api_key)
        tenant = DSecClient(api_url=admin.api_url, api_key=tenant_key)
        made = []
        try:
            for _ in range(2):
                made.append(await tenant.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32,
                                                                 ttl_seconds=300, project=project)))
            for sb in made:
                assert (await sb.run_shell("echo hi")).stdout == "hi\n"
            # A name the sandbox's rules do not allow: the DNS proxy refuses it.
            r = await made[0].run_shell("getent hosts not-allowed.example.com; echo $?")
            assert r.stdout.strip() != "0", r
            # A create the node refuses is counted under its error code.
            with pytest.raises(NotFoundError):
                await admin.run_sandbox(DSecRunArgs(image="root/no-such-image:1"))

            assert prom.until('up{job="dsec"}', lambda v: v == 1) == 1, \
                (prom.dir / "prometheus.log").read_text()[-2000:]
            running = f'dsec_sandboxes{{state="running",project="{project}"}}'
            assert await asyncio.to_thread(prom.until, running, lambda v: v == 2) == 2
            assert await asyncio.to_thread(prom.until, ok, lambda v: v >= created_before + 2) == created_before + 2
            assert await asyncio.to_thread(prom.until, missing, lambda v: v >= missing_before + 1) \
                == missing_before + 1
            count = 'dsec_sandbox_create_seconds_count{backend="container"}'
            assert await asyncio.to_thread(prom.until, count, lambda v: v >= count_before + 2) == count_before + 2
            execs = 'dsec_exec_seconds_count{backend="container"}'
            # Two echoes and the DNS lookup.
            assert await asyncio.to_thread(prom.until, execs, lambda v: v >= exec_before + 3) == exec_before + 3
            # The histogram has a median that is a time, not a count.
            p50 = prom.value('histogram_quantile(0.5, dsec_sandbox_create_seconds_bucket{backend="container"})')
            assert p50 is not None and 0 < p50 < 60, p50
            dns = 'dsec_dns_answers_total{outcome="refused"}'
            assert (prom.until(dns, lambda v: v >= refused_before + 1) or 0) >= refused_before + 1
            attach = 'dsec_netfilter_seconds_count{op="attach"}'
            assert (prom.until(attach, lambda v: v >= attach_before + 2) or 0) >= attach_before + 2
            # `dsec up` runs one IAM replica: it leads, in a term of at least 1.
            assert prom.until("dsec_iam_raft_leader", lambda v: v == 1) == 1
            assert prom.value("dsec_iam_raft_term") >= 1
            assert prom.value("dsec_iam_raft_applied_index") >= 1
            # Requests by route: the creates went to the route's pattern, not to ids.
            reqs = prom.value('sum(dsec_http_requests_total{role="edge",route="/v1/sandboxes",method="POST"})')
            assert reqs is not None and reqs >= 3
            assert prom.query(f'dsec_http_requests_total{{route=~".*{made[0].id}.*"}}') == []

            for sb in made:
                await sb.stop()
            # Both stopped: the project's series goes (a gauge of what exists now).
            assert await asyncio.to_thread(prom.until, f"absent({running})", lambda v: v == 1) == 1
            stops = f'dsec_sandbox_stops_total{{backend="container",reason="requested"}}'
            assert (prom.until(stops, lambda v: v >= 2) or 0) >= 2
        finally:
            for sb in made:
                try:
                    await sb.stop()
                except NotFoundError:
                    pass
            await tenant.close()
            prom.close()
