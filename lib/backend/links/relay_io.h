// The side-channel steps of a relay topology (relay.h) that every relaying engine
// (tcp, ucx) takes the same way: the trainer tells each worker its place, and a
// worker with children answers for its subtree: it passes the update header down
// and accepts only once its children accepted, and confirms only once they
// confirmed. How the buckets themselves travel down is each engine's own.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/links.h>
#include <refit/backend/links/relay.h>
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
/// `me` names this worker, `source` what it reads from.
asio::awaitable<std::uint64_t> accept_update_for_subtree(asio::ip::tcp::socket& upstream,
                                                         const std::vector<socket_ptr>& children,
                                                         const std::vector<int>& child_ranks, std::uint64_t last_seq,
                                                         const update_metadata& meta, const bucket_plan& plan,
                                                         std::chrono::milliseconds timeout, std::string me,
                                                         std::string source);

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
