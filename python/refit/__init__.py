"""refit: weight transfer from RL trainers to inference workers, from Python.

The engines are refit's C++ engines (tcp, loopback, and nccl / cuda_ipc in CUDA
builds), run on refit's own event loop, a thread of its own. Every long call comes
in two forms:

* blocking, ``engine.receive(info, load_weights)``: the GIL is released while C++
  works, so other Python threads run; Ctrl-C cancels it;
* asyncio, ``await engine.receive_async(info, load_weights)``: returns at once to
  the asyncio loop, which keeps running; the result comes back through
  ``loop.call_soon_threadsafe``. Cancelling the awaiting task cancels the C++
  operation (refit's loop gets asio's terminal cancellation).

Tensors are exchanged without copies: anything with ``__dlpack__`` (torch tensors
on the CPU or a GPU, numpy arrays, cupy, ...) is read or written in place, and
``load_weights`` gets torch tensors (numpy arrays when torch is not installed, or
with ``framework="numpy"``) that view refit's memory for the duration of the call:
copy what must outlive it (vLLM's ``model.load_weights`` does).

Errors are :class:`refit.Error` subclasses by refit's kind (``refit.TimeoutError``,
``refit.PeerLostError``, ...). An exception raised by a Python ``load_weights``
comes out of the call that received as itself.

Worker side: :class:`Engine` (an engine from the factory, with vLLM's session verbs)
and :class:`WorkerHost` (refit's control plane, driven by a trainer's
:class:`WorkerGroup`). Trainer side: :class:`Sender` and :class:`WorkerGroup`. The
vLLM backend is :mod:`refit.vllm`.
"""

from __future__ import annotations

import asyncio as _asyncio
import atexit as _atexit
import sys as _sys
from collections.abc import Callable as _Callable
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import Any as _Any
from typing import Self

try:
    from ._build import BUILD as _BUILD  # written into the wheel by build_wheel.py
    from ._build import VERSION as __version__
except ImportError:  # a source tree: the version is python/pyproject.toml's
    _BUILD = "cpu"
    from ._version import source_tree_version as _source_tree_version

    __version__ = _source_tree_version()
if _BUILD == "cuda":
    # The CUDA build links libnccl.so.2. torch brings its own (newer) NCCL under the
    # same soname: load torch first so that one serves both; loading refit first
    # would bind the system's older NCCL and torch's import would then fail.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass

from . import _refit
from ._errors import (
    AlreadyRegisteredError,
    AuthError,
    CancelledError,
    Error,
    IntegrityError,
    InvalidArgumentError,
    InvalidStateError,
    IoError,
    LoadFailedError,
    NotRegisteredError,
    PeerLostError,
    ProcessingFailedError,
    ProtocolError,
    ResourceExhaustedError,
    TimeoutError,
    UnsupportedError,
    error_class,
)

__all__ = [
    "Engine",
    "Sender",
    "WorkerGroup",
    "WorkerHost",
    "backends",
    "describe",
    "fingerprints",
    "register_plugin",
    "sharded_init_info",
    "Tensors",
    "LoadWeights",
    "Info",
    "error_class",
    "Error",
    "AlreadyRegisteredError",
    "AuthError",
    "CancelledError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidStateError",
    "IoError",
    "LoadFailedError",
    "NotRegisteredError",
    "PeerLostError",
    "ProcessingFailedError",
    "ProtocolError",
    "ResourceExhaustedError",
    "TimeoutError",
    "UnsupportedError",
]

# What the API takes and gives (dicts are JSON-like: vLLM's infos, refit's stats).
Tensors = _Mapping[str, _Any] | _Iterable[tuple[str, _Any]]
"""``{name: tensor}`` or ``(name, tensor)`` pairs (``model.named_parameters()``);
a tensor is anything with ``__dlpack__``."""
LoadWeights = _Callable[[list[tuple[str, _Any]]], None]
"""``load_weights(batch)``: a list of ``(name, tensor)`` views, valid during the call."""
Info = dict[str, _Any]
"""An init_info, update_info, trainer_args, state or stats dict."""

backends = _refit.backends
describe = _refit.describe
fingerprints = _refit.fingerprints
register_plugin = _refit.register_plugin

# Stop refit's loop before the interpreter goes: nothing may call into Python after.
_atexit.register(_refit._shutdown)


