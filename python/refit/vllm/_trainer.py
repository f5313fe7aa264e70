"""The trainer side: :class:`RefitTrainerWeightTransferEngine`, built by vLLM's
``WeightTransferTrainerFactory.trainer_init`` from a :class:`RefitTrainerInitInfo`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

import refit

from . import _compat
from ._worker import COMMIT_MODES, RefitUpdateInfo, secret_file

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's is CPython 3.11+

logger = logging.getLogger("refit.vllm")

BACKEND = "refit"

# The backends whose trainer arguments are the rendezvous of a trainer-to-worker
# group: {"master_address", "master_port", "world_size"} (refit's join info).
_GROUP_BACKENDS = frozenset({"tcp", "ucx", "nccl"})


class InferenceServerError(RuntimeError):
    """A call to the inference side failed; the message is the server's own
    answer (vLLM's HTTP client raises only "500 Server Error"; the answer's body
    says why: the worker's refit error, its kind and the tensor it names)."""


def error_text(response: Any) -> str:
    """An HTTP error answer's message: vLLM's JSON error body (``{"error":
    {"message": ...}}`` or FastAPI's ``{"detail": ...}``), else its text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if not isinstance(body, dict):
        return str(body)
    message = body.get("error", body.get("detail", body))
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message)


def _call(verb: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a client call; an HTTP error is raised again with the body
    of the server's answer."""
    try:
        return fn(*args)
    except Exception as e:
        response = getattr(e, "response", None)
        if response is None:
            raise
        raise InferenceServerError(f"{verb}: HTTP {response.status_code}: {error_text(response)}") from e


def _dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling of a dtype ("bfloat16"), which refit reads too."""
    return str(dtype).split(".")[-1]


@dataclass
class RefitTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for refit (``WeightTransferTrainerFactory`` key
    ``"refit"``).

    Attributes:
        master_address: the address the trainer listens on, which the workers
            connect to (tcp).
        master_port: its port; 0 picks a free one (the workers learn it from the
            init info).
        world_size: the trainer plus every inference worker (TP * PP * DP of every
            vLLM engine the client drives), as vLLM's NCCL trainer has it.
        refit_backend: refit's engine ("tcp").
        trainer_args: further arguments of refit's ``Sender.prepare`` (tcp:
            ``buffer_bytes``, ``num_buffers``, ``topology``, ``checksums``, ...),
            merged over the three above (for tcp and nccl; other backends get only
            these).
        device: the device of the trainer's tensors, for refit's sender ("cpu":
            tensors elsewhere are copied to the host first).
        timeout_ms: refit's timeout for every trainer-side operation.
        auth_secret_file: refit's shared secret (default $REFIT_AUTH_SECRET_FILE);
            every worker needs the same one in its $REFIT_AUTH_SECRET_FILE.
        commit: every update's refit commit mode ("in_place" | "staged"); the
            workers' default (staged) when None.
        fleet_atomic: every update reaches every worker of every replica or none
            (refit's two phases; the client must be a :class:`refit.vllm.FleetClient`,
            the replicas served with refit's ``RefitWorkerExtension``). The workers
            then keep a host copy of the weights (``keep_base``; memory: the
            model's bytes on the host) that undoes a commit; updates are staged.
        worker_options: further members of the workers' ``RefitInitInfo``
            (``timeout_ms``, ``commit``, ``device``, ``layerwise_reload``,
            ``validate``, ``keep_base``: on by default when ``trainer_args`` has
            ``"delta": True``).
        rank: this trainer process's rank (keyword-only); rank 0 sends.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    refit_backend: str = "tcp"
    trainer_args: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    timeout_ms: int = 60000
    auth_secret_file: str | None = None
    commit: str | None = None
    fleet_atomic: bool = False
    worker_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fleet_atomic, bool):
            raise ValueError(f"`fleet_atomic` must be a bool, got {self.fleet_atomic!r}")
        if self.fleet_atomic and self.commit == "in_place":
            raise ValueError("a fleet-atomic update commits staged: `commit` must not be 'in_place'")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"`world_size` (the trainer and its workers) must be at least 2, got {self.world_size!r}")
        if self.commit is not None and self.commit not in COMMIT_MODES:
            raise ValueError(f"`commit` must be 'in_place', 'staged' or None, got {self.commit!r}")
        clash = {"init_info", "refit_backend"} & self.worker_options.keys()
        if clash:
            raise ValueError(f"`worker_options` must not set {sorted(clash)}: the trainer engine does")

    def sender_args(self) -> dict[str, Any]:
        """The ``trainer_args`` refit's ``Sender.prepare`` gets."""
        args: dict[str, Any] = {}
        if self.refit_backend in _GROUP_BACKENDS:
            args = {"master_address": self.master_address, "master_port": self.master_port,
                    "world_size": self.world_size}
        args.update(self.trainer_args)
        return args


class RefitTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitTrainerInitInfo]):
    """Trainer-side refit engine: the mirror of vLLM's NCCL trainer engine.

    On the sender (rank 0) it holds a :class:`refit.Sender`. ``trainer_init``
    prepares it, sends its init info through ``client.init_weight_transfer_engine``
    while it accepts the workers (both at once: the workers connect during the
    RPC); ``send_weights`` runs ``client.start_weight_update()``, then
    ``client.update_weights`` in a thread while the sender streams the source's
    full tensors (checked against its metadata, the first divergent parameter
    named), then ``client.finish_weight_update()``. A round whose metadata equals
    the previous one's ships empty metadata (the workers reuse theirs). Non-sender
    ranks hold no sender and never call the client; they iterate the source to
    take part in its gathers (FSDP ``full_tensor``).

    A failed round (a worker refused the update, a worker or the network failed)
    leaves the workers' data path closed: the next ``send_weights`` connects again
    (a new ``init_weight_transfer_engine`` through the client) before it sends.

    Every parameter is sent by rank 0, so a parameter rank 0 does not hold is
    refused (as by NCCL). Works with the ``WeightSource`` API of vLLM 0.32 and
    0.33 (see ``_compat``).
    """

    init_info_cls = RefitTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: RefitTrainerInitInfo,
    ) -> None:
        super().__init__(
            client=client, source=source, is_sender=init_info.is_sender,
            **_compat.trainer_engine_kwargs(init_info.rank),
        )
        self.rank = init_info.rank
        self.init_info = init_info
        self.commit = init_info.commit
        self.device = init_info.device
        self.sender: refit.Sender | None = None
        self.refit_backend: str | None = None
        # Metadata the workers already hold; an unchanged round sends none.
        self._sent_meta: list[ParamMeta] | None = None
        self._connected = False

    @classmethod
    def trainer_init(
        cls,
        init_info: RefitTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("refit trainer weight transfer requires a WeightSource.")
        if not _compat.iterates_full_tensors(source):
            raise TypeError(f"refit sends full tensors, but {type(source).__name__} does not implement iter_full().")
        engine = cls(client=client, source=source, init_info=init_info)
        if not engine.is_sender:
            return engine
        if init_info.fleet_atomic and not all(
            callable(getattr(client, verb, None)) for verb in ("prepare_weight_update", "abort_weight_update")
        ):
            raise TypeError(
                f"fleet_atomic=True needs a client that drives refit's two phases (refit.vllm.FleetClient), "
                f"not {type(client).__name__}"
            )
        missing = _compat.not_sent_by_rank0(source, _compat.source_metadata(source))
        if missing is not None:
            raise ValueError(
                f"parameter {missing!r} is not held by trainer rank 0, but refit has a single sender, rank 0: "
                "rank 0 must hold (or gather) every parameter."
            )
        engine.sender = refit.Sender(
            init_info.refit_backend,
            device=init_info.device,
            timeout_ms=init_info.timeout_ms,
            auth_secret_file=secret_file(init_info.auth_secret_file),
        )
        engine.refit_backend = init_info.refit_backend
        try:
            engine._connect()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _connect(self) -> None:
        """Prepares the sender and initialises every worker with its init info,
        accepting their connections meanwhile."""
        assert self.sender is not None
        init_info = self.init_info
        worker_init_info = self.sender.prepare(init_info.sender_args())
        payload = {
            **init_info.worker_options,
            "refit_backend": init_info.refit_backend,
            "init_info": worker_init_info,
        }
        # Deltas decode against what the worker holds; vLLM's own parameters cannot
        # be read back by the trainer's names, so the worker keeps a host copy.
        # So does a fleet-atomic update's undo.
        if init_info.trainer_args.get("delta") is True or init_info.fleet_atomic:
            payload.setdefault("keep_base", True)
        _rendezvous(self.sender, lambda: _call("init_weight_transfer_engine",
                                               self.client.init_weight_transfer_engine, payload))
        self._connected = True
        self._sent_meta = None  # a (re-)initialised worker holds no metadata

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update round: start, update (alongside the send), finish. With
        ``weight_version``, the client's ``finish_weight_update`` records it."""
        assert self.source is not None  # guaranteed by trainer_init
        source = self.source
        meta = _compat.source_metadata(source)

        if not self.is_sender:
            for _ in _compat.iter_full(source):  # join the trainer-side gathers only
                pass
            return

        if self.sender is None:
            raise RuntimeError("refit trainer engine is shut down (or trainer_init() did not complete)")
        if not self._connected:
            self._connect()
        fleet_atomic = self.init_info.fleet_atomic
        if meta == self._sent_meta:
            update_info = RefitUpdateInfo(commit=self.commit, fleet_atomic=fleet_atomic)
        else:
            update_info = RefitUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[_dtype_name(m.dtype) for m in meta],
                shapes=[list(m.shape) for m in meta],
                commit=self.commit,
                fleet_atomic=fleet_atomic,
            )
        committing = False

        try:
            _call("start_weight_update", self.client.start_weight_update)
            # The workers receive inside update_weights, while the sender sends.
            exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-update-weights")
            try:
                future = exe.submit(_call, "update_weights", self.client.update_weights, update_info.to_payload())
                self.sender.send_weights(self._checked_iter(source, meta))
                future.result()  # surface the inference side's errors
            finally:
                # Never wait for the RPC thread here: if the send failed, the workers
                # wait for bytes until refit's timeout, and joining would hold the
                # error back that long.
                exe.shutdown(wait=False)
            if fleet_atomic:
                self.client.prepare_weight_update()  # a no vote aborts every replica
            committing = True
            if weight_version is None:
                _call("finish_weight_update", self.client.finish_weight_update)
            else:
                _call("finish_weight_update", self.client.finish_weight_update, weight_version)
        except BaseException as e:
            # The workers closed their data path (refit does after any failed
            # update): the next round connects again.
            self._connected = False
            if fleet_atomic and not committing:
                # Before the commit nothing reached a model: drop every stage (the
                # finish settles its own failures: rollback, fencing).
                try:
                    self.client.abort_weight_update(f"the trainer's update failed: {e}")
                except BaseException:  # noqa: BLE001 - the original error is what matters
                    logger.exception("refit: aborting the fleet's update after a failure failed too")
            raise
        self._sent_meta = meta

    def _checked_iter(self, source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's pairs, each checked against what the workers were told
        (vLLM's NCCL trainer's check), detached (DLPack refuses tensors that
        require grad), contiguous, and on the host for a host sender."""
        host = str(self.device) == "cpu"
        sent = 0
        for name, tensor in _compat.iter_full(source):
            if sent >= len(meta):
                raise ValueError(
                    f"WeightSource yielded more parameters than metadata declared ({len(meta)}); "
                    f"first extra is {name!r}."
                )
            expected = meta[sent]
            if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != tuple(expected.shape):
                raise ValueError(
                    f"WeightSource metadata disagrees with iteration at index {sent}: declared "
                    f"{expected.name!r} {expected.dtype} {tuple(expected.shape)}, got {name!r} {tensor.dtype} "
                    f"{tuple(tensor.shape)}. Both channels must enumerate the same parameters in the same order."
                )
            sent += 1
            t = tensor.detach()
            if host and t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            yield name, t
        if sent != len(meta):
            raise ValueError(
                f"WeightSource yielded {sent} parameters but metadata declared {len(meta)}; "
                "the workers are waiting for the rest."
            )

    def shutdown(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.shutdown()
        self._sent_meta = None
        self._connected = False


def _rendezvous(sender: refit.Sender, init_worker: Callable[[], None]) -> None:
    """vLLM's ``run_trainer_rendezvous`` (nccl_common): the workers' init RPC in a
    thread while the sender accepts them. Unlike it, a failed RPC (a worker that
    refused the init info, an unreachable server) cancels the accept at once
    instead of leaving it to refit's timeout, and a failed accept does not wait
    for the RPC."""
    exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-init-workers")
    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the usual case
            asyncio.run(_rendezvous_async(sender, init_worker, exe))
            return
        # Called from a coroutine's thread: no nested loop; accept blocking.
        future = exe.submit(init_worker)
        sender.connect_workers()
        future.result()
    finally:
        exe.shutdown(wait=False)


async def _rendezvous_async(sender: refit.Sender, init_worker: Callable[[], None], exe: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    worker = asyncio.ensure_future(loop.run_in_executor(exe, init_worker))
    accept = asyncio.ensure_future(sender.connect_workers_async())
    await asyncio.wait({worker, accept}, return_when=asyncio.FIRST_EXCEPTION)
    if worker.done() and (error := worker.exception()) is not None:
        if not accept.done():
            accept.cancel()
        try:
            await accept
        except BaseException:  # cancelled, or failed for the same reason
            pass
        raise error
    if accept.done() and (error := accept.exception()) is not None:
        worker.cancel()  # stops waiting for it; the RPC thread ends on its own
        raise error
    await accept
    await worker
