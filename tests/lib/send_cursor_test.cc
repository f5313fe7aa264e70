#include <refit/backend/send_cursor.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <refit/trainer.h>
#include "tests/lib/expect.h"
#include "tests/support/tensors.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using testing::tensor_set;

wire_params wire(std::uint64_t buffer_bytes) {
  wire_params w;
  w.buffer_bytes = buffer_bytes;
  return w;
}

// A source over a vector of views that counts how many it handed out.
class vector_source final : public tensor_source {
 public:
  explicit vector_source(std::vector<tensor_view> views) : views_(std::move(views)) {}
  std::optional<tensor_view> next() override {
    if (at_ == views_.size()) return std::nullopt;
    return views_[at_++];
  }
  std::size_t pulled() const { return at_; }

 private:
  std::vector<tensor_view> views_;
  std::size_t at_ = 0;
};

std::vector<std::byte> flatten(const std::vector<asio::const_buffer>& buffers) {
  std::vector<std::byte> out;
  for (const auto& b : buffers) {
    auto* p = static_cast<const std::byte*>(b.data());
    out.insert(out.end(), p, p + b.size());
  }
  return out;
}

// The payload image of bucket `b` as the receiver expects it: pieces at their
// offsets, zeros in between.
std::vector<std::byte> expected_image(const bucket_plan& plan, const bucket& b, tensor_set& set) {
  std::vector<std::byte> image(b.payload_bytes, std::byte{0});
  for (const auto& p : plan.pieces_of(b))
    if (p.bytes > 0)  // an empty tensor's storage may be null
      std::memcpy(image.data() + p.bucket_offset, set.data[p.tensor].data() + p.tensor_offset, p.bytes);
  return image;
}

tensor_set mixed_set() {
  tensor_set set;
  set.add("embed", dtype::bfloat16, {100, 30});  // 6000 bytes: split at 4096
  set.add("norm", dtype::float32, {7});          // 28 bytes
  set.add("bias", dtype::float16, {3});          // 6 bytes, padded after
  set.add("empty", dtype::float32, {0});
  set.add("flag", dtype::bool_, {5});
  set.add("proj", dtype::float8_e5m2, {40, 50});  // 2000 bytes
  set.add("head", dtype::bfloat16, {2100});       // 4200 bytes: split
  set.add("tail", dtype::int64, {});
  return set;
}

TEST(send_cursor, gathers_every_bucket_as_the_receiver_lays_it_out) {
  tensor_set set = mixed_set();
  const wire_params w = wire(4096);
  const bucket_plan plan = plan_buckets(set.meta, w);
  vector_source source(set.views());
  send_cursor cursor(set.meta, plan, source);
  for (const bucket& b : plan.buckets) {
    SCOPED_TRACE("bucket " + std::to_string(b.index));
    const auto& buffers = cursor.gather(b);
    EXPECT_EQ(asio::buffer_size(buffers), b.payload_bytes);
    EXPECT_EQ(flatten(buffers), expected_image(plan, b, set));
    for (const auto& buf : buffers) EXPECT_GT(buf.size(), 0u) << "no empty iovecs";
  }
  EXPECT_NO_THROW(cursor.finish());
  EXPECT_EQ(source.pulled(), set.meta.tensors.size());
  EXPECT_EQ(cursor.view(1).name, "norm");
}

TEST(send_cursor, split_chunks_point_into_the_trainers_tensor_without_copies) {
  tensor_set set;
  set.add("big", dtype::int8, {10000});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  ASSERT_EQ(plan.buckets.size(), 3u);
  vector_source source(set.views());
  send_cursor cursor(set.meta, plan, source);
  for (std::size_t k = 0; k < 3; ++k) {
    const auto& buffers = cursor.gather(plan.buckets[k]);
    ASSERT_EQ(buffers.size(), 1u);
    EXPECT_EQ(buffers[0].data(), set.data[0].data() + 4096 * k);
  }
  cursor.finish();
}

