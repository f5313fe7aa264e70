// NCCL errors as refit exceptions, the counterpart of error.h for ncclResult_t.
#pragma once

#include <nccl.h>

#include <source_location>
#include <string>
#include <string_view>
#include <system_error>

namespace refit::cuda {

/// The "refit.nccl" category: values are ncclResult_t codes, messages are
/// ncclGetErrorString's.
[[nodiscard]] const std::error_category& nccl_category() noexcept;

[[nodiscard]] std::error_code make_error_code(ncclResult_t result) noexcept;

/// "ncclInvalidArgument", ...; "ncclResult_t(<n>)" for a value this build does not
/// know.
[[nodiscard]] std::string nccl_result_name(ncclResult_t result);

/// A failed NCCL call. what() names the call, where it was made, the result's name,
/// NCCL's own detail for the failure (ncclGetLastError: "Invalid config blocking
/// attribute value -1", "Cuda failure 'out of memory'", ...) when it has one, and
/// the result's description, e.g.
///   "ncclCommInitRank(&comm, 2, id, 5) failed at lib/x.cc:9 (ncclInvalidArgument;
///    NCCL: Invalid rank requested : 5/2): invalid argument (run with NCCL_DEBUG=WARN
///    for details)"
class nccl_error : public std::system_error {
 public:
  nccl_error(ncclResult_t result, std::string_view call, std::string_view last_error = {},
             std::source_location where = std::source_location::current());

  [[nodiscard]] ncclResult_t result() const noexcept { return static_cast<ncclResult_t>(code().value()); }
  /// The failing call as written in the source.
  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  /// ncclGetLastError's text at the time of the failure (may be empty).
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }

 private:
  std::string call_;
  std::string last_error_;
};

/// Throws nccl_error for `result`, with ncclGetLastError(comm)'s text (comm may be
/// null). Out of line to keep the check's hot path small.
[[noreturn]] void throw_nccl_error(ncclResult_t result, std::string_view call, ncclComm_t comm,
                                   std::source_location where);

}  // namespace refit::cuda

// Evaluates `call` (an expression yielding ncclResult_t) once and throws
// refit::cuda::nccl_error naming the call and this line unless it returned
// ncclSuccess or ncclInProgress. ncclInProgress is not a failure: a non-blocking
// communicator (the kind refit uses, so that a dead peer can be aborted) answers it
// for work that was accepted and is still running; its outcome is polled with
// ncclCommGetAsyncError. Code that must see ncclInProgress compares the result itself.
#define REFIT_NCCL_CHECK(call) REFIT_NCCL_CHECK_COMM(nullptr, call)

// As REFIT_NCCL_CHECK, taking NCCL's last-error text for communicator `comm`.
#define REFIT_NCCL_CHECK_COMM(comm, call)                                                                    \
  do {                                                                                                       \
    const ::ncclResult_t refit_nccl_result_ = (call);                                                        \
    if (refit_nccl_result_ != ::ncclSuccess && refit_nccl_result_ != ::ncclInProgress) [[unlikely]]          \
      ::refit::cuda::throw_nccl_error(refit_nccl_result_, #call, (comm), ::std::source_location::current()); \
  } while (false)
