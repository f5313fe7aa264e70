// --role worker: an inference worker of the main job. Its "model" is one host
// buffer per tensor behind a control::worker_host; the trainer drives it through
// the control verbs (and the extra ones below) and checks what it holds.
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <asio/io_context.hpp>

#include <refit/adapters/vllm.h>
#include <refit/control/worker_host.h>
#include <refit/error.h>
#include <refit/integrity/fingerprint.h>
#include <refit/internal/lag_probe.h>
#include <refit/layout/layout.h>
#include <refit/layout/transfer_plan.h>
#include <refit/metadata.h>
#include "examples/weight_sync/job.h"

namespace refit::example::weight_sync {
namespace {

using clock_type = std::chrono::steady_clock;

// Simulated post-processing: spins for `bytes` at `cost` seconds per GB, like a
// dtype conversion or a layout transform would keep a core busy.
void burn(std::uint64_t bytes, double cost) {
  if (cost <= 0) return;
  auto until = clock_type::now() + std::chrono::duration<double>(static_cast<double>(bytes) * cost / 1e9);
  while (clock_type::now() < until) {
  }
}

// The worker's "model": one buffer per tensor. It offers its buffers as receive
// destinations (the engine writes weights straight into them); load_weights copies
// only what came through staging, then runs the simulated post-processing.
class worker_model final : public model_target {
 public:
  worker_model(double process_cost, bool direct, int slice_tp = 0, int tp_rank = 0)
      : process_cost_(process_cost), direct_(direct && slice_tp == 0), slice_tp_(slice_tp), tp_rank_(tp_rank) {}

  // Slicing a broadcast (--slice-tp): the worker keeps its tp rank's part of each
  // full tensor, in vLLM's layout, as a tensor-parallel worker does today.
  void begin_update(const update_metadata& meta) override {
    if (slice_tp_ == 0) return;
    const auto digest = metadata_digest(meta);
    std::lock_guard lock(mutex_);
    if (digest == sliced_digest_) return;
    slice_ = tensor_parallel_layout(meta, slice_tp_, tp_rank_, vllm_llama_layout());
    pieces_.clear();
    for (std::size_t d = 0; d < slice_.tensors.size(); ++d) {
      const auto& t = slice_.tensors[d];
      auto& slot = tensors_[t.spec.name];
      slot.spec = t.spec;
      if (slot.bytes.size() != t.spec.nbytes()) slot.bytes.assign(t.spec.nbytes(), std::byte{0});
      for (std::size_t k = 0; k < t.pieces.size(); ++k) pieces_[t.pieces[k].source].emplace_back(d, k);
    }
    sliced_digest_ = digest;
  }

  void load_weights(std::span<const tensor_view> views) override {
    if (slice_tp_ > 0) {
      for (const auto& v : views) {
        std::lock_guard lock(mutex_);
        auto it = pieces_.find(std::string(v.name));
        if (it == pieces_.end()) continue;  // nothing of it is kept here
        for (auto [d, k] : it->second) {
          const auto& t = slice_.tensors[d];
          const auto& piece = t.pieces[k];
          copy_box(v.data, v.shape, piece.from, tensors_[t.spec.name].bytes.data(), t.spec.shape, piece.at,
                   element_size(t.spec.dtype));
        }
        burn(v.nbytes(), process_cost_);
      }
      return;
    }
    for (const auto& v : views) {
      auto bytes = v.bytes();
      std::lock_guard lock(mutex_);
      auto& slot = tensors_[std::string(v.name)];
      slot.spec = tensor_spec{std::string(v.name), v.dtype, std::vector<std::int64_t>(v.shape.begin(), v.shape.end())};
      if (slot.bytes.size() != bytes.size()) slot.bytes.assign(bytes.size(), std::byte{0});
      if (slot.bytes.data() != bytes.data()) std::memcpy(slot.bytes.data(), bytes.data(), bytes.size());
      burn(bytes.size(), process_cost_);
    }
  }

  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    if (!direct_) return std::nullopt;
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    if (it == tensors_.end() || it->second.bytes.size() != spec.nbytes()) return std::nullopt;
    return tensor_view(spec, it->second.bytes.data());
  }

