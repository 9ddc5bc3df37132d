#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""What a VM guest that floods its channel costs the host.

Two parts, both printing peak RSS (VmHWM) and writing JSON to bench/results/:

  hostile peer   the real host end of a VM's channel (`dsec-aether vmux`) against a peer
                 playing a guest whose kernel the tenant owns: it answers the handshake,
                 learns the ids of the streams the host opens (64 connections that never
                 read), sends every stream three times its window, then only writes
                 (DATA, OPENs of its own, frames for streams that do not exist) and never
                 reads a byte of what the host sends. Printed: vmux's peak RSS, the
                 streams it closed for passing their window.
  real guest     a `vm` sandbox (QEMU; TCG where there is no KVM) whose guest writes to
                 its channel as fast as it can on 8 streamed execs nobody reads, next to the
                 same VM only burning its CPU (the floor any busy VM costs): the create p50
                 of container sandboxes beside it, idle / CPU floor / flood (interleaved
                 over --rounds), the node's and vmux's peak RSS, the cores node, vmux and
                 QEMU used. Skipped when the server has no `vm` backend.

    python3 bench/guest_flood.py [--seconds 20] [-n 30] [--rounds 3] [--skip-vm]
Needs root for the VM part (starts its own server on --data-dir with --image-store).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchlib import DSEC, ROOT, lat_summary, pct, proc_cpu, server_down, server_up, write_result  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402
from opendsec.errors import PreconditionError  # noqa: E402

AETHER = os.environ.get("DSEC_AETHER", str(ROOT / "target/x86_64-unknown-linux-gnu/release/dsec-aether"))

# vmux framing (crates/common/src/vmux.rs): [kind u8][stream u32][len u32][payload].
OPEN, DATA, EOF, WINDOW_UPDATE, CLOSE, RESET = 1, 2, 3, 4, 5, 6
MAX_DATA = 32 * 1024
WINDOW = 256 * 1024


def frame(kind: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">BII", kind, sid, len(payload)) + payload


