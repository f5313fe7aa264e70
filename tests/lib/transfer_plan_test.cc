// Tests of lib/layout/transfer_plan.h: the plan of a sharded transfer is checked by
// simulating it in memory (every rank's local shards serialised item by item,
// scattered into every worker's destination tensors) against the reference
// slicing of the global tensors, over many random layouts; plus the balancing of
// replicated sources, vLLM's preset, determinism, the digest and the cache.
#include <refit/layout/transfer_plan.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <refit/adapters/vllm.h>
#include <refit/error.h>
#include <refit/layout/layout.h>

#include "tests/lib/expect.h"

namespace refit {

void PrintTo(const box& b, std::ostream* os) { *os << b.to_string(); }

namespace {

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;
using ::testing::HasSubstr;
using shape_t = std::vector<std::int64_t>;

tensor_spec spec(std::string name, shape_t shape, dtype type = dtype::float32) {
  return {std::move(name), type, std::move(shape)};
}

box make_box(shape_t offset, shape_t extent) { return {std::move(offset), std::move(extent)}; }

std::int64_t numel_of(const shape_t& shape) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

// Calls f(idx) for every index of `extent` in row-major order (once for rank 0).
void for_each_index(const shape_t& extent, const std::function<void(const shape_t&)>& f) {
  for (auto e : extent)
    if (e <= 0) return;
  shape_t idx(extent.size(), 0);
  for (;;) {
    f(idx);
    std::size_t d = extent.size();
    for (;;) {
      if (d == 0) return;
      --d;
      if (++idx[d] < extent[d]) break;
      idx[d] = 0;
    }
  }
}

std::int64_t linear(const shape_t& shape, const shape_t& idx) {
  std::int64_t l = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) l = l * shape[d] + idx[d];
  return l;
}

// Element-by-element copy of box `from` of src to `at` of dst.
void naive_copy(const std::byte* src, const shape_t& src_shape, const box& from, std::byte* dst,
                const shape_t& dst_shape, const shape_t& at, std::size_t element) {
  for_each_index(from.extent, [&](const shape_t& i) {
    shape_t s(i.size()), d(i.size());
    for (std::size_t k = 0; k < i.size(); ++k) s[k] = from.offset[k] + i[k], d[k] = at[k] + i[k];
    std::memcpy(dst + linear(dst_shape, d) * element, src + linear(src_shape, s) * element, element);
  });
}

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  for (auto& b : v) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    b = static_cast<std::byte>((x * 0x2545f4914f6cdd1dULL) >> 56);
  }
  return v;
}

bool inside(const box& b, const shape_t& shape) {
  if (b.offset.size() != shape.size() || b.extent.size() != shape.size()) return false;
  for (std::size_t d = 0; d < shape.size(); ++d)
    if (b.offset[d] < 0 || b.extent[d] < 0 || b.offset[d] + b.extent[d] > shape[d]) return false;
  return true;
}

constexpr std::byte sentinel{0xa5};

