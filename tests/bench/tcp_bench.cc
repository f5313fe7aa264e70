// Worker-side throughput of the TCP engine on loopback, measured against memcpy in
// the same run. The trainer and the worker run on their own threads (own
// io_contexts) in one process; load_weights does no work unless a case adds some.
//
// Cases (each prints one JSON line; the last line sums them up):
//   big      one 400 MiB tensor per update
//   tiny     100k tensors of 4 KiB (the same 400 MiB)
//   overlap  100 x 4 MiB, first with no post-processing, then with post-processing
//            that costs as much as the transfer: wall time vs the larger of the two.
//            Twice: processing that waits (like a GPU kernel or I/O: the thread is
//            blocked, no core is used) and processing that spins a core. On a
//            2-core machine the sender and the receiver already use both cores, so
//            only the first shows what the pipeline overlaps; the second shows
//            what the machine allows.
//
//   bazel run -c opt //tests/bench:tcp_bench -- [--updates N] [--mib N]
#include <chrono>
#include <cstring>
#include <future>
#include <iostream>
#include <thread>
#include <vector>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>

#include <refit/engines/tcp/tcp.h>

namespace refit::bench {
namespace {

using clock_type = std::chrono::steady_clock;

struct tensor_data {
  update_metadata meta;
  std::vector<std::vector<std::byte>> storage;
  std::vector<tensor_view> views;

  tensor_data(std::size_t count, std::int64_t elements_bf16) {
    for (std::size_t i = 0; i < count; ++i)
      meta.tensors.push_back({"t" + std::to_string(i), dtype::bfloat16, {elements_bf16}});
    for (std::size_t i = 0; i < count; ++i) {
      storage.emplace_back(static_cast<std::size_t>(elements_bf16 * 2), std::byte(i & 0xff));
      views.emplace_back(meta.tensors[i], storage.back().data());
    }
  }
};

struct result {
  double best_s = 0, mean_s = 0, process_s = 0, receive_s = 0;
  std::uint64_t bytes = 0;
};

template <class T>
T run_on(asio::io_context& io, asio::awaitable<T> work) {
  std::promise<T> p;
  auto f = p.get_future();
  asio::co_spawn(io, std::move(work), [&p](std::exception_ptr e, T v) {
    if (e)
      p.set_exception(e);
    else
      p.set_value(std::move(v));
  });
  io.restart();
  io.run();
  return f.get();
}

asio::awaitable<int> send_all(tcp::sender& s, const update_metadata& meta, std::vector<tensor_view> views,
                              int updates) {
  for (int i = 0; i < updates; ++i) co_await trainer_send_weights(s, meta, views);
  co_return 0;
}

asio::awaitable<result> receive_all(tcp::engine& e, const update_metadata& meta, int updates, double cost_per_byte,
                                    bool spin) {
  result r;
  auto info = std::make_unique<tcp::update_info>();
  info->metadata = meta;
  std::vector<double> times;
  for (int i = 0; i < updates; ++i) {
    auto t0 = clock_type::now();
    co_await e.receive_weights(*info, [cost_per_byte, spin](std::span<const tensor_view> views) {
      if (cost_per_byte <= 0) return;
      std::uint64_t n = 0;
      for (const auto& v : views) n += v.nbytes();
      auto until = clock_type::now() + std::chrono::duration<double>(n * cost_per_byte);
      if (!spin) {
        std::this_thread::sleep_until(until);
        return;
      }
      while (clock_type::now() < until) {
      }
    });
    co_await e.drain_pending();
    times.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
    r.process_s += e.last_update_stats().process_s;
    r.receive_s += e.last_update_stats().receive_s;
  }
  r.best_s = *std::min_element(times.begin(), times.end());
  for (double t : times) r.mean_s += t / times.size();
  r.process_s /= updates;
  r.receive_s /= updates;
  r.bytes = meta.total_bytes();
  co_return r;
}

asio::awaitable<int> connect_engine(tcp::engine& e, json init) {
  co_await e.init_transfer_engine(*e.parse_init_info(init));
  co_return 0;
}

asio::awaitable<int> connect_sender(tcp::sender& s) {
  co_await s.connect_workers();
  co_return 0;
}

// One transfer setup: a sender thread and a worker (this thread).
result measure(tensor_data& data, int updates, double cost_per_byte, std::uint64_t buffer_bytes, bool spin = false,
               std::uint32_t num_buffers = 2) {
  asio::io_context trainer_io, worker_io;
  weight_transfer_config config;
  config.timeout = std::chrono::seconds(120);
  tcp::sender sender(config, trainer_context{trainer_io.get_executor(), {}});
  tcp::engine engine(config, engine_context{worker_io.get_executor()});
  json args = {{"master_address", "127.0.0.1"},
               {"master_port", 0},
               {"world_size", 2},
               {"buffer_bytes", buffer_bytes},
               {"num_buffers", num_buffers}};
  json init = sender.prepare(args);
  std::thread trainer([&] {
    run_on(trainer_io, connect_sender(sender));
    run_on(trainer_io, send_all(sender, data.meta, data.views, updates));
  });
  run_on(worker_io, connect_engine(engine, init));
  result r = run_on(worker_io, receive_all(engine, data.meta, updates, cost_per_byte, spin));
  trainer.join();
  return r;
}

double memcpy_gbps(std::size_t bytes) {
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes, std::byte{2});
  double best = 1e9;
  for (int i = 0; i < 5; ++i) {
    auto t0 = clock_type::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  return bytes / best / 1e9;
}

json line(const std::string& name, const result& r) {
  return {{"case", name},
          {"bytes", r.bytes},
          {"best_s", r.best_s},
          {"mean_s", r.mean_s},
          {"gbps_best", r.bytes / r.best_s / 1e9},
          {"receive_s", r.receive_s},
          {"process_s", r.process_s}};
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  using namespace refit::bench;
  int updates = 5;
  std::int64_t mib = 400;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--updates")
      updates = std::atoi(argv[i + 1]);
    else if (a == "--mib")
      mib = std::atoll(argv[i + 1]);
    else {
      std::cerr << "usage: tcp_bench [--updates N] [--mib N]\n";
      return 2;
    }
  }
  const std::int64_t bytes = mib << 20;
  const std::uint64_t buffer = 64ull << 20;
  double memcpy_rate = memcpy_gbps(static_cast<std::size_t>(bytes / 4));
  std::cout << refit::json{{"case", "memcpy"}, {"gbps", memcpy_rate}}.dump() << std::endl;

