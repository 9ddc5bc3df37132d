# SPDX-License-Identifier: Apache-2.0
"""The async client: DSecClient creates and finds sandboxes; Sandbox runs commands in one.

The runtime API (docs/RUNTIME_API.md) is reached from a Sandbox: ``exec``/``exec_stream``/
``exec_background``/``attach``/``pty`` give processes, ``sb.files`` the filesystem,
``sb.sessions`` persistent shells and ``sb.trajectory(name)`` the replayable step log.
"""

from __future__ import annotations

import asyncio
import base64
import json as _json
import os
import signal as _signal
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, BinaryIO, Iterable, Union
from urllib.parse import quote

from . import config
from ._http import Response, Timeout, Transport, TransportError
from .errors import DSecError, FunctionError, PreconditionError, UnavailableError, from_event, from_response

# Extra time over a command's own timeout before the HTTP call gives up.
_EXEC_SLACK_S = 60.0
# Streams (process output, watches) may be quiet for as long as the process or the watch
# lives: no read timeout, only a connect timeout.
_STREAM_TIMEOUT = Timeout(None)
# How much of each output stream a Process keeps for wait(): the server's default
# max_output_bytes, so wait() on a stream matches a plain exec.
_KEEP_OUTPUT = 16 << 20

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class DSecRunArgs:
    """What sandbox to create. Unset limits take the server's defaults."""

    image: str = "root/base:latest"
    backend: str = "container"
    cpu_cores_limit: float | None = None
    memory_limit_mb: int | None = None
    disk_limit_mb: int | None = None
    pids_limit: int | None = None
    ttl_seconds: int | None = None
    idle_timeout_seconds: int | None = None
    # When the TTL runs out: "stop" (default), "pause" (resume it later; it then has as
    # long again as it was created with) or "pause_to_disk" (its processes end, freeing
    # its memory; see Sandbox.pause).
    on_timeout: str | None = None
    # When paused, resume on the next request to one of its ports.
    auto_resume: bool | None = None
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # The project whose quota the sandbox counts against (default: the API key's).
    project: str | None = None
    # What the sandbox may reach; egress is closed otherwise. Keys are service names
    # ("pypi", "npm", "github", ...), domains ("*.example.com") or IPv4 CIDRs with an
    # optional port ("203.0.113.0/24:443"); values True (allow) or False (ignored).
    network_rules: dict[str, bool] = field(default_factory=dict)
    # Headers the node sets on the sandbox's HTTP and HTTPS requests to a host, which
    # must also be allowed: {"api.example.com": {"Authorization": "Bearer sk-..."}}. The
    # sandbox never holds the values (HTTPS goes through a node CA it is made to trust).
    egress_headers: dict[str, dict[str, str]] = field(default_factory=dict)
    # "none": no network at all (loopback only).
    network: str | None = None
    # Volumes to mount (container backend): {"/mnt/data": "my-volume"} or, for a
    # read-only mount, {"/mnt/data": {"volume": "my-volume", "read_only": True}}; a
    # volume by id or by name (in the sandbox's project or a parent of it).
    volumes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v is not None and v != {}}
        if self.volumes:
            d["volumes"] = [
                {"path": path, **(v if isinstance(v, dict) else {"volume": v})}
                for path, v in self.volumes.items()
            ]
        return d


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    signal: int | None = None
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ExecResult":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__ if k in d})  # type: ignore[arg-type]


@dataclass
class SessionResult(ExecResult):
    """A session command's result. ``state`` is ``running`` (output so far, no exit code
    yet) or ``done``; ``session_restarted`` says the shell was restarted after a timeout."""

    command_id: Any = None
    state: str = "done"
    session_restarted: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SessionResult":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        kw.setdefault("stdout", "")
        kw.setdefault("stderr", "")
        kw.setdefault("exit_code", None)
        return cls(**kw)

    @property
    def done(self) -> bool:
        return self.state == "done"


