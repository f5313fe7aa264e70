// The "torch_ipc" engine on CPU: a stand-in PyTorch trainer puts its tensors in
// exported host memory (several per allocation, at storage and element offsets, as
// PyTorch's caching allocator does) and describes them as refit_ipc.py does; the
// worker reads them through the handles. Bad handles and entries are refused with
// errors naming the tensor, before any byte reaches the model.
#include <refit/engines/cuda_ipc/torch_ipc.h>

#include <gtest/gtest.h>

#include <cstring>

#include <refit/internal/hex.h>
#include <refit/session.h>
#include "tests/support/run.h"
#include "tests/support/tensors.h"

namespace refit::testing {
namespace {

using cuda_ipc::gpu_uuid;
using cuda_ipc::handle_bytes;

const char* host_gpu = "GPU-00000000-0000-0000-0000-000000000000";

std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

// A PyTorch trainer stand-in: its tensors live in `allocations` exported host
// buffers, placed one after another (with a gap, like the caching allocator's
// rounding) and each given a storage that starts `storage_pad` bytes into its slot
// and an element offset of one element.
struct fake_trainer {
  static constexpr std::uint64_t allocation_bytes = 1 << 20;
  std::shared_ptr<cuda_ipc::ipc_provider> ipc = cuda_ipc::host_ipc();
  std::unique_ptr<staging_memory> memory;
  std::vector<json> entries;

  fake_trainer(const tensor_set& set, std::size_t allocations = 2) {
    memory = ipc->make_exportable(allocations, allocation_bytes);
    std::vector<std::uint64_t> used(allocations, 0);
    for (std::size_t i = 0; i < set.meta.tensors.size(); ++i) {
      const auto& spec = set.meta.tensors[i];
      const std::size_t a = i % allocations;
      const std::uint64_t element = element_size(spec.dtype);
      const std::uint64_t storage_offset = used[a] + 512;
      const std::uint64_t storage_bytes = spec.nbytes() + element;  // one element before the tensor
      if (storage_offset + storage_bytes > allocation_bytes) throw std::runtime_error("fake trainer: out of memory");
      if (spec.nbytes() != 0)
        std::memcpy(memory->slot(a).data() + storage_offset + element, set.data[i].data(), spec.nbytes());
      used[a] = storage_offset + storage_bytes;
      auto [handle, gpu] = ipc->export_buffer(*memory, a);
      entries.push_back(json{{host_gpu,
                              {{"handle", to_hex(handle)},
                               {"storage_offset_bytes", storage_offset},
                               {"storage_bytes", storage_bytes},
                               {"offset", 1},
                               {"size", spec.shape},
                               {"stride", contiguous_strides(spec.shape)}}}});
    }
  }

  json update_info(const update_metadata& meta) const {
    json j;
    write_update_metadata(meta, j);
    j["ipc_handles"] = entries;
    return j;
  }
};

struct worker {
  asio::io_context io;
  std::unique_ptr<cuda_ipc::torch_engine> engine;

  explicit worker(model_target* model = nullptr, json init = {{"buffer_bytes", 16 << 10}, {"num_buffers", 2}}) {
    weight_transfer_config config;
    config.backend = "torch_ipc";
    engine_context context{io.get_executor(), device::cpu(), {}, model, {}};
    engine = std::make_unique<cuda_ipc::torch_engine>(config, context, cuda_ipc::host_ipc());
    auto info = engine->parse_init_info(init);
    run_to_completion(io, engine->init_transfer_engine(*info));
  }
  ~worker() {
    if (engine) engine->shutdown();
  }

  std::unique_ptr<update_info> parse(const json& j) { return engine->parse_update_info(j); }

