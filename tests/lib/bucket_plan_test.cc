#include <refit/backend/bucket_plan.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::HasSubstr;

wire_params wire(std::uint64_t buffer_bytes, std::uint32_t num_buffers = 2) {
  wire_params w;
  w.buffer_bytes = buffer_bytes;
  w.num_buffers = num_buffers;
  return w;
}

// A metadata list of int8 tensors with the given byte sizes: sizes are exact.
update_metadata bytes_of(std::vector<std::int64_t> sizes) {
  update_metadata meta;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    meta.tensors.push_back({"t" + std::to_string(i), dtype::int8, {sizes[i]}});
  return meta;
}

// Every property the receiver and the sender rely on, checked for one plan.
void check_invariants(const update_metadata& meta, const wire_params& params, const bucket_plan& plan) {
  const std::uint64_t cap = params.buffer_bytes;
  std::vector<std::uint64_t> covered(meta.tensors.size(), 0);
  std::uint64_t payload_sum = 0, largest_split = 0;
  std::uint32_t next_piece = 0;
  std::int64_t last_tensor = -1;
  for (std::size_t k = 0; k < plan.buckets.size(); ++k) {
    const bucket& b = plan.buckets[k];
    SCOPED_TRACE("bucket " + std::to_string(k));
    EXPECT_EQ(b.index, k);
    EXPECT_EQ(b.first_piece, next_piece) << "pieces must be listed in bucket order";
    ASSERT_GE(b.piece_count, 1u);
    next_piece += b.piece_count;
    EXPECT_LE(b.payload_bytes, cap);
    payload_sum += b.payload_bytes;
    auto pieces = plan.pieces_of(b);
    if (b.split) {
      ASSERT_EQ(pieces.size(), 1u);
      const bucket_piece& p = pieces[0];
      const std::uint64_t n = meta.tensors[p.tensor].nbytes();
      EXPECT_GT(n, cap) << "only tensors larger than a buffer are split";
      EXPECT_EQ(p.bucket_offset, 0u);
      EXPECT_EQ(p.bytes, b.payload_bytes);
      EXPECT_EQ(p.tensor_offset, covered[p.tensor]) << "chunks are consecutive";
      EXPECT_EQ(b.last_chunk, p.tensor_offset + p.bytes == n);
      if (!b.last_chunk) {
        EXPECT_EQ(p.bytes, cap) << "only the last chunk may be short";
      }
      largest_split = std::max(largest_split, n);
      covered[p.tensor] += p.bytes;
      EXPECT_GE(static_cast<std::int64_t>(p.tensor), last_tensor);
      last_tensor = p.tensor;
    } else {
      EXPECT_FALSE(b.last_chunk);
      std::uint64_t end = 0;
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        const bucket_piece& p = pieces[i];
        const std::uint64_t n = meta.tensors[p.tensor].nbytes();
        EXPECT_LE(n, cap);
        EXPECT_EQ(p.tensor_offset, 0u) << "packed tensors ride whole";
        EXPECT_EQ(p.bytes, n);
        EXPECT_EQ(p.bucket_offset % wire_params::alignment, 0u) << "piece " << i << " misaligned";
        EXPECT_GE(p.bucket_offset, end) << "pieces overlap";
        EXPECT_LT(p.bucket_offset - end, i == 0 ? 1u : wire_params::alignment) << "more padding than alignment needs";
        end = p.bucket_offset + p.bytes;
        EXPECT_EQ(covered[p.tensor], 0u) << "tensor " << p.tensor << " placed twice";
        covered[p.tensor] = n;
        EXPECT_GT(static_cast<std::int64_t>(p.tensor), last_tensor) << "send order preserved";
        last_tensor = p.tensor;
      }
      EXPECT_EQ(b.payload_bytes, end) << "payload ends at the last piece";
    }
  }
  EXPECT_EQ(next_piece, plan.pieces.size());
  for (std::size_t i = 0; i < meta.tensors.size(); ++i)
    EXPECT_EQ(covered[i], meta.tensors[i].nbytes()) << "tensor " << i << " not fully covered";
  EXPECT_EQ(plan.tensor_bytes, meta.total_bytes());
  EXPECT_EQ(plan.payload_bytes, payload_sum);
  EXPECT_EQ(plan.largest_split_tensor, largest_split);
}

