// A model's tensors (names, shapes, dtypes) from its Hugging Face config.json, as
// its checkpoint names them: dense Llama-style models (llama, qwen2, qwen3,
// mistral), Qwen3-MoE, and DeepSeek-V3-style MoE (deepseek_v3, kimi_k2: MLA
// attention, routed and shared experts). The simulation needs sizes, not weights;
// tools/simulate/models/ ships the configs of docs/scale.md's cases.
#pragma once

#include <string>

#include <refit/dtype.h>
#include <refit/json.h>
#include <refit/metadata.h>

namespace refit::sim {

struct hf_model {
  std::string architecture;  ///< config's model_type
  update_metadata meta;
  double parameters = 0;  ///< elements in all tensors
};

/// The tensors of `config` (a parsed config.json) in checkpoint order, each of
/// `weights` (bfloat16, or float8_e4m3fn: then the 2-D projection weights are
/// fp8 with a float32 scale per 128x128 block, as DeepSeek-V3's checkpoint keeps
/// them; norms, embeddings, routers and lm_head stay bfloat16). invalid_argument
/// naming the member on a model type it does not know or a missing member.
hf_model read_hf_model(const json& config, refit::dtype weights = dtype::bfloat16);

}  // namespace refit::sim
