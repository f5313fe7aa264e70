#include <refit/cuda/error.h>

#include <string>

namespace refit::cuda {
namespace {

class cuda_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "refit.cuda"; }

  std::string message(int value) const override {
    // cudaGetErrorString needs no device or driver, and answers unknown values
    // with "unrecognized error code" instead of failing.
    return cudaGetErrorString(static_cast<cudaError_t>(value));
  }
};

}  // namespace

std::string describe_failed_call(std::string_view call, const std::source_location& where, std::string_view status) {
  std::string text(call);
  text += " failed at ";
  text += where.file_name();
  text += ':';
  text += std::to_string(where.line());
  text += " (";
  text += status;
  text += ')';
  return text;  // std::system_error appends ": " and the category's message.
}

const std::error_category& cuda_category() noexcept {
  static const cuda_category_impl category;
  return category;
}

std::error_code make_error_code(cudaError_t status) noexcept { return {static_cast<int>(status), cuda_category()}; }

cuda_error::cuda_error(cudaError_t status, std::string_view call, std::source_location where)
    : std::system_error(make_error_code(status), describe_failed_call(call, where, cudaGetErrorName(status))),
      call_(call) {}

void throw_cuda_error(cudaError_t status, std::string_view call, std::source_location where) {
  (void)cudaGetLastError();
  throw cuda_error(status, call, where);
}

}  // namespace refit::cuda
