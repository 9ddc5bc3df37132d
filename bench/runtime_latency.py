#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""Runtime API costs of an OpenDsec container sandbox, against the host floor in the same
run: exec round-trip latency of `true` through the SDK (plain and streamed) next to
`subprocess.run(["true"])` on the host, and file throughput up and down through the files
API next to a plain local file copy.

    python3 bench/runtime_latency.py -n 200 --size-mb 256
Starts its own server (like create_latency.py; --attach uses one already running, found as
the SDK finds it), prints p50/p90/p99 and MB/s (MB = 10^6 bytes), and writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchlib import DSEC, lat_summary, run, server_down, server_up, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402
MiB = 1 << 20


def rate(nbytes: int, seconds: float) -> dict:
    return {"bytes": nbytes, "seconds": round(seconds, 3), "mb_per_s": round(nbytes / 1e6 / seconds, 1)}


def make_file(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            b = os.urandom(min(4 * MiB, left))
            h.update(b)
            f.write(b)
            left -= len(b)
    return h.hexdigest()


def host_exec(n: int) -> dict:
    for _ in range(10):
        subprocess.run(["true"], check=True)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["true"], check=True)
        lat.append(time.perf_counter() - t0)
    return lat_summary(lat)


def host_copy(src: Path, tmp: Path) -> dict:
    """The floor for file transfer: a plain copy of the same file on the same disk (page
    cache to page cache, no fsync, as the transfers are timed)."""
    dst = tmp / "host-copy"
    t0 = time.perf_counter()
    shutil.copyfile(src, dst)
    took = time.perf_counter() - t0
    size = dst.stat().st_size
    dst.unlink()
    return rate(size, took)


async def bench_dsec(url: str | None, key: str | None, image: str, n: int, src: Path, size: int, want: str,
                     tmp: Path) -> dict:
    out: dict = {}
    async with DSecClient(api_url=url, api_key=key) as client:
        disk_mb = size // MiB + size // MiB // 5 + 64
        sb = await client.run_sandbox(DSecRunArgs(image=image, disk_limit_mb=disk_mb,
                                                  memory_limit_mb=disk_mb + 512, labels={"bench": "runtime"}))
        try:
            for _ in range(10):
                await sb.exec(["true"])
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = await sb.exec(["true"])
                lat.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
            out["exec"] = lat_summary(lat)

            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                p = await sb.exec_stream(["true"])
                r = await p.wait()
                lat.append(time.perf_counter() - t0)
                assert r.exit_code == 0, r
            out["exec_stream"] = lat_summary(lat)

            t0 = time.perf_counter()
            w = await sb.files.write_from("/root/bench.bin", src)
            up = time.perf_counter() - t0
            assert w["size"] == size, w
            out["upload"] = rate(size, up)
            r = await sb.exec(["sha256sum", "/root/bench.bin"], timeout=600)
            assert r.stdout.split()[0] == want, "uploaded file differs"

            dst = tmp / "downloaded"
            t0 = time.perf_counter()
            got = await sb.files.read_to("/root/bench.bin", dst)
            down = time.perf_counter() - t0
            assert got == size, got
            out["download"] = rate(size, down)
            dst.unlink()

            # The same through the CLI (a Rust client): what the server path carries when
            # the client is not the bottleneck.
            await sb.files.remove("/root/bench.bin")  # room on the sandbox's disk
            env = {**os.environ, "DSEC_API_URL": client.api_url, "DSEC_API_KEY": client.api_key}
            for name, args in (("cli_upload", [str(src), f"{sb.id}:/root/cli.bin"]),
                               ("cli_download", [f"{sb.id}:/root/cli.bin", str(dst)])):
                t0 = time.perf_counter()
                await asyncio.to_thread(run, [DSEC, "cp", *args], env=env)
                out[name] = rate(size, time.perf_counter() - t0)
            assert dst.stat().st_size == size
            dst.unlink()
        finally:
            await sb.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="exec round trips to time")
    ap.add_argument("--size-mb", type=int, default=256, help="file size for the throughput test, MiB")
    ap.add_argument("--image", default="root/base:latest")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7613")
    ap.add_argument("--tmp", default="/var/tmp", help="where the local test files go")
    ap.add_argument("--attach", action="store_true",
                    help="use a running server (DSEC_API_URL/DSEC_API_KEY or client.toml) instead of starting one")
    a = ap.parse_args()

    size = a.size_mb * MiB
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-runtime-", dir=a.tmp))
    data = Path(a.data_dir)
    started = False
    url = key = None
    try:
        if not a.attach:
            url, key = server_up(data, a.listen, store_of(data, a.image_store))
            started = True
        src = tmp / "source"
        print(f"writing a {a.size_mb} MiB test file in {tmp}")
        want = make_file(src, size)
        print(f"host floor: subprocess.run(['true']) x {a.n}, and a local copy of the file")
        h_exec = host_exec(a.n)
        h_copy = host_copy(src, tmp)
        print(f"OpenDsec: exec of `true` x {a.n} through the SDK, then the file up and down ({a.image})")
        d = asyncio.run(bench_dsec(url, key, a.image, a.n, src, size, want, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if started:
            server_down(data)

    print(f"\n{'exec round trip':28} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for name, r in (("opendsec exec", d["exec"]), ("opendsec exec_stream", d["exec_stream"]),
                    ("host subprocess.run (floor)", h_exec)):
        print(f"{name:28} {r['p50_ms']:9.2f} {r['p90_ms']:9.2f} {r['p99_ms']:9.2f} {r['mean_ms']:9.2f}")
    print(f"\n{'file, ' + str(a.size_mb) + ' MiB':28} {'MB/s':>9} {'seconds':>9}")
    for name, r in (("opendsec upload (SDK)", d["upload"]), ("opendsec download (SDK)", d["download"]),
                    ("opendsec upload (dsec cp)", d["cli_upload"]),
                    ("opendsec download (dsec cp)", d["cli_download"]),
                    ("host file copy (floor)", h_copy)):
        print(f"{name:28} {r['mb_per_s']:9.1f} {r['seconds']:9.2f}")

    out = {"bench": "runtime_latency", "image": a.image, "n": a.n, "size_mib": a.size_mb,
           "host_cpus": os.cpu_count(), "opendsec": d, "host_floor": {"exec": h_exec, "file_copy": h_copy}}
    write_result("runtime_latency", out)


if __name__ == "__main__":
    main()
