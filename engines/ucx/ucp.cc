#include "ucp.h"  // private to this engine

#include <sys/epoll.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>

#include <asio/posix/stream_descriptor.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/async/event.h>

namespace refit::ucx {

void throw_status(ucs_status_t status, const std::string& what) {
  const std::string message = what + ": " + ucs_status_string(status);
  switch (status) {
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
      throw_error(errc::peer_lost, message);
    case UCS_ERR_TIMED_OUT:
      throw_error(errc::timeout, message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      throw_error(errc::resource_exhausted, message);
    case UCS_ERR_CANCELED:
      throw_error(errc::cancelled, message);
    case UCS_ERR_MESSAGE_TRUNCATED:
      throw_error(errc::protocol_error, message);
    default:
      throw_error(errc::io_error, message);
  }
}

// ---- context and registrations

context::context() {
  ucp_config_t* config = nullptr;
  if (auto s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) throw_status(s, "ucx: reading UCX_* settings");
  // UCX's tcp transport moves a large message in segments of 8 KiB (send) and 64
  // KiB (receive) by default (a system call and a copy each); weights are large
  // messages. 512 KiB segments take the ucx engine over UCX's tcp from 0.57x to
  // about 0.8x of refit's own tcp engine on loopback (docs/benchmarks.md). Where
  // the environment sets them (UCX_TCP_TX_SEG_SIZE, UCX_TCP_RX_SEG_SIZE), its
  // values stand. (The names without the transport's prefix: only UCX's tcp
  // transport has these fields.)
  // (Only where UCX may load its tcp transport: with UCX_TLS naming others only,
  // no transport knows the keys and UCX warns about them.)
  const char* tls = std::getenv("UCX_TLS");
  const std::string_view t = tls ? tls : "";
  const bool tcp_possible = t.empty() || t.front() == '^' || t.find("tcp") != t.npos || t.find("all") != t.npos;
  for (const char* key : {"TX_SEG_SIZE", "RX_SEG_SIZE"})
    if (tcp_possible && !std::getenv((std::string("UCX_TCP_") + key).c_str()))
      (void)ucp_config_modify(config, key, "512K");
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  p.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  // Staging is registered off the event loop while workers may run: the context
  // must be thread-safe (workers are not shared).
  p.mt_workers_shared = 1;
  const ucs_status_t s = ucp_init(&p, config, &ctx_);
  ucp_config_release(config);
  if (s != UCS_OK) throw_status(s, "ucx: ucp_init");
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx_, &attr) == UCS_OK) memory_types_ = attr.memory_types;
}

bool context::handles(const refit::device& where) const noexcept {
  if (where.is_cpu()) return true;
  return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

std::string context::memory_types() const {
  std::string out;
  for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t)
    if (memory_types_ & UCS_BIT(t)) out += (out.empty() ? "" : ", ") + std::string(ucs_memory_type_names[t]);
  return out.empty() ? "none" : out;
}

std::string context::version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

context::~context() {
  if (ctx_) ucp_cleanup(ctx_);
}

registration::registration(std::shared_ptr<context> ctx, std::byte* base, std::uint64_t bytes,
                           const refit::device& where)
    : ctx_(std::move(ctx)), base_(base), bytes_(bytes) {
  if (!ctx_->handles(where))
    throw_error(errc::unsupported, "ucx: cannot register memory on " + to_string(where) + ": the UCX loaded (" +
                                       context::version() + ") handles " + ctx_->memory_types() +
                                       " memory only (a UCX built with CUDA, e.g. PyPI's libucx-cu13, first on the "
                                       "library path handles device memory)");
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  p.address = base;
  p.length = bytes;
  p.memory_type = where.is_cpu() ? UCS_MEMORY_TYPE_HOST : UCS_MEMORY_TYPE_CUDA;
  if (auto s = ucp_mem_map(ctx_->get(), &p, &memh_); s != UCS_OK)
    throw_status(
        s, "ucx: registering " + std::to_string(bytes) + " bytes of " + to_string(where) + " memory (ucp_mem_map)");
  void* packed = nullptr;
  std::size_t size = 0;
  if (auto s = ucp_rkey_pack(ctx_->get(), memh_, &packed, &size); s != UCS_OK) {
    ucp_mem_unmap(ctx_->get(), memh_);
    throw_status(s, "ucx: packing a remote key (ucp_rkey_pack)");
  }
  rkey_.assign(static_cast<std::byte*>(packed), static_cast<std::byte*>(packed) + size);
  ucp_rkey_buffer_release(packed);
}

