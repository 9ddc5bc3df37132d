# SPDX-License-Identifier: AGPL-3.0-only
"""One conformance suite for every sandbox backend (in the manner of containerd's
snapshotter test suite): the same scenarios, parameterised over `container`, `vm` and
`microvm`. What each backend can do comes from the running server (`GET /v1/status`:
each backend's `capabilities`); the assertions follow the capabilities, never the
backend's name. A backend the server reports unavailable is skipped with its reason.

Each backend's cheap scenarios (create, exec, files, sessions, refusals) share one
sandbox (`shared`); the others make their own and stop it, and check after the stop
that nothing of it is left on the host."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import DATA, cgroup_file, leftovers, server_down, server_up, wait_for
from opendsec import DSecClient, DSecRunArgs, NotFoundError, PreconditionError
from opendsec.errors import DSecError
from test_microvm import vmm_processes
from test_vm import _cpu_seconds, ask, qemu_processes, start_holder

BACKENDS = ["container", "vm", "microvm"]

# What each backend is specified to report (crates/edge/src/backend/*/mod.rs).
EXPECTED_CAPABILITIES = {
    "container": ["pause_to_disk", "volumes"],
    "vm": ["fork_memory", "pause_to_disk", "move", "volumes"],
    "microvm": ["fork_memory", "pause_to_disk", "move"],
}

# Known gaps, each reported: the scenario is expected to fail on these backends (strict:
# it fails the suite once the gap is closed, so the entry goes).
KNOWN_GAPS: dict[tuple[str, str], str] = {}


# Counts processes whose command line has `pattern` (a grep regex; the images have no
# pgrep), as test_lifecycle.py does for `sleep 1000`.
def count_procs(pattern: str) -> str:
    return f"cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o '{pattern}' | wc -l"


COUNT_SLEEPS = count_procs("sleep 100[0]")
COUNT_HOLDERS = count_procs("python3 /tmp/holder[.]py")
RANDOM_AND_UUID = "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /proc/sys/kernel/random/uuid"


# ---- what the server says, and the backends it offers -------------------------------

def _run(coro):
    """Runs `coro` to completion from a synchronous (module-scoped) fixture."""
    return asyncio.run(coro)


async def _status() -> dict:
    async with DSecClient() as c:
        return await c.status()


@pytest.fixture(scope="module")
def node_backends(server) -> dict[str, dict]:
    """The node's backends as `GET /v1/status` reports them, by name (read once)."""
    st = _run(_status())
    return {b["name"]: b for b in st["nodes"][0]["backends"]}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, node_backends) -> str:
    name = request.param
    b = node_backends.get(name)
    assert b is not None, f"the server does not report a {name} backend: {sorted(node_backends)}"
    if not b["available"]:
        pytest.skip(f"the {name} backend is unavailable here: {b['detail']}")
    return name


@pytest.fixture(scope="module")
def caps(backend, node_backends) -> frozenset[str]:
    return frozenset(node_backends[backend]["capabilities"])


# Ids of the module's shared sandboxes (left alone by `api`'s check).
SHARED_IDS: set[str] = set()


async def _create_shared(backend: str) -> str:
    async with DSecClient() as c:
        t0 = time.monotonic()
        sb = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256,
                                             env={"FROM_CREATE": "c"}, labels={"suite": f"backends-{backend}"}))
        print(f"\n{backend}: created and running in {time.monotonic() - t0:.1f} s", flush=True)
        return sb.id


async def _stop_ids(*ids: str) -> None:
    async with DSecClient() as c:
        for sid in ids:
            try:
                await (await c.get_sandbox(sid)).stop()
            except NotFoundError:
                pass


@pytest.fixture(scope="module")
def shared(backend) -> str:
    """One py:3.11 sandbox of the backend for the scenarios that change nothing of it
    but files under their own directories; stopped (and checked gone) after the module."""
    sid = _run(_create_shared(backend))
    SHARED_IDS.add(sid)
    yield sid
    SHARED_IDS.discard(sid)
    _run(_stop_ids(sid))
    assert_gone(sid)


@pytest.fixture
async def api():
    """A client for one test; after it, no sandbox but the shared ones may be left (a
    test stops what it made, in a `finally`)."""
    async with DSecClient() as c:
        yield c
        left = [s.id for s in await c.list_sandboxes() if s.id not in SHARED_IDS]
        for sid in left:
            try:
                await (await c.get_sandbox(sid)).stop()
            except NotFoundError:
                pass
        assert not left, f"the test left these sandboxes running: {left}"


