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

// from_python's steps, for one item each.

// A mapping's items(), or the iterable of (name, tensor) pairs itself.
nb::object pairs_of(nb::handle tensors) {
  if (PyDict_Check(tensors.ptr()) || (nb::hasattr(tensors, "items") && nb::hasattr(tensors, "keys")))
    return tensors.attr("items")();
  return nb::borrow(tensors);
}

// Item `index`'s name (a str) and tensor.
std::pair<nb::object, nb::object> name_and_tensor(nb::handle pair, const std::string& what, std::size_t index) {
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
    throw_error(errc::invalid_argument,
                what + ": item " + std::to_string(index) + ": the name is a " + py_type_name(name_obj) + ", not a str");
  return {std::move(name_obj), std::move(obj)};
}

// Whether a torch tensor reads as the cache's entry for its place: the same name,
// dtype, data pointer, device, shape and contiguity.
bool reads_as(nb::handle name_obj, nb::handle obj, const torch_api& api, const tensor_cache::entry& e) {
  Py_ssize_t length = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(name_obj.ptr(), &length);
  if (!utf8) throw nb::python_error();
  if (!(std::string_view(utf8, static_cast<std::size_t>(length)) == e.name &&
        get(obj, api.dtype).ptr() == e.torch_dtype && PyLong_AsVoidPtr(call(obj, api.data_ptr).ptr()) == e.data &&
        get(obj, api.is_cuda).is(nb::handle(e.device.is_cuda() ? Py_True : Py_False))))
    return false;
  nb::object shape = get(obj, api.shape);
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.ptr());
  bool hit = static_cast<std::size_t>(ndim) == e.shape.size();
  for (Py_ssize_t d = 0; hit && d < ndim; ++d)
    hit = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d)) == e.shape[static_cast<std::size_t>(d)];
  return hit && call(obj, api.is_contiguous).is(nb::handle(Py_True));
}

// What refit reads of a tensor besides its shape.
struct tensor_facts {
  refit::dtype type{};
  refit::device dev;
  void* data = nullptr;
  PyObject* torch_dtype = nullptr;  // a torch tensor's (the cache's key); null for others
};

// A torch tensor, through its own accessors (no detach needed, nothing is
// exported); its shape into `shape`.
tensor_facts read_torch(nb::handle obj, const torch_api& api, const std::string& what, const std::string& name,
                        std::vector<std::int64_t>& shape) {
  tensor_facts f;
  if (!get(obj, api.layout).is(api.strided))
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' has layout " +
                                            nb::cast<std::string>(nb::str(get(obj, api.layout))) +
                                            "; refit moves dense (strided) tensors");
  nb::object torch_dtype = get(obj, api.dtype);
  PyObject* code = PyDict_GetItemWithError(api.dtypes.ptr(), torch_dtype.ptr());
  if (!code)
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' has a dtype refit does not move (" +
                                            nb::cast<std::string>(nb::str(torch_dtype)) + ")");
  f.type = static_cast<refit::dtype>(PyLong_AsLong(code));
  f.torch_dtype = torch_dtype.ptr();
  nb::object sizes = get(obj, api.shape);
  const Py_ssize_t ndim = PyTuple_GET_SIZE(sizes.ptr());
  shape.reserve(static_cast<std::size_t>(ndim));
  for (Py_ssize_t d = 0; d < ndim; ++d) shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(sizes.ptr(), d)));
  if (!call(obj, api.is_contiguous).is(nb::handle(Py_True)))
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' of shape " + shape_to_string(shape) +
                                            " is not contiguous: send tensor.contiguous()");
  if (get(obj, api.is_cuda).is(nb::handle(Py_True))) {
    f.dev = refit::device::cuda(static_cast<int>(PyLong_AsLong(call(obj, api.get_device).ptr())));
  } else if (!get(obj, api.is_cpu).is(nb::handle(Py_True))) {
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' is on " +
                                            nb::cast<std::string>(nb::str(obj.attr("device"))) +
                                            "; refit moves host and CUDA tensors");
  }
  f.data = PyLong_AsVoidPtr(call(obj, api.data_ptr).ptr());
  return f;
}

