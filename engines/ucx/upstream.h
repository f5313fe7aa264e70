// What a worker does towards whoever sends to it (the trainer, a relaying worker, a
// trainer rank of a sharded job; private to the ucx engine), the receiving half of
// downstream.h: offer its UCX address and registered regions, accept or refuse what
// UCX chose for the endpoint to it, and read each bucket's "done".
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/engines/ucx/ucx.h>
#include "ucp.h"  // private to this engine

namespace refit::ucx {

/// Sends the offer on `socket`: `w`'s address and each of `regions`' extent and
/// packed key (numbered in order). Reads what UCX chose for the sender's endpoint
/// to it, which `choose` may amend (a worker that takes puts only into the model's
/// memory, and not there, says "tag"). Unless the data moves over one of
/// `required` (check_required) it refuses, telling the sender why, and throws
/// unsupported; else accepts. `who` names this side, `to` the sender ("the
/// trainer", "trainer rank 1", ...).
asio::awaitable<endpoint_report> offer_and_agree(asio::ip::tcp::socket& socket, const worker& w,
                                                 std::span<const registration* const> regions,
                                                 const std::vector<std::string>& required,
                                                 std::function<void(endpoint_report&)> choose,
                                                 std::chrono::milliseconds timeout, std::string who, std::string to);

/// Reads the sender's "done" for bucket `index` (its puts flushed or its tagged
/// send complete) and returns its checksum (0 without); protocol_error for another
/// bucket's, or a checksum present when `checksums` is off or missing when on.
asio::awaitable<std::uint64_t> read_done(asio::ip::tcp::socket& socket, std::uint64_t index, bool checksums,
                                         std::chrono::milliseconds timeout, const std::string& what);

}  // namespace refit::ucx
