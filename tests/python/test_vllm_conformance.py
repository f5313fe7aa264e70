"""refit's vLLM backend (refit.vllm) against vLLM 0.33.0's weight-transfer interface.

Run in the venv of python/venv.sh with refit's wheel installed:

    VENV=$(python/venv.sh | tail -1)
    $VENV/bin/pip install --no-deps dist/refit-*.whl
    $VENV/bin/python -m pytest tests/python/test_vllm_conformance.py

Skipped as a whole (with the reason) when ``import refit`` fails, unless
REFIT_REQUIRE_PYTHON is set, which makes that a failure (CI sets it).

What it checks, all through vLLM's own entry points:

* discovery: the ``vllm.general_plugins`` entry point of refit's wheel, run by
  ``vllm.plugins.load_general_plugins()``, registers "refit" in both factories;
  ``refit.vllm.register()`` is idempotent;
* configuration: ``WeightTransferConfig(backend="refit")`` inside a ``VllmConfig``;
* the worker engine, built by ``WeightTransferEngineFactory.create_engine`` with a
  real ``VllmConfig``: parse/validate init and update info, init -> start ->
  update (several chunks) -> finish into a ``torch.nn.Module`` whose
  ``load_weights`` records what it got, byte-exact over mixed dtypes (bf16, f16,
  f32, f64, int8, a 0-dim and a non-contiguous parameter), metadata reuse;
* the trainer engine, built by ``WeightTransferTrainerFactory.trainer_init(
  RefitTrainerInitInfo(...), client=..., source=ModuleSource(model))``, whose
  ``send_weights()`` drives the client: an in-process client standing in for
  vLLM's worker (the verbs of ``vllm/v1/worker/gpu_worker.py``), one worker and
  two (tensor-parallel ranks), and ``HTTPVLLMWeightSyncClient`` against a stdlib
  HTTP server serving vLLM's RLHF routes (``vllm/entrypoints/rl/online/
  api_router.py``: the same paths and JSON bodies);
* refit's staged commit; vLLM's MagicMock vllm_config; vLLM's layerwise reload for a
  model vLLM's loader recorded (parameters keep their storage);
* failures: a worker refusing its init info fails ``trainer_init`` at once, a
  failing ``load_weights`` fails ``send_weights`` and the next round recovers, a
  source that disagrees with its metadata is named, non-sender ranks never touch
  the client.
"""

from __future__ import annotations

import http.server
import importlib.metadata
import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import pytest
import torch

# vLLM's CUDA wheel finds no platform on a machine without a GPU, and VllmConfig
# then cannot infer its device; vLLM's CPU CI selects the CPU platform so.
if torch.accelerator.device_count() == 0:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

try:
    import refit
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("REFIT_REQUIRE_PYTHON"):
        raise
    pytest.skip(
        f"refit is not importable ({e}); install refit's wheel into this venv "
        "(set REFIT_REQUIRE_PYTHON=1 to make this a failure)",
        allow_module_level=True,
    )

import vllm.plugins
from vllm.config import ParallelConfig, VllmConfig, WeightTransferConfig
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import refit.vllm as rv

TIMEOUT_MS = 20000  # refit's timeout for every operation here
JOIN_S = 60  # a test thread that takes longer is a hang


# --------------------------------------------------------------------------------
# Helpers


@pytest.fixture(autouse=True)
def _registered():
    rv.register()
    yield


def make_vllm_config(rank: int = 0, tensor_parallel_size: int = 1) -> VllmConfig:
    """A real VllmConfig, as a vLLM worker has it (model_config None: no model)."""
    return VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size, rank=rank),
        weight_transfer_config=WeightTransferConfig(backend="refit"),
    )


class RecordingModel(torch.nn.Module):
    """An inference model that records what ``load_weights`` got (copies: refit's
    tensors view its memory only during the call)."""

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.received: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self.calls = 0
        self._lock = threading.Lock()
        self._busy = False

    def load_weights(self, weights):
        with self._lock:
            assert not self._busy, "load_weights called concurrently with itself"
            self._busy = True
        try:
            self.calls += 1
            loaded = set()
            for name, tensor in weights:
                assert isinstance(tensor, torch.Tensor), type(tensor)
                if name == self.fail_on:
                    raise LoadFailure(f"cannot load {name}")
                self.received[name] = tensor.detach().clone()
                self.order.append(name)
                loaded.add(name)
            return loaded
        finally:
            self._busy = False

    def reset(self) -> None:
        self.received.clear()
        self.order.clear()
        self.calls = 0


class LoadFailure(RuntimeError):
    pass


class _Block(torch.nn.Module):
    def __init__(self, g: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(24, 16, generator=g).to(dtype))
        self.norm = torch.nn.Parameter(torch.randn(16, generator=g).to(torch.float16))


