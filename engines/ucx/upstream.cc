#include "upstream.h"  // private to this engine

#include <refit/backend/links/status_io.h>
#include <refit/backend/net.h>
#include "wire.h"  // private to this engine

namespace refit::ucx {

asio::awaitable<endpoint_report> offer_and_agree(asio::ip::tcp::socket& socket, const worker& w,
                                                 std::span<const registration* const> regions,
                                                 const std::vector<std::string>& required,
                                                 std::function<void(endpoint_report&)> choose,
                                                 std::chrono::milliseconds timeout, std::string who, std::string to) {
  wire::writer body;
  const auto address = w.address();
  body.bytes(address);
  for (const registration* reg : regions) {
    body.put(reinterpret_cast<std::uint64_t>(reg->base()));
    body.put(reg->bytes());
    body.put(static_cast<std::uint32_t>(reg->packed_rkey().size()));
    body.bytes(reg->packed_rkey());
  }
  wire::offer_header h;
  h.bytes = static_cast<std::uint32_t>(body.out.size());
  h.address_bytes = static_cast<std::uint32_t>(address.size());
  h.regions = static_cast<std::uint32_t>(regions.size());
  const auto raw = wire::encode(h);
  std::vector<asio::const_buffer> out{asio::buffer(raw), asio::buffer(body.out)};
  co_await net::write_all(socket, out, timeout, who + ": offering its UCX address to " + to);

  // What UCX chose, as the sender's endpoint sees it; refused here when it is not
  // what this worker requires (the sender is told why).
  auto st = co_await links::read_status(socket, timeout, who + ": waiting for the UCX endpoint of " + to);
  links::throw_if_failed(st, who + ": " + to);
  auto report = endpoint_report::from_json(parse_json_text(st.message, who + ": UCX endpoint report"),
                                           who + ": UCX endpoint report");
  if (choose) choose(report);
  if (auto unmet = check_required(report, required); !unmet.empty()) {
    co_await links::send_status(socket, static_cast<std::uint32_t>(errc::unsupported), 0, who + ": " + unmet, timeout,
                                who + ": refusing the transports");
    throw_error(errc::unsupported, who + ": " + unmet);
  }
  co_await links::send_status(socket, 0, 0, {}, timeout, who + ": accepting the transports");
  co_return report;
}

asio::awaitable<std::uint64_t> read_done(asio::ip::tcp::socket& socket, std::uint64_t index, bool checksums,
                                         std::chrono::milliseconds timeout, const std::string& what) {
  std::array<std::byte, sizeof(wire::done)> d;
  co_await net::read_exact(socket, asio::buffer(d), timeout, what + ": waiting for the sender's done");
  const auto done = wire::decode<wire::done>(d);
  if (done.magic != wire::done_magic || done.index != index)
    throw_error(errc::protocol_error, what + ": expected the sender's done for bucket " + std::to_string(index));
  if (checksums != ((done.flags & wire::done_checksum) != 0))
    throw_error(errc::protocol_error, what + (checksums ? ": the done carries no checksum, but checksums are on"
                                                        : ": the done carries a checksum, but checksums are off"));
  co_return done.checksum;
}

}  // namespace refit::ucx