registration::~registration() { ucp_mem_unmap(ctx_->get(), memh_); }

// ---- requests

struct request_state {
  request_state(worker& w, asio::any_io_executor ex) : owner(&w), executor(ex), done(std::move(ex)) {}
  worker* owner;  // holds this until the callback runs (worker::track)
  asio::any_io_executor executor;
  async::event done;
  ucs_status_t status = UCS_INPROGRESS;
  std::size_t length = 0;
  void* request = nullptr;  // outstanding, for a cancel
  bool receive = false;
  std::vector<ucp_dt_iov_t> iov;  // what UCX reads or writes through, kept until completion
};

namespace {

// Records the outcome (the request is freed: the state holds all that is left) and
// posts the waiter's wake-up; it runs inside ucp_worker_progress, on the executor.
void complete(void* request, ucs_status_t status, std::size_t length, void* user_data) {
  auto* raw = static_cast<request_state*>(user_data);
  std::shared_ptr<request_state> s = raw->owner->untrack(raw);
  if (!s) {  // (not tracked: cannot happen; nothing to wake)
    ucp_request_free(request);
    return;
  }
  s->status = status;
  s->length = length;
  s->request = nullptr;
  ucp_request_free(request);
  asio::post(s->executor, [s] { s->done.set(); });
}

void on_send(void* request, ucs_status_t status, void* user_data) { complete(request, status, 0, user_data); }

void on_receive(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  complete(request, status, info ? info->length : 0, user_data);
}

std::vector<ucp_dt_iov_t> iov_of(std::span<const asio::const_buffer> pieces) {
  std::vector<ucp_dt_iov_t> out;
  for (const auto& p : pieces)
    if (p.size() > 0) out.push_back({const_cast<void*>(p.data()), p.size()});
  return out;
}

}  // namespace

std::shared_ptr<request_state> worker::track(ucp_request_param_t& param, bool receive) {
  auto s = std::make_shared<request_state>(*this, executor_);
  s->receive = receive;
  param.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (receive)
    param.cb.recv = on_receive;
  else
    param.cb.send = on_send;
  param.user_data = s.get();
  outstanding_.emplace(s.get(), s);
  return s;
}

std::shared_ptr<request_state> worker::untrack(request_state* state) noexcept {
  auto it = outstanding_.find(state);
  if (it == outstanding_.end()) return {};
  std::shared_ptr<request_state> s = std::move(it->second);
  outstanding_.erase(it);
  return s;
}

asio::awaitable<std::size_t> worker::wait(ucs_status_ptr_t request, std::shared_ptr<request_state> state,
                                          std::chrono::milliseconds limit, std::string what) {
  if (!UCS_PTR_IS_PTR(request)) {
    // Completed (or failed) at once: the callback will not run (the caller has
    // untracked the state).
    const ucs_status_t s = UCS_PTR_STATUS(request);
    if (s != UCS_OK) throw_status(s, what);
    co_return 0;
  }
  state->request = request;
  kick();
  std::exception_ptr failure;
  try {
    co_await async::with_deadline(state->done.wait(), limit, what);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    if (state->request && state->receive && worker_) ucp_request_cancel(worker_, state->request);
    std::rethrow_exception(failure);
  }
  if (state->status != UCS_OK) throw_status(state->status, what);
  co_return state->length;
}

// ---- the worker and its event fd

struct worker::fd_waiter {
  explicit fd_waiter(asio::any_io_executor ex) : fd(ex) {}
  asio::posix::stream_descriptor fd;
  int efd = -1;
  bool waiting = false;
};

worker::worker(std::shared_ptr<context> ctx, asio::any_io_executor executor)
    : ctx_(std::move(ctx)), executor_(std::move(executor)) {
  ucp_worker_params_t p{};
  p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  p.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (auto s = ucp_worker_create(ctx_->get(), &p, &worker_); s != UCS_OK) throw_status(s, "ucx: ucp_worker_create");
  fd_ = std::make_unique<fd_waiter>(executor_);
  int efd = -1;
  if (auto s = ucp_worker_get_efd(worker_, &efd); s != UCS_OK) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    throw_status(s, "ucx: ucp_worker_get_efd");
  }
  fd_->efd = efd;
  fd_->fd.assign(efd);
}

std::shared_ptr<worker> worker::create(std::shared_ptr<context> ctx, asio::any_io_executor executor) {
  return std::shared_ptr<worker>(new worker(std::move(ctx), std::move(executor)));
}

worker::~worker() { close(); }

