"""The worker side's engine: :class:`refit.Engine`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import _refit
from ._loop import _keep, _run
from ._scoped import _Scoped
from ._types import Info, LoadWeights


class Engine(_Scoped):
    """A worker-side engine of ``backend`` (see :func:`backends`).

    ``init(init_info)`` connects to the trainer with the dict the trainer's
    :meth:`Sender.prepare` returned. ``receive(update_info, load_weights)`` receives
    one update: ``update_info`` is vLLM's ``{"names", "dtype_names", "shapes"}``
    (plus the engine's own members); ``load_weights(batch)`` is called with lists of
    ``(name, tensor)`` views, incrementally, never concurrently with itself. With
    ``tensors={name: tensor}`` the engine receives straight into those tensors'
    memory (host tensors; checked against every update before a byte moves) and
    ``load_weights`` may be omitted; ``fingerprint()`` then answers for them.

    The session verbs of vLLM's RL API are here too: ``start_weight_update()``,
    ``update_weights(update_info, load_weights)`` (one or more chunks),
    ``finish_weight_update(version)`` (drains deferred processing, commits a staged
    session and records the version), ``abort_weight_update(why)``.

    ``commit="staged"`` (or ``"commit": "staged"`` in an update_info) makes a
    session all or nothing: each chunk is checked against ``tensors`` (when given)
    and received into refit's stage, and its ``load_weights`` is not called during
    ``update_weights``; ``finish_weight_update`` calls each chunk's own
    ``load_weights`` with that chunk's tensors, chunk by chunk in order, then
    records the version. A failed chunk or ``abort_weight_update`` discards the
    stage: nothing reached the model, its version is unchanged, and it is not
    dirty. (A ``load_weights`` that raises during that commit leaves it dirty.) A
    failed chunk fails the session: later chunks are refused and
    ``finish_weight_update`` raises without recording a version; abort it.
    ``max_stage_bytes`` (0: none) bounds the stage: a chunk beyond it is refused
    before a byte moves (``ResourceExhaustedError``, the trainer told at once).
    Outside a session, a staged ``receive`` lands whole at its end.

    ``keep_base=True`` (without ``tensors``) keeps a host copy of every tensor the
    engine last delivered (memory: the model's bytes, on the host) and receives
    into it: ``load_weights`` gets views of the copy, and a trainer's delta updates
    (``"delta": True``, docs/delta.md) decode against it where the model's own
    memory cannot be read back (vLLM's fused parameters, GPU tensors). A
    :class:`HostCopy` given as ``keep_base`` is that copy, kept by its owner across
    engines (and seeded with what the model holds before its first update).

    ``start_weight_update(fleet_atomic=True)`` makes the session undoable, the
    worker's part of a fleet-atomic update (docs/control-plane.md): each chunk is
    refused before a byte moves unless the model can read back every tensor of it
    (``tensors=``, or ``keep_base`` holding it); ``prepare_weight_update()`` votes
    (the whole update staged, nothing applied, no chunk failed); the finish keeps
    the previous version, which ``rollback_weight_update()`` loads back through the
    chunks' own ``load_weights`` (and records its version again) until the next
    session starts or ``release_undo()``.

    ``check_update(update_info)``, when given, is called with every update's
    ``{"names", "dtype_names", "shapes"}`` before any byte of it moves (on refit's
    loop thread); what it raises refuses the update: the trainer learns why at once
    (its send fails naming the reason), the receive raises
    :class:`InvalidArgumentError` with it, and nothing reaches ``load_weights``. A
    refused update closes the data path: ``init`` again before the next one.
    """

    def __init__(
        self,
        backend: str = "tcp",
        *,
        device: Any = "cpu",
        timeout_ms: int = 60000,
        commit: str = "in_place",
        auth_secret_file: str | None = None,
        processing_threads: int = 1,
        socket_buffer_bytes: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        tensors: Mapping[str, Any] | None = None,
        framework: str = "auto",
        max_stage_bytes: int = 0,
        check_update: Callable[[Info], None] | None = None,
        keep_base: bool | HostCopy = False,
    ) -> None:
        self._impl = _refit._Engine(
            backend=backend,
            device=str(device),
            timeout_ms=int(timeout_ms),
            commit=commit,
            auth_secret_file=auth_secret_file,
            processing_threads=processing_threads,
            socket_buffer_bytes=socket_buffer_bytes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tensors=tensors,
            framework=framework,
            max_stage_bytes=int(max_stage_bytes),
            check_update=check_update,
            keep_base=bool(keep_base),
            base=keep_base._impl if isinstance(keep_base, HostCopy) else None,
        )
        self._tensors = tensors  # referenced for as long as the engine writes them

    @property
    def backend(self) -> str:
        return self._impl.backend

    @property
    def defers_processing(self) -> bool:
        """True when receive returns once every byte arrived and load_weights may still
        run: drain() (or finish_weight_update) is its completion."""
        return self._impl.defers_processing

    def state(self) -> Info:
        """The engine's state: initialized, receiving, processing_pending, weights_dirty,
        dirty_reason, session_active, weight_version, prepared, holds_undo, undo_version,
        last_update (stats), transport (what the engine's transport chose, e.g. ucx's
        transports and mode; else None)."""
        return self._impl.state()

    @property
    def weight_version(self) -> int | None:
        return self.state()["weight_version"]

    @property
    def weights_dirty(self) -> bool:
        return self.state()["weights_dirty"]

    @property
    def dirty_reason(self) -> str:
        return self.state()["dirty_reason"]

    @property
    def last_update_stats(self) -> Info:
        return self.state()["last_update"]

    def init(self, init_info: Info) -> None:
        self._impl.init(init_info=init_info)

    async def init_async(self, init_info: Info) -> None:
        await _run(_keep(self, self._impl._start_init), init_info=init_info)

    def receive(self, update_info: Info, load_weights: LoadWeights | None = None) -> None:
        self._impl.receive(update_info=update_info, load_weights=load_weights)

    async def receive_async(self, update_info: Info, load_weights: LoadWeights | None = None) -> None:
        await _run(_keep(self, self._impl._start_receive), update_info=update_info, load_weights=load_weights)

    def drain(self) -> None:
        """Waits for deferred processing; raises the first error it hit, once."""
        self._impl.drain()

    async def drain_async(self) -> None:
        await _run(_keep(self, self._impl._start_drain))

    # vLLM's names for the same
    drain_pending = drain
    drain_pending_async = drain_async

    def start_weight_update(self, fleet_atomic: bool = False) -> None:
        self._impl.start_weight_update(fleet_atomic=bool(fleet_atomic))

    def prepare_weight_update(self) -> None:
        """The vote of a fleet-atomic update: raises :class:`InvalidStateError`
        (naming why) unless the session holds its whole update staged."""
        self._impl.prepare_weight_update()

    async def prepare_weight_update_async(self) -> None:
        await _run(_keep(self, self._impl._start_prepare_weight_update))

    def rollback_weight_update(self) -> None:
        """Loads the version before the last fleet-atomic finish back."""
        self._impl.rollback_weight_update()

    async def rollback_weight_update_async(self) -> None:
        await _run(_keep(self, self._impl._start_rollback_weight_update))

    def release_undo(self) -> None:
        """Drops the previous version a fleet-atomic finish kept."""
        self._impl.release_undo()

    def update_weights(self, update_info: Info, load_weights: LoadWeights | None = None) -> None:
        self._impl.update_weights(update_info=update_info, load_weights=load_weights)

    async def update_weights_async(self, update_info: Info, load_weights: LoadWeights | None = None) -> None:
        await _run(_keep(self, self._impl._start_update_weights), update_info=update_info, load_weights=load_weights)

    def finish_weight_update(self, version: int | None = None) -> None:
        self._impl.finish_weight_update(version=version)

    async def finish_weight_update_async(self, version: int | None = None) -> None:
        await _run(_keep(self, self._impl._start_finish_weight_update), version=version)

    def abort_weight_update(self, why: str = "") -> None:
        self._impl.abort_weight_update(why=why)

    async def abort_weight_update_async(self, why: str = "") -> None:
        await _run(_keep(self, self._impl._start_abort_weight_update), why=why)

    def fingerprint(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """{name: 64-bit fingerprint} of the engine's tensors (all, or ``names``)."""
        return self._impl.fingerprint(names=list(names or []))

    def shutdown(self) -> None:
        """Closes the engine's connections and releases its memory; idempotent."""
        self._impl.shutdown()

    def _release(self) -> None:  # with, async with
        self.shutdown()


class HostCopy:
    """A host copy of a model's checkpoint-format tensors that outlives any one
    :class:`Engine`: pass it as ``keep_base`` to each engine in turn (one at a
    time). ``seed(tensors)`` copies in what the model holds before refit's first
    update (e.g. its checkpoint), so that update can be undone too. Memory: the
    bytes of every tensor it holds, on the host (``bytes``)."""

    def __init__(self) -> None:
        self._impl = _refit._HostCopy()

    def seed(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Copies ``{name: tensor}`` (host tensors) in as the model's current bytes."""
        self._impl.seed(tensors=tensors)

    @property
    def bytes(self) -> int:
        return self._impl.bytes
