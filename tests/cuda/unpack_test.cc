// Needs a GPU; skips itself, with the reason, where there is none.
// The batched unpack kernel against a host memcpy reference: odd sizes and every
// relative alignment, 10,000 tiny pieces in one launch, pieces spanning many
// chunks, and unpacker's scratch reuse across batches and streams.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/cuda/unpack.h>
#include "tests/cuda/test_kernels.h"

namespace refit::cuda {
namespace {

// Pieces as offsets into a source and a destination arena.
struct span_copy {
  std::size_t src_offset;
  std::size_t dst_offset;
  std::size_t bytes;
};

class Unpack : public ::testing::Test {
 protected:
  static constexpr std::size_t arena = 24 << 20;

  void SetUp() override {
    const device_count_result devices = device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
    host_src_.resize(arena);
    std::mt19937 rng(7);
    for (auto& b : host_src_) b = static_cast<std::byte>(rng());
    src_ = device_buffer(arena);
    dst_ = device_buffer(arena);
    REFIT_CUDA_CHECK(cudaMemcpy(src_.data(), host_src_.data(), arena, cudaMemcpyHostToDevice));
    reset();
  }

  void reset() {
    REFIT_CUDA_CHECK(cudaMemset(dst_.data(), 0xEE, arena));
    expected_.assign(arena, std::byte{0xEE});
  }

  std::vector<piece> pieces(const std::vector<span_copy>& copies) {
    std::vector<piece> v;
    for (const span_copy& c : copies) {
      v.push_back({src_.bytes() + c.src_offset, dst_.bytes() + c.dst_offset, c.bytes});
      std::memcpy(expected_.data() + c.dst_offset, host_src_.data() + c.src_offset, c.bytes);
    }
    return v;
  }

  // Compares the whole destination arena, so stray writes show up too.
  void expect_destination_matches() {
    std::vector<std::byte> got(arena);
    REFIT_CUDA_CHECK(cudaMemcpy(got.data(), dst_.data(), arena, cudaMemcpyDeviceToHost));
    if (std::memcmp(got.data(), expected_.data(), arena) == 0) return;
    std::size_t first = 0, wrong = 0;
    for (std::size_t i = 0; i < arena; ++i) {
      if (got[i] != expected_[i]) {
        if (wrong++ == 0) first = i;
      }
    }
    ADD_FAILURE() << wrong << " wrong destination bytes, the first at offset " << first;
  }

  std::vector<std::byte> host_src_;
  std::vector<std::byte> expected_;
  device_buffer src_, dst_;
};

TEST_F(Unpack, OddSizesAndEveryRelativeAlignment) {
  const std::size_t sizes[] = {1, 2, 3, 7, 15, 16, 17, 31, 33, 255, 4095, 4097, 65537, 100003, 1 << 20, (1 << 20) + 5};
  std::vector<span_copy> copies;
  std::size_t src_cursor = 0, dst_cursor = 0;
  int variant = 0;
  for (std::size_t size : sizes) {
    // Source misalignment 0..15 and destination misalignment 0..15 in turn, so
    // equal (vector path), 8/4/2-byte-common and odd relative alignments all occur.
    for (std::size_t shift : {0, 1, 2, 4, 8, 3, 13}) {
      const std::size_t s = (src_cursor + 63) / 64 * 64 + variant % 16;
      const std::size_t d = (dst_cursor + 63) / 64 * 64 + (variant + shift) % 16;
      copies.push_back({s, d, size});
      src_cursor = s + size;
      dst_cursor = d + size;
      ++variant;
    }
  }
  ASSERT_LT(src_cursor, arena);
  ASSERT_LT(dst_cursor, arena);
  stream s;
  unpacker u;
  u.unpack(pieces(copies), s.get());
  s.synchronize();
  expect_destination_matches();
}

TEST_F(Unpack, TenThousandTinyPiecesInOneLaunch) {
  std::mt19937 rng(11);
  std::vector<span_copy> copies;
  std::size_t src_cursor = 0, dst_cursor = 0;
  for (int i = 0; i < 10'000; ++i) {
    const std::size_t size = 1 + rng() % 96;
    const std::size_t s = src_cursor + rng() % 16;
    const std::size_t d = dst_cursor + rng() % 16;
    copies.push_back({s, d, size});
    src_cursor = s + size;
    dst_cursor = d + size;
  }
  ASSERT_LT(dst_cursor, arena);
  const std::vector<piece> batch = pieces(copies);
  ASSERT_EQ(unpack_descriptor_count(batch), 10'000u);
  stream s;
  unpacker u;
  u.unpack(batch, s.get());
  s.synchronize();
  expect_destination_matches();
}

TEST_F(Unpack, ALargePieceSpansManyChunksAndWarps) {
  stream s;
  unpacker u;
  // 16 MiB + 5, source and destination both 16-byte aligned + 3.
  u.unpack(pieces({{3, 19, (16 << 20) + 5}}), s.get());
  s.synchronize();
  expect_destination_matches();
}

TEST_F(Unpack, LowLevelUnpackWithCallerScratch) {
  const std::vector<piece> batch = pieces({{0, 100, 1000}, {5000, 7001, 70'000}});
  const std::size_t n = unpack_descriptor_count(batch);
  pinned_buffer host(n * sizeof(piece));
  device_buffer device(n * sizeof(piece));
  stream s;
  unpack(batch, {host.as<piece>(), n}, device.as<piece>(), s.get());
  s.synchronize();
  expect_destination_matches();
}

TEST_F(Unpack, UnpackerReusesAndGrowsItsScratchAcrossBatchesAndStreams) {
  stream a, b;
  unpacker u(2);
  // Batches alternate streams and grow; the first stream is kept busy so that slot
  // reuse has to wait for (or be ordered after) earlier batches.
  std::size_t dst = 0;
  for (int round = 0; round < 6; ++round) {
    std::vector<span_copy> copies;
    const int count = 10 << round;  // 10 .. 320 pieces
    for (int i = 0; i < count; ++i) {
      copies.push_back({static_cast<std::size_t>(i) * 64 + round, dst + 1, 40});
      dst += 48;
    }
    stream& s = round % 2 == 0 ? a : b;
    if (round == 0) testing::spin(10'000'000, s.get());
    u.unpack(pieces(copies), s.get());
  }
  a.synchronize();
  b.synchronize();
  expect_destination_matches();
}

TEST_F(Unpack, EmptyBatchesEnqueueNothing) {
  stream s;
  unpacker u;
  u.unpack({}, s.get());
  u.unpack(pieces({{0, 0, 0}}), s.get());
  launch_unpack(nullptr, 0, s.get());
  s.synchronize();
  expect_destination_matches();
}

}  // namespace
}  // namespace refit::cuda
