# SPDX-License-Identifier: AGPL-3.0-only
"""Exec details, TTL and keep-alive, fork of the filesystem, and restarts that disturb
nothing."""

import asyncio
import json
import os
import signal
import time

import pytest

from conftest import DATA, cgroup_file, cgroup_mode, dsec, leftovers, server_down, server_up, wait_for
from opendsec import DSecClient, DSecRunArgs, InvalidArgumentError, NotFoundError
from opendsec.errors import DSecError

# Counts `sleep 1000` processes (the base image has no pgrep).
COUNT_SLEEPS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep 100[0]' | wc -l"


async def test_exec_env_cwd_stdin_exit_codes_and_timeout(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", env={"FROM_CREATE": "c"}))
    try:
        r = await sb.run_shell("echo out; echo err >&2; exit 7")
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)
        r = await sb.exec(["sh", "-c", 'echo "$FROM_CREATE $X $(pwd)"'], env={"X": "x"}, cwd="/tmp")
        assert r.stdout == "c x /tmp\n"
        r = await sb.exec(["cat"], stdin="from stdin")
        assert r.stdout == "from stdin"
        # A background child that keeps stdout open: the command still returns, with what
        # it printed, and the child runs on.
        r = await sb.run_shell("s=1000; sleep $s & echo started $!")
        assert r.exit_code == 0 and r.stdout.startswith("started "), r
        assert (await sb.run_shell(COUNT_SLEEPS)).stdout.strip() == "1"
        t0 = time.monotonic()
        r = await sb.run_shell("sleep 30", timeout=1)
        assert r.timed_out and r.exit_code == 137
        assert time.monotonic() - t0 < 10
        r = await sb.exec(["python3", "-c", "import sys; sys.stdout.write('x' * (20 << 20))"])
        assert r.stdout_truncated and len(r.stdout) == 16 << 20
    finally:
        await sb.stop()


async def test_container_pause_freezes_processes_and_groups_pause_by_label(client):
    """Containers pause through the freezer: a counting loop stands still while paused and
    goes on after; the TTL does not run meanwhile; a group (by label) pauses and resumes in
    one call, other sandboxes untouched."""
    labels = {"job": f"freeze-{os.getpid()}"}
    a = await client.run_sandbox(DSecRunArgs(image="root/base", labels=labels, ttl_seconds=600))
    b = await client.run_sandbox(DSecRunArgs(image="root/base", labels=labels, ttl_seconds=600))
    other = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=600))
    try:
        for sb in (a, b, other):
            await sb.exec_background(cmd="i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done")
        await asyncio.sleep(0.5)

        async def count(sb) -> int:
            return int((await sb.run_shell("cat /tmp/c")).stdout)

        r0 = await count(a)
        await asyncio.sleep(1.0)
        running = await count(a) - r0
        p0 = await count(a)
        info = await a.pause()
        assert info.state == "paused" and not info.paused_to_disk
        expires = info.expires_at_ms
        with pytest.raises(DSecError):
            await a.exec(["true"], timeout=5)
        await asyncio.sleep(1.0)
        await a.resume()
        p1 = await count(a)
        assert running >= 4 and p1 - p0 < running / 2, f"counted {p1 - p0} while paused 1 s, {running} while running"
        await asyncio.sleep(0.5)
        assert await count(a) > p1, "the counter did not go on after resume"
        assert (await a.refresh()).expires_at_ms >= expires + 900, "the TTL ran while paused"

        r = await client.pause_group(labels)
        assert sorted(r["done"]) == sorted([a.id, b.id]) and not r["failed"], r
        assert (await other.refresh()).state == "running"
        o1 = await count(other)
        await asyncio.sleep(0.4)
        assert await count(other) > o1
        for sb in (a, b):
            assert (await sb.refresh()).state == "paused"
        r = await client.resume_group(labels)
        assert sorted(r["done"]) == sorted([a.id, b.id]), r
        for sb in (a, b):
            c0 = await count(sb)
            await asyncio.sleep(0.4)
            assert await count(sb) > c0
        with pytest.raises(DSecError) as e:
            await client.pause_group({})
        assert e.value.code == "invalid_argument"
    finally:
        for sb in (a, b, other):
            await sb.stop()


async def test_ttl_stops_sandbox_and_set_timeout_extends_it(client):
    short = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=2))
    kept = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=2))
    idle = await client.run_sandbox(DSecRunArgs(image="root/base", idle_timeout_seconds=2))
    info = await kept.set_timeout(60)
    assert info.expires_at_ms > short.info.expires_at_ms + 50_000
    await asyncio.sleep(4)
    try:
        await short.refresh()
        raise AssertionError("sandbox outlived its TTL")
    except NotFoundError:
        pass
    try:
        await idle.refresh()
        raise AssertionError("sandbox outlived its idle timeout")
    except NotFoundError:
        pass
    assert (await kept.run_shell("echo alive")).stdout == "alive\n"
    assert leftovers(short.id) == [] and leftovers(idle.id) == []
    await kept.stop()


