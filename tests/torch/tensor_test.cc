// lib/torch/tensor.h: dtype and device mapping, zero-copy views of tensors and
// non-owning tensors over views, and the errors for what refit cannot move.
#include <refit/torch/tensor.h>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit::libtorch {
namespace {

using ::testing::HasSubstr;

const dtype all_dtypes[] = {dtype::bool_,   dtype::uint8,   dtype::int8,          dtype::int16,
                            dtype::int32,   dtype::int64,   dtype::float16,       dtype::bfloat16,
                            dtype::float32, dtype::float64, dtype::float8_e4m3fn, dtype::float8_e5m2};

TEST(libtorch_dtype, every_refit_dtype_round_trips_with_the_same_element_size) {
  for (dtype t : all_dtypes) {
    SCOPED_TRACE(std::string(to_string(t)));
    const bool fp8 = t == dtype::float8_e4m3fn || t == dtype::float8_e5m2;
    auto st = to_scalar_type(t);
    if (fp8 && !has_fp8) {
      EXPECT_FALSE(st.has_value());
      continue;
    }
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(to_dtype(*st), t);
    EXPECT_EQ(c10::elementSize(*st), element_size(t));
    EXPECT_EQ(scalar_type_of(t), *st);
    EXPECT_EQ(dtype_of(*st), t);
  }
}

TEST(libtorch_dtype, torch_names_match_refits) {
  EXPECT_EQ(to_dtype(at::kBFloat16), dtype::bfloat16);
  EXPECT_EQ(to_dtype(at::kHalf), dtype::float16);
  EXPECT_EQ(to_dtype(at::kBool), dtype::bool_);
  EXPECT_EQ(to_dtype(at::kByte), dtype::uint8);
  EXPECT_EQ(to_dtype(at::kChar), dtype::int8);
  EXPECT_EQ(to_dtype(at::kLong), dtype::int64);
}

TEST(libtorch_dtype, types_refit_does_not_move_are_unsupported_by_name) {
  EXPECT_FALSE(to_dtype(at::kComplexFloat).has_value());
  EXPECT_FALSE(to_dtype(at::kQInt8).has_value());
  auto e = REFIT_THROWN(dtype_of(at::kComplexFloat, "w"));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'w'"));
  EXPECT_THAT(e.message(), HasSubstr("ComplexFloat"));
}

TEST(libtorch_dtype, fp8_is_mapped_exactly_when_this_libtorch_has_it) {
#if REFIT_LIBTORCH_HAS_FP8
  EXPECT_EQ(to_scalar_type(dtype::float8_e4m3fn), c10::ScalarType::Float8_e4m3fn);
  EXPECT_EQ(to_scalar_type(dtype::float8_e5m2), c10::ScalarType::Float8_e5m2);
  EXPECT_EQ(to_dtype(c10::ScalarType::Float8_e4m3fn), dtype::float8_e4m3fn);
#else
  auto e = REFIT_THROWN(scalar_type_of(dtype::float8_e4m3fn, "w8"));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'w8' is float8_e4m3fn"));
  EXPECT_THAT(e.message(), HasSubstr("libtorch " + std::string(libtorch_version())));
#endif
}

TEST(libtorch_version, is_the_compiled_against_version) {
  EXPECT_THAT(std::string(libtorch_version()), ::testing::StartsWith(std::to_string(TORCH_VERSION_MAJOR) + "."));
}

TEST(libtorch_device, cpu_and_cuda_round_trip_others_are_unsupported) {
  EXPECT_EQ(from_torch_device(to_torch_device(device::cpu())), device::cpu());
  EXPECT_EQ(from_torch_device(to_torch_device(device::cuda(3))), device::cuda(3));
  EXPECT_EQ(to_torch_device(device::cuda(1)), c10::Device(c10::DeviceType::CUDA, 1));
  EXPECT_EQ(from_torch_device(c10::Device(c10::DeviceType::CUDA)), device::cuda(0));
  auto e = REFIT_THROWN(from_torch_device(c10::Device(c10::DeviceType::Meta), "m"));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'm' is on device meta"));
}

TEST(to_view, is_zero_copy_with_the_tensors_dtype_shape_and_device) {
  at::Tensor t = at::arange(6, at::kFloat).reshape({2, 3});
  tensor_view v = to_view(t, "w");
  EXPECT_EQ(v.name, "w");
  EXPECT_EQ(v.dtype, dtype::float32);
  EXPECT_EQ(std::vector<std::int64_t>(v.shape.begin(), v.shape.end()), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(static_cast<void*>(v.data), t.data_ptr());
  EXPECT_EQ(v.device, device::cpu());
  EXPECT_EQ(v.nbytes(), 24u);
  reinterpret_cast<float*>(v.data)[4] = 42.0f;  // writes through to the tensor
  EXPECT_EQ(t[1][1].item<float>(), 42.0f);
}

TEST(to_view, a_contiguous_slice_views_from_its_storage_offset) {
  at::Tensor t = at::arange(12, at::kLong).reshape({4, 3});
  at::Tensor rows = t.narrow(0, 2, 2);
  tensor_view v = to_view(rows, "rows");
  EXPECT_EQ(v.data, static_cast<std::byte*>(t.data_ptr()) + 6 * sizeof(std::int64_t));
  EXPECT_EQ(reinterpret_cast<std::int64_t*>(v.data)[0], 6);
  EXPECT_EQ(v.dtype, dtype::int64);
}

TEST(to_view, every_dtype_refit_and_torch_share) {
  for (dtype t : all_dtypes) {
    auto st = to_scalar_type(t);
    if (!st) continue;
    at::Tensor x = at::zeros({5}, at::TensorOptions().dtype(*st));
    EXPECT_EQ(to_view(x, "x").dtype, t) << to_string(t);
  }
}

TEST(to_view, a_non_contiguous_tensor_is_refused_by_name) {
  at::Tensor t = at::zeros({2, 3}).t();
  auto e = REFIT_THROWN(to_view(t, "layers.0.w"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'layers.0.w' of shape [3, 2] is not contiguous"));
  EXPECT_THAT(e.message(), HasSubstr("contiguous()"));
  EXPECT_NO_THROW(to_view(t.contiguous(), "copy"));
}

TEST(to_view, undefined_sparse_complex_and_meta_tensors_are_refused) {
  auto undefined = REFIT_THROWN(to_view(at::Tensor(), "u"));
  EXPECT_EQ(undefined.kind(), errc::invalid_argument);
  EXPECT_THAT(undefined.message(), HasSubstr("tensor 'u' is an undefined tensor"));

  auto sparse = REFIT_THROWN(to_view(at::eye(3).to_sparse(), "s"));
  EXPECT_EQ(sparse.kind(), errc::unsupported);
  EXPECT_THAT(sparse.message(), HasSubstr("tensor 's' has a non-strided layout"));

  auto complex = REFIT_THROWN(to_view(at::zeros({2}, at::kComplexFloat), "c"));
  EXPECT_EQ(complex.kind(), errc::unsupported);
  EXPECT_THAT(complex.message(), HasSubstr("tensor 'c' has torch dtype ComplexFloat"));

  auto meta = REFIT_THROWN(to_view(at::empty({2}, at::TensorOptions().device(c10::DeviceType::Meta)), "m"));
  EXPECT_EQ(meta.kind(), errc::unsupported);
  EXPECT_THAT(meta.message(), HasSubstr("tensor 'm' is on device meta"));
}

TEST(to_view, an_empty_tensor_is_a_view_of_no_bytes) {
  at::Tensor t = at::zeros({0, 4}, at::kHalf);
  tensor_view v = to_view(t, "e");
  EXPECT_EQ(v.nbytes(), 0u);
  EXPECT_EQ(v.dtype, dtype::float16);
}

TEST(to_tensor, is_a_non_owning_tensor_over_the_views_bytes) {
  std::vector<std::uint16_t> bits{0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0};  // bf16 1..6
  std::vector<std::int64_t> shape{3, 2};
  tensor_view v("b", dtype::bfloat16, shape, bits.data());
  at::Tensor t = to_tensor(v);
  EXPECT_EQ(t.data_ptr(), static_cast<void*>(bits.data()));
  EXPECT_EQ(t.scalar_type(), at::kBFloat16);
  EXPECT_EQ(t.sizes(), c10::IntArrayRef({3, 2}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_TRUE(t.device().is_cpu());
  EXPECT_EQ(t[2][1].item<float>(), 6.0f);
  t[0][0] = 2.0f;  // writes land in the view's memory
  EXPECT_EQ(bits[0], 0x4000);
  // And back: the same bytes.
  tensor_view again = to_view(t, "b");
  EXPECT_EQ(again.data, v.data);
  EXPECT_EQ(again.dtype, v.dtype);
}

TEST(to_tensor, a_dtype_this_libtorch_lacks_is_unsupported) {
  if (has_fp8) GTEST_SKIP() << "this libtorch has float8 types";
  std::uint8_t byte = 0;
  std::vector<std::int64_t> shape{1};
  auto e = REFIT_THROWN(to_tensor(tensor_view("f8", dtype::float8_e5m2, shape, &byte)));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'f8' is float8_e5m2"));
}

TEST(to_tensor, fp8_bytes_read_as_torch_fp8_where_available) {
  if (!has_fp8) GTEST_SKIP() << "libtorch " << libtorch_version() << " has no float8 types";
  std::vector<std::uint8_t> bytes{0x38, 0x40};  // e4m3fn 1.0, 2.0
  std::vector<std::int64_t> shape{2};
  at::Tensor t = to_tensor(tensor_view("f8", dtype::float8_e4m3fn, shape, bytes.data()));
  at::Tensor f = t.to(at::kFloat);
  EXPECT_EQ(f[0].item<float>(), 1.0f);
  EXPECT_EQ(f[1].item<float>(), 2.0f);
}

}  // namespace
}  // namespace refit::libtorch
