// A small asio inference server that takes weight updates on the same event loop it
// answers requests on. The model lives in a refit::tensor_map_target; the worker
// host's hooks tell the target when an update lands or fails; requests read the
// weights through the target's readers (protocol.h) and never see two versions.
//
//   async_server --model-bytes 1G [--mode double_buffered|reader_lock] [--listen ADDR]
//                [--control-port N] [--serve-port N] [--layers N] [--vocab N]
//                [--timeout-ms MS] [--auth-secret-file PATH]
//
// Prints "ASYNC_SERVER control=<port> serve=<port>" once both listen; a trainer
// (async_trainer, or any refit trainer) drives the control port. The control method
// "shutdown" ends it. The model's layout comes from the same flags as the trainer's
// (examples/weight_sync/model.h); an update of any other layout is refused before a
// byte moves.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <set>
#include <string>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/io_context.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/read.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/write.hpp>

#include <refit/internal/lag_probe.h>
#include <refit/refit.h>

#include "examples/async_server/flags.h"
#include "examples/async_server/protocol.h"
#include "examples/weight_sync/model.h"

namespace refit::example {
namespace {

using asio::ip::tcp;
constexpr auto as_tuple = asio::experimental::as_tuple(asio::use_awaitable);

struct server_options {
  std::string listen = "127.0.0.1";
  std::uint16_t control_port = 0;
  std::uint16_t serve_port = 0;
  std::uint64_t model_bytes = 1ull << 30;
  int layers = 16;
  std::int64_t vocab = 32000;
  reader_mode mode = reader_mode::double_buffered;
  std::int64_t timeout_ms = 60000;
  std::string secret;
};

server_options parse(int argc, char** argv) {
  server_options o;
  flag_parser f(argc, argv,
                "usage: async_server [--model-bytes SIZE] [--layers N] [--vocab N]\n"
                "                    [--mode double_buffered|reader_lock] [--listen ADDRESS]\n"
                "                    [--control-port N] [--serve-port N] [--timeout-ms MS]\n"
                "                    [--auth-secret-file PATH]\n");
  while (f.next()) {
    if (f.is("--listen"))
      o.listen = f.value();
    else if (f.is("--control-port"))
      o.control_port = static_cast<std::uint16_t>(f.integer(0, 65535));
    else if (f.is("--serve-port"))
      o.serve_port = static_cast<std::uint16_t>(f.integer(0, 65535));
    else if (f.is("--model-bytes"))
      o.model_bytes = parse_bytes(f.value(), "--model-bytes");
    else if (f.is("--layers"))
      o.layers = static_cast<int>(f.integer(1, 1000));
    else if (f.is("--vocab"))
      o.vocab = f.integer(1, 1 << 22);
    else if (f.is("--timeout-ms"))
      o.timeout_ms = f.integer(1, 86400000);
    else if (f.is("--auth-secret-file"))
      o.secret = auth::read_secret_file(f.value());
    else if (f.is("--mode")) {
      const std::string m = f.value();
      if (m == "double_buffered")
        o.mode = reader_mode::double_buffered;
      else if (m == "reader_lock")
        o.mode = reader_mode::reader_lock;
      else
        throw_error(errc::invalid_argument, "--mode: expected double_buffered or reader_lock, got '" + m + "'");
    } else
      f.unknown();
  }
  return o;
}

struct serving_stats {
  std::uint64_t requests = 0;
  std::uint64_t busy = 0;
  std::uint64_t connections = 0;
  std::set<tcp::socket*> open;  // closed at shutdown, so every coroutine ends before the loop does
};

// One client connection: requests answered in order, each from one reader.
asio::awaitable<void> serve_client(tcp::socket socket, tensor_map_target& model, serving_stats& stats) {
  stats.open.insert(&socket);
  struct forget {
    serving_stats& stats;
    tcp::socket* socket;
    ~forget() { stats.open.erase(socket); }
  } registered{stats, &socket};
  std::byte request[serving::request_bytes];
  std::byte answer[serving::answer_bytes];
  for (;;) {
    auto [ec, n] = co_await asio::async_read(socket, asio::buffer(request), as_tuple);
    if (ec) co_return;  // the client left
    std::uint64_t id;
    std::uint32_t index;
    std::memcpy(&id, request, 8);
    std::memcpy(&index, request + 8, 4);
    std::int64_t version = serving::version_busy;
    std::uint64_t digest = 0;
    {
      // Never held across a co_await: an update waits for readers of old weights.
      auto reader = model.try_read();
      if (reader && reader->size() > 0) {
        const tensor_view t = (*reader)[index % reader->size()];
        version = reader->version().value_or(serving::version_none);
        digest = serving::slice_digest(t.bytes());
      }
    }
    if (version == serving::version_busy) ++stats.busy;
    ++stats.requests;
    std::memcpy(answer, &id, 8);
    std::memcpy(answer + 8, &version, 8);
    std::memcpy(answer + 16, &digest, 8);
    auto [wec, w] = co_await asio::async_write(socket, asio::buffer(answer), as_tuple);
    if (wec) co_return;
  }
}

asio::awaitable<void> accept_clients(tcp::acceptor& acceptor, tensor_map_target& model, serving_stats& stats) {
  for (;;) {
    auto [ec, socket] = co_await acceptor.async_accept(as_tuple);
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) co_return;
    if (ec) continue;  // e.g. out of descriptors for a moment: keep serving the rest
    socket.set_option(tcp::no_delay(true));
    ++stats.connections;
    asio::co_spawn(acceptor.get_executor(), serve_client(std::move(socket), model, stats), asio::detached);
  }
}

int run(const server_options& o) {
  asio::io_context io;  // the server's one event loop: requests, control verbs and weights
  async::lag_probe lag(io.get_executor());

  const model_layout layout = make_layout(o.model_bytes, o.layers, o.vocab);
  tensor_map_target_options target_options;
  target_options.mode = o.mode;
  target_options.initial_version = 0;  // the zeroed weights it starts with
  tensor_map_target model(target_options);
  for (const auto& t : layout.meta.tensors) model.add(t);  // allocated and faulted in here, not on the loop

  weight_transfer_config config;
  config.backend = "tcp";
  config.timeout = std::chrono::milliseconds(o.timeout_ms);
  config.auth_secret = o.secret;
  control::worker_host host(config, engine_context{io.get_executor(), {}, {}, &model}, model.as_load_weights());

  // The hooks wrap the built-in verbs: the target serves an update's bytes with its
  // version from the moment finish_weight_update commits it, and drops a failed one.
  std::int64_t served = 0;
  control::update_hooks hooks;
  hooks.on_update_started = [](const std::string& owner) {
    std::fprintf(stderr, "[server] update started by %s\n", owner.c_str());
  };
  hooks.on_update_finished = [&served](std::int64_t version, const json&) {
    served = version;
    std::fprintf(stderr, "[server] serving version %lld\n", static_cast<long long>(version));
  };
  hooks.on_update_failed = [](const std::string& reason, errc kind) {
    std::fprintf(stderr, "[server] update failed (%s): %s\n", std::string(errc_name(kind)).c_str(), reason.c_str());
  };
  // The target finishes or aborts as the host's state says, then these run.
  host.set_hooks(control::tensor_map_hooks(host, model, std::move(hooks)));

  serving_stats stats;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address(o.listen), o.serve_port));
  host.add_method("serving_stats", [&](const json&) -> asio::awaitable<json> {
    co_return json{{"requests", stats.requests},
                   {"busy", stats.busy},
                   {"connections", stats.connections},
                   {"served_version", served},
                   {"mode", std::string(to_string(o.mode))}};
  });
  host.add_method("loop_lag", [&lag](const json&) -> asio::awaitable<json> { co_return lag.take().to_json(); });
  host.add_method("shutdown", [&](const json&) -> asio::awaitable<json> {
    asio::post(io, [&] {
      acceptor.close();
      for (auto* socket : stats.open) socket->close();
      lag.stop();
      host.stop();  // io.run() returns once every coroutine has ended
    });
    co_return json::object();
  });
  const std::uint16_t control_port = host.listen(o.listen, o.control_port);
  asio::co_spawn(io, accept_clients(acceptor, model, stats), asio::detached);
  asio::co_spawn(io, host.serve(), asio::detached);
  std::cout << "ASYNC_SERVER control=" << control_port << " serve=" << acceptor.local_endpoint().port() << std::endl;
  std::fprintf(stderr, "[server] %zu tensors, %.2f GB (%s), listening on %s\n", model.size(),
               layout.meta.total_bytes() / 1e9, std::string(to_string(o.mode)).c_str(), o.listen.c_str());
  io.run();
  return 0;
}

}  // namespace
}  // namespace refit::example

int main(int argc, char** argv) {
  try {
    return refit::example::run(refit::example::parse(argc, argv));
  } catch (const refit::error& e) {
    std::fprintf(stderr, "async_server: %s: %s\n", std::string(refit::errc_name(e.kind())).c_str(),
                 e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "async_server: %s\n", e.what());
    return 1;
  }
}
