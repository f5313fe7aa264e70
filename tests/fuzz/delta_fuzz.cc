// Delta payloads (lib/backend/delta.h), as a worker decodes what a trainer sent,
// and the encoder's round trip.
//
// Input: a config byte (element size 1 << (c & 3); bits 4-7: the encoder's
// options), the encoding's wire value, a u16 element count (at most 1024), the
// base's bytes, then the payload. decode() must accept it or refuse it with
// protocol_error (an unknown wire value too), never read or write out of bounds,
// and decoding in place must give what decoding into other memory gave. Then the
// payload's bytes perturb the base into a next version: encode(base, next) must
// decode back to exactly next, and be no larger than next.
#include <cstring>
#include <span>
#include <vector>

#include <refit/backend/delta.h>
#include "tests/fuzz/fuzz.h"

namespace refit::fuzz {
namespace {

namespace delta = backend::delta;

bool run(std::span<const std::uint8_t> input) {
  std::size_t at = 0;
  auto next_byte = [&]() -> std::uint8_t { return at < input.size() ? input[at++] : 0; };
  const std::uint8_t config = next_byte();
  const std::uint8_t wire_kind = next_byte();
  const std::size_t elem = std::size_t{1} << (config & 3);
  std::size_t n = next_byte();
  n |= std::size_t{next_byte()} << 8;
  n %= 1025;
  std::vector<std::byte> base(n * elem);
  for (auto& b : base) b = static_cast<std::byte>(next_byte());
  const auto rest = input.subspan(std::min(at, input.size()));
  const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(rest.data()), rest.size());

  std::vector<std::byte> out(base.size());
  const bool accepted = expect("decode", {errc::protocol_error}, [&] {
    const delta::encoding kind = delta::encoding_from_wire(wire_kind);
    delta::decode(kind, payload, base, out, elem);
    std::vector<std::byte> in_place = base;
    delta::decode(kind, payload, in_place, in_place, elem);
    check(in_place == out, "decode", "in place and into other memory differ");
  });

  // The round trip: next is base with the payload's bytes XORed in, scattered.
  std::vector<std::byte> next = base;
  if (!next.empty())
    for (std::size_t i = 0; i < payload.size(); ++i) next[(i * 2654435761u) % next.size()] ^= payload[i];
  const delta::encode_options options{.allow_zstd = (config & 0x20) == 0,
                                      .allow_planes = (config & 0x40) == 0,
                                      .zstd_with_planes = (config & 0x80) != 0,
                                      .fast_planes = (config & 0x10) == 0};
  expect("round trip", {}, [&] {
    std::vector<std::byte> wire;
    const auto r = delta::encode(base, next, elem, wire, options);
    check(r.bytes == wire.size(), "round trip", "encode's size is not what it appended");
    check(r.bytes <= next.size() || next.empty(), "round trip", "an encoding larger than the full bytes");
    std::vector<std::byte> back(base.size());
    delta::decode(r.kind, wire, base, back, elem);
    check(back == next, "round trip", "decode(encode(next)) differs from next");
  });
  return accepted;
}

}  // namespace
}  // namespace refit::fuzz

bool refit_fuzz_one(const std::uint8_t* data, std::size_t size) { return refit::fuzz::run({data, size}); }
