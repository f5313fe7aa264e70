// engine_factory: registration by type and by creator, lookup errors, and lazy
// backends in a real shared library (//tests/lib/plugin:libtest_plugin.so, found in
// the test's runfiles) loaded with dlopen on first create.
#include <refit/backend/engine.h>
#include <refit/factory.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <asio/io_context.hpp>

#include <refit/backend/plugin.h>
#include <refit/json_reader.h>
#include <refit/metadata.h>
#include "tests/lib/expect.h"
#include "tests/support/run.h"

// libtest_plugin.so is linked as an out-of-tree plugin is: with its own copy of the
// core library, so both copies register the same globals (backend::engine's vtable)
// with ASan, which clang's ASan reports as an ODR violation before main. The plugin
// only ever uses its own copy (RTLD_LOCAL).
extern "C" const char* __asan_default_options() { return "detect_odr_violation=0"; }

namespace refit {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---- in-process backends ----

struct null_init final : init_info {
  static null_init read(json_reader&) { return {}; }
};
struct null_update final : update_info {
  static null_update read(json_reader& r) {
    null_update u;
    u.metadata = read_update_metadata(r);
    return u;
  }
};

class null_engine final : public backend::typed_engine<null_init, null_update> {
 public:
  null_engine(const weight_transfer_config& config, const engine_context& context)
      : typed_engine(config, context, capabilities_of()) {}
  static engine_capabilities capabilities_of() { return {}; }
  std::string_view backend() const noexcept override { return "null"; }

 protected:
  asio::awaitable<void> init(const null_init&) override { co_return; }
  asio::awaitable<void> receive(const null_update&, load_weights_fn) override { co_return; }
  void do_shutdown() override {}
};

class null_sender final : public weight_sender {
 public:
  null_sender(const weight_transfer_config& c, const trainer_context&) : config(c) {}
  std::string_view backend() const noexcept override { return "null"; }
  json prepare(const json&) override { return json::object(); }
  asio::awaitable<void> connect_workers() override { co_return; }
  asio::awaitable<void> send_weights(const update_metadata&, tensor_source&) override { co_return; }
  void shutdown() override {}
  weight_transfer_config config;
};

// Registered with the process-wide factory before main(), as engines do.
const backend_registration static_registration{"factory_test.static", null_engine::capabilities_of(),
                                               [](const weight_transfer_config& c, const engine_context& x) {
                                                 return std::unique_ptr<weight_transfer_engine>(new null_engine(c, x));
                                               }};
const backend_type_registration<null_engine, null_sender> static_type_registration{"factory_test.typed"};

// ---- plugin location ----

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The plugin in this test's runfiles: $TEST_SRCDIR/<workspace>/..., the working
// directory of `bazel test`, or <binary>.runfiles/ when run by hand.
std::string find_plugin() {
  const fs::path rel = "tests/lib/plugin/libtest_plugin.so";
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string ws = workspace && *workspace ? workspace : "refit";
  std::vector<fs::path> candidates;
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) candidates.push_back(fs::path(srcdir) / ws / rel);
  if (const char* runfiles = std::getenv("RUNFILES_DIR")) candidates.push_back(fs::path(runfiles) / ws / rel);
  candidates.push_back(fs::current_path() / rel);
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(fs::path(self.string() + ".runfiles") / ws / rel);
  for (const auto& c : candidates)
    if (is_file(c)) return fs::absolute(c).string();
  return {};
}

// A directory private to this test run.
fs::path scratch_dir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  fs::path base = tmp && *tmp ? fs::path(tmp) : fs::temp_directory_path();
  fs::path dir = base / ("factory_test." + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir;
}

bool is_loaded(const std::string& path) {
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!h) return false;
  ::dlclose(h);  // drops only the reference NOLOAD took
  return true;
}

class factory_test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { plugin_ = new std::string(find_plugin()); }
  static void TearDownTestSuite() {
    delete plugin_;
    plugin_ = nullptr;
  }
  const std::string& plugin() {
    EXPECT_FALSE(plugin_->empty()) << "libtest_plugin.so not found in the runfiles";
    return *plugin_;
  }

  weight_transfer_config config(std::string backend) {
    weight_transfer_config c;
    c.backend = std::move(backend);
    c.timeout = std::chrono::milliseconds(1234);
    return c;
  }
  engine_context engine_ctx() {
    engine_context c;
    c.executor = io.get_executor();
    return c;
  }
  trainer_context trainer_ctx() {
    trainer_context c;
    c.executor = io.get_executor();
    return c;
  }

  static std::string* plugin_;
  engine_factory factory;
  asio::io_context io;
};

