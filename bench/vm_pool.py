#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""A warm pool of `vm` sandboxes (`[[edge.pools]]` with `backend = "vm"`): its first member
boots and is saved, the rest are restored from the save. Prints, in one run: a cold `vm`
create -> first exec (a boot), how long the pool takes to make each member by restoring
(its refill after a batch is taken), and a create served by the pool -> first exec, next
to the floor: a raw QEMU restore of the same save, by hand (the command line a pool
member runs, the same QMP steps as the edge's: a `mapped-ram` load of the save the member
maps (QEMU 10), or x-ignore-shared and an `fd:` migration of the device state (older QEMU);
then `cont`), timed from starting QEMU to the guest running.

    python3 bench/vm_pool.py -n 4

QEMU runs under TCG on hosts without hardware virtualisation (the figures say which).
JSON goes to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchlib import configured_server, lat_summary, pool_ready, store_of, write_result  # noqa: E402
from opendsec import DSecClient, DSecRunArgs  # noqa: E402
from rawqemu import Netns, RawVm, scratch  # noqa: E402

POOL = "vms"
POOL_MB = 320


def args(memory: int = POOL_MB) -> DSecRunArgs:
    return DSecRunArgs(image="root/base", backend="vm", memory_limit_mb=memory)


async def wait_ready(c: DSecClient, n: int, timeout: float = 900) -> float:
    t0 = time.perf_counter()
    while await pool_ready(c, POOL) < n:
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"the pool did not reach {n} ready members in {timeout} s")
        await asyncio.sleep(0.05)
    return time.perf_counter() - t0


def member_commands() -> list[list[str]]:
    """The command lines of the QEMU processes restored from a save (pool members)."""
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            a = p.read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if a and b"qemu-system" in a[0] and b"-incoming" in a:
            out.append([x.decode() for x in a])
    return out


def raw_restore(cmd: list[str], seed: Path, netns: str) -> float:
    """Seconds from starting QEMU to the guest running again, restored from the pool's
    save `seed` over the memory file the member maps (`cmd` names it, and how), in a
    scratch directory and the network namespace `netns` (see rawqemu.RawVm); no host end
    of the channel, so "running" is QEMU's run state. The save is the device state `dev`
    (x-ignore-shared) or, with QEMU 10's `mapped` capture, the mapped-ram file itself."""
    opts = next(a for a in cmd if a.startswith("memory-backend-file,")).split(",")
    mem = Path(next(o for o in opts if o.startswith("mem-path=")).split("=", 1)[1])
    vm = RawVm(cmd, scratch("dsec-raw-restore-"), None, mem, share="share=on" in opts,
               incoming=True, netns=netns)
    t0 = time.perf_counter()
    try:
        vm.spawn()
        q = vm.connect()
        if (seed / "dev").exists():
            q.ignore_shared()
            q.load(seed / "dev")
        else:
            q.load_mapped(mem)
        q.call("cont")
        took = time.perf_counter() - t0
        q.call("quit")
        vm.p.wait(timeout=30)
        return took
    except (OSError, RuntimeError) as e:
        raise SystemExit(f"raw QEMU restore failed ({e})")
    finally:
        vm.close()


def raw_floor(cmd: list[str], seed: Path, n: int = 5) -> list[float]:
    """`raw_restore` n times in a network namespace of its own (removed after)."""
    with Netns(cmd, 1) as [netns]:
        return [raw_restore(cmd, seed, netns) for _ in range(n)]


