#include <refit/tensor.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
constexpr std::int64_t i64max = std::numeric_limits<std::int64_t>::max();

TEST(device, prints_and_parses_torch_spelling) {
  EXPECT_EQ(to_string(device::cpu()), "cpu");
  EXPECT_EQ(to_string(device::cuda(3)), "cuda:3");
  EXPECT_EQ(parse_device("cpu"), device::cpu());
  EXPECT_EQ(parse_device("cuda"), device::cuda(0));
  EXPECT_EQ(parse_device("cuda:0"), device::cuda(0));
  EXPECT_EQ(parse_device("cuda:12"), device::cuda(12));
  for (device d : {device::cpu(), device::cuda(0), device::cuda(7)}) EXPECT_EQ(parse_device(to_string(d)), d);
  EXPECT_TRUE(device::cpu().is_cpu());
  EXPECT_TRUE(device::cuda(1).is_cuda());
  EXPECT_FALSE(device::cuda(1) == device::cuda(2));
}

TEST(device, rejects_anything_else_naming_the_text) {
  for (const char* bad :
       {"", "CPU", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:+1", "cuda 1", "cpu:0", "cuda:99999999999"}) {
    auto e = REFIT_THROWN(parse_device(bad));
    EXPECT_EQ(e.kind(), errc::invalid_argument) << bad;
    EXPECT_THAT(e.message(), HasSubstr("invalid device '" + std::string(bad) + "'"));
    EXPECT_THAT(e.message(), HasSubstr("expected 'cpu' or 'cuda:N'"));
  }
}

TEST(shape, prints_like_python) {
  EXPECT_EQ(shape_to_string(std::vector<std::int64_t>{}), "[]");
  EXPECT_EQ(shape_to_string(std::vector<std::int64_t>{7}), "[7]");
  EXPECT_EQ(shape_to_string(std::vector<std::int64_t>{2, 3, -1}), "[2, 3, -1]");
}

TEST(shape, numel_of_ordinary_shapes) {
  EXPECT_EQ(checked_numel(std::vector<std::int64_t>{}), 1);  // a scalar
  EXPECT_EQ(checked_numel(std::vector<std::int64_t>{2, 3, 4}), 24);
  EXPECT_EQ(checked_numel(std::vector<std::int64_t>{5, 0, 7}), 0);
  EXPECT_EQ(checked_numel(std::vector<std::int64_t>{i64max}), i64max);
  EXPECT_EQ(checked_numel(std::vector<std::int64_t>{1ll << 31, 1ll << 31}), 1ll << 62);
}

TEST(shape, numel_rejects_negative_dimensions_and_overflow) {
  auto e = REFIT_THROWN(checked_numel(std::vector<std::int64_t>{4, -1}));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("negative dimension in shape [4, -1]"));

  e = REFIT_THROWN(checked_numel(std::vector<std::int64_t>{1ll << 32, 1ll << 31}));  // 2^63
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("shape [4294967296, 2147483648] overflows the element count"));

  e = REFIT_THROWN(checked_numel(std::vector<std::int64_t>{i64max, 2}));
  EXPECT_THAT(e.message(), HasSubstr("overflows"));
}

TEST(shape, nbytes_multiplies_by_element_size) {
  EXPECT_EQ(checked_nbytes(dtype::float32, std::vector<std::int64_t>{2, 3}), 24u);
  EXPECT_EQ(checked_nbytes(dtype::bfloat16, std::vector<std::int64_t>{}), 2u);
  EXPECT_EQ(checked_nbytes(dtype::int64, std::vector<std::int64_t>{0, 9}), 0u);
  // The largest size allowed: exactly int64 max bytes.
  EXPECT_EQ(checked_nbytes(dtype::uint8, std::vector<std::int64_t>{i64max}), static_cast<std::uint64_t>(i64max));
}

