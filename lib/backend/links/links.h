// What group engines (one trainer, N workers; tcp and nccl) share: the init info
// a worker gets, the rendezvous over an authenticated side channel, and the
// per-update header exchange that makes a metadata mismatch an error on both sides
// before any weight byte moves (see lib/backend/links/wire.h for the bytes).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/wire.h>
#include <refit/engine.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>

namespace refit::links {

/// The members of a worker's init info, like vLLM's NCCL engine's plus the
/// trainer's wire parameters: {"master_address": str, "master_port": int,
/// "rank_offset": int, "world_size": int, wire parameters, "timeout_ms": int}.
/// The worker's rank is rank_offset + its local rank; the trainer is rank 0.
struct join_info {
  std::string master_address;
  std::uint16_t master_port = 0;
  int rank_offset = 1;
  int world_size = 2;
  wire_params wire;
  std::optional<std::chrono::milliseconds> timeout;
  static join_info read(json_reader& r);
};

/// The trainer's arguments: {"master_address": str, "master_port": int (0: any
/// free port), "world_size": int, wire parameters, "timeout_ms": int (default: the
/// config's)}.
struct trainer_args {
  std::string address;
  std::uint16_t port = 0;
  int world_size = 2;
  wire_params wire;
  std::chrono::milliseconds timeout{0};
  static trainer_args read(json_reader& r, std::chrono::milliseconds default_timeout);
};

/// The init info for the workers of a trainer listening on `port`: a join_info
/// with rank_offset 1.
json worker_init_info(const trainer_args& args, std::uint16_t port);

/// This worker's rank from the info and its parallel layout; invalid_argument
/// when it is not below world_size.
int worker_rank(const join_info& info, const parallel_ranks& ranks, const std::string& backend);

/// A worker that joined: its rank and its side-channel connection (and, in relay
/// topologies, where its downstream workers reach it).
struct member {
  int rank = 0;
  std::shared_ptr<asio::ip::tcp::socket> socket;
  std::string address;           ///< the worker's address as this side sees it
  std::uint16_t relay_port = 0;  ///< its relay listener; 0: none
};

/// Trainer side: accepts connections on `acceptor` (sockets on `executor`) until
/// ranks 1 .. world_size-1 have each joined: authenticated with `secret`, said
/// hello with `wire`, and been welcomed with `welcome` (at most 4096 bytes, e.g. a
/// communicator id). Handshakes run concurrently; a connection that fails one is
/// refused (told why when possible) and the wait goes on. Throws timeout after
/// `timeout` naming the ranks that joined and the last refusal; cancelled when the
/// acceptor is closed. `who` prefixes messages ("tcp trainer").
asio::awaitable<std::vector<member>> accept_workers(asio::ip::tcp::acceptor& acceptor, asio::any_io_executor executor,
                                                    std::string secret, std::chrono::milliseconds timeout,
                                                    wire_params wire, int world_size, std::string who,
                                                    std::string welcome = {});
/// The same for the ranks in `expected` (a relay worker accepting its children).
asio::awaitable<std::vector<member>> accept_members(asio::ip::tcp::acceptor& acceptor, asio::any_io_executor executor,
                                                    std::string secret, std::chrono::milliseconds timeout,
                                                    wire_params wire, std::vector<int> expected, std::string who,
                                                    std::string welcome = {});

/// Worker side: connects (retrying until the deadline), authenticates, says hello
/// as `rank` with `wire`; returns the connection and the trainer's welcome text.
/// With `relay`, it is called with the local address of the connection and
/// returns the port of the listener it opened there (sent in the hello).
struct joined {
  asio::ip::tcp::socket socket;
  std::string welcome;
};
using relay_listener = std::function<std::uint16_t(const asio::ip::address& local)>;
asio::awaitable<joined> join(std::string address, std::uint16_t port, int rank, wire_params wire, std::string secret,
                             std::chrono::milliseconds timeout, std::string who, relay_listener relay = {});

/// The update header a trainer announces for update `seq` of `meta` planned as `plan`.
std::array<std::byte, 48> update_header(std::uint64_t seq, const update_metadata& meta, const bucket_plan& plan);

/// The same from explicit members (sharded streams announce their own plan).
std::array<std::byte, 48> update_header(std::uint64_t seq, std::uint64_t tensors, std::uint64_t digest,
                                        std::uint64_t buckets, std::uint64_t payload_bytes);

/// Trainer side: announces `header` to one worker and waits for it to accept.
asio::awaitable<void> announce_update(asio::ip::tcp::socket& socket, const std::array<std::byte, 48>& header,
                                      std::chrono::milliseconds timeout, std::string who);

/// Worker side: reads the trainer's update header and checks it against this
/// worker's own metadata and plan; refuses (telling the trainer why) and throws
/// protocol_error on a mismatch, else accepts. Returns the update's sequence number.
/// With `delta` (an engine that takes delta updates), the delta header that follows
/// a header flagged update_flag_delta is read (and checked) into it; without, such
/// a header is refused.
asio::awaitable<std::uint64_t> accept_update(asio::ip::tcp::socket& socket, std::uint64_t last_seq,
                                             const update_metadata& meta, const bucket_plan& plan,
                                             std::chrono::milliseconds timeout, std::string who,
                                             std::optional<wire::delta_header>* delta = nullptr);

/// Worker side, for an update it refuses before reading its header: tells the
/// trainer (a status with `kind` and `reason` for update `seq`, which its
/// announce_update reads at once), stops sending, takes in what the trainer sends
/// meanwhile (so the close resets nothing the status is still in), and closes the
/// connection. Completes within `linger`.
asio::awaitable<void> refuse_update(std::shared_ptr<asio::ip::tcp::socket> socket, std::uint64_t seq, errc kind,
                                    std::string reason, std::chrono::milliseconds linger, std::string who);

/// Both sides: the worker confirms (or fails) update `seq` after its last byte.
asio::awaitable<void> confirm_update(asio::ip::tcp::socket& socket, std::uint64_t seq,
                                     std::chrono::milliseconds timeout, std::string who);
asio::awaitable<void> await_confirmation(asio::ip::tcp::socket& socket, std::uint64_t seq,
                                         std::chrono::milliseconds timeout, std::string who);

}  // namespace refit::links
