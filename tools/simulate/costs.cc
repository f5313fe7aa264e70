#include "tools/simulate/costs.h"

#include <algorithm>

namespace refit::sim {

delta_rates costs::delta_at(double fraction) const {
  if (delta.empty()) return {fraction, 1e18, 1e18, fraction};
  if (fraction <= delta.front().fraction) return delta.front();
  if (fraction >= delta.back().fraction) return delta.back();
  const auto hi =
      std::find_if(delta.begin(), delta.end(), [&](const delta_rates& d) { return d.fraction >= fraction; });
  const auto lo = hi - 1;
  const double t = (fraction - lo->fraction) / (hi->fraction - lo->fraction);
  auto mix = [t](double a, double b) { return a + t * (b - a); };
  return {fraction, mix(lo->encode_bytes_per_s, hi->encode_bytes_per_s),
          mix(lo->decode_bytes_per_s, hi->decode_bytes_per_s), mix(lo->wire_fraction, hi->wire_fraction)};
}

}  // namespace refit::sim
