// What a control-plane peer accepts from the other side's frames (length-prefixed
// JSON messages): worker_host's host_limits::frames, and the control client's.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refit::control {

/// Default largest frame: metadata of ~1M tensors fits.
inline constexpr std::uint32_t default_max_frame = 256u << 20;
/// Default most values a frame may parse into (json_shape::values): update
/// metadata of ~600k tensors (names, dtypes, shapes), a few hundred MiB parsed.
inline constexpr std::size_t default_max_frame_values = 4u << 20;

/// What a frame_stream accepts from its peer.
struct frame_limits {
  std::uint32_t max_bytes = default_max_frame;
  std::size_t max_values = default_max_frame_values;
};

}  // namespace refit::control
