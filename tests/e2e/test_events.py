# SPDX-License-Identifier: AGPL-3.0-only
"""Lifecycle events and webhooks: a receiver started here gets signed events for create,
pause, resume, stop and expiry in order, and a retry after it answered 500 once;
`GET /v1/events` shows a key only its project's subtree, long-polls, and keeps its events
across a restart; a webhook cannot be aimed at the node's own or private addresses, nor
seen or removed by another project. The E2B gateway serves the same events as E2B's
lifecycle API, and its webhooks get E2B's bodies and signature."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import dsec, node_config, server_down, server_up, wait_for
from opendsec import InvalidArgumentError, NotFoundError
from opendsec.sync import DSecClient, DSecRunArgs
from test_e2b import E2B_VERSION, e2b_env, pip_pinned

# Deliveries may go to loopback (the receiver below); nothing else private.
CONFIG = '[edge.events]\nwebhook_allow = ["127.0.0.0/8"]\n'


@pytest.fixture(scope="module", autouse=True)
def node():
    with node_config(CONFIG):
        yield


class Receiver:
    """An HTTP server that records each POST; it answers 500 to the first one."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                with outer.lock:
                    first = not outer.got
                    outer.got.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                      "body": body, "answered": 500 if first else 200})
                self.send_response(500 if first else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def events(self) -> list[dict]:
        with self.lock:
            return [json.loads(g["body"]) for g in self.got if g["answered"] == 200]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def signed_by(secret: str, g: dict) -> bool:
    parts = dict(p.split("=", 1) for p in g["headers"]["x-dsec-signature"].split(","))
    mac = hmac.new(secret.encode(), parts["t"].encode() + b"." + g["body"], hashlib.sha256).hexdigest()
    return hmac.compare_digest(mac, parts["v1"]) and abs(time.time() - int(parts["t"])) < 300


def test_a_webhook_gets_signed_events_in_order_with_a_retry():
    team = f"root/ev-{uuid.uuid4().hex[:8]}"
    rcv = Receiver()
    with DSecClient() as admin:
        admin.create_project(team, sandboxes=10)
        key = admin.create_key("ev", project=team, agent=True)["key"]
        with DSecClient(api_key=key) as c:
            hook = c.create_webhook(rcv.url)
            try:
                assert hook["project"] == team and hook["secret"].startswith("whsec_")
                assert "secret" not in c.webhooks()[0]
                sb = c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=300))
                sb.pause()
                sb.resume()
                sb.stop()
                short = c.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=2))
                # The admin's own sandbox is not the team's: its events are not sent.
                other = admin.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=60))
                other.stop()
                want = [("created", sb.id), ("paused", sb.id), ("resumed", sb.id), ("stopped", sb.id),
                        ("created", short.id), ("expired", short.id)]
                wait_for(lambda: len(rcv.events()) >= len(want), timeout=30)
                got = [(e["type"], e["sandbox"]) for e in rcv.events()]
                assert got == want, got
                evs = rcv.events()
                assert [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)
                assert all(e["project"] == team for e in evs)
                assert evs[3]["reason"] == "requested"
                # Every try is signed with the webhook's secret; a wrong secret fails.
                assert all(signed_by(hook["secret"], g) for g in rcv.got)
                assert not signed_by("whsec_wrong", rcv.got[0])
                # The first try was answered 500 and the same event came again.
                assert rcv.got[0]["answered"] == 500
                assert rcv.got[0]["headers"]["x-dsec-delivery"] == rcv.got[1]["headers"]["x-dsec-delivery"]
                log = c.webhook_deliveries(hook["id"])
                assert (log[0]["attempt"], log[0]["status"], log[0]["ok"]) == (1, 500, False), log[0]
                assert (log[1]["attempt"], log[1]["ok"], log[1]["event"]) == (2, True, log[0]["event"]), log[1]
                assert all(d["ok"] for d in log[1:]), log
                # The CLI shows the same, as JSON lines or as lines for people.
                env = {"DSEC_API_URL": admin.api_url, "DSEC_API_KEY": key}
                lines = dsec("events", "--sandbox", sb.id, "--json", env=env).stdout.splitlines()
                assert [json.loads(x)["type"] for x in lines] == ["created", "paused", "resumed", "stopped"]
                human = dsec("events", "--type", "expired", env=env).stdout
                assert short.id in human and "expired" in human and sb.id not in human
            finally:
                c.delete_webhook(hook["id"])
                rcv.close()


