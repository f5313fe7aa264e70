// Unit and property tests of lib/layout/layout.h: torch.chunk's split, placements, boxes,
// the trainer's mesh layouts (DTensor semantics), vLLM's tensor-parallel
// destination layouts, destination validation, and the byte-run walkers.
#include <refit/adapters/vllm.h>
#include <refit/layout/layout.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <refit/error.h>
#include <refit/json_reader.h>

#include "tests/lib/expect.h"

namespace refit {

// Readable gtest output for the layout types.
void PrintTo(const box& b, std::ostream* os) { *os << b.to_string(); }
void PrintTo(const placement& p, std::ostream* os) { *os << p.to_string(); }
void PrintTo(const dest_piece& p, std::ostream* os) {
  *os << "{" << p.source << " " << p.from.to_string() << " at " << shape_to_string(p.at) << "}";
}

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using shape_t = std::vector<std::int64_t>;

tensor_spec spec(std::string name, shape_t shape, dtype type = dtype::float32) {
  return {std::move(name), type, std::move(shape)};
}

box make_box(shape_t offset, shape_t extent) { return {std::move(offset), std::move(extent)}; }

// ---------------------------------------------------------------- naive references

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

std::int64_t numel_of(const shape_t& shape) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
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

// The box's element byte offsets in row-major box order, naively.
std::vector<std::uint64_t> naive_byte_offsets(const shape_t& shape, const box& b, std::size_t element) {
  std::vector<std::uint64_t> out;
  for_each_index(b.extent, [&](const shape_t& i) {
    shape_t g(i.size());
    for (std::size_t k = 0; k < i.size(); ++k) g[k] = b.offset[k] + i[k];
    const auto base = static_cast<std::uint64_t>(linear(shape, g)) * element;
    for (std::size_t e = 0; e < element; ++e) out.push_back(base + e);
  });
  return out;
}

std::vector<std::byte> pattern(std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (auto& b : v) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    b = static_cast<std::byte>((x * 0x2545f4914f6cdd1dULL) >> 56);
  }
  return v;
}

// ---------------------------------------------------------------- torch_chunk

std::vector<std::int64_t> chunk_lengths(std::int64_t n, std::int64_t parts) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < parts; ++i) out.push_back(torch_chunk(n, parts, i).length);
  return out;
}

std::vector<std::int64_t> chunk_starts(std::int64_t n, std::int64_t parts) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < parts; ++i) out.push_back(torch_chunk(n, parts, i).start);
  return out;
}

TEST(torch_chunk, matches_torch_chunk_examples) {
  // torch.arange(5).chunk(4) -> [0,1], [2,3], [4] (and DTensor pads with an empty one).
  EXPECT_THAT(chunk_lengths(5, 4), ElementsAre(2, 2, 1, 0));
  EXPECT_THAT(chunk_starts(5, 4), ElementsAre(0, 2, 4, 5));
  // torch.arange(10).chunk(4) -> 3, 3, 3, 1.
  EXPECT_THAT(chunk_lengths(10, 4), ElementsAre(3, 3, 3, 1));
  EXPECT_THAT(chunk_lengths(7, 3), ElementsAre(3, 3, 1));
  EXPECT_THAT(chunk_lengths(8, 4), ElementsAre(2, 2, 2, 2));
  // n < parts: one element each, then empty chunks.
  EXPECT_THAT(chunk_lengths(2, 4), ElementsAre(1, 1, 0, 0));
  EXPECT_THAT(chunk_starts(2, 4), ElementsAre(0, 1, 2, 2));
  // torch.arange(6).chunk(4) -> 2, 2, 2 (ceil(6/4) = 2), the fourth empty.
  EXPECT_THAT(chunk_lengths(6, 4), ElementsAre(2, 2, 2, 0));
  // n = 0: all empty at 0.
  EXPECT_THAT(chunk_lengths(0, 3), ElementsAre(0, 0, 0));
  EXPECT_THAT(chunk_starts(0, 3), ElementsAre(0, 0, 0));
  EXPECT_THAT(chunk_lengths(9, 1), ElementsAre(9));
}

TEST(torch_chunk, property_contiguous_ceil_sized_and_complete) {
  for (std::int64_t n = 0; n <= 60; ++n)
    for (std::int64_t parts = 1; parts <= 12; ++parts) {
      const std::int64_t size = (n + parts - 1) / parts;
      std::int64_t next = 0, total = 0;
      for (std::int64_t i = 0; i < parts; ++i) {
        const auto c = torch_chunk(n, parts, i);
        ASSERT_EQ(c.start, next) << n << "/" << parts << " #" << i;
        ASSERT_EQ(c.length, std::max<std::int64_t>(0, std::min(size, n - i * size))) << n << "/" << parts << " #" << i;
        ASSERT_GE(c.length, 0);
        next = c.start + c.length;
        total += c.length;
      }
      ASSERT_EQ(total, n) << n << "/" << parts;
    }
}

