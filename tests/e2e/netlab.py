# SPDX-License-Identifier: AGPL-3.0-only
"""A small internet around one OpenDsec node, for the egress-policy tests (test_network).

    root ns                 dsecn-node                          dsecn-world ("the internet")
    dsecn-api 192.0.2.5 ─── api0 192.0.2.6  (dsec up, :7621)
                            up0  192.0.2.1  ─────────────────── eth0 192.0.2.2
                            default via 192.0.2.2               lo: 203.0.113.10  HTTP :8000 ("pypi")
                            TCP :8080 on 0.0.0.0 and [::]           203.0.113.20  HTTP :8000 ("other")
                            (a service of the host that             (both also echo requests on :80, and
                            sandboxes must not reach)                on :443 over TLS with the lab CA's
                                                                     certificate for their names)
                                                                    203.0.113.53  DNS, the node's upstream
                                                                    198.51.100.1  a "foreign" DNS resolver
                                                                    169.254.169.254 HTTP :80 ("metadata")

The node (`dsec up` run inside dsecn-node, its own data dir and node name `netlab`) gives
each sandbox a namespace `dsec-netlab-<k>` and NATs it behind 192.0.2.1. Everything a
sandbox could be let through to answers (so a blocked connection fails because of the
policy, not because nothing is there), and the DNS servers log every query they get.

The upstream DNS server reads its zone (`{"name": [["A", "203.0.113.10", ttl], ["CNAME",
"other.test", ttl], ...]}`) from a JSON file on every query, so tests change records with
`Netlab.set_zone`. The foreign resolver answers every name with 198.51.100.66.

Processes enter namespaces with `nsenter --net` (not `ip netns exec`, which remounts /sys
and hides the cgroup filesystem from the edge). `Netlab.down()` stops the node with `dsec
down`, checks that the node removed its own rules, stops the servers and removes every
namespace, process, cgroup, mount and file of the lab; it returns whatever it had to force
away or found wrong (a non-empty list is a leak). Logs are kept in /var/tmp/dsec-netlab-logs.

This file is also the lab's server program: `python3 netlab.py http|dns|tcp ARGS`.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import hostclean
from hostclean import sandbox_cgroups

SELF = Path(__file__).resolve()
BASE = Path("/var/tmp/dsec-netlab")
NODE_DIR = BASE / "node"
LOGS = BASE / "logs"
KEPT_LOGS = Path("/var/tmp/dsec-netlab-logs")
ZONE_FILE = BASE / "zone.json"
FOREIGN_ZONE_FILE = BASE / "foreign-zone.json"
UPSTREAM_LOG = LOGS / "dns-upstream.jsonl"
FOREIGN_LOG = LOGS / "dns-foreign.jsonl"
HOST_TCP_LOG = LOGS / "host-tcp.jsonl"
ECHO_LOG = LOGS / "echo.jsonl"
# The lab's CA (the node's header proxy trusts it; sandboxes do not) and its servers'.
LAB_CA = BASE / "ca"

NODE_NS = "dsecn-node"
WORLD_NS = "dsecn-world"
NAMESPACES = (NODE_NS, WORLD_NS)
ROOT_VETH = "dsecn-api"
NODE_NAME = "netlab"

API_ROOT_IP = "192.0.2.5"
API_IP = "192.0.2.6"
API_PORT = 7621
NODE_IP = "192.0.2.1"  # the node's uplink: sandboxes are masqueraded behind it
WORLD_IP = "192.0.2.2"
HOST_PORT = 8080       # the node's own TCP service

PYPI_IP = "203.0.113.10"
OTHER_IP = "203.0.113.20"
UPSTREAM_DNS_IP = "203.0.113.53"
FOREIGN_DNS_IP = "198.51.100.1"
FOREIGN_ANSWER = "198.51.100.66"
METADATA_IP = "169.254.169.254"
HTTP_PORT = 8000
WORLD_ADDRS = (PYPI_IP, OTHER_IP, UPSTREAM_DNS_IP, FOREIGN_DNS_IP, METADATA_IP)

# The node's egress services (names a rule may use besides domains and CIDRs).
SERVICES = {"pypi": ["pypi.test", "*.pypi.test"]}
ZONE: dict[str, list] = {
    "pypi.test": [["A", PYPI_IP, 30], ["AAAA", "2001:db8::10", 30]],
    "files.pypi.test": [["A", PYPI_IP, 30]],
    "other.test": [["A", OTHER_IP, 30]],
    "alias.pypi.test": [["CNAME", "other.test", 30]],
    "ttl.test": [["A", PYPI_IP, 2]],
}
FOREIGN_ZONE = {"*": [["A", FOREIGN_ANSWER, 30]]}
# The echo servers' certificate names.
ECHO_NAMES = {"pypi": ["pypi.test", "files.pypi.test"], "other": ["other.test"]}


def _run(*argv: str, check: bool = True, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def in_ns(ns: str, argv: list[str]) -> list[str]:
    """`argv` run inside namespace `ns` (only the network namespace changes)."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--", *argv]


