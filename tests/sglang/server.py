"""A real SGLang server on this machine's CPUs with refit's loader, for tests and
benchmarks: tests/vllm_serve's Server (its own process group, a log, a deadline
for coming up, always stopped) with SGLang's command line, and the calls a user
makes (greedy /generate with the weight_version of its answer)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import requests

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "vllm_serve"))
from serve import Server, free_port, make_model  # noqa: E402,F401

PROMPT = "Once upon a time there was a small language model"


@dataclass
class Answer:
    text: str
    tokens: list[int]
    weight_version: str | None


class SGLangServer(Server):
    """``python -m sglang.launch_server`` on CPUs, ``--custom-weight-loader
    refit.sglang.load_weights``; ``extra_args`` appended. It writes bytecode (under
    the venv, not the checkout) even where PYTHONDONTWRITEBYTECODE is set: without
    it each of the server's three processes spends about 40 s importing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(sys.prefix, ".pycache"))

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), "--device", "cpu", "--attention-backend", "torch_native",
                "--disable-overlap-schedule", "--disable-cuda-graph", "--skip-server-warmup",
                "--max-total-tokens", "2048", "--custom-weight-loader", "refit.sglang.load_weights",
                *self.extra_args]

    def generate(self, prompt: str = PROMPT, tokens: int = 8) -> Answer:
        r = requests.post(self.url + "/generate", json={
            "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}}, timeout=120)
        r.raise_for_status()
        body = r.json()
        meta = body.get("meta_info", {})
        return Answer(body["text"], list(body.get("output_ids") or meta.get("output_token_ids") or []),
                      meta.get("weight_version"))


def checkpoint(model: str) -> dict:
    """The model's tensors by name, as its checkpoint holds them (the trainer's)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(model, "model.safetensors"))
