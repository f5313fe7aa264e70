"""The worker side: :class:`RefitWeightTransferEngine`, a vLLM ``WeightTransferEngine``.

What a failed update leaves (the guarantee this module exists for):

* **staged** (the default): every chunk of the session is received into refit's
  stage (host memory the size of the update, kept for the next session); the
  model is not touched until ``finish_weight_update``, which opens vLLM's
  layerwise reload, loads the stage, and closes the reload before it returns. A
  session that fails before that (a refused update, a trainer killed or silent
  mid-stream, a corrupt bucket, a receive error, an abort, a new trainer's init)
  leaves the model's weights exactly as they were, and vLLM's ``/weight_info``
  at the old version (vLLM records a version only when finish succeeds).
* **in_place** (opt-in: no stage, only refit's buffers): each ``update_weights``
  chunk loads as its buckets arrive, inside a layerwise reload that opens at the
  chunk's first load and closes before the call returns. If the chunk fails, every
  vLLM layer that had all of its tensors loaded serves the new weights, and every
  other layer its old ones (refit never lets vLLM process a half-loaded layer);
  refit's engine reports its weights dirty (``refit_state()``), vLLM's version
  stays the old one.

Either way the server keeps serving: no forward pass ever meets an open reload
(the reload never outlives the vLLM call that opened it), and every update is
checked by the model's own loader run on meta tensors (names it takes, renames,
stacks or skips, shapes, dtypes, whole layers; see ``_loader_check``) before a
byte of it moves, so the refusal reaches the trainer at once and names the tensor.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import refit
from refit.integration import COMMITS, Options

from . import _ranks, _reload
from ._checkpoint import CheckpointIndex, refuse
from ._loader_check import loader_problems

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

logger = logging.getLogger("refit.vllm")

COMMIT_MODES = COMMITS


def secret_file(explicit: str | None) -> str | None:
    """The auth secret file: the explicit one, else $REFIT_AUTH_SECRET_FILE."""
    return explicit if explicit is not None else (os.environ.get("REFIT_AUTH_SECRET_FILE") or None)


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
        timeout_ms: refit's deadline for every wait on the trainer (a trainer
            that falls silent mid-update fails the update after this long); the
            trainer's own ``timeout_ms`` in ``init_info`` applies where shorter.
        commit: "staged" (default: the model sees an update only once all of it
            arrived; a failed update leaves the old weights) or "in_place" (no
            stage; see the module's documentation). An update's own ``commit``
            overrides it.
        device: the device refit's engine is told the model is on (default: the
            worker's device).
        layerwise_reload: load through vLLM's layerwise reload. ``None``
            (default): when vLLM's model loader recorded the model (every model
            vLLM loads), not for a plain ``torch.nn.Module``.
        validate: check every update against the model's checkpoint (names,
            shapes, dtypes, whole layers) before a byte moves. On by default;
            a model loaded without a safetensors checkpoint is checked by vLLM's
            loader only (a warning says so).
        keep_base: keep a host copy of the weights refit last delivered, by the
            trainer's names (memory: the model's bytes, on the host), so that a
            trainer's delta updates (``"delta": True``) decode against it: vLLM's
            parameters are fused and repacked, so their own bytes cannot be read
            back as the trainer sends them. Set by refit's trainer engine when its
            ``trainer_args`` turn deltas on; without it such a worker gets every
            update full (its engine says why). The copy is also what a
            fleet-atomic update's undo loads back (set by the trainer engine's
            ``fleet_atomic``); it outlives the engine (a new trainer's init keeps
            it) and starts as the model's checkpoint when the worker has loaded
            no update yet.

    The auth secret file is the worker's own ``$REFIT_AUTH_SECRET_FILE`` (never
    sent over the wire).
    """

    init_info: dict[str, Any] = field(default_factory=dict)
    refit_backend: str = "tcp"
    timeout_ms: int = 60000
    commit: str = "staged"
    device: str | None = None
    layerwise_reload: bool | None = None
    validate: bool = True
    keep_base: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.init_info, dict):
            raise ValueError(f"`init_info` must be a dict (refit's init info), got {type(self.init_info).__name__}")
        # refit's own options, checked as every integration checks them (the
        # device is vLLM's worker's, not an engine option here).
        Options(engine=self.refit_backend, timeout_ms=self.timeout_ms, commit=self.commit, owner="refit.vllm")
        if not isinstance(self.validate, bool):
            raise ValueError(f"`validate` must be a bool, got {self.validate!r}")
        if not isinstance(self.keep_base, bool):
            raise ValueError(f"`keep_base` must be a bool, got {self.keep_base!r}")


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
        fleet_atomic: this update is one worker's part of a fleet-atomic update
            (refit's two phases, ``FleetClient``): every chunk is refused before a
            byte moves unless the worker's host copy (``keep_base``) holds each
            tensor to undo it; the session is voted on by
            ``prepare_weight_update`` and its finish keeps the previous version.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    commit: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    refit_backend: str | None = None
    fleet_atomic: bool = False

    def __post_init__(self) -> None:
        num_params = len(self.names)
        if len(self.dtype_names) != num_params:
            raise ValueError(
                f"`dtype_names` should be of the same size as `names`: got {len(self.dtype_names)} and {num_params}"
            )
        if len(self.shapes) != num_params:
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(self.shapes)} and {num_params}")
        if self.commit is not None and self.commit not in COMMIT_MODES:
            raise ValueError(f"`commit` must be 'in_place', 'staged' or None, got {self.commit!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"`extra` must be a dict, got {type(self.extra).__name__}")
        if not isinstance(self.fleet_atomic, bool):
            raise ValueError(f"`fleet_atomic` must be a bool, got {self.fleet_atomic!r}")
        if self.fleet_atomic and self.commit == "in_place":
            raise ValueError("a fleet-atomic update commits staged: `commit` must not be 'in_place'")
        clash = {"names", "dtype_names", "shapes", "commit", "fleet_atomic"} & self.extra.keys()
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
        if self.fleet_atomic:
            payload["fleet_atomic"] = True
        return payload


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """vLLM worker-side weight transfer over refit.

    The refit engine is built at ``init_transfer_engine``, when the trainer's init
    info names its backend; ``shutdown`` releases it (the worker keeps serving) and
    a later ``init_transfer_engine`` builds a new one.

    ``update_weights`` returns once its chunk is in refit's stage (staged) or
    loaded (in_place): vLLM's worker runs forward passes between its RPCs, so
    nothing of an update is left half-applied between them. ``defers_processing``
    is therefore False, and ``drain_pending`` has nothing to wait for.
    ``self.model.load_weights`` runs on refit's processing thread while the vLLM
    call that loads (``update_weights`` in place, ``finish_weight_update`` staged)
    waits for it.
    """

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    defers_processing: bool = False
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
        self._init: RefitInitInfo | None = None
        self._session: _Session | None = None
        # Metadata of the last update per model, reused by an empty update info.
        self._last_update_info: dict[torch.nn.Module, RefitUpdateInfo] = {}
        # Checkpoint indexes per model (the target can be a draft model).
        self._indexes: dict[int, CheckpointIndex | None] = {}
        # Per model, the last metadata its loader accepted: the same again (every
        # round of a training run) is not checked again.
        self._accepted: dict[int, tuple] = {}
        # Per model, its tied parameter names (read before any reload opens).
        self._tied_names: dict[int, dict[str, tuple[str, ...]]] = {}
        # keep_base's host copy, kept across engines (a new trainer's init); what a
        # fleet-atomic update's undo loads back.
        self._base: refit.HostCopy | None = None
        # Whether any update reached the model (then the checkpoint is not what it
        # serves, and cannot seed the host copy).
        self._updated = False
        # The reload a kept undo loads through (the last fleet-atomic finish's).
        self._undo_reload: _reload.LayerwiseReload | None = None

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
        trainer accepted it (the trainer's ``connect_workers`` runs meanwhile). A
        session still open (its trainer is gone: a new one is taking over) is
        aborted first; the model keeps its weights (staged) or stays as that
        session left it (in_place). At more than one rank, every rank's engine
        connects or none does (see ``_ranks``)."""
        self._step("init_weight_transfer_engine", lambda: self._init_engine(init_info), settle=self._release)

    def _init_engine(self, init_info: RefitInitInfo) -> None:
        if self._session is not None:
            logger.warning("refit: a new trainer initialises the engine during an open weight update; aborting it")
            self._fail("a new trainer initialised the engine")
        self._release()
        self._tied()  # read while no reload is open
        index, count = self._worker_index()
        engine = refit.Engine(
            init_info.refit_backend,
            device=init_info.device if init_info.device is not None else str(self.device),
            timeout_ms=init_info.timeout_ms,
            commit=init_info.commit,
            auth_secret_file=secret_file(None),
            tp_rank=index,
            tp_size=count,
            check_update=self._check_update if init_info.validate else None,
            keep_base=self._host_copy() if init_info.keep_base else False,
        )
        try:
            engine.init(_bounded_wait(init_info.init_info, init_info.timeout_ms))
        except BaseException:
            engine.shutdown()
            raise
        self._refit = engine
        self._backend = init_info.refit_backend
        self._init = init_info
        self._last_update_info.clear()

    def _host_copy(self) -> refit.HostCopy:
        """keep_base's copy, made once: seeded with the model's checkpoint while no
        update has reached the model (so that the first update can be undone too)."""
        if self._base is None:
            base = refit.HostCopy()
            if not self._updated:
                index = self._index()
                if index is not None:
                    index.seed(base)
                    logger.info("refit: host copy seeded from the checkpoint (%d bytes)", base.bytes)
            self._base = base
        return self._base

    def _tied(self) -> dict[str, tuple[str, ...]]:
        """The model's tied parameter names (:func:`tied_names`), read once per model
        while no reload is open."""
        key = id(self.model)
        if key not in self._tied_names:
            self._tied_names[key] = tied_names(self.model)
        return self._tied_names[key]

    def _engine(self) -> refit.Engine:
        if self._refit is None:
            raise RuntimeError("refit weight transfer not initialized. Call init_transfer_engine() first.")
        return self._refit

    def _index(self) -> CheckpointIndex | None:
        key = id(self.model)
        if key not in self._indexes:
            index = CheckpointIndex.load(self.model_config, self.model)
            if index is None:
                logger.warning(
                    "refit: no safetensors checkpoint found for %s; updates are checked by vLLM's loader only",
                    getattr(self.model_config, "model", type(self.model).__name__),
                )
            self._indexes[key] = index
        return self._indexes[key]

    def _check_update(self, update: dict[str, Any]) -> None:
        """refit's check_update: runs before any byte of an update moves. The
        model's own loader judges it, run on meta tensors (``_loader_check``);
        where vLLM's reload did not record the model, its checkpoint's index."""
        names = list(update.get("names", ()))
        dtype_names = list(update.get("dtype_names", ()))
        shapes = [[int(d) for d in s] for s in update.get("shapes", ())]
        key = (tuple(names), tuple(dtype_names), tuple(tuple(s) for s in shapes))
        if self._accepted.get(id(self.model)) == key:
            return
        index = self._index()
        dtype = getattr(self.model_config, "dtype", None)
        problems = loader_problems(
            self.model,
            _model_loader(self.model),
            names,
            dtype_names,
            shapes,
            model_dtype=str(dtype).split(".")[-1] if dtype is not None else None,
            checkpoint_names=frozenset(index.tensors) if index is not None else frozenset(),
        )
        if problems is not None:
            refuse(problems)
        elif index is not None:
            index.check(update)
        self._accepted[id(self.model)] = key

    def start_weight_update(self) -> None:
        """Opens refit's update session. The model is not touched yet."""
        self._step("start_weight_update", self._start, settle=self._drop_session)

    def _drop_session(self) -> None:
        self._session = None

    def _start(self) -> None:
        engine = self._engine()
        if self._session is not None:
            # vLLM's worker refuses a second start itself, so a session still open
            # here is one the worker gave up on: abort it and start afresh.
            logger.warning("refit: aborting a weight update that was never finished")
            self._fail("a new weight update started before the previous one finished")
        # refit's own session starts at the first chunk, which says whether the
        # update is fleet-atomic; a kept undo goes now (the next update's start).
        engine.release_undo()
        self._undo_reload = None
        assert self._init is not None
        self._session = _Session(
            _reload.LayerwiseReload(
                self.model, self.model_config, _reload.applies_to(self.model, self._init.layerwise_reload)
            )
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives one chunk: into refit's stage (staged) or loaded into the model
        (in_place), complete either way when this returns. A failed chunk aborts
        the session (the model as the module's documentation says), so the next
        ``start_weight_update`` starts clean (vLLM's worker does not call finish
        after a failed update). At more than one rank, a chunk that fails on
        one rank fails on all (``_ranks``)."""

        def receive() -> None:
            try:
                self.receive_weights(self.parse_update_info(update_info))
            except BaseException as e:
                self._fail(f"update_weights failed: {e!r}")
                raise

        self._step("update_weights", receive, settle=lambda: self._fail("another rank of the server failed the chunk"),
                   ends_session=True)

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """Receives the chunk ``update_info`` describes. Within a session
        (start_weight_update .. finish_weight_update) this is refit's
        ``update_weights``; outside one, a standalone in-place ``receive``."""
        engine = self._engine()
        if update_info.refit_backend is not None and update_info.refit_backend != self._backend:
            raise ValueError(
                f"update_info is for refit backend {update_info.refit_backend!r}, but this worker's refit "
                f"engine is {self._backend!r}"
            )
        update_info = self._with_metadata(update_info)
        session = self._session
        if session is None:
            assert self._init is not None  # _engine() found the engine init_transfer_engine built
            reload = _reload.LayerwiseReload(
                self.model, self.model_config, _reload.applies_to(self.model, self._init.layerwise_reload)
            )
            load = reload.wrap(_model_loader(self.model, self._tied()))
            self._updated = True  # its bytes reach the model
            try:
                engine.receive(update_info.to_refit(), load)
                engine.drain()
            except BaseException:
                reload.settle(failed=True)
                raise
            reload.settle(failed=False)
            return
        if not session.started:
            engine.start_weight_update(fleet_atomic=update_info.fleet_atomic)
            session.started = True
            session.fleet_atomic = update_info.fleet_atomic
        elif update_info.fleet_atomic != session.fleet_atomic:
            raise ValueError("every chunk of a fleet-atomic update must say so (`fleet_atomic`), and no other's")
        commit = update_info.commit or (self._init.commit if self._init is not None else "staged")
        if commit == "in_place":
            self._updated = True  # in place, the chunk's bytes reach the model now
        engine.update_weights(update_info.to_refit(), session.reload.wrap(_model_loader(self.model, self._tied())))
        session.chunks += 1
        # In place, the chunk's loads may still run (tcp defers them): wait, then
        # close the reload so that no forward pass between vLLM's RPCs meets it.
        engine.drain()
        session.reload.settle(failed=False)

    def _with_metadata(self, update_info: RefitUpdateInfo) -> RefitUpdateInfo:
        if update_info.names:
            self._last_update_info[self.model] = update_info
            return update_info
        last = self._last_update_info.get(self.model)
        if last is None:
            raise ValueError(
                "update_info has no names and there is no previous update of this model to reuse: "
                "the first update must declare its tensors"
            )
        return RefitUpdateInfo(
            names=last.names,
            dtype_names=last.dtype_names,
            shapes=last.shapes,
            commit=update_info.commit,
            extra=update_info.extra,
            fleet_atomic=update_info.fleet_atomic,
        )

    def finish_weight_update(self) -> None:
        """refit's ``finish_weight_update``: a staged session's stage is loaded into
        the model here (inside vLLM's layerwise reload, closed before this
        returns); raises what failed. vLLM records the version only when this
        returns, and a failed finish ends vLLM's session too (vLLM's worker
        would otherwise refuse every later start). At more than one rank, a
        fleet-atomic finish that fails on one rank is undone on the ranks that
        committed it, so that every rank serves the old version."""
        self._step("finish_weight_update", self._finish, settle=self._undo_committed, ends_session=True)

    def _undo_committed(self) -> None:
        """(A rank whose finish committed while another's failed.)"""
        if self._refit is not None and self._refit.state().get("holds_undo"):
            try:
                self._rollback()
                logger.warning("refit: another rank of the server failed its commit; this rank rolled back")
                return
            except BaseException:  # noqa: BLE001
                logger.exception("refit: rolling this rank back after another rank's failed commit failed")
        logger.error("refit: another rank of the server failed its commit and this rank holds no undo: the server's "
                     "ranks now hold different versions (send the update again; fleet_atomic updates roll back)")

    def _finish(self) -> None:
        engine = self._engine()
        session = self._session
        if session is None:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        try:
            if not session.started:  # no chunk: an empty session
                engine.start_weight_update()
                session.started = True
            self._updated = True
            engine.finish_weight_update()
        except BaseException as e:
            self._fail(f"finish_weight_update failed: {e!r}")
            raise
        self._session = None
        session.reload.settle(failed=False)
        if session.fleet_atomic:
            self._undo_reload = session.reload

    # -- fleet-atomic updates (refit's two phases; called through RefitWorkerExtension) --

    def prepare_weight_update(self) -> dict[str, Any]:
        """The vote of a fleet-atomic update: the whole update staged, nothing of it
        applied, no chunk failed; raises (refit's InvalidStateError, why) otherwise.
        At more than one rank, the server votes yes only if every rank does."""
        return self._step("prepare_weight_update", self._prepare)

    def _prepare(self) -> dict[str, Any]:
        engine = self._engine()
        session = self._session
        if session is None or not session.started:
            raise refit.InvalidStateError("prepare_weight_update: no weight update with chunks is open")
        if not session.fleet_atomic:
            raise refit.InvalidStateError(
                "prepare_weight_update: this update is not fleet-atomic (its chunks did not say `fleet_atomic`)")
        engine.prepare_weight_update()
        return {"prepared": True, "chunks": session.chunks}

    def abort_weight_update(self, why: str) -> dict[str, Any]:
        """Ends an open session (a fleet-atomic update another worker failed): the
        stage is dropped, the model keeps its weights."""
        aborted = self._session is not None
        if aborted:
            self._fail(why or "the trainer aborted the update")
        return {"aborted": aborted, "state": self.refit_state()}

    def rollback_weight_update(self, held_only: bool = False) -> dict[str, Any]:
        """Loads the version before the last fleet-atomic finish back, through the
        model's load_weights in a fresh layerwise reload. ``held_only``: a rank
        that holds no undo keeps its weights (and answers its state)."""

        def rollback() -> dict[str, Any]:
            if held_only and not self._engine().state().get("holds_undo"):
                return self.refit_state()
            return self._rollback()

        return self._step("rollback_weight_update", rollback)

    def _rollback(self) -> dict[str, Any]:
        engine = self._engine()
        if self._session is not None:
            raise refit.InvalidStateError("rollback_weight_update: a weight update is open; abort it first")
        reload, self._undo_reload = self._undo_reload, None
        try:
            engine.rollback_weight_update()
        except BaseException:
            if reload is not None:
                reload.settle(failed=True)
            raise
        if reload is not None:
            reload.settle(failed=False)
        return self.refit_state()

    def release_undo(self) -> None:
        """Drops the previous version a fleet-atomic finish kept."""
        if self._refit is not None:
            self._refit.release_undo()
        self._undo_reload = None

    def drain_pending(self) -> None:
        """refit's ``drain``. Nothing is left to wait for when a vLLM call has
        returned (see the class); a no-op before ``init_transfer_engine``."""
        engine = getattr(self, "_refit", None)
        if engine is not None:
            engine.drain()

    def shutdown(self) -> None:
        """Releases refit's engine (its connections); the worker keeps serving and a
        later ``init_transfer_engine`` connects again."""
        if getattr(self, "_session", None) is not None:
            self._fail("the weight transfer engine is shutting down")
        self._release()

    def refit_state(self) -> dict[str, Any]:
        """refit's own state of this worker (``refit.Engine.state()``: weight
        version, dirty and why, the last update's statistics, ...) and
        ``update_open``; empty before ``init_transfer_engine``."""
        engine = getattr(self, "_refit", None)
        if engine is None:
            return {}
        # update_open: vLLM's update session (start .. finish) is open here, with or
        # without refit's (which starts at its first chunk).
        return {**engine.state(), "update_open": getattr(self, "_session", None) is not None}

    # -- internals -------------------------------------------------------------------

    def _step(self, step: str, run: Callable[[], Any], settle: Callable[[], None] | None = None,
              ends_session: bool = False) -> Any:
        """Runs one step of an update on this rank. At more than one rank the
        ranks then agree on its outcome (``_ranks``): if any failed, the ranks
        that succeeded ``settle`` (follow the failed ones), and only the server's
        last rank raises, naming every failure. ``ends_session``: a failure
        ends vLLM's worker session on every rank."""
        ranks = self._rank_group()
        error: BaseException | None = None
        result: Any = None
        try:
            result = run()
        except BaseException as e:
            error = e
        if ranks is None:
            if error is None:
                return result
            if ends_session:
                self._end_vllm_session()
            raise error
        outcomes = ranks.outcomes(None if error is None else f"{type(error).__name__}: {error}")
        if all(o is None for o in outcomes):
            return result
        if error is None and settle is not None:
            settle()
        if ends_session:
            self._end_vllm_session()
        why = _ranks.describe(step, outcomes)
        if not ranks.last:
            logger.warning("refit: %s (the server's last rank reports it)", why)
            return None
        if error is None:
            raise RuntimeError(why)
        try:
            combined = type(error)(why)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            combined = RuntimeError(why)
        raise combined from error

    def _rank_group(self) -> _ranks.ServerRanks | None:
        if not hasattr(self, "_server_ranks"):
            self._server_ranks = _ranks.of_server(self.parallel_config)
        return self._server_ranks

    def _end_vllm_session(self) -> None:
        """Ends vLLM's worker session (its ``_weight_update_active``), as vLLM's
        worker does itself when ``update_weights`` raises but not when
        ``finish_weight_update`` does (then every later start would be refused)."""
        worker = self._vllm_worker()
        if worker is not None and getattr(worker, "_weight_update_active", False):
            worker._weight_update_active = False
            self.reset_weight_update_target()

    def _vllm_worker(self) -> Any:
        """The vLLM worker that holds this engine: found once, in the frames of
        the worker's call into it (vLLM keeps no reference back)."""
        ref = getattr(self, "_worker_ref", None)
        worker = ref() if ref is not None else None
        if worker is not None:
            return worker
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if candidate is not self and getattr(candidate, "weight_transfer_engine", None) is self:
                self._worker_ref = weakref.ref(candidate)
                return candidate
            frame = frame.f_back
        logger.warning("refit: cannot find the vLLM worker that holds this engine; its session may stay open")
        return None

    def _fail(self, why: str) -> None:
        """Ends the open session after a failure: refit's session aborted (a staged
        stage discarded), vLLM's reload closed with every unprocessed layer back at
        its old weights."""
        session, self._session = self._session, None
        engine = getattr(self, "_refit", None)
        if engine is not None:
            try:
                engine.drain()  # loads of the failed chunk that may still run
            except BaseException:  # noqa: BLE001 - the original error is what matters
                pass
        if session is not None:
            try:
                restored = session.reload.settle(failed=True)
                if restored:
                    logger.warning("refit: %s; layers restored to their old weights: %s", why, restored)
            except BaseException:  # noqa: BLE001
                logger.exception("refit: closing vLLM's layerwise reload after a failure failed")
        if engine is None or session is None or not session.started:
            return
        try:
            engine.abort_weight_update(why)
        except refit.Error:
            pass  # nothing to abort any more: the original error is what matters

    def _release(self) -> None:
        engine, self._refit = getattr(self, "_refit", None), None
        self._backend = None
        self._session = None
        if engine is not None:
            engine.shutdown()


def _bounded_wait(init: dict[str, Any], timeout_ms: int) -> dict[str, Any]:
    """The trainer's init info with its ``timeout_ms`` (refit's engines wait on the
    trainer that long) no longer than this worker's own."""
    theirs = init.get("timeout_ms")
    if isinstance(theirs, int) and not isinstance(theirs, bool) and theirs > timeout_ms:
        return {**init, "timeout_ms": timeout_ms}
    return init


@dataclass
class _Session:
    reload: _reload.LayerwiseReload
    chunks: int = 0
    started: bool = False  # refit's session (at the first chunk)
    fleet_atomic: bool = False


def tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """For every parameter name the model shares with others (tied weights, such
    as ``lm_head.weight`` and ``model.embed_tokens.weight``), the other names of
    the same parameter. Read from the loaded model, before any reload opens (a
    reload puts each layer's tensors on the meta device apart)."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return {n: tuple(o for o in group if o != n) for group in names_of.values() if len(group) > 1 for n in group}


def _model_loader(model: torch.nn.Module, tied: dict[str, tuple[str, ...]] | None = None):
    """``model.load_weights`` as refit's ``load_weights``: called on refit's
    processing thread, so the MTP-completeness switch vLLM's NCCL engine turns off
    around its receive (a ContextVar: per thread) is turned off there.

    With ``tied`` (:func:`tied_names`), a tensor loaded under one name of a tied
    parameter is loaded under its other names too, unless the same load names
    them: vLLM processes each layer apart (on CPUs it packs ``lm_head``'s weight
    for its GEMM), so a layer whose tied weight arrived only under the other
    layer's name would keep serving its old packed copy. A trainer's
    ``named_parameters()`` (and a checkpoint) name a tied weight once, its
    ``state_dict()`` under both names: both now serve the same."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:  # vLLM 0.32
        disable_mtp_completeness_check = None

    def with_tied(weights: Any) -> Any:
        if not tied:
            return weights  # as given: the loader check follows an iterator's progress
        weights = list(weights)
        named = {n for n, _ in weights}
        extra = [(alias, t) for n, t in weights for alias in tied.get(n, ()) if alias not in named]
        return weights + extra if extra else weights

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        weights = with_tied(weights)
        if disable_mtp_completeness_check is None:
            model.load_weights(weights)
            return
        with disable_mtp_completeness_check():
            model.load_weights(weights)

    return load_weights
