#include <refit/transfer_plan.h>

#include <algorithm>
#include <unordered_map>

#include <xxhash.h>

#include <refit/error.h>

namespace refit {

std::uint64_t transfer_plan::total_bytes() const {
  std::uint64_t n = 0;
  for (auto b : ingress) n += b;
  return n;
}

namespace {

class hasher {
 public:
  hasher() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~hasher() { XXH3_freeState(state_); }
  hasher(const hasher&) = delete;
  hasher& operator=(const hasher&) = delete;
  void bytes(const void* p, std::size_t n) { XXH3_64bits_update(state_, p, n); }
  void u64(std::uint64_t v) { bytes(&v, sizeof v); }
  void str(std::string_view s) {
    u64(s.size());
    bytes(s.data(), s.size());
  }
  void ints(std::span<const std::int64_t> v) {
    u64(v.size());
    bytes(v.data(), v.size() * sizeof(std::int64_t));
  }
  std::uint64_t digest() const { return XXH3_64bits_digest(state_); }

 private:
  XXH3_state_t* state_;
};

// One tensor dim's cut into the blocks its shard placements make (nested
// torch.chunk in mesh-dim order), sorted by start.
struct segment {
  std::int64_t start = 0, length = 0;
  std::vector<std::int64_t> coords;  // the coordinate of each mesh dim sharding this tensor dim
};

struct tensor_grid {
  std::vector<std::vector<segment>> dims;      // per tensor dim
  std::vector<std::vector<std::size_t>> mesh_dims;  // per tensor dim: the mesh dims sharding it, in order
  std::vector<std::size_t> free_dims;          // mesh dims that replicate it
};

tensor_grid grid_of(const device_mesh& mesh, const placed_tensor& t) {
  tensor_grid g;
  const std::size_t rank = t.spec.shape.size();
  g.dims.resize(rank);
  g.mesh_dims.resize(rank);
  for (std::size_t d = 0; d < rank; ++d) g.dims[d].push_back({0, t.spec.shape[d], {}});
  for (std::size_t i = 0; i < t.placements.size(); ++i) {
    const auto& p = t.placements[i];
    if (!p.is_shard()) {
      g.free_dims.push_back(i);
      continue;
    }
    auto& segs = g.dims[p.dim];
    std::vector<segment> next;
    next.reserve(segs.size() * mesh.shape[i]);
    for (const auto& s : segs)
      for (std::int64_t c = 0; c < mesh.shape[i]; ++c) {
        const auto ch = torch_chunk(s.length, mesh.shape[i], c);
        segment n{s.start + ch.start, ch.length, s.coords};
        n.coords.push_back(c);
        next.push_back(std::move(n));
      }
    segs = std::move(next);
    g.mesh_dims[p.dim].push_back(i);
  }
  return g;
}

}  // namespace

std::uint64_t layout_digest(const source_layout& source, std::span<const dest_layout> workers) {
  hasher h;
  h.str("refit transfer plan 1");
  h.ints(source.mesh.shape);
  h.u64(source.mesh.ranks.size());
  for (int r : source.mesh.ranks) h.u64(static_cast<std::uint64_t>(r));
  h.u64(source.tensors.size());
  for (const auto& t : source.tensors) {
    h.str(t.spec.name);
    h.u64(static_cast<std::uint64_t>(t.spec.dtype));
    h.ints(t.spec.shape);
    h.u64(t.placements.size());
    for (const auto& p : t.placements) h.u64((static_cast<std::uint64_t>(p.type) << 32) | static_cast<std::uint32_t>(p.dim));
  }
  h.u64(workers.size());
  for (const auto& w : workers) {
    h.u64(w.tensors.size());
    for (const auto& t : w.tensors) {
      h.str(t.spec.name);
      h.u64(static_cast<std::uint64_t>(t.spec.dtype));
      h.ints(t.spec.shape);
      h.u64(t.pieces.size());
      for (const auto& p : t.pieces) {
        h.str(p.source);
        h.ints(p.from.offset);
        h.ints(p.from.extent);
        h.ints(p.at);
      }
    }
  }
  return h.digest();
}

transfer_plan plan_transfer(const source_layout& source, std::span<const dest_layout> workers) {
  source.validate();
  if (workers.empty()) throw_error(errc::invalid_argument, "transfer plan: no workers");
  for (std::size_t w = 0; w < workers.size(); ++w) validate(workers[w], source, w);

  transfer_plan plan;
  plan.ranks = source.ranks();
  plan.workers = static_cast<int>(workers.size());
  plan.pairs.resize(static_cast<std::size_t>(plan.ranks) * plan.workers);
  plan.egress.assign(plan.ranks, 0);
  plan.ingress.assign(plan.workers, 0);
  plan.digest = layout_digest(source, workers);

  std::unordered_map<std::string_view, std::uint32_t> index;
  index.reserve(source.tensors.size());
  for (std::uint32_t i = 0; i < source.tensors.size(); ++i) index.emplace(source.tensors[i].spec.name, i);
  // Grids on first use: a tensor no worker wants costs nothing.
  std::vector<std::optional<tensor_grid>> grids(source.tensors.size());
  const auto& mesh = source.mesh;
  std::vector<std::int64_t> mesh_stride(mesh.shape.size(), 1);
  for (std::size_t i = mesh.shape.size(); i-- > 1;) mesh_stride[i - 1] = mesh_stride[i] * mesh.shape[i];

  std::vector<std::size_t> pick;  // per tensor dim: the segment chosen
  std::vector<std::pair<std::size_t, std::size_t>> range;  // per tensor dim: segments [first, last)
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const auto& dest = workers[w];
    for (std::uint32_t di = 0; di < dest.tensors.size(); ++di) {
      const auto& dt = dest.tensors[di];
      const std::size_t element = element_size(dt.spec.dtype);
      for (const auto& piece : dt.pieces) {
        if (piece.from.empty()) continue;
        const std::uint32_t si = index.at(piece.source);
        const auto& st = source.tensors[si];
        if (!grids[si]) grids[si] = grid_of(mesh, st);
        const auto& g = *grids[si];
        const std::size_t rank = st.spec.shape.size();
        // Per dim, the segments the piece's box touches (binary search by start).
        range.assign(rank, {0, 0});
        for (std::size_t d = 0; d < rank; ++d) {
          const auto& segs = g.dims[d];
          const auto lo = piece.from.offset[d], hi = lo + piece.from.extent[d];
          auto first = std::upper_bound(segs.begin(), segs.end(), lo,
                                        [](std::int64_t v, const segment& s) { return v < s.start + s.length; });
          auto last = std::lower_bound(first, segs.end(), hi, [](const segment& s, std::int64_t v) { return s.start < v; });
          range[d] = {static_cast<std::size_t>(first - segs.begin()), static_cast<std::size_t>(last - segs.begin())};
        }
        // Every combination of touched segments is one block held by the ranks
        // whose coordinates match it on the sharding mesh dims.
        pick.assign(rank, 0);
        for (std::size_t d = 0; d < rank; ++d) pick[d] = range[d].first;
        for (;;) {
          box block;
          block.offset.resize(rank);
          block.extent.resize(rank);
          std::int64_t fixed = 0;  // linear mesh index of the sharding coordinates
          for (std::size_t d = 0; d < rank; ++d) {
            const auto& s = g.dims[d][pick[d]];
            block.offset[d] = s.start;
            block.extent[d] = s.length;
            for (std::size_t k = 0; k < g.mesh_dims[d].size(); ++k) fixed += s.coords[k] * mesh_stride[g.mesh_dims[d][k]];
          }
          const box part = intersect(block, piece.from);
          if (!part.empty()) {
            // The holder with the least egress so far (lowest rank on ties).
            int holder = -1;
            std::vector<std::int64_t> free(g.free_dims.size(), 0);
            for (;;) {
              std::int64_t at = fixed;
              for (std::size_t k = 0; k < free.size(); ++k) at += free[k] * mesh_stride[g.free_dims[k]];
              const int r = mesh.rank_at(at);
              if (holder < 0 || plan.egress[r] < plan.egress[holder] ||
                  (plan.egress[r] == plan.egress[holder] && r < holder))
                holder = r;
              std::size_t k = free.size();
              bool done = true;
              while (k > 0) {
                --k;
                if (++free[k] < mesh.shape[g.free_dims[k]]) {
                  done = false;
                  break;
                }
                free[k] = 0;
              }
              if (done) break;
            }
            transfer_item item;
            item.source = si;
            item.dest = di;
            item.src.offset.resize(rank);
            item.src.extent = part.extent;
            item.dst_at.resize(rank);
            for (std::size_t d = 0; d < rank; ++d) {
              item.src.offset[d] = part.offset[d] - block.offset[d];
              item.dst_at[d] = piece.at[d] + (part.offset[d] - piece.from.offset[d]);
            }
            item.bytes = static_cast<std::uint64_t>(part.numel()) * element;
            auto& pp = plan.pairs[static_cast<std::size_t>(holder) * plan.workers + w];
            pp.bytes += item.bytes;
            plan.egress[holder] += item.bytes;
            plan.ingress[w] += item.bytes;
            pp.items.push_back(std::move(item));
          }
          // Next combination (the last dim fastest: row-major order of blocks).
          std::size_t d = rank;
          bool done = true;
          while (d > 0) {
            --d;
            if (++pick[d] < range[d].second) {
              done = false;
              break;
            }
            pick[d] = range[d].first;
          }
          if (done) break;
        }
      }
    }
  }
  return plan;
}

std::shared_ptr<const transfer_plan> plan_cache::get(const source_layout& source, std::span<const dest_layout> workers) {
  const auto digest = layout_digest(source, workers);
  {
    std::lock_guard lock(mutex_);
    if (last_ && last_->digest == digest) return last_;
  }
  auto plan = std::make_shared<const transfer_plan>(plan_transfer(source, workers));
  std::lock_guard lock(mutex_);
  last_ = plan;
  ++computed_;
  return plan;
}

}  // namespace refit
