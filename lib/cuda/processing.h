// The processing stream of a GPU engine's load_weights: engines whose staging is
// device memory (nccl) call load_weights on a processing thread with the stream it
// must enqueue its work on (unpack, casts, copies into the model) available here.
// The engine waits for that stream before the staging slot is reused, so
// load_weights returns as soon as its work is enqueued; the next bucket's receive
// on the communication stream overlaps it.
#pragma once

#include <cuda_runtime_api.h>

namespace refit::cuda {

/// The stream load_weights should enqueue on; nullptr (the legacy default stream)
/// outside a processing call.
cudaStream_t current_processing_stream() noexcept;

/// Makes `s` the current processing stream of this thread for its lifetime.
class processing_scope {
 public:
  explicit processing_scope(cudaStream_t s) noexcept;
  ~processing_scope();
  processing_scope(const processing_scope&) = delete;
  processing_scope& operator=(const processing_scope&) = delete;

 private:
  cudaStream_t previous_;
};

}  // namespace refit::cuda
