// Runs without a GPU: everything about lib/cuda that is decided on the host before
// any CUDA call (descriptor preparation, argument checks of the conversion kernels),
// and how the RAII types fail where there is no device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/event.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/cuda/unpack.h>
#include <refit/error.h>

namespace refit::cuda {
namespace {

using ::testing::HasSubstr;

// Fake addresses: preparation never dereferences them.
const std::byte* src_at(std::uintptr_t a) { return reinterpret_cast<const std::byte*>(a); }
std::byte* dst_at(std::uintptr_t a) { return reinterpret_cast<std::byte*>(a); }

TEST(UnpackDescriptors, SmallPiecesAreOneDescriptorEachEmptyOnesNone) {
  const std::vector<piece> pieces = {
      {src_at(0x1000), dst_at(0x9000), 5},
      {src_at(0x2000), dst_at(0xa000), 0},
      {src_at(0x3001), dst_at(0xb003), unpack_chunk_bytes},
  };
  EXPECT_EQ(unpack_descriptor_count(pieces), 2u);
  std::vector<piece> out(2);
  ASSERT_EQ(prepare_unpack_descriptors(pieces, out), 2u);
  EXPECT_EQ(out[0].src, pieces[0].src);
  EXPECT_EQ(out[0].dst, pieces[0].dst);
  EXPECT_EQ(out[0].bytes, 5u);
  EXPECT_EQ(out[1].src, pieces[2].src);
  EXPECT_EQ(out[1].bytes, unpack_chunk_bytes);
}

TEST(UnpackDescriptors, LargePiecesSplitIntoConsecutiveChunks) {
  const std::uint64_t size = 3 * unpack_chunk_bytes + 7;
  const std::vector<piece> pieces = {{src_at(0x10003), dst_at(0x800013), size}};
  ASSERT_EQ(unpack_descriptor_count(pieces), 4u);
  std::vector<piece> out(4);
  ASSERT_EQ(prepare_unpack_descriptors(pieces, out), 4u);
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].src, pieces[0].src + covered) << i;
    EXPECT_EQ(out[i].dst, pieces[0].dst + covered) << i;
    // Every chunk keeps the piece's alignment modulo 16.
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(out[i].src) % 16, 3u);
    covered += out[i].bytes;
  }
  EXPECT_EQ(out[3].bytes, 7u);
  EXPECT_EQ(covered, size);
}

TEST(UnpackDescriptors, CustomChunkAndOrderAcrossPieces) {
  const std::vector<piece> pieces = {
      {src_at(0x100), dst_at(0x1100), 33},
      {src_at(0x200), dst_at(0x1200), 16},
      {src_at(0x300), dst_at(0x1300), 17},
  };
  EXPECT_EQ(unpack_descriptor_count(pieces, 16), 3u + 1 + 2);
  std::vector<piece> out(8);  // more room than needed is fine
  ASSERT_EQ(prepare_unpack_descriptors(pieces, out, 16), 6u);
  const std::uint64_t sizes[] = {16, 16, 1, 16, 16, 1};
  const std::uintptr_t sources[] = {0x100, 0x110, 0x120, 0x200, 0x300, 0x310};
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(out[i].bytes, sizes[i]) << i;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(out[i].src), sources[i]) << i;
  }
}

TEST(UnpackDescriptors, RefusesTooLittleRoomAndBadChunks) {
  const std::vector<piece> pieces = {{src_at(0x100), dst_at(0x1100), 100}};
  std::vector<piece> out(1);
  try {
    (void)prepare_unpack_descriptors(pieces, out, 32);
    FAIL() << "no throw";
  } catch (const refit::error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("1 pieces need 4 descriptors, got room for 1"));
  }
  EXPECT_THROW((void)prepare_unpack_descriptors(pieces, out, 0), refit::error);
  EXPECT_THROW((void)prepare_unpack_descriptors(pieces, out, 24), refit::error);
  EXPECT_EQ(prepare_unpack_descriptors({}, out), 0u);
}

