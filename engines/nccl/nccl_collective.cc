// NCCL behind the collective interface (--config=cuda). Communicators are
// non-blocking: initialisation and every broadcast are polled from the asio
// executor (ncclCommGetAsyncError, cudaStreamQuery) with a deadline, and the
// communicator is aborted at the deadline or on an asynchronous error, so a dead or
// slow peer is a typed error, never a hang. Nothing here blocks the event loop:
// ncclCommAbort (blocking even for non-blocking communicators) and the drain of the
// aborted stream run on the provider's abort thread, and polling never touches a
// communicator an abort has taken.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include <asio/steady_timer.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/offload.h>
#include <refit/backend/hex.h>
#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/nccl_error.h>
#include <refit/cuda/staging.h>
#include <refit/cuda/stream.h>
#include <refit/engines/nccl/collective.h>
#include <refit/engines/nccl/nccl_collective.h>

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

// Where aborts run: one thread per provider, so aborts run in order and a no-op
// posted after them completes only once they have (aborted()).
class abort_thread {
 public:
  // ncclCommAbort, then the communication stream drained (bounded: a kernel the
  // abort did not stop is reported, not waited for forever).
  void abort(ncclComm_t comm, std::shared_ptr<cuda::stream> stream, int device) {
    asio::post(pool_, [comm, stream = std::move(stream), device] {
      try {
        const cuda::device_scope scope(device);
        if (comm) (void)ncclCommAbort(comm);
        const auto give_up = clock_type::now() + std::chrono::seconds(30);
        cudaError_t q;
        while ((q = cudaStreamQuery(stream->get())) == cudaErrorNotReady && clock_type::now() < give_up)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (q == cudaErrorNotReady)
          std::fprintf(stderr,
                       "refit nccl: the communication stream of an aborted communicator is still busy "
                       "after 30 s\n");
        (void)cudaGetLastError();
      } catch (...) {  // device_scope on a broken context: nothing more to do
      }
    });
  }
  asio::awaitable<void> idle() {
    co_await async::offload(pool_.get_executor(), [] {});
  }

 private:
  asio::thread_pool pool_{1};
};

// The communicator and its stream, shared by the collective, polls in flight and
// the abort that takes it.
struct communicator {
  std::mutex mutex;
  ncclComm_t comm = nullptr;  // null once an abort has taken it
  int device = 0;
  std::shared_ptr<cuda::stream> stream;
};

class nccl_collective final : public collective {
 public:
  nccl_collective(ncclComm_t comm, int rank, int device, asio::any_io_executor ex, std::shared_ptr<abort_thread> aborts)
      : c_(std::make_shared<communicator>()), rank_(rank), executor_(std::move(ex)), aborts_(std::move(aborts)) {
    c_->comm = comm;
    c_->device = device;
    c_->stream = std::make_shared<cuda::stream>(cuda::stream::on(device));
  }
  ~nccl_collective() override { abort(); }

  asio::awaitable<void> broadcast(std::byte* data, std::uint64_t bytes, std::chrono::milliseconds deadline) override {
    const std::string who = "nccl rank " + std::to_string(rank_);
    if (bytes == 0) co_return;
    const auto until = clock_type::now() + deadline;
    {
      std::lock_guard lock(c_->mutex);
      if (!c_->comm) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      const cuda::device_scope scope(c_->device);
      const ncclResult_t r = ncclBroadcast(data, data, bytes, ncclUint8, 0, c_->comm, c_->stream->get());
      if (r != ncclSuccess && r != ncclInProgress) fail_locked(r, who + ": ncclBroadcast");
    }
    co_await until_done(who, "broadcast of " + std::to_string(bytes) + " bytes", until, deadline);
  }

