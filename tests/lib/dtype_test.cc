#include <refit/dtype.h>

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/lib/expect.h"

namespace refit {
namespace {

using ::testing::HasSubstr;

struct dtype_case {
  dtype type;
  const char* name;
  std::size_t size;
};

constexpr dtype_case all_dtypes[] = {
    {dtype::bool_, "bool", 1},
    {dtype::uint8, "uint8", 1},
    {dtype::int8, "int8", 1},
    {dtype::int16, "int16", 2},
    {dtype::int32, "int32", 4},
    {dtype::int64, "int64", 8},
    {dtype::float16, "float16", 2},
    {dtype::bfloat16, "bfloat16", 2},
    {dtype::float32, "float32", 4},
    {dtype::float64, "float64", 8},
    {dtype::float8_e4m3fn, "float8_e4m3fn", 1},
    {dtype::float8_e5m2, "float8_e5m2", 1},
};

TEST(dtype, element_sizes_and_torch_names) {
  for (const auto& c : all_dtypes) {
    EXPECT_EQ(element_size(c.type), c.size) << c.name;
    EXPECT_EQ(to_string(c.type), c.name);
  }
}

TEST(dtype, parses_its_own_names_with_and_without_torch_prefix) {
  for (const auto& c : all_dtypes) {
    EXPECT_EQ(parse_dtype(c.name), c.type) << c.name;
    EXPECT_EQ(parse_dtype(std::string("torch.") + c.name), c.type) << c.name;
    EXPECT_EQ(parse_dtype(to_string(c.type)), c.type) << c.name;
  }
}

TEST(dtype, torch_aliases_map_to_canonical_types) {
  EXPECT_EQ(parse_dtype("half"), dtype::float16);
  EXPECT_EQ(parse_dtype("float"), dtype::float32);
  EXPECT_EQ(parse_dtype("double"), dtype::float64);
  EXPECT_EQ(parse_dtype("short"), dtype::int16);
  EXPECT_EQ(parse_dtype("int"), dtype::int32);
  EXPECT_EQ(parse_dtype("long"), dtype::int64);
  EXPECT_EQ(parse_dtype("torch.half"), dtype::float16);
  EXPECT_EQ(parse_dtype("torch.long"), dtype::int64);
  // Aliases are accepted but never produced: to_string is torch's canonical name.
  EXPECT_EQ(to_string(parse_dtype("torch.float")), "float32");
  EXPECT_EQ(to_string(parse_dtype("half")), "float16");
}

TEST(dtype, unknown_name_is_named_and_accepted_names_are_listed) {
  auto e = REFIT_THROWN(parse_dtype("torch.float33"));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_THAT(e.message(), HasSubstr("unknown dtype 'torch.float33'"));
  EXPECT_THAT(e.message(), HasSubstr("expected one of"));
  for (const auto& c : all_dtypes) EXPECT_THAT(e.message(), HasSubstr(c.name));
  EXPECT_THAT(e.message(), HasSubstr("'torch.'"));
}

TEST(dtype, near_misses_are_rejected) {
  for (const char* bad : {"", "torch.", "torch", "Float32", "FLOAT", "torch.torch.float32", " float32", "float32 ",
                          "fp16", "bf16", "float8", "torch.Half", "torch:float32", "numpy.float32"}) {
    auto e = REFIT_THROWN(parse_dtype(bad));
    EXPECT_EQ(e.kind(), errc::invalid_argument) << "'" << bad << "'";
    EXPECT_THAT(e.message(), HasSubstr("'" + std::string(bad) + "'"));
  }
}

}  // namespace
}  // namespace refit
