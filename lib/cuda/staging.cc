#include <refit/cuda/staging.h>

#include <exception>
#include <map>

#include <refit/cuda/await.h>
#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/processing.h>

namespace refit::cuda {

int device_index(const refit::device& d) { return d.is_cuda() ? d.index : current_device(); }

device_staging::device_staging(std::size_t count, std::uint64_t bytes, int device)
    : bytes_(bytes), device_(device < 0 ? current_device() : device) {
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

namespace {
bool device_readable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}
}  // namespace

piece_copier::piece_copier(int device)
    : device_(device), stream_(stream::on(device)), producer_done_(event::on(device)), unpacker_(4, device) {}

void piece_copier::order_after(cudaStream_t producer) {
  std::lock_guard lock(mutex_);
  const device_scope scope(device_);
  REFIT_CUDA_CHECK(cudaEventRecord(producer_done_.get(), producer));
  REFIT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), producer_done_.get(), 0));
}

void piece_copier::enqueue(std::span<const piece> pieces, bool sources_on_device) {
  std::lock_guard lock(mutex_);
  const device_scope scope(device_);
  small_.clear();
  for (const piece& p : pieces) {
    if (p.bytes == 0) continue;
    if (p.bytes < large_bytes && (sources_on_device || device_readable(p.src)))
      small_.push_back(p);
    else
      REFIT_CUDA_CHECK(cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDefault, stream_.get()));
  }
  if (!small_.empty()) unpacker_.unpack(small_, stream_.get());
}

asio::awaitable<void> piece_copier::copy(std::span<const piece> pieces, bool sources_on_device) {
  enqueue(pieces, sources_on_device);
  co_await when_done(stream_.get());
}

asio::awaitable<void> piece_copier::pack(std::span<const asio::const_buffer> pieces, std::byte* dst) {
  std::vector<piece> list;
  list.reserve(pieces.size());
  for (const auto& p : pieces) {
    list.push_back({static_cast<const std::byte*>(p.data()), dst, p.size()});
    dst += p.size();
  }
  co_await copy(list, false);
}

load_weights_fn on_stream(load_weights_fn load, const stream& s) {
  return [load = std::move(load), &s](std::span<const tensor_view> views) {
    const device_scope scope(s.device());
    // Events belong to a device: one per processing thread and device.
    thread_local std::map<int, event> done;
    auto it = done.find(s.device());
    if (it == done.end()) it = done.emplace(s.device(), event::on(s.device())).first;
    std::exception_ptr failed;
    {
      processing_scope processing(s.get());
      try {
        load(views);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    // Whatever load enqueued before it returned, or threw, may still read the
    // slot: the pipeline reuses it once this returns, so wait either way.
    it->second.record(s);
    it->second.synchronize();
    if (failed) std::rethrow_exception(failed);
  };
}

}  // namespace refit::cuda
