// GPU benchmark of the mission's claim through a real engine: with refit's
// cuda_ipc engine (trainer and worker processes on one GPU, tests/cuda/engine_pair.h),
// receiving bucket k+1 overlaps the post-processing of bucket k, a real conversion
// kernel (bfloat16 sent, float32 kept: lib/cuda's convert on the processing stream).
// Measured in the same run, each figure the median of --reps updates after one
// warm-up, with its spread:
//
//   receive   updates whose load_weights does nothing (the hand-over alone)
//   process   the worker's conversion of the same bytes, bucket by bucket, alone
//   total     updates with the conversion as post-processing
//   overlap = total / max(receive, process)       (target <= 1.15; 2.0 = serial)
//
// Every update is checked on a sample of tensors through the worker's digest.
// Prints one JSON line; without a GPU a line with "skipped" and the reason (exit 0).
// It is a mode of the engine_gpu_test binary (one binary fewer in the GPU
// check's bundle, which must stay under 40 MiB):
//
//   engine_gpu_test --bench [--gib 2] [--tensors 64] [--buffer-mib 64] [--buffers 3] [--reps 5]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/error.h>
#include "examples/torch_ipc/digest.h"
#include "tests/cuda/cuda_ipc_bench.h"
#include "tests/cuda/engine_pair.h"
#include "tests/support/convert.h"
#include "tests/support/run.h"

