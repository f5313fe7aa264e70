"""``with`` and ``async with`` for refit's objects: leaving the block (by an
exception too, which goes on) releases the object through its ``_release()``
(``shutdown()``, ``close()`` or ``stop()``, as the class names it)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if sys.version_info >= (3, 11):
    from typing import Self
elif TYPE_CHECKING:  # 3.10: type checkers know typing_extensions; annotations are strings at run time
    from typing_extensions import Self


class _Scoped:
    """The context-manager protocol of every class that holds refit's resources."""

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
