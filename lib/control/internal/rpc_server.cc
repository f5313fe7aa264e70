#include <refit/control/internal/rpc_server.h>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <refit/backend/async/offload.h>
#include <refit/backend/handshake.h>
#include <refit/backend/net.h>

namespace refit::control::internal {

namespace {

json error_answer(const json& id, std::string_view kind, const std::string& message) {
  return {{"id", id}, {"error", {{"kind", kind}, {"message", message}}}};
}

// Frames this large leave many freed small blocks behind; give them back to the
// system (off the event loop) so a big update_info does not stay resident.
constexpr std::size_t trim_after_bytes = 1 << 20;
// Requests at least this large are parsed off the event loop (about 1 ms of CPU).
constexpr std::size_t large_request_bytes = 64 << 10;

// Whether `j` has more than `budget` values (counted until the budget runs out, so
// the check itself stays a few microseconds): such answers are serialized, and
// freed, off the event loop.
bool larger_than(const json& j, std::size_t& budget) {
  if (budget == 0) return true;
  --budget;
  if (j.is_structured())
    for (const auto& v : j)
      if (larger_than(v, budget)) return true;
  return false;
}
bool large_answer(const json& j) {
  std::size_t budget = 2048;
  return larger_than(j, budget);
}

}  // namespace

rpc_connection::rpc_connection(std::uint64_t id, std::string peer, std::shared_ptr<frame_stream> stream)
    : id(id), peer(std::move(peer)), stream(std::move(stream)), request_done(this->stream->socket().get_executor()) {}

std::string rpc_connection::name() const { return "connection #" + std::to_string(id) + " (" + peer + ")"; }

rpc_server::rpc_server(asio::any_io_executor loop, std::function<asio::any_io_executor()> offload, std::string secret,
                       std::chrono::milliseconds timeout, host_limits limits, events on)
    : loop_(std::move(loop)), offload_(std::move(offload)), secret_(std::move(secret)), timeout_(timeout),
      limits_(limits), on_(std::move(on)) {}

void rpc_server::add_builtin(const std::string& name, handler h) { builtins_[name] = std::move(h); }

std::size_t rpc_server::in_flight(std::uint64_t id) const noexcept {
  auto it = connections_.find(id);
  return it == connections_.end() ? 0 : it->second->in_flight;
}

std::uint16_t rpc_server::listen(const std::string& host, std::uint16_t port) {
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(loop_, host, port));
  return acceptor_->local_endpoint().port();
}

asio::awaitable<void> rpc_server::serve() {
  if (!acceptor_) throw_error(errc::invalid_state, "worker_host: serve before listen");
  asio::steady_timer pause(loop_);
  std::chrono::milliseconds backoff(0);
  while (!stopped_) {
    asio::ip::tcp::socket socket(loop_);
    std::error_code failed;
    co_await acceptor_->async_accept(socket, asio::redirect_error(asio::use_awaitable, failed));
    if (failed) {
      if (stopped_ || failed == asio::error::operation_aborted) break;
      // Out of descriptors (EMFILE, ENFILE) or memory: serving goes on, but an
      // accept retried at once fails at once, forever. Back off (up to 1 s) and say so.
      ++accept_errors_;
      last_accept_error_ = "control: accepting a connection failed: " + net::describe(failed) + " (" +
                           std::to_string(accept_errors_) + " failures so far)";
      backoff = std::clamp(backoff * 2, std::chrono::milliseconds(5), std::chrono::milliseconds(1000));
      pause.expires_after(backoff);
      std::error_code ignored;
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
      continue;
    }
    backoff = std::chrono::milliseconds(0);
    net::tune(socket);
    std::string peer = "?";
    {
      std::error_code ec;
      auto ep = socket.remote_endpoint(ec);
      if (!ec) peer = ep.address().to_string() + ":" + std::to_string(ep.port());
    }
    if (connections_.size() >= limits_.max_connections) {
      asio::co_spawn(loop_, refuse(std::move(socket), std::move(peer)), asio::detached);
      continue;
    }
    const std::uint64_t id = next_connection_++;
    auto c =
        std::make_shared<rpc_connection>(id, peer, std::make_shared<frame_stream>(std::move(socket), limits_.frames));
    connections_.emplace(id, c);
    asio::co_spawn(loop_, serve_connection(c), asio::detached);
  }
}

asio::awaitable<void> rpc_server::refuse(asio::ip::tcp::socket socket, std::string peer) {
  refused_ = "control: connection from " + peer +
             " refused: resource_exhausted: " + std::to_string(connections_.size()) +
             " connections already (the limit)";
  co_await auth::refuse_busy(socket, limits_.handshake_timeout, "control: connection from " + peer);
  std::error_code ignored;
  socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
}

asio::awaitable<bool> rpc_server::admit(rpc_connection& c, asio::steady_timer& throttle) {
  // Back-pressure: with max_requests_in_flight being handled, stop reading (the
  // peer's frames wait in the kernel) until one is answered.
  while (c.in_flight >= limits_.max_requests_in_flight) {
    c.request_done.reset();
    co_await c.request_done.wait();
  }
  if (limits_.max_requests_per_second <= 0) co_return true;
  // The request rate: a token bucket with a burst of max_requests_in_flight.
  const double burst = static_cast<double>(std::max<std::size_t>(1, limits_.max_requests_in_flight));
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    c.tokens = std::min(
        burst, c.tokens + std::chrono::duration<double>(now - c.refilled).count() * limits_.max_requests_per_second);
    c.refilled = now;
    if (c.tokens >= 1) break;
    throttle.expires_after(std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::duration<double>((1 - c.tokens) / limits_.max_requests_per_second)));
    std::error_code ignored;
    co_await throttle.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
    if (!c.stream->is_open()) co_return false;
  }
  c.tokens -= 1;
  co_return true;
}

