# SPDX-License-Identifier: Apache-2.0
"""The SDK's HTTP transport: one aiohttp session per event loop, kept-alive connections,
and a small response type the client reads.

aiohttp rather than httpx: a burst of a thousand calls from one process (the SDK's
everyday load: thousands of sandboxes started at once) cost httpx's connection pool
seconds of CPU; aiohttp's does not, and its parser is compiled. `bench/burst.py` prints
the SDK's own floor (calls that do nothing, all at once) next to its bursts.
"""

from __future__ import annotations

import asyncio
import json as _json
from typing import Any, AsyncIterator

import aiohttp
from yarl import URL

# Connections kept per client. A create answers quickly, but streamed execs and watches
# hold one each for as long as they run.
MAX_CONNECTIONS = 1000
CONNECT_TIMEOUT_S = 10.0


class TransportError(Exception):
    """The server could not be reached, or the connection broke."""


class Timeout:
    """How long to wait: ``read`` seconds between bytes of the answer (None: no limit),
    ``connect`` seconds for a new connection."""

    __slots__ = ("read", "connect")

    def __init__(self, read: float | None, connect: float = CONNECT_TIMEOUT_S):
        self.read = read
        self.connect = connect

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect, sock_read=self.read)


class Response:
    """One answer. ``content``/``json()``/``text`` for a read answer; ``aiter_lines()``,
    ``aiter_bytes()`` and ``aclose()`` for a streamed one."""

    def __init__(self, raw: aiohttp.ClientResponse, content: bytes | None):
        self._raw = raw
        self.status_code = raw.status
        self.headers = raw.headers  # case-insensitive
        self._content = content

    @property
    def content(self) -> bytes:
        if self._content is None:
            raise RuntimeError("a streamed answer: read it with aread() first")
        return self._content

    @property
    def text(self) -> str:
        return self.content.decode(self._raw.charset or "utf-8", "replace")

    def json(self) -> Any:
        return _json.loads(self.content)

    async def aread(self) -> bytes:
        if self._content is None:
            try:
                self._content = await self._raw.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise TransportError(str(e) or type(e).__name__) from e
        return self._content

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._raw.content.iter_any():
                yield piece
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TransportError(str(e) or type(e).__name__) from e

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Lines without their ends, of any length (aiohttp's own readline stops at 64 KiB,
        and an exec's output event can be longer)."""
        held = b""
        async for piece in self.aiter_bytes():
            held += piece
            if b"\n" not in piece:
                continue
            *lines, held = held.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if held:
            yield held.decode("utf-8", "replace")

    async def aclose(self) -> None:
        # Back to the pool when read to its end; closed when abandoned part-way.
        self._raw.release()


class Transport:
    """Sends requests to one base URL with fixed headers. The session is made on first use
    in the running loop (and again if the client is used from another loop)."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: Timeout):
        self.base_url = base_url.rstrip("/")
        self.headers = headers
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _current(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, ttl_dns_cache=None),
                timeout=self.timeout.client_timeout(),
                # The server's error answers are read by the client, not raised here.
                raise_for_status=False,
                auto_decompress=True,
            )
            self._loop = loop
        return self._session

    async def send(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                   headers: dict[str, str] | None = None, timeout: Timeout | None = None,
                   stream: bool = False) -> Response:
        """Sends one request; reads the whole answer unless ``stream``. Raises
        TransportError when the server cannot be reached or the connection broke."""
        session = self._current()
        # The path is sent as given: its parts are already percent-encoded by the caller.
        url = URL(self.base_url + path, encoded=True)
        data = json_bytes = None
        h = dict(headers) if headers else {}
        if json is not None:
            json_bytes = _json.dumps(json, separators=(",", ":")).encode()
            h.setdefault("content-type", "application/json")
            data = json_bytes
        elif content is not None:
            data = content
        try:
            raw = await session.request(method, url, params=_params(params), data=data, headers=h or None,
                                        timeout=(timeout or self.timeout).client_timeout())
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise TransportError(str(e) or type(e).__name__) from e
        r = Response(raw, None)
        if not stream:
            try:
                await r.aread()
            finally:
                raw.release()
        return r

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def _params(params: Any) -> Any:
    """aiohttp takes str and int values only: booleans as true/false, None left out."""
    if params is None:
        return None
    items = params.items() if isinstance(params, dict) else params
    out = []
    for k, v in items:
        if v is None:
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        out.append((k, v if isinstance(v, (str, int)) else str(v)))
    return out
