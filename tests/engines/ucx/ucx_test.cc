#include <refit/engines/ucx/ucx.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <asio/experimental/awaitable_operators.hpp>
#include <asio/post.hpp>

#include <refit/backend/async/all_of.h>
#include <refit/backend/links/relay.h>

#include <refit/control/client.h>
#include <refit/control/worker_host.h>
#include <refit/factory.h>
#include <refit/model/host_copy_target.h>

#include "tests/conformance/conformance.h"
#include "tests/engines/ucx/transports.h"

namespace {
// Before any test: the family's UCX settings (tests/engines/ucx/transports.h).
const std::string tls_family = refit::testing::use_ucx_test_transports();
const bool shared_memory = tls_family.starts_with("sm");
}  // namespace

namespace refit::testing {
namespace {

weight_transfer_config ucx_config(std::string secret = {}) {
  weight_transfer_config config;
  config.backend = "ucx";
  config.timeout = std::chrono::seconds(5);
  config.auth_secret = std::move(secret);
  return config;
}

class ucx_harness final : public engine_harness {
 public:
  ucx_harness(asio::io_context& io, model_target* model, std::string secret = {}) {
    sender_ = std::make_unique<ucx::sender>(ucx_config(secret), trainer_context{io.get_executor(), {}});
    engine_ = std::make_unique<ucx::engine>(ucx_config(secret), engine_context{io.get_executor(), {}, {}, model});
  }
  asio::awaitable<void> connect(const wire_params& wire) override {
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
    wire.write(args);
    json init = sender_->prepare(args);
    init.update(init_extra);
    auto info = engine_->parse_init_info(init);
    using namespace asio::experimental::awaitable_operators;
    co_await (sender_->connect_workers() && engine_->init_transfer_engine(*info));
  }
  weight_transfer_engine& engine() override { return *engine_; }
  weight_sender& sender() override { return *sender_; }
  ucx::engine& ucx_engine() { return *engine_; }
  ucx::sender& ucx_sender() { return *sender_; }
  json init_extra = json::object();  // merged into the workers' init info