@dataclass
class SandboxInfo:
    id: str
    edge: str
    backend: str
    image: str
    state: str
    limits: dict[str, Any]
    created_at_ms: int
    expires_at_ms: int
    labels: dict[str, str] = field(default_factory=dict)
    oom_kills: int = 0
    forked_from: str | None = None
    idle_timeout_seconds: int | None = None
    port_token: str = ""
    project: str = "root"
    # {"mode": "rules" | "none", "address": "10.200.0.2", "rules": {...}}
    network: dict[str, Any] = field(default_factory=dict)
    # Paused with its memory on disk and no process on the host.
    paused_to_disk: bool = False
    # The id it had on the edge it was resumed away from (``resume(edge=...)``).
    moved_from: str | None = None
    # The warm pool (``[[edge.pools]]``) the sandbox was taken from, made before the create.
    from_pool: str | None = None
    # Its volumes: [{"volume": id, "path": "/mnt/data", "read_only": bool}].
    volumes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SandboxInfo":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class CommitResult:
    """What ``Sandbox.commit`` made: a new image, usable as ``DSecRunArgs(image=...)``."""

    image: str
    digest: str
    # Layer digests, bottom first; the last holds the sandbox's changes.
    layers: list[str] = field(default_factory=list)
    size_bytes: int = 0
    # How long the sandbox was frozen while its changes were copied (0 for vm sandboxes).
    paused_ms: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CommitResult":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class SnapshotInfo:
    """A sandbox's state kept under an id (``Sandbox.snapshot``), to start new sandboxes
    from (``DSecClient.restore_snapshot``) until it is deleted."""

    id: str
    edge: str
    source: str
    backend: str
    image: str
    project: str
    created_at_ms: int
    # Whether restored sandboxes carry its process memory (VM backends).
    memory_preserved: bool = False
    size_bytes: int = 0
    source_paused_ms: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SnapshotInfo":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class FunctionResult:
    """What a function call returned (``DSecClient.call``)."""

    function: str
    # The function's stdout parsed as JSON (its text when it is not JSON).
    output: Any
    stderr: str
    exit_code: int
    # Request at the node to answer, sandbox included; and the entry point's own time.
    duration_ms: int
    run_ms: int
    # The sandbox it ran in (stopped after) and the warm pool that sandbox came from.
    sandbox_id: str
    from_pool: str | None = None
    signal: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "FunctionResult":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class DSecClient:
    """Async client for the OpenDsec API.

    ``DSecClient()`` reads ``DSEC_API_URL``/``DSEC_API_KEY``, else the file named by
    ``DSEC_CONFIG``, else ``~/.config/dsec/client.toml`` (written by ``dsec up``).
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, timeout: float = 120.0):
        self.api_url, self.api_key = config.resolve(api_url, api_key)
        self._timeout = timeout
        self._http = Transport(self.api_url, {"Authorization": f"Bearer {self.api_key}"}, Timeout(timeout))

    async def __aenter__(self) -> "DSecClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, method: str, path: str, *, json: Any = None, params: Any = None,
                    content: Any = None, headers: dict[str, str] | None = None,
                    timeout: float | Timeout | None = None, stream: bool = False) -> Response:
        """Sends one request and returns the response, raising the matching DSecError for
        an error status. With ``stream`` the body is left unread: the caller closes it."""
        # Reads and deletes are safe to send again when a pooled connection went stale
        # (e.g. the server restarted); other calls are never repeated.
        attempts = 2 if method in ("GET", "DELETE") and content is None else 1
        t = timeout if isinstance(timeout, Timeout) else Timeout(timeout if timeout is not None else self._timeout)
        for attempt in range(attempts):
            try:
                r = await self._http.send(method, path, json=json, params=params, content=content,
                                          headers=headers, timeout=t, stream=stream)
                break
            except TransportError as e:
                if attempt + 1 < attempts:
                    continue
                raise UnavailableError("unavailable", f"cannot reach the OpenDsec API at {self.api_url}: {e}") from e
        if r.status_code >= 400:
            body: Any = None
            try:
                if stream:
                    await r.aread()
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
            except TransportError as e:
                body = f"(body unreadable: {e})"
            finally:
                if stream:
                    await r.aclose()
            err = from_response(r.status_code, body)
            err.headers = r.headers  # type: ignore[attr-defined]
            raise err
        return r

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None,
                       params: Any = None, headers: dict[str, str] | None = None) -> Any:
        r = await self._send(method, path, json=json, params=params, headers=headers, timeout=timeout)
        return _json_of(r)

    async def run_sandbox(self, args: DSecRunArgs | None = None, **kwargs: Any) -> "Sandbox":
        """Creates a sandbox and returns once it is running."""
        args = args or DSecRunArgs(**kwargs)
        info = await self._request("POST", "/v1/sandboxes", json=args.to_json())
        return Sandbox(self, SandboxInfo.from_json(info))

    async def get_sandbox(self, sandbox_id: str) -> "Sandbox":
        info = await self._request("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self, SandboxInfo.from_json(info))

    async def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        r = await self._request("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.from_json(s) for s in r["sandboxes"]]

    async def usage(self, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """What each of the key's sandboxes uses, from the node's last readings (one call for
        all of them): ``{"sandboxes": [{"id", "project", "state", "cpu_percent" (of one
        core, over the last interval), "memory_used_bytes", "memory_limit_bytes", ...}],
        "interval_ms"}``."""
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        return await self._request("GET", "/v1/usage", params=params)

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/status")

    async def functions(self) -> list[dict[str, Any]]:
        """The functions this key may call (the node's ``[[edge.functions]]``)."""
        return (await self._request("GET", "/v1/functions"))["functions"]

    async def call(self, name: str, input: Any = None, *, timeout: float | None = None,
                   project: str | None = None, check: bool = True) -> FunctionResult:
        """Calls function ``name`` with ``input`` (any JSON value, given to it on stdin)
        and returns what it wrote to stdout as ``.output``. Each call runs in a sandbox of
        its own, from the function's warm pool when one is ready.

        A function that exits non-zero raises ``FunctionError`` (``check=False`` returns
        its result instead); one past ``timeout`` seconds raises ``DeadlineExceededError``.

            r = await client.call("add", {"a": 1, "b": 2})
            print(r.output)
        """
        body: dict[str, Any] = {"input": input}
        if timeout is not None:
            body["timeout_seconds"] = timeout
        if project is not None:
            body["project"] = project
        wait = None if timeout is None else timeout + 60
        r = FunctionResult.from_json(await self._request(
            "POST", f"/v1/functions/{quote(name, safe='')}:call", json=body, timeout=wait))
        if check and r.exit_code != 0:
            raise FunctionError(r)
        return r

    async def list_snapshots(self) -> list[SnapshotInfo]:
        r = await self._request("GET", "/v1/snapshots")
        return [SnapshotInfo.from_json(s) for s in r["snapshots"]]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return SnapshotInfo.from_json(await self._request("GET", f"/v1/snapshots/{snapshot_id}"))

    async def restore_snapshot(self, snapshot_id: str, count: int = 1, labels: dict[str, str] | None = None,
                               edge: str | None = None) -> list["Sandbox"]:
        """Starts ``count`` sandboxes from a snapshot; a VM snapshot's carry its memory.

        ``edge`` (a cluster) starts them on that edge, which pulls the snapshot. The snapshot
        stays until :meth:`delete_snapshot`.
        """
        body: dict[str, Any] = {"count": count}
        if labels:
            body["labels"] = labels
        if edge:
            body["edge"] = edge
        r = await self._request("POST", f"/v1/snapshots/{snapshot_id}/restore", json=body, timeout=900.0)
        return [Sandbox(self, SandboxInfo.from_json(s)) for s in r["sandboxes"]]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._request("DELETE", f"/v1/snapshots/{snapshot_id}")

    # ---- Volumes: file systems kept apart from sandboxes, mounted by many at once ----

    async def create_volume(self, name: str, size_mb: int | None = None,
                            project: str | None = None) -> dict[str, Any]:
        """Creates volume ``name`` (unique in its project) of ``size_mb`` (default 1024,
        counted against the project's disk quota). Mount it with
        ``DSecRunArgs(volumes={"/mnt/data": name})``. Returns its ``id``, ``name``,
        ``project``, ``size_mb``, ``used_bytes`` and ``created_at_ms``."""
        body: dict[str, Any] = {"name": name}
        if size_mb is not None:
            body["size_mb"] = size_mb
        if project is not None:
            body["project"] = project
        return await self._request("POST", "/v1/volumes", json=body, timeout=300.0)

    async def volumes(self) -> list[dict[str, Any]]:
        """The volumes of the key's project and the projects inside it."""
        return (await self._request("GET", "/v1/volumes"))["volumes"]

    async def get_volume(self, volume_id: str) -> dict[str, Any]:
        return await self._request("GET", f"/v1/volumes/{volume_id}")

    async def delete_volume(self, volume_id: str) -> None:
        """Deletes a volume and its files (refused while a sandbox mounts it)."""
        await self._request("DELETE", f"/v1/volumes/{volume_id}")

    def volume(self, volume_id: str) -> "VolumeFiles":
        """The files of volume ``volume_id`` (no request is made)."""
        return VolumeFiles(self, volume_id)

    async def pause_group(self, labels: dict[str, str], to_disk: bool = False) -> dict[str, Any]:
        """Pauses every sandbox of yours that carries all ``labels`` (e.g. a preempted
        job's), in parallel. Returns ``{"done": [ids], "failed": [{id, code, message}],
        "took_ms": n}``."""
        return await self._request(
            "POST", "/v1/groups/pause", json={"labels": labels, "to_disk": to_disk}, timeout=600.0
        )

    async def resume_group(self, labels: dict[str, str]) -> dict[str, Any]:
        """Resumes every paused sandbox of yours that carries all ``labels``."""
        return await self._request("POST", "/v1/groups/resume", json={"labels": labels}, timeout=600.0)

    # ---- IAM: a key acts on its own project and the projects inside it ----

    async def images(self) -> list[dict[str, Any]]:
        """The images this key may use: ``reference``, ``digest`` and ``manifest`` each."""
        return (await self._request("GET", "/v1/images"))["images"]

    async def remove_image(self, reference: str) -> dict[str, Any]:
        """Removes image ``reference`` of the key's subtree and the layers nothing else uses
        (no other image, sandbox or snapshot); the disk it held in its project's quota is
        given back. Returns ``image``, ``removed`` and ``freed_layers``."""
        return await self._request("DELETE", f"/v1/images/{quote(reference, safe=':')}")

    async def pull_image(self, reference: str, *, target: str | None = None, username: str | None = None,
                         password: str | None = None, token: str | None = None, plain_http: bool = False,
                         ca_pem: str | None = None, lazy: bool = True, progress: Any = None) -> dict[str, Any]:
        """Pulls ``reference`` (``[registry/]repository[:tag][@digest]``) from an OCI registry
        into the node's image store as ``target`` (default: ``<key's project>/<name>:<tag>``).
        ``progress``, if given, is called with each step's line. Returns ``image``,
        ``digest``, ``layers``, ``fetched_layers``, ``cached_layers``, ``fetched_bytes`` and
        ``lazy``: with ``lazy`` (the default), an image whose lazy layers the registry has
        (``push_image`` sends them) is named at once and its layers are fetched by chunk as
        sandboxes read them.

        Keys outside ``root`` may pull only from the node's ``pull_registries``;
        ``plain_http`` and ``ca_pem`` are for keys of ``root``."""
        body: dict[str, Any] = {"reference": reference, "plain_http": plain_http, "lazy": lazy}
        for k, v in (("as", target), ("username", username), ("password", password), ("token", token),
                     ("ca_pem", ca_pem)):
            if v is not None:
                body[k] = v
        return await self._ndjson_result("/v1/images:pull", body, f"the pull of {reference}", progress)

    async def push_image(self, image: str, reference: str, *, username: str | None = None,
                         password: str | None = None, token: str | None = None, plain_http: bool = False,
                         ca_pem: str | None = None, lazy: bool = True, progress: Any = None) -> dict[str, Any]:
        """Pushes ``image`` of the node's store to ``reference`` (``registry/repository:tag``).
        Returns ``digest`` (the manifest's, in the registry), ``pushed_blobs``,
        ``skipped_blobs`` (those the registry had), ``pushed_bytes`` and ``lazy_digest``:
        with ``lazy`` (the default) the layers also go as EROFS images with chunk tables,
        in an artifact that refers to the image, so that nodes can start it lazily."""
        body: dict[str, Any] = {"image": image, "reference": reference, "plain_http": plain_http, "lazy": lazy}
        for k, v in (("username", username), ("password", password), ("token", token), ("ca_pem", ca_pem)):
            if v is not None:
                body[k] = v
        return await self._ndjson_result("/v1/images:push", body, f"the push of {image}", progress)

    async def set_registry_login(self, registry: str, *, username: str | None = None, password: str | None = None,
                                 token: str | None = None, project: str | None = None) -> dict[str, Any]:
        """Keeps a login for ``registry`` (``host[:port]``) for ``project`` (default: the
        key's own; one the key may write images of), sealed on the node: a username with a
        password, or a token. Pulls, pushes and builds that give no credentials use it; a
        project's login also serves the pulls of the projects inside it. Returns what is
        kept (``project``, ``registry``, ``kind``, ``username``), never the secret."""
        body: dict[str, Any] = {}
        for k, v in (("username", username), ("password", password), ("token", token), ("project", project)):
            if v is not None:
                body[k] = v
        return await self._request("PUT", f"/v1/registries/{quote(registry, safe=':')}/login", json=body)

    async def registry_logins(self) -> list[dict[str, Any]]:
        """The registry logins kept for the key's project and those inside it (never their
        secrets)."""
        return (await self._request("GET", "/v1/registries"))["logins"]

    async def delete_registry_login(self, registry: str, *, project: str | None = None) -> None:
        """Forgets ``project``'s (default: the key's) login for ``registry``."""
        q = f"?project={quote(project, safe='')}" if project else ""
        await self._request("DELETE", f"/v1/registries/{quote(registry, safe=':')}/login{q}")

    async def _ndjson_result(self, path: str, body: dict[str, Any], what: str, progress: Any) -> dict[str, Any]:
        """POSTs ``body`` and follows an answer of ``{"log": …}`` lines and a last line, the
        result or ``{"error": …}``."""
        r = await self._send("POST", path, json=body, timeout=_STREAM_TIMEOUT, stream=True)
        try:
            async for raw in r.aiter_lines():
                if not raw.strip():
                    continue
                line = _json.loads(raw)
                if "log" in line:
                    if progress is not None:
                        progress(line["log"])
                elif "error" in line:
                    raise from_event(line["error"])
                else:
                    return line
        except TransportError as e:
            raise UnavailableError("unavailable", f"{what} broke off: {e}") from e
        finally:
            await r.aclose()
        raise UnavailableError("unavailable", f"{what} ended without a result")

    # ---- lifecycle events and webhooks --------------------------------------------------

    async def events(self, after: int = 0, *, limit: int | None = None, sandbox: str | None = None,
                     type: str | list[str] | None = None, wait_seconds: float | None = None,
                     newest_first: bool = False, offset: int | None = None) -> dict[str, Any]:
        """Lifecycle events of the key's sandboxes (its project and inside) with ``seq`` over
        ``after``, oldest first (``newest_first``: newest first): ``{"events": [...],
        "next": seq}``; pass ``next`` as ``after`` for the next page, or page by
        ``offset``. ``wait_seconds`` (at most 60) waits for one when there is none yet.
        ``type`` is one type or a list of them: created, paused, resumed, updated, forked,
        snapshotted, stopped, expired, oom_killed."""
        params: list[tuple[str, Any]] = [("after", int(after))]
        for k, v in (("limit", limit), ("sandbox", sandbox), ("wait_seconds", wait_seconds),
                     ("offset", offset)):
            if v is not None:
                params.append((k, v))
        for t in ([type] if isinstance(type, str) else (type or [])):
            params.append(("type", t))
        if newest_first:
            params.append(("order", "desc"))
        t = None if wait_seconds is None else self._timeout + float(wait_seconds)
        return await self._request("GET", "/v1/events", params=params, timeout=t)

    async def create_webhook(self, url: str, *, types: list[str] | None = None,
                             project: str | None = None, name: str | None = None,
                             enabled: bool = True, secret: str | None = None,
                             format: str | None = None) -> dict[str, Any]:
        """Sends the events of ``project`` (default the key's; its sub-projects' too) to
        ``url``, one POST per event in order, retried with backoff. Each carries
        ``X-Dsec-Signature: t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>``
        (``format="e2b"``: E2B's body and ``e2b-signature``). ``secret`` (16 to 256
        bytes) is made when not given; the answer's ``secret`` is shown only now."""
        body: dict[str, Any] = {"url": url, "enabled": bool(enabled)}
        for k, v in (("types", list(types or []) or None), ("project", project), ("name", name),
                     ("secret", secret), ("format", format)):
            if v is not None:
                body[k] = v
        return await self._request("POST", "/v1/webhooks", json=body)

    async def update_webhook(self, webhook_id: str, *, url: str | None = None,
                             types: list[str] | None = None, name: str | None = None,
                             enabled: bool | None = None) -> dict[str, Any]:
        """Changes what is given (``types=[]``: all types); the rest stays."""
        body: dict[str, Any] = {}
        for k, v in (("url", url), ("types", None if types is None else list(types)), ("name", name),
                     ("enabled", enabled)):
            if v is not None:
                body[k] = v
        return await self._request("PATCH", f"/v1/webhooks/{webhook_id}", json=body)

    async def webhooks(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/webhooks"))["webhooks"]

    async def delete_webhook(self, webhook_id: str) -> None:
        await self._request("DELETE", f"/v1/webhooks/{webhook_id}")

    async def webhook_deliveries(self, webhook_id: str) -> list[dict[str, Any]]:
        """The webhook's last tries, oldest first: ``event``, ``type``, ``attempt``,
        ``status``, ``ok``, ``error``, ``at_ms``, ``took_ms``."""
        return (await self._request("GET", f"/v1/webhooks/{webhook_id}/deliveries"))["deliveries"]

    async def whoami(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/whoami")

    @staticmethod
    def _quota(sandboxes: int | None, cpu_cores: float | None, memory_mb: int | None,
               disk_mb: int | None = None) -> dict[str, Any]:
        q = {"sandboxes": sandboxes, "cpu_cores": cpu_cores, "memory_mb": memory_mb, "disk_mb": disk_mb}
        return {k: v for k, v in q.items() if v is not None}

    async def create_project(self, project: str, *, sandboxes: int | None = None,
                             cpu_cores: float | None = None, memory_mb: int | None = None,
                             disk_mb: int | None = None) -> dict[str, Any]:
        """Creates ``project`` (e.g. ``root/team-a/exp-1``) with a quota delegated from its parent.
        ``disk_mb`` counts sandboxes' disk limits, snapshots and committed images."""
        body = {"project": project, "quota": self._quota(sandboxes, cpu_cores, memory_mb, disk_mb)}
        return await self._request("POST", "/v1/projects", json=body)

    async def set_quota(self, project: str, *, sandboxes: int | None = None,
                        cpu_cores: float | None = None, memory_mb: int | None = None,
                        disk_mb: int | None = None) -> dict[str, Any]:
        """Sets a project's quota; only a key of a parent project can."""
        body = {"project": project, "quota": self._quota(sandboxes, cpu_cores, memory_mb, disk_mb)}
        return await self._request("POST", "/v1/projects/quota", json=body)

    async def projects(self) -> list[dict[str, Any]]:
        """Projects this key can see, each with ``quota`` and ``usage``."""
        return (await self._request("GET", "/v1/projects"))["projects"]

    async def create_key(self, principal: str, *, project: str | None = None, agent: bool = False,
                         e2b_format: bool = False) -> dict[str, Any]:
        """Makes an API key (``["key"]``, shown only now) for a person or an agent; with
        ``e2b_format`` in E2B's shape (``e2b_`` and 40 hex digits), for programs written for
        E2B that check it."""
        body: dict[str, Any] = {"principal": principal, "kind": "agent" if agent else "human"}
        if e2b_format:
            body["format"] = "e2b"
        if project is not None:
            body["project"] = project
        return await self._request("POST", "/v1/keys", json=body)

    async def keys(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/keys"))["keys"]

    async def revoke_key(self, key_id: str) -> None:
        await self._request("DELETE", f"/v1/keys/{key_id}")


def _json_of(r: Response) -> Any:
    if r.status_code == 204 or not r.content:
        return None
    return r.json()


def _exec_body(argv: list[str] | None, cmd: str | None, env: dict[str, str] | None, cwd: str | None,
               user: str | int | None, timeout: float | None, stdin: str | None) -> dict[str, Any]:
    if argv is None and cmd is None:
        raise ValueError("exec needs argv (a list of strings) or cmd (a shell command line)")
    if isinstance(argv, str):
        raise TypeError("argv must be a list of strings; pass a shell command line as cmd=")
    body: dict[str, Any] = {}
    if argv is not None:
        body["argv"] = list(argv)
    if cmd is not None:
        body["cmd"] = cmd
    if env:
        body["env"] = env
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        # The API takes a user name or a numeric uid, both as a string.
        body["user"] = str(user)
    if timeout is not None:
        body["timeout_seconds"] = timeout
    if stdin is not None:
        body["stdin"] = stdin
    return body


def _pty_size(pty: Any) -> dict[str, int] | None:
    if pty is None or pty is False:
        return None
    if pty is True:
        return {"cols": 80, "rows": 24}
    if isinstance(pty, dict):
        return {"cols": int(pty["cols"]), "rows": int(pty["rows"])}
    cols, rows = pty
    return {"cols": int(cols), "rows": int(rows)}


def _http_timeout(timeout: float | None) -> float:
    return (timeout if timeout is not None else 600.0) + _EXEC_SLACK_S


def _mode_param(mode: int | str) -> str:
    """A file mode for the ``mode=`` query parameter, which is octal text (``644``)."""
    if isinstance(mode, int):
        return format(mode, "o")
    m = str(mode)
    return m[2:] if m.startswith("0o") else m


def _as_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


class Sandbox:
    """One running sandbox. ``async with`` stops it on exit."""

    def __init__(self, client: DSecClient, info: SandboxInfo):
        self._client = client
        self.info = info
        self.files = Files(self)
        self.sessions = Sessions(self)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def _base(self) -> str:
        return f"/v1/sandboxes/{self.id}"

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, image={self.info.image!r}, state={self.info.state!r})"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- processes -------------------------------------------------------------------

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        cmd: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        """Runs a program (argv) or a shell command line (cmd) and waits for it.

        ``user`` is a name from the sandbox's /etc/passwd or a numeric uid (default root).
        """
        body = _exec_body(argv, cmd, env, cwd, user, timeout, stdin)
        r = await self._client._request("POST", f"{self._base}/exec", json=body, timeout=_http_timeout(timeout))
        return ExecResult.from_json(r)

    async def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        """Runs ``command`` with /bin/sh -c; returns stdout, stderr and exit_code."""
        return await self.exec(cmd=command, **kwargs)

    async def exec_stream(
        self,
        argv: list[str] | None = None,
        *,
        cmd: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        pty: Any = None,
        tag: str | None = None,
    ) -> "Process":
        """Starts a process and returns once it runs (``.pid`` is set), its output to be
        read as it comes: ``async for stream, data in p`` and/or ``await p.wait()``.

        Stdin stays open for ``p.send_stdin`` unless ``stdin`` is given (then it is
        written and closed). ``pty`` is True (80x24), ``(cols, rows)`` or a dict: the
        process gets a terminal and all its output arrives as ``stdout``. If this client
        goes away the process keeps running; ``attach(pid)`` reads it again.
        """
        body = _exec_body(argv, cmd, env, cwd, user, timeout, stdin if isinstance(stdin, str) else None)
        body["stream"] = True
        size = _pty_size(pty)
        if size:
            body["pty"] = size
        if tag is not None:
            body["tag"] = tag
        r = await self._client._send("POST", f"{self._base}/exec", json=body, timeout=_STREAM_TIMEOUT, stream=True)
        p = Process(self, response=r)
        try:
            await p._wait_started()
            if isinstance(stdin, (bytes, bytearray, memoryview)):
                await p.send_stdin(bytes(stdin), close=True)
        except BaseException:
            await p.close()
            raise
        return p

    async def exec_background(
        self,
        argv: list[str] | None = None,
        *,
        cmd: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
        pty: Any = None,
        tag: str | None = None,
    ) -> "Process":
        """Starts a process that runs on its own (until it ends, times out or is
        signalled) and returns at once. Iterating or waiting on the returned Process
        attaches to it (kept output first, then live output)."""
        body = _exec_body(argv, cmd, env, cwd, user, timeout, stdin)
        body["background"] = True
        size = _pty_size(pty)
        if size:
            body["pty"] = size
        if tag is not None:
            body["tag"] = tag
        r = await self._client._request("POST", f"{self._base}/exec", json=body)
        return Process(self, pid=int(r["pid"]))

    async def attach(self, pid: int) -> "Process":
        """Attaches to a process started with ``exec_stream`` or ``exec_background`` (from
        this client or any other): its kept output first, then live output, then its exit.
        Raises NotFoundError for an unknown pid."""
        p = Process(self, pid=pid)
        await p._attach()
        return p

    async def processes(self) -> list[dict[str, Any]]:
        """Managed processes, running ones and the last finished ones:
        ``{"pid","argv","tag","cwd","pty","running","exit_code","started_at_ms"}``."""
        r = await self._client._request("GET", f"{self._base}/processes")
        return list(r["processes"])

    async def pty(
        self,
        cmd: str | list[str] = "/bin/bash",
        cols: int = 80,
        rows: int = 24,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        *,
        user: str | int | None = None,
        timeout: float | None = None,
    ) -> "Process":
        """Starts ``cmd`` on a terminal of ``cols`` x ``rows`` and returns the Process.

        ``cmd`` as a list is the argv. As a string: without whitespace it is the program
        (argv ``[cmd]``); with whitespace it is a shell command line, run as
        ``["/bin/sh", "-c", cmd]`` (so quoting and pipes work as in a shell). ``TERM`` is
        set to ``xterm-256color`` unless ``env`` sets it.
        """
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd] if any(c.isspace() for c in cmd) else [cmd]
        else:
            argv = list(cmd)
        e = {"TERM": "xterm-256color", **(env or {})}
        return await self.exec_stream(argv, env=e, cwd=cwd, user=user, timeout=timeout, pty=(cols, rows))

    # ---- trajectories ----------------------------------------------------------------

    async def trajectory(self, name: str, resume: bool = False) -> "Trajectory":
        """A trajectory: a named log of steps (execs, session commands, file changes) that
        a client can replay after it was interrupted. Steps are numbered 1, 2, … per
        Trajectory object; a step already in the log is answered from it without running.

        With ``resume=False`` the name must be new (PreconditionError otherwise); pass
        ``resume=True`` to run the same steps again after an interruption.
        """
        if not resume:
            log = await self.trajectory_log(name, missing_ok=True)
            steps = (log.get("steps") or []) if log else []
            if steps:
                raise PreconditionError(
                    "failed_precondition",
                    f"trajectory {name!r} of sandbox {self.id} already has {len(steps)} step(s): pass "
                    "resume=True to replay them and continue, or choose another name",
                    409,
                )
        return Trajectory(self, name)

    async def trajectory_log(self, name: str, missing_ok: bool = False) -> dict[str, Any] | None:
        """``{"name", "steps": [{"seq","kind","request","result","started_at_ms","finished_at_ms"}]}``.
        A trajectory with no steps yet is NotFoundError, or None with ``missing_ok``."""
        try:
            return await self._client._request("GET", f"{self._base}/trajectories/{name}")
        except DSecError as e:
            if missing_ok and e.code == "not_found":
                return None
            raise

    async def trajectories(self) -> list[dict[str, Any]]:
        """The sandbox's trajectories, names and step counts."""
        r = await self._client._request("GET", f"{self._base}/trajectories")
        if isinstance(r, dict) and "trajectories" in r:
            return list(r["trajectories"])
        return list(r or [])

    # ---- the sandbox itself ----------------------------------------------------------

    async def fork(self, count: int = 1, labels: dict[str, str] | None = None,
                   edge: str | None = None) -> list["Sandbox"]:
        """Makes ``count`` copies of this sandbox.

        VM sandboxes (``backend="vm"``): each copy carries the source's memory, so its
        processes go on from where the source was, and the copies share unchanged memory
        pages with each other; each gets its own clock step, RNG reseed and id
        (``DSEC_SANDBOX_ID``). Container sandboxes: the copies get this sandbox's files
        (its writable layer) but not its process memory; their processes start fresh.

        ``edge`` (a cluster, VM sandboxes) makes the copies on that edge: it pulls the
        snapshot from this sandbox's edge.
        """
        body: dict[str, Any] = {"count": count}
        if labels:
            body["labels"] = labels
        if edge:
            body["edge"] = edge
        r = await self._client._request("POST", f"{self._base}/fork", json=body, timeout=600.0)
        self.last_fork = r
        return [Sandbox(self._client, SandboxInfo.from_json(s)) for s in r["sandboxes"]]

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.from_json(await self._client._request("GET", self._base))
        return self.info

    async def metrics(self) -> dict[str, Any]:
        """What the running sandbox uses now: ``cpu_used_ns`` (CPU time so far),
        ``memory_used_bytes``, ``memory_cache_bytes``, ``memory_limit_bytes``,
        ``disk_used_bytes``, ``disk_total_bytes``, ``cpu_cores``, ``timestamp_ms``."""
        return await self._client._request("GET", f"{self._base}/metrics")

    async def metrics_history(self, start_ms: int | None = None, end_ms: int | None = None) -> dict[str, Any]:
        """The node's kept readings of the sandbox's CPU time and memory (one every
        ``interval_ms`` while it ran, the last 360) from ``start_ms`` to ``end_ms``
        (milliseconds since the epoch): ``{"interval_ms", "cpu_cores",
        "memory_limit_bytes", "samples": [{"timestamp_ms", "cpu_used_ns",
        "memory_used_bytes", "memory_cache_bytes"}]}``, oldest first."""
        params = {k: v for k, v in (("start_ms", start_ms), ("end_ms", end_ms)) if v is not None}
        return await self._client._request("GET", f"{self._base}/metrics/history", params=params or None)

    def port_url(self, port: int, path: str = "/", with_token: bool = True) -> str:
        """URL of ``port`` inside the sandbox, through the API (HTTP and WebSocket).

        With ``with_token`` the URL carries the sandbox's port token, so it opens without an
        API key (e.g. in a browser); otherwise send the API key as usual.
        """
        url = f"{self._client.api_url.rstrip('/')}/v1/sandboxes/{self.id}/ports/{int(port)}/{path.lstrip('/')}"
        if with_token and self.info.port_token:
            url += ("&" if "?" in url else "?") + f"dsec_token={self.info.port_token}"
        return url

    async def snapshot(self, labels: dict[str, str] | None = None) -> SnapshotInfo:
        """Keeps this sandbox's state under a new id (it pauses briefly): a VM's memory and
        devices, a container's files. Start sandboxes from it with
        ``DSecClient.restore_snapshot``; it stays until ``delete_snapshot``. Its labels are
        the sandbox's with ``labels`` over them."""
        body = {"labels": labels} if labels else None
        r = await self._client._request("POST", f"{self._base}/snapshot", json=body, timeout=900.0)
        return SnapshotInfo.from_json(r)

    async def pause(self, to_disk: bool = False) -> SandboxInfo:
        """Pauses the sandbox: its processes stop where they are and its TTL stops running.

        ``to_disk=True`` ends its processes instead, so the host's memory is freed until
        :meth:`resume`: a VM's memory is written to disk and restored on resume; a
        container keeps its files and starts afresh on resume (running processes are
        gone; its image's start command runs again).
        """
        r = await self._client._request("POST", f"{self._base}/pause", json={"to_disk": to_disk}, timeout=600.0)
        self.info = SandboxInfo.from_json(r)
        return self.info

    async def resume(self, edge: str | None = None) -> SandboxInfo:
        """Resumes a paused sandbox where it stopped (from disk if it was paused to disk).

        ``edge`` (a cluster, VM sandboxes) resumes it on that edge instead: it is paused to
        disk first if it was not, the other edge pulls its state, and it goes on there
        under a new id; this object follows it (``info.moved_from`` is the old id).
        """
        body = {"edge": edge} if edge else None
        r = await self._client._request("POST", f"{self._base}/resume", json=body, timeout=900.0)
        self.info = SandboxInfo.from_json(r)
        return self.info

    async def set_timeout(self, ttl_seconds: int) -> SandboxInfo:
        """Sets the remaining lifetime to ``ttl_seconds`` from now."""
        r = await self._client._request("POST", f"{self._base}/timeout", json={"ttl_seconds": ttl_seconds})
        self.info = SandboxInfo.from_json(r)
        return self.info

    keep_alive = set_timeout

    async def set_network_rules(self, network_rules: dict[str, bool],
                                egress_headers: dict[str, dict[str, str]] | None = None) -> SandboxInfo:
        """Replaces what the sandbox may reach (same keys as ``DSecRunArgs.network_rules``)
        and the headers set on its requests (as ``DSecRunArgs.egress_headers``; none: no
        headers after); ``{}`` closes egress. New connections follow the new rules at once."""
        r = await self._client._request("PUT", f"{self._base}/network",
                                        json={"network_rules": network_rules,
                                              "egress_headers": egress_headers or {}})
        self.info = SandboxInfo.from_json(r)
        return self.info

    async def commit(self, image: str, overwrite: bool = False) -> CommitResult:
        """Turns this sandbox's filesystem changes into a new image ``image``
        (``<project>/name[:tag]``, e.g. ``root/t1/env:v1``): one more layer on top of the
        sandbox's image, with its env and workdir. Any later sandbox, container or vm, can
        start from it. The image must lie in the key's project or one inside it
        (``PermissionDeniedError`` otherwise); shared images of parent projects are read-only.

        An existing ``image`` is replaced only with ``overwrite=True``; otherwise the call
        raises ``AlreadyExistsError``. A container sandbox is frozen while its changes are
        copied; a vm sandbox keeps running, so write nothing in it meanwhile.
        """
        r = await self._client._request(
            "POST", f"{self._base}/commit", json={"image": image, "overwrite": overwrite}, timeout=1800.0
        )
        return CommitResult.from_json(r)

    async def stop(self) -> None:
        """Stops the sandbox; stopping one that is already gone is not an error."""
        try:
            await self._client._request("DELETE", self._base, timeout=120.0)
        except DSecError as e:
            if e.code != "not_found":
                raise


class _Ndjson:
    """Reads one NDJSON response line by line; ``next()`` is None at the end."""

    def __init__(self, response: Response):
        self.response = response
        self._lines = response.aiter_lines()

    async def next(self) -> dict[str, Any] | None:
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                return None
            except TransportError as e:
                raise UnavailableError("unavailable", f"the stream from the OpenDsec API broke: {e}") from e
            line = line.strip()
            if line:
                return _event(_json.loads(line))

    async def close(self) -> None:
        await self.response.aclose()


_EVENT_NAMES = ("start", "stdout", "stderr", "exit", "error", "ready")


def _event(d: Any) -> dict[str, Any]:
    """An event as a dict with its kind in ``type`` (also accepts ``event`` as the key, or a
    one-key ``{"exit": {...}}`` object)."""
    if isinstance(d, dict):
        if "type" in d:
            return d
        if "event" in d:
            return {**d, "type": d["event"]}
        if len(d) == 1:
            (k, v), = d.items()
            if k in _EVENT_NAMES and isinstance(v, dict):
                return {**v, "type": k}
    raise DSecError("internal", f"unexpected event in a stream from the OpenDsec API: {d!r}")


def _signal_value(sig: int | str | _signal.Signals) -> int | str:
    if isinstance(sig, _signal.Signals):
        return int(sig)
    if isinstance(sig, int):
        return sig
    s = str(sig).strip().upper()
    if s.isdigit():
        return int(s)
    # Sent by name: the server knows the sandbox's (Linux) numbers.
    return s if s.startswith("SIG") else "SIG" + s


class Process:
    """A process started with ``exec_stream``, ``exec_background``, ``pty`` or found with
    ``attach``.

    ``async for stream, data in p`` yields ``("stdout" | "stderr", bytes)`` chunks as they
    come and ends at the exit; ``await p.wait()`` reads the rest and returns the
    ExecResult, whose stdout/stderr hold everything this object read (the last 16 MiB of
    each). An ``error`` event raises the matching DSecError. ``close()`` (or leaving
    ``async with``) stops reading; the process keeps running. One reader at a time.
    """

    def __init__(self, sandbox: Sandbox, pid: int | None = None, response: Response | None = None,
                 keep_output: int = _KEEP_OUTPUT):
        self._sb = sandbox
        self.pid = pid
        self._stream = _Ndjson(response) if response is not None else None
        self._pending: deque[tuple[str, bytes]] = deque()
        self._keep = keep_output
        self._out = {"stdout": bytearray(), "stderr": bytearray()}
        self._dropped = {"stdout": False, "stderr": False}
        self.result: ExecResult | None = None

    def __repr__(self) -> str:
        state = "running" if self.result is None else f"exited {self.result.exit_code}"
        return f"Process(pid={self.pid}, sandbox={self._sb.id!r}, {state})"

    @property
    def _path(self) -> str:
        if self.pid is None:
            raise DSecError("failed_precondition", "the process has no pid yet (its start event has not arrived)")
        return f"{self._sb._base}/processes/{self.pid}"

    async def __aenter__(self) -> "Process":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _attach(self) -> None:
        r = await self._sb._client._send("GET", f"{self._path}/output", timeout=_STREAM_TIMEOUT, stream=True)
        self._stream = _Ndjson(r)

    async def _wait_started(self) -> None:
        """Reads events until ``start`` (keeping any output that came first)."""
        while self.pid is None:
            item = await self._read(until_start=True)
            if item is None:
                if self.result is not None:
                    return  # exited before it said it started: nothing left to wait for
                raise DSecError("internal", "the stream ended before the process started")
            if item[0] != "start":
                self._pending.append(item)

    async def _read(self, until_start: bool = False) -> tuple[str, bytes] | None:
        """The next output chunk (or with ``until_start``, also ``("start", b"")``); None
        once the process exited (``self.result`` set)."""
        if self.result is not None:
            return None
        if self._stream is None:
            await self._attach()
        assert self._stream is not None
        while True:
            ev = await self._stream.next()
            if ev is None:
                await self.close()
                raise UnavailableError("unavailable", f"the output stream of process {self.pid} ended before its exit")
            kind = ev["type"]
            if kind == "start":
                self.pid = int(ev["pid"])
                if until_start:
                    return "start", b""
            elif kind in ("stdout", "stderr"):
                data = base64.b64decode(ev.get("data") or "")
                self._keep_chunk(kind, data)
                return kind, data
            elif kind == "exit":
                self._finish(ev)
                await self.close()
                return None
            elif kind == "error":
                await self.close()
                raise from_event(ev)
            # Unknown event kinds are skipped: newer servers may add some.

    def _keep_chunk(self, kind: str, data: bytes) -> None:
        buf = self._out[kind]
        buf += data
        if len(buf) > 2 * self._keep:
            del buf[: len(buf) - self._keep]
            self._dropped[kind] = True

    def _finish(self, ev: dict[str, Any]) -> None:
        out = {}
        for k in ("stdout", "stderr"):
            buf = self._out[k]
            if len(buf) > self._keep:
                del buf[: len(buf) - self._keep]
                self._dropped[k] = True
            out[k] = bytes(buf).decode("utf-8", errors="replace")
        self.result = ExecResult(
            stdout=out["stdout"],
            stderr=out["stderr"],
            exit_code=ev.get("exit_code"),  # type: ignore[arg-type]
            signal=ev.get("signal"),
            timed_out=bool(ev.get("timed_out")),
            oom_killed=bool(ev.get("oom_killed")),
            stdout_truncated=bool(ev.get("stdout_truncated")) or self._dropped["stdout"],
            stderr_truncated=bool(ev.get("stderr_truncated")) or self._dropped["stderr"],
            duration_ms=ev.get("duration_ms") or 0,
        )
        self._out = {"stdout": bytearray(), "stderr": bytearray()}

    def __aiter__(self) -> "Process":
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        if self._pending:
            return self._pending.popleft()
        item = await self._read()
        if item is None:
            raise StopAsyncIteration
        return item

    async def wait(self) -> ExecResult:
        """Reads the output to the end and returns the result."""
        self._pending.clear()  # already kept
        while await self._read() is not None:
            pass
        assert self.result is not None
        return self.result

    @property
    def exited(self) -> bool:
        return self.result is not None

    async def send_stdin(self, data: bytes | str, close: bool = False) -> None:
        """Writes ``data`` to the process's stdin (to its terminal for a PTY process)."""
        params = {"close": "true"} if close else None
        await self._sb._client._send("POST", f"{self._path}/stdin", params=params, content=_as_bytes(data),
                                     headers={"content-type": "application/octet-stream"})

    async def close_stdin(self) -> None:
        await self.send_stdin(b"", close=True)

    async def signal(self, sig: int | str | _signal.Signals) -> None:
        """Sends a signal (a number, ``"SIGTERM"``/``"TERM"``, or a ``signal.Signals``) to
        the process's group."""
        await self._sb._client._request("POST", f"{self._path}/signal", json={"signal": _signal_value(sig)})

    async def kill(self) -> None:
        await self.signal(9)

    async def resize(self, cols: int, rows: int) -> None:
        """Resizes the terminal of a PTY process."""
        await self._sb._client._request("POST", f"{self._path}/resize", json={"cols": int(cols), "rows": int(rows)})

    async def close(self) -> None:
        """Stops reading the output (the process keeps running)."""
        if self._stream is not None:
            s, self._stream = self._stream, None
            await s.close()


class Files:
    """The sandbox's filesystem (``sb.files``). Relative paths are resolved against the
    image's working directory (else ``/``)."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    @property
    def _base(self) -> str:
        return f"{self._sb._base}/files"

    async def read(self, path: str) -> bytes:
        """The file's bytes (NotFoundError if missing, InvalidArgumentError for a directory)."""
        r = await self._sb._client._send("GET", self._base, params={"path": path})
        return r.content

    async def read_text(self, path: str, encoding: str = "utf-8", errors: str = "strict") -> str:
        return (await self.read(path)).decode(encoding, errors)

    async def read_to(self, path: str, local_path: PathLike | BinaryIO, chunk_size: int = 1 << 20) -> int:
        """Streams the file into ``local_path`` (a path or a binary file object) in bounded
        memory; returns the number of bytes written."""
        client = self._sb._client
        r = await client._send("GET", self._base, params={"path": path}, stream=True,
                               timeout=Timeout(client._timeout))
        own = not hasattr(local_path, "write")
        f: Any = open(local_path, "wb") if own else local_path  # type: ignore[arg-type]
        n = 0
        # The socket gives small pieces: gather about chunk_size, then write it off the loop.
        parts: list[bytes] = []
        held = 0
        try:
            async for piece in r.aiter_bytes():
                parts.append(piece)
                held += len(piece)
                if held >= chunk_size:
                    await asyncio.to_thread(f.write, b"".join(parts))
                    n += held
                    parts, held = [], 0
            if parts:
                await asyncio.to_thread(f.write, b"".join(parts))
                n += held
        except TransportError as e:
            raise UnavailableError("unavailable", f"download of {path} broke after {n} bytes: {e}") from e
        finally:
            await r.aclose()
            if own:
                f.close()
        return n

    async def write(self, path: str, data: bytes | str, mode: int | str | None = None,
                    append: bool = False, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        """Writes (or with ``append`` appends) ``data``, creating parent directories.
        ``mode`` is a number (``0o644``) or octal text (``"644"``). ``metadata`` (lower-case
        keys, printable ASCII values) replaces the file's metadata, kept as its
        ``user.e2b.*`` extended attributes and shown by ``stat``/``list``; without it a
        write clears the metadata and an append keeps it. Returns ``{"path","size"}``."""
        return await self._put(path, _as_bytes(data), mode, append, _metadata_headers(metadata))

    async def write_from(self, path: str, local_path: PathLike | BinaryIO, mode: int | str | None = None,
                         chunk_size: int = 1 << 20) -> dict[str, Any]:
        """Streams a local file (a path or a binary file object) into ``path`` in bounded
        memory. Returns ``{"path","size"}``."""
        own = not hasattr(local_path, "read")
        f: Any = open(local_path, "rb") if own else local_path  # type: ignore[arg-type]
        headers = None
        try:
            if own:
                headers = {"content-length": str(os.fstat(f.fileno()).st_size)}

            async def chunks() -> AsyncIterator[bytes]:
                while True:
                    b = await asyncio.to_thread(f.read, chunk_size)
                    if not b:
                        return
                    yield b

            return await self._put(path, chunks(), mode, False, headers)
        finally:
            if own:
                f.close()

    async def _put(self, path: str, content: Any, mode: int | str | None, append: bool,
                   headers: dict[str, str] | None) -> dict[str, Any]:
        params: dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = _mode_param(mode)
        if append:
            params["append"] = "true"
        h = {"content-type": "application/octet-stream", **(headers or {})}
        client = self._sb._client
        r = await client._send("PUT", self._base, params=params, content=content, headers=h,
                               timeout=Timeout(client._timeout))
        return _json_of(r)

    async def write_many(self, files: Iterable[Any]) -> list[dict[str, Any]]:
        """Writes several small files in one call. Each item is ``(path, data)``,
        ``(path, data, mode)`` or ``{"path", "data", "mode"?, "metadata"?}`` with data bytes or str.
        Returns ``[{"path","size"}]``."""
        return (await self._sb._client._request("POST", f"{self._base}/batch", json=_batch_body(files)))["written"]

    async def stat(self, path: str) -> dict[str, Any]:
        """``{"path","name","type" (file/dir/symlink/other),"size","mode","uid","gid","mtime_ms","target"}``."""
        return await self._sb._client._request("GET", f"{self._base}/stat", params={"path": path})

    async def list(self, path: str, depth: int = 1) -> list[dict[str, Any]]:
        """Entries (stat dicts) under the directory ``path``, ``depth`` levels deep, sorted by path."""
        r = await self._sb._client._request("GET", f"{self._base}/list", params={"path": path, "depth": int(depth)})
        return list(r["entries"])

    async def exists(self, path: str) -> bool:
        r = await self._sb._client._request("GET", f"{self._base}/exists", params={"path": path})
        return bool(r["exists"])

    async def mkdir(self, path: str) -> dict[str, Any]:
        """Creates a directory and its parents (like ``mkdir -p``); returns its stat."""
        return await self._sb._client._request("POST", f"{self._base}/mkdir", json={"path": path})

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._sb._client._request("POST", f"{self._base}/remove", json={"path": path, "recursive": recursive})

    async def rename(self, src: str, dst: str) -> dict[str, Any]:
        """Renames ``src`` to ``dst``; returns the stat of ``dst``."""
        return await self._sb._client._request("POST", f"{self._base}/rename", json={"from": src, "to": dst})

    async def chmod(self, path: str, mode: int) -> dict[str, Any]:
        """Sets permission bits (a number: ``0o755``); returns the stat."""
        return await self._sb._client._request("POST", f"{self._base}/chmod", json={"path": path, "mode": int(mode)})

    async def chown(self, path: str, uid: int, gid: int) -> dict[str, Any]:
        return await self._sb._client._request("POST", f"{self._base}/chown",
                                               json={"path": path, "uid": int(uid), "gid": int(gid)})

    def watch(self, path: str, recursive: bool = True, *, entry: bool = False,
              allow_network_mounts: bool = False) -> "Watch":
        """Watches ``path`` for changes. Either ``async with sb.files.watch(p) as w:`` or
        ``w = await sb.files.watch(p)`` (then ``await w.close()``); both return once the
        watch is in place. ``async for ev in w`` yields ``{"type","path","is_dir"}`` (and
        ``from`` for a rename), type one of create, write, remove, rename, chmod; with
        ``entry`` also ``entry``, the stat after the change (not for a removal). A
        directory on a network filesystem is refused unless ``allow_network_mounts``."""
        return Watch(self._sb, path, recursive, entry, allow_network_mounts)


def _metadata_headers(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    return {f"x-dsec-metadata-{k}": v for k, v in metadata.items()}


def _batch_body(files: Iterable[Any]) -> dict[str, Any]:
    out = []
    for item in files:
        metadata = None
        if isinstance(item, dict):
            path, data, mode, metadata = item["path"], item["data"], item.get("mode"), item.get("metadata")
        elif len(item) == 3:
            path, data, mode = item
        else:
            (path, data), mode = item, None
        e: dict[str, Any] = {"path": path, "data": base64.b64encode(_as_bytes(data)).decode()}
        if mode is not None:
            e["mode"] = int(mode, 8) if isinstance(mode, str) else int(mode)
        if metadata is not None:
            e["metadata"] = dict(metadata)
        out.append(e)
    return {"files": out}


class Watch:
    """A directory watch; see ``Files.watch``."""

    def __init__(self, sandbox: Sandbox, path: str, recursive: bool, entry: bool = False,
                 allow_network_mounts: bool = False):
        self._sb = sandbox
        self.path = path
        self.recursive = recursive
        self.entry = entry
        self.allow_network_mounts = allow_network_mounts
        self._stream: _Ndjson | None = None
        self._closed = False

    async def _open(self) -> "Watch":
        if self._stream is not None:
            return self
        params = {"path": self.path}
        for name in ("recursive", "entry", "allow_network_mounts"):
            if getattr(self, name):
                params[name] = "true"
        r = await self._sb._client._send("GET", f"{self._sb._base}/files/watch", params=params,
                                         timeout=_STREAM_TIMEOUT, stream=True)
        self._stream = _Ndjson(r)
        try:
            while True:
                ev = await self._stream.next()
                if ev is None:
                    raise UnavailableError("unavailable", f"the watch on {self.path} ended before it was ready")
                if ev["type"] == "error":
                    raise from_event(ev)
                if ev["type"] == "ready":
                    return self
        except BaseException:
            await self.close()
            raise

    def __await__(self):  # type: ignore[no-untyped-def]
        return self._open().__await__()

    async def __aenter__(self) -> "Watch":
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> "Watch":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._stream is None:
            if self._closed:
                raise StopAsyncIteration
            await self._open()
        assert self._stream is not None
        while True:
            ev = await self._stream.next()
            if ev is None:
                await self.close()
                raise StopAsyncIteration
            if ev["type"] == "error":
                await self.close()
                raise from_event(ev)
            if ev["type"] != "ready":
                return ev

    async def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            s, self._stream = self._stream, None
            await s.close()


class Sessions:
    """Persistent shells (``sb.sessions``): the working directory, exported variables and
    shell functions carry over between commands."""

    def __init__(self, sandbox: Sandbox):
        self._sb = sandbox

    async def create(self, cwd: str | None = None, env: dict[str, str] | None = None) -> "Session":
        body: dict[str, Any] = {}
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = env
        r = await self._sb._client._request("POST", f"{self._sb._base}/sessions", json=body)
        return Session(self._sb, r["session_id"], r.get("pid"), r.get("shell"))

    async def list(self) -> list[dict[str, Any]]:
        """``[{"session_id","pid","shell","busy","commands"}]``."""
        r = await self._sb._client._request("GET", f"{self._sb._base}/sessions")
        return list(r["sessions"])

    def get(self, session_id: str) -> "Session":
        """A handle on an existing session (no request is made)."""
        return Session(self._sb, session_id)


class Session:
    """One persistent shell. ``async with`` kills it on exit."""

    def __init__(self, sandbox: Sandbox, session_id: str, pid: int | None = None, shell: str | None = None):
        self._sb = sandbox
        self.id = session_id
        self.pid = pid
        self.shell = shell

    def __repr__(self) -> str:
        return f"Session({self.id!r}, shell={self.shell!r})"

    @property
    def _path(self) -> str:
        return f"{self._sb._base}/sessions/{self.id}"

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    async def run(self, cmd: str, timeout: float | None = None) -> SessionResult:
        """Runs ``cmd`` in the shell and waits for it."""
        r = await self._sb._client._request("POST", f"{self._path}/run", json=_session_body(cmd, timeout, False),
                                            timeout=_http_timeout(timeout))
        return SessionResult.from_json(r)

    async def run_background(self, cmd: str, timeout: float | None = None) -> Any:
        """Starts ``cmd`` and returns its command_id at once; see ``command`` and ``wait``."""
        r = await self._sb._client._request("POST", f"{self._path}/run", json=_session_body(cmd, timeout, True))
        return r["command_id"]

    async def command(self, command_id: Any) -> dict[str, Any]:
        """A command's state: ``running`` with the output so far, or ``done`` with its result."""
        return await self._sb._client._request("GET", f"{self._path}/commands/{command_id}")

    async def wait(self, command_id: Any, timeout: float | None = None, poll: float = 0.1) -> SessionResult:
        """Polls a background command until it is done (TimeoutError after ``timeout`` s)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            r = SessionResult.from_json(await self.command(command_id))
            if r.done:
                return r
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"session command {command_id} still running after {timeout} s")
            await asyncio.sleep(poll)

    async def kill(self) -> None:
        """Ends the shell and every process it started (daemons included); killing a
        session that is already gone is not an error."""
        try:
            await self._sb._client._request("DELETE", self._path)
        except DSecError as e:
            if e.code != "not_found":
                raise


def _session_body(cmd: str, timeout: float | None, background: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd}
    if timeout is not None:
        body["timeout_seconds"] = timeout
    if background:
        body["background"] = True
    return body


class Trajectory:
    """Steps sent with ``X-Dsec-Trajectory: name`` and ``X-Dsec-Step: n`` (n = 1, 2, … in
    the order of the calls on this object). A step already in the server's log with the
    same request is answered from the log without running (``replayed`` counts them); a
    step that differs from the log raises PreconditionError with the server's message.

    The step counter moves on when the server answered the step (with a result or with an
    error it logged); after a connection failure the same call sends the same step again,
    which the server answers once the first run is done.
    """

    def __init__(self, sandbox: Sandbox, name: str):
        self._sb = sandbox
        self.name = name
        self.step = 0          # the last step answered
        self.replayed = 0      # how many steps were answered from the log
        self.last_replayed = False
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"Trajectory({self.name!r}, step={self.step}, replayed={self.replayed})"

    async def _call(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                    headers: dict[str, str] | None = None, timeout: Any = None) -> Response:
        async with self._lock:
            n = self.step + 1
            h = {"X-Dsec-Trajectory": self.name, "X-Dsec-Step": str(n), **(headers or {})}
            try:
                r = await self._sb._client._send(method, f"{self._sb._base}{path}", json=json, params=params,
                                                 content=content, headers=h, timeout=timeout)
            except DSecError as e:
                if e.status and e.code != "failed_precondition" and await self._logged(n):
                    self._answered(n, getattr(e, "headers", None))
                raise
            self._answered(n, r.headers)
            return r

    def _answered(self, n: int, headers: Any) -> None:
        self.step = n
        self.last_replayed = bool(headers) and headers.get("x-dsec-replayed", "").lower() == "true"
        if self.last_replayed:
            self.replayed += 1

    async def _logged(self, n: int) -> bool:
        try:
            log = await self._sb.trajectory_log(self.name, missing_ok=True)
        except DSecError:
            return False
        return any(s.get("seq") == n for s in (log or {}).get("steps", []))

    async def log(self) -> dict[str, Any] | None:
        return await self._sb.trajectory_log(self.name, missing_ok=True)

    async def exec(self, argv: list[str] | None = None, *, cmd: str | None = None, env: dict[str, str] | None = None,
                   cwd: str | None = None, user: str | int | None = None, timeout: float | None = None,
                   stdin: str | None = None) -> ExecResult:
        body = _exec_body(argv, cmd, env, cwd, user, timeout, stdin)
        r = await self._call("POST", "/exec", json=body, timeout=_http_timeout(timeout))
        return ExecResult.from_json(r.json())

    async def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        return await self.exec(cmd=command, **kwargs)

    async def exec_background(self, argv: list[str] | None = None, *, cmd: str | None = None,
                              env: dict[str, str] | None = None, cwd: str | None = None,
                              user: str | int | None = None, timeout: float | None = None,
                              stdin: str | None = None, tag: str | None = None) -> Process:
        """Starts a background process as a step (a replayed step gives the logged pid and
        starts nothing). Streamed execs cannot be steps."""
        body = _exec_body(argv, cmd, env, cwd, user, timeout, stdin)
        body["background"] = True
        if tag is not None:
            body["tag"] = tag
        r = await self._call("POST", "/exec", json=body)
        return Process(self._sb, pid=int(r.json()["pid"]))

    async def write_file(self, path: str, data: bytes | str, mode: int | str | None = None,
                         append: bool = False) -> dict[str, Any]:
        params: dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = _mode_param(mode)
        if append:
            params["append"] = "true"
        r = await self._call("PUT", "/files", params=params, content=_as_bytes(data),
                             headers={"content-type": "application/octet-stream"})
        return _json_of(r)

    async def write_many(self, files: Iterable[Any]) -> list[dict[str, Any]]:
        return (await self._call("POST", "/files/batch", json=_batch_body(files))).json()["written"]

    async def remove_file(self, path: str, recursive: bool = False) -> None:
        await self._call("POST", "/files/remove", json={"path": path, "recursive": recursive})

    async def mkdir(self, path: str) -> dict[str, Any]:
        return (await self._call("POST", "/files/mkdir", json={"path": path})).json()

    async def rename(self, src: str, dst: str) -> dict[str, Any]:
        return (await self._call("POST", "/files/rename", json={"from": src, "to": dst})).json()

    async def chmod(self, path: str, mode: int) -> dict[str, Any]:
        return (await self._call("POST", "/files/chmod", json={"path": path, "mode": int(mode)})).json()

    async def chown(self, path: str, uid: int, gid: int) -> dict[str, Any]:
        return (await self._call("POST", "/files/chown", json={"path": path, "uid": int(uid), "gid": int(gid)})).json()

    async def session_run(self, session: Session | str, cmd: str, timeout: float | None = None) -> SessionResult:
        sid = session.id if isinstance(session, Session) else session
        r = await self._call("POST", f"/sessions/{sid}/run", json=_session_body(cmd, timeout, False),
                             timeout=_http_timeout(timeout))
        return SessionResult.from_json(r.json())


async def run_many(coros: list[Any], limit: int = 64) -> list[Any]:
    """Runs coroutines with at most ``limit`` in flight (helper for bulk creates)."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


class VolumeFiles:
    """The files of a volume, read and written by the node (no sandbox needed). Paths are
    inside the volume: ``..`` and links never leave it."""

    def __init__(self, client: DSecClient, volume_id: str):
        self._client = client
        self.id = volume_id
        self._base = f"/v1/volumes/{volume_id}"

    @staticmethod
    def _owner(params: dict[str, str], uid: int | None, gid: int | None, mode: int | str | None) -> None:
        if uid is not None:
            params["uid"] = str(uid)
        if gid is not None:
            params["gid"] = str(gid)
        if mode is not None:
            params["mode"] = _mode_param(mode)

    async def read(self, path: str) -> bytes:
        r = await self._client._send("GET", f"{self._base}/files", params={"path": path}, timeout=3600.0)
        return r.content

    async def write(self, path: str, data: bytes | str, *, uid: int | None = None, gid: int | None = None,
                    mode: int | str | None = None) -> dict[str, Any]:
        """Writes a file (made with the directories above it, or replaced)."""
        params = {"path": path}
        self._owner(params, uid, gid, mode)
        r = await self._client._send("PUT", f"{self._base}/files", params=params, content=_as_bytes(data),
                                     headers={"content-type": "application/octet-stream"}, timeout=3600.0)
        return _json_of(r)

    async def stat(self, path: str) -> dict[str, Any]:
        return await self._client._request("GET", f"{self._base}/stat", params={"path": path})

    async def list(self, path: str = "/", depth: int = 1) -> list[dict[str, Any]]:
        r = await self._client._request("GET", f"{self._base}/list", params={"path": path, "depth": str(depth)})
        return list(r["entries"])

    async def mkdir(self, path: str, parents: bool = False, *, uid: int | None = None, gid: int | None = None,
                    mode: int | str | None = None) -> dict[str, Any]:
        params = {"path": path}
        if parents:
            params["parents"] = "true"
        self._owner(params, uid, gid, mode)
        return await self._client._request("POST", f"{self._base}/mkdir", params=params)

    async def remove(self, path: str) -> None:
        """Removes a file or link, or a directory with everything in it."""
        await self._client._send("DELETE", f"{self._base}/files", params={"path": path})

    async def update(self, path: str, *, uid: int | None = None, gid: int | None = None,
                     mode: int | None = None) -> dict[str, Any]:
        """Changes the owner or permission bits of ``path``."""
        body = {k: v for k, v in (("uid", uid), ("gid", gid), ("mode", mode)) if v is not None}
        return await self._client._request("PATCH", f"{self._base}/stat", params={"path": path}, json=body)

