#include "tests/conformance/conformance.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <map>

#include <refit/factory.h>
#include <refit/metadata.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {

json engine_harness::update_info_json(const update_metadata& meta) {
  json j = json::object();
  write_update_metadata(meta, j);
  return j;
}

namespace {

wire_params small_wire(std::uint64_t buffer = 64 << 10, std::uint32_t buffers = 2) {
  wire_params w;
  w.buffer_bytes = buffer;
  w.num_buffers = buffers;
  return w;
}

TEST_P(engine_conformance, round_trip_of_mixed_tensor_set) {
  connect(small_wire(16 << 10, 2));
  tensor_set set;
  set.add("embed.weight", dtype::bfloat16, {300, 64});
  set.add("layers.0.norm.weight", dtype::float32, {64});
  set.add("layers.0.q.bias", dtype::float16, {3});  // odd size: next offset needs padding
  set.add("layers.0.flag", dtype::bool_, {5});
  set.add("layers.0.q.weight", dtype::float8_e4m3fn, {64, 64});
  set.add("layers.0.counts", dtype::int64, {7, 3});
  set.add("layers.0.scale", dtype::float64, {});
  set.add("lm_head.weight", dtype::bfloat16, {128, 64});
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_NO_THROW(got.check_equals(set));
  const auto& stats = harness_->engine().last_update_stats();
  EXPECT_EQ(stats.bytes, set.meta.total_bytes());
  EXPECT_EQ(stats.tensors, set.meta.tensors.size());
  EXPECT_GT(stats.buckets, 1u);
}

TEST_P(engine_conformance, empty_update_completes_without_loading) {
  connect(small_wire());
  tensor_set set;
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_EQ(got.calls(), 0u);
}

TEST_P(engine_conformance, zero_size_tensors_are_delivered) {
  connect(small_wire());
  tensor_set set;
  set.add("empty.a", dtype::float32, {0});
  set.add("real", dtype::float32, {16});
  set.add("empty.b", dtype::bfloat16, {4, 0, 3});
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_P(engine_conformance, tensor_larger_than_a_buffer_arrives_whole) {
  connect(small_wire(16 << 10, 2));
  tensor_set set;
  set.add("before", dtype::float32, {100});
  set.add("huge", dtype::float32, {14500});    // 58000 bytes: 4 chunks of 16 KiB
  set.add("huge2", dtype::bfloat16, {20000});  // a second split tensor right after
  set.add("after", dtype::int8, {33});
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_P(engine_conformance, repeated_updates_reuse_the_engine) {
  connect(small_wire(32 << 10, 3));
  for (int round = 0; round < 3; ++round) {
    tensor_set set;
    for (int i = 0; i < 20; ++i) set.add("w" + std::to_string(i), dtype::bfloat16, {37 + i, 11}, round + 1);
    capture got;
    expect_ok(transfer(set, got.fn()));
    EXPECT_NO_THROW(got.check_equals(set)) << "round " << round;
  }
}

TEST_P(engine_conformance, deferred_processing_completes_in_drain) {
  connect(small_wire(16 << 10, 8));
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("t" + std::to_string(i), dtype::float32, {1000});
  // Processing blocks until the test opens the gate, after receive_weights returned.
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  std::atomic<int> loaded{0};
  auto load = [&, opened](std::span<const tensor_view> views) {
    opened.wait();
    loaded += static_cast<int>(views.size());
  };
  auto& engine = harness_->engine();
  auto info = engine.parse_update_info(harness_->update_info_json(set.meta));
  auto views = set.views();
  auto send = spawn(io_, send_views(harness_->sender(), set.meta, views));
  auto recv = spawn(io_, engine.receive_weights(*info, load));
  if (!engine.defers_processing()) {
    gate.set_value();
    ASSERT_TRUE(run(io_));
    EXPECT_FALSE(recv->error) << recv->message();
    EXPECT_EQ(loaded.load(), 4) << "an engine that does not defer loads everything before returning";
    return;
  }
  // Run until receive completes; processing is still held at the gate.
  ASSERT_TRUE(run_until(io_, [&] { return recv->done; })) << "receive did not complete";
  EXPECT_FALSE(recv->error) << recv->message();
  EXPECT_EQ(loaded.load(), 0);
  gate.set_value();
  auto drain = spawn(io_, engine.drain_pending());
  ASSERT_TRUE(run(io_));
  EXPECT_FALSE(drain->error) << drain->message();
  EXPECT_EQ(loaded.load(), 4);
  EXPECT_FALSE(send->error) << send->message();
  // Idempotent: a second drain has nothing to wait for and nothing to report.
  auto again = spawn(io_, engine.drain_pending());
  ASSERT_TRUE(run(io_));
  EXPECT_TRUE(again->done && !again->error);
}

TEST_P(engine_conformance, load_weights_error_surfaces_once) {
  connect(small_wire(16 << 10, 2));
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("t" + std::to_string(i), dtype::float32, {2000});
  auto load = [](std::span<const tensor_view> views) {
    for (const auto& v : views)
      if (v.name == "t3") throw std::runtime_error("model has no parameter t3");
  };
  auto r = transfer(set, load, /*drain=*/true);
  EXPECT_FALSE(r.first->error) << "the sender is not at fault: " << r.first->message();
  ASSERT_TRUE(r.second->error);
  EXPECT_EQ(r.second->kind(), static_cast<int>(errc::processing_failed));
  EXPECT_NE(r.second->message().find("model has no parameter t3"), std::string::npos) << r.second->message();
  EXPECT_NE(r.second->message().find("'t3'"), std::string::npos) << r.second->message();
  // Reported once: the next drain is clean, and the engine takes the next update.
  auto again = spawn(io_, harness_->engine().drain_pending());
  ASSERT_TRUE(run(io_));
  EXPECT_FALSE(again->error) << again->message();
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_NO_THROW(got.check_equals(set));
}

TEST_P(engine_conformance, sender_tensor_diverging_from_declaration_is_named) {
  connect(small_wire());
  tensor_set set;
  set.add("a", dtype::float32, {10});
  set.add("b", dtype::float32, {10});
  set.add("c", dtype::float32, {10});
  auto views = set.views();
  std::vector<std::int64_t> wrong{11};
  views[1].shape = wrong;
  capture got;
  auto r = transfer(set, got.fn(), true, &views);
  ASSERT_TRUE(r.first->error);
  EXPECT_EQ(r.first->kind(), static_cast<int>(errc::invalid_argument));
  EXPECT_NE(r.first->message().find("parameter #1 ('b') shape"), std::string::npos) << r.first->message();
  EXPECT_TRUE(r.second->done) << "the worker must not hang";
}

// A model that offers its own memory for some tensors: those bytes must arrive
// there (no staging copy), the rest through staging, and load_weights sees both.
class direct_model final : public model_target {
 public:
  explicit direct_model(const tensor_set& set) {
    for (std::size_t i = 0; i < set.meta.tensors.size(); ++i)
      if (i % 2 == 0) memory_[set.meta.tensors[i].name].resize(set.data[i].size());
  }
  void load_weights(std::span<const tensor_view>) override {}
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    auto it = memory_.find(spec.name);
    if (it == memory_.end()) return std::nullopt;
    return tensor_view(spec, it->second.data());
  }
  bool owns(const tensor_view& v) const {
    auto it = memory_.find(std::string(v.name));
    return it != memory_.end() && v.data == it->second.data();
  }
  std::map<std::string, std::vector<std::byte>> memory_;
};

TEST_P(engine_conformance, direct_receive_into_model_memory) {
  tensor_set set;
  set.add("a", dtype::float32, {1000});
  set.add("b", dtype::bfloat16, {77});
  set.add("big", dtype::float32, {10000});  // 40000 bytes: split over 16 KiB buffers
  set.add("c", dtype::int8, {13});
  set.add("d", dtype::float16, {500});
  set.add("big2", dtype::bfloat16, {30000});  // split, not direct
  direct_model model(set);
  harness_ = GetParam().make(io_, &model);
  connect(small_wire(16 << 10, 2));
  std::vector<std::string> direct_views, staged_views;
  capture got;
  auto copy = got.fn();
  auto load = [&](std::span<const tensor_view> views) {
    for (const auto& v : views) (model.owns(v) ? direct_views : staged_views).emplace_back(v.name);
    copy(views);
  };
  expect_ok(transfer(set, load));
  EXPECT_NO_THROW(got.check_equals(set));
  if (!harness_->engine().capabilities().direct_receive) {
    // Not claimed: everything through staging, still correct.
    EXPECT_TRUE(direct_views.empty());
    EXPECT_EQ(staged_views.size(), set.meta.tensors.size());
    return;
  }
  EXPECT_EQ(direct_views, (std::vector<std::string>{"a", "big", "d"}));
  EXPECT_EQ(staged_views, (std::vector<std::string>{"b", "c", "big2"}));
  for (std::size_t i = 0; i < set.meta.tensors.size(); i += 2)
    EXPECT_EQ(model.memory_[set.meta.tensors[i].name], set.data[i]) << set.meta.tensors[i].name;
}

json with_commit(json info, const char* mode) {
  info["commit"] = mode;
  return info;
}

// The engine's capabilities (engine_capabilities) decide which of the tests below
// apply: a claimed capability is tested; one not claimed is skipped, saying so.
#define REFIT_REQUIRE_CAPABILITY(engine, what)                                        \
  if (!(engine).capabilities().what)                                                  \
  GTEST_SKIP() << (engine).backend() << " does not claim engine_capabilities::" #what \
               << " (its capabilities: " << (engine).capabilities().to_json().dump() << ")"

TEST_P(engine_conformance, capabilities_are_what_the_factory_registered) {
  connect(small_wire(16 << 10, 2));
  auto& engine = harness_->engine();
  EXPECT_EQ(engine.defers_processing(), engine.capabilities().defers_processing);
  if (!engine_factory::instance().contains(engine.backend()))
    GTEST_SKIP() << engine.backend() << " is not registered in this binary (a GPU engine on the host provider)";
  const auto registered = engine_factory::instance().capabilities(engine.backend());
  ASSERT_TRUE(registered.has_value());
  EXPECT_EQ(*registered, engine.capabilities())
      << "registered " << registered->to_json().dump() << ", engine says " << engine.capabilities().to_json().dump();
}

TEST_P(engine_conformance, staged_commit_loads_the_whole_update_at_once_after_it_arrived) {
  {
    connect(small_wire(16 << 10, 2));
    REFIT_REQUIRE_CAPABILITY(harness_->engine(), staged_commit);
  }
  tensor_set set;
  for (int i = 0; i < 12; ++i) set.add("t" + std::to_string(i), dtype::float32, {3000});  // 12 KiB each
  set.add("big", dtype::bfloat16, {30000});                                               // split over 16 KiB buffers
  direct_model model(set);
  harness_ = GetParam().make(io_, &model);
  connect(small_wire(16 << 10, 2));
  auto& engine = harness_->engine();
  auto info = engine.parse_update_info(with_commit(harness_->update_info_json(set.meta), "staged"));
  ASSERT_EQ(info->commit, commit_mode::staged);
  capture got;
  auto copy = got.fn();
  std::size_t direct = 0;
  auto load = [&](std::span<const tensor_view> views) {
    for (const auto& v : views) direct += model.owns(v);
    copy(views);
  };
  auto send = spawn(io_, send_views(harness_->sender(), set.meta, set.views()));
  auto recv = spawn(io_, receive_update(engine, std::move(info), load, /*drain=*/false));
  ASSERT_TRUE(run(io_)) << "a hang";
  expect_ok({send, recv});
  EXPECT_NO_THROW(got.check_equals(set));
  // One call with every tensor: nothing was loaded before the last bucket arrived,
  // and nothing went into the model's memory behind load_weights' back.
  EXPECT_EQ(got.calls(), 1u);
  EXPECT_EQ(direct, 0u);
  EXPECT_GE(engine.staged_bytes(), set.meta.total_bytes());
  EXPECT_FALSE(engine.weights_dirty());
  EXPECT_GT(engine.last_update_stats().buckets, 2u);
  engine.shutdown();
  EXPECT_EQ(engine.staged_bytes(), 0u) << "shutdown frees the stage";
}

TEST_P(engine_conformance, failing_staged_commit_marks_weights_dirty) {
  connect(small_wire(16 << 10, 2));
  REFIT_REQUIRE_CAPABILITY(harness_->engine(), staged_commit);
  tensor_set set;
  for (int i = 0; i < 4; ++i) set.add("t" + std::to_string(i), dtype::float32, {5000});
  auto& engine = harness_->engine();
  auto info = engine.parse_update_info(with_commit(harness_->update_info_json(set.meta), "staged"));
  auto load = [](std::span<const tensor_view>) { throw std::runtime_error("device full"); };
  auto send = spawn(io_, send_views(harness_->sender(), set.meta, set.views()));
  auto recv = spawn(io_, receive_update(engine, std::move(info), load, false));
  ASSERT_TRUE(run(io_));
  EXPECT_FALSE(send->error) << send->message();
  ASSERT_TRUE(recv->error);
  EXPECT_NE(recv->message().find("device full"), std::string::npos) << recv->message();
  EXPECT_TRUE(engine.weights_dirty());
  EXPECT_NE(engine.dirty_reason().find("commit of a staged update"), std::string::npos) << engine.dirty_reason();
  // The next full update clears it (through a session; here directly).
  capture got;
  expect_ok(transfer(set, got.fn()));
  EXPECT_NO_THROW(got.check_equals(set));
  EXPECT_TRUE(engine.weights_dirty()) << "only a finished session (or the user) declares the weights clean";
  engine.mark_weights_clean();
  EXPECT_FALSE(engine.weights_dirty());
}

TEST_P(engine_conformance, in_place_processing_failure_marks_weights_dirty) {
  connect(small_wire(16 << 10, 2));
  tensor_set set;
  for (int i = 0; i < 6; ++i) set.add("t" + std::to_string(i), dtype::float32, {2000});
  auto load = [](std::span<const tensor_view> views) {
    for (const auto& v : views)
      if (v.name == "t4") throw std::runtime_error("bad t4");
  };
  auto r = transfer(set, load, /*drain=*/true);
  ASSERT_TRUE(r.second->error);
  EXPECT_TRUE(harness_->engine().weights_dirty()) << "t0..t3 were already loaded";
  EXPECT_NE(harness_->engine().dirty_reason().find("bad t4"), std::string::npos) << harness_->engine().dirty_reason();
}

TEST_P(engine_conformance, receive_before_init_is_a_clear_error) {
  auto& engine = harness_->engine();
  tensor_set set;
  set.add("a", dtype::float32, {4});
  auto info = engine.parse_update_info(harness_->update_info_json(set.meta));
  capture got;
  auto r = spawn(io_, engine.receive_weights(*info, got.fn()));
  ASSERT_TRUE(run(io_));
  ASSERT_TRUE(r->error);
  EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_state));
  EXPECT_NE(r->message().find("before init_transfer_engine"), std::string::npos) << r->message();
}

TEST_P(engine_conformance, update_info_rejects_unknown_and_mistyped_members) {
  auto& engine = harness_->engine();
  json j = {{"names", {"a"}}, {"dtype_names", {"float32"}}, {"shapes", {{4}}}, {"bogus", 1}};
  try {
    engine.parse_update_info(j);
    ADD_FAILURE() << "unknown member accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_NE(e.message().find("'bogus'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find(std::string(engine.backend())), std::string::npos) << e.message();
  }
  j.erase("bogus");
  j["shapes"] = {{"4"}};
  try {
    engine.parse_update_info(j);
    ADD_FAILURE() << "string shape accepted";
  } catch (const error& e) {
    EXPECT_NE(e.message().find("shapes[0][0]"), std::string::npos) << e.message();
  }
}

}  // namespace

}  // namespace refit::testing
