# SPDX-License-Identifier: AGPL-3.0-only
"""The Go client (`sdk/go`): `go test ./...` run against this session's `dsec up`. Its
tests run the seed's example written in Go, a streamed exec with stdin and attach, a
100 MiB file round trip, typed errors for 400/401/404/429 and a lifecycle (sessions, pause,
network rules, snapshot, commit, events); `DSEC_GO_E2E=1` lets them run against the
configured API (this session's node, by `DSEC_CONFIG`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from conftest import ROOT
from opendsec.sync import DSecClient

GO_TESTS = {
    "TestSeedExample",
    "TestExecStreamsOutputWhileTheProcessRuns",
    "TestA100MiBFileGoesInAndOutWhole",
    "TestErrorsAreTyped",
    "TestLifecycleSessionsSnapshotsAndImages",
}


def go_binary() -> str:
    for cand in (shutil.which("go"), "/usr/local/go/bin/go", "/usr/lib/go-1.23/bin/go"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise AssertionError("no Go toolchain: deploy/deps.sh installs one")


def test_go_client_passes_its_tests_against_dsec_up():
    env = dict(os.environ, DSEC_GO_E2E="1", GOFLAGS="-mod=mod", GOPROXY="off", CGO_ENABLED="0")
    go = go_binary()
    env["PATH"] = os.path.dirname(go) + os.pathsep + env.get("PATH", "")
    r = subprocess.run([go, "test", "-count=1", "-v", "-timeout", "15m", "./..."], cwd=ROOT / "sdk/go",
                       env=env, capture_output=True, text=True, timeout=1000)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    passed = set(re.findall(r"^--- PASS: (\w+)", out, re.M))
    assert GO_TESTS <= passed, f"not passed: {GO_TESTS - passed}\n{out[-4000:]}"
    assert "--- SKIP" not in out, out
    for line in out.splitlines():
        if line.startswith("--- PASS"):
            print(line)
    with DSecClient() as c:
        left = [s.id for s in c.list_sandboxes() if "go-sdk-test" in s.labels]
    assert left == [], f"the Go tests left sandboxes: {left}"
