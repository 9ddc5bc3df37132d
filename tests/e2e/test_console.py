# SPDX-License-Identifier: AGPL-3.0-only
"""The web console (`/console`) in headless Chromium (Debian's `chromium`, driven by
`js/console.mjs` with playwright-core): a wrong key is refused, a project's key logs in and
sees its own sandbox only (a hostile label shown as text, no script run), a terminal runs
`echo hi`, the files, processes, events and projects views load, and every page carries a
Content-Security-Policy. The screenshots are kept in /var/tmp/dsec-console-shots."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import JS
from opendsec.sync import DSecClient, DSecRunArgs

SHOTS = Path("/var/tmp/dsec-console-shots")
HOSTILE = "<img src=x onerror=alert(document.domain)>"


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_console_logs_in_runs_a_terminal_and_shows_the_keys_view():
    chromium = shutil.which("chromium")
    if chromium is None or shutil.which("node") is None:
        pytest.fail("chromium and node are needed (deploy/deps.sh installs them)")
    assert (JS / "node_modules/playwright-core/package.json").exists(), "npm ci did not install playwright-core"
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    team = f"root/console-{uuid.uuid4().hex[:8]}"
    with DSecClient() as admin:
        admin.create_project(team, sandboxes=4)
        key = admin.create_key("console", project=team)["key"]
        other = admin.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=600))
        with DSecClient(api_key=key) as c:
            sb = c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64, ttl_seconds=600,
                                           labels={"note": HOSTILE}))
            try:
                r = subprocess.run(["node", "console.mjs", admin.api_url, key, sb.id, str(SHOTS)], cwd=JS,
                                   env=dict(os.environ, CHROMIUM=chromium), capture_output=True, text=True,
                                   timeout=300)
                assert r.returncode == 0, r.stderr[-4000:]
                res = json.loads(r.stdout.strip().splitlines()[-1])
                assert "failure" not in res, (res["failure"] + "\n" + res.get("failureText", "")[-3000:]
                                              + "\n" + r.stderr[-2000:])
                # A wrong key gets a sentence, not the console.
                assert "not valid" in res["wrongKey"]
                # The key's sandbox is listed; the admin's is not.
                assert sb.id in res["rowText"] and other.id not in json.dumps(res)
                # The hostile label is text: escaped in the DOM, no dialog, no script error.
                assert "&lt;img" in res["labelHtml"], res["labelHtml"]
                assert res["dialogs"] == [] and res["errors"] == [], (res["dialogs"], res["errors"])
                # The terminal ran the command in the sandbox.
                lines = [ln.strip() for ln in res["terminal"].splitlines()]
                assert "hi" in lines and "Linux" in lines, res["terminal"]
                assert res["cwd"] == "/etc"
                assert any("console" in p for p in res["processes"]), res["processes"]
                assert any("created" in e for e in res["events"]), res["events"]
                assert "default-src 'none'" in res["csp"] and "frame-ancestors 'none'" in res["csp"]
                # Seven screenshots, each a full 1280x800 page.
                names = sorted(Path(p).name for p in res["shots"])
                assert names == sorted(f"{n}.png" for n in ("login-refused", "sandboxes", "terminal", "files",
                                                            "processes", "events", "projects")), names
                for p in res["shots"]:
                    assert png_size(Path(p)) == (1280, 800), p
                    assert Path(p).stat().st_size > 8000, f"{p} looks blank"
            finally:
                sb.stop()
                other.stop()
