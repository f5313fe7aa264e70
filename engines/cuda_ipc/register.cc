// Registers "cuda_ipc" (refit trainers) and "torch_ipc" (PyTorch trainers) with the
// process-wide factory (CUDA builds; linked in through //engines:all). Each engine
// uses the provider of its context's device (the current one when the context
// names no CUDA device).
#include <refit/cuda/staging.h>
#include <refit/engines/cuda_ipc/cuda_ipc.h>
#include <refit/engines/cuda_ipc/cuda_ipc_provider.h>
#include <refit/engines/cuda_ipc/torch_ipc.h>
#include <refit/factory.h>

namespace {
using refit::cuda::device_index;
using refit::cuda_ipc::cuda_ipcs;

const bool registered = [] {
  refit::engine_factory::instance().register_backend(
      "cuda_ipc", refit::cuda_ipc::engine::capabilities_of(),
      [](const refit::weight_transfer_config& c, const refit::engine_context& ctx) {
        return std::unique_ptr<refit::weight_transfer_engine>(
            new refit::cuda_ipc::engine(c, ctx, cuda_ipcs(device_index(ctx.device))));
      },
      [](const refit::weight_transfer_config& c, const refit::trainer_context& ctx) {
        return std::unique_ptr<refit::weight_sender>(
            new refit::cuda_ipc::sender(c, ctx, cuda_ipcs(device_index(ctx.device))));
      });
  // PyTorch trainers: no refit sender, the trainer is Python (examples/torch_ipc).
  refit::engine_factory::instance().register_backend(
      "torch_ipc", refit::cuda_ipc::torch_engine::capabilities_of(),
      [](const refit::weight_transfer_config& c, const refit::engine_context& ctx) {
        return std::unique_ptr<refit::weight_transfer_engine>(
            new refit::cuda_ipc::torch_engine(c, ctx, cuda_ipcs(device_index(ctx.device))));
      });
  return true;
}();
}  // namespace
