// The worker side of the control plane: owns one engine and serves the weight
// transfer verbs of vLLM's RL API over framed JSON, with vLLM's request bodies:
//
//   init_weight_transfer_engine  {"init_info": {...}}
//   start_weight_update          {}
//   update_weights               {"update_info": {...}}
//   finish_weight_update         {"weight_version": int}   (optional member)
//   weight_info                  {}
//       -> {"weight_version", "state": "clean" | "updating" | "dirty", "dirty_reason",
//           "session_active", "receiving", "commit", "last_update": stats,
//           "last_error", "last_refused_connection", ...}
//       "updating": a session is open (a trainer that dies between its last chunk
//       and finish_weight_update leaves it so until the next init or start).
//   weight_fingerprint           {"names": [str]}  (optional; all weights when absent)
//       -> {"algorithm", "tensors": {name: hex}, "weight_version", "state"}
//          (needs the engine context's model_target; see lib/fingerprint.h)
//
// A request is {"id": int, "method": str, "params": {...}}; the answer is
// {"id": int, "result": {...}} or {"id": int, "error": {"kind": str, "message": str}}.
// Every request runs in its own coroutine, so weight_info (or any other method)
// is answered while an update is in flight.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include "lib/control/frame.h"
#include "lib/engine.h"
#include "lib/factory.h"
#include "lib/session.h"

namespace refit::control {

class worker_host {
 public:
  /// A method: params in, result out; throw refit::error to answer with an error.
  using method = std::function<asio::awaitable<json>(const json& params)>;

  /// Creates the engine for config.backend from `factory`; `load_weights` receives
  /// every update's tensors.
  worker_host(weight_transfer_config config, engine_context context, load_weights_fn load_weights,
              engine_factory& factory = engine_factory::instance());
  ~worker_host();

  /// Listens on host:port (0: any free port); returns the port.
  std::uint16_t listen(const std::string& host, std::uint16_t port);
  /// Accepts and serves connections until stop().
  asio::awaitable<void> serve();
  /// Closes the listener and every connection; the engine is shut down.
  void stop();

  /// Adds (or replaces) a method, e.g. an application's own query.
  void add_method(const std::string& name, method m);

  weight_transfer_engine& engine() { return *engine_; }
  weight_update_session& session() { return session_; }

 private:
  asio::awaitable<void> serve_connection(std::shared_ptr<frame_stream> stream);
  asio::awaitable<void> handle(std::shared_ptr<frame_stream> stream, json request);
  json weight_info() const;
  std::string weight_state() const;
  void note_error(const std::string& method, std::exception_ptr e);

  weight_transfer_config config_;
  engine_context context_;
  load_weights_fn load_weights_;
  std::unique_ptr<weight_transfer_engine> engine_;
  weight_update_session session_;
  std::unique_ptr<asio::ip::tcp::acceptor> acceptor_;
  std::vector<std::weak_ptr<frame_stream>> connections_;
  std::map<std::string, method> methods_;
  bool stopped_ = false;
  std::string last_error_;
  std::string refused_;     // why the last control connection was refused  // the last failed update_weights / finish_weight_update
};

}  // namespace refit::control