class TrainerModel(torch.nn.Module):
    """The trainer's model: nested modules (dotted names), mixed dtypes, a 0-dim
    parameter, an int8 one, a non-contiguous one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(32, 16, generator=g).to(torch.bfloat16))
        self.layers = torch.nn.ModuleList([_Block(g, torch.float32), _Block(g, torch.bfloat16)])
        self.scale = torch.nn.Parameter(torch.randn((), generator=g))
        self.codes = torch.nn.Parameter(
            torch.randint(-128, 128, (7, 5), generator=g, dtype=torch.int8), requires_grad=False
        )
        self.lm_head = torch.nn.Parameter(torch.randn(16, 32, generator=g, dtype=torch.float64).t())
        assert not self.lm_head.is_contiguous()

    @torch.no_grad()
    def step(self, seed: int) -> None:
        """One "training step": new values, same metadata."""
        g = torch.Generator().manual_seed(seed)
        for _, p in self.named_parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            else:
                p.copy_(torch.randint(-128, 128, p.shape, generator=g, dtype=p.dtype))


def expected_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def assert_received(model: RecordingModel, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(model.received) == sorted(expected), (sorted(model.received), sorted(expected))
    for name, want in expected.items():
        got = model.received[name]
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert tuple(got.shape) == tuple(want.shape), (name, tuple(got.shape), tuple(want.shape))
        assert torch.equal(as_bytes(got), as_bytes(want)), f"{name}: bytes differ"


def run_concurrently(*fns: Callable[[], Any]) -> list[Any]:
    """Runs each function in its own thread; returns their results, raises the
    first error; a thread still running after JOIN_S is a failure (a hang)."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a concurrent call did not finish (hang)"
    for e in errors:
        if e is not None:
            raise e
    return results


def make_worker(model: torch.nn.Module | None = None, vllm_config: VllmConfig | None = None):
    """A worker-side engine as vLLM's GPUWorker.load_model builds it."""
    vllm_config = vllm_config or make_vllm_config()
    model = model if model is not None else RecordingModel()
    engine = WeightTransferEngineFactory.create_engine(
        vllm_config.weight_transfer_config, vllm_config, torch.device("cpu"), model
    )
    return engine, model


class WorkerStub:
    """The weight-transfer verbs of vLLM's GPUWorker (vllm/v1/worker/gpu_worker.py):
    what an EngineClient / the HTTP routes reach through collective_rpc."""

    def __init__(self, engine: WeightTransferEngine, parallel_config: ParallelConfig) -> None:
        self.engine = engine
        self.parallel_config = parallel_config
        self.active = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def shutdown_weight_transfer_engine(self) -> None:
        if self.active:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self.engine.shutdown()

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active.")
        self.engine.start_weight_update()
        self.active = True

    def update_weights(self, update_info: dict | list[dict]) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            if isinstance(update_info, list):
                pc = self.parallel_config
                update_info = update_info[pc.data_parallel_index * pc.world_size + pc.rank]
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        try:
            self.engine.finish_weight_update()
        finally:
            self.active = False


class InProcessClient:
    """vLLM's VLLMWeightSyncClient protocol over WorkerStubs in this process: every
    call runs on every worker at once (as collective_rpc does) and returns when all
    did; records the calls."""

    def __init__(self, workers: list[WorkerStub]) -> None:
        self.workers = workers
        self.calls: list[tuple[str, Any]] = []
        self.versions: list[str] = []

    def _all(self, method: str, *args: Any) -> None:
        run_concurrently(*[lambda w=w: getattr(w, method)(*args) for w in self.workers])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init_weight_transfer_engine", json.loads(json.dumps(init_info))))
        self._all("init_weight_transfer_engine", init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("shutdown_weight_transfer_engine", None))
        self._all("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", None))
        self._all("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.calls.append(("update_weights", json.loads(json.dumps(update_info))))  # JSON-native
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", weight_version))
        self._all("finish_weight_update")
        if weight_version is not None:
            self.versions.append(weight_version)

    def verbs(self) -> list[str]:
        return [c[0] for c in self.calls]


def one_worker(model: RecordingModel | None = None):
    vllm_config = make_vllm_config()
    engine, model = make_worker(model, vllm_config)
    return engine, model, InProcessClient([WorkerStub(engine, vllm_config.parallel_config)])


def trainer_info(**kwargs: Any) -> rv.RefitTrainerInitInfo:
    kwargs.setdefault("timeout_ms", TIMEOUT_MS)
    kwargs.setdefault("worker_options", {"timeout_ms": TIMEOUT_MS})
    kwargs.setdefault("rank", 0)
    return rv.RefitTrainerInitInfo(**kwargs)


# --------------------------------------------------------------------------------
# Discovery and registration


def _without_refit(monkeypatch) -> None:
    """A process where refit was never registered (the test's own business:
    refit.vllm itself never reads vLLM's private registry)."""
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        monkeypatch.setattr(factory, "_registry", {k: v for k, v in factory._registry.items() if k != "refit"})
    monkeypatch.setattr(rv, "_registered", False)


def test_entry_point_registers_through_load_general_plugins(monkeypatch):
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "refit"]
    if not eps:
        message = "refit's vllm.general_plugins entry point is not installed (refit is not installed as a wheel)"
        if os.environ.get("REFIT_REQUIRE_PYTHON"):
            pytest.fail(message)
        pytest.skip(message)
    assert [ep.value for ep in eps] == ["refit.vllm:register"]

    _without_refit(monkeypatch)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "refit")  # only ours: vLLM's LoRA resolvers need not load
    vllm.plugins.load_general_plugins()

    assert WeightTransferEngineFactory._registry["refit"]() is rv.RefitWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["refit"]() is rv.RefitTrainerWeightTransferEngine


