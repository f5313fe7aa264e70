#include "examples/torch_module_sync/model.h"

#include <cmath>
#include <limits>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <refit/error.h>

namespace refit::example {
namespace {

// This rank's share of `n` (heads, rows); the layouts require it to divide.
std::int64_t share(std::int64_t n, const model_layout& l, const char* what) {
  if (l.tp_size < 1 || l.tp_rank < 0 || l.tp_rank >= l.tp_size || n % l.tp_size != 0)
    throw_error(errc::invalid_argument, std::string(what) + " (" + std::to_string(n) + ") cannot be split over tp " +
                                            std::to_string(l.tp_size) + " (rank " + std::to_string(l.tp_rank) + ")");
  return n / l.tp_size;
}

torch::nn::Linear linear(std::int64_t in, std::int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

}  // namespace

rms_norm::rms_norm(std::int64_t size, double eps) : eps_(eps) {
  weight = register_parameter("weight", 1 + 0.1 * at::randn({size}));
}

at::Tensor rms_norm::forward(const at::Tensor& x) const {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

attention::attention(const model_config& c, const model_layout& l)
    : heads_(share(c.heads, l, "heads")), kv_heads_(share(c.kv_heads, l, "kv_heads")), head_dim_(c.head_dim()) {
  const std::int64_t q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
  if (l.fused) {
    qkv_proj = register_module("qkv_proj", linear(c.hidden, q + 2 * kv, c.qkv_bias));
  } else {
    q_proj = register_module("q_proj", linear(c.hidden, q, c.qkv_bias));
    k_proj = register_module("k_proj", linear(c.hidden, kv, c.qkv_bias));
    v_proj = register_module("v_proj", linear(c.hidden, kv, c.qkv_bias));
  }
  o_proj = register_module("o_proj", linear(q, c.hidden, false));
}

at::Tensor attention::partial(const at::Tensor& x) {
  const std::int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  at::Tensor q, k, v;
  if (qkv_proj) {
    auto parts = qkv_proj(x).split_with_sizes({q_size, kv_size, kv_size}, -1);
    q = parts[0], k = parts[1], v = parts[2];
  } else {
    q = q_proj(x), k = k_proj(x), v = v_proj(x);
  }
  const auto batch = x.size(0), seq = x.size(1);
  // [batch, heads, seq, head_dim]; each KV head serves heads_ / kv_heads_ query heads
  // (a rank holds whole groups: its query heads and their KV heads).
  q = q.view({batch, seq, heads_, head_dim_}).transpose(1, 2);
  k = k.view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2).repeat_interleave(heads_ / kv_heads_, 1);
  v = v.view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2).repeat_interleave(heads_ / kv_heads_, 1);
  auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  auto future = at::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  auto out = at::softmax(scores, -1).matmul(v).transpose(1, 2).reshape({batch, seq, q_size});
  return o_proj(out);
}

mlp::mlp(const model_config& c, const model_layout& l) : intermediate_(share(c.intermediate, l, "intermediate")) {
  if (l.fused) {
    gate_up_proj = register_module("gate_up_proj", linear(c.hidden, 2 * intermediate_, false));
  } else {
    gate_proj = register_module("gate_proj", linear(c.hidden, intermediate_, false));
    up_proj = register_module("up_proj", linear(c.hidden, intermediate_, false));
  }
  down_proj = register_module("down_proj", linear(intermediate_, c.hidden, false));
}

at::Tensor mlp::partial(const at::Tensor& x) {
  at::Tensor gate, up;
  if (gate_up_proj) {
    auto parts = gate_up_proj(x).split(intermediate_, -1);
    gate = parts[0], up = parts[1];
  } else {
    gate = gate_proj(x), up = up_proj(x);
  }
  return down_proj(at::silu(gate) * up);
}

decoder_layer::decoder_layer(const model_config& c, const model_layout& l) {
  input_layernorm = register_module("input_layernorm", std::make_shared<rms_norm>(c.hidden, c.eps));
  self_attn = register_module("self_attn", std::make_shared<attention>(c, l));
  post_attention_layernorm = register_module("post_attention_layernorm", std::make_shared<rms_norm>(c.hidden, c.eps));
  mlp_ = register_module("mlp", std::make_shared<mlp>(c, l));
}

llama_model::llama_model(const model_config& c, const model_layout& l) : config_(c), layout_(l) {
  body_ = register_module("model", std::make_shared<torch::nn::Module>());
  embed_tokens_ = body_->register_module("embed_tokens", torch::nn::Embedding(c.vocab, c.hidden));
  torch::nn::ModuleList list;
  for (std::int64_t i = 0; i < c.layers; ++i) {
    layers_.push_back(std::make_shared<decoder_layer>(c, l));
    list->push_back(layers_.back());
  }
  body_->register_module("layers", list);
  norm_ = body_->register_module("norm", std::make_shared<rms_norm>(c.hidden, c.eps));
  lm_head_ = register_module("lm_head", linear(c.hidden, c.vocab, false));
}

at::Tensor llama_model::embed(const at::Tensor& tokens) { return embed_tokens_(tokens); }

at::Tensor llama_model::attention_partial(std::int64_t layer, const at::Tensor& h) {
  auto& l = layers_.at(static_cast<std::size_t>(layer));
  return l->self_attn->partial(l->input_layernorm->forward(h));
}

at::Tensor llama_model::mlp_partial(std::int64_t layer, const at::Tensor& h) {
  auto& l = layers_.at(static_cast<std::size_t>(layer));
  return l->mlp_->partial(l->post_attention_layernorm->forward(h));
}

at::Tensor llama_model::logits(const at::Tensor& h) { return lm_head_(norm_->forward(h)); }

std::vector<at::Tensor> llama_model::trace(const at::Tensor& tokens) {
  if (layout_.tp_size != 1) throw_error(errc::invalid_state, "trace needs the whole model (tp 1)");
  std::vector<at::Tensor> out;
  at::Tensor h = embed(tokens);
  out.push_back(h);
  for (std::int64_t i = 0; i < config_.layers; ++i) {
    h = h + attention_partial(i, h);
    out.push_back(h);
    h = h + mlp_partial(i, h);
    out.push_back(h);
  }
  out.push_back(logits(h));
  return out;
}

}  // namespace refit::example
