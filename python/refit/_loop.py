"""The asyncio bridge: refit's C++ operations run on refit's own event loop (a
thread of the extension's); their ``_async`` forms await them from any asyncio
loop, the result coming back through ``loop.call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import atexit
from collections.abc import Callable
from typing import Any

from . import _refit
from ._scoped import _release_all

# Stop refit's loop before the interpreter goes: nothing may call into Python after.
# atexit runs the last registered first: live objects are released while the loop
# still runs (their teardown is a coroutine on it), then the loop stops.
atexit.register(_refit._shutdown)
atexit.register(_release_all)


def _resolve(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _run(start: Callable[..., Any], **kwargs: Any) -> Any:
    """Awaits a C++ operation started with ``start(**kwargs, done=done)``."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(result, exc):  # on refit's loop, GIL held
        try:
            loop.call_soon_threadsafe(_resolve, future, result, exc)
        except RuntimeError:  # the asyncio loop is closed: nobody waits any more
            pass

    call = start(**kwargs, done=done)
    try:
        return await future
    except asyncio.CancelledError:
        call.cancel()
        raise


def _keep(owner: object, start: Callable[..., Any]) -> Callable[..., Any]:
    """``start`` whose completion keeps ``owner`` alive until it is called."""

    def bound(*, done: Callable[[Any, BaseException | None], None], **kwargs: Any) -> Any:
        return start(**kwargs, done=lambda result, exc, _owner=owner: done(result, exc))

    return bound
