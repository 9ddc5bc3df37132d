# SPDX-License-Identifier: AGPL-3.0-only
"""A whole OpenDsec cluster on one machine, for the end-to-end cluster tests.

Every component (3 IAMs, 2 apiservers, a watcher, 3 edges) is its own `dsec serve
--config FILE` process in its own network namespace ("host") `dsect-<name>`, joined by a
bridge `dsect-br0` (10.231.0.1/24) in the root namespace, so each one has its own address
and can be killed and restarted on its own. Components talk to each other over mTLS with
certificates from `dsec certs`; the tests reach the apiservers' public plain-HTTP API.

Processes enter their namespace with `nsenter --net` rather than `ip netns exec`: the
latter also remounts /sys for the namespace, which hides /sys/fs/cgroup from the edges.

Everything lives under /var/tmp/dsec-cluster-test and is removed by `Cluster.down()`; the
component logs are copied to /var/tmp/dsec-cluster-test-logs first.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from conftest import DATA, DSEC, dsec

import hostclean
from hostclean import sandbox_cgroups

BASE = Path("/var/tmp/dsec-cluster-test")
CERTS = BASE / "certs"
FOREIGN_CERTS = BASE / "foreign-certs"
CONFIGS = BASE / "configs"
LOGS = BASE / "logs"
KEPT_LOGS = Path("/var/tmp/dsec-cluster-test-logs")
ADMIN_KEY_FILE = BASE / "admin.key"
IMAGE_STORE = DATA / "images"

BRIDGE = "dsect-br0"
GATEWAY = "10.231.0.1"
PREFIX_LEN = 24
PORT = 7700
PUBLIC_PORT = 7600


@dataclass(frozen=True)
class Host:
    """One component and the network namespace it runs in."""

    name: str
    role: str  # iam | apiserver | watcher | edge
    ip: str
    iam_id: int | None = None

    @property
    def ns(self) -> str:
        return f"dsect-{self.name}"

    @property
    def veth(self) -> str:
        # The root-namespace end of the pair (interface names are at most 15 bytes).
        return f"dsv-{self.name}"

    @property
    def addr(self) -> str:
        return f"{self.ip}:{PORT}"

    @property
    def public_addr(self) -> str:
        return f"{self.ip}:{PUBLIC_PORT}"

    @property
    def data_dir(self) -> Path:
        return BASE / self.name

    @property
    def config(self) -> Path:
        return CONFIGS / f"{self.name}.toml"

    @property
    def log(self) -> Path:
        return LOGS / f"{self.name}.log"


HOSTS: dict[str, Host] = {
    h.name: h
    for h in (
        Host("iam1", "iam", "10.231.0.11", 1),
        Host("iam2", "iam", "10.231.0.12", 2),
        Host("iam3", "iam", "10.231.0.13", 3),
        Host("api1", "apiserver", "10.231.0.21"),
        Host("api2", "apiserver", "10.231.0.22"),
        Host("watcher", "watcher", "10.231.0.31"),
        Host("edge1", "edge", "10.231.0.41"),
        Host("edge2", "edge", "10.231.0.42"),
        Host("edge3", "edge", "10.231.0.43"),
    )
}
IAMS = ("iam1", "iam2", "iam3")
APIS = ("api1", "api2")
EDGES = ("edge1", "edge2", "edge3")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


# ---- network ---------------------------------------------------------------------------


def netns_available() -> str | None:
    """None when network namespaces can be used here, else why not."""
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    r = _run("ip", "netns", "list", check=False)
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip()}"
    return None


def namespaces() -> list[str]:
    """The test namespaces that exist now (ours all start with `dsect-`)."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("dsect-")]


