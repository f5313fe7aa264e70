"""refit as a vLLM weight-transfer backend: ``WeightTransferConfig(backend="refit")``.

vLLM 0.33.0's weight-transfer interface (``vllm.distributed.weight_transfer``),
implemented on refit's engines:

* worker side, :class:`RefitWeightTransferEngine`, a ``WeightTransferEngine``:
  ``init_transfer_engine`` builds a :class:`refit.Engine` of the backend the
  trainer names (``refit_backend``, "tcp" by default) and connects it to the
  trainer; each ``update_weights`` chunk is received by refit and loaded through
  ``self.model.load_weights([(name, tensor), ...])``, incrementally, from refit's
  processing thread;
* trainer side, :class:`RefitTrainerWeightTransferEngine`, a
  ``TrainerWeightTransferEngine`` built by ``WeightTransferTrainerFactory`` from a
  :class:`RefitTrainerInitInfo`: a :class:`refit.Sender` whose ``prepare()`` gives
  the workers' init info, sent through the client's
  ``init_weight_transfer_engine``; ``send_weights()`` then drives
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` through
  the client while the sender streams the ``WeightSource``'s tensors, as vLLM's
  NCCL trainer engine does.

:func:`register` is the ``vllm.general_plugins`` entry point (``refit =
refit.vllm:register`` in refit's wheel): vLLM calls it in every process, so both
factories know "refit" wherever a worker or a trainer is built.

Trainer::

    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory)
    from refit.vllm import RefitTrainerInitInfo

    trainer = WeightTransferTrainerFactory.trainer_init(
        RefitTrainerInitInfo(master_address="10.0.0.1", world_size=1 + num_workers, rank=0),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"),
        source=ModuleSource(model))
    trainer.send_weights()          # every round

Server: ``vllm serve ... --weight-transfer-config '{"backend": "refit"}'`` with
refit's wheel installed in vLLM's environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
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
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import refit

if TYPE_CHECKING:
    from typing import Self

    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = [
    "BACKEND",
    "RefitInitInfo",
    "RefitUpdateInfo",
    "RefitWeightTransferEngine",
    "RefitTrainerInitInfo",
    "RefitTrainerWeightTransferEngine",
    "register",
]

BACKEND = "refit"
"""The name refit registers under in both of vLLM's weight-transfer factories."""

_MODULE = __name__

logger = logging.getLogger(__name__)

# The backends whose trainer arguments are the rendezvous of a trainer-to-worker
# group: {"master_address", "master_port", "world_size"} (refit's join info).
_GROUP_BACKENDS = frozenset({"tcp", "nccl"})


def _secret_file(explicit: str | None) -> str | None:
    """The auth secret file: the explicit one, else $REFIT_AUTH_SECRET_FILE."""
    return explicit if explicit is not None else (os.environ.get("REFIT_AUTH_SECRET_FILE") or None)


def _dtype_name(dtype: torch.dtype) -> str:
    """vLLM's spelling of a dtype ("bfloat16"), which refit reads too."""
    return str(dtype).split(".")[-1]


