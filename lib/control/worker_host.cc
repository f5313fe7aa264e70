#include <refit/control/worker_host.h>

#include <refit/control/internal/frame.h>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <refit/backend/async/event.h>
#include <refit/backend/async/offload.h>
#include <refit/backend/handshake.h>
#include <refit/backend/net.h>
#include <refit/integrity/fingerprint.h>
#include <refit/internal/engine_access.h>

namespace refit::control {

// One control connection, alive while it is served (and while its requests run).
struct worker_host::connection {
  connection(std::uint64_t id, std::string peer, std::shared_ptr<frame_stream> stream)
      : id(id), peer(std::move(peer)), stream(std::move(stream)), request_done(this->stream->socket().get_executor()) {}
  std::uint64_t id;
  std::string peer;
  std::shared_ptr<frame_stream> stream;
  std::size_t in_flight = 0;  // requests being handled
  async::event request_done;  // set when one finishes
  double tokens = 0;          // the request-rate bucket
  std::chrono::steady_clock::time_point refilled = std::chrono::steady_clock::now();
  std::string name() const { return "connection #" + std::to_string(id) + " (" + peer + ")"; }
};

// The timer of one session's silence watch. Shared with its coroutine, which
// touches the host only while `alive` (stop() and the destructor clear it).
struct worker_host::session_watch {
  explicit session_watch(const asio::any_io_executor& ex) : timer(ex) {}
  asio::steady_timer timer;
  bool alive = true;
};

namespace {

// Method bodies are read strictly, like engine infos: unknown members are errors.
json_reader params_reader(const json& params, const std::string& method) {
  return json_reader(params, method + " params");
}

json error_answer(const json& id, std::string_view kind, const std::string& message) {
  return {{"id", id}, {"error", {{"kind", kind}, {"message", message}}}};
}

// A hook's failure as the error a verb answers with: a refit::error keeps its kind,
// anything else is processing_failed (the application's code threw).
error hook_error(const std::string& verb, const char* hook, std::exception_ptr e) {
  errc kind = errc::processing_failed;
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    if (x.kind() != errc{}) kind = x.kind();
  } catch (...) {
  }
  return error(kind, verb + ": the application's " + hook + " hook failed: " + error_message_of(e));
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

worker_host::worker_host(weight_transfer_config config, engine_context context, load_weights_fn load_weights,
                         engine_factory& factory, host_limits limits)
    : config_(std::move(config)), context_(std::move(context)), load_weights_(std::move(load_weights)), limits_(limits),
      engine_(factory.create_engine(config_, context_)), session_(*engine_) {
  limits_.handshake_timeout = std::min(limits_.handshake_timeout, config_.timeout);
  if (limits_.session_timeout.count() <= 0) limits_.session_timeout = config_.timeout;
  add_verb("init_weight_transfer_engine", [this](connection& caller, json params) -> asio::awaitable<json> {
    auto r = params_reader(params, "init_weight_transfer_engine");
    json init_info = r.required<json>("init_info");
    r.finish();
    if (session_.active()) {
      if (owner_ != caller.id) {
        const auto silent =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - owner_heard_);
        throw_error(errc::invalid_state,
                    "init_weight_transfer_engine: refused while the weight update session started by " + owner_name() +
                        " is open (finish it, or close that connection; its owner has been silent for " +
                        std::to_string(silent.count()) + " ms, and the session is aborted after " +
                        std::to_string(limits_.session_timeout.count()) + " ms of silence)");
      }
      if (session_.receiving())
        throw_error(errc::invalid_state,
                    "init_weight_transfer_engine: a chunk of this connection's update is "
                    "still being received");
    }
    std::exception_ptr failure;
    try {
      auto info = engine_->parse_init_info(init_info);
      // The owner re-initialises during its own session: that session ends here
      // (dirty if any of it was applied).
      const bool ends_session = session_.active();
      co_await session_.abort_weight_update("the engine was re-initialised during it");
      owner_.reset();
      if (ends_session)
        update_failed(
            "init_weight_transfer_engine: the weight update session was aborted: the engine was "
            "re-initialised during it");
      co_await engine_->init_transfer_engine(*info);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      note_error("init_weight_transfer_engine", failure);
      std::rethrow_exception(failure);
    }
    json answer = json::object();
    if (auto t = engine_->transport_info(); !t.is_null()) answer["transport"] = std::move(t);
    co_return answer;
  });
  add_verb("start_weight_update", [this](connection& caller, json params) -> asio::awaitable<json> {
    auto r = params_reader(params, "start_weight_update");
    r.finish();
    if (session_.active() && owner_ != caller.id)
      throw_error(errc::invalid_state,
                  "start_weight_update: the weight update session started by " + owner_name() + " is open");
    session_.start_weight_update();
    owner_ = caller.id;
    owner_peer_ = caller.peer;
    owner_left_ = false;
    if (silenced_ == caller.id) silenced_.reset();
    owner_heard_ = std::chrono::steady_clock::now();
    ++session_generation_;
    watch_session();
    if (std::exception_ptr refused = update_started()) {
      // The application refused the session: it closes again before anything of
      // it was received (the weights are untouched).
      co_await session_.abort_weight_update("the application's on_update_started hook refused it");
      owner_.reset();
      auto e = std::make_exception_ptr(hook_error("start_weight_update", "on_update_started", refused));
      note_error("start_weight_update", e);
      std::rethrow_exception(e);
    }
    co_return json::object();
  });
  add_verb("update_weights", [this](connection& caller, json params) -> asio::awaitable<json> {
    require_owner(caller, "update_weights");
    std::exception_ptr failure;
    try {
      // Refused before its update_info is read (off the loop) as after.
      if (session_.receiving())
        throw_error(errc::invalid_state, "update_weights: another chunk of this update is still being received");
      std::unique_ptr<update_info> info;
      try {
        auto r = params_reader(params, "update_weights");
        if (!r.has("update_info")) r.fail("missing required member 'update_info'");  // read in place, not copied
        r.finish();
        info = co_await engine_->read_update_info(params["update_info"]);
      } catch (const error& e) {
        // The trainer is about to send this update: tell it at once why it is
        // refused rather than let it wait for a worker that reads nothing.
        internal::engine_access::refuse_update(*engine_, e.kind(), "update_weights: " + e.message());
        throw;
      }
      params = json();  // the typed info is all that is needed now: free the parsed frame
      const commit_mode mode = info->commit.value_or(config_.commit);
      if (!session_.receiving()) receiving_commit_ = mode;  // else refused below: another chunk is
      co_await session_.update_weights(*info, load_weights_);
      applied_commit_ = mode;
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      // A failed chunk ends the session: the next start_weight_update begins clean.
      note_error("update_weights", failure);
      const bool was_active = session_.active();
      co_await session_.abort_weight_update("its chunk failed: " + error_message_of(failure));
      owner_.reset();
      if (was_active && !session_.active()) update_failed(last_error_);
      std::rethrow_exception(failure);
    }
    if (owner_left_) co_await end_session_after_owner_left();
    co_return json{{"stats", engine_->last_update_stats().to_json()}};
  });
  add_verb("finish_weight_update", [this](connection& caller, json params) -> asio::awaitable<json> {
    require_owner(caller, "finish_weight_update");
    auto r = params_reader(params, "finish_weight_update");
    auto version = r.maybe<std::int64_t>("weight_version");
    r.finish();
    std::exception_ptr failure;
    try {
      co_await session_.finish_weight_update(version);
    } catch (...) {
      failure = std::current_exception();
    }
    if (!session_.active()) owner_.reset();
    if (failure) {
      note_error("finish_weight_update", failure);
      if (!session_.active()) update_failed(last_error_);  // it closed, unrecorded
      std::rethrow_exception(failure);
    }
    last_error_.clear();
    json stats = engine_->last_update_stats().to_json();
    if (engine_->weights_dirty()) {
      update_failed("finish_weight_update: the session finished with the weights dirty: " + engine_->dirty_reason());
    } else if (std::exception_ptr failed = update_finished(stats)) {
      auto e = std::make_exception_ptr(hook_error("finish_weight_update", "on_update_finished", failed));
      note_error("finish_weight_update", e);
      std::rethrow_exception(e);
    }
    co_return json{{"stats", std::move(stats)}};
  });
  add_verb("weight_fingerprint", [this](connection&, json params) -> asio::awaitable<json> {
    auto r = params_reader(params, "weight_fingerprint");
    auto names = r.optional<std::vector<std::string>>("names", {});
    r.finish();
    if (!context_.model)
      throw_error(errc::unsupported, "weight_fingerprint: this worker was created without a model target");
    // Hashing a model reads all of it: not on the event loop.
    auto* model = context_.model;
    // (Captures by pointer and reference only: GCC 12 may destroy a lambda that owns
    // memory twice when it is a temporary of a co_await expression.)
    // (Its JSON is built there too: a map of every tensor.)
    json answer = co_await async::offload(internal::engine_access::processing_executor(*engine_),
                                          [model, &names] { return fingerprints_to_json(model->fingerprint(names)); });
    answer["weight_version"] = session_.weight_version() ? json(*session_.weight_version()) : json(nullptr);
    answer["state"] = weight_state();
    co_return answer;
  });
  add_verb("weight_info", [this](connection&, json params) -> asio::awaitable<json> {
    auto r = params_reader(params, "weight_info");
    r.finish();
    co_return weight_info();
  });
}

worker_host::~worker_host() { stop(); }

void worker_host::add_verb(const std::string& name, verb v) { verbs_[name] = std::move(v); }

void worker_host::add_method(const std::string& name, method m) {
  if (verbs_.count(name))
    throw_error(errc::invalid_argument, "worker_host: '" + name + "' is a built-in verb and cannot be replaced");
  methods_[name] = std::move(m);
}

void worker_host::note_error(const std::string& method, std::exception_ptr e) {
  last_error_ = method + ": " + std::string(errc_name(error_kind_of(e))) + ": " + error_message_of(e);
}

void worker_host::set_hooks(update_hooks hooks) { hooks_ = std::move(hooks); }

void worker_host::note_hook_error(const char* hook, std::exception_ptr e) noexcept {
  try {
    last_hook_error_ = std::string(hook) + ": " + std::string(errc_name(error_kind_of(e))) + ": " + error_message_of(e);
  } catch (...) {
  }
}

std::exception_ptr worker_host::update_started() noexcept {
  if (!hooks_.on_update_started) return nullptr;
  try {
    auto hook = hooks_.on_update_started;  // a copy: the hook may replace the hooks
    hook(owner_name());
  } catch (...) {
    note_hook_error("on_update_started", std::current_exception());
    return std::current_exception();
  }
  return nullptr;
}

std::exception_ptr worker_host::update_finished(const json& stats) noexcept {
  if (!hooks_.on_update_finished) return nullptr;
  try {
    auto hook = hooks_.on_update_finished;
    hook(session_.weight_version().value_or(-1), stats);
  } catch (...) {
    note_hook_error("on_update_finished", std::current_exception());
    return std::current_exception();
  }
  return nullptr;
}

void worker_host::update_failed(const std::string& reason) noexcept {
  if (!hooks_.on_update_failed) return;
  try {
    auto hook = hooks_.on_update_failed;
    hook(reason);
  } catch (...) {
    note_hook_error("on_update_failed", std::current_exception());
  }
}

std::string worker_host::owner_name() const {
  if (!owner_) return "nobody";
  return "connection #" + std::to_string(*owner_) + " (" + owner_peer_ + ")";
}

void worker_host::require_owner(const connection& caller, const std::string& method) const {
  // A trainer that froze and resumed learns why its session is gone.
  const std::string silenced = silenced_ == caller.id
                                   ? " (this connection's weight update session was aborted: " + silenced_why_ + ")"
                                   : std::string();
  if (!session_.active())
    throw_error(errc::invalid_state, method + ": no active weight update (call start_weight_update first)" + silenced);
  if (owner_ != caller.id)
    throw_error(errc::invalid_state, method + ": the weight update session belongs to " + owner_name() + ", not to " +
                                         caller.name() + silenced);
}

void worker_host::heard_from(const connection& c) noexcept {
  if (owner_ && *owner_ == c.id) owner_heard_ = std::chrono::steady_clock::now();
}

bool worker_host::owner_busy() const noexcept {
  if (session_.receiving()) return true;
  if (!owner_) return false;
  auto it = connections_.find(*owner_);
  return it != connections_.end() && it->second->in_flight > 0;
}

void worker_host::watch_session() {
  end_watch();
  watch_ = std::make_shared<session_watch>(context_.executor);
  asio::co_spawn(context_.executor, watch(watch_, session_generation_), asio::detached);
}

void worker_host::end_watch() noexcept {
  if (!watch_) return;
  watch_->alive = false;
  watch_->timer.cancel();
  watch_.reset();
}

asio::awaitable<void> worker_host::watch(std::shared_ptr<session_watch> w, std::uint64_t generation) {
  for (;;) {
    // The host may be gone: nothing of it is touched unless the watch is alive.
    if (!w->alive || !session_.active() || session_generation_ != generation) co_return;
    const auto now = std::chrono::steady_clock::now();
    // A chunk being received has its own deadlines, and a request of the owner's
    // still running is not silence; the clock restarts when they end.
    const bool busy = owner_busy();
    const auto due = (busy ? now : owner_heard_) + limits_.session_timeout;
    if (!busy && now >= due) {
      co_await abort_silent_session();
      co_return;
    }
    w->timer.expires_at(due);
    std::error_code ignored;
    co_await w->timer.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  }
}

asio::awaitable<void> worker_host::abort_silent_session() {
  const auto silent =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - owner_heard_);
  const std::string why = "its owner, " + owner_name() + ", sent nothing for " + std::to_string(silent.count()) +
                          " ms: no request, no data; the session timeout is " +
                          std::to_string(limits_.session_timeout.count()) + " ms";
  const std::optional<std::uint64_t> owner = owner_;
  owner_.reset();
  owner_left_ = false;
  watch_.reset();  // this coroutine's own watch: it ends here
  try {
    co_await session_.abort_weight_update(why);
  } catch (const error&) {
    // a chunk started meanwhile (cannot happen: the owner was silent): its end decides
    owner_ = owner;
    co_return;
  }
  silenced_ = owner;
  silenced_why_ = why;
  last_error_ = "weight update session aborted: " + why;
  update_failed("the weight update session was aborted: " + why);
}

