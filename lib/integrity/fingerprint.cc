#include <refit/integrity/fingerprint.h>

#include <cstdio>
#include <map>

#include <xxhash.h>

#include <refit/error.h>
#include <refit/internal/hex.h>
#include <refit/json_reader.h>

namespace refit {

std::uint64_t fingerprint(const tensor_view& t) {
  if (!(t.device == device::cpu()))
    throw_error(errc::unsupported, "fingerprint of '" + std::string(t.name) + "': tensor is on " + to_string(t.device) +
                                       ", only host tensors are fingerprinted here");
  // The seed binds the bytes to what they claim to be.
  std::string id(t.name);
  id += '\0';
  id += to_string(t.dtype);
  for (auto d : t.shape) id += "," + std::to_string(d);
  const std::uint64_t seed = XXH3_64bits(id.data(), id.size());
  return XXH3_64bits_withSeed(t.data, static_cast<std::size_t>(t.nbytes()), seed);
}

fingerprint_list fingerprint_all(std::span<const tensor_view> tensors, const std::vector<std::string>& names) {
  fingerprint_list out;
  if (names.empty()) {
    out.reserve(tensors.size());
    for (const auto& t : tensors) out.emplace_back(std::string(t.name), fingerprint(t));
    return out;
  }
  std::map<std::string_view, const tensor_view*> by_name;
  for (const auto& t : tensors) by_name.emplace(t.name, &t);
  for (const auto& n : names) {
    auto it = by_name.find(n);
    if (it == by_name.end()) throw_error(errc::invalid_argument, "fingerprint: no weight named '" + n + "'");
    out.emplace_back(n, fingerprint(*it->second));
  }
  return out;
}

json fingerprints_to_json(const fingerprint_list& list) {
  json tensors = json::object();
  for (const auto& [name, fp] : list) tensors[name] = to_hex(fp);
  return {{"algorithm", fingerprint_algorithm}, {"tensors", std::move(tensors)}};
}

fingerprint_list fingerprints_from_json(const json& j) {
  json_reader r(j, "weight fingerprints");
  auto algorithm = r.required<std::string>("algorithm");
  if (algorithm != fingerprint_algorithm)
    r.fail("algorithm is '" + algorithm + "', expected '" + fingerprint_algorithm + "'");
  json tensors = r.required<json>("tensors");
  // The rest of the worker's weight_fingerprint answer (docs/control-plane.md):
  // read for their types, not used here.
  (void)r.maybe<std::int64_t>("weight_version");
  (void)r.maybe<std::string>("state");
  r.finish();
  if (!tensors.is_object()) throw_error(errc::invalid_argument, "weight fingerprints: 'tensors' must be an object");
  fingerprint_list out;
  for (const auto& [name, value] : tensors.items()) {
    const std::string* text = value.get_ptr<const std::string*>();
    char* end = nullptr;
    std::uint64_t v = text && text->size() == 16 ? std::strtoull(text->c_str(), &end, 16) : 0;
    if (!text || text->size() != 16 || !end || *end != '\0')
      throw_error(errc::invalid_argument,
                  "weight fingerprints: '" + name + "' must be 16 hex digits, got " + value.dump());
    out.emplace_back(name, v);
  }
  return out;
}

std::vector<std::string> compare_fingerprints(const fingerprint_list& expected, const fingerprint_list& got) {
  std::map<std::string_view, std::uint64_t> have;
  for (const auto& [n, v] : got) have.emplace(n, v);
  std::vector<std::string> out;
  for (const auto& [n, v] : expected) {
    auto it = have.find(n);
    if (it == have.end())
      out.push_back("'" + n + "' is missing");
    else {
      if (it->second != v)
        out.push_back("'" + n + "' differs (expected " + to_hex(v) + ", got " + to_hex(it->second) + ")");
      have.erase(it);
    }
  }
  for (const auto& [n, v] : have) out.push_back("'" + std::string(n) + "' was not expected");
  return out;
}

}  // namespace refit
