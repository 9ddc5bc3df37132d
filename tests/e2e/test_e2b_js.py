# SPDX-License-Identifier: AGPL-3.0-only
"""The E2B-compatible gateway from JavaScript: the released `e2b` npm package, unmodified,
runs the scenarios in js/scenarios.mjs against the gateway `dsec up` starts, configured only
by the three variables in <data-dir>/e2b.env, on both backends."""

import json
import os
import shutil
import subprocess

import pytest

from test_e2b import BACKENDS, PORT_SERVER, e2b_env, skip_unless_available

from conftest import E2B_JS_VERSION, JS


@pytest.fixture(scope="module")
def node_e2b():
    # conftest's session fixture ran `npm ci` (in the host's network namespace).
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed (deploy/deps.sh installs them)")
    installed = JS / "node_modules/e2b/package.json"
    assert json.loads(installed.read_text())["version"] == E2B_JS_VERSION


@pytest.mark.parametrize("template", BACKENDS)
def test_e2b_npm_package(node_e2b, template):
    skip_unless_available(template)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(e2b_env())
    env["PORT_SERVER"] = PORT_SERVER
    r = subprocess.run(["node", "scenarios.mjs", template], cwd=JS, env=env, capture_output=True,
                       text=True, timeout=900)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    done = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("ok ")]
    assert done == ["commands", "files", "metadata", "lifecycle", "snapshots", "parity", "volumes", "charts",
                    "ports", "metrics"]
