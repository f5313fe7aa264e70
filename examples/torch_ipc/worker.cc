// A refit worker that a PyTorch trainer on the same GPU feeds through CUDA IPC
// ("torch_ipc" backend; the trainer's side is refit_ipc.py, no refit there), or,
// with --backend cuda_ipc, a refit trainer (refit.Sender("cuda_ipc") from Python). Its
// model is device memory, one buffer per tensor name, allocated the first time a
// name is declared and then received into directly (no staging copy):
// examples/torch_ipc/device_model.h.
//
//   bazel run --config=cuda //examples/torch_ipc:worker -- --device 0 --port 5600
//   python3 examples/torch_ipc/refit_ipc.py --worker 127.0.0.1:5600
//
// Besides the control verbs (lib/control/worker_host.h) it answers
//   digest {"names": [str]}  -> {name: [sum, weighted_sum]}  (all tensors when absent)
//   ipc_stats {}             -> {"opens": handles opened ever, "mapped": open now}
// (digest.h: byte sums a trainer can compute with torch to check every byte).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <asio/io_context.hpp>
#include <asio/signal_set.hpp>

#include <refit/control/worker_host.h>
#include <refit/cuda/error.h>
#include <refit/integrity/auth.h>
#include "examples/common/worker_process.h"
#include "examples/torch_ipc/device_model.h"

namespace refit::example {
namespace {

int usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: worker [--device N] [--listen ADDRESS] [--port PORT] [--auth-secret-file FILE]\n"
               "              [--timeout-ms MS] [--backend torch_ipc|cuda_ipc]\n"
               "Prints REFIT_WORKER_PORT <port> once it listens; serves until SIGINT/SIGTERM or the\n"
               "control call 'shutdown'.\n",
               why);
  return 2;
}

int run(int argc, char** argv) {
  // Started by a Python trainer (refit_ipc.py's users, the GPU check): dies with it,
  // even when stuck in a CUDA call, so nothing outlives the trainer.
  if (std::getenv("REFIT_TRAINER_PID")) die_with_trainer(SIGKILL);
  int device = 0;
  std::string listen = "127.0.0.1", secret_file, backend = "torch_ipc";
  unsigned port = 0;
  long timeout_ms = 120000;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--device")
      device = std::stoi(next());
    else if (a == "--listen")
      listen = next();
    else if (a == "--port")
      port = static_cast<unsigned>(std::stoul(next()));
    else if (a == "--auth-secret-file")
      secret_file = next();
    else if (a == "--timeout-ms")
      timeout_ms = std::stol(next());
    else if (a == "--backend") {
      backend = next();
      if (backend != "torch_ipc" && backend != "cuda_ipc")
        return usage(("--backend " + backend + ": this worker serves torch_ipc or cuda_ipc").c_str());
    } else
      return usage(("unknown argument " + a).c_str());
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
  config.backend = backend;
  config.timeout = std::chrono::milliseconds(timeout_ms);
  if (!secret_file.empty()) config.auth_secret = auth::read_secret_file(secret_file);
  control::worker_host host(config, engine_context{io.get_executor(), refit::device::cuda(device), {}, &model},
                            model.as_load_weights());
  const auto bound = host.listen(listen, static_cast<std::uint16_t>(port));
  add_model_methods(host, model);  // digest, ipc_stats
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