TEST(torch_chunk, bad_chunk_is_invalid_argument) {
  EXPECT_EQ(REFIT_THROWN(torch_chunk(4, 0, 0)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(torch_chunk(4, 2, 2)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(torch_chunk(4, 2, -1)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(torch_chunk(4, -3, 0)).kind(), errc::invalid_argument);
}

// ---------------------------------------------------------------- placement

TEST(placement, to_string_and_parse_round_trip) {
  EXPECT_EQ(placement::replicate().to_string(), "replicate");
  EXPECT_EQ(placement::shard(0).to_string(), "shard(0)");
  EXPECT_EQ(placement::shard(12).to_string(), "shard(12)");
  EXPECT_FALSE(placement::replicate().is_shard());
  EXPECT_TRUE(placement::shard(1).is_shard());
  for (auto p : {placement::replicate(), placement::shard(0), placement::shard(1), placement::shard(7),
                 placement::shard(42), placement::shard(999)})
    EXPECT_EQ(parse_placement(p.to_string()), p) << p.to_string();
}

TEST(placement, parses_torch_and_short_spellings) {
  EXPECT_EQ(parse_placement("R"), placement::replicate());
  EXPECT_EQ(parse_placement("Replicate()"), placement::replicate());
  EXPECT_EQ(parse_placement("S(1)"), placement::shard(1));
  EXPECT_EQ(parse_placement("Shard(dim=2)"), placement::shard(2));
  EXPECT_EQ(parse_placement("Shard(3)"), placement::shard(3));
  EXPECT_NE(parse_placement("shard(0)"), parse_placement("shard(1)"));
  EXPECT_NE(parse_placement("shard(0)"), placement::replicate());
}

TEST(placement, bad_text_is_invalid_argument_naming_it) {
  for (const char* bad : {"", "shard", "shard()", "shard(-1)", "shard(1", "shard(a)", "shard(1234)", "replicate ",
                          "S(1)x", "Shard(dim=)", "partial", "shard( 1)", "r", "SHARD(0)"}) {
    auto e = REFIT_THROWN(parse_placement(bad));
    EXPECT_EQ(e.kind(), errc::invalid_argument) << "'" << bad << "'";
    EXPECT_THAT(e.message(), HasSubstr("'" + std::string(bad) + "'"));
  }
}

// ---------------------------------------------------------------- box

TEST(box, numel_to_string_whole_and_intersect) {
  const box b = make_box({0, 8}, {4, 8});
  EXPECT_EQ(b.numel(), 32);
  EXPECT_FALSE(b.empty());
  EXPECT_EQ(b.to_string(), "[0:4, 8:16]");
  EXPECT_TRUE(make_box({1, 2}, {0, 3}).empty());
  EXPECT_EQ(box{}.numel(), 1) << "a scalar's box holds one element";
  EXPECT_EQ(box{}.to_string(), "[]");

  const shape_t shape{3, 5};
  EXPECT_EQ(whole(shape), make_box({0, 0}, {3, 5}));
  EXPECT_EQ(whole(shape_t{}), box{});

  EXPECT_EQ(intersect(make_box({0, 0}, {4, 4}), make_box({2, 1}, {4, 2})), make_box({2, 1}, {2, 2}));
  EXPECT_EQ(intersect(make_box({2, 1}, {4, 2}), make_box({0, 0}, {4, 4})), make_box({2, 1}, {2, 2}));
  EXPECT_TRUE(intersect(make_box({0, 0}, {2, 2}), make_box({2, 0}, {2, 2})).empty()) << "touching is disjoint";
  EXPECT_TRUE(intersect(make_box({0}, {2}), make_box({5}, {2})).empty());
  EXPECT_EQ(intersect(make_box({0}, {2}), make_box({5}, {2})).extent, shape_t{0});
}

// ---------------------------------------------------------------- device mesh

TEST(device_mesh, size_rank_at_and_validate) {
  device_mesh m;
  EXPECT_EQ(m.size(), 1);
  m.validate();
  m.shape = {2, 3};
  EXPECT_EQ(m.size(), 6);
  EXPECT_EQ(m.rank_at(4), 4);
  m.ranks = {5, 4, 3, 2, 1, 0};
  m.validate();
  EXPECT_EQ(m.rank_at(1), 4);
}

TEST(device_mesh, bad_meshes_are_invalid_argument) {
  auto bad = [](device_mesh m, const char* what) {
    auto e = REFIT_THROWN(m.validate());
    EXPECT_EQ(e.kind(), errc::invalid_argument) << what;
    return e.message();
  };
  bad({{}, {}}, "empty shape");
  bad({{2, 0}, {}}, "zero dim");
  bad({{-1}, {}}, "negative dim");
  EXPECT_THAT(bad({{4}, {0, 1, 2}}, "too few ranks"), HasSubstr("3 ranks"));
  EXPECT_THAT(bad({{3}, {0, 1, 1}}, "duplicate"), HasSubstr("twice"));
  bad({{3}, {0, 1, 3}}, "out of range");
  bad({{2}, {-1, 0}}, "negative rank");
}

// ---------------------------------------------------------------- source layout

update_metadata meta_of(std::vector<tensor_spec> t) { return {std::move(t)}; }

std::vector<shape_t> local_shapes(const source_layout& l, int rank) {
  std::vector<shape_t> out;
  for (const auto& t : l.local_metadata(rank).tensors) out.push_back(t.shape);
  return out;
}

TEST(source_layout, uniform_shard0_over_two_ranks_with_uneven_last_shard) {
  const auto meta = meta_of({spec("a", {5, 3}), spec("b", {1}), spec("c", {4, 2}, dtype::bfloat16), spec("s", {})});
  const auto l = source_layout::uniform(meta, device_mesh{{2}, {}}, {placement::shard(0)});
  EXPECT_EQ(l.ranks(), 2);
  EXPECT_THAT(local_shapes(l, 0), ElementsAre(shape_t{3, 3}, shape_t{1}, shape_t{2, 2}, shape_t{}));
  EXPECT_THAT(local_shapes(l, 1), ElementsAre(shape_t{2, 3}, shape_t{0}, shape_t{2, 2}, shape_t{}));
  // Names and dtypes are the global ones.
  const auto m1 = l.local_metadata(1);
  EXPECT_EQ(m1.tensors[2].name, "c");
  EXPECT_EQ(m1.tensors[2].dtype, dtype::bfloat16);
  EXPECT_EQ(l.local_box(0, 1), make_box({3, 0}, {2, 3}));
  EXPECT_EQ(l.local_box(1, 0), make_box({0}, {1}));
  EXPECT_EQ(l.local_box(1, 1), make_box({1}, {0}));
  EXPECT_TRUE(l.local_box(1, 1).empty());
  EXPECT_EQ(l.local_box(3, 1), box{}) << "a scalar is replicated";
  EXPECT_EQ(l.tensors[3].placements, std::vector<placement>{placement::replicate()});
  EXPECT_EQ(l.global_metadata().tensors, meta.tensors);
  EXPECT_EQ(REFIT_THROWN(l.local_box(0, 2)).kind(), errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(l.local_metadata(-1)).kind(), errc::invalid_argument);
}

TEST(source_layout, uniform_refuses_a_shard_dim_a_tensor_lacks_but_replicates_scalars) {
  auto e = REFIT_THROWN(source_layout::uniform(meta_of({spec("w", {4, 6}), spec("bias", {4})}), device_mesh{{2}, {}},
                                               {placement::shard(1)}));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'bias'"));
  const auto l = source_layout::uniform(meta_of({spec("w", {4, 6}), spec("step", {}, dtype::int64)}),
                                        device_mesh{{2, 2}, {}}, {placement::shard(1), placement::shard(0)});
  EXPECT_EQ(l.tensors[0].placements, (std::vector<placement>{placement::shard(1), placement::shard(0)}));
  EXPECT_EQ(l.tensors[1].placements, (std::vector<placement>{placement::replicate(), placement::replicate()}));
  EXPECT_EQ(l.local_box(0, 1), make_box({2, 0}, {2, 3})) << "rank 1 at (0, 1): columns [0,3), rows [2,4)";
  EXPECT_EQ(l.local_box(1, 3), box{});
}

TEST(source_layout, two_d_mesh_shard_replicate) {
  const auto l = source_layout::uniform(meta_of({spec("w", {5, 4})}), device_mesh{{2, 2}, {}},
                                        {placement::shard(0), placement::replicate()});
  // Rank r sits at (r / 2, r % 2); mesh dim 0 cuts rows, mesh dim 1 replicates.
  EXPECT_EQ(l.local_box(0, 0), make_box({0, 0}, {3, 4}));
  EXPECT_EQ(l.local_box(0, 1), make_box({0, 0}, {3, 4}));
  EXPECT_EQ(l.local_box(0, 2), make_box({3, 0}, {2, 4}));
  EXPECT_EQ(l.local_box(0, 3), make_box({3, 0}, {2, 4}));
}

TEST(source_layout, two_d_mesh_shard0_shard1) {
  const auto l = source_layout::uniform(meta_of({spec("w", {5, 4})}), device_mesh{{2, 2}, {}},
                                        {placement::shard(0), placement::shard(1)});
  EXPECT_EQ(l.local_box(0, 0), make_box({0, 0}, {3, 2}));
  EXPECT_EQ(l.local_box(0, 1), make_box({0, 2}, {3, 2}));
  EXPECT_EQ(l.local_box(0, 2), make_box({3, 0}, {2, 2}));
  EXPECT_EQ(l.local_box(0, 3), make_box({3, 2}, {2, 2}));
  // A 2x3 mesh: columns 4 over 3 -> 2, 2, 0.
  const auto l3 = source_layout::uniform(meta_of({spec("w", {5, 4})}), device_mesh{{2, 3}, {}},
                                         {placement::shard(0), placement::shard(1)});
  EXPECT_EQ(l3.local_box(0, 4), make_box({3, 2}, {2, 2}));
  EXPECT_EQ(l3.local_box(0, 5), make_box({3, 4}, {2, 0}));
}

TEST(source_layout, two_d_mesh_shard0_shard0_chunks_nested) {
  // 7 rows: mesh dim 0 cuts 4 | 3, mesh dim 1 cuts each again: 2,2 | 2,1.
  const auto l = source_layout::uniform(meta_of({spec("w", {7, 2}), spec("v", {3})}), device_mesh{{2, 2}, {}},
                                        {placement::shard(0), placement::shard(0)});
  EXPECT_EQ(l.local_box(0, 0), make_box({0, 0}, {2, 2}));
  EXPECT_EQ(l.local_box(0, 1), make_box({2, 0}, {2, 2}));
  EXPECT_EQ(l.local_box(0, 2), make_box({4, 0}, {2, 2}));
  EXPECT_EQ(l.local_box(0, 3), make_box({6, 0}, {1, 2}));
  // 3 rows: 2 | 1, then 1,1 | 1,0 (not the flat chunk of 3 over 4 = 1,1,1,0 by accident: check offsets).
  EXPECT_EQ(l.local_box(1, 0), make_box({0}, {1}));
  EXPECT_EQ(l.local_box(1, 1), make_box({1}, {1}));
  EXPECT_EQ(l.local_box(1, 2), make_box({2}, {1}));
  EXPECT_EQ(l.local_box(1, 3).extent, shape_t{0});
  // 10 rows: 5 | 5 then 3,2 | 3,2 (flat chunk over 4 would be 3,3,3,1).
  const auto l10 = source_layout::uniform(meta_of({spec("w", {10})}), device_mesh{{2, 2}, {}},
                                          {placement::shard(0), placement::shard(0)});
  EXPECT_EQ(l10.local_box(0, 0), make_box({0}, {3}));
  EXPECT_EQ(l10.local_box(0, 1), make_box({3}, {2}));
  EXPECT_EQ(l10.local_box(0, 2), make_box({5}, {3}));
  EXPECT_EQ(l10.local_box(0, 3), make_box({8}, {2}));
}

TEST(source_layout, mesh_ranks_permute_coordinates) {
  // Coordinate i is held by ranks[i].
  const auto l =
      source_layout::uniform(meta_of({spec("w", {8})}), device_mesh{{4}, {2, 0, 3, 1}}, {placement::shard(0)});
  EXPECT_EQ(l.local_box(0, 2), make_box({0}, {2}));
  EXPECT_EQ(l.local_box(0, 0), make_box({2}, {2}));
  EXPECT_EQ(l.local_box(0, 3), make_box({4}, {2}));
  EXPECT_EQ(l.local_box(0, 1), make_box({6}, {2}));
  // 2-D: ranks {3,2,1,0}: rank 0 sits at (1, 1).
  const auto l2 = source_layout::uniform(meta_of({spec("w", {4, 4})}), device_mesh{{2, 2}, {3, 2, 1, 0}},
                                         {placement::shard(0), placement::shard(1)});
  EXPECT_EQ(l2.local_box(0, 0), make_box({2, 2}, {2, 2}));
  EXPECT_EQ(l2.local_box(0, 1), make_box({2, 0}, {2, 2}));
  EXPECT_EQ(l2.local_box(0, 3), make_box({0, 0}, {2, 2}));
  EXPECT_EQ(l2.local_metadata(0).tensors[0].shape, (shape_t{2, 2}));
}

TEST(source_layout, single_holds_everything_on_rank_zero) {
  const auto meta = meta_of({spec("a", {5, 3}), spec("s", {})});
  const auto l = source_layout::single(meta);
  EXPECT_EQ(l.ranks(), 1);
  EXPECT_EQ(l.local_box(0, 0), make_box({0, 0}, {5, 3}));
  EXPECT_EQ(l.local_metadata(0).tensors, meta.tensors);
}

TEST(source_layout, validate_refuses_bad_layouts_naming_the_tensor) {
  source_layout l;
  l.mesh = {{2, 2}, {}};
  l.tensors = {{spec("ok", {4, 4}), {placement::shard(0), placement::replicate()}},
               {spec("few", {4, 4}), {placement::shard(0)}}};
  auto e = REFIT_THROWN(l.validate());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'few'"));
  EXPECT_THAT(e.message(), HasSubstr("1 placements for a 2-dimensional mesh"));

  l.tensors[1].placements = {placement::shard(0), placement::shard(0), placement::shard(1)};
  EXPECT_EQ(REFIT_THROWN(l.validate()).kind(), errc::invalid_argument) << "too many placements";

  l.tensors[1].placements = {placement::shard(2), placement::replicate()};
  e = REFIT_THROWN(l.validate());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'few'"));
  EXPECT_THAT(e.message(), HasSubstr("shard(2)"));

  l.tensors[1].placements = {placement::replicate(), placement::shard(-1)};
  EXPECT_EQ(REFIT_THROWN(l.validate()).kind(), errc::invalid_argument) << "negative dim";

  l.tensors[1] = {spec("s", {}), {placement::shard(0), placement::replicate()}};
  EXPECT_EQ(REFIT_THROWN(l.validate()).kind(), errc::invalid_argument) << "a scalar cannot be sharded";

  l.tensors[1] = {spec("ok", {4}), {placement::shard(0), placement::replicate()}};
  EXPECT_THAT(REFIT_THROWN(l.validate()).message(), HasSubstr("duplicate"));

  l.tensors[1].spec.name = "fine";
  l.validate();
  l.mesh.ranks = {0, 1, 2, 2};
  EXPECT_EQ(REFIT_THROWN(l.validate()).kind(), errc::invalid_argument) << "bad mesh ranks";
  l.mesh.ranks = {0, 1, 2};
  EXPECT_EQ(REFIT_THROWN(l.validate()).kind(), errc::invalid_argument) << "too few mesh ranks";
  l.mesh.ranks = {1, 0, 3, 2};
  l.validate();
  // uniform() validates too.
  EXPECT_EQ(REFIT_THROWN(source_layout::uniform(meta_of({spec("a", {2})}), device_mesh{{2}, {}},
                                                {placement::shard(0), placement::shard(0)}))
                .kind(),
            errc::invalid_argument);
  EXPECT_EQ(REFIT_THROWN(source_layout::uniform(meta_of({spec("a", {2})}), device_mesh{{0}, {}}, {placement::shard(0)}))
                .kind(),
            errc::invalid_argument);
}

TEST(source_layout, property_every_element_held_by_replication_factor_ranks) {
  std::mt19937_64 rng(20240611);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 300; ++iter) {
    device_mesh mesh;
    mesh.shape.clear();
    const int mdims = static_cast<int>(pick(1, 3));
    for (int i = 0; i < mdims; ++i) mesh.shape.push_back(pick(1, 3));
    if (pick(0, 1)) {
      mesh.ranks.resize(mesh.size());
      for (int i = 0; i < mesh.size(); ++i) mesh.ranks[i] = i;
      std::shuffle(mesh.ranks.begin(), mesh.ranks.end(), rng);
    }
    shape_t shape;
    const int rank = static_cast<int>(pick(1, 3));
    for (int d = 0; d < rank; ++d) shape.push_back(pick(0, 7));
    std::vector<placement> ps;
    std::int64_t replication = 1;
    for (int i = 0; i < mdims; ++i) {
      if (pick(0, 2) == 0) {
        ps.push_back(placement::replicate());
        replication *= mesh.shape[i];
      } else {
        ps.push_back(placement::shard(static_cast<int>(pick(0, rank - 1))));
      }
    }
    source_layout l;
    l.mesh = mesh;
    l.tensors = {{spec("t", shape), ps}};
    l.validate();
    std::vector<std::int64_t> held(numel_of(shape), 0);
    for (int r = 0; r < l.ranks(); ++r) {
      const auto b = l.local_box(0, r);
      ASSERT_EQ(b.offset.size(), shape.size());
      for (std::size_t d = 0; d < shape.size(); ++d) {
        ASSERT_GE(b.offset[d], 0);
        ASSERT_GE(b.extent[d], 0);
        ASSERT_LE(b.offset[d] + b.extent[d], shape[d]);
      }
      EXPECT_EQ(l.local_metadata(r).tensors[0].shape, b.extent);
      for_each_index(b.extent, [&](const shape_t& i) {
        shape_t g(i.size());
        for (std::size_t k = 0; k < i.size(); ++k) g[k] = b.offset[k] + i[k];
        ++held[linear(shape, g)];
      });
    }
    for (std::size_t e = 0; e < held.size(); ++e)
      ASSERT_EQ(held[e], replication) << "iteration " << iter << " element " << e << " mesh "
                                      << shape_to_string(mesh.shape) << " shape " << shape_to_string(shape);
  }
}

// ---------------------------------------------------------------- tensor-parallel layouts

// A small Llama-like checkpoint (GQA: k and v have half q's rows).
struct llama_dims {
  std::int64_t vocab = 100, hidden = 8, q = 8, kv = 4, inter = 12;
  int layers = 2;
  bool qkv_bias = false;
  dtype type = dtype::bfloat16;
};

update_metadata llama(const llama_dims& d) {
  update_metadata m;
  auto add = [&](std::string name, shape_t shape) { m.tensors.push_back({std::move(name), d.type, std::move(shape)}); };
  add("model.embed_tokens.weight", {d.vocab, d.hidden});
  for (int l = 0; l < d.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {d.hidden});
    add(p + "self_attn.q_proj.weight", {d.q, d.hidden});
    add(p + "self_attn.k_proj.weight", {d.kv, d.hidden});
    add(p + "self_attn.v_proj.weight", {d.kv, d.hidden});
    if (d.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {d.q});
      add(p + "self_attn.k_proj.bias", {d.kv});
      add(p + "self_attn.v_proj.bias", {d.kv});
    }
    add(p + "self_attn.o_proj.weight", {d.hidden, d.q});
    add(p + "post_attention_layernorm.weight", {d.hidden});
    add(p + "mlp.gate_proj.weight", {d.inter, d.hidden});
    add(p + "mlp.up_proj.weight", {d.inter, d.hidden});
    add(p + "mlp.down_proj.weight", {d.hidden, d.inter});
  }
  add("model.norm.weight", {d.hidden});
  add("lm_head.weight", {d.vocab, d.hidden});
  return m;
}

