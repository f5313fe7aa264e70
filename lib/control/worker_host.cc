#include "lib/control/worker_host.h"

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/use_awaitable.hpp>

#include "lib/async/offload.h"
#include "lib/auth.h"
#include "lib/fingerprint.h"
#include "lib/net.h"

namespace refit::control {

namespace {

// Method bodies are read strictly, like engine infos: unknown members are errors.
json_reader params_reader(const json& params, const std::string& method) {
  return json_reader(params, method + " params");
}

json error_answer(const json& id, std::string_view kind, const std::string& message) {
  return {{"id", id}, {"error", {{"kind", kind}, {"message", message}}}};
}

}  // namespace

worker_host::worker_host(weight_transfer_config config, engine_context context,
                         load_weights_fn load_weights, engine_factory& factory)
    : config_(std::move(config)),
      context_(std::move(context)),
      load_weights_(std::move(load_weights)),
      engine_(factory.create_engine(config_, context_)),
      session_(*engine_) {
  add_method("init_weight_transfer_engine", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "init_weight_transfer_engine");
    json init_info = r.required<json>("init_info");
    r.finish();
    auto info = engine_->parse_init_info(init_info);
    co_await session_.abort_weight_update();
    co_await engine_->init_transfer_engine(*info);
    co_return json::object();
  });
  add_method("start_weight_update", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "start_weight_update");
    r.finish();
    session_.start_weight_update();
    co_return json::object();
  });
  add_method("update_weights", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "update_weights");
    json update_info = r.required<json>("update_info");
    r.finish();
    std::exception_ptr failure;
    try {
      // An update_info the engine refuses fails the chunk like any other failure
      // (the session ends; nothing was written).
      co_await session_.update_weights(update_info, load_weights_);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      // A failed chunk ends the session: the next start_weight_update begins clean.
      note_error("update_weights", failure);
      co_await session_.abort_weight_update();
      std::rethrow_exception(failure);
    }
    co_return json{{"stats", engine_->last_update_stats().to_json()}};
  });
  add_method("finish_weight_update", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "finish_weight_update");
    auto version = r.maybe<std::int64_t>("weight_version");
    r.finish();
    std::exception_ptr failure;
    try {
      co_await session_.finish_weight_update(version);
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure) {
      note_error("finish_weight_update", failure);
      std::rethrow_exception(failure);
    }
    last_error_.clear();
    co_return json{{"stats", engine_->last_update_stats().to_json()}};
  });
  add_method("weight_fingerprint", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "weight_fingerprint");
    auto names = r.optional<std::vector<std::string>>("names", {});
    r.finish();
    if (!context_.model)
      throw_error(errc::unsupported, "weight_fingerprint: this worker was created without a model target");
    // Hashing a model reads all of it: not on the event loop.
    auto* model = context_.model;
    auto list = co_await async::offload(engine_->processing_executor(),
                                        [model, names] { return model->fingerprint(names); });
    json answer = fingerprints_to_json(list);
    answer["weight_version"] = session_.weight_version() ? json(*session_.weight_version()) : json(nullptr);
    answer["state"] = weight_state();
    co_return answer;
  });
  add_method("weight_info", [this](const json& params) -> asio::awaitable<json> {
    auto r = params_reader(params, "weight_info");
    r.finish();
    co_return weight_info();
  });
}

worker_host::~worker_host() { stop(); }

void worker_host::note_error(const std::string& method, std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    last_error_ = method + ": " + std::string(errc_name(x.kind())) + ": " + x.message();
  } catch (const std::exception& x) {
    last_error_ = method + ": " + x.what();
  }
}

std::string worker_host::weight_state() const {
  if (engine_->weights_dirty()) return "dirty";
  return session_.active() ? "updating" : "clean";
}

