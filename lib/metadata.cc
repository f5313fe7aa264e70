#include <refit/metadata.h>

#include <limits>
#include <string>
#include <unordered_set>

#include <xxhash.h>

namespace refit {

std::uint64_t update_metadata::total_bytes() const {
  std::uint64_t total = 0;
  for (const auto& t : tensors)
    if (__builtin_add_overflow(total, t.nbytes(), &total) ||
        total > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw_error(errc::invalid_argument, "update metadata: total byte size overflows");
  return total;
}

void update_metadata::validate() const {
  std::unordered_set<std::string_view> seen;
  seen.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name.empty())
      throw_error(errc::invalid_argument, "update metadata: tensor #" + std::to_string(i) + " has an empty name");
    if (!seen.insert(t.name).second)
      throw_error(errc::invalid_argument,
                  "update metadata: duplicate tensor name '" + t.name + "' (at #" + std::to_string(i) + ")");
    (void)t.nbytes();
  }
  (void)total_bytes();
}

std::uint64_t metadata_digest(const update_metadata& meta) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const auto& t : meta.tensors) {
    const std::uint64_t header[2] = {t.name.size(), (static_cast<std::uint64_t>(t.dtype) << 32) | t.shape.size()};
    XXH3_64bits_update(state, header, sizeof header);
    XXH3_64bits_update(state, t.name.data(), t.name.size());
    XXH3_64bits_update(state, t.shape.data(), t.shape.size() * sizeof(std::int64_t));
  }
  std::uint64_t digest = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return digest;
}

update_metadata read_update_metadata(json_reader& reader) {
  auto names = reader.required<std::vector<std::string>>("names");
  auto dtype_names = reader.required<std::vector<std::string>>("dtype_names");
  auto shapes = reader.required<std::vector<std::vector<std::int64_t>>>("shapes");
  if (dtype_names.size() != names.size() || shapes.size() != names.size())
    reader.fail("'names', 'dtype_names' and 'shapes' must have the same length, got " + std::to_string(names.size()) +
                ", " + std::to_string(dtype_names.size()) + " and " + std::to_string(shapes.size()));
  update_metadata meta;
  meta.tensors.reserve(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    dtype type;
    try {
      type = parse_dtype(dtype_names[i]);
    } catch (const error& e) {
      reader.fail("member '" + reader.member_path("dtype_names") + "[" + std::to_string(i) + "]': " + e.message());
    }
    meta.tensors.push_back({std::move(names[i]), type, std::move(shapes[i])});
  }
  try {
    meta.validate();
  } catch (const error& e) {
    reader.fail(e.message());
  }
  return meta;
}

void write_update_metadata(const update_metadata& meta, json& out) {
  json names = json::array(), dtypes = json::array(), shapes = json::array();
  for (const auto& t : meta.tensors) {
    names.push_back(t.name);
    dtypes.push_back(std::string(to_string(t.dtype)));
    shapes.push_back(t.shape);
  }
  out["names"] = std::move(names);
  out["dtype_names"] = std::move(dtypes);
  out["shapes"] = std::move(shapes);
}

}  // namespace refit
