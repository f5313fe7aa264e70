// The cuda_ipc overlap benchmark (cuda_ipc_bench.cc), run by
// `engine_gpu_test --bench [options]`.
#pragma once

namespace refit::cuda::testing {

/// argv after "--bench": the options; prints one JSON line; returns the exit status.
int cuda_ipc_bench_main(int argc, char** argv);

}  // namespace refit::cuda::testing
