// The side-channel steps of a relay topology (relay.h) that every relaying engine
// (tcp, ucx) takes the same way: the trainer tells each worker its place, and a
// worker with children answers for its subtree: it passes the update header down
// and accepts only once its children accepted, and confirms only once they
// confirmed. How the buckets themselves travel down is each engine's own.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
#include <refit/backend/links/wire.h>
#include <refit/metadata.h>

namespace refit::links {

using socket_ptr = std::shared_ptr<asio::ip::tcp::socket>;

/// Trainer side, after accept_workers in a relay topology: tells every member
/// (sorted by rank, 1..N) where it receives from (the trainer, or its parent's
/// relay listener) and whom it forwards to. `who` prefixes messages ("tcp
/// trainer"). protocol_error when a parent has no relay listener.
asio::awaitable<void> tell_positions(const std::vector<member>& members, topology t, std::chrono::milliseconds timeout,
                                     std::string who);

/// Worker side: the place tell_positions sent it (children sorted by rank);
/// the trainer's failure, or protocol_error for a malformed position.
asio::awaitable<relay_position> read_position(asio::ip::tcp::socket& trainer, topology t,
                                              std::chrono::milliseconds timeout, std::string who);

/// Worker side: reads update header from `upstream` and checks it against `meta`
/// and `plan` (as accept_update). With children, the header goes on to them and
/// this worker accepts only once every child accepted; a child's refusal is sent
/// upstream naming that child, and thrown. Returns the update's sequence number.
/// `me` names this worker, `source` what it reads from. With `delta` (an engine
/// that takes delta updates), a delta header is read into it (as accept_update)
/// and goes down with the update header; without, a delta update is refused.
asio::awaitable<std::uint64_t> accept_update_for_subtree(
    asio::ip::tcp::socket& upstream, const std::vector<socket_ptr>& children, const std::vector<int>& child_ranks,
    std::uint64_t last_seq, const update_metadata& meta, const bucket_plan& plan, std::chrono::milliseconds timeout,
    std::string me, std::string source, std::optional<wire::delta_header>* delta = nullptr);

/// A subtree's answer to a delta offer (answer_delta_offer_for_subtree).
struct subtree_delta_answer {
  /// Why the subtree takes the update full (this worker's reason or the first
  /// child's, "downstream worker rank N: ..."); empty: it takes the deltas.
  std::string why_full;
  /// Per child (in the order of `children`): whether its subtree took them.
  std::vector<bool> child_took;
};

/// Worker side, after its own check of a delta offer with a base (docs/delta.md):
/// one stream carries one form of each bucket to the whole subtree, so it takes
/// deltas only when this worker holds the base (`why_full` empty) and every
/// child's subtree answered 0; else it answers invalid_state upstream with the
/// first reason, and the trainer sends that stream full (which a worker below that
/// holds the base takes as well). A child's other failure is thrown.
asio::awaitable<subtree_delta_answer> answer_delta_offer_for_subtree(asio::ip::tcp::socket& upstream,
                                                                     const std::vector<socket_ptr>& children,
                                                                     const std::vector<int>& child_ranks,
                                                                     std::string why_full, std::uint64_t seq,
                                                                     std::chrono::milliseconds timeout, std::string me);

/// Worker side, after its last bucket: waits for every child's confirmation of
/// update `seq` (a child's failure goes upstream, naming it, and is thrown), then
/// confirms upstream.
asio::awaitable<void> confirm_update_for_subtree(asio::ip::tcp::socket& upstream,
                                                 const std::vector<socket_ptr>& children,
                                                 const std::vector<int>& child_ranks, std::uint64_t seq,
                                                 std::chrono::milliseconds timeout, std::string me);

/// The same bytes to every child at once; the first error wins, naming the child
/// (its own reason when it gave one before closing). The sockets are held until
/// the writes end.
asio::awaitable<void> write_to_children(std::vector<socket_ptr> children, std::vector<int> ranks,
                                        std::vector<asio::const_buffer> bytes, std::chrono::milliseconds timeout,
                                        std::string what);

}  // namespace refit::links
