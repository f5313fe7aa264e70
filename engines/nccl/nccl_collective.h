// NCCL as a collective_provider (--config=cuda only).
#pragma once

#include <memory>

#include "engines/nccl/collective.h"

namespace refit::nccl {

/// Communicators from NCCL (non-blocking, polled from the executor, aborted at the
/// deadline), staging and packing buffers in device memory on the current device.
std::shared_ptr<collective_provider> nccl_collectives();

}  // namespace refit::nccl