const dest_tensor* find_tensor(const dest_layout& l, const std::string& name) {
  for (const auto& t : l.tensors)
    if (t.spec.name == name) return &t;
  return nullptr;
}

TEST(tensor_parallel_layout, vllm_llama_names_and_order) {
  const auto global = llama({.layers = 1});
  const auto d = tensor_parallel_layout(global, 2, 0, vllm_llama_layout());
  std::vector<std::string> names;
  for (const auto& t : d.tensors) names.push_back(t.spec.name);
  EXPECT_THAT(names,
              ElementsAre("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                          "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                          "model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight",
                          "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"));
  for (const auto& t : d.tensors) EXPECT_EQ(t.spec.dtype, dtype::bfloat16) << t.spec.name;
  EXPECT_EQ(d.metadata().tensors.size(), d.tensors.size());
  EXPECT_EQ(d.metadata().tensors[2].shape, (shape_t{4 + 2 + 2, 8}));
}

TEST(tensor_parallel_layout, vllm_llama_tp2_pieces) {
  const llama_dims dims{.layers = 2, .qkv_bias = true};
  const auto global = llama(dims);
  const auto source = source_layout::single(global);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("tp rank " + std::to_string(r));
    const auto d = tensor_parallel_layout(global, 2, r, vllm_llama_layout());
    validate(d, source, static_cast<std::size_t>(r));
    for (int layer = 0; layer < 2; ++layer) {
      const std::string p = "model.layers." + std::to_string(layer) + ".";
      // qkv_proj: q/2 + k/2 + v/2 rows, each component's rank shard stacked.
      const auto* qkv = find_tensor(d, p + "self_attn.qkv_proj.weight");
      ASSERT_NE(qkv, nullptr);
      EXPECT_EQ(qkv->spec.shape, (shape_t{4 + 2 + 2, 8}));
      ASSERT_EQ(qkv->pieces.size(), 3u);
      EXPECT_EQ(qkv->pieces[0], (dest_piece{p + "self_attn.q_proj.weight", make_box({4 * r, 0}, {4, 8}), {0, 0}}));
      EXPECT_EQ(qkv->pieces[1], (dest_piece{p + "self_attn.k_proj.weight", make_box({2 * r, 0}, {2, 8}), {4, 0}}));
      EXPECT_EQ(qkv->pieces[2], (dest_piece{p + "self_attn.v_proj.weight", make_box({2 * r, 0}, {2, 8}), {6, 0}}));
      const auto* bias = find_tensor(d, p + "self_attn.qkv_proj.bias");
      ASSERT_NE(bias, nullptr);
      EXPECT_EQ(bias->spec.shape, (shape_t{8}));
      ASSERT_EQ(bias->pieces.size(), 3u);
      EXPECT_EQ(bias->pieces[1], (dest_piece{p + "self_attn.k_proj.bias", make_box({2 * r}, {2}), {4}}));
      EXPECT_EQ(bias->pieces[2], (dest_piece{p + "self_attn.v_proj.bias", make_box({2 * r}, {2}), {6}}));
      // gate_up_proj: inter/2 + inter/2 rows.
      const auto* gu = find_tensor(d, p + "mlp.gate_up_proj.weight");
      ASSERT_NE(gu, nullptr);
      EXPECT_EQ(gu->spec.shape, (shape_t{12, 8}));
      ASSERT_EQ(gu->pieces.size(), 2u);
      EXPECT_EQ(gu->pieces[0], (dest_piece{p + "mlp.gate_proj.weight", make_box({6 * r, 0}, {6, 8}), {0, 0}}));
      EXPECT_EQ(gu->pieces[1], (dest_piece{p + "mlp.up_proj.weight", make_box({6 * r, 0}, {6, 8}), {6, 0}}));
      // Row-parallel: dim 1 split.
      const auto* o = find_tensor(d, p + "self_attn.o_proj.weight");
      ASSERT_NE(o, nullptr);
      EXPECT_EQ(o->spec.shape, (shape_t{8, 4}));
      EXPECT_THAT(o->pieces,
                  ElementsAre(dest_piece{p + "self_attn.o_proj.weight", make_box({0, 4 * r}, {8, 4}), {0, 0}}));
      const auto* down = find_tensor(d, p + "mlp.down_proj.weight");
      ASSERT_NE(down, nullptr);
      EXPECT_EQ(down->spec.shape, (shape_t{8, 6}));
      EXPECT_THAT(down->pieces,
                  ElementsAre(dest_piece{p + "mlp.down_proj.weight", make_box({0, 6 * r}, {8, 6}), {0, 0}}));
      // Norms replicated.
      for (const char* n : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
        const auto* t = find_tensor(d, p + n);
        ASSERT_NE(t, nullptr) << n;
        EXPECT_EQ(t->spec.shape, shape_t{8});
        EXPECT_THAT(t->pieces, ElementsAre(dest_piece{p + n, make_box({0}, {8}), {0}}));
      }
      EXPECT_EQ(find_tensor(d, p + "self_attn.q_proj.weight"), nullptr) << "fused away";
    }
    const auto* norm = find_tensor(d, "model.norm.weight");
    ASSERT_NE(norm, nullptr);
    EXPECT_THAT(norm->pieces, ElementsAre(dest_piece{"model.norm.weight", make_box({0}, {8}), {0}}));
    // Vocab-parallel: 100 rows padded to 128, 64 a rank; rank 1 holds rows [64, 100) at 0.
    for (const char* n : {"model.embed_tokens.weight", "lm_head.weight"}) {
      const auto* t = find_tensor(d, n);
      ASSERT_NE(t, nullptr) << n;
      EXPECT_EQ(t->spec.shape, (shape_t{64, 8})) << n;
      const box from = r == 0 ? make_box({0, 0}, {64, 8}) : make_box({64, 0}, {36, 8});
      EXPECT_THAT(t->pieces, ElementsAre(dest_piece{n, from, {0, 0}})) << n;
    }
  }
}