TEST(send_cursor, adjacent_tensors_in_memory_become_one_buffer) {
  // Two tensors laid out back to back exactly as in the bucket: one iovec.
  alignas(64) static std::byte arena[128];
  for (std::size_t i = 0; i < sizeof arena; ++i) arena[i] = std::byte(i);
  std::vector<std::int64_t> shape{64};
  std::vector<tensor_view> views{tensor_view("a", dtype::int8, shape, arena),
                                 tensor_view("b", dtype::int8, shape, arena + 64)};
  update_metadata meta = describe(views);
  const bucket_plan plan = plan_buckets(meta, wire(4096));
  vector_source source(views);
  send_cursor cursor(meta, plan, source);
  const auto& buffers = cursor.gather(plan.buckets[0]);
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers[0].data(), arena);
  EXPECT_EQ(buffers[0].size(), 128u);
}

TEST(send_cursor, padding_between_tensors_is_zeros) {
  tensor_set set;
  set.add("a", dtype::int8, {1});
  set.add("b", dtype::int8, {1});
  set.data[0][0] = std::byte{0xAA};
  set.data[1][0] = std::byte{0xBB};
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  vector_source source(set.views());
  send_cursor cursor(set.meta, plan, source);
  auto image = flatten(cursor.gather(plan.buckets[0]));
  ASSERT_EQ(image.size(), 65u);
  EXPECT_EQ(image[0], std::byte{0xAA});
  for (std::size_t i = 1; i < 64; ++i) EXPECT_EQ(image[i], std::byte{0}) << i;
  EXPECT_EQ(image[64], std::byte{0xBB});
}

TEST(send_cursor, first_divergent_parameter_is_named) {
  tensor_set set;
  set.add("w0", dtype::float32, {4});
  set.add("w1", dtype::float32, {4});
  set.add("w2", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));

  auto views = set.views();
  std::vector<std::int64_t> wrong{5};
  views[1].shape = wrong;
  views[2].dtype = dtype::int32;  // also wrong, but later: #1 is reported
  vector_source shape_source(views);
  send_cursor c1(set.meta, plan, shape_source);
  auto e = REFIT_THROWN(c1.gather(plan.buckets[0]));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "parameter #1 ('w1') shape: declared [4], sent [5]");

  views = set.views();
  views[2].name = "w3";
  vector_source name_source(views);
  send_cursor c2(set.meta, plan, name_source);
  e = REFIT_THROWN(c2.gather(plan.buckets[0]));
  EXPECT_EQ(e.message(), "parameter #2 ('w2') name: declared 'w2', sent 'w3'");

  views = set.views();
  views[0].dtype = dtype::bfloat16;
  vector_source dtype_source(views);
  send_cursor c3(set.meta, plan, dtype_source);
  e = REFIT_THROWN(c3.gather(plan.buckets[0]));
  EXPECT_EQ(e.message(), "parameter #0 ('w0') dtype: declared float32, sent bfloat16");
}

TEST(send_cursor, too_few_tensors_names_the_first_missing_one) {
  tensor_set set;
  set.add("a", dtype::float32, {4});
  set.add("b", dtype::float32, {4});
  set.add("c", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  auto views = set.views();
  views.pop_back();
  vector_source source(views);
  send_cursor cursor(set.meta, plan, source);
  auto e = REFIT_THROWN(cursor.gather(plan.buckets[0]));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "trainer sent 2 tensor(s) but declared 3; first missing: 'c'");
}

TEST(send_cursor, too_many_tensors_are_caught_by_finish) {
  tensor_set set;
  set.add("a", dtype::float32, {4});
  set.add("b", dtype::float32, {4});
  tensor_set extra;
  extra.add("c", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  auto views = set.views();
  views.push_back(extra.views()[0]);
  vector_source source(views);
  send_cursor cursor(set.meta, plan, source);
  for (const auto& b : plan.buckets) cursor.gather(b);
  auto e = REFIT_THROWN(cursor.finish());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "trainer sent more tensors than the 2 declared; first extra: 'c'");
}

