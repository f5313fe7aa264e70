#include <refit/cuda/nccl_error.h>

#include <string>

#include <refit/cuda/error.h>

namespace refit::cuda {
namespace {

class nccl_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "refit.nccl"; }
  std::string message(int value) const override {
    // Needs no device; unknown values give NCCL's "unknown result code".
    return ncclGetErrorString(static_cast<ncclResult_t>(value));
  }
};

std::string describe(ncclResult_t result, std::string_view call, std::string_view last_error,
                     const std::source_location& where) {
  std::string status = nccl_result_name(result);
  if (!last_error.empty()) {
    status += "; NCCL: ";
    status += last_error;
  }
  return describe_failed_call(call, where, status);
}

// NCCL's last-error text ends in a newline in some releases.
std::string_view trimmed(const char* text) {
  std::string_view s = text == nullptr ? std::string_view{} : std::string_view(text);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.remove_suffix(1);
  return s;
}

}  // namespace

const std::error_category& nccl_category() noexcept {
  static const nccl_category_impl category;
  return category;
}

std::error_code make_error_code(ncclResult_t result) noexcept { return {static_cast<int>(result), nccl_category()}; }

std::string nccl_result_name(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      break;
  }
  return "ncclResult_t(" + std::to_string(static_cast<int>(result)) + ")";
}

nccl_error::nccl_error(ncclResult_t result, std::string_view call, std::string_view last_error,
                       std::source_location where)
    : std::system_error(make_error_code(result), describe(result, call, last_error, where)), call_(call),
      last_error_(last_error) {}

void throw_nccl_error(ncclResult_t result, std::string_view call, ncclComm_t comm, std::source_location where) {
  throw nccl_error(result, call, trimmed(ncclGetLastError(comm)), where);
}

}  // namespace refit::cuda
