// The boundary between refit and a backend loaded from a shared library. Only C
// types and functions that never throw cross it; C++ objects cross as pointers to
// refit's own abstract classes, guarded by an ABI version and a layout check.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

#include <refit/engine.h>
#include <refit/error.h>
#include <refit/trainer.h>

extern "C" {

/// Bumped whenever anything reachable through refit_plugin_v1 changes layout.
#define REFIT_PLUGIN_ABI_VERSION 1u

/// Sizes the host and the plugin must agree on.
struct refit_plugin_layout {
  std::uint32_t config_size, engine_context_size, trainer_context_size;
};

/// What a plugin's entry point fills in. The creators return 0 on success or a
/// refit::errc value, writing a NUL-terminated message into `err` on failure.
struct refit_plugin_v1 {
  std::uint32_t abi_version;
  refit_plugin_layout layout;
  int (*create_engine)(const refit::weight_transfer_config* config,
                       const refit::engine_context* context,
                       refit::weight_transfer_engine** out, char* err, std::size_t err_len);
  int (*create_sender)(const refit::weight_transfer_config* config,
                       const refit::trainer_context* context, refit::weight_sender** out,
                       char* err, std::size_t err_len);  // may be null
};

/// The entry point's type: fills `out` when `host_abi_version` is supported,
/// else returns errc::load_failed with a message.
typedef int (*refit_plugin_entry_fn)(std::uint32_t host_abi_version, refit_plugin_v1* out,
                                     char* err, std::size_t err_len);
}

namespace refit::plugin_detail {

inline refit_plugin_layout host_layout() {
  return {sizeof(weight_transfer_config), sizeof(engine_context), sizeof(trainer_context)};
}

inline void write_message(char* err, std::size_t err_len, const char* text) {
  if (!err || err_len == 0) return;
  std::strncpy(err, text, err_len - 1);
  err[err_len - 1] = '\0';
}

/// Runs `fn`, turning any exception into an error code and message.
template <class Fn>
int guarded(char* err, std::size_t err_len, Fn&& fn) noexcept {
  try {
    fn();
    return 0;
  } catch (const refit::error& e) {
    write_message(err, err_len, e.message().c_str());
    return e.kind() == errc{} ? static_cast<int>(errc::load_failed) : static_cast<int>(e.kind());
  } catch (const std::exception& e) {
    write_message(err, err_len, e.what());
  } catch (...) {
    write_message(err, err_len, "unknown exception");
  }
  return static_cast<int>(errc::load_failed);
}

}  // namespace refit::plugin_detail

/// Defines the extern "C" entry point `symbol` of a plugin whose engine type is
/// `engine_t` and sender type `sender_t` (both constructible from config, context).
#define REFIT_DEFINE_PLUGIN(symbol, engine_t, sender_t)                                       \
  extern "C" __attribute__((visibility("default"))) int symbol(                                \
      std::uint32_t host_abi_version, refit_plugin_v1* out, char* err, std::size_t err_len) {  \
    if (host_abi_version != REFIT_PLUGIN_ABI_VERSION || !out) {                                \
      refit::plugin_detail::write_message(err, err_len,                                        \
                                          "plugin built for refit plugin ABI 1, host differs");\
      return static_cast<int>(refit::errc::load_failed);                                       \
    }                                                                                          \
    out->abi_version = REFIT_PLUGIN_ABI_VERSION;                                               \
    out->layout = refit::plugin_detail::host_layout();                                         \
    out->create_engine = [](const refit::weight_transfer_config* c,                            \
                            const refit::engine_context* x, refit::weight_transfer_engine** o, \
                            char* e, std::size_t n) noexcept {                                 \
      return refit::plugin_detail::guarded(e, n, [&] { *o = new engine_t(*c, *x); });          \
    };                                                                                         \
    out->create_sender = [](const refit::weight_transfer_config* c,                            \
                            const refit::trainer_context* x, refit::weight_sender** o,         \
                            char* e, std::size_t n) noexcept {                                 \
      return refit::plugin_detail::guarded(e, n, [&] { *o = new sender_t(*c, *x); });          \
    };                                                                                         \
    return 0;                                                                                  \
  }
