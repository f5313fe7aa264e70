#include "registry.h"  // private to this engine

namespace refit::ucx {

asio::awaitable<void> registrar::close(std::unique_ptr<update_registry> registry) {
  if (!registry) co_return;
  auto* r = registry.release();
  co_await async::offload(pool_.get_executor(), [r] { delete r; });
}

std::vector<std::byte> put_pieces_grant(std::span<const asio::mutable_buffer> pieces,
                                        std::span<update_registry::region* const> regions,
                                        const std::function<bool(update_registry::region&)>& fresh, wire::grant& g) {
  wire::writer w;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    update_registry::region& r = *regions[i];
    wire::put_piece piece;
    piece.remote = reinterpret_cast<std::uint64_t>(pieces[i].data());
    piece.bytes = pieces[i].size();
    piece.region = r.id;
    const bool with_key = fresh(r);
    if (with_key) {
      piece.rkey_bytes = static_cast<std::uint32_t>(r.reg->packed_rkey().size());
      piece.region_base = reinterpret_cast<std::uint64_t>(r.reg->base());
      piece.region_bytes = r.reg->bytes();
    }
    w.put(piece);
    if (with_key) w.bytes(r.reg->packed_rkey());
  }
  g.mode = wire::mode_put_pieces;
  g.region = static_cast<std::uint32_t>(pieces.size());
  g.rkey_bytes = static_cast<std::uint32_t>(w.out.size());
  return std::move(w.out);
}

}  // namespace refit::ucx
