// The backend registry: refit's WeightTransferEngineFactory. A backend registers its
// worker engine, its trainer sender and its capabilities under one name, either
// directly (engines built into the binary register themselves from a static
// initialiser in their own folder) or lazily as a shared library loaded with dlopen
// on first use (backend/plugin.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <refit/config.h>
#include <refit/engine.h>
#include <refit/trainer.h>

namespace refit {

using engine_creator =
    std::function<std::unique_ptr<weight_transfer_engine>(const weight_transfer_config&, const engine_context&)>;
using sender_creator =
    std::function<std::unique_ptr<weight_sender>(const weight_transfer_config&, const trainer_context&)>;

/// Registry of backends. Thread-safe. Most code uses the process-wide instance().
class engine_factory {
 public:
  /// The process-wide registry that self-registering engines join.
  static engine_factory& instance();

  /// Registers a backend by its capabilities and creators. `create_sender` may be
  /// empty for a receive-only backend. Throws already_registered for a duplicate
  /// name.
  void register_backend(const std::string& name, const engine_capabilities& capabilities, engine_creator create_engine,
                        sender_creator create_sender = {});

  /// Registers types constructible from (config, context); the capabilities are
  /// Engine::capabilities_of() (backend/engine.h).
  template <class Engine, class Sender = void>
  void register_engine(const std::string& name) {
    sender_creator sc;
    if constexpr (!std::is_void_v<Sender>)
      sc = [](const weight_transfer_config& c, const trainer_context& t) {
        return std::unique_ptr<weight_sender>(new Sender(c, t));
      };
    register_backend(
        name, Engine::capabilities_of(),
        [](const weight_transfer_config& c, const engine_context& e) {
          return std::unique_ptr<weight_transfer_engine>(new Engine(c, e));
        },
        std::move(sc));
  }

  /// Registers a backend implemented in a shared library, loaded on first create
  /// with dlopen(RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE). `entry_symbol` names a
  /// function defined with REFIT_DEFINE_PLUGIN (backend/plugin.h). Nothing is
  /// loaded now; a missing library or symbol, or a plugin built by another
  /// compiler, standard library or refit, is a load_failed error at create time.
  void register_lazy(const std::string& name, std::string library_path, std::string entry_symbol);

  /// Creates the worker engine for config.backend; throws not_registered listing the
  /// available backends, load_failed for a lazy backend that cannot load, or
  /// unsupported when config asks for what the backend cannot do (commit staged
  /// without engine_capabilities::staged_commit), naming the capability.
  std::unique_ptr<weight_transfer_engine> create_engine(const weight_transfer_config& config,
                                                        const engine_context& context);
  /// Creates the trainer sender for config.backend (same errors; unsupported when
  /// the backend has no sender).
  std::unique_ptr<weight_sender> create_sender(const weight_transfer_config& config, const trainer_context& context);

  bool contains(std::string_view name) const;
  /// Registered names, sorted.
  std::vector<std::string> available() const;
  /// What backend `name` can do; nullopt for a lazy backend not loaded yet. Throws
  /// not_registered listing the available backends.
  std::optional<engine_capabilities> capabilities(std::string_view name) const;

 private:
  struct entry {
    std::optional<engine_capabilities> capabilities;  // empty for lazy entries until loaded
    engine_creator create_engine;
    sender_creator create_sender;
    std::string library, symbol;  // set for lazy entries until loaded
  };
  const entry& find(std::string_view name) const;  // called with mutex_ held
  entry& resolve(const std::string& name);         // called with mutex_ held

  mutable std::mutex mutex_;
  std::map<std::string, entry, std::less<>> entries_;
};

/// Registers a backend with the process-wide factory from a static initialiser:
///   static refit::backend_registration reg{"nccl", nccl::engine::capabilities_of(), make_engine, make_sender};
/// The library holding it must be linked with alwayslink so the initialiser runs.
struct backend_registration {
  backend_registration(const std::string& name, const engine_capabilities& capabilities, engine_creator create_engine,
                       sender_creator create_sender = {});
};

/// The same for engine and sender types constructible from (config, context):
///   static refit::backend_type_registration<tcp::engine, tcp::sender> reg{"tcp"};
template <class Engine, class Sender = void>
struct backend_type_registration {
  explicit backend_type_registration(const std::string& name) {
    engine_factory::instance().register_engine<Engine, Sender>(name);
  }
};

}  // namespace refit
