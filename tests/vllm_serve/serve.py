"""A real ``vllm serve`` with refit's backend, for tests and benchmarks.

:class:`Server` starts it in the background (its own process group, a log file,
a hard deadline for coming up) and always stops it (SIGTERM to the group, SIGKILL
after a grace period). The helpers talk to it over HTTP the way a trainer does:
vLLM's RLHF routes (``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/weight_info``, ``/pause``,
``/resume``) and completions (greedy, with logprobs).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import requests

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(out: str, **kwargs: Any) -> str:
    """The tiny model of make_model.py in ``out`` (reused when its settings match);
    ``family="qwen2"`` etc. for another family than Llama's."""
    settings = {"hidden": 128, "layers": 2, "dtype": "bfloat16", "seed": 0, **kwargs}
    if settings.get("family") == "llama":
        del settings["family"]
    stamp = os.path.join(out, "refit_model.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == settings:
                return out
    cmd = [sys.executable, os.path.join(HERE, "make_model.py"), out]
    for k, v in settings.items():
        cmd += [f"--{k}", str(v)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


@dataclass
class Completion:
    tokens: list[str]
    logprobs: list[float]
    text: str


class Server:
    """``vllm serve MODEL`` with ``--weight-transfer-config {"backend": "refit"}``."""

    def __init__(self, model: str, log_path: str, *, env: dict[str, str] | None = None,
                 start_timeout_s: float = 420, extra_args: list[str] | None = None) -> None:
        self.model = model
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.env = dict(os.environ)
        self.env.update({
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # the RLHF routes
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
        })
        self.env.update(env or {})
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        """The server's command line (tests/sglang's server overrides it)."""
        vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
        return [vllm, "serve", self.model, "--port", str(self.port), "--host", "127.0.0.1",
                "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8",
                "--weight-transfer-config", json.dumps({"backend": "refit"}), *self.extra_args]

    def start(self) -> Server:
        cmd = self.command()
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with status {self.proc.returncode} while starting; "
                                   f"see {self.log_path}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{cmd[0]} did not come up within {self.start_timeout_s:.0f} s; see {self.log_path}:\n"
                           f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    # -- HTTP -----------------------------------------------------------------------

    def post(self, route: str, body: dict | None = None, timeout: float = 120, **params: Any) -> requests.Response:
        return requests.post(self.url + route, json=body if body is not None else {}, params=params or None,
                             timeout=timeout)

    def weight_version(self) -> str:
        r = requests.get(self.url + "/weight_info", timeout=30)
        r.raise_for_status()
        return r.json()["weight_version"]

    def complete(self, prompt: str, max_tokens: int = 12, timeout: float = 120) -> Completion:
        r = requests.post(self.url + "/v1/completions", timeout=timeout, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
        })
        if r.status_code != 200:
            raise RuntimeError(f"completion failed: HTTP {r.status_code}: {r.text[:500]}")
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        return Completion(list(lp["tokens"]), [float(x) for x in lp["token_logprobs"]], choice["text"])


def error_text(r: requests.Response) -> str:
    """An HTTP error answer's message (vLLM's JSON error body, else the text)."""
    try:
        body = r.json()
    except ValueError:
        return r.text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)