json worker_host::weight_info() const {
  json info = {{"backend", engine_->backend()},
               {"initialized", engine_->initialized()},
               {"defers_processing", engine_->defers_processing()},
               {"session_active", session_.active()},
               {"receiving", engine_->receiving()},
               {"state", weight_state()},
               {"commit", to_string(config_.commit)},
               {"last_update", engine_->last_update_stats().to_json()}};
  info["weight_version"] = session_.weight_version() ? json(*session_.weight_version()) : json(nullptr);
  info["dirty_reason"] = engine_->weights_dirty() ? json(engine_->dirty_reason()) : json(nullptr);
  info["last_error"] = last_error_.empty() ? json(nullptr) : json(last_error_);
  info["last_refused_connection"] = refused_.empty() ? json(nullptr) : json(refused_);
  return info;
}

void worker_host::add_method(const std::string& name, method m) { methods_[name] = std::move(m); }

std::uint16_t worker_host::listen(const std::string& host, std::uint16_t port) {
  acceptor_ = std::make_unique<asio::ip::tcp::acceptor>(net::listen(context_.executor, host, port));
  return acceptor_->local_endpoint().port();
}

asio::awaitable<void> worker_host::serve() {
  if (!acceptor_) throw_error(errc::invalid_state, "worker_host: serve before listen");
  while (!stopped_) {
    asio::ip::tcp::socket socket(context_.executor);
    try {
      co_await acceptor_->async_accept(socket, asio::use_awaitable);
    } catch (const std::system_error& e) {
      if (stopped_ || e.code() == asio::error::operation_aborted) break;
      continue;  // a failed accept (e.g. out of descriptors) must not end serving
    }
    net::tune(socket);
    auto stream = std::make_shared<frame_stream>(std::move(socket));
    connections_.push_back(stream);
    asio::co_spawn(context_.executor, serve_connection(stream), asio::detached);
  }
}

asio::awaitable<void> worker_host::serve_connection(std::shared_ptr<frame_stream> stream) {
  // No frame is read from a peer that has not proved the shared secret.
  std::string peer = "?";
  {
    std::error_code ec;
    auto ep = stream->socket().remote_endpoint(ec);
    if (!ec) peer = ep.address().to_string() + ":" + std::to_string(ep.port());
  }
  try {
    co_await auth::as_server(stream->socket(), config_.auth_secret, config_.timeout,
                             "control: connection from " + peer);
  } catch (const error& e) {
    refused_ = "control: connection from " + peer + " refused: " + std::string(errc_name(e.kind())) + ": " +
               e.message();
    stream->close();
    co_return;
  }
  for (;;) {
    json request;
    try {
      request = co_await stream->read(config_.timeout, /*idle_ok=*/true, "control request");
    } catch (const error& e) {
      // A peer that closed is the normal end; a malformed frame ends this
      // connection (its framing can no longer be trusted) but not the host.
      stream->close();
      co_return;
    }
    asio::co_spawn(context_.executor, handle(stream, std::move(request)), asio::detached);
  }
}

asio::awaitable<void> worker_host::handle(std::shared_ptr<frame_stream> stream, json request) {
  json id = nullptr;
  json answer;
  try {
    control_request req = parse_request(request, id);
    auto it = methods_.find(req.method);
    if (it == methods_.end()) {
      std::string known;
      for (const auto& [n, m] : methods_) known += (known.empty() ? "" : ", ") + n;
      throw_error(errc::invalid_argument, "unknown method '" + req.method + "' (methods: " + known + ")");
    }
    method m = it->second;  // a copy: the handler may replace methods while running
    json result = co_await m(req.params);
    answer = json::object();
    answer["id"] = id;
    answer["result"] = std::move(result);
  } catch (const error& e) {
    answer = error_answer(id, errc_name(e.kind()), e.message());
  } catch (const std::exception& e) {
    answer = error_answer(id, "io_error", e.what());
  }
  try {
    co_await stream->write(answer, config_.timeout, "control answer");
  } catch (const error&) {
    stream->close();  // the trainer went away; its calls fail on its side
  }
}

void worker_host::stop() {
  stopped_ = true;
  if (acceptor_) {
    std::error_code ignored;
    acceptor_->close(ignored);
  }
  for (auto& weak : connections_)
    if (auto s = weak.lock()) s->close();
  connections_.clear();
  if (engine_) engine_->shutdown();
}

}  // namespace refit::control
