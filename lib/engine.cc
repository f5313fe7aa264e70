#include <refit/engine.h>

#include <refit/error.h>

namespace refit {

std::vector<std::pair<std::string, std::uint64_t>> model_target::fingerprint(const std::vector<std::string>&) {
  throw_error(errc::unsupported, "this model target offers no weight fingerprint");
}

void model_target::read_back(const tensor_spec& spec, std::span<std::byte>) {
  throw_error(errc::unsupported, "this model target cannot read back '" + spec.name + "'");
}

void model_target::exchange(std::span<const tensor_view>) {
  throw_error(errc::unsupported, "this model target cannot exchange its bytes with a stage");
}

json engine_capabilities::to_json() const {
  return {{"direct_receive", direct_receive},
          {"staged_commit", staged_commit},
          {"checksums", checksums},
          {"device_memory", device_memory},
          {"relay", relay},
          {"sharded", sharded},
          {"defers_processing", defers_processing},
          {"needs_gpu", needs_gpu},
          {"opt_in_build", opt_in_build}};
}

weight_transfer_engine::~weight_transfer_engine() = default;

}  // namespace refit
