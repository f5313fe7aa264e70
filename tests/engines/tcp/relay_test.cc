// The TCP engine's relay topologies (lib/backend/links/relay.h) in one process: a trainer
// and N workers on one loop; the trainer sends one copy (chain) or K (tree), the
// workers forward each bucket as it arrives, and every worker gets every byte.
#include <gtest/gtest.h>

#include <refit/engines/tcp/tcp.h>
#include <asio/post.hpp>

#include <refit/backend/async/all_of.h>
#include "tests/conformance/conformance.h"

namespace refit::testing {
namespace {

using namespace std::chrono_literals;

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(engine_conformance);  // (only its helpers are used)

weight_transfer_config tcp_config(std::chrono::milliseconds timeout = 5s) {
  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = timeout;
  return config;
}

// A trainer and `n` workers in `topology`, with a capture per worker.
struct group_of_workers {
  asio::io_context io;
  std::unique_ptr<tcp::sender> sender;
  std::vector<std::unique_ptr<tcp::engine>> workers;
  std::vector<std::unique_ptr<capture>> got;
  json init;

  group_of_workers(int n, const std::string& topology, bool checksums, std::chrono::milliseconds timeout = 5s) {
    reset_captures(n);
    sender = std::make_unique<tcp::sender>(tcp_config(timeout), trainer_context{io.get_executor(), {}});
    json args = {{"master_address", "127.0.0.1"}, {"master_port", 0}, {"world_size", n + 1},
                 {"buffer_bytes", 16 << 10},      {"num_buffers", 2}, {"checksums", checksums},
                 {"topology", topology}};
    init = sender->prepare(args);
    for (int i = 0; i < n; ++i)
      workers.push_back(std::make_unique<tcp::engine>(tcp_config(timeout), engine_context{io.get_executor()}));
  }
  void reset_captures(int n) {
    got.clear();
    for (int i = 0; i < n; ++i) got.push_back(std::make_unique<capture>());
  }
  ~group_of_workers() {
    sender->shutdown();
    for (auto& w : workers) w->shutdown();
    run(io, 5s);
  }

  static asio::awaitable<void> init_one(tcp::engine& e, json info) {
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
    run_to_completion(io, async::all_of(std::move(all)), 30s);
  }