bool same_plan(const bucket_plan& a, const bucket_plan& b) {
  if (a.buckets.size() != b.buckets.size() || a.pieces.size() != b.pieces.size()) return false;
  for (std::size_t i = 0; i < a.buckets.size(); ++i) {
    const auto &x = a.buckets[i], &y = b.buckets[i];
    if (x.index != y.index || x.payload_bytes != y.payload_bytes || x.first_piece != y.first_piece ||
        x.piece_count != y.piece_count || x.split != y.split || x.last_chunk != y.last_chunk)
      return false;
  }
  for (std::size_t i = 0; i < a.pieces.size(); ++i) {
    const auto &x = a.pieces[i], &y = b.pieces[i];
    if (x.tensor != y.tensor || x.tensor_offset != y.tensor_offset || x.bucket_offset != y.bucket_offset ||
        x.bytes != y.bytes)
      return false;
  }
  return a.tensor_bytes == b.tensor_bytes && a.payload_bytes == b.payload_bytes &&
         a.largest_split_tensor == b.largest_split_tensor;
}

// ---- wire_params ----

TEST(wire_params, validate_accepts_the_documented_bounds) {
  EXPECT_NO_THROW(wire_params{}.validate());
  EXPECT_NO_THROW(wire(4096, 1).validate());
  EXPECT_NO_THROW(wire(16ull << 30, 64).validate());
}

TEST(wire_params, validate_rejects_values_outside_with_the_value) {
  auto e = REFIT_THROWN(wire(4095).validate());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "wire params: buffer_bytes must be in [4096, 16 GiB], got 4095");
  e = REFIT_THROWN(wire((16ull << 30) + 1).validate());
  EXPECT_THAT(e.message(), HasSubstr("got 17179869185"));
  e = REFIT_THROWN(wire(4096, 0).validate());
  EXPECT_EQ(e.message(), "wire params: num_buffers must be in [1, 64], got 0");
  e = REFIT_THROWN(wire(4096, 65).validate());
  EXPECT_EQ(e.message(), "wire params: num_buffers must be in [1, 64], got 65");
}

TEST(wire_params, read_uses_defaults_and_write_round_trips) {
  json empty = json::object();
  json_reader r0(empty, "tcp init_info");
  EXPECT_EQ(wire_params::read(r0), wire_params{});
  json j = json::object();
  wire(1 << 20, 5).write(j);
  EXPECT_EQ(j, json::parse(R"({"buffer_bytes": 1048576, "num_buffers": 5, "checksums": false})"));
  json_reader r(j, "tcp init_info");
  EXPECT_EQ(wire_params::read(r), wire(1 << 20, 5));
  EXPECT_NO_THROW(r.finish());
}

TEST(wire_params, read_errors_carry_the_context) {
  json j = json::parse(R"({"buffer_bytes": 100})");
  json_reader r(j, "tcp init_info");
  auto e = REFIT_THROWN(wire_params::read(r));
  EXPECT_EQ(e.message(), "tcp init_info: wire params: buffer_bytes must be in [4096, 16 GiB], got 100");
  json k = json::parse(R"({"num_buffers": -2})");
  json_reader rk(k, "tcp init_info");
  e = REFIT_THROWN(wire_params::read(rk));
  EXPECT_EQ(e.message(), "tcp init_info: member 'num_buffers' must not be negative, got -2");
  json m = json::parse(R"({"num_buffers": 4294967296})");
  json_reader rm(m, "tcp init_info");
  e = REFIT_THROWN(wire_params::read(rm));
  EXPECT_THAT(e.message(), HasSubstr("member 'num_buffers' is 4294967296, above the maximum 4294967295"));
}

// ---- plan_buckets ----

TEST(plan_buckets, empty_update_has_no_buckets) {
  auto plan = plan_buckets({}, wire(4096));
  EXPECT_TRUE(plan.buckets.empty());
  EXPECT_TRUE(plan.pieces.empty());
  EXPECT_EQ(plan.tensor_bytes, 0u);
  EXPECT_EQ(plan.payload_bytes, 0u);
  EXPECT_EQ(plan.largest_split_tensor, 0u);
}

TEST(plan_buckets, rejects_invalid_params_and_shapes) {
  auto e = REFIT_THROWN(plan_buckets(bytes_of({1}), wire(100)));
  EXPECT_THAT(e.message(), HasSubstr("buffer_bytes must be in"));
  update_metadata bad;
  bad.tensors = {{"neg", dtype::float32, {-1}}};
  e = REFIT_THROWN(plan_buckets(bad, wire(4096)));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor 'neg'"));
}

TEST(plan_buckets, small_tensors_pack_at_aligned_offsets) {
  update_metadata meta;
  meta.tensors = {{"a", dtype::float16, {3}},   // 6 bytes at 0
                  {"b", dtype::float32, {4}},   // 16 bytes at 64
                  {"c", dtype::int8, {64}},     // 64 bytes at 128
                  {"d", dtype::float64, {1}}};  // 8 bytes at 192
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 1u);
  ASSERT_EQ(plan.pieces.size(), 4u);
  EXPECT_EQ(plan.pieces[0].bucket_offset, 0u);
  EXPECT_EQ(plan.pieces[1].bucket_offset, 64u);
  EXPECT_EQ(plan.pieces[2].bucket_offset, 128u);
  EXPECT_EQ(plan.pieces[3].bucket_offset, 192u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 200u);
  EXPECT_EQ(plan.tensor_bytes, 6u + 16 + 64 + 8);
  EXPECT_EQ(plan.payload_bytes, 200u);
}

