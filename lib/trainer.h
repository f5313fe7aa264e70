// The trainer side of a weight transfer: refit's counterpart of vLLM's static
// trainer_send_weights(iterator, trainer_args). C++ has no static virtuals, so each
// backend registers a weight_sender type under the same name as its engine.
#pragma once

#include <iterator>
#include <memory>
#include <optional>
#include <ranges>
#include <string>
#include <string_view>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>

#include <refit/config.h>
#include <refit/error.h>
#include <refit/json.h>
#include <refit/metadata.h>
#include <refit/stats.h>
#include <refit/tensor.h>

namespace refit {

/// Pull-based iteration over the tensors a trainer sends (the Python iterator). The
/// memory each view points to must stay valid until the send completes.
class tensor_source {
 public:
  virtual ~tensor_source() = default;
  /// The next tensor, or nullopt at the end.
  virtual std::optional<tensor_view> next() = 0;
};

/// Adapts any input range of tensor_view (a vector, a ranges pipeline over a model's
/// parameters, ...) to a tensor_source. The range must outlive the adapter.
template <std::ranges::input_range R>
requires std::convertible_to<std::ranges::range_reference_t<R>, tensor_view>
class range_source final : public tensor_source {
 public:
  explicit range_source(R& range) : it_(std::ranges::begin(range)), end_(std::ranges::end(range)) {}
  std::optional<tensor_view> next() override {
    if (it_ == end_) return std::nullopt;
    tensor_view v = *it_;
    ++it_;
    return v;
  }

 private:
  std::ranges::iterator_t<R> it_;
  std::ranges::sentinel_t<R> end_;
};

/// What a sender is created with.
struct trainer_context {
  asio::any_io_executor executor;
  /// Where the trainer's tensors live (device engines make their buffers there).
  refit::device device;
  /// For engines that read device tensors (nccl, cuda_ipc): the native stream (a
  /// cudaStream_t, opaque here) on which the trainer last wrote its tensors, e.g.
  /// libtorch's current stream. Each send_weights reads them only after the work
  /// queued there when the send starts, without blocking the host. nullptr: the
  /// legacy default stream (what libtorch uses unless told otherwise). Work on any
  /// other stream must be synchronised by the trainer before sending.
  const void* native_stream = nullptr;
};

/// What a caller asks of one send (weight_sender::set_next_send).
struct send_options {
  /// Deltas (docs/delta.md), for a sender prepared with them (tcp, tcp_sharded with
  /// "delta": true). nullopt: as prepared; false: this update goes full to every
  /// worker (still numbered, and the sender's base is refreshed, so the next one
  /// may be a delta); true: the sender must have been prepared with deltas, else
  /// the call fails (error(invalid_argument), or unsupported where the engine
  /// sends no deltas).
  std::optional<bool> delta;
  /// For senders that read device tensors (nccl, cuda_ipc): the native stream (a
  /// cudaStream_t, opaque here; nullptr is the legacy default stream) this send's
  /// tensors were last written on, in place of trainer_context::native_stream for
  /// this send only: the send reads them only after the work queued there when it
  /// starts (e.g. the stream current in the trainer's framework at the call).
  /// nullopt: the context's. Senders of host memory ignore it.
  std::optional<const void*> producer_stream;
};

/// The trainer-side half of a backend. Typical use:
///   auto sender = factory.create_sender(config, ctx);
///   json init_info = sender->prepare(trainer_args);   // e.g. listen
///   // send init_info to every worker's init_weight_transfer_engine, and meanwhile
///   co_await sender->connect_workers();
///   co_await trainer_send_weights(*sender, declared, model_tensors);
class weight_sender {
 public:
  virtual ~weight_sender() = default;
  virtual std::string_view backend() const noexcept = 0;

  /// Sets up what workers connect to (without waiting for them) and returns the
  /// init_info JSON every worker passes to init_transfer_engine (rank_offset 1).
  /// `trainer_args` is backend-specific JSON, read strictly like init info.
  virtual json prepare(const json& trainer_args) = 0;
  /// Waits until every worker has connected (within the backend's deadline).
  virtual asio::awaitable<void> connect_workers() = 0;
  /// prepare() then connect_workers().
  asio::awaitable<void> init(const json& trainer_args) {
    prepare(trainer_args);
    co_await connect_workers();
  }

  /// Sends one update: the tensors `source` yields, which must match `declared`
  /// one to one and in order (the first divergent parameter is named in the error).
  virtual asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) = 0;

  /// Closes connections. Idempotent.
  virtual void shutdown() = 0;

  /// What the next send_weights (that one only) does beyond the defaults. This
  /// implementation, for engines that send no deltas, refuses delta == true with
  /// unsupported and accepts the rest.
  virtual void set_next_send(const send_options& options) {
    if (options.delta.value_or(false))
      throw_error(errc::unsupported, std::string(backend()) + " sender: this engine sends no delta updates");
  }

  /// Statistics of the last send.
  virtual update_stats last_send_stats() const { return {}; }
  /// What the last send did beyond its statistics, as the engine reports it, or
  /// null for engines with nothing to report. tcp with "delta": true:
  /// {"delta": {"version", "base_version", "delta_workers", "full_fallbacks",
  /// "encoded_buckets", "delta_bytes", "encoded_full", "full_bytes", "encode_s"}}
  /// (docs/delta.md).
  virtual json last_send_info() const { return nullptr; }
};

/// Sends a range of tensor views through `sender` (the C++ trainer_send_weights).
template <std::ranges::input_range R>
asio::awaitable<void> trainer_send_weights(weight_sender& sender, const update_metadata& declared, R&& tensors) {
  range_source<std::remove_reference_t<R>> source(tensors);
  co_await sender.send_weights(declared, source);
}

/// The metadata a trainer declares for a set of views (names, dtypes, shapes).
template <std::ranges::input_range R>
update_metadata describe(const R& tensors) {
  update_metadata meta;
  for (const tensor_view& v : tensors) meta.tensors.push_back(v.spec());
  meta.validate();
  return meta;
}

}  // namespace refit
