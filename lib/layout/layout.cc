#include <refit/layout/layout.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <regex>
#include <unordered_map>
#include <unordered_set>

#include <refit/error.h>

namespace refit {

namespace {

std::string in_quotes(std::string_view s) { return "'" + std::string(s) + "'"; }

}  // namespace

// ---------------------------------------------------------------- placement, box

std::string placement::to_string() const { return is_shard() ? "shard(" + std::to_string(dim) + ")" : "replicate"; }

placement parse_placement(std::string_view text) {
  if (text == "replicate" || text == "R" || text == "Replicate()") return placement::replicate();
  auto dim_of = [&](std::string_view prefix) -> std::optional<int> {
    if (!text.starts_with(prefix) || !text.ends_with(")")) return std::nullopt;
    std::string_view digits = text.substr(prefix.size(), text.size() - prefix.size() - 1);
    if (digits.empty() || digits.size() > 3) return std::nullopt;
    int d = 0;
    for (char c : digits) {
      if (c < '0' || c > '9') return std::nullopt;
      d = d * 10 + (c - '0');
    }
    return d;
  };
  for (std::string_view prefix : {"shard(", "S(", "Shard(dim=", "Shard("})
    if (auto d = dim_of(prefix)) return placement::shard(*d);
  throw_error(errc::invalid_argument, "placement: expected \"replicate\" or \"shard(DIM)\", got " + in_quotes(text));
}

std::int64_t box::numel() const {
  std::int64_t n = 1;
  for (auto e : extent) n *= e;
  return n;
}

std::string box::to_string() const {
  std::string s = "[";
  for (std::size_t d = 0; d < offset.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(offset[d]) + ":" + std::to_string(offset[d] + extent[d]);
  }
  return s + "]";
}

box whole(std::span<const std::int64_t> shape) {
  return {std::vector<std::int64_t>(shape.size(), 0), std::vector<std::int64_t>(shape.begin(), shape.end())};
}

box intersect(const box& a, const box& b) {
  box out;
  out.offset.resize(a.offset.size());
  out.extent.resize(a.offset.size());
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const auto lo = std::max(a.offset[d], b.offset[d]);
    const auto hi = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    out.offset[d] = lo;
    out.extent[d] = std::max<std::int64_t>(0, hi - lo);
  }
  return out;
}

chunk_range torch_chunk(std::int64_t n, std::int64_t parts, std::int64_t index) {
  if (parts < 1 || index < 0 || index >= parts)
    throw_error(errc::invalid_argument,
                "torch_chunk: chunk " + std::to_string(index) + " of " + std::to_string(parts) + " does not exist");
  const std::int64_t size = (n + parts - 1) / parts;
  const std::int64_t start = std::min(n, index * size);
  const std::int64_t end = std::min(n, (index + 1) * size);
  return {start, end - start};
}

// ---------------------------------------------------------------- mesh, source