def test_register_is_idempotent(monkeypatch):
    _without_refit(monkeypatch)
    rv.register()
    rv.register()  # vLLM may load general plugins more than once per process
    assert WeightTransferEngineFactory._registry["refit"]() is rv.RefitWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["refit"]() is rv.RefitTrainerWeightTransferEngine
    with pytest.raises(ValueError, match="already registered"):  # vLLM's own guard stays
        WeightTransferEngineFactory.register_engine("refit", "refit.vllm", "RefitWeightTransferEngine")


def test_register_leaves_a_refit_registered_by_another_copy(monkeypatch):
    # Another copy of the module (another import path) registered first: vLLM's
    # public ValueError is taken as "done", the first registration stays.
    _without_refit(monkeypatch)
    WeightTransferEngineFactory.register_engine("refit", "refit.vllm._worker", "RefitWeightTransferEngine")
    rv.register()
    rv.register()
    assert WeightTransferEngineFactory._registry["refit"]() is rv.RefitWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["refit"]() is rv.RefitTrainerWeightTransferEngine


def test_register_does_not_read_vllms_private_registry():
    source = inspect.getsource(rv)
    assert "_registry" not in source, "refit.vllm must use only vLLM's public factory API"


def test_weight_transfer_config_accepts_refit():
    config = WeightTransferConfig(backend="refit")
    assert config.backend == "refit"
    vllm_config = make_vllm_config()
    assert vllm_config.weight_transfer_config.backend == "refit"


def test_unregistered_backend_is_refused_by_the_factory(monkeypatch):
    _without_refit(monkeypatch)
    vllm_config = make_vllm_config()
    with pytest.raises(ValueError, match="Invalid weight transfer backend"):
        WeightTransferEngineFactory.create_engine(
            vllm_config.weight_transfer_config, vllm_config, torch.device("cpu"), RecordingModel()
        )


# --------------------------------------------------------------------------------
# The classes against vLLM's bases


def test_worker_engine_implements_vllm_base():
    cls = rv.RefitWeightTransferEngine
    assert issubclass(cls, WeightTransferEngine)
    assert not inspect.isabstract(cls)
    assert list(inspect.signature(cls.__init__).parameters) == list(
        inspect.signature(WeightTransferEngine.__init__).parameters
    )
    assert issubclass(cls.init_info_cls, WeightTransferInitInfo)
    assert issubclass(cls.update_info_cls, WeightTransferUpdateInfo)
    # vLLM's deferred-processing contract (tests/distributed/test_weight_transfer.py)
    assert isinstance(cls.defers_processing, bool)
    assert cls.drain_pending is not WeightTransferEngine.drain_pending
    object.__new__(cls).drain_pending()  # needs no state before init
    assert list(inspect.signature(cls.update_weights).parameters) == ["self", "update_info"]
    assert list(inspect.signature(cls.receive_weights).parameters) == ["self", "update_info"]


def test_trainer_engine_implements_vllm_base():
    cls = rv.RefitTrainerWeightTransferEngine
    assert issubclass(cls, TrainerWeightTransferEngine)
    assert not inspect.isabstract(cls)
    assert cls.init_info_cls is rv.RefitTrainerInitInfo
    assert issubclass(rv.RefitTrainerInitInfo, TrainerInitInfo)
    assert rv.RefitTrainerInitInfo.backend == "refit"
    base = inspect.signature(TrainerWeightTransferEngine.trainer_init)
    ours = inspect.signature(cls.trainer_init)
    assert [(p.name, p.kind) for p in ours.parameters.values()] == [
        (p.name, p.kind) for p in base.parameters.values()
    ]
    with pytest.raises(TypeError):  # rank is keyword-only and required, as vLLM has it
        rv.RefitTrainerInitInfo()
    assert rv.RefitTrainerInitInfo(rank=0).is_sender
    assert not rv.RefitTrainerInitInfo(rank=1).is_sender


def test_in_process_client_is_a_vllm_client():
    assert isinstance(InProcessClient([]), VLLMWeightSyncClient)
    assert isinstance(HTTPVLLMWeightSyncClient("http://127.0.0.1:1"), VLLMWeightSyncClient)


# --------------------------------------------------------------------------------
# Parsing


def test_parse_init_info():
    engine, _ = make_worker()
    info = engine.parse_init_info({"init_info": {"master_address": "127.0.0.1", "master_port": 1}})
    assert isinstance(info, rv.RefitInitInfo)
    assert info.refit_backend == "tcp"
    assert info.init_info == {"master_address": "127.0.0.1", "master_port": 1}
    info = engine.parse_init_info({"refit_backend": "loopback", "init_info": {}, "commit": "staged"})
    assert (info.refit_backend, info.commit) == ("loopback", "staged")
    with pytest.raises(ValueError, match="Invalid init_info"):
        engine.parse_init_info({"init_info": {}, "no_such_member": 1})
    with pytest.raises(ValueError, match="commit"):
        engine.parse_init_info({"init_info": {}, "commit": "sometimes"})
    with pytest.raises(ValueError, match="init_info"):
        engine.parse_init_info({"init_info": [1, 2]})


