#include <refit/internal/lag_probe.h>

#include <algorithm>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>

namespace refit::async {

namespace {
constexpr std::size_t buckets = 1000;  // 0.1 ms each, the last one "100 ms or more"
}

struct lag_probe::state {
  explicit state(asio::any_io_executor ex) : timer(std::move(ex)) {}
  asio::steady_timer timer;
  bool stopped = false;
  double max_ms = 0;
  std::uint64_t samples = 0;
  std::array<std::uint32_t, buckets> histogram{};
};

json lag_probe::report::to_json() const { return {{"max_ms", max_ms}, {"p99_ms", p99_ms}, {"samples", samples}}; }

asio::awaitable<void> lag_probe::run(std::shared_ptr<state> s, std::chrono::microseconds period) {
  auto due = std::chrono::steady_clock::now() + period;
  while (!s->stopped) {
    s->timer.expires_at(due);
    std::error_code ec;
    co_await s->timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (s->stopped) break;
    const auto now = std::chrono::steady_clock::now();
    const double late_ms = std::max(0.0, std::chrono::duration<double, std::milli>(now - due).count());
    s->max_ms = std::max(s->max_ms, late_ms);
    ++s->samples;
    ++s->histogram[std::min<std::size_t>(buckets - 1, static_cast<std::size_t>(late_ms * 10))];
    due = now + period;
  }
}

lag_probe::lag_probe(asio::any_io_executor ex, std::chrono::microseconds period) : state_(std::make_shared<state>(ex)) {
  asio::co_spawn(ex, run(state_, period), asio::detached);
}

lag_probe::~lag_probe() { stop(); }

void lag_probe::stop() {
  state_->stopped = true;
  state_->timer.cancel();
}

lag_probe::report lag_probe::take() {
  report r;
  r.max_ms = state_->max_ms;
  r.samples = state_->samples;
  std::uint64_t seen = 0;
  const std::uint64_t at = r.samples - r.samples / 100;  // the sample at the 99th percentile
  for (std::size_t i = 0; i < buckets && r.samples; ++i) {
    seen += state_->histogram[i];
    if (seen >= at) {
      r.p99_ms = (i + 1) / 10.0;
      break;
    }
  }
  state_->max_ms = 0;
  state_->samples = 0;
  state_->histogram.fill(0);
  return r;
}

}  // namespace refit::async