 private:
  std::unique_ptr<ucx::sender> sender_;
  std::unique_ptr<ucx::engine> engine_;
};

wire_params small_wire() {
  wire_params w;
  w.buffer_bytes = 64 << 10;
  w.num_buffers = 2;
  return w;
}

// The harness's trainer sends `set`, its worker receives it (direct receive): both
// end without error and the worker holds exactly the set.
void send_and_check(asio::io_context& io, ucx_harness& h, tensor_set& set) {
  capture got;
  auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
  auto received =
      spawn(io, receive_update(h.engine(), h.engine().parse_update_info(h.update_info_json(set.meta)), got.fn(), true));
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_FALSE(sent->error) << sent->message();
  ASSERT_FALSE(received->error) << received->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST(ucx, the_transports_ucx_chose_are_reported_and_decide_puts_or_tags) {
  asio::io_context io;
  ucx_harness h(io, nullptr);
  run_to_completion(io, h.connect(small_wire()));
  const json worker = h.ucx_engine().transport_info();
  const json trainer = h.ucx_sender().transport_info();
  ASSERT_TRUE(worker.is_object()) << worker.dump();
  json same = worker;
  same.erase("rank");
  same.erase("put_into_model");  // the worker's choices
  same.erase("memory");
  EXPECT_EQ(trainer.at("1"), same) << "both sides report the same endpoint";
  const auto transports = worker.at("transports").get<std::vector<std::string>>();
  if (shared_memory) {
    // cma carries puts between processes on one host: one-sided.
    EXPECT_EQ(worker.at("mode"), "put") << worker.dump();
    EXPECT_NE(std::find(transports.begin(), transports.end(), "cma"), transports.end()) << worker.dump();
  } else {
    // UCX's tcp has no put lane (puts would be emulated): tagged sends.
    EXPECT_EQ(worker.at("mode"), "tag") << worker.dump();
    EXPECT_NE(std::find(transports.begin(), transports.end(), "tcp"), transports.end()) << worker.dump();
    EXPECT_TRUE(worker.at("peer_failure_handling").get<bool>()) << worker.dump();
  }
  // Data moves either way, with buckets of several tensors and split tensors.
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("w" + std::to_string(i), dtype::float32, {5000});
  set.add("big", dtype::float32, {100000});  // larger than a buffer: split, assembled
  ASSERT_NO_FATAL_FAILURE(send_and_check(io, h, set));
}

// A model whose own memory every tensor is received into (direct receive).
class held_model final : public model_target {
 public:
  explicit held_model(const tensor_set& set) {
    for (const auto& t : set.meta.tensors) memory_[t.name].assign(t.nbytes(), std::byte{0});
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    return tensor_view(spec, memory_.at(spec.name).data());
  }
  void load_weights(std::span<const tensor_view> views) override {
    for (const auto& v : views) {
      auto& m = memory_.at(std::string(v.name));
      if (v.data != m.data()) std::memcpy(m.data(), v.data, m.size());
    }
  }
  std::map<std::string, std::vector<std::byte>> memory_;
};

// With "put_into_model": true and a put lane (cma here), direct receive lands by
// the trainer's puts in the model's memory, registered for each update (fresh keys
// every update); false, absent (puts into the model by default only over RDMA),
// or no put lane (UCX's tcp): received tagged.
TEST(ucx, direct_receive_puts_into_the_models_memory_where_asked_and_ucx_carries_puts) {
  for (const std::optional<bool> put_into_model :
       {std::optional<bool>(true), std::optional<bool>(false), std::optional<bool>()}) {
    asio::io_context io;
    tensor_set set;
    for (int i = 0; i < 5; ++i) set.add("w" + std::to_string(i), dtype::float32, {3000 + 17 * i});
    set.add("big", dtype::bfloat16, {100000});  // larger than a buffer: split into the model's memory
    held_model model(set);
    ucx_harness h(io, &model);
    if (put_into_model) h.init_extra["put_into_model"] = *put_into_model;
    run_to_completion(io, h.connect(small_wire()));
    const bool puts = shared_memory && put_into_model.value_or(false);
    EXPECT_EQ(h.ucx_engine().transport_info().at("put_into_model"), puts);
    for (std::uint64_t round = 1; round <= 2; ++round) {
      tensor_set next;
      for (std::size_t i = 0; i < set.meta.tensors.size(); ++i)
        next.add(set.meta.tensors[i].name, set.meta.tensors[i].dtype, set.meta.tensors[i].shape, round * 10 + i);
      auto sent = spawn(io, send_views(h.sender(), next.meta, next.views()));
      auto received = spawn(io, receive_update(h.engine(), h.engine().parse_update_info(h.update_info_json(next.meta)),
                                               model.as_load_weights(), true));
      ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
      ASSERT_FALSE(sent->error) << sent->message();
      ASSERT_FALSE(received->error) << received->message();
      for (std::size_t i = 0; i < next.meta.tensors.size(); ++i)
        EXPECT_EQ(model.memory_.at(next.meta.tensors[i].name), next.data[i])
            << next.meta.tensors[i].name << " round " << round << " put_into_model " << put_into_model.value_or(-1);
      if (puts)
        EXPECT_GT(h.ucx_engine().last_put_regions(), 0u) << "round " << round;
      else
        EXPECT_EQ(h.ucx_engine().last_put_regions(), 0u) << "round " << round;
    }
  }
}

// A bucket larger than what one turn of the trainer's loop puts (4 MiB) arrives
// whole, in order.
TEST(ucx, a_bucket_of_several_put_turns_arrives_whole) {
  asio::io_context io;
  ucx_harness h(io, nullptr);
  wire_params wire;
  wire.buffer_bytes = 16 << 20;
  wire.num_buffers = 2;
  run_to_completion(io, h.connect(wire));
  tensor_set set;
  set.add("a", dtype::float32, {5 << 18});  // 5 MiB
  set.add("b", dtype::float32, {5 << 18});
  ASSERT_NO_FATAL_FAILURE(send_and_check(io, h, set));
  EXPECT_EQ(h.engine().last_update_stats().buckets, 1u);
}

TEST(ucx, required_transports_that_ucx_did_not_choose_refuse_init_on_both_sides) {
  asio::io_context io;
  ucx::sender sender(ucx_config(), trainer_context{io.get_executor(), {}});
  ucx::engine engine(ucx_config(), engine_context{io.get_executor()});
  json init = sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
  init["require_transports"] = {"rc", "dc"};
  auto info = engine.parse_init_info(init);
  auto t = spawn(io, sender.connect_workers());
  auto w = spawn(io, engine.init_transfer_engine(*info));
  ASSERT_TRUE(run_until(io, [&] { return t->done && w->done; })) << "a hang";
  ASSERT_TRUE(w->error);
  EXPECT_EQ(w->kind(), static_cast<int>(errc::unsupported)) << w->message();
  EXPECT_NE(w->message().find("require_transports [rc, dc] not met"), std::string::npos) << w->message();
  EXPECT_NE(w->message().find(shared_memory ? "cma" : "tcp"), std::string::npos) << "names what UCX offered";
  ASSERT_TRUE(t->error);
  EXPECT_EQ(t->kind(), static_cast<int>(errc::unsupported)) << t->message();
  EXPECT_NE(t->message().find("worker rank 1"), std::string::npos) << t->message();
  EXPECT_FALSE(engine.initialized());
}

// Where a worker receives ("device_memory"): asked for a device it cannot receive
// on, init fails with the reason (unsupported); not asked, a worker whose device
// is a GPU takes the update on the host (into its model's host memory) and says so.
TEST(ucx, device_memory_is_refused_with_its_reason_and_the_host_is_the_default) {
  struct attempt {
    refit::device device;
    std::optional<bool> device_memory;
  };
  for (const attempt a : {attempt{device::cuda(0), true}, attempt{device::cpu(), true}}) {
    asio::io_context io;
    ucx::sender sender(ucx_config(), trainer_context{io.get_executor(), {}});
    ucx::engine engine(ucx_config(), engine_context{io.get_executor(), a.device});
    json init = sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
    init["device_memory"] = *a.device_memory;
    auto info = engine.parse_init_info(init);
    auto t = spawn(io, sender.connect_workers());
    auto w = spawn(io, engine.init_transfer_engine(*info));
    ASSERT_TRUE(run_until(io, [&] { return t->done && w->done; })) << "a hang";
    const std::string where = to_string(a.device);
    ASSERT_TRUE(w->error) << where;
    EXPECT_EQ(w->kind(), static_cast<int>(errc::unsupported)) << w->message();
    EXPECT_NE(w->message().find("\"device_memory\": true, but "), std::string::npos) << w->message();
    if (a.device.is_cpu())
      EXPECT_NE(w->message().find("is the host"), std::string::npos) << w->message();
    else  // this build has no CUDA, or the UCX loaded has no CUDA memory support
      EXPECT_TRUE(w->message().find("no CUDA") != std::string::npos ||
                  w->message().find("memory only") != std::string::npos)
          << w->message();
    EXPECT_TRUE(t->error) << "the trainer fails too, not waiting out its deadline";
    EXPECT_FALSE(engine.initialized());
  }
  // Not asked: a worker on a GPU receives on the host, and says so.
  asio::io_context io;
  tensor_set set;
  for (int i = 0; i < 3; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000 + i});
  set.add("big", dtype::float32, {100000});
  held_model model(set);
  auto sender = std::make_unique<ucx::sender>(ucx_config(), trainer_context{io.get_executor(), {}});
  ucx::engine engine(ucx_config(), engine_context{io.get_executor(), device::cuda(0), {}, &model});
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  small_wire().write(args);
  auto info = engine.parse_init_info(sender->prepare(args));
  auto t = spawn(io, sender->connect_workers());
  auto w = spawn(io, engine.init_transfer_engine(*info));
  ASSERT_TRUE(run_until(io, [&] { return t->done && w->done; })) << "a hang";
  ASSERT_FALSE(w->error) << w->message();
  ASSERT_FALSE(t->error) << t->message();
  EXPECT_EQ(engine.transport_info().at("memory"), "cpu") << engine.transport_info().dump();
  json update = json::object();
  write_update_metadata(set.meta, update);
  auto sent = spawn(io, send_views(*sender, set.meta, set.views()));
  auto received = spawn(io, receive_update(engine, engine.parse_update_info(update), model.as_load_weights(), true));
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  ASSERT_FALSE(sent->error) << sent->message();
  ASSERT_FALSE(received->error) << received->message();
  for (std::size_t i = 0; i < set.meta.tensors.size(); ++i)
    EXPECT_EQ(model.memory_.at(set.meta.tensors[i].name), set.data[i]) << set.meta.tensors[i].name;
}

TEST(ucx, a_trainer_lost_mid_update_fails_the_worker_which_recovers) {
  asio::io_context io;
  auto h = std::make_unique<ucx_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  tensor_set set;
  for (int i = 0; i < 32; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000});
  std::atomic<int> loads{0};
  auto sent = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received = spawn(io, receive_update(
                                h->engine(), h->engine().parse_update_info(h->update_info_json(set.meta)),
                                [&](std::span<const tensor_view> v) { loads += static_cast<int>(v.size()); }, true));
  ASSERT_TRUE(run_until(io, [&] { return loads > 0 || received->done; }));
  h->sender().shutdown();
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
  EXPECT_LT(std::chrono::steady_clock::now() - start, ucx_config().timeout) << "within the deadline";
  ASSERT_TRUE(received->error);
  EXPECT_EQ(received->kind(), static_cast<int>(errc::peer_lost)) << received->message();
  EXPECT_NE(received->message().find("ucx worker rank 1"), std::string::npos) << received->message();