// Simulates `plan` in memory and checks it against the reference slicing of the
// global tensors: (a) every covered destination byte equals the reference, (b) it
// was written exactly once, (c) padding is never written, (d) byte counts add up,
// (e) every item's box lies in its rank's local shard.
AssertionResult check_plan(const source_layout& source, const std::vector<dest_layout>& workers,
                           const transfer_plan& plan, std::uint64_t seed = 1) {
  const auto S = source.tensors.size();
  const int R = source.ranks(), W = static_cast<int>(workers.size());
  if (plan.ranks != R || plan.workers != W || plan.pairs.size() != static_cast<std::size_t>(R) * W ||
      plan.egress.size() != static_cast<std::size_t>(R) || plan.ingress.size() != static_cast<std::size_t>(W))
    return AssertionFailure() << "plan dimensions: " << plan.ranks << " ranks, " << plan.workers << " workers";
  if (plan.digest != layout_digest(source, workers)) return AssertionFailure() << "digest is not layout_digest";
  // Global tensors and every rank's local shards.
  std::vector<std::vector<std::byte>> global(S);
  for (std::size_t t = 0; t < S; ++t) global[t] = pattern(source.tensors[t].spec.nbytes(), seed * 1000003 + t);
  std::vector<std::vector<box>> local_box(R, std::vector<box>(S));
  std::vector<std::vector<std::vector<std::byte>>> local(R, std::vector<std::vector<std::byte>>(S));
  for (int r = 0; r < R; ++r)
    for (std::size_t t = 0; t < S; ++t) {
      const auto& st = source.tensors[t].spec;
      const auto element = element_size(st.dtype);
      const box lb = source.local_box(t, r);
      local_box[r][t] = lb;
      local[r][t].assign(numel_of(lb.extent) * element, std::byte{0});
      naive_copy(global[t].data(), st.shape, lb, local[r][t].data(), lb.extent, shape_t(lb.extent.size(), 0), element);
    }
  // Destination buffers and write counts.
  std::vector<std::vector<std::vector<std::byte>>> got(W);
  std::vector<std::vector<std::vector<std::uint8_t>>> writes(W);
  for (int w = 0; w < W; ++w)
    for (const auto& t : workers[w].tensors) {
      got[w].emplace_back(t.spec.nbytes(), sentinel);
      writes[w].emplace_back(t.spec.nbytes(), 0);
    }
  std::vector<std::uint64_t> egress(R, 0), ingress(W, 0);
  std::uint64_t total = 0;
  std::vector<std::byte> stream;
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) {
      const auto& pp = plan.pair(r, w);
      std::uint64_t pair_bytes = 0;
      for (std::size_t k = 0; k < pp.items.size(); ++k) {
        const auto& it = pp.items[k];
        auto where = [&] {
          return "rank " + std::to_string(r) + " -> worker " + std::to_string(w) + " item " + std::to_string(k) + ": ";
        };
        if (it.source >= S) return AssertionFailure() << where() << "source " << it.source;
        if (it.dest >= workers[w].tensors.size()) return AssertionFailure() << where() << "dest " << it.dest;
        const auto& st = source.tensors[it.source].spec;
        const auto& dt = workers[w].tensors[it.dest].spec;
        if (st.dtype != dt.dtype) return AssertionFailure() << where() << "dtypes differ";
        const auto element = element_size(st.dtype);
        // (e) the box lies in this rank's shard.
        const box& lb = local_box[r][it.source];
        if (!inside(it.src, lb.extent))
          return AssertionFailure() << where() << "box " << it.src.to_string() << " of '" << st.name
                                    << "' is not inside rank " << r << "'s shard " << lb.to_string();
        if (it.src.empty()) return AssertionFailure() << where() << "an empty item";
        if (it.bytes != static_cast<std::uint64_t>(it.src.numel()) * element)
          return AssertionFailure() << where() << "bytes " << it.bytes << " for box " << it.src.to_string();
        const box to{it.dst_at, it.src.extent};
        if (!inside(to, dt.shape))
          return AssertionFailure() << where() << "destination box " << to.to_string() << " outside '" << dt.name
                                    << "' " << shape_to_string(dt.shape);
        // Serialise from the local shard, scatter into the destination.
        stream.clear();
        const auto& src = local[r][it.source];
        for_each_run(lb.extent, it.src, element, [&](std::uint64_t o, std::uint64_t n) {
          stream.insert(stream.end(), src.begin() + o, src.begin() + o + n);
        });
        if (stream.size() != it.bytes)
          return AssertionFailure() << where() << "stream of " << stream.size() << " bytes";
        std::size_t used = 0;
        auto& dst = got[w][it.dest];
        auto& cnt = writes[w][it.dest];
        for_each_run(dt.shape, to, element, [&](std::uint64_t o, std::uint64_t n) {
          std::memcpy(dst.data() + o, stream.data() + used, n);
          for (std::uint64_t i = 0; i < n; ++i) ++cnt[o + i];
          used += n;
        });
        if (used != stream.size()) return AssertionFailure() << where() << "scattered " << used << " bytes";
        pair_bytes += it.bytes;
      }
      // (d)
      if (pair_bytes != pp.bytes)
        return AssertionFailure() << "pair " << r << " -> " << w << ": items sum to " << pair_bytes << ", pair says "
                                  << pp.bytes;
      egress[r] += pp.bytes;
      ingress[w] += pp.bytes;
      total += pp.bytes;
    }
  if (egress != plan.egress) return AssertionFailure() << "egress does not sum the pairs";
  if (ingress != plan.ingress) return AssertionFailure() << "ingress does not sum the pairs";
  if (total != plan.total_bytes()) return AssertionFailure() << "total_bytes " << plan.total_bytes() << " vs " << total;
  // The reference: pieces copied from the global tensors; coverage by a naive loop.
  for (int w = 0; w < W; ++w) {
    std::uint64_t covered_bytes = 0;
    for (std::size_t di = 0; di < workers[w].tensors.size(); ++di) {
      const auto& dt = workers[w].tensors[di];
      const auto element = element_size(dt.spec.dtype);
      std::vector<std::byte> want(dt.spec.nbytes(), sentinel);
      std::vector<char> covered(want.size(), 0);
      for (const auto& p : dt.pieces) {
        std::size_t si = S;
        for (std::size_t t = 0; t < S; ++t)
          if (source.tensors[t].spec.name == p.source) si = t;
        if (si == S) return AssertionFailure() << "test bug: unknown source " << p.source;
        copy_box(global[si].data(), source.tensors[si].spec.shape, p.from, want.data(), dt.spec.shape, p.at, element);
        for_each_index(p.from.extent, [&](const shape_t& i) {
          shape_t g(i.size());
          for (std::size_t k = 0; k < i.size(); ++k) g[k] = p.at[k] + i[k];
          for (std::size_t e = 0; e < element; ++e) covered[linear(dt.spec.shape, g) * element + e] = 1;
        });
      }
      for (std::size_t b = 0; b < want.size(); ++b) {
        const auto c = writes[w][di][b];
        if (covered[b]) {
          ++covered_bytes;
          if (c != 1)  // (b)
            return AssertionFailure() << "worker " << w << " '" << dt.spec.name << "' byte " << b << " written "
                                      << int(c) << " times";
          if (got[w][di][b] != want[b])  // (a)
            return AssertionFailure() << "worker " << w << " '" << dt.spec.name << "' byte " << b << " differs";
        } else if (c != 0 || got[w][di][b] != sentinel) {  // (c)
          return AssertionFailure() << "worker " << w << " '" << dt.spec.name << "' padding byte " << b << " written";
        }
      }
    }
    if (covered_bytes != plan.ingress[w])
      return AssertionFailure() << "worker " << w << " ingress " << plan.ingress[w] << ", pieces cover "
                                << covered_bytes;
  }
  return AssertionSuccess();
}

// ---------------------------------------------------------------- random layouts

update_metadata meta_of(std::vector<tensor_spec> t) { return {std::move(t)}; }

dest_layout whole_tensors(const update_metadata& meta) {
  dest_layout d;
  for (const auto& t : meta.tensors) d.tensors.push_back({t, {{t.name, whole(t.shape), shape_t(t.shape.size(), 0)}}});
  return d;
}

struct generator {
  std::mt19937_64 rng;
  explicit generator(std::uint64_t seed) : rng(seed) {}
  std::int64_t pick(std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  }
  bool chance(int percent) { return pick(0, 99) < percent; }

