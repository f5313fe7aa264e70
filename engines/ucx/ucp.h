// UCX's UCP API (1.13 and later) as the ucx engine uses it: a context that lives as
// long as its owner (memory registrations belong to it), a worker per connection
// whose progress is driven from the asio executor by its event fd (no busy loop,
// no thread), requests awaited with deadlines, endpoints with peer failure
// handling, and what UCX chose for an endpoint read back from ucp_ep_print_info
// (1.13 has no UCP_EP_ATTR_FIELD_TRANSPORTS).
//
// Threading: a worker and everything on it (endpoints, requests) is touched only
// from its executor, which must run on one thread at a time (an io_context run by
// one thread, or a strand). UCX's callbacks run inside ucp_worker_progress, which
// only this file calls, on that executor; they record the result and post the
// wake-up of the waiting coroutine to the executor.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>

#include <refit/error.h>
#include <refit/tensor.h>

namespace refit::ucx {

/// Throws refit::error for a UCX failure: a lost or unreachable peer is
/// peer_lost, UCX's own timeouts are timeout, memory is resource_exhausted,
/// anything else io_error; the message is "<what>: <UCX's status string>".
[[noreturn]] void throw_status(ucs_status_t status, const std::string& what);

/// A UCP context (RMA, tag matching, wakeup) and the memory registered with it.
class context {
 public:
  context();
  ~context();
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  ucp_context_h get() const noexcept { return ctx_; }
  /// Whether UCX (the one loaded at run time) can register and move memory on
  /// `where`: always for the host; for a CUDA device only where it has CUDA
  /// memory support (UCX 1.13 from Debian has none; PyPI's libucx-cu13 has).
  bool handles(const refit::device& where) const noexcept;
  /// The memory types UCX handles, as UCX names them ("host", "cuda", ...).
  std::string memory_types() const;
  /// The loaded UCX's version ("1.13.1").
  static std::string version();

 private:
  ucp_context_h ctx_ = nullptr;
  std::uint64_t memory_types_ = 0;  // UCS_BIT(ucs_memory_type_t) of each
};

/// A registered range of memory (on the host, or on the CUDA device `where`: the
/// memory type UCX is told at registration) and its packed remote key.
class registration {
 public:
  registration(std::shared_ptr<context> ctx, std::byte* base, std::uint64_t bytes,
               const refit::device& where = refit::device::cpu());
  ~registration();
  registration(const registration&) = delete;
  registration& operator=(const registration&) = delete;
  std::byte* base() const noexcept { return base_; }
  std::uint64_t bytes() const noexcept { return bytes_; }
  const std::vector<std::byte>& packed_rkey() const noexcept { return rkey_; }
  bool contains(const std::byte* p, std::uint64_t n) const noexcept {
    return p >= base_ && n <= bytes_ && static_cast<std::uint64_t>(p - base_) <= bytes_ - n;
  }

 private:
  std::shared_ptr<context> ctx_;
  std::byte* base_;
  std::uint64_t bytes_;
  ucp_mem_h memh_ = nullptr;
  std::vector<std::byte> rkey_;
};

/// The completion of one UCX request, shared by the callback and its waiter.
struct request_state;

/// A UCP worker whose progress runs on `executor` when its event fd says so.
class worker : public std::enable_shared_from_this<worker> {
 public:
  /// Creates the worker and starts waiting on its event fd.
  static std::shared_ptr<worker> create(std::shared_ptr<context> ctx, asio::any_io_executor executor);
  ~worker();
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;

  ucp_worker_h get() const noexcept { return worker_; }
  const asio::any_io_executor& executor() const noexcept { return executor_; }
  /// This worker's address (what a peer's endpoint connects to).
  std::vector<std::byte> address() const;
  /// Runs progress soon (after posting an operation).
  void kick();
  /// While one of these lives, the worker waits on its event fd and progresses
  /// what comes; with none, it leaves the executor idle (an io_context with nothing
  /// else to do returns from run()) and what arrives waits for the next one. Held
  /// for the length of an init, an update or a trainer's send.
  class engaged {
   public:
    explicit engaged(std::shared_ptr<worker> w);
    ~engaged();
    engaged(const engaged&) = delete;
    engaged& operator=(const engaged&) = delete;

   private:
    std::shared_ptr<worker> worker_;
  };
  /// Stops the event-fd wait and destroys the worker (cancelling what is left);
  /// idempotent. Endpoints must be closed first.
  void close() noexcept;

  /// Completes when `request` (what a *_nbx call returned, with its callback's
  /// user data from track()) completes; throws its failure, or timeout after
  /// `limit` (cancelling the request where UCX can). `what` names the wait. When
  /// the call completed at once (no request), the caller untracks the state first
  /// (the callback never runs).
  asio::awaitable<std::size_t> wait(ucs_status_ptr_t request, std::shared_ptr<request_state> state,
                                    std::chrono::milliseconds limit, std::string what);
  /// A fresh request_state and the op params that route its callback here. The
  /// worker holds it until the callback runs, the caller untracks it, or close():
  /// what is outstanding then ends as cancelled (UCX calls no callback for a
  /// request whose worker it destroys).
  std::shared_ptr<request_state> track(ucp_request_param_t& param, bool receive);
  /// Drops the worker's hold on `state` (its callback ran, or will not run) and
  /// returns it (null if it was not held).
  std::shared_ptr<request_state> untrack(request_state* state) noexcept;
  /// Tracked requests whose callback has not run (none after close()).
  std::size_t outstanding() const noexcept { return outstanding_.size(); }

