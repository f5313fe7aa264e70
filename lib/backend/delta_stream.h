// Delta updates over a stream of buckets (docs/delta.md): what a trainer and its
// workers share around the codec (delta.h), for every engine that sends an update
// as buckets (tcp, ucx): the version fingerprint, the trainer's snapshot of what
// it last sent and its per-bucket encoding, the worker's record of the version it
// holds, its check that it still holds a base, and its decode and hash of a
// bucket. The wire (the delta header after the update header, the worker's
// answer, a flag per delta bucket) is links/wire.h's.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <array>
#include <utility>

#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/buffer.hpp>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/delta.h>
#include <refit/backend/links/wire.h>
#include <refit/backend/pipeline.h>
#include <refit/engine.h>
#include <refit/json.h>
#include <refit/json_reader.h>
#include <refit/trainer.h>

namespace refit::backend {

/// A version of the weights a worker holds, as a trainer with deltas on numbered
/// it, and its fingerprint (delta_fingerprint of the bytes that arrived).
struct held_version {
  std::uint64_t version = 0;
  std::uint64_t fingerprint = 0;
};

/// What a sender's last send did with deltas (docs/delta.md).
struct delta_send_stats {
  std::uint64_t version = 0;       ///< the version it sent (0: deltas off)
  std::uint64_t fingerprint = 0;   ///< that version's (delta_fingerprint), as its workers now hold it
  std::uint64_t base_version = 0;  ///< the base its deltas were against (0: none, every worker got it full)
  std::size_t delta_workers = 0;   ///< workers that took the deltas
  /// Workers offered deltas and sent the update full: they did not hold the base,
  /// or (relays) a worker their stream also reaches did not.
  std::size_t full_fallbacks = 0;
  std::uint64_t encoded_buckets = 0;  ///< buckets (sharded: frames) sent as deltas (the rest full: not smaller)
  std::uint64_t delta_bytes = 0;      ///< bytes of those deltas (headers not counted)
  std::uint64_t encoded_full = 0;     ///< those buckets' payload bytes (their cost sent full)
  std::uint64_t full_bytes = 0;       ///< the update's payload bytes (what a full update sends)
  double encode_s = 0;                ///< time spent encoding (off the event loop)
  /// The update was larger than the sender's "delta_max_bytes": sent as a plain
  /// update (no delta header, no version), and no snapshot is held.
  bool over_bound = false;
  std::uint64_t snapshot_bytes = 0;  ///< the memory of the snapshot held after the send
};

/// trainer_args' "delta_max_bytes" (optional, 0: no bound): the largest snapshot
/// a sender with deltas on holds; an update larger than it goes without deltas.
inline std::uint64_t read_delta_max_bytes(json_reader& r) { return r.optional<std::uint64_t>("delta_max_bytes", 0); }
/// {"delta": {every member of `d`}}: what last_send_info() reports with deltas on.
json delta_send_info(const delta_send_stats& d);

/// The fingerprint of a version of an update's bytes, as both sides of a delta
/// update compute it: XXH3-64 over the metadata digest and the checksum of every
/// bucket's payload bytes (padding included), in order.
std::uint64_t delta_fingerprint(std::uint64_t digest, std::span<const std::uint64_t> bucket_checksums);

/// The delta fingerprint of the bytes `tensors` hold now (per tensor its first
/// byte; nullptr for an empty one), laid out in buckets as `plan` says: every
/// bucket's pieces with its padding as zeros, as the trainer sends them.
std::uint64_t fingerprint_of(const bucket_plan& plan, const std::vector<const std::byte*>& tensors,
                             std::uint64_t digest);

// ---- Trainer side

/// The snapshot of the bytes a trainer last sent (its next base): the update's
/// payload bytes, laid out bucket after bucket.
struct delta_snapshot {
  std::unique_ptr<std::byte[]> bytes;
  std::uint64_t capacity = 0;
  bool valid = false;  // holds exactly version's bytes
  std::uint64_t digest = 0, payload_bytes = 0, buckets = 0;
  std::uint64_t version = 0, fingerprint = 0;
  /// At least `need` bytes (its old bytes are kept only when it is large enough
  /// already: a base has the same size as the update it is the base of). Off the
  /// event loop: the allocation may be the model's size.
  std::byte* reserve(std::uint64_t need);
};

/// The delta header of a send that goes with deltas.
struct delta_offer {
  std::array<std::byte, sizeof(links::wire::delta_header)> header;
  bool has_base = false;  ///< it offers `base` as the base (else every worker gets it full)
};

/// Starts a send of `plan` (the tensors `declared`) by a sender with deltas on.
/// Over `max_bytes` (0: no bound) it goes plain: the snapshot is let go,
/// `stats.over_bound` is set and nullopt returned. Otherwise it numbers a new
/// version (++version), offers `base` as its base when the snapshot holds the last
/// version of the same tensors and plan and `allow_base`, flags `update_header`,
/// fills `stats`' version, base and full bytes, and marks the snapshot as this
/// version's, invalid until finish_delta_send.
std::optional<delta_offer> start_delta_send(delta_snapshot& base, std::uint64_t& version, std::uint64_t max_bytes,
                                            const update_metadata& declared, const bucket_plan& plan, bool allow_base,
                                            std::array<std::byte, 48>& update_header, delta_send_stats& stats);

struct bucket_delta_work;
/// After every worker confirmed: the snapshot is the version's bytes (the next
/// base, with the fingerprint `work` made), and `stats` get what was encoded.
void finish_delta_send(delta_snapshot& base, const bucket_delta_work& work, delta_send_stats& stats);

/// set_next_send's delta choice for a sender whose deltas are `on`: delta == true
/// asks for deltas, which a sender prepared without them refuses
/// (invalid_argument naming `who`). Returns the choice for the next send.
std::optional<bool> next_delta_choice(const send_options& options, bool on, const std::string& who);

/// A delta update's work per bucket, in bucket order on one thread (with each
/// bucket's checksum): encode the bucket's pieces against the snapshot (when the
/// sender offers a base), then copy the new bytes into the snapshot.
struct bucket_delta_work {
  const bucket_plan* plan = nullptr;
  std::vector<const std::byte*> next;  // per tensor: the trainer's bytes
  std::vector<std::size_t> dtype_size;
  std::byte* snapshot = nullptr;
  std::vector<std::uint64_t> starts;  // per bucket: its place in the snapshot
  bool has_base = false;
  std::vector<std::vector<std::byte>>* encoded = nullptr;  // per bucket; empty: sent full
  std::vector<std::uint64_t> hashes;
  std::uint64_t encoded_buckets = 0, delta_bytes = 0, encoded_full = 0;
  double encode_s = 0;

