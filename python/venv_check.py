"""python/venv.sh's check of the default venv: it imports what refit, its vLLM
backend and their tests use."""
import importlib

import nanobind, numpy, pytest, requests  # noqa: F401
import torch

x = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
assert x.sum().item() == 15.0

import vllm.distributed.weight_transfer  # noqa: F401
from vllm.config import ParallelConfig, VllmConfig, WeightTransferConfig
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.plugins import load_general_plugins

# Every built-in engine's module loads (modelexpress needs ModelExpress, a
# separate install; the sharded_rdt trainer needs Ray: neither is installed).
for name, loader in WeightTransferEngineFactory._registry.items():
    if name != "modelexpress":
        loader()
for name, loader in WeightTransferTrainerFactory._registry.items():
    if name != "sharded_rdt":
        loader()
assert WeightTransferConfig(backend="refit").backend == "refit"
VllmConfig(parallel_config=ParallelConfig(), weight_transfer_config=WeightTransferConfig(backend="refit"))
m = torch.nn.Linear(2, 2)
assert [n for n, _ in ModuleSource(m).iter_full()] == ["weight", "bias"]
HTTPVLLMWeightSyncClient("http://127.0.0.1:1")
load_general_plugins()
print("venv.sh: torch", torch.__version__, "vllm", importlib.import_module("vllm").__version__, "import fine")
