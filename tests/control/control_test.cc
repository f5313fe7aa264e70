#include <gtest/gtest.h>

#include <asio/experimental/awaitable_operators.hpp>
#include <asio/redirect_error.hpp>
#include <asio/write.hpp>

#include <refit/backend/handshake.h>
#include <refit/backend/net.h>
#include <refit/control/internal/frame.h>
#include "tests/support/control_fixture.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

// A worker host with a tcp engine, a client to it and a tcp trainer, on one loop.
class control_test : public control_fixture {
 protected:
  void SetUp() override {
    start_host(tcp_config(), engine_context{io_.get_executor()}, got_.fn());
    client_ = trainer_;
  }
  void TearDown() override { EXPECT_TRUE(stop_all()) << "stop() leaves nothing running"; }

  asio::awaitable<void> init_both() {
    using namespace asio::experimental::awaitable_operators;
    json args = {{"master_address", "127.0.0.1"},
                 {"master_port", 0},
                 {"world_size", 2},
                 {"buffer_bytes", 16384},
                 {"num_buffers", 2}};
    json params = {{"init_info", sender_->prepare(args)}};
    co_await (sender_->connect_workers() && init_call(params));
  }
  asio::awaitable<void> init_call(json params) { co_await client_->call("init_weight_transfer_engine", params); }
  asio::awaitable<void> update(tensor_set& set, json& info_during, std::int64_t version) {
    using namespace asio::experimental::awaitable_operators;
    co_await client_->call("start_weight_update");
    json update_info = json::object();
    write_update_metadata(set.meta, update_info);
    auto views = set.views();
    // Bodies built before co_await (GCC 12 and braced lists across suspension).
    json update_body = {{"update_info", update_info}};
    json finish_body = {{"weight_version", version}};
    co_await (client_->call("update_weights", update_body) && (query(info_during) && send(set.meta, views)));
    co_await client_->call("finish_weight_update", finish_body);
  }
  asio::awaitable<void> query(json& out) { out = co_await client_->call("weight_info"); }
  asio::awaitable<void> send(const update_metadata& meta, std::vector<tensor_view> views) {
    co_await trainer_send_weights(*sender_, meta, views);
  }

  capture got_;
  control::client* client_ = nullptr;  // the trainer's
};

TEST_F(control_test, full_update_through_the_verbs_records_the_version) {
  run_to_completion(io_, init_both());
  tensor_set set;
  for (int i = 0; i < 10; ++i) set.add("layer." + std::to_string(i), dtype::bfloat16, {64, 64});
  json during;
  run_to_completion(io_, update(set, during, 7));
  EXPECT_NO_THROW(got_.check_equals(set));
  // weight_info was answered while the update was in flight.
  EXPECT_EQ(during["backend"], "tcp");
  json info = call("weight_info");
  EXPECT_EQ(info["weight_version"], 7);
  EXPECT_EQ(info["session_active"], false);
  EXPECT_EQ(info["last_update"]["tensors"], 10);
  EXPECT_EQ(info["last_update"]["bytes"], set.meta.total_bytes());
}

// A request of ~200 KiB (an update_info of 3,000 tensors) is parsed, and an answer
// of 5,000 values serialized, off the event loop: both arrive whole and in order.
TEST_F(control_test, large_requests_and_answers_arrive_whole) {
  host_->add_method("count_to", [](const json& p) -> asio::awaitable<json> {
    json a = json::array();
    for (int i = 0; i < p.at("n").get<int>(); ++i) a.push_back(i);
    co_return a;
  });
  json many = call("count_to", {{"n", 5000}});
  ASSERT_EQ(many.size(), 5000u);
  EXPECT_EQ(many[0], 0);
  EXPECT_EQ(many[4999], 4999);
  EXPECT_EQ(call("count_to", {{"n", 3}}), json::array({0, 1, 2}));
  run_to_completion(io_, init_both());
  tensor_set set;
  for (int i = 0; i < 3000; ++i) set.add("model.layers." + std::to_string(i) + ".weight", dtype::float32, {4});
  json body = json::object();
  write_update_metadata(set.meta, body);
  ASSERT_GT(body.dump().size(), 64u << 10) << "the update_info must be large enough to be parsed off the loop";
  json during;
  run_to_completion(io_, update(set, during, 3));
  EXPECT_NO_THROW(got_.check_equals(set));
  EXPECT_EQ(call("weight_info")["last_update"]["tensors"], 3000);
}

