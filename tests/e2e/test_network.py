# SPDX-License-Identifier: AGPL-3.0-only
"""Sandbox egress policy, end to end, on a node inside netlab's small internet (see
netlab.py for the topology): a sandbox reaches what its rules name, by name through the
node's DNS proxy, and nothing else (other names and addresses, the node itself, other
sandboxes, cloud metadata, other resolvers); rules changed at runtime hold at once; DNS
TTLs, DNS to other servers, CNAMEs, IPv6 and raw sockets do not get around the rules; 200
sandboxes with rules leave no rules, namespaces or interfaces behind; bad rules are refused
with a message that names them.

Probes run inside the sandboxes (PROBE below); a blocked connection is one that fails
although the lab has a server answering there (netlab checks that from the node first).

Run with `-s` to see the figures."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

import netlab
from conftest import DATA, DSEC
from netlab import (API_IP, API_PORT, FOREIGN_ANSWER, FOREIGN_DNS_IP, HOST_PORT, HTTP_PORT, METADATA_IP,
                    NODE_IP, OTHER_IP, PYPI_IP, Netlab)
from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, Sandbox

PY = dict(image="root/py:3.11", memory_limit_mb=128, cpu_cores_limit=0.5, ttl_seconds=900)
TINY = dict(image="root/base", memory_limit_mb=32, cpu_cores_limit=0.05, ttl_seconds=900)
PYPI_URL = f"http://pypi.test:{HTTP_PORT}/"
OTHER_URL = f"http://other.test:{HTTP_PORT}/"
RUNTIME_CHANGE_S = 1.0

# Runs checks inside a sandbox: argv[1] is a JSON list of [function, *args], argv[2] "par"
# (all at once) or "seq" (in order); prints a JSON list of results. A failure is a string
# "FAIL <exception>: <message>".
PROBE = r'''
import json, socket, struct, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor

def fail(e):
    return f"FAIL {type(e).__name__}: {e}"

def connect(host, port, timeout=2.0):
    try:
        socket.create_connection((host, port), timeout).close()
        return "OK"
    except OSError as e:
        return fail(e)

def connect6(addr, iface, port, timeout=2.0):
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect((addr, port, 0, socket.if_nametoindex(iface)))
        return "OK"
    except OSError as e:
        return fail(e)

def http(url, timeout=3.0):
    try:
        return urllib.request.urlopen(url, timeout=timeout).read().decode().strip()
    except Exception as e:
        return fail(e)

def resolve(name):
    try:
        return socket.gethostbyname(name)
    except OSError as e:
        return fail(e)

def resolve6(name):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET6)})
    except OSError as e:
        return fail(e)

def _skip(m, o):
    while m[o] and m[o] < 0xC0:
        o += 1 + m[o]
    return o + (2 if m[o] else 1)

def _exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise ConnectionError("closed")
        b += c
    return b

def dns(server, name, transport="udp", qtype="A", timeout=2.0, ttls=False):
    """A query sent straight to server:53: {"rcode", "a": addresses} (and "ttls", the
    records' TTLs, if asked) or FAIL."""
    t = {"A": 1, "AAAA": 28}[qtype]
    q = struct.pack(">6H", 0x4242, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\0" + struct.pack(">HH", t, 1)
    try:
        if transport == "udp":
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(timeout)
                s.sendto(q, (server, 53))
                m = s.recv(65535)
        else:
            with socket.create_connection((server, 53), timeout) as s:
                s.sendall(struct.pack(">H", len(q)) + q)
                m = _exact(s, struct.unpack(">H", _exact(s, 2))[0])
    except OSError as e:
        return fail(e)
    o, out, seen = _skip(m, 12) + 4, [], []
    for _ in range(struct.unpack(">H", m[6:8])[0]):
        o = _skip(m, o)
        rtype, _, ttl, n = struct.unpack(">HHIH", m[o:o + 10])
        o += 10
        if rtype in (1, 28):
            out.append(socket.inet_ntop(socket.AF_INET if rtype == 1 else socket.AF_INET6, m[o:o + n]))
            seen.append(ttl)
        o += n
    return {"rcode": m[3] & 15, "a": out, **({"ttls": seen} if ttls else {})}

def sleep(seconds):
    time.sleep(seconds)
    return "slept"

def raw(kind):
    try:
        if kind == "icmp":
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        else:
            socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)).close()
        return "OK"
    except OSError as e:
        return fail(e)

def read(path):
    return open(path).read()

def interfaces():
    return [line.split(":")[0].strip() for line in read("/proc/net/dev").splitlines()[2:]]

def ipv6_addresses():
    return [f"{f[5]} {f[0]}" for f in (line.split() for line in read("/proc/net/if_inet6").splitlines())]

def blocked(v):
    return isinstance(v, str) and v.startswith("FAIL")

def switched(new_name, new_ip, old_name, old_ip, port, limit):
    """Repeats until the new rules hold (the new name resolves and connects, the old name
    does not resolve, the old address does not connect); returns when the round that saw
    it began."""
    end = time.time() + limit
    rounds = 0
    while time.time() < end:
        began = time.time()
        rounds += 1
        if (resolve(new_name) == new_ip and connect(new_ip, port, 1.0) == "OK"
                and blocked(resolve(old_name)) and blocked(connect(old_ip, port, 0.3))):
            return {"held_at": began, "rounds": rounds}
    return {"held_at": None, "rounds": rounds}

checks = json.loads(sys.argv[1])
run = lambda c: globals()[c[0]](*c[1:])
if sys.argv[2] == "par":
    with ThreadPoolExecutor(len(checks)) as pool:
        results = list(pool.map(run, checks))
else:
    results = [run(c) for c in checks]