  h = std::make_unique<ucx_harness>(io, nullptr);
  run_to_completion(io, h->connect(small_wire()));
  capture got;
  auto sent2 = spawn(io, send_views(h->sender(), set.meta, set.views()));
  auto received2 = spawn(
      io, receive_update(h->engine(), h->engine().parse_update_info(h->update_info_json(set.meta)), got.fn(), true));
  ASSERT_TRUE(run_until(io, [&] { return sent2->done && received2->done; })) << "a hang";
  EXPECT_FALSE(received2->error) << received2->message();
  EXPECT_NO_THROW(got.check_equals(set));
}

// A worker process killed (SIGKILL) in the middle of an update: the trainer's send
// fails with peer_lost naming the rank, well within its deadline.
TEST(ucx, a_worker_process_killed_mid_update_is_peer_lost_naming_its_rank) {
  tensor_set set;
  for (int i = 0; i < 64; ++i) set.add("w" + std::to_string(i), dtype::float32, {4000});
  asio::io_context io;
  auto config = ucx_config();
  ucx::sender sender(config, trainer_context{io.get_executor(), {}});
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  small_wire().write(args);
  const json init = sender.prepare(args);
  const json info_json = [&] {
    json j = json::object();
    write_update_metadata(set.meta, j);
    return j;
  }();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The worker: its own loop and UCX context; it dies at its third load.
    asio::io_context wio;
    ucx::engine engine(config, engine_context{wio.get_executor()});
    auto info = engine.parse_init_info(init);
    auto w = spawn(wio, engine.init_transfer_engine(*info));
    if (!run_until(wio, [&] { return w->done; }) || w->error) _exit(3);
    int loads = 0;
    auto r = spawn(wio, receive_update(
                            engine, engine.parse_update_info(info_json),
                            [&](std::span<const tensor_view>) {
                              if (++loads == 3) kill(getpid(), SIGKILL);
                            },
                            true));
    run_until(wio, [&] { return r->done; });
    _exit(4);  // not reached: the process is killed
  }
  auto connected = spawn(io, sender.connect_workers());
  ASSERT_TRUE(run_until(io, [&] { return connected->done; })) << "a hang";
  ASSERT_FALSE(connected->error) << connected->message();
  const auto start = std::chrono::steady_clock::now();
  auto sent = spawn(io, send_views(sender, set.meta, set.views()));
  ASSERT_TRUE(run_until(io, [&] { return sent->done; })) << "a hang";
  const auto took = std::chrono::steady_clock::now() - start;
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the worker was killed, status " << status;
  ASSERT_TRUE(sent->error);
  EXPECT_EQ(sent->kind(), static_cast<int>(errc::peer_lost)) << sent->message();
  EXPECT_NE(sent->message().find("worker rank 1"), std::string::npos) << sent->message();
  EXPECT_LT(took, config.timeout) << "detected before the deadline, not by it";
}

int open_descriptors() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) n += e.exists() ? 1 : 0;
  return n;
}