  source_layout source() {
    source_layout l;
    l.mesh.shape.clear();
    if (chance(50)) {
      l.mesh.shape = {pick(1, 4)};
    } else {
      l.mesh.shape = {pick(1, 3), pick(1, 3)};
    }
    if (chance(30)) {
      l.mesh.ranks.resize(l.mesh.size());
      for (int i = 0; i < l.mesh.size(); ++i) l.mesh.ranks[i] = i;
      std::shuffle(l.mesh.ranks.begin(), l.mesh.ranks.end(), rng);
    }
    const int n = static_cast<int>(pick(1, 6));
    static constexpr dtype types[] = {dtype::float32, dtype::bfloat16, dtype::int64, dtype::float32, dtype::uint8};
    for (int i = 0; i < n; ++i) {
      shape_t shape;
      const int rank = chance(8) ? 0 : static_cast<int>(pick(1, 3));
      for (int d = 0; d < rank; ++d) shape.push_back(chance(4) ? 0 : pick(1, 7));
      placed_tensor t{spec("t" + std::to_string(i), shape, types[pick(0, 4)]), {}};
      for (std::size_t m = 0; m < l.mesh.shape.size(); ++m)
        t.placements.push_back(rank == 0 || chance(35) ? placement::replicate()
                                                       : placement::shard(static_cast<int>(pick(0, rank - 1))));
      l.tensors.push_back(std::move(t));
    }
    l.validate();
    return l;
  }

  // Source tensors of this dtype and rank.
  std::vector<const tensor_spec*> like(const source_layout& s, dtype type, std::size_t rank) {
    std::vector<const tensor_spec*> out;
    for (const auto& t : s.tensors)
      if (t.spec.dtype == type && t.spec.shape.size() == rank) out.push_back(&t.spec);
    return out;
  }

  // Random disjoint boxes of sources of one dtype and rank, placed anywhere.
  dest_tensor scattered(const source_layout& s, const tensor_spec& seed, std::string name) {
    const auto rank = seed.shape.size();
    dest_tensor d{spec(std::move(name), {}, seed.dtype), {}};
    for (std::size_t k = 0; k < rank; ++k) d.spec.shape.push_back(pick(1, 9));
    std::vector<char> covered(numel_of(d.spec.shape), 0);
    const auto candidates = like(s, seed.dtype, rank);
    const int attempts = static_cast<int>(pick(1, 8));
    for (int a = 0; a < attempts; ++a) {
      const auto& src = *candidates[pick(0, static_cast<std::int64_t>(candidates.size()) - 1)];
      dest_piece p{src.name, {}, {}};
      for (std::size_t k = 0; k < rank; ++k) {
        const auto limit = std::min(src.shape[k], d.spec.shape[k]);
        const auto e = chance(10) ? 0 : pick(std::min<std::int64_t>(1, limit), limit);
        p.from.offset.push_back(pick(0, src.shape[k] - e));
        p.from.extent.push_back(e);
        p.at.push_back(pick(0, d.spec.shape[k] - e));
      }
      bool clash = false;
      for_each_index(p.from.extent, [&](const shape_t& i) {
        shape_t g(i.size());
        for (std::size_t k = 0; k < i.size(); ++k) g[k] = p.at[k] + i[k];
        if (covered[linear(d.spec.shape, g)]) clash = true;
      });
      if (clash) continue;
      for_each_index(p.from.extent, [&](const shape_t& i) {
        shape_t g(i.size());
        for (std::size_t k = 0; k < i.size(); ++k) g[k] = p.at[k] + i[k];
        covered[linear(d.spec.shape, g)] = 1;
      });
      d.pieces.push_back(std::move(p));
    }
    return d;
  }

  // Fused: row ranges of a few sources (their shards, as under tensor
  // parallelism) stacked along dim 0, with padding rows between and columns after.
  dest_tensor stacked(const source_layout& s, const tensor_spec& seed, std::string name) {
    const auto rank = seed.shape.size();
    auto candidates = like(s, seed.dtype, rank);
    std::erase_if(candidates, [](const tensor_spec* t) { return numel_of(t->shape) == 0; });
    dest_tensor d{spec(std::move(name), {}, seed.dtype), {}};
    if (candidates.empty()) {
      d.spec.shape.assign(rank, 2);
      return d;
    }
    std::vector<const tensor_spec*> parts;
    const int k = static_cast<int>(pick(1, 3));
    for (int i = 0; i < k; ++i) parts.push_back(candidates[pick(0, static_cast<std::int64_t>(candidates.size()) - 1)]);
    shape_t tail(rank, 0), tail_at(rank, 0);
    d.spec.shape.assign(rank, 0);
    for (std::size_t dim = 1; dim < rank; ++dim) {
      std::int64_t m = parts[0]->shape[dim];
      for (const auto* p : parts) m = std::min(m, p->shape[dim]);
      tail[dim] = pick(1, m);
      d.spec.shape[dim] = tail[dim] + pick(0, 2);
      tail_at[dim] = pick(0, d.spec.shape[dim] - tail[dim]);
    }
    std::int64_t row = 0;
    for (const auto* p : parts) {
      row += chance(30) ? pick(1, 2) : 0;  // padding rows
      // A tensor-parallel shard of the component's rows.
      const auto tp = pick(1, 3), r = pick(0, tp - 1);
      const auto c = torch_chunk(p->shape[0], tp, r);
      dest_piece piece{p->name, {}, {}};
      piece.from.offset.push_back(c.start);
      piece.from.extent.push_back(c.length);
      piece.at.push_back(row);
      for (std::size_t dim = 1; dim < rank; ++dim) {
        piece.from.offset.push_back(pick(0, p->shape[dim] - tail[dim]));
        piece.from.extent.push_back(tail[dim]);
        piece.at.push_back(tail_at[dim]);
      }
      row += c.length;
      d.pieces.push_back(std::move(piece));
    }
    d.spec.shape[0] = row + pick(0, 2);
    return d;
  }

