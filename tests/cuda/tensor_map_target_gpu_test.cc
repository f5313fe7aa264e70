// tensor_map_target on device memory (cuda::device_tensor_memory, cuda:0): zeroed
// device allocations, views on the device, updates through the loopback engine
// received into its host staging and copied to the device by load_weights (both
// reader modes, both commit modes), device -> device loads, fingerprints equal to
// the trainer's, views on another device refused. Needs a GPU; skips itself, with
// the reason, where there is none (only the no-device failure runs there).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <asio/io_context.hpp>

#include <refit/cuda/device.h>
#include <refit/cuda/error.h>
#include <refit/cuda/memory.h>
#include <refit/cuda/tensor_memory.h>
#include <refit/engines/loopback/loopback.h>
#include <refit/error.h>
#include <refit/integrity/fingerprint.h>
#include <refit/model/tensor_map_target.h>
#include "tests/support/run.h"

namespace refit {
namespace {

using ::testing::HasSubstr;
using testing::spawn;

const reader_mode modes[] = {reader_mode::reader_lock, reader_mode::double_buffered};

// A split tensor (larger than a 16 KiB bucket), a small one, an odd-sized one.
update_metadata model_layout() {
  update_metadata m;
  m.tensors.push_back({"layers.0.w", dtype::float32, {64, 128}});
  m.tensors.push_back({"layers.0.b", dtype::bfloat16, {100}});
  m.tensors.push_back({"embed", dtype::int32, {7, 3}});
  return m;
}

std::byte fill(std::int64_t v, std::size_t t, std::size_t i) {
  return static_cast<std::byte>((v * 13 + static_cast<std::int64_t>(t) * 101 + static_cast<std::int64_t>(i % 251)) &
                                0xff);
}

std::vector<std::byte> bytes_of(const tensor_spec& spec, std::int64_t v, std::size_t t) {
  std::vector<std::byte> out(spec.nbytes());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = fill(v, t, i);
  return out;
}

// The trainer's copy of the model at a version (host memory).
struct trainer_copy {
  update_metadata meta = model_layout();
  std::vector<std::vector<std::byte>> data;
  void set_version(std::int64_t v) {
    data.clear();
    for (std::size_t t = 0; t < meta.tensors.size(); ++t) data.push_back(bytes_of(meta.tensors[t], v, t));
  }
  std::vector<tensor_view> views() {
    std::vector<tensor_view> out;
    for (std::size_t i = 0; i < meta.tensors.size(); ++i) out.emplace_back(meta.tensors[i], data[i].data());
    return out;
  }
};

// A loopback trainer and worker on one io_context; the worker receives on the host.
struct loopback_pair {
  asio::io_context io;
  std::unique_ptr<loopback::sender> sender;
  std::unique_ptr<loopback::engine> engine;

  explicit loopback_pair(model_target* model) {
    static std::atomic<int> counter{0};
    weight_transfer_config config;
    config.backend = "loopback";
    config.timeout = std::chrono::seconds(20);
    engine_context ectx;
    ectx.executor = io.get_executor();
    ectx.model = model;
    trainer_context tctx;
    tctx.executor = io.get_executor();
    sender = std::make_unique<loopback::sender>(config, tctx);
    engine = std::make_unique<loopback::engine>(config, ectx);
    json args = {{"channel", "tensor-map-target-gpu-test-" + std::to_string(counter++)},
                 {"buffer_bytes", 16 << 10},
                 {"num_buffers", 2}};
    testing::run_to_completion(io, sender->init(args));
    auto info = engine->parse_init_info(args);
    testing::run_to_completion(io, engine->init_transfer_engine(*info));
  }

  void update(trainer_copy& copy, load_weights_fn load, commit_mode commit) {
    json j = json::object();
    write_update_metadata(copy.meta, j);
    std::unique_ptr<update_info> info = engine->parse_update_info(j);
    info->commit = commit;
    auto received = spawn(io, testing::receive_update(*engine, std::move(info), std::move(load)));
    auto sent = spawn(io, testing::send_views(*sender, copy.meta, copy.views()));
    ASSERT_TRUE(testing::run_until(io, [&] { return sent->done && received->done; })) << "update hung";
    ASSERT_FALSE(sent->error) << sent->message();
    ASSERT_FALSE(received->error) << received->message();
  }
};

class TensorMapTargetGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const cuda::device_count_result devices = cuda::device_count_or_reason();
    if (!devices) GTEST_SKIP() << "no CUDA device: " << devices.reason;
    memory_ = std::make_shared<cuda::device_tensor_memory>(0);
  }

  std::unique_ptr<tensor_map_target> make_target(reader_mode mode, std::int64_t version) {
    tensor_map_target_options o;
    o.mode = mode;
    o.initial_version = version;
    o.memory = memory_;
    auto target = std::make_unique<tensor_map_target>(o);
    const auto layout = model_layout();
    for (std::size_t t = 0; t < layout.tensors.size(); ++t) {
      auto host = bytes_of(layout.tensors[t], version, t);
      auto at = target->add(layout.tensors[t]);
      memory_->copy_in(at.data(), tensor_view(layout.tensors[t], host.data()));
    }
    return target;
  }

