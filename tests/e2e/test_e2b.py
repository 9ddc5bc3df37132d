# SPDX-License-Identifier: AGPL-3.0-only
"""The E2B-compatible gateway: the released `e2b` Python SDK, unmodified, against the gateway
`dsec up` starts, configured only by the three variables it writes to <data-dir>/e2b.env."""

import importlib
import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from conftest import DATA, dsec

# The SDK release these tests pin (deploy/deps.sh installs the same).
E2B_VERSION = "2.63.0"


def e2b_env() -> dict[str, str]:
    env = {}
    for line in (DATA / "e2b.env").read_text().splitlines():
        k, _, v = line.partition("=")
        if k:
            env[k] = v
    return env


def pip_pinned(dist: str, want: str) -> None:
    """Installs `dist` at version `want` unless it is installed already."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(dist)
    except PackageNotFoundError:
        installed = None
    if installed != want:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"{dist}=={want}"], check=True, timeout=600)
        importlib.invalidate_caches()
    assert version(dist) == want, f"tests pin {dist} {want}, found {version(dist)}"


@pytest.fixture(scope="module")
def e2b():
    pip_pinned("e2b", E2B_VERSION)
    import e2b as mod

    env = e2b_env()
    assert set(env) == {"E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL", "E2B_API_KEY"}
    # E2B's key shape, which wrappers around its SDK check before they send anything
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", env["E2B_API_KEY"]), env["E2B_API_KEY"]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield mod
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# The same scenarios on each backend: `base` runs as a container, `base-vm` (the same
# image) as a virtual machine, `base-microvm` as a Firecracker microVM (skipped where the
# node has no hardware KVM; `make test-nested` runs it); all are in the gateway's default
# template map.
BACKENDS = [pytest.param("base", id="container"), pytest.param("base-vm", id="vm"),
            pytest.param("base-microvm", id="microvm")]


def skip_unless_available(template: str) -> None:
    """Skips a test of a `-microvm` template on a node whose microvm backend is unavailable."""
    if template.endswith("-microvm"):
        import json
        st = json.loads(dsec("status", "--data-dir", str(DATA), "--json").stdout)
        nodes = st.get("nodes") or [st]
        mv = [b for n in nodes for b in n.get("backends", []) if b["name"] == "microvm"]
        if not mv or not mv[0]["available"]:
            pytest.skip(f"skipped: the microvm backend is unavailable: {mv[0]['detail'] if mv else 'not reported'}")


@pytest.fixture(params=BACKENDS)
def template(request):
    skip_unless_available(request.param)
    return request.param


@pytest.fixture
def sandbox(e2b, template):
    sb = e2b.Sandbox.create(template, timeout=120)
    yield sb
    sb.kill()


def test_create_run_and_exit_codes(e2b, template):
    sb = e2b.Sandbox.create(template, metadata={"suite": "e2b"}, envs={"FROM_CREATE": "c1"})
    try:
        assert sb.is_running()
        r = sb.commands.run("echo hi")
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "", 0)
        r = sb.commands.run("echo $FROM_CREATE $PER_CMD; echo oops >&2; pwd",
                            envs={"PER_CMD": "p2"}, cwd="/tmp")
        assert r.stdout == "c1 p2\n/tmp\n" and r.stderr == "oops\n"
        with pytest.raises(e2b.CommandExitException) as ei:
            sb.commands.run("echo partial; exit 3")
        assert ei.value.exit_code == 3 and ei.value.stdout == "partial\n"
        # E2B's default user `user` (uid 1000), at home: relative paths and working
        # directories are under its home, and what it writes is its own
        assert sb.commands.run("whoami; id -u; pwd; echo $HOME").stdout == "user\n1000\n/home/user\n/home/user\n"
        assert sb.files.write("a.txt", "mine").path == "/home/user/a.txt"
        sb.files.write("sub/dir/b.txt", "x")
        assert sb.files.make_dir("made") is True
        r = sb.commands.run("stat -c %U a.txt sub sub/dir sub/dir/b.txt made; cat a.txt")
        assert r.stdout == "user\nuser\nuser\nuser\nuser\nmine", r.stdout
        assert sb.commands.run("pwd", cwd="sub").stdout == "/home/user/sub\n"
        assert sb.commands.run("python --version").stdout.startswith("Python 3")
        assert sb.commands.run("node -v").stdout.startswith("v")
        # the user writes only where it may; root anywhere
        with pytest.raises(e2b.SandboxException):
            sb.files.write("/etc/owned-by-user", "x")
        assert sb.files.write("/etc/owned-by-root", "x", user="root").path == "/etc/owned-by-root"
        assert sb.commands.run("stat -c %U /etc/owned-by-root; test -e /etc/owned-by-user || echo no").stdout == "root\nno\n"
        # other users: root or any user of the image
        assert sb.commands.run("whoami", user="root").stdout == "root\n"
        assert sb.commands.run("whoami; echo $HOME", user="nobody").stdout.startswith("nobody\n")
        # stdin is closed unless asked for: `cat` returns at once
        assert sb.commands.run("cat", timeout=10).stdout == ""
        seen = []
        sb.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
        assert "".join(seen) == "1\n2\n3\n"
        # a command over its timeout ends with the SDK's timeout exception
        with pytest.raises(e2b.TimeoutException):
            sb.commands.run("sleep 30", timeout=1)
    finally:
        assert sb.kill() is True


def test_background_stdin_and_kill(sandbox, e2b):
    h = sandbox.commands.run("read line; echo got $line", background=True, stdin=True)
    assert h.pid > 0
    sandbox.commands.send_stdin(h.pid, "abc\n")
    assert h.wait().stdout == "got abc\n"
    h = sandbox.commands.run("sleep 1000", background=True, timeout=0)
    assert h.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(e2b.CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    assert sandbox.commands.kill(999999) is False
    # a process that has ended: False as well, not an error
    ended = sandbox.commands.run("true", background=True)
    ended.wait()
    assert sandbox.commands.kill(ended.pid) is False
    # a client that goes away does not end the process; another attaches to it
    h = sandbox.commands.run("sleep 1; echo late", background=True)
    h.disconnect()
    assert sandbox.commands.connect(h.pid).wait().stdout == "late\n"
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.stream_input(h.pid, iter([b"a", b"b\n"]))
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "ab\n"
    out = []
    pty = sandbox.pty.create(e2b.PtySize(rows=24, cols=80))
    sandbox.pty.resize(pty.pid, e2b.PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(pty.pid, b"stty size; exit\n")
    assert pty.wait(on_pty=out.append).exit_code == 0
    assert b"30 100" in b"".join(out)
    # another client connects to a running terminal and gets its output
    term = sandbox.pty.create(e2b.PtySize(rows=24, cols=80))
    term.disconnect()
    seen = []
    again = sandbox.pty.connect(term.pid)
    sandbox.pty.send_stdin(term.pid, b"echo via-$((40+2)); exit\n")
    assert again.wait(on_pty=seen.append).exit_code == 0
    assert b"via-42" in b"".join(seen)


def test_files_and_filesystem(sandbox, e2b):
    info = sandbox.files.write("/tmp/e2b/a.txt", "hello file")
    assert info.path == "/tmp/e2b/a.txt" and info.name == "a.txt"
    assert sandbox.files.read("/tmp/e2b/a.txt") == "hello file"
    data = bytes(range(256)) * 1000
    sandbox.files.write("/tmp/e2b/b.bin", data)
    assert bytes(sandbox.files.read("/tmp/e2b/b.bin", format="bytes")) == data
    written = sandbox.files.write_files([
        {"path": "/tmp/e2b/multi/one.txt", "data": "1"},
        {"path": "/tmp/e2b/multi/two.txt", "data": b"2"},
    ])
    assert sorted(w.path for w in written) == ["/tmp/e2b/multi/one.txt", "/tmp/e2b/multi/two.txt"]
    assert sandbox.commands.run("cat /tmp/e2b/multi/one.txt /tmp/e2b/multi/two.txt").stdout == "12"
    # a file object goes as a raw (octet-stream) body, streamed: no size limit
    import hashlib
    import io

    big = os.urandom(1 << 20) * 80
    sandbox.files.write("/tmp/e2b/big.bin", io.BytesIO(big))
    r = sandbox.commands.run("sha256sum /tmp/e2b/big.bin; rm /tmp/e2b/big.bin")
    assert r.stdout.split()[0] == hashlib.sha256(big).hexdigest()
    # bytes go as multipart/form-data, which streams through too: a 100 MiB upload
    big = os.urandom(1 << 20) * 100
    sandbox.files.write("/tmp/e2b/big.bin", big, use_octet_stream=False)
    r = sandbox.commands.run("sha256sum /tmp/e2b/big.bin; rm /tmp/e2b/big.bin")
    assert r.stdout.split()[0] == hashlib.sha256(big).hexdigest()
    del big
    # gzip uploads (octet-stream) are unpacked before they are written
    sandbox.files.write("/tmp/e2b/gz.txt", "zipped", gzip=True)
    assert sandbox.files.read("/tmp/e2b/gz.txt") == "zipped"

    assert sandbox.files.exists("/tmp/e2b/a.txt")
    assert not sandbox.files.exists("/tmp/e2b/missing")
    st = sandbox.files.get_info("/tmp/e2b/a.txt")
    assert st.type == e2b.FileType.FILE and st.size == 10 and st.path == "/tmp/e2b/a.txt"
    names = sorted(e.name for e in sandbox.files.list("/tmp/e2b"))
    assert names == ["a.txt", "b.bin", "gz.txt", "multi"]
    deep = sorted(e.path for e in sandbox.files.list("/tmp/e2b", depth=2))
    assert "/tmp/e2b/multi/one.txt" in deep
    assert sandbox.files.make_dir("/tmp/e2b/newdir") is True
    assert sandbox.files.make_dir("/tmp/e2b/newdir") is False
    moved = sandbox.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/newdir/c.txt")
    assert moved.path == "/tmp/e2b/newdir/c.txt"
    assert sandbox.files.read("/tmp/e2b/newdir/c.txt") == "hello file"
    sandbox.files.remove("/tmp/e2b/newdir")
    assert not sandbox.files.exists("/tmp/e2b/newdir")
    sandbox.files.remove("/tmp/e2b/never-there")  # removing a missing path succeeds

    # `..` cannot leave the sandbox: the path resolves inside its own filesystem
    import socket

    inside = sandbox.commands.run("cat /etc/hostname").stdout
    assert sandbox.files.read("/../../../../etc/hostname") == inside
    assert sandbox.files.read("/tmp/../../etc/hostname") == inside
    assert inside.strip() != socket.gethostname()
    with pytest.raises(e2b.FileNotFoundException):
        sandbox.files.read("/tmp/e2b/missing")
    with pytest.raises(e2b.FileNotFoundException):
        sandbox.files.get_info("/tmp/e2b/missing")
    with pytest.raises(e2b.InvalidArgumentException):
        sandbox.files.list("/tmp/e2b/b.bin")


def test_signed_file_urls(sandbox):
    """`download_url()`/`upload_url()` work without any header (as from a browser): the
    signature opens them, for one path and operation, until it expires."""
    import time

    import httpx

    sandbox.files.write("/tmp/s/a.txt", "signed")
    url = sandbox.download_url("/tmp/s/a.txt")
    assert "signature=v1_" in url
    assert httpx.get(url).text == "signed"
    # the signature covers path and operation
    assert httpx.get(url.replace("a.txt", "b.txt")).status_code == 401
    up = sandbox.upload_url("/tmp/s/up.bin")
    r = httpx.post(up, files={"file": ("up.bin", b"\x00uploaded")})
    assert r.status_code == 200, r.text
    assert sandbox.commands.run("cat /tmp/s/up.bin").stdout == "\x00uploaded"
    assert httpx.post(url, files={"file": ("a.txt", b"x")}).status_code == 401  # a read URL
    # an expired signature
    old = sandbox.download_url("/tmp/s/a.txt", use_signature_expiration=1)
    time.sleep(2.1)
    assert httpx.get(old).status_code == 401
    fresh = sandbox.download_url("/tmp/s/a.txt", use_signature_expiration=60)
    assert httpx.get(fresh).text == "signed"
    # a wrong header token is refused even with a valid signature
    assert httpx.get(url, headers={"X-Access-Token": "0" * 64,
                                   "E2b-Sandbox-Id": sandbox.sandbox_id}).status_code == 401


def test_watch_dir(sandbox, e2b):
    import time

    sandbox.files.make_dir("/tmp/w/sub")
    w = sandbox.files.watch_dir("/tmp/w", recursive=True)
    sandbox.files.write("/tmp/w/a.txt", "1")
    sandbox.commands.run("echo x > /tmp/w/sub/inner.txt; rm /tmp/w/a.txt")
    seen = []
    for _ in range(50):
        seen += [(e.name, e.type) for e in w.get_new_events()]
        if ("a.txt", e2b.FilesystemEventType.REMOVE) in seen:
            break
        time.sleep(0.1)
    assert ("a.txt", e2b.FilesystemEventType.CREATE) in seen
    assert ("sub/inner.txt", e2b.FilesystemEventType.CREATE) in seen
    assert ("a.txt", e2b.FilesystemEventType.REMOVE) in seen
    w.stop()
    with pytest.raises(e2b.FileNotFoundException):
        sandbox.files.watch_dir("/tmp/w/missing")


def test_file_metadata_and_entries_in_watch_events(sandbox, e2b, template):
    """envd 0.6.2-0.6.4 as the SDK gates them: metadata on uploads, kept as `user.e2b.*`
    extended attributes (shown by get_info and list, kept by a rename, cleared by an
    overwrite, read from attributes set inside), and watch events with their entries."""
    import time

    import httpx
    from packaging.version import Version

    assert sandbox._envd_version >= Version("0.6.4")
    info = sandbox.files.write("meta/a.txt", "x", metadata={"owner": "team-a", "Stage": "raw 1"})
    want = {"owner": "team-a", "stage": "raw 1"}
    assert info.path == "/home/user/meta/a.txt" and info.metadata == want, info
    assert sandbox.files.get_info("meta/a.txt").metadata == want
    assert [e.metadata for e in sandbox.files.list("meta") if e.name == "a.txt"] == [want]
    # In the file itself, as extended attributes: `user.e2b.*`, or `trusted.e2b.*` where the
    # filesystem keeps no user attributes (a VM's writable tmpfs, on the guest's Linux 6.1).
    r = sandbox.commands.run("python3 -c \"import os; print(sorted(os.listxattr('/home/user/meta/a.txt')))\"",
                             user="root")
    prefix = "trusted.e2b." if "trusted.e2b." in r.stdout else "user.e2b."
    assert r.stdout.strip() == str([f"{prefix}owner", f"{prefix}stage"]), r
    assert prefix == "user.e2b." or template.endswith("-vm"), "a container's files keep user attributes"
    moved = sandbox.files.rename("meta/a.txt", "meta/b.txt")
    assert moved.metadata == want and sandbox.files.get_info("meta/b.txt").metadata == want
    # An overwrite without metadata clears it; one with metadata replaces it.
    sandbox.files.write("meta/b.txt", "y")
    assert sandbox.files.get_info("meta/b.txt").metadata is None
    sandbox.files.write_files([{"path": "meta/c.txt", "data": "z"}], metadata={"k": "v"})
    assert sandbox.files.get_info("meta/c.txt").metadata == {"k": "v"}
    # Set inside the sandbox (as an image's files would have it): read back.
    sandbox.commands.run(f"python3 -c \"import os; os.setxattr('/home/user/meta/b.txt', '{prefix}source', b'img')\"",
                         user="root")
    assert sandbox.files.get_info("meta/b.txt").metadata == {"source": "img"}
    # The gateway checks what the SDK does not: too many keys, a value that is not ASCII.
    with pytest.raises(e2b.InvalidArgumentException):
        sandbox.files.write("meta/d.txt", "x", metadata={f"k{i}": "v" for i in range(65)})
    url = sandbox.upload_url("meta/d.txt")
    r = httpx.post(url, content=b"x", headers={"Content-Type": "application/octet-stream",
                                               "X-Metadata-k": "caf\u00e9".encode("latin-1")})
    assert r.status_code == 400 and "US-ASCII" in r.text, r.text
    assert not sandbox.files.exists("meta/d.txt"), "a refused upload wrote its file"

    # Watch events with their entries (none for a removal).
    w = sandbox.files.watch_dir("meta", include_entry=True, allow_network_mounts=True)
    sandbox.files.write("meta/e.txt", "12345")
    sandbox.files.remove("meta/c.txt")
    seen = {}
    for _ in range(50):
        for e in w.get_new_events():
            seen.setdefault((e.name, e.type), e)
        if ("c.txt", e2b.FilesystemEventType.REMOVE) in seen:
            break
        time.sleep(0.1)
    w.stop()
    created = seen[("e.txt", e2b.FilesystemEventType.CREATE)]
    assert created.entry is not None and created.entry.path == "/home/user/meta/e.txt", created
    assert created.entry.type == e2b.FileType.FILE
    assert seen[("c.txt", e2b.FilesystemEventType.REMOVE)].entry is None


def test_list_connect_timeout_and_kill(e2b, template):
    tag = uuid.uuid4().hex[:8]
    a = e2b.Sandbox.create(template, metadata={"run": tag, "role": "a"})
    b = e2b.Sandbox.create(template, metadata={"run": tag, "role": "b"})
    try:
        from e2b import SandboxQuery

        ids = {s.sandbox_id for s in e2b.Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()}
        assert ids == {a.sandbox_id, b.sandbox_id}
        only = e2b.Sandbox.list(query=SandboxQuery(metadata={"run": tag, "role": "b"})).next_items()
        assert [s.sandbox_id for s in only] == [b.sandbox_id]
        assert only[0].metadata == {"run": tag, "role": "b"} and only[0].template_id == template
        pager = e2b.Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=1)
        first = pager.next_items()
        assert len(first) == 1 and pager.has_next
        assert len(pager.next_items()) == 1

        c = e2b.Sandbox.connect(a.sandbox_id)
        assert c.sandbox_id == a.sandbox_id
        assert c.commands.run("echo via connect").stdout == "via connect\n"

        before = a.get_info().end_at
        a.set_timeout(600)
        after = a.get_info().end_at
        assert (after - before).total_seconds() > 300
        a.set_timeout(30)
        assert (a.get_info().end_at - before).total_seconds() < 0

        assert e2b.Sandbox.kill(b.sandbox_id) is True
        assert e2b.Sandbox.kill(b.sandbox_id) is False
        assert not b.is_running()
        with pytest.raises(e2b.SandboxNotFoundException):
            e2b.Sandbox.connect(b.sandbox_id)
        with pytest.raises(e2b.NotFoundException):
            e2b.Sandbox.get_info(b.sandbox_id)
        ids = {s.sandbox_id for s in e2b.Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()}
        assert ids == {a.sandbox_id}
        # expiry: a sandbox past its timeout is gone
        import time

        a.set_timeout(1)
        for _ in range(150):
            if not a.is_running():
                break
            time.sleep(0.1)
        assert not a.is_running()
        with pytest.raises(e2b.SandboxNotFoundException):
            e2b.Sandbox.connect(a.sandbox_id)
    finally:
        a.kill()
        b.kill()


def test_fork_and_snapshots(e2b, template):
    """`fork(count=)`, `create_snapshot(name=)`, `list_snapshots` (all, per sandbox, by
    name, paged), `Sandbox.create(<snapshot id or name>)` and `delete_snapshot`, on
    OpenDsec's fork and snapshots."""
    sb = e2b.Sandbox.create(template, timeout=300, metadata={"suite": "fork"})
    made = []
    snaps = []
    try:
        sb.files.write("state.txt", "before")
        forks = sb.fork(count=2, timeout=120)
        made += [f for f in forks if isinstance(f, e2b.Sandbox)]
        assert len(forks) == 2 and all(isinstance(f, e2b.Sandbox) for f in forks), forks
        assert len({f.sandbox_id for f in forks} | {sb.sandbox_id}) == 3
        for f in forks:
            assert f.files.read("state.txt") == "before"
            f.files.write("state.txt", f.sandbox_id)
        assert sb.is_running() and sb.files.read("state.txt") == "before"
        assert [f.files.read("state.txt") for f in forks] == [f.sandbox_id for f in forks]
        # fork() with no count makes one; on the VM backends with the source's memory,
        # so a process the source runs runs in the copy too.
        sb.commands.run("sleep 1000", background=True)
        one = sb.fork(timeout=120)
        made += [f for f in one if isinstance(f, e2b.Sandbox)]
        assert len(one) == 1 and isinstance(one[0], e2b.Sandbox), one
        count = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
                 " | grep -c '^sleep 1000' || true")
        memory = template != "base"
        assert one[0].commands.run(count).stdout.strip() == ("1" if memory else "0")

        name = f"snap-{uuid.uuid4().hex[:8]}"
        info = sb.create_snapshot(name=name)
        snaps.append(info.snapshot_id)
        assert info.snapshot_id and info.names == [name], info
        sb.files.write("state.txt", "after")
        other = sb.create_snapshot()
        snaps.append(other.snapshot_id)
        assert sb.is_running()

        ids = lambda p: [s.snapshot_id for s in p.next_items()]  # noqa: E731
        assert {info.snapshot_id, other.snapshot_id} <= set(ids(e2b.Sandbox.list_snapshots()))
        assert set(ids(sb.list_snapshots())) == {info.snapshot_id, other.snapshot_id}
        assert ids(e2b.Sandbox.list_snapshots(name=name)) == [info.snapshot_id]
        page = sb.list_snapshots(limit=1)
        first = ids(page)
        assert len(first) == 1 and page.has_next
        assert len(set(first + ids(page))) == 2 and not page.has_next

        by_id = e2b.Sandbox.create(info.snapshot_id, timeout=120)
        made.append(by_id)
        by_name = e2b.Sandbox.create(name, timeout=120)
        made.append(by_name)
        for r in (by_id, by_name):
            assert r.files.read("state.txt") == "before"
            assert r.commands.run("whoami").stdout == "user\n"
        assert e2b.Sandbox.create(other.snapshot_id, timeout=60).files.read("state.txt") == "after"

        assert e2b.Sandbox.delete_snapshot(info.snapshot_id) is True
        assert e2b.Sandbox.delete_snapshot(info.snapshot_id) is False
        assert ids(e2b.Sandbox.list_snapshots(name=name)) == []
    finally:
        for m in made:
            m.kill()
        for s in snaps:
            e2b.Sandbox.delete_snapshot(s)
        sb.kill()
        for x in e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "fork"})).next_items():
            e2b.Sandbox.kill(x.sandbox_id)