std::int64_t device_mesh::size() const {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

void device_mesh::validate() const {
  if (shape.empty()) throw_error(errc::invalid_argument, "device mesh: the shape is empty");
  std::int64_t n = 1;
  for (auto s : shape) {
    if (s < 1 || s > 1 << 20)
      throw_error(errc::invalid_argument,
                  "device mesh: dimension sizes must be in [1, 2^20], got " + std::to_string(s));
    n *= s;
    if (n > 1 << 20) throw_error(errc::invalid_argument, "device mesh: more than 2^20 ranks");
  }
  if (ranks.empty()) return;
  if (static_cast<std::int64_t>(ranks.size()) != n)
    throw_error(errc::invalid_argument, "device mesh: " + std::to_string(ranks.size()) + " ranks for a mesh of " +
                                            std::to_string(n) + " coordinates");
  std::vector<char> seen(ranks.size(), 0);
  for (int r : ranks) {
    if (r < 0 || r >= n || seen[r])
      throw_error(errc::invalid_argument, "device mesh: ranks must be a permutation of 0.." + std::to_string(n - 1) +
                                              ", got rank " + std::to_string(r) + (r >= 0 && r < n ? " twice" : ""));
    seen[r] = 1;
  }
}

namespace {

// Coordinates of linear mesh index `index` (row-major).
std::vector<std::int64_t> coords_of(const device_mesh& mesh, std::int64_t index) {
  std::vector<std::int64_t> c(mesh.shape.size());
  for (std::size_t i = mesh.shape.size(); i-- > 0;) {
    c[i] = index % mesh.shape[i];
    index /= mesh.shape[i];
  }
  return c;
}

std::int64_t index_of_rank(const device_mesh& mesh, int rank) {
  if (mesh.ranks.empty()) return rank;
  auto it = std::find(mesh.ranks.begin(), mesh.ranks.end(), rank);
  return it - mesh.ranks.begin();
}

box box_at(const device_mesh& mesh, const placed_tensor& t, const std::vector<std::int64_t>& coords) {
  box b = whole(t.spec.shape);
  for (std::size_t i = 0; i < t.placements.size(); ++i) {
    const auto& p = t.placements[i];
    if (!p.is_shard()) continue;
    const auto c = torch_chunk(b.extent[p.dim], mesh.shape[i], coords[i]);
    b.offset[p.dim] += c.start;
    b.extent[p.dim] = c.length;
  }
  return b;
}

}  // namespace

box source_layout::local_box(std::size_t t, int rank) const {
  if (rank < 0 || rank >= ranks())
    throw_error(errc::invalid_argument, "source layout: rank " + std::to_string(rank) + " is not on the mesh of " +
                                            std::to_string(ranks()) + " ranks");
  return box_at(mesh, tensors.at(t), coords_of(mesh, index_of_rank(mesh, rank)));
}

update_metadata source_layout::local_metadata(int rank) const {
  if (rank < 0 || rank >= ranks())
    throw_error(errc::invalid_argument, "source layout: rank " + std::to_string(rank) + " is not on the mesh of " +
                                            std::to_string(ranks()) + " ranks");
  const auto coords = coords_of(mesh, index_of_rank(mesh, rank));
  update_metadata meta;
  meta.tensors.reserve(tensors.size());
  for (const auto& t : tensors) meta.tensors.push_back({t.spec.name, t.spec.dtype, box_at(mesh, t, coords).extent});
  return meta;
}

update_metadata source_layout::global_metadata() const {
  update_metadata meta;
  meta.tensors.reserve(tensors.size());
  for (const auto& t : tensors) meta.tensors.push_back(t.spec);
  return meta;
}

void source_layout::validate() const {
  mesh.validate();
  global_metadata().validate();
  for (const auto& t : tensors) {
    if (t.placements.size() != mesh.shape.size())
      throw_error(errc::invalid_argument, "source layout: tensor " + in_quotes(t.spec.name) + " has " +
                                              std::to_string(t.placements.size()) + " placements for a " +
                                              std::to_string(mesh.shape.size()) + "-dimensional mesh");
    for (const auto& p : t.placements)
      if (p.is_shard() && (p.dim < 0 || p.dim >= static_cast<int>(t.spec.shape.size())))
        throw_error(errc::invalid_argument, "source layout: tensor " + in_quotes(t.spec.name) + " of shape " +
                                                shape_to_string(t.spec.shape) + " cannot be placed " + p.to_string());
  }
}

source_layout source_layout::uniform(const update_metadata& meta, device_mesh mesh, std::vector<placement> placements) {
  source_layout l;
  l.mesh = std::move(mesh);
  l.tensors.reserve(meta.tensors.size());
  for (const auto& t : meta.tensors) {
    // Scalars (rare: step counters) cannot be sharded: they stay replicated rather
    // than refusing the whole layout. Any other tensor lacking the dim is refused.
    auto p = placements;
    if (t.shape.empty())
      for (auto& x : p) x = placement::replicate();
    l.tensors.push_back({t, std::move(p)});
  }
  l.validate();
  return l;
}

source_layout source_layout::single(const update_metadata& meta) {
  return uniform(meta, device_mesh{}, {placement::replicate()});
}

// ---------------------------------------------------------------- destination

update_metadata dest_layout::metadata() const {
  update_metadata meta;
  meta.tensors.reserve(tensors.size());
  for (const auto& t : tensors) meta.tensors.push_back(t.spec);
  return meta;
}

namespace {

using name_index = std::unordered_map<std::string_view, std::size_t>;

name_index index_of(const source_layout& source) {
  name_index index;
  index.reserve(source.tensors.size());
  for (std::size_t i = 0; i < source.tensors.size(); ++i) index.emplace(source.tensors[i].spec.name, i);
  return index;
}

// Messages are made only when something is wrong: a 100k-tensor layout has
// millions of pieces.
void validate_one(const dest_layout& dest, const source_layout& source, const name_index& index, std::size_t worker) {
  auto who = [&] { return "destination layout of worker " + std::to_string(worker); };
  {
    std::unordered_set<std::string_view> names;
    names.reserve(dest.tensors.size());
    for (const auto& t : dest.tensors) {
      if (t.spec.name.empty()) throw_error(errc::invalid_argument, who() + ": a tensor has an empty name");
      if (!names.insert(t.spec.name).second)
        throw_error(errc::invalid_argument, who() + ": tensor " + in_quotes(t.spec.name) + " appears twice");
      (void)t.spec.nbytes();  // shape checked
    }
  }
  for (const auto& t : dest.tensors) {
    auto tensor = [&] { return who() + ", tensor " + in_quotes(t.spec.name); };
    const std::size_t rank = t.spec.shape.size();
    for (std::size_t k = 0; k < t.pieces.size(); ++k) {
      const auto& p = t.pieces[k];
      auto piece = [&] { return tensor() + ", piece " + std::to_string(k); };
      auto it = index.find(p.source);
      if (it == index.end()) throw_error(errc::invalid_argument, piece() + ": no source tensor " + in_quotes(p.source));
      const auto& s = source.tensors[it->second].spec;
      if (s.dtype != t.spec.dtype)
        throw_error(errc::invalid_argument, piece() + ": source " + in_quotes(s.name) + " is " +
                                                std::string(to_string(s.dtype)) + ", the tensor " +
                                                std::string(to_string(t.spec.dtype)));
      if (s.shape.size() != rank || p.from.offset.size() != rank || p.from.extent.size() != rank || p.at.size() != rank)
        throw_error(errc::invalid_argument, piece() + ": source " + in_quotes(s.name) + " of shape " +
                                                shape_to_string(s.shape) + " and the tensor of shape " +
                                                shape_to_string(t.spec.shape) + " need boxes of their rank");
      for (std::size_t d = 0; d < rank; ++d) {
        if (p.from.offset[d] < 0 || p.from.extent[d] < 0 || p.from.offset[d] + p.from.extent[d] > s.shape[d])
          throw_error(errc::invalid_argument, piece() + ": box " + p.from.to_string() + " is outside source " +
                                                  in_quotes(s.name) + " of shape " + shape_to_string(s.shape));
        if (p.at[d] < 0 || p.at[d] + p.from.extent[d] > t.spec.shape[d])
          throw_error(errc::invalid_argument, piece() + ": placed at dim " + std::to_string(d) + " offset " +
                                                  std::to_string(p.at[d]) + " it does not fit the tensor's shape " +
                                                  shape_to_string(t.spec.shape));
      }
    }
    // Overlaps: sweep over dim 0 (pieces of one tensor are few, or disjoint in dim 0).
    std::vector<std::size_t> order(t.pieces.size());
    std::iota(order.begin(), order.end(), 0);
    auto start = [&](std::size_t k) { return rank ? t.pieces[k].at[0] : 0; };
    auto end = [&](std::size_t k) { return rank ? t.pieces[k].at[0] + t.pieces[k].from.extent[0] : 1; };
    std::sort(order.begin(), order.end(),
              [&](auto a, auto b) { return start(a) < start(b) || (start(a) == start(b) && a < b); });
    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto& a = t.pieces[order[i]];
      if (a.from.empty()) continue;
      for (std::size_t j = i + 1; j < order.size() && start(order[j]) < end(order[i]); ++j) {
        const auto& b = t.pieces[order[j]];
        if (b.from.empty()) continue;
        bool overlap = true;
        for (std::size_t d = 0; d < rank && overlap; ++d)
          overlap = a.at[d] < b.at[d] + b.from.extent[d] && b.at[d] < a.at[d] + a.from.extent[d];
        if (overlap)
          throw_error(errc::invalid_argument, tensor() + ": pieces " + std::to_string(std::min(order[i], order[j])) +
                                                  " and " + std::to_string(std::max(order[i], order[j])) +
                                                  " overlap (each byte must come from one piece)");
      }
    }
  }
}

}  // namespace

