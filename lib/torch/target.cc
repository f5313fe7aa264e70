#include <refit/torch/target.h>

#include <algorithm>
#include <functional>
#include <regex>
#include <unordered_map>

#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/nn/module.h>

#include <refit/error.h>

namespace refit::libtorch {

namespace {

struct string_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

template <class T>
using string_map = std::unordered_map<std::string, T, string_hash, std::equal_to<>>;

std::regex compile(const std::string& pattern, std::string_view what) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw_error(errc::invalid_argument, "module_target: " + std::string(what) + " '" + pattern +
                                            "' is not a valid regular expression: " + e.what());
  }
}

std::string in_quotes(std::string_view s) { return "'" + std::string(s) + "'"; }

std::span<const std::int64_t> span_of(c10::IntArrayRef a) { return {a.data(), a.size()}; }

bool is_floating(dtype t) noexcept {
  switch (t) {
    case dtype::float16:
    case dtype::bfloat16:
    case dtype::float32:
    case dtype::float64:
    case dtype::float8_e4m3fn:
    case dtype::float8_e5m2:
      return true;
    default:
      return false;
  }
}

const char* style_name(parallel_style s) {
  switch (s) {
    case parallel_style::column:
      return "column";
    case parallel_style::row:
      return "row";
    case parallel_style::vocab:
      return "vocab";
    default:
      return "replicated";
  }
}

}  // namespace

// The options, compiled once.
struct module_target::compiled {
  const target_options* options = nullptr;
  std::vector<std::optional<std::regex>> renames;  // engaged for regex renames
  std::vector<std::regex> ignore;
  std::vector<std::regex> shards;
  std::vector<std::regex> optional;
  string_map<std::size_t> index;  // model name -> tensors_ index

  // Where an incoming name loads.
  struct resolution {
    std::optional<std::string> name;  // nullopt: ignored
    const fused_param* fused = nullptr;
    std::size_t component = 0;
  };
  resolution resolve(std::string_view incoming) const {
    std::string name(incoming);
    for (std::size_t i = 0; i < options->renames.size(); ++i) {
      const auto& r = options->renames[i];
      if (renames[i])
        name = std::regex_replace(name, *renames[i], r.to);
      else if (name.starts_with(r.from))
        name = r.to + name.substr(r.from.size());
    }
    for (const auto& re : ignore)
      if (std::regex_search(name, re)) return {};
    // A fused name is used only where the model has it (vLLM skips the mapping
    // otherwise), so models with some unfused projections still load.
    for (const auto& f : options->fused)
      for (std::size_t c = 0; c < f.components.size(); ++c)
        if (auto pos = name.find(f.components[c]); pos != std::string::npos) {
          std::string fused = name;
          fused.replace(pos, f.components[c].size(), f.fused);
          if (index.contains(fused)) return {std::move(fused), &f, c};
        }
    return {std::move(name)};
  }
  // The first matching shard rule's style.
  parallel_style style(const std::string& model_name) const {
    for (std::size_t i = 0; i < shards.size(); ++i)
      if (std::regex_search(model_name, shards[i])) return options->shards[i].style;
    return parallel_style::replicated;
  }
};

// Where one announced tensor goes.
struct placement {
  tensor_spec spec;  // as announced
  bool ignored = false;
  std::size_t target = 0;  // tensors_ index
  int shard_dim = -1;      // dim of the incoming tensor holding this rank's slice
  std::int64_t shard_start = 0, shard_length = 0;
  bool fused = false;   // a component: [offset, offset + length) of dim 0
  bool padded = false;  // vocab-parallel: the slice fills the first shard_length rows
  std::int64_t offset = 0, length = 0;
};

struct module_target::plan {
  string_map<placement> by_name;
};