// The data a worker's tensors hold when loaded naively from the checkpoint, row
// by row from vLLM's rules, compared with copying the layout's pieces.
TEST(tensor_parallel_layout, pieces_reproduce_vllm_sharded_weights) {
  const llama_dims dims{.vocab = 130, .hidden = 4, .q = 8, .kv = 2, .inter = 6, .layers = 1, .type = dtype::float32};
  const auto global = llama(dims);
  std::map<std::string, std::vector<float>> data;
  float next = 1;
  for (const auto& t : global.tensors) {
    auto& v = data[t.name];
    v.resize(numel_of(t.shape));
    for (auto& x : v) x = next++;
  }
  const int tp = 2;
  for (int r = 0; r < tp; ++r) {
    const auto d = tensor_parallel_layout(global, tp, r, vllm_llama_layout());
    for (const auto& t : d.tensors) {
      std::vector<float> got(numel_of(t.spec.shape), -1.0f);
      for (const auto& p : t.pieces) {
        const auto* s = &global.tensors[0];
        for (const auto& g : global.tensors)
          if (g.name == p.source) s = &g;
        copy_box(reinterpret_cast<const std::byte*>(data[p.source].data()), s->shape, p.from,
                 reinterpret_cast<std::byte*>(got.data()), t.spec.shape, p.at, sizeof(float));
      }
      // Expected: row i (dim 0) of the local tensor, element j.
      const auto rows = t.spec.shape[0];
      const auto cols = t.spec.shape.size() > 1 ? t.spec.shape[1] : 1;
      auto at = [&](const std::string& n, std::int64_t i, std::int64_t j, std::int64_t ncols) {
        return data[n][i * ncols + j];
      };
      const std::string p = "model.layers.0.";
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) {
          float want = -2;
          const auto& n = t.spec.name;
          if (n == p + "self_attn.qkv_proj.weight") {
            const std::int64_t qn = dims.q / tp, kn = dims.kv / tp;
            if (i < qn)
              want = at(p + "self_attn.q_proj.weight", r * qn + i, j, dims.hidden);
            else if (i < qn + kn)
              want = at(p + "self_attn.k_proj.weight", r * kn + i - qn, j, dims.hidden);
            else
              want = at(p + "self_attn.v_proj.weight", r * kn + i - qn - kn, j, dims.hidden);
          } else if (n == p + "mlp.gate_up_proj.weight") {
            const std::int64_t h = dims.inter / tp;
            want = i < h ? at(p + "mlp.gate_proj.weight", r * h + i, j, dims.hidden)
                         : at(p + "mlp.up_proj.weight", r * h + i - h, j, dims.hidden);
          } else if (n == p + "self_attn.o_proj.weight") {
            want = at(n, i, r * (dims.q / tp) + j, dims.q);
          } else if (n == p + "mlp.down_proj.weight") {
            want = at(n, i, r * (dims.inter / tp) + j, dims.inter);
          } else if (n == "model.embed_tokens.weight" || n == "lm_head.weight") {
            // 130 pads to 192, 96 a rank: rank 1's rows past 130 - 96 = 34 are padding.
            ASSERT_EQ(rows, 96);
            const auto g = r * 96 + i;
            want = g < dims.vocab ? at(n, g, j, dims.hidden) : -1.0f;
          } else {
            want = data[n][i * cols + j];
          }
          ASSERT_EQ(got[i * cols + j], want) << n << " rank " << r << " [" << i << ", " << j << "]";
        }
    }
  }
}