asio::awaitable<void> call_update(control::client& c, json body) { co_await c.call("update_weights", body); }

// The trainer dies mid-transfer: the worker's update fails with peer_lost (not a
// hang), the host keeps answering, and a new trainer can init and update again.
TEST_F(control_test, a_trainer_lost_mid_transfer_fails_the_update_and_the_worker_recovers) {
  run_to_completion(io_, init_both());
  tensor_set set;
  for (int i = 0; i < 64; ++i) set.add("w" + std::to_string(i), dtype::bfloat16, {256, 1024});  // 32 MiB
  call("start_weight_update");
  json body = json::object();
  write_update_metadata(set.meta, body["update_info"]);
  auto updating = spawn(io_, call_update(*client_, body));
  auto sent = spawn(io_, send(set.meta, set.views()));
  // Kill the trainer's connections as soon as the worker has loaded something.
  ASSERT_TRUE(run_until(io_, [&] { return got_.calls() > 0 || updating->done; }));
  ASSERT_FALSE(updating->done) << "the whole update got through before the trainer died; use more bytes";
  sender_->shutdown();
  ASSERT_TRUE(run_until(io_, [&] { return updating->done && sent->done; })) << "a hang";
  ASSERT_TRUE(updating->error);
  EXPECT_EQ(updating->kind(), static_cast<int>(errc::peer_lost)) << updating->message();
  EXPECT_NE(updating->message().find("tcp worker rank 1"), std::string::npos) << updating->message();
  EXPECT_TRUE(sent->error) << "the trainer's own send reports the failure";

  json info = call("weight_info");
  EXPECT_EQ(info["session_active"], false) << "a failed chunk ends the session";
  // in_place (the default) and some tensors were loaded: the weights are dirty, and
  // weight_info says so and why, until a full update succeeds.
  EXPECT_EQ(info["state"], "dirty") << info.dump();
  EXPECT_NE(info["dirty_reason"].get<std::string>().find("peer_lost"), std::string::npos) << info.dump();
  EXPECT_NE(info["last_error"].get<std::string>().find("update_weights"), std::string::npos) << info.dump();

  // A new trainer: re-init and a full update succeed.
  sender_ = std::make_unique<tcp::sender>(tcp_config(), trainer_context{io_.get_executor(), {}});
  run_to_completion(io_, init_both());
  tensor_set small;
  for (int i = 0; i < 4; ++i) small.add("v" + std::to_string(i), dtype::float32, {1000});
  json during;
  run_to_completion(io_, update(small, during, 2));
  info = call("weight_info");
  EXPECT_EQ(info["weight_version"], 2);
  EXPECT_EQ(info["state"], "clean") << info.dump();
  EXPECT_TRUE(info["dirty_reason"].is_null()) << info.dump();
}

// The worker's update_info disagrees with what the trainer sends: both sides get a
// protocol error naming the difference before any weight byte moves, the model is
// untouched, and after a re-init the next update goes through.
TEST_F(control_test, metadata_disagreeing_with_the_trainer_is_refused_before_any_byte) {
  run_to_completion(io_, init_both());
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("w" + std::to_string(i), dtype::float32, {1000});
  tensor_set declared = set;
  declared.meta.tensors[2].shape = {999};  // the worker was told another shape
  call("start_weight_update");
  json body = json::object();
  write_update_metadata(declared.meta, body["update_info"]);
  auto updating = spawn(io_, call_update(*client_, body));
  auto sent = spawn(io_, send(set.meta, set.views()));
  ASSERT_TRUE(run_until(io_, [&] { return updating->done && sent->done; })) << "a hang";
  ASSERT_TRUE(updating->error);
  EXPECT_EQ(updating->kind(), static_cast<int>(errc::protocol_error)) << updating->message();
  EXPECT_NE(updating->message().find("names, dtypes or shapes differ"), std::string::npos) << updating->message();
  ASSERT_TRUE(sent->error);
  EXPECT_NE(sent->message().find("names, dtypes or shapes differ"), std::string::npos)
      << "the trainer hears why: " << sent->message();
  EXPECT_EQ(got_.calls(), 0u) << "nothing was loaded";
  EXPECT_EQ(call("weight_info")["state"], "clean");

  sender_ = std::make_unique<tcp::sender>(tcp_config(), trainer_context{io_.get_executor(), {}});
  run_to_completion(io_, init_both());
  json during;
  run_to_completion(io_, update(set, during, 3));
  EXPECT_NO_THROW(got_.check_equals(set));
  EXPECT_EQ(call("weight_info")["weight_version"], 3);
}