# ---- what a sandbox has on the host ---------------------------------------------------

def cgroup_procs(sandbox_id: str) -> list[int]:
    try:
        return [int(p) for p in cgroup_file("memory", sandbox_id, "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def host_processes(sandbox_id: str) -> list[int]:
    """Every process of the sandbox the host can see: its cgroup's (a container's
    processes, a VMM), and QEMU, vmux, Firecracker or vsockproxy naming it."""
    return sorted(set(cgroup_procs(sandbox_id)) | set(qemu_processes(sandbox_id)) | set(vmm_processes(sandbox_id)))


def ram_files(sandbox_id: str) -> list[str]:
    """Files of the sandbox in the VM memory directory (a tmpfs: host RAM)."""
    d = Path("/dev/shm/dsec-vm")
    return [p.name for p in d.glob("*") if sandbox_id in p.name] if d.exists() else []


def assert_gone(sandbox_id: str) -> None:
    """After a stop: no process, no memory file, nothing of `leftovers` (mounts, cgroups,
    directories, runtime state)."""
    assert wait_for(lambda: not host_processes(sandbox_id), timeout=10), \
        f"processes of {sandbox_id} outlived it: {host_processes(sandbox_id)}"
    assert not qemu_processes(sandbox_id), "QEMU or vmux outlived the sandbox"
    assert not vmm_processes(sandbox_id), "Firecracker or vsockproxy outlived the sandbox"
    assert wait_for(lambda: not leftovers(sandbox_id), timeout=10), leftovers(sandbox_id)
    assert not ram_files(sandbox_id), f"its memory files stayed in RAM: {ram_files(sandbox_id)}"


async def stop_all(sbs) -> None:
    """Stops each of `sbs` (for a `finally`: no assertion here)."""
    for sb in sbs:
        try:
            await sb.stop()
        except Exception as e:  # the test's own failure, if any, is the one to see
            print(f"stopping {sb.id}: {e}", flush=True)


async def clock_is_the_hosts(sb) -> None:
    r = await sb.exec(["date", "+%s"])
    assert abs(int(r.stdout) - time.time()) < 5, r


async def holders(sb) -> int:
    return int((await sb.run_shell(COUNT_HOLDERS)).stdout)


def known_gap(request, scenario: str, backend: str) -> None:
    reason = KNOWN_GAPS.get((scenario, backend))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


# ---- the backends and their capabilities ----------------------------------------------

def test_every_backend_is_reported(node_backends):
    assert sorted(node_backends) == sorted(BACKENDS), node_backends
    for name, b in node_backends.items():
        assert isinstance(b["available"], bool) and b["detail"], b
        assert set(b["capabilities"]) <= {"fork_memory", "pause_to_disk", "move", "volumes"}, b


async def test_reports_exactly_its_capabilities(backend, node_backends):
    reported = node_backends[backend]["capabilities"]
    assert len(reported) == len(set(reported)), reported
    assert sorted(reported) == sorted(EXPECTED_CAPABILITIES[backend]), reported


@pytest.mark.parametrize("name", BACKENDS)
async def test_an_unavailable_backend_refuses_a_create_with_its_reason(name, node_backends, api):
    b = node_backends[name]
    if b["available"]:
        pytest.skip(f"the {name} backend is available here")
    with pytest.raises(DSecError) as e:
        await api.run_sandbox(DSecRunArgs(image="root/base", backend=name))
    assert (e.value.status, e.value.code) == (503, "unavailable"), e.value
    assert b["detail"] in e.value.message, e.value


async def test_refuses_what_it_lacks_before_doing_anything(backend, caps, shared, api):
    """A request that needs a capability the backend lacks is refused before anything is
    done: 501 `unimplemented` naming the capability (400 for a create's argument)."""
    sb = await api.get_sandbox(shared)
    fork_tmp = DATA / "edge/fork-tmp"

    async def nothing_done():
        assert sorted(s.id for s in await api.list_sandboxes()) == before
        assert (await sb.refresh()).state == "running" and not sb.info.paused_to_disk
        assert (await sb.exec(["echo", "alive"])).stdout == "alive\n"
        assert sorted(os.listdir(fork_tmp)) == tmp_before

    before = sorted(s.id for s in await api.list_sandboxes())
    tmp_before = sorted(os.listdir(fork_tmp))
    checked = []
    # move: a fork whose copies go to another edge.
    with pytest.raises(DSecError) as e:
        await sb.fork(count=1, edge="other")
    if "move" in caps:
        # Not refused for the capability (here: no cluster to place it in).
        assert e.value.code != "unimplemented", e.value
    else:
        assert (e.value.status, e.value.code) == (501, "unimplemented"), e.value
        assert "capability move" in e.value.message, e.value
        checked.append("move")
    await nothing_done()
    # move: a resume on another edge (checked before the sandbox is paused to disk).
    with pytest.raises(DSecError) as e:
        await sb.resume(edge="other")
    if "move" in caps:
        assert e.value.code != "unimplemented", e.value
    else:
        assert (e.value.status, e.value.code) == (501, "unimplemented"), e.value
        assert "capability move" in e.value.message, e.value
    await nothing_done()
    # pause_to_disk
    if "pause_to_disk" not in caps:
        with pytest.raises(DSecError) as e:
            await sb.pause(to_disk=True)
        assert (e.value.status, e.value.code) == (501, "unimplemented"), e.value
        assert "capability pause_to_disk" in e.value.message, e.value
        await nothing_done()
        checked.append("pause_to_disk")
    # volumes: a create that mounts one, refused before the volume is even looked up
    # (the name need not exist; a node without loop devices makes none).
    if "volumes" not in caps:
        with pytest.raises(DSecError) as e:
            await api.run_sandbox(DSecRunArgs(image="root/base", backend=backend,
                                              volumes={"/mnt/data": "no-such-volume"}))
        assert (e.value.status, e.value.code) == (400, "invalid_argument"), e.value
        assert "capability volumes" in e.value.message, e.value
        await nothing_done()
        checked.append("volumes")
    print(f"\n{backend} refused, for lack of the capability: {checked or 'nothing (it has them all)'}", flush=True)


# ---- create, exec, files, sessions (the shared sandbox) ---------------------------------

async def test_create(backend, shared, api):
    sb = await api.get_sandbox(shared)
    info = sb.info
    assert (info.backend, info.state) == (backend, "running"), info
    assert info.image.startswith("root/py:3.11"), info.image
    assert info.limits["memory_mb"] == 256, info.limits
    assert info.labels == {"suite": f"backends-{backend}"}, info.labels
    assert [s.id for s in await api.list_sandboxes(labels=info.labels)] == [sb.id]
    r = await sb.run_shell("python3 -c 'print(6*7)'")
    assert (r.stdout, r.exit_code) == ("42\n", 0), r
    r = await sb.run_shell("echo $DSEC_SANDBOX_ID")
    assert r.stdout.strip() == sb.id, r


async def test_exec(backend, shared, api):
    sb = await api.get_sandbox(shared)
    r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = await sb.run_shell("echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)
    assert (await sb.exec(["true"])).exit_code == 0
    assert (await sb.exec(["false"])).exit_code == 1
    # The environment of the create and of the call; the working directory; stdin.
    r = await sb.exec(["sh", "-c", 'echo "$FROM_CREATE $X $(pwd)"'], env={"X": "x"}, cwd="/tmp")
    assert r.stdout == "c x /tmp\n", r
    r = await sb.exec(["cat"], stdin="from stdin")
    assert r.stdout == "from stdin", r
    r = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper(), end='')"], stdin="abc\n")
    assert r.stdout == "ABC\n", r
    # A process killed by a signal; a command past its timeout.
    r = await sb.run_shell("kill -9 $$")
    assert r.exit_code == 137 and r.signal == signal.SIGKILL, r
    t0 = time.monotonic()
    r = await sb.run_shell("sleep 30", timeout=1)
    assert r.timed_out and r.exit_code == 137, r
    assert time.monotonic() - t0 < 10
    # A background child that keeps stdout open: the command still returns, with what it
    # printed, and the child runs on.
    r = await sb.run_shell("s=1000; sleep $s & echo started $!")
    assert r.exit_code == 0 and r.stdout.startswith("started "), r
    try:
        assert (await sb.run_shell(COUNT_SLEEPS)).stdout.strip() == "1"
    finally:
        await sb.run_shell(f"kill {r.stdout.split()[1]}")
    assert (await sb.run_shell(COUNT_SLEEPS)).stdout.strip() == "0"


async def test_files(backend, shared, api):
    sb = await api.get_sandbox(shared)
    f = sb.files
    d = "/root/files-test"
    try:
        w = await f.write(f"{d}/a.txt", "hello\n", mode=0o640)
        assert w["size"] == 6
        assert await f.read(f"{d}/a.txt") == b"hello\n"
        await f.write(f"{d}/a.txt", b"world\n", append=True)
        assert await f.read_text(f"{d}/a.txt") == "hello\nworld\n"
        assert (await sb.run_shell(f"cat {d}/a.txt")).stdout == "hello\nworld\n"
        # What a process writes, the API reads.
        await sb.run_shell(f"printf 'from exec' > {d}/x")
        assert await f.read_text(f"{d}/x") == "from exec"

        st = await f.stat(f"{d}/a.txt")
        assert (st["path"], st["name"], st["type"], st["size"]) == (f"{d}/a.txt", "a.txt", "file", 12), st
        assert st["mode"] & 0o7777 == 0o640 and (st["uid"], st["gid"]) == (0, 0), st
        assert abs(st["mtime_ms"] - time.time() * 1000) < 300_000, st
        assert (await f.stat(d))["type"] == "dir"

        await f.write(f"{d}/t/b/c.txt", "2")
        paths = lambda entries: [e["path"] for e in entries]  # noqa: E731
        assert paths(await f.list(d)) == [f"{d}/a.txt", f"{d}/t", f"{d}/x"]
        two = await f.list(f"{d}/t", depth=2)
        assert paths(two) == [f"{d}/t/b", f"{d}/t/b/c.txt"] and [e["type"] for e in two] == ["dir", "file"]
        assert await f.exists(f"{d}/t/b/c.txt") is True
        assert await f.exists(f"{d}/t/nope") is False

        await f.remove(f"{d}/x")
        assert not await f.exists(f"{d}/x")
        assert (await sb.run_shell(f"test -e {d}/x || echo gone")).stdout == "gone\n"
        with pytest.raises(DSecError):
            await f.remove(f"{d}/t")  # not empty, not recursive
        assert await f.exists(f"{d}/t/b/c.txt")
        await f.remove(f"{d}/t", recursive=True)
        assert not await f.exists(f"{d}/t")
        with pytest.raises(NotFoundError) as e:
            await f.read(f"{d}/missing")
        assert e.value.status == 404
        with pytest.raises(NotFoundError):
            await f.stat(f"{d}/missing")

        # A file of a few MiB each way, byte for byte.
        blob = os.urandom(3 << 20)
        t0 = time.monotonic()
        w = await f.write(f"{d}/blob", blob)
        assert w["size"] == len(blob)
        r = await sb.exec(["sha256sum", f"{d}/blob"])
        assert r.stdout.split()[0] == hashlib.sha256(blob).hexdigest(), r
        assert await f.read(f"{d}/blob") == blob
        print(f"\n{backend}: 3 MiB up and down in {time.monotonic() - t0:.2f} s", flush=True)
    finally:
        await sb.run_shell(f"rm -rf {d}")


async def test_sessions(backend, shared, api):
    sb = await api.get_sandbox(shared)
    s = await sb.sessions.create()
    s2 = None
    try:
        assert (await s.run("cd /var; export A=1")).exit_code == 0
        r = await s.run("pwd; echo $A")
        assert (r.stdout, r.exit_code, r.state) == ("/var\n1\n", 0, "done"), r
        await s.run('greet() { echo "hello $1"; }')
        assert (await s.run("greet bob")).stdout == "hello bob\n"
        r = await s.run("echo oops >&2; false")
        assert (r.stdout, r.stderr, r.exit_code) == ("", "oops\n", 1), r
        # Another session has its own state; a plain exec none of theirs.
        s2 = await sb.sessions.create(cwd="/tmp", env={"B": "2"})
        assert (await s2.run("pwd; echo $B; echo ${A:-unset}")).stdout == "/tmp\n2\nunset\n"
        assert (await s.run("pwd; echo ${B:-unset}")).stdout == "/var\nunset\n"
        assert (await sb.run_shell("echo ${A:-unset}")).stdout == "unset\n"
        assert {s.id, s2.id} <= {x["session_id"] for x in await sb.sessions.list()}
        await s2.kill()
        assert s2.id not in {x["session_id"] for x in await sb.sessions.list()}
        with pytest.raises(NotFoundError):
            await s2.run("echo gone")
    finally:
        await s.kill()
        if s2:
            await s2.kill()


# ---- limits ---------------------------------------------------------------------------

async def test_memory_limit(backend, api):
    """Beyond its memory limit an allocation fails: the process is OOM-killed (and the
    kill reported), or refused (a guest kernel's MemoryError); under it, it works."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=128))
    try:
        r = await sb.exec(["python3", "-c", "b = bytearray(600 << 20); print('allocated')"], timeout=120)
        assert r.exit_code != 0 and "allocated" not in r.stdout, r
        if r.oom_killed:
            assert r.exit_code == 137 and r.signal == 9, r
            assert (await sb.refresh()).oom_kills >= 1
        else:
            assert "MemoryError" in r.stderr, r
        print(f"\n{backend}: 600 MiB under a 128 MiB limit: {'OOM-killed' if r.oom_killed else 'MemoryError'}", flush=True)
        r = await sb.exec(["python3", "-c", "b = bytearray(16 << 20); print('ok')"])
        assert r.stdout == "ok\n" and r.oom_killed is False, r
        assert (await sb.refresh()).state == "running"
    finally:
        await stop_all([sb])
    assert_gone(sb.id)


async def test_cpu_limit(backend, api):
    """A process spinning in a sandbox with cpu_cores_limit=0.5 gets half a host core
    (measured on the sandbox's cgroup, where a VMM runs too)."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/base", backend=backend, cpu_cores_limit=0.5,
                                           memory_limit_mb=256))
    try:
        assert sb.info.limits["cpu_cores"] == 0.5, sb.info.limits
        # Whatever the host runs for it runs in its cgroup.
        procs = cgroup_procs(sb.id)
        vmms = [p for p in qemu_processes(sb.id) + vmm_processes(sb.id)
                if any(n in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for n in (b"qemu-system", b"firecracker"))]
        assert procs and set(vmms) <= set(procs), (vmms, procs)
        await sb.exec_background(cmd="while :; do :; done")
        await asyncio.sleep(1)
        t0, c0 = time.monotonic(), _cpu_seconds(sb.id)
        await asyncio.sleep(3)
        used = (_cpu_seconds(sb.id) - c0) / (time.monotonic() - t0)
        print(f"\n{backend} with cpu_cores_limit=0.5, spinning: {used:.2f} cores", flush=True)
        assert 0.2 < used < 0.65, used
    finally:
        await stop_all([sb])
    assert_gone(sb.id)


async def test_pids_limit(backend, api, request):
    """No more processes than pids_limit: forks beyond it are refused, and the sandbox
    goes on."""
    known_gap(request, "pids", backend)
    sb = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, pids_limit=64))
    forker = (
        "import os, time\n"
        "kids = []\n"
        "for i in range(100):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno); break\n"
        "    if pid == 0:\n"
        "        time.sleep(1000); os._exit(0)\n"
        "    kids.append(pid)\n"
        "print(len(kids))\n"
        "for k in kids: os.kill(k, 9)\n"
        "for k in kids: os.waitpid(k, 0)\n"
    )
    try:
        assert sb.info.limits["pids"] == 64, sb.info.limits
        r = await sb.exec(["python3", "-c", forker], timeout=120)
        lines = r.stdout.split()
        assert r.exit_code == 0 and lines[0] == "refused", r
        assert int(lines[-1]) < 64, r
        assert (await sb.run_shell("echo alive", timeout=30)).stdout == "alive\n"
    finally:
        await stop_all([sb])
    assert_gone(sb.id)


