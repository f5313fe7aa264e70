#include <refit/backend/checksum.h>

#include <memory>
#include <vector>

#include <xxhash.h>

#include <refit/internal/checksum_avx2.h>

namespace refit {
namespace {

const bool have_avx2 = __builtin_cpu_supports("avx2");

template <class Buffers>
std::uint64_t checksum_of(const Buffers& buffers) {
  if (have_avx2) {
    std::vector<const void*> data;
    std::vector<unsigned long> sizes;
    data.reserve(buffers.size());
    sizes.reserve(buffers.size());
    for (const auto& b : buffers) {
      data.push_back(b.data());
      sizes.push_back(b.size());
    }
    return detail::xxh3_avx2(data.data(), sizes.data(), data.size());
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (const auto& b : buffers) XXH3_64bits_update(state.get(), b.data(), b.size());
  return XXH3_64bits_digest(state.get());
}

}  // namespace

std::uint64_t checksum(std::span<const asio::const_buffer> buffers) { return checksum_of(buffers); }
std::uint64_t checksum(std::span<const asio::mutable_buffer> buffers) { return checksum_of(buffers); }

}  // namespace refit