  dest_layout dest(const source_layout& s) {
    dest_layout l;
    const int n = static_cast<int>(pick(1, 5));
    for (int i = 0; i < n; ++i) {
      const auto& seed = s.tensors[pick(0, static_cast<std::int64_t>(s.tensors.size()) - 1)].spec;
      std::string name = "d" + std::to_string(i);
      if (seed.shape.empty()) {
        dest_tensor d{spec(std::move(name), {}, seed.dtype), {}};
        if (chance(70)) d.pieces.push_back({seed.name, box{}, {}});
        l.tensors.push_back(std::move(d));
      } else if (chance(40)) {
        l.tensors.push_back(stacked(s, seed, std::move(name)));
      } else {
        l.tensors.push_back(scattered(s, seed, std::move(name)));
      }
    }
    return l;
  }
};

TEST(plan_transfer, property_random_layouts_simulate_exactly) {
  generator g(0x5eed);
  int items = 0, replicated_items = 0, padded = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const auto source = g.source();
    std::vector<dest_layout> workers;
    const int W = static_cast<int>(g.pick(1, 4));
    for (int w = 0; w < W; ++w) workers.push_back(g.dest(source));
    if (g.chance(15)) workers.assign(W, workers[0]);  // every worker the same (replicated to all)
    for (std::size_t w = 0; w < workers.size(); ++w) ASSERT_NO_THROW(validate(workers[w], source, w)) << iter;
    const auto plan = plan_transfer(source, workers);
    ASSERT_TRUE(check_plan(source, workers, plan, iter)) << "iteration " << iter;
    for (const auto& pp : plan.pairs) {
      items += static_cast<int>(pp.items.size());
      for (const auto& it : pp.items)
        for (const auto& p : source.tensors[it.source].placements)
          if (!p.is_shard()) ++replicated_items;
    }
    for (const auto& w : workers)
      for (const auto& t : w.tensors) {
        std::int64_t c = 0;
        for (const auto& p : t.pieces) c += p.from.numel();
        if (c < numel_of(t.spec.shape)) ++padded;
      }
  }
  // The generator exercised what it should.
  EXPECT_GT(items, 8000);
  EXPECT_GT(replicated_items, 1000);
  EXPECT_GT(padded, 1000);
}

// The simulation itself catches wrong plans (so the property above can fail).
TEST(plan_transfer, simulation_refuses_corrupted_plans) {
  const auto meta = meta_of({spec("w", {6, 4}), spec("v", {5}, dtype::bfloat16)});
  const auto source = source_layout::uniform(meta, device_mesh{{2}, {}}, {placement::shard(0)});
  dest_layout d;
  d.tensors.push_back(
      {spec("fused", {12, 4}), {{"w", make_box({1, 0}, {4, 4}), {0, 0}}, {"w", make_box({0, 1}, {6, 2}), {5, 2}}}});
  d.tensors.push_back({spec("v", {8}, dtype::bfloat16), {{"v", make_box({0}, {5}), {2}}}});
  const std::vector<dest_layout> workers{d, d};
  const auto good = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, good));
  auto first = [](transfer_plan& p) -> transfer_item& {
    for (auto& pp : p.pairs)
      if (!pp.items.empty()) return pp.items[0];
    throw std::logic_error("no items");
  };
  std::vector<std::pair<const char*, std::function<void(transfer_plan&)>>> corruptions = {
      {"dst_at shifted", [&](transfer_plan& p) { first(p).dst_at[0] += 1; }},
      {"src shifted", [&](transfer_plan& p) { first(p).src.offset[1] += 1, first(p).src.extent[1] -= 1; }},
      {"item dropped",
       [](transfer_plan& p) {
         for (std::size_t i = 0; i < p.pairs.size(); ++i) {
           auto& pp = p.pairs[i];
           if (pp.items.empty()) continue;
           const auto b = pp.items.back().bytes;
           pp.bytes -= b, p.egress[i / p.workers] -= b, p.ingress[i % p.workers] -= b;
           pp.items.pop_back();
           return;
         }
       }},
      {"item duplicated",
       [](transfer_plan& p) {
         auto& pp = p.pairs[0];
         pp.items.push_back(pp.items[0]);
         pp.bytes += pp.items[0].bytes;
         p.egress[0] += pp.items[0].bytes;
         p.ingress[0] += pp.items[0].bytes;
       }},
      {"item sent by the wrong rank",
       [](transfer_plan& p) {
         // Rank 0's first item to worker 0 moved to rank 1 (which holds other rows).
         auto it = p.pairs[0].items[0];
         p.pairs[0].items.erase(p.pairs[0].items.begin());
         p.pairs[0].bytes -= it.bytes, p.egress[0] -= it.bytes;
         p.pairs[p.workers].items.push_back(it);
         p.pairs[p.workers].bytes += it.bytes, p.egress[1] += it.bytes;
       }},
      {"wrong destination tensor", [&](transfer_plan& p) { first(p).dest ^= 1; }},
      {"ingress off", [](transfer_plan& p) { p.ingress[1] += 1; }},
      {"digest off", [](transfer_plan& p) { p.digest ^= 1; }},
  };
  for (auto& [what, corrupt] : corruptions) {
    auto bad = good;
    corrupt(bad);
    EXPECT_FALSE(check_plan(source, workers, bad)) << what;
  }
}

// ---------------------------------------------------------------- balancing

