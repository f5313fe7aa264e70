// Element types refit moves. The core never interprets element values; it needs the
// size to lay out bytes and the name to match torch's spelling in JSON metadata.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace refit {

/// Element types, named as torch names them.
enum class dtype : std::uint8_t {
  bool_,
  uint8,
  int8,
  int16,
  int32,
  int64,
  float16,
  bfloat16,
  float32,
  float64,
  float8_e4m3fn,
  float8_e5m2,
};

/// Bytes per element.
std::size_t element_size(dtype t) noexcept;

/// torch's name without the "torch." prefix: "bfloat16", "bool", ...
std::string_view to_string(dtype t) noexcept;

/// Parses "bfloat16" or "torch.bfloat16" (and torch's aliases "half", "float",
/// "double", "short", "int", "long"). Throws refit::error(invalid_argument) naming
/// the text and listing the accepted names.
dtype parse_dtype(std::string_view name);

}  // namespace refit
