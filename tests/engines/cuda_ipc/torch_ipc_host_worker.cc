// A "torch_ipc" worker over host memory, for testing refit_ipc.py's client without a
// GPU: the test asks it to export host memory holding bytes of its choosing
// (export_test_memory {"hex": str} -> {"handle": hex, "gpu": uuid}), describes
// tensors in that memory as a PyTorch trainer would, and checks what arrived with
// digest (as examples/torch_ipc/worker.cc). Host "handles" only resolve inside this
// process, which is why the memory is exported here.
#include <cstdio>
#include <map>
#include <mutex>

#include <asio/io_context.hpp>

#include <refit/control/worker_host.h>
#include <refit/engines/cuda_ipc/torch_ipc.h>
#include <refit/factory.h>
#include <refit/integrity/auth.h>
#include <refit/internal/hex.h>
#include "examples/common/worker_process.h"
#include "examples/torch_ipc/digest.h"

namespace refit::testing {
namespace {

class host_model final : public model_target {
 public:
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    std::lock_guard lock(mutex_);
    auto& t = tensors_[spec.name];
    if (t.first != spec) {
      t.first = spec;
      t.second.assign(spec.nbytes(), std::byte{0});
    }
    return tensor_view(t.first, t.second.data());
  }
  void load_weights(std::span<const tensor_view> views) override {
    for (const auto& v : views) {
      auto d = destination(v.spec());
      if (d->data != v.data && v.nbytes() != 0) std::memcpy(d->data, v.data, v.nbytes());
    }
  }
  json digest() {
    std::lock_guard lock(mutex_);
    json out = json::object();
    for (auto& [name, t] : tensors_) {
      auto [sum, weighted] = example::byte_digest(t.second);
      out[name] = {sum, weighted};
    }
    return out;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> tensors_;
};

int run(int argc, char** argv) {
  weight_transfer_config config;
  config.backend = "torch_ipc";
  config.timeout = std::chrono::seconds(30);
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--auth-secret-file") config.auth_secret = auth::read_secret_file(argv[i + 1]);
  engine_factory factory;
  factory.register_backend(
      "torch_ipc", cuda_ipc::torch_engine::capabilities_of(),
      [](const weight_transfer_config& c, const engine_context& ctx) {
        return std::unique_ptr<weight_transfer_engine>(new cuda_ipc::torch_engine(c, ctx, cuda_ipc::host_ipc()));
      });
  asio::io_context io;
  host_model model;
  control::worker_host host(config, engine_context{io.get_executor(), {}, {}, &model}, model.as_load_weights(),
                            factory);
  std::vector<std::unique_ptr<staging_memory>> exported;
  host.add_method("export_test_memory", [&](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "export_test_memory params");
    const auto hex = r.required<std::string>("hex");
    r.finish();
    auto mem = cuda_ipc::host_ipc()->make_exportable(1, std::max<std::uint64_t>(4096, hex.size() / 2));
    if (!from_hex(hex, mem->slot(0).first(hex.size() / 2))) r.fail("member 'hex' must be hex digits");
    auto [handle, gpu] = cuda_ipc::host_ipc()->export_buffer(*mem, 0);
    exported.push_back(std::move(mem));
    co_return json{{"handle", to_hex(handle)}, {"gpu", cuda_ipc::format_gpu_uuid(gpu)}};
  });
  host.add_method("digest", [&](const json&) -> asio::awaitable<json> { co_return model.digest(); });
  const auto port = host.listen("127.0.0.1", 0);
  return example::serve_worker(io, host, port);
}

}  // namespace
}  // namespace refit::testing

int main(int argc, char** argv) {
  try {
    return refit::testing::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_ipc_host_worker: %s\n", e.what());
    return 1;
  }
}
