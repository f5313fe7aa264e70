// The per-bucket message of the CUDA IPC side channel (after the update header of
// lib/backend/links/wire.h): which exported buffer holds the bucket. The worker
// answers each with a status (seq = bucket index) once it has consumed the buffer.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace refit::cuda_ipc::wire {

inline constexpr std::uint32_t chunk_magic = 0x43504952;  // "RIPC"

struct chunk {
  std::uint32_t magic = chunk_magic;
  std::uint32_t buffer = 0;  ///< which of the trainer's rotating buffers
  std::uint64_t index = 0;   ///< bucket index
  std::uint64_t payload_bytes = 0;
  std::uint64_t reserved = 0;
  std::array<std::byte, 64> handle{};
  std::array<std::byte, 16> gpu{};
};
static_assert(sizeof(chunk) == 112);

/// "" when `c` is the chunk the worker's plan expects, else what differs.
inline std::string check_chunk(const chunk& c, std::uint64_t index, std::uint64_t bytes, std::uint32_t buffers) {
  if (c.magic != chunk_magic) return "expected a chunk message, got magic " + std::to_string(c.magic);
  if (c.index != index || c.payload_bytes != bytes)
    return "expected bucket " + std::to_string(index) + " of " + std::to_string(bytes) +
           " bytes, trainer sent bucket " + std::to_string(c.index) + " of " + std::to_string(c.payload_bytes);
  if (c.buffer >= buffers)
    return "buffer " + std::to_string(c.buffer) + " outside the " + std::to_string(buffers) + " exported buffers";
  return {};
}

}  // namespace refit::cuda_ipc::wire
