#include "tensors.h"

#include <nanobind/ndarray.h>

#include <refit/error.h>

namespace refit::py {

namespace {

using dl = nb::dlpack::dtype_code;

nb::dlpack::dtype dl_dtype(refit::dtype t) {
  auto make = [](dl code, int bits) { return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1}; };
  switch (t) {
    case dtype::bool_: return make(dl::Bool, 8);
    case dtype::uint8: return make(dl::UInt, 8);
    case dtype::int8: return make(dl::Int, 8);
    case dtype::int16: return make(dl::Int, 16);
    case dtype::int32: return make(dl::Int, 32);
    case dtype::int64: return make(dl::Int, 64);
    case dtype::float16: return make(dl::Float, 16);
    case dtype::bfloat16: return make(dl::Bfloat, 16);
    case dtype::float32: return make(dl::Float, 32);
    case dtype::float64: return make(dl::Float, 64);
    case dtype::float8_e4m3fn: return make(dl::Float8_E4M3FN, 8);
    case dtype::float8_e5m2: return make(dl::Float8_E5M2, 8);
  }
  return make(dl::UInt, 8);
}

std::optional<refit::dtype> refit_dtype(nb::dlpack::dtype d) {
  if (d.lanes != 1) return std::nullopt;
  switch (static_cast<dl>(d.code)) {
    case dl::Bool: if (d.bits == 8) return dtype::bool_; break;
    case dl::UInt: if (d.bits == 8) return dtype::uint8; break;
    case dl::Int:
      if (d.bits == 8) return dtype::int8;
      if (d.bits == 16) return dtype::int16;
      if (d.bits == 32) return dtype::int32;
      if (d.bits == 64) return dtype::int64;
      break;
    case dl::Float:
      if (d.bits == 16) return dtype::float16;
      if (d.bits == 32) return dtype::float32;
      if (d.bits == 64) return dtype::float64;
      break;
    case dl::Bfloat: if (d.bits == 16) return dtype::bfloat16; break;
    case dl::Float8_E4M3FN: if (d.bits == 8) return dtype::float8_e4m3fn; break;
    case dl::Float8_E5M2: if (d.bits == 8) return dtype::float8_e5m2; break;
    default: break;
  }
  return std::nullopt;
}

std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  static const char* names[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool", "float8_e3m4",
                                "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
                                "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn",
                                "float6_e3m2fn", "float4_e2m1fn", "bcomplex"};
  std::string name = d.code < std::size(names) ? names[d.code] : "code " + std::to_string(d.code);
  if (d.code <= 6 || d.code == 18) name += std::to_string(d.bits);
  if (d.lanes != 1) name += "x" + std::to_string(d.lanes);
  return name;
}

std::string py_type_name(nb::handle o) { return nb::cast<std::string>(nb::str(nb::handle(o.type()).attr("__name__"))); }

// torch.Tensor, when torch has been imported (refit never imports it for this).
nb::handle torch_tensor_type() {
  static nb::object type;
  if (!type.is_valid()) {
    nb::dict modules = nb::borrow<nb::dict>(PyImport_GetModuleDict());
    if (!modules.contains("torch")) return {};
    type = nb::module_::import_("torch").attr("Tensor");
  }
  return type;
}

}  // namespace

framework parse_framework(const std::string& name) {
  if (name == "torch") return framework::torch;
  if (name == "numpy") return framework::numpy;
  if (name == "auto") {
    try {
      nb::module_::import_("torch");
      return framework::torch;
    } catch (nb::python_error&) {
      return framework::numpy;
    }
  }
  throw_error(errc::invalid_argument, "framework: expected 'auto', 'torch' or 'numpy', got '" + name + "'");
}

