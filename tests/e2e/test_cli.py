# SPDX-License-Identifier: AGPL-3.0-only
"""The dsec CLI: run, exec, ls, fork, rm, status, top, image build/ls/inspect/rm, --help."""

import json
import os
import subprocess
import time

from conftest import DATA, DSEC, dsec, leftovers

import pytest


def test_run_exec_ls_fork_rm():
    r = dsec("run", "--rm", "root/py:3.11", "--", "python3", "-c", "print(6*7)")
    assert r.stdout == "42\n"
    sid = dsec("run", "root/base", "--label", "cli=yes").stdout.strip()
    try:
        r = dsec("exec", sid, "--", "sh", "-c", "echo hi; exit 3", check=False)
        assert r.returncode == 3 and r.stdout == "hi\n"
        listed = json.loads(dsec("ls", "--label", "cli=yes", "--json").stdout)["sandboxes"]
        assert [s["id"] for s in listed] == [sid]
        assert sid in dsec("ls").stdout
        forks = dsec("fork", sid, "--count", "2").stdout.split()
        assert len(forks) == 2
        dsec("rm", *forks)
        r = dsec("set-timeout", sid, "120", "--json")
        assert json.loads(r.stdout)["id"] == sid
    finally:
        dsec("rm", sid)
    assert leftovers(sid) == []
    r = dsec("exec", sid, "--", "true", check=False)
    assert r.returncode == 1 and "not_found" in r.stderr


def test_status_shows_node_and_backend():
    s = json.loads(dsec("status", "--data-dir", str(DATA), "--json").stdout)
    node = s["nodes"][0]
    assert node["name"] == "local" and node["cpus"] >= 1
    container = [b for b in node["backends"] if b["name"] == "container"][0]
    assert container["available"], container
    human = dsec("status", "--data-dir", str(DATA)).stdout
    assert "container" in human and "local" in human


