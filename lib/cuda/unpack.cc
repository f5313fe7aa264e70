#include <refit/cuda/unpack.h>

#include <algorithm>
#include <string>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/error.h>

namespace refit::cuda {

std::size_t unpack_descriptor_count(std::span<const piece> pieces, std::uint64_t chunk_bytes) {
  std::size_t count = 0;
  for (const piece& p : pieces) count += (p.bytes + chunk_bytes - 1) / chunk_bytes;
  return count;
}

std::size_t prepare_unpack_descriptors(std::span<const piece> pieces, std::span<piece> out, std::uint64_t chunk_bytes) {
  if (chunk_bytes == 0 || chunk_bytes % 16 != 0)
    throw_error(errc::invalid_argument,
                "prepare_unpack_descriptors: chunk_bytes must be a positive multiple of 16, "
                "got " +
                    std::to_string(chunk_bytes));
  const std::size_t needed = unpack_descriptor_count(pieces, chunk_bytes);
  if (out.size() < needed)
    throw_error(errc::invalid_argument, "prepare_unpack_descriptors: " + std::to_string(pieces.size()) +
                                            " pieces need " + std::to_string(needed) + " descriptors, got room for " +
                                            std::to_string(out.size()));
  std::size_t n = 0;
  for (const piece& p : pieces) {
    for (std::uint64_t offset = 0; offset < p.bytes; offset += chunk_bytes)
      out[n++] = {p.src + offset, p.dst + offset, std::min(chunk_bytes, p.bytes - offset)};
  }
  return n;
}

void unpack(std::span<const piece> pieces, std::span<piece> host_scratch, piece* device_scratch, cudaStream_t stream) {
  const std::size_t n = prepare_unpack_descriptors(pieces, host_scratch);
  if (n == 0) return;
  REFIT_CUDA_CHECK(
      cudaMemcpyAsync(device_scratch, host_scratch.data(), n * sizeof(piece), cudaMemcpyHostToDevice, stream));
  launch_unpack(device_scratch, n, stream);
}

namespace {
int device_or_current(int device) {
  if (device >= 0) return device;
  int d = 0;
  REFIT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
}  // namespace

unpacker::unpacker(std::size_t slots, int device) : device_(device_or_current(device)) {
  // Events belong to the device current when they are made: make them on device_.
  const device_scope scope(device_);
  slots_.resize(std::max<std::size_t>(slots, 1));
}

void unpacker::unpack(std::span<const piece> pieces, cudaStream_t stream) {
  const std::size_t n = unpack_descriptor_count(pieces);
  if (n == 0) return;
  const device_scope scope(device_);
  slot& s = slots_[next_];
  next_ = (next_ + 1) % slots_.size();
  // Its previous batch (possibly on another stream) must have finished reading both
  // the staging and the device descriptors. Usually long done: no wait.
  if (s.used && !s.done.query()) s.done.synchronize();
  if (n > s.capacity) {
    const std::size_t capacity = std::max<std::size_t>({n, 2 * s.capacity, 256});
    s.host = pinned_buffer();  // free first: peak memory stays one buffer each
    s.device = device_buffer();
    s.host = pinned_buffer(capacity * sizeof(piece));
    s.device = device_buffer(capacity * sizeof(piece));
    s.capacity = capacity;
  }
  cuda::unpack(pieces, {s.host.as<piece>(), s.capacity}, s.device.as<piece>(), stream);
  s.done.record(stream);
  s.used = true;
}

}  // namespace refit::cuda
