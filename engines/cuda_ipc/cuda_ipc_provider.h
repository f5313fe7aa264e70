// CUDA IPC as an ipc_provider (--config=cuda only).
#pragma once

#include <memory>

#include <refit/engines/cuda_ipc/cuda_ipc.h>

namespace refit::cuda_ipc {

/// The provider for CUDA device `device` (one per device and process, made on
/// first use): exported buffers from cudaMalloc on that device
/// (cudaIpcGetMemHandle), handles opened with cudaIpcOpenMemHandle on the device
/// whose UUID matches (whatever its index in this process), copies and packing on
/// a stream of `device` awaited through the CUDA-to-asio bridge, load_weights on a
/// processing stream of `device` (lib/cuda/staging.h). Every call makes `device`
/// current for itself and restores the caller's.
std::shared_ptr<ipc_provider> cuda_ipcs(int device);

}  // namespace refit::cuda_ipc