TEST(plan_transfer, replicated_sources_spread_over_their_holders) {
  const auto meta = meta_of({spec("a", {16}), spec("b", {16}), spec("c", {16}), spec("d", {16})});
  const auto source = source_layout::uniform(meta, device_mesh{{4}, {}}, {placement::replicate()});
  const std::vector<dest_layout> workers{whole_tensors(meta)};
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(plan.egress[r], 64u) << "rank " << r;
    EXPECT_EQ(plan.pair(r, 0).items.size(), 1u) << "rank " << r;
  }
  EXPECT_EQ(plan.ingress[0], 256u);
  // Eight tensors: two each.
  update_metadata eight;
  for (int i = 0; i < 8; ++i) eight.tensors.push_back(spec("t" + std::to_string(i), {4, 4}, dtype::bfloat16));
  const auto s8 = source_layout::uniform(eight, device_mesh{{4}, {}}, {placement::replicate()});
  const std::vector<dest_layout> w8{whole_tensors(eight), whole_tensors(eight)};
  const auto p8 = plan_transfer(s8, w8);
  ASSERT_TRUE(check_plan(s8, w8, p8));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p8.egress[r], 2u * 2 * 32) << "rank " << r;
}

TEST(plan_transfer, widely_replicated_sources_take_holders_in_turn) {
  // Past 1024 holders the planner takes the next holder in turn instead of
  // scanning them all: still every byte once, spread over the ranks.
  update_metadata meta;
  for (int i = 0; i < 8; ++i) meta.tensors.push_back(spec("t" + std::to_string(i), {4}));
  const auto source = source_layout::uniform(meta, device_mesh{{2048}, {}}, {placement::replicate()});
  const std::vector<dest_layout> workers{whole_tensors(meta), whole_tensors(meta)};
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  int senders = 0;
  for (int r = 0; r < plan.ranks; ++r) {
    EXPECT_LE(plan.egress[r], 16u) << "rank " << r << " sent more than one tensor";
    senders += plan.egress[r] > 0;
  }
  EXPECT_EQ(senders, 16);
  // A 2 x 1024 mesh replicating on both dims (2048 holders), ranks permuted.
  device_mesh permuted{{2, 1024}, {}};
  for (int i = 0; i < 2048; ++i) permuted.ranks.push_back(2047 - i);
  const auto s2 = source_layout::uniform(meta, permuted, {placement::replicate(), placement::replicate()});
  const auto p2 = plan_transfer(s2, workers);
  ASSERT_TRUE(check_plan(s2, workers, p2));
}

TEST(plan_transfer, hsdp_blocks_spread_over_replicas) {
  // Mesh {2, 2}: Shard(0) on mesh dim 0, replicated on mesh dim 1. Each block has
  // two holders; two tensors to one worker use all four ranks equally.
  const auto meta = meta_of({spec("a", {4}), spec("b", {4})});
  const auto source =
      source_layout::uniform(meta, device_mesh{{2, 2}, {}}, {placement::shard(0), placement::replicate()});
  const std::vector<dest_layout> workers{whole_tensors(meta)};
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(plan.egress[r], 8u) << "rank " << r;
  // And with the other mesh dim sharding.
  const auto s2 =
      source_layout::uniform(meta, device_mesh{{2, 2}, {2, 3, 0, 1}}, {placement::replicate(), placement::shard(0)});
  const auto p2 = plan_transfer(s2, workers);
  ASSERT_TRUE(check_plan(s2, workers, p2));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p2.egress[r], 8u) << "rank " << r;
}

// ---------------------------------------------------------------- vLLM's preset

update_metadata llama(std::int64_t vocab, std::int64_t hidden, std::int64_t q, std::int64_t kv, std::int64_t inter,
                      int layers) {
  update_metadata m;
  auto add = [&](std::string name, shape_t shape) {
    m.tensors.push_back({std::move(name), dtype::bfloat16, std::move(shape)});
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {hidden});
    add(p + "self_attn.q_proj.weight", {q, hidden});
    add(p + "self_attn.k_proj.weight", {kv, hidden});
    add(p + "self_attn.v_proj.weight", {kv, hidden});
    add(p + "self_attn.o_proj.weight", {hidden, q});
    add(p + "post_attention_layernorm.weight", {hidden});
    add(p + "mlp.gate_proj.weight", {inter, hidden});
    add(p + "mlp.up_proj.weight", {inter, hidden});
    add(p + "mlp.down_proj.weight", {hidden, inter});
  }
  add("model.norm.weight", {hidden});
  add("lm_head.weight", {vocab, hidden});
  return m;
}

std::vector<dest_layout> tp_workers(const update_metadata& global, int tp) {
  std::vector<dest_layout> out;
  for (int r = 0; r < tp; ++r) out.push_back(tensor_parallel_layout(global, tp, r, vllm_llama_layout()));
  return out;
}

TEST(plan_transfer, vllm_llama_fsdp2_tp2_sends_each_worker_its_tensors_minus_padding) {
  const std::int64_t vocab = 100, h = 8;
  const auto global = llama(vocab, h, 8, 4, 12, 2);
  const auto source = source_layout::uniform(global, device_mesh{{2}, {}}, {placement::shard(0)});
  const auto workers = tp_workers(global, 2);
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  for (int w = 0; w < 2; ++w) {
    std::uint64_t local = 0;
    for (const auto& t : workers[w].tensors) local += t.spec.nbytes();
    // 100 rows pad to 128, 64 a worker: worker 1's rows past 36 are padding in
    // both embed_tokens and lm_head.
    const std::uint64_t padding = w == 0 ? 0 : 2 * (64 - 36) * h * 2;
    EXPECT_EQ(plan.ingress[w], local - padding) << "worker " << w;
    std::uint64_t pairs = 0;
    for (int r = 0; r < 2; ++r) pairs += plan.pair(r, w).bytes;
    EXPECT_EQ(pairs, plan.ingress[w]);
  }
  // Each trainer rank sends exactly what it holds (nothing is replicated, every
  // byte goes to exactly one worker apart from the norms, which go to both).
  const std::uint64_t norms = 5 * h * 2;
  for (int r = 0; r < 2; ++r) {
    std::uint64_t held = 0, held_norms = 0;
    const auto meta = source.local_metadata(r);
    for (const auto& t : meta.tensors) {
      held += t.nbytes();
      if (t.name.find("norm") != std::string::npos) held_norms += t.nbytes();
    }
    EXPECT_EQ(plan.egress[r], held + held_norms) << "rank " << r;
  }
  EXPECT_EQ(plan.total_bytes(), global.total_bytes() + norms);
}