std::string worker_host::weight_state() const {
  if (engine_->weights_dirty()) return "dirty";
  // A finish that is still committing is changing the model: not clean yet.
  return session_.active() || session_.finishing() ? "updating" : "clean";
}

json worker_host::weight_info() const {
  json info = {
      {"backend", engine_->backend()},
      {"initialized", engine_->initialized()},
      {"defers_processing", engine_->defers_processing()},
      {"session_active", session_.active()},
      {"receiving", engine_->receiving()},
      {"state", weight_state()},
      {"commit", to_string(session_.receiving() && receiving_commit_ ? *receiving_commit_
                                                                     : applied_commit_.value_or(config_.commit))},
      {"default_commit", to_string(config_.commit)},
      {"last_update", engine_->last_update_stats().to_json()},
      {"connections", connections_.size()},
      {"accept_errors", accept_errors_},
      {"transport", engine_->transport_info()}};
  info["session_owner"] = session_.active() && owner_ ? json(owner_name()) : json(nullptr);
  info["session_timeout_ms"] = limits_.session_timeout.count();
  info["session_chunks"] = session_.active() ? json(session_.chunks()) : json(nullptr);
  info["session_idle_ms"] =
      session_.active() && owner_
          ? json(owner_busy() ? std::int64_t{0}
                              : static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                              std::chrono::steady_clock::now() - owner_heard_)
                                                              .count()))
          : json(nullptr);
  info["weight_version"] = session_.weight_version() ? json(*session_.weight_version()) : json(nullptr);
  info["dirty_reason"] = engine_->weights_dirty() ? json(engine_->dirty_reason()) : json(nullptr);
  info["last_error"] = last_error_.empty() ? json(nullptr) : json(last_error_);
  info["last_hook_error"] = last_hook_error_.empty() ? json(nullptr) : json(last_hook_error_);
  info["last_refused_connection"] = refused_.empty() ? json(nullptr) : json(refused_);
  info["last_accept_error"] = last_accept_error_.empty() ? json(nullptr) : json(last_accept_error_);
  return info;
}

