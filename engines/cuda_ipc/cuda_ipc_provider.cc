#include "engines/cuda_ipc/cuda_ipc_provider.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <vector>


#include "lib/cuda/await.h"
#include "lib/cuda/device.h"
#include "lib/cuda/error.h"
#include "lib/cuda/staging.h"
#include "lib/cuda/stream.h"
#include "lib/cuda/unpack.h"

namespace refit::cuda_ipc {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(handle_bytes));

gpu_uuid uuid_of_device(int device) {
  cudaDeviceProp prop{};
  REFIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  gpu_uuid u;
  std::memcpy(u.data(), prop.uuid.bytes, u.size());
  return u;
}

class cuda_provider final : public ipc_provider {
 public:
  std::string name() const override { return "cuda"; }

  std::unique_ptr<staging_memory> make_exportable(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes);
  }

  std::pair<handle_bytes, gpu_uuid> export_buffer(staging_memory& memory, std::size_t index) override {
    cudaIpcMemHandle_t h;
    REFIT_CUDA_CHECK(cudaIpcGetMemHandle(&h, memory.slot(index).data()));
    handle_bytes out;
    std::memcpy(out.data(), &h, out.size());
    return {out, uuid_of_device(memory.device().index)};
  }

  std::byte* open(const handle_bytes& handle, const gpu_uuid& gpu) override {
    int count = 0;
    REFIT_CUDA_CHECK(cudaGetDeviceCount(&count));
    int device = -1;
    for (int d = 0; d < count && device < 0; ++d)
      if (uuid_of_device(d) == gpu) device = d;
    if (device < 0)
      throw_error(errc::invalid_argument, "cuda ipc: the trainer's buffer is on a GPU this process cannot see "
                                          "(no device with its UUID; check CUDA_VISIBLE_DEVICES)");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof h);
    void* p = nullptr;
    cudaError_t r;
    {
      const cuda::device_scope scope(device);
      r = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    }
    if (r != cudaSuccess) {
      cudaGetLastError();  // clear
      throw_error(errc::invalid_argument, std::string("cuda ipc: cudaIpcOpenMemHandle refused the handle (") +
                                              cudaGetErrorName(r) + ": " + cudaGetErrorString(r) +
                                              "); a stale handle, or one from this same process");
    }
    return static_cast<std::byte*>(p);
  }

  void close(std::byte* mapped) noexcept override { cudaIpcCloseMemHandle(mapped); }

  asio::awaitable<void> copy_batch(std::span<const copy_piece> pieces) override {
    // Large pieces go to the copy engines one by one; the small ones (most of a
    // model's tensors) in one batched kernel launch.
    std::vector<cuda::piece> small;
    for (const auto& p : pieces) {
      if (p.bytes >= large_copy_bytes)
        REFIT_CUDA_CHECK(cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDeviceToDevice, stream_.get()));
      else if (p.bytes)
        small.push_back({p.src, p.dst, p.bytes});
    }
    if (!small.empty()) {
      std::lock_guard lock(unpack_mutex_);  // engines of one process share this provider
      unpacker_.unpack(small, stream_.get());
    }
    co_await cuda::when_done(stream_.get());
  }

  gpu_uuid uuid_of(const refit::device& d) override {
    if (!d.is_cuda())
      throw_error(errc::invalid_argument, "cuda ipc: the engine's device is " + to_string(d) + ", not a CUDA device");
    return uuid_of_device(d.index);
  }

  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await cuda::pack_pieces_async(pieces, dst, stream_);
  }

  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes);
  }
  bool device_sources() const noexcept override { return true; }
  load_weights_fn processing(load_weights_fn load) override { return cuda::on_stream(std::move(load), processing_); }

 private:
  static constexpr std::uint64_t large_copy_bytes = 1 << 20;
  cuda::stream stream_;      // copies and packing
  std::mutex unpack_mutex_;
  cuda::unpacker unpacker_;  // batched small copies on stream_
  cuda::stream processing_;  // workers' load_weights
};

}  // namespace

std::shared_ptr<ipc_provider> cuda_ipcs() {
  static auto provider = std::make_shared<cuda_provider>();
  return provider;
}

}  // namespace refit::cuda_ipc