  // One update session: start, update, drain, finish. Returns the mappings open
  // before finish.
  std::size_t update(const json& info_json, load_weights_fn load) {
    auto info = parse(info_json);
    weight_update_session session(*engine);
    std::size_t open = 0;
    run_to_completion(io, [&]() -> asio::awaitable<void> {
      session.start_weight_update();
      co_await session.update_weights(*info, load);
      co_await engine->drain_pending();
      open = engine->handles().size();
      co_await session.finish_weight_update(1);
    }());
    return open;
  }
};

tensor_set model_set() {
  tensor_set set;
  set.add("embed", dtype::bfloat16, {300, 20});
  set.add("layer.0.q", dtype::float32, {64, 16});
  set.add("layer.0.bias", dtype::float16, {7});
  set.add("big", dtype::float32, {12000});  // 48000 bytes: split over 16 KiB buffers
  set.add("scalar", dtype::float32, {});
  set.add("empty", dtype::int8, {0, 5});
  for (int i = 0; i < 40; ++i) set.add("small." + std::to_string(i), dtype::bfloat16, {3 + i});
  return set;
}

TEST(torch_ipc_host, tensors_arrive_from_pytorch_style_handles) {
  tensor_set set = model_set();
  fake_trainer trainer(set);
  worker w;
  capture got;
  const std::size_t open = w.update(trainer.update_info(set.meta), got.fn());
  EXPECT_NO_THROW(got.check_equals(set));
  EXPECT_EQ(open, 2u) << "one mapping per allocation, however many tensors share it";
  EXPECT_EQ(w.engine->handles().opens(), 2u);
  EXPECT_EQ(w.engine->last_update_stats().tensors, set.meta.tensors.size());
}

// The trainer's storages live across updates: their mappings are kept, so later
// updates open nothing. Memory the trainer stops offering (freed, reallocated:
// new handles) is unmapped at the end of the first session that did not use it.
TEST(torch_ipc_host, mappings_are_kept_while_the_trainer_offers_them) {
  tensor_set set = model_set();
  fake_trainer trainer(set);
  worker w;
  for (int round = 0; round < 3; ++round) {
    // New values in the same allocations, as an optimizer step writes them.
    set.data[1].assign(set.data[1].size(), static_cast<std::byte>(0x50 + round));
    std::memcpy(trainer.memory->slot(1).data() + 512 + 4, set.data[1].data(), set.data[1].size());
    capture got;
    w.update(trainer.update_info(set.meta), got.fn());
    EXPECT_NO_THROW(got.check_equals(set)) << "round " << round;
    EXPECT_EQ(w.engine->handles().opens(), 2u) << "round " << round << ": no reopening";
    EXPECT_EQ(w.engine->handles().size(), 2u) << "kept after finish_weight_update";
  }
  // A restarted trainer: other allocations, other handles.
  fake_trainer trainer2(set);
  capture got;
  w.update(trainer2.update_info(set.meta), got.fn());
  EXPECT_NO_THROW(got.check_equals(set));
  EXPECT_EQ(w.engine->handles().opens(), 4u);
  EXPECT_EQ(w.engine->handles().size(), 2u) << "the first trainer's mappings were closed at finish";
  // Re-init closes everything.
  run_to_completion(w.io, w.engine->init_transfer_engine(
                              *w.engine->parse_init_info(json{{"buffer_bytes", 16 << 10}, {"num_buffers", 2}})));
  EXPECT_EQ(w.engine->handles().size(), 0u);
}

// PyTorch gives an empty tensor's storage no handle (refit_ipc.py sends zeros):
// nothing is opened for it, and the update goes through.
TEST(torch_ipc_host, empty_tensors_need_no_handle) {
  tensor_set set;
  set.add("a", dtype::float32, {10});
  set.add("empty", dtype::bfloat16, {0, 4});
  set.add("b", dtype::int8, {3});
  fake_trainer trainer(set);
  json info = trainer.update_info(set.meta);
  info["ipc_handles"][1][host_gpu]["handle"] = std::string(128, '0');
  info["ipc_handles"][1][host_gpu]["storage_bytes"] = 0;
  info["ipc_handles"][1][host_gpu]["offset"] = 0;
  worker w;
  capture got;
  w.update(info, got.fn());
  EXPECT_NO_THROW(got.check_equals(set));
  EXPECT_EQ(w.engine->handles().opens(), 1u) << "'a' and 'b' share allocation 0; nothing is opened for 'empty'";
}

// A model that offers its own memory for every tensor: bytes go straight there.
class direct_model final : public model_target {
 public:
  explicit direct_model(const tensor_set& set) {
    for (const auto& t : set.meta.tensors) memory_[t.name].resize(t.nbytes());
  }
  void load_weights(std::span<const tensor_view> views) override {
    for (const auto& v : views)  // (a zero-byte tensor has no memory to offer)
      if (v.nbytes() != 0 && v.data != memory_.at(std::string(v.name)).data()) ++staged_;
  }
  std::optional<tensor_view> destination(const tensor_spec& spec) override {
    return tensor_view(spec, memory_.at(spec.name).data());
  }
  std::map<std::string, std::vector<std::byte>> memory_;
  int staged_ = 0;
};

// torch 2.x wraps the cudaIpcMemHandle_t in the caching allocator's shareable
// handle (a version byte, 'c', the 64 bytes): the same memory, whatever the version.
TEST(torch_ipc_host, torch_2_shareable_handles_are_unwrapped) {
  tensor_set set = model_set();
  fake_trainer trainer(set);
  json info = trainer.update_info(set.meta);
  int version = 1;
  for (auto& by_gpu : info["ipc_handles"]) {
    auto& e = by_gpu[host_gpu];
    char prefix[5];
    std::snprintf(prefix, sizeof prefix, "%02x63", version);  // 'c'
    e["handle"] = std::string(prefix) + e["handle"].get<std::string>();
    version = version % 3 + 1;
  }
  worker w;
  capture got;
  const std::size_t open = w.update(info, got.fn());
  EXPECT_NO_THROW(got.check_equals(set));
  EXPECT_EQ(open, 2u) << "the same two allocations as the raw handles name";
}

TEST(torch_ipc_host, receives_straight_into_the_models_memory) {
  tensor_set set = model_set();
  fake_trainer trainer(set);
  direct_model model(set);
  worker w(&model);
  w.update(trainer.update_info(set.meta), model.as_load_weights());
  EXPECT_EQ(model.staged_, 0) << "every tensor had a destination";
  for (std::size_t i = 0; i < set.meta.tensors.size(); ++i)
    EXPECT_EQ(model.memory_[set.meta.tensors[i].name], set.data[i]) << set.meta.tensors[i].name;
}

// Reads `info` and expects invalid_argument whose message contains every `part`.
void expect_refused(worker& w, const json& info, std::initializer_list<std::string> parts) {
  try {
    w.parse(info);
    ADD_FAILURE() << "accepted: " << info.dump().substr(0, 300);
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument) << e.message();
    for (const auto& p : parts) EXPECT_NE(e.message().find(p), std::string::npos) << e.message();
  }
}

TEST(torch_ipc_host, malformed_entries_are_refused_naming_the_tensor) {
  tensor_set set;
  set.add("a", dtype::float32, {4, 8});
  set.add("b", dtype::bfloat16, {16});
  fake_trainer trainer(set);
  worker w;
  const json good = trainer.update_info(set.meta);
  auto entry = [&](json info, auto edit) {
    edit(info["ipc_handles"][1][host_gpu]);
    return info;
  };
  expect_refused(w, entry(good, [](json& e) { e["handle"] = "zz"; }), {"'b'", "hex digits"});
  expect_refused(w, entry(good, [](json& e) { e["handle"] = std::string(130, 'a'); }),
                 {"'b'", "65 bytes", "cudaIpcMemHandle_t"});
  // torch 2.x's shareable handle of an expandable segment: version, 'e', payload.
  expect_refused(w, entry(good, [](json& e) { e["handle"] = "0265" + std::string(40, '0'); }),
                 {"'b'", "expandable_segments"});
  // version, 'c', but a truncated cudaIpcMemHandle_t.
  expect_refused(w, entry(good, [](json& e) { e["handle"] = "0263" + std::string(100, '0'); }), {"'b'", "52 bytes"});
  expect_refused(w, entry(good, [](json& e) { e["size"] = {15}; }), {"'b'", "[15]", "declared shape is [16]"});
  expect_refused(w, entry(good, [](json& e) { e["stride"] = {1, 1}; }), {"'b'", "dimensions"});
  expect_refused(w, entry(good, [](json& e) { e["storage_bytes"] = 32; }),
                 {"'b'", "32 bytes at element offset 1", "do not fit"});
  expect_refused(w, entry(good, [](json& e) { e["offset"] = -1; }), {"offset", "negative"});
  expect_refused(w, entry(good, [](json& e) { e.erase("storage_offset_bytes"); }), {"storage_offset_bytes", "missing"});
  expect_refused(w, entry(good, [](json& e) { e["event_handle"] = "x"; }), {"event_handle"});
  {
    json info = good;
    info["ipc_handles"][0][host_gpu]["stride"] = {1, 4};  // a transposed view
    expect_refused(w, info, {"'a'", "not contiguous", "t.contiguous()"});
  }
  {
    json info = good;
    info["ipc_handles"].erase(1);
    expect_refused(w, info, {"1 entries for 2 tensors"});
  }
  {
    json info = good;
    info["ipc_handles"][0] = json{{"not-a-uuid", info["ipc_handles"][0][host_gpu]}};
    expect_refused(w, info, {"'a'", "not a GPU UUID"});
  }
  {
    json info = good;
    info["ipc_handles"][0] = json::object();
    expect_refused(w, info, {"'a'", "non-empty object"});
  }
  {
    json info = good;
    info.erase("ipc_handles");
    expect_refused(w, info, {"ipc_handles"});
  }
}

TEST(torch_ipc_host, stale_handles_fail_the_update_before_any_byte_moves) {
  tensor_set set;
  set.add("a", dtype::float32, {100});
  set.add("b", dtype::float32, {100});
  fake_trainer trainer(set);
  json info = trainer.update_info(set.meta);
  std::string h = info["ipc_handles"][1][host_gpu]["handle"];
  h[40] = h[40] == '0' ? '1' : '0';  // an id no allocation has
  info["ipc_handles"][1][host_gpu]["handle"] = h;
  worker w;
  capture got;
  try {
    w.update(info, got.fn());
    ADD_FAILURE() << "a stale handle was accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_NE(e.message().find("tensor 'b'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("stale"), std::string::npos) << e.message();
  }
  EXPECT_EQ(got.calls(), 0u) << "load_weights saw nothing";
  EXPECT_FALSE(w.engine->weights_dirty()) << "nothing was written";

