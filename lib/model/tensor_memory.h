// Where a tensor_map_target's tensors live and how bytes move there. The core
// knows no device API: host memory is built in (host_tensor_memory, the default),
// and a device layer implements the interface for its memory (CUDA builds:
// refit::cuda::device_tensor_memory, lib/cuda/tensor_memory.h).
//
// Who calls what (see the threading contract in lib/model/tensor_map_target.h):
//
//  * allocate_zeroed / release: at tensor_map_target::add() and at the target's
//    destruction, on the application's thread, never on an engine's event loop
//    (device allocation may synchronise the device).
//  * copy_in: in load_weights, on the engine's processing executor; never
//    concurrently with itself for one target, but possibly concurrently with
//    copy_out.
//  * copy_out: in fingerprint (worker_host's weight_fingerprint), on the
//    processing executor, concurrently with anything, copy_in included (on other
//    memory of the target: double_buffered hashes the front copies while an update
//    writes the back ones).
//
// Implementations are therefore thread-safe for concurrent copy_in and copy_out,
// and both return only once the bytes are in place (synchronous with respect to
// the calling thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include <refit/tensor.h>

namespace refit {

class tensor_memory {
 public:
  virtual ~tensor_memory() = default;

  /// The device this memory is on: the device of every view a target using it
  /// hands out.
  virtual refit::device device() const noexcept = 0;
  /// At least `bytes` bytes (non-null even for 0 bytes: every tensor has an
  /// address), all zero when it returns. Throws refit::error (resource_exhausted)
  /// or the device layer's error on failure.
  virtual std::byte* allocate_zeroed(std::uint64_t bytes) = 0;
  /// Gives back what allocate_zeroed returned.
  virtual void release(std::byte* p) noexcept = 0;
  /// Copies the whole of `src` (src.nbytes() bytes, on the host or on device())
  /// to `dst`, memory on device() of at least that size.
  virtual void copy_in(std::byte* dst, const tensor_view& src) = 0;
  /// Copies host.size() bytes from `src` (memory on device()) to `host`.
  virtual void copy_out(std::span<std::byte> host, const std::byte* src) = 0;
};

/// Host memory: 64-byte aligned (at least one 64-byte line, even for 0 bytes),
/// zeroed and faulted in at allocation; copies are memcpy. copy_in refuses a view
/// that is not on the host (unsupported).
class host_tensor_memory final : public tensor_memory {
 public:
  refit::device device() const noexcept override { return device::cpu(); }
  std::byte* allocate_zeroed(std::uint64_t bytes) override;
  void release(std::byte* p) noexcept override;
  void copy_in(std::byte* dst, const tensor_view& src) override;
  void copy_out(std::span<std::byte> host, const std::byte* src) override;
};

/// A shared host_tensor_memory (what a target uses when given none).
std::shared_ptr<tensor_memory> host_memory();

}  // namespace refit
