# SPDX-License-Identifier: Apache-2.0
"""The seed example: a sandbox runs Python, forks four copies, stops them all.

    python3 examples/seed.py            # a container (copies get its files)
    python3 examples/seed.py vm         # a QEMU VM (copies get its memory too)
    python3 examples/seed.py microvm    # a Firecracker microVM (hardware KVM needed)
"""

import asyncio
import sys

from opendsec import DSecClient, DSecRunArgs

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "container"


async def main():
    async with DSecClient() as client:
        sb = await client.run_sandbox(DSecRunArgs(backend=BACKEND, image="root/py:3.11",
                cpu_cores_limit=1, memory_limit_mb=1024))
        try:
            print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout)
            forks = await sb.fork(count=4)
            for f in forks: await f.stop()
        finally:
            await sb.stop()


asyncio.run(main())
