// The engine conformance suite: one parameterised gtest suite that every backend
// instantiates with a harness connecting its sender to its engine:
//
//   INSTANTIATE_TEST_SUITE_P(tcp, engine_conformance,
//                            ::testing::Values(refit::testing::harness_factory{"tcp", make}));
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <gtest/gtest.h>
#include <asio/awaitable.hpp>
#include <asio/io_context.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/engine.h>
#include <refit/trainer.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {

/// Connects one trainer-side sender with one worker-side engine of a backend.
class engine_harness {
 public:
  virtual ~engine_harness() = default;
  /// Creates and initialises both sides with `wire` and a short peer timeout.
  virtual asio::awaitable<void> connect(const wire_params& wire) = 0;
  virtual weight_transfer_engine& engine() = 0;
  virtual weight_sender& sender() = 0;
  /// The update info JSON the trainer would send for `meta` (backends with extra
  /// members override).
  virtual json update_info_json(const update_metadata& meta);
};

struct harness_factory {
  std::string name;
  /// Builds the harness; `model` goes into the engine's context (may be null).
  std::function<std::unique_ptr<engine_harness>(asio::io_context&, model_target* model)> make;
  friend void PrintTo(const harness_factory& f, std::ostream* os) { *os << f.name; }
};

// send_views and receive_update: tests/support/run.h.

/// The suite's fixture; instantiate it with harness_factory values.
class engine_conformance : public ::testing::TestWithParam<harness_factory> {
 protected:
  void SetUp() override { harness_ = GetParam().make(io_, nullptr); }

  void connect(wire_params wire) { run_to_completion(io_, harness_->connect(wire)); }

  // Sends `set` and receives it into `load`; returns both outcomes.
  std::pair<std::shared_ptr<outcome>, std::shared_ptr<outcome>> transfer(tensor_set& set, load_weights_fn load,
                                                                         bool drain = true,
                                                                         std::vector<tensor_view>* sent = nullptr) {
    auto info = harness_->engine().parse_update_info(harness_->update_info_json(set.meta));
    auto views = sent ? *sent : set.views();
    auto& sender = harness_->sender();
    auto& engine = harness_->engine();
    auto send = spawn(io_, send_views(sender, set.meta, std::move(views)));
    auto recv = spawn(io_, receive_update(engine, std::move(info), std::move(load), drain));
    EXPECT_TRUE(run(io_)) << "transfer did not finish: a hang";
    return {send, recv};
  }

  void expect_ok(const std::pair<std::shared_ptr<outcome>, std::shared_ptr<outcome>>& r) {
    EXPECT_TRUE(r.first->done && !r.first->error) << "sender: " << r.first->message();
    EXPECT_TRUE(r.second->done && !r.second->error) << "receiver: " << r.second->message();
  }

  asio::io_context io_;
  std::unique_ptr<engine_harness> harness_;
};

}  // namespace refit::testing
