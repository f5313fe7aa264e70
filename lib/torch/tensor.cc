#include <refit/torch/tensor.h>

#include <ATen/ops/from_blob.h>
#include <c10/util/ArrayRef.h>

#include <refit/error.h>

namespace refit::libtorch {

namespace {

std::string named(std::string_view what) {
  return what.empty() ? std::string("tensor") : "tensor '" + std::string(what) + "'";
}

std::span<const std::int64_t> span_of(c10::IntArrayRef a) { return {a.data(), a.size()}; }

}  // namespace

std::string_view libtorch_version() noexcept { return TORCH_VERSION; }

std::optional<dtype> to_dtype(c10::ScalarType type) noexcept {
  switch (type) {
    case c10::ScalarType::Bool:
      return dtype::bool_;
    case c10::ScalarType::Byte:
      return dtype::uint8;
    case c10::ScalarType::Char:
      return dtype::int8;
    case c10::ScalarType::Short:
      return dtype::int16;
    case c10::ScalarType::Int:
      return dtype::int32;
    case c10::ScalarType::Long:
      return dtype::int64;
    case c10::ScalarType::Half:
      return dtype::float16;
    case c10::ScalarType::BFloat16:
      return dtype::bfloat16;
    case c10::ScalarType::Float:
      return dtype::float32;
    case c10::ScalarType::Double:
      return dtype::float64;
#if REFIT_LIBTORCH_HAS_FP8
    case c10::ScalarType::Float8_e4m3fn:
      return dtype::float8_e4m3fn;
    case c10::ScalarType::Float8_e5m2:
      return dtype::float8_e5m2;
#endif
    default:
      return std::nullopt;
  }
}

std::optional<c10::ScalarType> to_scalar_type(dtype type) noexcept {
  switch (type) {
    case dtype::bool_:
      return c10::ScalarType::Bool;
    case dtype::uint8:
      return c10::ScalarType::Byte;
    case dtype::int8:
      return c10::ScalarType::Char;
    case dtype::int16:
      return c10::ScalarType::Short;
    case dtype::int32:
      return c10::ScalarType::Int;
    case dtype::int64:
      return c10::ScalarType::Long;
    case dtype::float16:
      return c10::ScalarType::Half;
    case dtype::bfloat16:
      return c10::ScalarType::BFloat16;
    case dtype::float32:
      return c10::ScalarType::Float;
    case dtype::float64:
      return c10::ScalarType::Double;
#if REFIT_LIBTORCH_HAS_FP8
    case dtype::float8_e4m3fn:
      return c10::ScalarType::Float8_e4m3fn;
    case dtype::float8_e5m2:
      return c10::ScalarType::Float8_e5m2;
#else
    case dtype::float8_e4m3fn:
    case dtype::float8_e5m2:
      return std::nullopt;
#endif
  }
  return std::nullopt;
}

dtype dtype_of(c10::ScalarType type, std::string_view what) {
  if (auto d = to_dtype(type)) return *d;
  throw_error(errc::unsupported, named(what) + " has torch dtype " + std::string(c10::toString(type)) +
                                     ", which refit does not move (supported: bool, uint8, int8, int16, "
                                     "int32, int64, float16, bfloat16, float32, float64" +
                                     (has_fp8 ? ", float8_e4m3fn, float8_e5m2)" : ")"));
}

c10::ScalarType scalar_type_of(dtype type, std::string_view what) {
  if (auto t = to_scalar_type(type)) return *t;
  throw_error(errc::unsupported, named(what) + " is " + std::string(to_string(type)) + ", which libtorch " +
                                     std::string(libtorch_version()) +
                                     " does not have (float8 types need libtorch 2.1 or later)");
}

c10::Device to_torch_device(const device& d) {
  if (d.is_cuda()) return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.index));
  return c10::Device(c10::DeviceType::CPU);
}

device from_torch_device(const c10::Device& d, std::string_view what) {
  if (d.is_cpu()) return device::cpu();
  if (d.is_cuda()) return device::cuda(d.has_index() ? d.index() : 0);
  throw_error(errc::unsupported, named(what) + " is on device " + d.str() + "; refit moves cpu and cuda tensors");
}

tensor_view to_view(const at::Tensor& t, std::string_view name) {
  if (!t.defined()) throw_error(errc::invalid_argument, named(name) + " is an undefined tensor");
  if (t.layout() != c10::Layout::Strided)
    throw_error(errc::unsupported, named(name) +
                                       " has a non-strided layout (sparse or other); refit moves "
                                       "dense tensors");
  const dtype type = dtype_of(t.scalar_type(), name);
  const device dev = from_torch_device(t.device(), name);
  if (!t.is_contiguous())
    throw_error(errc::invalid_argument, named(name) + " of shape " + shape_to_string(span_of(t.sizes())) +
                                            " is not contiguous (strides " + shape_to_string(span_of(t.strides())) +
                                            "); pass t.contiguous() (a copy) instead");
  return tensor_view(name, type, span_of(t.sizes()), t.data_ptr(), dev);
}

at::Tensor to_tensor(const tensor_view& v) {
  const auto options = at::TensorOptions().dtype(scalar_type_of(v.dtype, v.name)).device(to_torch_device(v.device));
  return at::from_blob(v.data, c10::IntArrayRef(v.shape.data(), v.shape.size()), options);
}

}  // namespace refit::libtorch
