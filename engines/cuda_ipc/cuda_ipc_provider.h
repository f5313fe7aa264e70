// CUDA IPC as an ipc_provider (--config=cuda only).
#pragma once

#include <memory>

#include "engines/cuda_ipc/cuda_ipc.h"

namespace refit::cuda_ipc {

/// Exported buffers from cudaMalloc (cudaIpcGetMemHandle), handles opened with
/// cudaIpcOpenMemHandle on the device whose UUID matches (whatever its index in
/// this process), copies and packing on the provider's stream, polled from the
/// executor; load_weights on a processing stream (lib/cuda/staging.h).
std::shared_ptr<ipc_provider> cuda_ipcs();

}  // namespace refit::cuda_ipc
