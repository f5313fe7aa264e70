// Registers "nccl" with the process-wide factory (CUDA builds; linked in through
// //engines:all). Each engine and sender uses the provider of its context's device
// (the current one when the context names no CUDA device).
#include <refit/cuda/staging.h>
#include <refit/engines/nccl/nccl.h>
#include <refit/engines/nccl/nccl_collective.h>
#include <refit/factory.h>

namespace {
using refit::cuda::device_index;
using refit::nccl::nccl_collectives;

const bool registered = [] {
  refit::engine_factory::instance().register_backend(
      "nccl", refit::nccl::engine::capabilities_of(),
      [](const refit::weight_transfer_config& c, const refit::engine_context& ctx) {
        return std::unique_ptr<refit::weight_transfer_engine>(
            new refit::nccl::engine(c, ctx, nccl_collectives(device_index(ctx.device))));
      },
      [](const refit::weight_transfer_config& c, const refit::trainer_context& ctx) {
        return std::unique_ptr<refit::weight_sender>(
            new refit::nccl::sender(c, ctx, nccl_collectives(device_index(ctx.device))));
      });
  return true;
}();
}  // namespace