TEST(plan_buckets, exact_fit_stays_in_one_bucket_and_one_more_byte_opens_the_next) {
  // 4096 = 2048 + 2048: fits exactly.
  auto meta = bytes_of({2048, 2048});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 4096u);

  // Alignment counts: 2000 pads to 2048, then 2048 still fits exactly.
  meta = bytes_of({2000, 2048});
  plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_EQ(plan.pieces[1].bucket_offset, 2048u);

  // ... but 2049 after the padded 2000 does not.
  meta = bytes_of({2000, 2049});
  plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 2000u) << "no trailing padding";
  EXPECT_EQ(plan.buckets[1].payload_bytes, 2049u);
  EXPECT_EQ(plan.pieces[1].bucket_offset, 0u);
}

TEST(plan_buckets, tensor_of_exactly_a_buffer_is_not_split) {
  auto meta = bytes_of({10, 4096, 10});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 3u);
  for (const auto& b : plan.buckets) EXPECT_FALSE(b.split);
  EXPECT_EQ(plan.buckets[1].payload_bytes, 4096u);
  EXPECT_EQ(plan.largest_split_tensor, 0u);
}

TEST(plan_buckets, tensor_one_byte_over_a_buffer_is_split_in_two) {
  auto meta = bytes_of({4097});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_TRUE(plan.buckets[0].split);
  EXPECT_FALSE(plan.buckets[0].last_chunk);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 4096u);
  EXPECT_TRUE(plan.buckets[1].split);
  EXPECT_TRUE(plan.buckets[1].last_chunk);
  EXPECT_EQ(plan.buckets[1].payload_bytes, 1u);
  EXPECT_EQ(plan.pieces[1].tensor_offset, 4096u);
  EXPECT_EQ(plan.largest_split_tensor, 4097u);
}

TEST(plan_buckets, split_tensor_of_whole_buffers_has_no_empty_tail) {
  auto meta = bytes_of({3 * 4096});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 3u);
  EXPECT_TRUE(plan.buckets[2].last_chunk);
  EXPECT_EQ(plan.buckets[2].payload_bytes, 4096u);
}

TEST(plan_buckets, split_tensor_closes_the_open_bucket_and_later_tensors_start_a_new_one) {
  auto meta = bytes_of({100, 200, 10000, 300, 9000, 50});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  // {t0,t1} | t2 x3 | {t3} | t4 x3 | {t5}
  ASSERT_EQ(plan.buckets.size(), 9u);
  EXPECT_FALSE(plan.buckets[0].split);
  EXPECT_EQ(plan.buckets[0].piece_count, 2u);
  for (int k : {1, 2, 3}) EXPECT_TRUE(plan.buckets[k].split);
  EXPECT_FALSE(plan.buckets[4].split);
  EXPECT_EQ(plan.pieces_of(plan.buckets[4])[0].tensor, 3u);
  for (int k : {5, 6, 7}) EXPECT_TRUE(plan.buckets[k].split);
  EXPECT_EQ(plan.pieces_of(plan.buckets[8])[0].tensor, 5u);
  EXPECT_EQ(plan.largest_split_tensor, 10000u);
}

TEST(plan_buckets, zero_size_tensors_ride_in_packed_buckets) {
  update_metadata meta;
  meta.tensors = {{"e0", dtype::float32, {0}},  {"x", dtype::int8, {10}},    {"e1", dtype::bfloat16, {4, 0}},
                  {"big", dtype::int8, {5000}}, {"e2", dtype::float32, {0}}, {"big2", dtype::int8, {5000}}};
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  // {e0, x, e1} | big x2 | {e2} (a packed bucket of no bytes) | big2 x2
  ASSERT_EQ(plan.buckets.size(), 6u);
  EXPECT_EQ(plan.buckets[0].piece_count, 3u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 64u) << "e1 sits at the aligned offset after x";
  EXPECT_FALSE(plan.buckets[3].split);
  EXPECT_EQ(plan.buckets[3].payload_bytes, 0u);
  EXPECT_EQ(plan.pieces_of(plan.buckets[3])[0].tensor, 4u);
}

TEST(plan_buckets, only_zero_size_tensors_make_one_empty_bucket) {
  auto meta = bytes_of({0, 0, 0});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_EQ(plan.buckets[0].piece_count, 3u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 0u);
}

