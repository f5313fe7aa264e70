#include "examples/torch_ipc/device_model.h"

#include <cuda_runtime_api.h>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/processing.h>
#include <refit/engines/cuda_ipc/cuda_ipc.h>
#include <refit/engines/cuda_ipc/torch_ipc.h>
#include <refit/integrity/fingerprint.h>
#include "examples/torch_ipc/digest.h"

namespace refit::example {

device_model::device_model(int device, std::optional<dtype> store_as)
    : device_(device), store_as_(store_as), unpacker_(4, device) {}

void device_model::set_store_as(std::optional<dtype> store_as) {
  std::lock_guard lock(mutex_);
  store_as_ = store_as;
}

tensor_spec device_model::held_spec(const tensor_spec& incoming) const {
  tensor_spec held = incoming;
  if (store_as_ && cuda::can_convert(incoming.dtype, *store_as_)) held.dtype = *store_as_;
  return held;
}

device_model::tensor& device_model::slot_for(const tensor_spec& incoming) {
  const tensor_spec held = held_spec(incoming);
  auto& t = tensors_[incoming.name];
  if (t.spec != held || (t.memory.size() == 0 && held.nbytes() != 0)) {
    t.memory = cuda::device_buffer(held.nbytes(), device_);
    t.spec = held;
  }
  return t;
}

std::optional<tensor_view> device_model::destination(const tensor_spec& spec) {
  std::lock_guard lock(mutex_);
  tensor& t = slot_for(spec);
  if (t.spec != spec) return std::nullopt;  // converted on arrival: through staging
  return tensor_view(t.spec, t.memory.data(), refit::device::cuda(device_));
}

void device_model::load_weights(std::span<const tensor_view> views) {
  const cudaStream_t s = cuda::current_processing_stream();
  const cuda::device_scope scope(device_);
  pieces_.clear();
  std::lock_guard lock(mutex_);
  for (const auto& v : views) {
    tensor& t = slot_for(v.spec());
    if (v.nbytes() == 0 || t.memory.data() == v.data) continue;  // received in place
    if (t.spec.dtype != v.dtype)
      cuda::convert(v.data, v.dtype, t.memory.data(), t.spec.dtype,
                    static_cast<std::size_t>(checked_numel(t.spec.shape)), s);
    else
      pieces_.push_back({static_cast<const std::byte*>(v.data), t.memory.bytes(), v.nbytes()});
  }
  if (!pieces_.empty()) unpacker_.unpack(pieces_, s);  // every staged copy of the batch: one launch
}

std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> device_model::host_copies(
    const std::vector<std::string>& names) {
  std::lock_guard lock(mutex_);
  const cuda::device_scope scope(device_);
  // Pending processing (conversions on the processing stream) finishes first.
  REFIT_CUDA_CHECK(cudaDeviceSynchronize());
  std::map<std::string, std::pair<tensor_spec, std::vector<std::byte>>> out;
  auto add = [&](const std::string& name, const tensor& t) {
    std::vector<std::byte> bytes(t.spec.nbytes());
    if (!bytes.empty())
      REFIT_CUDA_CHECK(cudaMemcpy(bytes.data(), t.memory.data(), bytes.size(), cudaMemcpyDeviceToHost));
    out.emplace(name, std::make_pair(t.spec, std::move(bytes)));
  };
  if (names.empty()) {
    for (auto& [name, t] : tensors_) add(name, t);
  } else {
    for (const auto& name : names) {
      auto it = tensors_.find(name);
      if (it == tensors_.end()) throw_error(errc::invalid_argument, "no tensor named '" + name + "'");
      add(name, it->second);
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::uint64_t>> device_model::fingerprint(const std::vector<std::string>& names) {
  auto host = host_copies(names);
  std::vector<tensor_view> views;
  for (auto& [name, t] : host) views.emplace_back(t.first, t.second.data());
  return fingerprint_all(views);
}

json device_model::digest(const std::vector<std::string>& names) {
  json out = json::object();
  for (auto& [name, t] : host_copies(names)) {
    auto [sum, weighted] = byte_digest(t.second);
    out[name] = {sum, weighted};
  }
  return out;
}

void add_model_methods(control::worker_host& host, device_model& model) {
  host.add_method("digest", [&model](const json& params) -> asio::awaitable<json> {
    json_reader r(params, "digest params");
    auto names = r.optional<std::vector<std::string>>("names", {});
    r.finish();
    co_return model.digest(names);
  });
  host.add_method("ipc_stats", [&host](const json&) -> asio::awaitable<json> {
    const cuda_ipc::handle_cache* handles = nullptr;
    if (const auto* e = dynamic_cast<const cuda_ipc::torch_engine*>(&host.engine())) handles = &e->handles();
    if (const auto* e = dynamic_cast<const cuda_ipc::engine*>(&host.engine())) handles = &e->handles();
    if (!handles) throw_error(errc::unsupported, "ipc_stats: the engine is neither cuda_ipc nor torch_ipc");
    co_return json{{"opens", handles->opens()}, {"mapped", handles->size()}};
  });
}

}  // namespace refit::example
