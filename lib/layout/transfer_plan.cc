#include <refit/layout/transfer_plan.h>

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

// One block of a tensor dim: the nested torch.chunk cut its shard placements make
// (mesh-dim order), and what its coordinates add to the linear mesh index.
struct segment {
  std::int64_t start = 0, length = 0;
  std::int64_t mesh_index = 0;  // sum of coordinate x stride over the mesh dims sharding this dim
};

// How one tensor dim is cut, computed on demand (never materialised: a dim cut
// over a 512-rank mesh is 512 blocks per tensor, times 100k tensors).
struct dim_cut {
  std::int64_t n = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> levels;  // (parts, mesh stride) per sharding mesh dim

  // The non-empty block that holds position x (0 <= x < n).
  segment at(std::int64_t x) const {
    segment s{0, n, 0};
    for (const auto& [parts, stride] : levels) {
      const std::int64_t size = (s.length + parts - 1) / parts;  // torch.chunk
      const std::int64_t c = (x - s.start) / size;
      const std::int64_t start = s.start + c * size;
      s.length = std::min(s.start + s.length, start + size) - start;
      s.start = start;
      s.mesh_index += c * stride;
    }
    return s;
  }
};

// Past this many holders of a replicated block, the next holder in turn (per block
// position) is taken instead of the least loaded: a scan of every holder per block
// would cost most of a large plan.
constexpr std::int64_t max_scanned_holders = 16;

struct tensor_grid {
  std::vector<dim_cut> dims;               // per tensor dim
  std::vector<std::size_t> free_dims;      // mesh dims that replicate it
  std::int64_t holders = 1;                // ranks holding each block (the replicating dims' product)
  std::vector<std::int64_t> free_offsets;  // their linear mesh offsets (when few enough to scan)
};