// Registrations, endpoints, UCX workers and contexts are released on every path:
// after updates, refused inits and lost trainers, as many descriptors are open as
// before.
TEST(ucx, inits_updates_and_failures_leave_no_descriptors_behind) {
  auto round = [](int i) {
    asio::io_context io;
    ucx_harness h(io, nullptr);
    tensor_set set;
    for (int t = 0; t < 32; ++t) set.add("w" + std::to_string(t), dtype::float32, {4000});
    if (i % 3 == 2) {  // a refused init
      json init = h.sender().prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
      init["require_transports"] = {"rc"};
      auto info = h.engine().parse_init_info(init);
      auto t = spawn(io, h.sender().connect_workers());
      auto w = spawn(io, h.engine().init_transfer_engine(*info));
      EXPECT_TRUE(run_until(io, [&] { return t->done && w->done; })) << "a hang";
      EXPECT_TRUE(w->error);
      return;
    }
    run_to_completion(io, h.connect(small_wire()));
    std::atomic<int> loads{0};
    auto sent = spawn(io, send_views(h.sender(), set.meta, set.views()));
    auto received = spawn(io, receive_update(
                                  h.engine(), h.engine().parse_update_info(h.update_info_json(set.meta)),
                                  [&](std::span<const tensor_view> v) { loads += static_cast<int>(v.size()); }, true));
    if (i % 3 == 1) {  // the trainer goes mid-update
      EXPECT_TRUE(run_until(io, [&] { return loads > 0 || received->done; }));
      h.sender().shutdown();
    }
    EXPECT_TRUE(run_until(io, [&] { return sent->done && received->done; })) << "a hang";
    // (A trainer shut down mid-update may still have delivered it all: no error then.)
    if (i % 3 != 1) {
      EXPECT_FALSE(received->error) << received->message();
    }
  };
  round(0);  // first use: UCX loads its modules, once per process
  const int fds = open_descriptors();
  for (int i = 0; i < 12; ++i) round(i);
  EXPECT_EQ(open_descriptors(), fds) << "descriptors leaked across inits, updates and failures";
}

// The control plane carries what UCX chose: in the init answer and in weight_info.
asio::awaitable<void> init_through_host(ucx::sender& sender, control::client& client, json params, json& answer) {
  using namespace asio::experimental::awaitable_operators;
  auto call = [&]() -> asio::awaitable<void> {
    answer = co_await client.call("init_weight_transfer_engine", std::move(params));
  };
  co_await (sender.connect_workers() && call());
}

asio::awaitable<void> call_into(control::client& client, std::string method, json& out) {
  out = co_await client.call(method, json::object());
}

TEST(ucx, the_init_answer_and_weight_info_carry_the_transports) {
  asio::io_context io;
  engine_factory factory;
  factory.register_engine<ucx::engine, ucx::sender>("ucx");
  capture got;
  control::worker_host host(ucx_config(), engine_context{io.get_executor()}, got.fn(), factory);
  const auto port = host.listen("127.0.0.1", 0);
  spawn(io, host.serve());
  control::client client(io.get_executor(), std::chrono::seconds(5));
  run_to_completion(io, client.connect("127.0.0.1", port));
  ucx::sender sender(ucx_config(), trainer_context{io.get_executor(), {}});
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}};
  small_wire().write(args);
  json answer, info;
  run_to_completion(io, init_through_host(sender, client, {{"init_info", sender.prepare(args)}}, answer));
  run_to_completion(io, call_into(client, "weight_info", info));
  ASSERT_TRUE(answer.contains("transport")) << answer.dump();
  EXPECT_EQ(answer["transport"]["mode"], shared_memory ? "put" : "tag") << answer.dump();
  EXPECT_EQ(info["transport"], answer["transport"]) << info.dump();
  EXPECT_EQ(answer["transport"]["rank"], 1);
  client.close();
  host.stop();
  sender.shutdown();
  EXPECT_TRUE(run(io, std::chrono::seconds(5))) << "nothing left running";
}

// A trainer and `n` ucx workers in `topology` on one loop, with a capture per
// worker (as the tcp engine's relay tests).
struct ucx_group {
  asio::io_context io;
  std::unique_ptr<ucx::sender> sender;
  std::vector<std::unique_ptr<host_copy_target>> copies;  // by worker (null: no model target)
  std::vector<std::unique_ptr<ucx::engine>> workers;
  std::vector<std::unique_ptr<capture>> got;
  json init;