def test_parse_update_info():
    engine, _ = make_worker()
    info = engine.parse_update_info(
        {"names": ["w1", "w2"], "dtype_names": ["float32", "bfloat16"], "shapes": [[100, 100], [50]]}
    )
    assert isinstance(info, rv.RefitUpdateInfo)
    assert info.names == ["w1", "w2"] and info.dtype_names == ["float32", "bfloat16"]
    assert info.shapes == [[100, 100], [50]]
    assert info.commit is None and info.extra == {}
    assert info.to_refit() == {
        "names": ["w1", "w2"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[100, 100], [50]],
    }
    assert engine.parse_update_info({}).names == []  # empty: reuse the previous metadata
    staged = engine.parse_update_info({"names": ["w"], "dtype_names": ["int8"], "shapes": [[3]], "commit": "staged"})
    assert staged.to_refit()["commit"] == "staged"
    with pytest.raises(ValueError, match="dtype_names"):
        engine.parse_update_info({"names": ["w1", "w2"], "dtype_names": ["float32"], "shapes": [[1], [1]]})
    with pytest.raises(ValueError, match="shapes"):
        engine.parse_update_info({"names": ["w1"], "dtype_names": ["float32"], "shapes": []})
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.parse_update_info({"names": [], "ipc_handles": []})


def test_calls_before_init_raise():
    engine, _ = make_worker()
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.receive_weights(rv.RefitUpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[1]]))
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.start_weight_update()
    engine.drain_pending()  # a no-op, as vLLM's contract wants
    engine.shutdown()  # nothing to release: must not raise
    engine.shutdown()


# --------------------------------------------------------------------------------
# Worker engine, driven directly (the trainer is a bare refit.Sender)


def test_worker_engine_init_start_update_finish():
    engine, model = make_worker()
    sender = refit.Sender("tcp", timeout_ms=TIMEOUT_MS)
    try:
        init_info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
        typed = engine.parse_init_info({"refit_backend": "tcp", "init_info": init_info, "timeout_ms": TIMEOUT_MS})
        run_concurrently(lambda: engine.init_transfer_engine(typed), sender.connect_workers)
        assert isinstance(engine.defers_processing, bool)

        trainer = TrainerModel(seed=1)
        named = [(n, p.detach().contiguous()) for n, p in trainer.named_parameters()]
        half = len(named) // 2
        chunks = [named[:half], named[half:]]

        # One session, two update_weights chunks.
        engine.start_weight_update()
        for chunk in chunks:
            meta = refit.describe(chunk)
            assert meta["dtype_names"] == [str(t.dtype).split(".")[-1] for _, t in chunk]  # vLLM's spelling
            run_concurrently(lambda m=meta: engine.update_weights(m), lambda c=chunk: sender.send_weights(c))
        engine.finish_weight_update()
        assert_received(model, expected_of(trainer))
        assert model.order == [n for n, _ in named]  # incremental, in send order

        # Next session: the same tensors with empty metadata (reused, as vLLM's NCCL
        # engine allows), then drain_pending by hand.
        model.reset()
        trainer.step(seed=2)
        named = [(n, p.detach().contiguous()) for n, p in trainer.named_parameters()]
        engine.start_weight_update()
        run_concurrently(lambda: engine.update_weights(refit.describe(named)), lambda: sender.send_weights(named))
        engine.drain_pending()
        engine.finish_weight_update()
        assert_received(model, expected_of(trainer))

        engine.start_weight_update()
        run_concurrently(lambda: engine.update_weights({}), lambda: sender.send_weights(named))
        engine.finish_weight_update()
        assert_received(model, expected_of(trainer))
    finally:
        sender.shutdown()
        engine.shutdown()


def test_empty_first_update_is_refused():
    engine, _ = make_worker()
    sender = refit.Sender("tcp", timeout_ms=TIMEOUT_MS)
    try:
        init_info = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
        run_concurrently(
            lambda: engine.init_transfer_engine(engine.parse_init_info({"init_info": init_info})),
            sender.connect_workers,
        )
        engine.start_weight_update()
        with pytest.raises(ValueError, match="no previous update"):
            engine.update_weights({})
    finally:
        sender.shutdown()
        engine.shutdown()


# --------------------------------------------------------------------------------
# Trainer engine through vLLM's trainer factory