held_tensors held_tensors::from_python(nb::handle tensors, const std::string& what) {
  held_tensors out;
  nb::list owners;
  nb::object pairs = nb::borrow(tensors);
  if (PyDict_Check(tensors.ptr()) || (nb::hasattr(tensors, "items") && nb::hasattr(tensors, "keys")))
    pairs = tensors.attr("items")();
  nb::handle tensor_type = torch_tensor_type();
  std::size_t index = 0;
  for (nb::handle pair : pairs) {
    nb::object name_obj, obj;
    if (PyTuple_Check(pair.ptr()) && PyTuple_GET_SIZE(pair.ptr()) == 2) {
      name_obj = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 0));
      obj = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 1));
    } else {
      nb::sequence seq = nb::borrow<nb::sequence>(pair);
      if (nb::len(seq) != 2)
        throw_error(errc::invalid_argument, what + ": item " + std::to_string(index) +
                                                " is not a (name, tensor) pair");
      name_obj = seq[0];
      obj = seq[1];
    }
    if (!PyUnicode_Check(name_obj.ptr()))
      throw_error(errc::invalid_argument, what + ": item " + std::to_string(index) + ": the name is a " +
                                              py_type_name(name_obj) + ", not a str");
    std::string name = nb::cast<std::string>(name_obj);
    if (tensor_type.is_valid() && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(tensor_type.ptr())) &&
        nb::cast<bool>(obj.attr("requires_grad")))
      obj = obj.attr("detach")();
    nb::ndarray<> array;
    if (!nb::try_cast(obj, array, false))
      throw_error(errc::invalid_argument, what + ": tensor '" + name + "' is a " + py_type_name(obj) +
                                              ", which has no DLPack form (__dlpack__): pass torch tensors or "
                                              "numpy arrays");
    auto type = refit_dtype(array.dtype());
    if (!type)
      throw_error(errc::invalid_argument, what + ": tensor '" + name + "' has a dtype refit does not move (" +
                                              dlpack_dtype_name(array.dtype()) + ")");
    item it{std::move(name), {}};
    it.shape.reserve(array.ndim());
    std::int64_t expected = 1;
    bool contiguous = true;
    for (std::size_t d = array.ndim(); d-- > 0;) {
      const auto extent = static_cast<std::int64_t>(array.shape(d));
      if (extent != 1 && array.stride_ptr() && array.stride(d) != expected) contiguous = false;
      expected *= extent;
    }
    for (std::size_t d = 0; d < array.ndim(); ++d) it.shape.push_back(static_cast<std::int64_t>(array.shape(d)));
    if (expected == 0) contiguous = true;  // no element: any strides describe it
    if (!contiguous)
      throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' of shape " + shape_to_string(it.shape) +
                                              " is not contiguous: send tensor.contiguous()");
    refit::device dev;
    switch (array.device_type()) {
      case nb::device::cpu::value:
      case nb::device::cuda_host::value:
        break;
      case nb::device::cuda::value:
      case nb::device::cuda_managed::value:
        dev = refit::device::cuda(array.device_id());
        break;
      default:
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' is on a device refit does not know "
                                                "(DLPack device type " + std::to_string(array.device_type()) + ")");
    }
    auto& stored = out.items_.emplace_back(std::move(it));
    out.views_.emplace_back(stored.name, *type, std::span<const std::int64_t>(stored.shape),
                            const_cast<void*>(static_cast<const void*>(array.data())), dev);
    owners.append(obj);
    ++index;
  }
  out.owners_ = shared_object(std::move(owners));
  return out;
}

update_metadata held_tensors::metadata() const {
  update_metadata meta;
  meta.tensors.reserve(views_.size());
  for (const auto& v : views_) meta.tensors.push_back(v.spec());
  meta.validate();
  return meta;
}

nb::object python_view(const tensor_view& v, framework fw) {
  std::size_t shape[16];
  if (v.shape.size() > 16) throw_error(errc::invalid_argument, "tensor '" + std::string(v.name) + "' has over 16 dimensions");
  for (std::size_t d = 0; d < v.shape.size(); ++d) shape[d] = static_cast<std::size_t>(v.shape[d]);
  const int device_type = v.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  if (fw == framework::torch) {
    nb::ndarray<nb::pytorch> array(v.data, v.shape.size(), shape, nb::handle(), nullptr, dl_dtype(v.dtype),
                                   device_type, v.device.index);
    return array.cast(nb::rv_policy::reference);
  }
  nb::dlpack::dtype type = dl_dtype(v.dtype);
  if (v.dtype == dtype::bfloat16) type = nb::dtype<std::uint16_t>();
  if (v.dtype == dtype::float8_e4m3fn || v.dtype == dtype::float8_e5m2) type = nb::dtype<std::uint8_t>();
  if (v.dtype == dtype::bool_) type = nb::dtype<bool>();
  nb::ndarray<nb::numpy> array(v.data, v.shape.size(), shape, nb::handle(), nullptr, type, device_type,
                               v.device.index);
  return array.cast(nb::rv_policy::reference);
}

nb::list python_batch(std::span<const tensor_view> views, framework fw) {
  nb::list out;
  for (const auto& v : views) out.append(nb::make_tuple(nb::str(v.name.data(), v.name.size()), python_view(v, fw)));
  return out;
}

}  // namespace refit::py
