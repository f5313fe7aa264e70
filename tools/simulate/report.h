// What a simulation predicts: the update's time, where it went, and the physical
// limit it is measured against.
#pragma once

#include <string>
#include <vector>

#include <refit/json.h>

namespace refit::sim {

struct nic_load {
  std::string host;
  double tx_bytes = 0, rx_bytes = 0;
};

struct phase {
  std::string name;
  double seconds = 0;
  std::string what;
};

struct prediction {
  double seconds = 0;        ///< the update, first pack to the last worker's commit
  double payload_bytes = 0;  ///< bytes of one copy of the update on the wire
  std::vector<nic_load> nics;
  std::string busiest_nic;  ///< the NIC with the most bytes one way
  double busiest_bytes = 0;
  double nic_bytes_per_s = 0;  ///< line rate of that NIC, one way
  /// busiest_bytes / nic_bytes_per_s: no schedule moves the update faster.
  double limit_seconds = 0;
  /// The busiest NIC's busy share of the update (limit_seconds / seconds).
  double busiest_share = 0;
  std::vector<phase> phases;

  /// Counts `what` (`bytes` one way at `bytes_per_s`) toward the physical limit:
  /// the one that takes longest sets limit_seconds, busiest_* and busiest_share
  /// (against `seconds`, so set that first).
  void consider(const std::string& what, double bytes, double bytes_per_s);

  json to_json() const;
  /// A plain table of the figures and phases.
  std::string table() const;
};

}  // namespace refit::sim
