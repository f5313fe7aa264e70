// TCP update and bucket headers, as a worker checks them against its own plan.
//
// The input describes an update (wire params, a few small tensors, the worker's last
// accepted sequence number) and then corrupts the stream a correct trainer would
// send: its remaining bytes are XORed over the encoded update header and bucket
// headers. An input of the description alone is a correct stream and must be
// accepted; a corrupted field must be refused exactly when the protocol says so
// (fields the worker does not check, such as reserved bytes, may change).
#include <array>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/links/wire.h>
#include <refit/metadata.h>
#include "tests/fuzz/fuzz.h"

namespace refit::fuzz {
namespace {

namespace wire = links::wire;

class reader {
 public:
  explicit reader(std::span<const std::uint8_t> in) : in_(in) {}
  std::uint64_t take(std::size_t bytes) {  // little-endian; zeros past the end
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < bytes; ++i) v |= std::uint64_t(next()) << (8 * i);
    return v;
  }
  std::uint8_t next() { return at_ < in_.size() ? in_[at_++] : 0; }

 private:
  std::span<const std::uint8_t> in_;
  std::size_t at_ = 0;
};

constexpr std::uint64_t max_planned = 1u << 12;

template <class T>
T decode_at(const std::vector<std::byte>& stream, std::size_t offset) {
  std::array<std::byte, sizeof(T)> raw;
  std::memcpy(raw.data(), stream.data() + offset, sizeof(T));
  return wire::decode<T>(raw);
}

bool run(std::span<const std::uint8_t> input) {
  reader in(input);
  const std::uint8_t config = in.next();
  wire_params params;
  params.checksums = config & 1;
  params.buffer_bytes = 4096ull << ((config >> 1) & 3);
  update_metadata meta;
  const int tensors = in.next() % 9;
  for (int i = 0; i < tensors; ++i) {
    tensor_spec t{"t" + std::to_string(i), static_cast<dtype>(in.next() % 12), {}};
    const int dims = in.next() % 3;
    for (int d = 0; d < dims; ++d) t.shape.push_back(static_cast<std::int64_t>(in.take(2) & 0x3fff));
    meta.tensors.push_back(std::move(t));
  }
  const std::uint64_t last_seq = in.take(8) >> 1;  // room for last_seq + 1
  if (meta.total_bytes() / params.buffer_bytes + meta.tensors.size() > max_planned) return false;
  const bucket_plan plan = plan_buckets(meta, params);

  // What a correct trainer sends.
  std::vector<std::byte> stream;
  auto append = [&](const auto& header) {
    const auto raw = wire::encode(header);
    stream.insert(stream.end(), raw.begin(), raw.end());
  };
  wire::update u;
  u.seq = last_seq + 1;
  u.digest = metadata_digest(meta);
  u.tensors = meta.tensors.size();
  u.buckets = plan.buckets.size();
  u.payload_bytes = plan.payload_bytes;
  append(u);
  for (const bucket& b : plan.buckets) {
    wire::bucket_header h;
    h.index = b.index;
    h.payload_bytes = b.payload_bytes;
    h.flags = params.checksums ? wire::flag_checksum : 0;
    h.checksum = b.index * 0x9E3779B97F4A7C15ull;  // checked after the payload, not here
    append(h);
  }
  // ... and what arrives.
  for (auto& byte : stream) byte ^= std::byte(in.next());

  // The worker's side, as engine::receive_on and its bucket transport check.
  const auto got = decode_at<wire::update>(stream, 0);
  const std::string magic = wire::check_update_magic(got);
  check(magic.empty() == (got.magic == wire::update_magic), "check_update_magic", "wrong verdict");
  if (!magic.empty()) return false;
  const wire::update_expectation expected{last_seq, u.tensors, u.digest, u.buckets, u.payload_bytes};
  const std::string mismatch = wire::check_update_header(got, expected);
  const bool update_ok = got.seq > last_seq && got.tensors == u.tensors && got.digest == u.digest &&
                         got.buckets == u.buckets && got.payload_bytes == u.payload_bytes;
  check(mismatch.empty() == update_ok, "check_update_header", "wrong verdict");
  if (!mismatch.empty()) return false;

  for (const bucket& b : plan.buckets) {
    const auto h = decode_at<wire::bucket_header>(stream, sizeof(wire::update) + b.index * sizeof(wire::bucket_header));
    const std::string why = wire::check_bucket_header(h, b.index, b.payload_bytes, params.checksums);
    const bool header_ok = h.magic == wire::bucket_magic && h.index == b.index && h.payload_bytes == b.payload_bytes &&
                           ((h.flags & wire::flag_checksum) != 0) == params.checksums;
    check(why.empty() == header_ok, "check_bucket_header", "wrong verdict");
    if (!why.empty()) return false;
  }
  return true;
}

}  // namespace
}  // namespace refit::fuzz

bool refit_fuzz_one(const std::uint8_t* data, std::size_t size) {
  bool ok = false;
  // Every shape here is valid and small: nothing may throw at all.
  refit::fuzz::check(refit::fuzz::expect("wire", {},
                                         [&] {
                                           ok = refit::fuzz::run({data, size});
                                         }),
                     "wire", "an error was thrown");
  return ok;
}