# refit's backends that work without a GPU; loopback connects a sender and its
# engines in one process (its trainer_args name the channel); ucx moves the bytes
# over UCX (shared memory here).
BACKENDS = {"tcp": {}, "ucx": {}, "loopback": {"channel": "vllm-conformance"}}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_trainer_engine_in_process_client(backend):
    engine, model, client = one_worker()
    trainer_model = TrainerModel(seed=3)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, refit_backend=backend, trainer_args=BACKENDS[backend]),
        client=client,
        source=ModuleSource(trainer_model),
    )
    try:
        assert isinstance(trainer, rv.RefitTrainerWeightTransferEngine)
        assert client.verbs() == ["init_weight_transfer_engine"]
        init_payload = client.calls[0][1]
        assert init_payload["refit_backend"] == backend
        assert isinstance(init_payload["init_info"], dict)

        trainer.send_weights()
        assert client.verbs()[1:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        first = client.calls[2][1]
        assert first["names"] == [n for n, _ in trainer_model.named_parameters()]
        assert first["dtype_names"] == [str(p.dtype).split(".")[-1] for _, p in trainer_model.named_parameters()]
        assert first["shapes"] == [list(p.shape) for _, p in trainer_model.named_parameters()]
        assert_received(model, expected_of(trainer_model))

        # Round 2: same metadata, so none is shipped; the version reaches finish.
        model.reset()
        trainer_model.step(seed=4)
        trainer.send_weights("step-2")
        assert client.verbs()[4:] == ["start_weight_update", "update_weights", "finish_weight_update"]
        assert client.calls[5][1]["names"] == []
        assert client.calls[6][1] == "step-2"
        assert client.versions == ["step-2"]
        assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
@pytest.mark.parametrize("commit", ["staged", "in_place"])
def test_delta_updates_decode_against_the_workers_host_copy(commit, backend):
    """trainer_args {"delta": True}: the workers keep a host copy of what refit
    delivered (keep_base, set by the trainer engine), so each round after the first
    goes as deltas against it and vLLM's load_weights still gets every tensor whole
    and exact; with worker_options keep_base False the worker says it cannot and
    gets the round full."""
    engine, model, client = one_worker()
    trainer_model = TrainerModel(seed=21)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, refit_backend=backend, trainer_args={"delta": True},
                     worker_options={"timeout_ms": TIMEOUT_MS, "commit": commit}),
        client=client, source=ModuleSource(trainer_model))
    g = torch.Generator().manual_seed(5)

    @torch.no_grad()
    def nudge() -> None:  # about 1% of each float parameter's elements move one ulp
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        for p in trainer_model.parameters():
            if not p.dtype.is_floating_point:
                continue
            t = p.detach().clone().reshape(-1)
            at = torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 100)]
            bits = t.view(ints[t.element_size()])
            bits[at] += 1
            p.copy_(t.view(p.shape))

    try:
        assert client.calls[0][1]["keep_base"] is True
        trainer.send_weights()
        assert_received(model, expected_of(trainer_model))
        for _ in range(2):
            model.reset()
            nudge()
            trainer.send_weights()
            d = trainer.sender.last_send_info["delta"]
            assert (d["delta_workers"], d["full_fallbacks"]) == (1, 0), d
            assert d["encoded_buckets"] > 0 and d["delta_bytes"] < d["full_bytes"] / 2, d
            assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()
    # Without the copy: the worker refuses the base and gets each round full.
    engine, model, client = one_worker()
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, refit_backend=backend, trainer_args={"delta": True},
                     worker_options={"timeout_ms": TIMEOUT_MS, "commit": commit, "keep_base": False}),
        client=client, source=ModuleSource(trainer_model))
    try:
        trainer.send_weights()
        model.reset()
        nudge()
        trainer.send_weights()
        d = trainer.sender.last_send_info["delta"]
        assert (d["delta_workers"], d["full_fallbacks"]) == (0, 1), d
        assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()


@pytest.mark.parametrize("where", ["update", "worker_default"])
def test_staged_commit(where):
    """refit's staged commit (the update lands at finish_weight_update), asked for per
    update by the trainer or as the workers' default."""
    engine, model, client = one_worker()
    trainer_model = TrainerModel(seed=12)
    kwargs = {"commit": "staged"} if where == "update" else {
        "worker_options": {"timeout_ms": TIMEOUT_MS, "commit": "staged"}}
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, **kwargs), client=client, source=ModuleSource(trainer_model)
    )
    try:
        trainer.send_weights()
        if where == "update":
            assert client.calls[2][1]["commit"] == "staged"
        else:
            assert client.calls[0][1]["commit"] == "staged"
        assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()


def test_vllm_test_style_mock_config():
    """The MagicMock vllm_config vLLM's own engine tests pass
    (tests/distributed/test_weight_transfer.py: create_mock_vllm_config)."""
    from unittest.mock import MagicMock

    parallel_config = MagicMock(spec=ParallelConfig)
    parallel_config.rank = 0
    parallel_config.world_size = 1
    parallel_config.data_parallel_rank = 0
    parallel_config.data_parallel_index = 0
    vllm_config = MagicMock()
    vllm_config.parallel_config = parallel_config
    vllm_config.model_config = MagicMock()
    vllm_config.weight_transfer_config = WeightTransferConfig(backend="refit")
    engine, model = make_worker(vllm_config=vllm_config)
    client = InProcessClient([WorkerStub(engine, parallel_config)])
    trainer_model = TrainerModel(seed=13)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2), client=client, source=ModuleSource(trainer_model)
    )
    try:
        trainer.send_weights()
        assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()


