// Needs a GPU and a UCX with CUDA memory support at run time (the GPU check loads
// PyPI's libucx-cu13 from the bundle, tests/cuda/gpu_bundle.sh); skips itself,
// with the reason, where either is missing (Debian's UCX 1.13 has no CUDA).
// The ucx engine receiving into device memory ("device_memory": true): its
// staging and the model's own memory on cuda:0, registered with UCX as CUDA
// memory; a trainer sends host tensors; every byte read back from the device.
// Direct receive (into the model's memory) and through the device staging (then
// copied device to device by load_weights), in place and staged, and a second
// update over the first.
#include <gtest/gtest.h>

#include <cstdlib>

#include <asio/experimental/awaitable_operators.hpp>
#include <asio/io_context.hpp>

#include <refit/cuda/device.h>
#include <refit/cuda/tensor_memory.h>
#include <refit/engines/ucx/ucp.h>
#include <refit/engines/ucx/ucx.h>
#include <refit/model/tensor_map_target.h>
#include "tests/support/run.h"

namespace refit {
namespace {

const bool ucx_env = [] {
  setenv("UCX_NET_DEVICES", "lo", 0);  // UCX's tcp, if it comes to it, on loopback only
  return true;
}();

update_metadata layout() {
  update_metadata m;
  for (int i = 0; i < 6; ++i) m.tensors.push_back({"layers." + std::to_string(i) + ".w", dtype::float32, {3000 + i}});
  m.tensors.push_back({"embed", dtype::bfloat16, {300000}});  // larger than a buffer: split
  return m;
}

std::vector<std::vector<std::byte>> bytes_of(const update_metadata& m, int version) {
  std::vector<std::vector<std::byte>> out;
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    out.emplace_back(m.tensors[t].nbytes());
    for (std::size_t i = 0; i < out.back().size(); ++i)
      out.back()[i] = static_cast<std::byte>((version * 29 + t * 7 + i % 253) & 0x7f);
  }
  return out;
}

TEST(ucx_device, updates_land_in_device_memory_direct_or_through_device_staging) {
  const cuda::device_count_result devices = cuda::device_count_or_reason();
  if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
  if (!ucx::context().handles(device::cuda(0)))
    GTEST_SKIP() << "the UCX loaded (" << ucx::context::version() << ") handles " << ucx::context().memory_types()
                 << " memory only: put a UCX with CUDA support (PyPI's libucx-cu13) first on LD_LIBRARY_PATH";
  auto memory = std::make_shared<cuda::device_tensor_memory>(0);
  for (const bool direct : {true, false}) {
    for (const commit_mode commit : {commit_mode::in_place, commit_mode::staged}) {
      SCOPED_TRACE(std::string(direct ? "direct" : "staging") + " " + std::string(to_string(commit)));
      tensor_map_target_options o;
      o.memory = memory;
      o.direct_receive = direct;
      o.direct_receive_on_device = true;
      tensor_map_target target(o);
      const update_metadata meta = layout();
      for (const auto& s : meta.tensors) target.add(s);

      asio::io_context io;
      weight_transfer_config config;
      config.backend = "ucx";
      config.timeout = std::chrono::seconds(20);
      ucx::sender sender(config, trainer_context{io.get_executor(), {}});
      ucx::engine engine(config, engine_context{io.get_executor(), device::cuda(0), {}, &target});
      json args = {{"master_address", "127.0.0.1"},
                   {"master_port", 0},
                   {"world_size", 2},
                   {"buffer_bytes", 256 << 10},
                   {"num_buffers", 2}};
      json init = sender.prepare(args);
      init["device_memory"] = true;
      auto info = engine.parse_init_info(init);
      using namespace asio::experimental::awaitable_operators;
      testing::run_to_completion(io, sender.connect_workers() && engine.init_transfer_engine(*info));
      const json t = engine.transport_info();
      EXPECT_EQ(t.at("memory"), "cuda:0") << t.dump();
      std::cout << "ucx endpoint: " << t.dump() << std::endl;

      for (int version = 1; version <= 2; ++version) {
        auto data = bytes_of(meta, version);
        std::vector<tensor_view> views;
        for (std::size_t i = 0; i < meta.tensors.size(); ++i) views.emplace_back(meta.tensors[i], data[i].data());
        json j = json::object();
        write_update_metadata(meta, j);
        auto u = engine.parse_update_info(j);
        u->commit = commit;
        auto received = testing::spawn(io, testing::receive_update(engine, std::move(u), target.as_load_weights()));
        auto sent = testing::spawn(io, testing::send_views(sender, meta, views));
        ASSERT_TRUE(testing::run_until(io, [&] { return sent->done && received->done; })) << "update hung";
        ASSERT_FALSE(sent->error) << sent->message();
        ASSERT_FALSE(received->error) << received->message();
        target.finish(version);
        auto r = target.read();
        for (std::size_t i = 0; i < r.size(); ++i) {
          const tensor_view v = r[i];
          EXPECT_EQ(v.device, device::cuda(0)) << v.name;
          std::vector<std::byte> host(v.nbytes());
          memory->copy_out(host, v.data);
          EXPECT_TRUE(host == data[i]) << v.name << " is not version " << version;
        }
      }
    }
  }
}

}  // namespace
}  // namespace refit