std::string* factory_test::plugin_ = nullptr;

// ---- registration and lookup ----

TEST_F(factory_test, register_engine_creates_the_types_with_config_and_context) {
  factory.register_engine<null_engine, null_sender>("null");
  EXPECT_TRUE(factory.contains("null"));
  auto engine = factory.create_engine(config("null"), engine_ctx());
  ASSERT_NE(dynamic_cast<null_engine*>(engine.get()), nullptr);
  EXPECT_EQ(engine->config().timeout, std::chrono::milliseconds(1234));
  EXPECT_EQ(engine->context().executor, engine_ctx().executor);
  auto sender = factory.create_sender(config("null"), trainer_ctx());
  auto* typed = dynamic_cast<null_sender*>(sender.get());
  ASSERT_NE(typed, nullptr);
  EXPECT_EQ(typed->config.backend, "null");
}

TEST_F(factory_test, register_backend_passes_arguments_to_the_creators) {
  int engines = 0, senders = 0;
  factory.register_backend(
      "counted", null_engine::capabilities_of(),
      [&](const weight_transfer_config& c, const engine_context& x) {
        ++engines;
        EXPECT_EQ(c.backend, "counted");
        return std::unique_ptr<weight_transfer_engine>(new null_engine(c, x));
      },
      [&](const weight_transfer_config& c, const trainer_context& x) {
        ++senders;
        return std::unique_ptr<weight_sender>(new null_sender(c, x));
      });
  factory.create_engine(config("counted"), engine_ctx());
  factory.create_engine(config("counted"), engine_ctx());
  factory.create_sender(config("counted"), trainer_ctx());
  EXPECT_EQ(engines, 2);
  EXPECT_EQ(senders, 1);
}

TEST_F(factory_test, invalid_registrations_are_refused) {
  auto make = [](const weight_transfer_config& c, const engine_context& x) {
    return std::unique_ptr<weight_transfer_engine>(new null_engine(c, x));
  };
  auto e = REFIT_THROWN(factory.register_backend("", {}, make));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_EQ(e.message(), "register_backend: empty backend name");
  e = REFIT_THROWN(factory.register_backend("x", {}, engine_creator{}));
  EXPECT_EQ(e.message(), "register_backend('x'): no engine creator");
  e = REFIT_THROWN(factory.register_lazy("", "/lib.so", "entry"));
  EXPECT_EQ(e.message(), "register_lazy: empty backend name");
  e = REFIT_THROWN(factory.register_lazy("y", "", "entry"));
  EXPECT_EQ(e.message(), "register_lazy('y'): library path and entry symbol are required");
  e = REFIT_THROWN(factory.register_lazy("y", "/lib.so", ""));
  EXPECT_EQ(e.kind(), errc::invalid_argument);
  EXPECT_TRUE(factory.available().empty()) << "nothing invalid was registered";
}

TEST_F(factory_test, duplicate_name_is_already_registered_and_keeps_the_first) {
  factory.register_engine<null_engine>("dup");
  auto e = REFIT_THROWN(factory.register_engine<null_engine>("dup"));
  EXPECT_EQ(e.kind(), errc::already_registered);
  EXPECT_EQ(e.message(), "weight transfer backend 'dup' is already registered");
  e = REFIT_THROWN(factory.register_lazy("dup", "/somewhere/libdup.so", "entry"));
  EXPECT_EQ(e.kind(), errc::already_registered);
  factory.register_lazy("lazy_dup", "/somewhere/libdup.so", "entry");
  e = REFIT_THROWN(factory.register_engine<null_engine>("lazy_dup"));
  EXPECT_EQ(e.kind(), errc::already_registered);
  EXPECT_EQ(e.message(), "weight transfer backend 'lazy_dup' is already registered");
  e = REFIT_THROWN(factory.register_lazy("lazy_dup", "/elsewhere/libother.so", "entry"));
  EXPECT_EQ(e.kind(), errc::already_registered);
  // The first registration still works.
  EXPECT_NE(factory.create_engine(config("dup"), engine_ctx()), nullptr);
}