void validate(const dest_layout& dest, const source_layout& source, std::size_t worker) {
  validate_one(dest, source, index_of(source), worker);
}

void validate(std::span<const dest_layout> workers, const source_layout& source) {
  const auto index = index_of(source);
  for (std::size_t w = 0; w < workers.size(); ++w) validate_one(workers[w], source, index, w);
}

// ---------------------------------------------------------------- tensor-parallel rules

namespace {

// The destination presets read_dest_layouts accepts, by name.
std::map<std::string, std::function<tp_layout_options()>>& tp_presets() {
  static std::map<std::string, std::function<tp_layout_options()>> presets{
      {"replicated", [] { return tp_layout_options{}; }}};
  return presets;
}

}  // namespace

void register_tp_preset(const std::string& name, std::function<tp_layout_options()> options) {
  tp_presets()[name] = std::move(options);
}

namespace {

std::regex compile_rule(const std::string& pattern, std::string_view what) {
  try {
    return std::regex(pattern, std::regex::ECMAScript | std::regex::optimize);
  } catch (const std::regex_error& e) {
    throw_error(errc::invalid_argument, "tensor-parallel layout: " + std::string(what) + " " + in_quotes(pattern) +
                                            " is not a valid regular expression: " + e.what());
  }
}

// This rank's box of a (component) tensor under `style`, and the local extents.
struct local_slice {
  box from;
  std::vector<std::int64_t> local_shape;
};

local_slice slice_for(const tensor_spec& t, parallel_style style, int tp, int r, std::int64_t padding,
                      const std::string& model_name) {
  local_slice s{whole(t.shape), t.shape};
  const auto rank = t.shape.size();
  auto split = [&](std::size_t dim, const char* what) {
    const auto n = t.shape[dim];
    if (n % tp != 0)
      throw_error(errc::invalid_argument, "tensor-parallel layout: " + in_quotes(t.name) + " (" +
                                              in_quotes(model_name) + ", " + what + "-parallel) has " +
                                              std::to_string(n) + " in dim " + std::to_string(dim) +
                                              ", not divisible by tp_size " + std::to_string(tp));
    s.from.offset[dim] = n / tp * r;
    s.from.extent[dim] = n / tp;
    s.local_shape[dim] = n / tp;
  };
  switch (style) {
    case parallel_style::replicated:
      break;
    case parallel_style::column:
      if (rank >= 1) split(0, "column");
      break;
    case parallel_style::row:
      if (rank >= 2) split(1, "row");
      break;
    case parallel_style::vocab: {
      if (rank < 1) break;
      const auto n = t.shape[0];
      const auto padded = (n + padding - 1) / padding * padding;
      if (padded % tp != 0)
        throw_error(errc::invalid_argument, "tensor-parallel layout: " + in_quotes(t.name) + " pads to " +
                                                std::to_string(padded) + " rows, not divisible by tp_size " +
                                                std::to_string(tp));
      const auto per = padded / tp;
      const auto lo = std::min(n, per * r), hi = std::min(n, per * (r + 1));
      s.from.offset[0] = lo;
      s.from.extent[0] = hi - lo;
      s.local_shape[0] = per;
      break;
    }
  }
  return s;
}

}  // namespace