  asio::awaitable<void> exchange(std::span<const p2p_op> ops, std::chrono::milliseconds deadline) override {
    const std::string who = "nccl rank " + std::to_string(rank_);
    if (ops.empty()) co_return;
    const auto until = clock_type::now() + deadline;
    std::uint64_t bytes = 0;
    {
      std::lock_guard lock(c_->mutex);
      if (!c_->comm) throw_error(errc::peer_lost, who + ": the communicator was aborted");
      const cuda::device_scope scope(c_->device);
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) fail_locked(r, who + ": ncclGroupStart");
      for (const auto& op : ops) {
        bytes += op.bytes;
        r = op.type == p2p_op::kind::send
                ? ncclSend(op.data, op.bytes, ncclUint8, op.peer, c_->comm, c_->stream->get())
                : ncclRecv(op.data, op.bytes, ncclUint8, op.peer, c_->comm, c_->stream->get());
        if (r != ncclSuccess && r != ncclInProgress) {
          (void)ncclGroupEnd();
          fail_locked(r, who + (op.type == p2p_op::kind::send ? ": ncclSend to rank " : ": ncclRecv from rank ") +
                             std::to_string(op.peer));
        }
      }
      r = ncclGroupEnd();
      if (r != ncclSuccess && r != ncclInProgress) fail_locked(r, who + ": ncclGroupEnd");
    }
    co_await until_done(who,
                        "grouped exchange of " + std::to_string(ops.size()) + " sends and receives (" +
                            std::to_string(bytes) + " bytes)",
                        until, deadline);
  }

  // Polls the communicator and its stream until the work queued last is done, the
  // deadline passes (abort, timeout) or an asynchronous error comes (abort).
  asio::awaitable<void> until_done(std::string who, std::string what, clock_type::time_point until,
                                   std::chrono::milliseconds deadline) {
    asio::steady_timer timer(executor_);
    backoff b;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      {
        std::lock_guard lock(c_->mutex);
        if (!c_->comm) throw_error(errc::peer_lost, who + ": the communicator was aborted");
        const ncclResult_t r = ncclCommGetAsyncError(c_->comm, &state);
        if (r != ncclSuccess) fail_locked(r, who + ": ncclCommGetAsyncError");
        if (state != ncclSuccess && state != ncclInProgress) fail_locked(state, who + ": " + what);
      }
      if (state == ncclSuccess) {
        const cudaError_t q = cudaStreamQuery(c_->stream->get());
        if (q == cudaSuccess) co_return;
        if (q != cudaErrorNotReady) {
          abort();
          cuda::throw_cuda_error(q, "cudaStreamQuery(communication stream)", std::source_location::current());
        }
      }
      if (clock_type::now() >= until) {
        abort();
        throw_error(errc::timeout, who + ": " + what + ": no progress within " + std::to_string(deadline.count()) +
                                       " ms (a peer is gone or stalled; "
                                       "communicator aborted)");
      }
      co_await b.wait(timer);
    }
  }

  void abort() noexcept override {
    std::lock_guard lock(c_->mutex);
    take_locked();
  }

  asio::awaitable<void> aborted() override { co_await aborts_->idle(); }

 private:
  // Hands the communicator to the abort thread (mutex held): later polls see it gone.
  void take_locked() noexcept {
    if (!c_->comm) return;
    try {
      aborts_->abort(std::exchange(c_->comm, nullptr), c_->stream, c_->device);
    } catch (...) {  // posting failed (out of memory): abort here rather than leak a live communicator
      (void)ncclCommAbort(c_->comm);
      c_->comm = nullptr;
    }
  }

  [[noreturn]] void fail_locked(ncclResult_t r, const std::string& what) {
    const char* last = ncclGetLastError(c_->comm);
    std::string text = std::string(ncclGetErrorString(r)) + (last && *last ? std::string(" (") + last + ")" : "");
    take_locked();
    throw_error(r == ncclRemoteError || r == ncclSystemError ? errc::peer_lost : errc::io_error, what + ": " + text);
  }

  std::shared_ptr<communicator> c_;
  int rank_;
  asio::any_io_executor executor_;
  std::shared_ptr<abort_thread> aborts_;
};

class nccl_provider final : public collective_provider {
 public:
  explicit nccl_provider(int device)
      : device_(device), copier_(device), processing_stream_(cuda::stream::on(device)),
        aborts_(std::make_shared<abort_thread>()) {}

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
    const std::string who = "nccl rank " + std::to_string(rank) + " on cuda:" + std::to_string(device_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // non-blocking: polled below, abortable at the deadline
    ncclComm_t comm = nullptr;
    ncclResult_t r;
    {
      const cuda::device_scope scope(device_);  // NCCL binds the communicator to the current device
      r = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
    }
    std::string failure;
    errc kind = errc::io_error;
    if (r != ncclSuccess && r != ncclInProgress) {
      failure = who + ": ncclCommInitRankConfig: " + ncclGetErrorString(r);
    } else {
      const auto until = clock_type::now() + deadline;
      asio::steady_timer timer(executor);
      backoff b;
      for (;;) {
        ncclResult_t state = ncclInProgress;
        const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
        if (q != ncclSuccess) {
          failure = who + ": ncclCommGetAsyncError while joining: " + ncclGetErrorString(q);
          break;
        }
        if (state == ncclSuccess) break;
        if (state != ncclInProgress) {
          kind = errc::peer_lost;
          failure = who + ": joining the communicator of " + std::to_string(world_size) +
                    " ranks failed: " + ncclGetErrorString(state);
          break;
        }
        if (clock_type::now() >= until) {
          kind = errc::timeout;
          failure = who + ": the communicator of " + std::to_string(world_size) + " ranks did not form within " +
                    std::to_string(deadline.count()) + " ms (communicator aborted)";
          break;
        }
        co_await b.wait(timer);
      }
    }
    if (!failure.empty()) {
      if (comm) {
        aborts_->abort(comm, std::make_shared<cuda::stream>(cuda::stream::on(device_)), device_);
        co_await aborts_->idle();
      }
      throw_error(kind, failure);
    }
    co_return std::make_unique<nccl_collective>(comm, rank, device_, executor, aborts_);
  }

  std::unique_ptr<staging_memory> make_staging(std::size_t count, std::uint64_t bytes) override {
    return std::make_unique<cuda::device_staging>(count, bytes, device_);
  }

  void order_after(const void* producer) override {
    copier_.order_after(static_cast<cudaStream_t>(const_cast<void*>(producer)));
  }

  asio::awaitable<void> pack(std::span<const asio::const_buffer> pieces, std::byte* dst) override {
    co_await copier_.pack(pieces, dst);
  }

  bool device_sources() const noexcept override { return true; }

  // One processing stream for the provider, created once (not per update).
  load_weights_fn processing(load_weights_fn load) override {
    return cuda::on_stream(std::move(load), processing_stream_);
  }

 private:
  int device_;
  cuda::piece_copier copier_;       // packing: large pieces by copy engine, small ones batched
  cuda::stream processing_stream_;  // workers' load_weights
  std::shared_ptr<abort_thread> aborts_;
};

}  // namespace

std::shared_ptr<collective_provider> nccl_collectives(int device) {
  return cuda::one_per_device<collective_provider, nccl_provider>(device);
}

}  // namespace refit::nccl
