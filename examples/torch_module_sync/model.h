// A small Llama-like decoder in libtorch's C++ frontend, in two layouts with the
// same arithmetic:
//   - the trainer's: Hugging Face names, unfused and whole
//     ("model.layers.0.self_attn.q_proj.weight", "mlp.gate_proj", ...);
//   - a vLLM worker's: fused "self_attn.qkv_proj" and "mlp.gate_up_proj", and under
//     tensor parallelism only this rank's shard of the column-parallel layers
//     (qkv_proj: its query heads and KV heads; gate_up_proj: its slices of gate and
//     up) and of the row-parallel ones (o_proj, down_proj: its input columns).
//     Embeddings, norms and lm_head are replicated.
// Attention is causal with grouped KV heads (GQA) and no positional encoding:
// enough to make every weight count, not a language model.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

namespace refit::example {

struct model_config {
  std::int64_t vocab = 128;
  std::int64_t hidden = 64;
  std::int64_t layers = 2;
  std::int64_t heads = 4;     ///< query heads
  std::int64_t kv_heads = 2;  ///< key/value heads (GQA: heads / kv_heads queries share one)
  std::int64_t intermediate = 128;
  double eps = 1e-5;
  bool qkv_bias = true;  ///< q/k/v_proj carry a bias (Qwen2-style), sharded with them
  std::int64_t head_dim() const { return hidden / heads; }
};

/// How the model is laid out: the trainer's (unfused, tp 1) or a worker rank's.
struct model_layout {
  bool fused = false;
  int tp_rank = 0;
  int tp_size = 1;
};

class rms_norm final : public torch::nn::Module {
 public:
  rms_norm(std::int64_t size, double eps);
  at::Tensor forward(const at::Tensor& x) const;
  at::Tensor weight;

 private:
  double eps_;
};

class attention final : public torch::nn::Module {
 public:
  attention(const model_config& c, const model_layout& l);
  /// This rank's o_proj output for normalised input `x` [batch, seq, hidden]:
  /// its share of the sum over ranks (the whole output at tp 1).
  at::Tensor partial(const at::Tensor& x);

 private:
  std::int64_t heads_, kv_heads_, head_dim_;  // this rank's
  torch::nn::Linear qkv_proj{nullptr}, q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};

class mlp final : public torch::nn::Module {
 public:
  mlp(const model_config& c, const model_layout& l);
  /// This rank's down_proj output (SwiGLU), as attention::partial.
  at::Tensor partial(const at::Tensor& x);

 private:
  std::int64_t intermediate_;  // this rank's
  torch::nn::Linear gate_up_proj{nullptr}, gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};

class decoder_layer final : public torch::nn::Module {
 public:
  decoder_layer(const model_config& c, const model_layout& l);
  std::shared_ptr<rms_norm> input_layernorm, post_attention_layernorm;
  std::shared_ptr<attention> self_attn;
  std::shared_ptr<mlp> mlp_;
};

/// The whole model: "model.embed_tokens", "model.layers.N.*", "model.norm", "lm_head".
/// Parameters start random from torch's current seed (norm weights around 1).
class llama_model final : public torch::nn::Module {
 public:
  llama_model(const model_config& c, const model_layout& l);

  const model_config& config() const { return config_; }
  const model_layout& layout() const { return layout_; }

  /// tokens [batch, seq] (int64) -> hidden states [batch, seq, hidden].
  at::Tensor embed(const at::Tensor& tokens);
  /// This rank's partial output of layer `layer`'s attention or MLP block for the
  /// residual stream `h`: the block's own norm, then its row-parallel output before
  /// the all-reduce. The next residual stream is h + sum over ranks.
  at::Tensor attention_partial(std::int64_t layer, const at::Tensor& h);
  at::Tensor mlp_partial(std::int64_t layer, const at::Tensor& h);
  /// Final norm and lm_head: [batch, seq, hidden] -> logits [batch, seq, vocab].
  at::Tensor logits(const at::Tensor& h);

  /// The whole forward pass (tp 1 only): the residual stream after the embedding
  /// and after each block (1 + 2 * layers tensors), then the logits.
  std::vector<at::Tensor> trace(const at::Tensor& tokens);

 private:
  model_config config_;
  model_layout layout_;
  std::shared_ptr<torch::nn::Module> body_;  // "model"
  torch::nn::Embedding embed_tokens_{nullptr};
  std::vector<std::shared_ptr<decoder_layer>> layers_;
  std::shared_ptr<rms_norm> norm_;
  torch::nn::Linear lm_head_{nullptr};
};

}  // namespace refit::example