std::uint16_t worker_host::listen(const std::string& host, std::uint16_t port) {
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, host, port));
  return acceptor_->local_endpoint().port();
}

asio::awaitable<void> worker_host::serve() {
  if (!acceptor_) throw_error(errc::invalid_state, "worker_host: serve before listen");
  asio::steady_timer pause(context_.executor);
  std::chrono::milliseconds backoff(0);
  while (!stopped_) {
    asio::ip::tcp::socket socket(context_.executor);
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
      asio::co_spawn(context_.executor, refuse(std::move(socket), std::move(peer)), asio::detached);
      continue;
    }
    const std::uint64_t id = next_connection_++;
    auto c = std::make_shared<connection>(id, peer, std::make_shared<frame_stream>(std::move(socket), limits_.frames));
    connections_.emplace(id, c);
    asio::co_spawn(context_.executor, serve_connection(c), asio::detached);
  }
}

asio::awaitable<void> worker_host::refuse(asio::ip::tcp::socket socket, std::string peer) {
  refused_ = "control: connection from " + peer +
             " refused: resource_exhausted: " + std::to_string(connections_.size()) +
             " connections already (the limit)";
  co_await auth::refuse_busy(socket, limits_.handshake_timeout, "control: connection from " + peer);
  std::error_code ignored;
  socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
  socket.close(ignored);
}