def unavailable() -> str | None:
    """None when the lab can be built here, else why not."""
    for tool in ("ip", "nsenter", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    r = _run("ip", "netns", "list", check=False)
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip()}"
    return None


# ---- what is on the host now -----------------------------------------------------------


def _netns_list() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_namespaces() -> list[str]:
    return [ns for ns in _netns_list() if ns in NAMESPACES]


SANDBOX_NETNS = Path("/run/dsec/netns")


def sandbox_namespaces() -> list[str]:
    """Namespaces of the lab node's sandboxes (`dsec-netlab-<k>`): files in /run/dsec/netns
    (their pins are mounted in the sandboxes' mount namespace, not the host's)."""
    if not SANDBOX_NETNS.is_dir():
        return []
    return sorted(p.name for p in SANDBOX_NETNS.glob(f"dsec-{NODE_NAME}-*"))


def _sandbox_cgroups() -> list[str]:
    return sandbox_cgroups((NODE_NAME,))


def sweep_host() -> list[str]:
    """Removes whatever a lab (this one, or an earlier run that crashed) left on the host:
    processes in the lab's namespaces, the node's sandboxes (cgroups, namespaces), mounts
    and files under BASE, the namespaces and the root veth. Returns what it found besides
    the lab's own namespaces and veth."""
    found = hostclean.sweep(lab_namespaces(), _sandbox_cgroups(), BASE)
    for ns in sandbox_namespaces():
        found.append(f"sandbox namespace {ns}")
        (SANDBOX_NETNS / ns).unlink(missing_ok=True)
    for ns in lab_namespaces():
        _run("ip", "netns", "del", ns, check=False)
    if Path(f"/sys/class/net/{ROOT_VETH}").exists():
        _run("ip", "link", "del", ROOT_VETH, check=False)
    if BASE.exists():
        _run("rm", "-rf", "--one-file-system", str(BASE), check=False)
    return found


# ---- the lab ---------------------------------------------------------------------------


