// The receive pipeline every engine shares:
//
//   for bucket k:
//     slot = co_await ring.acquire()        // waits for processing of bucket k-N
//     co_await transport.receive(k, slot)
//     spawn process(k, slot)                // load_weights on the processing executor;
//                                           // its completion releases the slot
//
// so bucket k+1 is received while bucket k is processed, and staging memory stays
// at num_buffers x buffer_bytes (plus one assembly buffer for tensors larger than a
// buffer) however large the model is.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>

#include <refit/backend/async/drain_scope.h>
#include <refit/backend/async/slot_ring.h>
#include <refit/backend/bucket_plan.h>
#include <refit/engine.h>

namespace refit {

/// Where received bytes land. Host memory here; lib/cuda provides device memory.
class staging_memory {
 public:
  virtual ~staging_memory() = default;
  virtual refit::device device() const noexcept = 0;
  virtual std::size_t slot_count() const noexcept = 0;
  virtual std::span<std::byte> slot(std::size_t index) = 0;
  /// A buffer of at least `bytes` for assembling a split tensor, grown on demand
  /// and kept for later updates.
  virtual std::span<std::byte> assembly(std::uint64_t bytes) = 0;
  /// Bytes currently allocated (slots plus assembly).
  virtual std::uint64_t allocated_bytes() const noexcept = 0;
};

/// Page-aligned host staging: `count` slots of `bytes`, allocated up front.
class host_staging final : public staging_memory {
 public:
  host_staging(std::size_t count, std::uint64_t bytes);
  refit::device device() const noexcept override { return device::cpu(); }
  std::size_t slot_count() const noexcept override { return slots_.size(); }
  std::span<std::byte> slot(std::size_t index) override;
  std::span<std::byte> assembly(std::uint64_t bytes) override;
  std::uint64_t allocated_bytes() const noexcept override;

 private:
  struct free_deleter {
    void operator()(std::byte* p) const noexcept;
  };
  using buffer = std::unique_ptr<std::byte[], free_deleter>;
  static buffer allocate(std::uint64_t bytes);

  std::uint64_t slot_bytes_;
  std::vector<buffer> slots_;
  buffer assembly_;
  std::uint64_t assembly_bytes_ = 0;
};

/// The engine-specific part: moving one bucket's payload into memory.
class bucket_transport {
 public:
  virtual ~bucket_transport() = default;
  /// Called before receive(b, ...): reads and checks whatever precedes bucket b's
  /// payload (a header). A failure here has written nothing anywhere, so the model
  /// is still untouched. Default: nothing.
  virtual asio::awaitable<void> begin(const bucket& /*b*/) { co_return; }
  /// Receives exactly b.payload_bytes bytes of bucket `b`, scattered over `dest`
  /// in order (staging, or a model's own memory). Throws on peer loss, timeout or a
  /// protocol violation.
  virtual asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) = 0;
  /// After receive(b, dest): work that verifies what arrived (a checksum over
  /// `dest`), or an empty function. The pipeline runs it on the processing
  /// executor, in bucket order before the bucket is loaded, while the next buckets
  /// are received; receive() completes only once every check has passed, and a
  /// check that throws fails the update with its error (nothing after that bucket
  /// is loaded). `dest` stays valid until the check has run.
  virtual std::function<void()> check(const bucket& /*b*/, std::span<const asio::mutable_buffer> /*dest*/) {
    return {};
  }
  /// After receive(b, dest): what completes once the transport itself no longer
  /// reads `dest` (a relay still forwarding the bucket to its children), or an
  /// empty function. The pipeline awaits it on the event loop before b's check and
  /// load, so nothing changes `dest` or reuses its slot before it; an error it
  /// throws fails the update like a check's. It must not need the transport alive
  /// (receive() completes once every one has completed). Default: none.
  virtual std::function<asio::awaitable<void>()> settled(const bucket& /*b*/) { return {}; }

  // ---- Encoded buckets (delta updates, docs/delta.md). Transports that never
  // encode keep the defaults.

