# SPDX-License-Identifier: Apache-2.0
"""The async client: DSecClient creates and finds sandboxes; Sandbox runs commands in one."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from . import config
from .errors import DSecError, from_response

# Extra time over a command's own timeout before the HTTP call gives up.
_EXEC_SLACK_S = 60.0


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
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}


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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SandboxInfo":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class DSecClient:
    """Async client for the OpenDsec API.

    ``DSecClient()`` reads ``DSEC_API_URL``/``DSEC_API_KEY``, else the file named by
    ``DSEC_CONFIG``, else ``~/.config/dsec/client.toml`` (written by ``dsec up``).
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, timeout: float = 120.0):
        self.api_url, self.api_key = config.resolve(api_url, api_key)
        self._timeout = timeout
        self._http = httpx.AsyncClient(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200),
        )

    async def __aenter__(self) -> "DSecClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None,
                       params: Any = None) -> Any:
        # Reads and deletes are safe to send again when a pooled connection went stale
        # (e.g. the server restarted); other calls are never repeated.
        attempts = 2 if method in ("GET", "DELETE") else 1
        for attempt in range(attempts):
            try:
                r = await self._http.request(method, path, json=json, params=params, timeout=timeout or self._timeout)
                break
            except httpx.TransportError as e:
                if attempt + 1 < attempts:
                    continue
                raise DSecError("unavailable", f"cannot reach the OpenDsec API at {self.api_url}: {e}") from e
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = r.text
            raise from_response(r.status_code, body)
        if r.status_code == 204 or not r.content:
            return None
        return r.json()

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

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/status")


class Sandbox:
    """One running sandbox. ``async with`` stops it on exit."""

    def __init__(self, client: DSecClient, info: SandboxInfo):
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, image={self.info.image!r}, state={self.info.state!r})"

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def exec(
        self,
        argv: list[str] | None = None,
        *,
        cmd: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
    ) -> ExecResult:
        """Runs a program (argv) or a shell command line (cmd) and waits for it."""
        body: dict[str, Any] = {}
        if argv is not None:
            body["argv"] = argv
        if cmd is not None:
            body["cmd"] = cmd
        if env:
            body["env"] = env
        if cwd is not None:
            body["cwd"] = cwd
        if timeout is not None:
            body["timeout_seconds"] = timeout
        if stdin is not None:
            body["stdin"] = stdin
        http_timeout = (timeout if timeout is not None else 600.0) + _EXEC_SLACK_S
        r = await self._client._request("POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=http_timeout)
        return ExecResult.from_json(r)

    async def run_shell(self, command: str, **kwargs: Any) -> ExecResult:
        """Runs ``command`` with /bin/sh -c; returns stdout, stderr and exit_code."""
        return await self.exec(cmd=command, **kwargs)

    async def fork(self, count: int = 1, labels: dict[str, str] | None = None) -> list["Sandbox"]:
        """Makes ``count`` copies of this sandbox.

        Container sandboxes: the copies get this sandbox's files (its writable layer) but
        not its process memory; their processes start fresh.
        """
        body: dict[str, Any] = {"count": count}
        if labels:
            body["labels"] = labels
        r = await self._client._request("POST", f"/v1/sandboxes/{self.id}/fork", json=body, timeout=600.0)
        self.last_fork = r
        return [Sandbox(self._client, SandboxInfo.from_json(s)) for s in r["sandboxes"]]

    async def refresh(self) -> SandboxInfo:
        self.info = SandboxInfo.from_json(await self._client._request("GET", f"/v1/sandboxes/{self.id}"))
        return self.info

    async def set_timeout(self, ttl_seconds: int) -> SandboxInfo:
        """Sets the remaining lifetime to ``ttl_seconds`` from now."""
        r = await self._client._request("POST", f"/v1/sandboxes/{self.id}/timeout", json={"ttl_seconds": ttl_seconds})
        self.info = SandboxInfo.from_json(r)
        return self.info

    keep_alive = set_timeout

    async def stop(self) -> None:
        """Stops the sandbox; stopping one that is already gone is not an error."""
        try:
            await self._client._request("DELETE", f"/v1/sandboxes/{self.id}", timeout=120.0)
        except DSecError as e:
            if e.code != "not_found":
                raise


async def run_many(coros: list[Any], limit: int = 64) -> list[Any]:
    """Runs coroutines with at most ``limit`` in flight (helper for bulk creates)."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))
