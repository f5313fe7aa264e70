// What the simulations (stream.cc, sharded.cc) share on SimGrid's side: time as a
// core's work, and hosts whose route to the fabric starts at their NIC.
#pragma once

#include <simgrid/s4u.hpp>

#include <string>
#include <vector>

namespace refit::sim::grid {

/// A core's speed: a cost of s seconds is an execution of s * core_flops.
inline constexpr double core_flops = 1e9;

/// The calling actor computes for `seconds` on its host's cores.
void run_for(double seconds);

/// A zone whose hosts meet at one switch, under refit's network model: max-min
/// sharing of each link, no cross traffic. A stream's efficiency (TCP's headers and
/// ACKs, the engine's framing) is calibrated rather than modelled: SimGrid's cross
/// traffic (ACKs as reverse flows) would make a relay's forwarding slow its own
/// receive, which TCP's ACKs, a few percent of a link, do not.
simgrid::s4u::NetZone* switch_zone(const std::string& name);

/// A host of `zone` with a NIC of `bytes_per_s` each way (split duplex), its route
/// to the switch that NIC and then `also` (a node's uplink).
simgrid::s4u::Host* add_host(simgrid::s4u::NetZone* zone, const std::string& name, double bytes_per_s, double latency_s,
                             const std::vector<simgrid::s4u::LinkInRoute>& also = {});

}  // namespace refit::sim::grid
