#include <refit/cuda/processing.h>

namespace refit::cuda {
namespace {
thread_local cudaStream_t current = nullptr;
}  // namespace

cudaStream_t current_processing_stream() noexcept { return current; }

processing_scope::processing_scope(cudaStream_t s) noexcept : previous_(current) { current = s; }
processing_scope::~processing_scope() { current = previous_; }

}  // namespace refit::cuda