async def test_fork_copies_files_not_memory_and_copies_are_independent(client):
    src = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", labels={"role": "src"}))
    try:
        await src.run_shell("mkdir -p /work && echo state-1 > /work/state && (sleep 1000 >/dev/null 2>&1 &)")
        forks = await src.fork(count=3, labels={"role": "copy"})
        assert len(forks) == 3
        assert src.last_fork["memory_preserved"] is False
        for i, f in enumerate(forks):
            assert f.info.forked_from == src.id and f.info.labels["role"] == "copy"
            r = await f.run_shell(f"cat /work/state; echo copy-{i} > /work/state; {COUNT_SLEEPS}")
            assert r.stdout.splitlines()[0] == "state-1"
            assert r.stdout.splitlines()[1] == "0", "a container fork must not carry processes"
        assert (await src.run_shell(f"cat /work/state; {COUNT_SLEEPS}")).stdout == "state-1\n1\n"
        for i, f in enumerate(forks):
            assert (await f.run_shell("cat /work/state")).stdout == f"copy-{i}\n"
            await f.stop()
    finally:
        await src.stop()


async def test_container_paused_to_disk_ends_its_processes_keeps_its_files_and_a_restart(client):
    """A container paused to disk has no process left (the memory they held is freed) and
    keeps its files; a restart of the server keeps it paused; a resume starts it afresh
    on its files with its environment and TTL; a stop then leaves nothing."""
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", env={"KEPT": "env"}, ttl_seconds=600))
    stopped = False
    try:
        await sb.run_shell("echo kept > /root/file; (sleep 1000 >/dev/null 2>&1 &)")
        await sb.exec_background(cmd="python3 -c 'b = bytearray(96 << 20); import time; time.sleep(1000)'")
        usage = cgroup_file("memory", sb.id, "memory.current" if cgroup_mode() == "v2" else "memory.usage_in_bytes")
        assert wait_for(lambda: int(usage.read_text()) > 96 << 20, 10), "the process did not take its memory"
        init = int((DATA / f"edge/sandboxes/{sb.id}/init.pid").read_text())
        info = await sb.pause(to_disk=True)
        assert info.state == "paused" and info.paused_to_disk
        def ended(pid: int) -> bool:
            try:
                return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except FileNotFoundError:
                return True

        assert ended(init), "its init still runs"
        assert not usage.exists() or int(usage.read_text()) < 8 << 20, "its memory was not freed"
        with pytest.raises(DSecError):
            await sb.exec(["true"], timeout=5)
        # Paused twice is paused; in place after to disk stays on disk.
        assert (await sb.pause()).paused_to_disk
        server_down("--keep-sandboxes")
        server_up()
        async with DSecClient() as c2:
            again = await c2.get_sandbox(sb.id)
            assert again.info.state == "paused" and again.info.paused_to_disk
            await asyncio.sleep(1.0)
            info = await again.resume()
            assert info.state == "running" and not info.paused_to_disk
            r = await again.run_shell(f"cat /root/file; echo $KEPT; {COUNT_SLEEPS}")
            assert r.stdout == "kept\nenv\n0\n", r
            # It runs as a new sandbox does: files written now are kept too.
            await again.files.write("/root/after", "x")
            assert await again.files.read_text("/root/after") == "x"
            await again.stop()
            stopped = True
        assert leftovers(sb.id) == []
    finally:
        if not stopped:
            async with DSecClient() as c3:
                try:
                    await (await c3.get_sandbox(sb.id)).stop()
                except NotFoundError:
                    pass


