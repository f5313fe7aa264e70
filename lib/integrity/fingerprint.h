// Weight fingerprints: a 64-bit digest per tensor of its name, dtype, shape and
// bytes, so a trainer can check that a worker holds exactly its weights (as vLLM's
// weight checker does) without moving them again. Both sides compute them the same
// way; the worker answers the control call weight_fingerprint with them.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <refit/json.h>
#include <refit/tensor.h>

namespace refit {

/// Name of the algorithm, reported next to fingerprints so both sides can check
/// they speak the same one.
inline constexpr const char* fingerprint_algorithm = "xxh3-64/refit-1";

/// XXH3-64 of the tensor's bytes, seeded with a digest of its name, dtype and
/// shape. Host tensors only (unsupported for device tensors: a device model target
/// computes its own, e.g. on a host copy).
std::uint64_t fingerprint(const tensor_view& tensor);

using fingerprint_list = std::vector<std::pair<std::string, std::uint64_t>>;

/// Fingerprints of `tensors`, those named in `names` when it is non-empty (an
/// unknown name is invalid_argument).
fingerprint_list fingerprint_all(std::span<const tensor_view> tensors, const std::vector<std::string>& names = {});

/// {"algorithm": ..., "tensors": {name: "<16 hex digits>"}}.
json fingerprints_to_json(const fingerprint_list& list);
/// The inverse; invalid_argument on a malformed answer, another algorithm or an
/// unknown member. Also reads the worker's whole weight_fingerprint answer: its
/// "weight_version" (int or null) and "state" (string) are accepted and ignored.
fingerprint_list fingerprints_from_json(const json& j);

/// Differences between what the trainer expects and what a worker reported, one
/// readable line each (missing, unexpected, differs); empty when they agree.
std::vector<std::string> compare_fingerprints(const fingerprint_list& expected, const fingerprint_list& got);

}  // namespace refit