  // delta: the trainer sends deltas; the first `with_copy` workers (or those
  // `copy_mask` marks) keep a host copy of what they delivered (their model
  // target: what deltas decode against).
  ucx_group(int n, const std::string& topology, bool checksums, wire_params wire = small_wire(), bool delta = false,
            int with_copy = 0, std::vector<bool> copy_mask = {}) {
    for (int i = 0; i < n; ++i) got.push_back(std::make_unique<capture>());
    sender = std::make_unique<ucx::sender>(ucx_config(), trainer_context{io.get_executor(), {}});
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", n + 1}, {"topology", topology}};
    if (delta) args["delta"] = true;
    wire.checksums = checksums;
    wire.write(args);
    init = sender->prepare(args);
    for (int i = 0; i < n; ++i) {
      const bool keeps = copy_mask.empty() ? i < with_copy : copy_mask.at(static_cast<std::size_t>(i));
      copies.push_back(keeps ? std::make_unique<host_copy_target>() : nullptr);
      workers.push_back(
          std::make_unique<ucx::engine>(ucx_config(), engine_context{io.get_executor(), {}, {}, copies.back().get()}));
    }
  }
  ~ucx_group() {
    sender->shutdown();
    for (auto& w : workers) w->disconnect();
    run(io, std::chrono::seconds(5));
  }
  void reset_captures() {
    for (auto& g : got) g = std::make_unique<capture>();
  }
  static asio::awaitable<void> init_one(ucx::engine& e, json info) {
    auto typed = e.parse_init_info(info);
    co_await e.init_transfer_engine(*typed);
  }
  void connect() {
    std::vector<asio::awaitable<void>> all;
    all.push_back(sender->connect_workers());
    for (std::size_t i = 0; i < workers.size(); ++i) {
      json info = init;
      info["rank_offset"] = static_cast<int>(i) + 1;
      all.push_back(init_one(*workers[i], info));
    }
    run_to_completion(io, async::all_of(std::move(all)), std::chrono::seconds(30));
  }
  static asio::awaitable<void> receive(ucx::engine& e, std::unique_ptr<update_info> info, load_weights_fn load) {
    co_await e.receive_weights(*info, std::move(load));
    co_await e.drain_pending();
  }
  // One update: the send and every worker's receive (worker `at` also runs
  // `extra` on each load); their outcomes.
  std::pair<std::shared_ptr<outcome>, std::vector<std::shared_ptr<outcome>>> update(tensor_set& set,
                                                                                    load_weights_fn extra = {},
                                                                                    std::size_t at = 1) {
    auto sent = spawn(io, send_views(*sender, set.meta, set.views()));
    std::vector<std::shared_ptr<outcome>> received;
    json info = json::object();
    write_update_metadata(set.meta, info);
    for (std::size_t i = 0; i < workers.size(); ++i) {
      load_weights_fn load = copies[i] ? copies[i]->loading_through(got[i]->fn()) : got[i]->fn();
      if (extra && i == at)
        load = [inner = load, extra](std::span<const tensor_view> v) {
          extra(v);
          inner(v);
        };
      received.push_back(spawn(io, receive(*workers[i], workers[i]->parse_update_info(info), load)));
    }
    EXPECT_TRUE(run_until(
        io,
        [&] { return sent->done && std::all_of(received.begin(), received.end(), [](auto& r) { return r->done; }); },
        std::chrono::seconds(30)))
        << "a hang";
    return {sent, received};
  }
};

tensor_set mixed(std::uint8_t salt) {
  tensor_set set;
  set.add("embed", dtype::bfloat16, {300, 200});  // 120 KB: split over 64 KiB buffers
  for (int i = 0; i < 30; ++i) set.add("w" + std::to_string(i), dtype::float32, {10 + 137 * i});
  set.add("empty", dtype::int8, {0});
  for (auto& d : set.data)
    for (std::size_t k = 0; k < d.size(); ++k) d[k] = static_cast<std::byte>(k * 13 + salt);
  return set;
}

void every_worker_gets_every_byte(int n, const std::string& topology, bool checksums) {
  ucx_group g(n, topology, checksums);
  g.connect();
  const auto expected = links::topology::parse(topology, "test");
  for (std::size_t i = 0; i < g.workers.size(); ++i) {
    const int rank = static_cast<int>(i) + 1;
    EXPECT_EQ(g.workers[i]->upstream_rank(), expected.parent(rank)) << "rank " << rank;
    EXPECT_EQ(g.workers[i]->children(), expected.children(rank, n)) << "rank " << rank;
    EXPECT_EQ(g.workers[i]->transport_info().at("mode"), shared_memory ? "put" : "tag") << "rank " << rank;
  }
  // The trainer's egress: endpoints (and so puts or sends) to its own children
  // only, one copy in a chain, K in a tree.
  const json trainer = g.sender->transport_info();
  EXPECT_EQ(trainer.size(), expected.children(0, n).size()) << trainer.dump();
  for (int r : expected.children(0, n)) {
    json same = g.workers[r - 1]->transport_info();
    same.erase("rank");
    same.erase("put_into_model");  // the worker's choices
    same.erase("memory");
    EXPECT_EQ(trainer.value(std::to_string(r), json()), same) << trainer.dump();
  }
  for (std::uint8_t round = 1; round <= 2; ++round) {
    tensor_set set = mixed(round);
    g.reset_captures();
    auto [sent, received] = g.update(set);
    ASSERT_FALSE(sent->error) << sent->message();
    for (std::size_t i = 0; i < received.size(); ++i) {
      ASSERT_FALSE(received[i]->error) << "rank " << i + 1 << ": " << received[i]->message();
      EXPECT_NO_THROW(g.got[i]->check_equals(set)) << "rank " << i + 1 << ", round " << int(round);
    }
  }
}

// ---- Delta updates (docs/delta.md).

// About one element in `every` of each tensor moves by its lowest bit.
void nudge(tensor_set& set, std::size_t every, std::size_t offset) {
  for (std::size_t t = 0; t < set.data.size(); ++t) {
    const std::size_t elem = element_size(set.meta.tensors[t].dtype);
    auto& d = set.data[t];
    for (std::size_t e = offset % every; (e + 1) * elem <= d.size(); e += every) d[e * elem] ^= std::byte{1};
  }
}

class ucx_delta : public ::testing::TestWithParam<bool> {};  // checksums