namespace refit::cuda::testing {
namespace {

struct options {
  double gib = 2;
  int tensors = 64;
  std::uint64_t buffer_mib = 64;
  int buffers = 3;
  int reps = 5;
};

struct figure {
  double median = 0, min = 0, max = 0;
};
figure summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}
std::string to_json(const figure& f) {
  char buf[160];
  std::snprintf(buf, sizeof buf, R"({"median_s":%.5f,"min_s":%.5f,"max_s":%.5f})", f.median, f.min, f.max);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

struct model {
  update_metadata meta;
  std::vector<device_buffer> device;
  std::vector<std::vector<std::byte>> host;  // a few sampled tensors only
};

model make_model(const options& o) {
  model m;
  const std::int64_t elems = static_cast<std::int64_t>(o.gib * (1ull << 30) / 2 / o.tensors);
  for (int i = 0; i < o.tensors; ++i) {
    m.meta.tensors.push_back({"layers." + std::to_string(i) + ".w", dtype::bfloat16, {elems}});
    m.device.emplace_back(static_cast<std::size_t>(elems * 2), 0);
    REFIT_CUDA_CHECK(cudaMemset(m.device.back().data(), 0x3c + i % 3, static_cast<std::size_t>(elems * 2)));
  }
  return m;
}

std::vector<tensor_view> views_of(const model& m) {
  std::vector<tensor_view> v;
  for (std::size_t i = 0; i < m.device.size(); ++i)
    v.emplace_back(m.meta.tensors[i], m.device[i].data(), device::cuda(0));
  return v;
}

// The expected digest of tensor i as the worker holds it (float32 when converted).
json expected_digest(const model& m, std::size_t i, bool converted) {
  const auto& spec = m.meta.tensors[i];
  std::vector<std::byte> bytes(spec.nbytes());
  REFIT_CUDA_CHECK(cudaMemcpy(bytes.data(), m.device[i].data(), bytes.size(), cudaMemcpyDeviceToHost));
  if (converted) {
    tensor_spec f32 = spec;
    f32.dtype = dtype::float32;
    std::vector<std::byte> out(f32.nbytes());
    convert::convert_tensor(tensor_view(spec, bytes.data()), tensor_view(f32, out.data()));
    bytes = std::move(out);
  }
  auto [sum, weighted] = example::byte_digest(bytes);
  return json::array({sum, weighted});
}

asio::awaitable<void> run_all(engine_pair& pair, const options& o, model& m, std::string* out) {
  json wire = {{"buffer_bytes", o.buffer_mib << 20}, {"num_buffers", o.buffers}};
  co_await pair.connect(wire);
  const auto views = views_of(m);
  const std::vector<std::size_t> sample = {0, m.meta.tensors.size() / 2, m.meta.tensors.size() - 1};
  int version = 0;
  auto series = [&](bool convert) -> asio::awaitable<figure> {
    json as = {{"dtype", convert ? "float32" : "discard"}};
    co_await pair.call("set_store_as", as);
    std::vector<double> times;
    for (int r = 0; r <= o.reps; ++r) {
      const double s = co_await pair.update(m.meta, views, ++version);
      if (r) times.push_back(s);  // the first allocates the model's memory: warm-up
    }
    if (convert) {  // what the worker holds is the trainer's bfloat16, converted (discard keeps nothing)
      std::vector<std::string> names;
      for (auto i : sample) names.push_back(m.meta.tensors[i].name);
      const json params = {{"names", names}};
      json got = co_await pair.call("digest", params);
      for (auto i : sample)
        if (got[m.meta.tensors[i].name] != expected_digest(m, i, convert))
          throw_error(errc::integrity_error, "tensor '" + m.meta.tensors[i].name + "' arrived wrong");
    }
    co_return summarize(times);
  };
  const figure receive = co_await series(false);
  const figure total = co_await series(true);
  std::vector<double> process_times;
  const std::uint64_t bytes = m.meta.total_bytes();
  for (int r = 0; r < o.reps; ++r) {
    const json params = {{"bytes", bytes}, {"bucket_bytes", o.buffer_mib << 20}};
    json p = co_await pair.call("process_only", params);
    process_times.push_back(p["seconds"].get<double>());
  }
  const figure process = summarize(process_times);
  const double overlap = total.median / std::max(receive.median, process.median);
  char head[512];
  std::snprintf(head, sizeof head,
                R"({"bench":"cuda_ipc_overlap","gpu":"%s","bytes":%llu,"tensors":%d,"buffer_bytes":%llu,)"
                R"("buffers":%d,"reps":%d,)",
                escape([] {
                  cudaDeviceProp p{};
                  return cudaGetDeviceProperties(&p, 0) == cudaSuccess ? std::string(p.name) : std::string("?");
                }())
                    .c_str(),
                static_cast<unsigned long long>(bytes), o.tensors, static_cast<unsigned long long>(o.buffer_mib << 20),
                o.buffers, o.reps);
  char tail[256];
  std::snprintf(tail, sizeof tail, R"("overlap":%.3f,"target":"<= 1.15","receive_gbps":%.1f,"verified":true})", overlap,
                bytes / receive.median / 1e9);
  *out = std::string(head) + "\"receive\":" + to_json(receive) + ",\"process\":" + to_json(process) +
         ",\"total\":" + to_json(total) + "," + tail;
}

int bench(const options& o) {
  auto devices = device_count_or_reason();
  if (!devices) {
    std::printf("{\"bench\":\"cuda_ipc_overlap\",\"skipped\":true,\"reason\":\"%s\"}\n",
                escape(devices.reason).c_str());
    return 0;
  }
  REFIT_CUDA_CHECK(cudaSetDevice(0));
  model m = make_model(o);
  asio::io_context io;
  engine_pair pair(io, "cuda_ipc", 0, 0, std::chrono::seconds(120));
  std::string line;
  refit::testing::run_to_completion(io, run_all(pair, o, m, &line), std::chrono::seconds(300));
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace
}  // namespace refit::cuda::testing

int refit::cuda::testing::cuda_ipc_bench_main(int argc, char** argv) {
  refit::cuda::testing::options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--gib")
      o.gib = std::stod(v);
    else if (a == "--tensors")
      o.tensors = std::stoi(v);
    else if (a == "--buffer-mib")
      o.buffer_mib = std::stoull(v);
    else if (a == "--buffers")
      o.buffers = std::stoi(v);
    else if (a == "--reps")
      o.reps = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  try {
    return refit::cuda::testing::bench(o);
  } catch (const std::exception& e) {
    std::printf("{\"bench\":\"cuda_ipc_overlap\",\"error\":\"%s\"}\n", refit::cuda::testing::escape(e.what()).c_str());
    return 1;
  }
}
