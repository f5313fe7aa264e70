#include <refit/backend/links/relay_io.h>

#include <algorithm>

#include <refit/backend/async/all_of.h>
#include <refit/backend/links/status_io.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/net.h>

namespace refit::links {

asio::awaitable<void> tell_positions(const std::vector<member>& members, topology t, std::chrono::milliseconds timeout,
                                     std::string who) {
  const int workers = static_cast<int>(members.size());
  std::vector<asio::awaitable<void>> tell;
  for (const auto& m : members) {
    relay_position p;
    p.upstream = t.parent(m.rank);
    p.children = t.children(m.rank, workers);
    const std::string name = who + ": worker rank " + std::to_string(m.rank);
    if (p.upstream != 0) {
      const auto& up = members.at(static_cast<std::size_t>(p.upstream - 1));  // sorted by rank, 1..N
      if (up.relay_port == 0)
        throw_error(errc::protocol_error, who + ": worker rank " + std::to_string(up.rank) +
                                              " has no relay listener (is it an older refit?)");
      p.upstream_address = up.address;
      p.upstream_port = up.relay_port;
    }
    tell.push_back(send_status(*m.socket, 0, 0, p.to_json().dump(), timeout,
                               name + ": telling it its place in the " + t.to_string()));
  }
  co_await async::all_of(std::move(tell));
}

namespace {
// Bytes to one child; if it fails, the child's own reason (it says why before it
// closes) is the error where it gave one.
asio::awaitable<void> to_child(socket_ptr child, std::vector<asio::const_buffer> bytes,
                               std::chrono::milliseconds timeout, std::string what) {
  std::exception_ptr failure;
  try {
    co_await net::write_all(*child, bytes, timeout, what, net::loop_bytes_per_call);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) co_await rethrow_with_peer_reason(*child, failure, what);
}
}  // namespace

asio::awaitable<void> write_to_children(std::vector<socket_ptr> children, std::vector<int> ranks,
                                        std::vector<asio::const_buffer> bytes, std::chrono::milliseconds timeout,
                                        std::string what) {
  std::vector<asio::awaitable<void>> writes;
  for (std::size_t i = 0; i < children.size(); ++i)
    writes.push_back(
        to_child(children[i], bytes, timeout, what + " to downstream worker rank " + std::to_string(ranks[i])));
  co_await async::all_of(std::move(writes));
}

asio::awaitable<std::uint64_t> accept_update_for_subtree(asio::ip::tcp::socket& socket,
                                                         const std::vector<socket_ptr>& children,
                                                         const std::vector<int>& child_ranks, std::uint64_t last_seq,
                                                         const update_metadata& meta, const bucket_plan& plan,
                                                         std::chrono::milliseconds timeout, std::string me,
                                                         std::string source, std::optional<wire::delta_header>* delta) {
  if (children.empty()) co_return co_await accept_update(socket, last_seq, meta, plan, timeout, source, delta);
  // The header goes down the tree; this worker accepts only once its children did.
  std::array<std::byte, sizeof(wire::update)> raw;
  co_await net::read_exact(socket, asio::buffer(raw), timeout, source + ": waiting for the update header");
  auto u = wire::decode<wire::update>(raw);
  if (auto bad = wire::check_update_magic(u); !bad.empty()) throw_error(errc::protocol_error, me + ": " + bad);
  const wire::update_expectation expected{last_seq, meta.tensors.size(), metadata_digest(meta), plan.buckets.size(),
                                          plan.payload_bytes};
  std::string refusal = wire::check_update_header(u, expected);
  std::array<std::byte, sizeof(wire::delta_header)> raw_delta;
  const bool delta_follows = delta && (u.flags & wire::update_flag_delta) != 0;
  if (delta_follows) {
    co_await net::read_exact(socket, asio::buffer(raw_delta), timeout, source + ": reading the delta header");
    *delta = wire::decode<wire::delta_header>(raw_delta);
    if (refusal.empty()) refusal = wire::check_delta_header(**delta);
  }
  const std::uint32_t other_flags = u.flags & (delta_follows ? ~wire::update_flag_delta : ~0u);
  if (refusal.empty() && other_flags != 0)
    refusal = (other_flags & wire::update_flag_delta) != 0 ? "the trainer sends a delta update; this relay takes "
                                                             "full updates only"
                                                           : "unknown update flags " + std::to_string(other_flags);
  errc code = errc::protocol_error;
  if (refusal.empty()) {
    std::vector<asio::const_buffer> header{asio::buffer(raw)};  // (GCC 12: no braced list in co_await)
    if (delta_follows) header.push_back(asio::buffer(raw_delta));
    co_await write_to_children(children, child_ranks, std::move(header), timeout, me + ": update header");
    for (std::size_t i = 0; i < children.size() && refusal.empty(); ++i) {
      auto st = co_await read_status(
          *children[i], timeout,
          me + ": waiting for downstream worker rank " + std::to_string(child_ranks[i]) + " to accept");
      if (st.code != 0) {
        code = st.code <= static_cast<std::uint32_t>(last_errc) ? static_cast<errc>(st.code) : errc::protocol_error;
        refusal = "downstream worker rank " + std::to_string(child_ranks[i]) + " refused the update: " + st.message;
      }
    }
  }
  if (!refusal.empty()) {
    co_await send_status(socket, static_cast<std::uint32_t>(code), u.seq, me + ": " + refusal, timeout,
                         me + ": refusing the update");
    throw_error(code, me + ": " + refusal);
  }
  co_await send_status(socket, 0, u.seq, {}, timeout, me + ": accepting the update");
  co_return u.seq;
}

asio::awaitable<subtree_delta_answer> answer_delta_offer_for_subtree(
    asio::ip::tcp::socket& upstream, const std::vector<socket_ptr>& children, const std::vector<int>& child_ranks,
    std::string why_full, std::uint64_t seq, std::chrono::milliseconds timeout, std::string me) {
  subtree_delta_answer out;
  for (std::size_t i = 0; i < children.size(); ++i) {
    const std::string child = "downstream worker rank " + std::to_string(child_ranks[i]);
    const auto st =
        co_await read_status(*children[i], timeout, me + ": waiting for " + child + "'s answer to the delta offer");
    const bool took = st.code == 0;
    if (st.code == static_cast<std::uint32_t>(errc::invalid_state)) {
      if (why_full.empty()) why_full = child + ": " + st.message;
    } else {
      throw_if_failed(st, me + ": " + child + " refused the delta offer");
    }
    out.child_took.push_back(took);
  }
  co_await send_status(upstream, why_full.empty() ? 0 : static_cast<std::uint32_t>(errc::invalid_state), seq, why_full,
                       timeout, me + ": answering the delta offer");
  out.why_full = std::move(why_full);
  co_return out;
}

asio::awaitable<void> confirm_update_for_subtree(asio::ip::tcp::socket& socket, const std::vector<socket_ptr>& children,
                                                 const std::vector<int>& child_ranks, std::uint64_t seq,
                                                 std::chrono::milliseconds timeout, std::string me) {
  // Every child confirms (its subtree has every byte, verified) before this one does.
  for (std::size_t i = 0; i < children.size(); ++i) {
    std::exception_ptr failure;
    errc kind = errc::peer_lost;
    std::string message;
    try {
      co_await await_confirmation(*children[i], seq, timeout,
                                  me + ": downstream worker rank " + std::to_string(child_ranks[i]));
    } catch (const error& e) {
      failure = std::current_exception();
      kind = e.kind();
      message = e.message();
    }
    if (failure) {
      // The upstream learns which worker failed, and why.
      try {
        co_await send_status(socket, static_cast<std::uint32_t>(kind), seq, message, timeout,
                             me + ": failing the update");
      } catch (const error&) {
      }
      std::rethrow_exception(failure);
    }
  }
  co_await confirm_update(socket, seq, timeout, me);
}

asio::awaitable<relay_position> read_position(asio::ip::tcp::socket& trainer, topology t,
                                              std::chrono::milliseconds timeout, std::string who) {
  auto st = co_await read_status(trainer, timeout, who + ": waiting for its place in the " + t.to_string());
  throw_if_failed(st, who + ": the trainer");
  relay_position p =
      relay_position::from_json(parse_json_text(st.message, who + ": relay position"), who + ": relay position");
  std::sort(p.children.begin(), p.children.end());
  co_return p;
}

}  // namespace refit::links
