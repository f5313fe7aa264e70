// The receive pipeline on a GPU with a device-to-device transport standing in for a
// network: the "trainer" packs every bucket into one device buffer; receiving bucket
// k copies its bytes into the staging slot on a communication stream (optionally
// followed by a spin that makes the link as slow as `link_bytes_per_s`), awaited
// through the CUDA-to-asio bridge. Shared by pipeline_gpu_test and pipeline_bench.
#pragma once

#include <cstring>
#include <vector>

#include <refit/backend/bucket_plan.h>
#include <refit/backend/pipeline.h>
#include <refit/backend/send_cursor.h>
#include <refit/cuda/await.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/trainer.h>
#include "tests/cuda/test_kernels.h"

namespace refit::cuda::testing {

/// Every bucket's payload of `views` (host tensors) back to back, in device memory.
inline device_buffer pack_on_device(const update_metadata& meta, const bucket_plan& plan,
                                    const std::vector<tensor_view>& views, std::vector<std::uint64_t>& offsets) {
  range_source<const std::vector<tensor_view>> source(views);
  send_cursor cursor(meta, plan, source);
  std::vector<std::byte> host;
  offsets.clear();
  for (const bucket& b : plan.buckets) {
    offsets.push_back(host.size());
    for (const auto& piece : cursor.gather(b)) {
      const auto* p = static_cast<const std::byte*>(piece.data());
      host.insert(host.end(), p, p + piece.size());
    }
  }
  cursor.finish();
  device_buffer d(std::max<std::size_t>(host.size(), 1));
  if (!host.empty()) REFIT_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size(), cudaMemcpyHostToDevice));
  return d;
}

class d2d_transport final : public bucket_transport {
 public:
  d2d_transport(const device_buffer& packed, std::vector<std::uint64_t> offsets, double link_bytes_per_s = 0,
                bool copy = true)
      : packed_(packed), offsets_(std::move(offsets)), link_(link_bytes_per_s), copy_(copy) {}
  asio::awaitable<void> receive(const bucket& b, std::span<const asio::mutable_buffer> dest) override {
    std::uint64_t at = offsets_.at(b.index);
    for (const auto& d : dest) {
      if (copy_ && d.size())
        REFIT_CUDA_CHECK(
            cudaMemcpyAsync(d.data(), packed_.bytes() + at, d.size(), cudaMemcpyDeviceToDevice, stream_.get()));
      at += d.size();
    }
    if (link_ > 0) spin(static_cast<std::uint64_t>(static_cast<double>(b.payload_bytes) / link_ * 1e9), stream_.get());
    co_await when_done(stream_.get());
  }

 private:
  const device_buffer& packed_;
  std::vector<std::uint64_t> offsets_;
  double link_;
  bool copy_;
  stream stream_;
};

}  // namespace refit::cuda::testing