dest_layout tensor_parallel_layout(const update_metadata& global, int tp_size, int tp_rank,
                                   const tp_layout_options& options) {
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size)
    throw_error(errc::invalid_argument, "tensor-parallel layout: rank " + std::to_string(tp_rank) + " of tp_size " +
                                            std::to_string(tp_size) + " does not exist");
  if (options.vocab_padding < 1)
    throw_error(errc::invalid_argument, "tensor-parallel layout: vocab_padding must be positive");
  std::vector<std::regex> shards, ignore;
  for (const auto& s : options.shards) shards.push_back(compile_rule(s.pattern, "shard pattern"));
  for (const auto& i : options.ignore) ignore.push_back(compile_rule(i, "ignore pattern"));
  auto style_of = [&](const std::string& name) {
    for (std::size_t i = 0; i < shards.size(); ++i)
      if (std::regex_search(name, shards[i])) return options.shards[i].style;
    return parallel_style::replicated;
  };

  dest_layout out;
  // Fused tensors: the components seen so far, by model name.
  struct fused_build {
    std::size_t dest = 0;
    const fused_param* param = nullptr;
    std::vector<std::optional<std::pair<const tensor_spec*, local_slice>>> parts;
  };
  std::map<std::string, fused_build> fused;
  for (const auto& t : global.tensors) {
    bool skip = false;
    for (const auto& re : ignore)
      if (std::regex_search(t.name, re)) skip = true;
    if (skip) continue;
    const fused_param* fp = nullptr;
    std::size_t component = 0;
    std::string model_name = t.name;
    for (const auto& f : options.fused) {
      for (std::size_t c = 0; c < f.components.size() && !fp; ++c)
        if (auto pos = t.name.find(f.components[c]); pos != std::string::npos) {
          model_name.replace(pos, f.components[c].size(), f.fused);
          fp = &f;
          component = c;
        }
      if (fp) break;
    }
    auto slice = slice_for(t, style_of(model_name), tp_size, tp_rank, options.vocab_padding, model_name);
    if (!fp) {
      dest_tensor d{{model_name, t.dtype, slice.local_shape}, {}};
      if (!slice.from.empty() || t.shape.empty())
        d.pieces.push_back({t.name, slice.from, std::vector<std::int64_t>(t.shape.size(), 0)});
      out.tensors.push_back(std::move(d));
      continue;
    }
    if (t.shape.empty())
      throw_error(errc::invalid_argument,
                  "tensor-parallel layout: " + in_quotes(t.name) + " is a scalar; fused components stack along dim 0");
    auto [it, fresh] = fused.try_emplace(model_name);
    auto& fb = it->second;
    if (fresh) {
      fb.dest = out.tensors.size();
      fb.param = fp;
      fb.parts.resize(fp->components.size());
      out.tensors.push_back({{model_name, t.dtype, {}}, {}});
    }
    if (fb.parts[component])
      throw_error(errc::invalid_argument, "tensor-parallel layout: " + in_quotes(t.name) + " and " +
                                              in_quotes(fb.parts[component]->first->name) + " both load into " +
                                              in_quotes(model_name));
    fb.parts[component] = std::make_pair(&t, std::move(slice));
  }
  // Stack each fused tensor's components in the fused order.
  for (auto& [name, fb] : fused) {
    auto& d = out.tensors[fb.dest];
    std::int64_t rows = 0;
    const tensor_spec* first = nullptr;
    for (std::size_t c = 0; c < fb.parts.size(); ++c) {
      if (!fb.parts[c])
        throw_error(errc::invalid_argument, "tensor-parallel layout: fused " + in_quotes(name) +
                                                " lacks its component " + in_quotes(fb.param->components[c]));
      const auto& [spec, slice] = *fb.parts[c];
      if (!first) first = spec;
      auto tail = [](const std::vector<std::int64_t>& s) { return std::vector<std::int64_t>(s.begin() + 1, s.end()); };
      if (spec->dtype != first->dtype || tail(slice.local_shape) != tail(fb.parts[0]->second.local_shape))
        throw_error(errc::invalid_argument, "tensor-parallel layout: the components of fused " + in_quotes(name) +
                                                " differ in dtype or in dims after 0 (" + in_quotes(first->name) + " " +
                                                shape_to_string(first->shape) + ", " + in_quotes(spec->name) + " " +
                                                shape_to_string(spec->shape) + ")");
      std::vector<std::int64_t> at(spec->shape.size(), 0);
      at[0] = rows;
      if (!slice.from.empty()) d.pieces.push_back({spec->name, slice.from, std::move(at)});
      rows += slice.local_shape[0];
    }
    d.spec.dtype = first->dtype;
    d.spec.shape = fb.parts[0]->second.local_shape;
    d.spec.shape[0] = rows;
  }
  return out;
}