TEST(tensor_parallel_layout, vocab_padding_edge_cases) {
  // Vocabulary smaller than a rank's share: the last rank holds only padding.
  auto global = meta_of({spec("model.embed_tokens.weight", {10, 4})});
  const auto source = source_layout::single(global);
  auto r1 = tensor_parallel_layout(global, 2, 1, vllm_llama_layout());
  ASSERT_EQ(r1.tensors.size(), 1u);
  EXPECT_EQ(r1.tensors[0].spec.shape, (shape_t{32, 4}));
  EXPECT_TRUE(r1.tensors[0].pieces.empty());
  validate(r1, source, 1);
  auto r0 = tensor_parallel_layout(global, 2, 0, vllm_llama_layout());
  EXPECT_THAT(r0.tensors[0].pieces,
              ElementsAre(dest_piece{"model.embed_tokens.weight", make_box({0, 0}, {10, 4}), {0, 0}}));
  // A multiple of the padding splits exactly.
  global = meta_of({spec("lm_head.weight", {128, 4})});
  auto d = tensor_parallel_layout(global, 4, 3, vllm_llama_layout());
  EXPECT_EQ(d.tensors[0].spec.shape, (shape_t{32, 4}));
  EXPECT_THAT(d.tensors[0].pieces, ElementsAre(dest_piece{"lm_head.weight", make_box({96, 0}, {32, 4}), {0, 0}}));
  // Another padding.
  auto opts = vllm_llama_layout();
  opts.vocab_padding = 16;
  global = meta_of({spec("lm_head.weight", {100, 4})});
  d = tensor_parallel_layout(global, 4, 3, opts);  // pads to 112, 28 a rank
  EXPECT_EQ(d.tensors[0].spec.shape, (shape_t{28, 4}));
  EXPECT_THAT(d.tensors[0].pieces, ElementsAre(dest_piece{"lm_head.weight", make_box({84, 0}, {16, 4}), {0, 0}}));
}

TEST(tensor_parallel_layout, tp_size_one_gives_whole_tensors) {
  const auto global = llama({.vocab = 128, .layers = 2});
  const auto d = tensor_parallel_layout(global, 1, 0, vllm_llama_layout());
  validate(d, source_layout::single(global));
  std::int64_t pieces = 0;
  for (const auto& t : d.tensors) {
    std::int64_t rows = 0;
    for (const auto& p : t.pieces) {
      ++pieces;
      const tensor_spec* s = nullptr;
      for (const auto& g : global.tensors)
        if (g.name == p.source) s = &g;
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(p.from, whole(s->shape)) << p.source;
      EXPECT_EQ(p.at[0], rows) << p.source;
      rows += s->shape[0];
    }
    EXPECT_EQ(rows, t.spec.shape[0]) << t.spec.name << ": fully covered";
  }
  EXPECT_EQ(pieces, static_cast<std::int64_t>(global.tensors.size())) << "every checkpoint tensor is a piece";
  EXPECT_EQ(find_tensor(d, "model.layers.1.self_attn.qkv_proj.weight")->spec.shape, (shape_t{16, 8}));
  EXPECT_EQ(find_tensor(d, "model.layers.1.mlp.gate_up_proj.weight")->spec.shape, (shape_t{24, 8}));
  // Not a multiple of the padding: whole rows plus padding even at tp 1 (vLLM pads too).
  const auto d100 = tensor_parallel_layout(llama({.vocab = 100, .layers = 1}), 1, 0, vllm_llama_layout());
  EXPECT_EQ(find_tensor(d100, "lm_head.weight")->spec.shape, (shape_t{128, 8}));
  EXPECT_EQ(find_tensor(d100, "lm_head.weight")->pieces[0].from, make_box({0, 0}, {100, 8}));
}

TEST(tensor_parallel_layout, empty_options_replicate_everything_unfused) {
  const auto global = llama({.layers = 1});
  const auto d = tensor_parallel_layout(global, 4, 2, tp_layout_options{});
  ASSERT_EQ(d.tensors.size(), global.tensors.size());
  for (std::size_t i = 0; i < d.tensors.size(); ++i) {
    EXPECT_EQ(d.tensors[i].spec, global.tensors[i]);
    EXPECT_THAT(d.tensors[i].pieces, ElementsAre(dest_piece{global.tensors[i].name, whole(global.tensors[i].shape),
                                                            shape_t(global.tensors[i].shape.size(), 0)}));
  }
}