def test_layerwise_reload_for_a_model_vllm_loaded():
    """A model vLLM's loader built (record_metadata_for_reloading) is reloaded
    layerwise, as vLLM's NCCL engine does: start puts it on meta and wraps its
    weight loaders, finish finalizes; the parameters keep their storage and get the
    trainer's bytes."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.utils import set_weight_attrs

    class VllmStyleModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
            self.b = torch.nn.Linear(8, 4)
            for p in self.parameters():
                set_weight_attrs(p, {"weight_loader": default_weight_loader})

        def load_weights(self, weights):
            params = dict(self.named_parameters())  # now: start swapped them
            loaded = set()
            for name, w in weights:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
            return loaded

    model = VllmStyleModel()
    record_metadata_for_reloading(model)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    vllm_config = make_vllm_config()
    engine, _ = make_worker(model, vllm_config)
    client = InProcessClient([WorkerStub(engine, vllm_config.parallel_config)])
    source_model = VllmStyleModel()
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2), client=client, source=ModuleSource(source_model)
    )
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        assert model in LAYERWISE_INFO  # what makes refit reload it layerwise
        for seed in (14, 15):
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in source_model.parameters():
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            trainer.send_weights()
            for (name, got), (_, want) in zip(model.named_parameters(), source_model.named_parameters()):
                assert got.device.type == "cpu" and got.dtype == want.dtype, name
                assert torch.equal(as_bytes(got), as_bytes(want)), name
                assert got.data_ptr() == storage[name], f"{name} moved"
    finally:
        trainer.shutdown()
        engine.shutdown()


class _VllmStyleModel(torch.nn.Module):
    """Two layers loaded through vLLM's weight loaders, recorded for vLLM's
    layerwise reload as vLLM's model loader records every model it builds;
    ``fail_on`` makes load_weights raise at that tensor (after loading the ones
    before it in the batch): with its bytes only, like a loader that fails on the
    data (refit's check, which runs the loader on meta tensors, passes), or on its
    name too with ``fail_on_meta`` (the check refuses the update)."""

    def __init__(self, fail_on: str | None = None, fail_on_meta: bool = False) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        from vllm.model_executor.utils import set_weight_attrs

        super().__init__()
        self.fail_on = fail_on
        self.fail_on_meta = fail_on_meta
        self.a = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
        self.b = torch.nn.Linear(8, 4, dtype=torch.bfloat16)
        for p in self.parameters():
            set_weight_attrs(p, {"weight_loader": default_weight_loader})

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            if name == self.fail_on and (self.fail_on_meta or not w.is_meta):
                raise LoadFailure(f"cannot load {name}")
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded


def _recorded(model: torch.nn.Module) -> torch.nn.Module:
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    record_metadata_for_reloading(model)
    return model


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: as_bytes(p).clone() for n, p in model.named_parameters()}


def _source_like(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    src = _VllmStyleModel()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return src


def test_staged_update_reaches_the_model_only_at_finish():
    """Staged (the default): after update_weights every byte is in refit's stage and
    the model still serves its old weights, none on the meta device; finish loads
    them through vLLM's layerwise reload (parameters keep their storage)."""
    model = _recorded(_VllmStyleModel())
    before = _snapshot(model)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    vllm_config = make_vllm_config()
    engine, _ = make_worker(model, vllm_config)
    stub = WorkerStub(engine, vllm_config.parallel_config)
    src = _source_like(model, 31)
    sender = refit.Sender("tcp", timeout_ms=TIMEOUT_MS)
    try:
        init = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 2})
        run_concurrently(lambda: stub.init_weight_transfer_engine({"init_info": init, "timeout_ms": TIMEOUT_MS}),
                         sender.connect_workers)
        stub.start_weight_update()
        assert _snapshot(model).keys() == before.keys()
        info = {"names": [n for n, _ in src.named_parameters()],
                "dtype_names": ["bfloat16"] * 4, "shapes": [list(p.shape) for p in src.parameters()]}
        run_concurrently(lambda: stub.update_weights(info),
                         lambda: sender.send_weights([(n, p.detach()) for n, p in src.named_parameters()]))
        for name, p in model.named_parameters():
            assert not p.is_meta, f"{name} is on the meta device between update_weights and finish"
            assert torch.equal(as_bytes(p), before[name]), f"{name} changed before finish (staged)"
        stub.finish_weight_update()
        for (name, got), (_, want) in zip(model.named_parameters(), src.named_parameters()):
            assert torch.equal(as_bytes(got), as_bytes(want)), name
            assert got.data_ptr() == storage[name], f"{name} moved"
    finally:
        sender.shutdown()
        engine.shutdown()


