# SPDX-License-Identifier: Apache-2.0
"""The synchronous OpenDsec client, for code that is not asyncio (rollout workers, notebooks,
scripts)::

    from opendsec.sync import DSecClient, DSecRunArgs

    with DSecClient() as client:
        with client.run_sandbox(DSecRunArgs(image="root/py:3.11")) as sb:
            print(sb.run_shell("python3 -c 'print(6*7)'").stdout)
            for stream, data in sb.exec_stream(cmd="make test"):
                print(stream, data)

It has the async client's names, arguments and results: where the async client is
awaited, this one returns; ``async with`` is ``with`` and ``async for`` is ``for``. It is
not a second implementation: each class here is made from the async class of the same name,
and every call runs the async method on one event loop that a background thread keeps
for the whole process. So the client may be shared by threads (calls from many threads run
at once, on one connection pool), and it works where an event loop is already running in
the calling thread (a Jupyter notebook), which ``asyncio.run`` refuses.

``files.watch(path)`` returns once the watch is in place, as ``await files.watch(path)``
does. Errors are the same exception classes as the async client's.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Callable

from . import __all__ as _package_names
from . import client as _aio

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
# Set at exit: from then on a call is refused rather than left waiting on a loop thread
# that can no longer run.
_closing = False


def _the_loop() -> asyncio.AbstractEventLoop:
    """The process's one loop for synchronous calls, started on first use (and again in a
    child after ``fork``, where the parent's thread does not exist)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="opendsec-sync", daemon=True)
            _thread.start()
        return _loop


def _run(coro: Any) -> Any:
    """Runs a coroutine on the loop and waits for its result in the calling thread."""
    if _closing or sys.is_finalizing():
        coro.close()
        raise RuntimeError("the interpreter is exiting: OpenDsec calls are no longer made")
    loop = _the_loop()
    if threading.current_thread() is _thread:
        coro.close()
        raise RuntimeError("a synchronous OpenDsec call from a callback the client itself runs "
                           "would wait for itself; use the async client there")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result()
    except BaseException:
        # Ctrl-C (or any interruption) while waiting stops the call as well.
        fut.cancel()
        raise


async def _awaited(v: Any) -> Any:
    return await v


class _Proxy:
    """A synchronous face of one async SDK object (``_aio``)."""

    __slots__ = ("_aio", "__weakref__")
    _async_type: type = object

    @classmethod
    def _of(cls, obj: Any) -> Any:
        p = cls.__new__(cls)
        object.__setattr__(p, "_aio", obj)
        return p

    def __getattr__(self, name: str) -> Any:
        # Attributes the async object sets itself: ``info``, ``files``, ``pid``, ...
        if name == "_aio":
            raise AttributeError(name)
        v = getattr(self._aio, name)
        if inspect.ismethod(v):
            # A method the class did not copy (a private one): the same translation.
            return functools.partial(_method(v.__func__), self)
        return _wrap(v)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._aio, name, _unwrap(value))

    def __repr__(self) -> str:
        return repr(self._aio)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Proxy) and other._aio is self._aio

    def __hash__(self) -> int:
        return hash(id(self._aio))


# The synchronous class of each async one, filled in below.
_SYNC: dict[type, type] = {}


