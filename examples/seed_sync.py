# SPDX-License-Identifier: Apache-2.0
"""The seed example with the synchronous client (no asyncio): a sandbox runs Python,
forks four copies, stops them all.

    python3 examples/seed_sync.py            # a container (copies get its files)
    python3 examples/seed_sync.py vm         # a QEMU VM (copies get its memory too)
"""

import sys

from opendsec.sync import DSecClient, DSecRunArgs

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "container"

with DSecClient() as client:
    with client.run_sandbox(DSecRunArgs(backend=BACKEND, image="root/py:3.11",
            cpu_cores_limit=1, memory_limit_mb=1024)) as sb:
        print(sb.run_shell("python3 -c 'print(6*7)'").stdout)
        for f in sb.fork(count=4):
            f.stop()