def _resolve(future: _asyncio.Future[_Any], result: _Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _run(start: _Callable[..., _Any], **kwargs: _Any) -> _Any:
    """Awaits a C++ operation started with ``start(**kwargs, done=done)``."""
    loop = _asyncio.get_running_loop()
    future = loop.create_future()

    def done(result, exc):  # on refit's loop, GIL held
        try:
            loop.call_soon_threadsafe(_resolve, future, result, exc)
        except RuntimeError:  # the asyncio loop is closed: nobody waits any more
            pass

    call = start(**kwargs, done=done)
    try:
        return await future
    except _asyncio.CancelledError:
        call.cancel()
        raise


class Engine:
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
    memory cannot be read back (vLLM's fused parameters, GPU tensors).

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
        device: _Any = "cpu",
        timeout_ms: int = 60000,
        commit: str = "in_place",
        auth_secret_file: str | None = None,
        processing_threads: int = 1,
        socket_buffer_bytes: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        tensors: _Mapping[str, _Any] | None = None,
        framework: str = "auto",
        max_stage_bytes: int = 0,
        check_update: _Callable[[Info], None] | None = None,
        keep_base: bool = False,
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
        dirty_reason, session_active, weight_version, last_update (stats), transport
        (what the engine's transport chose, e.g. ucx's transports and mode; else None)."""
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

    def start_weight_update(self) -> None:
        self._impl.start_weight_update()

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

    def fingerprint(self, names: _Iterable[str] | None = None) -> dict[str, int]:
        """{name: 64-bit fingerprint} of the engine's tensors (all, or ``names``)."""
        return self._impl.fingerprint(names=list(names or []))

    def shutdown(self) -> None:
        """Closes the engine's connections and releases its memory; idempotent."""
        self._impl.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()  # a short call on refit's loop: it does not wait for peers


class _ProducerOrder:
    """Orders a device sender's reads after the stream that wrote its tensors.

    A GPU sender (nccl, cuda_ipc) reads the trainer's tensors on a stream of its
    own; a tensor written on torch's current stream (a side stream under
    ``torch.cuda.stream(s)``, or the default one) may still be in flight when
    ``send_weights`` is called. At each call this makes a stream of its own wait for
    the producer's work queued so far (an event recorded on it now, without blocking
    the host) and hands that stream to refit, which orders every read after it."""

    def __init__(self, device: str) -> None:
        self._device = device
        self._waiter: _Any = None

    def handle(self, stream: _Any) -> int | None:
        """The stream handle for refit: ``stream`` is a ``torch.cuda.Stream`` (or
        anything with ``cuda_stream``), a raw ``cudaStream_t`` int, or None for
        torch's current stream on the sender's device."""
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream  # the caller's own handle: refit records on it when the send starts
        if not self._device.startswith("cuda"):
            if stream is not None:
                raise InvalidArgumentError(
                    f"stream=: the sender's device is {self._device}; a producer stream orders reads of CUDA tensors")
            return None
        torch = _sys.modules.get("torch")
        if torch is None:  # tensors from another framework: the legacy default stream's order, as in C++
            if stream is not None and not hasattr(stream, "cuda_stream"):
                raise InvalidArgumentError(f"stream=: expected a torch.cuda.Stream or an int handle, got {stream!r}")
            return int(stream.cuda_stream) if stream is not None else None
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        elif not isinstance(stream, torch.cuda.Stream):
            raise InvalidArgumentError(f"stream=: expected a torch.cuda.Stream or an int handle, got {stream!r}")
        if self._waiter is None:
            self._waiter = torch.cuda.Stream(device=self._device)
        self._waiter.wait_stream(stream)
        return int(self._waiter.cuda_stream)


class Sender:
    """The trainer side of ``backend``: ``prepare(trainer_args)`` returns the init_info
    every worker's :meth:`Engine.init` takes; ``connect_workers()`` waits for them;
    ``send_weights(tensors)`` sends one update (a mapping or an iterable of
    ``(name, tensor)``, e.g. ``model.named_parameters()``), checked tensor by tensor
    against ``metadata`` (``describe(tensors)`` by default: the first divergent
    parameter is named). tcp's trainer_args: ``master_address``, ``master_port``
    (0: any free port), ``world_size`` (workers + 1), ``buffer_bytes``,
    ``num_buffers``, ``timeout_ms``, ``topology``.

    GPU senders (nccl, cuda_ipc, ``device="cuda:N"``) read the tensors only after
    the work queued on torch's current stream when ``send_weights`` is called, or on
    ``stream=`` (a ``torch.cuda.Stream`` or a raw ``cudaStream_t``) when the tensors
    were written elsewhere; the host is never blocked for it.
    """

    def __init__(
        self,
        backend: str = "tcp",
        *,
        device: _Any = "cpu",
        timeout_ms: int = 60000,
        auth_secret_file: str | None = None,
        socket_buffer_bytes: int = 0,
    ) -> None:
        self._order = _ProducerOrder(str(device))
        self._impl = _refit._Sender(
            backend=backend,
            device=str(device),
            timeout_ms=int(timeout_ms),
            auth_secret_file=auth_secret_file,
            socket_buffer_bytes=socket_buffer_bytes,
        )

    @property
    def backend(self) -> str:
        return self._impl.backend

    def prepare(self, trainer_args: Info | None = None) -> Info:
        return self._impl.prepare(trainer_args=trainer_args or {})

    def connect_workers(self) -> None:
        self._impl.connect_workers()

    async def connect_workers_async(self) -> None:
        await _run(_keep(self, self._impl._start_connect_workers))

    def send_weights(
        self, tensors: Tensors, metadata: Info | None = None, *, delta: bool | None = None, stream: _Any = None
    ) -> None:
        """Sends one update. ``delta`` (a sender prepared with ``"delta": True``):
        ``False`` sends this one full, ``True`` requires deltas to be on; ``None``
        as prepared (docs/delta.md). ``stream``: where the tensors were written
        (GPU senders; torch's current stream by default)."""
        self._impl.send_weights(tensors=tensors, metadata=metadata, delta=delta, stream=self._order.handle(stream))

    async def send_weights_async(
        self, tensors: Tensors, metadata: Info | None = None, *, delta: bool | None = None, stream: _Any = None
    ) -> None:
        await _run(
            _keep(self, self._impl._start_send_weights),
            tensors=tensors,
            metadata=metadata,
            delta=delta,
            stream=self._order.handle(stream),
        )

    @property
    def last_send_stats(self) -> Info:
        return self._impl.last_send_stats()

    @property
    def last_send_info(self) -> Info | None:
        """What the last send did beyond its stats, as the engine reports it, or None:
        the tcp engine with ``"delta": True`` gives ``{"delta": {"version",
        "base_version", "delta_workers", "full_fallbacks", "encoded_buckets",
        "delta_bytes", ...}}`` (docs/delta.md)."""
        info = self._impl.last_send_info()
        return info if isinstance(info, dict) else None

    def shutdown(self) -> None:
        """Closes the sender's connections to the workers; idempotent."""
        self._impl.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()  # a short call on refit's loop: it does not wait for peers


def sharded_init_info(infos: _Iterable[Info]) -> Info:
    """The workers' init_info of a ``tcp_sharded`` job from what every trainer rank's
    :meth:`Sender.prepare` returned (in rank order): each rank knows only its own
    listen port (``"port": 0`` in trainer_args takes any free one), the workers need
    them all. Raises :class:`refit.InvalidArgumentError` when the ranks were
    prepared with different workers, wire parameters or rank counts.
    """
    infos = list(infos)
    if not infos:
        raise InvalidArgumentError("sharded_init_info: no trainer ranks")
    merged = {k: v for k, v in infos[0].items()}
    trainers = [dict(t) for t in infos[0]["trainers"]]
    if len(trainers) != len(infos):
        raise InvalidArgumentError(f"sharded_init_info: {len(infos)} init infos for a job of {len(trainers)} "
                                   "trainer ranks (give one per rank, in rank order)")
    for r, info in enumerate(infos):
        others = {k: v for k, v in info.items() if k != "trainers"}
        first = {k: v for k, v in infos[0].items() if k != "trainers"}
        if others != first:
            raise InvalidArgumentError(f"sharded_init_info: trainer rank {r} was prepared with {others}, rank 0 with "
                                       f"{first}")
        if len(info["trainers"]) != len(trainers):
            raise InvalidArgumentError(f"sharded_init_info: trainer rank {r} lists {len(info['trainers'])} ranks, "
                                       f"rank 0 {len(trainers)}")
        trainers[r] = dict(info["trainers"][r])
    merged["trainers"] = trainers
    return merged


def _keep(owner: object, start: _Callable[..., _Any]) -> _Callable[..., _Any]:
    """``start`` whose completion keeps ``owner`` alive until it is called."""

    def bound(*, done: _Callable[[_Any, BaseException | None], None], **kwargs: _Any) -> _Any:
        return start(**kwargs, done=lambda result, exc, _owner=owner: done(result, exc))

    return bound


class WorkerGroup:
    """The trainer's control connections to N workers (refit's control plane, e.g.
    :class:`WorkerHost` processes or the C++ main job's workers), each ``"host:port"``
    or ``(host, port)``. ``update(sender, tensors, version)`` runs a whole update on
    every worker at once: start_weight_update, update_weights alongside the send,
    finish_weight_update, then (``verify=True``) every worker's fingerprints against
    the trainer's. The first error names the worker.
    """

    def __init__(
        self,
        endpoints: _Iterable[str | tuple[str, int]],
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
        expected: _Mapping[str, int] | None = None,
        metadata: Info | None = None,
        delta: bool | None = None,
        stream: _Any = None,
    ) -> Info:
        """One update of every worker; returns {"version", "seconds", "verified", "workers"}.
        ``delta`` and ``stream``: as :meth:`Sender.send_weights`'s, for this update."""
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
        expected: _Mapping[str, int] | None = None,
        metadata: Info | None = None,
        delta: bool | None = None,
        stream: _Any = None,
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
        )

    def call_all(self, method: str, params: Info | None = None) -> list[_Any]:
        """``method`` on every worker at once; the answers by worker."""
        return self._impl.call_all(method=method, params=params or {})

    async def call_all_async(self, method: str, params: Info | None = None) -> list[_Any]:
        return await _run(_keep(self, self._impl._start_call_all), method=method, params=params or {})

    def fingerprint_differences(self, expected: _Mapping[str, int], version: int) -> list[list[str]]:
        return self._impl.fingerprint_differences(expected=expected, version=int(version))

    def close(self) -> None:
        """Closes the control connections to the workers; idempotent."""
        self._impl.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()  # a short call on refit's loop: it does not wait for peers


class WorkerHost:
    """refit's control plane in this process: serves vLLM's weight-transfer verbs
    (init_weight_transfer_engine, start_weight_update, update_weights,
    finish_weight_update, weight_info, weight_fingerprint) on ``host:port`` (0: any
    free port, see ``.port``) for a trainer's :class:`WorkerGroup`, on refit's loop.
    Updates land in ``tensors`` (received into directly, readers see whole versions)
    or go to ``load_weights``. The ``on_update_*`` hooks are called on refit's loop
    (keep them short): started(owner), finished(version, stats), failed(reason).

    A session belongs to the connection that started it and ends, aborted, when
    that connection closes or sends nothing (no request, no chunk being received)
    for ``session_timeout_ms`` (default: ``timeout_ms``): a frozen trainer does not
    keep the worker, and when it resumes its finish is refused. Staged sessions are
    all or nothing (see :class:`Engine`); ``max_stage_bytes`` bounds their stage.
    """

    def __init__(
        self,
        backend: str = "tcp",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tensors: _Mapping[str, _Any] | None = None,
        load_weights: LoadWeights | None = None,
        timeout_ms: int = 60000,
        commit: str = "in_place",
        auth_secret_file: str | None = None,
        processing_threads: int = 1,
        framework: str = "auto",
        on_update_started: _Callable[[str], None] | None = None,
        on_update_finished: _Callable[[int, Info], None] | None = None,
        on_update_failed: _Callable[[str], None] | None = None,
        session_timeout_ms: int | None = None,
        max_stage_bytes: int = 0,
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
        )
        self._tensors = tensors

    @property
    def port(self) -> int:
        return self._impl.port

    def weight_info(self) -> Info:
        return self._impl.weight_info()

    def fingerprint(self, names: _Iterable[str] | None = None) -> dict[str, int]:
        return self._impl.fingerprint(names=list(names or []))

    def add_method(self, name: str, fn: _Callable[[Info], Info]) -> None:
        """Serves ``name``: ``fn(params: dict) -> dict``, called on refit's loop."""
        self._impl.add_method(name=name, fn=fn)

    def stop(self) -> None:
        """Stops serving: closes the listener and every connection, aborts an open
        session and releases the engine; idempotent."""
        self._impl.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()  # a short call on refit's loop: it does not wait for peers
