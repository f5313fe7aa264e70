// A trainer's model in device memory for the GPU engine tests: every tensor on
// cuda:0 with, unless asked otherwise, a host copy to check the worker's digest
// against.
#pragma once

#include <cuda_runtime_api.h>

#include <random>
#include <string>
#include <vector>

#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/json.h>
#include <refit/metadata.h>
#include <refit/tensor.h>
#include "examples/torch_ipc/digest.h"

namespace refit::cuda::testing {

// A trainer's model in device memory, with a host copy of every tensor.
struct device_tensors {
  update_metadata meta;
  std::vector<std::vector<std::byte>> host;
  std::vector<device_buffer> device;

  /// Without `host_copy` the tensor has no host bytes (fill() leaves it as it is).
  void add(std::string name, dtype t, std::vector<std::int64_t> shape, bool host_copy = true) {
    meta.tensors.push_back({std::move(name), t, std::move(shape)});
    host.emplace_back(host_copy ? meta.tensors.back().nbytes() : 0);
    device.emplace_back(meta.tensors.back().nbytes(), 0);
  }
  void fill(std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (std::size_t i = 0; i < host.size(); ++i) {
      for (auto& b : host[i]) b = static_cast<std::byte>(rng() & 0x7f);  // finite bf16/fp32 patterns
      if (!host[i].empty())
        REFIT_CUDA_CHECK(cudaMemcpy(device[i].data(), host[i].data(), host[i].size(), cudaMemcpyHostToDevice));
    }
  }
  std::vector<tensor_view> views() const {
    std::vector<tensor_view> v;
    for (std::size_t i = 0; i < device.size(); ++i) v.emplace_back(meta.tensors[i], device[i].data(), device::cuda(0));
    return v;
  }
  json expected_digests() const {
    json out = json::object();
    for (std::size_t i = 0; i < host.size(); ++i) {
      auto [sum, weighted] = example::byte_digest(host[i]);
      out[meta.tensors[i].name] = {sum, weighted};
    }
    return out;
  }
};

inline device_tensors mixed_model() {
  device_tensors m;
  m.add("embed", dtype::bfloat16, {3000, 64});
  m.add("big", dtype::bfloat16, {40 << 20});  // 80 MiB: split over 16 MiB buffers
  m.add("norm", dtype::float32, {64});
  m.add("ids", dtype::int64, {1000});
  m.add("scalar", dtype::float32, {});
  m.add("empty", dtype::bfloat16, {0, 8});
  for (int i = 0; i < 500; ++i) m.add("layers." + std::to_string(i) + ".bias", dtype::bfloat16, {1 + i % 97});
  return m;
}

}  // namespace refit::cuda::testing
