// The boundary between refit and a backend loaded from a shared library
// (engine_factory::register_lazy). It is a C++ ABI, not a C one: the plugin's
// creators take refit's config and context objects (std::string, std::function,
// asio executors and json members) and hand back refit's C++ engines and senders,
// which the host then calls and destroys. So both sides must be built with the
// same compiler, standard library (and its ABI flag), C++ standard and refit
// plugin ABI. Each side states what it was built with in a build stamp
// (refit_build_stamp(), expanded in the translation unit that uses it: the host's
// factory and the plugin's REFIT_DEFINE_PLUGIN), and the host refuses, at load, a
// plugin whose stamp differs, naming both. What does cross as plain C is the entry
// point's signature, its status codes and messages: exceptions never cross (the
// creators return a refit::errc value and write a message), and the library is
// loaded RTLD_LOCAL | RTLD_NODELETE so the code of objects it made stays mapped.
//
// This header is the boundary's types, which the factory (the host's side,
// engine_factory::register_lazy) and a plugin both read; a plugin defines its entry
// point with REFIT_DEFINE_PLUGIN (backend/plugin.h).
#pragma once

#include <cstddef>

#include <asio/version.hpp>

#include <refit/engine.h>
#include <refit/json.h>
#include <refit/trainer.h>

/// Bumped whenever a type that crosses the boundary changes (engine_capabilities,
/// weight_transfer_config, engine_context, trainer_context, the engine and sender
/// interfaces, refit_plugin_v2).
#define REFIT_PLUGIN_ABI_VERSION 4

#define REFIT_PLUGIN_STR2(x) #x
#define REFIT_PLUGIN_STR(x) REFIT_PLUGIN_STR2(x)

#if defined(__clang__)
#define REFIT_PLUGIN_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define REFIT_PLUGIN_COMPILER "gcc " __VERSION__
#else
#define REFIT_PLUGIN_COMPILER "unknown compiler"
#endif

#if defined(_GLIBCXX_RELEASE)
#define REFIT_PLUGIN_STDLIB \
  "libstdc++ " REFIT_PLUGIN_STR(_GLIBCXX_RELEASE) " cxx11-abi " REFIT_PLUGIN_STR(_GLIBCXX_USE_CXX11_ABI)
#elif defined(_LIBCPP_VERSION)
#define REFIT_PLUGIN_STDLIB "libc++ " REFIT_PLUGIN_STR(_LIBCPP_VERSION)
#else
#define REFIT_PLUGIN_STDLIB "unknown standard library"
#endif

/// What this translation unit was built with, as one string: refit's plugin ABI,
/// the compiler, the standard library, the C++ standard, asio and nlohmann json.
inline const char* refit_build_stamp() noexcept {
  return "refit plugin ABI " REFIT_PLUGIN_STR(REFIT_PLUGIN_ABI_VERSION) "; " REFIT_PLUGIN_COMPILER
         "; " REFIT_PLUGIN_STDLIB "; C++ " REFIT_PLUGIN_STR(__cplusplus) "; asio " REFIT_PLUGIN_STR(
             ASIO_VERSION) "; json " REFIT_PLUGIN_STR(NLOHMANN_JSON_VERSION_MAJOR) "." REFIT_PLUGIN_STR(NLOHMANN_JSON_VERSION_MINOR);
}

extern "C" {

/// What a plugin's entry point fills in. The creators return 0 on success or a
/// refit::errc value, writing a NUL-terminated message into `err` on failure.
struct refit_plugin_v2 {
  const char* build;  ///< the plugin's refit_build_stamp()
  refit::engine_capabilities capabilities;
  int (*create_engine)(const refit::weight_transfer_config* config, const refit::engine_context* context,
                       refit::weight_transfer_engine** out, char* err, std::size_t err_len);
  int (*create_sender)(const refit::weight_transfer_config* config, const refit::trainer_context* context,
                       refit::weight_sender** out, char* err, std::size_t err_len);  // may be null
};

/// The entry point's type: fills `out` (always its build stamp, so the host can say
/// what differs) and returns 0, or errc::load_failed with a message when
/// `host_build` is not its own.
typedef int (*refit_plugin_entry_fn)(const char* host_build, refit_plugin_v2* out, char* err, std::size_t err_len);
}
