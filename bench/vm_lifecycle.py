#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""VM lifecycle costs, for each VM backend the server reports available (`vm` on QEMU,
`microvm` on Firecracker), with a container sandbox's cold start as the reference in the
same run:

  cold start     create until the first exec of `true` answers
  pause/resume   in place (the VM stops where it is)
  suspend        pause to disk (memory written out, VM process gone)
  restore        resume from disk until an exec answers
  fork           the source's stall, and per-copy latency (fork call until every copy
                 answers an exec) for N = 1, 8, 32 (--counts)
  PSS per copy   proportional set size of each copy's VM process after the fork of the
                 largest N, next to the source's (pages shared copy-on-write count once)

Floors measured in the same run: for `vm`, the command line of a sandbox's QEMU run by
hand (bench/rawqemu.py): a raw boot of the same kernel, initramfs and disk until its
agent answers, and the memory-sharing fork recipe (stop, device-state save with
x-ignore-shared, copies mapping the memory file privately) for each N; for `microvm`,
Firecracker booting the same kernel and disk by hand.

    python3 bench/vm_lifecycle.py --repeat 3 --counts 1,8,32
Starts its own server (--attach uses a running one, found as the SDK finds it; PSS is then
read from --data-dir's sandbox directories only if they are on this host), prints a table
labelled with the accelerator (KVM or TCG emulation), and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from benchlib import server_down, server_up, store_of, write_result  # noqa: E402 (puts the SDK on the path)
from opendsec import DSecClient, DSecRunArgs  # noqa: E402
import rawqemu  # noqa: E402
VM_BACKENDS = ("vm", "microvm")
# A process that holds memory worth sharing (64 MiB, touched), as a warmed environment does.
HOLDER = "import time; b = bytearray(range(256)) * (256 * 1024); time.sleep(1e9)"


def summary(xs_s: list[float]) -> dict:
    return {
        "count": len(xs_s),
        "min_ms": round(min(xs_s) * 1000, 1),
        "median_ms": round(statistics.median(xs_s) * 1000, 1),
        "max_ms": round(max(xs_s) * 1000, 1),
    }


def vm_pid(data: Path, sandbox_id: str) -> int | None:
    """The VM process of a sandbox: QEMU's or Firecracker's pid file in its directory."""
    d = data / "edge/sandboxes" / sandbox_id
    for name in ("qemu.pid", "firecracker.pid"):
        try:
            return int((d / name).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def raw_qemu_floor(data: Path, sandbox_id: str, repeat: int, counts: list[int]) -> dict:
    """The `vm` floors, by hand from the command line of a booted sandbox's QEMU (see
    rawqemu.py): a boot until aether answers, and for each N a memory-sharing fork of such
    a booted VM: the source's stall (stop and device-state save) and the time until all N
    copies answer."""
    cmd = rawqemu.qemu_cmdline(vm_pid(data, sandbox_id))
    vmux = int((data / "edge/sandboxes" / sandbox_id / "vmux.pid").read_text().strip())
    aether = rawqemu.qemu_cmdline(vmux)[0]
    ram_dir = Path(next((o.split("=", 1)[1] for a in cmd for o in a.split(",") if o.startswith("mem-path=")),
                        "/dev/shm/dsec-vm/x")).parent
    boots, forks = [], []
    with rawqemu.Netns(cmd, 1 + max(counts)) as ns:
        for i in range(repeat):
            t, vm = rawqemu.raw_boot(cmd, aether, ram_dir, ns[0])
            boots.append(t)
            vm.close()
            vm.mem.unlink(missing_ok=True)
        for n in counts:
            _, vm = rawqemu.raw_boot(cmd, aether, ram_dir, ns[0])
            try:
                r = rawqemu.raw_fork(vm, cmd, aether, ns[1:1 + n])
            finally:
                vm.close()
                vm.mem.unlink(missing_ok=True)
            forks.append({"n": n, "stall_ms": round(r["stall_s"] * 1000, 1),
                          "all_copies_answer_ms": round(r["all_answer_s"] * 1000, 1)})
            print(f"  raw QEMU fork N={n}: stall {forks[-1]['stall_ms']} ms, all copies answer in "
                  f"{forks[-1]['all_copies_answer_ms']} ms", flush=True)
    print(f"  raw QEMU boot, same kernel, initramfs and disk: aether answers after "
          f"{statistics.median(boots) * 1000:.0f} ms (median)", flush=True)
    return {"boot_to_agent": summary(boots), "fork": forks}


def qemu_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return out.splitlines()[0].removeprefix("QEMU emulator version ") if out else None


def pss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = await coro
    return time.perf_counter() - t0, r


async def cold_start(c: DSecClient, image: str, backend: str, memory: int) -> tuple[float, object]:
    t0 = time.perf_counter()
    sb = await c.run_sandbox(DSecRunArgs(image=image, backend=backend, memory_limit_mb=memory))
    await sb.exec(["true"])
    return time.perf_counter() - t0, sb


def microvm_disk(data: Path, sandbox_id: str) -> list[str] | None:
    """The root disks a microvm sandbox booted from, top first (its `microvm.json`)."""
    import json

    try:
        info = json.loads((data / "edge/sandboxes" / sandbox_id / "microvm.json").read_text())
        return [info["disk"], *info.get("lowers", [])]
    except (OSError, ValueError, KeyError):
        return None


def raw_firecracker_boot(data: Path, disks: list[str], memory: int) -> float | None:
    """The floor under a microvm cold start: the same Firecracker, kernel, initramfs and
    root disk as a sandbox, started by hand (no jail, cgroup, namespace or edge), until
    the guest's agent takes a connection on its vsock port. None when Firecracker or the
    kernel is not on this host."""
    import json
    import shutil
    import socket
    import subprocess
    import tempfile

    kdirs = sorted((data / "images/guest").glob("kernel-*"))
    fc = shutil.which("firecracker") or "/usr/local/bin/firecracker"
    if not kdirs or not Path(fc).exists():
        return None
    kdir = kdirs[-1]
    initrd = sorted(kdir.glob("initramfs-*.cpio.gz"))[-1]
    with tempfile.TemporaryDirectory() as t:
        uds = Path(t) / "v.sock"
        cfg = {
            "boot-source": {"kernel_image_path": str(kdir / "vmlinux"), "initrd_path": str(initrd),
                            "boot_args": "console=ttyS0 reboot=k panic=1 quiet i8042.noaux i8042.nomux "
                                         "i8042.dumbkbd random.trust_cpu=on dsec.channel=vsock "
                                         + (f"dsec.layers={len(disks)}" if len(disks) > 1 else "")},
            "drives": [{"drive_id": f"dsec_l{i}", "path_on_host": d, "is_root_device": False,
                        "is_read_only": True} for i, d in enumerate(disks)],
            "machine-config": {"vcpu_count": 1, "mem_size_mib": memory},
            "vsock": {"guest_cid": 3, "uds_path": str(uds)},
        }
        (Path(t) / "vm.json").write_text(json.dumps(cfg))
        t0 = time.perf_counter()
        p = subprocess.Popen([fc, "--no-api", "--config-file", str(Path(t) / "vm.json")],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.perf_counter() - t0 < 300 and p.poll() is None:
                try:
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(2)
                    s.connect(str(uds))
                    s.sendall(b"CONNECT 1024\n")
                    if s.recv(64).startswith(b"OK"):
                        return time.perf_counter() - t0
                except OSError:
                    pass
                finally:
                    s.close()
                time.sleep(0.01)
            return None
        finally:
            p.kill()
            p.wait()


async def bench_backend(c: DSecClient, backend: str, image: str, memory: int, repeat: int,
                        counts: list[int], data: Path | None) -> dict:
    out: dict = {}
    starts, pauses, resumes, suspends, restores = [], [], [], [], []
    for i in range(repeat):
        t, sb = await cold_start(c, image, backend, memory)
        starts.append(t)
        print(f"  {backend}: cold start {t * 1000:.0f} ms", flush=True)
        try:
            for _ in range(3):
                pauses.append((await timed(sb.pause()))[0])
                resumes.append((await timed(sb.resume()))[0])
            t, _ = await timed(sb.pause(to_disk=True))
            suspends.append(t)
            t0 = time.perf_counter()
            await sb.resume()
            await sb.exec(["true"])
            restores.append(time.perf_counter() - t0)
        finally:
            await sb.stop()
    out["cold_start_to_first_exec"] = summary(starts)
    if backend == "microvm" and data:
        sb = await c.run_sandbox(DSecRunArgs(image=image, backend=backend, memory_limit_mb=memory))
        disk = microvm_disk(data, sb.id)
        await sb.stop()
        raw = [raw_firecracker_boot(data, disk, memory) for _ in range(repeat)] if disk else [None]
        if all(r is not None for r in raw):
            out["raw_firecracker_boot_to_agent"] = summary(raw)
            print(f"  raw Firecracker, same kernel and disk: agent listening after "
                  f"{statistics.median(raw) * 1000:.0f} ms (median)", flush=True)
    if backend == "vm" and data:
        sb = await c.run_sandbox(DSecRunArgs(image=image, backend=backend, memory_limit_mb=memory))
        try:
            out["raw_qemu"] = raw_qemu_floor(data, sb.id, repeat, counts)
        finally:
            await sb.stop()
        out["cold_start_over_raw_boot"] = round(
            out["cold_start_to_first_exec"]["median_ms"] / out["raw_qemu"]["boot_to_agent"]["median_ms"], 2)
    out["pause"] = summary(pauses)
    out["resume"] = summary(resumes)
    out["pause_to_disk"] = summary(suspends)
    out["restore_from_disk_to_first_exec"] = summary(restores)

    sb = await c.run_sandbox(DSecRunArgs(image=image, backend=backend, memory_limit_mb=memory))
    try:
        await sb.exec_background(["python3", "-c", HOLDER])
        await asyncio.sleep(3)
        source_pss = pss_mib(vm_pid(data, sb.id)) if data else None
        forks = []
        for n in counts:
            t0 = time.perf_counter()
            copies = await sb.fork(count=n)
            called = time.perf_counter() - t0
            await asyncio.gather(*(cp.exec(["true"]) for cp in copies))
            all_answer = time.perf_counter() - t0
            stall = sb.last_fork.get("source_paused_ms")
            row = {"n": n, "source_stall_ms": stall, "fork_call_ms": round(called * 1000, 1),
                   "all_copies_answer_ms": round(all_answer * 1000, 1),
                   "per_copy_ms": round(all_answer * 1000 / n, 1)}
            if n == max(counts) and data:
                await asyncio.sleep(2)
                per = [pss_mib(vm_pid(data, cp.id)) for cp in copies]
                if all(p is not None for p in per):
                    row["pss_per_copy_mib"] = round(sum(per) / n, 1)
                    row["pss_all_copies_mib"] = round(sum(per), 1)
            raw = next((f for f in out.get("raw_qemu", {}).get("fork", []) if f["n"] == n), None)
            if raw:
                row["over_raw_all_answer"] = round(row["all_copies_answer_ms"] / raw["all_copies_answer_ms"], 2)
                if stall is not None:
                    row["stall_over_raw_save"] = round(stall / raw["stall_ms"], 2)
            print(f"  {backend}: fork N={n}: source stall {stall} ms, all copies answer in "
                  f"{all_answer * 1000:.0f} ms ({row['per_copy_ms']} ms per copy)", flush=True)
            forks.append(row)
            await asyncio.gather(*(cp.stop() for cp in copies))
        out["fork"] = forks
        out["source_pss_mib"] = round(source_pss, 1) if source_pss else None
    finally:
        await sb.stop()
    return out


async def bench(url: str | None, key: str | None, image: str, memory: int, repeat: int,
                counts: list[int], data: Path | None, only: list[str]) -> dict:
    async with DSecClient(api_url=url, api_key=key, timeout=600.0) as c:
        status = await c.status()
        nodes = status.get("nodes") or [status]
        backends = {b["name"]: b for n in nodes for b in n.get("backends", [])}
        result: dict = {"backends": {}, "skipped": {}}
        ref = []
        for _ in range(repeat):
            t, sb = await cold_start(c, image, "container", memory)
            ref.append(t)
            await sb.stop()
        result["container_cold_start_to_first_exec"] = summary(ref)
        for name in VM_BACKENDS:
            if only and name not in only:
                continue
            b = backends.get(name)
            if not b or not b.get("available"):
                why = b["detail"] if b else "not reported by the server"
                result["skipped"][name] = why
                print(f"{name}: skipped: {why}", flush=True)
                continue
            accel = "KVM" if "KVM" in b["detail"] and "TCG" not in b["detail"] else "TCG"
            if accel == "KVM" and os.environ.get("DSEC_NESTED"):
                # The harness's outer VM: KVM one level down, running at emulation speed.
                accel = "KVM nested under TCG"
            print(f"{name} ({accel}): {b['detail']}", flush=True)
            r = await bench_backend(c, name, image, memory, repeat, counts, data)
            r["accelerator"] = accel
            r["detail"] = b["detail"]
            result["backends"][name] = r
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="cold starts (each followed by pause/resume/suspend/restore)")
    ap.add_argument("--counts", default="1,8,32", help="fork sizes, comma-separated")
    ap.add_argument("--memory", type=int, default=512, help="guest memory, MiB")
    ap.add_argument("--image", default="root/py:3.11")
    ap.add_argument("--backend", action="append", default=[], help="only this VM backend (repeatable)")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-bench")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7614")
    ap.add_argument("--fork-capture", choices=("auto", "mapped", "pause", "live"), default=None,
                    help="[edge.vm] fork_capture for the server it starts (default: the server's, auto: "
                         "mapped with QEMU 10 or newer, else pause)")
    ap.add_argument("--attach", action="store_true",
                    help="use a running server (DSEC_API_URL/DSEC_API_KEY or client.toml) instead of starting one")
    a = ap.parse_args()
    counts = sorted({int(x) for x in a.counts.split(",") if x.strip()})
    data = Path(a.data_dir)
    started = False
    url = key = None
    try:
        if not a.attach:
            cfg = data / "config.toml"
            if a.fork_capture:
                data.mkdir(parents=True, exist_ok=True)
                cfg.write_text(f'[edge.vm]\nfork_capture = "{a.fork_capture}"\n')
            else:
                cfg.unlink(missing_ok=True)
            url, key = server_up(data, a.listen, store_of(data, a.image_store))
            started = True
        r = asyncio.run(bench(url, key, a.image, a.memory, a.repeat, counts,
                              data if (data / "edge/sandboxes").is_dir() else None, a.backend))
    finally:
        if started:
            server_down(data)
            (data / "config.toml").unlink(missing_ok=True)

    print(f"\n{'':34} {'median ms':>10} {'min ms':>9} {'max ms':>9}")
    ref = r["container_cold_start_to_first_exec"]
    print(f"{'container cold start (reference)':34} {ref['median_ms']:10.1f} {ref['min_ms']:9.1f} {ref['max_ms']:9.1f}")
    for name, b in r["backends"].items():
        print(f"\n{name} ({b['accelerator']}{' emulation: no hardware virtualisation' if b['accelerator'] == 'TCG' else ''}"
              f"{': timings mean little' if 'nested' in b['accelerator'] else ''})")
        rows = [(k.replace("_", " "), b[k]) for k in
                ("cold_start_to_first_exec", "raw_firecracker_boot_to_agent") if k in b]
        if "raw_qemu" in b:
            rows.append(("raw QEMU boot to agent (floor)", b["raw_qemu"]["boot_to_agent"]))
        rows += [(k.replace("_", " "), b[k]) for k in
                 ("pause", "resume", "pause_to_disk", "restore_from_disk_to_first_exec") if k in b]
        for k, s in rows:
            print(f"  {k:32} {s['median_ms']:10.1f} {s['min_ms']:9.1f} {s['max_ms']:9.1f}")
        if "cold_start_over_raw_boot" in b:
            print(f"  cold start / raw boot: {b['cold_start_over_raw_boot']}")
        print(f"  {'fork N':8} {'stall ms':>9} {'call ms':>9} {'all answer ms':>14} {'per copy ms':>12} {'PSS/copy MiB':>13}")
        for f in b["fork"]:
            pss = f.get("pss_per_copy_mib")
            print(f"  {f['n']:<8} {f['source_stall_ms']:>9} {f['fork_call_ms']:9.1f} {f['all_copies_answer_ms']:14.1f} "
                  f"{f['per_copy_ms']:12.1f} {pss if pss is not None else '-':>13}")
        for f in b.get("raw_qemu", {}).get("fork", []):
            mine = next((x for x in b["fork"] if x["n"] == f["n"]), {})
            print(f"  raw QEMU fork N={f['n']}: stall {f['stall_ms']} ms, all answer {f['all_copies_answer_ms']} ms"
                  f" (ours/raw: stall {mine.get('stall_over_raw_save', '-')}, "
                  f"all answer {mine.get('over_raw_all_answer', '-')})")
        if b.get("source_pss_mib"):
            print(f"  source PSS {b['source_pss_mib']} MiB")
    for name, why in r["skipped"].items():
        print(f"\n{name}: skipped: {why}")

    out = {"bench": "vm_lifecycle", "image": a.image, "memory_mib": a.memory, "repeat": a.repeat,
           "fork_capture": a.fork_capture or "auto", "qemu": qemu_version(),
           "counts": counts, "host_cpus": os.cpu_count(), **r}
    write_result("vm_lifecycle", out)


if __name__ == "__main__":
    main()