def setup_network() -> None:
    """The bridge in the root namespace and one namespace per host, attached to it."""
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{GATEWAY}/{PREFIX_LEN}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    _allow_bridge_forwarding(True)
    for h in HOSTS.values():
        _run("ip", "netns", "add", h.ns)
        _run("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
        _run("ip", "link", "set", h.veth, "master", BRIDGE, "up")
        _run("ip", "-n", h.ns, "addr", "add", f"{h.ip}/{PREFIX_LEN}", "dev", "eth0")
        _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
        _run("ip", "-n", h.ns, "link", "set", "lo", "up")


def teardown_network() -> None:
    """Removes the namespaces (and with them their veth pairs) and the bridge; whatever
    does not exist is skipped."""
    for ns in namespaces():
        _run("ip", "netns", "del", ns, check=False)
    for h in HOSTS.values():
        if Path(f"/sys/class/net/{h.veth}").exists():
            _run("ip", "link", "del", h.veth, check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "del", BRIDGE, check=False)
    _allow_bridge_forwarding(False)


# Whether the `ip filter` table was there before the harness's first iptables call (with
# the nft backend, even `iptables -C` makes it); one the harness made goes with the rule.
_FILTER_TABLE_WAS_THERE: bool | None = None


def _filter_table_exists() -> bool:
    return shutil.which("nft") is not None and _run("nft", "list", "table", "ip", "filter",
                                                     check=False).returncode == 0


def _allow_bridge_forwarding(on: bool) -> None:
    """With br_netfilter loaded, frames between bridge ports pass iptables' FORWARD chain,
    whose policy may be DROP (e.g. where Docker runs): let the bridge's own traffic through."""
    global _FILTER_TABLE_WAS_THERE
    if shutil.which("iptables") is None:
        return
    if _FILTER_TABLE_WAS_THERE is None:
        _FILTER_TABLE_WAS_THERE = _filter_table_exists()
    rule = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]
    present = _run("iptables", "-C", *rule, check=False).returncode == 0
    if on and not present:
        _run("iptables", "-I", *rule, check=False)
    elif not on and present:
        _run("iptables", "-D", *rule, check=False)
    if not on and not _FILTER_TABLE_WAS_THERE and _filter_table_exists():
        _run("nft", "delete", "table", "ip", "filter", check=False)


def in_netns(name: str, argv: list[str]) -> list[str]:
    """`argv` run inside host `name`'s network namespace (and nothing else changed)."""
    return ["nsenter", f"--net=/run/netns/{HOSTS[name].ns}", "--", *argv]


