#include "lib/cuda/staging.h"

#include "lib/cuda/await.h"
#include "lib/cuda/error.h"
#include "lib/cuda/processing.h"

namespace refit::cuda {

device_staging::device_staging(std::size_t count, std::uint64_t bytes) : bytes_(bytes) {
  REFIT_CUDA_CHECK(cudaGetDevice(&device_));
  slots_.reserve(count);
  for (std::size_t i = 0; i < count; ++i) slots_.emplace_back(static_cast<std::size_t>(bytes), device_);
}

std::span<std::byte> device_staging::slot(std::size_t index) {
  return {slots_.at(index).bytes(), static_cast<std::size_t>(bytes_)};
}

std::span<std::byte> device_staging::assembly(std::uint64_t bytes) {
  if (bytes > assembly_.size()) {
    assembly_ = device_buffer();  // free first: peak is the new size, not old + new
    assembly_ = device_buffer(static_cast<std::size_t>(bytes), device_);
  }
  return {assembly_.bytes(), static_cast<std::size_t>(bytes)};
}

std::uint64_t device_staging::allocated_bytes() const noexcept { return bytes_ * slots_.size() + assembly_.size(); }

asio::awaitable<void> pack_pieces_async(std::span<const asio::const_buffer> pieces, std::byte* dst, const stream& s) {
  for (const auto& p : pieces) {
    if (p.size()) REFIT_CUDA_CHECK(cudaMemcpyAsync(dst, p.data(), p.size(), cudaMemcpyDefault, s.get()));
    dst += p.size();
  }
  co_await when_done(s.get());
}

load_weights_fn on_stream(load_weights_fn load, const stream& s) {
  return [load = std::move(load), &s](std::span<const tensor_view> views) {
    // Processing threads start on device 0: use the stream's.
    REFIT_CUDA_CHECK(cudaSetDevice(s.device()));
    thread_local event done;
    {
      processing_scope scope(s.get());
      load(views);
    }
    done.record(s);
    done.synchronize();
  };
}

}  // namespace refit::cuda