TEST(plan_transfer, vllm_llama_single_rank_tp4_sends_a_quarter_to_each_worker) {
  const std::int64_t h = 8;
  const auto global = llama(256, h, 8, 4, 16, 2);
  const auto source = source_layout::single(global);
  const auto workers = tp_workers(global, 4);
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  const std::uint64_t total = global.total_bytes();
  const std::uint64_t norms = (2 * 2 + 1) * h * 2;  // replicated: every worker gets them whole
  for (int w = 0; w < 4; ++w) {
    EXPECT_EQ(plan.ingress[w], (total - norms) / 4 + norms) << "worker " << w;
    EXPECT_NEAR(static_cast<double>(plan.ingress[w]), total / 4.0, total * 0.05) << "worker " << w;
  }
  EXPECT_EQ(plan.egress[0], plan.total_bytes());
}

TEST(plan_transfer, vllm_llama_hsdp_and_2d_meshes_simulate_exactly) {
  const auto global = llama(100, 8, 8, 4, 12, 2);
  for (const auto& [mesh, placements] : std::vector<std::pair<device_mesh, std::vector<placement>>>{
           {device_mesh{{2, 2}, {}}, {placement::replicate(), placement::shard(0)}},
           {device_mesh{{2, 3}, {5, 4, 3, 2, 1, 0}}, {placement::shard(0), placement::shard(1)}},
           {device_mesh{{3, 2}, {}}, {placement::shard(0), placement::shard(0)}},
           {device_mesh{{8}, {}}, {placement::shard(1)}},
       }) {
    SCOPED_TRACE(shape_to_string(mesh.shape));
    // Placements that shard dim 1 leave the (1-D) norms replicated.
    source_layout source;
    source.mesh = mesh;
    for (const auto& t : global.tensors) {
      auto p = placements;
      for (auto& x : p)
        if (x.is_shard() && x.dim >= static_cast<int>(t.shape.size())) x = placement::replicate();
      source.tensors.push_back({t, std::move(p)});
    }
    for (int tp : {1, 2, 4}) {
      const auto workers = tp_workers(global, tp);
      const auto plan = plan_transfer(source, workers);
      ASSERT_TRUE(check_plan(source, workers, plan, tp)) << "tp " << tp;
    }
  }
}

// ---------------------------------------------------------------- determinism, digest

struct small_case {
  source_layout source;
  std::vector<dest_layout> workers;
};

small_case make_small_case() {
  const auto global = llama(100, 8, 8, 4, 12, 1);
  return {source_layout::uniform(global, device_mesh{{2}, {}}, {placement::shard(0)}), tp_workers(global, 2)};
}

bool same_items(const transfer_plan& a, const transfer_plan& b) {
  if (a.pairs.size() != b.pairs.size()) return false;
  for (std::size_t i = 0; i < a.pairs.size(); ++i) {
    const auto &x = a.pairs[i], &y = b.pairs[i];
    if (x.bytes != y.bytes || x.items.size() != y.items.size()) return false;
    for (std::size_t k = 0; k < x.items.size(); ++k) {
      const auto &p = x.items[k], &q = y.items[k];
      if (p.source != q.source || p.dest != q.dest || p.src != q.src || p.dst_at != q.dst_at || p.bytes != q.bytes)
        return false;
    }
  }
  return a.egress == b.egress && a.ingress == b.ingress && a.digest == b.digest;
}

TEST(plan_transfer, deterministic) {
  const auto c = make_small_case();
  const auto a = plan_transfer(c.source, c.workers);
  const auto b = plan_transfer(c.source, c.workers);
  EXPECT_TRUE(same_items(a, b));
  const auto d = make_small_case();  // built afresh
  const auto e = plan_transfer(d.source, d.workers);
  EXPECT_TRUE(same_items(a, e));
  EXPECT_EQ(layout_digest(c.source, c.workers), a.digest);
  EXPECT_EQ(layout_digest(d.source, d.workers), a.digest);
  // Random layouts too.
  generator g1(99), g2(99);
  for (int i = 0; i < 50; ++i) {
    const auto s1 = g1.source(), s2 = g2.source();
    const std::vector<dest_layout> w1{g1.dest(s1), g1.dest(s1)}, w2{g2.dest(s2), g2.dest(s2)};
    EXPECT_TRUE(same_items(plan_transfer(s1, w1), plan_transfer(s2, w2))) << i;
  }
}

