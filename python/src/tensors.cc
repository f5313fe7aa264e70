#include "tensors.h"

#include <nanobind/ndarray.h>

#include <refit/error.h>

namespace refit::py {

namespace {

using dl = nb::dlpack::dtype_code;

nb::dlpack::dtype dl_dtype(refit::dtype t) {
  auto make = [](dl code, int bits) {
    return nb::dlpack::dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  switch (t) {
    case dtype::bool_:
      return make(dl::Bool, 8);
    case dtype::uint8:
      return make(dl::UInt, 8);
    case dtype::int8:
      return make(dl::Int, 8);
    case dtype::int16:
      return make(dl::Int, 16);
    case dtype::int32:
      return make(dl::Int, 32);
    case dtype::int64:
      return make(dl::Int, 64);
    case dtype::float16:
      return make(dl::Float, 16);
    case dtype::bfloat16:
      return make(dl::Bfloat, 16);
    case dtype::float32:
      return make(dl::Float, 32);
    case dtype::float64:
      return make(dl::Float, 64);
    case dtype::float8_e4m3fn:
      return make(dl::Float8_E4M3FN, 8);
    case dtype::float8_e5m2:
      return make(dl::Float8_E5M2, 8);
  }
  return make(dl::UInt, 8);
}

std::optional<refit::dtype> refit_dtype(nb::dlpack::dtype d) {
  if (d.lanes != 1) return std::nullopt;
  switch (static_cast<dl>(d.code)) {
    case dl::Bool:
      if (d.bits == 8) return dtype::bool_;
      break;
    case dl::UInt:
      if (d.bits == 8) return dtype::uint8;
      break;
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
    case dl::Bfloat:
      if (d.bits == 16) return dtype::bfloat16;
      break;
    case dl::Float8_E4M3FN:
      if (d.bits == 8) return dtype::float8_e4m3fn;
      break;
    case dl::Float8_E5M2:
      if (d.bits == 8) return dtype::float8_e5m2;
      break;
    default:
      break;
  }
  return std::nullopt;
}

std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  static const char* names[] = {"int",
                                "uint",
                                "float",
                                "opaque",
                                "bfloat",
                                "complex",
                                "bool",
                                "float8_e3m4",
                                "float8_e4m3",
                                "float8_e4m3b11fnuz",
                                "float8_e4m3fn",
                                "float8_e4m3fnuz",
                                "float8_e5m2",
                                "float8_e5m2fnuz",
                                "float8_e8m0fnu",
                                "float6_e2m3fn",
                                "float6_e3m2fn",
                                "float4_e2m1fn",
                                "bcomplex"};
  std::string name = d.code < std::size(names) ? names[d.code] : "code " + std::to_string(d.code);
  if (d.code <= 6 || d.code == 18) name += std::to_string(d.bits);
  if (d.lanes != 1) name += "x" + std::to_string(d.lanes);
  return name;
}

std::string py_type_name(nb::handle o) { return nb::cast<std::string>(nb::str(nb::handle(o.type()).attr("__name__"))); }

// What the torch fast path reads, found once torch has been imported (refit never
// imports it for this). Reading a tensor's data_ptr, shape, dtype and device
// through these costs about a microsecond; its __dlpack__ (a Python method of
// torch's) several: with 10k parameters that is the difference a trainer sees.
struct torch_api {
  nb::object tensor_type, strided;
  nb::dict dtypes;  // torch.dtype -> refit dtype
  nb::object data_ptr, shape, dtype, is_contiguous, is_cuda, is_cpu, get_device, layout;
};

const torch_api* torch_fast() {
  static torch_api* api = nullptr;  // never destroyed: it would outlive the interpreter
  if (api) return api;
  nb::dict modules = nb::borrow<nb::dict>(PyImport_GetModuleDict());
  if (!modules.contains("torch")) return nullptr;
  nb::module_ torch = nb::module_::import_("torch");
  auto a = std::make_unique<torch_api>();
  a->tensor_type = torch.attr("Tensor");
  a->strided = torch.attr("strided");
  const std::pair<const char*, dtype> names[] = {{"bool", dtype::bool_},
                                                 {"uint8", dtype::uint8},
                                                 {"int8", dtype::int8},
                                                 {"int16", dtype::int16},
                                                 {"int32", dtype::int32},
                                                 {"int64", dtype::int64},
                                                 {"float16", dtype::float16},
                                                 {"bfloat16", dtype::bfloat16},
                                                 {"float32", dtype::float32},
                                                 {"float64", dtype::float64},
                                                 {"float8_e4m3fn", dtype::float8_e4m3fn},
                                                 {"float8_e5m2", dtype::float8_e5m2}};
  for (const auto& [name, type] : names)
    if (nb::hasattr(torch, name)) a->dtypes[torch.attr(name)] = nb::int_(static_cast<int>(type));
  auto intern = [](const char* n) { return nb::steal(PyUnicode_InternFromString(n)); };
  a->data_ptr = intern("data_ptr");
  a->shape = intern("shape");
  a->dtype = intern("dtype");
  a->is_contiguous = intern("is_contiguous");
  a->is_cuda = intern("is_cuda");
  a->is_cpu = intern("is_cpu");
  a->get_device = intern("get_device");
  a->layout = intern("layout");
  api = a.release();
  return api;
}

nb::object get(nb::handle o, const nb::object& name) {
  PyObject* r = PyObject_GetAttr(o.ptr(), name.ptr());
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

nb::object call(nb::handle o, const nb::object& name) {
  PyObject* r = PyObject_CallMethodNoArgs(o.ptr(), name.ptr());
  if (!r) throw nb::python_error();
  return nb::steal(r);
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

held_tensors held_tensors::from_python(nb::handle tensors, const std::string& what, tensor_cache* cache) {
  held_tensors out;
  bool all_hit = cache != nullptr;
  // The last update's entries (kept alive for the views of hits), and this one's,
  // made only when something differs.
  std::shared_ptr<const std::vector<tensor_cache::entry>> old_entries = cache ? cache->entries : nullptr;
  std::shared_ptr<std::vector<tensor_cache::entry>> new_entries;
  auto start_new_entries = [&](std::size_t upto) {
    if (new_entries || !cache) return;
    new_entries = std::make_shared<std::vector<tensor_cache::entry>>();
    if (old_entries)
      new_entries->assign(old_entries->begin(), old_entries->begin() + static_cast<std::ptrdiff_t>(upto));
  };
  nb::list owners;
  nb::object pairs = nb::borrow(tensors);
  if (PyDict_Check(tensors.ptr()) || (nb::hasattr(tensors, "items") && nb::hasattr(tensors, "keys")))
    pairs = tensors.attr("items")();
  const torch_api* api = torch_fast();
  std::size_t index = 0;
  for (nb::handle pair : pairs) {
    nb::object name_obj, obj;
    if (PyTuple_Check(pair.ptr()) && PyTuple_GET_SIZE(pair.ptr()) == 2) {
      name_obj = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 0));
      obj = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 1));
    } else {
      nb::sequence seq = nb::borrow<nb::sequence>(pair);
      if (nb::len(seq) != 2)
        throw_error(errc::invalid_argument, what + ": item " + std::to_string(index) + " is not a (name, tensor) pair");
      name_obj = seq[0];
      obj = seq[1];
    }
    if (!PyUnicode_Check(name_obj.ptr()))
      throw_error(errc::invalid_argument, what + ": item " + std::to_string(index) + ": the name is a " +
                                              py_type_name(name_obj) + ", not a str");
    // A torch tensor as the cache saw it: a handful of reads, nothing rebuilt.
    const bool is_torch = api && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(api->tensor_type.ptr()));
    if (is_torch && old_entries && index < old_entries->size()) {
      const auto& e = (*old_entries)[index];
      Py_ssize_t length = 0;
      const char* utf8 = PyUnicode_AsUTF8AndSize(name_obj.ptr(), &length);
      if (!utf8) throw nb::python_error();
      bool hit = std::string_view(utf8, static_cast<std::size_t>(length)) == e.name &&
                 get(obj, api->dtype).ptr() == e.torch_dtype &&
                 PyLong_AsVoidPtr(call(obj, api->data_ptr).ptr()) == e.data &&
                 get(obj, api->is_cuda).is(nb::handle(e.device.is_cuda() ? Py_True : Py_False));
      if (hit) {
        nb::object shape = get(obj, api->shape);
        const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
        hit = static_cast<std::size_t>(ndim) == e.shape.size();
        for (Py_ssize_t d = 0; hit && d < ndim; ++d)
          hit = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d)) == e.shape[static_cast<std::size_t>(d)];
        hit = hit && call(obj, api->is_contiguous).is(nb::handle(Py_True));
      }
      if (hit) {
        out.views_.emplace_back(e.name, e.type, std::span<const std::int64_t>(e.shape), e.data, e.device);
        owners.append(obj);
        if (new_entries) new_entries->push_back(e);
        ++cache->hits;
        ++index;
        continue;
      }
    }
    all_hit = false;
    start_new_entries(index);
    std::string name = nb::cast<std::string>(name_obj);
    item it{std::move(name), {}};
    PyObject* seen_dtype = nullptr;
    refit::dtype type{};
    refit::device dev;
    void* data = nullptr;
    if (is_torch) {
      // A torch tensor: its own accessors (no detach needed, nothing is exported).
      if (!get(obj, api->layout).is(api->strided))
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' has layout " +
                                                nb::cast<std::string>(nb::str(get(obj, api->layout))) +
                                                "; refit moves dense (strided) tensors");
      nb::object torch_dtype = get(obj, api->dtype);
      PyObject* code = PyDict_GetItemWithError(api->dtypes.ptr(), torch_dtype.ptr());
      if (!code)
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' has a dtype refit does not move (" +
                                                nb::cast<std::string>(nb::str(torch_dtype)) + ")");
      type = static_cast<refit::dtype>(PyLong_AsLong(code));
      seen_dtype = torch_dtype.ptr();
      nb::object shape = get(obj, api->shape);
      const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
      it.shape.reserve(static_cast<std::size_t>(ndim));
      for (Py_ssize_t d = 0; d < ndim; ++d) it.shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d)));
      if (!call(obj, api->is_contiguous).is(nb::handle(Py_True)))
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' of shape " + shape_to_string(it.shape) +
                                                " is not contiguous: send tensor.contiguous()");
      if (get(obj, api->is_cuda).is(nb::handle(Py_True))) {
        dev = refit::device::cuda(static_cast<int>(PyLong_AsLong(call(obj, api->get_device).ptr())));
      } else if (!get(obj, api->is_cpu).is(nb::handle(Py_True))) {
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' is on " +
                                                nb::cast<std::string>(nb::str(obj.attr("device"))) +
                                                "; refit moves host and CUDA tensors");
      }
      data = PyLong_AsVoidPtr(call(obj, api->data_ptr).ptr());
    } else {
      nb::ndarray<> array;
      if (!nb::try_cast(obj, array, false))
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' is a " + py_type_name(obj) +
                                                ", which has no DLPack form (__dlpack__): pass torch tensors or "
                                                "numpy arrays");
      auto t = refit_dtype(array.dtype());
      if (!t)
        throw_error(errc::invalid_argument, what + ": tensor '" + it.name + "' has a dtype refit does not move (" +
                                                dlpack_dtype_name(array.dtype()) + ")");
      type = *t;
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
      switch (array.device_type()) {
        case nb::device::cpu::value:
        case nb::device::cuda_host::value:
          break;
        case nb::device::cuda::value:
        case nb::device::cuda_managed::value:
          dev = refit::device::cuda(array.device_id());
          break;
        default:
          throw_error(errc::invalid_argument, what + ": tensor '" + it.name +
                                                  "' is on a device refit does not know "
                                                  "(DLPack device type " +
                                                  std::to_string(array.device_type()) + ")");
      }
      data = const_cast<void*>(static_cast<const void*>(array.data()));
    }
    auto& stored = out.items_.emplace_back(std::move(it));
    out.views_.emplace_back(stored.name, type, std::span<const std::int64_t>(stored.shape), data, dev);
    owners.append(obj);
    if (new_entries) {
      auto& e = new_entries->emplace_back();
      e.name = stored.name;
      e.torch_dtype = seen_dtype;  // null for non-torch: never a hit
      e.type = type;
      e.shape = stored.shape;
      e.device = dev;
      e.data = data;
      ++cache->misses;
    }
    ++index;
  }
  out.owners_ = shared_object(std::move(owners));
  if (cache) {
    out.cached_entries_ = old_entries;  // hits' views point into it
    if (all_hit && old_entries && old_entries->size() == index && cache->meta) {
      out.cached_meta_ = cache->meta;
    } else {
      start_new_entries(index);  // fewer tensors than last time, all of them hits
      cache->entries = std::move(new_entries);
      cache->meta = std::make_shared<const update_metadata>(out.metadata());
      out.cached_meta_ = cache->meta;
    }
  }
  return out;
}