  // Undo of a fleet-atomic commit: the bytes it holds read back (not a sliced
  // model's: its tensors are slices of what the trainer sends).
  bool can_read_back(const tensor_spec& spec) override {
    if (slice_tp_ > 0) return false;
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    return it != tensors_.end() && it->second.spec.dtype == spec.dtype && it->second.spec.shape == spec.shape;
  }
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override {
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    if (it == tensors_.end() || it->second.bytes.size() != out.size())
      throw_error(errc::invalid_argument, "worker model: read_back of '" + spec.name + "'");
    std::memcpy(out.data(), it->second.bytes.data(), out.size());
  }

  // A fleet-atomic commit through its own loader swaps the staged bytes in (one
  // pass; the stage keeps the previous ones as the undo), then post-processes.
  bool can_exchange() const override { return slice_tp_ == 0; }
  void exchange(std::span<const tensor_view> staged) override {
    {
      std::lock_guard lock(mutex_);
      for (const auto& v : staged) {
        auto it = tensors_.find(std::string(v.name));
        if (it == tensors_.end() || it->second.bytes.size() != v.nbytes())
          throw_error(errc::invalid_argument, "worker model: exchange of '" + std::string(v.name) + "'");
      }
      constexpr std::size_t block = 64 << 10;
      std::byte tmp[block];
      for (const auto& v : staged) {
        std::byte* model = tensors_[std::string(v.name)].bytes.data();
        auto* stage = static_cast<std::byte*>(v.data);
        for (std::uint64_t off = 0; off < v.nbytes(); off += block) {
          const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(block, v.nbytes() - off));
          std::memcpy(tmp, model + off, k);
          std::memcpy(model + off, stage + off, k);
          std::memcpy(stage + off, tmp, k);
        }
      }
    }
    for (const auto& v : staged) burn(v.nbytes(), process_cost_);
  }

  // A server has its model resident before any update: allocate and touch it.
  void allocate(const update_metadata& meta) {
    std::lock_guard lock(mutex_);
    for (const auto& t : meta.tensors) {
      tensors_[t.name].bytes.assign(t.nbytes(), std::byte{0});
      tensors_[t.name].spec = t;
    }
  }

  // What the worker's weight_fingerprint call answers: computed on request from the
  // model's own memory (after the update, outside its timing).
  fingerprint_list fingerprint(const std::vector<std::string>& names) override {
    std::lock_guard lock(mutex_);
    std::vector<tensor_view> views;
    for (auto& [name, t] : tensors_) views.emplace_back(t.spec, t.bytes.data());
    return fingerprint_all(views, names);
  }

 private:
  struct tensor {
    tensor_spec spec;
    std::vector<std::byte> bytes;
  };
  double process_cost_;
  bool direct_;
  int slice_tp_, tp_rank_;
  std::uint64_t sliced_digest_ = 0;
  dest_layout slice_;
  std::map<std::string, std::vector<std::pair<std::size_t, std::size_t>>> pieces_;  // source -> (tensor, piece)
  mutable std::mutex mutex_;
  std::map<std::string, tensor> tensors_;
};

std::uint64_t peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::uint64_t>(usage.ru_maxrss) * 1024;
}

// This process's CPU time so far, user and system, every thread.
double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return s(usage.ru_utime) + s(usage.ru_stime);
}

}  // namespace

int run_worker(const options& o) {
  die_with_trainer();  // never outlive the trainer
  asio::io_context io;
  // How late this loop runs its work (the inference server's view of refit).
  async::lag_probe lag(io.get_executor());
  worker_model model(o.process_cost, !o.no_direct, o.slice_tp, o.tp_rank);
  weight_transfer_config config;
  config.backend = o.engine;
  config.timeout = std::chrono::milliseconds(o.timeout_ms);
  config.commit = o.commit;
  config.auth_secret = o.secret;
  control::worker_host host(config, engine_context{io.get_executor(), {}, {}, &model}, model.as_load_weights());
  const auto port = host.listen(o.listen, 0);
  host.add_method("load_model", [&model](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "load_model params");
    auto meta = read_update_metadata(r);
    r.finish();
    model.allocate(meta);
    co_return json::object();
  });
  host.add_method("worker_stats", [](const json&) -> asio::awaitable<json> {
    co_return json{{"peak_rss_bytes", peak_rss_bytes()}, {"cpu_seconds", cpu_seconds()}};
  });
  // The event loop's largest stall since the last call (and its p99).
  host.add_method("loop_lag", [&lag](const json&) -> asio::awaitable<json> { co_return lag.take().to_json(); });
  return serve_worker(io, host, port, [&lag] { lag.stop(); });
}

}  // namespace refit::example::weight_sync
