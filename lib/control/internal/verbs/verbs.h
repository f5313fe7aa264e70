// The weight-transfer verbs a worker_host serves, one file each (the wire format
// and the rules they keep: docs/control-plane.md). Each runs on the host's loop
// in its own coroutine, for the connection that called it.
#pragma once

#include <string>

#include <asio/awaitable.hpp>

#include <refit/control/internal/worker_state.h>
#include <refit/json_reader.h>

namespace refit::control::internal::verbs {

asio::awaitable<json> init_weight_transfer_engine(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> start_weight_update(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> update_weights(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> prepare_weight_update(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> finish_weight_update(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> abort_weight_update(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> rollback_weight_update(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> release_weight_undo(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> weight_info(worker_state& w, rpc_connection& caller, json params);
asio::awaitable<json> weight_fingerprint(worker_state& w, rpc_connection& caller, json params);

/// weight_info's answer (worker_host::weight_info() answers the same).
json weight_info_of(const worker_state& w);

/// Method bodies are read strictly, like engine infos: unknown members are errors.
inline json_reader params_reader(const json& params, const std::string& method) {
  return json_reader(params, method + " params");
}

}  // namespace refit::control::internal::verbs
