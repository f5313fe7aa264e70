// The trainer side of the libtorch adapter: a refit::tensor_source over a
// torch::nn::Module's parameters and buffers, or over any range of
// (name, at::Tensor). Views are zero-copy: the sender reads the tensors' own memory.
//
//   refit::libtorch::torch_source source(model);          // parameters + buffers
//   co_await sender->send_weights(source.metadata(), source);
//   // next update (same tensors, new values): source.rewind(), send again
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <ranges>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include <refit/metadata.h>
#include <refit/torch/module.h>
#include <refit/torch/tensor.h>
#include <refit/trainer.h>

namespace refit::libtorch {

namespace detail {
template <class E>
concept keyed_item = requires(const E& e) {  // torch::OrderedDict's items
  { e.key() } -> std::convertible_to<std::string_view>;
  { e.value() } -> std::convertible_to<const at::Tensor&>;
};
template <class E>
concept pair_item = requires(const E& e) {  // std::pair, std::tuple
  { std::get<0>(e) } -> std::convertible_to<std::string_view>;
  { std::get<1>(e) } -> std::convertible_to<const at::Tensor&>;
};
}  // namespace detail

/// A range whose elements are (name, at::Tensor): pairs or tuples of a string-like
/// and a tensor, or torch::OrderedDict items (module.named_parameters()).
template <class R>
concept named_tensor_range = std::ranges::input_range<R> &&
    (detail::keyed_item<std::ranges::range_value_t<R>> || detail::pair_item<std::ranges::range_value_t<R>>);

/// Collects a named_tensor_range into owned (name, tensor) pairs; the tensors share
/// storage with the originals.
template <named_tensor_range R>
std::vector<named_tensor> collect_named(R&& range) {
  std::vector<named_tensor> out;
  for (auto&& e : range) {
    if constexpr (detail::keyed_item<std::ranges::range_value_t<R>>)
      out.emplace_back(std::string(std::string_view(e.key())), e.value());
    else
      out.emplace_back(std::string(std::string_view(std::get<0>(e))), std::get<1>(e));
  }
  return out;
}

/// Yields zero-copy views of a fixed list of named tensors, in order, and declares
/// their metadata. It holds references to the tensors it was built with: in-place
/// changes (optimizer steps) are seen, replaced tensors (module.to(dtype)) are not;
/// build a new source then. Views stay valid until the source is destroyed (or, for
/// contiguous copies, rewound), which covers a send.
class torch_source final : public tensor_source {
 public:
  /// Checks every tensor now (names unique and non-empty, dtype known, cpu or cuda,
  /// dense, contiguous) and throws refit::error naming the first bad one.
  /// `contiguous_copies`: instead of refusing a non-contiguous tensor, copy it
  /// (t.contiguous(), made when next() reaches it, held until rewind()).
  explicit torch_source(std::vector<named_tensor> tensors, bool contiguous_copies = false);
  /// A module's parameters and buffers (see named_tensors).
  explicit torch_source(const torch::nn::Module& module, const module_tensors& which = {},
                        bool contiguous_copies = false);
  /// Any range of (name, tensor): a map, a vector of pairs, module.named_parameters().
  template <named_tensor_range R>
  requires(!std::same_as<std::remove_cvref_t<R>, std::vector<named_tensor>>) explicit torch_source(
      R&& range, bool contiguous_copies = false)
      : torch_source(collect_named(std::forward<R>(range)), contiguous_copies) {}

  /// What the trainer declares for the update (send_weights' `declared`).
  const update_metadata& metadata() const noexcept { return metadata_; }
  /// The tensors, as given.
  const std::vector<named_tensor>& tensors() const noexcept { return tensors_; }
  std::size_t size() const noexcept { return tensors_.size(); }

  /// The next tensor's view, or nullopt after the last.
  std::optional<tensor_view> next() override;
  /// Starts again from the first tensor (for the next update); drops copies.
  void rewind() noexcept;
  /// Views of all tensors (for trainer_send_weights with a range, or
  /// refit::describe). Non-contiguous tensors need contiguous_copies.
  std::vector<tensor_view> views();

 private:
  tensor_view view_of(std::size_t i);

  std::vector<named_tensor> tensors_;
  std::vector<at::Tensor> copies_;  // contiguous copies, by index (undefined: none)
  update_metadata metadata_;
  bool contiguous_copies_;
  std::size_t next_ = 0;
};

}  // namespace refit::libtorch