def test_update_network_replaces_the_rules(sandbox, e2b):
    """`update_network` replaces a running sandbox's egress rules at once (allowed entries
    win over denied ones; DNS servers opened as E2B opens them); what the gateway cannot
    do is refused, not ignored."""
    import json

    def rules() -> dict:
        out = json.loads(dsec("ls", "--json").stdout)
        rows = out["sandboxes"] if isinstance(out, dict) else out
        return next(r for r in rows if r["id"] == sandbox.sandbox_id)["network"]["rules"]

    sandbox.update_network({"allow_out": ["203.0.113.7", "198.51.100.0/24"], "deny_out": ["203.0.113.7"]})
    assert rules() == {"203.0.113.7": True, "198.51.100.0/24": True}
    sandbox.update_network({"deny_out": ["0.0.0.0/0"]})
    assert rules() == {"0.0.0.0/0": False}
    sandbox.update_network({})
    assert rules() == {}
    # DNS servers are opened when allow_out names a domain, and only then.
    sandbox.update_network({"allow_out": ["203.0.113.7"], "dns_servers": ["1.1.1.1"]})
    assert rules() == {"203.0.113.7": True}
    sandbox.update_network({"allow_out": ["example.com"], "dns_servers": ["1.1.1.1"]})
    assert rules() == {"example.com": True, "1.1.1.1": True}
    sandbox.update_network({"allow_out": ["example.com"]})
    assert rules() == {"example.com": True, "8.8.8.8": True}
    sandbox.update_network({})
    with pytest.raises(e2b.SandboxException, match="dnsServers"):
        sandbox.update_network({"allow_out": ["example.com"], "dns_servers": ["dns.example.com"]})
    # An egress proxy of the caller's is refused, not ignored (as E2B's open-source
    # deployment does)
    with pytest.raises(e2b.SandboxException, match="egressProxy"):
        sandbox.update_network({"allow_out": ["203.0.113.7"], "egress_proxy": {"address": "proxy.example.com:1080"}})
    assert rules() == {}
    # a rule the node refuses (another sandbox's range) leaves the rules as they were
    with pytest.raises(e2b.SandboxException):
        sandbox.update_network({"allow_out": ["10.200.0.0/16"]})
    assert rules() == {}
    # Header rules are checked before anything is made: a header that frames the request
    # is refused at create, and nothing is made.
    before = {x.sandbox_id for x in e2b.Sandbox.list().next_items()}
    with pytest.raises(Exception, match="Content-Length"):
        e2b.Sandbox.create("base", timeout=60, network={
            "allow_out": ["api.example.com"],
            "rules": {"api.example.com": [{"transform": {"headers": {"Content-Length": "1"}}}]}})
    assert {x.sandbox_id for x in e2b.Sandbox.list().next_items()} == before


