# SPDX-License-Identifier: Apache-2.0
"""The seed example: a container sandbox runs Python, forks four copies, stops them all."""

import asyncio

from opendsec import DSecClient, DSecRunArgs


async def main():
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend="container", image="root/py:3.11",
                cpu_cores_limit=1, memory_limit_mb=1024))
        try:
            print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout)
            forks = await sb.fork(count=4)
            for f in forks: await f.stop()
        finally:
            await sb.stop()


asyncio.run(main())