def hwm_kib(pid: int) -> int:
    """Peak resident memory of a process so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def read_exact(s: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise ConnectionError("closed")
        b += c
    return b


def read_frame(s: socket.socket) -> tuple[int, int, bytes]:
    """The next frame, skipping the 0xFF filler between frames."""
    k = read_exact(s, 1)[0]
    while k == 0xFF:
        k = read_exact(s, 1)[0]
    sid, n = struct.unpack(">II", read_exact(s, 8))
    return k, sid, read_exact(s, n)


def hostile_peer(seconds: float, streams: int) -> dict:
    """Runs vmux against a peer that floods and never reads; returns its figures."""
    with tempfile.TemporaryDirectory(prefix="dsec-vmux-") as d:
        chardev, listen = os.path.join(d, "chardev.sock"), os.path.join(d, "aether.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(chardev)
        srv.listen(1)
        vmux = subprocess.Popen([AETHER, "vmux", listen, chardev], stderr=subprocess.DEVNULL)
        try:
            link, _ = srv.accept()
            # The handshake: the host's RESET, echoed after filler.
            k, sid, nonce = read_frame(link)
            assert k == RESET, f"vmux opened with frame kind {k}"
            link.sendall(b"\xff" * (MAX_DATA + 10) + frame(RESET, 0, nonce))
            for _ in range(100):
                if os.path.exists(listen):
                    break
                time.sleep(0.02)
            # The host's clients (the edge, in a real node): they never read either.
            clients = []
            for _ in range(streams):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(listen)
                c.sendall(b'{"op":"ping"}\n')
                clients.append(c)
            ids: list[int] = []
            link.settimeout(5)
            while len(ids) < streams:
                k, sid, _ = read_frame(link)
                if k == OPEN:
                    ids.append(sid)
            base = hwm_kib(vmux.pid)
            # Phase 1: every stream gets three times its window at once (the host's socket
            # to its client takes a little, the rest is over the window), while the peer
            # still drains what the host sends (so the host is never stalled by the peer's
            # own link and the window is what stops it).
            link.settimeout(None)
            draining = threading.Event()
            draining.set()
            closes: list[int] = []

            def drain() -> None:
                try:
                    while draining.is_set():
                        k, sid, _ = read_frame(link)
                        if k == CLOSE:
                            closes.append(sid)
                except OSError:
                    pass

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            payload = os.urandom(MAX_DATA)
            over = WINDOW * 3 // MAX_DATA
            for sid in ids:
                link.sendall(frame(DATA, sid, payload) * over)
            t1 = time.monotonic()
            while len(set(closes) & set(ids)) < len(ids) and time.monotonic() - t1 < 10:
                time.sleep(0.05)
            closed_for_window = len(set(closes) & set(ids))
            draining.clear()
            # Phase 2: from here on the peer only writes, and reads nothing.
            link.setblocking(False)
            sent = 0
            blocked_s = 0.0
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < seconds:
                burst = [frame(DATA, ids[i % len(ids)], payload)] * 4 + [
                    frame(OPEN, 0x7000_0000 + i),           # streams the host never opened
                    frame(DATA, 0x6000_0000 + i, payload),  # data for streams that do not exist
                ]
                buf = b"".join(burst)
                off = 0
                while off < len(buf) and time.monotonic() - t0 < seconds:
                    try:
                        off += link.send(buf[off:])
                    except BlockingIOError:
                        time.sleep(0.01)
                        blocked_s += 0.01
                sent += off
                i += 1
            took = time.monotonic() - t0
            peak = hwm_kib(vmux.pid)
            alive = vmux.poll() is None
            return {
                "streams": streams,
                "seconds": round(took, 1),
                "bytes_written_by_guest": sent,
                "guest_blocked_s": round(blocked_s, 1),
                "window_per_stream_kib": WINDOW // 1024,
                "vmux_rss_before_flood_mib": round(base / 1024, 1),
                "vmux_peak_rss_mib": round(peak / 1024, 1),
                "streams_closed_for_passing_window": closed_for_window,
                "vmux_still_running": alive,
            }
        finally:
            vmux.kill()
            vmux.wait()
            srv.close()


# Writes to stdout as fast as the channel lets it, for ever.
FLOOD = "import os\nb = os.urandom(1 << 16)\nwhile True: os.write(1, b)\n"
SPIN = "while True: pass\n"


async def creates(c: DSecClient, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        sb = await c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, cpu_cores_limit=0.05))
        out.append(time.monotonic() - t0)
        await sb.stop()
    return out


async def real_guest(url: str, key: str, data: Path, n: int, seconds: float, rounds: int) -> dict:
    async with DSecClient(api_url=url, api_key=key, timeout=600.0) as c:
        st = await c.status()
        backends = {b["name"]: b for n in (st.get("nodes") or [st]) for b in n.get("backends", [])}
        vmb = backends.get("vm")
        if not vmb or not vmb.get("available"):
            return {"skipped": vmb["detail"] if vmb else "no vm backend reported"}
        accel = "KVM" if "KVM" in vmb["detail"] and "TCG" not in vmb["detail"] else "TCG"
        # Room for aether's kept output (the last 16 MiB of each stream of every process,
        # exited ones too, until they are reaped) across the rounds' 24 flooders.
        vm = await c.run_sandbox(DSecRunArgs(image="root/py:3.11", backend="vm", memory_limit_mb=1536,
                                             cpu_cores_limit=1, ttl_seconds=1800))
        try:
            node = int((data / "dsec.pid").read_text().strip())
            vmux = int((data / "edge/sandboxes" / vm.id / "vmux.pid").read_text().strip())
            qemu = int((data / "edge/sandboxes" / vm.id / "qemu.pid").read_text().strip())
            procs = {"node": node, "vmux": vmux, "qemu": qemu}
            cpu: dict[str, dict[str, float]] = {}
            wall: dict[str, float] = {}
            flood_s = 0.0
            ended_early = 0
            how: list[dict] = []

            async def measured(name: str, k: int) -> list[float]:
                t0, c0 = time.monotonic(), {x: proc_cpu(p) for x, p in procs.items()}
                lat = await creates(c, k)
                wall[name] = wall.get(name, 0.0) + time.monotonic() - t0
                got = cpu.setdefault(name, {x: 0.0 for x in procs})
                for x, p in procs.items():
                    got[x] += proc_cpu(p) - c0[x]
                return lat

            await creates(c, 3)
            # The three conditions interleaved over `rounds`, so drift falls on each alike.
            idle: list[float] = []
            busy: list[float] = []
            flooded: list[float] = []
            per = max(1, n // rounds)
            node_before, vmux_before = hwm_kib(node), hwm_kib(vmux)
            t0 = time.monotonic()
            for _ in range(rounds):
                idle += await measured("idle", per)
                spin = await vm.exec_stream(["python3", "-c", SPIN])
                await asyncio.sleep(1)
                busy += await measured("cpu_floor", per)
                await spin.kill()
                # Eight streams writing as fast as they can; nobody reads them.
                floods = [await vm.exec_stream(["python3", "-c", FLOOD]) for _ in range(8)]
                f0 = time.monotonic()
                await asyncio.sleep(1)
                flooded += await measured("flood", per)
                rest = seconds / rounds - (time.monotonic() - f0)
                if rest > 0:
                    await asyncio.sleep(rest)
                flood_s += time.monotonic() - f0
                for p in floods:
                    try:
                        await p.kill()
                    except PreconditionError:
                        ended_early += 1  # the flood process had already exited: how?
                        a = await vm.attach(p.pid)
                        res = await a.wait()
                        how.append({"exit_code": res.exit_code, "signal": res.signal,
                                    "oom_killed": res.oom_killed, "stderr": res.stderr[-300:]})
            node_peak, vmux_peak = hwm_kib(node), hwm_kib(vmux)
            # The VM still answers.
            r = await vm.exec(argv=["echo", "alive"], timeout=60)
        finally:
            await vm.stop()
    return {
        "accelerator": accel,
        "n": n,
        "idle_create": lat_summary(idle),
        "cpu_floor_create": lat_summary(busy),
        "flooded_create": lat_summary(flooded),
        "flooded_create_p50_ratio": round(pct(flooded, 50) / pct(idle, 50), 3),
        "cpu_floor_create_p50_ratio": round(pct(busy, 50) / pct(idle, 50), 3),
        "flood_seconds": round(flood_s, 1),
        "rounds": rounds,
        "flood_processes_ended_early": ended_early,
        "how_they_ended": how,
        "node_peak_rss_mib_before_flood": round(node_before / 1024, 1),
        "node_peak_rss_mib": round(node_peak / 1024, 1),
        "vmux_peak_rss_mib_before_flood": round(vmux_before / 1024, 1),
        "vmux_peak_rss_mib": round(vmux_peak / 1024, 1),
        "vm_answered_after": r.stdout.strip() == "alive",
        "cores_used_while_measuring": {k: {x: round(v / wall[k], 2) for x, v in u.items()}
                                       for k, u in cpu.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20, help="how long each flood runs")
    ap.add_argument("-n", type=int, default=30, help="creates measured per condition")
    ap.add_argument("--streams", type=int, default=64, help="host streams the hostile peer floods")
    ap.add_argument("--rounds", type=int, default=3, help="rounds the VM conditions are interleaved over")
    ap.add_argument("--skip-vm", action="store_true", help="only the hostile-peer part")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench-flood")
    ap.add_argument("--image-store", default=os.environ.get("DSEC_TEST_DIR", "/var/tmp/dsec-test") + "/images")
    ap.add_argument("--listen", default="127.0.0.1:7615")
    a = ap.parse_args()

    out: dict = {"hostile_peer": hostile_peer(a.seconds, a.streams)}
    h = out["hostile_peer"]
    print(f"hostile peer: then {h['bytes_written_by_guest'] / 2**20:.0f} MiB written in {h['seconds']} s, "
          f"reading nothing (blocked {h['guest_blocked_s']} s: the host's link filled and it stopped reading)")
    print(f"  vmux RSS {h['vmux_rss_before_flood_mib']} MiB before, peak {h['vmux_peak_rss_mib']} MiB; "
          f"{h['streams_closed_for_passing_window']}/{h['streams']} streams closed for passing their "
          f"window; vmux still running: {h['vmux_still_running']}")

    if not a.skip_vm:
        data = Path(a.data_dir)
        try:
            url, key = server_up(data, a.listen, Path(a.image_store))
            subprocess.run([DSEC, "image", "vm-kernel", "--data-dir", str(data), "--store", a.image_store],
                           capture_output=True)
            out["real_guest"] = asyncio.run(real_guest(url, key, data, a.n, a.seconds, a.rounds))
        finally:
            server_down(data)
        g = out["real_guest"]
        if "skipped" in g:
            print(f"real guest: skipped ({g['skipped']})")
        else:
            print(f"\nreal guest ({g['accelerator']}"
                  f"{': emulated, timings mean little' if g['accelerator'] == 'TCG' else ''}): "
                  f"8 streams writing for {g['flood_seconds']} s, nobody reading")
            print(f"{'create p50 of others (ms)':<28}{'idle':>8}{'VM CPU floor':>16}{'channel flood':>17}")
            i = g["idle_create"]["p50_ms"]
            b, f = g["cpu_floor_create"]["p50_ms"], g["flooded_create"]["p50_ms"]
            print(f"{'':<28}{i:>8.1f}{b:>9.1f} ({b / i:.2f}){f:>10.1f} ({f / i:.2f})")
            print(f"node peak RSS {g['node_peak_rss_mib_before_flood']} MiB before, {g['node_peak_rss_mib']} "
                  f"after; vmux {g['vmux_peak_rss_mib_before_flood']} -> {g['vmux_peak_rss_mib']} MiB; "
                  f"VM answered after: {g['vm_answered_after']}")
            for cond, u in g["cores_used_while_measuring"].items():
                print(f"  cores used, {cond:<10} " + "  ".join(f"{k} {v:.2f}" for k, v in u.items()))
    write_result("guest_flood", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
