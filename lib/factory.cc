#include <refit/factory.h>

#include <dlfcn.h>

#include <cstring>

#include <refit/plugin_abi.h>

namespace refit {

engine_factory& engine_factory::instance() {
  static engine_factory factory;
  return factory;
}

void engine_factory::register_backend(const std::string& name, const engine_capabilities& capabilities,
                                      engine_creator create_engine, sender_creator create_sender) {
  if (name.empty()) throw_error(errc::invalid_argument, "register_backend: empty backend name");
  if (!create_engine) throw_error(errc::invalid_argument, "register_backend('" + name + "'): no engine creator");
  std::lock_guard lock(mutex_);
  if (entries_.contains(name))
    throw_error(errc::already_registered, "weight transfer backend '" + name + "' is already registered");
  entries_.emplace(name, entry{capabilities, std::move(create_engine), std::move(create_sender), {}, {}});
}

void engine_factory::register_lazy(const std::string& name, std::string library_path, std::string entry_symbol) {
  if (name.empty()) throw_error(errc::invalid_argument, "register_lazy: empty backend name");
  if (library_path.empty() || entry_symbol.empty())
    throw_error(errc::invalid_argument, "register_lazy('" + name + "'): library path and entry symbol are required");
  std::lock_guard lock(mutex_);
  if (entries_.contains(name))
    throw_error(errc::already_registered, "weight transfer backend '" + name + "' is already registered");
  entries_.emplace(name, entry{std::nullopt, {}, {}, std::move(library_path), std::move(entry_symbol)});
}

bool engine_factory::contains(std::string_view name) const {
  std::lock_guard lock(mutex_);
  return entries_.find(name) != entries_.end();
}

std::vector<std::string> engine_factory::available() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, e] : entries_) names.push_back(name);
  return names;
}

namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "(none)" : out;
}

// What config asks of a backend that its capabilities say it cannot do.
void check_config(const std::string& name, const engine_capabilities& caps, const weight_transfer_config& config) {
  if (config.commit == commit_mode::staged && !caps.staged_commit)
    throw_error(errc::unsupported, "backend '" + name +
                                       "' does not commit staged updates "
                                       "(engine_capabilities::staged_commit is false: its buckets land in device "
                                       "memory); use commit in_place");
}

// Turns a plugin creator's status into an exception on this side of the boundary.
void check_plugin_status(int status, const char* err, const std::string& what) {
  if (status == 0) return;
  auto kind = status > 0 && status <= static_cast<int>(last_errc) ? static_cast<errc>(status) : errc::load_failed;
  throw_error(kind, what + ": " + (err[0] ? err : "failed without a message"));
}

}  // namespace

const engine_factory::entry& engine_factory::find(std::string_view name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, e] : entries_) names.push_back(n);
    throw_error(errc::not_registered,
                "invalid weight transfer backend '" + std::string(name) + "'; available backends: " + join(names));
  }
  return it->second;
}

std::optional<engine_capabilities> engine_factory::capabilities(std::string_view name) const {
  std::lock_guard lock(mutex_);
  return find(name).capabilities;
}

engine_factory::entry& engine_factory::resolve(const std::string& name) {
  entry& e = const_cast<entry&>(find(name));
  if (e.create_engine) return e;

  // Lazy entry: load the library once. RTLD_NODELETE keeps code and vtables mapped
  // for as long as any object it created may live.
  const std::string where = "backend '" + name + "' from " + e.library;
  void* handle = ::dlopen(e.library.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!handle) throw_error(errc::load_failed, where + ": dlopen failed: " + ::dlerror());
  auto entry_fn = reinterpret_cast<refit_plugin_entry_fn>(::dlsym(handle, e.symbol.c_str()));
  if (!entry_fn) throw_error(errc::load_failed, where + ": entry symbol '" + e.symbol + "' not found");
  refit_plugin_v2 plugin{};
  char err[512] = {};
  const char* host = refit_build_stamp();
  const int status = entry_fn(host, &plugin, err, sizeof err);
  if (!plugin.build || std::strcmp(plugin.build, host) != 0)
    throw_error(errc::load_failed, where + ": the plugin was built as [" +
                                       (plugin.build ? plugin.build : "no build stamp") + "], this program as [" +
                                       host +
                                       "]; a plugin shares C++ objects with refit, so both must be built with the "
                                       "same compiler, standard library and refit plugin ABI");
  check_plugin_status(status, err, where);
  if (!plugin.create_engine) throw_error(errc::load_failed, where + ": the plugin offers no engine");
  e.capabilities = plugin.capabilities;
  e.create_engine = [create = plugin.create_engine, where](const weight_transfer_config& c, const engine_context& x) {
    weight_transfer_engine* out = nullptr;
    char msg[512] = {};
    check_plugin_status(create(&c, &x, &out, msg, sizeof msg), msg, where);
    return std::unique_ptr<weight_transfer_engine>(out);
  };
  if (plugin.create_sender)
    e.create_sender = [create = plugin.create_sender, where](const weight_transfer_config& c,
                                                             const trainer_context& x) {
      weight_sender* out = nullptr;
      char msg[512] = {};
      check_plugin_status(create(&c, &x, &out, msg, sizeof msg), msg, where);
      return std::unique_ptr<weight_sender>(out);
    };
  return e;
}

std::unique_ptr<weight_transfer_engine> engine_factory::create_engine(const weight_transfer_config& config,
                                                                      const engine_context& context) {
  engine_creator create;
  {
    std::lock_guard lock(mutex_);
    const entry& e = resolve(config.backend);
    check_config(config.backend, *e.capabilities, config);
    create = e.create_engine;
  }
  return create(config, context);
}

std::unique_ptr<weight_sender> engine_factory::create_sender(const weight_transfer_config& config,
                                                             const trainer_context& context) {
  sender_creator create;
  {
    std::lock_guard lock(mutex_);
    create = resolve(config.backend).create_sender;
  }
  if (!create) throw_error(errc::unsupported, "backend '" + config.backend + "' has no trainer-side sender");
  return create(config, context);
}

backend_registration::backend_registration(const std::string& name, const engine_capabilities& capabilities,
                                           engine_creator create_engine, sender_creator create_sender) {
  engine_factory::instance().register_backend(name, capabilities, std::move(create_engine), std::move(create_sender));
}

}  // namespace refit
