// The loopback backend: trainer and worker in one process, linked by name. It moves
// bytes with memcpy through the shared receive pipeline, so it is the reference
// engine of the conformance suite and a way to test a load_weights without a network.
#pragma once

#include <memory>
#include <string>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/engine.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit::loopback {

struct link;

/// {"channel": str, "buffer_bytes": int, "num_buffers": int}: the channel the
/// sender created and the wire parameters it chose ("checksums" is accepted and
/// has no effect: bytes never leave the process).
struct init_info final : refit::init_info {
  std::string channel;
  wire_params wire;
  static init_info read(json_reader& r);
};

/// {"names", "dtype_names", "shapes"}.
using update_info = metadata_update_info;

/// Worker side.
class engine final : public backend::typed_engine<init_info, update_info> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context);
  ~engine() override;
  std::string_view backend() const noexcept override { return "loopback"; }
  /// Direct receive and staged commits; processing deferred.
  static engine_capabilities capabilities_of() {
    return {.direct_receive = true, .staged_commit = true, .defers_processing = true};
  }

 protected:
  asio::awaitable<void> init(const init_info& info) override;
  asio::awaitable<void> receive(const update_info& info, load_weights_fn load_weights) override;
  void do_shutdown() override;

 private:
  std::shared_ptr<link> link_;
  std::unique_ptr<receive_pipeline> pipeline_;
};

/// Trainer side. prepare({"channel": str, "buffer_bytes": int, "num_buffers": int})
/// opens the channel and returns the same JSON as the workers' init info.
class sender final : public weight_sender {
 public:
  sender(const weight_transfer_config& config, const trainer_context& context);
  ~sender() override;
  std::string_view backend() const noexcept override { return "loopback"; }
  json prepare(const json& trainer_args) override;
  asio::awaitable<void> connect_workers() override { co_return; }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override;
  void shutdown() override;

 private:
  weight_transfer_config config_;
  trainer_context context_;
  std::shared_ptr<link> link_;
};

}  // namespace refit::loopback