// ---------------------------------------------------------------- JSON

source_layout read_source_layout(json_reader& r, const update_metadata& meta) {
  device_mesh mesh;
  mesh.shape = r.required<std::vector<std::int64_t>>("mesh");
  mesh.ranks = r.optional<std::vector<int>>("ranks", {});
  std::vector<placement> placements;
  for (const auto& p : r.optional<std::vector<std::string>>("placements", {})) placements.push_back(parse_placement(p));
  if (placements.empty()) placements.assign(mesh.shape.size(), placement::replicate());
  try {
    mesh.validate();
  } catch (const error& e) {
    r.fail("member '" + r.member_path("mesh") + "': " + e.message());
  }
  if (placements.size() != mesh.shape.size())
    r.fail("member '" + r.member_path("placements") + "' has " + std::to_string(placements.size()) +
           " placements for a " + std::to_string(mesh.shape.size()) + "-dimensional mesh");
  // uniform()'s placements, validated only once the overrides are in: a default
  // that shards a dim some tensor lacks is fine when that tensor's override says
  // otherwise (what write_source_layout writes for sharded weights and 1-D biases).
  source_layout layout;
  layout.mesh = mesh;
  layout.tensors.reserve(meta.tensors.size());
  for (const auto& t : meta.tensors)
    layout.tensors.push_back(
        {t, t.shape.empty() ? std::vector<placement>(placements.size(), placement::replicate()) : placements});
  if (r.has("tensors")) {
    auto overrides = r.required<json>("tensors");
    if (!overrides.is_object()) r.fail("member '" + r.member_path("tensors") + "' must be an object");
    std::unordered_map<std::string_view, std::size_t> index;
    for (std::size_t i = 0; i < layout.tensors.size(); ++i) index.emplace(layout.tensors[i].spec.name, i);
    for (auto& [name, value] : overrides.items()) {
      auto it = index.find(name);
      const std::string path = r.member_path("tensors") + "." + name;
      if (it == index.end()) r.fail("member '" + path + "' names no tensor of the update");
      auto list = r.convert<std::vector<std::string>>(value, path);
      std::vector<placement> p;
      for (const auto& s : list) p.push_back(parse_placement(s));
      layout.tensors[it->second].placements = std::move(p);
    }
  }
  layout.validate();
  return layout;
}