# ---- pause, snapshot, fork, commit --------------------------------------------------------

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done"


async def test_pause_resume(backend, api):
    """Paused in place, the sandbox's processes stand still (a counting loop does not
    advance; its TTL does not run) and keep their state: after the resume the same
    processes go on, with what they held in memory."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256,
                                           ttl_seconds=600))
    try:
        value = await start_holder(sb)
        counter = await sb.exec_background(cmd=COUNTER)
        await asyncio.sleep(0.5)

        async def count() -> int:
            return int((await sb.run_shell("cat /tmp/c")).stdout)

        r0 = await count()
        await asyncio.sleep(1.0)
        running = await count() - r0
        vmms = set(qemu_processes(sb.id)) | set(vmm_processes(sb.id))
        p0 = await count()
        info = await sb.pause()
        assert info.state == "paused" and not info.paused_to_disk, info
        assert (await api.get_sandbox(sb.id)).info.state == "paused"
        # It stays on the host (a VMM included), standing still: nothing starts or ends.
        paused = host_processes(sb.id)
        assert paused, "nothing of it is left on the host while paused in place"
        assert set(qemu_processes(sb.id)) | set(vmm_processes(sb.id)) == vmms, "its VMM changed while paused in place"
        expires = info.expires_at_ms
        with pytest.raises(PreconditionError):
            await sb.exec(["true"], timeout=5)
        await asyncio.sleep(1.0)
        assert host_processes(sb.id) == paused, "its processes changed while paused in place"
        info = await sb.resume()
        assert info.state == "running", info
        p1 = await count()
        assert running >= 4 and p1 - p0 < running / 2, f"counted {p1 - p0} while paused 1 s, {running} while running"
        await asyncio.sleep(0.5)
        assert await count() > p1 >= p0, "the counter did not go on after resume"
        procs = [p["pid"] for p in await sb.processes() if p["running"]]
        assert counter.pid in procs, (counter.pid, procs)
        assert (await sb.refresh()).expires_at_ms >= expires + 900, "the TTL ran while paused"
        assert await ask(sb, "get 2", 2) == value
    finally:
        await stop_all([sb])
    assert_gone(sb.id)


async def test_pause_to_disk(backend, caps, api):
    """Paused to disk, nothing of the sandbox runs on the host (its memory is freed);
    resumed, it has its files, and, where the backend keeps memory (`fork_memory`), its
    processes with what they held; otherwise it starts afresh. A group pauses and resumes
    by label the same way."""
    if "pause_to_disk" not in caps:
        pytest.skip(f"the {backend} backend lacks pause_to_disk (its refusal: test_refuses_what_it_lacks_before_doing_anything)")
    memory = "fork_memory" in caps
    labels = {"job": f"ptd-{backend}-{os.getpid()}"}
    sb = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256,
                                           labels=labels, env={"KEPT": "env"}))
    try:
        await start_holder(sb)
        assert await ask(sb, "set 2 7", 2) == 7
        await sb.files.write("/root/kept", "kept\n")
        t0 = time.monotonic()
        info = await sb.pause(to_disk=True)
        paused = time.monotonic() - t0
        assert info.state == "paused" and info.paused_to_disk, info
        assert wait_for(lambda: not host_processes(sb.id), timeout=10), \
            f"still on the host while paused to disk: {host_processes(sb.id)}"
        assert not ram_files(sb.id), f"its memory file is still in RAM: {ram_files(sb.id)}"
        with pytest.raises(PreconditionError):
            await sb.exec(["true"], timeout=5)
        # Paused again in place: it stays on disk.
        assert (await sb.pause()).paused_to_disk
        t0 = time.monotonic()
        info = await sb.resume()
        resumed = time.monotonic() - t0
        assert info.state == "running" and not info.paused_to_disk, info
        assert host_processes(sb.id), "nothing runs for it after the resume"
        r = await sb.run_shell("cat /root/kept; echo $KEPT")
        assert r.stdout == "kept\nenv\n", r
        if memory:
            assert await ask(sb, "get 3", 3) == 7
        else:
            assert await holders(sb) == 0, "a process outlived a pause to disk of a backend without fork_memory"
        await clock_is_the_hosts(sb)
        print(f"\n{backend}: pause to disk {paused:.2f} s, resume {resumed:.2f} s", flush=True)
        # A group, by label.
        await sb.run_shell("(sleep 1000 >/dev/null 2>&1 &)")
        g = await api.pause_group(labels, to_disk=True)
        assert g["done"] == [sb.id] and not g["failed"], g
        assert wait_for(lambda: not host_processes(sb.id), timeout=10), host_processes(sb.id)
        g = await api.resume_group(labels)
        assert g["done"] == [sb.id], g
        assert (await sb.files.read_text("/root/kept")) == "kept\n"
        if memory:
            assert await ask(sb, "get 4", 4) == 7
        assert (await sb.run_shell(COUNT_SLEEPS)).stdout == ("1\n" if memory else "0\n")
        # It runs as a new sandbox does: files written now are kept too.
        await sb.files.write("/root/after", "x")
        assert await sb.files.read_text("/root/after") == "x"
    finally:
        await stop_all([sb])
    assert_gone(sb.id)


async def test_snapshot(backend, caps, api):
    """A snapshot keeps the sandbox's files (and, with `fork_memory`, its memory) under an
    id: sandboxes restored from it, after the source changed and stopped, start from the
    moment it was taken; once deleted it cannot be restored, and what was restored from
    it runs on."""
    memory = "fork_memory" in caps
    sb = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256))
    restored = []
    snap = None
    try:
        value = await start_holder(sb)
        await sb.run_shell("echo kept > /root/state")
        snap = await sb.snapshot()
        assert snap.memory_preserved is memory, snap
        assert (snap.source, snap.backend) == (sb.id, backend) and snap.size_bytes > 0, snap
        assert snap.id in [s.id for s in await api.list_snapshots()]
        # The source moves on and goes; the snapshot does not.
        await sb.run_shell("echo changed > /root/state")
        assert await ask(sb, "set 2 7", 2) == 7
        await sb.stop()
        assert not ram_files(sb.id), f"a kept snapshot's memory stayed in the RAM directory: {ram_files(sb.id)}"
        restored = await api.restore_snapshot(snap.id, count=2, labels={"from": "snapshot"})
        assert len({r.id for r in restored}) == 2
        for i, r in enumerate(restored):
            assert r.info.backend == backend and r.info.labels.get("from") == "snapshot", r.info
            assert (await r.run_shell("cat /root/state")).stdout == "kept\n"
            if memory:
                assert await ask(r, f"get {10 + i}", 10 + i) == value, "a restored sandbox lost the memory"
            else:
                assert await holders(r) == 0, "a process came back from a snapshot without fork_memory"
        print(f"\n{backend} snapshot: {snap.size_bytes / 2**20:.0f} MiB, source paused {snap.source_paused_ms} ms",
              flush=True)
        await api.delete_snapshot(snap.id)
        assert snap.id not in [s.id for s in await api.list_snapshots()]
        with pytest.raises(DSecError) as e:
            await api.restore_snapshot(snap.id)
        assert e.value.code == "not_found", e.value
        snap = None
        if memory:
            assert await ask(restored[0], "get 20", 20) == value
        assert (await restored[0].run_shell("cat /root/state")).stdout == "kept\n"
    finally:
        await stop_all([*restored, sb])
        if snap:
            await api.delete_snapshot(snap.id)
    for s in [sb, *restored]:
        assert_gone(s.id)


async def test_fork(backend, caps, api):
    """Fork copies have the source's files and go on independently; with `fork_memory`
    they also carry its processes with what they hold in memory (and then diverge);
    without it they have the files but not the processes."""
    memory = "fork_memory" in caps
    src = await api.run_sandbox(DSecRunArgs(image="root/py:3.11", backend=backend, memory_limit_mb=256,
                                            labels={"role": "src"}))
    copies = []
    try:
        value = await start_holder(src)
        await src.run_shell("echo state-1 > /root/state")
        t0 = time.monotonic()
        copies = await src.fork(count=4, labels={"role": "copy"})
        took = time.monotonic() - t0
        fork = src.last_fork
        print(f"\n{backend} fork of 4: {took:.2f} s, source paused {fork['source_paused_ms']} ms, "
              f"memory_preserved={fork['memory_preserved']}", flush=True)
        assert fork["memory_preserved"] is memory, fork
        assert len({c.id for c in copies}) == 4 and src.id not in {c.id for c in copies}
        for i, c in enumerate(copies):
            assert c.info.forked_from == src.id and c.info.labels["role"] == "copy", c.info
            assert c.info.backend == backend
            r = await c.run_shell(f"cat /root/state; echo copy-{i} > /root/state")
            assert r.stdout == "state-1\n", r
        assert (await src.run_shell("cat /root/state")).stdout == "state-1\n"
        for i, c in enumerate(copies):
            assert (await c.run_shell("cat /root/state")).stdout == f"copy-{i}\n"
        if memory:
            # Every copy's process is the source's, with the value in its memory; each
            # changes it on its own, the source and the other copies keep theirs.
            for i, c in enumerate(copies):
                assert await ask(c, f"get {10 + i}", 10 + i) == value, c.id
            for i, c in enumerate(copies):
                assert await ask(c, f"set {20 + i} {1000 + i}", 20 + i) == 1000 + i
            for i, c in enumerate(copies):
                assert await ask(c, f"get {30 + i}", 30 + i) == 1000 + i
        else:
            for c in copies:
                assert await holders(c) == 0, "a copy carries a process of a backend without fork_memory"
        assert await ask(src, "get 40", 40) == value
        assert await holders(src) == 1
        # Their random numbers differ (reseeded after a restore), and each knows its id.
        rand = set()
        for c in [src, *copies]:
            rand.add((await c.exec(["sh", "-c", RANDOM_AND_UUID])).stdout)
        assert len(rand) == 5, rand
        for c in copies:
            assert (await c.run_shell("echo $DSEC_SANDBOX_ID")).stdout.strip() == c.id
        # The clock was stepped to the host's.
        await clock_is_the_hosts(copies[0])
    finally:
        await stop_all([*copies, src])
    for c in [src, *copies]:
        assert_gone(c.id)


async def test_commit(backend, api):
    """The sandbox's changes committed to an image: a sandbox of the same backend and a
    container created from it have the file."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/base", backend=backend))
    image = f"root/conformance-{backend}:v1"
    made = []
    try:
        await sb.files.write(f"/root/made-in-a-{backend}", b"yes\n")
        c = await sb.commit(image, overwrite=True)
        assert c.image.endswith(f"conformance-{backend}:v1") and c.digest, c
        assert len(c.layers) >= 2 and c.size_bytes > 0, c
        for b in dict.fromkeys([backend, "container"]):
            made.append(await api.run_sandbox(DSecRunArgs(backend=b, image=image)))
            assert made[-1].info.backend == b
            assert await made[-1].files.read(f"/root/made-in-a-{backend}") == b"yes\n"
    finally:
        await stop_all([*made, sb])
        try:
            await api.remove_image(image)
        except DSecError as e:
            print(f"removing {image}: {e}", flush=True)
    for s in [sb, *made]:
        assert_gone(s.id)


