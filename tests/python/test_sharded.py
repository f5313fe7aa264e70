"""tcp_sharded and ucx_sharded from Python: two trainer ranks holding FSDP Shard(0) shards of a small
Llama-like model send two vLLM tensor-parallel workers only what each keeps, straight
into the workers' own torch tensors. Every worker tensor is checked against a slicing
of the whole model written here in torch, independent of refit's planner (fused
qkv / gate_up, column- and row-parallel, vocab-parallel rows padded to 64, replicated
norms)."""

import pytest

import refit
from conftest import Background

torch = pytest.importorskip("torch")

HIDDEN, Q, KV, INTER, VOCAB, LAYERS = 64, 64, 32, 96, 1000, 2
RANKS, TP = 2, 2
# The sharded engines of the default wheel (ucx_sharded over what UCX picks here:
# shared memory between these threads' endpoints).
SHARDED = ["tcp_sharded", "ucx_sharded"]
LAYOUT = {"source": {"mesh": [RANKS], "placements": ["shard(0)"]},
          "destination": {"preset": "vllm_llama", "tp_size": TP}}


def whole_model(step):
    g = torch.Generator().manual_seed(1234 + step)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    m = {"model.embed_tokens.weight": t(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        m[p + "self_attn.q_proj.weight"] = t(Q, HIDDEN)
        m[p + "self_attn.k_proj.weight"] = t(KV, HIDDEN)
        m[p + "self_attn.v_proj.weight"] = t(KV, HIDDEN)
        m[p + "self_attn.o_proj.weight"] = t(HIDDEN, Q)
        m[p + "mlp.gate_proj.weight"] = t(INTER, HIDDEN)
        m[p + "mlp.up_proj.weight"] = t(INTER, HIDDEN)
        m[p + "mlp.down_proj.weight"] = t(HIDDEN, INTER)
        m[p + "input_layernorm.weight"] = t(HIDDEN)
        m[p + "post_attention_layernorm.weight"] = t(HIDDEN)
    m["model.norm.weight"] = t(HIDDEN)
    m["lm_head.weight"] = t(VOCAB, HIDDEN)
    return m


def rank_shards(model, rank):
    """What FSDP's Shard(0) leaves on one rank: torch.chunk along dim 0."""
    return {n: torch.chunk(t, RANKS, dim=0)[rank].contiguous() for n, t in model.items()}


def vllm_slice(model, tp_rank):
    """A vLLM tp worker's tensors, written out by hand."""
    def rows(t):
        return torch.chunk(t, TP, dim=0)[tp_rank]

    def cols(t):
        return torch.chunk(t, TP, dim=1)[tp_rank]

    def vocab(t):
        padded = (t.shape[0] + 63) // 64 * 64
        full = torch.zeros(padded, t.shape[1], dtype=t.dtype)
        full[: t.shape[0]] = t
        return torch.chunk(full, TP, dim=0)[tp_rank]

    out = {"model.embed_tokens.weight": vocab(model["model.embed_tokens.weight"])}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [rows(model[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = cols(model[p + "self_attn.o_proj.weight"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [rows(model[p + "mlp.gate_proj.weight"]), rows(model[p + "mlp.up_proj.weight"])])
        out[p + "mlp.down_proj.weight"] = cols(model[p + "mlp.down_proj.weight"])
        out[p + "input_layernorm.weight"] = model[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = model[p + "post_attention_layernorm.weight"]
    out["model.norm.weight"] = model["model.norm.weight"]
    out["lm_head.weight"] = vocab(model["lm_head.weight"])
    return {n: t.contiguous() for n, t in out.items()}


def start(backend, timeout_ms=20000, workers_layout=LAYOUT):
    trainers = [{"address": "127.0.0.1", "port": 0}] * RANKS
    senders = [refit.Sender(backend, timeout_ms=timeout_ms) for _ in range(RANKS)]
    infos = [s.prepare({"rank": r, "trainers": trainers, "workers": TP, "layout": LAYOUT, "checksums": True})
             for r, s in enumerate(senders)]
    init_info = refit.sharded_init_info(infos)
    model = whole_model(0)
    # Each worker's own tensors (zeros), received into in place.
    held = [{n: torch.zeros_like(t) for n, t in vllm_slice(model, w).items()} for w in range(TP)]
    engines = [refit.Engine(backend, timeout_ms=timeout_ms, tp_rank=w, tp_size=TP, tensors=held[w])
               for w in range(TP)]
    accepting = [Background(s.connect_workers) for s in senders]
    joining = [Background(e.init, init_info) for e in engines]
    for b in accepting + joining:
        b.join()
    return senders, engines, held


def update(senders, engines, step, update_layout=LAYOUT):
    model = whole_model(step)
    metadata = refit.describe(model)  # the GLOBAL tensors, as every side plans from them
    info = dict(metadata, layout=update_layout)
    sending = [Background(s.send_weights, rank_shards(model, r), metadata) for r, s in enumerate(senders)]
    receiving = [Background(e.receive, info) for e in engines]
    errors = []
    for b in sending + receiving:
        try:
            b.join()
        except refit.Error as e:
            errors.append(e)
    return model, errors


@pytest.mark.parametrize("backend", SHARDED)
def test_two_ranks_send_two_tp_workers_only_their_slices(backend):
    senders, engines, held = start(backend)
    try:
        for step in (1, 2):
            model, errors = update(senders, engines, step)
            assert not errors, errors
            total = sum(t.numel() * t.element_size() for t in model.values())
            for w, e in enumerate(engines):
                expected = vllm_slice(model, w)
                assert set(held[w]) == set(expected)
                for name, t in expected.items():
                    assert torch.equal(held[w][name], t), f"worker {w} step {step}: {name}"
                stats = e.last_update_stats
                assert stats["bytes"] < 0.55 * total, (stats["bytes"], total)
            sent = [s.last_send_stats["bytes"] for s in senders]
            assert all(b > 0 for b in sent), sent
        if backend == "ucx_sharded":
            # What UCX chose for each rank's endpoint to the worker.
            transport = engines[0].state()["transport"]
            assert transport["mode"] == "tag" and len(transport["trainer_ranks"]) == RANKS, transport
    finally:
        for x in engines + senders:
            x.shutdown()


@pytest.mark.parametrize("backend", SHARDED)
def test_a_worker_with_another_layout_is_refused_before_a_byte_moves(backend):
    senders, engines, held = start(backend, timeout_ms=5000)
    try:
        before = [{n: t.clone() for n, t in h.items()} for h in held]
        # The same worker tensors, planned from another source: the worker believes
        # every rank holds everything.
        wrong = {"source": {"mesh": [RANKS], "placements": ["replicate"]}, "destination": LAYOUT["destination"]}
        _, errors = update(senders, engines, 1, update_layout=wrong)
        assert errors, "a layout the trainer ranks did not plan was accepted"
        assert any("transfer plans differ" in str(e) for e in errors), errors
        assert all(isinstance(e, refit.Error) for e in errors), errors
        for w in range(TP):
            for name, t in before[w].items():
                assert torch.equal(held[w][name], t), f"worker {w}: {name} changed by a refused update"
    finally:
        for x in engines + senders:
            x.shutdown()


def test_sharded_init_info_needs_one_consistent_info_per_rank():
    a = {"trainers": [{"address": "h", "port": 5}, {"address": "h", "port": 0}], "workers": 2, "rank_offset": 1}
    b = {"trainers": [{"address": "h", "port": 0}, {"address": "h", "port": 6}], "workers": 2, "rank_offset": 1}
    assert [t["port"] for t in refit.sharded_init_info([a, b])["trainers"]] == [5, 6]
    with pytest.raises(refit.InvalidArgumentError, match="2 trainer ranks"):
        refit.sharded_init_info([a])
    with pytest.raises(refit.InvalidArgumentError, match="rank 1 was prepared"):
        refit.sharded_init_info([a, dict(b, workers=3)])
