#include <refit/adapters/vllm.h>

namespace refit {

std::vector<fused_param> vllm_stacked_params() {
  return {
      {".qkv_proj", {".q_proj", ".k_proj", ".v_proj"}, {}},
      {".gate_up_proj", {".gate_proj", ".up_proj"}, {}},
  };
}

std::vector<shard_rule> vllm_llama_shards() {
  return {
      {"\\.(qkv_proj|gate_up_proj|q_proj|k_proj|v_proj|gate_proj|up_proj)\\.", parallel_style::column},
      {"\\.(o_proj|down_proj)\\.", parallel_style::row},
  };
}

std::vector<shard_rule> vllm_vocab_shards() { return {{"(^|\\.)(embed_tokens|lm_head)\\.", parallel_style::vocab}}; }

tp_layout_options vllm_llama_layout() {
  tp_layout_options o;
  o.fused = vllm_stacked_params();
  o.shards = vllm_llama_shards();
  for (auto& r : vllm_vocab_shards()) o.shards.push_back(std::move(r));
  return o;
}

namespace {

// {"preset": "vllm_llama"} in a layout (read_dest_layouts, lib/layout/layout.h), wherever this
// library is linked (it is linked whole: refit_cc_library).
const bool registered = (register_tp_preset("vllm_llama", vllm_llama_layout), true);

}  // namespace

}  // namespace refit
