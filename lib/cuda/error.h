// CUDA runtime errors as refit exceptions.
#pragma once

#include <cuda_runtime_api.h>

#include <source_location>
#include <string>
#include <string_view>
#include <system_error>

namespace refit::cuda {

// The "refit.cuda" category: values are cudaError_t codes and messages are the CUDA
// runtime's own strings, so a CUDA failure travels as an ordinary std::error_code
// and can be compared against make_error_code(cudaErrorXxx).
[[nodiscard]] const std::error_category& cuda_category() noexcept;

// cudaError_t is a C enum we do not own, so it is not registered with
// std::is_error_code_enum (another library may do that); convert explicitly.
[[nodiscard]] std::error_code make_error_code(cudaError_t status) noexcept;

// A failed CUDA runtime call. what() names the call, where it was made, the CUDA
// error name and its description, e.g.
//   "cudaMalloc(&p, n) failed at lib/cuda/staging.cc:12 (cudaErrorMemoryAllocation): out of memory"
// so a log line alone says which call failed and why.
class cuda_error : public std::system_error {
 public:
  cuda_error(cudaError_t status, std::string_view call, std::source_location where = std::source_location::current());

  // The CUDA status, without going through std::error_code.
  [[nodiscard]] cudaError_t status() const noexcept { return static_cast<cudaError_t>(code().value()); }

  // The failing call as written in the source (REFIT_CUDA_CHECK's argument).
  [[nodiscard]] const std::string& call() const noexcept { return call_; }

 private:
  std::string call_;
};

// "<call> failed at <file>:<line> (<status>)": the start of every CUDA-layer
// failure's what() (CUDA and NCCL); std::system_error appends the description.
[[nodiscard]] std::string describe_failed_call(std::string_view call, const std::source_location& where,
                                               std::string_view status);

// Throws cuda_error for a failed call. It first clears the runtime's last-error
// slot, so that a later cudaGetLastError() after a kernel launch does not report
// this, already handled, failure again. Out of line to keep the check's hot path small.
[[noreturn]] void throw_cuda_error(cudaError_t status, std::string_view call, std::source_location where);

}  // namespace refit::cuda

// Evaluates `call` (an expression yielding cudaError_t) once and throws
// refit::cuda::cuda_error naming the call and this source line unless it returned
// cudaSuccess.
#define REFIT_CUDA_CHECK(call)                                                                       \
  do {                                                                                               \
    const ::cudaError_t refit_cuda_status_ = (call);                                                 \
    if (refit_cuda_status_ != ::cudaSuccess) [[unlikely]]                                            \
      ::refit::cuda::throw_cuda_error(refit_cuda_status_, #call, ::std::source_location::current()); \
  } while (false)