tensor_grid grid_of(const device_mesh& mesh, const placed_tensor& t, std::span<const std::int64_t> mesh_stride) {
  tensor_grid g;
  g.dims.resize(t.spec.shape.size());
  for (std::size_t d = 0; d < t.spec.shape.size(); ++d) g.dims[d].n = t.spec.shape[d];
  for (std::size_t i = 0; i < t.placements.size(); ++i) {
    const auto& p = t.placements[i];
    if (p.is_shard())
      g.dims[p.dim].levels.emplace_back(mesh.shape[i], mesh_stride[i]);
    else
      g.free_dims.push_back(i);
  }
  for (auto f : g.free_dims) g.holders *= mesh.shape[f];
  if (g.holders <= max_scanned_holders) {
    g.free_offsets.assign(1, 0);
    for (auto f : g.free_dims) {
      std::vector<std::int64_t> next;
      for (auto o : g.free_offsets)
        for (std::int64_t c = 0; c < mesh.shape[f]; ++c) next.push_back(o + c * mesh_stride[f]);
      g.free_offsets = std::move(next);
    }
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
    for (const auto& p : t.placements)
      h.u64((static_cast<std::uint64_t>(p.type) << 32) | static_cast<std::uint32_t>(p.dim));
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
  validate(workers, source);

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
  const auto& mesh = source.mesh;
  std::vector<std::int64_t> mesh_stride(mesh.shape.size(), 1);
  for (std::size_t i = mesh.shape.size(); i-- > 1;) mesh_stride[i - 1] = mesh_stride[i] * mesh.shape[i];
  // Grids on first use: a tensor no worker wants costs nothing.
  std::vector<std::optional<tensor_grid>> grids(source.tensors.size());

  std::uint64_t items = 0;
  std::unordered_map<std::int64_t, std::uint64_t> turns;  // per sharding coordinate
  std::vector<std::size_t> pick;                          // per tensor dim: the block chosen
  std::vector<std::vector<segment>> touched;              // per tensor dim: the blocks the piece touches
  box block, part;                                        // reused: no allocation per block
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const auto& dest = workers[w];
    for (std::uint32_t di = 0; di < dest.tensors.size(); ++di) {
      const auto& dt = dest.tensors[di];
      const std::size_t element = element_size(dt.spec.dtype);
      for (const auto& piece : dt.pieces) {
        if (piece.from.empty()) continue;
        const std::uint32_t si = index.at(piece.source);
        const auto& st = source.tensors[si];
        if (!grids[si]) grids[si] = grid_of(mesh, st, mesh_stride);
        const auto& g = *grids[si];
        const std::size_t rank = st.spec.shape.size();
        // Per dim, the blocks the piece's box touches, walked from its first byte.
        touched.resize(rank);
        std::uint64_t combos = 1;
        for (std::size_t d = 0; d < rank; ++d) {
          touched[d].clear();
          const auto lo = piece.from.offset[d], hi = lo + piece.from.extent[d];
          for (std::int64_t x = lo; x < hi;) {
            touched[d].push_back(g.dims[d].at(x));
            x = touched[d].back().start + touched[d].back().length;
            if (touched[d].size() > max_plan_items)
              throw_error(errc::invalid_argument, "transfer plan: tensor '" + st.spec.name +
                                                      "' is cut into more than " + std::to_string(max_plan_items) +
                                                      " blocks");
          }
          combos *= touched[d].size();
          if (items + combos > max_plan_items)
            throw_error(errc::invalid_argument, "transfer plan: more than " + std::to_string(max_plan_items) +
                                                    " boxes (the layouts cut the model into too many pieces; worker " +
                                                    std::to_string(w) + ", tensor '" + dt.spec.name + "')");
        }
        // Every combination of touched blocks is one box, held by the ranks whose
        // coordinates match it on the sharding mesh dims.
        pick.assign(rank, 0);
        block.offset.resize(rank);
        block.extent.resize(rank);
        part.offset.resize(rank);
        part.extent.resize(rank);
        for (;;) {
          std::int64_t fixed = 0;  // linear mesh index of the sharding coordinates
          for (std::size_t d = 0; d < rank; ++d) {
            const auto& sg = touched[d][pick[d]];
            block.offset[d] = sg.start;
            block.extent[d] = sg.length;
            fixed += sg.mesh_index;
          }
          bool empty = false;
          for (std::size_t d = 0; d < rank; ++d) {
            const auto lo = std::max(block.offset[d], piece.from.offset[d]);
            const auto hi = std::min(block.offset[d] + block.extent[d], piece.from.offset[d] + piece.from.extent[d]);
            part.offset[d] = lo;
            part.extent[d] = std::max<std::int64_t>(0, hi - lo);
            empty |= part.extent[d] == 0;
          }
          if (!empty) {
            // The holder with the least egress so far (lowest rank on ties); past
            // max_scanned_holders candidates, the next in turn (still deterministic).
            int holder = -1;
            if (g.holders > max_scanned_holders) {
              // (the offsets of the turn's coordinates on the replicating dims)
              // Each block position rotates through its own holders, so equal blocks
              // spread evenly (a shared counter would align with the block pattern).
              std::int64_t turn = static_cast<std::int64_t>(turns[fixed]++ % static_cast<std::uint64_t>(g.holders));
              std::int64_t at = fixed;
              for (std::size_t k = g.free_dims.size(); k-- > 0;) {
                at += (turn % mesh.shape[g.free_dims[k]]) * mesh_stride[g.free_dims[k]];
                turn /= mesh.shape[g.free_dims[k]];
              }
              holder = mesh.rank_at(at);
            } else {
              for (const std::int64_t off : g.free_offsets) {
                const int r = mesh.rank_at(fixed + off);
                if (holder < 0 || plan.egress[r] < plan.egress[holder] ||
                    (plan.egress[r] == plan.egress[holder] && r < holder))
                  holder = r;
              }
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
            ++items;
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
            if (++pick[d] < touched[d].size()) {
              done = false;
              break;
            }
            pick[d] = 0;
          }
          if (done) break;
        }
      }
    }
  }
  return plan;
}

std::shared_ptr<const transfer_plan> plan_cache::get(const source_layout& source,
                                                     std::span<const dest_layout> workers) {
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
