#include "tools/simulate/hf_model.h"

#include <cstdint>
#include <string>
#include <vector>

#include <refit/error.h>

namespace refit::sim {
namespace {

class builder {
 public:
  builder(const json& config, dtype weights) : config_(config), weights_(weights) {}

  std::int64_t get(const char* key) const {
    if (!config_.contains(key) || !config_.at(key).is_number_integer())
      throw_error(errc::invalid_argument, std::string("config.json: '") + key + "' (an integer) is missing");
    return config_.at(key).get<std::int64_t>();
  }
  std::int64_t get_or(const char* key, std::int64_t fallback) const {
    return config_.contains(key) && config_.at(key).is_number_integer() ? config_.at(key).get<std::int64_t>()
                                                                        : fallback;
  }
  bool flag(const char* key) const {
    return config_.contains(key) && config_.at(key).is_boolean() && config_.at(key).get<bool>();
  }

  // A tensor kept in bfloat16 whatever the weights' dtype (norms, embeddings, routers).
  void plain(const std::string& name, std::vector<std::int64_t> shape) {
    add({name, dtype::bfloat16, std::move(shape)});
  }
  // A 2-D projection weight: in the weights' dtype; fp8 with its block scales.
  void projection(const std::string& name, std::int64_t rows, std::int64_t cols) {
    add({name, weights_, {rows, cols}});
    if (weights_ == dtype::float8_e4m3fn)
      add({name + "_scale_inv", dtype::float32, {(rows + 127) / 128, (cols + 127) / 128}});
  }

  hf_model done(std::string architecture) {
    out_.architecture = std::move(architecture);
    out_.meta.validate();
    return std::move(out_);
  }

 private:
  void add(tensor_spec t) {
    double n = 1;
    for (std::int64_t d : t.shape) n *= static_cast<double>(d);
    out_.parameters += n;
    out_.meta.tensors.push_back(std::move(t));
  }

  const json& config_;
  dtype weights_;
  hf_model out_;
};

void mlp(builder& b, const std::string& at, std::int64_t hidden, std::int64_t intermediate) {
  b.projection(at + ".gate_proj.weight", intermediate, hidden);
  b.projection(at + ".up_proj.weight", intermediate, hidden);
  b.projection(at + ".down_proj.weight", hidden, intermediate);
}

}  // namespace

hf_model read_hf_model(const json& config, dtype weights) {
  if (!config.is_object()) throw_error(errc::invalid_argument, "config.json: not a JSON object");
  if (weights != dtype::bfloat16 && weights != dtype::float8_e4m3fn)
    throw_error(errc::invalid_argument, "weights are bfloat16 or float8_e4m3fn");
  const std::string type = config.contains("model_type") && config.at("model_type").is_string()
                               ? config.at("model_type").get<std::string>()
                               : "";
  builder b(config, weights);
  const std::int64_t hidden = b.get("hidden_size"), layers = b.get("num_hidden_layers"), vocab = b.get("vocab_size");
  const std::int64_t heads = b.get("num_attention_heads");
  b.plain("model.embed_tokens.weight", {vocab, hidden});
  if (type == "deepseek_v3" || type == "kimi_k2") {
    const std::int64_t q_lora = b.get("q_lora_rank"), kv_lora = b.get("kv_lora_rank");
    const std::int64_t nope = b.get("qk_nope_head_dim"), rope = b.get("qk_rope_head_dim"), v = b.get("v_head_dim");
    const std::int64_t experts = b.get("n_routed_experts"), shared = b.get_or("n_shared_experts", 0);
    const std::int64_t moe = b.get("moe_intermediate_size"), dense = b.get("intermediate_size");
    const std::int64_t first_moe = b.get_or("first_k_dense_replace", 0), every = b.get_or("moe_layer_freq", 1);
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::string at = "model.layers." + std::to_string(l);
      b.plain(at + ".input_layernorm.weight", {hidden});
      b.projection(at + ".self_attn.q_a_proj.weight", q_lora, hidden);
      b.plain(at + ".self_attn.q_a_layernorm.weight", {q_lora});
      b.projection(at + ".self_attn.q_b_proj.weight", heads * (nope + rope), q_lora);
      b.projection(at + ".self_attn.kv_a_proj_with_mqa.weight", kv_lora + rope, hidden);
      b.plain(at + ".self_attn.kv_a_layernorm.weight", {kv_lora});
      b.projection(at + ".self_attn.kv_b_proj.weight", heads * (nope + v), kv_lora);
      b.projection(at + ".self_attn.o_proj.weight", hidden, heads * v);
      b.plain(at + ".post_attention_layernorm.weight", {hidden});
      if (l >= first_moe && l % every == 0) {
        b.plain(at + ".mlp.gate.weight", {experts, hidden});
        b.plain(at + ".mlp.gate.e_score_correction_bias", {experts});
        for (std::int64_t e = 0; e < experts; ++e) mlp(b, at + ".mlp.experts." + std::to_string(e), hidden, moe);
        if (shared > 0) mlp(b, at + ".mlp.shared_experts", hidden, moe * shared);
      } else {
        mlp(b, at + ".mlp", hidden, dense);
      }
    }
  } else if (type == "llama" || type == "qwen2" || type == "qwen3" || type == "mistral" || type == "qwen3_moe") {
    const std::int64_t kv_heads = b.get_or("num_key_value_heads", heads);
    const std::int64_t head_dim = b.get_or("head_dim", hidden / heads);
    const bool qk_norm = type == "qwen3" || type == "qwen3_moe";
    const bool qkv_bias = type == "qwen2" || b.flag("attention_bias");
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::string at = "model.layers." + std::to_string(l);
      b.plain(at + ".input_layernorm.weight", {hidden});
      b.projection(at + ".self_attn.q_proj.weight", heads * head_dim, hidden);
      b.projection(at + ".self_attn.k_proj.weight", kv_heads * head_dim, hidden);
      b.projection(at + ".self_attn.v_proj.weight", kv_heads * head_dim, hidden);
      if (qkv_bias) {
        b.plain(at + ".self_attn.q_proj.bias", {heads * head_dim});
        b.plain(at + ".self_attn.k_proj.bias", {kv_heads * head_dim});
        b.plain(at + ".self_attn.v_proj.bias", {kv_heads * head_dim});
      }
      if (qk_norm) {
        b.plain(at + ".self_attn.q_norm.weight", {head_dim});
        b.plain(at + ".self_attn.k_norm.weight", {head_dim});
      }
      b.projection(at + ".self_attn.o_proj.weight", hidden, heads * head_dim);
      b.plain(at + ".post_attention_layernorm.weight", {hidden});
      if (type == "qwen3_moe") {
        const std::int64_t experts = b.get("num_experts"), moe = b.get("moe_intermediate_size");
        b.plain(at + ".mlp.gate.weight", {experts, hidden});
        for (std::int64_t e = 0; e < experts; ++e) mlp(b, at + ".mlp.experts." + std::to_string(e), hidden, moe);
      } else {
        mlp(b, at + ".mlp", hidden, b.get("intermediate_size"));
      }
    }
  } else {
    throw_error(errc::invalid_argument, "config.json: model_type '" + type +
                                            "' (known: llama, mistral, qwen2, qwen3, qwen3_moe, deepseek_v3, kimi_k2)");
  }
  b.plain("model.norm.weight", {hidden});
  if (!b.flag("tie_word_embeddings")) b.plain("lm_head.weight", {vocab, hidden});
  return b.done(type);
}

}  // namespace refit::sim
