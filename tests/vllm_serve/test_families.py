"""refit's vLLM backend across model families, each served by a real ``vllm serve``.

Each family (make_model.FAMILIES: Llama untied and tied, Qwen2, Qwen3, Qwen3-MoE,
Phi-3) is a tiny model made offline with random weights. The trainer is the
family's ``transformers`` model, as an RL trainer holds it; it updates the server
through vLLM's own trainer path (``WeightTransferTrainerFactory`` with refit's
init info) from its ``state_dict()`` (tied weights under both names, experts as
transformers keeps them) and from its ``named_parameters()`` (tied weights once).

For every family: other weights change the greedy completion; the original
weights pushed back give the reference completion token for token and logprob
for logprob; an unknown name is refused naming it, the server serving on; and a
refused update followed by a good one, twenty times in a row, never breaks the
link. The reference is what vLLM's own ``reload_weights`` from the checkpoint
serves (the dev-mode ``/collective_rpc`` route): the served output of the first
load for every family but one whose reload vLLM-CPU itself does not reproduce
(recorded as ``vllm_reload_reproduces_first_load``).

Run by tests/vllm_serve/run.sh after test_serve.py. REFIT_VLLM_FAMILIES picks
families ("llama,qwen2"); REFIT_VLLM_FAMILIES_JSON, when set, receives what each
family measured (docs/vllm.md's table is made from the committed copy,
docs/bench/vllm_families.json).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import requests
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_model import FAMILIES  # noqa: E402
from serve import Server, make_model  # noqa: E402
from test_serve import DEADLINE_MS, vllm_trainer  # noqa: E402 - vLLM's trainer path, as test_serve drives it
from weights import DictSource  # noqa: E402

PROMPT = "The quick brown fox"
REFUSED_THEN_GOOD = int(os.environ.get("REFIT_VLLM_FAMILY_ROUNDS", "20"))
SELECTED = [f for f in (os.environ.get("REFIT_VLLM_FAMILIES") or ",".join(FAMILIES)).split(",") if f]
RESULTS: dict[str, dict] = {}


def _models_root() -> str:
    return os.environ.get("REFIT_VLLM_FAMILY_MODELS") or os.path.expanduser("~/.cache/refit/vllm_serve-models")


class _Starts:
    """Servers started ahead, two at a time: a server spends most of its minute
    of start-up importing vLLM on one core, so the next family's starts while this
    one's are tested (and the first two together)."""

    AHEAD = 2

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=self.AHEAD, thread_name_prefix="vllm-serve-start")
        self.started: dict[str, Future] = {}
        self.root = tempfile.mkdtemp(prefix="refit-families-")

    def start(self, family: str) -> tuple[Server, str, str]:
        assert family in FAMILIES, f"unknown family {family!r} (make_model.FAMILIES: {sorted(FAMILIES)})"
        model = make_model(os.path.join(_models_root(), family), family=family)
        secret = os.path.join(self.root, f"{family}.secret")
        with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(32))
        # Next to test_serve.py's log (run.sh prints their tails when a test fails).
        log = (os.environ.get("REFIT_VLLM_SERVE_LOG") or os.path.join(self.root, "vllm_serve.log")) + f".{family}"
        env = {"REFIT_AUTH_SECRET_FILE": secret, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
        return Server(model, log, env=env).start(), model, secret

    def take(self, family: str) -> tuple[Server, str, str]:
        at = SELECTED.index(family)
        for ahead in SELECTED[at:at + self.AHEAD]:
            if ahead not in self.started:
                self.started[ahead] = self.pool.submit(self.start, ahead)
        return self.started.pop(family).result()

    def close(self) -> None:
        """Stops what was started and not taken (a run cut short)."""
        for future in self.started.values():
            try:
                future.result()[0].stop()
            except Exception:  # noqa: BLE001 - it failed to start: nothing to stop
                pass
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def starts():
    s = _Starts()
    yield s
    s.close()


@pytest.fixture(scope="module", params=SELECTED)
def fam(request, starts):
    family = request.param
    server, model, secret = starts.take(family)
    log = server.log_path
    try:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
        first = server.complete(PROMPT)
        r = requests.post(server.url + "/collective_rpc", json={"method": "reload_weights"}, timeout=300)
        assert r.status_code == 200, f"vLLM's own reload_weights failed: {r.text[:500]}"
        reference = server.complete(PROMPT)
        with open(os.path.join(model, "config.json")) as f:
            architecture = json.load(f)["architectures"][0]
        RESULTS[family] = {
            "family": family,
            "architecture": architecture,
            "checkpoint": FAMILIES[family][2],
            "vllm_reload_reproduces_first_load": (first.tokens, first.logprobs) ==
                                                 (reference.tokens, reference.logprobs),
        }
        yield {"family": family, "server": server, "model": model, "hf": hf, "secret": secret,
               "reference": reference, "log": log}
    finally:
        alive = server.alive()
        server.stop()
        assert alive, f"vllm serve died during the {family} tests; see {log}"


def perturbed(tensors: dict[str, torch.Tensor], seed: int | None) -> dict[str, torch.Tensor]:
    """Every floating tensor plus noise (a copy without noise when ``seed`` is
    None); tensors that share storage (tied weights) stay one tensor, as in the
    trainer's model."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    by_storage: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in tensors.items():
        key = t.untyped_storage().data_ptr()
        if key not in by_storage:
            new = t.detach().clone()
            if t.is_floating_point() and g is not None:
                new = (t.detach().float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
            by_storage[key] = new.contiguous()
        out[name] = by_storage[key]
    return out


def state_dict_of(hf) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in hf.state_dict().items()}


def named_parameters_of(hf) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in hf.named_parameters()}


def same(a, b) -> bool:
    return (a.tokens, a.logprobs) == (b.tokens, b.logprobs)


def push(trainer, tensors, version) -> float:
    trainer.source = DictSource.make(tensors)
    started = time.monotonic()
    trainer.send_weights(version)
    return time.monotonic() - started


@pytest.mark.parametrize("layout", ["state_dict", "named_parameters"])
def test_other_weights_change_output_and_original_restores_it(fam, layout):
    server, reference = fam["server"], fam["reference"]
    original = state_dict_of(fam["hf"]) if layout == "state_dict" else named_parameters_of(fam["hf"])
    other = perturbed(original, seed=11)
    trainer = vllm_trainer(fam, other)
    try:
        push(trainer, other, f"{layout}-other")
        assert server.weight_version() == f"{layout}-other"
        assert not same(server.complete(PROMPT), reference), "other weights did not change the completion"
        push(trainer, original, f"{layout}-original")
        assert server.weight_version() == f"{layout}-original"
        restored = server.complete(PROMPT)
        assert restored.tokens == reference.tokens, "the original weights did not restore the completion"
        assert restored.logprobs == reference.logprobs, "the original weights did not restore the logprobs"
        RESULTS[fam["family"]][f"{layout}_tensors"] = len(original)
    finally:
        trainer.shutdown()


def reload_from(server, path: str) -> None:
    """vLLM's own reload of the checkpoint at ``path`` (every worker)."""
    r = requests.post(server.url + "/collective_rpc", timeout=300,
                      json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    assert r.status_code == 200, f"vLLM's own reload_weights({path}) failed: {r.text[:500]}"


def test_both_layouts_serve_what_vllms_own_load_serves(fam, tmp_path):
    """The same weights sent from ``state_dict()`` (tied weights under both names)
    and from ``named_parameters()`` (once) serve exactly what vLLM's own load of
    them serves: token for token, logprob for logprob.

    vLLM's own load is a fresh ``vllm serve`` of them for a model with tied
    embeddings: vLLM-CPU's ``reload_weights`` of such a checkpoint itself leaves
    ``lm_head``'s packed GEMM weight at the old values (it names the tied weight
    once, and vLLM processes each layer apart). For the others, the cheaper
    ``reload_weights`` from the checkpoint."""
    server, hf, model = fam["server"], fam["hf"], fam["model"]
    original = perturbed(state_dict_of(hf), seed=None)  # a copy, tied weights still one tensor
    other = perturbed(original, seed=23)
    checkpoint = str(tmp_path / "checkpoint")
    shutil.copytree(model, checkpoint)  # the tokenizer and config, then the weights
    hf.load_state_dict(other)
    try:
        hf.save_pretrained(checkpoint)
    finally:
        hf.load_state_dict(original)
    if hf.config.get_text_config().tie_word_embeddings:
        with Server(checkpoint, fam["log"] + ".checkpoint", env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"}) as fresh:
            expected = fresh.complete(PROMPT)
    else:
        reload_from(server, checkpoint)
        expected = server.complete(PROMPT)
    named = {n: other[n] for n, _ in hf.named_parameters()}
    trainer = vllm_trainer(fam, other)
    try:
        for layout, tensors in (("state_dict", other), ("named_parameters", named)):
            # From the original (under both names of a tied weight: vLLM's own
            # reload_weights names it once, see above).
            push(trainer, original, f"layouts-original-{layout}")
            push(trainer, tensors, f"layouts-{layout}")
            got = server.complete(PROMPT)
            assert got.tokens == expected.tokens, (
                f"{layout} ({len(tensors)} tensors) serves other tokens than vLLM's own load of the same weights: "
                f"{got.text!r} != {expected.text!r}")
            assert got.logprobs == expected.logprobs, f"{layout}: other logprobs than vLLM's own load"
        push(trainer, original, "layouts-original")
    finally:
        trainer.shutdown()


def test_unknown_name_is_refused_then_a_good_update_lands_every_time(fam):
    """One unknown name: refused naming it, before a byte moves, the server serving
    its last version; then the good update lands, REFUSED_THEN_GOOD times."""
    server, reference = fam["server"], fam["reference"]
    original = state_dict_of(fam["hf"])
    first = next(iter(original))
    unknown = "model.layers.0.self_attn.not_a_weight.weight"
    bad = {**original, unknown: original[first]}
    trainer = vllm_trainer(fam, original)
    per_round: list[dict[str, float]] = []
    try:
        push(trainer, original, "families-0")
        for i in range(1, REFUSED_THEN_GOOD + 1):
            before = server.weight_version()
            started = time.monotonic()
            with pytest.raises(Exception) as refused:
                push(trainer, bad, f"families-bad-{i}")
            assert unknown in str(refused.value), f"round {i}: the refusal does not name {unknown}: {refused.value}"
            assert time.monotonic() - started < DEADLINE_MS / 1000, f"round {i}: the refusal waited for a deadline"
            assert server.weight_version() == before, f"round {i}: /weight_info moved on a refused update"
            took = push(trainer, original, f"families-{i}")
            assert server.weight_version() == f"families-{i}", f"round {i}: the good update did not land"
            assert trainer.sender is not None
            # The same update's send by refit's sender (its wall_s): refit's part.
            per_round.append({"through_server_s": took, "refit_send_s": trainer.sender.last_send_stats["wall_s"]})
        served = server.complete(PROMPT)
        assert served.tokens == reference.tokens and served.logprobs == reference.logprobs
        RESULTS[fam["family"]].update({
            "refused_then_good_rounds": REFUSED_THEN_GOOD,
            "update_bytes": int(sum(t.numel() * t.element_size() for t in original.values())),
            "per_round": per_round,
            "through_server_median_s": statistics.median(r["through_server_s"] for r in per_round),
        })
    finally:
        trainer.shutdown()


def test_write_results(fam):
    """(Last for each family.) What was measured, for docs/vllm.md's table."""
    out = os.environ.get("REFIT_VLLM_FAMILIES_JSON")
    if not out:
        pytest.skip("REFIT_VLLM_FAMILIES_JSON not set")
    row = RESULTS[fam["family"]]
    missing = [k for k in ("state_dict_tensors", "named_parameters_tensors", "per_round") if k not in row]
    assert not missing, f"{fam['family']}: an earlier test failed (no {missing}); nothing recorded"
    data = {}
    if os.path.exists(out):
        with open(out) as f:
            data = json.load(f)
    rows = {r["family"]: r for r in data.get("families", [])}
    rows[fam["family"]] = row
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    import vllm

    data = {
        "command": "REFIT_VLLM_FAMILIES_JSON=docs/bench/vllm_families.json bash tests/vllm_serve/run.sh",
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "rounds": REFUSED_THEN_GOOD,
        "families": [rows[k] for k in sorted(rows, key=lambda k: list(FAMILIES).index(k) if k in FAMILIES else 99)],
    }
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