module_target::module_target(std::vector<named_tensor> tensors, target_options options)
    : tensors_(std::move(tensors)), options_(std::move(options)), rules_(std::make_unique<compiled>()) {
  const auto& o = options_;
  rules_->options = &options_;
  if (o.tp_size < 1 || o.tp_rank < 0 || o.tp_rank >= o.tp_size)
    throw_error(errc::invalid_argument, "module_target: tp_rank " + std::to_string(o.tp_rank) +
                                            " is not in [0, tp_size " + std::to_string(o.tp_size) + ")");
  if (o.vocab_padding < 1)
    throw_error(errc::invalid_argument,
                "module_target: vocab_padding must be positive, got " + std::to_string(o.vocab_padding));
  for (const auto& r : o.renames) {
    if (r.type == rename_rule::kind::regex)
      rules_->renames.emplace_back(compile(r.from, "rename pattern"));
    else
      rules_->renames.emplace_back(std::nullopt);
  }
  for (const auto& p : o.ignore) rules_->ignore.push_back(compile(p, "ignore pattern"));
  for (const auto& s : o.shards) rules_->shards.push_back(compile(s.pattern, "shard pattern"));
  for (const auto& p : o.optional) rules_->optional.push_back(compile(p, "optional pattern"));
  for (const auto& f : o.fused) {
    if (f.fused.empty() || f.components.empty() ||
        std::any_of(f.components.begin(), f.components.end(), [](const std::string& c) { return c.empty(); }))
      throw_error(errc::invalid_argument, "module_target: fused parameter " + in_quotes(f.fused) +
                                              " needs a non-empty name and non-empty component names");
    if (!f.sizes.empty() && f.sizes.size() != f.components.size())
      throw_error(errc::invalid_argument, "module_target: fused parameter " + in_quotes(f.fused) + " has " +
                                              std::to_string(f.components.size()) + " components but " +
                                              std::to_string(f.sizes.size()) + " sizes");
    if (std::any_of(f.sizes.begin(), f.sizes.end(), [](std::int64_t s) { return s < 0; }))
      throw_error(errc::invalid_argument,
                  "module_target: fused parameter " + in_quotes(f.fused) + " has a negative size");
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const auto& [name, t] = tensors_[i];
    if (!t.defined())
      throw_error(errc::invalid_argument, "module_target: model tensor " + in_quotes(name) + " is undefined");
    if (t.layout() != c10::Layout::Strided)
      throw_error(errc::unsupported, "module_target: model tensor " + in_quotes(name) + " is not dense (strided)");
    (void)from_torch_device(t.device(), name);
    if (!rules_->index.emplace(name, i).second)
      throw_error(errc::invalid_argument, "module_target: model tensor name " + in_quotes(name) + " appears twice");
  }
}

module_target::module_target(torch::nn::Module& module, target_options options, const module_tensors& which)
    : module_target(named_tensors(module, which), std::move(options)) {}

module_target::~module_target() = default;

std::optional<std::string> module_target::model_name(std::string_view incoming) const {
  return rules_->resolve(incoming).name;
}

// make_plan's steps, and what they gather on the way.
struct module_target::planner {
  explicit planner(const module_target& m) : m(m), o(m.options_), covered(m.tensors_.size()) {}

  // The components of a fused tensor the update carries: incoming name and the
  // dim-0 length of this rank's slice, by component index.
  struct fused_use {
    const fused_param* param = nullptr;
    std::vector<std::optional<std::pair<std::string, std::int64_t>>> parts;
  };

  // One announced tensor: where it loads, checked against its model tensor.
  void place(const tensor_spec& spec);
  // Its dtype: equal to the model tensor's, or a floating-point conversion copy_
  // makes.
  void check_dtype(dtype incoming, const at::Tensor& t, const std::string& what, const std::string& into) const;
  // This rank's slice of it must fit the model tensor (or, for a fused
  // component, a dim-0 range of it); returns the slice.
  std::vector<std::int64_t> fit_slice(placement& pl, const std::string& name, bool fused, const at::Tensor& t,
                                      const std::string& what, const std::string& into) const;
  // This rank's slice by the model tensor's parallel style (pl's shard).
  std::vector<std::int64_t> shard(placement& pl, parallel_style style, bool fused, const std::string& what) const;
  // Each model tensor loads from one update tensor, each fused component too.
  void use_component(placement& pl, std::int64_t length, const fused_param& f, std::size_t component,
                     const std::string& into);
  void cover(const placement& pl, const std::string& into);
  // A fused tensor's components, whose sizes may differ (GQA), one after another
  // along dim 0.
  void stack_components(std::size_t target, const fused_use& use);
  // target_options::require_complete: every model tensor is covered or optional.
  void check_complete() const;

  const module_target& m;
  const target_options& o;
  std::shared_ptr<plan> out = std::make_shared<plan>();
  std::vector<std::string> covered;  // incoming name loading into an unfused tensor
  std::unordered_map<std::size_t, fused_use> fused_uses;
};

std::shared_ptr<const module_target::plan> module_target::make_plan(const update_metadata& meta) const {
  meta.validate();
  planner p(*this);
  for (const auto& spec : meta.tensors) p.place(spec);
  for (const auto& [target, use] : p.fused_uses) p.stack_components(target, use);
  if (options_.require_complete) p.check_complete();
  return std::move(p.out);
}

