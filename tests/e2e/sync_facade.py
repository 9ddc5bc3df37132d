# SPDX-License-Identifier: AGPL-3.0-only
"""The async client's interface over `opendsec.sync`, so that async end-to-end tests run
through the synchronous client unchanged: each call a test awaits is a call of the sync
client's method of the same name, made in a worker thread; the sync client then runs the
async original on its own loop. Nothing here knows a method by name: what is awaited is
what the async class declares as a coroutine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
from typing import Any

from opendsec import sync

# Streams (watches, attached processes) hold a thread each while they wait.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="sync-facade")


async def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


def _face(v: Any) -> Any:
    if isinstance(v, sync._Proxy):
        return Facade(v)
    if isinstance(v, list):
        return [_face(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_face(x) for x in v)
    return v


def _unface(v: Any) -> Any:
    return v._s if isinstance(v, Facade) else v


class Facade:
    """An async-looking object over one sync client object (``_s``)."""

    __slots__ = ("_s",)

    def __init__(self, s: Any):
        object.__setattr__(self, "_s", s)

    def __getattr__(self, name: str) -> Any:
        s = self._s
        v = getattr(s, name)
        declared = inspect.getattr_static(type(s)._async_type, name, None)
        if inspect.iscoroutinefunction(declared):
            async def call(*args: Any, **kwargs: Any) -> Any:
                args = tuple(_unface(a) for a in args)
                kwargs = {k: _unface(x) for k, x in kwargs.items()}
                return _face(await _in_thread(v, *args, **kwargs))
            return call
        if inspect.isfunction(declared):
            def plain(*args: Any, **kwargs: Any) -> Any:
                return _face(v(*(_unface(a) for a in args), **{k: _unface(x) for k, x in kwargs.items()}))
            return plain
        return _face(v)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._s, name, _unface(value))

    def __repr__(self) -> str:
        return repr(self._s)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Facade) and other._s == self._s

    def __hash__(self) -> int:
        return hash(self._s)

    def __await__(self):  # type: ignore[no-untyped-def]
        # The sync client hands back what the async one has to be awaited (a watch)
        # already awaited.
        async def me() -> "Facade":
            return self
        return me().__await__()

    async def __aenter__(self) -> "Facade":
        await _in_thread(self._s.__enter__)
        return self

    async def __aexit__(self, *exc: object) -> Any:
        return await _in_thread(self._s.__exit__, *exc)

    def __aiter__(self) -> "Facade":
        return self

    async def __anext__(self) -> Any:
        def step() -> tuple[bool, Any]:
            try:
                return True, next(self._s)
            except StopIteration:
                return False, None
        more, v = await _in_thread(step)
        if not more:
            raise StopAsyncIteration
        return _face(v)


def client(**kwargs: Any) -> Facade:
    """A sync ``DSecClient`` that looks async."""
    return Facade(sync.DSecClient(**kwargs))