def test_list_order_started_after_and_template(e2b, template):
    """Listing: `order`, `started_after` and the `template` filter, with the pages, which
    run across running and paused sandboxes alike."""
    import datetime
    import time

    tag = uuid.uuid4().hex[:8]
    other = template.replace("base", "code-interpreter-v1")  # the same backend
    made = []
    try:
        first = e2b.Sandbox.create(template, metadata={"lt": tag}, timeout=300)
        made.append(first)
        time.sleep(0.05)
        cut = datetime.datetime.now(datetime.timezone.utc)
        time.sleep(0.05)
        second = e2b.Sandbox.create(other, metadata={"lt": tag}, timeout=300)
        made.append(second)
        third = e2b.Sandbox.create(template, metadata={"lt": tag}, timeout=300)
        made.append(third)
        third.pause()

        def ids(order=None, **q):
            p = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"lt": tag}, **q), order=order, limit=1)
            out = []
            while p.has_next:
                out += [s.sandbox_id for s in p.next_items()]
            return out

        a, b, c = first.sandbox_id, second.sandbox_id, third.sandbox_id
        both = [e2b.SandboxState.RUNNING, e2b.SandboxState.PAUSED]
        assert ids(state=both) == [a, b, c] and ids("asc", state=both) == [a, b, c]
        assert ids("desc", state=both) == [c, b, a]
        assert ids(state=[e2b.SandboxState.RUNNING]) == [a, b]
        assert ids(state=[e2b.SandboxState.PAUSED]) == [c]
        assert ids(started_after=cut, state=both) == [b, c]
        assert ids(template=template, state=both) == [a, c]
        assert ids(template=other, state=both) == [b]
        assert ids(template="no-such-template", state=both) == []
    finally:
        for m in made:
            e2b.Sandbox.kill(m.sandbox_id)


