// What the trainer and a relaying worker do alike towards a worker they send
// buckets to (private to the ucx engine): take its UCX offer and make an endpoint
// to it, then per bucket read its grant, put into the granted slot (flushed) or
// send tagged, and say "done" (with the trainer's checksum when asked). The
// trainer runs it for its direct children; a worker in a chain or tree for its own
// children, from its registered memory, once the bucket's "done" came from upstream.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>
#include <asio/ip/tcp.hpp>

#include <refit/engines/ucx/ucx.h>
#include "ucp.h"  // private to this engine

namespace refit::ucx {

/// A worker buckets are sent to: its side channel, the endpoint to it on the
/// sender's UCX worker, and the regions whose keys it gave.
struct downstream {
  struct region {
    std::uint64_t base = 0, bytes = 0;
    std::unique_ptr<remote_key> rkey;
    /// [at, at + n) lies within the region.
    bool holds(std::uint64_t at, std::uint64_t n) const noexcept {
      return at >= base && n <= bytes && at - base <= bytes - n;
    }
  };
  int rank = 0;
  std::string name;  ///< "ucx trainer: worker rank 2", "ucx worker rank 1: downstream worker rank 3"
  std::shared_ptr<asio::ip::tcp::socket> socket;
  std::unique_ptr<endpoint> ep;
  std::map<std::uint32_t, region> regions;
  endpoint_report report;
  // The trainer's last update with deltas on: what the worker answered.
  bool took_delta = false, fell_back = false;

  /// The key for writing [at, at + n) of region `id`: learns the region first when
  /// its key came with the grant (`key` not empty, extent [base, base + bytes)).
  /// protocol_error ("<what>: the grant (or piece <piece> of it) lies outside the
  /// worker's registered memory", nothing written) unless the range lies within a
  /// region it registered.
  const remote_key& key_for(std::uint32_t id, std::span<const std::byte> key, std::uint64_t base, std::uint64_t bytes,
                            std::uint64_t at, std::uint64_t n, const std::string& what,
                            std::optional<std::uint32_t> piece = {});
  /// Drops the keys of regions the worker registered for one update only (the
  /// model's memory, a stage): called as each update starts.
  void forget_update_regions() noexcept;
  /// Keys first (while the endpoint's worker lives), then the endpoint (a send in
  /// flight finds it closed before it touches a key again), then the socket.
  void close() noexcept;
};

/// Reads its UCX offer, makes the endpoint on `w` (wired up before anything is
/// read back), tells it what UCX chose and waits for it to accept. A malformed
/// offer is protocol_error (the worker is told why).
asio::awaitable<void> connect_downstream(std::shared_ptr<downstream> d, std::shared_ptr<worker> w,
                                         std::chrono::milliseconds timeout);

/// Bucket `index` (its bytes `payload`, from anywhere in this process) to `d` for
/// update `seq`: with `form` (`d` took a delta offer), the bucket's form first
/// (wire::form: the delta's bytes, which `payload` then holds, or 0 for the
/// bucket's own), then its grant, the puts and their flush or the tagged send
/// (either abandoned with peer_lost as soon as `d` hangs up its side channel),
/// then "done" carrying `checksum` when there is one.
asio::awaitable<void> send_bucket(std::shared_ptr<worker> w, std::shared_ptr<downstream> d, std::uint64_t index,
                                  std::span<const asio::const_buffer> payload, std::uint64_t seq,
                                  std::optional<std::uint64_t> checksum, std::chrono::milliseconds timeout,
                                  std::optional<std::uint64_t> form = std::nullopt);

/// Awaits `op` towards `d`; if it fails, the worker's own reason (it says why
/// before it closes) is the error where it gave one.
asio::awaitable<void> with_peer_reason(asio::awaitable<void> op, std::shared_ptr<downstream> d);

}  // namespace refit::ucx
