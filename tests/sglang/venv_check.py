"""python/venv.sh's check of the tests/sglang venv: torch runs on the CPU, and
what `python -m sglang.launch_server` imports (its HTTP server, the scheduler
that loads weights, the weight-update request types and serializer) is there."""

import importlib.metadata

import torch

x = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
assert x.sum().item() == 15.0

assert importlib.metadata.version("sglang") == "0.5.23", importlib.metadata.version("sglang")
import pytest  # noqa: F401  (tests/sglang/run.sh)
import requests  # noqa: F401  (tests/sglang/server.py's client)
import safetensors  # noqa: F401
import tokenizers  # noqa: F401
import transformers  # noqa: F401  (tests/vllm_serve/make_model.py)

import sglang.launch_server  # noqa: F401
from sglang.srt.entrypoints import http_server  # noqa: F401
from sglang.srt.managers import scheduler  # noqa: F401
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput  # noqa: F401
from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater  # noqa: F401
from sglang.srt.models.llama import LlamaForCausalLM  # noqa: F401
from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
import vllm._custom_ops  # noqa: F401  (sglang/srt/layers/rotary_embedding/base.py imports it)

print("venv_check: torch", torch.__version__, "sglang", importlib.metadata.version("sglang"), "import fine")
