// Builds without CUDA: a ucx worker receives on the host only.
#include "device_memory.h"  // private to this engine

#include <refit/error.h>

namespace refit::ucx {

std::string device_memory_unavailable() {
  return "this build has no CUDA (build with --config=cuda --config=ucx to receive into device memory)";
}

std::shared_ptr<std::byte> allocate_device(const refit::device& where, std::uint64_t) {
  throw_error(errc::unsupported,
              "ucx: cannot allocate memory on " + to_string(where) + ": " + device_memory_unavailable());
}

}  // namespace refit::ucx