  static asio::awaitable<void> receive(tcp::engine& e, std::unique_ptr<update_info> info, load_weights_fn load) {
    co_await e.receive_weights(*info, std::move(load));
    co_await e.drain_pending();
  }
  // One update: the send and every worker's receive; their outcomes.
  std::pair<std::shared_ptr<outcome>, std::vector<std::shared_ptr<outcome>>> update(tensor_set& set,
                                                                                    load_weights_fn extra = {}) {
    auto sent = spawn(io, send_views(*sender, set.meta, set.views()));
    std::vector<std::shared_ptr<outcome>> received;
    json info = json::object();
    write_update_metadata(set.meta, info);
    for (std::size_t i = 0; i < workers.size(); ++i) {
      load_weights_fn load = got[i]->fn();
      if (extra && i == 1)
        load = [inner = load, extra](std::span<const tensor_view> v) {
          extra(v);
          inner(v);
        };
      received.push_back(spawn(io, receive(*workers[i], workers[i]->parse_update_info(info), load)));
    }
    EXPECT_TRUE(run_until(
        io,
        [&] { return sent->done && std::all_of(received.begin(), received.end(), [](auto& r) { return r->done; }); },
        30s))
        << "a hang";
    return {sent, received};
  }
};

tensor_set mixed(std::uint8_t salt) {
  tensor_set set;
  set.add("embed", dtype::bfloat16, {300, 100});  // 60 KB: split over 16 KiB buffers
  for (int i = 0; i < 30; ++i) set.add("w" + std::to_string(i), dtype::float32, {10 + 37 * i});
  set.add("empty", dtype::int8, {0});
  for (auto& d : set.data)
    for (std::size_t k = 0; k < d.size(); ++k) d[k] = static_cast<std::byte>(k * 13 + salt);
  return set;
}

void every_worker_gets_every_byte(int n, const std::string& topology, bool checksums) {
  group_of_workers g(n, topology, checksums);
  g.connect();
  // Who receives from whom.
  for (std::size_t i = 0; i < g.workers.size(); ++i) {
    const int rank = static_cast<int>(i) + 1;
    const auto expected = links::topology::parse(topology, "test");
    EXPECT_EQ(g.workers[i]->upstream_rank(), expected.parent(rank)) << "rank " << rank;
    EXPECT_EQ(g.workers[i]->children(), expected.children(rank, n)) << "rank " << rank;
  }
  for (std::uint8_t round = 1; round <= 2; ++round) {
    tensor_set set = mixed(round);
    g.reset_captures(n);
    auto [sent, received] = g.update(set);
    ASSERT_FALSE(sent->error) << sent->message();
    for (std::size_t i = 0; i < received.size(); ++i) {
      ASSERT_FALSE(received[i]->error) << "rank " << i + 1 << ": " << received[i]->message();
      EXPECT_NO_THROW(g.got[i]->check_equals(set)) << "rank " << i + 1 << ", round " << int(round);
    }
  }
}

TEST(tcp_relay, a_chain_of_three_gets_every_byte) { every_worker_gets_every_byte(3, "chain", false); }
TEST(tcp_relay, a_chain_verifies_checksums_at_every_hop) { every_worker_gets_every_byte(3, "chain", true); }
TEST(tcp_relay, a_tree_of_fanout_two_gets_every_byte) { every_worker_gets_every_byte(6, "tree:2", true); }

TEST(tcp_relay, the_default_is_a_star_for_two_and_a_chain_beyond) {
  EXPECT_TRUE(links::topology::default_for(1).star());
  EXPECT_TRUE(links::topology::default_for(2).star());
  EXPECT_EQ(links::topology::default_for(3).to_string(), "chain");
  EXPECT_THROW(links::topology::parse("ring", "t"), error);
  EXPECT_THROW(links::topology::parse("tree:0", "t"), error);
  EXPECT_EQ(links::topology::parse("tree:4", "t").children(1, 30), (std::vector<int>{5, 6, 7, 8}));
  EXPECT_EQ(links::topology::parse("tree:4", "t").parent(8), 1);
}

// Worker 2 (the middle of 1 -> 2 -> 3) goes away mid-update: worker 3 fails at once
// (its upstream is gone), the trainer's send fails naming where, and after a
// re-init everything works again.
TEST(tcp_relay, a_lost_middle_worker_fails_its_successors_at_once_and_the_chain_recovers) {
  group_of_workers g(3, "chain", false, 5s);
  g.connect();
  tensor_set set = mixed(7);
  bool killed = false;
  const auto t0 = std::chrono::steady_clock::now();
  auto [sent, received] = g.update(set, [&](std::span<const tensor_view>) {
    if (killed) return;
    killed = true;
    asio::post(g.io, [&g] { g.workers[1]->disconnect(); });  // as if its process died
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s) << "someone waited for a deadline";
  ASSERT_TRUE(killed);
  ASSERT_TRUE(received[2]->error) << "worker 3 did not notice its upstream was gone";
  EXPECT_EQ(received[2]->kind(), static_cast<int>(errc::peer_lost)) << received[2]->message();
  EXPECT_NE(received[2]->message().find("tcp worker rank 3"), std::string::npos) << received[2]->message();
  ASSERT_TRUE(sent->error) << "the trainer reported success";
  EXPECT_NE(sent->message().find("rank"), std::string::npos) << sent->message();

  // Re-init (worker 2 too): the chain forms again and delivers.
  g.init = g.sender->prepare({{"master_address", "127.0.0.1"},
                              {"master_port", 0},
                              {"world_size", 4},
                              {"buffer_bytes", 16 << 10},
                              {"num_buffers", 2},
                              {"topology", "chain"}});
  g.connect();
  g.reset_captures(3);
  auto [sent2, received2] = g.update(set);
  ASSERT_FALSE(sent2->error) << sent2->message();
  for (std::size_t i = 0; i < received2.size(); ++i) {
    ASSERT_FALSE(received2[i]->error) << received2[i]->message();
    EXPECT_NO_THROW(g.got[i]->check_equals(set));
  }
}

// A worker down the chain refuses the update (its metadata differ): the refusal
// comes up the chain to the trainer, naming that worker and why, before any bucket.
TEST(tcp_relay, a_refusal_down_the_chain_reaches_the_trainer_naming_the_worker) {
  group_of_workers g(3, "chain", false);
  g.connect();
  tensor_set set = mixed(3);
  auto sent = spawn(g.io, send_views(*g.sender, set.meta, set.views()));
  std::vector<std::shared_ptr<outcome>> received;
  for (std::size_t i = 0; i < 3; ++i) {
    update_metadata meta = set.meta;
    if (i == 2) meta.tensors[1].dtype = dtype::int32;  // worker 3 thinks otherwise
    json info = json::object();
    write_update_metadata(meta, info);
    received.push_back(
        spawn(g.io, group_of_workers::receive(*g.workers[i], g.workers[i]->parse_update_info(info), g.got[i]->fn())));
  }
  ASSERT_TRUE(run_until(
      g.io,
      [&] { return sent->done && std::all_of(received.begin(), received.end(), [](auto& r) { return r->done; }); },
      30s));
  ASSERT_TRUE(sent->error);
  EXPECT_EQ(sent->kind(), static_cast<int>(errc::protocol_error)) << sent->message();
  EXPECT_NE(sent->message().find("downstream worker rank 3 refused the update"), std::string::npos) << sent->message();
  EXPECT_NE(sent->message().find("names, dtypes or shapes differ"), std::string::npos) << sent->message();
  for (auto& c : g.got) EXPECT_EQ(c->calls(), 0u) << "a byte was loaded although the update was refused";
}

}  // namespace
}  // namespace refit::testing
