// A trainer's send of one update as buckets (tcp, ucx): the steps every such sender
// walks, in one sequence (send_buckets), with the transport's parts apart
// (bucket_send_transport):
//
//   1. gather_update   every tensor the source yields walked and checked, each
//                      bucket's payload a gather list into the trainer's tensors,
//                      before any byte leaves;
//   2. offer_deltas    (deltas on) the version numbered, deltas offered against the
//                      snapshot, the work that encodes each bucket prepared;
//   3. transmit        the transport's: the header (and the offer's answers), each
//                      bucket with its checksum (hash_buckets, off the event loop,
//                      before the buckets go or while they do), the confirmations;
//   4. finish          (deltas on) the snapshot becomes the next base, and the
//                      workers that took the deltas or fell back are counted.
//
// A failure at any step closes the transport (bucket_send_transport::failed).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/delta_stream.h>
#include <refit/metadata.h>
#include <refit/trainer.h>

namespace refit::backend {

/// One update on its way, as the steps make it.
struct bucket_update {
  bucket_update(const update_metadata& declared, const bucket_plan& plan, std::uint64_t seq)
      : declared(declared), plan(plan), seq(seq) {}

  const update_metadata& declared;
  const bucket_plan& plan;
  std::uint64_t seq;
  std::array<std::byte, 48> header{};  ///< the update header (flagged by offer_deltas)
  /// gather_update: per bucket its payload, buffers into the trainer's tensors;
  /// per tensor its bytes.
  std::vector<std::vector<asio::const_buffer>> payloads;
  std::vector<const std::byte*> tensors;
  /// offer_deltas (deltas on, within their bound): the delta header and whether
  /// it offers a base, the work that encodes each bucket and refreshes the
  /// snapshot, and per bucket its delta (filled by hash_buckets; empty: sent full).
  std::optional<delta_offer> offer;
  std::shared_ptr<bucket_delta_work> work;
  std::vector<std::vector<std::byte>> encoded;
};

/// A sender's deltas (docs/delta.md): trainer_args' choice and bound, this send's
/// choice, and what the sender keeps from one send to the next.
struct delta_sending {
  bool on = false;              ///< trainer_args' "delta"
  std::uint64_t max_bytes = 0;  ///< trainer_args' "delta_max_bytes" (0: no bound)
  bool allow_base = true;       ///< set_next_send's choice for this send
  std::uint64_t& version;       ///< the last version numbered
  delta_snapshot& base;         ///< the bytes last sent
  delta_send_stats& stats;      ///< this send's (reset at its start)
};

/// What a stream to one peer did with the deltas offered.
struct peer_delta_outcome {
  std::size_t workers = 0;  ///< the workers the stream reaches (the peer and those it relays to)
  bool took_delta = false;  ///< they held the base: the buckets went as deltas
  bool fell_back = false;   ///< offered deltas, one did not hold the base: the update went full
};

/// The transport's parts of send_buckets (tcp and ucx each their own way).
class bucket_send_transport {
 public:
  /// Before anything of the update: each peer's state of the last one cleared.
  virtual void reset_peers() = 0;
  /// Step 3: the update to every peer (see the top of this file); completes when
  /// every worker confirmed it.
  virtual asio::awaitable<void> transmit(bucket_update& u) = 0;
  /// After transmit, with deltas offered: each peer's stream's outcome.
  virtual std::vector<peer_delta_outcome> delta_outcomes() const = 0;
  /// A step failed: closes the transport; may throw an error that says more than
  /// `failure` (send_buckets rethrows `failure` otherwise).
  virtual void failed(const bucket_update& u, std::exception_ptr failure) = 0;

 protected:
  ~bucket_send_transport() = default;
};

/// Steps 1 to 4 of `u` (its plan and sequence number chosen, the transport's
/// checks made) with `t`'s parts; `deltas.stats` is reset first.
asio::awaitable<void> send_buckets(bucket_send_transport& t, bucket_update& u, tensor_source& source,
                                   delta_sending deltas);

/// Step 1: the update header, and every tensor `source` yields checked against
/// what was declared, laid out as u.payloads and u.tensors.
void gather_update(bucket_update& u, tensor_source& source);

/// Step 2 (deltas on): start_delta_send; with an offer, u.encoded and u.work
/// prepared for hash_buckets.
void offer_deltas(bucket_update& u, const delta_sending& deltas);

/// Inside step 3, on one thread off the event loop, bucket after bucket: its
/// checksum, handed to `each(k, checksum)`, and with u.work its encoding against
/// `base` (which grows here first, and gets the version's fingerprint once every
/// bucket is done). Stops before the next bucket once `*stop` (when given) is set;
/// returns whether it did every bucket.
bool hash_buckets(bucket_update& u, delta_snapshot& base, const std::function<void(std::size_t, std::uint64_t)>& each,
                  const std::atomic<bool>* stop = nullptr);

}  // namespace refit::backend
