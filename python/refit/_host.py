"""refit's control plane in a worker process: :class:`refit.WorkerHost`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import _refit
from ._engine import HostCopy
from ._errors import UpdateFailure
from ._scoped import _Scoped
from ._types import Info, LoadWeights


class WorkerHost(_Scoped):
    """refit's control plane in this process: serves vLLM's weight-transfer verbs
    (init_weight_transfer_engine, start_weight_update, update_weights,
    finish_weight_update, weight_info, weight_fingerprint) on ``host:port`` (0: any
    free port, see ``.port``) for a trainer's :class:`WorkerGroup`, on refit's loop.
    Updates land in ``tensors`` (received into directly, readers see whole versions)
    or go to ``load_weights``. The ``on_update_*`` hooks are called on refit's loop
    (keep them short): started(owner), finished(version, stats), failed(reason).
    failed's ``reason`` is a :class:`refit.UpdateFailure`: the reason's text (a
    ``str``) whose ``.kind`` says what ended the session ("timeout": the trainer
    fell silent; "peer_lost": its connection closed; what the trainer's abort
    named, "cancelled" by default; a failed chunk's own kind) and whose
    ``.error()`` is that failure as refit's exception (``refit.TimeoutError``, ...).
    Branch on ``.kind``, never on the text; ``weight_info()["last_error_kind"]``
    says the same.

    A session belongs to the connection that started it and ends, aborted, when
    that connection closes or sends nothing (no request, no chunk being received)
    for ``session_timeout_ms`` (default: ``timeout_ms``): a frozen trainer does not
    keep the worker, and when it resumes its finish is refused. Staged sessions are
    all or nothing (see :class:`Engine`); ``max_stage_bytes`` bounds their stage.
    ``keep_base=True`` (with ``load_weights``) receives into a host copy of every
    tensor, as :class:`Engine`'s does, so a trainer's delta updates decode against
    it and a fleet-atomic update's undo reads it back (memory: the model's bytes,
    on the host). A :class:`HostCopy` given as ``keep_base`` is that copy, seeded
    by its owner with what the model holds before refit's first update (so that
    update can be undone too).

    ``device`` is the engine's device, as :class:`Engine`'s: ``"cuda:N"`` for the
    GPU engines (nccl, cuda_ipc in a CUDA build), whose buckets land in device
    memory and reach ``load_weights`` as CUDA tensors.
    """

    def __init__(
        self,
        backend: str = "tcp",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tensors: Mapping[str, Any] | None = None,
        load_weights: LoadWeights | None = None,
        timeout_ms: int = 60000,
        commit: str = "in_place",
        auth_secret_file: str | None = None,
        processing_threads: int = 1,
        framework: str = "auto",
        on_update_started: Callable[[str], None] | None = None,
        on_update_finished: Callable[[int, Info], None] | None = None,
        on_update_failed: Callable[[UpdateFailure], None] | None = None,
        session_timeout_ms: int | None = None,
        max_stage_bytes: int = 0,
        keep_base: bool | HostCopy = False,
        device: Any = "cpu",
    ) -> None:
        self._impl = _refit._WorkerHost(
            backend=backend,
            host=host,
            port=int(port),
            tensors=tensors,
            load_weights=load_weights,
            timeout_ms=int(timeout_ms),
            commit=commit,
            auth_secret_file=auth_secret_file,
            processing_threads=processing_threads,
            framework=framework,
            on_update_started=on_update_started,
            on_update_finished=on_update_finished,
            on_update_failed=on_update_failed,
            session_timeout_ms=None if session_timeout_ms is None else int(session_timeout_ms),
            max_stage_bytes=int(max_stage_bytes),
            keep_base=bool(keep_base),
            base=keep_base._impl if isinstance(keep_base, HostCopy) else None,
            device=str(device),
        )
        self._tensors = tensors

    @property
    def port(self) -> int:
        return self._impl.port

    def weight_info(self) -> Info:
        return self._impl.weight_info()

    def fingerprint(self, names: Iterable[str] | None = None) -> dict[str, int]:
        return self._impl.fingerprint(names=list(names or []))

    def add_method(self, name: str, fn: Callable[[Info], Info]) -> None:
        """Serves ``name``: ``fn(params: dict) -> dict``, called on refit's loop."""
        self._impl.add_method(name=name, fn=fn)

    def stop(self) -> None:
        """Stops serving: closes the listener and every connection, aborts an open
        session and releases the engine; idempotent."""
        self._impl.stop()

    def _release(self) -> None:  # with, async with
        self.stop()