std::shared_ptr<const update_metadata> held_tensors::shared_metadata() const {
  if (cached_meta_) return cached_meta_;
  return std::make_shared<const update_metadata>(metadata());
}

update_metadata held_tensors::metadata() const {
  if (cached_meta_) return *cached_meta_;
  update_metadata meta;
  meta.tensors.reserve(views_.size());
  for (const auto& v : views_) meta.tensors.push_back(v.spec());
  meta.validate();
  return meta;
}

nb::object python_view(const tensor_view& v, framework fw) {
  std::size_t shape[16];
  if (v.shape.size() > 16)
    throw_error(errc::invalid_argument, "tensor '" + std::string(v.name) + "' has over 16 dimensions");
  for (std::size_t d = 0; d < v.shape.size(); ++d) shape[d] = static_cast<std::size_t>(v.shape[d]);
  const int device_type = v.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  if (fw == framework::torch) {
    nb::ndarray<nb::pytorch> array(v.data, v.shape.size(), shape, nb::handle(), nullptr, dl_dtype(v.dtype), device_type,
                                   v.device.index);
    return array.cast(nb::rv_policy::reference);
  }
  nb::dlpack::dtype type = dl_dtype(v.dtype);
  if (v.dtype == dtype::bfloat16) type = nb::dtype<std::uint16_t>();
  if (v.dtype == dtype::float8_e4m3fn || v.dtype == dtype::float8_e5m2) type = nb::dtype<std::uint8_t>();
  if (v.dtype == dtype::bool_) type = nb::dtype<bool>();
  nb::ndarray<nb::numpy> array(v.data, v.shape.size(), shape, nb::handle(), nullptr, type, device_type, v.device.index);
  return array.cast(nb::rv_policy::reference);
}

nb::list python_batch(std::span<const tensor_view> views, framework fw) {
  nb::list out;
  for (const auto& v : views) out.append(nb::make_tuple(nb::str(v.name.data(), v.name.size()), python_view(v, fw)));
  return out;
}

}  // namespace refit::py
