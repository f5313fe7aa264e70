"""The trainer side's sender: :class:`refit.Sender`, the stream ordering of its GPU
reads (:class:`_ProducerOrder`), and :func:`refit.sharded_init_info`."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from . import _refit
from ._errors import InvalidArgumentError
from ._loop import _keep, _run
from ._scoped import _Scoped
from ._types import Info, Tensors


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
        self._waiter: Any = None

    def handle(self, stream: Any) -> int | None:
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
        torch = sys.modules.get("torch")
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


class Sender(_Scoped):
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
        device: Any = "cpu",
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
        self, tensors: Tensors, metadata: Info | None = None, *, delta: bool | None = None, stream: Any = None
    ) -> None:
        """Sends one update. ``delta`` (a sender prepared with ``"delta": True``):
        ``False`` sends this one full, ``True`` requires deltas to be on; ``None``
        as prepared (docs/delta.md). ``stream``: where the tensors were written
        (GPU senders; torch's current stream by default)."""
        self._impl.send_weights(tensors=tensors, metadata=metadata, delta=delta, stream=self._order.handle(stream))

    async def send_weights_async(
        self, tensors: Tensors, metadata: Info | None = None, *, delta: bool | None = None, stream: Any = None
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

    def _release(self) -> None:  # with, async with
        self.shutdown()


def sharded_init_info(infos: Iterable[Info]) -> Info:
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
