// The async server's request protocol (a stand-in for inference): fixed-size
// little-endian binary frames on one TCP connection, answered in order.
//
//   request  (16 bytes): u64 id, u32 tensor index, u32 reserved (0)
//   answer   (24 bytes): u64 id, i64 version, u64 digest
//
// The server reads the first slice_bytes of the tensor (index modulo the number of
// tensors) under a tensor_map_target reader and answers the XXH3-64 of it with
// the version it read: a client that knows each version's weights checks that no
// answer mixes two versions. version is version_none when the weights carry no
// version (dirty, or never updated), version_busy when a reader_lock server's
// update holds the weights (the request is not served; retry).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <xxhash.h>

namespace refit::example::serving {

inline constexpr std::size_t request_bytes = 16;
inline constexpr std::size_t answer_bytes = 24;
/// How much of a tensor one request reads (the whole tensor when smaller).
inline constexpr std::size_t slice_bytes = 64 << 10;
inline constexpr std::int64_t version_none = -1;
inline constexpr std::int64_t version_busy = -2;

/// What a request for a tensor holding `bytes` answers.
inline std::uint64_t slice_digest(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size() < slice_bytes ? bytes.size() : slice_bytes);
}

}  // namespace refit::example::serving