TEST_F(control_test, misuse_is_a_clear_error) {
  EXPECT_NE(call_error("start_weight_update", json::object(), errc::invalid_state).find("not initialised"),
            std::string::npos);
  run_to_completion(io_, init_both());
  EXPECT_NE(call_error("finish_weight_update", json::object(), errc::invalid_state).find("no active weight update"),
            std::string::npos);
  json update_info = {{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
  EXPECT_NE(call_error("update_weights", {{"update_info", update_info}}, errc::invalid_state)
                .find("call start_weight_update first"),
            std::string::npos);
  call("start_weight_update");
  EXPECT_NE(call_error("start_weight_update", json::object(), errc::invalid_state).find("already active"),
            std::string::npos);
}

TEST_F(control_test, bad_requests_get_typed_errors_and_the_host_keeps_serving) {
  auto msg = call_error("no_such_method", json::object(), errc::invalid_argument);
  EXPECT_NE(msg.find("unknown method 'no_such_method'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("weight_info"), std::string::npos) << "lists the methods: " << msg;
  msg = call_error("init_weight_transfer_engine", {{"init_info", {{"master_address", "127.0.0.1"}}}},
                   errc::invalid_argument);
  EXPECT_NE(msg.find("tcp init_info"), std::string::npos) << msg;
  EXPECT_NE(msg.find("master_port"), std::string::npos) << msg;
  msg = call_error("start_weight_update", {{"surprise", 1}}, errc::invalid_argument);
  EXPECT_NE(msg.find("'surprise'"), std::string::npos) << msg;

  // A raw connection sending an absurd frame length gets an error answer (id null)
  // and is then dropped, without harm to the host.
  auto raw = [](std::uint16_t port) -> asio::awaitable<void> {
    auto s = co_await net::connect_with_retry("127.0.0.1", port, 5s, "raw");
    co_await auth::as_client(s, "", 5s, "raw");  // this host has no secret
    const std::uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};
    co_await asio::async_write(s, asio::buffer(huge), asio::use_awaitable);
    control::frame_stream f(std::move(s));
    json answer = co_await f.read(5s, false, "raw");
    EXPECT_TRUE(answer["id"].is_null()) << answer;
    EXPECT_EQ(answer["error"]["kind"], "protocol_error") << answer;
    EXPECT_NE(answer["error"]["message"].get<std::string>().find("limit"), std::string::npos) << answer;
    char byte;
    std::error_code ec;
    co_await f.socket().async_read_some(asio::buffer(&byte, 1), asio::redirect_error(asio::use_awaitable, ec));
    EXPECT_TRUE(ec) << "the host closes a connection with a corrupt frame";
  };
  run_to_completion(io_, raw(port_));
  EXPECT_EQ(call("weight_info")["backend"], "tcp");
}

TEST(control_auth, a_host_with_a_secret_serves_only_clients_that_prove_it) {
  asio::io_context io;
  engine_factory factory;
  factory.register_engine<tcp::engine, tcp::sender>("tcp");
  auto config = tcp_config();
  config.auth_secret = "control secret";
  capture got;
  control::worker_host host(config, engine_context{io.get_executor()}, got.fn(), factory);
  const auto port = host.listen("127.0.0.1", 0);
  spawn(io, host.serve());
  for (const char* wrong : {"", "control secreT"}) {
    control::client c(io.get_executor(), 5s, wrong);
    auto r = spawn(io, c.connect("127.0.0.1", port));
    ASSERT_TRUE(run_until(io, [&] { return r->done; }));
    ASSERT_TRUE(r->error) << "connected with '" << wrong << "'";
    EXPECT_EQ(r->kind(), static_cast<int>(errc::auth_error)) << r->message();
  }
  control::client good(io.get_executor(), 5s, "control secret");
  json info;
  auto call_info = [&]() -> asio::awaitable<void> {
    co_await good.connect("127.0.0.1", port);
    info = co_await good.call("weight_info");
  };
  run_to_completion(io, call_info());
  EXPECT_EQ(info["state"], "clean");
  ASSERT_TRUE(info["last_refused_connection"].is_string()) << info.dump();
  EXPECT_NE(info["last_refused_connection"].get<std::string>().find("auth_error"), std::string::npos) << info.dump();
  good.close();
  host.stop();
  EXPECT_TRUE(run(io, 5s));
}

}  // namespace
}  // namespace refit::testing
