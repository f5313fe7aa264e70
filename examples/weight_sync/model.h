// A synthetic model laid out like a decoder-only LLM (embedding, per-layer q/k/v/o
// and gate/up/down projections, norms, lm_head), sized to a byte budget.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <refit/metadata.h>

namespace refit::example {

struct model_layout {
  std::int64_t vocab = 32000;
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  int layers = 0;
  update_metadata meta;
};

/// The layout whose bf16 size is closest to `target_bytes` with `layers` layers
/// (hidden size a multiple of 64). Throws invalid_argument when even the smallest
/// such model is larger than 4x the target.
model_layout make_layout(std::uint64_t target_bytes, int layers, std::int64_t vocab);

/// Parses "1G", "512M", "64K", "1GiB", "1000000" (powers of 1024).
std::uint64_t parse_bytes(const std::string& text, const std::string& flag);

}  // namespace refit::example
