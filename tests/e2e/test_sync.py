# SPDX-License-Identifier: AGPL-3.0-only
"""The synchronous Python client (`opendsec.sync`) as code without asyncio uses it: the
seed's example written with it, one client shared by many threads, and calls from a thread
whose event loop is running (a notebook). `test_runtime.py` runs its scenarios through it
as well."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

from conftest import ROOT, leftovers
from opendsec import NotFoundError
from opendsec.sync import DSecClient, DSecRunArgs, Process, Sandbox


def test_the_seed_example_written_synchronously_prints_42():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "sdk/python"))
    r = subprocess.run([sys.executable, str(ROOT / "examples/seed_sync.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "42\n\n"
    with DSecClient() as c:
        assert c.list_sandboxes() == []


def test_a_sandbox_with_blocks_streams_and_errors():
    with DSecClient() as c:
        with c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64, ttl_seconds=300)) as sb:
            assert isinstance(sb, Sandbox)
            sid = sb.id
            assert sb.run_shell("echo hi").stdout == "hi\n"
            p = sb.exec_stream(cmd="for i in 1 2 3; do echo $i; sleep 0.2; done; echo err >&2; exit 4")
            assert isinstance(p, Process) and p.pid > 1
            got = list(p)
            assert b"".join(d for s, d in got if s == "stdout") == b"1\n2\n3\n"
            assert b"".join(d for s, d in got if s == "stderr") == b"err\n"
            assert p.wait().exit_code == 4
            sb.files.write("/tmp/a.txt", "abc")
            with sb.files.watch("/tmp") as w:
                sb.files.write("/tmp/b.txt", "x")
                ev = next(iter(w))
                assert ev["path"] == "/tmp/b.txt", ev
            assert sb.files.read("/tmp/a.txt") == b"abc"
            with sb.sessions.create() as s:
                s.run("cd /tmp && X=7")
                assert s.run("echo $X $(pwd)").stdout == "7 /tmp\n"
            try:
                sb.files.read("/tmp/none")
                raise AssertionError("a missing file was read")
            except NotFoundError as e:
                assert e.code == "not_found"
        # The with block stopped it.
        try:
            c.get_sandbox(sid)
            raise AssertionError("the sandbox outlived its with block")
        except NotFoundError:
            pass
    assert leftovers(sid) == []


def test_one_client_shared_by_threads():
    n = 24
    made: list[str] = []
    errors: list[BaseException] = []
    with DSecClient() as c:
        def one(i: int) -> None:
            try:
                sb = c.run_sandbox(image="root/base", memory_limit_mb=32, ttl_seconds=300,
                                   labels={"sync-threads": "1"})
                made.append(sb.id)
                assert sb.run_shell(f"echo {i}").stdout == f"{i}\n"
                sb.stop()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert len(set(made)) == n
        assert c.list_sandboxes(labels={"sync-threads": "1"}) == []


def test_calls_from_a_thread_whose_loop_is_running():
    async def notebook_cell() -> str:
        # A notebook's cell runs inside a running loop; asyncio.run would refuse here.
        with DSecClient() as c:
            with c.run_sandbox(image="root/base", memory_limit_mb=32, ttl_seconds=300) as sb:
                return sb.run_shell("echo cell").stdout
    assert asyncio.run(notebook_cell()) == "cell\n"


def test_a_forked_child_and_its_parent_both_keep_working():
    # A rollout worker forks with a client in hand: the child makes its own connections,
    # and the parent's kept-alive ones are not closed under it by the child.
    with DSecClient(timeout=20) as c:
        with c.run_sandbox(image="root/base", memory_limit_mb=32, ttl_seconds=300) as sb:
            assert sb.run_shell("echo a").stdout == "a\n"
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = 0 if sb.run_shell("echo child").stdout == "child\n" else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            for _ in range(3):
                assert sb.run_shell("echo parent").stdout == "parent\n"
