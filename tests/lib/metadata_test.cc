#include <refit/json_reader.h>
#include <refit/metadata.h>

#include <limits>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

update_metadata read(const json& j, const std::string& context = "tcp update_info") {
  json_reader r(j, context);
  auto meta = read_update_metadata(r);
  r.finish();
  return meta;
}

TEST(update_metadata, reads_parallel_arrays_in_order) {
  auto meta = read(json::parse(R"({"names": ["embed", "norm", "scale"],
                                   "dtype_names": ["bfloat16", "torch.float32", "double"],
                                   "shapes": [[10, 4], [4], []]})"));
  ASSERT_EQ(meta.tensors.size(), 3u);
  EXPECT_EQ(meta.tensors[0], (tensor_spec{"embed", dtype::bfloat16, {10, 4}}));
  EXPECT_EQ(meta.tensors[1], (tensor_spec{"norm", dtype::float32, {4}}));
  EXPECT_EQ(meta.tensors[2], (tensor_spec{"scale", dtype::float64, {}}));
  EXPECT_EQ(meta.total_bytes(), 80u + 16u + 8u);
}

TEST(update_metadata, empty_update_is_valid) {
  auto meta = read(json::parse(R"({"names": [], "dtype_names": [], "shapes": []})"));
  EXPECT_TRUE(meta.tensors.empty());
  EXPECT_EQ(meta.total_bytes(), 0u);
}

TEST(update_metadata, write_then_read_round_trips_with_canonical_dtype_names) {
  update_metadata meta;
  meta.tensors = {{"a", dtype::float8_e4m3fn, {3, 3}}, {"b", dtype::bool_, {0}}, {"c", dtype::int64, {}}};
  json j = json::object();
  write_update_metadata(meta, j);
  EXPECT_EQ(j["dtype_names"], json::parse(R"(["float8_e4m3fn", "bool", "int64"])"));
  EXPECT_EQ(j["shapes"], json::parse("[[3, 3], [0], []]"));
  auto back = read(j);
  EXPECT_EQ(back.tensors, meta.tensors);
}

TEST(update_metadata, write_keeps_other_members) {
  json j = {{"version", 3}};
  write_update_metadata({}, j);
  EXPECT_EQ(j["version"], 3);
  EXPECT_EQ(j["names"], json::array());
}

TEST(update_metadata, length_mismatch_gives_all_three_lengths) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a", "b"], "dtype_names": ["float32"],
                                             "shapes": [[1], [2]]})")));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(),
            "tcp update_info: 'names', 'dtype_names' and 'shapes' must have the same length, got 2, 1 and 2");
  e = REFIT_THROWN(read(json::parse(R"({"names": ["a"], "dtype_names": ["float32"], "shapes": []})")));
  EXPECT_THAT(e.message(), HasSubstr("got 1, 1 and 0"));
}

TEST(update_metadata, unknown_dtype_names_the_element_path) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a", "b"], "dtype_names": ["float32", "float33"],
                                             "shapes": [[1], [2]]})")));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), StartsWith("tcp update_info: member 'dtype_names[1]': unknown dtype 'float33'"));
}

TEST(update_metadata, nested_metadata_errors_carry_the_object_path) {
  json j = json::parse(R"({"meta": {"names": ["a"], "dtype_names": ["f32"], "shapes": [[1]]}})");
  json_reader outer(j, "shm update_info");
  json_reader inner = outer.object("meta");
  auto e = REFIT_THROWN(read_update_metadata(inner));
  EXPECT_THAT(e.message(), StartsWith("shm update_info: member 'meta.dtype_names[0]': unknown dtype 'f32'"));
}

TEST(update_metadata, duplicate_names_are_rejected_with_position) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a", "b", "a"],
                                             "dtype_names": ["float32", "float32", "float32"],
                                             "shapes": [[1], [1], [1]]})")));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "tcp update_info: update metadata: duplicate tensor name 'a' (at #2)");
}

TEST(update_metadata, empty_name_is_rejected_with_position) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a", ""], "dtype_names": ["int8", "int8"],
                                             "shapes": [[1], [1]]})")));
  EXPECT_EQ(e.message(), "tcp update_info: update metadata: tensor #1 has an empty name");
}

