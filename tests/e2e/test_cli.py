# SPDX-License-Identifier: AGPL-3.0-only
"""The dsec CLI: run, exec, ls, fork, rm, status, image build/ls/inspect/rm, --help."""

import json

from conftest import DATA, dsec, leftovers

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
        'name = "test/motd:1"\nfrom = "root/base"\nenv = { GREETING = "hello" }\n'
        '[[step]]\nfile = "/etc/motd"\ncontent = "built by a test\\n"\n'
        '[[step]]\nrun = "echo ran > /etc/ran-step"\n'
    )
    r = dsec("image", "build", str(spec), "--data-dir", str(DATA))
    assert "built test/motd:1" in r.stdout
    m = json.loads(dsec("image", "inspect", "test/motd:1", "--data-dir", str(DATA)).stdout)
    assert len(m["manifest"]["layers"]) == 3 and m["manifest"]["env"]["GREETING"] == "hello"
    assert "test/motd:1" in dsec("image", "ls", "--data-dir", str(DATA)).stdout
    r = dsec("run", "--rm", "test/motd:1", "--", "sh", "-c", "cat /etc/motd /etc/ran-step; echo $GREETING")
    assert r.stdout == "built by a test\nran\nhello\n"
    r = dsec("image", "rm", "test/motd:1", "--data-dir", str(DATA))
    assert "2 layers freed" in r.stdout
    r = dsec("image", "inspect", "test/motd:1", "--data-dir", str(DATA), check=False)
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = dsec("image", "inspect", "../../etc", "--data-dir", str(DATA), check=False)
    assert r.returncode == 1 and "not a valid image reference" in r.stderr


@pytest.mark.parametrize("cmd", [[], ["up"], ["down"], ["status"], ["run"], ["exec"], ["ls"], ["rm"], ["fork"],
                                 ["set-timeout"], ["image", "build"], ["image", "ls"], ["image", "inspect"], ["image", "rm"]])
def test_every_command_has_help_with_an_example(cmd):
    r = dsec(*cmd, "--help")
    assert "Example" in r.stdout, r.stdout
