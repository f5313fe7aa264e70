// Checksums of scattered bytes: a bucket's payload is a list of buffers on both
// sides (the trainer's tensors, the worker's staging or model memory), and both
// must arrive at the same number.
#pragma once

#include <cstdint>
#include <span>

#include <asio/buffer.hpp>

namespace refit {

/// XXH3-64 of the concatenation of `buffers`.
std::uint64_t checksum(std::span<const asio::const_buffer> buffers);
std::uint64_t checksum(std::span<const asio::mutable_buffer> buffers);

}  // namespace refit