TEST_F(factory_test, unknown_backend_lists_the_available_names_sorted) {
  factory.register_engine<null_engine>("tcp");
  factory.register_engine<null_engine>("nccl");
  factory.register_lazy("shm", "/nowhere/libshm.so", "entry");
  EXPECT_EQ(factory.available(), (std::vector<std::string>{"nccl", "shm", "tcp"}));
  EXPECT_FALSE(factory.contains("gloo"));
  auto e = REFIT_THROWN(factory.create_engine(config("gloo"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::not_registered);
  EXPECT_EQ(e.message(), "invalid weight transfer backend 'gloo'; available backends: nccl, shm, tcp");
  e = REFIT_THROWN(factory.create_sender(config("gloo"), trainer_ctx()));
  EXPECT_EQ(e.kind(), errc::not_registered);
  EXPECT_THAT(e.message(), HasSubstr("available backends: nccl, shm, tcp"));
}

TEST_F(factory_test, unknown_backend_in_an_empty_registry_says_none) {
  auto e = REFIT_THROWN(factory.create_engine(config("tcp"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::not_registered);
  EXPECT_EQ(e.message(), "invalid weight transfer backend 'tcp'; available backends: (none)");
}

TEST_F(factory_test, create_sender_of_a_receive_only_backend_is_unsupported) {
  factory.register_engine<null_engine>("recv_only");
  EXPECT_NE(factory.create_engine(config("recv_only"), engine_ctx()), nullptr);
  auto e = REFIT_THROWN(factory.create_sender(config("recv_only"), trainer_ctx()));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_EQ(e.message(), "backend 'recv_only' has no trainer-side sender");
}

TEST_F(factory_test, static_registrations_join_the_process_wide_instance) {
  EXPECT_EQ(&engine_factory::instance(), &engine_factory::instance());
  auto& global = engine_factory::instance();
  EXPECT_TRUE(global.contains("factory_test.static"));
  EXPECT_TRUE(global.contains("factory_test.typed"));
  EXPECT_FALSE(factory.contains("factory_test.static")) << "a local factory is independent";
  auto sender = global.create_sender(config("factory_test.typed"), trainer_ctx());
  EXPECT_NE(dynamic_cast<null_sender*>(sender.get()), nullptr);
  auto e = REFIT_THROWN(global.create_sender(config("factory_test.static"), trainer_ctx()));
  EXPECT_EQ(e.kind(), errc::unsupported);
  // A second static registration under the same name fails loudly.
  e = REFIT_THROWN(backend_type_registration<null_engine> again{"factory_test.typed"});
  EXPECT_EQ(e.kind(), errc::already_registered);
}

// ---- lazy backends in a shared library ----

asio::awaitable<void> init_and_receive(weight_transfer_engine& engine, json init, json update, load_weights_fn load) {
  auto init_info = engine.parse_init_info(init);
  co_await engine.init_transfer_engine(*init_info);
  auto update_info = engine.parse_update_info(update);
  co_await engine.receive_weights(*update_info, std::move(load));
  co_await engine.drain_pending();
}

TEST_F(factory_test, lazy_registration_loads_nothing_until_create_and_the_engine_works) {
  // A private copy, so no other test can have loaded this file already.
  const fs::path copy = scratch_dir() / "liblazy_probe.so";
  fs::copy_file(plugin(), copy, fs::copy_options::overwrite_existing);
  ASSERT_FALSE(is_loaded(copy.string()));

  factory.register_lazy("plugged", copy.string(), "refit_test_plugin_entry");
  EXPECT_TRUE(factory.contains("plugged"));
  EXPECT_EQ(factory.available(), (std::vector<std::string>{"plugged"}));
  EXPECT_FALSE(is_loaded(copy.string())) << "register_lazy must not load the library";

  auto engine = factory.create_engine(config("plugged"), engine_ctx());
  EXPECT_TRUE(is_loaded(copy.string())) << "create_engine loads it";
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend(), "test_plugin");
  EXPECT_EQ(engine->config().timeout, std::chrono::milliseconds(1234)) << "config crossed the boundary";

  std::vector<std::string> names;
  std::vector<float> values;
  auto load = [&](std::span<const tensor_view> views) {
    for (const auto& v : views) {
      names.emplace_back(v.name);
      EXPECT_EQ(v.dtype, dtype::float32);
      EXPECT_EQ(v.spec().shape, (std::vector<std::int64_t>{4}));
      const float* p = reinterpret_cast<const float*>(v.data);
      values.assign(p, p + v.numel());
    }
  };
  json update = {{"names", {"plugin.weight"}}, {"dtype_names", {"float32"}}, {"shapes", {{4}}}};
  testing::run_to_completion(io, init_and_receive(*engine, json{{"scale", 2.0}}, update, load));
  EXPECT_EQ(names, (std::vector<std::string>{"plugin.weight"}));
  EXPECT_EQ(values, (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(engine->last_update_stats().tensors, 1u);

  // Loaded once; later creates reuse it and give independent engines.
  auto second = factory.create_engine(config("plugged"), engine_ctx());
  ASSERT_NE(second, nullptr);
  EXPECT_NE(second.get(), engine.get());
  EXPECT_FALSE(second->initialized());
  engine.reset();  // destroyed through the plugin's vtable
  second->shutdown();
}

TEST_F(factory_test, plugin_engine_keeps_the_base_class_checks_and_strict_parsing) {
  factory.register_lazy("plugged", plugin(), "refit_test_plugin_entry");
  auto engine = factory.create_engine(config("plugged"), engine_ctx());
  json update = {{"names", {"plugin.weight"}}, {"dtype_names", {"float32"}}, {"shapes", {{4}}}};
  auto info = engine->parse_update_info(update);
  auto r = testing::spawn(io, engine->receive_weights(*info, [](std::span<const tensor_view>) {}));
  ASSERT_TRUE(testing::run(io));
  EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_state));
  EXPECT_EQ(r->message(), "test_plugin: receive_weights before init_transfer_engine");
  auto e = REFIT_THROWN(engine->parse_init_info(json{{"scael", 2}}));
  EXPECT_EQ(e.kind(), errc::invalid_argument) << "a refit::error thrown inside the plugin keeps its kind";
  EXPECT_EQ(e.message(), "test_plugin init_info: unknown member 'scael' (accepted: scale)");
}

asio::awaitable<void> send_two(weight_sender& sender, update_metadata declared, std::vector<tensor_view> views) {
  co_await trainer_send_weights(sender, declared, views);
}

TEST_F(factory_test, plugin_sender_is_created_and_usable) {
  factory.register_lazy("plugged", plugin(), "refit_test_plugin_entry");
  auto sender = factory.create_sender(config("plugged"), trainer_ctx());
  ASSERT_NE(sender, nullptr);
  EXPECT_EQ(sender->backend(), "test_plugin");
  EXPECT_EQ(sender->prepare(json{{"scale", 3.0}}), (json{{"scale", 3.0}}));
  auto e = REFIT_THROWN(sender->prepare(json{{"sclae", 3.0}}));
  EXPECT_EQ(e.message(), "test_plugin trainer_args: unknown member 'sclae' (accepted: scale)");

  std::vector<std::int64_t> shape{2};
  float a[2] = {1, 2}, b[2] = {3, 4};
  std::vector<tensor_view> views{tensor_view("a", dtype::float32, shape, a),
                                 tensor_view("b", dtype::float32, shape, b)};
  update_metadata declared = describe(views);
  testing::run_to_completion(io, send_two(*sender, declared, views));
  EXPECT_EQ(sender->last_send_stats().tensors, 2u);
  EXPECT_EQ(sender->last_send_stats().bytes, 16u);

  views[1].name = "c";
  auto r = testing::spawn(io, send_two(*sender, declared, views));
  ASSERT_TRUE(testing::run(io));
  EXPECT_EQ(r->kind(), static_cast<int>(errc::invalid_argument));
  EXPECT_EQ(r->message(), "parameter #1 ('b') name: declared 'b', sent 'c'");
}

TEST_F(factory_test, missing_library_is_load_failed_with_the_dlopen_message) {
  const std::string path = "/nonexistent/refit/libghost.so";
  factory.register_lazy("ghost", path, "refit_test_plugin_entry");
  for (int attempt = 0; attempt < 2; ++attempt) {  // stays registered; fails the same way again
    auto e = REFIT_THROWN(factory.create_engine(config("ghost"), engine_ctx()));
    EXPECT_EQ(e.kind(), errc::load_failed);
    EXPECT_THAT(e.message(), StartsWith("backend 'ghost' from " + path + ": dlopen failed: "));
    EXPECT_THAT(e.message(), HasSubstr("No such file or directory"));
  }
  auto e = REFIT_THROWN(factory.create_sender(config("ghost"), trainer_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed);
  EXPECT_TRUE(factory.contains("ghost"));
}

TEST_F(factory_test, a_file_that_is_not_a_library_is_load_failed) {
  const fs::path bogus = scratch_dir() / "libnot_elf.so";
  std::ofstream(bogus) << "this is not an ELF file, just some text long enough to have a header\n";
  factory.register_lazy("bogus", bogus.string(), "refit_test_plugin_entry");
  auto e = REFIT_THROWN(factory.create_engine(config("bogus"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed);
  EXPECT_THAT(e.message(), StartsWith("backend 'bogus' from " + bogus.string() + ": dlopen failed: "));
}

TEST_F(factory_test, missing_entry_symbol_is_load_failed_naming_the_symbol) {
  factory.register_lazy("nosym", plugin(), "refit_no_such_entry");
  auto e = REFIT_THROWN(factory.create_engine(config("nosym"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed);
  EXPECT_EQ(e.message(), "backend 'nosym' from " + plugin() + ": entry symbol 'refit_no_such_entry' not found");
  // A good entry in the same library is unaffected.
  factory.register_lazy("good", plugin(), "refit_test_plugin_entry");
  EXPECT_NE(factory.create_engine(config("good"), engine_ctx()), nullptr);
}

TEST_F(factory_test, plugin_that_refuses_to_load_passes_its_kind_and_message) {
  factory.register_lazy("refusing", plugin(), "refit_test_plugin_refusing_entry");
  auto e = REFIT_THROWN(factory.create_engine(config("refusing"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::unsupported);
  EXPECT_EQ(e.message(), "backend 'refusing' from " + plugin() + ": test_plugin: no widget driver on this machine");
}

TEST_F(factory_test, plugin_of_another_build_is_load_failed_naming_both_builds) {
  factory.register_lazy("other_build", plugin(), "refit_test_plugin_other_build_entry");
  auto e = REFIT_THROWN(factory.create_engine(config("other_build"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed);
  EXPECT_THAT(e.message(), HasSubstr("the plugin was built as [refit plugin ABI 1; gcc 9.9.9; libstdc++ 9"));
  EXPECT_THAT(e.message(), HasSubstr(std::string("this program as [") + refit_build_stamp() + "]"));
  EXPECT_THAT(e.message(), HasSubstr("same compiler, standard library and refit plugin ABI"));
  factory.register_lazy("unstamped", plugin(), "refit_test_plugin_unstamped_entry");
  e = REFIT_THROWN(factory.create_engine(config("unstamped"), engine_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed);
  EXPECT_THAT(e.message(), HasSubstr("the plugin was built as [no build stamp]"));
  // The stamp names what it must: refit's plugin ABI, the compiler, the library.
  const std::string stamp = refit_build_stamp();
#if defined(__clang__)
  EXPECT_THAT(stamp, HasSubstr("refit plugin ABI " REFIT_PLUGIN_STR(REFIT_PLUGIN_ABI_VERSION) "; clang "));
#else
  EXPECT_THAT(stamp, HasSubstr("refit plugin ABI " REFIT_PLUGIN_STR(REFIT_PLUGIN_ABI_VERSION) "; gcc "));
#endif
  EXPECT_THAT(stamp, HasSubstr("; libstdc++ 12 cxx11-abi 1; C++ 202002"));
}

TEST_F(factory_test, a_loaded_plugin_reports_its_capabilities) {
  factory.register_lazy("good", plugin(), "refit_test_plugin_entry");
  EXPECT_EQ(factory.capabilities("good"), std::nullopt) << "not loaded yet";
  EXPECT_NE(factory.create_engine(config("good"), engine_ctx()), nullptr);
  ASSERT_TRUE(factory.capabilities("good").has_value());
  EXPECT_TRUE(factory.capabilities("good")->staged_commit);
  auto e = REFIT_THROWN(factory.capabilities("nothing"));
  EXPECT_EQ(e.kind(), errc::not_registered);
}

TEST_F(factory_test, exceptions_in_plugin_constructors_cross_as_error_codes) {
  factory.register_lazy("throwing", plugin(), "refit_test_plugin_throwing_entry");
  weight_transfer_config c = config("throwing");
  c.processing_threads = 3;
  auto e = REFIT_THROWN(factory.create_engine(c, engine_ctx()));
  EXPECT_EQ(e.kind(), errc::unsupported) << "a refit::error keeps its kind";
  EXPECT_EQ(e.message(), "backend 'throwing' from " + plugin() + ": test_plugin: this engine needs 103 widgets");
  e = REFIT_THROWN(factory.create_sender(c, trainer_ctx()));
  EXPECT_EQ(e.kind(), errc::load_failed) << "any other exception is load_failed";
  EXPECT_EQ(e.message(), "backend 'throwing' from " + plugin() + ": test_plugin: no trainer on this host");
}

}  // namespace
}  // namespace refit
