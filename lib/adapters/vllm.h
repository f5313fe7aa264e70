// vLLM's names and tensor-parallel rules for Llama-style models (Llama, Qwen2/3,
// Mistral), in the terms of the core's layout model (lib/layout/layout.h): what a
// trainer or worker that talks to vLLM loads with, kept out of the core, which
// knows no framework. Linking this library also registers the "vllm_llama"
// destination preset that read_dest_layouts accepts ({"preset": "vllm_llama",
// "tp_size": N}).
#pragma once

#include <vector>

#include <refit/layout/layout.h>

namespace refit {

/// vLLM's stacked_params_mapping for Llama-style models: (".qkv_proj",
/// ".q_proj"/".k_proj"/".v_proj") and (".gate_up_proj", ".gate_proj"/".up_proj").
std::vector<fused_param> vllm_stacked_params();

/// vLLM's tensor-parallel layout of a Llama-style decoder layer: qkv_proj and
/// gate_up_proj (and unfused q/k/v/gate/up_proj) column-parallel, o_proj and
/// down_proj row-parallel. Embeddings and lm_head are not covered (replicated);
/// vllm_vocab_shards() adds them.
std::vector<shard_rule> vllm_llama_shards();
/// embed_tokens and lm_head vocab-parallel (VocabParallelEmbedding, ParallelLMHead).
std::vector<shard_rule> vllm_vocab_shards();

/// The vLLM Llama/Qwen preset ("vllm_llama"): vllm_stacked_params,
/// vllm_llama_shards and vllm_vocab_shards.
tp_layout_options vllm_llama_layout();

}  // namespace refit
