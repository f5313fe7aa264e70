#include "tools/simulate/simgrid.h"

namespace refit::sim::grid {
namespace sg4 = simgrid::s4u;

void run_for(double seconds) {
  if (seconds > 0) sg4::this_actor::execute(seconds * core_flops);
}

sg4::NetZone* switch_zone(const std::string& name) {
  sg4::Engine& e = *sg4::Engine::get_instance();
  e.set_config("network/model:CM02");
  e.set_config("network/crosstraffic:0");
  return sg4::create_star_zone(name);
}

sg4::Host* add_host(sg4::NetZone* zone, const std::string& name, double bytes_per_s, double latency_s,
                    const std::vector<sg4::LinkInRoute>& also) {
  sg4::Host* host = zone->create_host(name, core_flops);
  sg4::SplitDuplexLink* nic = zone->create_split_duplex_link(name + ".nic", bytes_per_s);
  nic->set_latency(latency_s);
  std::vector<sg4::LinkInRoute> route{{nic, sg4::LinkInRoute::Direction::UP}};
  route.insert(route.end(), also.begin(), also.end());
  zone->add_route(host->get_netpoint(), nullptr, nullptr, nullptr, route, true);
  return host;
}

}  // namespace refit::sim::grid
