// host_copy_target on its own: the copy it offers, what its loads copy in, its
// refusals. (With an engine and deltas: //tests/engines/tcp:delta_test.)
#include <refit/model/host_copy_target.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include <refit/error.h>
#include <refit/integrity/fingerprint.h>

namespace refit::testing {
namespace {

update_metadata meta_of(std::vector<tensor_spec> specs) {
  update_metadata m;
  m.tensors = std::move(specs);
  return m;
}

TEST(host_copy_target, offers_a_copy_per_announced_tensor_and_keeps_it_across_updates) {
  host_copy_target copy;
  const tensor_spec w{"w", dtype::bfloat16, {4, 8}};
  EXPECT_FALSE(copy.destination(w)) << "nothing before begin_update";
  copy.begin_update(meta_of({w}));
  auto d = copy.destination(w);
  ASSERT_TRUE(d);
  EXPECT_TRUE(d->device.is_cpu());
  EXPECT_EQ(d->nbytes(), w.nbytes());
  std::memset(d->data, 7, d->nbytes());
  // The same tensor again: the same memory, its bytes kept (the base of a delta).
  copy.begin_update(meta_of({w}));
  auto again = copy.destination(w);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->data, d->data);
  EXPECT_EQ(static_cast<const std::byte*>(again->data)[5], std::byte{7});
  // Another shape under that name: other memory, and the old spec is not offered.
  const tensor_spec w2{"w", dtype::bfloat16, {8, 8}};
  EXPECT_FALSE(copy.destination(w2));
  copy.begin_update(meta_of({w2}));
  EXPECT_FALSE(copy.destination(w));
  ASSERT_TRUE(copy.destination(w2));
  EXPECT_EQ(copy.bytes(), w2.nbytes());
}

TEST(host_copy_target, loads_copy_views_from_elsewhere_and_then_call_the_models_load) {
  host_copy_target copy;
  const tensor_spec w{"w", dtype::float32, {16}};
  copy.begin_update(meta_of({w}));
  std::vector<float> staged(16, 2.5f);
  std::vector<std::string> loaded;
  auto load = copy.loading_through([&](std::span<const tensor_view> views) {
    for (const auto& v : views) loaded.emplace_back(v.name);
  });
  const tensor_view v(w, staged.data());
  load(std::span(&v, 1));
  EXPECT_EQ(loaded, std::vector<std::string>{"w"});
  const auto d = copy.destination(w);
  ASSERT_TRUE(d);
  EXPECT_EQ(std::memcmp(d->data, staged.data(), w.nbytes()), 0) << "the stage's bytes are the copy's now";
  // Fingerprints without an inner target: the copy's.
  EXPECT_EQ(copy.fingerprint({}), fingerprint_all(std::span(&v, 1)));
}

TEST(host_copy_target, refuses_loads_it_was_not_told_of_and_device_views) {
  host_copy_target copy;
  const tensor_spec w{"w", dtype::float32, {16}};
  std::vector<float> bytes(16);
  const tensor_view unknown(w, bytes.data());
  try {
    copy.load_weights(std::span(&unknown, 1));
    FAIL() << "an unannounced tensor was loaded";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::invalid_argument) << e.message();
  }
  copy.begin_update(meta_of({w}));
  const tensor_view on_gpu(w, bytes.data(), device::cuda(0));
  try {
    copy.load_weights(std::span(&on_gpu, 1));
    FAIL() << "a device view was read as host memory";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported) << e.message();
  }
}

TEST(host_copy_target, a_seeded_tensor_reads_back_before_any_update_and_stays_across_one) {
  host_copy_target copy;
  const tensor_spec w{"w", dtype::float32, {4}};
  std::vector<float> served{1, 2, 3, 4};
  EXPECT_FALSE(copy.can_read_back(w));
  copy.seed(tensor_view(w, served.data()));
  served.assign(4, 0);  // seed copied the bytes
  ASSERT_TRUE(copy.can_read_back(w));
  EXPECT_FALSE(copy.can_read_back(tensor_spec{"w", dtype::bfloat16, {4}})) << "another dtype is not held";
  EXPECT_FALSE(copy.can_read_back(tensor_spec{"w", dtype::float32, {2, 2}})) << "another shape is not held";
  // An update that announces the same tensor keeps what was seeded: the previous
  // version an undo of that update loads back.
  copy.begin_update(meta_of({w}));
  std::vector<float> back(4);
  copy.read_back(w, std::as_writable_bytes(std::span(back)));
  EXPECT_EQ(back, (std::vector<float>{1, 2, 3, 4}));
  const tensor_view on_gpu(w, served.data(), device::cuda(0));
  try {
    copy.seed(on_gpu);
    FAIL() << "a device view was read as host memory";
  } catch (const error& e) {
    EXPECT_EQ(e.kind(), errc::unsupported) << e.message();
  }
}

}  // namespace
}  // namespace refit::testing