TEST(UnpackDescriptors, TenThousandTinyPiecesAreTenThousandDescriptors) {
  std::vector<piece> pieces;
  for (std::uintptr_t i = 0; i < 10'000; ++i)
    pieces.push_back({src_at(0x100000 + 64 * i), dst_at(0x900000 + 61 * i), 1 + i % 60});
  EXPECT_EQ(unpack_descriptor_count(pieces), 10'000u);
}

void expect_invalid(auto&& call, const std::string& text) {
  try {
    call();
    FAIL() << "no throw; expected " << text;
  } catch (const refit::error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr(text));
  }
}

// Real-looking but never dereferenced pointers: every check fails before a launch.
auto* const a = reinterpret_cast<void*>(std::uintptr_t{0x7f0000000000});
auto* const b = reinterpret_cast<void*>(std::uintptr_t{0x7f0001000000});

TEST(ConvertArguments, SupportedPairsAreTheReferences) {
  EXPECT_TRUE(can_convert(dtype::float32, dtype::bfloat16));
  EXPECT_TRUE(can_convert(dtype::float16, dtype::float16));
  EXPECT_TRUE(can_convert(dtype::float8_e5m2, dtype::float32));
  EXPECT_FALSE(can_convert(dtype::float32, dtype::float8_e4m3fn));
  EXPECT_FALSE(can_convert(dtype::float8_e4m3fn, dtype::float8_e5m2));
  EXPECT_FALSE(can_convert(dtype::float64, dtype::float32));
  EXPECT_TRUE(can_quantize(dtype::bfloat16, dtype::float8_e4m3fn));
  EXPECT_FALSE(can_quantize(dtype::float8_e4m3fn, dtype::float8_e4m3fn));
  EXPECT_FALSE(can_quantize(dtype::int8, dtype::float8_e5m2));
}

TEST(ConvertArguments, BadArgumentsThrowBeforeAnyLaunch) {
  expect_invalid([] { convert(a, dtype::float32, b, dtype::int8, 4, nullptr); },
                 "refit::cuda::convert of 4 elements from float32 to int8: unsupported dtype "
                 "pair");
  expect_invalid([] { convert(a, dtype::float32, b, dtype::float16, 4, nullptr, 2.0f); },
                 "a scale applies to fp8 sources only; expected 1, got 2");
  expect_invalid([] { convert(a, dtype::float8_e4m3fn, b, dtype::float16, 4, nullptr, 0.0f); },
                 "the fp8 scale must be finite and > 0, got 0");
  expect_invalid([] { quantize_fp8(a, dtype::float32, b, dtype::float8_e5m2, 4, -1.0f, nullptr); },
                 "the fp8 scale must be finite and > 0, got -1");
  expect_invalid([] { quantize_fp8(a, dtype::float32, b, dtype::float16, 4, 1.0f, nullptr); },
                 "refit::cuda::quantize_fp8 of 4 elements from float32 to float16: unsupported dtype pair");
  expect_invalid([] { convert(nullptr, dtype::float32, b, dtype::float16, 4, nullptr); }, "null pointer");
  expect_invalid([] { convert(a, dtype::float32, static_cast<std::byte*>(a) + 8, dtype::bfloat16, 4, nullptr); },
                 "source and destination overlap");
  expect_invalid([] { convert(static_cast<std::byte*>(a) + 1, dtype::float16, b, dtype::float32, 4, nullptr); },
                 "pointers must be aligned to their element sizes");
}

// Where there is no device, constructors fail with cuda_error naming the call (and
// not, say, with a crash); with a device they succeed.
TEST(RaiiWithoutDevice, ConstructorsThrowCudaErrorNamingTheCall) {
  const device_count_result devices = device_count_or_reason();
  if (devices) {
    EXPECT_NO_THROW({
      stream s;
      event e;
      device_buffer d(16);
      pinned_buffer p(16);
    });
    return;
  }
  EXPECT_THAT([] { stream s; }, ::testing::ThrowsMessage<cuda_error>(HasSubstr("cudaGetDevice(")));
  EXPECT_THAT([] { event e; }, ::testing::ThrowsMessage<cuda_error>(HasSubstr("cudaEventCreateWithFlags(")));
  EXPECT_THAT([] { device_buffer d(16); }, ::testing::ThrowsMessage<cuda_error>(HasSubstr("cudaGetDevice(")));
  EXPECT_THAT([] { pinned_buffer p(16); }, ::testing::ThrowsMessage<cuda_error>(HasSubstr("cudaHostAlloc(")));
  // Empty objects need no device.
  EXPECT_EQ(device_buffer().data(), nullptr);
  EXPECT_EQ(pinned_buffer().size(), 0u);
}

}  // namespace
}  // namespace refit::cuda