TEST(plan_buckets, zero_size_tensor_after_a_full_bucket_fits_at_its_end) {
  auto meta = bytes_of({4096, 0, 1});
  auto plan = plan_buckets(meta, wire(4096));
  check_invariants(meta, wire(4096), plan);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].piece_count, 2u);
  EXPECT_EQ(plan.pieces[1].bucket_offset, 4096u);
  EXPECT_EQ(plan.buckets[0].payload_bytes, 4096u);
}

TEST(plan_buckets, unaligned_buffer_size_still_respects_the_cap) {
  // 4100 is not a multiple of 64: the aligned offset after 4090 bytes (4096) plus 5
  // would pass the cap.
  auto meta = bytes_of({4090, 5, 0, 4});
  auto plan = plan_buckets(meta, wire(4100));
  check_invariants(meta, wire(4100), plan);
  ASSERT_EQ(plan.buckets.size(), 2u);
  EXPECT_EQ(plan.buckets[0].piece_count, 1u);
  EXPECT_EQ(plan.buckets[1].piece_count, 3u);
}

TEST(plan_buckets, is_deterministic_and_holds_its_invariants_on_varied_updates) {
  std::mt19937_64 rng(20240611);  // fixed seed: the same updates every run
  for (int round = 0; round < 200; ++round) {
    const std::uint64_t cap = 4096 + (rng() % 4) * 1000 + (rng() % 2) * 7;
    update_metadata meta;
    const int count = static_cast<int>(rng() % 30);
    for (int i = 0; i < count; ++i) {
      const dtype types[] = {dtype::int8, dtype::float16, dtype::float32, dtype::float64};
      dtype t = types[rng() % 4];
      std::int64_t elems;
      switch (rng() % 5) {
        case 0:
          elems = 0;
          break;
        case 1:
          elems = static_cast<std::int64_t>(rng() % 8);
          break;
        case 2:
          elems = static_cast<std::int64_t>(rng() % 2000);
          break;
        case 3:
          elems = static_cast<std::int64_t>(cap / element_size(t));
          break;  // exact fit
        default:
          elems = static_cast<std::int64_t>(rng() % 20000);
          break;
      }
      meta.tensors.push_back({"r" + std::to_string(round) + "." + std::to_string(i), t, {elems}});
    }
    SCOPED_TRACE("round " + std::to_string(round) + ", cap " + std::to_string(cap));
    const wire_params w = wire(cap);
    auto a = plan_buckets(meta, w);
    auto b = plan_buckets(meta, w);
    EXPECT_TRUE(same_plan(a, b)) << "the two sides would disagree";
    check_invariants(meta, w, a);
    if (::testing::Test::HasFailure()) break;
  }
}

// Found writing tests/fuzz/info_fuzz: a declared 1 TiB tensor with 4 KiB
// buffers tried to record 2^28 buckets and ended in std::bad_alloc (or the OOM
// killer) inside the worker, before the trainer's header was even checked.
TEST(plan_buckets, absurd_bucket_counts_are_refused_before_allocating) {
  update_metadata huge;
  huge.tensors = {{"small", dtype::int8, {10}}, {"huge", dtype::uint8, {std::int64_t{1} << 40}}};
  auto e = REFIT_THROWN(plan_buckets(huge, wire(4096)));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("tensor #1 ('huge')"));
  EXPECT_THAT(e.message(), HasSubstr("more than the limit " + std::to_string(max_buckets)));
  // The largest tensor in the largest buffers is fine: 2^40 / 16 GiB = 64 buckets.
  EXPECT_EQ(plan_buckets(huge, wire(16ull << 30)).buckets.size(), 65u);
}

TEST(plan_buckets, the_bucket_limit_is_exact) {
  // max_buckets - 1 chunks of one tensor plus one packed bucket: exactly the limit.
  update_metadata meta = bytes_of({std::int64_t((max_buckets - 1) * 4096), 1});
  auto plan = plan_buckets(meta, wire(4096));
  EXPECT_EQ(plan.buckets.size(), max_buckets);
  // One more packed bucket is one too many.
  meta.tensors.push_back({"t2", dtype::int8, {4096}});
  auto e = REFIT_THROWN(plan_buckets(meta, wire(4096)));
  EXPECT_THAT(e.message(), HasSubstr("tensor #2 ('t2')"));
  // As is one more chunk of the split tensor.
  e = REFIT_THROWN(plan_buckets(bytes_of({std::int64_t(max_buckets * 4096 + 1)}), wire(4096)));
  EXPECT_THAT(e.message(), HasSubstr("tensor #0 ('t0')"));
}

TEST(plan_buckets, num_buffers_does_not_change_the_plan) {
  auto meta = bytes_of({100, 5000, 7, 4096, 0, 3000, 3000});
  EXPECT_TRUE(same_plan(plan_buckets(meta, wire(4096, 1)), plan_buckets(meta, wire(4096, 64))));
}

}  // namespace
}  // namespace refit
