// A refit worker that a PyTorch trainer on the same GPU feeds through CUDA IPC
// ("torch_ipc" backend; the trainer's side is refit_ipc.py, no refit there). Its
// model is device memory, one buffer per tensor name, allocated the first time a
// name is declared and then received into directly (no staging copy).
//
//   bazel run --config=cuda //examples/torch_ipc:worker -- --device 0 --port 5600
//   python3 examples/torch_ipc/refit_ipc.py --worker 127.0.0.1:5600
//
// Besides the control verbs (lib/control/worker_host.h) it answers
//   digest {"names": [str]}  -> {name: [sum, weighted_sum]}  (all tensors when absent)
// (digest.h: byte sums a trainer can compute with torch to check every byte).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include <asio/io_context.hpp>
#include <asio/signal_set.hpp>

#include "examples/common/worker_process.h"
#include "examples/torch_ipc/digest.h"
#include "lib/auth.h"
#include "lib/control/worker_host.h"
#include "lib/cuda/error.h"
#include "lib/cuda/memory.h"
#include "lib/cuda/processing.h"
#include "lib/fingerprint.h"

namespace refit::example {
namespace {

class device_model final : public model_target {
 public:
  explicit device_model(int device) : device_(device) {}

  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    std::lock_guard lock(mutex_);
    auto& t = tensors_[spec.name];
    if (t.spec != spec || (t.memory.size() == 0 && spec.nbytes() != 0)) {
      t.memory = cuda::device_buffer(spec.nbytes(), device_);
      t.spec = spec;
    }
    return tensor_view(t.spec, t.memory.data(), refit::device::cuda(device_));
  }

  // Everything was received in place; a tensor that came through staging (none
  // here, but a staged commit would) is copied on the processing stream.
  void load_weights(std::span<const tensor_view> views) override {
    for (const auto& v : views) {
      auto dst = destination(v.spec());
      if (dst && dst->data != v.data && v.nbytes() != 0)
        REFIT_CUDA_CHECK(cudaMemcpyAsync(dst->data, v.data, v.nbytes(), cudaMemcpyDeviceToDevice,
                                         cuda::current_processing_stream()));
    }
  }

  std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names) override {
    auto host = host_copies(names);
    std::vector<tensor_view> views;
    for (auto& [name, t] : host) views.emplace_back(t.first, t.second.data());
    return fingerprint_all(views);
  }

  json digest(const std::vector<std::string>& names) {
    json out = json::object();
    for (auto& [name, t] : host_copies(names)) {
      auto [sum, weighted] = byte_digest(t.second);
      out[name] = {sum, weighted};
    }
    return out;
  }

 private:
  struct tensor {
    tensor_spec spec;
    cuda::device_buffer memory;
  };
  std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> host_copies(
      const std::vector<std::string>& names) {
    std::lock_guard lock(mutex_);
    std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> out;
    auto add = [&](const std::string& name, const tensor& t) {
      std::vector<std::byte> bytes(t.spec.nbytes());
      if (!bytes.empty()) REFIT_CUDA_CHECK(cudaMemcpy(bytes.data(), t.memory.data(), bytes.size(), cudaMemcpyDeviceToHost));
      out.emplace(name, std::make_pair(t.spec, std::move(bytes)));
    };
    if (names.empty()) {
      for (auto& [name, t] : tensors_) add(name, t);
    } else {
      for (const auto& name : names) {
        auto it = tensors_.find(name);
        if (it == tensors_.end()) throw_error(errc::invalid_argument, "no tensor named '" + name + "'");
        add(name, it->second);
      }
    }
    return out;
  }

  int device_;
  std::mutex mutex_;
  std::map<std::string, tensor> tensors_;
};

int usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: worker [--device N] [--listen ADDRESS] [--port PORT] [--auth-secret-file FILE]\n"
               "              [--timeout-ms MS]\n"
               "Prints REFIT_WORKER_PORT <port> once it listens; serves until SIGINT/SIGTERM or the\n"
               "control call 'shutdown'.\n",
               why);
  return 2;
}

int run(int argc, char** argv) {
  int device = 0;
  std::string listen = "127.0.0.1", secret_file;
  unsigned port = 0;
  long timeout_ms = 120000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--device") device = std::stoi(next());
    else if (a == "--listen") listen = next();
    else if (a == "--port") port = static_cast<unsigned>(std::stoul(next()));
    else if (a == "--auth-secret-file") secret_file = next();
    else if (a == "--timeout-ms") timeout_ms = std::stol(next());
    else return usage(("unknown argument " + a).c_str());
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "worker: no CUDA device visible (torch_ipc needs the trainer's GPU)\n");
    return 1;
  }
  if (device < 0 || device >= count) return usage("--device out of range");
  REFIT_CUDA_CHECK(cudaSetDevice(device));

  asio::io_context io;
  device_model model(device);
  weight_transfer_config config;
  config.backend = "torch_ipc";
  config.timeout = std::chrono::milliseconds(timeout_ms);
  if (!secret_file.empty()) config.auth_secret = auth::read_secret_file(secret_file);
  control::worker_host host(config, engine_context{io.get_executor(), refit::device::cuda(device), {}, &model},
                            model.as_load_weights());
  const auto bound = host.listen(listen, static_cast<std::uint16_t>(port));
  host.add_method("digest", [&model](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "digest params");
    auto names = r.optional<std::vector<std::string>>("names", {});
    r.finish();
    co_return model.digest(names);
  });
  asio::signal_set signals(io, SIGINT, SIGTERM);
  signals.async_wait([&](std::error_code, int) { host.stop(); });
  return serve_worker(io, host, bound);
}

}  // namespace
}  // namespace refit::example

int main(int argc, char** argv) {
  try {
    return refit::example::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "worker: %s\n", e.what());
    return 1;
  }
}