def test_events_are_seen_by_their_subtree_only_and_kept_across_a_restart():
    a, b = f"root/eva-{uuid.uuid4().hex[:8]}", f"root/evb-{uuid.uuid4().hex[:8]}"
    with DSecClient() as admin:
        admin.create_project(a, sandboxes=4)
        admin.create_project(f"{a}/sub", sandboxes=2)
        admin.create_project(b, sandboxes=4)
        ka = admin.create_key("a", project=a, agent=True)["key"]
        kb = admin.create_key("b", project=b, agent=True)["key"]
        ksub = admin.create_key("sub", project=f"{a}/sub", agent=True)["key"]
        start = admin.events(limit=1000)["next"]
        with DSecClient(api_key=ka) as ca, DSecClient(api_key=kb) as cb, DSecClient(api_key=ksub) as csub:
            # A long poll returns as soon as an event lands.
            polled: dict = {}
            t = threading.Thread(target=lambda: polled.update(ca.events(after=start, wait_seconds=30)))
            t.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            sa = csub.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=300))
            t.join(timeout=40)
            assert [e["sandbox"] for e in polled["events"]] == [sa.id], polled
            assert time.monotonic() - t0 < 20, "the long poll did not wake on the event"
            sb = cb.run_sandbox(DSecRunArgs(image="root/base", memory_limit_mb=32, ttl_seconds=300))
            sa.stop()
            sb.stop()
            mine = {(e["type"], e["sandbox"]) for e in ca.events(after=start)["events"]}
            assert mine == {("created", sa.id), ("stopped", sa.id)}, mine
            assert {e["sandbox"] for e in cb.events(after=start)["events"]} == {sb.id}
            # The sub-project sees its own; the parent's other events stay hidden from it.
            assert {e["sandbox"] for e in csub.events(after=start)["events"]} == {sa.id}
            assert ca.events(after=start, sandbox=sb.id)["events"] == []
            assert [e["type"] for e in ca.events(after=start, type="stopped")["events"]] == ["stopped"]
            # Another project's webhook: not listed, not shown, not removable.
            hook = ca.create_webhook("http://127.0.0.1:9/hook", types=["created"])
            assert cb.webhooks() == []
            with pytest.raises(NotFoundError):
                cb.delete_webhook(hook["id"])
            with pytest.raises(NotFoundError):
                cb.webhook_deliveries(hook["id"])
            # Nor can a key hook a project outside its own.
            with pytest.raises(NotFoundError):
                cb.create_webhook("http://127.0.0.1:9/hook", project=a)
            with pytest.raises(InvalidArgumentError) as e:
                ca.create_webhook("http://127.0.0.1:9/hook", types=["exploded"])
            assert "created" in e.value.message
            ca.delete_webhook(hook["id"])
        seen = [(e["type"], e["sandbox"]) for e in admin.events(after=start, limit=1000)["events"]]
    # A restart keeps them.
    server_down()
    server_up()
    with DSecClient() as admin:
        again = [(e["type"], e["sandbox"]) for e in admin.events(after=start, limit=1000)["events"]]
        assert again[:len(seen)] == seen and len(seen) >= 4


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",
    "http://10.200.0.1:53/",
    "http://192.168.0.1/",
    "http://[::1]:7611/v1/keys",
    "http://[::ffff:10.0.0.1]/",
    "file:///etc/shadow",
    "http://user:pw@127.0.0.1/",
])
def test_webhooks_are_not_aimed_at_private_or_special_addresses(url):
    with DSecClient() as c:
        with pytest.raises(InvalidArgumentError):
            c.create_webhook(url)
        assert all(w["url"] != url for w in c.webhooks())