std::vector<std::byte> worker::address() const {
  ucp_address_t* a = nullptr;
  std::size_t n = 0;
  if (auto s = ucp_worker_get_address(worker_, &a, &n); s != UCS_OK) throw_status(s, "ucx: ucp_worker_get_address");
  std::vector<std::byte> out(reinterpret_cast<std::byte*>(a), reinterpret_cast<std::byte*>(a) + n);
  ucp_worker_release_address(worker_, a);
  return out;
}

void worker::kick() {
  if (drive_posted_ || !worker_) return;
  drive_posted_ = true;
  asio::post(executor_, [w = weak_from_this()] {
    if (auto self = w.lock()) self->drive();
  });
}

worker::engaged::engaged(std::shared_ptr<worker> w) : worker_(std::move(w)) {
  ++worker_->engaged_;
  worker_->kick();
}

worker::engaged::~engaged() {
  if (--worker_->engaged_ > 0 || !worker_->fd_ || !worker_->fd_->waiting) return;
  std::error_code ignored;
  worker_->fd_->fd.cancel(ignored);
}

void worker::drive() {
  drive_posted_ = false;
  if (!worker_) return;
  // A bounded batch of progress per turn of the loop: other handlers run between
  // batches, and a worker with nothing to do costs no CPU (it waits on its fd).
  for (int i = 0; i < 64; ++i) {
    if (ucp_worker_progress(worker_) == 0) {
      wait_for_events();
      return;
    }
  }
  kick();
}

void worker::wait_for_events() {
  // Empty the event fd's ready list (asio watches it edge-triggered: a new event
  // must make it readable again), then arm; events that came meanwhile make the
  // arm busy, and progress runs again.
  epoll_event events[16];
  while (epoll_wait(fd_->efd, events, 16, 0) == 16) {
  }
  const ucs_status_t s = ucp_worker_arm(worker_);
  if (s == UCS_ERR_BUSY) {
    kick();
    return;
  }
  if (fd_->waiting || engaged_ == 0) return;
  fd_->waiting = true;
  fd_->fd.async_wait(asio::posix::stream_descriptor::wait_read, [w = weak_from_this()](std::error_code ec) {
    auto self = w.lock();
    if (!self || !self->worker_) return;
    self->fd_->waiting = false;
    if (!ec) self->drive();
  });
}

void worker::close() noexcept {
  if (!worker_) return;
  if (fd_) {
    std::error_code ignored;
    fd_->fd.cancel(ignored);
    fd_->fd.release();  // the fd is UCX's: it goes with the worker
  }
  // What is still outstanding completes or is dropped now; nothing lands after.
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
  // Requests UCX dropped without a callback: their waiters (if any) wake cancelled.
  for (auto& [raw, s] : std::exchange(outstanding_, {})) {
    s->status = UCS_ERR_CANCELED;
    s->request = nullptr;
    try {
      asio::post(s->executor, [s = s] { s->done.set(); });
    } catch (...) {  // an executor gone: no waiter left to wake
    }
  }
}

// ---- endpoints

transport_report parse_ep_info(const std::string& text) {
  transport_report r;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto lane = line.find("lane[");
    if (lane == std::string::npos) continue;
    r.lanes += line.substr(lane) + "\n";
    // "lane[2]:  3:cma/memory.0 md[3] -> md[3]/cma/sysdev[255] rma_bw#0"
    const auto colon = line.find(':', lane);
    const auto colon2 = colon == std::string::npos ? colon : line.find(':', colon + 1);
    const auto slash = colon2 == std::string::npos ? colon2 : line.find('/', colon2);
    if (slash == std::string::npos) continue;
    const std::string name = line.substr(colon2 + 1, slash - colon2 - 1);
    auto add = [](std::vector<std::string>& v, const std::string& n) {
      if (std::find(v.begin(), v.end(), n) == v.end()) v.push_back(n);
    };
    add(r.transports, name);
    if (line.find(" rma_bw") != std::string::npos) {
      r.native_puts = true;
      add(r.put_transports, name);
    }
  }
  return r;
}

namespace {
void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  // Recorded only; the operations on the endpoint fail with it on their own.
  auto* failure = static_cast<ucs_status_t*>(arg);
  if (*failure == UCS_OK) *failure = status;
}

// Closes `ep` at once (forced: nothing waits for the peer).
void close_ep(ucp_worker_h, ucp_ep_h ep) noexcept {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // released when the close completes
}

// Whether every lane of `t` is UCX's tcp (or self).
bool only_tcp(const transport_report& t) {
  return !t.transports.empty() && std::all_of(t.transports.begin(), t.transports.end(),
                                              [](const std::string& n) { return n == "tcp" || n == "self"; });
}

