#include <refit/torch/module.h>

#include <torch/nn/module.h>

namespace refit::libtorch {

std::vector<named_tensor> named_tensors(const torch::nn::Module& module, const module_tensors& which) {
  std::vector<named_tensor> out;
  if (which.parameters)
    for (const auto& item : module.named_parameters(which.recurse)) out.emplace_back(item.key(), item.value());
  if (which.buffers)
    for (const auto& item : module.named_buffers(which.recurse)) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace refit::libtorch
