"""refit inside a real SGLang server on this machine's CPUs (sglang from PyPI,
launched with ``--custom-weight-loader refit.sglang.load_weights``): updates
through refit.sglang.Client change greedy output and the weight_version of
/generate's answers; what is refused or abandoned leaves the server answering with
its old weights and version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import refit
import refit.sglang

# UCX's tcp transport on loopback only, here and in the server (read when UCX starts).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server import SGLangServer, checkpoint, make_model  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    model = make_model(os.environ.get("REFIT_SGLANG_MODEL") or str(root / "model"))
    log = os.environ.get("REFIT_SGLANG_LOG") or str(root / "sglang.log")
    server = SGLangServer(model, log, start_timeout_s=300, env={"UCX_NET_DEVICES": "lo"}).start()
    try:
        yield {"server": server, "model": model, "log": log, "original": checkpoint(model),
               "first": server.generate()}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"the SGLang server died during the tests; see {log}"


def negated(tensors: dict) -> dict:
    """The model with its MLP weights negated: greedy output changes."""
    return {n: (-t if ".mlp." in n else t) for n, t in tensors.items()}


def update_then_restore(served, client) -> None:
    """Other weights change greedy output and weight_version; the original weights
    give the first answer's tokens back (this module's and test_sglang_tp's)."""
    s, original = served["server"], served["original"]
    client.update(negated(original), 11)
    changed = s.generate()
    assert changed.weight_version == "11"
    assert changed.tokens != served["first"].tokens, "the update did not reach the model"
    client.update(original, 12)
    back = s.generate()
    assert back.weight_version == "12"
    assert back.tokens == served["first"].tokens, "the original weights do not give the original tokens"


def test_an_update_changes_greedy_output_and_weight_version_and_the_original_restores_it(served):
    with refit.sglang.Client(served["server"].url, timeout_ms=30000) as client:
        update_then_restore(served, client)


@pytest.mark.parametrize("bad, says", [
    ({"model.layers.0.mlp.bogus_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)},
     "model.layers.0.mlp.bogus_proj.weight: the model's loader takes it into no parameter"),
    ({"model.layers.1.self_attn.k_proj.weight": torch.zeros(3, 128, dtype=torch.bfloat16)},
     "model.layers.1.self_attn.k_proj.weight: shape [3, 128] does not fit parameter"),
])
def test_a_tensor_the_models_loader_refuses_is_named_before_a_byte_moves_and_the_next_update_lands(served, bad, says):
    s, original = served["server"], served["original"]
    with refit.sglang.Client(s.url, timeout_ms=30000) as client:
        client.update(original, 20)
        before = s.generate()
        with pytest.raises(refit.InvalidArgumentError, match="nothing was sent") as e:
            client.update({**negated(original), **bad}, 21)
        assert says in str(e.value)
        after = s.generate()
        assert (after.tokens, after.weight_version) == (before.tokens, "20"), "a refused update changed the server"
        client.update(negated(original), 22)
        assert s.generate().weight_version == "22"
        client.update(original, 23)


def test_a_trainer_killed_with_generation_paused_before_the_apply_leaves_the_old_weights_and_version(served):
    s, original = served["server"], served["original"]
    with refit.sglang.Client(s.url, timeout_ms=30000) as client:
        client.update(original, 30)
    before = s.generate()
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_proc.py"), s.url, served["model"],
                             "--version", "31"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "TRANSFERRED", f"the trainer did not get its bytes across: {line!r}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # It paused generation before it died: its ranks resume it at its deadline (5 s).
    t0 = time.monotonic()
    after = s.generate()
    waited = time.monotonic() - t0
    assert (after.tokens, after.weight_version) == (before.tokens, "30"), "an abandoned update reached the model"
    # Paused (no answer at once), and resumed by the guard, not by the next trainer.
    assert 2 < waited < 30, f"the server answered {waited:.1f} s after the trainer died (its deadline: 5 s)"
    with refit.sglang.Client(s.url, timeout_ms=30000) as client:  # the next trainer
        client.update(negated(original), 32)
        assert s.generate().weight_version == "32"
        client.update(original, 33)
    assert s.generate().tokens == served["first"].tokens


def test_over_ucx(served):
    if "ucx" not in refit.backends():
        pytest.skip(f"this build of refit has no ucx engine ({refit.backends()})")
    s, original = served["server"], served["original"]
    with refit.sglang.Client(s.url, engine="ucx", timeout_ms=30000) as client:
        client.update(negated(original), 40)
        changed = s.generate()
        assert changed.weight_version == "40" and changed.tokens != served["first"].tokens
        client.update(original, 41)
    assert s.generate().tokens == served["first"].tokens