TEST_P(ucx_delta, updates_after_the_first_go_as_deltas_to_workers_holding_the_base) {
  // Worker 1 keeps a host copy (deltas decode against it); worker 2 has no model
  // memory to decode against: it is offered the deltas, refuses, gets every update full.
  ucx_group g(2, "star", GetParam(), small_wire(), /*delta=*/true, /*with_copy=*/1);
  g.connect();
  tensor_set set = mixed(3);
  for (std::uint64_t round = 1; round <= 4; ++round) {
    if (round > 1) nudge(set, 50, round);
    g.reset_captures();
    auto [sent, received] = g.update(set);
    ASSERT_FALSE(sent->error) << sent->message();
    for (std::size_t i = 0; i < received.size(); ++i) {
      ASSERT_FALSE(received[i]->error) << "rank " << i + 1 << ": " << received[i]->message();
      EXPECT_NO_THROW(g.got[i]->check_equals(set)) << "rank " << i + 1 << ", round " << round;
      ASSERT_TRUE(g.workers[i]->held()) << "rank " << i + 1;
      EXPECT_EQ(g.workers[i]->held()->version, round);
      EXPECT_EQ(g.workers[i]->held()->fingerprint, g.sender->last_delta_stats().fingerprint);
    }
    const auto& d = g.sender->last_delta_stats();
    EXPECT_EQ(d.version, round);
    const auto& w1 = g.workers[0]->last_update_stats();
    if (round == 1) {
      EXPECT_EQ(d.base_version, 0u);
      EXPECT_GE(w1.wire_bytes, w1.bytes);  // full: every bucket's bytes
    } else {
      EXPECT_EQ(d.base_version, round - 1);
      EXPECT_EQ(d.delta_workers, 1u);
      EXPECT_EQ(d.full_fallbacks, 1u);
      EXPECT_GT(d.encoded_buckets, 0u);
      EXPECT_LT(w1.wire_bytes * 4, w1.bytes) << "2% of the elements moved";
    }
    EXPECT_GE(g.workers[1]->last_update_stats().wire_bytes, g.workers[1]->last_update_stats().bytes);
    EXPECT_EQ(g.sender->last_send_info().at("delta").at("version").get<std::uint64_t>(), round);
  }
  // One update asked full, then deltas again.
  nudge(set, 50, 7);
  g.sender->set_next_send({.delta = false});
  g.reset_captures();
  auto [sent, received] = g.update(set);
  ASSERT_FALSE(sent->error) << sent->message();
  for (auto& r : received) ASSERT_FALSE(r->error) << r->message();
  EXPECT_EQ(g.sender->last_delta_stats().delta_workers, 0u);
  EXPECT_NO_THROW(g.got[0]->check_equals(set));
  nudge(set, 50, 8);
  g.reset_captures();
  auto [sent2, received2] = g.update(set);
  ASSERT_FALSE(sent2->error) << sent2->message();
  for (auto& r : received2) ASSERT_FALSE(r->error) << r->message();
  EXPECT_EQ(g.sender->last_delta_stats().delta_workers, 1u);
  EXPECT_NO_THROW(g.got[0]->check_equals(set));
}

INSTANTIATE_TEST_SUITE_P(checksums, ucx_delta, ::testing::Bool());

