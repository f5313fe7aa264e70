// GPU benchmark of lib/cuda's kernels against their natural peers, measured in the
// same run: each conversion kernel against a device-to-device cudaMemcpyAsync of
// its input (bandwidth ratio), and one batched unpack of 10,000 small tensors
// against one cudaMemcpyAsync per tensor (time ratio). Prints one JSON line; without
// a GPU, a JSON line saying it skipped and why (exit status 0).
//
//   bazel run --config=cuda //tests/cuda:kernel_bench
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/event.h>
#include <refit/cuda/kernels.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/stream.h>
#include <refit/cuda/unpack.h>
#include <refit/dtype.h>

namespace refit::cuda {
namespace {

constexpr int warmup = 3;
constexpr int repeats = 15;

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

// Best-of-`repeats` GPU milliseconds of `enqueue` on `s`.
template <class Enqueue>
float best_gpu_ms(const stream& s, Enqueue enqueue) {
  event start = event::timing(), end = event::timing();
  for (int i = 0; i < warmup; ++i) enqueue();
  float best = 1e30f;
  for (int i = 0; i < repeats; ++i) {
    start.record(s);
    enqueue();
    end.record(s);
    end.synchronize();
    best = std::min(best, event::elapsed_ms(start, end));
  }
  return best;
}

// Best-of-`repeats` wall-clock microseconds from the first enqueue to completion:
// for many small operations, host-side launch cost is the point.
template <class Enqueue>
double best_wall_us(const stream& s, Enqueue enqueue) {
  for (int i = 0; i < warmup; ++i) enqueue();
  s.synchronize();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    enqueue();
    s.synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return best;
}

struct case_spec {
  dtype src;
  dtype dst;
  bool quantize;
  float scale;
};

std::string run() {
  const device_count_result devices = device_count_or_reason();
  if (!devices) return R"({"bench":"cuda_kernels","skipped":true,"reason":")" + json_escape(devices.reason) + R"("})";

  cudaDeviceProp prop{};
  int device = 0;
  REFIT_CUDA_CHECK(cudaGetDevice(&device));
  REFIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  stream s;
  std::string json = R"({"bench":"cuda_kernels","device":")" + json_escape(prop.name) + R"(")";

  // ---- conversions: 64 Mi elements
  constexpr std::size_t elements = std::size_t{64} << 20;
  device_buffer src(elements * 4), dst(elements * 4);
  REFIT_CUDA_CHECK(cudaMemsetAsync(src.data(), 0x3c, src.size(), s.get()));  // finite values
  const case_spec cases[] = {
      {dtype::float32, dtype::bfloat16, false, 1.0f},        {dtype::bfloat16, dtype::float32, false, 1.0f},
      {dtype::float32, dtype::float16, false, 1.0f},         {dtype::bfloat16, dtype::float16, false, 1.0f},
      {dtype::bfloat16, dtype::float8_e4m3fn, true, 0.37f},  {dtype::float32, dtype::float8_e5m2, true, 0.37f},
      {dtype::float8_e4m3fn, dtype::bfloat16, false, 0.37f}, {dtype::float8_e5m2, dtype::float32, false, 0.37f},
  };
  json += R"(,"convert":[)";
  double worst_ratio = 1e30;
  for (std::size_t i = 0; i < std::size(cases); ++i) {
    const case_spec& c = cases[i];
    const std::size_t in_bytes = elements * element_size(c.src);
    const std::size_t out_bytes = elements * element_size(c.dst);
    const float kernel_ms = best_gpu_ms(s, [&] {
      if (c.quantize)
        quantize_fp8(src.data(), c.src, dst.data(), c.dst, elements, c.scale, s.get());
      else
        convert(src.data(), c.src, dst.data(), c.dst, elements, s.get(), c.scale);
    });
    const float memcpy_ms = best_gpu_ms(s, [&] {
      REFIT_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), in_bytes, cudaMemcpyDeviceToDevice, s.get()));
    });
    // Bytes read plus bytes written per second.
    const double kernel_gbps = double(in_bytes + out_bytes) / (kernel_ms * 1e6);
    const double memcpy_gbps = double(2 * in_bytes) / (memcpy_ms * 1e6);
    const double ratio = kernel_gbps / memcpy_gbps;
    worst_ratio = std::min(worst_ratio, ratio);
    char line[512];
    std::snprintf(line, sizeof line,
                  R"(%s{"op":"%s","src":"%s","dst":"%s","elements":%zu,"kernel_ms":%.4f,)"
                  R"("kernel_gbps":%.1f,"memcpy_ms":%.4f,"memcpy_gbps":%.1f,"bandwidth_ratio":%.3f})",
                  i == 0 ? "" : ",", c.quantize ? "quantize_fp8" : "convert", std::string(to_string(c.src)).c_str(),
                  std::string(to_string(c.dst)).c_str(), elements, kernel_ms, kernel_gbps, memcpy_ms, memcpy_gbps,
                  ratio);
    json += line;
  }
  json += "]";

  // ---- batched unpack: 10,000 small tensors (64 B .. 16 KiB, random alignment
  // within 16 bytes, as packed in a bucket)
  constexpr int tensors = 10'000;
  std::mt19937 rng(5);
  std::vector<piece> pieces;
  std::size_t src_cursor = 0, dst_cursor = 0, total = 0;
  for (int i = 0; i < tensors; ++i) {
    const std::size_t size = 64 + rng() % (16 * 1024 - 64);
    pieces.push_back({src.bytes() + src_cursor, dst.bytes() + dst_cursor, size});
    src_cursor += (size + 15) / 16 * 16;
    dst_cursor += (size + 255) / 256 * 256;
    total += size;
  }
  unpacker u;
  const double batched_us = best_wall_us(s, [&] { u.unpack(pieces, s.get()); });
  const double per_tensor_us = best_wall_us(s, [&] {
    for (const piece& p : pieces)
      REFIT_CUDA_CHECK(cudaMemcpyAsync(p.dst, p.src, p.bytes, cudaMemcpyDeviceToDevice, s.get()));
  });
  const float batched_gpu_ms = best_gpu_ms(s, [&] { u.unpack(pieces, s.get()); });
  char line[512];
  std::snprintf(line, sizeof line,
                R"(,"unpack":{"tensors":%d,"bytes":%zu,"batched_wall_us":%.1f,)"
                R"("batched_gpu_us":%.1f,"per_tensor_memcpy_wall_us":%.1f,"time_ratio":%.2f})",
                tensors, total, batched_us, batched_gpu_ms * 1e3, per_tensor_us, per_tensor_us / batched_us);
  json += line;
  std::snprintf(line, sizeof line, R"(,"worst_convert_bandwidth_ratio":%.3f})", worst_ratio);
  json += line;
  return json;
}

}  // namespace
}  // namespace refit::cuda

int main() {
  try {
    std::printf("%s\n", refit::cuda::run().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::printf(R"({"bench":"cuda_kernels","error":"%s"})"
                "\n",
                refit::cuda::json_escape(what).c_str());
    return 1;
  }
}
