#include <refit/backend/links/relay.h>

#include <algorithm>
#include <cstdlib>

namespace refit::links {

topology topology::parse(const std::string& text, const std::string& what) {
  if (text == "star") return {0};
  if (text == "chain") return {1};
  if (text.rfind("tree:", 0) == 0) {
    const std::string k = text.substr(5);
    char* end = nullptr;
    const long v = k.empty() ? 0 : std::strtol(k.c_str(), &end, 10);
    if (end && *end == '\0' && v >= 1 && v <= 1024) return {static_cast<int>(v)};
  }
  throw_error(errc::invalid_argument, what +
                                          ": topology must be \"star\", \"chain\" or \"tree:K\" (K in [1, 1024]), "
                                          "got \"" +
                                          valid_utf8(text.substr(0, 40)) + "\"");
}

topology topology::default_for(int workers) { return workers <= 2 ? topology{0} : topology{1}; }

std::string topology::to_string() const {
  if (fanout == 0) return "star";
  if (fanout == 1) return "chain";
  return "tree:" + std::to_string(fanout);
}

int topology::parent(int rank) const noexcept {
  if (fanout == 0 || rank <= fanout) return 0;
  return (rank - 1) / fanout;
}

std::vector<int> topology::children(int rank, int workers) const {
  std::vector<int> out;
  if (fanout == 0) {
    if (rank == 0)
      for (int r = 1; r <= workers; ++r) out.push_back(r);
    return out;
  }
  for (int r = fanout * rank + 1; r <= std::min(workers, fanout * rank + fanout); ++r) out.push_back(r);
  return out;
}

std::vector<int> topology::subtree(int rank, int workers) const {
  std::vector<int> out, todo{rank};
  while (!todo.empty()) {
    const int r = todo.back();
    todo.pop_back();
    out.push_back(r);
    if (!star())
      for (int c : children(r, workers)) todo.push_back(c);
  }
  return out;
}

json relay_position::to_json() const {
  return {{"upstream", upstream}, {"address", upstream_address}, {"port", upstream_port}, {"children", children}};
}

relay_position relay_position::from_json(const json& j, const std::string& what) {
  try {
    json_reader r(j, what);
    relay_position p;
    p.upstream = r.required<int>("upstream");
    p.upstream_address = r.required<std::string>("address");
    p.upstream_port = r.required<std::uint16_t>("port");
    p.children = r.required<std::vector<int>>("children");
    r.finish();
    if (p.upstream != 0 && (p.upstream_address.empty() || p.upstream_port == 0))
      r.fail("an upstream worker needs an address and a port");
    return p;
  } catch (const error& e) {
    throw error(errc::protocol_error, e.message());
  }
}

}  // namespace refit::links
