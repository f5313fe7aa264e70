"""verl's ``CheckpointEngine`` on refit: :class:`RefitCheckpointEngine`.

How verl drives it every step (``CheckpointEngineManager.update_weights``), and what
each call does here:

* ``prepare()`` on every actor and rollout rank. A rollout rank starts its
  :class:`refit.WorkerHost` once (its control plane: the master drives the update
  through it) and returns where it listens; the master actor returns who it is.
* ``build_topology(actor_world_size, rollout_world_size, metadata)`` (verl's
  driver): the master gets every rollout's endpoint, every rank the step's *key*:
  the master's identity and each rollout host's. The key is unchanged while no
  process came or went.
* ``init_process_group(**kwargs)``: the master connects a :class:`refit.WorkerGroup`
  to the rollout hosts and inits them with its :class:`refit.Sender` only when the
  key changed (first step, a rollout replica added, removed or restarted, a
  restarted master); otherwise the connections of the last step are kept. The
  rollout ranks have nothing to do (their host is driven by the master).
* ``send_weights(weights, global_steps)`` on every actor rank. The master cuts the
  full-tensor generator into chunks of at most ``bucket_size`` bytes (a larger
  tensor alone) and runs one update session on every rollout: start, one
  ``update_weights`` per chunk alongside the sender streaming it, finish at version
  ``global_steps``. Every other actor rank walks the same generator (producing each
  tensor is collective across the actor ranks) and sends nothing.
* ``receive_weights(global_steps)`` on every rollout rank: an async generator of
  ``(name, tensor)`` as the buckets land, bounded to the engine's buffers: a
  yielded tensor is a view of refit's receive buffer, valid until the generator is
  resumed after the last tensor of its bucket (copy it to keep it). It ends when
  the master's finish committed the update (``weight_version`` is then
  ``global_steps``) and raises the refit error that ended the session otherwise.
* ``finalize()``: nothing (connections are kept for the next step).
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngine
from verl.workers.rollout.utils import ensure_async_iterator

import refit
from refit.integration import GPU_ENGINES, HOST_ENGINES, Options, TrainerLink, route_address

_ENGINES = HOST_ENGINES + GPU_ENGINES


def _bad(what: str) -> refit.InvalidArgumentError:
    return refit.InvalidArgumentError(f"refit.verl: {what}")


class RefitCheckpointEngine(CheckpointEngine):
    """refit's checkpoint engine for verl (module docstring: the flow).

    ``bucket_size`` (verl's ``update_weights_bucket_megabytes``): the largest chunk
    of one update (one control round trip and one send each). ``is_master``: given
    on actor ranks (True on rank 0, the one that sends); absent on rollout ranks.
    The options (``checkpoint_engine.engine_kwargs.refit``):

    * ``engine``: refit's backend: ``"tcp"`` (default) or ``"ucx"`` where built
      (host tensors), or a GPU engine of a CUDA build, ``"nccl"`` (one GPU per
      rank: the master's and every rollout's) or ``"cuda_ipc"`` (the master and
      the rollouts on one node), which move device tensors: the master's stay on
      its GPU, and a rollout yields views of its device buffers;
    * ``device``: the GPU engines' device (default ``"cuda:N"``, N torch's
      current device when the rank first needs it; verl pins each rank to its GPU);
    * ``checksums``: every bucket's checksum verified on every rollout rank;
    * ``commit``: ``"in_place"`` (default: tensors are yielded as they land) or
      ``"staged"`` (nothing is yielded until every byte of the step arrived: a
      failed step yields nothing);
    * ``timeout_ms``: the deadline of every wait on a peer (default 60000);
    * ``buffer_bytes``, ``num_buffers``: refit's pipeline (default 64 MiB x 2;
      a rollout holds at most that many buckets);
    * ``topology``: the relay among rollout ranks (``"star"``, ``"chain"``,
      ``"tree:K"``; default: refit's, a chain from 3 ranks on);
    * ``auth_secret_file``: every connection authenticated (mode 0600);
    * ``address``: the address this rank listens on and is reached at (default:
      this host's address; ``127.0.0.1`` on one machine);
    * ``delta``: tcp, in place: each step goes as a delta against the last one each
      rollout holds (docs/delta.md); a rollout keeps a host copy of the model to
      decode against (memory: the model's bytes), and the master sends a step as one
      chunk (deltas are against the previous send of the same tensors), holding the
      step's tensors and the sender's snapshot (twice the model's bytes).

    A bad value raises :class:`refit.InvalidArgumentError` here, at construction.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool | None = None,
        *,
        engine: str = "tcp",
        checksums: bool = False,
        commit: str = "in_place",
        timeout_ms: int = 60000,
        buffer_bytes: int = 64 << 20,
        num_buffers: int = 2,
        topology: str | None = None,
        auth_secret_file: str | None = None,
        address: str | None = None,
        delta: bool = False,
        device: str | None = None,
    ) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
            raise _bad(f"bucket_size: expected a positive number of bytes, got {bucket_size!r}")
        if engine not in _ENGINES:
            raise _bad(f"engine: expected one of {_ENGINES}, got {engine!r}")
        self.options = Options(engine=engine, timeout_ms=timeout_ms, auth_secret_file=auth_secret_file, device=device,
                               commit=commit, checksums=checksums, buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                               topology=topology, delta=delta, owner="refit.verl")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.role = "rollout" if is_master is None else ("master" if is_master else "actor")
        self._device: str | None = None
        self.address = address or route_address()
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # master: its connections to the rollouts, kept while the topology's key is unchanged
        self._link = TrainerLink(self.options, address=self.address)
        # rollout
        self._host: refit.WorkerHost | None = None
        self._events: queue.Queue = queue.Queue()

    @property
    def connects(self) -> int:
        """Topologies this master connected (one while no process came or went)."""
        return self._link.connects

    # ------------------------------------------------------------------ each step

    def prepare(self) -> dict[str, Any]:
        if self.role == "rollout" and self._host is None:
            self._host = refit.WorkerHost(
                **self.options.worker_args(),
                host=self.address,
                port=0,
                load_weights=self._load,
                keep_base=self.options.delta,  # what deltas decode against
                on_update_started=lambda owner: self._events.put(("started", owner)),
                on_update_finished=lambda version, stats: self._events.put(("finished", version)),
                on_update_failed=lambda reason: self._events.put(("failed", reason)),
            )
        out: dict[str, Any] = {"role": self.role, "id": self.id}
        if self._host is not None:
            out.update(address=self.address, port=self._host.port)
        return out

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        actors, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size or any(m.get("role") != "rollout" for m in rollouts):
            raise _bad(f"build_topology: expected {rollout_world_size} rollout ranks after the actors, got {metadata}")
        masters = [m for m in actors if m.get("role") == "master"]
        if len(masters) != 1:
            raise _bad(f"build_topology: expected one master actor rank (is_master=True), got {len(masters)}")
        endpoints = [(m["address"], int(m["port"])) for m in rollouts]
        key = (masters[0]["id"], tuple((m["id"], m["address"], int(m["port"])) for m in rollouts))
        actor_kwargs: dict[str, list[Any]] = {"endpoints": [endpoints] * actor_wg_world_size,
                                              "key": [key] * actor_wg_world_size}
        rollout_kwargs: dict[str, list[Any]] = {"endpoints": [None] * rollout_world_size,
                                                "key": [key] * rollout_world_size}
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, endpoints: list[tuple[str, int]] | None = None, key: Any = None) -> None:
        if self.role == "master":
            self._link.open(endpoints or [], key)

    def finalize(self) -> None:
        """Keeps the connections (and the rollout hosts) for the next step."""

    # ------------------------------------------------------------------ transfer

    async def send_weights(self, weights: Iterable[tuple[str, Any]], global_steps: int | None = None) -> dict:
        if self.role != "master":
            async for _ in ensure_async_iterator(weights):  # collective across the actor ranks
                pass
            return {}
        group, sender = self._link.group, self._link.sender
        if group is None or sender is None:
            raise refit.InvalidStateError("refit.verl: send_weights before init_process_group")
        version = 0 if global_steps is None else int(global_steps)
        sent = chunks = wire = fallbacks = 0
        await group.call_all_async("start_weight_update")
        # Deltas are taken against the previous send of the same tensors: with
        # them on, a step is one chunk (the master holds the step's tensors).
        produced = _chunks(weights, 1 << 62 if self.options.delta else self.bucket_size, self.device).__aiter__()
        upcoming: asyncio.Future | None = None
        try:
            # The next chunk is produced (verl's generator gathers each tensor)
            # while this one moves: at most two chunks are held.
            upcoming = asyncio.ensure_future(produced.__anext__())
            while True:
                try:
                    chunk = await upcoming
                except StopAsyncIteration:
                    break
                upcoming = asyncio.ensure_future(produced.__anext__())
                info = dict(refit.describe(chunk), commit=self.options.commit)
                await _both(group.call_all_async("update_weights", {"update_info": info}),
                            sender.send_weights_async(chunk))
                sent += sum(t.numel() * t.element_size() for _, t in chunk)
                chunks += 1
                info_of_send = sender.last_send_info
                if info_of_send and "delta" in info_of_send:
                    wire += int(info_of_send["delta"].get("delta_bytes", 0))
                    fallbacks += int(info_of_send["delta"].get("full_fallbacks", 0))
            upcoming = None
            await group.call_all_async("finish_weight_update", {"weight_version": version})
        except BaseException as e:
            if upcoming is not None:
                upcoming.cancel()
            # Every rollout's session ends now, not at its deadline; the error that
            # ended the step is the one raised.
            try:
                await group.call_all_async("abort_weight_update", {"why": str(e)[:500]})
            except Exception:
                pass
            raise
        out = {"refit/bytes": sent, "refit/chunks": chunks}
        if self.options.delta:
            out.update({"refit/delta_bytes": wire, "refit/full_fallbacks": fallbacks})
        return out

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, Any]]:
        if self._host is None:
            raise refit.InvalidStateError("refit.verl: receive_weights before prepare (or on an actor rank)")
        loop = asyncio.get_running_loop()
        deadline = self.options.timeout_ms / 1000

        async def next_event():
            try:
                return await loop.run_in_executor(None, lambda: self._events.get(timeout=deadline))
            except queue.Empty:
                raise refit.TimeoutError(
                    f"refit.verl: no word of the update from the master within {self.options.timeout_ms} ms"
                ) from None

        # This step's session starts with its owner's start; what came before (a
        # step that ended while nobody was receiving) is not this step's.
        while (await next_event())[0] != "started":
            pass
        while True:
            kind, payload = await next_event()
            if kind == "batch":
                views, done = payload
                try:
                    for name, tensor in views:
                        yield name, tensor
                finally:
                    done.set()  # the bucket is refit's again
            elif kind == "finished":
                if global_steps is not None and payload != int(global_steps):
                    raise refit.ProtocolError(f"refit.verl: the master finished version {payload}, not {global_steps}")
                return
            elif kind == "failed":
                raise payload.error()  # a refit.UpdateFailure: the typed error of its kind

    @property
    def device(self) -> str:
        """Where this rank's tensors move from or land: ``"cpu"`` for the host
        engines, the GPU engines' ``"cuda:N"``."""
        if self._device is None:
            self._device = self.options.resolved_device()
        return self._device

    @property
    def weight_version(self) -> int | None:
        """The version this rollout rank holds (the last step's ``global_steps``)."""
        return None if self._host is None else self._host.weight_info().get("weight_version")

    def _load(self, batch: list[tuple[str, Any]]) -> None:
        # On refit's processing thread: hands the bucket's views to receive_weights
        # and waits until its consumer is past them (bounded memory, views valid).
        done = threading.Event()
        self._events.put(("batch", (batch, done)))
        if not done.wait(self.options.timeout_ms / 1000):
            raise refit.TimeoutError(
                f"refit.verl: receive_weights did not take a bucket within {self.options.timeout_ms} ms"
            )

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Closes the master's connections and stops a rollout's host; idempotent."""
        self._link.close()
        if self._host is not None:
            self._host.stop()
            self._host = None


async def _both(control: Any, data: Any) -> None:
    """A chunk's control call and its send. When one fails the other is given a
    moment to say why too (a lost rollout fails both: the control plane names its
    endpoint, the data path its rank), and the error raised says both."""
    tasks = [asyncio.ensure_future(control), asyncio.ensure_future(data)]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if not any(t.exception() for t in done):
            return
        if pending:
            await asyncio.wait(pending, timeout=2)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
    errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
    first = errors[0]
    if len(errors) == 1:
        raise first
    kind = getattr(first, "kind", None)
    message = "; ".join(getattr(e, "message", str(e)) for e in errors)
    raise (refit.error_class(kind) if kind else refit.Error)(message) from first


async def _chunks(weights: Iterable[tuple[str, Any]], limit: int,
                  device: str = "cpu") -> AsyncIterator[list[tuple[str, Any]]]:
    """The generator's tensors (contiguous, on ``device``: the host, or a GPU
    engine's device) in lists of at most ``limit`` bytes; a larger tensor alone."""
    chunk: list[tuple[str, Any]] = []
    size = 0
    async for name, tensor in ensure_async_iterator(weights):
        t = tensor.detach()
        if str(t.device) != device:
            t = t.to(device)
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += n
    if chunk:
        yield chunk
