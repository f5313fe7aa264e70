#include <refit/torch/source.h>

#include <refit/error.h>

namespace refit::libtorch {

torch_source::torch_source(std::vector<named_tensor> tensors, bool contiguous_copies)
    : tensors_(std::move(tensors)), copies_(tensors_.size()), contiguous_copies_(contiguous_copies) {
  metadata_.tensors.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    // Checks without copying: a non-contiguous tensor's spec is its sizes.
    if (contiguous_copies_ && t.second.defined() && !t.second.is_contiguous()) {
      (void)dtype_of(t.second.scalar_type(), t.first);
      (void)from_torch_device(t.second.device(), t.first);
      const auto sizes = t.second.sizes();
      metadata_.tensors.push_back(
          {t.first, *to_dtype(t.second.scalar_type()), std::vector<std::int64_t>(sizes.begin(), sizes.end())});
    } else {
      metadata_.tensors.push_back(to_view(t.second, t.first).spec());
    }
  }
  metadata_.validate();
}

torch_source::torch_source(const torch::nn::Module& module, const module_tensors& which, bool contiguous_copies)
    : torch_source(named_tensors(module, which), contiguous_copies) {}

tensor_view torch_source::view_of(std::size_t i) {
  const auto& [name, t] = tensors_[i];
  if (contiguous_copies_ && t.defined() && !t.is_contiguous()) {
    if (!copies_[i].defined()) copies_[i] = t.contiguous();
    return to_view(copies_[i], name);
  }
  return to_view(t, name);
}

std::optional<tensor_view> torch_source::next() {
  if (next_ >= tensors_.size()) return std::nullopt;
  return view_of(next_++);
}

void torch_source::rewind() noexcept {
  next_ = 0;
  for (auto& c : copies_) c = at::Tensor();
}

std::vector<tensor_view> torch_source::views() {
  std::vector<tensor_view> out;
  out.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) out.push_back(view_of(i));
  return out;
}

}  // namespace refit::libtorch
