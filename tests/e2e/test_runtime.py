# SPDX-License-Identifier: AGPL-3.0-only
"""The runtime API (docs/RUNTIME_API.md) through the Python SDK: streamed and background
processes, attach, stdin, signals, PTYs, files (large ones in bounded server memory),
watches, persistent sessions, the trajectory log across client and server kills, and what
all of that must not leave visible inside the sandbox."""

import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from conftest import DATA, ROOT, make_client, server_up, stop_what_is_left, wait_for
from opendsec import (DSecClient, DSecError, DSecRunArgs, InvalidArgumentError, NotFoundError,
                      PreconditionError, ResourceExhaustedError)

MiB = 1 << 20
# Counts `sleep 1000` processes (the images have no pgrep); as in test_lifecycle.py.
COUNT_SLEEPS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep 100[0]' | wc -l"


def server_pid() -> int:
    return int((DATA / "dsec.pid").read_text())


def host_trajectory_logs(sandbox_id: str, name: str) -> list[Path]:
    """The host files holding a trajectory's log: <state-dir>/trajectories/<sandbox>/<name>.jsonl
    as documented, or kept in the sandbox's own state directory."""
    edge = DATA / "edge"
    pats = [f"trajectories/{sandbox_id}/{name}.jsonl", f"*/{sandbox_id}/trajectories/{name}.jsonl",
            f"*/{sandbox_id}/{name}.jsonl"]
    return sorted({p for pat in pats for p in edge.glob(pat)})


class RssPoller:
    """Samples the server's resident memory (VmRSS) every 50 ms in a thread; VmHWM would
    be the peak since the server started, not during the part under test."""

    def __init__(self, pid: int | None = None, every: float = 0.05):
        self.pid = pid or server_pid()
        self.every = every
        self.peak_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                self.peak_kib = max(self.peak_kib, int(line.split()[1]))
                self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def __enter__(self) -> "RssPoller":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def peak_mib(self) -> float:
        return self.peak_kib / 1024


@pytest.fixture(params=["async", "sync"])
async def client(request):
    """Every test here runs through the async client and through the synchronous one
    (`opendsec.sync`, behind the async interface: `sync_facade.py`)."""
    async with make_client(request.param) as c:
        yield c
        await stop_what_is_left(c)


async def read_until(p, needle: bytes, timeout: float = 15.0) -> tuple[bytes, set]:
    """Reads a Process's chunks until ``needle`` shows up in what this call read; returns
    that output and the stream names it came on."""
    buf = bytearray()
    streams = set()

    async def go() -> None:
        async for stream, data in p:
            buf.extend(data)
            streams.add(stream)
            if needle in buf:
                return
        raise AssertionError(f"process exited before {needle!r} appeared: {bytes(buf)!r}")

    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"{needle!r} did not appear within {timeout} s; got {bytes(buf)!r}") from None
    return bytes(buf), streams


async def count_sleeps(sb) -> int:
    return int((await sb.run_shell(COUNT_SLEEPS)).stdout.strip())


async def until(pred, timeout: float = 10.0, every: float = 0.1):
    """Awaits the async predicate until it is truthy (or the time is up)."""
    end = time.monotonic() + timeout
    while True:
        v = await pred()
        if v or time.monotonic() > end:
            return v
        await asyncio.sleep(every)


# ---- processes ------------------------------------------------------------------------

PRINTER = """\
import sys, time
for i in range(4):
    print('line', i, flush=True)
    time.sleep(0.4)
print('to stderr', file=sys.stderr, flush=True)
sys.exit(3)
"""


