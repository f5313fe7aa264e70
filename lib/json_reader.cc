#include "lib/json_reader.h"

#include <algorithm>

namespace refit {

json parse_json_text(std::string_view text, std::string_view context) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    throw error(errc::invalid_argument, std::string(context) + ": malformed JSON at byte " +
                                            std::to_string(e.byte) + ": " + e.what());
  }
}

std::string describe_json(const json& value) {
  std::string excerpt = value.dump();
  if (excerpt.size() > 40) excerpt = excerpt.substr(0, 37) + "...";
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

void json_reader::type_error(const std::string& path, std::string_view expected,
                             const json& got) const {
  fail("member '" + path + "' expected " + std::string(expected) + ", got " +
       describe_json(got));
}

}  // namespace refit
