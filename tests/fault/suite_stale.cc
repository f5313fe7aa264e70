// stale_trainer: a second control client calls a live session's verbs on a
// worker (suite.h; suite_faults.cc injects it).
#include "tests/fault/suite.h"

namespace refit::fault {

// A stale trainer: its own authenticated connection to a worker, whose every verb
// on the live session must be refused.
// Two waves: mid-chunk, then (`between`) once the chunk is received and the
// session waits for its finish.
asio::awaitable<void> suite::stale_calls(std::uint16_t port,
                                         std::shared_ptr<std::vector<std::pair<std::string, std::string>>> out,
                                         std::shared_ptr<bool> done, bool between) {
  control::client c(io_.get_executor(), std::chrono::milliseconds(o_.timeout_ms * 2), secret_);
  try {
    co_await c.connect("127.0.0.1", port);
    co_await stale_wave(c, *out);
    *done = true;  // the held stream goes on
    if (between) {
      const auto until = clock_type::now() + std::chrono::milliseconds(o_.timeout_ms * 2);
      asio::steady_timer t(io_);
      bool window = false;
      while (!window && clock_type::now() < until) {
        json info = co_await c.call("weight_info");
        window = info["session_active"].get<bool>() && !info["receiving"].get<bool>();
        if (!window) {
          t.expires_after(2ms);
          co_await t.async_wait(asio::use_awaitable);
        }
      }
      if (window)
        co_await stale_wave(c, *out);
      else
        out->emplace_back("the window between update and finish", "never seen");
    }
  } catch (const error& e) {
    out->emplace_back("connect", std::string(errc_name(e.kind())));
  }
  c.close();
  *done = true;
  stale_finished_ = true;
}

asio::awaitable<void> suite::stale_wave(control::client& c, std::vector<std::pair<std::string, std::string>>& out) {
  {
    const json update_info = {{"names", {"w"}}, {"dtype_names", {"float32"}}, {"shapes", {{4}}}};
    const std::vector<std::pair<std::string, json>> calls = {
        {"finish_weight_update", {{"weight_version", 999}}},
        {"init_weight_transfer_engine",
         {{"init_info", {{"master_address", "127.0.0.1"}, {"master_port", 1}, {"rank_offset", 1}, {"world_size", 2}}}}},
        {"update_weights", {{"update_info", update_info}}},
        {"start_weight_update", json::object()}};
    for (const auto& [method, params] : calls) {
      std::string got;
      try {
        co_await c.call(method, params);
      } catch (const error& e) {
        got = std::string(errc_name(e.kind()));
      }
      out.emplace_back(method, got);
    }
  }
}

// stale_trainer's verdict, once its trainer is done: every stale call refused
// (`stale`: each call and the error kind it got), the live update verified, and
// no worker claiming weights it does not hold.
void suite::stale_verdict(const std::string& name, const proxy& px,
                          const std::vector<std::pair<std::string, std::string>>& stale, const trainer_result& result,
                          bool hang, int round) {
  io_.restart();
  const auto until = clock_type::now() + std::chrono::milliseconds(o_.timeout_ms * 4);
  while (!stale_finished_ && clock_type::now() < until) io_.run_for(20ms);
  json& stats = count_injected("stale_trainer");
  std::vector<std::string> missed;
  if (!px.fired) missed.push_back("the point of the stale calls was never reached");
  if (!stale_finished_) missed.push_back("the stale calls did not complete");
  if (stale.size() < 8) missed.push_back("only " + std::to_string(stale.size()) + " of 8 stale calls were made");
  for (const auto& [call, kind_got] : stale)
    if (kind_got != "invalid_state")
      missed.push_back("the stale " + call + " got '" + kind_got + "', not invalid_state");
  const bool verified = !hang && result.last.is_object() && result.last.value("verified", false);
  if (!verified)
    missed.push_back("the live update did not verify: " + (result.last.is_object() ? result.last.dump() : "no JSON"));
  if (hang) ++r_.hangs;
  if (verified) {
    version_ = round;
    fingerprints_[round] = fingerprint_of(workers_[0]);
  }
  // Whatever happened, a worker that says clean must hold its version's weights.
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    auto info = settled_info(workers_[i]);
    if (!info) continue;
    const std::string state = (*info)["state"];
    const int v = (*info)["weight_version"].is_number_integer() ? (*info)["weight_version"].get<int>() : -1;
    auto known = fingerprints_.find(v);
    if (state == "clean" &&
        (known == fingerprints_.end() || !compare_fingerprints(known->second, fingerprint_of(workers_[i])).empty())) {
      ++r_.lost;
      r_.problems.push_back(name + ": worker " + std::to_string(i) + " says clean at version " + std::to_string(v) +
                            " but holds other weights");
    }
  }
  count_verdict(stats, name, missed);
  say(name + ": " +
      (missed.empty() ? "every stale call refused; the live update verified" : "MISSED: " + missed.front()));
  if (!verified) {
    if (recover(name))
      ++r_.recoveries;
    else
      ++r_.recoveries_failed;
  }
}

}  // namespace refit::fault