TEST(ucx_delta, an_update_larger_than_the_snapshot_bound_goes_plain) {
  wire_params wire = small_wire();
  ucx_group g(1, "star", false, wire, /*delta=*/true, /*with_copy=*/1);
  // Re-prepared with a bound below the update.
  json args = {
      {"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}, {"topology", "star"}, {"delta", true},
      {"delta_max_bytes", 4096}};
  wire.write(args);
  g.init = g.sender->prepare(args);
  g.connect();
  tensor_set set = mixed(5);
  for (int round = 0; round < 2; ++round) {
    if (round) nudge(set, 50, 1);
    g.reset_captures();
    auto [sent, received] = g.update(set);
    ASSERT_FALSE(sent->error) << sent->message();
    ASSERT_FALSE(received[0]->error) << received[0]->message();
    EXPECT_NO_THROW(g.got[0]->check_equals(set));
    EXPECT_TRUE(g.sender->last_delta_stats().over_bound);
    EXPECT_EQ(g.sender->last_delta_stats().snapshot_bytes, 0u);
    EXPECT_FALSE(g.workers[0]->held());
  }
}

TEST(ucx_delta, a_copy_changed_behind_the_engine_is_refused_and_sent_full) {
  ucx_group g(1, "star", false, small_wire(), /*delta=*/true, /*with_copy=*/1);
  g.connect();
  tensor_set set = mixed(4);
  auto [s1, r1] = g.update(set);
  ASSERT_FALSE(s1->error) << s1->message();
  // Bytes the worker holds change outside refit: its recorded version is right,
  // its bytes are not; the offer is refused and the update comes full, exact.
  auto view = g.copies[0]->destination(set.meta.tensors[0]);
  ASSERT_TRUE(view);
  static_cast<std::byte*>(view->data)[17] ^= std::byte{0x20};
  nudge(set, 40, 1);
  g.reset_captures();
  auto [s2, r2] = g.update(set);
  ASSERT_FALSE(s2->error) << s2->message();
  ASSERT_FALSE(r2[0]->error) << r2[0]->message();
  EXPECT_EQ(g.sender->last_delta_stats().full_fallbacks, 1u);
  EXPECT_NO_THROW(g.got[0]->check_equals(set));
  nudge(set, 40, 2);
  g.reset_captures();
  auto [s3, r3] = g.update(set);
  ASSERT_FALSE(s3->error) << s3->message();
  EXPECT_EQ(g.sender->last_delta_stats().delta_workers, 1u);
  EXPECT_NO_THROW(g.got[0]->check_equals(set));
}

// One update over `g`; every worker exact, holding the trainer's version and
// fingerprint. Returns the trainer's delta stats.
backend::delta_send_stats exact_update(ucx_group& g, tensor_set& set, std::uint64_t version) {
  g.reset_captures();
  auto [sent, received] = g.update(set);
  EXPECT_FALSE(sent->error) << sent->message();
  for (std::size_t i = 0; i < received.size(); ++i) {
    EXPECT_FALSE(received[i]->error) << "rank " << i + 1 << ": " << received[i]->message();
    EXPECT_NO_THROW(g.got[i]->check_equals(set)) << "rank " << i + 1 << ", version " << version;
    EXPECT_TRUE(g.workers[i]->held()) << "rank " << i + 1;
    if (!g.workers[i]->held()) continue;
    EXPECT_EQ(g.workers[i]->held()->version, version) << "rank " << i + 1;
    EXPECT_EQ(g.workers[i]->held()->fingerprint, g.sender->last_delta_stats().fingerprint) << "rank " << i + 1;
  }
  return g.sender->last_delta_stats();
}

// Relays forward the encoded bytes: every worker of a chain or tree of 4 decodes
// them against its own base. A worker whose bytes changed behind the engine gets
// its stream full (its relay and siblings below that relay too), then deltas again.
class ucx_delta_relay : public ::testing::TestWithParam<std::string> {};  // topology

TEST_P(ucx_delta_relay, relays_forward_deltas_and_a_tampered_worker_gets_its_stream_full) {
  const std::string topology = GetParam();
  const auto t = links::topology::parse(topology, "test");
  ucx_group g(4, topology, /*checksums=*/topology == "chain", small_wire(), /*delta=*/true, /*with_copy=*/4);
  g.connect();
  tensor_set set = mixed(6);
  std::uint64_t version = 0;
  for (int round = 1; round <= 3; ++round) {
    if (round > 1) nudge(set, 50, static_cast<std::size_t>(round));
    const auto d = exact_update(g, set, ++version);
    if (round == 1) continue;
    EXPECT_EQ(d.delta_workers, 4u) << "round " << round;
    EXPECT_EQ(d.full_fallbacks, 0u);
    for (std::size_t i = 0; i < g.workers.size(); ++i) {
      const auto& w = g.workers[i]->last_update_stats();
      EXPECT_LT(w.wire_bytes * 4, w.bytes) << "rank " << i + 1 << ": 2% of the elements moved";
    }
  }
  // Rank 4's copy changes outside refit: the stream that reaches it goes full.
  auto view = g.copies[3]->destination(set.meta.tensors[0]);
  ASSERT_TRUE(view);
  static_cast<std::byte*>(view->data)[5] ^= std::byte{0x40};
  int root = 4;
  while (t.parent(root) != 0) root = t.parent(root);
  const std::size_t full = t.subtree(root, 4).size();
  nudge(set, 50, 9);
  auto d = exact_update(g, set, ++version);
  EXPECT_EQ(d.full_fallbacks, full);
  EXPECT_EQ(d.delta_workers, 4u - full);
  EXPECT_GE(g.workers[3]->last_update_stats().wire_bytes, g.workers[3]->last_update_stats().bytes);
  nudge(set, 50, 10);
  d = exact_update(g, set, ++version);
  EXPECT_EQ(d.delta_workers, 4u) << "deltas again once every worker holds the base";
}

INSTANTIATE_TEST_SUITE_P(topologies, ucx_delta_relay, ::testing::Values("chain", "tree:2"),
                         [](const auto& info) { return info.param == "chain" ? "chain" : "tree2"; });

TEST(ucx_delta, a_relay_without_the_base_forwards_full_buckets_to_children_that_hold_it) {
  // A chain 1 -> 2 -> 3: rank 2 has no model memory to decode against. The stream
  // goes full; rank 3 took the offer and reads each bucket's form (0, its own
  // bytes) from rank 2. Then rank 3 alone lacks the base: rank 2 answers for it.
  for (const std::vector<bool>& mask : {std::vector<bool>{true, false, true}, std::vector<bool>{true, true, false}}) {
    ucx_group g(3, "chain", false, small_wire(), /*delta=*/true, 0, mask);
    g.connect();
    tensor_set set = mixed(7);
    std::uint64_t version = 0;
    for (int round = 1; round <= 3; ++round) {
      if (round > 1) nudge(set, 50, static_cast<std::size_t>(round));
      const auto d = exact_update(g, set, ++version);
      if (round == 1) continue;
      EXPECT_EQ(d.full_fallbacks, 3u);
      EXPECT_EQ(d.delta_workers, 0u);
      for (std::size_t i = 0; i < g.workers.size(); ++i)
        EXPECT_GE(g.workers[i]->last_update_stats().wire_bytes, g.workers[i]->last_update_stats().bytes);
    }
  }
}

TEST(ucx_delta, without_deltas_on_a_delta_send_is_refused) {
  asio::io_context io;
  ucx::sender s(ucx_config(), trainer_context{io.get_executor(), {}});
  s.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}});
  EXPECT_THROW(s.set_next_send({.delta = true}), error);
  EXPECT_THROW(s.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 2}, {"delta_bytes", 1}}),
               error);  // (strict: an unknown member)
  EXPECT_TRUE(s.last_send_info().is_null());
  s.shutdown();
}

TEST(ucx_relay, a_chain_of_three_gets_every_byte) { every_worker_gets_every_byte(3, "chain", false); }
TEST(ucx_relay, a_chain_verifies_checksums_at_every_hop) { every_worker_gets_every_byte(3, "chain", true); }
TEST(ucx_relay, a_tree_of_fanout_two_gets_every_byte) { every_worker_gets_every_byte(4, "tree:2", false); }
TEST(ucx_relay, a_star_with_checksums_gets_every_byte) { every_worker_gets_every_byte(2, "star", true); }

