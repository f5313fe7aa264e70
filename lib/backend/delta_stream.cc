#include <refit/backend/delta_stream.h>

#include <algorithm>
#include <array>

#include <refit/backend/async/offload.h>
#include <refit/backend/checksum.h>
#include <refit/backend/hex.h>
#include <refit/backend/send_cursor.h>
#include <refit/error.h>

namespace refit::backend {

json delta_send_info(const delta_send_stats& d) {
  return {{"delta",
           {{"version", d.version},
            {"fingerprint", d.fingerprint},
            {"base_version", d.base_version},
            {"delta_workers", d.delta_workers},
            {"full_fallbacks", d.full_fallbacks},
            {"encoded_buckets", d.encoded_buckets},
            {"delta_bytes", d.delta_bytes},
            {"encoded_full", d.encoded_full},
            {"full_bytes", d.full_bytes},
            {"encode_s", d.encode_s},
            {"over_bound", d.over_bound},
            {"snapshot_bytes", d.snapshot_bytes}}}};
}

std::uint64_t delta_fingerprint(std::uint64_t digest, std::span<const std::uint64_t> bucket_checksums) {
  const std::array<asio::const_buffer, 2> parts{asio::buffer(&digest, sizeof digest),
                                                asio::buffer(bucket_checksums.data(), bucket_checksums.size_bytes())};
  return checksum(std::span<const asio::const_buffer>(parts));
}

std::uint64_t fingerprint_of(const bucket_plan& plan, const std::vector<const std::byte*>& tensors,
                             std::uint64_t digest) {
  static constexpr std::array<std::byte, 4096> zeros{};
  std::vector<std::uint64_t> hashes;
  hashes.reserve(plan.buckets.size());
  std::vector<asio::const_buffer> parts;
  const auto pad = [&parts](std::uint64_t n) {
    for (; n > 0; n -= std::min<std::uint64_t>(n, zeros.size()))
      parts.emplace_back(zeros.data(), std::min<std::uint64_t>(n, zeros.size()));
  };
  for (const auto& b : plan.buckets) {
    parts.clear();
    std::uint64_t at = 0;
    for (const auto& p : plan.pieces_of(b)) {
      pad(p.bucket_offset - at);
      if (p.bytes > 0) parts.emplace_back(tensors.at(p.tensor) + p.tensor_offset, p.bytes);
      at = p.bucket_offset + p.bytes;
    }
    pad(b.payload_bytes - at);
    hashes.push_back(checksum(std::span<const asio::const_buffer>(parts)));
  }
  return delta_fingerprint(digest, hashes);
}

std::byte* delta_snapshot::reserve(std::uint64_t need) {
  need = std::max<std::uint64_t>(need, 1);
  if (capacity < need) {
    bytes.reset();
    capacity = 0;
    bytes = std::make_unique_for_overwrite<std::byte[]>(static_cast<std::size_t>(need));
    capacity = need;
  }
  return bytes.get();
}

std::optional<delta_offer> start_delta_send(delta_snapshot& base, std::uint64_t& version, std::uint64_t max_bytes,
                                            const update_metadata& declared, const bucket_plan& plan, bool allow_base,
                                            std::array<std::byte, 48>& update_header, delta_send_stats& stats) {
  namespace wire = links::wire;
  stats.full_bytes = plan.payload_bytes;
  if (max_bytes != 0 && plan.payload_bytes > max_bytes) {
    base = {};
    stats.over_bound = true;
    return std::nullopt;
  }
  const std::uint64_t digest = metadata_digest(declared);
  delta_offer offer;
  offer.has_base = base.valid && base.digest == digest && base.payload_bytes == plan.payload_bytes &&
                   base.buckets == plan.buckets.size() && allow_base;
  base.valid = false;  // it holds a mix of two versions until this send completes
  auto u = wire::decode<wire::update>(update_header);
  u.flags |= wire::update_flag_delta;
  update_header = wire::encode(u);
  wire::delta_header d;
  d.version = ++version;
  if (offer.has_base) {
    d.flags = wire::delta_flag_has_base;
    d.base_version = base.version;
    d.base_fingerprint = base.fingerprint;
  }
  offer.header = wire::encode(d);
  stats.version = d.version;
  stats.base_version = d.base_version;
  base.digest = digest;
  base.payload_bytes = plan.payload_bytes;
  base.buckets = plan.buckets.size();
  base.version = d.version;
  return offer;
}

std::optional<bool> next_delta_choice(const send_options& options, bool on, const std::string& who) {
  if (options.delta.value_or(false) && !on)
    throw_error(errc::invalid_argument, who + ": a delta update asked of a sender prepared without \"delta\": true");
  return options.delta;
}

void finish_delta_send(delta_snapshot& base, const bucket_delta_work& work, delta_send_stats& stats) {
  base.valid = true;
  stats.fingerprint = base.fingerprint;
  stats.encoded_buckets = work.encoded_buckets;
  stats.delta_bytes = work.delta_bytes;
  stats.encoded_full = work.encoded_full;
  stats.encode_s = work.encode_s;
  stats.snapshot_bytes = base.capacity;
}

void bucket_delta_work::prepare(const bucket_plan& p, const update_metadata& meta, std::vector<const std::byte*> n,
                                bool base, std::vector<std::vector<std::byte>>* out) {
  plan = &p;
  next = std::move(n);
  dtype_size.resize(meta.tensors.size());
  for (std::size_t i = 0; i < meta.tensors.size(); ++i) dtype_size[i] = element_size(meta.tensors[i].dtype);
  starts.resize(p.buckets.size());
  std::uint64_t at = 0;
  for (const bucket& b : p.buckets) {
    starts[b.index] = at;
    at += b.payload_bytes;
  }
  has_base = base;
  encoded = out;
  hashes.assign(p.buckets.size(), 0);
}

void bucket_delta_work::encode_bucket(std::size_t k, std::uint64_t hash, std::span<const asio::const_buffer> payload) {
  using clock_type = std::chrono::steady_clock;
  hashes[k] = hash;
  const refit::bucket& b = plan->buckets[k];
  std::byte* old = snapshot + starts[k];
  if (has_base) {
    const auto t0 = clock_type::now();
    std::vector<delta::piece_in> pieces;
    for (const auto& p : plan->pieces_of(b)) {
      if (p.bytes == 0) continue;
      const auto n = static_cast<std::size_t>(p.bytes);
      pieces.push_back({std::span<const std::byte>(old + p.bucket_offset, n),
                        std::span<const std::byte>(next[p.tensor] + p.tensor_offset, n),
                        delta::piece_elem(dtype_size[p.tensor], p.tensor_offset, p.bytes)});
    }
    auto& out = (*encoded)[k];
    out.clear();
    const auto r = delta::encode_pieces(pieces, out);
    // A delta never needs more room than the bucket: full when it is not smaller.
    if (r.bytes >= b.payload_bytes) {
      out.clear();
      out.shrink_to_fit();
    } else {
      ++encoded_buckets;
      delta_bytes += r.bytes;
      encoded_full += b.payload_bytes;
    }
    encode_s += std::chrono::duration<double>(clock_type::now() - t0).count();
  }
  pack_pieces(payload, old);
}

std::string delta_base_refusal(const links::wire::delta_header& d, const std::optional<held_version>& held,
                               const std::string& dirty_reason, const update_metadata& meta, model_target* current,
                               bool staged, std::vector<const std::byte*>& base,
                               std::vector<const std::byte*>& current_bytes) {
  const auto hex = [](std::uint64_t v) { return to_hex(v); };
  if (!held)
    return "this worker does not know which version its weights hold (no complete update from a trainer with "
           "deltas on since it started, or the last one failed or was staged in a session)";
  if (held->version != d.base_version || held->fingerprint != d.base_fingerprint)
    return "this worker holds version " + std::to_string(held->version) + " (fingerprint " + hex(held->fingerprint) +
           "), the deltas are against version " + std::to_string(d.base_version) + " (fingerprint " +
           hex(d.base_fingerprint) + ")";
  if (!dirty_reason.empty()) return "this worker's weights are dirty: " + dirty_reason;
  // Deltas decode against the tensors' current bytes: in place, in the memory the
  // model offers (destination()); staged, from there into the stage.
  base.assign(meta.tensors.size(), nullptr);
  current_bytes.assign(meta.tensors.size(), nullptr);
  for (std::size_t i = 0; i < meta.tensors.size(); ++i) {
    const auto& spec = meta.tensors[i];
    if (spec.nbytes() == 0) continue;
    std::optional<tensor_view> v = current ? current->destination(spec) : std::nullopt;
    if (!v || v->nbytes() != spec.nbytes() || !v->device.is_cpu() || v->data == nullptr)
      return "the model offers no host memory holding '" + spec.name +
             "' to decode a delta against (deltas need a model target with destination())";
    current_bytes[i] = static_cast<const std::byte*>(v->data);
    if (staged) base[i] = static_cast<const std::byte*>(v->data);
  }
  return {};
}

asio::awaitable<std::string> check_delta_base(const links::wire::delta_header& d,
                                              const std::optional<held_version>& held, std::string dirty_reason,
                                              const update_metadata& meta, model_target* current, bool staged,
                                              const bucket_plan& plan, asio::any_io_executor processing,
                                              std::vector<const std::byte*>& base) {
  std::vector<const std::byte*> bytes;
  std::string why = delta_base_refusal(d, held, dirty_reason, meta, current, staged, base, bytes);
  if (!why.empty()) co_return why;
  // The version's fingerprint says what arrived, not what the tensors hold now.
  const std::uint64_t digest = metadata_digest(meta);
  const auto* p = &plan;
  const auto* b = &bytes;
  const std::uint64_t now =
      co_await async::offload(processing, [p, b, digest] { return fingerprint_of(*p, *b, digest); });
  if (now != d.base_fingerprint)
    co_return "this worker's tensors no longer hold version " + std::to_string(d.base_version) +
        "'s bytes (their fingerprint is " + to_hex(now) + ", the base's " + to_hex(d.base_fingerprint) +
        "): written outside refit since that update";
  co_return std::string();
}

std::function<void()> delta_decode(const delta_receive& d, std::span<const std::byte> encoded,
                                   std::vector<bucket_transport::decode_target> pieces, std::string what) {
  if (!d.accepted) throw_error(errc::protocol_error, what + ": an unexpected delta bucket");
  std::vector<delta::piece_out> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) {
    const auto& spec = d.meta->tensors.at(p.tensor);
    const std::byte* base = d.base.at(p.tensor);
    out.push_back({base ? std::span<const std::byte>(base + p.tensor_offset, p.out.size())
                        : std::span<const std::byte>(p.out.data(), p.out.size()),
                   p.out, delta::piece_elem(element_size(spec.dtype), p.tensor_offset, p.out.size())});
  }
  return [encoded, out = std::move(out), what = std::move(what)] {
    try {
      delta::decode_pieces(encoded, out);
    } catch (const error& e) {
      throw_error(e.kind(), what + ": " + e.message());
    }
  };
}

std::function<void()> bucket_hash_check(std::span<const asio::mutable_buffer> dest,
                                        std::optional<std::uint64_t> expected, std::uint64_t* keep, std::string what,
                                        bool encoded) {
  return [dest = std::vector<asio::mutable_buffer>(dest.begin(), dest.end()), expected, keep, what = std::move(what),
          encoded] {
    const std::uint64_t got = checksum(dest);
    if (expected && got != *expected)
      throw_error(errc::integrity_error, what + ": payload checksum " + to_hex(got) + " differs from the trainer's " +
                                             to_hex(*expected) +
                                             (encoded ? " after decoding its delta (corrupted in transit, or "
                                                        "this worker's tensors did not hold the base)"
                                                      : " (corrupted in transit)"));
    if (keep) *keep = got;
  };
}

}  // namespace refit::backend