# --------------------------------------------------------------------------------
# Worker side


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What a worker's ``init_weight_transfer_engine`` takes for refit.

    Attributes:
        init_info: the dict refit's engine takes (``refit.Sender.prepare``'s
            result, e.g. tcp's ``{"master_address", "master_port", "rank_offset",
            "world_size", ...}``), passed to ``refit.Engine.init`` unchanged. Every
            worker gets the same one; each finds its own rank from its place in
            vLLM's parallel layout (``data_parallel_index * world_size + rank``,
            as vLLM's NCCL engine does).
        refit_backend: refit's engine ("tcp"; see ``refit.backends()``).
        timeout_ms: refit's timeout for every operation of this engine.
        commit: refit's default commit mode, "in_place" or "staged" (an update's
            own ``commit`` overrides it).
        device: the device refit's engine is told the model is on (default: the
            worker's device).
        layerwise_reload: run vLLM's layerwise reload around each update
            (``initialize_layerwise_reload`` in ``start_weight_update``,
            ``finalize_layerwise_reload`` in ``finish_weight_update``), as vLLM's
            NCCL engine does for checkpoint-format weights. ``None`` (default): when
            vLLM's model loader recorded the model's layout (every model vLLM
            loads), not for a plain ``torch.nn.Module``.

    The auth secret file is the worker's own ``$REFIT_AUTH_SECRET_FILE`` (never
    sent over the wire).
    """

    init_info: dict[str, Any] = field(default_factory=dict)
    refit_backend: str = "tcp"
    timeout_ms: int = 60000
    commit: str = "in_place"
    device: str | None = None
    layerwise_reload: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.init_info, dict):
            raise ValueError(f"`init_info` must be a dict (refit's init info), got {type(self.init_info).__name__}")
        if not isinstance(self.refit_backend, str) or not self.refit_backend:
            raise ValueError(f"`refit_backend` must name one of refit's engines, got {self.refit_backend!r}")
        if self.commit not in ("in_place", "staged"):
            raise ValueError(f"`commit` must be 'in_place' or 'staged', got {self.commit!r}")
        if isinstance(self.timeout_ms, bool) or not isinstance(self.timeout_ms, int) or self.timeout_ms <= 0:
            raise ValueError(f"`timeout_ms` must be a positive int, got {self.timeout_ms!r}")


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` chunk for refit: vLLM's parameter metadata.

    Attributes:
        names, dtype_names, shapes: the tensors of the chunk, in the order the
            trainer sends them (vLLM's spelling: ``"bfloat16"``, ``[4096, 4096]``).
            Leave all three empty to reuse the previous chunk's metadata for the
            same model, as vLLM's NCCL engine allows: a trainer that sends the same
            parameters every round ships them once.
        commit: this update's refit commit mode ("in_place" | "staged"); the
            engine's when None.
        extra: further members of refit's update info for the engine (merged
            into the dict refit receives).
        refit_backend: when given, the refit backend the trainer sends with; a
            worker whose engine is another backend refuses the update.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    commit: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    refit_backend: str | None = None

    def __post_init__(self) -> None:
        num_params = len(self.names)
        if len(self.dtype_names) != num_params:
            raise ValueError(
                f"`dtype_names` should be of the same size as `names`: got {len(self.dtype_names)} and {num_params}"
            )
        if len(self.shapes) != num_params:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {num_params}")
        if self.commit is not None and self.commit not in ("in_place", "staged"):
            raise ValueError(f"`commit` must be 'in_place', 'staged' or None, got {self.commit!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"`extra` must be a dict, got {type(self.extra).__name__}")
        clash = {"names", "dtype_names", "shapes", "commit"} & self.extra.keys()
        if clash:
            raise ValueError(f"`extra` must not repeat the update info's own members: {sorted(clash)}")

    def to_refit(self) -> dict[str, Any]:
        """The update info refit's engine takes."""
        info: dict[str, Any] = {
            "names": list(self.names),
            "dtype_names": list(self.dtype_names),
            "shapes": [list(s) for s in self.shapes],
        }
        if self.commit is not None:
            info["commit"] = self.commit
        info.update(self.extra)
        return info

    def to_payload(self) -> dict[str, Any]:
        """The dict a trainer passes to the client's ``update_weights``: the set
        members only, so that it stays small and JSON-native."""
        payload: dict[str, Any] = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        if self.commit is not None:
            payload["commit"] = self.commit
        if self.extra:
            payload["extra"] = self.extra
        if self.refit_backend is not None:
            payload["refit_backend"] = self.refit_backend
        return payload


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """vLLM worker-side weight transfer over refit.

    The refit engine is built at ``init_transfer_engine``, when the trainer's init
    info names its backend; ``shutdown`` releases it (the worker keeps serving) and
    a later ``init_transfer_engine`` builds a new one.

    ``defers_processing`` is refit's: with tcp, ``update_weights`` returns once
    every byte of the chunk arrived while ``load_weights`` may still run (refit
    overlaps receiving bucket k+1 with loading bucket k), so ``update_weights``
    skips the base's device synchronize and ``finish_weight_update`` (refit's,
    which drains) completes the update, as vLLM's sharded RDT engine does. ``drain_pending`` is refit's ``drain``. Before
    ``init_transfer_engine`` the class answers True (the conservative answer: a
    caller then drains, which is always safe).

    ``self.model.load_weights`` is called on refit's processing thread, with
    tensors that view refit's memory for the duration of the call (vLLM's loaders
    copy them into the parameters).
    """

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    defers_processing: bool = True
    """True until ``init_transfer_engine``; then the refit engine's own answer."""

    supports_draft_weight_update: bool = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._refit: refit.Engine | None = None
        self._backend: str | None = None
        self._layerwise_setting: bool | None = None
        self._in_session = False
        self._layerwise_active = False
        # Metadata of the last update per model, reused by an empty update info.
        self._last_update_info: dict[torch.nn.Module, RefitUpdateInfo] = {}

    # -- refit's parallel layout ----------------------------------------------------

    def _worker_index(self) -> tuple[int, int]:
        """(this worker's index, the number of workers) across TP*PP and DP, the
        same formula as vLLM's NCCL (``_worker_group_rank``) and RDT engines."""
        pc = self.parallel_config
        world_size = int(pc.world_size)
        dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        index = dp_index * world_size + int(pc.rank)
        try:
            count = int(pc.world_size_across_dp)
        except (AttributeError, TypeError, ValueError):
            count = world_size * int(getattr(pc, "data_parallel_size", 1) or 1)
        return index, max(count, index + 1)

    # -- WeightTransferEngine ------------------------------------------------------

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        """Builds the refit engine of ``init_info.refit_backend`` and connects it to
        the trainer (``refit.Engine.init(init_info.init_info)``). Blocks until the
        trainer accepted it (the trainer's ``connect_workers`` runs meanwhile)."""
        if self._in_session:
            raise RuntimeError("init_transfer_engine called during a weight update; finish or abort it first")
        self._release()
        index, count = self._worker_index()
        engine = refit.Engine(
            init_info.refit_backend,
            device=init_info.device if init_info.device is not None else str(self.device),
            timeout_ms=init_info.timeout_ms,
            commit=init_info.commit,
            auth_secret_file=_secret_file(None),
            tp_rank=index,
            tp_size=count,
        )
        try:
            engine.init(init_info.init_info)
        except BaseException:
            engine.shutdown()
            raise
        self._refit = engine
        self._backend = init_info.refit_backend
        self._layerwise_setting = init_info.layerwise_reload
        self._last_update_info.clear()
        self.defers_processing = bool(engine.defers_processing)

    def _engine(self) -> refit.Engine:
        if self._refit is None:
            raise RuntimeError("refit weight transfer not initialized. Call init_transfer_engine() first.")
        return self._refit

    def _layerwise_applies(self) -> bool:
        if self._layerwise_setting is not None:
            return self._layerwise_setting
        try:
            from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        except ImportError:
            return False
        # record_metadata_for_reloading (vLLM's model loader) registers every module
        # of a model it builds; layerwise reload of an unrecorded module would drop
        # its parameters.
        return self.model in LAYERWISE_INFO

    def start_weight_update(self) -> None:
        """Opens refit's update session, then (for a model vLLM loaded) vLLM's
        layerwise reload for the incoming checkpoint-format weights."""
        engine = self._engine()
        if self._in_session:
            # vLLM's worker refuses a second start itself, so a session still open
            # here is one the worker gave up on (an update_weights that raised):
            # abort it and start afresh.
            logger.warning("refit: aborting a weight update that was never finished")
            self._abort("a new weight update started before the previous one finished")
        engine.start_weight_update()
        self._in_session = True
        self._layerwise_active = False
        if self._layerwise_applies():
            try:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
            except BaseException as e:
                self._abort(f"initialize_layerwise_reload failed: {e!r}")
                raise
            self._layerwise_active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives one chunk. A deferring refit engine (tcp) returns once every byte
        arrived, without the base's device synchronize (that would wait for the
        deferred loads and serialize the pipeline); ``finish_weight_update``
        completes it. A failed chunk aborts refit's session, so that the next
        ``start_weight_update`` starts clean (vLLM's worker does not call finish
        after a failed update)."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as e:
            if self._in_session:
                self._abort(f"update_weights failed: {e!r}")
            raise
        if not self.defers_processing and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """Receives the chunk ``update_info`` describes into ``self.model``, through
        ``self.model.load_weights``. Within a session (start_weight_update ..
        finish_weight_update) this is refit's ``update_weights``; outside one, a
        standalone ``receive`` (drained before it returns)."""
        engine = self._engine()
        if update_info.refit_backend is not None and update_info.refit_backend != self._backend:
            raise ValueError(
                f"update_info is for refit backend {update_info.refit_backend!r}, but this worker's refit "
                f"engine is {self._backend!r}"
            )
        if update_info.names:
            self._last_update_info[self.model] = update_info
        else:
            last = self._last_update_info.get(self.model)
            if last is None:
                raise ValueError(
                    "update_info has no names and there is no previous update of this model to reuse: "
                    "the first update must declare its tensors"
                )
            update_info = RefitUpdateInfo(
                names=last.names,
                dtype_names=last.dtype_names,
                shapes=last.shapes,
                commit=update_info.commit,
                extra=update_info.extra,
            )
        load_weights = _model_loader(self.model)
        if self._in_session:
            engine.update_weights(update_info.to_refit(), load_weights)
        else:
            engine.receive(update_info.to_refit(), load_weights)
            engine.drain()

    def finish_weight_update(self) -> None:
        """refit's ``finish_weight_update`` (drains the deferred loads, commits a
        staged update, raises what any load raised), then vLLM's
        ``finalize_layerwise_reload`` when the session started a layerwise
        reload."""
        engine = self._engine()
        if not self._in_session:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        try:
            engine.finish_weight_update()
        except BaseException as e:
            self._abort(f"finish_weight_update failed: {e!r}")
            raise
        finally:
            self._in_session = False
        if self._layerwise_active:
            self._layerwise_active = False
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def drain_pending(self) -> None:
        """refit's ``drain``: blocks until every deferred load of the model ran, and
        raises the first error one hit. A no-op before ``init_transfer_engine``."""
        engine = getattr(self, "_refit", None)
        if engine is not None:
            engine.drain()

    def shutdown(self) -> None:
        """Releases refit's engine (its connections); the worker keeps serving and a
        later ``init_transfer_engine`` connects again."""
        if getattr(self, "_in_session", False):
            self._abort("the weight transfer engine is shutting down")
        self._release()

    # -- internals -------------------------------------------------------------------

    def _abort(self, why: str) -> None:
        self._in_session = False
        engine = getattr(self, "_refit", None)
        if engine is None:
            return
        try:
            engine.abort_weight_update(why)
        except refit.Error:
            pass  # nothing to abort any more: the original error is what matters

    def _release(self) -> None:
        engine, self._refit = getattr(self, "_refit", None), None
        self._backend = None
        self._in_session = False
        if engine is not None:
            engine.shutdown()
        self.__dict__.pop("defers_processing", None)  # the class's answer again