class Netlab:
    """The lab's namespaces, servers and node, and what tests ask of them."""

    def __init__(self, dsec: str, image_store: Path) -> None:
        self.dsec = dsec
        self.image_store = image_store
        self.procs: dict[str, subprocess.Popen] = {}
        self.api_url = f"http://{API_IP}:{API_PORT}"
        self.api_key = ""
        self._forward_before = ""
        self._node_started = False

    # ---- bring-up ----

    def up(self) -> None:
        found = sweep_host()
        if found:
            print(f"netlab: removed leftovers of an earlier run: {found}", flush=True)
        for d in (NODE_DIR, LOGS):
            d.mkdir(parents=True, exist_ok=True)
        self._network()
        self.reset_zone()
        _write_json(FOREIGN_ZONE_FILE, FOREIGN_ZONE)
        self._servers()
        self._check_world()
        self.clear_logs()
        self._start_node()

    def _network(self) -> None:
        for ns in NAMESPACES:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        # root <-> node: the API
        _run("ip", "link", "add", ROOT_VETH, "type", "veth", "peer", "name", "api0", "netns", NODE_NS)
        _run("ip", "addr", "add", f"{API_ROOT_IP}/30", "dev", ROOT_VETH)
        _run("ip", "link", "set", ROOT_VETH, "up")
        _run("ip", "-n", NODE_NS, "addr", "add", f"{API_IP}/30", "dev", "api0")
        _run("ip", "-n", NODE_NS, "link", "set", "api0", "up")
        # node <-> world: the node's uplink
        _run("ip", "-n", NODE_NS, "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", WORLD_NS)
        _run("ip", "-n", NODE_NS, "addr", "add", f"{NODE_IP}/30", "dev", "up0")
        _run("ip", "-n", NODE_NS, "link", "set", "up0", "up")
        _run("ip", "-n", NODE_NS, "route", "add", "default", "via", WORLD_IP)
        _run("ip", "-n", WORLD_NS, "addr", "add", f"{WORLD_IP}/30", "dev", "eth0")
        _run("ip", "-n", WORLD_NS, "link", "set", "eth0", "up")
        for a in WORLD_ADDRS:
            _run("ip", "-n", WORLD_NS, "addr", "add", f"{a}/32", "dev", "lo")
        # Forwarding off, as on a fresh host: the node turns it on and must put it back.
        self.node("sysctl", "-qw", "net.ipv4.ip_forward=0")
        self._forward_before = self.ip_forward()

    def _certificates(self) -> None:
        """The lab CA and a certificate of each echo server's names, signed by it."""
        LAB_CA.mkdir(parents=True, exist_ok=True)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _run("openssl", "req", "-x509", *ec, "-keyout", str(LAB_CA / "ca.key"), "-out", str(LAB_CA / "ca.pem"),
             "-days", "30", "-subj", "/CN=netlab CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        for name, sans in ECHO_NAMES.items():
            ext = LAB_CA / f"{name}.ext"
            ext.write_text(f"subjectAltName={','.join('DNS:' + s for s in sans)}\n"
                           "extendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n")
            _run("openssl", "req", *ec, "-keyout", str(LAB_CA / f"{name}.key"), "-out", str(LAB_CA / f"{name}.csr"),
                 "-subj", f"/CN={sans[0]}")
            _run("openssl", "x509", "-req", "-in", str(LAB_CA / f"{name}.csr"), "-CA", str(LAB_CA / "ca.pem"),
                 "-CAkey", str(LAB_CA / "ca.key"), "-CAcreateserial", "-out", str(LAB_CA / f"{name}.pem"),
                 "-days", "30", "-extfile", str(ext))

    def _servers(self) -> None:
        self._certificates()
        for name, ip in (("pypi", PYPI_IP), ("other", OTHER_IP)):
            self._start(f"echo-{name}", WORLD_NS, ["echo", ip, "80", name, str(ECHO_LOG)])
            self._start(f"echo-{name}-tls", WORLD_NS, ["echo", ip, "443", name, str(ECHO_LOG),
                                                     str(LAB_CA / f"{name}.pem"), str(LAB_CA / f"{name}.key")])
        self._start("http-pypi", WORLD_NS, ["http", PYPI_IP, str(HTTP_PORT), "pypi"])
        self._start("http-other", WORLD_NS, ["http", OTHER_IP, str(HTTP_PORT), "other"])
        self._start("http-metadata", WORLD_NS, ["http", METADATA_IP, "80", "metadata"])
        self._start("dns-upstream", WORLD_NS, ["dns", UPSTREAM_DNS_IP, str(ZONE_FILE), str(UPSTREAM_LOG)])
        self._start("dns-foreign", WORLD_NS, ["dns", FOREIGN_DNS_IP, str(FOREIGN_ZONE_FILE), str(FOREIGN_LOG)])
        self._start("host-tcp", NODE_NS, ["tcp", str(HOST_PORT), str(HOST_TCP_LOG)])
        # and on :80, where the header proxy would take a sandbox's HTTP
        self._start("host-tcp-80", NODE_NS, ["tcp", "80", str(HOST_TCP_LOG)])

    def _start(self, name: str, ns: str, args: list[str]) -> None:
        """Starts `netlab.py ARGS` in `ns` in its own process group and waits for its
        `ready` line."""
        with open(LOGS / f"{name}.log", "ab") as log:
            p = subprocess.Popen(in_ns(ns, [sys.executable, str(SELF), *args]), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        self.procs[name] = p
        assert p.stdout is not None
        line = p.stdout.readline() if select.select([p.stdout], [], [], 10)[0] else b""
        if line.strip() != b"ready":
            raise RuntimeError(f"netlab: {name} did not start:\n{_tail(LOGS / f'{name}.log')}")

    def _check_world(self) -> None:
        """From the node itself everything answers (the lab works before the node's rules
        are in place)."""
        def expect(what: str, got: object, want: object) -> None:
            if got != want:
                raise RuntimeError(f"netlab: {what} from the node gave {got!r}, not {want!r}")

        for ip, port, body in ((PYPI_IP, HTTP_PORT, "pypi"), (OTHER_IP, HTTP_PORT, "other"),
                               (METADATA_IP, 80, "metadata")):
            expect(f"http://{ip}:{port}/", self.node_py(
                f"import urllib.request as u; print(u.urlopen('http://{ip}:{port}/', timeout=3).read().decode())"), body)
        expect("DNS A pypi.test", self.node_dns(UPSTREAM_DNS_IP, "pypi.test"), [PYPI_IP])
        expect("DNS AAAA pypi.test", self.node_dns(UPSTREAM_DNS_IP, "pypi.test", "AAAA"), ["2001:db8::10"])
        expect("DNS over TCP to the foreign resolver", self.node_dns(FOREIGN_DNS_IP, "other.test", tcp=True),
               [FOREIGN_ANSWER])
        expect(f"{NODE_IP}:{HOST_PORT}", self.node_connect(NODE_IP, HOST_PORT), "OK")
        expect(f"[::1]:{HOST_PORT}", self.node_connect("::1", HOST_PORT), "OK")

    def _node_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("DSEC_API_URL", "DSEC_API_KEY")}
        env["DSEC_CONFIG"] = str(NODE_DIR / "client.toml")
        # `dsec up` copies its client config to $XDG_CONFIG_HOME/dsec: keep it in the lab.
        env["XDG_CONFIG_HOME"] = str(BASE / "xdg")
        return env

    def _start_node(self) -> None:
        (NODE_DIR / "config.toml").write_text(node_config(self.image_store))
        self._node_started = True
        r = _run(*in_ns(NODE_NS, [self.dsec, "up", "--data-dir", str(NODE_DIR), "--listen", f"{API_IP}:{API_PORT}"]),
                 check=False, timeout=120, env=self._node_env())
        if r.returncode != 0:
            raise RuntimeError(f"netlab: dsec up failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n"
                               f"{_tail(NODE_DIR / 'dsec.log')}")
        cfg = tomllib.loads((NODE_DIR / "client.toml").read_text())
        self.api_url, self.api_key = cfg["api_url"], cfg["api_key"]

    # ---- teardown ----

    def down(self) -> list[str]:
        """Stops the node, checks what it left, stops the servers and removes the lab;
        returns what was wrong or had to be forced away."""
        problems: list[str] = []
        try:
            if self._node_started:
                r = _run(self.dsec, "down", "--data-dir", str(NODE_DIR), check=False, timeout=180, env=self._node_env())
                if r.returncode != 0:
                    problems.append(f"dsec down failed ({r.returncode}): {r.stdout} {r.stderr}")
                problems += self.node_leftovers()
            for name in list(self.procs):
                self._stop(name)
        finally:
            self._keep_logs()
            problems += sweep_host()
            problems += [f"sandbox namespace {ns} after the sweep" for ns in sandbox_namespaces()]
        return problems

    def node_leftovers(self) -> list[str]:
        """What a stopped node must not leave in its namespace: its nft table, sandbox
        namespaces and interfaces, and IPv4 forwarding it turned on."""
        if NODE_NS not in lab_namespaces():
            return []
        left = []
        if self.node("nft", "list", "table", "inet", "dsec", check=False).returncode == 0:
            left.append("nft table inet dsec in the node after dsec down:\n" + self.nft())
        left += [f"sandbox namespace {ns}" for ns in sandbox_namespaces()]
        # Interfaces go with their namespace, which the kernel dismantles asynchronously.
        end = time.monotonic() + 10
        while self.sandbox_links() and time.monotonic() < end:
            time.sleep(0.2)
        left += [f"interface {i} in the node" for i in self.sandbox_links()]
        fwd = self.ip_forward()
        if fwd != self._forward_before:
            left.append(f"ip_forward in the node is {fwd} after dsec down (was {self._forward_before})")
        return left

    def _stop(self, name: str) -> None:
        p = self.procs.pop(name)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if p.stdout is not None:
            p.stdout.close()

    @staticmethod
    def _keep_logs() -> None:
        shutil.rmtree(KEPT_LOGS, ignore_errors=True)
        KEPT_LOGS.mkdir(parents=True, exist_ok=True)
        for f in [*LOGS.glob("*"), NODE_DIR / "dsec.log"]:
            if f.is_file():
                shutil.copy(f, KEPT_LOGS / f.name)

    # ---- what tests ask ----

    def client(self) -> "DSecClient":  # noqa: F821
        # Imported here: the lab's servers run this file without the SDK on the path.
        from opendsec import DSecClient
        return DSecClient(api_url=self.api_url, api_key=self.api_key)

    def node(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A command run in the node's namespace."""
        return _run(*in_ns(NODE_NS, list(argv)), check=check, timeout=timeout)

    def node_py(self, code: str) -> str:
        return self.node(sys.executable, "-c", code).stdout.strip()

    def node_connect(self, host: str, port: int, timeout: float = 2.0) -> str:
        """A TCP connection from the node itself: OK or FAIL <why>."""
        return self.node_py(
            "import socket\n"
            f"try:\n socket.create_connection(({host!r}, {port}), {timeout}).close(); print('OK')\n"
            "except OSError as e:\n print('FAIL', type(e).__name__, e)")

    def node_dns(self, server: str, name: str, qtype: str = "A", tcp: bool = False) -> list[str]:
        """Asks `server` from the node: the answer's addresses."""
        return json.loads(self.node_py(
            f"import json, sys; sys.path.insert(0, {str(SELF.parent)!r}); import netlab\n"
            f"print(json.dumps(netlab.ask({server!r}, {name!r}, {qtype!r}, {tcp!r})[1]))"))

    def ip_forward(self) -> str:
        return self.node("cat", "/proc/sys/net/ipv4/ip_forward").stdout.strip()

    def nft(self) -> str:
        """The node's table `inet dsec` ('' when there is none)."""
        r = self.node("nft", "list", "table", "inet", "dsec", check=False)
        return r.stdout if r.returncode == 0 else ""

    def sandbox_links(self) -> list[str]:
        """The node's sandbox interfaces (`dsv<k>`)."""
        out = self.node("ip", "-o", "link").stdout
        names = [line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line]
        return [n for n in names if n.startswith("dsv")]

    def set_zone(self, name: str, records: list) -> None:
        zone = json.loads(ZONE_FILE.read_text())
        zone[name] = records
        _write_json(ZONE_FILE, zone)

    def reset_zone(self) -> None:
        _write_json(ZONE_FILE, ZONE)

    def clear_logs(self) -> None:
        for f in (UPSTREAM_LOG, FOREIGN_LOG, HOST_TCP_LOG, ECHO_LOG):
            f.write_text("")

    @staticmethod
    def echoed() -> list[dict]:
        """Requests the echo servers got: server, port, host, headers (lower-case)."""
        return _read_log(ECHO_LOG)

    @staticmethod
    def foreign_queries() -> list[dict]:
        """Queries that reached the foreign resolver."""
        return _read_log(FOREIGN_LOG)

    @staticmethod
    def upstream_queries() -> list[dict]:
        """Queries that reached the node's upstream DNS server."""
        return _read_log(UPSTREAM_LOG)

    @staticmethod
    def host_connections() -> list[dict]:
        """Connections the node's own TCP service accepted."""
        return _read_log(HOST_TCP_LOG)


def node_config(image_store: Path) -> str:
    """The node's `<data-dir>/config.toml`."""
    services = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SERVICES.items())
    return (f"[edge]\n"
            f"name = {json.dumps(NODE_NAME)}\n"
            f"state_dir = {json.dumps(str(NODE_DIR / 'edge'))}\n"
            f"image_store = {json.dumps(str(image_store))}\n"
            f"\n[edge.network]\n"
            f"dns_upstream = [{json.dumps(f'{UPSTREAM_DNS_IP}:53')}]\n"
            f"header_roots = [{json.dumps(str(LAB_CA / 'ca.pem'))}]\n"
            f"\n[edge.network.services]\n{services}\n")


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_log(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


# ---- DNS messages ----------------------------------------------------------------------

QTYPES = {"A": 1, "CNAME": 5, "AAAA": 28}
NAMES = {v: k for k, v in QTYPES.items()}


def encode_name(name: str) -> bytes:
    return b"".join(bytes([len(label)]) + label.encode() for label in name.strip(".").split(".")) + b"\0"


def query(name: str, qtype: str = "A", qid: int = 0x4242) -> bytes:
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack(">HH", QTYPES[qtype], 1)


def _skip_name(m: bytes, o: int) -> int:
    while True:
        n = m[o]
        if n >= 0xC0:
            return o + 2
        if n == 0:
            return o + 1
        o += 1 + n


def parse_answer(m: bytes) -> tuple[int, list[str]]:
    """(rcode, the A and AAAA addresses of the answer section)."""
    ancount = struct.unpack(">H", m[6:8])[0]
    o = _skip_name(m, 12) + 4
    out = []
    for _ in range(ancount):
        o = _skip_name(m, o)
        rtype, _, _, rdlen = struct.unpack(">HHIH", m[o:o + 10])
        o += 10
        if rtype == 1:
            out.append(socket.inet_ntop(socket.AF_INET, m[o:o + 4]))
        elif rtype == 28:
            out.append(socket.inet_ntop(socket.AF_INET6, m[o:o + 16]))
        o += rdlen
    return m[3] & 0x0F, out


def ask(server: str, name: str, qtype: str = "A", tcp: bool = False, timeout: float = 3.0) -> tuple[int, list[str]]:
    q = query(name, qtype)
    if tcp:
        with socket.create_connection((server, 53), timeout) as s:
            s.sendall(struct.pack(">H", len(q)) + q)
            return parse_answer(_recv_msg(s))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(q, (server, 53))
        return parse_answer(s.recv(65535))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed mid-message")
        buf += chunk
    return buf


def _recv_msg(s: socket.socket) -> bytes:
    return _recv_exact(s, struct.unpack(">H", _recv_exact(s, 2))[0])


def zone_answer(q: bytes, zone: dict) -> tuple[bytes, str, str] | None:
    """The answer to query `q` from `zone` (a CNAME is followed to its target's records),
    with the question's name and type; None for something that is not a query."""
    if len(q) < 17 or struct.unpack(">H", q[4:6])[0] != 1:
        return None
    labels, o = [], 12
    while q[o]:
        labels.append(q[o + 1:o + 1 + q[o]].decode(errors="replace").lower())
        o += 1 + q[o]
    qtype = struct.unpack(">H", q[o + 1:o + 3])[0]
    qend = o + 5
    name = ".".join(labels)

    def records(n: str) -> list | None:
        return zone.get(n, zone.get("*"))

    rcode, answers, owner = 0, [], name
    if records(name) is None:
        rcode = 3  # NXDOMAIN
    for _ in range(8):
        recs = records(owner) or []
        cname = next((r for r in recs if r[0] == "CNAME"), None)
        if cname is not None and qtype != QTYPES["CNAME"]:
            answers.append((owner, cname))
            owner = cname[1]
            continue
        answers += [(owner, r) for r in recs if QTYPES.get(r[0]) == qtype]
        break
    flags = 0x8000 | 0x0400 | (struct.unpack(">H", q[2:4])[0] & 0x0100) | 0x0080 | rcode
    out = struct.pack(">HHHHHH", struct.unpack(">H", q[:2])[0], flags, 1, len(answers), 0, 0) + q[12:qend]
    for owner_name, (rtype, value, ttl) in answers:
        if rtype == "A":
            data = socket.inet_pton(socket.AF_INET, value)
        elif rtype == "AAAA":
            data = socket.inet_pton(socket.AF_INET6, value)
        else:
            data = encode_name(value)
        out += encode_name(owner_name) + struct.pack(">HHIH", QTYPES[rtype], 1, int(ttl), len(data)) + data
    return out, name, NAMES.get(qtype, str(qtype))


# ---- the lab's servers (`python3 netlab.py ...`) -----------------------------------------


class _Log:
    """Appends JSON lines, one per event, from any thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, **event: object) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), **event}) + "\n")


class _Quiet(BaseHTTPRequestHandler):
    """A handler that logs nothing and answers 200 with a body."""

    def reply(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve_http(addr: str, port: int, name: str) -> None:
    """Answers every GET with its own name."""

    class Handler(_Quiet):
        def do_GET(self) -> None:  # noqa: N802
            self.reply(f"{name}\n".encode(), "text/plain")

    srv = ThreadingHTTPServer((addr, port), Handler)
    print("ready", flush=True)
    srv.serve_forever()


def serve_dns(addr: str, zone_path: str, log_path: str) -> None:
    """DNS over UDP and TCP on addr:53 from the zone in `zone_path` (read for every query);
    logs every query."""
    log = _Log(log_path)

    def answer(q: bytes, peer: str, transport: str) -> bytes | None:
        got = zone_answer(q, json.loads(Path(zone_path).read_text()))
        if got is None:
            log.write(**{"from": peer, "transport": transport, "name": None, "type": None})
            return None
        log.write(**{"from": peer, "transport": transport, "name": got[1], "type": got[2]})
        return got[0]

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((addr, 53))
    tcp = socket.create_server((addr, 53))

    def udp_loop() -> None:
        while True:
            q, peer = udp.recvfrom(65535)
            r = answer(q, peer[0], "udp")
            if r is not None:
                udp.sendto(r, peer)

    def tcp_conn(c: socket.socket, peer: str) -> None:
        with c:
            c.settimeout(10)
            try:
                while True:
                    r = answer(_recv_msg(c), peer, "tcp")
                    if r is None:
                        return
                    c.sendall(struct.pack(">H", len(r)) + r)
            except (OSError, ConnectionError):
                return

    threading.Thread(target=udp_loop, daemon=True).start()
    print("ready", flush=True)
    while True:
        c, peer = tcp.accept()
        threading.Thread(target=tcp_conn, args=(c, peer[0]), daemon=True).start()


def serve_echo(addr: str, port: int, name: str, log_path: str, cert: str | None, key: str | None) -> None:
    """Answers every GET with JSON of its own name and the request's headers, and logs
    them; over TLS with `cert` and `key`."""
    log = _Log(log_path)

    class Handler(_Quiet):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802
            headers = {k.lower(): v for k, v in self.headers.items()}
            log.write(server=name, port=port, path=self.path, headers=headers)
            self.reply(json.dumps({"server": name, "port": port, "headers": headers}).encode(), "application/json")

    srv = ThreadingHTTPServer((addr, port), Handler)
    if cert and key:
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    print("ready", flush=True)
    srv.serve_forever()


def serve_tcp(port: int, log_path: str) -> None:
    """The node's own service: on 0.0.0.0 and [::] (IPv6 only), says `node` and closes;
    logs every peer."""
    log = _Log(log_path)
    v4 = socket.create_server(("0.0.0.0", port))
    v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    v6.bind(("::", port))
    v6.listen()

    def loop(s: socket.socket) -> None:
        while True:
            c, peer = s.accept()
            log.write(**{"from": peer[0]})
            with c:
                c.sendall(b"node\n")

    threading.Thread(target=loop, args=(v6,), daemon=True).start()
    print("ready", flush=True)
    loop(v4)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    role, args = argv[0], argv[1:]
    if role == "http":
        serve_http(args[0], int(args[1]), args[2])
    elif role == "dns":
        serve_dns(args[0], args[1], args[2])
    elif role == "echo":
        serve_echo(args[0], int(args[1]), args[2], args[3], *(args[4:6] if len(args) >= 6 else (None, None)))
    elif role == "tcp":
        serve_tcp(int(args[0]), args[1])
    else:
        raise SystemExit(f"unknown role {role!r}: http ADDR PORT NAME | dns ADDR ZONE LOG | tcp PORT LOG")


if __name__ == "__main__":
    main(sys.argv[1:])
