// Engine-independent settings, the counterpart of vLLM's WeightTransferConfig.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "lib/json_reader.h"

namespace refit {

/// Which backend to use and the settings every backend honours.
struct weight_transfer_config {
  /// Registered backend name ("tcp", "shm", "nccl", ...).
  std::string backend = "tcp";
  /// Default deadline for every wait on a peer (connect, each bucket, each control
  /// call) unless an engine's init info sets its own.
  std::chrono::milliseconds timeout{60'000};
  /// Threads for CPU post-processing (load_weights) when the context brings none.
  std::size_t processing_threads = 1;

  /// Reads {"backend": str, "timeout_ms": int, "processing_threads": int} strictly.
  static weight_transfer_config from_json(const json& j);
  json to_json() const;
};

}  // namespace refit