asio::awaitable<void> worker_host::serve_connection(std::shared_ptr<connection> c) {
  struct closing {
    worker_host* host;
    connection* c;
    ~closing() { host->connection_closed(*c); }
  } on_exit{this, c.get()};
  // No frame is read from a peer that has not proved the shared secret, and a
  // peer that stays silent is cut at the handshake deadline.
  try {
    co_await auth::as_server(c->stream->socket(), config_.auth_secret, limits_.handshake_timeout,
                             "control: connection from " + c->peer);
  } catch (const error& e) {
    refused_ =
        "control: connection from " + c->peer + " refused: " + std::string(errc_name(e.kind())) + ": " + e.message();
    c->stream->close();
    co_return;
  }
  c->tokens = static_cast<double>(std::max<std::size_t>(1, limits_.max_requests_in_flight));
  asio::steady_timer throttle(context_.executor);
  for (;;) {
    // Back-pressure: with max_requests_in_flight being handled, stop reading (the
    // peer's frames wait in the kernel) until one is answered.
    while (c->in_flight >= limits_.max_requests_in_flight) {
      c->request_done.reset();
      co_await c->request_done.wait();
    }
    if (limits_.max_requests_per_second > 0) {
      const double burst = static_cast<double>(std::max<std::size_t>(1, limits_.max_requests_in_flight));
      for (;;) {
        const auto now = std::chrono::steady_clock::now();
        c->tokens = std::min(burst, c->tokens + std::chrono::duration<double>(now - c->refilled).count() *
                                                    limits_.max_requests_per_second);
        c->refilled = now;
        if (c->tokens >= 1) break;
        throttle.expires_after(std::chrono::duration_cast<std::chrono::microseconds>(
            std::chrono::duration<double>((1 - c->tokens) / limits_.max_requests_per_second)));
        std::error_code ignored;
        co_await throttle.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
        if (!c->stream->is_open()) co_return;
      }
      c->tokens -= 1;
    }
    json request;
    json refusal;
    json refused_id;  // a refused frame's id, when it could be read
    bool framing_intact = false;
    try {
      std::string text = co_await c->stream->read_text(config_.timeout, /*idle_ok=*/true, "control request");
      // The whole body was read: whatever it holds, the next frame starts after it.
      framing_intact = true;
      heard_from(*c);  // the session's owner is not silent
      // A large request (an update_info of thousands of tensors) is parsed on the
      // processing executor: about 10 ms of CPU per MB the event loop must not spend.
      if (text.size() < large_request_bytes) {
        request = parse_frame_body(text, "control request", limits_.frames.max_values, &refused_id);
      } else {
        const std::string* body = &text;
        json* id = &refused_id;
        const std::size_t max_values = limits_.frames.max_values;
        request = co_await async::offload(
            internal::engine_access::processing_executor(*engine_),
            [body, max_values, id] { return parse_frame_body(*body, "control request", max_values, id); });
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
        co_await c->stream->write(refusal, config_.timeout, "control answer");
      } catch (const error&) {
        written = false;
      }
      if (framing_intact && written && c->stream->is_open()) continue;
      c->stream->close();
      co_return;
    }
    const std::size_t bytes = c->stream->last_frame_bytes();
    ++c->in_flight;
    asio::co_spawn(context_.executor, handle(c, std::move(request), bytes), asio::detached);
  }
}