  // The worker goes on: a good update works.
  capture again;
  w.update(trainer.update_info(set.meta), again.fn());
  EXPECT_NO_THROW(again.check_equals(set));
}

TEST(torch_ipc_host, picks_this_workers_gpu_among_several) {
  tensor_spec spec{"w", dtype::float32, {2}};
  cuda_ipc::torch_tensor_handle a, b;
  a.gpu[0] = std::byte{1};
  b.gpu[0] = std::byte{2};
  std::vector<cuda_ipc::torch_tensor_handle> offered{a, b};
  EXPECT_EQ(&cuda_ipc::pick_handle(offered, b.gpu, spec), &offered[1]);
  std::vector<cuda_ipc::torch_tensor_handle> one{a};
  EXPECT_EQ(&cuda_ipc::pick_handle(one, b.gpu, spec), &one[0]) << "a lone entry is opened on the GPU it names";
  gpu_uuid other{};
  other[0] = std::byte{3};
  try {
    cuda_ipc::pick_handle(offered, other, spec);
    ADD_FAILURE();
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument);
    EXPECT_NE(e.message().find("'w'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("GPU-03000000"), std::string::npos) << e.message();
  }
}

TEST(torch_ipc_host, gpu_uuids_in_nvidia_smi_and_pytorch_spellings) {
  gpu_uuid u{};
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = static_cast<std::byte>(0x10 * i + 0x0f - i);
  const std::string text = cuda_ipc::format_gpu_uuid(u);
  EXPECT_EQ(text, "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0");
  EXPECT_EQ(cuda_ipc::parse_gpu_uuid(text, "t"), u);
  EXPECT_EQ(cuda_ipc::parse_gpu_uuid("0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0", "t"), u) << "PyTorch's, no prefix";
  EXPECT_THROW(cuda_ipc::parse_gpu_uuid("GPU-0f1e", "t"), error);
  EXPECT_THROW(cuda_ipc::parse_gpu_uuid("", "t"), error);
}

TEST(torch_ipc_host, init_info_takes_the_pipeline_shape_only) {
  worker w;
  EXPECT_NO_THROW(w.engine->parse_init_info(json::object()));
  EXPECT_THROW(w.engine->parse_init_info(json{{"checksums", true}}), error);
  EXPECT_THROW(w.engine->parse_init_info(json{{"master_address", "x"}}), error);
  EXPECT_THROW(w.engine->parse_init_info(json{{"buffer_bytes", 1}}), error);
}

}  // namespace
}  // namespace refit::testing