TEST(tensor_parallel_layout, ignore_scalars_and_custom_rules) {
  auto global = llama({.layers = 1});
  global.tensors.push_back(spec("model.layers.0.self_attn.rotary_emb.inv_freq", {4}, dtype::float32));
  global.tensors.push_back(spec("model.step", {}, dtype::int64));
  auto opts = vllm_llama_layout();
  opts.ignore = {"rotary_emb\\.inv_freq$"};
  const auto d = tensor_parallel_layout(global, 2, 1, opts);
  EXPECT_EQ(find_tensor(d, "model.layers.0.self_attn.rotary_emb.inv_freq"), nullptr);
  const auto* step = find_tensor(d, "model.step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->spec.shape, shape_t{});
  EXPECT_THAT(step->pieces, ElementsAre(dest_piece{"model.step", box{}, {}}));
  validate(d, source_layout::single(global), 1);

  // A custom rule list: the first match wins.
  tp_layout_options custom;
  custom.shards = {{"special", parallel_style::row}, {"weight", parallel_style::column}};
  const auto c = tensor_parallel_layout(
      meta_of({spec("a.special.weight", {4, 6}), spec("b.weight", {4, 6}), spec("c.bias", {4, 6})}), 2, 1, custom);
  EXPECT_EQ(c.tensors[0].pieces[0].from, make_box({0, 3}, {4, 3}));
  EXPECT_EQ(c.tensors[1].pieces[0].from, make_box({2, 0}, {2, 6}));
  EXPECT_EQ(c.tensors[2].pieces[0].from, make_box({0, 0}, {4, 6}));
}

TEST(tensor_parallel_layout, refuses_bad_inputs) {
  const auto opts = vllm_llama_layout();
  auto kind_of = [](auto&& f) { return REFIT_THROWN(f()).kind(); };
  // Column dim not divisible.
  {
    auto e = REFIT_THROWN(tensor_parallel_layout(llama({.kv = 3, .layers = 1}), 2, 0, opts));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("k_proj"));
    EXPECT_THAT(e.message(), HasSubstr("not divisible by tp_size 2"));
  }
  // Row dim not divisible.
  {
    auto g = meta_of({spec("model.layers.0.self_attn.o_proj.weight", {8, 5})});
    auto e = REFIT_THROWN(tensor_parallel_layout(g, 2, 0, opts));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("row"));
  }
  // Vocab padded rows not divisible: 100 -> 128 over 3.
  EXPECT_EQ(kind_of([&] {
              return tensor_parallel_layout(meta_of({spec("lm_head.weight", {100, 4})}), 3, 0, opts);
            }),
            errc::invalid_argument);
  // A missing fused component.
  {
    auto g = llama({.layers = 1});
    std::erase_if(g.tensors, [](const tensor_spec& t) { return t.name.find("v_proj") != std::string::npos; });
    auto e = REFIT_THROWN(tensor_parallel_layout(g, 2, 0, opts));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_THAT(e.message(), HasSubstr("qkv_proj"));
    EXPECT_THAT(e.message(), HasSubstr(".v_proj"));
  }
  {
    auto g = llama({.layers = 1});
    std::erase_if(g.tensors, [](const tensor_spec& t) { return t.name.find("gate_proj") != std::string::npos; });
    EXPECT_THAT(REFIT_THROWN(tensor_parallel_layout(g, 1, 0, opts)).message(), HasSubstr(".gate_proj"));
  }
  // Components that differ in dtype or trailing dims.
  {
    auto g = llama({.layers = 1});
    for (auto& t : g.tensors)
      if (t.name.find("k_proj") != std::string::npos) t.dtype = dtype::float32;
    EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 0, opts); }), errc::invalid_argument);
    for (auto& t : g.tensors)
      if (t.name.find("k_proj") != std::string::npos) t = spec(t.name, {4, 6}, dtype::bfloat16);
    EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 0, opts); }), errc::invalid_argument);
  }
  // A fused scalar.
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(meta_of({spec("x.q_proj.s", {})}), 1, 0, opts); }),
            errc::invalid_argument);
  // Ranks, padding, rules.
  const auto g = llama({.layers = 1});
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 2, opts); }), errc::invalid_argument);
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, -1, opts); }), errc::invalid_argument);
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 0, 0, opts); }), errc::invalid_argument);
  auto bad = opts;
  bad.vocab_padding = 0;
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 0, bad); }), errc::invalid_argument);
  bad = opts;
  bad.shards.push_back({"(unclosed", parallel_style::column});
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 0, bad); }), errc::invalid_argument);
  bad = opts;
  bad.ignore = {"[z-a]"};
  EXPECT_EQ(kind_of([&] { return tensor_parallel_layout(g, 2, 0, bad); }), errc::invalid_argument);
}

// ---------------------------------------------------------------- validate(dest, source)

TEST(validate_dest, accepts_disjoint_pieces_and_padding) {
  const auto source = source_layout::single(meta_of({spec("a", {4, 4}), spec("b", {2, 4}), spec("s", {})}));
  dest_layout d;
  d.tensors.push_back(
      {spec("fused", {8, 4}), {{"a", make_box({0, 0}, {4, 4}), {0, 0}}, {"b", make_box({0, 0}, {2, 4}), {5, 0}}}});
  d.tensors.push_back(
      {spec("cols", {4, 4}), {{"a", make_box({0, 0}, {4, 2}), {0, 0}}, {"a", make_box({0, 2}, {4, 2}), {0, 2}}}});
  d.tensors.push_back(
      {spec("empty", {4, 4}), {{"a", make_box({0, 0}, {0, 4}), {0, 0}}, {"a", make_box({0, 0}, {4, 4}), {0, 0}}}});
  d.tensors.push_back({spec("scalar", {}), {{"s", box{}, {}}}});
  validate(d, source);
}

std::string refusal(const dest_layout& d, const source_layout& s, std::size_t worker = 0) {
  auto e = REFIT_THROWN(validate(d, s, worker));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  return e.message();
}

TEST(validate_dest, refuses_overlaps_bounds_dtypes_and_unknown_sources) {
  const auto source = source_layout::single(
      meta_of({spec("a", {4, 4}), spec("h", {4, 4}, dtype::float16), spec("v", {4}), spec("s", {})}));
  auto one = [](dest_tensor t) { return dest_layout{{std::move(t)}}; };
  // Overlap of two pieces.
  auto m = refusal(
      one({spec("t", {6, 4}), {{"a", make_box({0, 0}, {2, 4}), {0, 0}}, {"a", make_box({0, 0}, {2, 4}), {1, 0}}}}),
      source, 3);
  EXPECT_THAT(m, HasSubstr("worker 3"));
  EXPECT_THAT(m, HasSubstr("'t'"));
  EXPECT_THAT(m, HasSubstr("pieces 0 and 1 overlap"));
  // Overlap of non-neighbours in dim-0 order: A rows [0,4) col 0, B rows [1,2) col 1, C rows [3,4) col 0.
  m = refusal(one({spec("t", {4, 4}),
                   {{"a", make_box({0, 0}, {4, 1}), {0, 0}},
                    {"a", make_box({0, 0}, {1, 1}), {1, 1}},
                    {"a", make_box({0, 0}, {1, 1}), {3, 0}}}}),
              source);
  EXPECT_THAT(m, HasSubstr("pieces 0 and 2 overlap"));
  // Out-of-order pieces overlap too.
  m = refusal(
      one({spec("t", {4, 4}), {{"a", make_box({0, 0}, {1, 4}), {3, 0}}, {"a", make_box({0, 0}, {4, 1}), {0, 3}}}}),
      source);
  EXPECT_THAT(m, HasSubstr("overlap"));
  // Two scalars into one scalar.
  EXPECT_THAT(refusal(one({spec("t", {}), {{"s", box{}, {}}, {"s", box{}, {}}}}), source), HasSubstr("overlap"));
  // Box outside its source.
  m = refusal(one({spec("t", {8, 8}), {{"a", make_box({2, 0}, {3, 4}), {0, 0}}}}), source);
  EXPECT_THAT(m, HasSubstr("outside source 'a'"));
  EXPECT_THAT(m, HasSubstr("piece 0"));
  refusal(one({spec("t", {8, 8}), {{"a", make_box({-1, 0}, {1, 4}), {0, 0}}}}), source);
  refusal(one({spec("t", {8, 8}), {{"a", make_box({0, 0}, {-1, 4}), {0, 0}}}}), source);
  // Placed outside the destination tensor.
  m = refusal(one({spec("t", {4, 4}), {{"a", make_box({0, 0}, {2, 4}), {3, 0}}}}), source);
  EXPECT_THAT(m, HasSubstr("does not fit"));
  refusal(one({spec("t", {4, 4}), {{"a", make_box({0, 0}, {2, 2}), {0, -1}}}}), source);
  refusal(one({spec("t", {4, 4}), {{"a", make_box({0, 0}, {2, 2}), {0, 3}}}}), source);
  // Ranks that differ.
  refusal(one({spec("t", {4}), {{"a", make_box({0, 0}, {1, 4}), {0, 0}}}}), source);
  refusal(one({spec("t", {4, 4}), {{"v", make_box({0}, {4}), {0}}}}), source);
  refusal(one({spec("t", {4, 4}), {{"a", make_box({0, 0}, {1, 4}), {0}}}}), source);
  refusal(one({spec("t", {4, 4}), {{"a", make_box({0}, {1}), {0, 0}}}}), source);
  // Dtype mismatch.
  m = refusal(one({spec("t", {4, 4}), {{"h", make_box({0, 0}, {1, 4}), {0, 0}}}}), source);
  EXPECT_THAT(m, HasSubstr("float16"));
  EXPECT_THAT(m, HasSubstr("float32"));
  // Unknown source.
  m = refusal(one({spec("t", {4, 4}), {{"nope", make_box({0, 0}, {1, 4}), {0, 0}}}}), source);
  EXPECT_THAT(m, HasSubstr("no source tensor 'nope'"));
  // Duplicate destination names.
  dest_layout dup{{{spec("t", {4}), {}}, {spec("t", {4}), {}}}};
  refusal(dup, source);
}