async def test_restart_keeps_sandboxes_running(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    # One that dies while the server is down: the restart finds it gone and cleans up.
    dead = await client.run_sandbox(DSecRunArgs(image="root/base"))
    await sb.run_shell("echo kept > /root/file; (sleep 1000 >/dev/null 2>&1 &)")
    # A graceful restart that keeps sandboxes, then a kill -9 of the server.
    server_down("--keep-sandboxes")
    server_up()
    async with DSecClient() as c2:
        again = await c2.get_sandbox(sb.id)
        assert again.info.state == "running"
        r = await again.run_shell(f"cat /root/file; {COUNT_SLEEPS}")
        assert r.stdout == "kept\n1\n"
    pid = int((DATA / "dsec.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    # A create that was cut short leaves a "creating" record; the next start removes it.
    half = DATA / "edge/sandboxes/local-00000000000a"
    half.mkdir(parents=True)
    state = json.loads((DATA / f"edge/sandboxes/{sb.id}/state.json").read_text())
    state.update(id="local-00000000000a", state="creating")
    (half / "state.json").write_text(json.dumps(state))
    (DATA / "edge/sandboxes/garbage-dir").mkdir()
    assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
    init = int((DATA / f"edge/sandboxes/{dead.id}/init.pid").read_text())
    os.kill(init, signal.SIGKILL)
    assert wait_for(lambda: not os.path.exists(f"/proc/{init}"), 10)
    server_up()
    assert not half.exists() and not (DATA / "edge/sandboxes/garbage-dir").exists()
    assert leftovers(dead.id) == [], "the sandbox that died while the server was down left these"

    async with DSecClient() as c3:
        assert [s.id for s in await c3.list_sandboxes()] == [sb.id]
        r = await (await c3.get_sandbox(sb.id)).run_shell(f"cat /root/file; {COUNT_SLEEPS}")
        assert r.stdout == "kept\n1\n"
        await (await c3.get_sandbox(sb.id)).stop()
    assert leftovers(sb.id) == []


async def test_down_stops_every_sandbox_with_progress_while_iam_is_up(client):
    """`dsec down` stops sandboxes a bounded number at a time, says how far it is, waits as
    long as they keep stopping, and every reservation is released while IAM still runs."""
    project = f"root/down-{os.urandom(3).hex()}"
    await client.create_project(project, sandboxes=40)
    made = await asyncio.gather(*(client.run_sandbox(DSecRunArgs(image="root/base", project=project))
                                  for _ in range(24)))
    log = DATA / "dsec.log"
    before = log.stat().st_size if log.exists() else 0
    try:
        r = dsec("down", "--data-dir", str(DATA), timeout=300)
    finally:
        written = log.read_bytes()[before:].decode(errors="replace") if log.exists() else ""
        server_up()
    print(r.stderr.strip().splitlines()[-3:], r.stdout.strip())
    lines = [l for l in r.stderr.splitlines() if l.startswith("stopped ")]
    assert lines and lines[-1].endswith(" sandboxes"), r.stderr
    done, total = int(lines[-1].split()[1]), int(lines[-1].split()[3])
    assert done == total >= 24, lines
    for s in made:
        assert leftovers(s.id) == [], s.id
    assert "releasing its quota" not in written, "a reservation was released after IAM stopped"
    async with DSecClient() as c2:
        usage = next(p for p in await c2.projects() if p["path"] == project)["usage"]
        assert usage["sandboxes"] == 0, usage
        assert [s for s in await c2.list_sandboxes() if s.project == project] == []


async def test_on_timeout_pause_pauses_at_the_ttl_and_a_resume_gives_it_as_long_again(client):
    """`on_timeout = "pause"`: when its TTL runs out the sandbox is paused, not stopped;
    resumed, it has its files and as long again as it was created with. Anything but
    stop or pause is refused."""
    with pytest.raises(InvalidArgumentError, match="on_timeout"):
        await client.run_sandbox(DSecRunArgs(image="root/base", on_timeout="sleep"))
    sb = await client.run_sandbox(DSecRunArgs(image="root/base", ttl_seconds=3, on_timeout="pause"))
    try:
        await sb.run_shell("echo kept > /root/state")
        end = time.monotonic() + 20
        while (state := (await client.get_sandbox(sb.id)).info.state) != "paused" and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert state == "paused", state
        await asyncio.sleep(1)
        assert (await client.get_sandbox(sb.id)).info.state == "paused", "a paused sandbox's TTL stands still"
        info = await sb.resume()
        left_s = info.expires_at_ms / 1000 - time.time()
        assert info.state == "running" and 1.5 < left_s <= 3.5, (info.state, left_s)
        assert (await sb.run_shell("cat /root/state")).stdout == "kept\n"
    finally:
        await sb.stop()


async def test_container_snapshot_keeps_files_for_later(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    restored = []
    try:
        await sb.run_shell("echo kept > /root/state")
        snap = await sb.snapshot()
        assert not snap.memory_preserved and snap.backend == "container"
        await sb.run_shell("echo changed > /root/state")
        restored = await client.restore_snapshot(snap.id, count=2)
        for r in restored:
            assert (await r.run_shell("cat /root/state")).stdout == "kept\n"
        await client.delete_snapshot(snap.id)
        assert snap.id not in [s.id for s in await client.list_snapshots()]
    finally:
        for r in restored:
            await r.stop()
        await sb.stop()


async def test_a_sandbox_whose_init_dies_is_stopped_and_cleaned_up(client):
    """The kernel tells the server (a pidfd per container init) when a sandbox's PID 1
    exits, also for a sandbox adopted after a restart: it is stopped and leaves nothing."""

    async def stopped_after_init_killed(c: DSecClient, sid: str) -> bool:
        init = int((DATA / f"edge/sandboxes/{sid}/init.pid").read_text())
        os.kill(init, signal.SIGKILL)
        for _ in range(100):
            if sid not in [s.id for s in await c.list_sandboxes()]:
                return True
            await asyncio.sleep(0.1)
        return False

    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    kept = await client.run_sandbox(DSecRunArgs(image="root/base"))
    assert await stopped_after_init_killed(client, sb.id), "a dead sandbox is still listed"
    assert wait_for(lambda: leftovers(sb.id) == [], 10), leftovers(sb.id)
    server_down("--keep-sandboxes")
    server_up()
    async with DSecClient() as c2:
        assert (await c2.get_sandbox(kept.id)).info.state == "running"
        assert await stopped_after_init_killed(c2, kept.id), "a dead adopted sandbox is still listed"
    assert wait_for(lambda: leftovers(kept.id) == [], 10), leftovers(kept.id)