@pytest.mark.parametrize("commit,on_names", [("staged", False), ("in_place", False), ("staged", True)])
def test_load_weights_that_raises_leaves_every_layer_whole(commit, on_names):
    """The model's load_weights raises at b.bias. On its bytes (layer b got its
    weight, not its bias): the update fails, nothing is left on the meta device,
    layer a (processed before the failure) holds the new weights and layer b its old
    ones, whole. On its name, whatever the bytes: refit's check runs the loader on
    meta tensors first, so the update is refused naming the tensor and quoting the
    loader, and every layer keeps its old bytes. Either way the next update lands."""
    model = _recorded(_VllmStyleModel(fail_on="b.bias", fail_on_meta=on_names))
    before = _snapshot(model)
    vllm_config = make_vllm_config()
    engine, _ = make_worker(model, vllm_config)
    client = InProcessClient([WorkerStub(engine, vllm_config.parallel_config)])
    src = _source_like(model, 32)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, commit=commit), client=client, source=ModuleSource(src))
    try:
        refused = r"'b\.bias': vLLM's loader refuses it: LoadFailure: cannot load b\.bias"
        match = refused if on_names else "cannot load b.bias"
        with pytest.raises(Exception, match=match):
            trainer.send_weights()
        new = {n: as_bytes(p) for n, p in src.named_parameters()}
        for name, p in model.named_parameters():
            assert not p.is_meta, name
            changed = name.startswith("a.") and not on_names
            want = new[name] if changed else before[name]
            assert torch.equal(as_bytes(p), want), f"{name}: not the {'new' if changed else 'old'} bytes"
        # The trainer's send fails as soon as the worker refuses; the worker's own
        # update_weights call (on the client's thread) ends its session just after.
        deadline = time.monotonic() + 10
        while engine.refit_state()["session_active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.refit_state()["session_active"] is False
        model.fail_on = None
        trainer.send_weights()
        for (name, got), (_, want) in zip(model.named_parameters(), src.named_parameters()):
            assert torch.equal(as_bytes(got), as_bytes(want)), name
    finally:
        trainer.shutdown()
        engine.shutdown()


def test_update_that_does_not_fit_the_checkpoint_is_refused_before_a_byte_moves(tmp_path):
    """With the checkpoint the model was loaded from (safetensors in
    model_config.model), an update naming a tensor the model lacks, or with another
    shape or dtype, or with only part of a fused layer, is refused at once, naming
    it; the model is untouched; the same trainer engine's next update lands."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    model = _recorded(_VllmStyleModel())
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp_path / "model.safetensors"))
    before = _snapshot(model)
    vllm_config = make_vllm_config()
    engine, _ = make_worker(model, vllm_config)
    engine.model_config = SimpleNamespace(model=str(tmp_path), dtype=torch.bfloat16, revision=None)
    client = InProcessClient([WorkerStub(engine, vllm_config.parallel_config)])

    class Extra(_VllmStyleModel):
        def __init__(self) -> None:
            super().__init__()
            self.c = torch.nn.Linear(2, 2, dtype=torch.bfloat16)

    class Wider(_VllmStyleModel):
        def __init__(self) -> None:
            super().__init__()
            self.b = torch.nn.Linear(8, 5, dtype=torch.bfloat16)

    class Half(_VllmStyleModel):
        def __init__(self) -> None:
            super().__init__()
            del self.b.bias

    for bad, named in ((Extra(), "c.weight"), (Wider(), "b.weight"), (Half(), "b.bias")):
        trainer = WeightTransferTrainerFactory.trainer_init(
            trainer_info(world_size=2), client=client, source=ModuleSource(bad))
        try:
            started = time.monotonic()
            with pytest.raises(Exception, match=named.replace(".", r"\.")):
                trainer.send_weights()
            assert time.monotonic() - started < TIMEOUT_MS / 2000, "the refusal waited for a deadline"
            assert _snapshot(model).keys() == before.keys()
            for name, p in model.named_parameters():
                assert torch.equal(as_bytes(p), before[name]), f"{name} changed by a refused update"
            good = _source_like(model, 33)
            trainer.source = ModuleSource(good)
            trainer.send_weights()
            for (name, got), (_, want) in zip(model.named_parameters(), good.named_parameters()):
                assert torch.equal(as_bytes(got), as_bytes(want)), name
            before = _snapshot(model)
        finally:
            trainer.shutdown()
    engine.shutdown()


def test_trainer_engine_two_workers():
    """Two workers of one vLLM engine (tensor-parallel ranks 0 and 1): each finds its
    own refit rank from its ParallelConfig; both get every tensor."""
    workers, models, engines = [], [], []
    for rank in (0, 1):
        vllm_config = make_vllm_config(rank=rank, tensor_parallel_size=2)
        engine, model = make_worker(vllm_config=vllm_config)
        workers.append(WorkerStub(engine, vllm_config.parallel_config))
        models.append(model)
        engines.append(engine)
    client = InProcessClient(workers)
    trainer_model = TrainerModel(seed=5)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=3), client=client, source=ModuleSource(trainer_model)
    )
    try:
        for seed in (6, 7):
            trainer_model.step(seed)
            for m in models:
                m.reset()
            trainer.send_weights()
            for m in models:
                assert_received(m, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        for e in engines:
            e.shutdown()


class _RLHFRoutes(http.server.BaseHTTPRequestHandler):
    """vLLM's RLHF weight-sync routes (vllm/entrypoints/rl/online/api_router.py):
    POST /init_weight_transfer_engine {"init_info": {...}}, /start_weight_update,
    /update_weights {"update_info": {...} | [...]}, /finish_weight_update
    {"weight_version": str} (or no body), /shutdown_weight_transfer_engine."""

    worker: WorkerStub
    log: list[tuple[str, Any]]

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        path = self.path.strip("/")
        self.log.append((path, body))
        try:
            if path == "init_weight_transfer_engine":
                self.worker.init_weight_transfer_engine(body["init_info"])
            elif path == "start_weight_update":
                self.worker.start_weight_update()
            elif path == "update_weights":
                self.worker.update_weights(body["update_info"])
            elif path == "finish_weight_update":
                self.worker.finish_weight_update()
                if body and body.get("weight_version") is not None:
                    self.server.weight_version = body["weight_version"]
            elif path == "shutdown_weight_transfer_engine":
                self.worker.shutdown_weight_transfer_engine()
            else:
                self._reply(404, {"detail": "Not Found"})
                return
        except Exception as e:  # noqa: BLE001 - the server answers 500, as vLLM's
            self._reply(500, {"error": repr(e)})
            return
        self._reply(200, {"message": "ok"})

    def _reply(self, status: int, content: dict) -> None:
        data = json.dumps(content).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_trainer_engine_over_http():
    vllm_config = make_vllm_config()
    engine, model = make_worker(vllm_config=vllm_config)
    log: list[tuple[str, Any]] = []
    handler = type("Routes", (_RLHFRoutes,), {"worker": WorkerStub(engine, vllm_config.parallel_config), "log": log})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.weight_version = None
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_address[1]}", timeout=JOIN_S)
    trainer_model = TrainerModel(seed=8)
    trainer = None
    try:
        trainer = WeightTransferTrainerFactory.trainer_init(
            trainer_info(world_size=2), client=client, source=ModuleSource(trainer_model)
        )
        assert [p for p, _ in log] == ["init_weight_transfer_engine"]
        assert log[0][1]["init_info"]["refit_backend"] == "tcp"

        trainer.send_weights("step-1")
        assert [p for p, _ in log[1:]] == ["start_weight_update", "update_weights", "finish_weight_update"]
        assert log[1][1] is None
        assert log[2][1]["update_info"]["names"] == [n for n, _ in trainer_model.named_parameters()]
        assert log[3][1] == {"weight_version": "step-1"}
        assert server.weight_version == "step-1"
        assert_received(model, expected_of(trainer_model))

        model.reset()
        trainer_model.step(seed=9)
        trainer.send_weights()
        assert log[-1] == ("finish_weight_update", None)
        assert_received(model, expected_of(trainer_model))

        client.shutdown_weight_transfer_engine()
        assert log[-1] == ("shutdown_weight_transfer_engine", None)
        with pytest.raises(RuntimeError, match="not initialized"):
            engine.start_weight_update()
    finally:
        if trainer is not None:
            trainer.shutdown()
        server.shutdown()
        server.server_close()
        engine.shutdown()


# --------------------------------------------------------------------------------
# Failures


def test_worker_refusing_init_fails_trainer_init_at_once():
    engine, _, client = one_worker()
    started = time.monotonic()
    with pytest.raises(ValueError, match="commit"):
        WeightTransferTrainerFactory.trainer_init(
            trainer_info(world_size=2, worker_options={"timeout_ms": TIMEOUT_MS, "commit": "sometimes"}),
            client=client,
            source=ModuleSource(TrainerModel()),
        )
    assert time.monotonic() - started < TIMEOUT_MS / 1000 / 2, "waited for refit's timeout"
    engine.shutdown()


def test_failing_load_weights_fails_the_round_and_the_next_recovers():
    model = RecordingModel(fail_on="layers.1.qkv")
    engine, model, client = one_worker(model)
    trainer_model = TrainerModel(seed=10)
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2), client=client, source=ModuleSource(trainer_model)
    )
    try:
        with pytest.raises(Exception) as failed:  # noqa: PT011 - refit's kind or the loader's own
            trainer.send_weights()
        chain, e = [], failed.value
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__cause__ or e.__context__
        assert any("layers.1.qkv" in c for c in chain), chain

        model.fail_on = None
        model.reset()
        trainer_model.step(seed=11)
        trainer.send_weights()
        assert_received(model, expected_of(trainer_model))
    finally:
        trainer.shutdown()
        engine.shutdown()


class _DisagreeingSource(WeightSource):
    """Declares [a, b]; iterates a with another shape."""

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta("a", torch.float32, (4,)), ParamMeta("b", torch.float32, (2,))]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "a", torch.zeros(5)
        yield "b", torch.zeros(2)


def test_source_disagreeing_with_its_metadata_is_named():
    engine, _, client = one_worker()
    trainer = WeightTransferTrainerFactory.trainer_init(
        trainer_info(world_size=2, timeout_ms=5000, worker_options={"timeout_ms": 5000}),
        client=client,
        source=_DisagreeingSource(),
    )
    try:
        with pytest.raises(ValueError, match=r"index 0.*'a'"):
            trainer.send_weights()
    finally:
        trainer.shutdown()  # the worker's receive fails (peer lost or timeout)
        deadline = time.monotonic() + JOIN_S
        while client.workers[0].active and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.shutdown()


class RecordingClient:
    """A client that must not be called (non-sender ranks)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init_weight_transfer_engine")

    def start_weight_update(self):
        self.calls.append("start_weight_update")

    def update_weights(self, update_info):
        self.calls.append("update_weights")

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish_weight_update")


def test_non_sender_rank_never_touches_the_client():
    class CountingSource(ModuleSource):
        iterated = 0

        def iter_full(self):
            for pair in super().iter_full():
                CountingSource.iterated += 1
                yield pair

    client = RecordingClient()
    source = CountingSource(TrainerModel())
    trainer = WeightTransferTrainerFactory.trainer_init(trainer_info(rank=1), client=client, source=source)
    assert trainer.is_sender is False and trainer.sender is None
    trainer.send_weights()
    assert client.calls == []
    assert CountingSource.iterated == len(source.metadata)  # it joined the gathers
    trainer.shutdown()


def test_trainer_init_requires_a_full_source():
    with pytest.raises(ValueError, match="requires a WeightSource"):
        WeightTransferTrainerFactory.trainer_init(trainer_info(), client=RecordingClient(), source=None)

    class Partitioned(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta("w", torch.float32, (2,), owners=(1,))]

        def iter_full(self):
            yield "w", torch.zeros(2)

    client = RecordingClient()
    with pytest.raises(ValueError, match="not held by trainer rank 0"):
        WeightTransferTrainerFactory.trainer_init(trainer_info(), client=client, source=Partitioned())
    assert client.calls == []