void module_target::planner::place(const tensor_spec& spec) {
  placement pl;
  pl.spec = spec;
  const auto resolved = m.rules_->resolve(spec.name);
  if (!resolved.name) {
    pl.ignored = true;
    out->by_name.emplace(spec.name, std::move(pl));
    return;
  }
  const std::string& name = *resolved.name;
  const auto it = m.rules_->index.find(name);
  const std::string what =
      "update tensor " + in_quotes(spec.name) + (name == spec.name ? "" : " (model name " + in_quotes(name) + ")");
  if (it == m.rules_->index.end())
    throw_error(errc::invalid_argument, "module_target: " + what + " is not a tensor of the model");
  pl.target = it->second;
  const at::Tensor& t = m.tensors_[pl.target].second;
  const std::string into = "model tensor " + in_quotes(name);
  check_dtype(spec.dtype, t, what, into);
  const std::vector<std::int64_t> slice = fit_slice(pl, name, resolved.fused != nullptr, t, what, into);
  if (resolved.fused)
    use_component(pl, slice[0], *resolved.fused, resolved.component, into);
  else
    cover(pl, into);
  out->by_name.emplace(spec.name, std::move(pl));
}

void module_target::planner::check_dtype(dtype incoming, const at::Tensor& t, const std::string& what,
                                         const std::string& into) const {
  const auto model_dtype = to_dtype(t.scalar_type());
  if (!model_dtype)
    throw_error(errc::invalid_argument, "module_target: " + into + " has torch dtype " +
                                            std::string(c10::toString(t.scalar_type())) +
                                            ", which refit does not move");
  if (!to_scalar_type(incoming))
    throw_error(errc::invalid_argument, "module_target: " + what + " is " + std::string(to_string(incoming)) +
                                            ", which libtorch " + std::string(libtorch_version()) +
                                            " does not have (float8 types need libtorch 2.1 or later)");
  if (incoming == *model_dtype) return;
  if (!o.convert_dtypes)
    throw_error(errc::invalid_argument, "module_target: " + what + " is " + std::string(to_string(incoming)) + " but " +
                                            into + " is " + std::string(to_string(*model_dtype)) +
                                            " (dtype conversion is off)");
  if (!is_floating(incoming) || !is_floating(*model_dtype))
    throw_error(errc::invalid_argument, "module_target: " + what + " is " + std::string(to_string(incoming)) + " but " +
                                            into + " is " + std::string(to_string(*model_dtype)) +
                                            "; only floating-point dtypes are converted");
}

std::vector<std::int64_t> module_target::planner::fit_slice(placement& pl, const std::string& name, bool fused,
                                                            const at::Tensor& t, const std::string& what,
                                                            const std::string& into) const {
  const auto model_shape = span_of(t.sizes());
  const auto& shape = pl.spec.shape;
  const std::string shapes = what + " " + shape_to_string(shape) + " and " + into + " " + shape_to_string(model_shape);
  if (shape.size() != model_shape.size())
    throw_error(errc::invalid_argument, "module_target: " + shapes + " differ in rank");
  if (fused && shape.empty())
    throw_error(errc::invalid_argument, "module_target: " + what + " is a scalar; fused components stack along dim 0");
  const std::vector<std::int64_t> slice = shard(pl, m.rules_->style(name), fused, what);
  const std::string sliced = pl.shard_dim >= 0
                                 ? " (rank " + std::to_string(o.tp_rank) + " of " + std::to_string(o.tp_size) +
                                       " holds " + shape_to_string(slice) + ")"
                                 : "";
  for (std::size_t d = fused ? 1 : 0; d < slice.size(); ++d)
    if (slice[d] != model_shape[d])
      throw_error(errc::invalid_argument,
                  "module_target: shapes of " + shapes + sliced + " do not match" + (fused ? " (beyond dim 0)" : ""));
  return slice;
}