async def test_exec_stream_delivers_output_as_it_comes_and_runs_as_user(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        t0 = time.monotonic()
        p = await sb.exec_stream(["python3", "-c", PRINTER])
        assert isinstance(p.pid, int) and p.pid > 1
        arrivals = []
        async for stream, data in p:
            arrivals.append((stream, data, time.monotonic() - t0))
        r = await p.wait()
        out = b"".join(d for s, d, _ in arrivals if s == "stdout")
        err = b"".join(d for s, d, _ in arrivals if s == "stderr")
        assert out == b"line 0\nline 1\nline 2\nline 3\n"
        assert err == b"to stderr\n"
        assert (r.exit_code, r.signal, r.timed_out) == (3, None, False)
        assert r.stdout == out.decode() and r.stderr == err.decode()
        # Several chunks, spread over the program's 1.6 s: not all delivered at exit.
        times = [t for s, _, t in arrivals if s == "stdout"]
        assert len(times) >= 3, arrivals
        assert times[-1] - times[0] >= 0.8, arrivals

        assert (await sb.exec(["id", "-u"])).stdout == "0\n"
        r = await sb.exec(["id", "-u"], user="nobody")
        assert (r.stdout, r.exit_code) == ("65534\n", 0)
        p = await sb.exec_stream(["sh", "-c", "id -u; id -g; cat /etc/shadow"], user=65534)
        r = await p.wait()
        assert r.stdout.splitlines() == ["65534", "65534"]
        assert r.exit_code != 0 and "Permission denied" in r.stderr
    finally:
        await sb.stop()


async def test_exec_stream_stdin_signals_and_timeout(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        # Interactive stdin: cat echoes before stdin is closed.
        p = await sb.exec_stream(["cat"])
        await p.send_stdin(b"hello ")
        await p.send_stdin("world\n")
        await read_until(p, b"hello world\n")
        await p.close_stdin()
        r = await asyncio.wait_for(p.wait(), 10)
        assert (r.stdout, r.exit_code) == ("hello world\n", 0)

        # Binary stdin, in pieces, arrives intact.
        blob = bytes(range(256)) * 1024
        p = await sb.exec_stream(["python3", "-c", "import sys, hashlib; d = sys.stdin.buffer.read(); "
                                  "print(len(d), hashlib.sha256(d).hexdigest())"])
        await p.send_stdin(blob[:100_000])
        await p.send_stdin(blob[100_000:], close=True)
        r = await asyncio.wait_for(p.wait(), 10)
        assert r.stdout == f"{len(blob)} {hashlib.sha256(blob).hexdigest()}\n", r

        # stdin given up front is written and closed.
        p = await sb.exec_stream(["cat"], stdin="given\n")
        assert (await asyncio.wait_for(p.wait(), 10)).stdout == "given\n"

        # Signals by name and by number.
        p = await sb.exec_stream(["sleep", "100"])
        await p.signal("SIGTERM")
        r = await asyncio.wait_for(p.wait(), 10)
        assert (r.signal, r.exit_code, r.timed_out) == (15, 143, False), r
        p = await sb.exec_stream(["sleep", "100"])
        await p.kill()
        r = await asyncio.wait_for(p.wait(), 10)
        assert (r.signal, r.exit_code) == (9, 137), r

        # A signal goes to the process group: the shell's background child dies too.
        # ($s keeps "sleep 1000" out of the shell's own command line, which is counted too.)
        p = await sb.exec_stream(["sh", "-c", "s=1000; sleep $s & sleep $s; wait"])
        assert await until(lambda: _eq(count_sleeps(sb), 2), 5)
        await p.signal(signal.SIGTERM)
        r = await asyncio.wait_for(p.wait(), 10)
        assert r.signal == 15
        assert await until(lambda: _eq(count_sleeps(sb), 0), 5), "the group's other process survived"

        # Timeout.
        t0 = time.monotonic()
        p = await sb.exec_stream(["sleep", "30"], timeout=1)
        r = await asyncio.wait_for(p.wait(), 15)
        assert r.timed_out and r.exit_code == 137, r
        assert time.monotonic() - t0 < 5
    finally:
        await sb.stop()


async def _eq(coro, value) -> bool:
    return (await coro) == value


async def test_background_process_attach_from_another_client_and_process_list(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        script = "for i in 1 2 3 4 5; do echo $i; sleep 0.3; done"
        p = await sb.exec_background(cmd=script, tag="counter")
        assert p.pid
        procs = {x["pid"]: x for x in await sb.processes()}
        assert procs[p.pid]["running"] is True, procs
        assert procs[p.pid]["tag"] == "counter"
        assert any("echo $i" in a for a in procs[p.pid]["argv"])
        await asyncio.sleep(0.5)  # some output is kept before anyone attaches
        async with DSecClient() as c2:
            other = await c2.get_sandbox(sb.id)
            a = await other.attach(p.pid)
            chunks = []
            t0 = time.monotonic()
            async for stream, data in a:
                assert stream == "stdout"
                chunks.append((data, time.monotonic() - t0))
            assert b"".join(d for d, _ in chunks) == b"1\n2\n3\n4\n5\n"
            assert a.result is not None and a.result.exit_code == 0 and not a.result.stdout_truncated
            # The kept lines first, then the rest live as it was printed.
            assert chunks[-1][1] - chunks[0][1] >= 0.3, chunks
        # The first client's handle attaches too, after the exit: kept output, then exit.
        r = await p.wait()
        assert (r.stdout, r.exit_code) == ("1\n2\n3\n4\n5\n", 0)
        procs = {x["pid"]: x for x in await sb.processes()}
        assert procs[p.pid]["running"] is False and procs[p.pid]["exit_code"] == 0

        # A streaming client that goes away does not stop its process.
        p = await sb.exec_stream(["sh", "-c", "echo before; sleep 1; echo after; echo done > /tmp/finished"])
        await read_until(p, b"before\n")
        await p.close()
        async with DSecClient() as c3:
            a = await (await c3.get_sandbox(sb.id)).attach(p.pid)
            r = await asyncio.wait_for(a.wait(), 10)
        assert (r.stdout, r.exit_code) == ("before\nafter\n", 0)
        assert (await sb.run_shell("cat /tmp/finished")).stdout == "done\n"

        with pytest.raises(NotFoundError):
            await sb.attach(999_999)
    finally:
        await sb.stop()


WRITER = """\
import sys
for i in range(40):
    sys.stdout.buffer.write(bytes([97 + i % 26]) * (1 << 20))
sys.stdout.flush()
"""


async def test_output_beyond_the_kept_cap_streams_and_attach_reports_truncation(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11", memory_limit_mb=512))
    expected = b"".join(bytes([97 + i % 26]) * MiB for i in range(40))
    try:
        with RssPoller() as rss:
            t0 = time.monotonic()
            p = await sb.exec_stream(["python3", "-c", WRITER])
            received = 0
            async for stream, data in p:
                assert stream == "stdout"
                received += len(data)
            took = time.monotonic() - t0
        r = p.result
        assert r is not None and r.exit_code == 0, r
        assert 16 * MiB <= received <= 40 * MiB
        if received < 40 * MiB:
            assert r.stdout_truncated, "output was dropped from the live stream without saying so"
        print(f"40 MiB of output streamed in {took:.1f} s ({received / MiB:.0f} MiB received live); "
              f"server peak RSS {rss.peak_mib:.0f} MiB")
        assert rss.peak_mib < 300, f"server RSS reached {rss.peak_mib:.0f} MiB"
        # Attaching after the fact: only the last 16 MiB were kept, and that is reported.
        a = await sb.attach(p.pid)
        kept = b"".join([d async for s, d in a if s == "stdout"])
        assert 15 * MiB < len(kept) <= 16 * MiB, len(kept)
        assert expected.endswith(kept)
        assert a.result.stdout_truncated and a.result.exit_code == 0
        # A unary exec's result holds the first 16 MiB of each stream, more than a channel
        # frame may carry (16 MiB, with the JSON around it): it still arrives whole.
        r = await sb.exec(argv=["python3", "-c", WRITER + "sys.stderr.write('e' * 5000)"], timeout=120)
        assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated, r.exit_code
        assert len(r.stdout) == 16 * MiB and expected.startswith(r.stdout.encode())
        assert r.stderr == "e" * 5000
    finally:
        await sb.stop()


# ---- files ----------------------------------------------------------------------------

async def test_files_read_write_stat_list_and_changes(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    f = sb.files
    try:
        w = await f.write("/root/a.txt", "hello\n", mode=0o640)
        assert w["size"] == 6
        assert await f.read("/root/a.txt") == b"hello\n"
        await f.write("/root/a.txt", b"world\n", append=True)
        assert await f.read_text("/root/a.txt") == "hello\nworld\n"
        assert (await sb.run_shell("cat /root/a.txt")).stdout == "hello\nworld\n"
        blob = bytes(range(256)) * 40
        await f.write("/root/blob.bin", blob)
        assert await f.read("/root/blob.bin") == blob
        r = await sb.run_shell("sha256sum /root/blob.bin")
        assert r.stdout.split()[0] == hashlib.sha256(blob).hexdigest()
        # What a process writes, the API reads.
        await sb.run_shell("printf 'from exec' > /tmp/x")
        assert await f.read_text("/tmp/x") == "from exec"
        # Relative paths: the image has no working directory, so they start at /.
        await f.write("tmp/rel.txt", "rel")
        assert (await sb.run_shell("cat /tmp/rel.txt")).stdout == "rel"

        st = await f.stat("/root/a.txt")
        assert (st["path"], st["name"], st["type"], st["size"]) == ("/root/a.txt", "a.txt", "file", 12)
        assert st["mode"] & 0o7777 == 0o640 and (st["uid"], st["gid"]) == (0, 0)
        assert abs(st["mtime_ms"] - time.time() * 1000) < 300_000
        assert (await f.stat("/root"))["type"] == "dir"
        await sb.run_shell("ln -s a.txt /root/link")
        st = await f.stat("/root/link")
        assert (st["type"], st["target"]) == ("symlink", "a.txt")

        # Parents are created; list walks `depth` levels, sorted by path.
        await f.write("/root/t/a.txt", "1")
        await f.write("/root/t/b/c.txt", "2")
        await f.write("/root/t/b/d/e.txt", "3")
        paths = lambda entries: [e["path"] for e in entries]  # noqa: E731
        assert paths(await f.list("/root/t")) == ["/root/t/a.txt", "/root/t/b"]
        two = await f.list("/root/t", depth=2)
        assert paths(two) == ["/root/t/a.txt", "/root/t/b", "/root/t/b/c.txt", "/root/t/b/d"]
        assert [e["type"] for e in two] == ["file", "dir", "file", "dir"]
        assert paths(await f.list("/root/t", depth=3))[-1] == "/root/t/b/d/e.txt"

        assert await f.exists("/root/t/b/c.txt") is True
        assert await f.exists("/root/t/nope") is False
        st = await f.mkdir("/root/m/n/o")
        assert st["type"] == "dir"
        await f.mkdir("/root/m/n/o")  # like mkdir -p: already there is fine
        assert (await sb.run_shell("test -d /root/m/n/o && echo dir")).stdout == "dir\n"

        st = await f.rename("/root/t/a.txt", "/root/t/a2.txt")
        assert st["path"] == "/root/t/a2.txt" and st["size"] == 1
        assert not await f.exists("/root/t/a.txt")
        st = await f.chmod("/root/t/a2.txt", 0o755)
        assert st["mode"] & 0o7777 == 0o755
        assert (await f.stat("/root/t/a2.txt"))["mode"] & 0o7777 == 0o755
        assert (await sb.run_shell("stat -c %a /root/t/a2.txt")).stdout == "755\n"
        st = await f.chown("/root/t/a2.txt", 65534, 65534)
        assert (st["uid"], st["gid"]) == (65534, 65534)
        assert (await sb.run_shell("stat -c %u:%g /root/t/a2.txt")).stdout == "65534:65534\n"

        await f.remove("/root/t/a2.txt")
        assert not await f.exists("/root/t/a2.txt")
        with pytest.raises(DSecError):
            await f.remove("/root/t/b")  # not empty, not recursive
        assert await f.exists("/root/t/b/d/e.txt")
        await f.remove("/root/t", recursive=True)
        assert not await f.exists("/root/t")

        written = await f.write_many([(f"/root/many/f{i:02d}.txt", f"content {i}") for i in range(50)]
                                     + [{"path": "/root/many/run.sh", "data": b"#!/bin/sh\necho ran\n", "mode": 0o755}])
        assert len(written) == 51 and (written[7]["path"], written[7]["size"]) == ("/root/many/f07.txt", 9)
        entries = await f.list("/root/many")
        assert len(entries) == 51
        assert [e["name"] for e in entries[:50]] == [f"f{i:02d}.txt" for i in range(50)]
        assert await f.read_text("/root/many/f42.txt") == "content 42"
        assert (await sb.exec(["/root/many/run.sh"])).stdout == "ran\n"

        with pytest.raises(NotFoundError) as e:
            await f.read("/root/missing")
        assert e.value.status == 404
        with pytest.raises(InvalidArgumentError) as e:
            await f.read("/root")
        assert e.value.status == 400
        with pytest.raises(NotFoundError):
            await f.stat("/root/missing")
        with pytest.raises(InvalidArgumentError):
            await f.list("/root/a.txt")
        with pytest.raises(NotFoundError):
            await f.chmod("/root/missing", 0o600)
    finally:
        await sb.stop()


async def test_write_to_a_full_disk_is_resource_exhausted(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/base", disk_limit_mb=64))
    try:
        r = await sb.run_shell("dd if=/dev/zero of=/root/fill bs=1M 2>&1 | tail -1")
        assert "No space left" in r.stdout or "copied" in r.stdout
        with pytest.raises(ResourceExhaustedError) as e:
            await sb.files.write("/root/more", b"y" * 4096)
        assert e.value.status == 429
        await sb.files.remove("/root/fill")
        await sb.files.write("/root/more", b"y" * 4096)
        assert (await sb.files.stat("/root/more"))["size"] == 4096
    finally:
        await sb.stop()


@pytest.mark.skipif(os.environ.get("DSEC_SKIP_LARGE") == "1", reason="DSEC_SKIP_LARGE=1")
async def test_large_file_round_trip_in_bounded_server_memory(client):
    size = 1 << 30
    tmp = Path("/var/tmp")
    if shutil.disk_usage(tmp).free < 2 * size + (512 << 20):
        pytest.skip("needs 2.5 GiB free in /var/tmp")
    fd, name = tempfile.mkstemp(prefix="dsec-large-up-", dir=tmp)
    os.close(fd)
    src = Path(name)
    dst = src.with_name(src.name.replace("-up-", "-down-"))
    sb = None
    try:
        h = hashlib.sha256()
        with open(src, "wb") as out:
            for _ in range(size // (4 * MiB)):
                b = os.urandom(4 * MiB)
                h.update(b)
                out.write(b)
        want = h.hexdigest()
        # The writable layer is a tmpfs counted against the memory limit.
        sb = await client.run_sandbox(DSecRunArgs(image="root/base", disk_limit_mb=1500, memory_limit_mb=2048))
        with RssPoller() as rss:
            t0 = time.monotonic()
            w = await sb.files.write_from("/root/big.bin", src)
            up_s = time.monotonic() - t0
            assert w["size"] == size
            r = await sb.exec(["sha256sum", "/root/big.bin"], timeout=300)
            assert r.stdout.split()[0] == want, r
            t0 = time.monotonic()
            n = await sb.files.read_to("/root/big.bin", dst)
            down_s = time.monotonic() - t0
        assert n == size and dst.stat().st_size == size

        def digest(p: Path) -> str:
            d = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(4 * MiB):
                    d.update(chunk)
            return d.hexdigest()

        assert await asyncio.to_thread(digest, dst) == want
        print(f"1 GiB up {size / MiB / up_s:.0f} MiB/s, down {size / MiB / down_s:.0f} MiB/s; "
              f"server peak RSS {rss.peak_mib:.0f} MiB over {rss.samples} samples")
        assert rss.peak_mib < 300, f"server RSS reached {rss.peak_mib:.0f} MiB moving a 1 GiB file"
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
        if sb is not None:
            await sb.stop()


async def test_watch_reports_changes_in_order(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    try:
        await sb.files.mkdir("/root/w")
        d = "/root/w"
        touched = {f"{d}/a.txt", f"{d}/sub", f"{d}/sub/b.txt", f"{d}/sub/c.txt"}
        flat: list[dict] = []

        async def collect_flat(w) -> None:
            async for ev in w:
                flat.append(ev)

        async with sb.files.watch(d, recursive=True) as w, sb.files.watch(d, recursive=False) as w_flat:
            flat_task = asyncio.create_task(collect_flat(w_flat))
            # The watch is in place once watch() returned: the very first change is seen.
            for cmd in (f": > {d}/a.txt", f"echo hi >> {d}/a.txt", f"mkdir {d}/sub", f": > {d}/sub/b.txt",
                        f"mv {d}/sub/b.txt {d}/sub/c.txt", f"chmod 600 {d}/sub/c.txt", f"rm {d}/sub/c.txt",
                        f"rmdir {d}/sub"):
                assert (await sb.run_shell(cmd)).exit_code == 0, cmd
            events: list[dict] = []

            async def collect() -> None:
                async for ev in w:
                    if ev["path"] in touched or ev.get("from") in touched:
                        events.append(ev)
                    if (ev["type"], ev["path"]) == ("remove", f"{d}/sub"):
                        return

            try:
                await asyncio.wait_for(collect(), 15)
            except asyncio.TimeoutError:
                raise AssertionError(f"watch events stopped short: {events}") from None
            await asyncio.sleep(0.5)
            flat_task.cancel()
            try:
                await flat_task
            except asyncio.CancelledError:
                pass

        # Writes may come more than once (open, each write, close): checked apart.
        writes = [i for i, e in enumerate(events) if e["type"] == "write"]
        assert writes, events
        seq = []
        for e in events:
            item = (e["type"], e["path"], e["is_dir"], e.get("from"))
            if e["type"] != "write" and (not seq or seq[-1] != item):
                seq.append(item)
        assert seq == [
            ("create", f"{d}/a.txt", False, None),
            ("create", f"{d}/sub", True, None),
            ("create", f"{d}/sub/b.txt", False, None),
            ("rename", f"{d}/sub/c.txt", False, f"{d}/sub/b.txt"),
            ("chmod", f"{d}/sub/c.txt", False, None),
            ("remove", f"{d}/sub/c.txt", False, None),
            ("remove", f"{d}/sub", True, None),
        ], events
        # The a.txt write came after its create and before the next change.
        first_write = writes[0]
        assert events[first_write]["path"] == f"{d}/a.txt"
        create_a = next(i for i, e in enumerate(events) if e["type"] == "create" and e["path"] == f"{d}/a.txt")
        create_sub = next(i for i, e in enumerate(events) if e["type"] == "create" and e["path"] == f"{d}/sub")
        assert create_a < first_write < create_sub, events

        # Not recursive: the directory's own entries only.
        flat_paths = [(e["type"], e["path"]) for e in flat]
        assert ("create", f"{d}/a.txt") in flat_paths and ("create", f"{d}/sub") in flat_paths, flat
        assert not [p for _, p in flat_paths if p.startswith(f"{d}/sub/")], flat
    finally:
        await sb.stop()


async def test_metrics_now_and_over_time(client):
    """The node keeps a sandbox's CPU time and memory every 5 s (`metrics_history`), a
    range narrows them, and a bad range is refused."""
    from opendsec import InvalidArgumentError

    sb = await client.run_sandbox(DSecRunArgs(image="root/base"))
    try:
        now = await sb.metrics()
        assert now["memory_used_bytes"] > 0 and now["disk_total_bytes"] > 0, now
        await asyncio.sleep(6)
        h = await sb.metrics_history()
        assert h["interval_ms"] == 5000 and h["memory_limit_bytes"] > 0, h
        assert h["samples"] and all(s["memory_used_bytes"] > 0 for s in h["samples"]), h
        t = [s["timestamp_ms"] for s in h["samples"]]
        assert t == sorted(t)
        assert (await sb.metrics_history(start_ms=t[-1] + 1))["samples"] == []
        assert len((await sb.metrics_history(end_ms=t[0]))["samples"]) == 1
        with pytest.raises(InvalidArgumentError):
            await client._request("GET", f"/v1/sandboxes/{sb.id}/metrics/history", params={"start_ms": "yesterday"})
        await sb.pause()
        assert (await sb.metrics_history())["samples"], "a paused sandbox keeps its readings"
    finally:
        await sb.stop()


async def test_file_metadata_and_watch_entries(client):
    """Metadata given on a write is the file's `user.e2b.*` extended attributes; the API
    refuses bad metadata before touching the file; a watch with `entry` carries stats."""
    from opendsec import InvalidArgumentError

    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        w = await sb.files.write("/root/m/a.txt", "one", metadata={"owner": "me"})
        assert w["metadata"] == {"owner": "me"}, w
        assert (await sb.files.stat("/root/m/a.txt"))["metadata"] == {"owner": "me"}
        await sb.files.write("/root/m/a.txt", "+", append=True)
        assert (await sb.files.stat("/root/m/a.txt"))["metadata"] == {"owner": "me"}, "an append keeps it"
        r = await sb.run_shell("python3 -c \"import os; print(os.getxattr('/root/m/a.txt', 'user.e2b.owner'))\"")
        assert r.stdout.strip() == "b'me'", r
        for bad in ({"k": "x" * 3000}, {f"k{i}": "" for i in range(65)}):
            with pytest.raises(InvalidArgumentError):
                await sb.files.write("/root/m/a.txt", "clobbered", metadata=bad)
        with pytest.raises(InvalidArgumentError):  # (header names have no case)
            await sb.files.write_many([{"path": "/root/m/a.txt", "data": "x", "metadata": {"Upper": "v"}}])
        assert await sb.files.read_text("/root/m/a.txt") == "one+", "a refused write touched the file"
        await sb.files.write_many([{"path": "/root/m/b.txt", "data": "b", "metadata": {"k": "v"}}])
        assert (await sb.files.stat("/root/m/b.txt"))["metadata"] == {"k": "v"}
        await sb.files.write("/root/m/b.txt", "new")
        assert "metadata" not in await sb.files.stat("/root/m/b.txt"), "an overwrite clears it"
        async with sb.files.watch("/root/m", recursive=False, entry=True) as watch:
            await sb.files.write("/root/m/c.txt", "12345", metadata={"from": "watch"})
            await sb.run_shell("rm /root/m/b.txt")
            seen = []

            async def until_removed() -> None:
                async for ev in watch:
                    seen.append(ev)
                    if ev["type"] == "remove":
                        return

            await asyncio.wait_for(until_removed(), 15)
        created = [e for e in seen if e["path"] == "/root/m/c.txt" and e["type"] == "create"]
        assert created and created[0]["entry"]["name"] == "c.txt", seen
        assert [e for e in seen if e["type"] == "remove"][0].get("entry") is None, seen
        assert any(e.get("entry", {}).get("metadata") == {"from": "watch"} for e in seen), seen
    finally:
        await sb.stop()


# ---- terminals ------------------------------------------------------------------------

async def test_pty_repl_resize_interrupt_and_exit(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        p = await sb.pty(["python3", "-i", "-q"], cols=80, rows=24)
        await p.send_stdin("import os, sys\n")
        await p.send_stdin("print(6*7)\n")
        await read_until(p, b"42")
        await p.send_stdin('print("TTY", os.isatty(0), os.isatty(1), os.get_terminal_size(0))\n')
        await read_until(p, b"TTY True True os.terminal_size(columns=80, lines=24)")
        await p.resize(120, 40)
        await p.send_stdin('print("SIZE", os.get_terminal_size(0))\n')
        await read_until(p, b"SIZE os.terminal_size(columns=120, lines=40)")
        # stderr of a terminal process arrives on the terminal, as stdout.
        await p.send_stdin('sys.stderr.write("ERR-" + "MARK\\n")\n')
        _, streams = await read_until(p, b"ERR-MARK")
        assert streams == {"stdout"}
        # ^C is the terminal's interrupt.
        await p.send_stdin("import time; time.sleep(30)\n")
        await asyncio.sleep(0.5)
        await p.send_stdin(b"\x03")
        await read_until(p, b"KeyboardInterrupt", timeout=10)
        await p.send_stdin("exit()\n")
        r = await asyncio.wait_for(p.wait(), 10)
        assert r.exit_code == 0, r
        # A command line with spaces runs through /bin/sh -c.
        p = await sb.pty("echo pty-$((6*7))")
        r = await asyncio.wait_for(p.wait(), 10)
        assert "pty-42" in r.stdout and r.exit_code == 0
    finally:
        await sb.stop()


# ---- sessions -------------------------------------------------------------------------

async def test_sessions_keep_state_and_end_everything_they_started(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        s = await sb.sessions.create()
        assert (await s.run("cd /var; export A=1")).exit_code == 0
        r = await s.run("pwd; echo $A")
        assert (r.stdout, r.exit_code, r.state) == ("/var\n1\n", 0, "done")
        assert r.command_id is not None
        await s.run('greet() { echo "hello $1"; }')
        assert (await s.run("greet bob")).stdout == "hello bob\n"
        r = await s.run("echo oops >&2; false")
        assert (r.stdout, r.stderr, r.exit_code) == ("", "oops\n", 1)

        s2 = await sb.sessions.create(cwd="/tmp", env={"B": "2"})
        assert (await s2.run("pwd; echo $B; echo ${A:-unset}")).stdout == "/tmp\n2\nunset\n"
        assert (await s.run("pwd; echo ${B:-unset}")).stdout == "/var\nunset\n"
        listed = {x["session_id"]: x for x in await sb.sessions.list()}
        assert {s.id, s2.id} <= set(listed)
        assert "bash" in listed[s.id]["shell"]

        # Background command: running with the output so far, then done.
        cid = await s.run_background("echo first; sleep 1.5; echo second")
        seen_partial = await until(lambda: _partial(s, cid), 1.4, 0.05)
        assert seen_partial, "no 'running' state with the first line"
        r = await s.wait(cid, timeout=15)
        assert (r.stdout, r.exit_code, r.state) == ("first\nsecond\n", 0, "done")

        # Timeouts: a child process is killed and the shell carries on; a busy shell
        # (a builtin loop) is restarted.
        t0 = time.monotonic()
        r = await s.run("sleep 30", timeout=1)
        assert r.timed_out and time.monotonic() - t0 < 10, r
        assert (await s.run("pwd")).stdout == "/var\n"
        r = await s.run("while :; do :; done", timeout=1)
        assert r.timed_out and r.session_restarted, r
        assert (await s.run("echo alive")).stdout == "alive\n"

        # Ending a session ends what it started, detached daemons included.
        s3 = await sb.sessions.create()
        await s3.run("s=1000; setsid sleep $s >/dev/null 2>&1 </dev/null &")
        assert await count_sleeps(sb) == 1
        await s3.kill()
        assert await until(lambda: _eq(count_sleeps(sb), 0), 5), "a daemon outlived its session"
        assert s3.id not in {x["session_id"] for x in await sb.sessions.list()}
        with pytest.raises(NotFoundError):
            await s3.run("echo gone")
        await s2.kill()
        await s.kill()
    finally:
        await sb.stop()


async def _partial(s, cid) -> bool:
    d = await s.command(cid)
    return d["state"] == "running" and d["stdout"] == "first\n"


# ---- trajectories ---------------------------------------------------------------------

DRIVER = '''\
import asyncio, sys
from opendsec import DSecClient, PreconditionError

async def main():
    sandbox_id, resume, first = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    async with DSecClient() as c:
        sb = await c.get_sandbox(sandbox_id)
        t = await sb.trajectory("t1", resume=resume)
        try:
            for n in range(1, 7):
                word = first if n == 1 else "x"
                r = await t.run_shell(f"echo {word} >> /root/counter; sleep 1")
                assert r.exit_code == 0, r
                print(f"step {n}", flush=True)
        except PreconditionError as e:
            print("precondition: " + e.message.replace("\\n", " "), flush=True)
            sys.exit(3)
        print(f"replayed {t.replayed}", flush=True)

asyncio.run(main())
'''


class Driver:
    def __init__(self, script: Path, sandbox_id: str):
        self.script = script
        self.sandbox_id = sandbox_id
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, resume: bool, first: str = "x") -> asyncio.subprocess.Process:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "sdk/python"))
        env["DSEC_CONFIG"] = os.environ["DSEC_CONFIG"]
        p = await asyncio.create_subprocess_exec(
            sys.executable, str(self.script), self.sandbox_id, "1" if resume else "0", first,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        self.procs.append(p)
        return p

    async def run(self, resume: bool, first: str = "x", timeout: float = 60) -> tuple[int, list[str], float, str]:
        t0 = time.monotonic()
        p = await self.start(resume, first)
        out, err = await asyncio.wait_for(p.communicate(), timeout)
        return p.returncode, out.decode().splitlines(), time.monotonic() - t0, err.decode()

    def kill_all(self) -> None:
        for p in self.procs:
            if p.returncode is None:
                p.kill()


async def test_trajectory_resumes_exactly_once_and_survives_a_server_kill(client, tmp_path):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    (tmp_path / "driver.py").write_text(DRIVER)
    drv = Driver(tmp_path / "driver.py", sb.id)
    counter = "wc -l < /root/counter"
    try:
        # A first run, killed (SIGKILL) while step 3 runs.
        p = await drv.start(resume=False)
        lines = []
        while not lines or lines[-1] != "step 2":
            line = await asyncio.wait_for(p.stdout.readline(), 30)
            assert line, f"driver ended early: {lines} {(await p.stderr.read()).decode()}"
            lines.append(line.decode().strip())
        assert await until(lambda: _eq(_int(sb.run_shell(counter)), 3), 5, 0.05)
        p.kill()
        await p.wait()
        # Step 3 runs to its end without its client; then the driver resumes.
        await asyncio.sleep(1.5)
        rc, lines, wall, err = await drv.run(resume=True)
        assert rc == 0, (lines, err)
        assert lines[:6] == [f"step {n}" for n in range(1, 7)]
        replayed = int(lines[-1].split()[1])
        assert replayed >= 3, lines
        assert wall < 6 - 1.5, f"the resumed run took {wall:.1f} s: steps ran again?"
        r = await sb.run_shell("cat /root/counter")
        assert r.stdout == "x\n" * 6, "each step must be applied exactly once"

        # A program whose step 1 changed is refused, and nothing runs.
        rc, lines, wall, err = await drv.run(resume=True, first="y")
        assert rc == 3, (lines, err)
        msg = lines[-1]
        assert msg.startswith("precondition: ")
        assert re.search(r"step\D{0,3}1\b", msg, re.I) and "echo y" in msg, msg
        assert (await sb.run_shell(counter)).stdout.strip() == "6"
        with pytest.raises(PreconditionError) as e:
            await sb.trajectory("t1")  # not a resume, and the name is taken
        assert "resume=True" in e.value.message

        log = await sb.trajectory_log("t1")
        assert log["name"] == "t1"
        assert [s["seq"] for s in log["steps"]] == [1, 2, 3, 4, 5, 6]
        assert "echo x >> /root/counter" in json.dumps(log["steps"][0]["request"])
        for a, b in zip(log["steps"], log["steps"][1:]):
            assert a["started_at_ms"] <= a["finished_at_ms"] <= b["started_at_ms"]
        listed = [t for t in await sb.trajectories() if t.get("name") == "t1"]
        assert listed and 6 in listed[0].values(), listed
        host_logs = host_trajectory_logs(sb.id, "t1")
        assert host_logs, "no trajectory log on the host"

        # Calls without the headers are not logged; a gap in the step numbers is refused.
        await sb.run_shell("echo untracked")
        assert len((await sb.trajectory_log("t1"))["steps"]) == 6
        async with httpx.AsyncClient(base_url=client.api_url,
                                     headers={"Authorization": f"Bearer {client.api_key}"}) as raw:
            r = await raw.post(f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "true"},
                               headers={"X-Dsec-Trajectory": "t-gap", "X-Dsec-Step": "3"})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text

        # The log outlives a kill -9 of the server, and still answers a resumed run.
        pid = server_pid()
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10)
        server_up()
        async with DSecClient() as c2:
            again = await c2.get_sandbox(sb.id)
            assert [s["seq"] for s in (await again.trajectory_log("t1"))["steps"]] == [1, 2, 3, 4, 5, 6]
            rc, lines, wall, err = await drv.run(resume=True)
            assert rc == 0, (lines, err)
            assert lines[-1] == "replayed 6" and wall < 6 - 1.5, (lines, wall)
            assert (await again.run_shell(counter)).stdout.strip() == "6"
            await again.stop()
        # Logs go with the sandbox.
        assert not [p for p in host_logs if p.exists()]
    finally:
        drv.kill_all()
        await sb.stop()


async def _int(coro) -> int:
    return int((await coro).stdout.strip() or 0)


# ---- what stays outside ---------------------------------------------------------------

async def test_runtime_state_is_invisible_inside_and_survives_a_broken_shell(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        s = await sb.sessions.create()
        # A marker only the command's output contains (not its text).
        a, b = "MK" + uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
        marker = a + b
        r = await s.run(f"printf '%s%s\\n' {a} {b}")
        assert r.stdout == marker + "\n"
        marker_cid = r.command_id
        bg_marker = "BG" + a[2:] + b
        bg = await sb.exec_background(["sh", "-c", f"printf '%s%s\\n' BG{a[2:]} {b}; sleep 1000"])
        t = await sb.trajectory("t-sec")
        assert (await t.run_shell("echo step-one")).stdout == "step-one\n"
        host_logs = host_trajectory_logs(sb.id, "t-sec")
        assert host_logs, "no trajectory log on the host"
        async with sb.files.watch("/root"):
            # No socket anywhere inside (sessions, processes, watches all go through aether's
            # inherited descriptor), on the root filesystem or any other.
            assert (await sb.run_shell("find / -xdev -type s 2>/dev/null | wc -l")).stdout.strip() == "0"
            r = await sb.run_shell("find / \\( -path /proc -o -path /sys \\) -prune -o -type s -print 2>/dev/null")
            assert r.stdout == "", r.stdout
            # The host's trajectory log is not reachable at its path or anywhere else.
            tests = "".join(f"test -e {p} && echo present {p}; " for p in host_logs + [DATA])
            r = await sb.run_shell(tests + "find / \\( -path /proc -o -path /sys \\) -prune -o -name '*.jsonl' -print 2>/dev/null")
            assert r.stdout == "", r.stdout
            # Kept output (of a session command, of a background process) is in no file a
            # process can read, though the API still has it.
            assert (await s.command(marker_cid))["stdout"] == marker + "\n"
            r = await sb.exec(["grep", "-rlsF", "-D", "skip", "--exclude-dir=proc", "--exclude-dir=sys",
                               "-e", marker, "-e", bg_marker, "/"], timeout=120)
            assert r.stdout == "" and r.exit_code in (1, 2), r
        # Replacing bash (unlinked first: the session's bash is running it, so writing in
        # place would fail with ETXTBSY) breaks neither exec by argv nor the open session.
        r = await sb.run_shell("cp /bin/bash /tmp/b && rm -f /bin/bash && echo broken > /bin/bash "
                               "&& chmod 755 /bin/bash && head -c 6 /bin/bash")
        assert r.stdout == "broken", r
        assert (await sb.exec(["/usr/bin/python3", "-c", "print('argv ok')"])).stdout == "argv ok\n"
        assert (await sb.exec(["echo", "plain"])).stdout == "plain\n"
        assert (await s.run("echo still")).stdout == "still\n"
        p = await sb.exec_stream(["echo", "streamed"])
        assert (await p.wait()).stdout == "streamed\n"
        await sb.files.write("/root/after", "ok")
        assert await sb.files.read_text("/root/after") == "ok"
        await bg.kill()
        assert (await asyncio.wait_for(bg.wait(), 10)).stdout == bg_marker + "\n"
    finally:
        await sb.stop()


# ---- ports ----------------------------------------------------------------------------

# An HTTP and WebSocket echo server from the standard library, run inside the sandbox.
PORT_SERVER = r'''
import base64, hashlib, http.server, socketserver
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() != "websocket":
            body = ("path=%s auth=%s token=%s" % (self.path, self.headers.get("Authorization"),
                                                   self.headers.get("X-Dsec-Token"))).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        acc = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] + GUID).encode()).digest())
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", acc.decode())
        self.end_headers()
        self.wfile.flush()
        while True:
            hdr = self.rfile.read(2)
            if len(hdr) < 2 or hdr[0] & 0x0F == 8:
                return
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(hdr[1] & 0x7F)))
            out = b"echo:" + data
            self.wfile.write(bytes([0x81, len(out)]) + out)
            self.wfile.flush()
    def log_message(self, *a):
        pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 8080), H).serve_forever()
'''


async def _websocket_echo(api_url: str, path: str, text: str) -> str:
    host, port = api_url.split("//", 1)[1].rstrip("/").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.split(b" ")[1] == b"101", head
        assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head, head
        mask = os.urandom(4)
        payload = text.encode()
        writer.write(bytes([0x81, 0x80 | len(payload)]) + mask
                     + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        await writer.drain()
        hdr = await asyncio.wait_for(reader.readexactly(2), 10)
        return (await asyncio.wait_for(reader.readexactly(hdr[1] & 0x7F), 10)).decode()
    finally:
        writer.close()


async def test_ports_forward_http_and_websocket_with_key_or_token(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        await sb.files.write("/root/srv.py", PORT_SERVER)
        await sb.exec_background(["python3", "/root/srv.py"])
        assert sb.info.port_token and len(sb.info.port_token) >= 32
        key = {"Authorization": f"Bearer {client.api_key}"}
        async with httpx.AsyncClient(timeout=20) as h:
            url = sb.port_url(8080, "x/y?a=1", with_token=False)
            r = None
            for _ in range(100):  # until the server listens
                r = await h.get(url, headers=key)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
                await asyncio.sleep(0.1)
            # The path and query arrive as sent; the API key does not reach the sandbox.
            assert r.status_code == 200 and r.text == "path=/x/y?a=1 auth=None token=None", r.text
            # The port token opens it without a key, and is not passed on either.
            r = await h.get(sb.port_url(8080, "p?b=2"))
            assert r.status_code == 200 and r.text == "path=/p?b=2 auth=None token=None", r.text
            r = await h.get(sb.port_url(8080, "q", with_token=False),
                            headers={"X-Dsec-Token": sb.info.port_token})
            assert r.status_code == 200 and r.text.startswith("path=/q "), r.text
            # Nothing else does: no credentials, a wrong token, another sandbox's token.
            other = await client.run_sandbox(DSecRunArgs(image="root/base"))
            try:
                for headers in ({}, {"X-Dsec-Token": "0" * 48}, {"X-Dsec-Token": other.info.port_token}):
                    r = await h.get(sb.port_url(8080, "", with_token=False), headers=headers)
                    assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
            finally:
                await other.stop()
            # A closed port and a bad one are clear errors.
            r = await h.get(sb.port_url(8081), headers=key)
            assert r.status_code == 503 and "8081" in r.json()["message"], r.text
            r = await h.get(sb.port_url(70000), headers=key)
            assert r.status_code == 400, r.text
        # WebSocket through the same path, with the token.
        path = sb.port_url(8080, "ws").split("//", 1)[1]
        path = path[path.index("/"):]
        assert await _websocket_echo(client.api_url, path, "hello ws") == "echo:hello ws"
    finally:
        await sb.stop()


async def test_calls_to_one_sandbox_do_not_wait_for_each_other(client):
    sb = await client.run_sandbox(DSecRunArgs(image="root/py:3.11"))
    try:
        slow = asyncio.create_task(sb.run_shell("sleep 4; echo slow"))
        await asyncio.sleep(0.5)
        # Another command, a file write and a session command all finish while it runs.
        assert (await sb.run_shell("echo quick")).stdout == "quick\n"
        await sb.files.write("/root/f", "x")
        s = await sb.sessions.create()
        busy = await s.run_background("sleep 1000")
        assert not slow.done(), "a second exec waited for the first"
        # Ending a session whose shell is busy works at once and ends what it ran.
        await asyncio.wait_for(s.kill(), 10)
        r = await sb.run_shell("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c 'sleep 100[0]'")
        assert r.stdout.strip() == "0", r
        assert busy
        assert (await slow).stdout == "slow\n"
    finally:
        await sb.stop()