print(json.dumps(results))
'''


async def probe(sb: Sandbox, *checks: tuple, parallel: bool = True) -> list:
    r = await sb.exec(argv=["python3", "-c", PROBE, json.dumps(checks), "par" if parallel else "seq"], timeout=60)
    assert r.exit_code == 0, f"the probe failed in {sb.id}: {r.stderr}"
    return json.loads(r.stdout)


async def probe_named(sb: Sandbox, title: str, checks: dict[str, tuple], parallel: bool = True) -> dict:
    """Runs labelled checks and prints them."""
    got = dict(zip(checks, await probe(sb, *checks.values(), parallel=parallel)))
    print(f"\n{title} ({sb.id}):", flush=True)
    for label, v in got.items():
        print(f"  {label:<48} {' | '.join(str(v).strip().splitlines())[:120]}", flush=True)
    return got


def blocked(v: object) -> bool:
    return isinstance(v, str) and v.startswith("FAIL")


def refused_or_silent(v: object) -> bool:
    """A DNS probe that got REFUSED (without records) or no answer at all."""
    return blocked(v) or (isinstance(v, dict) and v["rcode"] == 5 and not v["a"])


def key(sb: Sandbox) -> str:
    return sb.id.rsplit("-", 1)[1]


def gateway(address: str) -> str:
    """The gateway of the sandbox at `address`: the first address of the node's pool
    (10.200.0.0/16), the same for every sandbox, held by the node's loopback."""
    assert ipaddress.IPv4Address(address) in ipaddress.IPv4Network("10.200.0.0/16"), address
    return "10.200.0.1"


async def node_connect(lab: Netlab, host: str, port: int) -> str:
    return await asyncio.to_thread(lab.node_connect, host, port)


# The node's table is fixed: a sandbox is only elements keyed by its interface, `"dsv<k>"`.
PER_SANDBOX = re.compile(r"^\s*(?:set|chain|map) (?:sb_\w+|(?:a|c|p|x|xp)_\w+|egress \{\s*type ifname : verdict)",
                         re.M)
SANDBOX_ELEMENT = re.compile(r'"dsv(\w+)" \. ([^,}\n]+)')


def elements(lab: Netlab, set_name: str, sb: Sandbox | None = None) -> list[str]:
    """The elements of the node's set `set_name` (of `sb` only, when given), each without
    the interface: `203.0.113.7 . 443`, `192.0.2.1 timeout 30s expires 29s`."""
    listing = lab.node("nft", "list", "set", "inet", "dsec", set_name).stdout
    return [rest.strip() for k, rest in SANDBOX_ELEMENT.findall(listing) if sb is None or k == key(sb)]


# ---- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(server):
    why = netlab.unavailable()
    if why:
        pytest.skip(f"the network tests need network namespaces and nftables: {why}")
    lab = Netlab(dsec=DSEC, image_store=DATA / "images")
    try:
        lab.up()
        yield lab
    finally:
        left = lab.down()
    assert not left, f"the lab's node left these behind after dsec down: {left}"
    assert not netlab.sandbox_namespaces()


@pytest.fixture
async def node(lab):
    """A client of the lab's node, with the zone and the logs fresh; stops every sandbox
    of the node after the test."""
    lab.reset_zone()
    lab.clear_logs()
    async with lab.client() as c:
        yield c
        sem = asyncio.Semaphore(16)

        async def stop(sid: str) -> None:
            async with sem:
                await (await c.get_sandbox(sid)).stop()

        await asyncio.gather(*(stop(s.id) for s in await c.list_sandboxes()))


# ---- 1. allow by name, everything else closed ------------------------------------------


async def test_allow_by_name_and_nothing_else(lab: Netlab, node: DSecClient):
    sb1, sb2, sb_none = await asyncio.gather(
        node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True})),
        node.run_sandbox(DSecRunArgs(**PY, network_rules={})),
        node.run_sandbox(DSecRunArgs(**PY, network="none")))
    net1, net2 = sb1.info.network, sb2.info.network
    assert net1["mode"] == "rules" and net1["rules"] == {"pypi": True}, net1
    assert net2["mode"] == "rules" and net2["rules"] == {}, net2
    assert sb_none.info.network["mode"] == "none", sb_none.info.network
    addr1, addr2 = net1["address"], net2["address"]
    assert ipaddress.IPv4Address(addr1) in ipaddress.IPv4Network("10.200.0.0/16")
    gw1 = gateway(addr1)

    # The second sandbox serves HTTP on its address; the node reaches it, so a failure
    # from the first sandbox is the policy's doing.
    await sb2.exec_background(argv=["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"])
    end = time.monotonic() + 15
    while (seen := await node_connect(lab, addr2, 8000)) != "OK" and time.monotonic() < end:
        await asyncio.sleep(0.2)
    assert seen == "OK", f"the second sandbox's server at {addr2}:8000 is not up: {seen}"

    one, two, none = await asyncio.gather(
        probe_named(sb1, 'rules {"pypi": true}', {
            "GET http://pypi.test:8000 (allowed by name)": ("http", PYPI_URL),
            "GET http://files.pypi.test:8000 (*.pypi.test)": ("http", f"http://files.pypi.test:{HTTP_PORT}/"),
            "resolve other.test": ("resolve", "other.test"),
            "GET http://other.test:8000": ("http", OTHER_URL),
            f"{OTHER_IP}:{HTTP_PORT} by address": ("connect", OTHER_IP, HTTP_PORT),
            f"node uplink {NODE_IP}:{HOST_PORT}": ("connect", NODE_IP, HOST_PORT),
            f"node API {API_IP}:{API_PORT}": ("connect", API_IP, API_PORT),
            f"own gateway {gw1}:{HOST_PORT}": ("connect", gw1, HOST_PORT),
            f"second sandbox {addr2}:8000": ("connect", addr2, 8000),
            f"metadata {METADATA_IP}:80": ("connect", METADATA_IP, 80),
            f"DNS other.test to {FOREIGN_DNS_IP} (UDP)": ("dns", FOREIGN_DNS_IP, "other.test", "udp"),
            f"DNS other.test to {FOREIGN_DNS_IP} (TCP)": ("dns", FOREIGN_DNS_IP, "other.test", "tcp"),
            "/etc/resolv.conf": ("read", "/etc/resolv.conf"),
        }),
        probe_named(sb2, "rules {}", {
            "GET http://pypi.test:8000": ("http", PYPI_URL),
            "resolve pypi.test": ("resolve", "pypi.test"),
            f"{PYPI_IP}:{HTTP_PORT} by address": ("connect", PYPI_IP, HTTP_PORT),
            f"{OTHER_IP}:{HTTP_PORT} by address": ("connect", OTHER_IP, HTTP_PORT),
            "its own server at 127.0.0.1:8000": ("connect", "127.0.0.1", 8000),
        }),
        probe_named(sb_none, 'network "none"', {"interfaces (/proc/net/dev)": ("interfaces",)}))

    assert one.pop("GET http://pypi.test:8000 (allowed by name)") == "pypi"
    assert one.pop("GET http://files.pypi.test:8000 (*.pypi.test)") == "pypi"
    assert f"nameserver {gw1}" in one.pop("/etc/resolv.conf")
    for label, v in one.items():
        if label.startswith("DNS"):
            assert refused_or_silent(v), f"{label}: {v}"
        else:
            assert blocked(v), f'rules {{"pypi": true}}: {label} got through: {v}'
    assert two.pop("its own server at 127.0.0.1:8000") == "OK"
    for label, v in two.items():
        assert blocked(v), f"rules {{}}: {label} got through: {v}"
    assert none["interfaces (/proc/net/dev)"] == ["lo"], none

    assert lab.foreign_queries() == [], "a sandbox's DNS query reached the foreign resolver"
    assert lab.host_connections() == [], "a sandbox reached the node's own service"
    asked = {(q["name"], q["from"]) for q in lab.upstream_queries()}
    print(f"  the upstream DNS server was asked: {sorted(asked)}", flush=True)
    assert ("pypi.test", NODE_IP) in asked
    assert not any(name == "other.test" for name, _ in asked), "the proxy forwarded a name no rule allows"


async def test_vm_sandboxes_follow_the_same_rules(lab: Netlab, node: DSecClient):
    """A vm sandbox's guest sits behind a namespace of its own that translates its address
    (the same in every VM) to the sandbox's: it reaches what its rules name, by name
    through the proxy, and nothing else; a fork copy has its own namespace and rules."""
    import shutil

    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("skipped: qemu-system-x86_64 is not installed")
    sb = await node.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=256,
                                            ttl_seconds=900, network_rules={"pypi": True}))
    got = await probe_named(sb, 'vm, rules {"pypi": true}', {
        "GET http://pypi.test:8000 (allowed by name)": ("http", PYPI_URL),
        "GET http://other.test:8000": ("http", OTHER_URL),
        f"{OTHER_IP}:{HTTP_PORT} by address": ("connect", OTHER_IP, HTTP_PORT),
        f"node uplink {NODE_IP}:{HOST_PORT}": ("connect", NODE_IP, HOST_PORT),
        f"metadata {METADATA_IP}:80": ("connect", METADATA_IP, 80),
        f"DNS other.test to {FOREIGN_DNS_IP} (UDP)": ("dns", FOREIGN_DNS_IP, "other.test", "udp"),
        "/etc/resolv.conf": ("read", "/etc/resolv.conf"),
    })
    assert got.pop("GET http://pypi.test:8000 (allowed by name)") == "pypi"
    assert "nameserver 172.16.0.1" in got.pop("/etc/resolv.conf")
    for label, v in got.items():
        if label.startswith("DNS"):
            assert refused_or_silent(v), f"{label}: {v}"
        else:
            assert blocked(v), f"vm: {label} got through: {v}"
    [copy] = await sb.fork(count=1)
    assert copy.info.network["address"] != sb.info.network["address"]
    allowed, other = await probe(copy, ("http", PYPI_URL), ("connect", OTHER_IP, HTTP_PORT))
    assert allowed == "pypi" and blocked(other), (allowed, other)
    assert lab.foreign_queries() == [], "a VM's DNS query reached the foreign resolver"
    assert lab.host_connections() == [], "a VM reached the node's own service"


# ---- 2. rules changed at runtime ---------------------------------------------------------


async def test_rules_change_at_runtime(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    before = await probe(sb, ("http", PYPI_URL), ("connect", PYPI_IP, HTTP_PORT), ("resolve", "other.test"),
                         parallel=False)
    assert before[:2] == ["pypi", "OK"] and blocked(before[2]), before

    t0 = time.time()
    info = await sb.set_network_rules({"other.test": True})
    call_s = time.time() - t0
    assert info.network["rules"] == {"other.test": True}, info.network
    s = (await probe(sb, ("switched", "other.test", OTHER_IP, "pypi.test", PYPI_IP, HTTP_PORT, 5.0)))[0]
    held_s = s["held_at"] - t0 if s["held_at"] is not None else None
    print(f"\nset_network_rules answered in {call_s * 1000:.0f} ms; the new rules held "
          f"{'never (5 s)' if held_s is None else f'{held_s * 1000:.0f} ms'} after the call "
          f"(round {s['rounds']} of the probe)", flush=True)
    assert held_s is not None and held_s < RUNTIME_CHANGE_S, s

    after = await probe(sb, ("http", OTHER_URL), ("resolve", "pypi.test"), ("connect", PYPI_IP, HTTP_PORT),
                        ("http", PYPI_URL))
    print(f"  after: other.test {after[0]!r}; pypi.test {after[1]}; {PYPI_IP} {after[2]}", flush=True)
    assert after[0] == "other" and all(blocked(v) for v in after[1:]), after
    assert (await node.get_sandbox(sb.id)).info.network["rules"] == {"other.test": True}

    # {} closes everything, also the address other.test's answer opened a moment ago.
    await sb.set_network_rules({})
    closed = await probe(sb, ("connect", OTHER_IP, HTTP_PORT), ("resolve", "other.test"))
    assert all(blocked(v) for v in closed), closed


# ---- 3. bypasses -------------------------------------------------------------------------


async def test_answer_opens_address_for_its_ttl(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"ttl.test": True}))
    first = await probe(sb, ("resolve", "ttl.test"), ("connect", PYPI_IP, HTTP_PORT), parallel=False)
    learned = elements(lab, "a", sb)
    print(f"\nttl.test (TTL 2) -> {first}; the sandbox's DNS-learned elements: {learned}", flush=True)
    assert first == [PYPI_IP, "OK"], first

    moved = time.monotonic()
    lab.set_zone("ttl.test", [["A", OTHER_IP, 2]])
    await asyncio.sleep(5 - (time.monotonic() - moved))
    later = await probe(sb, ("connect", PYPI_IP, HTTP_PORT), ("resolve", "ttl.test"),
                        ("connect", OTHER_IP, HTTP_PORT), parallel=False)
    print(f"5 s after ttl.test moved to {OTHER_IP}: {PYPI_IP} {later[0]}; ttl.test -> {later[1]}; "
          f"{OTHER_IP} {later[2]}", flush=True)
    assert blocked(later[0]), f"{PYPI_IP} still open 5 s after its 2 s TTL: {later[0]}"
    assert later[1:] == [OTHER_IP, "OK"], later


async def test_a_repeated_answer_tells_what_is_left_and_reopens_nothing(lab: Netlab, node: DSecClient):
    """An address answered again within half its TTL is not written to the node's set a
    second time (the cost of a name asked over and over stays flat); the answer tells the
    time the address has left, so the sandbox never trusts it past its closing."""
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    gw = gateway(sb.info.network["address"])
    first, _, again = await probe(sb, ("dns", gw, "pypi.test", "udp", "A", 2.0, True), ("sleep", 3),
                                  ("dns", gw, "files.pypi.test", "udp", "A", 2.0, True), parallel=False)
    learned = " ".join(elements(lab, "a", sb))
    print(f"\nfirst {first}, 3 s later under another name {again}; its elements: {learned}", flush=True)
    assert first == {"rcode": 0, "a": [PYPI_IP], "ttls": [30]}, first
    assert again["a"] == [PYPI_IP], again
    # Told what is left of the first opening (30 s less the 3 s slept), not a fresh 30.
    assert 24 <= again["ttls"][0] <= 27, again
    # ...and the set's element still runs on its first timeout (not restarted).
    expires = [int(x) for x in re.findall(r"expires (\d+)s", learned)]
    assert expires and max(expires) <= 27, learned


async def test_dns_to_any_server_goes_to_the_proxy(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    got = await probe_named(sb, f"DNS straight to the foreign resolver {FOREIGN_DNS_IP}", {
        "other.test over TCP (not allowed)": ("dns", FOREIGN_DNS_IP, "other.test", "tcp"),
        "pypi.test over TCP (allowed)": ("dns", FOREIGN_DNS_IP, "pypi.test", "tcp"),
        "pypi.test over UDP (allowed)": ("dns", FOREIGN_DNS_IP, "pypi.test", "udp"),
    }, parallel=False)
    assert refused_or_silent(got["other.test over TCP (not allowed)"])
    # Allowed names are answered too, but by the node's proxy from its upstream (the
    # foreign resolver would have said FOREIGN_ANSWER).
    for label in ("pypi.test over TCP (allowed)", "pypi.test over UDP (allowed)"):
        assert got[label] == {"rcode": 0, "a": [PYPI_IP]}, f"{label}: {got[label]}"
    assert lab.foreign_queries() == [], f"sandbox DNS reached the foreign resolver: {lab.foreign_queries()}"
    assert not any(FOREIGN_ANSWER in str(v) for v in got.values())


async def test_cname_out_of_the_allowed_names_is_refused(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    gw = gateway(sb.info.network["address"])
    got = await probe_named(sb, 'alias.pypi.test is a CNAME of other.test; rules {"pypi": true}', {
        "resolve alias.pypi.test": ("resolve", "alias.pypi.test"),
        "DNS alias.pypi.test to the gateway": ("dns", gw, "alias.pypi.test"),
        f"then {OTHER_IP}:{HTTP_PORT}": ("connect", OTHER_IP, HTTP_PORT),
        "GET http://pypi.test:8000": ("http", PYPI_URL),
    }, parallel=False)
    assert blocked(got["resolve alias.pypi.test"])
    assert got["DNS alias.pypi.test to the gateway"] == {"rcode": 5, "a": []}
    assert blocked(got[f"then {OTHER_IP}:{HTTP_PORT}"])
    assert got["GET http://pypi.test:8000"] == "pypi"
    # The proxy asked (the name is allowed) and refused the answer for its CNAME.
    assert "alias.pypi.test" in {q["name"] for q in lab.upstream_queries()}


async def test_no_ipv6(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    iface = f"dsv{key(sb)}"
    # The node's side of the pair has no IPv6 at all: no address a sandbox could reach,
    # no route of its own in the node's table.
    knob = lab.node("cat", f"/proc/sys/net/ipv6/conf/{iface}/disable_ipv6").stdout.strip()
    assert knob == "1", knob
    assert lab.node("ip", "-6", "-o", "addr", "show", "dev", iface).stdout == ""
    # The node's service listens on IPv6 (it answers on the node's own loopback) ...
    assert await node_connect(lab, "::1", HOST_PORT) == "OK"
    # ... and the sandbox aims at the link-local address the node's side would have had
    # (the EUI-64 of its MAC), which nothing answers on.
    mac = lab.node("ip", "-o", "link", "show", "dev", iface).stdout.split("link/ether ")[1].split()[0]
    b = [int(x, 16) for x in mac.split(":")]
    b = [b[0] ^ 2, *b[1:3], 0xFF, 0xFE, *b[3:]]
    node_ll = "fe80::" + ":".join(f"{b[i] << 8 | b[i + 1]:x}" for i in range(0, 8, 2))
    lab.clear_logs()
    got = await probe_named(sb, "IPv6", {
        "getaddrinfo(pypi.test, AF_INET6)": ("resolve6", "pypi.test"),
        "DNS AAAA pypi.test to the gateway": ("dns", gateway(sb.info.network["address"]), "pypi.test", "udp", "AAAA"),
        f"node [{node_ll}%eth0]:{HOST_PORT}": ("connect6", node_ll, "eth0", HOST_PORT),
        "the sandbox's IPv6 addresses": ("ipv6_addresses",),
    })
    # IPv6 only on its loopback (`::1`, for what listens on localhost); none on eth0.
    assert {a.split()[0] for a in got["the sandbox's IPv6 addresses"]} == {"lo"}, got
    six = got["getaddrinfo(pypi.test, AF_INET6)"]
    assert blocked(six) or six == [], six
    assert got["DNS AAAA pypi.test to the gateway"] == {"rcode": 0, "a": []}
    assert blocked(got[f"node [{node_ll}%eth0]:{HOST_PORT}"])
    assert lab.host_connections() == [], lab.host_connections()


async def test_no_raw_sockets(lab: Netlab, node: DSecClient):
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    got = await probe_named(sb, "raw sockets", {
        "socket(AF_INET, SOCK_RAW, IPPROTO_ICMP)": ("raw", "icmp"),
        "socket(AF_PACKET, SOCK_RAW, ETH_P_ALL)": ("raw", "packet"),
    })
    for label, v in got.items():
        assert str(v).startswith("FAIL PermissionError"), f"{label}: {v}"


# A DNS query for pypi.test from `src` to `dst`:53, as one raw IPv4 packet (the kernel
# fills in the header checksum; a UDP checksum of 0 means none).
FORGE = r"""
import socket, struct, sys
src, dst = sys.argv[1], sys.argv[2]
name = b"".join(bytes([len(p)]) + p.encode() for p in "pypi.test".split(".")) + b"\0"
q = struct.pack(">HHHHHH", 0x5151, 0x0100, 1, 0, 0, 0) + name + struct.pack(">HH", 1, 1)
udp = struct.pack(">HHHH", 40000, 53, 8 + len(q), 0) + q
ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst)) + udp
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
for _ in range(3):
    s.sendto(ip, (dst, 0))
"""


async def test_a_sandbox_that_forges_another_sandboxs_address_is_dropped(lab: Netlab, node: DSecClient):
    """An attacker with raw sockets in its sandbox's network namespace (which a sandbox
    never has: here the test enters the namespace from the node) sends DNS queries as
    another sandbox. The DNS proxy knows a sandbox by its source address, so a forged
    query would open addresses in the victim's name and count against its rate; the node
    drops it before it gets there. The same packet with the attacker's own address is
    answered (so the drop is the forgery's doing)."""
    attacker, victim = await asyncio.gather(
        node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True})),
        node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True})))
    mark = f"{4000 + int(time.time()) % 1000}.{int(key(attacker), 36) % 10**6}"  # a number: sleep's argument
    await attacker.exec_background(argv=["sleep", mark])
    end, pid = time.monotonic() + 10, ""
    while not pid and time.monotonic() < end:
        pid = subprocess.run(["pgrep", "-xf", f"sleep {mark}"], capture_output=True,
                             text=True).stdout.split("\n")[0].strip()
        await asyncio.sleep(0.1)
    assert pid, "the attacker's process is not to be found on the node"
    gw = gateway(attacker.info.network["address"])

    def forge(src: str) -> None:
        subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", "python3", "-c", FORGE, src, gw],
                       check=True, timeout=10)

    def learned(sb: Sandbox) -> list[str]:
        end = time.monotonic() + 3
        while not (got := elements(lab, "a", sb)) and time.monotonic() < end:
            time.sleep(0.1)
        return got

    await asyncio.to_thread(forge, victim.info.network["address"])
    assert await asyncio.to_thread(learned, victim) == [], "a forged query opened addresses as the victim"
    await asyncio.to_thread(forge, attacker.info.network["address"])
    own = await asyncio.to_thread(learned, attacker)
    assert any(e.startswith(PYPI_IP) for e in own), f"the attacker's own query opened nothing: {own}"
    assert elements(lab, "a", victim) == []


# ---- egress headers: set by the node, never held by the sandbox -------------------------

# The probe of egress headers (see fetch_probe.py).
FETCH = (Path(__file__).parent / "fetch_probe.py").read_text()
LAB_CA_IN_SANDBOX = "/tmp/netlab-ca.pem"


async def fetch(sb: Sandbox, *checks: tuple) -> list:
    r = await sb.exec(argv=["python3", "-c", FETCH, json.dumps(checks)], timeout=120)
    assert r.exit_code == 0, f"fetch failed in {sb.id}: {r.stderr}"
    return json.loads(r.stdout)


def secret(v: object) -> str | None:
    """The X-Secret header the echo server got, or None when the request failed."""
    return v["headers"].get("x-secret") if isinstance(v, dict) else None


@pytest.mark.parametrize("backend", ["container", "vm"])
async def test_egress_headers_reach_the_named_host_only(lab: Netlab, node: DSecClient, backend: str):
    """A sandbox's egress headers are set by the node on its HTTP and HTTPS requests to
    the named host (HTTPS through the node's CA, which the sandbox was made to trust, the
    real server checked by the node) and to nothing else; the sandbox never holds the
    value. The attacks: a plain-HTTP request that names the host but goes to another
    allowed address, and TLS that names the host to another allowed address, get no
    header (the second fails, its server never sees the secret); the proxy cannot be
    reached directly; a sandbox without headers is not intercepted at all."""
    import shutil

    if backend == "vm" and not shutil.which("qemu-system-x86_64"):
        pytest.skip("skipped: qemu-system-x86_64 is not installed")
    args = dict(image="root/py:3.11", backend=backend, memory_limit_mb=256 if backend == "vm" else 128,
                ttl_seconds=900)
    sb, plain = await asyncio.gather(
        node.run_sandbox(DSecRunArgs(**args, network_rules={"pypi": True, "other.test": True},
                                     egress_headers={"pypi.test": {"X-Secret": "s3cret", "X-Team": "a"}})),
        node.run_sandbox(DSecRunArgs(**args, network_rules={"pypi": True})),
    )
    ca = (netlab.LAB_CA / "ca.pem").read_text()
    for s in (sb, plain):
        await s.files.write(LAB_CA_IN_SANDBOX, ca)
    assert sb.info.network.get("egress_headers") == {"pypi.test": {"X-Secret": "s3cret", "X-Team": "a"}}

    got = await fetch(
        sb,
        ["pypi.test", 443, "pypi.test", None, None, True],             # the named host, HTTPS
        ["pypi.test", 80, "pypi.test"],                                # the named host, HTTP
        ["other.test", 443, "other.test", None, LAB_CA_IN_SANDBOX, True],  # another host: untouched
        ["other.test", 80, "pypi.test"],                               # attack: Host names it, address is other's
        ["other.test", 443, "pypi.test", "pypi.test", None, True],      # attack: TLS names it to other's address
        [gateway(sb.info.network["address"]), 10080, "pypi.test"],      # attack: the proxy itself
        ["pypi.test", 443, "other.test", "pypi.test", None, True],      # attack: TLS names it, Host another
        ["pypi.test", 80, "pypi.test", None, None, False, "http://other.test/"],  # attack: URI names another
    )
    print(f"\negress headers ({backend}): " + json.dumps([secret(v) if not blocked(v) else v for v in got]),
          flush=True)
    https, http_, other, host_spoof, sni_spoof, direct, inner_host, absolute = got
    assert https["server"] == "pypi" and secret(https) == "s3cret" and https["headers"]["x-team"] == "a", https
    assert http_["server"] == "pypi" and secret(http_) == "s3cret", http_
    # Checked against the lab's own CA: the real server's certificate, not the node's.
    assert other["server"] == "other" and secret(other) == "from-sandbox", other
    assert host_spoof["server"] == "other" and secret(host_spoof) == "from-sandbox", host_spoof
    assert blocked(sni_spoof), sni_spoof
    assert blocked(direct), direct
    # Behind a server that proved it is the host, a request naming another host (which a
    # front serving many routes by) gets nothing; nor one whose URI names another.
    assert inner_host["server"] == "pypi" and secret(inner_host) == "from-sandbox", inner_host
    assert absolute["server"] == "pypi" and secret(absolute) == "from-sandbox", absolute
    leaked = [e for e in lab.echoed() if e["server"] == "other" and e["headers"].get("x-secret") == "s3cret"]
    assert not leaked, leaked

    r = await sb.exec(argv=["sh", "-c", "env; cat /proc/self/environ; ls /usr/local/share/ca-certificates"])
    assert "s3cret" not in r.stdout and "opendsec-egress.crt" in r.stdout, r.stdout

    # The node's own address, even when a rule names it, is not reached through the proxy
    # (which would connect from the node to itself).
    lab.clear_logs()
    node_self = await node.run_sandbox(DSecRunArgs(**args, network_rules={NODE_IP: True},
                                                   egress_headers={NODE_IP: {"X-Secret": "s3cret"}}))
    got_node = await fetch(node_self, [NODE_IP, 80, NODE_IP])
    assert blocked(got_node[0]) and lab.host_connections() == [], (got_node, lab.host_connections())

    # Not intercepted: the lab's CA verifies the server it reached, and nothing was set.
    untouched = await fetch(plain, ["pypi.test", 443, "pypi.test", None, LAB_CA_IN_SANDBOX, True],
                            ["pypi.test", 80, "pypi.test"])
    assert [secret(v) for v in untouched] == ["from-sandbox", "from-sandbox"], untouched

    # Changed at runtime, then taken away: the proxy lets go of the sandbox.
    await sb.set_network_rules({"pypi": True}, {"pypi.test": {"X-Secret": "v2"}})
    assert secret((await fetch(sb, ["pypi.test", 443, "pypi.test", None, None, True]))[0]) == "v2"
    await sb.set_network_rules({"pypi": True})
    after = await fetch(sb, ["pypi.test", 443, "pypi.test", None, LAB_CA_IN_SANDBOX, True],
                        ["pypi.test", 80, "pypi.test"])
    assert [secret(v) for v in after] == ["from-sandbox", "from-sandbox"], after


async def test_bad_egress_headers_are_refused(lab: Netlab, node: DSecClient):
    bad = [
        ({"not a host": {"X-A": "1"}}, "neither a domain"),
        ({"api.example.com": {"Host": "evil.test"}}, "cannot be set"),
        ({"api.example.com": {"X-A": "1\r\nX-Injected: 1"}}, "printable ASCII"),
        ({"api.example.com": {"X A": "1"}}, "not a header name"),
        ({"api.example.com": {}}, "give 1 to"),
    ]
    for headers, says in bad:
        with pytest.raises(InvalidArgumentError, match=says):
            await node.run_sandbox(DSecRunArgs(**TINY, network_rules={"api.example.com": True},
                                               egress_headers=headers))
    with pytest.raises(InvalidArgumentError, match="no network"):
        await node.run_sandbox(DSecRunArgs(**TINY, network="none", egress_headers={"pypi.test": {"X-A": "1"}}))
    assert await node.list_sandboxes() == []


# ---- E2B's allowOut / denyOut, through the lab node's gateway -----------------------------


@pytest.mark.parametrize("template", ["base", "base-vm"], ids=["container", "vm"])
def test_e2b_allow_out_wins_over_deny_out(lab: Netlab, node: DSecClient, template: str):
    """E2B's egress rules with real traffic, through the lab node's E2B gateway: deny all
    plus specific allows reaches the allowed address only; an address both allowed and
    denied is allowed (allow wins, as E2B defines it); `update_network` changes them at
    once."""
    e2b, saved = lab_e2b()
    get = ("python3 -c \"import sys, urllib.request as u\n"
           "try: print(u.urlopen(sys.argv[1], timeout=3).read().decode().strip())\n"
           "except Exception as e: print('FAIL', type(e).__name__)\" ")
    pypi, other = f"http://{PYPI_IP}:{HTTP_PORT}/", f"http://{OTHER_IP}:{HTTP_PORT}/"
    made = []
    try:
        only = e2b.Sandbox.create(template, timeout=300, network={
            "allow_out": [PYPI_IP], "deny_out": ["0.0.0.0/0"]})
        made.append(only)
        both = e2b.Sandbox.create(template, timeout=300, network={
            "allow_out": [f"{OTHER_IP}/32"], "deny_out": [OTHER_IP, "0.0.0.0/0"]})
        made.append(both)
        assert only.commands.run(get + pypi).stdout.strip() == "pypi"
        assert only.commands.run(get + other).stdout.startswith("FAIL")
        assert both.commands.run(get + other).stdout.strip() == "other"
        assert both.commands.run(get + pypi).stdout.startswith("FAIL")
        only.update_network({"allow_out": [OTHER_IP], "deny_out": ["0.0.0.0/0"]})
        assert only.commands.run(get + other).stdout.strip() == "other"
        assert only.commands.run(get + pypi).stdout.startswith("FAIL")
    finally:
        for m in made:
            m.kill()
        restore_env(saved)


@pytest.mark.parametrize("template", ["base", "base-vm"], ids=["container", "vm"])
def test_e2b_rules_set_headers_and_dns_servers_open(lab: Netlab, node: DSecClient, template: str):
    """E2B's `network.rules` through the lab node's gateway: a transform's headers are set
    on HTTPS and HTTP requests to its host (an exact name before the longest wildcard,
    values replacing the request's own), the sandbox's info shows them, `update_network`
    replaces them and, left out, removes them; `dns_servers` are opened (all traffic)
    when `allow_out` names a domain, and only then; workload identity is refused."""
    e2b, saved = lab_e2b()
    made = []
    try:
        sb = e2b.Sandbox.create(template, timeout=300, network={
            "allow_out": ["pypi.test", "files.pypi.test"], "deny_out": ["0.0.0.0/0"],
            "rules": {"pypi.test": [{"transform": {"headers": {"X-Secret": "exact"}}}],
                      "*.pypi.test": [{"transform": lambda ctx: {"headers": {"X-Secret": "wild"}}}]},
            "dns_servers": [OTHER_IP]})
        made.append(sb)
        sb.files.write("/tmp/fetch.py", FETCH)

        def run(*checks: list) -> list:
            r = sb.commands.run(f"python3 /tmp/fetch.py '{json.dumps(checks)}'", timeout=120)
            return json.loads(r.stdout)

        got = run(["pypi.test", 443, "pypi.test", None, None, True], ["pypi.test", 80, "pypi.test"],
                  ["files.pypi.test", 443, "files.pypi.test", None, None, True])
        assert [secret(v) for v in got] == ["exact", "exact", "wild"], got
        net = sb.get_info().network
        assert net and net["rules"]["pypi.test"][0]["transform"]["headers"] == {"X-Secret": "exact"}, net
        # The DNS server is open, all of it, since allow_out names a domain.
        other = sb.commands.run(f"python3 -c \"import urllib.request as u; "
                                f"print(u.urlopen('http://{OTHER_IP}:{HTTP_PORT}/', timeout=3).read().decode())\"")
        assert other.stdout.strip() == "other"

        sb.update_network({"allow_out": ["pypi.test"], "deny_out": ["0.0.0.0/0"],
                           "rules": {"pypi.test": [{"transform": {"headers": {"X-Secret": "second"}}}]}})
        assert secret(run(["pypi.test", 443, "pypi.test", None, None, True])[0]) == "second"
        sb.update_network({"allow_out": ["pypi.test"], "deny_out": ["0.0.0.0/0"]})
        assert secret(run(["pypi.test", 80, "pypi.test"])[0]) == "from-sandbox"

        # No domain in allow_out: the DNS servers are not opened.
        by_ip = e2b.Sandbox.create(template, timeout=300, network={
            "allow_out": [PYPI_IP], "deny_out": ["0.0.0.0/0"], "dns_servers": [OTHER_IP]})
        made.append(by_ip)
        with pytest.raises(e2b.CommandExitException, match="URLError|timed out"):
            by_ip.commands.run(f"python3 -c \"import urllib.request as u; "
                               f"u.urlopen('http://{OTHER_IP}:{HTTP_PORT}/', timeout=3)\"", timeout=60)
    finally:
        for m in made:
            m.kill()
        restore_env(saved)
    assert len(made) == 2
    with pytest.raises(e2b.SandboxException, match="400: iam .workload identity"):
        e2b, saved = lab_e2b()
        try:
            e2b.Sandbox.create(template, timeout=60, iam={"tokens": {"aws": {"audience": "sts.amazonaws.com",
                                                                           "token_type": "JWT-SVID"}}},
                               network={"allow_out": ["pypi.test"],
                                        "rules": {"pypi.test": [{"transform": lambda ctx: {"headers": {
                                            "Authorization": f"Bearer {ctx.iam.tokens['aws']}"}}}]}})
        finally:
            restore_env(saved)


@pytest.mark.parametrize("template", ["base", "base-vm"], ids=["container", "vm"])
def test_e2b_npm_rules_and_dns_servers(lab: Netlab, node: DSecClient, template: str):
    """The same from JavaScript: the released `e2b` npm package (js/network.mjs) against
    the lab node's gateway."""
    import shutil

    from conftest import JS
    if shutil.which("node") is None or not (JS / "node_modules/e2b").is_dir():
        pytest.fail("node and the e2b npm package are needed (deploy/deps.sh; conftest installs the package)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    for line in (netlab.NODE_DIR / "e2b.env").read_text().splitlines():
        k, _, v = line.partition("=")
        if k:
            env[k] = v
    r = subprocess.run(["node", "network.mjs", template, OTHER_IP], cwd=JS, env=env,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok network"), r.stdout + r.stderr


def restore_env(saved: dict) -> None:
    """Puts back the environment `lab_e2b` replaced."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def lab_e2b():
    """The `e2b` package pointed at the lab node's gateway: (module, the environment it
    replaced, to put back)."""
    from test_e2b import E2B_VERSION, pip_pinned
    pip_pinned("e2b", E2B_VERSION)
    import e2b

    env = {}
    for line in (netlab.NODE_DIR / "e2b.env").read_text().splitlines():
        k, _, v = line.partition("=")
        if k:
            env[k] = v
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return e2b, saved


# ---- 4. scale and cleanup ------------------------------------------------------------------


async def test_two_hundred_sandboxes_with_rules_leave_nothing_behind(lab: Netlab, node: DSecClient):
    n, limit = 200, 16
    rules = [(f"203.0.113.{i % 200 + 1}", 1000 + i) for i in range(n)]
    sem = asyncio.Semaphore(limit)

    async def make(ip: str, port: int) -> Sandbox:
        async with sem:
            return await node.run_sandbox(DSecRunArgs(**TINY, network_rules={f"{ip}:{port}": True}))

    t0 = time.monotonic()
    made = await asyncio.gather(*(make(*r) for r in rules), return_exceptions=True)
    took = time.monotonic() - t0
    ok = [s for s in made if isinstance(s, Sandbox)]
    failed = [e for e in made if not isinstance(e, Sandbox)]
    print(f"\n{len(ok)} sandboxes with a rule each in {took:.1f} s: {len(ok) / took:.1f} creates/s "
          f"(concurrency {limit})", flush=True)
    assert not failed, f"{len(failed)} of {n} creates failed, e.g. {failed[:3]}"
    assert len({s.info.network["address"] for s in ok}) == n

    # Each sandbox's rule is one element of the node's fixed set `p1` (one address and a
    # port), keyed by its interface; no chain or set per sandbox.
    table = await asyncio.to_thread(lab.nft)
    assert not PER_SANDBOX.findall(table), PER_SANDBOX.findall(table)[:5]
    listing = lab.node("nft", "list", "set", "inet", "dsec", "p1").stdout
    ports: dict[str, list[str]] = {}
    for k, rest in SANDBOX_ELEMENT.findall(listing):
        ports.setdefault(k, []).append(rest.strip())
    for s, (ip, port) in zip(ok, rules):
        held = ports.get(key(s), [])
        assert len(held) == 1 and re.fullmatch(rf"{re.escape(ip)}(/32)? \. {port}", held[0]), \
            f"{s.id}: rule {ip}:{port}, set p1 holds {held!r} for it"

    t1 = time.monotonic()

    async def stop(s: Sandbox) -> None:
        async with sem:
            await s.stop()

    await asyncio.gather(*(stop(s) for s in ok))
    print(f"stopped them in {time.monotonic() - t1:.1f} s", flush=True)
    assert await node.list_sandboxes() == []

    table = await asyncio.to_thread(lab.nft)
    left = PER_SANDBOX.findall(table)
    assert not left, f"per-sandbox sets and chains in the node's table: {left[:10]}\n{table[:3000]}"
    for set_name in ("c", "p", "x", "xp", "c1", "p1", "x1", "xp1"):
        assert elements(lab, set_name) == [], f"elements left in set {set_name}: {elements(lab, set_name)[:5]}"
    assert netlab.sandbox_namespaces() == []
    # A deleted namespace takes its veth pair with it, but the kernel dismantles namespaces
    # asynchronously: give it a few seconds.
    end = time.monotonic() + 10
    while lab.sandbox_links() and time.monotonic() < end:
        await asyncio.sleep(0.2)
    assert lab.sandbox_links() == []


# ---- 5. bad rules ----------------------------------------------------------------------------


async def test_bad_rules_are_refused(lab: Netlab, node: DSecClient):
    with pytest.raises(InvalidArgumentError) as e:
        await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pipy": True}))
    print(f"\nnetwork_rules {{'pipy': True}}: {e.value.status} {e.value}", flush=True)
    assert e.value.status == 400 and "pipy" in e.value.message

    with pytest.raises(InvalidArgumentError) as e:
        await node.run_sandbox(DSecRunArgs(**PY, network="none", network_rules={"pypi": True}))
    print(f'network "none" with rules: {e.value.status} {e.value}', flush=True)
    assert await node.list_sandboxes() == []

    # A bad rule for a running sandbox changes nothing.
    sb = await node.run_sandbox(DSecRunArgs(**PY, network_rules={"pypi": True}))
    with pytest.raises(InvalidArgumentError) as e:
        await sb.set_network_rules({"pipy": True})
    assert "pipy" in e.value.message
    assert (await node.get_sandbox(sb.id)).info.network["rules"] == {"pypi": True}
    assert (await probe(sb, ("http", PYPI_URL))) == ["pypi"]
