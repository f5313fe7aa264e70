#include "tools/simulate/report.h"

#include <cstdio>

namespace refit::sim {

void prediction::consider(const std::string& what, double bytes, double bytes_per_s) {
  if (bytes_per_s <= 0 || bytes / bytes_per_s <= limit_seconds) return;
  limit_seconds = bytes / bytes_per_s;
  busiest_nic = what;
  busiest_bytes = bytes;
  nic_bytes_per_s = bytes_per_s;
  busiest_share = seconds > 0 ? limit_seconds / seconds : 0;
}

json prediction::to_json() const {
  json j;
  j["seconds"] = seconds;
  j["payload_bytes"] = payload_bytes;
  j["busiest_nic"] = busiest_nic;
  j["busiest_bytes"] = busiest_bytes;
  j["nic_bytes_per_s"] = nic_bytes_per_s;
  j["limit_seconds"] = limit_seconds;
  j["busiest_share"] = busiest_share;
  j["nics"] = json::array();
  for (const nic_load& n : nics)
    j["nics"].push_back({{"host", n.host}, {"tx_bytes", n.tx_bytes}, {"rx_bytes", n.rx_bytes}});
  j["phases"] = json::array();
  for (const phase& p : phases) j["phases"].push_back({{"name", p.name}, {"seconds", p.seconds}, {"what", p.what}});
  return j;
}

std::string prediction::table() const {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "update            %10.4f s\n", seconds);
  out += line;
  std::snprintf(line, sizeof line, "physical limit    %10.4f s  (%s: %.3f GB one way at %.2f GB/s)\n", limit_seconds,
                busiest_nic.c_str(), busiest_bytes / 1e9, nic_bytes_per_s / 1e9);
  out += line;
  std::snprintf(line, sizeof line, "busiest NIC busy  %10.1f %% of the update\n", 100 * busiest_share);
  out += line;
  for (const phase& p : phases) {
    std::snprintf(line, sizeof line, "  %-16s%10.4f s  %s\n", p.name.c_str(), p.seconds, p.what.c_str());
    out += line;
  }
  return out;
}

}  // namespace refit::sim
