#include <refit/stats.h>

#include <algorithm>

namespace refit {

void update_stats::finalize() {
  double shorter = std::min(receive_s, process_s);
  overlap = shorter > 0 ? std::clamp((receive_s + process_s - wall_s) / shorter, 0.0, 1.0) : 0.0;
  gbps = wall_s > 0 ? static_cast<double>(bytes) / wall_s / 1e9 : 0.0;
}

json update_stats::to_json() const {
  return {{"bytes", bytes},           {"tensors", tensors}, {"buckets", buckets},
          {"wire_bytes", wire_bytes}, {"wall_s", wall_s},   {"receive_s", receive_s},
          {"process_s", process_s},   {"overlap", overlap}, {"gbps", gbps}};
}

}  // namespace refit
