// Strict reading of JSON objects into typed structs. Every engine's init/update info
// and every control message is read through this, so all of them reject missing,
// mistyped and unknown members the same way, with a message that names the context
// (engine and info kind) and the member path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <refit/error.h>
#include <refit/json.h>

namespace refit {

/// Deepest nesting of arrays and objects accepted from text. refit's documents nest
/// a few levels; copying or dumping a json value recurses once per level, so a
/// deeper document (a few bytes per level) could exhaust the stack.
inline constexpr std::size_t max_json_depth = 64;

/// The deepest nesting of arrays and objects in JSON `text`, counting no further
/// than `stop_above + 1`. Meaningful for valid JSON only (a parser rejects the rest).
std::size_t json_nesting_depth(std::string_view text, std::size_t stop_above = max_json_depth);

/// What a parse of `text` would build, found in one pass without building it:
/// the deepest nesting (as json_nesting_depth) and an upper bound of the values
/// (every scalar, array, object and object key), from the separators outside
/// strings. A parsed value costs tens of bytes however short its text ("1,": 2
/// bytes of text, a 16-byte value), so a frame is refused on this count before it
/// is parsed.
struct json_shape {
  std::size_t depth = 0;
  std::size_t values = 0;
};
json_shape scan_json(std::string_view text);

/// Parses JSON text; malformed text (including a number out of range and nesting
/// deeper than max_json_depth) is refit::error(invalid_argument) naming `context`
/// and, for a syntax error, the byte offset.
json parse_json_text(std::string_view text, std::string_view context);

/// `text` with every byte that is not part of a valid UTF-8 sequence replaced by
/// '?': for messages that quote raw input, since messages travel in JSON.
std::string valid_utf8(std::string_view text);

/// The JSON type name used in messages ("string", "number", "object", ...), plus a
/// short excerpt of the value (valid UTF-8, whatever the value's size or depth).
std::string describe_json(const json& value);

/// Reads members of one JSON object. Construct, read each member, then call
/// finish() to reject members nobody read.
class json_reader {
 public:
  /// `context` prefixes every message ("tcp init_info"); `path` is the path of this
  /// object inside the document ("" at the top, "wire" for a nested object).
  json_reader(const json& object, std::string context, std::string path = {});

  /// A member that must be present.
  template <class T>
  T required(std::string_view key) {
    const json* v = find(key);
    if (!v) fail("missing required member '" + member_path(key) + "'");
    return convert<T>(*v, member_path(key));
  }

  /// A member that may be absent (or null), with a default.
  template <class T>
  T optional(std::string_view key, T fallback) {
    const json* v = find(key);
    if (!v || v->is_null()) return fallback;
    return convert<T>(*v, member_path(key));
  }

  /// A member that may be absent (or null).
  template <class T>
  std::optional<T> maybe(std::string_view key) {
    const json* v = find(key);
    if (!v || v->is_null()) return std::nullopt;
    return convert<T>(*v, member_path(key));
  }

  /// A nested object member, read with its own reader (finish() it too).
  json_reader object(std::string_view key);
  /// True when the member is present and not null (marks it as read).
  bool has(std::string_view key);

  /// Throws invalid_argument naming the first member that nothing read, and the
  /// members that are accepted.
  void finish() const;

  /// Converts one value, or throws invalid_argument naming `path`.
  template <class T>
  T convert(const json& v, const std::string& path) const;

  /// Throws refit::error(invalid_argument) with the context prefix.
  [[noreturn]] void fail(const std::string& message) const;
  std::string member_path(std::string_view key) const;
  const std::string& context() const { return context_; }

 private:
  const json* find(std::string_view key);
  [[noreturn]] void type_error(const std::string& path, std::string_view expected, const json& got) const;

  const json& object_;
  std::string context_;
  std::string path_;
  std::vector<std::string> read_;
};

template <class T>
inline constexpr bool is_vector_v = false;
template <class U>
inline constexpr bool is_vector_v<std::vector<U>> = true;

template <class T>
T json_reader::convert(const json& v, const std::string& path) const {
  if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) type_error(path, "a boolean", v);
    return v.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (v.is_number_unsigned()) {
      auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<T>::max()))
        fail("member '" + path + "' is " + std::to_string(u) + ", above the maximum " +
             std::to_string(std::numeric_limits<T>::max()));
      return static_cast<T>(u);
    }
    if (v.is_number_integer()) {
      auto s = v.get<std::int64_t>();
      if (std::is_unsigned_v<T> && s < 0) fail("member '" + path + "' must not be negative, got " + std::to_string(s));
      if constexpr (std::is_signed_v<T>) {
        if (s < std::numeric_limits<T>::min() || s > std::numeric_limits<T>::max())
          fail("member '" + path + "' is " + std::to_string(s) + ", out of range");
      }
      return static_cast<T>(s);
    }
    type_error(path, "an integer", v);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) type_error(path, "a number", v);
    return v.get<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) type_error(path, "a string", v);
    return v.get<std::string>();
  } else if constexpr (std::is_same_v<T, json>) {
    return v;
  } else if constexpr (is_vector_v<T>) {
    if (!v.is_array()) type_error(path, "an array", v);
    T out;
    out.reserve(v.size());
    for (std::size_t i = 0; i < v.size(); ++i)
      out.push_back(convert<typename T::value_type>(v[i], path + "[" + std::to_string(i) + "]"));
    return out;
  } else {
    static_assert(sizeof(T) == 0, "json_reader: unsupported member type");
  }
}

}  // namespace refit