TEST(validate_dest, property_overlap_verdict_matches_brute_force) {
  std::mt19937_64 rng(7);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  int refused = 0, accepted = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    const int rank = static_cast<int>(pick(1, 3));
    shape_t shape;
    for (int d = 0; d < rank; ++d) shape.push_back(pick(1, 5));
    const auto source = source_layout::single(meta_of({spec("src", shape)}));
    dest_tensor t{spec("t", shape), {}};
    const int n = static_cast<int>(pick(1, 5));
    for (int k = 0; k < n; ++k) {
      dest_piece p{"src", {}, {}};
      for (int d = 0; d < rank; ++d) {
        const auto e = pick(0, shape[d]);
        p.from.offset.push_back(pick(0, shape[d] - e));
        p.from.extent.push_back(e);
        p.at.push_back(pick(0, shape[d] - e));
      }
      t.pieces.push_back(std::move(p));
    }
    // Brute force: count every element's covers.
    std::vector<int> covers(numel_of(shape), 0);
    bool overlap = false;
    for (const auto& p : t.pieces)
      for_each_index(p.from.extent, [&](const shape_t& i) {
        shape_t g(i.size());
        for (std::size_t k = 0; k < i.size(); ++k) g[k] = p.at[k] + i[k];
        if (++covers[linear(shape, g)] > 1) overlap = true;
      });
    const dest_layout d{{t}};
    if (overlap) {
      ++refused;
      EXPECT_THAT(refusal(d, source), HasSubstr("overlap")) << "iteration " << iter;
    } else {
      ++accepted;
      EXPECT_NO_THROW(validate(d, source)) << "iteration " << iter;
    }
  }
  EXPECT_GT(refused, 100);
  EXPECT_GT(accepted, 100);
}

// ---------------------------------------------------------------- byte runs

std::vector<std::pair<std::uint64_t, std::uint64_t>> runs_of(const shape_t& shape, const box& b, std::size_t element) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for_each_run(shape, b, element, [&](std::uint64_t o, std::uint64_t n) { out.emplace_back(o, n); });
  return out;
}

using run = std::pair<std::uint64_t, std::uint64_t>;

TEST(for_each_run, contiguous_boxes_are_one_run) {
  EXPECT_THAT(runs_of({4, 5}, whole(shape_t{4, 5}), 2), ElementsAre(run{0, 40}));
  EXPECT_EQ(run_count(shape_t{4, 5}, whole(shape_t{4, 5})), 1u);
  // Full rows.
  EXPECT_THAT(runs_of({4, 5}, make_box({1, 0}, {2, 5}), 4), ElementsAre(run{20, 40}));
  EXPECT_THAT(runs_of({3, 4, 5}, make_box({1, 0, 0}, {2, 4, 5}), 1), ElementsAre(run{20, 40}));
  // A part of one row.
  EXPECT_THAT(runs_of({4, 5}, make_box({2, 1}, {1, 3}), 4), ElementsAre(run{44, 12}));
  // Part of one plane made of full rows; extents 1 in the outer dims.
  EXPECT_THAT(runs_of({3, 4, 5}, make_box({2, 1, 0}, {1, 2, 5}), 1), ElementsAre(run{45, 10}));
  // 1-D.
  EXPECT_THAT(runs_of({10}, make_box({3}, {4}), 8), ElementsAre(run{24, 32}));
  // Scalar.
  EXPECT_THAT(runs_of({}, box{}, 4), ElementsAre(run{0, 4}));
  EXPECT_EQ(run_count(shape_t{}, box{}), 1u);
  // Size-1 dims inside.
  EXPECT_THAT(runs_of({4, 1, 3}, make_box({1, 0, 0}, {2, 1, 3}), 1), ElementsAre(run{3, 6}));
}

TEST(for_each_run, column_slice_is_one_run_per_row) {
  EXPECT_THAT(runs_of({4, 5}, make_box({0, 1}, {4, 2}), 2), ElementsAre(run{2, 4}, run{12, 4}, run{22, 4}, run{32, 4}));
  EXPECT_EQ(run_count(shape_t{4, 5}, make_box({0, 1}, {4, 2})), 4u);
  EXPECT_THAT(runs_of({2, 3, 4}, make_box({0, 1, 0}, {2, 2, 4}), 1), ElementsAre(run{4, 8}, run{16, 8}));
  EXPECT_EQ(run_count(shape_t{2, 3, 4}, make_box({0, 0, 1}, {2, 3, 2})), 6u);
}

TEST(for_each_run, empty_boxes_have_no_runs) {
  EXPECT_TRUE(runs_of({4, 5}, make_box({1, 1}, {0, 3}), 4).empty());
  EXPECT_TRUE(runs_of({4, 5}, make_box({1, 5}, {3, 0}), 4).empty());
  EXPECT_TRUE(runs_of({0, 5}, whole(shape_t{0, 5}), 4).empty());
  EXPECT_EQ(run_count(shape_t{4, 5}, make_box({1, 1}, {0, 3})), 0u);
}

struct random_box {
  shape_t shape;
  box b;
};

random_box make_random_box(std::mt19937_64& rng, int max_rank, std::int64_t max_dim, bool allow_empty) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  random_box r;
  const int rank = static_cast<int>(pick(1, max_rank));
  for (int d = 0; d < rank; ++d) {
    const auto n = pick(1, max_dim);
    // Often the whole dim, to exercise folding.
    const auto e = pick(0, 2) == 0 ? n : pick(allow_empty ? 0 : 1, n);
    r.shape.push_back(n);
    r.b.offset.push_back(pick(0, n - e));
    r.b.extent.push_back(e);
  }
  return r;
}

TEST(for_each_run, property_runs_are_the_boxes_bytes_in_order_and_maximal) {
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 3000; ++iter) {
    const auto rb = make_random_box(rng, 4, 6, true);
    const std::size_t element = std::size_t{1} << (iter % 4);
    const auto runs = runs_of(rb.shape, rb.b, element);
    EXPECT_EQ(runs.size(), run_count(rb.shape, rb.b));
    std::vector<std::uint64_t> bytes;
    for (std::size_t k = 0; k < runs.size(); ++k) {
      ASSERT_GT(runs[k].second, 0u);
      ASSERT_EQ(runs[k].second % element, 0u);
      if (k > 0) {
        ASSERT_GT(runs[k].first, runs[k - 1].first + runs[k - 1].second)
            << "runs must be maximal (not adjacent) and increasing: " << rb.b.to_string() << " of "
            << shape_to_string(rb.shape);
      }
      for (std::uint64_t o = 0; o < runs[k].second; ++o) bytes.push_back(runs[k].first + o);
    }
    ASSERT_EQ(bytes, naive_byte_offsets(rb.shape, rb.b, element))
        << rb.b.to_string() << " of " << shape_to_string(rb.shape);
  }
}