def check_connectivity() -> None:
    """A TCP connection from one host to another and from the root namespace to a host,
    so that a broken network shows up here and not as a component that never gets healthy."""
    listener = subprocess.Popen(
        in_netns("iam1", [sys.executable, "-c",
                          "import socket,sys\n"
                          f"s=socket.create_server(('{HOSTS['iam1'].ip}', 9))\n"
                          "print('up', flush=True)\n"
                          "s.settimeout(10)\n"
                          "for _ in range(2): s.accept()[0].close()\n"]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None
        if listener.stdout.readline().strip() != "up":
            raise RuntimeError("could not listen inside namespace dsect-iam1")
        target = f"('{HOSTS['iam1'].ip}', 9)"
        r = _run(*in_netns("edge1", [sys.executable, "-c", f"import socket; socket.create_connection({target}, 3)"]),
                 check=False)
        if r.returncode != 0:
            raise RuntimeError(f"dsect-edge1 cannot reach dsect-iam1 over {BRIDGE}: {r.stderr.strip()}")
        socket.create_connection((HOSTS["iam1"].ip, 9), timeout=3).close()
        listener.wait(10)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()


# ---- certificates and configuration ----------------------------------------------------


def init_ca(directory: Path) -> None:
    dsec("certs", "init", "--dir", str(directory), timeout=60)


def issue_cert(directory: Path, role: str, name: str, hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A certificate for `role`/`name` signed by the CA in `directory`: (cert, key)."""
    args = ["certs", "issue", "--dir", str(directory), "--role", role, "--name", name]
    for h in hosts:
        args += ["--host", h]
    dsec(*args, timeout=60)
    return directory / f"{name}.pem", directory / f"{name}.key"


def make_certs() -> None:
    init_ca(CERTS)
    for h in HOSTS.values():
        issue_cert(CERTS, h.role, h.name, (h.ip,))


def _q(s: object) -> str:
    """A TOML basic string (JSON's escapes are TOML's for the strings used here)."""
    return json.dumps(str(s))


def config_text(h: Host) -> str:
    """The `dsec serve --config` file of host `h`."""
    lines = [
        f"role = {_q(h.role)}",
        f"name = {_q(h.name)}",
        f"data_dir = {_q(h.data_dir)}",
        f"listen = {_q(h.addr)}",
    ]
    if h.role == "apiserver":
        lines.append(f"public_listen = {_q(h.public_addr)}")
    lines += [
        "",
        "[tls]",
        f"ca = {_q(CERTS / 'ca.pem')}",
        f"cert = {_q(CERTS / (h.name + '.pem'))}",
        f"key = {_q(CERTS / (h.name + '.key'))}",
        "",
        "[cluster]",
        "iam = [" + ", ".join(_q(HOSTS[i].addr) for i in IAMS) + "]",
        f"watcher = {_q(HOSTS['watcher'].addr)}",
        "[cluster.edges]",
        *(f"{e} = {_q(HOSTS[e].addr)}" for e in EDGES),
    ]
    if h.role == "iam":
        members = ", ".join(f'"{HOSTS[i].iam_id}" = {_q(HOSTS[i].addr)}' for i in IAMS)
        lines += ["", "[iam]", f"id = {h.iam_id}", f"members = {{ {members} }}"]
        if h.iam_id == 1:
            lines.append(f"bootstrap_key_file = {_q(ADMIN_KEY_FILE)}")
        if os.environ.get("DSEC_NESTED"):
            # Nine components on the two emulated CPUs of the nested-KVM harness miss the
            # default 100 ms heartbeats: slower Raft timing, so the leader stays.
            lines += ["heartbeat_ms = 400", "election_timeout_ms = [3000, 6000]"]
    if h.role == "edge":
        lines += ["", "[edge]", f"image_store = {_q(IMAGE_STORE)}", f"state_dir = {_q(h.data_dir / 'edge')}"]
    return "\n".join(lines) + "\n"


def write_configs() -> None:
    CONFIGS.mkdir(parents=True, exist_ok=True)
    for h in HOSTS.values():
        h.data_dir.mkdir(parents=True, exist_ok=True)
        h.config.write_text(config_text(h))


# ---- TLS from the test -----------------------------------------------------------------


def tls_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """Trusts `ca` (no host name check) and presents `cert` when given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(ca))
    ctx.check_hostname = False
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def tls_probe(addr: str, ctx: ssl.SSLContext, path: str = "/healthz", timeout: float = 5.0) -> tuple[int | None, str]:
    """Sends `GET path` over raw TLS: (HTTP status, status line), or (None, why) when the
    server refused the handshake or closed the connection before any HTTP answer. A server
    that neither answers nor closes raises TimeoutError."""
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=host) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n".encode())
                data = b""
                while b"\r\n" not in data:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
    except socket.timeout:
        raise TimeoutError(f"{addr} neither answered nor closed within {timeout} s") from None
    except (ssl.SSLError, ConnectionError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not data:
        return None, "closed without an answer"
    line = data.split(b"\r\n", 1)[0].decode(errors="replace")
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise AssertionError(f"{addr} answered something that is not HTTP: {line!r}")
    return int(parts[1]), line


def tls_get(addr: str, path: str, ctx: ssl.SSLContext, timeout: float = 5.0) -> tuple[int, bytes]:
    """An HTTPS GET with a client certificate: (status, body)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# ---- leftovers on the host -------------------------------------------------------------


def _our_cgroups() -> list[str]:
    """Cgroups of sandboxes on this cluster's edges."""
    return sandbox_cgroups(EDGES)


def sweep_host() -> list[str]:
    """Removes whatever a cluster run (this or an earlier, crashed one) left on the host:
    processes in the test namespaces, sandbox cgroups of the test edges, mounts and files
    under BASE, the namespaces and the bridge. Returns what it found besides the network."""
    found = hostclean.sweep(namespaces(), _our_cgroups(), BASE)
    teardown_network()
    if BASE.exists():
        _run("rm", "-rf", "--one-file-system", str(BASE), check=False)
    return found


# ---- the cluster -----------------------------------------------------------------------


class Cluster:
    """The processes of one cluster and the calls tests make on it.

    `up()` builds it from nothing; `down()` stops every sandbox through the API, stops the
    components (SIGTERM, then SIGKILL), and removes everything; it returns the leftovers it
    had to force away (a non-empty list is a leak).
    """

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.admin_key = ""
        self._ctx: ssl.SSLContext | None = None

    # ---- addresses and TLS ----

    def api_url(self, name: str = "api1") -> str:
        return f"http://{HOSTS[name].public_addr}"

    def peer_context(self) -> ssl.SSLContext:
        """A TLS context presenting api1's certificate (role apiserver)."""
        if self._ctx is None:
            self._ctx = tls_context(CERTS / "ca.pem", CERTS / "api1.pem", CERTS / "api1.key")
        return self._ctx

    def foreign_context(self) -> ssl.SSLContext:
        """A context presenting an apiserver certificate signed by another CA."""
        init_ca(FOREIGN_CERTS)
        cert, key = issue_cert(FOREIGN_CERTS, "apiserver", "api1", (HOSTS["api1"].ip,))
        return tls_context(CERTS / "ca.pem", cert, key)

    # ---- processes ----

    def start(self, name: str) -> None:
        """Starts host `name`'s component in its namespace, in its own process group, its
        output appended to its log."""
        if self.alive(name):
            raise RuntimeError(f"{name} is already running (pid {self.pid(name)})")
        h = HOSTS[name]
        LOGS.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("DSEC_API_URL", "DSEC_API_KEY")}
        with open(h.log, "ab") as log:
            log.write(f"\n==== test harness: starting {name} at {time.strftime('%H:%M:%S')} ====\n".encode())
            log.flush()
            self.procs[name] = subprocess.Popen(
                in_netns(name, [DSEC, "serve", "--config", str(h.config)]),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env=env)

    def pid(self, name: str) -> int | None:
        """The component's pid (nsenter execs it, so it is the Popen's), None when not running."""
        p = self.procs.get(name)
        return p.pid if p is not None and p.poll() is None else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    def kill9(self, name: str) -> None:
        """kill -9 of the component process alone (not its group: an edge's sandboxes live on)."""
        p = self.procs[name]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join(HOSTS[name].log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _exited(self, name: str) -> str:
        p = self.procs.get(name)
        code = p.returncode if p is not None else None
        return f"{name} exited ({code}); the end of its log:\n{self.log_tail(name)}"

    # ---- health ----

    def healthy(self, name: str) -> bool:
        """The apiserver's public /healthz (plain HTTP), or a peer's mTLS /healthz."""
        h = HOSTS[name]
        try:
            if h.role == "apiserver":
                return httpx.get(f"{self.api_url(name)}/healthz", timeout=2).status_code == 200
            return tls_get(h.addr, "/healthz", self.peer_context(), timeout=2)[0] == 200
        except (OSError, httpx.HTTPError, http.client.HTTPException):
            return False

    def wait_healthy(self, name: str, timeout: float = 30.0) -> float:
        """Waits until `name` answers /healthz; returns the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not self.alive(name):
                raise RuntimeError(self._exited(name))
            if self.healthy(name):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{name} not healthy within {timeout} s; the end of its log:\n{self.log_tail(name)}")

    def status(self, api: str = "api1") -> dict:
        r = httpx.get(f"{self.api_url(api)}/v1/status", timeout=5,
                      headers={"Authorization": f"Bearer {self.admin_key}"})
        r.raise_for_status()
        return r.json()

    def wait_edges_healthy(self, apis: tuple[str, ...] = APIS, timeout: float = 60.0) -> None:
        """Waits until `/v1/status` of each apiserver shows all three edges healthy."""
        end = time.monotonic() + timeout
        for api in apis:
            last: object = None
            while True:
                try:
                    last = {n["name"]: n["healthy"] for n in self.status(api)["nodes"]}
                    if all(last.get(e) for e in EDGES):
                        break
                except (httpx.HTTPError, KeyError, ValueError) as e:
                    last = e
                if time.monotonic() > end:
                    raise TimeoutError(f"{api} does not see all edges healthy within {timeout} s: {last}")
                time.sleep(0.2)

    def iam_leader(self, timeout: float = 15.0) -> str:
        """The host name of the IAM raft leader, asked of each running IAM's /iam/leader."""
        end = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < end:
            for name in IAMS:
                if not self.alive(name):
                    continue
                try:
                    code, body = tls_get(HOSTS[name].addr, "/iam/leader", self.peer_context(), timeout=2)
                    last = (name, code, body[:200])
                    if code != 200:
                        continue
                    leader = self._iam_host(json.loads(body))
                    if leader is not None and self.alive(leader):
                        return leader
                except (OSError, ValueError, http.client.HTTPException) as e:
                    last = (name, e)
            time.sleep(0.2)
        raise TimeoutError(f"no IAM leader within {timeout} s (last answer: {last})")

    @staticmethod
    def _iam_host(answer: dict) -> str | None:
        """The host of a {"leader_id": N, "leader": "addr"} answer."""
        by_id = {HOSTS[i].iam_id: i for i in IAMS}
        if answer.get("leader_id") in by_id:
            return by_id[answer["leader_id"]]
        by_addr = {HOSTS[i].addr: i for i in IAMS}
        return by_addr.get(answer.get("leader") or "")

    # ---- bring-up and teardown ----

    def up(self) -> None:
        """Network, certificates, configs, then the components: the IAMs first (iam1 writes
        the admin key once the cluster is initialised), then everything else."""
        found = sweep_host()
        if found:
            print(f"cluster harness: removed leftovers of an earlier run: {found}", flush=True)
        setup_network()
        check_connectivity()
        for d in (CERTS, CONFIGS, LOGS):
            d.mkdir(parents=True, exist_ok=True)
        make_certs()
        write_configs()
        for name in IAMS:
            self.start(name)
        self.admin_key = self._wait_admin_key()
        for name in IAMS:
            self.wait_healthy(name)
        for name in ("watcher", *EDGES, *APIS):
            self.start(name)
        for name in ("watcher", *EDGES, *APIS):
            self.wait_healthy(name, timeout=60)
        self.wait_edges_healthy()

    def _wait_admin_key(self, timeout: float = 60.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name in IAMS:
                if not self.alive(name):
                    raise RuntimeError(self._exited(name))
            if ADMIN_KEY_FILE.exists():
                key = ADMIN_KEY_FILE.read_text().strip()
                if key.startswith("dsk."):
                    return key
            time.sleep(0.2)
        tails = "\n".join(f"--- {n}:\n{self.log_tail(n)}" for n in IAMS)
        raise TimeoutError(f"{ADMIN_KEY_FILE} did not appear within {timeout} s\n{tails}")

    def stop_all_sandboxes(self) -> int:
        """Stops every sandbox through the first apiserver that lists them (the admin key
        sees all projects); returns how many it stopped."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        for api in APIS:
            if not self.admin_key or not self.alive(api):
                continue
            try:
                with httpx.Client(base_url=self.api_url(api), headers=headers, timeout=120) as c:
                    r = c.get("/v1/sandboxes")
                    r.raise_for_status()
                    ids = [s["id"] for s in r.json()["sandboxes"]]
                    with ThreadPoolExecutor(16) as pool:
                        list(pool.map(lambda i: c.delete(f"/v1/sandboxes/{i}"), ids))
                    return len(ids)
            except httpx.HTTPError as e:
                print(f"cluster harness: stopping sandboxes through {api} failed: {e}", flush=True)
        return 0

    def _restart_dead(self) -> None:
        """Brings back components a failed test left killed, so that their sandboxes can be
        stopped properly."""
        for name in HOSTS:
            if name in self.procs and not self.alive(name):
                try:
                    self.start(name)
                    self.wait_healthy(name, timeout=30)
                except (RuntimeError, TimeoutError) as e:
                    print(f"cluster harness: restarting {name} for cleanup failed: {e}", flush=True)

    def _terminate(self, names: tuple[str, ...], timeout: float) -> None:
        for n in names:
            if self.alive(n):
                os.kill(self.procs[n].pid, signal.SIGTERM)
        end = time.monotonic() + timeout
        for n in names:
            p = self.procs.get(n)
            if p is None:
                continue
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"cluster harness: {n} ignored SIGTERM for {timeout} s; killing it", flush=True)
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def down(self) -> list[str]:
        """Tears everything down; returns what was left behind after an orderly stop."""
        try:
            if self.procs:
                self._restart_dead()
                n = self.stop_all_sandboxes()
                print(f"cluster harness: stopped {n} sandboxes at teardown", flush=True)
            self._terminate(APIS, 20)
            self._terminate(("watcher",), 20)
            self._terminate(EDGES, 120)
            self._terminate(IAMS, 20)
        finally:
            self._keep_logs()
            found = sweep_host()
        return found

    def _keep_logs(self) -> None:
        if LOGS.exists():
            shutil.rmtree(KEPT_LOGS, ignore_errors=True)
            shutil.copytree(LOGS, KEPT_LOGS)
