// NCCL behind the collective interface (--config=cuda). Communicators are
// non-blocking: initialisation and every broadcast are polled from the asio
// executor (ncclCommGetAsyncError, cudaStreamQuery) with a deadline, and the
// communicator is aborted at the deadline or on an asynchronous error, so a dead or
// slow peer is a typed error, never a hang. Nothing here blocks the event loop.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include "engines/nccl/collective.h"
#include "engines/nccl/nccl_collective.h"
#include "lib/cuda/error.h"
#include "lib/cuda/memory.h"
#include "lib/cuda/nccl_error.h"
#include "lib/cuda/staging.h"
#include "lib/cuda/stream.h"
#include "lib/hex.h"

namespace refit::nccl {
namespace {

using clock_type = std::chrono::steady_clock;

std::string to_hex(const ncclUniqueId& id) { return refit::to_hex(std::as_bytes(std::span(id.internal))); }

ncclUniqueId from_hex(const std::string& text) {
  ncclUniqueId id{};
  if (!refit::from_hex(text, std::as_writable_bytes(std::span(id.internal))))
    throw_error(errc::protocol_error, "nccl: communicator id '" + text.substr(0, 16) + "...' is not " +
                                          std::to_string(2 * sizeof(id.internal)) + " hex digits");
  return id;
}

// Sleeps on the executor for a growing interval: short waits stay short, long
// ones cost little.
struct backoff {
  std::chrono::microseconds next{20};
  asio::awaitable<void> wait(asio::steady_timer& timer) {
    timer.expires_after(next);
    co_await timer.async_wait(asio::use_awaitable);
    next = std::min<std::chrono::microseconds>(next * 2, std::chrono::milliseconds(1));
  }
};

class nccl_collective final : public collective {
 public:
  nccl_collective(ncclComm_t comm, int rank, asio::any_io_executor ex)
      : comm_(comm), rank_(rank), executor_(std::move(ex)) {}
  ~nccl_collective() override { abort(); }

  asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds deadline) override {
    const std::string who = "nccl rank " + std::to_string(rank_);
    if (!comm_) throw_error(errc::peer_lost, who + ": the communicator was aborted");
    if (bytes == 0) co_return;
    const auto until = clock_type::now() + deadline;
    ncclResult_t r = ncclBroadcast(data, data, bytes, ncclUint8, 0, comm_, stream_.get());
    if (r != ncclSuccess && r != ncclInProgress) fail(r, who + ": ncclBroadcast");
    asio::steady_timer timer(executor_);
    backoff b;
    for (;;) {
      if (!comm_) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) fail(state, who + ": broadcast of " + std::to_string(bytes) + " bytes");
      if (state == ncclSuccess) {
        const cudaError_t q = cudaStreamQuery(stream_.get());
        if (q == cudaSuccess) co_return;
        if (q != cudaErrorNotReady) {
          abort();
          cuda::throw_cuda_error(q, "cudaStreamQuery(communication stream)", std::source_location::current());
        }
      }
      if (clock_type::now() >= until) {
        abort();
        throw_error(errc::timeout, who + ": broadcast of " + std::to_string(bytes) + " bytes: no progress within " +
                                       std::to_string(deadline.count()) + " ms (a peer is gone or stalled; "
                                       "communicator aborted)");
      }
      co_await b.wait(timer);
    }
  }

  void abort() noexcept override {
    if (!comm_) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  [[noreturn]] void fail(ncclResult_t r, const std::string& what) {
    const char* last = ncclGetLastError(comm_);
    std::string text = std::string(ncclGetErrorString(r)) + (last && *last ? std::string(" (") + last + ")" : "");
    abort();
    throw_error(r == ncclRemoteError || r == ncclSystemError ? errc::peer_lost : errc::io_error, what + ": " + text);
  }

  ncclComm_t comm_;
  int rank_;
  asio::any_io_executor executor_;
  cuda::stream stream_;
};

class nccl_provider final : public collective_provider {
 public:
  std::string name() const override { return "nccl"; }

  std::string new_group_id() override {
    ncclUniqueId id;
    REFIT_NCCL_CHECK(ncclGetUniqueId(&id));
    return to_hex(id);
  }

  asio::awaitable<std::unique_ptr<collective>> join(std::string id_text, int rank, int world_size,
                                                    asio::any_io_executor executor,
                                                    std::chrono::milliseconds deadline) override {
    const ncclUniqueId id = from_hex(id_text);
    const std::string who = "nccl rank " + std::to_string(rank);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // non-blocking: polled below, abortable at the deadline
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm) ncclCommAbort(comm);
      throw_error(errc::io_error, who + ": ncclCommInitRankConfig: " + ncclGetErrorString(r));
    }
    const auto until = clock_type::now() + deadline;
    asio::steady_timer timer(executor);
    backoff b;
    for (;;) {
      ncclResult_t state = ncclInProgress;
      ncclCommGetAsyncError(comm, &state);
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) {
        std::string text = ncclGetErrorString(state);
        ncclCommAbort(comm);
        throw_error(errc::peer_lost, who + ": joining the communicator of " + std::to_string(world_size) +
                                         " ranks failed: " + text);
      }
      if (clock_type::now() >= until) {
        ncclCommAbort(comm);
        throw_error(errc::timeout, who + ": the communicator of " + std::to_string(world_size) +
                                       " ranks did not form within " + std::to_string(deadline.count()) +
                                       " ms (communicator aborted)");
      }
      co_await b.wait(timer);
    }
    co_return std::make_unique<nccl_collective>(comm, rank, executor);
  }

  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes);
  }

  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await cuda::pack_pieces_async(pieces, dst, stream_);
  }

  bool device_sources() const noexcept override { return true; }

  // One processing stream for the provider, created once (not per update).
  load_weights_fn processing(load_weights_fn load) override { return cuda::on_stream(std::move(load), processing_stream_); }

 private:
  cuda::stream stream_;             // packing
  cuda::stream processing_stream_;  // workers' load_weights
};

}  // namespace

std::shared_ptr<collective_provider> nccl_collectives() {
  static auto provider = std::make_shared<nccl_provider>();
  return provider;
}

}  // namespace refit::nccl