asio::awaitable<void> rpc_server::serve_connection(std::shared_ptr<rpc_connection> c) {
  struct closing {
    rpc_server* server;
    rpc_connection* c;
    ~closing() {
      server->connections_.erase(c->id);
      if (server->on_.closed) server->on_.closed(*c);
    }
  } on_exit{this, c.get()};
  // No frame is read from a peer that has not proved the shared secret, and a
  // peer that stays silent is cut at the handshake deadline.
  try {
    co_await auth::as_server(c->stream->socket(), secret_, limits_.handshake_timeout,
                             "control: connection from " + c->peer);
  } catch (const error& e) {
    refused_ =
        "control: connection from " + c->peer + " refused: " + std::string(errc_name(e.kind())) + ": " + e.message();
    c->stream->close();
    co_return;
  }
  c->tokens = static_cast<double>(std::max<std::size_t>(1, limits_.max_requests_in_flight));
  asio::steady_timer throttle(loop_);
  for (;;) {
    if (!co_await admit(*c, throttle)) co_return;
    json request;
    json refusal;
    json refused_id;  // a refused frame's id, when it could be read
    bool framing_intact = false;
    try {
      std::string text = co_await c->stream->read_text(timeout_, /*idle_ok=*/true, "control request");
      // The whole body was read: whatever it holds, the next frame starts after it.
      framing_intact = true;
      if (on_.frame_read) on_.frame_read(*c);
      // A large request (an update_info of thousands of tensors) is parsed on the
      // offload executor: about 10 ms of CPU per MB the event loop must not spend.
      if (text.size() < large_request_bytes) {
        request = parse_frame_body(text, "control request", limits_.frames.max_values, &refused_id);
      } else {
        const std::string* body = &text;
        json* id = &refused_id;
        const std::size_t max_values = limits_.frames.max_values;
        request = co_await async::offload(
            offload_(), [body, max_values, id] { return parse_frame_body(*body, "control request", max_values, id); });
      }
    } catch (const error& e) {
      // A peer that closed is the normal end; a refused frame is answered. A body
      // that is not JSON (id null: it cannot be read), nests too deep or holds too
      // many values (with its id where the JSON is well-formed, so the caller's
      // call fails with the reason rather than its client dropping an answer it
      // cannot route) leaves the framing intact and the connection is served on;
      // an oversized length ends it (its framing can no longer be trusted).
      if (e.kind() != errc::protocol_error || !c->stream->is_open()) {
        c->stream->close();
        co_return;
      }
      std::string message = e.message();
      if (!framing_intact)
        message += " (the connection is closed)";
      else if (refused_id.is_null())
        message += " (the request's id cannot be read: this answer's is null)";
      refusal = error_answer(refused_id, errc_name(e.kind()), message);
    }
    if (!refusal.is_null()) {
      bool written = true;
      try {
        co_await c->stream->write(refusal, timeout_, "control answer");
      } catch (const error&) {
        written = false;
      }
      if (framing_intact && written && c->stream->is_open()) continue;
      c->stream->close();
      co_return;
    }
    const std::size_t bytes = c->stream->last_frame_bytes();
    ++c->in_flight;
    asio::co_spawn(loop_, handle(c, std::move(request), bytes), asio::detached);
  }
}

asio::awaitable<void> rpc_server::handle(std::shared_ptr<rpc_connection> c, json request, std::size_t frame_bytes) {
  json id = nullptr;
  json answer;
  try {
    control_request req = parse_request(std::move(request), id);
    request = json();
    json result;
    handler call;  // a copy: the handler may replace methods while running
    if (auto b = builtins_.find(req.method); b != builtins_.end()) {
      call = b->second;
    } else if (auto m = methods_.find(req.method); m != methods_.end()) {
      call = m->second;
    } else {
      std::string known;
      for (const auto& [n, h] : builtins_) known += (known.empty() ? "" : ", ") + n;
      for (const auto& [n, h] : methods_) known += ", " + n;
      throw_error(errc::invalid_argument, "unknown method '" + req.method + "' (methods: " + known + ")");
    }
    result = co_await call(*c, std::move(req.params));
    answer = json::object();
    answer["id"] = id;
    answer["result"] = std::move(result);
  } catch (const error& e) {
    answer = error_answer(id, errc_name(e.kind()), e.message());
  } catch (const std::exception& e) {
    answer = error_answer(id, "io_error", e.what());
  }
  try {
    if (!large_answer(answer)) {
      co_await c->stream->write(answer, timeout_, "control answer");
    } else {
      // A large answer (the fingerprints of a whole model) is serialized and freed
      // on the offload executor: milliseconds per thousand tensors.
      json* a = &answer;
      std::string text = co_await async::offload(offload_(), [a] {
        std::string t = a->dump();
        *a = json();
        return t;
      });
      co_await c->stream->write_text(std::move(text), timeout_, "control answer");
    }
  } catch (const error&) {
    c->stream->close();  // the trainer went away; its calls fail on its side
  }
  answer = json();
  --c->in_flight;
  c->request_done.set();
  if (on_.request_ended) on_.request_ended(*c);
#if defined(__GLIBC__)
  if (frame_bytes >= trim_after_bytes) asio::post(offload_(), [] { malloc_trim(0); });
#endif
}

void rpc_server::stop() {
  stopped_ = true;
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
  for (auto& [id, c] : connections_) c->stream->close();
}

}  // namespace refit::control::internal