// Worker 2 (the middle of 1 -> 2 -> 3) goes away mid-update: worker 3 fails at once
// with peer_lost naming its upstream, the trainer's send fails naming worker 2
// (worker 1 says which child it lost), nobody waits for a deadline, and after a
// re-init the chain delivers again.
TEST(ucx_relay, a_lost_middle_worker_fails_its_successor_and_the_trainer_naming_it) {
  ucx_group g(3, "chain", false);
  g.connect();
  tensor_set set = mixed(7);
  bool killed = false;
  const auto t0 = std::chrono::steady_clock::now();
  auto [sent, received] = g.update(set, [&](std::span<const tensor_view>) {
    if (killed) return;
    killed = true;
    asio::post(g.io, [&g] { g.workers[1]->disconnect(); });  // as if its process died
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, ucx_config().timeout) << "someone waited for a deadline";
  ASSERT_TRUE(killed);
  ASSERT_TRUE(received[2]->error) << "worker 3 did not notice its upstream was gone";
  EXPECT_EQ(received[2]->kind(), static_cast<int>(errc::peer_lost)) << received[2]->message();
  EXPECT_NE(received[2]->message().find("ucx worker rank 3: upstream worker rank 2"), std::string::npos)
      << received[2]->message();
  ASSERT_TRUE(sent->error) << "the trainer reported success";
  EXPECT_EQ(sent->kind(), static_cast<int>(errc::peer_lost)) << sent->message();
  EXPECT_NE(sent->message().find("downstream worker rank 2"), std::string::npos) << sent->message();
  ASSERT_TRUE(received[0]->error);
  EXPECT_NE(received[0]->message().find("downstream worker rank 2"), std::string::npos) << received[0]->message();

  // Re-init (worker 2 too): the chain forms again and delivers.
  json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 4}, {"topology", "chain"}};
  small_wire().write(args);
  g.init = g.sender->prepare(args);
  g.connect();
  g.reset_captures();
  auto [sent2, received2] = g.update(set);
  ASSERT_FALSE(sent2->error) << sent2->message();
  for (std::size_t i = 0; i < received2.size(); ++i) {
    ASSERT_FALSE(received2[i]->error) << received2[i]->message();
    EXPECT_NO_THROW(g.got[i]->check_equals(set));
  }
}

// A bucket whose bytes differ from what the trainer checksummed is refused before
// it is loaded. The trainer checksums the whole update in one pass before its first
// byte leaves; with one staging slot the worker grants bucket k+1 only once bucket
// k was loaded, so a byte of the last tensor flipped (in the trainer's memory,
// this is one process) by the worker's first load changes the bytes put or sent,
// not the checksum: the worker sees what a corruption on the way would look like.
TEST(ucx_relay, a_bucket_changed_after_its_checksum_is_refused_before_it_is_loaded) {
  wire_params wire;
  wire.buffer_bytes = 16 << 10;
  wire.num_buffers = 1;
  for (const std::string topology : {"star", "chain"}) {
    SCOPED_TRACE(topology);
    const int n = topology == "star" ? 1 : 2;
    ucx_group g(n, topology, true, wire);
    g.connect();
    tensor_set set;
    for (int i = 0; i < 8; ++i) set.add("w" + std::to_string(i), dtype::float32, {4096});  // one bucket each
    bool flipped = false;
    auto [sent, received] = g.update(
        set,
        [&](std::span<const tensor_view>) {
          if (std::exchange(flipped, true)) return;
          set.data[7][100] ^= std::byte{0x40};
        },
        0);
    ASSERT_TRUE(flipped);
    for (std::size_t i = 0; i < received.size(); ++i) {
      ASSERT_TRUE(received[i]->error) << "rank " << i + 1;
      if (i == 0 || received[i]->kind() == static_cast<int>(errc::integrity_error)) {
        EXPECT_EQ(received[i]->kind(), static_cast<int>(errc::integrity_error)) << received[i]->message();
        EXPECT_NE(received[i]->message().find("bucket 7: payload checksum"), std::string::npos)
            << received[i]->message();
      }
      const auto got = g.got[i]->received();
      EXPECT_EQ(got.count("w7"), 0u) << "rank " << i + 1 << ": the corrupted bucket was loaded";
      if (i == 0) {
        for (int t = 0; t < 7; ++t) EXPECT_EQ(got.count("w" + std::to_string(t)), 1u) << "w" << t;
      }
    }
    ASSERT_TRUE(sent->error);
    EXPECT_EQ(sent->kind(), static_cast<int>(errc::integrity_error)) << sent->message();
  }
}

TEST(ucx_relay, topologies_are_read_and_checked_by_both_sides) {
  asio::io_context io;
  ucx::sender sender(ucx_config(), trainer_context{io.get_executor(), {}});
  EXPECT_THROW(sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"topology", "ring"}}), error);
  const json chain =
      sender.prepare({{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", 4}, {"checksums", true}});
  EXPECT_EQ(chain.at("topology"), "chain") << "the default beyond two workers, as tcp's";
  EXPECT_TRUE(chain.at("checksums").get<bool>());
  ucx::engine engine(ucx_config(), engine_context{io.get_executor()});
  EXPECT_NO_THROW(engine.parse_init_info(chain));
  json bad = chain;
  bad["topology"] = "tree:0";
  EXPECT_THROW(engine.parse_init_info(bad), error);
  EXPECT_TRUE(ucx::engine::capabilities_of().relay);
  EXPECT_TRUE(ucx::engine::capabilities_of().checksums);
  sender.shutdown();
}

}  // namespace
}  // namespace refit::testing

using refit::testing::engine_conformance;
INSTANTIATE_TEST_SUITE_P(
    ucx, engine_conformance,
    ::testing::Values(refit::testing::harness_factory{"ucx",
                                                      [](asio::io_context& io, refit::model_target* model) {
                                                        return std::unique_ptr<refit::testing::engine_harness>(
                                                            new refit::testing::ucx_harness(io, model));
                                                      }},
                      refit::testing::harness_factory{"ucx_auth",
                                                      [](asio::io_context& io, refit::model_target* model) {
                                                        return std::unique_ptr<refit::testing::engine_harness>(
                                                            new refit::testing::ucx_harness(io, model,
                                                                                            "shared secret"));
                                                      }}),
    [](const auto& info) { return info.param.name; });