async def bench(url: str, key: str, n: int, data: Path) -> dict:
    out: dict = {}
    async with DSecClient(api_url=url, api_key=key, timeout=600) as c:
        vm = [b for b in (await c.status())["nodes"][0]["backends"] if b["name"] == "vm"][0]
        out["vm_backend"] = vm["detail"]
        print(f"vm backend: {vm['detail']}", flush=True)
        out["first_fill_s"] = round(await wait_ready(c, n), 2)
        # Cold creates (another memory size, so the pool does not serve them).
        cold = []
        for _ in range(3):
            t0 = time.perf_counter()
            sb = await c.run_sandbox(args(POOL_MB + 16))
            await sb.exec(["true"])
            cold.append(time.perf_counter() - t0)
            await sb.stop()
        out["cold_create_to_first_exec"] = lat_summary(cold)
        # Creates served by the pool, one after another.
        pooled, handed, first, again, taken = [], [], [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await c.run_sandbox(args())
            t1 = time.perf_counter()
            await sb.exec(["true"])
            t2 = time.perf_counter()
            await sb.exec(["true"])
            pooled.append(t2 - t0)
            handed.append(t1 - t0)
            first.append(t2 - t1)
            again.append(time.perf_counter() - t2)
            assert sb.info.from_pool == POOL, sb.info
            taken.append(sb)
        out["pooled_create_to_first_exec"] = lat_summary(pooled)
        # Where it goes: the create's answer, the first exec, and a second exec (what an
        # exec of `true` costs in a running guest, which a restore by hand would pay too).
        out["pooled_create_answer"] = lat_summary(handed)
        out["pooled_first_exec"] = lat_summary(first)
        out["exec_in_running_vm"] = lat_summary(again)
        # The pool makes n members again, each restored from its save.
        refill = await wait_ready(c, n)
        out["refill_s"] = round(refill, 2)
        out["refill_per_member_ms"] = round(refill / n * 1000, 1)
        # The floor, while the pool's members run: the same save restored by hand.
        seeds = sorted(data.glob(f"edge/fork-tmp/pool-{POOL}-*/vm.json"))
        members = member_commands()
        if seeds and members:
            raw = raw_floor(members[0], seeds[0].parent)
            out["raw_qemu_restore_to_running"] = lat_summary(raw)
            out["pooled_over_raw_restore"] = round(
                out["pooled_create_to_first_exec"]["p50_ms"] / out["raw_qemu_restore_to_running"]["p50_ms"], 2)
        else:
            print(f"  no floor: seeds {seeds}, restored QEMU processes {len(members)}", flush=True)
        for sb in taken:
            await sb.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=4, help="the pool's size, and creates served from it")
    ap.add_argument("--data-dir", default="/var/tmp/dsec-vm-pool")
    ap.add_argument("--image-store", default=None, help="default: <data-dir>/images (built if missing)")
    ap.add_argument("--listen", default="127.0.0.1:7617")
    a = ap.parse_args()
    data = Path(a.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    store = store_of(data, a.image_store)
    config = (f'[[edge.pools]]\nname = "{POOL}"\nimage = "root/base"\nbackend = "vm"\n'
              f'memory_mb = {POOL_MB}\nsize = {a.n}\nrefill_per_second = 100\n')
    with configured_server(data, a.listen, store, config) as (url, key):
        out = {"bench": "vm_pool", "n": a.n, **asyncio.run(bench(url, key, a.n, data))}
    print(f"\nvm pool of {a.n} ({out['vm_backend']}):")
    print(f"  first fill (one boot, then restores): {out['first_fill_s']} s")
    c, p = out["cold_create_to_first_exec"], out["pooled_create_to_first_exec"]
    print(f"  cold create -> first exec (boot):     p50 {c['p50_ms']:.0f} ms")
    print(f"  pooled create -> first exec:          p50 {p['p50_ms']:.1f} ms, max {p['max_ms']:.1f} ms")
    print(f"    of which the create's answer:       p50 {out['pooled_create_answer']['p50_ms']:.1f} ms")
    print(f"    and the first exec:                 p50 {out['pooled_first_exec']['p50_ms']:.1f} ms")
    print(f"  an exec of `true` in a running VM:    p50 {out['exec_in_running_vm']['p50_ms']:.1f} ms")
    print(f"  refill, per member (a restore):       {out['refill_per_member_ms']} ms")
    if "raw_qemu_restore_to_running" in out:
        r = out["raw_qemu_restore_to_running"]
        print(f"  floor, raw QEMU restore of the save:  p50 {r['p50_ms']:.0f} ms (to running; "
              f"pooled/raw {out['pooled_over_raw_restore']})")
    write_result("vm_pool", out)


if __name__ == "__main__":
    main()