json write_source_layout(const source_layout& layout) {
  json out = json::object();
  out["mesh"] = layout.mesh.shape;
  if (!layout.mesh.ranks.empty()) out["ranks"] = layout.mesh.ranks;
  // The most common placements become the default; the rest are overrides.
  std::map<std::vector<std::string>, std::size_t> counts;
  std::vector<std::vector<std::string>> names(layout.tensors.size());
  for (std::size_t i = 0; i < layout.tensors.size(); ++i) {
    for (const auto& p : layout.tensors[i].placements) names[i].push_back(p.to_string());
    ++counts[names[i]];
  }
  std::vector<std::string> common(layout.mesh.shape.size(), "replicate");
  std::size_t best = 0;
  for (const auto& [k, n] : counts)
    if (n > best) best = n, common = k;
  out["placements"] = common;
  // uniform() makes scalars replicated.
  std::vector<placement> parsed;
  for (const auto& s : common) parsed.push_back(parse_placement(s));
  json overrides = json::object();
  for (std::size_t i = 0; i < layout.tensors.size(); ++i) {
    auto implied = parsed;
    if (layout.tensors[i].spec.shape.empty())
      for (auto& x : implied) x = placement::replicate();
    if (layout.tensors[i].placements != implied) overrides[layout.tensors[i].spec.name] = names[i];
  }
  if (!overrides.empty()) out["tensors"] = std::move(overrides);
  return out;
}

std::vector<dest_layout> read_dest_layouts(json_reader& r, const update_metadata& global) {
  std::vector<dest_layout> out;
  if (auto preset = r.maybe<std::string>("preset")) {
    const auto& presets = tp_presets();
    const auto found = presets.find(*preset);
    if (found == presets.end()) {
      std::string known;
      for (const auto& [name, rules] : presets) known += (known.empty() ? "" : " or ") + in_quotes(name);
      r.fail("member '" + r.member_path("preset") + "': expected " + known + ", got " + in_quotes(*preset));
    }
    const int tp = r.required<int>("tp_size");
    if (tp < 1 || tp > 4096) r.fail("member '" + r.member_path("tp_size") + "' must be in [1, 4096]");
    auto options = found->second();
    options.vocab_padding = r.optional<std::int64_t>("vocab_padding", options.vocab_padding);
    options.ignore = r.optional<std::vector<std::string>>("ignore", {});
    for (int w = 0; w < tp; ++w) out.push_back(tensor_parallel_layout(global, tp, w, options));
    return out;
  }
  auto workers = r.required<json>("workers");
  const std::string path = r.member_path("workers");
  if (!workers.is_array() || workers.empty()) r.fail("member '" + path + "' must be a non-empty array");
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const std::string wpath = path + "[" + std::to_string(w) + "]";
    if (!workers[w].is_array()) r.fail("member '" + wpath + "' must be an array of tensors");
    dest_layout d;
    for (std::size_t i = 0; i < workers[w].size(); ++i) {
      json_reader t(workers[w][i], r.context(), wpath + "[" + std::to_string(i) + "]");
      dest_tensor dt;
      dt.spec.name = t.required<std::string>("name");
      dt.spec.dtype = parse_dtype(t.required<std::string>("dtype"));
      dt.spec.shape = t.required<std::vector<std::int64_t>>("shape");
      auto pieces = t.required<json>("pieces");
      if (!pieces.is_array()) t.fail("member '" + t.member_path("pieces") + "' must be an array");
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        json_reader p(pieces[k], r.context(), t.member_path("pieces") + "[" + std::to_string(k) + "]");
        dest_piece dp;
        dp.source = p.required<std::string>("source");
        dp.from.offset = p.required<std::vector<std::int64_t>>("offset");
        dp.from.extent = p.required<std::vector<std::int64_t>>("extent");
        dp.at = p.required<std::vector<std::int64_t>>("at");
        p.finish();
        dt.pieces.push_back(std::move(dp));
      }
      t.finish();
      d.tensors.push_back(std::move(dt));
    }
    out.push_back(std::move(d));
  }
  return out;
}

