"""Writes a tiny checkpoint that `vllm serve` loads offline.

    python make_model.py OUT_DIR [--family llama] [--hidden 128] [--layers 2] [--dtype bfloat16] [--seed 0]

Random weights (``transformers``' model of the family), saved as safetensors, with
a byte-level BPE tokenizer trained by ``tokenizers`` on a few sentences (no
download). vLLM's CPU attention needs head_dim in {32, 64, 80, ...}: heads are
chosen so that head_dim is 64. Deterministic for a given seed. The families
(FAMILIES) differ where their checkpoints differ: tied embeddings, attention
biases, q/k norms, experts, projections fused in the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A trainer pushes new weights to the inference server every few seconds.",
    "refit moves model weights from an RL trainer to inference workers.",
    "Once upon a time there was a small language model that learned to count: one two three four five.",
    "Weights arrive in buckets; each bucket is checked before the model sees it.",
]


# family: (transformers config class, what it sets beyond the shared shape, what
# differs in its checkpoint and trainer's state_dict(); docs/vllm.md's table says it)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "separate q/k/v and gate/up projections (vLLM stacks them), untied lm_head"),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True},
                   "tied embeddings: state_dict() has lm_head.weight, the checkpoint and named_parameters() not"),
    "qwen2": ("Qwen2Config", {}, "q/k/v biases, stacked with their weights"),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}, "q/k norms; tied embeddings"),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "decoder_sparse_step": 1, "norm_topk_prob": True},
                  "experts: per-expert tensors in the checkpoint, fused 3-D gate_up_proj/down_proj in "
                  "transformers' state_dict(); a router per layer"),
    "phi3": ("Phi3Config", {"pad_token_id": None}, "qkv_proj and gate_up_proj already fused in the checkpoint"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=0, help="default: 2 x hidden")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(args.out)

    head_dim = 64
    heads = max(1, args.hidden // head_dim)
    config_class, extra, _ = FAMILIES[args.family]
    config = getattr(transformers, config_class)(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype=args.dtype,
        **{"tie_word_embeddings": False, **extra},
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    # Larger weights than the default init: a random model's greedy output then
    # depends visibly on every layer, so a changed weight changes the completion.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(args.out, safe_serialization=True)
    with open(os.path.join(args.out, "refit_model.json"), "w") as f:
        settings = {"hidden": args.hidden, "layers": args.layers, "dtype": args.dtype, "seed": args.seed}
        if args.family != "llama":  # (the stamp of a llama made before families existed)
            settings["family"] = args.family
        json.dump(settings, f)
    print(args.out)


if __name__ == "__main__":
    main()