  /// After begin(b): the size of bucket b's payload when it arrives encoded against
  /// the bytes its tensors hold now (fewer than b.payload_bytes), else nullopt (plain
  /// bytes). An encoded payload is received into a staging slot, never into a
  /// tensor's memory; every tensor of the bucket needs a destination (the target's),
  /// else the update fails with protocol_error before the payload is read. Then, on
  /// the processing executor: decode() writes the bucket's bytes into the
  /// destinations, check() verifies them (over the decoded bytes, padding as zeros),
  /// and the bucket is loaded as a plain one.
  virtual std::optional<std::uint64_t> encoded_bytes(const bucket& /*b*/) { return std::nullopt; }
  /// One piece of an encoded bucket: where its decoded bytes go.
  struct decode_target {
    std::size_t tensor = 0;           ///< index in the update's metadata
    std::uint64_t tensor_offset = 0;  ///< of the piece in its tensor
    std::span<std::byte> out;         ///< the piece's bytes in the tensor's destination
  };
  /// For a bucket encoded_bytes() announced: the work (run on the processing
  /// executor) that decodes `encoded` (in staging, valid until it has run) into
  /// `pieces` (b's pieces of non-zero size, in order); throws on a corrupt payload.
  virtual std::function<void()> decode(const bucket& b, std::span<const std::byte> encoded,
                                       std::vector<decode_target> pieces);
};

/// Runs updates through staging memory that lives as long as the pipeline.
class receive_pipeline {
 public:
  /// `processing` runs load_weights; calls for one update are serialised on a
  /// strand of it, in bucket order.
  receive_pipeline(asio::any_io_executor executor, asio::any_io_executor processing, wire_params params,
                   std::unique_ptr<staging_memory> staging);

  /// Receives the update described by `meta` through `transport`. Processing runs
  /// in `scope`: when this completes every bucket has arrived, and scope.join()
  /// completes when every tensor has been loaded. `stats` is filled in as work
  /// completes (final after the join). On a transport error, processing already in
  /// flight is awaited before the error propagates, so staging is never in use
  /// after a failed receive returns. When `target` gives a destination for a
  /// tensor, its bytes are received there directly.
  asio::awaitable<void> receive(const update_metadata& meta, bucket_transport& transport, load_weights_fn load_weights,
                                async::drain_scope& scope, update_stats& stats, model_target* target = nullptr);
  /// The same with the plan the engine already made (plan_buckets(meta, params())),
  /// for engines that check it against the trainer before receiving.
  asio::awaitable<void> receive(const update_metadata& meta, bucket_plan plan, bucket_transport& transport,
                                load_weights_fn load_weights, async::drain_scope& scope, update_stats& stats,
                                model_target* target = nullptr);

  const wire_params& params() const noexcept { return params_; }
  staging_memory& staging() noexcept { return *staging_; }
  refit::device staging_device() const noexcept { return staging_->device(); }

 private:
  struct update_state;
  // What runs before a bucket's load: the transport's settled() and check().
  struct bucket_checks {
    std::function<asio::awaitable<void>()> settle;
    std::function<void()> check;
    explicit operator bool() const noexcept { return settle || check; }
  };
  void process(std::shared_ptr<update_state> state, std::vector<tensor_view> views, std::optional<std::size_t> slot,
               bool assembly, std::uint64_t bucket_index, bucket_checks checks, async::drain_scope& scope,
               update_stats& stats);
  asio::awaitable<void> process_bucket(std::shared_ptr<update_state> state, std::vector<tensor_view> views,
                                       std::optional<std::size_t> slot, bool assembly, std::uint64_t bucket_index,
                                       bucket_checks checks, update_stats& stats);

  // receive()'s steps: the assembly buffer grown for the update, then each bucket
  // received (a split tensor's chunk, or a bucket through a staging slot; either
  // plain or a delta) and handed to process().
  struct receive_call;
  asio::awaitable<void> grow_assembly(const receive_call& call);
  asio::awaitable<void> receive_chunk(receive_call& call, const bucket& b);
  asio::awaitable<void> receive_encoded_chunk(receive_call& call, const bucket& b, std::byte* base,
                                              std::uint64_t encoded, std::chrono::steady_clock::time_point t0);
  asio::awaitable<void> receive_bucket(receive_call& call, const bucket& b);
  asio::awaitable<std::function<void()>> receive_encoded_bucket(receive_call& call, const bucket& b, std::byte* mem,
                                                                std::uint64_t encoded);

  asio::any_io_executor executor_;
  asio::any_io_executor processing_;
  wire_params params_;
  std::unique_ptr<staging_memory> staging_;
  async::slot_ring slots_;
  async::slot_ring assembly_;  // one assembly buffer: a split tensor waits for the last one's processing
};

}  // namespace refit
