#include <refit/engines/cuda_ipc/cuda_ipc_provider.h>

#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/staging.h>
#include <refit/cuda/stream.h>

namespace refit::cuda_ipc {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(handle_bytes));

gpu_uuid uuid_of_device(int device) {
  gpu_uuid u;
  const auto& cached = cuda::device_uuid(device);  // one cudaGetDeviceProperties per device and process
  std::memcpy(u.data(), cached.data(), u.size());
  return u;
}

class cuda_provider final : public ipc_provider {
 public:
  explicit cuda_provider(int device) : device_(device), copier_(device), processing_(cuda::stream::on(device)) {}

  std::string name() const override { return "cuda"; }

  std::unique_ptr<staging_memory> make_exportable(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes, device_);
  }

  std::pair<handle_bytes, gpu_uuid> export_buffer(staging_memory& memory, std::size_t index) override {
    cudaIpcMemHandle_t h;
    {
      const cuda::device_scope scope(memory.device().index);
      REFIT_CUDA_CHECK(cudaIpcGetMemHandle(&h, memory.slot(index).data()));
    }
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
      throw_error(errc::invalid_argument,
                  "cuda ipc: the trainer's buffer is on a GPU this process cannot see "
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
      (void)cudaGetLastError();  // clear
      throw_error(errc::invalid_argument, std::string("cuda ipc: cudaIpcOpenMemHandle refused the handle (") +
                                              cudaGetErrorName(r) + ": " + cudaGetErrorString(r) +
                                              "); a stale handle, or one from this same process");
    }
    return static_cast<std::byte*>(p);
  }

  void close(std::byte* mapped) noexcept override { (void)cudaIpcCloseMemHandle(mapped); }

  asio::awaitable<void> copy_batch(std::span<const copy_piece> pieces) override {
    std::vector<cuda::piece> list;
    list.reserve(pieces.size());
    for (const auto& p : pieces) list.push_back({p.src, p.dst, p.bytes});
    co_await copier_.copy(list, true);  // mapped memory is device memory
  }

  gpu_uuid uuid_of(const refit::device& d) override {
    if (!d.is_cuda())
      throw_error(errc::invalid_argument, "cuda ipc: the engine's device is " + to_string(d) + ", not a CUDA device");
    return uuid_of_device(d.index);
  }

  void order_after(const void* producer) override {
    copier_.order_after(static_cast<cudaStream_t>(const_cast<void*>(producer)));
  }

  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await copier_.pack(pieces, dst);
  }

  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes, device_);
  }
  bool device_sources() const noexcept override { return true; }
  load_weights_fn processing(load_weights_fn load) override { return cuda::on_stream(std::move(load), processing_); }

 private:
  int device_;
  cuda::piece_copier copier_;  // copies and packing
  cuda::stream processing_;    // workers' load_weights
};

}  // namespace

std::shared_ptr<ipc_provider> cuda_ipcs(int device) {
  return cuda::one_per_device<ipc_provider, cuda_provider>(device);
}

}  // namespace refit::cuda_ipc
