#include "tests/support/control_fixture.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

namespace refit::testing {

using namespace std::chrono_literals;

weight_transfer_config tcp_config(std::chrono::milliseconds timeout) {
  weight_transfer_config c;
  c.backend = "tcp";
  c.timeout = timeout;
  return c;
}

void holding_model::load_weights(std::span<const tensor_view> views) {
  if (stall_load_after.load() >= 0 && stall_load_after.fetch_sub(1) == 0) {
    if (on_stall) on_stall();
    std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms.load()));
  }
  if (fail_next_load.exchange(false)) throw_error(errc::processing_failed, "holding model: load_weights failed");
  if (fail_load_after.load() >= 0 && fail_load_after.fetch_sub(1) == 0)
    throw_error(errc::processing_failed, "holding model: load_weights failed after a batch");
  std::lock_guard lock(mutex_);
  for (const auto& v : views) {
    auto& slot = tensors_[std::string(v.name)];
    slot.spec = v.spec();
    auto bytes = v.bytes();
    slot.bytes.assign(bytes.begin(), bytes.end());
    if (slot.spec.name == tamper_ && !slot.bytes.empty()) slot.bytes[0] ^= std::byte{1};
  }
}

void holding_model::exchange(std::span<const tensor_view> staged) {
  if (fail_next_load.exchange(false)) throw_error(errc::processing_failed, "holding model: exchange failed");
  std::lock_guard lock(mutex_);
  for (const auto& v : staged)
    if (tensors_[std::string(v.name)].bytes.size() != v.nbytes())
      throw_error(errc::invalid_argument, "holding model: exchange of '" + std::string(v.name) + "': another size");
  for (const auto& v : staged) {
    auto& slot = tensors_[std::string(v.name)];
    auto* stage = static_cast<std::byte*>(v.data);
    std::swap_ranges(slot.bytes.begin(), slot.bytes.end(), stage);
  }
  ++exchanged;
}

void holding_model::begin_update(const update_metadata& meta) {
  if (refuse_next.exchange(false)) throw_error(errc::invalid_argument, "holding model: refused this update");
  for (const auto& t : meta.tensors)
    if (t.name == "forbidden") throw_error(errc::invalid_argument, "holding model: no tensor may be named 'forbidden'");
}

bool holding_model::can_read_back(const tensor_spec& spec) {
  std::lock_guard lock(mutex_);
  auto it = tensors_.find(spec.name);
  return it != tensors_.end() && it->second.spec.dtype == spec.dtype && it->second.spec.shape == spec.shape;
}

void holding_model::read_back(const tensor_spec& spec, std::span<std::byte> out) {
  std::lock_guard lock(mutex_);
  auto it = tensors_.find(spec.name);
  if (it == tensors_.end() || it->second.bytes.size() != out.size())
    throw_error(errc::invalid_argument, "holding model: read_back of '" + spec.name + "'");
  std::memcpy(out.data(), it->second.bytes.data(), out.size());
}

fingerprint_list holding_model::fingerprint(const std::vector<std::string>& names) {
  std::lock_guard lock(mutex_);
  std::vector<tensor_view> views;
  for (auto& [name, t] : tensors_) views.emplace_back(t.spec, t.bytes.data());
  return fingerprint_all(views, names);
}

void control_fixture::start_host(const weight_transfer_config& config, engine_context context, load_weights_fn load,
                                 control::host_limits limits, control::update_hooks hooks) {
  factory_.register_engine<tcp::engine, tcp::sender>("tcp");
  host_ = std::make_unique<control::worker_host>(config, std::move(context), std::move(load), factory_, limits);
  host_->set_hooks(std::move(hooks));
  port_ = host_->listen("127.0.0.1", 0);
  spawn(io_, host_->serve());
  trainer_ = connect();
  sender_ = std::make_unique<tcp::sender>(config, trainer_context{io_.get_executor(), {}});
}

bool control_fixture::stop_all() {
  for (auto& c : clients_) c->close();
  if (host_) host_->stop();
  if (sender_) sender_->shutdown();
  const bool drained = run(io_, 5s);
  // Gone before a derived fixture's members (its model, its load_weights' state),
  // in the order a fixture that declared them all itself would destroy them.
  sender_.reset();
  trainer_ = nullptr;
  clients_.clear();
  host_.reset();
  return drained;
}

control::client* control_fixture::connect() {
  clients_.push_back(std::make_unique<control::client>(io_.get_executor(), 5s));
  run_to_completion(io_, clients_.back()->connect("127.0.0.1", port_));
  return clients_.back().get();
}

asio::awaitable<void> control_fixture::call_into(control::client* c, std::string method, json params, json* out) {
  *out = co_await c->call(method, std::move(params));
}

json control_fixture::call(control::client* c, const std::string& method, json params) {
  json result;
  run_to_completion(io_, call_into(c, method, std::move(params), &result));
  return result;
}

std::string control_fixture::call_error(control::client* c, const std::string& method, json params, errc kind) {
  try {
    call(c, method, std::move(params));
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), kind) << e.message();
    return e.message();
  }
  ADD_FAILURE() << method << " succeeded";
  return {};
}

void control_fixture::init(control::client* client, tcp::sender* sender) {
  client = client ? client : trainer_;
  sender = sender ? sender : sender_.get();
  json args = {{"master_address", "127.0.0.1"},
               {"master_port", 0},
               {"world_size", 2},
               {"buffer_bytes", 16384},
               {"num_buffers", 2}};
  json params = {{"init_info", sender->prepare(args)}};
  auto accepted = spawn(io_, sender->connect_workers());
  call(client, "init_weight_transfer_engine", params);
  ASSERT_TRUE(run_until(
      io_, [&] { return accepted->done; }, 10s));
  ASSERT_FALSE(accepted->error) << accepted->message();
}

json control_fixture::update_body(const tensor_set& set, const char* commit) {
  json info = json::object();
  write_update_metadata(set.meta, info);
  if (commit) info["commit"] = commit;
  return {{"update_info", info}};
}

void control_fixture::chunk(tensor_set& set, const char* commit, control::client* client, tcp::sender* sender) {
  client = client ? client : trainer_;
  sender = sender ? sender : sender_.get();
  auto views = set.views();
  auto sent = spawn(io_, trainer_send_weights(*sender, set.meta, views));
  call(client, "update_weights", update_body(set, commit));
  ASSERT_TRUE(run_until(
      io_, [&] { return sent->done; }, 10s));
  ASSERT_FALSE(sent->error) << sent->message();
}

void control_fixture::full_update(tensor_set& set, std::optional<std::int64_t> version, const char* commit,
                                  control::client* client, tcp::sender* sender) {
  client = client ? client : trainer_;
  call(client, "start_weight_update");
  chunk(set, commit, client, sender);
  call(client, "finish_weight_update", version ? json{{"weight_version", *version}} : json::object());
}

}  // namespace refit::testing