# ---- stop, cleanup, restart ---------------------------------------------------------------

async def test_stop(backend, api):
    """A stopped sandbox is gone from the list and answers 404, and nothing of it is left
    on the host: no process (no VMM), mount, cgroup, directory or memory file."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/base", backend=backend))
    stopped = False
    try:
        await sb.files.write("/root/f", "x")
        await sb.run_shell("(sleep 1000 >/dev/null 2>&1 &)")
        s = await sb.sessions.create()
        await s.run("cd /tmp")
        assert host_processes(sb.id)
        await sb.stop()
        stopped = True
        assert sb.id not in [x.id for x in await api.list_sandboxes()]
        with pytest.raises(NotFoundError) as e:
            await api.get_sandbox(sb.id)
        assert e.value.status == 404
        with pytest.raises(NotFoundError) as e:
            await sb.exec(["true"])
        assert e.value.status == 404
        await sb.stop()  # stopping what is gone is not an error
    finally:
        if not stopped:
            await stop_all([sb])
    assert_gone(sb.id)


async def test_restart_readopts(backend, api):
    """The server restarted (gracefully, keeping sandboxes; then killed) finds the
    sandbox running, with its files and processes, and serves it."""
    sb = await api.run_sandbox(DSecRunArgs(image="root/base", backend=backend))
    try:
        await sb.exec(["sh", "-c", "echo kept > /root/state"])
        await sb.run_shell("(sleep 1000 >/dev/null 2>&1 &)")
        server_down("--keep-sandboxes")
        server_up()
        async with DSecClient() as c2:
            again = await c2.get_sandbox(sb.id)
            assert again.info.state == "running"
            r = await again.run_shell(f"cat /root/state; {COUNT_SLEEPS}")
            assert r.stdout == "kept\n1\n", r
        pid = int((DATA / "dsec.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=10)
        server_up()
        async with DSecClient() as c3:
            again = await c3.get_sandbox(sb.id)
            assert again.info.state == "running"
            r = await again.exec(["cat", "/root/state"])
            assert r.stdout == "kept\n", r
            assert (await again.run_shell(COUNT_SLEEPS)).stdout == "1\n"
            await again.files.write("/root/after", "x")
            assert await again.files.read_text("/root/after") == "x"
            await again.stop()
    finally:
        async with DSecClient() as c4:
            try:
                await (await c4.get_sandbox(sb.id)).stop()
            except NotFoundError:
                pass
    assert_gone(sb.id)