ucs_status_t make_ep(ucp_worker_h w, std::span<const std::byte> address, ucp_err_handling_mode_t mode,
                     ucs_status_t* failure, ucp_ep_h* ep) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = mode;
  if (mode == UCP_ERR_HANDLING_MODE_PEER) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_handler.cb = on_ep_error;
    p.err_handler.arg = failure;
  }
  return ucp_ep_create(w, &p, ep);
}
}  // namespace

endpoint::endpoint(std::shared_ptr<worker> w, std::span<const std::byte> address, std::string who)
    : worker_(std::move(w)), failure_(std::make_shared<ucs_status_t>(UCS_OK)), who_(std::move(who)) {
  ucs_status_t s = make_ep(worker_->get(), address, UCP_ERR_HANDLING_MODE_PEER, failure_.get(), &ep_);
  if (s == UCS_ERR_UNREACHABLE) {
    // UCX's shared-memory transports (sysv, posix, cma) have no peer failure
    // handling: without it, the side channel is what notices a lost peer.
    peer_mode_ = false;
    s = make_ep(worker_->get(), address, UCP_ERR_HANDLING_MODE_NONE, nullptr, &ep_);
  } else if (s == UCS_OK && only_tcp(transports())) {
    // Peer failure handling took the endpoint to tcp where the peer is also
    // reachable over shared memory (UCX_TLS with both, as by default, on one host):
    // shared memory without UCX's failure handling, as above, moves the bytes at
    // memory speed (docs/benchmarks.md: 2.6x over UCX's tcp here).
    ucp_ep_h shared = nullptr;
    if (make_ep(worker_->get(), address, UCP_ERR_HANDLING_MODE_NONE, nullptr, &shared) == UCS_OK) {
      std::swap(ep_, shared);
      const auto t = transports();
      if (std::any_of(t.transports.begin(), t.transports.end(), shared_memory_transport)) {
        peer_mode_ = false;
      } else {
        std::swap(ep_, shared);  // no shared memory there either: keep the first
      }
      close_ep(worker_->get(), shared);
    }
  }
  if (s != UCS_OK) throw_status(s, who_ + ": creating an endpoint (ucp_ep_create)");
  worker_->kick();
}

bool shared_memory_transport(const std::string& name) {
  return name == "cma" || name == "posix" || name == "sysv" || name == "xpmem" || name == "knem";
}

endpoint::~endpoint() { close(); }

transport_report endpoint::transports() const {
  char* text = nullptr;
  std::size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (!f) return {};
  ucp_ep_print_info(ep_, f);
  std::fclose(f);
  std::string s(text, size);
  std::free(text);
  return parse_ep_info(s);
}

asio::awaitable<void> endpoint::flush(std::chrono::milliseconds limit, std::string what) {
  check_open(what);
  ucp_request_param_t p{};
  auto state = worker_->track(p, false);
  ucs_status_ptr_t r = ucp_ep_flush_nbx(ep_, &p);
  if (!UCS_PTR_IS_PTR(r)) worker_->untrack(state.get());
  co_await worker_->wait(r, state, limit, what);
  if (*failure_ != UCS_OK) throw_status(*failure_, what);
}

void endpoint::check_open(const std::string& what) const {
  if (!ep_ || !worker_->get()) throw_error(errc::cancelled, what + ": the UCX endpoint was closed");
}

void endpoint::close() noexcept {
  if (!ep_) return;
  if (worker_->get()) {
    close_ep(worker_->get(), ep_);
    worker_->kick();
  }
  ep_ = nullptr;
}

remote_key::remote_key(const endpoint& ep, std::span<const std::byte> packed, const std::string& what) {
  ep.check_open(what);
  if (auto s = ucp_ep_rkey_unpack(ep.get(), packed.data(), &rkey_); s != UCS_OK)
    throw_status(s, what + ": the worker's remote key does not unpack (ucp_ep_rkey_unpack)");
}

remote_key::~remote_key() {
  if (rkey_) ucp_rkey_destroy(rkey_);
}

// ---- data movement

asio::awaitable<void> put_all(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces, std::uint64_t remote,
                              const remote_key& rkey, std::chrono::milliseconds limit, std::string what) {
  const remote_range dest{remote, asio::buffer_size(pieces), &rkey};
  co_await put_scattered(w, ep, pieces, std::span(&dest, 1), limit, std::move(what));
}