def gateway(method: str, path: str, key: str, body: dict | None = None) -> tuple[int, object]:
    """One call of the E2B gateway's control plane, as E2B's documents make it."""
    req = urllib.request.Request(e2b_env()["E2B_API_URL"] + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"X-API-Key": key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def e2b_signed(secret: str, g: dict) -> bool:
    want = base64.urlsafe_b64encode(hashlib.sha256(secret.encode() + g["body"]).digest()).decode().rstrip("=")
    return hmac.compare_digest(want, g["headers"]["e2b-signature"])


def test_the_e2b_gateway_serves_the_same_events_and_e2b_signed_webhooks(monkeypatch):
    pip_pinned("e2b", E2B_VERSION)
    import e2b

    for k, v in e2b_env().items():
        monkeypatch.setenv(k, v)

    tag = uuid.uuid4().hex[:8]
    team, other = f"root/e2bev-{tag}", f"root/e2bother-{tag}"
    with DSecClient() as admin:
        admin.create_project(team, sandboxes=4)
        admin.create_project(other, sandboxes=2)
        key = admin.create_key("e2b-ev", project=team, agent=True, e2b_format=True)["key"]
        okey = admin.create_key("e2b-other", project=other, agent=True, e2b_format=True)["key"]
    rcv = Receiver()
    secret = f"e2b-secret-{uuid.uuid4().hex}"
    kinds = ["sandbox.lifecycle.created", "sandbox.lifecycle.paused", "sandbox.lifecycle.resumed",
             "sandbox.lifecycle.updated", "sandbox.lifecycle.killed"]
    st, hook = gateway("POST", "/events/webhooks", key, {
        "name": "rollouts", "url": rcv.url, "enabled": True, "events": kinds, "signatureSecret": secret})
    assert st == 201, hook
    wid = hook["id"]
    try:
        assert hook["events"] == ["sandbox.lifecycle.created", "sandbox.lifecycle.paused",
                                  "sandbox.lifecycle.resumed", "sandbox.lifecycle.updated",
                                  "sandbox.lifecycle.killed"], hook
        assert hook["teamID"] == team and hook["name"] == "rollouts" and secret not in json.dumps(hook)
        # Another team neither sees, changes nor removes it.
        assert gateway("GET", "/events/webhooks", okey) == (200, [])
        for method, body in (("GET", None), ("PATCH", {"enabled": False}), ("DELETE", None)):
            assert gateway(method, f"/events/webhooks/{wid}", okey, body)[0] == 404, method
        assert gateway("GET", "/events/webhooks/..%2F..%2Fv1%2Fkeys", key)[0] == 404
        st, err = gateway("POST", "/events/webhooks", key, {"url": rcv.url, "events": ["sandbox.exploded"]})
        assert st == 400 and "sandbox.lifecycle.killed" in err["message"], err

        sb = e2b.Sandbox.create("base", timeout=120, metadata={"run": tag}, api_key=key)
        sid = sb.sandbox_id
        sb.set_timeout(200)
        sb.pause()
        e2b.Sandbox.connect(sid, api_key=key).kill()
        want = [t for t in kinds if t != "sandbox.lifecycle.updated"]
        wait_for(lambda: [e["type"] for e in rcv.events() if e["type"] != "sandbox.lifecycle.updated"] == want,
                 timeout=30)
        evs = rcv.events()
        types = [e["type"] for e in evs]
        # set_timeout is an update, between create and pause.
        assert types[:2] == ["sandbox.lifecycle.created", "sandbox.lifecycle.updated"], types
        first = evs[0]
        assert first["version"] == "v1" and first["sandboxId"] == sid and first["sandboxTeamId"] == team
        assert first["sandboxTemplateId"] == "base" and first["eventData"]["sandbox_metadata"] == {"run": tag}
        assert evs[1]["eventData"]["set_timeout"].endswith("Z")
        # Each try carries E2B's headers and signature; the first was answered 500 and sent again.
        assert all(e2b_signed(secret, g) for g in rcv.got)
        assert not e2b_signed("not-the-secret-0000", rcv.got[0])
        assert all(g["headers"]["e2b-webhook-id"] == wid and g["headers"]["e2b-signature-version"] == "v1"
                   for g in rcv.got)
        assert rcv.got[0]["answered"] == 500 and rcv.got[0]["body"] == rcv.got[1]["body"]

        # The lifecycle API reads the same events: newest first unless asked otherwise.
        st, page = gateway("GET", f"/events/sandboxes/{sid}?limit=100", key)
        assert st == 200 and [e["id"] for e in page] == [e["id"] for e in reversed(evs)], page
        st, asc = gateway("GET", f"/events/sandboxes/{sid}?orderAsc=true&limit=2&offset=1", key)
        assert [e["id"] for e in asc] == [e["id"] for e in evs[1:3]], asc
        st, killed = gateway("GET", f"/events/sandboxes/{sid}?types=sandbox.lifecycle.killed", key)
        assert [e["type"] for e in killed] == ["sandbox.lifecycle.killed"], killed
        st, team_page = gateway("GET", "/events/sandboxes?limit=3", key)
        assert st == 200 and [e["id"] for e in team_page] == [e["id"] for e in reversed(evs)][:3]
        # Another team's key reads none of them, by sandbox or in its own list.
        assert gateway("GET", f"/events/sandboxes/{sid}", okey) == (200, [])
        assert all(e["sandboxTeamId"] == other for e in gateway("GET", "/events/sandboxes?limit=100", okey)[1])
        assert gateway("GET", "/events/sandboxes?limit=1000", key)[0] == 400

        # Disabled: nothing more is sent. Then removed.
        st, off = gateway("PATCH", f"/events/webhooks/{wid}", key, {"enabled": False})
        assert st == 200 and off["enabled"] is False
        sent = len(rcv.got)
        e2b.Sandbox.create("base", timeout=60, api_key=key).kill()
        time.sleep(2)
        assert len(rcv.got) == sent, rcv.events()[sent:]
    finally:
        st, _ = gateway("DELETE", f"/events/webhooks/{wid}", key)
        rcv.close()
    assert st == 200
    assert gateway("GET", f"/events/webhooks/{wid}", key)[0] == 404