// ---------------------------------------------------------------- bytes

namespace {

// The box's innermost contiguous run: trailing dims the box covers entirely fold
// into one, plus the first dim it does not cover.
struct run_shape {
  std::size_t outer_dims = 0;      // dims iterated one by one: [0, outer_dims)
  std::uint64_t run_elements = 1;  // elements per run
};

run_shape fold(std::span<const std::int64_t> shape, const box& b) {
  run_shape rs;
  std::size_t d = shape.size();
  while (d > 0) {
    --d;
    rs.run_elements *= static_cast<std::uint64_t>(b.extent[d]);
    if (b.extent[d] != shape[d]) {
      rs.outer_dims = d;
      return rs;
    }
  }
  rs.outer_dims = 0;
  return rs;
}

}  // namespace

std::uint64_t run_count(std::span<const std::int64_t> shape, const box& b) {
  if (b.empty()) return 0;
  const auto rs = fold(shape, b);
  std::uint64_t n = 1;
  for (std::size_t d = 0; d < rs.outer_dims; ++d) n *= static_cast<std::uint64_t>(b.extent[d]);
  return n;
}

void for_each_run(std::span<const std::int64_t> shape, const box& b, std::size_t element,
                  const std::function<void(std::uint64_t, std::uint64_t)>& run) {
  if (b.empty()) return;
  const std::size_t rank = shape.size();
  const auto rs = fold(shape, b);
  // Row-major strides in elements.
  std::vector<std::uint64_t> stride(rank, 1);
  for (std::size_t d = rank; d-- > 1;) stride[d - 1] = stride[d] * static_cast<std::uint64_t>(shape[d]);
  std::uint64_t base = 0;
  for (std::size_t d = 0; d < rank; ++d) base += static_cast<std::uint64_t>(b.offset[d]) * stride[d];
  const std::uint64_t run_bytes = rs.run_elements * element;
  if (rs.outer_dims == 0) {
    run(base * element, run_bytes);
    return;
  }
  std::vector<std::int64_t> idx(rs.outer_dims, 0);
  for (;;) {
    std::uint64_t at = base;
    for (std::size_t d = 0; d < rs.outer_dims; ++d) at += static_cast<std::uint64_t>(idx[d]) * stride[d];
    run(at * element, run_bytes);
    std::size_t d = rs.outer_dims;
    while (d > 0) {
      --d;
      if (++idx[d] < b.extent[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
  }
}

void copy_box(const std::byte* src, std::span<const std::int64_t> src_shape, const box& from, std::byte* dst,
              std::span<const std::int64_t> dst_shape, std::span<const std::int64_t> at, std::size_t element) {
  if (from.empty()) return;
  // Walk both boxes' runs in step: the destination's runs are cut at the source's
  // and vice versa, over the same row-major byte sequence.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dst_runs;
  box to{std::vector<std::int64_t>(at.begin(), at.end()), from.extent};
  dst_runs.reserve(run_count(dst_shape, to));
  for_each_run(dst_shape, to, element, [&](std::uint64_t o, std::uint64_t n) { dst_runs.emplace_back(o, n); });
  std::size_t k = 0;
  std::uint64_t used = 0;  // of dst_runs[k]
  for_each_run(src_shape, from, element, [&](std::uint64_t o, std::uint64_t n) {
    while (n > 0) {
      const auto take = std::min(n, dst_runs[k].second - used);
      std::memcpy(dst + dst_runs[k].first + used, src + o, take);
      o += take;
      n -= take;
      used += take;
      if (used == dst_runs[k].second) ++k, used = 0;
    }
  });
}

}  // namespace refit
