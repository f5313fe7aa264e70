#include <refit/engines/cuda_ipc/torch_ipc.h>

#include <cctype>
#include <cstring>
#include <limits>
#include <span>

#include <refit/backend/hex.h>

namespace refit::cuda_ipc {
namespace {

// Row-major contiguous: every dimension longer than 1 has the stride of the
// dimensions after it (torch's is_contiguous()).
bool contiguous(std::span<const std::int64_t> shape, std::span<const std::int64_t> stride) {
  std::int64_t expected = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 0) return true;  // no elements: any strides
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// PyTorch's handles come in two forms:
//   older torch (1.13)  the 64-byte cudaIpcMemHandle_t of the allocation
//   torch 2.x           CUDACachingAllocator::shareIpcHandle's string: a version
//                       byte (1, 2, 3 so far), a type byte, then for 'c' (a
//                       cudaMalloc block) the 64-byte cudaIpcMemHandle_t; 'e' is an
//                       expandable segment (another kind of handle, not opened).
// Both carry the storage's offset in the allocation in storage_offset_bytes.
void read_handle(const std::string& hex, handle_bytes& out, json_reader& e, const tensor_spec& spec) {
  const std::string where = "member '" + e.member_path("handle") + "' of tensor '" + spec.name + "'";
  if (!is_hex(hex)) e.fail(where + " must be hex digits (a CUDA IPC handle), got " + describe_json(json(hex)));
  std::vector<std::byte> bytes(hex.size() / 2);
  from_hex(hex, bytes);
  constexpr std::size_t raw = sizeof(handle_bytes);
  if (bytes.size() == raw) {
    std::memcpy(out.data(), bytes.data(), raw);
    return;
  }
  const char type = bytes.size() >= 2 ? static_cast<char>(bytes[1]) : '\0';
  if (type == 'e')
    e.fail(where +
           " is an expandable-segment handle (PyTorch's expandable_segments allocator), which refit "
           "does not open: run the trainer without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
  if (bytes.size() != raw + 2 || type != 'c')
    e.fail(where + " is " + std::to_string(bytes.size()) +
           " bytes: expected a 64-byte cudaIpcMemHandle_t, or "
           "PyTorch's shareable handle (a version byte, 'c', then the 64-byte cudaIpcMemHandle_t)");
  std::memcpy(out.data(), bytes.data() + 2, raw);
}

torch_tensor_handle read_entry(const json& value, const tensor_spec& spec, const std::string& context,
                               const std::string& path) {
  if (!value.is_object())
    throw_error(errc::invalid_argument,
                context + ": member '" + path + "' must be an object, got " + describe_json(value));
  json_reader e(value, context, path);
  torch_tensor_handle h;
  const auto hex = e.required<std::string>("handle");
  read_handle(hex, h.handle, e, spec);
  h.storage_offset_bytes = e.required<std::uint64_t>("storage_offset_bytes");
  h.storage_bytes = e.required<std::uint64_t>("storage_bytes");
  const auto offset = e.required<std::uint64_t>("offset");
  const auto size = e.required<std::vector<std::int64_t>>("size");
  const auto stride = e.required<std::vector<std::int64_t>>("stride");
  e.finish();

  const std::string tensor = "tensor '" + spec.name + "'";
  if (size != spec.shape)
    e.fail(tensor + ": member '" + e.member_path("size") + "' is " + shape_to_string(size) +
           " but its declared shape is " + shape_to_string(spec.shape) + " (are ipc_handles in 'names' order?)");
  if (stride.size() != size.size())
    e.fail(tensor + ": member '" + e.member_path("stride") + "' has " + std::to_string(stride.size()) +
           " dimensions, its size " + std::to_string(size.size()));
  if (!contiguous(size, stride))
    e.fail(tensor + " is not contiguous (size " + shape_to_string(size) + ", stride " + shape_to_string(stride) +
           "): send t.contiguous() instead");
  const std::uint64_t element = element_size(spec.dtype);
  const std::uint64_t nbytes = spec.nbytes();
  if (offset > (std::numeric_limits<std::uint64_t>::max() - nbytes) / element ||
      offset * element + nbytes > h.storage_bytes)
    e.fail(tensor + ": " + std::to_string(nbytes) + " bytes at element offset " + std::to_string(offset) +
           " do not fit in its storage of " + std::to_string(h.storage_bytes) + " bytes");
  h.offset_bytes = offset * element;
  if (h.storage_offset_bytes > std::numeric_limits<std::uint64_t>::max() - h.storage_bytes)
    e.fail(tensor + ": storage_offset_bytes " + std::to_string(h.storage_offset_bytes) + " is out of range");
  return h;
}

}  // namespace

std::string format_gpu_uuid(const gpu_uuid& uuid) {
  const std::string h = to_hex(uuid);  // 8-4-4-4-12 digits
  return "GPU-" + h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) + "-" +
         h.substr(20);
}

gpu_uuid parse_gpu_uuid(std::string_view text, const std::string& what) {
  std::string_view rest = text;
  if (rest.size() >= 4 && std::toupper(static_cast<unsigned char>(rest[0])) == 'G' &&
      std::toupper(static_cast<unsigned char>(rest[1])) == 'P' &&
      std::toupper(static_cast<unsigned char>(rest[2])) == 'U' && rest[3] == '-')
    rest.remove_prefix(4);
  std::string digits;
  for (char c : rest)
    if (c != '-') digits += c;
  gpu_uuid out{};
  if (!from_hex(digits, out))
    throw_error(errc::invalid_argument, what + ": '" + valid_utf8(text.substr(0, 80)) +
                                            "' is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)");
  return out;
}

torch_handle_table read_torch_handles(json_reader& r, const update_metadata& meta) {
  const json all = r.required<json>("ipc_handles");
  const std::string path = r.member_path("ipc_handles");
  if (!all.is_array())
    r.fail("member '" + path + "' must be an array (one object per tensor), got " + describe_json(all));
  if (all.size() != meta.tensors.size())
    r.fail("member '" + path + "' has " + std::to_string(all.size()) + " entries for " +
           std::to_string(meta.tensors.size()) + " tensors (one per name, in 'names' order)");
  torch_handle_table table(all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto& spec = meta.tensors[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    const json& by_gpu = all[i];
    if (!by_gpu.is_object() || by_gpu.empty())
      r.fail("member '" + at + "' (tensor '" + spec.name + "') must be a non-empty object keyed by GPU UUID, got " +
             describe_json(by_gpu));
    for (const auto& [key, value] : by_gpu.items()) {
      auto h = read_entry(value, spec, r.context(), at + "." + key);
      h.gpu = parse_gpu_uuid(key, r.context() + ": member '" + at + "' (tensor '" + spec.name + "')");
      table[i].push_back(h);
    }
  }
  return table;
}

const torch_tensor_handle& pick_handle(const std::vector<torch_tensor_handle>& offered, const gpu_uuid& mine,
                                       const tensor_spec& tensor) {
  for (const auto& h : offered)
    if (h.gpu == mine) return h;
  if (offered.size() == 1) return offered.front();
  std::string gpus;
  for (const auto& h : offered) gpus += (gpus.empty() ? "" : ", ") + format_gpu_uuid(h.gpu);
  throw_error(errc::invalid_argument, "torch_ipc: tensor '" + tensor.name + "' is offered on " + gpus +
                                          ", none of them this worker's " + format_gpu_uuid(mine));
}

}  // namespace refit::cuda_ipc
