// The worker side of the libtorch adapter: a refit::model_target that copies an
// update into a module's existing tensors in place (addresses unchanged, so
// captured CUDA graphs stay valid), with vLLM's loading rules: renames, fused
// parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj), tensor-parallel shards
// and dtype conversion. Every update is checked against the model as a whole
// before any byte of it is written.
//
// Call order (what makes "checked before any write" hold):
//   1. begin_update(metadata) with the update's declared metadata (names, dtypes,
//      shapes). It throws refit::error(invalid_argument) naming the parameter for
//      unknown or missing names, shape and dtype mismatches; nothing is written.
//   2. load_weights(batch) any number of times with views of that update; a view
//      whose name, dtype or shape was not announced in step 1 is refused
//      (invalid_state / invalid_argument) before anything of its batch is written.
// With an engine, step 1 is automatic: put the target in engine_context::model
// and pass as_load_weights() as the load_weights of receive_weights (or of
// worker_host); the engine base calls begin_update with each update's metadata
// before it receives a byte, and a refused update leaves the weights untouched.
//
//   refit::libtorch::target_options opt;
//   opt.fused = refit::libtorch::vllm_stacked_params();
//   opt.shards = refit::libtorch::vllm_llama_shards();
//   opt.tp_rank = ranks.tp_rank; opt.tp_size = ranks.tp_size;
//   refit::libtorch::module_target target(model, opt);
//   ctx.model = &target;  ...  worker_host host(config, ctx, target.as_load_weights());
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include <refit/adapters/vllm.h>
#include <refit/engine.h>
#include <refit/layout/layout.h>
#include <refit/metadata.h>
#include <refit/torch/module.h>
#include <refit/torch/tensor.h>

namespace refit::libtorch {

// vLLM's loading rules are the vLLM adapter's (lib/adapters/vllm.h), in the core's
// layout model, shared with sharded transfers: the same presets slice a broadcast
// here and plan a sharded transfer there.
using refit::fused_param;
using refit::parallel_style;
using refit::shard_rule;
using refit::vllm_llama_shards;
using refit::vllm_stacked_params;
using refit::vllm_vocab_shards;

/// A rename applied to each incoming name (before fusing).
struct rename_rule {
  enum class kind { prefix, regex };
  kind type = kind::prefix;
  std::string from;  ///< the prefix, or the std::regex (ECMAScript)
  std::string to;    ///< the new prefix, or the regex replacement ($1 ...)

  /// Replaces a leading `from` with `to` ("model." -> "", "" -> "model.").
  static rename_rule prefix(std::string from, std::string to) { return {kind::prefix, std::move(from), std::move(to)}; }
  /// std::regex_replace of every match of `pattern` with `replacement`.
  static rename_rule regex(std::string pattern, std::string replacement) {
    return {kind::regex, std::move(pattern), std::move(replacement)};
  }
};

/// How a module_target maps an update onto the model.
struct target_options {
  /// Applied in order, each to the result of the one before.
  std::vector<rename_rule> renames;
  /// Incoming names (after renames) that match any of these regexes are accepted
  /// and dropped (e.g. "rotary_emb\\.inv_freq").
  std::vector<std::string> ignore;
  std::vector<fused_param> fused;
  std::vector<shard_rule> shards;
  int tp_rank = 0;
  int tp_size = 1;
  /// vocab-style tensors (vllm_vocab_shards) pad dim 0 to a multiple of this and
  /// split it evenly; the model tensor holds the padded rows of its rank.
  std::int64_t vocab_padding = 64;
  /// Convert between floating-point dtypes (float16, bfloat16, float32, float64,
  /// float8 where libtorch has it) into the model tensor's dtype. Integer and bool
  /// tensors must always match exactly; false: every dtype must match.
  bool convert_dtypes = true;
  /// Every update must cover every model tensor (and every component of a fused
  /// one). false: updates may carry any subset (chunked updates), but still only
  /// known names with matching shapes.
  bool require_complete = true;
  /// Model tensors (regexes on the model's names) that a complete update may leave
  /// out, e.g. buffers the trainer does not send.
  std::vector<std::string> optional;
};

/// A model_target over named at::Tensors (a module's parameters and buffers, or a
/// name -> tensor map). It keeps references to the tensors and writes into them
/// with copy_ under InferenceMode; source views may be on cpu or cuda and the model
/// tensors on either. CUDA copies run on torch's current stream and are
/// synchronised before load_weights returns, because the views are only valid
/// during the call.
class module_target final : public model_target {
 public:
  /// Targets `tensors` (names unique). Throws invalid_argument for a bad option
  /// (tp_rank out of range, a regex that does not compile, ...).
  explicit module_target(std::vector<named_tensor> tensors, target_options options = {});
  /// Targets a module's parameters and buffers (see named_tensors).
  explicit module_target(torch::nn::Module& module, target_options options = {}, const module_tensors& which = {});
  ~module_target() override;

  /// Checks the whole update against the model and makes it the update
  /// load_weights accepts. Throws refit::error(invalid_argument) naming the first
  /// problem's tensor: an unknown name, a missing model tensor or fused component,
  /// two tensors loading into the same place, a rank or shape mismatch (after
  /// fusing and sharding; a split dimension not divisible by tp_size), a dtype
  /// that cannot be converted. On error the previously announced update stays.
  void begin_update(const update_metadata& meta) override;
  /// The same check without changing what load_weights accepts.
  void validate(const update_metadata& meta) const;

  /// Copies each view into its place. Refuses, before writing anything of the
  /// batch, views not announced by begin_update (invalid_state) or that differ
  /// from what was announced (invalid_argument).
  void load_weights(std::span<const tensor_view> weights) override;

  /// Where an incoming (checkpoint) name loads: the model tensor's name, after
  /// renames and fusing; nullopt when ignored. Does not check that it exists.
  std::optional<std::string> model_name(std::string_view incoming) const;

  /// The model tensors, as given.
  const std::vector<named_tensor>& tensors() const noexcept { return tensors_; }
  const target_options& options() const noexcept { return options_; }

 private:
  struct compiled;
  struct plan;
  struct planner;  // make_plan's steps
  std::shared_ptr<const plan> make_plan(const update_metadata& meta) const;

  std::vector<named_tensor> tensors_;
  target_options options_;
  std::unique_ptr<compiled> rules_;
  mutable std::mutex mutex_;
  std::shared_ptr<const plan> current_;
};

}  // namespace refit::libtorch