@pytest.mark.parametrize("on_timeout", ["pause", {"action": "pause", "mode": "filesystem"}],
                         ids=["full", "filesystem"])
def test_on_timeout_pause_and_connect_resumes(e2b, template, on_timeout):
    """`lifecycle={"on_timeout": "pause"}`: at its timeout the sandbox is paused, not
    killed; `connect` resumes it with its files, and its processes unless the pause was
    filesystem-only (a VM's memory is on its disk then, so they live on)."""
    import time

    vm = template != "base"  # a guest takes seconds to boot under emulation
    sb = e2b.Sandbox.create(template, timeout=15 if vm else 3, lifecycle={"on_timeout": on_timeout})
    try:
        sb.files.write("kept.txt", "yes")
        sb.commands.run("sleep 1000", background=True)
        end = time.monotonic() + (60 if vm else 20)
        while (st := e2b.Sandbox.get_info(sb.sandbox_id).state) != e2b.SandboxState.PAUSED and time.monotonic() < end:
            time.sleep(0.2)
        assert st == e2b.SandboxState.PAUSED, st
        c = e2b.Sandbox.connect(sb.sandbox_id, timeout=60)
        assert c.get_info().state == e2b.SandboxState.RUNNING
        assert c.files.read("kept.txt") == "yes"
        r = c.commands.run("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true")
        assert r.stdout.strip() == ("1" if on_timeout == "pause" or template.endswith("-vm") else "0"), r
    finally:
        e2b.Sandbox.kill(sb.sandbox_id)


