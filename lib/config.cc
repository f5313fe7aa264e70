#include <refit/config.h>

namespace refit {

std::string_view to_string(commit_mode mode) noexcept { return mode == commit_mode::staged ? "staged" : "in_place"; }

std::optional<commit_mode> read_commit_mode(json_reader& r, const std::string& name) {
  auto text = r.maybe<std::string>(name);
  if (!text) return std::nullopt;
  if (*text == "in_place") return commit_mode::in_place;
  if (*text == "staged") return commit_mode::staged;
  r.fail("member '" + name + "' must be \"in_place\" or \"staged\", got \"" + *text + "\"");
}

weight_transfer_config weight_transfer_config::from_json(const json& j) {
  json_reader r(j, "weight_transfer_config");
  weight_transfer_config c;
  c.backend = r.optional<std::string>("backend", c.backend);
  if (c.backend.empty()) r.fail("member 'backend' must not be empty");
  auto ms = r.optional<std::int64_t>("timeout_ms", c.timeout.count());
  if (ms <= 0) r.fail("member 'timeout_ms' must be positive, got " + std::to_string(ms));
  c.timeout = std::chrono::milliseconds(ms);
  c.processing_threads = r.optional<std::size_t>("processing_threads", c.processing_threads);
  if (c.processing_threads == 0 || c.processing_threads > 256)
    r.fail("member 'processing_threads' must be in [1, 256], got " + std::to_string(c.processing_threads));
  c.commit = read_commit_mode(r).value_or(c.commit);
  c.socket_buffer_bytes = r.optional<std::size_t>("socket_buffer_bytes", c.socket_buffer_bytes);
  if (c.socket_buffer_bytes > (1u << 30))
    r.fail("member 'socket_buffer_bytes' must be at most 1 GiB, got " + std::to_string(c.socket_buffer_bytes));
  c.max_stage_bytes = r.optional<std::uint64_t>("max_stage_bytes", c.max_stage_bytes);
  r.finish();
  return c;
}

json weight_transfer_config::to_json() const {
  return {{"backend", backend},
          {"timeout_ms", timeout.count()},
          {"processing_threads", processing_threads},
          {"socket_buffer_bytes", socket_buffer_bytes},
          {"max_stage_bytes", max_stage_bytes},
          {"commit", to_string(commit)}};
}

}  // namespace refit
