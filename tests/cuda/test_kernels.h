// Kernels that only tests need: GPU work of a known duration, and a device fault.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace refit::cuda::testing {

/// Enqueues a single-thread kernel that busy-waits `nanoseconds` of GPU time (by
/// the global timer), so that work is still running when the host looks.
void spin(std::uint64_t nanoseconds, cudaStream_t stream);

/// Enqueues a single-thread kernel that waits until `*flag` (host memory the device
/// can read: pinned and mapped, cudaHostAllocMapped) becomes non-zero, or until
/// `timeout_ns` of GPU time have passed: the host decides when later work on the
/// stream may start.
void wait_flag(const volatile int* flag, std::uint64_t timeout_ns, cudaStream_t stream);

/// Enqueues a kernel that writes through an invalid address: a sticky error
/// (cudaErrorIllegalAddress) that corrupts the process's CUDA context. Only for
/// tests that run in a child process of their own.
void fault(cudaStream_t stream);

}  // namespace refit::cuda::testing