std::vector<std::int64_t> module_target::planner::shard(placement& pl, parallel_style style, bool fused,
                                                        const std::string& what) const {
  const auto& shape = pl.spec.shape;
  std::vector<std::int64_t> slice(shape.begin(), shape.end());  // this rank's part
  if (style == parallel_style::vocab && o.tp_size > 1 && !shape.empty()) {
    // vLLM's VocabParallelEmbedding: rows padded, then split evenly; the last
    // ranks' rows past the vocabulary are padding the update does not write.
    if (fused) throw_error(errc::invalid_argument, "module_target: " + what + " is vocab-parallel and fused");
    const std::int64_t padded = (shape[0] + o.vocab_padding - 1) / o.vocab_padding * o.vocab_padding;
    if (padded % o.tp_size != 0)
      throw_error(errc::invalid_argument, "module_target: " + what + " pads to " + std::to_string(padded) +
                                              " rows, not divisible by tp_size " + std::to_string(o.tp_size));
    const std::int64_t per = padded / o.tp_size;
    pl.shard_dim = 0;
    pl.shard_start = std::min(shape[0], per * o.tp_rank);
    pl.shard_length = std::min(shape[0], per * (o.tp_rank + 1)) - pl.shard_start;
    pl.padded = true;
    slice[0] = per;
  } else if (style != parallel_style::replicated && o.tp_size > 1) {
    const int dim = style == parallel_style::column ? 0 : (shape.size() >= 2 ? 1 : -1);
    if (style == parallel_style::column && shape.empty())
      throw_error(errc::invalid_argument, "module_target: " + what + " is a scalar and cannot be column-parallel");
    if (dim >= 0) {
      if (shape[dim] % o.tp_size != 0)
        throw_error(errc::invalid_argument, "module_target: " + what + " " + shape_to_string(shape) + " is " +
                                                style_name(style) + "-parallel but its dim " + std::to_string(dim) +
                                                " (" + std::to_string(shape[dim]) + ") is not divisible by tp_size " +
                                                std::to_string(o.tp_size));
      pl.shard_dim = dim;
      pl.shard_length = shape[dim] / o.tp_size;
      pl.shard_start = pl.shard_length * o.tp_rank;
      slice[dim] = pl.shard_length;
    }
  }
  return slice;
}

void module_target::planner::use_component(placement& pl, std::int64_t length, const fused_param& f,
                                           std::size_t component, const std::string& into) {
  pl.fused = true;
  pl.length = length;
  auto& use = fused_uses[pl.target];
  use.param = &f;
  use.parts.resize(f.components.size());
  if (use.parts[component])
    throw_error(errc::invalid_argument, "module_target: update tensors " + in_quotes(use.parts[component]->first) +
                                            " and " + in_quotes(pl.spec.name) + " both load into component " +
                                            in_quotes(f.components[component]) + " of " + into);
  use.parts[component] = std::pair(pl.spec.name, length);
}

void module_target::planner::cover(const placement& pl, const std::string& into) {
  if (!covered[pl.target].empty())
    throw_error(errc::invalid_argument, "module_target: update tensors " + in_quotes(covered[pl.target]) + " and " +
                                            in_quotes(pl.spec.name) + " both load into " + into);
  covered[pl.target] = pl.spec.name;
}

void module_target::planner::stack_components(std::size_t target, const fused_use& use) {
  const auto& f = *use.param;
  const std::string& name = m.tensors_[target].first;
  const std::string into = "model tensor " + in_quotes(name);
  const at::Tensor& t = m.tensors_[target].second;
  const bool dim0_split = o.tp_size > 1 && m.rules_->style(name) == parallel_style::column;
  std::vector<std::int64_t> lengths(f.components.size(), -1);
  for (std::size_t c = 0; c < f.components.size(); ++c) {
    std::int64_t declared = -1;
    if (!f.sizes.empty()) {
      if (dim0_split && f.sizes[c] % o.tp_size != 0)
        throw_error(errc::invalid_argument, "module_target: component " + in_quotes(f.components[c]) + " of " + into +
                                                " has size " + std::to_string(f.sizes[c]) +
                                                ", not divisible by tp_size " + std::to_string(o.tp_size));
      declared = dim0_split ? f.sizes[c] / o.tp_size : f.sizes[c];
    }
    if (use.parts[c]) {
      lengths[c] = use.parts[c]->second;
      if (declared >= 0 && declared != lengths[c])
        throw_error(errc::invalid_argument, "module_target: update tensor " + in_quotes(use.parts[c]->first) +
                                                " gives " + std::to_string(lengths[c]) + " rows of component " +
                                                in_quotes(f.components[c]) + " of " + into +
                                                ", its declared size makes " + std::to_string(declared));
      continue;
    }
    if (o.require_complete)
      throw_error(errc::invalid_argument,
                  "module_target: the update misses component " + in_quotes(f.components[c]) + " of fused " + into);
    if (declared < 0)
      throw_error(errc::invalid_argument, "module_target: the update carries only some components of fused " + into +
                                              " (not " + in_quotes(f.components[c]) +
                                              "); set fused_param::sizes to place them");
    lengths[c] = declared;
  }
  std::int64_t offset = 0;
  for (std::size_t c = 0; c < f.components.size(); ++c) {
    if (use.parts[c]) out->by_name.find(use.parts[c]->first)->second.offset = offset;
    offset += lengths[c];
  }
  if (offset != t.size(0)) {
    std::string parts;
    for (std::size_t c = 0; c < f.components.size(); ++c)
      parts += (c ? " + " : "") + std::to_string(lengths[c]) + " (" + f.components[c] + ")";
    throw_error(errc::invalid_argument, "module_target: the components of fused " + into + " stack to " + parts +
                                            " = " + std::to_string(offset) +
                                            " rows on this rank, the model tensor has " + std::to_string(t.size(0)));
  }
}