def test_a_request_to_its_port_wakes_an_auto_resume_sandbox(e2b, template):
    """`lifecycle={"on_timeout": "pause", "auto_resume": True}`: paused at its timeout, the
    sandbox is resumed by the next request to one of its ports, which its server (frozen
    with it, not restarted) answers. Without `auto_resume` a paused sandbox's port is
    not reached."""
    import time

    import httpx

    url = e2b_env()["E2B_SANDBOX_URL"]
    ttl = 6 if template == "base" else 25  # a guest takes seconds to boot under emulation
    sb = e2b.Sandbox.create(template, timeout=ttl, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = e2b.Sandbox.create(template, timeout=ttl, lifecycle={"on_timeout": "pause"})
    try:
        for s in (sb, plain):
            s.files.write("/tmp/srv.py", PORT_SERVER)
            s.commands.run("python3 /tmp/srv.py", background=True, timeout=0)
        host, plain_host = sb.get_host(8000), plain.get_host(8000)
        for _ in range(100):
            if httpx.get(f"{url}/up", headers={"Host": host}).status_code == 200:
                break
            time.sleep(0.1)
        end = time.monotonic() + 30 + ttl
        while time.monotonic() < end and not all(
                e2b.Sandbox.get_info(s.sandbox_id).state == e2b.SandboxState.PAUSED for s in (sb, plain)):
            time.sleep(0.2)
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.PAUSED
        r = httpx.get(f"{url}/wake", headers={"Host": host}, timeout=60)
        assert r.status_code == 200 and r.text.startswith("/wake "), (r.status_code, r.text)
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.RUNNING
        r = httpx.get(f"{url}/wake", headers={"Host": plain_host}, timeout=60)
        assert r.status_code == 502, (r.status_code, r.text)
        assert e2b.Sandbox.get_info(plain.sandbox_id).state == e2b.SandboxState.PAUSED
    finally:
        for s in (sb, plain):
            e2b.Sandbox.kill(s.sandbox_id)


def test_traffic_does_not_wake_a_sandbox_paused_without_its_memory(e2b):
    """E2B: a filesystem-only pause cannot be combined with `auto_resume` (refused at
    create), and a sandbox paused without its memory is resumed with connect(), not by a
    request to its port (its server would not be running)."""
    import httpx

    url = e2b_env()["E2B_API_URL"]
    r = httpx.post(f"{url}/sandboxes", headers={"X-API-Key": e2b_env()["E2B_API_KEY"]},
                   json={"templateID": "base", "autoPause": True, "autoPauseMemory": False,
                         "autoResume": {"enabled": True}})
    assert r.status_code == 400 and "auto_resume" in r.json()["message"], r.text
    sb = e2b.Sandbox.create("base", timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/tmp/srv.py", PORT_SERVER)
        sb.commands.run("python3 /tmp/srv.py", background=True, timeout=0)
        host = sb.get_host(8000)
        for _ in range(100):
            if httpx.get(f"{url}/up", headers={"Host": host}).status_code == 200:
                break
            time.sleep(0.1)
        sb.pause(mode="filesystem")
        r = httpx.get(f"{url}/wake", headers={"Host": host}, timeout=60)
        assert r.status_code in (409, 502), (r.status_code, r.text)
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.PAUSED
        e2b.Sandbox.connect(sb.sandbox_id)
        assert e2b.Sandbox.get_info(sb.sandbox_id).state == e2b.SandboxState.RUNNING
    finally:
        e2b.Sandbox.kill(sb.sandbox_id)


def test_errors_map_to_sdk_exceptions(e2b):
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(api_key="dsk.not-a-real-key")
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.list(api_key="dsk.not-a-real-key").next_items()
    # a key of E2B's shape that no project has
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(api_key="e2b_" + "0" * 40)
    with pytest.raises(e2b.SandboxException, match="404: template"):
        e2b.Sandbox.create("no-such-template")
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.connect("e2btest-doesnotexist1")
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.connect("../../v1/status")


@pytest.mark.parametrize("template", ["base"])
def test_envd_requires_the_sandbox_token(sandbox):
    import httpx

    url = e2b_env()["E2B_SANDBOX_URL"]
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    assert httpx.get(f"{url}/health", headers=h).status_code == 401
    h["X-Access-Token"] = "0" * 64
    assert httpx.get(f"{url}/health", headers=h).status_code == 401
    h["X-Access-Token"] = sandbox._envd_access_token
    assert httpx.get(f"{url}/health", headers=h).status_code == 204
    # another sandbox's token does not open this one
    other = dict(h, **{"E2b-Sandbox-Id": sandbox.sandbox_id[:-1] + ("a" if sandbox.sandbox_id[-1] != "a" else "b")})
    assert httpx.get(f"{url}/health", headers=other).status_code in (401, 502)
    # malformed Connect frames are errors, never a dropped connection
    ct = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    for body in [b"\x00\x00\x00", b"\x00\xff\xff\xff\xff{}", b"\x01\x00\x00\x00\x02{}", b"\x00\x00\x00\x00\x03abc"]:
        r = httpx.post(f"{url}/process.Process/Start", headers={**h, **ct}, content=body)
        assert r.status_code == 200 and r.content[0] == 2 and b'"error"' in r.content, r.content
    r = httpx.post(f"{url}/filesystem.Filesystem/Stat", headers={**h, "Content-Type": "application/json"},
                   content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    r = httpx.post(f"{url}/filesystem.Filesystem/Stat", headers={**h, "Content-Type": "application/json"},
                   content=b'{"path": "a\\u0000b"}')
    assert r.status_code == 400
    # an oversized message (the limit is 4 MiB) and a wrong content type
    r = httpx.post(f"{url}/filesystem.Filesystem/Stat", headers={**h, "Content-Type": "application/json"},
                   content=b'{"path": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code in (400, 413, 429) and r.json()["code"] in ("resource_exhausted", "invalid_argument")
    r = httpx.post(f"{url}/process.Process/Start", headers={**h, **ct},
                   content=b"\x00" + (5 << 20).to_bytes(4, "big") + b"{}")
    assert r.status_code == 200 and r.content[0] == 2 and b"resource_exhausted" in r.content, r.content
    r = httpx.post(f"{url}/filesystem.Filesystem/Stat", headers={**h, "Content-Type": "text/plain"},
                   content=b'{"path": "/"}')
    assert r.status_code == 501 and "JSON codec" in r.json()["message"]
    r = httpx.post(f"{url}/filesystem.Filesystem/Nope", headers={**h, "Content-Type": "application/json"},
                   content=b"{}")
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = httpx.post(f"{url}/filesystem.Filesystem/GetWatcherEvents", headers={**h, "Content-Type": "application/json"},
                   content=b'{"watcherId": "w1-nope"}')
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    # ports other than envd's
    r = httpx.get(f"{url}/health", headers={**h, "E2b-Sandbox-Port": "49999"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


def test_quota_and_projects(e2b):
    """Control-plane calls use the caller's key: its project's quota and visibility apply.
    A key in E2B's shape (`e2b_` and 40 hex digits) acts in its own project, as any."""
    import json

    tag = uuid.uuid4().hex[:8]
    keys = {}
    for p in ("qa", "qb"):
        dsec("iam", "project-create", f"root/e2b{p}{tag}", "--sandboxes", "1",
             *(["--disk", "1536"] if p == "qb" else []))
        out = dsec("iam", "key-create", "--project", f"root/e2b{p}{tag}", "--name", f"k{p}", "--json",
                   *(["--e2b-format"] if p == "qa" else [])).stdout
        keys[p] = json.loads(out)["key"]
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", keys["qa"]), keys["qa"]
    # A volume counts against the project's disk quota: one of 1 GiB fits in 1.5, two do not.
    vol = e2b.Volume.create(f"q-{tag}", api_key=keys["qb"])
    try:
        with pytest.raises(Exception, match="quota"):
            e2b.Volume.create(f"q2-{tag}", api_key=keys["qb"])
    finally:
        assert e2b.Volume.destroy(vol.volume_id, api_key=keys["qb"])
    a = e2b.Sandbox.create(api_key=keys["qa"])
    rows = json.loads(dsec("ls", "--json").stdout)
    rows = rows["sandboxes"] if isinstance(rows, dict) else rows
    assert next(r for r in rows if r["id"] == a.sandbox_id)["project"] == f"root/e2bqa{tag}"
    try:
        with pytest.raises(e2b.RateLimitException, match="quota"):
            e2b.Sandbox.create(api_key=keys["qa"])
        # another project's key sees nothing of it
        assert e2b.Sandbox.list(api_key=keys["qb"]).next_items() == []
        with pytest.raises(e2b.SandboxNotFoundException):
            e2b.Sandbox.connect(a.sandbox_id, api_key=keys["qb"])
        assert e2b.Sandbox.kill(a.sandbox_id, api_key=keys["qb"]) is False
        assert a.commands.run("echo mine").stdout == "mine\n"
    finally:
        assert e2b.Sandbox.kill(a.sandbox_id, api_key=keys["qa"]) is True


async def test_async_sdk(e2b, template):
    """The async client: its own transport, and the streaming `WatchDir`."""
    import asyncio

    s = await e2b.AsyncSandbox.create(template)
    try:
        assert (await s.commands.run("echo async")).stdout == "async\n"
        await s.files.make_dir("/tmp/aw")
        events = []
        h = await s.files.watch_dir("/tmp/aw", on_event=lambda e: events.append((e.name, e.type)),
                                    recursive=True)
        await s.files.write("/tmp/aw/x.txt", "1")
        await s.commands.run("mkdir -p /tmp/aw/d && touch /tmp/aw/d/y")
        for _ in range(50):
            if ("d/y", e2b.FilesystemEventType.CREATE) in events:
                break
            await asyncio.sleep(0.1)
        await h.stop()
        assert ("x.txt", e2b.FilesystemEventType.CREATE) in events
        assert ("d/y", e2b.FilesystemEventType.CREATE) in events
        assert await s.files.read("/tmp/aw/x.txt") == "1"
    finally:
        await s.kill()


def test_pause_and_connect_resumes(sandbox, e2b):
    """A pause keeps the sandbox's memory by default (`mode="full"`, and the deprecated
    `keep_memory=True`): its processes live on after connect."""
    from e2b import SandboxQuery, SandboxState

    sandbox.commands.run("echo kept > /tmp/p")
    sandbox.commands.run("sleep 1000", background=True)
    count = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
             " | grep -c '^sleep 1000' || true")
    assert sandbox.pause() is True
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert not sandbox.is_running()
    paused = e2b.Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert sandbox.sandbox_id in [s.sandbox_id for s in paused]
    assert sandbox.pause() is False  # already paused
    c = e2b.Sandbox.connect(sandbox.sandbox_id)
    assert c.get_info().state == SandboxState.RUNNING
    assert c.commands.run("cat /tmp/p").stdout == "kept\n"
    assert c.commands.run(count).stdout.strip() == "1"
    assert c.pause(keep_memory=True) is True
    c = e2b.Sandbox.connect(sandbox.sandbox_id)
    assert c.commands.run(count).stdout.strip() == "1"


def test_filesystem_only_pause_keeps_files_and_ends_processes(sandbox, e2b, template):
    """`pause(mode="filesystem")`: the sandbox's processes end, its files stay; connect
    resumes it (a container starts afresh; a VM, whose files live in its memory, keeps
    its memory on disk and its processes with it)."""
    from e2b import SandboxState

    sandbox.commands.run("echo kept > /home/user/fs.txt")
    sandbox.commands.run("sleep 1000", background=True)
    assert sandbox.pause(mode="filesystem") is True
    assert sandbox.get_info().state == SandboxState.PAUSED
    c = e2b.Sandbox.connect(sandbox.sandbox_id)
    assert c.commands.run("cat fs.txt").stdout == "kept\n"
    r = c.commands.run("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true")
    assert r.stdout.strip() == ("1" if template.endswith("-vm") else "0"), r


def test_metrics(sandbox):
    """get_metrics(): the node's kept readings (one every 5 s): CPU over each interval and
    memory from the sandbox's cgroup, the disk as it is now; `start` narrows them."""
    import datetime
    import time

    first = sandbox.get_metrics()
    assert len(first) >= 1
    m = first[-1]
    assert m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100
    assert 0 < m.mem_used < m.mem_total == sandbox.get_info().memory_mb << 20
    assert 0 <= m.disk_used < m.disk_total
    sandbox.commands.run("head -c 20000000 /dev/urandom > /tmp/fill.bin")
    busy_from = datetime.datetime.now(datetime.timezone.utc)
    sandbox.commands.run("timeout 11 sh -c 'while :; do :; done' || true", timeout=60)
    time.sleep(5)  # one more reading after the busy ones
    series = sandbox.get_metrics()
    stamps = [e.timestamp for e in series]
    assert len(series) >= 2 and stamps == sorted(stamps), stamps
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
    assert all(3 <= g <= 7 for g in gaps), gaps
    busy = [e for e in series if e.timestamp > busy_from + datetime.timedelta(seconds=5)]
    print(f"metrics: {len(series)} readings, cpu {[e.cpu_used_pct for e in series]}%, "
          f"disk {m.disk_used >> 20} -> {series[-1].disk_used >> 20} MiB")
    assert busy and max(e.cpu_used_pct for e in busy) > 50, series
    assert series[-1].disk_used >= m.disk_used + 19_000_000
    later = sandbox.get_metrics(start=busy_from)
    assert later and len(later) <= len(series)
    assert all(e.timestamp >= busy_from - datetime.timedelta(seconds=6) for e in later)
    ahead = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=1)
    assert sandbox.get_metrics(start=ahead) == []
    # `end` closes the range (E2B sends whole seconds): nothing after it, alone or with
    # a `start`.
    cut = stamps[-1] - datetime.timedelta(seconds=1)  # after the reading before the last
    upto = sandbox.get_metrics(end=cut)
    assert upto and all(e.timestamp <= cut for e in upto), (upto, cut)
    assert stamps[-2] in [e.timestamp for e in upto] and stamps[-1] not in [e.timestamp for e in upto]
    # Readings are 3-7 s apart: from 8 s before the one before the last, it is in.
    window = [e.timestamp for e in sandbox.get_metrics(start=stamps[-2] - datetime.timedelta(seconds=8), end=cut)]
    assert stamps[-2] in window and set(window) <= set(stamps) and max(window) <= cut, (window, stamps)
    assert sandbox.get_metrics(start=ahead, end=ahead + datetime.timedelta(minutes=1)) == []
    # A range around one reading (whole seconds, as E2B sends) holds that reading, and
    # every reading a range covers is shown, the first one in it too.
    sec = lambda t: t.replace(microsecond=0)  # noqa: E731
    one = sandbox.get_metrics(start=sec(stamps[-2]), end=sec(stamps[-2]) + datetime.timedelta(seconds=1))
    assert [e.timestamp for e in one] == [stamps[-2]], (one, stamps)
    inner = [e.timestamp for e in sandbox.get_metrics(start=sec(stamps[1]), end=cut)]
    assert inner == [t for t in stamps if t >= sec(stamps[1]) and t <= cut], (inner, stamps)


# A server run inside the sandbox: GET echoes what reached it, POST answers the body's
# sha256, and an `Upgrade: echo` request switches to a line echo in upper case.
PORT_SERVER = r'''
import hashlib, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def reply(self, text):
        b = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101)
            self.send_header("Upgrade", "echo")
            self.send_header("Connection", "Upgrade")
            self.end_headers()
            self.wfile.flush()
            for line in self.rfile:
                self.wfile.write(line.upper())
                self.wfile.flush()
            self.close_connection = True
            return
        self.reply(f"{self.path} host={self.headers.get('Host')} auth={self.headers.get('Authorization')}")
    def do_POST(self):
        h = hashlib.sha256()
        left = int(self.headers["Content-Length"])
        while left:
            chunk = self.rfile.read(min(left, 1 << 20))
            h.update(chunk)
            left -= len(chunk)
        self.reply(h.hexdigest())
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
'''


def get_when_up(url: str, headers: dict[str, str], tries: int = 100):
    """GET `url` until the server behind it answers 200 (it may still be starting); the
    last answer."""
    import httpx

    for _ in range(tries):
        r = httpx.get(url, headers=headers)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    return r


TLS_SERVER = r'''
import http.server, ssl, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        b = f"tls {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
srv = http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/tls.pem", "/tmp/tls.key")
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
'''


def test_https_ports_reach_a_tls_server_in_the_sandbox(e2b, template, tmp_path):
    """`network.https_ports`: requests for a listed port reach the sandbox's server over
    TLS (its self-signed certificate accepted); an unlisted port is spoken to in plain
    HTTP (a TLS server there does not answer it); envd's port cannot be listed."""
    import httpx

    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(tmp_path / "k"), "-out", str(tmp_path / "c"), "-days", "2",
                    "-subj", "/CN=sandbox"], check=True, capture_output=True)
    url = e2b_env()["E2B_SANDBOX_URL"]
    with pytest.raises(e2b.SandboxException, match="49983"):
        e2b.Sandbox.create(template, timeout=60, network={"https_ports": [49983]})
    sb = e2b.Sandbox.create(template, timeout=300, network={"https_ports": [8443]})
    try:
        assert sb.get_info().network["https_ports"] == [8443]
        sb.files.write("/tmp/tls.pem", (tmp_path / "c").read_text())
        sb.files.write("/tmp/tls.key", (tmp_path / "k").read_text())
        sb.files.write("/tmp/tls.py", TLS_SERVER)
        for port in (8443, 8444):
            sb.commands.run(f"python3 /tmp/tls.py {port}", background=True, timeout=0)
        r = get_when_up(f"{url}/hello", {"Host": sb.get_host(8443)})
        assert r.status_code == 200 and r.text == "tls /hello", (r.status_code, r.text)
        # The same server on a port not listed: plain HTTP, which it does not answer.
        r = httpx.get(f"{url}/hello", headers={"Host": sb.get_host(8444)}, timeout=30)
        assert r.status_code == 502, (r.status_code, r.text)
    finally:
        sb.kill()


def test_sandbox_ports_through_the_host_url(e2b, template):
    """`get_host(port)` names the gateway; requests for it reach the server in the sandbox."""
    import hashlib
    import socket
    import time

    import httpx

    url = e2b_env()["E2B_SANDBOX_URL"]
    gw_host, gw_port = url.removeprefix("http://").split(":")
    sb = e2b.Sandbox.create(template, timeout=120)
    private = e2b.Sandbox.create(template, timeout=120, network={"allow_public_traffic": False})
    try:
        host = sb.get_host(8000)
        assert host == f"8000-{sb.sandbox_id}.localhost:{gw_port}"
        # nothing listens yet: E2B's 502
        r = httpx.get(f"{url}/", headers={"Host": host})
        assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"
        for s in (sb, private):
            s.files.write("/tmp/srv.py", PORT_SERVER)
            s.commands.run("python3 /tmp/srv.py", background=True, timeout=0)
        for _ in range(100):
            r = httpx.get(f"{url}/a/b?c=1", headers={"Host": host, "Authorization": "Basic dTo="})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        # path, query, host and the client's own Authorization arrive unchanged
        assert r.text == f"/a/b?c=1 host={host} auth=Basic dTo="
        body = os.urandom(8 << 20)
        r = httpx.post(f"{url}/up", headers={"Host": host}, content=body, timeout=60)
        assert r.text == hashlib.sha256(body).hexdigest()
        # an upgraded connection is a byte stream both ways
        with socket.create_connection((gw_host, int(gw_port)), timeout=10) as c:
            c.sendall(f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += c.recv(4096)
            assert head.startswith(b"HTTP/1.1 101"), head
            c.sendall(b"hello\n")
            got = head.split(b"\r\n\r\n", 1)[1]
            while not got.endswith(b"\n"):
                got += c.recv(4096)
            assert got == b"HELLO\n"
        # E2b-Sandbox-Port routes the same way with one sandbox URL
        r = httpx.get(f"{url}/x", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000"})
        assert r.status_code == 200 and r.text.startswith("/x ")
        # a private sandbox's ports want its traffic token
        phost = private.get_host(8000)
        assert private.traffic_access_token
        r = get_when_up(f"{url}/p", {"Host": phost, "E2B-Traffic-Access-Token": private.traffic_access_token})
        assert r.text.startswith("/p ")
        assert httpx.get(f"{url}/p", headers={"Host": phost}).status_code == 401
        assert httpx.get(f"{url}/p", headers={"Host": phost, "E2B-Traffic-Access-Token": "x"}).status_code == 403
    finally:
        sb.kill()
        private.kill()
    # a sandbox that is gone
    r = httpx.get(f"{url}/", headers={"Host": host})
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_connect_gives_the_same_tokens_and_hosts(e2b, template):
    """`Sandbox.connect` (the class's and the instance's) to a private sandbox, from a
    process that holds no token: the handle it gets carries the same envd and traffic
    tokens and the same hosts as the creator's, and both reach the sandbox and its ports."""
    import time

    import httpx

    url = e2b_env()["E2B_SANDBOX_URL"]
    sb = e2b.Sandbox.create(template, timeout=120, network={"allow_public_traffic": False})
    try:
        sb.files.write("/tmp/srv.py", PORT_SERVER)
        sb.commands.run("python3 /tmp/srv.py", background=True, timeout=0)
        c = e2b.Sandbox.connect(sb.sandbox_id)
        again = sb.connect()
        for h in (c, again):
            assert h.sandbox_id == sb.sandbox_id
            assert h._envd_access_token == sb._envd_access_token
            assert h.traffic_access_token == sb.traffic_access_token and sb.traffic_access_token
            assert h.get_host(8000) == sb.get_host(8000)
            assert h.commands.run("echo hi").stdout == "hi\n"
        host = c.get_host(8000)
        r = get_when_up(f"{url}/c", {"Host": host, "E2B-Traffic-Access-Token": c.traffic_access_token})
        assert r.status_code == 200 and r.text.startswith("/c "), (r.status_code, r.text)
        assert httpx.get(f"{url}/c", headers={"Host": host}).status_code == 401
    finally:
        sb.kill()


def test_a_host_mask_is_the_host_a_sandbox_server_sees(e2b, template):
    """`network.mask_request_host`: the sandbox's servers see that Host (with `${PORT}`
    the port) in requests through the gateway, not the one the client asked for; a mask
    that is not a host is refused."""
    import time

    import httpx

    url = e2b_env()["E2B_SANDBOX_URL"]
    sb = e2b.Sandbox.create(template, timeout=120, network={"mask_request_host": "${PORT}-myapp.example.com"})
    try:
        sb.files.write("/tmp/srv.py", PORT_SERVER)
        sb.commands.run("python3 /tmp/srv.py", background=True, timeout=0)
        for _ in range(100):
            r = httpx.get(f"{url}/m", headers={"Host": sb.get_host(8000)})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.text == "/m host=8000-myapp.example.com auth=None", r.text
    finally:
        sb.kill()
    for bad in ["a b", "x\r\nX-Injected: 1", "${HOME}.example.com"]:
        with pytest.raises(Exception) as e:
            e2b.Sandbox.create(template, timeout=60, network={"mask_request_host": bad})
        assert "maskRequestHost" in str(e.value), e.value


def test_template_build(e2b):
    """`Template.build()` (and `from_dockerfile`) become OpenDsec image builds; sandboxes of
    the new template have its files, env, workdir and running start command."""
    import time

    import httpx
    from e2b import Template

    tag = uuid.uuid4().hex[:8]
    ready = "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))'"
    t = (Template().from_template("base")
         .run_cmd("echo built > /built.txt")
         .set_envs({"FROM_TEMPLATE": "yes"})
         .set_workdir("/srv")
         .run_cmd("echo here > in-workdir.txt")
         .set_start_cmd("python3 -m http.server 8000", ready))
    logs = []
    t0 = time.monotonic()
    info = Template.build(t, f"t{tag}", on_build_logs=logs.append)
    print(f"template build {time.monotonic() - t0:.1f} s, {len(logs)} log lines")
    assert info.template_id == f"t{tag}"
    # (the e2b.env key belongs to the project root/e2b: its templates are its images)
    assert any(f"root/e2b/e2b-t{tag}:latest" in e.message for e in logs)
    sb = e2b.Sandbox.create(f"t{tag}")
    try:
        r = sb.commands.run("cat /built.txt; echo $FROM_TEMPLATE; pwd; cat in-workdir.txt")
        assert r.stdout == "built\nyes\n/srv\nhere\n"
        # the start command was running (and ready) when create returned
        url = e2b_env()["E2B_SANDBOX_URL"]
        assert httpx.get(f"{url}/in-workdir.txt", headers={"Host": sb.get_host(8000)}).text == "here\n"
    finally:
        sb.kill()
    # from a Dockerfile, on an OpenDsec image
    t2 = Template().from_dockerfile("FROM root/py:3.11\nRUN echo df > /df.txt\nENV X=1\n")
    Template.build(t2, f"d{tag}:v1")
    sb = e2b.Sandbox.create(f"d{tag}:v1")
    try:
        # (the SDK ends a Dockerfile with E2B's `USER user` and `WORKDIR /home/user`)
        assert sb.commands.run("cat /df.txt; echo $X; pwd").stdout == "df\n1\n/home/user\n"
    finally:
        sb.kill()
    # what cannot be built says why
    # (a registry's image is pulled first: Docker Hub, which this node cannot reach)
    with pytest.raises(e2b.BuildException, match="pulling docker.io/library/python:3.11"):
        Template.build(Template().from_image("python:3.11"), f"x{tag}")
    with pytest.raises(e2b.BuildException, match="exit|status|failed"):
        Template.build(Template().from_template("base").run_cmd("echo to-the-log; exit 7"), f"f{tag}")
    # a template is its project's: another project's key builds its own, which the first
    # key does not find
    import json

    dsec("iam", "project-create", f"root/tb{tag}")
    pkey = json.loads(dsec("iam", "key-create", "--project", f"root/tb{tag}", "--name", "k",
                           "--json").stdout)["key"]
    Template.build(Template().from_template("base").run_cmd("echo mine > /mine"), f"p{tag}", api_key=pkey)
    sb = e2b.Sandbox.create(f"p{tag}", api_key=pkey)
    try:
        assert sb.commands.run("cat /mine").stdout == "mine\n"
    finally:
        sb.kill()
    with pytest.raises(e2b.SandboxException, match="not found"):
        e2b.Sandbox.create(f"p{tag}")
    # COPY: the client's files are uploaded to the gateway and copied in
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        ctx = Path(d)
        (ctx / "app.txt").write_text("from the client\n")
        (ctx / "pkg").mkdir()
        (ctx / "pkg" / "m.py").write_text("X = 1\n")
        (ctx / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (ctx / "run.sh").chmod(0o755)
        t3 = (Template(file_context_path=str(ctx)).from_template("base")
              .copy("app.txt", "/opt/app/")
              .copy("pkg", "/opt/pkg")
              .set_workdir("/opt")
              .copy("run.sh", "bin/run"))
        Template.build(t3, f"cp{tag}")
    sb = e2b.Sandbox.create(f"cp{tag}")
    try:
        r = sb.commands.run("cat /opt/app/app.txt /opt/pkg/m.py; /opt/bin/run")
        assert r.stdout == "from the client\nX = 1\nran\n"
    finally:
        sb.kill()


def test_standalone_gateway(e2b, tmp_path):
    """`dsec gateway` serves E2B programs in front of any OpenDsec API (as for a cluster's
    apiserver), with a secret of its own."""
    import json

    import httpx

    from conftest import DSEC as DSEC_BIN

    p = subprocess.Popen([DSEC_BIN, "gateway", "--listen", "127.0.0.1:0", "--secret-file",
                          str(tmp_path / "secret")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        first = p.stdout.readline()
        assert first.startswith("E2B gateway on http://"), first + p.stderr.read()
        url = first.split()[3]
        sb = e2b.Sandbox.create(api_url=url, sandbox_url=url)
        try:
            assert sb.commands.run("echo via standalone").stdout == "via standalone\n"
            assert sb.files.read("/etc/hostname")
            # its tokens are its own: the gateway of `dsec up` does not take them
            main = e2b_env()["E2B_SANDBOX_URL"]
            h = {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token}
            assert httpx.get(f"{main}/health", headers=h).status_code == 401
            assert httpx.get(f"{url}/health", headers=h).status_code == 204
        finally:
            sb.kill()
    finally:
        p.terminate()
        p.wait(timeout=10)
    # it wants a key that sees every sandbox
    tag = uuid.uuid4().hex[:8]
    dsec("iam", "project-create", f"root/gw{tag}")
    key = json.loads(dsec("iam", "key-create", "--project", f"root/gw{tag}", "--name", "k",
                          "--json").stdout)["key"]
    r = subprocess.run([DSEC_BIN, "gateway", "--listen", "127.0.0.1:0", "--api-key", key,
                        "--secret-file", str(tmp_path / "secret")], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and "root project" in r.stderr


def test_binary_protobuf_codec(sandbox):
    """envd's RPCs in the binary protobuf codec: the Connect clients generated into the e2b
    package, with their default codec (the SDK itself plugs in JSON)."""
    from e2b.envd.filesystem import filesystem_connect, filesystem_pb
    from e2b.envd.process import process_connect, process_pb
    from protobuf import Oneof

    url = e2b_env()["E2B_SANDBOX_URL"]
    h = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": sandbox._envd_access_token}
    proc = process_connect.ProcessClientSync(url, send_compression=None)
    start = process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/bash", args=["-c", "echo hi; echo err >&2; exit 3"],
                                         envs={"X": "1"}),
        stdin=False)
    out, err, end = b"", b"", None
    for r in proc.start(start, headers=h, timeout_ms=20000):
        ev = r.event.event
        if ev.field == "data":
            d = ev.value.output
            if d.field == "stdout":
                out += d.value
            elif d.field == "stderr":
                err += d.value
        elif ev.field == "end":
            end = ev.value
    assert (out, err) == (b"hi\n", b"err\n")
    assert end.exit_code == 3 and end.exited
    assert isinstance(proc.list(process_pb.ListRequest(), headers=h), process_pb.ListResponse)
    fs = filesystem_connect.FilesystemClientSync(url, send_compression=None)
    sandbox.files.write("/tmp/pb/a.txt", "12345")
    st = fs.stat(filesystem_pb.StatRequest(path="/tmp/pb/a.txt"), headers=h)
    assert st.entry.name == "a.txt" and st.entry.size == 5
    assert st.entry.type == filesystem_pb.FileType.FILE
    assert st.entry.modified_time.seconds > 1_700_000_000
    ls = fs.list_dir(filesystem_pb.ListDirRequest(path="/tmp/pb", depth=1), headers=h)
    assert [e.path for e in ls.entries] == ["/tmp/pb/a.txt"]
    # errors keep the Connect error model
    from connectrpc.errors import ConnectError

    with pytest.raises(ConnectError) as ei:
        fs.stat(filesystem_pb.StatRequest(path="/tmp/pb/missing"), headers=h)
    assert ei.value.code.name.lower() == "not_found"
    # a signal by pid, through a oneof
    bg = sandbox.commands.run("sleep 100", background=True)
    proc.send_signal(process_pb.SendSignalRequest(
        process=process_pb.ProcessSelector(selector=Oneof(field="pid", value=bg.pid)),
        signal=process_pb.Signal.SIGKILL), headers=h)
    with pytest.raises(Exception):
        bg.wait()
    # a process selected by its tag
    it = proc.start(process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/sleep", args=["100"]), tag="tagged-sleep",
        stdin=False), headers=h, timeout_ms=60000)
    first = next(iter(it))
    assert first.event.event.field == "start"
    tagged = [p for p in proc.list(process_pb.ListRequest(), headers=h).processes if p.tag == "tagged-sleep"]
    assert [p.pid for p in tagged] == [first.event.event.value.pid]
    proc.send_signal(process_pb.SendSignalRequest(
        process=process_pb.ProcessSelector(selector=Oneof(field="tag", value="tagged-sleep")),
        signal=process_pb.Signal.SIGKILL), headers=h)
    import time

    for _ in range(50):
        if not [p for p in proc.list(process_pb.ListRequest(), headers=h).processes if p.tag == "tagged-sleep"]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the tagged process still runs")
    with pytest.raises(ConnectError) as ei:
        proc.send_signal(process_pb.SendSignalRequest(
            process=process_pb.ProcessSelector(selector=Oneof(field="tag", value="no-such-tag")),
            signal=process_pb.Signal.SIGKILL), headers=h)
    assert ei.value.code.name.lower() == "not_found"
    # with the client's default (gzip) compression too
    gz = filesystem_connect.FilesystemClientSync(url)
    assert gz.stat(filesystem_pb.StatRequest(path="/tmp/pb/" + "./" * 600 + "a.txt"), headers=h).entry.size == 5
    last = list(process_connect.ProcessClientSync(url).start(start, headers=h, timeout_ms=20000))[-1]
    assert last.event.event.field == "end" and last.event.event.value.exit_code == 3


def test_volumes(e2b):
    """E2B's `Volume` (control plane and content API) and `volume_mounts` on create."""
    import httpx

    name = f"vol-{os.urandom(3).hex()}"
    vol = e2b.Volume.create(name)
    try:
        assert vol.name == name and vol.token
        assert name in [v.name for v in e2b.Volume.list()]
        assert e2b.Volume.get_info(vol.volume_id).token == vol.token
        entry = vol.write_file("/data/a.txt", "from the SDK", mode=0o640)
        assert (entry.path, entry.size, entry.mode & 0o777) == ("/data/a.txt", 12, 0o640), entry
        assert vol.read_file("/data/a.txt") == "from the SDK"
        d = vol.make_dir("/x/y", force=True)
        assert d.type.value == "directory", d
        paths = sorted(e.path for e in vol.list("/", depth=3))
        assert paths == ["/data", "/data/a.txt", "/x", "/x/y"], paths
        assert vol.get_info("/data/a.txt").type.value == "file"
        assert vol.exists("/data/a.txt") and not vol.exists("/nope")

        # Mounted by a container and a VM at once: each sees what the other wrote.
        sb = e2b.Sandbox.create("base", timeout=120, volume_mounts={"/mnt/data": vol})
        vm = e2b.Sandbox.create("base-vm", timeout=300, volume_mounts={"/home/user/vol": vol})
        try:
            r = sb.commands.run("cat /mnt/data/data/a.txt; echo more > /mnt/data/b.txt")
            assert r.stdout == "from the SDK", r
            r = vm.commands.run("cat vol/b.txt && echo vm > vol/c.txt")
            assert r.stdout == "more\n", r
            assert sb.files.read("/mnt/data/c.txt") == "vm\n"
            # In the VM the volume is a network mount (virtio-fs): a watch is refused
            # unless it allows network mounts, then sees the VM's own changes.
            with pytest.raises(e2b.SandboxException, match="network filesystem"):
                vm.files.watch_dir("vol")
            w = vm.files.watch_dir("vol", allow_network_mounts=True)
            vm.files.write("vol/w.txt", "watched")
            names = set()
            for _ in range(50):
                names |= {e.name for e in w.get_new_events()}
                if "w.txt" in names:
                    break
                time.sleep(0.1)
            w.stop()
            assert "w.txt" in names, names
        finally:
            sb.kill()
            vm.kill()
        assert vol.read_file("/b.txt") == "more\n"
        vol.remove("/x")
        assert not vol.exists("/x")

        # The content API wants this volume's token: none, another's, a sandbox's.
        url = e2b_env()["E2B_SANDBOX_URL"]
        for token in ("", "0" * 64, e2b.Volume.create(name + "-b").token):
            r = httpx.get(f"{url}/volumecontent/{vol.volume_id}/file", params={"path": "/data/a.txt"},
                          headers={"Authorization": f"Bearer {token}"} if token else {})
            assert r.status_code == 401, (token, r.status_code, r.text)
        e2b.Volume.destroy(
            next(v.volume_id for v in e2b.Volume.list() if v.name == name + "-b"))
    finally:
        assert e2b.Volume.destroy(vol.volume_id)
    assert name not in [v.name for v in e2b.Volume.list()]
    assert not e2b.Volume.destroy(vol.volume_id)
