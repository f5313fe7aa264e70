#include "lib/checksum.h"

#include <memory>

#include <xxhash.h>

namespace refit {
namespace {

template <class Buffers>
std::uint64_t checksum_of(const Buffers& buffers) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (const auto& b : buffers) XXH3_64bits_update(state.get(), b.data(), b.size());
  return XXH3_64bits_digest(state.get());
}

}  // namespace

std::uint64_t checksum(std::span<const asio::const_buffer> buffers) { return checksum_of(buffers); }
std::uint64_t checksum(std::span<const asio::mutable_buffer> buffers) { return checksum_of(buffers); }

}  // namespace refit
