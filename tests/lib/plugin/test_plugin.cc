// A backend built as a real shared library, loaded by factory_test through
// engine_factory::register_lazy. Its engine loads one fixed tensor per update; its
// sender checks what it is given against the declaration and counts it. Further
// entry points misbehave on purpose (constructors that throw, a plugin that
// refuses to load, one built for another ABI) so the host's side of the boundary
// can be tested.
#include <array>
#include <stdexcept>
#include <string>

#include <refit/backend/engine.h>
#include <refit/backend/plugin.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>

namespace refit_test_plugin {

using namespace refit;

struct plugin_init_info final : refit::init_info {
  double scale = 1;
  static plugin_init_info read(json_reader& r) {
    plugin_init_info info;
    info.scale = r.optional<double>("scale", 1.0);
    return info;
  }
};

struct plugin_update_info final : refit::update_info {
  static plugin_update_info read(json_reader& r) {
    plugin_update_info info;
    info.metadata = read_update_metadata(r);
    return info;
  }
};

// Worker side: "receives" the fixed tensor plugin.weight = [1, 2, 3, 4] * scale.
class engine final : public backend::typed_engine<plugin_init_info, plugin_update_info> {
 public:
  engine(const weight_transfer_config& config, const engine_context& context)
      : typed_engine(config, context, capabilities_of()) {}
  static engine_capabilities capabilities_of() { return {.staged_commit = true}; }
  std::string_view backend() const noexcept override { return "test_plugin"; }

 protected:
  asio::awaitable<void> init(const plugin_init_info& info) override {
    scale_ = static_cast<float>(info.scale);
    co_return;
  }
  asio::awaitable<void> receive(const plugin_update_info&, load_weights_fn load_weights) override {
    static constexpr std::array<std::int64_t, 1> shape{4};
    std::array<float, 4> values{1 * scale_, 2 * scale_, 3 * scale_, 4 * scale_};
    tensor_view view("plugin.weight", dtype::float32, shape, values.data());
    load_weights(std::span<const tensor_view>(&view, 1));
    mutable_stats().tensors = 1;
    mutable_stats().bytes = sizeof values;
    co_return;
  }
  void do_shutdown() override {}

 private:
  float scale_ = 1;
};

// Trainer side: checks each tensor against the declaration and counts.
class sender final : public weight_sender {
 public:
  sender(const weight_transfer_config&, const trainer_context&) {}
  std::string_view backend() const noexcept override { return "test_plugin"; }
  json prepare(const json& trainer_args) override {
    json_reader r(trainer_args, "test_plugin trainer_args");
    const double scale = r.optional<double>("scale", 1.0);
    r.finish();
    return {{"scale", scale}};
  }
  asio::awaitable<void> connect_workers() override { co_return; }
  asio::awaitable<void> send_weights(const update_metadata& declared, tensor_source& source) override {
    stats_ = {};
    std::size_t i = 0;
    while (auto v = source.next()) {
      if (i >= declared.tensors.size()) throw_error(errc::invalid_argument, "test_plugin: more tensors than declared");
      check_matches_declared(declared.tensors[i], *v, i);
      stats_.bytes += v->nbytes();
      ++i;
    }
    stats_.tensors = i;
    co_return;
  }
  void shutdown() override {}
  update_stats last_send_stats() const override { return stats_; }

 private:
  update_stats stats_;
};

// Constructors that fail: a refit::error must cross as its kind and message, any
// other exception as load_failed with its what().
class throwing_engine final : public backend::typed_engine<plugin_init_info, plugin_update_info> {
 public:
  throwing_engine(const weight_transfer_config& config, const engine_context& context)
      : typed_engine(config, context, capabilities_of()) {
    throw_error(errc::unsupported,
                "test_plugin: this engine needs " + std::to_string(config.processing_threads + 100) + " widgets");
  }
  static engine_capabilities capabilities_of() { return {}; }
  std::string_view backend() const noexcept override { return "test_plugin_throwing"; }

 protected:
  asio::awaitable<void> init(const plugin_init_info&) override { co_return; }
  asio::awaitable<void> receive(const plugin_update_info&, load_weights_fn) override { co_return; }
  void do_shutdown() override {}
};

class throwing_sender final : public weight_sender {
 public:
  throwing_sender(const weight_transfer_config&, const trainer_context&) {
    throw std::runtime_error("test_plugin: no trainer on this host");
  }
  static engine_capabilities capabilities_of() { return {}; }
  std::string_view backend() const noexcept override { return "test_plugin_throwing"; }
  json prepare(const json&) override { return {}; }
  asio::awaitable<void> connect_workers() override { co_return; }
  asio::awaitable<void> send_weights(const update_metadata&, tensor_source&) override { co_return; }
  void shutdown() override {}
};

}  // namespace refit_test_plugin

REFIT_DEFINE_PLUGIN(refit_test_plugin_entry, refit_test_plugin::engine, refit_test_plugin::sender)
REFIT_DEFINE_PLUGIN(refit_test_plugin_throwing_entry, refit_test_plugin::throwing_engine,
                    refit_test_plugin::throwing_sender)

namespace {
int never_create(const refit::weight_transfer_config*, const refit::engine_context*, refit::weight_transfer_engine**,
                 char* err, std::size_t err_len) {
  refit::plugin_detail::write_message(err, err_len, "must not be called");
  return static_cast<int>(refit::errc::load_failed);
}
}  // namespace

// Refuses to load, as a plugin whose hardware is missing would.
extern "C" __attribute__((visibility("default"))) int refit_test_plugin_refusing_entry(const char*,
                                                                                       refit_plugin_v2* out, char* err,
                                                                                       std::size_t err_len) {
  out->build = refit_build_stamp();
  refit::plugin_detail::write_message(err, err_len, "test_plugin: no widget driver on this machine");
  return static_cast<int>(refit::errc::unsupported);
}

// Claims success but was built by another compiler: its build stamp differs.
extern "C" __attribute__((visibility("default"))) int refit_test_plugin_other_build_entry(const char*,
                                                                                          refit_plugin_v2* out, char*,
                                                                                          std::size_t) {
  out->build = "refit plugin ABI 1; gcc 9.9.9; libstdc++ 9 cxx11-abi 0; C++ 201703L; asio 101800; json 3.7";
  out->create_engine = &never_create;
  out->create_sender = nullptr;
  return 0;
}

// Says nothing of how it was built.
extern "C" __attribute__((visibility("default"))) int refit_test_plugin_unstamped_entry(const char*,
                                                                                        refit_plugin_v2* out, char*,
                                                                                        std::size_t) {
  out->build = nullptr;
  out->create_engine = &never_create;
  return 0;
}