void module_target::planner::check_complete() const {
  const auto& tensors = m.tensors_;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!covered[i].empty() || fused_uses.contains(i)) continue;
    const auto& name = tensors[i].first;
    if (std::any_of(m.rules_->optional.begin(), m.rules_->optional.end(),
                    [&](const std::regex& re) { return std::regex_search(name, re); }))
      continue;
    std::size_t more = 0;
    for (std::size_t j = i + 1; j < tensors.size(); ++j)
      if (covered[j].empty() && !fused_uses.contains(j)) ++more;
    throw_error(errc::invalid_argument, "module_target: the update misses model tensor " + in_quotes(name) +
                                            (more ? " (and up to " + std::to_string(more) + " more)" : std::string()) +
                                            "; a complete update covers every model tensor (see "
                                            "target_options::require_complete and ::optional)");
  }
}

void module_target::validate(const update_metadata& meta) const { (void)make_plan(meta); }

void module_target::begin_update(const update_metadata& meta) {
  auto p = make_plan(meta);
  std::lock_guard lock(mutex_);
  current_ = std::move(p);
}

void module_target::load_weights(std::span<const tensor_view> weights) {
  std::shared_ptr<const plan> p;
  {
    std::lock_guard lock(mutex_);
    p = current_;
  }
  if (!p)
    throw_error(errc::invalid_state,
                "module_target: load_weights before begin_update; announce the update's "
                "metadata first (an engine does when the target is its context's model)");
  // Everything of the batch is checked before any of it is written.
  std::vector<const placement*> places;
  places.reserve(weights.size());
  for (const auto& v : weights) {
    const auto it = p->by_name.find(v.name);
    if (it == p->by_name.end())
      throw_error(errc::invalid_state,
                  "module_target: tensor " + in_quotes(v.name) + " was not in the update announced to begin_update");
    const auto& spec = it->second.spec;
    if (v.dtype != spec.dtype || !std::ranges::equal(v.shape, spec.shape))
      throw_error(errc::invalid_argument, "module_target: tensor " + in_quotes(v.name) + " arrived as " +
                                              std::string(to_string(v.dtype)) + " " + shape_to_string(v.shape) +
                                              ", announced as " + std::string(to_string(spec.dtype)) + " " +
                                              shape_to_string(spec.shape));
    if (!v.data && v.nbytes() != 0)
      throw_error(errc::invalid_argument, "module_target: tensor " + in_quotes(v.name) + " has no data");
    places.push_back(&it->second);
  }

  c10::InferenceMode inference;
  std::vector<c10::Device> cuda_devices;
  auto note = [&](const c10::Device& d) {
    if (d.is_cuda() && std::find(cuda_devices.begin(), cuda_devices.end(), d) == cuda_devices.end())
      cuda_devices.push_back(d);
  };
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const placement& pl = *places[i];
    if (pl.ignored) continue;
    at::Tensor src = to_tensor(weights[i]);
    if (pl.shard_dim >= 0) src = src.narrow(pl.shard_dim, pl.shard_start, pl.shard_length);
    at::Tensor dst = tensors_[pl.target].second;
    if (pl.fused) dst = dst.narrow(0, pl.offset, pl.length);
    if (pl.padded) dst = dst.narrow(0, 0, pl.shard_length);
    note(src.device());
    note(dst.device());
    if (src.numel() == 0) continue;
    dst.copy_(src);
  }
  // The views die when this returns: device-to-device copies must be done by then.
  for (const auto& d : cuda_devices) {
    const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    guard->getStream(d).synchronize();
  }
}

}  // namespace refit::libtorch
