// Host-memory stand-in for CUDA IPC: exported buffers are registered under a
// random id (the "handle"); open() finds them in this process. Lets the whole
// engine run on CPU in tests, including stale and foreign handles.
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include <refit/backend/send_cursor.h>
#include <refit/engines/cuda_ipc/cuda_ipc.h>

namespace refit::cuda_ipc {
namespace {

class host_provider final : public ipc_provider {
 public:
  std::string name() const override { return "host"; }
  std::unique_ptr<staging_memory> make_exportable(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<host_staging>(count, bytes);
  }
  // Like cudaIpcGetMemHandle: the same allocation always has the same handle.
  std::pair<handle_bytes, gpu_uuid> export_buffer(staging_memory& memory, std::size_t index) override {
    std::lock_guard lock(mutex_);
    std::byte* p = memory.slot(index).data();
    if (auto it = handle_of_.find(p); it != handle_of_.end()) return {it->second, gpu_uuid{}};
    handle_bytes h{};
    const std::uint64_t id = rng_();
    std::memcpy(h.data(), "host-ipc", 8);
    std::memcpy(h.data() + 8, &id, sizeof id);
    exported_[h] = p;
    handle_of_[p] = h;
    return {h, gpu_uuid{}};
  }
  std::byte* open(const handle_bytes& handle, const gpu_uuid& gpu) override {
    std::lock_guard lock(mutex_);
    if (gpu != gpu_uuid{}) throw_error(errc::invalid_argument, "host ipc: the handle is for a GPU, not host memory");
    if (std::memcmp(handle.data(), "host-ipc", 8) != 0)
      throw_error(errc::invalid_argument, "host ipc: not a host ipc handle");
    auto it = exported_.find(handle);
    if (it == exported_.end())
      throw_error(errc::invalid_argument,
                  "host ipc: no exported buffer has this handle (stale or from another trainer)");
    ++open_count_[it->second];
    return it->second;
  }
  void close(std::byte* mapped) noexcept override {
    std::lock_guard lock(mutex_);
    if (auto it = open_count_.find(mapped); it != open_count_.end() && --it->second == 0) open_count_.erase(it);
  }
  asio::awaitable<void> copy_batch(std::span<const copy_piece> pieces) override {
    for (const auto& p : pieces)
      if (p.bytes) std::memcpy(p.dst, p.src, p.bytes);
    co_return;
  }
  gpu_uuid uuid_of(const refit::device&) override { return {}; }
  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    pack_pieces(pieces, dst);
    co_return;
  }
  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<host_staging>(count, bytes);
  }
  bool device_sources() const noexcept override { return false; }

 private:
  std::mutex mutex_;
  std::mt19937_64 rng_{std::random_device{}()};
  std::map<handle_bytes, std::byte*> exported_;
  std::map<std::byte*, handle_bytes> handle_of_;
  std::map<std::byte*, int> open_count_;
};

}  // namespace

std::shared_ptr<ipc_provider> host_ipc() {
  static auto provider = std::make_shared<host_provider>();
  return provider;
}

}  // namespace refit::cuda_ipc
