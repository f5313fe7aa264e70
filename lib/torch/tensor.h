// Zero-copy conversions between libtorch's at::Tensor and refit's tensor views:
// dtypes, devices, views of a tensor's storage and non-owning tensors over a
// view's bytes. The core stays torch-free; this layer is optional.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#include <refit/dtype.h>
#include <refit/tensor.h>

// Float8 scalar types arrived in libtorch 2.1.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define REFIT_LIBTORCH_HAS_FP8 1
#else
#define REFIT_LIBTORCH_HAS_FP8 0
#endif

namespace refit::libtorch {

/// Whether this libtorch has float8_e4m3fn and float8_e5m2 (2.1 and later).
inline constexpr bool has_fp8 = REFIT_LIBTORCH_HAS_FP8 != 0;

/// The libtorch this was compiled against, "1.13.1".
std::string_view libtorch_version() noexcept;

/// refit's dtype for a torch scalar type; nullopt for types refit does not move
/// (complex, quantized, uint16/32/64, fp8 variants other than e4m3fn and e5m2).
std::optional<dtype> to_dtype(c10::ScalarType type) noexcept;
/// torch's scalar type for `type`; nullopt when this libtorch lacks it (fp8
/// before 2.1).
std::optional<c10::ScalarType> to_scalar_type(dtype type) noexcept;

/// Like to_dtype, throwing refit::error(unsupported) that names `what` (usually
/// the tensor name) and the torch type.
dtype dtype_of(c10::ScalarType type, std::string_view what = {});
/// Like to_scalar_type, throwing refit::error(unsupported) that names `what` and
/// the libtorch version.
c10::ScalarType scalar_type_of(dtype type, std::string_view what = {});

/// cpu -> cpu, cuda:N -> cuda:N.
c10::Device to_torch_device(const device& d);
/// The inverse; throws refit::error(unsupported) naming `what` for other device
/// types (mps, xla, meta, ...).
device from_torch_device(const c10::Device& d, std::string_view what = {});

/// A zero-copy view of `t`'s elements, named `name`. The view points into t's
/// storage and at t's sizes (held by its TensorImpl), and at `name`'s characters:
/// keep `t` (or another reference to the same tensor) and `name` alive and `t`
/// unresized while the view is used. Throws refit::error naming `name`:
/// invalid_argument for an undefined or non-contiguous tensor (call .contiguous()
/// first: that copies), unsupported for a dtype refit lacks, a sparse or other
/// non-strided layout, or a device other than cpu/cuda.
tensor_view to_view(const at::Tensor& t, std::string_view name = {});

/// A non-owning at::Tensor over `v`'s bytes (at::from_blob): same dtype, shape and
/// device, contiguous. It is valid as long as `v`'s memory is, e.g. only during a
/// load_weights call for views an engine hands out. Throws refit::error
/// (unsupported) when this libtorch lacks the dtype.
at::Tensor to_tensor(const tensor_view& v);

}  // namespace refit::libtorch