  // Every tensor read back from the device equals version `v`'s bytes.
  void expect_version(tensor_map_target& target, std::int64_t v) {
    auto r = target.read();
    ASSERT_EQ(r.version(), v);
    const auto layout = model_layout();
    for (std::size_t t = 0; t < r.size(); ++t) {
      const tensor_view view = r[t];
      EXPECT_EQ(view.device, device::cuda(0)) << view.name;
      std::vector<std::byte> host(view.nbytes());
      memory_->copy_out(host, view.data);
      EXPECT_TRUE(host == bytes_of(layout.tensors[t], v, t)) << view.name << " is not version " << v;
    }
  }

  std::shared_ptr<cuda::device_tensor_memory> memory_;
};

TEST_F(TensorMapTargetGpu, AllocatesZeroedDeviceMemoryAndViewsCarryTheDevice) {
  tensor_map_target_options o;
  o.memory = memory_;
  tensor_map_target target(o);
  const auto layout = model_layout();
  for (const auto& s : layout.tensors) target.add(s);
  auto r = target.read();
  for (auto v : r) {
    EXPECT_EQ(v.device, device::cuda(0)) << v.name;
    cudaPointerAttributes attributes{};
    REFIT_CUDA_CHECK(cudaPointerGetAttributes(&attributes, v.data));
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice) << v.name;
    EXPECT_EQ(attributes.device, 0) << v.name;
    std::vector<std::byte> host(v.nbytes(), std::byte{0x55});
    memory_->copy_out(host, v.data);
    EXPECT_TRUE(host == std::vector<std::byte>(v.nbytes())) << v.name << " starts zeroed";
  }
  EXPECT_FALSE(target.destination(layout.tensors[0])) << "no direct receive into device memory by default";
}

TEST_F(TensorMapTargetGpu, LoopbackUpdatesAreStagedOnTheHostAndCopiedToTheDevice) {
  for (reader_mode mode : modes) {
    for (commit_mode commit : {commit_mode::in_place, commit_mode::staged}) {
      SCOPED_TRACE(std::string(to_string(mode)) + " " + std::string(to_string(commit)));
      auto target = make_target(mode, 0);
      expect_version(*target, 0);
      loopback_pair pair(target.get());
      trainer_copy copy;
      copy.set_version(5);
      pair.update(copy, target->as_load_weights(), commit);
      target->finish(5);
      expect_version(*target, 5);
      EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views())) << "the trainer's fingerprints";

      copy.set_version(6);
      pair.update(copy, target->as_load_weights(), commit);
      target->finish(6);
      expect_version(*target, 6);
      EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views()));
    }
  }
}

TEST_F(TensorMapTargetGpu, LoadsViewsAlreadyOnTheDevice) {
  for (reader_mode mode : modes) {
    SCOPED_TRACE(std::string(to_string(mode)));
    auto target = make_target(mode, 0);
    trainer_copy copy;
    copy.set_version(9);
    std::vector<cuda::device_buffer> on_device;
    std::vector<tensor_view> views;
    for (std::size_t t = 0; t < copy.meta.tensors.size(); ++t) {
      on_device.emplace_back(copy.data[t].size(), 0);
      REFIT_CUDA_CHECK(
          cudaMemcpy(on_device.back().data(), copy.data[t].data(), copy.data[t].size(), cudaMemcpyHostToDevice));
      views.emplace_back(copy.meta.tensors[t], on_device.back().data(), device::cuda(0));
    }
    target->load_weights(views);
    target->finish(9);
    expect_version(*target, 9);
    EXPECT_EQ(target->fingerprint({}), fingerprint_all(copy.views()));
  }
}

TEST_F(TensorMapTargetGpu, RefusesViewsOnAnotherDevice) {
  auto target = make_target(reader_mode::reader_lock, 2);
  trainer_copy copy;
  copy.set_version(3);
  auto views = copy.views();
  views[2].device = device::cuda(1);
  try {
    target->load_weights(views);
    ADD_FAILURE() << "a view on cuda:1 must be refused";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported);
    EXPECT_THAT(e.message(), HasSubstr("tensor 'embed' on cuda:1"));
    EXPECT_THAT(e.message(), HasSubstr("this target's tensors are on cuda:0"));
  }
  EXPECT_FALSE(target->writing());
  expect_version(*target, 2);
}

// Without a usable device the memory cannot be made: a cuda_error, not a crash.
TEST(TensorMapTargetNoGpu, DeviceMemoryWithoutADeviceThrowsCudaError) {
  const cuda::device_count_result devices = cuda::device_count_or_reason();
  if (devices) GTEST_SKIP() << "a CUDA device is present (" << devices.count << "): the GPU tests cover it";
  EXPECT_THROW(cuda::device_tensor_memory(0), cuda::cuda_error);
}

}  // namespace
}  // namespace refit