TEST(layout_digest, changes_with_every_input) {
  const auto base = make_small_case();
  const auto d0 = layout_digest(base.source, base.workers);
  std::vector<std::pair<std::string, std::function<void(small_case&)>>> changes = {
      {"source shape", [](small_case& c) { c.source.tensors[1].spec.shape[0] += 1; }},
      {"source dtype", [](small_case& c) { c.source.tensors[1].spec.dtype = dtype::float16; }},
      {"source name", [](small_case& c) { c.source.tensors[1].spec.name += "x"; }},
      {"placement kind", [](small_case& c) { c.source.tensors[0].placements[0] = placement::replicate(); }},
      {"placement dim", [](small_case& c) { c.source.tensors[0].placements[0] = placement::shard(1); }},
      {"mesh shape",
       [](small_case& c) {
         c.source.mesh.shape = {2, 1};
       }},
      {"mesh size", [](small_case& c) { c.source.mesh.shape = {4}; }},
      {"mesh ranks",
       [](small_case& c) {
         c.source.mesh.ranks = {1, 0};
       }},
      {"piece from offset", [](small_case& c) { c.workers[1].tensors[2].pieces[1].from.offset[0] += 1; }},
      {"piece from extent", [](small_case& c) { c.workers[1].tensors[2].pieces[1].from.extent[0] -= 1; }},
      {"piece at", [](small_case& c) { c.workers[0].tensors[2].pieces[2].at[0] += 1; }},
      {"piece source", [](small_case& c) { c.workers[0].tensors[2].pieces[2].source = "other"; }},
      {"piece dropped", [](small_case& c) { c.workers[0].tensors[2].pieces.pop_back(); }},
      {"dest name", [](small_case& c) { c.workers[1].tensors[0].spec.name = "renamed"; }},
      {"dest dtype", [](small_case& c) { c.workers[1].tensors[0].spec.dtype = dtype::float32; }},
      {"dest shape", [](small_case& c) { c.workers[1].tensors[0].spec.shape[0] += 1; }},
      {"dest order", [](small_case& c) { std::swap(c.workers[1].tensors[0], c.workers[1].tensors[1]); }},
      {"worker order", [](small_case& c) { std::swap(c.workers[0], c.workers[1]); }},
      {"more workers", [](small_case& c) { c.workers.push_back(c.workers[0]); }},
      {"fewer workers", [](small_case& c) { c.workers.pop_back(); }},
  };
  std::set<std::uint64_t> seen{d0};
  for (auto& [what, change] : changes) {
    auto c = make_small_case();
    change(c);
    const auto d = layout_digest(c.source, c.workers);
    EXPECT_NE(d, d0) << what;
    EXPECT_TRUE(seen.insert(d).second) << what << " collides with another change";
  }
  // The plan's digest is the layout digest.
  EXPECT_EQ(plan_transfer(base.source, base.workers).digest, d0);
}

// ---------------------------------------------------------------- plan cache

TEST(plan_cache, reuses_the_plan_while_the_layouts_are_unchanged) {
  plan_cache cache;
  EXPECT_EQ(cache.computed(), 0u);
  const auto c = make_small_case();
  const auto p1 = cache.get(c.source, c.workers);
  const auto p2 = cache.get(c.source, c.workers);
  EXPECT_EQ(cache.computed(), 1u);
  EXPECT_EQ(p1, p2) << "the same plan object";
  const auto fresh = make_small_case();  // equal layouts, other objects
  EXPECT_EQ(cache.get(fresh.source, fresh.workers), p1);
  EXPECT_EQ(cache.computed(), 1u);
  EXPECT_TRUE(same_items(*p1, plan_transfer(c.source, c.workers)));

  auto changed = make_small_case();
  changed.source.mesh.ranks = {1, 0};
  const auto p3 = cache.get(changed.source, changed.workers);
  EXPECT_EQ(cache.computed(), 2u);
  EXPECT_NE(p3->digest, p1->digest);
  EXPECT_TRUE(check_plan(changed.source, changed.workers, *p3));
  EXPECT_EQ(cache.get(changed.source, changed.workers), p3);
  EXPECT_EQ(cache.computed(), 2u);
  // Only the last plan is kept.
  const auto p4 = cache.get(c.source, c.workers);
  EXPECT_EQ(cache.computed(), 3u);
  EXPECT_EQ(p4->digest, p1->digest);
  // A failing plan is not cached.
  auto bad = make_small_case();
  bad.workers[0].tensors[0].pieces[0].source = "nope";
  EXPECT_EQ(REFIT_THROWN(cache.get(bad.source, bad.workers)).kind(), errc::invalid_argument);
  EXPECT_EQ(cache.get(c.source, c.workers), p4);
  EXPECT_EQ(cache.computed(), 3u);
}

// ---------------------------------------------------------------- errors, edge cases

TEST(plan_transfer, refuses_bad_layouts) {
  auto c = make_small_case();
  EXPECT_THAT(REFIT_THROWN(plan_transfer(c.source, std::span<const dest_layout>{})).message(), HasSubstr("no workers"));
  c.workers[1].tensors[0].spec.dtype = dtype::float32;
  auto e = REFIT_THROWN(plan_transfer(c.source, c.workers));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("worker 1"));
  c = make_small_case();
  c.source.tensors[0].placements = {placement::shard(5)};
  EXPECT_EQ(REFIT_THROWN(plan_transfer(c.source, c.workers)).kind(), errc::invalid_argument);
  c = make_small_case();
  c.source.mesh.ranks = {0, 0};
  EXPECT_EQ(REFIT_THROWN(plan_transfer(c.source, c.workers)).kind(), errc::invalid_argument);
}

TEST(plan_transfer, empty_shards_pieces_and_scalars) {
  // 3 rows over 4 ranks: rank 3 holds nothing; a scalar is replicated; an empty
  // piece and a worker with no tensors plan to nothing.
  const auto meta = meta_of({spec("w", {3, 2}), spec("s", {}, dtype::int64), spec("z", {0, 4})});
  const auto source = source_layout::uniform(meta, device_mesh{{4}, {}}, {placement::shard(0)});
  dest_layout d = whole_tensors(meta);
  d.tensors.push_back({spec("e", {2, 2}), {{"w", make_box({1, 0}, {0, 2}), {0, 0}}}});
  const std::vector<dest_layout> workers{d, dest_layout{}, d};
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  // Rank 3 holds no row of w but the (replicated) scalar: it sends both workers'
  // scalars, as the least loaded holder, and every rank sends 16 bytes.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(plan.egress[r], 16u) << "rank " << r;
  ASSERT_EQ(plan.pair(3, 0).items.size(), 1u);
  EXPECT_EQ(plan.pair(3, 0).items[0].source, 1u);
  EXPECT_EQ(plan.ingress[1], 0u);
  EXPECT_EQ(plan.ingress[0], 3u * 2 * 4 + 8);
  for (int r = 0; r < 4; ++r)
    for (const auto& it : plan.pair(r, 1).items)
      ADD_FAILURE() << "an item for the empty worker: " << it.src.to_string();
  // Local coordinates: rank 1's row is its row 0.
  ASSERT_FALSE(plan.pair(1, 0).items.empty());
  const auto& it = plan.pair(1, 0).items[0];
  EXPECT_EQ(it.src, make_box({0, 0}, {1, 2}));
  EXPECT_EQ(it.dst_at, (shape_t{1, 0}));
}

