// The named tensors of a torch::nn::Module, as both sides of the adapter see them.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace refit::libtorch {

/// A tensor and its name ("layers.0.self_attn.q_proj.weight").
using named_tensor = std::pair<std::string, at::Tensor>;

/// Which of a module's tensors take part.
struct module_tensors {
  bool parameters = true;
  bool buffers = true;
  bool recurse = true;  ///< submodules too, with dotted names
};

/// The module's parameters, then its buffers (named_parameters / named_buffers
/// order). The tensors share storage with the module's: writing into them updates
/// the module in place.
std::vector<named_tensor> named_tensors(const torch::nn::Module& module, const module_tensors& which = {});

}  // namespace refit::libtorch
