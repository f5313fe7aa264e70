"""``with`` and ``async with`` for refit's objects: leaving the block (by an
exception too, which goes on) releases the object through its ``_release()``
(``shutdown()``, ``close()`` or ``stop()``, as the class names it)."""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    from typing import Self
elif TYPE_CHECKING:  # 3.10: type checkers know typing_extensions; annotations are strings at run time
    from typing_extensions import Self


# Every live object of these classes, released at interpreter exit (_release_all).
_LIVE: weakref.WeakSet[_Scoped] = weakref.WeakSet()


class _Scoped:
    """The context-manager protocol of every class that holds refit's resources."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        obj = super().__new__(cls)
        _LIVE.add(obj)
        return obj

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release()  # a short call on refit's loop: it does not wait for peers


def _release_all() -> None:
    """At interpreter exit, before refit's loop stops: every object still alive is
    released and lets go of its extension object. A Python callable the extension
    holds (a WorkerHost's load_weights, its hooks) can refer back to its owner (a
    lambda's module globals do), a cycle Python's collector cannot see through the
    extension: it would outlive the interpreter (nanobind's "leaked instances")."""
    for obj in list(_LIVE):
        try:
            obj._release()
        except Exception:  # noqa: BLE001 - exiting: what it held goes anyway
            pass
        obj.__dict__.pop("_impl", None)
