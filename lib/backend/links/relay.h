// Relay topologies of a group's stream: the trainer sends every byte to each
// worker itself (star: trainer egress grows with N), or to its first worker(s),
// which forward each bucket to theirs as it arrives (chain: one child each; tree
// of fan-out K: K each), so the trainer's egress is one (or K) copies whatever N.
// Every worker keeps its own copy, verifies what it got, and answers for its whole
// subtree: it accepts an update only after its children did, and confirms it only
// after they confirmed.
//
// Worker rank r (1..N) has parent (r - 1) / K (0 is the trainer) and children
// K*r + 1 .. K*r + K; a chain is K = 1, a star K >= N.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <refit/json_reader.h>

namespace refit::links {

struct topology {
  int fanout = 0;  ///< children per worker; 0: star (the trainer is everyone's parent)

  /// "star", "chain" or "tree:K" (K >= 1; tree:1 is a chain); invalid_argument
  /// naming `what` otherwise.
  static topology parse(const std::string& text, const std::string& what);
  /// The default for `workers` workers: a star for one or two (nothing to gain),
  /// else a chain (the trainer sends one copy).
  static topology default_for(int workers);
  std::string to_string() const;
  bool star() const noexcept { return fanout == 0; }

  /// The parent of worker `rank` (0: the trainer).
  int parent(int rank) const noexcept;
  /// The children of worker `rank` (0: the trainer's) among ranks 1..workers.
  std::vector<int> children(int rank, int workers) const;
  /// Worker `rank` (>= 1) and every worker below it, in no set order: what its
  /// stream reaches.
  std::vector<int> subtree(int rank, int workers) const;
};

/// What the trainer tells a worker after the rendezvous in a relay topology.
struct relay_position {
  int upstream = 0;              ///< the rank it receives from (0: the trainer)
  std::string upstream_address;  ///< where that worker relays (empty for the trainer)
  std::uint16_t upstream_port = 0;
  std::vector<int> children;  ///< the ranks it forwards to

  json to_json() const;
  /// Reads to_json's output strictly; protocol_error naming `what` otherwise.
  static relay_position from_json(const json& j, const std::string& what);
};

}  // namespace refit::links