  /// Ready for `plan` (kept by pointer) of the tensors `next` (by tensor, as the
  /// send cursor's views), with or without a base to encode against.
  void prepare(const bucket_plan& plan, const update_metadata& meta, std::vector<const std::byte*> next, bool has_base,
               std::vector<std::vector<std::byte>>* encoded);
  /// Bucket k, whose checksum is `hash` and whose bytes are `payload`.
  void encode_bucket(std::size_t k, std::uint64_t hash, std::span<const asio::const_buffer> payload);
};

// ---- Worker side

/// Why a worker cannot take deltas against `d`'s base, as far as what it recorded
/// tells ("" when it can): `held` (what it recorded), `dirty_reason` (empty: its
/// weights are clean), and whether `current` (the model target whose
/// destination() holds the tensors' current bytes) offers host memory for every
/// tensor of `meta`. When it can: `current_bytes` says where each tensor's bytes
/// are, and with `staged` (decoded from there into the stage) `base` too (else
/// all null: decoded in place).
std::string delta_base_refusal(const links::wire::delta_header& d, const std::optional<held_version>& held,
                               const std::string& dirty_reason, const update_metadata& meta, model_target* current,
                               bool staged, std::vector<const std::byte*>& base,
                               std::vector<const std::byte*>& current_bytes);

/// The whole check a worker makes before it answers a delta offer with a base:
/// delta_base_refusal, then the fingerprint of its tensors' current bytes (hashed
/// on `processing`, as the trainer laid them out in `plan`) against the base's, so
/// that bytes written outside refit since get the update full. "" when it takes the
/// deltas (`base` is then set: see delta_receive).
asio::awaitable<std::string> check_delta_base(const links::wire::delta_header& d,
                                              const std::optional<held_version>& held, std::string dirty_reason,
                                              const update_metadata& meta, model_target* current, bool staged,
                                              const bucket_plan& plan, asio::any_io_executor processing,
                                              std::vector<const std::byte*>& base);

/// The version a worker records, across update sessions: taken at the start of
/// each update (it is known only until that update changes the weights), recorded
/// after it completed; a chunk staged in an open session counts once the session
/// commits, and a session discarded leaves what was held before it.
class held_record {
 public:
  std::optional<held_version> take() { return std::exchange(held_, std::nullopt); }
  /// After an update that brought `now` completed; `before`: what take() returned.
  void record(held_version now, bool in_session, const std::optional<held_version>& before) {
    if (!in_session) {
      held_ = now;
      return;
    }
    if (!staged_) before_ = before;
    staged_ = now;
  }
  void committed() {
    if (staged_) held_ = std::exchange(staged_, std::nullopt);
    before_.reset();
  }
  /// The session ended; `dirty`: a failed commit left the weights dirty.
  void finished(bool dirty) {
    if (staged_ && !dirty) held_ = before_;
    staged_.reset();
    before_.reset();
  }
  const std::optional<held_version>& held() const noexcept { return held_; }

 private:
  std::optional<held_version> held_;  // kept across re-inits: the model's bytes do not change there
  std::optional<held_version> staged_, before_;
};

/// What an update that came with a delta header needs on its way through the
/// transport: whether its buckets may arrive as deltas, what to decode them
/// against, and the hash of every bucket's bytes (the fingerprint's parts).
struct delta_receive {
  bool accepted = false;  // this worker holds the base: buckets may arrive encoded
  const update_metadata* meta = nullptr;
  // Per tensor, its current bytes when they are not where the new ones go (a staged
  // update decodes from the model into the stage); nullptr: decoded in place.
  std::vector<const std::byte*> base;
  std::vector<std::uint64_t> hashes;  // per bucket, set by its check
};

/// bucket_transport::decode for a delta bucket: decodes `encoded` into `pieces`
/// against `d`'s base (or in place); errors name `what`.
std::function<void()> delta_decode(const delta_receive& d, std::span<const std::byte> encoded,
                                   std::vector<bucket_transport::decode_target> pieces, std::string what);

/// bucket_transport::check with deltas and checksums: hashes `dest`; with
/// `expected` compares (integrity_error naming `what`, and with `encoded`, that
/// the bucket was decoded), and keeps the hash in `*keep` when given.
std::function<void()> bucket_hash_check(std::span<const asio::mutable_buffer> dest,
                                        std::optional<std::uint64_t> expected, std::uint64_t* keep, std::string what,
                                        bool encoded);

}  // namespace refit::backend