TEST(send_cursor, finish_pulls_and_checks_tensors_no_bucket_asked_for) {
  tensor_set set;
  set.add("a", dtype::float32, {4});
  set.add("b", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  {
    vector_source source(set.views());
    send_cursor cursor(set.meta, plan, source);
    EXPECT_NO_THROW(cursor.finish());
    EXPECT_EQ(source.pulled(), 2u);
  }
  {
    auto views = set.views();
    views.pop_back();
    vector_source source(views);
    send_cursor cursor(set.meta, plan, source);
    auto e = REFIT_THROWN(cursor.finish());
    EXPECT_EQ(e.message(), "trainer sent 1 tensor(s) but declared 2; first missing: 'b'");
  }
  {
    auto views = set.views();
    views[1].name = "x";
    vector_source source(views);
    send_cursor cursor(set.meta, plan, source);
    auto e = REFIT_THROWN(cursor.finish());
    EXPECT_EQ(e.message(), "parameter #1 ('b') name: declared 'b', sent 'x'");
  }
}

TEST(send_cursor, empty_declaration_accepts_only_an_empty_source) {
  update_metadata none;
  const bucket_plan plan = plan_buckets(none, wire(4096));
  vector_source empty({});
  send_cursor ok(none, plan, empty);
  EXPECT_NO_THROW(ok.finish());
  tensor_set set;
  set.add("stray", dtype::int8, {1});
  vector_source one(set.views());
  send_cursor bad(none, plan, one);
  auto e = REFIT_THROWN(bad.finish());
  EXPECT_EQ(e.message(), "trainer sent more tensors than the 0 declared; first extra: 'stray'");
}

TEST(send_cursor, device_memory_is_refused_unless_allowed) {
  tensor_set set;
  set.add("w", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  auto views = set.views();
  views[0].device = device::cuda(1);
  {
    vector_source source(views);
    send_cursor cursor(set.meta, plan, source);
    auto e = REFIT_THROWN(cursor.gather(plan.buckets[0]));
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_EQ(e.message(), "parameter #0 ('w') is on cuda:1; this backend sends host memory only");
  }
  {
    vector_source source(views);
    send_cursor cursor(set.meta, plan, source, /*allow_device=*/true);
    const auto& buffers = cursor.gather(plan.buckets[0]);
    ASSERT_EQ(buffers.size(), 1u);
    EXPECT_EQ(buffers[0].data(), set.data[0].data());
    EXPECT_EQ(cursor.view(0).device, device::cuda(1));
  }
}

TEST(send_cursor, null_data_is_refused_except_for_empty_tensors) {
  update_metadata meta;
  meta.tensors = {{"empty", dtype::float32, {0}}, {"w", dtype::float32, {2}}};
  const bucket_plan plan = plan_buckets(meta, wire(4096));
  std::vector<tensor_view> views{tensor_view(meta.tensors[0], nullptr), tensor_view(meta.tensors[1], nullptr)};
  vector_source source(views);
  send_cursor cursor(meta, plan, source);
  auto e = REFIT_THROWN(cursor.gather(plan.buckets[0]));
  EXPECT_EQ(e.message(), "parameter #1 ('w') data: declared non-null data, sent a null pointer");
}

TEST(send_cursor, view_of_an_unpulled_index_throws) {
  tensor_set set;
  set.add("w", dtype::float32, {4});
  const bucket_plan plan = plan_buckets(set.meta, wire(4096));
  vector_source source(set.views());
  send_cursor cursor(set.meta, plan, source);
  EXPECT_THROW(cursor.view(0), std::out_of_range);
}

// ---- trainer.h helpers ----

TEST(range_source, yields_the_range_in_order_then_ends) {
  tensor_set set;
  set.add("a", dtype::int8, {1});
  set.add("b", dtype::int8, {2});
  auto views = set.views();
  range_source<std::vector<tensor_view>> source(views);
  auto first = source.next();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->name, "a");
  auto second = source.next();
  ASSERT_TRUE(second);
  EXPECT_EQ(second->name, "b");
  EXPECT_FALSE(source.next());
  EXPECT_FALSE(source.next());
}

TEST(describe, declares_what_the_views_are_and_rejects_duplicates) {
  tensor_set set;
  set.add("a", dtype::bfloat16, {2, 3});
  set.add("b", dtype::int64, {});
  auto views = set.views();
  update_metadata meta = describe(views);
  EXPECT_EQ(meta.tensors, set.meta.tensors);
  views.push_back(views[0]);
  auto e = REFIT_THROWN(describe(views));
  EXPECT_EQ(e.message(), "update metadata: duplicate tensor name 'a' (at #2)");
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {
TEST(pack_pieces, copies_a_gather_list_back_to_back) {
  const char a[] = "abc", b[] = "", c[] = "defg";
  std::vector<asio::const_buffer> pieces{asio::buffer(a, 3), asio::buffer(b, 0), asio::buffer(c, 4)};
  std::byte out[8]{};
  EXPECT_EQ(pack_pieces(pieces, out), 7u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(out), 7), "abcdefg");
}
}  // namespace
}  // namespace refit
