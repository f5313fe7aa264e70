// NCCL as a collective_provider (--config=cuda only).
#pragma once

#include <memory>

#include <refit/engines/nccl/collective.h>

namespace refit::nccl {

/// The provider for CUDA device `device` (one per device and process, made on first
/// use): communicators on `device`, device staging and packing buffers there,
/// packing and processing streams of `device`. Non-blocking communicators polled
/// from the executor; aborts on a thread of the provider's own.
std::shared_ptr<collective_provider> nccl_collectives(int device);

}  // namespace refit::nccl
