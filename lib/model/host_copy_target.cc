#include <refit/model/host_copy_target.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <refit/error.h>
#include <refit/integrity/fingerprint.h>

namespace refit {

void host_copy_target::begin_update(const update_metadata& meta) {
  if (inner_) inner_->begin_update(meta);
  std::lock_guard lock(mutex_);
  for (const auto& spec : meta.tensors) {
    auto& e = tensors_[spec.name];
    if (e.data && e.spec.dtype == spec.dtype && e.spec.shape == spec.shape) continue;
    e.spec = spec;
    e.data = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(spec.nbytes(), 1));
    e.filled = false;
  }
}

std::optional<tensor_view> host_copy_target::destination(const tensor_spec& spec) {
  std::lock_guard lock(mutex_);
  auto it = tensors_.find(spec.name);
  if (it == tensors_.end() || it->second.spec.dtype != spec.dtype || it->second.spec.shape != spec.shape)
    return std::nullopt;
  return tensor_view(it->second.spec, it->second.data.get());
}

void host_copy_target::load_weights(std::span<const tensor_view> weights) {
  // Checked and looked up under the lock, copied outside it (destination() runs
  // on the engine's loop).
  std::vector<std::pair<std::byte*, const tensor_view*>> copies;
  {
    std::lock_guard lock(mutex_);
    for (const auto& v : weights) {
      auto it = tensors_.find(std::string(v.name));
      if (it == tensors_.end() || it->second.spec.dtype != v.dtype || it->second.spec.nbytes() != v.nbytes())
        throw_error(errc::invalid_argument,
                    "host_copy_target: '" + std::string(v.name) + "' was not announced with this dtype and shape");
      if (!v.device.is_cpu())
        throw_error(errc::unsupported, "host_copy_target: '" + std::string(v.name) + "' arrived on " +
                                           to_string(v.device) + ", not in host memory");
      if (v.data != it->second.data.get() && v.nbytes() > 0) copies.emplace_back(it->second.data.get(), &v);
      it->second.filled = true;  // whole once the copies below are done (a failure throws past the update)
    }
  }
  for (auto [to, v] : copies) std::memcpy(to, v->data, v->nbytes());
}

std::vector<std::pair<std::string, std::uint64_t>> host_copy_target::fingerprint(
    const std::vector<std::string>& names) {
  if (inner_) return inner_->fingerprint(names);
  std::lock_guard lock(mutex_);
  std::vector<tensor_view> views;
  views.reserve(tensors_.size());
  for (const auto& [name, e] : tensors_) views.emplace_back(e.spec, e.data.get());
  return fingerprint_all(views, names);
}

bool host_copy_target::can_read_back(const tensor_spec& spec) {
  std::lock_guard lock(mutex_);
  auto it = tensors_.find(spec.name);
  return it != tensors_.end() && it->second.filled && it->second.spec.dtype == spec.dtype &&
         it->second.spec.shape == spec.shape;
}

void host_copy_target::read_back(const tensor_spec& spec, std::span<std::byte> out) {
  const std::byte* from = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = tensors_.find(spec.name);
    if (it == tensors_.end() || !it->second.filled || it->second.spec.dtype != spec.dtype ||
        it->second.spec.shape != spec.shape || out.size() != spec.nbytes())
      throw_error(errc::invalid_argument, "host_copy_target: read_back: no whole copy of '" + spec.name + "'");
    from = it->second.data.get();
  }
  if (!out.empty()) std::memcpy(out.data(), from, out.size());
}

void host_copy_target::seed(const tensor_view& v) {
  if (!v.device.is_cpu())
    throw_error(errc::unsupported, "host_copy_target: seed: '" + std::string(v.name) + "' is on " +
                                       to_string(v.device) + ", not the host");
  entry e;
  e.spec = v.spec();
  e.data = std::make_unique_for_overwrite<std::byte[]>(std::max<std::size_t>(v.nbytes(), 1));
  if (v.nbytes() > 0) std::memcpy(e.data.get(), v.data, v.nbytes());
  e.filled = true;
  std::lock_guard lock(mutex_);
  tensors_[e.spec.name] = std::move(e);
}

load_weights_fn host_copy_target::loading_through(load_weights_fn load) {
  return [this, load = std::move(load)](std::span<const tensor_view> weights) {
    load_weights(weights);
    if (load) load(weights);
  };
}

std::uint64_t host_copy_target::bytes() const {
  std::lock_guard lock(mutex_);
  std::uint64_t n = 0;
  for (const auto& [name, e] : tensors_) n += e.spec.nbytes();
  return n;
}

}  // namespace refit
