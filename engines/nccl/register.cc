// Registers "nccl" with the process-wide factory (CUDA builds; linked in through
// //engines:all).
#include "engines/nccl/nccl.h"
#include "engines/nccl/nccl_collective.h"
#include "lib/factory.h"

namespace {
const bool registered = [] {
  refit::engine_factory::instance().register_backend(
      "nccl",
      [](const refit::weight_transfer_config& c, const refit::engine_context& ctx) {
        return std::unique_ptr<refit::weight_transfer_engine>(
            new refit::nccl::engine(c, ctx, refit::nccl::nccl_collectives()));
      },
      [](const refit::weight_transfer_config& c, const refit::trainer_context& ctx) {
        return std::unique_ptr<refit::weight_sender>(new refit::nccl::sender(c, ctx, refit::nccl::nccl_collectives()));
      });
  return true;
}();
}  // namespace
