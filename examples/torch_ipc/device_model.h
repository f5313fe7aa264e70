// A model held in device memory, one buffer per tensor name (allocated the first
// time a name is declared, then reused: addresses stay put): the model_target of
// the CUDA workers (examples/torch_ipc:worker, the GPU check's cuda_ipc worker).
//
// It offers each tensor's memory for direct receive; a tensor that arrives through
// staging is copied in on the processing stream (all of a batch in one batched
// launch), or, when the model stores a dtype other than the one sent (store_as,
// e.g. bfloat16 sent, float32 kept), converted there by refit's conversion kernel:
// the post-processing a GPU worker overlaps with the next bucket's receive.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <refit/control/worker_host.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/unpack.h>
#include <refit/engine.h>

namespace refit::example {

class device_model final : public model_target {
 public:
  /// Tensors live on CUDA device `device`. With `store_as`, floating-point tensors
  /// are kept in that dtype (converted on arrival; no direct receive then).
  explicit device_model(int device, std::optional<dtype> store_as = std::nullopt);

  /// Changes store_as for later updates (a tensor whose stored dtype changes is
  /// reallocated when it next arrives).
  void set_store_as(std::optional<dtype> store_as);

  std::optional<tensor_view> destination(const tensor_spec& spec) override;
  void load_weights(std::span<const tensor_view> views) override;
  std::vector<std::pair<std::string, std::uint64_t>> fingerprint(const std::vector<std::string>& names) override;

  /// {name: [sum, weighted_sum]} of the bytes held (digest.h); all tensors when
  /// `names` is empty; invalid_argument for a name it does not hold.
  json digest(const std::vector<std::string>& names);

 private:
  struct tensor {
    tensor_spec spec;  // as held (dtype may be store_as)
    cuda::device_buffer memory;
  };
  tensor& slot_for(const tensor_spec& incoming);  // mutex_ held
  tensor_spec held_spec(const tensor_spec& incoming) const;
  std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> host_copies(
      const std::vector<std::string>& names);

  int device_;
  std::optional<dtype> store_as_;
  std::mutex mutex_;
  std::map<std::string, tensor> tensors_;
  cuda::unpacker unpacker_;  // processing thread only (load_weights is never concurrent with itself)
  std::vector<cuda::piece> pieces_;
};

/// Adds the CUDA workers' own control methods to `host` (whose model is `model`):
///   digest {"names": [str]}  -> {name: [sum, weighted_sum]}  (all tensors when absent)
///   ipc_stats {}             -> {"opens": handles opened ever, "mapped": open now}
///                               (cuda_ipc and torch_ipc engines: a trainer whose
///                               memory lives pays for its opens once)
void add_model_methods(control::worker_host& host, device_model& model);

}  // namespace refit::example
