"""refit inside a real SGLang server at two tensor-parallel ranks (``--tp 2`` on this
machine's two cores: ``SGLANG_CPU_OMP_THREADS_BIND="0|1"``; ``SGLANG_NCCL_SO_PATH``
names no file, so that SGLang's pynccl stays off and its ranks all-reduce over
gloo). Each rank runs refit's loader and its own ``refit.WorkerHost``;
``refit.sglang.Client`` updates both:

- an update changes greedy output and ``weight_version`` on the server, and the
  original weights restore the first answer token for token;
- twenty times in a row, an update the model's loader refuses is named before a
  byte moves, the server answering with its old weights and version, and the good
  update that follows lands.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import refit
import refit.sglang

os.environ.setdefault("UCX_NET_DEVICES", "lo")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server import SGLangServer, checkpoint, make_model  # noqa: E402
from test_sglang import negated  # noqa: E402

ROUNDS = int(os.environ.get("REFIT_SGLANG_TP_ROUNDS", "20"))


@pytest.fixture(scope="module")
def served_tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tp")
    # Four heads, two of them key/value heads (one per rank): SGLang 0.5.23's
    # loader fails its own first load of a single key/value head at two ranks.
    model = make_model(os.path.join(os.environ.get("REFIT_SGLANG_MODEL") or str(root / "model"), "tp"), hidden=256)
    log = (os.environ.get("REFIT_SGLANG_LOG") or str(root / "sglang.log")) + ".tp"
    env = {"UCX_NET_DEVICES": "lo", "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
           "SGLANG_NCCL_SO_PATH": str(root / "no-nccl.so")}
    server = SGLangServer(model, log, start_timeout_s=300, env=env, extra_args=["--tp", "2"]).start()
    try:
        yield {"server": server, "model": model, "log": log, "original": checkpoint(model),
               "first": server.generate()}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"the SGLang server (--tp 2) died during the tests; see {log}"


def test_an_update_lands_on_both_ranks_and_the_original_restores_the_output(served_tp):
    s, original = served_tp["server"], served_tp["original"]
    with refit.sglang.Client(s.url, timeout_ms=30000) as client:
        client.update(negated(original), 11)
        changed = s.generate()
        assert changed.weight_version == "11"
        assert changed.tokens != served_tp["first"].tokens, "the update did not reach the model"
        client.update(original, 12)
        back = s.generate()
    assert back.weight_version == "12"
    assert back.tokens == served_tp["first"].tokens, "the original weights do not give the original tokens"


def test_a_refused_update_then_a_good_one_lands_every_time(served_tp):
    s, original = served_tp["server"], served_tp["original"]
    bad = {"model.layers.0.mlp.bogus_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    with refit.sglang.Client(s.url, timeout_ms=30000) as client:
        client.update(original, 100)
        for i in range(1, ROUNDS + 1):
            before = s.generate()
            with pytest.raises(refit.InvalidArgumentError, match="nothing was sent") as e:
                client.update({**negated(original), **bad}, 100 + 2 * i - 1)
            assert "bogus_proj" in str(e.value)
            after = s.generate()
            assert (after.tokens, after.weight_version) == (before.tokens, before.weight_version), (
                f"round {i}: a refused update changed the server")
            client.update(negated(original) if i % 2 else original, 100 + 2 * i)
            assert s.generate().weight_version == str(100 + 2 * i), f"round {i}: the good update did not land"
        client.update(original, 1000)
    assert s.generate().tokens == served_tp["first"].tokens