def test_image_build_inspect_run_and_rm(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(
        'name = "root/test-motd:1"\nfrom = "root/base"\nenv = { GREETING = "hello" }\n'
        '[[step]]\nfile = "/etc/motd"\ncontent = "built by a test\\n"\n'
        '[[step]]\nrun = "echo ran > /etc/ran-step"\n'
    )
    r = dsec("image", "build", str(spec), "--data-dir", str(DATA))
    assert "built root/test-motd:1" in r.stdout
    m = json.loads(dsec("image", "inspect", "root/test-motd:1", "--data-dir", str(DATA)).stdout)
    assert len(m["manifest"]["layers"]) == 3 and m["manifest"]["env"]["GREETING"] == "hello"
    assert "root/test-motd:1" in dsec("image", "ls", "--data-dir", str(DATA)).stdout
    r = dsec("run", "--rm", "root/test-motd:1", "--", "sh", "-c", "cat /etc/motd /etc/ran-step; echo $GREETING")
    assert r.stdout == "built by a test\nran\nhello\n"
    r = dsec("image", "rm", "root/test-motd:1", "--data-dir", str(DATA))
    assert "2 layers freed" in r.stdout
    r = dsec("image", "inspect", "root/test-motd:1", "--data-dir", str(DATA), check=False)
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = dsec("image", "inspect", "../../etc", "--data-dir", str(DATA), check=False)
    assert r.returncode == 1 and "not a valid image reference" in r.stderr


def test_status_fits_80_columns_unless_wide():
    s = json.loads(dsec("status", "--data-dir", str(DATA), "--json").stdout)
    details = [b["detail"] for n in s["nodes"] for b in n["backends"] if b["detail"]]
    narrow = dsec("status", "--data-dir", str(DATA)).stdout
    too_long = [line for line in narrow.splitlines() if len(line) > 80]
    assert too_long == [], too_long
    wide = dsec("status", "--data-dir", str(DATA), "--wide").stdout
    # Wide: each backend's detail whole on its line, however long.
    for d in details:
        assert any(d in line for line in wide.splitlines()), d
    assert max(len(d) for d in details) <= 60 or max(map(len, wide.splitlines())) > 80


def test_completion_scripts_for_each_shell():
    r = subprocess.run(["bash", "-c", f"source <({DSEC} completion bash) && complete -p dsec"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "-F _dsec dsec" in r.stdout, r.stderr
    assert dsec("completion", "zsh").stdout.startswith("#compdef dsec")
    fish = dsec("completion", "fish").stdout
    assert "complete -c dsec" in fish and "status" in fish
    r = dsec("completion", "nosh", check=False)
    assert r.returncode != 0 and "possible values" in r.stderr


@pytest.mark.parametrize("cmd", [[], ["up"], ["down"], ["status"], ["completion"], ["run"], ["exec"], ["ls"], ["rm"], ["fork"],
                                 ["set-timeout"], ["shell"], ["cp"], ["logs"], ["ps"], ["trajectory"], ["iam", "project-create"], ["iam", "key-create"], ["iam", "quota-set"], ["image", "build"], ["image", "ls"], ["image", "inspect"], ["image", "rm"],
                                 ["network"], ["top"], ["events"], ["serve"], ["certs", "init"], ["certs", "issue"], ["image", "vm-kernel"]])
def test_every_command_has_help_with_an_example(cmd):
    r = dsec(*cmd, "--help")
    assert "Example" in r.stdout, r.stdout


def test_run_with_allow_and_network_change():
    sid = dsec("run", "root/base", "--allow", "pypi", "--allow", "203.0.113.0/24:443").stdout.strip()
    try:
        info = json.loads(dsec("ls", "--json").stdout)["sandboxes"]
        mine = [s for s in info if s["id"] == sid][0]
        assert mine["network"]["rules"] == {"pypi": True, "203.0.113.0/24:443": True}
        r = dsec("network", sid, "--allow", "npm")
        assert "may reach npm" in r.stdout, r.stdout
        r = dsec("network", sid, "--json")
        assert json.loads(r.stdout)["rules"] == {}
        r = dsec("network", sid, "--allow", "pipy", check=False)
        assert r.returncode == 1 and 'unknown service name "pipy"' in r.stderr, r.stderr
        r = dsec("run", "root/base", "--network", "none", "--allow", "pypi", check=False)
        assert r.returncode == 1 and "none" in r.stderr, r.stderr
    finally:
        dsec("rm", sid)


def test_certs_make_a_ca_and_component_certificates(tmp_path):
    r = dsec("certs", "init", "--dir", str(tmp_path))
    assert "Created the cluster CA" in r.stdout
    assert "already holds a CA" in dsec("certs", "init", "--dir", str(tmp_path)).stdout
    assert oct((tmp_path / "ca.key").stat().st_mode & 0o777) == "0o600"
    r = dsec("certs", "issue", "--dir", str(tmp_path), "--role", "edge", "--name", "edge7", "--host", "10.0.0.7", "--json")
    out = json.loads(r.stdout)
    assert out["identity"] == "spiffe://opendsec/edge/edge7"
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", out["cert"]], capture_output=True, text=True)
    if text.returncode == 0:
        assert "IP Address:10.0.0.7" in text.stdout and "URI:spiffe://opendsec/edge/edge7" in text.stdout
    r = dsec("certs", "issue", "--dir", str(tmp_path), "--role", "king", "--name", "x", check=False)
    assert r.returncode != 0 and "iam, apiserver, watcher, edge" in r.stderr, r.stderr


def test_cp_shell_logs_ps_trajectory(tmp_path):
    sid = dsec("run", "root/py:3.11").stdout.strip()
    try:
        src = tmp_path / "up.bin"
        src.write_bytes(os.urandom(3 << 20))
        src.chmod(0o640)
        dsec("cp", str(src), f"{sid}:/root/up.bin")
        r = dsec("exec", sid, "--", "stat", "-c", "%s %a", "/root/up.bin")
        assert r.stdout == f"{3 << 20} 640\n"
        dsec("cp", f"{sid}:/root/up.bin", str(tmp_path / "down.bin"))
        assert (tmp_path / "down.bin").read_bytes() == src.read_bytes()
        r = dsec("cp", f"{sid}:/no/such", str(tmp_path / "x"), check=False)
        assert r.returncode == 1 and "not_found" in r.stderr and not (tmp_path / "x").exists()
        # A shell with piped input runs it and ends with its exit status.
        r = subprocess.run([DSEC, "shell", sid], input="cd /tmp; echo in-$(pwd); exit 4\n",
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "DSEC_CONFIG": str(DATA / "client.toml")})
        assert r.returncode == 4 and "in-/tmp" in r.stdout, r
        procs = json.loads(dsec("ps", sid, "--json").stdout)["processes"]
        shell = [p for p in procs if p["exit_code"] == 4]
        assert shell, procs
        r = dsec("logs", sid, str(shell[0]["pid"]), check=False)
        assert r.returncode == 4 and "in-/tmp" in r.stdout
        t = json.loads(dsec("trajectory", sid, "--json").stdout)["trajectories"]
        assert {"name": "default", "steps": 2} in t, t
        steps = json.loads(dsec("trajectory", sid, "default", "--json").stdout)["steps"]
        assert [s["kind"] for s in steps] == ["write_file", "exec"]
        assert "write_file" in dsec("trajectory", sid, "default").stdout
    finally:
        dsec("rm", sid)


def test_top_shows_what_each_sandbox_uses_and_only_the_keys_own():
    """`dsec top` (one GET /v1/usage): a sandbox spinning a core shows most of a core, an
    idle one next to nothing; another project's key sees neither."""
    import uuid

    from opendsec.sync import DSecClient, DSecRunArgs

    tag = uuid.uuid4().hex[:8]
    with DSecClient() as c:
        other = f"root/top-{tag}"
        c.create_project(other, sandboxes=2)
        okey = c.create_key("top", project=other, agent=True)["key"]
        busy = c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64, labels={"top": tag}))
        idle = c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=64, labels={"top": tag}))
        try:
            busy.exec_background(cmd="while :; do :; done", tag="spin")
            # Two readings after the spinning started (the node reads every 5 s by default).
            deadline = time.monotonic() + 40
            rows = {}
            while time.monotonic() < deadline:
                u = json.loads(dsec("top", "--once", "--json", "--label", f"top={tag}").stdout)
                rows = {s["id"]: s for s in u["sandboxes"]}
                if (rows.get(busy.id, {}).get("cpu_percent") or 0) > 50:
                    break
                time.sleep(1)
            assert set(rows) == {busy.id, idle.id}, rows
            assert rows[busy.id]["cpu_percent"] > 50, rows[busy.id]
            assert (rows[idle.id].get("cpu_percent") or 0) < 20, rows[idle.id]
            assert rows[busy.id]["memory_limit_bytes"] == 64 << 20
            assert 0 < rows[busy.id]["memory_used_bytes"] < 64 << 20
            # Sorted by CPU by default; the screen fits 80 columns.
            screen = dsec("top", "--once", "--label", f"top={tag}").stdout
            assert screen.index(busy.id) < screen.index(idle.id), screen
            assert all(len(line) <= 80 for line in screen.splitlines()), screen
            assert "2 sandboxes, 2 running" in screen, screen
            # Another project's key sees none of them.
            env = {"DSEC_API_URL": c.api_url, "DSEC_API_KEY": okey}
            theirs = json.loads(dsec("top", "--once", "--json", env=env).stdout)["sandboxes"]
            assert theirs == [], theirs
        finally:
            busy.stop()
            idle.stop()
