#include "tests/cuda/test_kernels.h"

#include <refit/cuda/error.h>

namespace refit::cuda::testing {
namespace {

__device__ std::uint64_t global_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(std::uint64_t ns) {
  const std::uint64_t start = global_ns();
  while (global_ns() - start < ns) {
  }
}

__global__ void wait_flag_kernel(const volatile int* flag, std::uint64_t ns) {
  const std::uint64_t start = global_ns();
  while (*flag == 0 && global_ns() - start < ns) {
  }
}

__global__ void fault_kernel(int* p) { *p = 1; }

void check_launch(const char* kernel) {
  if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) throw cuda_error(status, kernel);
}

}  // namespace

void spin(std::uint64_t nanoseconds, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  check_launch("spin_kernel<<<...>>>");
}

void wait_flag(const volatile int* flag, std::uint64_t timeout_ns, cudaStream_t stream) {
  wait_flag_kernel<<<1, 1, 0, stream>>>(flag, timeout_ns);
  check_launch("wait_flag_kernel<<<...>>>");
}

void fault(cudaStream_t stream) {
  // An address no allocation maps: the write faults.
  fault_kernel<<<1, 1, 0, stream>>>(reinterpret_cast<int*>(std::uintptr_t{0x10}));
  check_launch("fault_kernel<<<...>>>");
}

}  // namespace refit::cuda::testing
