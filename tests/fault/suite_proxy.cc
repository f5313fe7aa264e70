// The fault suite's data proxy (suite.h), the proxies in front of a trainer, and
// the calibration of a side channel through them.
#include "tests/fault/suite.h"

namespace refit::fault {

void proxy::stop() {
  std::error_code ec;
  acceptor_.close(ec);
  // A black hole stays one until it ends (its pumps close the sockets then): the
  // trainer giving up must not reach the stalled worker sooner.
  if (clock_type::now() < *black_hole_) return;
  for (auto& s : sockets_) s->close(ec);
}

asio::awaitable<void> proxy::serve() {
  for (;;) {
    std::error_code ec;
    auto worker = std::make_shared<asio::ip::tcp::socket>(io_);
    co_await acceptor_.async_accept(*worker, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return;
    // The worker heard of this proxy from the trainer, which reported its port
    // first; the suite reads that report on this same loop, maybe after this.
    asio::steady_timer wait(io_);
    for (const auto until = clock_type::now() + 30s; *trainer_port_ == 0 && clock_type::now() < until;) {
      wait.expires_after(2ms);
      co_await wait.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    if (*trainer_port_ == 0) {
      worker->close(ec);
      continue;
    }
    auto trainer = std::make_shared<asio::ip::tcp::socket>(io_);
    co_await trainer->async_connect(asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), *trainer_port_),
                                    asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      worker->close(ec);
      continue;
    }
    sockets_.push_back(worker);
    sockets_.push_back(trainer);
    auto open = std::make_shared<int>(2);  // pumps of this connection still running
    asio::co_spawn(io_, pump(worker, trainer, false, open), asio::detached);
    asio::co_spawn(io_, pump(trainer, worker, true, open), asio::detached);
  }
}

asio::awaitable<void> proxy::pump(std::shared_ptr<asio::ip::tcp::socket> from,
                                  std::shared_ptr<asio::ip::tcp::socket> to, bool downstream,
                                  std::shared_ptr<int> open) {
  std::vector<std::byte> buf(64 << 10);
  std::uint64_t seen = 0;
  std::error_code ec;
  asio::steady_timer timer(io_);
  const std::shared_ptr<clock_type::time_point> black_hole = black_hole_;  // outlives this proxy
  for (;;) {
    std::size_t n = co_await from->async_read_some(asio::buffer(buf), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;
    if (downstream && act == action::throttle && throttle_bytes_per_s > 0) {
      timer.expires_after(std::chrono::microseconds(static_cast<std::int64_t>(n / throttle_bytes_per_s * 1e6)));
      co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    }
    if (downstream && !fired && act != action::none && act != action::throttle && at < seen + n) {
      fired = true;
      if (act == action::corrupt) {
        buf[at >= seen ? at - seen : 0] ^= std::byte{0x5a};
      } else if (act == action::stall) {
        *black_hole_ = clock_type::now() + stall;
        timer.expires_after(stall);
        co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
        break;
      } else {
        if (kill) kill();
        // What was in flight when the process died is what it sent; forward it.
        // A hook holds the stream (the session stays live) while it runs.
        const auto give_up = clock_type::now() + 10s;
        while (act == action::hook && hold && hold() && clock_type::now() < give_up) {
          timer.expires_after(1ms);
          co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
        }
      }
    }
    seen += n;
    if (downstream) downstream_bytes += n;
    co_await asio::async_write(*to, asio::buffer(buf.data(), n), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) break;
  }
  // A stalled link is a black hole: not even the trainer's close gets through to
  // the worker before the stall ends (the worker must time out on its own). Only
  // locals from here on: the proxy may be gone by the time the wait ends.
  if (clock_type::now() < *black_hole) {
    timer.expires_at(*black_hole);
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
  // Like a wire: this direction ends (FIN) while the other still carries what is
  // in flight (a failing worker's last status, its reason); the last pump closes.
  to->shutdown(asio::ip::tcp::socket::shutdown_send, ec);
  if (--*open == 0) {
    from->close(ec);
    to->close(ec);
  }
}

suite::proxy_set suite::make_proxies() {
  proxy_set out;
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    out.proxies.push_back(std::make_unique<proxy>(io_));
    out.advertise += (out.advertise.empty() ? "" : ",") + std::to_string(out.proxies.back()->port());
  }
  return out;
}

// Over an engine whose data does not cross the proxies: how many side-channel
// bytes each worker gets at init and per update in `topology`, from two clean
// trainers through proxies (1 update, then 2), each verified.
void suite::calibrate(const std::string& topology, bool checksums) {
  std::vector<std::uint64_t> totals[2];
  const std::string key = topology + (checksums ? "+checksums" : "");
  for (int updates = 1; updates <= 2; ++updates) {
    auto [proxies, advertise] = make_proxies();
    for (auto& p : proxies) p->start();
    const int round = version_ + 1;
    std::vector<std::string> args = {"--first-round",      std::to_string(round),
                                     "--updates",          std::to_string(updates),
                                     "--advertise-port",   advertise,
                                     "--auth-secret-file", secret_file_,
                                     "--topology",         topology};
    if (checksums) args.push_back("--checksums");
    auto r = run_trainer(args, &proxies, dir_ + "/trainer-calibrate-" + key + "-" + std::to_string(updates) + ".log");
    if (!(r.exited && r.last.is_object() && r.last.value("verified", false)))
      throw_error(errc::io_error,
                  "calibration over " + o_.engine + " failed: " + (r.last.is_object() ? r.last.dump() : "no JSON"));
    version_ = round + updates - 1;
    fingerprints_[version_] = fingerprint_of(workers_[0]);
    for (auto& p : proxies) totals[updates - 1].push_back(p->downstream_bytes);
  }
  auto& [init, update] = side_[key];
  // A chain's only proxied update stream is worker 0's: the others hear of an
  // update from their predecessor.
  const std::size_t measured = topology == "chain" ? 1 : workers_.size();
  for (std::size_t i = 0; i < measured; ++i) {
    if (totals[1][i] <= totals[0][i] || totals[0][i] <= totals[1][i] - totals[0][i])
      throw_error(errc::io_error, "calibration over " + o_.engine + " (" + topology + "): worker " + std::to_string(i) +
                                      "'s side channel carried " + std::to_string(totals[0][i]) + " and " +
                                      std::to_string(totals[1][i]) + " bytes for 1 and 2 updates");
    update.push_back(totals[1][i] - totals[0][i]);
    init.push_back(totals[0][i] - update.back());
    say("calibrated worker " + std::to_string(i) + " (" + key + "): " + std::to_string(init.back()) +
        " side-channel bytes at init, " + std::to_string(update.back()) + " per update");
  }
}

}  // namespace refit::fault