TEST(plan_transfer, piece_crossing_shards_is_cut_at_shard_boundaries) {
  // [10, 6] Shard(0) x Shard(1) over {2, 3} (rows 5|5, columns 2|2|2); a piece of
  // rows [3, 7) and columns [1, 5) crosses 2 x 3 blocks.
  const auto meta = meta_of({spec("w", {10, 6})});
  const auto source = source_layout::uniform(meta, device_mesh{{2, 3}, {}}, {placement::shard(0), placement::shard(1)});
  const std::vector<dest_layout> workers{{{{spec("d", {5, 5}), {{"w", make_box({3, 1}, {4, 4}), {1, 0}}}}}}};
  const auto plan = plan_transfer(source, workers);
  ASSERT_TRUE(check_plan(source, workers, plan));
  std::size_t items = 0;
  for (int r = 0; r < 6; ++r) items += plan.pair(r, 0).items.size();
  EXPECT_EQ(items, 6u);
  // Rank 0 holds rows [0,5) x columns [0,2): it sends rows 3..4, column 1, local [3:5, 1:2], landing at [1, 0].
  ASSERT_EQ(plan.pair(0, 0).items.size(), 1u);
  EXPECT_EQ(plan.pair(0, 0).items[0].src, make_box({3, 1}, {2, 1}));
  EXPECT_EQ(plan.pair(0, 0).items[0].dst_at, (shape_t{1, 0}));
  // Rank 5 holds rows [5,10) x columns [4,6): rows 5..6, column 4 -> local [0:2, 0:1] at [3, 3].
  ASSERT_EQ(plan.pair(5, 0).items.size(), 1u);
  EXPECT_EQ(plan.pair(5, 0).items[0].src, make_box({0, 0}, {2, 1}));
  EXPECT_EQ(plan.pair(5, 0).items[0].dst_at, (shape_t{3, 3}));
}

// ---------------------------------------------------------------- scale

TEST(plan_transfer, property_about_100k_tensors_plan_with_consistent_sums) {
  // A MoE-like checkpoint: 32 layers of 1024 experts (gate, up, down: [4, 32]
  // bf16 each), FSDP Shard(0) over 64 ranks (ranks 0..3 hold one row of each),
  // 8 expert-parallel workers: expert e on worker e % 8, gate and up stacked into
  // w13 [8, 32] (fused), down as w2, plus a padding row in w2.
  const int layers = 32, experts = 1024, workers_n = 8;
  const std::int64_t rows = 4, cols = 32;
  update_metadata global;
  global.tensors.reserve(static_cast<std::size_t>(layers) * experts * 3);
  std::vector<dest_layout> workers(workers_n);
  std::vector<std::uint64_t> want_ingress(workers_n, 0);
  for (int l = 0; l < layers; ++l)
    for (int e = 0; e < experts; ++e) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      for (const char* n : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
        global.tensors.push_back(spec(p + n, {rows, cols}, dtype::bfloat16));
      auto& w = workers[e % workers_n];
      w.tensors.push_back({spec(p + "w13", {2 * rows, cols}, dtype::bfloat16),
                           {{p + "gate_proj.weight", make_box({0, 0}, {rows, cols}), {0, 0}},
                            {p + "up_proj.weight", make_box({0, 0}, {rows, cols}), {rows, 0}}}});
      w.tensors.push_back({spec(p + "w2", {rows + 1, cols}, dtype::bfloat16),
                           {{p + "down_proj.weight", make_box({0, 0}, {rows, cols}), {0, 0}}}});
      want_ingress[e % workers_n] += 3 * rows * cols * 2;
    }
  ASSERT_GE(global.tensors.size(), 98000u);
  const auto source = source_layout::uniform(global, device_mesh{{64}, {}}, {placement::shard(0)});
  const auto t0 = std::chrono::steady_clock::now();
  const auto plan = plan_transfer(source, workers);
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("[ plan ] %zu source tensors, %d ranks, %d workers: planned in %.1f ms\n", global.tensors.size(),
              plan.ranks, plan.workers, std::chrono::duration<double, std::milli>(t1 - t0).count());
  EXPECT_EQ(plan.ingress, want_ingress);
  const std::uint64_t total = global.total_bytes();
  EXPECT_EQ(plan.total_bytes(), total);
  std::uint64_t egress = 0, items = 0;
  for (int r = 0; r < plan.ranks; ++r) {
    egress += plan.egress[r];
    // Ranks 0..3 hold one row of every tensor; the rest hold nothing.
    EXPECT_EQ(plan.egress[r], r < rows ? total / rows : 0u) << "rank " << r;
    for (int w = 0; w < workers_n; ++w) {
      const auto& pp = plan.pair(r, w);
      items += pp.items.size();
      std::uint64_t b = 0;
      for (const auto& it : pp.items) b += it.bytes;
      EXPECT_EQ(b, pp.bytes);
    }
  }
  EXPECT_EQ(egress, total);
  EXPECT_EQ(items, global.tensors.size() * rows) << "one item per (tensor, row-holding rank)";
  // The digest is stable and a cache hit costs no planning.
  plan_cache cache;
  cache.get(source, workers);
  const auto t2 = std::chrono::steady_clock::now();
  cache.get(source, workers);
  const auto t3 = std::chrono::steady_clock::now();
  EXPECT_EQ(cache.computed(), 1u);
  std::printf("[ plan ] cache hit (digest only) in %.1f ms\n",
              std::chrono::duration<double, std::milli>(t3 - t2).count());
}

}  // namespace
}  // namespace refit