void worker_host::connection_closed(connection& c) {
  connections_.erase(c.id);
  if (silenced_ == c.id) silenced_.reset();
  if (!session_.active() || owner_ != c.id) return;
  // The trainer that owns the open session is gone: nobody may finish it.
  if (session_.receiving()) {
    owner_left_ = true;  // ended when its chunk ends (update_weights)
    return;
  }
  asio::co_spawn(context_.executor, end_session_after_owner_left(), asio::detached);
}

asio::awaitable<void> worker_host::end_session_after_owner_left() {
  const std::string who = owner_name();
  owner_.reset();
  owner_left_ = false;
  if (!session_.active()) co_return;
  const std::string why = "its owner, " + who + ", closed its connection before finishing it";
  bool ended = false;
  try {
    co_await session_.abort_weight_update(why);
    ended = true;
  } catch (const error&) {
    // a chunk started meanwhile: its end decides
  }
  if (ended) {
    end_watch();
    // No verb failed: last_error says what happened (and dirty_reason, when an
    // in_place chunk of it was applied; staged chunks were discarded).
    last_error_ = "weight update session aborted: " + why;
    update_failed("the weight update session was aborted: " + why);
  }
}

asio::awaitable<void> worker_host::handle(std::shared_ptr<connection> c, json request, std::size_t frame_bytes) {
  json id = nullptr;
  json answer;
  try {
    control_request req = parse_request(std::move(request), id);
    request = json();
    json result;
    if (auto v = verbs_.find(req.method); v != verbs_.end()) {
      verb call = v->second;
      result = co_await call(*c, std::move(req.params));
    } else if (auto m = methods_.find(req.method); m != methods_.end()) {
      method call = m->second;  // a copy: the handler may replace methods while running
      result = co_await call(req.params);
    } else {
      std::string known;
      for (const auto& [n, v] : verbs_) known += (known.empty() ? "" : ", ") + n;
      for (const auto& [n, m] : methods_) known += ", " + n;
      throw_error(errc::invalid_argument, "unknown method '" + req.method + "' (methods: " + known + ")");
    }
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
      co_await c->stream->write(answer, config_.timeout, "control answer");
    } else {
      // A large answer (the fingerprints of a whole model) is serialized and freed
      // on the processing executor: milliseconds per thousand tensors.
      json* a = &answer;
      std::string text = co_await async::offload(internal::engine_access::processing_executor(*engine_), [a] {
        std::string t = a->dump();
        *a = json();
        return t;
      });
      co_await c->stream->write_text(std::move(text), config_.timeout, "control answer");
    }
  } catch (const error&) {
    c->stream->close();  // the trainer went away; its calls fail on its side
  }
  answer = json();
  --c->in_flight;
  c->request_done.set();
  heard_from(*c);  // the silence clock restarts when the owner's request ends
  if (!session_.active()) end_watch();
#if defined(__GLIBC__)
  if (frame_bytes >= trim_after_bytes)
    asio::post(internal::engine_access::processing_executor(*engine_), [] { malloc_trim(0); });
#endif
}

void worker_host::stop() {
  stopped_ = true;
  end_watch();
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
  for (auto& [id, c] : connections_) c->stream->close();
  // Refused while deferred processing runs (it reads staging): the engine then
  // shuts down when it is destroyed. stop() itself never throws.
  if (engine_) {
    try {
      engine_->shutdown();
    } catch (const error&) {
    }
  }
}

asio::awaitable<void> worker_host::drain_pending() { co_await engine_->drain_pending(); }

}  // namespace refit::control