def _wrap(v: Any) -> Any:
    cls = _SYNC.get(type(v))
    if cls is not None:
        return cls._of(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    return v


def _unwrap(v: Any) -> Any:
    if isinstance(v, _Proxy):
        return v._aio
    if isinstance(v, list):
        return [_unwrap(x) for x in v]
    return v


def _method(fn: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        def call(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            return _wrap(_run(fn(self._aio, *args, **kwargs)))
    else:
        @functools.wraps(fn)
        def call(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            v = fn(self._aio, *args, **kwargs)
            if inspect.isawaitable(v):
                # What the async client hands back to be awaited (a watch) is awaited here.
                v = _run(_awaited(v))
            return _wrap(v)
    return call


def _property(p: property) -> property:
    return property(lambda self: _wrap(p.fget(self._aio)), doc=p.__doc__)  # type: ignore[misc]


def _enter(self: _Proxy) -> Any:
    _run(self._aio.__aenter__())
    return self


def _exit(self: _Proxy, *exc: object) -> Any:
    return _run(self._aio.__aexit__(*exc))


def _iter(self: _Proxy) -> Any:
    return self


def _next(self: _Proxy) -> Any:
    try:
        return _wrap(_run(self._aio.__anext__()))
    except StopAsyncIteration:
        raise StopIteration from None


def _sync_class(acls: type, extra: dict[str, Any] | None = None) -> type:
    """The synchronous class of ``acls``: its public methods and properties, its context
    manager and iterator protocols, each running the async original."""
    ns: dict[str, Any] = {"__slots__": (), "__module__": __name__, "__doc__": acls.__doc__,
                          "_async_type": acls}
    for klass in reversed(acls.__mro__[:-1]):
        for name, v in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(v, property):
                ns[name] = _property(v)
            elif inspect.isfunction(v):
                ns[name] = _method(v)
    if hasattr(acls, "__aenter__"):
        ns["__enter__"], ns["__exit__"] = _enter, _exit
    if hasattr(acls, "__anext__"):
        ns["__iter__"], ns["__next__"] = _iter, _next
    ns.update(extra or {})
    cls = type(acls.__name__, (_Proxy,), ns)
    cls.__qualname__ = acls.__name__
    _SYNC[acls] = cls
    return cls


# The async clients behind synchronous ones, closed at exit if their owner did not (a
# notebook seldom does), so that their connections end cleanly.
_clients: "weakref.WeakSet[_aio.DSecClient]" = weakref.WeakSet()


async def _new_client(*args: Any) -> _aio.DSecClient:
    c = _aio.DSecClient(*args)
    _clients.add(c)
    return c


@atexit.register
def _close_all() -> None:
    global _closing
    if _loop is None or _thread is None or not _thread.is_alive():
        _closing = True
        return
    for c in list(_clients):
        try:
            asyncio.run_coroutine_threadsafe(c.close(), _loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - nothing to do about it at exit
            pass
    _closing = True
    _loop.call_soon_threadsafe(_loop.stop)


def _close_later(c: _aio.DSecClient) -> None:
    """A client dropped unclosed: its connections are closed on the loop's own thread
    (aiohttp's are not to be touched from another)."""
    loop = _loop
    if loop is not None and not _closing and _thread is not None and _thread.is_alive():
        asyncio.run_coroutine_threadsafe(c.close(), loop)


# The inherited connections of a forked child: kept, never closed here (closing them would
# take the parent's sockets out of the epoll instance both processes share).
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    global _lock, _loop, _thread
    _lock = threading.Lock()
    _loop, _thread = None, None
    for c in list(_clients):
        session = getattr(c._http, "_session", None)
        if session is not None:
            _inherited.append(session)
            c._http._session = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _client_init(self: _Proxy, api_url: str | None = None, api_key: str | None = None,
                 timeout: float = 120.0) -> None:
    aio = _run(_new_client(api_url, api_key, timeout))
    object.__setattr__(self, "_aio", aio)
    weakref.finalize(self, _close_later, aio).atexit = False


DSecClient = _sync_class(_aio.DSecClient, {"__init__": _client_init})
Sandbox = _sync_class(_aio.Sandbox)
Process = _sync_class(_aio.Process)
Files = _sync_class(_aio.Files)
Watch = _sync_class(_aio.Watch)
Sessions = _sync_class(_aio.Sessions)
Session = _sync_class(_aio.Session)
Trajectory = _sync_class(_aio.Trajectory)
VolumeFiles = _sync_class(_aio.VolumeFiles)

# The rest of what the package exports (its data classes, its errors) is the same object
# here: results and exceptions are those of the async client.
_package = sys.modules[__package__]
for _name in _package_names:
    if _name not in globals():
        globals()[_name] = getattr(_package, _name)

__all__ = list(_package_names)
