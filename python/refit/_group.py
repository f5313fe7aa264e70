"""The trainer's control connections to its workers: :class:`refit.WorkerGroup`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import _refit
from ._loop import _keep, _run
from ._scoped import _Scoped
from ._sender import Sender
from ._types import Info, Tensors


class WorkerGroup(_Scoped):
    """The trainer's control connections to N workers (refit's control plane, e.g.
    :class:`WorkerHost` processes or the C++ main job's workers), each ``"host:port"``
    or ``(host, port)``. ``update(sender, tensors, version)`` runs a whole update on
    every worker at once: start_weight_update, update_weights alongside the send,
    finish_weight_update, then (``verify=True``) every worker's fingerprints against
    the trainer's. The first error names the worker.
    """

    def __init__(
        self,
        endpoints: Iterable[str | tuple[str, int]],
        *,
        timeout_ms: int = 60000,
        auth_secret_file: str | None = None,
    ) -> None:
        self._impl = _refit._WorkerGroup(
            endpoints=list(endpoints), timeout_ms=int(timeout_ms), auth_secret_file=auth_secret_file
        )

    def __len__(self) -> int:
        return len(self._impl)

    def connect(self) -> None:
        self._impl.connect()

    async def connect_async(self) -> None:
        await _run(_keep(self, self._impl._start_connect))

    def init(self, sender: Sender, trainer_args: Info | None = None, *, ranks: str = "per_worker") -> Info:
        """sender.prepare(trainer_args), every worker's init alongside
        sender.connect_workers(); returns the init_info. ``ranks="shared"``: the workers
        are the ranks of one tensor-parallel engine. ``world_size`` defaults to the
        group's size + 1 (the trainer is rank 0)."""
        return self._impl.init(sender=sender._impl, trainer_args=self._trainer_args(trainer_args), ranks=ranks)

    async def init_async(
        self, sender: Sender, trainer_args: Info | None = None, *, ranks: str = "per_worker"
    ) -> Info:
        return await _run(
            _keep((self, sender), self._impl._start_init),
            sender=sender._impl,
            trainer_args=self._trainer_args(trainer_args),
            ranks=ranks,
        )

    def _trainer_args(self, trainer_args: Info | None) -> Info:
        args = dict(trainer_args or {})
        args.setdefault("world_size", len(self) + 1)
        return args

    def update(
        self,
        sender: Sender,
        tensors: Tensors,
        version: int,
        *,
        verify: bool = True,
        commit: str | None = None,
        update_info: Info | None = None,
        expected: Mapping[str, int] | None = None,
        metadata: Info | None = None,
        delta: bool | None = None,
        stream: Any = None,
        fleet_atomic: bool = False,
    ) -> Info:
        """One update of every worker; returns {"version", "seconds", "verified", "workers"}.
        ``delta`` and ``stream``: as :meth:`Sender.send_weights`'s, for this update.

        A failure before any worker commits aborts every worker's session (each keeps
        its previous version). ``fleet_atomic=True`` makes the update two-phase: staged
        on every worker, each votes (``prepare_weight_update``), and none commits
        unless all voted yes; its error names every worker's phase."""
        return self._impl.update(
            sender=sender._impl,
            tensors=tensors,
            version=int(version),
            verify=verify,
            commit=commit,
            update_info=update_info,
            expected=expected,
            metadata=metadata,
            delta=delta,
            stream=sender._order.handle(stream),
            fleet_atomic=fleet_atomic,
        )

    async def update_async(
        self,
        sender: Sender,
        tensors: Tensors,
        version: int,
        *,
        verify: bool = True,
        commit: str | None = None,
        update_info: Info | None = None,
        expected: Mapping[str, int] | None = None,
        metadata: Info | None = None,
        delta: bool | None = None,
        stream: Any = None,
        fleet_atomic: bool = False,
    ) -> Info:
        return await _run(
            _keep((self, sender), self._impl._start_update),
            sender=sender._impl,
            tensors=tensors,
            version=int(version),
            verify=verify,
            commit=commit,
            update_info=update_info,
            expected=expected,
            metadata=metadata,
            delta=delta,
            stream=sender._order.handle(stream),
            fleet_atomic=fleet_atomic,
        )

    def call_all(self, method: str, params: Info | None = None) -> list[Any]:
        """``method`` on every worker at once; the answers by worker."""
        return self._impl.call_all(method=method, params=params or {})

    async def call_all_async(self, method: str, params: Info | None = None) -> list[Any]:
        return await _run(_keep(self, self._impl._start_call_all), method=method, params=params or {})

    def reconcile(self) -> Info:
        """Brings a fleet a lost trainer left at two versions back to one: workers that
        committed a fleet-atomic update the others never did are rolled back. Returns
        {"version", "workers": [{"worker", "weight_version", "state", "action"}]};
        call it from a new trainer before its first update (docs/control-plane.md)."""
        return self._impl.reconcile()

    async def reconcile_async(self) -> Info:
        return await _run(_keep(self, self._impl._start_reconcile))

    def fingerprint_differences(self, expected: Mapping[str, int], version: int) -> list[list[str]]:
        return self._impl.fingerprint_differences(expected=expected, version=int(version))

    def close(self) -> None:
        """Closes the control connections to the workers; idempotent."""
        self._impl.close()

    def _release(self) -> None:  # with, async with
        self.close()