TEST(shape, nbytes_names_the_tensor_in_errors) {
  auto e = REFIT_THROWN(checked_nbytes(dtype::float32, std::vector<std::int64_t>{3, -2}, "layers.0.w"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.w': negative dimension in shape [3, -2]"));

  // Overflows uint64 (2^62 elements x 8 bytes).
  e = REFIT_THROWN(checked_nbytes(dtype::int64, std::vector<std::int64_t>{1ll << 62}, "big"));
  EXPECT_THAT(e.message(), HasSubstr("tensor 'big': shape [4611686018427387904] of int64 overflows the byte size"));

  // Fits uint64 but not int64: 2^61 float32 elements are 2^63 bytes.
  e = REFIT_THROWN(checked_nbytes(dtype::float32, std::vector<std::int64_t>{1ll << 61}, "huge"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'huge': shape [2305843009213693952] is too large"));

  // Without a name there is no "tensor ''" prefix.
  e = REFIT_THROWN(checked_nbytes(dtype::float32, std::vector<std::int64_t>{-1}));
  EXPECT_THAT(e.message(), Not(HasSubstr("tensor '")));
  EXPECT_THAT(e.message(), HasSubstr("negative dimension in shape [-1]"));
}

TEST(tensor_spec, nbytes_validates_and_equality_covers_all_fields) {
  tensor_spec a{"w", dtype::bfloat16, {4, 8}};
  EXPECT_EQ(a.nbytes(), 64u);
  EXPECT_EQ(a, (tensor_spec{"w", dtype::bfloat16, {4, 8}}));
  EXPECT_NE(a, (tensor_spec{"v", dtype::bfloat16, {4, 8}}));
  EXPECT_NE(a, (tensor_spec{"w", dtype::float16, {4, 8}}));
  EXPECT_NE(a, (tensor_spec{"w", dtype::bfloat16, {8, 4}}));
  tensor_spec bad{"bad", dtype::float32, {-3}};
  auto e = REFIT_THROWN(bad.nbytes());
  EXPECT_THAT(e.message(), HasSubstr("tensor 'bad'"));
}

TEST(tensor_view, describes_bytes_and_copies_its_metadata) {
  tensor_spec spec{"layers.1.bias", dtype::float16, {3, 5}};
  std::vector<std::byte> storage(spec.nbytes());
  tensor_view v(spec, storage.data());
  EXPECT_EQ(v.name, "layers.1.bias");
  EXPECT_EQ(v.dtype, dtype::float16);
  EXPECT_EQ(v.numel(), 15);
  EXPECT_EQ(v.nbytes(), 30u);
  EXPECT_EQ(v.bytes().data(), storage.data());
  EXPECT_EQ(v.bytes().size(), 30u);
  EXPECT_TRUE(v.device.is_cpu());
  tensor_spec copy = v.spec();
  EXPECT_EQ(copy, spec);
  EXPECT_NE(copy.name.data(), spec.name.data()) << "spec() must own its name";

  tensor_view on_gpu(spec, storage.data(), device::cuda(1));
  EXPECT_EQ(on_gpu.device, device::cuda(1));
}

class declared_check : public ::testing::Test {
 protected:
  tensor_spec declared{"model.b", dtype::float32, {2, 3}};
  std::vector<std::byte> storage = std::vector<std::byte>(24);
};

TEST_F(declared_check, matching_view_passes) {
  EXPECT_NO_THROW(check_matches_declared(declared, tensor_view(declared, storage.data()), 4));
}

TEST_F(declared_check, name_divergence_names_parameter_and_both_names) {
  std::vector<std::int64_t> shape{2, 3};
  tensor_view v("model.c", dtype::float32, shape, storage.data());
  auto e = REFIT_THROWN(check_matches_declared(declared, v, 1));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("parameter #1 ('model.b') name: declared 'model.b', sent 'model.c'"));
}

TEST_F(declared_check, dtype_divergence_names_both_dtypes) {
  std::vector<std::int64_t> shape{2, 3};
  tensor_view v("model.b", dtype::bfloat16, shape, storage.data());
  auto e = REFIT_THROWN(check_matches_declared(declared, v, 7));
  EXPECT_THAT(e.message(), HasSubstr("parameter #7 ('model.b') dtype: declared float32, sent bfloat16"));
}

TEST_F(declared_check, shape_divergence_names_both_shapes_including_rank) {
  std::vector<std::int64_t> transposed{3, 2};
  auto e = REFIT_THROWN(
      check_matches_declared(declared, tensor_view("model.b", dtype::float32, transposed, storage.data()), 0));
  EXPECT_THAT(e.message(), HasSubstr("parameter #0 ('model.b') shape: declared [2, 3], sent [3, 2]"));
  std::vector<std::int64_t> flat{6};  // same element count, other rank
  e = REFIT_THROWN(check_matches_declared(declared, tensor_view("model.b", dtype::float32, flat, storage.data()), 0));
  EXPECT_THAT(e.message(), HasSubstr("shape: declared [2, 3], sent [6]"));
}

TEST_F(declared_check, null_data_is_rejected_unless_the_tensor_is_empty) {
  auto e = REFIT_THROWN(check_matches_declared(declared, tensor_view(declared, nullptr), 2));
  EXPECT_THAT(e.message(), HasSubstr("parameter #2 ('model.b') data: declared non-null data, sent a null pointer"));
  tensor_spec empty{"e", dtype::float32, {0, 3}};
  EXPECT_NO_THROW(check_matches_declared(empty, tensor_view(empty, nullptr), 0));
}

}  // namespace
}  // namespace refit
