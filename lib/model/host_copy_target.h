// A model_target that keeps a host copy of every tensor's last delivered bytes and
// offers that copy as each tensor's destination, for models whose own memory
// cannot be read back as the trainer sends it: vLLM's parameters (fused, repacked,
// quantised) or device memory. Updates land in the copy (direct receive, no
// staging copy) and the receive's load_weights gets views of it; a delta update
// (docs/delta.md) decodes against it, so such a worker takes deltas.
//
//   refit::host_copy_target copy;                        // or host_copy_target(&checks)
//   ctx.model = &copy;
//   auto engine = factory.create_engine(config, ctx);
//   co_await engine->receive_weights(info, copy.loading_through(model_load_weights));
//
// The copy holds what the model was last given: in place, the bytes land in the
// copy and load_weights sees them there; with staged commits they land in the
// stage, and loading_through() copies each view into the copy before the model's
// load_weights sees it (the commit), so the copy is what the model was given
// either way. A failed update leaves the copy partly written, which the engine's
// base check sees (it hashes the copy before it takes a delta): the next update
// comes full.
//
// Memory: the bytes of every tensor it has been sent (the model's size on the
// host), allocated at begin_update for tensors it has not held before (on the
// engine's loop: an allocation, not a fill; the pages are faulted in as bytes
// land), held until it is destroyed. A tensor sent again with another dtype or
// shape gets new memory.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <refit/engine.h>

namespace refit {

class host_copy_target final : public model_target {
 public:
  /// `inner` (optional, not owned): told of every update first (its begin_update
  /// checks may refuse it) and answers fingerprint(); null: fingerprints of the
  /// copy.
  explicit host_copy_target(model_target* inner = nullptr) : inner_(inner) {}

  void begin_update(const update_metadata& meta) override;
  /// The copy of `spec` (after begin_update announced it with this dtype and shape).
  std::optional<tensor_view> destination(const tensor_spec& spec) override;
  /// Copies views that are not the copy's own memory into it; the model is loaded
  /// by the receive's load_weights (loading_through), never here.
  void load_weights(std::span<const tensor_view> weights) override;
  std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names) override;
  /// The copy reads back what the model was last given: a tensor the copy holds
  /// whole (loaded at least once with this dtype and shape). Undo of a staged
  /// commit (lib/engine.h) then reloads the previous version through load_weights.
  bool can_read_back(const tensor_spec& spec) override;
  void read_back(const tensor_spec& spec, std::span<std::byte> out) override;

  /// Gives the copy `v`'s bytes (host memory) as what the model holds now, before
  /// any update reached it: what a server loaded from its checkpoint, so that the
  /// first update can be undone too. Replaces what the copy held of that tensor.
  /// Not during an update.
  void seed(const tensor_view& v);

  /// `load` preceded by load_weights(views) above: what a receive passes so that
  /// the copy holds every view the model is given, in either commit mode.
  load_weights_fn loading_through(load_weights_fn load);
  /// Bytes held.
  std::uint64_t bytes() const;

 private:
  struct entry {
    tensor_spec spec;
    std::unique_ptr<std::byte[]> data;
    bool filled = false;  // load_weights gave it whole bytes since it was allocated
  };
  model_target* inner_;
  mutable std::mutex mutex_;
  std::unordered_map<std::string, entry> tensors_;
};

}  // namespace refit
