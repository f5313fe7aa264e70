#include <refit/json_reader.h>

#include <algorithm>

namespace refit {

std::size_t json_nesting_depth(std::string_view text, std::size_t stop_above) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > deepest && (deepest = depth) > stop_above) break;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

json_shape scan_json(std::string_view text) {
  json_shape shape;
  std::size_t depth = 0, separators = 0;
  bool in_string = false, escaped = false, any = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        any = true;
        break;
      case '[':
      case '{':
        ++separators;  // the container, and the first value inside it
        shape.depth = std::max(shape.depth, ++depth);
        any = true;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      case ',':
      case ':':
        ++separators;
        break;
      case ' ':
      case '\t':
      case '\n':
      case '\r':
        break;
      default:
        any = true;
        break;
    }
  }
  shape.values = any ? separators + 1 : 0;
  return shape;
}

std::string valid_utf8(std::string_view text) {
  // The well-formed sequences of Unicode's table 3-7 (no overlong forms, no
  // surrogates, nothing above U+10FFFF): what nlohmann accepts and dumps.
  auto sequence_length = [&](std::size_t i) -> std::size_t {
    auto at = [&](std::size_t k) { return i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0u; };
    auto cont = [&](std::size_t k, unsigned lo = 0x80, unsigned hi = 0xBF) { return at(k) >= lo && at(k) <= hi; };
    const unsigned c = at(0);
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
    if (c == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
    if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
    if (c == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
    if (c == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
    if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
    if (c == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
    return 0;
  };
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = sequence_length(i);
    if (n == 0) {
      out += '?';
      ++i;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

json parse_json_text(std::string_view text, std::string_view context) {
  if (json_nesting_depth(text) > max_json_depth)
    throw error(errc::invalid_argument,
                std::string(context) + ": JSON nests deeper than " + std::to_string(max_json_depth) + " levels");
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    // nlohmann's message quotes the input where it stopped, which may be any bytes.
    throw error(errc::invalid_argument, std::string(context) + ": malformed JSON at byte " + std::to_string(e.byte) +
                                            ": " + valid_utf8(e.what()));
  } catch (const json::exception& e) {
    // out_of_range: a number too large for a double ("1e999").
    throw error(errc::invalid_argument, std::string(context) + ": malformed JSON: " + valid_utf8(e.what()));
  }
}

namespace {

// Appends `value`'s JSON text to `out` until `out` holds more than `limit` bytes:
// bounded work and recursion however large or deep the value is.
void append_excerpt(const json& value, std::string& out, std::size_t limit) {
  if (out.size() > limit) return;
  if (value.is_array() || value.is_object()) {
    out += value.is_array() ? '[' : '{';
    bool first = true;
    for (auto it = value.begin(); it != value.end() && out.size() <= limit; ++it) {
      if (!first) out += ',';
      first = false;
      if (value.is_object()) {
        append_excerpt(json(it.key()), out, limit);
        out += ':';
      }
      append_excerpt(*it, out, limit);
    }
    out += value.is_array() ? ']' : '}';
  } else if (value.is_string()) {
    // Only the start of a long string; replace, not throw, if the cut splits a
    // UTF-8 sequence.
    json head = value.get_ref<const std::string&>().substr(0, limit + 1);
    out += head.dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    out += value.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

}  // namespace

std::string describe_json(const json& value) {
  constexpr std::size_t max_excerpt = 40;
  std::string excerpt;
  append_excerpt(value, excerpt, max_excerpt);
  if (excerpt.size() > max_excerpt) {
    // Cut at a UTF-8 character boundary: the message may itself be sent as JSON,
    // which must be valid UTF-8.
    std::size_t cut = max_excerpt - 3;
    while (cut > 0 && (static_cast<unsigned char>(excerpt[cut]) & 0xC0) == 0x80) --cut;
    excerpt = excerpt.substr(0, cut) + "...";
  }
  return std::string(value.type_name()) + " " + excerpt;
}

json_reader::json_reader(const json& object, std::string context, std::string path)
    : object_(object), context_(std::move(context)), path_(std::move(path)) {
  if (!object_.is_object())
    fail((path_.empty() ? std::string("expected a JSON object") : "member '" + path_ + "' expected an object") +
         ", got " + describe_json(object_));
}

const json* json_reader::find(std::string_view key) {
  // Every key asked about is a known member, present or not, so finish() can list
  // what this object accepts.
  if (std::find(read_.begin(), read_.end(), key) == read_.end()) read_.emplace_back(key);
  auto it = object_.find(key);
  return it == object_.end() ? nullptr : &*it;
}

bool json_reader::has(std::string_view key) {
  const json* v = find(key);
  return v && !v->is_null();
}

json_reader json_reader::object(std::string_view key) {
  const json* v = find(key);
  if (!v) fail("missing required member '" + member_path(key) + "'");
  return json_reader(*v, context_, member_path(key));
}

void json_reader::finish() const {
  for (auto it = object_.begin(); it != object_.end(); ++it) {
    if (std::find(read_.begin(), read_.end(), it.key()) != read_.end()) continue;
    std::string accepted;
    for (const auto& k : read_) accepted += (accepted.empty() ? "" : ", ") + k;
    fail("unknown member '" + member_path(it.key()) + "'" +
         (accepted.empty() ? std::string() : " (accepted: " + accepted + ")"));
  }
}

std::string json_reader::member_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

void json_reader::fail(const std::string& message) const {
  throw error(errc::invalid_argument, context_ + ": " + message);
}

void json_reader::type_error(const std::string& path, std::string_view expected, const json& got) const {
  fail("member '" + path + "' expected " + std::string(expected) + ", got " + describe_json(got));
}

}  // namespace refit
