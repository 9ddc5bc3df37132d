# SPDX-License-Identifier: AGPL-3.0-only
"""Host clean-up shared by the test harnesses that run their own nodes (cluster_harness,
netlab): find and remove what a crashed run can leave behind."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from pathlib import Path


def mountns_holders(base: Path) -> list[int]:
    """Live holders of the sandboxes' mount namespace of edges whose state is under `base`
    (the process named `dsec-mountns` each names in its `mountns.pid`, at the top of its
    state directory: `base/edge`, or `base/<host>/edge` for a harness of several). Not a
    recursive search: `base` may hold an image store of hundreds of thousands of files
    (shared into the nested harness over virtiofs, where each file looked up holds a
    descriptor of its daemon)."""
    pids = []
    pats = [f"{base}/mountns.pid", f"{base}/edge/mountns.pid", f"{base}/*/edge/mountns.pid"]
    for f in sorted({f for pat in pats for f in glob.glob(pat)}):
        try:
            pid = int(Path(f).read_text().split()[0])
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"dsec-mountns\0"):
                pids.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    return pids


def mounts_under(root: Path, pid: int | str = "self") -> list[str]:
    """Mount points at or below `root`, in the mount namespace of process `pid`."""
    out = []
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        mp = line.split()[4].encode().decode("unicode_escape")  # \040 etc.
        if mp == str(root) or mp.startswith(str(root) + "/"):
            out.append(mp)
    return out


def sandbox_cgroups(edges: list[str] | tuple[str, ...]) -> list[str]:
    """Cgroups of sandboxes of these edges (ids start with the edge's name), v1 or v2."""
    pats = [f"{root}/{d}/{e}-*" for e in edges for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/*")
            for d in ("dsec", "dsec/*")]
    return sorted({p for pat in pats for p in glob.glob(pat) if os.path.isdir(p)})


def kill_cgroup(path: str) -> None:
    """SIGKILLs everything in a cgroup tree, then removes it, innermost first."""
    kill = Path(path) / "cgroup.kill"
    if kill.exists():
        try:
            kill.write_text("1")
        except OSError:
            pass
    for _ in range(50):
        pids = []
        for d, _, _ in os.walk(path):
            try:
                pids += [int(p) for p in Path(d, "cgroup.procs").read_text().split()]
            except OSError:
                pass
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for d, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        try:
            os.rmdir(d)
        except OSError:
            pass


def netns_pids(ns: str) -> list[int]:
    """Processes running in network namespace `ns`."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def sweep(namespaces: list[str], cgroups: list[str], base: Path) -> list[str]:
    """Kills every process in `namespaces`, kills and removes `cgroups`, and unmounts
    everything under `base`; returns what it found."""
    found = []
    for ns in namespaces:
        for pid in netns_pids(ns):
            found.append(f"process {pid} in {ns}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for cg in cgroups:
        found.append(f"cgroup {cg}")
        kill_cgroup(cg)
    for mp in sorted(mounts_under(base), key=len, reverse=True):
        found.append(f"mount {mp}")
        subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
    # The sandboxes' mounts are in their own namespace, gone with its holder.
    for pid in mountns_holders(base):
        found += [f"mount {mp} (sandboxes' namespace)" for mp in mounts_under(base, pid)]
        found.append(f"mount namespace holder {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found
