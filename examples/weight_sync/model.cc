#include "examples/weight_sync/model.h"

#include <cctype>
#include <cmath>

#include <refit/error.h>

namespace refit::example {

namespace {

std::int64_t round_up(std::int64_t v, std::int64_t a) { return (v + a - 1) / a * a; }

std::uint64_t bytes_for(std::int64_t vocab, std::int64_t h, int layers) {
  const std::int64_t inter = round_up(8 * h / 3, 64);
  const std::int64_t per_layer = 4 * h * h + 3 * h * inter + 2 * h;
  return 2ull * static_cast<std::uint64_t>(2 * vocab * h + layers * per_layer + h);
}

}  // namespace

model_layout make_layout(std::uint64_t target_bytes, int layers, std::int64_t vocab) {
  if (layers < 1 || layers > 4096)
    throw_error(errc::invalid_argument, "--layers must be in [1, 4096], got " + std::to_string(layers));
  if (vocab < 1) throw_error(errc::invalid_argument, "--vocab must be positive");
  std::int64_t best = 64;
  for (std::int64_t h = 64; h <= 65536; h += 64) {
    auto b = bytes_for(vocab, h, layers);
    if (std::llabs(static_cast<long long>(b) - static_cast<long long>(target_bytes)) <
        std::llabs(static_cast<long long>(bytes_for(vocab, best, layers)) - static_cast<long long>(target_bytes)))
      best = h;
    if (b > target_bytes) break;
  }
  if (bytes_for(vocab, best, layers) > 4 * target_bytes)
    throw_error(errc::invalid_argument,
                "--model-bytes " + std::to_string(target_bytes) + " is too small for " + std::to_string(layers) +
                    " layers and a vocabulary of " + std::to_string(vocab) + " (smallest: " +
                    std::to_string(bytes_for(vocab, 64, layers)) + " bytes); lower --layers or --vocab");
  model_layout m;
  m.vocab = vocab;
  m.hidden = best;
  m.intermediate = round_up(8 * best / 3, 64);
  m.layers = layers;
  auto add = [&](std::string name, std::vector<std::int64_t> shape) {
    m.meta.tensors.push_back({std::move(name), dtype::bfloat16, std::move(shape)});
  };
  const std::int64_t h = m.hidden, I = m.intermediate;
  add("model.embed_tokens.weight", {vocab, h});
  for (int i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {h});
    add(p + "self_attn.q_proj.weight", {h, h});
    add(p + "self_attn.k_proj.weight", {h, h});
    add(p + "self_attn.v_proj.weight", {h, h});
    add(p + "self_attn.o_proj.weight", {h, h});
    add(p + "post_attention_layernorm.weight", {h});
    add(p + "mlp.gate_proj.weight", {I, h});
    add(p + "mlp.up_proj.weight", {I, h});
    add(p + "mlp.down_proj.weight", {h, I});
  }
  add("model.norm.weight", {h});
  add("lm_head.weight", {vocab, h});
  m.meta.validate();
  return m;
}

std::uint64_t parse_bytes(const std::string& text, const std::string& flag) {
  std::size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    throw_error(errc::invalid_argument, flag + ": expected a size like 1G or 512M, got '" + text + "'");
  }
  std::string unit = text.substr(end);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (unit == "" || unit == "B")
    scale = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB")
    scale = 1024.0;
  else if (unit == "M" || unit == "MB" || unit == "MIB")
    scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB" || unit == "GIB")
    scale = 1024.0 * 1024 * 1024;
  else
    throw_error(errc::invalid_argument, flag + ": unknown unit '" + unit + "' in '" + text + "'");
  if (!(value > 0) || value * scale > 1e15)
    throw_error(errc::invalid_argument, flag + ": size must be positive and sane, got '" + text + "'");
  return static_cast<std::uint64_t>(value * scale);
}

}  // namespace refit::example
