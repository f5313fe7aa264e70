#include <refit/control/client.h>

#include <refit/control/internal/frame.h>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/use_awaitable.hpp>

#include <refit/backend/async/deadline.h>
#include <refit/backend/handshake.h>
#include <refit/backend/net.h>

namespace refit::control {

bool client::connected() const { return state_ && state_->stream->is_open(); }

client::client(asio::any_io_executor executor, std::chrono::milliseconds timeout, std::string secret)
    : executor_(std::move(executor)), timeout_(timeout), secret_(std::move(secret)) {}

client::~client() { close(); }

asio::awaitable<void> client::connect(std::string host, std::uint16_t port) {
  close();
  const std::string peer = host + ":" + std::to_string(port);
  auto socket = co_await net::connect_with_retry(host, port, timeout_, "control: connecting to worker " + peer);
  co_await auth::as_client(socket, secret_, timeout_, "control: worker " + peer);
  state_ = std::make_shared<connection>(connection{std::make_shared<frame_stream>(std::move(socket)), peer, {}});
  asio::co_spawn(executor_, read_loop(state_, timeout_), asio::detached);
}

asio::awaitable<void> client::read_loop(std::shared_ptr<connection> c, std::chrono::milliseconds timeout) {
  std::string why = "connection closed";
  try {
    for (;;) {
      json answer = co_await c->stream->read(timeout, /*idle_ok=*/true, "control answer from " + c->peer);
      json_reader r(answer, "control answer from " + c->peer);
      auto id = r.required<std::uint64_t>("id");
      auto it = c->pending.find(id);
      if (it == c->pending.end()) continue;  // the caller gave up (timed out) already
      it->second->try_send(std::error_code{}, std::move(answer));
    }
  } catch (const error& e) {
    why = e.message();
  }
  c->stream->close();
  // Every call still waiting learns the connection is gone, now.
  for (auto& [id, channel] : c->pending) channel->try_send(make_error_code(errc::peer_lost), json(why));
}

asio::awaitable<json> client::call(std::string method, json params, std::optional<std::chrono::milliseconds> timeout) {
  if (!connected()) throw_error(errc::invalid_state, "control: " + method + " on a closed connection");
  const auto limit = timeout.value_or(timeout_);
  const std::uint64_t id = next_id_++;
  auto channel = std::make_shared<reply_channel>(executor_, 1);
  auto conn = state_;
  conn->pending[id] = channel;
  struct forget {
    std::shared_ptr<connection> conn;
    std::uint64_t id;
    ~forget() { conn->pending.erase(id); }
  } guard{conn, id};
  const std::string what = "control: " + method + " on worker " + conn->peer;
  // Built before co_await: GCC 12 cannot keep a braced list of string literals alive
  // across a suspension point ("array used as initializer").
  json request = {{"id", id}, {"method", method}, {"params", std::move(params)}};
  co_await conn->stream->write(request, limit, what);
  auto reply = co_await async::with_deadline(channel->async_receive(asio::experimental::as_tuple(asio::use_awaitable)),
                                             limit, what);
  const std::error_code ec = std::get<0>(reply);
  json answer = std::move(std::get<1>(reply));
  if (ec) throw_error(errc::peer_lost, what + ": " + (answer.is_string() ? answer.get<std::string>() : ec.message()));
  if (answer.contains("error")) {
    const json& e = answer["error"];
    errc kind = e.contains("kind") && e["kind"].is_string() ? parse_errc(e["kind"].get<std::string>()) : errc{};
    std::string message =
        e.contains("message") && e["message"].is_string() ? e["message"].get<std::string>() : e.dump();
    throw_error(kind == errc{} ? errc::protocol_error : kind,
                method + " failed on worker " + conn->peer + ": " + message);
  }
  if (!answer.contains("result")) throw_error(errc::protocol_error, what + ": answer has neither 'result' nor 'error'");
  co_return answer["result"];
}

void client::close() {
  if (state_) state_->stream->close();
  state_.reset();
}

}  // namespace refit::control
