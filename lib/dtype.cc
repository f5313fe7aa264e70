#include <refit/dtype.h>

#include <array>
#include <string>

#include <refit/error.h>

namespace refit {
namespace {

struct entry {
  dtype type;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<entry, 12> entries{{
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
}};

struct alias {
  std::string_view name;
  dtype type;
};

constexpr std::array<alias, 6> aliases{{
    {"half", dtype::float16},
    {"float", dtype::float32},
    {"double", dtype::float64},
    {"short", dtype::int16},
    {"int", dtype::int32},
    {"long", dtype::int64},
}};

}  // namespace

std::size_t element_size(dtype t) noexcept { return entries[static_cast<std::size_t>(t)].size; }

std::string_view to_string(dtype t) noexcept { return entries[static_cast<std::size_t>(t)].name; }

dtype parse_dtype(std::string_view text) {
  std::string_view name = text;
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const auto& e : entries)
    if (e.name == name) return e.type;
  for (const auto& a : aliases)
    if (a.name == name) return a.type;
  std::string accepted;
  for (const auto& e : entries) {
    if (!accepted.empty()) accepted += ", ";
    accepted += e.name;
  }
  throw_error(errc::invalid_argument, "unknown dtype '" + std::string(text) + "': expected one of " + accepted +
                                          " (optionally prefixed with 'torch.')");
}

}  // namespace refit