asio::awaitable<void> put_scattered(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces,
                                    std::span<const remote_range> dest, std::chrono::milliseconds limit,
                                    std::string what) {
  std::uint64_t total = 0;
  for (const auto& d : dest) total += d.bytes;
  if (total != asio::buffer_size(pieces))
    throw_error(errc::protocol_error, what + ": " + std::to_string(asio::buffer_size(pieces)) +
                                          " bytes to put into remote ranges of " + std::to_string(total));
  // Over cma (and other copy-based transports) a put copies inside ucp_put_nbx,
  // on this event loop: at most max_put bytes per turn of the loop, so that other
  // handlers wait well under a millisecond for each.
  constexpr std::size_t max_put = 4u << 20;
  std::size_t since_yield = 0;
  std::size_t d = 0;         // the remote range being filled
  std::uint64_t filled = 0;  // bytes of it filled
  for (const auto& piece : pieces) {
    const auto* data = static_cast<const std::byte*>(piece.data());
    for (std::size_t at = 0; at < piece.size();) {
      while (filled == dest[d].bytes) {
        ++d;
        filled = 0;
      }
      const std::size_t n = static_cast<std::size_t>(
          std::min<std::uint64_t>({max_put - since_yield, piece.size() - at, dest[d].bytes - filled}));
      ep.check_open(what);
      ucp_request_param_t p{};
      // No callback: the flush below completes them all; a request is released by
      // UCX when it completes.
      ucs_status_ptr_t r = ucp_put_nbx(ep.get(), data + at, n, dest[d].address + filled, dest[d].rkey->get(), &p);
      if (UCS_PTR_IS_ERR(r)) throw_status(UCS_PTR_STATUS(r), what + " (ucp_put_nbx)");
      if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
      filled += n;
      at += n;
      since_yield += n;
      if (since_yield == max_put) {
        since_yield = 0;
        co_await asio::post(w.executor(), asio::use_awaitable);
      }
    }
  }
  w.kick();
  co_await ep.flush(limit, what + " (flush)");
}

asio::awaitable<void> tag_send(worker& w, endpoint& ep, std::span<const asio::const_buffer> pieces, std::uint64_t tag,
                               std::chrono::milliseconds limit, std::string what) {
  ep.check_open(what);
  ucp_request_param_t p{};
  auto state = w.track(p, false);
  state->iov = iov_of(pieces);
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
  p.datatype = ucp_dt_make_iov();
  ucs_status_ptr_t r = ucp_tag_send_nbx(ep.get(), state->iov.data(), state->iov.size(), tag, &p);
  if (!UCS_PTR_IS_PTR(r)) w.untrack(state.get());
  co_await w.wait(r, state, limit, what + " (ucp_tag_send_nbx)");
  if (ep.failure() != UCS_OK) throw_status(ep.failure(), what);
}

tag_receive::tag_receive(std::shared_ptr<worker> w, std::span<const asio::mutable_buffer> dest, std::uint64_t tag,
                         std::string what)
    : worker_(std::move(w)), what_(std::move(what)) {
  // A worker closed under an update (a disconnect) takes no more receives.
  if (!worker_->get()) throw_error(errc::cancelled, what_ + ": the UCX worker was closed");
  ucp_request_param_t p{};
  state_ = worker_->track(p, true);
  for (const auto& d : dest) {
    if (d.size() > 0) state_->iov.push_back({d.data(), d.size()});
    bytes_ += d.size();
  }
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.datatype = ucp_dt_make_iov();
  request_ = ucp_tag_recv_nbx(worker_->get(), state_->iov.data(), state_->iov.size(), tag, ~ucp_tag_t{0}, &p);
  if (!UCS_PTR_IS_PTR(request_)) {
    worker_->untrack(state_.get());
    const ucs_status_t s = UCS_PTR_STATUS(request_);
    request_ = nullptr;
    throw_status(s == UCS_OK ? UCS_ERR_IO_ERROR : s, what_ + " (ucp_tag_recv_nbx)");
  }
  state_->request = request_;
  worker_->kick();
}

tag_receive::~tag_receive() { cancel(); }

void tag_receive::cancel() noexcept {
  if (state_ && state_->request && worker_->get()) ucp_request_cancel(worker_->get(), state_->request);
}

asio::awaitable<void> tag_receive::wait(std::chrono::milliseconds limit) {
  worker_->kick();
  co_await async::with_deadline(state_->done.wait(), limit, what_);
  if (state_->status != UCS_OK) throw_status(state_->status, what_);
  if (state_->length != bytes_)
    throw_error(errc::protocol_error,
                what_ + ": expected " + std::to_string(bytes_) + " bytes, " + std::to_string(state_->length) + " came");
}

}  // namespace refit::ucx