// Any other tensor, through DLPack; its shape into `shape`.
tensor_facts read_dlpack(nb::handle obj, const std::string& what, const std::string& name,
                         std::vector<std::int64_t>& shape) {
  tensor_facts f;
  nb::ndarray<> array;
  if (!nb::try_cast(obj, array, false))
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' is a " + py_type_name(obj) +
                                            ", which has no DLPack form (__dlpack__): pass torch tensors or "
                                            "numpy arrays");
  auto t = refit_dtype(array.dtype());
  if (!t)
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' has a dtype refit does not move (" +
                                            dlpack_dtype_name(array.dtype()) + ")");
  f.type = *t;
  shape.reserve(array.ndim());
  std::int64_t expected = 1;
  bool contiguous = true;
  for (std::size_t d = array.ndim(); d-- > 0;) {
    const auto extent = static_cast<std::int64_t>(array.shape(d));
    if (extent != 1 && array.stride_ptr() && array.stride(d) != expected) contiguous = false;
    expected *= extent;
  }
  for (std::size_t d = 0; d < array.ndim(); ++d) shape.push_back(static_cast<std::int64_t>(array.shape(d)));
  if (expected == 0) contiguous = true;  // no element: any strides describe it
  if (!contiguous)
    throw_error(errc::invalid_argument, what + ": tensor '" + name + "' of shape " + shape_to_string(shape) +
                                            " is not contiguous: send tensor.contiguous()");
  switch (array.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      f.dev = refit::device::cuda(array.device_id());
      break;
    default:
      throw_error(errc::invalid_argument, what + ": tensor '" + name +
                                              "' is on a device refit does not know "
                                              "(DLPack device type " +
                                              std::to_string(array.device_type()) + ")");
  }
  f.data = const_cast<void*>(static_cast<const void*>(array.data()));
  return f;
}

// The cache's side of one from_python: the last update's entries (kept alive for
// the views of hits), and this one's, made only once something differs.
struct cache_pass {
  explicit cache_pass(tensor_cache* c) : cache(c), old_entries(c ? c->entries : nullptr), all_hit(c != nullptr) {}

  // The last update's entry for item `index`, if any.
  const tensor_cache::entry* previous(std::size_t index) const {
    return old_entries && index < old_entries->size() ? &(*old_entries)[index] : nullptr;
  }
  void hit(const tensor_cache::entry& e) {
    if (new_entries) new_entries->push_back(e);
    ++cache->hits;
  }
  // Item `index` is not as cached: this update's entries start from the earlier ones.
  void differs(std::size_t index) {
    all_hit = false;
    start_new_entries(index);
  }
  void miss(const std::string& name, const std::vector<std::int64_t>& shape, const tensor_facts& f) {
    if (!new_entries) return;
    auto& e = new_entries->emplace_back();
    e.name = name;
    e.torch_dtype = f.torch_dtype;  // null for non-torch: never a hit
    e.type = f.type;
    e.shape = shape;
    e.device = f.dev;
    e.data = f.data;
    ++cache->misses;
  }
  void start_new_entries(std::size_t upto) {
    if (new_entries || !cache) return;
    new_entries = std::make_shared<std::vector<tensor_cache::entry>>();
    if (old_entries)
      new_entries->assign(old_entries->begin(), old_entries->begin() + static_cast<std::ptrdiff_t>(upto));
  }

  tensor_cache* cache;
  std::shared_ptr<const std::vector<tensor_cache::entry>> old_entries;
  std::shared_ptr<std::vector<tensor_cache::entry>> new_entries;
  bool all_hit;
};

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
  cache_pass pass(cache);
  nb::list owners;
  nb::object pairs = pairs_of(tensors);
  const torch_api* api = torch_fast();
  std::size_t index = 0;
  for (nb::handle pair : pairs) {
    auto [name_obj, obj] = name_and_tensor(pair, what, index);
    // A torch tensor as the cache saw it: a handful of reads, nothing rebuilt.
    const bool is_torch = api && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(api->tensor_type.ptr()));
    const tensor_cache::entry* e = is_torch ? pass.previous(index) : nullptr;
    if (e && reads_as(name_obj, obj, *api, *e)) {
      out.views_.emplace_back(e->name, e->type, std::span<const std::int64_t>(e->shape), e->data, e->device);
      owners.append(obj);
      pass.hit(*e);
      ++index;
      continue;
    }
    pass.differs(index);
    item it{nb::cast<std::string>(name_obj), {}};
    const tensor_facts f =
        is_torch ? read_torch(obj, *api, what, it.name, it.shape) : read_dlpack(obj, what, it.name, it.shape);
    auto& stored = out.items_.emplace_back(std::move(it));
    out.views_.emplace_back(stored.name, f.type, std::span<const std::int64_t>(stored.shape), f.data, f.dev);
    owners.append(obj);
    pass.miss(stored.name, stored.shape, f);
    ++index;
  }
  out.owners_ = shared_object(std::move(owners));
  if (cache) {
    out.cached_entries_ = pass.old_entries;  // hits' views point into it
    if (pass.all_hit && pass.old_entries && pass.old_entries->size() == index && cache->meta) {
      out.cached_meta_ = cache->meta;
    } else {
      pass.start_new_entries(index);  // fewer tensors than last time, all of them hits
      cache->entries = std::move(pass.new_entries);
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
