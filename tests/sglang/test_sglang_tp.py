"""refit inside a real SGLang server at two tensor-parallel ranks (``--tp 2`` on this
machine's two cores: ``SGLANG_CPU_OMP_THREADS_BIND="0|1"``; ``SGLANG_NCCL_SO_PATH``
names no file, so that SGLang's pynccl stays off and its ranks all-reduce over
gloo). Each rank runs refit's loader and its own ``refit.WorkerHost``;
``refit.sglang.Client`` updates both:

- an update changes greedy output and ``weight_version`` on the server, and the
  original weights restore the first answer token for token;
- twenty times in a row, an update the model's loader refuses is named before a
  byte moves, the server answering with its old weights and version, and the good
  update that follows lands;
- an apply whose load fails half-way on one rank (rank 0, then rank 1:
  ``fault_loader.py``) leaves both ranks at the old weights and version, and the
  next update lands.
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
from test_sglang import negated, update_then_restore  # noqa: E402

ROUNDS = int(os.environ.get("REFIT_SGLANG_TP_ROUNDS", "20"))
LOAD_FORMAT = "fault_loader.load_weights"


def client(s) -> refit.sglang.Client:
    return refit.sglang.Client(s.url, timeout_ms=30000, load_format=LOAD_FORMAT)


@pytest.fixture(scope="module")
def served_tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tp")
    # Four heads, two of them key/value heads (one per rank): SGLang 0.5.23's
    # loader fails its own first load of a single key/value head at two ranks.
    model = make_model(os.path.join(os.environ.get("REFIT_SGLANG_MODEL") or str(root / "model"), "tp"), hidden=256)
    log = (os.environ.get("REFIT_SGLANG_LOG") or str(root / "sglang.log")) + ".tp"
    faults = root / "faults"
    faults.mkdir()
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    env = {"UCX_NET_DEVICES": "lo", "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
           "SGLANG_NCCL_SO_PATH": str(root / "no-nccl.so"), "REFIT_SGLANG_FAULT_DIR": str(faults), "PYTHONPATH": path}
    # refit's loader and fault_loader's (refit's, with a switch that fails one rank's apply).
    loaders = ["--custom-weight-loader", "refit.sglang.load_weights", LOAD_FORMAT]
    server = SGLangServer(model, log, start_timeout_s=300, env=env, extra_args=["--tp", "2", *loaders]).start()
    try:
        yield {"server": server, "model": model, "log": log, "original": checkpoint(model),
               "first": server.generate(), "faults": faults}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"the SGLang server (--tp 2) died during the tests; see {log}"


def test_an_update_lands_on_both_ranks_and_the_original_restores_the_output(served_tp):
    with client(served_tp["server"]) as c:
        update_then_restore(served_tp, c)


def test_a_refused_update_then_a_good_one_lands_every_time(served_tp):
    s, original = served_tp["server"], served_tp["original"]
    bad = {"model.layers.0.mlp.bogus_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    with client(s) as c:
        c.update(original, 100)
        for i in range(1, ROUNDS + 1):
            before = s.generate()
            with pytest.raises(refit.InvalidArgumentError, match="nothing was sent") as e:
                c.update({**negated(original), **bad}, 100 + 2 * i - 1)
            assert "bogus_proj" in str(e.value)
            after = s.generate()
            assert (after.tokens, after.weight_version) == (before.tokens, before.weight_version), (
                f"round {i}: a refused update changed the server")
            c.update(negated(original) if i % 2 else original, 100 + 2 * i)
            assert s.generate().weight_version == str(100 + 2 * i), f"round {i}: the good update did not land"
        c.update(original, 1000)
    assert s.generate().tokens == served_tp["first"].tokens


def test_an_apply_that_fails_on_one_rank_leaves_both_at_the_old_weights(served_tp):
    """One rank's load raises half-way through the apply: the client rolls every
    rank back, the server answers with the old tokens at the old version, and the
    next update lands on both."""
    s, original = served_tp["server"], served_tp["original"]
    with client(s) as c:
        c.update(original, 200)
        before = s.generate()
        for rank in (0, 1):
            (served_tp["faults"] / f"fail-next-apply-rank{rank}").touch()
            with pytest.raises(refit.Error, match="half-way on purpose") as e:
                c.update(negated(original), 201 + rank)
            assert f"tp rank {rank}" in str(e.value), e.value
            assert not (served_tp["faults"] / f"fail-next-apply-rank{rank}").exists(), "the switch was not used"
            after = s.generate()
            assert (after.tokens, after.weight_version) == (before.tokens, "200"), (
                f"rank {rank}'s failed apply changed what the server answers")
        c.update(negated(original), 210)
        changed = s.generate()
        assert changed.weight_version == "210" and changed.tokens != before.tokens
        c.update(original, 211)
    assert s.generate().tokens == served_tp["first"].tokens
