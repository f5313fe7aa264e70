#include <refit/model/tensor_memory.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include <refit/error.h>

namespace refit {

std::byte* host_tensor_memory::allocate_zeroed(std::uint64_t bytes) {
  const std::uint64_t rounded = std::max<std::uint64_t>(64, (bytes + 63) / 64 * 64);
  if (rounded < bytes)
    throw_error(errc::resource_exhausted, "host tensor memory: cannot allocate " + std::to_string(bytes) + " bytes");
  void* p = std::aligned_alloc(64, static_cast<std::size_t>(rounded));
  if (!p)
    throw_error(errc::resource_exhausted, "host tensor memory: cannot allocate " + std::to_string(rounded) + " bytes");
  std::memset(p, 0, static_cast<std::size_t>(rounded));
  return static_cast<std::byte*>(p);
}

void host_tensor_memory::release(std::byte* p) noexcept { std::free(p); }

void host_tensor_memory::copy_in(std::byte* dst, const tensor_view& src) {
  if (!src.device.is_cpu())
    throw_error(errc::unsupported, "host tensor memory: tensor '" + std::string(src.name) + "' is on " +
                                       to_string(src.device) + ", this memory copies host tensors only");
  const std::uint64_t n = src.nbytes();
  if (n != 0) std::memcpy(dst, src.data, static_cast<std::size_t>(n));
}

void host_tensor_memory::copy_out(std::span<std::byte> host, const std::byte* src) {
  if (!host.empty()) std::memcpy(host.data(), src, host.size());
}

std::shared_ptr<tensor_memory> host_memory() {
  static const std::shared_ptr<tensor_memory> memory = std::make_shared<host_tensor_memory>();
  return memory;
}

}  // namespace refit