def _model_loader(model: torch.nn.Module):
    """``model.load_weights`` as refit's ``load_weights``: called on refit's
    processing thread, so the MTP-completeness switch vLLM's NCCL engine turns off
    around its receive (a ContextVar: per thread) is turned off there."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # pragma: no cover - older layouts
        disable_mtp_completeness_check = None

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        if disable_mtp_completeness_check is None:
            model.load_weights(weights)
            return
        with disable_mtp_completeness_check():
            model.load_weights(weights)

    return load_weights


# --------------------------------------------------------------------------------
# Trainer side


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
            workers' default when None.
        worker_options: further members of the workers' :class:`RefitInitInfo`
            (``timeout_ms``, ``commit``, ``device``, ``layerwise_reload``).
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
    worker_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"`world_size` (the trainer and its workers) must be at least 2, got {self.world_size!r}")
        if self.commit is not None and self.commit not in ("in_place", "staged"):
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
    ``client.update_weights`` in a thread while the sender streams
    ``source.iter_full()`` (checked against ``source.metadata``, the first
    divergent parameter named), then ``client.finish_weight_update()``. A round
    whose metadata equals the previous one's ships empty metadata (the workers
    reuse theirs). Non-sender ranks hold no sender and never call the client; they
    iterate the source to take part in its gathers (FSDP ``full_tensor``).

    Every parameter is sent by rank 0, so a parameter owned by ranks that do not
    start at 0 is refused (as by NCCL).
    """

    init_info_cls = RefitTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        rank: int = 0,
        commit: str | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.commit = commit
        self.device = device
        self.sender: refit.Sender | None = None
        self.refit_backend: str | None = None
        # Metadata the workers already hold; an unchanged round sends none.
        self._sent_meta: list[ParamMeta] | None = None

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
        if not source.implements_iter_full():
            raise TypeError(
                f"refit sends full tensors, but {type(source).__name__} does not implement iter_full()."
            )
        # Identical on every rank, so every rank raises alike.
        for m in source.metadata:
            if m.owners is not None and m.owners[0] != 0:
                raise ValueError(
                    f"parameter {m.name!r} is sent by its first owner, rank {m.owners[0]}, but refit has a "
                    "single sender, rank 0. Every parameter's owners must start at rank 0."
                )
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            rank=init_info.rank,
            commit=init_info.commit,
            device=init_info.device,
        )
        if not engine.is_sender:
            return engine

        sender = refit.Sender(
            init_info.refit_backend,
            device=init_info.device,
            timeout_ms=init_info.timeout_ms,
            auth_secret_file=_secret_file(init_info.auth_secret_file),
        )
        try:
            worker_init_info = sender.prepare(init_info.sender_args())
            payload = {
                **init_info.worker_options,
                "refit_backend": init_info.refit_backend,
                "init_info": worker_init_info,
            }
            # The workers connect to the sender during the RPC: accept them meanwhile.
            _rendezvous(sender, lambda: engine.client.init_weight_transfer_engine(payload))
        except BaseException:
            sender.shutdown()
            raise
        engine.sender = sender
        engine.refit_backend = init_info.refit_backend
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update round: start, update (alongside the send), finish. With
        ``weight_version``, the client's ``finish_weight_update`` records it."""
        assert self.source is not None  # guaranteed by trainer_init
        source = self.source
        meta = source.metadata

        if not self.is_sender:
            for _ in source.iter_full():  # join the trainer-side gathers only
                pass
            return

        if self.sender is None:
            raise RuntimeError("refit trainer engine is shut down (or trainer_init() did not complete)")
        if meta == self._sent_meta:
            update_info = RefitUpdateInfo(commit=self.commit)
        else:
            update_info = RefitUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[_dtype_name(m.dtype) for m in meta],
                shapes=[list(m.shape) for m in meta],
                commit=self.commit,
            )

        self.client.start_weight_update()
        # The workers receive inside update_weights, while the sender sends.
        exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refit-update-weights")
        try:
            future = exe.submit(self.client.update_weights, update_info.to_payload())
            if future.done():  # a request refused before any byte moved: say so now
                future.result()
            self.sender.send_weights(self._checked_iter(source, meta))
            future.result()  # surface the inference side's errors
        finally:
            # Never wait for the RPC thread here: if the send failed, the workers
            # wait for bytes until refit's timeout, and joining would hold the
            # error back that long.
            exe.shutdown(wait=False)
        if weight_version is None:
            self.client.finish_weight_update()
        else:
            self.client.finish_weight_update(weight_version)
        self._sent_meta = meta

    def _checked_iter(self, source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
        """The sender's pairs, each checked against what the workers were told
        (vLLM's NCCL trainer's check), detached (DLPack refuses tensors that
        require grad), contiguous, and on the host for a host sender."""
        host = str(self.device) == "cpu"
        sent = 0
        for name, tensor in source.iter_full():
            if sent >= len(meta):
                raise ValueError(
                    f"WeightSource yielded more parameters than metadata declared ({len(meta)}); "
                    f"first extra is {name!r}."
                )
            expected = meta[sent]
            if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
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
    if worker.done() and worker.exception() is not None:
        if not accept.done():
            accept.cancel()
        try:
            await accept
        except BaseException:  # cancelled, or failed for the same reason
            pass
        raise worker.exception()
    if accept.done() and accept.exception() is not None:
        worker.cancel()  # stops waiting for it; the RPC thread ends on its own
        raise accept.exception()
    await accept
    await worker


# --------------------------------------------------------------------------------
# Registration


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers "refit" with vLLM's
    worker-side and trainer-side weight-transfer factories (lazily: by module
    path). Safe to call any number of times."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, class_name in (
        (WeightTransferEngineFactory, "RefitWeightTransferEngine"),
        (WeightTransferTrainerFactory, "RefitTrainerWeightTransferEngine"),
    ):
        if BACKEND in getattr(factory, "_registry", {}):
            continue
        try:
            factory.register_engine(BACKEND, _MODULE, class_name)
        except ValueError as e:  # registered meanwhile (another thread)
            if "already registered" not in str(e):
                raise