TEST(update_metadata, negative_and_overflowing_shapes_name_the_tensor) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["ok", "neg"], "dtype_names": ["int8", "int8"],
                                             "shapes": [[1], [2, -1]]})")));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "tcp update_info: tensor 'neg': negative dimension in shape [2, -1]");
  e = REFIT_THROWN(read(json::parse(R"({"names": ["big"], "dtype_names": ["float32"],
                                        "shapes": [[4294967296, 4294967296]]})")));
  EXPECT_THAT(e.message(), StartsWith("tcp update_info: tensor 'big': shape [4294967296, 4294967296]"));
  EXPECT_THAT(e.message(), HasSubstr("overflows"));
}

TEST(update_metadata, mistyped_shapes_name_the_element) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a"], "dtype_names": ["int8"], "shapes": [[1.5]]})")));
  EXPECT_EQ(e.message(), "tcp update_info: member 'shapes[0][0]' expected an integer, got number 1.5");
  e = REFIT_THROWN(read(json::parse(R"({"names": ["a"], "dtype_names": ["int8"], "shapes": [3]})")));
  EXPECT_EQ(e.message(), "tcp update_info: member 'shapes[0]' expected an array, got number 3");
  e = REFIT_THROWN(read(json::parse(R"({"names": "a", "dtype_names": ["int8"], "shapes": [[3]]})")));
  EXPECT_EQ(e.message(), "tcp update_info: member 'names' expected an array, got string \"a\"");
}

TEST(update_metadata, missing_arrays_are_named) {
  auto e = REFIT_THROWN(read(json::parse(R"({"names": ["a"], "shapes": [[3]]})")));
  EXPECT_EQ(e.message(), "tcp update_info: missing required member 'dtype_names'");
}

TEST(update_metadata, validate_checks_a_programmatic_list) {
  update_metadata meta;
  meta.tensors = {{"x", dtype::float32, {2}}, {"y", dtype::float32, {3}}};
  EXPECT_NO_THROW(meta.validate());
  meta.tensors.push_back({"x", dtype::int8, {1}});
  auto e = REFIT_THROWN(meta.validate());
  EXPECT_EQ(e.message(), "update metadata: duplicate tensor name 'x' (at #2)");
  meta.tensors.back() = {"z", dtype::int8, {-4}};
  e = REFIT_THROWN(meta.validate());
  EXPECT_EQ(e.message(), "tensor 'z': negative dimension in shape [-4]");
}

TEST(update_metadata, total_bytes_overflow_is_an_error) {
  // Each tensor is just under 2^63 bytes (valid alone); three of them overflow uint64.
  constexpr std::int64_t n = std::numeric_limits<std::int64_t>::max();
  update_metadata meta;
  meta.tensors = {{"a", dtype::uint8, {n}}, {"b", dtype::uint8, {n}}, {"c", dtype::uint8, {n}}};
  auto e = REFIT_THROWN(meta.total_bytes());
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "update metadata: total byte size overflows");
  e = REFIT_THROWN(meta.validate());
  EXPECT_EQ(e.message(), "update metadata: total byte size overflows");
}

TEST(metadata_digest, is_deterministic_and_sensitive_to_every_field_and_the_order) {
  update_metadata base;
  base.tensors = {{"a", dtype::float32, {2, 3}}, {"b", dtype::bfloat16, {4}}};
  const std::uint64_t d = metadata_digest(base);
  EXPECT_EQ(metadata_digest(base), d);
  update_metadata copy = base;
  EXPECT_EQ(metadata_digest(copy), d);

  auto differs = [&](auto change, const char* what) {
    update_metadata m = base;
    change(m);
    EXPECT_NE(metadata_digest(m), d) << what;
  };
  differs([](update_metadata& m) { m.tensors[1].name = "c"; }, "name");
  differs([](update_metadata& m) { m.tensors[1].dtype = dtype::float16; }, "dtype");
  differs([](update_metadata& m) { m.tensors[0].shape = {3, 2}; }, "shape order");
  differs([](update_metadata& m) { m.tensors[0].shape = {6}; }, "rank");
  differs([](update_metadata& m) { std::swap(m.tensors[0], m.tensors[1]); }, "tensor order");
  differs([](update_metadata& m) { m.tensors.pop_back(); }, "tensor count");
  // Field boundaries are not ambiguous: "ab"+[] vs "a"+... are different lists.
  update_metadata x, y;
  x.tensors = {{"ab", dtype::int8, {}}};
  y.tensors = {{"a", dtype::int8, {}}, {"b", dtype::int8, {}}};
  EXPECT_NE(metadata_digest(x), metadata_digest(y));
  EXPECT_NE(metadata_digest(update_metadata{}), d);
}

}  // namespace
}  // namespace refit