  tensor_data big(1, bytes / 2);
  result r_big = measure(big, updates, 0, buffer);
  std::cout << line("big", r_big).dump() << std::endl;
  big = tensor_data(0, 0);

  tensor_data tiny(static_cast<std::size_t>(bytes / 4096), 2048);
  result r_tiny = measure(tiny, updates, 0, buffer);
  std::cout << line("tiny", r_tiny).dump() << std::endl;
  tiny = tensor_data(0, 0);

  // Overlap hides all but one bucket's receive and one bucket's processing (pipeline
  // fill and drain), so this case uses 16 MiB buffers (~25 buckets, not 7), and 4 of
  // them so short hiccups on either side do not stall the other.
  const std::uint64_t overlap_buffer = 16ull << 20;
  const std::uint32_t overlap_buffers = 4;
  tensor_data mid(100, bytes / 100 / 2);
  result r_plain = measure(mid, updates, 0, overlap_buffer, false, overlap_buffers);
  std::cout << line("overlap_transfer_only", r_plain).dump() << std::endl;
  // Post-processing as expensive as the transfer was.
  double cost = r_plain.best_s / static_cast<double>(mid.meta.total_bytes());
  result r_cost = measure(mid, updates, cost, overlap_buffer, false, overlap_buffers);
  std::cout << line("overlap_with_waiting_processing", r_cost).dump() << std::endl;
  double larger = std::max(r_plain.best_s, r_cost.process_s);
  result r_spin = measure(mid, updates, cost, overlap_buffer, /*spin=*/true, overlap_buffers);
  std::cout << line("overlap_with_spinning_processing", r_spin).dump() << std::endl;
  double larger_spin = std::max(r_plain.best_s, r_spin.process_s);

  refit::json summary = {{"case", "summary"},
                         {"worker_gbps", r_big.bytes / r_big.best_s / 1e9},
                         {"memcpy_gbps", memcpy_rate},
                         {"tiny_vs_big", (r_tiny.bytes / r_tiny.best_s) / (r_big.bytes / r_big.best_s)},
                         {"overlap_wall_vs_larger", r_cost.best_s / larger},
                         {"overlap_spinning_wall_vs_larger", r_spin.best_s / larger_spin}};
  std::cout << summary.dump() << std::endl;
  return 0;
}
