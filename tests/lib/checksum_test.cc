// refit::checksum is XXH3-64 of the concatenated buffers, whichever build of XXH3
// runs (the AVX2 one where the CPU has it): it must equal libxxhash's one-shot
// XXH3_64bits of the same bytes, for any split into buffers, or trainer and worker
// on different CPUs would disagree.
#include <refit/backend/checksum.h>

#include <cstdint>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include <refit/internal/checksum_avx2.h>

namespace refit {
namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> out(n);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

TEST(checksum, equals_one_shot_xxh3_for_every_split_and_size) {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{16}, std::size_t{17}, std::size_t{128},
                        std::size_t{129}, std::size_t{240}, std::size_t{241}, std::size_t{1000}, std::size_t{4096},
                        std::size_t{100000}, std::size_t{3} << 20}) {
    const auto bytes = random_bytes(n, n);
    const std::uint64_t expected = XXH3_64bits(bytes.data(), bytes.size());
    std::mt19937_64 rng(n + 1);
    for (int split = 0; split < 5; ++split) {
      std::vector<asio::const_buffer> buffers;
      std::size_t at = 0;
      while (at < n) {
        std::size_t take = std::min<std::size_t>(n - at, 1 + rng() % (split == 0 ? n : 300));
        buffers.emplace_back(bytes.data() + at, take);
        at += take;
      }
      if (split == 4)
        buffers.insert(buffers.begin(), asio::const_buffer(bytes.data(), 0));  // empty pieces count for nothing
      EXPECT_EQ(checksum(buffers), expected) << n << " bytes in " << buffers.size() << " buffers";
    }
  }
}

TEST(checksum, the_avx2_build_agrees_with_libxxhash) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2: only the baseline build runs here";
  const auto bytes = random_bytes(1 << 20, 7);
  const void* data[] = {bytes.data(), bytes.data() + 1000};
  const unsigned long sizes[] = {1000, bytes.size() - 1000};
  EXPECT_EQ(detail::xxh3_avx2(data, sizes, 2), XXH3_64bits(bytes.data(), bytes.size()));
}

}  // namespace
}  // namespace refit
