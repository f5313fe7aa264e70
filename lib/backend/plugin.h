// REFIT_DEFINE_PLUGIN: a backend's entry point for loading from a shared library
// (engine_factory::register_lazy). The boundary itself, its build stamp and why
// both sides must be built alike: plugin_abi.h.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>

#include <refit/engine.h>
#include <refit/error.h>
#include <refit/plugin_abi.h>
#include <refit/trainer.h>

namespace refit::plugin_detail {

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
/// `engine_t` and sender type `sender_t` (both constructible from config, context;
/// engine_t::capabilities_of() declares what it can do).
#define REFIT_DEFINE_PLUGIN(symbol, engine_t, sender_t)                                                      \
  extern "C" __attribute__((visibility("default"))) int symbol(const char* host_build, refit_plugin_v2* out, \
                                                               char* err, std::size_t err_len) {             \
    if (!out) return static_cast<int>(refit::errc::load_failed);                                             \
    out->build = refit_build_stamp();                                                                        \
    if (!host_build || std::strcmp(host_build, out->build) != 0) {                                           \
      refit::plugin_detail::write_message(err, err_len, "the host's refit build differs from the plugin's"); \
      return static_cast<int>(refit::errc::load_failed);                                                     \
    }                                                                                                        \
    out->capabilities = engine_t::capabilities_of();                                                         \
    out->create_engine = [](const refit::weight_transfer_config* c, const refit::engine_context* x,          \
                            refit::weight_transfer_engine** o, char* e, std::size_t n) noexcept {            \
      return refit::plugin_detail::guarded(e, n, [&] { *o = new engine_t(*c, *x); });                        \
    };                                                                                                       \
    out->create_sender = [](const refit::weight_transfer_config* c, const refit::trainer_context* x,         \
                            refit::weight_sender** o, char* e, std::size_t n) noexcept {                     \
      return refit::plugin_detail::guarded(e, n, [&] { *o = new sender_t(*c, *x); });                        \
    };                                                                                                       \
    return 0;                                                                                                \
  }