 private:
  worker(std::shared_ptr<context> ctx, asio::any_io_executor executor);
  void drive();
  void wait_for_events();
  struct fd_waiter;

  std::shared_ptr<context> ctx_;
  asio::any_io_executor executor_;
  ucp_worker_h worker_ = nullptr;
  std::unique_ptr<fd_waiter> fd_;
  bool drive_posted_ = false;
  int engaged_ = 0;
  // Tracked requests whose callback has not run yet, by their user data.
  std::unordered_map<request_state*, std::shared_ptr<request_state>> outstanding_;
};

/// What UCX chose for an endpoint: its lanes' transports and whether one-sided
/// puts run on a transport that does them (a lane marked rma_bw), or would be
/// emulated over active messages (UCX's tcp).
struct transport_report {
  std::vector<std::string> transports;      ///< "cma", "sysv", "tcp", "rc_mlx5", ... (each once, in lane order)
  bool native_puts = false;                 ///< some lane carries rma_bw
  std::vector<std::string> put_transports;  ///< the transports of those lanes
  std::string lanes;                        ///< ucp_ep_print_info's lane lines, for logs
};
transport_report parse_ep_info(const std::string& text);

/// Whether `name` (as ucp_ep_print_info names a lane's transport) is one of UCX's
/// shared-memory transports: cma, posix, sysv, xpmem, knem.
bool shared_memory_transport(const std::string& name);

/// An endpoint to a peer worker's address. Peer failure handling is asked for
/// (UCP_ERR_HANDLING_MODE_PEER); UCX's shared-memory transports do not offer it,
/// and where they reach the peer the endpoint is made without
/// (peer_failure_handling() false: the side channel is what detects the peer's
/// loss), also when with it UCX would fall back to tcp.
class endpoint {
 public:
  endpoint(std::shared_ptr<worker> w, std::span<const std::byte> address, std::string who);
  ~endpoint();
  endpoint(const endpoint&) = delete;
  endpoint& operator=(const endpoint&) = delete;
  ucp_ep_h get() const noexcept { return ep_; }
  bool peer_failure_handling() const noexcept { return peer_mode_; }
  /// The first error UCX reported for the endpoint (UCS_OK: none).
  ucs_status_t failure() const noexcept { return *failure_; }
  transport_report transports() const;
  /// Completes every operation posted on the endpoint so far (puts are then
  /// visible in the peer's memory), within `limit`.
  asio::awaitable<void> flush(std::chrono::milliseconds limit, std::string what);
  /// Closes now (forced: nothing waits for the peer); idempotent.
  void close() noexcept;
  /// Throws cancelled naming `what` once the endpoint or its worker was closed.
  void check_open(const std::string& what) const;

 private:
  std::shared_ptr<worker> worker_;
  ucp_ep_h ep_ = nullptr;
  bool peer_mode_ = true;
  std::shared_ptr<ucs_status_t> failure_;
  std::string who_;
};

/// A remote key unpacked for an endpoint.
class remote_key {
 public:
  remote_key(const endpoint& ep, std::span<const std::byte> packed, const std::string& what);
  ~remote_key();
  remote_key(const remote_key&) = delete;
  remote_key& operator=(const remote_key&) = delete;
  ucp_rkey_h get() const noexcept { return rkey_; }

 private:
  ucp_rkey_h rkey_ = nullptr;
};

/// A range of a peer's registered memory: its address, size and unpacked key.
struct remote_range {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
  const remote_key* rkey = nullptr;
};
/// Puts `pieces` to consecutive remote addresses from `remote`, then flushes: when
/// it completes every byte is in the peer's memory.
asio::awaitable<void> put_all(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces, std::uint64_t remote,
                              const remote_key& rkey, std::chrono::milliseconds limit, std::string what);
/// Puts the bytes of `pieces`, in order, into the ranges of `dest`, in order (the
/// same total; protocol_error otherwise, before a byte moves), then flushes.
asio::awaitable<void> put_scattered(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces,
                                    std::span<const remote_range> dest, std::chrono::milliseconds limit,
                                    std::string what);
/// Sends `pieces` as one tagged message (an iov datatype).
asio::awaitable<void> tag_send(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces, std::uint64_t tag,
                               std::chrono::milliseconds limit, std::string what);
/// A tagged receive into `dest`, posted now; wait() completes it.
class tag_receive {
 public:
  tag_receive(std::shared_ptr<worker> w, std::span<const asio::mutable_buffer> dest, std::uint64_t tag,
              std::string what);
  ~tag_receive();
  /// Waits for the message; throws if it did not arrive whole within `limit`.
  asio::awaitable<void> wait(std::chrono::milliseconds limit);
  /// Cancels it if it is still outstanding (nothing lands in `dest` once the
  /// worker is closed or the cancellation completed).
  void cancel() noexcept;

 private:
  std::shared_ptr<worker> worker_;
  std::vector<ucp_dt_iov_t> iov_;
  std::uint64_t bytes_ = 0;
  ucs_status_ptr_t request_ = nullptr;
  std::shared_ptr<request_state> state_;
  std::string what_;
};

}  // namespace refit::ucx