TEST(copy_box, between_different_shapes_copies_exactly_the_box) {
  // A column block of a 4x6 into rows of a 3x8 at [1, 2].
  const shape_t src_shape{4, 6}, dst_shape{3, 8};
  std::vector<std::int32_t> src(24), dst(24, -1), want(24, -1);
  for (int i = 0; i < 24; ++i) src[i] = i;
  const box from = make_box({1, 2}, {2, 3});
  copy_box(reinterpret_cast<const std::byte*>(src.data()), src_shape, from, reinterpret_cast<std::byte*>(dst.data()),
           dst_shape, shape_t{1, 2}, 4);
  // Rows 1..2, columns 2..4 of src: 8 9 10 / 14 15 16 at dst rows 1..2, columns 2..4.
  want[1 * 8 + 2] = 8, want[1 * 8 + 3] = 9, want[1 * 8 + 4] = 10;
  want[2 * 8 + 2] = 14, want[2 * 8 + 3] = 15, want[2 * 8 + 4] = 16;
  EXPECT_EQ(dst, want);
}

TEST(copy_box, property_matches_naive_element_loop_on_random_shapes) {
  std::mt19937_64 rng(1234);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 3000; ++iter) {
    auto rs = make_random_box(rng, 4, 6, true);
    const std::size_t element = std::size_t{1} << pick(0, 3);
    // A destination of the same rank, each dim at least the box's extent, at a random offset.
    shape_t dst_shape, at;
    for (std::size_t d = 0; d < rs.shape.size(); ++d) {
      const auto n = rs.b.extent[d] + pick(0, 3);
      dst_shape.push_back(n);
      at.push_back(pick(0, n - rs.b.extent[d]));
    }
    const auto src = pattern(numel_of(rs.shape) * element, iter);
    std::vector<std::byte> got(numel_of(dst_shape) * element, std::byte{0xee}), want = got;
    copy_box(src.data(), rs.shape, rs.b, got.data(), dst_shape, at, element);
    naive_copy(src.data(), rs.shape, rs.b, want.data(), dst_shape, at, element);
    ASSERT_EQ(got, want) << "iteration " << iter << ": " << rs.b.to_string() << " of " << shape_to_string(rs.shape)
                         << " to " << shape_to_string(dst_shape) << " at " << shape_to_string(at);
  }
}

// ---------------------------------------------------------------- JSON

source_layout read_back(const json& j, const update_metadata& meta) {
  json_reader r(j, "layout");
  return read_source_layout(r, meta);
}

TEST(layout_json, source_layout_round_trip_with_overrides) {
  const auto meta = meta_of({spec("a", {4, 4}), spec("b", {4}), spec("c", {4, 2}), spec("s", {})});
  auto l =
      source_layout::uniform(meta, device_mesh{{2, 2}, {3, 1, 2, 0}}, {placement::shard(0), placement::replicate()});
  l.tensors[0].placements = {placement::shard(1), placement::shard(0)};
  l.tensors[2].placements = {placement::replicate(), placement::replicate()};
  const json j = write_source_layout(l);
  EXPECT_TRUE(j.contains("tensors")) << j.dump();
  const auto back = read_back(j, meta);
  EXPECT_EQ(back.mesh, l.mesh) << j.dump();
  EXPECT_EQ(back.tensors, l.tensors) << j.dump();
  // The compact form reads back as uniform.
  const auto u = source_layout::uniform(meta, device_mesh{{4}, {}}, {placement::shard(0)});
  const json ju = write_source_layout(u);
  EXPECT_FALSE(ju.contains("tensors")) << ju.dump();
  const auto ub = read_back(ju, meta);
  EXPECT_EQ(ub.mesh, u.mesh);
  EXPECT_EQ(ub.tensors, u.tensors);
}

TEST(layout_json, default_sharding_a_dim_that_overridden_tensors_lack) {
  // Column-sharded weights with replicated 1-D biases: the common placement
  // (shard(1)) is the default, the biases are overrides. The default alone would
  // not fit a bias, the override does.
  const auto meta = meta_of({spec("w0", {4, 6}), spec("w1", {4, 6}), spec("w2", {4, 6}), spec("bias", {4})});
  source_layout l;
  l.mesh = {{2}, {}};
  for (const auto& t : meta.tensors)
    l.tensors.push_back({t, {t.shape.size() > 1 ? placement::shard(1) : placement::replicate()}});
  l.validate();
  const json j = write_source_layout(l);
  EXPECT_EQ(j.at("placements"), json::array({"shard(1)"})) << j.dump();
  const auto back = read_back(j, meta);
  EXPECT_EQ(back.tensors, l.tensors) << j.dump();
  // Written by hand the same way.
  const auto hand = read_back(json::parse(R"j({"mesh": [2], "placements": ["shard(1)"],
                                               "tensors": {"bias": ["replicate"]}})j"),
                              meta);
  EXPECT_EQ(hand.tensors, l.tensors);
  // Without the override it is refused, naming the tensor.
  auto e = REFIT_THROWN(read_back(json::parse(R"j({"mesh": [2], "placements": ["shard(1)"]})j"), meta));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("'bias'"));
}

TEST(layout_json, bad_source_layouts_are_invalid_argument) {
  const auto meta = meta_of({spec("a", {4, 4})});
  for (const char* text :
       {R"j({"mesh": [2], "placements": ["shard(0)", "shard(1)"]})j", R"j({"mesh": [0], "placements": ["shard(0)"]})j",
        R"j({"mesh": [2], "placements": ["sharded"]})j",
        R"j({"mesh": [2], "placements": ["shard(0)"], "tensors": {"zz": ["replicate"]}})j",
        R"j({"mesh": [2], "placements": ["shard(0)"], "tensors": {"a": ["shard(5)"]}})j",
        R"j({"mesh": [2], "ranks": [0, 0]})j"}) {
    const json j = json::parse(text);
    json_reader r(j, "layout");
    EXPECT_EQ(REFIT_THROWN(read_source_layout(r, meta)).kind(), errc::invalid_argument) << text;
  }
}

TEST(layout_json, dest_layouts_preset_and_explicit) {
  const auto global = llama({.layers = 1});
  {
    const json j = json::parse(R"j({"preset": "vllm_llama", "tp_size": 2})j");
    json_reader r(j, "dest");
    const auto ws = read_dest_layouts(r, global);
    ASSERT_EQ(ws.size(), 2u);
    for (int w = 0; w < 2; ++w) EXPECT_EQ(ws[w], tensor_parallel_layout(global, 2, w, vllm_llama_layout()));
  }
  {
    const json j = json::parse(R"j({"workers": [[{"name": "x", "dtype": "bfloat16", "shape": [2, 8],
        "pieces": [{"source": "model.norm.weight", "offset": [0], "extent": [8], "at": [0]}]}]]})j");
    json_reader r(j, "dest");
    const auto ws = read_dest_layouts(r, global);
    ASSERT_EQ(ws.size(), 1u);
    ASSERT_EQ(ws[0].tensors.size(), 1u);
    EXPECT_EQ(ws[0].tensors[0].spec, spec("x", {2, 8}, dtype::bfloat16));
    EXPECT_EQ(ws[0].tensors[0].pieces[0], (dest_piece{"model.norm.weight", make_box({0}, {8}), {0}}));
  }
  for (const char* text : {R"j({"preset": "megatron", "tp_size": 2})j", R"j({"preset": "vllm_llama", "tp_size": 0})j",
                           R"j({"workers": []})j", R"j({"workers": [[{"name": "x", "dtype": "bfloat16", "shape": [2],
                               "pieces": [{"source": "a", "offset": [0], "extent": [1], "at": [0], "extra": 1}]}]]})j"}) {
    const json j = json::parse(text);
    json_reader r(j, "dest");
    EXPECT_EQ(REFIT_THROWN(read_dest_layouts(r, global)).kind(), errc::invalid_argument) << text;
  }
}

}  // namespace
}  // namespace refit
