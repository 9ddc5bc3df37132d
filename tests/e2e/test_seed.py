# SPDX-License-Identifier: AGPL-3.0-only
"""The seed's example, as written, through the Python SDK."""

from conftest import leftovers
from opendsec import DSecClient, DSecRunArgs


async def test_seed_example_prints_42_and_forks_four(capsys):
    made = []
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend="container", image="root/py:3.11",
                cpu_cores_limit=1, memory_limit_mb=1024))
        try:
            print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout)
            forks = await sb.fork(count=4)
            made = [f.id for f in forks]
            assert len({f.id for f in forks} | {sb.id}) == 5
            assert all(f.info.forked_from == sb.id for f in forks)
            assert sb.last_fork["memory_preserved"] is False
            assert "not its process memory" in sb.last_fork["note"]
            for f in forks: await f.stop()
        finally:
            await sb.stop()
        assert await client.list_sandboxes() == []
    assert capsys.readouterr().out == "42\n\n"
    for i in made + [sb.id]:
        assert leftovers(i) == []


async def test_seed_example_with_backend_vm_prints_42_and_forks_four(capsys):
    import shutil

    import pytest

    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("skipped: qemu-system-x86_64 is not installed")
    made = []
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend="vm", image="root/py:3.11",
                cpu_cores_limit=1, memory_limit_mb=1024))
        try:
            print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout)
            forks = await sb.fork(count=4)
            made = [f.id for f in forks]
            assert len({f.id for f in forks} | {sb.id}) == 5
            assert all(f.info.forked_from == sb.id for f in forks)
            assert sb.last_fork["memory_preserved"] is True
            for f in forks:
                assert (await f.run_shell("echo copy")).stdout == "copy\n"
                await f.stop()
        finally:
            await sb.stop()
        assert await client.list_sandboxes() == []
    assert capsys.readouterr().out == "42\n\n"
    for i in made + [sb.id]:
        assert leftovers(i) == []
